//! Nodes' rows: registration nonces (single use), node records, heartbeats, re-attestation
//! asks, reputation.

use sqlx::Row;

use super::super::error::BrokerError;
use super::{NodeRow, Outcome, Refusal, Store, Tx, one_row};

/// Writes to nodes' rows.
#[derive(Debug)]
pub(crate) enum NodeWrite {
    /// Use a registration nonce: single use across replicas, spent before the evidence is
    /// looked at (a refused registration spends it too).
    UseNonce {
        nonce: String,
        expires_at: i64,
    },
    /// A registration: store the node's signed record, and take its GPUs (device serials)
    /// from any node that is no longer live; refused if another live node offers one.
    Register {
        id: String,
        operator: String,
        record: String,
        attested_at: i64,
        now_ms: i64,
        gpus: Vec<String>,
        /// Another node counts as live if it heartbeat at or after this…
        live_after: i64,
        /// …and attested at or after this.
        attested_after: i64,
        /// The registration's leaf (`node.register`'s detail) and the pieces it names, recorded
        /// in the registration's transaction.
        leaf: serde_json::Value,
        archive: Vec<super::Archived>,
    },
    Heartbeat {
        id: String,
        seq: i64,
        at: i64,
        now_ms: i64,
    },
    /// Ask node `id` to re-attest at its next heartbeat.
    AskReattest {
        id: String,
        at: i64,
        now_ms: i64,
    },
    SweepNonces {
        now: i64,
    },
}

