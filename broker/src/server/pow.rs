//! The proof-of-work schedule and its verdicts (issue 31; `cgx_pow`).
//!
//! - **Issue**: at each heartbeat of a placeable node, every GPU of each of its open leases
//!   whose last challenge is older than `[pow] interval_secs` gets a new one (a fresh nonce,
//!   the class's size, two deadlines: the GPU's and the wall clock's); challenges still open
//!   are sent again until answered.
//! - **Answer** (`POST /v1/nodes/{id}/pow/{challenge}`): the receipt under the node's
//!   attested key, for this challenge, by the wall-clock deadline, with the proof whose digest
//!   it signs, is stored; nothing is verified on the request path beyond that.
//! - **Verdict**, off the request path (a task of its own, the CPU work on the blocking pool):
//!   the GPU time against the class, the commitment (rows, paths, Cᵢ·r = yᵢ) always, the
//!   product y = A·(B·r) on one answer in `verify_one_in`, drawn after the answer arrived. A
//!   failed proof, or a challenge not answered by its deadline, marks the node: unplaceable for
//!   `penalty_secs`, its leases ended and their jobs re-placed by the monitor's failover, the
//!   reason in `cgx node show`.

use std::sync::Arc;

use cgx_pow::challenge::{Challenge, Params, seed};
use cgx_pow::class::gpu_deadline_ms;
use cgx_pow::proof::Verifier;
use cgx_protocol::broker::{LeaseGrant, PowAccepted, PowChallenge, PowPost, PowReceipt};
use cgx_protocol::records::NodeRecord;

use super::store::{ChallengeRow, Outcome, PowWrite, Refusal};
use super::{Broker, BrokerError, random_id};

/// Answers judged per pass.
const VERDICTS_PER_PASS: i64 = 16;

fn sha256_hex(b: &[u8]) -> String {
    hex::encode(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, b).as_ref())
}

impl Broker {
    /// The challenge size and expected time for a GPU model: `[pow] fixed`, else its class.
    fn pow_size(&self, model: &str) -> Option<(Params, u64)> {
        if let Some(f) = self.config.pow.fixed {
            return Some((Params { n: f.n, k: f.k }, f.expected_ms));
        }
        cgx_pow::class::class(model).map(|c| (c.params, c.expected_ms))
    }

    /// The challenges node `id` is to answer, issuing those its leases' GPUs are due.
    pub(super) async fn pow_challenges(
        &self,
        record: &NodeRecord,
        leases: &[LeaseGrant],
    ) -> Result<Vec<PowChallenge>, BrokerError> {
        let interval = self.config.pow.interval_secs;
        if interval == 0 || leases.is_empty() {
            return Ok(Vec::new());
        }
        let Some((params, expected_ms)) = self.pow_size(&record.gpu_model) else {
            return Ok(Vec::new());
        };
        let now_ms = self.clock.unix_ms();
        let mut open = self.store.pow_open(&record.id, now_ms).await?;
        for g in leases {
            let window_secs = i64::from(g.window_secs.max(1));
            let window = u64::try_from((now_ms / 1000 - g.start).max(0) / window_secs).unwrap_or(0);
            for &gpu in &g.gpus {
                let last = self.store.pow_last_issued(&g.lease_id, gpu).await?;
                if last.is_some_and(|t| now_ms - t < interval.saturating_mul(1000)) {
                    continue;
                }
                let mut nonce = [0u8; 32];
                aws_lc_rs::rand::fill(&mut nonce)
                    .map_err(|_| BrokerError::Internal("random".into()))?;
                let gpu_deadline = gpu_deadline_ms(expected_ms);
                let row = ChallengeRow {
                    id: random_id("p")?,
                    node_id: record.id.clone(),
                    lease_id: g.lease_id.clone(),
                    gpu,
                    window,
                    nonce: hex::encode(nonce),
                    n: params.n,
                    k: params.k,
                    expected_ms,
                    gpu_deadline_ms: gpu_deadline,
                    issued_ms: now_ms,
                    deadline_ms: now_ms.saturating_add(
                        i64::try_from(gpu_deadline.saturating_add(self.config.pow.allowance_ms))
                            .unwrap_or(i64::MAX),
                    ),
                    state: "issued".into(),
                    reason: String::new(),
                    answered_ms: None,
                    gpu_us: None,
                    root: None,
                };
                self.store.write(PowWrite::Issue(row.clone())).await?;
                self.metrics.event("pow", "issued");
                tracing::info!(node = %record.id, lease = %g.lease_id, gpu, challenge = %row.id, n = params.n, "proof-of-work challenge issued");
                open.push(row);
            }
        }
        Ok(open
            .into_iter()
            .map(|c| PowChallenge {
                id: c.id,
                lease: c.lease_id,
                window: c.window,
                gpu: c.gpu,
                nonce: c.nonce,
                n: c.n,
                k: c.k,
                gpu_deadline_ms: c.gpu_deadline_ms,
                deadline_ms: c.deadline_ms,
            })
            .collect())
    }

