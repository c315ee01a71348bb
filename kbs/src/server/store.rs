//! Storage: sessions, sealed resources, policies and the audit trail, in SQLite (embedded
//! default) or PostgreSQL (several replicas), through sqlx's `Any` driver with one SQL dialect
//! (`$n` placeholders work on both).
//!
//! Sessions live here, not in memory, so any replica serves any step of a handshake; a challenge
//! is answered by one INSERT keyed by the session id, so it is single-use across replicas too
//! ([`super::session`]). Resources are
//! sealed with AES-256-GCM under the key-encryption key (never stored), the resource path as
//! AAD so a sealed value cannot be moved to another path.
//!
//! The two writes on every flow — the session row at attestation, the audit row at release —
//! go through [`GroupCommit`]: each caller waits for its own commit, the database sees one
//! statement per batch. Sealed resources are read through a cache of [`RESOURCE_CACHE`]: a
//! change made on this replica clears it at once, one made on another replica is seen within
//! that time (as release policies are).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_lc_rs::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use sqlx::any::AnyPoolOptions;
use sqlx::{AnyPool, Row};

use super::error::KbsError;
use super::group_commit::{GroupCommit, placeholders};

/// How long a sealed resource read from the database is served from memory.
pub const RESOURCE_CACHE: Duration = Duration::from_secs(1);

/// The PostgreSQL advisory lock replicas take to migrate ("cgxkbs").
const MIGRATION_LOCK: i64 = 0x6367_786b_6273;

/// Migrations, versioned; each runs once, in order, in a transaction.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        // SQLite
        "CREATE TABLE IF NOT EXISTS sessions (
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
        // PostgreSQL
        "CREATE TABLE IF NOT EXISTS sessions (
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
    ),
    (
        2,
        // SQLite: `audit` without AUTOINCREMENT. Rows are never deleted, so `seq` (max + 1)
        // still only grows, and a release's commit no longer rewrites a `sqlite_sequence`
        // page too (~4 KB less written per flow, of ~30). Rows keep their numbers.
        "CREATE TABLE audit_v2 (
            seq INTEGER PRIMARY KEY, at BIGINT NOT NULL, actor TEXT NOT NULL,
            action TEXT NOT NULL, subject TEXT NOT NULL, detail TEXT NOT NULL);
         INSERT INTO audit_v2 (seq, at, actor, action, subject, detail)
            SELECT seq, at, actor, action, subject, detail FROM audit;
         DROP TABLE audit;
         ALTER TABLE audit_v2 RENAME TO audit;",
        // PostgreSQL: BIGSERIAL has no such cost; nothing to change.
        "",
    ),
];

/// A session row.
#[derive(Debug, Clone)]
pub struct Session {
    pub state: String,
    pub expires_at: i64,
    pub tee_pubkey: Option<String>,
    pub token: Option<String>,
}

/// Session states (a session row exists once its challenge was answered).
pub const ATTESTED: &str = "attested";
pub const FAILED: &str = "failed";

/// A stored resource, unsealed.
#[derive(Debug)]
pub struct Resource {
    pub value: Vec<u8>,
    pub requires_lease: bool,
}

/// An audit event (becomes a transparency-log leaf later).
#[derive(Debug, Clone, serde::Serialize)]
pub struct AuditEvent {
    pub seq: i64,
    pub at: i64,
    pub actor: String,
    pub action: String,
    pub subject: String,
    pub detail: serde_json::Value,
}

