//! `cgx-bench`: cgx's benchmarks, run as `cgx bench verify|appraise|kbs` (the `cgx` binary
//! hands `bench` to this program) or directly. Each benchmark reports a ratio against the bound
//! it chases, measured in the same run; peers (`sev`, `dcap-qvl` on ring, ring's ECDSA) are
//! linked here only, never into the user's `cgx`.

mod attestation;
mod broker;
mod channel;
mod coco;
mod console;
mod kbs;
mod ledger;
mod log;
mod measure;
mod pow;

// The KBS under `cgx bench kbs` runs in this process: the same allocator as `cgx kbs serve`.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// A command's exit code, or a usage/runtime error printed as `cgx bench: …` (exit 2).
pub type CliResult = Result<ExitCode, String>;

/// Pretty JSON on stdout.
/// The median of measured rounds (0 for none).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

pub fn print_json(v: &impl serde::Serialize) -> Result<(), String> {
    let s = serde_json::to_string_pretty(v).map_err(|e| e.to_string())?;
    println!("{s}");
    Ok(())
}

#[derive(Parser, Debug)]
#[command(
    name = "cgx bench",
    version,
    about = "cgx benchmarks, each against the bound it chases"
)]
struct Cli {
    #[command(subcommand)]
    what: BenchWhat,
}

