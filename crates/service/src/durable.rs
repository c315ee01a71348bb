//! Files the services keep beside their database (the log's pin, a witness's state, the KBS's
//! version watermarks, an auditor's last checkpoint), each replaced whole: a crash leaves the
//! old contents or the new, never a mix.

/// Replace `path`'s contents with `bytes` atomically and durably (temporary file, fsync,
/// rename, fsync of the directory).
pub fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    // A name of this write's own: two writers never share (and truncate) one temporary file.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp =
        std::path::PathBuf::from(format!("{}.{}.{n}.tmp", path.display(), std::process::id()));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}
