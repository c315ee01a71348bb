//! The JWE a KBS answers a resource request with (RFC 7516 flattened JSON, as kbs-types'
//! `Response`), encrypted to the TEE public key the requester attested:
//!
//! - `ECDH-ES+A256KW` (RFC 7518 §4.6) on P-256, P-384 or P-521: an ephemeral key agreement, the
//!   Concat KDF (SHA-256, AlgorithmID = "ECDH-ES+A256KW", empty PartyU/V info), AES-256 key wrap
//!   of a random content key;
//! - `RSA-OAEP-256` (RFC 7518 §4.3): the content key under RSAES-OAEP with SHA-256 and MGF1-SHA-256;
//! - content: `A256GCM`, 96-bit random IV, AAD = the ASCII of the base64url protected header.
//!
//! CoCo's client does not use the `protected` text it receives as AAD: it decodes it, re-serializes
//! it compactly (kbs-types' `ProtectedHeader::generate_aad`: `alg`, `enc`, then the other fields
//! sorted) and base64url-encodes that. So the protected header is sent in exactly that form:
//! the bytes we authenticate are the bytes CoCo rebuilds. Both directions live here: the KBS
//! encrypts, the guest agent decrypts.

use aws_lc_rs::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use aws_lc_rs::agreement::{self, ECDH_P256, ECDH_P384, ECDH_P521, PrivateKey, UnparsedPublicKey};
use aws_lc_rs::key_wrap::{AES_256, AesKek, KeyWrap};
use aws_lc_rs::rsa::{
    KeySize, OAEP_SHA256_MGF1SHA256, OaepPrivateDecryptingKey, OaepPublicEncryptingKey,
    PrivateDecryptingKey, PublicEncryptingKey,
};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use kbs_types::{ProtectedHeader, Response, TeePubKey};
use serde_json::{Map, Value};

pub const ALG_ECDH_ES_A256KW: &str = "ECDH-ES+A256KW";
pub const ALG_RSA_OAEP_256: &str = "RSA-OAEP-256";
pub const ENC_A256GCM: &str = "A256GCM";

/// Why a JWE could not be made or opened. Carries no key material.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum JweError {
    #[error("unsupported TEE key: {0}")]
    UnsupportedKey(String),
    #[error("invalid TEE key: {0}")]
    InvalidKey(String),
    #[error("malformed JWE: {0}")]
    Malformed(String),
    #[error("JWE does not decrypt (wrong key or tampered)")]
    Decrypt,
    #[error("cryptographic failure: {0}")]
    Crypto(&'static str),
}

type Result<T> = std::result::Result<T, JweError>;

/// An EC curve for ECDH-ES.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Curve {
    P256,
    P384,
    P521,
}

