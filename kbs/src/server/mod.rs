//! The KBS service: configuration → state ([`Kbs`]) → router (`http`) → the service layer's
//! listener (`cgx-service`: TLS by default, plain HTTP on loopback with `insecure_dev`, a
//! connection cap, graceful drain), with housekeeping as background tasks.

mod attest;
pub mod config;
mod error;
mod fetch;
#[cfg(feature = "fuzzing")]
pub mod fuzz;
mod http;
mod keys;
mod log;
mod openapi;
mod rcar;
mod release;
mod session;
mod sessions;
pub mod store;
mod tenancy;
mod watermark;

/// The admin scope that reads the KBS log's entries and nothing else (the broker's mirror of
/// releases by lease). Its `:` is in no repository's name, so it changes none.
pub const LOG_READER_SCOPE: &str = ":log-reader";

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cgx_attestation::collateral::CollateralStore;
use cgx_attestation::collateral::fetch::{CollateralSource, FetchPolicy};
use cgx_attestation::results::{Ear, ResultSigner};
use cgx_attestation::{SimTrust, Verifier, VerifierConfig};
use cgx_policies::{Appraiser, PolicyEngine};
use cgx_service::auth::{AdminKeys, AdminState};
use cgx_service::metrics::Metrics;
use cgx_service::{Background, SharedClock, jwt};

pub use config::KbsConfig;
use config::SessionMode;
pub use error::KbsError;

use attest::Attester;
use fetch::FetchGate;
use release::ReleasePolicies;
use store::Store;

/// The state every handler shares.
pub(crate) struct Kbs {
    pub(crate) store: Store,
    pub(crate) attester: Attester,
    /// Online collateral fetching, bounded; `None` offline.
    pub(crate) fetcher: Option<FetchGate>,
    pub(crate) release: ReleasePolicies,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) clock: SharedClock,
    admin_keys: AdminKeys,
    broker_keys: Vec<[u8; 32]>,
    /// Longest accepted lease lifetime (`exp − iat`).
    lease_max_ttl: i64,
    /// Which tenant each TEE key's live lease is for (`tenancy.rs`).
    pub(crate) tee_tenants: tenancy::TeeTenants,
    nonce_ttl: i64,
    session_ttl: i64,
    allow_sample: bool,
    default_policy: String,
    default_reference_values: String,
    /// (policy, reference values) the running engine was built from.
    engine_source: Mutex<(String, String)>,
    /// Release policy rows by resource path, with the time they were read: a change made on
    /// this replica clears it at once, one made on another replica is seen within
    /// [`POLICY_CACHE_SECS`].
    policy_cache: Mutex<std::collections::HashMap<String, CachedPolicies>>,
    pub(crate) session_keys: session::SessionKeys,
    /// Answered challenges and attested sessions: the record (`memory`) or this replica's
    /// cache of what it attested (`database`).
    sessions: sessions::Sessions,
    /// The transparency log's writer (`[log]`), if it keeps one.
    pub(crate) log: Option<cgx_service::logwriter::LogWriter>,
}

/// An attested session as the resource endpoint needs it: the TEE key the EAR binds and the
/// EAR itself, verified (a session read from the database is re-verified against this KBS's
/// result key: a row proves nothing by itself).
#[derive(Debug)]
pub(crate) struct LiveSession {
    pub expires_at: i64,
    pub tee_pubkey: cgx_protocol::kbs_types::TeePubKey,
    pub ear: Ear,
}

/// The name the KBS's appraisal policy carries in its results' policy ids.
pub(crate) const KBS_POLICY_NAME: &str = "kbs.appraisal";
/// How those ids start (`kbs.appraisal@sha256:…`).
const KBS_POLICY_ID_PREFIX: &str = "kbs.appraisal@";

/// Release policy rows (scope, text) read at an instant.
type CachedPolicies = (std::time::Instant, Arc<Vec<(String, String)>>);

/// How long a replica may use release policies it read from the database.
pub(crate) const POLICY_CACHE_SECS: u64 = 1;

impl std::fmt::Debug for Kbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kbs")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

fn read(path: &std::path::Path) -> Result<String, KbsError> {
    std::fs::read_to_string(path).map_err(|e| KbsError::Config(format!("{}: {e}", path.display())))
}

