//! `cgx-guest-agent run`: the node daemon. It performs [`crate::node::Node`]'s steps — HTTP to
//! the broker and the KBS (TLS, or HTTP to loopback only), evidence from the machine, the
//! workloads' processes — and feeds their outcomes back. One thread, plus one per lease while
//! its weights are fetched and decrypted (so heartbeats never wait on a 70 GB decryption).
//!
//! Keys: a fresh Ed25519 node key (signs registrations, heartbeats, reports) and a fresh P-256
//! TEE key (receives the KBS's keys), both bound by every registration's evidence and never
//! written anywhere. The operator's API token is read from its file at each registration, so
//! the host can rotate it while the node runs.
//!
//! Every lease the broker's answer carries is verified before the node acts on it: the token
//! is a lease record signed by the broker's key (`--broker-key`), for this node and this VM's
//! TEE key, and what the node runs, fetches and uses — the workload, the resources, the GPUs —
//! comes from that signed record, never from the answer around it (a host that proxies the
//! broker cannot rewrite what the VM runs).
//!
//! A workload runs as `command args…` in `WORK/<lease>` with a cleared environment: `PATH`,
//! `CGX_WEIGHTS` (the decrypted weights, when the job names some), `CGX_LEASE_ID`,
//! `CGX_JOB_ID`, `CGX_GPUS` and `CGX_LEASE` (the lease token); when the agent runs as root,
//! under a user id of its own per live lease (`--workload-uid` and up, rotating, a uid reused
//! only once no process runs as it), so it can read neither the agent's keys, the operator's
//! token nor another lease's folder (not root: as the agent, which is for development); its
//! output goes to `WORK/<lease>/output.log`, inside the VM. When the lease ends every process of
//! its uid (not root: its process group) is killed, and `WORK/<lease>` (the plaintext
//! included) and what the uid left in /tmp, /var/tmp and /dev/shm removed. At start the agent
//! clears the lease folders in `WORK` and the workload uids of whatever a previous run left.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;

use cgx_broker::client::{BrokerClient, ClientError};
use cgx_kbs::client::KbsClient;
use cgx_protocol::broker::{LeaseGrant, Offer, Registered};
use cgx_protocol::kbs::jwe::{Curve, TeeKey};
use cgx_protocol::kbs_types::TeePubKey;
use cgx_protocol::money::Micros;
use cgx_protocol::records::WorkloadReport;

use crate::machine::{Machine, registration_evidence};
use crate::node::{HeartbeatError, Node, ReportError, Step};

/// The daemon's settings (`cgx-guest-agent run`'s flags).
#[derive(Debug, Clone, Default)]
pub struct Options {
    pub broker: String,
    pub kbs: String,
    pub ca: Option<Vec<u8>>,
    /// The operator's broker API token (scope `operator:<name>`), re-read at each registration
    /// (with a channel: asked of the host, and this is unused).
    pub token_file: PathBuf,
    pub operator: String,
    pub region: String,
    pub price: Micros,
    /// Encrypted weights (age files), read-only.
    pub store: PathBuf,
    /// Where each lease's folder (decrypted weights, the workload's working directory) goes.
    pub work: PathBuf,
    pub threads: usize,
    /// The broker's lease-signing key (Ed25519): grants are verified under it.
    pub broker_key: [u8; 32],
    /// The first workload user id (one per live lease, up to [`MAX_LEASES`]); `None`: the
    /// workloads run as the agent (it is not root).
    pub workload_uid: Option<u32>,
    /// Services connected to at these addresses (the channel's forwarders).
    pub pins: Vec<cgx_kbs::client::Pin>,
    /// The host channel (`--channel`): encrypted weights missing from the store come over it.
    pub channel: Option<crate::tunnel::Tunnel>,
    /// Simulated nodes only (`--sim-cheat-pow PCT`): prove by skipping this percentage of the
    /// product's rows — the cheat the broker must catch, for demonstrations and tests.
    pub pow_cheat: Option<u32>,
}

/// The most leases a node runs at once (one per GPU at most).
pub const MAX_LEASES: u32 = 64;

pub(crate) fn log(msg: impl std::fmt::Display) {
    eprintln!("cgx-guest-agent: {msg}");
}

