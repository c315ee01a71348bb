//! The commitment, the cells the verifier opens, and their verification.
//!
//! The prover commits to the rows of C = A·B (the root of an RFC 6962 tree whose leaves are
//! the rows) and sends the root. Only then does the verifier draw its **opening** — 32 random
//! bytes the prover could not know when it committed — from which follow the k rows to open
//! and, in each, one group of 16 columns. The prover sends those rows with their paths; the
//! verifier checks each path and recomputes the row's 16 chosen entries from A's row and 16
//! columns of B (n Philox blocks: a column group of B is one 16-byte block in every row).
//!
//! Soundness: if the committed rows differ from A·B in a fraction φ of the n × n/16 cells (a
//! row and a group of 16 columns), each opened cell is wrong with probability φ whatever the
//! prover did, so it passes with probability at most (1 − φ)ᵏ — k = 66 and φ = 10%: < 10⁻³.
//! A prover that skips a tenth of the rows has φ ≥ 10%. Because the opening comes after the
//! commitment, no choice of root can steer which cells are opened (no grinding), and a
//! verification costs O(k·n), not O(n²): about k·n Philox blocks and k·16·n multiply-adds.

use cgx_protocol::merkle::{Hash, Tree, leaf_hash, verify_inclusion};

use crate::PowError;
use crate::challenge::{Challenge, Matrix, fill_rows, seed_words};
use crate::cpu::row_bytes;
use crate::philox::{LANES, philox4x32_10, philox4x32_10_lanes};

/// Columns per opened group (one Philox block of a row of B).
pub const GROUP: u32 = 16;

/// One opened row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opening {
    pub index: u32,
    pub row: Vec<i32>,
    pub path: Vec<Hash>,
}

/// A proof: the committed root and the rows the opening selects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proof {
    pub root: Hash,
    pub openings: Vec<Opening>,
}

/// The cells an opening selects: k distinct rows below n, each with a group of 16 columns
/// (its first column, a multiple of 16), in the order drawn. Uniform: candidates past the
/// largest multiple of the range below 2³² are dropped.
pub fn cells(seed: &[u8; 32], root: &Hash, opening: &[u8; 32], n: u32, k: u32) -> Vec<(u32, u32)> {
    let mut c = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    c.update(b"cgx-pow-v2/open");
    c.update(seed);
    c.update(root);
    c.update(opening);
    let d = c.finish();
    let b = d.as_ref();
    let w = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let (key, c2, c3) = ([w(0), w(4)], w(8), w(12));
    let uniform = |range: u32, x: u32| -> Option<u32> {
        let range = range.max(1);
        let limit = (u64::from(u32::MAX) + 1) / u64::from(range) * u64::from(range);
        (u64::from(x) < limit).then_some(x % range)
    };
    let groups = (n / GROUP).max(1);
    let want = k.min(n) as usize;
    let mut picked: Vec<(u32, u32)> = Vec::with_capacity(want);
    let mut seen = std::collections::HashSet::new();
    let mut block = 0u64;
    let mut pending_row: Option<u32> = None;
    while picked.len() < want {
        for x in philox4x32_10([block as u32, (block >> 32) as u32, c2, c3], key) {
            if picked.len() == want {
                break;
            }
            match pending_row {
                None => {
                    if let Some(r) = uniform(n, x)
                        && seen.insert(r)
                    {
                        pending_row = Some(r);
                    }
                }
                Some(r) => {
                    if let Some(g) = uniform(groups, x) {
                        picked.push((r, g * GROUP));
                        pending_row = None;
                    }
                }
            }
        }
        block += 1;
    }
    picked
}

