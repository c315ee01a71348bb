//! A whole tree in memory: every stored hash (Go sumdb's layout: the hashes of each complete
//! subtree, in the order they complete) and every leaf. The log writers keep the same hashes in
//! their databases; this one serves the exporter, the auditor's replay and the tests.

use tlog_tiles::{Hash, HashReader, RecordProof, Tile, TreeProof};

use crate::{HEIGHT, LogError, MAX_LEAF, bundle, paths};

/// A tree of leaves and its stored hashes.
#[derive(Debug, Default, Clone)]
pub struct MemoryTree {
    hashes: Vec<Hash>,
    leaves: Vec<Vec<u8>>,
}

impl HashReader for MemoryTree {
    fn read_hashes(&self, indexes: &[u64]) -> Result<Vec<Hash>, tlog_tiles::Error> {
        indexes
            .iter()
            .map(|&i| {
                usize::try_from(i)
                    .ok()
                    .and_then(|i| self.hashes.get(i))
                    .copied()
                    .ok_or(tlog_tiles::Error::IndexesNotInTree)
            })
            .collect()
    }
}

impl MemoryTree {
    pub fn new() -> MemoryTree {
        MemoryTree::default()
    }

    /// Leaves in the tree.
    pub fn size(&self) -> u64 {
        self.leaves.len() as u64
    }

    /// Leaf `i`.
    pub fn leaf(&self, i: u64) -> Option<&[u8]> {
        usize::try_from(i)
            .ok()
            .and_then(|i| self.leaves.get(i))
            .map(Vec::as_slice)
    }

    /// Append a leaf: its index.
    pub fn append(&mut self, leaf: &[u8]) -> Result<u64, LogError> {
        if leaf.len() > MAX_LEAF {
            return Err(LogError::LeafTooLarge(leaf.len()));
        }
        let n = self.size();
        let new = tlog_tiles::stored_hashes(n, leaf, self)?;
        self.hashes.extend(new);
        self.leaves.push(leaf.to_vec());
        Ok(n)
    }

    /// The root of the first `size` leaves.
    pub fn root_at(&self, size: u64) -> Result<Hash, LogError> {
        if size > self.size() {
            return Err(LogError::Tree(format!(
                "no tree of {size} leaves (the tree holds {})",
                self.size()
            )));
        }
        Ok(tlog_tiles::tree_hash(size, self)?)
    }

    /// The root of the whole tree.
    pub fn root(&self) -> Result<Hash, LogError> {
        self.root_at(self.size())
    }

    /// Leaf `index`'s inclusion proof in the tree of `size` leaves.
    pub fn prove_inclusion(&self, size: u64, index: u64) -> Result<RecordProof, LogError> {
        if index >= size || size > self.size() {
            return Err(LogError::Tree(format!(
                "leaf {index} is not in a tree of {size} (the tree holds {})",
                self.size()
            )));
        }
        Ok(tlog_tiles::prove_record(size, index, self)?)
    }

    /// The proof that the tree of `old` leaves is a prefix of the tree of `size`.
    pub fn prove_consistency(&self, size: u64, old: u64) -> Result<TreeProof, LogError> {
        if old == 0 || old > size || size > self.size() {
            return Err(LogError::Tree(format!(
                "no consistency proof from {old} to {size} (the tree holds {})",
                self.size()
            )));
        }
        Ok(tlog_tiles::prove_tree(size, old, self)?)
    }

    /// Its leaves, the tree given up.
    pub fn into_leaves(self) -> Vec<Vec<u8>> {
        self.leaves
    }

    /// A hash tile's bytes.
    pub fn tile(&self, t: &Tile) -> Result<Vec<u8>, LogError> {
        Ok(t.read_data(self)?)
    }

    /// An entry bundle's bytes (`t` a data tile, [`paths::bundle_tile`]).
    pub fn bundle(&self, t: &Tile) -> Result<Vec<u8>, LogError> {
        let start = t.level_index() << HEIGHT;
        let end = start + u64::from(t.width());
        if !t.is_data() || end > self.size() {
            return Err(LogError::Tree(format!(
                "no entry bundle {} in a tree of {}",
                paths::tile_path(t),
                self.size()
            )));
        }
        let leaves: Vec<&[u8]> = (start..end).filter_map(|i| self.leaf(i)).collect();
        bundle::encode(&leaves)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Certificate Transparency's reference tree (RFC 6962's test data, as Go's and
    /// Trillian's tests use it): its roots at sizes 1–8.
    const LEAVES: [&[u8]; 8] = [
        b"",
        b"\x00",
        b"\x10",
        b"\x20\x21",
        b"\x30\x31",
        b"\x40\x41\x42\x43",
        b"\x50\x51\x52\x53\x54\x55\x56\x57",
        b"\x60\x61\x62\x63\x64\x65\x66\x67\x68\x69\x6a\x6b\x6c\x6d\x6e\x6f",
    ];
    const ROOTS: [&str; 8] = [
        "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
        "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
        "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
        "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
        "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
        "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
    ];

    fn hex(h: &Hash) -> String {
        h.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn the_reference_roots_and_every_proof() {
        let mut t = MemoryTree::new();
        for (i, leaf) in LEAVES.iter().enumerate() {
            assert_eq!(t.append(leaf).unwrap(), i as u64);
            assert_eq!(hex(&t.root().unwrap()), ROOTS[i], "size {}", i + 1);
        }
        for size in 1..=8u64 {
            let root = t.root_at(size).unwrap();
            for i in 0..size {
                let p = t.prove_inclusion(size, i).unwrap();
                let h = crate::record_hash(LEAVES[i as usize]);
                tlog_tiles::check_record(&p, size, root, i, h).unwrap();
                // Another leaf's hash does not verify at this index.
                let other = crate::record_hash(b"not a leaf");
                assert!(tlog_tiles::check_record(&p, size, root, i, other).is_err());
            }
            for old in 1..=size {
                let p = t.prove_consistency(size, old).unwrap();
                tlog_tiles::check_tree(&p, size, root, old, t.root_at(old).unwrap()).unwrap();
            }
        }
        assert!(t.prove_inclusion(8, 8).is_err());
        assert!(t.prove_consistency(9, 1).is_err());
        assert!(t.append(&vec![0; MAX_LEAF + 1]).is_err());
        assert_eq!(t.size(), 8);
    }
}
