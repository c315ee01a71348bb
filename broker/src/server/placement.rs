//! Placement: choose a node for a job (the index's candidates, the tenant's policy in the
//! sandbox, the choice checked again under the index's lock), sign its lease and commit GPUs,
//! lease and state in one write; and the pass over pending jobs.

use std::collections::HashMap;
use std::sync::Arc;

use cgx_protocol::broker::JobSpec;

use super::error::BrokerError;
use super::index::{Misfit, Requirements};
use super::jobs::owned_resources;
use super::store::{self, EscrowOpen, JobRow, JobState, JobWrite, Outcome, PlacementRow, Refusal};
use super::{Broker, random_id};
use cgx_ledger::settle::{Escrow, Price, affordable_windows};
use cgx_protocol::money::Micros;

/// A policy's refusal of one node, and what it judged: the same record (EAR digest) and
/// reputation give the same input, so the same answer.
#[derive(Debug, Clone)]
pub(super) struct Denial {
    pub(super) ear_digest: String,
    pub(super) reputation: i64,
    pub(super) reasons: Vec<String>,
}

impl Broker {
    /// Try to place one job (`new`: not stored yet — it is stored with its placement, or
    /// pending without one). The placement that committed, if any, and what the job's policy
    /// said of the nodes it ran on.
    ///
    /// The job row is the database's word only: before a lease is signed its seal must verify
    /// (tenant and spec as submitted) and every resource must be the tenant's own. The policy
    /// runs outside the index's lock and off the async threads; a policy that fails (a limit,
    /// an error) fails its job, never the pass.
    pub(super) async fn place_job(
        &self,
        job: &JobRow,
        req: Option<Requirements>,
        new: bool,
    ) -> Result<(Option<PlacementRow>, HashMap<String, Misfit>), BrokerError> {
        self.keys.check_job(job)?;
        // Sealed, so the broker stored this text. One no version could read (not JSON, a
        // field missing) fails its job with the reason rather than stay pending for ever; one a
        // newer replica wrote (a field or a kind this version does not know) is left for a
        // replica that reads it.
        let spec = JobSpec::from_stored(&job.spec).map_err(|e| {
            if e.contains("unknown field") || e.contains("unknown variant") {
                BrokerError::Internal(format!("stored job spec of a newer version: {e}"))
            } else {
                BrokerError::BadRequest(format!("stored job spec: {e}"))
            }
        })?;
        if spec.tenant.as_deref() != Some(job.tenant.as_str()) {
            return Err(BrokerError::JobSeal(format!(
                "job {}'s spec names another tenant than its row",
                job.id
            )));
        }
        owned_resources(&job.tenant, &spec.resources)?;
        let req = match req {
            Some(r) => r,
            None => self.requirements(&job.id, &job.tenant, &spec).await?,
        };
        let mut verdicts = HashMap::new();
        // What the job's earlier leases spent and still hold: this lease reserves the rest.
        let mut committed = self.store.job_committed(&job.id).await?;
        // A quoted offer holds the job's first placement only: after a failover the job goes
        // wherever fits (the offer's node is, as often as not, the one that failed).
        let offer = match &spec.offer {
            Some(o) if new || !self.store.job_was_leased(&job.id).await? => Some(o.clone()),
            _ => None,
        };
        for _attempt in 0..8 {
            let now = self.clock.unix();
            let candidates = match &offer {
                None => self.index().candidates(&req, now),
                // Held to a quoted offer: that node at that price, or refused with why not.
                Some(o) => {
                    let c = self.index().candidate_on(&o.node, &req, now).map_err(|m| {
                        BrokerError::OfferGone(format!("node {} no longer fits: {m}", o.node))
                    })?;
                    if c.record.price != o.price_per_gpu_hour_micros {
                        return Err(BrokerError::OfferGone(format!(
                            "node {}'s price is now {} per GPU-hour, not the offer's {}",
                            o.node, c.record.price, o.price_per_gpu_hour_micros
                        )));
                    }
                    vec![c]
                }
            };
            let chosen = match &req.policy {
                None => candidates.into_iter().next().map(|c| (c.choice, c.record)),
                Some(policy) => {
                    // One hop to the policy sandbox's evaluator threads for every candidate,
                    // each under its own limits; the answers come back in rank order.
                    let mut inputs = Vec::with_capacity(candidates.len());
                    let mut choices = Vec::with_capacity(candidates.len());
                    let known = self
                        .denials
                        .lock()
                        .ok()
                        .and_then(|d| d.get(&job.id).cloned())
                        .unwrap_or_default();
                    for c in candidates {
                        let input = c.input.unwrap_or_default();
                        let reputation = input["node"]["reputation"].as_i64().unwrap_or(0);
                        // Denied before on this very record and reputation: denied again.
                        if let Some(d) = known.get(&c.choice.node_id)
                            && d.ear_digest == c.record.ear_digest
                            && d.reputation == reputation
                        {
                            verdicts.insert(c.choice.node_id, Misfit::Policy(d.reasons.clone()));
                            continue;
                        }
                        inputs.push((input, reputation));
                        choices.push((c.choice, c.record));
                    }
                    let reputations: Vec<i64> = inputs.iter().map(|(_, r)| *r).collect();
                    let inputs: Vec<serde_json::Value> =
                        inputs.into_iter().map(|(i, _)| i).collect();
                    let answers = if choices.is_empty() {
                        Vec::new()
                    } else {
                        self.metrics.event("placement", "policy_batch");
                        match policy.refusals_many(inputs).await {
                            Ok(a) => a,
                            // The sandbox had no room: not evaluated now (the job waits for the
                            // next pass), which is no fault of the job's.
                            Err(cgx_policies::Error::Busy) => {
                                self.metrics.event("placement", "policy_busy");
                                return Ok((None, verdicts));
                            }
                            Err(e) => {
                                return Err(BrokerError::PlacementPolicy(format!("failed: {e}")));
                            }
                        }
                    };
                    let mut chosen = None;
                    let mut denied = Vec::new();
                    for (((choice, record), answer), reputation) in
                        choices.into_iter().zip(answers).zip(reputations)
                    {
                        match answer {
                            Ok(r) if r.is_empty() => {
                                chosen = Some((choice, record));
                                break;
                            }
                            Ok(r) => {
                                denied.push((
                                    choice.node_id.clone(),
                                    Denial {
                                        ear_digest: record.ear_digest.clone(),
                                        reputation,
                                        reasons: r.clone(),
                                    },
                                ));
                                verdicts.insert(choice.node_id, Misfit::Policy(r));
                            }
                            // A limit or an error is the job's failure, with its reason, once:
                            // it does not cost every pass again.
                            Err(e) => {
                                return Err(BrokerError::PlacementPolicy(format!(
                                    "failed on node {}: {e}",
                                    choice.node_id
                                )));
                            }
                        }
                    }
                    if !denied.is_empty()
                        && let Ok(mut d) = self.denials.lock()
                    {
                        if d.len() > 10_000 && !d.contains_key(&job.id) {
                            d.clear();
                        }
                        d.entry(job.id.clone()).or_default().extend(denied);
                    }
                    chosen
                }
            };
            let Some((choice, judged)) = chosen else {
                if let Some(o) = &offer {
                    let why = verdicts
                        .get(&o.node)
                        .map_or_else(|| "it no longer fits".to_string(), ToString::to_string);
                    return Err(BrokerError::OfferGone(format!("node {}: {why}", o.node)));
                }
                break;
            };
            // The index may have changed while the policy ran: check again under the lock,
            // the record the policy judged included (a re-registration brings new claims).
            let record = {
                let mut idx = self.index();
                let same = idx
                    .record(&choice.node_id)
                    .is_some_and(|r| Arc::ptr_eq(&r, &judged));
                if same
                    && idx.cheap_fits(&choice.node_id, &req, now).is_ok()
                    && idx.reserve_for(&choice.node_id, &choice.gpus, &job.tenant, now)
                {
                    judged
                } else {
                    continue;
                }
            };
            let lease_id = random_id("l")?;
            let job_end = now.saturating_add(i64::try_from(spec.duration_secs).unwrap_or(i64::MAX));
            // The escrow: the job's budget left, reserved from the tenant; the lease ends
            // before the first window it could not pay (`cgx_ledger::settle`).
            let price = Price {
                per_gpu_hour: record.price.get(),
                gpus: u32::try_from(choice.gpus.len()).unwrap_or(u32::MAX),
                window_secs: self.config.metering_window_secs,
            };
            let reserve = spec.budget_micros.get().saturating_sub(committed);
            let covers = affordable_windows(&price, reserve);
            if covers == 0 {
                self.index().release(&choice.node_id, &choice.gpus);
                return Err(BrokerError::Budget(format!(
                    "job {}'s budget is spent: {} of {} paid or held by its earlier leases",
                    job.id,
                    Micros(committed),
                    spec.budget_micros
                )));
            }
            let window = i64::from(self.config.metering_window_secs);
            let ends_at = job_end.min(
                now.saturating_add(
                    i64::try_from(covers)
                        .unwrap_or(i64::MAX)
                        .saturating_mul(window),
                ),
            );
            let escrow = Escrow::new(
                &lease_id,
                &job.tenant,
                &record.operator,
                price,
                self.config.ledger.fee_bps,
                ends_at.saturating_add(self.config.ledger.escrow_expiry_secs),
            )
            .map_err(|e| BrokerError::Internal(format!("escrow: {e}")))?;
            let token = self.keys.lease_token(
                &lease_id,
                &job.id,
                &job.tenant,
                &record,
                &choice.gpus,
                &spec.resources,
                spec.workload.as_ref(),
                now,
                ends_at,
                self.config.lease_ttl_secs,
                self.config.metering_window_secs,
            )?;
            let placement = PlacementRow {
                reason: format!(
                    "placed on {} (GPUs {}), lease {lease_id}",
                    choice.node_id,
                    store::gpus_text(&choice.gpus)
                ),
                job_id: job.id.clone(),
                tenant: job.tenant.clone(),
                tenant_ended_after: now - self.config.lease_ttl_secs,
                broker_key: self.keys.public,
                node_id: choice.node_id.clone(),
                lease_id: lease_id.clone(),
                gpus: choice.gpus.clone(),
                token,
                started_at: now,
                ends_at,
                now_ms: self.now_ms(),
                escrow: Some(Box::new(EscrowOpen {
                    escrow,
                    job_id: job.id.clone(),
                    node_id: choice.node_id.clone(),
                    started_at: now,
                    covers,
                    reserve,
                    job_committed: committed,
                })),
            };
            let write = if new {
                JobWrite::Submit {
                    job: Box::new(job.clone()),
                    placement: Some(placement.clone()),
                    max_pending: self.config.max_pending_per_tenant,
                }
            } else {
                JobWrite::Place(placement.clone())
            };
            match self.store.write(write).await {
                Ok(Outcome::Refused(Refusal::GpuTaken | Refusal::OtherTenant(_))) => {
                    // Another replica took one of these GPUs, or placed another tenant on the
                    // node: learn its allocations, choose again.
                    self.metrics.event("placement", "conflict");
                    self.index().release(&choice.node_id, &choice.gpus);
                    let used = self
                        .store
                        .allocations(
                            Some(std::slice::from_ref(&choice.node_id)),
                            now - self.config.lease_ttl_secs,
                            self.config.lease_ttl_secs,
                            &self.keys.public,
                        )
                        .await?;
                    self.index().set_use(
                        &choice.node_id,
                        &used.get(&choice.node_id).cloned().unwrap_or_default(),
                    );
                }
                Ok(Outcome::Refused(Refusal::EscrowMoved)) => {
                    // The job's earlier leases settled meanwhile: reserve again from what
                    // they hold now.
                    self.index().release(&choice.node_id, &choice.gpus);
                    committed = self.store.job_committed(&job.id).await?;
                }
                Ok(Outcome::Refused(Refusal::Funds(why))) => {
                    // The tenant cannot fund the escrow now: the job waits (a new one is
                    // stored pending below) for a deposit.
                    self.index().release(&choice.node_id, &choice.gpus);
                    self.metrics.event("placement", "unfunded");
                    tracing::info!(job = %job.id, tenant = %job.tenant, %why, "escrow not funded; the job waits");
                    break;
                }
                Ok(Outcome::Refused(_)) => {
                    self.index().release(&choice.node_id, &choice.gpus);
                    return Ok((None, verdicts));
                }
                Ok(_) => {
                    self.index().confirm(&choice.node_id, &choice.gpus);
                    self.metrics.event("job", "placed");
                    tracing::info!(job = %job.id, node = %choice.node_id, lease = %lease_id, "job placed");
                    if let Ok(mut p) = self.policies.lock() {
                        p.remove(&job.id);
                    }
                    if let Ok(mut d) = self.denials.lock() {
                        d.remove(&job.id);
                    }
                    return Ok((Some(placement), verdicts));
                }
                Err(e) => {
                    self.index().release(&choice.node_id, &choice.gpus);
                    return Err(e);
                }
            }
        }
        if new {
            // The cap is counted inside the write that adds the job: concurrent submissions
            // cannot all pass a count taken before it.
            let written = self
                .store
                .write(JobWrite::Submit {
                    job: Box::new(job.clone()),
                    placement: None,
                    max_pending: self.config.max_pending_per_tenant,
                })
                .await?;
            if matches!(written, Outcome::Refused(Refusal::TooManyPending)) {
                return Err(BrokerError::Quota(format!(
                    "tenant {} has {} jobs pending already; cancel some or wait",
                    job.tenant, self.config.max_pending_per_tenant
                )));
            }
        }
        Ok((None, verdicts))
    }

