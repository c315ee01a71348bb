//! Jobs: submission (the tenant, its resources, its budget and its placement policy checked;
//! stored pending or placed at once), what a tenant or an auditor sees of a job, cancellation,
//! and state changes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use cgx_policies::placement::PlacementPolicy;
use cgx_protocol::broker::{JobSpec, JobView};
use cgx_protocol::money::Micros;
use cgx_service::auth::Admin;

use super::error::BrokerError;
use super::index::{self, Requirements};
use super::store::{JobRow, JobState, JobWrite, Outcome};
use super::{Broker, MAX_LIST, auditor, random_id, register};

/// How long a tenant's placement policy may take to compile (64 KiB at most).
const POLICY_COMPILE_TIME: Duration = Duration::from_secs(2);

/// Refuse a placement policy that reads a money field of before (`input.node.price_per_gpu_hour`,
/// `input.job.max_price_per_gpu_hour`, `input.job.budget`): each is undefined now, and a `deny`
/// rule over an undefined value never fires — the policy would let through every node it was
/// written to keep out. A field access is the name after `.` or `"` and not followed by more
/// of an identifier (`_micros`), so prose and today's names pass.
fn retired_policy_input(text: &str) -> Result<(), BrokerError> {
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    for (old, new) in cgx_protocol::money::RETIRED_FLOAT_FIELDS {
        let reads_old = text.match_indices(old).any(|(i, _)| {
            let before = i.checked_sub(1).map(|j| text.as_bytes()[j]);
            let after = text.as_bytes().get(i + old.len()).copied();
            matches!(before, Some(b'.' | b'"')) && !after.is_some_and(ident)
        });
        if reads_old {
            return Err(BrokerError::PlacementPolicy(format!(
                "the policy reads {old}, which is no longer given: read {new}, an integer of micros (10^-6 of the currency unit)"
            )));
        }
    }
    Ok(())
}

/// The tenant a caller acts for: `wanted` if its token has that scope, else its only tenant.
pub(super) fn tenant_of(admin: &Admin, wanted: Option<&str>) -> Result<String, BrokerError> {
    if let Some(t) = wanted {
        register::check_name(t, "tenant")?;
        admin.may(Some(&format!("tenant:{t}")))?;
        return Ok(t.to_string());
    }
    let tenants: Vec<&str> = admin
        .scopes()
        .iter()
        .filter_map(|s| s.strip_prefix("tenant:"))
        .collect();
    match tenants.as_slice() {
        [one] => Ok(one.to_string()),
        [] => Err(BrokerError::Forbidden(
            "this token names no tenant (scope tenant:<name>)".into(),
        )),
        _ => Err(BrokerError::BadRequest(
            "this token names several tenants: say which (tenant)".into(),
        )),
    }
}

/// A sample node a placement policy is evaluated on at submission.
fn probe_input(spec: &JobSpec) -> serde_json::Value {
    serde_json::json!({
        "node": {
            "id": "n-probe", "operator": "op", "region": "region", "tee": "snp", "sim": false,
            "gpu_model": spec.gpu_model, "gpu_chip": "GH100", "gpu_count": spec.gpu_count,
            "gpu_memory_gib": 80, "price_per_gpu_hour_micros": 1_000_000, "reputation": 0,
            "claims": {"cpu": {"kind": "snp", "sim": false, "debug": false}, "gpus": []},
        },
        "job": spec,
    })
}

/// Every resource is `repository/type/tag` in `tenant`'s own repository: a lease releases
/// keys, only the tenant's own (its KBS repository is its name). Checked at submission and
/// again before every lease is signed.
pub(super) fn owned_resources(tenant: &str, resources: &[String]) -> Result<(), BrokerError> {
    for r in resources {
        let parts: Vec<&str> = r.split('/').collect();
        if parts.len() != 3
            || parts
                .iter()
                .any(|p| register::check_name(p, "resource").is_err())
        {
            return Err(BrokerError::BadRequest(format!(
                "resource '{r}' is not repository/type/tag"
            )));
        }
        if parts[0] != tenant {
            return Err(BrokerError::Forbidden(format!(
                "resource '{r}' is not tenant {tenant}'s (repository {tenant})"
            )));
        }
    }
    Ok(())
}

