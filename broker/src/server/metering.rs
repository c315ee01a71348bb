//! Metering records: a node sends, window by window, what each of its leases used, signed by
//! its attested key and chained (`cgx_protocol::metering`). The broker accepts each record
//! once, as the next link of its lease's chain — the lease this broker signed, on this node —
//! and stores it; a refusal says why, is logged, and changes nothing.

use cgx_protocol::broker::MeteringAnswer;
use cgx_protocol::metering::{
    Chain, MeteringError, MeteringRecord, check, token_hash, verify_record,
};
use cgx_protocol::signed::{When, verify};

use super::Broker;
use super::error::BrokerError;
use super::store::{AuditWrite, LedgerWrite, MeteringWrite, Outcome, Refusal};

impl Broker {
    /// Slash the operator of `lease` for two records of window `seq`: what it says.
    async fn slash_equivocation(&self, lease: &str, seq: u64) -> Result<String, BrokerError> {
        let Some(e) = self.store.escrow(lease).await? else {
            return Ok("no escrow to slash for".into());
        };
        let w = LedgerWrite::Slash {
            operator: e.escrow.operator.clone(),
            tenant: e.escrow.tenant.clone(),
            lease: lease.to_string(),
            cheat: format!("equivocation/{lease}/{seq}"),
            per_gpu: self.config.ledger.slash_per_gpu_micros,
            gpus: e.escrow.price.gpus,
            at: self.clock.unix(),
            half_life: self.config.reputation.half_life_secs,
            now_ms: self.now_ms(),
        };
        self.metrics.event("metering", "equivocation");
        tracing::warn!(%lease, seq, operator = %e.escrow.operator, "two records of one window under one key: slashed");
        Ok(match self.store.write(w).await? {
            Outcome::Items(i) if matches!(i.first(), Some(Ok(true))) => {
                format!(
                    "operator {}'s stake is slashed to tenant {}",
                    e.escrow.operator, e.escrow.tenant
                )
            }
            _ => format!(
                "operator {} was slashed for this window before, or holds no stake",
                e.escrow.operator
            ),
        })
    }

    /// Accept node `id`'s metering record `token`.
    pub(crate) async fn metering(
        &self,
        id: &str,
        token: &str,
    ) -> Result<MeteringAnswer, BrokerError> {
        let now = self.clock.unix();
        let (_, key) = self.node_key(id)?;
        // A token the node's attested key did not sign is nobody's decision to log: refused
        // here, before anything is written.
        let r = verify_record(&key, token, now).map_err(|e| {
            let e = BrokerError::Metering(format!("not a metering record of node {id}: {e}"));
            tracing::warn!(node = %id, error = %e, "metering record refused");
            e
        })?;
        let (lease, seq) = (r.lease.clone(), r.seq);
        let out = self.metering_inner(id, key, r, token, now).await;
        if let Err(e) = &out {
            tracing::warn!(node = %id, error = %e, "metering record refused");
            // The node's own record, refused: a leaf of the log (issue 33), durable before the
            // refusal is answered. A failure to decide (storage) is not a refusal.
            if !matches!(e, BrokerError::Storage(_) | BrokerError::Internal(_)) {
                self.store
                    .write(AuditWrite {
                        at: now,
                        actor: format!("node:{id}"),
                        action: "metering.refuse",
                        subject: lease,
                        // The refused record itself, as the node signed it: an auditor checks
                        // an equivocation (two records of one window) from the leaves alone.
                        detail: serde_json::json!({
                            "seq": seq.to_string(),
                            "record_sha256": token_hash(token),
                            "record": token,
                            "reason": cgx_service::audit::cap(&e.to_string(), 1024),
                        }),
                        archive: Vec::new(),
                    })
                    .await?;
            }
        }
        out
    }

