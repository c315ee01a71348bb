//! The proof-of-work schedule and its verdicts (issue 31; `cgx_pow`).
//!
//! - **Issue**: at each heartbeat of a placeable node, every GPU of each of its open leases
//!   whose last challenge is older than `[pow] interval_secs` gets a new one: its nonce and
//!   its seal are MACs under the broker's key (`Keys::pow_mac`), over its id and over every
//!   field it is judged by, so the database can neither predict a nonce nor make or change a
//!   challenge. Challenges not yet committed to are sent again until their deadline.
//! - **Commit** (`POST /v1/nodes/{id}/pow/{challenge}`): the node's receipt under its attested
//!   key names the root of its product's rows and the device time; by the deadline (the GPU's,
//!   plus the allowance), it is stored and answered with the **opening** — a MAC over the
//!   challenge and that root, so it is drawn only once the root is fixed, and every replica
//!   draws the same.
//! - **Proof** (`POST …/proof`): the opened rows and a receipt naming their digest, by the
//!   opening's deadline, are stored; nothing else is verified on the request path.
//! - **Verdict**, off the request path (a task of its own, the CPU work on the blocking pool):
//!   the seal, both receipts, the GPU time against the class, then every opened row's path
//!   and its opened cells recomputed from A and B — O(k·n), on every answer. A failed proof
//!   marks the node at once: unplaceable for `penalty_secs`, its leases ended and their jobs
//!   re-placed by the monitor's failover, the reason in `cgx node show`. A missed deadline or
//!   a GPU slower than its class counts as a miss: the node is marked when more than
//!   `misses_allowed` come in a row on one GPU (a lost packet or a tenant's kernels hogging
//!   the GPU for one challenge do not cost an honest node its leases). A proof withheld once
//!   the opening is known is a failure. Commitments and proofs sent again (their answers
//!   lost) get the same answer: retries are idempotent. The node's key and GPU serials are
//!   sealed into the challenge when it is issued, so a verdict needs neither the index nor
//!   the node still registered.

use std::sync::Arc;

use cgx_pow::challenge::{Challenge, Params, seed};
use cgx_pow::class::gpu_deadline_ms;
use cgx_pow::proof::Verifier;
use cgx_protocol::broker::{
    LeaseGrant, PowAccepted, PowChallenge, PowCommit, PowOpening, PowPost, PowReceipt,
};
use cgx_protocol::records::NodeRecord;

use super::store::{ChallengeRow, Outcome, PowWrite, Refusal, Slash};
use super::{Broker, BrokerError, random_id};

/// Answers judged per pass.
const VERDICTS_PER_PASS: i64 = 16;

fn sha256_hex(b: &[u8]) -> String {
    hex::encode(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, b).as_ref())
}

/// What a verdict says.
enum Verdict {
    Passed,
    /// The proof is wrong: the node is marked at once.
    Failed(String),
    /// The GPU took longer than its class allows: a miss.
    Slow(String),
}

impl Broker {
    /// The challenge size and expected time for a GPU model: `[pow] fixed`, else its class.
    fn pow_size(&self, model: &str) -> Option<(Params, u64)> {
        if let Some(f) = self.config.pow.fixed {
            return Some((Params { n: f.n, k: f.k }, f.expected_ms));
        }
        cgx_pow::class::class(model).map(|c| (c.params, c.expected_ms))
    }

    /// The seal over every field a challenge is judged by.
    fn pow_seal(&self, c: &ChallengeRow) -> String {
        let nums: Vec<[u8; 8]> = [
            u64::from(c.gpu),
            c.window,
            u64::from(c.n),
            u64::from(c.k),
            c.expected_ms,
            c.gpu_deadline_ms,
            c.issued_ms as u64,
            c.deadline_ms as u64,
        ]
        .iter()
        .map(|v| v.to_be_bytes())
        .collect();
        let serials = c.serials.join(",");
        let mut parts: Vec<&[u8]> = vec![
            c.id.as_bytes(),
            c.node_id.as_bytes(),
            c.lease_id.as_bytes(),
            c.nonce.as_bytes(),
            c.node_key.as_bytes(),
            serials.as_bytes(),
        ];
        parts.extend(nums.iter().map(|n| n.as_slice()));
        hex::encode(self.keys.pow_mac(b"seal", &parts))
    }

    /// A challenge row as the broker made it: its seal verifies.
    fn pow_sealed(&self, c: &ChallengeRow) -> Result<(), BrokerError> {
        let want = self.pow_seal(c);
        match (hex::decode(&c.seal), hex::decode(&want)) {
            (Ok(got), Ok(want))
                if aws_lc_rs::constant_time::verify_slices_are_equal(&got, &want).is_ok() =>
            {
                Ok(())
            }
            _ => Err(BrokerError::Internal(format!(
                "challenge {}: its row does not carry the broker's seal",
                c.id
            ))),
        }
    }

