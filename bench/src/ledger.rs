//! `cgx bench ledger`: settlement's costs against the bounds they chase, in one run (issue 32,
//! item 8).
//!
//! - **In memory**: transfers applied per second by `cgx_ledger::Book` (each window's chain:
//!   the post, the provider's share, the fee, the next reservation), against the bare work a
//!   transfer needs — hashing its id and its two accounts' ids into the maps and the
//!   checked additions — measured on the same transfers in the same run.
//! - **Durable**: metering records settled per second by the broker's own settlement pass on
//!   SQLite at `synchronous=FULL` (`cgx_broker::server::bench`), against the database's durable
//!   commit rate for the same rows in the same number of transactions.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::time::Instant;

use cgx_ledger::settle::{Escrow, Outcome, Price};
use cgx_ledger::{AccountId, Applied, Book, CauseKind, Role, Transfer};
use serde_json::json;

use crate::{CliResult, median};

/// `leases × windows` chains, each a window paid (4 transfers), built before the clock runs.
fn chains(leases: usize, windows: u64) -> (Book, Vec<Vec<Transfer>>) {
    let mut book = Book::new();
    let tenant = AccountId::new(Role::Tenant, "t").unwrap_or_else(|_| AccountId::world());
    let _ = book.apply(&[Transfer::single(
        "deposit/bench",
        AccountId::world(),
        tenant,
        u64::MAX / 4,
        CauseKind::Deposit,
        "bench",
        0,
    )]);
    let price = Price {
        per_gpu_hour: 3_600_000,
        gpus: 8,
        window_secs: 60,
    };
    let mut out = Vec::with_capacity(leases * windows as usize);
    let mut escrows = Vec::new();
    for l in 0..leases {
        let Ok(e) = Escrow::new(
            &format!("l{l}"),
            "t",
            &format!("op{}", l % 16),
            price,
            1000,
            0,
        ) else {
            continue;
        };
        let Ok((e, open)) = e.open(price.cost(windows).unwrap_or(0), 1) else {
            continue;
        };
        let _ = book.apply(&open);
        escrows.push(e);
    }
    // Interleaved across leases, as a settlement pass meets them.
    for w in 0..windows {
        for e in escrows.iter_mut() {
            if let Ok((next, chain)) = e.resolve(Outcome::Paid, &format!("{w:064}"), 2) {
                *e = next;
                out.push(chain);
            }
        }
        let _ = w;
    }
    let _ = book.take_changes();
    (book, out)
}

/// Transfers per second through the book.
fn in_memory(leases: usize, windows: u64) -> (f64, usize) {
    let (mut book, chains) = chains(leases, windows);
    let n: usize = chains.iter().map(Vec::len).sum();
    let t = Instant::now();
    let mut ok = 0usize;
    for c in &chains {
        ok += book
            .apply(c)
            .iter()
            .filter(|r| **r == Ok(Applied::New))
            .count();
        // What the broker does after each batch.
        if ok % 4096 < 4 {
            std::hint::black_box(book.take_changes());
        }
    }
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(ok, n, "every transfer applied");
    (n as f64 / secs, n)
}

/// The bare work per transfer on the same transfers: its id and its two accounts hashed into
/// maps, and the four checked additions.
fn bound(leases: usize, windows: u64) -> f64 {
    let (_, chains) = chains(leases, windows);
    let state = std::hash::RandomState::new();
    let mut sums: HashMap<u64, [u64; 4]> = HashMap::new();
    let mut seen: HashMap<u64, ()> = HashMap::new();
    let n: usize = chains.iter().map(Vec::len).sum();
    let t = Instant::now();
    for c in &chains {
        for tr in c {
            let h = |x: &dyn Fn(&mut dyn Hasher)| {
                let mut s = state.build_hasher();
                x(&mut s);
                s.finish()
            };
            seen.insert(h(&|s| tr.id.hash(&mut HashAdapter(s))), ());
            for a in [&tr.debit, &tr.credit] {
                let k = h(&|s| a.hash(&mut HashAdapter(s)));
                let e = sums.entry(k).or_insert([0; 4]);
                e[0] = e[0].checked_add(tr.amount).unwrap_or(e[0]);
                e[1] = e[1].checked_add(tr.amount).unwrap_or(e[1]);
            }
        }
    }
    let secs = t.elapsed().as_secs_f64();
    std::hint::black_box((&sums, &seen));
    n as f64 / secs
}

/// `&mut dyn Hasher` as a `Hasher` (std's `Hash::hash` takes a sized one).
struct HashAdapter<'a>(&'a mut dyn Hasher);

impl Hasher for HashAdapter<'_> {
    fn finish(&self) -> u64 {
        self.0.finish()
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.write(bytes)
    }
}

pub fn bench(leases: usize, windows: u64, rounds: usize, json: bool) -> CliResult {
    let mut mem = Vec::new();
    let mut bare = Vec::new();
    let mut transfers = 0;
    for _ in 0..rounds {
        let (rate, n) = in_memory(leases, windows);
        transfers = n;
        mem.push(rate);
        bare.push(bound(leases, windows));
    }
    let mem_rate = median(mem);
    let bare_rate = median(bare);
    // Durable: the broker's settlement pass on SQLite, beside the database's own commit rate.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let mut runs = Vec::new();
    for r in 0..rounds {
        let dir = std::env::temp_dir().join(format!("cgx-bench-ledger-{}-{r}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // The durable run settles 64 leases × 400 windows: 25 600 records.
        let run = rt
            .block_on(cgx_broker::server::bench::settle_durable(&dir, 64, 400))
            .map_err(|e| e.to_string())?;
        let _ = std::fs::remove_dir_all(&dir);
        runs.push(run);
    }
    runs.sort_by(|a, b| a.records_per_sec.total_cmp(&b.records_per_sec));
    let mid = runs.get(runs.len() / 2).cloned().ok_or("no durable run")?;
    let out = json!({
        "in_memory": {
            "transfers": transfers,
            "transfers_per_sec": mem_rate,
            "goal": 200_000,
            "bound_transfers_per_sec": bare_rate,
            "ratio": mem_rate / bare_rate,
            "bound": "the same transfers' ids and accounts hashed into maps and their sums added, bare",
        },
        "durable_sqlite_full": {
            "records": mid.records,
            "passes": mid.passes,
            "records_per_sec": mid.records_per_sec,
            "goal": 20_000,
            "rows_written": mid.rows_written,
            "bound_records_per_sec": mid.raw_records_per_sec,
            "ratio": mid.ratio,
            "bound": "the same number of rows in the same number of durable transactions, bare",
        },
        "rounds": rounds,
    });
    if json {
        crate::print_json(&out)?;
    } else {
        println!(
            "in memory: {:.0} transfers/s (goal 200 000) — bound {:.0}/s (hashing and sums alone), ratio {:.2}",
            mem_rate,
            bare_rate,
            mem_rate / bare_rate
        );
        println!(
            "durable (SQLite, synchronous=FULL): {:.0} records settled/s in {} pass(es) of {} records (goal 20 000) — the same {} rows bare: {:.0} records/s, ratio {:.2}",
            mid.records_per_sec,
            mid.passes,
            mid.records,
            mid.rows_written,
            mid.raw_records_per_sec,
            mid.ratio
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}
