//! What the web console reads beyond the API's own queries: jobs by keyset (newest first, a
//! page at a time however many there are), a job's leases, whether a console name (a sign-in
//! challenge, a signed-out session) was spent.

use sqlx::Row;

use super::{JOB_COLUMNS, JobRow, Store, job_row, parse_gpus};
use crate::server::error::BrokerError;

/// Migration 15: the indexes the console's pages read by (the all-tenants job list newest
/// first; a job's leases).
pub(super) const CONSOLE_V15: &str = "CREATE INDEX jobs_created ON jobs (created_at, id);
     CREATE INDEX leases_job ON leases (job_id, started_at);
     CREATE INDEX audit_subject ON audit (subject, seq);
     CREATE INDEX audit_action ON audit (action, seq)";

/// A lease of a job, open or ended.
#[derive(Debug, Clone)]
pub struct LeaseHistory {
    pub id: String,
    pub node_id: String,
    pub gpus: Vec<u32>,
    pub started_at: i64,
    pub ends_at: i64,
    pub ended_at: Option<i64>,
    pub end_reason: String,
}

impl Store {
    /// Jobs of `tenant` (every tenant for `None`), newest first, after the keyset cursor
    /// `(created_at, id)` of the previous page's last row, at most `limit`.
    pub async fn jobs_page(
        &self,
        tenant: Option<&str>,
        after: Option<(i64, &str)>,
        limit: i64,
    ) -> Result<Vec<JobRow>, BrokerError> {
        // Newest first, ties by id: the next page starts strictly below the cursor.
        let (at, id) = after.unwrap_or((i64::MAX, ""));
        let rows = match tenant {
            Some(t) => {
                let sql = format!(
                    "SELECT {JOB_COLUMNS} FROM jobs WHERE tenant = $1
                       AND (created_at < $2 OR (created_at = $2 AND id > $3))
                     ORDER BY created_at DESC, id LIMIT $4"
                );
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(t)
                    .bind(at)
                    .bind(id)
                    .bind(limit)
                    .fetch_all(self.db.pool())
                    .await?
            }
            None => {
                let sql = format!(
                    "SELECT {JOB_COLUMNS} FROM jobs
                     WHERE (created_at < $1 OR (created_at = $1 AND id > $2))
                     ORDER BY created_at DESC, id LIMIT $3"
                );
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(at)
                    .bind(id)
                    .bind(limit)
                    .fetch_all(self.db.pool())
                    .await?
            }
        };
        Ok(rows.iter().map(job_row).collect::<Result<_, _>>()?)
    }

