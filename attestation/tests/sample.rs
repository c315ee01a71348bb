#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! CoCo's unsigned sample evidence: refused unless the verifier is told to take it, and then
//! always reported as simulated debug evidence — also as the CPU part of composite evidence.

use cgx_attestation::binding::{CompositeEvidence, verify_composite};
use cgx_attestation::sample::SampleEvidence;
use cgx_attestation::{Evidence, Verifier, VerifierConfig};
use time::OffsetDateTime;

#[test]
fn sample_evidence_only_where_allowed_and_always_sim() {
    let now = OffsetDateTime::now_utc();
    let svn = serde_json::json!("1");
    let ev = Evidence::Sample(SampleEvidence {
        report_data: &[7; 16],
        svn: &svn,
        device: false,
    });
    let strict = Verifier::new(VerifierConfig::default());
    assert_eq!(
        strict.verify(&ev, now).unwrap_err().code(),
        "untrusted_root"
    );
    let composite = CompositeEvidence {
        cpu: ev,
        gpus: vec![],
        nonce: b"n",
        node_pubkey: b"k",
    };
    assert_eq!(
        verify_composite(&strict, &composite, now)
            .unwrap_err()
            .code(),
        "untrusted_root"
    );
    let dev = Verifier::new(VerifierConfig::default()).allowing_sample(true);
    let c = dev.verify(&ev, now).unwrap().into_claims();
    assert!(c.sim && c.debug);
    assert_eq!(c.kind.as_str(), "sample");
    let too_long = Evidence::Sample(SampleEvidence {
        report_data: &[0; 65],
        svn: &svn,
        device: false,
    });
    assert_eq!(
        dev.verify(&too_long, now).unwrap_err().code(),
        "invalid_field"
    );
    // The sample device twin: its own kind, as simulated.
    let device = Evidence::Sample(SampleEvidence {
        report_data: &[9; 48],
        svn: &svn,
        device: true,
    });
    assert!(strict.verify(&device, now).is_err());
    let c = dev.verify(&device, now).unwrap().into_claims();
    assert!(c.sim && c.debug);
    assert_eq!(c.kind.as_str(), "sampledevice");
    assert_eq!(
        serde_json::to_value(&c).unwrap()["kind"],
        serde_json::json!("sampledevice")
    );
}
