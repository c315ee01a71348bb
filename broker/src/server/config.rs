//! Broker configuration (`cgx broker serve --config F`): TOML (`.toml`) or JSON, then
//! environment overrides `CGX_BROKER__<KEY>[__<KEY>]`.
//!
//! ```toml
//! listen = "0.0.0.0:8444"
//! tls = { cert = "broker.crt", key = "broker.key" }
//! database = "sqlite://broker.db"          # postgres://… for several replicas
//! signing_key = "broker-ed25519.pk8"       # signs leases and node records; the KBS's broker_keys
//! result_key = "ear-signing.pk8"           # EAR signing key (Ed25519 or P-256), shared by replicas
//! sim_roots = []                           # development only
//! reattest_secs = 600
//! heartbeat_secs = 5
//! missed_heartbeats = 3
//! lease_ttl_secs = 120
//! metering_window_secs = 60
//! api_keys = [{ public_key = "<base64 Ed25519>", scopes = ["tenant:acme"] },
//!             { public_key = "<base64 Ed25519>", scopes = ["operator:op1"] },
//!             { public_key = "<base64 Ed25519>", scopes = ["auditor"] }]
//! [collateral]
//! store = "collateral"
//! [appraisal]
//! reference_values = "reference-values.json"
//! [pow]                                    # proof-of-work schedule (cgx_pow::class)
//! interval_secs = 600
//! misses_allowed = 2
//! allowance_ms = 5000
//! penalty_secs = 86400
//! # fixed = { n = 256, k = 66, expected_ms = 2000 }   # simulated nodes (CPU)
//! [ledger]                                 # settlement (cgx_ledger)
//! fee_bps = 1000                           # the platform's fee: 10% of each paid window
//! slash_per_gpu_micros = 100000000         # what a proven cheat forfeits per GPU of its lease
//! settle_grace_secs = 660                  # how long an ended lease's last records may come
//! escrow_expiry_secs = 86400               # a reservation expires this long after its job's end
//! [reputation]                             # from uptime, proofs, failovers, cheats
//! half_life_secs = 604800                  # every count halves in a week
//! interval_secs = 600                      # uptime credited every ten minutes
//! ```
//! Every replica of one broker shares `database`, `signing_key` and `result_key`.

use std::path::PathBuf;

use serde::Deserialize;

use super::error::BrokerError;

/// The environment prefix of configuration overrides.
pub(crate) const ENV_PREFIX: &str = "CGX_BROKER";

