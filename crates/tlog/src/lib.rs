//! The transparency log's format (issue 33): what the broker and the KBS write and what an
//! auditor reads, with no server.
//!
//! - **Hashing** is RFC 6962 / 9162 (`SHA-256(0x00 ‖ leaf)`, `SHA-256(0x01 ‖ l ‖ r)`), through
//!   `tlog_tiles` (Cloudflare azul's port of Go's `sumdb/tlog`).
//! - **Tiles** are C2SP tlog-tiles: height 8, hash tiles at `tile/<L>/<N>[.p/<W>]` and entry
//!   bundles at `tile/entries/<N>[.p/<W>]` ([`paths`], [`bundle`]).
//! - **Checkpoints** are C2SP tlog-checkpoint bodies in C2SP signed notes, signed with the log's
//!   Ed25519 key ([`note`]).
//! - [`proof`] is C2SP tlog-proof: one leaf's inclusion proof and its checkpoint, checked alone.
//! - [`witness`] is C2SP tlog-witness's `add-checkpoint` decision, for a witness and a log.
//! - [`tree::MemoryTree`] keeps a whole tree's stored hashes; [`dir`] writes a log as a
//!   directory any static server can serve; [`verify`] reads one back and checks everything it
//!   says.
//!
//! Sans-IO but for [`dir`] and [`verify`]'s directory reader: no clock, no network.

pub mod bundle;
pub mod compact;
pub mod dir;
pub mod note;
pub mod paths;
pub mod proof;
pub mod tree;
pub mod verify;
pub mod witness;

/// The crate the format is built on, for what this one does not wrap (stored-hash indexes,
/// `HashReader`).
pub use tlog_tiles;
pub use tlog_tiles::{Checkpoint, Hash, Tile, node_hash, record_hash};

/// Tiles are 2⁸ = 256 hashes wide (C2SP tlog-tiles: "Full tiles MUST be exactly 256 hashes
/// wide").
pub const HEIGHT: u8 = 8;
/// Leaves per full tile.
pub const TILE_WIDTH: u64 = 1 << HEIGHT;
/// The largest leaf: entry bundles prefix each entry with a big-endian `uint16` length.
pub const MAX_LEAF: usize = u16::MAX as usize;
/// The most leaves a log here holds or a reader takes a checkpoint for (2⁴⁸): far past any
/// log's growth, and short of the sizes where `tlog_tiles`' index arithmetic overflows.
pub const MAX_SIZE: u64 = 1 << 48;
/// The highest tile level a log of at most [`MAX_SIZE`] leaves has.
pub const MAX_LEVEL: u8 = 6;

/// The number of leaves below the end of tile `t` (level 0: leaves; above: the leaves under
/// the full tiles it hashes), `None` past [`MAX_SIZE`]: a tile is in a tree of `size` leaves
/// when this is at most `size`.
pub fn tile_reach(t: &Tile) -> Option<u64> {
    let end = t
        .level_index()
        .checked_mul(TILE_WIDTH)?
        .checked_add(u64::from(t.width()))?;
    let reach = end.checked_mul(1u64.checked_shl(u32::from(HEIGHT) * u32::from(t.level()))?)?;
    (reach <= MAX_SIZE).then_some(reach)
}

/// The hash tiles of a tree of `size` leaves (at most [`MAX_SIZE`]), level by level, made as
/// they are asked for (`Tile::new_tiles` builds them all at once).
pub fn tiles_of(size: u64) -> impl Iterator<Item = Tile> {
    let size = size.min(MAX_SIZE);
    (0..=MAX_LEVEL).flat_map(move |l| {
        let below = size >> (u32::from(HEIGHT) * u32::from(l));
        let full = below >> HEIGHT;
        let part = u32::try_from(below % TILE_WIDTH).unwrap_or(0);
        (0..full)
            .map(move |n| Tile::new(HEIGHT, l, n, 1 << HEIGHT, false))
            .chain((part > 0).then(|| Tile::new(HEIGHT, l, full, part, false)))
    })
}

/// Why a log, a tile, a bundle or a checkpoint was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LogError {
    #[error("a leaf of {0} bytes: at most {MAX_LEAF}")]
    LeafTooLarge(usize),
    #[error("not a tile path: {0}")]
    Path(String),
    #[error("entry bundle: {0}")]
    Bundle(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("signed note: {0}")]
    Note(String),
    #[error("key: {0}")]
    Key(String),
    #[error("tree: {0}")]
    Tree(String),
    #[error("leaf {index}: {why}")]
    Leaf { index: u64, why: String },
    #[error("{path}: {why}")]
    Io { path: String, why: String },
}

impl From<tlog_tiles::Error> for LogError {
    fn from(e: tlog_tiles::Error) -> Self {
        LogError::Tree(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn tiles_of_a_size_are_new_tiles_from_empty_and_reach_is_bounded() {
        for size in [0u64, 1, 255, 256, 257, 65_536, 65_537, 70_000, 16_777_217] {
            let ours: Vec<String> = tiles_of(size).map(|t| paths::tile_path(&t)).collect();
            let theirs: Vec<String> = Tile::new_tiles(HEIGHT, 0, size)
                .iter()
                .map(paths::tile_path)
                .collect();
            let (mut a, mut b) = (ours.clone(), theirs);
            a.sort();
            b.sort();
            assert_eq!(a, b, "size {size}");
        }
        assert_eq!(tile_reach(&Tile::new(8, 0, 0, 1, false)), Some(1));
        assert_eq!(tile_reach(&Tile::new(8, 1, 1, 17, false)), Some(273 * 256));
        // The largest tree's top tile, and nothing above it.
        assert_eq!(tile_reach(&Tile::new(8, 6, 0, 1, false)), Some(MAX_SIZE));
        assert_eq!(tile_reach(&Tile::new(8, 7, 0, 1, false)), None);
        assert_eq!(
            tile_reach(&Tile::new(8, 0, u64::MAX >> 8, 256, false)),
            None
        );
        assert_eq!(
            tile_reach(&Tile::new(8, 0, (1 << 56) - 1, 256, false)),
            None
        );
    }
}
