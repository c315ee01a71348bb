//! Group commit: many handlers' writes of one kind become one multi-row statement.
//!
//! Each caller still waits for its own row to be committed (an audit event is durable before the
//! key it records leaves; a challenge is used up before its token is issued), but the database
//! sees one statement per batch instead of one per request. Batches form by themselves under
//! load: while one statement runs, the next callers queue behind it. Nothing waits on a timer,
//! so an idle KBS commits each write at once.

use std::future::Future;
use std::pin::Pin;

use tokio::sync::{mpsc, oneshot};

use super::DbError;

/// Rows per statement at most (SQLite allows 32 766 bound parameters; each distinct batch size
/// is one prepared statement per connection, so this also bounds the statement cache).
pub(crate) const MAX_BATCH: usize = 64;

/// Writes one batch; answers one result per row, in order.
pub type WriteBatch<T, R> =
    Box<dyn Fn(Vec<T>) -> Pin<Box<dyn Future<Output = Result<Vec<R>, DbError>> + Send>> + Send>;

/// A queued row and where its result goes.
pub(crate) type Waiter<T, R> = (T, oneshot::Sender<Result<R, DbError>>);

/// Answer each caller of a batch of `n` rows: its own row's result, or the batch's error (also
/// when the writer answered another number of results than rows).
pub(crate) fn answer<R>(
    replies: Vec<oneshot::Sender<Result<R, DbError>>>,
    n: usize,
    written: Result<Vec<R>, DbError>,
) {
    match written {
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

/// A queue in front of one batch writer task.
pub struct GroupCommit<T, R> {
    queue: mpsc::UnboundedSender<Waiter<T, R>>,
}

impl<T, R> Clone for GroupCommit<T, R> {
    fn clone(&self) -> Self {
        GroupCommit {
            queue: self.queue.clone(),
        }
    }
}

impl<T, R> std::fmt::Debug for GroupCommit<T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupCommit").finish_non_exhaustive()
    }
}

impl<T: Send + 'static, R: Send + 'static> GroupCommit<T, R> {
    /// Start the writer task (on the current tokio runtime). It ends when the last handle is
    /// dropped.
    pub fn spawn(write: WriteBatch<T, R>) -> Self {
        let (queue, mut rx) = mpsc::unbounded_channel::<Waiter<T, R>>();
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut waiters = vec![first];
                while waiters.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(w) => waiters.push(w),
                        Err(_) => break,
                    }
                }
                let (rows, replies): (Vec<T>, Vec<_>) = waiters.into_iter().unzip();
                let n = rows.len();
                answer(replies, n, write(rows).await);
            }
        });
        GroupCommit { queue }
    }

    /// Queue `row` and wait until its batch is committed.
    pub async fn write(&self, row: T) -> Result<R, DbError> {
        let (tx, rx) = oneshot::channel();
        self.queue
            .send((row, tx))
            .map_err(|_| DbError::WriterStopped)?;
        rx.await.map_err(|_| DbError::WriterStopped)?
    }
}

/// `($k, $k+1, …), (…)` placeholders for `rows` rows of `cols` columns, numbered from 1.
pub fn placeholders(rows: usize, cols: usize) -> String {
    let mut s = String::with_capacity(rows * cols * 5);
    for r in 0..rows {
        if r > 0 {
            s.push_str(", ");
        }
        s.push('(');
        for c in 0..cols {
            if c > 0 {
                s.push_str(", ");
            }
            s.push('$');
            s.push_str(&(r * cols + c + 1).to_string());
        }
        s.push(')');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn placeholders_number_rows_in_order() {
        assert_eq!(placeholders(1, 2), "($1, $2)");
        assert_eq!(placeholders(2, 3), "($1, $2, $3), ($4, $5, $6)");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_caller_gets_its_own_answer_and_batches_form() {
        let batches = Arc::new(AtomicUsize::new(0));
        let b = batches.clone();
        let g = Arc::new(GroupCommit::<u32, u32>::spawn(Box::new(move |rows| {
            b.fetch_add(1, Ordering::Relaxed);
            Box::pin(async move {
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                Ok(rows.into_iter().map(|r| r * 10).collect())
            })
        })));
        let mut tasks = Vec::new();
        for i in 0..200u32 {
            let g = g.clone();
            tasks.push(tokio::spawn(async move { (i, g.write(i).await) }));
        }
        for t in tasks {
            let (i, r) = t.await.unwrap();
            assert_eq!(r.unwrap(), i * 10);
        }
        let n = batches.load(Ordering::Relaxed);
        assert!(n < 200, "200 writes arriving together took {n} statements");
    }

    #[tokio::test]
    async fn a_failed_batch_fails_each_caller_and_the_next_batch_runs() {
        let g = GroupCommit::<u32, u32>::spawn(Box::new(|rows| {
            Box::pin(async move {
                if rows.contains(&7) {
                    Err(DbError::Batch("disk full".into()))
                } else {
                    Ok(rows)
                }
            })
        }));
        assert!(matches!(g.write(7).await, Err(DbError::Batch(m)) if m.contains("disk full")));
        assert_eq!(g.write(8).await.unwrap(), 8);
    }

    #[tokio::test]
    async fn a_writer_answering_the_wrong_count_is_an_error_not_a_mixup() {
        let g = GroupCommit::<u32, u32>::spawn(Box::new(|_| Box::pin(async { Ok(vec![]) })));
        assert!(g.write(1).await.is_err());
    }
}
