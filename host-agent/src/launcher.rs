//! Launchers: how the host agent boots its node. `sim` runs the guest agent as a local process
//! on a simulated machine (tests, `cgx up`, a provider trying cgx without TEE hardware); `qemu`
//! boots the confidential VM the launch description describes. Both hand the guest agent the
//! same settings ([`guest_agent_args`]).

use std::process::{Command, Stdio};

use crate::config::{AgentConfig, HostConfig, LauncherKind, QemuConfig, SimConfig};
use crate::launch::Channel;

/// `cgx-guest-agent run`'s flags for this host's agent settings.
pub fn guest_agent_args(a: &AgentConfig) -> Vec<String> {
    let mut v = vec![
        "run".to_string(),
        "--broker".into(),
        a.broker.clone(),
        "--broker-key".into(),
        a.broker_key.clone(),
        "--kbs".into(),
        a.kbs.clone(),
        "--token-file".into(),
        a.token_file.display().to_string(),
        "--operator".into(),
        a.operator.clone(),
        "--region".into(),
        a.region.clone(),
        "--price-micros".into(),
        a.price_micros.to_string(),
    ];
    if let Some(ca) = &a.ca {
        v.extend(["--ca".into(), ca.display().to_string()]);
    }
    v
}

/// The simulated machine at `path`: made once (0600), with `gpus` GPUs, its revocation
/// collateral published into `collateral` when given (the store a development broker reads at
/// start). `true` if it was made now.
#[cfg(feature = "sim")]
pub fn sim_machine(
    path: &std::path::Path,
    gpus: usize,
    measurement: [u8; 48],
    collateral: Option<&std::path::Path>,
) -> Result<bool, String> {
    if path.exists() {
        return Ok(false);
    }
    let now = crate::supervise::unix_now();
    let node =
        cgx_kbs::sim::SimNode::generate(gpus, measurement, now).map_err(|e| e.to_string())?;
    if let Some(dir) = collateral {
        node.publish_collateral(dir, now)
            .map_err(|e| e.to_string())?;
    }
    let bytes = node.to_json().map_err(|e| e.to_string())?;
    // Whole or not at all, and never over one another launcher made meanwhile: written beside
    // it under a name of its own (0600), then linked into place (which fails if the file is
    // there).
    // (The process id and a count within it: unique among writers.)
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("partial-{}-{n}", std::process::id()));
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(0o600);
    }
    let fail = |e: std::io::Error| format!("{}: {e}", tmp.display());
    let mut f = o.open(&tmp).map_err(fail)?;
    std::io::Write::write_all(&mut f, &bytes).map_err(fail)?;
    f.sync_all().map_err(fail)?;
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// The `sim` launcher's command: the guest agent on the simulated machine.
pub fn sim_command(agent: &AgentConfig, s: &SimConfig) -> Result<Command, String> {
    let (program, lead) = s
        .guest_agent
        .split_first()
        .ok_or("sim.guest_agent: no command")?;
    let mut c = Command::new(program);
    c.args(lead)
        .args(guest_agent_args(agent))
        .arg("--store")
        .arg(&s.store)
        .arg("--work")
        .arg(&s.work)
        .arg("--sim-machine")
        .arg(&s.machine)
        .stdin(Stdio::null());
    if let Some(u) = s.workload_uid {
        c.arg("--workload-uid").arg(u.to_string());
    }
    Ok(c)
}

/// The `qemu` launcher's command: the VM of the launch description, its serial console on the
/// agent's standard error, its channel to this agent on `q.socket`.
pub fn qemu_command(q: &QemuConfig) -> Result<Command, String> {
    let args = q
        .launch
        .qemu_args(
            &Channel::VirtioSerial {
                socket: q.socket.clone(),
            },
            q.tcg,
        )
        .map_err(|e| e.to_string())?;
    // QEMU listens at the socket afresh each boot; a previous VM's file would stop it.
    let _ = std::fs::remove_file(&q.socket);
    let mut c = Command::new(&q.binary);
    c.args(args).stdin(Stdio::null());
    Ok(c)
}

/// The command this host's launcher runs.
pub fn command(c: &HostConfig) -> Result<Command, String> {
    match c.launcher.kind {
        LauncherKind::Sim => {
            let s = c.sim.as_ref().ok_or("no [sim] table")?;
            sim_command(&c.agent, s)
        }
        LauncherKind::Qemu => qemu_command(c.qemu.as_ref().ok_or("no [qemu] table")?),
    }
}
