//! Minimal DER: a TLV reader for the few extension values we decode by hand (AMD SPLs, NVIDIA
//! FWID), and a writer the simulator uses to build certificates in the vendors' exact shapes.

/// Read one TLV (single-byte tag, definite length). Returns (tag, value, rest); `None` on any
/// malformation, never a panic.
pub(crate) fn read_tlv(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first & 0x80 == 0 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7F);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        (len, &rest[n..])
    };
    if rest.len() < len {
        return None;
    }
    Some((tag, &rest[..len], &rest[len..]))
}

/// (tag, value, raw TLV, rest).
pub(crate) type RawTlv<'a> = (u8, &'a [u8], &'a [u8], &'a [u8]);

/// Like [`read_tlv`], also returning the whole TLV's raw bytes.
pub(crate) fn read_tlv_raw(input: &[u8]) -> Option<RawTlv<'_>> {
    let (tag, value, rest) = read_tlv(input)?;
    let raw = &input[..input.len() - rest.len()];
    Some((tag, value, raw, rest))
}

/// Iterate the TLVs of a constructed value's contents.
pub(crate) fn children(mut input: &[u8]) -> impl Iterator<Item = (u8, &[u8])> {
    std::iter::from_fn(move || {
        let (tag, value, rest) = read_tlv(input)?;
        input = rest;
        Some((tag, value))
    })
}

/// DER writer.
pub(crate) mod write {
    pub fn tlv(tag: u8, value: &[u8]) -> Vec<u8> {
        let mut out = vec![tag];
        let len = value.len();
        if len < 0x80 {
            out.push(len as u8);
        } else {
            let bytes = len.to_be_bytes();
            let skip = bytes.iter().take_while(|&&b| b == 0).count();
            out.push(0x80 | (bytes.len() - skip) as u8);
            out.extend_from_slice(&bytes[skip..]);
        }
        out.extend_from_slice(value);
        out
    }

    pub fn seq(parts: &[Vec<u8>]) -> Vec<u8> {
        tlv(0x30, &parts.concat())
    }

    #[cfg(any(feature = "sim", test))]
    pub fn set(parts: &[Vec<u8>]) -> Vec<u8> {
        tlv(0x31, &parts.concat())
    }

    /// An unsigned INTEGER from big-endian magnitude bytes.
    #[cfg(any(feature = "sim", test))]
    pub fn uint(be: &[u8]) -> Vec<u8> {
        let skip = be.iter().take_while(|&&b| b == 0).count();
        let mut v = be[skip..].to_vec();
        if v.is_empty() || v[0] & 0x80 != 0 {
            v.insert(0, 0);
        }
        tlv(0x02, &v)
    }

    #[cfg(any(feature = "sim", test))]
    pub fn small_uint(n: u64) -> Vec<u8> {
        uint(&n.to_be_bytes())
    }

    pub fn oid(dotted: &str) -> Vec<u8> {
        let arcs: Vec<u64> = dotted.split('.').filter_map(|a| a.parse().ok()).collect();
        let mut body = Vec::new();
        if arcs.len() >= 2 {
            push_base128(&mut body, arcs[0] * 40 + arcs[1]);
            for &a in &arcs[2..] {
                push_base128(&mut body, a);
            }
        }
        tlv(0x06, &body)
    }

    fn push_base128(out: &mut Vec<u8>, mut v: u64) {
        let mut tmp = vec![(v & 0x7F) as u8];
        v >>= 7;
        while v > 0 {
            tmp.push(0x80 | (v & 0x7F) as u8);
            v >>= 7;
        }
        tmp.reverse();
        out.extend_from_slice(&tmp);
    }

    pub fn octets(v: &[u8]) -> Vec<u8> {
        tlv(0x04, v)
    }

    pub fn bits(v: &[u8]) -> Vec<u8> {
        let mut body = vec![0u8];
        body.extend_from_slice(v);
        tlv(0x03, &body)
    }

    #[cfg(any(feature = "sim", test))]
    pub fn utf8(s: &str) -> Vec<u8> {
        tlv(0x0C, s.as_bytes())
    }

    pub fn null() -> Vec<u8> {
        vec![0x05, 0x00]
    }

    #[cfg(any(feature = "sim", test))]
    pub fn boolean(b: bool) -> Vec<u8> {
        tlv(0x01, &[if b { 0xFF } else { 0 }])
    }

    /// GeneralizedTime `YYYYMMDDHHMMSSZ` from Unix seconds.
    #[cfg(any(feature = "sim", test))]
    pub fn generalized_time(ts: i64) -> Vec<u8> {
        let t = time::OffsetDateTime::from_unix_timestamp(ts)
            .unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
        let s = format!(
            "{:04}{:02}{:02}{:02}{:02}{:02}Z",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        );
        tlv(0x18, s.as_bytes())
    }

    /// Context-specific constructed `[n]`.
    pub fn ctx(n: u8, v: &[u8]) -> Vec<u8> {
        tlv(0xA0 | n, v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tlv_round_trip_and_malformed() {
        let long = write::octets(&[7u8; 300]);
        let (tag, body, rest) = read_tlv(&long).unwrap();
        assert_eq!((tag, body.len(), rest.len()), (0x04, 300, 0));
        assert!(read_tlv(&long[..long.len() - 1]).is_none());
        assert!(read_tlv(&[0x30]).is_none());
        assert!(read_tlv(&[0x30, 0x85, 1, 1, 1, 1, 1]).is_none());
        assert_eq!(
            write::oid("1.2.840.10045.2.1"),
            [6, 7, 42, 134, 72, 206, 61, 2, 1]
        );
        assert_eq!(write::small_uint(128), [2, 2, 0, 128]);
    }
}
