//! The broker's storage on `cgx-service`'s database (SQLite by default, PostgreSQL for
//! replicas): nonces, nodes, operators, jobs and their events, leases, GPU allocations.
//!
//! - **Capacity is reserved atomically.** `allocations` has one row per (node, GPU) with that
//!   pair as its primary key; a placement inserts its rows, its lease and the job's state change
//!   in one transaction, and commits only if every row went in and the job was still pending. Two
//!   replicas that chose the same GPU cannot both commit: no GPU is ever given to two leases.
//! - **Durability.** Every write runs at SQLite's `synchronous=FULL` (`BEGIN IMMEDIATE`, one
//!   writer at a time in this process): a placement, a lease and a job's events cannot be
//!   recomputed.
//! - **A row proves nothing by itself.** Node rows carry the registration as a record signed by
//!   the broker's key, lease rows the lease token it signed; both are verified when read
//!   (`mod.rs`).

use std::collections::HashMap;

use cgx_service::db::{Backend, Database, Migration};
use sqlx::Row;

use super::error::BrokerError;

/// The broker's migration lock number.
const MIGRATION_LOCK: i64 = 0x6367_7842;

const MIGRATIONS: &[Migration] = &[Migration {
    version: 1,
    sqlite: "CREATE TABLE nonces (nonce TEXT PRIMARY KEY, expires_at BIGINT NOT NULL);
     CREATE TABLE nodes (
        id TEXT PRIMARY KEY, operator TEXT NOT NULL, record TEXT NOT NULL,
        attested_at BIGINT NOT NULL, last_heartbeat BIGINT NOT NULL,
        heartbeat_seq BIGINT NOT NULL, reputation BIGINT NOT NULL DEFAULT 0,
        updated_ms BIGINT NOT NULL);
     CREATE INDEX nodes_updated ON nodes (updated_ms);
     CREATE TABLE operators (name TEXT PRIMARY KEY, reputation BIGINT NOT NULL DEFAULT 0);
     CREATE TABLE jobs (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, spec TEXT NOT NULL, state TEXT NOT NULL,
        reason TEXT NOT NULL, node_id TEXT, lease_id TEXT, created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL);
     CREATE INDEX jobs_state ON jobs (state, created_at);
     CREATE INDEX jobs_tenant ON jobs (tenant, created_at);
     CREATE TABLE job_events (
        seq INTEGER PRIMARY KEY, job_id TEXT NOT NULL, at BIGINT NOT NULL,
        from_state TEXT, to_state TEXT NOT NULL, reason TEXT NOT NULL);
     CREATE INDEX job_events_job ON job_events (job_id, seq);
     CREATE TABLE leases (
        id TEXT PRIMARY KEY, job_id TEXT NOT NULL, node_id TEXT NOT NULL, gpus TEXT NOT NULL,
        token TEXT NOT NULL, started_at BIGINT NOT NULL, ends_at BIGINT NOT NULL,
        ended_at BIGINT, end_reason TEXT);
     CREATE INDEX leases_open ON leases (node_id) WHERE ended_at IS NULL;
     CREATE TABLE allocations (
        node_id TEXT NOT NULL, gpu BIGINT NOT NULL, lease_id TEXT NOT NULL,
        PRIMARY KEY (node_id, gpu))",
    postgres: "CREATE TABLE nonces (nonce TEXT PRIMARY KEY, expires_at BIGINT NOT NULL);
     CREATE TABLE nodes (
        id TEXT PRIMARY KEY, operator TEXT NOT NULL, record TEXT NOT NULL,
        attested_at BIGINT NOT NULL, last_heartbeat BIGINT NOT NULL,
        heartbeat_seq BIGINT NOT NULL, reputation BIGINT NOT NULL DEFAULT 0,
        updated_ms BIGINT NOT NULL);
     CREATE INDEX nodes_updated ON nodes (updated_ms);
     CREATE TABLE operators (name TEXT PRIMARY KEY, reputation BIGINT NOT NULL DEFAULT 0);
     CREATE TABLE jobs (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, spec TEXT NOT NULL, state TEXT NOT NULL,
        reason TEXT NOT NULL, node_id TEXT, lease_id TEXT, created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL);
     CREATE INDEX jobs_state ON jobs (state, created_at);
     CREATE INDEX jobs_tenant ON jobs (tenant, created_at);
     CREATE TABLE job_events (
        seq BIGSERIAL PRIMARY KEY, job_id TEXT NOT NULL, at BIGINT NOT NULL,
        from_state TEXT, to_state TEXT NOT NULL, reason TEXT NOT NULL);
     CREATE INDEX job_events_job ON job_events (job_id, seq);
     CREATE TABLE leases (
        id TEXT PRIMARY KEY, job_id TEXT NOT NULL, node_id TEXT NOT NULL, gpus TEXT NOT NULL,
        token TEXT NOT NULL, started_at BIGINT NOT NULL, ends_at BIGINT NOT NULL,
        ended_at BIGINT, end_reason TEXT);
     CREATE INDEX leases_open ON leases (node_id) WHERE ended_at IS NULL;
     CREATE TABLE allocations (
        node_id TEXT NOT NULL, gpu BIGINT NOT NULL, lease_id TEXT NOT NULL,
        PRIMARY KEY (node_id, gpu))",
}];