    /// Every lease job `job` had, oldest first (a failover adds one).
    pub async fn leases_of_job(&self, job: &str) -> Result<Vec<LeaseHistory>, BrokerError> {
        let rows = sqlx::query(
            "SELECT id, node_id, gpus, started_at, ends_at, ended_at, end_reason FROM leases
             WHERE job_id = $1 ORDER BY started_at, id LIMIT 100",
        )
        .bind(job)
        .fetch_all(self.db.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(LeaseHistory {
                    id: r.try_get("id")?,
                    node_id: r.try_get("node_id")?,
                    gpus: parse_gpus(&r.try_get::<String, _>("gpus")?),
                    started_at: r.try_get("started_at")?,
                    ends_at: r.try_get("ends_at")?,
                    ended_at: r.try_get("ended_at")?,
                    end_reason: r
                        .try_get::<Option<String>, _>("end_reason")?
                        .unwrap_or_default(),
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(BrokerError::from)
    }

    /// Audit events newest first, before `before` (a `seq`), whose subject or action is
    /// `term` (every event for `None`), at most `limit`.
    pub async fn audit_page(
        &self,
        term: Option<&str>,
        before: Option<i64>,
        limit: i64,
    ) -> Result<Vec<cgx_protocol::audit::AuditEvent>, BrokerError> {
        let before = before.unwrap_or(i64::MAX);
        let rows = match term {
            // Two index walks, merged: `OR` across two indexes is a scan on SQLite.
            Some(t) => {
                sqlx::query(
                    "SELECT seq, at, actor, action, subject, detail FROM (
                       SELECT * FROM (SELECT seq, at, actor, action, subject, detail FROM audit
                         WHERE subject = $1 AND seq < $2 ORDER BY seq DESC LIMIT $3) AS s
                       UNION
                       SELECT * FROM (SELECT seq, at, actor, action, subject, detail FROM audit
                         WHERE action = $1 AND seq < $2 ORDER BY seq DESC LIMIT $3) AS a
                     ) AS u ORDER BY seq DESC LIMIT $3",
                )
                .bind(t)
                .bind(before)
                .bind(limit)
                .fetch_all(self.db.pool())
                .await?
            }
            None => {
                sqlx::query(
                    "SELECT seq, at, actor, action, subject, detail FROM audit
                     WHERE seq < $1 ORDER BY seq DESC LIMIT $2",
                )
                .bind(before)
                .bind(limit)
                .fetch_all(self.db.pool())
                .await?
            }
        };
        rows.iter()
            .map(cgx_service::audit::event_row)
            .collect::<Result<_, _>>()
            .map_err(BrokerError::from)
    }

    /// The newest `limit` metering records accepted for `node`'s leases since `since` (unix
    /// seconds), as their tokens (the caller verifies each under the node's key).
    pub async fn metering_of_node(
        &self,
        node: &str,
        since: i64,
        limit: i64,
    ) -> Result<Vec<String>, BrokerError> {
        let rows = sqlx::query(
            "SELECT m.token FROM leases l JOIN metering m ON m.lease_id = l.id
             WHERE l.node_id = $1 AND (l.ended_at IS NULL OR l.ended_at >= $2)
               AND m.accepted_at >= $2
             ORDER BY m.accepted_at DESC LIMIT $3",
        )
        .bind(node)
        .bind(since)
        .bind(limit)
        .fetch_all(self.db.pool())
        .await?;
        rows.iter()
            .map(|r| r.try_get::<String, _>("token"))
            .collect::<Result<_, _>>()
            .map_err(BrokerError::from)
    }

    /// The newest `limit` settled windows of `lease`, newest first.
    pub async fn windows_recent(
        &self,
        lease: &str,
        limit: i64,
    ) -> Result<Vec<super::SettledWindow>, BrokerError> {
        let rows = sqlx::query(
            "SELECT win, outcome, record, amount, reason, at FROM settled_windows
             WHERE lease_id = $1 ORDER BY win DESC LIMIT $2",
        )
        .bind(lease)
        .bind(limit)
        .fetch_all(self.db.pool())
        .await?;
        rows.iter()
            .map(super::ledger::settled_window)
            .collect::<Result<_, sqlx::Error>>()
            .map_err(BrokerError::from)
    }

    /// What `lease` paid, summed per `bucket` seconds of settlement time, in time order: at
    /// most a few hundred points however long the lease ran (a chart's).
    pub async fn paid_by_bucket(
        &self,
        lease: &str,
        bucket: i64,
    ) -> Result<Vec<(i64, u64)>, BrokerError> {
        let rows = sqlx::query(
            "SELECT (at / $2) * $2 AS b, SUM(amount) AS paid FROM settled_windows
             WHERE lease_id = $1 AND outcome = 'paid' GROUP BY (at / $2) ORDER BY b LIMIT 2000",
        )
        .bind(lease)
        .bind(bucket.max(1))
        .fetch_all(self.db.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get::<i64, _>("b")?,
                    u64::try_from(r.try_get::<i64, _>("paid")?).unwrap_or(0),
                ))
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(BrokerError::from)
    }

    /// Was the console name `name` (a sign-in challenge, a signed-out session) spent?
    pub async fn nonce_used(&self, name: &str) -> Result<bool, BrokerError> {
        let row = sqlx::query("SELECT nonce FROM used_nonces WHERE nonce = $1")
            .bind(name)
            .fetch_optional(self.db.pool())
            .await?;
        Ok(row.is_some())
    }
}
