//! A TDX virtual firmware (TDVF) image as the VMM sees it when it builds a TD.
//!
//! - **TDX metadata offset** (the OVMF GUIDed footer table, [`crate::ovmf`]): the entry
//!   `e47a6535-984a-4798-865e-4685a7bf8ec2` holds a `u32` offset from the image's end to the
//!   TDVF descriptor (TDVF Design Guide, §11 "TDVF Metadata"; edk2
//!   `OvmfPkg/ResetVector/X64/IntelTdxMetadata.asm`).
//! - **TDVF_DESCRIPTOR** (Design Guide Table 11-1): `{ "TDVF", u32 length, u32 version = 1,
//!   u32 number_of_section_entry }`, then that many **TDVF_SECTION** entries (Table 11-2), 32
//!   bytes each: `{ u32 data_offset, u32 raw_data_size, u64 memory_address, u64 memory_data_size,
//!   u32 type, u32 attributes }`.
//!
//! QEMU (`hw/i386/tdvf.c`, `tdx.c`) builds a TD from four section types only: the boot firmware
//! volume (BFV) and the configuration firmware volume (CFV), copied from the image — QEMU maps
//! `memory_data_size` bytes of the image from `data_offset` —, and the TD HOB and temporary
//! memory, fresh zeroed memory (which must have no raw data). Other types make QEMU refuse the
//! firmware, and so does this parser: a digest for a launch that cannot happen would mislead.

use crate::ovmf::{PAGE, footer_table, u32_at};
use crate::{Error, Result, guid};

/// Where the TDVF descriptor is.
pub const TDX_METADATA_OFFSET_GUID: [u8; 16] = guid(
    0xe47a_6535,
    0x984a,
    0x4798,
    [0x86, 0x5e, 0x46, 0x85, 0xa7, 0xbf, 0x8e, 0xc2],
);

/// The largest image taken (TDVF builds are 4 MiB).
pub const MAX_IMAGE: usize = crate::ovmf::MAX_IMAGE;
/// The most sections taken (edk2 declares five).
pub const MAX_SECTIONS: u32 = 64;
/// The most pages all sections together may span: 1 GiB. A page the VMM only adds costs 128
/// bytes of hashing, one it also extends 6 KiB (and an extended page is in the image, at most
/// 64 MiB); this bounds a crafted image to about a second.
pub const MAX_SECTION_PAGES: u64 = 1 << 18;

/// `TDVF_SECTION.attributes` bit 0: the VMM extends MRTD with the section's content
/// (`TDH.MR.EXTEND`), not only with its pages' addresses.
pub const ATTRIBUTE_MR_EXTEND: u32 = 1 << 0;
/// Bit 1: the pages are added after launch (`TDH.MEM.PAGE.AUG`); refused (see
/// `check_section`).
pub const ATTRIBUTE_PAGE_AUG: u32 = 1 << 1;

/// `TDVF_SECTION.type` (Design Guide Table 11-3), the four QEMU builds a TD from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SectionType {
    /// 0: the boot firmware volume (code).
    Bfv,
    /// 1: the configuration firmware volume (UEFI variables); measured into RTMR[0].
    Cfv,
    /// 2: where the VMM writes the TD HOB (memory map).
    TdHob,
    /// 3: temporary memory for the firmware's early stages.
    TempMem,
}

impl SectionType {
    fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::Bfv,
            1 => Self::Cfv,
            2 => Self::TdHob,
            3 => Self::TempMem,
            _ => return None,
        })
    }

    /// Whether the VMM copies the section's content from the image.
    pub fn from_image(self) -> bool {
        matches!(self, Self::Bfv | Self::Cfv)
    }
}

/// One `TDVF_SECTION`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Section {
    pub data_offset: u32,
    pub raw_data_size: u32,
    pub memory_address: u64,
    pub memory_data_size: u64,
    pub kind: SectionType,
    pub attributes: u32,
}

impl Section {
    /// Pages in the section.
    pub fn pages(&self) -> u64 {
        self.memory_data_size / PAGE as u64
    }

    /// Whether MRTD covers the content and not only the addresses.
    pub fn extended(&self) -> bool {
        self.attributes & ATTRIBUTE_MR_EXTEND != 0
    }
}

/// A parsed TDVF image (borrowed).
#[derive(Debug, Clone)]
pub struct Tdvf<'a> {
    data: &'a [u8],
    sections: Vec<Section>,
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    let s = b.get(at..at.checked_add(8)?)?;
    Some(u64::from_le_bytes(s.try_into().ok()?))
}

