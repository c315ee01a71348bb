//! RFC 6962 Merkle trees (RFC 9162 §2.1), SHA-256: the hashing the proof-of-work commits rows
//! with and the transparency log is built on, so one implementation and one set of vectors
//! serve both.
//!
//! - leaf hash `SHA-256(0x00 ‖ d)`, interior node `SHA-256(0x01 ‖ left ‖ right)` — the
//!   prefixes keep a leaf from ever passing for a node;
//! - `MTH(D[n])` splits at `k`, the largest power of two below `n`;
//! - an inclusion proof is RFC 6962's `PATH(m, D[n])`, verified with RFC 9162 §2.1.3.2's
//!   algorithm, which refuses a path of the wrong length for the tree's shape.

use aws_lc_rs::digest::{Context, SHA256};

/// A SHA-256 digest.
pub type Hash = [u8; 32];

fn finish(c: Context) -> Hash {
    let mut out = [0u8; 32];
    out.copy_from_slice(c.finish().as_ref());
    out
}

/// `SHA-256(0x00 ‖ data)`.
pub fn leaf_hash(data: &[u8]) -> Hash {
    let mut c = Context::new(&SHA256);
    c.update(&[0]);
    c.update(data);
    finish(c)
}

/// `SHA-256(0x01 ‖ left ‖ right)`.
pub fn node_hash(left: &Hash, right: &Hash) -> Hash {
    let mut c = Context::new(&SHA256);
    c.update(&[1]);
    c.update(left);
    c.update(right);
    finish(c)
}

/// The largest power of two below `n` (n ≥ 2).
fn split(n: usize) -> usize {
    let mut k = 1;
    while k * 2 < n {
        k *= 2;
    }
    k
}

/// `MTH` of the leaves whose hashes are `leaves` (the empty tree: `SHA-256("")`).
pub fn root(leaves: &[Hash]) -> Hash {
    match leaves.len() {
        0 => finish(Context::new(&SHA256)),
        1 => leaves[0],
        n => {
            let k = split(n);
            node_hash(&root(&leaves[..k]), &root(&leaves[k..]))
        }
    }
}

/// A tree kept whole, level by level, so that every inclusion proof is read rather than
/// recomputed (the prover opens many rows of one tree).
#[derive(Debug, Clone)]
pub struct Tree {
    /// `levels[0]` the leaf hashes; each next level the parents of full pairs, with an odd
    /// last node carried up unchanged (which is RFC 6962's split, bottom up).
    levels: Vec<Vec<Hash>>,
}

impl Tree {
    pub fn new(leaves: Vec<Hash>) -> Tree {
        let mut levels = vec![leaves];
        while levels.last().is_some_and(|l| l.len() > 1) {
            let below = levels.last().map(Vec::as_slice).unwrap_or_default();
            let next = below
                .chunks(2)
                .map(|p| match p {
                    [l, r] => node_hash(l, r),
                    [one] => *one,
                    _ => unreachable_hash(),
                })
                .collect();
            levels.push(next);
        }
        Tree { levels }
    }