impl Broker {
    /// A job's requirements with its placement policy compiled (cached per job): the policy
    /// is compiled and tried once on a sample node off the async threads, under the limits
    /// `cgx-policies` puts on a tenant's code; an error refuses the job.
    pub(super) async fn requirements(
        &self,
        job_id: &str,
        tenant: &str,
        spec: &JobSpec,
    ) -> Result<Requirements, BrokerError> {
        let mut req = self.cheap_requirements(tenant, spec)?;
        let Some(text) = &spec.placement_policy else {
            return Ok(req);
        };
        let cached = self
            .policies
            .lock()
            .ok()
            .and_then(|p| p.get(job_id).cloned());
        let policy = match cached {
            Some(p) => p,
            None => {
                if text.len() > 64 << 10 {
                    return Err(BrokerError::PlacementPolicy("larger than 64 KiB".into()));
                }
                let text = text.clone();
                // Compiled (the builtin allow-list and literal checks of `cgx-policies`'
                // limits; a closed program is folded, that is evaluated, while compiling) on the
                // policy sandbox's threads, whose deep stacks a chain of rules cannot overflow…
                let p = cgx_policies::sandbox::Sandbox::global()
                    .submit(POLICY_COMPILE_TIME, move || PlacementPolicy::compile(&text))
                    .await
                    .map_err(|e| match e {
                        cgx_policies::Error::Busy => BrokerError::Unavailable(
                            "the placement policy evaluators are busy; try again".into(),
                        ),
                        e => BrokerError::PlacementPolicy(e.to_string()),
                    })?;
                let p = Arc::new(p);
                // …and evaluated once on a sample node in the sandbox: a policy that cannot
                // evaluate, or hits a limit, is refused now, not left pending for ever. A
                // sandbox without room is the service's state, not the policy's fault.
                p.refusals_off_thread(probe_input(spec))
                    .await
                    .map_err(|e| match e {
                        cgx_policies::Error::Busy => BrokerError::Unavailable(
                            "the placement policy evaluators are busy; try again".into(),
                        ),
                        e => BrokerError::PlacementPolicy(e.to_string()),
                    })?;
                if let Ok(mut c) = self.policies.lock() {
                    if c.len() > 10_000 {
                        c.clear();
                    }
                    c.insert(job_id.to_string(), p.clone());
                }
                p
            }
        };
        req.policy = Some(policy);
        Ok(req)
    }

    /// Parse and check a job's requirements, its policy not compiled (a status read; the
    /// first step of [`Broker::requirements`]).
    pub(super) fn cheap_requirements(
        &self,
        tenant: &str,
        spec: &JobSpec,
    ) -> Result<Requirements, BrokerError> {
        let bad = |m: String| Err(BrokerError::BadRequest(m));
        // At submission, and for a job stored before integer money (its policy fails the job
        // with this reason rather than let through what it was written to keep out).
        if let Some(text) = &spec.placement_policy {
            retired_policy_input(text)?;
        }
        register::check_name(&spec.gpu_model, "gpu_model")?;
        if spec.gpu_count == 0 || spec.gpu_count > index::MAX_GPUS {
            return bad(format!("gpu_count must be 1 to {}", index::MAX_GPUS));
        }
        let tee = spec.tee.clone();
        if spec.regions.len() > 32 {
            return bad("at most 32 regions".into());
        }
        for r in &spec.regions {
            register::check_name(r, "region")?;
        }
        let max_price = spec.max_price_per_gpu_hour_micros;
        if !max_price.in_range() {
            return bad(format!(
                "max_price_per_gpu_hour_micros must be at most {} (10^9 units)",
                Micros::MAX.get()
            ));
        }
        if spec
            .placement_policy
            .as_ref()
            .is_some_and(|t| t.len() > 64 << 10)
        {
            return Err(BrokerError::PlacementPolicy("larger than 64 KiB".into()));
        }
        Ok(Requirements {
            tenant: tenant.to_string(),
            gpu_model: spec.gpu_model.clone(),
            gpu_count: spec.gpu_count,
            min_gpu_memory_gib: spec.min_gpu_memory_gib,
            tee,
            regions: spec.regions.clone(),
            max_price,
            policy: None,
            has_policy: spec.placement_policy.is_some(),
            // The policy's `input.job`: the spec without the policy's own text (up to 64 KiB,
            // copied into every candidate's input otherwise).
            spec: Arc::new(
                serde_json::to_value(JobSpec {
                    placement_policy: None,
                    ..spec.clone()
                })
                .unwrap_or_default(),
            ),
        })
    }

