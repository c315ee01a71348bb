//! SPDM GET_MEASUREMENTS request and MEASUREMENTS response, as NVIDIA Hopper GPUs produce them in
//! confidential-computing mode (DMTF DSP0274 v1.1: §10.11 "GET_MEASUREMENTS request and
//! MEASUREMENTS response", Table 38/40/41; measurement blocks Table 42, DMTF measurement value
//! Table 43). NVIDIA's opaque data is a list of (type u16, size u16, value) fields.
//!
//! Evidence is `request ‖ response` exactly as NVIDIA's tools dump it. The signature (ECDSA P-384,
//! raw `r ‖ s`) covers `request ‖ response[..signature]`. It is located by parsing: some dumps
//! carry bytes after it.
//!
//! Crate-private: the verifier is its only reader. Constants the parser does not consult yet
//! stay, named as the spec and NVIDIA's opaque-data table name them.
#![allow(dead_code)]

use crate::error::{Error, Result};

/// Request code of GET_MEASUREMENTS.
pub const GET_MEASUREMENTS: u8 = 0xE0;
/// Response code of MEASUREMENTS.
pub const MEASUREMENTS: u8 = 0x60;
/// Length of the v1.1 GET_MEASUREMENTS request with a signature requested.
pub const REQUEST_LEN: usize = 37;
/// Nonce length.
pub const NONCE_LEN: usize = 32;
/// ECDSA P-384 raw signature length.
pub const SIGNATURE_LEN: usize = 96;

/// NVIDIA opaque-data field types (nvtrust `OpaqueDataType`).
pub mod opaque_type {
    pub const DRIVER_VERSION: u16 = 3;
    pub const GPU_INFO: u16 = 4;
    pub const VBIOS_VERSION: u16 = 6;
    pub const CHIP_SKU: u16 = 15;
    pub const PROJECT: u16 = 17;
    pub const PROJECT_SKU: u16 = 18;
    pub const FWID: u16 = 20;
    /// One status byte: `0x55` protected PCIe (PPCIE) off, `0xAA` on.
    pub const PROTECTED_PCIE_STATUS: u16 = 21;
    pub const OPAQUE_DATA_VERSION: u16 = 34;
    /// The GPU's confidential-computing topology (later firmware): little-endian integer,
    /// 0 SPT (single GPU passthrough), 1 MPT (multi-GPU protected), 2 PPCIE.
    pub const FEATURE_FLAG: u16 = 36;
}

/// `cc_mode` claim: the GPU signed that it runs confidential computing for one GPU passed
/// through to one VM (FEATURE_FLAG SPT, or — firmware without that field — protected PCIe off).
pub const CC_MODE_ON: &str = "on";
/// `cc_mode` claim: protected PCIe, where NVLink traffic is plaintext and the switches are
/// inside the TCB.
pub const CC_MODE_PPCIE: &str = "ppcie";
/// `cc_mode` claim: multi-GPU protected topology (FEATURE_FLAG MPT).
pub const CC_MODE_MPT: &str = "mpt";
/// `cc_mode` claim: neither field, or a value not reviewed here.
pub const CC_MODE_UNKNOWN: &str = "unknown";

/// GET_MEASUREMENTS request (Table 38).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeasurementsRequest {
    /// SPDMVersion (0x11 for 1.1).
    pub version: u8,
    /// Param1: bit 0 SignatureRequested.
    pub attributes: u8,
    /// Param2: MeasurementOperation (0xFF = all blocks).
    pub operation: u8,
    /// The requester's nonce.
    pub nonce: [u8; NONCE_LEN],
    /// SlotIDParam.
    pub slot_id: u8,
}

/// One measurement block (Table 42) holding a DMTF measurement value (Table 43).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeasurementBlock {
    /// Index (1-based).
    pub index: u8,
    /// MeasurementSpecification (bit 0: DMTF).
    pub specification: u8,
    /// DMTFSpecMeasurementValueType.
    pub value_type: u8,
    /// DMTFSpecMeasurementValue.
    pub value: Vec<u8>,
}

