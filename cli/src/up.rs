//! `cgx up`: the network on embedded defaults, no hardware needed — a broker, a KBS and four
//! provider hosts on loopback. Each host runs the host agent's `sim` launcher: the real guest
//! agent (`cgx guest-agent run`, the program `cgx-guest-agent` is) as a process on a simulated
//! machine the host made, its collateral published as AMD's and NVIDIA's would be. The agents
//! register on composite evidence (one booted an image the reference values do not list), a
//! tenant's job is placed with a lease, the agent fetches the weights key through it, decrypts
//! the weights inside its VM and runs the job's workload, whose state reaches the broker; the
//! node proves its leased GPUs work and meters the lease window by window; then a host stops and
//! its job moves — to a node that cheats at its proof of work, is caught and loses the lease,
//! and the job runs again once the first host restarts its VM. Every piece runs the production code path; only the evidence
//! is simulated (its claims say so).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cgx_age::Identity;
use cgx_attestation::{Verifier, VerifierConfig};
use cgx_broker::client::BrokerClient;
use cgx_devnet::broker::{BrokerServer, OPERATOR, broker_setup};
use cgx_host_agent::config::{AgentConfig, SimConfig};
use cgx_host_agent::supervise::{Backoff, Report, supervise};
use cgx_kbs::sim::SimNode;
use cgx_protocol::broker::{JobSpec, JobState, JobView, Workload, WorkloadWeights};
use cgx_protocol::money::Micros;
use cgx_protocol::weights::WeightsKey;

use crate::output::CliResult;

fn s(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// A provider's host: what it offers, and its host agent's supervisor (a thread) once started.
struct Host {
    name: &'static str,
    region: &'static str,
    price: u64,
    machine: SimNode,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    log: PathBuf,
    uid_base: u32,
    /// A simulated node that cheats at the proof of work (skips this percentage of rows).
    cheat: Option<u32>,
}

impl Host {
    /// Start this host's agent: the sim launcher, kept running by the supervisor.
    fn start(
        &mut self,
        dir: &Path,
        broker: (&str, &str),
        kbs: &str,
        token: &Path,
    ) -> Result<(), String> {
        let machine = dir.join(format!("{}.machine.json", self.name));
        cgx_devnet::write_private(
            dir,
            &format!("{}.machine.json", self.name),
            &self.machine.to_json().map_err(s)?,
        )
        .map_err(s)?;
        let exe = std::env::current_exe().map_err(s)?;
        let agent = AgentConfig {
            broker: broker.0.into(),
            broker_key: broker.1.into(),
            kbs: kbs.into(),
            operator: OPERATOR.into(),
            region: self.region.into(),
            price_micros: self.price,
            token_file: token.to_path_buf(),
            ca: None,
        };
        let sim = SimConfig {
            guest_agent: vec![exe.display().to_string(), "guest-agent".into()],
            machine,
            gpus: self.machine.gpus.len(),
            store: dir.join("store"),
            work: dir.join(format!("{}.work", self.name)),
            // Four hosts on one OS: each agent's workload uids apart (when root).
            workload_uid: (cgx_guest_agent::reap::own_uid() == 0).then_some(self.uid_base),
        };
        let log = self.log.clone();
        self.stop.store(false, Ordering::SeqCst);
        let stop = self.stop.clone();
        let cheat = self.cheat;
        let report = Report {
            state_file: Some(dir.join(format!("{}.state.json", self.name))),
            launcher: "sim".into(),
            quiet: true,
        };
        self.thread = Some(std::thread::spawn(move || {
            let mut backoff = Backoff::new(500, 5_000);
            let _ = supervise(
                || {
                    let mut c = cgx_host_agent::launcher::sim_command(&agent, &sim)?;
                    if let Some(p) = cheat {
                        c.args(["--sim-cheat-pow", &p.to_string()]);
                    }
                    let f = std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(&log)
                        .map_err(s)?;
                    c.stderr(f);
                    Ok(c)
                },
                &mut backoff,
                &report,
                &stop,
                Duration::from_secs(5),
            );
        }));
        Ok(())
    }

    fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    fn log_line(&self, needle: &str) -> Option<String> {
        std::fs::read_to_string(&self.log)
            .ok()?
            .lines()
            .find(|l| l.contains(needle))
            .map(|l| l.trim_start_matches("cgx-guest-agent: ").to_string())
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `cgx up`.
pub fn up(keep: bool) -> CliResult {
    let started = Instant::now();
    println!(
        "cgx up: a broker, a KBS and 4 provider hosts on loopback, each running the host agent's sim launcher (evidence is simulated; claims say so)"
    );
    let now = cgx_devnet::now();
    let machine =
        |gpus: usize, measurement: [u8; 48]| SimNode::generate(gpus, measurement, now).map_err(s);
    // Four hosts; node-4 launched its VM with the SNP debug policy bit set (its memory is
    // readable by the host): contraindicated.
    let mut hosts = vec![
        (
            "node-1",
            "eu-west",
            2_100_000,
            machine(8, cgx_devnet::MEASUREMENT)?,
        ),
        (
            "node-2",
            "eu-west",
            2_400_000,
            machine(4, cgx_devnet::MEASUREMENT)?,
        ),
        (
            "node-3",
            "us-east",
            1_200_000,
            machine(2, cgx_devnet::MEASUREMENT)?,
        ),
        ("node-4", "eu-west", 900_000, {
            let mut m = machine(4, cgx_devnet::MEASUREMENT)?;
            m.policy |= 1 << 19;
            m
        }),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (name, region, price, machine))| Host {
        uid_base: cgx_guest_agent::DEFAULT_WORKLOAD_UID + 1_000 * i as u32,
        name,
        region,
        price,
        machine,
        stop: Arc::new(AtomicBool::new(false)),
        thread: None,
        log: PathBuf::new(),
        // node-2 skips a tenth of its proof's rows: the broker must catch it.
        cheat: (name == "node-2").then_some(10),
    })
    .collect::<Vec<_>>();
    // Production trust refuses simulated evidence outright; the network pins the sim roots.
    let production = Verifier::new(VerifierConfig::default());
    let probe = hosts[0]
        .machine
        .amd
        .bundle(&Default::default())
        .map_err(s)?;
    match production.verify(&probe.evidence(), time::OffsetDateTime::now_utc()) {
        Err(e) => println!(
            "[trust]  production roots: simulated evidence refused as it must be ({})",
            e.code()
        ),
        Ok(_) => return Err("simulated evidence passed production trust".into()),
    }
    // The KBS and the broker trust the four machines' roots, accept the image they booted, and
    // find each machine's CRL and OCSP answers in their collateral store.
    let machines: Vec<&SimNode> = hosts.iter().map(|h| &h.machine).collect();
    let kbs_setup = cgx_devnet::setup(&machines, None).map_err(s)?;
    let pins: Vec<String> = kbs_setup.pins.iter().map(hex::encode).collect();
    let mut broker_cfg = broker_setup(&kbs_setup, pins, None).map_err(s)?;
    // A witness cosigns the log's checkpoints; none is published without its cosignature.
    let witness = cgx_devnet::broker::WitnessServer::start(
        &broker_cfg.dir.join("witness"),
        &broker_cfg.log_vkey().map_err(s)?,
    )
    .map_err(s)?;
    broker_cfg.witnessed_by(&witness);
    // One-second heartbeats so the failover below shows in seconds (default: 5 s × 3).
    broker_cfg.config.heartbeat_secs = 1;
    broker_cfg.config.monitor_interval_ms = 200;
    let dir = cgx_devnet::temp_dir("up").map_err(s)?;
    // Workloads run under user ids of their own: they pass through this folder to theirs.
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711)).map_err(s)?;
    }
    let result = run(
        &mut hosts,
        &dir,
        &kbs_setup,
        &broker_cfg,
        &witness.vkey,
        keep,
    );
    drop(witness);
    for h in &mut hosts {
        h.stop();
    }
    kbs_setup.cleanup();
    broker_cfg.cleanup();
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    println!(
        "ok: cgx up finished in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

/// The web console's URL, and for each of the network's users a key file (0600) and the
/// command that answers the sign-in page's challenge with it.
fn console_lines(
    dir: &Path,
    base: &str,
    b: &cgx_devnet::broker::BrokerSetup,
) -> Result<(), String> {
    println!("[console] {base}/console/ — sign in as each user: open the page, then run");
    for (who, file, key) in [
        ("tenant acme", "tenant-acme.pk8", &b.tenant),
        ("tenant globex", "tenant-globex.pk8", &b.other_tenant),
        ("operators op1, op2", "operator.pk8", &b.operator),
        ("auditor", "auditor.pk8", &b.auditor),
    ] {
        let path = cgx_devnet::write_private(dir, file, &key.pkcs8).map_err(s)?;
        println!(
            "[console]   {who:<19} cgx console login --broker {base} --key {} --challenge <the page's>",
            path.display()
        );
    }
    Ok(())
}

/// `cgx up --keep`: serve until Ctrl-C.
fn serve_until_interrupted(base: &str) -> Result<(), String> {
    println!("[up]     serving; the console is at {base}/console/ — Ctrl-C stops the network");
    tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(s)?
        .block_on(tokio::signal::ctrl_c())
        .map_err(s)
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut d = [0u8; 32];
    d.copy_from_slice(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, bytes).as_ref());
    d
}

