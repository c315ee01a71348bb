//! `cgx`: the one command for enterprises, providers and auditors.
//!
//! This binary only parses arguments, reads and writes files, and prints; verification lives in
//! `cgx-attestation`.

mod appraise;
mod audit;
mod bench;
mod broker;
mod collateral;
mod console;
mod kbs;
mod ledger;
mod measure;
mod output;
mod policy;
mod rim;
mod sim;
mod up;
mod verify;
mod weights;

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(
    name = "cgx",
    version,
    about = "Confidential GPU eXchange: attestation, keys, placement, audit"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Make simulated SNP and GPU evidence and verify it end to end (embedded defaults).
    Up {
        /// After the run, keep the network serving (the console's URL and sign-in commands
        /// are printed) until Ctrl-C.
        #[arg(long)]
        keep: bool,
    },
    /// Verify an evidence bundle (a folder: report.bin + vcek.der + ask_ark.pem, quote.bin +
    /// collateral.json, or attestation_report.hex + cert_chain.pem).
    Verify {
        #[command(flatten)]
        evidence: EvidenceArgs,
        /// Take collateral the bundle lacks from this store (offline: prepare it with
        /// `cgx collateral fetch|import`).
        #[arg(long)]
        collateral: Option<PathBuf>,
        /// Expected requester nonce of NVIDIA evidence (32 bytes hex); refused when it differs.
        #[arg(long)]
        nonce: Option<String>,
        /// NVIDIA RIM files to compare a GPU report's measurements against (exit 1 on a mismatch).
        #[arg(long = "rim")]
        rims: Vec<PathBuf>,
        /// Accept RIMs whose signing certificates have expired.
        #[arg(long)]
        rim_ignore_signer_expiry: bool,
    },
    /// Verify a bundle, appraise it with a policy and print the signed result (EAR), issued now.
    /// Exit 0 affirming, 3 warning, 4 contraindicated, 1 refused by the verifier, 2 usage.
    Appraise {
        #[command(flatten)]
        evidence: EvidenceArgs,
        /// Rego appraisal policy (default: the shipped policies/appraisal.rego).
        #[arg(long)]
        policy: Option<PathBuf>,
        /// Reference values JSON (default: the shipped policies/reference-values/default.json).
        #[arg(long)]
        reference_values: Option<PathBuf>,
        /// Result signing key, PKCS#8 DER: Ed25519 (EdDSA) or P-256 (ES256); a fresh Ed25519 key
        /// when absent.
        #[arg(long)]
        signing_key: Option<PathBuf>,
        /// Nonce to echo in the result (hex).
        #[arg(long)]
        nonce: Option<String>,
    },
    /// Vendor collateral cache: fetch for a bundle, import, export (air-gapped use), list.
    Collateral {
        #[command(subcommand)]
        command: CollateralCommand,
        #[command(flatten)]
        source: SourceArgs,
    },
    /// Appraisal policies.
    Policy {
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// Write simulated evidence bundles.
    Sim {
        #[command(subcommand)]
        kind: SimKind,
    },
    /// NVIDIA reference integrity manifests.
    Rim {
        #[command(subcommand)]
        command: RimCommand,
    },
    /// Benchmarks: `verify`, `appraise`, `kbs`, `broker`, `coco`, `measure` (run by the `cgx-bench`
    /// program beside this one, which alone links the peers they are compared with).
    #[command(disable_help_flag = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The broker: registry, placement, leases (`serve`).
    Broker {
        #[command(subcommand)]
        command: BrokerCommand,
    },
    /// Tenants' jobs on the broker: submit, status, cancel, ls.
    Job {
        #[command(subcommand)]
        command: JobCommand,
        #[command(flatten)]
        conn: broker::Conn,
    },
    /// A tenant's or an operator's statement: every transfer with its cause, every lease with
    /// its windows paid and refunded, reconciled against the ledger.
    Statement {
        #[arg(long, conflicts_with = "operator")]
        tenant: Option<String>,
        #[arg(long)]
        operator: Option<String>,
        /// From (Unix seconds, inclusive).
        #[arg(long)]
        from: Option<i64>,
        /// To (Unix seconds, exclusive).
        #[arg(long)]
        to: Option<i64>,
        /// Print every transfer line too.
        #[arg(long)]
        lines: bool,
        #[command(flatten)]
        conn: broker::Conn,
    },
    /// A C2SP tlog-witness: cosigns the checkpoints of the logs it knows while they only grow.
    Witness {
        #[command(subcommand)]
        command: WitnessCommand,
    },
    /// The broker's web console: sign in with an API key.
    Console {
        #[command(subcommand)]
        command: ConsoleCommand,
    },
    /// The broker's transparency log, for auditors: fetch it, verify it offline.
    Audit {
        #[command(subcommand)]
        command: AuditCommand,
    },
    /// The broker's ledger: deposits (a `ledger` key), every account (auditors).
    Ledger {
        #[command(subcommand)]
        command: LedgerCommand,
        #[command(flatten)]
        conn: broker::Conn,
    },
    /// Nodes registered with the broker: ls, show (claims, result, freshness, why a node is or
    /// is not placeable).
    Node {
        #[command(subcommand)]
        command: NodeCommand,
        #[command(flatten)]
        conn: broker::Conn,
    },
    /// The key broker service.
    Kbs {
        #[command(subcommand)]
        command: KbsCommand,
    },
    /// Model weights: identities in the KBS, age encryption.
    Weights {
        #[command(subcommand)]
        command: WeightsCommand,
    },
    /// Launch measurements computed from an image (reference values from the image, not from
    /// evidence).
    Measure {
        #[command(subcommand)]
        command: MeasureCommand,
    },
    /// The guest image a provider boots: a kernel and a reproducible initrd holding the static
    /// guest agent and its measured settings.
    Image {
        #[command(subcommand)]
        command: ImageCommand,
    },
}

#[derive(Subcommand, Debug)]
enum ImageCommand {
    /// Build vmlinuz, initrd.img, cmdline and image.json into --out; the same inputs give the
    /// same bytes. The agent's arguments follow `--` (they are measured: put the broker, the
    /// KBS, the broker's key and `--channel cgx.0` there). `image/build.sh` fetches Debian's
    /// kernel and builds the static agent first.
    Build {
        /// The kernel (bzImage), e.g. Debian's linux-image-cloud-amd64's /boot/vmlinuz-*.
        #[arg(long)]
        kernel: PathBuf,
        /// The same package's lib/modules/<version> (the virtio-serial driver is a module).
        #[arg(long)]
        modules: Option<PathBuf>,
        /// The guest agent, statically linked.
        #[arg(long)]
        agent: PathBuf,
        /// The CA the broker's and the KBS's certificates chain to: /etc/cgx/ca.pem in the image.
        #[arg(long)]
        ca: Option<PathBuf>,
        /// The kernel command line (default: console=ttyS0 panic=-1 quiet).
        #[arg(long, default_value = "")]
        append: String,
        #[arg(long)]
        out: PathBuf,
        /// The agent's arguments (after `--`).
        #[arg(last = true, required = true)]
        args: Vec<String>,
    },
}

#[derive(Subcommand, Debug)]
enum MeasureCommand {
    /// The SEV-SNP launch digest of an OVMF image (and a directly booted kernel), as
    /// `sev-snp-measure --mode snp` computes it.
    Snp(Box<measure::SnpArgs>),
    /// A TD's MRTD (from the TDVF image) and the RTMR events its image determines (kernel,
    /// command line, initrd, configuration volume); with --replay, a TD's event log replayed and
    /// held to the image; with --quote, a quote compared with both. Exit 0, or 1 naming what
    /// differs. With --replay, the reference values take RTMR[0]–[2] from the log (RTMR[0] only
    /// without --kernel), and only when the log holds every event of the image, RTMR[1]/[2]
    /// nothing else, and it matches --quote.
    Tdx(Box<measure::tdx::TdxArgs>),
    /// The launch a host agent's configuration describes (its `[qemu.launch]` table), measured
    /// as `cgx measure snp` or `tdx` would measure the same flags: the reference values of
    /// exactly the VM `cgx-host-agent run` boots.
    Launch {
        /// The host agent's configuration (TOML).
        config: PathBuf,
        #[command(flatten)]
        refs: measure::RefsArgs,
        #[arg(long)]
        json: bool,
    },
    /// Does an SEV-SNP report's measurement match this launch? Exit 0, or 1 with both digests
    /// and the likely cause (the neighbouring launch parameters that would match).
    Check {
        /// An evidence bundle (folder) or a raw report file.
        report: PathBuf,
        #[command(flatten)]
        launch: Box<measure::LaunchArgs>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum SimKind {
    /// An SEV-SNP report signed by a generated ARK/ASK/VCEK chain.
    Snp {
        #[arg(long)]
        out: PathBuf,
        /// REPORT_DATA, up to 64 bytes of hex (zero-padded).
        #[arg(long)]
        report_data: Option<String>,
        /// MEASUREMENT, 48 bytes of hex.
        #[arg(long)]
        measurement: Option<String>,
        #[arg(long, value_enum, default_value = "genoa")]
        product: ProductArg,
        /// Sign with a VLEK instead of a VCEK.
        #[arg(long)]
        vlek: bool,
        /// Report version (2, 3 or 5).
        #[arg(long, default_value_t = 5)]
        version: u32,
    },
    /// NVIDIA SPDM measurements signed by a generated device chain.
    Nvidia {
        #[arg(long)]
        out: PathBuf,
        /// Requester nonce, 32 bytes of hex (random when absent).
        #[arg(long)]
        nonce: Option<String>,
    },
}

/// The evidence a command verifies, and how.
#[derive(clap::Args, Debug, Clone)]
pub struct EvidenceArgs {
    /// Evidence bundle folder.
    pub bundle: PathBuf,
    /// Verification time (RFC 3339); defaults to now.
    #[arg(long)]
    pub at: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
    /// Trust simulator roots found in the bundle (development only; claims say `sim`).
    #[arg(long)]
    pub trust_sim: bool,
}

#[derive(clap::Args, Debug, Clone)]
pub struct SourceArgs {
    /// Collateral store (default: $CGX_COLLATERAL, else ~/.cache/cgx/collateral).
    #[arg(long, global = true)]
    pub store: Option<PathBuf>,
    /// AMD KDS base URL.
    #[arg(long, global = true, default_value = "https://kdsintf.amd.com")]
    pub kds: String,
    /// Intel PCS v4 or PCCS base URL.
    #[arg(
        long,
        global = true,
        default_value = "https://api.trustedservices.intel.com"
    )]
    pub pcs: String,
    /// Intel SGX Root CA CRL URL.
    #[arg(
        long,
        global = true,
        default_value = "https://certificates.trustedservices.intel.com/IntelSGXRootCA.der"
    )]
    pub intel_root_ca_crl: String,
    /// NVIDIA RIM service base URL.
    #[arg(
        long,
        global = true,
        default_value = "https://rim.attestation.nvidia.com"
    )]
    pub rim_service: String,
    /// NVIDIA OCSP responder URL (device chain revocation).
    #[arg(long, global = true, default_value = "http://ocsp.ndis.nvidia.com")]
    pub nvidia_ocsp: String,
}