    /// Submit a job for `admin`'s tenant: checked, stored pending, placed at once if a node fits.
    pub(crate) async fn submit(
        &self,
        admin: &Admin,
        spec: JobSpec,
    ) -> Result<JobView, BrokerError> {
        let tenant = tenant_of(admin, spec.tenant.as_deref())?;
        if spec.duration_secs == 0 || spec.duration_secs > 30 * 86_400 {
            return Err(BrokerError::BadRequest(
                "duration_secs must be 1 to 2592000 (30 days)".into(),
            ));
        }
        if spec.resources.len() > 32 {
            return Err(BrokerError::BadRequest("at most 32 resources".into()));
        }
        owned_resources(&tenant, &spec.resources)?;
        if let Some(w) = &spec.workload {
            w.check(&spec.resources)
                .map_err(|e| BrokerError::BadRequest(e.to_string()))?;
        }
        let id = random_id("j")?;
        let req = self.requirements(&id, &tenant, &spec).await?;
        let budget = spec.budget_micros;
        if !budget.in_range() {
            return Err(BrokerError::BadRequest(format!(
                "budget_micros must be at most {} (10^9 units)",
                Micros::MAX.get()
            )));
        }
        // Bounded above (price, GPUs, duration), so never past u128.
        let needed =
            cgx_protocol::money::max_cost(req.max_price, spec.gpu_count, spec.duration_secs)
                .unwrap_or(u128::MAX);
        if u128::from(budget.get()) < needed {
            // Shown exactly, as `Micros` shows amounts (`needed` may pass u64: 10^15 × 64 × 30 days).
            let per = u128::from(Micros::PER_UNIT);
            let needed = format!("{}.{:06}", needed / per, needed % per);
            return Err(BrokerError::Budget(format!(
                "a budget of {budget} does not cover {} GPUs × {} s at up to {max} per GPU-hour ({needed})",
                spec.gpu_count,
                spec.duration_secs,
                max = req.max_price,
            )));
        }
        // The budget is held in escrow while the job runs: the tenant's balance must cover it
        // now (placement reserves it; a tenant's concurrent jobs are checked there again).
        let account = cgx_ledger::AccountId::new(cgx_ledger::Role::Tenant, &tenant)
            .map_err(|e| BrokerError::BadRequest(e.to_string()))?;
        let available = self.store.account(&account).await?.available();
        if available < i128::from(budget.get()) {
            return Err(BrokerError::Funds(format!(
                "tenant {tenant} has {} available; the job's budget is {budget}: deposit the difference first",
                Micros(u64::try_from(available.max(0)).unwrap_or(u64::MAX)),
            )));
        }
        let now = self.clock.unix();
        let spec = JobSpec {
            tenant: Some(tenant.clone()),
            ..spec
        };
        let spec_text =
            serde_json::to_string(&spec).map_err(|e| BrokerError::Internal(e.to_string()))?;
        let row = JobRow {
            seal: self.keys.seal_job(&id, &tenant, &spec_text, now),
            id: id.clone(),
            tenant,
            spec: spec_text,
            state: JobState::Pending,
            reason: "submitted".into(),
            node_id: None,
            lease_id: None,
            created_at: now,
            updated_at: now,
        };
        self.metrics.event("job", "submitted");
        let (placed, verdicts) = self.place_job(&row, Some(req.clone()), true).await?;
        let mut events = vec![cgx_protocol::broker::JobEvent {
            at: now,
            from: None,
            to: JobState::Pending,
            reason: row.reason.clone(),
        }];
        let (state_now, reason, node_id, lease_id, gpus) = match placed {
            Some(p) => {
                events.push(cgx_protocol::broker::JobEvent {
                    at: p.started_at,
                    from: Some(JobState::Pending),
                    to: JobState::Placed,
                    reason: p.reason.clone(),
                });
                (
                    JobState::Placed,
                    p.reason,
                    Some(p.node_id),
                    Some(p.lease_id),
                    p.gpus,
                )
            }
            None => {
                self.pending
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let why = self.index().why_none(&req, now, &verdicts);
                (
                    JobState::Pending,
                    format!("submitted; {why}"),
                    None,
                    None,
                    Vec::new(),
                )
            }
        };
        // Built from what was just committed: no read back.
        Ok(JobView {
            metered_windows: 0,
            id,
            tenant: row.tenant,
            state: state_now,
            reason,
            spec,
            node_id,
            lease_id,
            gpus,
            created_at: now,
            updated_at: now,
            events,
        })
    }