/// One opaque-data field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpaqueField {
    pub field_type: u16,
    pub value: Vec<u8>,
}

/// MEASUREMENTS response (Table 40).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeasurementsResponse {
    pub version: u8,
    /// Param1 (total number of blocks for operation 0, else reserved).
    pub param1: u8,
    /// Param2 (slot id in bits 3:0).
    pub param2: u8,
    pub blocks: Vec<MeasurementBlock>,
    /// Responder nonce.
    pub nonce: [u8; NONCE_LEN],
    pub opaque: Vec<OpaqueField>,
    /// Raw `r ‖ s`.
    pub signature: [u8; SIGNATURE_LEN],
}

/// Parsed evidence plus the signed span.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpdmEvidence {
    pub request: MeasurementsRequest,
    pub response: MeasurementsResponse,
    /// Length of `request ‖ response` up to the signature: the signed message.
    pub signed_len: usize,
    /// Bytes after the signature (not signed; reported, never trusted).
    pub trailing: usize,
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len());
        match end {
            Some(end) => {
                let s = &self.b[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(Error::Length {
                what: "SPDM evidence",
                expected: format!("{n} more bytes for {what} at offset {}", self.pos),
                actual: self.b.len(),
            }),
        }
    }
    fn u8(&mut self, what: &'static str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16> {
        let s = self.take(2, what)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u24(&mut self, what: &'static str) -> Result<usize> {
        let s = self.take(3, what)?;
        Ok(usize::from(s[0]) | usize::from(s[1]) << 8 | usize::from(s[2]) << 16)
    }
    fn arr<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }
}

impl SpdmEvidence {
    /// Parse `request ‖ response`.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let mut c = Cursor { b: bytes, pos: 0 };
        let version = c.u8("request SPDMVersion")?;
        if !(0x10..=0x13).contains(&version) {
            return Err(Error::UnsupportedVersion {
                what: "SPDM",
                version: version.into(),
            });
        }
        let code = c.u8("request code")?;
        if code != GET_MEASUREMENTS {
            return Err(Error::malformed(
                "SPDM request",
                format!("code {code:#04x} is not GET_MEASUREMENTS (0xe0)"),
            ));
        }
        let attributes = c.u8("request Param1")?;
        if attributes & 1 == 0 {
            return Err(Error::malformed(
                "SPDM request",
                "no signature was requested",
            ));
        }
        let operation = c.u8("request Param2")?;
        let nonce = c.arr::<NONCE_LEN>("request nonce")?;
        let slot_id = if version >= 0x11 {
            c.u8("request SlotIDParam")?
        } else {
            0
        };
        let request = MeasurementsRequest {
            version,
            attributes,
            operation,
            nonce,
            slot_id,
        };

        let rversion = c.u8("response SPDMVersion")?;
        if rversion != version {
            return Err(Error::malformed(
                "SPDM response",
                format!("version {rversion:#04x} differs from the request's {version:#04x}"),
            ));
        }
        let rcode = c.u8("response code")?;
        if rcode != MEASUREMENTS {
            return Err(Error::malformed(
                "SPDM response",
                format!("code {rcode:#04x} is not MEASUREMENTS (0x60)"),
            ));
        }
        let param1 = c.u8("response Param1")?;
        let param2 = c.u8("response Param2")?;
        let count = c.u8("NumberOfBlocks")?;
        let record_len = c.u24("MeasurementRecordLength")?;
        let record = c.take(record_len, "MeasurementRecord")?;
        let blocks = parse_blocks(record, count)?;
        let rnonce = c.arr::<NONCE_LEN>("response nonce")?;
        let opaque_len = usize::from(c.u16("OpaqueLength")?);
        let opaque = parse_opaque(c.take(opaque_len, "OpaqueData")?)?;
        let signed_len = c.pos;
        let signature = c.arr::<SIGNATURE_LEN>("signature")?;
        Ok(SpdmEvidence {
            request,
            response: MeasurementsResponse {
                version: rversion,
                param1,
                param2,
                blocks,
                nonce: rnonce,
                opaque,
                signature,
            },
            signed_len,
            trailing: bytes.len() - c.pos,
        })
    }

    /// First opaque field of `field_type`.
    pub fn opaque(&self, field_type: u16) -> Option<&[u8]> {
        self.response
            .opaque
            .iter()
            .find(|f| f.field_type == field_type)
            .map(|f| f.value.as_slice())
    }
}

