#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! `cgx-guest-agent run` as a real process against a broker and a KBS on loopback, on a
//! simulated machine its "host" made (the machine file, its collateral in the broker's store,
//! as a host agent's sim launcher does): the node registers on composite evidence, learns its
//! lease, fetches and decrypts the job's weights through the lease, runs the workload and
//! reports it; failures are reported with their reason; a broker restart, a killed agent and
//! SIGTERM each end as they should.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cgx_age::Identity;
use cgx_devnet::broker::{BrokerServer, BrokerSetup, OPERATOR, TENANT_A, broker_setup};
use cgx_protocol::broker::{JobSpec, JobState, JobView, Workload, WorkloadWeights};
use cgx_protocol::money::Micros;
use cgx_protocol::weights::WeightsKey;

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut d = [0u8; 32];
    d.copy_from_slice(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, bytes).as_ref());
    d
}

#[cfg(unix)]
fn private(p: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// A KBS and a broker trusting `machines`, the weights of tenant A in the KBS and the store.
struct Net {
    kbs_setup: cgx_devnet::Setup,
    broker_setup: BrokerSetup,
    kbs: cgx_devnet::Server,
    broker: Option<BrokerServer>,
    dir: PathBuf,
    machines: Vec<PathBuf>,
    /// The agents' first workload uid when root (agent i: this + 100 i); tests run side by
    /// side, and an agent clears its uids of what an earlier agent left.
    uid_base: u32,
}

const PLAIN: &[u8] = b"the tenant's weights";

impl Net {
    fn new(name: &str, gpus: &[usize], heartbeat_secs: i64, uid_base: u32) -> Net {
        let sims: Vec<cgx_kbs::sim::SimNode> =
            gpus.iter().map(|g| cgx_devnet::node(*g).unwrap()).collect();
        let refs: Vec<&cgx_kbs::sim::SimNode> = sims.iter().collect();
        let kbs_setup = cgx_devnet::setup(&refs, None).unwrap();
        let pins = kbs_setup.pins.iter().map(hex::encode).collect();
        let mut broker_setup = broker_setup(&kbs_setup, pins, None).unwrap();
        broker_setup.config.heartbeat_secs = heartbeat_secs;
        broker_setup.config.monitor_interval_ms = 100;
        let kbs = cgx_devnet::Server::start(&kbs_setup.config).unwrap();
        let broker = BrokerServer::start(&broker_setup.config).unwrap();
        let dir = cgx_devnet::temp_dir(name).unwrap();
        // The workloads run under user ids of their own (the agent runs as root here, or as
        // its user): they pass through this folder to their lease's.
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711)).unwrap();
        }
        // The machines, as their host's launcher hands them to the guest.
        let machines = sims
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let p = dir.join(format!("machine{i}.json"));
                std::fs::write(&p, s.to_json().unwrap()).unwrap();
                #[cfg(unix)]
                private(&p);
                p
            })
            .collect();
        // The tenant's weights: encrypted into the node's store, the key in the KBS (a job
        // resource: released only with a lease), bound to the age file's digest.
        std::fs::create_dir_all(dir.join("store")).unwrap();
        let id = Identity::generate().unwrap();
        let mut file = Vec::new();
        cgx_age::encrypt(
            &id.recipient().unwrap(),
            &mut &PLAIN[..],
            PLAIN.len() as u64,
            &mut file,
            1,
            &mut |_| {},
        )
        .unwrap();
        std::fs::write(dir.join("store/llama.age"), &file).unwrap();
        // Another file under the same recipient: not the file the key binds.
        let mut other = Vec::new();
        cgx_age::encrypt(
            &id.recipient().unwrap(),
            &mut &b"someone else's weights"[..],
            22,
            &mut other,
            1,
            &mut |_| {},
        )
        .unwrap();
        std::fs::write(dir.join("store/swapped.age"), &other).unwrap();
        let bound = WeightsKey::new(&id.to_secret_string(), sha256(&file)).unwrap();
        let token = kbs_setup.admin.admin_token().unwrap();
        let resp = ureq::post(&format!(
            "{}/kbs/v0/resource/{TENANT_A}/weights/llama?lease=required",
            kbs.base
        ))
        .header("authorization", &format!("Bearer {token}"))
        .send(bound.to_resource().as_bytes())
        .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        Net {
            kbs_setup,
            broker_setup,
            kbs,
            broker: Some(broker),
            dir,
            machines,
            uid_base,
        }
    }

    fn broker(&self) -> &BrokerServer {
        self.broker.as_ref().unwrap()
    }

    fn tenant(&self) -> cgx_broker::client::BrokerClient {
        self.broker_setup
            .client(&self.broker().base, &self.broker_setup.tenant)
            .unwrap()
    }

    fn auditor(&self) -> cgx_broker::client::BrokerClient {
        self.broker_setup
            .client(&self.broker().base, &self.broker_setup.auditor)
            .unwrap()
    }

    /// Start the agent on machine `i` at `price` micros.
    fn agent(&self, i: usize, price: u64) -> Agent {
        let token = self.dir.join(format!("op{i}.token"));
        std::fs::write(&token, self.broker_setup.operator.api_token().unwrap()).unwrap();
        #[cfg(unix)]
        private(&token);
        let work = self.dir.join(format!("work{i}"));
        let log = self.dir.join(format!("agent{i}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_cgx-guest-agent"))
            .args([
                "run",
                "--broker",
                &self.broker().base,
                "--kbs",
                &self.kbs.base,
            ])
            .args(["--broker-key", &self.kbs_setup.broker.public_b64])
            .args([
                "--workload-uid",
                &(self.uid_base + 100 * i as u32).to_string(),
            ])
            .arg("--token-file")
            .arg(&token)
            .args(["--operator", OPERATOR, "--region", "eu-west"])
            .args(["--price-micros", &price.to_string()])
            .arg("--store")
            .arg(self.dir.join("store"))
            .arg("--work")
            .arg(&work)
            .arg("--sim-machine")
            .arg(&self.machines[i])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Agent { child, log, work }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // A killed agent leaves its workload behind (the next agent on that VM clears it).
        for uid in self.uid_base..self.uid_base + 200 {
            cgx_guest_agent::reap::kill_uid(uid);
        }
        if let Some(b) = self.broker.take() {
            b.stop();
        }
        self.kbs_setup.cleanup();
        self.broker_setup.cleanup();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

struct Agent {
    child: Child,
    log: PathBuf,
    work: PathBuf,
}

impl Agent {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok);
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Wait up to `secs` for `f` to give something.
fn wait<T>(secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t.elapsed() < Duration::from_secs(secs), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn job(workload: Workload) -> JobSpec {
    JobSpec {
        tenant: None,
        gpu_model: "H100".into(),
        gpu_count: 1,
        min_gpu_memory_gib: 40,
        tee: vec![],
        regions: vec![],
        max_price_per_gpu_hour_micros: Micros(4_000_000),
        duration_secs: 3600,
        budget_micros: Micros(4_000_000),
        resources: vec![format!("{TENANT_A}/weights/llama")],
        placement_policy: None,
        workload: Some(workload),
        offer: None,
    }
}

fn sh(script: &str, weights: Option<&str>) -> Workload {
    Workload {
        command: "/bin/sh".into(),
        args: vec!["-c".into(), script.into()],
        weights: weights.map(|f| WorkloadWeights {
            resource: format!("{TENANT_A}/weights/llama"),
            file: f.into(),
        }),
    }
}

fn final_state(net: &Net, id: &str, secs: u64) -> JobView {
    let tenant = net.tenant();
    wait(secs, "the job to end", || {
        tenant.job(id).ok().filter(|j| j.state.is_final())
    })
}

fn placeable(net: &Net, n: usize) {
    let auditor = net.auditor();
    let t = Instant::now();
    while auditor
        .nodes()
        .map_or(0, |v| v.iter().filter(|n| n.placeable).count())
        < n
    {
        if t.elapsed() > Duration::from_secs(20) {
            let logs: String = (0..net.machines.len())
                .map(|i| {
                    std::fs::read_to_string(net.dir.join(format!("agent{i}.log")))
                        .unwrap_or_default()
                })
                .collect();
            panic!("timed out: the nodes to register\n{logs}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_node_registers_runs_its_workload_on_decrypted_weights_and_reports_it() {
    let net = Net::new("agent-run", &[1], 1, 530_000);
    let t0 = Instant::now();
    let agent = net.agent(0, 1_000_000);
    placeable(&net, 1);
    let placeable_after = t0.elapsed();
    // The workload reads the weights the agent decrypted inside the VM, sees its lease, and
    // exits 0.
    let ok = net
        .tenant()
        .submit(&job(sh(
            r#"test "$(cat "$CGX_WEIGHTS")" = "the tenant's weights" && test -n "$CGX_LEASE" && test "$CGX_GPUS" = 0 && test "$PWD" = "$(dirname "$CGX_WEIGHTS")""#,
            Some("llama.age"),
        )))
        .unwrap();
    let done = final_state(&net, &ok.id, 30);
    assert_eq!(
        done.state,
        JobState::Completed,
        "{}\n{}",
        done.reason,
        agent.log()
    );
    let states: Vec<JobState> = done.events.iter().map(|e| e.to).collect();
    assert_eq!(
        states,
        [
            JobState::Pending,
            JobState::Placed,
            JobState::Running,
            JobState::Completed
        ]
    );
    assert!(
        done.reason.contains("exited with status 0"),
        "{}",
        done.reason
    );
    let log = agent.log();
    assert!(
        log.contains("registered as") && log.contains("affirming"),
        "{log}"
    );
    assert!(
        log.contains(&format!("decrypted {} bytes", PLAIN.len())),
        "{log}"
    );
    // The plaintext is gone with the lease.
    let lease = done.lease_id.clone().unwrap();
    assert!(!agent.work.join(&lease).exists());
    // A workload that dies is reported, with its status.
    let dies = net.tenant().submit(&job(sh("exit 3", None))).unwrap();
    let failed = final_state(&net, &dies.id, 30);
    assert_eq!(failed.state, JobState::Failed);
    assert!(
        failed.reason.contains("exited with status 3"),
        "{}",
        failed.reason
    );
    // Weights that are not the file the key binds never reach the workload.
    let swapped = net
        .tenant()
        .submit(&job(sh("exit 0", Some("swapped.age"))))
        .unwrap();
    let refused = final_state(&net, &swapped.id, 30);
    assert_eq!(refused.state, JobState::Failed);
    assert!(
        refused.reason.contains("digest mismatch"),
        "{}",
        refused.reason
    );
    // A command the image does not have.
    let missing = net
        .tenant()
        .submit(&job(Workload {
            command: "/no/such/program".into(),
            args: vec![],
            weights: None,
        }))
        .unwrap();
    let refused = final_state(&net, &missing.id, 30);
    assert_eq!(refused.state, JobState::Failed);
    assert!(
        refused.reason.contains("/no/such/program"),
        "{}",
        refused.reason
    );
    // The workload runs under a user id of its own: the operator's token, which the agent reads,
    // is not its to read (when the agent is root and can change user); its output stays in
    // the VM, never on the agent's (the host's console).
    let root = cgx_guest_agent::reap::own_uid() == 0;
    let token = net.dir.join("op0.token");
    let prying = net
        .tenant()
        .submit(&job(sh(
            &format!(
                "echo tenant-output-7f3; id -u; cat {} >/dev/null 2>&1 && exit 9; exit 0",
                token.display()
            ),
            None,
        )))
        .unwrap();
    let pried = final_state(&net, &prying.id, 30);
    if root {
        assert_eq!(pried.state, JobState::Completed, "{}", pried.reason);
    }
    assert!(
        !agent.log().contains("tenant-output-7f3"),
        "{}",
        agent.log()
    );
    // SIGTERM with a workload running: the agent stops it (every process of its uid) and
    // removes its folder, then exits cleanly.
    let long = net
        .tenant()
        .submit(&job(sh("exec sleep 120", None)))
        .unwrap();
    let running = wait(20, "the long job to run", || {
        net.tenant()
            .job(&long.id)
            .ok()
            .filter(|v| v.state == JobState::Running)
    });
    let lease_dir = agent.work.join(running.lease_id.clone().unwrap());
    assert!(lease_dir.join("output.log").exists());
    let mut agent = agent;
    let term = Instant::now();
    agent.signal("-TERM");
    let status = wait(10, "the agent to exit", || agent.child.try_wait().unwrap());
    assert!(status.success(), "{status:?}\n{}", agent.log());
    assert!(
        !lease_dir.exists(),
        "the workload's folder outlived the agent"
    );
    if root {
        for uid in 530_000..530_064 {
            assert!(
                cgx_guest_agent::reap::pids_of_uid(uid).is_empty(),
                "a process of workload uid {uid} outlived the agent"
            );
        }
    }
    println!(
        "guest agent (sim machine): placeable {placeable_after:?} after start; stopped {:?} after SIGTERM",
        term.elapsed()
    );
}

#[test]
fn a_broker_restart_and_a_cancelled_lease_and_a_killed_agent() {
    // Heartbeats every second: a silent node is declared gone after 3 s.
    let mut net = Net::new("agent-restart", &[1, 1], 1, 531_000);
    let cheap = net.agent(0, 1_000_000);
    placeable(&net, 1);
    // A workload that runs until it is stopped.
    let forever = sh("exec sleep 120", None);
    let j = net.tenant().submit(&job(forever.clone())).unwrap();
    let tenant = net.tenant();
    wait(20, "the job to run", || {
        tenant
            .job(&j.id)
            .ok()
            .filter(|v| v.state == JobState::Running)
    });
    // The broker restarts on the same address and database; the node carries on.
    let addr = net.broker().addr;
    net.broker.take().unwrap().stop();
    std::thread::sleep(Duration::from_millis(1500));
    let mut config = net.broker_setup.config.clone();
    config.listen = addr.to_string();
    net.broker = Some(BrokerServer::start(&config).unwrap());
    std::thread::sleep(Duration::from_millis(2500));
    let v = net.tenant().job(&j.id).unwrap();
    assert_eq!(v.state, JobState::Running, "{}\n{}", v.reason, cheap.log());
    assert!(cheap.log().contains("heartbeat"), "the outage was seen");
    // Cancelled: the lease ends and the agent stops the workload, reporting nothing.
    net.tenant().cancel(&j.id).unwrap();
    let lease = v.lease_id.clone().unwrap();
    wait(10, "the workload to stop", || {
        (!cheap.work.join(&lease).exists()).then_some(())
    });
    assert_eq!(net.tenant().job(&j.id).unwrap().state, JobState::Cancelled);
    // A second node; the next job goes to the cheap one, whose agent is then killed: the job
    // moves to the other node and runs there.
    let dear = net.agent(1, 2_000_000);
    placeable(&net, 2);
    let j = net.tenant().submit(&job(forever)).unwrap();
    let first = wait(20, "the job to run", || {
        net.tenant()
            .job(&j.id)
            .ok()
            .filter(|v| v.state == JobState::Running)
    });
    let mut cheap = cheap;
    cheap.signal("-KILL");
    let _ = cheap.child.wait();
    let moved = wait(30, "the job to move", || {
        net.tenant()
            .job(&j.id)
            .ok()
            .filter(|v| v.state == JobState::Running && v.node_id != first.node_id)
    });
    let states: Vec<JobState> = moved.events.iter().map(|e| e.to).collect();
    assert_eq!(
        states,
        [
            JobState::Pending,
            JobState::Placed,
            JobState::Running,
            JobState::Pending,
            JobState::Placed,
            JobState::Running
        ],
        "{}",
        dear.log()
    );
}

/// The provider's loop with proofs and metering, from the agent's own process: a placed node
/// answers its GPU's challenge (passed, judged by the broker) and meters its lease window by
/// window; the broker restarts mid-window and the chain goes on without a gap (the records of
/// windows closed meanwhile are sent again, the same bytes); the node is killed mid-window and
/// its job moves to the other node, whose lease is proved and metered from its first window.
#[test]
fn proofs_and_metering_through_a_broker_restart_and_a_killed_node() {
    let mut net = Net::new("agent-pow", &[1, 1], 1, 533_000);
    let first = net.agent(0, 1_000_000);
    placeable(&net, 1);
    let tenant = net.tenant();
    let j = tenant.submit(&job(sh("exec sleep 120", None))).unwrap();
    let running = wait(20, "the job to run", || {
        tenant
            .job(&j.id)
            .ok()
            .filter(|v| v.state == JobState::Running)
    });
    let node = running.node_id.clone().unwrap();
    let auditor = net.auditor();
    let proved = wait(20, "the node's proof to pass", || {
        let n = auditor.node(&node).ok()?;
        assert!(
            !n.proofs
                .iter()
                .any(|p| p.state == "failed" || p.state == "missed"),
            "{:?}\n{}",
            n.proofs,
            first.log()
        );
        n.proofs.iter().find(|p| p.state == "passed").cloned()
    });
    assert_eq!(proved.lease, running.lease_id.clone().unwrap());
    assert!(first.log().contains("opened, answered"), "{}", first.log());
    wait(20, "two windows metered", || {
        tenant.job(&j.id).ok().filter(|v| v.metered_windows >= 2)
    });
    // The broker restarts on the same address and database, mid-window.
    let addr = net.broker().addr;
    net.broker.take().unwrap().stop();
    std::thread::sleep(Duration::from_millis(1500));
    let mut config = net.broker_setup.config.clone();
    config.listen = addr.to_string();
    net.broker = Some(BrokerServer::start(&config).unwrap());
    let before = net.tenant().job(&j.id).unwrap();
    // Windows closed during the outage arrive once it is back: the count catches up with the
    // lease's age (one record per window, each linked to the one before, or none is taken).
    // The lease is the one running now (a slow restart can let the monitor take the node for
    // gone and place the job again: its age counts from that placement).
    let window = i64::from(net.broker_setup.config.metering_window_secs);
    let caught_up = wait(30, "the chain to catch up after the restart", || {
        let v = net.tenant().job(&j.id).ok()?;
        let placed = v.events.iter().rev().find(|e| e.to == JobState::Placed)?.at;
        let age = cgx_devnet::now() - placed;
        let grew = v.lease_id != before.lease_id || v.metered_windows > before.metered_windows;
        (v.state == JobState::Running && grew && v.metered_windows as i64 >= age / window - 1)
            .then_some(v)
    });
    assert_eq!(caught_up.state, JobState::Running);
    // The node is killed mid-window: the job moves; the new lease is proved and metered.
    let second = net.agent(1, 2_000_000);
    placeable(&net, 2);
    let mut first = first;
    first.signal("-KILL");
    let _ = first.child.wait();
    let moved = wait(30, "the job to move", || {
        net.tenant()
            .job(&j.id)
            .ok()
            .filter(|v| v.state == JobState::Running && v.node_id.as_deref() != Some(&node))
    });
    let to = moved.node_id.clone().unwrap();
    wait(20, "the new node's proof to pass", || {
        auditor
            .node(&to)
            .ok()?
            .proofs
            .iter()
            .find(|p| p.state == "passed" && Some(&p.lease) == moved.lease_id.as_ref())
            .cloned()
    });
    wait(20, "the new lease metered", || {
        net.tenant()
            .job(&j.id)
            .ok()
            .filter(|v| v.metered_windows >= 1 && v.lease_id == moved.lease_id)
    });
    assert!(
        second.log().contains("opened, answered"),
        "{}",
        second.log()
    );
}

/// A machine that answers with its own CPU report but another machine's GPUs (a host that
/// swaps in evidence from GPUs it does not pass through), or with none of its GPUs' evidence.
struct Tampered {
    cpu: cgx_guest_agent::machine::SimMachine,
    gpus: cgx_guest_agent::machine::SimMachine,
    drop_gpus: bool,
}

impl cgx_guest_agent::machine::Machine for Tampered {
    fn gpus(&self) -> Result<Vec<cgx_guest_agent::machine::GpuInfo>, String> {
        if self.drop_gpus {
            return Ok(vec![]);
        }
        self.gpus.gpus()
    }
    fn gpu_evidence(&self, index: u32, nonce: [u8; 32]) -> Result<(Vec<u8>, Vec<u8>), String> {
        self.gpus.gpu_evidence(index, nonce)
    }
    fn cpu_evidence(
        &self,
        report_data: &[u8; 64],
    ) -> Result<cgx_protocol::broker::CpuEvidence, String> {
        self.cpu.cpu_evidence(report_data)
    }
    fn kbs_evidence(&self) -> &dyn cgx_protocol::kbs::rcar::EvidenceSource {
        self.cpu.kbs_evidence()
    }
    fn gpu_usage(&self, index: u32) -> Result<cgx_protocol::metering::GpuUsage, String> {
        self.gpus.gpu_usage(index)
    }
    fn simulated(&self) -> bool {
        true
    }
}

/// Through the guest's own registration path: GPUs another live node offers, in this node's
/// registration, are refused; GPU evidence swapped in transit breaks the binding; a
/// registration without the GPU evidence its offer needs proves no GPUs. Each refused with its
/// reason.
#[test]
fn gpu_evidence_from_another_node_or_none_is_refused() {
    use cgx_guest_agent::machine::{Machine, SimMachine, registration_evidence};
    let net = Net::new("agent-gpus", &[2, 2], 1, 532_000);
    let load = |i: usize| SimMachine {
        node: cgx_kbs::sim::SimNode::from_json(&std::fs::read(&net.machines[i]).unwrap()).unwrap(),
    };
    let op = net
        .broker_setup
        .client(&net.broker().base, &net.broker_setup.operator)
        .unwrap();
    // Register `m` offering `offered` GPUs; with `swap`, the GPU evidence is replaced in
    // transit by what `swap` makes for the same nonce and identity.
    let register = |m: &dyn Machine, offered: u32, swap: Option<&dyn Machine>| {
        use aws_lc_rs::signature::{Ed25519KeyPair, KeyPair};
        let pk8 = Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new()).unwrap();
        let raw: [u8; 32] = Ed25519KeyPair::from_pkcs8(pk8.as_ref())
            .unwrap()
            .public_key()
            .as_ref()
            .try_into()
            .unwrap();
        let tee = cgx_protocol::kbs::jwe::TeeKey::generate_ec(cgx_protocol::kbs::jwe::Curve::P256)
            .unwrap()
            .public()
            .unwrap();
        let identity =
            cgx_protocol::broker::node_identity(&raw, &cgx_protocol::kbs::jwe::thumbprint(&tee));
        let nonce = op.nonce().unwrap();
        let bytes = cgx_protocol::broker::unb64(&nonce.nonce).unwrap();
        let (cpu, mut gpus) = registration_evidence(m, &bytes, &identity).unwrap();
        if let Some(other) = swap {
            gpus = registration_evidence(other, &bytes, &identity).unwrap().1;
        }
        let reg = cgx_protocol::broker::registration(
            &nonce.nonce,
            pk8.as_ref(),
            tee,
            cpu,
            gpus,
            cgx_protocol::broker::Offer {
                gpu_model: "H100".into(),
                gpu_count: offered,
                gpu_memory_gib: 80,
                region: "eu-west".into(),
                price_per_gpu_hour_micros: Micros(1_000_000),
                operator: OPERATOR.into(),
            },
        )
        .unwrap();
        op.register(&reg)
    };
    let refused = |r: Result<_, cgx_broker::client::ClientError>| match r {
        Err(cgx_broker::client::ClientError::Refused { code, detail, .. }) => (code, detail),
        other => panic!("expected a refusal, got {other:?}"),
    };
    // Machine 1 registers honestly: its GPUs are a live node's.
    let one = register(&load(1), 2, None).unwrap();
    // Machine 0's CPU with machine 1's GPUs, composed as the guest composes.
    let (code, detail) = refused(register(
        &Tampered {
            cpu: load(0),
            gpus: load(1),
            drop_gpus: false,
        },
        2,
        None,
    ));
    assert_eq!(code, "InventoryNotProven", "{detail}");
    assert!(
        detail.contains("already offered by node") && detail.contains(&one.node_id),
        "{detail}"
    );
    // Machine 0's evidence with the GPU reports swapped for machine 1's in transit.
    let (code, detail) = refused(register(&load(0), 2, Some(&load(1))));
    assert_eq!(code, "EvidenceRefused", "{detail}");
    assert!(detail.contains("binding"), "{detail}");
    // No GPU evidence for the GPUs offered.
    let (code, detail) = refused(register(
        &Tampered {
            cpu: load(0),
            gpus: load(0),
            drop_gpus: true,
        },
        2,
        None,
    ));
    assert_eq!(code, "InventoryNotProven", "{detail}");
    assert!(
        detail.contains("2 GPUs") && detail.contains("0 GPU reports"),
        "{detail}"
    );
    // The honest machine 0 registers.
    assert!(register(&load(0), 2, None).is_ok());
}