/// A session row to insert (the answer to a challenge).
#[derive(Debug, Clone)]
struct NewSession {
    id: String,
    nonce: String,
    tee: String,
    state: &'static str,
    created_at: i64,
    expires_at: i64,
    tee_pubkey: Option<String>,
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

pub struct Store {
    pool: AnyPool,
    kek: LessSafeKey,
    postgres: bool,
    sessions: GroupCommit<NewSession, bool>,
    audits: GroupCommit<NewAudit, ()>,
    /// The connections the two writers keep (given back on [`Store::close`]).
    writers: [WriterConn; 2],
    resources: Mutex<HashMap<String, CachedResource>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("postgres", &self.postgres)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Connect and migrate. `url`: `sqlite://PATH` (created if missing) or `postgres://…`.
    pub async fn open(url: &str, kek: &[u8; 32]) -> Result<Self, KbsError> {
        sqlx::any::install_default_drivers();
        let postgres = url.starts_with("postgres://") || url.starts_with("postgresql://");
        let sqlite = url.starts_with("sqlite:");
        if !postgres && !sqlite {
            return Err(KbsError::Config(format!(
                "database must be sqlite://… or postgres://…, not '{}'",
                url.split(':').next().unwrap_or("")
            )));
        }
        let url = if sqlite && !url.contains('?') && !url.contains(":memory:") {
            format!("{url}?mode=rwc")
        } else {
            url.to_string()
        };
        let mut opts = AnyPoolOptions::new().max_connections(if sqlite { 8 } else { 16 });
        if sqlite {
            // An embedded database does not drop connections: pinging each one before use would
            // cost every statement a second round trip to its worker thread.
            opts = opts.test_before_acquire(false);
            opts = opts.after_connect(|conn, _| {
                Box::pin(async move {
                    use sqlx::Executor;
                    conn.execute("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=5000; PRAGMA wal_autocheckpoint=20000; PRAGMA mmap_size=268435456;")
                        .await?;
                    Ok(())
                })
            });
        }
        let pool = opts.connect(&url).await?;
        let kek = LessSafeKey::new(
            UnboundKey::new(&AES_256_GCM, kek).map_err(|_| KbsError::Config("kek".into()))?,
        );
        // SQLite: one connection writes both tables. Every commit by another connection empties
        // a connection's page cache (WAL mode), so two writers taking turns would re-read every
        // page they touch; one has it all in memory, and SQLite serialises writers anyway.
        // PostgreSQL commits in parallel: a connection each.
        let session_writer = WriterConn::new(&pool);
        let audit_writer = if sqlite {
            session_writer.clone()
        } else {
            WriterConn::new(&pool)
        };
        let writers = [session_writer, audit_writer];
        let store = Store {
            sessions: GroupCommit::spawn(Box::new({
                let w = writers[0].clone();
                move |rows| Box::pin(insert_sessions(w.clone(), rows))
            })),
            audits: GroupCommit::spawn(Box::new({
                let w = writers[1].clone();
                move |rows| Box::pin(insert_audits(w.clone(), rows))
            })),
            writers,
            resources: Mutex::new(HashMap::new()),
            pool,
            kek,
            postgres,
        };
        store.migrate().await?;
        Ok(store)
    }

