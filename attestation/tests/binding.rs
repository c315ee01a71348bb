#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Composite binding: one CPU report bound to a nonce, a node key and its GPUs' evidence.

use cgx_attestation::binding::{self, CompositeEvidence, verify_composite};
use cgx_attestation::sim::{SimAmd, SimGpu, default_tcb};
use cgx_attestation::snp::{Product, SigningKey};
use cgx_attestation::{SimTrust, Verifier, VerifierConfig};
use time::OffsetDateTime;

#[test]
fn binding_holds_and_every_swap_breaks_it() {
    let now = OffsetDateTime::now_utc();
    let t = now.unix_timestamp();
    let amd = SimAmd::generate(
        Product::Genoa,
        SigningKey::Vcek,
        default_tcb(Product::Genoa),
        [3; 64],
        t,
    )
    .unwrap();
    let gpus = [SimGpu::generate(t).unwrap(), SimGpu::generate(t).unwrap()];
    let v = Verifier::new(VerifierConfig { sim: SimTrust::Any });
    let (nonce, key) = (b"broker-nonce-0001".as_slice(), [9u8; 32]);
    let n = amd.composite(&gpus, nonce, &key).unwrap();

    let ok = verify_composite(&v, &n.evidence(&[0, 1], nonce, &key), now).unwrap();
    assert_eq!(ok.gpus().count(), 2);
    assert_eq!(ok.node_pubkey(), key);

    let code = |ev: &CompositeEvidence<'_>| verify_composite(&v, ev, now).unwrap_err().code();
    // Reordered GPUs: GPU 0 now presents the nonce made for index 1.
    assert_eq!(code(&n.evidence(&[1, 0], nonce, &key)), "binding_mismatch");
    // Another nonce or another node key.
    assert_eq!(
        code(&n.evidence(&[0, 1], b"broker-nonce-0002", &key)),
        "binding_mismatch"
    );
    assert_eq!(
        code(&n.evidence(&[0, 1], nonce, &[8u8; 32])),
        "binding_mismatch"
    );
    // A GPU dropped.
    assert_eq!(code(&n.evidence(&[0], nonce, &key)), "binding_mismatch");
    // A GPU report swapped for another valid one with the right nonce: only the CPU's digest
    // of the GPU evidence catches it.
    let other = SimGpu::generate(t).unwrap();
    let swapped = other.bundle(binding::gpu_nonce(nonce, &key, 1), 8).unwrap();
    let mut n2 = n.clone();
    n2.gpus[1] = swapped;
    let e = verify_composite(&v, &n2.evidence(&[0, 1], nonce, &key), now).unwrap_err();
    assert_eq!(e.code(), "binding_mismatch");
    assert!(e.to_string().contains("CPU report_data"), "{e}");
    // A GPU-only composite is refused.
    let bad = CompositeEvidence {
        cpu: n.gpus[0].evidence(),
        ..n.evidence(&[0], nonce, &key)
    };
    assert_eq!(code(&bad), "invalid_field");
}

#[test]
fn encodings_are_unambiguous() {
    // Moving a byte between nonce and key changes every derived value.
    let a = binding::gpu_nonce(b"ab", b"c", 0);
    let b = binding::gpu_nonce(b"a", b"bc", 0);
    assert_ne!(a, b);
    let d = binding::gpu_evidence_digest(&[]);
    assert_ne!(
        binding::report_data(b"ab", b"c", &d),
        binding::report_data(b"a", b"bc", &d)
    );
    assert_ne!(
        binding::gpu_evidence_digest(&[(b"ab", b"c")]),
        binding::gpu_evidence_digest(&[(b"a", b"bc")])
    );
    assert_ne!(
        binding::gpu_nonce(b"n", b"k", 0),
        binding::gpu_nonce(b"n", b"k", 1)
    );
}