impl Curve {
    fn from_name(crv: &str) -> Result<Self> {
        match crv {
            "P-256" => Ok(Curve::P256),
            "P-384" => Ok(Curve::P384),
            "P-521" => Ok(Curve::P521),
            other => Err(JweError::UnsupportedKey(format!("curve {other}"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Curve::P256 => "P-256",
            Curve::P384 => "P-384",
            Curve::P521 => "P-521",
        }
    }

    fn alg(self) -> &'static agreement::Algorithm {
        match self {
            Curve::P256 => &ECDH_P256,
            Curve::P384 => &ECDH_P384,
            Curve::P521 => &ECDH_P521,
        }
    }

    /// Bytes of one coordinate.
    fn coord_len(self) -> usize {
        match self {
            Curve::P256 => 32,
            Curve::P384 => 48,
            Curve::P521 => 66,
        }
    }
}

fn b64(s: &str, what: &str) -> Result<Vec<u8>> {
    B64.decode(s)
        .map_err(|_| JweError::InvalidKey(format!("{what} is not base64url")))
}

/// Uncompressed SEC1 point from JWK coordinates.
fn point(curve: Curve, x: &str, y: &str) -> Result<Vec<u8>> {
    let (x, y) = (b64(x, "x")?, b64(y, "y")?);
    let n = curve.coord_len();
    if x.len() != n || y.len() != n {
        return Err(JweError::InvalidKey(format!(
            "{} coordinates must be {n} bytes",
            curve.name()
        )));
    }
    let mut p = Vec::with_capacity(1 + 2 * n);
    p.push(4);
    p.extend_from_slice(&x);
    p.extend_from_slice(&y);
    Ok(p)
}

/// JWK coordinates of an uncompressed SEC1 point.
fn coords(curve: Curve, point: &[u8]) -> Result<(String, String)> {
    let n = curve.coord_len();
    if point.len() != 1 + 2 * n || point[0] != 4 {
        return Err(JweError::Crypto("unexpected public key encoding"));
    }
    Ok((B64.encode(&point[1..1 + n]), B64.encode(&point[1 + n..])))
}

/// RFC 7518 §4.6.2 Concat KDF with SHA-256 for a 256-bit key (one round), as `ECDH-ES+A256KW`
/// uses it: empty PartyUInfo and PartyVInfo.
fn concat_kdf(z: &[u8], alg: &str) -> [u8; 32] {
    concat_kdf_with(z, alg.as_bytes(), b"", b"", 256)
}

/// One round of the Concat KDF (NIST SP 800-56A §5.8.1, RFC 7518 §4.6.2): SHA-256 over
/// `1 ‖ Z ‖ len‖alg ‖ len‖apu ‖ len‖apv ‖ keydatalen`, for `key_bits` ≤ 256 (the first
/// `key_bits / 8` bytes are the key). Separate so RFC 7518 Appendix C's example runs through it.
fn concat_kdf_with(z: &[u8], alg: &[u8], apu: &[u8], apv: &[u8], key_bits: u32) -> [u8; 32] {
    let mut ctx = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    ctx.update(&1u32.to_be_bytes());
    ctx.update(z);
    for field in [alg, apu, apv] {
        ctx.update(&(field.len() as u32).to_be_bytes());
        ctx.update(field);
    }
    ctx.update(&key_bits.to_be_bytes()); // SuppPubInfo: key length in bits
    let mut out = [0u8; 32];
    out.copy_from_slice(ctx.finish().as_ref());
    out
}

/// ECDH with the peer's uncompressed point, then the Concat KDF: the key-encryption key of
/// `ECDH-ES+A256KW`. Both sides call it (the KBS with its ephemeral key and the TEE's key, the
/// guest with its key and the `epk`); a point off the curve is refused by aws-lc.
fn ecdh_es_kek(
    curve: Curve,
    private: &PrivateKey,
    peer: &[u8],
    refused: JweError,
) -> Result<[u8; 32]> {
    agreement::agree(
        private,
        UnparsedPublicKey::new(curve.alg(), peer),
        refused,
        |z| Ok(concat_kdf(z, ALG_ECDH_ES_A256KW)),
    )
}

/// AES-256-GCM open of a JWE's content (RFC 7518 §5.3): 256-bit key, 96-bit IV, 128-bit tag,
/// and nothing else.
fn open_a256gcm(
    cek: &[u8],
    iv: &[u8],
    aad: &[u8],
    ciphertext: &[u8],
    tag: &[u8],
) -> Result<Vec<u8>> {
    let (Ok(iv), 32, 16) = (<[u8; 12]>::try_from(iv), cek.len(), tag.len()) else {
        return Err(JweError::Malformed("key, IV or tag length".into()));
    };
    let key = LessSafeKey::new(
        UnboundKey::new(&AES_256_GCM, cek).map_err(|_| JweError::Crypto("content key"))?,
    );
    let mut buf = Vec::with_capacity(ciphertext.len() + tag.len());
    buf.extend_from_slice(ciphertext);
    buf.extend_from_slice(tag);
    let plain = key
        .open_in_place(Nonce::assume_unique_for_key(iv), Aad::from(aad), &mut buf)
        .map_err(|_| JweError::Decrypt)?
        .len();
    buf.truncate(plain);
    Ok(buf)
}

/// RSA SubjectPublicKeyInfo DER from big-endian modulus and exponent.
fn rsa_spki(n: &[u8], e: &[u8]) -> Vec<u8> {
    use crate::kbs::der::{seq, tlv, uint};
    let rsa_key = seq(&[uint(n), uint(e)]);
    let mut bits = vec![0u8];
    bits.extend_from_slice(&rsa_key);
    // rsaEncryption 1.2.840.113549.1.1.1, NULL parameters
    let alg = seq(&[
        tlv(
            0x06,
            &[0x2A, 0x86, 0x48, 0x86, 0xF7, 0x0D, 0x01, 0x01, 0x01],
        ),
        vec![0x05, 0x00],
    ]);
    seq(&[alg, tlv(0x03, &bits)])
}

fn seal(cek: &[u8; 32], protected: &ProtectedHeader, plaintext: &[u8]) -> Result<Response> {
    let aad = protected
        .generate_aad()
        .map_err(|_| JweError::Crypto("protected header encoding"))?;
    let key = LessSafeKey::new(
        UnboundKey::new(&AES_256_GCM, cek).map_err(|_| JweError::Crypto("content key"))?,
    );
    let mut iv = [0u8; 12];
    aws_lc_rs::rand::fill(&mut iv).map_err(|_| JweError::Crypto("random"))?;
    let mut ciphertext = plaintext.to_vec();
    let tag = key
        .seal_in_place_separate_tag(
            Nonce::assume_unique_for_key(iv),
            Aad::from(aad.as_slice()),
            &mut ciphertext,
        )
        .map_err(|_| JweError::Crypto("encryption"))?;
    Ok(Response {
        protected: protected.clone(),
        encrypted_key: Vec::new(),
        aad: None,
        iv: iv.to_vec(),
        ciphertext,
        tag: tag.as_ref().to_vec(),
    })
}

/// Encrypt `plaintext` to `tee` (the attested TEE public key).
pub fn encrypt(tee: &TeePubKey, plaintext: &[u8]) -> Result<Response> {
    let mut cek = [0u8; 32];
    aws_lc_rs::rand::fill(&mut cek).map_err(|_| JweError::Crypto("random"))?;
    match tee {
        TeePubKey::EC { crv, alg, x, y } => {
            if alg != ALG_ECDH_ES_A256KW {
                return Err(JweError::UnsupportedKey(format!("EC key algorithm {alg}")));
            }
            let curve = Curve::from_name(crv)?;
            let peer = point(curve, x, y)?;
            let eph =
                PrivateKey::generate(curve.alg()).map_err(|_| JweError::Crypto("ephemeral key"))?;
            let eph_pub = eph
                .compute_public_key()
                .map_err(|_| JweError::Crypto("ephemeral key"))?;
            let kek = ecdh_es_kek(
                curve,
                &eph,
                &peer,
                JweError::InvalidKey("the point is not on the curve".into()),
            )?;
            let mut wrapped = [0u8; 40];
            AesKek::new(&AES_256, &kek)
                .map_err(|_| JweError::Crypto("key wrap"))?
                .wrap(&cek, &mut wrapped)
                .map_err(|_| JweError::Crypto("key wrap"))?;
            let (ex, ey) = coords(curve, eph_pub.as_ref())?;
            let mut other = Map::new();
            other.insert(
                "epk".into(),
                serde_json::json!({"crv": curve.name(), "kty": "EC", "x": ex, "y": ey}),
            );
            let protected = ProtectedHeader {
                alg: ALG_ECDH_ES_A256KW.into(),
                enc: ENC_A256GCM.into(),
                other_fields: other,
            };
            let mut r = seal(&cek, &protected, plaintext)?;
            r.encrypted_key = wrapped.to_vec();
            Ok(r)
        }
        TeePubKey::RSA { alg, k_mod, k_exp } => {
            if alg != ALG_RSA_OAEP_256 {
                return Err(JweError::UnsupportedKey(format!("RSA key algorithm {alg}")));
            }
            let spki = rsa_spki(&b64(k_mod, "n")?, &b64(k_exp, "e")?);
            let key = PublicEncryptingKey::from_der(&spki)
                .map_err(|_| JweError::InvalidKey("RSA modulus/exponent rejected".into()))?;
            if key.key_size_bits() < 2048 {
                return Err(JweError::InvalidKey("RSA keys under 2048 bits".into()));
            }
            let oaep = OaepPublicEncryptingKey::new(key)
                .map_err(|_| JweError::InvalidKey("RSA key".into()))?;
            let mut out = vec![0u8; oaep.ciphertext_size()];
            let n = oaep
                .encrypt(&OAEP_SHA256_MGF1SHA256, &cek, &mut out, None)
                .map_err(|_| JweError::Crypto("RSA-OAEP"))?
                .len();
            out.truncate(n);
            let protected = ProtectedHeader {
                alg: ALG_RSA_OAEP_256.into(),
                enc: ENC_A256GCM.into(),
                other_fields: Map::new(),
            };
            let mut r = seal(&cek, &protected, plaintext)?;
            r.encrypted_key = out;
            Ok(r)
        }
        TeePubKey::AKP { alg, .. } => Err(JweError::UnsupportedKey(format!("AKP key {alg}"))),
    }
}

/// A TEE key pair the requester holds for one session (the guest side).
pub enum TeeKey {
    Ec(Curve, PrivateKey),
    Rsa(PrivateDecryptingKey),
}

impl std::fmt::Debug for TeeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TeeKey::Ec(c, _) => write!(f, "TeeKey::Ec({})", c.name()),
            TeeKey::Rsa(_) => f.write_str("TeeKey::Rsa"),
        }
    }
}

