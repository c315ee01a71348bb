//! Tenants' pages: their jobs (state history with reasons, the node and GPUs, every lease,
//! proofs of work, metering windows and what each cost), why a node was or would be chosen,
//! submitting and cancelling, and spend (a statement, as a chart, CSV and JSON).
//!
//! Auditors read the same pages over every tenant, read-only.

use std::sync::Arc;

use axum::Form;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use cgx_protocol::broker::{JobSpec, JobState, JobView};
use cgx_protocol::ledger::Statement;
use cgx_protocol::money::Micros;
use maud::{Markup, html};
use serde::Deserialize;

use super::super::statements::Owner;
use super::super::{Broker, BrokerError};
use super::chart::{self, Series};
use super::{
    ConsoleError, CsrfForm, PAGE, Viewer, check_id, html_response, layout, live_response, see_other,
};

/// Rows of each kind a job's page shows per lease.
const SHOWN: i64 = 50;

#[derive(Debug, Default, Deserialize)]
pub(super) struct ListQuery {
    /// The keyset cursor: `<created_at>.<id>` of the previous page's last row.
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    tenant: Option<String>,
}

fn cursor(after: Option<&str>) -> Result<Option<(i64, String)>, ConsoleError> {
    let Some(a) = after.filter(|a| !a.is_empty()) else {
        return Ok(None);
    };
    let bad = || ConsoleError::BadRequest("malformed page cursor".into());
    let (at, id) = a.split_once('.').ok_or_else(bad)?;
    check_id(id).map_err(|_| bad())?;
    Ok(Some((at.parse().map_err(|_| bad())?, id.to_string())))
}

/// Whose jobs a list shows: an auditor's choice (or every tenant), a tenant's own (one of
/// its tenants when its key has several).
fn list_tenant(v: &Viewer, wanted: Option<&str>) -> Result<Option<String>, ConsoleError> {
    let wanted = wanted.filter(|t| !t.is_empty());
    if v.is_auditor() {
        if let Some(t) = wanted {
            super::super::register::check_name(t, "tenant")?;
        }
        return Ok(wanted.map(str::to_string));
    }
    // A key acting for several tenants sees its first unless it says which (the page links
    // each).
    let first = v.tenants().first().map(|t| t.to_string());
    Ok(Some(super::super::jobs::tenant_of(
        &v.admin,
        wanted.or(first.as_deref()),
    )?))
}

