//! The SEV-SNP attestation report, field by field.
//!
//! Layout: AMD SEV Secure Nested Paging Firmware ABI Specification (publication 56860),
//! Table 23 "ATTESTATION_REPORT Structure" (rev. 1.55+: version 3 adds CPUID fields; rev. 1.57:
//! version 5 adds the mitigation vectors). Offsets in the doc comments are in bytes from the start
//! of the 1184-byte (0x4A0) report. Parsing only decodes and checks the format; signature and
//! certificate checks live in [`super::SnpVerifier::verify`].

use crate::error::{Error, Result};

/// Size of an attestation report.
pub const REPORT_LEN: usize = 0x4A0;
/// Bytes covered by the signature: 0x000..0x2A0.
pub const SIGNED_LEN: usize = 0x2A0;

/// Report versions whose layout we have reviewed. Newer versions are refused rather than read
/// with an old layout.
pub const SUPPORTED_VERSIONS: [u32; 3] = [2, 3, 5];

/// `SIGNATURE_ALGO` value for ECDSA P-384 with SHA-384 (Table 139, "Signature Algorithm").
pub const SIG_ALGO_ECDSA_P384_SHA384: u32 = 1;

/// AMD product line, which fixes the ARK and the TCB_VERSION layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Product {
    Milan,
    Genoa,
    Turin,
}

impl Product {
    pub fn name(self) -> &'static str {
        match self {
            Product::Milan => "Milan",
            Product::Genoa => "Genoa",
            Product::Turin => "Turin",
        }
    }

    /// Product from the CPUID family/model the v3+ report carries (AMD PPR: family 19h models
    /// 00h–0Fh Milan, 10h–1Fh and A0h–AFh Genoa; family 1Ah models 00h–1Fh Turin).
    pub fn from_cpuid(family: u8, model: u8) -> Option<Self> {
        match (family, model) {
            (0x19, 0x00..=0x0F) => Some(Product::Milan),
            (0x19, 0x10..=0x1F) | (0x19, 0xA0..=0xAF) => Some(Product::Genoa),
            (0x1A, 0x00..=0x1F) => Some(Product::Turin),
            _ => None,
        }
    }
}

/// A TCB_VERSION (SNP ABI Table 3; Turin's layout per rev. 1.58 Table 4).
///
/// Milan/Genoa: byte 0 BOOT_LOADER, 1 TEE, 2–5 reserved, 6 SNP, 7 MICROCODE.
/// Turin: byte 0 FMC, 1 BOOT_LOADER, 2 TEE, 3 SNP, 4–6 reserved, 7 MICROCODE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TcbVersion {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fmc: Option<u8>,
    pub bootloader: u8,
    pub tee: u8,
    pub snp: u8,
    pub microcode: u8,
}

impl TcbVersion {
    pub fn decode(raw: u64, product: Product) -> Self {
        let b = raw.to_le_bytes();
        match product {
            Product::Turin => TcbVersion {
                fmc: Some(b[0]),
                bootloader: b[1],
                tee: b[2],
                snp: b[3],
                microcode: b[7],
            },
            Product::Milan | Product::Genoa => TcbVersion {
                fmc: None,
                bootloader: b[0],
                tee: b[1],
                snp: b[6],
                microcode: b[7],
            },
        }
    }

    /// Encode back into the product's layout (used by the simulator).
    pub fn encode(&self, product: Product) -> u64 {
        let mut b = [0u8; 8];
        match product {
            Product::Turin => {
                b[0] = self.fmc.unwrap_or(0);
                b[1] = self.bootloader;
                b[2] = self.tee;
                b[3] = self.snp;
            }
            Product::Milan | Product::Genoa => {
                b[0] = self.bootloader;
                b[1] = self.tee;
                b[6] = self.snp;
            }
        }
        b[7] = self.microcode;
        u64::from_le_bytes(b)
    }
}

/// Which key signed the report (`SIGNING_KEY`, bits 4:2 of the word at 0x48).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum SigningKey {
    Vcek,
    Vlek,
}

impl SigningKey {
    pub fn name(self) -> &'static str {
        match self {
            SigningKey::Vcek => "VCEK",
            SigningKey::Vlek => "VLEK",
        }
    }
}

