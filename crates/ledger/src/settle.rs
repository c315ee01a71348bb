//! The settlement rules: what a window costs, how it is split, what a lease's escrow holds,
//! and what a cheat forfeits — and the transfer chains that carry each out.
//!
//! **A window's price.** A lease of `g` GPUs at `p` micros per GPU-hour, metered in windows of
//! `w` seconds, owes after `n` windows `cost(n) = ⌊p·g·w·n / 3600⌋` micros (exact, in 128-bit
//! integers); window `i` costs `cost(i+1) − cost(i)`. The windows' prices add up to the
//! lease's cost to the micro, whatever the rounding.
//!
//! **Escrow.** At placement the lease reserves from its tenant's balance what the job's
//! budget has left, as a pending transfer `tenant → escrow/<lease>`; the lease runs only as
//! many windows as that covers ([`affordable_windows`]: the broker ends it before the first
//! window it could not pay). Each window is then resolved in order, as one linked chain:
//! - **paid** (its record accepted, its proof passed): the reservation is posted for the
//!   window's price, the price moves on from the escrow to the provider and the fee
//!   ([`split`]), and what is left is reserved again;
//! - **refunded** (its proof failed or was missed): the reservation is voided and what is left
//!   less the window's price reserved again — the price stays with the tenant.
//!
//! The lease's end voids the reservation that is left. So at any time an escrow account's
//! pending credits are exactly what its lease still holds, and its posted credits and debits
//! are what it passed through.
//!
//! **The slash.** A proven cheat forfeits the lesser of the operator's available stake and
//! `slash_per_gpu × GPUs it cheated on`, moved `stake/<operator> → slashed → tenant/<tenant>`
//! as one chain: a proof that fails under the node's valid signature is a cheat on the one
//! GPU it covers; two different records of one window, both under the node's signature, a
//! cheat on every GPU of the lease. Each cheat is slashed once (the chain's ids name it: the
//! challenge, or the lease and window).

use serde::{Deserialize, Serialize};

use crate::LedgerError;
use crate::account::{AccountId, Role};
use crate::transfer::{CauseKind, Transfer};

/// Basis points in one.
pub const BPS: u64 = 10_000;

/// What a lease costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Price {
    pub per_gpu_hour: u64,
    pub gpus: u32,
    pub window_secs: u32,
}

impl Price {
    /// What the first `n` windows cost together.
    pub fn cost(&self, n: u64) -> Result<u64, LedgerError> {
        let c = u128::from(self.per_gpu_hour)
            * u128::from(self.gpus)
            * u128::from(self.window_secs)
            * u128::from(n)
            / 3600;
        u64::try_from(c).map_err(|_| LedgerError::Overflow("a lease's cost"))
    }

    /// What window `i` costs.
    pub fn window(&self, i: u64) -> Result<u64, LedgerError> {
        let next = i
            .checked_add(1)
            .ok_or(LedgerError::Overflow("a window index"))?;
        Ok(self.cost(next)? - self.cost(i)?)
    }
}

/// How many windows from the first `reserve` pays for: the largest `n` with
/// `cost(n) ≤ reserve` (`u64::MAX` for a free lease).
pub fn affordable_windows(price: &Price, reserve: u64) -> u64 {
    let rate =
        u128::from(price.per_gpu_hour) * u128::from(price.gpus) * u128::from(price.window_secs);
    if rate == 0 {
        return u64::MAX;
    }
    // cost(n) ≤ B  ⇔  ⌊r·n/3600⌋ ≤ B  ⇔  r·n < 3600·(B+1)  ⇔  n ≤ ⌈3600·(B+1)/r⌉ − 1.
    let bound = 3600 * (u128::from(reserve) + 1);
    let n = bound.div_ceil(rate) - 1;
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// A window's price split into the provider's share and the fee (`fee_bps` basis points,
/// rounded down: the micro a rounding leaves goes to the provider).
pub fn split(amount: u64, fee_bps: u32) -> (u64, u64) {
    let fee = u128::from(amount) * u128::from(fee_bps.min(BPS as u32)) / u128::from(BPS);
    let fee = u64::try_from(fee).unwrap_or(amount);
    (amount - fee, fee)
}

/// What a cheat forfeits: the lesser of the stake available and `per_gpu × gpus`.
pub fn slash_amount(stake_available: i128, per_gpu: u64, gpus: u32) -> u64 {
    let cap = u128::from(per_gpu) * u128::from(gpus);
    let have = u128::try_from(stake_available.max(0)).unwrap_or(0);
    u64::try_from(cap.min(have)).unwrap_or(u64::MAX)
}

/// One lease's escrow, as the broker keeps it between windows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Escrow {
    pub lease: String,
    pub tenant: String,
    pub operator: String,
    pub price: Price,
    pub fee_bps: u32,
    /// The pending transfer holding the reservation (`None` once released, or when nothing
    /// was left to hold).
    pub pending: Option<String>,
    /// What it holds.
    pub reserve: u64,
    /// The next window to resolve.
    pub next_window: u64,
    /// When the reservations expire (Unix seconds; the job's end plus a grace).
    pub expires_at: i64,
}

