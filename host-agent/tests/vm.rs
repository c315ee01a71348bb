#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The image booted: `cgx-host-agent run` with the `qemu` launcher boots the cgx image under
//! QEMU TCG (no TEE: the agent in it on simulated evidence), and the guest agent — with no
//! network address — reaches a broker and a KBS on this host only through the host agent, over
//! the virtio-serial channel, TLS end to end. It registers, becomes placeable, gets a lease,
//! fetches the encrypted weights over the channel, has their key released by the KBS, decrypts
//! them in the VM and runs the workload; the job completes. A workload that fails is reported
//! failed.
//!
//! Needs the static guest agent (`CGX_IMAGE_AGENT`), Debian's cloud kernel and its modules
//! (`CGX_TEST_KERNEL`, `CGX_TEST_MODULES`) and `qemu-system-x86_64`: `.ci/run` provides them.
//! Without them it says so and passes, unless `CGX_REQUIRE_PEERS=1` (CI), where it fails.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cgx_age::Identity;
use cgx_broker::client::BrokerClient;
use cgx_devnet::broker::{BrokerServer, OPERATOR, TENANT_A, broker_setup};
use cgx_protocol::broker::{JobSpec, JobState, Workload, WorkloadWeights};
use cgx_protocol::money::Micros;
use cgx_protocol::weights::WeightsKey;

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut d = [0u8; 32];
    d.copy_from_slice(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, bytes).as_ref());
    d
}

