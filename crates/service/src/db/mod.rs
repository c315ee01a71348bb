//! The database every cgx service uses: sqlx's `Any` driver over SQLite (the embedded default,
//! one replica) or PostgreSQL (several replicas), one SQL dialect (`$n` placeholders work on
//! both), versioned migrations that replicas starting together run exactly once, writers that
//! keep their connection, and group commit for the writes every request makes: [`GroupCommit`]
//! (a writer task) or, on an SQLite file, [`InlineCommit`] (the requests write the batches
//! themselves), both behind [`Commit`].
//!
//! A row proves nothing by itself: services verify what they read (see DESIGN.md's trust model).

mod group_commit;
mod inline;

use std::sync::Arc;
use std::time::Duration;

use sqlx::AnyPool;
use sqlx::Row;
use sqlx::any::AnyPoolOptions;

pub use group_commit::{GroupCommit, WriteBatch, placeholders};
pub use inline::{InlineBatch, InlineCommit, SqliteConn};

/// Database errors. What reaches a client is only the service's own error code: a driver's
/// message can name tables, files and hosts.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DbError {
    #[error("database URL: {0}")]
    Url(String),
    #[error(transparent)]
    Sqlx(#[from] sqlx::Error),
    #[error(transparent)]
    Sqlite(#[from] rusqlite::Error),
    #[error("batch write: {0}")]
    Batch(String),
    #[error("the database writer has stopped")]
    WriterStopped,
    /// A checkpoint could not run (another connection holds the checkpoint lock).
    #[error("WAL checkpoint busy")]
    CheckpointBusy,
}

/// Which database a URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    /// The backend `url` names: `sqlite:…`, `postgres://…` or `postgresql://…`.
    pub fn of(url: &str) -> Option<Self> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Some(Backend::Postgres)
        } else if url.starts_with("sqlite:") {
            Some(Backend::Sqlite)
        } else {
            None
        }
    }
}

/// One versioned migration: the statements for each backend (`;`-separated; empty: nothing to
/// do on that backend). Versions only grow; a migration never changes once released.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    pub version: i64,
    pub sqlite: &'static str,
    pub postgres: &'static str,
}

/// A connection pool and what it is connected to.
#[derive(Debug, Clone)]
pub struct Database {
    pool: AnyPool,
    /// Where a service's single writer begins its transactions ([`Database::write_pool`]):
    /// on an SQLite file a pool of one connection of its own; otherwise (PostgreSQL, where
    /// replicas write too; in-memory SQLite, where a second pool would open a second
    /// database) the pool itself.
    writer: AnyPool,
    backend: Backend,
    /// The SQLite file, for [`Database::inline_conn`] (none for PostgreSQL and in-memory).
    sqlite_file: Option<std::path::PathBuf>,
    durable: bool,
}

impl Database {
    /// Connect: `sqlite://PATH` (created if missing; WAL, mmap reads) or `postgres://…`.
    /// SQLite commits at `synchronous=NORMAL` (a power loss may drop the last commits, never
    /// corrupt); a service sets FULL where it needs it, or opens with [`Database::open_durable`].
    pub async fn open(url: &str) -> Result<Self, DbError> {
        Self::open_with(url, false).await
    }

    /// [`Database::open`] with every SQLite connection at `synchronous=FULL`: an acknowledged
    /// commit survives a power loss (for stores whose every write cannot be recomputed).
    pub async fn open_durable(url: &str) -> Result<Self, DbError> {
        Self::open_with(url, true).await
    }