fn wait_for<T>(
    secs: u64,
    what: &str,
    mut f: impl FnMut() -> Result<Option<T>, String>,
) -> Result<T, String> {
    let t = Instant::now();
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        if t.elapsed() > Duration::from_secs(secs) {
            return Err(format!("timed out after {secs} s waiting for {what}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn job_in(
    tenant: &BrokerClient,
    id: &str,
    want: impl Fn(&JobView) -> bool,
) -> Result<Option<JobView>, String> {
    let j = tenant.job(id).map_err(s)?;
    if want(&j) {
        return Ok(Some(j));
    }
    if j.state.is_final() {
        return Err(format!("job {id} ended {}: {}", j.state, j.reason));
    }
    Ok(None)
}

fn run(
    hosts: &mut [Host],
    dir: &Path,
    kbs_setup: &cgx_devnet::Setup,
    b: &cgx_devnet::broker::BrokerSetup,
    witness: &str,
    keep: bool,
) -> Result<(), String> {
    let kbs = cgx_devnet::Server::start(&kbs_setup.config).map_err(s)?;
    // The broker's log records each checkpoint the KBS's log publishes (`log.anchor`).
    let mut broker_config = b.config.clone();
    if let Some(l) = broker_config.log.as_mut() {
        l.anchors = vec![cgx_service::logwriter::AnchorRef {
            vkey: kbs_setup.log_vkey().map_err(s)?,
            url: format!("{}/kbs/v0/log", kbs.base),
            ca: None,
            reader_key: Some(kbs_setup.dir.join(cgx_devnet::LOG_READER_KEY)),
        }];
    }
    let broker = BrokerServer::start(&broker_config).map_err(s)?;
    println!("[kbs]    {} up (CoCo KBS protocol)", kbs.base);
    println!(
        "[broker] {} up (re-attestation every {} s, heartbeats every {} s, {} missed = gone)",
        broker.base, b.config.reattest_secs, b.config.heartbeat_secs, b.config.missed_heartbeats
    );
    console_lines(dir, &broker.base, b)?;
    // The tenant's weights: an age identity in the KBS, bound to the SHA-256 of the encrypted
    // file (`cgx weights encrypt --kbs` does this), released only with a lease; the encrypted
    // file in the hosts' weights store.
    let path = "acme/weights/llama";
    let id = Identity::generate().map_err(s)?;
    let weights: Vec<u8> = (0..(4u32 << 20)).map(|i| (i % 251) as u8).collect();
    let mut file = Vec::new();
    cgx_age::encrypt(
        &id.recipient().map_err(s)?,
        &mut &weights[..],
        weights.len() as u64,
        &mut file,
        0,
        &mut |_| {},
    )
    .map_err(s)?;
    std::fs::create_dir_all(dir.join("store")).map_err(s)?;
    std::fs::write(dir.join("store/llama.age"), &file).map_err(s)?;
    let key = WeightsKey::new(&id.to_secret_string(), sha256(&file)).map_err(s)?;
    kbs.put_resource(&kbs_setup.admin, path, key.to_resource().as_bytes(), true)
        .map_err(s)?;
    println!(
        "[tenant] 4 MiB of weights age-encrypted into the hosts' store; identity in the KBS at {path} (lease required), bound to the file's SHA-256"
    );
    // The hosts start their agents with the operator's token.
    let token = cgx_devnet::write_private(
        dir,
        "operator.token",
        b.operator.api_token().map_err(s)?.as_bytes(),
    )
    .map_err(s)?;
    let t0 = Instant::now();
    for h in hosts.iter_mut() {
        h.log = dir.join(format!("{}.log", h.name));
        h.start(
            dir,
            (&broker.base, &kbs_setup.broker.public_b64),
            &kbs.base,
            &token,
        )?;
    }
    let auditor = b.client(&broker.base, &b.auditor).map_err(s)?;
    let nodes = wait_for(30, "4 nodes to register", || {
        let n = auditor.nodes().map_err(s)?;
        Ok((n.len() == 4).then_some(n))
    })?;
    println!(
        "[hosts]  4 guest agents registered {:.0} ms after their hosts started them (sim launcher → cgx guest-agent run → composite evidence → broker)",
        t0.elapsed().as_secs_f64() * 1e3
    );
    let offers: Vec<(&str, u64, &str)> =
        hosts.iter().map(|h| (h.region, h.price, h.name)).collect();
    let name_of = |id: &str, nodes: &[cgx_protocol::broker::NodeView]| {
        nodes
            .iter()
            .find(|n| n.id == id)
            .and_then(|n| {
                offers
                    .iter()
                    .find(|(r, p, _)| *r == n.region && *p == n.price_per_gpu_hour_micros.get())
            })
            .map_or(id.to_string(), |(_, _, name)| name.to_string())
    };
    let mut by_name: Vec<&cgx_protocol::broker::NodeView> = nodes.iter().collect();
    by_name.sort_by_key(|n| name_of(&n.id, &nodes));
    for n in by_name {
        println!(
            "[node]   {} {} registered: SNP report + {} GPU SPDM reports bound to the broker nonce, node key and KBS TEE key → {}{}",
            name_of(&n.id, &nodes),
            n.id,
            n.gpu_count,
            n.status.as_str().to_uppercase(),
            n.violations
                .first()
                .map(|v| format!(" ({v})"))
                .unwrap_or_default()
        );
    }
    println!("[broker] cgx node ls:");
    for line in crate::broker::node_table(&nodes) {
        println!("           {line}");
    }
    let tenant = b.client(&broker.base, &b.tenant).map_err(s)?;
    // The workload checks the weights it was handed inside the VM, then serves until its node
    // stops.
    let digest = hex::encode(sha256(&weights));
    let serve = format!(
        r#"test "$(sha256sum "$CGX_WEIGHTS" | cut -d' ' -f1)" = {digest} && exec sleep 600"#
    );
    let spec = |script: String, gpus: u32| JobSpec {
        tenant: None,
        gpu_model: "H100".into(),
        gpu_count: gpus,
        min_gpu_memory_gib: 80,
        tee: vec![cgx_protocol::records::TeeKind::Snp],
        regions: vec!["eu-west".into()],
        max_price_per_gpu_hour_micros: Micros(3_000_000),
        duration_secs: 3600,
        budget_micros: Micros(3_000_000 * u64::from(gpus)),
        resources: vec![path.into()],
        placement_policy: None,
        workload: Some(Workload {
            command: "/bin/sh".into(),
            args: vec!["-c".into(), script],
            weights: Some(WorkloadWeights {
                resource: path.into(),
                file: "llama.age".into(),
            }),
        }),
        offer: None,
    };
    let t = Instant::now();
    let job = tenant.submit(&spec(serve, 4)).map_err(s)?;
    let first = job.node_id.clone().ok_or("the job was not placed")?;
    println!(
        "[tenant] job {} (4 × H100, eu-west, ≤ 3.00/GPU-h, workload: check the weights' SHA-256, then serve) → {} on {} GPUs {:?} in {:.1} ms, lease {}",
        job.id,
        job.state.as_str().to_uppercase(),
        name_of(&first, &nodes),
        job.gpus,
        t.elapsed().as_secs_f64() * 1e3,
        job.lease_id.as_deref().unwrap_or("-")
    );
    println!("         (node-4 is cheaper but contraindicated; node-3 is in us-east)");
    if name_of(&first, &nodes) != "node-1" {
        return Err(format!("placed on {first}, expected node-1"));
    }
    let running = wait_for(30, "the job to run", || {
        job_in(&tenant, &job.id, |j| j.state == JobState::Running)
    })?;
    if let Some(line) = hosts[0].log_line("decrypted") {
        println!("[node-1] {line}");
    }
    println!(
        "[broker] job {} RUNNING {:.0} ms after submission: {}",
        job.id,
        t.elapsed().as_secs_f64() * 1e3,
        running.reason
    );
    // The node proves its leased GPUs work (a challenge per GPU, answered from its own loop,
    // judged by the broker off the request path) and meters the lease window by window.
    let proved = wait_for(30, "node-1's proofs of work to pass", || {
        let n = auditor.node(&first).map_err(s)?;
        if let Some(p) = n.proofs.iter().find(|p| p.state == "failed") {
            return Err(format!("node-1's proof failed: {}", p.reason));
        }
        let passed = n.proofs.iter().filter(|p| p.state == "passed").count();
        Ok((passed >= running.gpus.len()).then_some(n))
    })?;
    for line in crate::broker::proof_lines(&proved).iter().take(2) {
        println!(
            "[node-1] {}",
            line.trim_start_matches("proofs").trim_start()
        );
    }
    println!(
        "[broker] node-1 proved its {} leased GPUs: a challenge each (Philox int8 matrices bound to the lease, window and node key; their int32 product's rows committed in a Merkle tree; then {} rows opened where the broker's opening, drawn after the commitment, says, and 16 cells of each recomputed)",
        running.gpus.len(),
        b.config.pow.fixed.map_or(0, |f| f.k)
    );
    let metered = wait_for(30, "metering records", || {
        job_in(&tenant, &job.id, |j| j.metered_windows >= 2)
    })?;
    println!(
        "[broker] job {} metered: {} windows of {} s accepted, each a record signed by node-1's attested key and chained to the one before",
        job.id, metered.metered_windows, b.config.metering_window_secs
    );
    // The checkpoint published now, for the rollback the auditor is shown at the end.
    let early = wait_for(10, "a published checkpoint", || {
        Ok(auditor.log_file("checkpoint").ok())
    })?;
    // A second job whose workload finishes: completed, with the node's word for it.
    let short = tenant
        .submit(&spec(
            format!(r#"test "$(sha256sum "$CGX_WEIGHTS" | cut -d' ' -f1)" = {digest}"#),
            2,
        ))
        .map_err(s)?;
    let done = wait_for(30, "the second job to complete", || {
        let j = tenant.job(&short.id).map_err(s)?;
        Ok(j.state.is_final().then_some(j))
    })?;
    if done.state != JobState::Completed {
        return Err(format!("job {} {}: {}", done.id, done.state, done.reason));
    }
    println!(
        "[broker] job {} (2 GPUs, a workload that finishes) {}: {}",
        done.id,
        done.state.as_str().to_uppercase(),
        done.reason
    );
    // node-1's host stops: its agent stops the workload and falls silent.
    hosts[0].stop();
    let stopped = Instant::now();
    println!(
        "[host]   node-1's host agent stops its VM (SIGTERM: the workload stops, heartbeats end)…"
    );
    let moved = wait_for(30, "the job to move and run again", || {
        job_in(&tenant, &job.id, |j| {
            j.node_id.as_deref() != Some(first.as_str()) && j.state == JobState::Running
        })
    })?;
    for e in moved.events.iter().skip(3) {
        println!(
            "[broker] job {} {} → {}: {}",
            job.id,
            e.from.map_or("-", |f| f.as_str()),
            e.to,
            e.reason
        );
    }
    let to = moved.node_id.clone().unwrap_or_default();
    println!(
        "[broker] job running on {} {:.1} s after node-1 stopped (allowance {} × {} s): its agent fetched the weights key through its new lease and started the workload",
        name_of(&to, &nodes),
        stopped.elapsed().as_secs_f64(),
        b.config.missed_heartbeats,
        b.config.heartbeat_secs
    );
    // node-2 cheats: its proof skips a tenth of the product's rows. Caught, it loses the lease.
    let caught = wait_for(30, "node-2's cheat to be caught", || {
        let n = auditor.node(&to).map_err(s)?;
        Ok(n.proofs
            .iter()
            .find(|p| p.state == "failed")
            .cloned()
            .map(|p| (p, n)))
    })?;
    println!(
        "[broker] {} proof of work FAILED (it skips 10% of the rows): {}",
        name_of(&to, &nodes),
        caught.0.reason
    );
    let gone = wait_for(30, "the cheat's lease to end", || {
        job_in(&tenant, &job.id, |j| {
            j.node_id.as_deref() != Some(to.as_str()) || j.state == JobState::Pending
        })
    })?;
    let n = auditor.node(&to).map_err(s)?;
    println!(
        "[broker] {} NOT placeable: {}",
        name_of(&to, &nodes),
        n.reason
    );
    if let Some(e) = gone.events.iter().rev().find(|e| e.to == JobState::Pending) {
        println!("[broker] job {} → PENDING: {}", job.id, e.reason);
    }
    // node-1's host starts its VM again: a fresh registration, and the job runs there.
    hosts[0].start(
        dir,
        (&broker.base, &kbs_setup.broker.public_b64),
        &kbs.base,
        &token,
    )?;
    let back = wait_for(30, "the job to run again on an honest node", || {
        job_in(&tenant, &job.id, |j| {
            j.state == JobState::Running && j.node_id.as_deref() != Some(to.as_str())
        })
    })?;
    println!(
        "[broker] node-1's host restarted its VM; it registered anew and job {} RUNNING there again ({} placements in all)",
        job.id,
        back.events
            .iter()
            .filter(|e| e.to == JobState::Placed)
            .count()
    );
    wait_for(30, "node-1's new lease to be metered", || {
        job_in(&tenant, &job.id, |j| j.metered_windows >= 2)
    })?;
    // The tenant ends the job: its lease ends, and settlement closes every escrow — each
    // window paid from its record and proof, or refunded; what was left goes back.
    tenant.cancel(&job.id).map_err(s)?;
    let statement = wait_for(30, "every lease to be settled", || {
        let st = tenant
            .statement(Some(cgx_devnet::broker::TENANT_A), None, None, None)
            .map_err(s)?;
        Ok(st.leases.iter().all(|l| l.state == "closed").then_some(st))
    })?;
    // node-1 registered anew when its host restarted: name nodes from the registry now.
    let nodes = auditor.nodes().map_err(s)?;
    for l in &statement.leases {
        let refunded: Vec<&cgx_protocol::ledger::WindowLine> = l
            .windows
            .iter()
            .filter(|w| w.outcome == "refunded")
            .collect();
        println!(
            "[ledger] lease {} on {} (job {}): {} windows paid {} ({} to the provider, {} fee), {} refunded {}; escrow closed",
            l.lease,
            name_of(&l.node, &nodes),
            l.job,
            l.windows.iter().filter(|w| w.outcome == "paid").count(),
            l.paid,
            l.provider,
            l.fee,
            refunded.len(),
            l.refunded,
        );
        if let Some(w) = refunded.first() {
            println!(
                "[ledger]   window {} refunded (record {}…): {}",
                w.window,
                w.record.get(..12).unwrap_or(&w.record),
                w.reason
            );
        }
    }
    let slash_in = statement
        .lines
        .iter()
        .filter(|l| l.cause == "slash")
        .map(|l| l.credit.get())
        .sum::<u64>();
    let spent: u64 = statement.leases.iter().map(|l| l.paid.get()).sum();
    let acct = &statement.accounts[0];
    println!(
        "[ledger] tenant statement ({}): opening {}, paid {} for proven windows only, slash received {}, closing {}, held {} — {}",
        statement.owner,
        acct.opening_posted,
        Micros(spent),
        Micros(slash_in),
        acct.closing_posted,
        acct.closing_held,
        if statement.reconciled {
            "reconciled"
        } else {
            "NOT RECONCILED"
        }
    );
    let provider = b
        .client(&broker.base, &b.operator)
        .map_err(s)?
        .statement(None, Some(OPERATOR), None, None)
        .map_err(s)?;
    let earned: u64 = provider
        .lines
        .iter()
        .filter(|l| l.account.starts_with("provider/") && l.cause == "window")
        .map(|l| l.credit.get())
        .sum();
    let slashed: Vec<&cgx_protocol::ledger::StatementLine> = provider
        .lines
        .iter()
        .filter(|l| l.account.starts_with("stake/") && l.cause == "slash")
        .collect();
    println!(
        "[ledger] provider statement ({}): earned {} over {} paid windows; stake slashed {} for {} — {}",
        provider.owner,
        Micros(earned),
        provider
            .lines
            .iter()
            .filter(|l| l.account.starts_with("provider/") && l.cause == "window")
            .count(),
        Micros(slashed.iter().map(|l| l.debit.get()).sum()),
        slashed
            .iter()
            .map(|l| l.reference.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        if provider.reconciled {
            "reconciled"
        } else {
            "NOT RECONCILED"
        }
    );
    if !statement.reconciled || !provider.reconciled || slashed.is_empty() {
        return Err("the statements do not show the cheat slashed, or do not reconcile".into());
    }
    // The cheat's lease ran at least its first window (however soon it was caught), which its
    // failed proof covers: refunded, never paid.
    if !statement
        .leases
        .iter()
        .any(|l| l.node == to && l.windows.iter().any(|w| w.outcome == "refunded"))
    {
        return Err("the statement does not show node-2's failed window refunded".into());
    }
    // The audit trail as a transparency log: the auditor copies it and checks it offline
    // (`cgx audit fetch`, `cgx audit verify`) — the checkpoint under the log's key, every
    // leaf by its inclusion proof.
    let vkey = b.log_vkey().map_err(s)?;
    let copy = dir.join("log");
    let size = wait_for(30, "the log to checkpoint the run", || {
        // The integrator signs four times a second: a checkpoint past the statements' rows.
        Ok(crate::audit::fetch_log(&auditor, &copy)
            .ok()
            .filter(|n| *n > 0))
    })?;
    let v = cgx_tlog::verify::verify_dir(
        &copy,
        &cgx_tlog::verify::Trust {
            log: cgx_tlog::note::NoteKey::parse(&vkey).map_err(s)?,
            witnesses: vec![cgx_tlog::note::NoteKey::parse(witness).map_err(s)?],
            quorum: 1,
        },
        None,
    )
    .map_err(|e| format!("the run's log does not verify: {e}"))?;
    let actions: std::collections::BTreeMap<String, usize> =
        v.leaves.iter().fold(Default::default(), |mut m, leaf| {
            let action = serde_json::from_slice::<serde_json::Value>(leaf)
                .ok()
                .and_then(|j| j["action"].as_str().map(str::to_string))
                .unwrap_or_default();
            *m.entry(action).or_default() += 1;
            m
        });
    // What every decision rests on, from the leaves and the archive alone.
    let archive = dir.join("archive");
    let pieces = crate::audit::fetch_archive(&auditor, &copy, &archive)?;
    let report = cgx_audit::check(
        &v.leaves,
        cgx_audit::Rules {
            service: "cgx-broker",
            proofs: true,
            archive: Some(&archive),
        },
    );
    if let Some(x) = report.violations.first() {
        return Err(format!(
            "the auditor found {} violations in the run's log; the first: leaf {} ({}): {}",
            report.violations.len(),
            x.index,
            x.action,
            x.reason
        ));
    }
    println!(
        "[log]    {} leaves checkpointed by {}, cosigned by witness {}; fetched and verified offline (every leaf included): {}",
        size,
        cgx_devnet::broker::LOG_ORIGIN,
        witness.split('+').next().unwrap_or(witness),
        actions
            .iter()
            .map(|(a, n)| format!("{n} {a}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    // Every registration re-verified from the archive against the pinned roots and
    // re-appraised under the broker's reference values, at the time its leaf records.
    let refs = match &b.config.appraisal.reference_values {
        Some(p) => Some(std::fs::read_to_string(p).map_err(s)?),
        None => None,
    };
    let reappraiser = cgx_broker::server::reappraise::Reappraiser::new(
        None,
        refs.as_deref(),
        &b.config.sim_roots,
    )?;
    let (reappraised, wrong) = crate::audit::reappraise_all(&v.leaves, &archive, &reappraiser);
    if let Some(x) = wrong.first() {
        return Err(format!(
            "re-appraisal from the archive: leaf {} ({}): {}",
            x.index, x.action, x.reason
        ));
    }
    println!(
        "[audit]  {reappraised} registrations re-verified from the archive against the pinned roots and re-appraised at their recorded time: each as the broker judged it"
    );
    println!(
        "[audit]  {} registrations ({} archived pieces rehashed), {} leases, {} metering records signed by their nodes' attested keys, {} proofs judged, {} windows paid, each on its accepted record and its GPUs' passing proofs, {} transfers replayed and balanced: no violation",
        report.registrations,
        pieces,
        report.leases,
        report.records,
        report.verdicts,
        report.payments,
        report.transfers
    );
    // The verdict, recorded with the broker (an `audit.verdict` leaf the console shows).
    auditor
        .log_verdict(&cgx_protocol::broker::LogVerdict {
            origin: v.opened.checkpoint.origin().to_string(),
            size: v.size.to_string(),
            root: v.root.to_string(),
            violations: 0,
            checks: vec!["archive".into(), "reappraise".into(), "proofs".into()],
        })
        .map_err(|e| format!("recording the verdict: {e}"))?;
    println!("[audit]  verdict recorded with the broker: the console's log page shows it");
    tampering(dir, &copy, &v, b, witness, &early)?;
    kbs_log(dir, &kbs.base, kbs_setup, &v, b, witness)?;
    if keep {
        serve_until_interrupted(&broker.base)?;
    }
    for h in hosts.iter_mut() {
        h.stop();
    }
    broker.stop();
    kbs.stop();
    Ok(())
}

/// The KBS's own log: fetched (entries with an administrator's token), verified under its
/// key, every release checked against the broker's log; then a release forged into a copy
/// (the KBS's key re-signing it) is caught by that cross-check.
fn kbs_log(
    dir: &Path,
    base: &str,
    kbs_setup: &cgx_devnet::Setup,
    broker: &cgx_tlog::verify::Verified,
    b: &cgx_devnet::broker::BrokerSetup,
    witness: &str,
) -> Result<(), String> {
    let token = kbs_setup
        .admin
        .token_at(cgx_service::auth::BearerKind::KbsAdmin, cgx_devnet::now())
        .map_err(s)?;
    let agent = cgx_kbs::client::agent(None).map_err(s)?;
    let copy = dir.join("kbs-log");
    let vkey = kbs_setup.log_vkey().map_err(s)?;
    let trust = cgx_tlog::verify::Trust {
        log: cgx_tlog::note::NoteKey::parse(&vkey).map_err(s)?,
        witnesses: Vec::new(),
        quorum: 0,
    };
    // The integrator signs four times a second: wait for a checkpoint holding the releases.
    let v = wait_for(30, "the KBS log to checkpoint the run's releases", || {
        if crate::audit::fetch_kbs_log(&agent, base, &token, &copy).is_err() {
            return Ok(None);
        }
        let v = cgx_tlog::verify::verify_dir(&copy, &trust, None)
            .map_err(|e| format!("the KBS's log does not verify: {e}"))?;
        let released = v.leaves.iter().any(|l| {
            serde_json::from_slice::<serde_json::Value>(l).is_ok_and(|j| j["action"] == "release")
        });
        Ok(released.then_some(v))
    })?;
    let mut violations = cgx_audit::check(
        &v.leaves,
        cgx_audit::Rules {
            service: "cgx-kbs",
            proofs: true,
            archive: None,
        },
    )
    .violations;
    violations.extend(cgx_audit::check_releases(&v.leaves, &broker.leaves));
    violations.extend(cgx_audit::check_anchors(
        &broker.leaves,
        cgx_devnet::KBS_LOG_ORIGIN,
        &v.leaves,
    ));
    if let Some(x) = violations.first() {
        return Err(format!(
            "the KBS's log: leaf {} ({}): {}",
            x.index, x.action, x.reason
        ));
    }
    let count = |a: &str| {
        v.leaves
            .iter()
            .filter(|l| {
                serde_json::from_slice::<serde_json::Value>(l).is_ok_and(|j| j["action"] == a)
            })
            .count()
    };
    let anchors = broker
        .leaves
        .iter()
        .filter(|l| {
            serde_json::from_slice::<serde_json::Value>(l)
                .is_ok_and(|j| j["action"] == "log.anchor")
        })
        .count();
    println!(
        "[kbs]    its own log {}: {} leaves, verified offline; {} releases, each under a live lease the broker opened on an affirming node, to the TEE key that node attested; {} refusals logged; each of the {} KBS checkpoints the broker's log anchored is a prefix of it",
        cgx_devnet::KBS_LOG_ORIGIN,
        v.size,
        count("release"),
        count("release.refused"),
        anchors
    );
    // The same, as an auditor runs it: `cgx audit verify` over the broker's log (its witness,
    // its archive re-appraised) and the KBS's.
    let code = crate::audit::verify(
        &dir.join("log"),
        &crate::audit::VerifyArgs {
            log_key: b.log_vkey().map_err(s)?,
            witnesses: vec![witness.to_string()],
            quorum: 1,
            archive: Some(dir.join("archive")),
            reappraise: true,
            refs: b.config.appraisal.reference_values.clone(),
            sim_roots: b.config.sim_roots.clone(),
            kbs_log: Some(copy.clone()),
            kbs_log_key: Some(vkey.clone()),
            ..Default::default()
        },
    )?;
    if code != std::process::ExitCode::SUCCESS {
        return Err("cgx audit verify found violations in the run's logs".into());
    }
    // A forged release: the weights' key to a TEE key no node attested, under a lease the
    // broker never opened, appended and the KBS's log re-signed with its own key.
    let key = cgx_tlog::note::NoteSigner::from_pkcs8(
        cgx_devnet::KBS_LOG_ORIGIN,
        cgx_tlog::note::KeyKind::Ed25519,
        &std::fs::read(kbs_setup.dir.join("kbs-log.pk8")).map_err(s)?,
    )
    .map_err(s)?;
    let last: serde_json::Value = v
        .leaves
        .iter()
        .rev()
        .find_map(|l| {
            serde_json::from_slice::<serde_json::Value>(l)
                .ok()
                .filter(|j| j["action"] == "release")
        })
        .ok_or("no release")?;
    let mut forged = last.clone();
    forged["seq"] = serde_json::json!(
        serde_json::from_slice::<serde_json::Value>(v.leaves.last().ok_or("empty")?)
            .map_err(s)?["seq"]
            .as_i64()
            .unwrap_or(0)
            + 1
    );
    forged["detail"]["tee_key"] = serde_json::json!("forged-tee-key");
    forged["detail"]["lease"] = serde_json::json!("lforged");
    let mut leaves = v.leaves.clone();
    leaves.push(cgx_protocol::jcs::canonical(&forged).into_bytes());
    let d = dir.join("kbs-forged");
    resigned(&d, &leaves, &key)?;
    let forged_v = cgx_tlog::verify::verify_dir(&d, &trust, None).map_err(s)?;
    match cgx_audit::check_releases(&forged_v.leaves, &broker.leaves).first() {
        Some(x) => println!(
            "[tamper] a release of {} forged into the KBS's log and re-signed with its key: caught — leaf {} ({}): {}",
            last["subject"].as_str().unwrap_or(""),
            x.index,
            x.action,
            x.reason
        ),
        None => return Err("a forged release was not caught".into()),
    }
    // The KBS's log rewritten without its first release (re-signed with its key): the
    // checkpoints the broker anchored no longer match it.
    let first = v
        .leaves
        .iter()
        .position(|l| {
            serde_json::from_slice::<serde_json::Value>(l).is_ok_and(|j| j["action"] == "release")
        })
        .ok_or("no release")?;
    let mut rewritten = v.leaves.clone();
    rewritten.remove(first);
    match cgx_audit::check_anchors(&broker.leaves, cgx_devnet::KBS_LOG_ORIGIN, &rewritten).first() {
        Some(x) => println!(
            "[tamper] the KBS's log rewritten without its release at leaf {first}: caught by the broker's anchors — leaf {} ({}): {}",
            x.index, x.action, x.reason
        ),
        None => {
            return Err(
                "a rewritten KBS log was not caught by the broker's anchors (none covered the release)"
                    .into(),
            );
        }
    }
    Ok(())
}

/// The auditor against a log tampered with, four ways, on copies of the run's log: each is
/// caught, with its reason. `genuine` is what the auditor verified (its state from now on),
/// `early` a checkpoint the broker published earlier in the run.
fn tampering(
    dir: &Path,
    copy: &Path,
    genuine: &cgx_tlog::verify::Verified,
    b: &cgx_devnet::broker::BrokerSetup,
    witness: &str,
    early: &[u8],
) -> Result<(), String> {
    use cgx_tlog::verify::{Trust, verify_dir};
    let trust = Trust {
        log: cgx_tlog::note::NoteKey::parse(&b.log_vkey().map_err(s)?).map_err(s)?,
        witnesses: vec![cgx_tlog::note::NoteKey::parse(witness).map_err(s)?],
        quorum: 1,
    };
    // The log's own key, as an operator who holds it and rewrites the log would use it.
    let key = cgx_tlog::note::NoteSigner::from_pkcs8(
        cgx_devnet::broker::LOG_ORIGIN,
        cgx_tlog::note::KeyKind::Ed25519,
        &std::fs::read(b.dir.join("log.pk8")).map_err(s)?,
    )
    .map_err(s)?;
    let leaf = |i: usize| -> serde_json::Value {
        serde_json::from_slice(&genuine.leaves[i]).unwrap_or_default()
    };
    let find = |action: &str| -> Result<usize, String> {
        (0..genuine.leaves.len())
            .rev()
            .find(|&i| leaf(i)["action"] == action)
            .ok_or_else(|| format!("the run logged no {action}"))
    };
    // A log rewritten from `leaves` and signed with the log's key (no witness cosigns it).
    let rewrite = |name: &str, leaves: &[Vec<u8>]| -> Result<std::path::PathBuf, String> {
        let d = dir.join(name);
        resigned(&d, leaves, &key)?;
        Ok(d)
    };
    // Each tampered copy: what the auditor says (its state is the genuine checkpoint), and
    // what the cross-checks say of the leaves had the witness been bypassed.
    let caught = |what: &str, d: &Path| -> Result<(), String> {
        let log = match verify_dir(d, &trust, Some(&genuine.note)) {
            Ok(_) => return Err(format!("tampering not caught: {what}")),
            Err(e) => e.to_string(),
        };
        let bypassed = Trust {
            witnesses: Vec::new(),
            quorum: 0,
            ..trust.clone()
        };
        let cross = match verify_dir(d, &bypassed, None) {
            Ok(v) => cgx_audit::check(
                &v.leaves,
                cgx_audit::Rules {
                    service: "cgx-broker",
                    proofs: true,
                    archive: None,
                },
            )
            .violations
            .first()
            .map(|x| format!("leaf {} ({}): {}", x.index, x.action, x.reason)),
            Err(_) => None,
        };
        println!(
            "[tamper] {what}: caught — {log}{}",
            match cross {
                Some(c) => format!("; and without the witness, the leaves themselves: {c}"),
                None => String::new(),
            }
        );
        Ok(())
    };

    // 1. A dropped leaf: an accepted metering record a payment rests on removed, the log
    // re-signed.
    let paid_on: std::collections::HashSet<String> = (0..genuine.leaves.len())
        .flat_map(|i| {
            leaf(i)["detail"]["transfers"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter(|t| t["cause"] == "window")
        .filter_map(|t| t["reference"].as_str().map(str::to_string))
        .collect();
    let i = (0..genuine.leaves.len())
        .find(|&i| {
            let l = leaf(i);
            l["action"] == "metering.accept"
                && l["detail"]["hash"]
                    .as_str()
                    .is_some_and(|h| paid_on.contains(h))
        })
        .map_or_else(|| find("metering.accept"), Ok)?;
    let mut leaves = genuine.leaves.clone();
    leaves.remove(i);
    let d = rewrite("dropped", &leaves)?;
    caught(
        &format!("leaf {i} (metering.accept) dropped and the log re-signed"),
        &d,
    )?;

    // 2. An edited payment: a window's amount changed in the entry bundle.
    let i = (0..genuine.leaves.len())
        .rev()
        .find(|&i| {
            leaf(i)["detail"]["transfers"]
                .as_array()
                .is_some_and(|t| t.iter().any(|t| t["cause"] == "window"))
        })
        .ok_or("the run paid no window")?;
    let d = dir.join("edited");
    copy_dir(copy, &d)?;
    let n = i as u64 / cgx_tlog::TILE_WIDTH;
    let width = (genuine.size - n * cgx_tlog::TILE_WIDTH).min(cgx_tlog::TILE_WIDTH);
    let bundle = d.join(cgx_tlog::paths::tile_path(&cgx_tlog::paths::bundle_tile(
        n,
        u32::try_from(width).map_err(s)?,
    )));
    let bytes = std::fs::read(&bundle).map_err(s)?;
    let old = String::from_utf8_lossy(&genuine.leaves[i]).into_owned();
    let amount = leaf(i)["detail"]["transfers"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["cause"] == "window"))
        .and_then(|t| t["amount"].as_str().map(str::to_string))
        .ok_or("no amount")?;
    // Same length, another amount: the bundle's framing still holds.
    let forged_amount: String = amount
        .chars()
        .map(|c| if c == '9' { '8' } else { '9' })
        .collect();
    let new = old.replacen(
        &format!("\"amount\":\"{amount}\""),
        &format!("\"amount\":\"{forged_amount}\""),
        1,
    );
    let pos = bytes
        .windows(old.len())
        .position(|w| w == old.as_bytes())
        .ok_or("the leaf is not in its bundle")?;
    let mut edited = bytes.clone();
    edited[pos..pos + old.len()].copy_from_slice(new.as_bytes());
    std::fs::write(&bundle, &edited).map_err(s)?;
    caught(
        &format!("leaf {i}'s window payment edited from {amount} to {forged_amount}"),
        &d,
    )?;

    // 3. A forged payment: a window nobody metered paid to the provider, the log re-signed.
    let pay = leaf(i);
    let t = pay["detail"]["transfers"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["cause"] == "window"))
        .cloned()
        .ok_or("no payment")?;
    let mut forged = t.clone();
    forged["id"] = serde_json::json!(format!("{}-forged", t["id"].as_str().unwrap_or("")));
    forged["window"] = serde_json::json!("999999");
    forged["phase"] = serde_json::json!("single");
    forged["pending"] = serde_json::Value::Null;
    let mut forged_leaf = pay.clone();
    forged_leaf["seq"] =
        serde_json::json!(leaf(genuine.leaves.len() - 1)["seq"].as_i64().unwrap_or(0) + 1);
    forged_leaf["subject"] = forged["id"].clone();
    forged_leaf["detail"] = serde_json::json!({"transfers": [forged]});
    let mut leaves = genuine.leaves.clone();
    leaves.push(cgx_protocol::jcs::canonical(&forged_leaf).into_bytes());
    let d = rewrite("forged", &leaves)?;
    caught(
        "a payment for window 999999, never metered, appended and the log re-signed",
        &d,
    )?;

    // 4. A rolled-back checkpoint: one the broker published earlier, served after the auditor
    // saw the later one.
    let d = dir.join("rolled");
    copy_dir(copy, &d)?;
    std::fs::write(d.join("checkpoint"), early).map_err(s)?;
    caught("the checkpoint rolled back to one published earlier", &d)?;
    Ok(())
}

/// `leaves` published in `d` (replaced) as a log signed with `key`: what an operator holding the
/// log's key could publish after rewriting it (no witness cosigns it).
fn resigned(d: &Path, leaves: &[Vec<u8>], key: &cgx_tlog::note::NoteSigner) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(d);
    let mut tree = cgx_tlog::tree::MemoryTree::new();
    for l in leaves {
        tree.append(l).map_err(s)?;
    }
    let cp = cgx_tlog::Checkpoint::new(key.name(), tree.size(), tree.root().map_err(s)?, "")
        .map_err(s)?;
    let note = cgx_tlog::note::sign_checkpoint(&cp, key).map_err(s)?;
    cgx_tlog::dir::publish(d, &tree, 0, &note).map_err(s)?;
    Ok(())
}

/// A copy of the log directory `from` at `to` (replaced), to tamper with.
fn copy_dir(from: &Path, to: &Path) -> Result<(), String> {
    let _ = std::fs::remove_dir_all(to);
    let status = std::process::Command::new("cp")
        .arg("-r")
        .arg(from)
        .arg(to)
        .status()
        .map_err(s)?;
    if !status.success() {
        return Err("cp -r failed".into());
    }
    Ok(())
}
