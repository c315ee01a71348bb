//! Metering records (DESIGN.md, "Metering and settlement"): one per lease per window, signed
//! by the attested node key, each carrying the hash of the one before, so that a lease's
//! usage is one chain a broker accepts link by link and an auditor replays.
//!
//! The acceptance rule is here, sans-IO ([`accept`]): the broker hands it what it holds of the
//! lease's chain, the token and the time, and stores what it returns — or records the refusal,
//! changing nothing.

use serde::{Deserialize, Serialize};

use crate::records::WorkloadState;
use crate::signed::{Kind, Record, SignedError, When, verify};

/// One GPU's usage and health in a window, as NVML reports them inside the VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuUsage {
    /// The GPU's index in the lease (as the lease record names it).
    pub index: u32,
    /// Mean utilization over the window, percent (0–100).
    pub utilization_pct: u8,
    pub memory_used_mib: u64,
    pub temperature_c: i16,
    pub power_mw: u32,
    /// ECC errors counted in the window (corrected and uncorrected).
    pub ecc_corrected: u64,
    pub ecc_uncorrected: u64,
    /// NVML's clock-throttle reasons bitmask, OR-ed over the window.
    pub throttle_reasons: u64,
}

/// The window's proof-of-work answer, if a challenge fell in it: which challenge, the root
/// the node committed to (the broker holds its verdict).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PowAnswer {
    pub challenge: String,
    /// The rows' Merkle root, hex.
    pub root: String,
}

/// One window of one lease (`sub`: the node's id).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeteringRecord {
    pub sub: String,
    pub lease: String,
    /// 0 for the lease's first window, then one more each window.
    pub seq: u64,
    /// The window's start (Unix seconds): the lease's start plus `seq` windows.
    pub window_start: i64,
    pub window_secs: u32,
    pub gpus: Vec<GpuUsage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pow: Option<PowAnswer>,
    pub workload: WorkloadState,
    /// The SHA-256 (hex) of the previous record's token; for the first, of
    /// `cgx-metering-v1/genesis` and the lease's id ([`genesis`]).
    pub prev: String,
}

impl Record for MeteringRecord {
    const KIND: Kind = Kind::Metering;
}

/// A metering window (seconds): the broker's, which every lease's records follow.
pub const WINDOW_SECS: u32 = 60;

/// The most GPUs one record covers.
pub const MAX_GPUS: usize = 64;
/// A record is sent when its window closes and retried for at most this long (its token's
/// lifetime, seconds).
pub const METERING_TTL_SECS: i64 = 600;
/// How far ahead of the broker's clock a window may end (clocks differ a little; a record of
/// usage that has not happened yet is refused).
pub const METERING_SKEW_SECS: i64 = 5;

fn sha256_hex(parts: &[&[u8]]) -> String {
    let mut c = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    for p in parts {
        c.update(p);
    }
    hex::encode(c.finish().as_ref())
}

/// The `prev` of a lease's first record.
pub fn genesis(lease: &str) -> String {
    sha256_hex(&[b"cgx-metering-v1/genesis", lease.as_bytes()])
}

/// The hash a record's successor carries: SHA-256 of the token's bytes, exactly as signed.
pub fn token_hash(token: &str) -> String {
    sha256_hex(&[token.as_bytes()])
}

/// The end a stopped lease is metered and settled to: `ended`, but at least one second past
/// `start`. Lease times are whole seconds, so a lease placed and stopped within one second
/// (a node caught cheating at its first proof, say) would otherwise have run no window at all;
/// it ran part of its first, which is metered and settled like any other — paid if proven,
/// refunded to the tenant if not.
pub fn metered_end(start: i64, ended: i64) -> i64 {
    ended.max(start.saturating_add(1))
}

/// How many windows of `window_secs` a lease that started at `start` and stopped at `ended`
/// ran: those begun before its [`metered_end`] (the last one whole).
pub fn windows_ran(start: i64, ended: i64, window_secs: u32) -> u64 {
    let ran = u64::try_from(metered_end(start, ended).saturating_sub(start)).unwrap_or(0);
    ran.div_ceil(u64::from(window_secs.max(1)))
}

