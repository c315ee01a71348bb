//! C2SP tlog-tiles entry bundles: a level-0 tile's leaves, each as a big-endian `uint16` length
//! and its bytes.

use crate::{LogError, MAX_LEAF};

/// A bundle of `entries` (each at most [`MAX_LEAF`] bytes).
pub fn encode<E: AsRef<[u8]>>(entries: &[E]) -> Result<Vec<u8>, LogError> {
    let mut out = Vec::with_capacity(entries.iter().map(|e| e.as_ref().len() + 2).sum());
    for e in entries {
        let e = e.as_ref();
        let n = u16::try_from(e.len()).map_err(|_| LogError::LeafTooLarge(e.len()))?;
        out.extend_from_slice(&n.to_be_bytes());
        out.extend_from_slice(e);
    }
    Ok(out)
}

/// The `expect` entries of a bundle: exactly that many, nothing after the last.
pub fn decode(data: &[u8], expect: usize) -> Result<Vec<&[u8]>, LogError> {
    let mut out = Vec::with_capacity(expect);
    let mut rest = data;
    while !rest.is_empty() {
        let Some((len, tail)) = rest.split_first_chunk::<2>() else {
            return Err(LogError::Bundle(format!(
                "a length cut short after {} entries",
                out.len()
            )));
        };
        let len = usize::from(u16::from_be_bytes(*len));
        if tail.len() < len {
            return Err(LogError::Bundle(format!(
                "entry {} says {len} bytes, {} are left",
                out.len(),
                tail.len()
            )));
        }
        if out.len() == expect {
            return Err(LogError::Bundle(format!("more than {expect} entries")));
        }
        let (entry, tail) = tail.split_at(len);
        debug_assert!(entry.len() <= MAX_LEAF);
        out.push(entry);
        rest = tail;
    }
    if out.len() != expect {
        return Err(LogError::Bundle(format!(
            "{} entries, the tile says {expect}",
            out.len()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn bundles_round_trip_and_refuse_what_they_do_not_hold() {
        let entries: Vec<Vec<u8>> = vec![b"a".to_vec(), Vec::new(), vec![7; MAX_LEAF]];
        let b = encode(&entries).unwrap();
        assert_eq!(&b[..3], &[0, 1, b'a']);
        assert_eq!(
            decode(&b, 3).unwrap(),
            entries.iter().map(Vec::as_slice).collect::<Vec<_>>()
        );
        assert!(
            decode(&b, 2)
                .unwrap_err()
                .to_string()
                .contains("more than 2")
        );
        assert!(decode(&b, 4).unwrap_err().to_string().contains("3 entries"));
        assert!(
            decode(&b[..b.len() - 1], 3)
                .unwrap_err()
                .to_string()
                .contains("are left")
        );
        assert!(
            decode(&[0], 1)
                .unwrap_err()
                .to_string()
                .contains("cut short")
        );
        assert_eq!(
            encode(&[vec![0u8; MAX_LEAF + 1]]).unwrap_err(),
            LogError::LeafTooLarge(MAX_LEAF + 1)
        );
    }
}
