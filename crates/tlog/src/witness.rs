//! A witness's decision, sans I/O: C2SP tlog-witness `add-checkpoint`, and the request a log
//! sends. A witness cosigns (tlog-cosignature/v1) a checkpoint of a log it knows only when it
//! is consistent with the latest one it cosigned for that log, so a log that rewrites or forks
//! history cannot gather a quorum for both branches.
//!
//! The request body is `old <size>\n`, up to 63 base64 consistency-proof lines, an empty
//! line, then the signed checkpoint. The answers, per the spec:
//! - **404**: unknown log (origin);
//! - **403**: no trusted signature of that log verifies;
//! - **400**: a malformed body, old size past the checkpoint's, a proof where old is 0;
//! - **409**: old is not the latest size cosigned (body `<size>\n`, `text/x.tlog.size`), or
//!   the same size with another root;
//! - **422**: the consistency proof does not verify;
//! - **200**: the cosignature line(s).
//!
//! The caller persists the new latest checkpoint atomically with the check (per log), before it
//! answers.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;

use crate::note::{KeyKind, NoteKey, NoteSigner, Opened, open_checkpoint};
use crate::{Hash, MAX_SIZE};

/// The content type of a 409's body (the latest size the witness cosigned).
pub const SIZE_CONTENT_TYPE: &str = "text/x.tlog.size";
/// The largest request body a witness reads (a checkpoint note with a few signatures and 63
/// proof lines is far under it).
pub const MAX_BODY: usize = 16 * 1024;
/// At most this many proof lines (a tree of 2⁶³ leaves needs no more).
pub const MAX_PROOF: usize = 63;

/// An `add-checkpoint` request.
#[derive(Debug, Clone, PartialEq)]
pub struct AddCheckpoint {
    /// The size of the latest checkpoint the log believes the witness cosigned (0: none).
    pub old: u64,
    /// The consistency proof from `old` to the checkpoint's size.
    pub proof: Vec<Hash>,
    /// The signed checkpoint (a note).
    pub checkpoint: Vec<u8>,
}

impl AddCheckpoint {
    /// The request's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = format!("old {}\n", self.old).into_bytes();
        for h in &self.proof {
            out.extend_from_slice(B64.encode(h.0).as_bytes());
            out.push(b'\n');
        }
        out.push(b'\n');
        out.extend_from_slice(&self.checkpoint);
        out
    }

    /// Parse a request body: refused (400) when it is not one.
    pub fn parse(body: &[u8]) -> Result<AddCheckpoint, Refusal> {
        let bad = |why: &str| Refusal::Malformed(why.to_string());
        if body.len() > MAX_BODY {
            return Err(bad("the body is too large"));
        }
        let split = body
            .windows(2)
            .position(|w| w == b"\n\n")
            .ok_or_else(|| bad("no empty line before the checkpoint"))?;
        let head =
            std::str::from_utf8(&body[..=split]).map_err(|_| bad("the head is not UTF-8"))?;
        let checkpoint = body[split + 2..].to_vec();
        let mut lines = head.lines();
        let old = lines
            .next()
            .and_then(|l| l.strip_prefix("old "))
            .ok_or_else(|| bad("the first line is not `old <size>`"))?;
        if old.is_empty()
            || !old.bytes().all(|b| b.is_ascii_digit())
            || (old.len() > 1 && old.starts_with('0'))
        {
            return Err(bad("the old size is not a decimal number"));
        }
        let old: u64 = old
            .parse()
            .map_err(|_| bad("the old size is not a number"))?;
        let mut proof = Vec::new();
        for l in lines {
            if proof.len() == MAX_PROOF {
                return Err(bad("more than 63 proof lines"));
            }
            let h = B64
                .decode(l)
                .ok()
                .and_then(|b| <[u8; 32]>::try_from(b).ok())
                .ok_or_else(|| bad("a proof line is not a base64 hash"))?;
            proof.push(Hash(h));
        }
        Ok(AddCheckpoint {
            old,
            proof,
            checkpoint,
        })
    }
}

