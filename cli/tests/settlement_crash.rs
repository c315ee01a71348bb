//! Settlement under crashes (issue 32, item 6): the real broker process (`cgx broker serve`,
//! SQLite at `synchronous=FULL`) is killed with SIGKILL at random points while nodes meter
//! windows, deposits come in and the settlement pass pays — at least 100 times
//! (`CGX_CRASHES` changes the count). After each restart: every transfer balances, no
//! must-not-go-negative account is below zero, the escrows hold what the statements say the
//! leases hold, every record and deposit the broker acknowledged is there, and no window is
//! paid twice. At the end, with no more kills, settlement catches up on every metered window.
//!
//! The broker's transparency log (issue 33, item 6) is written by the same process (its
//! integrator signs a checkpoint every 50 ms), so each kill also lands at a random point of the
//! log writer's work. After each restart the auditor fetches the log and runs `cgx audit
//! verify` with its state file: no acknowledged record or deposit is missing from the leaves,
//! no checkpoint goes backwards or forks from the last one seen, and the ledger replayed from
//! the leaves agrees with every record and balances. At the end the replayed balances equal
//! the broker's accounts.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cgx_broker::client::{BrokerClient, ClientError};
use cgx_devnet::broker::{BrokerSetup, SimBrokerNode, TENANT_A, broker_setup, offer};
use cgx_protocol::metering::{GpuUsage, MeteringRecord, genesis, token_hash};
use cgx_protocol::money::Micros;

/// The broker's configuration as a file `cgx broker serve` reads: the dev network's, with
/// one-second windows, proofs off (windows paid on their records), a fast settlement pass.
fn config_file(b: &BrokerSetup) -> std::path::PathBuf {
    let c = &b.config;
    let doc = serde_json::json!({
        "listen": "127.0.0.1:0",
        "insecure_dev": true,
        "database": c.database,
        "signing_key": c.signing_key,
        "result_key": c.result_key,
        "api_keys": c.api_keys.iter().map(|k| serde_json::json!({
            "public_key": k.public_key, "scopes": k.scopes,
        })).collect::<Vec<_>>(),
        "sim_roots": c.sim_roots,
        "collateral": {"store": c.collateral.store},
        "appraisal": {"reference_values": c.appraisal.reference_values},
        "heartbeat_secs": 5,
        "missed_heartbeats": 6,
        "monitor_interval_ms": 250,
        "metering_window_secs": 1,
        "pow": {"interval_secs": 0},
        "ledger": {"settle_interval_ms": 50, "settle_grace_secs": 30},
        "log": {
            "origin": cgx_devnet::broker::LOG_ORIGIN,
            "key": b.dir.join("log.pk8"),
            "interval_ms": 50,
        },
    });
    let path = b.dir.join("broker.json");
    std::fs::write(&path, doc.to_string()).unwrap();
    path
}

/// Start `cgx broker serve` and wait for its address (a broker that never listens fails the
/// test, which then leaves it to the test harness's exit).
#[allow(clippy::zombie_processes)]
fn start(config: &std::path::Path) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cgx"))
        .args(["broker", "serve", "--config"])
        .arg(config)
        .arg("--insecure-dev")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            panic!("the broker exited before listening");
        }
        if let Some(addr) = line.trim().rsplit("listening on ").next()
            && addr.starts_with("http://")
        {
            let base = addr.to_string();
            // Keep draining its stdout so it never blocks on a full pipe.
            std::thread::spawn(move || {
                let mut sink = String::new();
                while out.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
                    sink.clear();
                }
            });
            return (child, base);
        }
    }
    panic!("the broker did not listen in 60 s");
}

