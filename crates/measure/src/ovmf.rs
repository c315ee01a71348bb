//! An OVMF firmware image as an SEV-SNP launch sees it.
//!
//! - **GUIDed footer table** (edk2 `OvmfPkg/ResetVector/Ia16/ResetVectorVtf0.asm`, "OVMF GUIDed
//!   structure table"): it ends 32 bytes before the end of the image with a footer entry
//!   `{ u16 size, GUID 96b582de-1fb2-45f7-baea-a366c55a082d }` whose `size` covers the whole
//!   table. Entries are read backwards from the footer, each `data ‖ u16 size ‖ GUID` with `size`
//!   counting all three.
//! - **SEV metadata** (edk2 `OvmfPkg/ResetVector/X64/OvmfSevMetadata.asm`): the table entry
//!   `dc886566-984a-4798-a75e-5585a7bf67cc` holds a `u32` offset from the image's end to the header
//!   `{ "ASEV", u32 size, u32 version = 1, u32 num_items }`, followed by `num_items` sections
//!   `{ u32 base, u32 size, u32 type }` that the VMM adds to the launch in order.
//! - **SEV-ES reset block** (`00f771de-1a7e-4fcb-890e-68c77e2fb44e`): the application processors'
//!   reset address (`u32`, first four bytes).
//! - **SEV hashes table** (`7255371f-3a3b-4b04-927b-1da6efa8d454`): the guest-physical address where
//!   QEMU puts the kernel/initrd/cmdline hashes for measured direct boot (`u32`).
//!
//! The image is mapped so that it ends at 4 GiB: its first byte is at `4 GiB − len`.

use crate::{Error, Result, guid};

/// The footer entry's GUID.
pub const FOOTER_GUID: [u8; 16] = guid(
    0x96b5_82de,
    0x1fb2,
    0x45f7,
    [0xba, 0xea, 0xa3, 0x66, 0xc5, 0x5a, 0x08, 0x2d],
);
/// Where the SEV metadata is.
pub const SEV_METADATA_GUID: [u8; 16] = guid(
    0xdc88_6566,
    0x984a,
    0x4798,
    [0xa7, 0x5e, 0x55, 0x85, 0xa7, 0xbf, 0x67, 0xcc],
);
/// The APs' reset address.
pub const SEV_ES_RESET_BLOCK_GUID: [u8; 16] = guid(
    0x00f7_71de,
    0x1a7e,
    0x4fcb,
    [0x89, 0x0e, 0x68, 0xc7, 0x7e, 0x2f, 0xb4, 0x4e],
);
/// Where QEMU places the SEV hashes table.
pub const SEV_HASH_TABLE_RV_GUID: [u8; 16] = guid(
    0x7255_371f,
    0x3a3b,
    0x4b04,
    [0x92, 0x7b, 0x1d, 0xa6, 0xef, 0xa8, 0xd4, 0x54],
);

/// The largest firmware image taken (OVMF builds are 2–4 MiB; the flash window is 16 MiB).
pub const MAX_IMAGE: usize = 64 << 20;
/// The most SEV metadata sections taken (OVMF declares five or six).
pub const MAX_SECTIONS: u32 = 64;
/// The most pages all sections together may span (OVMF's span a few MiB): bounds the work a
/// crafted image can ask of a launch digest (one SHA-384 step per page) to well under a second.
pub const MAX_SECTION_PAGES: u64 = 1 << 16;
/// The end of the firmware's mapping.
pub const FOUR_GIB: u64 = 1 << 32;
pub(crate) const PAGE: usize = 4096;
/// `u16 size` + GUID.
pub(crate) const ENTRY_HEADER: usize = 18;

/// A section of the SEV metadata: what the VMM adds to the launch at `gpa` (edk2
/// `OvmfSevMetadata.asm`, `OVMF_SECTION_TYPE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Section {
    pub gpa: u32,
    pub size: u32,
    pub kind: SectionKind,
}

/// `OVMF_SECTION_TYPE_*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SectionKind {
    /// 1: memory the firmware uses before it validates memory itself (measured as zero pages).
    SnpSecMem,
    /// 2: the SNP secrets page.
    SnpSecrets,
    /// 3: the CPUID page.
    Cpuid,
    /// 4: the SVSM calling area.
    SvsmCaa,
    /// 0x10: where QEMU puts the kernel hashes table.
    SnpKernelHashes,
}

