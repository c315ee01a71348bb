//! A TD's event log (the ACPI CCEL table's log area, which the guest can hand over with its
//! quote) and its replay into RTMR values.
//!
//! The format is TCG's crypto-agile event log (TCG PC Client Platform Firmware Profile 1.05,
//! §10.2 and §10.4): a first event in the SHA-1 shape (`TCG_PCClientPCREvent`: `u32 pcr, u32
//! type, [u8; 20] digest, u32 size, data`) whose data is the `TCG_EfiSpecIdEvent` ("Spec ID
//! Event03") listing each algorithm's digest size; then `TCG_PCR_EVENT2`s: `u32 index, u32 type,
//! TPML_DIGEST_VALUES { u32 count, count × { u16 alg, digest } }, u32 size, data`.
//!
//! In a TD's log the index is the confidential-computing MR index (UEFI 2.10 §38.4.1,
//! `EFI_CC_EVENT`): 1–4 are RTMR[0]–RTMR[3] (0, MRTD, is never extended at run time). Replay:
//! `RTMR[i] = SHA-384(RTMR[i] ‖ digest)` from 48 zero bytes, for every event but `EV_NO_ACTION`.
//! The unused rest of the log area is 0xff (or zeros): parsing stops there.

use crate::{Error, Result};

/// The largest log taken (CCEL areas are 64 KiB to a few MiB).
pub const MAX_LOG: usize = 16 << 20;
/// The most events taken.
pub const MAX_EVENTS: usize = 1 << 16;
/// `TPM_ALG_SHA384`.
pub const SHA384: u16 = 0x000c;
/// `EV_NO_ACTION`: logged, never extended.
pub const EV_NO_ACTION: u32 = 0x3;
/// `EV_SEPARATOR`.
pub const EV_SEPARATOR: u32 = 0x4;
/// `EV_EVENT_TAG` (the Linux EFI stub's load options and initrd).
pub const EV_EVENT_TAG: u32 = 0x6;
/// `EV_EFI_VARIABLE_DRIVER_CONFIG`.
pub const EV_EFI_VARIABLE_DRIVER_CONFIG: u32 = 0x8000_0001;
/// `EV_EFI_BOOT_SERVICES_APPLICATION`.
pub const EV_EFI_BOOT_SERVICES_APPLICATION: u32 = 0x8000_0003;
/// `EV_EFI_ACTION`.
pub const EV_EFI_ACTION: u32 = 0x8000_0007;
/// `EV_EFI_PLATFORM_FIRMWARE_BLOB2`.
pub const EV_EFI_PLATFORM_FIRMWARE_BLOB2: u32 = 0x8000_000a;

/// The first event's signature.
const SPEC_ID: &[u8; 16] = b"Spec ID Event03\0";
/// The most algorithms a Spec ID event may list.
const MAX_ALGS: u32 = 8;

/// One measured event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The MR index (1–4: RTMR[0]–RTMR[3]).
    pub mr_index: u32,
    pub event_type: u32,
    /// Its SHA-384 digest, where it carries one.
    pub sha384: Option<[u8; 48]>,
    /// The event data (what was measured, or a description of it).
    pub data: Vec<u8>,
}

impl Event {
    /// The RTMR it extends, where it extends one.
    pub fn rtmr(&self) -> Option<usize> {
        if self.event_type == EV_NO_ACTION {
            return None;
        }
        (1..=4)
            .contains(&self.mr_index)
            .then(|| self.mr_index as usize - 1)
    }
}

/// A parsed event log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventLog {
    pub events: Vec<Event>,
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.b.len());
        let s = end.map(|e| &self.b[self.at..e]).ok_or_else(|| {
            Error::Parameter(format!("event log truncated in {what} at byte {}", self.at))
        })?;
        self.at += n;
        Ok(s)
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        let s = self.take(2, what)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn rest(&self) -> &'a [u8] {
        &self.b[self.at.min(self.b.len())..]
    }
}

fn bad(m: String) -> Error {
    Error::Parameter(format!("event log: {m}"))
}

