//! Group commit run by the writers themselves, for an SQLite file.
//!
//! sqlx runs each SQLite connection on a worker thread of its own: a write is a hand-off to the
//! [`super::GroupCommit`] task, another to the connection's thread and two back, each a thread
//! wake-up. Measured with CoCo's stock client (`cgx bench coco`), that cost the KBS about
//! 0.17 ms of CPU per write, of a flow's 0.8 ms — for a statement SQLite runs in about 20
//! microseconds (WAL, `synchronous=NORMAL`: a commit is a write into the page cache).
//!
//! Here the caller runs the statement on its own thread, through a connection of its own to the
//! same file, by flat combining: each writer queues its row, then whoever finds no one writing
//! becomes the writer, and writes everything queued (its own row and any that arrived while
//! another batch ran) as batches, until the queue is empty or it has written
//! [`BATCHES_PER_TURN`] of them (then a task of its own takes over, so no request writes for
//! others without end). Idle, a write is one statement and no hand-off; under load, rows still
//! share commits as with [`super::GroupCommit`], and each caller still waits for its own row's
//! commit.
//!
//! The statement runs on an async worker thread, so nothing there may wait: the connection's
//! busy timeout is zero and it never checkpoints (the service's checkpoint task does). A batch
//! that finds the file locked by another writer (an administrator's change, the session
//! sweep, another process) goes to the `fallback` writer task instead, which waits off the
//! workers. A panic in a batch fails that batch only.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::oneshot;

use super::DbError;
use super::GroupCommit;
use super::group_commit::{MAX_BATCH, Waiter, answer};

/// Batches one writer writes before handing the rest of the queue to a task.
pub const BATCHES_PER_TURN: usize = 4;

/// One connection to an SQLite file, shared by the inline writers of a store (one connection
/// writes every table: SQLite has one writer at a time anyway, and a connection's page cache
/// stays warm only while no other connection commits).
pub struct SqliteConn {
    conn: Mutex<rusqlite::Connection>,
}

impl std::fmt::Debug for SqliteConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteConn").finish_non_exhaustive()
    }
}

impl SqliteConn {
    /// Open `path` (which must exist: the pool created and migrated it) in WAL mode with
    /// `synchronous` FULL if `durable` else NORMAL, no busy wait and no automatic checkpoint.
    pub(crate) fn open(path: &Path, durable: bool) -> Result<Self, DbError> {
        use rusqlite::OpenFlags;
        let conn = rusqlite::Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.execute_batch(&super::sqlite_settings(
            durable,
            "PRAGMA busy_timeout=0; PRAGMA wal_autocheckpoint=0;",
        ))?;
        // One prepared statement per batch size in use.
        conn.set_prepared_statement_cache_capacity(MAX_BATCH * 2);
        Ok(SqliteConn {
            conn: Mutex::new(conn),
        })
    }

    /// Run `f` on the connection (waiting for a batch another writer is running on it, which
    /// never waits itself). A panic in `f` is an error, and an open transaction is rolled back.
    pub fn with<T>(
        &self,
        f: impl FnOnce(&rusqlite::Connection) -> Result<T, DbError>,
    ) -> Result<T, DbError> {
        // Nothing unwinds while the lock is held (below), so a poisoned lock holds nothing
        // half-done.
        let conn = self.conn.lock().unwrap_or_else(PoisonError::into_inner);
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&conn))) {
            Ok(r) => r,
            Err(_) => {
                if !conn.is_autocommit() {
                    let _ = conn.execute_batch("ROLLBACK");
                }
                Err(DbError::Batch("the batch writer panicked".into()))
            }
        }
    }
}

/// Writes one batch on the connection; answers one result per row, in order.
pub type InlineBatch<T, R> =
    Box<dyn Fn(&rusqlite::Connection, &[T]) -> Result<Vec<R>, DbError> + Send + Sync>;

/// A queue whose writers commit for each other (flat combining; see `db/inline.rs`).
pub struct InlineCommit<T, R> {
    inner: Arc<Inner<T, R>>,
}

struct Inner<T, R> {
    conn: Arc<SqliteConn>,
    write: InlineBatch<T, R>,
    /// Where a batch goes when another writer holds the file.
    fallback: GroupCommit<T, R>,
    queue: Mutex<Vec<Waiter<T, R>>>,
    /// Someone is draining the queue.
    writing: AtomicBool,
    /// The runtime this writer was made on: hand-offs run there, not on the caller's runtime,
    /// which may be a serving thread's that ends at shutdown with the hand-off still queued
    /// (other callers' rows would then wait for a writer that never runs).
    runtime: Option<tokio::runtime::Handle>,
}

