//! Leases: how one ends (its job moves, its GPUs are free, the VM stays its tenant's until the
//! last token lapses), and their renewal in a node's heartbeat answer — only leases this broker
//! signed, only one tenant's per VM.

use cgx_protocol::broker::LeaseGrant;

use super::Broker;
use super::error::BrokerError;
use super::store::{self, JobState, LeaseRow, LeaseWrite, Outcome};

impl Broker {
    /// End lease `lease`, moving its job `from` → `to`; the lease if this call ended it.
    pub(super) async fn end_lease(
        &self,
        lease: &str,
        from: &'static [JobState],
        to: JobState,
        reason: &str,
    ) -> Result<Option<LeaseRow>, BrokerError> {
        let out = self
            .store
            .write(LeaseWrite::EndLease {
                lease: lease.to_string(),
                job_from: from,
                job_to: to,
                reason: reason.to_string(),
                now: self.clock.unix(),
                now_ms: self.now_ms(),
                half_life: self.config.reputation.half_life_secs,
            })
            .await?;
        Ok(match out {
            Outcome::Ended(l) => {
                let mut idx = self.index();
                idx.release(&l.node_id, &l.gpus);
                // Its last token lives until a lease TTL from now: the VM stays its tenant's
                // until then (a VM serves one tenant at a time).
                idx.hold_until(
                    &l.node_id,
                    self.clock.unix().saturating_add(self.config.lease_ttl_secs),
                );
                Some(l)
            }
            _ => None,
        })
    }

    /// The open leases of node `id` (placeable now) with fresh tokens, for its heartbeat's
    /// answer. The job moves on the node's workload reports (`reports.rs`), not here.
    pub(super) async fn renew_leases(
        &self,
        id: &str,
        now: i64,
    ) -> Result<Vec<LeaseGrant>, BrokerError> {
        let mut leases = Vec::new();
        let mut open = self.store.open_leases(Some(id)).await?;
        open.sort_by_key(|l| l.started_at);
        // A VM serves one tenant at a time: only the leases of the tenant whose lease on
        // it is oldest are renewed (rows that put another tenant beside it are a database
        // writer's, or a race placement refuses; either way not renewed).
        let mut tenant: Option<String> = None;
        for l in open {
            // Only a lease this broker signed is renewed: a row alone proves nothing.
            let Some(grant) = self.keys.renew(&l, now, self.config.lease_ttl_secs) else {
                tracing::error!(lease = %l.id, "an open lease row carries no valid broker signature; not renewed");
                continue;
            };
            let its = store::lease_tenant(&l.token, &self.keys.public);
            match (&tenant, its) {
                (None, t) => tenant = t,
                (Some(t), Some(other)) if *t != other => {
                    tracing::error!(lease = %l.id, node = %id, "an open lease of a second tenant on one VM; not renewed");
                    continue;
                }
                _ => {}
            }
            leases.push(grant);
        }
        self.log_renewals(id, &leases, now).await?;
        Ok(leases)
    }

