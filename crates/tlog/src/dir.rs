//! A log as a directory, laid out as C2SP tlog-tiles serves it (`checkpoint`, `tile/<L>/<N>`,
//! `tile/entries/<N>`): any static web server or object store can serve it, and the auditor
//! reads it offline ([`crate::verify`]).

use std::path::Path;

use tlog_tiles::Tile;

use crate::tree::MemoryTree;
use crate::{HEIGHT, LogError, paths};

fn io(path: &Path, e: std::io::Error) -> LogError {
    LogError::Io {
        path: path.display().to_string(),
        why: e.to_string(),
    }
}

/// Write `bytes` at `path` whole or not at all: a temporary file beside it, synced, renamed.
fn put(path: &Path, bytes: &[u8]) -> Result<(), LogError> {
    use std::io::Write as _;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| io(&tmp, e))?;
    f.sync_all().map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))
}

/// Publish the tree grown from `old` leaves to its size into `dir`: the hash tiles and entry
/// bundles that changed, then `checkpoint` (the signed note of the new size) — last, so a
/// reader never finds a checkpoint whose tiles are not there yet. Partial tiles of earlier
/// sizes stay (readers of the checkpoints that named them still need them). The files written.
pub fn publish(
    dir: &Path,
    tree: &MemoryTree,
    old: u64,
    checkpoint: &[u8],
) -> Result<usize, LogError> {
    if old > tree.size() {
        return Err(LogError::Tree(format!(
            "cannot publish from {old} leaves: the tree holds {}",
            tree.size()
        )));
    }
    let mut written = 0;
    for t in Tile::new_tiles(HEIGHT, old, tree.size()) {
        put(&dir.join(paths::tile_path(&t)), &tree.tile(&t)?)?;
        written += 1;
        if t.level() == 0 {
            let b = paths::bundle_tile(t.level_index(), t.width());
            put(&dir.join(paths::tile_path(&b)), &tree.bundle(&b)?)?;
            written += 1;
        }
    }
    put(&dir.join("checkpoint"), checkpoint)?;
    Ok(written + 1)
}
