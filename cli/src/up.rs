//! `cgx up`: the network on embedded defaults, no hardware needed — a broker, a KBS and several
//! simulated confidential VMs on loopback. The nodes register on composite evidence (one
//! contraindicated), a tenant's job is placed on the right node with a lease, the weights key is
//! released into that VM only through that lease, then the node stops and its job moves. Every
//! piece runs the production code path; only the evidence is simulated (its claims say so).

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cgx_age::Identity;
use cgx_attestation::{Verifier, VerifierConfig};
use cgx_broker::client::BrokerClient;
use cgx_devnet::broker::{BrokerServer, SimBrokerNode, broker_setup, offer};
use cgx_protocol::broker::JobSpec;
use cgx_protocol::weights::WeightsKey;

use crate::output::CliResult;

fn s(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Heartbeats every second from each node until told to stop (the host agents' job).
struct Beats {
    stop: Vec<Arc<AtomicBool>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Beats {
    fn start(nodes: &[Arc<SimBrokerNode>], client: &BrokerClient) -> Beats {
        let mut stop = Vec::new();
        let mut threads = Vec::new();
        for n in nodes {
            let flag = Arc::new(AtomicBool::new(false));
            let (n, c, f) = (n.clone(), client.with_token(None), flag.clone());
            threads.push(std::thread::spawn(move || {
                while !f.load(Ordering::SeqCst) {
                    let _ = n.heartbeat(&c);
                    std::thread::sleep(Duration::from_millis(1000));
                }
            }));
            stop.push(flag);
        }
        Beats { stop, threads }
    }

    fn stop_one(&self, i: usize) {
        if let Some(f) = self.stop.get(i) {
            f.store(true, Ordering::SeqCst);
        }
    }

    fn stop_all(self) {
        for f in &self.stop {
            f.store(true, Ordering::SeqCst);
        }
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// `cgx up`.
pub fn up() -> CliResult {
    let started = Instant::now();
    println!(
        "cgx up: a broker, a KBS and 4 simulated confidential VMs on loopback (evidence is simulated; claims say so)"
    );
    let mut debug_node =
        SimBrokerNode::generate(4, offer(4, "eu-west", cgx_protocol::money::Micros(900_000)))
            .map_err(s)?;
    debug_node.snp_policy |= 1 << 19;
    let nodes: Vec<Arc<SimBrokerNode>> = vec![
        Arc::new(
            SimBrokerNode::generate(
                8,
                offer(8, "eu-west", cgx_protocol::money::Micros(2_100_000)),
            )
            .map_err(s)?,
        ),
        Arc::new(
            SimBrokerNode::generate(
                4,
                offer(4, "eu-west", cgx_protocol::money::Micros(2_400_000)),
            )
            .map_err(s)?,
        ),
        Arc::new(
            SimBrokerNode::generate(
                2,
                offer(2, "us-east", cgx_protocol::money::Micros(1_200_000)),
            )
            .map_err(s)?,
        ),
        Arc::new(debug_node),
    ];
    let names = ["node-1", "node-2", "node-3", "node-4"];
    // Production trust refuses simulated evidence outright; the network pins the sim roots.
    let production = Verifier::new(VerifierConfig::default());
    let probe = nodes[0].sim.amd.bundle(&Default::default()).map_err(s)?;
    match production.verify(&probe.evidence(), time::OffsetDateTime::now_utc()) {
        Err(e) => println!(
            "[trust] production roots: simulated evidence refused as it must be ({})",
            e.code()
        ),
        Ok(_) => return Err("simulated evidence passed production trust".into()),
    }
    let sims: Vec<&cgx_kbs::sim::SimNode> = nodes.iter().map(|n| &n.sim).collect();
    let kbs_setup = cgx_devnet::setup(&sims, None).map_err(s)?;
    let mut broker_cfg = broker_setup(
        &kbs_setup,
        kbs_setup.pins.iter().map(hex::encode).collect(),
        None,
    )
    .map_err(s)?;
    // One-second heartbeats so the failover below shows in seconds (default: 5 s × 3).
    broker_cfg.config.heartbeat_secs = 1;
    broker_cfg.config.monitor_interval_ms = 200;
    let result = run(&nodes, &names, &kbs_setup, &broker_cfg);
    kbs_setup.cleanup();
    broker_cfg.cleanup();
    result?;
    println!(
        "ok: cgx up finished in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut d = [0u8; 32];
    d.copy_from_slice(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, bytes).as_ref());
    d
}

fn run(
    nodes: &[Arc<SimBrokerNode>],
    names: &[&str],
    kbs_setup: &cgx_devnet::Setup,
    b: &cgx_devnet::broker::BrokerSetup,
) -> Result<(), String> {
    let kbs = cgx_devnet::Server::start(&kbs_setup.config).map_err(s)?;
    let broker = BrokerServer::start(&b.config).map_err(s)?;
    println!("[kbs]    {} up (CoCo KBS protocol)", kbs.base);
    println!(
        "[broker] {} up (re-attestation every {} s, heartbeats every {} s, {} missed = gone)",
        broker.base, b.config.reattest_secs, b.config.heartbeat_secs, b.config.missed_heartbeats
    );
    let op = b.client(&broker.base, &b.operator).map_err(s)?;
    let name_of = |id: &str| {
        nodes
            .iter()
            .position(|n| n.id == id)
            .map_or(id.to_string(), |i| names[i].to_string())
    };
    for (n, name) in nodes.iter().zip(names) {
        let t = Instant::now();
        let r = n.register(&op).map_err(s)?;
        println!(
            "[node]   {name} {} registered in {:.0} ms: SNP report + {} GPU SPDM reports bound to the broker nonce, node key and KBS TEE key → {}{}",
            n.id,
            t.elapsed().as_secs_f64() * 1e3,
            n.offer.gpu_count,
            r.status.as_str().to_uppercase(),
            r.violations
                .first()
                .map(|v| format!(" ({v})"))
                .unwrap_or_default()
        );
    }
    let beats = Beats::start(nodes, &op);
    let auditor = b.client(&broker.base, &b.auditor).map_err(s)?;
    println!("[broker] cgx node ls:");
    for line in crate::broker::node_table(&auditor.nodes().map_err(s)?) {
        println!("           {line}");
    }
    // The tenant's weights: an age identity in the KBS, bound to the SHA-256 of the encrypted
    // file (`cgx weights encrypt --kbs` does this), released only with a lease.
    let path = "acme/weights/llama";
    let id = Identity::generate().map_err(s)?;
    let weights: Vec<u8> = (0..(4u32 << 20)).map(|i| (i % 251) as u8).collect();
    let encrypt = |plain: &[u8]| -> Result<Vec<u8>, String> {
        let mut file = Vec::new();
        cgx_age::encrypt(
            &id.recipient().map_err(s)?,
            &mut &plain[..],
            plain.len() as u64,
            &mut file,
            0,
            &mut |_| {},
        )
        .map_err(s)?;
        Ok(file)
    };
    let file = encrypt(&weights)?;
    let key = WeightsKey::new(&id.to_secret_string(), sha256(&file)).map_err(s)?;
    kbs.put_resource(&kbs_setup.admin, path, key.to_resource().as_bytes(), true)
        .map_err(s)?;
    println!(
        "[tenant] 4 MiB of weights age-encrypted; identity stored in the KBS at {path} (lease required), bound to the file's SHA-256"
    );
    let tenant = b.client(&broker.base, &b.tenant).map_err(s)?;
    let spec = JobSpec {
        tenant: None,
        gpu_model: "H100".into(),
        gpu_count: 4,
        min_gpu_memory_gib: 80,
        tee: vec![cgx_protocol::records::TeeKind::Snp],
        regions: vec!["eu-west".into()],
        max_price_per_gpu_hour_micros: cgx_protocol::money::Micros(3_000_000),
        duration_secs: 3600,
        budget_micros: cgx_protocol::money::Micros(12_000_000),
        resources: vec![path.into()],
        placement_policy: None,
        workload: None,
    };
    let t = Instant::now();
    let job = tenant.submit(&spec).map_err(s)?;
    let first = job.node_id.clone().ok_or("the job was not placed")?;
    println!(
        "[tenant] job {} (4 × H100, eu-west, ≤ 3.00/GPU-h) → {} on {} GPUs {:?} in {:.1} ms, lease {}",
        job.id,
        job.state.as_str().to_uppercase(),
        name_of(&first),
        job.gpus,
        t.elapsed().as_secs_f64() * 1e3,
        job.lease_id.as_deref().unwrap_or("-")
    );
    println!("         (node-4 is cheaper but contraindicated; node-3 is in us-east)");
    if first != nodes[0].id {
        return Err(format!("placed on {first}, expected node-1"));
    }
    // The node learns its lease from its heartbeat answer; its VM fetches the key with it.
    let grant = nodes[0]
        .heartbeat(&op.with_token(None))
        .map_err(s)?
        .leases
        .into_iter()
        .next()
        .ok_or("node-1's heartbeat carried no lease")?;
    let fetch = |n: &SimBrokerNode, lease: &str| -> Result<Vec<u8>, String> {
        let mut vm = n.kbs_client(&kbs.base).map_err(s)?;
        vm.attest(&n.sim).map_err(s)?;
        vm.resource(path, Some(lease)).map_err(s)
    };
    let secret = fetch(&nodes[0], &grant.token)?;
    let key = WeightsKey::parse(&secret).map_err(s)?;
    let identity = Identity::parse(key.identity()).map_err(s)?;
    // The guest agent's check: the recipient is public, so anyone can encrypt weights of their
    // own to it; only the file whose digest the tenant bound is opened.
    let forged = encrypt(b"someone else's weights")?;
    if sha256(&forged) == *key.sha256() {
        return Err("a re-encrypted file matched the bound digest".into());
    }
    println!(
        "[vm]     a file re-encrypted to the same recipient is refused: its SHA-256 is not the one the key binds"
    );
    if sha256(&file) != *key.sha256() {
        return Err("the tenant's file does not match its bound digest".into());
    }
    let mut plain = Vec::new();
    cgx_age::decrypt(
        &identity,
        &mut &file[..],
        file.len() as u64,
        &mut plain,
        0,
        &mut |_| {},
    )
    .map_err(s)?;
    if plain != weights {
        return Err("decrypted weights differ".into());
    }
    println!(
        "[kbs]    node-1's VM attested with the TEE key its registration bound: weights key released through the lease; weights decrypted and equal"
    );
    match fetch(&nodes[1], &grant.token) {
        Err(e) => println!("[kbs]    node-2's VM with node-1's lease: refused as it must be ({e})"),
        Ok(_) => return Err("another VM got the key with node-1's lease".into()),
    }
    // node-1 stops: no more heartbeats.
    beats.stop_one(0);
    let stopped = Instant::now();
    println!("[node]   node-1 stops (no more heartbeats)…");
    let moved = loop {
        let j = tenant.job(&job.id).map_err(s)?;
        if let Some(n) = &j.node_id
            && *n != first
            && j.state != cgx_protocol::broker::JobState::Pending
        {
            break j;
        }
        if stopped.elapsed() > Duration::from_secs(20) {
            return Err(format!("the job did not move: {} {}", j.state, j.reason));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let to = moved.node_id.clone().unwrap_or_default();
    for e in moved.events.iter().skip(3) {
        println!(
            "[broker] job {} {} → {}: {}",
            job.id,
            e.from.map_or("-", |f| f.as_str()),
            e.to,
            e.reason
        );
    }
    println!(
        "[broker] job moved to {} {:.1} s after node-1's last heartbeat (allowance {} × {} s)",
        name_of(&to),
        stopped.elapsed().as_secs_f64(),
        b.config.missed_heartbeats,
        b.config.heartbeat_secs
    );
    let idx = nodes
        .iter()
        .position(|n| n.id == to)
        .ok_or("moved to an unknown node")?;
    let grant = nodes[idx]
        .heartbeat(&op.with_token(None))
        .map_err(s)?
        .leases
        .into_iter()
        .find(|l| l.job_id == job.id)
        .ok_or("the new node's heartbeat carried no lease")?;
    fetch(&nodes[idx], &grant.token)?;
    println!(
        "[kbs]    {}'s VM fetched the weights key through its new lease",
        name_of(&to)
    );
    beats.stop_all();
    broker.stop();
    kbs.stop();
    Ok(())
}