impl<T, R> std::fmt::Debug for InlineCommit<T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InlineCommit").finish_non_exhaustive()
    }
}

/// Clears the writing flag however the drain ends.
struct Writing<'a>(&'a AtomicBool);

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// Whether `e` says another connection holds the lock this write needs.
fn locked(e: &DbError) -> bool {
    matches!(
        e,
        DbError::Sqlite(err) if matches!(
            err.sqlite_error_code(),
            Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
        )
    )
}

impl<T: Send + 'static, R: Send + 'static> InlineCommit<T, R> {
    pub fn new(
        conn: Arc<SqliteConn>,
        write: InlineBatch<T, R>,
        fallback: GroupCommit<T, R>,
    ) -> Self {
        InlineCommit {
            inner: Arc::new(Inner {
                conn,
                write,
                fallback,
                queue: Mutex::new(Vec::new()),
                writing: AtomicBool::new(false),
                runtime: tokio::runtime::Handle::try_current().ok(),
            }),
        }
    }

    /// Queue `row` and wait until its batch is committed (by this caller or another).
    pub async fn write(&self, row: T) -> Result<R, DbError> {
        let (tx, rx) = oneshot::channel();
        self.inner
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((row, tx));
        Inner::drain(&self.inner);
        rx.await.map_err(|_| DbError::WriterStopped)?
    }
}

impl<T: Send + 'static, R: Send + 'static> Inner<T, R> {
    /// Become the writer unless someone is, and write until the queue is empty or this turn's
    /// batches are written (then a task goes on).
    ///
    /// No row is left behind: a caller that finds someone writing queued its row before it
    /// looked, and the writer looks at the queue again after it stops writing; if the row is
    /// there, it (or a newer caller, or the task it starts) writes it.
    fn drain(this: &Arc<Self>) {
        loop {
            if this
                .writing
                .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
            {
                return;
            }
            let writing = Writing(&this.writing);
            let mut turn_over = true;
            for _ in 0..BATCHES_PER_TURN {
                let batch: Vec<Waiter<T, R>> = {
                    let mut q = this.queue.lock().unwrap_or_else(PoisonError::into_inner);
                    let n = q.len().min(MAX_BATCH);
                    q.drain(..n).collect()
                };
                if batch.is_empty() {
                    turn_over = false;
                    break;
                }
                this.commit(batch);
            }
            drop(writing);
            if this
                .queue
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty()
            {
                return;
            }
            if turn_over && let Some(rt) = this.spawner() {
                // This caller has written its turn; a task writes the rest.
                let next = Arc::clone(this);
                rt.spawn(async move { Inner::drain(&next) });
                return;
            }
        }
    }

