//! The broker's storage on `cgx-service`'s database (SQLite by default, PostgreSQL for
//! replicas): nonces, nodes, operators, jobs and their events, leases, GPU allocations.
//!
//! - **Capacity is reserved atomically.** `allocations` has one row per (node, GPU) with that
//!   pair as its primary key; a placement inserts its rows, its lease and the job's state change
//!   in one transaction, and commits only if every row went in and the job was still pending. Two
//!   replicas that chose the same GPU cannot both commit: no GPU is ever given to two leases.
//! - **Durability, in batches.** Every write goes through one writer task (`GroupCommit`) that
//!   commits whatever is queued as one transaction: at SQLite's `synchronous=FULL` (a
//!   placement, a lease and a job's events cannot be recomputed) the fsync is shared. A write
//!   refused for a reason checks before it changes anything (or undoes its own rows), so the
//!   others commit without it; a failing statement makes the writer retry the batch's writes
//!   one by one. Callers still wait for their own commit.
//! - **Nonces are single use across replicas**: a nonce is MAC'd by the broker (no write to
//!   issue one); a registration spends it in `used_nonces` before its evidence is verified, so
//!   a second use — refused or not the first time — finds it there.
//! - **A row proves nothing by itself.** Node rows carry the registration as a record signed by
//!   the broker's key, lease rows the lease token it signed; both are verified when read
//!   (`mod.rs`).

use std::collections::HashMap;

use cgx_service::db::{Backend, Database, DbError, GroupCommit, Migration};
use sqlx::Row;

use super::error::BrokerError;

/// The broker's migration lock number.
const MIGRATION_LOCK: i64 = 0x6367_7842;

/// Migration 2, the same on both backends.
const REATTEST_ASKED: &str =
    "ALTER TABLE nodes ADD COLUMN reattest_asked BIGINT NOT NULL DEFAULT 0";

/// The first schema; the backends differ only in how `job_events.seq` grows (SQLite's rowid,
/// PostgreSQL's sequence).
macro_rules! schema_v1 {
    ($seq:literal) => {
        concat!(
            "CREATE TABLE used_nonces (nonce TEXT PRIMARY KEY, expires_at BIGINT NOT NULL);
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
        ",
            $seq,
            ", job_id TEXT NOT NULL, at BIGINT NOT NULL,
        from_state TEXT, to_state TEXT NOT NULL, reason TEXT NOT NULL);
     CREATE INDEX job_events_job ON job_events (job_id, seq);
     CREATE TABLE leases (
        id TEXT PRIMARY KEY, job_id TEXT NOT NULL, node_id TEXT NOT NULL, gpus TEXT NOT NULL,
        token TEXT NOT NULL, started_at BIGINT NOT NULL, ends_at BIGINT NOT NULL,
        ended_at BIGINT, end_reason TEXT);
     CREATE INDEX leases_open ON leases (node_id) WHERE ended_at IS NULL;
     CREATE TABLE allocations (
        node_id TEXT NOT NULL, gpu BIGINT NOT NULL, lease_id TEXT NOT NULL,
        PRIMARY KEY (node_id, gpu))"
        )
    };
}

/// Migration 3: settings an admin puts (the reference values) that every replica appraises
/// with, each row with the broker-signed record of its body and version (`settings.rs`); and
/// the audit trail of admin changes.
macro_rules! settings_v3 {
    ($seq:literal) => {
        concat!(
            "CREATE TABLE settings (
        name TEXT PRIMARY KEY, body TEXT NOT NULL, record TEXT NOT NULL,
        version BIGINT NOT NULL, updated_at BIGINT NOT NULL);
     CREATE TABLE admin_events (",
            $seq,
            ", at BIGINT NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL, detail TEXT NOT NULL)"
        )
    };
}

/// Migration 4 (issue 28), the same on both backends: a job's tenant and spec sealed at
/// submission under a key the database does not hold (`lease.rs`, `Keys::seal_job`), checked
/// before every lease is signed; and which node a GPU (device serial) is offered by, so one GPU
/// is one live node across replicas, not per replica's index.
const JOB_SEAL_GPU_OWNERS: &str = "ALTER TABLE jobs ADD COLUMN seal TEXT NOT NULL DEFAULT '';
     CREATE INDEX leases_node_ended ON leases (node_id, ended_at);
     CREATE TABLE gpu_owners (serial TEXT PRIMARY KEY, node_id TEXT NOT NULL);
     CREATE INDEX gpu_owners_node ON gpu_owners (node_id)";

/// Migration 5: who holds a VM, answered without reading a tenant's churned leases. Each lease
/// row names its tenant; `node_holds` keeps, per (node, tenant), when its latest lease on the
/// node ended and that lease's token (which the broker signed, naming the tenant). A VM's holds
/// are then its open leases (at most one per GPU) and the `node_holds` rows that ended within a
/// lease TTL — however many leases a tenant opened and ended there. A trigger keeps
/// `node_holds` as leases end (whoever ends them, in the same statement: no round trip in the
/// single writer). Rows from before this migration have tenant `''` and no `node_holds` row:
/// they are read as before, from their tokens (a partial index holds them alone, so finding
/// them never walks newer leases).
macro_rules! node_holds_v5 {
    () => {
        "ALTER TABLE leases ADD COLUMN tenant TEXT NOT NULL DEFAULT '';
     CREATE INDEX leases_legacy ON leases (node_id, ended_at) WHERE tenant = '';
     CREATE TABLE node_holds (
        node_id TEXT NOT NULL, tenant TEXT NOT NULL, last_end BIGINT NOT NULL,
        token TEXT NOT NULL, PRIMARY KEY (node_id, tenant));
     "
    };
}

/// The hold a lease leaves when it ends (the latest end of a tenant's leases on a node stands).
///
/// Written only when the end moves forward: a tenant that ends many leases on a node within one
/// second writes its row once, not once per lease (the row's token is any lease of the tenant's
/// there that the broker signed — it proves whose hold it is, and the end says how long).
macro_rules! hold_upsert {
    () => {
        "INSERT INTO node_holds (node_id, tenant, last_end, token)
            VALUES (NEW.node_id, NEW.tenant, NEW.ended_at, NEW.token)
          ON CONFLICT (node_id, tenant) DO UPDATE
            SET last_end = excluded.last_end, token = excluded.token
            WHERE node_holds.last_end < excluded.last_end;"
    };
}

const NODE_HOLDS_SQLITE: &str = concat!(
    node_holds_v5!(),
    "CREATE TRIGGER leases_node_hold AFTER UPDATE OF ended_at ON leases
     FOR EACH ROW WHEN NEW.ended_at IS NOT NULL AND NEW.tenant <> ''
     BEGIN ",
    hold_upsert!(),
    " END"
);

