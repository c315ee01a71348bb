//! Accepted metering records: one row per (lease, sequence), the token exactly as the node
//! signed it and its hash (what the next record must carry). The next issue pays them; an
//! auditor replays the chain from these rows alone.

use sqlx::Row;

use super::super::error::BrokerError;
use super::{LEASE_COLUMNS, LeaseRow, Outcome, Refusal, Store, Tx};

#[derive(Debug)]
pub(crate) enum MeteringWrite {
    /// Append record `seq` of `lease` — only if it links to the stored record before it (its
    /// hash is `prev`), or is the first: checked in the write, so replicas racing to accept two
    /// records of one window, or a record and its predecessor's rival, accept one chain.
    Append {
        node: String,
        lease: String,
        seq: i64,
        prev: String,
        hash: String,
        token: String,
        at: i64,
    },
}

pub(super) async fn apply(tx: &mut Tx, w: &MeteringWrite) -> Result<Outcome, sqlx::Error> {
    match w {
        MeteringWrite::Append {
            node,
            lease,
            seq,
            prev,
            hash,
            token,
            at,
        } => {
            let r = sqlx::query(
                "INSERT INTO metering (lease_id, seq, hash, token, accepted_at)
                 SELECT $1, $2, $3, $4, $5
                 WHERE ($2 = 0 AND NOT EXISTS (SELECT 1 FROM metering WHERE lease_id = $1))
                    OR EXISTS (SELECT 1 FROM metering WHERE lease_id = $1 AND seq = $2 - 1 AND hash = $6)
                 ON CONFLICT (lease_id, seq) DO NOTHING",
            )
            .bind(lease)
            .bind(seq)
            .bind(hash)
            .bind(token)
            .bind(at)
            .bind(prev)
            .execute(&mut **tx)
            .await?;
            if r.rows_affected() != 1 {
                return Ok(Outcome::Refused(Refusal::MeteringMoved));
            }
            // A leaf of the log (issue 33), in the acceptance's transaction: the record as the
            // node signed it (an auditor checks its signature under the node's attested key),
            // and where it links in the lease's chain.
            cgx_service::audit::record(
                tx,
                *at,
                &cgx_service::audit::NewEvent {
                    actor: &format!("node:{node}"),
                    action: "metering.accept",
                    subject: lease,
                    detail: &serde_json::json!({
                        "seq": seq.to_string(),
                        "hash": hash,
                        "prev": prev,
                        "record": token,
                    }),
                },
            )
            .await?;
            Ok(Outcome::Done)
        }
    }
}

impl Store {
    /// The last accepted record of `lease`: its sequence number and hash.
    pub async fn metering_last(&self, lease: &str) -> Result<Option<(u64, String)>, BrokerError> {
        let row = sqlx::query(
            "SELECT seq, hash FROM metering WHERE lease_id = $1 ORDER BY seq DESC LIMIT 1",
        )
        .bind(lease)
        .fetch_optional(self.db.pool())
        .await?;
        Ok(match row {
            Some(r) => {
                let seq: i64 = r.try_get("seq")?;
                Some((u64::try_from(seq).unwrap_or(0), r.try_get("hash")?))
            }
            None => None,
        })
    }

    /// Accepted records of `lease` from sequence `from` on, in order: (sequence, hash).
    pub async fn metering_from(
        &self,
        lease: &str,
        from: u64,
        limit: i64,
    ) -> Result<Vec<(u64, String)>, BrokerError> {
        let rows = sqlx::query(
            "SELECT seq, hash FROM metering WHERE lease_id = $1 AND seq >= $2 ORDER BY seq LIMIT $3",
        )
        .bind(lease)
        .bind(i64::try_from(from).unwrap_or(i64::MAX))
        .bind(limit)
        .fetch_all(self.db.pool())
        .await?;
        rows.iter()
            .map(|r| {
                let seq: i64 = r.try_get("seq")?;
                Ok((u64::try_from(seq).unwrap_or(0), r.try_get("hash")?))
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// How many records of `lease` were accepted.
    pub async fn metering_count(&self, lease: &str) -> Result<u64, BrokerError> {
        let r = sqlx::query("SELECT COUNT(*) AS c FROM metering WHERE lease_id = $1")
            .bind(lease)
            .fetch_one(self.db.pool())
            .await?;
        Ok(u64::try_from(r.try_get::<i64, _>("c")?).unwrap_or(0))
    }

    /// Every accepted record of `lease`, in order: (sequence, token).
    pub async fn metering(&self, lease: &str) -> Result<Vec<(u64, String)>, BrokerError> {
        let rows = sqlx::query("SELECT seq, token FROM metering WHERE lease_id = $1 ORDER BY seq")
            .bind(lease)
            .fetch_all(self.db.pool())
            .await?;
        rows.iter()
            .map(|r| {
                let seq: i64 = r.try_get("seq")?;
                Ok((u64::try_from(seq).unwrap_or(0), r.try_get("token")?))
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// A lease by id, open or ended, and when it ended.
    pub async fn lease_any(
        &self,
        id: &str,
    ) -> Result<Option<(LeaseRow, Option<i64>)>, BrokerError> {
        let sql = format!("SELECT {LEASE_COLUMNS}, ended_at FROM leases WHERE id = $1");
        let row = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(id)
            .fetch_optional(self.db.pool())
            .await?;
        match row {
            None => Ok(None),
            Some(r) => {
                let ended: Option<i64> = r.try_get("ended_at")?;
                Ok(Some((super::lease_row(&r)?, ended)))
            }
        }
    }
}