    pub(crate) async fn job_view_by_id(&self, id: &str) -> Result<JobView, BrokerError> {
        let row = self
            .store
            .job(id)
            .await?
            .ok_or_else(|| BrokerError::NotFound(format!("job {id}")))?;
        self.job_view(row, true).await
    }

    pub(super) async fn job_view(&self, row: JobRow, events: bool) -> Result<JobView, BrokerError> {
        let spec = JobSpec::from_stored(&row.spec)
            .map_err(|e| BrokerError::Internal(format!("stored job spec: {e}")))?;
        let mut reason = row.reason.clone();
        // Why a job waits is worked out for one job's status only, not for a listing.
        // The policy is not run for a read: nodes passing every other filter are counted.
        if events
            && row.state == JobState::Pending
            && let Ok(req) = self.cheap_requirements(&row.tenant, &spec)
        {
            reason = format!(
                "{reason}; {}",
                self.index()
                    .why_none(&req, self.clock.unix(), &HashMap::new())
            );
        }
        let gpus = match &row.lease_id {
            Some(_) if !row.state.is_final() && row.state != JobState::Pending => self
                .store
                .open_leases(row.node_id.as_deref())
                .await?
                .into_iter()
                .find(|l| Some(&l.id) == row.lease_id.as_ref())
                .map(|l| l.gpus)
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        let metered_windows = match (&row.lease_id, events) {
            (Some(l), true) => self.store.metering_count(l).await?,
            _ => 0,
        };
        Ok(JobView {
            metered_windows,
            events: if events {
                self.store.events(&row.id).await?
            } else {
                Vec::new()
            },
            id: row.id,
            tenant: row.tenant,
            state: row.state,
            reason,
            spec,
            node_id: row.node_id,
            lease_id: row.lease_id,
            gpus,
            created_at: row.created_at,
            updated_at: row.updated_at,
        })
    }

    /// A job `admin` may see (its tenant's, or an auditor's).
    pub(crate) async fn job_for(&self, admin: &Admin, id: &str) -> Result<JobView, BrokerError> {
        let view = self.job_view_by_id(id).await?;
        if auditor(admin) || admin.may(Some(&format!("tenant:{}", view.tenant))).is_ok() {
            Ok(view)
        } else {
            Err(BrokerError::NotFound(format!("job {id}")))
        }
    }

    pub(crate) async fn jobs(
        &self,
        admin: &Admin,
        tenant: Option<&str>,
    ) -> Result<Vec<JobView>, BrokerError> {
        let rows = if auditor(admin) {
            if let Some(t) = tenant {
                register::check_name(t, "tenant")?;
            }
            self.store.jobs(tenant, MAX_LIST).await?
        } else {
            let t = tenant_of(admin, tenant)?;
            self.store.jobs(Some(&t), MAX_LIST).await?
        };
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            out.push(self.job_view(r, false).await?);
        }
        Ok(out)
    }

    /// Cancel a job: its lease ends (no renewal) and its GPUs are free at once.
    /// A job row `admin` may see (one read; others' jobs are "not found").
    pub(super) async fn job_row_for(&self, admin: &Admin, id: &str) -> Result<JobRow, BrokerError> {
        let row = self
            .store
            .job(id)
            .await?
            .ok_or_else(|| BrokerError::NotFound(format!("job {id}")))?;
        if auditor(admin) || admin.may(Some(&format!("tenant:{}", row.tenant))).is_ok() {
            Ok(row)
        } else {
            Err(BrokerError::NotFound(format!("job {id}")))
        }
    }

