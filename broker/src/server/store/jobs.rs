//! Jobs' rows and their events: submission (with its placement when one was found at once),
//! placement, state changes, expiry.

use sqlx::Row;

use super::super::error::BrokerError;
use super::leases::{free_gpus, open_lease, take_gpus_for_tenant};
use super::{
    JOB_COLUMNS, JobRow, JobState, Outcome, PlacementRow, Refusal, Store, Tx, job_row, job_state,
};

/// Writes to jobs' rows (each state change with its event).
#[derive(Debug)]
pub(crate) enum JobWrite {
    /// A new job, and its placement when one was found at once.
    Submit {
        /// Boxed: the largest write by far, and the queue holds many small ones.
        job: Box<JobRow>,
        placement: Option<PlacementRow>,
        /// Pending jobs its tenant may have (a job stored pending is refused past it).
        max_pending: i64,
    },
    Place(PlacementRow),
    Transition {
        job_id: String,
        from: &'static [JobState],
        to: JobState,
        reason: String,
        now: i64,
    },
    /// Jobs pending since before `before` expire (state `expired`, with the reason). A job's
    /// `updated_at` is when it last moved (to pending too: a failed-over job waits anew).
    ExpirePending {
        before: i64,
        now: i64,
        reason: String,
    },
}

/// Apply one of these writes inside the batch's transaction (see `store::apply`).
pub(super) async fn apply(tx: &mut Tx, w: &JobWrite, sqlite: bool) -> Result<Outcome, sqlx::Error> {
    match w {
        JobWrite::Submit {
            job,
            placement,
            max_pending,
        } => {
            if placement.is_none() {
                let n: i64 =
                    sqlx::query("SELECT COUNT(*) AS n FROM jobs WHERE tenant = $1 AND state = $2")
                        .bind(&job.tenant)
                        .bind(JobState::Pending.as_str())
                        .fetch_one(&mut **tx)
                        .await?
                        .try_get("n")?;
                if n >= *max_pending {
                    return Ok(Outcome::Refused(Refusal::TooManyPending));
                }
            }
            // The escrow checked (nothing written), then GPUs: a refusal leaves nothing behind.
            let escrow = match placement.as_ref().and_then(|p| p.escrow.as_ref()) {
                Some(o) => match super::ledger::prepare_escrow(tx, o).await? {
                    Ok(c) => Some((o, c)),
                    Err(r) => return Ok(Outcome::Refused(r)),
                },
                None => None,
            };
            if let Some(p) = placement
                && let Some(refused) = take_gpus_for_tenant(tx, p).await?
            {
                return Ok(Outcome::Refused(refused));
            }
            let (state_now, reason, node, lease) = match placement {
                Some(p) => (
                    JobState::Placed,
                    p.reason.as_str(),
                    Some(&p.node_id),
                    Some(&p.lease_id),
                ),
                None => (job.state, job.reason.as_str(), None, None),
            };
            sqlx::query(
                "INSERT INTO jobs (id, tenant, spec, state, reason, node_id, lease_id, created_at, updated_at, seal) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8, $9)",
            )
            .bind(&job.id)
            .bind(&job.tenant)
            .bind(&job.spec)
            .bind(state_now.as_str())
            .bind(reason)
            .bind(node.cloned())
            .bind(lease.cloned())
            .bind(job.created_at)
            .bind(&job.seal)
            .execute(&mut **tx)
            .await?;
            match placement {
                Some(p) => {
                    sqlx::query(
                        "INSERT INTO job_events (job_id, at, from_state, to_state, reason) VALUES ($1, $2, NULL, $3, $4), ($1, $5, $3, $6, $7)",
                    )
                    .bind(&job.id)
                    .bind(job.created_at)
                    .bind(job.state.as_str())
                    .bind(&job.reason)
                    .bind(p.started_at)
                    .bind(JobState::Placed.as_str())
                    .bind(&p.reason)
                    .execute(&mut **tx)
                    .await?;
                    open_lease(tx, p, sqlite).await?;
                    if let Some((o, c)) = &escrow {
                        super::ledger::finish_escrow(tx, o, c).await?;
                    }
                }
                None => event(tx, &job.id, job.created_at, None, job.state, &job.reason).await?,
            }
            Ok(Outcome::Done)
        }
        JobWrite::Place(p) => {
            let escrow = match &p.escrow {
                Some(o) => match super::ledger::prepare_escrow(tx, o).await? {
                    Ok(c) => Some((o, c)),
                    Err(r) => return Ok(Outcome::Refused(r)),
                },
                None => None,
            };
            if let Some(refused) = take_gpus_for_tenant(tx, p).await? {
                return Ok(Outcome::Refused(refused));
            }
            let placed = sqlx::query(
                "UPDATE jobs SET state = $1, reason = $2, updated_at = $3, node_id = $4, lease_id = $5 WHERE id = $6 AND state = $7",
            )
            .bind(JobState::Placed.as_str())
            .bind(&p.reason)
            .bind(p.started_at)
            .bind(&p.node_id)
            .bind(&p.lease_id)
            .bind(&p.job_id)
            .bind(JobState::Pending.as_str())
            .execute(&mut **tx)
            .await?;
            if placed.rows_affected() != 1 {
                free_gpus(tx, &p.lease_id).await?;
                return Ok(Outcome::Refused(Refusal::JobNotPending));
            }
            event(
                tx,
                &p.job_id,
                p.started_at,
                Some(JobState::Pending),
                JobState::Placed,
                &p.reason,
            )
            .await?;
            open_lease(tx, p, sqlite).await?;
            if let Some((o, c)) = &escrow {
                super::ledger::finish_escrow(tx, o, c).await?;
            }
            Ok(Outcome::Done)
        }
        JobWrite::Transition {
            job_id,
            from,
            to,
            reason,
            now,
        } => Ok(
            match transition(tx, job_id, from, *to, reason, *now, false).await? {
                Some(_) => Outcome::Done,
                None => Outcome::Refused(Refusal::JobNotPending),
            },
        ),
        JobWrite::ExpirePending {
            before,
            now,
            reason,
        } => {
            // Events first (they select the jobs the update then moves).
            sqlx::query(
                "INSERT INTO job_events (job_id, at, from_state, to_state, reason)
                 SELECT id, $1, $2, $3, $4 FROM jobs WHERE state = $2 AND updated_at < $5",
            )
            .bind(now)
            .bind(JobState::Pending.as_str())
            .bind(JobState::Expired.as_str())
            .bind(reason)
            .bind(before)
            .execute(&mut **tx)
            .await?;
            sqlx::query(
                "UPDATE jobs SET state = $1, reason = $2, updated_at = $3 WHERE state = $4 AND updated_at < $5",
            )
            .bind(JobState::Expired.as_str())
            .bind(reason)
            .bind(now)
            .bind(JobState::Pending.as_str())
            .bind(before)
            .execute(&mut **tx)
            .await?;
            Ok(Outcome::Done)
        }
    }
}

