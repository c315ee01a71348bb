//! Reputation (issue 32): from what the broker observed — uptime from heartbeats, proofs
//! passed and missed, leases lost to failover, proven cheats — per node and per operator,
//! decayed over time, stored, and fed to placement's ranking (price first, then reputation).
//!
//! **The formula.** Each subject (a node, an operator: the sum of its nodes' events) keeps
//! decayed counts: `up` and `down` hours, `passed` and `missed` proofs, `failovers`, `cheats`
//! (failed proofs, equivocated records). Every count is multiplied by `2^(−Δt / half_life)`
//! before an event is added (`[reputation] half_life_secs`, default 7 days), so old events
//! fade and a node that mended its ways recovers. Then
//!
//! ```text
//! good  = up + passed
//! bad   = 3·down + 2·missed + 5·failovers + 100·cheats
//! score = 1000 · (good + K·r₀) / (good + bad + K)        K = 20, r₀ = 0.9
//! score = min(score, 1000 − 300·cheats)                  a cheat costs even a large operator
//! rank  = min(0, 100 · ⌊score / 100⌋ − 900)               ∈ {0, −100, …, −900}
//! ```
//!
//! A subject with no evidence scores `1000·r₀ = 900`: rank 0. An honest subject's score climbs
//! towards 1000 and stays in the same band, rank 0: **a new node is neither favoured nor
//! starved** — it ranks with the honest nodes of its price, not above them, not below. A
//! flapping, slow or cheating subject sinks a band per 100 points. What the index ranks with
//! is the node's rank plus its operator's, so a new node of a cheating operator starts below
//! everyone honest, and re-registering under a new key (a new node id) keeps the operator's
//! part (and the GPUs' proof penalties, `pow.rs`).

use super::store::{ReputationWrite, UPTIME_CHUNK};
use super::{Broker, BrokerError};

/// Pseudo-events of the prior, and the prior's good share.
const K: f64 = 20.0;
const PRIOR: f64 = 0.9;

/// The decayed counts of one subject.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Signals {
    pub up_h: f64,
    pub down_h: f64,
    pub passed: f64,
    pub missed: f64,
    pub failovers: f64,
    pub cheats: f64,
}

/// One event (or an uptime span) to add.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Delta {
    pub up_h: f64,
    pub down_h: f64,
    pub passed: f64,
    pub missed: f64,
    pub failovers: f64,
    pub cheats: f64,
}

impl Signals {
    /// The counts `secs` later, with nothing new: each halves every `half_life` seconds.
    pub fn decayed(self, secs: i64, half_life: i64) -> Signals {
        if secs <= 0 || half_life <= 0 {
            return self;
        }
        let f = (-(secs as f64) / half_life as f64).exp2();
        Signals {
            up_h: self.up_h * f,
            down_h: self.down_h * f,
            passed: self.passed * f,
            missed: self.missed * f,
            failovers: self.failovers * f,
            cheats: self.cheats * f,
        }
    }

    pub fn add(self, d: Delta) -> Signals {
        Signals {
            up_h: self.up_h + d.up_h,
            down_h: self.down_h + d.down_h,
            passed: self.passed + d.passed,
            missed: self.missed + d.missed,
            failovers: self.failovers + d.failovers,
            cheats: self.cheats + d.cheats,
        }
    }

    /// The score, 0–1000 (900 with no evidence).
    pub fn score(&self) -> i64 {
        let good = self.up_h + self.passed;
        let bad =
            3.0 * self.down_h + 2.0 * self.missed + 5.0 * self.failovers + 100.0 * self.cheats;
        let s = 1000.0 * (good + K * PRIOR) / (good + bad + K);
        let s = s.min(1000.0 - 300.0 * self.cheats);
        if s.is_finite() {
            s.clamp(0.0, 1000.0).floor() as i64
        } else {
            0
        }
    }

    /// What placement ranks with: 0 for honest and new subjects, less per band of 100 below.
    pub fn rank(&self) -> i64 {
        rank_of(self.score())
    }
}

/// A score's rank.
pub fn rank_of(score: i64) -> i64 {
    (100 * (score.clamp(0, 1000) / 100) - 900).min(0)
}

impl Broker {
    /// The uptime pass: every node this replica indexes is credited with the time since its
    /// last credit as up (fresh now) or down (heartbeats missed or its attestation lapsed),
    /// in one write; the ranks it changed go to the index.
    pub(crate) async fn reputation_pass(&self) -> Result<usize, BrokerError> {
        let now = self.clock.unix();
        let nodes = self.index().liveness(now);
        let n = nodes.len();
        for chunk in nodes.chunks(UPTIME_CHUNK) {
            self.store
                .write(ReputationWrite::Uptime {
                    nodes: chunk.to_vec(),
                    at: now,
                    half_life: self.config.reputation.half_life_secs,
                    now_ms: self.now_ms(),
                })
                .await?;
        }
        if n > 0 {
            self.sync().await?;
        }
        Ok(n)
    }
}

