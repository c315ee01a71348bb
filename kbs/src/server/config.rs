//! KBS configuration (`cgx kbs serve --config F`): TOML (`kbs.toml`) or JSON (any other
//! name, as deployments already write it), then environment overrides `CGX_KBS__<KEY>[__<KEY>]`
//! (e.g. `CGX_KBS__LISTEN=0.0.0.0:8443`, `CGX_KBS__COLLATERAL__ONLINE=true`).
//!
//! ```json
//! { "listen": "0.0.0.0:8443",
//!   "tls": {"cert": "kbs.crt", "key": "kbs.key"},
//!   "database": "sqlite://kbs.db",
//!   "kek": {"file": "kek.hex"},
//!   "admin_keys": [{"public_key": "<base64 Ed25519>", "repositories": ["*"]}],
//!   "broker_keys": ["<base64 Ed25519>"],
//!   "result_key": "ear-signing.pk8",
//!   "sim_roots": [], "allow_sample": false,
//!   "nonce_ttl_secs": 60, "session_ttl_secs": 300, "tenant_isolation": true,
//!   "sessions": "memory", "max_live_sessions": 100000,
//!   "collateral": {"store": "collateral", "online": true},
//!   "appraisal": {"policy": null, "reference_values": null} }
//! ```
//! Every replica of one KBS shares `database`, `kek` and `result_key`.

use std::path::PathBuf;

use serde::Deserialize;

use super::error::KbsError;

/// Where the resource key-encryption key comes from. It is never stored in the database.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KekSource {
    /// A file holding 32 bytes as 64 hex digits (or raw).
    File(PathBuf),
    /// An environment variable holding 64 hex digits.
    Env(String),
}

/// TLS certificate chain and key (PEM).
pub type TlsConfig = cgx_service::tls::TlsFiles;

/// The longest challenge or session (a session's EAR is a bearer credential for this long).
pub const MAX_TTL_SECS: i64 = 86_400;

/// The environment prefix of configuration overrides.
pub(crate) const ENV_PREFIX: &str = "CGX_KBS";

/// An administrator's Ed25519 public key and the repositories (tenants) it may change; `*`
/// means all, including the global policies.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminKey {
    /// Raw 32-byte Ed25519 public key, base64 (standard or URL-safe), or a PEM SPKI file path.
    pub public_key: String,
    /// The repositories this key may change, `*` for all and the global settings. Required:
    /// a key that forgot its scope must not silently get every tenant's.
    pub repositories: Vec<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollateralConfig {
    /// Collateral store directory (see `cgx collateral`); none: only what evidence carries.
    pub store: Option<PathBuf>,
    /// Fetch missing collateral from the vendors (AMD KDS, Intel PCS, NVIDIA OCSP).
    #[serde(default)]
    pub online: bool,
    /// Vendor URLs (a PCCS, a mirror); default: the vendors' own.
    #[serde(default)]
    pub endpoints: Option<cgx_attestation::collateral::fetch::Endpoints>,
    /// Least spacing of AMD KDS requests (KDS rate-limits; default 10 000 ms).
    #[serde(default = "default_amd_interval")]
    pub amd_min_interval_ms: u64,
    /// Fetches one client may start: a burst of this many, then one per
    /// `fetch_refill_secs` (the collateral of evidence nobody has verified yet).
    #[serde(default = "default_fetch_burst")]
    pub fetch_burst: u32,
    #[serde(default = "default_fetch_refill")]
    pub fetch_refill_secs: u64,
    /// Fetches waiting at once, all clients together; past it, 503 with `Retry-After`.
    #[serde(default = "default_fetch_queue")]
    pub fetch_queue: usize,
    /// How long a key whose fetch failed is refused without asking the vendor again.
    #[serde(default = "default_negative_ttl")]
    pub negative_ttl_secs: u64,
}

