//! Where answered challenges and attested sessions live.
//!
//! A challenge is answered once, and an attested session is found again by its id. Two
//! places can hold that ([`SessionMode`]):
//!
//! - **`database`** (PostgreSQL's only mode, SQLite's opt-in). One INSERT keyed by the MAC'd
//!   id records each answer, so any replica on the database serves any step, and a second
//!   answer is refused on every replica. The table here is then a cache of the sessions this
//!   replica attested; another replica's are read from the database and re-verified.
//! - **`memory`** (the default with SQLite). The table here is the record: a commit per
//!   attestation was the largest removable cost of a CoCo flow on SQLite (5–10% of the
//!   KBS's CPU per flow with the stock client, `cgx bench coco`). Ids are MAC'd with a key drawn at start
//!   ([`super::session::SessionKeys::ephemeral`]), so this process answers only challenges it
//!   issued in this run. A challenge from another process, or from before a restart, fails its
//!   MAC and cannot be answered twice anywhere. Sessions end with the process; CoCo clients
//!   attest again on the 401.
//!
//! In memory an answer is kept a session lifetime past its challenge's expiry (as a row is:
//! a clock stepped back still finds it), and nothing is evicted before then: forgetting an
//! answer early would let its challenge be answered again. An answer recorded after its
//! challenge expired (an attestation that waited on collateral) is refused, so an answer can
//! only have been dropped once its challenge no longer opens, and an id below the highest cut
//! ever swept is refused whatever the clock says. At [`Sessions::capacity`] affirming
//! sessions, none droppable, attestation is refused with 503. Sessions whose appraisal is not
//! affirming, and failed answers, are counted apart under caps of their own, so neither can
//! lock affirming ones out; where the failed answers' cap is full a failure is not recorded
//! (a new challenge costs nothing, so a failed one being answered again gains nothing).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};

use super::LiveSession;
pub use super::config::SessionMode;
use super::session::id_time_prefix;

/// Answered challenges, by session id, in three kinds each under its own cap: affirming
/// sessions (the ones release serves), other attested sessions (a genuine TEE whose appraisal
/// is not affirming gets a session, so release can say why it refuses, but cannot crowd the
/// affirming ones out), and failed answers. Ids lead with their challenge's expiry,
/// zero-padded (`session.rs`), so all three are in time order and a sweep cuts the expired
/// answers off at one key.
#[derive(Debug, Default)]
struct Table {
    affirming: BTreeMap<String, Arc<LiveSession>>,
    other: BTreeMap<String, Arc<LiveSession>>,
    failed: BTreeSet<String>,
    /// The highest cut swept at: ids below it are never taken again, whatever the clock does
    /// afterwards (a clock stepped back would otherwise reopen a swept challenge).
    cut: String,
}

/// What a sweep took out, dropped once the lock is released.
type Swept = (
    BTreeMap<String, Arc<LiveSession>>,
    BTreeMap<String, Arc<LiveSession>>,
    BTreeSet<String>,
);

impl Table {
    /// Take out the answers to challenges that expired `hold` or more before `now`.
    fn sweep(&mut self, now: i64, hold: i64) -> Swept {
        let cut = id_time_prefix(now.saturating_sub(hold).saturating_add(1));
        if cut > self.cut {
            self.cut = cut;
        }
        let cut = self.cut.as_str();
        let keep = (
            self.affirming.split_off(cut),
            self.other.split_off(cut),
            self.failed.split_off(cut),
        );
        (
            std::mem::replace(&mut self.affirming, keep.0),
            std::mem::replace(&mut self.other, keep.1),
            std::mem::replace(&mut self.failed, keep.2),
        )
    }

    fn holds(&self, id: &str) -> bool {
        self.affirming.contains_key(id) || self.other.contains_key(id) || self.failed.contains(id)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.affirming.len() + self.other.len() + self.failed.len()
    }
}

/// Answered challenges and attested sessions held by this process.
#[derive(Debug)]
pub(crate) struct Sessions {
    mode: SessionMode,
    capacity: usize,
    /// How long past its challenge's expiry an answer is kept (the session lifetime).
    hold: i64,
    table: Mutex<Table>,
}

/// Why an answer was not recorded in memory.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The challenge was answered before.
    Replayed,
    /// The challenge expired before its answer was recorded.
    Expired,
    /// The table holds `capacity` answers of that kind, none droppable.
    Full,
}

impl Sessions {
    /// `hold`: the session lifetime, how long past its challenge's expiry an answer is kept.
    pub(crate) fn new(mode: SessionMode, capacity: usize, hold: i64) -> Self {
        Sessions {
            mode,
            capacity,
            hold,
            table: Mutex::new(Table::default()),
        }
    }