/// A lease's workload as the daemon holds it.
#[derive(Debug)]
struct Work {
    child: Option<Child>,
    /// Being set up by its thread; stop asked meanwhile: kill what it starts.
    setting_up: bool,
    cancel: Arc<AtomicBool>,
    dir: PathBuf,
    /// Its user id (`None`: the agent's own).
    uid: Option<u32>,
}

impl Work {
    /// Kill everything it runs, remove its folder.
    fn end(mut self) {
        if let Some(c) = &mut self.child {
            crate::reap::kill_group(c.id());
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(uid) = self.uid {
            crate::reap::kill_uid(uid);
            if !crate::reap::pids_of_uid(uid).is_empty() {
                log(format_args!(
                    "workload uid {uid}: processes remain after the kill; the uid is not reused while they do"
                ));
            }
            // What it left where every user may write, so the uid's next lease finds none of it.
            for shared in ["/tmp", "/var/tmp", "/dev/shm"] {
                crate::reap::remove_owned(std::path::Path::new(shared), uid);
            }
        }
        remove_dir(&self.dir);
    }
}

/// What a setup thread sends back.
#[derive(Debug)]
struct SetupDone {
    lease: String,
    result: Result<Option<Child>, String>,
}

/// What a lease's setup thread needs.
struct Setup {
    kbs: String,
    agent: cgx_kbs::client::Agent,
    channel: Option<crate::tunnel::Tunnel>,
    tee_pkcs8: Vec<u8>,
    machine: Arc<dyn Machine>,
    store: PathBuf,
    threads: usize,
}

/// The grants of `a` that verify: each token a lease record under `broker_key` for node `id`
/// and the TEE key `thumbprint`, with the grant's workload, resources and GPUs taken from it.
/// The others are dropped, saying why (a lease not carried is stopped if it runs).
fn verified(
    mut a: cgx_protocol::broker::HeartbeatAnswer,
    broker_key: &[u8; 32],
    id: &str,
    thumbprint: &str,
    now: i64,
) -> cgx_protocol::broker::HeartbeatAnswer {
    use cgx_protocol::signed::When;
    a.leases.retain_mut(|g| {
        let (lease, exp) = match cgx_protocol::signed::verify::<cgx_protocol::records::Lease>(
            &g.token,
            std::slice::from_ref(broker_key),
            When::At {
                now,
                max_lifetime: 86_400,
            },
        ) {
            Ok(v) => (v.body, v.exp),
            Err(e) => {
                log(format_args!(
                    "lease {}: its token is not the broker's lease: {e}; ignored",
                    g.lease_id
                ));
                return false;
            }
        };
        if lease.lease != g.lease_id
            || lease.job != g.job_id
            || lease.node != id
            || lease.node_key != thumbprint
        {
            log(format_args!(
                "lease {}: its token is not this lease for this node and TEE key; ignored",
                g.lease_id
            ));
            return false;
        }
        // When it lapses is the token's word too, not the answer's.
        g.expires_at = exp.min(lease.until);
        g.start = lease.start;
        g.window_secs = lease.window();
        g.workload = lease.workload;
        g.resources = lease.resources;
        g.gpus = lease.gpus;
        true
    });
    a
}

/// The daemon: run until `stop` is set (SIGTERM, SIGINT), then stop every workload and return.
pub fn run(opts: &Options, machine: Arc<dyn Machine>, stop: &AtomicBool) -> Result<(), String> {
    use aws_lc_rs::signature::{Ed25519KeyPair, KeyPair};
    let node_pkcs8 = Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
        .map_err(|_| "node key generation failed".to_string())?
        .as_ref()
        .to_vec();
    let node_pair = Ed25519KeyPair::from_pkcs8(&node_pkcs8).map_err(|_| "node key")?;
    let node_raw: [u8; 32] = node_pair
        .public_key()
        .as_ref()
        .try_into()
        .map_err(|_| "node key")?;
    let tee = TeeKey::generate_ec(Curve::P256).map_err(|e| e.to_string())?;
    let tee_pkcs8 = tee.ec_pkcs8().map_err(|e| e.to_string())?;
    let tee_public = tee.public().map_err(|e| e.to_string())?;
    let thumbprint = cgx_protocol::kbs::jwe::thumbprint(&tee_public);
    let identity = cgx_protocol::broker::node_identity(&node_raw, &thumbprint);
    let id = cgx_protocol::broker::node_id(&node_raw);
    std::fs::create_dir_all(&opts.work).map_err(|e| format!("{}: {e}", opts.work.display()))?;
    // What a previous run left (it was killed before it could clean up): its workloads'
    // processes and folders, plaintext included.
    if let Some(base) = opts.workload_uid {
        crate::reap::kill_uids(base..base.saturating_add(MAX_LEASES));
    }
    // Only lease folders (named as the broker names leases): WORK may hold other things.
    for e in std::fs::read_dir(&opts.work)
        .map_err(|e| format!("{}: {e}", opts.work.display()))?
        .flatten()
    {
        if e.file_name().to_str().is_some_and(lease_id_ok) && e.path().is_dir() {
            remove_dir(&e.path());
        }
    }
    let agent =
        cgx_kbs::client::agent_with(opts.ca.as_deref(), &opts.pins).map_err(|e| e.to_string())?;
    let client = BrokerClient::with_agent(&opts.broker, agent.clone(), None);
    let setup = Arc::new(Setup {
        kbs: opts.kbs.clone(),
        agent,
        channel: opts.channel.clone(),
        tee_pkcs8,
        machine: machine.clone(),
        store: opts.store.clone(),
        threads: opts.threads,
    });
    let backend: Arc<dyn cgx_pow::Backend> = match opts.pow_cheat {
        Some(percent) if machine.simulated() => Arc::new(cgx_pow::backend::SkipRows {
            threads: opts.threads.max(1),
            percent,
        }),
        _ => Arc::new(cgx_pow::backend::Cpu {
            threads: opts.threads.max(1),
        }),
    };
    // A confidential machine proves on its GPUs: GPU i of a lease (NVML's index) is taken as
    // CUDA device i — true when CUDA enumerates in PCI bus order as NVML does
    // (CUDA_DEVICE_ORDER=PCI_BUS_ID); the image does not carry the NVIDIA driver yet, so this
    // path is untested on hardware.
    let mut backends: HashMap<u32, Arc<dyn cgx_pow::Backend>> = HashMap::new();
    if !machine.simulated() {
        for (i, _) in machine.gpus().unwrap_or_default().iter().enumerate() {
            match cgx_pow_cuda::Cuda::open(i) {
                Ok(c) => {
                    backends.insert(i as u32, Arc::new(c));
                }
                Err(e) => log(format_args!(
                    "GPU {i}: no CUDA backend ({e}); it cannot answer proof-of-work challenges"
                )),
            }
        }
    }
    let mut prover = crate::prover::Prover::start(crate::prover::ProverSetup {
        backends,
        fallback: machine.simulated().then_some(backend),
        client: BrokerClient::with_agent(&opts.broker, setup.agent.clone(), None),
        node_id: id.clone(),
        node_pkcs8: node_pkcs8.clone(),
        node_raw,
    });
    let signer =
        cgx_protocol::signed::Signer::from_pkcs8(&node_pkcs8).map_err(|e| e.to_string())?;
    // The largest challenge this node proves: its GPUs' class's, or on a simulated node's CPU
    // n = 1024 (a second of two cores at most).
    let max_n = if machine.simulated() {
        1024
    } else {
        machine
            .gpus()
            .ok()
            .and_then(|g| g.first().and_then(|g| cgx_pow::class::class(&g.model)))
            .map_or(0, |c| c.params.n)
    };
    let mut meters: HashMap<String, crate::meter::Meter> = HashMap::new();
    let (tx, rx) = mpsc::channel::<SetupDone>();
    let started = Instant::now();
    let now = || u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let seq = AtomicU64::new(0);
    let mut node = Node::new(&id, now());
    let mut works: HashMap<String, Work> = HashMap::new();
    let mut terminating = false;
    let mut next_uid = 0u32;
    log(format_args!(
        "node {id}: {} machine, broker {}, KBS {}",
        if machine.simulated() {
            "simulated"
        } else {
            "confidential"
        },
        opts.broker,
        opts.kbs
    ));
    loop {
        if !terminating && stop.load(Ordering::SeqCst) {
            log("stopping: every workload is stopped");
            terminating = true;
            node.terminate(now());
        }
        // Setups that finished.
        while let Ok(done) = rx.try_recv() {
            let Some(w) = works.get_mut(&done.lease) else {
                continue;
            };
            w.setting_up = false;
            let cancelled = w.cancel.load(Ordering::SeqCst);
            match done.result {
                Ok(child) if cancelled => {
                    if let Some(mut w) = works.remove(&done.lease) {
                        w.child = child;
                        w.end();
                    }
                    node.stopped(&done.lease);
                }
                Ok(Some(child)) => {
                    log(format_args!(
                        "lease {}: workload started (pid {})",
                        done.lease,
                        child.id()
                    ));
                    w.child = Some(child);
                    node.workload_started(&done.lease, "workload started");
                }
                Ok(None) => node.workload_started(&done.lease, "lease held (no workload)"),
                Err(why) => {
                    log(format_args!("lease {}: {why}", done.lease));
                    if let Some(w) = works.remove(&done.lease) {
                        w.end();
                    }
                    if cancelled {
                        node.stopped(&done.lease);
                    } else {
                        node.workload_failed(&done.lease, &why);
                    }
                }
            }
        }
        // Workloads that exited.
        let mut exited = Vec::new();
        for (lease, w) in &mut works {
            if let Some(c) = &mut w.child
                && let Ok(Some(status)) = c.try_wait()
            {
                exited.push((lease.clone(), status));
            }
        }
        for (lease, status) in exited {
            if let Some(w) = works.remove(&lease) {
                w.end();
            }
            let why = describe(&status);
            log(format_args!("lease {lease}: workload {why}"));
            node.workload_ended(&lease, status.code(), &why);
        }
        // Metering: each running lease's window that closed.
        let t = unix_now();
        for (lease, m) in &mut meters {
            if m.due(t) {
                let state = if works.contains_key(lease) {
                    cgx_protocol::records::WorkloadState::Running
                } else {
                    cgx_protocol::records::WorkloadState::Completed
                };
                m.tick(t, &id, &signer, &*machine, &client, state, |w| {
                    prover.answer_for(lease, w)
                });
            }
        }
        meters.retain(|lease, m| {
            let done = m.done(t);
            if done {
                log(format_args!(
                    "lease {lease}: {} metering records accepted",
                    m.sent()
                ));
            }
            !done
        });
        match node.next(now()) {
            Step::Exit => {
                log("stopped");
                return Ok(());
            }
            Step::Wait(ms) => std::thread::sleep(Duration::from_millis(ms.min(100))),
            Step::Register => match register(
                opts,
                &client,
                &*machine,
                &node_pkcs8,
                &tee_public,
                &identity,
            ) {
                Ok(r) => {
                    log(format_args!(
                        "registered as {}: {}{}",
                        r.node_id,
                        r.status,
                        if r.violations.is_empty() {
                            String::new()
                        } else {
                            format!(" ({})", r.violations.join("; "))
                        }
                    ));
                    node.registered(now(), &r);
                }
                Err(e) => {
                    log(format_args!("registration: {e}"));
                    node.register_failed(now());
                }
            },
            Step::Heartbeat => {
                let n = seq.fetch_add(1, Ordering::SeqCst) + 1;
                let result = cgx_protocol::broker::heartbeat_token(&node_pkcs8, &id, n, unix_now())
                    .map_err(|e| HeartbeatError::Unreachable(e.to_string()))
                    .and_then(|t| {
                        client.heartbeat(&id, &t).map_err(|e| match &e {
                            ClientError::Refused { status: 404, .. } => HeartbeatError::UnknownNode,
                            ClientError::Refused { status: 401, .. } => {
                                HeartbeatError::Refused(e.to_string())
                            }
                            _ => HeartbeatError::Unreachable(e.to_string()),
                        })
                    });
                match result {
                    Ok(a) => {
                        let a = verified(a, &opts.broker_key, &id, &thumbprint, unix_now());
                        // Only challenges for this node's verified leases and their GPUs,
                        // of the size its GPUs' class sets (a simulated node's CPU: small
                        // ones): a host cannot make it prove for anything else.
                        let wanted: Vec<_> = a
                            .challenges
                            .iter()
                            .filter(|c| {
                                a.leases
                                    .iter()
                                    .any(|g| g.lease_id == c.lease && g.gpus.contains(&c.gpu))
                                    && size_ok(c, max_n)
                            })
                            .cloned()
                            .collect();
                        prover.offer(&wanted);
                        node.heartbeat_answered(now(), unix_now(), &a);
                    }
                    Err(e) => {
                        log(format_args!("heartbeat: {e:?}"));
                        node.heartbeat_failed(now(), &e);
                    }
                }
            }
            Step::Start(grant) => {
                if !lease_id_ok(&grant.lease_id) {
                    node.workload_failed(&grant.lease_id, "a lease id that names no folder");
                    continue;
                }
                if let Some(m) = crate::meter::Meter::new(&grant) {
                    meters.insert(grant.lease_id.clone(), m);
                }
                // The next workload uid, round the range, that no live lease holds and no
                // process still runs as (a uid is reused as late as it can be).
                let uid = match opts.workload_uid {
                    None => None,
                    Some(base) => {
                        let mut taken: Vec<u32> = works.values().filter_map(|w| w.uid).collect();
                        taken.extend(crate::reap::busy_uids(base..base + MAX_LEASES));
                        let free = (0..MAX_LEASES)
                            .map(|i| base + (next_uid + i) % MAX_LEASES)
                            .find(|u| !taken.contains(u));
                        match free {
                            Some(u) => {
                                next_uid = (u - base + 1) % MAX_LEASES;
                                Some(u)
                            }
                            None => {
                                node.workload_failed(&grant.lease_id, "no workload uid free");
                                continue;
                            }
                        }
                    }
                };
                let dir = opts.work.join(&grant.lease_id);
                let cancel = Arc::new(AtomicBool::new(false));
                works.insert(
                    grant.lease_id.clone(),
                    Work {
                        child: None,
                        setting_up: true,
                        cancel: cancel.clone(),
                        dir: dir.clone(),
                        uid,
                    },
                );
                let (setup, tx) = (setup.clone(), tx.clone());
                std::thread::spawn(move || {
                    // Whatever happens in the setup, the daemon hears of it (a lease left
                    // "starting" would hold its stop, and the agent's exit, for ever).
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        start_workload(&setup, &grant, &dir, uid, &cancel)
                    }))
                    .unwrap_or_else(|_| Err("the lease's setup failed unexpectedly".into()));
                    let _ = tx.send(SetupDone {
                        lease: grant.lease_id.clone(),
                        result,
                    });
                });
            }
            Step::Stop(lease) => {
                log(format_args!("lease {lease}: stopping its workload"));
                // Its last windows are still metered (the provider is paid for what it ran
                // and proved); the meter goes once their records are taken.
                if let Some(m) = meters.get_mut(&lease) {
                    m.end(unix_now());
                }
                prover.forget(&lease);
                match works.get_mut(&lease) {
                    Some(w) if w.setting_up => w.cancel.store(true, Ordering::SeqCst),
                    Some(_) => {
                        if let Some(w) = works.remove(&lease) {
                            w.end();
                        }
                        node.stopped(&lease);
                    }
                    None => node.stopped(&lease),
                }
            }
            Step::Report(r) => match send_report(&client, &node_pkcs8, &r) {
                Ok(state) => {
                    log(format_args!(
                        "lease {}: reported {} (job {} is {state})",
                        r.lease, r.state, r.job
                    ));
                    node.report_sent();
                }
                Err(e) => {
                    log(format_args!("lease {}: report {}: {e:?}", r.lease, r.state));
                    node.report_failed(now(), &e);
                }
            },
        }
    }
}

