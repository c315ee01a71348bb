//! The Authenticode digest of a PE/COFF image, as the firmware measures an EFI application it
//! starts (`EV_EFI_BOOT_SERVICES_APPLICATION`; a Linux bzImage is one, through its EFI stub).
//!
//! Microsoft's "Windows Authenticode Portable Executable Signature Format", §"Calculating the PE
//! Image Hash", as edk2 implements it (`SecurityPkg/Library/DxeTpm2MeasureBootLib`,
//! `Tcg2MeasurePeImage`): hash the headers up to `SizeOfHeaders` less the optional header's
//! `CheckSum` and the Certificate Table data directory entry (PE/COFF spec §3.4, data directory
//! 4); then each section's raw data, in the order of `PointerToRawData`, skipping empty ones;
//! then whatever follows the sections, less the certificate table's size. Nothing is padded.

use crate::{Error, Result};

/// The PE/COFF limit on sections.
const MAX_SECTIONS: u16 = 96;
/// Data directory index of the Certificate Table (`IMAGE_DIRECTORY_ENTRY_SECURITY`).
const SECURITY: u32 = 4;

fn bad(m: &str) -> Error {
    Error::Parameter(format!(
        "kernel is not a PE/COFF image the firmware can start: {m}"
    ))
}

fn u16_at(b: &[u8], at: usize) -> Result<u16> {
    crate::ovmf::u16_at(b, at).ok_or_else(|| bad("headers truncated"))
}

fn u32_at(b: &[u8], at: usize) -> Result<u32> {
    crate::ovmf::u32_at(b, at).ok_or_else(|| bad("headers truncated"))
}

/// The image's Authenticode SHA-384 (what a TD's firmware measures).
pub fn authenticode_sha384(image: &[u8]) -> Result<[u8; 48]> {
    let d = authenticode(image, &aws_lc_rs::digest::SHA384)?;
    let mut out = [0u8; 48];
    out.copy_from_slice(d.as_ref());
    Ok(out)
}

/// The image's Authenticode SHA-256 (what a signed image's signature covers: a check of these
/// ranges against a real signer's).
pub fn authenticode_sha256(image: &[u8]) -> Result<[u8; 32]> {
    let d = authenticode(image, &aws_lc_rs::digest::SHA256)?;
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    Ok(out)
}

