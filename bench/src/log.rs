//! `cgx bench log`: the transparency log's costs against the bounds they chase, in one run
//! (issue 33, item 7).
//!
//! - **Durable append**: leaves per second from audit rows committed (SQLite,
//!   `synchronous=FULL`, the broker's own integrator signing a checkpoint pass after pass) to a
//!   checkpoint covering them; beside it, the same leaves' SHA-256 alone and the disk's durable
//!   write rate for the same bytes in the same batches (written, then `fsync`).
//! - **Auditor**: `verify_dir` over a log of a million leaves (leaves per second against raw
//!   SHA-256 of the same leaves); inclusion proofs per second (proved from the tree, checked
//!   against the root) against raw SHA-256 node hashes per proof; the checkpoint's signature
//!   against raw Ed25519 verifications.
//! - **A lease-day**: one lease of 8 GPUs for 1 440 one-minute windows — its registration, its
//!   opening, 1 440 signed metering records, a proof per GPU every 10 windows, 1 440 paid
//!   windows' transfers — verified and cross-checked (`cgx_audit`) from its directory; goal
//!   ≤ 1 s.

use std::io::Write as _;
use std::time::Instant;

use cgx_ledger::settle::{Escrow, Outcome, Price};
use cgx_ledger::{AccountId, CauseKind, Role, Transfer};
use cgx_protocol::audit::AuditEvent;
use cgx_protocol::metering::{MeteringRecord, genesis, token_hash};
use cgx_tlog::note::{KeyKind, NoteSigner, sign_checkpoint};
use cgx_tlog::tree::MemoryTree;
use cgx_tlog::verify::{Trust, verify_dir};
use serde_json::{Value, json};

use crate::{CliResult, median};

const ORIGIN: &str = "bench.cgx/log";

fn ed25519() -> Result<Vec<u8>, String> {
    aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
        .map(|k| k.as_ref().to_vec())
        .map_err(|_| "key".to_string())
}

/// A metering.accept's detail of the usual size (a signed record, its hash and its link).
fn record_detail() -> String {
    json!({
        "seq": "123",
        "hash": "ab".repeat(32),
        "prev": "cd".repeat(32),
        "record": format!("eyJ{}", "x".repeat(560)),
    })
    .to_string()
}

/// Leaves per second: `n` leaves' SHA-256 (RFC 6962 leaf hashes), bare.
fn sha_rate(leaves: &[Vec<u8>]) -> f64 {
    let t = Instant::now();
    let mut acc = 0u8;
    for l in leaves {
        acc ^= cgx_tlog::record_hash(l).0[0];
    }
    std::hint::black_box(acc);
    leaves.len() as f64 / t.elapsed().as_secs_f64()
}

/// Leaves per second the disk takes durably: the same bytes appended in batches of `batch`,
/// each batch written and `fsync`ed.
fn disk_rate(dir: &std::path::Path, leaves: &[Vec<u8>], batch: usize) -> Result<f64, String> {
    let p = dir.join("disk-bound");
    let mut f = std::fs::File::create(&p).map_err(|e| e.to_string())?;
    let t = Instant::now();
    for chunk in leaves.chunks(batch) {
        let mut buf = Vec::new();
        for l in chunk {
            buf.extend_from_slice(l);
        }
        f.write_all(&buf).map_err(|e| e.to_string())?;
        f.sync_data().map_err(|e| e.to_string())?;
    }
    let rate = leaves.len() as f64 / t.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&p);
    Ok(rate)
}

/// A log of `n` leaves (each about `size` bytes) in `dir`, signed: its tree.
fn build(dir: &std::path::Path, n: u64, key: &NoteSigner) -> Result<MemoryTree, String> {
    let mut tree = MemoryTree::new();
    let detail: Value = serde_json::from_str(&record_detail()).map_err(|e| e.to_string())?;
    for i in 0..n {
        let e = AuditEvent {
            seq: i as i64 + 1,
            at: 1_800_000_000,
            actor: "node:n".into(),
            action: "metering.accept".into(),
            subject: format!("l{:06}", i / 1440),
            detail: detail.clone(),
        };
        tree.append(&e.leaf("cgx-broker"))
            .map_err(|e| e.to_string())?;
    }
    publish(dir, &tree, key)?;
    Ok(tree)
}

