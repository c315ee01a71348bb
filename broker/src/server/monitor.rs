//! The monitor: replica sync (node rows into the index, each record's signature checked),
//! failover of nodes that stopped proving themselves, completion of leases that ran their
//! duration, expiry of pending jobs, the placement pass; and its background tasks.

use std::sync::Arc;
use std::time::Duration;

use super::Broker;
use super::error::BrokerError;
use super::store::{JobState, JobWrite, NodeWrite};

pub(super) async fn monitor(broker: Arc<Broker>, every: Duration) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n: u64 = 0;
    loop {
        ticker.tick().await;
        n += 1;
        if let Err(e) = broker.tick().await {
            tracing::warn!(error = %e, "monitor pass deferred");
        }
        if n.is_multiple_of(120)
            && let Err(e) = broker
                .store
                .write(NodeWrite::SweepNonces {
                    now: broker.clock.unix(),
                })
                .await
        {
            tracing::debug!(error = %e, "nonce sweep deferred");
        }
    }
}

pub(super) async fn checkpoints(broker: Arc<Broker>) {
    cgx_service::db::checkpoints(|| broker.store.checkpoint()).await;
}

impl Broker {
    /// Read node rows other replicas (or this one) changed since the last sync into the index;
    /// each record's signature is checked before it counts.
    pub(crate) async fn sync(&self) -> Result<(), BrokerError> {
        let cursor = self.sync_cursor.lock().map(|c| *c).unwrap_or(0);
        // Taken before the rows are read: a registration this replica serves meanwhile writes
        // a record newer than the row read here, which must not put the row's back.
        let since = self.index().generation();
        // Overlap by two seconds: a row committed late with an earlier `updated_ms` is still
        // seen.
        let rows = self.store.nodes_since((cursor - 2000).max(0)).await?;
        let operators = self.store.operators().await?;
        let ids: Vec<String> = rows.iter().map(|r| r.id.clone()).collect();
        let now = self.clock.unix();
        let ttl = self.config.lease_ttl_secs;
        let used = self
            .store
            .allocations(Some(&ids), now - ttl, ttl, &self.keys.public)
            .await?;
        let penalties = self
            .store
            .pow_penalties(now - self.config.pow.penalty_secs)
            .await?;
        let mut max_ms = cursor;
        let mut idx = self.index();
        for (serial, at, reason) in &penalties {
            idx.set_gpu_penalty(serial, *at, reason);
        }
        for (name, rep) in operators {
            idx.set_operator_reputation(&name, rep);
        }
        for row in rows {
            if idx.wrote_since(&row.id, since) {
                // Not counted in the cursor either: the next pass reads the row as it is then.
                continue;
            }
            max_ms = max_ms.max(row.updated_ms);
            let same = idx.record_token(&row.id) == Some(row.record.as_str());
            if !same {
                match self.keys.verify_record(&row.record) {
                    Ok(record)
                        if record.id == row.id
                            && !idx.accepts_record(&row.id, record.attested_at) =>
                    {
                        // Validly signed, but older than a record of this node already seen: a
                        // database writer putting back an attestation the node has since
                        // replaced. The newer one stays.
                        tracing::error!(node = %row.id, attested_at = record.attested_at, "a node row carries an older record than one already seen; ignored");
                        continue;
                    }
                    Ok(record) if record.id == row.id => {
                        idx.upsert(
                            record,
                            row.record.clone(),
                            row.reputation,
                            row.last_heartbeat,
                            row.heartbeat_seq,
                            0,
                        );
                    }
                    Ok(record) => {
                        tracing::error!(node = %row.id, record_for = %record.id, "a node row carrying another node's record; ignored");
                        idx.remove(&row.id);
                        continue;
                    }
                    Err(e) => {
                        // Say why: a bad signature, or a record this version cannot read (a
                        // newer replica's, say) — not the same thing to an operator.
                        tracing::error!(node = %row.id, error = %e, "a node row whose record does not verify or parse; ignored");
                        idx.remove(&row.id);
                        continue;
                    }
                }
            } else {
                idx.set_node_reputation(&row.id, row.reputation);
            }
            idx.observe_heartbeat(&row.id, row.last_heartbeat, row.heartbeat_seq);
            idx.ask_reattest(&row.id, row.reattest_asked > 0);
            idx.set_pow_failure(&row.id, row.pow_failed_at, &row.pow_reason);
            idx.set_use(&row.id, &used.get(&row.id).cloned().unwrap_or_default());
        }
        drop(idx);
        if let Ok(mut c) = self.sync_cursor.lock() {
            *c = max_ms;
        }
        Ok(())
    }

