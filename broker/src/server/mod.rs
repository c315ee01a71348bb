//! The broker service: configuration → state ([`Broker`]) → router (`http`) → `cgx-service`'s
//! listener, with the monitor (freshness, failover, completion, pending placement, replica
//! sync) as a background task.
//!
//! - `index.rs`: the in-memory registry placement decides on (pure, time-explicit);
//! - `register.rs`: registration on composite evidence and the inventory check;
//! - `store.rs`: the database (the truth), atomic capacity;
//! - `lease.rs`: signed records and lease tokens;
//! - `http.rs`: routes and handlers that validate and delegate here.

pub mod config;
mod error;
mod http;
pub mod index;
mod lease;
mod register;
mod settings;
pub mod store;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cgx_attestation::collateral::CollateralStore;
use cgx_attestation::collateral::fetch::CollateralSource;
use cgx_attestation::results::ResultSigner;
use cgx_attestation::{SimTrust, Verifier, VerifierConfig};
use cgx_policies::placement::PlacementPolicy;
use cgx_policies::{Appraiser, PolicyEngine};
use cgx_protocol::broker::{HeartbeatAnswer, JobSpec, JobView, NodeView, Registered, Registration};
use cgx_protocol::money::Micros;
use cgx_protocol::records::Tier;
use cgx_service::auth::{Admin, AdminKeys, AdminState};
use cgx_service::metrics::Metrics;
use cgx_service::{Background, SharedClock, jwt};

pub use config::BrokerConfig;
pub use error::BrokerError;

use index::{Freshness, Index, Misfit, NodeRecord, Requirements};
use store::{JobRow, JobState, LeaseRow, Outcome, PlacementRow, Refusal, Store, Write};

/// How long a tenant's placement policy may take to compile (64 KiB at most).
const POLICY_COMPILE_TIME: Duration = Duration::from_secs(2);

/// The most jobs one listing returns.
pub const MAX_LIST: i64 = 1000;

/// The state every handler shares.
pub(crate) struct Broker {
    pub(crate) store: Store,
    appraiser: Arc<Appraiser>,
    source: Option<Arc<CollateralSource>>,
    pub(crate) index: Mutex<Index>,
    pub(crate) keys: lease::Keys,
    api_keys: AdminKeys,
    pub(crate) clock: SharedClock,
    pub(crate) metrics: Arc<Metrics>,
    config: BrokerConfig,
    /// Compiled placement policies of pending jobs, by job id.
    policies: Mutex<HashMap<String, Arc<PlacementPolicy>>>,
    /// What each pending job's policy denied, per node, with what it judged (the record's EAR
    /// digest and the node's reputation): a pass does not evaluate a tenant's code again on a
    /// node that has not changed.
    denials: Mutex<HashMap<String, HashMap<String, Denial>>>,
    /// One placement pass at a time on this replica (placements inside it are serialized by
    /// the index lock and the database).
    placing: tokio::sync::Mutex<()>,
    /// The `updated_ms` this replica has read node rows up to.
    sync_cursor: Mutex<i64>,
    /// Pending jobs this replica knows of (a hint: when zero, a placement pass skips its read;
    /// the monitor reads anyway, for jobs another replica left pending).
    pending: std::sync::atomic::AtomicI64,
    /// Leases whose job this replica saw move to running (heartbeats skip that write after).
    running: Mutex<std::collections::HashSet<String>>,
    /// The appraisal policy (configured; reference values change under it).
    appraisal_policy: String,
    /// The reference values in force and their version (0: the configuration file's); the
    /// version never goes down (`settings.rs`). Changed only under `settings_lock`, with the
    /// engine.
    refs_in_force: Mutex<(i64, String)>,
    /// One change of settings at a time on this replica.
    settings_lock: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker").finish_non_exhaustive()
    }
}

impl AdminState for Broker {
    type Rejection = BrokerError;

    fn admin_keys(&self) -> &AdminKeys {
        &self.api_keys
    }

    fn unix_now(&self) -> i64 {
        self.clock.unix()
    }
}

fn read(path: &std::path::Path) -> Result<String, BrokerError> {
    std::fs::read_to_string(path)
        .map_err(|e| BrokerError::Config(format!("{}: {e}", path.display())))
}

