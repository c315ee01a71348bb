//! Attestation results: an EAR (draft-ietf-rats-ear-04, JSON form) signed with the verifier's
//! key (EdDSA, or ES256 for a P-256 key), short-lived, carrying per-evidence appraisals (trust
//! vector, policy id, violations), the digest of the claims they were made from, the broker
//! nonce and the node key the evidence bound. The public key is published as a JWKS.
//!
//! The EAR types are cgx's own, field by field as the draft's JSON serialization names them
//! (`eat_profile`, `ear_status`, `ear_trustworthiness_vector`, …). The `ear` crate wrote exactly
//! these bytes (`tests/ear_wire.rs` pins them), but it compiled reqwest, native-tls and OpenSSL
//! into every build for a build script of its CMW dependency.

use std::collections::BTreeMap;

use base64::Engine;
use serde::{Deserialize, Serialize};

use cgx_protocol::jcs::Canonical;

use crate::claims::Claims;
use crate::crypto::sha256;
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

/// AR4SI trustworthiness tier: one type with the wire's ([`cgx_protocol::records::Tier`]).
pub use cgx_protocol::records::Tier;

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

/// The EAR submodule of a composite result's CPU evidence (SNP report or TDX quote), as Trustee
/// names it, so CoCo release policies (`input.submods.cpu0`) read cgx results unchanged.
pub const CPU_PART: &str = "cpu0";

/// The EAR submodule of the `index`-th GPU's evidence, in the order the evidence bound them.
pub fn gpu_part(index: usize) -> String {
    format!("gpu{index}")
}

/// Default lifetime of a result: placement and key release must use fresh appraisals.
pub const DEFAULT_TTL_SECS: i64 = 300;

fn err(detail: impl Into<String>) -> Error {
    Error::Result {
        detail: detail.into(),
    }
}

/// Lowercase hex through `hex`'s table loop (its `encode` goes a character at a time).
fn hex_string(b: &[u8]) -> String {
    let mut out = vec![0; b.len() * 2];
    // The buffer is exactly twice the input, and hex digits are ASCII.
    let _ = hex::encode_to_slice(b, &mut out);
    String::from_utf8(out).unwrap_or_default()
}

fn b64url(b: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

/// One appraised piece of evidence, named as an EAR submodule (`cpu`, `gpu0`, …).
#[derive(Debug, Clone, Copy)]
pub struct Submod<'a> {
    name: &'a str,
    /// Evidence kind of the appraised claims (`snp`, `tdx`, `nvidia`, …).
    kind: &'a str,
    /// Whether the claims came from simulated evidence.
    sim: bool,
    /// [`claims_digest`] of the claims.
    claims_sha256: [u8; 32],
    outcome: &'a Outcome,
}

impl<'a> Submod<'a> {
    /// A submodule from its parts as given (wire-format tests).
    #[cfg(feature = "test-support")]
    pub fn raw(
        name: &'a str,
        kind: &'a str,
        sim: bool,
        claims_sha256: [u8; 32],
        outcome: &'a Outcome,
    ) -> Self {
        Submod {
            name,
            kind,
            sim,
            claims_sha256,
            outcome,
        }
    }

    /// A submodule for verified `claims`.
    pub fn of(
        name: &'a str,
        claims: &'a Claims,
        claims_sha256: [u8; 32],
        outcome: &'a Outcome,
    ) -> Self {
        Submod {
            name,
            kind: claims.kind.as_str(),
            sim: claims.sim,
            claims_sha256,
            outcome,
        }
    }
}

/// SHA-256 of the claims in canonical JSON (RFC 8785 JCS: members sorted, no whitespace),
/// written straight from the claims. Auditors recompute it from archived claims with any JCS
/// implementation to tie a result to what was appraised.
pub fn claims_digest(claims: &Claims) -> Result<[u8; 32]> {
    Ok(claims_digest_of(&canonical_claims(claims)?))
}

/// The claims in canonical JSON, as [`claims_digest`] hashes them.
pub fn canonical_claims(claims: &Claims) -> Result<Canonical> {
    cgx_protocol::jcs::to_canonical(claims).map_err(|e| err(format!("claims: {e}")))
}

/// [`claims_digest`] of claims already in canonical form.
pub fn claims_digest_of(claims: &Canonical) -> [u8; 32] {
    sha256(claims.as_str().as_bytes())
}

