//! Proof-of-work challenges: one row per challenge, from its issue to its verdict —
//! `issued` → `committed` (the node's root arrived by the deadline; the opening was drawn) →
//! `answered` (the proof arrived by the opening's deadline) → `passed`, `failed` or `slow`;
//! or `missed` when a deadline passes first. A row carries the broker's seal over every field it
//! is judged by (`pow.rs`): the database cannot make or change a challenge. The proof waits in
//! its row until a verifier (any replica) judges it, then is dropped (the root and the
//! receipts stay). A failed or missed proof marks its node (`nodes.pow_failed_at`,
//! `pow_reason`), which every replica reads with the node's row.

use sqlx::Row;

use super::super::reputation::Delta;

use super::super::error::BrokerError;
use super::{Outcome, Refusal, Store, Tx, one_row};

/// A challenge row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChallengeRow {
    pub id: String,
    pub node_id: String,
    pub lease_id: String,
    pub gpu: u32,
    pub window: u64,
    /// Hex, 32 bytes.
    pub nonce: String,
    pub n: u32,
    pub k: u32,
    pub expected_ms: u64,
    pub gpu_deadline_ms: u64,
    pub issued_ms: i64,
    pub deadline_ms: i64,
    /// The node's attested key (hex) and its GPUs' serials when the challenge was issued:
    /// the verdict needs neither the index nor the node still registered.
    pub node_key: String,
    pub serials: Vec<String>,
    /// The broker's MAC over the fields above (hex).
    pub seal: String,
    pub state: String,
    pub reason: String,
    pub committed_ms: Option<i64>,
    pub open_deadline_ms: Option<i64>,
    pub gpu_us: Option<i64>,
    pub root: Option<String>,
    pub answered_ms: Option<i64>,
    pub proof_sha256: Option<String>,
}

#[derive(Debug)]
pub(crate) enum PowWrite {
    Issue(Box<ChallengeRow>),
    /// Node `node`'s commitment to `id`, if the challenge is its, still issued and not past
    /// its deadline at `at_ms`.
    Commit {
        id: String,
        node: String,
        at_ms: i64,
        open_deadline_ms: i64,
        gpu_us: i64,
        root: String,
        receipt: String,
    },
    /// Node `node`'s proof for `id`, if committed and not past the opening's deadline.
    Answer {
        id: String,
        node: String,
        at_ms: i64,
        proof_sha256: String,
        receipt: String,
        proof: Vec<u8>,
    },
    /// The verdict on `id` (from state `from`): `passed`, `failed`, `slow` or `missed`, with
    /// the reason; `mark`: the node is marked unplaceable for it, and its GPUs (`serials`).
    Verdict {
        id: String,
        node: String,
        from: &'static str,
        state: &'static str,
        reason: String,
        mark: bool,
        serials: Vec<String>,
        at: i64,
        now_ms: i64,
        /// A failed proof is a proven cheat: the operator's stake is slashed to the tenant in
        /// the verdict's own transaction (`cgx_ledger::settle`).
        slash: Option<Slash>,
        /// The proof was checked and is wrong (a cheat, for reputation); a failure that
        /// proves no wrong answer (withheld, the broker's own) counts as a miss.
        cheat: bool,
        /// Reputation's half-life: the verdict counts for the node and its operator.
        half_life: i64,
    },
}

/// What a failed proof forfeits, and to whom.
#[derive(Debug, Clone)]
pub(crate) struct Slash {
    pub operator: String,
    pub tenant: String,
    pub per_gpu: u64,
    pub gpus: u32,
}

const COLUMNS: &str = "id, node_id, lease_id, gpu, win, nonce, n, k, expected_ms, gpu_deadline_ms, issued_ms, deadline_ms, node_key, serials, seal, state, reason, committed_ms, open_deadline_ms, gpu_us, root, answered_ms, proof_sha256";

