//! Nodes and registration: the nonce, registration (and re-attestation) on composite evidence
//! through `register.rs`'s checks, signed heartbeats, re-attestation asks, and what a node's
//! operator or an auditor sees of it.

use cgx_protocol::broker::{HeartbeatAnswer, NodeView, Registered, Registration};
use cgx_protocol::records::Tier;
use cgx_service::auth::Admin;

use super::error::BrokerError;
use super::index::{self, NodeRecord};
use super::store::{Archived, AuditWrite, NodeWrite};
use super::store::{Outcome, Refusal};
use super::{Broker, auditor, register};
use cgx_protocol::archive::Kind as ArchiveKind;

impl Broker {
    pub(crate) async fn nonce(&self) -> Result<cgx_protocol::broker::NonceResponse, BrokerError> {
        let (nonce, expires_at) = self
            .keys
            .make_nonce(self.clock.unix() + self.config.nonce_ttl_secs)?;
        Ok(cgx_protocol::broker::NonceResponse { nonce, expires_at })
    }

    /// Register (or re-attest) a node. `admin` must hold `operator:<the offer's operator>`.
    pub(crate) async fn register(
        &self,
        admin: &Admin,
        reg: Registration,
    ) -> Result<Registered, BrokerError> {
        register::check_offer(&reg.offer)?;
        admin.may(Some(&format!("operator:{}", reg.offer.operator)))?;
        let now = self.clock.unix();
        // Decoded once, here at the edge: every later step reads the bytes. The nonce first.
        let nonce = register::nonce(&reg)?;
        let nonce_expires_at = self.keys.check_nonce(&nonce, now)?;
        let decoded = register::decode(&reg, nonce, self.source.as_deref(), now)?;
        // Whoever registers holds the node key (evidence alone can bind anyone's public key).
        register::check_proof(&reg, &decoded)?;
        let id = cgx_protocol::broker::node_id(&decoded.node_key);
        if let Some(r) = self.index().record(&id)
            && r.operator != reg.offer.operator
        {
            return Err(BrokerError::Forbidden(format!(
                "node {id} belongs to operator {}",
                r.operator
            )));
        }
        // Spent before the costly part, whatever comes of it.
        let spent = self
            .store
            .write(NodeWrite::UseNonce {
                // Spent by its bytes' one spelling: another base64 spelling of the same nonce
                // is the same nonce.
                nonce: cgx_protocol::broker::b64(&decoded.nonce),
                expires_at: nonce_expires_at,
            })
            .await?;
        if !matches!(spent, Outcome::Done) {
            return Err(BrokerError::Nonce("already used: ask for a new one".into()));
        }
        // From here on the registration is a decision of the log's, accepted or refused: what
        // it rests on is archived under its digest, and its leaf names them (issue 33).
        let json = |r: serde_json::Result<String>| {
            r.map_err(|e| BrokerError::Internal(format!("archive: {e}")))
        };
        let pieces = vec![
            Archived::new(
                ArchiveKind::Registration,
                json(serde_json::to_string(&reg))?,
            ),
            Archived::new(
                ArchiveKind::Collateral,
                json(serde_json::to_string(&register::collateral_used(&decoded)))?,
            ),
        ];
        let operator = reg.offer.operator.clone();
        match self
            .register_appraised(reg, decoded, id.clone(), now, pieces.clone())
            .await
        {
            Ok(r) => Ok(r),
            Err(e) if refusal_is_decision(&e) => {
                let detail = serde_json::json!({
                    "operator": operator,
                    "reason": cgx_service::audit::cap(&e.to_string(), 1024),
                    "registration_sha256": pieces[0].sha256,
                    "collateral_sha256": pieces[1].sha256,
                });
                self.store
                    .write(AuditWrite {
                        at: now,
                        actor: format!("operator:{operator}"),
                        action: "node.register.refused",
                        subject: id,
                        detail,
                        archive: pieces,
                    })
                    .await?;
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// The rest of [`Self::register`], once the nonce is spent: appraise, check the
    /// inventory, store the signed record with its leaf.
    async fn register_appraised(
        &self,
        reg: Registration,
        decoded: register::Decoded,
        id: String,
        now: i64,
        mut pieces: Vec<Archived>,
    ) -> Result<Registered, BrokerError> {
        let appraiser = self.appraiser.clone();
        let at = time::OffsetDateTime::from_unix_timestamp(now)
            .map_err(|e| BrokerError::Internal(e.to_string()))?;
        let (decoded, appraisal) = tokio::task::spawn_blocking(move || {
            let a = register::appraise(&appraiser, &decoded, at);
            (decoded, a)
        })
        .await
        .map_err(|e| BrokerError::Internal(format!("appraisal task: {e}")))?;
        let appraisal = appraisal?;
        let proven = register::check_inventory(&reg.offer, &appraisal)?;
        let parts = appraisal.parts();
        let claims = serde_json::json!({
            "cpu": parts.first().map(|p| &p.claims),
            "gpus": parts.iter().skip(1).map(|p| &p.claims).collect::<Vec<_>>(),
        });
        let record = NodeRecord {
            id: id.clone(),
            node_key: reg.node_key.clone(),
            tee_thumbprint: decoded.tee_thumbprint.clone(),
            operator: reg.offer.operator.clone(),
            region: reg.offer.region.clone(),
            tee: proven.tee,
            sim: proven.sim,
            gpu_model: reg.offer.gpu_model.clone(),
            gpu_chip: proven.chip,
            gpu_count: reg.offer.gpu_count,
            gpu_memory_gib: reg.offer.gpu_memory_gib,
            price: reg.offer.price_per_gpu_hour_micros,
            status: appraisal.status(),
            violations: appraisal.violations(),
            attested_at: now,
            ear_expires_at: appraisal.ear().exp.unwrap_or(now),
            ear_digest: hex::encode(aws_lc_rs::digest::digest(
                &aws_lc_rs::digest::SHA256,
                appraisal.token().as_bytes(),
            )),
            claims,
        };
        let claimed = {
            let idx = self.index();
            idx.gpu_claimed_elsewhere(&record, now)
                .map(|(serial, owner)| {
                    // Another operator's node is not named to this one.
                    let same = idx
                        .record(&owner)
                        .is_some_and(|r| r.operator == record.operator);
                    (
                        serial,
                        if same {
                            owner
                        } else {
                            "of another operator".into()
                        },
                    )
                })
        };
        if let Some((serial, owner)) = claimed {
            return Err(BrokerError::Inventory(format!(
                "GPU {serial} is already offered by node {owner}, which is attested and live"
            )));
        }
        let token = self.keys.sign_record(&record)?;
        let ear = Archived::new(ArchiveKind::Ear, appraisal.token().to_string());
        let leaf = serde_json::json!({
            "operator": record.operator,
            "node_key": record.node_key,
            "tee_thumbprint": record.tee_thumbprint,
            "tee": record.tee,
            "sim": record.sim,
            "status": record.status,
            "violations": record.violations.iter().take(32).map(|v| cgx_service::audit::cap(v, 512)).collect::<Vec<_>>(),
            "gpu_chip": record.gpu_chip,
            "gpus": index::serials(&record),
            "attested_at": record.attested_at,
            "ear_expires_at": record.ear_expires_at,
            "ear_sha256": ear.sha256,
            "record_sha256": cgx_protocol::archive::address(token.as_bytes()),
            "registration_sha256": pieces[0].sha256,
            "collateral_sha256": pieces.get(1).map(|p| p.sha256.clone()),
        });
        pieces.push(ear);
        let f = self.index().freshness();
        let written = self
            .store
            .write(NodeWrite::Register {
                id: id.clone(),
                operator: record.operator.clone(),
                record: token.clone(),
                attested_at: now,
                now_ms: self.now_ms(),
                gpus: index::serials(&record),
                live_after: now
                    .saturating_sub(f.heartbeat_secs.saturating_mul(f.missed_heartbeats)),
                attested_after: now.saturating_sub(f.reattest_secs),
                leaf,
                archive: pieces,
            })
            .await?;
        match written {
            Outcome::Done => {}
            Outcome::Refused(Refusal::GpuOffered { serial, node }) => {
                return Err(BrokerError::Inventory(format!(
                    "GPU {serial} is already offered by node {node}, which is attested and live"
                )));
            }
            _ => {
                return Err(BrokerError::Internal(
                    "the node record was not stored".into(),
                ));
            }
        }
        // A node this replica indexes keeps its allocations (and reservations in flight); a new
        // one (or one another replica registered) reads them.
        let known = self.index().record(&id).is_some();
        let used = if known {
            None
        } else {
            Some(
                self.store
                    .allocations(
                        Some(std::slice::from_ref(&id)),
                        now - self.config.lease_ttl_secs,
                        self.config.lease_ttl_secs,
                        &self.keys.public,
                    )
                    .await?
                    .get(&id)
                    .cloned()
                    .unwrap_or_default(),
            )
        };
        let fresh_until;
        {
            let mut idx = self.index();
            match used {
                None if idx.refresh(record.clone(), token.clone(), now) => {}
                _ => {
                    let used = used.unwrap_or_default();
                    idx.upsert(record.clone(), token, 0, now, 0, used.gpus);
                    idx.set_use(&id, &used);
                }
            }
            idx.wrote(&id);
            fresh_until = idx.fresh_until(&record);
        }
        self.metrics.event(
            "register",
            if record.status == Tier::Affirming {
                "affirming"
            } else {
                "not_affirming"
            },
        );
        tracing::info!(node = %id, status = %record.status, operator = %record.operator, gpus = record.gpu_count, "node attested");
        self.place_pending().await;
        Ok(Registered {
            node_id: id,
            status: record.status,
            ear: appraisal.token().to_string(),
            violations: record.violations,
            attested_at: now,
            fresh_until,
            heartbeat_secs: self.config.heartbeat_secs as u64,
        })
    }

    /// A record of kind `T` node `id` signed (`token`: EdDSA JWS under its attested key),
    /// living at most `max_lifetime`, and the node's record. A token of another kind or
    /// audience is refused as `{not_kind} {id}`, a bad signature or time as not the node's;
    /// each through `refused` (the caller's error).
    /// Node `id`'s record and its attested node key (Ed25519), from this broker's index.
    pub(super) fn node_key(
        &self,
        id: &str,
    ) -> Result<(std::sync::Arc<NodeRecord>, [u8; 32]), BrokerError> {
        let record = self
            .index()
            .record(id)
            .ok_or_else(|| BrokerError::NotFound(format!("node {id}")))?;
        let key: [u8; 32] = cgx_protocol::broker::unb64(&record.node_key)
            .and_then(|k| k.try_into().ok())
            .ok_or_else(|| BrokerError::Internal("stored node key".into()))?;
        Ok((record, key))
    }

    pub(super) fn node_signed<T: cgx_protocol::signed::Record>(
        &self,
        id: &str,
        token: &str,
        max_lifetime: i64,
        not_kind: &str,
        refused: fn(String) -> BrokerError,
    ) -> Result<(std::sync::Arc<NodeRecord>, T), BrokerError> {
        use cgx_protocol::signed::{SignedError, When};
        let (record, key) = self.node_key(id)?;
        let body = cgx_protocol::signed::verify::<T>(
            token,
            &[key],
            When::At {
                now: self.clock.unix(),
                max_lifetime,
            },
        )
        .map_err(|e| match e {
            SignedError::WrongKind { .. }
            | SignedError::WrongAudience { .. }
            | SignedError::Claims { .. } => refused(format!("{not_kind} {id}: {e}")),
            e => refused(format!("not signed by node {id}'s attested key: {e}")),
        })?
        .body;
        Ok((record, body))
    }

    /// A signed heartbeat from node `id` (`token`: EdDSA JWS under its attested key).
    pub(crate) async fn heartbeat(
        &self,
        id: &str,
        token: &str,
    ) -> Result<HeartbeatAnswer, BrokerError> {
        let now = self.clock.unix();
        let (record, heartbeat) = self.node_signed::<cgx_protocol::records::Heartbeat>(
            id,
            token,
            60,
            "the token is not a heartbeat of node",
            BrokerError::Heartbeat,
        )?;
        if heartbeat.sub != id {
            return Err(BrokerError::Heartbeat(format!(
                "the token is not a heartbeat of node {id}"
            )));
        }
        let seq = i64::try_from(heartbeat.seq)
            .ok()
            .filter(|s| *s > 0)
            .ok_or_else(|| BrokerError::Heartbeat("no positive seq".into()))?;
        let written = self
            .store
            .write(NodeWrite::Heartbeat {
                id: id.to_string(),
                seq,
                at: now,
                now_ms: self.now_ms(),
            })
            .await?;
        if !matches!(written, Outcome::Done) {
            return Err(BrokerError::Heartbeat(format!(
                "sequence {seq} is not past the last one (replayed?)"
            )));
        }
        let (placeable, fresh_until, asked) = {
            let mut idx = self.index();
            idx.heartbeat(id, seq, now);
            (
                idx.placeable(id, now),
                idx.fresh_until(&record),
                idx.reattest_asked(id),
            )
        };
        let unplaceable = match &placeable {
            Some(Err(u)) => Some(u.to_string()),
            _ => None,
        };
        // Re-attest in the last fifth of the interval, or at once when not placeable for a
        // reason re-attestation can fix.
        let reattest = asked
            || now >= fresh_until - self.config.reattest_secs / 5
            || matches!(
                placeable,
                Some(Err(index::Unplaceable::AttestationLapsed { .. }
                    | index::Unplaceable::GpuMoved { .. }))
            );
        let leases = if placeable == Some(Ok(())) {
            self.renew_leases(id, now).await?
        } else {
            Vec::new()
        };
        let challenges = self.pow_challenges(&record, &leases).await?;
        Ok(HeartbeatAnswer {
            reattest,
            unplaceable,
            leases,
            challenges,
        })
    }

    /// Ask node `id` to re-attest at its next heartbeat (its operator, an auditor or `*`): the
    /// answer says so until it registers again. It stays placeable meanwhile — its current
    /// result is still fresh; asking is how an operator rolls a new policy or TCB out early.
    pub(crate) async fn ask_reattest(
        &self,
        admin: &Admin,
        id: &str,
    ) -> Result<NodeView, BrokerError> {
        let view = self.node_for(admin, id)?;
        let out = self
            .store
            .write(NodeWrite::AskReattest {
                id: id.to_string(),
                at: self.clock.unix(),
                now_ms: self.now_ms(),
            })
            .await?;
        if !matches!(out, Outcome::Done) {
            return Err(BrokerError::NotFound(format!("node {id}")));
        }
        self.index().ask_reattest(id, true);
        tracing::info!(node = %id, by = %admin.actor(), "re-attestation asked");
        Ok(NodeView {
            reattest_asked: true,
            ..view
        })
    }

    /// A node as `cgx node show` reports it.
    pub(crate) fn node_view(&self, id: &str, with_claims: bool) -> Option<NodeView> {
        let now = self.clock.unix();
        let idx = self.index();
        node_view_in(&idx, id, with_claims, now)
    }

    /// A page of nodes by id after `after` whose operator `shown` accepts, at most `limit`,
    /// under one lock of the index; and the cursor of the next page, if there is one.
    pub(crate) fn nodes_page(
        &self,
        after: Option<&str>,
        limit: usize,
        shown: impl Fn(&str) -> bool,
    ) -> (Vec<NodeView>, Option<String>) {
        let now = self.clock.unix();
        let idx = self.index();
        let mut out = Vec::with_capacity(limit);
        let mut next = None;
        for id in idx.ids_after(after) {
            if !idx.operator_of(id).is_some_and(&shown) {
                continue;
            }
            if out.len() == limit {
                next = out.last().map(|v: &NodeView| v.id.clone());
                break;
            }
            if let Some(v) = node_view_in(&idx, id, false, now) {
                out.push(v);
            }
        }
        (out, next)
    }

    /// The nodes `admin` may see.
    pub(crate) fn nodes(&self, admin: &Admin) -> Vec<NodeView> {
        let all = auditor(admin);
        let ids = self.index().ids();
        ids.iter()
            .filter_map(|id| self.node_view(id, false))
            .filter(|n| all || admin.may(Some(&format!("operator:{}", n.operator))).is_ok())
            .collect()
    }

    /// [`Broker::node_for`] with the node's latest proofs.
    pub(crate) async fn node_show(&self, admin: &Admin, id: &str) -> Result<NodeView, BrokerError> {
        let mut v = self.node_for(admin, id)?;
        v.proofs = self
            .store
            .pow_history(id, 8)
            .await?
            .into_iter()
            .map(|c| cgx_protocol::broker::ProofView {
                challenge: c.id,
                lease: c.lease_id,
                gpu: c.gpu,
                n: c.n,
                state: c.state,
                reason: c.reason,
                issued_ms: c.issued_ms,
                gpu_us: c.gpu_us,
            })
            .collect();
        Ok(v)
    }

    pub(crate) fn node_for(&self, admin: &Admin, id: &str) -> Result<NodeView, BrokerError> {
        let n = self
            .node_view(id, true)
            .ok_or_else(|| BrokerError::NotFound(format!("node {id}")))?;
        if auditor(admin) || admin.may(Some(&format!("operator:{}", n.operator))).is_ok() {
            Ok(n)
        } else {
            // Not someone else's node to this caller: the same answer as no node at all.
            Err(BrokerError::NotFound(format!("node {id}")))
        }
    }
}

/// [`Broker::node_view`] under a lock of the index already held.
fn node_view_in(idx: &index::Index, id: &str, with_claims: bool, now: i64) -> Option<NodeView> {
    let r = idx.record(id)?;
    let placeable = idx.placeable(id, now)?;
    let (last, _) = idx.last_heartbeat(id)?;
    Some(NodeView {
        id: r.id.clone(),
        operator: r.operator.clone(),
        region: r.region.clone(),
        tee: r.tee,
        sim: r.sim,
        gpu_model: r.gpu_model.clone(),
        gpu_chip: r.gpu_chip.clone(),
        gpu_count: r.gpu_count,
        gpu_memory_gib: r.gpu_memory_gib,
        free_gpus: idx.free_gpus(id).unwrap_or(0),
        price_per_gpu_hour_micros: r.price,
        reputation: idx.reputation(id).unwrap_or(0),
        status: r.status,
        placeable: placeable.is_ok(),
        reason: placeable.err().map(|u| u.to_string()).unwrap_or_default(),
        violations: r.violations.clone(),
        attested_at: r.attested_at,
        fresh_until: idx.fresh_until(&r),
        last_heartbeat: last,
        reattest_asked: idx.reattest_asked(id),
        claims: with_claims.then(|| r.claims.clone()),
        proofs: Vec::new(),
    })
}

/// Whether a registration's refusal is the broker's decision on the evidence or the offer (a
/// leaf of the log), rather than a failure to decide (storage, internal).
fn refusal_is_decision(e: &BrokerError) -> bool {
    matches!(
        e,
        BrokerError::Evidence { .. }
            | BrokerError::Inventory(_)
            | BrokerError::BadRequest(_)
            | BrokerError::Forbidden(_)
            | BrokerError::Conflict(_)
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::super::testing::{Harness, OPERATOR, Role};
    use super::*;

    /// A node registers on its simulated evidence and is placeable; its nonce is spent, so the
    /// same registration again is refused before its evidence is looked at.
    #[tokio::test]
    async fn a_node_registers_on_its_evidence_and_its_nonce_is_spent_once() {
        let h = Harness::new("nodes-register").await;
        let node = h.node(2);
        let nonce = h.broker.nonce().await.unwrap().nonce;
        let reg = node.registration(&nonce);
        let done = h
            .broker
            .register(&h.admin(Role::Operator), reg.clone())
            .await
            .unwrap();
        assert_eq!(done.node_id, node.id);
        assert_eq!(done.status, Tier::Affirming, "{:?}", done.violations);
        let view = h.broker.node_view(&node.id, false).unwrap();
        assert!(view.placeable, "{}", view.reason);
        assert_eq!((view.free_gpus, view.operator.as_str()), (2, OPERATOR));
        let again = h.broker.register(&h.admin(Role::Operator), reg).await;
        assert!(matches!(again, Err(BrokerError::Nonce(_))), "{again:?}");
    }

    /// What the evidence does not prove is refused: more GPUs than GPU reports, and an offer
    /// made by someone who is not its operator.
    #[tokio::test]
    async fn registration_refuses_what_the_evidence_or_the_caller_does_not_prove() {
        let h = Harness::new("nodes-refuse").await;
        let mut node = h.node(1);
        node.offer.gpu_count = 2;
        let e = h.register(&node).await.unwrap_err();
        assert!(matches!(e, BrokerError::Inventory(_)), "{e}");
        node.offer.gpu_count = 1;
        let nonce = h.broker.nonce().await.unwrap().nonce;
        let e = h
            .broker
            .register(&h.admin(Role::Tenant), node.registration(&nonce))
            .await
            .unwrap_err();
        assert!(matches!(e, BrokerError::Forbidden(_)), "{e}");
        assert!(h.broker.node_view(&node.id, false).is_none());
        // The inventory refusal, made after the nonce was spent, is a leaf with its reason and
        // the evidence it was made on; the caller refused before (not the operator) is none.
        let events = cgx_service::audit::read(h.broker.store.db.pool(), 0, 1000)
            .await
            .unwrap();
        let refused: Vec<_> = events
            .iter()
            .filter(|e| e.action == "node.register.refused")
            .collect();
        assert_eq!(refused.len(), 1, "{events:?}");
        assert_eq!(refused[0].subject, node.id);
        assert!(
            refused[0].detail["reason"]
                .as_str()
                .unwrap()
                .starts_with("inventory:"),
            "{refused:?}"
        );
        let sha = refused[0].detail["registration_sha256"].as_str().unwrap();
        let (kind, doc) = h.broker.store.archived(sha).await.unwrap().unwrap();
        assert_eq!(kind, "registration");
        let reg: cgx_protocol::broker::Registration = serde_json::from_str(&doc).unwrap();
        assert_eq!(reg.offer.gpu_count, 2);
        assert!(!events.iter().any(|e| e.action == "node.register"));
    }

    /// Heartbeats are the node's own, in sequence: a replayed one and one another node signed
    /// are refused; without heartbeats the node stops being placeable on the clock.
    #[tokio::test]
    async fn heartbeats_are_the_nodes_own_in_sequence_and_lapse_on_the_clock() {
        let h = Harness::new("nodes-heartbeat").await;
        let (node, other) = (h.node(1), h.node(1));
        h.register(&node).await.unwrap();
        h.register(&other).await.unwrap();
        let token = node.heartbeat_token(h.now());
        let answer = h.broker.heartbeat(&node.id, &token).await.unwrap();
        assert!(!answer.reattest && answer.unplaceable.is_none() && answer.leases.is_empty());
        let replay = h.broker.heartbeat(&node.id, &token).await.unwrap_err();
        assert!(
            matches!(&replay, BrokerError::Heartbeat(m) if m.contains("not past")),
            "{replay}"
        );
        let forged = other.heartbeat_token(h.now());
        let e = h.broker.heartbeat(&node.id, &forged).await.unwrap_err();
        assert!(
            matches!(&e, BrokerError::Heartbeat(m) if m.contains("not signed by")),
            "{e}"
        );
        // Three missed heartbeats of five seconds.
        h.clock.advance(16);
        let view = h.broker.node_view(&node.id, false).unwrap();
        assert!(!view.placeable && !view.reason.is_empty(), "{view:?}");
        h.heartbeat(&node).await.unwrap();
        assert!(h.broker.node_view(&node.id, false).unwrap().placeable);
    }

    /// A node is its operator's and auditors' to see; to a tenant it does not exist. An
    /// operator's ask to re-attest reaches the node in its next heartbeat's answer.
    #[tokio::test]
    async fn nodes_are_seen_by_their_operator_and_asked_to_reattest() {
        let h = Harness::new("nodes-views").await;
        let node = h.node(1);
        h.register(&node).await.unwrap();
        let tenant = h.admin(Role::Tenant);
        assert!(matches!(
            h.broker.node_for(&tenant, &node.id),
            Err(BrokerError::NotFound(_))
        ));
        assert!(h.broker.nodes(&tenant).is_empty());
        assert_eq!(h.broker.nodes(&h.admin(Role::Auditor)).len(), 1);
        let view = h
            .broker
            .node_for(&h.admin(Role::Operator), &node.id)
            .unwrap();
        assert!(view.claims.is_some());
        assert!(matches!(
            h.broker.ask_reattest(&tenant, &node.id).await,
            Err(BrokerError::NotFound(_))
        ));
        let asked = h
            .broker
            .ask_reattest(&h.admin(Role::Operator), &node.id)
            .await
            .unwrap();
        assert!(asked.reattest_asked && asked.placeable);
        assert!(h.heartbeat(&node).await.unwrap().reattest);
        // Registering again answers the ask.
        h.register(&node).await.unwrap();
        assert!(!h.heartbeat(&node).await.unwrap().reattest);
    }
}
