#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The shipped Rego tests pass, and the default policy appraises real and simulated evidence.

use std::path::Path;

use cgx_attestation::bundle::Bundle;
use cgx_attestation::results::Tier;
use cgx_attestation::sim::{SIM_GPU_DRIVER_VERSION, SIM_GPU_VBIOS_VERSION};
use cgx_attestation::{Verifier, VerifierConfig};

#[test]
fn shipped_rego_tests_pass() {
    let results = cgx_policies::run_tests(Path::new(env!("CARGO_MANIFEST_DIR"))).unwrap();
    let failed: Vec<_> = results.iter().filter(|r| !r.passed).collect();
    assert!(failed.is_empty(), "{failed:#?}");
    assert!(results.len() >= 14, "only {} tests found", results.len());
}

#[test]
fn default_policy_on_real_evidence() {
    let Some(v) = cgx_attestation::bundle::shared_vectors(Path::new(env!("CARGO_MANIFEST_DIR")))
    else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED default_policy_on_real_evidence: no vectors"
        );
        return;
    };
    let verifier = Verifier::new(VerifierConfig::default());
    let at = time::macros::datetime!(2025-10-01 00:00 UTC);
    let b = Bundle::load(&v.join("snp/genoa-v5-oak-genoa-oc")).unwrap();
    let claims = verifier.verify(&b.evidence(), at).unwrap().into_claims();
    // Shipped defaults hold no launch measurements: genuine but unrecognized.
    let out = cgx_policies::appraisal_engine(None)
        .unwrap()
        .evaluate(&claims)
        .unwrap();
    assert_eq!(out.status, Tier::Warning);
    assert_eq!(out.trust_vector["executables"], 33);
    assert_eq!(out.trust_vector["hardware"], 2);
    assert_eq!(out.violations[0].rule, "snp_measurement_not_allowed");
    // With the image's measurement as a reference value: affirming.
    let cgx_attestation::KindClaims::Snp(s) = &claims.detail else {
        panic!()
    };
    let refs = serde_json::json!({"snp": {"measurements": [s.measurement],
        "min_tcb": {"genoa": {"bootloader": 10, "tee": 0, "snp": 25, "microcode": 84}}}});
    let engine = cgx_policies::appraisal_engine(Some(&refs.to_string())).unwrap();
    let out = engine.evaluate(&claims).unwrap();
    assert_eq!(out.status, Tier::Affirming, "{out:#?}");
    // A minimum TCB above the platform's: contraindicated, naming the field.
    let refs = serde_json::json!({"snp": {"measurements": [s.measurement],
        "min_tcb": {"genoa": {"microcode": 85}}}});
    let out = cgx_policies::appraisal_engine(Some(&refs.to_string()))
        .unwrap()
        .evaluate(&claims)
        .unwrap();
    assert_eq!(out.status, Tier::Contraindicated);
    assert_eq!(out.violations[0].rule, "snp_tcb_below_minimum");
    assert_eq!(out.violations[0].value, "microcode=84");
    // The debug TD verifies and is refused by policy.
    let b = Bundle::load(&v.join("tdx/v4-50806f-trustee-debug")).unwrap();
    let at = time::macros::datetime!(2023-07-08 07:24:58 UTC);
    let claims = verifier.verify(&b.evidence(), at).unwrap().into_claims();
    let out = cgx_policies::appraisal_engine(None)
        .unwrap()
        .evaluate(&claims)
        .unwrap();
    assert_eq!(out.status, Tier::Contraindicated);
    assert!(out.violations.iter().any(|v| v.rule == "debug_forbidden"));
}

#[test]
fn bad_policy_or_reference_values_are_errors() {
    let e = cgx_policies::appraisal_engine(Some("not json")).unwrap_err();
    assert!(e.to_string().contains("reference values"), "{e}");
    let e = cgx_policies::appraisal_engine(Some("[1]")).unwrap_err();
    assert!(e.to_string().contains("object"), "{e}");
    let e = cgx_policies::PolicyEngine::new("x", "package x\nthis is not rego", "{}").unwrap_err();
    assert_eq!(e.code(), "policy_error");
}

