//! Appraisal: are verified claims acceptable? A Rego policy (evaluated with regorus, compiled
//! once and reused) maps claims and reference values to an AR4SI trust vector plus the list of
//! violations that lowered it — each naming its rule, the offending value and what was expected.
//!
//! The verifier answers "is this evidence genuine"; this module answers "is it what we accept";
//! [`crate::results`] signs the answer as an EAR.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::claims::Claims;
use crate::error::{Error, Result};

/// Trust-vector claim names (draft-ietf-rats-ar4si §2.3), in EAR order.
pub const TRUST_CLAIMS: [&str; 8] = [
    "instance-identity",
    "configuration",
    "executables",
    "file-system",
    "hardware",
    "runtime-opaque",
    "storage-opaque",
    "sourced-data",
];

/// The entry point every appraisal policy defines.
pub const ENTRY_POINT: &str = "data.cgx.appraisal.result";

/// AR4SI trustworthiness tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    None,
    Affirming,
    Warning,
    Contraindicated,
}

impl Tier {
    /// Tier of one AR4SI claim value: 0 none, 1 and -1..=31 affirming... per §2.3.1:
    /// -1..=1 none, 2..=31 affirming, 32..=95 warning, 96..=127 contraindicated.
    pub fn of(code: i64) -> Tier {
        match code {
            2..=31 => Tier::Affirming,
            32..=95 => Tier::Warning,
            96..=127 => Tier::Contraindicated,
            _ => Tier::None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::None => "none",
            Tier::Affirming => "affirming",
            Tier::Warning => "warning",
            Tier::Contraindicated => "contraindicated",
        }
    }
}

/// One reason the policy lowered a claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Violation {
    pub rule: String,
    pub claim: String,
    pub code: i64,
    pub value: serde_json::Value,
    pub expected: serde_json::Value,
}

/// What the policy decided about one piece of evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// Overall tier: the worst tier among the set claims.
    pub status: Tier,
    pub trust_vector: BTreeMap<String, i64>,
    pub violations: Vec<Violation>,
}

#[derive(Deserialize)]
struct RawOutcome {
    trust_vector: BTreeMap<String, i64>,
    violations: Vec<Violation>,
}

/// A compiled appraisal policy with its reference values.
#[derive(Debug, Clone)]
pub struct PolicyEngine {
    compiled: regorus::CompiledPolicy,
    /// `name@sha256:<digest of policy ‖ reference values>`: goes into the EAR's policy ids.
    id: String,
}

impl PolicyEngine {
    /// Compile `rego` with `reference_values` (JSON) placed under `data.reference`.
    pub fn new(name: &str, rego: &str, reference_values: &str) -> Result<Self> {
        let bad = |what: &str, e: &dyn std::fmt::Display| Error::Policy {
            detail: format!("{what}: {e}"),
        };
        let reference: serde_json::Value =
            serde_json::from_str(reference_values).map_err(|e| bad("reference values", &e))?;
        if !reference.is_object() {
            return Err(Error::Policy {
                detail: "reference values must be a JSON object".into(),
            });
        }
        let mut engine = regorus::Engine::new();
        engine
            .add_policy(format!("{name}.rego"), rego.to_string())
            .map_err(|e| bad("policy", &e))?;
        let data = serde_json::json!({ "reference": reference });
        engine
            .add_data(regorus::Value::from(data))
            .map_err(|e| bad("reference values", &e))?;
        let compiled = engine
            .compile_with_entrypoint(&regorus::Rc::from(ENTRY_POINT))
            .map_err(|e| bad("policy", &e))?;
        let digest = crate::crypto::sha256(&[rego.as_bytes(), b"\0", reference_values.as_bytes()].concat());
        Ok(PolicyEngine {
            compiled,
            id: format!("{name}@sha256:{}", hex::encode(digest)),
        })
    }

    /// Identifier of this policy and its reference values.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Appraise verified claims.
    pub fn evaluate(&self, claims: &Claims) -> Result<Outcome> {
        let input = serde_json::to_value(claims).map_err(|e| Error::Policy {
            detail: format!("claims: {e}"),
        })?;
        self.evaluate_json(input)
    }

    /// Appraise a claims-shaped JSON value (policy tests feed claims they construct).
    pub fn evaluate_json(&self, input: serde_json::Value) -> Result<Outcome> {
        let out = self
            .compiled
            .eval_with_input(regorus::Value::from(input))
            .map_err(|e| Error::Policy {
                detail: format!("evaluation: {e}"),
            })?;
        let json = out.to_json_str().map_err(|e| Error::Policy {
            detail: format!("result: {e}"),
        })?;
        let raw: RawOutcome = serde_json::from_str(&json).map_err(|e| Error::Policy {
            detail: format!("policy result is not {{trust_vector, violations}}: {e}"),
        })?;
        for name in raw.trust_vector.keys() {
            if !TRUST_CLAIMS.contains(&name.as_str()) {
                return Err(Error::Policy {
                    detail: format!("policy set unknown trust claim '{name}'"),
                });
            }
        }
        let status = raw
            .trust_vector
            .values()
            .map(|&c| Tier::of(c))
            .max()
            .unwrap_or(Tier::None);
        let mut violations = raw.violations;
        violations.sort_by(|a, b| b.code.cmp(&a.code).then(a.rule.cmp(&b.rule)));
        Ok(Outcome {
            status,
            trust_vector: raw.trust_vector,
            violations,
        })
    }
}