/// The reputation task: an uptime pass every `every`.
pub(super) async fn keeper(broker: std::sync::Arc<Broker>, every: std::time::Duration) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is at once: skip it (a node just registered has no uptime to credit).
    ticker.tick().await;
    loop {
        ticker.tick().await;
        if let Err(e) = broker.reputation_pass().await {
            tracing::warn!(error = %e, "reputation pass deferred");
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::testing::{Harness, Role};
    use super::*;

    /// Through the broker: a node that flaps (silent a third of an hour) sinks below a steady
    /// one of the same price, and the next job goes to the steady one whatever their ids; a
    /// node registered now ranks with the steady one; a failed proof sinks a node further and
    /// costs its operator; the ranks are stored (a restarted broker ranks the same).
    #[tokio::test]
    async fn a_flapping_or_cheating_node_sinks_below_a_steady_one_and_a_new_one_ranks_with_it() {
        let mut h = Harness::with("reputation", |c| c.reattest_secs = 7200).await;
        let (a, b) = (h.node(1), h.node(1));
        h.register(&a).await.unwrap();
        h.register(&b).await.unwrap();
        let t0 = h.now();
        for step in 1..=720 {
            let t = t0 + step * 5;
            h.clock.set(t);
            h.heartbeat(&b).await.unwrap();
            // `a` is silent from minute 20 to minute 40.
            if !(240..480).contains(&step) {
                h.heartbeat(&a).await.unwrap();
            }
            if step % 12 == 0 {
                h.broker.reputation_pass().await.unwrap();
            }
        }
        let rank = |h: &Harness, id: &str| h.broker.index().reputation(id).unwrap();
        // (Both are the operator's: its part, pulled down by `a`'s downtime, is the same.)
        assert_eq!(h.broker.index().node_reputation(&b.id), Some(0), "steady");
        assert!(
            rank(&h, &a.id) < rank(&h, &b.id),
            "flapping: {}",
            rank(&h, &a.id)
        );
        let job = h
            .broker
            .submit(&h.admin(Role::Tenant), Harness::job(1, 600))
            .await
            .unwrap();
        assert_eq!(job.node_id.as_deref(), Some(b.id.as_str()), "{job:?}");
        let c = h.node(1);
        h.register(&c).await.unwrap();
        assert_eq!(
            rank(&h, &c.id),
            rank(&h, &b.id),
            "a new node is neither favoured nor starved"
        );
        // Stored: a restarted broker ranks the same.
        let before = (rank(&h, &a.id), rank(&h, &b.id));
        h.restart().await;
        assert_eq!((rank(&h, &a.id), rank(&h, &b.id)), before);
        // A failed proof on `b`'s lease: `b` sinks two bands at least, its operator with it.
        let challenges = h.heartbeat(&b).await.unwrap().challenges;
        assert_eq!(challenges.len(), 1);
        b.prove(&h.broker, &challenges[0], false, h.now()).await;
        h.broker.pow_pass().await.unwrap();
        h.broker.sync().await.unwrap();
        assert!(
            rank(&h, &b.id) <= -400,
            "node and operator: {}",
            rank(&h, &b.id)
        );
        assert!(h.broker.index().node_reputation(&b.id).unwrap() <= -200);
        assert!(rank(&h, &c.id) < 0, "the operator's part");
    }

    const DAY: i64 = 86_400;
    const WEEK: i64 = 7 * DAY;

    /// A week of a node's life, hour by hour: `up` of every 12 five-minute heartbeat spans
    /// fresh, a proof every 10 minutes passed with probability `pass` (deterministic), and a
    /// failover or a cheat where asked.
    fn week(up_share: f64, pass: f64, failovers_per_day: f64, cheats: f64) -> Signals {
        let mut s = Signals::default();
        for hour in 0..(7 * 24) {
            s = s.decayed(3600, WEEK);
            let proofs = 6.0;
            let passed = (proofs * pass).floor();
            s = s.add(Delta {
                up_h: up_share,
                down_h: 1.0 - up_share,
                passed,
                missed: proofs - passed,
                failovers: if hour % 24 == 0 {
                    failovers_per_day
                } else {
                    0.0
                },
                cheats: if hour == 7 * 24 - 1 { cheats } else { 0.0 },
            });
        }
        s
    }

    #[test]
    fn honest_and_new_nodes_rank_alike_and_cheats_and_flapping_sink() {
        let new = Signals::default();
        let honest = week(1.0, 1.0, 0.0, 0.0);
        let flapping = week(0.7, 0.7, 3.0, 0.0);
        let slow = week(1.0, 0.5, 0.0, 0.0);
        let cheat = week(1.0, 1.0, 0.0, 1.0);
        assert_eq!(new.score(), 900);
        assert!(honest.score() > 990, "{}", honest.score());
        // Neither favoured nor starved: the same rank.
        assert_eq!((new.rank(), honest.rank()), (0, 0));
        for (what, s) in [("flapping", flapping), ("slow", slow), ("cheat", cheat)] {
            assert!(s.rank() < honest.rank(), "{what}: {} ({s:?})", s.score());
        }
        assert!(cheat.rank() <= -200, "{}", cheat.rank());
        // A honest operator with a hundred nodes still loses a band per cheat.
        let mut fleet = Signals::default();
        for _ in 0..100 {
            fleet = fleet.add(Delta {
                up_h: 168.0,
                passed: 1000.0,
                ..Delta::default()
            });
        }
        assert_eq!(fleet.rank(), 0);
        assert!(
            fleet
                .add(Delta {
                    cheats: 1.0,
                    ..Delta::default()
                })
                .rank()
                <= -200
        );
        // Old sins fade: after four half-lives of honest work, the cheat is back to rank 0.
        let mut mended = cheat;
        for _ in 0..(4 * 7 * 24) {
            mended = mended.decayed(3600, WEEK).add(Delta {
                up_h: 1.0,
                passed: 6.0,
                ..Delta::default()
            });
        }
        assert_eq!(mended.rank(), 0, "{}", mended.score());
        assert_eq!(rank_of(1000), 0);
    }
}
