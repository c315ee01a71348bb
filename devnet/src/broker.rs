//! The development network's broker and simulated nodes: a broker on `127.0.0.1:0` whose
//! signing key is the KBS setup's broker key (so the KBS honours its leases), with API keys for
//! two tenants, an operator and an auditor; and simulated nodes that register on composite
//! evidence, heartbeat with their node key, and attest to the KBS with the TEE key their
//! registration bound.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use cgx_attestation::sim::SnpReportOptions;
use cgx_broker::client::BrokerClient;
use cgx_broker::server::config::{ApiKey, AppraisalConfig, BrokerConfig};
use cgx_kbs::client::KbsClient;
use cgx_kbs::sim::SimNode;
use cgx_protocol::broker::{HeartbeatAnswer, Offer, Registered, Registration};
use cgx_protocol::kbs::jwe::{Curve, TeeKey};
use serde_json::json;

use crate::{DevnetError, Ed, Result, Setup, now, temp_dir, write_private};

/// Tenants and roles the development broker knows.
pub const TENANT_A: &str = "acme";
pub const TENANT_B: &str = "globex";
pub const OPERATOR: &str = "op1";
/// What the development network deposits for each tenant (one million units, in micros).
pub const DEVNET_FUNDS: u64 = 1_000_000 * 1_000_000;
/// What it stakes for each operator (a thousand units).
pub const DEVNET_STAKE: u64 = 1_000 * 1_000_000;

/// A broker configuration beside a KBS setup.
#[derive(Debug)]
pub struct BrokerSetup {
    pub dir: PathBuf,
    pub config: BrokerConfig,
    /// `tenant:acme`.
    pub tenant: Ed,
    /// `tenant:globex`.
    pub other_tenant: Ed,
    /// `operator:op1` and `operator:op2`.
    pub operator: Ed,
    /// `auditor`.
    pub auditor: Ed,
    /// `reference-values`: sets the reference values appraisal uses.
    pub admin: Ed,
}

impl Ed {
    /// A bearer API token for the broker (five minutes).
    pub fn api_token(&self) -> Result<String> {
        self.token_at(cgx_service::auth::BearerKind::BrokerApi, now())
    }
}

/// The development broker's log origin (its checkpoints' first line, its key's name).
pub const LOG_ORIGIN: &str = "broker.cgx.devnet/log";

