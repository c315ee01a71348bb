//! Compact JWS with EdDSA (Ed25519), as CoCo's kbs-client signs admin tokens and as brokers
//! sign lease tokens: parse, check the header, verify against a set of keys, check `exp`/`iat`
//! at an explicit time. Sans-IO.

use aws_lc_rs::signature::{ED25519, UnparsedPublicKey};
use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use serde_json::Value;

/// Tolerated clock skew for `iat`/`nbf`.
pub(crate) const SKEW_SECS: i64 = 60;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum JwtError {
    #[error("not a compact JWS")]
    Malformed,
    #[error("algorithm {0} is not EdDSA")]
    Algorithm(String),
    #[error("signature does not verify under any configured key")]
    Signature,
    #[error("expired at {0}")]
    Expired(i64),
    #[error("not valid yet (iat/nbf {0})")]
    NotYetValid(i64),
    #[error("no integer exp claim")]
    NoExpiry,
    #[error("no integer iat claim")]
    NoIssuedAt,
    #[error("lives {lifetime} s (exp − iat), more than the {max} s allowed")]
    TooLong { lifetime: i64, max: i64 },
}

/// An Ed25519 public key from config: base64 (standard or URL-safe) of the raw 32 bytes, a PEM
/// `PUBLIC KEY` (SPKI) text, or a path to a file holding either.
pub fn ed25519_key(spec: &str) -> Result<[u8; 32], String> {
    let text = if std::path::Path::new(spec).is_file() {
        std::fs::read_to_string(spec).map_err(|e| format!("{spec}: {e}"))?
    } else {
        spec.to_string()
    };
    let text = text.trim();
    let raw = if let Some(body) = text.strip_prefix("-----BEGIN PUBLIC KEY-----") {
        let b64: String = body
            .split("-----END PUBLIC KEY-----")
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        let der = STANDARD
            .decode(b64)
            .map_err(|_| "PEM body is not base64".to_string())?;
        // SPKI for Ed25519 is 44 bytes: a 12-byte prefix (OID 1.3.101.112) and the key.
        const PREFIX: [u8; 12] = [
            0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
        ];
        if der.len() != 44 || der[..12] != PREFIX {
            return Err("PEM key is not an Ed25519 SubjectPublicKeyInfo".into());
        }
        der[12..].to_vec()
    } else {
        STANDARD
            .decode(text)
            .or_else(|_| URL_SAFE_NO_PAD.decode(text.trim_end_matches('=')))
            .map_err(|_| "key is neither PEM nor base64".to_string())?
    };
    raw.try_into()
        .map_err(|_| "Ed25519 public keys are 32 bytes".to_string())
}

/// Verify `token` under any of `keys` at `now`: EdDSA only, integer `exp` and `iat` required,
/// `exp − iat` at most `max_lifetime` seconds, not expired, `iat`/`nbf` not ahead of `now` by
/// more than [`SKEW_SECS`]. Returns (index of the key, claims).
pub fn verify_eddsa(
    token: &str,
    keys: &[[u8; 32]],
    now: i64,
    max_lifetime: i64,
) -> Result<(usize, Value), JwtError> {
    let mut parts = token.split('.');
    let (Some(h), Some(p), Some(s), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(JwtError::Malformed);
    };
    let header: Value = URL_SAFE_NO_PAD
        .decode(h)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or(JwtError::Malformed)?;
    let alg = header.get("alg").and_then(Value::as_str).unwrap_or("");
    if alg != "EdDSA" && alg != "Ed25519" {
        return Err(JwtError::Algorithm(alg.into()));
    }
    let sig = URL_SAFE_NO_PAD.decode(s).map_err(|_| JwtError::Malformed)?;
    let signed = &token.as_bytes()[..h.len() + 1 + p.len()];
    let index = keys
        .iter()
        .position(|k| {
            UnparsedPublicKey::new(&ED25519, k)
                .verify(signed, &sig)
                .is_ok()
        })
        .ok_or(JwtError::Signature)?;
    let claims: Value = URL_SAFE_NO_PAD
        .decode(p)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or(JwtError::Malformed)?;
    if !claims.is_object() {
        return Err(JwtError::Malformed);
    }
    let exp = claims
        .get("exp")
        .and_then(Value::as_i64)
        .ok_or(JwtError::NoExpiry)?;
    let iat = claims
        .get("iat")
        .and_then(Value::as_i64)
        .ok_or(JwtError::NoIssuedAt)?;
    let lifetime = exp.saturating_sub(iat);
    if lifetime > max_lifetime {
        return Err(JwtError::TooLong {
            lifetime,
            max: max_lifetime,
        });
    }
    if now > exp {
        return Err(JwtError::Expired(exp));
    }
    let nbf = match claims.get("nbf") {
        None => None,
        Some(v) => Some(v.as_i64().ok_or(JwtError::Malformed)?),
    };
    for t in [Some(iat), nbf].into_iter().flatten() {
        if t > now.saturating_add(SKEW_SECS) {
            return Err(JwtError::NotYetValid(t));
        }
    }
    Ok((index, claims))
}

