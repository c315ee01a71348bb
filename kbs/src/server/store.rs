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
use cgx_service::SharedClock;
use cgx_service::db::{
    Backend, Database, DbError, GroupCommit, Migration, WriterConn, placeholders,
};
use sqlx::Row;

use super::error::KbsError;

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
    db: Database,
    clock: SharedClock,
    kek: LessSafeKey,
    sessions: GroupCommit<NewSession, bool>,
    audits: GroupCommit<NewAudit, ()>,
    /// The connections the two writers keep (given back on [`Store::close`]).
    writers: [WriterConn; 2],
    resources: Mutex<HashMap<String, CachedResource>>,
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
        Ok(Store {
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
            db,
            clock,
            kek,
        })
    }

    /// The highest applied migration.
    pub async fn schema_version(&self) -> Result<i64, KbsError> {
        Ok(self.db.schema_version().await?)
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
                created_at: self.clock.unix(),
                expires_at,
                tee_pubkey: tee_pubkey.map(str::to_string),
                token: token.map(str::to_string),
            })
            .await
            .map_err(KbsError::from)
    }

    pub async fn session(&self, id: &str) -> Result<Option<Session>, KbsError> {
        let row =
            sqlx::query("SELECT state, expires_at, tee_pubkey, token FROM sessions WHERE id = $1")
                .bind(id)
                .fetch_optional(self.db.pool())
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

    pub(crate) fn is_sqlite(&self) -> bool {
        self.db.backend() == Backend::Sqlite
    }

    /// Fold the SQLite write-ahead log back into the database without blocking writers
    /// (a background task does this twice a second, so commits never pay for a checkpoint).
    pub(crate) async fn checkpoint(&self) -> Result<(), KbsError> {
        Ok(self.db.checkpoint().await?)
    }

    /// Delete sessions that expired before `now`; returns how many.
    pub(crate) async fn sweep_sessions(&self, now: i64) -> Result<u64, KbsError> {
        Ok(sqlx::query("DELETE FROM sessions WHERE expires_at <= $1")
            .bind(now)
            .execute(self.db.pool())
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
        .bind(self.clock.unix())
        .execute(self.db.pool())
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
            .execute(self.db.pool())
            .await?
            .rows_affected()
            == 1;
        self.forget_resource(path);
        Ok(deleted)
    }

    // ---------------------------------------------------------------- policies

    pub(crate) async fn put_policy(&self, scope: &str, body: &str) -> Result<(), KbsError> {
        sqlx::query(
            "INSERT INTO policies (scope, body, updated_at) VALUES ($1, $2, $3)
             ON CONFLICT (scope) DO UPDATE SET body = excluded.body, updated_at = excluded.updated_at",
        )
        .bind(scope)
        .bind(body)
        .bind(self.clock.unix())
        .execute(self.db.pool())
        .await?;
        Ok(())
    }

    pub(crate) async fn policy(&self, scope: &str) -> Result<Option<String>, KbsError> {
        let row = sqlx::query("SELECT body FROM policies WHERE scope = $1")
            .bind(scope)
            .fetch_optional(self.db.pool())
            .await?;
        Ok(match row {
            Some(r) => Some(r.try_get("body")?),
            None => None,
        })
    }

    /// The policies among `scopes` that exist, as (scope, body).
    pub(crate) async fn policies(
        &self,
        scopes: &[&str; 3],
    ) -> Result<Vec<(String, String)>, KbsError> {
        let rows = sqlx::query("SELECT scope, body FROM policies WHERE scope IN ($1, $2, $3)")
            .bind(scopes[0])
            .bind(scopes[1])
            .bind(scopes[2])
            .fetch_all(self.db.pool())
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
        let at = self.clock.unix();
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
            .map_err(KbsError::from)
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
        .fetch_all(self.db.pool())
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

    pub async fn close(&self) {
        // The pool waits for every connection to come back, the writers' too.
        for w in &self.writers {
            w.release().await;
        }
        self.db.close().await;
    }
}

/// One statement for a batch of session rows: `true` for each row inserted, `false` for a
/// replayed challenge (its id already stored, or earlier in this batch).
async fn insert_sessions(w: WriterConn, rows: Vec<NewSession>) -> Result<Vec<bool>, DbError> {
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
async fn insert_audits(w: WriterConn, rows: Vec<NewAudit>) -> Result<Vec<()>, DbError> {
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
