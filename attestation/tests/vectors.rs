#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Every evidence bundle in the shared real-hardware vectors gets exactly its `expected.json`
//! verdict and claims. The folder comes from `CGX_VECTORS` or `../shared/vectors`; where neither
//! exists (a user's own clone) the test says so and passes, while CI always has it.

use std::path::{Path, PathBuf};

use cgx_attestation::bundle::Bundle;
use cgx_attestation::nvidia::rim::{self, RimOptions};
use cgx_attestation::{Verifier, VerifierConfig};
use serde_json::Value;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// The vectors, or `None` (skip). Under CI (`CI=true`) their absence is a failure: CI always
/// has them, and a silent skip there would hide every real-evidence check.
fn vectors_dir() -> Option<PathBuf> {
    let found = cgx_attestation::bundle::shared_vectors(Path::new(env!("CARGO_MANIFEST_DIR")));
    if found.is_none() && std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true but no vectors: set CGX_VECTORS or place ../shared/vectors");
    }
    found
}

fn bundles(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if dir.join("expected.json").is_file() {
            out.push(dir.clone());
        }
        for entry in std::fs::read_dir(&dir).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            }
        }
    }
    out.sort();
    out
}

/// `expected` is a subset of `actual`: objects by key, arrays element-wise, hex and names
/// without regard to case, numbers equal to integers or `0x` strings.
fn matches(expected: &Value, actual: &Value) -> bool {
    fn num(v: &Value) -> Option<u64> {
        match v {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s
                .strip_prefix("0x")
                .and_then(|h| u64::from_str_radix(h, 16).ok()),
            _ => None,
        }
    }
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => e
            .iter()
            .all(|(k, v)| a.get(k).is_some_and(|av| matches(v, av))),
        (Value::Array(e), Value::Array(a)) => {
            e.len() == a.len() && e.iter().zip(a).all(|(x, y)| matches(x, y))
        }
        (Value::String(e), Value::String(a)) if e.eq_ignore_ascii_case(a) => true,
        _ => num(expected).is_some() && num(expected) == num(actual),
    }
}

/// The error code a negative sample's `reason` calls for.
fn expected_codes(reason: &str) -> &'static [&'static str] {
    let r = reason.to_ascii_lowercase();
    if r.contains("no matching tcb level") {
        &["tcb_level_not_found"]
    } else if r.contains("expired") {
        &[
            "collateral_expired",
            "certificate_not_valid_at_time",
            "crl_invalid",
        ]
    } else if r.contains("truncated") || r.contains("bytes, not") {
        &["truncated", "malformed"]
    } else if r.contains("hwid or tcb") {
        &["chip_id_mismatch", "tcb_mismatch", "signature_invalid"]
    } else if r.contains("signature") {
        &["signature_invalid"]
    } else {
        &[]
    }
}