/// Why a witness did not cosign: each maps to the spec's status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("malformed request: {0}")]
    Malformed(String),
    #[error("unknown log {0:?}")]
    UnknownLog(String),
    #[error("no trusted signature verifies: {0}")]
    Unverified(String),
    #[error("old size {old} is past the checkpoint's size {size}")]
    OldPastNew { old: u64, size: u64 },
    /// The request's old size is not the latest the witness cosigned (which it says).
    #[error("old size {old} is not the latest size cosigned, {latest}")]
    NotLatest { old: u64, latest: u64 },
    /// The same size as the latest cosigned, with another root: a fork.
    #[error("a checkpoint of size {size} was cosigned with another root")]
    Fork { size: u64 },
    #[error("the consistency proof does not verify: {0}")]
    BadProof(String),
}

impl Refusal {
    /// The HTTP status the spec gives it.
    pub fn status(&self) -> u16 {
        match self {
            Refusal::Malformed(_) | Refusal::OldPastNew { .. } => 400,
            Refusal::Unverified(_) => 403,
            Refusal::UnknownLog(_) => 404,
            Refusal::NotLatest { .. } | Refusal::Fork { .. } => 409,
            Refusal::BadProof(_) => 422,
        }
    }

    /// The answer's body and content type: a 409 says the latest size cosigned.
    pub fn body(&self) -> (&'static str, Vec<u8>) {
        match self {
            Refusal::NotLatest { latest, .. } | Refusal::Fork { size: latest } => {
                (SIZE_CONTENT_TYPE, format!("{latest}\n").into_bytes())
            }
            other => (
                "text/plain; charset=utf-8",
                format!("{other}\n").into_bytes(),
            ),
        }
    }
}

/// The latest checkpoint a witness cosigned for a log.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Latest {
    pub size: u64,
    pub root: Hash,
}

/// Step 1: which known log the checkpoint is of, and whether its signature holds. `logs` are the
/// logs' verifier keys (each named by its origin).
pub fn open<'a>(
    req: &AddCheckpoint,
    logs: &'a [NoteKey],
) -> Result<(&'a NoteKey, Opened), Refusal> {
    let origin = req
        .checkpoint
        .split(|&b| b == b'\n')
        .next()
        .and_then(|l| std::str::from_utf8(l).ok())
        .ok_or_else(|| Refusal::Malformed("the checkpoint has no origin line".into()))?;
    let log = logs
        .iter()
        .find(|k| k.name() == origin && k.kind() == KeyKind::Ed25519)
        .ok_or_else(|| Refusal::UnknownLog(origin.to_string()))?;
    let opened = open_checkpoint(&req.checkpoint, log, &[], 0)
        .map_err(|e| Refusal::Unverified(e.to_string()))?;
    if opened.checkpoint.size() > MAX_SIZE {
        return Err(Refusal::Malformed("a checkpoint past 2^48 leaves".into()));
    }
    Ok((log, opened))
}

/// Step 2: whether the checkpoint extends `latest` (`None`: nothing cosigned yet for this log),
/// by the request's proof. The new latest on success.
pub fn judge(
    req: &AddCheckpoint,
    opened: &Opened,
    latest: Option<Latest>,
) -> Result<Latest, Refusal> {
    let size = opened.checkpoint.size();
    let root = *opened.checkpoint.hash();
    let have = latest.map_or(0, |l| l.size);
    if req.old > size {
        return Err(Refusal::OldPastNew { old: req.old, size });
    }
    if req.old != have {
        return Err(Refusal::NotLatest {
            old: req.old,
            latest: have,
        });
    }
    match latest.filter(|l| l.size > 0) {
        None => {
            if !req.proof.is_empty() {
                return Err(Refusal::Malformed(
                    "a proof from an old size of 0 must be empty".into(),
                ));
            }
        }
        Some(l) if l.size == size => {
            if l.root != root {
                return Err(Refusal::Fork { size });
            }
        }
        Some(l) => {
            tlog_tiles::check_tree(&req.proof, size, root, l.size, l.root)
                .map_err(|e| Refusal::BadProof(e.to_string()))?;
        }
    }
    Ok(Latest { size, root })
}

