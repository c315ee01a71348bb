//! The small part of X.509 the verifiers need: parse, check a validity window against an explicit
//! time, verify one link of a chain through the [`CryptoProvider`], read raw extensions, pin roots
//! by the SHA-256 of their SubjectPublicKeyInfo. Parsing is x509-parser's; every signature goes
//! through our provider so one backend does all the crypto.

use x509_parser::certificate::X509Certificate;
use x509_parser::prelude::FromDer;
use x509_parser::revocation_list::CertificateRevocationList;
use x509_parser::signature_algorithm::SignatureAlgorithm;
use x509_parser::x509::AlgorithmIdentifier;

use crate::crypto::{CryptoProvider, SigAlg, sha256};
use crate::error::{ChainKind, Error, Result};

const OID_ECDSA_SHA256: &str = "1.2.840.10045.4.3.2";
const OID_ECDSA_SHA384: &str = "1.2.840.10045.4.3.3";
const OID_SHA384: &str = "2.16.840.1.101.3.4.2.2";
const OID_MGF1: &str = "1.2.840.113549.1.1.8";
const OID_EC_PUBLIC_KEY: &str = "1.2.840.10045.2.1";
const OID_RSA_ENCRYPTION: &str = "1.2.840.113549.1.1.1";
const OID_RSASSA_PSS: &str = "1.2.840.113549.1.1.10";
const OID_P256: &str = "1.2.840.10045.3.1.7";
const OID_P384: &str = "1.3.132.0.34";

/// Parse one DER certificate, refusing trailing bytes.
pub(crate) fn parse_cert<'a>(der: &'a [u8], what: &'static str) -> Result<X509Certificate<'a>> {
    match X509Certificate::from_der(der) {
        Ok(([], cert)) => Ok(cert),
        Ok((rest, _)) => Err(Error::malformed(
            what,
            format!("{} trailing bytes after certificate", rest.len()),
        )),
        Err(e) => Err(Error::malformed(
            what,
            format!("certificate does not parse: {e}"),
        )),
    }
}

/// Decode every `CERTIFICATE` block of a PEM text, in order.
pub(crate) fn pem_certs(pem: &[u8], what: &'static str) -> Result<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    for item in x509_parser::pem::Pem::iter_from_buffer(pem) {
        let item = item.map_err(|e| Error::malformed(what, format!("PEM: {e}")))?;
        if item.label == "CERTIFICATE" {
            out.push(item.contents);
        }
    }
    if out.is_empty() {
        return Err(Error::malformed(what, "no CERTIFICATE block"));
    }
    Ok(out)
}

/// DER as-is, or the certificates of a PEM text.
pub(crate) fn der_or_pem_certs(bytes: &[u8], what: &'static str) -> Result<Vec<Vec<u8>>> {
    if bytes.first() == Some(&0x30) {
        Ok(vec![bytes.to_vec()])
    } else {
        pem_certs(bytes, what)
    }
}

/// Canonical PEM: 64-column base64, LF line ends (what Intel's QE, AMD KDS and our simulator
/// write; `tdx` requires quotes' PCK chains to be exactly this).
pub(crate) fn to_pem(label: &str, der: &[u8]) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        // base64 output is ASCII, so every chunk is valid UTF-8.
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// Human-readable subject for messages.
pub(crate) fn subject(cert: &X509Certificate<'_>) -> String {
    cert.subject().to_string()
}

pub(crate) fn rfc3339(ts: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(ts)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| ts.to_string())
}

/// Validity window of a certificate as Unix seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    pub not_before: i64,
    pub not_after: i64,
}

impl Window {
    pub(crate) fn of(cert: &X509Certificate<'_>) -> Self {
        Window {
            not_before: cert.validity().not_before.timestamp(),
            not_after: cert.validity().not_after.timestamp(),
        }
    }

    pub(crate) fn check(&self, subject: impl FnOnce() -> String, now: i64) -> Result<()> {
        if now < self.not_before || now > self.not_after {
            return Err(Error::CertificateValidity {
                subject: subject(),
                not_before: rfc3339(self.not_before),
                not_after: rfc3339(self.not_after),
                at: rfc3339(now),
            });
        }
        Ok(())
    }
}