/// Job states.
pub mod state {
    pub const PENDING: &str = "pending";
    pub const PLACED: &str = "placed";
    pub const RUNNING: &str = "running";
    pub const COMPLETED: &str = "completed";
    pub const FAILED: &str = "failed";
    pub const CANCELLED: &str = "cancelled";

    /// States a job leaves no more.
    pub fn is_final(s: &str) -> bool {
        matches!(s, COMPLETED | FAILED | CANCELLED)
    }
}

/// A node row.
#[derive(Debug, Clone)]
pub struct NodeRow {
    pub id: String,
    pub record: String,
    pub last_heartbeat: i64,
    pub heartbeat_seq: i64,
    pub reputation: i64,
    pub updated_ms: i64,
}

/// A job row.
#[derive(Debug, Clone)]
pub struct JobRow {
    pub id: String,
    pub tenant: String,
    pub spec: String,
    pub state: String,
    pub reason: String,
    pub node_id: Option<String>,
    pub lease_id: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
}

/// An open lease row.
#[derive(Debug, Clone)]
pub struct LeaseRow {
    pub id: String,
    pub job_id: String,
    pub node_id: String,
    pub gpus: Vec<u32>,
    pub token: String,
    pub started_at: i64,
    pub ends_at: i64,
}

/// What a placement writes.
#[derive(Debug)]
pub struct Placement<'a> {
    pub job_id: &'a str,
    pub node_id: &'a str,
    pub lease_id: &'a str,
    pub gpus: &'a [u32],
    pub token: &'a str,
    pub started_at: i64,
    pub ends_at: i64,
    pub reason: &'a str,
}

/// Why a placement did not commit.
#[derive(Debug, PartialEq, Eq)]
pub enum PlaceOutcome {
    Placed,
    /// A GPU was taken meanwhile (another replica): reload the node's allocations, try again.
    GpuTaken,
    /// The job is no longer pending (cancelled, or placed by another replica).
    JobNotPending,
}

