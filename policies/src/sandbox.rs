//! The evaluator threads untrusted programs run on: never a serving thread, never a tokio
//! worker, never under a caller's lock. [`Sandbox::submit`] queues a closure and answers a
//! [`Pending`] (a `Future` on any executor, or [`Pending::wait`] blocking) that resolves with
//! exactly one of:
//!
//! - **the closure's result** — for a policy, its decision, or [`Error::Limit`] when the
//!   policy itself ran into one of its limits ([`crate::limits`]: instructions, value size,
//!   allocation, numbers);
//! - **[`Error::Limit`] ([`Exceeded::Time`])** — the evaluation ran past its time limit. The
//!   limit is counted from the moment an evaluator thread *picks the evaluation up*, never
//!   from the submission: time spent waiting behind other evaluations is not the policy's. A
//!   watchdog resolves it at that deadline even when the evaluation is stuck in one slow
//!   instruction;
//! - **[`Error::Busy`]** — the evaluation was *not run now*: no evaluator thread picked it up
//!   within [`MAX_QUEUE_WAIT`] (every thread busy with others' evaluations, or stuck), the
//!   queue was full ([`MAX_QUEUE`]), or no thread could be started. It says nothing about the
//!   policy; the caller retries later (the same job, the same request) and must not record it
//!   as the policy's refusal.
//!
//! So a caller tells the two apart with [`Error::is_policy_fault`] (the policy's own doing:
//! a limit, or an evaluation error) and [`Error::is_not_evaluated`] (try again later).
//!
//! A thread still busy past its evaluation's deadline is counted as stuck and replaced, up to
//! [`MAX_REPLACEMENTS`] extra threads; a stuck thread that finishes leaves if it is surplus.
//! A panic inside an evaluation is its error.

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
/// Each evaluator thread's stack. regorus's VM (and its compile-time fold) recurses once per
/// rule a rule calls, and a program may hold 4 000 rules: a chain of them overflows the 2 MiB
/// default (about 1 000 deep), which aborts the process. 256 MiB is address space, not memory:
/// pages are committed only as a chain that deep uses them.
pub const EVAL_STACK: usize = 256 << 20;
/// Evaluations waiting at most; one more is refused with [`Error::Busy`].
pub const MAX_QUEUE: usize = 1024;
/// How long an evaluation may wait for an evaluator thread; past it, it is answered
/// [`Error::Busy`] without running.
pub const MAX_QUEUE_WAIT: Duration = Duration::from_millis(500);
/// Threads started beyond [`THREADS`] to stand in for stuck ones, at most.
pub const MAX_REPLACEMENTS: usize = 4;
/// A busy thread past its evaluation's deadline is counted as stuck: its answer has been
/// refused by then, and the VM's own timer stops anything but one slow instruction within a few
/// microseconds of the deadline.
const STUCK_AFTER: Duration = Duration::ZERO;

/// A queued evaluation: run (`true`) or, its queue wait past, answered busy (`false`).
type Job = Box<dyn FnOnce(bool) + Send>;

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
    watch: Mutex<Vec<Weak<dyn Expire>>>,
    watch_changed: Condvar,
}

struct State {
    /// Each waiting evaluation: until when it may wait, and its time limit once started.
    queue: VecDeque<(Instant, Duration, Job)>,
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

    /// Run `f` on an evaluator thread, within `limit` from when a thread picks it up (past
    /// it: [`Error::Limit`] [`Exceeded::Time`]); not picked up within [`MAX_QUEUE_WAIT`], or
    /// the queue full: [`Error::Busy`], and `f` never runs.
    pub fn submit<T, F>(&self, limit: Duration, f: F) -> Pending<T>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, Error> + Send + 'static,
    {
        self.submit_with(limit, MAX_QUEUE_WAIT, f)
    }

