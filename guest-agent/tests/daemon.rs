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
}

const PLAIN: &[u8] = b"the tenant's weights";

impl Net {
    fn new(name: &str, gpus: &[usize], heartbeat_secs: i64) -> Net {
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
    wait(20, "the nodes to register", || {
        auditor
            .nodes()
            .ok()
            .filter(|v| v.iter().filter(|n| n.placeable).count() >= n)
    });
}

#[test]
fn a_node_registers_runs_its_workload_on_decrypted_weights_and_reports_it() {
    let net = Net::new("agent-run", &[1], 1);
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
    // SIGTERM: the agent stops at once, cleanly.
    let mut agent = agent;
    let term = Instant::now();
    agent.signal("-TERM");
    let status = wait(10, "the agent to exit", || agent.child.try_wait().unwrap());
    assert!(status.success(), "{status:?}\n{}", agent.log());
    println!(
        "guest agent (sim machine): placeable {placeable_after:?} after start; stopped {:?} after SIGTERM",
        term.elapsed()
    );
}

#[test]
fn a_broker_restart_and_a_cancelled_lease_and_a_killed_agent() {
    // Heartbeats every second: a silent node is declared gone after 3 s.
    let mut net = Net::new("agent-restart", &[1, 1], 1);
    let cheap = net.agent(0, 1_000_000);
    placeable(&net, 1);
    // A workload that runs while its agent lives.
    let forever = sh("while kill -0 $PPID 2>/dev/null; do sleep 0.1; done", None);
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