    /// Renewals as leaves of the log (issue 33): a renewed token that carries its lease at
    /// least half a token lifetime past the last one logged is recorded (`lease.renew`: the
    /// token's digest and expiry) before the heartbeat's answer hands it out. Every renewal
    /// would be a leaf per lease per heartbeat; at most two per token lifetime still show how
    /// long each lease was kept alive, and cover every token a release can have relied on to
    /// within half a lifetime.
    async fn log_renewals(
        &self,
        node: &str,
        grants: &[LeaseGrant],
        now: i64,
    ) -> Result<(), BrokerError> {
        if self.log.is_none() {
            return Ok(());
        }
        let step = (self.config.lease_ttl_secs / 2).max(1);
        for g in grants {
            let due = {
                let logged = self
                    .renewals_logged
                    .lock()
                    .map_err(|_| BrokerError::Internal("a poisoned lock".into()))?;
                logged
                    .get(&g.lease_id)
                    .is_none_or(|last| g.expires_at >= last.saturating_add(step))
            };
            if !due {
                continue;
            }
            let token = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, g.token.as_bytes());
            self.store
                .write(store::AuditWrite {
                    at: now,
                    actor: "broker".into(),
                    action: "lease.renew",
                    subject: g.lease_id.clone(),
                    detail: serde_json::json!({
                        "node": node,
                        "expires_at": g.expires_at,
                        "token_sha256": hex::encode(token.as_ref()),
                    }),
                    archive: Vec::new(),
                })
                .await?;
            let mut logged = self
                .renewals_logged
                .lock()
                .map_err(|_| BrokerError::Internal("a poisoned lock".into()))?;
            // Leases whose last token has expired are forgotten (a renewal would be logged
            // again, once).
            if logged.len() > 10_000 {
                logged.retain(|_, exp| *exp > now);
            }
            logged.insert(g.lease_id.clone(), g.expires_at);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::testing::{Harness, Role, TENANT};
    use super::*;
    use cgx_protocol::records::Lease;
    use cgx_protocol::signed::{self, When};

    /// A placed job's node learns its lease from its heartbeat's answer, with a token the
    /// broker signed for the KBS (the job's tenant, the node's TEE key) and the job's
    /// workload; taking it leaves the job placed (it runs when the node says so). A node that
    /// heartbeats for another node's leases gets none.
    #[tokio::test]
    async fn a_heartbeat_hands_the_node_its_leases_and_their_workload() {
        let h = Harness::new("leases-renew").await;
        let (node, idle) = (h.node(1), h.node(1));
        h.register(&node).await.unwrap();
        let tenant = h.admin(Role::Tenant);
        let workload = cgx_protocol::broker::Workload {
            command: "/bin/serve".into(),
            args: vec!["--port".into(), "8000".into()],
            weights: None,
        };
        let job = h
            .broker
            .submit(&tenant, {
                let mut j = Harness::job(1, 600);
                j.workload = Some(workload.clone());
                j
            })
            .await
            .unwrap();
        assert_eq!(job.node_id.as_deref(), Some(node.id.as_str()));
        h.register(&idle).await.unwrap();
        assert!(h.heartbeat(&idle).await.unwrap().leases.is_empty());
        let answer = h.heartbeat(&node).await.unwrap();
        assert_eq!(answer.leases.len(), 1);
        let grant = &answer.leases[0];
        assert_eq!(Some(&grant.lease_id), job.lease_id.as_ref());
        let lease = signed::verify::<Lease>(
            &grant.token,
            &[h.broker.keys.public],
            When::At {
                now: h.now(),
                max_lifetime: i64::MAX,
            },
        )
        .unwrap()
        .body;
        assert_eq!(
            (lease.tenant.as_str(), lease.job.as_str()),
            (TENANT, job.id.as_str())
        );
        assert_eq!(
            lease.workload.as_ref(),
            Some(&workload),
            "signed with the lease"
        );
        assert_eq!(grant.workload.as_ref(), Some(&workload));
        let placed = h.broker.job_for(&tenant, &job.id).await.unwrap();
        assert_eq!(placed.state, JobState::Placed);
    }

    /// Ending a lease frees its GPUs at once, and its tenant holds the VM until the last
    /// token it was handed lapses.
    #[tokio::test]
    async fn an_ended_lease_frees_its_gpus_and_its_tenant_holds_the_vm_a_lease_ttl() {
        let h = Harness::new("leases-end").await;
        let node = h.node(1);
        h.register(&node).await.unwrap();
        let job = h
            .broker
            .submit(&h.admin(Role::Tenant), Harness::job(1, 600))
            .await
            .unwrap();
        let lease = job.lease_id.unwrap();
        let ended = h
            .broker
            .end_lease(&lease, &[JobState::Placed], JobState::Cancelled, "test")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ended.node_id, node.id);
        assert!(
            h.broker
                .end_lease(&lease, &[JobState::Placed], JobState::Cancelled, "test")
                .await
                .unwrap()
                .is_none(),
            "a lease ends once"
        );
        assert_eq!(h.broker.node_view(&node.id, false).unwrap().free_gpus, 1);
        let other = h
            .broker
            .submit(&h.admin(Role::OtherTenant), {
                let mut j = Harness::job(1, 600);
                j.resources = vec![format!(
                    "{}/weights/key",
                    super::super::testing::OTHER_TENANT
                )];
                j
            })
            .await
            .unwrap();
        assert_eq!(other.state, JobState::Pending, "{}", other.reason);
    }
}
