//! `cgx bench pow`: the proof-of-work's costs against the bounds they chase, in one run.
//!
//! - The CPU backend's product (int8, int32 accumulation, every core) against its own inner loop
//!   on cache-resident data (the widest vectors the CPU has: AVX-512 VNNI here) — the most this
//!   code reaches on this machine with memory out of the way. No vendor int8 GEMM (oneDNN, MKL)
//!   is installed here to race against.
//! - The broker's verification of one challenge of each GPU class, on one core (the opened
//!   rows' paths, and each opened cell recomputed from A's row and B's column group); how many
//!   GPUs one core keeps verified at the default schedule.
//! - The proof's share of GPU time at the default schedule (the class's expected time; the
//!   GPU figures themselves come from a GPU host).
//! - Metering records accepted per second on one core (signature, chain rules).

use std::time::Instant;

use cgx_pow::challenge::{Challenge, Matrix, matrix, seed};
use cgx_pow::proof::{Opening, Proof, Verifier, cells};
use cgx_protocol::merkle::{Tree, leaf_hash};
use serde_json::json;

use crate::{CliResult, median};

/// The broker's default (broker config `[pow]`): one challenge per GPU every 600 s, each
/// answer verified in full.
pub const INTERVAL_SECS: f64 = 600.0;

fn gops(n: usize, secs: f64) -> f64 {
    2.0 * (n as f64).powi(3) / secs / 1e9
}

/// The product at n on `threads` cores (GOPS).
fn product(n: usize, threads: usize) -> f64 {
    let s = seed(b"bench", "l", 0, b"k", 0);
    let a = matrix(&s, Matrix::A, n as u32);
    let b = matrix(&s, Matrix::B, n as u32);
    let t = Instant::now();
    let c = cgx_pow::cpu::product(&a, &b, n, threads);
    let secs = t.elapsed().as_secs_f64();
    std::hint::black_box(c);
    gops(n, secs)
}

/// The kernel's ceiling on this machine: its inner loop on cache-resident data, every core.
fn cached(threads: usize) -> f64 {
    cgx_pow::cpu::kernel_peak_ops(threads, 1000) / 1e9
}

/// A proof of `ch`'s shape for `opening`: rows that are not the product, committed honestly
/// (every path right). The verifier recomputes every opened cell before it refuses, so its
/// time is an honest proof's.
fn shaped(ch: &Challenge, opening: &[u8; 32]) -> Proof {
    let n = ch.params.n as usize;
    let row = |i: usize| -> Vec<i32> {
        (0..n)
            .map(|j| ((i * 31 + j * 17) % 2001) as i32 - 1000)
            .collect()
    };
    let leaves: Vec<_> = (0..n)
        .map(|i| leaf_hash(&cgx_pow::cpu::row_bytes(&row(i))))
        .collect();
    let tree = Tree::new(leaves);
    let root = tree.root();
    let openings = cells(&ch.seed, &root, opening, ch.params.n, ch.params.k)
        .into_iter()
        .map(|(i, _)| Opening {
            index: i,
            row: row(i as usize),
            path: tree.path(i as usize).unwrap_or_default(),
        })
        .collect();
    Proof { root, openings }
}

fn metering_per_sec(records: usize) -> Result<f64, String> {
    use cgx_protocol::metering::{Chain, GpuUsage, MeteringRecord, accept, genesis};
    let pkcs8 =
        aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .map_err(|_| "key")?;
    let s = cgx_protocol::signed::Signer::from_pkcs8(pkcs8.as_ref()).map_err(|e| e.to_string())?;
    let start = 1_000_000i64;
    let mut chain = Chain {
        lease: "l1".into(),
        node: "n1".into(),
        node_key: s.public_key(),
        start,
        window_secs: 60,
        ended_at: None,
        gpus: vec![0, 1, 2, 3, 4, 5, 6, 7],
        last: None,
    };
    let mut tokens = Vec::with_capacity(records);
    let mut prev = genesis("l1");
    for seq in 0..records as u64 {
        let r = MeteringRecord {
            sub: "n1".into(),
            lease: "l1".into(),
            seq,
            window_start: start + 60 * seq as i64,
            window_secs: 60,
            gpus: (0..8)
                .map(|index| GpuUsage {
                    index,
                    utilization_pct: 97,
                    memory_used_mib: 70_000,
                    temperature_c: 61,
                    power_mw: 650_000,
                    ecc_corrected: 0,
                    ecc_uncorrected: 0,
                    throttle_reasons: 0,
                })
                .collect(),
            pow: None,
            workload: cgx_protocol::records::WorkloadState::Running,
            prev,
        };
        let end = r.window_start + 60;
        let t = s.sign(&r, end, end + 300).map_err(|e| e.to_string())?;
        prev = cgx_protocol::metering::token_hash(&t);
        tokens.push((t, end));
    }
    let t = Instant::now();
    for (token, end) in &tokens {
        let a = accept(&chain, token, *end + 1).map_err(|e| e.to_string())?;
        chain.last = Some((a.record.seq, a.hash));
    }
    Ok(records as f64 / t.elapsed().as_secs_f64())
}

