//! The node's protocol logic as a state machine, without I/O: what the guest agent does next
//! (register, heartbeat, start or stop a lease's workload, send a report, wait, exit) and
//! what each outcome changes. The daemon (`daemon.rs`) performs the steps and feeds the
//! outcomes back; tests drive this directly, on a clock of their own.
//!
//! ```text
//!  unregistered ──Register ok──► registered ──Heartbeat every heartbeat_secs──► …
//!       ▲  │ refused: back off (0.5 s doubling to 30 s)     │ answer: leases to start/stop,
//!       │  ▼                                                │ re-attest asked → Register
//!       └── broker forgot the node (404) or refused its heartbeat (401)
//!
//!  lease: (new in an answer) Starting ──started──► Running ──exited 0──► Done  (report completed)
//!                               │ setup failed ─────────────┴─exited ≠ 0─► Done  (report failed)
//!                               └─ gone from a placeable node's answer, its token lapsed
//!                                  unrenewed, or SIGTERM ─► Stopping ─► Done (no report)
//! ```
//! A lease the broker stops renewing is stopped, not reported: its job already moved. A lease
//! whose last token lapsed (on this clock) without a renewal is stopped too: a node cut off
//! from its broker does not go on serving a job the broker has moved. Reports are sent in
//! order and retried (each freshly signed) until the broker takes them or says it never will;
//! on terminate they get a few seconds to go out.

use std::collections::{BTreeMap, VecDeque};

use cgx_protocol::broker::{HeartbeatAnswer, LeaseGrant, Registered};
use cgx_protocol::records::{WorkloadReport, WorkloadState};

/// Milliseconds on the driver's monotonic clock.
pub type Millis = u64;

/// First retry delay after a failed registration, heartbeat or report.
pub const RETRY_MIN_MS: Millis = 500;
/// Retry delays double up to this.
pub const RETRY_MAX_MS: Millis = 30_000;
/// After a terminate, reports still queued get this long to go out.
/// (A report already in flight may take up to the HTTP client's timeout.)
pub const FLUSH_MS: Millis = 3_000;

/// What to do next.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Get a nonce, collect evidence and register (or re-attest).
    Register,
    /// Send a signed heartbeat.
    Heartbeat,
    /// Set up this lease's workload: fetch its weights through the lease, start its process.
    Start(LeaseGrant),
    /// Stop this lease's workload (the lease is over, or the agent stops).
    Stop(String),
    /// Send this report (signed now).
    Report(WorkloadReport),
    /// Nothing is due for this long (the driver also wakes for its own events).
    Wait(Millis),
    /// Every workload is stopped after a terminate: exit.
    Exit,
}

/// Why a heartbeat got no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeartbeatError {
    /// The broker does not know this node (404): register again.
    UnknownNode,
    /// The broker refused the heartbeat (401): register again.
    Refused(String),
    /// No answer (transport, 5xx): try again at the next beat.
    Unreachable(String),
}

/// Why a report was not taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReportError {
    /// The broker will never take it (the lease or job is not this node's any more): dropped.
    Gone(String),
    /// The broker does not know this node: register, then send it again.
    UnknownNode,
    /// No answer: try again later.
    Unreachable(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Starting,
    Running,
    Stopping,
    Done,
}

#[derive(Debug)]
struct Lease {
    grant: LeaseGrant,
    phase: Phase,
    /// Its newest token lapses then (this clock).
    valid_until: Millis,
    /// This node ended it on its own (its token lapsed): the broker is told, if it still
    /// carries the lease.
    lapsed: bool,
}

/// The node's state.
#[derive(Debug)]
pub struct Node {
    id: String,
    registered: bool,
    register_at: Millis,
    register_backoff: Millis,
    heartbeat_every: Millis,
    heartbeat_at: Millis,
    leases: BTreeMap<String, Lease>,
    to_start: VecDeque<String>,
    to_stop: VecDeque<String>,
    reports: VecDeque<WorkloadReport>,
    report_at: Millis,
    report_backoff: Millis,
    terminating: bool,
    exit_by: Millis,
}