impl EventLog {
    /// Parse a log. Every event must carry a SHA-384 digest (a TD's log does); unknown
    /// algorithms are skipped by the sizes the Spec ID event declares.
    pub fn parse(b: &[u8]) -> Result<Self> {
        if b.len() > MAX_LOG {
            return Err(bad(format!(
                "{} bytes, more than the {} MiB taken",
                b.len(),
                MAX_LOG >> 20
            )));
        }
        let mut r = Reader { b, at: 0 };
        // The first event, SHA-1 shaped, carrying the Spec ID event.
        let _pcr = r.u32("the first event")?;
        if r.u32("the first event")? != EV_NO_ACTION {
            return Err(bad(
                "the first event is not EV_NO_ACTION (not a crypto-agile log)".into(),
            ));
        }
        r.take(20, "the first event")?;
        let size = r.u32("the first event")? as usize;
        let spec = r.take(size, "the Spec ID event")?;
        let sizes = spec_id_sizes(spec)?;
        if !sizes.iter().any(|(alg, n)| *alg == SHA384 && *n == 48) {
            return Err(bad("the Spec ID event lists no SHA-384 digests".into()));
        }
        let mut events = Vec::new();
        loop {
            let rest = r.rest();
            // The end of the area: nothing left, or erased (0xff) or zeroed space.
            if rest.len() < 8 || rest[..8].iter().all(|x| *x == 0xff) || rest[..8] == [0; 8] {
                break;
            }
            if events.len() == MAX_EVENTS {
                return Err(bad(format!("more than {MAX_EVENTS} events")));
            }
            let mr_index = r.u32("an event")?;
            let event_type = r.u32("an event")?;
            let count = r.u32("an event's digests")?;
            if count > MAX_ALGS {
                return Err(bad(format!(
                    "event {} lists {count} digests",
                    events.len() + 1
                )));
            }
            let mut sha384 = None;
            for _ in 0..count {
                let alg = r.u16("a digest")?;
                let n = sizes
                    .iter()
                    .find(|(a, _)| *a == alg)
                    .map(|(_, n)| *n as usize)
                    .ok_or_else(|| {
                        bad(format!(
                            "event {} has a digest of algorithm {alg:#06x}, which the Spec ID \
                             event does not list",
                            events.len() + 1
                        ))
                    })?;
                let d = r.take(n, "a digest")?;
                if alg == SHA384 {
                    sha384 = Some(d.try_into().map_err(|_| {
                        bad(format!(
                            "event {} has a SHA-384 digest of {n} bytes",
                            events.len() + 1
                        ))
                    })?);
                }
            }
            let size = r.u32("an event's size")? as usize;
            let data = r.take(size, "an event's data")?.to_vec();
            let e = Event {
                mr_index,
                event_type,
                sha384,
                data,
            };
            if e.rtmr().is_some() && e.sha384.is_none() {
                return Err(bad(format!(
                    "event {} extends RTMR[{}] without a SHA-384 digest",
                    events.len() + 1,
                    mr_index - 1
                )));
            }
            events.push(e);
        }
        Ok(EventLog { events })
    }

    /// RTMR[0]–RTMR[3] as the events extend them.
    pub fn replay(&self) -> [[u8; 48]; 4] {
        let mut rtmr = [[0u8; 48]; 4];
        for e in &self.events {
            if let (Some(i), Some(d)) = (e.rtmr(), e.sha384) {
                rtmr[i] = extend(&rtmr[i], &d);
            }
        }
        rtmr
    }

    /// The events that extend RTMR[`i`], in order.
    pub fn rtmr_events(&self, i: usize) -> impl Iterator<Item = &Event> {
        self.events.iter().filter(move |e| e.rtmr() == Some(i))
    }
}

/// `SHA-384(mr ‖ digest)`.
pub fn extend(mr: &[u8; 48], digest: &[u8; 48]) -> [u8; 48] {
    crate::sha384(&[mr.as_slice(), digest.as_slice()].concat())
}

/// An RTMR extended with `digests` in order, from zero.
pub fn replay_digests<'a>(digests: impl IntoIterator<Item = &'a [u8; 48]>) -> [u8; 48] {
    digests.into_iter().fold([0u8; 48], |mr, d| extend(&mr, d))
}

/// `TCG_EfiSpecIdEvent` (PFP §10.4.5.1): the algorithms and their digest sizes.
fn spec_id_sizes(spec: &[u8]) -> Result<Vec<(u16, u16)>> {
    let mut r = Reader { b: spec, at: 0 };
    if r.take(16, "the Spec ID event")? != SPEC_ID {
        return Err(bad("the first event is not a Spec ID Event03".into()));
    }
    r.take(8, "the Spec ID event")?; // platform class, version, errata, uintn size
    let n = r.u32("the Spec ID event")?;
    if n == 0 || n > MAX_ALGS {
        return Err(bad(format!("the Spec ID event lists {n} algorithms")));
    }
    let mut sizes: Vec<(u16, u16)> = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let (alg, size) = (r.u16("the Spec ID event")?, r.u16("the Spec ID event")?);
        // One size per algorithm, and SHA-384's is 48: a digest is read by the size listed.
        if sizes.iter().any(|(a, _)| *a == alg) {
            return Err(bad(format!(
                "the Spec ID event lists algorithm {alg:#06x} twice"
            )));
        }
        if alg == SHA384 && size != 48 {
            return Err(bad(format!("the Spec ID event gives SHA-384 {size} bytes")));
        }
        sizes.push((alg, size));
    }
    Ok(sizes)
}

/// Event logs made to order, for tests here and in other crates (`test-support`).
#[cfg(any(test, feature = "test-support"))]
pub mod testing {
    use super::*;