impl SectionKind {
    fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            1 => SectionKind::SnpSecMem,
            2 => SectionKind::SnpSecrets,
            3 => SectionKind::Cpuid,
            4 => SectionKind::SvsmCaa,
            0x10 => SectionKind::SnpKernelHashes,
            _ => return None,
        })
    }
}

/// A parsed OVMF image (borrowed).
#[derive(Debug, Clone)]
pub struct Ovmf<'a> {
    data: &'a [u8],
    table: Vec<([u8; 16], &'a [u8])>,
    sections: Vec<Section>,
}

pub(crate) fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    b.get(at..at.checked_add(2)?)
        .map(|s| u16::from_le_bytes([s[0], s[1]]))
}

pub(crate) fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at.checked_add(4)?)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

impl<'a> Ovmf<'a> {
    /// Parse the footer table and the SEV metadata. The image must be whole pages (it is
    /// measured page by page) and carry a footer table (the APs' reset vector is in it); SEV
    /// metadata is optional (none: no sections).
    pub fn parse(data: &'a [u8]) -> Result<Self> {
        let bad = |m: &str| Error::Firmware(m.to_string());
        if data.is_empty() || !data.len().is_multiple_of(PAGE) {
            return Err(Error::Firmware(format!(
                "{} bytes is not a whole number of 4 KiB pages",
                data.len()
            )));
        }
        if data.len() > MAX_IMAGE {
            return Err(Error::Firmware(format!(
                "{} bytes is larger than the {} MiB taken",
                data.len(),
                MAX_IMAGE >> 20
            )));
        }
        let table = footer_table(data)?;
        let mut ovmf = Ovmf {
            data,
            table,
            sections: Vec::new(),
        };
        // A firmware without SEV metadata (a plain OVMF build) adds no sections: its launch
        // measures the image and the VMSAs only.
        let Some(meta) = ovmf.table_entry(&SEV_METADATA_GUID) else {
            return Ok(ovmf);
        };
        let offset = u32_at(meta, 0).ok_or_else(|| bad("SEV metadata entry too short"))?;
        let start = data
            .len()
            .checked_sub(offset as usize)
            .ok_or_else(|| bad("SEV metadata offset points before the image"))?;
        if data.get(start..start + 4) != Some(b"ASEV".as_slice()) {
            return Err(bad("SEV metadata header signature is not ASEV"));
        }
        let (Some(size), Some(version), Some(count)) = (
            u32_at(data, start + 4),
            u32_at(data, start + 8),
            u32_at(data, start + 12),
        ) else {
            return Err(bad("SEV metadata header truncated"));
        };
        if version != 1 {
            return Err(Error::Firmware(format!(
                "SEV metadata version {version} (1 is known)"
            )));
        }
        if count > MAX_SECTIONS {
            return Err(Error::Firmware(format!(
                "SEV metadata declares {count} sections, more than the {MAX_SECTIONS} taken"
            )));
        }
        let items = 16usize
            .checked_add((count as usize).saturating_mul(12))
            .filter(|n| *n <= size as usize)
            .ok_or_else(|| bad("SEV metadata sections overrun the header's size"))?;
        let body = data
            .get(start..start + items)
            .ok_or_else(|| bad("SEV metadata runs past the image"))?;
        for i in 0..count as usize {
            let at = 16 + i * 12;
            let (Some(gpa), Some(size), Some(kind)) =
                (u32_at(body, at), u32_at(body, at + 4), u32_at(body, at + 8))
            else {
                return Err(bad("SEV metadata section truncated"));
            };
            let kind = SectionKind::from_u32(kind).ok_or_else(|| {
                Error::Firmware(format!(
                    "SEV metadata section {i} has unknown type {kind:#x}"
                ))
            })?;
            ovmf.sections.push(Section { gpa, size, kind });
        }
        let pages: u64 = ovmf.sections.iter().map(|s| u64::from(s.size) / 4096).sum();
        if pages > MAX_SECTION_PAGES {
            return Err(Error::Firmware(format!(
                "SEV metadata sections span {pages} pages, more than the {MAX_SECTION_PAGES} taken"
            )));
        }
        Ok(ovmf)
    }

    /// The image's bytes.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }

    /// Guest-physical address of the image's first byte (it ends at 4 GiB).
    pub fn gpa(&self) -> u64 {
        FOUR_GIB - self.data.len() as u64
    }

    /// The SEV metadata sections, in the order the VMM adds them.
    pub fn sections(&self) -> &[Section] {
        &self.sections
    }

