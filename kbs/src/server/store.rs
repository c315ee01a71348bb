//! Storage: sessions, sealed resources, policies and the audit trail, in SQLite (embedded
//! default) or PostgreSQL (several replicas), through sqlx's `Any` driver with one SQL dialect
//! (`$n` placeholders work on both).
//!
//! With `database` sessions ([`super::sessions`]) they live here, so any replica serves any step
//! of a handshake; a challenge is answered by one INSERT keyed by the session id, so it is
//! single-use across replicas too ([`super::session`]). Resources are
//! sealed with AES-256-GCM under the key-encryption key (never stored). Everything that decides
//! a release is bound into the AAD — the path, whether a lease is required, and a version — so
//! someone who can write the database cannot move a sealed value to another path, drop a
//! lease requirement, or (on a replica that has read a newer version) put an older value back.
//! A restart with another KEK is refused at open.
//!
//! The writes on every flow — the audit row at release, and with `database` sessions the
//! session row at attestation — are group-committed: each caller waits for its own commit,
//! the database sees one statement per batch. On an SQLite file the callers write the batches
//! themselves ([`InlineCommit`], no thread hand-offs); on PostgreSQL a writer task per table
//! does ([`GroupCommit`]). Sealed resources are read through a cache of [`RESOURCE_CACHE`]: a
//! change made on this replica clears it at once, one made on another replica is seen within
//! that time (as release policies are).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_lc_rs::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use aws_lc_rs::hmac;
use cgx_service::SharedClock;
use cgx_service::db::{
    Backend, Commit, Database, DbError, GroupCommit, InlineCommit, Migration, WriterConn,
    placeholders,
};
use sqlx::Row;

use super::error::KbsError;
pub use super::session::id_time_prefix;
use super::watermark::Watermarks;

/// How long a sealed resource read from the database is served from memory.
pub const RESOURCE_CACHE: Duration = Duration::from_secs(1);

/// The PostgreSQL advisory lock replicas take to migrate ("cgxkbs").
const MIGRATION_LOCK: i64 = 0x6367_786b_6273;