    /// Node `id`'s answer to challenge `challenge`: stored for its verdict, or refused with
    /// the reason (nothing changes).
    pub(crate) async fn pow_answer(
        &self,
        id: &str,
        challenge: &str,
        post: &PowPost,
    ) -> Result<PowAccepted, BrokerError> {
        let r = self.pow_answer_inner(id, challenge, post).await;
        if let Err(e) = &r {
            tracing::warn!(node = %id, challenge, error = %e, "proof-of-work answer refused");
        }
        r
    }

    async fn pow_answer_inner(
        &self,
        id: &str,
        challenge: &str,
        post: &PowPost,
    ) -> Result<PowAccepted, BrokerError> {
        let now_ms = self.clock.unix_ms();
        let (_, receipt) = self.node_signed::<PowReceipt>(
            id,
            post.receipt.trim(),
            600,
            "a proof-of-work receipt",
            BrokerError::Pow,
        )?;
        if receipt.sub != id || receipt.challenge != challenge {
            return Err(BrokerError::Pow(format!(
                "the receipt is node {}'s for challenge {}, not node {id}'s for {challenge}",
                receipt.sub, receipt.challenge
            )));
        }
        let c = self
            .store
            .pow_challenge(challenge)
            .await?
            .filter(|c| c.node_id == id)
            .ok_or_else(|| BrokerError::NotFound(format!("challenge {challenge} of node {id}")))?;
        if c.state != "issued" {
            return Err(BrokerError::Conflict(format!(
                "challenge {challenge} is already {}",
                c.state
            )));
        }
        if now_ms > c.deadline_ms {
            return Err(BrokerError::Pow(format!(
                "late: answered {} ms after the deadline",
                now_ms - c.deadline_ms
            )));
        }
        let params = Params { n: c.n, k: c.k };
        let max = cgx_pow::wire::max_len(params);
        if post.proof.len() > max.div_ceil(3) * 4 + 4 {
            return Err(BrokerError::Pow(format!(
                "a proof of {} base64 characters; one of n = {}, k = {} takes at most {max} bytes",
                post.proof.len(),
                c.n,
                c.k
            )));
        }
        let proof = cgx_protocol::broker::unb64(post.proof.trim())
            .ok_or_else(|| BrokerError::Pow("the proof is not base64".into()))?;
        if sha256_hex(&proof) != receipt.proof_sha256 {
            return Err(BrokerError::Pow(
                "the proof is not the one the receipt signs (SHA-256 differs)".into(),
            ));
        }
        let write = PowWrite::Answer {
            id: challenge.to_string(),
            node: id.to_string(),
            answered_ms: now_ms,
            gpu_us: i64::try_from(receipt.gpu_us).unwrap_or(i64::MAX),
            root: receipt.root.clone(),
            receipt: post.receipt.trim().to_string(),
            proof,
        };
        match self.store.write(write).await? {
            Outcome::Done => {
                self.metrics.event("pow", "answered");
                Ok(PowAccepted {
                    challenge: challenge.to_string(),
                    state: "answered".into(),
                })
            }
            Outcome::Refused(Refusal::PowNotOpen) => Err(BrokerError::Conflict(format!(
                "challenge {challenge} was answered, or passed its deadline, meanwhile"
            ))),
            other => Err(BrokerError::Internal(format!("pow write: {other:?}"))),
        }
    }

