//! The proof-of-work worker: challenges from heartbeat answers are proved one at a time on a
//! thread of their own (the daemon's loop never waits on a product). Each is committed to (the
//! root, under a receipt signed by the node key: `cgx_protocol::broker::PowReceipt`), then
//! opened where the broker's opening says; a request that does not reach the broker is tried
//! again until its deadline. The root is remembered for the metering record of the window the
//! challenge fell in. What the worker accepts is bounded (`offer`): a host that alters or
//! invents challenges cannot make the VM burn its GPU on them.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use cgx_broker::client::BrokerClient;
use cgx_pow::Backend;
use cgx_pow::challenge::{Challenge, Params, seed};
use cgx_protocol::broker::{PowChallenge, PowReceipt};
use cgx_protocol::metering::PowAnswer;

use crate::daemon::log;

/// Challenges remembered as seen (their ids), so a challenge the broker sends again until it
/// is answered is proved once.
const SEEN_MAX: usize = 4096;
/// Challenges waiting for the worker at most (more are dropped: the broker sends them again).
const QUEUE: usize = 64;
/// How far ahead a challenge's deadline may be (ms): a later one is no broker's.
const MAX_AHEAD_MS: i64 = 600_000;

/// What the workers need.
pub struct ProverSetup {
    /// The backend of each GPU (its index in leases): its CUDA device on a confidential
    /// machine.
    pub backends: HashMap<u32, Arc<dyn Backend>>,
    /// The backend for a GPU without one of its own: the CPU on a simulated machine; `None`
    /// on a confidential one (an attested GPU without a CUDA device cannot prove, and the
    /// broker counts the misses on that GPU).
    pub fallback: Option<Arc<dyn Backend>>,
    pub client: BrokerClient,
    pub node_id: String,
    pub node_pkcs8: Vec<u8>,
    pub node_raw: [u8; 32],
}

impl std::fmt::Debug for ProverSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ProverSetup({})", self.node_id)
    }
}

type Answers = Arc<Mutex<HashMap<(String, u64), PowAnswer>>>;

/// The daemon's handle on its workers: one thread per GPU, so eight GPUs' challenges are
/// proved side by side, each within its own deadline.
pub struct Prover {
    setup: Arc<ProverSetup>,
    workers: HashMap<u32, mpsc::SyncSender<PowChallenge>>,
    seen: HashSet<String>,
    /// (lease, GPU) with a challenge queued or being proved: one at a time each.
    busy: Arc<Mutex<HashSet<(String, u32)>>>,
    answers: Answers,
}

impl std::fmt::Debug for Prover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Prover({} seen)", self.seen.len())
    }
}

