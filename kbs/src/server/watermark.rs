//! The newest sealed version of each resource this KBS has opened or written — its high-water
//! marks — kept in memory and, when configured, in a file beside the KBS and outside the
//! database, MAC'd under a key derived from the KEK.
//!
//! The version sits in each sealed value's AAD, so nobody without the KEK can change it; but
//! someone who can write the database (a restored backup) can put back an older sealed value
//! whole. A replica refuses a version older than its mark. Kept in memory only, the marks die
//! with the process and a rollback made while the KBS was down would pass; the file carries
//! them across restarts. A replica started without the file knows nothing yet (it learns as it
//! reads): what closes that gap is a trusted counter outside every replica.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use aws_lc_rs::hmac;

use super::error::KbsError;

/// The `info` of the file's MAC key ([`super::keys::mac_key`]).
const MAC_INFO: &[u8] = b"version-marks/v1";

#[derive(serde::Serialize, serde::Deserialize)]
struct File {
    versions: BTreeMap<String, u64>,
    /// HMAC-SHA-256 (hex) of the canonical JSON of `versions`.
    mac: String,
}

#[derive(Debug)]
pub(crate) struct Watermarks {
    file: Option<PathBuf>,
    key: hmac::Key,
    marks: Mutex<HashMap<String, u64>>,
    /// Versions handed out for writes not yet committed: two writes of one path on this replica
    /// never get the same version.
    reserved: Mutex<HashMap<String, u64>>,
}

fn mac_of(key: &hmac::Key, versions: &BTreeMap<String, u64>) -> Result<String, KbsError> {
    let body = serde_json::to_vec(versions).map_err(|e| KbsError::Internal(e.to_string()))?;
    Ok(hex::encode(hmac::sign(key, &body)))
}

impl Watermarks {
    /// Marks held in memory only.
    pub(crate) fn in_memory(kek: &[u8; 32]) -> Self {
        Watermarks {
            file: None,
            key: super::keys::mac_key(kek, MAC_INFO),
            marks: Mutex::new(HashMap::new()),
            reserved: Mutex::new(HashMap::new()),
        }
    }

    /// Marks kept in `file` too: read now (a file whose MAC does not verify under this KEK is
    /// refused — someone edited it, or it belongs to another KBS), rewritten on every rise.
    pub(crate) fn in_file(kek: &[u8; 32], file: &Path) -> Result<Self, KbsError> {
        let mut w = Self::in_memory(kek);
        match std::fs::read(file) {
            Ok(bytes) => {
                let f: File = serde_json::from_slice(&bytes).map_err(|e| {
                    KbsError::Config(format!("version watermarks {}: {e}", file.display()))
                })?;
                let body = serde_json::to_vec(&f.versions)
                    .map_err(|e| KbsError::Internal(e.to_string()))?;
                let ok = hex::decode(&f.mac)
                    .ok()
                    .is_some_and(|m| hmac::verify(&w.key, &body, &m).is_ok());
                if !ok {
                    return Err(KbsError::Config(format!(
                        "version watermarks {}: the MAC does not verify under this KEK (edited, \
                         or another KBS's file)",
                        file.display()
                    )));
                }
                w.marks = Mutex::new(f.versions.into_iter().collect());
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(KbsError::Config(format!(
                    "version watermarks {}: {e}",
                    file.display()
                )));
            }
        }
        w.file = Some(file.to_path_buf());
        {
            // Written at once: a path that cannot be written is a start-up error, not a
            // surprise at the first release.
            let marks = w.lock()?;
            w.persist(&marks)?;
        }
        Ok(w)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, HashMap<String, u64>>, KbsError> {
        self.marks
            .lock()
            .map_err(|_| KbsError::Internal("version watermarks lock".into()))
    }

    /// The mark of `path` (0: none).
    pub(crate) fn get(&self, path: &str) -> Result<u64, KbsError> {
        Ok(self.lock()?.get(path).copied().unwrap_or(0))
    }

    /// A version for a new write of `path`: past its mark, past any version this replica has
    /// handed out for it, and at least `floor` (the clock, so replicas that never read each
    /// other's writes still move forward).
    pub(crate) fn reserve(&self, path: &str, floor: u64) -> Result<u64, KbsError> {
        let mark = self.get(path)?;
        let mut reserved = self
            .reserved
            .lock()
            .map_err(|_| KbsError::Internal("version reservations lock".into()))?;
        let last = reserved.get(path).copied().unwrap_or(0);
        let v = mark.max(last).saturating_add(1).max(floor);
        if reserved.len() > 100_000 {
            reserved.clear(); // only same-replica races need it; the marks carry the rest
        }
        reserved.insert(path.to_string(), v);
        Ok(v)
    }

    /// `version` of `path` was just read: refused when older than the mark; otherwise the
    /// mark rises to it, kept on disk before the value is used (a mark that could not be kept
    /// is not raised, and the read fails).
    pub(crate) fn observe(&self, path: &str, version: u64) -> Result<(), KbsError> {
        let mut marks = self.lock()?;
        let mark = marks.get(path).copied().unwrap_or(0);
        if version < mark {
            return Err(KbsError::Storage(format!(
                "{path} is version {version}, older than the {mark} this KBS has read: rolled back"
            )));
        }
        if version > mark {
            let old = marks.insert(path.to_string(), version);
            if let Err(e) = self.persist(&marks) {
                match old {
                    Some(o) => marks.insert(path.to_string(), o),
                    None => marks.remove(path),
                };
                return Err(e);
            }
        }
        Ok(())
    }

    /// Write the marks: a temporary file, synced, renamed over the old one.
    fn persist(&self, marks: &HashMap<String, u64>) -> Result<(), KbsError> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        let versions: BTreeMap<String, u64> = marks.iter().map(|(k, v)| (k.clone(), *v)).collect();
        let mac = mac_of(&self.key, &versions)?;
        let body = serde_json::to_vec(&File { versions, mac })
            .map_err(|e| KbsError::Internal(e.to_string()))?;
        cgx_service::durable::write_atomic(file, &body).map_err(|e| {
            KbsError::Storage(format!("version watermarks {}: {e}", file.display()))
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn marks_survive_a_restart_and_refuse_edits() {
        let dir = std::env::temp_dir().join(format!("cgx-wm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("versions.json");
        let kek = [5u8; 32];
        let w = Watermarks::in_file(&kek, &file).unwrap();
        w.observe("a/b/c", 10).unwrap();
        w.observe("a/b/c", 12).unwrap();
        assert!(w.observe("a/b/c", 11).is_err());
        drop(w);
        // A restart reads the mark back.
        let w = Watermarks::in_file(&kek, &file).unwrap();
        assert_eq!(w.get("a/b/c").unwrap(), 12);
        assert!(w.observe("a/b/c", 10).is_err());
        drop(w);
        // Lowering the mark in the file breaks its MAC; another KEK does not verify it either.
        let text = std::fs::read_to_string(&file).unwrap().replace("12", "1");
        std::fs::write(&file, text).unwrap();
        assert!(Watermarks::in_file(&kek, &file).is_err());
        let w = Watermarks::in_memory(&kek);
        assert_eq!(w.get("a/b/c").unwrap(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