#[test]
fn shared_vectors_verify_exactly_as_expected() {
    let Some(root) = vectors_dir() else {
        skip(
            "SKIPPED shared_vectors_verify_exactly_as_expected: no CGX_VECTORS and no \
             ../shared/vectors (CI always has them)",
        );
        return;
    };
    let verifier = Verifier::new(VerifierConfig::default());
    let mut failures = Vec::new();
    let mut counts = (0, 0);
    for dir in bundles(&root) {
        let name = dir.strip_prefix(&root).unwrap().display().to_string();
        let expected: Value =
            serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
        let at = match expected.get("at").and_then(Value::as_str) {
            Some(t) => OffsetDateTime::parse(t, &Rfc3339).unwrap(),
            None => OffsetDateTime::now_utc(),
        };
        let valid = expected["valid"].as_bool().unwrap();
        let result = Bundle::load(&dir).and_then(|b| verifier.verify(&b.evidence(), at));
        match (valid, result) {
            (true, Ok(claims)) => {
                counts.0 += 1;
                let actual = serde_json::to_value(claims.claims()).unwrap();
                assert_eq!(actual["kind"], expected["kind"], "{name}");
                // TDX bundles are named after their FMSPC (`v4-b0c06f-…`): the PCK cert's.
                if let Some(fam) = name.strip_prefix("tdx/").and_then(|n| n.get(3..9)) {
                    let fmspc = actual["fmspc"].as_str().unwrap_or("");
                    assert!(fmspc.starts_with(fam), "{name}: fmspc {fmspc}");
                }
                if !matches(&expected["claims"], &actual) {
                    failures.push(format!("{name}: claims differ:\n{actual:#}"));
                }
            }
            (true, Err(e)) => failures.push(format!("{name}: refused valid evidence: {e}")),
            (false, Ok(_)) => failures.push(format!("{name}: accepted invalid evidence")),
            (false, Err(e)) => {
                counts.1 += 1;
                let reason = expected["reason"].as_str().unwrap_or("");
                let codes = expected_codes(reason);
                if !codes.is_empty() && !codes.contains(&e.code()) {
                    failures.push(format!(
                        "{name}: refused with {} ({e}) but the reason is '{reason}'",
                        e.code()
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        counts.0 >= 10 && counts.1 >= 40,
        "too few vectors: {counts:?}"
    );
    eprintln!(
        "vectors: {} valid verified, {} invalid refused",
        counts.0, counts.1
    );
}

#[test]
fn shared_rims_all_verify_and_match_a_real_report() {
    let Some(root) = vectors_dir() else {
        skip("SKIPPED shared_rims_all_verify_and_match_a_real_report: no vectors");
        return;
    };
    let provider = &cgx_attestation::crypto::DEFAULT_PROVIDER;
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let mut rims = Vec::new();
    let mut dir: Vec<PathBuf> = std::fs::read_dir(root.join("nvidia/rims"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "swidtag"))
        .collect();
    dir.sort();
    for p in &dir {
        let xml = std::fs::read(p).unwrap();
        let opts = RimOptions {
            ignore_signer_expiry: true,
        };
        let rim = rim::verify(&xml, provider, now, opts)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(!rim.golden.is_empty(), "{}", p.display());
        // Without the opt-in an expired signer is refused.
        if rim.signer_expired {
            let err = rim::verify(&xml, provider, now, RimOptions::default()).unwrap_err();
            assert_eq!(err.code(), "certificate_not_valid_at_time");
        }
        // Any change to the signed content breaks the digest.
        let text = String::from_utf8(xml.clone()).unwrap();
        let tampered = text.replacen("active=\"True\"", "active=\"False\"", 1);
        assert!(rim::verify(tampered.as_bytes(), provider, now, opts).is_err());
        rims.push((p.file_name().unwrap().to_string_lossy().into_owned(), rim));
    }
    assert_eq!(rims.len(), 26);

    // The CoCo sample is VBIOS 96.00.74.00.1A on a 1010/0200/882 board: its RIM is in the set.
    let bundle = Bundle::load(&root.join("nvidia/h100-trustee-coco")).unwrap();
    let claims = Verifier::new(VerifierConfig::default())
        .verify(&bundle.evidence(), OffsetDateTime::now_utc())
        .unwrap();
    let cgx_attestation::KindClaims::Nvidia(gpu) = &claims.claims().detail else {
        panic!("not nvidia")
    };
    assert_eq!(gpu.vbios_version.as_deref(), Some("96.00.74.00.1A"));
    let vbios = &rims
        .iter()
        .find(|(n, _)| n.starts_with("1010_0200_882_960074001A"))
        .unwrap()
        .1;
    assert_eq!(vbios.version, "96.00.74.00.1A");
    let cmp = rim::compare(&gpu.measurements, &[vbios]).unwrap();
    assert!(!cmp.matched.is_empty(), "{cmp:?}");
    // The VBIOS RIM covers only VBIOS indices; the rest have no reference in it.
    assert!(!cmp.no_reference.is_empty());
    eprintln!(
        "RIM compare: {} match, {} differ, {} without reference",
        cmp.matched.len(),
        cmp.mismatched.len(),
        cmp.no_reference.len()
    );
}

/// Both real H100s signed the CC mode the simulator writes: `on` — one from its
/// PROTECTED_PCIE_STATUS alone (driver 550, no FEATURE_FLAG), one from FEATURE_FLAG SPT.
#[test]
fn real_h100_evidence_reports_cc_mode_on() {
    let Some(root) = vectors_dir() else {
        skip("SKIPPED real_h100_evidence_reports_cc_mode_on: no vectors");
        return;
    };
    let verifier = Verifier::new(VerifierConfig::default());
    for name in ["h100-nvtrust-sample", "h100-trustee-coco"] {
        let dir = root.join("nvidia").join(name);
        let expected: Value =
            serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
        let at = expected
            .get("at")
            .and_then(Value::as_str)
            .map(|t| OffsetDateTime::parse(t, &Rfc3339).unwrap())
            .unwrap_or_else(OffsetDateTime::now_utc);
        let bundle = Bundle::load(&dir).unwrap();
        let claims = verifier.verify(&bundle.evidence(), at).unwrap();
        let cgx_attestation::KindClaims::Nvidia(gpu) = &claims.claims().detail else {
            panic!("{name}: not nvidia")
        };
        assert_eq!(
            gpu.cc_mode.as_deref(),
            Some(cgx_attestation::nvidia::CC_MODE_ON),
            "{name}"
        );
    }
}

/// Say that a test skipped, past libtest's output capture (a plain `eprintln!` in a passing
/// test is swallowed), so a user without the vectors sees it.
fn skip(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{msg}");
}