fn challenge_row(r: &sqlx::any::AnyRow) -> Result<ChallengeRow, sqlx::Error> {
    let u = |c: &str| -> Result<u64, sqlx::Error> {
        let v: i64 = r.try_get(c)?;
        u64::try_from(v).map_err(|_| sqlx::Error::ColumnDecode {
            index: c.into(),
            source: "negative".into(),
        })
    };
    Ok(ChallengeRow {
        id: r.try_get("id")?,
        node_id: r.try_get("node_id")?,
        lease_id: r.try_get("lease_id")?,
        gpu: u32::try_from(u("gpu")?).unwrap_or(u32::MAX),
        window: u("win")?,
        nonce: r.try_get("nonce")?,
        n: u32::try_from(u("n")?).unwrap_or(0),
        k: u32::try_from(u("k")?).unwrap_or(0),
        expected_ms: u("expected_ms")?,
        gpu_deadline_ms: u("gpu_deadline_ms")?,
        issued_ms: r.try_get("issued_ms")?,
        deadline_ms: r.try_get("deadline_ms")?,
        node_key: r.try_get("node_key")?,
        serials: r
            .try_get::<String, _>("serials")?
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect(),
        seal: r.try_get("seal")?,
        state: r.try_get("state")?,
        reason: r.try_get("reason")?,
        committed_ms: r.try_get("committed_ms")?,
        open_deadline_ms: r.try_get("open_deadline_ms")?,
        gpu_us: r.try_get("gpu_us")?,
        root: r.try_get("root")?,
        answered_ms: r.try_get("answered_ms")?,
        proof_sha256: r.try_get("proof_sha256")?,
    })
}