#[derive(Subcommand, Debug)]
enum KbsCommand {
    /// Run the key broker (CoCo KBS protocol) until SIGINT/SIGTERM.
    Serve {
        /// Configuration (JSON; see kbs/src/server/config.rs).
        #[arg(long)]
        config: PathBuf,
        /// Plain HTTP instead of the configured TLS (refused unless listening on loopback).
        #[arg(long)]
        insecure_dev: bool,
    },
    /// Write a self-signed TLS certificate and key (dev.crt, dev.key) for a development KBS.
    DevCert {
        #[arg(long)]
        out: PathBuf,
        /// DNS names or IP addresses (default: localhost, 127.0.0.1).
        #[arg(long = "name")]
        names: Vec<String>,
    },
    /// Print an admin bearer token signed with an Ed25519 PKCS#8 key (DER or PEM).
    Token {
        #[arg(long)]
        admin_key: PathBuf,
        /// Lifetime in seconds.
        #[arg(long, default_value_t = 300)]
        ttl: i64,
    },
}

#[derive(Subcommand, Debug)]
enum ConsoleCommand {
    /// Answer the sign-in page's challenge with an API key (`--key`): prints the token to
    /// paste into that page. The token signs in only the browser that showed the challenge.
    Login {
        /// The challenge the sign-in page shows.
        #[arg(long)]
        challenge: String,
        #[command(flatten)]
        conn: broker::Conn,
    },
}