#[derive(Subcommand, Debug)]
enum BenchWhat {
    /// The transparency log: durable appends per second with a checkpoint at least every
    /// second (against raw SHA-256 and the disk's durable write rate), the auditor over a log
    /// of a million leaves (against raw SHA-256 and Ed25519), and one lease-day audited.
    Log {
        /// Leaves appended per round.
        #[arg(long, default_value_t = 200_000)]
        leaves: u64,
        /// Leaves of the log the auditor verifies.
        #[arg(long, default_value_t = 1_000_000)]
        audit_leaves: u64,
        /// Audit rows per durable transaction.
        #[arg(long, default_value_t = 512)]
        batch: u64,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long)]
        json: bool,
    },
    /// Full KBS flows per second (auth → attest → resource) with N concurrent clients, p50/p99;
    /// then weights decryption GB/s against raw ChaCha20-Poly1305 by thread count.
    Kbs {
        #[arg(long, default_value_t = 64)]
        clients: usize,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Also run paced at this many flows/s offered (latency under a fixed load); 0: skip.
        #[arg(long, default_value_t = 1100.0)]
        rate: f64,
        /// Simulated GPUs per node (their evidence goes through attestation too).
        #[arg(long, default_value_t = 0)]
        gpus: usize,
        /// Size of the weights file decrypted (MiB).
        #[arg(long, default_value_t = 256)]
        weights_mib: usize,
        #[arg(long)]
        json: bool,
    },
    /// The broker: placement decisions on a 100 000-node index, submit → placed over HTTP,
    /// registrations over HTTP against in-process appraisal.
    Broker {
        #[arg(long, default_value_t = 100_000)]
        nodes: usize,
        #[arg(long, default_value_t = 200_000)]
        decisions: usize,
        #[arg(long, default_value_t = 64)]
        tenants: usize,
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Registrations posted (each with its own nonce and evidence).
        #[arg(long, default_value_t = 300)]
        registrations: usize,
        /// Run one part only: placement, submit, registration, heartbeat, or agent (the guest
        /// agent as a process: RSS and CPU per heartbeat; needs `cgx` built beside this).
        #[arg(long)]
        only: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// cgx's KBS beside Trustee's (../shared/anchors), both driven by the same clients (CoCo's
    /// stock kbs-client, an independent Python RCAR client) in interleaved rounds: server CPU
    /// per full flow, and the ratio cgx ÷ Trustee.
    Coco {
        /// Full flows per server per round, each on a new connection.
        #[arg(long, default_value_t = 100)]
        flows: usize,
        /// Interleaved rounds; the ratio is their median (the machine's noise moves single
        /// rounds by ±15%).
        #[arg(long, default_value_t = 9)]
        rounds: usize,
        /// Which client drives the flows (`both`: each in its own rounds; the Python client is
        /// skipped, visibly, where python3 or its cryptography package is missing).
        #[arg(long, value_enum, default_value_t = coco::CocoClient::Both)]
        client: coco::CocoClient,
        #[arg(long)]
        json: bool,
    },
    /// Bytes per second through the host–guest channel (one stream and four) against the same
    /// bytes over the same kind of link without it.
    Channel {
        /// Bytes moved per round (MiB).
        #[arg(long, default_value_t = 256)]
        mib: u64,
        /// Rounds (the median is reported).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        #[arg(long)]
        json: bool,
    },
    /// The proof-of-work: the CPU backend's GOPS against the same kernel cache-resident,
    /// verification per challenge per GPU class and GPUs one core keeps verified, the proof's
    /// share of GPU time, metering records accepted per second.
    Pow {
        /// The CPU product's size.
        #[arg(long, default_value_t = 1024)]
        n: usize,
        /// Rounds (the median is reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long)]
        json: bool,
    },
    /// The web console: server time per page (p50, p99) and bytes per page on a broker with
    /// 100 000 nodes, 100 000 jobs and a million log leaves, and the broker's CPU per page view
    /// against a plain API read.
    Console {
        #[arg(long, default_value_t = 100_000)]
        nodes: usize,
        #[arg(long, default_value_t = 100_000)]
        jobs: usize,
        #[arg(long, default_value_t = 1_000_000)]
        leaves: u64,
        /// Views of each page measured.
        #[arg(long, default_value_t = 200)]
        views: usize,
        /// Seed this folder once and reuse it on later runs (the seed takes a minute or two).
        #[arg(long)]
        keep: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Settlement: transfers per second in memory and records settled per second on SQLite
    /// at synchronous=FULL, each beside its bound.
    Ledger {
        #[arg(long, default_value_t = 256)]
        leases: usize,
        #[arg(long, default_value_t = 1000)]
        windows: u64,
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        #[arg(long)]
        json: bool,
    },
    /// SEV-SNP launch digests per second (4 MiB firmware, kernel, initrd) against raw hashing
    /// of the same bytes, and sev-snp-measure on the same files.
    Measure {
        /// Measurement rounds (the median is reported).
        #[arg(long, default_value_t = 9)]
        rounds: usize,
        #[arg(long)]
        json: bool,
    },
    /// Full appraisals per second (verify + policy + sign) against verification alone.
    Appraise {
        #[arg(long)]
        json: bool,
        #[arg(long, default_value_t = 1.0)]
        seconds: f64,
        #[arg(long)]
        vectors: Option<PathBuf>,
    },
    /// Verifications per second per kind on one core: warm (a known platform re-attesting),
    /// cold (a platform seen for the first time) and the peer's, side by side; the warm path
    /// against the raw signature bound.
    Verify {
        #[arg(long)]
        json: bool,
        /// Seconds per measurement round (5 rounds; the median is reported).
        #[arg(long, default_value_t = 1.0)]
        seconds: f64,
        /// Vectors folder for real evidence (default: $CGX_VECTORS or ../shared/vectors).
        #[arg(long)]
        vectors: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.what {
        BenchWhat::Log {
            leaves,
            audit_leaves,
            batch,
            rounds,
            json,
        } => log::bench(leaves, audit_leaves, batch, rounds, json),
        BenchWhat::Console {
            nodes,
            jobs,
            leaves,
            views,
            keep,
            json,
        } => console::bench(nodes, jobs, leaves, views, keep.as_deref(), json),
        BenchWhat::Ledger {
            leases,
            windows,
            rounds,
            json,
        } => ledger::bench(leases, windows, rounds, json),
        BenchWhat::Kbs {
            clients,
            seconds,
            rate,
            gpus,
            weights_mib,
            json,
        } => kbs::bench(
            clients,
            seconds,
            (rate > 0.0).then_some(rate),
            gpus,
            weights_mib,
            json,
        ),
        BenchWhat::Appraise {
            json,
            seconds,
            vectors,
        } => attestation::appraise(json, seconds, vectors),
        BenchWhat::Coco {
            flows,
            rounds,
            client,
            json,
        } => coco::bench(flows, rounds, client, json),
        BenchWhat::Broker {
            nodes,
            decisions,
            tenants,
            seconds,
            registrations,
            only,
            json,
        } => broker::bench(
            nodes,
            decisions,
            tenants,
            seconds,
            registrations,
            only.as_deref(),
            json,
        ),
        BenchWhat::Verify {
            json,
            seconds,
            vectors,
        } => attestation::verify(json, seconds, vectors),
        BenchWhat::Measure { rounds, json } => measure::bench(rounds, json),
        BenchWhat::Channel { mib, rounds, json } => channel::bench(mib, rounds, json),
        BenchWhat::Pow { n, rounds, json } => pow::bench(n, rounds, json),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("cgx bench: {e}");
            ExitCode::from(2)
        }
    }
}
