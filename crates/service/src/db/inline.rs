//! Group commit run by the writers themselves, for an SQLite file.
//!
//! sqlx runs each SQLite connection on a worker thread of its own: a write is a hand-off to the
//! [`super::GroupCommit`] task, another to the connection's thread and two back, each a thread
//! wake-up. Measured with CoCo's stock client (`cgx bench coco`), that cost the KBS about
//! 0.17 ms of CPU per write, of a flow's 0.8 ms — for a statement SQLite runs in tens of
//! microseconds (WAL, `synchronous=NORMAL`: a commit is a write into the page cache).
//!
//! Here the caller runs the statement on its own thread, through a connection of its own to the
//! same file, by flat combining: each writer queues its row, then whoever finds no one writing
//! becomes the writer, and writes everything queued (its own row and any that arrived while
//! another batch ran) as one statement, repeating until the queue is empty. Idle, a write is one
//! statement and no hand-off; under load, rows still share statements as with
//! [`super::GroupCommit`], and each caller still waits for its own row's commit.
//!
//! The statement runs on an async worker thread: it is bounded (one batch of at most
//! [`super::group_commit::MAX_BATCH`] rows into the page cache), as the KBS's attestation
//! checks are. A writer blocked by another process's write lock waits at most the connection's
//! busy timeout.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use super::DbError;
use super::group_commit::MAX_BATCH;

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
    /// Open `path` (which must exist: the pool created and migrated it) with the pool's
    /// settings: WAL, `synchronous` FULL if `durable` else NORMAL, a 5 s busy timeout.
    pub(crate) fn open(path: &Path, durable: bool) -> Result<Self, DbError> {
        use rusqlite::OpenFlags;
        let conn = rusqlite::Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.execute_batch(if durable {
            "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA busy_timeout=5000; PRAGMA wal_autocheckpoint=20000;"
        } else {
            "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=5000; PRAGMA wal_autocheckpoint=20000;"
        })?;
        // One prepared statement per batch size in use.
        conn.set_prepared_statement_cache_capacity(MAX_BATCH * 2);
        Ok(SqliteConn {
            conn: Mutex::new(conn),
        })
    }

    /// Run `f` on the connection (waiting for a batch another writer is running on it).
    pub fn with<T>(
        &self,
        f: impl FnOnce(&rusqlite::Connection) -> Result<T, DbError>,
    ) -> Result<T, DbError> {
        let conn = self.conn.lock().map_err(|_| DbError::WriterStopped)?;
        f(&conn)
    }
}

/// Writes one batch on the connection; answers one result per row, in order.
pub type InlineBatch<T, R> =
    Box<dyn Fn(&rusqlite::Connection, Vec<T>) -> Result<Vec<R>, DbError> + Send + Sync>;

type Waiter<T, R> = (T, oneshot::Sender<Result<R, DbError>>);

/// A queue whose writers commit for each other ([module docs](self)).
pub struct InlineCommit<T, R> {
    conn: Arc<SqliteConn>,
    write: InlineBatch<T, R>,
    queue: Mutex<Vec<Waiter<T, R>>>,
    /// Someone is draining the queue.
    writing: AtomicBool,
}

impl<T, R> std::fmt::Debug for InlineCommit<T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InlineCommit").finish_non_exhaustive()
    }
}

/// Clears the writing flag however the drain ends, so a failed batch never leaves the queue
/// without a writer.
struct Writing<'a>(&'a AtomicBool);

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

impl<T, R> InlineCommit<T, R> {
    pub fn new(conn: Arc<SqliteConn>, write: InlineBatch<T, R>) -> Self {
        InlineCommit {
            conn,
            write,
            queue: Mutex::new(Vec::new()),
            writing: AtomicBool::new(false),
        }
    }

    /// Queue `row` and wait until its batch is committed (by this caller or another).
    pub async fn write(&self, row: T) -> Result<R, DbError> {
        let (tx, rx) = oneshot::channel();
        self.queue
            .lock()
            .map_err(|_| DbError::WriterStopped)?
            .push((row, tx));
        self.drain();
        rx.await.map_err(|_| DbError::WriterStopped)?
    }