    /// A footer-table entry's data.
    pub fn table_entry(&self, g: &[u8; 16]) -> Option<&'a [u8]> {
        self.table.iter().find(|(k, _)| k == g).map(|(_, v)| *v)
    }

    /// The APs' reset address (`SEV_ES_RESET_BLOCK_GUID`).
    pub fn sev_es_reset_eip(&self) -> Result<u32> {
        self.table_entry(&SEV_ES_RESET_BLOCK_GUID)
            .and_then(|e| u32_at(e, 0))
            .ok_or_else(|| {
                Error::Firmware(
                    "no SEV-ES reset block in the footer table (no AP reset vector)".into(),
                )
            })
    }

    /// Where QEMU places the SEV hashes table (`SEV_HASH_TABLE_RV_GUID`).
    pub fn sev_hashes_table_gpa(&self) -> Result<u32> {
        self.table_entry(&SEV_HASH_TABLE_RV_GUID)
            .and_then(|e| u32_at(e, 0))
            .filter(|gpa| *gpa != 0)
            .ok_or_else(|| {
                Error::Unsupported(
                    "this firmware has no SEV hashes table (measured direct kernel boot needs an \
                     OVMF built with it, e.g. AmdSev)"
                        .into(),
                )
            })
    }
}

/// The GUIDed table that ends 32 bytes before the image's end (TDVF images carry it too).
pub(crate) fn footer_table(data: &[u8]) -> Result<Vec<([u8; 16], &[u8])>> {
    let bad = |m: &str| Error::Firmware(m.to_string());
    let footer_at = data
        .len()
        .checked_sub(32 + ENTRY_HEADER)
        .ok_or_else(|| bad("too small for a footer table"))?;
    let guid_at = |at: usize| -> Option<[u8; 16]> { data.get(at..at + 16)?.try_into().ok() };
    if guid_at(footer_at + 2) != Some(FOOTER_GUID) {
        return Err(bad("no OVMF footer table GUID 32 bytes before the end"));
    }
    let total = u16_at(data, footer_at).ok_or_else(|| bad("footer truncated"))? as usize;
    let body_len = total
        .checked_sub(ENTRY_HEADER)
        .ok_or_else(|| bad("footer table size smaller than its footer"))?;
    let body_start = footer_at
        .checked_sub(body_len)
        .ok_or_else(|| bad("footer table size larger than the image"))?;
    let mut end = footer_at; // entries end here, walked backwards
    let mut out = Vec::new();
    while end - body_start >= ENTRY_HEADER {
        let header = end - ENTRY_HEADER;
        let size = u16_at(data, header).ok_or_else(|| bad("table entry truncated"))? as usize;
        let g = guid_at(header + 2).ok_or_else(|| bad("table entry truncated"))?;
        if size < ENTRY_HEADER || size > end - body_start {
            return Err(Error::Firmware(format!(
                "footer table entry of size {size} does not fit the table"
            )));
        }
        // Two entries with one GUID: sev-snp-measure keeps one, QEMU another; neither is right.
        if out.iter().any(|(k, _)| *k == g) {
            return Err(Error::Firmware(
                "footer table names one GUID twice".to_string(),
            ));
        }
        out.push((g, &data[end - size..header]));
        end -= size;
    }
    Ok(out)
}

/// Firmware images made to order, for tests here and in other crates (`test-support`).
#[cfg(any(test, feature = "test-support"))]
pub mod testing {
    use super::*;

    /// A small image with a footer table: SEV metadata (the given sections), a reset block and,
    /// where asked, a hashes-table address. `pages` pages long.
    pub fn image(pages: usize, sections: &[(u32, u32, u32)], hashes_gpa: Option<u32>) -> Vec<u8> {
        let mut img = vec![0xAAu8; pages * PAGE];
        let len = img.len();
        // SEV metadata at 8 KiB before the end.
        let meta_at = len - 2 * PAGE;
        let mut meta = b"ASEV".to_vec();
        meta.extend_from_slice(&((16 + 12 * sections.len()) as u32).to_le_bytes());
        meta.extend_from_slice(&1u32.to_le_bytes());
        meta.extend_from_slice(&(sections.len() as u32).to_le_bytes());
        for (gpa, size, kind) in sections {
            for v in [gpa, size, kind] {
                meta.extend_from_slice(&v.to_le_bytes());
            }
        }
        img[meta_at..meta_at + meta.len()].copy_from_slice(&meta);
        // Entries, in file order; the footer last.
        let mut entries = Vec::new();
        let mut entry = |data: &[u8], g: [u8; 16]| {
            let mut e = data.to_vec();
            e.extend_from_slice(&((data.len() + ENTRY_HEADER) as u16).to_le_bytes());
            e.extend_from_slice(&g);
            entries.extend_from_slice(&e);
        };
        entry(&((len - meta_at) as u32).to_le_bytes(), SEV_METADATA_GUID);
        entry(&0xffff_f000u32.to_le_bytes()[..], SEV_ES_RESET_BLOCK_GUID);
        if let Some(h) = hashes_gpa {
            entry(
                &[h.to_le_bytes(), 0x400u32.to_le_bytes()].concat(),
                SEV_HASH_TABLE_RV_GUID,
            );
        }
        let mut table = entries;
        table.extend_from_slice(&((table.len() + ENTRY_HEADER) as u16).to_le_bytes());
        table.extend_from_slice(&FOOTER_GUID);
        let end = len - 32;
        img[end - table.len()..end].copy_from_slice(&table);
        img
    }