    pub fn len(&self) -> usize {
        self.levels.first().map_or(0, Vec::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn root(&self) -> Hash {
        match self.levels.last() {
            Some(top) if top.len() == 1 => top[0],
            _ => root(&[]),
        }
    }

    /// `PATH(index, D[n])`, or `None` for an index outside the tree.
    pub fn path(&self, index: usize) -> Option<Vec<Hash>> {
        if index >= self.len() {
            return None;
        }
        let mut path = Vec::new();
        let mut i = index;
        for level in &self.levels[..self.levels.len() - 1] {
            let sibling = i ^ 1;
            // A node without a sibling (the last, odd one) is carried up: no step.
            if sibling < level.len() {
                path.push(level[sibling]);
            }
            i /= 2;
        }
        Some(path)
    }
}

/// `chunks(2)` yields one or two items; this is never reached (kept total, not panicking).
fn unreachable_hash() -> Hash {
    [0u8; 32]
}

/// Whether `path` proves the leaf hash `leaf` at `index` in a tree of `size` leaves with root
/// `root` (RFC 9162 §2.1.3.2).
pub fn verify_inclusion(leaf: &Hash, index: u64, size: u64, path: &[Hash], root: &Hash) -> bool {
    if index >= size {
        return false;
    }
    let (mut f, mut s) = (index, size - 1);
    let mut r = *leaf;
    for p in path {
        if s == 0 {
            return false;
        }
        if f & 1 == 1 || f == s {
            r = node_hash(p, &r);
            if f & 1 == 0 {
                while f & 1 == 0 && f != 0 {
                    f >>= 1;
                    s >>= 1;
                }
            }
        } else {
            r = node_hash(&r, p);
        }
        f >>= 1;
        s >>= 1;
    }
    s == 0 && r == *root
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn h(s: &str) -> Hash {
        hex::decode(s).unwrap().try_into().unwrap()
    }

    /// The certificate-transparency reference leaves (RFC 6962's test data, as
    /// transparency-dev/merkle publishes them).
    fn ct_leaves() -> Vec<Hash> {
        [
            "",
            "00",
            "10",
            "2021",
            "3031",
            "40414243",
            "5051525354555657",
            "606162636465666768696a6b6c6d6e6f",
        ]
        .iter()
        .map(|x| leaf_hash(&hex::decode(x).unwrap()))
        .collect()
    }

    const CT_ROOTS: [&str; 9] = [
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
        "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
        "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
        "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
        "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
        "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
        "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
        "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
    ];

    #[test]
    fn the_reference_roots_and_paths() {
        let leaves = ct_leaves();
        for (n, want) in CT_ROOTS.iter().enumerate() {
            assert_eq!(root(&leaves[..n]), h(want), "MTH of {n}");
            assert_eq!(
                Tree::new(leaves[..n].to_vec()).root(),
                h(want),
                "Tree of {n}"
            );
        }
        let t = Tree::new(leaves.clone());
        for (index, want) in [
            (
                0,
                [
                    "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
                    "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
                    "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4",
                ],
            ),
            (
                5,
                [
                    "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
                    "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
                    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
                ],
            ),
        ] {
            let path = t.path(index).unwrap();
            assert_eq!(path, want.map(h).to_vec(), "PATH({index}, D[8])");
            assert!(verify_inclusion(
                &leaves[index],
                index as u64,
                8,
                &path,
                &t.root()
            ));
        }
    }

    /// RFC 6962's recursive PATH, written from its definition, for the differential check.
    fn ref_path(m: usize, d: &[Hash]) -> Vec<Hash> {
        if d.len() <= 1 {
            return vec![];
        }
        let k = split(d.len());
        if m < k {
            let mut p = ref_path(m, &d[..k]);
            p.push(root(&d[k..]));
            p
        } else {
            let mut p = ref_path(m - k, &d[k..]);
            p.push(root(&d[..k]));
            p
        }
    }

    #[test]
    fn every_path_of_every_size_verifies_and_nothing_else_does() {
        let leaves: Vec<Hash> = (0u32..70).map(|i| leaf_hash(&i.to_be_bytes())).collect();
        for n in 1..=leaves.len() {
            let t = Tree::new(leaves[..n].to_vec());
            assert_eq!(t.root(), root(&leaves[..n]));
            for m in 0..n {
                let p = t.path(m).unwrap();
                assert_eq!(p, ref_path(m, &leaves[..n]), "PATH({m}, D[{n}])");
                let (m64, n64) = (m as u64, n as u64);
                assert!(verify_inclusion(&leaves[m], m64, n64, &p, &t.root()));
                // Another leaf, a path one step short or long, an index past the size: refused.
                assert!(!verify_inclusion(
                    &leaves[(m + 1) % 70],
                    m64,
                    n64,
                    &p,
                    &t.root()
                ));
                if !p.is_empty() {
                    assert!(!verify_inclusion(&leaves[m], m64, n64, &p[1..], &t.root()));
                }
                let mut longer = p.clone();
                longer.push(t.root());
                assert!(!verify_inclusion(&leaves[m], m64, n64, &longer, &t.root()));
                assert!(!verify_inclusion(&leaves[m], n64, n64, &p, &t.root()));
            }
            assert!(t.path(n).is_none());
        }
        // A leaf hash cannot pass for a node: the prefixes differ.
        assert_ne!(
            leaf_hash(&[leaves[0], leaves[1]].concat()),
            node_hash(&leaves[0], &leaves[1])
        );
    }
}