impl Prover {
    pub fn start(setup: ProverSetup) -> Prover {
        let mut on: Vec<String> = setup
            .backends
            .iter()
            .map(|(g, b)| format!("GPU {g}: {}", b.name()))
            .collect();
        on.sort();
        if let Some(f) = &setup.fallback {
            on.push(format!("otherwise {}", f.name()));
        }
        log(format_args!("proof of work on {}", on.join("; ")));
        Prover {
            setup: Arc::new(setup),
            workers: HashMap::new(),
            seen: HashSet::new(),
            busy: Arc::new(Mutex::new(HashSet::new())),
            answers: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// GPU `gpu`'s worker, started on its first challenge.
    fn worker(&mut self, gpu: u32) -> &mpsc::SyncSender<PowChallenge> {
        let (setup, busy, answers) = (self.setup.clone(), self.busy.clone(), self.answers.clone());
        self.workers.entry(gpu).or_insert_with(|| {
            let (tx, rx) = mpsc::sync_channel::<PowChallenge>(QUEUE);
            std::thread::spawn(move || {
                while let Ok(c) = rx.recv() {
                    let outcome = prove_and_send(&setup, &c);
                    if let Ok(mut b) = busy.lock() {
                        b.remove(&(c.lease.clone(), c.gpu));
                    }
                    match outcome {
                        Ok(root) => {
                            if let Ok(mut a) = answers.lock() {
                                // The window's record carries the first answer of its window.
                                a.entry((c.lease.clone(), c.window)).or_insert(PowAnswer {
                                    challenge: c.id.clone(),
                                    root,
                                });
                            }
                        }
                        Err(e) => log(format_args!(
                            "challenge {} (lease {}, GPU {}): {e}",
                            c.id, c.lease, c.gpu
                        )),
                    }
                }
            });
            tx
        })
    }

    /// Queue the challenges not seen before, one per (lease, GPU) at a time, whose deadline
    /// is in the next ten minutes (the daemon has already kept only its verified leases'
    /// GPUs and sizes it accepts). One not queued now (its GPU busy, its queue full) is
    /// taken when the broker sends it again.
    pub fn offer(&mut self, challenges: &[PowChallenge]) {
        let now_ms = crate::daemon::unix_now().saturating_mul(1000);
        for c in challenges {
            if c.deadline_ms < now_ms || c.deadline_ms > now_ms + MAX_AHEAD_MS {
                continue;
            }
            if self.seen.len() >= SEEN_MAX {
                self.seen.clear();
            }
            if self.seen.contains(&c.id) {
                continue;
            }
            let key = (c.lease.clone(), c.gpu);
            let free = self.busy.lock().is_ok_and(|mut b| b.insert(key.clone()));
            if !free {
                continue;
            }
            if self.worker(c.gpu).try_send(c.clone()).is_ok() {
                self.seen.insert(c.id.clone());
            } else if let Ok(mut b) = self.busy.lock() {
                b.remove(&key);
            }
        }
    }

    /// The answer given in `lease`'s window `window`, if any (taken: one record carries it).
    pub fn answer_for(&self, lease: &str, window: u64) -> Option<PowAnswer> {
        self.answers
            .lock()
            .ok()
            .and_then(|mut a| a.remove(&(lease.to_string(), window)))
    }

    /// Forget a lease's answers (it ended).
    pub fn forget(&self, lease: &str) {
        if let Ok(mut a) = self.answers.lock() {
            a.retain(|(l, _), _| l != lease);
        }
    }
}

/// `call` until it succeeds, fails for a reason other than the network or the broker's load,
/// or `deadline_ms` (Unix ms) passes.
fn until<T>(
    deadline_ms: i64,
    mut call: impl FnMut() -> Result<T, cgx_broker::client::ClientError>,
) -> Result<T, String> {
    use cgx_broker::client::ClientError;
    loop {
        match call() {
            Ok(v) => return Ok(v),
            Err(e) => {
                let again = matches!(e, ClientError::Transport { .. })
                    || matches!(&e, ClientError::Refused { status, .. } if *status >= 500 || *status == 429);
                if !again || crate::daemon::unix_now().saturating_mul(1000) + 250 > deadline_ms {
                    return Err(e.to_string());
                }
                std::thread::sleep(std::time::Duration::from_millis(250));
            }
        }
    }
}

/// Prove `c`: commit, receive the opening, open. The root (hex) the broker took.
fn prove_and_send(s: &ProverSetup, c: &PowChallenge) -> Result<String, String> {
    let now_ms = crate::daemon::unix_now().saturating_mul(1000);
    if now_ms > c.deadline_ms {
        return Err("its deadline passed before it could be proved".into());
    }
    let nonce = hex::decode(&c.nonce)
        .ok()
        .filter(|n| n.len() == 32)
        .ok_or("its nonce is not 32 bytes of hex")?;
    let ch = Challenge {
        seed: seed(&nonce, &c.lease, c.window, &s.node_raw, c.gpu),
        params: Params { n: c.n, k: c.k },
    };
    let backend = s
        .backends
        .get(&c.gpu)
        .or(s.fallback.as_ref())
        .ok_or("no CUDA device for this GPU: it cannot prove")?;
    let (held, ms) = backend.commit(&ch).map_err(|e| e.to_string())?;
    let root = hex::encode(held.root());
    let signer =
        cgx_protocol::signed::Signer::from_pkcs8(&s.node_pkcs8).map_err(|e| e.to_string())?;
    let mut receipt = PowReceipt {
        sub: s.node_id.clone(),
        challenge: c.id.clone(),
        root: root.clone(),
        proof_sha256: String::new(),
        gpu_us: (ms * 1e3) as u64,
        backend: backend.name(),
    };
    let now = crate::daemon::unix_now();
    let token = signer
        .sign(&receipt, now, now + 300)
        .map_err(|e| e.to_string())?;
    let opening = until(c.deadline_ms, || {
        s.client.pow_commit(&s.node_id, &c.id, &token)
    })
    .map_err(|e| format!("commitment refused: {e}"))?;
    let o: [u8; 32] = hex::decode(&opening.opening)
        .ok()
        .and_then(|o| o.try_into().ok())
        .ok_or("the broker's opening is not 32 bytes of hex")?;
    let bytes = cgx_pow::wire::encode(&held.open(&o).map_err(|e| e.to_string())?);
    receipt.proof_sha256 =
        hex::encode(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &bytes).as_ref());
    let now = crate::daemon::unix_now();
    let token = signer
        .sign(&receipt, now, now + 300)
        .map_err(|e| e.to_string())?;
    until(opening.deadline_ms, || {
        s.client.pow_proof(&s.node_id, &c.id, &token, &bytes)
    })
    .map_err(|e| format!("proof refused: {e}"))?;
    log(format_args!(
        "challenge {} (lease {}, GPU {}, n = {}): committed after {ms:.1} ms on {}, opened, answered",
        c.id,
        c.lease,
        c.gpu,
        c.n,
        backend.name()
    ));
    Ok(root)
}