impl<'a> Tdvf<'a> {
    /// Parse the footer table, the TDVF descriptor and its sections, checking each section as
    /// QEMU does before it builds a TD from them.
    pub fn parse(data: &'a [u8]) -> Result<Self> {
        let bad = |m: String| Error::Firmware(m);
        if data.is_empty() || data.len() > MAX_IMAGE {
            return Err(bad(format!(
                "{} bytes is not a firmware image this takes (1 byte to {} MiB)",
                data.len(),
                MAX_IMAGE >> 20
            )));
        }
        let table = footer_table(data)?;
        let entry = table
            .iter()
            .find(|(g, _)| *g == TDX_METADATA_OFFSET_GUID)
            .map(|(_, v)| *v)
            .ok_or_else(|| {
                bad(
                    "no TDX metadata in the footer table (not a TDVF build: OVMF needs \
                     IntelTdx support, e.g. OvmfPkg/IntelTdx/IntelTdxX64.dsc)"
                        .into(),
                )
            })?;
        // QEMU reads the entry's first four bytes.
        let offset = u32_at(entry, 0).ok_or_else(|| bad("TDX metadata entry too short".into()))?;
        let start = data
            .len()
            .checked_sub(offset as usize)
            .ok_or_else(|| bad("TDVF descriptor offset points before the image".into()))?;
        if data.get(start..start + 4) != Some(b"TDVF".as_slice()) {
            return Err(bad("TDVF descriptor signature is not TDVF".into()));
        }
        let (Some(length), Some(version), Some(count)) = (
            u32_at(data, start + 4),
            u32_at(data, start + 8),
            u32_at(data, start + 12),
        ) else {
            return Err(bad("TDVF descriptor truncated".into()));
        };
        if version != 1 {
            return Err(bad(format!(
                "TDVF descriptor version {version} (1 is known)"
            )));
        }
        // QEMU takes at least two sections (one must be the TD HOB).
        if !(2..=MAX_SECTIONS).contains(&count) {
            return Err(bad(format!(
                "TDVF descriptor declares {count} sections (2 to {MAX_SECTIONS} taken)"
            )));
        }
        let end = 16 + 32 * count as usize;
        if length as usize != end {
            return Err(bad(format!(
                "TDVF descriptor length {length} is not that of its {count} sections ({end})"
            )));
        }
        let body = data
            .get(start..start + end)
            .ok_or_else(|| bad("TDVF sections run past the image".into()))?;
        let mut sections = Vec::with_capacity(count as usize);
        let mut pages = 0u64;
        for i in 0..count as usize {
            let at = 16 + 32 * i;
            let field = |o: usize| u32_at(body, at + o).unwrap_or(0);
            let wide = |o: usize| u64_at(body, at + o).unwrap_or(0);
            let raw_type = field(24);
            let kind = SectionType::from_u32(raw_type).ok_or_else(|| {
                bad(format!(
                    "TDVF section {i} has type {raw_type}, which QEMU does not build a TD \
                     from (0 BFV, 1 CFV, 2 TD HOB, 3 temporary memory)"
                ))
            })?;
            let s = Section {
                data_offset: field(0),
                raw_data_size: field(4),
                memory_address: wide(8),
                memory_data_size: wide(16),
                kind,
                attributes: field(28),
            };
            check_section(i, &s, data.len())?;
            pages = pages.saturating_add(s.pages());
            sections.push(s);
        }
        if sections
            .iter()
            .filter(|s| s.kind == SectionType::TdHob)
            .count()
            != 1
        {
            return Err(bad(
                "TDVF sections name no TD HOB, or more than one (QEMU needs exactly one)".into(),
            ));
        }
        if pages > MAX_SECTION_PAGES {
            return Err(bad(format!(
                "TDVF sections span {pages} pages, more than the {MAX_SECTION_PAGES} taken"
            )));
        }
        Ok(Tdvf { data, sections })
    }

    /// The image's bytes.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }

    /// The sections, in the order the VMM adds them.
    pub fn sections(&self) -> &[Section] {
        &self.sections
    }