impl TeeKey {
    pub fn generate_ec(curve: Curve) -> Result<Self> {
        Ok(TeeKey::Ec(
            curve,
            PrivateKey::generate(curve.alg()).map_err(|_| JweError::Crypto("key generation"))?,
        ))
    }

    /// An EC key from PKCS#8 or RFC 5915 DER: a node key the broker already knows (a lease
    /// names it), kept by the guest across sessions.
    pub fn ec_from_der(curve: Curve, der: &[u8]) -> Result<Self> {
        Ok(TeeKey::Ec(
            curve,
            PrivateKey::from_private_key_der(curve.alg(), der)
                .map_err(|_| JweError::InvalidKey(format!("not a {} private key", curve.name())))?,
        ))
    }

    /// PKCS#8 DER of an EC key (to persist a node key). Secret: never log it.
    pub fn ec_pkcs8(&self) -> Result<Vec<u8>> {
        use aws_lc_rs::encoding::{AsDer, Pkcs8V1Der};
        match self {
            TeeKey::Ec(_, k) => AsDer::<Pkcs8V1Der<'static>>::as_der(k)
                .map(|d| d.as_ref().to_vec())
                .map_err(|_| JweError::Crypto("key encoding")),
            TeeKey::Rsa(_) => Err(JweError::UnsupportedKey("RSA keys are not exported".into())),
        }
    }