    /// One monitor pass: sync, fail over nodes that stopped proving themselves, complete leases
    /// that ran their duration, place pending jobs.
    pub(crate) async fn tick(&self) -> Result<(), BrokerError> {
        self.sync().await?;
        // Reference values another replica stored; a row that does not hold is logged and the
        // engine in force stays.
        if let Err(e) = self.refresh_reference_values().await {
            tracing::error!(error = %e, "reference values not refreshed");
        }
        let now = self.clock.unix();
        self.index().release_lapsed_holds(now);
        let failing = self.index().failing(now);
        for (node, why) in failing {
            let reason = format!("node {node} stopped proving itself ({why}); re-placing");
            for l in self.store.open_leases(Some(&node)).await? {
                if let Some(l) = self
                    .end_lease(
                        &l.id,
                        &[JobState::Placed, JobState::Running],
                        JobState::Pending,
                        &reason,
                    )
                    .await?
                {
                    self.pending
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.metrics.event("failover", "lease_ended");
                    tracing::warn!(node = %node, lease = %l.id, job = %l.job_id, %why, "lease ended; job re-placed");
                }
            }
            // Leases another replica ended: the allocation rows are gone.
            let used = self
                .store
                .allocations(
                    Some(std::slice::from_ref(&node)),
                    now - self.config.lease_ttl_secs,
                    self.config.lease_ttl_secs,
                    &self.keys.public,
                )
                .await?;
            self.index()
                .set_use(&node, &used.get(&node).cloned().unwrap_or_default());
        }
        for l in self.store.due_leases(now).await? {
            if self
                .end_lease(
                    &l.id,
                    &[JobState::Placed, JobState::Running],
                    JobState::Completed,
                    "ran its duration",
                )
                .await?
                .is_some()
            {
                self.metrics.event("job", "completed");
            }
        }
        self.expire_pending(now).await?;
        self.place_pending_all().await;
        Ok(())
    }

    /// Pending jobs older than `pending_ttl_secs` expire, with the reason (a read first, so a
    /// pass with nothing to expire writes nothing).
    pub(super) async fn expire_pending(&self, now: i64) -> Result<(), BrokerError> {
        let before = now.saturating_sub(self.config.pending_ttl_secs);
        if !self.store.any_pending_before(before).await? {
            return Ok(());
        }
        self.store
            .write(JobWrite::ExpirePending {
                before,
                now,
                reason: format!(
                    "expired: pending longer than {} s without a node that fits",
                    self.config.pending_ttl_secs
                ),
            })
            .await?;
        self.metrics.event("job", "expired");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::testing::{Harness, Role};
    use super::*;

    /// A node that stops heartbeating loses its leases at the next pass, and its job goes to a
    /// node that still proves itself, with the reason in its events.
    #[tokio::test]
    async fn a_silent_nodes_jobs_fail_over_to_a_live_node() {
        let h = Harness::new("monitor-failover").await;
        let first = h.node(1);
        h.register(&first).await.unwrap();
        let tenant = h.admin(Role::Tenant);
        let job = h
            .broker
            .submit(&tenant, Harness::job(1, 3600))
            .await
            .unwrap();
        assert_eq!(job.node_id.as_deref(), Some(first.id.as_str()));
        let second = h.node(1);
        h.register(&second).await.unwrap();
        for _ in 0..4 {
            h.clock.advance(5);
            h.heartbeat(&second).await.unwrap();
        }
        h.broker.tick().await.unwrap();
        let moved = h.broker.job_for(&tenant, &job.id).await.unwrap();
        assert_eq!(
            moved.node_id.as_deref(),
            Some(second.id.as_str()),
            "{}",
            moved.reason
        );
        assert_eq!(moved.state, JobState::Placed);
        assert!(
            moved
                .events
                .iter()
                .any(|e| e.to == JobState::Pending && e.reason.contains("stopped proving itself")),
            "{:?}",
            moved.events
        );
        assert_ne!(moved.lease_id, job.lease_id);
    }

    /// A lease that ran its duration completes at the next pass; a job nothing fits expires
    /// after `pending_ttl_secs`, with the reason.
    #[tokio::test]
    async fn leases_complete_and_pending_jobs_expire_on_the_clock() {
        let h = Harness::with("monitor-complete", |c| c.pending_ttl_secs = 100).await;
        let node = h.node(1);
        h.register(&node).await.unwrap();
        let tenant = h.admin(Role::Tenant);
        let short = h.broker.submit(&tenant, Harness::job(1, 20)).await.unwrap();
        let waiting = h.broker.submit(&tenant, Harness::job(8, 20)).await.unwrap();
        assert_eq!(waiting.state, JobState::Pending);
        for _ in 0..5 {
            h.clock.advance(5);
            h.heartbeat(&node).await.unwrap();
        }
        h.broker.tick().await.unwrap();
        let done = h.broker.job_for(&tenant, &short.id).await.unwrap();
        assert_eq!(done.state, JobState::Completed, "{}", done.reason);
        assert_eq!(
            h.broker.job_for(&tenant, &waiting.id).await.unwrap().state,
            JobState::Pending
        );
        h.clock.advance(80);
        h.broker.tick().await.unwrap();
        let expired = h.broker.job_for(&tenant, &waiting.id).await.unwrap();
        assert_eq!(expired.state, JobState::Expired);
        assert!(expired.reason.contains("expired"), "{}", expired.reason);
    }
}
