//! C2SP tlog-proof (`c2sp.org/tlog-proof@v1`): one leaf's inclusion proof with the checkpoint it
//! is proven against, in one file an auditor hands to anyone, who checks it alone
//! (`cgx audit proof`, `cgx audit verify-proof`). The leaf itself travels in the `extra` line
//! (the spec's "additional data necessary to reconstruct the record hash"): it is hashed, so
//! a changed leaf fails the proof.
//!
//! ```text
//! c2sp.org/tlog-proof@v1
//! extra <base64 of the leaf>
//! index <n>
//! <base64 hash>            (the inclusion proof, the leaf's sibling first)
//! …
//!
//! <the checkpoint, a signed note, verbatim with its cosignatures>
//! ```

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;

use crate::note::{NoteKey, Opened, open_checkpoint};
use crate::{Hash, LogError};

const HEADER: &str = "c2sp.org/tlog-proof@v1";
/// The largest proof file read (a leaf of at most 65 535 bytes in base64, 63 hashes, a note).
pub const MAX_PROOF_FILE: usize = 128 * 1024;

/// A leaf's proof of inclusion and its checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct TlogProof {
    /// The leaf.
    pub extra: Option<Vec<u8>>,
    pub index: u64,
    pub hashes: Vec<Hash>,
    /// The signed checkpoint.
    pub checkpoint: Vec<u8>,
}

impl TlogProof {
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = format!("{HEADER}\n").into_bytes();
        if let Some(e) = &self.extra {
            out.extend_from_slice(format!("extra {}\n", B64.encode(e)).as_bytes());
        }
        out.extend_from_slice(format!("index {}\n", self.index).as_bytes());
        for h in &self.hashes {
            out.extend_from_slice(format!("{}\n", B64.encode(h.0)).as_bytes());
        }
        out.push(b'\n');
        out.extend_from_slice(&self.checkpoint);
        out
    }

    /// Parse a proof file: refused, with why, when it is not one.
    pub fn parse(bytes: &[u8]) -> Result<TlogProof, LogError> {
        let bad = |why: &str| LogError::Tree(format!("not a tlog-proof: {why}"));
        if bytes.len() > MAX_PROOF_FILE {
            return Err(bad("too large"));
        }
        let split = bytes
            .windows(2)
            .position(|w| w == b"\n\n")
            .ok_or_else(|| bad("no empty line before the checkpoint"))?;
        let head = std::str::from_utf8(&bytes[..=split]).map_err(|_| bad("not text"))?;
        let checkpoint = bytes[split + 2..].to_vec();
        let mut lines = head.lines().peekable();
        if lines.next() != Some(HEADER) {
            return Err(bad("the first line is not c2sp.org/tlog-proof@v1"));
        }
        let extra = match lines.peek().and_then(|l| l.strip_prefix("extra ")) {
            Some(e) => {
                let e = B64.decode(e).map_err(|_| bad("extra is not base64"))?;
                lines.next();
                Some(e)
            }
            None => None,
        };
        let index = lines
            .next()
            .and_then(|l| l.strip_prefix("index "))
            .filter(|n| {
                !n.is_empty()
                    && n.bytes().all(|b| b.is_ascii_digit())
                    && (n.len() == 1 || !n.starts_with('0'))
            })
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| bad("no `index <n>` line"))?;
        let mut hashes = Vec::new();
        for l in lines {
            if hashes.len() == 63 {
                return Err(bad("more than 63 hashes"));
            }
            let h = B64
                .decode(l)
                .ok()
                .and_then(|b| <[u8; 32]>::try_from(b).ok())
                .ok_or_else(|| bad("a proof line is not a base64 hash"))?;
            hashes.push(Hash(h));
        }
        Ok(TlogProof {
            extra,
            index,
            hashes,
            checkpoint,
        })
    }

    /// Check it alone: the checkpoint under the log's key (and `quorum` of `witnesses`), and
    /// the leaf (`extra`) included at `index` in its tree. The checkpoint opened.
    pub fn verify(
        &self,
        log: &NoteKey,
        witnesses: &[NoteKey],
        quorum: usize,
    ) -> Result<Opened, LogError> {
        let opened = open_checkpoint(&self.checkpoint, log, witnesses, quorum)?;
        let leaf = self
            .extra
            .as_deref()
            .ok_or_else(|| LogError::Tree("the proof carries no leaf (extra)".into()))?;
        let size = opened.checkpoint.size();
        if self.index >= size {
            return Err(LogError::Leaf {
                index: self.index,
                why: format!("not in a tree of {size} leaves"),
            });
        }
        tlog_tiles::check_record(
            &self.hashes,
            size,
            *opened.checkpoint.hash(),
            self.index,
            crate::record_hash(leaf),
        )
        .map_err(|_| LogError::Leaf {
            index: self.index,
            why: "not included in the checkpoint's tree (the leaf or the proof was changed)".into(),
        })?;
        Ok(opened)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::note::{KeyKind, NoteSigner, sign_checkpoint};
    use crate::tree::MemoryTree;

    #[test]
    fn a_proof_checks_alone_and_any_change_refuses_it() {
        let key = NoteSigner::from_pkcs8(
            "log.test/p",
            KeyKind::Ed25519,
            aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(
                &aws_lc_rs::rand::SystemRandom::new(),
            )
            .unwrap()
            .as_ref(),
        )
        .unwrap();
        let mut tree = MemoryTree::new();
        for i in 0..1000u64 {
            tree.append(format!("leaf {i}").as_bytes()).unwrap();
        }
        let cp = crate::Checkpoint::new("log.test/p", 1000, tree.root().unwrap(), "").unwrap();
        let note = sign_checkpoint(&cp, &key).unwrap();
        let p = TlogProof {
            extra: Some(b"leaf 777".to_vec()),
            index: 777,
            hashes: tree.prove_inclusion(1000, 777).unwrap(),
            checkpoint: note,
        };
        let bytes = p.to_bytes();
        assert!(bytes.starts_with(b"c2sp.org/tlog-proof@v1\nextra "));
        let back = TlogProof::parse(&bytes).unwrap();
        assert_eq!(back, p);
        assert_eq!(
            back.verify(&key.verifier(), &[], 0)
                .unwrap()
                .checkpoint
                .size(),
            1000
        );
        // Another leaf, another index, a changed hash, a quorum not met: refused.
        let mut x = p.clone();
        x.extra = Some(b"leaf 778".to_vec());
        assert!(x.verify(&key.verifier(), &[], 0).is_err());
        let mut x = p.clone();
        x.index = 776;
        assert!(x.verify(&key.verifier(), &[], 0).is_err());
        let mut x = p.clone();
        x.hashes[0].0[0] ^= 1;
        assert!(x.verify(&key.verifier(), &[], 0).is_err());
        let w = NoteSigner::from_pkcs8(
            "w.test/1",
            KeyKind::Cosignature,
            aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(
                &aws_lc_rs::rand::SystemRandom::new(),
            )
            .unwrap()
            .as_ref(),
        )
        .unwrap();
        assert!(p.verify(&key.verifier(), &[w.verifier()], 1).is_err());
        for junk in [
            &b""[..],
            b"c2sp.org/tlog-proof@v1\n\n",
            b"other\nindex 1\n\nx",
            b"c2sp.org/tlog-proof@v1\nindex 01\n\nx",
        ] {
            assert!(TlogProof::parse(junk).is_err(), "{junk:?}");
        }
    }
}