    pub fn generate_rsa() -> Result<Self> {
        Ok(TeeKey::Rsa(
            PrivateDecryptingKey::generate(KeySize::Rsa2048)
                .map_err(|_| JweError::Crypto("key generation"))?,
        ))
    }

    /// The public half as the JWK the requester puts in `runtime-data.tee-pubkey`.
    pub fn public(&self) -> Result<TeePubKey> {
        match self {
            TeeKey::Ec(curve, k) => {
                let p = k
                    .compute_public_key()
                    .map_err(|_| JweError::Crypto("public key"))?;
                let (x, y) = coords(*curve, p.as_ref())?;
                Ok(TeePubKey::EC {
                    crv: curve.name().into(),
                    alg: ALG_ECDH_ES_A256KW.into(),
                    x,
                    y,
                })
            }
            TeeKey::Rsa(k) => {
                // The SPKI DER ends with the RSAPublicKey; read n and e back out of it.
                use aws_lc_rs::encoding::AsDer;
                let der = k
                    .public_key()
                    .as_der()
                    .map_err(|_| JweError::Crypto("public key"))?;
                let (n, e) =
                    rsa_components(der.as_ref()).ok_or(JweError::Crypto("public key encoding"))?;
                Ok(TeePubKey::RSA {
                    alg: ALG_RSA_OAEP_256.into(),
                    k_mod: B64.encode(n),
                    k_exp: B64.encode(e),
                })
            }
        }
    }

