//! The broker service: configuration → state ([`Broker`]) → router (`http`) → `cgx-service`'s
//! listener, with the monitor (freshness, failover, completion, pending placement, replica
//! sync) as a background task.
//!
//! One module per domain, each an `impl Broker` over the shared state, with its writes in the
//! store module of the same name (a new domain — proofs of work, metering, the ledger — comes
//! as one more pair):
//! - `nodes.rs`: the nonce, registration and re-attestation, heartbeats, node views;
//! - `jobs.rs`: submission, job views, cancellation, state changes;
//! - `placement.rs`: choosing a node and committing a lease, the pass over pending jobs;
//! - `leases.rs`: how a lease ends, renewal in heartbeat answers;
//! - `monitor.rs`: replica sync, failover, completion, expiry;
//! - `settings.rs`: reference values admins put, the admin audit trail;
//! - `settle.rs`: settlement — each window paid or refunded from its record and proofs, escrow
//!   released as leases end;
//! - `statements.rs`: deposits, accounts and statements (the ledger's API);
//! - `quotes.rs`: the offers a job would get, placing nothing;
//! - `reputation.rs`: reputation from uptime, proofs, failovers and cheats, decayed.
//!
//! And beside them: `index.rs`, the in-memory registry placement decides on (pure,
//! time-explicit); `register.rs`, the checks on a registration's evidence and inventory;
//! `store/`, the database (the truth), atomic capacity; `keys.rs`, what the broker signs and
//! MACs; `http.rs`, routes and handlers that validate and delegate here.

pub mod bench;
pub mod config;
mod console;
mod error;
mod http;
pub mod index;
mod jobs;
mod keys;
mod leases;
mod log;
mod metering;
mod monitor;
mod nodes;
mod placement;
mod pow;
mod quotes;
pub mod reappraise;
mod register;
mod reports;
mod reputation;
mod settings;
mod settle;
mod statements;
pub mod store;
#[cfg(test)]
mod testing;

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
use cgx_service::auth::{Admin, AdminKeys, AdminState};
use cgx_service::metrics::Metrics;
use cgx_service::{Background, SharedClock, jwt};

pub use config::BrokerConfig;
pub use error::BrokerError;

use index::{Freshness, Index};
use placement::Denial;
use store::Store;

/// The most jobs one listing returns.
pub const MAX_LIST: i64 = 1000;

/// The state every handler shares.
pub(crate) struct Broker {
    pub(crate) store: Store,
    appraiser: Arc<Appraiser>,
    source: Option<Arc<CollateralSource>>,
    pub(crate) index: Mutex<Index>,
    pub(crate) keys: keys::Keys,
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
    /// Where the settlement pass goes on from: (started_at, lease) of the last escrow seen.
    settle_cursor: Mutex<(i64, String)>,
    /// One placement pass at a time on this replica (placements inside it are serialized by
    /// the index lock and the database).
    placing: tokio::sync::Mutex<()>,
    /// The `updated_ms` this replica has read node rows up to.
    sync_cursor: Mutex<i64>,
    /// Pending jobs this replica knows of (a hint: when zero, a placement pass skips its read;
    /// the monitor reads anyway, for jobs another replica left pending).
    pending: std::sync::atomic::AtomicI64,
    /// The appraisal policy (configured; reference values change under it).
    appraisal_policy: String,
    /// The reference values in force and their version (0: the configuration file's); the
    /// version never goes down (`settings.rs`). Changed only under `settings_lock`, with the
    /// engine.
    refs_in_force: Mutex<(i64, String)>,
    /// One change of settings at a time on this replica.
    settings_lock: tokio::sync::Mutex<()>,
    /// The transparency log's writer (`[log]`), if it keeps one.
    log: Option<cgx_service::logwriter::LogWriter>,
    /// Per lease, the expiry of the last renewal logged (`leases.rs`).
    renewals_logged: std::sync::Mutex<std::collections::HashMap<String, i64>>,
    /// The KBS log's mirror in progress, by origin (`log.rs`); one pass at a time.
    mirror_staged: tokio::sync::Mutex<HashMap<String, log::Staged>>,
    /// Metering records the console verified, by SHA-256 of (node key, token): a live node
    /// page re-reads the same records every few seconds (`console/provider.rs`).
    metering_verified: Mutex<HashMap<[u8; 32], console::Usage>>,
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
        let keys = keys::Keys::load(&config.signing_key)?;
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
        // The log key must be a key of its own: not the one that signs leases, records and
        // EARs' keys are another kind (P-256).
        let log = config
            .log
            .as_ref()
            .map(|l| cgx_service::logwriter::LogWriter::open(l, &[keys.public]))
            .transpose()?;
        let broker = Broker {
            log,
            renewals_logged: std::sync::Mutex::new(std::collections::HashMap::new()),
            mirror_staged: tokio::sync::Mutex::new(HashMap::new()),
            metering_verified: Mutex::new(HashMap::new()),
            store,
            appraiser: Arc::new(appraiser),
            source,
            index: Mutex::new(Index::new(Freshness {
                reattest_secs: config.reattest_secs,
                heartbeat_secs: config.heartbeat_secs,
                missed_heartbeats: config.missed_heartbeats,
                pow_penalty_secs: config.pow.penalty_secs,
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
            settle_cursor: Mutex::new((0, String::new())),
            placing: tokio::sync::Mutex::new(()),
            sync_cursor: Mutex::new(0),
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

    /// Deposit `amount` micros to `account` (`tenant/<name>` or `stake/<operator>`) under
    /// `reference`, as the in-process owner of this broker (the development network funds
    /// its tenants and operators so; a deployment deposits through the API with a `ledger`
    /// key). Audited as `actor`.
    pub async fn deposit(
        &self,
        account: &str,
        amount: u64,
        reference: &str,
        actor: &str,
    ) -> Result<(), BrokerError> {
        self.broker
            .deposit_as(account, amount, reference, actor)
            .await
            .map(|_| ())
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
    let mut background: Vec<Background> = vec![Box::pin(monitor::monitor(
        broker.clone(),
        Duration::from_millis(config.monitor_interval_ms),
    ))];
    if broker.store.is_sqlite() {
        background.push(Box::pin(monitor::checkpoints(broker.clone())));
    }
    if config.pow.interval_secs > 0 {
        background.push(Box::pin(pow::verifier(
            broker.clone(),
            Duration::from_millis(config.monitor_interval_ms),
        )));
    }
    background.push(Box::pin(reputation::keeper(
        broker.clone(),
        Duration::from_secs(config.reputation.interval_secs),
    )));
    background.push(Box::pin(settle::settler(
        broker.clone(),
        Duration::from_millis(config.ledger.settle_interval_ms),
    )));
    if let Some(l) = &config.log {
        background.push(Box::pin(log::integrator(
            broker.clone(),
            Duration::from_millis(l.interval_ms.max(10)),
        )));
        if l.anchors.iter().any(|a| a.reader_key.is_some()) {
            background.push(Box::pin(log::mirror(
                broker.clone(),
                Duration::from_millis(l.interval_ms.max(250)),
            )));
        }
    }
    let server = cgx_service::server::start(
        &config.listener(),
        http::router(broker.clone())?,
        background,
    )
    .await
    .map_err(|e| BrokerError::Config(e.to_string()))?;
    Ok(Running {
        addr: server.addr(),
        broker,
        server,
    })
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
