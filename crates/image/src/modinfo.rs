//! A kernel module's `.modinfo` section (NUL-separated `key=value` strings, the kernel's
//! `MODULE_INFO`), read from the module's ELF section table: what `modinfo -F depends` prints,
//! without kmod. Only 64-bit little-endian ELF (x86-64 modules); anything else, or a table
//! that points outside the file, is refused.

/// Why a module cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModinfoError {
    #[error("not a 64-bit little-endian ELF file")]
    NotElf,
    #[error("its section table points outside the file")]
    Truncated,
    #[error("it has no .modinfo section")]
    NoModinfo,
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        b.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}
fn u64_at(b: &[u8], at: usize) -> Option<usize> {
    usize::try_from(u64::from_le_bytes(
        b.get(at..at.checked_add(8)?)?.try_into().ok()?,
    ))
    .ok()
}

/// The `.modinfo` strings of an ELF module.
pub fn modinfo(elf: &[u8]) -> Result<Vec<(String, String)>, ModinfoError> {
    if elf.get(..6) != Some(&[0x7f, b'E', b'L', b'F', 2, 1][..]) {
        return Err(ModinfoError::NotElf);
    }
    let t = ModinfoError::Truncated;
    let shoff = u64_at(elf, 0x28).ok_or(t.clone())?;
    let shentsize = u16_at(elf, 0x3a).ok_or(t.clone())? as usize;
    let shnum = u16_at(elf, 0x3c).ok_or(t.clone())? as usize;
    let shstrndx = u16_at(elf, 0x3e).ok_or(t.clone())? as usize;
    if shentsize < 0x28 {
        return Err(t);
    }
    let section = |i: usize| -> Option<(u32, &[u8])> {
        let h = shoff.checked_add(i.checked_mul(shentsize)?)?;
        let name = u32_at(elf, h)?;
        let off = u64_at(elf, h.checked_add(0x18)?)?;
        let size = u64_at(elf, h.checked_add(0x20)?)?;
        Some((name, elf.get(off..off.checked_add(size)?)?))
    };
    let (_, names) = section(shstrndx).ok_or(t.clone())?;
    for i in 0..shnum {
        let (name, data) = section(i).ok_or(t.clone())?;
        let n = names.get(name as usize..).ok_or(t.clone())?;
        if n.split(|&c| c == 0).next() == Some(&b".modinfo"[..]) {
            return Ok(data
                .split(|&c| c == 0)
                .filter_map(|kv| {
                    let s = std::str::from_utf8(kv).ok()?;
                    let (k, v) = s.split_once('=')?;
                    Some((k.to_string(), v.to_string()))
                })
                .collect());
        }
    }
    Err(ModinfoError::NoModinfo)
}

/// The modules a module depends on (`depends=`), by name.
pub fn depends(elf: &[u8]) -> Result<Vec<String>, ModinfoError> {
    Ok(modinfo(elf)?
        .into_iter()
        .filter(|(k, _)| k == "depends")
        .flat_map(|(_, v)| {
            v.split(',')
                .filter(|d| !d.is_empty())
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect())
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A minimal ELF64 with a section-name table and a `.modinfo` section.
    pub(crate) fn elf(modinfo: &[u8]) -> Vec<u8> {
        let shstr = b"\0.shstrtab\0.modinfo\0";
        let mut b = vec![0u8; 64];
        b[..6].copy_from_slice(&[0x7f, b'E', b'L', b'F', 2, 1]);
        let shstr_off = b.len();
        b.extend_from_slice(shstr);
        let mi_off = b.len();
        b.extend_from_slice(modinfo);
        while !b.len().is_multiple_of(8) {
            b.push(0);
        }
        let shoff = b.len();
        for (name, off, size) in [
            (0u32, 0usize, 0usize),
            (1, shstr_off, shstr.len()),
            (11, mi_off, modinfo.len()),
        ] {
            let mut h = vec![0u8; 64];
            h[..4].copy_from_slice(&name.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
            h[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
            b.extend_from_slice(&h);
        }
        b[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        b[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        b[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        b[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        b
    }

    #[test]
    fn depends_are_read_and_broken_files_refused() {
        let m = elf(b"license=GPL\0depends=virtio,virtio_ring\0name=virtio_console\0");
        assert_eq!(depends(&m).unwrap(), ["virtio", "virtio_ring"]);
        assert!(depends(&elf(b"depends=\0")).unwrap().is_empty());
        assert_eq!(depends(b"not elf").unwrap_err(), ModinfoError::NotElf);
        let mut cut = m.clone();
        cut.truncate(200);
        assert_eq!(depends(&cut).unwrap_err(), ModinfoError::Truncated);
        let mut wild = m.clone();
        wild[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(depends(&wild).unwrap_err(), ModinfoError::Truncated);
        // A section table at the very end of the address space, section 0 named: no overflow.
        let mut edge = m.clone();
        edge[0x28..0x30].copy_from_slice(&(u64::MAX - 2).to_le_bytes());
        edge[0x3e..0x40].copy_from_slice(&0u16.to_le_bytes());
        assert_eq!(depends(&edge).unwrap_err(), ModinfoError::Truncated);
        let mut none = elf(b"x");
        let at = none.windows(8).position(|w| w == b".modinfo").unwrap();
        none[at + 1] = b'X';
        assert_eq!(depends(&none).unwrap_err(), ModinfoError::NoModinfo);
    }
}