fn publish(dir: &std::path::Path, tree: &MemoryTree, key: &NoteSigner) -> Result<(), String> {
    let cp = cgx_tlog::Checkpoint::new(
        ORIGIN,
        tree.size(),
        tree.root().map_err(|e| e.to_string())?,
        "",
    )
    .map_err(|e| e.to_string())?;
    let note = sign_checkpoint(&cp, key).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(dir);
    cgx_tlog::dir::publish(dir, tree, 0, &note).map_err(|e| e.to_string())?;
    Ok(())
}

/// One lease-day's log: the leaves a broker writes for a lease of 8 GPUs over 1 440 one-minute
/// windows, every window proven and paid.
fn lease_day() -> Result<Vec<Vec<u8>>, String> {
    const WINDOWS: u64 = 1440;
    const GPUS: u64 = 8;
    let node = "n-bench";
    let lease = "l-bench";
    let der = ed25519()?;
    let signer = cgx_protocol::signed::Signer::from_pkcs8(&der).map_err(|e| e.to_string())?;
    let mut leaves = Vec::new();
    let mut seq = 0i64;
    let mut push =
        |leaves: &mut Vec<Vec<u8>>, actor: &str, action: &str, subject: &str, detail: Value| {
            seq += 1;
            leaves.push(
                AuditEvent {
                    seq,
                    at: 1_800_000_000,
                    actor: actor.into(),
                    action: action.into(),
                    subject: subject.into(),
                    detail,
                }
                .leaf("cgx-broker"),
            );
        };
    push(
        &mut leaves,
        "operator:op",
        "node.register",
        node,
        json!({
            "operator": "op", "status": "affirming",
            "node_key": cgx_protocol::broker::b64(&signer.public_key()),
        }),
    );
    let tenant = AccountId::new(Role::Tenant, "t").map_err(|e| e.to_string())?;
    let deposit = vec![Transfer::single(
        "deposit/t",
        AccountId::world(),
        tenant,
        1 << 40,
        CauseKind::Deposit,
        "wire",
        0,
    )];
    let price = Price {
        per_gpu_hour: 3_600_000,
        gpus: GPUS as u32,
        window_secs: 60,
    };
    let e = Escrow::new(lease, "t", "op", price, 1000, 0).map_err(|e| e.to_string())?;
    let (mut e, open) = e
        .open(price.cost(WINDOWS).map_err(|e| e.to_string())?, 1)
        .map_err(|e| e.to_string())?;
    for chain in [deposit, open] {
        for (_, subject, d) in
            cgx_audit::schema::transfer_leaves(&chain).map_err(|e| e.to_string())?
        {
            push(
                &mut leaves,
                "broker",
                "ledger.transfer",
                subject,
                serde_json::from_str(&d).map_err(|e| e.to_string())?,
            );
        }
    }
    push(
        &mut leaves,
        "broker",
        "lease.open",
        lease,
        json!({
            "node": node, "tenant": "t", "gpus": (0..GPUS).collect::<Vec<_>>(),
        }),
    );
    let mut prev = genesis(lease);
    for w in 0..WINDOWS {
        let r = MeteringRecord {
            sub: node.into(),
            lease: lease.into(),
            seq: w,
            window_start: 60 * w as i64,
            window_secs: 60,
            gpus: Vec::new(),
            pow: None,
            workload: cgx_protocol::records::WorkloadState::Running,
            prev: prev.clone(),
        };
        let token = signer.sign(&r, 100, 400).map_err(|e| e.to_string())?;
        let hash = token_hash(&token);
        push(
            &mut leaves,
            &format!("node:{node}"),
            "metering.accept",
            lease,
            json!({
                "seq": w.to_string(), "hash": hash, "prev": prev, "record": token,
            }),
        );
        if w % 10 == 0 {
            for g in 0..GPUS {
                push(
                    &mut leaves,
                    "broker",
                    "pow.verdict",
                    &format!("c{w}-{g}"),
                    json!({
                        "node": node, "lease": lease, "gpu": g, "window": w.to_string(),
                        "state": "passed", "root": "ab".repeat(32),
                    }),
                );
            }
        }
        let (next, chain) = e
            .resolve(Outcome::Paid, &hash, 2)
            .map_err(|e| e.to_string())?;
        e = next;
        for (_, subject, d) in
            cgx_audit::schema::transfer_leaves(&chain).map_err(|e| e.to_string())?
        {
            push(
                &mut leaves,
                "broker",
                "ledger.transfer",
                subject,
                serde_json::from_str(&d).map_err(|e| e.to_string())?,
            );
        }
        prev = hash;
    }
    Ok(leaves)
}