/// The broker process, killed when the test ends however it ends (a failed assertion must
/// not leave a broker running).
struct Broker(Child);

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A lease the test meters as its node would: the records it made (each window's made once,
/// resent until acknowledged), the last hash the broker acknowledged.
struct Meter {
    lease: String,
    node: usize,
    start: i64,
    gpus: Vec<u32>,
    /// Sequence → the token made for it (kept: a retry sends the same record).
    made: Vec<String>,
    acked: u64,
    prev: String,
}

fn now() -> i64 {
    cgx_devnet::now()
}

impl Meter {
    /// Send every closed window's record not acknowledged yet; stop at the first failure.
    fn catch_up(&mut self, node: &SimBrokerNode, client: &BrokerClient) {
        let signer = node.node_key.signer().unwrap();
        loop {
            let seq = self.acked;
            if self.start + seq as i64 + 1 > now() + 4 {
                return;
            }
            if self.made.len() as u64 == seq {
                let r = MeteringRecord {
                    sub: node.id.clone(),
                    lease: self.lease.clone(),
                    seq,
                    window_start: self.start + seq as i64,
                    window_secs: 1,
                    gpus: self
                        .gpus
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
                    prev: self.prev.clone(),
                };
                let t = now();
                self.made.push(signer.sign(&r, t, t + 300).unwrap());
            }
            let token = self.made[seq as usize].clone();
            match client.metering(&node.id, &token) {
                Ok(a) => {
                    assert_eq!(a.seq, seq);
                    self.prev = a.hash;
                    self.acked += 1;
                }
                // Accepted before the answer was lost (the broker died after its commit):
                // the broker holds exactly the record made.
                Err(ClientError::Refused { detail, .. }) if detail.contains("accepted as") => {
                    let held = detail.rsplit("accepted as ").next().unwrap_or("");
                    assert_eq!(
                        held,
                        token_hash(&token),
                        "the broker holds another record: {detail}"
                    );
                    self.prev = held.to_string();
                    self.acked += 1;
                }
                Err(ClientError::Refused { detail, .. }) if detail.contains("lease ended") => {
                    return;
                }
                Err(_) => return,
            }
        }
    }
}

/// The invariants, read through the auditor's API: balanced, nothing negative, escrows equal
/// to what the leases hold, every acknowledged record and deposit there, nothing paid twice.
fn check(auditor: &BrokerClient, meters: &[Meter], deposits: u64, tried: u64) -> (u64, u64) {
    let accounts = auditor.accounts().unwrap();
    let (mut dp, mut cp, mut dn, mut cn) = (0u128, 0u128, 0u128, 0u128);
    let mut escrow_pending = 0u128;
    for a in &accounts {
        dp += u128::from(a.debits_posted.get());
        cp += u128::from(a.credits_posted.get());
        dn += u128::from(a.debits_pending.get());
        cn += u128::from(a.credits_pending.get());
        if a.account != "world" {
            assert!(!a.available_negative, "{} is below zero", a.account);
        }
        if a.account.starts_with("escrow/") {
            escrow_pending += u128::from(a.credits_pending.get());
            assert_eq!(
                a.credits_posted, a.debits_posted,
                "{} passes through",
                a.account
            );
        }
    }
    assert_eq!((dp, dn), (cp, cn), "debits and credits differ");
    let st = auditor.statement(Some(TENANT_A), None, None, None).unwrap();
    assert!(st.reconciled, "the tenant's statement does not reconcile");
    let held: u128 = st.leases.iter().map(|l| u128::from(l.held.get())).sum();
    assert_eq!(held, escrow_pending, "escrow ≠ what the leases hold");
    // Every acknowledged deposit is there (one whose answer the kill cut off may be too).
    let found = st.lines.iter().filter(|l| l.cause == "deposit").count() as u64;
    assert!(
        (deposits + 1..=tried + 1).contains(&found),
        "deposits: {found} found, {deposits} acknowledged of {tried} sent"
    );
    let jobs = auditor.jobs(Some(TENANT_A)).unwrap();
    let mut settled = 0;
    let mut paid_windows = 0;
    for m in meters {
        let id = jobs
            .iter()
            .find(|j| j.lease_id.as_deref() == Some(&m.lease))
            .expect("the job is on its lease")
            .id
            .clone();
        // One job's view counts its lease's accepted records (a listing does not).
        let j = auditor.job(&id).unwrap();
        assert!(
            j.metered_windows >= m.acked,
            "an acknowledged record is missing"
        );
        let l = st.leases.iter().find(|l| l.lease == m.lease).unwrap();
        assert!(
            l.windows.len() as u64 <= j.metered_windows,
            "a window settled without its record"
        );
        for (i, w) in l.windows.iter().enumerate() {
            assert_eq!(w.window, i as u64, "windows settle in order, each once");
            assert_eq!(w.outcome, "paid");
        }
        settled += l.windows.len() as u64;
        paid_windows += l.windows.len() as u64;
    }
    let op = auditor.statement(None, Some("op1"), None, None).unwrap();
    let pays: Vec<&str> = op
        .lines
        .iter()
        .filter(|l| l.cause == "window" && l.account == "provider/op1")
        .map(|l| l.transfer.as_str())
        .collect();
    let mut unique = pays.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), pays.len(), "a record paid twice");
    // Every payment is of a window settled as paid (the windows are read after the lines:
    // settlement goes on between two reads, so there may be more windows, never fewer).
    let paid: std::collections::BTreeSet<String> = op
        .leases
        .iter()
        .flat_map(|l| {
            l.windows
                .iter()
                .filter(|w| w.outcome == "paid")
                .map(move |w| format!("pay/{}/{}/provider", l.lease, w.window))
        })
        .collect();
    for p in &pays {
        assert!(paid.contains(*p), "{p} pays no window settled as paid");
    }
    assert!(paid.len() as u64 >= paid_windows);
    (settled, pays.len() as u64)
}