pub(crate) fn check_validity(cert: &X509Certificate<'_>, now: i64) -> Result<()> {
    Window::of(cert).check(|| subject(cert), now)
}

/// SHA-256 of the SubjectPublicKeyInfo DER: how roots are pinned.
pub(crate) fn spki_sha256(cert: &X509Certificate<'_>) -> [u8; 32] {
    sha256(cert.public_key().raw)
}

/// The named curve of an EC key (the SPKI algorithm parameters), dotted.
fn curve_oid(spki: &x509_parser::x509::SubjectPublicKeyInfo<'_>) -> Option<String> {
    spki.algorithm
        .parameters
        .as_ref()
        .and_then(|p| p.as_oid().ok())
        .map(|o| o.to_id_string())
}

/// The key of `cert` in the form the provider takes, and the signature algorithm that
/// `signature_algorithm` selects for that key.
fn key_and_alg<'a>(
    issuer: &'a X509Certificate<'_>,
    signature_algorithm: &AlgorithmIdentifier<'_>,
    chain: ChainKind,
) -> Result<(&'a [u8], SigAlg)> {
    let spki = issuer.public_key();
    let key: &[u8] = &spki.subject_public_key.data;
    let key_alg = spki.algorithm.algorithm.to_id_string();
    let curve = curve_oid(spki);
    let sig_oid = signature_algorithm.algorithm.to_id_string();
    let alg = match (sig_oid.as_str(), key_alg.as_str(), curve.as_deref()) {
        (OID_ECDSA_SHA384, OID_EC_PUBLIC_KEY, Some(OID_P384)) => SigAlg::EcdsaP384Sha384Der,
        (OID_ECDSA_SHA256, OID_EC_PUBLIC_KEY, Some(OID_P256)) => SigAlg::EcdsaP256Sha256Der,
        (OID_RSASSA_PSS, OID_RSA_ENCRYPTION | OID_RSASSA_PSS, _) => {
            check_pss_sha384(signature_algorithm, chain)?;
            SigAlg::RsaPssSha384
        }
        (s, k, c) => {
            return Err(Error::chain(
                chain,
                format!(
                    "unsupported signature algorithm {s} with key {k} ({}) issued by '{}'",
                    c.unwrap_or("-"),
                    subject(issuer)
                ),
            ));
        }
    };
    Ok((key, alg))
}

/// AMD signs with RSASSA-PSS, SHA-384, MGF1-SHA-384, salt 48; anything else is refused rather
/// than verified under the wrong parameters.
fn check_pss_sha384(alg: &AlgorithmIdentifier<'_>, chain: ChainKind) -> Result<()> {
    let bad = |d: &str| Error::chain(chain, format!("RSASSA-PSS parameters: {d}"));
    let Ok(SignatureAlgorithm::RSASSA_PSS(params)) = SignatureAlgorithm::try_from(alg) else {
        return Err(bad("missing or malformed"));
    };
    if params.hash_algorithm_oid().to_id_string() != OID_SHA384 {
        return Err(bad("hash is not SHA-384"));
    }
    let mgf = params
        .mask_gen_algorithm()
        .map_err(|_| bad("mask generation"))?;
    if mgf.mgf.to_id_string() != OID_MGF1 || mgf.hash.to_id_string() != OID_SHA384 {
        return Err(bad("mask generation is not MGF1-SHA-384"));
    }
    if params.salt_length() != 48 {
        return Err(bad("salt length is not 48"));
    }
    Ok(())
}

