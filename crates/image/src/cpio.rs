//! The initramfs archive: cpio "newc" (the kernel's `Documentation/driver-api/early-userspace/
//! buffer-format.rst`), written so that the same entries give the same bytes — entries in
//! the caller's order, inode numbers counted from 1, every time 0, every owner root.
//!
//! ```text
//! "070701" then 13 fields of 8 hex digits: ino mode uid gid nlink mtime filesize
//! devmajor devminor rdevmajor rdevminor namesize check; the name and its NUL, padded to
//! 4 bytes; the data, padded to 4 bytes. The archive ends with the entry "TRAILER!!!".
//! ```

/// What an entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    Dir,
    File(Vec<u8>),
    /// A character device (major, minor): `/dev/console`, which the kernel opens for init.
    CharDevice(u32, u32),
}

/// One entry: a path without a leading `/`, permission bits, what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub path: String,
    pub perm: u32,
    pub body: Body,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFCHR: u32 = 0o020000;

fn pad4(out: &mut Vec<u8>) {
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

fn header(
    out: &mut Vec<u8>,
    ino: u32,
    mode: u32,
    nlink: u32,
    size: u32,
    rdev: (u32, u32),
    name: &str,
) {
    out.extend_from_slice(b"070701");
    let namesize = name.len() as u32 + 1;
    for v in [
        ino, mode, 0, 0, nlink, 0, size, 0, 0, rdev.0, rdev.1, namesize, 0,
    ] {
        out.extend_from_slice(format!("{v:08x}").as_bytes());
    }
    out.extend_from_slice(name.as_bytes());
    out.push(0);
    pad4(out);
}

/// Why an archive cannot be written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CpioError {
    #[error("{0}: a path is relative, without empty, . or .. parts")]
    Path(String),
    #[error("{0}: over 4 GiB (newc sizes are 32 bits)")]
    TooLarge(String),
    #[error("{0}: twice in the archive")]
    Duplicate(String),
}

/// The archive of `entries`, in their order.
pub fn write(entries: &[Entry]) -> Result<Vec<u8>, CpioError> {
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (i, e) in entries.iter().enumerate() {
        if e.path.is_empty()
            || e.path.starts_with('/')
            || e.path
                .split('/')
                .any(|p| p.is_empty() || p == "." || p == "..")
        {
            return Err(CpioError::Path(e.path.clone()));
        }
        if !seen.insert(e.path.as_str()) {
            return Err(CpioError::Duplicate(e.path.clone()));
        }
        let ino = i as u32 + 1;
        let perm = e.perm & 0o7777;
        match &e.body {
            Body::Dir => header(&mut out, ino, S_IFDIR | perm, 2, 0, (0, 0), &e.path),
            Body::CharDevice(ma, mi) => {
                header(&mut out, ino, S_IFCHR | perm, 1, 0, (*ma, *mi), &e.path)
            }
            Body::File(data) => {
                let size =
                    u32::try_from(data.len()).map_err(|_| CpioError::TooLarge(e.path.clone()))?;
                header(&mut out, ino, S_IFREG | perm, 1, size, (0, 0), &e.path);
                out.extend_from_slice(data);
                pad4(&mut out);
            }
        }
    }
    header(&mut out, 0, 0, 1, 0, (0, 0), "TRAILER!!!");
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Read back with the format's own rules (an independent reader: GNU cpio is not
    /// installed here; the kernel reads the real thing in the QEMU test).
    fn read(mut b: &[u8]) -> Vec<(String, u32, Vec<u8>)> {
        let mut v = Vec::new();
        let mut off = 0usize;
        loop {
            assert_eq!(&b[..6], b"070701");
            let f = |i: usize| {
                u32::from_str_radix(std::str::from_utf8(&b[6 + 8 * i..14 + 8 * i]).unwrap(), 16)
                    .unwrap()
            };
            let (mode, size, namesize) = (f(1), f(6) as usize, f(11) as usize);
            let name = std::str::from_utf8(&b[110..110 + namesize - 1])
                .unwrap()
                .to_string();
            let mut p = 110 + namesize;
            p += (4 - (off + p) % 4) % 4;
            let data = b[p..p + size].to_vec();
            p += size;
            p += (4 - (off + p) % 4) % 4;
            if name == "TRAILER!!!" {
                return v;
            }
            v.push((name, mode, data));
            off += p;
            b = &b[p..];
        }
    }

    #[test]
    fn entries_read_back_and_the_same_entries_give_the_same_bytes() {
        let entries = vec![
            Entry {
                path: "dev".into(),
                perm: 0o755,
                body: Body::Dir,
            },
            Entry {
                path: "dev/console".into(),
                perm: 0o600,
                body: Body::CharDevice(5, 1),
            },
            Entry {
                path: "init".into(),
                perm: 0o755,
                body: Body::File(b"#!agent".to_vec()),
            },
            Entry {
                path: "etc".into(),
                perm: 0o755,
                body: Body::Dir,
            },
            Entry {
                path: "etc/x".into(),
                perm: 0o644,
                body: Body::File(vec![1, 2, 3, 4, 5]),
            },
        ];
        let a = write(&entries).unwrap();
        assert_eq!(a, write(&entries).unwrap());
        assert_eq!(a.len() % 4, 0);
        let back = read(&a);
        assert_eq!(back.len(), 5);
        assert_eq!(back[1], ("dev/console".into(), 0o020600, vec![]));
        assert_eq!(back[2], ("init".into(), 0o100755, b"#!agent".to_vec()));
        assert_eq!(back[4].2, vec![1, 2, 3, 4, 5]);
        for (bad, want) in [
            ("/init", CpioError::Path("/init".into())),
            ("a/../b", CpioError::Path("a/../b".into())),
            ("dev", CpioError::Duplicate("dev".into())),
        ] {
            let mut e = entries.clone();
            e.push(Entry {
                path: bad.into(),
                perm: 0o755,
                body: Body::Dir,
            });
            assert_eq!(write(&e).unwrap_err(), want);
        }
    }
}