/// The result key and the JWS algorithm it signs with.
enum ResultKey {
    /// EdDSA (RFC 8037, Ed25519): what [`ResultSigner::generate`] makes. Deterministic (no
    /// per-signature randomness to get wrong inside a VM) and cheaper than ES256 (about 7 µs
    /// against 12 µs per EAR here), which matters once verification costs tens of µs.
    EdDsa(aws_lc_rs::signature::Ed25519KeyPair),
    /// ES256 (P-256), for relying parties that take nothing else: a P-256 PKCS#8 key selects it.
    Es256(aws_lc_rs::signature::EcdsaKeyPair),
}

/// Signs EARs. The private key never leaves this value and is never printed.
pub struct ResultSigner {
    key: ResultKey,
    /// `base64url(protected header) "."`, fixed per key.
    header_b64: String,
    /// The public key as a JWK, `kid` included.
    jwk: serde_json::Value,
    /// The raw public key: 32 bytes (Ed25519) or an uncompressed P-256 point.
    public: Vec<u8>,
    kid: String,
    /// Lifetime of issued results in seconds.
    pub ttl_secs: i64,
}

impl std::fmt::Debug for ResultSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResultSigner")
            .field("alg", &self.alg())
            .field("kid", &self.kid)
            .field("ttl_secs", &self.ttl_secs)
            .finish_non_exhaustive()
    }
}

impl ResultSigner {
    /// A fresh Ed25519 key (EdDSA).
    pub fn generate() -> Result<Self> {
        let doc = aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(
            &aws_lc_rs::rand::SystemRandom::new(),
        )
        .map_err(|_| err("key generation failed"))?;
        Self::from_pkcs8(doc.as_ref())
    }

    /// A fresh P-256 key (ES256).
    pub fn generate_es256() -> Result<Self> {
        let doc = aws_lc_rs::signature::EcdsaKeyPair::generate_pkcs8(
            &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            &aws_lc_rs::rand::SystemRandom::new(),
        )
        .map_err(|_| err("key generation failed"))?;
        Self::from_pkcs8(doc.as_ref())
    }

    /// An Ed25519 (EdDSA) or P-256 (ES256) key from PKCS#8 DER; the key's type picks the
    /// algorithm.
    pub fn from_pkcs8(pkcs8: &[u8]) -> Result<Self> {
        use aws_lc_rs::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, KeyPair};
        // (key, RFC 7638 thumbprint input, JWK, raw public key)
        let (key, thumbprint_input, mut jwk, public) = if let Ok(kp) =
            aws_lc_rs::signature::Ed25519KeyPair::from_pkcs8(pkcs8)
        {
            let raw = kp.public_key().as_ref().to_vec();
            let x = b64url(&raw);
            (
                ResultKey::EdDsa(kp),
                // RFC 8037 §2: an OKP key's thumbprint members are crv, kty, x.
                format!(r#"{{"crv":"Ed25519","kty":"OKP","x":"{x}"}}"#),
                serde_json::json!({"kty": "OKP", "crv": "Ed25519", "x": x, "alg": "EdDSA"}),
                raw,
            )
        } else if let Ok(kp) =
            aws_lc_rs::signature::EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8)
        {
            let point = kp.public_key().as_ref().to_vec();
            if point.len() != 65 {
                return Err(err("unexpected public key encoding"));
            }
            let (x, y) = (b64url(&point[1..33]), b64url(&point[33..65]));
            (
                ResultKey::Es256(kp),
                format!(r#"{{"crv":"P-256","kty":"EC","x":"{x}","y":"{y}"}}"#),
                serde_json::json!({"kty": "EC", "crv": "P-256", "x": x, "y": y, "alg": "ES256"}),
                point,
            )
        } else {
            return Err(err("signing key is not an Ed25519 or P-256 PKCS#8 key"));
        };
        // RFC 7638 thumbprint as the key id.
        let kid = b64url(&sha256(thumbprint_input.as_bytes()));
        jwk["use"] = "sig".into();
        jwk["kid"] = kid.clone().into();
        let alg = match key {
            ResultKey::EdDsa(_) => "EdDSA",
            ResultKey::Es256(_) => "ES256",
        };
        let header = serde_json::json!({"alg": alg, "typ": "JWT", "kid": kid});
        Ok(ResultSigner {
            key,
            header_b64: format!("{}.", b64url(header.to_string().as_bytes())),
            jwk,
            public,
            kid,
            ttl_secs: DEFAULT_TTL_SECS,
        })
    }

    pub fn kid(&self) -> &str {
        &self.kid
    }

