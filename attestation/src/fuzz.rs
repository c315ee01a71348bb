//! Entry points for cargo-fuzz (feature `fuzzing`; `fuzz/` at the repository root).
//!
//! Each function takes outside bytes exactly where production takes them and calls the same
//! parser or verifier; it returns nothing, because a fuzz target only asks whether the code
//! panics, hangs or blows up memory. Several inputs travel in one buffer split on [`SEPARATOR`]
//! (length prefixes would make every mutation of a length a different parse).

use std::sync::OnceLock;

use crate::crypto::DEFAULT_PROVIDER;
use crate::nvidia::{c14n, ocsp, rim, spdm};
use crate::{Evidence, SimTrust, Verifier, VerifierConfig, snp, tdx, x509};

/// Splits one fuzz input into the several byte strings a verification takes.
pub const SEPARATOR: &[u8] = b"\n--cgx-fuzz--\n";

/// The fields of `data` split on [`SEPARATOR`]; missing ones are empty.
pub fn fields(data: &[u8], n: usize) -> Vec<&[u8]> {
    let mut out = Vec::with_capacity(n);
    let mut rest = data;
    while out.len() + 1 < n {
        match rest.windows(SEPARATOR.len()).position(|w| w == SEPARATOR) {
            Some(i) => {
                out.push(&rest[..i]);
                rest = &rest[i + SEPARATOR.len()..];
            }
            None => break,
        }
    }
    out.push(rest);
    out.resize(n, &[]);
    out
}

/// The non-empty fields, owned (CRLs, OCSP responses: as many as the input carries).
fn owned_nonempty(fields: &[&[u8]]) -> Vec<Vec<u8>> {
    fields
        .iter()
        .filter(|c| !c.is_empty())
        .map(|c| c.to_vec())
        .collect()
}

/// Fixed "now" (2026-01-01): inputs must replay identically, whatever the date.
pub const NOW: i64 = 1_767_225_600;

fn verifier() -> &'static Verifier {
    static V: OnceLock<Verifier> = OnceLock::new();
    // Any sim root: the simulator's seeds get past the root check and into every later one.
    V.get_or_init(|| Verifier::new(VerifierConfig { sim: SimTrust::Any }).allowing_sample(true))
}

/// An SNP attestation report (1184 bytes, AMD SEV-SNP ABI Table 23) and what is read from it.
pub fn snp_report(data: &[u8]) {
    if let Ok(r) = snp::AttestationReport::parse(data) {
        let _ = r.signing_key();
        let _ = r.cpuid_product();
        let _ = r.signature_fixed_be();
        let _ = crate::collateral::CollateralKey::vcek_for(&r);
    }
}

/// A TDX quote: dcap-qvl's decoder, our canonical-encoding check, the PCK chain and FMSPC.
pub fn tdx_quote(data: &[u8]) {
    let _ = tdx::collateral_ids(data);
}

/// NVIDIA SPDM `GET_MEASUREMENTS` request ‖ response.
pub fn spdm(data: &[u8]) {
    if let Ok(ev) = spdm::SpdmEvidence::parse(data) {
        for t in 0..=u16::from(u8::MAX) {
            if let Some(v) = ev.opaque(t) {
                let _ = spdm::format_vbios_version(v);
                let _ = spdm::ascii_field(v);
            }
        }
    }
}

/// A RIM: the XML parser, exclusive canonicalization, and XML-DSig verification.
pub fn rim(data: &[u8]) {
    if let Ok(root) = c14n::parse(data) {
        let _ = c14n::canonicalize(&root, None);
        if let Some(c14n::Node::Element(first)) = root.children.first() {
            let _ = c14n::canonicalize(&root, Some(first));
        }
    }
    let _ = rim::verify(
        data,
        &DEFAULT_PROVIDER,
        NOW,
        rim::RimOptions {
            ignore_signer_expiry: true,
        },
    );
}