/// Sim trust from configured pins (`*`: any simulator root).
fn sim_trust(roots: &[String]) -> Result<SimTrust, BrokerError> {
    if roots.iter().any(|r| r == "*") {
        tracing::warn!("trusting every simulator root (sim_roots: \"*\"): development only");
        return Ok(SimTrust::Any);
    }
    let pins = roots
        .iter()
        .map(|h| {
            hex::decode(h)
                .ok()
                .and_then(|b| <[u8; 32]>::try_from(b).ok())
                .ok_or_else(|| {
                    BrokerError::Config(format!("sim root pin '{h}' is not 32 bytes hex"))
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(if pins.is_empty() {
        SimTrust::Refuse
    } else {
        SimTrust::Pinned(pins)
    })
}

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
fn tenant_of(admin: &Admin, wanted: Option<&str>) -> Result<String, BrokerError> {
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
fn owned_resources(tenant: &str, resources: &[String]) -> Result<(), BrokerError> {
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

/// A policy's refusal of one node, and what it judged: the same record (EAR digest) and
/// reputation give the same input, so the same answer.
#[derive(Debug, Clone)]
struct Denial {
    ear_digest: String,
    reputation: i64,
    reasons: Vec<String>,
}

/// May `admin` read every node and job?
fn auditor(admin: &Admin) -> bool {
    admin.scopes().iter().any(|s| s == "*" || s == "auditor")
}

fn random_id(prefix: &str) -> Result<String, BrokerError> {
    let mut b = [0u8; 12];
    aws_lc_rs::rand::fill(&mut b).map_err(|_| BrokerError::Internal("random".into()))?;
    Ok(format!("{prefix}{}", hex::encode(b)))
}

impl Broker {
    async fn new(config: &BrokerConfig, clock: SharedClock) -> Result<Self, BrokerError> {
        config.check()?;
        let store = Store::open(&config.database, clock.unix()).await?;
        let policy = match &config.appraisal.policy {
            Some(p) => read(p)?,
            None => cgx_policies::APPRAISAL_POLICY.to_string(),
        };
        let refs = match &config.appraisal.reference_values {
            Some(p) => read(p)?,
            None => cgx_policies::DEFAULT_REFERENCE_VALUES.to_string(),
        };
        let engine = PolicyEngine::new("broker.appraisal", &policy, &refs)
            .map_err(|e| BrokerError::Config(format!("appraisal policy: {e}")))?;
        let mut signer = match &config.result_key {
            Some(p) => {
                let der = std::fs::read(p)
                    .map_err(|e| BrokerError::Config(format!("{}: {e}", p.display())))?;
                ResultSigner::from_pkcs8(&der)
            }
            None => ResultSigner::generate(),
        }
        .map_err(|e| BrokerError::Config(format!("result key: {e}")))?;
        // The EAR outlives the re-attestation interval a little: freshness is the broker's
        // rule, the EAR's expiry is its outer bound.
        signer.ttl_secs = config.reattest_secs + 60;
        let source = match &config.collateral.store {
            Some(dir) => Some(Arc::new(CollateralSource::offline(
                CollateralStore::open(dir)
                    .map_err(|e| BrokerError::Config(format!("collateral store: {e}")))?,
            ))),
            None => None,
        };
        let appraiser = Appraiser::new(
            Verifier::new(VerifierConfig {
                sim: sim_trust(&config.sim_roots)?,
            }),
            engine,
            signer,
        );
        let api = config
            .api_keys
            .iter()
            .map(|k| {
                jwt::ed25519_key(&k.public_key)
                    .map(|key| (key, k.scopes.clone()))
                    .map_err(|e| BrokerError::Config(format!("api key: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let keys = lease::Keys::load(&config.signing_key)?;
        // EARs and the broker's own tokens (leases, node records) under one key would let a
        // reader mistake one for the other; each role gets its key.
        if appraiser.signer().public_key() == keys.public.as_slice() {
            return Err(BrokerError::Config(
                "result_key and signing_key are the same key: EARs and leases need two keys".into(),
            ));
        }
        if api.iter().any(|(k, _)| *k == keys.public) {
            return Err(BrokerError::Config(
                "the signing key is also an API key: leases and API tokens need two keys".into(),
            ));
        }
        let broker = Broker {
            store,
            appraiser: Arc::new(appraiser),
            source,
            index: Mutex::new(Index::new(Freshness {
                reattest_secs: config.reattest_secs,
                heartbeat_secs: config.heartbeat_secs,
                missed_heartbeats: config.missed_heartbeats,
            })),
            keys,
            api_keys: AdminKeys::for_kind(
                cgx_service::auth::BearerKind::BrokerApi,
                api,
                config.api_token_max_ttl_secs,
            ),
            clock,
            metrics: Arc::new(Metrics::new("cgx_broker")),
            config: config.clone(),
            policies: Mutex::new(HashMap::new()),
            denials: Mutex::new(HashMap::new()),
            placing: tokio::sync::Mutex::new(()),
            sync_cursor: Mutex::new(0),
            running: Mutex::new(std::collections::HashSet::new()),
            pending: std::sync::atomic::AtomicI64::new(1),
            appraisal_policy: policy,
            refs_in_force: Mutex::new((0, refs)),
            settings_lock: tokio::sync::Mutex::new(()),
        };
        // Reference values an admin stored outrank the configured file; a stored row that
        // does not verify stops the start (falling back to the file would be a silent
        // downgrade).
        broker.refresh_reference_values().await?;
        broker.sync().await?;
        Ok(broker)
    }

    fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        // The index is rebuilt from the database; a panic mid-update leaves at worst a stale
        // entry that the next sync replaces.
        match self.index.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Wall-clock milliseconds: row change marks for replica sync (replication order, not
    /// business time, so not the injected clock).
    fn now_ms(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0)
    }

    // --- registry

    pub(crate) async fn nonce(&self) -> Result<cgx_protocol::broker::NonceResponse, BrokerError> {
        let (nonce, expires_at) = self
            .keys
            .make_nonce(self.clock.unix() + self.config.nonce_ttl_secs)?;
        Ok(cgx_protocol::broker::NonceResponse { nonce, expires_at })
    }

    /// End lease `lease`, moving its job `from` → `to`; the lease if this call ended it.
    async fn end_lease(
        &self,
        lease: &str,
        from: &'static [JobState],
        to: JobState,
        reason: &str,
    ) -> Result<Option<LeaseRow>, BrokerError> {
        let out = self
            .store
            .write(Write::EndLease {
                lease: lease.to_string(),
                job_from: from,
                job_to: to,
                reason: reason.to_string(),
                now: self.clock.unix(),
                now_ms: self.now_ms(),
            })
            .await?;
        Ok(match out {
            Outcome::Ended(l) => {
                let mut idx = self.index();
                idx.release(&l.node_id, &l.gpus);
                // Its last token lives until a lease TTL from now: the VM stays its tenant's
                // until then (a VM serves one tenant at a time).
                idx.hold_until(
                    &l.node_id,
                    self.clock.unix().saturating_add(self.config.lease_ttl_secs),
                );
                Some(l)
            }
            _ => None,
        })
    }

    /// Move a job `from` → `to`; whether it moved.
    async fn transition(
        &self,
        job_id: &str,
        from: &'static [JobState],
        to: JobState,
        reason: &str,
    ) -> Result<bool, BrokerError> {
        let out = self
            .store
            .write(Write::Transition {
                job_id: job_id.to_string(),
                from,
                to,
                reason: reason.to_string(),
                now: self.clock.unix(),
            })
            .await?;
        Ok(matches!(out, Outcome::Done))
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
            .write(Write::UseNonce {
                // Spent by its bytes' one spelling: another base64 spelling of the same nonce
                // is the same nonce.
                nonce: cgx_protocol::broker::b64(&decoded.nonce),
                expires_at: nonce_expires_at,
            })
            .await?;
        if !matches!(spent, Outcome::Done) {
            return Err(BrokerError::Nonce("already used: ask for a new one".into()));
        }
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
        let f = self.index().freshness();
        let written = self
            .store
            .write(Write::Register {
                id: id.clone(),
                operator: record.operator.clone(),
                record: token.clone(),
                attested_at: now,
                now_ms: self.now_ms(),
                gpus: index::serials(&record),
                live_after: now
                    .saturating_sub(f.heartbeat_secs.saturating_mul(f.missed_heartbeats)),
                attested_after: now.saturating_sub(f.reattest_secs),
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

    /// A signed heartbeat from node `id` (`token`: EdDSA JWS under its attested key).
    pub(crate) async fn heartbeat(
        &self,
        id: &str,
        token: &str,
    ) -> Result<HeartbeatAnswer, BrokerError> {
        let now = self.clock.unix();
        let record = self
            .index()
            .record(id)
            .ok_or_else(|| BrokerError::NotFound(format!("node {id}")))?;
        let key: [u8; 32] = cgx_protocol::broker::unb64(&record.node_key)
            .and_then(|k| k.try_into().ok())
            .ok_or_else(|| BrokerError::Internal("stored node key".into()))?;
        use cgx_protocol::signed::{SignedError, When};
        let heartbeat = cgx_protocol::signed::verify::<cgx_protocol::records::Heartbeat>(
            token,
            &[key],
            When::At {
                now,
                max_lifetime: 60,
            },
        )
        .map_err(|e| match e {
            SignedError::WrongKind { .. }
            | SignedError::WrongAudience { .. }
            | SignedError::Claims { .. } => {
                BrokerError::Heartbeat(format!("the token is not a heartbeat of node {id}: {e}"))
            }
            e => BrokerError::Heartbeat(format!("not signed by node {id}'s attested key: {e}")),
        })?
        .body;
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
            .write(Write::Heartbeat {
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
        let mut leases = Vec::new();
        if placeable == Some(Ok(())) {
            let mut open = self.store.open_leases(Some(id)).await?;
            open.sort_by_key(|l| l.started_at);
            // A VM serves one tenant at a time: only the leases of the tenant whose lease on
            // it is oldest are renewed (rows that put another tenant beside it are a database
            // writer's, or a race placement refuses; either way not renewed).
            let mut tenant: Option<String> = None;
            for l in open {
                // Only a lease this broker signed is renewed: a row alone proves nothing.
                let Some(grant) = self.keys.renew(&l, now, self.config.lease_ttl_secs) else {
                    tracing::error!(lease = %l.id, "an open lease row carries no valid broker signature; not renewed");
                    continue;
                };
                let its = store::lease_tenant(&l.token, &self.keys.public);
                match (&tenant, its) {
                    (None, t) => tenant = t,
                    (Some(t), Some(other)) if *t != other => {
                        tracing::error!(lease = %l.id, node = %id, "an open lease of a second tenant on one VM; not renewed");
                        continue;
                    }
                    _ => {}
                }
                let known = self.running.lock().is_ok_and(|r| r.contains(&l.id));
                if !known
                    && self
                        .transition(
                            &l.job_id,
                            &[JobState::Placed],
                            JobState::Running,
                            &format!("node {id} took the lease"),
                        )
                        .await?
                {
                    tracing::info!(job = %l.job_id, node = %id, "job running");
                }
                if !known && let Ok(mut r) = self.running.lock() {
                    if r.len() > 100_000 {
                        r.clear();
                    }
                    r.insert(l.id.clone());
                }
                leases.push(grant);
            }
        }
        Ok(HeartbeatAnswer {
            reattest,
            unplaceable,
            leases,
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
            .write(Write::AskReattest {
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

    /// The reference values in force: (version, text).
    fn refs_in_force(&self) -> (i64, String) {
        match self.refs_in_force.lock() {
            Ok(r) => r.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The engine and the values GET reports switch together: under the values' lock.
    fn set_refs_in_force(&self, version: i64, text: String, engine: PolicyEngine) {
        let mut r = match self.refs_in_force.lock() {
            Ok(r) => r,
            Err(poisoned) => poisoned.into_inner(),
        };
        self.appraiser.set_engine(engine);
        *r = (version, text);
    }

    /// Pick up reference values an admin stored (on this replica or another): a newer
    /// version whose record verifies goes into force. A row at the version in force with
    /// another body, or at an older version, is refused (an older row put back, or a version
    /// signed twice after one was): the engine stays as it is.
    pub(crate) async fn refresh_reference_values(&self) -> Result<(), BrokerError> {
        let _one = self.settings_lock.lock().await;
        let Some((body, record, version)) = self.store.setting(settings::REFERENCE_VALUES).await?
        else {
            return Ok(());
        };
        let (current, text) = self.refs_in_force();
        if version == current && body == text {
            return Ok(());
        }
        if version <= current {
            return Err(BrokerError::Storage(format!(
                "setting reference-values: the row holds version {version}, and version \
                 {current} with {} is in force (an older row put back, or a version signed \
                 twice): kept version {current}",
                if version == current {
                    "another body"
                } else {
                    "its own body"
                }
            )));
        }
        self.keys
            .verify_setting(&record, settings::REFERENCE_VALUES, version, &body)?;
        let engine =
            PolicyEngine::new("broker.appraisal", &self.appraisal_policy, &body).map_err(|e| {
                BrokerError::Storage(format!("setting reference-values v{version}: {e}"))
            })?;
        self.set_refs_in_force(version, body, engine);
        tracing::info!(version, "reference values in force");
        Ok(())
    }

    /// Store reference values (the document `cgx measure … --reference-values` writes) in
    /// place of version `replaces` and put them in force: they judge registrations from now on
    /// (registered nodes at their next re-attestation, or at once with `reattest`). Refused
    /// unless they compile with the appraisal policy; a conflict where the stored values are no
    /// longer at `replaces`.
    pub(crate) async fn put_reference_values(
        &self,
        admin: &Admin,
        body: &[u8],
        replaces: i64,
    ) -> Result<serde_json::Value, BrokerError> {
        if !admin
            .scopes()
            .iter()
            .any(|s| s == "*" || s == settings::REFERENCE_VALUES)
        {
            return Err(BrokerError::Forbidden(
                "reference values are set by admins (scope reference-values or *)".into(),
            ));
        }
        let text = settings::reference_values_text(body)?;
        let engine = PolicyEngine::new("broker.appraisal", &self.appraisal_policy, &text)
            .map_err(|e| BrokerError::BadRequest(format!("reference values: {e}")))?;
        let policy_id = engine.id().to_string();
        let _one = self.settings_lock.lock().await;
        let stored = self
            .store
            .setting(settings::REFERENCE_VALUES)
            .await?
            .map_or(0, |(_, _, v)| v);
        if stored != replaces {
            return Err(BrokerError::Conflict(format!(
                "the reference values are at version {stored}, not {replaces}: read them and \
                 put again"
            )));
        }
        let (current, _) = self.refs_in_force();
        if stored < current {
            return Err(BrokerError::Storage(format!(
                "setting reference-values: the row holds version {stored}, older than the \
                 {current} in force (an older row put back?): nothing put"
            )));
        }
        let version = replaces.checked_add(1).ok_or_else(|| {
            BrokerError::Conflict(format!("version {replaces} cannot be followed"))
        })?;
        let at = self.clock.unix();
        let actor = admin.actor();
        let record =
            self.keys
                .sign_setting(settings::REFERENCE_VALUES, version, &text, at, &actor)?;
        let detail = serde_json::json!({
            "version": version,
            "replaces": replaces,
            "sha256": settings::sha256_hex(text.as_bytes()),
            "policy_id": policy_id,
        });
        match self
            .store
            .write(Write::PutSetting {
                name: settings::REFERENCE_VALUES,
                body: text.clone(),
                record,
                version,
                at,
                actor: actor.clone(),
                detail: detail.to_string(),
            })
            .await?
        {
            Outcome::Done => {}
            Outcome::Refused(Refusal::SettingChanged) => {
                return Err(BrokerError::Conflict(format!(
                    "the reference values changed from version {replaces} meanwhile (another \
                     admin or replica): read them and put again"
                )));
            }
            other => return Err(BrokerError::Internal(format!("setting write: {other:?}"))),
        }
        self.set_refs_in_force(version, text, engine);
        tracing::info!(version, by = %actor, "reference values put");
        Ok(detail)
    }

    /// The reference values this replica appraises with, and their version (0: the
    /// configuration's).
    pub(crate) fn reference_values(&self, admin: &Admin) -> Result<serde_json::Value, BrokerError> {
        if !admin
            .scopes()
            .iter()
            .any(|s| s == "*" || s == settings::REFERENCE_VALUES || s == "auditor")
        {
            return Err(BrokerError::Forbidden(
                "reference values are read by admins and auditors".into(),
            ));
        }
        let (version, text) = self.refs_in_force();
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| BrokerError::Internal(format!("reference values: {e}")))?;
        Ok(serde_json::json!({"version": version, "reference_values": v}))
    }

    /// The admin audit trail (auditors and `*`).
    pub(crate) async fn admin_events(
        &self,
        admin: &Admin,
    ) -> Result<serde_json::Value, BrokerError> {
        if !auditor(admin) {
            return Err(BrokerError::Forbidden(
                "the audit trail is for auditors".into(),
            ));
        }
        let events: Vec<serde_json::Value> = self
            .store
            .admin_events()
            .await?
            .into_iter()
            .map(|(at, actor, action, detail)| {
                let detail: serde_json::Value =
                    serde_json::from_str(&detail).unwrap_or(serde_json::Value::String(detail));
                serde_json::json!({"at": at, "actor": actor, "action": action, "detail": detail})
            })
            .collect();
        Ok(serde_json::json!({"events": events}))
    }

    /// A node as `cgx node show` reports it.
    pub(crate) fn node_view(&self, id: &str, with_claims: bool) -> Option<NodeView> {
        let now = self.clock.unix();
        let idx = self.index();
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
        })
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

    // --- jobs

    /// A job's requirements with its placement policy compiled (cached per job): the policy
    /// is compiled and tried once on a sample node off the async threads, under the limits
    /// `cgx-policies` puts on a tenant's code; an error refuses the job.
    async fn requirements(
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
    fn cheap_requirements(
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

    /// Try to place one job (`new`: not stored yet — it is stored with its placement, or
    /// pending without one). The placement that committed, if any, and what the job's policy
    /// said of the nodes it ran on.
    ///
    /// The job row is the database's word only: before a lease is signed its seal must verify
    /// (tenant and spec as submitted) and every resource must be the tenant's own. The policy
    /// runs outside the index's lock and off the async threads; a policy that fails (a limit,
    /// an error) fails its job, never the pass.
    async fn place_job(
        &self,
        job: &JobRow,
        req: Option<Requirements>,
        new: bool,
    ) -> Result<(Option<PlacementRow>, HashMap<String, Misfit>), BrokerError> {
        self.keys.check_job(job)?;
        // Sealed, so the broker stored this text. One no version could read (not JSON, a
        // field missing) fails its job with the reason rather than stay pending for ever; one a
        // newer replica wrote (a field or a kind this version does not know) is left for a
        // replica that reads it.
        let spec = JobSpec::from_stored(&job.spec).map_err(|e| {
            if e.contains("unknown field") || e.contains("unknown variant") {
                BrokerError::Internal(format!("stored job spec of a newer version: {e}"))
            } else {
                BrokerError::BadRequest(format!("stored job spec: {e}"))
            }
        })?;
        if spec.tenant.as_deref() != Some(job.tenant.as_str()) {
            return Err(BrokerError::JobSeal(format!(
                "job {}'s spec names another tenant than its row",
                job.id
            )));
        }
        owned_resources(&job.tenant, &spec.resources)?;
        let req = match req {
            Some(r) => r,
            None => self.requirements(&job.id, &job.tenant, &spec).await?,
        };
        let mut verdicts = HashMap::new();
        for _attempt in 0..8 {
            let now = self.clock.unix();
            let candidates = self.index().candidates(&req, now);
            let chosen = match &req.policy {
                None => candidates.into_iter().next().map(|c| (c.choice, c.record)),
                Some(policy) => {
                    // One hop to the policy sandbox's evaluator threads for every candidate,
                    // each under its own limits; the answers come back in rank order.
                    let mut inputs = Vec::with_capacity(candidates.len());
                    let mut choices = Vec::with_capacity(candidates.len());
                    let known = self
                        .denials
                        .lock()
                        .ok()
                        .and_then(|d| d.get(&job.id).cloned())
                        .unwrap_or_default();
                    for c in candidates {
                        let input = c.input.unwrap_or_default();
                        let reputation = input["node"]["reputation"].as_i64().unwrap_or(0);
                        // Denied before on this very record and reputation: denied again.
                        if let Some(d) = known.get(&c.choice.node_id)
                            && d.ear_digest == c.record.ear_digest
                            && d.reputation == reputation
                        {
                            verdicts.insert(c.choice.node_id, Misfit::Policy(d.reasons.clone()));
                            continue;
                        }
                        inputs.push((input, reputation));
                        choices.push((c.choice, c.record));
                    }
                    let reputations: Vec<i64> = inputs.iter().map(|(_, r)| *r).collect();
                    let inputs: Vec<serde_json::Value> =
                        inputs.into_iter().map(|(i, _)| i).collect();
                    let answers = if choices.is_empty() {
                        Vec::new()
                    } else {
                        self.metrics.event("placement", "policy_batch");
                        match policy.refusals_many(inputs).await {
                            Ok(a) => a,
                            // The sandbox had no room: not evaluated now (the job waits for the
                            // next pass), which is no fault of the job's.
                            Err(cgx_policies::Error::Busy) => {
                                self.metrics.event("placement", "policy_busy");
                                return Ok((None, verdicts));
                            }
                            Err(e) => {
                                return Err(BrokerError::PlacementPolicy(format!("failed: {e}")));
                            }
                        }
                    };
                    let mut chosen = None;
                    let mut denied = Vec::new();
                    for (((choice, record), answer), reputation) in
                        choices.into_iter().zip(answers).zip(reputations)
                    {
                        match answer {
                            Ok(r) if r.is_empty() => {
                                chosen = Some((choice, record));
                                break;
                            }
                            Ok(r) => {
                                denied.push((
                                    choice.node_id.clone(),
                                    Denial {
                                        ear_digest: record.ear_digest.clone(),
                                        reputation,
                                        reasons: r.clone(),
                                    },
                                ));
                                verdicts.insert(choice.node_id, Misfit::Policy(r));
                            }
                            // A limit or an error is the job's failure, with its reason, once:
                            // it does not cost every pass again.
                            Err(e) => {
                                return Err(BrokerError::PlacementPolicy(format!(
                                    "failed on node {}: {e}",
                                    choice.node_id
                                )));
                            }
                        }
                    }
                    if !denied.is_empty()
                        && let Ok(mut d) = self.denials.lock()
                    {
                        if d.len() > 10_000 && !d.contains_key(&job.id) {
                            d.clear();
                        }
                        d.entry(job.id.clone()).or_default().extend(denied);
                    }
                    chosen
                }
            };
            let Some((choice, judged)) = chosen else {
                break;
            };
            // The index may have changed while the policy ran: check again under the lock,
            // the record the policy judged included (a re-registration brings new claims).
            let record = {
                let mut idx = self.index();
                let same = idx
                    .record(&choice.node_id)
                    .is_some_and(|r| Arc::ptr_eq(&r, &judged));
                if same
                    && idx.cheap_fits(&choice.node_id, &req, now).is_ok()
                    && idx.reserve_for(&choice.node_id, &choice.gpus, &job.tenant, now)
                {
                    judged
                } else {
                    continue;
                }
            };
            let lease_id = random_id("l")?;
            let ends_at = now.saturating_add(i64::try_from(spec.duration_secs).unwrap_or(i64::MAX));
            let token = self.keys.lease_token(
                &lease_id,
                &job.id,
                &job.tenant,
                &record,
                &choice.gpus,
                &spec.resources,
                now,
                ends_at,
                self.config.lease_ttl_secs,
            )?;
            let placement = PlacementRow {
                reason: format!(
                    "placed on {} (GPUs {}), lease {lease_id}",
                    choice.node_id,
                    store::gpus_text(&choice.gpus)
                ),
                job_id: job.id.clone(),
                tenant: job.tenant.clone(),
                tenant_ended_after: now - self.config.lease_ttl_secs,
                broker_key: self.keys.public,
                node_id: choice.node_id.clone(),
                lease_id: lease_id.clone(),
                gpus: choice.gpus.clone(),
                token,
                started_at: now,
                ends_at,
                now_ms: self.now_ms(),
            };
            let write = if new {
                Write::Submit {
                    job: Box::new(job.clone()),
                    placement: Some(placement.clone()),
                    max_pending: self.config.max_pending_per_tenant,
                }
            } else {
                Write::Place(placement.clone())
            };
            match self.store.write(write).await {
                Ok(Outcome::Refused(Refusal::GpuTaken | Refusal::OtherTenant(_))) => {
                    // Another replica took one of these GPUs, or placed another tenant on the
                    // node: learn its allocations, choose again.
                    self.metrics.event("placement", "conflict");
                    self.index().release(&choice.node_id, &choice.gpus);
                    let used = self
                        .store
                        .allocations(
                            Some(std::slice::from_ref(&choice.node_id)),
                            now - self.config.lease_ttl_secs,
                            self.config.lease_ttl_secs,
                            &self.keys.public,
                        )
                        .await?;
                    self.index().set_use(
                        &choice.node_id,
                        &used.get(&choice.node_id).cloned().unwrap_or_default(),
                    );
                }
                Ok(Outcome::Refused(_)) => {
                    self.index().release(&choice.node_id, &choice.gpus);
                    return Ok((None, verdicts));
                }
                Ok(_) => {
                    self.index().confirm(&choice.node_id, &choice.gpus);
                    self.metrics.event("job", "placed");
                    tracing::info!(job = %job.id, node = %choice.node_id, lease = %lease_id, "job placed");
                    if let Ok(mut p) = self.policies.lock() {
                        p.remove(&job.id);
                    }
                    if let Ok(mut d) = self.denials.lock() {
                        d.remove(&job.id);
                    }
                    return Ok((Some(placement), verdicts));
                }
                Err(e) => {
                    self.index().release(&choice.node_id, &choice.gpus);
                    return Err(e);
                }
            }
        }
        if new {
            // The cap is counted inside the write that adds the job: concurrent submissions
            // cannot all pass a count taken before it.
            let written = self
                .store
                .write(Write::Submit {
                    job: Box::new(job.clone()),
                    placement: None,
                    max_pending: self.config.max_pending_per_tenant,
                })
                .await?;
            if matches!(written, Outcome::Refused(Refusal::TooManyPending)) {
                return Err(BrokerError::Quota(format!(
                    "tenant {} has {} jobs pending already; cancel some or wait",
                    job.tenant, self.config.max_pending_per_tenant
                )));
            }
        }
        Ok((None, verdicts))
    }

    /// Place every pending job that fits now, oldest first (nothing to read when this replica
    /// knows of none).
    pub(crate) async fn place_pending(&self) {
        if self.pending.load(std::sync::atomic::Ordering::Relaxed) <= 0 {
            return;
        }
        self.place_pending_all().await;
    }

    /// [`Broker::place_pending`] whatever the hint says (the monitor: another replica's jobs).
    async fn place_pending_all(&self) {
        let Ok(_one) = self.placing.try_lock() else {
            return;
        };
        let jobs = match self.store.pending_jobs(self.config.placement_batch).await {
            Ok(j) => j,
            Err(e) => {
                tracing::warn!(error = %e, "pending jobs");
                return;
            }
        };
        let mut left = jobs.len() as i64;
        for job in jobs {
            match self.place_job(&job, None, false).await {
                Ok((Some(_), _)) => left -= 1,
                Ok((None, _)) => {}
                Err(e) => {
                    tracing::warn!(job = %job.id, error = %e, "placement failed");
                    // The job's own fault (its policy, its spec, its seal, resources not its
                    // tenant's): it fails with the reason; the pass goes on.
                    if matches!(
                        e,
                        BrokerError::PlacementPolicy(_)
                            | BrokerError::BadRequest(_)
                            | BrokerError::JobSeal(_)
                            | BrokerError::Forbidden(_)
                    ) && self
                        .transition(
                            &job.id,
                            &[JobState::Pending],
                            JobState::Failed,
                            &e.to_string(),
                        )
                        .await
                        .unwrap_or(false)
                    {
                        left -= 1;
                    }
                }
            }
        }
        self.pending
            .store(left, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) async fn job_view_by_id(&self, id: &str) -> Result<JobView, BrokerError> {
        let row = self
            .store
            .job(id)
            .await?
            .ok_or_else(|| BrokerError::NotFound(format!("job {id}")))?;
        self.job_view(row, true).await
    }

    async fn job_view(&self, row: JobRow, events: bool) -> Result<JobView, BrokerError> {
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
        Ok(JobView {
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
    async fn job_row_for(&self, admin: &Admin, id: &str) -> Result<JobRow, BrokerError> {
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

    // --- the monitor

    /// Read node rows other replicas (or this one) changed since the last sync into the index;
    /// each record's signature is checked before it counts.
    pub(crate) async fn sync(&self) -> Result<(), BrokerError> {
        let cursor = self.sync_cursor.lock().map(|c| *c).unwrap_or(0);
        // Overlap by two seconds: a row committed late with an earlier `updated_ms` is still
        // seen.
        let rows = self.store.nodes_since((cursor - 2000).max(0)).await?;
        let operators = self.store.operators().await?;
        let ids: Vec<String> = rows.iter().map(|r| r.id.clone()).collect();
        let now = self.clock.unix();
        let ttl = self.config.lease_ttl_secs;
        let used = self
            .store
            .allocations(Some(&ids), now - ttl, ttl, &self.keys.public)
            .await?;
        let mut max_ms = cursor;
        let mut idx = self.index();
        for (name, rep) in operators {
            idx.set_operator_reputation(&name, rep);
        }
        for row in rows {
            max_ms = max_ms.max(row.updated_ms);
            let same = idx.record_token(&row.id) == Some(row.record.as_str());
            if !same {
                match self.keys.verify_record(&row.record) {
                    Ok(record)
                        if record.id == row.id
                            && !idx.accepts_record(&row.id, record.attested_at) =>
                    {
                        // Validly signed, but older than a record of this node already seen: a
                        // database writer putting back an attestation the node has since
                        // replaced. The newer one stays.
                        tracing::error!(node = %row.id, attested_at = record.attested_at, "a node row carries an older record than one already seen; ignored");
                        continue;
                    }
                    Ok(record) if record.id == row.id => {
                        idx.upsert(
                            record,
                            row.record.clone(),
                            row.reputation,
                            row.last_heartbeat,
                            row.heartbeat_seq,
                            0,
                        );
                    }
                    Ok(record) => {
                        tracing::error!(node = %row.id, record_for = %record.id, "a node row carrying another node's record; ignored");
                        idx.remove(&row.id);
                        continue;
                    }
                    Err(e) => {
                        // Say why: a bad signature, or a record this version cannot read (a
                        // newer replica's, say) — not the same thing to an operator.
                        tracing::error!(node = %row.id, error = %e, "a node row whose record does not verify or parse; ignored");
                        idx.remove(&row.id);
                        continue;
                    }
                }
            } else {
                idx.set_node_reputation(&row.id, row.reputation);
            }
            idx.observe_heartbeat(&row.id, row.last_heartbeat, row.heartbeat_seq);
            idx.ask_reattest(&row.id, row.reattest_asked > 0);
            idx.set_use(&row.id, &used.get(&row.id).cloned().unwrap_or_default());
        }
        drop(idx);
        if let Ok(mut c) = self.sync_cursor.lock() {
            *c = max_ms;
        }
        Ok(())
    }

    /// One monitor pass: sync, fail over nodes that stopped proving themselves, complete leases
    /// that ran their duration, place pending jobs.
    pub(crate) async fn tick(&self) -> Result<(), BrokerError> {
        self.sync().await?;
        // Reference values another replica stored; a row that does not hold is logged and the
        // engine in force stays.
        if let Err(e) = self.refresh_reference_values().await {
            tracing::error!(error = %e, "reference values not refreshed");
        }
        let now = self.clock.unix();
        self.index().release_lapsed_holds(now);
        let failing = self.index().failing(now);
        for (node, why) in failing {
            let reason = format!("node {node} stopped proving itself ({why}); re-placing");
            for l in self.store.open_leases(Some(&node)).await? {
                if let Some(l) = self
                    .end_lease(
                        &l.id,
                        &[JobState::Placed, JobState::Running],
                        JobState::Pending,
                        &reason,
                    )
                    .await?
                {
                    self.pending
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.metrics.event("failover", "lease_ended");
                    tracing::warn!(node = %node, lease = %l.id, job = %l.job_id, %why, "lease ended; job re-placed");
                }
            }
            // Leases another replica ended: the allocation rows are gone.
            let used = self
                .store
                .allocations(
                    Some(std::slice::from_ref(&node)),
                    now - self.config.lease_ttl_secs,
                    self.config.lease_ttl_secs,
                    &self.keys.public,
                )
                .await?;
            self.index()
                .set_use(&node, &used.get(&node).cloned().unwrap_or_default());
        }
        for l in self.store.due_leases(now).await? {
            if self
                .end_lease(
                    &l.id,
                    &[JobState::Placed, JobState::Running],
                    JobState::Completed,
                    "ran its duration",
                )
                .await?
                .is_some()
            {
                self.metrics.event("job", "completed");
            }
        }
        self.expire_pending(now).await?;
        self.place_pending_all().await;
        Ok(())
    }

    /// Pending jobs older than `pending_ttl_secs` expire, with the reason (a read first, so a
    /// pass with nothing to expire writes nothing).
    async fn expire_pending(&self, now: i64) -> Result<(), BrokerError> {
        let before = now.saturating_sub(self.config.pending_ttl_secs);
        if !self.store.any_pending_before(before).await? {
            return Ok(());
        }
        self.store
            .write(Write::ExpirePending {
                before,
                now,
                reason: format!(
                    "expired: pending longer than {} s without a node that fits",
                    self.config.pending_ttl_secs
                ),
            })
            .await?;
        self.metrics.event("job", "expired");
        Ok(())
    }

    /// Reputation (tests; later work feeds it from metering and proofs).
    pub async fn set_reputation(
        &self,
        node: Option<(&str, i64)>,
        operator: Option<(&str, i64)>,
    ) -> Result<(), BrokerError> {
        self.store
            .write(Write::Reputation {
                node: node.map(|(n, r)| (n.to_string(), r)),
                operator: operator.map(|(n, r)| (n.to_string(), r)),
                now_ms: self.now_ms(),
            })
            .await?;
        self.sync().await
    }
}

/// A running broker (tests, `cgx up` and `cgx bench broker` start one on port 0).
#[derive(Debug)]
pub struct Running {
    pub addr: SocketAddr,
    broker: Arc<Broker>,
    server: cgx_service::Running,
}

impl Running {
    /// Stop accepting and the monitor, let open requests finish, close the database.
    pub async fn shutdown(self) {
        self.server.shutdown().await;
        self.broker.store.close().await;
    }

    /// Run one monitor pass now (tests drive time with a manual clock).
    pub async fn tick(&self) -> Result<(), BrokerError> {
        self.broker.tick().await
    }

    /// Set reputations (tests; the ledger feeds them later).
    pub async fn set_reputation(
        &self,
        node: Option<(&str, i64)>,
        operator: Option<(&str, i64)>,
    ) -> Result<(), BrokerError> {
        self.broker.set_reputation(node, operator).await
    }
}

/// Bind and serve on the system clock.
pub async fn start(config: &BrokerConfig) -> Result<Running, BrokerError> {
    start_with_clock(config, cgx_service::clock::system()).await
}

/// [`start`] on `clock`.
pub async fn start_with_clock(
    config: &BrokerConfig,
    clock: SharedClock,
) -> Result<Running, BrokerError> {
    let broker = Arc::new(Broker::new(config, clock).await?);
    let mut background: Vec<Background> = vec![Box::pin(monitor(
        broker.clone(),
        Duration::from_millis(config.monitor_interval_ms),
    ))];
    if broker.store.is_sqlite() {
        background.push(Box::pin(checkpoints(broker.clone())));
    }
    let server =
        cgx_service::server::start(&config.listener(), http::router(broker.clone()), background)
            .await
            .map_err(|e| BrokerError::Config(e.to_string()))?;
    Ok(Running {
        addr: server.addr(),
        broker,
        server,
    })
}

async fn monitor(broker: Arc<Broker>, every: Duration) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n: u64 = 0;
    loop {
        ticker.tick().await;
        n += 1;
        if let Err(e) = broker.tick().await {
            tracing::warn!(error = %e, "monitor pass deferred");
        }
        if n.is_multiple_of(120)
            && let Err(e) = broker
                .store
                .write(Write::SweepNonces {
                    now: broker.clock.unix(),
                })
                .await
        {
            tracing::debug!(error = %e, "nonce sweep deferred");
        }
    }
}

async fn checkpoints(broker: Arc<Broker>) {
    cgx_service::db::checkpoints(|| broker.store.checkpoint()).await;
}

/// Serve `config` until `shutdown` completes, then drain and close.
pub async fn run(
    config: &BrokerConfig,
    shutdown: impl std::future::Future<Output = ()>,
    on_listen: impl FnOnce(SocketAddr),
) -> Result<(), BrokerError> {
    let running = start(config).await?;
    on_listen(running.addr);
    shutdown.await;
    tracing::info!("shutting down");
    running.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    #[test]
    fn placement_policies_reading_the_float_price_are_refused() {
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
