//! Challenge sizes and deadlines per GPU class (issue 31, item 2), and the timing model they
//! rest on. Figures marked *datasheet* are NVIDIA's; those marked *assumed* are ours and are
//! to be replaced by measurements on the hardware (`cgx-bench pow` on a GPU host).
//!
//! One challenge at n = 16 384 does, on the GPU:
//! - generation: 2n² = 512 MiB of Philox output (A and B);
//! - the product: 2n³ = 8.80 × 10¹² int8 operations (tensor cores, int32 accumulation);
//! - hashing: C is n² int32 = 1 GiB, read once to hash each row (SHA-256);
//! - memory touched: 1.5 GiB (A, B, C) of the GPU's 80 GB (H100) or 141 GB (H200).
//!
//! At the *assumed* 70% of the *datasheet* dense int8 peak (1 979 TOPS for both H100 SXM and
//! H200 SXM) the product takes 6.35 ms; generation and hashing, bound by memory bandwidth
//! (3.35 TB/s H100, 4.8 TB/s H200; 2 GiB moved) and SHA-256 throughput, add about 2.5 ms
//! (H100) and 2 ms (H200). Expected: 9 ms (H100), 8.5 ms (H200), rounded up to 10 ms and 9 ms.
//!
//! Two deadlines, for two different provers:
//! - **The GPU's**: the agent (the measured guest image, trusted by attestation) times the
//!   work on the device with CUDA events (generation, product, hashing; not allocation, the
//!   host's tree or the copies) and signs that time with the node key in its commitment. It
//!   must be at most [`GPU_MARGIN_PCT`]% of the class's expected time: a GPU of half the
//!   claimed speed needs 200%, so it misses by 25% of the expected time (2.5 ms at 10 ms, far
//!   above CUDA event resolution, 0.5 µs). Assumed: the challenge is not slowed more than 60%
//!   by the tenant's own kernels time-sliced on the same GPU; a challenge that is counts as a
//!   miss, and only `[pow] misses_allowed` misses in a row cost the node its leases.
//! - **The wall clock's**, on the broker: from the challenge's issue to its commitment at most
//!   the GPU deadline plus [`ALLOWANCE_MS`] (the heartbeat that carries the challenge, the
//!   upload, scheduling), and the proof within [`ALLOWANCE_MS`] of the opening. It does not tell half speed from full at 10 ms (the allowance is
//!   larger) — it refuses answers that are late or missing whatever the agent says, and bounds
//!   what a prover outside the attested image could borrow from elsewhere.
//!
//! Attestation already proves which GPU this is (its certificate chain and serial, CC mode on,
//! firmware measured); the proof shows that the attested GPUs are present in this VM and
//! computing now, at their class's speed.

use crate::challenge::Params;

/// Rows opened per challenge: (1 − 0.1)⁶⁶ < 10⁻³, so a prover wrong in 10% of rows passes at
/// most once in a thousand (drawing without replacement makes it smaller still).
pub const K: u32 = 66;

/// The GPU deadline, as a percentage of the class's expected time.
pub const GPU_MARGIN_PCT: u64 = 160;

/// What the broker's wall-clock deadline allows beyond the GPU's (ms).
pub const ALLOWANCE_MS: u64 = 5_000;

/// A GPU class: its challenge and what it should take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuClass {
    /// The marketplace's model name (a node record's `gpu_model`).
    pub model: &'static str,
    pub params: Params,
    /// The expected time of one challenge on the device (ms).
    pub expected_ms: u64,
    /// Datasheet dense int8 peak (TOPS), for the benchmark's ratio.
    pub peak_int8_tops: u32,
}

/// The classes with a challenge.
pub const CLASSES: [GpuClass; 2] = [
    GpuClass {
        model: "H100",
        params: Params { n: 16_384, k: K },
        expected_ms: 10,
        peak_int8_tops: 1_979,
    },
    GpuClass {
        model: "H200",
        params: Params { n: 16_384, k: K },
        expected_ms: 9,
        peak_int8_tops: 1_979,
    },
];

/// The class of a model, if it has one.
pub fn class(model: &str) -> Option<&'static GpuClass> {
    CLASSES.iter().find(|c| c.model == model)
}

/// The GPU deadline for an expected time (ms).
pub fn gpu_deadline_ms(expected_ms: u64) -> u64 {
    expected_ms.saturating_mul(GPU_MARGIN_PCT) / 100
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The margin's promise: full speed passes, half speed misses, for every class.
    #[test]
    fn half_speed_misses_the_gpu_deadline() {
        for c in CLASSES {
            c.params
                .check()
                .unwrap_or_else(|e| panic!("{}: {e}", c.model));
            let d = gpu_deadline_ms(c.expected_ms);
            assert!(c.expected_ms <= d, "{}", c.model);
            assert!(2 * c.expected_ms > d, "{}: half speed passes", c.model);
        }
        // 0.9^66 < 1e-3.
        assert!(0.9f64.powi(K as i32) < 1e-3);
        assert_eq!(class("H100").map(|c| c.params.n), Some(16_384));
        assert!(class("A100").is_none());
    }
}
