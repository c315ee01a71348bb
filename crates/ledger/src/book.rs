//! The book: accounts, the pending transfers and the ids already used, and the one function
//! that applies a batch of transfers to them.
//!
//! A batch is a list of chains: consecutive transfers marked `linked` belong with the next, and
//! a chain applies all or none — a refusal anywhere undoes what the chain did before it, and
//! every transfer of the chain is answered (the one refused with its reason, the others with
//! [`Refusal::LinkedEventFailed`]). A transfer whose id the book knows is not applied again:
//! with the same fields it is answered [`Applied::Exists`] (a retry), with others it is
//! refused. The broker loads, per batch, the accounts, pending transfers and ids a batch
//! names ([`Book::load_account`], [`Book::load_pending`], [`Book::load_known`]), applies, and
//! writes back what [`Book::take_changes`] lists, in the same database transaction as the
//! state change the money follows.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};

use crate::account::{Account, AccountId, Balance};
use crate::transfer::{CauseKind, MAX_REF, PendingState, Phase, Resolution, Transfer};

/// Why a transfer was refused. Nothing it or its chain did stands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    #[error("another transfer of its chain was refused")]
    LinkedEventFailed,
    #[error("the batch's last transfer is linked to nothing")]
    LinkedEventChainOpen,
    #[error("id: 1–{MAX_REF} printable ASCII characters, no spaces")]
    Id,
    #[error("reference: at most {MAX_REF} characters")]
    Reference,
    #[error("transfer {0} exists with other fields")]
    ExistsWithDifferentFields(String),
    #[error("debit and credit are the same account")]
    SameAccount,
    #[error("the amount must be positive")]
    AmountZero,
    #[error("a void moves no amount")]
    VoidAmount,
    #[error("a {0} transfer names no pending transfer")]
    PendingMissing(&'static str),
    #[error("a {0} transfer resolves nothing")]
    PendingNotExpected(&'static str),
    #[error("pending transfer {0} not found")]
    PendingNotFound(String),
    #[error("pending transfer {0} was already posted")]
    PendingAlreadyPosted(String),
    #[error("pending transfer {0} was already voided")]
    PendingAlreadyVoided(String),
    #[error("pending transfer {0} expired")]
    PendingExpired(String),
    #[error("the accounts differ from pending transfer {0}'s")]
    PendingAccountsMismatch(String),
    #[error("posts {amount}, more than pending transfer {pending}'s {held}")]
    ExceedsPendingAmount {
        pending: String,
        amount: u64,
        held: u64,
    },
    #[error("the expiry is before the transfer")]
    ExpiresBeforeTransfer,
    #[error("{account} holds {available}; {amount} would take it below zero")]
    ExceedsCredits {
        account: String,
        available: i128,
        amount: u64,
    },
    #[error("an account's sum would overflow")]
    Overflow,
}

/// What an accepted transfer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Applied now.
    New,
    /// Applied before, with the same fields: nothing moved now.
    Exists,
}

/// What the book knows of a transfer id it holds: the transfer itself (read from storage, or a
/// pending one), or a fingerprint of its fields (an in-memory book keeps no more).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Known {
    Transfer(Box<Transfer>),
    Fingerprint(u64),
}

fn fingerprint(t: &Transfer) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    t.hash(&mut h);
    h.finish()
}

impl Hash for Transfer {
    fn hash<H: Hasher>(&self, h: &mut H) {
        (
            &self.id,
            &self.debit,
            &self.credit,
            self.amount,
            self.phase,
            &self.pending,
            self.expires_at,
            self.linked,
        )
            .hash(h);
        (
            self.cause,
            &self.reference,
            &self.lease,
            self.window,
            self.at,
        )
            .hash(h);
    }
}

impl Known {
    fn same(&self, t: &Transfer) -> bool {
        match self {
            Known::Transfer(k) => **k == *t,
            Known::Fingerprint(f) => *f == fingerprint(t),
        }
    }
}

/// What a batch changed, to be written back.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    /// The accounts whose sums changed, with their new sums (created if new).
    pub accounts: BTreeMap<AccountId, Balance>,
    /// The transfers applied, in order.
    pub transfers: Vec<Transfer>,
    /// Pending transfers resolved: id → how.
    pub resolved: BTreeMap<String, Resolution>,
}