#[test]
fn a_failing_rego_test_is_reported() {
    let dir = std::env::temp_dir().join(format!("cgx-policy-test-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("tests")).unwrap();
    std::fs::write(
        dir.join("p.rego"),
        "package p\nimport rego.v1\nallow if input.ok\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("tests/p_test.rego"),
        "package p_test\nimport rego.v1\nimport data.p\n\
         test_pass if { p.allow with input as {\"ok\": true} }\n\
         test_fail if { p.allow with input as {\"ok\": false} }\n",
    )
    .unwrap();
    let results = cgx_policies::run_tests(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let by = |n: &str| results.iter().find(|r| r.name.ends_with(n)).unwrap().passed;
    assert!(by("test_pass"));
    assert!(!by("test_fail"));
}

#[test]
fn the_default_policy_reads_named_claims_only() {
    let engine = cgx_policies::appraisal_engine(None).unwrap();
    let reads = engine
        .reads()
        .expect("the default policy reads input.<name> only");
    for name in [
        "kind",
        "sim",
        "debug",
        "measurement",
        "reported_tcb",
        "ocsp",
        "measurement_mismatches",
    ] {
        assert!(
            reads.iter().any(|r| r == name),
            "{name} missing from {reads:?}"
        );
    }
    assert!(!reads.iter().any(|r| r == "chip_id"));
    // The 64 GPU measurements reach the policy as the engine's comparison, not one by one.
    assert!(!reads.iter().any(|r| r == "measurements"));
    // A policy that reads `input` as a whole sees every claim.
    let whole = "package cgx.appraisal\nimport rego.v1\nresult := {\"affirming\": {}, \"violations\": [v | v := {\"rule\": \"all\", \"claim\": \"configuration\", \"code\": 32, \"value\": count(input), \"expected\": 0}]}\n";
    let e = cgx_policies::PolicyEngine::new("w", whole, "{}").unwrap();
    assert!(e.reads().is_none());
    let out = e
        .evaluate_json(&serde_json::json!({"a": 1, "b": 2, "c": 3}))
        .unwrap();
    assert_eq!(out.violations[0].value, 3);
}

fn sim_gpu_claims() -> cgx_attestation::Claims {
    let t = time::OffsetDateTime::now_utc();
    let gpu = cgx_attestation::sim::SimGpu::generate(t.unix_timestamp()).unwrap();
    let v = Verifier::new(VerifierConfig {
        sim: cgx_attestation::SimTrust::Pinned(vec![gpu.root_pin()]),
    });
    let b = gpu.bundle([2; 32], 64).unwrap();
    v.verify(&b.evidence(), t).unwrap().into_claims()
}

#[test]
fn golden_measurements_are_compared_and_named() {
    let claims = sim_gpu_claims();
    let cgx_attestation::KindClaims::Nvidia(n) = &claims.detail else {
        panic!()
    };
    assert_eq!(n.ocsp, "good");
    let golden: serde_json::Map<String, serde_json::Value> = n
        .measurements
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::json!(["00", v])))
        .collect();
    let refs = |golden: &serde_json::Map<String, serde_json::Value>| {
        serde_json::json!({"allow_sim": true, "nvidia": {"measurements": golden,
            "driver_versions": [SIM_GPU_DRIVER_VERSION], "vbios_versions": [SIM_GPU_VBIOS_VERSION]}})
        .to_string()
    };
    let engine = cgx_policies::appraisal_engine(Some(&refs(&golden))).unwrap();
    let out = engine.evaluate(&claims).unwrap();
    // Sim evidence allowed by reference values is a warning, nothing else.
    assert_eq!(
        out.violations
            .iter()
            .map(|v| v.rule.as_str())
            .collect::<Vec<_>>(),
        ["sim_evidence_allowed_by_reference_values"]
    );
    // One index differs, one is missing from the evidence: both named, contraindicated.
    let mut g = golden.clone();
    g.insert("7".into(), serde_json::json!(["ab", "cd"]));
    g.insert("99".into(), serde_json::json!(["ef"]));
    let out = cgx_policies::appraisal_engine(Some(&refs(&g)))
        .unwrap()
        .evaluate(&claims)
        .unwrap();
    assert_eq!(out.status, Tier::Contraindicated);
    let bad: Vec<(String, serde_json::Value)> = out
        .violations
        .iter()
        .filter(|v| v.rule == "gpu_measurement_mismatch")
        .map(|v| (v.value.as_str().unwrap().to_string(), v.expected.clone()))
        .collect();
    assert_eq!(bad.len(), 2, "{bad:?}");
    assert!(
        bad.iter().any(
            |(v, e)| v == &format!("measurement 7={}", n.measurements["7"]) && e == "ab or cd"
        )
    );
    assert!(
        bad.iter()
            .any(|(v, e)| v == "measurement 99=absent" && e == "ef")
    );
    // Without revocation evidence the default requires OCSP: a warning on hardware.
    let mut unchecked = claims.clone();
    if let cgx_attestation::KindClaims::Nvidia(n) = &mut unchecked.detail {
        n.ocsp = "not_checked".into();
    }
    let out = engine.evaluate(&unchecked).unwrap();
    assert!(
        out.violations
            .iter()
            .any(|v| v.rule == "gpu_revocation_not_checked")
    );
    assert_eq!(out.trust_vector["hardware"], 32);
    // Malformed golden tables are refused when the engine is built.
    for bad in [
        r#"{"nvidia": {"measurements": []}}"#,
        r#"{"nvidia": {"measurements": {"1": "ab"}}}"#,
        r#"{"nvidia": {"measurements": {"1": [1]}}}"#,
        r#"{"nvidia": {"measurements": "ANY"}}"#,
        r#"{"nvidia": {"measurements": true}}"#,
    ] {
        let e = cgx_policies::appraisal_engine(Some(bad)).unwrap_err();
        assert!(e.to_string().contains("nvidia.measurements"), "{e}");
    }
}

#[test]
fn outcomes_are_memoized_only_for_pure_policies() {
    let claims = sim_gpu_claims();
    let engine = cgx_policies::appraisal_engine(None).unwrap();
    assert!(engine.memoizes());
    let first = engine.evaluate(&claims).unwrap();
    let json = serde_json::to_value(&claims).unwrap();
    assert_eq!(engine.evaluate(&claims).unwrap(), first);
    assert_eq!(engine.evaluate_json_cold(&json).unwrap(), first);
    // Another nonce (not read by the policy) hits the same outcome; another driver does not.
    let mut other = json.clone();
    other["nonce"] = serde_json::json!("ff");
    assert_eq!(engine.evaluate_json(&other).unwrap(), first);
    let refs = serde_json::json!({"allow_sim": true, "nvidia": {"driver_versions": ["1.0"]}});
    let strict = cgx_policies::appraisal_engine(Some(&refs.to_string())).unwrap();
    let a = strict.evaluate_json(&json).unwrap();
    let mut d = json.clone();
    d["driver_version"] = serde_json::json!("1.0");
    let b = strict.evaluate_json(&d).unwrap();
    assert!(
        a.violations
            .iter()
            .any(|v| v.rule == "gpu_driver_not_allowed")
    );
    assert!(
        !b.violations
            .iter()
            .any(|v| v.rule == "gpu_driver_not_allowed")
    );
    // The golden comparison reads `measurements` though the policy never names it: a memoized
    // outcome for matching measurements is not reused for a changed one.
    let cgx_attestation::KindClaims::Nvidia(n) = &claims.detail else {
        panic!()
    };
    let golden = serde_json::json!({"allow_sim": true,
        "nvidia": {"measurements": {"1": [n.measurements["1"]]}}});
    let golden = cgx_policies::appraisal_engine(Some(&golden.to_string())).unwrap();
    let mismatch = |o: &cgx_attestation::results::Outcome| {
        o.violations
            .iter()
            .any(|v| v.rule == "gpu_measurement_mismatch")
    };
    assert!(!mismatch(&golden.evaluate_json(&json).unwrap()));
    let mut changed = json.clone();
    changed["measurements"]["1"] = serde_json::json!("00".repeat(48));
    assert!(mismatch(&golden.evaluate_json(&changed).unwrap()));
    assert!(!mismatch(&golden.evaluate(&claims).unwrap()));
    // Claims too large to keep as a memo key are evaluated, not remembered: same answer.
    let mut huge = json.clone();
    huge["driver_version"] = serde_json::json!("9".repeat(64 * 1024));
    let once = strict.evaluate_json(&huge).unwrap();
    assert_eq!(strict.evaluate_json(&huge).unwrap(), once);
    // A policy that names a clock builtin (here only in a comment: the check is conservative)
    // is evaluated every time.
    let clocked = "package cgx.appraisal\nimport rego.v1\n# time.now_ns\nresult := {\"affirming\": {\"hardware\": 2}, \"violations\": []}\n";
    let e = cgx_policies::PolicyEngine::new("c", clocked, "{}").unwrap();
    assert!(!e.memoizes());
}

fn rules(out: &cgx_attestation::results::Outcome) -> Vec<&str> {
    out.violations.iter().map(|v| v.rule.as_str()).collect()
}

/// Reference values that say nothing about GPUs accept no GPU: each list that is missing or
/// empty is its own violation; `"any"` written accepts every value; a misspelt waiver is an
/// error when the reference values are set.
#[test]
fn gpu_reference_lists_fail_closed_unless_any_is_written() {
    let claims = sim_gpu_claims();
    let not_set = [
        "gpu_driver_versions_not_set",
        "gpu_measurements_not_set",
        "gpu_vbios_versions_not_set",
    ];
    for refs in [
        serde_json::json!({"allow_sim": "affirming"}),
        serde_json::json!({"allow_sim": "affirming", "nvidia": {}}),
        serde_json::json!({"allow_sim": "affirming", "nvidia":
            {"driver_versions": [], "vbios_versions": [], "measurements": {}}}),
    ] {
        let out = cgx_policies::appraisal_engine(Some(&refs.to_string()))
            .unwrap()
            .evaluate(&claims)
            .unwrap();
        assert_eq!(out.status, Tier::Warning, "{refs}: {out:#?}");
        let mut got = rules(&out);
        got.sort();
        assert_eq!(got, not_set, "{refs}");
        assert!(
            out.violations
                .iter()
                .all(|v| v.expected.as_str().unwrap().contains("\"any\"")),
            "{out:#?}"
        );
    }
    // The shipped defaults: the same three, and nothing accepts the GPU.
    let out = cgx_policies::appraisal_engine(None)
        .unwrap()
        .evaluate(&claims)
        .unwrap();
    for rule in not_set {
        assert!(rules(&out).contains(&rule), "{rule}: {out:#?}");
    }
    // Written "any": affirming (sim allowed as affirming here, revocation checked by the sim).
    let any = serde_json::json!({"allow_sim": "affirming", "nvidia":
        {"driver_versions": "any", "vbios_versions": "any", "measurements": "any"}});
    let out = cgx_policies::appraisal_engine(Some(&any.to_string()))
        .unwrap()
        .evaluate(&claims)
        .unwrap();
    assert_eq!(out.status, Tier::Affirming, "{out:#?}");
    // Waivers spelt any other way are refused when the engine is built.
    for bad in [
        r#"{"nvidia": {"driver_versions": "ANY"}}"#,
        r#"{"nvidia": {"vbios_versions": "all"}}"#,
        r#"{"nvidia": {"driver_versions": true}}"#,
        r#"{"nvidia": {"driver_versions": [1]}}"#,
        r#"{"nvidia": "any"}"#,
        r#"{"nvidia": {"allowed_cc_modes": "any"}}"#,
    ] {
        let e = cgx_policies::appraisal_engine(Some(bad)).unwrap_err();
        assert_eq!(e.code(), "policy_error", "{bad}");
        assert!(e.to_string().contains("nvidia"), "{bad}: {e}");
    }
}

/// A GPU that signs another CC mode than `on` is contraindicated by default, naming the mode;
/// a written `allowed_cc_modes` admits it.
#[test]
fn gpu_not_in_cc_mode_on_is_refused_by_default() {
    let claims = sim_gpu_claims();
    let cgx_attestation::KindClaims::Nvidia(n) = &claims.detail else {
        panic!()
    };
    assert_eq!(n.cc_mode.as_deref(), Some("on"));
    let refs = |modes: Option<&[&str]>| {
        let mut r = serde_json::json!({"allow_sim": "affirming", "nvidia":
            {"driver_versions": "any", "vbios_versions": "any", "measurements": "any"}});
        if let Some(m) = modes {
            r["nvidia"]["allowed_cc_modes"] = serde_json::json!(m);
        }
        cgx_policies::appraisal_engine(Some(&r.to_string())).unwrap()
    };
    let engine = refs(None);
    for (mode, value) in [
        (Some("ppcie"), "cc_mode ppcie"),
        (Some("unknown"), "cc_mode unknown"),
        (None, "cc_mode absent"),
    ] {
        let mut c = claims.clone();
        if let cgx_attestation::KindClaims::Nvidia(n) = &mut c.detail {
            n.cc_mode = mode.map(str::to_string);
        }
        let out = engine.evaluate(&c).unwrap();
        assert_eq!(out.status, Tier::Contraindicated, "{mode:?}");
        assert_eq!(out.trust_vector["configuration"], 96);
        let v = &out.violations[0];
        assert_eq!(v.rule, "gpu_cc_mode_not_allowed");
        assert_eq!(v.value, value);
    }
    let mut ppcie = claims.clone();
    if let cgx_attestation::KindClaims::Nvidia(n) = &mut ppcie.detail {
        n.cc_mode = Some("ppcie".into());
    }
    let out = refs(Some(&["on", "ppcie"])).evaluate(&ppcie).unwrap();
    assert_eq!(out.status, Tier::Affirming, "{out:#?}");
}

/// Real H100 evidence: refused by the shipped defaults (nothing listed), affirming once its
/// versions and golden measurements are the reference values — its signed CC mode is `on`.
#[test]
fn real_gpu_evidence_under_gpu_reference_values() {
    let Some(v) = cgx_attestation::bundle::shared_vectors(Path::new(env!("CARGO_MANIFEST_DIR")))
    else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED real_gpu_evidence_under_gpu_reference_values: no vectors"
        );
        return;
    };
    let verifier = Verifier::new(VerifierConfig::default());
    for name in ["h100-nvtrust-sample", "h100-trustee-coco"] {
        let dir = v.join("nvidia").join(name);
        let expected: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
        let at = expected["at"]
            .as_str()
            .map(|t| {
                time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
                    .unwrap()
            })
            .unwrap_or_else(time::OffsetDateTime::now_utc);
        let b = Bundle::load(&dir).unwrap();
        let claims = verifier.verify(&b.evidence(), at).unwrap().into_claims();
        let out = cgx_policies::appraisal_engine(None)
            .unwrap()
            .evaluate(&claims)
            .unwrap();
        assert_ne!(out.status, Tier::Affirming, "{name}");
        assert!(
            rules(&out).contains(&"gpu_measurements_not_set"),
            "{name}: {out:#?}"
        );
        assert!(!rules(&out).contains(&"gpu_cc_mode_not_allowed"), "{name}");
        let cgx_attestation::KindClaims::Nvidia(n) = &claims.detail else {
            panic!()
        };
        let refs = serde_json::json!({"nvidia": {
            "require_ocsp": false,
            "driver_versions": [n.driver_version],
            "vbios_versions": [n.vbios_version],
            "measurements": n.measurements.iter().map(|(k, v)| (k.clone(), serde_json::json!([v])))
                .collect::<serde_json::Map<_, _>>()}});
        let out = cgx_policies::appraisal_engine(Some(&refs.to_string()))
            .unwrap()
            .evaluate(&claims)
            .unwrap();
        assert_eq!(out.status, Tier::Affirming, "{name}: {out:#?}");
    }
}

