#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Attestation results: appraise simulated evidence, sign an EAR, verify it as a relying party
//! would (jsonwebtoken via the `ear` crate), and refuse tampered, foreign-key and expired ones.

use base64::Engine;
use cgx_attestation::appraisal::{Appraiser, PolicyEngine, Tier};
use cgx_attestation::results::{self, ResultSigner};
use cgx_attestation::sim::{SimAmd, SnpReportOptions, default_tcb};
use cgx_attestation::snp::{Product, SigningKey};
use cgx_attestation::{SimTrust, Verifier, VerifierConfig};
use time::OffsetDateTime;

const POLICY: &str = r#"package cgx.appraisal
import rego.v1
affirming := {"instance-identity": 2, "configuration": 2, "executables": 2, "hardware": 2}
violations contains v if {
	not input.measurement in data.reference.measurements
	v := {"rule": "measurement", "claim": "executables", "code": 33, "value": input.measurement, "expected": "listed"}
}
result := {"affirming": affirming, "violations": [v | some v in violations]}
"#;

#[test]
fn ear_round_trip_and_refusals() {
    let now = OffsetDateTime::now_utc();
    let t = now.unix_timestamp();
    let amd = SimAmd::generate(
        Product::Milan,
        SigningKey::Vcek,
        default_tcb(Product::Milan),
        [5; 64],
        t,
    )
    .unwrap();
    let bundle = amd
        .bundle(&SnpReportOptions {
            measurement: [0xAB; 48],
            ..Default::default()
        })
        .unwrap();
    let refs = format!(r#"{{"measurements": ["{}"]}}"#, hex::encode([0xABu8; 48]));
    let appraiser = Appraiser {
        verifier: Verifier::new(VerifierConfig {
            sim: SimTrust::Pinned(vec![amd.root_pin()]),
        }),
        engine: PolicyEngine::new("test", POLICY, &refs).unwrap(),
        signer: ResultSigner::generate().unwrap(),
    };
    let nonce = b"0123456789abcdef";
    let node_key = [7u8; 32];
    let a = appraiser
        .appraise(&bundle.evidence(), now, t, Some(nonce), Some(&node_key))
        .unwrap();
    assert_eq!(a.outcome.status, Tier::Affirming);

    // A relying party verifies with the published JWK.
    let jwks = appraiser.signer.jwks();
    let jwk = &jwks["keys"][0];
    assert_eq!(jwk["kid"], appraiser.signer.kid());
    let ear = results::verify(&a.token, jwk, t).unwrap();
    assert_eq!(results::tier(&ear.status.unwrap()), Tier::Affirming);
    assert_eq!(ear.exp, Some(t + results::DEFAULT_TTL_SECS));
    let json = serde_json::to_value(&ear).unwrap();
    let sub = &json["submods"]["snp"];
    assert_eq!(sub["ear_trustworthiness_vector"]["executables"], 2);
    let claims_digest = results::claims_digest(&a.claims).unwrap();
    assert_eq!(
        sub["ear_verifier_claims"]["cgx.claims-sha256"],
        hex::encode(claims_digest)
    );
    assert_eq!(
        sub["ear_verifier_claims"]["cgx.node-key"],
        hex::encode(node_key)
    );
    assert!(
        sub["ear_appraisal_policy_ids"][0]
            .as_str()
            .unwrap()
            .starts_with("test@sha256:")
    );
    assert!(json.get("eat_nonce").is_some(), "{json}");
    // The kid is in the protected header.
    let header = a.token.split('.').next().unwrap();
    let header: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(header)
            .unwrap(),
    )
    .unwrap();
    assert_eq!(header["alg"], "ES256");
    assert_eq!(header["kid"], appraiser.signer.kid());

    // Refusals: another key, a tampered payload, an expired result.
    let other = ResultSigner::generate().unwrap();
    assert_eq!(
        results::verify(&a.token, &other.jwk(), t)
            .unwrap_err()
            .code(),
        "result_error"
    );
    let mut parts: Vec<String> = a.token.split('.').map(str::to_string).collect();
    let mut payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(&parts[1])
        .unwrap();
    let s = String::from_utf8(payload.clone())
        .unwrap()
        .replace("\"affirming\"", "\"warning\"");
    payload = s.into_bytes();
    parts[1] = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(payload);
    assert!(results::verify(&parts.join("."), jwk, t).is_err());
    assert!(results::verify(&a.token, jwk, t + results::DEFAULT_TTL_SECS + 1).is_err());

    // Unrecognized measurement: warning, with the violation in the result.
    let bundle = amd.bundle(&SnpReportOptions::default()).unwrap();
    let w = appraiser
        .appraise(&bundle.evidence(), now, t, None, None)
        .unwrap();
    assert_eq!(w.outcome.status, Tier::Warning);
    let ear = results::verify(&w.token, jwk, t).unwrap();
    let json = serde_json::to_value(&ear).unwrap();
    let violations = &json["submods"]["snp"]["ear_verifier_claims"]["cgx.violations"];
    assert!(
        violations[0]
            .as_str()
            .unwrap()
            .starts_with("measurement [executables 33]")
    );

    // A key from PKCS#8 keeps its identity; garbage is refused.
    assert!(ResultSigner::from_pkcs8(b"not a key").is_err());
}