/// A broker that signs leases with `kbs.broker` and trusts `sim_roots` (hex pins, or `*`), on
/// SQLite in its own folder unless `database` is given (a PostgreSQL URL shared by replicas).
pub fn broker_setup(
    kbs: &Setup,
    sim_roots: Vec<String>,
    database: Option<String>,
) -> Result<BrokerSetup> {
    let dir = temp_dir("broker")?;
    let write = |name: &str, bytes: &[u8]| write_private(&dir, name, bytes).map(drop);
    write("signing.pk8", &kbs.broker.pkcs8)?;
    let result_key = aws_lc_rs::signature::EcdsaKeyPair::generate_pkcs8(
        &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
        &aws_lc_rs::rand::SystemRandom::new(),
    )
    .map_err(|_| DevnetError::Keys)?;
    write("ear.pk8", result_key.as_ref())?;
    let log_key =
        aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .map_err(|_| DevnetError::Keys)?;
    write("log.pk8", log_key.as_ref())?;
    let tenant = Ed::generate()?;
    let other_tenant = Ed::generate()?;
    let operator = Ed::generate()?;
    let auditor = Ed::generate()?;
    let admin = Ed::generate()?;
    let key = |e: &Ed, scopes: &[&str]| ApiKey {
        public_key: e.public_b64.clone(),
        scopes: scopes.iter().map(|s| s.to_string()).collect(),
    };
    let config = BrokerConfig {
        listen: "127.0.0.1:0".into(),
        tls: None,
        insecure_dev: true,
        database: database
            .unwrap_or_else(|| format!("sqlite://{}", dir.join("broker.db").display())),
        signing_key: dir.join("signing.pk8"),
        result_key: Some(dir.join("ear.pk8")),
        api_keys: vec![
            key(&tenant, &[&format!("tenant:{TENANT_A}")]),
            key(&other_tenant, &[&format!("tenant:{TENANT_B}")]),
            key(
                &operator,
                &[&format!("operator:{OPERATOR}"), "operator:op2"],
            ),
            key(&auditor, &["auditor"]),
            key(&admin, &["reference-values", "ledger"]),
        ],
        sim_roots,
        // The store the KBS setup wrote the simulated nodes' CRLs to (the broker requires a
        // current CRL from its store for every SNP chain).
        collateral: cgx_broker::server::config::CollateralConfig {
            store: Some(kbs.dir.join(crate::COLLATERAL_DIR)).filter(|d| d.is_dir()),
        },
        appraisal: AppraisalConfig {
            policy: None,
            reference_values: Some(kbs.dir.join("refs.json")),
        },
        reattest_secs: 600,
        heartbeat_secs: 5,
        missed_heartbeats: 3,
        lease_ttl_secs: 120,
        nonce_ttl_secs: 60,
        monitor_interval_ms: 250,
        api_token_max_ttl_secs: 3600,
        max_pending_per_tenant: 250,
        placement_batch: 1000,
        pending_ttl_secs: 86_400,
        max_connections: 4096,
        max_in_flight: 1024,
        // Every client of a development network is 127.0.0.1 (see `setup`).
        max_connections_per_client: 4096,
        max_in_flight_per_client: 1024,
        // Short windows, and challenges a simulated node proves on its CPU in milliseconds,
        // each checked in full: the development network shows the whole loop in seconds.
        metering_window_secs: 2,
        pow: cgx_broker::server::config::PowConfig {
            interval_secs: 30,
            misses_allowed: 2,
            fixed: Some(cgx_broker::server::config::PowFixed {
                n: 256,
                k: 66,
                expected_ms: 2_000,
            }),
            ..Default::default()
        },
        // Settlement closes an ended lease's escrow a few seconds after its last window.
        ledger: cgx_broker::server::config::LedgerConfig {
            settle_grace_secs: 3,
            settle_interval_ms: 250,
            ..Default::default()
        },
        reputation: Default::default(),
        // Every audited decision a leaf of a log checkpointed four times a second.
        log: Some(cgx_broker::server::config::LogConfig {
            origin: LOG_ORIGIN.into(),
            key: dir.join("log.pk8"),
            interval_ms: 250,
            state: None,
            witnesses: Vec::new(),
            quorum: 0,
            anchors: Vec::new(),
            export_dir: None,
        }),
    };
    Ok(BrokerSetup {
        dir,
        config,
        tenant,
        other_tenant,
        operator,
        auditor,
        admin,
    })
}

impl BrokerSetup {
    pub fn cleanup(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }

    /// The log's verifier key.
    pub fn log_vkey(&self) -> Result<String> {
        crate::log_vkey(&self.dir.join("log.pk8"), LOG_ORIGIN)
    }

    /// Have `witness` cosign the log's checkpoints, and publish none without it.
    pub fn witnessed_by(&mut self, witness: &WitnessServer) {
        if let Some(l) = self.config.log.as_mut() {
            l.witnesses = vec![cgx_broker::server::config::WitnessRef {
                vkey: witness.vkey.clone(),
                url: witness.base.clone(),
                ca: None,
            }];
            l.quorum = 1;
        }
    }

    /// A client of `base` with `who`'s API token.
    pub fn client(&self, base: &str, who: &Ed) -> Result<BrokerClient> {
        self.client_at(base, who, now())
    }

    /// A client whose token is issued at `t` (a broker on a manual clock).
    pub fn client_at(&self, base: &str, who: &Ed, t: i64) -> Result<BrokerClient> {
        BrokerClient::new(
            base,
            None,
            Some(who.token_at(cgx_service::auth::BearerKind::BrokerApi, t)?),
        )
        .map_err(|e| DevnetError::Kbs(e.to_string()))
    }
}

/// A broker on its own runtime; stopped gracefully on [`BrokerServer::stop`] or drop.
pub struct BrokerServer {
    pub base: String,
    pub addr: std::net::SocketAddr,
    rt: tokio::runtime::Runtime,
    running: Option<cgx_broker::server::Running>,
}

