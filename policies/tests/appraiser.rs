#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The appraiser end to end: appraise simulated evidence, sign an EAR, verify it as a relying
//! party would, and refuse tampered, foreign-key, wrong-algorithm and expired ones; composite
//! evidence gives one EAR with a part per piece, named as Trustee names them.

use base64::Engine;
use cgx_attestation::results::{self, CPU_PART, ResultSigner, Tier};
use cgx_attestation::sim::{SimAmd, SimGpu, SnpReportOptions, default_tcb};
use cgx_attestation::snp::{Product, SigningKey};
use cgx_attestation::{SimTrust, Verifier, VerifierConfig};
use cgx_policies::{Appraiser, PolicyEngine};
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
    let appraiser = Appraiser::new(
        Verifier::new(VerifierConfig {
            sim: SimTrust::Pinned(vec![amd.root_pin()]),
        }),
        PolicyEngine::new("test", POLICY, &refs).unwrap(),
        ResultSigner::generate().unwrap(),
    );
    let nonce = b"0123456789abcdef";
    let node_key = [7u8; 32];
    let a = appraiser
        .appraise(&bundle.evidence(), now, t, Some(nonce), Some(&node_key))
        .unwrap();
    assert_eq!(a.status(), Tier::Affirming);
    assert_eq!(a.first().unwrap().name, CPU_PART);

    // A relying party verifies with the published JWK.
    let jwks = appraiser.signer().jwks();
    let jwk = &jwks["keys"][0];
    assert_eq!(jwk["kid"], appraiser.signer().kid());
    let ear = results::verify(a.token(), jwk, t).unwrap();
    assert_eq!(ear.status, Some(Tier::Affirming));
    assert_eq!(&ear, a.ear());
    assert_eq!(ear.exp, Some(t + results::DEFAULT_TTL_SECS));
    let json = serde_json::to_value(&ear).unwrap();
    let sub = &json["submods"][CPU_PART];
    assert_eq!(sub["ear_trustworthiness_vector"]["executables"], 2);
    let claims_digest = results::claims_digest(&a.first().unwrap().claims).unwrap();
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
    let header = a.token().split('.').next().unwrap();
    let header: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(header)
            .unwrap(),
    )
    .unwrap();
    assert_eq!(header["alg"], "ES256");
    assert_eq!(header["kid"], appraiser.signer().kid());

    // Refusals: another key, a tampered payload, an expired result.
    let other = ResultSigner::generate().unwrap();
    assert_eq!(
        results::verify(a.token(), &other.jwk(), t)
            .unwrap_err()
            .code(),
        "result_error"
    );
    let mut parts: Vec<String> = a.token().split('.').map(str::to_string).collect();
    let mut payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(&parts[1])
        .unwrap();
    let s = String::from_utf8(payload.clone())
        .unwrap()
        .replace("\"affirming\"", "\"warning\"");
    payload = s.into_bytes();
    parts[1] = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(payload);
    assert!(results::verify(&parts.join("."), jwk, t).is_err());
    assert!(results::verify(a.token(), jwk, t + results::DEFAULT_TTL_SECS + 1).is_err());

    // Unrecognized measurement: warning, with the violation in the result.
    let bundle = amd.bundle(&SnpReportOptions::default()).unwrap();
    let w = appraiser
        .appraise(&bundle.evidence(), now, t, None, None)
        .unwrap();
    assert_eq!(w.status(), Tier::Warning);
    let ear = results::verify(w.token(), jwk, t).unwrap();
    let json = serde_json::to_value(&ear).unwrap();
    let violations = &json["submods"][CPU_PART]["ear_verifier_claims"]["cgx.violations"];
    assert!(
        violations[0]
            .as_str()
            .unwrap()
            .starts_with("measurement [executables 33]")
    );

    // Another algorithm in the header (here `none`, unsigned) is refused before any signature.
    let none_header =
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(br#"{"alg":"none","typ":"JWT"}"#);
    let forged = format!("{none_header}.{}.", a.token().split('.').nth(1).unwrap());
    let e = results::verify(&forged, jwk, t).unwrap_err();
    assert!(e.to_string().contains("ES256"), "{e}");
    // Not a compact JWS, or one carrying a fourth part.
    assert!(results::verify("a.b", jwk, t).is_err());
    assert!(results::verify(&format!("{}.x", a.token()), jwk, t).is_err());
    // A JWK of another curve or type is refused, not misread.
    let mut rsa = jwk.clone();
    rsa["kty"] = serde_json::json!("RSA");
    assert!(results::verify(a.token(), &rsa, t).is_err());
    // Issued more than a minute in the future: refused at `now`.
    assert!(results::verify(a.token(), jwk, t - 61).is_err());

    // A key from PKCS#8 keeps its identity; garbage is refused.
    assert!(ResultSigner::from_pkcs8(b"not a key").is_err());
}

#[test]
fn composite_appraisal_is_one_ear_with_a_submod_per_piece() {
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
    let n = amd.composite(&gpus, nonce, &key).unwrap();
    let policy = r#"package cgx.appraisal
import rego.v1
result := {"affirming": {"hardware": 2}, "violations": [v | input.kind == "nvidia"; v := {"rule": "gpu_flag", "claim": "runtime-opaque", "code": 33, "value": input.kind, "expected": "x"}]}
"#;
    let appraiser = Appraiser::new(
        Verifier::new(VerifierConfig { sim: SimTrust::Any }),
        PolicyEngine::new("composite", policy, "{}").unwrap(),
        ResultSigner::generate().unwrap(),
    );
    let a = appraiser
        .appraise_composite(&n.evidence(&[0], nonce, &key), now, t)
        .unwrap();
    assert_eq!(a.parts().len(), 2);
    assert_eq!(a.parts()[0].name, CPU_PART);
    assert_eq!(a.parts()[1].name, "gpu0");
    assert_eq!(a.parts()[0].outcome.status, Tier::Affirming);
    assert_eq!(a.status(), Tier::Warning);
    assert!(
        a.violations()[0].starts_with("gpu0: gpu_flag"),
        "{:?}",
        a.violations()
    );
    let ear = results::verify(a.token(), &appraiser.signer().jwk(), t).unwrap();
    let json = serde_json::to_value(&ear).unwrap();
    assert_eq!(json["ear_status"], "warning");
    assert_eq!(
        json["submods"][CPU_PART]["ear_verifier_claims"]["cgx.node-key"],
        hex::encode(key)
    );
    assert_eq!(
        json["submods"]["gpu0"]["ear_trustworthiness_vector"]["runtime-opaque"],
        33
    );
    // Typed access agrees with the JSON a relying party reads.
    assert_eq!(ear.submods[CPU_PART].node_key().unwrap(), key);
    assert_eq!(
        ear.submods["gpu0"].trust_vector.get("runtime-opaque"),
        Some(33)
    );
    // A broken binding yields no result at all.
    let e = appraiser
        .appraise_composite(&n.evidence(&[0], b"other", &key), now, t)
        .unwrap_err();
    assert_eq!(e.code(), "binding_mismatch");
}
