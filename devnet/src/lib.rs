//! A loopback development network: a KBS on `127.0.0.1:0` (plain HTTP, SQLite in a temporary
//! folder unless a database URL is given) trusting the simulator roots and launch measurement
//! of the simulated nodes it is set up for, with an admin key for every repository, a tenant
//! admin key for `tenant-a`, and a broker key that signs leases.
//!
//! One setup serves the test suites of every crate, the benchmarks and `cgx up`, so they all
//! exercise the KBS as it is configured in production, through its public configuration.
//! Development only: keys are generated per setup and the folder is removed on [`Setup::cleanup`].
//!
//! The folder holds a KEK and signing keys, so it is private: a fresh directory with an
//! unguessable name created 0700 (never an existing one, never a path another user could have
//! prepared), and every file in it written 0600 under a temporary name and renamed into place,
//! so no file is ever readable by others or seen half written.

pub mod broker;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use aws_lc_rs::signature::{Ed25519KeyPair, KeyPair};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use cgx_kbs::server::config::{AdminKey, AppraisalConfig, KbsConfig, KekSource};
use cgx_kbs::server::{Running, start_with_clock};
pub use cgx_kbs::sim::SimNode;
use serde_json::json;

/// Reference values for the simulated GPUs: their driver and VBIOS versions, stated, and their
/// golden measurements waived in writing (`"any"`: the simulator's are not NVIDIA's RIMs).
/// Revocation is not required (sim OCSP responses are not fetched here).
pub fn sim_gpu_reference_values() -> serde_json::Value {
    json!({
        "require_ocsp": false,
        "driver_versions": [cgx_attestation::sim::SIM_GPU_DRIVER_VERSION],
        "vbios_versions": [cgx_attestation::sim::SIM_GPU_VBIOS_VERSION],
        "measurements": "any",
    })
}

/// Launch measurement of the simulated nodes the default reference values accept.
pub const MEASUREMENT: [u8; 48] = [0x5A; 48];

/// What can go wrong setting up or driving the development network.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DevnetError {
    #[error("{path}: {detail}")]
    Io { path: String, detail: String },
    #[error("key generation failed")]
    Keys,
    #[error("KBS: {0}")]
    Kbs(String),
    #[error("{url}: HTTP {status}: {body}")]
    Http {
        url: String,
        status: u16,
        body: String,
    },
    #[error("{0}")]
    Simulator(String),
}

type Result<T, E = DevnetError> = std::result::Result<T, E>;

fn io(path: &Path, e: std::io::Error) -> DevnetError {
    DevnetError::Io {
        path: path.display().to_string(),
        detail: e.to_string(),
    }
}

/// A new, empty database on the PostgreSQL server `url` names; its URL.
pub fn fresh_postgres(url: &str) -> Result<String> {
    let kbs = |e: &dyn std::fmt::Display| DevnetError::Kbs(format!("PostgreSQL: {e}"));
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let after_scheme = base.find("://").map_or(0, |i| i + 3);
    let server = match base[after_scheme..].find('/') {
        Some(i) => &base[..after_scheme + i],
        None => base,
    };
    let mut tag = [0u8; 6];
    aws_lc_rs::rand::fill(&mut tag).map_err(|_| DevnetError::Keys)?;
    let name = format!("cgx_devnet_{}_{}", std::process::id(), hex::encode(tag));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| kbs(&e))?;
    rt.block_on(async {
        sqlx::any::install_default_drivers();
        let pool = sqlx::AnyPool::connect(url).await.map_err(|e| kbs(&e))?;
        // The name is ours (digits, hex and underscores): no quoting needed.
        let created = sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&pool)
            .await;
        pool.close().await;
        created.map(|_| ()).map_err(|e| kbs(&e))
    })?;
    Ok(match query {
        Some(q) => format!("{server}/{name}?{q}"),
        None => format!("{server}/{name}"),
    })
}

/// Unix seconds now (the development network's tokens are issued against the wall clock).
pub fn now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

