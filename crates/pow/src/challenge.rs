//! What a challenge is: its seed (bound to who is asked, for which lease and window) and its
//! size, and the matrices that follow from them.

use crate::PowError;

/// The largest dimension: |(A·(B·r))ᵢ| ≤ n·2⁷·n·2⁷·2²⁰ stays within i64 up to n = 2¹⁴.
pub const MAX_N: u32 = 16_384;

/// A challenge's size: n×n matrices, k rows opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    pub n: u32,
    pub k: u32,
}

impl Params {
    /// The rules every backend relies on: 16 ≤ n ≤ [`MAX_N`], n a multiple of 16 (whole
    /// Philox blocks per row; cuBLAS's int8 kernels want leading dimensions that are multiples
    /// of 4), 1 ≤ k ≤ n.
    pub fn check(&self) -> Result<(), PowError> {
        if self.n < 16 || self.n > MAX_N || !self.n.is_multiple_of(16) {
            return Err(PowError::Params("n: a multiple of 16 from 16 to 16384"));
        }
        if self.k == 0 || self.k > self.n {
            return Err(PowError::Params("k: from 1 to n rows opened"));
        }
        Ok(())
    }
}

/// A challenge: the seed and the size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Challenge {
    pub seed: [u8; 32],
    pub params: Params,
}

/// Which matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Matrix {
    A = 0,
    B = 1,
}

/// A challenge's seed: SHA-256 over a domain label and each field, length-prefixed (u32
/// big-endian), so that no two different bindings share a seed — the broker's nonce, the
/// lease, the metering window, the attested node key (its public key bytes) and the GPU (its
/// index in the lease): one GPU's answer is no other's.
pub fn seed(nonce: &[u8], lease: &str, window: u64, node_key: &[u8], gpu: u32) -> [u8; 32] {
    let mut c = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    c.update(b"cgx-pow-v1/challenge");
    for field in [
        nonce,
        lease.as_bytes(),
        &window.to_be_bytes(),
        node_key,
        &gpu.to_be_bytes(),
    ] {
        c.update(&(field.len() as u32).to_be_bytes());
        c.update(field);
    }
    let mut out = [0u8; 32];
    out.copy_from_slice(c.finish().as_ref());
    out
}

/// The seed's first four little-endian words: the Philox key (s₀, s₁) and the counter's upper
/// words (s₂, s₃) every backend generates the matrices from.
pub fn seed_words(seed: &[u8; 32]) -> [u32; 4] {
    let w = |i: usize| u32::from_le_bytes([seed[i], seed[i + 1], seed[i + 2], seed[i + 3]]);
    [w(0), w(4), w(8), w(12)]
}

/// Rows `rows` of matrix `m` (n×n, row-major, int8) into `out` (`rows.len() · n` bytes).
///
/// Element e = i·n + j is byte e mod 16 of Philox block b = e / 16, the block's four words
/// little-endian; the block's counter is (b mod 2³², b / 2³², s₂ ⊕ m, s₃) under the key
/// (s₀, s₁), s₀…s₃ the seed's first four little-endian words. A GPU thread computes any
/// block from its index alone.
// Lanes are indexed across four arrays at once: the shape the compiler vectorizes.
#[allow(clippy::needless_range_loop)]
pub fn fill_rows(seed: &[u8; 32], m: Matrix, n: u32, rows: std::ops::Range<u32>, out: &mut [i8]) {
    use crate::philox::{LANES, philox4x32_10_lanes};
    let s = seed_words(seed);
    let first = u64::from(rows.start) * u64::from(n) / 16;
    let len = out.len();
    let blocks = len.div_ceil(16);
    let mut done = 0usize;
    while done < blocks {
        let mut ctr = [[0u32; LANES]; 4];
        for l in 0..LANES {
            let b = first + (done + l) as u64;
            ctr[0][l] = b as u32;
            ctr[1][l] = (b >> 32) as u32;
            ctr[2][l] = s[2] ^ m as u32;
            ctr[3][l] = s[3];
        }
        let w = philox4x32_10_lanes(ctr, [s[0], s[1]]);
        for l in 0..LANES.min(blocks - done) {
            let mut block = [0u8; 16];
            for (i, word) in [w[0][l], w[1][l], w[2][l], w[3][l]].into_iter().enumerate() {
                block[4 * i..4 * i + 4].copy_from_slice(&word.to_le_bytes());
            }
            let at = (done + l) * 16;
            let end = (at + 16).min(len);
            for (o, &b) in out[at..end].iter_mut().zip(&block) {
                *o = b as i8;
            }
        }
        done += LANES;
    }
}

/// The whole matrix.
pub fn matrix(seed: &[u8; 32], m: Matrix, n: u32) -> Vec<i8> {
    let mut out = vec![0i8; (n as usize) * (n as usize)];
    fill_rows(seed, m, n, 0..n, &mut out);
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn parameters_and_seeds() {
        for (p, ok) in [
            (Params { n: 16, k: 1 }, true),
            (Params { n: 8192, k: 66 }, true),
            (Params { n: 8, k: 1 }, false),
            (Params { n: 24, k: 1 }, false),
            (Params { n: 32768, k: 1 }, false),
            (Params { n: 64, k: 0 }, false),
            (Params { n: 64, k: 65 }, false),
        ] {
            assert_eq!(p.check().is_ok(), ok, "{p:?}");
        }
        let s = seed(b"nonce", "l1", 7, b"key", 0);
        assert_ne!(s, seed(b"nonce", "l2", 7, b"key", 0));
        assert_ne!(s, seed(b"nonce", "l1", 8, b"key", 0));
        assert_ne!(
            s,
            seed(b"nonc", "el1", 7, b"key", 0),
            "fields are length-prefixed"
        );
        assert_ne!(s, seed(b"nonce", "l1", 7, b"kez", 0));
        assert_ne!(s, seed(b"nonce", "l1", 7, b"key", 1), "another GPU");
    }

    /// Any rows computed alone equal the same rows of the whole matrix, and A ≠ B.
    #[test]
    fn rows_follow_from_their_index() {
        let s = seed(b"n", "l", 1, b"k", 0);
        let a = matrix(&s, Matrix::A, 48);
        let mut part = vec![0i8; 5 * 48];
        fill_rows(&s, Matrix::A, 48, 17..22, &mut part);
        assert_eq!(&a[17 * 48..22 * 48], &part[..]);
        assert_ne!(a, matrix(&s, Matrix::B, 48));
        // The first block is Philox of counter (0, 0, s₂, s₃): bytes little-endian.
        let w = seed_words(&s);
        let b0 = crate::philox::philox4x32_10([0, 0, w[2], w[3]], [w[0], w[1]]);
        assert_eq!(
            a[..4].iter().map(|&x| x as u8).collect::<Vec<_>>(),
            b0[0].to_le_bytes()
        );
    }
}
