//! The CPU backend: the product and its row leaves on `threads` cores (CI, GPU-less hosts).
//! The bytes are the CUDA backend's: int32 accumulation is exact, so the order of the sums
//! does not matter.

use cgx_protocol::merkle::{Hash, leaf_hash};

/// Bᵀ, so each dot product reads two contiguous rows.
fn transpose(b: &[i8], n: usize) -> Vec<i8> {
    let mut t = vec![0i8; n * n];
    for (i, row) in b.chunks(n).enumerate() {
        for (j, &x) in row.iter().enumerate() {
            t[j * n + i] = x;
        }
    }
    t
}

/// x·y with int32 accumulation (the compiler vectorizes this into multiply-add pairs).
#[inline(always)]
fn dot(x: &[i8], y: &[i8]) -> i32 {
    x.iter()
        .zip(y)
        .map(|(&a, &b)| i32::from(a) * i32::from(b))
        .sum()
}

/// Four rows of A against one column of B (a row of Bᵀ): the column is read once for four
/// outputs, so Bᵀ streams from memory a quarter as often.
#[inline(always)]
fn dot4(a: [&[i8]; 4], y: &[i8]) -> [i32; 4] {
    let mut acc = [0i32; 4];
    for (l, &b) in y.iter().enumerate() {
        let b = i32::from(b);
        for (s, row) in acc.iter_mut().zip(a) {
            *s += i32::from(row[l]) * b;
        }
    }
    acc
}

/// Rows `rows` of A (whole rows, n each) times B (as Bᵀ) into `out`.
#[inline(always)]
fn rows_kernel(out: &mut [i32], rows: &[i8], bt: &[i8], n: usize) {
    for (out, group) in out.chunks_mut(4 * n).zip(rows.chunks(4 * n)) {
        if group.len() == 4 * n {
            let (a0, rest) = group.split_at(n);
            let (a1, rest) = rest.split_at(n);
            let (a2, a3) = rest.split_at(n);
            let (o0, rest) = out.split_at_mut(n);
            let (o1, rest) = rest.split_at_mut(n);
            let (o2, o3) = rest.split_at_mut(n);
            for (j, col) in bt.chunks(n).enumerate() {
                let v = dot4([a0, a1, a2, a3], col);
                (o0[j], o1[j], o2[j], o3[j]) = (v[0], v[1], v[2], v[3]);
            }
        } else {
            for (crow, arow) in out.chunks_mut(n).zip(group.chunks(n)) {
                for (o, col) in crow.iter_mut().zip(bt.chunks(n)) {
                    *o = dot(arow, col);
                }
            }
        }
    }
}

/// [`rows_kernel`] compiled for AVX-512 (BW, VNNI): the same code, wider vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn rows_avx512(out: &mut [i32], rows: &[i8], bt: &[i8], n: usize) {
    rows_kernel(out, rows, bt, n)
}

/// [`rows_kernel`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn rows_avx2(out: &mut [i32], rows: &[i8], bt: &[i8], n: usize) {
    rows_kernel(out, rows, bt, n)
}

/// The widest [`rows_kernel`] this CPU runs.
fn rows_best(out: &mut [i32], rows: &[i8], bt: &[i8], n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
        {
            // SAFETY: the CPU was just found to have every feature rows_avx512 is compiled for.
            #[allow(unsafe_code)]
            unsafe {
                rows_avx512(out, rows, bt, n)
            };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: as above, for AVX2.
            #[allow(unsafe_code)]
            unsafe {
                rows_avx2(out, rows, bt, n)
            };
            return;
        }
    }
    rows_kernel(out, rows, bt, n)
}

/// C = A·B, n×n, row-major, rows split across `threads`, on the widest vectors the CPU has
/// (the same integers on any: the sums are exact).
pub fn product(a: &[i8], b: &[i8], n: usize, threads: usize) -> Vec<i32> {
    product_with(a, b, n, threads, rows_best)
}

/// [`product`] with the baseline x86-64 code only (the tests hold both to the definition).
pub fn product_baseline(a: &[i8], b: &[i8], n: usize, threads: usize) -> Vec<i32> {
    product_with(a, b, n, threads, rows_kernel)
}

