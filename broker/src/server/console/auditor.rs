//! Auditors' page: the log's newest published checkpoint with its cosignatures, its verifier
//! key, the audited decisions newest first with a search by event, node, lease or job (a
//! leaf's subject or action), and the commands that check all of it offline with nothing of
//! the broker's but its files.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::Response;
use maud::html;
use serde::Deserialize;

use super::super::{Broker, BrokerError};
use super::{ConsoleError, PAGE, Viewer, layout, live_response};

#[derive(Debug, Default, Deserialize)]
pub(super) struct LogQuery {
    /// A subject (node, lease, job, resource id) or an action (`lease.open`, …).
    #[serde(default)]
    q: Option<String>,
    /// Events before this `seq`.
    #[serde(default)]
    before: Option<i64>,
}

/// A checkpoint note read for display: origin, size, root, and each signature line's name.
struct Checkpoint {
    origin: String,
    size: String,
    root: String,
    signers: Vec<String>,
}

fn parse_checkpoint(note: &[u8]) -> Option<Checkpoint> {
    let text = std::str::from_utf8(note).ok()?;
    let (body, sigs) = text.split_once("\n\n")?;
    let mut lines = body.lines();
    Some(Checkpoint {
        origin: lines.next()?.to_string(),
        size: lines.next()?.to_string(),
        root: lines.next()?.to_string(),
        signers: sigs
            .lines()
            .filter_map(|l| l.strip_prefix("— "))
            .filter_map(|l| l.split_once(' ').map(|(name, _)| name.to_string()))
            .collect(),
    })
}

/// `GET /console/log` (auditors).
pub(super) async fn log(
    State(b): State<Arc<Broker>>,
    viewer: Viewer,
    headers: HeaderMap,
    Query(q): Query<LogQuery>,
) -> Result<Response, ConsoleError> {
    if !viewer.is_auditor() {
        return Err(BrokerError::Forbidden("the log's pages are for auditors".into()).into());
    }
    let term = q.q.as_deref().map(str::trim).filter(|t| !t.is_empty());
    if term.is_some_and(|t| t.len() > 256) {
        return Err(ConsoleError::BadRequest("the search is too long".into()));
    }
    let checkpoint = match b.log_checkpoint().await {
        Ok(note) => Some(note),
        Err(BrokerError::NotFound(_)) => None,
        Err(e) => return Err(e.into()),
    };
    let parsed = checkpoint.as_deref().and_then(parse_checkpoint);
    let vkey = b.log.as_ref().map(|l| l.key().vkey());
    // A job's decisions are its leases' leaves (a lease names its job in its detail): a job
    // id searches for the job and each of its leases.
    let mut terms: Vec<String> = term.map(|t| vec![t.to_string()]).unwrap_or_default();
    if let Some(t) = term
        && super::check_id(t).is_ok()
        && b.store.job(t).await?.is_some()
    {
        terms.extend(b.store.leases_of_job(t).await?.into_iter().map(|l| l.id));
    }
    let mut events = Vec::new();
    if terms.is_empty() {
        events = b.store.audit_page(None, q.before, PAGE as i64 + 1).await?;
    } else {
        for t in &terms {
            events.extend(
                b.store
                    .audit_page(Some(t), q.before, PAGE as i64 + 1)
                    .await?,
            );
        }
        events.sort_unstable_by_key(|e| std::cmp::Reverse(e.seq));
        events.dedup_by_key(|e| e.seq);
        events.truncate(PAGE + 1);
    }
    let more = events.len() > PAGE;
    let next = more.then(|| events.get(PAGE - 1).map(|e| e.seq)).flatten();
    let broker_url = super::origin(&b, &headers);
    let body = html! {
        h1 { "Transparency log" }
        @match (&parsed, &checkpoint) {
            (Some(c), _) => {
                (layout::facts(&[
                    ("Origin", html! { code { (c.origin) } }),
                    ("Size", html! { (c.size) " leaves" }),
                    ("Root", html! { code { (c.root) } }),
                    ("Signed by", html! { @for s in &c.signers { code { (s) } " " } }),
                    ("Log key", html! { @if let Some(k) = &vkey { code.wrap { (k) } } }),
                ]))
                details {
                    summary { "The checkpoint as served" }
                    pre.note { (String::from_utf8_lossy(checkpoint.as_deref().unwrap_or_default())) }
                }
            }
            (None, Some(_)) => p.error { "The published checkpoint does not parse." },
            (None, None) => p.empty { "No checkpoint published yet (or this broker keeps no log)." },
        }
        h2 { "Check it offline" }
        p { "With an auditor's key and the log's verifier key, nothing else of the broker's:" }
        pre.command { code {
            "cgx audit fetch --broker " (broker_url) " --key AUDITOR.pk8 --out log --archive archive\n"
            "cgx audit verify --log log --log-key LOG.vkey --archive archive --reappraise --state audit.state"
        } }
        h2 { "Decisions" }
        form.search method="get" action="/console/log" role="search" {
            label for="q" { "Event, node, lease or job" }
            input id="q" name="q" value=[term] maxlength="256" placeholder="lease.open, n…, l…, j…";
            button type="submit" { "Search" }
        }
        @if events.is_empty() { p.empty { "No events." } } @else {
            table.list {
                thead { tr { th scope="col" { "#" } th scope="col" { "When" } th scope="col" { "Actor" } th scope="col" { "Action" } th scope="col" { "Subject" } th scope="col" { "Detail" } } }
                tbody { @for e in events.iter().take(PAGE) { tr {
                    td { (e.seq) } td { (layout::when(e.at)) } td { code { (e.actor) } }
                    td { a href=(format!("/console/log?q={}", layout::urlencode(&e.action))) { code { (e.action) } } }
                    td { a href=(format!("/console/log?q={}", layout::urlencode(&e.subject))) { code { (e.subject) } } }
                    td { details { summary { "detail" }
                        pre.detail { (serde_json::to_string_pretty(&e.detail).unwrap_or_default()) } } }
                } } }
            }
        }
        @if let Some(before) = next {
            nav.pager aria-label="Pages" {
                a rel="next" href=(match term {
                    Some(t) => format!("/console/log?q={}&before={before}", layout::urlencode(t)),
                    None => format!("/console/log?before={before}"),
                }) { "Older →" }
            }
        }
    };
    Ok(live_response(
        &headers,
        layout::page("Log", Some(&viewer), q.before.is_none(), body),
    ))
}