/// Migrations, versioned; each runs once, in order, in a transaction.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        sqlite: "CREATE TABLE IF NOT EXISTS sessions (
        id TEXT PRIMARY KEY, nonce TEXT NOT NULL, tee TEXT NOT NULL, state TEXT NOT NULL,
        created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL, tee_pubkey TEXT, token TEXT);
     CREATE INDEX IF NOT EXISTS sessions_expiry ON sessions (expires_at);
     CREATE TABLE IF NOT EXISTS resources (
        path TEXT PRIMARY KEY, repository TEXT NOT NULL, sealed BLOB NOT NULL,
        requires_lease BIGINT NOT NULL, updated_at BIGINT NOT NULL);
     CREATE TABLE IF NOT EXISTS policies (
        scope TEXT PRIMARY KEY, body TEXT NOT NULL, updated_at BIGINT NOT NULL);
     CREATE TABLE IF NOT EXISTS audit (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, at BIGINT NOT NULL, actor TEXT NOT NULL,
        action TEXT NOT NULL, subject TEXT NOT NULL, detail TEXT NOT NULL);",
        postgres: "CREATE TABLE IF NOT EXISTS sessions (
        id TEXT PRIMARY KEY, nonce TEXT NOT NULL, tee TEXT NOT NULL, state TEXT NOT NULL,
        created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL, tee_pubkey TEXT, token TEXT);
     CREATE INDEX IF NOT EXISTS sessions_expiry ON sessions (expires_at);
     CREATE TABLE IF NOT EXISTS resources (
        path TEXT PRIMARY KEY, repository TEXT NOT NULL, sealed BYTEA NOT NULL,
        requires_lease BIGINT NOT NULL, updated_at BIGINT NOT NULL);
     CREATE TABLE IF NOT EXISTS policies (
        scope TEXT PRIMARY KEY, body TEXT NOT NULL, updated_at BIGINT NOT NULL);
     CREATE TABLE IF NOT EXISTS audit (
        seq BIGSERIAL PRIMARY KEY, at BIGINT NOT NULL, actor TEXT NOT NULL,
        action TEXT NOT NULL, subject TEXT NOT NULL, detail TEXT NOT NULL);",
    },
    Migration {
        version: 2,
        // SQLite: `audit` without AUTOINCREMENT. Rows are never deleted, so `seq` (max + 1)
        // still only grows, and a release's commit no longer rewrites a `sqlite_sequence`
        // page too (~4 KB less written per flow, of ~30). Rows keep their numbers.
        sqlite: "CREATE TABLE audit_v2 (
            seq INTEGER PRIMARY KEY, at BIGINT NOT NULL, actor TEXT NOT NULL,
            action TEXT NOT NULL, subject TEXT NOT NULL, detail TEXT NOT NULL);
         INSERT INTO audit_v2 (seq, at, actor, action, subject, detail)
            SELECT seq, at, actor, action, subject, detail FROM audit;
         DROP TABLE audit;
         ALTER TABLE audit_v2 RENAME TO audit;",
        // PostgreSQL: BIGSERIAL has no such cost; nothing to change.
        postgres: "",
    },
    Migration {
        version: 3,
        // Values the store keeps about itself (the KEK check). Resources sealed before this
        // version (path-only AAD) no longer open: the sealed format now binds the lease
        // requirement and a version, and re-sealing them here would let anyone who can write
        // the database launder an old value through it. Re-upload them.
        sqlite: "CREATE TABLE IF NOT EXISTS kbs_meta (name TEXT PRIMARY KEY, value BLOB NOT NULL)",
        postgres: "CREATE TABLE IF NOT EXISTS kbs_meta (name TEXT PRIMARY KEY, value BYTEA NOT NULL)",
    },
    Migration {
        version: 4,
        // Policy rows carry a MAC under a KEK-derived key over (scope, body): a row written
        // outside the KBS — a permissive release policy, other reference values — is refused,
        // not obeyed. Rows from before this version have none: re-put them.
        sqlite: "ALTER TABLE policies ADD COLUMN mac TEXT",
        postgres: "ALTER TABLE policies ADD COLUMN IF NOT EXISTS mac TEXT",
    },
    Migration {
        version: 5,
        // …and a version under that MAC, so an older row put back (or a row removed: there is
        // no API to remove one) is refused by a replica that has read a newer one
        // (`watermark.rs`). Rows MAC'd without a version: re-put them.
        sqlite: "ALTER TABLE policies ADD COLUMN version BIGINT",
        postgres: "ALTER TABLE policies ADD COLUMN IF NOT EXISTS version BIGINT",
    },
    Migration {
        version: 6,
        // SQLite: no index on `expires_at`. Session ids begin with their challenge's expiry,
        // zero-padded, so the primary key orders them by time and the sweep deletes a range of
        // it ([`Store::sweep_sessions`]); every attestation's commit writes one b-tree fewer.
        // PostgreSQL keeps it: its text collation is not byte order.
        sqlite: "DROP INDEX IF EXISTS sessions_expiry",
        postgres: "",
    },
    // Versions 7 and 8 (issue 33): the KBS's own transparency log over its audit trail
    // (`cgx_service::tlog`), and how many witnesses cosigned each checkpoint.
    Migration {
        version: 7,
        sqlite: cgx_service::tlog::LOG_TABLES,
        postgres: cgx_service::tlog::LOG_TABLES,
    },
    Migration {
        version: 8,
        sqlite: cgx_service::tlog::LOG_WITNESSED,
        postgres: cgx_service::tlog::LOG_WITNESSED,
    },
];

/// The service name the KBS's leaves carry.
pub const SERVICE: &str = "cgx-kbs";

/// At most this many audit rows are integrated in one pass.
pub(crate) const LOG_PASS: i64 = 16_384;

/// The watermark name of a policy scope (resources use their path, which has no `:`).
fn policy_mark(scope: &str) -> String {
    format!("policy:{scope}")
}

/// A session row.
#[derive(Debug, Clone)]
pub struct Session {
    pub state: String,
    pub expires_at: i64,
    pub token: Option<String>,
}

/// Session states (a session row exists once its challenge was answered).
pub const ATTESTED: &str = "attested";
pub const FAILED: &str = "failed";

/// A change an administrator makes ([`Store::admin_change`]).
#[derive(Debug)]
pub(crate) enum AdminChange<'a> {
    PutResource {
        path: &'a str,
        repository: &'a str,
        value: &'a [u8],
        requires_lease: bool,
    },
    DeleteResource {
        path: &'a str,
    },
    PutPolicy {
        scope: &'a str,
        body: &'a str,
    },
}

/// A stored resource, unsealed.
#[derive(Debug)]
pub struct Resource {
    pub value: Vec<u8>,
    pub requires_lease: bool,
}

pub use cgx_service::audit::{AuditEvent, NewEvent};

/// A session row to insert (the answer to a challenge).
#[derive(Debug, Clone)]
struct NewSession {
    id: String,
    nonce: String,
    tee: String,
    state: &'static str,
    created_at: i64,
    expires_at: i64,
    token: Option<String>,
}

/// An audit row to insert.
#[derive(Debug, Clone)]
struct NewAudit {
    at: i64,
    actor: String,
    action: String,
    subject: String,
    detail: String,
}

/// A sealed resource row as read, with when it was read.
#[derive(Debug, Clone)]
struct CachedResource {
    read_at: Instant,
    sealed: Arc<Vec<u8>>,
    requires_lease: bool,
}