/// An SNP report requested at VMPL 1 (a real one: Trustee's VLEK sample) is refused by default,
/// naming the VMPL; only a written `snp.max_vmpl` admits it.
#[test]
fn snp_report_above_vmpl_0_is_refused_by_default() {
    let Some(v) = cgx_attestation::bundle::shared_vectors(Path::new(env!("CARGO_MANIFEST_DIR")))
    else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED snp_report_above_vmpl_0_is_refused_by_default: no vectors"
        );
        return;
    };
    let verifier = Verifier::new(VerifierConfig::default());
    let at = time::macros::datetime!(2025-06-01 00:00 UTC);
    let b = Bundle::load(&v.join("snp/milan-v3-vlek-trustee")).unwrap();
    let claims = verifier.verify(&b.evidence(), at).unwrap().into_claims();
    let cgx_attestation::KindClaims::Snp(s) = &claims.detail else {
        panic!()
    };
    assert_eq!(s.vmpl, 1);
    let refs = serde_json::json!({"snp": {"measurements": [s.measurement]}});
    let out = cgx_policies::appraisal_engine(Some(&refs.to_string()))
        .unwrap()
        .evaluate(&claims)
        .unwrap();
    assert_eq!(rules(&out), ["snp_vmpl_too_high"], "{out:#?}");
    assert_eq!(out.violations[0].value, 1);
    assert_eq!(out.trust_vector["configuration"], 32);
    assert_ne!(out.status, Tier::Affirming);
    // The shipped defaults say max_vmpl 0 as well.
    let out = cgx_policies::appraisal_engine(None)
        .unwrap()
        .evaluate(&claims)
        .unwrap();
    assert!(rules(&out).contains(&"snp_vmpl_too_high"), "{out:#?}");
    let refs = serde_json::json!({"snp": {"measurements": [s.measurement], "max_vmpl": 1}});
    let out = cgx_policies::appraisal_engine(Some(&refs.to_string()))
        .unwrap()
        .evaluate(&claims)
        .unwrap();
    assert_eq!(out.status, Tier::Affirming, "{out:#?}");
}