/// The peers no one here wrote (`kbs-client`, Trustee's KBS): `$CGX_ANCHORS`, else
/// `shared/anchors` beside one of `starts`' ancestors. `None` when there is no `kbs-client`.
pub fn shared_anchors(starts: &[&Path]) -> Option<PathBuf> {
    let dir = match std::env::var_os("CGX_ANCHORS") {
        Some(p) => PathBuf::from(p),
        None => starts.iter().find_map(|s| {
            s.ancestors()
                .map(|a| a.join("shared/anchors"))
                .find(|p| p.join("kbs-client").is_file())
        })?,
    };
    dir.join("kbs-client").is_file().then_some(dir)
}

/// A fresh, empty, private folder (0700) under the system's temporary folder, with a name no
/// one can predict. Created with `mkdir`, which fails on anything already there: a directory
/// or a symbolic link another user planted under the shared temporary folder is never used.
pub fn temp_dir(name: &str) -> Result<PathBuf> {
    static N: AtomicU32 = AtomicU32::new(0);
    let mut tag = [0u8; 8];
    aws_lc_rs::rand::fill(&mut tag).map_err(|_| DevnetError::Keys)?;
    let p = std::env::temp_dir().join(format!(
        "cgx-{}-{}-{}-{name}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst),
        hex::encode(tag)
    ));
    let mut builder = std::fs::DirBuilder::new();
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(0o700);
    }
    builder.create(&p).map_err(|e| io(&p, e))?;
    Ok(p)
}

/// Write `bytes` to `dir/name` readable by the owner only (0600), atomically: into a new file
/// with a random name in `dir` (created 0600 with `O_EXCL`, so it is never readable by others
/// and never an existing file or link), synced, then renamed over `name`.
pub fn write_private(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf> {
    use std::io::Write;
    let path = dir.join(name);
    let mut tag = [0u8; 8];
    aws_lc_rs::rand::fill(&mut tag).map_err(|_| DevnetError::Keys)?;
    let tmp = dir.join(format!(".{name}.tmp-{}", hex::encode(tag)));
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let written = opts.open(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        f.sync_all()
    });
    let renamed = written.and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = renamed {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(&path, e));
    }
    Ok(path)
}

/// A simulated confidential VM (SNP report, `gpus` simulated H100s) measured as
/// [`MEASUREMENT`].
pub fn node(gpus: usize) -> Result<SimNode> {
    SimNode::generate(gpus, MEASUREMENT, now()).map_err(|e| DevnetError::Simulator(e.to_string()))
}

/// An Ed25519 key: PKCS#8 for signing, the raw public key in base64 for a KBS configuration.
#[derive(Clone)]
pub struct Ed {
    pub pkcs8: Vec<u8>,
    pub public_b64: String,
}

impl std::fmt::Debug for Ed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ed")
            .field("public_b64", &self.public_b64)
            .finish_non_exhaustive()
    }
}

impl Ed {
    pub fn generate() -> Result<Ed> {
        let doc = Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .map_err(|_| DevnetError::Keys)?;
        let kp = Ed25519KeyPair::from_pkcs8(doc.as_ref()).map_err(|_| DevnetError::Keys)?;
        Ok(Ed {
            pkcs8: doc.as_ref().to_vec(),
            public_b64: STANDARD.encode(kp.public_key().as_ref()),
        })
    }

    /// A KBS admin bearer token (as CoCo's kbs-client makes them, for the KBS's audience),
    /// valid for five minutes.
    pub fn admin_token(&self) -> Result<String> {
        self.token_at(cgx_service::auth::BearerKind::KbsAdmin, now())
    }

    /// A bearer token of `kind` issued at `t` (a service on a manual clock), valid for five
    /// minutes: KBS admin tokens and broker API tokens are two record kinds
    /// ([`cgx_protocol::signed::Kind`]), each refused by the other service.
    pub fn token_at(&self, kind: cgx_service::auth::BearerKind, t: i64) -> Result<String> {
        kind.sign(&self.signer()?, t, t + 300)
            .map_err(|e| DevnetError::Kbs(e.to_string()))
    }