impl Default for CollateralConfig {
    fn default() -> Self {
        CollateralConfig {
            store: None,
            online: false,
            endpoints: None,
            amd_min_interval_ms: default_amd_interval(),
            fetch_burst: default_fetch_burst(),
            fetch_refill_secs: default_fetch_refill(),
            fetch_queue: default_fetch_queue(),
            negative_ttl_secs: default_negative_ttl(),
        }
    }
}

fn default_amd_interval() -> u64 {
    10_000
}

fn default_fetch_burst() -> u32 {
    8
}

fn default_fetch_refill() -> u64 {
    30
}

fn default_fetch_queue() -> usize {
    64
}

fn default_negative_ttl() -> u64 {
    300
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppraisalConfig {
    /// Appraisal policy (Rego); default: the shipped `policies/appraisal.rego`.
    pub policy: Option<PathBuf>,
    /// Reference values (JSON); default: the shipped defaults.
    pub reference_values: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KbsConfig {
    pub listen: String,
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// Plain HTTP (only on a loopback address).
    #[serde(default)]
    pub insecure_dev: bool,
    pub database: String,
    pub kek: KekSource,
    /// The KBS's own transparency log over its audit trail (`[log]`; none where absent): every
    /// release and refusal a leaf, checkpointed under its own origin and key.
    #[serde(default)]
    pub log: Option<cgx_service::logwriter::LogConfig>,
    #[serde(default)]
    pub admin_keys: Vec<AdminKey>,
    /// Ed25519 keys of brokers whose lease tokens are honoured.
    #[serde(default)]
    pub broker_keys: Vec<String>,
    /// EAR signing key (PKCS#8 DER: Ed25519 signs EdDSA, P-256 signs ES256); a fresh Ed25519
    /// key per process when absent (then tokens
    /// from one replica do not verify on another).
    #[serde(default)]
    pub result_key: Option<PathBuf>,
    /// SPKI SHA-256 pins (hex) of simulator roots to trust, or `*` for any simulator root
    /// (development and tests only).
    #[serde(default)]
    pub sim_roots: Vec<String>,
    /// Accept CoCo's unsigned `sample` evidence into appraisal (the default policy still refuses
    /// it). Never enable in production.
    #[serde(default)]
    pub allow_sample: bool,
    #[serde(default = "default_nonce_ttl")]
    pub nonce_ttl_secs: i64,
    #[serde(default = "default_session_ttl")]
    pub session_ttl_secs: i64,
    #[serde(default)]
    pub collateral: CollateralConfig,
    #[serde(default)]
    pub appraisal: AppraisalConfig,
    /// Connections served at once (further ones wait in the accept backlog).
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Requests handled at once; past it, 503 with `Retry-After` (memory stays bounded).
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// Connections one client address (an IPv6 /64) may hold open; further ones are closed at
    /// once (default 64). Behind a load balancer that hides client addresses, set it to
    /// `max_connections`.
    #[serde(default = "default_max_connections_per_client")]
    pub max_connections_per_client: usize,
    /// Requests one client address (an IPv6 /64) may have in flight; past it, 429 with
    /// `Retry-After` (default 32). As `max_connections_per_client` behind a load balancer.
    #[serde(default = "default_max_in_flight_per_client")]
    pub max_in_flight_per_client: usize,
    /// Threads that serve connections, each with its own runtime and listening socket
    /// (thread-per-core, Linux; `cgx_service::server`); 0: the main runtime serves them.
    /// Default: one per CPU with a SQLite database, 0 with PostgreSQL (a connection a serving
    /// thread opened would be driven by that thread alone).
    #[serde(default)]
    pub serving_threads: Option<usize>,
    /// Longest admin token accepted (`exp − iat`, seconds; default an hour).
    #[serde(default = "default_admin_token_ttl")]
    pub admin_token_max_ttl_secs: i64,
    /// Longest lease accepted (`exp − iat`, seconds; default a day).
    #[serde(default = "default_lease_ttl")]
    pub lease_max_ttl_secs: i64,
    /// This replica's record of the resource versions it has read (outside the database; see
    /// `watermark.rs`). Default: beside a SQLite database; required with a shared one.
    #[serde(default)]
    pub version_file: Option<PathBuf>,
    /// Start with no `version_file` although the database holds resources: a new replica of
    /// an existing database (it knows no versions until it reads them). Keep the file on
    /// another volume than the database, so one restore does not roll back both.
    #[serde(default)]
    pub accept_new_version_file: bool,
    /// Tenants are isolated (the default): a resource is released only to a requester its
    /// tenant names — a lease for it, or a release policy on its repository or on the resource
    /// itself that allows the request. `false` is Trustee's model (the global policy alone
    /// releases every resource to any requester it allows) for single-tenant deployments.
    #[serde(default = "default_true")]
    pub tenant_isolation: bool,
    /// Where answered challenges and attested sessions live (`sessions.rs`): `memory` (the
    /// default with SQLite: this process answers only its own challenges, no write per
    /// attestation) or `database` (PostgreSQL's only mode, SQLite's opt-in: any replica on
    /// the database serves any step).
    #[serde(default)]
    pub sessions: Option<SessionMode>,
    /// The most attested sessions held at once (each holds its appraisal, a few KB), and apart
    /// from them the most failed answers. With `memory` sessions, past it, with none
    /// droppable, attestation is refused with 503 until some expire; with `database`
    /// sessions it bounds this replica's cache.
    #[serde(default = "default_max_live_sessions")]
    pub max_live_sessions: usize,
}

/// Where sessions live; see [`KbsConfig::sessions`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionMode {
    Memory,
    Database,
}

fn default_max_live_sessions() -> usize {
    100_000
}

fn default_true() -> bool {
    true
}

fn default_max_in_flight() -> usize {
    1024
}

fn default_max_connections_per_client() -> usize {
    cgx_service::server::DEFAULT_MAX_CONNECTIONS_PER_CLIENT
}

fn default_max_in_flight_per_client() -> usize {
    cgx_service::server::DEFAULT_MAX_IN_FLIGHT_PER_CLIENT
}

fn default_admin_token_ttl() -> i64 {
    cgx_service::auth::DEFAULT_ADMIN_TOKEN_TTL
}

fn default_lease_ttl() -> i64 {
    86_400
}

fn default_max_connections() -> usize {
    4096
}

fn default_nonce_ttl() -> i64 {
    60
}

fn default_session_ttl() -> i64 {
    300
}

impl cgx_service::config::ServiceConfig for KbsConfig {
    const ENV_PREFIX: &'static str = ENV_PREFIX;
    type Error = KbsError;

    fn check(&self) -> Result<(), KbsError> {
        KbsConfig::check(self)
    }

    fn set_insecure_dev(&mut self) {
        self.insecure_dev = true;
        self.tls = None;
    }

    fn listener(&self) -> cgx_service::ListenerConfig {
        KbsConfig::listener(self)
    }
}

impl KbsConfig {
    /// Read, let the caller override (command-line flags), then check
    /// ([`cgx_service::config::load_service`]).
    pub fn from_file_with(
        path: &std::path::Path,
        adjust: impl FnOnce(&mut KbsConfig),
    ) -> Result<Self, KbsError> {
        cgx_service::config::load_service(path, adjust)
    }

    /// The listener this configuration asks for.
    pub(crate) fn listener(&self) -> cgx_service::ListenerConfig {
        let mut l = cgx_service::ListenerConfig::new(
            self.listen.clone(),
            self.tls.clone(),
            self.insecure_dev,
        );
        l.max_connections = self.max_connections;
        l.max_in_flight = self.max_in_flight;
        l.max_connections_per_client = self.max_connections_per_client;
        l.max_in_flight_per_client = self.max_in_flight_per_client;
        l.serving_threads = self.serving_threads.unwrap_or_else(|| {
            if cgx_service::db::Backend::of(&self.database)
                == Some(cgx_service::db::Backend::Sqlite)
            {
                std::thread::available_parallelism().map_or(1, |n| n.get())
            } else {
                0
            }
        });
        l
    }

    /// Where sessions live: as configured, else in memory with SQLite and in the database
    /// with PostgreSQL.
    pub fn session_mode(&self) -> SessionMode {
        self.sessions
            .unwrap_or(match cgx_service::db::Backend::of(&self.database) {
                Some(cgx_service::db::Backend::Sqlite) => SessionMode::Memory,
                _ => SessionMode::Database,
            })
    }

    /// Refuse configurations that cannot be served safely.
    pub fn check(&self) -> Result<(), KbsError> {
        self.listener()
            .check()
            .map_err(|e| KbsError::Config(e.to_string().replace("configuration: ", "")))?;
        if !(1..=MAX_TTL_SECS).contains(&self.nonce_ttl_secs)
            || !(1..=MAX_TTL_SECS).contains(&self.session_ttl_secs)
        {
            return Err(KbsError::Config(format!(
                "nonce_ttl_secs and session_ttl_secs must be 1 to {MAX_TTL_SECS}"
            )));
        }
        if !(1..=MAX_TTL_SECS).contains(&self.admin_token_max_ttl_secs)
            || !(1..=MAX_TTL_SECS).contains(&self.lease_max_ttl_secs)
        {
            return Err(KbsError::Config(format!(
                "admin_token_max_ttl_secs and lease_max_ttl_secs must be 1 to {MAX_TTL_SECS}"
            )));
        }
        // PostgreSQL is for replicas, and replicas serve one another's sessions.
        if self.session_mode() == SessionMode::Memory
            && cgx_service::db::Backend::of(&self.database)
                != Some(cgx_service::db::Backend::Sqlite)
        {
            return Err(KbsError::Config(
                "sessions = \"memory\" is for a SQLite database; replicas on a shared \
                 database share their sessions (sessions = \"database\")"
                    .into(),
            ));
        }
        if !(1..=50_000_000).contains(&self.max_live_sessions) {
            return Err(KbsError::Config(
                "max_live_sessions must be 1 to 50000000".into(),
            ));
        }
        if self.session_ttl_secs < self.nonce_ttl_secs {
            return Err(KbsError::Config(
                "session_ttl_secs must not be shorter than nonce_ttl_secs".into(),
            ));
        }
        if self.admin_keys.iter().any(|k| k.repositories.is_empty()) {
            return Err(KbsError::Config(
                "an admin key names no repositories (use [\"*\"] for all)".into(),
            ));
        }
        // Simulator roots and unsigned sample evidence are for development on this machine.
        let loopback = self
            .listen
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|a| a.ip().is_loopback());
        if (self.allow_sample || !self.sim_roots.is_empty()) && !loopback {
            return Err(KbsError::Config(
                "allow_sample and sim_roots are for development: listen on loopback".into(),
            ));
        }
        // Sessions are EARs signed by the result key and re-verified wherever they are read:
        // replicas sharing a database must share that key, or each refuses the others' sessions.
        if self.result_key.is_none() && !self.database.starts_with("sqlite:") {
            return Err(KbsError::Config(
                "a shared database needs a shared result_key (replicas verify each other's sessions)"
                    .into(),
            ));
        }
        let c = &self.collateral;
        if !(1..=65_536).contains(&c.fetch_queue)
            || !(1..=10_000).contains(&c.fetch_burst)
            || !(1..=MAX_TTL_SECS as u64).contains(&c.fetch_refill_secs)
            || c.negative_ttl_secs > MAX_TTL_SECS as u64
            || c.amd_min_interval_ms > 3_600_000
        {
            return Err(KbsError::Config(
                "collateral: fetch_queue 1..=65536, fetch_burst 1..=10000, fetch_refill_secs and \
                 negative_ttl_secs at most a day, amd_min_interval_ms at most an hour"
                    .into(),
            ));
        }
        // A restored backup of a shared database is the rollback the marks are for.
        if self.version_file().is_none() {
            return Err(KbsError::Config(
                "a shared database needs a version_file (each replica's own, outside the \
                 database: resource versions it has read, so a restored backup is refused)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Where resource version marks are kept: `version_file`, or beside a SQLite database.
    pub(crate) fn version_file(&self) -> Option<PathBuf> {
        self.version_file.clone().or_else(|| {
            let path = self
                .database
                .strip_prefix("sqlite://")
                .or_else(|| self.database.strip_prefix("sqlite:"))?;
            let path = path
                .split('?')
                .next()
                .filter(|p| !p.is_empty() && *p != ":memory:")?;
            Some(PathBuf::from(format!("{path}.versions")))
        })
    }

    /// The key-encryption key.
    pub(crate) fn load_kek(&self) -> Result<[u8; 32], KbsError> {
        let bad = |w: &str| KbsError::Config(format!("kek: {w} (32 bytes as 64 hex digits)"));
        let text: Vec<u8> = match &self.kek {
            KekSource::File(p) => std::fs::read(p).map_err(|e| bad(&e.to_string()))?,
            KekSource::Env(v) => std::env::var(v)
                .map_err(|_| bad(&format!("${v} is not set")))?
                .into_bytes(),
        };
        if text.len() == 32 {
            let mut k = [0u8; 32];
            k.copy_from_slice(&text);
            return Ok(k);
        }
        let hexed = String::from_utf8_lossy(&text).trim().to_string();
        let v = hex::decode(&hexed).map_err(|_| bad("not hex"))?;
        v.try_into().map_err(|_| bad("wrong length"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn config(database: &str, sessions: Option<&str>) -> Result<KbsConfig, KbsError> {
        let mut v = serde_json::json!({
            "listen": "127.0.0.1:0", "insecure_dev": true, "database": database,
            "kek": {"env": "UNUSED"}, "result_key": "ear.pk8", "version_file": "v",
        });
        if let Some(s) = sessions {
            v["sessions"] = s.into();
        }
        let c: KbsConfig =
            serde_json::from_value(v).map_err(|e| KbsError::Config(e.to_string()))?;
        c.check()?;
        Ok(c)
    }

    #[test]
    fn sessions_live_in_memory_on_sqlite_and_in_the_database_on_postgresql() {
        let sqlite = config("sqlite://kbs.db", None).unwrap();
        assert_eq!(sqlite.session_mode(), SessionMode::Memory);
        let shared = config("sqlite://kbs.db", Some("database")).unwrap();
        assert_eq!(shared.session_mode(), SessionMode::Database);
        let pg = config("postgres://kbs@db/kbs", None).unwrap();
        assert_eq!(pg.session_mode(), SessionMode::Database);
        let e = config("postgres://kbs@db/kbs", Some("memory")).unwrap_err();
        assert!(e.to_string().contains("share their sessions"), "{e}");
        assert!(config("sqlite://kbs.db", Some("disk")).is_err());
    }

    /// Issue 28: per-client caps default well below the server's, reach the listener as
    /// configured, and cannot be 0.
    #[test]
    fn per_client_caps_default_below_the_servers_and_reach_the_listener() {
        let c = config("sqlite://kbs.db", None).unwrap();
        let l = c.listener();
        assert_eq!(
            (l.max_connections, l.max_connections_per_client),
            (4096, 64)
        );
        assert_eq!((l.max_in_flight, l.max_in_flight_per_client), (1024, 32));
        let mut c = c;
        c.max_connections_per_client = 4096;
        c.max_in_flight_per_client = 1024;
        assert_eq!(c.listener().max_in_flight_per_client, 1024);
        c.max_in_flight_per_client = 0;
        let e = c.check().unwrap_err();
        assert!(e.to_string().contains("per_client"), "{e}");
    }
}