/// A caller's Ed25519 public key and what it may do: `tenant:<name>` (submit and see that
/// tenant's jobs), `operator:<name>` (register that operator's nodes, see them), `auditor`
/// (read every node and job), `*` (everything).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKey {
    /// Raw 32-byte Ed25519 public key, base64 (standard or URL-safe), or a PEM SPKI file path.
    pub public_key: String,
    pub scopes: Vec<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollateralConfig {
    /// Collateral store directory (`cgx collateral`); none: only what evidence carries.
    pub store: Option<PathBuf>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppraisalConfig {
    /// Appraisal policy (Rego); default: the shipped one.
    pub policy: Option<PathBuf>,
    /// Reference values (JSON); default: the shipped defaults.
    pub reference_values: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerConfig {
    pub listen: String,
    #[serde(default)]
    pub tls: Option<cgx_service::tls::TlsFiles>,
    /// Plain HTTP (only on a loopback address).
    #[serde(default)]
    pub insecure_dev: bool,
    pub database: String,
    /// Ed25519 PKCS#8 (DER) that signs lease tokens and node records; its public key is in the
    /// KBS's `broker_keys`.
    pub signing_key: PathBuf,
    /// EAR signing key (PKCS#8 DER: Ed25519 signs EdDSA, P-256 signs ES256); a fresh Ed25519
    /// key per process when absent (single
    /// replica on SQLite only).
    #[serde(default)]
    pub result_key: Option<PathBuf>,
    #[serde(default)]
    pub api_keys: Vec<ApiKey>,
    /// SPKI SHA-256 pins (hex) of simulator roots to trust, or `*` (development only).
    #[serde(default)]
    pub sim_roots: Vec<String>,
    #[serde(default)]
    pub collateral: CollateralConfig,
    #[serde(default)]
    pub appraisal: AppraisalConfig,
    /// A node's result counts this long (default 10 min); it re-attests before.
    #[serde(default = "default_reattest")]
    pub reattest_secs: i64,
    /// Nodes heartbeat this often (default 5 s).
    #[serde(default = "default_heartbeat")]
    pub heartbeat_secs: i64,
    /// Heartbeats a node may miss before its leases end (default 3).
    #[serde(default = "default_missed")]
    pub missed_heartbeats: i64,
    /// Lifetime of a lease token (renewed through heartbeats while the node stays fresh).
    #[serde(default = "default_lease_ttl")]
    pub lease_ttl_secs: i64,
    /// Lifetime of a registration nonce.
    #[serde(default = "default_nonce_ttl")]
    pub nonce_ttl_secs: i64,
    /// How often the monitor checks freshness, heartbeats, completed jobs and pending jobs,
    /// milliseconds (default 500).
    #[serde(default = "default_monitor_ms")]
    pub monitor_interval_ms: u64,
    /// Pending jobs one tenant may have at once (more are refused, 429). At most a quarter
    /// of `placement_batch`: a pass reads tenants' jobs in turns (each tenant's oldest, then
    /// each one's second, …), so one tenant's unplaceable jobs cannot hide another's.
    #[serde(default = "default_max_pending")]
    pub max_pending_per_tenant: i64,
    /// Pending jobs one placement pass reads at most (default 1000).
    #[serde(default = "default_placement_batch")]
    pub placement_batch: i64,
    /// A job pending this long expires (state `expired`, with the reason; default 1 day).
    #[serde(default = "default_pending_ttl")]
    pub pending_ttl_secs: i64,
    /// Longest API token accepted (`exp − iat`, seconds).
    #[serde(default = "default_token_ttl")]
    pub api_token_max_ttl_secs: i64,
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
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
    /// The metering window of new leases (seconds, default 60), signed into each lease.
    #[serde(default = "default_window")]
    pub metering_window_secs: u32,
    /// The proof-of-work schedule (`[pow]`).
    #[serde(default)]
    pub pow: PowConfig,
    /// Settlement (`[ledger]`).
    #[serde(default)]
    pub ledger: LedgerConfig,
    /// Reputation (`[reputation]`).
    #[serde(default)]
    pub reputation: ReputationConfig,
    /// The transparency log over the audit trail (`[log]`; none where absent).
    #[serde(default)]
    pub log: Option<LogConfig>,
}

/// `[log]`: the transparency log every audited decision becomes a leaf of (issue 33).
pub use cgx_service::logwriter::{LogConfig, WitnessRef};

/// `[reputation]`: how fast old events fade, how often uptime is credited.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ReputationConfig {
    /// Every count halves in this long (seconds; default 7 days).
    #[serde(default = "default_half_life")]
    pub half_life_secs: i64,
    /// Uptime is credited this often (seconds; default 600).
    #[serde(default = "default_uptime_interval")]
    pub interval_secs: u64,
}

impl Default for ReputationConfig {
    fn default() -> Self {
        ReputationConfig {
            half_life_secs: default_half_life(),
            interval_secs: default_uptime_interval(),
        }
    }
}

fn default_half_life() -> i64 {
    7 * 86_400
}
fn default_uptime_interval() -> u64 {
    600
}

/// `[ledger]`: the fee, the slash, and how long settlement waits.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LedgerConfig {
    /// The platform's fee on each paid window, in basis points (default 1000: 10%; the
    /// networks we compete with charge 10–15%). At most 5000.
    #[serde(default = "default_fee_bps")]
    pub fee_bps: u32,
    /// What a proven cheat forfeits, per GPU of the lease it cheated on, from the operator's
    /// stake to the tenant (micros; default 100 currency units).
    #[serde(default = "default_slash_per_gpu")]
    pub slash_per_gpu_micros: u64,
    /// How long after a lease's end its last windows' records may still come and be settled,
    /// before what its escrow holds goes back to the tenant (seconds; default: a record's
    /// lifetime and a window, 660).
    #[serde(default = "default_settle_grace")]
    pub settle_grace_secs: i64,
    /// A reservation expires this long after its job's end whatever happens (a broker that
    /// lost track of a lease cannot hold a tenant's money for ever; seconds, default 1 day).
    #[serde(default = "default_escrow_expiry")]
    pub escrow_expiry_secs: i64,
    /// The settlement pass's period (ms, default 1000).
    #[serde(default = "default_settle_interval")]
    pub settle_interval_ms: u64,
}

