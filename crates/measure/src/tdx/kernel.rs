//! The kernel as the firmware sees it in a QEMU direct boot (`-kernel`): QEMU rewrites a few
//! fields of the bzImage's setup header before it hands the image over through fw_cfg, and the
//! firmware measures the rewritten image.
//!
//! QEMU `hw/i386/x86.c`, `x86_load_linux`, for a "high and recent" kernel (boot protocol ≥ 2.02,
//! `LOADED_HIGH`), the only kind a TD boots; fields from the Linux x86 boot protocol
//! (`Documentation/arch/x86/boot.rst`):
//! - `type_of_loader` (0x210) = 0xb0 (QEMU); `loadflags` (0x211) |= `CAN_USE_HEAP` (0x80);
//! - `heap_end_ptr` (0x224, u16) = `cmd_line_ptr − real-mode base − 0x200` = 0xfe00;
//! - `cmd_line_ptr` (0x228) = 0x20000;
//! - with an initrd: `ramdisk_image` (0x218) and `ramdisk_size` (0x21c). The initrd goes at the
//!   top of `initrd_max` (u32::MAX where `xloadflags` (0x236) has `XLF_CAN_BE_LOADED_ABOVE_4G`,
//!   else `initrd_addr_max` (0x22c)), capped below the low memory less QEMU's ACPI data
//!   (0x28000 bytes), page aligned down. On q35 low memory is all of RAM below 2.75 GiB, and
//!   2 GiB from 2.75 GiB of RAM up.

use crate::{Error, Result};

/// What QEMU's q35 reserves at the top of low memory for ACPI data (`acpi_data_size`).
pub const ACPI_DATA_SIZE: u64 = 0x28000;

const HDRS: &[u8; 4] = b"HdrS";
const LOADED_HIGH: u8 = 0x01;
const CAN_USE_HEAP: u8 = 0x80;
const XLF_CAN_BE_LOADED_ABOVE_4G: u16 = 1 << 1;

/// Low memory on QEMU's q35 for `memory` bytes of RAM (`pc_q35_init`).
pub fn below_4g(memory: u64) -> u64 {
    let lowmem = if memory >= 0xb000_0000 {
        0x8000_0000
    } else {
        0xb000_0000
    };
    memory.min(lowmem)
}