/// ATTESTATION_REPORT (Table 23). Byte arrays keep the order they have in the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttestationReport {
    /// 0x000 VERSION.
    pub version: u32,
    /// 0x004 GUEST_SVN.
    pub guest_svn: u32,
    /// 0x008 POLICY: the guest policy (Table 9).
    pub policy: u64,
    /// 0x010 FAMILY_ID.
    pub family_id: [u8; 16],
    /// 0x020 IMAGE_ID.
    pub image_id: [u8; 16],
    /// 0x030 VMPL the report was requested from.
    pub vmpl: u32,
    /// 0x034 SIGNATURE_ALGO.
    pub signature_algo: u32,
    /// 0x038 CURRENT_TCB.
    pub current_tcb: u64,
    /// 0x040 PLATFORM_INFO (SMT_EN bit 0, TSME_EN bit 1, ECC_EN bit 2, RAPL_DIS bit 3,
    /// CIPHERTEXT_HIDING_EN bit 4, ALIAS_CHECK_COMPLETE bit 5).
    pub platform_info: u64,
    /// 0x048 bit 0 AUTHOR_KEY_EN, bit 1 MASK_CHIP_KEY, bits 4:2 SIGNING_KEY.
    pub key_info: u32,
    /// 0x050 REPORT_DATA supplied by the guest.
    pub report_data: [u8; 64],
    /// 0x090 MEASUREMENT: the launch digest.
    pub measurement: [u8; 48],
    /// 0x0C0 HOST_DATA.
    pub host_data: [u8; 32],
    /// 0x0E0 ID_KEY_DIGEST.
    pub id_key_digest: [u8; 48],
    /// 0x110 AUTHOR_KEY_DIGEST.
    pub author_key_digest: [u8; 48],
    /// 0x140 REPORT_ID.
    pub report_id: [u8; 32],
    /// 0x160 REPORT_ID_MA.
    pub report_id_ma: [u8; 32],
    /// 0x180 REPORTED_TCB: the TCB the VCEK is derived from.
    pub reported_tcb: u64,
    /// 0x188 CPUID_FAM_ID (v3+).
    pub cpuid_fam_id: Option<u8>,
    /// 0x189 CPUID_MOD_ID (v3+).
    pub cpuid_mod_id: Option<u8>,
    /// 0x18A CPUID_STEP (v3+).
    pub cpuid_step: Option<u8>,
    /// 0x1A0 CHIP_ID (zero when MASK_CHIP_ID is set or for VLEK-signed reports).
    pub chip_id: [u8; 64],
    /// 0x1E0 COMMITTED_TCB.
    pub committed_tcb: u64,
    /// 0x1E8 CURRENT_BUILD, CURRENT_MINOR, CURRENT_MAJOR.
    pub current_version: (u8, u8, u8),
    /// 0x1EC COMMITTED_BUILD, COMMITTED_MINOR, COMMITTED_MAJOR.
    pub committed_version: (u8, u8, u8),
    /// 0x1F0 LAUNCH_TCB.
    pub launch_tcb: u64,
    /// 0x1F8 LAUNCH_MIT_VECTOR (v5).
    pub launch_mit_vector: Option<u64>,
    /// 0x200 CURRENT_MIT_VECTOR (v5).
    pub current_mit_vector: Option<u64>,
    /// 0x2A0 SIGNATURE R (72 bytes little-endian; P-384 uses the low 48).
    pub signature_r: [u8; 72],
    /// 0x2E8 SIGNATURE S (72 bytes little-endian).
    pub signature_s: [u8; 72],
}

fn arr<const N: usize>(b: &[u8], off: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&b[off..off + N]);
    out
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(arr(b, off))
}

fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(arr(b, off))
}

fn all_zero(b: &[u8]) -> bool {
    b.iter().all(|&x| x == 0)
}