/// How a window ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Paid,
    Refunded,
}

impl Escrow {
    fn tenant_account(&self) -> Result<AccountId, LedgerError> {
        AccountId::new(Role::Tenant, &self.tenant)
    }

    fn escrow_account(&self) -> Result<AccountId, LedgerError> {
        AccountId::new(Role::Escrow, &self.lease)
    }

    fn reservation(&self, id: String, amount: u64, at: i64) -> Result<Transfer, LedgerError> {
        Ok(Transfer::single(
            id,
            self.tenant_account()?,
            self.escrow_account()?,
            amount,
            CauseKind::Escrow,
            self.lease.clone(),
            at,
        )
        .pending(self.expires_at)
        .lease(&self.lease, Some(self.next_window)))
    }

    /// The pending transfer that holds the reservation now, as it was made.
    fn held(&self, at: i64) -> Result<Option<Transfer>, LedgerError> {
        let Some(id) = &self.pending else {
            return Ok(None);
        };
        // Its fields are all derived: only the id, the amount and the time differ, and a
        // post or void copies no more than the accounts and the id.
        let mut t = self.reservation(id.clone(), self.reserve, at)?;
        t.id = id.clone();
        Ok(Some(t))
    }

    /// A lease's escrow, holding nothing yet; its owners are checked now, so a bad one is
    /// refused before anything is written.
    pub fn new(
        lease: &str,
        tenant: &str,
        operator: &str,
        price: Price,
        fee_bps: u32,
        expires_at: i64,
    ) -> Result<Escrow, LedgerError> {
        let e = Escrow {
            lease: lease.to_string(),
            tenant: tenant.to_string(),
            operator: operator.to_string(),
            price,
            fee_bps,
            pending: None,
            reserve: 0,
            next_window: 0,
            expires_at,
        };
        e.tenant_account()?;
        e.escrow_account()?;
        AccountId::new(Role::Provider, operator)?;
        Ok(e)
    }

    /// The lease's first reservation: `amount` from the tenant, at `at`.
    pub fn open(&self, amount: u64, at: i64) -> Result<(Escrow, Vec<Transfer>), LedgerError> {
        let mut e = self.clone();
        if amount == 0 || self.pending.is_some() {
            return Ok((e, Vec::new()));
        }
        let id = format!("escrow/{}/0", self.lease);
        let t = e.reservation(id.clone(), amount, at)?;
        e.pending = Some(id);
        e.reserve = amount;
        Ok((e, vec![t]))
    }