    async fn open_with(url: &str, durable: bool) -> Result<Self, DbError> {
        sqlx::any::install_default_drivers();
        let Some(backend) = Backend::of(url) else {
            return Err(DbError::Url(format!(
                "must be sqlite://… or postgres://…, not '{}'",
                url.split(':').next().unwrap_or("")
            )));
        };
        let sqlite = backend == Backend::Sqlite;
        let url = if sqlite && !url.contains('?') && !url.contains(":memory:") {
            format!("{url}?mode=rwc")
        } else {
            url.to_string()
        };
        let opts = if sqlite {
            sqlite_pool_options(durable).max_connections(8)
        } else {
            AnyPoolOptions::new().max_connections(16)
        };
        // Inline writers open the file itself: only for a plain file URL (`mode=memory`, `ro`
        // or other options keep every write on the pool).
        let plain_file = url
            .split_once('?')
            .is_none_or(|(_, q)| q.split('&').all(|p| matches!(p, "mode=rwc" | "mode=rw")));
        let sqlite_file = if sqlite && plain_file && !url.contains(":memory:") {
            use std::str::FromStr;
            let opts = sqlx::sqlite::SqliteConnectOptions::from_str(&url)?;
            Some(opts.get_filename().to_path_buf())
        } else {
            None
        };
        let pool = opts.connect(&url).await?;
        // SQLite keeps a page cache per connection and drops it whenever another connection
        // has written since: writes that took any pool connection found it cold each batch
        // and read their B-tree pages again from the log (about seven reads a placement). One
        // connection for the writer keeps its pages warm; readers keep the pool.
        let writer = if sqlite_file.is_some() {
            // Opened on first use (a service with writers of its own, the KBS's inline ones,
            // never holds it), and kept: recycling it would drop the cache it is for.
            sqlite_pool_options(durable)
                .max_connections(1)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_lazy(&url)?
        } else {
            pool.clone()
        };
        Ok(Database {
            pool,
            writer,
            backend,
            sqlite_file,
            durable,
        })
    }

    /// A connection of its own to this SQLite file for [`InlineCommit`] writers (the pool's
    /// `synchronous`, no busy wait, no automatic checkpoint); `None` for PostgreSQL and for
    /// SQLite URLs other than a plain file (use [`GroupCommit`]). Open it after migrating: the
    /// file must exist.
    pub fn inline_conn(&self) -> Result<Option<Arc<SqliteConn>>, DbError> {
        match &self.sqlite_file {
            Some(f) => Ok(Some(Arc::new(SqliteConn::open(f, self.durable)?))),
            None => Ok(None),
        }
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// The pool a service's single writer (its [`GroupCommit`] batch) begins transactions on:
    /// one connection of its own on an SQLite file, whose page cache then stays warm from
    /// batch to batch; the pool itself on PostgreSQL and in-memory SQLite.
    ///
    /// For the one writer only: a second user would queue behind it for the connection (up to
    /// the pool's acquire timeout) instead of waiting on SQLite's lock.
    pub fn write_pool(&self) -> &AnyPool {
        &self.writer
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// A transaction that holds the database's migration lock `lock` (a service's own number):
    /// replicas that start together migrate one at a time, and the later ones find the work
    /// done. SQLite: `BEGIN IMMEDIATE` takes the write lock before anything is read (a deferred
    /// transaction that read first could not write after another's commit); PostgreSQL: a
    /// transaction-scoped advisory lock.
    async fn migration_tx(
        &self,
        lock: i64,
    ) -> Result<sqlx::Transaction<'static, sqlx::Any>, DbError> {
        match self.backend {
            Backend::Postgres => {
                let mut tx = self.pool.begin().await?;
                sqlx::query("SELECT pg_advisory_xact_lock($1)")
                    .bind(lock)
                    .execute(&mut *tx)
                    .await?;
                Ok(tx)
            }
            Backend::Sqlite => Ok(self.pool.begin_with("BEGIN IMMEDIATE").await?),
        }
    }

    /// Apply every migration not yet applied, in order, each in its own locked transaction;
    /// `now` (Unix seconds) is recorded as when.
    pub async fn migrate(
        &self,
        lock: i64,
        migrations: &[Migration],
        now: i64,
    ) -> Result<(), DbError> {
        let mut tx = self.migration_tx(lock).await?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY, applied_at BIGINT NOT NULL)",
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        for m in migrations {
            let mut tx = self.migration_tx(lock).await?;
            let done = sqlx::query("SELECT version FROM schema_migrations WHERE version = $1")
                .bind(m.version)
                .fetch_optional(&mut *tx)
                .await?;
            if done.is_some() {
                continue;
            }
            let sql = match self.backend {
                Backend::Postgres => m.postgres,
                Backend::Sqlite => m.sqlite,
            };
            for stmt in statements(sql) {
                sqlx::query(stmt).execute(&mut *tx).await?;
            }
            sqlx::query(
                "INSERT INTO schema_migrations (version, applied_at) VALUES ($1, $2) ON CONFLICT (version) DO NOTHING",
            )
            .bind(m.version)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
        }
        Ok(())
    }