pub fn bench(n: usize, rounds: usize, json: bool) -> CliResult {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if !(16..=4096).contains(&n) || !n.is_multiple_of(16) {
        return Err("--n: a multiple of 16 from 16 to 4096".into());
    }
    let rounds = rounds.max(1);
    let (mut prod, mut bound) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        prod.push(product(n, threads));
        bound.push(cached(threads));
    }
    let (prod, bound) = (median(prod), median(bound));
    let mut classes = serde_json::Map::new();
    let mut lines = vec![format!(
        "CPU product n = {n}, {threads} threads: {prod:.1} GOPS; its inner loop cache-resident {bound:.1} GOPS; ratio {:.2}",
        prod / bound
    )];
    for class in cgx_pow::class::CLASSES {
        let ch = Challenge {
            seed: seed(b"bench", "l", 2, b"k", 0),
            params: class.params,
        };
        let v = Verifier::new(ch).map_err(|e| e.to_string())?;
        let opening = [0x5au8; 32];
        let p = shaped(&ch, &opening);
        let mut times = Vec::new();
        for _ in 0..rounds.max(3) {
            let t = Instant::now();
            match v.verify(&p.root, &opening, &p) {
                Err(cgx_pow::PowError::Cell { .. }) => {}
                other => return Err(format!("a proof of the wrong product: {other:?}")),
            }
            times.push(t.elapsed().as_secs_f64());
        }
        let verify = median(times);
        let per_core = INTERVAL_SECS / verify;
        let share = class.expected_ms as f64 / 1e3 / INTERVAL_SECS;
        let bytes = cgx_pow::wire::encode(&p).len();
        lines.push(format!(
            "{}: n = {}, k = {}: verification on one core {:.2} ms (every opened cell recomputed); one core keeps {:.0} GPUs verified at one challenge per {INTERVAL_SECS} s each (goal 10 000: {:.2}); GPU share {:.5}% at {} ms expected (goal ≤ 1%); proof {:.2} MiB",
            class.model,
            class.params.n,
            class.params.k,
            verify * 1e3,
            per_core,
            per_core / 10_000.0,
            share * 100.0,
            class.expected_ms,
            bytes as f64 / (1 << 20) as f64
        ));
        classes.insert(
            class.model.into(),
            json!({
                "n": class.params.n, "k": class.params.k,
                "verify_ms": verify * 1e3,
                "gpus_per_core": per_core, "gpus_per_core_vs_goal": per_core / 10_000.0,
                "expected_gpu_ms": class.expected_ms, "gpu_share": share,
                "proof_bytes": bytes, "peak_int8_tops": class.peak_int8_tops,
            }),
        );
    }
    // The GPU, where there is one: a whole challenge of each class's size, and the int8 rate
    // it implies against the datasheet peak (the product is 2n³ of the challenge's work).
    let mut cuda = serde_json::Map::new();
    match cgx_pow_cuda::driver_present()
        .then(|| cgx_pow_cuda::Cuda::open(0))
        .transpose()
    {
        Ok(None) => {
            lines.push("CUDA: no driver on this host; the GPU path is not measured here".into())
        }
        Err(e) => lines.push(format!("CUDA: not usable: {e}")),
        Ok(Some(gpu)) => {
            use cgx_pow::Backend;
            for class in cgx_pow::class::CLASSES {
                let ch = Challenge {
                    seed: seed(b"bench", "l", 3, b"k", 0),
                    params: class.params,
                };
                let mut times = Vec::new();
                for _ in 0..rounds.max(3) {
                    let (_, ms) = gpu.commit(&ch).map_err(|e| e.to_string())?;
                    times.push(ms);
                }
                let ms = median(times);
                let tops = 2.0 * f64::from(class.params.n).powi(3) / (ms / 1e3) / 1e12;
                let share = ms / 1e3 / INTERVAL_SECS;
                lines.push(format!(
                    "CUDA {} at {}'s size: one challenge {ms:.2} ms (class expects {} ms); {tops:.0} int8 TOPS over the whole challenge, {:.3} of the {} TOPS peak; GPU share at the default schedule {:.5}%",
                    gpu.name(),
                    class.model,
                    class.expected_ms,
                    tops / f64::from(class.peak_int8_tops),
                    class.peak_int8_tops,
                    share * 100.0
                ));
                cuda.insert(
                    class.model.into(),
                    json!({"device": gpu.name(), "challenge_ms": ms, "int8_tops": tops,
                           "vs_peak": tops / f64::from(class.peak_int8_tops), "gpu_share": share}),
                );
            }
        }
    }
    let metering = median(
        (0..rounds)
            .map(|_| metering_per_sec(5_000))
            .collect::<Result<Vec<_>, _>>()?,
    );
    lines.push(format!(
        "metering records accepted on one core (signature + chain): {metering:.0}/s (goal 20 000: {:.2})",
        metering / 20_000.0
    ));
    if json {
        crate::print_json(&json!({
            "n": n, "threads": threads, "rounds": rounds, "interval_secs": INTERVAL_SECS,
            "cpu_product_gops": prod, "cpu_cached_kernel_gops": bound, "cpu_ratio": prod / bound,
            "classes": classes,
            "metering_accepted_per_s": metering, "metering_vs_goal": metering / 20_000.0,
            "cuda": cuda,
        }))?;
    } else {
        println!("pow: median of {rounds} rounds");
        for l in lines {
            println!("  {l}");
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}