impl AdminState for Kbs {
    type Rejection = KbsError;

    fn admin_keys(&self) -> &AdminKeys {
        &self.admin_keys
    }

    fn unix_now(&self) -> i64 {
        self.clock.unix()
    }
}

impl Kbs {
    /// Open storage and build verifier, policies and signer from `config`; `clock` is the
    /// time every handler and row sees.
    async fn new(config: &KbsConfig, clock: SharedClock) -> Result<Self, KbsError> {
        config.check()?;
        let kek = config.load_kek()?;
        let store = Store::open(&config.database, &kek, clock.clone()).await?;
        let store = match config.version_file() {
            Some(f) => {
                // A missing file would forget every mark: after a restore of both (the file
                // beside the database) or a deletion, a rollback would pass. A new replica of an
                // existing database says so.
                if !f.exists()
                    && !config.accept_new_version_file
                    && store.holds_versioned_rows().await?
                {
                    return Err(KbsError::Config(format!(
                        "version_file {} is missing but the database holds resources or policies: \
                         restore this replica's file, or set accept_new_version_file for a new \
                         replica (it learns the versions as it reads them)",
                        f.display()
                    )));
                }
                store.remembering_versions(&kek, &f)?
            }
            None => store,
        };
        let trust_any_sim = config.sim_roots.iter().any(|r| r == "*");
        let pins = config
            .sim_roots
            .iter()
            .filter(|r| *r != "*")
            .map(|h| {
                hex::decode(h)
                    .ok()
                    .and_then(|b| <[u8; 32]>::try_from(b).ok())
                    .ok_or_else(|| {
                        KbsError::Config(format!("sim root pin '{h}' is not 32 bytes hex"))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let sim = if trust_any_sim {
            tracing::warn!("trusting every simulator root (sim_roots: \"*\"): development only");
            SimTrust::Any
        } else if pins.is_empty() {
            SimTrust::Refuse
        } else {
            SimTrust::Pinned(pins.clone())
        };
        let default_policy = match &config.appraisal.policy {
            Some(p) => read(p)?,
            None => cgx_policies::APPRAISAL_POLICY.to_string(),
        };
        let default_reference_values = match &config.appraisal.reference_values {
            Some(p) => read(p)?,
            None => cgx_policies::DEFAULT_REFERENCE_VALUES.to_string(),
        };
        let policy = store
            .policy(http::SCOPE_ATTESTATION)
            .await?
            .unwrap_or_else(|| default_policy.clone());
        let refs = store
            .policy(http::SCOPE_REFERENCE_VALUES)
            .await?
            .unwrap_or_else(|| default_reference_values.clone());
        let refs = with_sample(
            &refs,
            store
                .policy(http::SCOPE_SAMPLE_REFERENCE_VALUES)
                .await?
                .as_deref(),
        )?;
        let engine = PolicyEngine::new(KBS_POLICY_NAME, &policy, &refs)
            .map_err(|e| KbsError::Config(format!("appraisal policy: {e}")))?;
        let mut signer = match &config.result_key {
            Some(p) => {
                let der = std::fs::read(p)
                    .map_err(|e| KbsError::Config(format!("{}: {e}", p.display())))?;
                ResultSigner::from_pkcs8(&der)
            }
            None => ResultSigner::generate(),
        }
        .map_err(|e| KbsError::Config(format!("result key: {e}")))?;
        // The EAR is the session's credential (cookie or bearer): it lives as long as the session.
        signer.ttl_secs = config.session_ttl_secs;
        let source = match &config.collateral.store {
            Some(dir) => {
                let s = CollateralStore::open(dir)
                    .map_err(|e| KbsError::Config(format!("collateral store: {e}")))?;
                Some(Arc::new(if config.collateral.online {
                    CollateralSource::new(
                        s,
                        config.collateral.endpoints.clone().unwrap_or_default(),
                        FetchPolicy {
                            amd_min_interval: Duration::from_millis(
                                config.collateral.amd_min_interval_ms,
                            ),
                            ..FetchPolicy::default()
                        },
                    )
                } else {
                    CollateralSource::offline(s)
                }))
            }
            None => None,
        };
        let fetcher = match &source {
            Some(s) if s.is_online() => Some(FetchGate::start(
                s.clone(),
                &config.collateral,
                clock.clone(),
            )?),
            _ => None,
        };
        let attester = Attester::new(
            Appraiser::new(
                Verifier::new(VerifierConfig { sim }).allowing_sample(config.allow_sample),
                engine,
                signer,
            ),
            source,
            config.allow_sample,
        );
        let admin = config
            .admin_keys
            .iter()
            .map(|k| {
                jwt::ed25519_key(&k.public_key)
                    .map(|key| (key, k.repositories.clone()))
                    .map_err(|e| KbsError::Config(format!("admin key: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let broker_keys = config
            .broker_keys
            .iter()
            .map(|k| jwt::ed25519_key(k).map_err(|e| KbsError::Config(format!("broker key: {e}"))))
            .collect::<Result<Vec<_>, _>>()?;
        // A key that may both administer and sign leases would turn any lease into an admin
        // token and back: the two roles need two keys.
        if admin.iter().any(|(key, _)| broker_keys.contains(key)) {
            return Err(KbsError::Config(
                "a key is configured both as an admin key and as a broker key".into(),
            ));
        }
        // The log key is a key of its own: neither an admin's nor a broker's.
        let admin_publics: Vec<[u8; 32]> = admin
            .iter()
            .map(|(k, _)| *k)
            .chain(broker_keys.iter().copied())
            .collect();
        let admin_keys = AdminKeys::for_kind(
            cgx_service::auth::BearerKind::KbsAdmin,
            admin,
            config.admin_token_max_ttl_secs,
        );
        let session_mode = config.session_mode();
        // Memory sessions are this process's alone: say so, for whoever runs two on one file.
        tracing::info!(
            sessions = ?session_mode,
            max_live_sessions = config.max_live_sessions,
            "sessions"
        );
        if !config.tenant_isolation {
            tracing::warn!(
                "tenant isolation is off: the global release policy alone releases any resource"
            );
        }
        let log = config
            .log
            .as_ref()
            .map(|l| cgx_service::logwriter::LogWriter::open(l, &admin_publics))
            .transpose()?;
        Ok(Kbs {
            log,
            store,
            attester,
            fetcher,
            release: ReleasePolicies::new(
                trust_any_sim || !pins.is_empty(),
                config.tenant_isolation,
            )?,
            metrics: Arc::new(Metrics::new("cgx_kbs")),
            clock,
            admin_keys,
            broker_keys,
            lease_max_ttl: config.lease_max_ttl_secs,
            tee_tenants: tenancy::TeeTenants::default(),
            nonce_ttl: config.nonce_ttl_secs,
            session_ttl: config.session_ttl_secs,
            allow_sample: config.allow_sample,
            default_policy,
            default_reference_values,
            engine_source: Mutex::new((policy, refs)),
            policy_cache: Mutex::new(std::collections::HashMap::new()),
            session_keys: match session_mode {
                SessionMode::Database => session::SessionKeys::derive(&kek),
                SessionMode::Memory => session::SessionKeys::ephemeral()
                    .ok_or_else(|| KbsError::Config("session keys: no randomness".into()))?,
            },
            sessions: sessions::Sessions::new(
                session_mode,
                config.max_live_sessions,
                config.session_ttl_secs,
            ),
        })
    }

    /// Record a failed answer to `ch`: the challenge is used up.
    pub(crate) async fn answer_failed(&self, ch: &session::Challenge) -> Result<(), KbsError> {
        match self.sessions.mode() {
            // Kept a session lifetime past the challenge's expiry, like an answered one: a
            // replica whose clock is behind still finds it.
            SessionMode::Database => {
                self.store
                    .record_session(
                        &ch.id,
                        &ch.nonce,
                        &ch.tee,
                        store::FAILED,
                        ch.expires_at + self.session_ttl,
                        None,
                    )
                    .await?;
                Ok(())
            }
            // A failure that was not recorded (a replay, an expired challenge, or a full table of
            // failures) still returns its own error: a new challenge costs nothing, so being
            // able to answer a failed one again gains nothing.
            SessionMode::Memory => {
                if let Err(why) =
                    self.sessions
                        .answer(&ch.id, ch.expires_at, None, self.clock.unix())
                {
                    tracing::debug!(?why, "failed answer not recorded");
                }
                Ok(())
            }
        }
    }

    /// Record the attested answer to `ch`, its session living until `expires_at` with
    /// `token` (the EAR, signed) and `session` (the same, verified): `false` when the
    /// challenge was answered before (on any replica, with `database` sessions).
    pub(crate) async fn answer_attested(
        &self,
        ch: &session::Challenge,
        expires_at: i64,
        token: &str,
        session: LiveSession,
    ) -> Result<bool, KbsError> {
        let now = self.clock.unix();
        match self.sessions.mode() {
            SessionMode::Database => {
                let first = self
                    .store
                    .record_session(
                        &ch.id,
                        &ch.nonce,
                        &ch.tee,
                        store::ATTESTED,
                        expires_at,
                        Some(token),
                    )
                    .await?;
                if first {
                    self.sessions.remember(&ch.id, Arc::new(session), now);
                }
                Ok(first)
            }
            SessionMode::Memory => {
                match self
                    .sessions
                    .answer(&ch.id, ch.expires_at, Some(Arc::new(session)), now)
                {
                    Ok(()) => Ok(true),
                    Err(sessions::Refused::Replayed) => Ok(false),
                    Err(sessions::Refused::Expired) => Err(KbsError::UnAuthenticated(
                        "the challenge expired while the evidence was appraised; start again \
                         with /auth"
                            .into(),
                    )),
                    Err(sessions::Refused::Full) => Err(self.sessions_full()),
                }
            }
        }
    }

    /// With `memory` sessions, whether challenge `id` was answered here (a replay).
    pub(crate) fn answered_here(&self, id: &str) -> bool {
        self.sessions.mode() == SessionMode::Memory && self.sessions.answered(id)
    }

    fn sessions_full(&self) -> KbsError {
        KbsError::Overloaded {
            retry_after: 5,
            detail: format!(
                "this KBS holds {} live sessions (max_live_sessions); try again later",
                self.sessions.capacity()
            ),
        }
    }

    /// An attested session: this process's table, else (with `database` sessions) the
    /// database. `None` for unknown sessions and for challenges whose answer failed.
    pub(crate) async fn attested_session(
        &self,
        id: &str,
    ) -> Result<Option<Arc<LiveSession>>, KbsError> {
        if let Some(s) = self.sessions.get(id) {
            return Ok(Some(s));
        }
        if self.sessions.mode() == SessionMode::Memory {
            return Ok(None);
        }
        let Some(row) = self.store.session(id).await? else {
            return Ok(None);
        };
        let (store::ATTESTED, Some(token)) = (row.state.as_str(), &row.token) else {
            return Ok(None);
        };
        // The row's token must be an EAR this KBS signed; the TEE key is the one it binds.
        let session = self.verified_ear(token)?;
        Ok(Some(Arc::new(LiveSession {
            expires_at: row.expires_at.min(session.expires_at),
            ..session
        })))
    }

    /// A bearer EAR (or a stored session's): signed by this KBS's result key, unexpired, and
    /// binding a TEE key in its CPU part.
    pub(crate) fn verified_ear(&self, token: &str) -> Result<LiveSession, KbsError> {
        let ear = cgx_attestation::results::verify(
            token,
            &self.attester.signer().jwk(),
            self.clock.unix(),
        )
        .map_err(|e| KbsError::TokenInvalid(e.to_string()))?;
        // Only the KBS's own session results: they echo a challenge nonce and name its
        // appraisal policy. Another EAR signed by the same key (a shared key file used by
        // `cgx appraise`, say) is not a session.
        let ours = ear.nonce.is_some()
            && ear.submods.values().all(|a| {
                a.policy_ids
                    .iter()
                    .any(|p| p.starts_with(KBS_POLICY_ID_PREFIX))
            });
        if !ours {
            return Err(KbsError::TokenInvalid(
                "not a session result of this KBS (no challenge nonce or another policy)".into(),
            ));
        }
        let tee_pubkey = ear
            .submods
            .get(cgx_attestation::results::CPU_PART)
            .and_then(|cpu| cpu.node_key())
            .and_then(|k| serde_json::from_slice::<cgx_protocol::kbs_types::TeePubKey>(&k).ok())
            .ok_or_else(|| KbsError::TokenInvalid("the token binds no TEE key".into()))?;
        Ok(LiveSession {
            expires_at: ear.exp.unwrap_or(0),
            tee_pubkey,
            ear,
        })
    }

    /// The stored release policies that apply to `path` (global, repository, resource).
    pub(crate) async fn release_policies(
        &self,
        path: &str,
        repository: &str,
    ) -> Result<Arc<Vec<(String, String)>>, KbsError> {
        if let Some((at, rows)) = self
            .policy_cache
            .lock()
            .ok()
            .and_then(|c| c.get(path).cloned())
            && at.elapsed() < Duration::from_secs(POLICY_CACHE_SECS)
        {
            return Ok(rows);
        }
        let [g, r, s] = release::scopes(path, repository);
        let rows = Arc::new(self.store.policies(&[&g, &r, &s]).await?);
        if let Ok(mut c) = self.policy_cache.lock() {
            if c.len() > 10_000 {
                c.clear();
            }
            c.insert(path.to_string(), (std::time::Instant::now(), rows.clone()));
        }
        Ok(rows)
    }

    /// Drop cached release policies (after this replica changed one).
    pub(crate) fn forget_release_policies(&self) {
        if let Ok(mut c) = self.policy_cache.lock() {
            c.clear();
        }
    }

    /// The appraisal policy in force (stored by an admin, else the configured default).
    pub(crate) async fn appraisal_policy(&self) -> Result<String, KbsError> {
        Ok(self
            .store
            .policy(http::SCOPE_ATTESTATION)
            .await?
            .unwrap_or_else(|| self.default_policy.clone()))
    }

    /// The reference values in force: the stored (else configured) document, its `sample`
    /// section replaced by the sample reference values set through `/kbs/v0/reference-value`.
    pub(crate) async fn reference_values(&self) -> Result<String, KbsError> {
        let main = self.stored_reference_values().await?;
        with_sample(&main, self.sample_reference_values().await?.as_deref())
    }

    /// The reference values `/kbs/v0/reference-values` stored (else configured), without the
    /// sample overlay.
    pub(crate) async fn stored_reference_values(&self) -> Result<String, KbsError> {
        Ok(self
            .store
            .policy(http::SCOPE_REFERENCE_VALUES)
            .await?
            .unwrap_or_else(|| self.default_reference_values.clone()))
    }

    /// The sample reference values set through `/kbs/v0/reference-value`, kept apart from the
    /// rest so merging one cannot overwrite a concurrent change to the others.
    pub(crate) async fn sample_reference_values(&self) -> Result<Option<String>, KbsError> {
        self.store.policy(http::SCOPE_SAMPLE_REFERENCE_VALUES).await
    }

    /// Pick up an appraisal policy or reference values another replica stored.
    pub(crate) async fn refresh_engine(&self) -> Result<(), KbsError> {
        let policy = self.appraisal_policy().await?;
        let refs = self.reference_values().await?;
        let changed = self
            .engine_source
            .lock()
            .map(|s| s.0 != policy || s.1 != refs)
            .unwrap_or(false);
        if changed {
            let engine = appraisal_engine(&policy, &refs)?;
            self.attester.set_engine(engine);
            if let Ok(mut s) = self.engine_source.lock() {
                *s = (policy, refs);
            }
        }
        Ok(())
    }
}

/// A running KBS (tests and `cgx bench kbs` start one on port 0).
#[derive(Debug)]
pub struct Running {
    pub addr: SocketAddr,
    kbs: Arc<Kbs>,
    server: cgx_service::Running,
}

impl Running {
    /// Stop accepting and housekeeping, let open requests finish, close the database.
    pub async fn shutdown(self) {
        self.server.shutdown().await;
        self.kbs.store.close().await;
    }
}

/// Bind `config.listen` and serve until [`Running::shutdown`], on the system clock.
pub async fn start(config: &KbsConfig) -> Result<Running, KbsError> {
    start_with_clock(config, cgx_service::clock::system()).await
}

/// [`start`] on `clock` (tests move a manual clock instead of sleeping).
pub async fn start_with_clock(config: &KbsConfig, clock: SharedClock) -> Result<Running, KbsError> {
    let kbs = Arc::new(Kbs::new(config, clock).await?);
    let mut background: Vec<Background> = vec![Box::pin(housekeeping(kbs.clone()))];
    if kbs.store.is_sqlite() {
        background.push(Box::pin(checkpoints(kbs.clone())));
    }
    if let Some(l) = &kbs.log {
        let every = l.interval();
        let k = kbs.clone();
        background.push(Box::pin(async move {
            cgx_service::logwriter::integrator(
                every,
                store::LOG_PASS.unsigned_abs(),
                || k.integrate_log_pass(),
                || async {
                    let cosigned = k.witness_round().await;
                    if let Some(log) = &k.log
                        && let Err(e) = log.export(k.store.pool()).await
                    {
                        tracing::warn!(error = %e, "log not exported");
                    }
                    cosigned
                },
            )
            .await
        }));
    }
    let server =
        cgx_service::server::start(&config.listener(), http::router(kbs.clone())?, background)
            .await
            .map_err(|e| KbsError::Config(e.to_string()))?;
    Ok(Running {
        addr: server.addr(),
        kbs,
        server,
    })
}

/// Every 2 s: drop expired sessions; pick up an appraisal policy another replica stored.
async fn housekeeping(kbs: Arc<Kbs>) {
    let mut ticker = tokio::time::interval(Duration::from_secs(2));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        kbs.sessions.prune(kbs.clock.unix());
        // Rows too: with `memory` sessions, those a `database` run left behind.
        // Busy databases are normal under load; the next tick retries.
        if let Err(e) = kbs
            .store
            .sweep_sessions(kbs.clock.unix(), kbs.session_ttl)
            .await
        {
            tracing::debug!(error = %e, "session sweep deferred");
        }
        if let Err(e) = kbs.refresh_engine().await {
            tracing::warn!(error = %e, "appraisal policy refresh");
        }
    }
}

/// SQLite: fold the write-ahead log back, at the pace of the writes (`cgx_service::db`).
async fn checkpoints(kbs: Arc<Kbs>) {
    cgx_service::db::checkpoints(|| kbs.store.checkpoint()).await;
}

/// Serve `config` until `shutdown` completes (`cgx kbs serve` passes SIGINT/SIGTERM), then
/// drain and close. `on_listen` is told the bound address.
pub async fn run(
    config: &KbsConfig,
    shutdown: impl std::future::Future<Output = ()>,
    on_listen: impl FnOnce(SocketAddr),
) -> Result<(), KbsError> {
    let running = start(config).await?;
    on_listen(running.addr);
    shutdown.await;
    tracing::info!("shutting down");
    running.shutdown().await;
    Ok(())
}

/// The appraisal engine for an admin's policy and reference values.
pub(crate) fn appraisal_engine(policy: &str, refs: &str) -> Result<PolicyEngine, KbsError> {
    PolicyEngine::new(KBS_POLICY_NAME, policy, refs)
        .map_err(|e| KbsError::PolicyInvalid(e.to_string()))
}

/// `refs` with its `sample` section replaced by `sample` (a JSON object), when there is one.
pub(crate) fn with_sample(refs: &str, sample: Option<&str>) -> Result<String, KbsError> {
    let Some(sample) = sample else {
        return Ok(refs.to_string());
    };
    let bad = |what: &str, e: serde_json::Error| KbsError::PolicyInvalid(format!("{what}: {e}"));
    let mut all: serde_json::Value =
        serde_json::from_str(refs).map_err(|e| bad("reference values", e))?;
    let sample: serde_json::Value =
        serde_json::from_str(sample).map_err(|e| bad("sample reference values", e))?;
    match all.as_object_mut() {
        Some(m) => {
            m.insert("sample".into(), sample);
        }
        None => {
            return Err(KbsError::PolicyInvalid(
                "reference values are not a JSON object".into(),
            ));
        }
    }
    Ok(all.to_string())
}