fn authenticode(
    image: &[u8],
    alg: &'static aws_lc_rs::digest::Algorithm,
) -> Result<aws_lc_rs::digest::Digest> {
    if image.get(..2) != Some(b"MZ".as_slice()) {
        return Err(bad("no MZ header"));
    }
    let pe = u32_at(image, 0x3c)? as usize;
    if image.get(pe..pe.saturating_add(4)) != Some(b"PE\0\0".as_slice()) {
        return Err(bad("no PE signature where e_lfanew points"));
    }
    let coff = pe + 4;
    let sections = u16_at(image, coff + 2)?;
    let optional_size = u16_at(image, coff + 16)? as usize;
    let opt = coff + 20;
    let (dirs_count_at, dirs_at) = match u16_at(image, opt)? {
        0x10b => (opt + 92, opt + 96),
        0x20b => (opt + 108, opt + 112),
        m => return Err(bad(&format!("optional header magic {m:#x}"))),
    };
    if sections > MAX_SECTIONS {
        return Err(bad(&format!(
            "{sections} sections (at most {MAX_SECTIONS})"
        )));
    }
    let headers = u32_at(image, opt + 60)? as usize;
    let checksum = opt + 64;
    let dirs = u32_at(image, dirs_count_at)?;
    let cert_dir = (dirs > SECURITY).then_some(dirs_at + 8 * SECURITY as usize);
    let table = opt
        .checked_add(optional_size)
        .ok_or_else(|| bad("optional header size"))?;
    let table_end = table + 40 * sections as usize;
    let header_floor = cert_dir.map_or(checksum + 4, |c| c + 8).max(table_end);
    if headers < header_floor || headers > image.len() {
        return Err(bad(
            "SizeOfHeaders does not cover the headers, or runs past the file",
        ));
    }

    let mut h = aws_lc_rs::digest::Context::new(alg);
    h.update(&image[..checksum]);
    let cert_size = match cert_dir {
        Some(c) => {
            h.update(&image[checksum + 4..c]);
            h.update(&image[c + 8..headers]);
            u32_at(image, c + 4)? as usize
        }
        None => {
            h.update(&image[checksum + 4..headers]);
            0
        }
    };
    let mut raw = Vec::with_capacity(sections as usize);
    for i in 0..sections as usize {
        let at = table + 40 * i;
        let size = u32_at(image, at + 16)? as usize;
        let offset = u32_at(image, at + 20)? as usize;
        if size != 0 {
            raw.push((offset, size));
        }
    }
    // edk2 sorts by PointerToRawData alone, keeping the table's order among equals.
    raw.sort_by_key(|(offset, _)| *offset);
    // Sections of a real image do not overlap, so together they fit the file: this bounds the
    // hashing to the file's size whatever the table says.
    let total = raw
        .iter()
        .fold(0usize, |t, (_, size)| t.saturating_add(*size));
    if total > image.len() - headers {
        return Err(bad("the sections' raw data together exceed the file"));
    }
    let mut hashed = headers;
    for (offset, size) in raw {
        let data = image
            .get(offset..offset.saturating_add(size))
            .ok_or_else(|| bad("a section's raw data runs past the file"))?;
        h.update(data);
        hashed = hashed.saturating_add(size);
    }
    if image.len() > hashed {
        let extra = (image.len() - hashed)
            .checked_sub(cert_size)
            .ok_or_else(|| bad("the certificate table is larger than what follows the sections"))?;
        h.update(&image[hashed..hashed + extra]);
    }
    Ok(h.finish())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::tdx::testing::pe;

    /// The spec's ranges written out by hand: headers less CheckSum and the certificate
    /// directory entry, the sections in file order, the trailer less the certificate table.
    #[test]
    fn hashes_the_ranges_the_spec_names() {
        let img = pe(0x30, 0x40);
        let opt = 0x84 + 20;
        let cert_dir = opt + 112 + 32;
        let expected = crate::sha384(
            &[
                &img[..opt + 64],
                &img[opt + 68..cert_dir],
                &img[cert_dir + 8..0x200],
                &img[0x200..0x600],
                &img[0x600..0x630],
            ]
            .concat(),
        );
        assert_eq!(authenticode_sha384(&img).unwrap(), expected);
        // CheckSum and the certificate table do not count; a byte of a section does.
        let mut other = img.clone();
        other[opt + 64] ^= 1;
        let n = other.len();
        other[n - 1] ^= 1;
        assert_eq!(authenticode_sha384(&other).unwrap(), expected);
        other[0x500] ^= 1;
        assert_ne!(authenticode_sha384(&other).unwrap(), expected);
    }

    #[test]
    fn malformed_images_are_refused_not_panicked_on() {
        assert!(authenticode_sha384(b"").is_err());
        assert!(authenticode_sha384(&[0u8; 4096]).is_err());
        let good = pe(0, 0x10);
        // A section whose raw data starts past the file's end.
        let mut short = good.clone();
        let table = 0x84 + 20 + 240;
        short[table + 20..table + 24].copy_from_slice(&0x1000u32.to_le_bytes());
        assert!(
            authenticode_sha384(&short)
                .unwrap_err()
                .to_string()
                .contains("past the file")
        );
        // Sections that overlap, together larger than the file.
        let mut overlap = good.clone();
        overlap[table + 20..table + 24].copy_from_slice(&0x200u32.to_le_bytes());
        overlap[table + 16..table + 20].copy_from_slice(&0x400u32.to_le_bytes());
        assert!(
            authenticode_sha384(&overlap)
                .unwrap_err()
                .to_string()
                .contains("exceed the file")
        );
        // A certificate table larger than what follows the sections.
        let mut big = good.clone();
        let cert_dir = 0x84 + 20 + 112 + 32;
        big[cert_dir + 4..cert_dir + 8].copy_from_slice(&0x1000u32.to_le_bytes());
        assert!(authenticode_sha384(&big).is_err());
        for at in 0..0x200 {
            for v in [0x00u8, 0xff, 0x7f] {
                let mut b = good.clone();
                b[at] = v;
                let _ = authenticode_sha384(&b);
            }
        }
    }
}
