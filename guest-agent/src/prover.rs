//! The proof-of-work worker: challenges from heartbeat answers are proved one at a time on a
//! thread of their own (the daemon's loop never waits on a product), each answered once with
//! a receipt under the node key (`cgx_protocol::broker::PowReceipt`), and the root remembered
//! for the metering record of the window it fell in.

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
    tx: mpsc::Sender<PowChallenge>,
    seen: HashSet<String>,
    answers: Arc<Mutex<HashMap<(String, u64), PowAnswer>>>,
}

impl std::fmt::Debug for Prover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Prover({} seen)", self.seen.len())
    }
}

impl Prover {
    pub fn start(setup: ProverSetup) -> Prover {
        let (tx, rx) = mpsc::channel::<PowChallenge>();
        let answers = Arc::new(Mutex::new(HashMap::new()));
        let mine = answers.clone();
        log(format_args!("proof of work on {}", setup.backend.name()));
        std::thread::spawn(move || {
            while let Ok(c) = rx.recv() {
                match prove_and_send(&setup, &c) {
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
            answers,
        }
    }

    /// Queue the challenges not seen before.
    pub fn offer(&mut self, challenges: &[PowChallenge]) {
        for c in challenges {
            if self.seen.len() >= SEEN_MAX {
                self.seen.clear();
            }
            if self.seen.insert(c.id.clone()) {
                let _ = self.tx.send(c.clone());
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

/// Prove `c` and send the answer: the root (hex) the broker accepted for its verdict.
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
    let (proof, ms) = backend.prove(&ch).map_err(|e| e.to_string())?;
    let bytes = cgx_pow::wire::encode(&proof);
    let root = hex::encode(proof.root);
    let receipt = PowReceipt {
        sub: s.node_id.clone(),
        challenge: c.id.clone(),
        root: root.clone(),
        proof_sha256: hex::encode(
            aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &bytes).as_ref(),
        ),
        gpu_us: (ms * 1e3) as u64,
        backend: backend.name(),
    };
    let now = crate::daemon::unix_now();
    let token = cgx_protocol::signed::Signer::from_pkcs8(&s.node_pkcs8)
        .and_then(|k| k.sign(&receipt, now, now + 300))
        .map_err(|e| e.to_string())?;
    s.client
        .pow(&s.node_id, &c.id, &token, &bytes)
        .map_err(|e| format!("answer refused: {e}"))?;
    log(format_args!(
        "challenge {} (lease {}, GPU {}, n = {}): proved in {ms:.1} ms, answered",
        c.id, c.lease, c.gpu, c.n
    ));
    Ok(root)
}