/// Step 3 (once the new latest is persisted): the witness's cosignature line for the
/// checkpoint at `time`, `— <name> <base64(key id ‖ time ‖ signature)>\n`.
pub fn cosignature(
    opened: &Opened,
    witness: &NoteSigner,
    time: u64,
) -> Result<Vec<u8>, crate::LogError> {
    if witness.verifier().kind() != KeyKind::Cosignature {
        return Err(crate::LogError::Key(
            "a witness cosigns with a cosignature/v1 (0x04) key".into(),
        ));
    }
    let mut b = witness.id().to_be_bytes().to_vec();
    b.extend_from_slice(&witness.cosignature_at(time, &opened.body));
    Ok(format!("\u{2014} {} {}\n", witness.name(), B64.encode(b)).into_bytes())
}

/// The log's side: a checkpoint with the cosignature lines witnesses answered added (each line
/// is checked when the checkpoint is opened with the witnesses' keys).
pub fn add_cosignatures(signed: &[u8], lines: &[Vec<u8>]) -> Vec<u8> {
    let mut out = signed.to_vec();
    for l in lines {
        out.extend_from_slice(l);
    }
    out
}

/// The log's side: a 409's body, the size the witness holds.
pub fn parse_size(body: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(body).ok()?.strip_suffix('\n')?;
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::Checkpoint;
    use crate::note::{cosign, sign_checkpoint};
    use crate::tree::MemoryTree;

    const ORIGIN: &str = "log.test/w";

    fn key() -> Vec<u8> {
        aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .unwrap()
            .as_ref()
            .to_vec()
    }

    struct Log {
        tree: MemoryTree,
        key: NoteSigner,
    }

    impl Log {
        fn new() -> Log {
            Log {
                tree: MemoryTree::new(),
                key: NoteSigner::from_pkcs8(ORIGIN, KeyKind::Ed25519, &key()).unwrap(),
            }
        }
        fn grow(&mut self, to: u64, tag: &str) {
            while self.tree.size() < to {
                let n = self.tree.size();
                self.tree.append(format!("{tag}{n}").as_bytes()).unwrap();
            }
        }
        fn checkpoint(&self, size: u64) -> Vec<u8> {
            let cp = Checkpoint::new(ORIGIN, size, self.tree.root_at(size).unwrap(), "").unwrap();
            sign_checkpoint(&cp, &self.key).unwrap()
        }
        fn request(&self, old: u64, size: u64) -> AddCheckpoint {
            AddCheckpoint {
                old,
                proof: if old == 0 || old == size {
                    Vec::new()
                } else {
                    self.tree.prove_consistency(size, old).unwrap()
                },
                checkpoint: self.checkpoint(size),
            }
        }
    }

    fn witness() -> NoteSigner {
        NoteSigner::from_pkcs8("witness.test/w1", KeyKind::Cosignature, &key())
            .unwrap()
            .at(1_700_000_000)
    }

    /// Run a request through the three steps against `latest`.
    fn add(
        req: &AddCheckpoint,
        logs: &[NoteKey],
        latest: Option<Latest>,
        w: &NoteSigner,
    ) -> Result<(Latest, Vec<u8>), Refusal> {
        let parsed = AddCheckpoint::parse(&req.to_bytes())?;
        assert_eq!(&parsed, req);
        let (_, opened) = open(&parsed, logs)?;
        let new = judge(&parsed, &opened, latest)?;
        Ok((new, cosignature(&opened, w, 1_700_000_000).unwrap()))
    }

    /// A log that grows is cosigned at each step; its checkpoint with the cosignature opens
    /// under a quorum of one; every way to fail gets the spec's status.
    #[test]
    fn a_witness_cosigns_what_extends_and_refuses_the_rest_with_the_specs_status() {
        let mut log = Log::new();
        let logs = vec![log.key.verifier()];
        let w = witness();
        log.grow(10, "a");
        let (l1, line) = add(&log.request(0, 10), &logs, None, &w).unwrap();
        assert_eq!(l1.size, 10);
        let cosigned = add_cosignatures(&log.checkpoint(10), &[line]);
        let o = open_checkpoint(&cosigned, &log.key.verifier(), &[w.verifier()], 1).unwrap();
        assert_eq!(
            o.cosigned,
            vec![("witness.test/w1".to_string(), 1_700_000_000)]
        );
        // Our line is the one `cosign` makes.
        assert_eq!(cosigned, cosign(&log.checkpoint(10), &[&w]).unwrap());
        log.grow(300, "a");
        let (l2, _) = add(&log.request(10, 300), &logs, Some(l1), &w).unwrap();
        assert_eq!(l2.size, 300);
        // The same checkpoint again: cosigned again.
        add(&log.request(300, 300), &logs, Some(l2), &w).unwrap();

        let status = |r: Result<(Latest, Vec<u8>), Refusal>| r.unwrap_err().status();
        // Unknown log.
        let other = Log::new();
        let mut other_req = other.request(0, 0);
        other_req.checkpoint = {
            let cp = Checkpoint::new("other.test/log", 0, crate::record_hash(b""), "").unwrap();
            let k = NoteSigner::from_pkcs8("other.test/log", KeyKind::Ed25519, &key()).unwrap();
            sign_checkpoint(&cp, &k).unwrap()
        };
        assert_eq!(status(add(&other_req, &logs, Some(l2), &w)), 404);
        // Signed by another key under the log's name.
        let mut forged = log.request(300, 300);
        forged.checkpoint = other.checkpoint(0);
        assert_eq!(status(add(&forged, &logs, Some(l2), &w)), 403);
        // Old past new.
        let mut r = log.request(300, 300);
        r.old = 301;
        assert_eq!(status(add(&r, &logs, Some(l2), &w)), 400);
        // Old not the latest: 409, saying the latest.
        let e = add(&log.request(10, 300), &logs, Some(l2), &w).unwrap_err();
        assert_eq!(e.status(), 409);
        assert_eq!(e.body(), (SIZE_CONTENT_TYPE, b"300\n".to_vec()));
        assert_eq!(parse_size(&e.body().1), Some(300));
        // A fork at the same size: 409.
        // (The same log's key: `fork_logs` stands for it.)
        let mut fork = Log::new();
        let fork_logs = vec![fork.key.verifier()];
        fork.grow(300, "b");
        let e = add(&fork.request(300, 300), &fork_logs, Some(l2), &w).unwrap_err();
        assert!(matches!(e, Refusal::Fork { size: 300 }), "{e}");
        assert_eq!(e.status(), 409);
        // A rewritten history that grows: its proof from 300 does not hold against the root
        // the witness holds: 422.
        fork.grow(400, "b");
        let e = add(&fork.request(300, 400), &fork_logs, Some(l2), &w).unwrap_err();
        assert_eq!(e.status(), 422, "{e}");
        // A proof edited: 422; a proof where old is 0: 400.
        log.grow(400, "a");
        let mut r = log.request(300, 400);
        r.proof[0].0[0] ^= 1;
        assert_eq!(status(add(&r, &logs, Some(l2), &w)), 422);
        let mut r = log.request(0, 400);
        r.proof = vec![crate::record_hash(b"x")];
        assert_eq!(status(add(&r, &logs, None, &w)), 400);
    }

    /// Bodies that are not requests are refused as malformed, whatever they hold.
    #[test]
    fn malformed_bodies_are_refused_before_anything_is_checked() {
        for body in [
            &b""[..],
            b"old 1\n",
            b"old x\n\ncp",
            b"old 01\n\ncp",
            b"old -1\n\ncp",
            b"old 1\nnot base64!\n\ncp",
            b"old 1\nAAAA\n\ncp",
            b"new 1\n\ncp",
            b"old 99999999999999999999999\n\ncp",
        ] {
            let e = AddCheckpoint::parse(body).unwrap_err();
            assert_eq!(e.status(), 400, "{body:?}: {e}");
        }
        let many = format!(
            "old 1\n{}\ncp",
            "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n".repeat(64)
        );
        assert!(AddCheckpoint::parse(many.as_bytes()).is_err());
        assert!(AddCheckpoint::parse(&vec![b'a'; MAX_BODY + 1]).is_err());
        assert_eq!(parse_size(b"12\n"), Some(12));
        assert_eq!(parse_size(b"12"), None);
        assert_eq!(parse_size(b"x\n"), None);
    }
}