#[derive(Subcommand, Debug)]
enum BrokerCommand {
    /// Run the broker until SIGINT/SIGTERM.
    Serve {
        /// Configuration (TOML or JSON; see broker/src/server/config.rs).
        #[arg(long)]
        config: PathBuf,
        /// Plain HTTP instead of the configured TLS (refused unless listening on loopback).
        #[arg(long)]
        insecure_dev: bool,
    },
    /// The reference values the broker appraises with, on every replica: `set FILE` (the file
    /// `cgx measure … --reference-values` writes; scope reference-values), `show`.
    ReferenceValues {
        #[command(subcommand)]
        command: RefsCommand,
        #[command(flatten)]
        conn: broker::Conn,
    },
}

#[derive(Subcommand, Debug)]
enum RefsCommand {
    /// Store FILE in place of version REPLACES (what `show` says; 0: the configuration's) and
    /// put it in force (registrations from now on are appraised with it).
    Set {
        file: PathBuf,
        #[arg(long)]
        replaces: i64,
    },
    /// The values in force and their version (0: the broker's configuration file's).
    Show,
}

#[derive(Subcommand, Debug)]
enum JobCommand {
    /// Submit a job; it is placed at once if an attested, fresh node fits.
    Submit(Box<broker::SubmitArgs>),
    /// The offers a job would get now, best first, and why other nodes would not; nothing
    /// is placed or held.
    Quote(Box<broker::SubmitArgs>),
    /// A job's state, node, lease and events.
    Status { id: String },
    /// Cancel a job: its lease ends and is never renewed; its GPUs are free at once.
    Cancel { id: String },
    /// Jobs of the key's tenant (auditors: every tenant's).
    Ls {
        #[arg(long)]
        tenant: Option<String>,
    },
}

