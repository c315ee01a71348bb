//! The archive beside the transparency log: the raw pieces a decision rested on, each kept
//! whole and addressed by its SHA-256, which the decision's leaf names. A leaf stays small
//! (≤ 65,535 bytes, the tile bundle's limit) and public in shape; the archive holds the bytes an
//! auditor re-verifies (evidence, collateral, signed results) and serves only to auditors.
//!
//! Each piece is one of [`Kind`]; its bytes are exactly what was hashed, so an auditor checks a
//! piece by hashing it, whatever store or directory it came from.

use serde::{Deserialize, Serialize};

/// What an archived piece is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A node's registration as it sent it (JSON of [`crate::broker::Registration`]): its
    /// CPU and GPU evidence, TEE key, offer and proof.
    Registration,
    /// The collateral the appraisal used ([`Collateral`] as JSON): what the broker's store
    /// supplied, and the certificates the node carried where it carried them.
    Collateral,
    /// The EAR (signed JWT, as text) the appraisal produced.
    Ear,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Registration => "registration",
            Kind::Collateral => "collateral",
            Kind::Ear => "ear",
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        match s {
            "registration" => Some(Kind::Registration),
            "collateral" => Some(Kind::Collateral),
            "ear" => Some(Kind::Ear),
            _ => None,
        }
    }
}

/// The collateral an appraisal of composite evidence used, byte for byte (base64url).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Collateral {
    pub cpu: CpuCollateral,
    /// Per GPU, in the registration's order.
    pub gpus: Vec<GpuCollateral>,
}

/// The CPU's collateral.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum CpuCollateral {
    /// AMD SEV-SNP: the VCEK or VLEK (DER), the ASK/ASVK and ARK (PEM) and the ARK's CRLs (DER).
    Snp {
        signing_key: String,
        signing_cert: String,
        chain: String,
        crls: Vec<String>,
    },
    /// Intel TDX: the collateral as JSON text (dcap-qvl's `QuoteCollateralV3`), base64url.
    Tdx { collateral: String },
}

/// One GPU's collateral: the OCSP responses (DER) for its chain, where the store had them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuCollateral {
    pub ocsp: Vec<String>,
}

/// A piece's address: lowercase hex SHA-256 of its bytes.
pub fn address(bytes: &[u8]) -> String {
    hex::encode(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, bytes).as_ref())
}

/// Whether `s` is an address's spelling (64 lowercase hex digits): checked before a store or
/// a directory is asked for it.
pub fn is_address(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn addresses_are_sha256_hex_and_checked_before_use() {
        // FIPS 180-2's "abc".
        assert_eq!(
            address(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(is_address(&address(b"")));
        assert!(!is_address("../../etc/passwd"));
        assert!(!is_address(&address(b"x").to_uppercase()));
        assert!(!is_address(&address(b"x")[..63]));
    }

    #[test]
    fn collateral_round_trips_and_refuses_unknown_fields() {
        let c = Collateral {
            cpu: CpuCollateral::Tdx {
                collateral: "e30".into(),
            },
            gpus: vec![GpuCollateral { ocsp: vec![] }],
        };
        let s = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<Collateral>(&s).unwrap(), c);
        assert!(
            serde_json::from_str::<Collateral>(
                r#"{"cpu":{"kind":"tdx","collateral":"","x":1},"gpus":[]}"#
            )
            .is_err()
        );
        assert_eq!(Kind::parse("ear"), Some(Kind::Ear));
        assert_eq!(Kind::parse("x"), None);
    }
}
