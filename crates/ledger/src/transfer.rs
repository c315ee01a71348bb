//! Transfers: immutable, each naming its cause; two-phase (pending → posted or voided, at most
//! once, or expired at a deterministic time) and linked (a chain applies all or none).

use serde::{Deserialize, Serialize};

use crate::account::AccountId;

/// What a transfer does (TigerBeetle's flags, one kind at a time).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Moves `amount` now.
    Single,
    /// Reserves `amount` (debit pending on one side, credit pending on the other) until it is
    /// posted, voided or expires.
    Pending,
    /// Resolves `pending` by moving `amount` (at most the pending amount; the rest of the
    /// reservation is released).
    Post,
    /// Resolves `pending` by releasing it whole (`amount` is 0).
    Void,
}

impl Phase {
    pub const fn as_str(self) -> &'static str {
        match self {
            Phase::Single => "single",
            Phase::Pending => "pending",
            Phase::Post => "post",
            Phase::Void => "void",
        }
    }

    pub fn parse(s: &str) -> Option<Phase> {
        [Phase::Single, Phase::Pending, Phase::Post, Phase::Void]
            .into_iter()
            .find(|p| p.as_str() == s)
    }
}

/// Why money moved: every transfer names its cause, so every statement line is traceable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CauseKind {
    /// Money in from outside (an admin or payment adapter; `reference` is its reference).
    Deposit,
    /// Money out (`reference`: the payout's reference).
    Withdrawal,
    /// An operator's stake posted.
    Stake,
    /// A lease's escrow reserved from its tenant's balance (`reference`: the lease).
    Escrow,
    /// A proven window paid (`reference`: the metering record's hash).
    Window,
    /// A window not proven, its price back to the tenant (`reference`: the record's hash, or
    /// the window's lease and index).
    Refund,
    /// What a lease's escrow still held when it ended, back to the tenant.
    Release,
    /// Stake forfeited for a proven cheat (`reference`: the challenge or record).
    Slash,
    /// A pending transfer that reached its time-out.
    Expiry,
    /// A correction of an earlier transfer (`reference`: its id); never an edit.
    Correction,
}

impl CauseKind {
    pub const ALL: [CauseKind; 10] = [
        CauseKind::Deposit,
        CauseKind::Withdrawal,
        CauseKind::Stake,
        CauseKind::Escrow,
        CauseKind::Window,
        CauseKind::Refund,
        CauseKind::Release,
        CauseKind::Slash,
        CauseKind::Expiry,
        CauseKind::Correction,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            CauseKind::Deposit => "deposit",
            CauseKind::Withdrawal => "withdrawal",
            CauseKind::Stake => "stake",
            CauseKind::Escrow => "escrow",
            CauseKind::Window => "window",
            CauseKind::Refund => "refund",
            CauseKind::Release => "release",
            CauseKind::Slash => "slash",
            CauseKind::Expiry => "expiry",
            CauseKind::Correction => "correction",
        }
    }

    pub fn parse(s: &str) -> Option<CauseKind> {
        CauseKind::ALL.into_iter().find(|c| c.as_str() == s)
    }
}

/// The longest id, reference or lease name a transfer carries.
pub const MAX_REF: usize = 200;

/// One transfer. Its id is chosen by the caller, deterministically from its cause
/// (`pay/<record hash>/provider`), so a second attempt at the same cause finds the first
/// instead of moving money again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    pub id: String,
    pub debit: AccountId,
    pub credit: AccountId,
    pub amount: u64,
    pub phase: Phase,
    /// The pending transfer a post or void resolves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<String>,
    /// For a pending transfer: when it expires (Unix seconds; 0: never). An expiry releases
    /// it as a void would, at the first [`crate::Book::expire`] at or after this time.
    #[serde(default)]
    pub expires_at: i64,
    /// Part of a chain with the next transfer of the batch: all of the chain or none.
    #[serde(default)]
    pub linked: bool,
    pub cause: CauseKind,
    pub reference: String,
    /// The lease and window it concerns, where it concerns one (statements group by them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<u64>,
    /// When (Unix seconds), as the caller's clock said: the book takes it as given.
    pub at: i64,
}

impl Transfer {
    /// A single-phase transfer.
    pub fn single(
        id: impl Into<String>,
        debit: AccountId,
        credit: AccountId,
        amount: u64,
        cause: CauseKind,
        reference: impl Into<String>,
        at: i64,
    ) -> Transfer {
        Transfer {
            id: id.into(),
            debit,
            credit,
            amount,
            phase: Phase::Single,
            pending: None,
            expires_at: 0,
            linked: false,
            cause,
            reference: reference.into(),
            lease: None,
            window: None,
            at,
        }
    }

    /// This transfer, reserving rather than moving, expiring at `expires_at` (0: never).
    pub fn pending(mut self, expires_at: i64) -> Transfer {
        self.phase = Phase::Pending;
        self.expires_at = expires_at;
        self
    }

    /// A post of pending transfer `pending` (between the same accounts) moving `amount`.
    pub fn post(
        id: impl Into<String>,
        pending: &Transfer,
        amount: u64,
        cause: CauseKind,
        reference: impl Into<String>,
        at: i64,
    ) -> Transfer {
        Transfer {
            id: id.into(),
            debit: pending.debit.clone(),
            credit: pending.credit.clone(),
            amount,
            phase: Phase::Post,
            pending: Some(pending.id.clone()),
            expires_at: 0,
            linked: false,
            cause,
            reference: reference.into(),
            lease: pending.lease.clone(),
            window: None,
            at,
        }
    }

    /// A void of pending transfer `pending`.
    pub fn void(
        id: impl Into<String>,
        pending: &Transfer,
        cause: CauseKind,
        reference: impl Into<String>,
        at: i64,
    ) -> Transfer {
        let mut t = Transfer::post(id, pending, 0, cause, reference, at);
        t.phase = Phase::Void;
        t
    }

    pub fn lease(mut self, lease: &str, window: Option<u64>) -> Transfer {
        self.lease = Some(lease.to_string());
        self.window = window;
        self
    }

    pub fn linked(mut self) -> Transfer {
        self.linked = true;
        self
    }
}

/// Where a pending transfer stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resolution {
    Open,
    Posted,
    Voided,
    Expired,
}

impl Resolution {
    pub const fn as_str(self) -> &'static str {
        match self {
            Resolution::Open => "open",
            Resolution::Posted => "posted",
            Resolution::Voided => "voided",
            Resolution::Expired => "expired",
        }
    }

    pub fn parse(s: &str) -> Option<Resolution> {
        [
            Resolution::Open,
            Resolution::Posted,
            Resolution::Voided,
            Resolution::Expired,
        ]
        .into_iter()
        .find(|r| r.as_str() == s)
    }
}

/// A pending transfer and where it stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingState {
    pub transfer: Transfer,
    pub resolution: Resolution,
}
