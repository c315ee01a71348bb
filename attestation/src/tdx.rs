//! Intel TDX quotes (v4 and v5; TD 1.0 and TD 1.5 bodies), verified by dcap-qvl against Intel
//! collateral passed in by the caller.
//!
//! dcap-qvl checks, at the given time: the PCK chain to the pinned Intel SGX Root CA and both
//! CRLs, the TCB info and QE identity signatures and validity windows, the QE report signature and
//! its binding of the attestation key, the quote signature, and matches the platform and QE TCB
//! levels to a status with advisory IDs. We add typed errors and the normalized claims. A debug
//! TD verifies (its DEBUG attribute is reported); policy refuses it.

use dcap_qvl::QuoteCollateralV3;
use dcap_qvl::quote::Report;
use dcap_qvl::verify::QuoteVerifier;

use crate::claims::{Claims, EvidenceKind, KindClaims, TdxClaims};
use crate::error::{Error, Result};

/// TDX evidence as bytes.
#[derive(Debug, Clone, Copy)]
pub struct TdxEvidence<'a> {
    /// The quote (v4 or v5, certification data type 5 carrying the PCK chain).
    pub quote: &'a [u8],
    /// Intel collateral in dcap-qvl's `QuoteCollateralV3` JSON shape.
    pub collateral_json: &'a [u8],
}

/// Accepts every cryptographically valid quote: acceptability is policy's call, not ours.
/// (dcap-qvl's `Policy` speaks `anyhow`; it goes no further than this module.)
struct VerifyOnly;

impl dcap_qvl::policy::Policy for VerifyOnly {
    fn validate(&self, _: &dcap_qvl::policy::QuoteClaims) -> anyhow::Result<()> {
        Ok(())
    }
}

/// Verifies TDX quotes.
#[derive(Debug, Default, Clone, Copy)]
pub struct TdxVerifier;

/// Smallest quote: 48-byte header + 584-byte TD 1.0 body + 4-byte signature length.
const MIN_QUOTE_LEN: usize = 48 + 584 + 4;

impl TdxVerifier {
    pub fn verify(&self, ev: &TdxEvidence<'_>, now: i64) -> Result<Claims> {
        if ev.quote.len() < MIN_QUOTE_LEN {
            return Err(Error::Length {
                what: "TDX quote",
                expected: format!("at least {MIN_QUOTE_LEN}"),
                actual: ev.quote.len(),
            });
        }
        let quote = dcap_qvl::quote::Quote::parse(ev.quote)
            .map_err(|e| Error::malformed("TDX quote", format!("{e:#}")))?;
        if quote.header.tee_type != 0x81 {
            return Err(Error::invalid(
                "tee_type",
                format!("{:#x} is not TDX (0x81)", quote.header.tee_type),
            ));
        }
        let collateral: QuoteCollateralV3 = serde_json::from_slice(ev.collateral_json)
            .map_err(|e| Error::Collateral {
                detail: format!("collateral JSON: {e}"),
            })?;
        let now = u64::try_from(now).map_err(|_| Error::invalid("time", "before 1970"))?;
        let claims = QuoteVerifier::new_prod()
            .allow_debug(true)
            .allow_service_td(true)
            .verify_with_policy(ev.quote, collateral, now, &VerifyOnly)
            .map_err(|e| classify(&format!("{e:#}")))?;
        let (base, td15) = match &claims.report {
            Report::TD10(r) => (r, None),
            Report::TD15(r) => (&r.base, Some(r)),
            Report::TD15Ex(r) => (&r.base.base, Some(&r.base)),
            Report::SgxEnclave(_) => {
                return Err(Error::invalid("body", "SGX enclave report in a TDX quote"));
            }
        };
        Ok(Claims {
            schema: crate::claims::CLAIMS_SCHEMA.into(),
            kind: EvidenceKind::Tdx,
            sim: false,
            // TD_ATTRIBUTES bit 0: DEBUG (TDX module ABI, TDATTRIBUTES table).
            debug: base.td_attributes[0] & 1 != 0,
            detail: KindClaims::Tdx(TdxClaims {
                quote_version: claims.header.version,
                body: if td15.is_some() { "td15" } else { "td10" }.into(),
                tcb_status: claims.tcb.status.to_string(),
                advisory_ids: claims.tcb.advisory_ids.clone(),
                mr_td: hex::encode(base.mr_td),
                mr_config_id: hex::encode(base.mr_config_id),
                mr_owner: hex::encode(base.mr_owner),
                mr_owner_config: hex::encode(base.mr_owner_config),
                mr_seam: hex::encode(base.mr_seam),
                mr_signer_seam: hex::encode(base.mr_signer_seam),
                rtmr: [base.rt_mr0, base.rt_mr1, base.rt_mr2, base.rt_mr3]
                    .iter()
                    .map(hex::encode)
                    .collect(),
                report_data: hex::encode(base.report_data),
                td_attributes: hex::encode(base.td_attributes),
                xfam: hex::encode(base.xfam),
                tee_tcb_svn: hex::encode(base.tee_tcb_svn),
                seam_attributes: hex::encode(base.seam_attributes),
                tee_tcb_svn2: td15.map(|r| hex::encode(r.tee_tcb_svn2)),
                mr_service_td: td15.map(|r| hex::encode(r.mr_service_td)),
                fmspc: hex::encode(claims.platform.pck.fmspc),
            }),
        })
    }
}

/// Map dcap-qvl's error text to a typed refusal. The message is kept verbatim for operators.
fn classify(msg: &str) -> Error {
    let lower = msg.to_ascii_lowercase();
    let detail = msg.to_string();
    if lower.contains("no matching tcb level") || lower.contains("tcb status") {
        Error::TcbLevel { detail }
    } else if lower.contains("expired")
        || lower.contains("not yet valid")
        || lower.contains("next update")
        || lower.contains("nextupdate")
        || lower.contains("issue date")
        || lower.contains("not valid")
    {
        Error::CollateralExpired { detail }
    } else if lower.contains("revoked") {
        Error::Revoked {
            subject: "Intel PCK chain".into(),
            serial: detail,
        }
    } else if lower.contains("signature") || lower.contains("mismatch") || lower.contains("hash")
    {
        Error::signature(format!("TDX quote or collateral ({msg})"))
    } else if lower.contains("decode") || lower.contains("parse") || lower.contains("invalid") {
        Error::malformed("TDX quote or collateral", detail)
    } else {
        Error::Collateral { detail }
    }
}