/// An OCSP response (RFC 6960), a certificate and its issuer (DER): the response parsed,
/// matched to the certificate, its signer checked and its times judged.
pub fn ocsp(data: &[u8]) {
    let f = fields(data, 3);
    let _ = ocsp::OcspResponse::parse(f[0]);
    let _ = ocsp::canonical(f[0], &DEFAULT_PROVIDER);
    let _ = ocsp::validity_window(f[0]);
    let _ = ocsp::chain_cert_ids(f[1]);
    if let (Ok(cert), Ok(issuer)) = (
        x509::parse_cert(f[1], "fuzz"),
        x509::parse_cert(f[2], "fuzz"),
    ) && let Ok(a) = ocsp::attest(&[f[0].to_vec()], &cert, &issuer, &DEFAULT_PROVIDER, None)
    {
        let _ = a.judge(NOW);
    }
}

/// Certificates (DER or PEM) and a CRL: our wrappers over x509-parser, the extensions we read,
/// and a CRL checked against the first certificate as its issuer.
pub fn x509(data: &[u8]) {
    let f = fields(data, 2);
    let Ok(ders) = x509::der_or_pem_certs(f[0], "fuzz") else {
        return;
    };
    for der in &ders {
        let Ok(cert) = x509::parse_cert(der, "fuzz") else {
            continue;
        };
        let _ = x509::check_validity(&cert, NOW);
        let _ = x509::spki_sha256(&cert);
        let _ = x509::subject(&cert);
        for (chain, p384) in [
            (crate::error::ChainKind::Amd, true),
            (crate::error::ChainKind::Intel, false),
            (crate::error::ChainKind::NvidiaDevice, true),
        ] {
            let _ = x509::ec_public_key(&cert, p384, chain);
            if let Ok(Some(v)) = x509::extension(&cert, "2.23.133.5.4.1", chain) {
                let _ = crate::nvidia::fwids_of(v);
            }
            let _ = x509::is_self_signed(&cert, &DEFAULT_PROVIDER, chain);
            let _ = x509::checked_crl_serials(f[1], &cert, &DEFAULT_PROVIDER, NOW, chain);
        }
    }
    let _ = crate::collateral::validity_window(f[0]);
}

/// Whole evidence, verified: the first byte picks SNP (report, signing certificate, chain,
/// CRLs…), TDX (quote, collateral JSON) or NVIDIA (report, PEM chain, OCSP responses…); the rest
/// is split into those fields. Trusts any sim root, so simulated seeds reach the signature and
/// policy-relevant checks.
pub fn evidence(data: &[u8]) {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let now =
        time::OffsetDateTime::from_unix_timestamp(NOW).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    match kind % 3 {
        0 => {
            let f = fields(rest, 6);
            let crls = owned_nonempty(&f[3..]);
            let ev = snp::SnpEvidence {
                report: f[0],
                signing_cert: f[1],
                signing_cert_kind: None,
                cert_chain: f[2],
                crls: &crls,
            };
            let _ = verifier().verify(&Evidence::Snp(ev), now);
        }
        1 => {
            let f = fields(rest, 2);
            let ev = tdx::TdxEvidence {
                quote: f[0],
                collateral_json: f[1],
            };
            let _ = verifier().verify(&Evidence::Tdx(ev), now);
        }
        _ => {
            let f = fields(rest, 5);
            let ocsp = owned_nonempty(&f[2..]);
            let ev = crate::nvidia::NvidiaEvidence {
                report: f[0],
                cert_chain: f[1],
                expected_nonce: None,
                ocsp: &ocsp,
            };
            let _ = verifier().verify(&Evidence::Nvidia(ev), now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_split_and_pad() {
        let mut joined = b"a".to_vec();
        joined.extend_from_slice(SEPARATOR);
        joined.extend_from_slice(b"b");
        assert_eq!(fields(&joined, 3), vec![&b"a"[..], b"b", b""]);
        // The last field keeps any further separators.
        assert_eq!(fields(&joined, 1), vec![&joined[..]]);
    }
}