fn backoff(b: &mut Millis) -> Millis {
    let now = *b;
    *b = (*b * 2).min(RETRY_MAX_MS);
    now
}

impl Node {
    /// A node with id `id` (`cgx_protocol::broker::node_id` of its key), to register at once.
    pub fn new(id: &str, now: Millis) -> Node {
        Node {
            id: id.to_string(),
            registered: false,
            register_at: now,
            register_backoff: RETRY_MIN_MS,
            heartbeat_every: 5_000,
            heartbeat_at: now,
            leases: BTreeMap::new(),
            to_start: VecDeque::new(),
            to_stop: VecDeque::new(),
            reports: VecDeque::new(),
            report_at: now,
            report_backoff: RETRY_MIN_MS,
            terminating: false,
            exit_by: 0,
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn is_registered(&self) -> bool {
        self.registered
    }

    /// Leases whose workload is starting or running.
    pub fn live_leases(&self) -> Vec<&LeaseGrant> {
        self.leases
            .values()
            .filter(|l| matches!(l.phase, Phase::Starting | Phase::Running))
            .map(|l| &l.grant)
            .collect()
    }

    /// The next step at `now`.
    pub fn next(&mut self, now: Millis) -> Step {
        let mut lapsed = Vec::new();
        for (id, l) in &mut self.leases {
            if matches!(l.phase, Phase::Starting | Phase::Running) && now >= l.valid_until {
                l.phase = Phase::Stopping;
                l.lapsed = true;
                self.to_start.retain(|s| s != id);
                self.to_stop.push_back(id.clone());
                lapsed.push(id.clone());
            }
        }
        // Said to the broker (sent when it can be reached): the job is not running here.
        for id in lapsed {
            self.report(
                &id,
                WorkloadState::Failed,
                None,
                "stopped on the node: its lease token lapsed without renewal",
            );
        }
        if let Some(id) = self.to_stop.pop_front() {
            return Step::Stop(id);
        }
        if self.terminating {
            if self.leases.values().any(|l| l.phase != Phase::Done) {
                return Step::Wait(50);
            }
            if self.reports.is_empty() || now >= self.exit_by {
                return Step::Exit;
            }
            if let Some(r) = self.reports.front()
                && now >= self.report_at
            {
                return Step::Report(r.clone());
            }
            return Step::Wait(self.report_at.min(self.exit_by).saturating_sub(now).max(1));
        }
        if !self.registered && now >= self.register_at {
            return Step::Register;
        }
        if let Some(id) = self.to_start.pop_front()
            && let Some(l) = self.leases.get(&id)
        {
            return Step::Start(l.grant.clone());
        }
        if let Some(r) = self.reports.front()
            && now >= self.report_at
        {
            return Step::Report(r.clone());
        }
        if self.registered && now >= self.heartbeat_at {
            return Step::Heartbeat;
        }
        let mut due = if self.registered {
            self.heartbeat_at
        } else {
            self.register_at
        };
        if !self.reports.is_empty() {
            due = due.min(self.report_at);
        }
        Step::Wait(due.saturating_sub(now).max(1))
    }

    /// Registered (or re-attested): heartbeat at once, then every `heartbeat_secs`.
    pub fn registered(&mut self, now: Millis, r: &Registered) {
        self.registered = true;
        self.register_backoff = RETRY_MIN_MS;
        self.heartbeat_every = r.heartbeat_secs.clamp(1, 60) * 1_000;
        self.heartbeat_at = now;
    }

    /// The registration failed: try again after a back-off.
    pub fn register_failed(&mut self, now: Millis) {
        self.register_at = now + backoff(&mut self.register_backoff);
    }

    /// A heartbeat's answer: re-attest if asked; start the leases it brings that are new;
    /// stop those it no longer brings — when it speaks for a placeable node (an unplaceable
    /// node's answer carries no leases, and re-attesting may make it placeable again).
    /// `now_unix`: the wall clock (seconds), to read the grants' expiry against.
    pub fn heartbeat_answered(&mut self, now: Millis, now_unix: i64, a: &HeartbeatAnswer) {
        self.heartbeat_at = now + self.heartbeat_every;
        if a.reattest {
            self.registered = false;
            self.register_at = now;
        }
        if a.unplaceable.is_some() {
            return;
        }
        for g in &a.leases {
            let lasts = u64::try_from(g.expires_at.saturating_sub(now_unix)).unwrap_or(0);
            let valid_until = now.saturating_add(lasts.saturating_mul(1_000));
            let mut ended_here = false;
            match self.leases.get_mut(&g.lease_id) {
                Some(l) => {
                    l.grant = g.clone();
                    l.valid_until = l.valid_until.max(valid_until);
                    // A lease this node ended on its own, carried again: the broker has not
                    // heard (its report was lost or refused): say it again, once.
                    if l.phase == Phase::Done && l.lapsed {
                        l.lapsed = false;
                        ended_here = true;
                    }
                }
                None => {
                    self.leases.insert(
                        g.lease_id.clone(),
                        Lease {
                            grant: g.clone(),
                            phase: Phase::Starting,
                            valid_until,
                            lapsed: false,
                        },
                    );
                    self.to_start.push_back(g.lease_id.clone());
                }
            }
            if ended_here {
                self.report(
                    &g.lease_id,
                    WorkloadState::Failed,
                    None,
                    "not running on the node: it stopped the lease when its token lapsed",
                );
            }
        }
        let gone: Vec<String> = self
            .leases
            .keys()
            .filter(|id| !a.leases.iter().any(|g| &g.lease_id == *id))
            .cloned()
            .collect();
        for id in gone {
            if let Some(l) = self.leases.get_mut(&id) {
                match l.phase {
                    Phase::Starting | Phase::Running => {
                        l.phase = Phase::Stopping;
                        self.to_start.retain(|s| s != &id);
                        self.to_stop.push_back(id);
                    }
                    Phase::Done => {
                        self.leases.remove(&id);
                    }
                    Phase::Stopping => {}
                }
            }
        }
    }

    /// A heartbeat went unanswered.
    pub fn heartbeat_failed(&mut self, now: Millis, e: &HeartbeatError) {
        match e {
            HeartbeatError::UnknownNode | HeartbeatError::Refused(_) => {
                self.registered = false;
                self.register_at = now;
            }
            HeartbeatError::Unreachable(_) => {
                self.heartbeat_at = now + self.heartbeat_every.min(RETRY_MAX_MS);
            }
        }
    }

    fn report(&mut self, lease: &str, state: WorkloadState, exit_code: Option<i32>, why: &str) {
        let Some(l) = self.leases.get(lease) else {
            return;
        };
        let mut reason = why.to_string();
        if reason.len() > WorkloadReport::MAX_REASON {
            let mut cut = WorkloadReport::MAX_REASON;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason.truncate(cut);
        }
        self.reports.push_back(WorkloadReport {
            sub: self.id.clone(),
            lease: l.grant.lease_id.clone(),
            job: l.grant.job_id.clone(),
            state,
            exit_code,
            reason,
        });
    }

    /// The lease's workload started (or, for a lease without one, the lease is held).
    pub fn workload_started(&mut self, lease: &str, what: &str) {
        if let Some(l) = self.leases.get_mut(lease)
            && l.phase == Phase::Starting
        {
            l.phase = Phase::Running;
            self.report(lease, WorkloadState::Running, None, what);
        }
    }

    /// The lease's workload could not start: reported failed with `why`.
    pub fn workload_failed(&mut self, lease: &str, why: &str) {
        self.workload_ended(lease, None, why);
    }

    /// The lease's workload ended: exit status `code` (`None`: killed by a signal, or it never
    /// started). Reported unless this agent stopped it.
    pub fn workload_ended(&mut self, lease: &str, code: Option<i32>, why: &str) {
        let Some(l) = self.leases.get_mut(lease) else {
            return;
        };
        let was = l.phase;
        l.phase = Phase::Done;
        if was == Phase::Stopping || was == Phase::Done {
            return;
        }
        let state = if code == Some(0) {
            WorkloadState::Completed
        } else {
            WorkloadState::Failed
        };
        self.report(lease, state, code, why);
    }

    /// The front report was taken.
    pub fn report_sent(&mut self) {
        self.reports.pop_front();
        self.report_backoff = RETRY_MIN_MS;
    }

    /// The front report was not taken.
    pub fn report_failed(&mut self, now: Millis, e: &ReportError) {
        match e {
            ReportError::Gone(_) => {
                self.reports.pop_front();
            }
            ReportError::UnknownNode => {
                self.registered = false;
                self.register_at = now;
                self.report_at = now + backoff(&mut self.report_backoff);
            }
            ReportError::Unreachable(_) => {
                self.report_at = now + backoff(&mut self.report_backoff);
            }
        }
    }

    /// Stop: every workload is stopped (not reported: the broker moves their jobs when the
    /// node falls silent), reports still queued get [`FLUSH_MS`] to go out, then
    /// [`Step::Exit`].
    pub fn terminate(&mut self, now: Millis) {
        self.terminating = true;
        self.exit_by = now.saturating_add(FLUSH_MS);
        self.to_start.clear();
        for (id, l) in &mut self.leases {
            if matches!(l.phase, Phase::Starting | Phase::Running) {
                l.phase = Phase::Stopping;
                self.to_stop.push_back(id.clone());
            }
        }
    }

    /// A stopped workload is gone (its process reaped, its plaintext removed).
    pub fn stopped(&mut self, lease: &str) {
        if let Some(l) = self.leases.get_mut(lease) {
            l.phase = Phase::Done;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use cgx_protocol::records::Tier;

    fn registered() -> Registered {
        Registered {
            node_id: "n1".into(),
            status: Tier::Affirming,
            ear: String::new(),
            violations: vec![],
            attested_at: 0,
            fresh_until: 600,
            heartbeat_secs: 5,
        }
    }

    fn grant(id: &str) -> LeaseGrant {
        LeaseGrant {
            start: 0,
            window_secs: 0,
            lease_id: id.into(),
            job_id: format!("j-{id}"),
            gpus: vec![0],
            resources: vec![],
            token: "t".into(),
            expires_at: 100,
            workload: None,
        }
    }

    fn answer(leases: &[&str]) -> HeartbeatAnswer {
        HeartbeatAnswer {
            challenges: Vec::new(),
            reattest: false,
            unplaceable: None,
            leases: leases.iter().map(|l| grant(l)).collect(),
        }
    }

    #[test]
    fn registers_backs_off_then_heartbeats_on_its_interval() {
        let mut n = Node::new("n1", 0);
        assert_eq!(n.next(0), Step::Register);
        n.register_failed(0);
        assert_eq!(n.next(0), Step::Wait(500));
        assert_eq!(n.next(500), Step::Register);
        n.register_failed(500);
        assert_eq!(n.next(500), Step::Wait(1_000), "doubled");
        assert_eq!(n.next(1_500), Step::Register);
        n.registered(1_500, &registered());
        assert_eq!(n.next(1_500), Step::Heartbeat, "at once, to learn leases");
        n.heartbeat_answered(1_500, 0, &answer(&[]));
        assert_eq!(n.next(1_500), Step::Wait(5_000));
        assert_eq!(n.next(6_500), Step::Heartbeat);
    }

    #[test]
    fn a_lease_runs_is_reported_and_completes() {
        let mut n = Node::new("n1", 0);
        n.registered(0, &registered());
        n.heartbeat_answered(0, 0, &answer(&["l1"]));
        assert_eq!(n.next(0), Step::Start(grant("l1")));
        // Renewed in the next answer: not started twice.
        n.heartbeat_answered(5_000, 0, &answer(&["l1"]));
        n.workload_started("l1", "started /bin/serve");
        let Step::Report(r) = n.next(5_000) else {
            panic!("a report is due")
        };
        assert_eq!(
            (r.sub.as_str(), r.lease.as_str(), r.job.as_str(), r.state),
            ("n1", "l1", "j-l1", WorkloadState::Running)
        );
        n.report_sent();
        n.workload_ended("l1", Some(0), "exited with status 0");
        let Step::Report(r) = n.next(5_001) else {
            panic!("a report is due")
        };
        assert_eq!((r.state, r.exit_code), (WorkloadState::Completed, Some(0)));
        // Unreachable: retried after a back-off, the same report.
        n.report_failed(5_001, &ReportError::Unreachable("down".into()));
        assert_eq!(n.next(5_001), Step::Wait(500));
        assert!(matches!(n.next(5_501), Step::Report(ref again) if *again == r));
        n.report_sent();
        // The lease leaves the answers: forgotten, nothing to stop.
        n.heartbeat_answered(10_000, 0, &answer(&[]));
        assert!(n.live_leases().is_empty());
        assert_eq!(n.next(10_000), Step::Wait(5_000));
    }

    #[test]
    fn failures_are_reported_with_their_reason_and_stops_are_not() {
        let mut n = Node::new("n1", 0);
        n.registered(0, &registered());
        n.heartbeat_answered(0, 0, &answer(&["l1", "l2", "l3"]));
        for _ in 0..3 {
            assert!(matches!(n.next(0), Step::Start(_)));
        }
        n.workload_failed("l1", "weights digest mismatch");
        n.workload_started("l2", "started");
        n.workload_started("l3", "started");
        n.workload_ended("l2", Some(3), "exited with status 3");
        // l3 is cancelled: stopped, and its end is not reported.
        n.heartbeat_answered(5_000, 0, &answer(&["l2"]));
        assert_eq!(n.next(5_000), Step::Stop("l3".into()));
        n.workload_ended("l3", None, "killed");
        let mut got = Vec::new();
        while let Step::Report(r) = n.next(5_000) {
            got.push((r.lease.clone(), r.state, r.exit_code, r.reason.clone()));
            n.report_sent();
        }
        assert_eq!(
            got,
            [
                (
                    "l1".into(),
                    WorkloadState::Failed,
                    None,
                    "weights digest mismatch".into()
                ),
                ("l2".into(), WorkloadState::Running, None, "started".into()),
                ("l3".into(), WorkloadState::Running, None, "started".into()),
                (
                    "l2".into(),
                    WorkloadState::Failed,
                    Some(3),
                    "exited with status 3".into()
                ),
            ]
        );
        // A report the broker will never take is dropped; one it could not take now stays.
        let mut m = Node::new("n1", 0);
        m.registered(0, &registered());
        m.heartbeat_answered(0, 0, &answer(&["l1"]));
        let _ = m.next(0);
        m.workload_started("l1", "started");
        m.report_failed(0, &ReportError::Unreachable("429".into()));
        assert!(matches!(m.next(500), Step::Report(_)));
        m.report_failed(500, &ReportError::Gone("409".into()));
        assert!(!matches!(m.next(60_000), Step::Report(_)));
    }

    /// A lease whose token lapses unrenewed (the broker is unreachable, or no longer renews
    /// it) is stopped on this clock, and not reported.
    #[test]
    fn a_lease_not_renewed_before_its_token_lapses_is_stopped() {
        let mut n = Node::new("n1", 0);
        n.registered(0, &registered());
        // Granted at unix 1000, lapsing at 1100: 100 s on this clock.
        n.heartbeat_answered(0, 1_000, &{
            let mut a = answer(&["l1"]);
            a.leases[0].expires_at = 1_100;
            a
        });
        let _ = n.next(0);
        n.workload_started("l1", "started");
        n.report_sent();
        for t in (5_000..100_000).step_by(5_000) {
            n.heartbeat_failed(t, &HeartbeatError::Unreachable("down".into()));
            assert!(!matches!(n.next(t), Step::Stop(_)), "at {t}");
        }
        assert_eq!(n.next(100_000), Step::Stop("l1".into()));
        n.workload_ended("l1", None, "killed");
        // The broker hears that the job is not running here, once it can be reached.
        let Step::Report(r) = n.next(100_001) else {
            panic!("the lapse is reported")
        };
        assert_eq!(r.state, WorkloadState::Failed);
        assert!(r.reason.contains("lapsed"), "{}", r.reason);
        n.report_failed(100_001, &ReportError::Gone("409: moved".into()));
        // If the broker carries the lease again, it is told once more, and nothing restarts.
        n.heartbeat_answered(200_000, 2_000, &{
            let mut a = answer(&["l1"]);
            a.leases[0].expires_at = 2_100;
            a
        });
        let Step::Report(r) = n.next(200_000) else {
            panic!("a renewed lease this node ended is reported")
        };
        assert_eq!(r.state, WorkloadState::Failed);
        n.report_sent();
        n.heartbeat_answered(205_000, 2_005, &answer(&["l1"]));
        assert!(!matches!(n.next(205_000), Step::Report(_) | Step::Start(_)));
    }

    /// On terminate, queued reports get a few seconds to go out, then the agent exits.
    #[test]
    fn terminate_flushes_reports_within_a_deadline() {
        let mut n = Node::new("n1", 0);
        n.registered(0, &registered());
        n.heartbeat_answered(0, 0, &answer(&["l1"]));
        let _ = n.next(0);
        n.workload_started("l1", "started");
        n.workload_ended("l1", Some(0), "exited with status 0");
        n.terminate(1_000);
        assert!(matches!(n.next(1_000), Step::Report(_)));
        n.report_failed(1_000, &ReportError::Unreachable("down".into()));
        assert_eq!(n.next(1_000), Step::Wait(500));
        assert!(matches!(n.next(1_500), Step::Report(_)));
        n.report_failed(1_500, &ReportError::Unreachable("down".into()));
        assert_eq!(n.next(FLUSH_MS + 1_000), Step::Exit, "the deadline passed");
    }

    #[test]
    fn a_forgetful_broker_or_a_reattest_ask_registers_again_keeping_the_workloads() {
        let mut n = Node::new("n1", 0);
        n.registered(0, &registered());
        n.heartbeat_answered(0, 0, &answer(&["l1"]));
        let _ = n.next(0);
        n.workload_started("l1", "started");
        n.report_sent();
        n.heartbeat_failed(5_000, &HeartbeatError::UnknownNode);
        assert_eq!(n.next(5_000), Step::Register);
        n.registered(5_100, &registered());
        // Unplaceable for now: the answer brings no leases, and nothing is stopped.
        n.heartbeat_answered(
            5_100,
            0,
            &HeartbeatAnswer {
                challenges: Vec::new(),
                reattest: true,
                unplaceable: Some("attestation lapsed".into()),
                leases: vec![],
            },
        );
        assert_eq!(n.live_leases().len(), 1);
        assert_eq!(n.next(5_100), Step::Register);
        // A broker that is down is retried at the next beat, registration kept.
        n.registered(5_200, &registered());
        n.heartbeat_failed(5_200, &HeartbeatError::Unreachable("refused".into()));
        assert!(n.is_registered());
        assert_eq!(n.next(5_200), Step::Wait(5_000));
    }

    #[test]
    fn terminate_stops_every_workload_then_exits() {
        let mut n = Node::new("n1", 0);
        n.registered(0, &registered());
        n.heartbeat_answered(0, 0, &answer(&["l1", "l2"]));
        let _ = n.next(0);
        n.workload_started("l1", "started");
        n.terminate(0);
        assert_eq!(n.next(0), Step::Stop("l1".into()));
        assert_eq!(n.next(0), Step::Stop("l2".into()));
        assert_eq!(n.next(0), Step::Wait(50));
        n.stopped("l1");
        n.workload_ended("l2", None, "killed");
        // l1's start was not reported yet: it goes out first (l2's kill is not reported).
        assert!(matches!(n.next(0), Step::Report(r) if r.lease == "l1"));
        n.report_sent();
        assert_eq!(n.next(0), Step::Exit);
        assert!(!matches!(n.next(0), Step::Heartbeat | Step::Register));
    }
}