/// The bzImage with QEMU's setup-header changes, for `initrd_len` bytes of initrd (0: none) in
/// a guest of `memory` bytes.
pub fn qemu_patched(kernel: &[u8], initrd_len: u64, memory: u64) -> Result<Vec<u8>> {
    let bad = |m: String| Error::Parameter(format!("kernel: {m}"));
    if kernel.len() < 0x1000 || kernel.get(0x202..0x206) != Some(HDRS.as_slice()) {
        return Err(bad("not a bzImage (no HdrS setup header)".into()));
    }
    let u16_at = |at: usize| u16::from_le_bytes([kernel[at], kernel[at + 1]]);
    let protocol = u16_at(0x206);
    if protocol < 0x202 || kernel[0x211] & LOADED_HIGH == 0 {
        return Err(Error::Unsupported(format!(
            "boot protocol {}.{:02} without LOADED_HIGH: QEMU loads such kernels low, which no \
             TD boots",
            protocol >> 8,
            protocol & 0xff
        )));
    }
    let mut k = kernel.to_vec();
    let (real_addr, cmdline_addr) = (0x10000u32, 0x20000u32);
    k[0x210] = 0xb0;
    k[0x211] |= CAN_USE_HEAP;
    let heap_end = (cmdline_addr - real_addr - 0x200) as u16;
    k[0x224..0x226].copy_from_slice(&heap_end.to_le_bytes());
    k[0x228..0x22c].copy_from_slice(&cmdline_addr.to_le_bytes());
    if initrd_len > 0 {
        let mut initrd_max: u64 =
            if protocol >= 0x20c && u16_at(0x236) & XLF_CAN_BE_LOADED_ABOVE_4G != 0 {
                u64::from(u32::MAX)
            } else if protocol >= 0x203 {
                u64::from(u32::from_le_bytes([k[0x22c], k[0x22d], k[0x22e], k[0x22f]]))
            } else {
                0x37ff_ffff
            };
        let low = below_4g(memory)
            .checked_sub(ACPI_DATA_SIZE)
            .ok_or_else(|| bad(format!("{memory} bytes of memory is too little")))?;
        if initrd_max >= low {
            initrd_max = low.saturating_sub(1);
        }
        if initrd_len >= initrd_max {
            return Err(bad(format!(
                "an initrd of {initrd_len} bytes does not fit below {initrd_max:#x}"
            )));
        }
        let addr = (initrd_max - initrd_len) & !0xfff;
        // Both fit in 32 bits: initrd_max does.
        k[0x218..0x21c].copy_from_slice(&(addr as u32).to_le_bytes());
        k[0x21c..0x220].copy_from_slice(&(initrd_len as u32).to_le_bytes());
    }
    Ok(k)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::tdx::testing::bzimage;

    fn u32_at(k: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(k[at..at + 4].try_into().unwrap())
    }

    /// Expectations worked out by hand from QEMU's `x86_load_linux`.
    #[test]
    fn patches_the_setup_header_as_qemu_does() {
        let k = bzimage(XLF_CAN_BE_LOADED_ABOVE_4G);
        // 2 GiB of RAM: low memory is all of it; initrd_max = 2 GiB − 0x28000 − 1.
        let p = qemu_patched(&k, 0x10_0000, 2 << 30).unwrap();
        assert_eq!(p[0x210], 0xb0);
        assert_eq!(p[0x211], LOADED_HIGH | CAN_USE_HEAP);
        assert_eq!(&p[0x224..0x226], &[0x00, 0xfe]);
        assert_eq!(u32_at(&p, 0x228), 0x20000);
        assert_eq!(u32_at(&p, 0x218), 0x7fed_7000);
        assert_eq!(u32_at(&p, 0x21c), 0x10_0000);
        // 16 GiB: low memory is 2 GiB too, so the same address.
        let q = qemu_patched(&k, 0x10_0000, 16 << 30).unwrap();
        assert_eq!(p, q);
        // 2.5 GiB: low memory is all 2.5 GiB.
        let r = qemu_patched(&k, 0x10_0000, 0xa000_0000).unwrap();
        assert_eq!(u32_at(&r, 0x218), 0x9fed_7000);
        // Without XLF_CAN_BE_LOADED_ABOVE_4G the header's initrd_addr_max (2 GiB − 1) rules.
        let s = qemu_patched(&bzimage(0), 0x10_0000, 0xa000_0000).unwrap();
        assert_eq!(u32_at(&s, 0x218), 0x7fef_f000);
        // No initrd: the ramdisk fields stay as they were.
        let t = qemu_patched(&k, 0, 2 << 30).unwrap();
        assert_eq!(u32_at(&t, 0x218), 0);
        // Only the fields named change.
        let changed: Vec<usize> = (0..k.len()).filter(|&i| k[i] != p[i]).collect();
        assert!(
            changed.iter().all(|i| (0x210..0x230).contains(i)),
            "{changed:x?}"
        );
    }

    #[test]
    fn kernels_qemu_would_not_boot_in_a_td_are_refused() {
        assert!(qemu_patched(&[0u8; 0x2000], 0, 1 << 30).is_err());
        let mut old = bzimage(0);
        old[0x206..0x208].copy_from_slice(&0x0201u16.to_le_bytes());
        assert!(matches!(
            qemu_patched(&old, 0, 1 << 30),
            Err(Error::Unsupported(_))
        ));
        let k = bzimage(XLF_CAN_BE_LOADED_ABOVE_4G);
        assert!(qemu_patched(&k, 0x1_0000, 0x1_0000).is_err());
        assert!(qemu_patched(&k, 3 << 30, 2 << 30).is_err());
    }
}
