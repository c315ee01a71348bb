//! The transparency log's format (issue 33): what the broker and the KBS write and what an
//! auditor reads, with no server.
//!
//! - **Hashing** is RFC 6962 / 9162 (`SHA-256(0x00 ‖ leaf)`, `SHA-256(0x01 ‖ l ‖ r)`), through
//!   `tlog_tiles` (Cloudflare azul's port of Go's `sumdb/tlog`).
//! - **Tiles** are C2SP tlog-tiles: height 8, hash tiles at `tile/<L>/<N>[.p/<W>]` and entry
//!   bundles at `tile/entries/<N>[.p/<W>]` ([`paths`], [`bundle`]).
//! - **Checkpoints** are C2SP tlog-checkpoint bodies in C2SP signed notes, signed with the log's
//!   Ed25519 key ([`note`]).
//! - [`tree::MemoryTree`] keeps a whole tree's stored hashes; [`dir`] writes a log as a
//!   directory any static server can serve; [`verify`] reads one back and checks everything it
//!   says.
//!
//! Sans-IO but for [`dir`] and [`verify`]'s directory reader: no clock, no network.

pub mod bundle;
pub mod dir;
pub mod note;
pub mod paths;
pub mod tree;
pub mod verify;

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