    /// The JWS algorithm: `EdDSA` or `ES256`.
    pub fn alg(&self) -> &'static str {
        match self.key {
            ResultKey::EdDsa(_) => "EdDSA",
            ResultKey::Es256(_) => "ES256",
        }
    }

    /// The raw public key: 32 bytes for Ed25519, the uncompressed point for P-256.
    pub fn public_key(&self) -> &[u8] {
        &self.public
    }

    /// The public key as a JWK.
    pub fn jwk(&self) -> serde_json::Value {
        self.jwk.clone()
    }

    /// The JWKS a relying party fetches to verify results.
    pub fn jwks(&self) -> serde_json::Value {
        serde_json::json!({ "keys": [self.jwk] })
    }

    /// Build the EAR for `submods` (unsigned), issued at Unix time `issued_at`.
    pub fn build(
        &self,
        submods: &[Submod<'_>],
        policy_id: &str,
        nonce: Option<&[u8]>,
        node_key: Option<&[u8]>,
        issued_at: i64,
    ) -> Result<Ear> {
        if submods.is_empty() {
            return Err(err("an EAR needs at least one appraisal"));
        }
        let nonce = match nonce {
            // draft-ietf-rats-eat §4.1: a nonce is 8 to 64 bytes.
            Some(n) if !(8..=64).contains(&n.len()) => {
                return Err(err(format!("nonce: {} bytes, not 8 to 64", n.len())));
            }
            Some(n) => Some(b64url(n)),
            None => None,
        };
        let mut out = BTreeMap::new();
        for s in submods {
            let mut trust_vector = TrustVector::default();
            for (claim, code) in &s.outcome.trust_vector {
                let code = i8::try_from(*code).map_err(|_| err(format!("{claim} code {code}")))?;
                trust_vector.set(claim, code)?;
            }
            let mut vc = BTreeMap::new();
            vc.insert(
                CLAIMS_SHA256.to_string(),
                serde_json::Value::String(hex_string(&s.claims_sha256)),
            );
            vc.insert(KIND.to_string(), serde_json::Value::String(s.kind.into()));
            vc.insert(SIM.to_string(), serde_json::Value::Bool(s.sim));
            if let Some(k) = node_key {
                vc.insert(
                    NODE_KEY.to_string(),
                    serde_json::Value::String(hex_string(k)),
                );
            }
            if !s.outcome.violations.is_empty() {
                let v = s
                    .outcome
                    .violations
                    .iter()
                    .map(|v| serde_json::Value::String(v.describe()))
                    .collect();
                vc.insert(VIOLATIONS.to_string(), serde_json::Value::Array(v));
            }
            out.insert(
                s.name.to_string(),
                EarAppraisal {
                    status: trust_vector.tier(),
                    trust_vector,
                    policy_ids: vec![policy_id.to_string()],
                    verifier_claims: vc,
                },
            );
        }
        let ear = Ear {
            profile: EAR_PROFILE.to_string(),
            iat: issued_at,
            exp: Some(issued_at + self.ttl_secs),
            verifier_id: VerifierId {
                developer: "cgx".to_string(),
                build: concat!("cgx-attestation ", env!("CARGO_PKG_VERSION")).to_string(),
            },
            status: out.values().map(|a| a.status).max(),
            submods: out,
            nonce,
        };
        ear.validate()?;
        Ok(ear)
    }

    /// Sign an EAR as a JWT (RFC 7515 compact JWS, EdDSA or ES256, `kid` in the protected
    /// header). The key is parsed once per signer; an ES256 signature is the fixed-width
    /// `r ‖ s` JWS requires.
    pub fn sign(&self, ear: &Ear) -> Result<String> {
        let mut payload = Vec::with_capacity(1024);
        serde_json::to_writer(&mut payload, ear).map_err(|e| err(format!("EAR encoding: {e}")))?;
        let mut token =
            String::with_capacity(self.header_b64.len() + payload.len().div_ceil(3) * 4 + 90);
        token.push_str(&self.header_b64);
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode_string(&payload, &mut token);
        let signature = match &self.key {
            ResultKey::EdDsa(kp) => kp.sign(token.as_bytes()).as_ref().to_vec(),
            ResultKey::Es256(kp) => kp
                .sign(&aws_lc_rs::rand::SystemRandom::new(), token.as_bytes())
                .map_err(|_| err("signing failed"))?
                .as_ref()
                .to_vec(),
        };
        token.push('.');
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode_string(&signature, &mut token);
        Ok(token)
    }
}

/// The EAT profile this EAR follows.
pub(crate) const EAR_PROFILE: &str = "tag:ietf.org,2026:rats/ear#04";

