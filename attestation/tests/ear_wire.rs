#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The EAR's wire form: a fixed EAR's JWT payload, byte for byte, as the `ear` crate (0.6) wrote
//! it before cgx carried its own EAR types. Relying parties parse these bytes; a change to them
//! is a protocol change, not a refactor.

use base64::Engine;
use cgx_attestation::results::{Outcome, Tier, Violation};
use cgx_attestation::results::{ResultSigner, Submod};

fn payload(token: &str) -> String {
    let p = token.split('.').nth(1).unwrap();
    String::from_utf8(
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(p)
            .unwrap(),
    )
    .unwrap()
}

#[test]
fn ear_payload_is_byte_identical() {
    let signer = ResultSigner::generate().unwrap();
    let mut tv = std::collections::BTreeMap::new();
    for (k, v) in [
        ("sourced-data", 2),
        ("hardware", 2),
        ("instance-identity", 2),
        ("executables", 33),
        ("configuration", 0),
    ] {
        tv.insert(k.to_string(), v);
    }
    let warn = Outcome {
        status: Tier::Warning,
        trust_vector: tv,
        violations: vec![Violation {
            rule: "measurement".into(),
            claim: "executables".into(),
            code: 33,
            value: serde_json::json!("ab\"cd"),
            expected: serde_json::json!(["x", 1]),
        }],
    };
    let mut ok_tv = std::collections::BTreeMap::new();
    ok_tv.insert("hardware".to_string(), 2);
    let ok = Outcome {
        status: Tier::Affirming,
        trust_vector: ok_tv,
        violations: vec![],
    };
    let submods = [
        Submod::raw("gpu0", "nvidia", true, [0x11; 32], &ok),
        Submod::raw("cpu", "snp", false, [0x22; 32], &warn),
    ];
    let ear = signer
        .build(
            &submods,
            "cgx-default@sha256:00",
            Some(b"0123456789abcdef"),
            Some(b"{\"k\":1}"),
            4_000_000_000,
        )
        .unwrap();
    let token = signer.sign(&ear).unwrap();
    let got = payload(&token);
    println!("{got}");
    assert_eq!(got, include_str!("ear_wire.json").trim_end());
    // A relying party's parse of those bytes writes them back unchanged.
    let parsed = cgx_attestation::results::verify(&token, &signer.jwk(), 4_000_000_000).unwrap();
    assert_eq!(parsed, ear);
    assert_eq!(serde_json::to_string(&parsed).unwrap(), got);
    let none = signer
        .build(&submods[..1], "p", None, None, 4_000_000_000)
        .unwrap();
    let got = payload(&signer.sign(&none).unwrap());
    println!("{got}");
    assert_eq!(got, include_str!("ear_wire_bare.json").trim_end());
}
