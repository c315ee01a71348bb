//! QEMU's SEV hashes table for measured direct kernel boot (QEMU `target/i386/sev.c`,
//! `SevHashTable`; read by OVMF's `BlobVerifierLibSevHashes`): SHA-256 of the kernel, the initrd
//! and the command line, placed in a page the launch measures, so the firmware can refuse any
//! other kernel. All GUIDs are stored as EFI stores them.
//!
//! | offset | field |
//! |---|---|
//! | 0x00 | table GUID `9438d606-4f22-4cc9-b479-a793d411fd21` |
//! | 0x10 | `u16` length of the table (0xA8) |
//! | 0x12 | cmdline entry: GUID `97d02dd8-bd20-4c94-aa78-e7714d36ab2a`, `u16` 0x32, SHA-256 |
//! | 0x44 | initrd entry: GUID `44baf731-3a2f-4bd7-9af1-41e29169781d`, `u16` 0x32, SHA-256 |
//! | 0x76 | kernel entry: GUID `4de79437-abd2-427f-b835-d5b172d2045b`, `u16` 0x32, SHA-256 |
//!
//! The table is zero-padded to a multiple of 16 bytes (0xB0) and sits in its page at the offset
//! the firmware's `SEV_HASH_TABLE_RV_GUID` address has within its page; the rest of the page is
//! zero. The command line is hashed with its terminating NUL (a lone NUL when there is none);
//! a missing initrd hashes as the empty string.

use aws_lc_rs::digest::{SHA256, digest};

use crate::{Error, Result, guid};

const TABLE_GUID: [u8; 16] = guid(
    0x9438_d606,
    0x4f22,
    0x4cc9,
    [0xb4, 0x79, 0xa7, 0x93, 0xd4, 0x11, 0xfd, 0x21],
);
const KERNEL_GUID: [u8; 16] = guid(
    0x4de7_9437,
    0xabd2,
    0x427f,
    [0xb8, 0x35, 0xd5, 0xb1, 0x72, 0xd2, 0x04, 0x5b],
);
const INITRD_GUID: [u8; 16] = guid(
    0x44ba_f731,
    0x3a2f,
    0x4bd7,
    [0x9a, 0xf1, 0x41, 0xe2, 0x91, 0x69, 0x78, 0x1d],
);
const CMDLINE_GUID: [u8; 16] = guid(
    0x97d0_2dd8,
    0xbd20,
    0x4c94,
    [0xaa, 0x78, 0xe7, 0x71, 0x4d, 0x36, 0xab, 0x2a],
);

const ENTRY_LEN: usize = 16 + 2 + 32;
const TABLE_LEN: usize = 16 + 2 + 3 * ENTRY_LEN;
const PADDED_LEN: usize = TABLE_LEN.div_ceil(16) * 16;

/// The three hashes QEMU measures for a directly booted kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SevHashes {
    pub kernel: [u8; 32],
    pub initrd: [u8; 32],
    pub cmdline: [u8; 32],
}

fn sha256(b: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(digest(&SHA256, b).as_ref());
    out
}

impl SevHashes {
    /// From the kernel image, the initrd (if any) and the command line (`-append`, if any).
    pub fn new(kernel: &[u8], initrd: Option<&[u8]>, cmdline: Option<&str>) -> Self {
        let mut c = cmdline.unwrap_or_default().as_bytes().to_vec();
        c.push(0);
        SevHashes {
            kernel: sha256(kernel),
            initrd: sha256(initrd.unwrap_or_default()),
            cmdline: sha256(&c),
        }
    }

    /// The padded table (0xB0 bytes).
    pub fn table(&self) -> [u8; PADDED_LEN] {
        let mut t = [0u8; PADDED_LEN];
        t[..16].copy_from_slice(&TABLE_GUID);
        t[16..18].copy_from_slice(&(TABLE_LEN as u16).to_le_bytes());
        for (i, (g, h)) in [
            (CMDLINE_GUID, &self.cmdline),
            (INITRD_GUID, &self.initrd),
            (KERNEL_GUID, &self.kernel),
        ]
        .into_iter()
        .enumerate()
        {
            let at = 18 + i * ENTRY_LEN;
            t[at..at + 16].copy_from_slice(&g);
            t[at + 16..at + 18].copy_from_slice(&(ENTRY_LEN as u16).to_le_bytes());
            t[at + 18..at + ENTRY_LEN].copy_from_slice(h);
        }
        t
    }

    /// The measured page: the table at `offset`, zeros around it.
    pub fn page(&self, offset: usize) -> Result<[u8; 4096]> {
        if offset + PADDED_LEN > 4096 {
            return Err(Error::Firmware(format!(
                "the SEV hashes table at page offset {offset:#x} would cross its page"
            )));
        }
        let mut p = [0u8; 4096];
        p[offset..offset + PADDED_LEN].copy_from_slice(&self.table());
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        assert_eq!((TABLE_LEN, PADDED_LEN), (0xa8, 0xb0));
        let h = SevHashes::new(b"kernel", None, None);
        assert_eq!(h.cmdline, sha256(b"\0"));
        assert_eq!(h.initrd, sha256(b""));
        let t = h.table();
        assert_eq!(&t[0x76..0x86], &KERNEL_GUID);
        assert_eq!(&t[0x88..0xa8], &sha256(b"kernel"));
        assert!(h.page(0xf60).is_err());
        assert_eq!(&h.page(0xc00).unwrap()[0xc00..0xcb0], &t[..]);
    }
}
