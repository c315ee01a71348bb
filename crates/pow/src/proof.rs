//! The commitment, the rows it opens, and their verification.

use cgx_protocol::merkle::{Hash, Tree, leaf_hash, verify_inclusion};

use crate::PowError;
use crate::challenge::{Challenge, Matrix, fill_rows};
use crate::cpu::row_bytes;
use crate::philox::philox4x32_10;

/// Freivalds' r takes values in [−2²⁰, 2²⁰): a wrong row passes its check with probability at
/// most 2⁻²¹ (a nonzero difference d has d·r = 0 for at most one value of any rᵢ with dᵢ ≠ 0).
const R_BITS: u32 = 21;

/// One opened row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opening {
    pub index: u32,
    pub row: Vec<i32>,
    pub path: Vec<Hash>,
}

/// A proof: the root of the rows, y = C·r, and the k rows the root selects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proof {
    pub root: Hash,
    pub y: Vec<i64>,
    pub openings: Vec<Opening>,
}

/// A Philox key and counter words from SHA-256(label ‖ seed ‖ root): what the root decides.
fn derived(seed: &[u8; 32], root: &Hash, label: &[u8]) -> [u32; 4] {
    let mut c = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    c.update(b"cgx-pow-v1/");
    c.update(label);
    c.update(seed);
    c.update(root);
    let d = c.finish();
    let b = d.as_ref();
    let w = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    [w(0), w(4), w(8), w(12)]
}

/// The rows a root selects: k distinct indices below n, in the order drawn (uniform:
/// candidates past the largest multiple of n below 2³² are dropped).
pub fn rows_to_open(seed: &[u8; 32], root: &Hash, n: u32, k: u32) -> Vec<u32> {
    let d = derived(seed, root, b"open");
    let limit = (u64::from(u32::MAX) + 1) / u64::from(n.max(1)) * u64::from(n.max(1));
    let mut picked = Vec::with_capacity(k as usize);
    let mut seen = std::collections::HashSet::new();
    let mut block = 0u64;
    while picked.len() < k.min(n) as usize {
        for w in philox4x32_10(
            [block as u32, (block >> 32) as u32, d[2], d[3]],
            [d[0], d[1]],
        ) {
            if u64::from(w) < limit {
                let i = w % n;
                if picked.len() < k as usize && seen.insert(i) {
                    picked.push(i);
                }
            }
        }
        block += 1;
    }
    picked
}

/// Freivalds' vector r for a root (n values in [−2²⁰, 2²⁰)).
pub fn freivalds_vector(seed: &[u8; 32], root: &Hash, n: u32) -> Vec<i64> {
    let d = derived(seed, root, b"freivalds");
    let mask = (1u32 << R_BITS) - 1;
    (0..n.div_ceil(4))
        .flat_map(|b| philox4x32_10([b, 0, d[2], d[3]], [d[0], d[1]]))
        .take(n as usize)
        .map(|w| i64::from(w & mask) - (1i64 << (R_BITS - 1)))
        .collect()
}

/// x·l for an int8 row and |lᵢ| < 2¹⁴: products below 2²¹, summed 512 at a time in i32 (below
/// 2³⁰), then in i64 — exact, and the shape x86's pmaddwd (in every x86-64) computes eight at
/// a time.
fn dot_limb(x: &[i8], l: &[i16]) -> i64 {
    x.chunks(512)
        .zip(l.chunks(512))
        .map(|(a, b)| {
            i64::from(
                a.iter()
                    .zip(b)
                    .map(|(&p, &q)| i32::from(p) * i32::from(q))
                    .sum::<i32>(),
            )
        })
        .sum()
}

/// Bits per limb.
const LIMB: u32 = 14;

/// v as limbs of [`LIMB`] bits, v = Σⱼ lⱼ·2¹⁴ʲ: the lower limbs in [0, 2¹⁴), the top one
/// signed and below 2¹³ in magnitude — as few limbs as v's largest value needs.
fn limbs(v: &[i64]) -> Vec<Vec<i16>> {
    let max = v.iter().map(|x| x.unsigned_abs()).max().unwrap_or(0);
    let mut count = 1u32;
    while count < 5 && (max >> (LIMB * (count - 1))) >= 1 << 13 {
        count += 1;
    }
    (0..count)
        .map(|j| {
            v.iter()
                .map(|&x| {
                    let shifted = x >> (LIMB * j);
                    if j + 1 == count {
                        shifted as i16
                    } else {
                        (shifted & ((1 << LIMB) - 1)) as i16
                    }
                })
                .collect()
        })
        .collect()
}

