//! Reading a log back, offline: a directory ([`crate::dir`]'s layout) whose checkpoint is
//! checked against the log's key and the witnesses' quorum, whose every tile is authenticated
//! against the checkpoint's root as it is read (`tlog_tiles::TileHashReader`), whose every
//! entry bundle's leaves hash to the level-0 tile's hashes, and whose tree extends the last
//! checkpoint the reader saw.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tlog_tiles::{Hash, Tile, TileHashReader, TileReader};

use crate::note::{NoteKey, Opened, open_checkpoint};
use crate::{HEIGHT, LogError, TILE_WIDTH, bundle, paths};

/// Tiles read from a directory; those `TileHashReader` authenticated are kept (it reads the
/// tree's top tiles again for every batch of hashes).
struct DirTiles {
    root: PathBuf,
    trusted: RefCell<HashMap<String, Vec<u8>>>,
}

impl TileReader for DirTiles {
    fn height(&self) -> u8 {
        HEIGHT
    }

    fn read_tiles(&self, tiles: &[Tile]) -> Result<Vec<Vec<u8>>, tlog_tiles::Error> {
        tiles
            .iter()
            .map(|t| {
                let p = paths::tile_path(t);
                if let Some(d) = self.trusted.borrow().get(&p) {
                    return Ok(d.clone());
                }
                read_capped(&self.root.join(&p), TILE_WIDTH * 32)
                    .map_err(|e| tlog_tiles::Error::InvalidInput(e.to_string()))
            })
            .collect()
    }

    fn save_tiles(&self, tiles: &[Tile], data: &[Vec<u8>]) {
        let mut trusted = self.trusted.borrow_mut();
        for (t, d) in tiles.iter().zip(data) {
            trusted.insert(paths::tile_path(t), d.clone());
        }
    }
}

/// What a verified log holds.
#[derive(Debug)]
pub struct Verified {
    /// The checkpoint verified, as read (what a reader keeps as the last it saw).
    pub note: Vec<u8>,
    pub opened: Opened,
    pub size: u64,
    pub root: Hash,
    /// Every leaf, in order (each checked against the tree).
    pub leaves: Vec<Vec<u8>>,
}

/// The keys a log is checked with.
#[derive(Debug, Clone)]
pub struct Trust {
    pub log: NoteKey,
    pub witnesses: Vec<NoteKey>,
    pub quorum: usize,
}

/// The largest file a log directory holds: an entry bundle of 256 leaves of the largest size.
const MAX_FILE: u64 = TILE_WIDTH * (2 + crate::MAX_LEAF as u64);
/// The largest checkpoint note read (a checkpoint and its cosignatures are a few hundred bytes).
const MAX_NOTE: u64 = 64 << 10;

/// A regular file of at most `max` bytes (a directory handed to the auditor may hold anything:
/// a link to a device, a file that never ends).
fn read_capped(path: &Path, max: u64) -> Result<Vec<u8>, LogError> {
    use std::io::Read as _;
    let err = |why: String| LogError::Io {
        path: path.display().to_string(),
        why,
    };
    let meta = std::fs::symlink_metadata(path).map_err(|e| err(e.to_string()))?;
    if !meta.is_file() {
        return Err(err("not a regular file".into()));
    }
    let mut out = Vec::new();
    std::fs::File::open(path)
        .map_err(|e| err(e.to_string()))?
        .take(max + 1)
        .read_to_end(&mut out)
        .map_err(|e| err(e.to_string()))?;
    if out.len() as u64 > max {
        return Err(err(format!("larger than {max} bytes")));
    }
    Ok(out)
}

fn read(path: &Path) -> Result<Vec<u8>, LogError> {
    read_capped(path, MAX_FILE)
}

/// Verify the log in `dir` under `trust`; `seen`: the last checkpoint this reader verified
/// (signed note), which the log must extend.
pub fn verify_dir(dir: &Path, trust: &Trust, seen: Option<&[u8]>) -> Result<Verified, LogError> {
    verify_dir_with(dir, trust, seen, &mut |_, _| {})
}

