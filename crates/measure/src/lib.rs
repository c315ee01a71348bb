//! Launch measurements computed from a confidential VM's image, so that reference values come
//! from what a provider boots and not from the first report that shows up.
//!
//! - [`ovmf`]: OVMF's GUIDed footer table and its SEV metadata (which pages an SNP launch
//!   measures, and how);
//! - [`snp`]: the SEV-SNP launch digest — the SHA-384 chain over every page `SNP_LAUNCH_UPDATE`
//!   adds (firmware, metadata sections, QEMU's kernel hashes table, one VMSA per vCPU);
//! - [`tdx`]: Intel TDX — MRTD from the TDVF's sections, the image's RTMR events (kernel,
//!   command line, initrd, configuration volume) and the replay of a TD's event log.
//!
//! **Architecture invariant.** Everything here is sans-IO: callers pass bytes (a firmware image,
//! a kernel, an initrd) and get digests back; nothing opens a file or reads the clock. Malformed
//! images are errors, never panics.

pub mod ovmf;
pub mod snp;
pub mod tdx;

/// Why a measurement could not be computed. Names what is wrong with the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The firmware image is not one this launch can measure (truncated, misaligned, no SEV
    /// metadata, a malformed table).
    #[error("firmware: {0}")]
    Firmware(String),
    /// A launch parameter is out of range or unknown.
    #[error("{0}")]
    Parameter(String),
    /// The combination asked for cannot be launched with this firmware (e.g. a kernel for a
    /// firmware without a kernel-hashes section).
    #[error("unsupported: {0}")]
    Unsupported(String),
}

/// Result of this crate's operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// SHA-384 of `b`.
pub(crate) fn sha384(b: &[u8]) -> [u8; 48] {
    let mut out = [0u8; 48];
    out.copy_from_slice(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA384, b).as_ref());
    out
}

/// A GUID as EFI stores it: the first three fields little-endian, the last eight bytes as
/// written (UEFI 2.10 Appendix A, `EFI_GUID`).
pub(crate) const fn guid(d1: u32, d2: u16, d3: u16, d4: [u8; 8]) -> [u8; 16] {
    let a = d1.to_le_bytes();
    let b = d2.to_le_bytes();
    let c = d3.to_le_bytes();
    [
        a[0], a[1], a[2], a[3], b[0], b[1], c[0], c[1], d4[0], d4[1], d4[2], d4[3], d4[4], d4[5],
        d4[6], d4[7],
    ]
}

#[cfg(test)]
mod tests {
    #[test]
    fn guids_are_stored_mixed_endian() {
        // 96b582de-1fb2-45f7-baea-a366c55a082d, as it appears in an OVMF image.
        let g = super::guid(
            0x96b5_82de,
            0x1fb2,
            0x45f7,
            [0xba, 0xea, 0xa3, 0x66, 0xc5, 0x5a, 0x08, 0x2d],
        );
        assert_eq!(hex::encode(g), "de82b596b21ff745baeaa366c55a082d");
    }
}