/// Undo log of one chain.
#[derive(Default)]
struct Undo {
    accounts: Vec<(AccountId, Option<Balance>)>,
    pending: Vec<(String, Option<PendingState>)>,
    known: Vec<String>,
    transfers: usize,
}

/// The maps' hasher: foldhash, seeded at random per map — a third of SipHash's cost on the
/// settlement path, and the seed keeps ids chosen to collide (a deposit's reference is a
/// caller's) from being chosen in advance.
type Seeded = foldhash::fast::RandomState;

/// The ledger's state, or the part of it a batch needs.
#[derive(Debug, Default)]
pub struct Book {
    accounts: HashMap<AccountId, Balance, Seeded>,
    pending: HashMap<String, PendingState, Seeded>,
    known: HashMap<String, Known, Seeded>,
    changed: HashSet<AccountId, Seeded>,
    changes: Changes,
    /// Running totals over every account the book holds (a full book: the whole ledger).
    totals: Balance,
}

fn id_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_REF && s.bytes().all(|b| b.is_ascii_graphic())
}

impl Book {
    pub fn new() -> Book {
        Book::default()
    }

    /// Load an account as storage holds it.
    pub fn load_account(&mut self, id: AccountId, balance: Balance) {
        add_totals(&mut self.totals, &balance, true);
        if let Some(old) = self.accounts.insert(id, balance) {
            add_totals(&mut self.totals, &old, false);
        }
    }

    /// Load a pending transfer as storage holds it.
    pub fn load_pending(&mut self, p: PendingState) {
        self.known.insert(
            p.transfer.id.clone(),
            Known::Transfer(Box::new(p.transfer.clone())),
        );
        self.pending.insert(p.transfer.id.clone(), p);
    }

    /// Load a transfer id storage holds.
    pub fn load_known(&mut self, id: String, known: Known) {
        self.known.insert(id, known);
    }

    pub fn account(&self, id: &AccountId) -> Option<Account> {
        self.accounts.get(id).map(|b| Account {
            id: id.clone(),
            balance: *b,
        })
    }

    pub fn balance(&self, id: &AccountId) -> Balance {
        self.accounts.get(id).copied().unwrap_or_default()
    }

    pub fn pending(&self, id: &str) -> Option<&PendingState> {
        self.pending.get(id)
    }

    pub fn knows(&self, id: &str) -> bool {
        self.known.contains_key(id)
    }

    /// Every account's sums, added up (over what the book holds).
    pub fn totals(&self) -> Balance {
        self.totals
    }

    pub fn accounts(&self) -> impl Iterator<Item = (&AccountId, &Balance)> {
        self.accounts.iter()
    }

    pub fn open_pending(&self) -> impl Iterator<Item = &PendingState> {
        self.pending
            .values()
            .filter(|p| p.resolution == Resolution::Open)
    }

    /// What the batches since the last call changed.
    pub fn take_changes(&mut self) -> Changes {
        self.changed.clear();
        std::mem::take(&mut self.changes)
    }

    /// Forget resolved pending transfers' bodies (an in-memory book over a long run keeps
    /// their fingerprints only).
    pub fn compact(&mut self) {
        self.pending.retain(|id, p| {
            if p.resolution == Resolution::Open {
                true
            } else {
                let f = fingerprint(&p.transfer);
                self.known.insert(id.clone(), Known::Fingerprint(f));
                false
            }
        });
    }

    /// Apply a batch: one answer per transfer, in order.
    pub fn apply(&mut self, batch: &[Transfer]) -> Vec<Result<Applied, Refusal>> {
        let mut out = Vec::with_capacity(batch.len());
        let mut start = 0;
        while start < batch.len() {
            let end = batch[start..]
                .iter()
                .position(|t| !t.linked)
                .map(|i| start + i + 1);
            let Some(end) = end else {
                // The last chain never closes: refused whole.
                let n = batch.len() - start;
                out.push(Err(Refusal::LinkedEventChainOpen));
                out.extend((1..n).map(|_| Err(Refusal::LinkedEventFailed)));
                break;
            };
            out.extend(self.apply_chain(&batch[start..end]));
            start = end;
        }
        out
    }