    /// The chain that resolves the next window as `outcome` (`reference`: the metering
    /// record's hash), and the escrow after it. Its first transfer's id is the window's
    /// (`window/<lease>/<i>`) whether it pays or refunds: a window is resolved at most once. Nothing changes until the caller applies the
    /// chain and keeps the escrow it returned.
    pub fn resolve(
        &self,
        outcome: Outcome,
        reference: &str,
        at: i64,
    ) -> Result<(Escrow, Vec<Transfer>), LedgerError> {
        let w = self.next_window;
        let price = self.price.window(w)?;
        let mut next = self.clone();
        next.next_window = w + 1;
        let Some(held) = self.held(at)? else {
            // Nothing held: a window the reservation never covered pays nothing.
            return Ok((next, Vec::new()));
        };
        let lease = self.lease.as_str();
        let mut chain = Vec::new();
        let take = price.min(self.reserve);
        let left = self.reserve - take;
        match outcome {
            Outcome::Paid if take > 0 => {
                chain.push(
                    Transfer::post(
                        format!("window/{lease}/{w}"),
                        &held,
                        take,
                        CauseKind::Window,
                        reference,
                        at,
                    )
                    .lease(lease, Some(w))
                    .linked(),
                );
                let (provider, fee) = split(take, self.fee_bps);
                let escrow = self.escrow_account()?;
                if provider > 0 {
                    chain.push(
                        Transfer::single(
                            format!("pay/{lease}/{w}/provider"),
                            escrow.clone(),
                            AccountId::new(Role::Provider, &self.operator)?,
                            provider,
                            CauseKind::Window,
                            reference,
                            at,
                        )
                        .lease(lease, Some(w))
                        .linked(),
                    );
                }
                if fee > 0 {
                    chain.push(
                        Transfer::single(
                            format!("pay/{lease}/{w}/fee"),
                            escrow,
                            AccountId::fee(),
                            fee,
                            CauseKind::Window,
                            reference,
                            at,
                        )
                        .lease(lease, Some(w))
                        .linked(),
                    );
                }
                next.reserve = left;
            }
            _ => {
                // Refunded (or a window of price 0): the reservation is released whole and
                // what is left re-reserved.
                chain.push(
                    Transfer::void(
                        format!("window/{lease}/{w}"),
                        &held,
                        CauseKind::Refund,
                        reference,
                        at,
                    )
                    .lease(lease, Some(w))
                    .linked(),
                );
                next.reserve = left;
            }
        }
        next.pending = None;
        if left > 0 {
            let id = format!("escrow/{lease}/{}", w + 1);
            next.next_window = w + 1;
            chain.push(next.reservation(id.clone(), left, at)?);
            next.pending = Some(id);
        } else if let Some(last) = chain.last_mut() {
            last.linked = false;
        }
        Ok((next, chain))
    }

    /// The chain that trims what the lease holds to `keep` (a lease that ended owes at most
    /// the windows it ran: the rest goes back to the tenant at once, so the job's next lease
    /// can reserve it). Once per lease: its ids name the lease.
    pub fn trim(&self, keep: u64, at: i64) -> Result<(Escrow, Vec<Transfer>), LedgerError> {
        let mut next = self.clone();
        let Some(held) = self.held(at)? else {
            return Ok((next, Vec::new()));
        };
        if keep >= self.reserve {
            return Ok((next, Vec::new()));
        }
        let lease = self.lease.as_str();
        let mut void = Transfer::void(
            format!("trim/{lease}"),
            &held,
            CauseKind::Release,
            lease,
            at,
        )
        .lease(lease, None);
        next.reserve = keep;
        next.pending = None;
        if keep == 0 {
            return Ok((next, vec![void]));
        }
        void.linked = true;
        let id = format!("escrow/{lease}/{}/end", self.next_window);
        let again = next.reservation(id.clone(), keep, at)?;
        next.pending = Some(id);
        Ok((next, vec![void, again]))
    }

    /// The chain that releases what the lease still holds at its end.
    pub fn release(&self, at: i64) -> Result<(Escrow, Vec<Transfer>), LedgerError> {
        let mut next = self.clone();
        next.pending = None;
        next.reserve = 0;
        let Some(held) = self.held(at)? else {
            return Ok((next, Vec::new()));
        };
        let void = Transfer::void(
            format!("release/{}", self.lease),
            &held,
            CauseKind::Release,
            self.lease.clone(),
            at,
        )
        .lease(&self.lease, None);
        Ok((next, vec![void]))
    }
}