#[derive(Subcommand, Debug)]
enum LedgerCommand {
    /// Money in: to tenant/<name> or stake/<operator>; idempotent by --reference.
    Deposit {
        #[arg(long)]
        account: String,
        /// Currency units (exact decimal, up to 6 decimals).
        #[arg(long)]
        amount: cgx_protocol::money::Micros,
        /// The payment's own reference (a retry with it moves nothing again).
        #[arg(long)]
        reference: String,
    },
    /// Every account's sums (auditors).
    Accounts,
}

#[derive(Subcommand, Debug)]
enum NodeCommand {
    /// Nodes the key may see.
    Ls,
    /// One node.
    Show { id: String },
    /// Ask a node to re-attest at its next heartbeat (a new policy or TCB, rolled out early).
    Reattest { id: String },
}

#[derive(Subcommand, Debug)]
enum WeightsCommand {
    /// Encrypt a file with age (v1; `age -d` opens it), in parallel, and print its SHA-256. With
    /// --kbs: to a fresh identity stored in the KBS as PATH, bound to the encrypted file's
    /// SHA-256 (the guest agent opens that file only); the identity never touches disk.
    Encrypt {
        /// Encrypt to this recipient only (bind its identity later with `cgx weights bind`).
        #[arg(
            long,
            short = 'r',
            required_unless_present = "kbs",
            conflicts_with = "kbs"
        )]
        recipient: Option<String>,
        #[arg(long = "in")]
        input: PathBuf,
        #[arg(long = "out")]
        output: PathBuf,
        #[command(flatten)]
        store: WeightsStore,
        /// Threads (0: one per core).
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// No progress bar.
        #[arg(long)]
        quiet: bool,
    },
    /// Store an age identity (`age-keygen -o`) in the KBS as PATH, bound to the SHA-256 of the
    /// age file encrypted to it (the stock `age -r` made it).
    Bind {
        /// The identity file.
        #[arg(long)]
        identity: PathBuf,
        /// The encrypted weights.
        #[arg(long = "in")]
        input: PathBuf,
        #[command(flatten)]
        store: WeightsStore,
    },
}

/// Where a weights key goes.
#[derive(clap::Args, Debug)]
struct WeightsStore {
    /// KBS base URL.
    #[arg(long, requires = "path", requires = "admin_key")]
    kbs: Option<String>,
    /// Resource path REPO/TYPE/TAG.
    #[arg(long, requires = "kbs")]
    path: Option<String>,
    /// Admin Ed25519 key (PKCS#8, DER or PEM) for the repository.
    #[arg(long, requires = "kbs")]
    admin_key: Option<PathBuf>,
    /// CA certificate(s) of the KBS (PEM); default: WebPKI roots.
    #[arg(long, requires = "kbs")]
    ca: Option<PathBuf>,
    /// Release the key without a lease too: then only to requesters a release policy of the
    /// repository or of this resource names (tenant isolation). By default the key is a job
    /// resource, released only with a lease token.
    #[arg(long, requires = "kbs")]
    no_lease: bool,
}

impl WeightsStore {
    fn get(&self) -> Option<weights::Store<'_>> {
        Some(weights::Store {
            kbs: self.kbs.as_deref()?,
            path: self.path.as_deref()?,
            admin_key: self.admin_key.as_deref()?,
            ca: self.ca.as_deref(),
            lease_required: !self.no_lease,
        })
    }
}

