//! A deterministic simulation (issue 32, item 6): the ledger driven through at least 1 000 000
//! random operations — deposits, stakes, placements (some the tenant cannot fund), windows
//! paid and refunded, records replayed and forged, failovers and cancellations, slashes, and
//! reservations expiring — against a model kept apart from the book. After every step: every
//! transfer balanced (debits equal credits, posted and pending), no record paid twice, no
//! must-not-go-negative account below zero, the escrow equal to what the leases still hold,
//! and the accounts the step touched equal to the model's. Every 20 000 steps the whole book
//! and the whole model are compared.
//!
//! `CGX_LEDGER_SIM_OPS` changes the count; `CGX_LEDGER_SIM_SEED` the seed (the failing seed
//! and step are printed).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, HashMap, HashSet};

use cgx_ledger::settle::{self, Escrow, Outcome, Price, affordable_windows, slash_amount, split};
use cgx_ledger::{AccountId, Applied, Book, CauseKind, Refusal, Role, Transfer};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // SplitMix64.
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The model: what every account should hold, kept without the book.
#[derive(Default)]
struct Model {
    tenant: HashMap<String, i128>,
    provider: HashMap<String, i128>,
    stake: HashMap<String, i128>,
    fee: i128,
    world: i128,
    /// Per open lease: its escrow and the chains it applied (for replays).
    leases: BTreeMap<String, (Escrow, Vec<Vec<Transfer>>)>,
    reserved: u128,
    paid: HashSet<(String, u64)>,
}

const TENANTS: u64 = 40;
const OPERATORS: u64 = 12;
const FEE_BPS: u32 = 1200;

fn tenant(i: u64) -> String {
    format!("t{i}")
}
fn operator(i: u64) -> String {
    format!("op{i}")
}
fn acct(role: Role, owner: &str) -> AccountId {
    AccountId::new(role, owner).unwrap()
}

fn all_new(r: &[Result<Applied, Refusal>]) -> bool {
    r.iter().all(|a| *a == Ok(Applied::New))
}

struct Sim {
    rng: Rng,
    book: Book,
    model: Model,
    now: i64,
    next_id: u64,
    deposits: Vec<Transfer>,
    ended: u64,
    trimmed: HashSet<String>,
    counts: HashMap<&'static str, u64>,
}

impl Sim {
    fn id(&mut self, p: &str) -> String {
        self.next_id += 1;
        format!("{p}-{}", self.next_id)
    }

    fn count(&mut self, what: &'static str) {
        *self.counts.entry(what).or_default() += 1;
    }

    /// One operation; the accounts it touched.
    fn step(&mut self) -> Vec<AccountId> {
        self.now += i64::try_from(self.rng.below(3)).unwrap();
        let op = self.rng.below(100);
        match op {
            0..=7 => self.deposit(),
            8..=9 => self.stake(),
            10..=17 => self.place(),
            18..=69 => self.window(),
            70..=77 => self.replay(),
            78..=81 => self.forge(),
            82..=84 => self.end(),
            85..=87 => self.trim(),
            88..=91 => self.slash(),
            92..=93 => self.expire(),
            _ => self.replay_deposit(),
        }
    }

    fn deposit(&mut self) -> Vec<AccountId> {
        let t = tenant(self.rng.below(TENANTS));
        let amount = 1 + self.rng.below(5_000_000);
        let id = self.id("dep");
        let d = Transfer::single(
            id,
            AccountId::world(),
            acct(Role::Tenant, &t),
            amount,
            CauseKind::Deposit,
            "bank",
            self.now,
        );
        assert!(all_new(&self.book.apply(std::slice::from_ref(&d))));
        *self.model.tenant.entry(t.clone()).or_default() += i128::from(amount);
        self.model.world -= i128::from(amount);
        self.deposits.push(d);
        if self.deposits.len() > 1000 {
            self.deposits.swap_remove(0);
        }
        self.count("deposit");
        vec![acct(Role::Tenant, &t), AccountId::world()]
    }