    /// The highest applied migration.
    pub async fn schema_version(&self) -> Result<i64, DbError> {
        let row = sqlx::query("SELECT MAX(version) AS v FROM schema_migrations")
            .fetch_one(&self.pool)
            .await?;
        Ok(row.try_get::<i64, _>("v").unwrap_or(0))
    }

    /// Fold the SQLite write-ahead log back into the database without blocking writers (a
    /// service does this often, see [`checkpoints`], so commits never pay for a checkpoint);
    /// nothing on PostgreSQL. Returns the frames in the log (0 on PostgreSQL): all it holds
    /// since a writer last started it over, which a writer does after a complete checkpoint.
    pub async fn checkpoint(&self) -> Result<u64, DbError> {
        if self.backend != Backend::Sqlite {
            return Ok(0);
        }
        // One row: busy (1 where another connection held the checkpoint lock), frames in the
        // log, frames checkpointed; both -1 when nothing ran.
        let row = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
            .fetch_one(&self.pool)
            .await?;
        let busy: i64 = row.try_get(0)?;
        let log: i64 = row.try_get(1)?;
        match u64::try_from(log) {
            Ok(frames) if busy == 0 => Ok(frames),
            _ => Err(DbError::CheckpointBusy),
        }
    }

    /// Wait for every connection to come back, then close.
    pub async fn close(&self) {
        self.writer.close().await;
        self.pool.close().await;
    }
}

/// The pace of [`checkpoints`]: as often as [`CHECKPOINT_MIN`] under load, so each
/// checkpoint (and its fsync) stays small — one every few seconds under heavy load stalls
/// concurrent commits for tens of milliseconds — and as seldom as [`CHECKPOINT_MAX`] when
/// little is written, since each costs a thread hand-off and two fsyncs whatever it folds back.
pub const CHECKPOINT_MIN: Duration = Duration::from_millis(500);
/// See [`CHECKPOINT_MIN`].
pub const CHECKPOINT_MAX: Duration = Duration::from_secs(2);
/// The log frames a checkpoint aims to fold back (about 2 MiB of pages).
const CHECKPOINT_FRAMES: u64 = 512;

/// The frames written since the checkpoint before, from the log's length then and now: the
/// log only grows until a writer starts it over (then all of it is new).
pub fn new_frames(before: u64, now: u64) -> u64 {
    if now >= before { now - before } else { now }
}

/// The wait before the next checkpoint, after one that found `frames` new in the log: scaled
/// so the next finds about [`CHECKPOINT_FRAMES`], within
/// [`CHECKPOINT_MIN`]..=[`CHECKPOINT_MAX`].
pub fn checkpoint_pace(waited: Duration, frames: u64) -> Duration {
    let scaled = waited.as_secs_f64() * CHECKPOINT_FRAMES as f64 / frames.max(1) as f64;
    Duration::from_secs_f64(
        scaled.clamp(CHECKPOINT_MIN.as_secs_f64(), CHECKPOINT_MAX.as_secs_f64()),
    )
}

