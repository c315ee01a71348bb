//! Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3",
//! SC'11; Random123's `philox4x32`, 10 rounds): a counter-based generator, so any element of a
//! matrix is computed from its index alone — on a GPU thread or a CPU core alike, bit for bit.
//! Pinned to Random123's known-answer vectors (`kat_vectors`), which every backend must meet.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

/// One block: four 32-bit words from a 128-bit counter and a 64-bit key.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (ctr, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let (hi0, lo0) = mulhilo(M0, c[0]);
        let (hi1, lo1) = mulhilo(M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// Lanes of [`philox4x32_10_lanes`].
pub const LANES: usize = 8;

/// [`LANES`] blocks at once, word by word across lanes (`ctr[w][lane]`), so the compiler turns
/// each round into vector multiplies: the generation a verifier does for every challenge runs
/// several times faster than block by block. Same outputs as [`philox4x32_10`] per lane.
// Lanes are indexed across eight arrays at once: the shape the compiler vectorizes.
#[allow(clippy::needless_range_loop)]
pub fn philox4x32_10_lanes(ctr: [[u32; LANES]; 4], key: [u32; 2]) -> [[u32; LANES]; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = ctr;
    let (mut k0, mut k1) = (key[0], key[1]);
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        let mut n0 = [0u32; LANES];
        let mut n1 = [0u32; LANES];
        let mut n2 = [0u32; LANES];
        let mut n3 = [0u32; LANES];
        for l in 0..LANES {
            let p0 = u64::from(M0) * u64::from(c0[l]);
            let p1 = u64::from(M1) * u64::from(c2[l]);
            n0[l] = (p1 >> 32) as u32 ^ c1[l] ^ k0;
            n1[l] = p1 as u32;
            n2[l] = (p0 >> 32) as u32 ^ c3[l] ^ k1;
            n3[l] = p0 as u32;
        }
        (c0, c1, c2, c3) = (n0, n1, n2, n3);
    }
    [c0, c1, c2, c3]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's `kat_vectors`, the three `philox4x32 10` lines: counter, key, output.
    #[test]
    fn random123_known_answers() {
        for (ctr, key, want) in [
            (
                [0, 0, 0, 0],
                [0, 0],
                [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
            ),
            (
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0],
                [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
            ),
        ] {
            assert_eq!(philox4x32_10(ctr, key), want, "{ctr:x?} {key:x?}");
        }
    }

    /// The lane-wise generator is the block function, lane by lane.
    #[test]
    #[allow(clippy::needless_range_loop)]
    fn lanes_are_blocks() {
        let mut ctr = [[0u32; LANES]; 4];
        for l in 0..LANES {
            ctr[0][l] = 1000 + l as u32;
            ctr[1][l] = 7;
            ctr[2][l] = 0xdead_beef ^ l as u32;
            ctr[3][l] = u32::MAX - l as u32;
        }
        let out = philox4x32_10_lanes(ctr, [0x1234_5678, 0x9abc_def0]);
        for l in 0..LANES {
            let one = philox4x32_10(
                [ctr[0][l], ctr[1][l], ctr[2][l], ctr[3][l]],
                [0x1234_5678, 0x9abc_def0],
            );
            assert_eq!(
                [out[0][l], out[1][l], out[2][l], out[3][l]],
                one,
                "lane {l}"
            );
        }
    }
}
