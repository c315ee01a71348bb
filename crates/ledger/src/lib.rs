//! The marketplace's double-entry ledger, sans-IO (issue 32): no clock, no storage, no I/O —
//! the broker loads what a batch needs, applies it here, and writes the changes back in the
//! same transaction as the state change the money follows.
//!
//! The model is TigerBeetle's:
//! - **accounts** ([`account`]) keep debits and credits, pending and posted, in exact integers
//!   of micros; every role but the world must never go negative, and never does;
//! - **transfers** ([`transfer`]) are immutable and name their cause; corrections are new
//!   transfers, never edits; an id is used once (a retry with the same fields is answered
//!   `Exists`, with others refused), and ids are derived from the cause, so a metering record
//!   is paid at most once;
//! - **two-phase** transfers reserve (pending) and are resolved at most once — posted (in part
//!   or whole) or voided — or expire at their time-out, deterministically;
//! - **linked** transfers apply all or none ([`book`]).
//!
//! [`settle`] holds the marketplace's rules on top: window prices, the fee, a lease's escrow,
//! the slash.

pub mod account;
pub mod book;
pub mod settle;
pub mod transfer;

pub use account::{Account, AccountId, Balance, Role};
pub use book::{Applied, Book, Changes, Known, Refusal};
pub use settle::{Escrow, Outcome, Price};
pub use transfer::{CauseKind, PendingState, Phase, Resolution, Transfer};

/// Why the ledger refused a request before any transfer was made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LedgerError {
    #[error("account: {0}")]
    Account(String),
    #[error("{0} overflows")]
    Overflow(&'static str),
}