/// A job's state change inside a transaction, conditional on its state being `from` (one
/// of), with its event; the state it left, or `None` (nothing written) if it was in none.
async fn transition(
    tx: &mut Tx,
    job_id: &str,
    from: &[JobState],
    to: JobState,
    reason: &str,
    now: i64,
    clear_placement: bool,
) -> Result<Option<JobState>, sqlx::Error> {
    let Some(current) = sqlx::query("SELECT state FROM jobs WHERE id = $1")
        .bind(job_id)
        .fetch_optional(&mut **tx)
        .await?
    else {
        return Ok(None);
    };
    let current: String = current.try_get("state")?;
    // A state this broker does not know is in no `from`.
    let Some(current) = JobState::parse(&current).filter(|c| from.contains(c)) else {
        return Ok(None);
    };
    move_job(tx, job_id, current, to, reason, now, clear_placement).await
}

/// Move a job known to be in `current` to `to` (conditional on it still being there), with its
/// event.
pub(super) async fn move_job(
    tx: &mut Tx,
    job_id: &str,
    current: JobState,
    to: JobState,
    reason: &str,
    now: i64,
    clear_placement: bool,
) -> Result<Option<JobState>, sqlx::Error> {
    let sql = if clear_placement {
        "UPDATE jobs SET state = $1, reason = $2, updated_at = $3, node_id = NULL, lease_id = NULL WHERE id = $4 AND state = $5"
    } else {
        "UPDATE jobs SET state = $1, reason = $2, updated_at = $3 WHERE id = $4 AND state = $5"
    };
    let changed = sqlx::query(sql)
        .bind(to.as_str())
        .bind(reason)
        .bind(now)
        .bind(job_id)
        .bind(current.as_str())
        .execute(&mut **tx)
        .await?;
    if changed.rows_affected() != 1 {
        return Ok(None);
    }
    event(tx, job_id, now, Some(current), to, reason).await?;
    Ok(Some(current))
}

