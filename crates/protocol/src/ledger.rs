//! The ledger's wire types (issue 32): deposits, statements, quotes. Amounts are micros
//! ([`crate::money::Micros`]); a signed change is an `i128`-free pair of integers — what came
//! in and what went out — so no field is ever negative on the wire.

use serde::{Deserialize, Serialize};

use crate::money::Micros;

/// `POST /v1/ledger/deposits`: money in from outside, by an admin or a payment adapter
/// (scope `ledger` or `*`). Idempotent by `reference`: the same reference again is answered
/// with the same transfer, and moves nothing; with another amount or account it is refused.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DepositRequest {
    /// `tenant/<name>` (a tenant's balance) or `stake/<operator>` (an operator's stake).
    pub account: String,
    pub amount_micros: Micros,
    /// The payment's own reference (a bank transfer, a card charge, a chain transaction):
    /// 1–128 of `[A-Za-z0-9._:@-]`.
    pub reference: String,
}

/// The answer to a deposit.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DepositAnswer {
    pub transfer: String,
    pub account: String,
    /// `false`: this reference was deposited before; nothing moved now.
    pub new: bool,
    /// What the account holds now, and what of it is held in escrow.
    pub balance: AccountBalance,
}

/// One account's sums and what they mean.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct AccountBalance {
    pub account: String,
    pub debits_posted: Micros,
    pub credits_posted: Micros,
    pub debits_pending: Micros,
    pub credits_pending: Micros,
    /// Posted credits less posted and pending debits (what it can spend or send now);
    /// negative only for the world account, as `available_negative`.
    pub available: Micros,
    #[serde(default, skip_serializing_if = "is_false")]
    pub available_negative: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// `GET /v1/statements?tenant=T|operator=O[&from=&to=]`: a tenant's or an operator's money
/// over `[from, to)` (Unix seconds), every line traceable to its transfers and records.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Statement {
    /// `tenant:<name>` or `operator:<name>`.
    pub owner: String,
    pub from: i64,
    pub to: i64,
    /// Always `micros` (10⁻⁶ of the currency unit).
    pub unit: String,
    /// Per account of the owner: opening, movements, closing — which reconcile.
    pub accounts: Vec<StatementAccount>,
    /// Every transfer that moved one of the owner's accounts in the period, in order.
    pub lines: Vec<StatementLine>,
    /// Per lease (the tenant's, or the operator's nodes'): its windows and what each did.
    pub leases: Vec<LeaseSettlement>,
    /// Whether every account's closing equals its opening plus its lines, and (when the
    /// period runs to now) the ledger's stored sums.
    pub reconciled: bool,
}

/// One account in a statement. `closing = opening + credits − debits`, posted and held
/// (pending) separately.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct StatementAccount {
    pub account: String,
    pub opening_posted: Micros,
    pub credits_posted: Micros,
    pub debits_posted: Micros,
    pub closing_posted: Micros,
    /// Held in escrow at the end of the period (pending debits), and at its start.
    pub opening_held: Micros,
    pub closing_held: Micros,
}

/// One transfer as it moved one of the owner's accounts.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct StatementLine {
    /// The transfer's order in the ledger and its id.
    pub seq: i64,
    pub transfer: String,
    pub at: i64,
    /// The owner's account it moved.
    pub account: String,
    /// The other side.
    pub counterparty: String,
    /// `single`, `pending`, `post` or `void`.
    pub phase: String,
    /// `deposit`, `escrow`, `window`, `refund`, `release`, `slash`, `stake`, `expiry`, …
    pub cause: String,
    /// The cause's reference: the metering record's hash for a window, the lease for an
    /// escrow, the payment's reference for a deposit, the challenge for a slash.
    pub reference: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<u64>,
    /// What it added to and took from the account, posted…
    pub credit: Micros,
    pub debit: Micros,
    /// …and the change in what the account holds in escrow (a reservation adds, its post or
    /// void releases).
    pub held_added: Micros,
    pub held_released: Micros,
    /// The account's posted balance after the line.
    pub balance: Micros,
}

/// A lease's settlement: its escrow and its windows.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LeaseSettlement {
    pub lease: String,
    pub job: String,
    pub node: String,
    pub tenant: String,
    pub operator: String,
    pub started_at: i64,
    pub price_per_gpu_hour: Micros,
    pub gpus: u32,
    pub window_secs: u32,
    /// How many windows its reservation covered (the lease ends before the next).
    pub covers: u64,
    /// Paid out, to the provider and the fee.
    pub paid: Micros,
    pub provider: Micros,
    pub fee: Micros,
    /// Windows refunded, and what they would have cost.
    pub refunded: Micros,
    /// Still held in escrow.
    pub held: Micros,
    /// `open` (settling) or `closed` (released).
    pub state: String,
    pub windows: Vec<WindowLine>,
}

/// One window of a lease as it was settled.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WindowLine {
    pub window: u64,
    /// `paid`, `refunded` or `unfunded` (nothing was left to pay it).
    pub outcome: String,
    /// The accepted metering record's hash (SHA-256 of its token).
    pub record: String,
    pub amount: Micros,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    pub at: i64,
}

/// `POST /v1/quotes`: the offers a job would get now, placing nothing.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct QuoteAnswer {
    /// Best first, as placement ranks them (price, then reputation, then region, then id).
    pub offers: Vec<QuoteOffer>,
    /// Nodes that would not get the job, with why (by node; at most 100, then counted).
    pub excluded: Vec<QuoteExclusion>,
    /// How many more were excluded than listed.
    #[serde(default)]
    pub excluded_more: u64,
    /// When the quote was made (Unix seconds): an offer holds while the node still fits at
    /// its price.
    pub at: i64,
}

/// One offer: a node that fits, its price and what the job would lock.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct QuoteOffer {
    pub rank: u32,
    pub node: String,
    pub operator: String,
    pub region: String,
    pub gpus: Vec<u32>,
    pub price_per_gpu_hour: Micros,
    pub reputation: i64,
    /// What placement would move from the tenant's balance into the lease's escrow.
    pub escrow: Micros,
    /// What the job's duration costs at this price.
    pub cost: Micros,
}

/// A node excluded from a quote, and why.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct QuoteExclusion {
    pub node: String,
    pub code: String,
    pub reason: String,
}

/// A job submitted against a quoted offer: placed on that node at that price per GPU-hour,
/// or refused with the reason the offer no longer holds.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ChosenOffer {
    pub node: String,
    pub price_per_gpu_hour_micros: Micros,
}
