//! Who computes a challenge: the CPU here, the GPU in the agent's CUDA backend. A backend
//! commits (computes the product and the root of its rows, and keeps the rows), then opens
//! what the verifier's opening selects; the bytes do not depend on which backend ran.

use cgx_protocol::merkle::Hash;

use crate::PowError;
use crate::challenge::{Challenge, Matrix, matrix};
use crate::proof::{Committed, Proof};

/// A commitment and the rows behind it, kept until the opening arrives.
pub trait Held: Send {
    fn root(&self) -> Hash;
    /// The proof for the verifier's `opening`.
    fn open(&self, opening: &[u8; 32]) -> Result<Proof, PowError>;
}

/// A prover of challenges.
pub trait Backend: Send + Sync {
    /// What it runs on, for logs and benchmarks (`cpu (2 threads)`, `cuda: NVIDIA H100 …`).
    fn name(&self) -> String;
    /// Compute `ch`'s product and commit to its rows: what is held for the opening, and the
    /// time the work took on the device (ms) — what the agent signs.
    fn commit(&self, ch: &Challenge) -> Result<(Box<dyn Held>, f64), PowError>;
}

/// Commit and open at once (tests, benchmarks).
pub fn prove(
    b: &dyn Backend,
    ch: &Challenge,
    opening: &[u8; 32],
) -> Result<(Proof, f64), PowError> {
    let (held, ms) = b.commit(ch)?;
    Ok((held.open(opening)?, ms))
}

/// The rows of C in memory, and their commitment.
struct InMemory {
    c: Vec<i32>,
    committed: Committed,
}

impl Held for InMemory {
    fn root(&self) -> Hash {
        self.committed.root()
    }

    fn open(&self, opening: &[u8; 32]) -> Result<Proof, PowError> {
        let n = self.committed.n as usize;
        self.committed.open(opening, |i| {
            self.c
                .get(i as usize * n..(i as usize + 1) * n)
                .map(<[i32]>::to_vec)
                .ok_or_else(|| PowError::Shape(format!("no row {i}")))
        })
    }
}

/// The CPU backend: [`crate::cpu`] on `threads` cores.
#[derive(Debug, Clone, Copy)]
pub struct Cpu {
    pub threads: usize,
}

fn commit_in_memory(
    ch: &Challenge,
    threads: usize,
    skip_percent: u32,
) -> Result<(Box<dyn Held>, f64), PowError> {
    ch.params.check()?;
    let t = std::time::Instant::now();
    let n = ch.params.n as usize;
    let mut a = matrix(&ch.seed, Matrix::A, ch.params.n);
    let b = matrix(&ch.seed, Matrix::B, ch.params.n);
    if skip_percent > 0 {
        // Row i skipped when (i · 7919) mod 100 falls below the percentage: spread over C.
        for (i, row) in a.chunks_mut(n).enumerate() {
            if (i as u64 * 7919 % 100) < u64::from(skip_percent) {
                row.fill(0);
            }
        }
    }
    let c = crate::cpu::product(&a, &b, n, threads);
    let committed = Committed::new(ch, crate::cpu::leaves(&c, n, threads))?;
    Ok((
        Box::new(InMemory { c, committed }),
        t.elapsed().as_secs_f64() * 1e3,
    ))
}

impl Backend for Cpu {
    fn name(&self) -> String {
        format!("cpu ({} threads)", self.threads)
    }

    fn commit(&self, ch: &Challenge) -> Result<(Box<dyn Held>, f64), PowError> {
        commit_in_memory(ch, self.threads, 0)
    }
}

/// A prover that skips work: it computes only some rows of the product and leaves the others
/// zero — the cheat the proof exists to catch. For the simulated node's `--sim-cheat-pow` and
/// the tests; no real node has a way to select it (the flag is refused without `--sim`).
#[derive(Debug, Clone, Copy)]
pub struct SkipRows {
    pub threads: usize,
    /// Rows skipped, percent (1–100).
    pub percent: u32,
}

impl Backend for SkipRows {
    fn name(&self) -> String {
        format!("cheating cpu (skips {}% of rows)", self.percent)
    }

    fn commit(&self, ch: &Challenge) -> Result<(Box<dyn Held>, f64), PowError> {
        commit_in_memory(ch, self.threads, self.percent.clamp(1, 100))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::challenge::{Params, seed};
    use crate::proof::Verifier;

    #[test]
    fn the_cpu_proves_and_a_row_skipper_is_refused() {
        let ch = Challenge {
            seed: seed(b"nonce", "l1", 0, b"key", 0),
            params: Params { n: 256, k: 66 },
        };
        let v = Verifier::new(ch).unwrap();
        let opening = [3u8; 32];
        let (held, ms) = Cpu { threads: 2 }.commit(&ch).unwrap();
        assert!(ms >= 0.0);
        let p = held.open(&opening).unwrap();
        v.verify(&held.root(), &opening, &p).unwrap();
        let cheat = SkipRows {
            threads: 2,
            percent: 10,
        };
        let (held, _) = cheat.commit(&ch).unwrap();
        let bad = held.open(&opening).unwrap();
        assert!(matches!(
            v.verify(&held.root(), &opening, &bad),
            Err(PowError::Cell { .. })
        ));
    }
}