/// Columns `col..col + 16` of the seed's matrix `m`: for each of its n rows, the 16-byte
/// Philox block that holds them (n blocks, eight at a time).
// Lanes are indexed across four arrays at once: the shape the compiler vectorizes.
#[allow(clippy::needless_range_loop)]
pub fn column_group(seed: &[u8; 32], m: Matrix, n: u32, col: u32) -> Vec<[i8; 16]> {
    let s = seed_words(seed);
    let per_row = u64::from(n / GROUP);
    let first = u64::from(col / GROUP);
    let mut out = Vec::with_capacity(n as usize);
    let mut row = 0u32;
    while row < n {
        let mut ctr = [[0u32; LANES]; 4];
        for (l, lane) in (0..LANES).enumerate() {
            let b = u64::from(row + lane as u32) * per_row + first;
            ctr[0][l] = b as u32;
            ctr[1][l] = (b >> 32) as u32;
            ctr[2][l] = s[2] ^ m as u32;
            ctr[3][l] = s[3];
        }
        let w = philox4x32_10_lanes(ctr, [s[0], s[1]]);
        for l in 0..LANES.min((n - row) as usize) {
            let mut block = [0i8; 16];
            for (i, word) in [w[0][l], w[1][l], w[2][l], w[3][l]].into_iter().enumerate() {
                for (j, byte) in word.to_le_bytes().into_iter().enumerate() {
                    block[4 * i + j] = byte as i8;
                }
            }
            out.push(block);
        }
        row += LANES as u32;
    }
    out
}

/// The prover's side: commit to `c`'s rows (their leaf hashes), as [`Committed`].
#[derive(Debug, Clone)]
pub struct Committed {
    pub n: u32,
    pub k: u32,
    pub seed: [u8; 32],
    pub tree: Tree,
}

impl Committed {
    pub fn new(ch: &Challenge, leaves: Vec<Hash>) -> Result<Committed, PowError> {
        ch.params.check()?;
        if leaves.len() != ch.params.n as usize {
            return Err(PowError::Shape(format!(
                "{} leaves for n = {}",
                leaves.len(),
                ch.params.n
            )));
        }
        Ok(Committed {
            n: ch.params.n,
            k: ch.params.k,
            seed: ch.seed,
            tree: Tree::new(leaves),
        })
    }

    pub fn root(&self) -> Hash {
        self.tree.root()
    }

    /// The rows `opening` selects, each fetched by `row` (from wherever C lives).
    pub fn open(
        &self,
        opening: &[u8; 32],
        mut row: impl FnMut(u32) -> Result<Vec<i32>, PowError>,
    ) -> Result<Proof, PowError> {
        let root = self.root();
        let mut openings = Vec::with_capacity(self.k as usize);
        for (i, _) in cells(&self.seed, &root, opening, self.n, self.k) {
            openings.push(Opening {
                index: i,
                row: row(i)?,
                path: self.tree.path(i as usize).unwrap_or_default(),
            });
        }
        Ok(Proof { root, openings })
    }
}

/// A challenge's verifier. It holds only the challenge: the rows of A and the column groups
/// of B it needs are generated when a proof is checked.
#[derive(Debug, Clone)]
pub struct Verifier {
    ch: Challenge,
}

/// The largest |Cᵢⱼ| of a true product: n · 2⁷ · 2⁷.
fn bound(n: u32) -> i64 {
    i64::from(n) << 14
}

impl Verifier {
    pub fn new(ch: Challenge) -> Result<Verifier, PowError> {
        ch.params.check()?;
        Ok(Verifier { ch })
    }

    pub fn challenge(&self) -> &Challenge {
        &self.ch
    }

