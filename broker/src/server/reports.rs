//! Workload reports: a node says, under its attested key, what became of a lease's workload,
//! and the job follows — `running` once it started, `completed` on exit status 0, `failed`
//! with the node's reason otherwise. A report ends the lease it finishes (its GPUs are free).
//!
//! Only a report of the node's own open lease moves a job, and only forward: a replayed
//! `running` after `completed` changes nothing, and a report for a lease that ended answers
//! the job's state without touching it.

use cgx_protocol::broker::ReportAnswer;
use cgx_protocol::records::{WorkloadReport, WorkloadState};

use super::Broker;
use super::error::BrokerError;
use super::store::JobState;

impl Broker {
    /// Apply node `id`'s signed workload report `token`.
    pub(crate) async fn report(&self, id: &str, token: &str) -> Result<ReportAnswer, BrokerError> {
        let (_, report) = self.node_signed::<WorkloadReport>(
            id,
            token,
            2 * cgx_protocol::records::WORKLOAD_REPORT_TTL_SECS,
            "not a workload report of node",
            BrokerError::Report,
        )?;
        if report.sub != id {
            return Err(BrokerError::Report(format!(
                "the report is node {}'s, not node {id}'s",
                report.sub
            )));
        }
        if report.reason.len() > WorkloadReport::MAX_REASON {
            return Err(BrokerError::BadRequest(format!(
                "the reason takes {} bytes; at most {}",
                report.reason.len(),
                WorkloadReport::MAX_REASON
            )));
        }
        let job = self
            .store
            .job(&report.job)
            .await?
            .ok_or_else(|| BrokerError::NotFound(format!("job {}", report.job)))?;
        // The lease must be this node's open lease for that job, signed by this broker: the
        // row alone proves nothing.
        let open = self.store.open_leases(Some(id)).await?;
        let Some(row) = open.iter().find(|l| l.id == report.lease) else {
            // Ended already (completed, cancelled, failed over): the job stays as it is.
            if job.lease_id.as_deref() == Some(report.lease.as_str()) && job.state.is_final() {
                return Ok(ReportAnswer {
                    job_id: job.id,
                    state: job.state,
                });
            }
            return Err(BrokerError::Conflict(format!(
                "lease {} is not an open lease of node {id}",
                report.lease
            )));
        };
        if row.job_id != report.job || self.keys.lease_of(row).is_none() {
            return Err(BrokerError::Conflict(format!(
                "lease {} is not job {}'s lease from this broker",
                report.lease, report.job
            )));
        }
        let reason = format!("node {id}: {}", report.reason);
        // The job's state after: what this report moved it to, or what it was (a replay, or a
        // job already past what the report says).
        let state = match report.state {
            WorkloadState::Running => {
                let moved = self
                    .transition(&report.job, &[JobState::Placed], JobState::Running, &reason)
                    .await?;
                if moved {
                    tracing::info!(job = %report.job, node = %id, "job running");
                    JobState::Running
                } else {
                    job.state
                }
            }
            WorkloadState::Completed | WorkloadState::Failed => {
                let to = if report.state == WorkloadState::Completed {
                    JobState::Completed
                } else {
                    JobState::Failed
                };
                let ended = self
                    .end_lease(
                        &report.lease,
                        &[JobState::Placed, JobState::Running],
                        to,
                        &reason,
                    )
                    .await?;
                if ended.is_some() {
                    self.metrics.event("job", to.as_str());
                    tracing::info!(job = %report.job, node = %id, state = %to, exit_code = ?report.exit_code, "workload ended");
                    to
                } else {
                    job.state
                }
            }
        };
        Ok(ReportAnswer {
            job_id: report.job,
            state,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::testing::{Harness, Role};
    use super::*;

    /// The job follows its node's reports: placed → running → completed (the lease ends, the
    /// GPUs are free); a replayed `running` after that changes nothing; a report of an ended
    /// lease answers the job's state.
    #[tokio::test]
    async fn the_job_follows_its_nodes_reports_and_completion_frees_the_gpus() {
        let h = Harness::new("reports-complete").await;
        let node = h.node(1);
        h.register(&node).await.unwrap();
        let tenant = h.admin(Role::Tenant);
        let job = h
            .broker
            .submit(&tenant, Harness::job(1, 600))
            .await
            .unwrap();
        let lease = job.lease_id.clone().unwrap();
        let running = node.report_token(&lease, &job.id, WorkloadState::Running, None, h.now());
        let a = h.broker.report(&node.id, &running).await.unwrap();
        assert_eq!(a.state, JobState::Running);
        assert_eq!(h.broker.node_view(&node.id, false).unwrap().free_gpus, 0);
        let done = node.report_token(&lease, &job.id, WorkloadState::Completed, Some(0), h.now());
        assert_eq!(
            h.broker.report(&node.id, &done).await.unwrap().state,
            JobState::Completed
        );
        assert_eq!(h.broker.node_view(&node.id, false).unwrap().free_gpus, 1);
        // Replays of either report leave the job completed.
        for t in [&running, &done] {
            assert_eq!(
                h.broker.report(&node.id, t).await.unwrap().state,
                JobState::Completed
            );
        }
        let view = h.broker.job_for(&tenant, &job.id).await.unwrap();
        assert_eq!(view.state, JobState::Completed);
        assert!(
            view.reason.contains("workload completed"),
            "{}",
            view.reason
        );
    }

    /// A failed workload fails its job with the node's reason and ends the lease.
    #[tokio::test]
    async fn a_failed_workload_fails_its_job_with_the_reason() {
        let h = Harness::new("reports-fail").await;
        let node = h.node(1);
        h.register(&node).await.unwrap();
        let tenant = h.admin(Role::Tenant);
        let job = h
            .broker
            .submit(&tenant, Harness::job(1, 600))
            .await
            .unwrap();
        let lease = job.lease_id.clone().unwrap();
        let failed = node.report_token(&lease, &job.id, WorkloadState::Failed, Some(3), h.now());
        assert_eq!(
            h.broker.report(&node.id, &failed).await.unwrap().state,
            JobState::Failed
        );
        let view = h.broker.job_for(&tenant, &job.id).await.unwrap();
        assert_eq!(view.state, JobState::Failed);
        assert!(view.reason.contains(&node.id) && view.reason.contains("workload failed"));
        assert_eq!(h.broker.node_view(&node.id, false).unwrap().free_gpus, 1);
    }

    /// Refused, each with its reason, and nothing moves: another node's report of this
    /// node's lease, a report under another node's key, a heartbeat presented as a report, a
    /// report of a lease that is not the node's, a stale report, an unknown node.
    #[tokio::test]
    async fn reports_not_of_the_nodes_own_lease_are_refused() {
        let h = Harness::new("reports-refused").await;
        let (node, other) = (h.node(2), h.node(1));
        h.register(&node).await.unwrap();
        let tenant = h.admin(Role::Tenant);
        let job = h
            .broker
            .submit(&tenant, Harness::job(1, 600))
            .await
            .unwrap();
        // A second job of the same tenant on the same node (its other GPU).
        let second = h
            .broker
            .submit(&tenant, Harness::job(1, 600))
            .await
            .unwrap();
        assert_eq!(second.node_id.as_deref(), Some(node.id.as_str()));
        h.register(&other).await.unwrap();
        let lease = job.lease_id.clone().unwrap();
        let now = h.now();
        let refused = |e: BrokerError, why: &str| {
            assert!(e.to_string().contains(why), "{e} (wanted: {why})");
        };
        // The other node signs a report of this node's lease: its key is not this node's.
        let forged = other.report_token(&lease, &job.id, WorkloadState::Failed, Some(1), now);
        refused(
            h.broker.report(&node.id, &forged).await.unwrap_err(),
            "not signed by node",
        );
        // ... and under its own id, the lease is not its own.
        refused(
            h.broker.report(&other.id, &forged).await.unwrap_err(),
            "not an open lease of node",
        );
        // A heartbeat is not a report.
        refused(
            h.broker
                .report(&node.id, &node.heartbeat_token(now))
                .await
                .unwrap_err(),
            "not a workload report",
        );
        // The node's own lease, but named for its other job: neither job moves.
        let wrong_job = node.report_token(&lease, &second.id, WorkloadState::Failed, None, now);
        refused(
            h.broker.report(&node.id, &wrong_job).await.unwrap_err(),
            &format!("is not job {}'s lease", second.id),
        );
        // A job that does not exist.
        let no_job = node.report_token(&lease, "jnotthisone", WorkloadState::Failed, None, now);
        refused(
            h.broker.report(&node.id, &no_job).await.unwrap_err(),
            "not found",
        );
        // Signed long ago.
        let stale = node.report_token(&lease, &job.id, WorkloadState::Failed, None, now - 3_600);
        refused(
            h.broker.report(&node.id, &stale).await.unwrap_err(),
            "not signed by node",
        );
        refused(
            h.broker.report("nunknown", &forged).await.unwrap_err(),
            "not found",
        );
        let view = h.broker.job_for(&tenant, &job.id).await.unwrap();
        assert_eq!(
            view.state,
            JobState::Placed,
            "nothing moved: {}",
            view.reason
        );
    }
}