    pub(crate) async fn cancel(&self, admin: &Admin, id: &str) -> Result<JobView, BrokerError> {
        let row = self.job_row_for(admin, id).await?;
        // Auditors read every job; only the job's tenant (or `*`) cancels it.
        if admin.may(Some(&format!("tenant:{}", row.tenant))).is_err() {
            return Err(BrokerError::Forbidden(format!(
                "only tenant {} cancels job {id}",
                row.tenant
            )));
        }
        if row.state.is_final() {
            return Err(BrokerError::Conflict(format!(
                "job {id} is already {}",
                row.state
            )));
        }
        let reason = format!("cancelled by {}", admin.actor());
        let done = match &row.lease_id {
            Some(lease) if row.state != JobState::Pending => self
                .end_lease(
                    lease,
                    &[JobState::Placed, JobState::Running],
                    JobState::Cancelled,
                    &reason,
                )
                .await?
                .is_some(),
            _ => {
                let moved = self
                    .transition(id, &[JobState::Pending], JobState::Cancelled, &reason)
                    .await?;
                if moved {
                    self.pending
                        .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                }
                moved
            }
        };
        if !done {
            return Err(BrokerError::Conflict(format!(
                "job {id} changed meanwhile; see its status"
            )));
        }
        self.metrics.event("job", "cancelled");
        self.place_pending().await;
        let now = self.clock.unix();
        let spec = JobSpec::from_stored(&row.spec)
            .map_err(|e| BrokerError::Internal(format!("stored job spec: {e}")))?;
        Ok(JobView {
            metered_windows: 0,
            id: row.id,
            tenant: row.tenant,
            state: JobState::Cancelled,
            reason,
            spec,
            node_id: row.node_id,
            lease_id: row.lease_id,
            gpus: Vec::new(),
            created_at: row.created_at,
            updated_at: now,
            events: Vec::new(),
        })
    }

    /// Move a job `from` → `to`; whether it moved.
    pub(super) async fn transition(
        &self,
        job_id: &str,
        from: &'static [JobState],
        to: JobState,
        reason: &str,
    ) -> Result<bool, BrokerError> {
        let out = self
            .store
            .write(JobWrite::Transition {
                job_id: job_id.to_string(),
                from,
                to,
                reason: reason.to_string(),
                now: self.clock.unix(),
            })
            .await?;
        Ok(matches!(out, Outcome::Done))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    #[test]
    pub(super) fn placement_policies_reading_the_float_price_are_refused() {
        let old = "package placement\ndeny contains \"dear\" if input.node.price_per_gpu_hour > 2";
        let e = super::retired_policy_input(old).unwrap_err().to_string();
        assert!(e.contains("read price_per_gpu_hour_micros"), "{e}");
        let job = "package placement\ndeny contains \"x\" if input.job.max_price_per_gpu_hour > 2";
        assert!(super::retired_policy_input(job).is_err());
        let budget = "package placement\ndeny contains \"x\" if input.job[\"budget\"] < 9";
        assert!(super::retired_policy_input(budget).is_err());
        // Prose and today's names pass: a comment about the budget, the _micros fields.
        let prose = "package placement\n# price_per_gpu_hour moved; the budget is in micros\ndeny contains \"x\" if input.job.budget_micros < 9";
        assert!(super::retired_policy_input(prose).is_ok());
        let today = "package placement\ndeny contains \"dear\" if input.node.price_per_gpu_hour_micros > input.job.max_price_per_gpu_hour_micros";
        assert!(super::retired_policy_input(today).is_ok());
    }
}

#[cfg(test)]
mod domain_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::testing::{Harness, OTHER_TENANT, Role, TENANT};
    use super::*;