    fn apply_chain(&mut self, chain: &[Transfer]) -> Vec<Result<Applied, Refusal>> {
        // A chain applied before is answered `Exists` whole; one applied in part cannot be
        // (chains apply all or none), so a mix is refused at its first new transfer.
        let mut undo = Undo {
            transfers: self.changes.transfers.len(),
            ..Undo::default()
        };
        let mut answers = Vec::with_capacity(chain.len());
        for (i, t) in chain.iter().enumerate() {
            match self.apply_one(t, &mut undo) {
                Ok(a) => answers.push(Ok(a)),
                Err(r) => {
                    self.rollback(undo);
                    let mut out: Vec<Result<Applied, Refusal>> = (0..chain.len())
                        .map(|_| Err(Refusal::LinkedEventFailed))
                        .collect();
                    out[i] = Err(r);
                    return out;
                }
            }
        }
        let exists = answers
            .iter()
            .filter(|a| **a == Ok(Applied::Exists))
            .count();
        if exists != 0 && exists != chain.len() {
            // Part of this chain was applied before: it is not the same chain.
            let first_new = answers
                .iter()
                .position(|a| *a == Ok(Applied::New))
                .unwrap_or(0);
            self.rollback(undo);
            let mut out: Vec<Result<Applied, Refusal>> = (0..chain.len())
                .map(|_| Err(Refusal::LinkedEventFailed))
                .collect();
            out[first_new] = Err(Refusal::ExistsWithDifferentFields(
                chain[first_new].id.clone(),
            ));
            return out;
        }
        answers
    }

    fn rollback(&mut self, undo: Undo) {
        for (id, old) in undo.accounts.into_iter().rev() {
            if let Some(now) = self.accounts.remove(&id) {
                add_totals(&mut self.totals, &now, false);
            }
            match old {
                Some(b) => {
                    add_totals(&mut self.totals, &b, true);
                    self.accounts.insert(id.clone(), b);
                    self.changes.accounts.insert(id, b);
                }
                None => {
                    self.changes.accounts.remove(&id);
                }
            }
        }
        for (id, old) in undo.pending.into_iter().rev() {
            match old {
                Some(p) => {
                    self.changes.resolved.remove(&id);
                    self.pending.insert(id, p);
                }
                None => {
                    self.pending.remove(&id);
                }
            }
        }
        for id in undo.known {
            self.known.remove(&id);
        }
        self.changes.transfers.truncate(undo.transfers);
    }

    fn save_account(&mut self, id: &AccountId, undo: &mut Undo) {
        undo.accounts
            .push((id.clone(), self.accounts.get(id).copied()));
    }

    fn set_account(&mut self, id: &AccountId, b: Balance) {
        // Replaced in place where the account is known (the common case): no key cloned.
        let old = match self.accounts.get_mut(id) {
            Some(slot) => std::mem::replace(slot, b),
            None => {
                self.accounts.insert(id.clone(), b);
                Balance::default()
            }
        };
        add_totals(&mut self.totals, &old, false);
        add_totals(&mut self.totals, &b, true);
        if !self.changed.contains(id) {
            self.changed.insert(id.clone());
        }
        match self.changes.accounts.get_mut(id) {
            Some(slot) => *slot = b,
            None => {
                self.changes.accounts.insert(id.clone(), b);
            }
        }
    }