fn parse_blocks(record: &[u8], count: u8) -> Result<Vec<MeasurementBlock>> {
    let mut c = Cursor { b: record, pos: 0 };
    let mut blocks = Vec::with_capacity(count.into());
    for _ in 0..count {
        let index = c.u8("block Index")?;
        let specification = c.u8("block MeasurementSpecification")?;
        let size = usize::from(c.u16("block MeasurementSize")?);
        let body = c.take(size, "block Measurement")?;
        if specification & 1 == 0 {
            return Err(Error::malformed(
                "SPDM measurement block",
                format!("block {index} is not a DMTF measurement"),
            ));
        }
        let mut m = Cursor { b: body, pos: 0 };
        let value_type = m.u8("DMTFSpecMeasurementValueType")?;
        let vsize = usize::from(m.u16("DMTFSpecMeasurementValueSize")?);
        let value = m.take(vsize, "DMTFSpecMeasurementValue")?.to_vec();
        if m.pos != body.len() {
            return Err(Error::malformed(
                "SPDM measurement block",
                format!("block {index}: value size {vsize} does not fill MeasurementSize {size}"),
            ));
        }
        if blocks.iter().any(|b: &MeasurementBlock| b.index == index) {
            return Err(Error::malformed(
                "SPDM measurement record",
                format!("block index {index} appears twice"),
            ));
        }
        blocks.push(MeasurementBlock {
            index,
            specification,
            value_type,
            value,
        });
    }
    if c.pos != record.len() {
        return Err(Error::malformed(
            "SPDM measurement record",
            format!("{} bytes left after {count} blocks", record.len() - c.pos),
        ));
    }
    Ok(blocks)
}

fn parse_opaque(data: &[u8]) -> Result<Vec<OpaqueField>> {
    let mut c = Cursor { b: data, pos: 0 };
    let mut out = Vec::new();
    while c.pos < data.len() {
        let field_type = c.u16("opaque field type")?;
        let size = usize::from(c.u16("opaque field size")?);
        let value = c.take(size, "opaque field value")?.to_vec();
        out.push(OpaqueField { field_type, value });
    }
    Ok(out)
}

/// The confidential-computing mode the GPU signed in its opaque data.
///
/// A Hopper GPU answers GET_MEASUREMENTS only with confidential computing enabled (CC `on` or
/// `devtools`; NVIDIA's tools refuse to collect evidence otherwise), so there is no signed "off".
/// What the opaque data does carry is the topology: FEATURE_FLAG where the firmware writes it,
/// else PROTECTED_PCIE_STATUS. DevTools mode has no opaque field of its own: it shows in the
/// measured configuration, which is why NVIDIA's verifier reports `dbgstat: disabled` only when
/// every golden measurement matched — and why appraisal requires golden measurements.
/// Anything not reviewed here (a longer field, another value, neither field) is `unknown`,
/// which the default policy refuses.
pub fn cc_mode(evidence: &SpdmEvidence) -> &'static str {
    if let Some(flag) = evidence.opaque(opaque_type::FEATURE_FLAG) {
        let ppcie = evidence.opaque(opaque_type::PROTECTED_PCIE_STATUS);
        return match le_uint(flag) {
            // Both fields present must agree: SPT with protected PCIe on is no mode we know.
            Some(0) if ppcie.is_none_or(|s| s == [0x55]) => CC_MODE_ON,
            Some(1) => CC_MODE_MPT,
            Some(2) => CC_MODE_PPCIE,
            _ => CC_MODE_UNKNOWN,
        };
    }
    match evidence.opaque(opaque_type::PROTECTED_PCIE_STATUS) {
        Some([0x55]) => CC_MODE_ON,
        Some([0xAA]) => CC_MODE_PPCIE,
        _ => CC_MODE_UNKNOWN,
    }
}

