//! CoCo's `sample` attester: unsigned evidence (`{"svn", "report_data"}`) for development
//! without a TEE, and its `sampledevice` twin (`ENABLE_SAMPLE_DEVICE=1`, additional evidence).
//! Nothing vouches for either, so they are checked for shape only and their claims say `sim` and
//! `debug`: every production policy refuses them, and a service takes them at all only when
//! configured to (the KBS's `allow_sample`).

use crate::claims::{CLAIMS_SCHEMA, Claims, EvidenceKind, KindClaims, SampleClaims};
use crate::error::{Error, Result};

/// CoCo sample evidence.
#[derive(Debug, Clone, Copy)]
pub struct SampleEvidence<'a> {
    /// Report data as sent, at most 64 bytes (zero-padded to 64 in the claims).
    pub report_data: &'a [u8],
    /// The attester's `svn`, passed through as it came (`null` when absent).
    pub svn: &'a serde_json::Value,
    /// Sample device evidence (kind `sampledevice`) rather than the sample CPU's.
    pub device: bool,
}

pub(crate) fn claims(ev: &SampleEvidence<'_>) -> Result<Claims> {
    if ev.report_data.len() > 64 {
        return Err(Error::invalid(
            "report_data",
            format!("{} bytes, at most 64", ev.report_data.len()),
        ));
    }
    let mut report_data = ev.report_data.to_vec();
    report_data.resize(64, 0);
    Ok(Claims {
        schema: CLAIMS_SCHEMA.into(),
        kind: if ev.device {
            EvidenceKind::SampleDevice
        } else {
            EvidenceKind::Sample
        },
        sim: true,
        debug: true,
        detail: KindClaims::Sample(SampleClaims {
            svn: ev.svn.clone(),
            report_data: hex::encode(report_data),
        }),
    })
}