/// Verifier claims cgx puts in each appraisal (`ear_verifier_claims`).
const CLAIMS_SHA256: &str = "cgx.claims-sha256";
const KIND: &str = "cgx.kind";
const SIM: &str = "cgx.sim";
const NODE_KEY: &str = "cgx.node-key";
const VIOLATIONS: &str = "cgx.violations";

/// `ear_verifier_id`: who made the result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifierId {
    pub developer: String,
    pub build: String,
}

/// `ear_trustworthiness_vector`: the AR4SI claims that were set (non-zero), written in the
/// draft's order (instance-identity … sourced-data), as the `ear` crate wrote them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustVector(BTreeMap<String, i8>);

impl TrustVector {
    /// Set `claim` to `code`; zero means unset. Unknown claims are refused.
    pub fn set(&mut self, claim: &str, code: i8) -> Result<()> {
        if !TRUST_CLAIMS.contains(&claim) {
            return Err(err(format!("unknown trust claim {claim}")));
        }
        if code == 0 {
            self.0.remove(claim);
        } else {
            self.0.insert(claim.to_string(), code);
        }
        Ok(())
    }

    pub fn get(&self, claim: &str) -> Option<i8> {
        self.0.get(claim).copied()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The worst tier among the set claims.
    pub fn tier(&self) -> Tier {
        self.0
            .values()
            .map(|&c| Tier::of(i64::from(c)))
            .max()
            .unwrap_or(Tier::None)
    }
}

impl Serialize for TrustVector {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for name in TRUST_CLAIMS {
            if let Some(code) = self.0.get(name) {
                map.serialize_entry(name, code)?;
            }
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for TrustVector {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let raw = BTreeMap::<String, i8>::deserialize(d)?;
        let mut v = TrustVector::default();
        for (claim, code) in raw {
            v.set(&claim, code).map_err(serde::de::Error::custom)?;
        }
        Ok(v)
    }
}

/// One submodule's appraisal (draft-ietf-rats-ear-04 §3.1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EarAppraisal {
    #[serde(rename = "ear_status")]
    pub status: Tier,
    #[serde(
        rename = "ear_trustworthiness_vector",
        default,
        skip_serializing_if = "TrustVector::is_empty"
    )]
    pub trust_vector: TrustVector,
    #[serde(
        rename = "ear_appraisal_policy_ids",
        default,
        skip_serializing_if = "Vec::is_empty"
    )]
    pub policy_ids: Vec<String>,
    #[serde(
        rename = "ear_verifier_claims",
        default,
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub verifier_claims: BTreeMap<String, serde_json::Value>,
}

impl EarAppraisal {
    fn claim_str(&self, name: &str) -> Option<&str> {
        self.verifier_claims.get(name).and_then(|v| v.as_str())
    }

    /// The node (TEE) key the evidence bound, as the bytes the verifier recorded.
    pub fn node_key(&self) -> Option<Vec<u8>> {
        self.claim_str(NODE_KEY).and_then(|h| hex::decode(h).ok())
    }
}

/// An EAT Attestation Result (draft-ietf-rats-ear-04 §3), JSON form.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ear {
    #[serde(rename = "eat_profile")]
    pub profile: String,
    pub iat: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exp: Option<i64>,
    #[serde(rename = "ear_verifier_id")]
    pub verifier_id: VerifierId,
    pub submods: BTreeMap<String, EarAppraisal>,
    /// Overall status: never more trustworthy than the worst submodule.
    #[serde(
        rename = "ear_status",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub status: Option<Tier>,
    /// The broker's nonce, base64url without padding.
    #[serde(rename = "eat_nonce", default, skip_serializing_if = "Option::is_none")]
    pub nonce: Option<String>,
}

impl Ear {
    /// The draft's structural rules: a profile, an issue time, at least one submodule, and an
    /// overall status no better than the worst submodule's.
    pub fn validate(&self) -> Result<()> {
        if self.profile.is_empty() {
            return Err(err("invalid EAR: empty profile"));
        }
        if self.iat == 0 {
            return Err(err("invalid EAR: iat unset"));
        }
        let Some(worst) = self.submods.values().map(|a| a.status).max() else {
            return Err(err("invalid EAR: empty submods"));
        };
        if let Some(status) = self.status
            && status != Tier::None
            && status < worst
        {
            return Err(err(format!(
                "invalid EAR: status {} is better than a submodule's {}",
                status.as_str(),
                worst.as_str()
            )));
        }
        if self.verifier_id.developer.is_empty() || self.verifier_id.build.is_empty() {
            return Err(err("invalid EAR: empty verifier id"));
        }
        Ok(())
    }