    /// A measured direct boot's firmware: 64 pages, pre-validated memory, secrets, CPUID, an
    /// SVSM calling area and the kernel-hashes page, with QEMU's hashes table at 0xC00 in it.
    pub fn direct_boot() -> Vec<u8> {
        image(
            64,
            &[
                (0x80_0000, 0x9000, 1),
                (0x80_9000, 0x1000, 2),
                (0x80_a000, 0x1000, 3),
                (0x80_b000, 0x1000, 4),
                (0x80_c000, 0x1000, 0x10),
            ],
            Some(0x80_cc00),
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::testing::image;
    use super::*;

    #[test]
    fn parses_the_table_and_metadata() {
        let img = image(
            16,
            &[
                (0x80_0000, 0x9000, 1),
                (0x80_9000, 0x1000, 2),
                (0x80_a000, 0x1000, 3),
            ],
            Some(0x80_c00),
        );
        let o = Ovmf::parse(&img).unwrap();
        assert_eq!(o.gpa(), FOUR_GIB - 16 * 4096);
        assert_eq!(o.sections().len(), 3);
        assert_eq!(o.sections()[1].kind, SectionKind::SnpSecrets);
        assert_eq!(o.sev_es_reset_eip().unwrap(), 0xffff_f000);
        assert_eq!(o.sev_hashes_table_gpa().unwrap(), 0x80_c00);
    }

    #[test]
    fn malformed_images_are_refused_not_panicked_on() {
        let good = image(16, &[(0x80_0000, 0x9000, 1)], None);
        // The same image without SEV metadata: no sections.
        let mut plain = good.clone();
        let meta_entry = plain.len() - 32 - 18 - 18 - 4 - 18 - 4;
        plain[meta_entry + 4 + 2] ^= 0xff; // the metadata entry's GUID, corrupted
        assert!(Ovmf::parse(&plain).unwrap().sections().is_empty());
        assert!(Ovmf::parse(&good).unwrap().sev_hashes_table_gpa().is_err());
        // Not whole pages; empty; no footer.
        assert!(Ovmf::parse(&good[..good.len() - 1]).is_err());
        assert!(Ovmf::parse(&[]).is_err());
        assert!(Ovmf::parse(&vec![0u8; 4096]).is_err());
        // An unknown section type.
        assert!(Ovmf::parse(&image(16, &[(0, 0x1000, 9)], None)).is_err());
        // Every single-byte corruption of the table region and the metadata parses or errs.
        // Each parses or errs, and a digest of what parses is quick.
        let params = crate::snp::LaunchParams {
            vcpus: 2,
            vcpu_signature: 0,
            vmm: crate::snp::Vmm::Qemu,
            guest_features: 1,
            kernel_hashes: None,
            firmware_digest: Some([0; 48]),
        };
        for at in (good.len() - 2 * PAGE)..good.len() {
            for v in [0x00u8, 0xff, 0x7f] {
                let mut b = good.clone();
                b[at] = v;
                if let Ok(o) = Ovmf::parse(&b) {
                    let t = std::time::Instant::now();
                    let _ = crate::snp::launch_digest(&o, &params);
                    assert!(t.elapsed().as_secs() < 5, "byte {at:#x} = {v:#x}");
                }
            }
        }
        // Sections that together span too much are refused before any hashing.
        assert!(Ovmf::parse(&image(16, &[(0, 0xffff_f000, 1)], None)).is_err());
        let many: Vec<(u32, u32, u32)> = (0..65).map(|i| (i * 4096, 4096, 1)).collect();
        assert!(Ovmf::parse(&image(16, &many, None)).is_err());
    }
}
