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
//!    hashing); from the root (Fiat–Shamir) a vector r and the k rows to open; the prover sends
//!    y = C·r and the opened rows with their paths. The verifier checks y = A·(B·r) — O(n²),
//!    exact — and, for each opened row, its path and Cᵢ·r = yᵢ. A wrong row that is opened
//!    fails its Freivalds check except with probability 2⁻²¹; a prover with a fraction f of
//!    wrong rows passes with probability ≤ (1−f)ᵏ (plus those 2⁻²¹ terms).

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
    #[error("y disagrees with A·(B·r) at row {row}: the claimed product is not A·B")]
    Product { row: u32 },
    #[error("row {row}: its path does not lead to the committed root")]
    Path { row: u32 },
    #[error("row {row}: the opened row is not the one y was computed from (Cᵢ·r ≠ yᵢ)")]
    Row { row: u32 },
}