    fn replay_deposit(&mut self) -> Vec<AccountId> {
        if self.deposits.is_empty() {
            return Vec::new();
        }
        let i = self.rng.below(self.deposits.len() as u64) as usize;
        let mut d = self.deposits[i].clone();
        if self.rng.below(2) == 0 {
            assert_eq!(
                self.book.apply(std::slice::from_ref(&d)),
                vec![Ok(Applied::Exists)]
            );
            self.count("deposit replayed");
        } else {
            d.amount += 1;
            assert_eq!(
                self.book.apply(std::slice::from_ref(&d)),
                vec![Err(Refusal::ExistsWithDifferentFields(d.id.clone()))]
            );
            self.count("deposit altered, refused");
        }
        vec![d.credit.clone(), AccountId::world()]
    }

    fn stake(&mut self) -> Vec<AccountId> {
        let o = operator(self.rng.below(OPERATORS));
        let amount = 1 + self.rng.below(2_000_000);
        let id = self.id("stake");
        let s = Transfer::single(
            id,
            AccountId::world(),
            acct(Role::Stake, &o),
            amount,
            CauseKind::Stake,
            "bond",
            self.now,
        );
        assert!(all_new(&self.book.apply(&[s])));
        *self.model.stake.entry(o.clone()).or_default() += i128::from(amount);
        self.model.world -= i128::from(amount);
        self.count("stake");
        vec![acct(Role::Stake, &o), AccountId::world()]
    }

    fn place(&mut self) -> Vec<AccountId> {
        if self.model.leases.len() >= 300 {
            return self.end();
        }
        let t = tenant(self.rng.below(TENANTS));
        let o = operator(self.rng.below(OPERATORS));
        let lease = self.id("l");
        let price = Price {
            per_gpu_hour: self.rng.below(4_000_000),
            gpus: 1 + self.rng.below(8) as u32,
            window_secs: [1, 2, 60, 300][self.rng.below(4) as usize],
        };
        let budget = 1 + self.rng.below(3_000_000);
        let e = Escrow::new(
            &lease,
            &t,
            &o,
            price,
            FEE_BPS,
            self.now + 5_000 + self.rng.below(50_000) as i64,
        )
        .unwrap();
        let (e, chain) = e.open(budget, self.now).unwrap();
        let r = self.book.apply(&chain);
        let have = self.model.tenant.get(&t).copied().unwrap_or(0);
        if i128::from(budget) > have {
            assert!(matches!(r[0], Err(Refusal::ExceedsCredits { .. })), "{r:?}");
            self.count("placement refused: funds");
        } else {
            assert!(all_new(&r), "{r:?}");
            *self.model.tenant.get_mut(&t).unwrap() -= i128::from(budget);
            self.model.reserved += u128::from(budget);
            assert!(affordable_windows(&price, budget) >= 1 || price.window(0).unwrap() > budget);
            self.model.leases.insert(lease.clone(), (e, vec![chain]));
            self.count("placement");
        }
        vec![acct(Role::Tenant, &t), acct(Role::Escrow, &lease)]
    }

    fn pick(&mut self) -> Option<String> {
        if self.model.leases.is_empty() {
            return None;
        }
        let i = self.rng.below(self.model.leases.len() as u64) as usize;
        self.model.leases.keys().nth(i).cloned()
    }

