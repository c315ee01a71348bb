#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Composite binding: one CPU report bound to a nonce, a node key and its GPUs' evidence.

use cgx_attestation::binding::{self, CompositeEvidence, verify_composite};
use cgx_attestation::bundle::Bundle;
use cgx_attestation::nvidia::NvidiaEvidence;
use cgx_attestation::sim::{SimAmd, SimGpu, SnpReportOptions, default_tcb};
use cgx_attestation::snp::{Product, SigningKey};
use cgx_attestation::{SimTrust, Verifier, VerifierConfig};
use time::OffsetDateTime;

struct Node {
    cpu: Bundle,
    gpus: Vec<Bundle>,
}

fn gpu_parts(b: &Bundle) -> (&[u8], &[u8]) {
    let Bundle::Nvidia {
        report, cert_chain, ..
    } = b
    else {
        panic!()
    };
    (report, cert_chain)
}

fn node(amd: &SimAmd, gpus: &[SimGpu], nonce: &[u8], key: &[u8]) -> Node {
    let gpus: Vec<Bundle> = gpus
        .iter()
        .enumerate()
        .map(|(i, g)| {
            g.bundle(binding::gpu_nonce(nonce, key, i as u32), 8)
                .unwrap()
        })
        .collect();
    let parts: Vec<(&[u8], &[u8])> = gpus.iter().map(gpu_parts).collect();
    let rd = binding::report_data(nonce, key, &binding::gpu_evidence_digest(&parts));
    let cpu = amd
        .bundle(&SnpReportOptions {
            report_data: rd,
            ..Default::default()
        })
        .unwrap();
    Node { cpu, gpus }
}

fn composite<'a>(
    n: &'a Node,
    order: &[usize],
    nonce: &'a [u8],
    key: &'a [u8],
) -> CompositeEvidence<'a> {
    CompositeEvidence {
        cpu: n.cpu.evidence(),
        gpus: order
            .iter()
            .map(|&i| {
                let (report, cert_chain) = gpu_parts(&n.gpus[i]);
                NvidiaEvidence {
                    report,
                    cert_chain,
                    expected_nonce: None,
                    ocsp: &[],
                }
            })
            .collect(),
        nonce,
        node_pubkey: key,
    }
}

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
    let n = node(&amd, &gpus, nonce, &key);

    let ok = verify_composite(&v, &composite(&n, &[0, 1], nonce, &key), now).unwrap();
    assert_eq!(ok.gpus().count(), 2);
    assert_eq!(ok.node_pubkey(), key);

    let code = |ev: &CompositeEvidence<'_>| verify_composite(&v, ev, now).unwrap_err().code();
    // Reordered GPUs: GPU 0 now presents the nonce made for index 1.
    assert_eq!(
        code(&composite(&n, &[1, 0], nonce, &key)),
        "binding_mismatch"
    );
    // Another nonce or another node key.
    assert_eq!(
        code(&composite(&n, &[0, 1], b"broker-nonce-0002", &key)),
        "binding_mismatch"
    );
    assert_eq!(
        code(&composite(&n, &[0, 1], nonce, &[8u8; 32])),
        "binding_mismatch"
    );
    // A GPU dropped.
    assert_eq!(code(&composite(&n, &[0], nonce, &key)), "binding_mismatch");
    // A GPU report swapped for another valid one with the right nonce: only the CPU's digest
    // of the GPU evidence catches it.
    let other = SimGpu::generate(t).unwrap();
    let swapped = other.bundle(binding::gpu_nonce(nonce, &key, 1), 8).unwrap();
    let mut n2 = Node {
        cpu: n.cpu.clone(),
        gpus: n.gpus.clone(),
    };
    n2.gpus[1] = swapped;
    let e = verify_composite(&v, &composite(&n2, &[0, 1], nonce, &key), now).unwrap_err();
    assert_eq!(e.code(), "binding_mismatch");
    assert!(e.to_string().contains("CPU report_data"), "{e}");
    // A GPU-only composite is refused.
    let bad = CompositeEvidence {
        cpu: n.gpus[0].evidence(),
        ..composite(&n, &[0], nonce, &key)
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

#[test]
fn composite_appraisal_is_one_ear_with_a_submod_per_piece() {
    use cgx_attestation::appraisal::{Appraiser, PolicyEngine, Tier};
    use cgx_attestation::results::{self, ResultSigner};
    let now = OffsetDateTime::now_utc();
    let t = now.unix_timestamp();
    let amd = SimAmd::generate(
        Product::Turin,
        SigningKey::Vcek,
        default_tcb(Product::Turin),
        [4; 64],
        t,
    )
    .unwrap();
    let gpus = [SimGpu::generate(t).unwrap()];
    let (nonce, key) = (b"n-123456".as_slice(), [6u8; 32]);
    let n = node(&amd, &gpus, nonce, &key);
    let policy = r#"package cgx.appraisal
import rego.v1
result := {"affirming": {"hardware": 2}, "violations": [v | input.kind == "nvidia"; v := {"rule": "gpu_flag", "claim": "runtime-opaque", "code": 33, "value": input.kind, "expected": "x"}]}
"#;
    let appraiser = Appraiser {
        verifier: Verifier::new(VerifierConfig { sim: SimTrust::Any }),
        engine: PolicyEngine::new("composite", policy, "{}").unwrap(),
        signer: ResultSigner::generate().unwrap(),
    };
    let a = appraiser
        .appraise_composite(&composite(&n, &[0], nonce, &key), now, t)
        .unwrap();
    assert_eq!(a.parts.len(), 2);
    assert_eq!(a.parts[0].2.status, Tier::Affirming);
    assert_eq!(a.status, Tier::Warning);
    let ear = results::verify(&a.token, &appraiser.signer.jwk(), t).unwrap();
    let json = serde_json::to_value(&ear).unwrap();
    assert_eq!(json["ear_status"], "warning");
    assert_eq!(
        json["submods"]["cpu"]["ear_verifier_claims"]["cgx.node-key"],
        hex::encode(key)
    );
    assert_eq!(
        json["submods"]["gpu0"]["ear_trustworthiness_vector"]["runtime-opaque"],
        33
    );
    // A broken binding yields no result at all.
    let e = appraiser
        .appraise_composite(&composite(&n, &[0], b"other", &key), now, t)
        .unwrap_err();
    assert_eq!(e.code(), "binding_mismatch");
}
