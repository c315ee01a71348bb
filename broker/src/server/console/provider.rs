//! Providers' pages: their nodes with attestation status, the appraisal's claims and reasons,
//! time to the next re-attestation, why a node is not placeable, proofs of work and their
//! pass rate, reputation; earnings are the statement page's. Auditors read every node.

use std::sync::Arc;

use axum::Form;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::Response;
use cgx_protocol::broker::NodeView;
use maud::html;
use serde::Deserialize;

use super::super::Broker;
use super::chart::{self, Series};
use super::{ConsoleError, CsrfForm, PAGE, Viewer, check_id, layout, live_response, see_other};

#[derive(Debug, Default, Deserialize)]
pub(super) struct ListQuery {
    #[serde(default)]
    after: Option<String>,
}

/// `GET /console/nodes`: a page of the nodes this viewer may see, by id.
pub(super) async fn nodes(
    State(b): State<Arc<Broker>>,
    viewer: Viewer,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Result<Response, ConsoleError> {
    let after = q.after.filter(|a| !a.is_empty());
    if let Some(a) = &after {
        check_id(a)?;
    }
    let all = viewer.is_auditor();
    let operators: Vec<String> = viewer.operators().iter().map(|o| o.to_string()).collect();
    let (views, next) = b.nodes_page(after.as_deref(), PAGE, |operator| {
        all || operators.iter().any(|o| o == operator)
    });
    let body = html! {
        h1 { "Nodes" }
        @if views.is_empty() {
            p.empty { "No nodes." }
        } @else {
            table.list {
                caption { "By id; states update without a reload." }
                thead { tr {
                    th scope="col" { "Node" } th scope="col" { "Operator" } th scope="col" { "Region" }
                    th scope="col" { "GPUs (free)" } th scope="col" { "Attestation" }
                    th scope="col" { "Placeable" } th scope="col" { "Re-attestation due" }
                    th scope="col" { "Reputation" } th scope="col" { "Per GPU-hour" }
                } }
                tbody {
                    @for n in &views {
                        tr {
                            td { a href=(format!("/console/nodes/{}", n.id)) { code { (n.id) } } }
                            td { (n.operator) }
                            td { (n.region) }
                            td { (n.gpu_count) " × " (n.gpu_model) " (" (n.free_gpus) ")" }
                            td { (layout::badge(n.status.as_str())) @if n.sim { " " span.note { "simulated" } } }
                            td { @if n.placeable { (layout::badge("placeable")) } @else { span.reason { (n.reason) } } }
                            td { (layout::when(n.fresh_until)) }
                            td.num { (n.reputation) }
                            td.num { (n.price_per_gpu_hour_micros) }
                        }
                    }
                }
            }
        }
        (layout::pager("/console/nodes", &[], next.as_deref()))
    };
    Ok(live_response(
        &headers,
        layout::page("Nodes", Some(&viewer), true, body),
    ))
}

/// `GET /console/nodes/{id}`.
pub(super) async fn node(
    State(b): State<Arc<Broker>>,
    viewer: Viewer,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, ConsoleError> {
    check_id(&id)?;
    let n = b.node_show(&viewer.admin, &id).await?;
    let now = b.clock.unix();
    let judged = n
        .proofs
        .iter()
        .filter(|p| matches!(p.state.as_str(), "passed" | "failed" | "missed"))
        .count();
    let passed = n.proofs.iter().filter(|p| p.state == "passed").count();
    let claims = n
        .claims
        .as_ref()
        .and_then(|c| serde_json::to_string_pretty(c).ok())
        .unwrap_or_default();
    let (gpus, unverified) = utilization(&b, &n.id, now).await?;
    let may_ask = viewer.is_auditor()
        || viewer
            .admin
            .may(Some(&format!("operator:{}", n.operator)))
            .is_ok();
    let body = html! {
        h1 { "Node " code { (n.id) } }
        (facts(&n))
        @if may_ask && !n.reattest_asked {
            form.inline method="post" action=(format!("/console/nodes/{}/reattest", n.id)) {
                input type="hidden" name="csrf" value=(viewer.csrf);
                button type="submit" { "Ask it to re-attest now" }
            }
        }
        h2 { "Appraisal" }
        @if n.violations.is_empty() {
            p { "No violations: every rule of the appraisal policy passed." }
        } @else {
            ul.violations { @for v in &n.violations { li.reason { (v) } } }
        }
        h2 { "Proofs of work" }
        p { "Latest " (n.proofs.len()) "; passed " (passed) " of " (judged) " judged"
            @if judged > 0 { " (" (format!("{:.0}", passed as f64 * 100.0 / judged as f64)) " %)" } "." }
        @if !n.proofs.is_empty() {
            table.list {
                thead { tr { th scope="col" { "Challenge" } th scope="col" { "Lease" } th scope="col" { "GPU" } th scope="col" { "n" } th scope="col" { "State" } th scope="col" { "Device time" } th scope="col" { "Reason" } } }
                tbody { @for p in &n.proofs { tr {
                    td { code { (p.challenge) } } td { code { (p.lease) } } td { (p.gpu) } td { (p.n) }
                    td { (layout::badge(&p.state)) }
                    td.num { @if let Some(us) = p.gpu_us { (format!("{:.1} ms", us as f64 / 1000.0)) } @else { "—" } }
                    td.reason { (p.reason) }
                } } }
            }
        }
        h2 { "GPU utilization" }
        (chart::lines("Utilization per GPU over the last six hours, from the node's signed metering records", &gpus))
        @if unverified > 0 {
            p.error { (unverified) " records did not verify under the node's attested key and are not shown." }
        }
        h2 { "Claims" }
        details {
            summary { "The appraisal's claims (what the evidence established)" }
            pre.claims { (claims) }
        }
        p { a href=(format!("/console/statement?operator={}", n.operator)) { "Earnings of " (n.operator) } }
    };
    Ok(live_response(
        &headers,
        layout::page(&format!("Node {}", n.id), Some(&viewer), true, body),
    ))
}

fn facts(n: &NodeView) -> maud::Markup {
    layout::facts(&[
        ("Operator", html! { (n.operator) }),
        (
            "Attestation",
            html! { (layout::badge(n.status.as_str())) " " (n.tee.as_str())
            @if n.sim { " (simulated TEE)" } },
        ),
        (
            "Placeable",
            html! { @if n.placeable { (layout::badge("placeable")) } @else { span.reason { (n.reason) } } },
        ),
        ("Attested", layout::when(n.attested_at)),
        (
            "Re-attestation due",
            // Absolute times only: a live page whose text changed every second would never
            // be answered 304.
            html! { (layout::when(n.fresh_until))
            @if n.reattest_asked { " — asked to re-attest now" } },
        ),
        ("Last heartbeat", layout::when(n.last_heartbeat)),
        ("Region", html! { (n.region) }),
        (
            "GPUs",
            html! { (n.gpu_count) " × " (n.gpu_model) " (" (n.gpu_chip) ", " (n.gpu_memory_gib) " GiB), " (n.free_gpus) " free" },
        ),
        ("Per GPU-hour", html! { (n.price_per_gpu_hour_micros) }),
        ("Reputation", html! { (n.reputation) }),
    ])
}

/// `POST /console/nodes/{id}/reattest`.
pub(super) async fn reattest(
    State(b): State<Arc<Broker>>,
    viewer: Viewer,
    headers: HeaderMap,
    Path(id): Path<String>,
    Form(form): Form<CsrfForm>,
) -> Result<Response, ConsoleError> {
    check_id(&id)?;
    viewer.check_change(&b, &headers, &form.csrf)?;
    b.ask_reattest(&viewer.admin, &id).await?;
    Ok(see_other(&format!("/console/nodes/{id}")))
}

/// Per-GPU utilization from the node's metering records of the last six hours (the newest
/// [`CHARTED`]), each verified under the node's attested key (a row proves nothing by itself;
/// each verified once, then remembered by its digest with the key's); and how many did not
/// verify.
async fn utilization(
    b: &Broker,
    node: &str,
    now: i64,
) -> Result<(Vec<Series>, usize), ConsoleError> {
    use cgx_protocol::metering::MeteringRecord;
    use cgx_protocol::signed::{When, verify};
    // A record without a readable key has no records to chart (none could verify).
    let Ok((_, key)) = b.node_key(node) else {
        return Ok((Vec::new(), 0));
    };
    let tokens = b
        .store
        .metering_of_node(node, now - 6 * 3600, CHARTED)
        .await?;
    let mut per_gpu: std::collections::BTreeMap<u32, Vec<(i64, f64)>> = Default::default();
    let mut unverified = 0;
    for t in &tokens {
        let mut ctx = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
        ctx.update(&key);
        ctx.update(t.as_bytes());
        let mut id = [0u8; 32];
        id.copy_from_slice(ctx.finish().as_ref());
        let known = b
            .metering_verified
            .lock()
            .ok()
            .and_then(|m| m.get(&id).cloned());
        let usage = match known {
            Some(u) => u,
            None => {
                let u = match verify::<MeteringRecord>(t, &[key], When::Any) {
                    Ok(v) if v.body.sub == node => v
                        .body
                        .window_start
                        .checked_add(i64::from(v.body.window_secs))
                        .map(|at| {
                            (
                                at,
                                v.body
                                    .gpus
                                    .iter()
                                    .map(|g| (g.index, g.utilization_pct.min(100)))
                                    .collect(),
                            )
                        }),
                    _ => None,
                };
                if let Ok(mut m) = b.metering_verified.lock() {
                    if m.len() >= 200_000 {
                        m.clear();
                    }
                    m.insert(id, u.clone());
                }
                u
            }
        };
        match usage {
            Some((at, gpus)) => {
                for (gpu, pct) in gpus {
                    per_gpu.entry(gpu).or_default().push((at, f64::from(pct)));
                }
            }
            None => unverified += 1,
        }
    }
    let series = per_gpu
        .into_iter()
        .take(64)
        .enumerate()
        .map(|(i, (gpu, mut points))| {
            points.sort_unstable_by_key(|p| p.0);
            Series {
                label: format!("GPU {gpu}"),
                points,
                // The scale's top: 100 %.
                limit: (i == 0).then(|| ("100 %".to_string(), 100.0)),
                unit: " %",
            }
        })
        .collect();
    Ok((series, unverified))
}

/// Metering records charted on a node's page, at most (six hours of one-minute windows of a
/// few leases).
const CHARTED: i64 = 1024;