/// A challenge of a size this node proves: the proof's rules, n at most `max_n`, k at most
/// twice the classes' (the broker's soundness needs no more).
fn size_ok(c: &cgx_protocol::broker::PowChallenge, max_n: u32) -> bool {
    cgx_pow::Params { n: c.n, k: c.k }.check().is_ok()
        && c.n <= max_n
        && c.k <= 2 * cgx_pow::class::K
}

/// The wall clock, Unix seconds.
pub(crate) fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// Lease ids are the broker's (`l` and hex); anything else would name a path of its choosing.
fn lease_id_ok(id: &str) -> bool {
    id.len() > 1
        && id.len() <= 64
        && id.starts_with('l')
        && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

fn remove_dir(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        log(format_args!("{}: {e}", dir.display()));
    }
}

fn describe(status: &std::process::ExitStatus) -> String {
    match status.code() {
        Some(c) => format!("exited with status {c}"),
        None => {
            #[cfg(unix)]
            {
                use std::os::unix::process::ExitStatusExt;
                if let Some(s) = status.signal() {
                    return format!("killed by signal {s}");
                }
            }
            "ended without a status".into()
        }
    }
}

/// A nonce, the machine's evidence over it, and the registration.
fn register(
    opts: &Options,
    client: &BrokerClient,
    machine: &dyn Machine,
    node_pkcs8: &[u8],
    tee_public: &TeePubKey,
    identity: &[u8],
) -> Result<Registered, String> {
    // Private to the agent (0600), as a key file: a workload that could read it could
    // register nodes as the operator. Over the host channel it is asked for at each
    // registration and kept in memory only (the host rotates it in its own file).
    let token = match &opts.channel {
        Some(t) => t.fetch("operator-token", 64 * 1024)?,
        None => crate::keyfile::read_private(&opts.token_file, 64 * 1024)?,
    };
    let token =
        String::from_utf8(token).map_err(|_| "the operator token is not text".to_string())?;
    let client = client.with_token(Some(token.trim().to_string()));
    let gpus = machine.gpus()?;
    let model = gpus.first().map(|g| g.model.clone()).unwrap_or_default();
    if gpus.iter().any(|g| g.model != model) {
        return Err("the GPUs are not all one model; a node offers one".into());
    }
    let offer = Offer {
        gpu_model: model,
        gpu_count: u32::try_from(gpus.len()).map_err(|_| "too many GPUs")?,
        gpu_memory_gib: gpus.iter().map(|g| g.memory_gib).min().unwrap_or(0),
        region: opts.region.clone(),
        price_per_gpu_hour_micros: opts.price,
        operator: opts.operator.clone(),
    };
    let nonce = client.nonce().map_err(|e| e.to_string())?;
    let raw =
        cgx_protocol::broker::unb64(&nonce.nonce).ok_or("the broker's nonce is not base64")?;
    let (cpu, gpu_evidence) = registration_evidence(machine, &raw, identity)?;
    let reg = cgx_protocol::broker::registration(
        &nonce.nonce,
        node_pkcs8,
        tee_public.clone(),
        cpu,
        gpu_evidence,
        offer,
    )
    .map_err(|e| e.to_string())?;
    client.register(&reg).map_err(|e| e.to_string())
}