    async fn metering_inner(
        &self,
        id: &str,
        key: [u8; 32],
        r: MeteringRecord,
        token: &str,
        now: i64,
    ) -> Result<MeteringAnswer, BrokerError> {
        let (row, ended_at) = self
            .store
            .lease_any(&r.lease)
            .await?
            .ok_or_else(|| BrokerError::NotFound(format!("lease {}", r.lease)))?;
        // The lease must be this node's, signed by this broker: the row alone proves nothing.
        let Some(signed) = self.keys.lease_of(&row).filter(|_| row.node_id == id) else {
            return Err(BrokerError::Conflict(format!(
                "lease {} is not a lease of node {id} from this broker",
                r.lease
            )));
        };
        let chain = Chain {
            lease: row.id.clone(),
            node: id.to_string(),
            node_key: key,
            start: row.started_at,
            window_secs: signed.window(),
            // The lease runs to its token's end at most, whenever the monitor ends it: a
            // window that starts after is refused (and so never billed).
            ended_at: match ended_at {
                Some(e) => Some(e.min(row.ends_at)),
                None if now >= row.ends_at => Some(row.ends_at),
                None => None,
            },
            gpus: row.gpus.clone(),
            last: self.store.metering_last(&row.id).await?,
        };
        let prev = chain
            .last
            .as_ref()
            .map(|(_, h)| h.clone())
            .unwrap_or_default();
        let accepted = match check(&chain, r.clone(), token, now) {
            Ok(a) => a,
            // A record of a window already accepted: say which record was, so a node whose
            // answer was lost goes on from the one the broker holds.
            Err(e @ MeteringError::Duplicate { got, .. }) => {
                let held_token = self
                    .store
                    .metering(&row.id)
                    .await?
                    .into_iter()
                    .find(|(s, _)| *s == got)
                    .map(|(_, t)| t);
                let held = held_token.as_deref().map(token_hash).unwrap_or_default();
                // Two different records of one window, both under the node's attested key,
                // are a proven cheat (an honest agent makes each window's record once and
                // only re-signs it on a retry): the operator's stake is slashed, once per
                // window. A record that differs only in its signature's times is a retry.
                let equivocated = held_token.as_deref().and_then(|t| {
                    verify::<MeteringRecord>(t, &[key], When::Any)
                        .ok()
                        .map(|h| h.body != r)
                });
                if equivocated == Some(true) {
                    let slashed = self.slash_equivocation(&row.id, got).await?;
                    return Err(BrokerError::Conflict(format!(
                        "{e}; accepted as {held}; this record differs from it under the same key: {slashed}"
                    )));
                }
                return Err(BrokerError::Conflict(format!("{e}; accepted as {held}")));
            }
            Err(e) => return Err(BrokerError::Conflict(e.to_string())),
        };
        let seq = accepted.record.seq;
        let write = MeteringWrite::Append {
            node: id.to_string(),
            lease: row.id.clone(),
            seq: i64::try_from(seq).map_err(|_| BrokerError::BadRequest("sequence".into()))?,
            prev,
            hash: accepted.hash.clone(),
            token: token.to_string(),
            at: now,
        };
        match self.store.write(write).await? {
            Outcome::Done => {
                tracing::debug!(node = %id, lease = %row.id, seq, "metering record accepted");
                Ok(MeteringAnswer {
                    lease: row.id,
                    seq,
                    hash: accepted.hash,
                })
            }
            Outcome::Refused(Refusal::MeteringMoved) => Err(BrokerError::Conflict(format!(
                "lease {}'s metering chain moved: sequence {seq} or its predecessor was accepted meanwhile",
                row.id
            ))),
            other => Err(BrokerError::Internal(format!("metering write: {other:?}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::testing::{Harness, Role};
    use super::*;
    use cgx_protocol::metering::{GpuUsage, MeteringRecord, WINDOW_SECS, genesis};
    use cgx_protocol::records::WorkloadState;
    use cgx_protocol::signed::Signer;

    fn record(
        node: &str,
        lease: &str,
        start: i64,
        seq: u64,
        gpus: &[u32],
        prev: String,
    ) -> MeteringRecord {
        MeteringRecord {
            sub: node.to_string(),
            lease: lease.to_string(),
            seq,
            window_start: start + i64::from(WINDOW_SECS) * seq as i64,
            window_secs: WINDOW_SECS,
            gpus: gpus
                .iter()
                .map(|&index| GpuUsage {
                    index,
                    utilization_pct: 90,
                    memory_used_mib: 1024,
                    temperature_c: 60,
                    power_mw: 300_000,
                    ecc_corrected: 0,
                    ecc_uncorrected: 0,
                    throttle_reasons: 0,
                })
                .collect(),
            pow: None,
            workload: WorkloadState::Running,
            prev,
        }
    }

    /// A lease's records accepted window by window and stored; each bad one refused with its
    /// reason (and the chain unchanged): a duplicate, a gap, another node's key, another
    /// node's lease, an unknown lease, a window not closed yet; the chain survives the broker's
    /// restart on the same database. On SQLite, and on PostgreSQL where CI names one, where two
    /// replicas also race: one record per window, one chain.
    #[tokio::test]
    async fn a_leases_records_are_accepted_once_in_order_and_kept() {
        scenario(Harness::new("metering").await, false).await;
        match Harness::postgres().await {
            Some(db) => {
                // Replicas on one database share the key their EARs are signed with.
                let ear = std::env::temp_dir()
                    .join(format!("cgx-metering-ear-{}.pk8", std::process::id()));
                let key = aws_lc_rs::signature::EcdsaKeyPair::generate_pkcs8(
                    &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
                    &aws_lc_rs::rand::SystemRandom::new(),
                )
                .unwrap();
                std::fs::write(&ear, key.as_ref()).unwrap();
                let h = Harness::with("metering-pg", |c| {
                    c.database = db;
                    c.result_key = Some(ear);
                })
                .await;
                scenario(h, true).await;
            }
            None => eprintln!("SKIPPED (PostgreSQL part): CGX_TEST_DATABASE_URL is not set"),
        }
    }

    async fn scenario(mut h: Harness, replicas: bool) {
        let node = h.node(2);
        let other = h.node(1);
        h.register(&node).await.unwrap();
        h.register(&other).await.unwrap();
        let tenant = h.admin(Role::Tenant);
        let job = h
            .broker
            .submit(&tenant, Harness::job(2, 3600))
            .await
            .unwrap();
        let lease = job.lease_id.clone().unwrap();
        let placed_on = job.node_id.clone().unwrap();
        let (me, them) = if placed_on == node.id {
            (&node, &other)
        } else {
            (&other, &node)
        };
        let row = h.broker.store.lease_any(&lease).await.unwrap().unwrap().0;
        let signer = Signer::from_pkcs8(&me.node_key).unwrap();
        let sign = |r: &MeteringRecord, at: i64| signer.sign(r, at, at + 300).unwrap();
        let start = row.started_at;
        // The signed lease says when it began: the node counts its windows from there.
        assert_eq!(h.broker.keys.lease_of(&row).unwrap().start, start);
        let mut prev = genesis(&lease);
        let mut tokens = Vec::new();
        for seq in 0..3 {
            h.clock
                .set(start + i64::from(WINDOW_SECS) * (seq as i64 + 1) + 1);
            let t = sign(
                &record(&me.id, &lease, start, seq, &row.gpus, prev.clone()),
                h.now(),
            );
            let a = h.broker.metering(&me.id, &t).await.unwrap();
            assert_eq!(a.seq, seq);
            prev = a.hash;
            tokens.push(t);
        }
        let now = h.now();
        let refused = |e: BrokerError| e.to_string();
        for (token, node_id, why) in [
            (
                tokens[2].clone(),
                me.id.clone(),
                "sequence 2 already accepted",
            ),
            (
                sign(
                    &record(&me.id, &lease, start, 4, &row.gpus, prev.clone()),
                    now,
                ),
                me.id.clone(),
                "sequence 4 skips ahead: 3 is next",
            ),
            (
                sign(
                    &record(&me.id, &lease, start, 3, &row.gpus, prev.clone()),
                    now,
                ),
                me.id.clone(),
                "has not closed yet",
            ),
            (
                sign(
                    &record(&me.id, "lnone", start, 0, &row.gpus, genesis("lnone")),
                    now,
                ),
                me.id.clone(),
                "lease lnone not found",
            ),
            (
                Signer::from_pkcs8(&them.node_key)
                    .unwrap()
                    .sign(
                        &record(&them.id, &lease, start, 3, &row.gpus, prev.clone()),
                        now,
                        now + 300,
                    )
                    .unwrap(),
                them.id.clone(),
                "is not a lease of node",
            ),
            (
                Signer::from_pkcs8(&them.node_key)
                    .unwrap()
                    .sign(
                        &record(&me.id, &lease, start, 3, &row.gpus, prev.clone()),
                        now,
                        now + 300,
                    )
                    .unwrap(),
                me.id.clone(),
                "not a metering record of node",
            ),
        ] {
            let e = refused(h.broker.metering(&node_id, &token).await.unwrap_err());
            assert!(e.contains(why), "{why}: {e}");
        }
        // A duplicate says which record the broker holds for that window: a node whose answer
        // was lost goes on from it (the same record signed twice has two hashes).
        let resigned = sign(
            &record(
                &me.id,
                &lease,
                start,
                2,
                &row.gpus,
                cgx_protocol::metering::token_hash(&tokens[1]),
            ),
            now + 1,
        );
        assert_ne!(resigned, tokens[2]);
        let e = refused(h.broker.metering(&me.id, &resigned).await.unwrap_err());
        assert!(
            e.ends_with(&format!(
                "accepted as {}",
                cgx_protocol::metering::token_hash(&tokens[2])
            )),
            "{e}"
        );
        // A different record of that window under the same key is a proven cheat: the
        // operator's stake is slashed to the tenant, once per window.
        h.deposit("stake/op1", 250_000_000, "bond-1").await.unwrap();
        let tenant = cgx_ledger::AccountId::new(cgx_ledger::Role::Tenant, "acme").unwrap();
        let before = h.broker.store.account(&tenant).await.unwrap();
        let other = sign(
            &record(&me.id, &lease, start, 2, &row.gpus, genesis("x")),
            now,
        );
        let e = refused(h.broker.metering(&me.id, &other).await.unwrap_err());
        assert!(
            e.contains(
                "differs from it under the same key: operator op1's stake is slashed to tenant acme"
            ),
            "{e}"
        );
        let after = h.broker.store.account(&tenant).await.unwrap();
        let gpus = row.gpus.len() as i128;
        assert_eq!(
            after.net_posted() - before.net_posted(),
            gpus * 100_000_000,
            "100 units per GPU of the lease"
        );
        let e = refused(h.broker.metering(&me.id, &other).await.unwrap_err());
        assert!(e.contains("was slashed for this window before"), "{e}");
        assert_eq!(h.broker.store.account(&tenant).await.unwrap(), after);
        assert_eq!(h.broker.store.metering(&lease).await.unwrap().len(), 3);
        // After a restart on the same database, the chain goes on from what was stored.
        h.restart().await;
        h.clock.set(start + i64::from(WINDOW_SECS) * 4 + 1);
        let t = sign(
            &record(&me.id, &lease, start, 3, &row.gpus, prev.clone()),
            h.now(),
        );
        let a = h.broker.metering(&me.id, &t).await.unwrap();
        assert_eq!(a.seq, 3);
        let stored = h.broker.store.metering(&lease).await.unwrap();
        assert_eq!(
            stored.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        assert_eq!(stored[3].1, t);
        if !replicas {
            return;
        }
        // Two replicas, two rival records of window 4 at once: one is accepted, the other
        // refused; the next window links only to the one accepted.
        let second = h.replica().await;
        h.clock.set(start + i64::from(WINDOW_SECS) * 5 + 1);
        let mut rival = record(&me.id, &lease, start, 4, &row.gpus, a.hash.clone());
        let first = sign(&rival, h.now());
        rival.gpus[0].utilization_pct = 1;
        let other_one = sign(&rival, h.now());
        let (r1, r2) = tokio::join!(
            h.broker.metering(&me.id, &first),
            second.metering(&me.id, &other_one)
        );
        let (won, lost) = match (r1, r2) {
            (Ok(w), Err(e)) => (w, e),
            (Err(e), Ok(w)) => (w, e),
            (a, b) => panic!("one of two rival records must win: {a:?} {b:?}"),
        };
        let lost = refused(lost);
        assert!(
            lost.contains("already accepted") || lost.contains("chain moved"),
            "the loser is refused as a duplicate or as the chain having moved: {lost}"
        );
        let stored = h.broker.store.metering(&lease).await.unwrap();
        assert_eq!(stored.len(), 5);
        h.clock.set(start + i64::from(WINDOW_SECS) * 6 + 1);
        let loser_hash = if won.hash == cgx_protocol::metering::token_hash(&first) {
            cgx_protocol::metering::token_hash(&other_one)
        } else {
            cgx_protocol::metering::token_hash(&first)
        };
        let on_loser = sign(
            &record(&me.id, &lease, start, 5, &row.gpus, loser_hash),
            h.now(),
        );
        let e = refused(second.metering(&me.id, &on_loser).await.unwrap_err());
        assert!(e.contains("is not the hash of the record before"), "{e}");
        let on_winner = sign(
            &record(&me.id, &lease, start, 5, &row.gpus, won.hash),
            h.now(),
        );
        assert_eq!(second.metering(&me.id, &on_winner).await.unwrap().seq, 5);
    }
}