    pub(crate) fn mode(&self) -> SessionMode {
        self.mode
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the challenge `id` has an answer here (`memory` mode: a replay, refused before
    /// its evidence costs an appraisal).
    pub(crate) fn answered(&self, id: &str) -> bool {
        let t = self.lock();
        t.holds(id) || id < t.cut.as_str()
    }

    /// `memory` mode: record the answer to challenge `id` (expiring at `challenge_expires`),
    /// with its session when it attested (`session.expires_at` at most `challenge_expires` +
    /// the session lifetime).
    pub(crate) fn answer(
        &self,
        id: &str,
        challenge_expires: i64,
        session: Option<Arc<LiveSession>>,
        now: i64,
    ) -> Result<(), Refused> {
        // (An id that does not lead with its challenge's expiry could not be kept in time
        // order; the MAC'd ids `session.rs` issues always do.)
        if now >= challenge_expires || !id.starts_with(&id_time_prefix(challenge_expires)) {
            return Err(Refused::Expired);
        }
        // The kind's own cap applies (`Table`).
        let affirming = session
            .as_ref()
            .map(|s| s.ear.tier() == cgx_attestation::results::Tier::Affirming);
        let held = |t: &Table| match affirming {
            Some(true) => t.affirming.len(),
            Some(false) => t.other.len(),
            None => t.failed.len(),
        };
        // Declared before the guard, so what a sweep took out is dropped after the unlock.
        let mut _swept = None;
        let mut t = self.lock();
        if id < t.cut.as_str() {
            return Err(Refused::Expired);
        }
        if t.holds(id) {
            return Err(Refused::Replayed);
        }
        if held(&t) >= self.capacity {
            _swept = Some(t.sweep(now, self.hold));
            if held(&t) >= self.capacity {
                return Err(Refused::Full);
            }
        }
        let id = id.to_string();
        match (session, affirming) {
            (Some(s), Some(true)) => {
                t.affirming.insert(id, s);
            }
            (Some(s), _) => {
                t.other.insert(id, s);
            }
            (None, _) => {
                t.failed.insert(id);
            }
        }
        Ok(())
    }

    /// `database` mode: cache a session this replica attested (its answer is in the database,
    /// so the cache may forget it at any time).
    pub(crate) fn remember(&self, id: &str, session: Arc<LiveSession>, now: i64) {
        // Declared before the guard, so what a sweep took out is dropped after the unlock.
        let mut _swept = None;
        let mut t = self.lock();
        if t.affirming.len() >= self.capacity {
            _swept = Some(t.sweep(now, self.hold));
            if t.affirming.len() >= self.capacity {
                t.affirming.clear();
            }
        }
        t.affirming.insert(id.to_string(), session);
    }

    /// The attested session held for `id` (unexpired or not: the caller checks).
    pub(crate) fn get(&self, id: &str) -> Option<Arc<LiveSession>> {
        let t = self.lock();
        t.affirming.get(id).or_else(|| t.other.get(id)).cloned()
    }

    /// Drop what is no longer needed at `now`; returns how many entries went.
    pub(crate) fn prune(&self, now: i64) -> usize {
        let swept = self.lock().sweep(now, self.hold);
        swept.0.len() + swept.1.len() + swept.2.len()
    }

    /// How many answers are held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }

    /// The most answers of each kind held at once.
    pub(crate) fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn session(expires_at: i64, status: &str) -> Arc<LiveSession> {
        let key: cgx_protocol::kbs_types::TeePubKey = serde_json::from_value(serde_json::json!({
            "kty": "EC", "crv": "P-256", "alg": "ECDH-ES+A256KW",
            "x": "YIhTO_G2VHPBFXqIJR1Z28NXwmHUsRX3hCrdVmFeHA0",
            "y": "r9BI1qGdZbC6hVrY8ItVSElgi9WscsauyQRNcLUbkyw"
        }))
        .unwrap();
        Arc::new(LiveSession {
            expires_at,
            tee_pubkey: key,
            ear: serde_json::from_value(serde_json::json!({
                "eat_profile": "tag:ietf.org,2026:rats/ear#04",
                "iat": 0,
                "ear_verifier_id": {"developer": "cgx", "build": "test"},
                "submods": {},
                "ear_status": status,
            }))
            .unwrap(),
        })
    }

    fn live(expires_at: i64) -> Arc<LiveSession> {
        session(expires_at, "affirming")
    }

    /// An id as `session.rs` makes them: its challenge's expiry first.
    fn id(expires: i64, n: &str) -> String {
        format!("{}.{n}.snp.mac", id_time_prefix(expires))
    }

    #[test]
    fn a_challenge_is_answered_once_and_failed_answers_count() {
        let s = Sessions::new(SessionMode::Memory, 10, 300);
        let (a, b) = (id(100, "a"), id(50, "b"));
        assert_eq!(s.answer(&a, 100, Some(live(400)), 0), Ok(()));
        assert_eq!(
            s.answer(&a, 100, Some(live(400)), 0),
            Err(Refused::Replayed)
        );
        assert_eq!(s.answer(&a, 100, None, 0), Err(Refused::Replayed));
        assert!(s.get(&a).is_some());
        // A failed answer uses the challenge up too, and holds no session.
        assert_eq!(s.answer(&b, 50, None, 0), Ok(()));
        assert_eq!(s.answer(&b, 50, Some(live(100)), 0), Err(Refused::Replayed));
        assert!(s.get(&b).is_none());
        // Both are kept a session lifetime past their challenge (a clock stepped back still
        // finds them), then go.
        assert_eq!(s.prune(349), 0);
        assert_eq!(s.prune(350), 1);
        assert!(s.get(&a).is_some());
        assert_eq!(s.prune(399), 0);
        assert_eq!(s.prune(400), 1);
        assert_eq!(s.len(), 0);
    }

    #[test]
    fn an_answer_is_kept_past_its_challenge_even_when_its_session_ends_first() {
        let s = Sessions::new(SessionMode::Memory, 10, 300);
        let a = id(100, "a");
        // The EAR ended at 20; the challenge is open until 100.
        s.answer(&a, 100, Some(live(20)), 0).unwrap();
        assert_eq!(s.prune(99), 0);
        assert_eq!(
            s.answer(&a, 100, Some(live(400)), 99),
            Err(Refused::Replayed)
        );
    }

    #[test]
    fn an_answer_recorded_after_its_challenge_expired_is_refused() {
        let s = Sessions::new(SessionMode::Memory, 10, 300);
        let a = id(100, "a");
        // A first answer, failed, swept once everything about it is over...
        s.answer(&a, 100, None, 10).unwrap();
        assert_eq!(s.prune(400), 1);
        // ...and a second one that waited on collateral until then: refused all the same.
        assert_eq!(
            s.answer(&a, 100, Some(live(400)), 400),
            Err(Refused::Expired)
        );
        assert_eq!(
            s.answer(&id(100, "b"), 100, Some(live(400)), 100),
            Err(Refused::Expired)
        );
        assert!(s.get(&a).is_none());
        // An id that does not lead with its challenge's expiry is not kept.
        assert_eq!(
            s.answer(&id(900, "c"), 100, None, 10),
            Err(Refused::Expired)
        );
    }

    #[test]
    fn a_full_table_refuses_rather_than_forget_a_live_answer() {
        let s = Sessions::new(SessionMode::Memory, 2, 300);
        let (a, b, c) = (id(100, "a"), id(200, "b"), id(500, "c"));
        s.answer(&a, 100, Some(live(400)), 0).unwrap();
        s.answer(&b, 200, Some(live(500)), 0).unwrap();
        assert_eq!(s.answer(&c, 500, Some(live(800)), 10), Err(Refused::Full));
        // Both answers are still held: neither challenge can be answered again.
        assert_eq!(s.answer(&a, 100, None, 10), Err(Refused::Replayed));
        assert_eq!(s.answer(&b, 200, None, 10), Err(Refused::Replayed));
        // Failed answers are counted apart: a flood of them does not lock attested ones out,
        // and where their own cap is full they are not recorded.
        s.answer(&id(300, "f1"), 300, None, 10).unwrap();
        s.answer(&id(300, "f2"), 300, None, 10).unwrap();
        assert_eq!(s.answer(&id(300, "f3"), 300, None, 10), Err(Refused::Full));
        // Once one is droppable (at 400, a's challenge is a session lifetime over), its room
        // is reused.
        assert_eq!(s.answer(&c, 500, Some(live(800)), 400), Ok(()));
        assert!(s.get(&a).is_none());
        assert!(s.get(&b).is_some());
        assert!(s.get(&c).is_some());
    }

    #[test]
    fn sessions_that_are_not_affirming_cannot_crowd_affirming_ones_out() {
        let s = Sessions::new(SessionMode::Memory, 1, 300);
        s.answer(
            &id(100, "c1"),
            100,
            Some(session(400, "contraindicated")),
            0,
        )
        .unwrap();
        assert_eq!(
            s.answer(&id(100, "c2"), 100, Some(session(400, "warning")), 0),
            Err(Refused::Full)
        );
        // Held, so release can say why it refuses; and the affirming cap is untouched.
        assert!(s.get(&id(100, "c1")).is_some());
        assert_eq!(s.answer(&id(100, "a"), 100, Some(live(400)), 0), Ok(()));
    }

    #[test]
    fn a_clock_stepped_back_does_not_reopen_a_swept_challenge() {
        let s = Sessions::new(SessionMode::Memory, 10, 300);
        let a = id(100, "a");
        s.answer(&a, 100, None, 10).unwrap();
        assert_eq!(s.prune(1000), 1);
        assert!(s.answered(&a));
        // The clock now says 50: the challenge would open again, but its id is below the cut.
        assert_eq!(
            s.answer(&a, 100, Some(live(400)), 50),
            Err(Refused::Expired)
        );
        // An unanswered challenge above the cut is taken.
        assert!(!s.answered(&id(800, "b")));
        assert_eq!(s.answer(&id(800, "b"), 800, None, 50), Ok(()));
        assert!(s.answered(&id(800, "b")));
    }

    #[test]
    fn the_database_cache_may_forget() {
        let s = Sessions::new(SessionMode::Database, 2, 300);
        s.remember(&id(100, "a"), live(100), 0);
        s.remember(&id(100, "b"), live(100), 0);
        s.remember(&id(100, "c"), live(100), 0);
        // At the cap, nothing droppable: the cache starts over rather than grow.
        assert!(s.get(&id(100, "c")).is_some());
        assert!(s.get(&id(100, "a")).is_none());
        assert_eq!(s.len(), 1);
    }
}