    /// Open a JWE addressed to this key. The AAD is rebuilt from the decoded protected header,
    /// as CoCo's client does.
    pub fn decrypt(&self, r: &Response) -> Result<Vec<u8>> {
        if r.protected.enc != ENC_A256GCM {
            return Err(JweError::Malformed(format!("enc {}", r.protected.enc)));
        }
        let cek: Vec<u8> = match (self, r.protected.alg.as_str()) {
            (TeeKey::Ec(curve, k), ALG_ECDH_ES_A256KW) => {
                let epk = r
                    .protected
                    .other_fields
                    .get("epk")
                    .ok_or_else(|| JweError::Malformed("no epk".into()))?;
                let field = |n: &str| {
                    epk.get(n)
                        .and_then(Value::as_str)
                        .ok_or_else(|| JweError::Malformed(format!("epk.{n}")))
                };
                if Curve::from_name(field("crv")?)? != *curve {
                    return Err(JweError::Malformed("epk on another curve".into()));
                }
                let peer = point(*curve, field("x")?, field("y")?)
                    .map_err(|e| JweError::Malformed(e.to_string()))?;
                let kek = ecdh_es_kek(
                    *curve,
                    k,
                    &peer,
                    JweError::Malformed("epk is not on the curve".into()),
                )?;
                let mut out = [0u8; 32];
                if r.encrypted_key.len() != 40 {
                    return Err(JweError::Malformed("encrypted_key length".into()));
                }
                AesKek::new(&AES_256, &kek)
                    .map_err(|_| JweError::Crypto("key wrap"))?
                    .unwrap(&r.encrypted_key, &mut out)
                    .map_err(|_| JweError::Decrypt)?;
                out.to_vec()
            }
            (TeeKey::Rsa(k), ALG_RSA_OAEP_256) => {
                let oaep = OaepPrivateDecryptingKey::new(k.clone())
                    .map_err(|_| JweError::Crypto("RSA key"))?;
                let mut out = vec![0u8; oaep.min_output_size()];
                let n = oaep
                    .decrypt(&OAEP_SHA256_MGF1SHA256, &r.encrypted_key, &mut out, None)
                    .map_err(|_| JweError::Decrypt)?
                    .len();
                out.truncate(n);
                out
            }
            (_, alg) => return Err(JweError::Malformed(format!("alg {alg} for this key"))),
        };
        let aad = r
            .protected
            .generate_aad()
            .map_err(|_| JweError::Malformed("protected header".into()))?;
        open_a256gcm(&cek, &r.iv, &aad, &r.ciphertext, &r.tag)
    }
}

/// (n, e) from an RSA SubjectPublicKeyInfo DER.
fn rsa_components(spki: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    use crate::kbs::der::read;
    let (0x30, spki, _) = read(spki)? else {
        return None;
    };
    let (0x30, _, rest) = read(spki)? else {
        return None;
    };
    let (0x03, bits, _) = read(rest)? else {
        return None;
    };
    let (0x30, key, _) = read(bits.get(1..)?)? else {
        return None;
    };
    let (0x02, n, rest) = read(key)? else {
        return None;
    };
    let (0x02, e, _) = read(rest)? else {
        return None;
    };
    let strip = |v: &[u8]| v[v.iter().take_while(|&&b| b == 0).count()..].to_vec();
    Some((strip(n), strip(e)))
}