    fn apply_one(&mut self, t: &Transfer, undo: &mut Undo) -> Result<Applied, Refusal> {
        if !id_ok(&t.id) {
            return Err(Refusal::Id);
        }
        if t.reference.len() > MAX_REF
            || t.lease.as_ref().is_some_and(|l| l.len() > MAX_REF)
            || t.pending.as_ref().is_some_and(|p| p.len() > MAX_REF)
        {
            return Err(Refusal::Reference);
        }
        if let Some(k) = self.known.get(&t.id) {
            return if k.same(t) {
                Ok(Applied::Exists)
            } else {
                Err(Refusal::ExistsWithDifferentFields(t.id.clone()))
            };
        }
        if t.debit == t.credit {
            return Err(Refusal::SameAccount);
        }
        let mut debit = self.balance(&t.debit);
        let mut credit = self.balance(&t.credit);
        match t.phase {
            Phase::Single | Phase::Pending => {
                if t.pending.is_some() {
                    return Err(Refusal::PendingNotExpected(t.phase.as_str()));
                }
                if t.amount == 0 {
                    return Err(Refusal::AmountZero);
                }
                if t.phase == Phase::Pending && t.expires_at != 0 && t.expires_at <= t.at {
                    return Err(Refusal::ExpiresBeforeTransfer);
                }
                let (dp, cp) = if t.phase == Phase::Single {
                    (&mut debit.debits_posted, &mut credit.credits_posted)
                } else {
                    (&mut debit.debits_pending, &mut credit.credits_pending)
                };
                *dp = dp.checked_add(t.amount).ok_or(Refusal::Overflow)?;
                *cp = cp.checked_add(t.amount).ok_or(Refusal::Overflow)?;
            }
            Phase::Post | Phase::Void => {
                let Some(pid) = &t.pending else {
                    return Err(Refusal::PendingMissing(t.phase.as_str()));
                };
                let Some(p) = self.pending.get(pid) else {
                    return Err(Refusal::PendingNotFound(pid.clone()));
                };
                match p.resolution {
                    Resolution::Open => {}
                    Resolution::Posted => return Err(Refusal::PendingAlreadyPosted(pid.clone())),
                    Resolution::Voided => return Err(Refusal::PendingAlreadyVoided(pid.clone())),
                    Resolution::Expired => return Err(Refusal::PendingExpired(pid.clone())),
                }
                let held = p.transfer.amount;
                if p.transfer.debit != t.debit || p.transfer.credit != t.credit {
                    return Err(Refusal::PendingAccountsMismatch(pid.clone()));
                }
                // Time-outs are deterministic: past its expiry a pending transfer resolves
                // only as expired, whether or not an expiry pass has run yet.
                let expired = p.transfer.expires_at != 0 && t.at >= p.transfer.expires_at;
                if expired && t.cause != CauseKind::Expiry {
                    return Err(Refusal::PendingExpired(pid.clone()));
                }
                if t.phase == Phase::Void && t.amount != 0 {
                    return Err(Refusal::VoidAmount);
                }
                if t.phase == Phase::Post {
                    if t.amount == 0 {
                        return Err(Refusal::AmountZero);
                    }
                    if t.amount > held {
                        return Err(Refusal::ExceedsPendingAmount {
                            pending: pid.clone(),
                            amount: t.amount,
                            held,
                        });
                    }
                }
                debit.debits_pending = debit
                    .debits_pending
                    .checked_sub(held)
                    .ok_or(Refusal::Overflow)?;
                credit.credits_pending = credit
                    .credits_pending
                    .checked_sub(held)
                    .ok_or(Refusal::Overflow)?;
                debit.debits_posted = debit
                    .debits_posted
                    .checked_add(t.amount)
                    .ok_or(Refusal::Overflow)?;
                credit.credits_posted = credit
                    .credits_posted
                    .checked_add(t.amount)
                    .ok_or(Refusal::Overflow)?;
            }
        }
        // The debit side's limit: only a new debit can break it (a post moves no more than it
        // releases).
        if t.debit.role().must_not_go_negative() && debit.available() < 0 {
            let before = self.balance(&t.debit).available();
            return Err(Refusal::ExceedsCredits {
                account: t.debit.to_string(),
                available: before,
                amount: t.amount,
            });
        }
        self.save_account(&t.debit, undo);
        self.save_account(&t.credit, undo);
        self.set_account(&t.debit, debit);
        self.set_account(&t.credit, credit);
        match t.phase {
            Phase::Pending => {
                undo.pending.push((t.id.clone(), None));
                self.pending.insert(
                    t.id.clone(),
                    PendingState {
                        transfer: t.clone(),
                        resolution: Resolution::Open,
                    },
                );
            }
            Phase::Post | Phase::Void => {
                if let Some(pid) = &t.pending
                    && let Some(p) = self.pending.get_mut(pid)
                {
                    undo.pending.push((pid.clone(), Some(p.clone())));
                    p.resolution = match (t.phase, t.cause) {
                        (Phase::Post, _) => Resolution::Posted,
                        (_, CauseKind::Expiry) => Resolution::Expired,
                        _ => Resolution::Voided,
                    };
                    self.changes.resolved.insert(pid.clone(), p.resolution);
                }
            }
            Phase::Single => {}
        }
        undo.known.push(t.id.clone());
        self.known
            .insert(t.id.clone(), Known::Fingerprint(fingerprint(t)));
        self.changes.transfers.push(t.clone());
        Ok(Applied::New)
    }