#[derive(Subcommand, Debug)]
enum CollateralCommand {
    /// Fetch what a bundle's evidence needs (SNP: VCEK, cert chain, CRL; TDX: TCB info, QE
    /// identity, CRLs) or NVIDIA RIMs by id, into the store.
    Fetch {
        /// Evidence bundles.
        bundles: Vec<PathBuf>,
        /// NVIDIA RIM ids.
        #[arg(long = "rim-id")]
        rim_ids: Vec<String>,
    },
    /// Import exported stores, evidence bundles' collateral, or RIM files.
    Import { paths: Vec<PathBuf> },
    /// Export the store to a folder (carry it to an air-gapped verifier, then import).
    Export { dir: PathBuf },
    /// List what the store holds and how fresh it is now.
    Ls {
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum PolicyCommand {
    /// Run the Rego tests (`test_*` rules in DIR/tests/*.rego against DIR/*.rego).
    Test {
        /// Policy folder (default: ./policies).
        #[arg(default_value = "policies")]
        dir: PathBuf,
    },
}

#[derive(Subcommand, Debug)]
enum RimCommand {
    /// Verify RIM files (XML-DSig and chain to the NVIDIA CoRIM signing root).
    Verify {
        files: Vec<PathBuf>,
        #[arg(long)]
        at: Option<String>,
        #[arg(long)]
        ignore_signer_expiry: bool,
        #[arg(long)]
        json: bool,
    },
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum ProductArg {
    Milan,
    Genoa,
    Turin,
}

/// Log filter from `CGX_LOG` (`warn`, `info`, `cgx_kbs=debug,warn`, …; `warn` when unset or
/// unreadable). Targets and levels only: a regex-capable filter costs every build a regex
/// engine.
fn log_filter() -> tracing_subscriber::filter::Targets {
    let default = || {
        tracing_subscriber::filter::Targets::new()
            .with_default(tracing_subscriber::filter::LevelFilter::WARN)
    };
    match std::env::var("CGX_LOG") {
        Ok(spec) => spec.parse().unwrap_or_else(|e| {
            eprintln!("cgx: CGX_LOG '{spec}': {e}; logging warnings");
            default()
        }),
        Err(_) => default(),
    }
}

/// `cgx measure launch`'s equivalent command line: `cgx measure snp|tdx` with the flags the
/// host agent's launch description gives.
fn launch_flags(
    config: &std::path::Path,
    refs: &measure::RefsArgs,
    json: bool,
) -> Result<Vec<String>, String> {
    let c = cgx_host_agent::config::HostConfig::load(config).map_err(|e| e.to_string())?;
    let q = c
        .qemu
        .ok_or_else(|| format!("{}: no [qemu] table, so no launch", config.display()))?;
    let flags = q
        .launch
        .measure_args()
        .map_err(|e| format!("{}: {e}", config.display()))?
        .ok_or_else(|| {
            format!(
                "{}: a launch without a TEE measures nothing",
                config.display()
            )
        })?;
    let mut argv = vec!["cgx".to_string(), "measure".to_string()];
    argv.extend(flags);
    if let Some(r) = &refs.reference_values {
        argv.extend(["--reference-values".into(), r.display().to_string()]);
    }
    if let Some(n) = &refs.image_name {
        argv.extend(["--image-name".into(), n.clone()]);
    }
    if json {
        argv.push("--json".into());
    }
    Ok(argv)
}

// Parsed once per process from the command line: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum AuditCommand {
    /// Copy the broker's log (checkpoint, hash tiles, entry bundles: an auditor's key) into a
    /// directory laid out as C2SP tlog-tiles serves it.
    Fetch {
        #[arg(long)]
        out: PathBuf,
        /// Also copy every archived piece the leaves name (evidence, collateral, EARs) here.
        #[arg(long)]
        archive: Option<PathBuf>,
        #[command(flatten)]
        conn: broker::Conn,
    },
    /// Copy the KBS's own log (checkpoint, hash tiles, entry bundles with an unscoped
    /// administrator's key) into a directory laid out as C2SP tlog-tiles serves it.
    FetchKbs {
        /// The KBS's base URL.
        #[arg(long)]
        kbs: String,
        /// An unscoped KBS administrator's Ed25519 PKCS#8 key.
        #[arg(long)]
        admin_key: PathBuf,
        /// CA certificate(s) of the KBS (PEM); default: WebPKI roots.
        #[arg(long)]
        ca: Option<PathBuf>,
        #[arg(long)]
        out: PathBuf,
    },
    /// Check a log directory offline: the checkpoint's signature and witness quorum, every
    /// leaf's inclusion, consistency with the checkpoint in --state (updated when all holds),
    /// then what every decision rests on (records, proofs, the ledger replayed, the archive).
    /// Prints by exception; exit 1 on a violation.
    Verify {
        #[arg(long)]
        log: PathBuf,
        /// The log's verifier key (`<origin>+<id>+<key>`).
        #[arg(long)]
        log_key: String,
        /// The last checkpoint this auditor verified (created on first use).
        #[arg(long)]
        state: Option<PathBuf>,
        /// A witness's verifier key (`<name>+<id>+<0x04 key>`); repeat for each.
        #[arg(long = "witness")]
        witnesses: Vec<String>,
        /// How many of them must have cosigned the checkpoint.
        #[arg(long, default_value_t = 0)]
        quorum: usize,
        /// The archive `cgx audit fetch --archive` wrote: each piece a leaf names must be
        /// there and hash to its name.
        #[arg(long)]
        archive: Option<PathBuf>,
        /// The broker pays windows on records alone (`[pow] interval_secs = 0`).
        #[arg(long)]
        no_proofs: bool,
        /// Re-verify every archived registration against the trust roots and re-appraise it
        /// (needs --archive): its tier must be the one its leaf records.
        #[arg(long, requires = "archive")]
        reappraise: bool,
        /// The appraisal policy to re-appraise under (default: the built-in one).
        #[arg(long)]
        policy: Option<PathBuf>,
        /// The reference values to re-appraise under (default: the built-in ones).
        #[arg(long)]
        refs: Option<PathBuf>,
        /// A simulator root pin to trust in re-appraisal (development networks only); repeat.
        #[arg(long = "sim-root")]
        sim_roots: Vec<String>,
        /// The KBS's own log (a directory): verified too, each release held to the broker's
        /// leases, each anchored KBS checkpoint to the KBS's log.
        #[arg(long, requires = "kbs_log_key")]
        kbs_log: Option<PathBuf>,
        /// The KBS log's verifier key.
        #[arg(long)]
        kbs_log_key: Option<String>,
        /// How many of the witnesses must have cosigned the KBS's checkpoint.
        #[arg(long, default_value_t = 0)]
        kbs_quorum: usize,
        /// Report violations from this leaf index on.
        #[arg(long)]
        from: Option<u64>,
        /// Report violations before this leaf index.
        #[arg(long)]
        to: Option<u64>,
        /// Record the verdict with the broker at this URL (an `audit.verdict` leaf the
        /// console shows), signed in with `--report-key` (an auditor's API key).
        #[arg(long, requires = "report_key", conflicts_with_all = ["from", "to"])]
        report: Option<String>,
        #[arg(long)]
        report_key: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// One event's C2SP tlog-proof (the leaf, its inclusion proof, the checkpoint with its
    /// cosignatures) from a log directory, verified first: anyone checks it alone with
    /// `verify-proof`.
    Proof {
        #[arg(long)]
        log: PathBuf,
        #[arg(long)]
        log_key: String,
        /// The leaf's index in the log.
        #[arg(long, conflicts_with = "seq")]
        index: Option<u64>,
        /// The event's `seq` in its service's trail.
        #[arg(long)]
        seq: Option<i64>,
        /// Where to write it (default: stdout).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Check a tlog-proof alone: the checkpoint under the log's key and the witnesses'
    /// quorum, the leaf in its tree. Prints the leaf; exit 1 when it does not hold.
    VerifyProof {
        file: PathBuf,
        #[arg(long)]
        log_key: String,
        #[arg(long = "witness")]
        witnesses: Vec<String>,
        #[arg(long, default_value_t = 0)]
        quorum: usize,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand, Debug)]
enum WitnessCommand {
    /// Run the witness until SIGINT/SIGTERM (`POST /add-checkpoint`).
    Serve {
        /// Configuration (TOML or JSON; see crates/service/src/witness.rs).
        #[arg(long)]
        config: PathBuf,
        /// Plain HTTP instead of the configured TLS (refused unless listening on loopback).
        #[arg(long)]
        insecure_dev: bool,
    },
    /// Print the witness's verifier key, for logs and auditors to name it by.
    Vkey {
        #[arg(long)]
        config: PathBuf,
    },
}

fn main() -> ExitCode {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    tracing_subscriber::registry()
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .with(log_filter())
        .init();
    // The guest agent, built in (`cgx guest-agent run …`): what `cgx up`'s simulated hosts
    // launch, as the host agent's sim launcher launches `cgx-guest-agent`.
    if std::env::args_os().nth(1).as_deref() == Some(std::ffi::OsStr::new("guest-agent")) {
        return cgx_guest_agent::main_os(std::env::args_os().skip(2));
    }
    let cli = Cli::parse();
    run(cli)
}

fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Up { keep } => up::up(keep),
        Command::Verify {
            evidence,
            collateral,
            nonce,
            rims,
            rim_ignore_signer_expiry,
        } => verify::verify(
            &evidence,
            &verify::VerifyOptions {
                nonce: nonce.as_deref(),
                collateral: collateral.as_deref(),
                rims: &rims,
                rim_ignore_signer_expiry,
            },
        ),
        Command::Appraise {
            evidence,
            policy,
            reference_values,
            signing_key,
            nonce,
        } => appraise::appraise(
            &evidence,
            &appraise::AppraiseOptions {
                policy: policy.as_deref(),
                reference_values: reference_values.as_deref(),
                signing_key: signing_key.as_deref(),
                nonce: nonce.as_deref(),
            },
        ),
        Command::Collateral { command, source } => match command {
            CollateralCommand::Fetch { bundles, rim_ids } => {
                collateral::fetch(&source, &bundles, &rim_ids)
            }
            CollateralCommand::Import { paths } => collateral::import(&source, &paths),
            CollateralCommand::Export { dir } => collateral::export(&source, &dir),
            CollateralCommand::Ls { json } => collateral::ls(&source, json),
        },
        Command::Policy { command } => match command {
            PolicyCommand::Test { dir } => policy::test(&dir),
        },
        Command::Sim { kind } => match kind {
            SimKind::Snp {
                out,
                report_data,
                measurement,
                product,
                vlek,
                version,
            } => sim::snp(
                &out,
                report_data.as_deref(),
                measurement.as_deref(),
                match product {
                    ProductArg::Milan => cgx_attestation::snp::Product::Milan,
                    ProductArg::Genoa => cgx_attestation::snp::Product::Genoa,
                    ProductArg::Turin => cgx_attestation::snp::Product::Turin,
                },
                vlek,
                version,
            ),
            SimKind::Nvidia { out, nonce } => sim::nvidia(&out, nonce.as_deref()),
        },
        Command::Rim { command } => match command {
            RimCommand::Verify {
                files,
                at,
                ignore_signer_expiry,
                json,
            } => rim::verify(&files, at.as_deref(), ignore_signer_expiry, json),
        },
        Command::Broker { command } => match command {
            BrokerCommand::Serve {
                config,
                insecure_dev,
            } => broker::serve(&config, insecure_dev),
            BrokerCommand::ReferenceValues { command, conn } => match command {
                RefsCommand::Set { file, replaces } => {
                    broker::reference_values_set(&conn, &file, replaces)
                }
                RefsCommand::Show => broker::reference_values_show(&conn),
            },
        },
        Command::Job { command, conn } => match command {
            JobCommand::Submit(args) => broker::job_submit(&conn, &args),
            JobCommand::Quote(args) => ledger::quote(&conn, &args),
            JobCommand::Status { id } => broker::job_status(&conn, &id),
            JobCommand::Cancel { id } => broker::job_cancel(&conn, &id),
            JobCommand::Ls { tenant } => broker::job_ls(&conn, tenant.as_deref()),
        },
        Command::Statement {
            tenant,
            operator,
            from,
            to,
            lines,
            conn,
        } => ledger::statement(
            &conn,
            tenant.as_deref(),
            operator.as_deref(),
            from,
            to,
            lines,
        ),
        Command::Console { command } => match command {
            ConsoleCommand::Login { challenge, conn } => console::login(&conn, &challenge),
        },
        Command::Audit { command } => match command {
            AuditCommand::FetchKbs {
                kbs,
                admin_key,
                ca,
                out,
            } => audit::fetch_kbs(&kbs, &admin_key, ca.as_deref(), &out),
            AuditCommand::Fetch { out, archive, conn } => {
                audit::fetch(&conn, &out, archive.as_deref())
            }
            AuditCommand::Verify {
                log,
                log_key,
                state,
                witnesses,
                quorum,
                archive,
                no_proofs,
                reappraise,
                policy,
                refs,
                sim_roots,
                kbs_log,
                kbs_log_key,
                kbs_quorum,
                from,
                to,
                report,
                report_key,
                json,
            } => audit::verify(
                &log,
                &audit::VerifyArgs {
                    report: report.zip(report_key),
                    log_key,
                    witnesses,
                    quorum,
                    state,
                    archive,
                    no_proofs,
                    reappraise,
                    policy,
                    refs,
                    sim_roots,
                    kbs_log,
                    kbs_log_key,
                    kbs_quorum,
                    from,
                    to,
                    json,
                },
            ),
            AuditCommand::Proof {
                log,
                log_key,
                index,
                seq,
                out,
            } => audit::proof(
                &log,
                &audit::VerifyArgs {
                    log_key,
                    ..Default::default()
                },
                index,
                seq,
                out.as_deref(),
            ),
            AuditCommand::VerifyProof {
                file,
                log_key,
                witnesses,
                quorum,
                json,
            } => audit::verify_proof(
                &file,
                &audit::VerifyArgs {
                    log_key,
                    witnesses,
                    quorum,
                    json,
                    ..Default::default()
                },
            ),
        },
        Command::Witness { command } => match command {
            WitnessCommand::Serve {
                config,
                insecure_dev,
            } => kbs::serve_service::<cgx_service::witness::WitnessConfig, _, _>(
                "cgx witness",
                &config,
                insecure_dev,
                |cfg, stop, on_listen| async move {
                    cgx_service::witness::run(&cfg, stop, on_listen).await
                },
            ),
            WitnessCommand::Vkey { config } => audit::witness_vkey(&config),
        },
        Command::Ledger { command, conn } => match command {
            LedgerCommand::Deposit {
                account,
                amount,
                reference,
            } => ledger::deposit(&conn, &account, amount, &reference),
            LedgerCommand::Accounts => ledger::accounts(&conn),
        },
        Command::Node { command, conn } => match command {
            NodeCommand::Ls => broker::node_ls(&conn),
            NodeCommand::Show { id } => broker::node_show(&conn, &id),
            NodeCommand::Reattest { id } => broker::node_reattest(&conn, &id),
        },
        Command::Kbs { command } => match command {
            KbsCommand::Serve {
                config,
                insecure_dev,
            } => kbs::serve(&config, insecure_dev),
            KbsCommand::Token { admin_key, ttl } => kbs::token(&admin_key, ttl),
            KbsCommand::DevCert { out, names } => kbs::dev_cert(&out, &names),
        },
        Command::Weights { command } => match command {
            WeightsCommand::Encrypt {
                recipient,
                input,
                output,
                store,
                threads,
                quiet,
            } => weights::encrypt(
                recipient.as_deref(),
                store.get(),
                &input,
                &output,
                threads,
                quiet,
            ),
            WeightsCommand::Bind {
                identity,
                input,
                store,
            } => match store.get() {
                Some(st) => weights::bind(&identity, &input, st),
                None => Err("cgx weights bind needs --kbs, --path and --admin-key".into()),
            },
        },
        Command::Bench { args } => bench::run(&args),
        Command::Image {
            command:
                ImageCommand::Build {
                    kernel,
                    modules,
                    agent,
                    ca,
                    append,
                    out,
                    args,
                },
        } => cgx_image::build(&cgx_image::Spec {
            kernel,
            modules,
            agent,
            args,
            ca,
            append,
        })
        .and_then(|image| image.write(&out))
        .map_err(|e| e.to_string())
        .and_then(|manifest| {
            let text = std::fs::read_to_string(&manifest).map_err(|e| e.to_string())?;
            println!("{text}");
            Ok(ExitCode::SUCCESS)
        }),
        Command::Measure { command } => match command {
            MeasureCommand::Snp(args) => measure::snp(&args),
            MeasureCommand::Tdx(args) => measure::tdx::tdx(&args),
            MeasureCommand::Check {
                report,
                launch,
                json,
            } => measure::check(&report, &launch, json),
            MeasureCommand::Launch { config, refs, json } => {
                match launch_flags(&config, &refs, json) {
                    Ok(argv) => match Cli::try_parse_from(argv) {
                        Ok(cli) => return run(cli),
                        Err(e) => Err(format!("{}: {e}", config.display())),
                    },
                    Err(e) => Err(e),
                }
            }
        },
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("cgx: {e}");
            ExitCode::from(2)
        }
    }
}