/// [`verify_dir`], telling `progress` (leaves read, leaves in all) after each entry bundle: a
/// long run's progress bar.
pub fn verify_dir_with(
    dir: &Path,
    trust: &Trust,
    seen: Option<&[u8]>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Verified, LogError> {
    let note = read_capped(&dir.join("checkpoint"), MAX_NOTE)?;
    let opened = open_checkpoint(&note, &trust.log, &trust.witnesses, trust.quorum)?;
    let size = opened.checkpoint.size();
    if size > crate::MAX_SIZE {
        return Err(LogError::Checkpoint(format!(
            "{size} leaves: more than the {} a log here holds",
            crate::MAX_SIZE
        )));
    }
    let root = *opened.checkpoint.hash();
    let tiles = DirTiles {
        root: dir.to_path_buf(),
        trusted: RefCell::new(HashMap::new()),
    };
    // The checkpoint this reader saw last: (size, root).
    let seen_at = seen
        .map(|s| open_checkpoint(s, &trust.log, &trust.witnesses, 0))
        .transpose()?
        .map(|o| (o.checkpoint.size(), *o.checkpoint.hash()));
    // A rollback is said as one before any tile is read (an older tree's partial tiles may
    // not be served any more).
    if let Some((n, _)) = seen_at
        && n > size
    {
        let now = if size == 0 {
            "empty".to_string()
        } else {
            format!("{size} leaves")
        };
        return Err(LogError::Checkpoint(format!(
            "rolled back: {now}, after a checkpoint of {n} was seen"
        )));
    }
    // Every leaf from its bundle; the tree they make, recomputed here (each leaf hashed once
    // and each inner node once: the cost of a proof per leaf without the proofs), must have
    // the checkpoint's root; every hash tile served must be the tree's; the checkpoint seen
    // before must be the root of the tree's prefix of its size.
    let mut tree = crate::tree::MemoryTree::new();
    for n in 0..size.div_ceil(TILE_WIDTH) {
        let start = n * TILE_WIDTH;
        let width = (size - start).min(TILE_WIDTH);
        let b = paths::bundle_tile(n, u32::try_from(width).unwrap_or(u32::MAX));
        let data = read(&dir.join(paths::tile_path(&b)))?;
        let entries =
            bundle::decode(&data, usize::try_from(width).unwrap_or(usize::MAX)).map_err(|e| {
                LogError::Leaf {
                    index: start,
                    why: format!("{}: {e}", paths::tile_path(&b)),
                }
            })?;
        for (k, entry) in entries.iter().enumerate() {
            tree.append(entry).map_err(|e| LogError::Leaf {
                index: start + k as u64,
                why: e.to_string(),
            })?;
        }
        progress(tree.size(), size);
    }
    if size > 0 && tree.root()? != root {
        // Which leaf: each by its inclusion proof through the served tiles, checked against
        // the checkpoint's root (only the true tree's hashes recompute it, whatever the tiles
        // say).
        return Err(first_excluded(&tiles, &tree, size, root));
    }
    for t in crate::tiles_of(size) {
        let p = paths::tile_path(&t);
        if read(&dir.join(&p))? != tree.tile(&t)? {
            return Err(LogError::Tree(format!(
                "{p} is not the tile of the tree its leaves make"
            )));
        }
    }
    if let Some((n, h)) = seen_at
        && n > 0
        && tree.root_at(n)? != h
    {
        return Err(LogError::Checkpoint(format!(
            "forked: the tree of {size} does not extend the checkpoint of {n} seen"
        )));
    }
    let leaves = tree.into_leaves();
    Ok(Verified {
        note,
        opened,
        size,
        root,
        leaves,
    })
}

/// The first leaf whose inclusion proof from the served tiles does not hold under `root` (the
/// leaves' tree has another root, so one does not).
fn first_excluded(
    tiles: &DirTiles,
    tree: &crate::tree::MemoryTree,
    size: u64,
    root: Hash,
) -> LogError {
    let reader = TileHashReader::new(size, root, tiles);
    for index in 0..size {
        let Some(entry) = tree.leaf(index) else {
            break;
        };
        let included = tlog_tiles::prove_record(size, index, &reader)
            .map_err(|e| e.to_string())
            .and_then(|proof| {
                tlog_tiles::check_record(&proof, size, root, index, crate::record_hash(entry))
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = included {
            return LogError::Leaf {
                index,
                why: format!(
                    "not included in the checkpoint's tree (its entry or a tile was changed): {e}"
                ),
            };
        }
    }
    LogError::Tree("the leaves' tree does not have the checkpoint's root".into())
}

/// The leaves a log directory's entry bundles hold, up to its checkpoint's size, *unverified*
/// (for a fetcher that looks up what leaves name and checks each piece by its hash; an auditor
/// reads leaves only through [`verify_dir`]).
pub fn read_leaves(dir: &Path) -> Result<Vec<Vec<u8>>, LogError> {
    let note = read_capped(&dir.join("checkpoint"), MAX_NOTE)?;
    let size: u64 = String::from_utf8_lossy(&note)
        .lines()
        .nth(1)
        .and_then(|l| l.parse().ok())
        .filter(|n| *n <= crate::MAX_SIZE)
        .ok_or_else(|| LogError::Checkpoint("no size line".into()))?;
    let mut leaves = Vec::new();
    for n in 0..size.div_ceil(TILE_WIDTH) {
        let width = (size - n * TILE_WIDTH).min(TILE_WIDTH);
        let b = paths::bundle_tile(n, u32::try_from(width).unwrap_or(u32::MAX));
        let data = read(&dir.join(paths::tile_path(&b)))?;
        let entries =
            bundle::decode(&data, usize::try_from(width).unwrap_or(usize::MAX)).map_err(|e| {
                LogError::Leaf {
                    index: n * TILE_WIDTH,
                    why: format!("{}: {e}", paths::tile_path(&b)),
                }
            })?;
        leaves.extend(entries.iter().map(|e| e.to_vec()));
    }
    Ok(leaves)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::dir::publish;
    use crate::note::{KeyKind, NoteSigner, sign_checkpoint};
    use crate::tree::MemoryTree;
    use tlog_tiles::Checkpoint;

    fn key() -> Vec<u8> {
        aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .unwrap()
            .as_ref()
            .to_vec()
    }

    fn signed(tree: &MemoryTree, log: &NoteSigner) -> Vec<u8> {
        let cp = Checkpoint::new("log.example/t", tree.size(), tree.root().unwrap(), "").unwrap();
        sign_checkpoint(&cp, log).unwrap()
    }

    fn leaf(i: u64) -> Vec<u8> {
        format!("{{\"leaf\":{i}}}").into_bytes()
    }

    /// A log grown in steps and published after each: it verifies whole, each step extends
    /// the one before; every kind of tampering is caught with its reason.
    #[test]
    fn a_published_log_verifies_and_tampering_is_caught() {
        let dir = std::env::temp_dir().join(format!("cgx-tlog-verify-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let log = NoteSigner::from_pkcs8("log.example/t", KeyKind::Ed25519, &key()).unwrap();
        let trust = Trust {
            log: log.verifier(),
            witnesses: Vec::new(),
            quorum: 0,
        };
        let mut tree = MemoryTree::new();
        let mut seen: Option<Vec<u8>> = None;
        for step in [1u64, 254, 1, 300, 700] {
            let old = tree.size();
            for _ in 0..step {
                tree.append(&leaf(tree.size())).unwrap();
            }
            let note = signed(&tree, &log);
            publish(&dir, &tree, old, &note).unwrap();
            let v = verify_dir(&dir, &trust, seen.as_deref()).unwrap();
            assert_eq!(v.size, tree.size());
            assert_eq!(v.leaves.len() as u64, tree.size());
            assert_eq!(v.leaves[v.leaves.len() - 1], leaf(tree.size() - 1));
            seen = Some(note);
        }
        let seen = seen.unwrap();
        let copy = |name: &str| {
            let d = dir.with_extension(name);
            let _ = std::fs::remove_dir_all(&d);
            std::process::Command::new("cp")
                .arg("-r")
                .arg(&dir)
                .arg(&d)
                .status()
                .unwrap();
            d
        };
        let why =
            |d: &Path, seen: Option<&[u8]>| verify_dir(d, &trust, seen).unwrap_err().to_string();

        // An edited leaf.
        let d = copy("edited");
        let p = d.join("tile/entries/002");
        let mut b = std::fs::read(&p).unwrap();
        b[5] ^= 1;
        std::fs::write(&p, b).unwrap();
        assert!(
            why(&d, None).contains("leaf 512: not included"),
            "{}",
            why(&d, None)
        );
        // A leaf dropped from a bundle.
        let d = copy("dropped");
        let p = d.join("tile/entries/001");
        let b = std::fs::read(&p).unwrap();
        let first = 2 + usize::from(u16::from_be_bytes([b[0], b[1]]));
        std::fs::write(&p, &b[first..]).unwrap();
        assert!(
            why(&d, None).contains("255 entries, the tile says 256"),
            "{}",
            why(&d, None)
        );
        // A full hash tile changed, one `TileHashReader` does not check against its parent
        // here (its frontier hashes share tiles): the proofs through it do not hold.
        let d = copy("tile");
        let p = d.join("tile/0/000");
        let mut t = std::fs::read(&p).unwrap();
        t[0] ^= 1;
        std::fs::write(&p, t).unwrap();
        assert!(
            why(&d, None).contains("tile/0/000 is not the tile"),
            "{}",
            why(&d, None)
        );
        // A checkpoint rolled back to an earlier one of the same log, after a later was seen.
        let d = copy("rolled");
        let mut small = MemoryTree::new();
        small.append(&leaf(0)).unwrap();
        std::fs::write(d.join("checkpoint"), signed(&small, &log)).unwrap();
        assert!(
            why(&d, Some(&seen)).contains("rolled back: 1 leaves"),
            "{}",
            why(&d, Some(&seen))
        );
        // A fork: another history of the same size, signed by the log's key.
        let d = dir.with_extension("fork");
        let _ = std::fs::remove_dir_all(&d);
        let mut other = MemoryTree::new();
        for i in 0..tree.size() {
            other
                .append(&leaf(if i == 3 { 999_999 } else { i }))
                .unwrap();
        }
        publish(&d, &other, 0, &signed(&other, &log)).unwrap();
        assert!(verify_dir(&d, &trust, None).is_ok());
        assert!(
            why(&d, Some(&seen)).contains("forked"),
            "{}",
            why(&d, Some(&seen))
        );
        // A checkpoint signed by another key.
        let d = copy("forged");
        let stranger = NoteSigner::from_pkcs8("log.example/t", KeyKind::Ed25519, &key()).unwrap();
        std::fs::write(d.join("checkpoint"), signed(&tree, &stranger)).unwrap();
        assert!(why(&d, None).contains("signed note"), "{}", why(&d, None));
        // A checkpoint, validly signed, claiming more leaves than any log here holds; an entry
        // bundle that is a link to a device: refused, neither read.
        let d = copy("huge");
        let cp = Checkpoint::new(
            "log.example/t",
            crate::MAX_SIZE + 1,
            tree.root().unwrap(),
            "",
        )
        .unwrap();
        std::fs::write(d.join("checkpoint"), sign_checkpoint(&cp, &log).unwrap()).unwrap();
        assert!(why(&d, None).contains("more than the"), "{}", why(&d, None));
        let d = copy("device");
        std::fs::remove_file(d.join("tile/entries/000")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", d.join("tile/entries/000")).unwrap();
        assert!(
            why(&d, None).contains("not a regular file"),
            "{}",
            why(&d, None)
        );
        for ext in [
            "edited", "dropped", "tile", "rolled", "fork", "forged", "huge", "device",
        ] {
            let _ = std::fs::remove_dir_all(dir.with_extension(ext));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