/// M·v for the seed's matrix `m` (n×n int8, generated sixteen rows at a time, never whole)
/// and |vᵢ| < 2⁴⁸ (v in [`limbs`], each taken by [`dot_limb`]).
fn mat_vec(seed: &[u8; 32], m: Matrix, n: u32, v: &[i64]) -> Vec<i64> {
    let nu = n as usize;
    let parts = limbs(v);
    let mut out = Vec::with_capacity(nu);
    let mut rows = vec![0i8; 16 * nu];
    for first in (0..n).step_by(16) {
        fill_rows(seed, m, n, first..first + 16, &mut rows);
        for row in rows.chunks(nu) {
            out.push(
                parts
                    .iter()
                    .enumerate()
                    .map(|(j, l)| dot_limb(row, l) << (LIMB * j as u32))
                    .sum(),
            );
        }
    }
    out
}

fn row_dot(row: &[i32], r: &[i64]) -> i64 {
    row.iter().zip(r).map(|(&c, &x)| i64::from(c) * x).sum()
}

/// The prover's side, after the product: commit to `c`'s rows (their leaf hashes `leaves`),
/// compute y = C·r for the root's r, open the rows the root selects.
pub fn prove(ch: &Challenge, c: &[i32], leaves: Vec<Hash>) -> Result<Proof, PowError> {
    ch.params.check()?;
    let n = ch.params.n as usize;
    if c.len() != n * n || leaves.len() != n {
        return Err(PowError::Shape(format!(
            "{} values and {} leaves for n = {n}",
            c.len(),
            leaves.len()
        )));
    }
    let tree = Tree::new(leaves);
    let root = tree.root();
    let r = freivalds_vector(&ch.seed, &root, ch.params.n);
    let y = c.chunks(n).map(|row| row_dot(row, &r)).collect();
    let openings = rows_to_open(&ch.seed, &root, ch.params.n, ch.params.k)
        .into_iter()
        .map(|i| Opening {
            index: i,
            row: c[i as usize * n..(i as usize + 1) * n].to_vec(),
            path: tree.path(i as usize).unwrap_or_default(),
        })
        .collect();
    Ok(Proof { root, y, openings })
}

/// A challenge's verifier. It holds only the challenge: A and B are generated sixteen rows at
/// a time while they are multiplied, so verifying an n = 16 384 challenge needs a few hundred
/// KiB, not the 512 MiB of the matrices.
#[derive(Debug, Clone)]
pub struct Verifier {
    ch: Challenge,
}

impl Verifier {
    pub fn new(ch: Challenge) -> Result<Verifier, PowError> {
        ch.params.check()?;
        Ok(Verifier { ch })
    }

    pub fn challenge(&self) -> &Challenge {
        &self.ch
    }

    /// The whole check: [`Verifier::verify_commitment`], then [`Verifier::verify_product`].
    pub fn verify(&self, p: &Proof) -> Result<(), PowError> {
        self.verify_commitment(p)?;
        self.verify_product(p)
    }

    /// The cheap part, O(k·n): the rows opened are the ones the root selects, each lies under
    /// the root and agrees with y (Cᵢ·r = yᵢ). Every refusal names its row.
    pub fn verify_commitment(&self, p: &Proof) -> Result<(), PowError> {
        let (n, k) = (self.ch.params.n, self.ch.params.k);
        let nu = n as usize;
        if p.y.len() != nu {
            return Err(PowError::Shape(format!(
                "y has {} values, n is {n}",
                p.y.len()
            )));
        }
        let want = rows_to_open(&self.ch.seed, &p.root, n, k);
        let got: Vec<u32> = p.openings.iter().map(|o| o.index).collect();
        if got != want {
            return Err(PowError::WrongRows { got, want });
        }
        for o in &p.openings {
            if o.row.len() != nu || o.path.len() > 64 {
                return Err(PowError::Shape(format!(
                    "row {}: {} values and a path of {}",
                    o.index,
                    o.row.len(),
                    o.path.len()
                )));
            }
        }
        let r = freivalds_vector(&self.ch.seed, &p.root, n);
        for o in &p.openings {
            let leaf = leaf_hash(&row_bytes(&o.row));
            if !verify_inclusion(&leaf, u64::from(o.index), u64::from(n), &o.path, &p.root) {
                return Err(PowError::Path { row: o.index });
            }
            if row_dot(&o.row, &r) != p.y[o.index as usize] {
                return Err(PowError::Row { row: o.index });
            }
        }
        Ok(())
    }

