//! The fuzz target `pow_proof`'s seed: an honest proof of its challenge (n = 16, k = 4),
//! written where `CGX_WRITE_FUZZ_SEED` says (the committed corpus was made so); otherwise the
//! seed's bytes are only checked to decode and verify.

#![allow(clippy::unwrap_used)]

use cgx_pow::backend::{Cpu, prove};
use cgx_pow::challenge::{Challenge, Params, seed};

#[test]
fn the_fuzz_seed_is_an_honest_proof() {
    let params = Params { n: 16, k: 4 };
    let ch = Challenge {
        seed: seed(b"fuzz", "lease", 0, b"node key", 0),
        params,
    };
    let (p, _) = prove(&Cpu { threads: 1 }, &ch, &[7u8; 32]).unwrap();
    let bytes = cgx_pow::wire::encode(&p);
    let v = cgx_pow::proof::Verifier::new(ch).unwrap();
    v.verify(
        &p.root,
        &[7u8; 32],
        &cgx_pow::wire::decode(&bytes, params).unwrap(),
    )
    .unwrap();
    if let Ok(path) = std::env::var("CGX_WRITE_FUZZ_SEED") {
        std::fs::write(path, &bytes).unwrap();
    }
}
