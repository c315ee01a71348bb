//! The evaluator threads untrusted programs run on: never a serving thread, never a tokio
//! worker, never under a caller's lock. [`Sandbox::submit`] queues a closure and answers a
//! [`Pending`] that resolves with the closure's result, or with [`Error::Limit`]
//! ([`Exceeded::Time`]) once its deadline passes, whichever is first — a watchdog thread
//! resolves it at the deadline even when the evaluation itself is stuck in one slow instruction
//! ([`crate::limits`] says which). `Pending` is a `Future` (any executor) and has a blocking
//! [`Pending::wait`].
//!
//! A thread still busy well past its deadline is counted as stuck and replaced, up to
//! [`MAX_REPLACEMENTS`] extra threads; a stuck thread that finishes leaves if it is surplus. A
//! full queue answers [`Error::Busy`] at once. A panic inside an evaluation is its error.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::Error;
use crate::limits::Exceeded;

/// Evaluator threads of the process-wide sandbox ([`Sandbox::global`]).
pub const THREADS: usize = 2;
/// Evaluations waiting at most; one more is refused with [`Error::Busy`].
pub const MAX_QUEUE: usize = 1024;
/// Threads started beyond [`THREADS`] to stand in for stuck ones, at most.
pub const MAX_REPLACEMENTS: usize = 4;
/// A busy thread past its evaluation's deadline is counted as stuck: its answer has been
/// refused by then, and the VM's own timer stops anything but one slow instruction within a few
/// microseconds of the deadline.
const STUCK_AFTER: Duration = Duration::ZERO;

type Job = Box<dyn FnOnce() + Send>;

/// A pool of evaluator threads with deadlines.
#[derive(Clone)]
pub struct Sandbox {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox")
            .field("threads", &self.inner.threads)
            .finish_non_exhaustive()
    }
}

struct Inner {
    threads: usize,
    state: Mutex<State>,
    work: Condvar,
    watch: Mutex<Vec<(Instant, Weak<dyn Expire>)>>,
    watch_changed: Condvar,
}

struct State {
    /// Each waiting evaluation with its deadline.
    queue: VecDeque<(Instant, Job)>,
    workers: usize,
    next_id: u64,
    /// Each busy worker's id and its current evaluation's deadline.
    busy: Vec<(u64, Instant)>,
    watchdog: bool,
}

impl State {
    fn stuck(&self, now: Instant) -> usize {
        self.busy
            .iter()
            .filter(|(_, deadline)| *deadline + STUCK_AFTER < now)
            .count()
    }
}

impl Sandbox {
    /// A sandbox of `threads` evaluators (at least one), started on first use.
    pub fn new(threads: usize) -> Self {
        Sandbox {
            inner: Arc::new(Inner {
                threads: threads.max(1),
                state: Mutex::new(State {
                    queue: VecDeque::new(),
                    workers: 0,
                    next_id: 0,
                    busy: Vec::new(),
                    watchdog: false,
                }),
                work: Condvar::new(),
                watch: Mutex::new(Vec::new()),
                watch_changed: Condvar::new(),
            }),
        }
    }

    /// The process-wide sandbox of [`THREADS`] evaluators.
    pub fn global() -> &'static Sandbox {
        static GLOBAL: OnceLock<Sandbox> = OnceLock::new();
        GLOBAL.get_or_init(|| Sandbox::new(THREADS))
    }

    /// Run `f` on an evaluator thread; the answer is refused with [`Exceeded::Time`] once
    /// `limit` has passed from now, queueing included.
    pub fn submit<T, F>(&self, limit: Duration, f: F) -> Pending<T>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, Error> + Send + 'static,
    {
        let slot = Arc::new(Slot::new(limit));
        let deadline = Instant::now() + limit;
        let for_job = slot.clone();
        let job: Job = Box::new(move || {
            if Instant::now() >= deadline {
                for_job.complete(Err(Error::Limit(Exceeded::Time(limit))));
                return;
            }
            let out =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| {
                    Err(Error::Policy {
                        detail: "evaluation failed (the evaluator panicked)".into(),
                    })
                });
            for_job.complete(out);
        });
        let Ok(mut state) = self.inner.state.lock() else {
            slot.complete(Err(Error::Busy));
            return Pending(slot);
        };
        if state.queue.len() >= MAX_QUEUE {
            drop(state);
            slot.complete(Err(Error::Busy));
            return Pending(slot);
        }
        state.queue.push_back((deadline, job));
        let now = Instant::now();
        let live = state.workers.saturating_sub(state.stuck(now));
        // Every waiting evaluation, this one included, is owed a thread that is not busy.
        let idle = state.workers.saturating_sub(state.busy.len());
        if state.queue.len() > idle
            && live < self.inner.threads
            && state.workers < self.inner.threads + MAX_REPLACEMENTS
        {
            self.spawn_worker(&mut state);
        }
        if !state.watchdog {
            state.watchdog = true;
            let inner = Arc::downgrade(&self.inner);
            let _ = std::thread::Builder::new()
                .name("cgx-policy-watch".into())
                .spawn(move || watchdog(inner));
        }
        drop(state);
        self.inner.work.notify_one();
        if let Ok(mut w) = self.inner.watch.lock() {
            let weak: Weak<dyn Expire> = Arc::downgrade(&slot) as Weak<dyn Expire>;
            w.push((deadline, weak));
        }
        self.inner.watch_changed.notify_one();
        Pending(slot)
    }

    fn spawn_worker(&self, state: &mut State) {
        let id = state.next_id;
        state.next_id += 1;
        let inner = self.inner.clone();
        let started = std::thread::Builder::new()
            .name("cgx-policy-eval".into())
            .spawn(move || worker(inner, id));
        if started.is_ok() {
            state.workers += 1;
        }
    }
}

