//! A proof's bytes: what the agent uploads and the broker stores and verifies. Fixed-width
//! little-endian fields, length checked against the challenge's size before anything is read.
//!
//! ```text
//! magic "cgx-pow-proof-v2" (16) | n u32 | k u32 | root [32]
//! k × ( index u32 | path length u8 | path: length × [32] | row: n × i32 )
//! ```

use crate::PowError;
use crate::challenge::Params;
use crate::proof::{Opening, Proof};

const MAGIC: &[u8; 16] = b"cgx-pow-proof-v2";

/// The longest a path can be (a tree of at most 2¹⁴ leaves has paths of at most 14).
const MAX_PATH: usize = 14;

/// The most bytes a proof of `p` can take: a larger body is refused before it is read.
pub fn max_len(p: Params) -> usize {
    let (n, k) = (p.n as usize, p.k as usize);
    16 + 8 + 32 + k * (4 + 1 + 32 * MAX_PATH + 4 * n)
}

pub fn encode(p: &Proof) -> Vec<u8> {
    let n = p.openings.first().map_or(0, |o| o.row.len());
    let mut out = Vec::with_capacity(64 + p.openings.len() * (4 * n + 512));
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(n as u32).to_le_bytes());
    out.extend_from_slice(&(p.openings.len() as u32).to_le_bytes());
    out.extend_from_slice(&p.root);
    for o in &p.openings {
        out.extend_from_slice(&o.index.to_le_bytes());
        out.push(o.path.len().min(255) as u8);
        for h in &o.path {
            out.extend_from_slice(h);
        }
        for v in &o.row {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

/// A cursor that refuses to read past the end.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], PowError> {
        if self.0.len() < n {
            return Err(PowError::Shape(format!("the proof ends inside {what}")));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u32(&mut self, what: &str) -> Result<u32, PowError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
}

/// The proof in `bytes`, for a challenge of size `p`: the size it states must be `p`.
pub fn decode(bytes: &[u8], p: Params) -> Result<Proof, PowError> {
    p.check()?;
    if bytes.len() > max_len(p) {
        return Err(PowError::Shape(format!(
            "{} bytes, more than a proof of n = {} and k = {} can take ({})",
            bytes.len(),
            p.n,
            p.k,
            max_len(p)
        )));
    }
    let mut r = Reader(bytes);
    if r.take(16, "the magic")? != MAGIC {
        return Err(PowError::Shape("not a cgx proof (magic)".into()));
    }
    let (n, k) = (r.u32("n")?, r.u32("k")?);
    if n != p.n || k != p.k {
        return Err(PowError::Shape(format!(
            "a proof of n = {n}, k = {k}; the challenge is n = {}, k = {}",
            p.n, p.k
        )));
    }
    let mut root = [0u8; 32];
    root.copy_from_slice(r.take(32, "the root")?);
    let mut openings = Vec::with_capacity(k as usize);
    for _ in 0..k {
        let index = r.u32("an opening's index")?;
        let len = usize::from(r.take(1, "a path's length")?[0]);
        if len > MAX_PATH {
            return Err(PowError::Shape(format!("row {index}: a path of {len}")));
        }
        let path = r
            .take(32 * len, "a path")?
            .chunks_exact(32)
            .map(|c| {
                let mut h = [0u8; 32];
                h.copy_from_slice(c);
                h
            })
            .collect();
        let row = r
            .take(4 * n as usize, "a row")?
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        openings.push(Opening { index, row, path });
    }
    if !r.0.is_empty() {
        return Err(PowError::Shape(format!(
            "{} bytes after the last opening",
            r.0.len()
        )));
    }
    Ok(Proof { root, openings })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::challenge::{Challenge, Matrix, matrix, seed};

    #[test]
    fn round_trip_and_every_malformed_body_refused() {
        let ch = Challenge {
            seed: seed(b"n", "l", 0, b"k", 0),
            params: Params { n: 32, k: 5 },
        };
        let (a, b) = (
            matrix(&ch.seed, Matrix::A, 32),
            matrix(&ch.seed, Matrix::B, 32),
        );
        let c = crate::cpu::product(&a, &b, 32, 1);
        let p = crate::proof::Committed::new(&ch, crate::cpu::leaves(&c, 32, 1))
            .unwrap()
            .open(&[5; 32], |i| {
                Ok(c[i as usize * 32..(i as usize + 1) * 32].to_vec())
            })
            .unwrap();
        let bytes = encode(&p);
        assert!(bytes.len() <= max_len(ch.params));
        assert_eq!(decode(&bytes, ch.params).unwrap(), p);
        // Every truncation is refused, none panics.
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut], ch.params).is_err(), "cut at {cut}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(decode(&long, ch.params), Err(PowError::Shape(m)) if m.contains("after")));
        let other = Params { n: 32, k: 6 };
        assert!(
            matches!(decode(&bytes, other), Err(PowError::Shape(m)) if m.contains("challenge is"))
        );
        let mut bad = bytes.clone();
        bad[0] ^= 1;
        assert!(matches!(decode(&bad, ch.params), Err(PowError::Shape(m)) if m.contains("magic")));
        let huge = vec![0u8; max_len(ch.params) + 1];
        assert!(
            matches!(decode(&huge, ch.params), Err(PowError::Shape(m)) if m.contains("more than"))
        );
        // A path longer than any tree of 2^14 leaves has.
        let at = 16 + 8 + 32 + 4;
        let mut bad = bytes.clone();
        bad[at] = 200;
        assert!(decode(&bad, ch.params).is_err());
    }
}
