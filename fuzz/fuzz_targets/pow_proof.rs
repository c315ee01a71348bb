//! A proof's bytes as a hostile node sends them: decoded for a challenge of n = 16, k = 4
//! (a proof that decodes encodes back to the same bytes), then verified against the
//! challenge, a root and an opening — refused or accepted, never a panic.
#![no_main]

use cgx_pow::challenge::{Challenge, Params, seed};
use cgx_pow::proof::Verifier;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let params = Params { n: 16, k: 4 };
    let Ok(p) = cgx_pow::wire::decode(data, params) else {
        return;
    };
    assert_eq!(cgx_pow::wire::encode(&p), data, "a decoded proof encodes back");
    let ch = Challenge {
        seed: seed(b"fuzz", "lease", 0, b"node key", 0),
        params,
    };
    let v = Verifier::new(ch).expect("a valid challenge");
    let _ = v.verify(&p.root, &[7u8; 32], &p);
});
