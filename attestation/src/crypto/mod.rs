//! Signature verification and hashing behind one provider trait.
//!
//! Every signature check in the verifiers (SNP report and AMD chain, NVIDIA SPDM and device chain,
//! RIM XML-DSig) goes through [`CryptoProvider`], so a FIPS or hardware backend is a swap of one
//! value, as rustls does with its `CryptoProvider`. The default is [`AwsLcWithP384Tables`]:
//! aws-lc-rs (on this class of machine it verifies P-384 about 3.8× faster than ring, see
//! `../shared/CRATES.md`), except that *prepared* P-384 keys (the cached VCEK and GPU device
//! keys, each used for thousands of signatures) verify with per-key precomputed tables
//! (`crypto/p384.rs`, ~2.5× aws-lc); aws-lc still parses and validates those keys. TDX quotes
//! are verified by dcap-qvl configured on aws-lc-rs too (`tdx.rs`).

use std::fmt;

pub(crate) mod p384;

#[cfg(feature = "test-support")]
pub use p384::table_verifications;

/// Signature algorithms the verifiers need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SigAlg {
    /// ECDSA P-384 / SHA-384, signature as fixed-width big-endian `r ‖ s` (96 bytes).
    EcdsaP384Sha384Fixed,
    /// ECDSA P-384 / SHA-384, DER `Ecdsa-Sig-Value` (X.509 `ecdsa-with-SHA384`).
    EcdsaP384Sha384Der,
    /// ECDSA P-256 / SHA-256, DER (X.509 `ecdsa-with-SHA256`).
    EcdsaP256Sha256Der,
    /// ECDSA P-256 / SHA-256, fixed `r ‖ s` (64 bytes).
    EcdsaP256Sha256Fixed,
    /// RSASSA-PSS, SHA-384, MGF1-SHA-384, salt 48 (AMD ARK/ASK/ASVK). Key is PKCS#1 `RSAPublicKey`.
    RsaPssSha384,
}

/// Digest algorithms the verifiers need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DigestAlg {
    /// Only for identifiers that are defined with it (OCSP CertID, ResponderID by key).
    Sha1,
    Sha256,
    Sha384,
    Sha512,
}

/// A signature did not verify, or the key could not be parsed. Deliberately carries no detail:
/// the caller knows what it was verifying and builds the precise [`crate::Error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rejected;

/// A public key parsed once and used for many verifications (cached chains).
pub trait PreparedKey: Send + Sync + fmt::Debug {
    fn verify(&self, msg: &[u8], sig: &[u8]) -> Result<(), Rejected>;
    /// Which implementation verifies for this key (tests assert the path they exercise).
    fn backend(&self) -> &'static str {
        "aws-lc-rs"
    }
}

/// The crypto a verifier needs. Implementations must be constant-behaviour: no I/O, no clock.
pub trait CryptoProvider: Send + Sync + fmt::Debug {
    /// Verify `sig` over `msg` with a raw public key (SEC1 point for EC, PKCS#1 for RSA).
    fn verify(
        &self,
        alg: SigAlg,
        public_key: &[u8],
        msg: &[u8],
        sig: &[u8],
    ) -> Result<(), Rejected>;
    /// Parse a key once for repeated verification.
    fn prepare(&self, alg: SigAlg, public_key: &[u8]) -> Result<Box<dyn PreparedKey>, Rejected>;
    /// Hash `data`.
    fn digest(&self, alg: DigestAlg, data: &[&[u8]]) -> Vec<u8>;
}

/// aws-lc-rs for every check and digest, except prepared P-384 keys: those verify through
/// cgx's precomputed tables (`crypto/p384.rs`, variable-time, public data only) while the table
/// memory budget lasts, and through aws-lc after.
#[derive(Debug, Default, Clone, Copy)]
pub struct AwsLcWithP384Tables;

/// The default provider.
pub static DEFAULT_PROVIDER: AwsLcWithP384Tables = AwsLcWithP384Tables;

fn aws_alg(alg: SigAlg) -> &'static dyn aws_lc_rs::signature::VerificationAlgorithm {
    use aws_lc_rs::signature as s;
    match alg {
        SigAlg::EcdsaP384Sha384Fixed => &s::ECDSA_P384_SHA384_FIXED,
        SigAlg::EcdsaP384Sha384Der => &s::ECDSA_P384_SHA384_ASN1,
        SigAlg::EcdsaP256Sha256Der => &s::ECDSA_P256_SHA256_ASN1,
        SigAlg::EcdsaP256Sha256Fixed => &s::ECDSA_P256_SHA256_FIXED,
        SigAlg::RsaPssSha384 => &s::RSA_PSS_2048_8192_SHA384,
    }
}

impl PreparedKey for p384::TabledKey {
    fn verify(&self, msg: &[u8], sig: &[u8]) -> Result<(), Rejected> {
        if p384::TabledKey::verify(self, msg, sig) {
            Ok(())
        } else {
            Err(Rejected)
        }
    }

    fn backend(&self) -> &'static str {
        "cgx-p384-tables"
    }
}

#[derive(Debug)]
struct AwsPrepared(aws_lc_rs::signature::ParsedPublicKey);

impl PreparedKey for AwsPrepared {
    fn verify(&self, msg: &[u8], sig: &[u8]) -> Result<(), Rejected> {
        self.0.verify_sig(msg, sig).map_err(|_| Rejected)
    }
}

impl CryptoProvider for AwsLcWithP384Tables {
    fn verify(
        &self,
        alg: SigAlg,
        public_key: &[u8],
        msg: &[u8],
        sig: &[u8],
    ) -> Result<(), Rejected> {
        aws_lc_rs::signature::UnparsedPublicKey::new(aws_alg(alg), public_key)
            .verify(msg, sig)
            .map_err(|_| Rejected)
    }

    fn prepare(&self, alg: SigAlg, public_key: &[u8]) -> Result<Box<dyn PreparedKey>, Rejected> {
        prepare_with_tables(alg, public_key, p384::TabledKey::new)
    }

    fn digest(&self, alg: DigestAlg, data: &[&[u8]]) -> Vec<u8> {
        use aws_lc_rs::digest;
        let mut ctx = digest::Context::new(match alg {
            DigestAlg::Sha1 => &digest::SHA1_FOR_LEGACY_USE_ONLY,
            DigestAlg::Sha256 => &digest::SHA256,
            DigestAlg::Sha384 => &digest::SHA384,
            DigestAlg::Sha512 => &digest::SHA512,
        });
        for d in data {
            ctx.update(d);
        }
        ctx.finish().as_ref().to_vec()
    }
}

/// aws-lc parses and validates every key; a P-384 key for fixed signatures (VCEK, GPU device
/// key) then gets tables from `tables`, which answers `None` once their memory budget is spent:
/// that key verifies through aws-lc.
pub(crate) fn prepare_with_tables(
    alg: SigAlg,
    public_key: &[u8],
    tables: impl FnOnce(&[u8]) -> Option<p384::TabledKey>,
) -> Result<Box<dyn PreparedKey>, Rejected> {
    let parsed = aws_lc_rs::signature::ParsedPublicKey::new(aws_alg(alg), public_key)
        .map_err(|_| Rejected)?;
    if alg == SigAlg::EcdsaP384Sha384Fixed
        && let Some(key) = tables(public_key)
    {
        return Ok(Box::new(key));
    }
    Ok(Box::new(AwsPrepared(parsed)))
}

/// SHA-256 with the default provider (fingerprints, cache keys).
pub(crate) fn sha256(data: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(&DEFAULT_PROVIDER.digest(DigestAlg::Sha256, &[data]));
    out
}