    /// The overall tier (the worst submodule's when no overall status is given).
    pub fn tier(&self) -> Tier {
        self.status.unwrap_or_else(|| {
            self.submods
                .values()
                .map(|a| a.status)
                .max()
                .unwrap_or(Tier::None)
        })
    }
}

/// Verify a result against a JWK (JSON) at Unix time `now` and return the EAR: a compact JWS
/// signed with the JWK's algorithm (an `OKP`/`Ed25519` key: EdDSA; an `EC`/`P-256` key: ES256;
/// the header must name that algorithm, so a token cannot pick another), whose `kid` (when both
/// name one) is the JWK's, whose signature verifies, whose payload is a valid EAR, and which is
/// not expired (`exp` is required) or issued more than 60 s ahead.
pub fn verify(token: &str, jwk: &serde_json::Value, now: i64) -> Result<Ear> {
    const MAX_TOKEN: usize = 256 * 1024;
    if token.len() > MAX_TOKEN {
        return Err(err("verification: token is too long"));
    }
    let mut parts = token.split('.');
    let (Some(h), Some(p), Some(sig), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(err("verification: not a compact JWS"));
    };
    let dec = |s: &str, what: &str| {
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(s)
            .map_err(|_| err(format!("verification: {what} is not base64url")))
    };
    let (alg, algorithm, public) = jwk_public_key(jwk)?;
    let header: serde_json::Value = serde_json::from_slice(&dec(h, "header")?)
        .map_err(|_| err("verification: header is not JSON"))?;
    if header.get("alg").and_then(|a| a.as_str()) != Some(alg) {
        return Err(err(format!(
            "verification: algorithm is not {alg}, the key's"
        )));
    }
    if let (Some(a), Some(b)) = (header.get("kid"), jwk.get("kid"))
        && a != b
    {
        return Err(err("verification: the token's kid is not this key's"));
    }
    let signed = &token[..h.len() + 1 + p.len()];
    aws_lc_rs::signature::UnparsedPublicKey::new(algorithm, &public)
        .verify(signed.as_bytes(), &dec(sig, "signature")?)
        .map_err(|_| err("verification: InvalidSignature"))?;
    let ear: Ear = serde_json::from_slice(&dec(p, "payload")?)
        .map_err(|e| err(format!("verification: payload is not an EAR: {e}")))?;
    ear.validate()?;
    let Some(exp) = ear.exp else {
        return Err(err("verification: the result has no exp"));
    };
    if now > exp || now + 60 < ear.iat {
        return Err(err("result is expired or not yet valid"));
    }
    Ok(ear)
}

/// The JWS algorithm a result key's JWK implies, and its public key bytes. A JWK that names an
/// `alg` must name that one.
fn jwk_public_key(
    jwk: &serde_json::Value,
) -> Result<(
    &'static str,
    &'static dyn aws_lc_rs::signature::VerificationAlgorithm,
    Vec<u8>,
)> {
    let member = |name: &str, len: usize| {
        jwk.get(name)
            .and_then(|v| v.as_str())
            .and_then(|v| {
                base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .decode(v)
                    .ok()
            })
            .filter(|v| v.len() == len)
            .ok_or_else(|| {
                err(format!(
                    "verification: JWK {name} is not {len} bytes of base64url"
                ))
            })
    };
    let text = |name: &str| jwk.get(name).and_then(|v| v.as_str());
    let (alg, algorithm, public): (
        _,
        &'static dyn aws_lc_rs::signature::VerificationAlgorithm,
        _,
    ) = match (text("kty"), text("crv")) {
        (Some("OKP"), Some("Ed25519")) => {
            ("EdDSA", &aws_lc_rs::signature::ED25519, member("x", 32)?)
        }
        (Some("EC"), Some("P-256")) => {
            let mut point = Vec::with_capacity(65);
            point.push(4);
            point.extend(member("x", 32)?);
            point.extend(member("y", 32)?);
            (
                "ES256",
                &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED,
                point,
            )
        }
        _ => {
            return Err(err(
                "verification: JWK is not an Ed25519 (OKP) or P-256 (EC) key",
            ));
        }
    };
    if jwk.get("alg").is_some_and(|a| a.as_str() != Some(alg)) {
        return Err(err(format!(
            "verification: JWK alg is not {alg}, its key's"
        )));
    }
    Ok((alg, algorithm, public))
}