    fn window(&mut self) -> Vec<AccountId> {
        let Some(l) = self.pick() else {
            return self.place();
        };
        let (e, _) = self.model.leases[&l].clone();
        let proven = self.rng.below(10) != 0;
        let outcome = if proven {
            Outcome::Paid
        } else {
            Outcome::Refunded
        };
        let record = format!("h{}", self.rng.next());
        let (next, chain) = e.resolve(outcome, &record, self.now).unwrap();
        let r = self.book.apply(&chain);
        if e.pending.is_some() && e.expires_at <= self.now {
            // Past its time-out the reservation resolves only as expired.
            assert!(
                r.iter()
                    .any(|x| matches!(x, Err(Refusal::PendingExpired(_)))),
                "{r:?}"
            );
            self.count("window after expiry, refused");
            return self.expire();
        }
        assert!(all_new(&r), "{r:?}");
        let w = e.next_window;
        let took = e.reserve - next.reserve;
        if outcome == Outcome::Paid && took > 0 {
            assert!(
                self.model.paid.insert((l.clone(), w)),
                "window {w} of {l} paid twice"
            );
            let (p, f) = split(took, FEE_BPS);
            *self.model.provider.entry(e.operator.clone()).or_default() += i128::from(p);
            self.model.fee += i128::from(f);
            self.count("window paid");
        } else {
            *self.model.tenant.get_mut(&e.tenant).unwrap() += i128::from(took);
            self.count("window refunded");
        }
        self.model.reserved -= u128::from(took);
        let entry = self.model.leases.get_mut(&l).unwrap();
        entry.0 = next.clone();
        if !chain.is_empty() {
            // The last few chains are kept for replays.
            if entry.1.len() >= 8 {
                entry.1.remove(1);
            }
            entry.1.push(chain);
        }
        if next.pending.is_none() {
            // Its escrow is spent: the broker ends such a lease before its next window.
            self.model.leases.remove(&l);
            self.ended += 1;
        }
        vec![
            acct(Role::Tenant, &e.tenant),
            acct(Role::Escrow, &l),
            acct(Role::Provider, &e.operator),
            AccountId::fee(),
        ]
    }

    /// A chain applied before, sent again (a retry, or a replayed record): nothing moves.
    fn replay(&mut self) -> Vec<AccountId> {
        let Some(l) = self.pick() else {
            return Vec::new();
        };
        let (e, chains) = self.model.leases[&l].clone();
        let i = self.rng.below(chains.len() as u64) as usize;
        assert!(
            self.book
                .apply(&chains[i])
                .iter()
                .all(|r| *r == Ok(Applied::Exists)),
            "a replay moved money"
        );
        self.count("chain replayed");
        vec![
            acct(Role::Tenant, &e.tenant),
            acct(Role::Escrow, &l),
            acct(Role::Provider, &e.operator),
        ]
    }

    /// A window paid again under another record (a forged or replayed record that got past
    /// the chain): the ids are the window's, so it is refused.
    fn forge(&mut self) -> Vec<AccountId> {
        let Some(l) = self.pick() else {
            return Vec::new();
        };
        let (e, chains) = self.model.leases[&l].clone();
        if e.next_window == 0 || chains.len() < 2 {
            return Vec::new();
        }
        let mut earlier = e.clone();
        earlier.next_window -= 1;
        let (_, chain) = earlier.resolve(Outcome::Paid, "forged", self.now).unwrap();
        let r = self.book.apply(&chain);
        assert!(
            r.iter().all(Result::is_err),
            "a forged window was paid: {r:?}"
        );
        self.count("forged window refused");
        vec![
            acct(Role::Tenant, &e.tenant),
            acct(Role::Escrow, &l),
            acct(Role::Provider, &e.operator),
        ]
    }

    /// A failover or cancellation: what the lease holds goes back.
    fn end(&mut self) -> Vec<AccountId> {
        let Some(l) = self.pick() else {
            return Vec::new();
        };
        let (e, _) = self.model.leases.remove(&l).unwrap();
        let (_, chain) = e.release(self.now).unwrap();
        let r = self.book.apply(&chain);
        if e.pending.is_some() && e.expires_at <= self.now {
            assert!(matches!(r[0], Err(Refusal::PendingExpired(_))), "{r:?}");
            self.model.leases.insert(l.clone(), (e.clone(), Vec::new()));
            return self.expire();
        }
        assert!(all_new(&r), "{r:?}");
        *self.model.tenant.get_mut(&e.tenant).unwrap() += i128::from(e.reserve);
        self.model.reserved -= u128::from(e.reserve);
        self.ended += 1;
        self.count("lease ended");
        vec![acct(Role::Tenant, &e.tenant), acct(Role::Escrow, &l)]
    }