fn private(p: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// What the test needs from outside the repository, or why it cannot run.
fn inputs() -> Result<(PathBuf, PathBuf, PathBuf), String> {
    let var = |k: &str| {
        std::env::var_os(k)
            .map(PathBuf::from)
            .filter(|p| p.exists())
            .ok_or_else(|| format!("{k} is not set to an existing path"))
    };
    let agent = var("CGX_IMAGE_AGENT")?;
    let kernel = var("CGX_TEST_KERNEL")?;
    let modules = var("CGX_TEST_MODULES")?;
    let qemu = Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .map_err(|e| format!("qemu-system-x86_64: {e}"))?;
    if !qemu.status.success() {
        return Err("qemu-system-x86_64 --version failed".into());
    }
    Ok((agent, kernel, modules))
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

struct HostAgent(std::process::Child);

impl Drop for HostAgent {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(15) {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_image_boots_under_qemu_and_runs_a_job_through_the_host_channel() {
    let (agent_bin, kernel, modules) = match inputs() {
        Ok(v) => v,
        Err(why) => {
            assert!(
                std::env::var("CGX_REQUIRE_PEERS").as_deref() != Ok("1"),
                "the QEMU test cannot run: {why}"
            );
            eprintln!("SKIPPED the_image_boots_under_qemu…: {why}");
            return;
        }
    };
    // The machine the VM simulates (its collateral published where broker and KBS look).
    let sim = cgx_devnet::node(1).unwrap();
    let mut kbs_setup = cgx_devnet::setup(&[&sim], None).unwrap();
    let pins = kbs_setup.pins.iter().map(hex::encode).collect();
    let mut bsetup = broker_setup(&kbs_setup, pins, None).unwrap();
    bsetup.config.heartbeat_secs = 2;
    bsetup.config.monitor_interval_ms = 200;
    // TLS for both, under names the guest pins to its forwarders.
    let (cert, key) =
        cgx_service::tls::self_signed(&["broker.cgx.test", "kbs.cgx.test", "127.0.0.1"]).unwrap();
    let dir = cgx_devnet::temp_dir("vm").unwrap();
    std::fs::write(dir.join("tls.crt"), &cert).unwrap();
    std::fs::write(dir.join("tls.key"), &key).unwrap();
    kbs_setup.config.insecure_dev = false;
    kbs_setup.config.tls = Some(cgx_kbs::server::config::TlsConfig {
        cert: dir.join("tls.crt"),
        key: dir.join("tls.key"),
    });
    bsetup.config.insecure_dev = false;
    bsetup.config.tls = Some(cgx_service::tls::TlsFiles {
        cert: dir.join("tls.crt"),
        key: dir.join("tls.key"),
    });
    let kbs = cgx_devnet::Server::start(&kbs_setup.config).unwrap();
    let broker = BrokerServer::start(&bsetup.config).unwrap();
    let agent = cgx_kbs::client::agent(Some(cert.as_bytes())).unwrap();
    let broker_base = format!("https://127.0.0.1:{}", broker.addr.port());
    let client = |who: &cgx_devnet::Ed| {
        BrokerClient::with_agent(&broker_base, agent.clone(), Some(who.api_token().unwrap()))
    };

    // The tenant's weights: encrypted into the host's store; the key in the KBS (released
    // only with a lease), bound to the file's digest.
    std::fs::create_dir_all(dir.join("store")).unwrap();
    let id = Identity::generate().unwrap();
    let plain = b"the tenant's weights, decrypted only in the VM";
    let mut file = Vec::new();
    cgx_age::encrypt(
        &id.recipient().unwrap(),
        &mut &plain[..],
        plain.len() as u64,
        &mut file,
        1,
        &mut |_| {},
    )
    .unwrap();
    std::fs::write(dir.join("store/llama.age"), &file).unwrap();
    let bound = WeightsKey::new(&id.to_secret_string(), sha256(&file)).unwrap();
    let admin = kbs_setup.admin.admin_token().unwrap();
    let resp = agent
        .post(&format!(
            "https://127.0.0.1:{}/kbs/v0/resource/{TENANT_A}/weights/llama?lease=required",
            kbs.addr.port()
        ))
        .header("authorization", &format!("Bearer {admin}"))
        .send(bound.to_resource().as_bytes())
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);

    // The image, built from this test's settings: they are measured with it.
    let spec = cgx_image::Spec {
        kernel,
        modules: Some(modules),
        agent: agent_bin,
        args: [
            "run",
            "--broker",
            "https://broker.cgx.test",
            "--broker-key",
            &kbs_setup.broker.public_b64,
            "--kbs",
            "https://kbs.cgx.test",
            "--ca",
            "/etc/cgx/ca.pem",
            "--channel",
            "cgx.0",
            "--sim-machine",
            "/run/cgx-sim-machine.json",
            "--operator",
            OPERATOR,
            "--region",
            "eu-west",
            "--price-micros",
            "1000000",
            "--store",
            "/run/cgx-store",
            "--work",
            "/run/cgx",
        ]
        .map(String::from)
        .to_vec(),
        ca: Some(dir.join("tls.crt")),
        append: "console=ttyS0 panic=-1".into(),
    };
    let image = cgx_image::build(&spec).unwrap();
    image.write(&dir.join("image")).unwrap();
    // Built again from the same inputs: the same bytes, so the same SNP launch digest (on a
    // firmware image made to order: Debian 12 ships no AmdSev OVMF); another setting in the
    // agent's arguments is another digest.
    let again = cgx_image::build(&spec).unwrap();
    assert!(again == image, "two builds of the image differ");
    let digest = |img: &cgx_image::Image| {
        let fw = cgx_measure::ovmf::testing::direct_boot();
        let ovmf = cgx_measure::ovmf::Ovmf::parse(&fw).unwrap();
        let params = cgx_measure::snp::LaunchParams {
            vcpus: 2,
            vcpu_signature: 0x00a1_0f11,
            vmm: cgx_measure::snp::Vmm::Qemu,
            guest_features: 1,
            kernel_hashes: Some(cgx_measure::snp::SevHashes::new(
                &img.kernel,
                Some(&img.initrd),
                Some(&img.cmdline),
            )),
            firmware_digest: None,
        };
        hex::encode(cgx_measure::snp::launch_digest(&ovmf, &params).unwrap())
    };
    let mut other = spec.clone();
    other.args[2] = "https://broker.elsewhere.test".into();
    let launch = digest(&image);
    assert_eq!(launch, digest(&again));
    assert_ne!(launch, digest(&cgx_image::build(&other).unwrap()));
    eprintln!("SNP launch digest (made-to-order firmware): {launch}");
    eprintln!(
        "image: initrd {} KiB, modules {:?}",
        image.initrd.len() / 1024,
        image.modules
    );

    // The host: its operator token (asked for over the channel at each registration), the
    // simulated machine, the store, the launch.
    std::fs::write(dir.join("op.token"), bsetup.operator.api_token().unwrap()).unwrap();
    private(&dir.join("op.token"));
    std::fs::write(dir.join("machine.json"), sim.to_json().unwrap()).unwrap();
    private(&dir.join("machine.json"));
    let config = format!(
        r#"
[agent]
broker = "https://broker.cgx.test"
broker_key = "{key}"
kbs = "https://kbs.cgx.test"
operator = "{OPERATOR}"
region = "eu-west"
price_micros = 1000000
token_file = "{dir}/op.token"

[launcher]
kind = "qemu"
state_file = "{dir}/state.json"

[qemu]
socket = "{dir}/vm.sock"
tcg = true

[qemu.launch]
tee = "none"
kernel = "{dir}/image/vmlinuz"
initrd = "{dir}/image/initrd.img"
append = "console=ttyS0 panic=-1"
vcpus = 2
memory_mib = 1024

[channel]
broker = "127.0.0.1:{bport}"
kbs = "127.0.0.1:{kport}"
store = "{dir}/store"
sim_machine = "{dir}/machine.json"
"#,
        key = kbs_setup.broker.public_b64,
        dir = dir.display(),
        bport = broker.addr.port(),
        kport = kbs.addr.port(),
    );
    std::fs::write(dir.join("host.toml"), config).unwrap();
    let log = dir.join("host-agent.log");
    let t0 = Instant::now();
    let _host = HostAgent(
        Command::new(env!("CARGO_BIN_EXE_cgx-host-agent"))
            .args(["run", "--config"])
            .arg(dir.join("host.toml"))
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::create(dir.join("host-agent.err")).unwrap())
            .spawn()
            .unwrap(),
    );
    let logs = || {
        format!(
            "--- console\n{}\n--- host agent\n{}",
            std::fs::read_to_string(&log).unwrap_or_default(),
            std::fs::read_to_string(dir.join("host-agent.err")).unwrap_or_default()
        )
    };
    let auditor = client(&bsetup.auditor);
    let wait = |secs: u64, what: &str, f: &mut dyn FnMut() -> bool| {
        let t = Instant::now();
        while !f() {
            assert!(
                t.elapsed() < Duration::from_secs(secs),
                "timed out: {what}\n{}",
                logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };
    wait(300, "the VM's node to be placeable", &mut || {
        auditor.nodes().is_ok_and(|v| v.iter().any(|n| n.placeable))
    });
    let boot_to_placeable = t0.elapsed();
    eprintln!(
        "boot to placeable (QEMU TCG, 2 vCPUs): {:.1} s",
        boot_to_placeable.as_secs_f64()
    );

    // A job: its workload reads the weights decrypted in the VM.
    let tenant = client(&bsetup.tenant);
    let weights = Some(WorkloadWeights {
        resource: format!("{TENANT_A}/weights/llama"),
        file: "llama.age".into(),
    });
    let ok = tenant
        .submit(&job(Workload {
            command: "/init".into(),
            args: vec!["sha256".into(), "weights".into()],
            weights: weights.clone(),
        }))
        .unwrap();
    let mut state = None;
    wait(240, "the job to complete", &mut || {
        state = tenant.job(&ok.id).ok().filter(|j| j.state.is_final());
        state.is_some()
    });
    let done = state.unwrap();
    assert_eq!(done.state, JobState::Completed, "{done:?}\n{}", logs());

    // A workload that fails is reported failed, with its exit status.
    let bad = tenant
        .submit(&job(Workload {
            command: "/init".into(),
            args: vec!["sha256".into(), "no-such-file".into()],
            weights: None,
        }))
        .unwrap();
    let mut state = None;
    wait(240, "the failing job to end", &mut || {
        state = tenant.job(&bad.id).ok().filter(|j| j.state.is_final());
        state.is_some()
    });
    let failed = state.unwrap();
    assert_eq!(failed.state, JobState::Failed, "{failed:?}\n{}", logs());
    let console = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        console.contains("over the host channel"),
        "the weights did not come over the channel:\n{}",
        logs()
    );
    eprintln!("total {:.1} s", t0.elapsed().as_secs_f64());
    broker.stop();
    kbs.stop();
}
