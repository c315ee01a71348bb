//! Who computes a challenge: the CPU here, the GPU in the agent's CUDA backend. A backend
//! takes a challenge and returns its proof; the proof's bytes do not depend on which one ran.

use crate::PowError;
use crate::challenge::{Challenge, Matrix, matrix};
use crate::proof::{Proof, prove};

/// A prover of challenges.
pub trait Backend: Send + Sync {
    /// What it runs on, for logs and benchmarks (`cpu (2 threads)`, `cuda: NVIDIA H100 …`).
    fn name(&self) -> String;
    /// The proof of `ch`, and the time the work took on the device (ms): what the agent signs.
    fn prove(&self, ch: &Challenge) -> Result<(Proof, f64), PowError>;
}

/// The CPU backend: [`crate::cpu`] on `threads` cores.
#[derive(Debug, Clone, Copy)]
pub struct Cpu {
    pub threads: usize,
}

impl Backend for Cpu {
    fn name(&self) -> String {
        format!("cpu ({} threads)", self.threads)
    }

    fn prove(&self, ch: &Challenge) -> Result<(Proof, f64), PowError> {
        ch.params.check()?;
        let t = std::time::Instant::now();
        let n = ch.params.n;
        let a = matrix(&ch.seed, Matrix::A, n);
        let b = matrix(&ch.seed, Matrix::B, n);
        let c = crate::cpu::product(&a, &b, n as usize, self.threads);
        let leaves = crate::cpu::leaves(&c, n as usize, self.threads);
        let p = prove(ch, &c, leaves)?;
        Ok((p, t.elapsed().as_secs_f64() * 1e3))
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

    fn prove(&self, ch: &Challenge) -> Result<(Proof, f64), PowError> {
        ch.params.check()?;
        let t = std::time::Instant::now();
        let n = ch.params.n as usize;
        let mut a = matrix(&ch.seed, Matrix::A, ch.params.n);
        let b = matrix(&ch.seed, Matrix::B, ch.params.n);
        // Row i skipped when i·percent mod 100 falls below percent: spread over the matrix.
        for (i, row) in a.chunks_mut(n).enumerate() {
            if (i as u64 * 7919 % 100) < u64::from(self.percent) {
                row.fill(0);
            }
        }
        let c = crate::cpu::product(&a, &b, n, self.threads);
        let leaves = crate::cpu::leaves(&c, n, self.threads);
        let p = prove(ch, &c, leaves)?;
        Ok((p, t.elapsed().as_secs_f64() * 1e3))
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
        let (p, ms) = Cpu { threads: 2 }.prove(&ch).unwrap();
        assert!(ms >= 0.0);
        v.verify(&p).unwrap();
        let (bad, _) = SkipRows {
            threads: 2,
            percent: 10,
        }
        .prove(&ch)
        .unwrap();
        assert!(matches!(
            v.verify(&bad),
            Err(PowError::Row { .. } | PowError::Product { .. })
        ));
    }
}