    /// A job that fits is placed at submission: its lease and GPUs in the answer, its events
    /// stored. It is its tenant's and auditors' to see; to another tenant it does not exist.
    #[tokio::test]
    async fn a_job_is_placed_at_submission_and_seen_by_its_tenant_only() {
        let h = Harness::new("jobs-submit").await;
        let node = h.node(2);
        h.register(&node).await.unwrap();
        let tenant = h.admin(Role::Tenant);
        let job = h
            .broker
            .submit(&tenant, Harness::job(1, 600))
            .await
            .unwrap();
        assert_eq!(job.state, JobState::Placed, "{}", job.reason);
        assert_eq!(job.node_id.as_deref(), Some(node.id.as_str()));
        assert_eq!((job.gpus.len(), job.tenant.as_str()), (1, TENANT));
        let stored = h.broker.job_for(&tenant, &job.id).await.unwrap();
        assert_eq!(stored.state, JobState::Placed);
        let states: Vec<JobState> = stored.events.iter().map(|e| e.to).collect();
        assert_eq!(states, [JobState::Pending, JobState::Placed]);
        let other = h.admin(Role::OtherTenant);
        assert!(matches!(
            h.broker.job_for(&other, &job.id).await,
            Err(BrokerError::NotFound(_))
        ));
        assert!(h.broker.jobs(&other, None).await.unwrap().is_empty());
        assert_eq!(h.broker.jobs(&tenant, None).await.unwrap().len(), 1);
        let all = h.broker.jobs(&h.admin(Role::Auditor), None).await.unwrap();
        assert_eq!(all.len(), 1);
    }

    /// Refused at submission, each with its reason, and nothing stored: a budget short of the
    /// price, another tenant's resource, a tenant the token does not name, no duration.
    #[tokio::test]
    async fn submissions_are_refused_with_their_reason_and_store_nothing() {
        let h = Harness::new("jobs-refuse").await;
        let tenant = h.admin(Role::Tenant);
        let mut short = Harness::job(1, 3600);
        short.budget_micros = Micros(1);
        let e = h.broker.submit(&tenant, short).await.unwrap_err();
        assert!(matches!(e, BrokerError::Budget(_)), "{e}");
        let mut theirs = Harness::job(1, 3600);
        theirs.resources = vec![format!("{OTHER_TENANT}/weights/key")];
        let e = h.broker.submit(&tenant, theirs).await.unwrap_err();
        assert!(matches!(e, BrokerError::Forbidden(_)), "{e}");
        let mut named = Harness::job(1, 3600);
        named.tenant = Some(OTHER_TENANT.into());
        let e = h.broker.submit(&tenant, named).await.unwrap_err();
        assert!(matches!(e, BrokerError::Forbidden(_)), "{e}");
        let mut none = Harness::job(1, 3600);
        none.duration_secs = 0;
        let e = h.broker.submit(&tenant, none).await.unwrap_err();
        assert!(matches!(e, BrokerError::BadRequest(_)), "{e}");
        let auditor = h.admin(Role::Auditor);
        assert!(h.broker.jobs(&auditor, None).await.unwrap().is_empty());
    }

    /// Without a node that fits a job waits, saying why; cancelling a placed job frees its GPUs
    /// at once, and the waiting job takes them. Only the job's tenant cancels it.
    #[tokio::test]
    async fn a_cancelled_job_frees_its_gpus_for_the_next() {
        let h = Harness::new("jobs-cancel").await;
        let node = h.node(2);
        h.register(&node).await.unwrap();
        let tenant = h.admin(Role::Tenant);
        let first = h
            .broker
            .submit(&tenant, Harness::job(2, 600))
            .await
            .unwrap();
        let second = h
            .broker
            .submit(&tenant, Harness::job(2, 600))
            .await
            .unwrap();
        assert_eq!(first.state, JobState::Placed);
        assert_eq!(second.state, JobState::Pending, "{}", second.reason);
        assert!(
            second.reason.starts_with("submitted; "),
            "{}",
            second.reason
        );
        let e = h
            .broker
            .cancel(&h.admin(Role::OtherTenant), &first.id)
            .await
            .unwrap_err();
        assert!(matches!(e, BrokerError::NotFound(_)), "{e}");
        let e = h
            .broker
            .cancel(&h.admin(Role::Auditor), &first.id)
            .await
            .unwrap_err();
        assert!(matches!(e, BrokerError::Forbidden(_)), "{e}");
        let cancelled = h.broker.cancel(&tenant, &first.id).await.unwrap();
        assert_eq!(cancelled.state, JobState::Cancelled);
        let second = h.broker.job_for(&tenant, &second.id).await.unwrap();
        assert_eq!(second.state, JobState::Placed, "{}", second.reason);
        let e = h.broker.cancel(&tenant, &first.id).await.unwrap_err();
        assert!(matches!(e, BrokerError::Conflict(_)), "{e}");
    }
}