    /// The memory content of a section copied from the image (BFV, CFV): `memory_data_size`
    /// bytes from `data_offset`, as QEMU maps it. `None` for the others.
    pub fn content(&self, s: &Section) -> Option<&'a [u8]> {
        if !s.kind.from_image() {
            return None;
        }
        let start = s.data_offset as usize;
        self.data
            .get(start..start.checked_add(usize::try_from(s.memory_data_size).ok()?)?)
    }

    /// The configuration firmware volume as TDVF measures it into RTMR[0]
    /// (`EV_EFI_PLATFORM_FIRMWARE_BLOB2`): its raw data.
    pub fn cfv(&self) -> Option<&'a [u8]> {
        let s = self.sections.iter().find(|s| s.kind == SectionType::Cfv)?;
        let start = s.data_offset as usize;
        self.data
            .get(start..start.checked_add(s.raw_data_size as usize)?)
    }
}

/// QEMU's checks (`tdvf_parse_and_check_section_entry`), plus that an image section lies in
/// the image.
fn check_section(i: usize, s: &Section, image_len: usize) -> Result<()> {
    let bad = |m: &str| Error::Firmware(format!("TDVF section {i} ({:?}): {m}", s.kind));
    let page = PAGE as u64;
    if !s.memory_address.is_multiple_of(page) || !s.memory_data_size.is_multiple_of(page) {
        return Err(bad("address or size not 4 KiB aligned"));
    }
    if s.memory_data_size == 0 || s.memory_address.checked_add(s.memory_data_size).is_none() {
        return Err(bad("empty, or wraps the address space"));
    }
    if u64::from(s.raw_data_size) > s.memory_data_size {
        return Err(bad("raw data larger than its memory"));
    }
    if s.attributes & ATTRIBUTE_PAGE_AUG != 0 {
        // Whether a VMM adds such pages at build time differs between VMMs: no guess.
        return Err(Error::Unsupported(format!(
            "TDVF section {i} ({:?}) is marked PAGE_AUG",
            s.kind
        )));
    }
    if s.attributes & !ATTRIBUTE_MR_EXTEND != 0 {
        return Err(Error::Firmware(format!(
            "TDVF section {i}: unknown attribute bits {:#x}",
            s.attributes
        )));
    }
    if s.kind.from_image() {
        if s.raw_data_size == 0 {
            return Err(bad("a firmware volume with no raw data"));
        }
        let end = u64::from(s.data_offset).saturating_add(s.memory_data_size);
        if end > image_len as u64 {
            return Err(bad("its memory runs past the image"));
        }
    } else {
        if s.raw_data_size != 0 || s.data_offset != 0 {
            return Err(bad("fresh memory with raw data"));
        }
        // QEMU writes the TD HOB before it adds the pages: extending MRTD with it would
        // measure QEMU's memory map, which no image determines.
        if s.extended() {
            return Err(Error::Unsupported(format!(
                "TDVF section {i} ({:?}) asks for its content to be measured",
                s.kind
            )));
        }
    }
    Ok(())
}

/// TDVF images made to order, for tests here and in other crates (`test-support`).
#[cfg(any(test, feature = "test-support"))]
pub mod testing {
    use super::*;
    use crate::ovmf::{ENTRY_HEADER, FOOTER_GUID};

    /// `(data_offset, raw_data_size, memory_address, memory_data_size, type, attributes)`.
    pub type RawSection = (u32, u32, u64, u64, u32, u32);

    /// A `pages`-page image whose page `n` is filled with byte `n` (so content differs page by
    /// page), with the TDVF descriptor (the given sections) 4 KiB before the end and a footer
    /// table naming it.
    pub fn image(pages: usize, sections: &[RawSection]) -> Vec<u8> {
        let mut img: Vec<u8> = (0..pages).flat_map(|p| [p as u8; PAGE]).collect();
        let len = img.len();
        let meta_at = len - PAGE;
        let mut meta = b"TDVF".to_vec();
        meta.extend_from_slice(&((16 + 32 * sections.len()) as u32).to_le_bytes());
        meta.extend_from_slice(&1u32.to_le_bytes());
        meta.extend_from_slice(&(sections.len() as u32).to_le_bytes());
        for &(off, raw, addr, size, kind, attr) in sections {
            meta.extend_from_slice(&off.to_le_bytes());
            meta.extend_from_slice(&raw.to_le_bytes());
            meta.extend_from_slice(&addr.to_le_bytes());
            meta.extend_from_slice(&size.to_le_bytes());
            meta.extend_from_slice(&kind.to_le_bytes());
            meta.extend_from_slice(&attr.to_le_bytes());
        }
        img[meta_at..meta_at + meta.len()].copy_from_slice(&meta);
        let mut table = ((len - meta_at) as u32).to_le_bytes().to_vec();
        table.extend_from_slice(&((4 + ENTRY_HEADER) as u16).to_le_bytes());
        table.extend_from_slice(&TDX_METADATA_OFFSET_GUID);
        table.extend_from_slice(&((table.len() + ENTRY_HEADER) as u16).to_le_bytes());
        table.extend_from_slice(&FOOTER_GUID);
        let end = len - 32;
        img[end - table.len()..end].copy_from_slice(&table);
        img
    }