    /// This key as a record signer.
    pub fn signer(&self) -> Result<cgx_protocol::signed::Signer> {
        cgx_protocol::signed::Signer::from_pkcs8(&self.pkcs8)
            .map_err(|e| DevnetError::Kbs(e.to_string()))
    }

    /// A broker lease for `node_key` (RFC 7638 thumbprint of the TEE key) covering `resources`,
    /// for the tenant whose repository the first resource is in (a lease always names its
    /// tenant; the KBS releases nothing of another's under it).
    pub fn lease(
        &self,
        lease: &str,
        resources: &[&str],
        node_key: &str,
        exp: i64,
    ) -> Result<String> {
        let tenant = resources
            .first()
            .and_then(|r| r.split('/').next())
            .unwrap_or_default();
        self.lease_for(tenant, lease, resources, node_key, now(), exp)
    }

    /// A lease record as the broker signs it (`cgx_protocol::records::Lease`), for `tenant`,
    /// issued at `iat`: the one place outside the broker that writes a lease's fields (tests
    /// pass a tenant that does not own the resources, to see it refused).
    pub fn lease_for(
        &self,
        tenant: &str,
        lease: &str,
        resources: &[&str],
        node_key: &str,
        iat: i64,
        exp: i64,
    ) -> Result<String> {
        let body = cgx_protocol::records::Lease {
            lease: lease.to_string(),
            job: lease.to_string(),
            tenant: tenant.to_string(),
            node: "devnet".into(),
            gpus: Vec::new(),
            resources: resources.iter().map(|r| r.to_string()).collect(),
            node_key: node_key.to_string(),
            iss: "cgx-broker".into(),
            until: exp,
            start: iat,
            window_secs: 0,
            workload: None,
        };
        self.signer()?
            .sign(&body, iat, exp)
            .map_err(|e| DevnetError::Kbs(e.to_string()))
    }
}

/// Everything a development KBS needs, kept so that a second replica or a restart shares it.
/// The verifier key of the log named `origin` whose Ed25519 PKCS#8 key is at `key`.
pub(crate) fn log_vkey(key: &std::path::Path, origin: &str) -> Result<String> {
    let der = std::fs::read(key)
        .map_err(|e| DevnetError::Kbs(format!("log key {}: {e}", key.display())))?;
    Ok(
        cgx_tlog::note::NoteSigner::from_pkcs8(origin, cgx_tlog::note::KeyKind::Ed25519, &der)
            .map_err(|e| DevnetError::Kbs(e.to_string()))?
            .vkey(),
    )
}

/// The development KBS's log origin.
pub const KBS_LOG_ORIGIN: &str = "kbs.cgx.devnet/log";

/// The development KBS's `log-reader` admin key, in its folder: the broker reads the KBS log's
/// entries with it (its mirror of releases by lease).
pub const LOG_READER_KEY: &str = "kbs-log-reader.pk8";

#[derive(Debug)]
pub struct Setup {
    pub dir: PathBuf,
    pub database: String,
    /// May change every repository and the global settings.
    pub admin: Ed,
    /// May change repository `tenant-a` only.
    pub tenant_admin: Ed,
    /// Signs leases.
    pub broker: Ed,
    /// Simulator root pins the KBS trusts.
    pub pins: Vec<[u8; 32]>,
    pub config: KbsConfig,
}

/// A KBS configuration for `nodes` (their simulator roots trusted, [`MEASUREMENT`] accepted,
/// OCSP not required of simulated GPUs), in a fresh temporary folder, on SQLite there — or, when
/// `database` names a PostgreSQL server, on a new database created there for this setup (each
/// setup has its own KEK, and a database remembers the KEK it was sealed under).
pub fn setup(nodes: &[&SimNode], database: Option<String>) -> Result<Setup> {
    let database = database.map(|url| fresh_postgres(&url)).transpose()?;
    let pins: Vec<[u8; 32]> = nodes.iter().flat_map(|n| n.root_pins()).collect();
    let measurements: Vec<String> = nodes.iter().map(|n| hex::encode(n.measurement)).collect();
    let setup = setup_with(
        pins.iter().map(hex::encode).collect(),
        pins,
        measurements,
        database,
    )?;
    sim_crls(&setup.dir.join(COLLATERAL_DIR), nodes)?;
    Ok(setup)
}

