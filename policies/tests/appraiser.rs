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
    assert_eq!(header["alg"], "EdDSA");
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
    assert!(e.to_string().contains("algorithm is not EdDSA"), "{e}");
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

/// The claims digest is RFC 8785 JCS whatever order serde writes the claims in: members sorted
/// at every level, as an auditor's JCS implementation recomputes it from the archived claims.
#[test]
fn claims_digest_is_jcs() {
    let t = OffsetDateTime::now_utc().unix_timestamp();
    let amd = SimAmd::generate(
        Product::Genoa,
        SigningKey::Vcek,
        default_tcb(Product::Genoa),
        [3; 64],
        t,
    )
    .unwrap();
    let bundle = amd.bundle(&SnpReportOptions::default()).unwrap();
    let claims = Verifier::new(VerifierConfig {
        sim: SimTrust::Pinned(vec![amd.root_pin()]),
    })
    .verify(&bundle.evidence(), OffsetDateTime::now_utc())
    .unwrap()
    .into_claims();
    let text = results::canonical_claims(&claims).unwrap().into_string();
    // Sorted: `author_key_digest` first, `vmpl` last, TCB components sorted inside.
    assert!(text.starts_with(r#"{"author_key_digest":""#), "{text}");
    assert!(text.ends_with(r#""version":5,"vmpl":0}"#), "{text}");
    assert!(
        text.contains(r#""current_tcb":{"bootloader":"#) && text.contains(r#","tee":"#),
        "{text}"
    );
    // The same as canonicalizing the JSON value, and parsing the text back gives the claims.
    let value = serde_json::to_value(&claims).unwrap();
    assert_eq!(text, cgx_protocol::jcs::canonical(&value));
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&text).unwrap(),
        value
    );
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, text.as_bytes());
    assert_eq!(
        results::claims_digest(&claims).unwrap().as_slice(),
        digest.as_ref()
    );
}

/// EdDSA by default, ES256 from a P-256 key; a result verifies only under its own key's
/// algorithm, whatever its header says.
#[test]
fn result_algorithms_do_not_mix() {
    let t = 4_000_000_000;
    let ed = ResultSigner::generate().unwrap();
    let es = ResultSigner::generate_es256().unwrap();
    assert_eq!((ed.alg(), es.alg()), ("EdDSA", "ES256"));
    assert_eq!(ed.jwk()["kty"], "OKP");
    assert_eq!(es.jwk()["kty"], "EC");
    let ok = cgx_attestation::results::Outcome {
        status: Tier::Affirming,
        trust_vector: [("hardware".to_string(), 2)].into_iter().collect(),
        violations: vec![],
    };
    let sub = [results::Submod::raw("cpu0", "snp", false, [1; 32], &ok)];
    let token = |s: &ResultSigner| s.sign(&s.build(&sub, "p", None, None, t).unwrap()).unwrap();
    let (ed_token, es_token) = (token(&ed), token(&es));
    results::verify(&ed_token, &ed.jwk(), t).unwrap();
    results::verify(&es_token, &es.jwk(), t).unwrap();
    // Each under the other's key: refused on the algorithm, not tried.
    for (tok, key, want) in [
        (&ed_token, es.jwk(), "algorithm is not ES256"),
        (&es_token, ed.jwk(), "algorithm is not EdDSA"),
    ] {
        let e = results::verify(tok, &key, t).unwrap_err();
        assert!(e.to_string().contains(want), "{e}");
    }
    // An EdDSA result whose header claims ES256: refused under the Ed25519 key.
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let relabeled = format!(
        "{}.{}",
        b64.encode(format!(
            r#"{{"alg":"ES256","typ":"JWT","kid":"{}"}}"#,
            ed.kid()
        )),
        ed_token.split_once('.').unwrap().1
    );
    let e = results::verify(&relabeled, &ed.jwk(), t).unwrap_err();
    assert!(e.to_string().contains("algorithm is not EdDSA"), "{e}");
    // A JWK whose alg contradicts its key type.
    let mut lying = ed.jwk();
    lying["alg"] = "ES256".into();
    let e = results::verify(&ed_token, &lying, t).unwrap_err();
    assert!(e.to_string().contains("JWK alg is not EdDSA"), "{e}");
    // A JWK whose alg is not even a string.
    let mut odd = ed.jwk();
    odd["alg"] = serde_json::json!(7);
    assert!(results::verify(&ed_token, &odd, t).is_err());
    // A JWK with a short key.
    let mut short = ed.jwk();
    short["x"] = b64.encode([1u8; 31]).into();
    assert!(results::verify(&ed_token, &short, t).is_err());
    // PKCS#8 keys of both kinds keep their identity; a P-384 key is neither.
    let rng = aws_lc_rs::rand::SystemRandom::new();
    let ed_doc = aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
    let a = ResultSigner::from_pkcs8(ed_doc.as_ref()).unwrap();
    let b = ResultSigner::from_pkcs8(ed_doc.as_ref()).unwrap();
    assert_eq!((a.alg(), a.kid(), a.jwk()), ("EdDSA", b.kid(), b.jwk()));
    let es_doc = aws_lc_rs::signature::EcdsaKeyPair::generate_pkcs8(
        &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
        &rng,
    )
    .unwrap();
    assert_eq!(
        ResultSigner::from_pkcs8(es_doc.as_ref()).unwrap().alg(),
        "ES256"
    );
    let p384 = aws_lc_rs::signature::EcdsaKeyPair::generate_pkcs8(
        &aws_lc_rs::signature::ECDSA_P384_SHA384_FIXED_SIGNING,
        &rng,
    )
    .unwrap();
    let e = ResultSigner::from_pkcs8(p384.as_ref()).unwrap_err();
    assert!(e.to_string().contains("not an Ed25519 or P-256"), "{e}");
    // The key id is the RFC 7638 / RFC 8037 thumbprint.
    let thumb = format!(
        r#"{{"crv":"Ed25519","kty":"OKP","x":"{}"}}"#,
        a.jwk()["x"].as_str().unwrap()
    );
    let d = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, thumb.as_bytes());
    assert_eq!(a.kid(), b64.encode(d.as_ref()));
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