const NODE_HOLDS_POSTGRES: &str = concat!(
    node_holds_v5!(),
    "CREATE FUNCTION leases_node_hold() RETURNS trigger LANGUAGE plpgsql AS $$
     BEGIN ",
    hold_upsert!(),
    " RETURN NULL; END
     $$;
     CREATE TRIGGER leases_node_hold AFTER UPDATE OF ended_at ON leases
     FOR EACH ROW WHEN (NEW.ended_at IS NOT NULL AND NEW.tenant <> '')
     EXECUTE FUNCTION leases_node_hold()"
);

/// Migration 6: the open leases indexed by (node, tenant), so the placement write's one-tenant
/// guard finds another tenant's open lease on a node in the index alone (two range probes,
/// `tenant < $t` and `tenant > $t`) instead of reading every open lease row of the node — up to
/// one per GPU, each a table read, on every placement in the single writer. And
/// `leases_node_ended` (migration 4) goes: since migration 5 no query reads leases by node and
/// end (holds come from `node_holds`, older rows from `leases_legacy`), and keeping it cost an
/// index write on every lease opened and ended.
const LEASES_OPEN_BY_TENANT: &str = "DROP INDEX leases_open;
     DROP INDEX leases_node_ended;
     CREATE INDEX leases_open ON leases (node_id, tenant) WHERE ended_at IS NULL";

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        sqlite: schema_v1!("seq INTEGER PRIMARY KEY"),
        postgres: schema_v1!("seq BIGSERIAL PRIMARY KEY"),
    },
    Migration {
        version: 2,
        // An operator or auditor may ask a node to re-attest before its interval ends; the ask
        // stands (across replicas) until the node registers again.
        sqlite: REATTEST_ASKED,
        postgres: REATTEST_ASKED,
    },
    Migration {
        version: 3,
        sqlite: settings_v3!("seq INTEGER PRIMARY KEY"),
        postgres: settings_v3!("seq BIGSERIAL PRIMARY KEY"),
    },
    Migration {
        version: 4,
        sqlite: JOB_SEAL_GPU_OWNERS,
        postgres: JOB_SEAL_GPU_OWNERS,
    },
    Migration {
        version: 5,
        sqlite: NODE_HOLDS_SQLITE,
        postgres: NODE_HOLDS_POSTGRES,
    },
    Migration {
        version: 6,
        sqlite: LEASES_OPEN_BY_TENANT,
        postgres: LEASES_OPEN_BY_TENANT,
    },
];

pub use cgx_protocol::broker::JobState;

/// A node row.
#[derive(Debug, Clone)]
pub struct NodeRow {
    pub id: String,
    pub record: String,
    pub last_heartbeat: i64,
    pub heartbeat_seq: i64,
    pub reputation: i64,
    pub updated_ms: i64,
    /// When an operator or auditor asked the node to re-attest (0: not asked).
    pub reattest_asked: i64,
}

/// A job row.
#[derive(Debug, Clone)]
pub struct JobRow {
    pub id: String,
    pub tenant: String,
    pub spec: String,
    pub state: JobState,
    pub reason: String,
    pub node_id: Option<String>,
    pub lease_id: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
    /// MAC of (id, tenant, spec, created_at) under the broker's job key (`lease.rs`): a row a
    /// database writer made or edited does not carry one that verifies.
    pub seal: String,
}

/// What a node's GPUs are allocated to: the bitmap, and the tenant whose leases hold the VM
/// (a VM serves one tenant at a time) with until when: `i64::MAX` while a lease is open, else
/// the end of its last lease plus the lease TTL (when its last token has expired).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeUse {
    pub gpus: u64,
    pub tenant: Option<(String, i64)>,
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

