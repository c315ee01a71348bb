//! Appraisal: are verified claims acceptable? A Rego policy (evaluated with regorus, compiled
//! once and reused) maps claims and reference values to an AR4SI trust vector plus the list of
//! violations that lowered it — each naming its rule, the offending value and what was expected.
//!
//! The verifier answers "is this evidence genuine"; this module answers "is it what we accept";
//! [`cgx_attestation::results`] signs the answer as an EAR. [`Appraiser`] is the one place the
//! three steps run together, for `cgx appraise`, the KBS and (later) the broker.

use std::collections::BTreeMap;

use cgx_attestation::results::{
    CPU_PART, Ear, Outcome, ResultSigner, Submod, TRUST_CLAIMS, Tier, Violation, canonical_claims,
    claims_digest_of, gpu_part,
};
use cgx_attestation::{Claims, EvidenceKind, VerifiedClaims, Verifier};
use cgx_protocol::jcs::Canonical;
use serde::Deserialize;

use crate::Error;
use crate::program::RegoProgram;

type Result<T, E = Error> = std::result::Result<T, E>;

/// The entry point every appraisal policy defines.
pub(crate) const ENTRY_POINT: &str = "data.cgx.appraisal.result";

#[derive(Deserialize)]
struct RawOutcome {
    affirming: BTreeMap<String, i64>,
    violations: Vec<Violation>,
}

/// A compiled appraisal policy with its reference values.
///
/// The policy is compiled once ([`RegoProgram`]: an RVM program, VMs pooled), its outcomes
/// memoized by exact input when it is pure.
pub struct PolicyEngine {
    program: RegoProgram,
    /// The top-level claims the policy reads, when it only ever reads `input.<name>`; the input
    /// is then built from those alone. `None`: the policy sees all claims.
    reads: Option<Vec<String>>,
    /// `name@sha256:<digest of policy ‖ reference values>`: goes into the EAR's policy ids.
    id: String,
    /// GPU golden measurements, compared before evaluation ([`Golden`]).
    golden: Golden,
    /// Outcomes by exactly what the policy input is made from ([`PolicyEngine::memo_key`]),
    /// when the policy is a pure function of input and data (see [`is_pure`]). A VM re-attesting
    /// with fresh nonces presents the same projected claims (nonces and report data are not
    /// read), so its appraisals skip the RVM. Keys are compared whole; the hash only places them.
    memo: Option<std::sync::Mutex<Memo>>,
    /// The top-level claims the policy input is made from when `reads` is known: those read,
    /// `kind` and `measurements` (the golden comparison's inputs), sorted.
    input_claims: Option<Vec<String>>,
}

type Memo = std::collections::HashMap<Box<[u8]>, Outcome, foldhash::fast::RandomState>;

/// Bound on memoized outcomes; past it the memo is cleared.
const MEMO_CAP: usize = 1024;

/// Largest memo key kept (a GPU's claims are about 7 KiB): larger claims, which only an
/// attester's free-form fields can make, are evaluated every time rather than pinning memory.
const MEMO_KEY_MAX: usize = 16 * 1024;

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
pub(crate) const MEASUREMENT_MISMATCHES: &str = "measurement_mismatches";

/// GPU golden measurements from reference values (`nvidia.measurements`: index → allowed
/// digests), compared before the policy runs, as NVIDIA's verifier reports `measres`: walking
/// 64 measurements in the RVM cost more than verifying the evidence, and the comparison is a
/// set lookup with nothing to decide. The policy decides what a mismatch means; for NVIDIA
/// evidence it receives `input.measurement_mismatches`: per index whose digest is not allowed,
/// `{index, value, expected}` (value `absent` when the evidence lacks the index).
///
/// An empty table compares nothing, and so proves nothing: the policy refuses GPUs then
/// (`gpu_measurements_not_set`) unless the reference values say `"measurements": "any"` in
/// writing, which also compares nothing here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Golden(Vec<(String, Vec<String>)>);

/// The written waiver of a GPU reference list (`nvidia.measurements`, `driver_versions`,
/// `vbios_versions`): accept every value. Never a default.
pub const ANY: &str = "any";

