//! cgx's policies: the Rego program every policy runs on ([`program`]: compiled once, VMs
//! pooled), the appraisal package and the appraiser (verify → policy → signed result,
//! [`appraisal`]), the release package ([`release`]), the shipped policies and reference values
//! (embedded so every binary carries them), and the runner behind `cgx policy test`.
//!
//! The dependency runs one way: policies read the claims `cgx-attestation` verified and sign
//! results with its signer; the attestation core knows nothing of Rego.
//!
//! The Rego sources live beside this crate (`appraisal.rego`, `release.rego`,
//! `reference-values/`, `tests/*.rego`) so operators can read, copy and override them.

pub mod appraisal;
pub mod limits;
pub mod placement;
mod program;
pub mod rego_value;
pub mod release;
pub mod sandbox;

use std::path::Path;

pub use appraisal::{Appraisal, AppraisedPart, Appraiser, PolicyEngine};

/// The example placement policy (package `placement`), for tenants to copy.
pub const PLACEMENT_POLICY: &str = include_str!("../placement.rego");
/// The default appraisal policy.
pub const APPRAISAL_POLICY: &str = include_str!("../appraisal.rego");
/// The default resource release policy of the KBS (entry point `data.policy.allow`).
pub const RELEASE_POLICY: &str = include_str!("../release.rego");
/// The default reference values (no launch measurements: operators add their image's).
pub const DEFAULT_REFERENCE_VALUES: &str = include_str!("../reference-values/default.json");

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The evidence was refused by the verifier, or the result could not be signed.
    #[error(transparent)]
    Attestation(#[from] cgx_attestation::Error),
    /// The policy or its reference values could not be compiled or evaluated, or the policy's
    /// result is not of the package's shape.
    #[error("policy: {detail}")]
    Policy { detail: String },
    /// The evaluation ran into one of its limits ([`limits::Limits`]): the refusal of what it
    /// was deciding, never the service's failure.
    #[error("{0}")]
    Limit(limits::Exceeded),
    /// The evaluation was not run now: the queue is full, or no evaluator thread picked it up
    /// within `sandbox::MAX_QUEUE_WAIT`. Says nothing about the policy; retry later.
    #[error("the policy evaluators are busy")]
    Busy,
    #[error("{path}: {detail}")]
    Io { path: String, detail: String },
    #[error("{file}: {detail}")]
    Rego { file: String, detail: String },
}

impl Error {
    /// Stable machine-readable code: the verifier's own for a refused evidence.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Attestation(e) => e.code(),
            Error::Policy { .. } => "policy_error",
            Error::Limit(_) => "policy_limit",
            Error::Busy => "policy_busy",
            Error::Io { .. } => "policy_unreadable",
            Error::Rego { .. } => "rego_invalid",
        }
    }
}

/// The default policy compiled with `reference_values` (the shipped defaults when `None`).
pub fn appraisal_engine(reference_values: Option<&str>) -> Result<PolicyEngine, Error> {
    PolicyEngine::new(
        "cgx.appraisal",
        APPRAISAL_POLICY,
        reference_values.unwrap_or(DEFAULT_REFERENCE_VALUES),
    )
}

/// Outcome of one Rego test rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestResult {
    /// `data.<package>.<rule>`.
    pub name: String,
    pub passed: bool,
    /// Why it failed (evaluation error or a non-true value).
    pub detail: Option<String>,
}

fn read(path: &Path) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        detail: e.to_string(),
    })
}

/// Run every `test_*` rule of the `.rego` files under `dir/tests` against the policies in `dir`
/// (`cgx policy test`). Each test is evaluated on its own, so one failure does not hide others.
pub fn run_tests(dir: &Path) -> Result<Vec<TestResult>, Error> {
    let mut policies = Vec::new();
    for sub in [dir.to_path_buf(), dir.join("tests")] {
        let Ok(entries) = std::fs::read_dir(&sub) else {
            continue;
        };
        let mut files: Vec<_> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "rego"))
            .collect();
        files.sort();
        for f in files {
            let src = read(&f)?;
            policies.push((f, src));
        }
    }
    if policies.is_empty() {
        return Err(Error::Io {
            path: dir.display().to_string(),
            detail: "no .rego files".into(),
        });
    }
    let mut engine = regorus::Engine::new();
    let mut tests = Vec::new();
    for (path, src) in &policies {
        engine
            .add_policy(path.display().to_string(), src.clone())
            .map_err(|e| Error::Rego {
                file: path.display().to_string(),
                detail: e.to_string(),
            })?;
        let package = src
            .lines()
            .find_map(|l| l.trim().strip_prefix("package "))
            .map(|p| p.trim().to_string());
        if let Some(package) = package {
            for line in src.lines() {
                if let Some(rest) = line.strip_prefix("test_") {
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    let full = format!("data.{package}.test_{name}");
                    if !tests.contains(&full) {
                        tests.push(full);
                    }
                }
            }
        }
    }
    let reference: serde_json::Value =
        serde_json::from_str(DEFAULT_REFERENCE_VALUES).map_err(|e| Error::Rego {
            file: "reference-values/default.json".into(),
            detail: e.to_string(),
        })?;
    engine
        .add_data(regorus::Value::from(
            serde_json::json!({ "reference": reference }),
        ))
        .map_err(|e| Error::Rego {
            file: "reference-values/default.json".into(),
            detail: e.to_string(),
        })?;
    let mut results = Vec::new();
    for name in tests {
        let outcome = engine.eval_rule(name.clone());
        let (passed, detail) = match outcome {
            Ok(regorus::Value::Bool(true)) => (true, None),
            Ok(regorus::Value::Undefined) => (false, Some("undefined (a condition failed)".into())),
            Ok(other) => (false, Some(format!("evaluated to {other}"))),
            Err(e) => (false, Some(e.to_string())),
        };
        results.push(TestResult {
            name,
            passed,
            detail,
        });
    }
    Ok(results)
}
