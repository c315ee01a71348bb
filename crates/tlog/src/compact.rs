//! A log's right edge: the roots of the perfect subtrees a tree of `size` leaves splits into
//! (RFC 9162 §2.1.1's split, largest first). A reader that appends leaves to it, one by one,
//! finds the tree's root without keeping the tree — how the broker checks the KBS's log it
//! mirrors against each checkpoint, reading only the entries it has not read yet.

use tlog_tiles::{Hash, node_hash, record_hash};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;

use crate::LogError;

/// The perfect subtrees' roots of a tree of `size` leaves, leftmost (largest) first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Frontier {
    size: u64,
    hashes: Vec<Hash>,
}

impl Frontier {
    pub fn new() -> Frontier {
        Frontier::default()
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Append a leaf.
    pub fn push(&mut self, leaf: &[u8]) {
        let mut h = record_hash(leaf);
        // Each trailing 1 bit of the old size is a subtree of that height the new leaf
        // completes, merged right to left.
        let mut n = self.size;
        while n & 1 == 1 {
            if let Some(left) = self.hashes.pop() {
                h = node_hash(left, h);
            }
            n >>= 1;
        }
        self.hashes.push(h);
        self.size += 1;
    }

    /// The tree's root (the empty tree's: SHA-256 of nothing).
    pub fn root(&self) -> Hash {
        let mut it = self.hashes.iter().rev();
        let Some(last) = it.next() else {
            let d = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, b"");
            let mut h = [0u8; 32];
            h.copy_from_slice(d.as_ref());
            return Hash(h);
        };
        it.fold(*last, |right, left| node_hash(*left, right))
    }

    /// As stored: `size` then each hash, base64, space-separated.
    pub fn to_text(&self) -> String {
        let mut s = self.size.to_string();
        for h in &self.hashes {
            s.push(' ');
            s.push_str(&B64.encode(h.0));
        }
        s
    }

    /// Read back [`Frontier::to_text`]: refused unless the hashes are as many as the size's
    /// 1 bits.
    pub fn from_text(text: &str) -> Result<Frontier, LogError> {
        let bad = |why: &str| LogError::Tree(format!("frontier: {why}"));
        let mut parts = text.split(' ');
        let size: u64 = parts
            .next()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("no size"))?;
        let hashes = parts
            .map(|p| {
                B64.decode(p)
                    .ok()
                    .and_then(|b| <[u8; 32]>::try_from(b).ok())
                    .map(Hash)
                    .ok_or_else(|| bad("a hash is not 32 bytes of base64"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if hashes.len() != size.count_ones() as usize {
            return Err(bad("as many hashes as the size has 1 bits"));
        }
        Ok(Frontier { size, hashes })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::tree::MemoryTree;

    /// The frontier's root is the full tree's at every size (a differential test against the
    /// tree `tlog_tiles` builds), and survives its text form.
    #[test]
    fn the_frontier_root_is_the_trees_at_every_size() {
        let mut tree = MemoryTree::new();
        let mut f = Frontier::new();
        assert_eq!(f.root(), tlog_tiles::tree_hash(0, &tree).unwrap());
        for i in 0..1100u32 {
            let leaf = format!("leaf {i}");
            tree.append(leaf.as_bytes()).unwrap();
            f.push(leaf.as_bytes());
            assert_eq!(
                f.root(),
                tlog_tiles::tree_hash(tree.size(), &tree).unwrap(),
                "size {}",
                i + 1
            );
            assert_eq!(Frontier::from_text(&f.to_text()).unwrap(), f);
        }
        assert!(Frontier::from_text("3 00").is_err());
        assert!(Frontier::from_text("x").is_err());
        assert!(Frontier::from_text(&format!("1 {}", "zz".repeat(32))).is_err());
    }
}