    /// Check `p` against the root the prover committed to (`root`) and the opening the
    /// verifier then drew: the rows it selects, each under the root, each right in its
    /// selected 16 columns. Every refusal names its row.
    pub fn verify(&self, root: &Hash, opening: &[u8; 32], p: &Proof) -> Result<(), PowError> {
        let (n, k) = (self.ch.params.n, self.ch.params.k);
        let nu = n as usize;
        if &p.root != root {
            return Err(PowError::Shape(
                "the proof's root is not the one committed".into(),
            ));
        }
        let want = cells(&self.ch.seed, root, opening, n, k);
        let got: Vec<u32> = p.openings.iter().map(|o| o.index).collect();
        if got.len() != want.len() || got.iter().zip(&want).any(|(g, (w, _))| g != w) {
            return Err(PowError::WrongRows {
                got,
                want: want.iter().map(|(r, _)| *r).collect(),
            });
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
            if let Some(j) = o.row.iter().position(|v| i64::from(*v).abs() > bound(n)) {
                return Err(PowError::Cell {
                    row: o.index,
                    col: j as u32,
                });
            }
            let leaf = leaf_hash(&row_bytes(&o.row));
            if !verify_inclusion(&leaf, u64::from(o.index), u64::from(n), &o.path, root) {
                return Err(PowError::Path { row: o.index });
            }
        }
        // Every opened cell is recomputed before a refusal is returned: a verification costs
        // the same whatever the proof (and the benchmark measures the real cost).
        let mut a_row = vec![0i8; nu];
        let mut first_wrong = None;
        for (o, &(i, col)) in p.openings.iter().zip(&want) {
            fill_rows(&self.ch.seed, Matrix::A, n, i..i + 1, &mut a_row);
            let b = column_group(&self.ch.seed, Matrix::B, n, col);
            let mut acc = [0i32; GROUP as usize];
            for (&a, block) in a_row.iter().zip(&b) {
                let a = i32::from(a);
                for (s, &x) in acc.iter_mut().zip(block) {
                    *s += a * i32::from(x);
                }
            }
            if first_wrong.is_none()
                && let Some(t) = (0..GROUP as usize).find(|&t| o.row[col as usize + t] != acc[t])
            {
                first_wrong = Some(PowError::Cell {
                    row: i,
                    col: col + t as u32,
                });
            }
        }
        if let Some(e) = first_wrong {
            return Err(e);
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

    fn honest(n: u32, k: u32) -> (Challenge, Vec<i32>, Committed) {
        let ch = Challenge {
            seed: seed(b"nonce", "lease-1", 3, b"node key", 0),
            params: Params { n, k },
        };
        let a = matrix(&ch.seed, Matrix::A, n);
        let b = matrix(&ch.seed, Matrix::B, n);
        let c = cpu::product(&a, &b, n as usize, 2);
        let committed = Committed::new(&ch, cpu::leaves(&c, n as usize, 2)).unwrap();
        (ch, c, committed)
    }

    fn rows_of(c: &[i32], n: usize) -> impl FnMut(u32) -> Result<Vec<i32>, PowError> + '_ {
        move |i| Ok(c[i as usize * n..(i as usize + 1) * n].to_vec())
    }

    #[test]
    fn column_groups_are_the_matrix_columns() {
        let s = seed(b"n", "l", 1, b"k", 0);
        let m = matrix(&s, Matrix::B, 48);
        for col in [0u32, 16, 32] {
            let g = column_group(&s, Matrix::B, 48, col);
            for (r, block) in g.iter().enumerate() {
                assert_eq!(
                    &block[..],
                    &m[r * 48 + col as usize..r * 48 + col as usize + 16]
                );
            }
        }
        // Cells: k distinct rows, groups aligned and in range, all fixed by the inputs.
        let c = cells(&s, &[1; 32], &[2; 32], 64, 20);
        assert_eq!(c.len(), 20);
        let mut rows: Vec<u32> = c.iter().map(|x| x.0).collect();
        rows.sort_unstable();
        rows.dedup();
        assert_eq!(rows.len(), 20);
        assert!(c.iter().all(|&(r, g)| r < 64 && g % 16 == 0 && g < 64));
        assert_eq!(c, cells(&s, &[1; 32], &[2; 32], 64, 20));
        assert_ne!(c, cells(&s, &[1; 32], &[3; 32], 64, 20), "another opening");
        assert_ne!(c, cells(&s, &[4; 32], &[2; 32], 64, 20), "another root");
    }

    #[test]
    fn an_honest_proof_verifies_and_each_forgery_is_refused_with_its_reason() {
        let (ch, c, committed) = honest(64, 16);
        let v = Verifier::new(ch).unwrap();
        let root = committed.root();
        let opening = [9u8; 32];
        let p = committed.open(&opening, rows_of(&c, 64)).unwrap();
        v.verify(&root, &opening, &p).unwrap();
        assert_eq!(p.openings.len(), 16);
        // Another opening selects other cells: the proof for one is not a proof for another.
        assert!(matches!(
            v.verify(&root, &[8u8; 32], &p),
            Err(PowError::WrongRows { .. })
        ));
        // Another challenge (another lease, window, key or GPU): its cells differ, and were
        // they the same rows, its A and B are not these.
        let other = Challenge {
            seed: seed(b"nonce", "lease-1", 3, b"node key", 1),
            ..ch
        };
        assert!(matches!(
            Verifier::new(other).unwrap().verify(&root, &opening, &p),
            Err(PowError::WrongRows { .. } | PowError::Cell { .. })
        ));
        // A root other than the committed one.
        assert!(matches!(
            v.verify(&[0u8; 32], &opening, &p),
            Err(PowError::Shape(m)) if m.contains("committed")
        ));
        // An opened row changed: its path fails.
        let mut bad = p.clone();
        bad.openings[0].row[0] ^= 1;
        assert_eq!(
            v.verify(&root, &opening, &bad),
            Err(PowError::Path {
                row: p.openings[0].index
            })
        );
        // Rows other than the opening's, or one fewer.
        let mut bad = p.clone();
        bad.openings[1].index = (bad.openings[1].index + 1) % 64;
        assert!(matches!(
            v.verify(&root, &opening, &bad),
            Err(PowError::WrongRows { .. })
        ));
        let mut bad = p.clone();
        bad.openings.pop();
        assert!(matches!(
            v.verify(&root, &opening, &bad),
            Err(PowError::WrongRows { .. })
        ));
        // Shapes, and values no product of int8 matrices has.
        let mut bad = p.clone();
        bad.openings[2].path = vec![[0u8; 32]; 65];
        assert!(matches!(
            v.verify(&root, &opening, &bad),
            Err(PowError::Shape(_))
        ));
        let mut bad = p.clone();
        bad.openings[2].row[5] = i32::MAX;
        assert!(matches!(
            v.verify(&root, &opening, &bad),
            Err(PowError::Cell { col: 5, .. })
        ));
        // A product that is not A·B, committed honestly (its own leaves): the opened cells
        // are recomputed and disagree.
        let zero = vec![0i32; 64 * 64];
        let forged = Committed::new(&ch, cpu::leaves(&zero, 64, 1)).unwrap();
        let fp = forged.open(&opening, rows_of(&zero, 64)).unwrap();
        assert!(matches!(
            v.verify(&forged.root(), &opening, &fp),
            Err(PowError::Cell { .. })
        ));
    }

    /// Soundness as a figure: a prover whose committed rows are wrong in 10% of places (26 of
    /// 256 rows, each wrong in every group), committing before the opening is drawn, passes
    /// only when none of the k = 66 opened rows is one of them. Over 10 000 cheating trials
    /// (each a different set of wrong rows and a fresh opening) it must pass at most as often
    /// as (1 − 0.1)⁶⁶ ≈ 9.6 × 10⁻⁴ allows: the exact bound for drawing 66 of 256 without
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
            // A wrong row: every value off by one (so wrong in every group of 16).
            let wrong_row = |i: u32| -> Vec<i32> {
                c[i as usize * nu..(i as usize + 1) * nu]
                    .iter()
                    .map(|x| x + 1)
                    .collect()
            };
            let mut leaves = honest_leaves.clone();
            for &i in &bad {
                leaves[i as usize] = leaf_hash(&row_bytes(&wrong_row(i)));
            }
            let committed = Committed::new(&ch, leaves).unwrap();
            let root = committed.root();
            // The verifier's opening, drawn after the commitment.
            let o = philox4x32_10([t, 0, 0x0be7, 1], [3, 5]);
            let mut opening = [0u8; 32];
            for (i, w) in o.iter().chain(o.iter()).enumerate() {
                opening[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
            }
            let proof = committed
                .open(&opening, |i| {
                    Ok(if bad.contains(&i) {
                        wrong_row(i)
                    } else {
                        c[i as usize * nu..(i as usize + 1) * nu].to_vec()
                    })
                })
                .unwrap();
            match v.verify(&root, &opening, &proof) {
                Ok(()) => passed += 1,
                Err(PowError::Cell { row, .. }) => assert!(bad.contains(&row)),
                Err(e) => panic!("trial {t}: {e}"),
            }
        }
        // (1 − 0.1)⁶⁶ · 10 000 ≈ 9.6; the exact rate allows ≈ 5. Deterministic trials: this
        // count is the same on every run.
        eprintln!("cheating prover (10% wrong rows, k = {k}): passed {passed} of {trials}");
        assert!(passed <= 10, "passed {passed} of {trials}");
    }
}