    /// A lease ends (a failover): what it holds is trimmed to what its last windows may
    /// still cost; it settles them, then releases the rest.
    fn trim(&mut self) -> Vec<AccountId> {
        let Some(l) = self.pick() else {
            return Vec::new();
        };
        let e = self.model.leases[&l].0.clone();
        if self.trimmed.contains(&l) {
            // Trimmed before: once per lease (a second trim is a different chain under the
            // same ids, refused).
            let (_, chain) = e.trim(0, self.now).unwrap();
            if !chain.is_empty() {
                assert!(self.book.apply(&chain).iter().all(Result::is_err));
            }
            return self.end();
        }
        self.trimmed.insert(l.clone());
        let keep = self.rng.below(e.reserve + 1);
        let (next, chain) = e.trim(keep, self.now).unwrap();
        let r = self.book.apply(&chain);
        if e.pending.is_some() && e.expires_at <= self.now && !chain.is_empty() {
            assert!(matches!(r[0], Err(Refusal::PendingExpired(_))), "{r:?}");
            return self.expire();
        }
        assert!(all_new(&r), "{r:?}");
        let freed = e.reserve - next.reserve;
        *self.model.tenant.get_mut(&e.tenant).unwrap() += i128::from(freed);
        self.model.reserved -= u128::from(freed);
        if next.pending.is_none() {
            self.model.leases.remove(&l);
            self.ended += 1;
        } else {
            self.model.leases.get_mut(&l).unwrap().0 = next;
        }
        self.count("lease trimmed");
        vec![acct(Role::Tenant, &e.tenant), acct(Role::Escrow, &l)]
    }

    fn slash(&mut self) -> Vec<AccountId> {
        let o = operator(self.rng.below(OPERATORS));
        let t = tenant(self.rng.below(TENANTS));
        let stake = acct(Role::Stake, &o);
        let amount = slash_amount(
            self.book.balance(&stake).available(),
            700_000,
            1 + self.rng.below(8) as u32,
        );
        let cheat = self.id("cheat");
        let chain = settle::slash(&o, &t, "l-x", &cheat, amount, self.now).unwrap();
        assert!(all_new(&self.book.apply(&chain)));
        assert!(
            self.book
                .apply(&chain)
                .iter()
                .all(|r| *r == Ok(Applied::Exists))
        );
        *self.model.stake.entry(o.clone()).or_default() -= i128::from(amount);
        *self.model.tenant.entry(t.clone()).or_default() += i128::from(amount);
        self.count("slash");
        vec![stake, acct(Role::Tenant, &t), AccountId::slashed()]
    }

    /// Reservations past their time-out expire, as the broker's pass does.
    fn expire(&mut self) -> Vec<AccountId> {
        let due = self.book.expiries(self.now);
        let r = self.book.apply(&due);
        assert!(all_new(&r), "{r:?}");
        let mut touched = Vec::new();
        for v in &due {
            let l = v.credit.owner().to_string();
            let (e, _) = self
                .model
                .leases
                .remove(&l)
                .expect("an expired reservation's lease");
            *self.model.tenant.get_mut(&e.tenant).unwrap() += i128::from(e.reserve);
            self.model.reserved -= u128::from(e.reserve);
            self.ended += 1;
            touched.push(acct(Role::Tenant, &e.tenant));
            touched.push(v.credit.clone());
            self.count("reservation expired");
        }
        touched
    }

