//! In-process harness for the domain modules' tests: a [`Broker`] on SQLite in its own folder
//! and on a [`ManualClock`], with no listener and no HTTP; API keys for two tenants, an
//! operator, an auditor and a reference-values admin (their [`Admin`]s made by authenticating
//! a token, as a request would); and simulated nodes whose evidence is the simulator's, in
//! the vendors' formats, registered through the broker's own path.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use cgx_attestation::sim::{SimAmd, SimGpu, SnpReportOptions};
use cgx_attestation::snp::{Product, SigningKey};
use cgx_protocol::broker::{HeartbeatAnswer, JobSpec, Offer, Registered, Registration};
use cgx_protocol::kbs::jwe::{Curve, TeeKey};
use cgx_protocol::money::Micros;
use cgx_protocol::signed::Signer;
use cgx_service::auth::{Admin, BearerKind};
use cgx_service::clock::{Clock, ManualClock};

use super::Broker;
use super::config::{ApiKey, AppraisalConfig, BrokerConfig, CollateralConfig};
use super::error::BrokerError;

/// The launch measurement simulated nodes report (and the reference values accept).
pub const MEASUREMENT: [u8; 48] = [0x5A; 48];
pub const TENANT: &str = "acme";
pub const OTHER_TENANT: &str = "globex";
pub const OPERATOR: &str = "op1";

/// Roles, each with its own API key.
#[derive(Debug, Clone, Copy)]
pub enum Role {
    Tenant,
    OtherTenant,
    Operator,
    Auditor,
    ReferenceValues,
    /// A payment adapter: deposits and stakes.
    Ledger,
}

const ROLES: [Role; 6] = [
    Role::Tenant,
    Role::OtherTenant,
    Role::Operator,
    Role::Auditor,
    Role::ReferenceValues,
    Role::Ledger,
];

/// What the harness deposits for each of its tenants (one million units), so jobs place.
pub const FUNDS: u64 = 1_000_000 * 1_000_000;

impl Role {
    fn scopes(self) -> Vec<String> {
        match self {
            Role::Tenant => vec![format!("tenant:{TENANT}")],
            Role::OtherTenant => vec![format!("tenant:{OTHER_TENANT}")],
            Role::Operator => vec![format!("operator:{OPERATOR}")],
            Role::Auditor => vec!["auditor".into()],
            Role::ReferenceValues => vec!["reference-values".into()],
            Role::Ledger => vec!["ledger".into()],
        }
    }
}

fn ed25519() -> Vec<u8> {
    aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
        .unwrap()
        .as_ref()
        .to_vec()
}

fn raw_public(pkcs8: &[u8]) -> [u8; 32] {
    use aws_lc_rs::signature::KeyPair;
    aws_lc_rs::signature::Ed25519KeyPair::from_pkcs8(pkcs8)
        .unwrap()
        .public_key()
        .as_ref()
        .try_into()
        .unwrap()
}

/// A broker in process.
pub struct Harness {
    pub broker: std::sync::Arc<Broker>,
    pub clock: ManualClock,
    pub dir: PathBuf,
    role_keys: Vec<Vec<u8>>,
    config: BrokerConfig,
}

impl Harness {
    /// A broker on a fresh SQLite database, its clock at the wall clock's now.
    pub async fn new(name: &str) -> Harness {
        Self::with(name, |_| {}).await
    }