    /// [`Sandbox::submit`] with its own bound on the wait for a thread.
    pub fn submit_with<T, F>(&self, limit: Duration, queue_wait: Duration, f: F) -> Pending<T>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, Error> + Send + 'static,
    {
        let queue_deadline = Instant::now() + queue_wait;
        let slot = Arc::new(Slot::new(limit, queue_deadline));
        let for_job = slot.clone();
        let watch = Arc::downgrade(&self.inner);
        let job: Job = Box::new(move |run| {
            // Answered already (its wait ran out while queued): nothing to do.
            if for_job.done() {
                return;
            }
            if !run || !for_job.start() {
                for_job.complete(Err(Error::Busy));
                return;
            }
            // Its deadline is now the time limit's: the watchdog must know before it next
            // sleeps. Told under the watch lock, so the news cannot fall between the
            // watchdog's reading of deadlines and its sleep.
            if let Some(inner) = watch.upgrade() {
                let _held = inner.watch.lock();
                inner.watch_changed.notify_one();
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
        state.queue.push_back((queue_deadline, limit, job));
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
            w.push(weak);
            // Under the lock, as the start's news is (see the job above).
            self.inner.watch_changed.notify_one();
        }
        Pending(slot)
    }

    /// Evaluator threads now (stuck ones included), and how many of them are busy: for tests
    /// and metrics.
    pub fn threads(&self) -> (usize, usize) {
        self.inner
            .state
            .lock()
            .map_or((0, 0), |s| (s.workers, s.busy.len()))
    }

    fn spawn_worker(&self, state: &mut State) {
        let id = state.next_id;
        state.next_id += 1;
        let inner = self.inner.clone();
        let started = std::thread::Builder::new()
            .name("cgx-policy-eval".into())
            .stack_size(EVAL_STACK)
            .spawn(move || worker(inner, id));
        if started.is_ok() {
            state.workers += 1;
        }
    }
}

fn worker(inner: Arc<Inner>, id: u64) {
    loop {
        let (job, run) = {
            let Ok(mut state) = inner.state.lock() else {
                return;
            };
            loop {
                if let Some((queue_deadline, limit, job)) = state.queue.pop_front() {
                    let now = Instant::now();
                    if now >= queue_deadline {
                        // Waited too long: answered busy, not run, and the thread stays free.
                        break (job, false);
                    }
                    state.busy.push((id, now + limit));
                    break (job, true);
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
        job(run);
        if run && let Ok(mut state) = inner.state.lock() {
            state.busy.retain(|(b, _)| *b != id);
        }
    }
}

/// Resolves every pending evaluation whose deadline has passed: its queue wait while queued
/// ([`Error::Busy`]), its time limit once running ([`Exceeded::Time`]).
fn watchdog(inner: Weak<Inner>) {
    loop {
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let Ok(mut watch) = inner.watch.lock() else {
            return;
        };
        let now = Instant::now();
        let mut next: Option<Instant> = None;
        watch.retain(|slot| {
            let Some(s) = slot.upgrade() else {
                return false;
            };
            match s.deadline() {
                None => false,
                Some(d) if d <= now => {
                    s.expire();
                    false
                }
                Some(d) => {
                    next = Some(next.map_or(d, |n| n.min(d)));
                    true
                }
            }
        });
        let wait = next.map_or(Duration::from_secs(1), |d| d.saturating_duration_since(now));
        let _ = inner.watch_changed.wait_timeout(watch, wait);
    }
}

trait Expire: Send + Sync {
    /// When it is next due: its queue deadline while queued, its time limit's end once
    /// running; `None` once answered.
    fn deadline(&self) -> Option<Instant>;
    /// Answer it for the deadline that passed.
    fn expire(&self);
}

/// Where an evaluation stands.
struct SlotState<T> {
    /// The answer, until taken.
    out: Option<Result<T, Error>>,
    /// The task awaiting it.
    waker: Option<Waker>,
    /// Whether an answer has been given (taken or not).
    answered: bool,
    /// When an evaluator thread picked it up.
    started: Option<Instant>,
}

struct Slot<T> {
    limit: Duration,
    queue_deadline: Instant,
    state: Mutex<SlotState<T>>,
    ready: Condvar,
}

impl<T> Slot<T> {
    fn new(limit: Duration, queue_deadline: Instant) -> Self {
        Slot {
            limit,
            queue_deadline,
            state: Mutex::new(SlotState {
                out: None,
                waker: None,
                answered: false,
                started: None,
            }),
            ready: Condvar::new(),
        }
    }

    /// Mark it picked up now; `false` if it was answered meanwhile.
    fn start(&self) -> bool {
        match self.state.lock() {
            Ok(mut s) if !s.answered => {
                s.started = Some(Instant::now());
                drop(s);
                // A blocked `wait` recomputes its deadline from the start.
                self.ready.notify_all();
                true
            }
            _ => false,
        }
    }

    fn done(&self) -> bool {
        self.state.lock().map_or(true, |s| s.answered)
    }

    /// The answer its current deadline gives: busy while queued, the time limit once running.
    fn overdue(&self, started: Option<Instant>) -> Error {
        match started {
            None => Error::Busy,
            Some(_) => Error::Limit(Exceeded::Time(self.limit)),
        }
    }

    /// The deadline of its current stage.
    fn due(&self, s: &SlotState<T>) -> Instant {
        s.started
            .map_or(self.queue_deadline, |started| started + self.limit)
    }

    /// The first answer wins: the evaluation's, or the watchdog's.
    fn complete(&self, out: Result<T, Error>) {
        let waker = match self.state.lock() {
            Ok(mut s) if !s.answered => {
                s.out = Some(out);
                s.answered = true;
                s.waker.take()
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
    fn deadline(&self) -> Option<Instant> {
        let s = self.state.lock().ok()?;
        (!s.answered).then(|| self.due(&s))
    }

    fn expire(&self) {
        let started = self.state.lock().ok().and_then(|s| s.started);
        self.complete(Err(self.overdue(started)));
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
    /// Block the calling (non-async) thread for the answer; never longer than the queue wait
    /// and the time limit (and a little slack for the watchdog).
    pub fn wait(self) -> Result<T, Error> {
        let slack = Duration::from_millis(100);
        let Ok(mut s) = self.0.state.lock() else {
            return Err(Error::Busy);
        };
        loop {
            if let Some(out) = s.out.take() {
                return out;
            }
            if s.answered {
                return Err(Error::Policy {
                    detail: "evaluation already answered".into(),
                });
            }
            let now = Instant::now();
            let give_up = self.0.due(&s) + slack;
            if now >= give_up {
                return Err(self.0.overdue(s.started));
            }
            s = match self.0.ready.wait_timeout(s, give_up - now) {
                Ok((s, _)) => s,
                Err(_) => return Err(Error::Busy),
            };
        }
    }
}

impl<T> Future for Pending<T> {
    type Output = Result<T, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Ok(mut s) = self.0.state.lock() else {
            return Poll::Ready(Err(Error::Busy));
        };
        if let Some(out) = s.out.take() {
            return Poll::Ready(out);
        }
        if s.answered {
            // Taken by an earlier poll: a finished future polled again.
            return Poll::Ready(Err(Error::Policy {
                detail: "evaluation already answered".into(),
            }));
        }
        s.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl Error {
    /// The policy itself is at fault: it ran into one of its limits ([`Error::Limit`]) or
    /// failed to evaluate ([`Error::Policy`]). This is the job's or the resource's refusal,
    /// with this reason; retrying the same policy on the same input gives the same answer.
    pub fn is_policy_fault(&self) -> bool {
        matches!(self, Error::Limit(_) | Error::Policy { .. })
    }

    /// The evaluation did not run now ([`Error::Busy`]: no evaluator thread free within
    /// [`MAX_QUEUE_WAIT`], the queue full, or no thread to start). Says nothing about the
    /// policy: retry later, and never record it as the policy's refusal.
    pub fn is_not_evaluated(&self) -> bool {
        matches!(self, Error::Busy)
    }
}