fn worker(inner: Arc<Inner>, id: u64) {
    loop {
        let job = {
            let Ok(mut state) = inner.state.lock() else {
                return;
            };
            loop {
                if let Some((deadline, job)) = state.queue.pop_front() {
                    state.busy.push((id, deadline));
                    break job;
                }
                // A surplus thread (one stood in for a stuck one that has since finished)
                // leaves when there is nothing to do.
                if state.workers > inner.threads
                    && state.workers - state.stuck(Instant::now()) > inner.threads
                {
                    state.workers -= 1;
                    return;
                }
                state = match inner.work.wait(state) {
                    Ok(s) => s,
                    Err(_) => return,
                };
            }
        };
        job();
        if let Ok(mut state) = inner.state.lock() {
            state.busy.retain(|(b, _)| *b != id);
        }
    }
}

/// Resolves every pending evaluation whose deadline has passed.
fn watchdog(inner: Weak<Inner>) {
    loop {
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let Ok(mut watch) = inner.watch.lock() else {
            return;
        };
        let now = Instant::now();
        watch.retain(|(deadline, slot)| match slot.upgrade() {
            None => false,
            Some(s) if *deadline <= now => {
                s.expire();
                false
            }
            Some(s) => !s.done(),
        });
        let next = watch.iter().map(|(d, _)| *d).min();
        let wait = next.map_or(Duration::from_secs(1), |d| d.saturating_duration_since(now));
        let _ = inner.watch_changed.wait_timeout(watch, wait);
    }
}

trait Expire: Send + Sync {
    fn expire(&self);
    fn done(&self) -> bool;
}

/// An answer (once), the waker of the task awaiting it, and whether it has been given.
type SlotState<T> = (Option<Result<T, Error>>, Option<Waker>, bool);

struct Slot<T> {
    limit: Duration,
    state: Mutex<SlotState<T>>,
    ready: Condvar,
}

impl<T> Slot<T> {
    fn new(limit: Duration) -> Self {
        Slot {
            limit,
            state: Mutex::new((None, None, false)),
            ready: Condvar::new(),
        }
    }

    /// The first answer wins: the evaluation's, or the watchdog's refusal.
    fn complete(&self, out: Result<T, Error>) {
        let waker = match self.state.lock() {
            Ok(mut s) if !s.2 => {
                s.0 = Some(out);
                s.2 = true;
                s.1.take()
            }
            _ => None,
        };
        self.ready.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl<T: Send> Expire for Slot<T> {
    fn expire(&self) {
        self.complete(Err(Error::Limit(Exceeded::Time(self.limit))));
    }

    fn done(&self) -> bool {
        self.state.lock().map_or(true, |s| s.2)
    }
}

/// An evaluation's answer, to come.
pub struct Pending<T>(Arc<Slot<T>>);

impl<T> std::fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending").finish_non_exhaustive()
    }
}

impl<T> Pending<T> {
    /// Block the calling (non-async) thread for the answer; never longer than the deadline
    /// (and a little slack for the watchdog).
    pub fn wait(self) -> Result<T, Error> {
        let limit = self.0.limit;
        let give_up = Instant::now() + limit + Duration::from_millis(100);
        let Ok(mut s) = self.0.state.lock() else {
            return Err(Error::Limit(Exceeded::Time(limit)));
        };
        loop {
            if let Some(out) = s.0.take() {
                return out;
            }
            let now = Instant::now();
            if now >= give_up {
                return Err(Error::Limit(Exceeded::Time(limit)));
            }
            s = match self.0.ready.wait_timeout(s, give_up - now) {
                Ok((s, _)) => s,
                Err(_) => return Err(Error::Limit(Exceeded::Time(limit))),
            };
        }
    }
}

impl<T> Future for Pending<T> {
    type Output = Result<T, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let limit = self.0.limit;
        let Ok(mut s) = self.0.state.lock() else {
            return Poll::Ready(Err(Error::Limit(Exceeded::Time(limit))));
        };
        if let Some(out) = s.0.take() {
            return Poll::Ready(out);
        }
        if s.2 {
            // Taken by an earlier poll: a finished future polled again.
            return Poll::Ready(Err(Error::Policy {
                detail: "evaluation already answered".into(),
            }));
        }
        s.1 = Some(cx.waker().clone());
        Poll::Pending
    }
}