/// `GET /console/jobs`.
pub(super) async fn jobs(
    State(b): State<Arc<Broker>>,
    viewer: Viewer,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Result<Response, ConsoleError> {
    let tenant = list_tenant(&viewer, q.tenant.as_deref())?;
    let after = cursor(q.after.as_deref())?;
    let rows = b
        .store
        .jobs_page(
            tenant.as_deref(),
            after.as_ref().map(|(a, i)| (*a, i.as_str())),
            PAGE as i64 + 1,
        )
        .await?;
    let more = rows.len() > PAGE;
    let mut views = Vec::with_capacity(PAGE);
    for r in rows.into_iter().take(PAGE) {
        views.push(b.job_view(r, false).await?);
    }
    let next = more
        .then(|| views.last().map(|j| format!("{}.{}", j.created_at, j.id)))
        .flatten();
    let body = html! {
        h1 { "Jobs" @if let Some(t) = &tenant { " of " (t) } }
        @if viewer.tenants().len() > 1 {
            nav.tenants aria-label="Tenants" { "Tenants: "
                @for t in viewer.tenants() { a href=(format!("/console/jobs?tenant={}", layout::urlencode(t))) { (t) } " " }
            }
        }
        @if views.is_empty() {
            p.empty { "No jobs yet." }
        } @else {
            table.list {
                caption { "Newest first; states update without a reload." }
                thead { tr {
                    th scope="col" { "Job" } th scope="col" { "Tenant" } th scope="col" { "State" }
                    th scope="col" { "GPUs" } th scope="col" { "Node" } th scope="col" { "Created" }
                    th scope="col" { "Why" }
                } }
                tbody {
                    @for j in &views {
                        tr {
                            td { a href=(format!("/console/jobs/{}", j.id)) { code { (j.id) } } }
                            td { (j.tenant) }
                            td { (layout::badge(j.state.as_str())) }
                            td { (j.spec.gpu_count) " × " (j.spec.gpu_model) }
                            td { @if let Some(n) = &j.node_id { code { (n) } } @else { "—" } }
                            td { (layout::when(j.created_at)) }
                            td.reason { (j.reason) }
                        }
                    }
                }
            }
        }
        (layout::pager(
            "/console/jobs",
            &q.tenant.as_deref().filter(|t| !t.is_empty()).map(|t| ("tenant", t)).into_iter().collect::<Vec<_>>(),
            next.as_deref(),
        ))
        @if viewer.is_tenant() {
            (submit_form(&viewer))
        }
    };
    Ok(live_response(
        &headers,
        layout::page("Jobs", Some(&viewer), true, body),
    ))
}

fn submit_form(v: &Viewer) -> Markup {
    let tenants = v.tenants();
    html! {
        section aria-labelledby="submit-h" {
            h2 id="submit-h" { "Submit a job" }
            form.submit method="post" action="/console/jobs" {
                input type="hidden" name="csrf" value=(v.csrf);
                @if tenants.len() > 1 {
                    label for="f-tenant" { "Tenant" }
                    select id="f-tenant" name="tenant" {
                        @for t in &tenants { option value=(t) { (t) } }
                    }
                }
                label for="f-model" { "GPU model" }
                input id="f-model" name="gpu_model" value="H100" required maxlength="64";
                label for="f-count" { "GPUs" }
                input id="f-count" name="gpu_count" type="number" min="1" max="64" value="1" required;
                label for="f-price" { "Most per GPU-hour" }
                input id="f-price" name="max_price" value="3" required inputmode="decimal";
                label for="f-duration" { "Duration (seconds)" }
                input id="f-duration" name="duration_secs" type="number" min="1" value="3600" required;
                label for="f-budget" { "Budget" }
                input id="f-budget" name="budget" value="3" required inputmode="decimal";
                label for="f-regions" { "Regions (comma-separated, in order of preference)" }
                input id="f-regions" name="regions";
                label for="f-resources" { "KBS resources (repo/type/tag, comma-separated)" }
                input id="f-resources" name="resources";
                label for="f-command" { "Workload command (absolute path; empty: hold the VM)" }
                input id="f-command" name="command";
                label for="f-args" { "Arguments (one per line)" }
                textarea id="f-args" name="args" rows="3" {}
                label for="f-policy" { "Placement policy (Rego, package placement)" }
                textarea id="f-policy" name="placement_policy" rows="4" spellcheck="false" {}
                button type="submit" { "Submit" }
            }
        }
    }
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct SubmitForm {
    csrf: String,
    #[serde(default)]
    tenant: String,
    gpu_model: String,
    gpu_count: String,
    max_price: String,
    duration_secs: String,
    budget: String,
    #[serde(default)]
    regions: String,
    #[serde(default)]
    resources: String,
    #[serde(default)]
    command: String,
    #[serde(default)]
    args: String,
    #[serde(default)]
    placement_policy: String,
}

fn list(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(str::to_string)
        .collect()
}

impl SubmitForm {
    /// The form as the API's job spec; what the API checks, it checks again.
    fn spec(&self) -> Result<JobSpec, ConsoleError> {
        let bad = |what: &str| ConsoleError::BadRequest(format!("{what} is not valid"));
        let money = |s: &str, what: &str| Micros::parse_decimal(s.trim()).map_err(|_| bad(what));
        let workload = if self.command.trim().is_empty() {
            None
        } else {
            Some(serde_json::json!({
                "command": self.command.trim(),
                "args": self.args.lines().map(str::trim_end).filter(|a| !a.is_empty()).collect::<Vec<_>>(),
            }))
        };
        let policy = self.placement_policy.trim();
        let v = serde_json::json!({
            "tenant": (!self.tenant.is_empty()).then_some(&self.tenant),
            "gpu_model": self.gpu_model.trim(),
            "gpu_count": self.gpu_count.trim().parse::<u32>().map_err(|_| bad("the GPU count"))?,
            "max_price_per_gpu_hour_micros": money(&self.max_price, "the price")?.0,
            "duration_secs": self.duration_secs.trim().parse::<u64>().map_err(|_| bad("the duration"))?,
            "budget_micros": money(&self.budget, "the budget")?.0,
            "regions": list(&self.regions),
            "resources": list(&self.resources),
            "placement_policy": (!policy.is_empty()).then_some(policy),
            "workload": workload,
        });
        serde_json::from_value(v).map_err(|e| ConsoleError::BadRequest(format!("job: {e}")))
    }
}

/// `POST /console/jobs`: the API's submission, as this tenant.
pub(super) async fn submit(
    State(b): State<Arc<Broker>>,
    viewer: Viewer,
    headers: HeaderMap,
    Form(form): Form<SubmitForm>,
) -> Result<Response, ConsoleError> {
    viewer.check_change(&b, &headers, &form.csrf)?;
    let spec = form.spec()?;
    let job = b.submit(&viewer.admin, spec).await?;
    Ok(see_other(&format!("/console/jobs/{}", job.id)))
}

/// `POST /console/jobs/{id}/cancel`.
pub(super) async fn cancel(
    State(b): State<Arc<Broker>>,
    viewer: Viewer,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(form): Form<CsrfForm>,
) -> Result<Response, ConsoleError> {
    check_id(&id)?;
    viewer.check_change(&b, &headers, &form.csrf)?;
    b.cancel(&viewer.admin, &id).await?;
    Ok(see_other(&format!("/console/jobs/{id}")))
}

/// `GET /console/jobs/{id}`.
pub(super) async fn job(
    State(b): State<Arc<Broker>>,
    viewer: Viewer,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ConsoleError> {
    check_id(&id)?;
    let j = b.job_for(&viewer.admin, &id).await?;
    let leases = b.store.leases_of_job(&id).await?;
    let mut lease_parts = Vec::with_capacity(leases.len());
    // Each lease's newest proofs and windows (a 30-day lease has tens of thousands: the page
    // shows the newest; the statement has them all), and its spend summed into at most a few
    // hundred buckets.
    let bucket = i64::try_from(j.spec.duration_secs / 300)
        .unwrap_or(i64::MAX)
        .max(60);
    let mut points: Vec<(i64, u64)> = Vec::new();
    for l in &leases {
        let proofs = b.store.pow_recent(&l.id, SHOWN).await?;
        let windows = b.store.windows_recent(&l.id, SHOWN).await?;
        let metered = b.store.metering_count(&l.id).await?;
        let releases = releases_of(&b, &l.id).await?;
        points.extend(b.store.paid_by_bucket(&l.id, bucket).await?);
        lease_parts.push((l, proofs, windows, metered, releases));
    }
    // Spend against the budget, cumulative.
    let mut spend = Series {
        label: "Paid so far".into(),
        unit: "micros",
        limit: Some(("budget".into(), j.spec.budget_micros.0 as f64)),
        ..Series::default()
    };
    let mut paid = 0u64;
    points.sort_unstable();
    for (at, amount) in points {
        paid = paid.saturating_add(amount);
        spend.points.push((at, paid as f64));
    }
    let can_cancel = !j.state.is_final()
        && viewer
            .admin
            .may(Some(&format!("tenant:{}", j.tenant)))
            .is_ok();
    let body = html! {
        h1 { "Job " code { (j.id) } }
        (job_facts(&j))
        @if can_cancel {
            form.inline method="post" action=(format!("/console/jobs/{}/cancel", j.id)) {
                input type="hidden" name="csrf" value=(viewer.csrf);
                button.danger type="submit" { "Cancel this job" }
            }
        }
        p { a href=(format!("/console/jobs/{}/why", j.id)) { "Why this node — and why not others" } }
        h2 { "State history" }
        table.list {
            thead { tr { th scope="col" { "When" } th scope="col" { "From" } th scope="col" { "To" } th scope="col" { "Reason" } } }
            tbody {
                @for e in &j.events {
                    tr {
                        td { (layout::when(e.at)) }
                        td { @if let Some(f) = e.from { (layout::badge(f.as_str())) } @else { "—" } }
                        td { (layout::badge(e.to.as_str())) }
                        td.reason { (e.reason) }
                    }
                }
            }
        }
        h2 { "Spend" }
        (chart::line("Paid for this job against its budget", &spend))
        h2 { "Leases" }
        @if lease_parts.is_empty() { p.empty { "No lease yet." } }
        @for (l, proofs, windows, metered, releases) in &lease_parts {
            section.lease aria-label=(format!("Lease {}", l.id)) {
                h3 { "Lease " code { (l.id) } }
                (layout::facts(&[
                    ("Node", html! { a href=(format!("/console/nodes/{}", l.node_id)) { code { (l.node_id) } } }),
                    ("GPUs", html! { (l.gpus.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")) }),
                    ("Started", layout::when(l.started_at)),
                    ("Ends", layout::when(l.ends_at)),
                    ("Ended", match l.ended_at { Some(t) => html! { (layout::when(t)) " — " (l.end_reason) }, None => html! { (layout::badge("running")) } }),
                    ("Metering records accepted", html! { (metered) }),
                ]))
                h4 { "Key releases" }
                @if releases.is_empty() {
                    p.empty { "None the KBS's log shows (yet): the broker mirrors it where it holds a reader key." }
                } @else {
                    table.list {
                        caption { "From the KBS's own log, mirrored and checked against its signed checkpoints" }
                        thead { tr { th scope="col" { "When" } th scope="col" { "Outcome" } th scope="col" { "Resource" } th scope="col" { "To TEE key" } th scope="col" { "Leaf" } th scope="col" { "Reason" } } }
                        tbody { @for r in releases { tr {
                            td { (layout::when(r.at)) }
                            td { (layout::badge(if r.action == "release" { "released" } else { "refused" })) }
                            td { code { (r.resource) } } td { code.wrap { (r.tee_key) } }
                            td { (r.origin) " #" (r.idx) } td.reason { (r.reason) }
                        } } }
                    }
                }
                h4 { "Proofs of work" @if proofs.len() as i64 == SHOWN { " (the newest " (SHOWN) ")" } }
                @if proofs.is_empty() { p.empty { "None issued." } } @else {
                    table.list {
                        thead { tr { th scope="col" { "Challenge" } th scope="col" { "GPU" } th scope="col" { "Window" } th scope="col" { "State" } th scope="col" { "Reason" } } }
                        tbody { @for p in proofs { tr {
                            td { code { (p.id) } } td { (p.gpu) } td { (p.window) }
                            td { (layout::badge(&p.state)) } td.reason { (p.reason) }
                        } } }
                    }
                }
                h4 { "Windows" @if windows.len() as i64 == SHOWN { " (the newest " (SHOWN) "; the statement has every one)" } }
                @if windows.is_empty() { p.empty { "None settled." } } @else {
                    table.list {
                        thead { tr { th scope="col" { "Window" } th scope="col" { "Outcome" } th scope="col" { "Amount" } th scope="col" { "Settled" } th scope="col" { "Reason" } } }
                        tbody { @for w in windows { tr {
                            td { (w.window) } td { (layout::badge(&w.outcome)) }
                            td.num { (layout::money(w.amount)) } td { (layout::when(w.at)) }
                            td.reason { (w.reason) }
                        } } }
                    }
                }
            }
        }
    };
    Ok(live_response(
        &headers,
        layout::page(&format!("Job {}", j.id), Some(&viewer), true, body),
    ))
}

/// The KBS's releases through `lease` and its refusals of the lease's tokens (those the log
/// recorded — `lease.open`, `lease.renew` — and the one the lease row holds now).
async fn releases_of(
    b: &Broker,
    lease: &str,
) -> Result<Vec<super::super::store::MirroredRelease>, ConsoleError> {
    let mut tokens: Vec<String> = b
        .store
        .audit_page(Some(lease), None, 200)
        .await?
        .into_iter()
        .filter(|e| e.action == "lease.open" || e.action == "lease.renew")
        .filter_map(|e| e.detail["token_sha256"].as_str().map(str::to_string))
        .collect();
    if let Some((row, _)) = b.store.lease_any(lease).await? {
        tokens.push(hex::encode(
            aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, row.token.as_bytes()).as_ref(),
        ));
    }
    tokens.sort_unstable();
    tokens.dedup();
    Ok(b.store.releases_of_lease(lease, &tokens).await?)
}

fn job_facts(j: &JobView) -> Markup {
    let s = &j.spec;
    layout::facts(&[
        (
            "State",
            html! { (layout::badge(j.state.as_str())) " " span.reason { (j.reason) } },
        ),
        ("Tenant", html! { (j.tenant) }),
        (
            "GPUs",
            html! { (s.gpu_count) " × " (s.gpu_model) @if s.min_gpu_memory_gib > 0 { ", ≥ " (s.min_gpu_memory_gib) " GiB" } },
        ),
        (
            "Node",
            match &j.node_id {
                Some(n) => html! { a href=(format!("/console/nodes/{n}")) { code { (n) } }
                @if !j.gpus.is_empty() { " GPUs " (j.gpus.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")) } },
                None => html! { "—" },
            },
        ),
        (
            "Regions",
            html! { @if s.regions.is_empty() { "any" } @else { (s.regions.join(", ")) } },
        ),
        (
            "Most per GPU-hour",
            html! { (s.max_price_per_gpu_hour_micros) },
        ),
        ("Budget", html! { (s.budget_micros) }),
        (
            "Duration",
            html! { (layout::span(i64::try_from(s.duration_secs).unwrap_or(i64::MAX))) },
        ),
        (
            "Resources",
            html! { @for r in &s.resources { code { (r) } " " } },
        ),
        (
            "Workload",
            match &s.workload {
                Some(w) => html! { code { (w.command) } @for a in &w.args { " " code { (a) } } },
                None => html! { "none (the tenant holds the VM)" },
            },
        ),
        (
            "Placement policy",
            match &s.placement_policy {
                Some(p) => html! { pre.policy { (p) } },
                None => html! { "none" },
            },
        ),
        ("Created", layout::when(j.created_at)),
        ("Updated", layout::when(j.updated_at)),
    ])
}

/// `GET /console/jobs/{id}/why`: the nodes this job would be offered now, ranked as placement
/// ranks them, and why every other node would not get it (the API's quote: nothing placed).
pub(super) async fn why(
    State(b): State<Arc<Broker>>,
    viewer: Viewer,
    Path(id): Path<String>,
) -> Result<Response, ConsoleError> {
    check_id(&id)?;
    let j = b.job_for(&viewer.admin, &id).await?;
    let placed = j
        .events
        .iter()
        .filter(|e| e.to == JobState::Placed)
        .map(|e| e.reason.clone())
        .collect::<Vec<_>>();
    // A quote runs the tenant's own policy: only the tenant asks for one.
    let quote = if viewer
        .admin
        .may(Some(&format!("tenant:{}", j.tenant)))
        .is_ok()
    {
        let mut spec = j.spec.clone();
        spec.tenant = Some(j.tenant.clone());
        spec.offer = None;
        Some(b.quote(&viewer.admin, spec).await)
    } else {
        None
    };
    let body = html! {
        h1 { "Why job " code { (j.id) } " runs where it does" }
        h2 { "Placement" }
        @if placed.is_empty() { p { "Not placed yet: " span.reason { (j.reason) } } }
        ul { @for r in &placed { li.reason { (r) } } }
        p { "Placement ranks nodes that pass attestation, freshness, the job's filters and its "
            "policy by price, then reputation, then the job's region order, then id." }
        h2 { "If it were placed now" }
        @match &quote {
            None => p { "Only the job's tenant can run its placement policy for a quote." },
            Some(Err(e)) => p.error { (cgx_service::error::detail(e)) },
            Some(Ok(q)) => {
                table.list {
                    caption { "Offers, best first" }
                    thead { tr { th scope="col" { "Rank" } th scope="col" { "Node" } th scope="col" { "Region" } th scope="col" { "Per GPU-hour" } th scope="col" { "Reputation" } } }
                    tbody { @for o in &q.offers { tr {
                        td { (o.rank) } td { a href=(format!("/console/nodes/{}", o.node)) { code { (o.node) } } }
                        td { (o.region) } td.num { (o.price_per_gpu_hour) } td.num { (o.reputation) }
                    } } }
                }
                table.list {
                    caption { "Nodes that would not get it, and why" }
                    thead { tr { th scope="col" { "Node" } th scope="col" { "Code" } th scope="col" { "Reason" } } }
                    tbody { @for x in &q.excluded { tr {
                        td { code { (x.node) } } td { code { (x.code) } } td.reason { (x.reason) }
                    } } }
                }
                @if q.excluded_more > 0 { p { "…and " (q.excluded_more) " more." } }
            }
        }
        p { a href=(format!("/console/jobs/{}", j.id)) { "Back to the job" } }
    };
    Ok(html_response(layout::page(
        "Why this node",
        Some(&viewer),
        false,
        body,
    )))
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct StatementQuery {
    #[serde(default)]
    tenant: Option<String>,
    #[serde(default)]
    operator: Option<String>,
    /// `csv` or `json`; else the page.
    #[serde(default)]
    format: Option<String>,
}

/// `GET /console/statement`: a tenant's spend or an operator's earnings (the API's
/// statement), as a page with a chart, or CSV or JSON to download.
pub(super) async fn statement(
    State(b): State<Arc<Broker>>,
    viewer: Viewer,
    Query(q): Query<StatementQuery>,
) -> Result<Response, ConsoleError> {
    let owner = match (
        q.tenant.filter(|t| !t.is_empty()),
        q.operator.filter(|o| !o.is_empty()),
    ) {
        (Some(t), None) => Owner::Tenant(t),
        (None, Some(o)) => Owner::Operator(o),
        (None, None) => match (viewer.tenants().first(), viewer.operators().first()) {
            (Some(t), _) => Owner::Tenant((*t).to_string()),
            (None, Some(o)) => Owner::Operator((*o).to_string()),
            _ => {
                return Err(ConsoleError::BadRequest(
                    "say whose statement: ?tenant= or ?operator=".into(),
                ));
            }
        },
        _ => {
            return Err(ConsoleError::BadRequest(
                "say whose statement: tenant or operator (one)".into(),
            ));
        }
    };
    let st = b.statement(&viewer.admin, owner, None, None).await?;
    match q.format.as_deref() {
        Some("json") => Ok((
            [
                (header::CONTENT_TYPE, "application/json"),
                (
                    header::CONTENT_DISPOSITION,
                    "attachment; filename=\"statement.json\"",
                ),
            ],
            serde_json::to_vec_pretty(&st)
                .map_err(|e| BrokerError::Internal(format!("statement: {e}")))?,
        )
            .into_response()),
        Some("csv") => Ok((
            [
                (header::CONTENT_TYPE, "text/csv; charset=utf-8"),
                (
                    header::CONTENT_DISPOSITION,
                    "attachment; filename=\"statement.csv\"",
                ),
            ],
            csv(&st),
        )
            .into_response()),
        Some(_) => Err(ConsoleError::BadRequest("format is csv or json".into())),
        None => Ok(html_response(layout::page(
            "Statement",
            Some(&viewer),
            false,
            statement_page(&st),
        ))),
    }
}

fn statement_page(st: &Statement) -> Markup {
    let tenant = st.owner.starts_with("tenant:");
    // A tenant's spend is what left its balance; an operator's earnings what came in.
    let mut series = Series {
        label: if tenant { "Spent" } else { "Earned" }.into(),
        unit: "micros",
        ..Series::default()
    };
    let mut total = 0u64;
    let mut funds = 0u64;
    for l in &st.lines {
        if l.cause == "deposit" || l.cause == "stake" {
            funds = funds.saturating_add(l.credit.0);
            continue;
        }
        let amount = if tenant { l.debit.0 } else { l.credit.0 };
        if amount > 0 {
            total = total.saturating_add(amount);
            series.points.push((l.at, total as f64));
        }
    }
    if tenant && funds > 0 {
        series.limit = Some(("deposited".into(), funds as f64));
    }
    let q = st.owner.replacen(':', "=", 1);
    html! {
        h1 { "Statement of " (st.owner) }
        p { "Reconciled: " (layout::badge(if st.reconciled { "passed" } else { "failed" })) " · "
            a href=(format!("/console/statement?{}&format=csv", q)) download { "CSV" } " · "
            a href=(format!("/console/statement?{}&format=json", q)) download { "JSON" } }
        (chart::line(if tenant { "Spend against deposits" } else { "Earnings" }, &series))
        h2 { "Accounts" }
        table.list {
            thead { tr { th scope="col" { "Account" } th scope="col" { "Opening" } th scope="col" { "Credits" } th scope="col" { "Debits" } th scope="col" { "Closing" } th scope="col" { "Held" } } }
            tbody { @for a in &st.accounts { tr {
                td { code { (a.account) } } td.num { (a.opening_posted) } td.num { (a.credits_posted) }
                td.num { (a.debits_posted) } td.num { (a.closing_posted) } td.num { (a.closing_held) }
            } } }
        }
        h2 { "Leases" }
        table.list {
            thead { tr { th scope="col" { "Lease" } th scope="col" { "Job" } th scope="col" { "Node" } th scope="col" { "Paid" } th scope="col" { "Refunded" } th scope="col" { "Held" } th scope="col" { "State" } } }
            tbody { @for l in &st.leases { tr {
                td { code { (l.lease) } } td { a href=(format!("/console/jobs/{}", l.job)) { code { (l.job) } } }
                td { code { (l.node) } } td.num { (l.paid) } td.num { (l.refunded) } td.num { (l.held) }
                td { (layout::badge(&l.state)) }
            } } }
        }
        h2 { "Lines" }
        table.list {
            thead { tr { th scope="col" { "#" } th scope="col" { "When" } th scope="col" { "Cause" } th scope="col" { "Counterparty" } th scope="col" { "Credit" } th scope="col" { "Debit" } th scope="col" { "Balance" } } }
            tbody { @for l in st.lines.iter().rev().take(500) { tr {
                td { (l.seq) } td { (layout::when(l.at)) } td { (l.cause) } td { code { (l.counterparty) } }
                td.num { (l.credit) } td.num { (l.debit) } td.num { (l.balance) }
            } } }
        }
    }
}

/// A CSV cell: quoted when it must be, and a leading `= + - @` (a spreadsheet formula)
/// made inert with `'`.
fn cell(s: &str) -> String {
    let s = if s.starts_with(['=', '+', '-', '@', '\t', '\r']) {
        format!("'{s}")
    } else {
        s.to_string()
    };
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s
    }
}

/// The statement's lines as CSV (amounts in micros).
pub(super) fn csv(st: &Statement) -> String {
    let mut out = String::from(
        "seq,transfer,at,account,counterparty,phase,cause,reference,lease,window,credit,debit,held_added,held_released,balance\n",
    );
    for l in &st.lines {
        let row = [
            l.seq.to_string(),
            l.transfer.clone(),
            l.at.to_string(),
            l.account.clone(),
            l.counterparty.clone(),
            l.phase.clone(),
            l.cause.clone(),
            l.reference.clone(),
            l.lease.clone().unwrap_or_default(),
            l.window.map(|w| w.to_string()).unwrap_or_default(),
            l.credit.0.to_string(),
            l.debit.0.to_string(),
            l.held_added.0.to_string(),
            l.held_released.0.to_string(),
            l.balance.0.to_string(),
        ];
        out.push_str(&row.iter().map(|c| cell(c)).collect::<Vec<_>>().join(","));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::cell;

    #[test]
    fn csv_cells_are_quoted_and_formulas_inert() {
        assert_eq!(cell("plain"), "plain");
        assert_eq!(cell("=HYPERLINK(\"x\")"), "\"'=HYPERLINK(\"\"x\"\")\"");
        assert_eq!(cell("+1"), "'+1");
        assert_eq!(cell("a,b"), "\"a,b\"");
        assert_eq!(cell("@SUM(A1)"), "'@SUM(A1)");
    }
}