impl std::fmt::Debug for BrokerServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerServer")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl BrokerServer {
    pub fn start(config: &BrokerConfig) -> Result<Self> {
        Self::start_with_clock(config, cgx_service::clock::system())
    }

    pub fn start_with_clock(
        config: &BrokerConfig,
        clock: cgx_service::SharedClock,
    ) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("broker-server")
            .enable_all()
            .build()
            .map_err(|e| DevnetError::Kbs(e.to_string()))?;
        let running = rt
            .block_on(cgx_broker::server::start_with_clock(config, clock))
            .map_err(|e| DevnetError::Kbs(format!("broker: {e}")))?;
        // The development network's money: its tenants funded, its operators staked (once:
        // a restart on the same database finds the references deposited).
        for (account, amount) in [
            (format!("tenant/{TENANT_A}"), DEVNET_FUNDS),
            (format!("tenant/{TENANT_B}"), DEVNET_FUNDS),
            (format!("stake/{OPERATOR}"), DEVNET_STAKE),
            ("stake/op2".to_string(), DEVNET_STAKE),
        ] {
            rt.block_on(running.deposit(
                &account,
                amount,
                &format!("devnet-{}", account.replace('/', "-")),
                "devnet",
            ))
            .map_err(|e| DevnetError::Kbs(format!("broker: deposit: {e}")))?;
        }
        Ok(BrokerServer {
            base: format!("http://{}", running.addr),
            addr: running.addr,
            rt,
            running: Some(running),
        })
    }

    /// Deposit `amount` micros to `account` (`tenant/<name>`, `stake/<operator>`) under
    /// `reference`, as the broker's in-process owner.
    pub fn deposit(&self, account: &str, amount: u64, reference: &str) -> Result<()> {
        match &self.running {
            Some(r) => self
                .rt
                .block_on(r.deposit(account, amount, reference, "devnet"))
                .map_err(|e| DevnetError::Kbs(format!("broker: deposit: {e}"))),
            None => Ok(()),
        }
    }

    /// One monitor pass now (with a manual clock: after moving it).
    pub fn tick(&self) -> Result<()> {
        match &self.running {
            Some(r) => self
                .rt
                .block_on(r.tick())
                .map_err(|e| DevnetError::Kbs(format!("broker: {e}"))),
            None => Ok(()),
        }
    }

    pub fn stop(mut self) {
        if let Some(r) = self.running.take() {
            self.rt.block_on(r.shutdown());
        }
    }
}

impl Drop for BrokerServer {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            self.rt.block_on(r.shutdown());
        }
    }
}

/// A C2SP tlog-witness (`cgx witness serve`'s service) on its own runtime, on loopback.
pub struct WitnessServer {
    pub base: String,
    pub vkey: String,
    rt: tokio::runtime::Runtime,
    running: Option<cgx_service::Running>,
}

impl std::fmt::Debug for WitnessServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WitnessServer")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl WitnessServer {
    /// A witness named `witness.cgx.devnet/w1` of the log `log_vkey`, its key and state in
    /// `dir`.
    pub fn start(dir: &std::path::Path, log_vkey: &str) -> Result<Self> {
        let e = |e: &dyn std::fmt::Display| DevnetError::Kbs(format!("witness: {e}"));
        std::fs::create_dir_all(dir).map_err(|x| e(&x))?;
        let key = dir.join("witness.pk8");
        let der = aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(
            &aws_lc_rs::rand::SystemRandom::new(),
        )
        .map_err(|x| e(&x))?;
        std::fs::write(&key, der.as_ref()).map_err(|x| e(&x))?;
        let config = cgx_service::witness::WitnessConfig {
            listen: "127.0.0.1:0".into(),
            tls: None,
            insecure_dev: true,
            name: "witness.cgx.devnet/w1".into(),
            key,
            state_dir: dir.join("state"),
            logs: vec![log_vkey.to_string()],
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("witness")
            .enable_all()
            .build()
            .map_err(|x| e(&x))?;
        let w =
            std::sync::Arc::new(cgx_service::witness::Witness::open(&config).map_err(|x| e(&x))?);
        let vkey = w.vkey();
        let running = rt
            .block_on(cgx_service::server::start(
                &cgx_service::config::ServiceConfig::listener(&config),
                cgx_service::witness::router(w),
                Vec::new(),
            ))
            .map_err(|x| e(&x))?;
        Ok(WitnessServer {
            base: format!("http://{}", running.addr()),
            vkey,
            rt,
            running: Some(running),
        })
    }
}

