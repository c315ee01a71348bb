//! The launch digest chain (SEV-SNP ABI specification, rev. 1.55, §8.17 `SNP_LAUNCH_UPDATE` and
//! Table 67, "Layout of the PAGE_INFO Structure"): for every page added,
//! `LD' = SHA-384(PAGE_INFO)`, where `PAGE_INFO` (0x70 bytes) is
//!
//! | offset | field |
//! |---|---|
//! | 0x00 | `DIGEST_CUR`: the digest so far (48 bytes) |
//! | 0x30 | `CONTENTS`: SHA-384 of the page for normal and VMSA pages, zero otherwise (48 bytes) |
//! | 0x60 | `LENGTH`: 0x70 (u16) |
//! | 0x62 | `PAGE_TYPE` (u8, Table 68) |
//! | 0x63 | `IMI_PAGE` (u8): 0, the launch is not an import |
//! | 0x64 | `VMPL3_PERMS`, `VMPL2_PERMS`, `VMPL1_PERMS`, reserved (u8 each): 0 |
//! | 0x68 | `GPA` (u64) |
//!
//! The chain starts from 48 zero bytes (or a caller's seed).

use crate::{Error, Result, sha384};

/// Table 68, `PAGE_TYPE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum PageType {
    Normal = 0x01,
    Vmsa = 0x02,
    Zero = 0x03,
    Unmeasured = 0x04,
    Secrets = 0x05,
    Cpuid = 0x06,
}

/// The GPA a VMSA page is recorded at: (u64)-1 page-aligned, bits above 51 clear.
pub const VMSA_GPA: u64 = 0x0000_FFFF_FFFF_F000;

const PAGE: usize = 4096;

/// A launch digest being built.
#[derive(Debug, Clone)]
pub struct LaunchDigest {
    ld: [u8; 48],
}

impl Default for LaunchDigest {
    fn default() -> Self {
        Self::new()
    }
}

impl LaunchDigest {
    pub fn new() -> Self {
        LaunchDigest { ld: [0; 48] }
    }

    pub fn from_seed(seed: [u8; 48]) -> Self {
        LaunchDigest { ld: seed }
    }

    /// The digest so far.
    pub fn digest(&self) -> [u8; 48] {
        self.ld
    }

    /// One `PAGE_INFO` step.
    pub fn update(&mut self, page_type: PageType, gpa: u64, contents: &[u8; 48]) {
        let mut info = [0u8; 0x70];
        info[..0x30].copy_from_slice(&self.ld);
        info[0x30..0x60].copy_from_slice(contents);
        info[0x60..0x62].copy_from_slice(&0x70u16.to_le_bytes());
        info[0x62] = page_type as u8;
        info[0x68..0x70].copy_from_slice(&gpa.to_le_bytes());
        self.ld = sha384(&info);
    }

    /// Normal pages with `data` (whole pages) at `gpa`.
    pub fn normal_pages(&mut self, gpa: u64, data: &[u8]) -> Result<()> {
        whole_pages(data.len() as u64)?;
        for (i, page) in data.chunks_exact(PAGE).enumerate() {
            self.update(PageType::Normal, gpa + (i * PAGE) as u64, &sha384(page));
        }
        Ok(())
    }

    /// One normal page.
    pub fn normal_page(&mut self, gpa: u64, page: &[u8; PAGE]) {
        self.update(PageType::Normal, gpa, &sha384(page));
    }

    pub fn vmsa_page(&mut self, page: &[u8; PAGE]) {
        self.update(PageType::Vmsa, VMSA_GPA, &sha384(page));
    }

    pub fn zero_pages(&mut self, gpa: u64, len: u64) -> Result<()> {
        self.empty_pages(PageType::Zero, gpa, len)
    }

    pub fn unmeasured_pages(&mut self, gpa: u64, len: u64) -> Result<()> {
        self.empty_pages(PageType::Unmeasured, gpa, len)
    }

    pub fn secrets_page(&mut self, gpa: u64) {
        self.update(PageType::Secrets, gpa, &[0; 48]);
    }

    pub fn cpuid_page(&mut self, gpa: u64) {
        self.update(PageType::Cpuid, gpa, &[0; 48]);
    }

    fn empty_pages(&mut self, t: PageType, gpa: u64, len: u64) -> Result<()> {
        whole_pages(len)?;
        for i in 0..len / PAGE as u64 {
            self.update(t, gpa + i * PAGE as u64, &[0; 48]);
        }
        Ok(())
    }
}

fn whole_pages(len: u64) -> Result<()> {
    // Callers bound the pages ([`crate::ovmf::MAX_SECTION_PAGES`] over all sections).
    if !len.is_multiple_of(PAGE as u64) {
        return Err(Error::Firmware(format!(
            "a region of {len:#x} bytes is not whole 4 KiB pages"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_info_layout_and_chaining() {
        let mut ld = LaunchDigest::new();
        ld.update(PageType::Cpuid, 0x1234_5000, &[0; 48]);
        let mut info = [0u8; 0x70];
        info[0x60] = 0x70;
        info[0x62] = 6;
        info[0x68..0x70].copy_from_slice(&0x1234_5000u64.to_le_bytes());
        assert_eq!(ld.digest(), sha384(&info));
        // Order matters: the same pages in another order give another digest.
        let (mut a, mut b) = (LaunchDigest::new(), LaunchDigest::new());
        a.secrets_page(0x1000);
        a.cpuid_page(0x2000);
        b.cpuid_page(0x2000);
        b.secrets_page(0x1000);
        assert_ne!(a.digest(), b.digest());
        assert!(LaunchDigest::new().zero_pages(0, 100).is_err());
    }
}