    /// The expiry voids due at `now`: every open pending transfer whose time-out is at or
    /// before it, oldest time-out first (ties by id), each as a void with cause
    /// [`CauseKind::Expiry`] and id `expire/<pending id>`. Apply them like any batch (the
    /// broker does, in its settlement pass; every replica computes the same).
    pub fn expiries(&self, now: i64) -> Vec<Transfer> {
        let mut due: Vec<&PendingState> = self
            .open_pending()
            .filter(|p| p.transfer.expires_at != 0 && p.transfer.expires_at <= now)
            .collect();
        due.sort_by(|a, b| {
            (a.transfer.expires_at, &a.transfer.id).cmp(&(b.transfer.expires_at, &b.transfer.id))
        });
        due.into_iter()
            .map(|p| {
                let at = p.transfer.expires_at;
                Transfer::void(
                    format!("expire/{}", p.transfer.id),
                    &p.transfer,
                    CauseKind::Expiry,
                    p.transfer.id.clone(),
                    at,
                )
            })
            .collect()
    }

    /// Check the whole book: every transfer balanced (debits equal credits, posted and
    /// pending, over all accounts), no account below its limit, and the pending sums equal to
    /// the open pending transfers. Only meaningful on a full book.
    pub fn check(&self) -> Result<(), String> {
        let mut sum = Balance::default();
        for (id, b) in &self.accounts {
            add_totals(&mut sum, b, true);
            let a = Account {
                id: id.clone(),
                balance: *b,
            };
            if !a.within_limit() {
                return Err(format!("{id} is below zero: {b:?}"));
            }
        }
        if sum != self.totals {
            return Err(format!(
                "the running totals {:?} differ from the accounts' {sum:?}",
                self.totals
            ));
        }
        if sum.debits_posted != sum.credits_posted || sum.debits_pending != sum.credits_pending {
            return Err(format!("debits and credits differ: {sum:?}"));
        }
        let open: u128 = self
            .open_pending()
            .map(|p| u128::from(p.transfer.amount))
            .sum();
        if open != u128::from(sum.credits_pending) {
            return Err(format!(
                "open pending transfers hold {open}, the accounts {}",
                sum.credits_pending
            ));
        }
        Ok(())
    }
}