/// RFC 7638 thumbprint (base64url SHA-256) of a TEE key: how leases name the node key.
pub fn thumbprint(tee: &TeePubKey) -> String {
    let members = match tee {
        TeePubKey::EC { crv, x, y, .. } => {
            serde_json::json!({"crv": crv, "kty": "EC", "x": x, "y": y})
        }
        TeePubKey::RSA { k_mod, k_exp, .. } => {
            serde_json::json!({"e": k_exp, "kty": "RSA", "n": k_mod})
        }
        TeePubKey::AKP { alg, public_key } => {
            serde_json::json!({"alg": alg, "kty": "AKP", "pub": public_key})
        }
    };
    let digest = aws_lc_rs::digest::digest(
        &aws_lc_rs::digest::SHA256,
        crate::jcs::canonical(&members).as_bytes(),
    );
    B64.encode(digest.as_ref())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn ec_and_rsa_round_trip_and_tamper() {
        for key in [
            TeeKey::generate_ec(Curve::P256).unwrap(),
            TeeKey::generate_ec(Curve::P384).unwrap(),
            TeeKey::generate_ec(Curve::P521).unwrap(),
            TeeKey::generate_rsa().unwrap(),
        ] {
            let jwe = encrypt(&key.public().unwrap(), b"model key").unwrap();
            assert_eq!(key.decrypt(&jwe).unwrap(), b"model key");
            // What goes on the wire and what CoCo's client rebuilds for AAD are the same.
            let wire = serde_json::to_value(&jwe).unwrap();
            let back: Response = serde_json::from_value(wire.clone()).unwrap();
            assert_eq!(key.decrypt(&back).unwrap(), b"model key");
            let protected = wire["protected"].as_str().unwrap();
            assert_eq!(
                protected.as_bytes(),
                back.protected.generate_aad().unwrap().as_slice()
            );
            let mut t = jwe.clone();
            t.ciphertext[0] ^= 1;
            assert_eq!(key.decrypt(&t), Err(JweError::Decrypt));
            let mut t = jwe.clone();
            t.tag[0] ^= 1;
            assert_eq!(key.decrypt(&t), Err(JweError::Decrypt));
            let mut t = jwe.clone();
            t.protected
                .other_fields
                .insert("kid".into(), Value::from("x"));
            assert_eq!(key.decrypt(&t), Err(JweError::Decrypt));
            // Another key of the same kind cannot open it.
            let other = match &key {
                TeeKey::Ec(c, _) => TeeKey::generate_ec(*c).unwrap(),
                TeeKey::Rsa(_) => TeeKey::generate_rsa().unwrap(),
            };
            assert!(other.decrypt(&jwe).is_err());
        }
    }

    #[test]
    fn bad_keys_are_refused() {
        let bad = TeePubKey::EC {
            crv: "P-256".into(),
            alg: ALG_ECDH_ES_A256KW.into(),
            x: B64.encode([1u8; 32]),
            y: B64.encode([2u8; 32]),
        };
        assert!(matches!(encrypt(&bad, b"x"), Err(JweError::InvalidKey(_))));
        let wrong_alg = TeePubKey::EC {
            crv: "P-256".into(),
            alg: "ECDH-ES".into(),
            x: String::new(),
            y: String::new(),
        };
        assert!(matches!(
            encrypt(&wrong_alg, b"x"),
            Err(JweError::UnsupportedKey(_))
        ));
        let small = TeePubKey::RSA {
            alg: ALG_RSA_OAEP_256.into(),
            k_mod: B64.encode([0xC3u8; 64]),
            k_exp: B64.encode([1, 0, 1]),
        };
        assert!(encrypt(&small, b"x").is_err());
    }
}