/// Format byte of sealed values: `0x02 ‖ version (8, BE) ‖ nonce (12) ‖ ciphertext ‖ tag`.
const SEALED_V2: u8 = 2;
const SEALED_HEADER: usize = 1 + 8 + 12;

pub struct Store {
    db: Database,
    clock: SharedClock,
    kek: LessSafeKey,
    sessions: Commit<NewSession, bool>,
    audits: Commit<NewAudit, ()>,
    /// The connections the two writers keep (given back on [`Store::close`]).
    writers: [WriterConn; 2],
    resources: Mutex<HashMap<String, CachedResource>>,
    /// The newest sealed version this KBS has opened or written, per path: an older one read
    /// later was put back by someone who can write the database.
    versions: Watermarks,
    /// MAC key of policy rows (derived from the KEK).
    policy_key: hmac::Key,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("backend", &self.db.backend())
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Connect and migrate. `url`: `sqlite://PATH` (created if missing) or `postgres://…`;
    /// `clock` dates rows.
    pub async fn open(url: &str, kek: &[u8; 32], clock: SharedClock) -> Result<Self, KbsError> {
        let db = Database::open(url).await?;
        let kek_bytes = kek;
        let kek = LessSafeKey::new(
            UnboundKey::new(&AES_256_GCM, kek).map_err(|_| KbsError::Config("kek".into()))?,
        );
        // SQLite: one connection writes both tables. Every commit by another connection empties
        // a connection's page cache (WAL mode), so two writers taking turns would re-read every
        // page they touch; one has it all in memory, and SQLite serialises writers anyway.
        // PostgreSQL commits in parallel: a connection each.
        let session_writer = WriterConn::new(&db);
        let audit_writer = if db.backend() == Backend::Sqlite {
            session_writer.clone()
        } else {
            WriterConn::new(&db)
        };
        let writers = [session_writer, audit_writer];
        db.migrate(MIGRATION_LOCK, MIGRATIONS, clock.unix()).await?;
        // An SQLite file: each request writes its rows itself ([`InlineCommit`]), through one
        // connection of its own. Otherwise a writer task per table.
        let queued_sessions = GroupCommit::spawn(Box::new({
            let w = writers[0].clone();
            move |rows| Box::pin(insert_sessions(w.clone(), rows))
        }));
        let queued_audits = GroupCommit::spawn(Box::new({
            let w = writers[1].clone();
            let postgres = db.backend() == Backend::Postgres;
            move |rows| Box::pin(insert_audits(w.clone(), postgres, rows))
        }));
        let (sessions, audits) = match db.inline_conn()? {
            // The writer tasks take what finds the file locked by another writer.
            Some(conn) => (
                Commit::Inline(InlineCommit::new(
                    conn.clone(),
                    Box::new(insert_sessions_inline),
                    queued_sessions,
                )),
                Commit::Inline(InlineCommit::new(
                    conn,
                    Box::new(insert_audits_inline),
                    queued_audits,
                )),
            ),
            None => (
                Commit::Queued(queued_sessions),
                Commit::Queued(queued_audits),
            ),
        };
        Store {
            sessions,
            audits,
            writers,
            resources: Mutex::new(HashMap::new()),
            versions: Watermarks::in_memory(kek_bytes),
            policy_key: super::keys::mac_key(kek_bytes, b"policy-rows/v1"),
            db,
            clock,
            kek,
        }
        .checked_kek()
        .await
    }

    /// Refuse a key-encryption key other than the one the database was first opened with: a
    /// value sealed under it (`kbs_meta.kek-check`) must open. The first open writes it.
    async fn checked_kek(self) -> Result<Self, KbsError> {
        const NAME: &str = "kek-check";
        let aad = b"cgx-kbs/kek-check/v1";
        // Write it if absent (the first open), then check what is there: replicas opening a new
        // database together all check the one value that won.
        let fresh = self.seal_with(b"kek-check", aad, 0)?;
        sqlx::query(
            "INSERT INTO kbs_meta (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
        )
        .bind(NAME)
        .bind(fresh)
        .execute(self.db.pool())
        .await?;
        let sealed: Vec<u8> = sqlx::query("SELECT value FROM kbs_meta WHERE name = $1")
            .bind(NAME)
            .fetch_one(self.db.pool())
            .await?
            .try_get("value")?;
        self.open_sealed(&sealed, aad).map_err(|()| {
            KbsError::Config(
                "the key-encryption key is not the one this database was sealed under".into(),
            )
        })?;
        Ok(self)
    }

    /// Keep the resource version marks in `file` too (outside the database), so a rollback
    /// made while this KBS was stopped is refused after it starts again.
    pub fn remembering_versions(mut self, kek: &[u8; 32], file: &Path) -> Result<Self, KbsError> {
        self.versions = Watermarks::in_file(kek, file)?;
        Ok(self)
    }

