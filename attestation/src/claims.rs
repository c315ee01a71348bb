//! The normalized claims shape: what a verifier proved, in one JSON form across evidence kinds.
//!
//! **API boundary.** Claims are the input to policy and what auditors read, so the shape is
//! versioned (`schema`) and changes only additively within a version. Byte strings are lowercase
//! hex in the byte order they have in the evidence. Every kind carries the common fields `schema`,
//! `kind`, `sim` (evidence chained to a simulator root: production policy refuses it) and `debug`
//! (the TEE lets a host inspect the guest: SNP policy bit 19, TDX attribute DEBUG).
//!
//! ```json
//! { "schema": "cgx.claims.v1", "kind": "snp", "sim": false, "debug": false,
//!   "version": 2, "product": "milan", "measurement": "…", "report_data": "…", "chip_id": "…",
//!   "reported_tcb": {"bootloader": 3, "tee": 0, "snp": 8, "microcode": 115},
//!   "policy": "0x30000", "signing_key": "VCEK", … }
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::snp::report::{Product, SigningKey, TcbVersion};

/// Version tag of the claims shape.
pub const CLAIMS_SCHEMA: &str = "cgx.claims.v1";

/// Evidence kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvidenceKind {
    Snp,
    Tdx,
    Nvidia,
    /// CoCo's unsigned sample evidence ([`crate::sample`]): always `sim`.
    Sample,
    /// CoCo's unsigned sample *device* evidence (`ENABLE_SAMPLE_DEVICE=1`): always `sim`.
    #[serde(rename = "sampledevice")]
    SampleDevice,
}

impl EvidenceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EvidenceKind::Snp => "snp",
            EvidenceKind::Tdx => "tdx",
            EvidenceKind::Nvidia => "nvidia",
            EvidenceKind::Sample => "sample",
            EvidenceKind::SampleDevice => "sampledevice",
        }
    }
}

/// Claims of one verified piece of evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Claims {
    pub schema: String,
    pub kind: EvidenceKind,
    pub sim: bool,
    pub debug: bool,
    #[serde(flatten)]
    pub detail: KindClaims,
}

/// Kind-specific claims, flattened next to the common fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum KindClaims {
    Snp(SnpClaims),
    Tdx(TdxClaims),
    Nvidia(NvidiaClaims),
    Sample(SampleClaims),
}

/// CoCo sample claims: nothing in them is vouched for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleClaims {
    /// The attester's `svn`, as it came.
    pub svn: serde_json::Value,
    /// Report data, zero-padded to 64 bytes.
    pub report_data: String,
}

/// SEV-SNP claims (names follow the report fields of SNP ABI Table 23).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnpClaims {
    pub version: u32,
    pub product: Product,
    pub signing_key: SigningKey,
    pub measurement: String,
    pub report_data: String,
    pub host_data: String,
    pub chip_id: String,
    pub reported_tcb: TcbVersion,
    pub current_tcb: TcbVersion,
    pub committed_tcb: TcbVersion,
    pub launch_tcb: TcbVersion,
    /// Guest policy as `0x…` hex.
    pub policy: String,
    pub guest_svn: u32,
    pub vmpl: u32,
    pub family_id: String,
    pub image_id: String,
    pub id_key_digest: String,
    pub author_key_digest: String,
    pub report_id: String,
    pub report_id_ma: String,
    pub platform_info: String,
    pub smt_enabled: bool,
    pub migration_agent_allowed: bool,
    /// Firmware version `major.minor.build`.
    pub firmware: String,
}

/// TDX claims (names follow the TD report fields, Intel TDX DCAP Quote Library API, A.3.2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TdxClaims {
    pub quote_version: u16,
    /// `td10` (TDX 1.0 body) or `td15` (TDX 1.5 body).
    pub body: String,
    /// Intel's TCB status name (UpToDate, SWHardeningNeeded, OutOfDate, …).
    pub tcb_status: String,
    pub advisory_ids: Vec<String>,
    pub mr_td: String,
    pub mr_config_id: String,
    pub mr_owner: String,
    pub mr_owner_config: String,
    pub mr_seam: String,
    pub mr_signer_seam: String,
    pub rtmr: Vec<String>,
    pub report_data: String,
    /// The 8 raw TD_ATTRIBUTES bytes as they sit in the quote.
    pub td_attributes: String,
    pub xfam: String,
    pub tee_tcb_svn: String,
    pub seam_attributes: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tee_tcb_svn2: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mr_service_td: Option<String>,
    pub fmspc: String,
}

/// NVIDIA GPU (SPDM GET_MEASUREMENTS) claims.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NvidiaClaims {
    /// SPDM version of the exchange, e.g. "1.1".
    pub spdm_version: String,
    /// The requester nonce (32 bytes) the GPU signed.
    pub nonce: String,
    pub measurement_count: usize,
    /// Measurement block index (1-based, as in the SPDM record) → digest.
    pub measurements: BTreeMap<String, String>,
    /// FWID from the opaque data, equal to the leaf certificate's FWID.
    pub fwid: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vbios_version: Option<String>,
    /// Device leaf certificate subject serial number (the GPU's unique id in its chain).
    pub device_serial: String,
    /// The GPU chip the device leaf certificate names (e.g. `GH100` for H100 and H200), which
    /// the verified chain vouches for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chip: Option<String>,
    /// The confidential-computing mode the GPU signed in its opaque data (`on`, `ppcie`,
    /// `mpt` or `unknown`, from FEATURE_FLAG or PROTECTED_PCIE_STATUS). Absent only in claims written before
    /// the field existed, which policy treats as unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cc_mode: Option<String>,
    /// Subject of the leaf certificate's issuer chain root.
    pub root: String,
    /// Revocation of the device chain: `good` (OCSP responses showed every certificate between
    /// leaf and root good) or `not_checked` (no responses came with the evidence).
    pub ocsp: String,
}
