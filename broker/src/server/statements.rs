//! The ledger's API (issue 32): deposits (money in, by an admin or a payment adapter, audited),
//! the accounts (auditors), and statements — a tenant's or an operator's money over a period,
//! every line a transfer with its cause, every lease with its windows and their records, and
//! totals that reconcile with the ledger's stored sums.
//!
//! Who sees what: a tenant its own statement (`tenant:<name>`), an operator its own
//! (`operator:<name>`), auditors (`auditor`) and `*` every one; deposits need `ledger` or `*`.

use std::collections::HashMap;

use cgx_ledger::settle::split;
use cgx_ledger::{AccountId, Balance, CauseKind, Phase, Role, Transfer};
use cgx_protocol::ledger::{
    AccountBalance, DepositAnswer, DepositRequest, LeaseSettlement, Statement, StatementAccount,
    StatementLine, WindowLine,
};
use cgx_protocol::money::Micros;
use cgx_service::auth::Admin;

use super::config::LEDGER_SCOPE;
use super::store::{LedgerWrite, Outcome, Refusal};
use super::{Broker, BrokerError};

/// The most lines one statement carries: past it, ask for a shorter period.
const MAX_LINES: i64 = 200_000;

fn micros(v: u64) -> Micros {
    Micros(v)
}

fn clamp(v: i128) -> Micros {
    Micros(u64::try_from(v.max(0)).unwrap_or(u64::MAX))
}

/// An account's sums as the API shows them.
pub(crate) fn balance_view(id: &AccountId, b: &Balance) -> AccountBalance {
    let available = b.available();
    AccountBalance {
        account: id.to_string(),
        debits_posted: micros(b.debits_posted),
        credits_posted: micros(b.credits_posted),
        debits_pending: micros(b.debits_pending),
        credits_pending: micros(b.credits_pending),
        available: clamp(available.abs()),
        available_negative: available < 0,
    }
}

/// Whose statement: a tenant's or an operator's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Owner {
    Tenant(String),
    Operator(String),
}

impl Owner {
    fn scope(&self) -> String {
        match self {
            Owner::Tenant(t) => format!("tenant:{t}"),
            Owner::Operator(o) => format!("operator:{o}"),
        }
    }

    fn accounts(&self) -> Result<Vec<AccountId>, BrokerError> {
        let bad = |e: cgx_ledger::LedgerError| BrokerError::BadRequest(e.to_string());
        Ok(match self {
            Owner::Tenant(t) => vec![AccountId::new(Role::Tenant, t).map_err(bad)?],
            Owner::Operator(o) => vec![
                AccountId::new(Role::Provider, o).map_err(bad)?,
                AccountId::new(Role::Stake, o).map_err(bad)?,
            ],
        })
    }
}

impl Broker {
    /// `POST /v1/ledger/deposits`.
    pub(crate) async fn deposit(
        &self,
        admin: &Admin,
        req: DepositRequest,
    ) -> Result<DepositAnswer, BrokerError> {
        if !admin.scopes().iter().any(|s| s == "*" || s == LEDGER_SCOPE) {
            return Err(BrokerError::Forbidden(
                "deposits are made by admins and payment adapters (scope ledger or *)".into(),
            ));
        }
        self.deposit_as(
            &req.account,
            req.amount_micros.get(),
            &req.reference,
            &admin.actor(),
        )
        .await
    }

    /// A deposit by `actor`, whose right to make it the caller checked.
    pub(crate) async fn deposit_as(
        &self,
        account: &str,
        amount: u64,
        reference: &str,
        actor: &str,
    ) -> Result<DepositAnswer, BrokerError> {
        let req = DepositRequest {
            account: account.to_string(),
            amount_micros: Micros(amount),
            reference: reference.to_string(),
        };
        let account: AccountId = req
            .account
            .parse()
            .map_err(|e: cgx_ledger::LedgerError| BrokerError::BadRequest(e.to_string()))?;
        let cause = match account.role() {
            Role::Tenant => CauseKind::Deposit,
            Role::Stake => CauseKind::Stake,
            _ => {
                return Err(BrokerError::BadRequest(format!(
                    "deposits go to tenant/<name> or stake/<operator>, not {account}"
                )));
            }
        };
        if req.amount_micros.get() == 0 || !req.amount_micros.in_range() {
            return Err(BrokerError::BadRequest(format!(
                "amount_micros must be 1 to {}",
                Micros::MAX.get()
            )));
        }
        let ok = !req.reference.is_empty()
            && req.reference.len() <= 128
            && req
                .reference
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._:@-".contains(&b));
        if !ok {
            return Err(BrokerError::BadRequest(
                "reference: 1–128 of [A-Za-z0-9._:@-]".into(),
            ));
        }
        let id = format!("deposit/{}", req.reference);
        let transfer = Transfer::single(
            id.clone(),
            AccountId::world(),
            account.clone(),
            req.amount_micros.get(),
            cause,
            req.reference.clone(),
            self.clock.unix(),
        );
        let detail = serde_json::json!({
            "amount_micros": req.amount_micros.get(),
            "reference": req.reference,
            "transfer": id,
        });
        let actor = actor.to_string();
        let new = match self
            .store
            .write(LedgerWrite::Deposit {
                transfer: Box::new(transfer),
                actor,
                detail,
            })
            .await?
        {
            Outcome::Items(items) => matches!(items.first(), Some(Ok(true))),
            Outcome::Refused(Refusal::Funds(why)) => return Err(BrokerError::Conflict(why)),
            other => return Err(BrokerError::Internal(format!("deposit: {other:?}"))),
        };
        if new {
            self.metrics.event("ledger", cause.as_str());
        }
        let b = self.store.account(&account).await?;
        Ok(DepositAnswer {
            transfer: id,
            account: account.to_string(),
            new,
            balance: balance_view(&account, &b),
        })
    }