/// Project Wycheproof and RFC vectors through the production functions (not through aws-lc
/// directly): what we compose ourselves — JWK points, the Concat KDF, the AES-GCM framing, the
/// OAEP unwrapping — must give the vectors' answers.
#[cfg(test)]
mod vectors {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn suite(name: &str) -> Value {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/wycheproof")
            .join(name);
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    }

    fn tests(v: &Value) -> impl Iterator<Item = (&Value, &Value)> {
        v["testGroups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| g["tests"].as_array().unwrap().iter().map(move |t| (g, t)))
    }

    fn hx(v: &Value) -> Vec<u8> {
        hex::decode(v.as_str().unwrap()).unwrap()
    }

    /// The uncompressed point of a named-curve EC SubjectPublicKeyInfo, exactly encoded; `None`
    /// for anything a JWK cannot say (explicit parameters, compressed points, bad DER), which
    /// never reaches our code in that form.
    fn spki_point(spki: &[u8], curve_oid: &[u8]) -> Option<Vec<u8>> {
        use crate::kbs::der::read;
        let (0x30, body, []) = read(spki)? else {
            return None;
        };
        let (0x30, alg, rest) = read(body)? else {
            return None;
        };
        let (0x03, bits, []) = read(rest)? else {
            return None;
        };
        let (0x06, ec, params) = read(alg)? else {
            return None;
        };
        let (0x06, oid, []) = read(params)? else {
            return None;
        };
        let ec_public_key = [0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01];
        (ec == ec_public_key
            && oid == curve_oid
            && bits.first() == Some(&0)
            && bits.get(1) == Some(&4))
        .then(|| bits[1..].to_vec())
    }

    #[test]
    fn ecdh_es_key_agreement_on_jwk_points() {
        let curves: [(&str, Curve, &[u8]); 3] = [
            (
                "ecdh_secp256r1_test.json",
                Curve::P256,
                &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07],
            ),
            (
                "ecdh_secp384r1_test.json",
                Curve::P384,
                &[0x2b, 0x81, 0x04, 0x00, 0x22],
            ),
            (
                "ecdh_secp521r1_test.json",
                Curve::P521,
                &[0x2b, 0x81, 0x04, 0x00, 0x23],
            ),
        ];
        for (file, curve, oid) in curves {
            let (mut agreed, mut refused, mut not_jwk) = (0, 0, 0);
            for (_, t) in tests(&suite(file)) {
                let id = &t["tcId"];
                let result = t["result"].as_str().unwrap();
                let Some(peer) = spki_point(&hx(&t["public"]), oid) else {
                    not_jwk += 1;
                    continue;
                };
                // As a JWK carries it: base64url coordinates, parsed by the production code.
                let half = (peer.len() - 1) / 2;
                let (x, y) = (
                    B64.encode(&peer[1..1 + half]),
                    B64.encode(&peer[1 + half..]),
                );
                let Ok(point) = point(curve, &x, &y) else {
                    assert_ne!(result, "valid", "{file} {id}: coordinates refused");
                    refused += 1;
                    continue;
                };
                // Private keys are big-endian integers, sometimes with a leading zero byte.
                let raw = hx(&t["private"]);
                let raw = &raw[raw.len().saturating_sub(curve.coord_len())..];
                let mut fixed = vec![0u8; curve.coord_len() - raw.len()];
                fixed.extend_from_slice(raw);
                let private = PrivateKey::from_private_key(curve.alg(), &fixed).unwrap();
                let ours = ecdh_es_kek(curve, &private, &point, JweError::Decrypt);
                match (result, ours) {
                    ("valid" | "acceptable", Ok(kek)) => {
                        assert_eq!(
                            kek,
                            concat_kdf(&hx(&t["shared"]), ALG_ECDH_ES_A256KW),
                            "{file} {id}"
                        );
                        agreed += 1;
                    }
                    ("invalid" | "acceptable", Err(_)) => refused += 1,
                    (r, o) => panic!("{file} tcId {id}: expected {r}, got {o:?}"),
                }
                // The KBS side: encrypting to such a key is refused likewise.
                let tee = TeePubKey::EC {
                    crv: curve.name().into(),
                    alg: ALG_ECDH_ES_A256KW.into(),
                    x,
                    y,
                };
                match (result, encrypt(&tee, b"k").is_ok()) {
                    ("valid", false) | ("invalid", true) => {
                        panic!("{file} tcId {id}: encrypt to it")
                    }
                    _ => {}
                }
            }
            eprintln!(
                "{file}: {agreed} agreed, {refused} refused, {not_jwk} not expressible as a JWK"
            );
            assert!(agreed > 50 && refused > 0, "{file}");
        }
    }