    /// Where hand-offs run: the writer's own runtime, else the caller's (none: the caller
    /// writes everything itself).
    fn spawner(&self) -> Option<tokio::runtime::Handle> {
        self.runtime
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok())
    }

    fn commit(&self, batch: Vec<Waiter<T, R>>) {
        let (rows, replies): (Vec<T>, Vec<_>) = batch.into_iter().unzip();
        let n = rows.len();
        let written = self.conn.with(|c| (self.write)(c, &rows));
        match (written, self.spawner()) {
            (Err(e), Some(rt)) if locked(&e) => {
                // Another writer holds the file: the writer task waits for it, not this thread.
                for (row, reply) in rows.into_iter().zip(replies) {
                    let fallback = self.fallback.clone();
                    rt.spawn(async move {
                        let _ = reply.send(fallback.write(row).await);
                    });
                }
            }
            (written, _) => answer(replies, n, written),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    fn conn(dir: &Path) -> Arc<SqliteConn> {
        let path = dir.join("t.db");
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch("PRAGMA journal_mode=WAL; CREATE TABLE t (n INTEGER PRIMARY KEY)")
            .unwrap();
        drop(c);
        Arc::new(SqliteConn::open(&path, false).unwrap())
    }

    fn temp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("cgx-inline-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A fallback that records what reaches it and answers `true`.
    fn recording_fallback(seen: Arc<Mutex<Vec<i64>>>) -> GroupCommit<i64, bool> {
        GroupCommit::spawn(Box::new(move |rows: Vec<i64>| {
            let seen = seen.clone();
            Box::pin(async move {
                let n = rows.len();
                seen.lock().unwrap().extend(rows);
                Ok(vec![true; n])
            })
        }))
    }

    /// Inserts each row; `false` for a value already there (or earlier in the batch).
    fn inserter(batches: Arc<AtomicUsize>) -> InlineBatch<i64, bool> {
        Box::new(move |c, rows| {
            // The first batch takes a while, so the writers behind it must queue and share.
            if batches.fetch_add(1, Ordering::SeqCst) == 0 {
                std::thread::sleep(Duration::from_millis(20));
            }
            let mut st =
                c.prepare_cached("INSERT INTO t (n) VALUES (?1) ON CONFLICT (n) DO NOTHING")?;
            let mut out = Vec::new();
            for n in rows {
                out.push(st.execute([n])? == 1);
            }
            Ok(out)
        })
    }

    async fn within<F: std::future::Future>(f: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(20), f)
            .await
            .unwrap_or_else(|_| panic!("a write never completed (a stranded row)"))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn every_row_commits_once_and_batches_form_under_load() {
        let dir = temp("load");
        let batches = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let w = Arc::new(InlineCommit::new(
            conn(&dir),
            inserter(batches.clone()),
            recording_fallback(seen.clone()),
        ));
        let mut tasks = Vec::new();
        for i in 0..2000i64 {
            let w = w.clone();
            // Every value twice: exactly one of the two is told it inserted.
            tasks.push(tokio::spawn(async move { w.write(i / 2).await.unwrap() }));
        }
        let mut firsts = 0;
        for t in tasks {
            firsts += usize::from(within(t).await.unwrap());
        }
        assert_eq!(firsts, 1000);
        let n: i64 = w
            .inner
            .conn
            .with(|c| Ok(c.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0))?))
            .unwrap();
        assert_eq!(n, 1000);
        // Writers that queued behind a running batch shared commits; nothing needed the fallback.
        let b = batches.load(Ordering::SeqCst);
        assert!(b < 1000, "{b} batches for 2000 rows");
        assert!(seen.lock().unwrap().is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_failed_or_panicking_batch_fails_its_rows_and_the_next_one_writes() {
        let dir = temp("fail");
        let w = InlineCommit::new(
            conn(&dir),
            Box::new(|c, rows: &[i64]| {
                c.execute_batch("BEGIN")?;
                c.execute("INSERT INTO t (n) VALUES (?1)", [rows[0]])?;
                match rows[0] {
                    -1 => return Err(DbError::Batch("refused".into())),
                    -2 => panic!("a bug in a batch"),
                    _ => {}
                }
                c.execute_batch("COMMIT")?;
                Ok(vec![(); rows.len()])
            }),
            GroupCommit::spawn(Box::new(|rows: Vec<i64>| {
                Box::pin(async move { Ok(vec![(); rows.len()]) })
            })),
        );
        assert!(within(w.write(-2)).await.is_err());
        assert!(!w.inner.writing.load(Ordering::SeqCst));
        // The panic rolled its transaction back and left the connection usable.
        within(w.write(7)).await.unwrap();
        let rows: Vec<i64> = w
            .inner
            .conn
            .with(|c| {
                let mut st = c.prepare("SELECT n FROM t ORDER BY n")?;
                let v = st.query_map([], |r| r.get(0))?.collect::<Result<_, _>>()?;
                Ok(v)
            })
            .unwrap();
        assert_eq!(rows, [7]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_that_finds_the_file_locked_goes_to_the_fallback_without_waiting() {
        let dir = temp("busy");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let w = InlineCommit::new(
            conn(&dir),
            inserter(Arc::new(AtomicUsize::new(1))),
            recording_fallback(seen.clone()),
        );
        // Another connection holds the write lock (an administrator's change, another process).
        let other = rusqlite::Connection::open(dir.join("t.db")).unwrap();
        other.execute_batch("BEGIN IMMEDIATE").unwrap();
        let started = std::time::Instant::now();
        assert!(within(w.write(5)).await.unwrap());
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "the inline writer waited for the lock: {:?}",
            started.elapsed()
        );
        assert_eq!(*seen.lock().unwrap(), [5]);
        other.execute_batch("ROLLBACK").unwrap();
        // The lock gone, writes are inline again.
        assert!(within(w.write(6)).await.unwrap());
        assert_eq!(*seen.lock().unwrap(), [5]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