/// `SEQUENCE { tbs, algorithm, BIT STRING signature }` where the unsigned outer algorithm is
/// byte-for-byte the signed inner one (RFC 5280 §4.1.1.2 / §5.1.1.2) and the signature has no
/// unused bits. Parsers are lenient about both; without this, unsigned bytes could vary.
fn canonical_signed_shape(der: &[u8], is_cert: bool) -> bool {
    use crate::der::read_tlv_raw;
    let Some((0x30, body, [])) = crate::der::read_tlv(der) else {
        return false;
    };
    let Some((0x30, tbs, _, rest)) = read_tlv_raw(body) else {
        return false;
    };
    let Some((0x30, _, outer_alg, rest)) = read_tlv_raw(rest) else {
        return false;
    };
    let Some((0x03, sig, _, [])) = read_tlv_raw(rest) else {
        return false;
    };
    if sig.first() != Some(&0) {
        return false;
    }
    // Inner algorithm: certificates `[0] version, serial, signature`; CRLs `version?, signature`.
    let mut rest = tbs;
    let mut skip = if is_cert { 2 } else { 0 };
    if !is_cert && rest.first() == Some(&0x02) {
        skip = 1;
    }
    for _ in 0..skip {
        let Some((_, _, _, r)) = read_tlv_raw(rest) else {
            return false;
        };
        rest = r;
    }
    matches!(read_tlv_raw(rest), Some((0x30, _, inner_alg, _)) if inner_alg == outer_alg)
}

/// Verify that `issuer` signed `cert`: names chain, then the signature.
pub(crate) fn verify_issued_by(
    cert: &X509Certificate<'_>,
    issuer: &X509Certificate<'_>,
    provider: &dyn CryptoProvider,
    chain: ChainKind,
) -> Result<()> {
    if cert.issuer().as_raw() != issuer.subject().as_raw() {
        return Err(Error::chain(
            chain,
            format!(
                "'{}' is issued by '{}', not by '{}'",
                subject(cert),
                cert.issuer(),
                subject(issuer)
            ),
        ));
    }
    // RFC 5280 §4.1.1.2: the unsigned outer algorithm must equal the signed inner one; and a
    // signature BIT STRING has no unused bits. Otherwise unsigned bytes could vary freely.
    if !canonical_signed_shape(cert.as_raw(), true) {
        return Err(Error::chain(
            chain,
            format!(
                "'{}': outer signature algorithm or signature encoding is not canonical",
                subject(cert)
            ),
        ));
    }
    let (key, alg) = key_and_alg(issuer, &cert.signature_algorithm, chain)?;
    provider
        .verify(
            alg,
            key,
            cert.tbs_certificate.as_ref(),
            &cert.signature_value.data,
        )
        .map_err(|_| {
            Error::signature(format!(
                "{chain} certificate '{}' (issuer '{}')",
                subject(cert),
                subject(issuer)
            ))
        })
}

/// Verify `signature` over `msg` by `signer`'s key under the DER `AlgorithmIdentifier`
/// `signature_algorithm` (OCSP responses and other signed structures that are not X.509).
pub(crate) fn verify_signed(
    signer: &X509Certificate<'_>,
    signature_algorithm: &[u8],
    msg: &[u8],
    signature: &[u8],
    provider: &dyn CryptoProvider,
    chain: ChainKind,
) -> Result<()> {
    // Outside the signed bytes, so only exact encodings pass: a lenient parser would read some
    // malformed tags and OIDs as the algorithm they resemble.
    let exact = |oid: &str| crate::der::write::seq(&[crate::der::write::oid(oid)]);
    let known = signature_algorithm == exact(OID_ECDSA_SHA384).as_slice()
        || signature_algorithm == exact(OID_ECDSA_SHA256).as_slice();
    let alg = match AlgorithmIdentifier::from_der(signature_algorithm) {
        Ok(([], alg)) if known => alg,
        _ => {
            return Err(Error::malformed(
                "signature algorithm",
                "not ecdsa-with-SHA384 or ecdsa-with-SHA256 in DER",
            ));
        }
    };
    let (key, alg) = key_and_alg(signer, &alg, chain)?;
    provider
        .verify(alg, key, msg, signature)
        .map_err(|_| Error::signature(format!("signature by '{}'", subject(signer))))
}