    /// A transaction that holds the database's migration lock: replicas that start together
    /// migrate one at a time, and the later ones find the work done. SQLite: `BEGIN IMMEDIATE`
    /// takes the write lock before anything is read (a deferred transaction that read first
    /// could not write after another's commit); PostgreSQL: a transaction-scoped advisory lock.
    async fn migration_tx(&self) -> Result<sqlx::Transaction<'static, sqlx::Any>, KbsError> {
        if self.postgres {
            let mut tx = self.pool.begin().await?;
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(MIGRATION_LOCK)
                .execute(&mut *tx)
                .await?;
            Ok(tx)
        } else {
            Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?)
        }
    }

    async fn migrate(&self) -> Result<(), KbsError> {
        let mut tx = self.migration_tx().await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY, applied_at BIGINT NOT NULL)",
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        for (version, sqlite, pg) in MIGRATIONS {
            let mut tx = self.migration_tx().await?;
            let done = sqlx::query("SELECT version FROM schema_migrations WHERE version = $1")
                .bind(*version)
                .fetch_optional(&mut *tx)
                .await?;
            if done.is_some() {
                continue;
            }
            let sql = if self.postgres { pg } else { sqlite };
            for stmt in sql.split(';').map(str::trim).filter(|s| !s.is_empty()) {
                sqlx::query(stmt).execute(&mut *tx).await?;
            }
            sqlx::query(
                "INSERT INTO schema_migrations (version, applied_at) VALUES ($1, $2) ON CONFLICT (version) DO NOTHING",
            )
            .bind(*version)
            .bind(now())
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
        }
        Ok(())
    }

    /// The highest applied migration.
    pub async fn schema_version(&self) -> Result<i64, KbsError> {
        let row = sqlx::query("SELECT MAX(version) AS v FROM schema_migrations")
            .fetch_one(&self.pool)
            .await?;
        Ok(row.try_get::<i64, _>("v").unwrap_or(0))
    }

    // ---------------------------------------------------------------- sessions

    /// Record the answer to a challenge: `true` for the first answer, `false` when the
    /// session already exists (a replayed challenge), on any replica.
    #[allow(clippy::too_many_arguments)]
    pub async fn record_session(
        &self,
        id: &str,
        nonce: &str,
        tee: &str,
        state: &str,
        expires_at: i64,
        tee_pubkey: Option<&str>,
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
                created_at: now(),
                expires_at,
                tee_pubkey: tee_pubkey.map(str::to_string),
                token: token.map(str::to_string),
            })
            .await
    }

    pub async fn session(&self, id: &str) -> Result<Option<Session>, KbsError> {
        let row =
            sqlx::query("SELECT state, expires_at, tee_pubkey, token FROM sessions WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await?;
        row.map(|r| {
            Ok(Session {
                state: r.try_get("state")?,
                expires_at: r.try_get("expires_at")?,
                tee_pubkey: r.try_get("tee_pubkey")?,
                token: r.try_get("token")?,
            })
        })
        .transpose()
        .map_err(|e: sqlx::Error| KbsError::Storage(e.to_string()))
    }

    pub fn is_sqlite(&self) -> bool {
        !self.postgres
    }

    /// Fold the SQLite write-ahead log back into the database without blocking writers
    /// (the accept loop does this twice a second, so commits never pay for a checkpoint).
    pub async fn checkpoint(&self) -> Result<(), KbsError> {
        if !self.postgres {
            sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
                .execute(&self.pool)
                .await?;
        }
        Ok(())
    }

    /// Delete sessions that expired before `now`; returns how many.
    pub async fn sweep_sessions(&self, now: i64) -> Result<u64, KbsError> {
        Ok(sqlx::query("DELETE FROM sessions WHERE expires_at <= $1")
            .bind(now)
            .execute(&self.pool)
            .await?
            .rows_affected())
    }

    // ---------------------------------------------------------------- resources

    fn seal(&self, path: &str, value: &[u8]) -> Result<Vec<u8>, KbsError> {
        let mut nonce = [0u8; 12];
        aws_lc_rs::rand::fill(&mut nonce).map_err(|_| KbsError::Internal("random".into()))?;
        let mut buf = value.to_vec();
        self.kek
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad(path).as_slice()),
                &mut buf,
            )
            .map_err(|_| KbsError::Internal("sealing".into()))?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&buf);
        Ok(out)
    }

    fn unseal(&self, path: &str, sealed: &[u8]) -> Result<Vec<u8>, KbsError> {
        if sealed.len() < 12 + 16 {
            return Err(KbsError::Storage(format!(
                "sealed value of {path} is truncated"
            )));
        }
        let mut nonce = [0u8; 12];
        nonce.copy_from_slice(&sealed[..12]);
        let mut buf = sealed[12..].to_vec();
        let n = self
            .kek
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad(path).as_slice()),
                &mut buf,
            )
            .map_err(|_| {
                KbsError::Storage(format!(
                    "sealed value of {path} does not open under this key-encryption key"
                ))
            })?
            .len();
        buf.truncate(n);
        Ok(buf)
    }

    pub async fn put_resource(
        &self,
        path: &str,
        repository: &str,
        value: &[u8],
        requires_lease: bool,
    ) -> Result<(), KbsError> {
        let sealed = self.seal(path, value)?;
        sqlx::query(
            "INSERT INTO resources (path, repository, sealed, requires_lease, updated_at) VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (path) DO UPDATE SET sealed = excluded.sealed, requires_lease = excluded.requires_lease, updated_at = excluded.updated_at",
        )
        .bind(path)
        .bind(repository)
        .bind(sealed)
        .bind(i64::from(requires_lease))
        .bind(now())
        .execute(&self.pool)
        .await?;
        self.forget_resource(path);
        Ok(())
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
                        .fetch_optional(&self.pool)
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
            value: self.unseal(path, &c.sealed)?,
            requires_lease: c.requires_lease,
        }))
    }

    fn forget_resource(&self, path: &str) {
        if let Ok(mut m) = self.resources.lock() {
            m.remove(path);
        }
    }

    pub async fn delete_resource(&self, path: &str) -> Result<bool, KbsError> {
        let deleted = sqlx::query("DELETE FROM resources WHERE path = $1")
            .bind(path)
            .execute(&self.pool)
            .await?
            .rows_affected()
            == 1;
        self.forget_resource(path);
        Ok(deleted)
    }

    // ---------------------------------------------------------------- policies

    pub async fn put_policy(&self, scope: &str, body: &str) -> Result<(), KbsError> {
        sqlx::query(
            "INSERT INTO policies (scope, body, updated_at) VALUES ($1, $2, $3)
             ON CONFLICT (scope) DO UPDATE SET body = excluded.body, updated_at = excluded.updated_at",
        )
        .bind(scope)
        .bind(body)
        .bind(now())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn policy(&self, scope: &str) -> Result<Option<String>, KbsError> {
        let row = sqlx::query("SELECT body FROM policies WHERE scope = $1")
            .bind(scope)
            .fetch_optional(&self.pool)
            .await?;
        Ok(match row {
            Some(r) => Some(r.try_get("body")?),
            None => None,
        })
    }

    /// The policies among `scopes` that exist, as (scope, body).
    pub async fn policies(&self, scopes: &[&str; 3]) -> Result<Vec<(String, String)>, KbsError> {
        let rows = sqlx::query("SELECT scope, body FROM policies WHERE scope IN ($1, $2, $3)")
            .bind(scopes[0])
            .bind(scopes[1])
            .bind(scopes[2])
            .fetch_all(&self.pool)
            .await?;
        rows.into_iter()
            .map(|r| Ok((r.try_get("scope")?, r.try_get("body")?)))
            .collect::<Result<Vec<_>, sqlx::Error>>()
            .map_err(Into::into)
    }

    // ---------------------------------------------------------------- audit

    pub async fn audit(
        &self,
        actor: &str,
        action: &str,
        subject: &str,
        detail: &serde_json::Value,
    ) -> Result<(), KbsError> {
        let at = now();
        tracing::info!(target: "cgx_kbs::audit", %actor, %action, %subject, %detail, at, "audit");
        self.audits
            .write(NewAudit {
                at,
                actor: actor.to_string(),
                action: action.to_string(),
                subject: subject.to_string(),
                detail: detail.to_string(),
            })
            .await
    }

    /// Audit events after `after_seq`, oldest first.
    pub async fn audit_events(
        &self,
        after_seq: i64,
        limit: i64,
    ) -> Result<Vec<AuditEvent>, KbsError> {
        let rows = sqlx::query(
            "SELECT seq, at, actor, action, subject, detail FROM audit WHERE seq > $1 ORDER BY seq LIMIT $2",
        )
        .bind(after_seq)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter()
            .map(|r| {
                let detail: String = r.try_get("detail")?;
                Ok(AuditEvent {
                    seq: r.try_get("seq")?,
                    at: r.try_get("at")?,
                    actor: r.try_get("actor")?,
                    action: r.try_get("action")?,
                    subject: r.try_get("subject")?,
                    detail: serde_json::from_str(&detail)
                        .unwrap_or(serde_json::Value::String(detail)),
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()
            .map_err(Into::into)
    }

    pub async fn ping(&self) -> Result<(), KbsError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    pub async fn close(&self) {
        // The pool waits for every connection to come back, the writers' too.
        for w in &self.writers {
            *w.conn.lock().await = None;
        }
        self.pool.close().await;
    }
}

/// The connection a batch writer keeps between batches: no pool round trip per batch, and its
/// page cache stays warm for its table. Dropped after an error; the next batch takes a new one.
#[derive(Clone)]
struct WriterConn {
    pool: AnyPool,
    conn: Arc<tokio::sync::Mutex<Option<sqlx::pool::PoolConnection<sqlx::Any>>>>,
}

impl WriterConn {
    fn new(pool: &AnyPool) -> Self {
        WriterConn {
            pool: pool.clone(),
            conn: Arc::new(tokio::sync::Mutex::new(None)),
        }
    }

    /// Run `q` on the kept connection (taking one from the pool first if there is none).
    async fn fetch_all(
        &self,
        q: sqlx::query::Query<'_, sqlx::Any, sqlx::any::AnyArguments>,
    ) -> Result<Vec<sqlx::any::AnyRow>, KbsError> {
        let mut slot = self.conn.lock().await;
        let conn = match &mut *slot {
            Some(c) => c,
            empty => empty.insert(self.pool.acquire().await?),
        };
        let answered = q.fetch_all(&mut **conn).await;
        if answered.is_err() {
            *slot = None;
        }
        Ok(answered?)
    }
}

/// One statement for a batch of session rows: `true` for each row inserted, `false` for a
/// replayed challenge (its id already stored, or earlier in this batch).
async fn insert_sessions(w: WriterConn, rows: Vec<NewSession>) -> Result<Vec<bool>, KbsError> {
    let mut seen = HashSet::new();
    let fresh: Vec<&NewSession> = rows.iter().filter(|r| seen.insert(&r.id)).collect();
    let sql = format!(
        "INSERT INTO sessions (id, nonce, tee, state, created_at, expires_at, tee_pubkey, token)
         VALUES {} ON CONFLICT (id) DO NOTHING RETURNING id",
        placeholders(fresh.len(), 8)
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
            .bind(r.tee_pubkey.clone())
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

/// One statement for a batch of audit rows (their `seq` follows the batch's order).
async fn insert_audits(w: WriterConn, rows: Vec<NewAudit>) -> Result<Vec<()>, KbsError> {
    let sql = format!(
        "INSERT INTO audit (at, actor, action, subject, detail) VALUES {}",
        placeholders(rows.len(), 5)
    );
    let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
    for r in &rows {
        q = q
            .bind(r.at)
            .bind(r.actor.clone())
            .bind(r.action.clone())
            .bind(r.subject.clone())
            .bind(r.detail.clone());
    }
    w.fetch_all(q).await?;
    Ok(vec![(); rows.len()])
}

fn aad(path: &str) -> Vec<u8> {
    let mut a = b"cgx-kbs/resource/v1\0".to_vec();
    a.extend_from_slice(path.as_bytes());
    a
}

/// Unix seconds now (the I/O edge: the store and handlers read the clock; logic takes `now`).
pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}