/// A service's checkpoint task: `checkpoint` (the store's [`Database::checkpoint`]) one at a
/// time, at [`checkpoint_pace`] of the frames written since the last one — a slow disk must
/// not pile them up. A failure (the database busy, normal under load) is retried at the
/// shortest wait.
pub async fn checkpoints<F, Fut, E>(mut checkpoint: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<u64, E>>,
    E: std::fmt::Display,
{
    let mut wait = CHECKPOINT_MIN;
    let mut log = 0;
    loop {
        tokio::time::sleep(wait).await;
        wait = match checkpoint().await {
            Ok(now) => {
                let fresh = new_frames(log, now);
                log = now;
                checkpoint_pace(wait, fresh)
            }
            Err(e) => {
                tracing::debug!(error = %e, "WAL checkpoint deferred");
                CHECKPOINT_MIN
            }
        };
    }
}

/// A pool of SQLite connections, each set up with [`sqlite_settings`] and [`POOL_SETTINGS`].
/// An embedded database does not drop connections: pinging each one before use would cost
/// every statement a second round trip to its worker thread.
fn sqlite_pool_options(durable: bool) -> AnyPoolOptions {
    let settings = sqlite_settings(durable, POOL_SETTINGS);
    AnyPoolOptions::new()
        .test_before_acquire(false)
        .after_connect(move |conn, _| {
            let settings = settings.clone();
            Box::pin(async move {
                use sqlx::Executor;
                conn.execute(sqlx::AssertSqlSafe(settings)).await?;
                Ok(())
            })
        })
}

/// What a pooled SQLite connection sets after [`sqlite_settings`]: it waits for the write lock,
/// checkpoints only when the log is large (the checkpoint task does the rest), reads by mmap.
const POOL_SETTINGS: &str = "PRAGMA busy_timeout=5000; PRAGMA wal_autocheckpoint=20000; PRAGMA mmap_size=268435456; PRAGMA cache_size=-65536;";

/// The settings every SQLite connection of a service gets: WAL, `synchronous` FULL if
/// `durable` else NORMAL, then `rest` (the connection's own waiting and checkpointing).
pub(crate) fn sqlite_settings(durable: bool, rest: &str) -> String {
    let sync = if durable { "FULL" } else { "NORMAL" };
    format!("PRAGMA journal_mode=WAL; PRAGMA synchronous={sync}; {rest}")
}

/// A per-request write path: inline on an SQLite file, through a writer task otherwise.
pub enum Commit<T, R> {
    Queued(GroupCommit<T, R>),
    Inline(InlineCommit<T, R>),
}

impl<T, R> std::fmt::Debug for Commit<T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Commit::Queued(_) => f.write_str("Commit::Queued"),
            Commit::Inline(_) => f.write_str("Commit::Inline"),
        }
    }
}

impl<T: Send + 'static, R: Send + 'static> Commit<T, R> {
    /// Write `row` and wait for its commit.
    pub async fn write(&self, row: T) -> Result<R, DbError> {
        match self {
            Commit::Queued(q) => q.write(row).await,
            Commit::Inline(i) => i.write(row).await,
        }
    }
}

/// The connection a batch writer keeps between batches: no pool round trip per batch, and its
/// page cache stays warm for its table. Dropped after an error; the next batch takes a new one.
#[derive(Clone)]
pub struct WriterConn {
    pool: AnyPool,
    conn: Arc<tokio::sync::Mutex<Option<sqlx::pool::PoolConnection<sqlx::Any>>>>,
}

impl std::fmt::Debug for WriterConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriterConn").finish_non_exhaustive()
    }
}

/// The kept connection, taking one from the pool first if there is none.
async fn kept<'a>(
    slot: &'a mut Option<sqlx::pool::PoolConnection<sqlx::Any>>,
    pool: &AnyPool,
) -> Result<&'a mut sqlx::pool::PoolConnection<sqlx::Any>, DbError> {
    Ok(match slot {
        Some(c) => c,
        empty => empty.insert(pool.acquire().await?),
    })
}