    fn expect(&self, id: &AccountId) -> i128 {
        match id.role() {
            Role::Tenant => self.model.tenant.get(id.owner()).copied().unwrap_or(0),
            Role::Provider => self.model.provider.get(id.owner()).copied().unwrap_or(0),
            Role::Stake => self.model.stake.get(id.owner()).copied().unwrap_or(0),
            Role::Fee => self.model.fee,
            Role::World => self.model.world,
            Role::Slashed => 0,
            Role::Escrow => 0,
        }
    }

    /// The invariants after a step, on the accounts it touched.
    fn check_step(&self, touched: &[AccountId]) -> Result<(), String> {
        let t = self.book.totals();
        if t.debits_posted != t.credits_posted || t.debits_pending != t.credits_pending {
            return Err(format!("unbalanced: {t:?}"));
        }
        if u128::from(t.credits_pending) != self.model.reserved {
            return Err(format!(
                "escrow holds {} pending, the leases {}",
                t.credits_pending, self.model.reserved
            ));
        }
        for id in touched {
            let b = self.book.balance(id);
            if id.role().must_not_go_negative() && b.available() < 0 {
                return Err(format!("{id} below zero: {b:?}"));
            }
            let got = if id.role() == Role::Escrow {
                // Pass-through: posted in equals posted out.
                b.net_posted()
            } else {
                b.available()
            };
            if got != self.expect(id) {
                return Err(format!("{id}: book {got}, model {}", self.expect(id)));
            }
        }
        Ok(())
    }

    fn check_all(&self) -> Result<(), String> {
        self.book.check()?;
        for (id, b) in self.book.accounts() {
            let got = if id.role() == Role::Escrow {
                b.net_posted()
            } else {
                b.available()
            };
            if got != self.expect(id) {
                return Err(format!("{id}: book {got}, model {}", self.expect(id)));
            }
        }
        for (l, (e, _)) in &self.model.leases {
            let b = self.book.balance(&acct(Role::Escrow, l));
            if u128::from(b.credits_pending) != u128::from(e.reserve) {
                return Err(format!(
                    "escrow/{l} holds {}, its lease {}",
                    b.credits_pending, e.reserve
                ));
            }
        }
        Ok(())
    }
}

#[test]
fn a_million_random_operations_keep_every_invariant() {
    let ops: u64 = std::env::var("CGX_LEDGER_SIM_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let seed: u64 = std::env::var("CGX_LEDGER_SIM_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x00C6_C532);
    let mut sim = Sim {
        rng: Rng(seed),
        book: Book::new(),
        model: Model::default(),
        now: 1_700_000_000,
        next_id: 0,
        deposits: Vec::new(),
        ended: 0,
        trimmed: HashSet::new(),
        counts: HashMap::new(),
    };
    let started = std::time::Instant::now();
    for step in 0..ops {
        let touched = sim.step();
        // What the broker writes back after each batch.
        let _ = sim.book.take_changes();
        if let Err(e) = sim.check_step(&touched) {
            panic!("seed {seed}, step {step}: {e}");
        }
        if step % 20_000 == 19_999 {
            if let Err(e) = sim.check_all() {
                panic!("seed {seed}, step {step} (whole book): {e}");
            }
            sim.book.compact();
        }
    }
    sim.check_all().unwrap();
    let mut counts: Vec<_> = sim.counts.iter().collect();
    counts.sort();
    println!(
        "{ops} operations in {:.1} s (seed {seed}); {} leases ended; {counts:?}",
        started.elapsed().as_secs_f64(),
        sim.ended
    );
    // Every kind of operation happened, or the simulation did not test what it says.
    for what in [
        "deposit",
        "deposit replayed",
        "deposit altered, refused",
        "stake",
        "placement",
        "placement refused: funds",
        "window paid",
        "window refunded",
        "chain replayed",
        "forged window refused",
        "lease ended",
        "slash",
        "reservation expired",
    ] {
        assert!(
            sim.counts.get(what).copied().unwrap_or(0) > 0,
            "no {what} in {ops} operations"
        );
    }
}