    /// The opening of challenge `id` once `root` is committed.
    fn pow_opening(&self, id: &str, root: &str) -> [u8; 32] {
        self.keys
            .pow_mac(b"opening", &[id.as_bytes(), root.as_bytes()])
    }

    /// The challenges node `record` is to answer, issuing those its leases' GPUs are due.
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
        let node_key = cgx_protocol::broker::unb64(&record.node_key)
            .filter(|k| k.len() == 32)
            .map(hex::encode)
            .ok_or_else(|| BrokerError::Internal("stored node key".into()))?;
        let serials = super::index::serials(record);
        let mut open = self.store.pow_open(&record.id, now_ms).await?;
        for g in leases {
            let window_secs = i64::from(g.window_secs.max(1));
            let window = u64::try_from((now_ms / 1000 - g.start).max(0) / window_secs).unwrap_or(0);
            for &gpu in &g.gpus {
                let last = self.store.pow_last_issued(&g.lease_id, gpu).await?;
                if last.is_some_and(|t| now_ms - t < interval.saturating_mul(1000)) {
                    continue;
                }
                let id = random_id("p")?;
                let gpu_deadline = gpu_deadline_ms(expected_ms);
                let mut row = ChallengeRow {
                    nonce: hex::encode(self.keys.pow_mac(b"nonce", &[id.as_bytes()])),
                    id,
                    node_id: record.id.clone(),
                    lease_id: g.lease_id.clone(),
                    gpu,
                    window,
                    n: params.n,
                    k: params.k,
                    expected_ms,
                    gpu_deadline_ms: gpu_deadline,
                    issued_ms: now_ms,
                    deadline_ms: now_ms.saturating_add(
                        i64::try_from(gpu_deadline.saturating_add(self.config.pow.allowance_ms))
                            .unwrap_or(i64::MAX),
                    ),
                    node_key: node_key.clone(),
                    serials: serials.clone(),
                    seal: String::new(),
                    state: "issued".into(),
                    reason: String::new(),
                    committed_ms: None,
                    open_deadline_ms: None,
                    gpu_us: None,
                    root: None,
                    answered_ms: None,
                    proof_sha256: None,
                };
                row.seal = self.pow_seal(&row);
                self.store
                    .write(PowWrite::Issue(Box::new(row.clone())))
                    .await?;
                self.metrics.event("pow", "issued");
                tracing::info!(node = %record.id, lease = %g.lease_id, gpu, challenge = %row.id, n = params.n, "proof-of-work challenge issued");
                open.push(row);
            }
        }
        Ok(open
            .into_iter()
            .filter(|c| self.pow_sealed(c).is_ok())
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

    /// The receipt `token` under node `id`'s attested key, for `challenge`.
    fn pow_receipt(
        &self,
        id: &str,
        challenge: &str,
        token: &str,
    ) -> Result<PowReceipt, BrokerError> {
        let (_, receipt) = self.node_signed::<PowReceipt>(
            id,
            token,
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
        Ok(receipt)
    }

    /// Challenge `challenge` of node `id`, sealed by this broker.
    async fn pow_row(&self, id: &str, challenge: &str) -> Result<ChallengeRow, BrokerError> {
        let c = self
            .store
            .pow_challenge(challenge)
            .await?
            .filter(|c| c.node_id == id)
            .ok_or_else(|| BrokerError::NotFound(format!("challenge {challenge} of node {id}")))?;
        self.pow_sealed(&c)?;
        Ok(c)
    }

    /// Node `id`'s commitment to `challenge`: stored, and answered with the opening.
    pub(crate) async fn pow_commit(
        &self,
        id: &str,
        challenge: &str,
        post: &PowCommit,
    ) -> Result<PowOpening, BrokerError> {
        let r = self.pow_commit_inner(id, challenge, post).await;
        if let Err(e) = &r {
            tracing::warn!(node = %id, challenge, error = %e, "proof-of-work commitment refused");
        }
        r
    }

    async fn pow_commit_inner(
        &self,
        id: &str,
        challenge: &str,
        post: &PowCommit,
    ) -> Result<PowOpening, BrokerError> {
        let now_ms = self.clock.unix_ms();
        let receipt = self.pow_receipt(id, challenge, post.receipt.trim())?;
        if !receipt.proof_sha256.is_empty() {
            return Err(BrokerError::Pow(
                "a commitment names no proof (the proof comes after the opening)".into(),
            ));
        }
        let root_ok = hex::decode(&receipt.root).is_ok_and(|r| r.len() == 32);
        if !root_ok {
            return Err(BrokerError::Pow("the root is not 32 bytes of hex".into()));
        }
        let c = self.pow_row(id, challenge).await?;
        // The same commitment again (its answer was lost): the same opening, so a retry
        // changes nothing.
        if c.state != "issued" && c.root.as_deref() == Some(receipt.root.as_str()) {
            return Ok(PowOpening {
                challenge: challenge.to_string(),
                opening: hex::encode(self.pow_opening(challenge, &receipt.root)),
                deadline_ms: c.open_deadline_ms.unwrap_or(0),
            });
        }
        if c.state != "issued" {
            return Err(BrokerError::Conflict(format!(
                "challenge {challenge} is already {}",
                c.state
            )));
        }
        if now_ms > c.deadline_ms {
            return Err(BrokerError::Pow(format!(
                "late: committed {} ms after the deadline",
                now_ms - c.deadline_ms
            )));
        }
        let open_deadline =
            now_ms.saturating_add(i64::try_from(self.config.pow.allowance_ms).unwrap_or(i64::MAX));
        let write = PowWrite::Commit {
            id: challenge.to_string(),
            node: id.to_string(),
            at_ms: now_ms,
            open_deadline_ms: open_deadline,
            gpu_us: i64::try_from(receipt.gpu_us).unwrap_or(i64::MAX),
            root: receipt.root.clone(),
            receipt: post.receipt.trim().to_string(),
        };
        match self.store.write(write).await? {
            Outcome::Done => {
                self.metrics.event("pow", "committed");
                Ok(PowOpening {
                    challenge: challenge.to_string(),
                    opening: hex::encode(self.pow_opening(challenge, &receipt.root)),
                    deadline_ms: open_deadline,
                })
            }
            Outcome::Refused(Refusal::PowNotOpen) => Err(BrokerError::Conflict(format!(
                "challenge {challenge} was committed to, or passed its deadline, meanwhile"
            ))),
            other => Err(BrokerError::Internal(format!("pow write: {other:?}"))),
        }
    }

    /// Node `id`'s proof for `challenge`: stored for its verdict, or refused with the reason
    /// (nothing changes).
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
        let receipt = self.pow_receipt(id, challenge, post.receipt.trim())?;
        let c = self.pow_row(id, challenge).await?;
        // The same proof again (its answer was lost): taken already.
        if c.proof_sha256.as_deref() == Some(receipt.proof_sha256.as_str()) {
            return Ok(PowAccepted {
                challenge: challenge.to_string(),
                state: c.state,
            });
        }
        if c.state != "committed" {
            return Err(BrokerError::Conflict(format!(
                "challenge {challenge} is {}, not waiting for its proof",
                c.state
            )));
        }
        if c.root.as_deref() != Some(receipt.root.as_str()) {
            return Err(BrokerError::Pow(
                "the receipt names another root than the one committed".into(),
            ));
        }
        if now_ms > c.open_deadline_ms.unwrap_or(0) {
            return Err(BrokerError::Pow(format!(
                "late: the proof came {} ms after the opening's deadline",
                now_ms - c.open_deadline_ms.unwrap_or(0)
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
            at_ms: now_ms,
            proof_sha256: receipt.proof_sha256.clone(),
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

    /// One verifier pass: mark overdue challenges missed, judge the answers waiting. Returns
    /// how many verdicts it gave.
    pub(crate) async fn pow_pass(&self) -> Result<usize, BrokerError> {
        let mut verdicts = 0;
        let now_ms = self.clock.unix_ms();
        for c in self.store.pow_overdue(now_ms).await? {
            // A row without the broker's seal is no challenge: nobody is marked for it.
            if self.pow_sealed(&c).is_err() {
                tracing::error!(challenge = %c.id, "a challenge row without the broker's seal; ignored");
                continue;
            }
            // No commitment in time: a miss. A commitment whose proof never came once the
            // opening was known: withheld — a prover that sends only the proofs its opened
            // cells would pass is a cheat, not a late one (retries are idempotent, so an
            // honest node's lost answer is sent again in time).
            let (from, state, what) = if c.state == "issued" {
                ("issued", "missed", "no commitment by its deadline")
            } else {
                (
                    "committed",
                    "failed",
                    "no proof by the opening's deadline: withheld once the opening was known",
                )
            };
            let reason = format!(
                "challenge {} (lease {}, GPU {}): {what}",
                c.id, c.lease_id, c.gpu
            );
            // A withheld proof fails the challenge, but proves no wrong answer: no slash (a
            // lost answer or a broker restart must not cost an honest operator its stake).
            if self.verdict(&c, from, state, reason, false).await? {
                verdicts += 1;
            }
        }
        for (c, receipt, proof_receipt, proof) in self.store.pow_answered(VERDICTS_PER_PASS).await?
        {
            let key: Option<[u8; 32]> = hex::decode(&c.node_key)
                .ok()
                .and_then(|k| k.try_into().ok());
            // `proven`: the proof itself was checked and is wrong — a cheat, slashed. A
            // failure of the broker's own (its stored key, its verifier) fails the challenge
            // without costing the operator its stake.
            let (verdict, proven) = match (self.pow_sealed(&c), key) {
                (Err(e), _) => {
                    tracing::error!(challenge = %c.id, error = %e, "ignored");
                    continue;
                }
                (Ok(()), None) => (
                    Verdict::Failed("the sealed node key is not 32 bytes".into()),
                    false,
                ),
                (Ok(()), Some(key)) => {
                    let opening = self.pow_opening(&c.id, c.root.as_deref().unwrap_or(""));
                    let row = c.clone();
                    tokio::task::spawn_blocking(move || {
                        judge(&row, &receipt, &proof_receipt, &proof, &key, &opening)
                    })
                    .await
                    .map(|v| (v, true))
                    .unwrap_or_else(|_| {
                        (
                            Verdict::Failed("the verifier stopped on this proof".into()),
                            false,
                        )
                    })
                }
            };
            let (state, reason) = match verdict {
                Verdict::Passed => ("passed", String::new()),
                Verdict::Failed(why) => ("failed", why),
                Verdict::Slow(why) => ("slow", why),
            };
            let reason = if reason.is_empty() {
                reason
            } else {
                format!(
                    "challenge {} (lease {}, GPU {}): {reason}",
                    c.id, c.lease_id, c.gpu
                )
            };
            if self
                .verdict(&c, "answered", state, reason, proven && state == "failed")
                .await?
            {
                verdicts += 1;
            }
        }
        Ok(verdicts)
    }

    /// Record a verdict (once: another replica may have given it first — the same one, since
    /// verdicts are deterministic). A failure marks the node and its GPUs at once; a miss
    /// (`missed`, `slow`) only past `misses_allowed` in a row on the same GPU.
    async fn verdict(
        &self,
        c: &ChallengeRow,
        from: &'static str,
        state: &'static str,
        reason: String,
        cheat: bool,
    ) -> Result<bool, BrokerError> {
        let at = self.clock.unix();
        let mark = match state {
            "passed" => false,
            "failed" => true,
            _ => {
                self.store.pow_missed_in_a_row(&c.node_id, c.gpu).await?
                    >= self.config.pow.misses_allowed
            }
        };
        let serials = if mark { c.serials.clone() } else { Vec::new() };
        // A wrong proof under the node's signature is a proven cheat on the one GPU it
        // covers: the lease's escrow names the operator and tenant the slash moves between.
        let slash = if cheat {
            self.store.escrow(&c.lease_id).await?.map(|e| Slash {
                operator: e.escrow.operator,
                tenant: e.escrow.tenant,
                per_gpu: self.config.ledger.slash_per_gpu_micros,
                gpus: 1,
            })
        } else {
            None
        };
        let w = PowWrite::Verdict {
            id: c.id.clone(),
            node: c.node_id.clone(),
            from,
            state,
            reason: reason.clone(),
            mark,
            serials: serials.clone(),
            at,
            now_ms: self.now_ms(),
            slash,
            cheat,
            half_life: self.config.reputation.half_life_secs,
        };
        match self.store.write(w).await? {
            Outcome::Done => {
                self.metrics.event("pow", state);
                if mark {
                    tracing::warn!(node = %c.node_id, challenge = %c.id, %reason, "proof of work {state}: the node is unplaceable");
                    let mut idx = self.index();
                    idx.set_pow_failure(&c.node_id, at, &reason);
                    for serial in &serials {
                        idx.set_gpu_penalty(serial, at, &reason);
                    }
                } else if state != "passed" {
                    tracing::warn!(node = %c.node_id, challenge = %c.id, %reason, "proof of work {state}");
                } else {
                    tracing::info!(node = %c.node_id, challenge = %c.id, "proof of work passed");
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

/// The verdict on one answer, on the blocking pool.
fn judge(
    c: &ChallengeRow,
    receipt: &str,
    proof_receipt: &str,
    proof: &[u8],
    node_key: &[u8; 32],
    opening: &[u8; 32],
) -> Verdict {
    // Both receipts were verified when they came; the root and the GPU time are read from
    // them again here, under the key, not from the row.
    let read = |token: &str| {
        cgx_protocol::signed::verify::<PowReceipt>(
            token,
            std::slice::from_ref(node_key),
            cgx_protocol::signed::When::Any,
        )
        .map(|v| v.body)
    };
    let (commit, answer) = match (read(receipt), read(proof_receipt)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            return Verdict::Failed(format!("a stored receipt does not verify: {e}"));
        }
    };
    if commit.challenge != c.id || answer.challenge != c.id || commit.root != answer.root {
        return Verdict::Failed("the receipts are not this challenge's, or name two roots".into());
    }
    if Some(&commit.root) != c.root.as_ref() {
        return Verdict::Failed("the stored root is not the one the node committed to".into());
    }
    if sha256_hex(proof) != answer.proof_sha256 {
        return Verdict::Failed("the stored proof is not the one its receipt signs".into());
    }
    let params = Params { n: c.n, k: c.k };
    let p = match cgx_pow::wire::decode(proof, params) {
        Ok(p) => p,
        Err(e) => return Verdict::Failed(e.to_string()),
    };
    let root: [u8; 32] = match hex::decode(&commit.root)
        .ok()
        .and_then(|r| r.try_into().ok())
    {
        Some(r) => r,
        None => return Verdict::Failed("the committed root is not 32 bytes".into()),
    };
    let Ok(nonce) = hex::decode(&c.nonce) else {
        return Verdict::Failed("the stored nonce".into());
    };
    let ch = Challenge {
        seed: seed(&nonce, &c.lease_id, c.window, node_key, c.gpu),
        params,
    };
    if let Err(e) = Verifier::new(ch).and_then(|v| v.verify(&root, opening, &p)) {
        return Verdict::Failed(e.to_string());
    }
    if commit.gpu_us > c.gpu_deadline_ms.saturating_mul(1000) {
        return Verdict::Slow(format!(
            "right, but the GPU took {:.1} ms; the class expects {} ms and allows {} ms",
            commit.gpu_us as f64 / 1e3,
            c.expected_ms,
            c.gpu_deadline_ms
        ));
    }
    Verdict::Passed
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
    use cgx_pow::backend::{Cpu, Held, SkipRows};
    use cgx_protocol::signed::Signer;

    /// `node`'s commitment to `c` by `backend`: what it holds, and its receipt.
    fn commit(
        node: &SimNode,
        c: &PowChallenge,
        backend: &dyn Backend,
        now: i64,
        edit: impl FnOnce(&mut PowReceipt),
    ) -> (Box<dyn Held>, PowCommit) {
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
        let (held, ms) = backend.commit(&ch).unwrap();
        let mut receipt = PowReceipt {
            sub: node.id.clone(),
            challenge: c.id.clone(),
            root: hex::encode(held.root()),
            proof_sha256: String::new(),
            gpu_us: (ms * 1e3) as u64,
            backend: backend.name(),
        };
        edit(&mut receipt);
        let token = signer.sign(&receipt, now, now + 300).unwrap();
        (held, PowCommit { receipt: token })
    }

    /// The proof for `opening`, its bytes passed through `edit`, with its receipt.
    fn proof(
        node: &SimNode,
        c: &PowChallenge,
        held: &dyn Held,
        opening: &str,
        now: i64,
        edit: impl FnOnce(&mut PowReceipt, &mut Vec<u8>),
    ) -> PowPost {
        use base64::Engine as _;
        let signer = Signer::from_pkcs8(&node.node_key).unwrap();
        let opening: [u8; 32] = hex::decode(opening).unwrap().try_into().unwrap();
        let mut bytes = cgx_pow::wire::encode(&held.open(&opening).unwrap());
        let mut receipt = PowReceipt {
            sub: node.id.clone(),
            challenge: c.id.clone(),
            root: hex::encode(held.root()),
            proof_sha256: sha256_hex(&bytes),
            gpu_us: 1,
            backend: "test".into(),
        };
        edit(&mut receipt, &mut bytes);
        if receipt.proof_sha256 == "recompute" {
            receipt.proof_sha256 = sha256_hex(&bytes);
        }
        PowPost {
            receipt: signer.sign(&receipt, now, now + 300).unwrap(),
            proof: base64::engine::general_purpose::STANDARD.encode(&bytes),
        }
    }

    async fn err<T: std::fmt::Debug>(
        r: impl std::future::Future<Output = Result<T, BrokerError>>,
    ) -> String {
        r.await.unwrap_err().to_string()
    }

    /// The provider's loop through the broker: a placed node's heartbeat carries a challenge
    /// for its leased GPU; its commitment is answered with an opening, its proof stored,
    /// judged off the request path, and passes; each bad commitment or proof is refused with
    /// its reason and changes nothing; a node that skips rows is caught, made unplaceable with
    /// the reason, and its job moves (failover); a challenge left without a commitment past
    /// its deadline is missed; a challenge row the broker did not seal is no challenge.
    #[tokio::test]
    async fn honest_proofs_pass_bad_answers_are_refused_and_a_cheat_loses_its_lease() {
        let h = Harness::new("pow").await;
        let (x, y, z, w) = (h.node(1), h.node(1), h.node(1), h.node(1));
        for n in [&x, &y, &z, &w] {
            h.register(n).await.unwrap();
        }
        let tenant = h.admin(Role::Tenant);
        let job = h
            .broker
            .submit(&tenant, Harness::job(1, 3600))
            .await
            .unwrap();
        let node_of = |id: &str| [&x, &y, &z, &w].into_iter().find(|n| n.id == id).unwrap();
        let honest = node_of(job.node_id.as_deref().unwrap());
        let a = h.heartbeat(honest).await.unwrap();
        assert_eq!(a.challenges.len(), 1, "one challenge per leased GPU");
        let c = a.challenges[0].clone();
        assert_eq!(
            (c.n, c.k, c.lease.as_str()),
            (64, 64, job.lease_id.as_deref().unwrap())
        );
        // Sent again until committed to, not issued twice.
        assert_eq!(
            h.heartbeat(honest).await.unwrap().challenges,
            vec![c.clone()]
        );
        let now = h.now();
        let cpu = Cpu { threads: 1 };
        let other = node_of(if honest.id == x.id { &y.id } else { &x.id });
        let b = &h.broker;
        // A proof before any commitment: refused.
        let (held, good) = commit(honest, &c, &cpu, now, |_| {});
        let early = proof(honest, &c, &*held, &"00".repeat(32), now, |_, _| {});
        let e = err(b.pow_answer(&honest.id, &c.id, &early)).await;
        assert!(e.contains("not waiting for its proof"), "{e}");
        // Commitments refused before anything is stored, each with its reason.
        for (post, why) in [
            (commit(other, &c, &cpu, now, |_| {}).1, "not signed by node"),
            (
                commit(honest, &c, &cpu, now, |r| r.challenge = "pother".into()).1,
                "for challenge pother",
            ),
            (
                commit(honest, &c, &cpu, now, |r| r.proof_sha256 = "ab".into()).1,
                "names no proof",
            ),
            (
                commit(honest, &c, &cpu, now, |r| r.root = "beef".into()).1,
                "not 32 bytes",
            ),
        ] {
            let e = err(b.pow_commit(&honest.id, &c.id, &post)).await;
            assert!(e.contains(why), "{why}: {e}");
        }
        let unknown = commit(honest, &c, &cpu, now, |r| r.challenge = "pnone".into()).1;
        let e = err(b.pow_commit(&honest.id, "pnone", &unknown)).await;
        assert!(e.contains("challenge pnone of node"), "{e}");
        assert_eq!(
            b.store.pow_challenge(&c.id).await.unwrap().unwrap().state,
            "issued"
        );
        // The commitment: stored, answered with the opening. Sent again (its answer lost), the
        // same opening; another root once committed: refused.
        let opening = b.pow_commit(&honest.id, &c.id, &good).await.unwrap();
        assert_eq!(
            b.pow_commit(&honest.id, &c.id, &good).await.unwrap(),
            opening
        );
        let (_, rival) = commit(honest, &c, &cpu, now, |r| r.root = "ab".repeat(32));
        let e = err(b.pow_commit(&honest.id, &c.id, &rival)).await;
        assert!(e.contains("already committed"), "{e}");
        // Proofs refused, each with its reason.
        for (post, why) in [
            (
                proof(honest, &c, &*held, &opening.opening, now, |r, _| {
                    r.root = "00".repeat(32)
                }),
                "another root",
            ),
            (
                proof(honest, &c, &*held, &opening.opening, now, |_, b| {
                    b[100] ^= 1
                }),
                "not the one the receipt signs",
            ),
            (
                proof(honest, &c, &*held, &opening.opening, now, |r, b| {
                    b.extend(vec![0; 1 << 20]);
                    r.proof_sha256 = "recompute".into();
                }),
                "takes at most",
            ),
        ] {
            let e = err(b.pow_answer(&honest.id, &c.id, &post)).await;
            assert!(e.contains(why), "{why}: {e}");
        }
        // The honest proof: stored, then judged by the verifier's pass.
        let post = proof(honest, &c, &*held, &opening.opening, now, |_, _| {});
        let ok = b.pow_answer(&honest.id, &c.id, &post).await.unwrap();
        assert_eq!(ok.state, "answered");
        // Sent again (its answer lost): taken already; another proof: refused.
        assert_eq!(b.pow_answer(&honest.id, &c.id, &post).await.unwrap(), ok);
        let other_proof = proof(honest, &c, &*held, &opening.opening, now, |r, b| {
            b[100] ^= 1;
            r.proof_sha256 = "recompute".into();
        });
        let e = err(b.pow_answer(&honest.id, &c.id, &other_proof)).await;
        assert!(e.contains("not waiting for its proof"), "{e}");
        assert_eq!(b.pow_pass().await.unwrap(), 1);
        let row = b.store.pow_challenge(&c.id).await.unwrap().unwrap();
        assert_eq!((row.state.as_str(), row.reason.as_str()), ("passed", ""));
        assert!(h.heartbeat(honest).await.unwrap().challenges.is_empty());
        assert_eq!(b.index().placeable(&honest.id, h.now()), Some(Ok(())));

        // A cheat: the second job lands on another node, which skips a tenth of the rows.
        let job2 = b.submit(&tenant, Harness::job(1, 3600)).await.unwrap();
        let cheat = node_of(job2.node_id.as_deref().unwrap());
        assert_ne!(cheat.id, honest.id);
        let c2 = h.heartbeat(cheat).await.unwrap().challenges[0].clone();
        let skip = SkipRows {
            threads: 1,
            percent: 10,
        };
        let (held2, post) = commit(cheat, &c2, &skip, h.now(), |_| {});
        let o2 = b.pow_commit(&cheat.id, &c2.id, &post).await.unwrap();
        let post = proof(cheat, &c2, &*held2, &o2.opening, h.now(), |_, _| {});
        b.pow_answer(&cheat.id, &c2.id, &post).await.unwrap();
        assert_eq!(b.pow_pass().await.unwrap(), 1);
        let row = b.store.pow_challenge(&c2.id).await.unwrap().unwrap();
        assert_eq!(row.state, "failed");
        assert!(
            row.reason.contains("the committed value is not (A·B)"),
            "{}",
            row.reason
        );
        match b.index().placeable(&cheat.id, h.now()) {
            Some(Err(index::Unplaceable::ProofFailed { reason, .. })) => {
                assert!(reason.contains(&c2.id), "{reason}")
            }
            other => panic!("the cheat stays placeable: {other:?}"),
        }
        // The monitor's failover ends its lease; the job is placed again elsewhere.
        b.tick().await.unwrap();
        assert!(
            b.store
                .open_leases(Some(&cheat.id))
                .await
                .unwrap()
                .is_empty()
        );
        let moved = b.job_view_by_id(&job2.id).await.unwrap();
        assert_ne!(
            moved.node_id.as_deref(),
            Some(cheat.id.as_str()),
            "{moved:?}"
        );
        let hb = h.heartbeat(cheat).await.unwrap();
        assert!(hb.unplaceable.unwrap().contains("proof of work failed"));

        // A proof for an opening of the node's own choosing: not the cells asked for.
        let third = node_of(moved.node_id.as_deref().unwrap());
        let c3 = h.heartbeat(third).await.unwrap().challenges[0].clone();
        let (held3, post) = commit(third, &c3, &cpu, h.now(), |_| {});
        b.pow_commit(&third.id, &c3.id, &post).await.unwrap();
        let mine = proof(third, &c3, &*held3, &"11".repeat(32), h.now(), |_, _| {});
        b.pow_answer(&third.id, &c3.id, &mine).await.unwrap();
        b.pow_pass().await.unwrap();
        let row = b.store.pow_challenge(&c3.id).await.unwrap().unwrap();
        assert!(
            row.state == "failed" && row.reason.contains("the proof opens rows"),
            "{row:?}"
        );

        // A challenge row the broker did not seal (a database writer's): never sent, refused.
        let mut forged = b.store.pow_challenge(&c.id).await.unwrap().unwrap();
        forged.id = "pforged".into();
        forged.state = "issued".into();
        forged.k = 1;
        forged.deadline_ms = i64::MAX;
        b.store
            .write(PowWrite::Issue(Box::new(forged.clone())))
            .await
            .unwrap();
        let for_forged = commit(honest, &c, &cpu, h.now(), |r| {
            r.challenge = "pforged".into()
        })
        .1;
        let e = err(b.pow_commit(&honest.id, "pforged", &for_forged)).await;
        assert!(e.contains("does not carry the broker's seal"), "{e}");

        // A challenge left without a commitment: missed, and (no misses allowed here) the
        // node is marked.
        let job3 = b.submit(&tenant, Harness::job(1, 3600)).await.unwrap();
        let idle = node_of(job3.node_id.as_deref().unwrap());
        let c4 = h.heartbeat(idle).await.unwrap().challenges[0].clone();
        h.clock.set(h.now() + 10);
        assert!(b.pow_pass().await.unwrap() >= 1);
        let row = b.store.pow_challenge(&c4.id).await.unwrap().unwrap();
        assert_eq!(row.state, "missed");
        let (_, late) = commit(idle, &c4, &cpu, h.now(), |_| {});
        let e = err(b.pow_commit(&idle.id, &c4.id, &late)).await;
        assert!(e.contains("already missed"), "{e}");
        assert!(matches!(
            b.index().placeable(&idle.id, h.now()),
            Some(Err(index::Unplaceable::ProofFailed { .. }))
        ));
    }

    /// A node caught cheating cannot shed the penalty by restarting its agent (a new node
    /// key, so a new node id): the penalty is on its GPUs too.
    #[tokio::test]
    async fn a_caught_node_that_registers_anew_stays_unplaceable() {
        let h = Harness::new("pow-restart").await;
        let node = h.node(1);
        h.register(&node).await.unwrap();
        let tenant = h.admin(Role::Tenant);
        h.broker
            .submit(&tenant, Harness::job(1, 3600))
            .await
            .unwrap();
        let c = h.heartbeat(&node).await.unwrap().challenges[0].clone();
        let skip = SkipRows {
            threads: 1,
            percent: 50,
        };
        let (held, post) = commit(&node, &c, &skip, h.now(), |_| {});
        let o = h.broker.pow_commit(&node.id, &c.id, &post).await.unwrap();
        let post = proof(&node, &c, &*held, &o.opening, h.now(), |_, _| {});
        h.broker.pow_answer(&node.id, &c.id, &post).await.unwrap();
        h.broker.pow_pass().await.unwrap();
        let old = node.id.clone();
        let again = node.restarted();
        assert_ne!(again.id, old);
        // Once the old node has fallen silent, its GPUs may be offered again.
        h.clock.set(h.now() + 60);
        h.register(&again).await.unwrap();
        match h.broker.index().placeable(&again.id, h.now()) {
            Some(Err(index::Unplaceable::ProofFailed { reason, .. })) => {
                assert!(reason.starts_with("GPU "), "{reason}")
            }
            other => panic!("the restarted cheat is placeable: {other:?}"),
        }
        // Another replica (or this one after a restart) reads the penalty from the database.
        let mut h = h;
        h.restart().await;
        h.broker.sync().await.unwrap();
        assert!(matches!(
            h.broker.index().placeable(&again.id, h.now()),
            Some(Err(index::Unplaceable::ProofFailed { .. }))
        ));
    }

    /// A proof withheld once the opening is known fails (a prover that answers only when its
    /// opened cells happen to be right is a cheat); misses are counted per GPU, so one GPU
    /// that never answers is not hidden by the others passing.
    #[tokio::test]
    async fn a_withheld_proof_fails_and_misses_count_per_gpu() {
        let h = Harness::with("pow-withheld", |c| {
            c.pow.interval_secs = 1;
            c.pow.misses_allowed = 1;
        })
        .await;
        let node = h.node(2);
        h.register(&node).await.unwrap();
        let tenant = h.admin(Role::Tenant);
        h.broker
            .submit(&tenant, Harness::job(2, 3600))
            .await
            .unwrap();
        let cpu = Cpu { threads: 1 };
        let b = &h.broker;
        // Two rounds: GPU 1 proves each time, GPU 0 never answers.
        for round in 0..2 {
            let cs = h.heartbeat(&node).await.unwrap().challenges;
            assert_eq!(cs.len(), 2, "round {round}: {cs:?}");
            for c in cs.iter().filter(|c| c.gpu == 1) {
                let (held, post) = commit(&node, c, &cpu, h.now(), |_| {});
                let o = b.pow_commit(&node.id, &c.id, &post).await.unwrap();
                let post = proof(&node, c, &*held, &o.opening, h.now(), |_, _| {});
                b.pow_answer(&node.id, &c.id, &post).await.unwrap();
            }
            b.pow_pass().await.unwrap();
            h.clock.set(h.now() + 10);
            b.pow_pass().await.unwrap();
            let placeable = b.index().placeable(&node.id, h.now());
            if round == 0 {
                assert_eq!(placeable, Some(Ok(())), "one miss is allowed");
            } else {
                match placeable {
                    Some(Err(index::Unplaceable::ProofFailed { reason, .. })) => {
                        assert!(
                            reason.contains("GPU 0") && reason.contains("no commitment"),
                            "{reason}"
                        )
                    }
                    other => panic!("GPU 0's second miss in a row: {other:?}"),
                }
            }
        }
        // Withheld: a fresh node commits, learns the opening, sends nothing.
        let other = h.node(1);
        h.register(&other).await.unwrap();
        h.broker
            .submit(&tenant, Harness::job(1, 3600))
            .await
            .unwrap();
        let c = h.heartbeat(&other).await.unwrap().challenges[0].clone();
        let (_, post) = commit(&other, &c, &cpu, h.now(), |_| {});
        b.pow_commit(&other.id, &c.id, &post).await.unwrap();
        h.clock.set(h.now() + 10);
        b.pow_pass().await.unwrap();
        let row = b.store.pow_challenge(&c.id).await.unwrap().unwrap();
        assert_eq!(row.state, "failed");
        assert!(row.reason.contains("withheld"), "{}", row.reason);
        assert!(matches!(
            b.index().placeable(&other.id, h.now()),
            Some(Err(index::Unplaceable::ProofFailed { .. }))
        ));
    }
}