/// A little-endian unsigned integer of 1 to 4 bytes.
fn le_uint(v: &[u8]) -> Option<u32> {
    if v.is_empty() || v.len() > 4 {
        return None;
    }
    Some(
        v.iter()
            .rev()
            .fold(0u32, |acc, &b| (acc << 8) | u32::from(b)),
    )
}

/// VBIOS version as NVIDIA writes it in RIM names and colloquialVersion (e.g. "96.00.74.00.1A"):
/// bytes 3, 2, 1, 0, 4 of the opaque field.
pub fn format_vbios_version(v: &[u8]) -> Option<String> {
    if v.len() < 5 {
        return None;
    }
    Some(format!(
        "{:02X}.{:02X}.{:02X}.{:02X}.{:02X}",
        v[3], v[2], v[1], v[0], v[4]
    ))
}

/// A NUL-terminated ASCII opaque field as a string.
pub fn ascii_field(v: &[u8]) -> String {
    let end = v.iter().position(|&b| b == 0).unwrap_or(v.len());
    String::from_utf8_lossy(&v[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_opaque(fields: &[(u16, &[u8])]) -> SpdmEvidence {
        SpdmEvidence {
            request: MeasurementsRequest {
                version: 0x11,
                attributes: 1,
                operation: 0xFF,
                nonce: [0; NONCE_LEN],
                slot_id: 0,
            },
            response: MeasurementsResponse {
                version: 0x11,
                param1: 0,
                param2: 0,
                blocks: Vec::new(),
                nonce: [0; NONCE_LEN],
                opaque: fields
                    .iter()
                    .map(|(t, v)| OpaqueField {
                        field_type: *t,
                        value: v.to_vec(),
                    })
                    .collect(),
                signature: [0; SIGNATURE_LEN],
            },
            signed_len: 0,
            trailing: 0,
        }
    }

    #[test]
    fn cc_mode_reads_the_feature_flag_then_the_protected_pcie_status() {
        use opaque_type::{FEATURE_FLAG as F, PROTECTED_PCIE_STATUS as P};
        type Fields<'a> = &'a [(u16, &'a [u8])];
        let cases: [(Fields<'_>, &str); 12] = [
            // As the real H100s sign it: driver 550 (status only), driver 580 (both).
            (&[(P, &[0x55])], CC_MODE_ON),
            (&[(P, &[0x55]), (F, &[0, 0])], CC_MODE_ON),
            (&[(F, &[0])], CC_MODE_ON),
            (&[(F, &[1, 0])], CC_MODE_MPT),
            (&[(F, &[2, 0])], CC_MODE_PPCIE),
            (&[(P, &[0xAA])], CC_MODE_PPCIE),
            // Fields that disagree, values and sizes not reviewed, or nothing: unknown.
            (&[(P, &[0xAA]), (F, &[0, 0])], CC_MODE_UNKNOWN),
            (&[(F, &[3, 0])], CC_MODE_UNKNOWN),
            (&[(F, &[])], CC_MODE_UNKNOWN),
            (&[(F, &[0, 0, 0, 0, 0])], CC_MODE_UNKNOWN),
            (&[(P, &[0x55, 0x55])], CC_MODE_UNKNOWN),
            (&[], CC_MODE_UNKNOWN),
        ];
        for (fields, want) in cases {
            assert_eq!(cc_mode(&with_opaque(fields)), want, "{fields:?}");
        }
    }
}