impl AttestationReport {
    /// Decode a report, checking length, version, algorithm and reserved fields.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        if bytes.len() != REPORT_LEN {
            return Err(Error::Length {
                what: "SNP attestation report",
                expected: REPORT_LEN.to_string(),
                actual: bytes.len(),
            });
        }
        let b = bytes;
        let version = u32_at(b, 0x000);
        if !SUPPORTED_VERSIONS.contains(&version) {
            return Err(Error::UnsupportedVersion {
                what: "SNP attestation report",
                version: version.into(),
            });
        }
        let signature_algo = u32_at(b, 0x034);
        if signature_algo != SIG_ALGO_ECDSA_P384_SHA384 {
            return Err(Error::invalid(
                "SIGNATURE_ALGO",
                format!("{signature_algo} is not ECDSA P-384/SHA-384 (1)"),
            ));
        }
        let vmpl = u32_at(b, 0x030);
        if vmpl > 3 {
            return Err(Error::invalid("VMPL", format!("{vmpl} is above 3")));
        }
        let key_info = u32_at(b, 0x048);
        if key_info & !0x1F != 0 {
            return Err(Error::invalid(
                "reserved bits of 0x048",
                format!("{key_info:#x}"),
            ));
        }
        // Reserved ranges must be zero; which ranges are reserved depends on the version.
        let mut reserved: Vec<(&'static str, std::ops::Range<usize>)> = vec![
            ("0x04C", 0x04C..0x050),
            ("0x1EB", 0x1EB..0x1EC),
            ("0x1EF", 0x1EF..0x1F0),
            ("signature 0x330..0x4A0", 0x330..0x4A0),
        ];
        if version >= 3 {
            reserved.push(("0x18B..0x1A0", 0x18B..0x1A0));
        } else {
            reserved.push(("0x188..0x1A0", 0x188..0x1A0));
        }
        if version >= 5 {
            reserved.push(("0x208..0x2A0", 0x208..0x2A0));
        } else {
            reserved.push(("0x1F8..0x2A0", 0x1F8..0x2A0));
        }
        for (name, range) in reserved {
            if !all_zero(&b[range]) {
                return Err(Error::invalid(
                    "reserved field",
                    format!("{name} is not zero"),
                ));
            }
        }
        let signature_r: [u8; 72] = arr(b, 0x2A0);
        let signature_s: [u8; 72] = arr(b, 0x2E8);
        // P-384 scalars are 48 bytes; the upper 24 bytes of each 72-byte field must be zero.
        if !all_zero(&signature_r[48..]) || !all_zero(&signature_s[48..]) {
            return Err(Error::invalid(
                "SIGNATURE",
                "r or s exceeds 48 bytes (not a P-384 signature)",
            ));
        }
        let v3 = version >= 3;
        let v5 = version >= 5;
        Ok(AttestationReport {
            version,
            guest_svn: u32_at(b, 0x004),
            policy: u64_at(b, 0x008),
            family_id: arr(b, 0x010),
            image_id: arr(b, 0x020),
            vmpl,
            signature_algo,
            current_tcb: u64_at(b, 0x038),
            platform_info: u64_at(b, 0x040),
            key_info,
            report_data: arr(b, 0x050),
            measurement: arr(b, 0x090),
            host_data: arr(b, 0x0C0),
            id_key_digest: arr(b, 0x0E0),
            author_key_digest: arr(b, 0x110),
            report_id: arr(b, 0x140),
            report_id_ma: arr(b, 0x160),
            reported_tcb: u64_at(b, 0x180),
            cpuid_fam_id: v3.then(|| b[0x188]),
            cpuid_mod_id: v3.then(|| b[0x189]),
            cpuid_step: v3.then(|| b[0x18A]),
            chip_id: arr(b, 0x1A0),
            committed_tcb: u64_at(b, 0x1E0),
            current_version: (b[0x1E8], b[0x1E9], b[0x1EA]),
            committed_version: (b[0x1EC], b[0x1ED], b[0x1EE]),
            launch_tcb: u64_at(b, 0x1F0),
            launch_mit_vector: v5.then(|| u64_at(b, 0x1F8)),
            current_mit_vector: v5.then(|| u64_at(b, 0x200)),
            signature_r,
            signature_s,
        })
    }

    /// SIGNING_KEY: 0 VCEK, 1 VLEK; 7 (no key) and the rest are refused.
    pub fn signing_key(&self) -> Result<SigningKey> {
        match (self.key_info >> 2) & 0x7 {
            0 => Ok(SigningKey::Vcek),
            1 => Ok(SigningKey::Vlek),
            other => Err(Error::invalid(
                "SIGNING_KEY",
                format!("{other} names no usable key (0 VCEK, 1 VLEK)"),
            )),
        }
    }

    /// MASK_CHIP_KEY: when set, firmware wrote a zero signature.
    pub fn mask_chip_key(&self) -> bool {
        self.key_info & 0b10 != 0
    }

    /// The signature as big-endian fixed `r ‖ s` (96 bytes), as verifiers take it.
    pub fn signature_fixed_be(&self) -> [u8; 96] {
        let mut out = [0u8; 96];
        for i in 0..48 {
            out[i] = self.signature_r[47 - i];
            out[48 + i] = self.signature_s[47 - i];
        }
        out
    }

    /// Product implied by CPUID fields (v3+), if any.
    pub fn cpuid_product(&self) -> Option<Product> {
        match (self.cpuid_fam_id, self.cpuid_mod_id) {
            (Some(f), Some(m)) => Product::from_cpuid(f, m),
            _ => None,
        }
    }

    /// Guest policy DEBUG bit (bit 19, Table 9).
    pub fn debug_allowed(&self) -> bool {
        self.policy & (1 << 19) != 0
    }
}

/// Byte offsets of fields the tamper tests flip (public so tests and tools agree).
pub mod offsets {
    pub const VERSION: usize = 0x000;
    pub const GUEST_SVN: usize = 0x004;
    pub const POLICY: usize = 0x008;
    pub const FAMILY_ID: usize = 0x010;
    pub const IMAGE_ID: usize = 0x020;
    pub const VMPL: usize = 0x030;
    pub const SIGNATURE_ALGO: usize = 0x034;
    pub const CURRENT_TCB: usize = 0x038;
    pub const PLATFORM_INFO: usize = 0x040;
    pub const KEY_INFO: usize = 0x048;
    pub const REPORT_DATA: usize = 0x050;
    pub const MEASUREMENT: usize = 0x090;
    pub const HOST_DATA: usize = 0x0C0;
    pub const ID_KEY_DIGEST: usize = 0x0E0;
    pub const AUTHOR_KEY_DIGEST: usize = 0x110;
    pub const REPORT_ID: usize = 0x140;
    pub const REPORT_ID_MA: usize = 0x160;
    pub const REPORTED_TCB: usize = 0x180;
    pub const CPUID_FAM_ID: usize = 0x188;
    pub const CHIP_ID: usize = 0x1A0;
    pub const COMMITTED_TCB: usize = 0x1E0;
    pub const CURRENT_BUILD: usize = 0x1E8;
    pub const LAUNCH_TCB: usize = 0x1F0;
    pub const SIGNATURE_R: usize = 0x2A0;
    pub const SIGNATURE_S: usize = 0x2E8;
}