fn add_totals(t: &mut Balance, b: &Balance, add: bool) {
    let f = |x: u64, y: u64| {
        if add {
            x.wrapping_add(y)
        } else {
            x.wrapping_sub(y)
        }
    };
    t.debits_pending = f(t.debits_pending, b.debits_pending);
    t.debits_posted = f(t.debits_posted, b.debits_posted);
    t.credits_pending = f(t.credits_pending, b.credits_pending);
    t.credits_posted = f(t.credits_posted, b.credits_posted);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::account::Role;

    fn tenant() -> AccountId {
        AccountId::new(Role::Tenant, "acme").unwrap()
    }
    fn escrow() -> AccountId {
        AccountId::new(Role::Escrow, "l-1").unwrap()
    }

    fn funded(amount: u64) -> Book {
        let mut b = Book::new();
        let d = Transfer::single(
            "dep/1",
            AccountId::world(),
            tenant(),
            amount,
            CauseKind::Deposit,
            "ref-1",
            1,
        );
        assert_eq!(b.apply(&[d]), vec![Ok(Applied::New)]);
        b
    }

    #[test]
    fn deposits_are_idempotent_and_a_changed_retry_is_refused() {
        let mut b = funded(100);
        let d = Transfer::single(
            "dep/1",
            AccountId::world(),
            tenant(),
            100,
            CauseKind::Deposit,
            "ref-1",
            1,
        );
        assert_eq!(b.apply(std::slice::from_ref(&d)), vec![Ok(Applied::Exists)]);
        let mut other = d.clone();
        other.amount = 200;
        assert_eq!(
            b.apply(&[other]),
            vec![Err(Refusal::ExistsWithDifferentFields("dep/1".into()))]
        );
        assert_eq!(b.balance(&tenant()).net_posted(), 100);
        assert_eq!(b.balance(&AccountId::world()).net_posted(), -100);
        b.check().unwrap();
    }

    #[test]
    fn two_phase_posts_or_voids_once_and_expires_on_time() {
        let mut b = funded(100);
        let p = Transfer::single("esc/0", tenant(), escrow(), 60, CauseKind::Escrow, "l-1", 2)
            .pending(50);
        assert_eq!(b.apply(std::slice::from_ref(&p)), vec![Ok(Applied::New)]);
        assert_eq!(b.balance(&tenant()).available(), 40);
        // More than the tenant has left is refused, and changes nothing.
        let q = Transfer::single("esc/x", tenant(), escrow(), 41, CauseKind::Escrow, "l-2", 2)
            .pending(0);
        let r = b.apply(&[q]);
        assert!(matches!(r[0], Err(Refusal::ExceedsCredits { .. })), "{r:?}");
        assert_eq!(b.balance(&tenant()).available(), 40);
        // Post more than held: refused; post part: the rest is released.
        let over = Transfer::post("post/0", &p, 61, CauseKind::Window, "h", 3);
        assert!(matches!(
            b.apply(&[over])[0],
            Err(Refusal::ExceedsPendingAmount { .. })
        ));
        let post = Transfer::post("post/0", &p, 25, CauseKind::Window, "h", 3);
        assert_eq!(b.apply(&[post]), vec![Ok(Applied::New)]);
        assert_eq!(b.balance(&tenant()).available(), 75);
        assert_eq!(b.balance(&escrow()).net_posted(), 25);
        let again = Transfer::void("void/0", &p, CauseKind::Release, "l-1", 4);
        assert_eq!(
            b.apply(&[again]),
            vec![Err(Refusal::PendingAlreadyPosted("esc/0".into()))]
        );
        // A second reservation expires deterministically: a post at or after its time-out is
        // refused, and the expiry void releases it.
        let p2 = Transfer::single("esc/1", tenant(), escrow(), 10, CauseKind::Escrow, "l-1", 5)
            .pending(9);
        b.apply(std::slice::from_ref(&p2));
        assert!(b.expiries(8).is_empty());
        let late = Transfer::post("post/1", &p2, 5, CauseKind::Window, "h2", 9);
        assert_eq!(
            b.apply(&[late]),
            vec![Err(Refusal::PendingExpired("esc/1".into()))]
        );
        let ex = b.expiries(9);
        assert_eq!(ex.len(), 1);
        assert_eq!(b.apply(&ex), vec![Ok(Applied::New)]);
        assert_eq!(b.pending("esc/1").unwrap().resolution, Resolution::Expired);
        assert_eq!(b.balance(&tenant()).available(), 75);
        b.check().unwrap();
    }

    #[test]
    fn a_chain_applies_all_or_none() {
        let mut b = funded(100);
        let before = b.balance(&tenant());
        let chain = vec![
            Transfer::single("a", tenant(), escrow(), 50, CauseKind::Escrow, "x", 2).linked(),
            Transfer::single(
                "b",
                escrow(),
                AccountId::fee(),
                60,
                CauseKind::Window,
                "x",
                2,
            ),
        ];
        let r = b.apply(&chain);
        assert_eq!(r[0], Err(Refusal::LinkedEventFailed));
        assert!(matches!(r[1], Err(Refusal::ExceedsCredits { .. })), "{r:?}");
        assert_eq!(b.balance(&tenant()), before);
        assert!(!b.knows("a"));
        b.check().unwrap();
        // An open chain is refused whole.
        let open =
            vec![Transfer::single("c", tenant(), escrow(), 5, CauseKind::Escrow, "x", 2).linked()];
        assert_eq!(b.apply(&open), vec![Err(Refusal::LinkedEventChainOpen)]);
        // A chain applied before is answered Exists whole; half of one is refused.
        let ok = vec![
            Transfer::single("d", tenant(), escrow(), 5, CauseKind::Escrow, "x", 2).linked(),
            Transfer::single(
                "e",
                escrow(),
                AccountId::fee(),
                5,
                CauseKind::Window,
                "x",
                2,
            ),
        ];
        assert_eq!(b.apply(&ok), vec![Ok(Applied::New), Ok(Applied::New)]);
        assert_eq!(b.apply(&ok), vec![Ok(Applied::Exists), Ok(Applied::Exists)]);
        let half = vec![
            ok[0].clone(),
            Transfer::single(
                "f",
                escrow(),
                AccountId::fee(),
                0,
                CauseKind::Window,
                "x",
                2,
            ),
        ];
        assert!(b.apply(&half).iter().all(Result::is_err));
        let half = vec![
            ok[0].clone(),
            Transfer::single(
                "f",
                tenant(),
                AccountId::fee(),
                1,
                CauseKind::Window,
                "x",
                2,
            ),
        ];
        assert_eq!(
            b.apply(&half)[1],
            Err(Refusal::ExistsWithDifferentFields("f".into()))
        );
        assert!(!b.knows("f"));
        b.check().unwrap();
    }

    #[test]
    fn malformed_transfers_are_refused_with_their_reason() {
        let mut b = funded(100);
        let base = Transfer::single("z", tenant(), escrow(), 5, CauseKind::Escrow, "x", 2);
        let cases: Vec<(Transfer, Refusal)> = vec![
            (
                Transfer {
                    id: "has space".into(),
                    ..base.clone()
                },
                Refusal::Id,
            ),
            (
                Transfer {
                    id: String::new(),
                    ..base.clone()
                },
                Refusal::Id,
            ),
            (
                Transfer {
                    reference: "r".repeat(MAX_REF + 1),
                    ..base.clone()
                },
                Refusal::Reference,
            ),
            (
                Transfer {
                    credit: tenant(),
                    ..base.clone()
                },
                Refusal::SameAccount,
            ),
            (
                Transfer {
                    amount: 0,
                    ..base.clone()
                },
                Refusal::AmountZero,
            ),
            (
                Transfer {
                    phase: Phase::Post,
                    ..base.clone()
                },
                Refusal::PendingMissing("post"),
            ),
            (
                Transfer {
                    phase: Phase::Void,
                    pending: Some("nope".into()),
                    ..base.clone()
                },
                Refusal::PendingNotFound("nope".into()),
            ),
            (
                Transfer {
                    pending: Some("dep/1".into()),
                    ..base.clone()
                },
                Refusal::PendingNotExpected("single"),
            ),
            (base.clone().pending(2), Refusal::ExpiresBeforeTransfer),
            (
                Transfer {
                    amount: u64::MAX,
                    debit: AccountId::world(),
                    ..base.clone()
                },
                Refusal::Overflow,
            ),
        ];
        for (t, want) in cases {
            // The world's debits grow without limit; overflow comes from the tenant's credits
            // once the world has sent u64::MAX - 100 more.
            let r = b.apply(std::slice::from_ref(&t));
            if want == Refusal::Overflow {
                let big = Transfer::single(
                    "big",
                    AccountId::world(),
                    escrow(),
                    u64::MAX - 100,
                    CauseKind::Deposit,
                    "x",
                    2,
                );
                assert_eq!(b.apply(&[big]), vec![Ok(Applied::New)]);
                let r = b.apply(&[t]);
                assert_eq!(r, vec![Err(Refusal::Overflow)]);
                continue;
            }
            assert_eq!(r, vec![Err(want)], "{t:?}");
        }
        // A post between other accounts than its pending transfer's.
        let p = Transfer::single("p", tenant(), escrow(), 5, CauseKind::Escrow, "x", 2).pending(0);
        b.apply(std::slice::from_ref(&p));
        let mut post = Transfer::post("q", &p, 5, CauseKind::Window, "x", 3);
        post.credit = AccountId::fee();
        assert_eq!(
            b.apply(&[post]),
            vec![Err(Refusal::PendingAccountsMismatch("p".into()))]
        );
        let mut void = Transfer::void("q", &p, CauseKind::Release, "x", 3);
        void.amount = 1;
        assert_eq!(b.apply(&[void]), vec![Err(Refusal::VoidAmount)]);
    }
}
