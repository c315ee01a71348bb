//! Auditors' page: the log's newest published checkpoint with its cosignatures, its verifier
//! key, the audited decisions newest first with a search by event, node, lease or job (a
//! leaf's subject or action), and the commands that check all of it offline with nothing of
//! the broker's but its files.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use maud::html;
use serde::Deserialize;

use super::super::{Broker, BrokerError};
use super::chart::{self, Series};
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
    let pool = b.store.db.pool();
    let sizes = cgx_service::tlog::history(pool, 500)
        .await
        .map_err(BrokerError::from)?;
    let growth = Series {
        label: "Leaves".into(),
        unit: "",
        points: sizes.iter().map(|(at, n)| (*at, *n as f64)).collect(),
        limit: None,
    };
    let verdict = b
        .store
        .audit_page(Some("audit.verdict"), None, 20)
        .await?
        .into_iter()
        .find(|e| e.action == "audit.verdict");
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
        (chart::line("Log size over time", &growth))
        h2 { "The last auditor's verdict" }
        @match &verdict {
            Some(v) => {
                p {
                    (layout::badge(if v.detail["violations"] == "0" { "passed" } else { "failed" }))
                    " " code { (v.actor) } " checked " (v.detail["size"].as_str().unwrap_or("?"))
                    " leaves (root " code { (v.detail["root"].as_str().unwrap_or("?")) } ") at "
                    (layout::when(v.at)) ": " (v.detail["violations"].as_str().unwrap_or("?")) " violations; checks: "
                    (v.detail["checks"].as_array().map(|c| c.iter().filter_map(|x| x.as_str()).collect::<Vec<_>>().join(", ")).unwrap_or_default())
                    " — " a href=(format!("/console/log/events/{}", v.seq)) { "its leaf" }
                }
            }
            None => p.empty { "No auditor has recorded a verdict yet (" code { "cgx audit verify … --report URL --report-key KEY" } ")." },
        }
        h2 { "Check it offline" }
        p { "With an auditor's key and the log's verifier key, nothing else of the broker's:" }
        pre.command { code {
            "cgx audit fetch --broker " (broker_url) " --key AUDITOR.pk8 --out log --archive archive\n"
            "cgx audit verify --log log --log-key LOG.vkey --archive archive --reappraise --state audit.state \\\n"
            "    --report " (broker_url) " --report-key AUDITOR.pk8"
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
                    td { a href=(format!("/console/log/events/{}", e.seq)) { (e.seq) } } td { (layout::when(e.at)) } td { code { (e.actor) } }
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

/// The published checkpoint's note and tree size.
async fn published(b: &Broker) -> Result<Option<(Vec<u8>, u64)>, ConsoleError> {
    let note = match b.log_checkpoint().await {
        Ok(n) => n,
        Err(BrokerError::NotFound(_)) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let size = parse_checkpoint(&note).and_then(|c| c.size.parse().ok());
    Ok(size.map(|s| (note, s)))
}

/// Event `seq`'s leaf and its inclusion proof in the published checkpoint, checked here
/// under the log's key before it is offered.
async fn leaf_proof(
    b: &Broker,
    seq: i64,
) -> Result<Result<cgx_tlog::proof::TlogProof, String>, ConsoleError> {
    let pool = b.store.db.pool();
    let Some((index, leaf)) = cgx_service::tlog::leaf_of_seq(pool, seq)
        .await
        .map_err(BrokerError::from)?
    else {
        return Ok(Err(
            "not yet a leaf: the log integrates it on its next pass".into(),
        ));
    };
    let Some((note, size)) = published(b).await? else {
        return Ok(Err("no checkpoint published yet".into()));
    };
    if index >= size {
        return Ok(Err(format!(
            "leaf {index} is not yet in the published checkpoint ({size} leaves)"
        )));
    }
    let hashes = cgx_service::tlog::prove_leaf(pool, size, index)
        .await
        .map_err(BrokerError::from)?;
    let proof = cgx_tlog::proof::TlogProof {
        extra: Some(leaf),
        index,
        hashes,
        checkpoint: note,
    };
    let Some(log) = &b.log else {
        return Ok(Err("this broker keeps no log".into()));
    };
    Ok(match proof.verify(&log.key().verifier(), &[], 0) {
        Ok(_) => Ok(proof),
        Err(e) => Err(format!("the proof does not verify: {e}")),
    })
}

fn seq_of(s: &str) -> Result<i64, ConsoleError> {
    s.parse::<i64>()
        .ok()
        .filter(|n| *n > 0)
        .ok_or(ConsoleError::NotFound)
}

fn auditors_only(v: &Viewer) -> Result<(), ConsoleError> {
    if v.is_auditor() {
        Ok(())
    } else {
        Err(BrokerError::Forbidden("the log's pages are for auditors".into()).into())
    }
}

/// `GET /console/log/events/{seq}`: one decision, its leaf's inclusion proof in the published
/// checkpoint, and the archived evidence it names.
pub(super) async fn event(
    State(b): State<Arc<Broker>>,
    viewer: Viewer,
    headers: HeaderMap,
    Path(seq): Path<String>,
) -> Result<Response, ConsoleError> {
    auditors_only(&viewer)?;
    let seq = seq_of(&seq)?;
    let e = b
        .store
        .audit_page(None, Some(seq.saturating_add(1)), 1)
        .await?
        .into_iter()
        .next()
        .filter(|e| e.seq == seq)
        .ok_or(ConsoleError::NotFound)?;
    let proof = leaf_proof(&b, seq).await?;
    // The pieces the leaf names by digest, as the archive holds them.
    let mut pieces = Vec::new();
    if let Some(obj) = e.detail.as_object() {
        for (k, v) in obj {
            if let (Some(name), Some(sha)) = (k.strip_suffix("_sha256"), v.as_str())
                && cgx_protocol::archive::is_address(sha)
            {
                let held = b.store.archived(sha).await?.is_some();
                pieces.push((name.to_string(), sha.to_string(), held));
            }
        }
    }
    let vkey = b.log.as_ref().map(|l| l.key().vkey()).unwrap_or_default();
    let body = html! {
        h1 { "Decision " (e.seq) ": " code { (e.action) } }
        (layout::facts(&[
            ("When", layout::when(e.at)),
            ("Actor", html! { code { (e.actor) } }),
            ("Subject", html! { a href=(format!("/console/log?q={}", layout::urlencode(&e.subject))) { code { (e.subject) } } }),
        ]))
        h2 { "Detail" }
        pre.detail { (serde_json::to_string_pretty(&e.detail).unwrap_or_default()) }
        h2 { "Inclusion in the log" }
        @match &proof {
            Ok(p) => {
                p { (layout::badge("passed")) " Leaf " (p.index) " is included in the published checkpoint; "
                    "the proof was checked here under the log's key before it was offered." }
                p { a href=(format!("/console/log/events/{}/proof", e.seq)) download { "Download its tlog-proof" } }
                pre.command { code { "cgx audit verify-proof proof.txt --log-key " (vkey) } }
            }
            Err(why) => p.empty { (why) },
        }
        h2 { "Evidence it rests on" }
        @if pieces.is_empty() { p.empty { "This decision names no archived evidence." } } @else {
            table.list {
                thead { tr { th scope="col" { "Piece" } th scope="col" { "SHA-256" } th scope="col" { "" } } }
                tbody { @for (name, sha, held) in &pieces { tr {
                    td { (name) } td { code.wrap { (sha) } }
                    td { @if *held { a href=(format!("/console/log/archive/{sha}")) download { "download" } } @else { "not archived" } }
                } } }
            }
            p { "Each piece hashes to its name; " code { "cgx audit verify --archive DIR --reappraise" }
                " re-verifies registrations from them against the trust roots." }
        }
    };
    Ok(live_response(
        &headers,
        layout::page(&format!("Decision {}", e.seq), Some(&viewer), false, body),
    ))
}

/// `GET /console/log/events/{seq}/proof`: the C2SP tlog-proof file.
pub(super) async fn proof(
    State(b): State<Arc<Broker>>,
    viewer: Viewer,
    Path(seq): Path<String>,
) -> Result<Response, ConsoleError> {
    auditors_only(&viewer)?;
    let seq = seq_of(&seq)?;
    match leaf_proof(&b, seq).await? {
        Ok(p) => Ok((
            [
                (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
                (
                    header::CONTENT_DISPOSITION,
                    "attachment; filename=\"proof.txt\"",
                ),
            ],
            p.to_bytes(),
        )
            .into_response()),
        Err(why) => Err(ConsoleError::BadRequest(why)),
    }
}

/// `GET /console/log/archive/{sha256}`: an archived piece (auditors).
pub(super) async fn archived(
    State(b): State<Arc<Broker>>,
    viewer: Viewer,
    Path(sha): Path<String>,
) -> Result<Response, ConsoleError> {
    auditors_only(&viewer)?;
    if !cgx_protocol::archive::is_address(&sha) {
        return Err(ConsoleError::NotFound);
    }
    let (_, doc) = b
        .store
        .archived(&sha)
        .await?
        .ok_or(ConsoleError::NotFound)?;
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream"),
            (
                header::CONTENT_DISPOSITION,
                "attachment; filename=\"piece.bin\"",
            ),
        ],
        doc,
    )
        .into_response())
}