/// The log as the broker publishes it, copied into `dir` (replaced): its size.
fn fetch_log(auditor: &BrokerClient, dir: &std::path::Path) -> Option<u64> {
    let note = auditor.log_file("checkpoint").ok()?;
    let size: u64 = String::from_utf8_lossy(&note)
        .lines()
        .nth(1)?
        .parse()
        .ok()?;
    let _ = std::fs::remove_dir_all(dir);
    for t in cgx_tlog::tiles_of(size) {
        let mut paths = vec![cgx_tlog::paths::tile_path(&t)];
        if t.level() == 0 {
            paths.push(cgx_tlog::paths::tile_path(&cgx_tlog::paths::bundle_tile(
                t.level_index(),
                t.width(),
            )));
        }
        for p in paths {
            let data = auditor.log_file(&p).ok()?;
            std::fs::create_dir_all(dir.join(&p).parent()?).ok()?;
            std::fs::write(dir.join(&p), data).ok()?;
        }
    }
    std::fs::write(dir.join("checkpoint"), note).ok()?;
    Some(size)
}

/// After a restart: wait for the log to hold every acknowledged record and deposit, then have
/// `cgx audit verify` check it against the last checkpoint this auditor saw (`state`). The
/// log's leaves.
fn check_log(
    auditor: &BrokerClient,
    b: &BrokerSetup,
    meters: &[Meter],
    deposits: u64,
    work: &std::path::Path,
) -> Vec<serde_json::Value> {
    let dir = work.join("log");
    let deadline = Instant::now() + Duration::from_secs(20);
    let leaves = loop {
        assert!(
            Instant::now() < deadline,
            "the log does not hold every acknowledged record and deposit"
        );
        if fetch_log(auditor, &dir).is_some()
            && let Ok(raw) = cgx_tlog::verify::read_leaves(&dir)
        {
            let leaves: Vec<serde_json::Value> = raw
                .iter()
                .map(|l| serde_json::from_slice(l).unwrap())
                .collect();
            let count = |action: &str, subject: Option<&str>| {
                leaves
                    .iter()
                    .filter(|l| l["action"] == action && subject.is_none_or(|s| l["subject"] == s))
                    .count() as u64
            };
            if meters
                .iter()
                .all(|m| count("metering.accept", Some(&m.lease)) >= m.acked)
                && count("ledger.deposit", None) > deposits
            {
                break leaves;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = Command::new(env!("CARGO_BIN_EXE_cgx"))
        .args(["audit", "verify", "--no-proofs", "--log"])
        .arg(&dir)
        .args(["--log-key", &b.log_vkey().unwrap(), "--state"])
        .arg(work.join("seen"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "cgx audit verify: {text}");
    leaves
}

#[test]
fn settlement_survives_the_broker_killed_at_random_points() {
    let crashes: u32 = std::env::var("CGX_CRASHES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let nodes: Vec<SimBrokerNode> = (0..2)
        .map(|_| SimBrokerNode::generate(2, offer(2, "eu-west", Micros(2_000_000))).unwrap())
        .collect();
    let sims: Vec<&cgx_devnet::SimNode> = nodes.iter().map(|n| &n.sim).collect();
    let kbs = cgx_devnet::setup(&sims, None).unwrap();
    let b = broker_setup(&kbs, kbs.pins.iter().map(hex::encode).collect(), None).unwrap();
    let config = config_file(&b);
    let (child, base) = start(&config);
    let mut child = Broker(child);
    let op = b.client(&base, &b.operator).unwrap();
    let admin = b.client(&base, &b.admin).unwrap();
    let deposit = |c: &BrokerClient, reference: &str| {
        c.deposit(&cgx_protocol::ledger::DepositRequest {
            account: format!("tenant/{TENANT_A}"),
            amount_micros: Micros(10_000_000),
            reference: reference.into(),
        })
    };
    deposit(&admin, "opening").unwrap();
    let tenant = b.client(&base, &b.tenant).unwrap();
    for n in &nodes {
        n.register(&op).unwrap();
        n.heartbeat(&op).unwrap();
    }
    let mut meters = Vec::new();
    for _ in 0..2 {
        let spec: cgx_protocol::broker::JobSpec = serde_json::from_value(serde_json::json!({
            "gpu_model": "H100", "gpu_count": 2, "max_price_per_gpu_hour_micros": 2_000_000,
            "duration_secs": 1800, "budget_micros": 2_000_000u64,
        }))
        .unwrap();
        let job = tenant.submit(&spec).unwrap();
        let lease = job.lease_id.clone().expect("placed");
        let node = nodes
            .iter()
            .position(|n| Some(&n.id) == job.node_id.as_ref())
            .unwrap();
        meters.push(Meter {
            start: job.updated_at,
            gpus: job.gpus.clone(),
            prev: genesis(&lease),
            lease,
            node,
            made: Vec::new(),
            acked: 0,
        });
    }
    let mut rng = 0x5eed_u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut deposits = 0u64;
    let mut tried = 0u64;
    let mut base = base;
    let started = Instant::now();
    for i in 0..crashes {
        let clients: Vec<BrokerClient> = nodes
            .iter()
            .map(|_| b.client(&base, &b.operator).unwrap())
            .collect();
        let admin = b.client(&base, &b.admin).unwrap();
        // Work, then the kill at a random point in it.
        let until = Instant::now() + Duration::from_millis(20 + next() % 230);
        while Instant::now() < until {
            for m in meters.iter_mut() {
                let n = &nodes[m.node];
                let _ = n.heartbeat(&clients[m.node]);
                m.catch_up(n, &clients[m.node]);
            }
            if next() % 3 == 0 {
                tried += 1;
                if deposit(&admin, &format!("wire-{i}-{tried}")).is_ok() {
                    deposits += 1;
                }
            }
            std::thread::sleep(Duration::from_millis(next() % 20));
        }
        child.0.kill().unwrap();
        child.0.wait().unwrap();
        let (c, nb) = start(&config);
        child = Broker(c);
        base = nb;
        let auditor = b.client(&base, &b.auditor).unwrap();
        check(&auditor, &meters, deposits, tried);
        check_log(&auditor, &b, &meters, deposits, &b.dir);
    }
    let killed_for = started.elapsed();
    // No more kills: settlement catches up on every acknowledged window.
    let auditor = b.client(&base, &b.auditor).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let acked: u64 = meters.iter().map(|m| m.acked).sum();
    loop {
        let (settled, paid) = check(&auditor, &meters, deposits, tried);
        if settled >= acked {
            assert_eq!(paid, settled, "every settled window paid once");
            // The log and the ledger agree: every account's sums, replayed from the leaves
            // once the log caught up, are the broker's.
            let accounts = auditor.accounts().unwrap();
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let leaves = check_log(&auditor, &b, &meters, deposits, &b.dir);
                let mut replayed: std::collections::BTreeMap<String, (u128, u128)> =
                    Default::default();
                for l in leaves.iter().filter(|l| l["action"] == "ledger.transfer") {
                    for t in l["detail"]["transfers"].as_array().unwrap() {
                        if t["phase"] != "single" && t["phase"] != "post" {
                            continue;
                        }
                        let amount: u128 = t["amount"].as_str().unwrap().parse().unwrap();
                        replayed
                            .entry(t["debit"].as_str().unwrap().into())
                            .or_default()
                            .0 += amount;
                        replayed
                            .entry(t["credit"].as_str().unwrap().into())
                            .or_default()
                            .1 += amount;
                    }
                }
                let agree = accounts.iter().all(|a| {
                    let (d, c) = replayed.get(&a.account).copied().unwrap_or_default();
                    (d, c)
                        == (
                            u128::from(a.debits_posted.get()),
                            u128::from(a.credits_posted.get()),
                        )
                });
                if agree {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the log's ledger never agreed with the broker's accounts"
                );
                std::thread::sleep(Duration::from_millis(200));
            }
            println!(
                "{crashes} kills in {:.1} s; {acked} records acknowledged, {settled} windows settled ({paid} paid), {deposits} deposits: every invariant held after each restart",
                killed_for.as_secs_f64()
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "settlement did not catch up: {settled} of {acked}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(child);
    b.cleanup();
}
