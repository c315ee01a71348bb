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

impl Violation {
    /// `rule [claim code]: value (expected …)`, strings shown without JSON quotes.
    pub fn describe(&self) -> String {
        fn plain(v: &serde_json::Value) -> String {
            match v {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            }
        }
        format!(
            "{} [{} {}]: {} (expected {})",
            self.rule,
            self.claim,
            self.code,
            plain(&self.value),
            plain(&self.expected)
        )
    }
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
    affirming: BTreeMap<String, i64>,
    violations: Vec<Violation>,
}

/// A compiled appraisal policy with its reference values.
///
/// The policy is compiled once to a regorus RVM program; evaluations run on VMs kept in a small
/// pool (each VM already holds the program and the reference values), about five times faster
/// than interpreting the compiled policy (`../shared/CRATES.md`).
pub struct PolicyEngine {
    compiled: regorus::CompiledPolicy,
    program: std::sync::Arc<regorus::rvm::Program>,
    data: regorus::Value,
    vms: std::sync::Mutex<Vec<regorus::rvm::RegoVM>>,
    /// The top-level claims the policy reads, when it only ever reads `input.<name>`; the input
    /// is then built from those alone. `None`: the policy sees all claims.
    reads: Option<Vec<String>>,
    /// `name@sha256:<digest of policy ‖ reference values>`: goes into the EAR's policy ids.
    id: String,
    /// GPU golden measurements, compared before evaluation ([`Golden`]).
    golden: Golden,
    /// Outcomes by exact policy input, when the policy is a pure function of input and data
    /// (see [`is_pure`]). A VM re-attesting with fresh nonces presents the same projected claims
    /// (nonces and report data are not read), so its appraisals skip the RVM.
    memo: Option<std::sync::Mutex<std::collections::HashMap<String, Outcome>>>,
}

/// Bound on memoized outcomes; past it the memo is cleared.
const MEMO_CAP: usize = 4096;

/// Builtins whose answer depends on something besides input and data (the clock, randomness,
/// the network, the runtime): a policy naming any of them is evaluated every time.
const IMPURE_BUILTINS: [&str; 8] = [
    "time.now_ns",
    "rand.",
    "http.send",
    "uuid.",
    "opa.runtime",
    "net.lookup",
    "crypto.x509.parse_and_verify",
    "trace(",
];

/// Is a policy's result a function of input and data alone? Conservative: any mention of an
/// impure builtin, even in a comment, says no.
fn is_pure(rego: &str) -> bool {
    !IMPURE_BUILTINS.iter().any(|b| rego.contains(b))
}

/// The input field carrying the golden-measurement comparison.
pub const MEASUREMENT_MISMATCHES: &str = "measurement_mismatches";

/// GPU golden measurements from reference values (`nvidia.measurements`: index → allowed
/// digests), compared before the policy runs, as NVIDIA's verifier reports `measres`: walking
/// 64 measurements in the RVM cost more than verifying the evidence, and the comparison is a
/// set lookup with nothing to decide. The policy decides what a mismatch means; for NVIDIA
/// evidence it receives `input.measurement_mismatches`: per index whose digest is not allowed,
/// `{index, value, expected}` (value `absent` when the evidence lacks the index).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Golden(Vec<(String, Vec<String>)>);

impl Golden {
    fn from_reference(reference: &serde_json::Value) -> Result<Self> {
        let bad = || Error::Policy {
            detail: "reference values nvidia.measurements must map an index to a list of digests"
                .into(),
        };
        let Some(table) = reference.get("nvidia").and_then(|n| n.get("measurements")) else {
            return Ok(Golden::default());
        };
        let table = table.as_object().ok_or_else(bad)?;
        let mut out = Vec::with_capacity(table.len());
        for (index, allowed) in table {
            let allowed = allowed
                .as_array()
                .ok_or_else(bad)?
                .iter()
                .map(|a| a.as_str().map(str::to_string).ok_or_else(bad))
                .collect::<Result<Vec<_>>>()?;
            out.push((index.clone(), allowed));
        }
        Ok(Golden(out))
    }

