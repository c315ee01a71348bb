//! The one error type of the attestation crate.
//!
//! Every refusal is a variant that says *what* was refused and carries the context an operator
//! needs (which certificate, which field, which time). [`Error::code`] gives a stable,
//! machine-readable code: it is what `cgx verify --json` prints and what later HTTP APIs will put
//! in problem+json bodies, so codes are never renamed once published.
//!
//! No variant carries secret material: evidence is public by construction.

use std::fmt;

/// Which certificate chain a chain error concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ChainKind {
    /// AMD ARK → ASK/ASVK → VCEK/VLEK.
    Amd,
    /// NVIDIA Device Identity CA → … → GPU attestation leaf.
    NvidiaDevice,
    /// NVIDIA CoRIM signing root → … → RIM signer.
    NvidiaRim,
    /// Intel SGX Root CA → … (TDX quotes; reported through dcap-qvl).
    Intel,
    /// No chain at all: CoCo's unsigned sample evidence.
    Sample,
}

impl fmt::Display for ChainKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ChainKind::Amd => "AMD",
            ChainKind::NvidiaDevice => "NVIDIA device",
            ChainKind::NvidiaRim => "NVIDIA RIM",
            ChainKind::Sample => "sample evidence",
            ChainKind::Intel => "Intel PCK",
        })
    }
}

/// Why evidence was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The input is shorter (or longer) than its format requires.
    #[error("{what} is {actual} bytes, expected {expected}")]
    Length {
        what: &'static str,
        expected: String,
        actual: usize,
    },
    /// The input does not follow its format.
    #[error("malformed {what}: {detail}")]
    Malformed { what: &'static str, detail: String },
    /// A format version we have not reviewed.
    #[error("unsupported {what} version {version}")]
    UnsupportedVersion { what: &'static str, version: u64 },
    /// A field holds a value the format forbids (reserved bits, unknown algorithm, ...).
    #[error("invalid {field}: {detail}")]
    InvalidField { field: &'static str, detail: String },
    /// A signature over the evidence or a certificate does not verify.
    #[error("{what}: signature does not verify")]
    Signature { what: String },
    /// The chain does not end at a pinned root (or at a sim root that was not trusted).
    #[error("{chain} chain ends at an untrusted root: {detail}")]
    UntrustedRoot { chain: ChainKind, detail: String },
    /// The chain is structurally wrong (missing link, wrong issuer, not a CA, ...).
    #[error("{chain} chain: {detail}")]
    Chain { chain: ChainKind, detail: String },
    /// A certificate is outside its validity window at the verification time.
    #[error("certificate '{subject}' is not valid at {at} (valid {not_before} .. {not_after})")]
    CertificateValidity {
        subject: String,
        not_before: String,
        not_after: String,
        at: String,
    },
    /// A certificate appears on a CRL supplied with the collateral.
    #[error("certificate '{subject}' (serial {serial}) is revoked")]
    Revoked { subject: String, serial: String },
    /// A CRL could not be used (bad signature, outside its window, wrong issuer).
    #[error("CRL: {detail}")]
    Crl { detail: String },
    /// An OCSP response could not be used (unparseable, unsigned by the issuer or its delegate,
    /// stale, about another certificate, or the responder does not know the certificate).
    #[error("OCSP: {detail}")]
    Ocsp { detail: String },
    /// The VCEK/VLEK TCB extensions do not equal the report's REPORTED_TCB.
    #[error("TCB mismatch in {field}: certificate says {certificate}, report says {report}")]
    TcbMismatch {
        field: &'static str,
        certificate: u64,
        report: u64,
    },
    /// The VCEK hwID does not equal the report's CHIP_ID.
    #[error("VCEK hwID {certificate} does not match report CHIP_ID {report}")]
    ChipIdMismatch { certificate: String, report: String },
    /// The kind of signing key the report names differs from the certificate supplied.
    #[error("report is signed by a {report} but the bundle supplies a {bundle}")]
    SigningKeyMismatch {
        report: &'static str,
        bundle: &'static str,
    },
    /// The GPU leaf's FWID extension does not equal the FWID in the measurement opaque data.
    #[error("FWID mismatch: certificate {certificate}, opaque data {opaque}")]
    FwidMismatch { certificate: String, opaque: String },
    /// A nonce in the evidence differs from the one expected by the caller.
    #[error("nonce mismatch: expected {expected}, evidence has {actual}")]
    NonceMismatch { expected: String, actual: String },
    /// Composite evidence does not bind together (nonce, node key, GPU evidence or order).
    #[error("binding mismatch: {link}")]
    BindingMismatch { link: String },
    /// Intel collateral or the quote's TCB could not be matched (TDX), with Intel's wording.
    #[error("TDX TCB: {detail}")]
    TcbLevel { detail: String },
    /// Collateral (TCB info, QE identity, CRLs) is outside its validity window.
    #[error("collateral expired or not yet valid: {detail}")]
    CollateralExpired { detail: String },
    /// Collateral is missing or does not parse.
    #[error("collateral: {detail}")]
    Collateral { detail: String },
    /// A RIM is malformed, unsigned, or signed by an untrusted chain.
    #[error("RIM {rim}: {detail}")]
    Rim { rim: String, detail: String },
    /// An attestation result could not be signed or verified.
    #[error("attestation result: {detail}")]
    Result { detail: String },
    /// The bundle folder could not be read (I/O at the edge).
    #[error("bundle {path}: {detail}")]
    Bundle { path: String, detail: String },
}

impl Error {
    /// Stable machine-readable code for this refusal.
    pub fn code(&self) -> &'static str {
        match self {
            Error::Length { .. } => "truncated",
            Error::Malformed { .. } => "malformed",
            Error::UnsupportedVersion { .. } => "unsupported_version",
            Error::InvalidField { .. } => "invalid_field",
            Error::Signature { .. } => "signature_invalid",
            Error::UntrustedRoot { .. } => "untrusted_root",
            Error::Chain { .. } => "chain_invalid",
            Error::CertificateValidity { .. } => "certificate_not_valid_at_time",
            Error::Revoked { .. } => "revoked",
            Error::Crl { .. } => "crl_invalid",
            Error::Ocsp { .. } => "ocsp_invalid",
            Error::TcbMismatch { .. } => "tcb_mismatch",
            Error::ChipIdMismatch { .. } => "chip_id_mismatch",
            Error::SigningKeyMismatch { .. } => "signing_key_mismatch",
            Error::FwidMismatch { .. } => "fwid_mismatch",
            Error::NonceMismatch { .. } => "nonce_mismatch",
            Error::BindingMismatch { .. } => "binding_mismatch",
            Error::TcbLevel { .. } => "tcb_level_not_found",
            Error::CollateralExpired { .. } => "collateral_expired",
            Error::Collateral { .. } => "collateral_invalid",
            Error::Rim { .. } => "rim_invalid",
            Error::Bundle { .. } => "bundle_unreadable",
            Error::Result { .. } => "result_error",
        }
    }

    pub(crate) fn malformed(what: &'static str, detail: impl Into<String>) -> Self {
        Error::Malformed {
            what,
            detail: detail.into(),
        }
    }

    pub(crate) fn invalid(field: &'static str, detail: impl Into<String>) -> Self {
        Error::InvalidField {
            field,
            detail: detail.into(),
        }
    }

    pub(crate) fn signature(what: impl Into<String>) -> Self {
        Error::Signature { what: what.into() }
    }

    pub(crate) fn chain(chain: ChainKind, detail: impl Into<String>) -> Self {
        Error::Chain {
            chain,
            detail: detail.into(),
        }
    }
}

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