/// In a PostgreSQL transaction, take the transaction-scoped advisory lock `key`: transactions
/// that all do so commit one at a time, in the order they took it, across every process on the
/// database. A holder that never lets go (a stalled session) fails the waiter after 10 s rather
/// than stalling it for good.
pub async fn lock_in_commit_order(
    tx: &mut sqlx::AnyConnection,
    key: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query("SET LOCAL lock_timeout = '10s'")
        .execute(&mut *tx)
        .await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(key)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

impl WriterConn {
    pub fn new(db: &Database) -> Self {
        WriterConn {
            pool: db.pool.clone(),
            conn: Arc::new(tokio::sync::Mutex::new(None)),
        }
    }

    /// Run `q` on the kept connection (taking one from the pool first if there is none).
    pub async fn fetch_all(
        &self,
        q: sqlx::query::Query<'_, sqlx::Any, sqlx::any::AnyArguments>,
    ) -> Result<Vec<sqlx::any::AnyRow>, DbError> {
        let mut slot = self.conn.lock().await;
        let conn = kept(&mut slot, &self.pool).await?;
        let answered = q.fetch_all(&mut **conn).await;
        if answered.is_err() {
            *slot = None;
        }
        Ok(answered?)
    }

    /// Run `q` on the kept connection in a transaction that first takes
    /// [`lock_in_commit_order`]`(key)`: a sequence the statement draws from is then in commit
    /// order, so a reader paging by it never passes a row that commits later.
    pub async fn fetch_all_in_lock_order(
        &self,
        key: i64,
        q: sqlx::query::Query<'_, sqlx::Any, sqlx::any::AnyArguments>,
    ) -> Result<Vec<sqlx::any::AnyRow>, DbError> {
        let mut slot = self.conn.lock().await;
        let conn = kept(&mut slot, &self.pool).await?;
        let answered = async {
            let mut tx = sqlx::Connection::begin(&mut **conn).await?;
            lock_in_commit_order(&mut tx, key).await?;
            let rows = q.fetch_all(&mut *tx).await?;
            tx.commit().await?;
            Ok::<_, sqlx::Error>(rows)
        }
        .await;
        if answered.is_err() {
            *slot = None;
        }
        Ok(answered?)
    }

    /// Give the kept connection back (before the pool closes).
    pub async fn release(&self) {
        *self.conn.lock().await = None;
    }
}

/// The statements of a migration's text: split at each `;` outside a quoted string (`'…'`),
/// a dollar-quoted body (`$$…$$`, PostgreSQL functions) and a `BEGIN … END` block (SQLite
/// trigger bodies), trimmed, empty ones dropped. Migrations are this crate's users' own text;
/// a `CASE … END` must not sit inside a trigger body (it would close the block).
pub(crate) fn statements(sql: &str) -> Vec<&str> {
    let bytes = sql.as_bytes();
    let word_at = |i: usize, w: &str| {
        let end = i + w.len();
        let boundary =
            |j: Option<&u8>| j.is_none_or(|b| !(b.is_ascii_alphanumeric() || *b == b'_'));
        bytes.len() >= end
            && bytes[i..end].eq_ignore_ascii_case(w.as_bytes())
            && boundary(i.checked_sub(1).and_then(|k| bytes.get(k)))
            && boundary(bytes.get(end))
    };
    let (mut out, mut start, mut depth) = (Vec::new(), 0usize, 0usize);
    let (mut quoted, mut dollar) = (false, false);
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if dollar {
            if bytes[i..].starts_with(b"$$") {
                dollar = false;
                i += 2;
                continue;
            }
        } else if quoted {
            quoted = b != b'\'';
        } else if b == b'\'' {
            quoted = true;
        } else if bytes[i..].starts_with(b"$$") {
            dollar = true;
            i += 2;
            continue;
        } else if word_at(i, "BEGIN") {
            depth += 1;
        } else if word_at(i, "END") {
            depth = depth.saturating_sub(1);
        } else if b == b';' && depth == 0 {
            out.push(sql[start..i].trim());
            start = i + 1;
        }
        i += 1;
    }
    out.push(sql[start..].trim());
    out.retain(|s| !s.is_empty());
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A migration's statements: split at `;`, but not inside strings, `$$` bodies or
    /// `BEGIN … END` trigger bodies; words that only contain BEGIN or END do not count.
    #[test]
    fn migration_text_splits_into_its_statements() {
        assert_eq!(
            statements(
                "CREATE TABLE a (x TEXT DEFAULT ';');\n ALTER TABLE a ADD COLUMN ended_at BIGINT; ;"
            ),
            [
                "CREATE TABLE a (x TEXT DEFAULT ';')",
                "ALTER TABLE a ADD COLUMN ended_at BIGINT"
            ]
        );
        let sqlite = "CREATE INDEX i ON a (x);
            CREATE TRIGGER t AFTER UPDATE OF ended_at ON a BEGIN
              INSERT INTO b (last_end) VALUES (NEW.ended_at);
              UPDATE c SET end_reason = 'x;y';
            END;
            CREATE TABLE d (y TEXT)";
        let got = statements(sqlite);
        assert_eq!(got.len(), 3, "{got:?}");
        assert!(
            got[1].starts_with("CREATE TRIGGER") && got[1].ends_with("END"),
            "{got:?}"
        );
        let postgres = "CREATE FUNCTION f() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN INSERT INTO b VALUES (1); RETURN NULL; END
            $$;
            CREATE TRIGGER t AFTER UPDATE ON a FOR EACH ROW EXECUTE FUNCTION f()";
        let got = statements(postgres);
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].ends_with("$$"), "{got:?}");
    }

    /// Inline writers open the file the URL names, so only a plain file URL gets them: an
    /// in-memory or read-only pool must not have its writes land in a file beside it.
    #[tokio::test]
    async fn only_a_plain_sqlite_file_gets_an_inline_connection() {
        let dir = std::env::temp_dir().join(format!("cgx-db-inline-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("x.db");
        let plain = Database::open(&format!("sqlite://{}", file.display()))
            .await
            .unwrap();
        assert!(plain.inline_conn().unwrap().is_some());
        for url in [
            format!("sqlite://{}?mode=memory", dir.join("m.db").display()),
            "sqlite::memory:".to_string(),
            format!("sqlite://{}?mode=ro", file.display()),
        ] {
            let db = Database::open(&url).await.unwrap();
            assert!(db.inline_conn().unwrap().is_none(), "{url}");
        }
        assert!(!dir.join("m.db").exists(), "an in-memory pool made a file");
        plain.close().await;
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The writer's pool writes the database the readers read: on an SQLite file, a pool of
    /// one connection of its own (so its page cache stays warm from batch to batch).
    #[tokio::test]
    async fn the_writer_writes_what_the_readers_read() {
        let dir = std::env::temp_dir().join(format!("cgx-db-writer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let db = Database::open_durable(&format!("sqlite://{}", dir.join("w.db").display()))
            .await
            .unwrap();
        assert_eq!(db.write_pool().options().get_max_connections(), 1);
        assert!(db.pool().options().get_max_connections() > 1);
        sqlx::query("CREATE TABLE t (n BIGINT)")
            .execute(db.pool())
            .await
            .unwrap();
        for n in 0..3i64 {
            let mut tx = db.write_pool().begin().await.unwrap();
            sqlx::query("INSERT INTO t (n) VALUES ($1)")
                .bind(n)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            let seen: i64 = sqlx::query("SELECT COUNT(*) FROM t")
                .fetch_one(db.pool())
                .await
                .unwrap()
                .try_get(0)
                .unwrap();
            assert_eq!(seen, n + 1);
        }
        db.close().await;
        assert!(db.write_pool().is_closed() && db.pool().is_closed());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The checkpoint task paces itself by what a checkpoint reports, so the count must be
    /// read: 0 from a log full of frames would stretch the wait to its longest under load.
    #[tokio::test]
    async fn a_checkpoint_reports_the_frames_it_found() {
        let dir = std::env::temp_dir().join(format!("cgx-db-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let db = Database::open(&format!("sqlite://{}", dir.join("c.db").display()))
            .await
            .unwrap();
        sqlx::query("CREATE TABLE t (n BIGINT)")
            .execute(db.pool())
            .await
            .unwrap();
        for n in 0..20i64 {
            sqlx::query("INSERT INTO t (n) VALUES ($1)")
                .bind(n)
                .execute(db.pool())
                .await
                .unwrap();
        }
        let found = db.checkpoint().await.unwrap();
        assert!(found >= 20, "{found} frames for 20 commits");
        // Nothing written since: the same log, none of it new.
        let again = db.checkpoint().await.unwrap();
        assert_eq!(again, found);
        assert_eq!(new_frames(found, again), 0);
        // Folded back whole, so the next commit starts the log over: a short log, all new.
        sqlx::query("INSERT INTO t (n) VALUES (1)")
            .execute(db.pool())
            .await
            .unwrap();
        let restarted = db.checkpoint().await.unwrap();
        assert!(restarted < found, "{restarted} of {found}");
        assert_eq!(new_frames(found, restarted), restarted);
        db.close().await;
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn checkpoints_follow_the_writes_within_their_bounds() {
        let half = Duration::from_millis(500);
        // The target found: the wait stays.
        assert_eq!(checkpoint_pace(half, CHECKPOINT_FRAMES), half);
        // Few frames: longer, up to the longest; none at all: the longest.
        assert_eq!(
            checkpoint_pace(half, CHECKPOINT_FRAMES / 2),
            Duration::from_secs(1)
        );
        assert_eq!(checkpoint_pace(CHECKPOINT_MAX, 1), CHECKPOINT_MAX);
        assert_eq!(checkpoint_pace(half, 0), CHECKPOINT_MAX);
        // Many: back to the shortest at once.
        assert_eq!(checkpoint_pace(CHECKPOINT_MAX, 1 << 20), CHECKPOINT_MIN);
        assert_eq!(
            checkpoint_pace(Duration::from_secs(2), CHECKPOINT_FRAMES * 2),
            Duration::from_secs(1)
        );
        assert_eq!(new_frames(100, 150), 50);
        assert_eq!(new_frames(100, 30), 30);
    }
}