    /// One verifier pass: judge the answers waiting, mark overdue challenges missed. Returns
    /// how many verdicts it gave.
    pub(crate) async fn pow_pass(&self) -> Result<usize, BrokerError> {
        let mut verdicts = 0;
        let now_ms = self.clock.unix_ms();
        for c in self.store.pow_overdue(now_ms).await? {
            let reason = format!(
                "challenge {} (lease {}, GPU {}) not answered by its deadline",
                c.id, c.lease_id, c.gpu
            );
            if self.verdict(&c, "issued", "missed", reason).await? {
                verdicts += 1;
            }
        }
        for (c, receipt, proof) in self.store.pow_answered(VERDICTS_PER_PASS).await? {
            let key = self.node_key(&c.node_id).map(|(_, k)| k);
            let one_in = self.config.pow.verify_one_in;
            let product = {
                let mut b = [0u8; 4];
                aws_lc_rs::rand::fill(&mut b)
                    .map_err(|_| BrokerError::Internal("random".into()))?;
                u32::from_le_bytes(b) % one_in.max(1) == 0
            };
            let row = c.clone();
            let judged = match key {
                Err(_) => Err("the node is no longer registered".to_string()),
                Ok(key) => tokio::task::spawn_blocking(move || {
                    judge(&row, &receipt, &proof, &key, product)
                })
                .await
                .map_err(|_| BrokerError::Internal("the verifier stopped".into()))?,
            };
            let done = match judged {
                Ok(checked) => {
                    tracing::info!(node = %c.node_id, challenge = %c.id, product_checked = checked, "proof of work passed");
                    self.verdict(&c, "answered", "passed", String::new())
                        .await?
                }
                Err(why) => {
                    let reason = format!(
                        "challenge {} (lease {}, GPU {}): {why}",
                        c.id, c.lease_id, c.gpu
                    );
                    self.verdict(&c, "answered", "failed", reason).await?
                }
            };
            if done {
                verdicts += 1;
            }
        }
        Ok(verdicts)
    }

