//! Ed25519 public keys as operators configure them (the keys that verify admin and API tokens,
//! and brokers' leases). Tokens themselves are `cgx_protocol::signed`'s.

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};

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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use aws_lc_rs::signature::{Ed25519KeyPair, KeyPair};

    #[test]
    fn keys_from_base64_and_spki_pem() {
        let doc = Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new()).unwrap();
        let kp = Ed25519KeyPair::from_pkcs8(doc.as_ref()).unwrap();
        let key: [u8; 32] = kp.public_key().as_ref().try_into().unwrap();
        let b64 = STANDARD.encode(key);
        assert_eq!(ed25519_key(&b64).unwrap(), key);
        assert_eq!(ed25519_key(&URL_SAFE_NO_PAD.encode(key)).unwrap(), key);
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