fn product_with(
    a: &[i8],
    b: &[i8],
    n: usize,
    threads: usize,
    kernel: fn(&mut [i32], &[i8], &[i8], usize),
) -> Vec<i32> {
    let bt = transpose(b, n);
    let mut c = vec![0i32; n * n];
    // Whole groups of four rows per thread where it can be.
    let per = n.div_ceil(threads.max(1)).div_ceil(4).max(1) * 4;
    std::thread::scope(|s| {
        for (chunk, rows) in c.chunks_mut(per * n).zip(a.chunks(per * n)) {
            let bt = &bt;
            s.spawn(move || kernel(chunk, rows, bt, n));
        }
    });
    c
}

/// The kernel's own ceiling here: [`product`]'s inner loop on four rows and 24 columns of
/// n = 1024 (28 KiB: they stay in L1 cache), on `threads` cores for `millis` — no
/// transposition, no allocation, no memory traffic. Int8 operations (two per multiply-add)
/// per second.
pub fn kernel_peak_ops(threads: usize, millis: u64) -> f64 {
    let n = 1024usize;
    let cols = 24usize;
    let rows: Vec<i8> = (0..4 * n).map(|i| (i * 37 % 251) as u8 as i8).collect();
    let bt: Vec<i8> = (0..cols * n).map(|i| (i * 91 % 241) as u8 as i8).collect();
    let per_call = 2.0 * 4.0 * cols as f64 * n as f64;
    let start = std::time::Instant::now();
    let total: u64 = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads.max(1))
            .map(|_| {
                let (rows, bt) = (&rows, &bt);
                s.spawn(move || {
                    let mut out = vec![0i32; 4 * n];
                    let mut calls = 0u64;
                    while start.elapsed().as_millis() < u128::from(millis) {
                        for _ in 0..64 {
                            rows_best(&mut out, rows, bt, n);
                            std::hint::black_box(&mut out);
                        }
                        calls += 64;
                    }
                    calls
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or(0)).sum()
    });
    total as f64 * per_call / start.elapsed().as_secs_f64()
}

/// A row's leaf data: its int32 values, little-endian.
pub fn row_bytes(row: &[i32]) -> Vec<u8> {
    row.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Each row's RFC 6962 leaf hash, rows split across `threads`.
pub fn leaves(c: &[i32], n: usize, threads: usize) -> Vec<Hash> {
    let mut out = vec![[0u8; 32]; c.len() / n.max(1)];
    let per = out.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        for (hashes, rows) in out.chunks_mut(per).zip(c.chunks(per * n)) {
            s.spawn(move || {
                for (h, row) in hashes.iter_mut().zip(rows.chunks(n)) {
                    *h = leaf_hash(&row_bytes(row));
                }
            });
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the definition, on every thread count, including the extremes of int8.
    #[test]
    fn the_product_is_the_definition_on_any_thread_count() {
        // 32: groups of four rows; 30: a group of two left over.
        for n in [32, 30] {
            check(n);
        }
    }

    fn check(n: usize) {
        let mut a: Vec<i8> = (0..n * n).map(|i| (i * 37 % 256) as u8 as i8).collect();
        let b: Vec<i8> = (0..n * n).map(|i| (i * 91 % 256) as u8 as i8).collect();
        a[0..n].fill(-128);
        let mut want = vec![0i32; n * n];
        for i in 0..n {
            for j in 0..n {
                want[i * n + j] = (0..n)
                    .map(|l| i32::from(a[i * n + l]) * i32::from(b[l * n + j]))
                    .sum();
            }
        }
        for t in [1, 2, 3, 7, 64] {
            assert_eq!(product(&a, &b, n, t), want, "{t} threads");
            assert_eq!(
                product_baseline(&a, &b, n, t),
                want,
                "{t} threads, baseline"
            );
            assert_eq!(leaves(&want, n, t), leaves(&want, n, 1));
        }
        assert_eq!(row_bytes(&[1, -1]), [1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
    }
}