    fn mismatches(&self, measurements: Option<&serde_json::Value>) -> serde_json::Value {
        let have = measurements.and_then(|m| m.as_object());
        serde_json::Value::Array(
            self.0
                .iter()
                .filter_map(|(index, allowed)| {
                    let value = have
                        .and_then(|m| m.get(index))
                        .and_then(|v| v.as_str())
                        .unwrap_or("absent");
                    (!allowed.iter().any(|a| a == value)).then(
                        || serde_json::json!({"index": index, "value": value, "expected": allowed}),
                    )
                })
                .collect(),
        )
    }
}

/// The names `x` of every `input.x` in a policy, or `None` when `input` is used any other way
/// (`input[k]`, `x := input`, `object.get(input, …)`): then the policy must see every claim.
fn input_fields(rego: &str) -> Option<Vec<String>> {
    // Drop `#` comments, except on lines with a string literal (a `#` there may be inside it;
    // keeping the line can only make the answer more conservative).
    let code: String = rego
        .lines()
        .map(|l| match l.find('#') {
            Some(i) if !l.contains('"') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let rego = code.as_str();
    let bytes = rego.as_bytes();
    let mut names = Vec::new();
    let mut from = 0;
    while let Some(pos) = rego[from..].find("input") {
        let at = from + pos;
        from = at + 5;
        let before = at.checked_sub(1).map(|i| bytes[i]);
        if before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.') {
            continue; // part of another identifier or a path like data.input
        }
        let rest = &rego[at + 5..];
        if rest.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            continue; // e.g. `inputs`
        }
        let field = rest.strip_prefix('.')?;
        let name: String = field
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            return None;
        }
        if !names.contains(&name) {
            names.push(name);
        }
    }
    Some(names)
}

