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
//!   (the service's `monitor.rs` and `leases.rs`).
//!
//! Each domain's writes (an enum) and reads are its own module — `nodes.rs`, `jobs.rs`,
//! `leases.rs`, `settings.rs` — and [`Write`] is one of them: the writer batches every
//! domain's writes in one transaction.

use cgx_service::db::{Backend, Database, DbError, GroupCommit, Migration};
use sqlx::Row;

use super::error::BrokerError;

mod archive;
mod console;
mod jobs;
mod leases;
mod ledger;
mod metering;
mod mirror;
mod nodes;
mod pow;
mod reputation;
mod settings;

pub(crate) use archive::Archived;
pub use console::LeaseHistory;
pub(crate) use jobs::JobWrite;
pub(crate) use leases::{LeaseWrite, lease_tenant};
pub use ledger::{EscrowOpen, EscrowRow, SettledWindow, WindowSettle};
pub(crate) use ledger::{LedgerWrite, insert_json};
pub(crate) use metering::MeteringWrite;
pub use mirror::MirroredRelease;
pub(crate) use nodes::NodeWrite;
pub use pow::ChallengeRow;
pub(crate) use pow::{PowWrite, Slash};
pub(crate) use reputation::{ReputationWrite, UPTIME_CHUNK};
pub(crate) use settings::SettingWrite;

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
/// submission under a key the database does not hold (`keys.rs`, `Keys::seal_job`), checked
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

/// Migration 7: the admin trail becomes the audit table both services keep
/// (`cgx_service::audit`: `subject` added, read and written by one module, each event a
/// future log leaf). Its rows so far are settings' puts (`<name>.put`): the name is the
/// subject. Order is kept; the `seq` numbers start again at 1. On PostgreSQL the old table is
/// locked first, so a put of an older replica still in flight lands before the copy or waits
/// and then fails, never between copy and drop. Replicas upgrade together: an older one has no
/// `admin_events` to write after this.
macro_rules! audit_v7 {
    ($lock:literal, $seq:literal) => {
        concat!(
            $lock,
            "CREATE TABLE audit (",
            $seq,
            ", at BIGINT NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL,
        subject TEXT NOT NULL, detail TEXT NOT NULL);
     INSERT INTO audit (at, actor, action, subject, detail)
        SELECT at, actor, action,
          CASE WHEN action LIKE '%.put' THEN substr(action, 1, length(action) - 4) ELSE action END,
          detail
        FROM admin_events ORDER BY seq;
     DROP TABLE admin_events"
        )
    };
}

/// Migration 8 (issue 31), the same on both backends: accepted metering records, one per
/// (lease, sequence), with the hash the next must carry.
const METERING_V8: &str = "CREATE TABLE metering (
        lease_id TEXT NOT NULL, seq BIGINT NOT NULL, hash TEXT NOT NULL, token TEXT NOT NULL,
        accepted_at BIGINT NOT NULL, PRIMARY KEY (lease_id, seq))";