/// What the broker holds of one lease's chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    pub lease: String,
    /// The node the lease runs on, and its attested node key (Ed25519).
    pub node: String,
    pub node_key: [u8; 32],
    /// The lease's start (Unix seconds) and its window length.
    pub start: i64,
    pub window_secs: u32,
    /// When the lease ended (`None`: open): no window may start at or after it.
    pub ended_at: Option<i64>,
    /// The lease's GPUs (indices on the node).
    pub gpus: Vec<u32>,
    /// The last accepted record: its sequence number and token hash (`None`: none yet).
    pub last: Option<(u64, String)>,
}

/// An accepted record: its body and the hash its successor must carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    pub record: MeteringRecord,
    pub hash: String,
}

/// Why a record is refused. The broker logs it and changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MeteringError {
    #[error("not a metering record signed by the lease's node key: {0}")]
    Signature(SignedError),
    #[error("a record of lease {got}, not of {want}")]
    OtherLease { got: String, want: String },
    #[error("a record from node {got}, not from {want} which runs the lease")]
    OtherNode { got: String, want: String },
    #[error("sequence {got} already accepted (the chain is at {last})")]
    Duplicate { got: u64, last: u64 },
    #[error("sequence {got} skips ahead: {want} is next")]
    Gap { got: u64, want: u64 },
    #[error("window starting {got}: sequence {seq} of this lease starts at {want}, {secs} s long")]
    Window {
        got: i64,
        want: i64,
        seq: u64,
        secs: u32,
    },
    #[error("window starting {start}: the lease ended at {ended}")]
    AfterEnd { start: i64, ended: i64 },
    #[error("window ending {end} has not closed yet (now {now})")]
    Future { end: i64, now: i64 },
    #[error("prev {got} is not the hash of the record before ({want})")]
    BrokenChain { got: String, want: String },
    #[error("GPUs {got:?}: the lease holds {want:?} (each once, in order)")]
    Gpus { got: Vec<u32>, want: Vec<u32> },
    #[error("utilization {0}% is not a percentage")]
    Utilization(u8),
}

/// Accept `token` as the next link of `chain` at `now`, or say why not. Checks, in order: the
/// signature (the lease's node key, this kind, its times), the lease and the node, the
/// sequence (a duplicate, a gap), the window (where the sequence puts it, and closed), the
/// link to the previous record, the GPUs (the lease's, each once) and the values' ranges.
pub fn accept(chain: &Chain, token: &str, now: i64) -> Result<Accepted, MeteringError> {
    let r = verify_record(&chain.node_key, token, now)?;
    check(chain, r, token, now)
}

/// The signature step of [`accept`] alone: `token` as a metering record under `node_key` at
/// `now` (a broker reads the lease it names, then [`check`]s it against that lease's chain,
/// verifying once).
pub fn verify_record(
    node_key: &[u8; 32],
    token: &str,
    now: i64,
) -> Result<MeteringRecord, MeteringError> {
    verify::<MeteringRecord>(
        token,
        &[*node_key],
        When::At {
            now,
            max_lifetime: METERING_TTL_SECS,
        },
    )
    .map(|v| v.body)
    .map_err(MeteringError::Signature)
}