/// The collateral store a setup's services read (in its folder): the simulated nodes' CRLs.
pub const COLLATERAL_DIR: &str = "collateral";

/// Each node's AMD CRL (revoking nothing, current for 30 days) and its GPUs' OCSP responses
/// (good) in the collateral store at `dir`, where a broker looks them up
/// (`cgx_attestation::trust::amd_crl_key`, `CollateralKey::NvidiaOcsp`): the broker requires
/// the store's current CRL for every chain and uses no CRL or OCSP response a node sends.
pub fn sim_crls(dir: &Path, nodes: &[&SimNode]) -> Result<()> {
    let t = now();
    for n in nodes {
        n.publish_collateral(dir, t)
            .map_err(|e| DevnetError::Simulator(e.to_string()))?;
    }
    Ok(())
}

/// A KBS configuration that trusts every simulator root (`sim_roots: ["*"]`) and accepts
/// `measurement`: for nodes made in another process (a guest agent run with `--sim`), whose
/// roots cannot be pinned ahead.
pub fn setup_any_sim(measurement: [u8; 48]) -> Result<Setup> {
    setup_with(
        vec!["*".into()],
        Vec::new(),
        vec![hex::encode(measurement)],
        None,
    )
}

fn setup_with(
    sim_roots: Vec<String>,
    pins: Vec<[u8; 32]>,
    measurements: Vec<String>,
    database: Option<String>,
) -> Result<Setup> {
    let dir = temp_dir("kbs")?;
    let write = |name: &str, bytes: &[u8]| write_private(&dir, name, bytes).map(drop);
    let mut kek = [0u8; 32];
    aws_lc_rs::rand::fill(&mut kek).map_err(|_| DevnetError::Keys)?;
    write("kek.hex", hex::encode(kek).as_bytes())?;
    let result_key = aws_lc_rs::signature::EcdsaKeyPair::generate_pkcs8(
        &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
        &aws_lc_rs::rand::SystemRandom::new(),
    )
    .map_err(|_| DevnetError::Keys)?;
    write("ear.pk8", result_key.as_ref())?;
    let refs = json!({
        "allow_sim": "affirming",
        "snp": {"measurements": measurements},
        "nvidia": sim_gpu_reference_values()
    });
    write("refs.json", refs.to_string().as_bytes())?;
    let database = database.unwrap_or_else(|| format!("sqlite://{}", dir.join("kbs.db").display()));
    let admin = Ed::generate()?;
    let tenant_admin = Ed::generate()?;
    let log_reader = Ed::generate()?;
    write_private(&dir, LOG_READER_KEY, &log_reader.pkcs8)?;
    let broker = Ed::generate()?;
    let log_key =
        aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .map_err(|_| DevnetError::Keys)?;
    write("kbs-log.pk8", log_key.as_ref())?;
    let config = KbsConfig {
        listen: "127.0.0.1:0".into(),
        tls: None,
        insecure_dev: true,
        database: database.clone(),
        kek: KekSource::File(dir.join("kek.hex")),
        // Every release and refusal a leaf of the KBS's own log, checkpointed four times a
        // second.
        log: Some(cgx_service::logwriter::LogConfig {
            origin: KBS_LOG_ORIGIN.into(),
            key: dir.join("kbs-log.pk8"),
            interval_ms: 250,
            state: None,
            witnesses: Vec::new(),
            quorum: 0,
            anchors: Vec::new(),
            export_dir: None,
        }),
        admin_keys: vec![
            AdminKey {
                public_key: admin.public_b64.clone(),
                repositories: vec!["*".into()],
            },
            AdminKey {
                public_key: tenant_admin.public_b64.clone(),
                repositories: vec!["tenant-a".into()],
            },
            AdminKey {
                public_key: log_reader.public_b64.clone(),
                repositories: vec![cgx_kbs::server::LOG_READER_SCOPE.into()],
            },
        ],
        broker_keys: vec![broker.public_b64.clone()],
        result_key: Some(dir.join("ear.pk8")),
        sim_roots,
        allow_sample: false,
        nonce_ttl_secs: 60,
        session_ttl_secs: 300,
        collateral: Default::default(),
        appraisal: AppraisalConfig {
            policy: None,
            reference_values: Some(dir.join("refs.json")),
        },
        tenant_isolation: true,
        version_file: Some(dir.join("kbs.versions")),
        accept_new_version_file: false,
        max_connections: 4096,
        max_in_flight: 1024,
        // Every client of a development network is 127.0.0.1: one address, so no per-client
        // share below the server's own caps (the tests and benchmarks run many clients).
        max_connections_per_client: 4096,
        max_in_flight_per_client: 1024,
        serving_threads: None,
        admin_token_max_ttl_secs: 3600,
        lease_max_ttl_secs: 86_400,
        sessions: None,
        max_live_sessions: 100_000,
    };
    Ok(Setup {
        dir,
        database,
        admin,
        tenant_admin,
        broker,
        pins,
        config,
    })
}

