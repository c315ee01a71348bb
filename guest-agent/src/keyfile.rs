//! Private key files the agent reads (the node's TEE key, `--tee-key`): refused when anyone but
//! the owner may access them, as ssh refuses an identity file. A key others can read is a key
//! that another process in the VM (another tenant's workload, a debugging shell) could use to
//! attest as this node and collect its leases' secrets.

use std::io::Read;
use std::path::Path;

/// A PKCS#8 EC or Ed25519 key, DER or PEM, is well under this; the cap comes before reading.
pub const MAX_KEY_FILE: u64 = 64 * 1024;

/// The bytes of the private key file `path`, after checking, on the opened file itself (no
/// window between the check and the read), that it is a regular file of at most
/// [`MAX_KEY_FILE`] bytes and that group and others have no access to it.
pub fn read_private_key(path: &Path) -> Result<Vec<u8>, String> {
    read_private(path, MAX_KEY_FILE)
}

/// [`read_private_key`] for a private file of up to `limit` bytes (a simulated machine's file
/// holds a key set per GPU).
pub fn read_private(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    let shown = path.display();
    let file = std::fs::File::open(path).map_err(|e| format!("key file {shown}: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("key file {shown}: {e}"))?;
    if !meta.is_file() {
        return Err(format!("key file {shown}: not a regular file"));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(format!(
                "key file {shown}: mode {mode:04o} lets group or others access it; refused \
                 (make it private: chmod 600)"
            ));
        }
    }
    if meta.len() > limit {
        return Err(format!(
            "key file {shown}: {} bytes, more than it holds (at most {limit})",
            meta.len()
        ));
    }
    let mut bytes = Vec::new();
    // `take` too: the file may grow between the stat and the read.
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("key file {shown}: {e}"))?;
    if bytes.len() as u64 > limit {
        return Err(format!(
            "key file {shown}: more than it holds (at most {limit} bytes)"
        ));
    }
    Ok(bytes)
}

#[cfg(all(test, unix))]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn modes() {
        let dir = std::env::temp_dir().join(format!("cgx-keyfile-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        let p = dir.join("k.pk8");
        std::fs::write(&p, b"key").unwrap();
        for (mode, ok) in [
            (0o600, true),
            (0o400, true),
            (0o644, false),
            (0o640, false),
            (0o604, false),
            (0o620, false),
        ] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            let r = read_private_key(&p);
            assert_eq!(r.is_ok(), ok, "{mode:o}: {r:?}");
            if !ok {
                assert!(r.unwrap_err().contains("group or others"));
            }
        }
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&p, vec![0u8; MAX_KEY_FILE as usize + 1]).unwrap();
        assert!(
            read_private_key(&p)
                .unwrap_err()
                .contains("more than it holds")
        );
        assert!(
            read_private_key(&dir)
                .unwrap_err()
                .contains("not a regular file")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