/// The chain that slashes `amount` of `operator`'s stake to `tenant` for cheat `cheat` (a
/// challenge id or a record hash: each cheat is slashed at most once).
pub fn slash(
    operator: &str,
    tenant: &str,
    lease: &str,
    cheat: &str,
    amount: u64,
    at: i64,
) -> Result<Vec<Transfer>, LedgerError> {
    if amount == 0 {
        return Ok(Vec::new());
    }
    Ok(vec![
        Transfer::single(
            format!("slash/{cheat}/stake"),
            AccountId::new(Role::Stake, operator)?,
            AccountId::slashed(),
            amount,
            CauseKind::Slash,
            cheat,
            at,
        )
        .lease(lease, None)
        .linked(),
        Transfer::single(
            format!("slash/{cheat}/tenant"),
            AccountId::slashed(),
            AccountId::new(Role::Tenant, tenant)?,
            amount,
            CauseKind::Slash,
            cheat,
            at,
        )
        .lease(lease, None),
    ])
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::book::{Applied, Book};

    #[test]
    fn window_prices_add_up_to_the_cost_and_affordability_is_exact() {
        let p = Price {
            per_gpu_hour: 2_345_679,
            gpus: 3,
            window_secs: 7,
        };
        let mut sum = 0;
        for i in 0..10_000 {
            sum += p.window(i).unwrap();
        }
        assert_eq!(sum, p.cost(10_000).unwrap());
        for budget in [0, 1, 13_679, 13_680, 13_681, 999_999, 10u64.pow(15)] {
            let n = affordable_windows(&p, budget);
            assert!(p.cost(n).unwrap() <= budget, "{budget}: {n}");
            assert!(p.cost(n + 1).unwrap() > budget, "{budget}: {n}");
        }
        let free = Price {
            per_gpu_hour: 0,
            gpus: 8,
            window_secs: 60,
        };
        assert_eq!(affordable_windows(&free, 0), u64::MAX);
        assert_eq!(split(1000, 1000), (900, 100));
        assert_eq!(split(9, 1500), (8, 1));
        assert_eq!(split(5, 20_000), (0, 5));
        assert_eq!(slash_amount(-5, 10, 2), 0);
        assert_eq!(slash_amount(15, 10, 2), 15);
        assert_eq!(slash_amount(50, 10, 2), 20);
    }

    #[test]
    fn a_lease_pays_proven_windows_refunds_the_rest_and_releases_its_end() {
        let mut b = Book::new();
        let tenant = AccountId::new(Role::Tenant, "t").unwrap();
        let dep = Transfer::single(
            "d",
            AccountId::world(),
            tenant.clone(),
            1000,
            CauseKind::Deposit,
            "x",
            0,
        );
        b.apply(&[dep]);
        let price = Price {
            per_gpu_hour: 3600,
            gpus: 2,
            window_secs: 50,
        }; // 100 per window
        let (mut e, t) = Escrow::new("l", "t", "op", price, 1000, 10_000)
            .unwrap()
            .open(450, 1)
            .unwrap();
        assert!(b.apply(&t).iter().all(|r| *r == Ok(Applied::New)));
        for (i, outcome) in [
            Outcome::Paid,
            Outcome::Refunded,
            Outcome::Paid,
            Outcome::Paid,
            Outcome::Paid,
        ]
        .into_iter()
        .enumerate()
        {
            let (next, chain) = e.resolve(outcome, &format!("h{i}"), 2).unwrap();
            let r = b.apply(&chain);
            assert!(r.iter().all(|r| *r == Ok(Applied::New)), "{i}: {r:?}");
            // A retry of the same chain moves nothing.
            assert!(b.apply(&chain).iter().all(|r| *r == Ok(Applied::Exists)));
            e = next;
            b.check().unwrap();
        }
        // 450 reserved: paid 100, refunded 100, paid 100, paid 100, then 50 left for the last.
        let provider = AccountId::new(Role::Provider, "op").unwrap();
        assert_eq!(b.balance(&provider).net_posted(), 90 * 3 + 45);
        assert_eq!(b.balance(&AccountId::fee()).net_posted(), 10 * 3 + 5);
        assert_eq!(e.reserve, 0);
        assert_eq!(e.pending, None);
        assert_eq!(b.balance(&tenant).available(), 1000 - 350);
        let (e2, chain) = e.release(3).unwrap();
        assert!(chain.is_empty());
        assert_eq!(e2.reserve, 0);
        b.check().unwrap();
    }

    #[test]
    fn a_slash_moves_stake_to_the_tenant_once() {
        let mut b = Book::new();
        let stake = AccountId::new(Role::Stake, "op").unwrap();
        b.apply(&[Transfer::single(
            "s",
            AccountId::world(),
            stake.clone(),
            30,
            CauseKind::Stake,
            "x",
            0,
        )]);
        let amount = slash_amount(b.balance(&stake).available(), 100, 1);
        let chain = slash("op", "t", "l", "c-1", amount, 5).unwrap();
        assert!(b.apply(&chain).iter().all(|r| *r == Ok(Applied::New)));
        assert!(b.apply(&chain).iter().all(|r| *r == Ok(Applied::Exists)));
        let tenant = AccountId::new(Role::Tenant, "t").unwrap();
        assert_eq!(b.balance(&tenant).net_posted(), 30);
        assert_eq!(b.balance(&stake).net_posted(), 0);
        // Nothing left to slash: the chain is empty, and a chain asking more is refused.
        assert!(slash("op", "t", "l", "c-2", 0, 6).unwrap().is_empty());
        let over = slash("op", "t", "l", "c-3", 1, 6).unwrap();
        assert!(b.apply(&over).iter().all(Result::is_err));
        b.check().unwrap();
    }
}
