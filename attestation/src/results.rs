//! Attestation results: an EAR (draft-ietf-rats-ear, via the `ear` crate) signed with the
//! verifier's ES256 key, short-lived, carrying per-evidence appraisals (trust vector, policy id,
//! violations), the digest of the claims they were made from, the broker nonce and the node key
//! the evidence bound. The public key is published as a JWKS.

use base64::Engine;
use ear::{Algorithm, Appraisal, Ear, RawValue, TrustTier, VerifierID};

use crate::appraisal::{Outcome, Tier};
use crate::claims::Claims;
use crate::crypto::sha256;
use crate::error::{Error, Result};

/// Default lifetime of a result: placement and key release must use fresh appraisals.
pub const DEFAULT_TTL_SECS: i64 = 300;

fn err(detail: impl Into<String>) -> Error {
    Error::Result {
        detail: detail.into(),
    }
}

fn b64url(b: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}

/// One appraised piece of evidence, named as an EAR submodule (`cpu`, `gpu0`, …).
#[derive(Debug, Clone, Copy)]
pub struct Submod<'a> {
    pub name: &'a str,
    /// Evidence kind of the appraised claims (`snp`, `tdx`, `nvidia`, …).
    pub kind: &'a str,
    /// Whether the claims came from simulated evidence.
    pub sim: bool,
    /// [`claims_digest`] of the claims.
    pub claims_sha256: [u8; 32],
    pub outcome: &'a Outcome,
}

impl<'a> Submod<'a> {
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

/// SHA-256 of the claims in canonical JSON: object keys sorted, no whitespace (what
/// `serde_json::Value` writes; for claims — strings, integers, booleans — this is RFC 8785 JCS).
/// Auditors recompute it from archived claims to tie a result to what was appraised.
pub fn claims_digest(claims: &Claims) -> Result<[u8; 32]> {
    let v = serde_json::to_value(claims).map_err(|e| err(format!("claims: {e}")))?;
    Ok(claims_digest_of(&v))
}

/// [`claims_digest`] of claims already turned into a JSON value.
pub fn claims_digest_of(claims: &serde_json::Value) -> [u8; 32] {
    sha256(claims.to_string().as_bytes())
}

/// Signs EARs. The private key never leaves this value and is never printed.
pub struct ResultSigner {
    key: aws_lc_rs::signature::EcdsaKeyPair,
    /// `base64url(protected header) "."`, fixed per key.
    header_b64: String,
    public_point: Vec<u8>,
    kid: String,
    /// Lifetime of issued results in seconds.
    pub ttl_secs: i64,
}

impl std::fmt::Debug for ResultSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResultSigner")
            .field("kid", &self.kid)
            .field("ttl_secs", &self.ttl_secs)
            .finish_non_exhaustive()
    }
}

impl ResultSigner {
    /// A fresh P-256 key.
    pub fn generate() -> Result<Self> {
        let rng = aws_lc_rs::rand::SystemRandom::new();
        let doc = aws_lc_rs::signature::EcdsaKeyPair::generate_pkcs8(
            &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            &rng,
        )
        .map_err(|_| err("key generation failed"))?;
        Self::from_pkcs8(doc.as_ref())
    }

    /// A P-256 key from PKCS#8 DER.
    pub fn from_pkcs8(pkcs8: &[u8]) -> Result<Self> {
        use aws_lc_rs::signature::KeyPair;
        let kp = aws_lc_rs::signature::EcdsaKeyPair::from_pkcs8(
            &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            pkcs8,
        )
        .map_err(|_| err("signing key is not a P-256 PKCS#8 key"))?;
        let public_point = kp.public_key().as_ref().to_vec();
        if public_point.len() != 65 {
            return Err(err("unexpected public key encoding"));
        }
        // RFC 7638 thumbprint as the key id.
        let thumb = format!(
            r#"{{"crv":"P-256","kty":"EC","x":"{}","y":"{}"}}"#,
            b64url(&public_point[1..33]),
            b64url(&public_point[33..65])
        );
        let kid = b64url(&sha256(thumb.as_bytes()));
        let header = serde_json::json!({"alg": "ES256", "typ": "JWT", "kid": kid});
        Ok(ResultSigner {
            key: kp,
            header_b64: format!("{}.", b64url(header.to_string().as_bytes())),
            public_point,
            kid,
            ttl_secs: DEFAULT_TTL_SECS,
        })
    }

    pub fn kid(&self) -> &str {
        &self.kid
    }