impl Setup {
    /// The KBS log's verifier key.
    pub fn log_vkey(&self) -> Result<String> {
        log_vkey(&self.dir.join("kbs-log.pk8"), KBS_LOG_ORIGIN)
    }

    /// Remove the setup's folder (its SQLite database, keys and reference values).
    pub fn cleanup(&self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A KBS running on its own runtime (two workers, named `thread_name` so a benchmark can tell
/// the server's CPU time from its clients'); shut down gracefully on [`Server::stop`] or drop.
pub struct Server {
    pub base: String,
    pub addr: std::net::SocketAddr,
    rt: tokio::runtime::Runtime,
    running: Option<Running>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl Server {
    pub fn start(config: &KbsConfig) -> Result<Server> {
        Self::start_with(config, "kbs-server", cgx_service::clock::system())
    }

    /// A KBS whose clock is `clock` (tests move a [`cgx_service::clock::ManualClock`] forward
    /// instead of sleeping).
    pub fn start_with_clock(config: &KbsConfig, clock: cgx_service::SharedClock) -> Result<Server> {
        Self::start_with(config, "kbs-server", clock)
    }

    pub fn start_named(config: &KbsConfig, thread_name: &str) -> Result<Server> {
        Self::start_with(config, thread_name, cgx_service::clock::system())
    }

    fn start_with(
        config: &KbsConfig,
        thread_name: &str,
        clock: cgx_service::SharedClock,
    ) -> Result<Server> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(thread_name)
            .enable_all()
            .build()
            .map_err(|e| DevnetError::Kbs(e.to_string()))?;
        let running = rt
            .block_on(start_with_clock(config, clock))
            .map_err(|e| DevnetError::Kbs(e.to_string()))?;
        Ok(Server {
            base: format!("http://{}", running.addr),
            addr: running.addr,
            rt,
            running: Some(running),
        })
    }

    /// Drain and stop.
    pub fn stop(mut self) {
        if let Some(r) = self.running.take() {
            self.rt.block_on(r.shutdown());
        }
    }

    /// Store `value` at `path` through the admin API. `lease_required`: a job resource, released
    /// with a lease only. Otherwise the resource's tenant names its requesters with a release
    /// policy on the resource: the shipped default (every part affirming), as a tenant that
    /// trusts any attested node of its own would write it — without one, tenant isolation
    /// releases it to nobody.
    pub fn put_resource(
        &self,
        admin: &Ed,
        path: &str,
        value: &[u8],
        lease_required: bool,
    ) -> Result<()> {
        let q = if lease_required {
            "?lease=required"
        } else {
            "?lease=optional"
        };
        self.admin_post(admin, &format!("/kbs/v0/resource/{path}{q}"), value)?;
        if !lease_required {
            self.put_resource_policy(admin, path, cgx_policies::RELEASE_POLICY)?;
        }
        Ok(())
    }

    /// Install `rego` as the release policy of `scope` (a repository, or `repo/type/tag`).
    pub fn put_resource_policy(&self, admin: &Ed, scope: &str, rego: &str) -> Result<()> {
        use base64::Engine;
        let body = serde_json::json!({
            "policy": base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(rego)
        });
        self.admin_post(
            admin,
            &format!("/kbs/v0/resource-policy/{scope}"),
            body.to_string().as_bytes(),
        )
    }

    /// Set the reference values appraisal uses (`POST /kbs/v0/reference-values`).
    pub fn put_reference_values(&self, admin: &Ed, doc: &[u8]) -> Result<()> {
        self.admin_post(admin, "/kbs/v0/reference-values", doc)
    }

    fn admin_post(&self, admin: &Ed, path: &str, body: &[u8]) -> Result<()> {
        let url = format!("{}{path}", self.base);
        let agent = cgx_kbs::client::agent(None).map_err(|e| DevnetError::Kbs(e.to_string()))?;
        let mut resp = agent
            .post(&url)
            .header("authorization", &format!("Bearer {}", admin.admin_token()?))
            .send(body)
            .map_err(|e| DevnetError::Kbs(format!("{url}: {e}")))?;
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(DevnetError::Http {
                url,
                status,
                body: resp.body_mut().read_to_string().unwrap_or_default(),
            });
        }
        Ok(())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            self.rt.block_on(r.shutdown());
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
    }

    /// What `cgx up` writes (the KBS's KEK and result key, the broker's signing and result
    /// keys): private folders with unguessable names, every file 0600, no temporary left.
    #[test]
    fn keys_are_private_and_written_atomically() {
        let kbs = setup_any_sim(MEASUREMENT).unwrap();
        let broker = broker::broker_setup(&kbs, vec!["*".into()], None).unwrap();
        for (dir, files) in [
            (&kbs.dir, &["kek.hex", "ear.pk8", "refs.json"][..]),
            (&broker.dir, &["signing.pk8", "ear.pk8"][..]),
        ] {
            assert_eq!(mode(dir), 0o700, "{}", dir.display());
            // The name carries 16 random hex digits: another user cannot prepare it.
            let name = dir.file_name().unwrap().to_string_lossy().into_owned();
            assert!(
                name.split('-')
                    .any(|p| p.len() == 16 && hex::decode(p).is_ok()),
                "{name}"
            );
            for f in files {
                assert_eq!(mode(&dir.join(f)), 0o600, "{f}");
            }
            let leftovers: Vec<_> = std::fs::read_dir(dir)
                .unwrap()
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
                .collect();
            assert!(leftovers.is_empty(), "{leftovers:?}");
        }
        // The broker's signing key is the KBS's broker key, byte for byte.
        assert_eq!(
            std::fs::read(broker.dir.join("signing.pk8")).unwrap(),
            kbs.broker.pkcs8
        );
        broker.cleanup();
        kbs.cleanup();
    }

    /// A file rewritten is replaced whole and stays 0600, even when what sat at its name was
    /// readable by others (or a link elsewhere: rename replaces the link, never its target).
    #[test]
    fn write_private_replaces_atomically() {
        let dir = temp_dir("write-private").unwrap();
        let target = dir.join("elsewhere");
        std::fs::write(&target, b"not yours").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::os::unix::fs::symlink(&target, dir.join("kek.hex")).unwrap();
        write_private(&dir, "kek.hex", b"secret").unwrap();
        assert_eq!(std::fs::read(dir.join("kek.hex")).unwrap(), b"secret");
        assert_eq!(mode(&dir.join("kek.hex")), 0o600);
        assert_eq!(std::fs::read(&target).unwrap(), b"not yours");
        std::fs::write(dir.join("plain"), b"x").unwrap();
        std::fs::set_permissions(dir.join("plain"), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        write_private(&dir, "plain", b"y").unwrap();
        assert_eq!(mode(&dir.join("plain")), 0o600);
        // A second temp_dir of the same name is another folder.
        let again = temp_dir("write-private").unwrap();
        assert_ne!(again, dir);
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&again).unwrap();
    }
}