/// Migration 9 (issue 31): proof-of-work challenges from issue to verdict (`pow.rs`), each
/// sealed by the broker; the node's last failed proof; and the same against its GPUs' serials,
/// so a node that registers anew with the same GPUs carries the penalty. The backends differ only in the
/// proof's column type.
macro_rules! pow_v9 {
    ($blob:literal) => {
        concat!(
            "CREATE TABLE pow_challenges (
        id TEXT PRIMARY KEY, node_id TEXT NOT NULL, lease_id TEXT NOT NULL, gpu BIGINT NOT NULL,
        win BIGINT NOT NULL, nonce TEXT NOT NULL, n BIGINT NOT NULL, k BIGINT NOT NULL,
        expected_ms BIGINT NOT NULL, gpu_deadline_ms BIGINT NOT NULL, issued_ms BIGINT NOT NULL,
        deadline_ms BIGINT NOT NULL, node_key TEXT NOT NULL, serials TEXT NOT NULL,
        seal TEXT NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL, committed_ms BIGINT,
        open_deadline_ms BIGINT, gpu_us BIGINT, root TEXT, receipt TEXT, answered_ms BIGINT,
        proof_sha256 TEXT, proof_receipt TEXT, proof ",
            $blob,
            ");
     CREATE INDEX pow_state ON pow_challenges (state, deadline_ms);
     CREATE INDEX pow_committed ON pow_challenges (state, open_deadline_ms);
     CREATE INDEX pow_lease_gpu ON pow_challenges (lease_id, gpu, issued_ms);
     CREATE INDEX pow_node ON pow_challenges (node_id, gpu, issued_ms);
     CREATE TABLE pow_penalties (
        serial TEXT PRIMARY KEY, at BIGINT NOT NULL, reason TEXT NOT NULL);
     ALTER TABLE nodes ADD COLUMN pow_failed_at BIGINT NOT NULL DEFAULT 0;
     ALTER TABLE nodes ADD COLUMN pow_reason TEXT NOT NULL DEFAULT ''"
        )
    };
}

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
    Migration {
        version: 7,
        sqlite: audit_v7!("", "seq INTEGER PRIMARY KEY"),
        postgres: audit_v7!(
            "LOCK TABLE admin_events IN EXCLUSIVE MODE; ",
            "seq BIGSERIAL PRIMARY KEY"
        ),
    },
    Migration {
        version: 8,
        sqlite: METERING_V8,
        postgres: METERING_V8,
    },
    Migration {
        version: 9,
        sqlite: pow_v9!("BLOB"),
        postgres: pow_v9!("BYTEA"),
    },
    // Migration 10 (issue 32): the ledger (`ledger.rs`).
    Migration {
        version: 10,
        sqlite: ledger::ledger_v10!("seq INTEGER PRIMARY KEY"),
        postgres: ledger::ledger_v10!("seq BIGSERIAL PRIMARY KEY"),
    },
    // Migration 11 (issue 32): reputation's decayed counts (`reputation.rs`).
    Migration {
        version: 11,
        sqlite: reputation::REPUTATION_V11,
        postgres: reputation::REPUTATION_V11,
    },
    // Migration 12 (issue 33): the transparency log over the audit trail
    // (`cgx_service::tlog`).
    Migration {
        version: 12,
        sqlite: cgx_service::tlog::LOG_TABLES,
        postgres: cgx_service::tlog::LOG_TABLES,
    },
    // Migration 13 (issue 33): the archive the log's leaves name by digest (`archive.rs`).
    Migration {
        version: 13,
        sqlite: archive::ARCHIVE_V13,
        postgres: archive::ARCHIVE_V13,
    },
    // Migration 14 (issue 33): how many witnesses cosigned each checkpoint.
    Migration {
        version: 14,
        sqlite: cgx_service::tlog::LOG_WITNESSED,
        postgres: cgx_service::tlog::LOG_WITNESSED,
    },
    // Migration 15 (issue 34): the console's pages by keyset (`console.rs`).
    Migration {
        version: 15,
        sqlite: console::CONSOLE_V15,
        postgres: console::CONSOLE_V15,
    },
    // Migration 16 (issue 34): the mirror of the KBS log's releases (`mirror.rs`).
    Migration {
        version: 16,
        sqlite: mirror::MIRROR_V16,
        postgres: mirror::MIRROR_V16,
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
    /// When its last proof-of-work failed or was missed (0: never), and why.
    pub pow_failed_at: i64,
    pub pow_reason: String,
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
    /// MAC of (id, tenant, spec, created_at) under the broker's job key (`keys.rs`): a row a
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
    pub(crate) db: Database,
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

/// One write, owned (it waits in the writer's queue): each domain's writes are its module's.
#[derive(Debug)]
pub(crate) enum Write {
    Node(NodeWrite),
    Job(JobWrite),
    Lease(LeaseWrite),
    Setting(SettingWrite),
    Metering(MeteringWrite),
    Pow(PowWrite),
    Ledger(LedgerWrite),
    Reputation(ReputationWrite),
    /// A decision recorded on its own (a refusal: nothing else changes), with the archived
    /// pieces its leaf names.
    Audit(AuditWrite),
}

/// An audit event to record in the batch's transaction, and the pieces it names.
#[derive(Debug)]
pub(crate) struct AuditWrite {
    pub at: i64,
    pub actor: String,
    pub action: &'static str,
    pub subject: String,
    pub detail: serde_json::Value,
    pub archive: Vec<Archived>,
}

impl From<AuditWrite> for Write {
    fn from(w: AuditWrite) -> Self {
        Write::Audit(w)
    }
}

impl From<ReputationWrite> for Write {
    fn from(w: ReputationWrite) -> Self {
        Write::Reputation(w)
    }
}

impl From<LedgerWrite> for Write {
    fn from(w: LedgerWrite) -> Self {
        Write::Ledger(w)
    }
}

impl From<PowWrite> for Write {
    fn from(w: PowWrite) -> Self {
        Write::Pow(w)
    }
}

impl From<NodeWrite> for Write {
    fn from(w: NodeWrite) -> Self {
        Write::Node(w)
    }
}

impl From<JobWrite> for Write {
    fn from(w: JobWrite) -> Self {
        Write::Job(w)
    }
}

impl From<LeaseWrite> for Write {
    fn from(w: LeaseWrite) -> Self {
        Write::Lease(w)
    }
}

impl From<SettingWrite> for Write {
    fn from(w: SettingWrite) -> Self {
        Write::Setting(w)
    }
}

impl From<MeteringWrite> for Write {
    fn from(w: MeteringWrite) -> Self {
        Write::Metering(w)
    }
}

/// What a write did.
#[derive(Debug)]
pub(crate) enum Outcome {
    Done,
    /// Not applied (and undone): why.
    Refused(Refusal),
    /// The lease a [`LeaseWrite::EndLease`] ended.
    Ended(LeaseRow),
    /// Per item of a write of several (the ledger's): whether it moved money (`false`: done
    /// before), or why it was refused.
    Items(Vec<Result<bool, String>>),
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
    /// The lease's metering chain moved since the record was checked (another replica
    /// accepted that window, or a rival of its predecessor).
    MeteringMoved,
    /// The challenge is not this node's, already answered, or past its deadline.
    PowNotOpen,
    /// The tenant has as many jobs pending as it may.
    TooManyPending,
    /// A GPU of the registration is offered by another live node.
    GpuOffered {
        serial: String,
        node: String,
    },
    /// The node's GPUs serve another tenant's leases (a VM serves one tenant at a time).
    OtherTenant(String),
    /// The job's other leases spent or released escrow since this placement's reservation
    /// was computed.
    EscrowMoved,
    /// The ledger refused the write's transfers (the tenant cannot fund the escrow, a
    /// deposit reused an id): why.
    Funds(String),
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
    /// The lease's escrow, opened in the same write.
    pub escrow: Option<Box<EscrowOpen>>,
}

/// One write inside the batch's transaction. A write refused for a reason (a used nonce, a
/// GPU taken, a job no longer pending) checks before it changes anything, or undoes what it
/// changed, so the batch's other writes commit without it; a failed statement fails the batch
/// (`write_batch` then runs its writes one by one).
async fn apply(tx: &mut Tx, w: &Write, sqlite: bool) -> Result<Outcome, sqlx::Error> {
    match w {
        Write::Node(w) => nodes::apply(tx, w).await,
        Write::Job(w) => jobs::apply(tx, w, sqlite).await,
        Write::Lease(w) => leases::apply(tx, w, sqlite).await,
        Write::Setting(w) => settings::apply(tx, w).await,
        Write::Metering(w) => metering::apply(tx, w).await,
        Write::Pow(w) => pow::apply(tx, w).await,
        Write::Ledger(w) => ledger::apply(tx, w).await,
        Write::Reputation(w) => reputation::apply(tx, w).await,
        Write::Audit(w) => {
            archive::insert_in(tx, &w.archive, w.at).await?;
            cgx_service::audit::record(
                tx,
                w.at,
                &cgx_service::audit::NewEvent {
                    actor: &w.actor,
                    action: w.action,
                    subject: &w.subject,
                    detail: &w.detail,
                },
            )
            .await?;
            Ok(Outcome::Done)
        }
    }
}

/// At most this many audit rows are integrated in one pass (one write transaction, which
/// holds the writer): a backlog drains in passes one after another.
pub(crate) const LOG_PASS: i64 = 16_384;

/// The service name the broker's leaves carry.
pub const SERVICE: &str = "cgx-broker";

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

    /// Integrate the audit rows committed since the last pass into the log and sign a
    /// checkpoint, in a write transaction of its own (under the replicas' write lock on
    /// PostgreSQL: one integrator at a time).
    pub(crate) async fn integrate_log(
        &self,
        signer: &cgx_tlog::note::NoteSigner,
        at: i64,
        pinned: Option<cgx_service::tlog::Pinned>,
    ) -> Result<Option<cgx_service::tlog::Integrated>, BrokerError> {
        // Nothing committed since the last leaf: no write lock taken (the task asks several
        // times a second, and the writer serves every request).
        if !cgx_service::tlog::behind(self.db.pool())
            .await
            .map_err(|e| BrokerError::Storage(e.to_string()))?
        {
            return Ok(None);
        }
        let mut tx = begin(&self.db).await?;
        let done = cgx_service::tlog::integrate(&mut tx, SERVICE, signer, at, LOG_PASS, pinned)
            .await
            .map_err(|e| BrokerError::Storage(e.to_string()))?;
        tx.commit().await?;
        Ok(done)
    }

    /// Queue a write and wait for its batch to commit.
    pub(crate) async fn write(&self, w: impl Into<Write>) -> Result<Outcome, BrokerError> {
        match self.writer.write(w.into()).await? {
            Outcome::Refused(Refusal::Failed) => {
                Err(BrokerError::Storage("a write failed; see the log".into()))
            }
            o => Ok(o),
        }
    }
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