impl std::fmt::Debug for PolicyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyEngine")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
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
        let golden = Golden::from_reference(&reference)?;
        let reference_copy = reference.clone();
        let data = serde_json::json!({ "reference": reference });
        engine
            .add_data(regorus::Value::from(data))
            .map_err(|e| bad("reference values", &e))?;
        let compiled = engine
            .compile_with_entrypoint(&regorus::Rc::from(ENTRY_POINT))
            .map_err(|e| bad("policy", &e))?;
        let program = regorus::languages::rego::compiler::Compiler::compile_from_policy(
            &compiled,
            &[ENTRY_POINT],
        )
        .map_err(|e| bad("policy (RVM)", &e))?;
        let digest =
            crate::crypto::sha256(&[rego.as_bytes(), b"\0", reference_values.as_bytes()].concat());
        Ok(PolicyEngine {
            compiled,
            program,
            data: regorus::Value::from(serde_json::json!({ "reference": reference_copy })),
            vms: std::sync::Mutex::new(Vec::new()),
            golden,
            memo: is_pure(rego).then(|| std::sync::Mutex::new(std::collections::HashMap::new())),
            reads: input_fields(rego),
            id: format!("{name}@sha256:{}", hex::encode(digest)),
        })
    }

    fn run(&self, input: regorus::Value) -> std::result::Result<regorus::Value, String> {
        let pooled = self.vms.lock().ok().and_then(|mut p| p.pop());
        let mut vm = match pooled {
            Some(vm) => vm,
            None => {
                let mut vm = regorus::rvm::RegoVM::new_with_policy(self.compiled.clone());
                vm.load_program(self.program.clone());
                vm.set_data(self.data.clone()).map_err(|e| e.to_string())?;
                vm
            }
        };
        vm.set_input(input);
        let out = vm
            .execute_entry_point_by_name(ENTRY_POINT)
            .map_err(|e| e.to_string());
        if let Ok(mut pool) = self.vms.lock()
            && pool.len() < 64
        {
            pool.push(vm);
        }
        out
    }

    /// The claims the policy reads (`None`: all of them).
    pub fn reads(&self) -> Option<&[String]> {
        self.reads.as_deref()
    }

    /// Identifier of this policy and its reference values.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Appraise verified claims.
    pub fn evaluate(&self, claims: &Claims) -> Result<Outcome> {
        let json = serde_json::to_value(claims).map_err(|e| Error::Policy {
            detail: format!("claims: {e}"),
        })?;
        self.evaluate_json(&json)
    }

    /// Whether outcomes are memoized by input (the policy is pure).
    pub fn memoizes(&self) -> bool {
        self.memo.is_some()
    }

    /// Evaluate `claims` without the memo (benchmarks report the cold cost too).
    pub fn evaluate_json_cold(&self, claims: &serde_json::Value) -> Result<Outcome> {
        self.evaluate_uncached(self.policy_input(claims))
    }

    /// Appraise a claims-shaped JSON value (policy tests feed claims they construct).
    pub fn evaluate_json(&self, claims: &serde_json::Value) -> Result<Outcome> {
        let input = self.policy_input(claims);
        let key = match &self.memo {
            Some(_) => serde_json::to_string(&input).ok(),
            None => None,
        };
        if let (Some(memo), Some(k)) = (&self.memo, &key)
            && let Some(hit) = memo.lock().ok().and_then(|m| m.get(k).cloned())
        {
            return Ok(hit);
        }
        let outcome = self.evaluate_uncached(input)?;
        if let (Some(memo), Some(k)) = (&self.memo, key)
            && let Ok(mut m) = memo.lock()
        {
            if m.len() >= MEMO_CAP {
                m.clear();
            }
            m.insert(k, outcome.clone());
        }
        Ok(outcome)
    }

    /// The policy input for `claims`: the claims the policy reads, plus the golden comparison
    /// for NVIDIA evidence.
    fn policy_input(&self, claims: &serde_json::Value) -> serde_json::Value {
        let mut input = match (&self.reads, claims) {
            (Some(reads), serde_json::Value::Object(all)) => serde_json::Value::Object(
                reads
                    .iter()
                    .filter_map(|name| all.get(name).map(|v| (name.clone(), v.clone())))
                    .collect(),
            ),
            (_, other) => other.clone(),
        };
        if let serde_json::Value::Object(fields) = &mut input
            && claims.get("kind").and_then(|k| k.as_str()) == Some("nvidia")
            && self
                .reads
                .as_ref()
                .is_none_or(|r| r.iter().any(|n| n == MEASUREMENT_MISMATCHES))
        {
            let m = self.golden.mismatches(claims.get("measurements"));
            fields.insert(MEASUREMENT_MISMATCHES.into(), m);
        }
        input
    }

    fn evaluate_uncached(&self, input: serde_json::Value) -> Result<Outcome> {
        let input = regorus::Value::from(input);
        let out = self.run(input).map_err(|e| Error::Policy {
            detail: format!("evaluation: {e}"),
        })?;
        let json = serde_json::to_value(&out).map_err(|e| Error::Policy {
            detail: format!("result: {e}"),
        })?;
        let raw: RawOutcome = serde_json::from_value(json).map_err(|e| Error::Policy {
            detail: format!("policy result is not {{affirming, violations}}: {e}"),
        })?;
        let mut trust_vector = raw.affirming;
        for v in &raw.violations {
            let code = trust_vector.entry(v.claim.clone()).or_insert(0);
            *code = (*code).max(v.code);
        }
        for (name, code) in &trust_vector {
            if !TRUST_CLAIMS.contains(&name.as_str()) || !(-128..=127).contains(code) {
                return Err(Error::Policy {
                    detail: format!("policy set unknown trust claim or code '{name}' = {code}"),
                });
            }
        }
        let status = trust_vector
            .values()
            .map(|&c| Tier::of(c))
            .max()
            .unwrap_or(Tier::None);
        let mut violations = raw.violations;
        violations.sort_by(|a, b| b.code.cmp(&a.code).then(a.rule.cmp(&b.rule)));
        Ok(Outcome {
            status,
            trust_vector,
            violations,
        })
    }
}

