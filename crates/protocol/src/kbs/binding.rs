//! How CoCo binds evidence to a KBS session (what the guest puts in its evidence and what the
//! KBS expects to find there):
//!
//! - CPU `report_data` = SHA-384(JCS({"additional-evidence", "nonce", "tee-pubkey"})), zero-padded
//!   to 64 bytes (TDX and SNP report data are 64 bytes);
//! - device evidence binds SHA-384(JCS({"nonce", "tee-pubkey"})); an NVIDIA GPU takes its first 32
//!   bytes as the SPDM requester nonce.
//!
//! `additional-evidence` is the exact string the requester sends (empty when there is none), so
//! the device evidence is covered by the CPU report too.

use kbs_types::TeePubKey;
use serde_json::{Value, json};

fn sha384(s: &str) -> [u8; 48] {
    let d = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA384, s.as_bytes());
    let mut out = [0u8; 48];
    out.copy_from_slice(d.as_ref());
    out
}

fn key_value(tee_pubkey: &TeePubKey) -> Value {
    serde_json::to_value(tee_pubkey).unwrap_or(Value::Null)
}

/// What the CPU report data binds, in the members' canonical order.
#[derive(serde::Serialize)]
struct CpuBinding<'a> {
    #[serde(rename = "additional-evidence")]
    additional_evidence: &'a str,
    nonce: &'a str,
    #[serde(rename = "tee-pubkey")]
    tee_pubkey: &'a TeePubKey,
}

/// The 64-byte CPU report data for a session, written straight to canonical JSON (no
/// `serde_json` tree: this runs once per attestation). `Err` where the members have no
/// canonical form, which no `TeePubKey` of kbs-types 0.18 hits (its members are strings); a
/// caller refuses the attestation then, never binds a stand-in.
pub fn cpu_report_data(
    nonce: &str,
    tee_pubkey: &TeePubKey,
    additional_evidence: &str,
) -> Result<[u8; 64], crate::jcs::Error> {
    let text = crate::jcs::to_canonical(&CpuBinding {
        additional_evidence,
        nonce,
        tee_pubkey,
    })?;
    let mut out = [0u8; 64];
    out[..48].copy_from_slice(&sha384(text.as_str()));
    Ok(out)
}

/// The 48-byte device binding for a session.
pub fn device_report_data(nonce: &str, tee_pubkey: &TeePubKey) -> [u8; 48] {
    let v = json!({"nonce": nonce, "tee-pubkey": key_value(tee_pubkey)});
    sha384(&crate::jcs::canonical(&v))
}

/// The SPDM requester nonce an NVIDIA GPU signs for a session.
pub fn nvidia_nonce(nonce: &str, tee_pubkey: &TeePubKey) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(&device_report_data(nonce, tee_pubkey)[..32]);
    out
}

/// The digest of CoCo init-data as the TEE measures it at launch — SNP HOST_DATA (32 bytes),
/// TDX MRCONFIGID (48 bytes): the init-data TOML's text hashed with the algorithm it names
/// (`algorithm = "sha256" | "sha384" | "sha512"`; sha256 when unnamed), truncated or zero-padded
/// to `field_len`, as Trustee compares it. `Err` names an unknown algorithm.
pub fn init_data_digest(body: &str, field_len: usize) -> Result<(String, Vec<u8>), String> {
    let algorithm = body
        .lines()
        .filter_map(|l| l.split_once('='))
        .find(|(k, _)| k.trim() == "algorithm")
        .map(|(_, v)| v.trim().trim_matches(['"', '\'']).to_ascii_lowercase())
        .unwrap_or_else(|| "sha256".into());
    let alg = match algorithm.as_str() {
        "sha256" => &aws_lc_rs::digest::SHA256,
        "sha384" => &aws_lc_rs::digest::SHA384,
        "sha512" => &aws_lc_rs::digest::SHA512,
        other => return Err(format!("init-data digest algorithm {other}")),
    };
    let mut d = aws_lc_rs::digest::digest(alg, body.as_bytes())
        .as_ref()
        .to_vec();
    d.resize(field_len, 0);
    Ok((algorithm, d))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn init_data_digests_fit_the_field() {
        let (alg, d) = init_data_digest("version = \"0.1.0\"\n", 32).unwrap();
        assert_eq!((alg.as_str(), d.len()), ("sha256", 32));
        let (alg, d) = init_data_digest("algorithm = \"sha384\"\n", 32).unwrap();
        assert_eq!((alg.as_str(), d.len()), ("sha384", 32));
        let (_, d) = init_data_digest("algorithm = 'sha256'\n", 48).unwrap();
        assert_eq!(&d[32..], &[0u8; 16]);
        assert!(init_data_digest("algorithm = \"md5\"", 32).is_err());
    }

    #[test]
    fn binds_every_input() {
        let k = |x: &str| TeePubKey::EC {
            crv: "P-256".into(),
            alg: "ECDH-ES+A256KW".into(),
            x: x.into(),
            y: "y".into(),
        };
        let rd = |n: &str, k: &TeePubKey, a: &str| cpu_report_data(n, k, a).unwrap();
        let base = rd("n", &k("a"), "");
        assert_eq!(base[48..], [0u8; 16]);
        assert_ne!(base, rd("m", &k("a"), ""));
        assert_ne!(base, rd("n", &k("b"), ""));
        assert_ne!(base, rd("n", &k("a"), "{}"));
        assert_ne!(nvidia_nonce("n", &k("a")), nvidia_nonce("n", &k("b")));
        // The canonical text hashed: keys sorted, the JWK's members sorted, no whitespace.
        let text = crate::jcs::canonical(&json!({
            "additional-evidence": "", "nonce": "n", "tee-pubkey": key_value(&k("a"))}));
        assert_eq!(
            text,
            r#"{"additional-evidence":"","nonce":"n","tee-pubkey":{"alg":"ECDH-ES+A256KW","crv":"P-256","kty":"EC","x":"a","y":"y"}}"#
        );
        assert_eq!(base[..48], sha384(&text));
    }

    #[test]
    fn the_cpu_binding_is_the_canonical_text_of_its_json() {
        let rsa = TeePubKey::RSA {
            alg: "RSA1_5".into(),
            k_mod: "bW9kdWx1cw".into(),
            k_exp: "AQAB".into(),
        };
        let ec = TeePubKey::EC {
            crv: "P-256".into(),
            alg: "ECDH-ES+A256KW".into(),
            x: "\u{e9}\"x".into(),
            y: "y".into(),
        };
        let akp = TeePubKey::AKP {
            alg: "ML-KEM-768".into(),
            public_key: "cHVibGlj".into(),
        };
        for key in [rsa, ec, akp] {
            for additional in ["", r#"{"nvgpu":["é"]}"#] {
                let text = crate::jcs::canonical(&json!({
                    "additional-evidence": additional,
                    "nonce": "bm9uY2U",
                    "tee-pubkey": key_value(&key),
                }));
                let rd = cpu_report_data("bm9uY2U", &key, additional).unwrap();
                assert_eq!(rd[..48], sha384(&text), "{text}");
            }
        }
    }
}