pub(crate) fn gpus_text(gpus: &[u32]) -> String {
    gpus.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

pub(crate) fn parse_gpus(text: &str) -> Vec<u32> {
    text.split(',').filter_map(|g| g.parse().ok()).collect()
}

fn job_row(r: &sqlx::any::AnyRow) -> Result<JobRow, sqlx::Error> {
    Ok(JobRow {
        id: r.try_get("id")?,
        tenant: r.try_get("tenant")?,
        spec: r.try_get("spec")?,
        state: r.try_get("state")?,
        reason: r.try_get("reason")?,
        node_id: r.try_get("node_id")?,
        lease_id: r.try_get("lease_id")?,
        created_at: r.try_get("created_at")?,
        updated_at: r.try_get("updated_at")?,
    })
}

fn lease_row(r: &sqlx::any::AnyRow) -> Result<LeaseRow, sqlx::Error> {
    Ok(LeaseRow {
        id: r.try_get("id")?,
        job_id: r.try_get("job_id")?,
        node_id: r.try_get("node_id")?,
        gpus: parse_gpus(&r.try_get::<String, _>("gpus")?),
        token: r.try_get("token")?,
        started_at: r.try_get("started_at")?,
        ends_at: r.try_get("ends_at")?,
    })
}

const JOB_COLUMNS: &str =
    "id, tenant, spec, state, reason, node_id, lease_id, created_at, updated_at";
const LEASE_COLUMNS: &str = "id, job_id, node_id, gpus, token, started_at, ends_at";

/// The broker's store.
#[derive(Debug)]
pub struct Store {
    db: Database,
    /// SQLite has one writer: this process's writes queue here instead of spinning on
    /// `SQLITE_BUSY`.
    write_lock: tokio::sync::Mutex<()>,
}

type Tx = sqlx::Transaction<'static, sqlx::Any>;

/// A job's state change inside a transaction: conditional on `from` (one of), with its event.
async fn transition(
    tx: &mut Tx,
    job_id: &str,
    from: &[&str],
    to: &str,
    reason: &str,
    now: i64,
    node_lease: Option<(Option<&str>, Option<&str>)>,
) -> Result<Option<String>, sqlx::Error> {
    let current = sqlx::query("SELECT state FROM jobs WHERE id = $1")
        .bind(job_id)
        .fetch_optional(&mut **tx)
        .await?;
    let Some(current) = current else {
        return Ok(None);
    };
    let current: String = current.try_get("state")?;
    if !from.contains(&current.as_str()) {
        return Ok(None);
    }
    let changed = match node_lease {
        Some((node, lease)) => sqlx::query(
            "UPDATE jobs SET state = $1, reason = $2, updated_at = $3, node_id = $4, lease_id = $5 WHERE id = $6 AND state = $7",
        )
        .bind(to)
        .bind(reason)
        .bind(now)
        .bind(node.map(str::to_string))
        .bind(lease.map(str::to_string))
        .bind(job_id)
        .bind(&current)
        .execute(&mut **tx)
        .await?,
        None => sqlx::query(
            "UPDATE jobs SET state = $1, reason = $2, updated_at = $3 WHERE id = $4 AND state = $5",
        )
        .bind(to)
        .bind(reason)
        .bind(now)
        .bind(job_id)
        .bind(&current)
        .execute(&mut **tx)
        .await?,
    };
    if changed.rows_affected() != 1 {
        return Ok(None);
    }
    sqlx::query(
        "INSERT INTO job_events (job_id, at, from_state, to_state, reason) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(job_id)
    .bind(now)
    .bind(&current)
    .bind(to)
    .bind(reason)
    .execute(&mut **tx)
    .await?;
    Ok(Some(current))
}

impl Store {
    pub async fn open(url: &str, now: i64) -> Result<Self, BrokerError> {
        let db = Database::open_durable(url).await?;
        db.migrate(MIGRATION_LOCK, MIGRATIONS, now).await?;
        Ok(Store {
            db,
            write_lock: tokio::sync::Mutex::new(()),
        })
    }

    pub fn is_sqlite(&self) -> bool {
        self.db.backend() == Backend::Sqlite
    }

    pub async fn close(&self) {
        self.db.close().await;
    }

    pub async fn checkpoint(&self) -> Result<(), BrokerError> {
        Ok(self.db.checkpoint().await?)
    }

    /// A write transaction: on SQLite, this process's one writer (`synchronous=FULL` on every
    /// connection, [`Database::open_durable`]) with the write lock taken up front
    /// (`BEGIN IMMEDIATE`).
    async fn begin(&self) -> Result<(Option<tokio::sync::MutexGuard<'_, ()>>, Tx), BrokerError> {
        if self.is_sqlite() {
            let guard = self.write_lock.lock().await;
            let tx = self.db.pool().begin_with("BEGIN IMMEDIATE").await?;
            Ok((Some(guard), tx))
        } else {
            Ok((None, self.db.pool().begin().await?))
        }
    }

    // --- nonces

    pub async fn put_nonce(&self, nonce: &str, expires_at: i64) -> Result<(), BrokerError> {
        let (_g, mut tx) = self.begin().await?;
        sqlx::query("INSERT INTO nonces (nonce, expires_at) VALUES ($1, $2)")
            .bind(nonce)
            .bind(expires_at)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Use `nonce` once: true if it existed and was unexpired at `now` (it is gone either way).
    pub async fn take_nonce(&self, nonce: &str, now: i64) -> Result<bool, BrokerError> {
        let (_g, mut tx) = self.begin().await?;
        let row = sqlx::query("DELETE FROM nonces WHERE nonce = $1 RETURNING expires_at")
            .bind(nonce)
            .fetch_optional(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(match row {
            Some(r) => r.try_get::<i64, _>("expires_at")? > now,
            None => false,
        })
    }

    pub async fn sweep_nonces(&self, now: i64) -> Result<(), BrokerError> {
        let (_g, mut tx) = self.begin().await?;
        sqlx::query("DELETE FROM nonces WHERE expires_at <= $1")
            .bind(now)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    // --- nodes

    /// Insert or replace a node's signed record (registration or re-attestation). A
    /// re-attestation keeps the heartbeat sequence (replays stay refused).
    pub async fn put_node(
        &self,
        id: &str,
        operator: &str,
        record: &str,
        attested_at: i64,
        now_ms: i64,
    ) -> Result<(), BrokerError> {
        let (_g, mut tx) = self.begin().await?;
        sqlx::query(
            "INSERT INTO nodes (id, operator, record, attested_at, last_heartbeat, heartbeat_seq, updated_ms)
             VALUES ($1, $2, $3, $4, $4, 0, $5)
             ON CONFLICT (id) DO UPDATE SET operator = excluded.operator, record = excluded.record,
               attested_at = excluded.attested_at,
               last_heartbeat = CASE WHEN nodes.last_heartbeat > excluded.attested_at THEN nodes.last_heartbeat ELSE excluded.attested_at END,
               updated_ms = excluded.updated_ms",
        )
        .bind(id)
        .bind(operator)
        .bind(record)
        .bind(attested_at)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        sqlx::query("INSERT INTO operators (name) VALUES ($1) ON CONFLICT (name) DO NOTHING")
            .bind(operator)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Record a heartbeat if `seq` is past the stored one (across replicas: a replayed
    /// heartbeat changes nothing). Returns whether it was taken.
    pub async fn heartbeat(
        &self,
        id: &str,
        seq: i64,
        at: i64,
        now_ms: i64,
    ) -> Result<bool, BrokerError> {
        let (_g, mut tx) = self.begin().await?;
        let r = sqlx::query(
            "UPDATE nodes SET last_heartbeat = $1, heartbeat_seq = $2, updated_ms = $3
             WHERE id = $4 AND heartbeat_seq < $2",
        )
        .bind(at)
        .bind(seq)
        .bind(now_ms)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(r.rows_affected() == 1)
    }

    /// Nodes changed at or after `since_ms` (every node for 0).
    pub async fn nodes_since(&self, since_ms: i64) -> Result<Vec<NodeRow>, BrokerError> {
        let rows = sqlx::query(
            "SELECT id, record, last_heartbeat, heartbeat_seq, reputation, updated_ms FROM nodes WHERE updated_ms >= $1",
        )
        .bind(since_ms)
        .fetch_all(self.db.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(NodeRow {
                    id: r.try_get("id")?,
                    record: r.try_get("record")?,
                    last_heartbeat: r.try_get("last_heartbeat")?,
                    heartbeat_seq: r.try_get("heartbeat_seq")?,
                    reputation: r.try_get("reputation")?,
                    updated_ms: r.try_get("updated_ms")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// Operator reputations.
    pub async fn operators(&self) -> Result<Vec<(String, i64)>, BrokerError> {
        let rows = sqlx::query("SELECT name, reputation FROM operators")
            .fetch_all(self.db.pool())
            .await?;
        rows.iter()
            .map(|r| Ok((r.try_get("name")?, r.try_get("reputation")?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// Allocated GPUs of `nodes` (every node for `None`) as bitmaps.
    pub async fn allocations(
        &self,
        nodes: Option<&[String]>,
    ) -> Result<HashMap<String, u64>, BrokerError> {
        let rows = match nodes {
            None => {
                sqlx::query("SELECT node_id, gpu FROM allocations")
                    .fetch_all(self.db.pool())
                    .await?
            }
            Some([]) => Vec::new(),
            Some(ids) => {
                let list = (1..=ids.len())
                    .map(|i| format!("${i}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                let sql = format!("SELECT node_id, gpu FROM allocations WHERE node_id IN ({list})");
                let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
                for id in ids {
                    q = q.bind(id.clone());
                }
                q.fetch_all(self.db.pool()).await?
            }
        };
        let mut out: HashMap<String, u64> = HashMap::new();
        for r in rows {
            let id: String = r.try_get("node_id")?;
            let gpu: i64 = r.try_get("gpu")?;
            if (0..64).contains(&gpu) {
                *out.entry(id).or_default() |= 1u64 << gpu;
            }
        }
        Ok(out)
    }

    // --- jobs

    pub async fn insert_job(&self, job: &JobRow) -> Result<(), BrokerError> {
        let (_g, mut tx) = self.begin().await?;
        sqlx::query(
            "INSERT INTO jobs (id, tenant, spec, state, reason, created_at, updated_at) VALUES ($1, $2, $3, $4, $5, $6, $6)",
        )
        .bind(&job.id)
        .bind(&job.tenant)
        .bind(&job.spec)
        .bind(&job.state)
        .bind(&job.reason)
        .bind(job.created_at)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO job_events (job_id, at, from_state, to_state, reason) VALUES ($1, $2, NULL, $3, $4)",
        )
        .bind(&job.id)
        .bind(job.created_at)
        .bind(&job.state)
        .bind(&job.reason)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

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

    /// Pending jobs, oldest first.
    pub async fn pending_jobs(&self, limit: i64) -> Result<Vec<JobRow>, BrokerError> {
        let sql = format!(
            "SELECT {JOB_COLUMNS} FROM jobs WHERE state = $1 ORDER BY created_at, id LIMIT $2"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(state::PENDING)
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
                    from: r.try_get("from_state")?,
                    to: r.try_get("to_state")?,
                    reason: r.try_get("reason")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// Open the lease, take its GPUs and move the job pending → placed, all or nothing.
    pub async fn place(&self, p: &Placement<'_>, now_ms: i64) -> Result<PlaceOutcome, BrokerError> {
        let (_g, mut tx) = self.begin().await?;
        let rows = p.gpus.len() as u64;
        let sql = format!(
            "INSERT INTO allocations (node_id, gpu, lease_id) VALUES {} ON CONFLICT (node_id, gpu) DO NOTHING",
            cgx_service::db::placeholders(p.gpus.len(), 3)
        );
        let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
        for g in p.gpus {
            q = q.bind(p.node_id).bind(i64::from(*g)).bind(p.lease_id);
        }
        if q.execute(&mut *tx).await?.rows_affected() != rows {
            tx.rollback().await?;
            return Ok(PlaceOutcome::GpuTaken);
        }
        let now = p.started_at;
        if transition(
            &mut tx,
            p.job_id,
            &[state::PENDING],
            state::PLACED,
            p.reason,
            now,
            Some((Some(p.node_id), Some(p.lease_id))),
        )
        .await?
        .is_none()
        {
            tx.rollback().await?;
            return Ok(PlaceOutcome::JobNotPending);
        }
        sqlx::query(
            "INSERT INTO leases (id, job_id, node_id, gpus, token, started_at, ends_at) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(p.lease_id)
        .bind(p.job_id)
        .bind(p.node_id)
        .bind(gpus_text(p.gpus))
        .bind(p.token)
        .bind(p.started_at)
        .bind(p.ends_at)
        .execute(&mut *tx)
        .await?;
        touch(&mut tx, p.node_id, now_ms).await?;
        tx.commit().await?;
        Ok(PlaceOutcome::Placed)
    }

    /// Open leases of `node` (every node for `None`).
    pub async fn open_leases(&self, node: Option<&str>) -> Result<Vec<LeaseRow>, BrokerError> {
        let rows = match node {
            Some(n) => {
                let sql = format!(
                    "SELECT {LEASE_COLUMNS} FROM leases WHERE node_id = $1 AND ended_at IS NULL ORDER BY id"
                );
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(n)
                    .fetch_all(self.db.pool())
                    .await?
            }
            None => {
                let sql = format!(
                    "SELECT {LEASE_COLUMNS} FROM leases WHERE ended_at IS NULL ORDER BY id"
                );
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .fetch_all(self.db.pool())
                    .await?
            }
        };
        Ok(rows.iter().map(lease_row).collect::<Result<_, _>>()?)
    }

    /// End lease `lease`: free its GPUs, and move its job to `job_state` (from `job_from`) with
    /// `reason`. Returns the lease (node and GPUs) if this call ended it.
    pub async fn end_lease(
        &self,
        lease: &str,
        job_from: &[&str],
        job_state: &str,
        reason: &str,
        now: i64,
        now_ms: i64,
    ) -> Result<Option<LeaseRow>, BrokerError> {
        let (_g, mut tx) = self.begin().await?;
        let sql = format!("SELECT {LEASE_COLUMNS} FROM leases WHERE id = $1 AND ended_at IS NULL");
        let Some(row) = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(lease)
            .fetch_optional(&mut *tx)
            .await?
        else {
            return Ok(None);
        };
        let l = lease_row(&row)?;
        let ended = sqlx::query(
            "UPDATE leases SET ended_at = $1, end_reason = $2 WHERE id = $3 AND ended_at IS NULL",
        )
        .bind(now)
        .bind(reason)
        .bind(lease)
        .execute(&mut *tx)
        .await?;
        if ended.rows_affected() != 1 {
            tx.rollback().await?;
            return Ok(None);
        }
        sqlx::query("DELETE FROM allocations WHERE lease_id = $1")
            .bind(lease)
            .execute(&mut *tx)
            .await?;
        let node_lease = (job_state == state::PENDING).then_some((None, None));
        transition(
            &mut tx, &l.job_id, job_from, job_state, reason, now, node_lease,
        )
        .await?;
        touch(&mut tx, &l.node_id, now_ms).await?;
        tx.commit().await?;
        Ok(Some(l))
    }

    /// Move a job `from` → `to` (no lease change); true if it moved.
    pub async fn transition(
        &self,
        job_id: &str,
        from: &[&str],
        to: &str,
        reason: &str,
        now: i64,
    ) -> Result<bool, BrokerError> {
        let (_g, mut tx) = self.begin().await?;
        let moved = transition(&mut tx, job_id, from, to, reason, now, None).await?;
        tx.commit().await?;
        Ok(moved.is_some())
    }

    /// Set reputations (tests and operators' tooling; later work feeds them).
    pub async fn set_reputation(
        &self,
        node: Option<(&str, i64)>,
        operator: Option<(&str, i64)>,
        now_ms: i64,
    ) -> Result<(), BrokerError> {
        let (_g, mut tx) = self.begin().await?;
        if let Some((id, r)) = node {
            sqlx::query("UPDATE nodes SET reputation = $1, updated_ms = $2 WHERE id = $3")
                .bind(r)
                .bind(now_ms)
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        if let Some((name, r)) = operator {
            sqlx::query(
                "INSERT INTO operators (name, reputation) VALUES ($1, $2) ON CONFLICT (name) DO UPDATE SET reputation = excluded.reputation",
            )
            .bind(name)
            .bind(r)
            .execute(&mut *tx)
            .await?;
            sqlx::query("UPDATE nodes SET updated_ms = $1 WHERE operator = $2")
                .bind(now_ms)
                .bind(name)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }
}

/// Mark a node changed (its allocations), so other replicas reload it.
async fn touch(tx: &mut Tx, node: &str, now_ms: i64) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE nodes SET updated_ms = $1 WHERE id = $2")
        .bind(now_ms)
        .bind(node)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