    /// Whether the database holds anything version marks protect (resources or policies).
    pub async fn holds_versioned_rows(&self) -> Result<bool, KbsError> {
        let n: i64 = sqlx::query_scalar(
            "SELECT (SELECT COUNT(*) FROM resources) + (SELECT COUNT(*) FROM policies)",
        )
        .fetch_one(self.db.pool())
        .await?;
        Ok(n > 0)
    }

    /// The highest applied migration.
    pub async fn schema_version(&self) -> Result<i64, KbsError> {
        Ok(self.db.schema_version().await?)
    }

    // ---------------------------------------------------------------- sessions

    /// Record the answer to a challenge: `true` for the first answer, `false` when the
    /// session already exists (a replayed challenge), on any replica. The session's TEE key is
    /// in its `token` (the EAR binds it), so the `tee_pubkey` column is no longer written: a
    /// smaller row is a cheaper commit, on every flow.
    pub async fn record_session(
        &self,
        id: &str,
        nonce: &str,
        tee: &str,
        state: &str,
        expires_at: i64,
        token: Option<&str>,
    ) -> Result<bool, KbsError> {
        let state = match state {
            ATTESTED => ATTESTED,
            FAILED => FAILED,
            other => return Err(KbsError::Internal(format!("session state {other}"))),
        };
        self.sessions
            .write(NewSession {
                id: id.to_string(),
                nonce: nonce.to_string(),
                tee: tee.to_string(),
                state,
                created_at: self.clock.unix(),
                expires_at,
                token: token.map(str::to_string),
            })
            .await
            .map_err(KbsError::from)
    }

    pub async fn session(&self, id: &str) -> Result<Option<Session>, KbsError> {
        let row = sqlx::query("SELECT state, expires_at, token FROM sessions WHERE id = $1")
            .bind(id)
            .fetch_optional(self.db.pool())
            .await?;
        row.map(|r| {
            Ok(Session {
                state: r.try_get("state")?,
                expires_at: r.try_get("expires_at")?,
                token: r.try_get("token")?,
            })
        })
        .transpose()
        .map_err(|e: sqlx::Error| KbsError::Storage(e.to_string()))
    }

    pub(crate) fn is_sqlite(&self) -> bool {
        self.db.backend() == Backend::Sqlite
    }

    /// The pool readers of the log use.
    pub(crate) fn pool(&self) -> &sqlx::AnyPool {
        self.db.pool()
    }

    /// Integrate the audit rows committed since the last pass into the log and sign a
    /// checkpoint extending `pin`, in a write transaction of its own: SQLite's one writer, or,
    /// on PostgreSQL, under the lock audit rows are inserted under (so no row with a smaller
    /// `seq` can still be uncommitted when a larger one is read).
    pub(crate) async fn integrate_log(
        &self,
        signer: &cgx_tlog::note::NoteSigner,
        at: i64,
        pin: Option<cgx_service::tlog::Pinned>,
    ) -> Result<Option<cgx_service::tlog::Integrated>, KbsError> {
        let storage = |e: cgx_service::tlog::LogStoreError| KbsError::Storage(e.to_string());
        if !cgx_service::tlog::behind(self.db.pool())
            .await
            .map_err(storage)?
        {
            return Ok(None);
        }
        let mut tx = match self.db.backend() {
            Backend::Sqlite => self.db.write_pool().begin_with("BEGIN IMMEDIATE").await?,
            Backend::Postgres => {
                let mut tx = self.db.pool().begin().await?;
                cgx_service::db::lock_in_commit_order(&mut tx, AUDIT_ORDER_LOCK).await?;
                tx
            }
        };
        let done = cgx_service::tlog::integrate(&mut tx, SERVICE, signer, at, LOG_PASS, pin)
            .await
            .map_err(storage)?;
        tx.commit().await?;
        Ok(done)
    }

    /// Fold the SQLite write-ahead log back into the database without blocking writers
    /// (a background task does this at the pace of the writes, so commits never pay for a
    /// checkpoint). Returns the frames the log held.
    pub(crate) async fn checkpoint(&self) -> Result<u64, KbsError> {
        Ok(self.db.checkpoint().await?)
    }