    /// Become the writer unless someone is, and write until the queue is empty.
    ///
    /// No row is left behind: a caller that finds someone writing queued its row before it
    /// looked, and the writer looks at the queue again after it stops writing; if the row is
    /// there, it (or a newer caller) writes it.
    fn drain(&self) {
        loop {
            if self
                .writing
                .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
            {
                return;
            }
            let writing = Writing(&self.writing);
            loop {
                let batch: Vec<Waiter<T, R>> = match self.queue.lock() {
                    Ok(mut q) => {
                        let n = q.len().min(MAX_BATCH);
                        q.drain(..n).collect()
                    }
                    Err(_) => return,
                };
                if batch.is_empty() {
                    break;
                }
                self.commit(batch);
            }
            drop(writing);
            if self.queue.lock().map(|q| q.is_empty()).unwrap_or(true) {
                return;
            }
        }
    }

    fn commit(&self, batch: Vec<Waiter<T, R>>) {
        let (rows, replies): (Vec<T>, Vec<_>) = batch.into_iter().unzip();
        let n = rows.len();
        match self.conn.with(|c| (self.write)(c, rows)) {
            Ok(results) if results.len() == n => {
                for (reply, r) in replies.into_iter().zip(results) {
                    let _ = reply.send(Ok(r));
                }
            }
            Ok(results) => {
                for reply in replies {
                    let _ = reply.send(Err(DbError::Batch(format!(
                        "batch of {n} rows answered {} results",
                        results.len()
                    ))));
                }
            }
            Err(e) => {
                let msg = e.to_string();
                for reply in replies {
                    let _ = reply.send(Err(DbError::Batch(msg.clone())));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn conn(dir: &Path) -> Arc<SqliteConn> {
        let path = dir.join("t.db");
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch("CREATE TABLE t (n INTEGER PRIMARY KEY)")
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

    /// Inserts each row; `false` for a value already there (or earlier in the batch).
    fn inserter(batches: Arc<AtomicUsize>) -> InlineBatch<i64, bool> {
        Box::new(move |c, rows| {
            // The first batch takes a while, so the writers behind it must queue and share.
            if batches.fetch_add(1, Ordering::SeqCst) == 0 {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let sql = format!(
                "INSERT INTO t (n) VALUES {} ON CONFLICT (n) DO NOTHING RETURNING n",
                super::super::placeholders(rows.len(), 1)
            );
            let mut st = c.prepare_cached(&sql)?;
            let got: Vec<i64> = st
                .query_map(rusqlite::params_from_iter(rows.iter()), |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            // A value inserted answers `true` once, to its first row in the batch.
            let mut claimed = std::collections::HashSet::new();
            Ok(rows
                .iter()
                .map(|n| got.contains(n) && claimed.insert(*n))
                .collect())
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn every_row_commits_once_and_batches_form_under_load() {
        let dir = temp("load");
        let batches = Arc::new(AtomicUsize::new(0));
        let w = Arc::new(InlineCommit::new(conn(&dir), inserter(batches.clone())));
        let mut tasks = Vec::new();
        for i in 0..2000i64 {
            let w = w.clone();
            // Every value twice: exactly one of the two is told it inserted.
            tasks.push(tokio::spawn(async move { w.write(i / 2).await.unwrap() }));
        }
        let mut firsts = 0;
        for t in tasks {
            firsts += usize::from(t.await.unwrap());
        }
        assert_eq!(firsts, 1000);
        let n: i64 = w
            .conn
            .with(|c| Ok(c.query_row("SELECT COUNT(*) FROM t", [], |r| r.get(0))?))
            .unwrap();
        assert_eq!(n, 1000);
        // Writers that queued behind a running batch shared statements.
        let b = batches.load(Ordering::SeqCst);
        assert!(b < 1000, "{b} batches for 2000 rows");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_failed_batch_fails_its_rows_and_the_next_one_writes() {
        let dir = temp("fail");
        let w = InlineCommit::new(
            conn(&dir),
            Box::new(|c, rows: Vec<i64>| {
                if rows.contains(&-1) {
                    return Err(DbError::Batch("refused".into()));
                }
                c.execute("INSERT INTO t (n) VALUES (?1)", [rows[0]])?;
                Ok(vec![(); rows.len()])
            }),
        );
        assert!(w.write(-1).await.is_err());
        w.write(7).await.unwrap();
        assert!(!w.writing.load(Ordering::SeqCst));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