pub fn bench(
    leaves: u64,
    audit_leaves: u64,
    batch: u64,
    rounds: usize,
    json_out: bool,
) -> CliResult {
    let work = std::env::temp_dir().join(format!("cgx-bench-log-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let detail = record_detail();

    // Durable append, and its bounds on the same leaves.
    let mut runs = Vec::new();
    let mut shas = Vec::new();
    let mut disks = Vec::new();
    for r in 0..rounds {
        let dir = work.join(format!("append-{r}"));
        let run = rt
            .block_on(cgx_broker::server::bench::log_durable(
                &dir, leaves, batch, &detail,
            ))
            .map_err(|e| e.to_string())?;
        let sample: Vec<Vec<u8>> = (0..leaves)
            .map(|i| {
                let mut l = vec![b'x'; run.leaf_bytes];
                l[..8].copy_from_slice(&i.to_be_bytes());
                l
            })
            .collect();
        shas.push(sha_rate(&sample));
        disks.push(disk_rate(
            &dir,
            &sample,
            usize::try_from(batch).unwrap_or(1),
        )?);
        let _ = std::fs::remove_dir_all(&dir);
        runs.push(run);
    }
    runs.sort_by(|a, b| a.leaves_per_sec.total_cmp(&b.leaves_per_sec));
    let mid = runs.get(runs.len() / 2).cloned().ok_or("no run")?;
    let max_gap = runs
        .iter()
        .map(|r| r.max_checkpoint_gap_ms)
        .fold(0.0, f64::max);
    let sha = median(shas);
    let disk = median(disks);

    // The auditor over a log of `audit_leaves`.
    let key =
        NoteSigner::from_pkcs8(ORIGIN, KeyKind::Ed25519, &ed25519()?).map_err(|e| e.to_string())?;
    let trust = Trust {
        log: key.verifier(),
        witnesses: Vec::new(),
        quorum: 0,
    };
    let big = work.join("big");
    let tree = build(&big, audit_leaves, &key)?;
    let mut verify_rates = Vec::new();
    for _ in 0..rounds {
        let t = Instant::now();
        let v = verify_dir(&big, &trust, None).map_err(|e| e.to_string())?;
        verify_rates.push(v.size as f64 / t.elapsed().as_secs_f64());
    }
    let verify_rate = median(verify_rates);
    let all: Vec<Vec<u8>> = (0..tree.size())
        .filter_map(|i| tree.leaf(i).map(<[u8]>::to_vec))
        .collect();
    let leaf_sha = sha_rate(&all);
    drop(all);
    // Inclusion proofs: proved from the tree, checked against its root.
    let root = tree.root().map_err(|e| e.to_string())?;
    let n = tree.size();
    let proofs = 100_000.min(n);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let t = Instant::now();
    let mut len = 0;
    for _ in 0..proofs {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let i = x % n;
        let p = tree.prove_inclusion(n, i).map_err(|e| e.to_string())?;
        len = p.len();
        let leaf = tree.leaf(i).ok_or("leaf")?;
        cgx_tlog::tlog_tiles::check_record(&p, n, root, i, cgx_tlog::record_hash(leaf))
            .map_err(|e| e.to_string())?;
    }
    let proof_rate = proofs as f64 / t.elapsed().as_secs_f64();
    // Raw node hashes per second: a proof's check is `len` of them and one leaf hash.
    let t = Instant::now();
    let mut h = root;
    for _ in 0..1_000_000 {
        h = cgx_tlog::node_hash(h, root);
    }
    std::hint::black_box(h);
    let node_rate = 1e6 / t.elapsed().as_secs_f64();
    let proof_bound = node_rate / (len as f64 + 1.0);
    // The checkpoint's signature: opened against raw Ed25519 verifications.
    let note = std::fs::read(big.join("checkpoint")).map_err(|e| e.to_string())?;
    let t = Instant::now();
    for _ in 0..10_000 {
        cgx_tlog::note::open_checkpoint(&note, &key.verifier(), &[], 0)
            .map_err(|e| e.to_string())?;
    }
    let open_rate = 1e4 / t.elapsed().as_secs_f64();
    let sk = aws_lc_rs::signature::Ed25519KeyPair::from_pkcs8(&ed25519()?).map_err(|_| "key")?;
    let sig = sk.sign(b"bench");
    let pk2 = aws_lc_rs::signature::UnparsedPublicKey::new(
        &aws_lc_rs::signature::ED25519,
        aws_lc_rs::signature::KeyPair::public_key(&sk)
            .as_ref()
            .to_vec(),
    );
    let t = Instant::now();
    for _ in 0..10_000 {
        pk2.verify(b"bench", sig.as_ref()).map_err(|_| "verify")?;
    }
    let ed_rate = 1e4 / t.elapsed().as_secs_f64();
    drop(tree);
    let _ = std::fs::remove_dir_all(&big);

    // A lease-day, verified and cross-checked from its directory.
    let day = lease_day()?;
    let mut day_tree = MemoryTree::new();
    for l in &day {
        day_tree.append(l).map_err(|e| e.to_string())?;
    }
    let day_dir = work.join("lease-day");
    publish(&day_dir, &day_tree, &key)?;
    let mut day_secs = Vec::new();
    let mut violations = 0;
    for _ in 0..rounds.max(3) {
        let t = Instant::now();
        let v = verify_dir(&day_dir, &trust, None).map_err(|e| e.to_string())?;
        let report = cgx_audit::check(
            &v.leaves,
            cgx_audit::Rules {
                service: "cgx-broker",
                proofs: true,
                archive: None,
            },
        );
        day_secs.push(t.elapsed().as_secs_f64());
        violations = report.violations.len();
        if let Some(x) = report.violations.first() {
            return Err(format!(
                "the lease-day log fails its audit: leaf {} ({}): {}",
                x.index, x.action, x.reason
            ));
        }
    }
    let day_s = median(day_secs);
    let _ = std::fs::remove_dir_all(&work);

    let out = json!({
        "append_durable_sqlite_full": {
            "leaves": mid.leaves,
            "batch": mid.batch,
            "leaf_bytes": mid.leaf_bytes,
            "leaves_per_sec": mid.leaves_per_sec,
            "goal": 20_000,
            "checkpoints": mid.checkpoints,
            "max_checkpoint_gap_ms": max_gap,
            "bound_sha256_leaves_per_sec": sha,
            "ratio_sha256": mid.leaves_per_sec / sha,
            "bound_disk_durable_leaves_per_sec": disk,
            "ratio_disk": mid.leaves_per_sec / disk,
        },
        "auditor": {
            "leaves": audit_leaves,
            "verify_leaves_per_sec": verify_rate,
            "bound_sha256_leaves_per_sec": leaf_sha,
            "ratio": verify_rate / leaf_sha,
            "inclusion_proofs_per_sec": proof_rate,
            "proof_hashes": len + 1,
            "bound_proofs_per_sec": proof_bound,
            "ratio_proofs": proof_rate / proof_bound,
            "checkpoints_opened_per_sec": open_rate,
            "bound_ed25519_verifies_per_sec": ed_rate,
            "ratio_checkpoint": open_rate / ed_rate,
        },
        "lease_day": {
            "leaves": day.len(),
            "secs": day_s,
            "goal_secs": 1.0,
            "violations": violations,
        },
        "rounds": rounds,
    });
    if json_out {
        crate::print_json(&out)?;
    } else {
        println!(
            "append (SQLite, synchronous=FULL, batches of {}): {:.0} leaves/s durable and checkpointed (goal 20 000; {} checkpoints, longest gap {:.0} ms) — bounds: SHA-256 {:.0} leaves/s (ratio {:.3}), disk write+fsync {:.0} leaves/s (ratio {:.2})",
            mid.batch,
            mid.leaves_per_sec,
            mid.checkpoints,
            max_gap,
            sha,
            mid.leaves_per_sec / sha,
            disk,
            mid.leaves_per_sec / disk
        );
        println!(
            "auditor over {audit_leaves} leaves: {:.0} leaves/s verified (bound SHA-256 {:.0}/s, ratio {:.2}); {:.0} inclusion proofs/s (bound {:.0}/s at {} hashes each, ratio {:.2}); {:.0} checkpoints opened/s (bound Ed25519 {:.0}/s, ratio {:.2})",
            verify_rate,
            leaf_sha,
            verify_rate / leaf_sha,
            proof_rate,
            proof_bound,
            len + 1,
            proof_rate / proof_bound,
            open_rate,
            ed_rate,
            open_rate / ed_rate
        );
        println!(
            "lease-day ({} leaves: 1 440 records, 1 152 proofs, 1 440 paid windows): verified and cross-checked in {:.3} s (goal ≤ 1 s), {} violations",
            day.len(),
            day_s,
            violations
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}