    /// A small TDVF in edk2's shape: BFV (pages 2–7, measured), CFV (pages 0–1, measured), a
    /// TD HOB page and two pages of temporary memory; 9 pages, the descriptor in the last.
    pub fn small() -> Vec<u8> {
        image(
            9,
            &[
                (0x2000, 0x6000, 0xffff_b000, 0x6000, 0, 1),
                (0x0000, 0x2000, 0xffff_7000, 0x2000, 1, 1),
                (0, 0, 0x80_9000, 0x1000, 2, 0),
                (0, 0, 0x80_a000, 0x2000, 3, 0),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::testing::{RawSection, image, small};
    use super::*;

    #[test]
    fn parses_sections_and_content() {
        let img = small();
        let t = Tdvf::parse(&img).unwrap();
        assert_eq!(t.sections().len(), 4);
        assert_eq!(t.sections()[0].kind, SectionType::Bfv);
        assert!(t.sections()[0].extended());
        assert_eq!(t.content(&t.sections()[0]).unwrap()[0], 2);
        assert_eq!(t.cfv().unwrap().len(), 0x2000);
        assert!(t.content(&t.sections()[2]).is_none());
    }

    #[test]
    fn malformed_images_are_refused_with_their_reason() {
        let err = |img: Vec<u8>| Tdvf::parse(&img).unwrap_err().to_string();
        // Each case: the section under test beside a good TD HOB.
        let hob = (0, 0, 0x80_9000, 0x1000, 2, 0);
        let one = |s: RawSection| err(image(4, &[s, hob]));
        // An OVMF image without TDX metadata.
        let snp = crate::ovmf::testing::image(4, &[], None);
        assert!(err(snp).contains("no TDX metadata"));
        assert!(one((0, 0, 0x1000, 0x1000, 7, 0)).contains("type 7"));
        assert!(one((0, 0x1000, 0x1001, 0x1000, 0, 1)).contains("aligned"));
        assert!(one((0x3000, 0x1000, 0, 0x2000, 0, 1)).contains("past the image"));
        assert!(one((0, 0x2000, 0, 0x1000, 0, 1)).contains("raw data larger"));
        assert!(one((0, 0x1000, 0, 0x1000, 3, 0)).contains("fresh memory"));
        assert!(one((0, 0, 0, 0x1000, 3, 1)).contains("content to be measured"));
        assert!(one((0, 0x1000, 0, 0x1000, 0, 4)).contains("attribute"));
        assert!(one((0, 0x1000, 0, 0x1000, 0, 3)).contains("PAGE_AUG"));
        assert!(one((0, 0, u64::MAX - 0xfff, 0x1000, 3, 0)).contains("wraps"));
        assert!(one((0, 0, 0, 1 << 31, 3, 0)).contains("pages"));
        assert!(err(image(4, &[hob])).contains("1 sections"));
        assert!(
            err(image(
                4,
                &[(0, 0x1000, 0, 0x1000, 0, 1), (0, 0, 0x1000, 0x1000, 3, 0)]
            ))
            .contains("TD HOB")
        );
        assert!(err(image(4, &[hob, hob])).contains("TD HOB"));
        // A descriptor length other than its sections'.
        let mut long = image(4, &[(0, 0x1000, 0, 0x1000, 0, 1), hob]);
        let at = long.len() - PAGE + 4;
        long[at] += 1;
        assert!(err(long).contains("length"));
        // Every single-byte corruption of the descriptor and the table parses or errs.
        let good = small();
        for at in (good.len() - PAGE)..good.len() {
            for v in [0x00u8, 0xff, 0x7f] {
                let mut b = good.clone();
                b[at] = v;
                let _ = Tdvf::parse(&b);
            }
        }
    }
}