    /// Delete sessions that expired by `now`; returns how many. `session_ttl`: the longest a
    /// session lives after its challenge.
    ///
    /// SQLite deletes by the id's leading challenge expiry (byte order is time order): the
    /// attest handler ends every session, and keeps every failed answer, at most
    /// `session_ttl` past its challenge's expiry, so a row whose challenge expired more than
    /// `session_ttl` ago is dead. Rows expired since stay a little longer; reads check
    /// `expires_at` anyway. (A restart with a shorter `session_ttl` ends older sessions by the
    /// new lifetime; their clients attest again.)
    pub async fn sweep_sessions(&self, now: i64, session_ttl: i64) -> Result<u64, KbsError> {
        let q = match self.db.backend() {
            Backend::Sqlite => sqlx::query("DELETE FROM sessions WHERE id < $1").bind(
                super::session::id_time_prefix(now.saturating_sub(session_ttl)),
            ),
            Backend::Postgres => {
                sqlx::query("DELETE FROM sessions WHERE expires_at <= $1").bind(now)
            }
        };
        Ok(q.execute(self.db.pool()).await?.rows_affected())
    }

    // ---------------------------------------------------------------- resources

    /// Seal `value` with `aad` at `version`: `0x02 ‖ version ‖ nonce ‖ ciphertext ‖ tag`.
    fn seal_with(&self, value: &[u8], aad: &[u8], version: u64) -> Result<Vec<u8>, KbsError> {
        let mut nonce = [0u8; 12];
        aws_lc_rs::rand::fill(&mut nonce).map_err(|_| KbsError::Internal("random".into()))?;
        let mut buf = value.to_vec();
        let mut full_aad = aad.to_vec();
        full_aad.extend_from_slice(&version.to_be_bytes());
        self.kek
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(full_aad.as_slice()),
                &mut buf,
            )
            .map_err(|_| KbsError::Internal("sealing".into()))?;
        let mut out = Vec::with_capacity(SEALED_HEADER + buf.len());
        out.push(SEALED_V2);
        out.extend_from_slice(&version.to_be_bytes());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&buf);
        Ok(out)
    }

    /// Open a sealed value with `aad`: (version, plaintext).
    fn open_sealed(&self, sealed: &[u8], aad: &[u8]) -> Result<(u64, Vec<u8>), ()> {
        if sealed.len() < SEALED_HEADER + 16 || sealed[0] != SEALED_V2 {
            return Err(());
        }
        let mut version = [0u8; 8];
        version.copy_from_slice(&sealed[1..9]);
        let version = u64::from_be_bytes(version);
        let mut nonce = [0u8; 12];
        nonce.copy_from_slice(&sealed[9..SEALED_HEADER]);
        let mut full_aad = aad.to_vec();
        full_aad.extend_from_slice(&version.to_be_bytes());
        let mut buf = sealed[SEALED_HEADER..].to_vec();
        let n = self
            .kek
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(full_aad.as_slice()),
                &mut buf,
            )
            .map_err(|_| ())?
            .len();
        buf.truncate(n);
        Ok((version, buf))
    }

    /// Open the resource at `path` as stored with `requires_lease`; an older version than this
    /// replica has seen is refused.
    fn unseal(&self, path: &str, sealed: &[u8], requires_lease: bool) -> Result<Vec<u8>, KbsError> {
        let (version, value) = self
            .open_sealed(sealed, &aad(path, requires_lease))
            .map_err(|()| {
                KbsError::Storage(format!(
                    "sealed value of {path} does not open: altered, moved, or sealed under another key"
                ))
            })?;
        self.versions.observe(path, version)?;
        Ok(value)
    }

    pub async fn put_resource(
        &self,
        path: &str,
        repository: &str,
        value: &[u8],
        requires_lease: bool,
    ) -> Result<(), KbsError> {
        self.admin_change(
            AdminChange::PutResource {
                path,
                repository,
                value,
                requires_lease,
            },
            None,
        )
        .await
        .map(|_| ())
    }

    /// Apply an administrator's change and, when given, its audit row in one transaction — at
    /// SQLite's `synchronous=FULL`, so an acknowledged change survives a power loss with its
    /// audit row. Returns whether a row changed.
    pub(crate) async fn admin_change(
        &self,
        change: AdminChange<'_>,
        audit: Option<NewEvent<'_>>,
    ) -> Result<bool, KbsError> {
        let sqlite = self.is_sqlite();
        let now = self.clock.unix();
        // A new resource version: past every version this replica has seen, and past the clock.
        let sealed = match &change {
            AdminChange::PutResource {
                path,
                value,
                requires_lease,
                ..
            } => {
                let now_ms = u64::try_from(now).unwrap_or(0).saturating_mul(1000);
                let version = self.versions.reserve(path, now_ms)?;
                Some((
                    version,
                    self.seal_with(value, &aad(path, *requires_lease), version)?,
                ))
            }
            _ => None,
        };
        let policy_version = match &change {
            AdminChange::PutPolicy { scope, .. } => {
                let now_ms = u64::try_from(now).unwrap_or(0).saturating_mul(1000);
                Some(self.versions.reserve(&policy_mark(scope), now_ms)?)
            }
            _ => None,
        };
        let mut conn = self.db.pool().acquire().await?;
        if sqlite {
            sqlx::query("PRAGMA synchronous=FULL")
                .execute(&mut *conn)
                .await?;
        }
        let written = async {
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            let changed = match &change {
                AdminChange::PutResource {
                    path,
                    repository,
                    requires_lease,
                    ..
                } => {
                    let sealed = sealed.as_ref().map_or(&[][..], |(_, b)| b.as_slice());
                    sqlx::query(
                        "INSERT INTO resources (path, repository, sealed, requires_lease, updated_at) VALUES ($1, $2, $3, $4, $5)
                         ON CONFLICT (path) DO UPDATE SET sealed = excluded.sealed, requires_lease = excluded.requires_lease, updated_at = excluded.updated_at",
                    )
                    .bind(*path)
                    .bind(*repository)
                    .bind(sealed)
                    .bind(i64::from(*requires_lease))
                    .bind(now)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected()
                }
                AdminChange::DeleteResource { path } => {
                    sqlx::query("DELETE FROM resources WHERE path = $1")
                        .bind(*path)
                        .execute(&mut *tx)
                        .await?
                        .rows_affected()
                }
                AdminChange::PutPolicy { scope, body } => {
                    let version = policy_version.unwrap_or(0);
                    sqlx::query(
                        "INSERT INTO policies (scope, body, updated_at, mac, version) VALUES ($1, $2, $3, $4, $5)
                         ON CONFLICT (scope) DO UPDATE SET body = excluded.body, updated_at = excluded.updated_at, mac = excluded.mac, version = excluded.version",
                    )
                    .bind(*scope)
                    .bind(*body)
                    .bind(now)
                    .bind(self.policy_mac(scope, version, body))
                    .bind(i64::try_from(version).unwrap_or(i64::MAX))
                    .execute(&mut *tx)
                    .await?
                    .rows_affected()
                }
            };
            if let Some(a) = &audit
                && changed > 0
            {
                if !sqlite {
                    // `seq` in commit order across replicas (see AUDIT_ORDER_LOCK).
                    cgx_service::db::lock_in_commit_order(&mut tx, AUDIT_ORDER_LOCK).await?;
                }
                cgx_service::audit::record(&mut tx, now, a).await?;
            }
            tx.commit().await?;
            Ok::<_, sqlx::Error>(changed > 0)
        }
        .await;
        if sqlite {
            // Back to the pool's setting for the connection's next user, whatever happened.
            let _ = sqlx::query("PRAGMA synchronous=NORMAL")
                .execute(&mut *conn)
                .await;
        }
        let changed = written?;
        if changed && let Some(a) = &audit {
            a.trace(now);
        }
        match change {
            AdminChange::PutResource { path, .. } => {
                self.forget_resource(path);
                if let Some((version, _)) = sealed {
                    self.versions.observe(path, version)?;
                }
            }
            AdminChange::DeleteResource { path } => self.forget_resource(path),
            AdminChange::PutPolicy { scope, .. } => {
                if let Some(v) = policy_version {
                    self.versions.observe(&policy_mark(scope), v)?;
                }
            }
        }
        Ok(changed)
    }

    /// The resource at `path`, unsealed (only sealed bytes are cached).
    pub async fn resource(&self, path: &str) -> Result<Option<Resource>, KbsError> {
        let cached = self
            .resources
            .lock()
            .map_err(|_| KbsError::Internal("resource cache lock".into()))?
            .get(path)
            .filter(|c| c.read_at.elapsed() < RESOURCE_CACHE)
            .cloned();
        let c = match cached {
            Some(c) => c,
            None => {
                let read_at = Instant::now();
                let row =
                    sqlx::query("SELECT sealed, requires_lease FROM resources WHERE path = $1")
                        .bind(path)
                        .fetch_optional(self.db.pool())
                        .await?;
                let Some(r) = row else {
                    self.forget_resource(path);
                    return Ok(None);
                };
                let c = CachedResource {
                    read_at,
                    sealed: Arc::new(r.try_get("sealed")?),
                    requires_lease: r.try_get::<i64, _>("requires_lease")? != 0,
                };
                if let Ok(mut m) = self.resources.lock() {
                    // Only paths that exist are cached, so the map is bounded by the table;
                    // expired entries go when it grows.
                    if m.len() >= 4096 {
                        m.retain(|_, v| v.read_at.elapsed() < RESOURCE_CACHE);
                    }
                    m.insert(path.to_string(), c.clone());
                }
                c
            }
        };
        Ok(Some(Resource {
            value: self.unseal(path, &c.sealed, c.requires_lease)?,
            requires_lease: c.requires_lease,
        }))
    }

    fn forget_resource(&self, path: &str) {
        if let Ok(mut m) = self.resources.lock() {
            m.remove(path);
        }
    }

    pub async fn delete_resource(&self, path: &str) -> Result<bool, KbsError> {
        self.admin_change(AdminChange::DeleteResource { path }, None)
            .await
    }

    // ---------------------------------------------------------------- policies

    /// What a policy row's MAC covers: `scope ‖ 0 ‖ version (8, BE) ‖ body`.
    fn policy_macced(scope: &str, version: u64, body: &str) -> Vec<u8> {
        [
            scope.as_bytes(),
            &[0],
            &version.to_be_bytes(),
            body.as_bytes(),
        ]
        .concat()
    }

    /// HMAC-SHA-256 (hex) of a policy row under the KEK-derived key.
    fn policy_mac(&self, scope: &str, version: u64, body: &str) -> String {
        hex::encode(hmac::sign(
            &self.policy_key,
            &Self::policy_macced(scope, version, body),
        ))
    }

    /// A policy row's body, once its MAC verifies and its version is not older than one this
    /// KBS has read: the database decides no policy.
    fn checked_policy(&self, row: &sqlx::any::AnyRow) -> Result<(String, String), KbsError> {
        let scope: String = row.try_get("scope")?;
        let body: String = row.try_get("body")?;
        let mac: Option<String> = row.try_get("mac")?;
        let version: Option<i64> = row.try_get("version")?;
        let version = version.and_then(|v| u64::try_from(v).ok()).unwrap_or(0);
        let msg = Self::policy_macced(&scope, version, &body);
        let ok = mac
            .and_then(|m| hex::decode(m).ok())
            .is_some_and(|m| hmac::verify(&self.policy_key, &msg, &m).is_ok());
        if !ok {
            return Err(KbsError::Storage(format!(
                "policy {scope}: its MAC does not verify (written outside this KBS, or before \
                 policies were MAC'd: put it again)"
            )));
        }
        self.versions.observe(&policy_mark(&scope), version)?;
        Ok((scope, body))
    }

    /// A scope with no row must never have had one here (there is no API that removes one).
    fn absent_policy(&self, scope: &str) -> Result<(), KbsError> {
        if self.versions.get(&policy_mark(scope))? > 0 {
            return Err(KbsError::Storage(format!(
                "policy {scope} was removed outside this KBS"
            )));
        }
        Ok(())
    }

    pub(crate) async fn policy(&self, scope: &str) -> Result<Option<String>, KbsError> {
        let row = sqlx::query("SELECT scope, body, mac, version FROM policies WHERE scope = $1")
            .bind(scope)
            .fetch_optional(self.db.pool())
            .await?;
        match row {
            Some(r) => self.checked_policy(&r).map(|(_, body)| Some(body)),
            None => self.absent_policy(scope).map(|()| None),
        }
    }

    /// The policies among `scopes` that exist, as (scope, body).
    pub(crate) async fn policies(
        &self,
        scopes: &[&str; 3],
    ) -> Result<Vec<(String, String)>, KbsError> {
        let rows = sqlx::query(
            "SELECT scope, body, mac, version FROM policies WHERE scope IN ($1, $2, $3)",
        )
        .bind(scopes[0])
        .bind(scopes[1])
        .bind(scopes[2])
        .fetch_all(self.db.pool())
        .await?;
        let found = rows
            .iter()
            .map(|r| self.checked_policy(r))
            .collect::<Result<Vec<_>, _>>()?;
        for scope in scopes {
            if !found.iter().any(|(s, _)| s == scope) {
                self.absent_policy(scope)?;
            }
        }
        Ok(found)
    }

    // ---------------------------------------------------------------- audit

    pub async fn audit(
        &self,
        actor: &str,
        action: &str,
        subject: &str,
        detail: &serde_json::Value,
    ) -> Result<(), KbsError> {
        let at = self.clock.unix();
        self.audits
            .write(NewAudit {
                at,
                actor: actor.to_string(),
                action: action.to_string(),
                subject: subject.to_string(),
                detail: detail.to_string(),
            })
            .await
            .map_err(KbsError::from)?;
        NewEvent {
            actor,
            action,
            subject,
            detail,
        }
        .trace(at);
        Ok(())
    }

    /// Audit events after `after_seq`, oldest first.
    pub async fn audit_events(
        &self,
        after_seq: i64,
        limit: i64,
    ) -> Result<Vec<AuditEvent>, KbsError> {
        Ok(cgx_service::audit::read(self.db.pool(), after_seq, limit).await?)
    }

    pub async fn close(&self) {
        // The pool waits for every connection to come back, the writers' too.
        for w in &self.writers {
            w.release().await;
        }
        self.db.close().await;
    }
}

