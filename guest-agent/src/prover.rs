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

/// What a worker needs.
pub struct ProverSetup {
    /// The backend of each GPU (its index in leases), and the one for any other.
    pub backends: HashMap<u32, Arc<dyn Backend>>,
    pub backend: Arc<dyn Backend>,
    pub client: BrokerClient,
    pub node_id: String,
    pub node_pkcs8: Vec<u8>,
    pub node_raw: [u8; 32],
}

impl std::fmt::Debug for ProverSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ProverSetup({}, {})", self.node_id, self.backend.name())
    }
}

/// The daemon's handle on its worker.
pub struct Prover {
    tx: mpsc::SyncSender<PowChallenge>,
    seen: HashSet<String>,
    /// (lease, GPU) with a challenge queued or being proved: one at a time each.
    busy: Arc<Mutex<HashSet<(String, u32)>>>,
    answers: Arc<Mutex<HashMap<(String, u64), PowAnswer>>>,
}

impl std::fmt::Debug for Prover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Prover({} seen)", self.seen.len())
    }
}

impl Prover {
    pub fn start(setup: ProverSetup) -> Prover {
        let (tx, rx) = mpsc::sync_channel::<PowChallenge>(QUEUE);
        let answers = Arc::new(Mutex::new(HashMap::new()));
        let mine = answers.clone();
        let busy = Arc::new(Mutex::new(HashSet::new()));
        let done = busy.clone();
        log(format_args!("proof of work on {}", setup.backend.name()));
        std::thread::spawn(move || {
            while let Ok(c) = rx.recv() {
                let outcome = prove_and_send(&setup, &c);
                if let Ok(mut b) = done.lock() {
                    b.remove(&(c.lease.clone(), c.gpu));
                }
                match outcome {
                    Ok(root) => {
                        if let Ok(mut a) = mine.lock() {
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
        Prover {
            tx,
            seen: HashSet::new(),
            busy,
            answers,
        }
    }

    /// Queue the challenges not seen before, one per (lease, GPU) at a time, whose deadline
    /// is in the next ten minutes (the daemon has already kept only its verified leases'
    /// GPUs and sizes it accepts).
    pub fn offer(&mut self, challenges: &[PowChallenge]) {
        let now_ms = crate::daemon::unix_now().saturating_mul(1000);
        for c in challenges {
            if c.deadline_ms < now_ms || c.deadline_ms > now_ms + MAX_AHEAD_MS {
                continue;
            }
            if self.seen.len() >= SEEN_MAX {
                self.seen.clear();
            }
            if !self.seen.insert(c.id.clone()) {
                continue;
            }
            let Ok(mut busy) = self.busy.lock() else {
                return;
            };
            if busy.insert((c.lease.clone(), c.gpu)) && self.tx.try_send(c.clone()).is_err() {
                busy.remove(&(c.lease.clone(), c.gpu));
                self.seen.remove(&c.id);
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
    let backend = s.backends.get(&c.gpu).unwrap_or(&s.backend);
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