/// Apply one of these writes inside the batch's transaction (see `store::apply`).
pub(super) async fn apply(tx: &mut Tx, w: &NodeWrite) -> Result<Outcome, sqlx::Error> {
    match w {
        NodeWrite::UseNonce { nonce, expires_at } => {
            let used = sqlx::query(
                "INSERT INTO used_nonces (nonce, expires_at) VALUES ($1, $2) ON CONFLICT (nonce) DO NOTHING",
            )
            .bind(nonce)
            .bind(expires_at)
            .execute(&mut **tx)
            .await?;
            Ok(one_row(used.rows_affected(), Refusal::NonceUsed))
        }
        NodeWrite::Register {
            id,
            operator,
            record,
            attested_at,
            now_ms,
            gpus,
            live_after,
            attested_after,
            leaf,
            archive,
        } => {
            // One GPU, one live node, across replicas: checked before anything changes (the
            // writer applies writes one at a time, and PostgreSQL replicas' batches commit one
            // at a time), so the check and the claim below cannot interleave with another's.
            for chunk in gpus.chunks(64) {
                let sql = format!(
                    "SELECT g.serial AS serial, g.node_id AS node_id, n.operator AS operator FROM gpu_owners g
                     JOIN nodes n ON n.id = g.node_id
                     WHERE g.node_id <> $1 AND n.last_heartbeat >= $2 AND n.attested_at >= $3
                       AND g.serial IN ({}) LIMIT 1",
                    (4..4 + chunk.len())
                        .map(|i| format!("${i}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                let mut q = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(id)
                    .bind(live_after)
                    .bind(attested_after);
                for g in chunk {
                    q = q.bind(g);
                }
                if let Some(r) = q.fetch_optional(&mut **tx).await? {
                    // Another operator's node is not named to this one.
                    let owner: String = r.try_get("operator")?;
                    return Ok(Outcome::Refused(Refusal::GpuOffered {
                        serial: r.try_get("serial")?,
                        node: if owner == *operator {
                            r.try_get("node_id")?
                        } else {
                            "of another operator".into()
                        },
                    }));
                }
            }
            sqlx::query("DELETE FROM gpu_owners WHERE node_id = $1")
                .bind(id)
                .execute(&mut **tx)
                .await?;
            for g in gpus {
                sqlx::query(
                    "INSERT INTO gpu_owners (serial, node_id) VALUES ($1, $2)
                     ON CONFLICT (serial) DO UPDATE SET node_id = excluded.node_id",
                )
                .bind(g)
                .bind(id)
                .execute(&mut **tx)
                .await?;
            }
            sqlx::query(
                "INSERT INTO nodes (id, operator, record, attested_at, last_heartbeat, heartbeat_seq, updated_ms)
                 VALUES ($1, $2, $3, $4, $4, 0, $5)
                 ON CONFLICT (id) DO UPDATE SET operator = excluded.operator, record = excluded.record,
                   attested_at = excluded.attested_at, reattest_asked = 0,
                   last_heartbeat = CASE WHEN nodes.last_heartbeat > excluded.attested_at THEN nodes.last_heartbeat ELSE excluded.attested_at END,
                   updated_ms = excluded.updated_ms",
            )
            .bind(id)
            .bind(operator)
            .bind(record)
            .bind(attested_at)
            .bind(now_ms)
            .execute(&mut **tx)
            .await?;
            sqlx::query("INSERT INTO operators (name) VALUES ($1) ON CONFLICT (name) DO NOTHING")
                .bind(operator)
                .execute(&mut **tx)
                .await?;
            super::archive::insert_in(tx, archive, *attested_at).await?;
            cgx_service::audit::record(
                tx,
                *attested_at,
                &cgx_service::audit::NewEvent {
                    actor: &format!("operator:{operator}"),
                    action: "node.register",
                    subject: id,
                    detail: leaf,
                },
            )
            .await?;
            Ok(Outcome::Done)
        }
        NodeWrite::Heartbeat {
            id,
            seq,
            at,
            now_ms,
        } => {
            let r = sqlx::query(
                "UPDATE nodes SET last_heartbeat = $1, heartbeat_seq = $2, updated_ms = $3
                 WHERE id = $4 AND heartbeat_seq < $2",
            )
            .bind(at)
            .bind(seq)
            .bind(now_ms)
            .bind(id)
            .execute(&mut **tx)
            .await?;
            Ok(one_row(r.rows_affected(), Refusal::StaleHeartbeat))
        }
        NodeWrite::AskReattest { id, at, now_ms } => {
            let r =
                sqlx::query("UPDATE nodes SET reattest_asked = $1, updated_ms = $2 WHERE id = $3")
                    .bind(at)
                    .bind(now_ms)
                    .bind(id)
                    .execute(&mut **tx)
                    .await?;
            Ok(one_row(r.rows_affected(), Refusal::NoSuchNode))
        }
        NodeWrite::SweepNonces { now } => {
            // A minute past expiry: a replica whose clock runs behind still refuses the nonce.
            sqlx::query("DELETE FROM used_nonces WHERE expires_at <= $1")
                .bind(now - 60)
                .execute(&mut **tx)
                .await?;
            Ok(Outcome::Done)
        }
    }
}

impl Store {
    /// Nodes changed at or after `since_ms` (every node for 0).
    pub async fn nodes_since(&self, since_ms: i64) -> Result<Vec<NodeRow>, BrokerError> {
        let rows = sqlx::query(
            "SELECT id, record, last_heartbeat, heartbeat_seq, reputation, updated_ms, reattest_asked, pow_failed_at, pow_reason FROM nodes WHERE updated_ms >= $1",
        )
        .bind(since_ms)
        .fetch_all(self.db.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(NodeRow {
                    id: r.try_get("id")?,
                    record: r.try_get("record")?,
                    last_heartbeat: r.try_get("last_heartbeat")?,
                    heartbeat_seq: r.try_get("heartbeat_seq")?,
                    reputation: r.try_get("reputation")?,
                    updated_ms: r.try_get("updated_ms")?,
                    reattest_asked: r.try_get("reattest_asked")?,
                    pow_failed_at: r.try_get("pow_failed_at")?,
                    pow_reason: r.try_get("pow_reason")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    /// Operator reputations.
    pub async fn operators(&self) -> Result<Vec<(String, i64)>, BrokerError> {
        let rows = sqlx::query("SELECT name, reputation FROM operators")
            .fetch_all(self.db.pool())
            .await?;
        rows.iter()
            .map(|r| Ok((r.try_get("name")?, r.try_get("reputation")?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }
}