/// [`insert_sessions`] on an SQLite connection of the caller's own ([`InlineCommit`]): one
/// single-row statement per row, whose change count says whether it was the first answer (no
/// `RETURNING`, which costs SQLite a temporary table per statement), in one transaction when
/// the batch has several rows.
fn insert_sessions_inline(
    c: &rusqlite::Connection,
    rows: &[NewSession],
) -> Result<Vec<bool>, DbError> {
    let tx = if rows.len() > 1 {
        Some(rusqlite::Transaction::new_unchecked(
            c,
            rusqlite::TransactionBehavior::Immediate,
        )?)
    } else {
        None
    };
    let mut st = c.prepare_cached(
        "INSERT INTO sessions (id, nonce, tee, state, created_at, expires_at, token)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT (id) DO NOTHING",
    )?;
    // A replay later in the same batch finds the row its first answer wrote.
    let mut out = Vec::with_capacity(rows.len());
    for r in rows {
        let n = st.execute(rusqlite::params![
            r.id,
            r.nonce,
            r.tee,
            r.state,
            r.created_at,
            r.expires_at,
            r.token
        ])?;
        out.push(n == 1);
    }
    drop(st);
    if let Some(tx) = tx {
        tx.commit()?;
    }
    Ok(out)
}

/// [`insert_audits`] on an SQLite connection of the caller's own ([`InlineCommit`]).
fn insert_audits_inline(c: &rusqlite::Connection, rows: &[NewAudit]) -> Result<Vec<()>, DbError> {
    let n = rows.len();
    let mut args: Vec<&dyn rusqlite::ToSql> = Vec::with_capacity(n * 5);
    for r in rows {
        args.extend([
            &r.at as &dyn rusqlite::ToSql,
            &r.actor,
            &r.action,
            &r.subject,
            &r.detail,
        ]);
    }
    c.prepare_cached(&cgx_service::audit::insert_sql(n))?
        .execute(args.as_slice())?;
    Ok(vec![(); n])
}