    /// [`Harness::new`] with the configuration changed by `edit` first.
    pub async fn with(name: &str, edit: impl FnOnce(&mut BrokerConfig)) -> Harness {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "cgx-broker-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("collateral")).unwrap();
        std::fs::write(dir.join("signing.pk8"), ed25519()).unwrap();
        let refs = serde_json::json!({
            "allow_sim": "affirming",
            "snp": {"measurements": [hex::encode(MEASUREMENT)]},
            "nvidia": {
                "require_ocsp": false,
                "driver_versions": [cgx_attestation::sim::SIM_GPU_DRIVER_VERSION],
                "vbios_versions": [cgx_attestation::sim::SIM_GPU_VBIOS_VERSION],
                "measurements": "any",
            },
        });
        std::fs::write(dir.join("refs.json"), refs.to_string()).unwrap();
        let role_keys: Vec<Vec<u8>> = ROLES.iter().map(|_| ed25519()).collect();
        let mut config = BrokerConfig {
            listen: "127.0.0.1:0".into(),
            tls: None,
            insecure_dev: true,
            database: format!("sqlite://{}", dir.join("broker.db").display()),
            signing_key: dir.join("signing.pk8"),
            result_key: None,
            api_keys: ROLES
                .iter()
                .zip(&role_keys)
                .map(|(role, k)| ApiKey {
                    public_key: base64::Engine::encode(
                        &base64::engine::general_purpose::STANDARD,
                        raw_public(k),
                    ),
                    scopes: role.scopes(),
                })
                .collect(),
            sim_roots: vec!["*".into()],
            collateral: CollateralConfig {
                store: Some(dir.join("collateral")),
            },
            appraisal: AppraisalConfig {
                policy: None,
                reference_values: Some(dir.join("refs.json")),
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
            max_connections: 64,
            max_in_flight: 64,
            max_connections_per_client: 64,
            max_in_flight_per_client: 64,
            metering_window_secs: 60,
            pow: super::config::PowConfig {
                misses_allowed: 0,
                fixed: Some(super::config::PowFixed {
                    n: 64,
                    k: 64,
                    expected_ms: 2_000,
                }),
                ..Default::default()
            },
            ledger: Default::default(),
            reputation: Default::default(),
            log: None,
        };
        edit(&mut config);
        let clock = ManualClock::default();
        let broker = std::sync::Arc::new(Broker::new(&config, clock.shared()).await.unwrap());
        let h = Harness {
            broker,
            clock,
            dir,
            role_keys,
            config,
        };
        for tenant in [TENANT, OTHER_TENANT] {
            h.deposit(
                &format!("tenant/{tenant}"),
                FUNDS,
                &format!("harness-{tenant}"),
            )
            .await
            .unwrap();
        }
        h
    }

    /// Deposit `amount` micros to `account` under `reference`.
    pub async fn deposit(
        &self,
        account: &str,
        amount: u64,
        reference: &str,
    ) -> Result<cgx_protocol::ledger::DepositAnswer, BrokerError> {
        let req = cgx_protocol::ledger::DepositRequest {
            account: account.into(),
            amount_micros: cgx_protocol::money::Micros(amount),
            reference: reference.into(),
        };
        self.broker.deposit(&self.admin(Role::Ledger), req).await
    }

    /// Another broker on the same configuration and database (a replica, on PostgreSQL).
    pub async fn replica(&self) -> Broker {
        Broker::new(&self.config, self.clock.shared())
            .await
            .unwrap()
    }

    /// A new, empty database on the PostgreSQL server `CGX_TEST_DATABASE_URL` names (its
    /// URL), or `None` where it names none.
    pub async fn postgres() -> Option<String> {
        let url = std::env::var("CGX_TEST_DATABASE_URL").ok()?;
        let (base, query) = match url.split_once('?') {
            Some((b, q)) => (b.to_string(), Some(q.to_string())),
            None => (url.clone(), None),
        };
        let after_scheme = base.find("://").map_or(0, |i| i + 3);
        let server = match base[after_scheme..].find('/') {
            Some(i) => base[..after_scheme + i].to_string(),
            None => base.clone(),
        };
        static N: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "cgx_broker_test_{}_{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        );
        sqlx::any::install_default_drivers();
        let pool = sqlx::AnyPool::connect(&url).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
        Some(match query {
            Some(q) => format!("{server}/{name}?{q}"),
            None => format!("{server}/{name}"),
        })
    }

    /// The broker stopped (its database closed) and started again on the same configuration
    /// and database: what a process restart keeps.
    pub async fn restart(&mut self) {
        self.broker.store.close().await;
        self.broker = std::sync::Arc::new(
            Broker::new(&self.config, self.clock.shared())
                .await
                .unwrap(),
        );
    }

    /// The broker's clock now.
    pub fn now(&self) -> i64 {
        self.clock.unix()
    }

    /// `role`'s API key, to sign its own records (a console sign-in).
    pub fn signer(&self, role: Role) -> Signer {
        Signer::from_pkcs8(&self.role_keys[role as usize]).unwrap()
    }

    /// The administrator a request with `role`'s token (issued now) is.
    pub fn admin(&self, role: Role) -> Admin {
        // ROLES lists the roles in declaration order.
        let i = role as usize;
        let now = self.clock.unix();
        let token = BearerKind::BrokerApi
            .sign(
                &Signer::from_pkcs8(&self.role_keys[i]).unwrap(),
                now,
                now + 300,
            )
            .unwrap();
        self.broker.api_keys.authenticate(&token, now).unwrap()
    }

    /// A simulated node with `gpus` H100s of [`OPERATOR`] in `eu-west` at 2 a GPU-hour; its
    /// AMD CRL and its GPUs' OCSP answers are put in the broker's collateral store.
    pub fn node(&self, gpus: u32) -> SimNode {
        let now = self.clock.unix();
        let mut chip = [0u8; 64];
        cgx_attestation::sim::fill_random(&mut chip).unwrap();
        let amd = SimAmd::generate(
            Product::Genoa,
            SigningKey::Vcek,
            cgx_attestation::sim::default_tcb(Product::Genoa),
            chip,
            now,
        )
        .unwrap();
        let gpus_sim: Vec<SimGpu> = (0..gpus).map(|_| SimGpu::generate(now).unwrap()).collect();
        // Through the broker's own collateral source: it keeps the store's index in memory.
        let store = self.broker.source.as_ref().unwrap();
        let key =
            cgx_attestation::trust::amd_crl_key(amd.cert_chain_pem().as_bytes(), false).unwrap();
        let crl = amd.crl(&[], now - 86_400, now + 30 * 86_400).unwrap();
        store.put(&key, &crl, "test", now).unwrap();
        for g in &gpus_sim {
            for cert_id in
                cgx_attestation::nvidia::ocsp::chain_cert_ids(g.chain_pem.as_bytes()).unwrap()
            {
                let key = cgx_attestation::collateral::CollateralKey::NvidiaOcsp { cert_id };
                store
                    .put(&key, &g.good_ocsp().unwrap(), "test", now)
                    .unwrap();
            }
        }
        let node_key = ed25519();
        let tee = TeeKey::generate_ec(Curve::P256).unwrap();
        SimNode {
            id: cgx_protocol::broker::node_id(&raw_public(&node_key)),
            amd,
            gpus: gpus_sim,
            node_key,
            tee,
            offer: Offer {
                gpu_model: "H100".into(),
                gpu_count: gpus,
                gpu_memory_gib: 80,
                region: "eu-west".into(),
                price_per_gpu_hour_micros: Micros(2_000_000),
                operator: OPERATOR.into(),
            },
            seq: AtomicU64::new(0),
        }
    }

    /// Ask for a nonce and register `node` through the broker's registration path.
    pub async fn register(&self, node: &SimNode) -> Result<Registered, BrokerError> {
        let nonce = self.broker.nonce().await?.nonce;
        let reg = node.registration(&nonce);
        self.broker.register(&self.admin(Role::Operator), reg).await
    }

    /// `node`'s next heartbeat, signed now.
    pub async fn heartbeat(&self, node: &SimNode) -> Result<HeartbeatAnswer, BrokerError> {
        let token = node.heartbeat_token(self.clock.unix());
        self.broker.heartbeat(&node.id, &token).await
    }

    /// A job of [`TENANT`]'s for `gpus` H100s for `secs`, with a budget that covers it.
    pub fn job(gpus: u32, secs: u64) -> JobSpec {
        serde_json::from_value(serde_json::json!({
            "gpu_model": "H100",
            "gpu_count": gpus,
            "max_price_per_gpu_hour_micros": 3_000_000,
            "duration_secs": secs,
            "budget_micros": 3_000_000u64 * u64::from(gpus) * secs.div_ceil(3600).max(1),
            "resources": [format!("{TENANT}/weights/key")],
        }))
        .unwrap()
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A simulated confidential VM: the simulator's AMD-SP and GPUs, the node key, the TEE key.
pub struct SimNode {
    pub id: String,
    amd: SimAmd,
    gpus: Vec<SimGpu>,
    pub node_key: Vec<u8>,
    tee: TeeKey,
    pub offer: Offer,
    seq: AtomicU64,
}

impl SimNode {
    /// The same machine (its AMD-SP, its GPUs) after its agent restarted: new node and TEE
    /// keys, so a new node id.
    pub fn restarted(self) -> SimNode {
        let node_key = ed25519();
        SimNode {
            id: cgx_protocol::broker::node_id(&raw_public(&node_key)),
            node_key,
            tee: TeeKey::generate_ec(Curve::P256).unwrap(),
            seq: AtomicU64::new(0),
            ..self
        }
    }

    /// A registration for `nonce` whose evidence binds this node's keys.
    pub fn registration(&self, nonce: &str) -> Registration {
        let raw = cgx_protocol::broker::unb64(nonce).unwrap();
        let tee_public = self.tee.public().unwrap();
        let identity = cgx_protocol::broker::node_identity(
            &raw_public(&self.node_key),
            &cgx_protocol::kbs::jwe::thumbprint(&tee_public),
        );
        let composite = self
            .amd
            .composite_with(
                &self.gpus,
                &raw,
                &identity,
                &SnpReportOptions {
                    measurement: MEASUREMENT,
                    ..Default::default()
                },
            )
            .unwrap();
        let (cpu, gpus) = composite
            .broker_evidence()
            .expect("the simulator makes an SNP bundle");
        cgx_protocol::broker::registration(
            nonce,
            &self.node_key,
            tee_public,
            cpu,
            gpus,
            self.offer.clone(),
        )
        .unwrap()
    }

    /// A workload report of `lease` (job `job`) in `state`, signed at `at`.
    pub fn report_token(
        &self,
        lease: &str,
        job: &str,
        state: cgx_protocol::records::WorkloadState,
        exit_code: Option<i32>,
        at: i64,
    ) -> String {
        cgx_protocol::broker::workload_report_token(
            &self.node_key,
            &cgx_protocol::records::WorkloadReport {
                sub: self.id.clone(),
                lease: lease.to_string(),
                job: job.to_string(),
                state,
                exit_code,
                reason: format!("workload {state}"),
            },
            at,
        )
        .unwrap()
    }

    /// This node's metering record of window `seq` of `lease` (started at `start`, on
    /// `gpus`), chained to `prev`, signed at `at`.
    #[allow(clippy::too_many_arguments)]
    pub fn meter(
        &self,
        lease: &str,
        start: i64,
        window_secs: u32,
        seq: u64,
        gpus: &[u32],
        prev: String,
        at: i64,
    ) -> String {
        use cgx_protocol::metering::{GpuUsage, MeteringRecord};
        let r = MeteringRecord {
            sub: self.id.clone(),
            lease: lease.to_string(),
            seq,
            window_start: start + i64::from(window_secs) * i64::try_from(seq).unwrap(),
            window_secs,
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
            workload: cgx_protocol::records::WorkloadState::Running,
            prev,
        };
        cgx_protocol::signed::Signer::from_pkcs8(&self.node_key)
            .unwrap()
            .sign(&r, at, at + 300)
            .unwrap()
    }

    /// Answer challenge `c` through `broker` at `now`: honestly on the CPU, or (`honest`
    /// false) skipping a fifth of the rows, which the verifier catches.
    pub async fn prove(
        &self,
        broker: &Broker,
        c: &cgx_protocol::broker::PowChallenge,
        honest: bool,
        now: i64,
    ) {
        use base64::Engine as _;
        use cgx_pow::Backend;
        let signer = cgx_protocol::signed::Signer::from_pkcs8(&self.node_key).unwrap();
        let ch = cgx_pow::challenge::Challenge {
            seed: cgx_pow::challenge::seed(
                &hex::decode(&c.nonce).unwrap(),
                &c.lease,
                c.window,
                &signer.public_key(),
                c.gpu,
            ),
            params: cgx_pow::Params { n: c.n, k: c.k },
        };
        let (held, _) = if honest {
            cgx_pow::backend::Cpu { threads: 1 }.commit(&ch).unwrap()
        } else {
            cgx_pow::backend::SkipRows {
                threads: 1,
                percent: 20,
            }
            .commit(&ch)
            .unwrap()
        };
        let receipt = cgx_protocol::broker::PowReceipt {
            sub: self.id.clone(),
            challenge: c.id.clone(),
            root: hex::encode(held.root()),
            proof_sha256: String::new(),
            gpu_us: 1000,
            backend: "test".into(),
        };
        let post = cgx_protocol::broker::PowCommit {
            receipt: signer.sign(&receipt, now, now + 300).unwrap(),
        };
        let opening = broker.pow_commit(&self.id, &c.id, &post).await.unwrap();
        let opening: [u8; 32] = hex::decode(&opening.opening).unwrap().try_into().unwrap();
        let bytes = cgx_pow::wire::encode(&held.open(&opening).unwrap());
        let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &bytes);
        let receipt = cgx_protocol::broker::PowReceipt {
            proof_sha256: hex::encode(digest.as_ref()),
            ..receipt
        };
        let post = cgx_protocol::broker::PowPost {
            receipt: signer.sign(&receipt, now, now + 300).unwrap(),
            proof: base64::engine::general_purpose::STANDARD.encode(&bytes),
        };
        broker.pow_answer(&self.id, &c.id, &post).await.unwrap();
    }

    /// A heartbeat token with the next sequence number, signed at `at`.
    pub fn heartbeat_token(&self, at: i64) -> String {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst) + 1;
        cgx_protocol::broker::heartbeat_token(&self.node_key, &self.id, seq, at).unwrap()
    }
}