/// Sign `claims` as an EdDSA compact JWS with a PKCS#8 Ed25519 key (tests, `cgx` admin tooling
/// and the broker).
pub fn sign_eddsa(pkcs8: &[u8], claims: &Value) -> Result<String, String> {
    let kp = aws_lc_rs::signature::Ed25519KeyPair::from_pkcs8(pkcs8)
        .map_err(|_| "not an Ed25519 PKCS#8 key".to_string())?;
    let h = URL_SAFE_NO_PAD.encode(br#"{"alg":"EdDSA","typ":"JWT"}"#);
    let p = URL_SAFE_NO_PAD.encode(claims.to_string());
    let signing_input = format!("{h}.{p}");
    let sig = kp.sign(signing_input.as_bytes());
    Ok(format!(
        "{signing_input}.{}",
        URL_SAFE_NO_PAD.encode(sig.as_ref())
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use aws_lc_rs::signature::{Ed25519KeyPair, KeyPair};

    #[test]
    fn sign_verify_expire_and_tamper() {
        let doc = Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new()).unwrap();
        let kp = Ed25519KeyPair::from_pkcs8(doc.as_ref()).unwrap();
        let key: [u8; 32] = kp.public_key().as_ref().try_into().unwrap();
        let t = sign_eddsa(doc.as_ref(), &serde_json::json!({"iat": 100, "exp": 200})).unwrap();
        assert_eq!(verify_eddsa(&t, &[[9; 32], key], 150, 100).unwrap().0, 1);
        assert_eq!(
            verify_eddsa(&t, &[key], 201, 100),
            Err(JwtError::Expired(200))
        );
        assert_eq!(
            verify_eddsa(&t, &[key], 30, 100),
            Err(JwtError::NotYetValid(100))
        );
        assert_eq!(
            verify_eddsa(&t, &[key], 150, 99),
            Err(JwtError::TooLong {
                lifetime: 100,
                max: 99
            })
        );
        assert_eq!(
            verify_eddsa(&t, &[[9; 32]], 150, 100),
            Err(JwtError::Signature)
        );
        let sign = |c: serde_json::Value| sign_eddsa(doc.as_ref(), &c).unwrap();
        for (claims, want) in [
            (serde_json::json!({"exp": 200}), JwtError::NoIssuedAt),
            (serde_json::json!({"iat": 100}), JwtError::NoExpiry),
            (
                serde_json::json!({"iat": 100, "exp": "200"}),
                JwtError::NoExpiry,
            ),
            (
                serde_json::json!({"iat": "100", "exp": 200}),
                JwtError::NoIssuedAt,
            ),
            (
                serde_json::json!({"iat": 100, "exp": 200, "nbf": 1000}),
                JwtError::NotYetValid(1000),
            ),
            (
                serde_json::json!({"iat": 100, "exp": 200, "nbf": "x"}),
                JwtError::Malformed,
            ),
            (
                serde_json::json!({"iat": i64::MIN, "exp": i64::MAX}),
                JwtError::TooLong {
                    lifetime: i64::MAX,
                    max: 100,
                },
            ),
        ] {
            assert_eq!(
                verify_eddsa(&sign(claims.clone()), &[key], 150, 100),
                Err(want),
                "{claims}"
            );
        }
        // Other algorithms, whatever their signature: refused before any key is tried.
        let body = URL_SAFE_NO_PAD.encode(br#"{"iat":100,"exp":200}"#);
        for alg in ["none", "HS256", "ES256", "RS256"] {
            let h = URL_SAFE_NO_PAD.encode(format!(r#"{{"alg":"{alg}","typ":"JWT"}}"#));
            let forged = format!("{h}.{body}.{}", t.rsplit('.').next().unwrap());
            assert_eq!(
                verify_eddsa(&forged, &[key], 150, 100),
                Err(JwtError::Algorithm(alg.into())),
                "{alg}"
            );
        }
        let mut bad = t.clone().into_bytes();
        let i = t.find('.').unwrap() + 3;
        bad[i] ^= 1;
        assert!(verify_eddsa(std::str::from_utf8(&bad).unwrap(), &[key], 150, 100).is_err());
        assert_eq!(
            verify_eddsa("a.b", &[key], 150, 100),
            Err(JwtError::Malformed)
        );
        let b64 = STANDARD.encode(key);
        assert_eq!(ed25519_key(&b64).unwrap(), key);
        let mut spki = vec![
            0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
        ];
        spki.extend_from_slice(&key);
        let pem = format!(
            "-----BEGIN PUBLIC KEY-----\n{}\n-----END PUBLIC KEY-----\n",
            STANDARD.encode(&spki)
        );
        assert_eq!(ed25519_key(&pem).unwrap(), key);
        assert!(ed25519_key("zz").is_err());
    }
}