/// One statement for a batch of session rows: `true` for each row inserted, `false` for a
/// replayed challenge (its id already stored, or earlier in this batch).
async fn insert_sessions(w: WriterConn, rows: Vec<NewSession>) -> Result<Vec<bool>, DbError> {
    let mut seen = HashSet::new();
    let fresh: Vec<&NewSession> = rows.iter().filter(|r| seen.insert(&r.id)).collect();
    let sql = format!(
        "INSERT INTO sessions (id, nonce, tee, state, created_at, expires_at, token)
         VALUES {} ON CONFLICT (id) DO NOTHING RETURNING id",
        placeholders(fresh.len(), 7)
    );
    let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
    for r in &fresh {
        q = q
            .bind(r.id.clone())
            .bind(r.nonce.clone())
            .bind(r.tee.clone())
            .bind(r.state)
            .bind(r.created_at)
            .bind(r.expires_at)
            .bind(r.token.clone());
    }
    let inserted = w
        .fetch_all(q)
        .await?
        .iter()
        .map(|row| row.try_get::<String, _>("id"))
        .collect::<Result<HashSet<String>, _>>()?;
    // Each inserted id answers `true` once: to the first row that carried it.
    let mut claimed = HashSet::new();
    Ok(rows
        .iter()
        .map(|r| inserted.contains(&r.id) && claimed.insert(&r.id))
        .collect())
}