/// The public key of a certificate for `alg`, checking that the key type matches.
pub(crate) fn ec_public_key<'a>(
    cert: &'a X509Certificate<'_>,
    p384: bool,
    chain: ChainKind,
) -> Result<&'a [u8]> {
    let spki = cert.public_key();
    let curve = curve_oid(spki);
    let want = if p384 { OID_P384 } else { OID_P256 };
    if spki.algorithm.algorithm.to_id_string() != OID_EC_PUBLIC_KEY
        || curve.as_deref() != Some(want)
    {
        return Err(Error::chain(
            chain,
            format!(
                "'{}' does not hold an EC {} key",
                subject(cert),
                if p384 { "P-384" } else { "P-256" }
            ),
        ));
    }
    Ok(&spki.subject_public_key.data)
}

/// The raw value of the extension `oid` (dotted), if present exactly once.
pub(crate) fn extension<'a>(
    cert: &'a X509Certificate<'_>,
    oid: &str,
    chain: ChainKind,
) -> Result<Option<&'a [u8]>> {
    let mut found = None;
    for ext in cert.extensions() {
        if ext.oid.to_id_string() == oid {
            if found.is_some() {
                return Err(Error::chain(
                    chain,
                    format!("extension {oid} appears twice in '{}'", subject(cert)),
                ));
            }
            found = Some(ext.value);
        }
    }
    Ok(found)
}

/// When a CRL may be relied on: from its thisUpdate to its nextUpdate (Unix seconds; a CRL
/// without nextUpdate has no end). Kept with a cached chain and checked at every `now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CrlWindow {
    pub this_update: i64,
    pub next_update: Option<i64>,
}

impl CrlWindow {
    pub(crate) fn check(&self, now: i64) -> Result<()> {
        if now < self.this_update {
            return Err(Error::Crl {
                detail: format!("not valid before {}", rfc3339(self.this_update)),
            });
        }
        if let Some(next) = self.next_update
            && now > next
        {
            return Err(Error::Crl {
                detail: format!("expired at {}", rfc3339(next)),
            });
        }
        Ok(())
    }
}

/// A CRL checked against its issuer and time; yields the revoked serials (raw big-endian) and
/// the CRL's window, which a cached verdict must keep checking.
pub(crate) fn checked_crl_serials(
    crl_der: &[u8],
    issuer: &X509Certificate<'_>,
    provider: &dyn CryptoProvider,
    now: i64,
    chain: ChainKind,
) -> Result<(Vec<Vec<u8>>, CrlWindow)> {
    let crl = match CertificateRevocationList::from_der(crl_der) {
        Ok(([], crl)) => crl,
        // Unsigned bytes after the CRL would make every copy of one CRL a new input.
        Ok((rest, _)) => {
            return Err(Error::Crl {
                detail: format!("{} trailing bytes after the CRL", rest.len()),
            });
        }
        Err(e) => {
            return Err(Error::Crl {
                detail: format!("does not parse: {e}"),
            });
        }
    };
    if crl.issuer().as_raw() != issuer.subject().as_raw() {
        return Err(Error::Crl {
            detail: format!("issued by '{}', not by '{}'", crl.issuer(), subject(issuer)),
        });
    }
    if !canonical_signed_shape(crl.as_ref(), false) {
        return Err(Error::Crl {
            detail: "outer signature algorithm or signature encoding is not canonical".into(),
        });
    }
    let (key, alg) = key_and_alg(issuer, &crl.signature_algorithm, chain)?;
    provider
        .verify(
            alg,
            key,
            crl.tbs_cert_list.as_ref(),
            &crl.signature_value.data,
        )
        .map_err(|_| Error::Crl {
            detail: format!("signature by '{}' does not verify", subject(issuer)),
        })?;
    let window = CrlWindow {
        this_update: crl.last_update().timestamp(),
        next_update: crl.next_update().map(|t| t.timestamp()),
    };
    window.check(now)?;
    Ok((
        crl.iter_revoked_certificates()
            .map(|r| r.raw_serial().to_vec())
            .collect(),
        window,
    ))
}

/// Is this certificate self-signed under its own key?
pub(crate) fn is_self_signed(
    cert: &X509Certificate<'_>,
    provider: &dyn CryptoProvider,
    chain: ChainKind,
) -> bool {
    verify_issued_by(cert, cert, provider, chain).is_ok()
}