pub(super) async fn apply(tx: &mut Tx, w: &PowWrite) -> Result<Outcome, sqlx::Error> {
    match w {
        PowWrite::Issue(c) => {
            sqlx::query(
                "INSERT INTO pow_challenges (id, node_id, lease_id, gpu, win, nonce, n, k, expected_ms, gpu_deadline_ms, issued_ms, deadline_ms, node_key, serials, seal, state, reason)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, 'issued', '')",
            )
            .bind(&c.id)
            .bind(&c.node_id)
            .bind(&c.lease_id)
            .bind(i64::from(c.gpu))
            .bind(i64::try_from(c.window).unwrap_or(i64::MAX))
            .bind(&c.nonce)
            .bind(i64::from(c.n))
            .bind(i64::from(c.k))
            .bind(i64::try_from(c.expected_ms).unwrap_or(i64::MAX))
            .bind(i64::try_from(c.gpu_deadline_ms).unwrap_or(i64::MAX))
            .bind(c.issued_ms)
            .bind(c.deadline_ms)
            .bind(&c.node_key)
            .bind(c.serials.join(","))
            .bind(&c.seal)
            .execute(&mut **tx)
            .await?;
            Ok(Outcome::Done)
        }
        PowWrite::Commit {
            id,
            node,
            at_ms,
            open_deadline_ms,
            gpu_us,
            root,
            receipt,
        } => {
            let r = sqlx::query(
                "UPDATE pow_challenges SET state = 'committed', committed_ms = $3, open_deadline_ms = $4, gpu_us = $5, root = $6, receipt = $7
                 WHERE id = $1 AND node_id = $2 AND state = 'issued' AND deadline_ms >= $3",
            )
            .bind(id)
            .bind(node)
            .bind(at_ms)
            .bind(open_deadline_ms)
            .bind(gpu_us)
            .bind(root)
            .bind(receipt)
            .execute(&mut **tx)
            .await?;
            Ok(one_row(r.rows_affected(), Refusal::PowNotOpen))
        }
        PowWrite::Answer {
            id,
            node,
            at_ms,
            proof_sha256,
            receipt,
            proof,
        } => {
            let r = sqlx::query(
                "UPDATE pow_challenges SET state = 'answered', answered_ms = $3, proof_sha256 = $4, proof_receipt = $5, proof = $6
                 WHERE id = $1 AND node_id = $2 AND state = 'committed' AND open_deadline_ms >= $3",
            )
            .bind(id)
            .bind(node)
            .bind(at_ms)
            .bind(proof_sha256)
            .bind(receipt)
            .bind(proof.clone())
            .execute(&mut **tx)
            .await?;
            Ok(one_row(r.rows_affected(), Refusal::PowNotOpen))
        }
        PowWrite::Verdict {
            id,
            node,
            from,
            state,
            reason,
            mark,
            serials,
            at,
            now_ms,
            slash,
            cheat,
            half_life,
        } => {
            let r = sqlx::query(
                "UPDATE pow_challenges SET state = $3, reason = $4, proof = NULL WHERE id = $1 AND state = $2",
            )
            .bind(id)
            .bind(*from)
            .bind(*state)
            .bind(reason)
            .execute(&mut **tx)
            .await?;
            if r.rows_affected() != 1 {
                return Ok(Outcome::Refused(Refusal::PowNotOpen));
            }
            let d = match *state {
                "passed" => Delta {
                    passed: 1.0,
                    ..Delta::default()
                },
                "failed" if *cheat => Delta {
                    cheats: 1.0,
                    ..Delta::default()
                },
                _ => Delta {
                    missed: 1.0,
                    ..Delta::default()
                },
            };
            super::reputation::bump_in(tx, node, d, *at, *half_life, *now_ms).await?;
            let c = sqlx::query(
                "SELECT lease_id, gpu, win, nonce, n, k, root, proof_sha256 FROM pow_challenges WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&mut **tx)
            .await?;
            let lease: String = c.try_get("lease_id")?;
            // A leaf of the log (issue 33), in the verdict's transaction: the challenge's terms,
            // the committed root and the proof's digest, and what was decided. The window is a
            // string (a leaf's numbers are exact only below 2^53).
            cgx_service::audit::record(
                tx,
                *at,
                &cgx_service::audit::NewEvent {
                    actor: "broker",
                    action: "pow.verdict",
                    subject: id,
                    detail: &serde_json::json!({
                        "node": node,
                        "lease": lease,
                        "gpu": c.try_get::<i64, _>("gpu")?,
                        "window": c.try_get::<i64, _>("win")?.to_string(),
                        "nonce": c.try_get::<String, _>("nonce")?,
                        "n": c.try_get::<i64, _>("n")?,
                        "k": c.try_get::<i64, _>("k")?,
                        "root": c.try_get::<Option<String>, _>("root")?,
                        "proof_sha256": c.try_get::<Option<String>, _>("proof_sha256")?,
                        "state": state,
                        "reason": cgx_service::audit::cap(reason, 1024),
                        "cheat": cheat,
                        "slash": slash.as_ref().map(|sl| (u128::from(sl.per_gpu) * u128::from(sl.gpus)).to_string()),
                    }),
                },
            )
            .await?;
            if let Some(sl) = slash {
                // The challenge's id names the cheat: it is slashed at most once.
                super::ledger::slash_in(
                    tx,
                    &sl.operator,
                    &sl.tenant,
                    &lease,
                    &format!("pow/{id}"),
                    sl.per_gpu,
                    sl.gpus,
                    *at,
                )
                .await?;
            }
            if *mark {
                sqlx::query(
                    "UPDATE nodes SET pow_failed_at = $2, pow_reason = $3, updated_ms = $4 WHERE id = $1",
                )
                .bind(node)
                .bind(at)
                .bind(reason)
                .bind(now_ms)
                .execute(&mut **tx)
                .await?;
                for serial in serials {
                    sqlx::query(
                        "INSERT INTO pow_penalties (serial, at, reason) VALUES ($1, $2, $3)
                         ON CONFLICT (serial) DO UPDATE SET at = excluded.at, reason = excluded.reason",
                    )
                    .bind(serial)
                    .bind(at)
                    .bind(reason)
                    .execute(&mut **tx)
                    .await?;
                }
            }
            Ok(Outcome::Done)
        }
    }
}

impl Store {
    /// GPUs (serials) marked at or after `since`: (serial, when, why).
    pub async fn pow_penalties(
        &self,
        since: i64,
    ) -> Result<Vec<(String, i64, String)>, BrokerError> {
        let rows = sqlx::query("SELECT serial, at, reason FROM pow_penalties WHERE at >= $1")
            .bind(since)
            .fetch_all(self.db.pool())
            .await?;
        rows.iter()
            .map(|r| Ok((r.try_get("serial")?, r.try_get("at")?, r.try_get("reason")?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    async fn pow_rows(
        &self,
        filter: &str,
        bind: &[&str],
        nums: &[i64],
    ) -> Result<Vec<ChallengeRow>, BrokerError> {
        let sql = format!("SELECT {COLUMNS} FROM pow_challenges WHERE {filter}");
        let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
        for b in bind {
            q = q.bind(b.to_string());
        }
        for n in nums {
            q = q.bind(*n);
        }
        let rows = q.fetch_all(self.db.pool()).await?;
        Ok(rows
            .iter()
            .map(challenge_row)
            .collect::<Result<_, sqlx::Error>>()?)
    }

    /// Every challenge of `lease`, by GPU then window (settlement reads their verdicts).
    pub async fn pow_of_lease(&self, lease: &str) -> Result<Vec<ChallengeRow>, BrokerError> {
        self.pow_rows(
            "lease_id = $1 ORDER BY gpu, win, issued_ms LIMIT 100000",
            &[lease],
            &[],
        )
        .await
    }

    /// The newest `limit` challenges of `lease` (a console page's).
    pub async fn pow_recent(
        &self,
        lease: &str,
        limit: i64,
    ) -> Result<Vec<ChallengeRow>, BrokerError> {
        self.pow_rows(
            "lease_id = $1 ORDER BY issued_ms DESC LIMIT $2",
            &[lease],
            &[limit],
        )
        .await
    }

    /// Node `node`'s challenges still open for a commitment (issued, deadline ahead).
    pub async fn pow_open(
        &self,
        node: &str,
        now_ms: i64,
    ) -> Result<Vec<ChallengeRow>, BrokerError> {
        self.pow_rows(
            "node_id = $1 AND state = 'issued' AND deadline_ms >= $2 ORDER BY issued_ms LIMIT 256",
            &[node],
            &[now_ms],
        )
        .await
    }

    /// When a challenge for (`lease`, `gpu`) was last issued (Unix ms).
    pub async fn pow_last_issued(&self, lease: &str, gpu: u32) -> Result<Option<i64>, BrokerError> {
        let r = sqlx::query(
            "SELECT MAX(issued_ms) AS m FROM pow_challenges WHERE lease_id = $1 AND gpu = $2",
        )
        .bind(lease)
        .bind(i64::from(gpu))
        .fetch_one(self.db.pool())
        .await?;
        Ok(r.try_get::<Option<i64>, _>("m")?)
    }

    /// One challenge.
    pub async fn pow_challenge(&self, id: &str) -> Result<Option<ChallengeRow>, BrokerError> {
        Ok(self
            .pow_rows("id = $1", &[id], &[])
            .await?
            .into_iter()
            .next())
    }

    /// Answers waiting for their verdict, oldest first, with both receipts and the proof.
    pub async fn pow_answered(
        &self,
        limit: i64,
    ) -> Result<Vec<(ChallengeRow, String, String, Vec<u8>)>, BrokerError> {
        let sql = format!(
            "SELECT {COLUMNS}, receipt, proof_receipt, proof FROM pow_challenges WHERE state = 'answered' ORDER BY answered_ms LIMIT $1"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(limit)
            .fetch_all(self.db.pool())
            .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    challenge_row(r)?,
                    r.try_get::<Option<String>, _>("receipt")?
                        .unwrap_or_default(),
                    r.try_get::<Option<String>, _>("proof_receipt")?
                        .unwrap_or_default(),
                    r.try_get::<Option<Vec<u8>>, _>("proof")?
                        .unwrap_or_default(),
                ))
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// Challenges past a deadline: issued and not committed, or committed and not answered.
    pub async fn pow_overdue(&self, now_ms: i64) -> Result<Vec<ChallengeRow>, BrokerError> {
        self.pow_rows(
            "(state = 'issued' AND deadline_ms < $1) OR (state = 'committed' AND open_deadline_ms < $2) ORDER BY issued_ms LIMIT 1000",
            &[],
            &[now_ms, now_ms],
        )
        .await
    }

    /// Node `node`'s latest challenges, newest first.
    pub async fn pow_history(
        &self,
        node: &str,
        limit: i64,
    ) -> Result<Vec<ChallengeRow>, BrokerError> {
        self.pow_rows(
            "node_id = $1 ORDER BY issued_ms DESC LIMIT $2",
            &[node],
            &[limit],
        )
        .await
    }

    /// How many of the latest verdicts on node `node`'s GPU `gpu`, in a row, were misses
    /// (`missed`, `slow`): per GPU, so one GPU missing or slow is not hidden by the others.
    pub async fn pow_missed_in_a_row(&self, node: &str, gpu: u32) -> Result<u32, BrokerError> {
        let rows = self
            .pow_rows(
                "node_id = $1 AND gpu = $2 AND state IN ('passed', 'failed', 'missed', 'slow') ORDER BY issued_ms DESC LIMIT 16",
                &[node],
                &[i64::from(gpu)],
            )
            .await?;
        Ok(rows
            .iter()
            .take_while(|r| r.state == "missed" || r.state == "slow")
            .count() as u32)
    }
}