/// Send `r`, signed now.
fn send_report(
    client: &BrokerClient,
    node_pkcs8: &[u8],
    r: &WorkloadReport,
) -> Result<String, ReportError> {
    let token = cgx_protocol::broker::workload_report_token(node_pkcs8, r, unix_now())
        .map_err(ReportError::Unreachable)?;
    match client.report(&r.sub, &token) {
        Ok(a) => Ok(a.state.to_string()),
        Err(ClientError::Refused { status, detail, .. }) => Err(classify(status, &detail)),
        Err(e) => Err(ReportError::Unreachable(e.to_string())),
    }
}

/// What a refusal of a report means: the broker does not know this node (register, send it
/// again); not now (timed out, shed, the broker's own trouble: send it again); or never (not
/// this node's lease, not its key: drop it).
fn classify(status: u16, detail: &str) -> ReportError {
    match status {
        404 if detail.starts_with("node ") => ReportError::UnknownNode,
        408 | 425 | 429 | 500..=599 => ReportError::Unreachable(format!("HTTP {status}: {detail}")),
        _ => ReportError::Gone(format!("HTTP {status}: {detail}")),
    }
}

/// Set up `grant`'s workload in `dir`: check it, fetch and decrypt its weights through the
/// lease (attesting to the KBS with the TEE key the registration bound), start its process
/// under `uid` (when given) in a process group of its own. `None`: the lease names no workload
/// (held for the tenant). Nothing starts once `cancel` is set.
fn start_workload(
    s: &Setup,
    grant: &LeaseGrant,
    dir: &Path,
    uid: Option<u32>,
    cancel: &AtomicBool,
) -> Result<Option<Child>, String> {
    let Some(w) = &grant.workload else {
        return Ok(None);
    };
    w.check(&grant.resources).map_err(|e| e.to_string())?;
    let mut b = std::fs::DirBuilder::new();
    b.mode(0o700);
    b.create(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let own = |p: &Path| -> Result<(), String> {
        match uid {
            Some(u) => std::os::unix::fs::chown(p, Some(u), Some(u))
                .map_err(|e| format!("{}: {e}", p.display())),
            None => Ok(()),
        }
    };
    let mut env: Vec<(&str, String)> = vec![
        ("PATH", "/usr/local/bin:/usr/bin:/bin".into()),
        ("CGX_LEASE_ID", grant.lease_id.clone()),
        ("CGX_JOB_ID", grant.job_id.clone()),
        (
            "CGX_GPUS",
            grant
                .gpus
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(","),
        ),
        ("CGX_LEASE", grant.token.clone()),
    ];
    if let Some(weights) = &w.weights {
        let key = TeeKey::ec_from_der(Curve::P256, &s.tee_pkcs8).map_err(|e| e.to_string())?;
        let mut kbs = KbsClient::with_agent(&s.kbs, s.agent.clone(), key);
        kbs.attest(s.machine.kbs_evidence())
            .map_err(|e| format!("KBS attestation: {e}"))?;
        let secret = kbs
            .resource(&weights.resource, Some(&grant.token))
            .map_err(|e| format!("weights key {}: {e}", weights.resource))?;
        if cancel.load(Ordering::SeqCst) {
            return Err("stopped before its weights were decrypted".into());
        }
        let out = dir.join("weights");
        let input = s.store.join(&weights.file);
        if let (false, Some(t)) = (input.exists(), &s.channel) {
            fetch_weights(t, &weights.file, &input)?;
        }
        let (n, secs) = crate::decrypt_weights(secret, &weights.resource, &input, &out, s.threads)?;
        own(&out)?;
        log(format_args!(
            "lease {}: decrypted {n} bytes of {} in {secs:.2} s",
            grant.lease_id, weights.file
        ));
        env.push(("CGX_WEIGHTS", out.display().to_string()));
    }
    // Its output stays in the VM (the console is the host's to read).
    let output = std::fs::OpenOptions::new()
        .create_new(true)
        .write(true)
        .mode(0o600)
        .open(dir.join("output.log"))
        .map_err(|e| format!("{}: {e}", dir.join("output.log").display()))?;
    own(&dir.join("output.log"))?;
    own(dir)?;
    if cancel.load(Ordering::SeqCst) {
        return Err("stopped before its workload started".into());
    }
    let mut c = Command::new(&w.command);
    c.args(&w.args)
        .env_clear()
        .envs(env)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(output.try_clone().map_err(|e| e.to_string())?)
        .stderr(output)
        .process_group(0);
    if let Some(u) = uid {
        c.uid(u).gid(u);
    }
    c.spawn()
        .map_err(|e| format!("{}: {e}", w.command))
        .map(Some)
}

/// The encrypted weights `file` from the host channel into the store at `dest`: written under
/// a name of its own, then linked into place (another lease may be fetching the same file).
/// Not trusted for being the host's: decryption checks the digest the key binds.
fn fetch_weights(t: &crate::tunnel::Tunnel, file: &str, dest: &Path) -> Result<(), String> {
    static FETCHES: AtomicU64 = AtomicU64::new(0);
    let n = FETCHES.fetch_add(1, Ordering::Relaxed);
    let tmp = dest.with_file_name(format!(".{file}.fetch-{n}"));
    let t0 = Instant::now();
    let bytes = t.fetch_to(&format!("store/{file}"), &tmp, Duration::from_secs(3600))?;
    let linked = std::fs::hard_link(&tmp, dest);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            log(format_args!(
                "fetched {file} ({bytes} bytes) over the host channel in {:.2} s",
                t0.elapsed().as_secs_f64()
            ));
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(format!("{}: {e}", dest.display())),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use cgx_protocol::broker::{HeartbeatAnswer, Workload};
    use cgx_protocol::records::Lease;

    fn signer() -> cgx_protocol::signed::Signer {
        use aws_lc_rs::signature::Ed25519KeyPair;
        let pk8 = Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new()).unwrap();
        cgx_protocol::signed::Signer::from_pkcs8(pk8.as_ref()).unwrap()
    }

    fn grant(s: &cgx_protocol::signed::Signer, node: &str, node_key: &str) -> LeaseGrant {
        let lease = Lease {
            lease: "l1".into(),
            job: "j1".into(),
            tenant: "acme".into(),
            node: node.into(),
            gpus: vec![3],
            resources: vec!["acme/weights/llama".into()],
            node_key: node_key.into(),
            iss: "cgx-broker".into(),
            until: 10_000,
            start: 1_000,
            window_secs: 0,
            workload: Some(Workload {
                command: "/usr/bin/serve".into(),
                args: vec![],
                weights: None,
            }),
        };
        LeaseGrant {
            start: 0,
            window_secs: 0,
            lease_id: "l1".into(),
            job_id: "j1".into(),
            gpus: vec![3],
            resources: lease.resources.clone(),
            token: s.sign(&lease, 1_000, 1_120).unwrap(),
            expires_at: 1_120,
            workload: lease.workload.clone(),
        }
    }

    fn answer(g: LeaseGrant) -> HeartbeatAnswer {
        HeartbeatAnswer {
            challenges: Vec::new(),
            reattest: false,
            unplaceable: None,
            leases: vec![g],
        }
    }

    #[test]
    fn refusals_of_reports_are_retried_or_dropped_by_what_they_mean() {
        for status in [408, 425, 429, 500, 503] {
            assert!(
                matches!(classify(status, "x"), ReportError::Unreachable(_)),
                "{status}"
            );
        }
        assert_eq!(classify(404, "node n1 not found"), ReportError::UnknownNode);
        for (status, detail) in [
            (404, "job j1 not found"),
            (409, "lease"),
            (401, "key"),
            (400, "bad"),
        ] {
            assert!(
                matches!(classify(status, detail), ReportError::Gone(_)),
                "{status}"
            );
        }
    }

    /// What the node runs is the signed record's: a workload, resources or GPUs rewritten in
    /// the answer around the token are replaced by the record's; a token not the broker's, or
    /// for another node or TEE key, and the grant is not acted on.
    #[test]
    fn only_leases_the_broker_signed_for_this_vm_are_acted_on() {
        let broker = signer();
        let key = broker.public_key();
        let mut g = grant(&broker, "n1", "thumb");
        g.workload = Some(Workload {
            command: "/bin/cat".into(),
            args: vec!["weights".into()],
            weights: None,
        });
        g.resources = vec!["globex/weights/secret".into()];
        g.gpus = vec![0, 1, 2, 3];
        let a = verified(answer(g), &key, "n1", "thumb", 1_010);
        assert_eq!(a.leases.len(), 1);
        let got = &a.leases[0];
        assert_eq!(got.workload.as_ref().unwrap().command, "/usr/bin/serve");
        assert_eq!(got.resources, vec!["acme/weights/llama".to_string()]);
        assert_eq!(got.gpus, vec![3]);
        // When it lapses is the token's word: an answer that says "never" is not believed.
        let mut g = grant(&broker, "n1", "thumb");
        g.expires_at = i64::MAX;
        let a = verified(answer(g), &key, "n1", "thumb", 1_010);
        assert_eq!(a.leases[0].expires_at, 1_120);
        for (g, node, thumb, now) in [
            (grant(&signer(), "n1", "thumb"), "n1", "thumb", 1_010),
            (grant(&broker, "n2", "thumb"), "n1", "thumb", 1_010),
            (grant(&broker, "n1", "other"), "n1", "thumb", 1_010),
            (grant(&broker, "n1", "thumb"), "n1", "thumb", 2_000),
        ] {
            assert!(
                verified(answer(g), &key, node, thumb, now)
                    .leases
                    .is_empty()
            );
        }
    }
}