impl Default for LedgerConfig {
    fn default() -> Self {
        LedgerConfig {
            fee_bps: default_fee_bps(),
            slash_per_gpu_micros: default_slash_per_gpu(),
            settle_grace_secs: default_settle_grace(),
            escrow_expiry_secs: default_escrow_expiry(),
            settle_interval_ms: default_settle_interval(),
        }
    }
}

fn default_fee_bps() -> u32 {
    1000
}
fn default_slash_per_gpu() -> u64 {
    100 * cgx_protocol::money::Micros::PER_UNIT
}
fn default_settle_grace() -> i64 {
    cgx_protocol::metering::METERING_TTL_SECS + i64::from(cgx_protocol::metering::WINDOW_SECS)
}
fn default_escrow_expiry() -> i64 {
    86_400
}
fn default_settle_interval() -> u64 {
    1000
}

/// `[pow]`: how often leased GPUs are challenged and how answers are judged.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PowConfig {
    /// One challenge per leased GPU this often (seconds; default 600; 0: none).
    #[serde(default = "default_pow_interval")]
    pub interval_secs: i64,
    /// Misses (a deadline passed, or a GPU slower than its class) a node may have in a row
    /// before it is marked unplaceable (default 2: the third in a row marks it). A wrong proof
    /// marks it at once.
    #[serde(default = "default_misses_allowed")]
    pub misses_allowed: u32,
    /// What the wall-clock deadline allows beyond the GPU's (ms; default 5000).
    #[serde(default = "default_allowance")]
    pub allowance_ms: u64,
    /// How long a failed or missed proof keeps the node unplaceable (seconds; default 1 day).
    #[serde(default = "default_penalty")]
    pub penalty_secs: i64,
    /// One challenge for every GPU model instead of the classes' (`cgx_pow::class`): the
    /// simulated nodes of development and tests, which prove on a CPU.
    #[serde(default)]
    pub fixed: Option<PowFixed>,
}

/// A fixed challenge size and its expected time.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PowFixed {
    pub n: u32,
    pub k: u32,
    pub expected_ms: u64,
}

impl Default for PowConfig {
    fn default() -> Self {
        PowConfig {
            interval_secs: default_pow_interval(),
            misses_allowed: default_misses_allowed(),
            allowance_ms: default_allowance(),
            penalty_secs: default_penalty(),
            fixed: None,
        }
    }
}

fn default_window() -> u32 {
    cgx_protocol::metering::WINDOW_SECS
}
fn default_pow_interval() -> i64 {
    600
}
fn default_misses_allowed() -> u32 {
    2
}
fn default_allowance() -> u64 {
    cgx_pow::class::ALLOWANCE_MS
}
fn default_penalty() -> i64 {
    86_400
}

