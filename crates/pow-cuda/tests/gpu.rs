//! The CUDA backend against the CPU backend, wherever a GPU is: the same challenge gives the
//! same proof, bit for bit (root, y, the opened rows and their paths), and the broker's
//! verifier accepts it. Skipped, visibly, on a host without CUDA.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use cgx_pow::Backend;
use cgx_pow::backend::{Cpu, prove};
use cgx_pow::challenge::{Challenge, Params, seed};
use cgx_pow::proof::Verifier;

#[test]
fn the_gpu_proves_what_the_cpu_proves() {
    if !cgx_pow_cuda::driver_present() {
        eprintln!("SKIPPED: no CUDA driver on this host (the GPU path is not run here)");
        return;
    }
    let gpu = match cgx_pow_cuda::Cuda::open(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("SKIPPED: CUDA present but not usable: {e}");
            return;
        }
    };
    for n in [256u32, 1024] {
        let ch = Challenge {
            seed: seed(b"nonce", "lease", 1, b"node key", 0),
            params: Params { n, k: 66 },
        };
        let opening = [7u8; 32];
        let (on_gpu, ms) = prove(&gpu, &ch, &opening).unwrap();
        let (on_cpu, _) = prove(&Cpu { threads: 2 }, &ch, &opening).unwrap();
        assert_eq!(on_gpu, on_cpu, "n = {n}");
        Verifier::new(ch)
            .unwrap()
            .verify(&on_cpu.root, &opening, &on_gpu)
            .unwrap();
        eprintln!("{}: n = {n} proved in {ms:.2} ms", gpu.name());
    }
}