    /// Place every pending job that fits now, oldest first (nothing to read when this replica
    /// knows of none).
    pub(crate) async fn place_pending(&self) {
        if self.pending.load(std::sync::atomic::Ordering::Relaxed) <= 0 {
            return;
        }
        self.place_pending_all().await;
    }

    /// [`Broker::place_pending`] whatever the hint says (the monitor: another replica's jobs).
    pub(super) async fn place_pending_all(&self) {
        let Ok(_one) = self.placing.try_lock() else {
            return;
        };
        let jobs = match self.store.pending_jobs(self.config.placement_batch).await {
            Ok(j) => j,
            Err(e) => {
                tracing::warn!(error = %e, "pending jobs");
                return;
            }
        };
        let mut left = jobs.len() as i64;
        for job in jobs {
            match self.place_job(&job, None, false).await {
                Ok((Some(_), _)) => left -= 1,
                Ok((None, _)) => {}
                Err(e) => {
                    tracing::warn!(job = %job.id, error = %e, "placement failed");
                    // The job's own fault (its policy, its spec, its seal, resources not its
                    // tenant's): it fails with the reason; the pass goes on.
                    if matches!(
                        e,
                        BrokerError::PlacementPolicy(_)
                            | BrokerError::Budget(_)
                            | BrokerError::OfferGone(_)
                            | BrokerError::BadRequest(_)
                            | BrokerError::JobSeal(_)
                            | BrokerError::Forbidden(_)
                    ) && self
                        .transition(
                            &job.id,
                            &[JobState::Pending],
                            JobState::Failed,
                            &e.to_string(),
                        )
                        .await
                        .unwrap_or(false)
                    {
                        left -= 1;
                    }
                }
            }
        }
        self.pending
            .store(left, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::testing::{Harness, Role};
    use super::*;

    /// A tenant's placement policy chooses among the nodes that fit: the node it denies is
    /// passed over, and while only denied nodes are left the job waits, saying what the policy
    /// said (by count). A policy that cannot compile is refused at submission.
    #[tokio::test]
    async fn the_tenants_policy_passes_over_the_nodes_it_denies() {
        let h = Harness::new("placement-policy").await;
        let mut europe = h.node(1);
        europe.offer.region = "eu-west".into();
        let mut america = h.node(1);
        america.offer.region = "us-east".into();
        h.register(&europe).await.unwrap();
        let tenant = h.admin(Role::Tenant);
        let mut spec = Harness::job(1, 600);
        spec.placement_policy = Some(
            "package placement\ndeny contains \"not in us-east\" if input.node.region != \"us-east\""
                .into(),
        );
        let job = h.broker.submit(&tenant, spec.clone()).await.unwrap();
        assert_eq!(job.state, JobState::Pending);
        assert!(job.reason.contains("1 placement_policy"), "{}", job.reason);
        let waiting = h.broker.job_for(&tenant, &job.id).await.unwrap();
        assert!(waiting.reason.contains("submitted"), "{}", waiting.reason);
        h.register(&america).await.unwrap();
        let placed = h.broker.job_for(&tenant, &job.id).await.unwrap();
        assert_eq!(placed.state, JobState::Placed, "{}", placed.reason);
        assert_eq!(placed.node_id.as_deref(), Some(america.id.as_str()));
        spec.placement_policy = Some("package placement\ndeny contains if {".into());
        let e = h.broker.submit(&tenant, spec).await.unwrap_err();
        assert!(matches!(e, BrokerError::PlacementPolicy(_)), "{e}");
    }
}