    /// Record a verdict (once: another replica may have given it first); a failure marks the
    /// node here at once (other replicas read it with the node's row).
    async fn verdict(
        &self,
        c: &ChallengeRow,
        from: &'static str,
        state: &'static str,
        reason: String,
    ) -> Result<bool, BrokerError> {
        let at = self.clock.unix();
        let w = PowWrite::Verdict {
            id: c.id.clone(),
            node: c.node_id.clone(),
            from,
            state,
            reason: reason.clone(),
            at,
            now_ms: self.now_ms(),
        };
        match self.store.write(w).await? {
            Outcome::Done => {
                self.metrics.event("pow", state);
                if state != "passed" {
                    tracing::warn!(node = %c.node_id, challenge = %c.id, %reason, "proof of work {state}: the node is unplaceable");
                    self.index().set_pow_failure(&c.node_id, at, &reason);
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

/// The verdict on one answer, on the blocking pool: `Ok(product checked)` or why it fails.
fn judge(
    c: &ChallengeRow,
    receipt: &str,
    proof: &[u8],
    node_key: &[u8; 32],
    product: bool,
) -> Result<bool, String> {
    // The receipt was verified when the answer came; the GPU time is read from it again
    // here, under the key, not from the row.
    let r = cgx_protocol::signed::verify::<PowReceipt>(
        receipt,
        std::slice::from_ref(node_key),
        cgx_protocol::signed::When::Any,
    )
    .map_err(|e| format!("the stored receipt does not verify: {e}"))?
    .body;
    if sha256_hex(proof) != r.proof_sha256 {
        return Err("the stored proof is not the one its receipt signs".into());
    }
    if r.gpu_us > c.gpu_deadline_ms.saturating_mul(1000) {
        return Err(format!(
            "the GPU took {:.1} ms; the class expects {} ms and allows {} ms",
            r.gpu_us as f64 / 1e3,
            c.expected_ms,
            c.gpu_deadline_ms
        ));
    }
    let params = Params { n: c.n, k: c.k };
    let p = cgx_pow::wire::decode(proof, params).map_err(|e| e.to_string())?;
    if hex::encode(p.root) != r.root {
        return Err("the proof's root is not the one the receipt signs".into());
    }
    let nonce = hex::decode(&c.nonce).map_err(|_| "the stored nonce".to_string())?;
    let ch = Challenge {
        seed: seed(&nonce, &c.lease_id, c.window, node_key, c.gpu),
        params,
    };
    let v = Verifier::new(ch).map_err(|e| e.to_string())?;
    v.verify_commitment(&p).map_err(|e| e.to_string())?;
    if product {
        v.verify_product(&p).map_err(|e| e.to_string())?;
    }
    Ok(product)
}

/// The verifier task: a pass every `every`.
pub(super) async fn verifier(broker: Arc<Broker>, every: std::time::Duration) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        if let Err(e) = broker.pow_pass().await {
            tracing::warn!(error = %e, "proof-of-work pass deferred");
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::index;
    use super::super::testing::{Harness, Role, SimNode};
    use super::*;
    use cgx_pow::Backend;
    use cgx_pow::backend::{Cpu, SkipRows};
    use cgx_protocol::signed::Signer;

    /// `node`'s answer to `c` by `backend`, its receipt and proof passed through `edit`.
    fn answer(
        node: &SimNode,
        c: &PowChallenge,
        backend: &dyn Backend,
        now: i64,
        edit: impl FnOnce(&mut PowReceipt, &mut Vec<u8>),
    ) -> PowPost {
        use base64::Engine as _;
        let signer = Signer::from_pkcs8(&node.node_key).unwrap();
        let ch = Challenge {
            seed: seed(
                &hex::decode(&c.nonce).unwrap(),
                &c.lease,
                c.window,
                &signer.public_key(),
                c.gpu,
            ),
            params: Params { n: c.n, k: c.k },
        };
        let (proof, ms) = backend.prove(&ch).unwrap();
        let mut bytes = cgx_pow::wire::encode(&proof);
        let mut receipt = PowReceipt {
            sub: node.id.clone(),
            challenge: c.id.clone(),
            root: hex::encode(proof.root),
            proof_sha256: sha256_hex(&bytes),
            gpu_us: (ms * 1e3) as u64,
            backend: backend.name(),
        };
        edit(&mut receipt, &mut bytes);
        PowPost {
            receipt: signer.sign(&receipt, now, now + 300).unwrap(),
            proof: base64::engine::general_purpose::STANDARD.encode(&bytes),
        }
    }

    /// The provider's loop through the broker: a placed node's heartbeat carries a challenge
    /// for its leased GPU; an honest answer is stored, judged off the request path and passes;
    /// each bad answer is refused with its reason and changes nothing; a node that skips rows
    /// is caught, made unplaceable with the reason, and its job moves (failover); a challenge
    /// left unanswered past its deadline counts as failed.
    #[tokio::test]
    async fn honest_proofs_pass_bad_answers_are_refused_and_a_cheat_loses_its_lease() {
        let h = Harness::new("pow").await;
        let (x, y, z) = (h.node(1), h.node(1), h.node(1));
        for n in [&x, &y, &z] {
            h.register(n).await.unwrap();
        }
        let tenant = h.admin(Role::Tenant);
        let job = h
            .broker
            .submit(&tenant, Harness::job(1, 3600))
            .await
            .unwrap();
        let node_of = |id: &str| [&x, &y, &z].into_iter().find(|n| n.id == id).unwrap();
        let honest = node_of(job.node_id.as_deref().unwrap());
        let a = h.heartbeat(honest).await.unwrap();
        assert_eq!(a.challenges.len(), 1, "one challenge per leased GPU");
        let c = a.challenges[0].clone();
        assert_eq!(
            (c.n, c.k, c.lease.as_str()),
            (64, 16, job.lease_id.as_deref().unwrap())
        );
        // Sent again until answered, not issued twice.
        assert_eq!(
            h.heartbeat(honest).await.unwrap().challenges,
            vec![c.clone()]
        );
        let now = h.now();
        let cpu = Cpu { threads: 1 };
        let other = node_of(if honest.id == x.id { &y.id } else { &x.id });
        // Refused before anything is stored, each with its reason.
        let refusals: Vec<(PowPost, &str, &str)> = vec![
            (
                answer(other, &c, &cpu, now, |_, _| {}),
                &honest.id,
                "not signed by node",
            ),
            (
                answer(honest, &c, &cpu, now, |r, _| r.challenge = "pother".into()),
                &honest.id,
                "for challenge pother",
            ),
            (
                answer(honest, &c, &cpu, now, |_, b| b[100] ^= 1),
                &honest.id,
                "not the one the receipt signs",
            ),
            (
                answer(honest, &c, &cpu, now, |_, b| b.extend(vec![0; 1 << 20])),
                &honest.id,
                "takes at most",
            ),
        ];
        for (post, id, why) in refusals {
            let e = h
                .broker
                .pow_answer(id, &c.id, &post)
                .await
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{why}: {e}");
        }
        let e = h
            .broker
            .pow_answer(
                &honest.id,
                "pnone",
                &answer(honest, &c, &cpu, now, |r, _| r.challenge = "pnone".into()),
            )
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("challenge pnone of node"), "{e}");
        assert_eq!(
            h.broker
                .store
                .pow_challenge(&c.id)
                .await
                .unwrap()
                .unwrap()
                .state,
            "issued"
        );
        // The honest answer: stored, then judged by the verifier's pass.
        let post = answer(honest, &c, &cpu, now, |_, _| {});
        let ok = h.broker.pow_answer(&honest.id, &c.id, &post).await.unwrap();
        assert_eq!(ok.state, "answered");
        let e = h
            .broker
            .pow_answer(&honest.id, &c.id, &post)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("already answered"), "{e}");
        assert_eq!(h.broker.pow_pass().await.unwrap(), 1);
        let row = h.broker.store.pow_challenge(&c.id).await.unwrap().unwrap();
        assert_eq!((row.state.as_str(), row.reason.as_str()), ("passed", ""));
        assert!(h.heartbeat(honest).await.unwrap().challenges.is_empty());
        assert_eq!(
            h.broker.index().placeable(&honest.id, h.now()),
            Some(Ok(()))
        );

        // A cheat: the second job lands on another node, which skips a tenth of the rows.
        let job2 = h
            .broker
            .submit(&tenant, Harness::job(1, 3600))
            .await
            .unwrap();
        let cheat = node_of(job2.node_id.as_deref().unwrap());
        assert_ne!(cheat.id, honest.id);
        let c2 = h.heartbeat(cheat).await.unwrap().challenges[0].clone();
        let skip = SkipRows {
            threads: 1,
            percent: 10,
        };
        let post = answer(cheat, &c2, &skip, h.now(), |_, _| {});
        h.broker.pow_answer(&cheat.id, &c2.id, &post).await.unwrap();
        assert_eq!(h.broker.pow_pass().await.unwrap(), 1);
        let row = h.broker.store.pow_challenge(&c2.id).await.unwrap().unwrap();
        assert_eq!(row.state, "failed");
        assert!(
            row.reason.contains("y disagrees with A·(B·r)"),
            "{}",
            row.reason
        );
        match h.broker.index().placeable(&cheat.id, h.now()) {
            Some(Err(index::Unplaceable::ProofFailed { reason, .. })) => {
                assert!(reason.contains(&c2.id), "{reason}")
            }
            other => panic!("the cheat stays placeable: {other:?}"),
        }
        // The monitor's failover ends its lease; the job is placed again elsewhere.
        h.broker.tick().await.unwrap();
        assert!(
            h.broker
                .store
                .open_leases(Some(&cheat.id))
                .await
                .unwrap()
                .is_empty()
        );
        let moved = h.broker.job_view_by_id(&job2.id).await.unwrap();
        assert_ne!(
            moved.node_id.as_deref(),
            Some(cheat.id.as_str()),
            "{moved:?}"
        );
        let hb = h.heartbeat(cheat).await.unwrap();
        assert!(hb.unplaceable.unwrap().contains("proof of work failed"));

        // A challenge not answered by its deadline: missed, and the node unplaceable.
        let third = node_of(moved.node_id.as_deref().unwrap());
        let c3 = h.heartbeat(third).await.unwrap().challenges[0].clone();
        h.clock.set(h.now() + 10);
        assert_eq!(h.broker.pow_pass().await.unwrap(), 1);
        let row = h.broker.store.pow_challenge(&c3.id).await.unwrap().unwrap();
        assert_eq!(row.state, "missed");
        let late = answer(third, &c3, &cpu, h.now(), |_, _| {});
        let e = h
            .broker
            .pow_answer(&third.id, &c3.id, &late)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("already missed"), "{e}");
        assert!(matches!(
            h.broker.index().placeable(&third.id, h.now()),
            Some(Err(index::Unplaceable::ProofFailed { .. }))
        ));
    }
}