    /// A log as a TD's firmware writes it: the Spec ID event (SHA-384 only), then each
    /// `(mr_index, type, digest, data)`, then `pad` bytes of 0xff.
    pub fn log(events: &[(u32, u32, [u8; 48], &[u8])], pad: usize) -> Vec<u8> {
        let mut spec = SPEC_ID.to_vec();
        spec.extend_from_slice(&[0, 0, 0, 0, 0, 2, 0, 2]);
        spec.extend_from_slice(&1u32.to_le_bytes());
        spec.extend_from_slice(&SHA384.to_le_bytes());
        spec.extend_from_slice(&48u16.to_le_bytes());
        spec.push(0);
        let mut b = Vec::new();
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&EV_NO_ACTION.to_le_bytes());
        b.extend_from_slice(&[0u8; 20]);
        b.extend_from_slice(&(spec.len() as u32).to_le_bytes());
        b.extend_from_slice(&spec);
        for (mr, ty, d, data) in events {
            b.extend_from_slice(&mr.to_le_bytes());
            b.extend_from_slice(&ty.to_le_bytes());
            b.extend_from_slice(&1u32.to_le_bytes());
            b.extend_from_slice(&SHA384.to_le_bytes());
            b.extend_from_slice(d);
            b.extend_from_slice(&(data.len() as u32).to_le_bytes());
            b.extend_from_slice(data);
        }
        b.extend(std::iter::repeat_n(0xffu8, pad));
        b
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::testing::log;
    use super::*;

    #[test]
    fn replays_each_rtmr_from_its_events() {
        let d = |b: u8| [b; 48];
        let b = log(
            &[
                (1, EV_EFI_PLATFORM_FIRMWARE_BLOB2, d(1), b"cfv"),
                (2, EV_EFI_ACTION, d(2), b"a"),
                (1, EV_SEPARATOR, d(3), &[0; 4]),
                (3, EV_NO_ACTION, d(9), b"not extended"),
                (3, EV_EVENT_TAG, d(4), b"t"),
            ],
            4096,
        );
        let l = EventLog::parse(&b).unwrap();
        assert_eq!(l.events.len(), 5);
        let r = l.replay();
        // Written out: RTMR[0] = H(H(0 ‖ 1s) ‖ 3s), and so on.
        let h = |a: &[u8], b: &[u8]| crate::sha384(&[a, b].concat());
        assert_eq!(r[0], h(&h(&[0; 48], &d(1)), &d(3)));
        assert_eq!(r[1], h(&[0; 48], &d(2)));
        assert_eq!(r[2], h(&[0; 48], &d(4)));
        assert_eq!(r[3], [0; 48]);
        assert_eq!(l.rtmr_events(0).count(), 2);
    }

    #[test]
    fn malformed_logs_are_refused_with_their_reason() {
        let err = |b: &[u8]| EventLog::parse(b).unwrap_err().to_string();
        let good = log(&[(1, EV_SEPARATOR, [7; 48], &[0; 4])], 0);
        assert!(err(&good[..good.len() - 1]).contains("truncated"));
        assert!(err(&[]).contains("truncated"));
        let mut not_agile = good.clone();
        not_agile[4] = 1;
        assert!(err(&not_agile).contains("crypto-agile"));
        let mut no_spec = good.clone();
        no_spec[32] = b'X';
        assert!(err(&no_spec).contains("Spec ID"));
        // A digest of an algorithm the header does not declare.
        let spec_len = u32::from_le_bytes(good[28..32].try_into().unwrap()) as usize;
        let first = 32 + spec_len;
        let mut alg = good.clone();
        alg[first + 12] = 0x0b;
        assert!(err(&alg).contains("does not list"));
        let mut count = good.clone();
        count[first + 8] = 200;
        assert!(err(&count).contains("200 digests"));
        // An event that extends an RTMR but has no SHA-384 digest.
        let mut none = good[..first].to_vec();
        for v in [1u32, EV_SEPARATOR, 0, 4, 0] {
            none.extend_from_slice(&v.to_le_bytes());
        }
        assert!(err(&none).contains("without a SHA-384"));
        // A Spec ID event listing SHA-384 twice, or with a size other than 48 (read by that
        // size, a digest would not fit).
        let spec_at = 32 + 16 + 8;
        let mut twice = good[..spec_at].to_vec();
        twice.extend_from_slice(&2u32.to_le_bytes());
        for (alg, n) in [(SHA384, 48u16), (SHA384, 48)] {
            twice.extend_from_slice(&alg.to_le_bytes());
            twice.extend_from_slice(&n.to_le_bytes());
        }
        twice.push(0);
        let grown = (twice.len() - 32) as u32;
        twice[28..32].copy_from_slice(&grown.to_le_bytes());
        for v in [1u32, EV_SEPARATOR, 1] {
            twice.extend_from_slice(&v.to_le_bytes());
        }
        twice.extend_from_slice(&SHA384.to_le_bytes());
        twice.extend_from_slice(&[0; 48]);
        twice.extend_from_slice(&0u32.to_le_bytes());
        assert!(err(&twice).contains("twice"), "{}", err(&twice));
        let mut short = good.clone();
        short[spec_at + 4 + 2] = 32;
        assert!(err(&short).contains("SHA-384 32 bytes"));
        // Each single-byte corruption parses or errs.
        for at in 0..good.len() {
            for v in [0x00u8, 0xff, 0x7f] {
                let mut b = good.clone();
                b[at] = v;
                let _ = EventLog::parse(&b);
            }
        }
        assert!(err(&vec![0u8; MAX_LOG + 1]).contains("MiB"));
    }
}