fn default_placement_batch() -> i64 {
    1000
}
fn default_pending_ttl() -> i64 {
    86_400
}
fn default_reattest() -> i64 {
    600
}
fn default_heartbeat() -> i64 {
    5
}
fn default_missed() -> i64 {
    3
}
fn default_lease_ttl() -> i64 {
    120
}
fn default_nonce_ttl() -> i64 {
    60
}
fn default_monitor_ms() -> u64 {
    500
}
fn default_max_pending() -> i64 {
    100
}
fn default_token_ttl() -> i64 {
    cgx_service::auth::DEFAULT_ADMIN_TOKEN_TTL
}
fn default_max_connections() -> usize {
    4096
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

impl cgx_service::config::ServiceConfig for BrokerConfig {
    const ENV_PREFIX: &'static str = ENV_PREFIX;
    type Error = BrokerError;

    fn check(&self) -> Result<(), BrokerError> {
        BrokerConfig::check(self)
    }

    fn set_insecure_dev(&mut self) {
        self.insecure_dev = true;
        self.tls = None;
    }

    fn listener(&self) -> cgx_service::ListenerConfig {
        BrokerConfig::listener(self)
    }
}

impl BrokerConfig {
    /// Read, let the caller override (command-line flags), then check
    /// ([`cgx_service::config::load_service`]).
    pub fn from_file_with(
        path: &std::path::Path,
        adjust: impl FnOnce(&mut BrokerConfig),
    ) -> Result<Self, BrokerError> {
        cgx_service::config::load_service(path, adjust)
    }

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
        l
    }

    /// Refuse configurations that cannot be served safely.
    pub fn check(&self) -> Result<(), BrokerError> {
        let bad = |m: &str| Err(BrokerError::Config(m.into()));
        self.listener()
            .check()
            .map_err(|e| BrokerError::Config(e.to_string().replace("configuration: ", "")))?;
        if !(60..=86_400).contains(&self.reattest_secs) {
            return bad("reattest_secs must be 60 to 86400");
        }
        if !(1..=300).contains(&self.heartbeat_secs) || !(1..=100).contains(&self.missed_heartbeats)
        {
            return bad("heartbeat_secs must be 1 to 300 and missed_heartbeats 1 to 100");
        }
        if !(10..=86_400).contains(&self.lease_ttl_secs)
            || !(1..=3600).contains(&self.nonce_ttl_secs)
            || !(1..=86_400).contains(&self.api_token_max_ttl_secs)
        {
            return bad(
                "lease_ttl_secs 10 to 86400, nonce_ttl_secs 1 to 3600, api_token_max_ttl_secs 1 to 86400",
            );
        }
        // A lease must outlive the gaps between the heartbeats that renew it.
        if self.lease_ttl_secs <= self.heartbeat_secs * self.missed_heartbeats {
            return bad("lease_ttl_secs must exceed heartbeat_secs × missed_heartbeats");
        }
        if !(4..=100_000).contains(&self.placement_batch) {
            return bad("placement_batch must be 4 to 100000");
        }
        if !(1..=self.placement_batch / 4).contains(&self.max_pending_per_tenant) {
            return bad("max_pending_per_tenant must be 1 to a quarter of placement_batch");
        }
        if !(60..=30 * 86_400).contains(&self.pending_ttl_secs) {
            return bad("pending_ttl_secs must be 60 to 2592000 (30 days)");
        }
        if !(50..=60_000).contains(&self.monitor_interval_ms) {
            return bad("monitor_interval_ms must be 50 to 60000");
        }
        if !(1..=3600).contains(&self.metering_window_secs) {
            return bad("metering_window_secs must be 1 to 3600");
        }
        let p = &self.pow;
        if !(0..=86_400).contains(&p.interval_secs)
            || p.misses_allowed > 100
            || p.allowance_ms > 600_000
            || !(0..=30 * 86_400).contains(&p.penalty_secs)
        {
            return bad(
                "[pow]: interval_secs 0 to 86400, misses_allowed at most 100, allowance_ms at most 600000, penalty_secs 0 to 2592000",
            );
        }
        if let Some(f) = p.fixed {
            let params = cgx_pow::Params { n: f.n, k: f.k };
            if let Err(e) = params.check() {
                return Err(BrokerError::Config(format!("[pow.fixed]: {e}")));
            }
            if !(1..=600_000).contains(&f.expected_ms) {
                return bad("[pow.fixed]: expected_ms 1 to 600000");
            }
        }
        let l = &self.ledger;
        if l.fee_bps > 5000
            || l.slash_per_gpu_micros > cgx_protocol::money::Micros::MAX.get()
            || !(0..=30 * 86_400).contains(&l.settle_grace_secs)
            || !(60..=365 * 86_400).contains(&l.escrow_expiry_secs)
            || !(50..=60_000).contains(&l.settle_interval_ms)
        {
            return bad(
                "[ledger]: fee_bps at most 5000, slash_per_gpu_micros at most 10^15, settle_grace_secs 0 to 2592000, escrow_expiry_secs 60 to 31536000, settle_interval_ms 50 to 60000",
            );
        }
        let r = &self.reputation;
        if !(3600..=365 * 86_400).contains(&r.half_life_secs)
            || !(1..=86_400).contains(&r.interval_secs)
        {
            return bad("[reputation]: half_life_secs 3600 to 31536000, interval_secs 1 to 86400");
        }
        if self.api_keys.iter().any(|k| k.scopes.is_empty()) {
            return bad("an API key names no scopes");
        }
        for scope in self.api_keys.iter().flat_map(|k| &k.scopes) {
            check_scope(scope)?;
        }
        let loopback = self
            .listen
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|a| a.ip().is_loopback());
        if !self.sim_roots.is_empty() && !loopback {
            return bad("sim_roots are for development: listen on loopback");
        }
        if self.result_key.is_none() && !self.database.starts_with("sqlite:") {
            return bad(
                "a shared database needs a shared result_key (replicas verify each other's EARs)",
            );
        }
        Ok(())
    }
}