/// The whole appraisal of one piece of evidence: verify, evaluate policy, sign the result.
#[derive(Debug)]
pub struct Appraiser {
    pub verifier: crate::Verifier,
    pub engine: PolicyEngine,
    pub signer: crate::results::ResultSigner,
}

/// An appraisal and its signed result.
#[derive(Debug)]
pub struct Appraised {
    pub claims: Claims,
    pub outcome: Outcome,
    /// The EAR as a signed JWT.
    pub token: String,
}

impl Appraiser {
    /// Policy outcome and canonical claims digest, from one JSON rendering of the claims.
    fn evaluate(&self, claims: &Claims) -> Result<(Outcome, [u8; 32])> {
        let json = serde_json::to_value(claims).map_err(|e| Error::Policy {
            detail: format!("claims: {e}"),
        })?;
        Ok((
            self.engine.evaluate_json(&json)?,
            crate::results::claims_digest_of(&json),
        ))
    }

    /// Verify `evidence` at `now`, appraise it, and sign an EAR issued at `issued_at` (Unix
    /// seconds) echoing `nonce` and binding `node_key` when given.
    pub fn appraise(
        &self,
        evidence: &crate::Evidence<'_>,
        now: time::OffsetDateTime,
        issued_at: i64,
        nonce: Option<&[u8]>,
        node_key: Option<&[u8]>,
    ) -> Result<Appraised> {
        let claims = self.verifier.verify(evidence, now)?.into_claims();
        let (outcome, digest) = self.evaluate(&claims)?;
        let name = claims.kind.as_str();
        let ear = self.signer.build(
            &[crate::results::Submod::of(name, &claims, digest, &outcome)],
            self.engine.id(),
            nonce,
            node_key,
            issued_at,
        )?;
        let token = self.signer.sign(&ear)?;
        Ok(Appraised {
            claims,
            outcome,
            token,
        })
    }
}

impl Appraiser {
    /// Appraise composite evidence (one CPU report bound to its GPUs, a broker nonce and the
    /// node key; [`crate::binding`]): one EAR with a submodule per piece (`cpu`, `gpu0`, …),
    /// echoing the nonce and carrying the node key the evidence bound.
    pub fn appraise_composite(
        &self,
        evidence: &crate::binding::CompositeEvidence<'_>,
        now: time::OffsetDateTime,
        issued_at: i64,
    ) -> Result<AppraisedComposite> {
        let verified = crate::binding::verify_composite(&self.verifier, evidence, now)?;
        let mut parts: Vec<(String, Claims)> = vec![("cpu".into(), verified.cpu().clone())];
        parts.extend(
            verified
                .gpus()
                .enumerate()
                .map(|(i, c)| (format!("gpu{i}"), c.clone())),
        );
        let (outcomes, digests): (Vec<_>, Vec<_>) = parts
            .iter()
            .map(|(_, claims)| self.evaluate(claims))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        let submods: Vec<crate::results::Submod<'_>> = parts
            .iter()
            .zip(&outcomes)
            .zip(&digests)
            .map(|(((name, claims), outcome), digest)| {
                crate::results::Submod::of(name, claims, *digest, outcome)
            })
            .collect();
        let ear = self.signer.build(
            &submods,
            self.engine.id(),
            Some(verified.nonce()),
            Some(verified.node_pubkey()),
            issued_at,
        )?;
        let status = outcomes
            .iter()
            .map(|o| o.status)
            .max()
            .unwrap_or(Tier::None);
        let token = self.signer.sign(&ear)?;
        Ok(AppraisedComposite {
            parts: parts
                .into_iter()
                .zip(outcomes)
                .map(|((n, c), o)| (n, c, o))
                .collect(),
            status,
            token,
        })
    }
}

/// A composite appraisal: each part's claims and outcome, the overall tier, the signed EAR.
#[derive(Debug)]
pub struct AppraisedComposite {
    pub parts: Vec<(String, Claims, Outcome)>,
    /// The worst tier among the parts.
    pub status: Tier,
    pub token: String,
}
