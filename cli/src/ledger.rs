//! `cgx statement`, `cgx ledger deposit|accounts`, `cgx job quote`: the broker's ledger for
//! people — tenants' and operators' statements, money in, and quotes before committing.

use cgx_protocol::ledger::{DepositRequest, QuoteAnswer, Statement};
use cgx_protocol::money::Micros;

use crate::broker::{Conn, SubmitArgs, show, time_of};
use crate::output::CliResult;

/// A statement as a person reads it: per account, opening → closing; per lease, its windows
/// (refunded ones with why); then every line.
pub fn print_statement(s: &Statement, lines: bool) {
    let to = if s.to == i64::MAX {
        "now".to_string()
    } else {
        time_of(s.to)
    };
    let from = if s.from == 0 {
        "the start".to_string()
    } else {
        time_of(s.from)
    };
    println!(
        "statement of {} from {from} to {to} (amounts in currency units)",
        s.owner
    );
    for a in &s.accounts {
        println!(
            "  {:<22} opening {:>14}  +{:<14} -{:<14} closing {:>14}   held {} → {}",
            a.account,
            a.opening_posted,
            a.credits_posted,
            a.debits_posted,
            a.closing_posted,
            a.opening_held,
            a.closing_held
        );
    }
    for l in &s.leases {
        let (paid, refunded): (Vec<_>, Vec<_>) =
            l.windows.iter().partition(|w| w.outcome == "paid");
        println!(
            "  lease {} (job {}, node {}, {} × {}/GPU-h, {} s windows): {} windows paid {} (provider {}, fee {}), {} refunded {}, held {}, {}",
            l.lease,
            l.job,
            l.node,
            l.gpus,
            l.price_per_gpu_hour,
            l.window_secs,
            paid.len(),
            l.paid,
            l.provider,
            l.fee,
            refunded.len(),
            l.refunded,
            l.held,
            l.state
        );
        for w in refunded {
            println!(
                "    window {} refunded {} (record {}…): {}",
                w.window,
                w.amount,
                w.record.get(..12).unwrap_or(&w.record),
                w.reason
            );
        }
    }
    if lines {
        for l in &s.lines {
            let amount = if l.credit.get() > 0 {
                format!("+{}", l.credit)
            } else if l.debit.get() > 0 {
                format!("-{}", l.debit)
            } else if l.held_added.get() > 0 {
                format!("held +{}", l.held_added)
            } else {
                format!("held -{}", l.held_released)
            };
            println!(
                "    #{:<6} {} {:<12} {:<10} {:>18}  balance {:>14}  {} ({})",
                l.seq,
                time_of(l.at),
                l.account,
                l.cause,
                amount,
                l.balance,
                l.transfer,
                l.reference.get(..16).unwrap_or(&l.reference)
            );
        }
    }
    println!(
        "  {} lines; {}",
        s.lines.len(),
        if s.reconciled {
            "reconciled: every account's lines add up to its balance"
        } else {
            "NOT RECONCILED: the lines do not add up to the ledger's balances"
        }
    );
}

/// `cgx statement`.
pub fn statement(
    conn: &Conn,
    tenant: Option<&str>,
    operator: Option<&str>,
    from: Option<i64>,
    to: Option<i64>,
    lines: bool,
) -> CliResult {
    if tenant.is_some() == operator.is_some() {
        return Err("say whose statement: --tenant T or --operator O".into());
    }
    show(
        conn,
        |c| c.statement(tenant, operator, from, to),
        |s| print_statement(s, lines),
    )
}

/// `cgx ledger deposit`.
pub fn deposit(conn: &Conn, account: &str, amount: Micros, reference: &str) -> CliResult {
    let req = DepositRequest {
        account: account.to_string(),
        amount_micros: amount,
        reference: reference.to_string(),
    };
    show(
        conn,
        |c| c.deposit(&req),
        |a| {
            println!(
                "{} {} to {} ({}); available {}{}, held {}",
                if a.new {
                    "deposited"
                } else {
                    "deposited before under this reference: nothing moved;"
                },
                amount,
                a.account,
                a.transfer,
                if a.balance.available_negative {
                    "-"
                } else {
                    ""
                },
                a.balance.available,
                a.balance.debits_pending
            )
        },
    )
}

/// `cgx ledger accounts`.
pub fn accounts(conn: &Conn) -> CliResult {
    show(
        conn,
        |c| c.accounts(),
        |all| {
            for a in all {
                println!(
                    "{:<28} available {}{:<16} held {:<14} posted +{} -{}",
                    a.account,
                    if a.available_negative { "-" } else { "" },
                    a.available,
                    a.debits_pending,
                    a.credits_posted,
                    a.debits_posted
                );
            }
        },
    )
}

/// A quote as a table.
pub fn print_quote(q: &QuoteAnswer) {
    if q.offers.is_empty() {
        println!("no offers");
    }
    for o in &q.offers {
        println!(
            "#{:<2} {}  {:<8} {:<10} GPUs {:?}  {}/GPU-h  reputation {:>4}  costs {}  escrow {}   submit with --offer {}={}",
            o.rank,
            o.node,
            o.operator,
            o.region,
            o.gpus,
            o.price_per_gpu_hour,
            o.reputation,
            o.cost,
            o.escrow,
            o.node,
            o.price_per_gpu_hour
        );
    }
    for x in &q.excluded {
        println!("excluded {}: {} ({})", x.node, x.reason, x.code);
    }
    if q.excluded_more > 0 {
        println!("… and {} more excluded", q.excluded_more);
    }
}

/// `cgx job quote`.
pub fn quote(conn: &Conn, args: &SubmitArgs) -> CliResult {
    let spec = args.spec()?;
    show(conn, |c| c.quote(&spec), print_quote)
}