/// The scope of a payment adapter or an admin that moves money in (deposits, stakes).
pub const LEDGER_SCOPE: &str = "ledger";

/// One API key scope: `*`, `auditor`, `reference-values`, or `tenant:` / `operator:` and a
/// name. An unknown scope (a typo) or an empty name (`tenant:` alone would act for the tenant
/// `""`) is refused at start, not read as granting nothing or something odd.
fn check_scope(scope: &str) -> Result<(), BrokerError> {
    let named = ["tenant:", "operator:"]
        .iter()
        .find_map(|p| scope.strip_prefix(p).map(|name| (p, name)));
    match named {
        Some((p, name)) => super::register::check_name(name, p.trim_end_matches(':'))
            .map_err(|e| BrokerError::Config(format!("API key scope {scope:?}: {e}"))),
        None if [
            "*",
            "auditor",
            super::settings::REFERENCE_VALUES,
            LEDGER_SCOPE,
        ]
        .contains(&scope) =>
        {
            Ok(())
        }
        None => Err(BrokerError::Config(format!(
            "unknown API key scope {:?} (*, auditor, reference-values, ledger, tenant:<name>, operator:<name>)",
            scope.chars().take(80).collect::<String>()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::check_scope;

    #[test]
    fn scopes_are_known_kinds_with_names() {
        for ok in [
            "*",
            "auditor",
            "reference-values",
            "tenant:acme",
            "operator:op-1.eu",
        ] {
            assert!(check_scope(ok).is_ok(), "{ok}");
        }
        for (bad, why) in [
            ("tenant:", "tenant must be 1 to 64"),
            ("operator:", "operator must be 1 to 64"),
            ("tenant:a/b", "tenant must be"),
            ("tenant:-x", "starting with a letter or digit"),
            ("tenent:acme", "unknown API key scope"),
            ("Auditor", "unknown API key scope"),
            ("", "unknown API key scope"),
        ] {
            let e = check_scope(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }
}
