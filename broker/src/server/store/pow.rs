//! Proof-of-work challenges: one row per challenge, from its issue to its verdict. An answer's
//! proof waits in its row until a verifier (any replica) judges it, then is dropped (the root
//! and the receipt stay). A failed or missed proof marks its node (`nodes.pow_failed_at`,
//! `pow_reason`), which every replica reads with the node's row.

use sqlx::Row;

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
    /// `issued`, `answered`, `passed`, `failed` or `missed`.
    pub state: String,
    pub reason: String,
    pub answered_ms: Option<i64>,
    pub gpu_us: Option<i64>,
    pub root: Option<String>,
}

#[derive(Debug)]
pub(crate) enum PowWrite {
    Issue(ChallengeRow),
    /// Store node `node`'s answer to `id`, if the challenge is its, still open and not past
    /// its deadline at `answered_ms`.
    Answer {
        id: String,
        node: String,
        answered_ms: i64,
        gpu_us: i64,
        root: String,
        receipt: String,
        proof: Vec<u8>,
    },
    /// The verdict on `id` (from state `from`): `passed`, or `failed` / `missed` with the
    /// reason, which also marks the node.
    Verdict {
        id: String,
        node: String,
        from: &'static str,
        state: &'static str,
        reason: String,
        at: i64,
        now_ms: i64,
    },
}

const COLUMNS: &str = "id, node_id, lease_id, gpu, win, nonce, n, k, expected_ms, gpu_deadline_ms, issued_ms, deadline_ms, state, reason, answered_ms, gpu_us, root";

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
        state: r.try_get("state")?,
        reason: r.try_get("reason")?,
        answered_ms: r.try_get("answered_ms")?,
        gpu_us: r.try_get("gpu_us")?,
        root: r.try_get("root")?,
    })
}

pub(super) async fn apply(tx: &mut Tx, w: &PowWrite) -> Result<Outcome, sqlx::Error> {
    match w {
        PowWrite::Issue(c) => {
            sqlx::query(
                "INSERT INTO pow_challenges (id, node_id, lease_id, gpu, win, nonce, n, k, expected_ms, gpu_deadline_ms, issued_ms, deadline_ms, state, reason)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, 'issued', '')",
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
            .execute(&mut **tx)
            .await?;
            Ok(Outcome::Done)
        }
        PowWrite::Answer {
            id,
            node,
            answered_ms,
            gpu_us,
            root,
            receipt,
            proof,
        } => {
            let r = sqlx::query(
                "UPDATE pow_challenges SET state = 'answered', answered_ms = $3, gpu_us = $4, root = $5, receipt = $6, proof = $7
                 WHERE id = $1 AND node_id = $2 AND state = 'issued' AND deadline_ms >= $3",
            )
            .bind(id)
            .bind(node)
            .bind(answered_ms)
            .bind(gpu_us)
            .bind(root)
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
            at,
            now_ms,
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
            if *state != "passed" {
                sqlx::query(
                    "UPDATE nodes SET pow_failed_at = $2, pow_reason = $3, updated_ms = $4 WHERE id = $1",
                )
                .bind(node)
                .bind(at)
                .bind(reason)
                .bind(now_ms)
                .execute(&mut **tx)
                .await?;
            }
            Ok(Outcome::Done)
        }
    }
}

impl Store {
    /// Node `node`'s challenges still open (issued, not answered, deadline ahead).
    pub async fn pow_open(
        &self,
        node: &str,
        now_ms: i64,
    ) -> Result<Vec<ChallengeRow>, BrokerError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM pow_challenges WHERE node_id = $1 AND state = 'issued' AND deadline_ms >= $2 ORDER BY issued_ms"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(node)
            .bind(now_ms)
            .fetch_all(self.db.pool())
            .await?;
        Ok(rows
            .iter()
            .map(challenge_row)
            .collect::<Result<_, sqlx::Error>>()?)
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
        let sql = format!("SELECT {COLUMNS} FROM pow_challenges WHERE id = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(self.db.pool())
            .await?;
        Ok(row.as_ref().map(challenge_row).transpose()?)
    }

    /// Answers waiting for their verdict, oldest first, with their receipts and proofs.
    pub async fn pow_answered(
        &self,
        limit: i64,
    ) -> Result<Vec<(ChallengeRow, String, Vec<u8>)>, BrokerError> {
        let sql = format!(
            "SELECT {COLUMNS}, receipt, proof FROM pow_challenges WHERE state = 'answered' ORDER BY answered_ms LIMIT $1"
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
                    r.try_get::<Option<Vec<u8>>, _>("proof")?
                        .unwrap_or_default(),
                ))
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// Challenges issued and not answered by their deadline.
    pub async fn pow_overdue(&self, now_ms: i64) -> Result<Vec<ChallengeRow>, BrokerError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM pow_challenges WHERE state = 'issued' AND deadline_ms < $1 ORDER BY deadline_ms LIMIT 1000"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(now_ms)
            .fetch_all(self.db.pool())
            .await?;
        Ok(rows
            .iter()
            .map(challenge_row)
            .collect::<Result<_, sqlx::Error>>()?)
    }

    /// Node `node`'s latest challenges, newest first.
    pub async fn pow_history(
        &self,
        node: &str,
        limit: i64,
    ) -> Result<Vec<ChallengeRow>, BrokerError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM pow_challenges WHERE node_id = $1 ORDER BY issued_ms DESC LIMIT $2"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(node)
            .bind(limit)
            .fetch_all(self.db.pool())
            .await?;
        Ok(rows
            .iter()
            .map(challenge_row)
            .collect::<Result<_, sqlx::Error>>()?)
    }
}