    #[test]
    fn aes_256_gcm_content_decryption() {
        let (mut opened, mut refused) = (0, 0);
        for (g, t) in tests(&suite("aes_gcm_test.json")) {
            let ours = open_a256gcm(
                &hx(&t["key"]),
                &hx(&t["iv"]),
                &hx(&t["aad"]),
                &hx(&t["ct"]),
                &hx(&t["tag"]),
            );
            let ours_sizes = g["keySize"] == 256 && g["ivSize"] == 96 && g["tagSize"] == 128;
            match ours {
                Ok(plain) => {
                    assert!(ours_sizes && t["result"] == "valid", "tcId {}", t["tcId"]);
                    assert_eq!(plain, hx(&t["msg"]));
                    opened += 1;
                }
                // Other key, IV and tag sizes are not JWE A256GCM: refused whatever the vector says.
                Err(_) => {
                    assert!(
                        !ours_sizes || t["result"] == "invalid",
                        "tcId {}",
                        t["tcId"]
                    );
                    refused += 1;
                }
            }
        }
        assert!(opened > 20 && refused > 100, "{opened} {refused}");
    }

    #[test]
    fn rsa_oaep_256_key_unwrapping() {
        let v = suite("rsa_oaep_2048_sha256_mgf1sha256_test.json");
        let mut checked = 0;
        for g in v["testGroups"].as_array().unwrap() {
            let der = hx(&g["privateKeyPkcs8"]);
            let key = TeeKey::Rsa(PrivateDecryptingKey::from_pkcs8(&der).unwrap());
            for t in g["tests"].as_array().unwrap() {
                // The production unwrapping, inside a JWE whose content key is the vector's
                // message: a 32-byte message opens (the JWE is sealed under it); anything else
                // must be refused somewhere on the way.
                let msg = hx(&t["msg"]);
                let label_empty = t["label"] == "";
                let cek: [u8; 32] = msg.clone().try_into().unwrap_or([0; 32]);
                let protected = ProtectedHeader {
                    alg: ALG_RSA_OAEP_256.into(),
                    enc: ENC_A256GCM.into(),
                    other_fields: Map::new(),
                };
                let mut r = seal(&cek, &protected, b"payload").unwrap();
                r.encrypted_key = hx(&t["ct"]);
                let opened = key.decrypt(&r);
                let should = t["result"] == "valid" && label_empty && msg.len() == 32;
                assert_eq!(opened.is_ok(), should, "tcId {}", t["tcId"]);
                if should {
                    assert_eq!(opened.unwrap(), b"payload");
                }
                checked += 1;
            }
        }
        assert!(checked > 20);
    }

    /// RFC 7518 Appendix C: ECDH-ES with apu "Alice", apv "Bob", A128GCM (128-bit key).
    #[test]
    fn concat_kdf_rfc7518_appendix_c() {
        let z = [
            158, 86, 217, 29, 129, 113, 53, 211, 114, 131, 66, 131, 191, 132, 38, 156, 251, 49,
            110, 163, 218, 128, 106, 72, 246, 218, 167, 121, 140, 254, 144, 196,
        ];
        let key = concat_kdf_with(&z, b"A128GCM", b"Alice", b"Bob", 128);
        assert_eq!(B64.encode(&key[..16]), "VqqN6vgjbSBcIijNcacQGg");
    }
}