/// Audit rows take `seq` in commit order (PostgreSQL: under this advisory lock; SQLite has one
/// writer at a time anyway), so `/audit?after=SEQ` pages through them missing none, whichever
/// replica wrote them.
const AUDIT_ORDER_LOCK: i64 = 0x6367_786b_6175;

/// One statement for a batch of audit rows (their `seq` follows the batch's order).
async fn insert_audits(
    w: WriterConn,
    postgres: bool,
    rows: Vec<NewAudit>,
) -> Result<Vec<()>, DbError> {
    let mut q = sqlx::query(sqlx::AssertSqlSafe(cgx_service::audit::insert_sql(
        rows.len(),
    )));
    for r in &rows {
        q = q
            .bind(r.at)
            .bind(r.actor.clone())
            .bind(r.action.clone())
            .bind(r.subject.clone())
            .bind(r.detail.clone());
    }
    if postgres {
        w.fetch_all_in_lock_order(AUDIT_ORDER_LOCK, q).await?;
    } else {
        w.fetch_all(q).await?;
    }
    Ok(vec![(); rows.len()])
}

/// What a sealed resource is bound to besides its version: its path and whether a lease is
/// required to release it.
fn aad(path: &str, requires_lease: bool) -> Vec<u8> {
    let mut a = b"cgx-kbs/resource/v2\0".to_vec();
    a.extend_from_slice(path.as_bytes());
    a.push(0);
    a.push(u8::from(requires_lease));
    a
}
