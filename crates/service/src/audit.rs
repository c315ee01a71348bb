//! The audit trail both services keep: one table shape (`audit`: `seq` growing, `at` BIGINT,
//! `actor`, `action`, `subject`, `detail` TEXT; each service's migrations create it), one writer that records an event in the transaction of the
//! change it describes, one reader. The event type is `cgx_protocol::audit::AuditEvent`, whose
//! canonical leaf a transparency log will commit to.
//!
//! Every event is also logged (`tracing` target `cgx::audit`), by the caller, once its
//! transaction committed ([`NewEvent::trace`]): a batch rolled back and retried logs nothing
//! twice. `seq`
//! grows in commit order: on SQLite one writer commits at a time; on PostgreSQL the caller
//! takes its commit-order lock ([`crate::db::lock_in_commit_order`]) in the transaction first.

use serde_json::Value;
use sqlx::Row;

pub use cgx_protocol::audit::AuditEvent;

/// An event to record (its `seq` is the database's, its time the caller's clock).
#[derive(Debug, Clone, Copy)]
pub struct NewEvent<'a> {
    pub actor: &'a str,
    pub action: &'a str,
    pub subject: &'a str,
    pub detail: &'a Value,
}

impl NewEvent<'_> {
    /// Say it in the log (`cgx::audit`): after the commit that recorded it.
    pub fn trace(&self, at: i64) {
        tracing::info!(target: "cgx::audit", actor = %self.actor, action = %self.action,
            subject = %self.subject, detail = %self.detail, at, "audit");
    }
}

/// `s`, cut to at most `max` bytes on a character boundary (marked with `…`): a reason a
/// verifier or a peer wrote goes into a detail capped, so a leaf stays under the log's bound
/// (65,535 bytes) whatever the message says.
pub fn cap(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// The statement that inserts `rows` events (the services' batched writers bind five values
/// per row: `at, actor, action, subject, detail`).
pub fn insert_sql(rows: usize) -> String {
    format!(
        "INSERT INTO audit (at, actor, action, subject, detail) VALUES {}",
        crate::db::placeholders(rows, 5)
    )
}

/// Record `event` at `at` in the caller's transaction: it commits with the change it
/// describes, or neither does (the caller traces it once committed).
pub async fn record(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    at: i64,
    event: &NewEvent<'_>,
) -> Result<(), sqlx::Error> {
    sqlx::query(sqlx::AssertSqlSafe(insert_sql(1)))
        .bind(at)
        .bind(event.actor)
        .bind(event.action)
        .bind(event.subject)
        .bind(event.detail.to_string())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Events after `after_seq`, oldest first, at most `limit`.
pub async fn read(
    pool: &sqlx::AnyPool,
    after_seq: i64,
    limit: i64,
) -> Result<Vec<AuditEvent>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT seq, at, actor, action, subject, detail FROM audit WHERE seq > $1 ORDER BY seq LIMIT $2",
    )
    .bind(after_seq)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    rows.iter().map(event_row).collect()
}

/// The newest `limit` events, oldest first.
pub async fn latest(pool: &sqlx::AnyPool, limit: i64) -> Result<Vec<AuditEvent>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT seq, at, actor, action, subject, detail FROM audit ORDER BY seq DESC LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await?;
    rows.iter().rev().map(event_row).collect()
}

pub fn event_row(r: &sqlx::any::AnyRow) -> Result<AuditEvent, sqlx::Error> {
    let detail: String = r.try_get("detail")?;
    Ok(AuditEvent {
        seq: r.try_get("seq")?,
        at: r.try_get("at")?,
        actor: r.try_get("actor")?,
        action: r.try_get("action")?,
        subject: r.try_get("subject")?,
        // Written from a JSON value; a row edited into something else is shown as its text.
        detail: serde_json::from_str(&detail).unwrap_or(Value::String(detail)),
    })
}