    /// The public key as a JWK.
    pub fn jwk(&self) -> serde_json::Value {
        serde_json::json!({
            "kty": "EC",
            "crv": "P-256",
            "x": b64url(&self.public_point[1..33]),
            "y": b64url(&self.public_point[33..65]),
            "use": "sig",
            "alg": "ES256",
            "kid": self.kid,
        })
    }

    /// The JWKS a relying party fetches to verify results.
    pub fn jwks(&self) -> serde_json::Value {
        serde_json::json!({ "keys": [self.jwk()] })
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
        let mut ear = Ear::new();
        ear.profile = ear::EAR_PROFILE.to_string();
        ear.iat = issued_at;
        ear.exp = Some(issued_at + self.ttl_secs);
        ear.vid = VerifierID {
            build: concat!("cgx-attestation ", env!("CARGO_PKG_VERSION")).to_string(),
            developer: "cgx".to_string(),
        };
        if let Some(n) = nonce {
            ear.nonce = Some(ear::Nonce::try_from(n).map_err(|e| err(format!("nonce: {e}")))?);
        }
        for s in submods {
            let mut a = Appraisal::new();
            for (claim, code) in &s.outcome.trust_vector {
                let code = i8::try_from(*code).map_err(|_| err(format!("{claim} code {code}")))?;
                if code != 0 {
                    a.trust_vector
                        .mut_by_name(claim)
                        .map_err(|e| err(format!("{claim}: {e}")))?
                        .set(code);
                }
            }
            a.update_status_from_trust_vector();
            a.policy_ids = vec![policy_id.to_string()];
            let mut vc = std::collections::BTreeMap::new();
            vc.insert(
                "cgx.claims-sha256".to_string(),
                RawValue::String(hex::encode(s.claims_sha256)),
            );
            vc.insert("cgx.kind".to_string(), RawValue::String(s.kind.into()));
            vc.insert("cgx.sim".to_string(), RawValue::Bool(s.sim));
            if let Some(k) = node_key {
                vc.insert("cgx.node-key".to_string(), RawValue::String(hex::encode(k)));
            }
            if !s.outcome.violations.is_empty() {
                let v = s
                    .outcome
                    .violations
                    .iter()
                    .map(|v| RawValue::String(v.describe()))
                    .collect();
                vc.insert("cgx.violations".to_string(), RawValue::Array(v));
            }
            a.verifier_claims = vc;
            ear.submods.insert(s.name.to_string(), a);
        }
        ear.status = Some(ear.most_severe_submod_status());
        ear.validate()
            .map_err(|e| err(format!("invalid EAR: {e}")))?;
        Ok(ear)
    }

    /// Sign an EAR as a JWT (RFC 7515 compact JWS, ES256, `kid` in the protected header). The
    /// key is parsed once per signer; the signature is the fixed-width `r ‖ s` JWS requires.
    pub fn sign(&self, ear: &Ear) -> Result<String> {
        let payload = serde_json::to_vec(ear).map_err(|e| err(format!("EAR encoding: {e}")))?;
        let mut token = self.header_b64.clone();
        token.push_str(&b64url(&payload));
        let sig = self
            .key
            .sign(&aws_lc_rs::rand::SystemRandom::new(), token.as_bytes())
            .map_err(|_| err("signing failed"))?;
        token.push('.');
        token.push_str(&b64url(sig.as_ref()));
        Ok(token)
    }
}

/// The tier an EAR status stands for.
pub fn tier(t: &TrustTier) -> Tier {
    match t {
        TrustTier::None => Tier::None,
        TrustTier::Affirming => Tier::Affirming,
        TrustTier::Warning => Tier::Warning,
        TrustTier::Contraindicated => Tier::Contraindicated,
    }
}

/// Verify a result against a JWK (JSON) and return the EAR. The JWT library checks `exp`
/// against the system clock; `now` is additionally checked so callers replaying a fixed time
/// get a time-explicit answer.
pub fn verify(token: &str, jwk: &serde_json::Value, now: i64) -> Result<Ear> {
    let key = serde_json::to_vec(jwk).map_err(|e| err(e.to_string()))?;
    let ear = Ear::from_jwt_jwk(token, Algorithm::ES256, &key)
        .map_err(|e| err(format!("verification: {e}")))?;
    if ear.exp.is_some_and(|exp| now > exp) || now + 60 < ear.iat {
        return Err(err("result is expired or not yet valid"));
    }
    Ok(ear)
}