impl Golden {
    fn from_reference(reference: &serde_json::Value) -> Result<Self> {
        let bad = || Error::Policy {
            detail: format!(
                "reference values nvidia.measurements must map an index to a list of digests, \
                 or be \"{ANY}\""
            ),
        };
        let Some(table) = reference.get("nvidia").and_then(|n| n.get("measurements")) else {
            return Ok(Golden::default());
        };
        if table.as_str() == Some(ANY) {
            return Ok(Golden::default());
        }
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

/// `nvidia` is an object; its `driver_versions` and `vbios_versions`, where present, a list of
/// strings or the written [`ANY`]; its `allowed_cc_modes` a list of strings. A misspelt waiver
/// (`"ANY"`, `"all"`, `true`) is refused when the reference values are set rather than read as
/// either.
fn check_gpu_lists(reference: &serde_json::Value) -> Result<()> {
    let Some(nvidia) = reference.get("nvidia") else {
        return Ok(());
    };
    if !nvidia.is_object() {
        return Err(Error::Policy {
            detail: "reference values nvidia must be an object".into(),
        });
    }
    let strings = |v: &serde_json::Value| {
        v.as_array()
            .is_some_and(|items| items.iter().all(|i| i.is_string()))
    };
    if nvidia.get("allowed_cc_modes").is_some_and(|m| !strings(m)) {
        return Err(Error::Policy {
            detail: "reference values nvidia.allowed_cc_modes must be a list of CC modes".into(),
        });
    }
    for field in ["driver_versions", "vbios_versions"] {
        let ok = match nvidia.get(field) {
            None => true,
            Some(serde_json::Value::String(s)) => s == ANY,
            Some(serde_json::Value::Array(items)) => items.iter().all(|i| i.is_string()),
            Some(_) => false,
        };
        if !ok {
            return Err(Error::Policy {
                detail: format!(
                    "reference values nvidia.{field} must be a list of versions or \"{ANY}\""
                ),
            });
        }
    }
    Ok(())
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
        let reference: serde_json::Value =
            serde_json::from_str(reference_values).map_err(|e| Error::Policy {
                detail: format!("reference values: {e}"),
            })?;
        if !reference.is_object() {
            return Err(Error::Policy {
                detail: "reference values must be a JSON object".into(),
            });
        }
        let golden = Golden::from_reference(&reference)?;
        check_gpu_lists(&reference)?;
        let program = RegoProgram::compile(
            &format!("{name}.rego"),
            rego,
            serde_json::json!({ "reference": reference }),
            ENTRY_POINT,
        )?;
        let digest = aws_lc_rs::digest::digest(
            &aws_lc_rs::digest::SHA256,
            &[rego.as_bytes(), b"\0", reference_values.as_bytes()].concat(),
        );
        let reads = input_fields(rego);
        let input_claims = reads.as_ref().map(|r| {
            let mut names = r.clone();
            names.extend(["kind".to_string(), "measurements".to_string()]);
            names.sort();
            names.dedup();
            names
        });
        Ok(PolicyEngine {
            program,
            golden,
            memo: is_pure(rego).then(|| std::sync::Mutex::new(Memo::default())),
            reads,
            input_claims,
            id: format!("{name}@sha256:{}", hex::encode(digest)),
        })
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
        let canonical = canonical_claims(claims)?;
        self.evaluate_canonical(claims, &canonical)
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
        let canonical = cgx_protocol::jcs::to_canonical(claims).map_err(|e| Error::Policy {
            detail: format!("claims: {e}"),
        })?;
        self.evaluate_memo(&canonical, || Ok(claims.clone()))
    }

    /// Appraise claims whose canonical JSON ([`canonical_claims`]) the caller already has: the
    /// memo is consulted on that text, and only a miss builds the policy's JSON input (from the
    /// claims themselves, never re-read from the text).
    pub fn evaluate_canonical(&self, claims: &Claims, canonical: &Canonical) -> Result<Outcome> {
        self.evaluate_memo(canonical, || {
            serde_json::to_value(claims).map_err(|e| Error::Policy {
                detail: format!("claims: {e}"),
            })
        })
    }

    fn evaluate_memo(
        &self,
        claims: &Canonical,
        json: impl FnOnce() -> Result<serde_json::Value>,
    ) -> Result<Outcome> {
        // No memo for an impure policy, nor for a key too large to keep.
        let key = self
            .memo
            .as_ref()
            .map(|_| self.memo_key(claims))
            .filter(|k| k.len() <= MEMO_KEY_MAX);
        if let (Some(memo), Some(k)) = (&self.memo, &key)
            && let Some(hit) = memo.lock().ok().and_then(|m| m.get(&k[..]).cloned())
        {
            return Ok(hit);
        }
        let outcome = self.evaluate_uncached(self.policy_input(&json()?))?;
        if let (Some(memo), Some(k)) = (&self.memo, key)
            && let Ok(mut m) = memo.lock()
        {
            if m.len() >= MEMO_CAP {
                m.clear();
            }
            m.insert(k.into_boxed_slice(), outcome.clone());
        }
        Ok(outcome)
    }

    /// What the policy input is made from: the canonical text of each claim in `input_claims`
    /// (name, then `=` and the value or `!` when absent, each ended by NUL; JCS text holds no
    /// raw NUL, so the encoding is unambiguous), or the whole text when the policy may read
    /// anything or the claims are not an object. Equal keys give equal inputs, so equal
    /// outcomes.
    fn memo_key(&self, claims: &Canonical) -> Vec<u8> {
        let text = claims.as_str();
        let names = match &self.input_claims {
            Some(names) if text.starts_with('{') => names,
            _ => return text.as_bytes().to_vec(),
        };
        let mut key = Vec::with_capacity(text.len());
        for name in names {
            key.extend_from_slice(name.as_bytes());
            match claims.member(name) {
                Some(value) => {
                    key.extend_from_slice(b"\0=");
                    key.extend_from_slice(value.as_bytes());
                }
                None => key.extend_from_slice(b"\0!"),
            }
            key.push(0);
        }
        key
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
        let out = self.program.eval(regorus::Value::from(input))?;
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

/// The whole appraisal: verify, evaluate policy, sign the result. The only place these three
/// steps run together — `cgx appraise`, the KBS and the broker all appraise through it.
///
/// The policy can be replaced while the appraiser serves (a KBS admin sets a new one); the
/// verifier's chain caches survive that.
#[derive(Debug)]
pub struct Appraiser {
    verifier: Verifier,
    engine: std::sync::RwLock<std::sync::Arc<PolicyEngine>>,
    signer: ResultSigner,
}

/// One appraised part of an attestation: its EAR submodule name ([`CPU_PART`], `gpu0`, …),
/// the verified claims and the policy's outcome.
#[derive(Debug, Clone)]
pub struct AppraisedPart {
    pub name: String,
    pub claims: Claims,
    pub outcome: Outcome,
}

/// An appraisal and its signed result. Built only by [`Appraiser`], from claims only a
/// [`Verifier`] builds: services act on this type, never on a result re-read from JSON.
#[derive(Debug, Clone)]
pub struct Appraisal {
    parts: Vec<AppraisedPart>,
    status: Tier,
    ear: Ear,
    token: String,
}

impl Appraisal {
    /// The parts, CPU first, GPUs in the order the evidence bound them.
    pub fn parts(&self) -> &[AppraisedPart] {
        &self.parts
    }

    /// The worst tier among the parts.
    pub fn status(&self) -> Tier {
        self.status
    }

    /// The EAR as a signed JWT.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The EAR that [`Appraisal::token`] signs.
    pub fn ear(&self) -> &Ear {
        &self.ear
    }

    /// The EAR and the token that signs it, for a caller that keeps them (a session).
    pub fn into_signed(self) -> (Ear, String) {
        (self.ear, self.token)
    }

    /// Every part's violations, described as `part: rule [claim code]: value (expected …)`.
    pub fn violations(&self) -> Vec<String> {
        self.parts
            .iter()
            .flat_map(|p| {
                p.outcome
                    .violations
                    .iter()
                    .map(move |v| format!("{}: {}", p.name, v.describe()))
            })
            .collect()
    }

    /// The single part of a one-piece appraisal (the first part otherwise).
    pub fn first(&self) -> Option<&AppraisedPart> {
        self.parts.first()
    }
}

/// The part name of one piece of evidence appraised alone: CPU evidence is [`CPU_PART`], a GPU's
/// is `gpu0`, so a policy reads a single result as it reads a composite one.
pub fn part_of(kind: EvidenceKind) -> String {
    match kind {
        EvidenceKind::Nvidia | EvidenceKind::SampleDevice => gpu_part(0),
        _ => CPU_PART.to_string(),
    }
}

impl Appraiser {
    pub fn new(verifier: Verifier, engine: PolicyEngine, signer: ResultSigner) -> Self {
        Appraiser {
            verifier,
            engine: std::sync::RwLock::new(std::sync::Arc::new(engine)),
            signer,
        }
    }

    pub fn verifier(&self) -> &Verifier {
        &self.verifier
    }

    pub fn signer(&self) -> &ResultSigner {
        &self.signer
    }

    /// The policy in force now.
    pub fn engine(&self) -> std::sync::Arc<PolicyEngine> {
        // A writer that panicked left a whole Arc behind: the lock's value is still sound.
        match self.engine.read() {
            Ok(e) => e.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Replace the policy; appraisals already running finish under the old one.
    pub fn set_engine(&self, engine: PolicyEngine) {
        let engine = std::sync::Arc::new(engine);
        match self.engine.write() {
            Ok(mut e) => *e = engine,
            Err(poisoned) => *poisoned.into_inner() = engine,
        }
    }

    /// Verify `evidence` at `now`, appraise it, and sign an EAR issued at `issued_at` (Unix
    /// seconds) echoing `nonce` and binding `node_key` when given.
    pub fn appraise(
        &self,
        evidence: &cgx_attestation::Evidence<'_>,
        now: time::OffsetDateTime,
        issued_at: i64,
        nonce: Option<&[u8]>,
        node_key: Option<&[u8]>,
    ) -> Result<Appraisal> {
        let verified = self.verifier.verify(evidence, now)?;
        let name = part_of(verified.claims().kind);
        self.appraise_verified(vec![(name, verified)], issued_at, nonce, node_key)
    }

    /// Appraise composite evidence (one CPU report bound to its GPUs, a broker nonce and the
    /// node key; [`cgx_attestation::binding`]): one EAR with a submodule per piece ([`CPU_PART`],
    /// `gpu0`, …), echoing the nonce and carrying the node key the evidence bound.
    pub fn appraise_composite(
        &self,
        evidence: &cgx_attestation::binding::CompositeEvidence<'_>,
        now: time::OffsetDateTime,
        issued_at: i64,
    ) -> Result<Appraisal> {
        let verified = cgx_attestation::binding::verify_composite(&self.verifier, evidence, now)?;
        let nonce = verified.nonce().to_vec();
        let node_key = verified.node_pubkey().to_vec();
        let parts = verified.into_parts();
        self.appraise_verified(parts, issued_at, Some(&nonce), Some(&node_key))
    }

    /// Appraise parts that were verified (and bound) by the caller — the KBS verifies CoCo's
    /// evidence shapes and checks their binding to its session itself — and sign one EAR.
    pub fn appraise_verified(
        &self,
        parts: Vec<(String, VerifiedClaims)>,
        issued_at: i64,
        nonce: Option<&[u8]>,
        node_key: Option<&[u8]>,
    ) -> Result<Appraisal> {
        let engine = self.engine();
        let mut appraised = Vec::with_capacity(parts.len());
        let mut digests = Vec::with_capacity(parts.len());
        for (name, verified) in parts {
            let claims = verified.into_claims();
            // One canonical serialization serves the digest and the policy memo.
            let canonical = canonical_claims(&claims)?;
            let outcome = engine.evaluate_canonical(&claims, &canonical)?;
            digests.push(claims_digest_of(&canonical));
            appraised.push(AppraisedPart {
                name,
                claims,
                outcome,
            });
        }
        let submods: Vec<Submod<'_>> = appraised
            .iter()
            .zip(&digests)
            .map(|(p, digest)| Submod::of(&p.name, &p.claims, *digest, &p.outcome))
            .collect();
        let ear = self
            .signer
            .build(&submods, engine.id(), nonce, node_key, issued_at)?;
        let token = self.signer.sign(&ear)?;
        let status = appraised
            .iter()
            .map(|p| p.outcome.status)
            .max()
            .unwrap_or(Tier::None);
        Ok(Appraisal {
            parts: appraised,
            status,
            ear,
            token,
        })
    }
}