    /// `GET /v1/ledger/accounts`: every account and the totals (auditors).
    pub(crate) async fn accounts(&self, admin: &Admin) -> Result<Vec<AccountBalance>, BrokerError> {
        if !admin.scopes().iter().any(|s| s == "*" || s == "auditor") {
            return Err(BrokerError::Forbidden(
                "the ledger's accounts are for auditors".into(),
            ));
        }
        Ok(self
            .store
            .accounts()
            .await?
            .iter()
            .map(|(id, b)| balance_view(id, b))
            .collect())
    }

    /// `GET /v1/statements`.
    pub(crate) async fn statement(
        &self,
        admin: &Admin,
        owner: Owner,
        from: Option<i64>,
        to: Option<i64>,
    ) -> Result<Statement, BrokerError> {
        let scope = owner.scope();
        let name = match &owner {
            Owner::Tenant(n) | Owner::Operator(n) => n.clone(),
        };
        super::register::check_name(
            &name,
            if matches!(owner, Owner::Tenant(_)) {
                "tenant"
            } else {
                "operator"
            },
        )?;
        if !admin
            .scopes()
            .iter()
            .any(|s| s == "*" || s == "auditor" || *s == scope)
        {
            return Err(BrokerError::Forbidden(format!(
                "this token may not read {scope}'s statement"
            )));
        }
        let now = self.clock.unix();
        let from = from.unwrap_or(0);
        let to = to.unwrap_or(i64::MAX);
        if from >= to {
            return Err(BrokerError::BadRequest("from must be before to".into()));
        }
        let accounts = owner.accounts()?;
        let names: Vec<String> = accounts.iter().map(ToString::to_string).collect();
        // The period's lines; what came before `from` is the opening, summed by the database
        // (a long-lived tenant's statement reads its period, not its history).
        // One read transaction: the lines, the opening and the stored sums below agree however
        // much settles meanwhile.
        let mut read = self.store.ledger_read(true).await?;
        let transfers = read.transfers_of(&names, from, to, MAX_LINES + 1).await?;
        if transfers.len() as i64 > MAX_LINES {
            return Err(BrokerError::BadRequest(format!(
                "more than {MAX_LINES} transfers: ask for a shorter period (from, to)"
            )));
        }
        let mut pending: HashMap<String, u64> = transfers
            .iter()
            .filter(|(_, t)| t.phase == Phase::Pending)
            .map(|(_, t)| (t.id.clone(), t.amount))
            .collect();
        // Reservations made before the period and resolved in it.
        let before: Vec<String> = transfers
            .iter()
            .filter_map(|(_, t)| t.pending.clone())
            .filter(|p| !pending.contains_key(p))
            .collect();
        for (id, amount) in read.transfer_amounts(&before).await? {
            pending.insert(id, amount);
        }
        struct Sums {
            posted: i128,
            held: i128,
            opening_posted: i128,
            opening_held: i128,
            credits: u128,
            debits: u128,
        }
        let mut sums: HashMap<String, Sums> = HashMap::new();
        for n in &names {
            let (posted, held) = read.sums_before(n, from).await?;
            sums.insert(
                n.clone(),
                Sums {
                    posted,
                    held,
                    opening_posted: posted,
                    opening_held: held,
                    credits: 0,
                    debits: 0,
                },
            );
        }
        let mut lines = Vec::new();
        for (seq, t) in &transfers {
            for (side, account) in [(true, &t.credit), (false, &t.debit)] {
                let name = account.to_string();
                let Some(s) = sums.get_mut(&name) else {
                    continue;
                };
                // What the transfer did to this account: posted in or out, held added or
                // released (a post or void releases the whole reservation it resolves).
                let released = t
                    .pending
                    .as_deref()
                    .and_then(|p| pending.get(p).copied())
                    .unwrap_or(0);
                let (credit, debit, added, freed) = match (t.phase, side) {
                    (Phase::Single | Phase::Post, true) => (t.amount, 0, 0, 0),
                    (Phase::Single, false) => (0, t.amount, 0, 0),
                    (Phase::Post, false) => (0, t.amount, 0, released),
                    (Phase::Pending, false) => (0, 0, t.amount, 0),
                    (Phase::Void, false) => (0, 0, 0, released),
                    // The credit side of a reservation is the escrow's, not an owner's.
                    (Phase::Pending | Phase::Void, true) => (0, 0, 0, 0),
                };
                s.posted += i128::from(credit) - i128::from(debit);
                s.held += i128::from(added) - i128::from(freed);
                s.credits += u128::from(credit);
                s.debits += u128::from(debit);
                lines.push(StatementLine {
                    seq: *seq,
                    transfer: t.id.clone(),
                    at: t.at,
                    account: name,
                    counterparty: if side { &t.debit } else { &t.credit }.to_string(),
                    phase: t.phase.as_str().into(),
                    cause: t.cause.as_str().into(),
                    reference: t.reference.clone(),
                    lease: t.lease.clone(),
                    window: t.window,
                    credit: micros(credit),
                    debit: micros(debit),
                    held_added: micros(added),
                    held_released: micros(freed),
                    balance: clamp(s.posted),
                });
            }
        }
        let mut reconciled = true;
        let mut views = Vec::new();
        for (id, name) in accounts.iter().zip(&names) {
            let Some(s) = sums.get(name) else { continue };
            let closing = s.opening_posted + s.credits as i128 - s.debits as i128;
            if closing != s.posted {
                reconciled = false;
            }
            if to > now {
                // The period runs past now: the lines must add up to the ledger's stored sums
                // (read in the same transaction). A period that ends at `now` leaves out this
                // second's transfers, which the sums hold.
                let b = read.account(id).await?;
                if b.net_posted() != s.posted || i128::from(b.debits_pending) != s.held {
                    tracing::error!(account = %name, stored = ?b, lines = s.posted, held = s.held, "a statement does not reconcile");
                    reconciled = false;
                }
            }
            views.push(StatementAccount {
                account: name.clone(),
                opening_posted: clamp(s.opening_posted),
                credits_posted: Micros(u64::try_from(s.credits).unwrap_or(u64::MAX)),
                debits_posted: Micros(u64::try_from(s.debits).unwrap_or(u64::MAX)),
                closing_posted: clamp(closing),
                opening_held: clamp(s.opening_held),
                closing_held: clamp(s.held),
            });
        }
        let (tenant, operator) = match &owner {
            Owner::Tenant(t) => (Some(t.as_str()), None),
            Owner::Operator(o) => (None, Some(o.as_str())),
        };
        let mut leases = Vec::new();
        for e in read.escrows_of(tenant, operator, from, to).await? {
            let windows = read.settled_windows(&e.escrow.lease).await?;
            let (mut paid, mut provider, mut fee, mut refunded) = (0u64, 0u64, 0u64, 0u64);
            for w in &windows {
                match w.outcome.as_str() {
                    "paid" => {
                        let (p, f) = split(w.amount, e.escrow.fee_bps);
                        paid += w.amount;
                        provider += p;
                        fee += f;
                    }
                    "refunded" => refunded += w.amount,
                    _ => {}
                }
            }
            leases.push(LeaseSettlement {
                lease: e.escrow.lease.clone(),
                job: e.job_id.clone(),
                node: e.node_id.clone(),
                tenant: e.escrow.tenant.clone(),
                operator: e.escrow.operator.clone(),
                started_at: e.started_at,
                price_per_gpu_hour: Micros(e.escrow.price.per_gpu_hour),
                gpus: e.escrow.price.gpus,
                window_secs: e.escrow.price.window_secs,
                covers: e.covers,
                paid: Micros(paid),
                provider: Micros(provider),
                fee: Micros(fee),
                refunded: Micros(refunded),
                held: Micros(e.escrow.reserve),
                state: e.state.clone(),
                windows: windows
                    .into_iter()
                    .map(|w| WindowLine {
                        window: w.window,
                        outcome: w.outcome,
                        record: w.record,
                        amount: Micros(w.amount),
                        reason: w.reason,
                        at: w.at,
                    })
                    .collect(),
            });
        }
        read.done().await?;
        Ok(Statement {
            owner: scope,
            from,
            to,
            unit: "micros".into(),
            accounts: views,
            lines,
            leases,
            reconciled,
        })
    }
}