    /// The costly part, O(n²), exact: y = A·(B·r). It regenerates both matrices (2n² Philox
    /// bytes) — what bounds how many GPUs one broker core keeps verified.
    pub fn verify_product(&self, p: &Proof) -> Result<(), PowError> {
        let n = self.ch.params.n;
        if p.y.len() != n as usize {
            return Err(PowError::Shape(format!(
                "y has {} values, n is {n}",
                p.y.len()
            )));
        }
        let r = freivalds_vector(&self.ch.seed, &p.root, n);
        let br = mat_vec(&self.ch.seed, Matrix::B, n, &r);
        let abr = mat_vec(&self.ch.seed, Matrix::A, n, &br);
        if let Some(row) = abr.iter().zip(&p.y).position(|(a, y)| a != y) {
            return Err(PowError::Product { row: row as u32 });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::challenge::{Params, matrix, seed};
    use crate::cpu;

    fn honest(n: u32, k: u32) -> (Challenge, Vec<i32>, Proof) {
        let ch = Challenge {
            seed: seed(b"nonce", "lease-1", 3, b"node key", 0),
            params: Params { n, k },
        };
        let a = matrix(&ch.seed, Matrix::A, n);
        let b = matrix(&ch.seed, Matrix::B, n);
        let c = cpu::product(&a, &b, n as usize, 2);
        let p = prove(&ch, &c, cpu::leaves(&c, n as usize, 2)).unwrap();
        (ch, c, p)
    }

    #[test]
    fn an_honest_proof_verifies_and_each_forgery_is_refused_with_its_reason() {
        let (ch, c, p) = honest(64, 16);
        let v = Verifier::new(ch).unwrap();
        v.verify(&p).unwrap();
        assert_eq!(p.openings.len(), 16);
        let mut sorted: Vec<u32> = p.openings.iter().map(|o| o.index).collect();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 16, "distinct rows");

        // Another challenge (another lease, window, key or GPU): its y is not this A·B·r.
        let other = Challenge {
            seed: seed(b"nonce", "lease-1", 3, b"node key", 1),
            ..ch
        };
        assert!(matches!(
            Verifier::new(other).unwrap().verify(&p),
            Err(PowError::WrongRows { .. } | PowError::Product { .. })
        ));
        // A y that is not the product's.
        let mut bad = p.clone();
        bad.y[5] += 1;
        assert_eq!(v.verify(&bad), Err(PowError::Product { row: 5 }));
        // An opened row changed (and y left as computed): its path fails.
        let mut bad = p.clone();
        bad.openings[0].row[0] ^= 1;
        assert_eq!(
            v.verify(&bad),
            Err(PowError::Path {
                row: p.openings[0].index
            })
        );
        // Rows other than the root's, or one fewer.
        let mut bad = p.clone();
        bad.openings[1].index = (bad.openings[1].index + 1) % 64;
        assert!(matches!(v.verify(&bad), Err(PowError::WrongRows { .. })));
        let mut bad = p.clone();
        bad.openings.pop();
        assert!(matches!(v.verify(&bad), Err(PowError::WrongRows { .. })));
        // Shapes.
        let mut bad = p.clone();
        bad.y.pop();
        assert!(matches!(v.verify(&bad), Err(PowError::Shape(_))));
        let mut bad = p.clone();
        bad.openings[2].path = vec![[0u8; 32]; 65];
        assert!(matches!(v.verify(&bad), Err(PowError::Shape(_))));
        // A wrong row committed honestly (its leaf is its own hash): caught by Freivalds when
        // opened — y was computed from the true product, so Cᵢ·r ≠ yᵢ.
        let i = p.openings[3].index as usize;
        let mut wrong = c.clone();
        wrong[i * 64] = wrong[i * 64].wrapping_add(1);
        let mut leaves = cpu::leaves(&wrong, 64, 1);
        let forged = prove(&ch, &wrong, leaves.clone()).unwrap();
        // (the forged root selects other rows; the forger's y is its own C·r.) Its y is not
        // A·B·r: refused at the product.
        assert!(matches!(v.verify(&forged), Err(PowError::Product { .. })));
        // A forger that sends the true y with the wrong row committed: refused at that row
        // when it is opened.
        leaves[i] = leaf_hash(&row_bytes(&wrong[i * 64..(i + 1) * 64]));
        let root = Tree::new(leaves.clone()).root();
        let opened = rows_to_open(&ch.seed, &root, 64, 64);
        let r = freivalds_vector(&ch.seed, &root, 64);
        let tree = Tree::new(leaves);
        let all = Proof {
            root,
            y: c.chunks(64).map(|row| row_dot(row, &r)).collect(),
            openings: opened
                .iter()
                .map(|&j| Opening {
                    index: j,
                    row: wrong[j as usize * 64..(j as usize + 1) * 64].to_vec(),
                    path: tree.path(j as usize).unwrap(),
                })
                .collect(),
        };
        let full = Verifier::new(Challenge {
            params: Params { n: 64, k: 64 },
            ..ch
        })
        .unwrap();
        assert_eq!(full.verify(&all), Err(PowError::Row { row: i as u32 }));
    }

    /// The limbed product is the plain one, at the extremes of the values it meets.
    #[test]
    fn mat_vec_by_limbs_is_exact() {
        let s = seed(b"n", "l", 9, b"k", 0);
        let n = 48u32;
        let m = matrix(&s, Matrix::A, n);
        for v in [
            vec![0i64; 48],
            (0..48)
                .map(|i| (i as i64 - 24) * 40_000)
                .collect::<Vec<_>>(),
            (0..48)
                .map(|i| {
                    if i % 2 == 0 {
                        (1i64 << 41) - 1
                    } else {
                        -(1i64 << 41)
                    }
                })
                .collect(),
            (0..48).map(|i| ((i as i64) << 35) - (7 << 30)).collect(),
        ] {
            let want: Vec<i64> = m
                .chunks(48)
                .map(|row| row.iter().zip(&v).map(|(&a, &x)| i64::from(a) * x).sum())
                .collect();
            assert_eq!(mat_vec(&s, Matrix::A, n, &v), want);
        }
    }

    /// Soundness as a figure: a prover whose committed rows are wrong in 10% of places (26 of
    /// 256), sending the true y, passes only when none of the k = 66 opened rows is one of
    /// them. Over 10 000 cheating commitments (each a different set of wrong rows, so a
    /// different root and different rows opened) it must pass at most as often as
    /// (1 − 0.1)⁶⁶ ≈ 9.6 × 10⁻⁴ allows: the exact bound for drawing 66 of 256 without
    /// replacement is C(230, 66)/C(256, 66) ≈ 5.0 × 10⁻⁴. Every trial goes through the verifier.
    #[test]
    fn a_prover_wrong_in_ten_percent_of_rows_passes_at_most_one_time_in_a_thousand() {
        let (n, k, wrong_rows) = (256u32, 66u32, 26usize);
        let (ch, c, _) = honest(n, k);
        let v = Verifier::new(ch).unwrap();
        let nu = n as usize;
        let honest_leaves = cpu::leaves(&c, nu, 2);
        let trials = 10_000u32;
        let mut passed = 0u32;
        for t in 0..trials {
            // Which rows this cheater got wrong: drawn from the trial's own Philox stream.
            let mut bad = std::collections::BTreeSet::new();
            let mut blk = 0u32;
            while bad.len() < wrong_rows {
                for w in philox4x32_10([blk, t, 0x5eed, 0], [7, 11]) {
                    if bad.len() < wrong_rows {
                        bad.insert(w % n);
                    }
                }
                blk += 1;
            }
            let mut leaves = honest_leaves.clone();
            let wrong_row = |i: u32| {
                let mut row = c[i as usize * nu..(i as usize + 1) * nu].to_vec();
                row[(t as usize) % nu] = row[(t as usize) % nu].wrapping_add(1);
                row
            };
            for &i in &bad {
                leaves[i as usize] = leaf_hash(&row_bytes(&wrong_row(i)));
            }
            let tree = Tree::new(leaves);
            let root = tree.root();
            let r = freivalds_vector(&ch.seed, &root, n);
            let proof = Proof {
                root,
                y: c.chunks(nu).map(|row| row_dot(row, &r)).collect(),
                openings: rows_to_open(&ch.seed, &root, n, k)
                    .into_iter()
                    .map(|i| Opening {
                        index: i,
                        row: if bad.contains(&i) {
                            wrong_row(i)
                        } else {
                            c[i as usize * nu..(i as usize + 1) * nu].to_vec()
                        },
                        path: tree.path(i as usize).unwrap(),
                    })
                    .collect(),
            };
            match v.verify(&proof) {
                Ok(()) => passed += 1,
                Err(PowError::Row { row }) => assert!(bad.contains(&row)),
                Err(e) => panic!("trial {t}: {e}"),
            }
        }
        // (1 − 0.1)⁶⁶ · 10 000 ≈ 9.6; the exact rate allows ≈ 5. Deterministic trials: this
        // count is the same on every run.
        eprintln!("cheating prover (10% wrong rows, k = {k}): passed {passed} of {trials}");
        assert!(passed <= 10, "passed {passed} of {trials}");
    }
}
