//! The GPU proof-of-work, sans-IO (DESIGN.md, "Proof of work"): exact integer work, so that a
//! GPU and a CPU agree to the bit.
//!
//! 1. [`challenge`]: a seed bound to the broker's nonce, the lease, the window and the attested
//!    node key; Philox4x32-10 ([`philox`]) turns it into two n×n int8 matrices, element by
//!    element from its index.
//! 2. [`cpu`]: the product C = A·B with int32 accumulation (exact: |aᵢⱼ·bⱼₖ| ≤ 2¹⁴, so n ≤ 2¹⁷
//!    terms never overflow), each row hashed as an RFC 6962 leaf. The CUDA backend computes the
//!    same bytes.
//! 3. [`proof`]: the rows committed in an RFC 6962 tree (`cgx_protocol::merkle`, the log's
//!    hashing); the prover sends the root. Then, and only then, the verifier draws an opening:
//!    k rows and in each a group of 16 columns. The prover sends those rows with their paths;
//!    the verifier checks the paths and recomputes the 16 chosen entries of each row from A's
//!    row and B's columns — O(k·n), exact. A prover whose rows differ from A·B in a fraction φ
//!    of the (row, column group) cells passes with probability ≤ (1−φ)ᵏ.
//! 4. [`backend`]: who computes (the CPU here, the GPU in `cgx-pow-cuda`), in two steps:
//!    commit, then open; [`wire`]: a proof's bytes.

pub mod backend;
pub mod challenge;
pub mod class;
pub mod cpu;
pub mod philox;
pub mod proof;
pub mod wire;

pub use backend::Backend;
pub use challenge::{Challenge, Matrix, Params};
pub use class::GpuClass;
pub use proof::{Opening, Proof, Verifier};

/// Why a challenge or a proof is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PowError {
    #[error("parameters: {0}")]
    Params(&'static str),
    #[error("proof shape: {0}")]
    Shape(String),
    #[error("the proof opens rows {got:?}, the root selects {want:?}")]
    WrongRows { got: Vec<u32>, want: Vec<u32> },
    #[error("row {row}: its path does not lead to the committed root")]
    Path { row: u32 },
    #[error("row {row}, column {col}: the committed value is not (A·B)ᵢⱼ")]
    Cell { row: u32, col: u32 },
}