impl Drop for WitnessServer {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            self.rt.block_on(r.shutdown());
        }
    }
}

/// A simulated node as the broker sees it: a simulated CVM ([`SimNode`]: SNP report and GPUs),
/// an Ed25519 node key, the EC TEE key it attests to the KBS with, and its offer.
pub struct SimBrokerNode {
    pub sim: SimNode,
    pub node_key: Ed,
    node_key_raw: [u8; 32],
    tee_pkcs8: Vec<u8>,
    pub offer: Offer,
    pub id: String,
    /// The SNP guest policy its reports carry (tests set the debug bit, 1 << 19).
    pub snp_policy: u64,
    seq: AtomicU64,
}

impl std::fmt::Debug for SimBrokerNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimBrokerNode")
            .field("id", &self.id)
            .field("offer", &self.offer)
            .finish_non_exhaustive()
    }
}

/// An offer of `gpus` simulated H100s (80 GiB) in `region` at `price` per GPU-hour.
pub fn offer(gpus: u32, region: &str, price: cgx_protocol::money::Micros) -> Offer {
    Offer {
        gpu_model: "H100".into(),
        gpu_count: gpus,
        gpu_memory_gib: 80,
        region: region.into(),
        price_per_gpu_hour_micros: price,
        operator: OPERATOR.into(),
    }
}

fn sim_err(e: impl std::fmt::Display) -> DevnetError {
    DevnetError::Simulator(e.to_string())
}

impl SimBrokerNode {
    /// A simulated node with `sim`'s hardware making `offer`.
    pub fn new(sim: SimNode, offer: Offer) -> Result<Self> {
        use aws_lc_rs::signature::{Ed25519KeyPair, KeyPair};
        let node_key = Ed::generate()?;
        let kp = Ed25519KeyPair::from_pkcs8(&node_key.pkcs8).map_err(|_| DevnetError::Keys)?;
        let node_key_raw: [u8; 32] = kp
            .public_key()
            .as_ref()
            .try_into()
            .map_err(|_| DevnetError::Keys)?;
        let tee = TeeKey::generate_ec(Curve::P256).map_err(sim_err)?;
        Ok(SimBrokerNode {
            id: cgx_protocol::broker::node_id(&node_key_raw),
            sim,
            node_key,
            node_key_raw,
            tee_pkcs8: tee.ec_pkcs8().map_err(sim_err)?,
            offer,
            snp_policy: SnpReportOptions::default().policy,
            seq: AtomicU64::new(0),
        })
    }

    /// A node with `gpus` simulated H100s measured as [`crate::MEASUREMENT`].
    pub fn generate(gpus: usize, offer: Offer) -> Result<Self> {
        Self::new(crate::node(gpus)?, offer)
    }

    /// The raw Ed25519 node key.
    pub fn node_key_raw(&self) -> [u8; 32] {
        self.node_key_raw
    }

    pub fn tee_key(&self) -> Result<TeeKey> {
        TeeKey::ec_from_der(Curve::P256, &self.tee_pkcs8).map_err(sim_err)
    }

    /// The RFC 7638 thumbprint of the TEE key.
    pub fn tee_thumbprint(&self) -> Result<String> {
        Ok(cgx_protocol::kbs::jwe::thumbprint(
            &self.tee_key()?.public().map_err(sim_err)?,
        ))
    }