pub(crate) fn gpus_text(gpus: &[u32]) -> String {
    gpus.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

pub(crate) fn parse_gpus(text: &str) -> Vec<u32> {
    text.split(',').filter_map(|g| g.parse().ok()).collect()
}

/// A job state column: a state this broker knows, or the row is refused.
fn job_state(r: &sqlx::any::AnyRow, column: &str) -> Result<JobState, sqlx::Error> {
    let s: String = r.try_get(column)?;
    JobState::parse(&s).ok_or_else(|| sqlx::Error::ColumnDecode {
        index: column.to_string(),
        source: format!("no job state {:?}", s.chars().take(32).collect::<String>()).into(),
    })
}

fn job_row(r: &sqlx::any::AnyRow) -> Result<JobRow, sqlx::Error> {
    Ok(JobRow {
        id: r.try_get("id")?,
        tenant: r.try_get("tenant")?,
        spec: r.try_get("spec")?,
        state: job_state(r, "state")?,
        reason: r.try_get("reason")?,
        node_id: r.try_get("node_id")?,
        lease_id: r.try_get("lease_id")?,
        created_at: r.try_get("created_at")?,
        updated_at: r.try_get("updated_at")?,
        seal: r.try_get("seal")?,
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
    "id, tenant, spec, state, reason, node_id, lease_id, created_at, updated_at, seal";
const LEASE_COLUMNS: &str = "id, job_id, node_id, gpus, token, started_at, ends_at";
const LEASE_COLUMNS_L: &str = "l.id AS id, l.job_id AS job_id, l.node_id AS node_id, l.gpus AS gpus, l.token AS token, l.started_at AS started_at, l.ends_at AS ends_at";

/// The broker's store.
pub struct Store {
    db: Database,
    /// Every write goes through one writer that commits batches: many requests' writes share
    /// one transaction (and on SQLite one fsync at `synchronous=FULL`), each in its own
    /// savepoint, so one write's refusal (a GPU taken, a job no longer pending) undoes only it.
    writer: GroupCommit<Write, Outcome>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("backend", &self.db.backend())
            .finish_non_exhaustive()
    }
}

type Tx = sqlx::Transaction<'static, sqlx::Any>;

/// One write, owned (it waits in the writer's queue).
#[derive(Debug)]
pub(crate) enum Write {
    /// Use a registration nonce: single use across replicas, spent before the evidence is
    /// looked at (a refused registration spends it too).
    UseNonce {
        nonce: String,
        expires_at: i64,
    },
    /// A registration: store the node's signed record, and take its GPUs (device serials)
    /// from any node that is no longer live; refused if another live node offers one.
    Register {
        id: String,
        operator: String,
        record: String,
        attested_at: i64,
        now_ms: i64,
        gpus: Vec<String>,
        /// Another node counts as live if it heartbeat at or after this…
        live_after: i64,
        /// …and attested at or after this.
        attested_after: i64,
    },
    Heartbeat {
        id: String,
        seq: i64,
        at: i64,
        now_ms: i64,
    },
    /// A new job, and its placement when one was found at once.
    Submit {
        /// Boxed: the largest write by far, and the queue holds many small ones.
        job: Box<JobRow>,
        placement: Option<PlacementRow>,
        /// Pending jobs its tenant may have (a job stored pending is refused past it).
        max_pending: i64,
    },
    Place(PlacementRow),
    EndLease {
        lease: String,
        job_from: &'static [JobState],
        job_to: JobState,
        reason: String,
        now: i64,
        now_ms: i64,
    },
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
    /// Ask node `id` to re-attest at its next heartbeat.
    AskReattest {
        id: String,
        at: i64,
        now_ms: i64,
    },
    Reputation {
        node: Option<(String, i64)>,
        operator: Option<(String, i64)>,
        now_ms: i64,
    },
    SweepNonces {
        now: i64,
    },
    /// Put a setting at `version`, only where the row is still at `version − 1` (absent for
    /// 1): two admins racing cannot both win. With its audit row.
    PutSetting {
        name: &'static str,
        body: String,
        record: String,
        version: i64,
        at: i64,
        actor: String,
        detail: String,
    },
}

/// What a write did.
#[derive(Debug)]
pub(crate) enum Outcome {
    Done,
    /// Not applied (and undone): why.
    Refused(Refusal),
    /// The lease a [`Write::EndLease`] ended.
    Ended(LeaseRow),
}

/// Why a write was not applied.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    NonceUsed,
    StaleHeartbeat,
    GpuTaken,
    JobNotPending,
    NoSuchLease,
    NoSuchNode,
    /// A setting changed since the version the write was made against.
    SettingChanged,
    /// The tenant has as many jobs pending as it may.
    TooManyPending,
    /// A GPU of the registration is offered by another live node.
    GpuOffered {
        serial: String,
        node: String,
    },
    /// The node's GPUs serve another tenant's leases (a VM serves one tenant at a time).
    OtherTenant(String),
    /// A statement failed (logged); the write was undone.
    Failed,
}

/// A placement, owned.
#[derive(Debug, Clone)]
pub struct PlacementRow {
    pub job_id: String,
    /// The job's tenant: the node must serve no other tenant's lease…
    pub tenant: String,
    /// …open, or ended at or after this (a lease whose last token may still be valid)…
    pub tenant_ended_after: i64,
    /// …as the lease tokens this key signed say.
    pub broker_key: [u8; 32],
    pub node_id: String,
    pub lease_id: String,
    pub gpus: Vec<u32>,
    pub token: String,
    pub started_at: i64,
    pub ends_at: i64,
    pub reason: String,
    pub now_ms: i64,
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
async fn move_job(
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

/// Count `tenant`'s hold on a node until `until`: one tenant's holds extend each other; of two
/// tenants' (rows from before the one-tenant rule), the longer stands.
fn hold(u: &mut NodeUse, tenant: String, until: i64) {
    match &mut u.tenant {
        Some((t, u)) if *t == tenant => *u = (*u).max(until),
        Some((_, u)) if *u >= until => {}
        slot => *slot = Some((tenant, until)),
    }
}

/// Another tenant whose lease on `node` is open, or ended at or after `ended_after` (its last
/// token may still be valid): a VM serves one tenant at a time, so one tenant's workload never
/// shares a TEE key, or the leases a node is handed, with another's.
///
/// Read from the node's open leases, its `node_holds` rows (each tenant's latest ended lease
/// there) and rows from before migration 5 — never from every lease the job's own tenant
/// churned through on the node. The tenant columns only narrow the search: who holds the node
/// is read from each lease token the broker signed, never from a column or a job row (a
/// database writer could move a running job to another tenant); a row without a valid
/// signature holds nothing. The database is trusted for whether a lease is live (a writer able
/// to end a lease can hide it either way), the signature for whose it is.
async fn other_tenant(tx: &mut Tx, p: &PlacementRow) -> Result<Option<String>, sqlx::Error> {
    // One statement (it runs in the single writer, on every placement).
    let sql = holds_naming_other_tenants("token", "$1", "$2", "$3");
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&p.node_id)
        .bind(&p.tenant)
        .bind(p.tenant_ended_after)
        .fetch_all(&mut **tx)
        .await?;
    for r in &rows {
        let token: String = r.try_get("token")?;
        if let Some(t) = lease_tenant(&token, &p.broker_key)
            && t != p.tenant
        {
            return Ok(Some(t));
        }
    }
    Ok(None)
}

/// The rows that name a tenant other than `tenant` as holding `node` (placeholders): its open
/// leases, its `node_holds` rows that ended at or after `after`, and rows from before
/// migration 5 that ended then — `select` of each. The placement write's guard and its check
/// from signed tokens ([`other_tenant`]) read the same rows.
///
/// "Another tenant" is written as two ranges (`< t`, `> t`), not `<> t`: each is then a range
/// probe of an index whose key holds the tenant (`leases_open`, migration 6; `node_holds`' key),
/// where `<>` makes SQLite walk the node's rows and read each. Rows from before migration 5
/// (tenant `''`) fall in `< t`, as they fell in `<> t`.
fn holds_naming_other_tenants(select: &str, node: &str, tenant: &str, after: &str) -> String {
    let mut parts = Vec::with_capacity(5);
    for side in ["<", ">"] {
        parts.push(format!(
            "SELECT {select} FROM leases WHERE node_id = {node} AND ended_at IS NULL AND tenant {side} {tenant}"
        ));
    }
    for side in ["<", ">"] {
        parts.push(format!(
            "SELECT {select} FROM node_holds WHERE node_id = {node} AND tenant {side} {tenant} AND last_end >= {after}"
        ));
    }
    parts.push(format!(
        "SELECT {select} FROM leases WHERE node_id = {node} AND tenant = '' AND ended_at >= {after}"
    ));
    parts.join(" UNION ALL ")
}

/// The tenant a lease token this broker signed names (`None`: not its signature, or none).
///
/// Remembered per (key, token): a lease row's token never changes, and the same bytes verify
/// the same way under the same key, so each is verified once per process — the placement
/// write (one writer for every replica's batch) would otherwise verify every lease of a node
/// on each placement. At most 100 000 tokens; cleared when full.
pub(crate) fn lease_tenant(token: &str, key: &[u8; 32]) -> Option<String> {
    type Seen = std::sync::Mutex<HashMap<([u8; 32], String), String>>;
    static SEEN: std::sync::OnceLock<Seen> = std::sync::OnceLock::new();
    let seen = SEEN.get_or_init(Default::default);
    let k = (*key, token.to_string());
    if let Some(t) = seen.lock().ok().and_then(|m| m.get(&k).cloned()) {
        return Some(t);
    }
    let t = super::lease::verify_stored::<cgx_protocol::records::Lease>(token, key)?
        .body
        .tenant;
    if let Ok(mut m) = seen.lock() {
        if m.len() >= 100_000 {
            m.clear();
        }
        m.insert(k, t.clone());
    }
    Some(t)
}

/// Take `p`'s GPUs for its tenant, or say why not: all or none, and only while no other
/// tenant holds the VM ([`other_tenant`]).
///
/// One statement on the common path (it runs in the single writer, on every placement): the
/// GPUs' rows are inserted only where no row *names* another tenant as holding the node — open
/// leases, `node_holds`, rows from before migration 5. Where that guard or a taken GPU stops
/// the insert, the holds are read and checked from their signed tokens: a confirmed other
/// tenant refuses; rows naming another tenant that their tokens do not confirm (a forged or
/// edited row) hold nothing, and the GPUs are taken as if they were not there.
async fn take_gpus_for_tenant(
    tx: &mut Tx,
    p: &PlacementRow,
) -> Result<Option<Refusal>, sqlx::Error> {
    if p.gpus.is_empty() {
        return Ok(other_tenant(tx, p).await?.map(Refusal::OtherTenant));
    }
    let gpus = (0..p.gpus.len())
        .map(|i| format!("SELECT CAST(${} AS BIGINT) AS gpu", i + 5))
        .collect::<Vec<_>>()
        .join(" UNION ALL ");
    let others = holds_naming_other_tenants("1", "$1", "$3", "$4");
    let sql = format!(
        "INSERT INTO allocations (node_id, gpu, lease_id)
         SELECT $1, g.gpu, $2 FROM ({gpus}) g
         WHERE NOT EXISTS ({others})
         ON CONFLICT (node_id, gpu) DO NOTHING"
    );
    let mut q = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&p.node_id)
        .bind(&p.lease_id)
        .bind(&p.tenant)
        .bind(p.tenant_ended_after);
    for g in &p.gpus {
        q = q.bind(i64::from(*g));
    }
    if q.execute(&mut **tx).await?.rows_affected() == p.gpus.len() as u64 {
        return Ok(None);
    }
    free_gpus(tx, &p.lease_id).await?;
    if let Some(t) = other_tenant(tx, p).await? {
        return Ok(Some(Refusal::OtherTenant(t)));
    }
    Ok((!take_gpus(tx, p).await?).then_some(Refusal::GpuTaken))
}

/// Take `p`'s GPUs: all or none (a GPU another lease holds undoes this lease's rows).
async fn take_gpus(tx: &mut Tx, p: &PlacementRow) -> Result<bool, sqlx::Error> {
    let sql = format!(
        "INSERT INTO allocations (node_id, gpu, lease_id) VALUES {} ON CONFLICT (node_id, gpu) DO NOTHING",
        cgx_service::db::placeholders(p.gpus.len(), 3)
    );
    let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
    for g in &p.gpus {
        q = q.bind(&p.node_id).bind(i64::from(*g)).bind(&p.lease_id);
    }
    if q.execute(&mut **tx).await?.rows_affected() == p.gpus.len() as u64 {
        return Ok(true);
    }
    free_gpus(tx, &p.lease_id).await?;
    Ok(false)
}

async fn free_gpus(tx: &mut Tx, lease: &str) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM allocations WHERE lease_id = $1")
        .bind(lease)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn open_lease(tx: &mut Tx, p: &PlacementRow, sqlite: bool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO leases (id, job_id, node_id, gpus, token, started_at, ends_at, tenant) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(&p.lease_id)
    .bind(&p.job_id)
    .bind(&p.node_id)
    .bind(gpus_text(&p.gpus))
    .bind(&p.token)
    .bind(p.started_at)
    .bind(p.ends_at)
    .bind(&p.tenant)
    .execute(&mut **tx)
    .await?;
    touch(tx, &p.node_id, p.now_ms, sqlite).await
}

/// One write inside the batch's transaction. A write refused for a reason (a used nonce, a
/// GPU taken, a job no longer pending) checks before it changes anything, or undoes what it
/// changed, so the batch's other writes commit without it; a failed statement fails the batch
/// (`write_batch` then runs its writes one by one).
async fn apply(tx: &mut Tx, w: &Write, sqlite: bool) -> Result<Outcome, sqlx::Error> {
    match w {
        Write::UseNonce { nonce, expires_at } => {
            let used = sqlx::query(
                "INSERT INTO used_nonces (nonce, expires_at) VALUES ($1, $2) ON CONFLICT (nonce) DO NOTHING",
            )
            .bind(nonce)
            .bind(expires_at)
            .execute(&mut **tx)
            .await?;
            Ok(one_row(used.rows_affected(), Refusal::NonceUsed))
        }
        Write::Register {
            id,
            operator,
            record,
            attested_at,
            now_ms,
            gpus,
            live_after,
            attested_after,
        } => {
            // One GPU, one live node, across replicas: checked before anything changes (the
            // writer applies writes one at a time, and PostgreSQL replicas' batches commit one
            // at a time), so the check and the claim below cannot interleave with another's.
            for chunk in gpus.chunks(64) {
                let sql = format!(
                    "SELECT g.serial AS serial, g.node_id AS node_id, n.operator AS operator FROM gpu_owners g
                     JOIN nodes n ON n.id = g.node_id
                     WHERE g.node_id <> $1 AND n.last_heartbeat >= $2 AND n.attested_at >= $3
                       AND g.serial IN ({}) LIMIT 1",
                    (4..4 + chunk.len())
                        .map(|i| format!("${i}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                let mut q = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(id)
                    .bind(live_after)
                    .bind(attested_after);
                for g in chunk {
                    q = q.bind(g);
                }
                if let Some(r) = q.fetch_optional(&mut **tx).await? {
                    // Another operator's node is not named to this one.
                    let owner: String = r.try_get("operator")?;
                    return Ok(Outcome::Refused(Refusal::GpuOffered {
                        serial: r.try_get("serial")?,
                        node: if owner == *operator {
                            r.try_get("node_id")?
                        } else {
                            "of another operator".into()
                        },
                    }));
                }
            }
            sqlx::query("DELETE FROM gpu_owners WHERE node_id = $1")
                .bind(id)
                .execute(&mut **tx)
                .await?;
            for g in gpus {
                sqlx::query(
                    "INSERT INTO gpu_owners (serial, node_id) VALUES ($1, $2)
                     ON CONFLICT (serial) DO UPDATE SET node_id = excluded.node_id",
                )
                .bind(g)
                .bind(id)
                .execute(&mut **tx)
                .await?;
            }
            sqlx::query(
                "INSERT INTO nodes (id, operator, record, attested_at, last_heartbeat, heartbeat_seq, updated_ms)
                 VALUES ($1, $2, $3, $4, $4, 0, $5)
                 ON CONFLICT (id) DO UPDATE SET operator = excluded.operator, record = excluded.record,
                   attested_at = excluded.attested_at, reattest_asked = 0,
                   last_heartbeat = CASE WHEN nodes.last_heartbeat > excluded.attested_at THEN nodes.last_heartbeat ELSE excluded.attested_at END,
                   updated_ms = excluded.updated_ms",
            )
            .bind(id)
            .bind(operator)
            .bind(record)
            .bind(attested_at)
            .bind(now_ms)
            .execute(&mut **tx)
            .await?;
            sqlx::query("INSERT INTO operators (name) VALUES ($1) ON CONFLICT (name) DO NOTHING")
                .bind(operator)
                .execute(&mut **tx)
                .await?;
            Ok(Outcome::Done)
        }
        Write::Heartbeat {
            id,
            seq,
            at,
            now_ms,
        } => {
            let r = sqlx::query(
                "UPDATE nodes SET last_heartbeat = $1, heartbeat_seq = $2, updated_ms = $3
                 WHERE id = $4 AND heartbeat_seq < $2",
            )
            .bind(at)
            .bind(seq)
            .bind(now_ms)
            .bind(id)
            .execute(&mut **tx)
            .await?;
            Ok(one_row(r.rows_affected(), Refusal::StaleHeartbeat))
        }
        Write::Submit {
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
            // GPUs first: a refusal then leaves nothing behind.
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
                }
                None => event(tx, &job.id, job.created_at, None, job.state, &job.reason).await?,
            }
            Ok(Outcome::Done)
        }
        Write::Place(p) => {
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
            Ok(Outcome::Done)
        }
        Write::EndLease {
            lease,
            job_from,
            job_to,
            reason,
            now,
            now_ms,
        } => {
            let sql = format!(
                "SELECT {LEASE_COLUMNS_L}, j.state AS job_state FROM leases l JOIN jobs j ON j.id = l.job_id WHERE l.id = $1 AND l.ended_at IS NULL"
            );
            let Some(row) = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(lease)
                .fetch_optional(&mut **tx)
                .await?
            else {
                return Ok(Outcome::Refused(Refusal::NoSuchLease));
            };
            let l = lease_row(&row)?;
            let job_state: String = row.try_get("job_state")?;
            sqlx::query("UPDATE leases SET ended_at = $1, end_reason = $2 WHERE id = $3")
                .bind(now)
                .bind(reason)
                .bind(lease)
                .execute(&mut **tx)
                .await?;
            // The tenant's hold on the VM now lasts until this lease's last token expired:
            // the trigger `leases_node_hold` (migration 5) records it in `node_holds`.
            free_gpus(tx, lease).await?;
            // The lease ends whatever its job's state; the job moves only from `job_from`.
            if let Some(current) = JobState::parse(&job_state).filter(|s| job_from.contains(s)) {
                move_job(
                    tx,
                    &l.job_id,
                    current,
                    *job_to,
                    reason,
                    *now,
                    *job_to == JobState::Pending,
                )
                .await?;
            }
            touch(tx, &l.node_id, *now_ms, sqlite).await?;
            Ok(Outcome::Ended(l))
        }
        Write::Transition {
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
        Write::ExpirePending {
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
        Write::PutSetting {
            name,
            body,
            record,
            version,
            at,
            actor,
            detail,
        } => {
            let r = if *version == 1 {
                sqlx::query(
                    "INSERT INTO settings (name, body, record, version, updated_at) VALUES ($1, $2, $3, $4, $5) ON CONFLICT (name) DO NOTHING",
                )
                .bind(name)
                .bind(body)
                .bind(record)
                .bind(version)
                .bind(at)
                .execute(&mut **tx)
                .await?
            } else {
                sqlx::query(
                    "UPDATE settings SET body = $1, record = $2, version = $3, updated_at = $4 WHERE name = $5 AND version = $6",
                )
                .bind(body)
                .bind(record)
                .bind(version)
                .bind(at)
                .bind(name)
                .bind(version.saturating_sub(1))
                .execute(&mut **tx)
                .await?
            };
            if r.rows_affected() != 1 {
                return Ok(Outcome::Refused(Refusal::SettingChanged));
            }
            sqlx::query(
                "INSERT INTO admin_events (at, actor, action, detail) VALUES ($1, $2, $3, $4)",
            )
            .bind(at)
            .bind(actor)
            .bind(format!("{name}.put"))
            .bind(detail)
            .execute(&mut **tx)
            .await?;
            Ok(Outcome::Done)
        }
        Write::AskReattest { id, at, now_ms } => {
            let r =
                sqlx::query("UPDATE nodes SET reattest_asked = $1, updated_ms = $2 WHERE id = $3")
                    .bind(at)
                    .bind(now_ms)
                    .bind(id)
                    .execute(&mut **tx)
                    .await?;
            Ok(one_row(r.rows_affected(), Refusal::NoSuchNode))
        }
        Write::Reputation {
            node,
            operator,
            now_ms,
        } => {
            if let Some((id, r)) = node {
                sqlx::query("UPDATE nodes SET reputation = $1, updated_ms = $2 WHERE id = $3")
                    .bind(r)
                    .bind(now_ms)
                    .bind(id)
                    .execute(&mut **tx)
                    .await?;
            }
            if let Some((name, r)) = operator {
                sqlx::query(
                    "INSERT INTO operators (name, reputation) VALUES ($1, $2) ON CONFLICT (name) DO UPDATE SET reputation = excluded.reputation",
                )
                .bind(name)
                .bind(r)
                .execute(&mut **tx)
                .await?;
                sqlx::query("UPDATE nodes SET updated_ms = $1 WHERE operator = $2")
                    .bind(now_ms)
                    .bind(name)
                    .execute(&mut **tx)
                    .await?;
            }
            Ok(Outcome::Done)
        }
        Write::SweepNonces { now } => {
            // A minute past expiry: a replica whose clock runs behind still refuses the nonce.
            sqlx::query("DELETE FROM used_nonces WHERE expires_at <= $1")
                .bind(now - 60)
                .execute(&mut **tx)
                .await?;
            Ok(Outcome::Done)
        }
    }
}

/// The advisory lock every replica's write batch takes on PostgreSQL.
const WRITE_LOCK: i64 = 0x6367_7843;

async fn begin(db: &Database) -> Result<Tx, sqlx::Error> {
    match db.backend() {
        // Take the write lock up front: a deferred transaction that read first could not write
        // after another process's commit.
        Backend::Sqlite => db.write_pool().begin_with("BEGIN IMMEDIATE").await,
        // Replicas' batches commit one at a time: two batches taking the same GPUs in opposite
        // orders would otherwise deadlock (and wait out PostgreSQL's deadlock timeout).
        Backend::Postgres => {
            let mut tx = db.pool().begin().await?;
            cgx_service::db::lock_in_commit_order(&mut tx, WRITE_LOCK).await?;
            Ok(tx)
        }
    }
}

/// One batch in one transaction. A statement that fails rolls the batch back; its writes are
/// then run one per transaction, so only the failing one fails.
async fn write_batch(db: &Database, writes: Vec<Write>) -> Result<Vec<Outcome>, sqlx::Error> {
    let sqlite = db.backend() == Backend::Sqlite;
    let together = async {
        let mut tx = begin(db).await?;
        let mut out = Vec::with_capacity(writes.len());
        for w in &writes {
            out.push(apply(&mut tx, w, sqlite).await?);
        }
        tx.commit().await?;
        Ok::<_, sqlx::Error>(out)
    }
    .await;
    match together {
        Ok(out) => Ok(out),
        Err(e) if writes.len() == 1 => Err(e),
        Err(e) => {
            tracing::warn!(error = %e, writes = writes.len(), "a batch failed; writing one by one");
            let mut out = Vec::with_capacity(writes.len());
            for w in &writes {
                let one = async {
                    let mut tx = begin(db).await?;
                    let o = apply(&mut tx, w, sqlite).await?;
                    tx.commit().await?;
                    Ok::<_, sqlx::Error>(o)
                }
                .await;
                out.push(one.unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "a write failed");
                    Outcome::Refused(Refusal::Failed)
                }));
            }
            Ok(out)
        }
    }
}

impl Store {
    pub async fn open(url: &str, now: i64) -> Result<Self, BrokerError> {
        let db = Database::open_durable(url).await?;
        db.migrate(MIGRATION_LOCK, MIGRATIONS, now).await?;
        let batch_db = db.clone();
        let writer = GroupCommit::spawn(Box::new(move |writes: Vec<Write>| {
            let db = batch_db.clone();
            Box::pin(async move { write_batch(&db, writes).await.map_err(DbError::from) })
        }));
        Ok(Store { db, writer })
    }

    pub fn is_sqlite(&self) -> bool {
        self.db.backend() == Backend::Sqlite
    }

    pub async fn close(&self) {
        self.db.close().await;
    }

    /// See [`cgx_service::db::Database::checkpoint`]: the frames the log held.
    pub async fn checkpoint(&self) -> Result<u64, BrokerError> {
        Ok(self.db.checkpoint().await?)
    }

    /// Queue a write and wait for its batch to commit.
    pub(crate) async fn write(&self, w: Write) -> Result<Outcome, BrokerError> {
        match self.writer.write(w).await? {
            Outcome::Refused(Refusal::Failed) => {
                Err(BrokerError::Storage("a write failed; see the log".into()))
            }
            o => Ok(o),
        }
    }

    /// A setting's row: (body, signed record, version). Proves nothing until the record
    /// verifies (`settings.rs`).
    pub async fn setting(&self, name: &str) -> Result<Option<(String, String, i64)>, BrokerError> {
        let row = sqlx::query("SELECT body, record, version FROM settings WHERE name = $1")
            .bind(name)
            .fetch_optional(self.db.pool())
            .await?;
        Ok(match row {
            Some(r) => Some((
                r.try_get("body")?,
                r.try_get("record")?,
                r.try_get("version")?,
            )),
            None => None,
        })
    }

    /// The admin audit trail's newest thousand entries, oldest first: (at, actor, action,
    /// detail).
    pub async fn admin_events(&self) -> Result<Vec<(i64, String, String, String)>, BrokerError> {
        let rows = sqlx::query(
            "SELECT at, actor, action, detail FROM admin_events ORDER BY seq DESC LIMIT 1000",
        )
        .fetch_all(self.db.pool())
        .await?;
        rows.iter()
            .rev()
            .map(|r| {
                Ok((
                    r.try_get("at")?,
                    r.try_get("actor")?,
                    r.try_get("action")?,
                    r.try_get("detail")?,
                ))
            })
            .collect()
    }

    /// Nodes changed at or after `since_ms` (every node for 0).
    pub async fn nodes_since(&self, since_ms: i64) -> Result<Vec<NodeRow>, BrokerError> {
        let rows = sqlx::query(
            "SELECT id, record, last_heartbeat, heartbeat_seq, reputation, updated_ms, reattest_asked FROM nodes WHERE updated_ms >= $1",
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
                    reattest_asked: r.try_get("reattest_asked")?,
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

    /// Allocated GPUs of `nodes` (every node for `None`) as bitmaps, with the tenant whose
    /// leases hold each VM: open ones, or ones that ended after `ended_after` (their last
    /// token may still be valid until `ended_at + ttl`).
    ///
    /// Read as [`other_tenant`] reads them: open leases, `node_holds` (each tenant's latest
    /// ended lease per node, so a node's many leases of one tenant cost one row) and rows from
    /// before migration 5; each hold counts only for the tenant its token, which the broker
    /// signed, names.
    pub async fn allocations(
        &self,
        nodes: Option<&[String]>,
        ended_after: i64,
        ttl: i64,
        key: &[u8; 32],
    ) -> Result<HashMap<String, NodeUse>, BrokerError> {
        const GPUS: &str = "SELECT node_id, gpu FROM allocations WHERE 1 = 1";
        /// (node, token, end): `NULL` end while open.
        const OPEN: &str = "SELECT node_id, token, ended_at FROM leases WHERE ended_at IS NULL";
        const HOLDS: &str =
            "SELECT node_id, token, last_end AS ended_at FROM node_holds WHERE last_end >= $1";
        const LEGACY: &str =
            "SELECT node_id, token, ended_at FROM leases WHERE tenant = '' AND ended_at >= $1";
        let (mut gpus, mut holds) = (Vec::new(), Vec::new());
        // In chunks: a statement takes a bounded number of parameters (every node: one
        // statement each, unfiltered).
        let chunks: Vec<&[String]> = match nodes {
            None => vec![&[]],
            Some([]) => Vec::new(),
            Some(ids) => ids.chunks(500).collect(),
        };
        for chunk in chunks {
            let filter = |from: usize| {
                if nodes.is_none() {
                    return String::new();
                }
                let list = (from..from + chunk.len())
                    .map(|i| format!("${i}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                format!(" AND node_id IN ({list})")
            };
            for (i, (sql, timed)) in [(GPUS, false), (OPEN, false), (HOLDS, true), (LEGACY, true)]
                .into_iter()
                .enumerate()
            {
                let from = if timed { 2 } else { 1 };
                let sql = format!("{sql}{}", filter(from));
                let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
                if timed {
                    q = q.bind(ended_after);
                }
                if nodes.is_some() {
                    for id in chunk {
                        q = q.bind(id.clone());
                    }
                }
                let rows = q.fetch_all(self.db.pool()).await?;
                if i == 0 {
                    gpus.extend(rows);
                } else {
                    holds.extend(rows);
                }
            }
        }
        let mut out: HashMap<String, NodeUse> = HashMap::new();
        for r in gpus {
            let id: String = r.try_get("node_id")?;
            let gpu: i64 = r.try_get("gpu")?;
            if (0..64).contains(&gpu) {
                out.entry(id).or_default().gpus |= 1u64 << gpu;
            }
        }
        for r in holds {
            let id: String = r.try_get("node_id")?;
            let token: String = r.try_get("token")?;
            let Some(tenant) = lease_tenant(&token, key) else {
                tracing::error!(node = %id, "a lease row without a valid broker signature; it holds no tenant");
                continue;
            };
            let ended: Option<i64> = r.try_get("ended_at")?;
            let until = ended.map_or(i64::MAX, |e| e.saturating_add(ttl));
            hold(out.entry(id).or_default(), tenant, until);
        }
        Ok(out)
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

    /// Open leases of `node` (every node for `None`).
    pub async fn open_leases(&self, node: Option<&str>) -> Result<Vec<LeaseRow>, BrokerError> {
        let rows = match node {
            Some(n) => {
                let sql = format!(
                    "SELECT {LEASE_COLUMNS} FROM leases WHERE node_id = $1 AND ended_at IS NULL"
                );
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(n)
                    .fetch_all(self.db.pool())
                    .await?
            }
            None => {
                let sql = format!("SELECT {LEASE_COLUMNS} FROM leases WHERE ended_at IS NULL");
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .fetch_all(self.db.pool())
                    .await?
            }
        };
        sorted_by_id(&rows)
    }

    /// Open leases whose job ran its duration by `now`.
    pub async fn due_leases(&self, now: i64) -> Result<Vec<LeaseRow>, BrokerError> {
        let sql =
            format!("SELECT {LEASE_COLUMNS} FROM leases WHERE ended_at IS NULL AND ends_at <= $1");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(now)
            .fetch_all(self.db.pool())
            .await?;
        sorted_by_id(&rows)
    }
}

/// Lease rows in id order, sorted here rather than by `ORDER BY id`: with that clause SQLite
/// walks the whole table (every lease ever, in key order) instead of the open leases' index.
fn sorted_by_id(rows: &[sqlx::any::AnyRow]) -> Result<Vec<LeaseRow>, BrokerError> {
    let mut leases = rows.iter().map(lease_row).collect::<Result<Vec<_>, _>>()?;
    leases.sort_unstable_by(|a, b| a.id.cmp(&b.id));
    Ok(leases)
}

/// Mark a node changed (its allocations), so other replicas reload it. SQLite serves one
/// replica: nobody else to tell.
async fn touch(tx: &mut Tx, node: &str, now_ms: i64, sqlite: bool) -> Result<(), sqlx::Error> {
    if sqlite {
        return Ok(());
    }
    sqlx::query("UPDATE nodes SET updated_ms = $1 WHERE id = $2")
        .bind(now_ms)
        .bind(node)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// A write that must change exactly one row: done when it did, refused for `why` otherwise.
fn one_row(rows: u64, why: Refusal) -> Outcome {
    if rows == 1 {
        Outcome::Done
    } else {
        Outcome::Refused(why)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn record(id: &str) -> super::super::index::NodeRecord {
        serde_json::from_value(serde_json::json!({
            "id": id, "node_key": "k", "tee_thumbprint": "t", "operator": "op",
            "region": "eu-west", "tee": "snp", "sim": true, "gpu_model": "H100",
            "gpu_chip": "GH100", "gpu_count": 8, "gpu_memory_gib": 80, "price": 1_000_000,
            "status": "affirming", "violations": [], "attested_at": 0, "ear_expires_at": 0,
            "ear_digest": "", "claims": {},
        }))
        .unwrap()
    }

    /// The placement write's one-tenant-per-VM check reads whose a lease is from its signed
    /// token: the `tenant` column (migration 5) only narrows which rows it reads. A row from
    /// before the column (`''`) still holds the VM for its token's tenant; a column naming
    /// another tenant over a token of the placing tenant's holds nothing; a row naming another
    /// tenant without a valid signature holds nothing.
    #[tokio::test]
    async fn who_holds_a_vm_is_read_from_signed_tokens_not_the_tenant_column() {
        let dir = std::env::temp_dir().join(format!("cgx-store-holds-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("sqlite://{}", dir.join("broker.db").display());
        let store = Store::open(&url, 1_000).await.unwrap();
        let pkcs8 = aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(
            &aws_lc_rs::rand::SystemRandom::new(),
        )
        .unwrap();
        let keys = super::super::lease::Keys::from_pkcs8(pkcs8.as_ref().to_vec()).unwrap();
        let node = record("n1");
        let token = |lease: &str, tenant: &str| {
            keys.lease_token(lease, "j", tenant, &node, &[0], &[], 1_000, 5_000, 120)
                .unwrap()
        };
        let place = |tenant: &str| PlacementRow {
            job_id: "j".into(),
            tenant: tenant.into(),
            tenant_ended_after: 1_000 - 120,
            broker_key: keys.public,
            node_id: "n1".into(),
            lease_id: "new".into(),
            gpus: vec![1],
            token: String::new(),
            started_at: 1_000,
            ends_at: 5_000,
            reason: String::new(),
            now_ms: 1_000_000,
        };
        let insert = |id: &'static str, tenant: &'static str, token: String| async move {
            (
                "INSERT INTO leases (id, job_id, node_id, gpus, token, started_at, ends_at, tenant) VALUES ($1, 'j', 'n1', '0', $2, 1000, 5000, $3)",
                vec![id.to_string(), token, tenant.to_string()],
            )
        };
        let run = |rows: Vec<(&'static str, Vec<String>)>| {
            let store = &store;
            async move {
                sqlx::query("DELETE FROM leases")
                    .execute(store.db.pool())
                    .await
                    .unwrap();
                for (sql, binds) in rows {
                    let mut q = sqlx::query(sqlx::AssertSqlSafe(sql.to_string()));
                    for b in binds {
                        q = q.bind(b);
                    }
                    q.execute(store.db.pool()).await.unwrap();
                }
            }
        };
        // The write's answer: the check alone, and the guarded insert that runs it (they must
        // agree), each in a transaction rolled back.
        let exec = |sql: &'static str| {
            let store = &store;
            async move {
                sqlx::query(sql).execute(store.db.pool()).await.unwrap();
            }
        };
        let check = |tenant: &'static str| {
            let store = &store;
            async move {
                let mut tx = store.db.pool().begin().await.unwrap();
                let t = other_tenant(&mut tx, &place(tenant)).await.unwrap();
                tx.rollback().await.unwrap();
                let mut tx = store.db.pool().begin().await.unwrap();
                let taken = take_gpus_for_tenant(&mut tx, &place(tenant)).await.unwrap();
                tx.rollback().await.unwrap();
                match (&t, taken) {
                    (None, None) => {}
                    (Some(a), Some(Refusal::OtherTenant(b))) => assert_eq!(*a, b),
                    (t, taken) => panic!("check {t:?}, guarded insert {taken:?}"),
                }
                t
            }
        };
        // What a replica's index learns (`allocations`, on sync): the same, as (tenant, until).
        let held = || {
            let store = &store;
            let key = keys.public;
            async move {
                store
                    .allocations(Some(&["n1".to_string()]), 1_000 - 120, 120, &key)
                    .await
                    .unwrap()
                    .remove("n1")
                    .and_then(|u| u.tenant)
            }
        };
        // Acme's own leases, however many, hold nothing against acme; they hold against globex.
        run(vec![
            insert("a1", "acme", token("a1", "acme")).await,
            insert("a2", "acme", token("a2", "acme")).await,
        ])
        .await;
        assert_eq!(check("acme").await, None);
        assert_eq!(check("globex").await.as_deref(), Some("acme"));
        assert_eq!(held().await, Some(("acme".into(), i64::MAX)));
        // The other way round: the holder's name sorts after the placing tenant's (the guard
        // looks on both sides of the placing tenant's name, `< t` and `> t`).
        run(vec![insert("g1", "globex", token("g1", "globex")).await]).await;
        assert_eq!(check("acme").await.as_deref(), Some("globex"));
        assert_eq!(check("umbrella").await.as_deref(), Some("globex"));
        assert_eq!(check("globex").await, None);
        // A row from before migration 5: no tenant column value, its token still decides.
        run(vec![insert("old", "", token("old", "globex")).await]).await;
        assert_eq!(check("acme").await.as_deref(), Some("globex"));
        assert_eq!(check("globex").await, None);
        assert_eq!(held().await, Some(("globex".into(), i64::MAX)));
        // A lease row signed before records were typed (`typ` JWT, the lease audience): still
        // this broker's lease, read back from its own row.
        let untyped = |lease: &str, tenant: &str, aud: &str| {
            use base64::Engine;
            let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
            let claims = serde_json::json!({"lease": lease, "job": "j", "tenant": tenant,
                "node": "n1", "gpus": [0], "resources": [], "node_key": "t", "aud": aud,
                "iss": "cgx-broker", "iat": 1_000, "exp": 1_120, "until": 5_000});
            let m = format!(
                "{}.{}",
                b64.encode(br#"{"alg":"EdDSA","typ":"JWT"}"#),
                b64.encode(claims.to_string())
            );
            let pair = aws_lc_rs::signature::Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap();
            format!("{m}.{}", b64.encode(pair.sign(m.as_bytes()).as_ref()))
        };
        run(vec![
            insert("old-typ", "", untyped("old-typ", "globex", "cgx-kbs")).await,
        ])
        .await;
        assert_eq!(check("acme").await.as_deref(), Some("globex"));
        assert_eq!(held().await, Some(("globex".into(), i64::MAX)));
        // Untyped under another kind's audience (a node record's): no lease, holds nothing.
        run(vec![
            insert(
                "old-aud",
                "",
                untyped("old-aud", "globex", "cgx-broker/node"),
            )
            .await,
        ])
        .await;
        assert_eq!(check("acme").await, None);
        assert_eq!(held().await, None);
        // The column names globex, the signed token acme: acme's lease, not globex's.
        run(vec![insert("lie", "globex", token("lie", "acme")).await]).await;
        assert_eq!(check("acme").await, None);
        assert_eq!(held().await, Some(("acme".into(), i64::MAX)));
        // A row naming globex without this broker's signature holds nothing.
        run(vec![insert("forged", "globex", "not.a.token".into()).await]).await;
        assert_eq!(check("acme").await, None);
        assert_eq!(held().await, None);
        // A GPU another lease holds: refused as taken, nothing left behind.
        sqlx::query("INSERT INTO allocations (node_id, gpu, lease_id) VALUES ('n1', 1, 'x')")
            .execute(store.db.pool())
            .await
            .unwrap();
        let mut tx = store.db.pool().begin().await.unwrap();
        let taken = take_gpus_for_tenant(&mut tx, &place("acme")).await.unwrap();
        assert!(matches!(taken, Some(Refusal::GpuTaken)), "{taken:?}");
        let mine: i64 = sqlx::query("SELECT COUNT(*) AS n FROM allocations WHERE lease_id = 'new'")
            .fetch_one(&mut *tx)
            .await
            .unwrap()
            .try_get("n")
            .unwrap();
        assert_eq!(mine, 0);
        tx.rollback().await.unwrap();
        exec("DELETE FROM allocations").await;
        // An ended lease (ended by the broker's own write) holds while its last token may
        // live, then no more; of one tenant's leases the latest end counts, ended in any order.
        run(vec![
            insert("ended", "globex", token("ended", "globex")).await,
            insert("earlier", "globex", token("earlier", "globex")).await,
            (
                "INSERT INTO jobs (id, tenant, spec, state, reason, created_at, updated_at) VALUES ('j', 'globex', '{}', 'placed', '', 0, 0)",
                vec![],
            ),
        ])
        .await;
        let end = |lease: &'static str, at: i64| {
            let store = &store;
            async move {
                let w = Write::EndLease {
                    lease: lease.into(),
                    job_from: &[],
                    job_to: JobState::Cancelled,
                    reason: "test".into(),
                    now: at,
                    now_ms: at * 1000,
                };
                assert!(matches!(store.write(w).await.unwrap(), Outcome::Ended(_)));
            }
        };
        end("ended", 890).await;
        end("earlier", 885).await;
        assert_eq!(check("acme").await.as_deref(), Some("globex"));
        assert_eq!(check("umbrella").await.as_deref(), Some("globex"));
        assert_eq!(held().await, Some(("globex".into(), 890 + 120)));
        // However many leases a tenant churned through on the node, one row says so.
        let n: i64 = sqlx::query("SELECT COUNT(*) AS n FROM node_holds")
            .fetch_one(store.db.pool())
            .await
            .unwrap()
            .try_get("n")
            .unwrap();
        assert_eq!(n, 1);
        // A lease ending in the same second writes nothing: the row keeps the first token.
        run(vec![
            insert("same", "globex", token("same", "globex")).await,
        ])
        .await;
        end("same", 890).await;
        let kept: String = sqlx::query("SELECT token FROM node_holds")
            .fetch_one(store.db.pool())
            .await
            .unwrap()
            .try_get("token")
            .unwrap();
        assert_eq!(kept, token("ended", "globex"));
        exec("UPDATE node_holds SET last_end = 870").await;
        assert_eq!(check("acme").await, None);
        assert_eq!(held().await, None);
        // A node_holds row naming globex over another tenant's token holds for that tenant.
        sqlx::query("UPDATE node_holds SET last_end = 890, token = $1")
            .bind(token("x", "initech"))
            .execute(store.db.pool())
            .await
            .unwrap();
        assert_eq!(check("acme").await.as_deref(), Some("initech"));
        assert_eq!(check("initech").await, None);
        assert_eq!(held().await, Some(("initech".into(), 890 + 120)));
        // A lease ended by any statement (another replica, an operator's SQL) leaves its hold:
        // the trigger writes it, and an earlier end never overwrites a later one.
        run(vec![
            insert("other", "umbrella", token("other", "umbrella")).await,
        ])
        .await;
        for at in [950, 940] {
            sqlx::query("UPDATE leases SET ended_at = $1 WHERE id = 'other'")
                .bind(at)
                .execute(store.db.pool())
                .await
                .unwrap();
        }
        let last: i64 = sqlx::query("SELECT last_end FROM node_holds WHERE tenant = 'umbrella'")
            .fetch_one(store.db.pool())
            .await
            .unwrap()
            .try_get("last_end")
            .unwrap();
        assert_eq!(last, 950);
        exec("DELETE FROM node_holds WHERE tenant = 'umbrella'").await;
        // Legacy rows (no tenant column value) that ended within the TTL still hold.
        run(vec![
            insert("old-ended", "", token("old-ended", "globex")).await,
        ])
        .await;
        exec("DELETE FROM node_holds").await;
        exec("UPDATE leases SET ended_at = 900").await;
        assert_eq!(check("acme").await.as_deref(), Some("globex"));
        assert_eq!(held().await, Some(("globex".into(), 900 + 120)));
        store.close().await;
        let _ = std::fs::remove_dir_all(&dir);
    }
}