async fn event(
    tx: &mut Tx,
    job_id: &str,
    at: i64,
    from: Option<JobState>,
    to: JobState,
    reason: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO job_events (job_id, at, from_state, to_state, reason) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(job_id)
    .bind(at)
    .bind(from.map(JobState::as_str))
    .bind(to.as_str())
    .bind(reason)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

impl Store {
    pub async fn job(&self, id: &str) -> Result<Option<JobRow>, BrokerError> {
        let sql = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(self.db.pool())
            .await?;
        Ok(row.as_ref().map(job_row).transpose()?)
    }

    /// Jobs of `tenant` (every tenant for `None`), newest first, at most `limit`.
    pub async fn jobs(&self, tenant: Option<&str>, limit: i64) -> Result<Vec<JobRow>, BrokerError> {
        let rows = match tenant {
            Some(t) => {
                let sql = format!(
                    "SELECT {JOB_COLUMNS} FROM jobs WHERE tenant = $1 ORDER BY created_at DESC, id LIMIT $2"
                );
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(t)
                    .bind(limit)
                    .fetch_all(self.db.pool())
                    .await?
            }
            None => {
                let sql =
                    format!("SELECT {JOB_COLUMNS} FROM jobs ORDER BY created_at DESC, id LIMIT $1");
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(limit)
                    .fetch_all(self.db.pool())
                    .await?
            }
        };
        Ok(rows.iter().map(job_row).collect::<Result<_, _>>()?)
    }

    /// Whether a job pending since before `before` is still pending.
    pub async fn any_pending_before(&self, before: i64) -> Result<bool, BrokerError> {
        let row = sqlx::query("SELECT id FROM jobs WHERE state = $1 AND updated_at < $2 LIMIT 1")
            .bind(JobState::Pending.as_str())
            .bind(before)
            .fetch_optional(self.db.pool())
            .await?;
        Ok(row.is_some())
    }

    /// Pending jobs, fairly across tenants: each tenant's oldest first, then each tenant's
    /// second, and so on (oldest first within a round), at most `limit`. A tenant with many
    /// jobs waiting takes one place per round, so it cannot hide another tenant's jobs from a
    /// placement pass however many it has.
    pub async fn pending_jobs(&self, limit: i64) -> Result<Vec<JobRow>, BrokerError> {
        let sql = format!(
            "SELECT {JOB_COLUMNS} FROM (SELECT {JOB_COLUMNS}, ROW_NUMBER() OVER (PARTITION BY tenant ORDER BY created_at, id) AS turn
               FROM jobs WHERE state = $1) AS p ORDER BY turn, created_at, id LIMIT $2"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(JobState::Pending.as_str())
            .bind(limit)
            .fetch_all(self.db.pool())
            .await?;
        Ok(rows.iter().map(job_row).collect::<Result<_, _>>()?)
    }

    pub async fn events(
        &self,
        job_id: &str,
    ) -> Result<Vec<cgx_protocol::broker::JobEvent>, BrokerError> {
        let rows = sqlx::query(
            "SELECT at, from_state, to_state, reason FROM job_events WHERE job_id = $1 ORDER BY seq",
        )
        .bind(job_id)
        .fetch_all(self.db.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(cgx_protocol::broker::JobEvent {
                    at: r.try_get("at")?,
                    from: match r.try_get::<Option<String>, _>("from_state")? {
                        Some(_) => Some(job_state(r, "from_state")?),
                        None => None,
                    },
                    to: job_state(r, "to_state")?,
                    reason: r.try_get("reason")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }
}