    /// A registration for `nonce` (base64url) binding `identity_key` and `tee` (tests pass
    /// another node's values to bind the evidence to the wrong identity).
    pub fn registration_with(
        &self,
        nonce: &str,
        bound_nonce: &[u8],
        bound_node_key: &[u8; 32],
        bound_tee_thumbprint: &str,
    ) -> Result<Registration> {
        let identity = cgx_protocol::broker::node_identity(bound_node_key, bound_tee_thumbprint);
        let composite = self
            .sim
            .amd
            .composite_with(
                &self.sim.gpus,
                bound_nonce,
                &identity,
                &SnpReportOptions {
                    measurement: self.sim.measurement,
                    policy: self.snp_policy,
                    ..Default::default()
                },
            )
            .map_err(sim_err)?;
        let (cpu, gpus) = composite
            .broker_evidence()
            .ok_or_else(|| sim_err("the simulator made no SNP bundle"))?;
        // The guest's own builder (`cgx-protocol`): the dev network registers as a node does.
        cgx_protocol::broker::registration(
            nonce,
            &self.node_key.pkcs8,
            self.tee_key()?.public().map_err(sim_err)?,
            cpu,
            gpus,
            self.offer.clone(),
        )
        .map_err(|e| DevnetError::Kbs(e.to_string()))
    }

    /// A registration for `nonce` binding this node's own keys.
    pub fn registration(&self, nonce: &str) -> Result<Registration> {
        let raw = cgx_protocol::broker::unb64(nonce).ok_or_else(|| sim_err("nonce"))?;
        self.registration_with(nonce, &raw, &self.node_key_raw, &self.tee_thumbprint()?)
    }

    /// Ask for a nonce and register through `operator` (a client with an operator token).
    pub fn register(
        &self,
        operator: &BrokerClient,
    ) -> std::result::Result<Registered, cgx_broker::client::ClientError> {
        let n = operator.nonce()?;
        let reg = self
            .registration(&n.nonce)
            .map_err(|e| cgx_broker::client::ClientError::Decode(e.to_string()))?;
        operator.register(&reg)
    }

    /// A signed heartbeat token with the next sequence number.
    pub fn heartbeat_token(&self, at: i64) -> Result<String> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst) + 1;
        cgx_protocol::broker::heartbeat_token(&self.node_key.pkcs8, &self.id, seq, at)
            .map_err(DevnetError::Kbs)
    }

    /// Heartbeat now (wall clock) through `client`.
    pub fn heartbeat(
        &self,
        client: &BrokerClient,
    ) -> std::result::Result<HeartbeatAnswer, cgx_broker::client::ClientError> {
        let t = self
            .heartbeat_token(now())
            .map_err(|e| cgx_broker::client::ClientError::Decode(e.to_string()))?;
        client.heartbeat(&self.id, &t)
    }

    /// Report `lease`'s workload (job `job`) in `state`, signed at `at`, through `client`.
    pub fn report(
        &self,
        client: &BrokerClient,
        lease: &str,
        job: &str,
        state: cgx_protocol::records::WorkloadState,
        exit_code: Option<i32>,
        at: i64,
    ) -> std::result::Result<cgx_protocol::broker::ReportAnswer, cgx_broker::client::ClientError>
    {
        let report = cgx_protocol::records::WorkloadReport {
            sub: self.id.clone(),
            lease: lease.to_string(),
            job: job.to_string(),
            state,
            exit_code,
            reason: format!("workload {state}"),
        };
        let t = cgx_protocol::broker::workload_report_token(&self.node_key.pkcs8, &report, at)
            .map_err(cgx_broker::client::ClientError::Decode)?;
        client.report(&self.id, &t)
    }

    /// A KBS client holding this node's TEE key (the key its registration bound).
    pub fn kbs_client(&self, base: &str) -> Result<KbsClient> {
        KbsClient::new(base, None, self.tee_key()?).map_err(|e| DevnetError::Kbs(e.to_string()))
    }
}

/// Reference values for a broker that accepts sim evidence measured as `measurements`.
pub fn reference_values(measurements: &[[u8; 48]]) -> serde_json::Value {
    json!({
        "allow_sim": "affirming",
        "snp": {"measurements": measurements.iter().map(hex::encode).collect::<Vec<_>>()},
        "nvidia": crate::sim_gpu_reference_values()
    })
}