/// The chain steps of [`accept`], for a record `r` verified from `token` under `chain`'s node
/// key ([`verify_record`]).
pub fn check(
    chain: &Chain,
    r: MeteringRecord,
    token: &str,
    now: i64,
) -> Result<Accepted, MeteringError> {
    if r.lease != chain.lease {
        return Err(MeteringError::OtherLease {
            got: r.lease,
            want: chain.lease.clone(),
        });
    }
    if r.sub != chain.node {
        return Err(MeteringError::OtherNode {
            got: r.sub,
            want: chain.node.clone(),
        });
    }
    let (want_seq, want_prev) = match &chain.last {
        None => (0, genesis(&chain.lease)),
        Some((seq, hash)) => (seq.saturating_add(1), hash.clone()),
    };
    if r.seq < want_seq {
        return Err(MeteringError::Duplicate {
            got: r.seq,
            last: want_seq.saturating_sub(1),
        });
    }
    if r.seq > want_seq {
        return Err(MeteringError::Gap {
            got: r.seq,
            want: want_seq,
        });
    }
    let secs = i64::from(chain.window_secs);
    let want_start = i64::try_from(r.seq)
        .ok()
        .and_then(|s| s.checked_mul(secs))
        .and_then(|o| chain.start.checked_add(o));
    if r.window_secs != chain.window_secs || Some(r.window_start) != want_start {
        return Err(MeteringError::Window {
            got: r.window_start,
            want: want_start.unwrap_or(i64::MAX),
            seq: r.seq,
            secs: chain.window_secs,
        });
    }
    if let Some(ended) = chain.ended_at.map(|e| metered_end(chain.start, e))
        && r.window_start >= ended
    {
        return Err(MeteringError::AfterEnd {
            start: r.window_start,
            ended,
        });
    }
    let end = r.window_start.saturating_add(secs);
    if end > now.saturating_add(METERING_SKEW_SECS) {
        return Err(MeteringError::Future { end, now });
    }
    if r.prev != want_prev {
        return Err(MeteringError::BrokenChain {
            got: r.prev,
            want: want_prev,
        });
    }
    let got: Vec<u32> = r.gpus.iter().map(|g| g.index).collect();
    if got != chain.gpus || got.len() > MAX_GPUS {
        return Err(MeteringError::Gpus {
            got,
            want: chain.gpus.clone(),
        });
    }
    if let Some(g) = r.gpus.iter().find(|g| g.utilization_pct > 100) {
        return Err(MeteringError::Utilization(g.utilization_pct));
    }
    Ok(Accepted {
        hash: token_hash(token),
        record: r,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::signed::Signer;

    fn signer() -> Signer {
        let pkcs8 = aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(
            &aws_lc_rs::rand::SystemRandom::new(),
        )
        .unwrap();
        Signer::from_pkcs8(pkcs8.as_ref()).unwrap()
    }

    fn usage(index: u32) -> GpuUsage {
        GpuUsage {
            index,
            utilization_pct: 97,
            memory_used_mib: 70_000,
            temperature_c: 61,
            power_mw: 650_000,
            ecc_corrected: 0,
            ecc_uncorrected: 0,
            throttle_reasons: 0,
        }
    }

    const START: i64 = 1_000_000;

    fn record(seq: u64, prev: String) -> MeteringRecord {
        MeteringRecord {
            sub: "n1".into(),
            lease: "l1".into(),
            seq,
            window_start: START + 60 * seq as i64,
            window_secs: 60,
            gpus: vec![usage(2), usage(3)],
            pow: None,
            workload: WorkloadState::Running,
            prev,
        }
    }

    fn chain(key: [u8; 32]) -> Chain {
        Chain {
            lease: "l1".into(),
            node: "n1".into(),
            node_key: key,
            start: START,
            window_secs: 60,
            ended_at: None,
            gpus: vec![2, 3],
            last: None,
        }
    }

    fn sign(s: &Signer, r: &MeteringRecord) -> String {
        let end = r.window_start + i64::from(r.window_secs);
        s.sign(r, end, end + 300).unwrap()
    }

    /// A chain of five windows accepted link by link; then every way a record can be wrong,
    /// each refused with its reason and leaving the chain as it was.
    #[test]
    fn a_chain_is_accepted_link_by_link_and_every_bad_link_refused() {
        let s = signer();
        let mut c = chain(s.public_key());
        let mut tokens = Vec::new();
        let mut prev = genesis("l1");
        for seq in 0..5 {
            let t = sign(&s, &record(seq, prev.clone()));
            let now = START + 60 * (seq as i64 + 1) + 1;
            let a = accept(&c, &t, now).unwrap();
            assert_eq!((a.record.seq, &a.hash), (seq, &token_hash(&t)));
            c.last = Some((seq, a.hash.clone()));
            prev = a.hash;
            tokens.push(t);
        }
        let now = START + 60 * 6 + 1;
        let next = |f: &dyn Fn(&mut MeteringRecord)| {
            let mut r = record(5, prev.clone());
            f(&mut r);
            sign(&s, &r)
        };
        let other = signer();
        let cases: Vec<(String, &str)> = vec![
            // A duplicate of an accepted record, and replays of earlier ones.
            (tokens[4].clone(), "sequence 4 already accepted"),
            (tokens[3].clone(), "sequence 3 already accepted"),
            // An old one past its token's life: refused before it is read.
            (tokens[0].clone(), "expired at"),
            // Reordered: the one after next before next.
            (next(&|r| r.seq = 6), "sequence 6 skips ahead: 5 is next"),
            (
                next(&|r| r.lease = "l2".into()),
                "a record of lease l2, not of l1",
            ),
            (next(&|r| r.sub = "n2".into()), "from node n2, not from n1"),
            (
                next(&|r| r.window_start += 60),
                "sequence 5 of this lease starts at 1000300",
            ),
            (
                next(&|r| r.window_secs = 30),
                "starts at 1000300, 60 s long",
            ),
            (
                next(&|r| r.prev = genesis("l1")),
                "is not the hash of the record before",
            ),
            (
                next(&|r| {
                    r.gpus.pop();
                }),
                "the lease holds [2, 3]",
            ),
            (next(&|r| r.gpus[1].index = 2), "the lease holds [2, 3]"),
            (
                next(&|r| r.gpus[0].utilization_pct = 101),
                "utilization 101%",
            ),
            // Signed by another key.
            (
                other
                    .sign(&record(5, prev.clone()), now - 1, now + 60)
                    .unwrap(),
                "signature does not verify",
            ),
        ];
        for (token, why) in cases {
            let e = accept(&c, &token, now).unwrap_err().to_string();
            assert!(e.contains(why), "{why}: {e}");
        }
        // A window in the future: its record cannot exist yet.
        let early = START + 60 * 5 + 10;
        let t = sign(&s, &record(5, prev.clone()));
        assert_eq!(
            accept(&c, &t, early).unwrap_err(),
            MeteringError::Future {
                end: START + 360,
                now: early
            }
        );
        let mut future = record(5, prev.clone());
        future.window_start = START + 60 * 5;
        let t = s.sign(&future, early, early + 60).unwrap();
        assert_eq!(
            accept(&c, &t, early).unwrap_err(),
            MeteringError::Future {
                end: START + 360,
                now: early
            }
        );
        // The next good record is still accepted: nothing above changed the chain.
        accept(&c, &sign(&s, &record(5, prev.clone())), now).unwrap();
        // Once the lease ended, its last window may still arrive; one after it may not.
        let mut ended = c.clone();
        ended.ended_at = Some(START + 330);
        accept(&ended, &sign(&s, &record(5, prev.clone())), now).unwrap();
        ended.ended_at = Some(START + 300);
        assert_eq!(
            accept(&ended, &sign(&s, &record(5, prev.clone())), now).unwrap_err(),
            MeteringError::AfterEnd {
                start: START + 300,
                ended: START + 300
            }
        );
        // Another lease's genesis is another chain: a first record cannot start this one.
        let mut fresh = chain(s.public_key());
        fresh.lease = "l2".into();
        let mut r = record(0, genesis("l1"));
        r.lease = "l2".into();
        let e = accept(&fresh, &sign(&s, &r), START + 61).unwrap_err();
        assert!(matches!(e, MeteringError::BrokenChain { .. }), "{e}");
    }

    /// A lease stopped within the second it started (times are whole seconds) still ran its
    /// first window: that window's record is taken, the next one's is not.
    #[test]
    fn a_lease_stopped_in_its_first_second_is_metered_its_first_window() {
        let s = signer();
        let mut c = chain(s.public_key());
        c.ended_at = Some(START);
        let first = accept(&c, &sign(&s, &record(0, genesis("l1"))), START + 61).unwrap();
        c.last = Some((0, first.hash.clone()));
        assert_eq!(
            accept(&c, &sign(&s, &record(1, first.hash)), START + 121).unwrap_err(),
            MeteringError::AfterEnd {
                start: START + 60,
                ended: START + 1
            }
        );
        assert_eq!(metered_end(START, START - 5), START + 1);
        assert_eq!(windows_ran(START, START, 60), 1);
        assert_eq!(windows_ran(START, START + 60, 60), 1);
        assert_eq!(windows_ran(START, START + 61, 60), 2);
        assert_eq!(windows_ran(START, START + 61, 0), 61);
        assert_eq!(metered_end(START, START + 90), START + 90);
    }
}
