#![allow(clippy::unwrap_used)]
//! The proof-of-work's Merkle tree (`cgx_protocol::merkle`, which the guest links and the GPU
//! kernel's leaves are checked against) and the log's (`tlog_tiles`) are one hashing: the same
//! leaf and node hashes, the same roots at every size, and each one's inclusion proofs verify
//! under the other's checker — so the proof-of-work commitment is an RFC 6962 tree an auditor
//! checks with the log's own code.

use cgx_protocol::merkle;
use cgx_tlog::tree::MemoryTree;

#[test]
fn the_proof_of_works_tree_is_the_logs_tree() {
    let mut log = MemoryTree::new();
    let mut leaves = Vec::new();
    for n in 0..600u64 {
        // Rows of different lengths, as the proof-of-work's and the log's leaves are.
        let row: Vec<u8> = (0..(n % 97)).map(|i| (i * 31 + n) as u8).collect();
        assert_eq!(merkle::leaf_hash(&row), cgx_tlog::record_hash(&row).0);
        log.append(&row).unwrap();
        leaves.push(merkle::leaf_hash(&row));
        let size = n + 1;
        let root = log.root().unwrap();
        assert_eq!(merkle::root(&leaves), root.0, "size {size}");
        // Spot-check proofs both ways at a few sizes (every index).
        if [1, 2, 3, 255, 256, 257, 511, 600].contains(&size) {
            let tree = merkle::Tree::new(leaves.clone());
            for i in 0..size {
                let ours = tree.path(i as usize).unwrap();
                let as_log: Vec<cgx_tlog::Hash> = ours.iter().map(|h| cgx_tlog::Hash(*h)).collect();
                tlog_tiles::check_record(
                    &as_log,
                    size,
                    root,
                    i,
                    cgx_tlog::Hash(leaves[i as usize]),
                )
                .unwrap();
                let theirs = log.prove_inclusion(size, i).unwrap();
                let as_pow: Vec<merkle::Hash> = theirs.iter().map(|h| h.0).collect();
                assert!(merkle::verify_inclusion(
                    &leaves[i as usize],
                    i,
                    size,
                    &as_pow,
                    &root.0
                ));
            }
        }
    }
    let (l, r) = ([1u8; 32], [2u8; 32]);
    assert_eq!(
        merkle::node_hash(&l, &r),
        cgx_tlog::node_hash(cgx_tlog::Hash(l), cgx_tlog::Hash(r)).0
    );
}
