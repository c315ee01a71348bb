//! The ledger's storage (issue 32; the rules are `cgx_ledger`'s): accounts, whose sums are a
//! cache of the transfers; transfers, insert-only, one row each, in the order they were
//! applied; escrows, one per lease — what it holds, which pending transfer holds it, the next
//! window to resolve; and the settled windows, one per (lease, window), paid or refunded and
//! why.
//!
//! Every posting is applied by `cgx_ledger::Book` to the accounts, pending transfers and ids it
//! names, loaded inside the write's transaction (on PostgreSQL under the replicas' write lock),
//! and written back in that same transaction with the state change it pays for: the
//! placement that opens an escrow, the settlement of a window, a lease's release. A second
//! attempt at the same cause finds its ids taken: a window is resolved, and a record paid, at
//! most once — the database holds that too (`ledger_transfers.id` and the pending transfer a
//! post or void resolves are unique).

use std::collections::{BTreeMap, BTreeSet};

use cgx_ledger::settle::{Escrow, Outcome as WindowOutcome, Price};
use cgx_ledger::{
    AccountId, Applied, Balance, Book, CauseKind, Changes, Known, PendingState, Phase, Resolution,
    Transfer,
};
use cgx_service::db::placeholders;
use sqlx::Row;

use super::super::error::BrokerError;
use super::{Backend, Outcome, Refusal, Store, Tx};

/// Migration 10 (issue 32), the same on both backends but for the transfers' sequence.
macro_rules! ledger_v10 {
    ($seq:literal) => {
        concat!(
            "CREATE TABLE ledger_accounts (
        id TEXT PRIMARY KEY, role TEXT NOT NULL, owner TEXT NOT NULL,
        debits_pending BIGINT NOT NULL, debits_posted BIGINT NOT NULL,
        credits_pending BIGINT NOT NULL, credits_posted BIGINT NOT NULL,
        updated_at BIGINT NOT NULL);
     CREATE TABLE ledger_transfers (",
            $seq,
            ", id TEXT NOT NULL UNIQUE, debit TEXT NOT NULL, credit TEXT NOT NULL,
        amount BIGINT NOT NULL, phase TEXT NOT NULL, pending_id TEXT, expires_at BIGINT NOT NULL,
        linked BIGINT NOT NULL, cause TEXT NOT NULL, reference TEXT NOT NULL, lease_id TEXT,
        win BIGINT, at BIGINT NOT NULL, party TEXT);
     CREATE UNIQUE INDEX ledger_resolves ON ledger_transfers (pending_id)
        WHERE pending_id IS NOT NULL;
     CREATE INDEX ledger_party ON ledger_transfers (party, seq) WHERE party IS NOT NULL;
     CREATE TABLE escrows (
        lease_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, tenant TEXT NOT NULL,
        operator TEXT NOT NULL, node_id TEXT NOT NULL, per_gpu_hour BIGINT NOT NULL,
        gpus BIGINT NOT NULL, window_secs BIGINT NOT NULL, fee_bps BIGINT NOT NULL,
        pending_id TEXT, reserve BIGINT NOT NULL, next_win BIGINT NOT NULL,
        expires_at BIGINT NOT NULL, covers BIGINT NOT NULL, spent BIGINT NOT NULL,
        started_at BIGINT NOT NULL, state TEXT NOT NULL, closed_at BIGINT);
     CREATE INDEX escrows_open ON escrows (state, started_at, lease_id);
     CREATE INDEX escrows_job ON escrows (job_id);
     CREATE INDEX escrows_tenant ON escrows (tenant, started_at);
     CREATE INDEX escrows_operator ON escrows (operator, started_at);
     CREATE TABLE settled_windows (
        lease_id TEXT NOT NULL, win BIGINT NOT NULL, outcome TEXT NOT NULL,
        record TEXT NOT NULL, amount BIGINT NOT NULL, reason TEXT NOT NULL, at BIGINT NOT NULL,
        PRIMARY KEY (lease_id, win))"
        )
    };
}
pub(super) use ledger_v10;

/// Binds per multi-row statement: well under both backends' limits (SQLite 32 766,
/// PostgreSQL 65 535), large enough that a pass of thousands of windows is few statements.
const CHUNK: usize = 200;

/// A lease's escrow row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EscrowRow {
    pub escrow: Escrow,
    pub job_id: String,
    pub node_id: String,
    pub started_at: i64,
    /// How many windows its first reservation covered: the lease ends before the next.
    pub covers: u64,
    /// What it has paid out so far.
    pub spent: u64,
    /// `open` until released.
    pub state: String,
    pub closed_at: Option<i64>,
}

/// Opening a lease's escrow, inside its placement's write.
#[derive(Debug, Clone)]
pub struct EscrowOpen {
    pub escrow: Escrow,
    pub job_id: String,
    pub node_id: String,
    pub started_at: i64,
    pub covers: u64,
    /// What the reservation takes from the tenant.
    pub reserve: u64,
    /// What the job's other leases had spent and still held when this one was signed: the
    /// write refuses if that moved since (the reservation was computed from it).
    pub job_committed: u64,
}

/// One window to resolve.
#[derive(Debug, Clone)]
pub struct WindowSettle {
    pub lease: String,
    pub window: u64,
    pub outcome: WindowOutcome,
    /// The metering record's hash (the cause the transfers name).
    pub record: String,
    pub reason: String,
    pub at: i64,
}

#[derive(Debug)]
pub(crate) enum LedgerWrite {
    /// Money in (a deposit or a stake), with its audit event.
    Deposit {
        transfer: Box<Transfer>,
        actor: String,
        detail: serde_json::Value,
    },
    /// A lease's escrow opened on its own (the benchmark's seed; a placement opens its
    /// lease's in its own write).
    Open(Box<EscrowOpen>),
    /// Windows resolved, in order per lease.
    Settle(Vec<WindowSettle>),
    /// What `lease`'s escrow still holds goes back (its end), or expires (`expiry`).
    Release {
        lease: String,
        at: i64,
        expiry: bool,
    },
    /// A proven cheat's slash (built by `cgx_ledger::settle::slash` inside the write, from the
    /// stake available then).
    Slash {
        operator: String,
        tenant: String,
        lease: String,
        cheat: String,
        per_gpu: u64,
        gpus: u32,
        at: i64,
        /// Reputation's half-life: the cheat counts against the lease's node and operator.
        half_life: i64,
        now_ms: i64,
    },
}

fn overflow(what: &str) -> sqlx::Error {
    sqlx::Error::Protocol(format!("{what} does not fit a BIGINT"))
}

fn big(v: u64, what: &str) -> Result<i64, sqlx::Error> {
    i64::try_from(v).map_err(|_| overflow(what))
}

fn unsigned(r: &sqlx::any::AnyRow, c: &str) -> Result<u64, sqlx::Error> {
    let v: i64 = r.try_get(c)?;
    u64::try_from(v).map_err(|_| sqlx::Error::ColumnDecode {
        index: c.into(),
        source: "negative".into(),
    })
}

fn decode<T>(c: &str, v: Option<T>) -> Result<T, sqlx::Error> {
    v.ok_or_else(|| sqlx::Error::ColumnDecode {
        index: c.into(),
        source: "not a value this broker knows".into(),
    })
}

const TRANSFER_COLUMNS: &str = "seq, id, debit, credit, amount, phase, pending_id, expires_at, linked, cause, reference, lease_id, win, at";

/// A transfer row, with its sequence number.
pub(crate) fn transfer_row(r: &sqlx::any::AnyRow) -> Result<(i64, Transfer), sqlx::Error> {
    let account = |c: &str| -> Result<AccountId, sqlx::Error> {
        let s: String = r.try_get(c)?;
        s.parse()
            .map_err(|e: cgx_ledger::LedgerError| sqlx::Error::ColumnDecode {
                index: c.into(),
                source: e.to_string().into(),
            })
    };
    let win: Option<i64> = r.try_get("win")?;
    Ok((
        r.try_get("seq")?,
        Transfer {
            id: r.try_get("id")?,
            debit: account("debit")?,
            credit: account("credit")?,
            amount: unsigned(r, "amount")?,
            phase: decode("phase", Phase::parse(&r.try_get::<String, _>("phase")?))?,
            pending: r.try_get("pending_id")?,
            expires_at: r.try_get("expires_at")?,
            linked: r.try_get::<i64, _>("linked")? != 0,
            cause: decode("cause", CauseKind::parse(&r.try_get::<String, _>("cause")?))?,
            reference: r.try_get("reference")?,
            lease: r.try_get("lease_id")?,
            window: win.and_then(|w| u64::try_from(w).ok()),
            at: r.try_get("at")?,
        },
    ))
}

fn balance_row(r: &sqlx::any::AnyRow) -> Result<Balance, sqlx::Error> {
    Ok(Balance {
        debits_pending: unsigned(r, "debits_pending")?,
        debits_posted: unsigned(r, "debits_posted")?,
        credits_pending: unsigned(r, "credits_pending")?,
        credits_posted: unsigned(r, "credits_posted")?,
    })
}

const ESCROW_COLUMNS: &str = "lease_id, job_id, tenant, operator, node_id, per_gpu_hour, gpus, window_secs, fee_bps, pending_id, reserve, next_win, expires_at, covers, spent, started_at, state, closed_at";

fn escrow_row(r: &sqlx::any::AnyRow) -> Result<EscrowRow, sqlx::Error> {
    Ok(EscrowRow {
        escrow: Escrow {
            lease: r.try_get("lease_id")?,
            tenant: r.try_get("tenant")?,
            operator: r.try_get("operator")?,
            price: Price {
                per_gpu_hour: unsigned(r, "per_gpu_hour")?,
                gpus: u32::try_from(unsigned(r, "gpus")?).unwrap_or(0),
                window_secs: u32::try_from(unsigned(r, "window_secs")?).unwrap_or(0),
            },
            fee_bps: u32::try_from(unsigned(r, "fee_bps")?).unwrap_or(0),
            pending: r.try_get("pending_id")?,
            reserve: unsigned(r, "reserve")?,
            next_window: unsigned(r, "next_win")?,
            expires_at: r.try_get("expires_at")?,
        },
        job_id: r.try_get("job_id")?,
        node_id: r.try_get("node_id")?,
        started_at: r.try_get("started_at")?,
        covers: unsigned(r, "covers")?,
        spent: unsigned(r, "spent")?,
        state: r.try_get("state")?,
        closed_at: r.try_get("closed_at")?,
    })
}

/// Bind a list of texts to `sql` (which has `{}` where the `$1, $2, …` list goes) in chunks,
/// collecting the rows.
async fn select_in(
    tx: &mut Tx,
    sql: &str,
    keys: &[String],
) -> Result<Vec<sqlx::any::AnyRow>, sqlx::Error> {
    let mut out = Vec::new();
    for chunk in keys.chunks(CHUNK) {
        let list = (1..=chunk.len())
            .map(|i| format!("${i}"))
            .collect::<Vec<_>>()
            .join(", ");
        let q = sql.replace("{}", &list);
        let mut query = sqlx::query(sqlx::AssertSqlSafe(q));
        for k in chunk {
            query = query.bind(k.clone());
        }
        out.extend(query.fetch_all(&mut **tx).await?);
    }
    Ok(out)
}

/// A book holding what `chains` name: their accounts, the pending transfers they resolve, and
/// those of their ids already used.
async fn load_book(tx: &mut Tx, chains: &[&[Transfer]]) -> Result<Book, sqlx::Error> {
    load_book_with(tx, chains, None, true).await
}

/// [`load_book`], the pending transfers to load named (`None`: every one the chains
/// resolve), and the chains' own ids looked up or not (`known`). Settlement names only its
/// escrows' current reservations (the rest its chains make themselves) and looks up no ids:
/// its windows are new by the escrow's next-window check, and were one not, its ids' unique
/// index would fail the write rather than pay twice.
async fn load_book_with(
    tx: &mut Tx,
    chains: &[&[Transfer]],
    pending_only: Option<&[String]>,
    known: bool,
) -> Result<Book, sqlx::Error> {
    let mut accounts = BTreeSet::new();
    let mut pending = BTreeSet::new();
    let mut ids = BTreeSet::new();
    for t in chains.iter().flat_map(|c| c.iter()) {
        accounts.insert(t.debit.to_string());
        accounts.insert(t.credit.to_string());
        if pending_only.is_none()
            && let Some(p) = &t.pending
        {
            pending.insert(p.clone());
        }
        if known {
            ids.insert(t.id.clone());
        }
    }
    if let Some(only) = pending_only {
        pending.extend(only.iter().cloned());
    }
    let mut book = Book::new();
    let accounts: Vec<String> = accounts.into_iter().collect();
    for r in select_in(
        tx,
        "SELECT id, debits_pending, debits_posted, credits_pending, credits_posted FROM ledger_accounts WHERE id IN ({})",
        &accounts,
    )
    .await?
    {
        let id: String = r.try_get("id")?;
        let id: AccountId = id.parse().map_err(|e: cgx_ledger::LedgerError| {
            sqlx::Error::ColumnDecode {
                index: "id".into(),
                source: e.to_string().into(),
            }
        })?;
        book.load_account(id, balance_row(&r)?);
    }
    let pending: Vec<String> = pending.into_iter().collect();
    let mut resolved: BTreeMap<String, Resolution> = BTreeMap::new();
    for r in select_in(
        tx,
        "SELECT pending_id, phase, cause FROM ledger_transfers WHERE pending_id IN ({})",
        &pending,
    )
    .await?
    {
        let p: String = r.try_get("pending_id")?;
        let phase: String = r.try_get("phase")?;
        let cause: String = r.try_get("cause")?;
        let how = match (phase.as_str(), cause.as_str()) {
            ("post", _) => Resolution::Posted,
            (_, "expiry") => Resolution::Expired,
            _ => Resolution::Voided,
        };
        resolved.insert(p, how);
    }
    let sql = format!("SELECT {TRANSFER_COLUMNS} FROM ledger_transfers WHERE id IN ({{}})");
    for r in select_in(tx, &sql, &pending).await? {
        let (_, t) = transfer_row(&r)?;
        if t.phase == Phase::Pending {
            let resolution = resolved.get(&t.id).copied().unwrap_or(Resolution::Open);
            book.load_pending(PendingState {
                transfer: t,
                resolution,
            });
        }
    }
    let ids: Vec<String> = ids.into_iter().collect();
    for r in select_in(tx, &sql, &ids).await? {
        let (_, t) = transfer_row(&r)?;
        book.load_known(t.id.clone(), Known::Transfer(Box::new(t)));
    }
    Ok(book)
}

/// Write what a book changed: the accounts' sums and the transfers, in order.
async fn write_changes(tx: &mut Tx, c: &Changes, at: i64) -> Result<(), sqlx::Error> {
    let accounts: Vec<(&AccountId, &Balance)> = c.accounts.iter().collect();
    for chunk in accounts.chunks(CHUNK / 8) {
        let sql = format!(
            "INSERT INTO ledger_accounts (id, role, owner, debits_pending, debits_posted, credits_pending, credits_posted, updated_at) VALUES {}
             ON CONFLICT (id) DO UPDATE SET debits_pending = excluded.debits_pending,
               debits_posted = excluded.debits_posted, credits_pending = excluded.credits_pending,
               credits_posted = excluded.credits_posted, updated_at = excluded.updated_at",
            placeholders(chunk.len(), 8)
        );
        let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
        for (id, b) in chunk {
            q = q
                .bind(id.to_string())
                .bind(id.role().as_str())
                .bind(id.owner().to_string())
                .bind(big(b.debits_pending, "an account's sum")?)
                .bind(big(b.debits_posted, "an account's sum")?)
                .bind(big(b.credits_pending, "an account's sum")?)
                .bind(big(b.credits_posted, "an account's sum")?)
                .bind(at);
        }
        q.execute(&mut **tx).await?;
    }
    insert_transfers(tx, &c.transfers).await?;
    Ok(())
}

/// The transfer rows' columns, in the order the JSON batch carries them.
const TRANSFER_INSERT: &str = "id, debit, credit, amount, phase, pending_id, expires_at, linked, cause, reference, lease_id, win, at, party";

/// The account a transfer is a statement line of: its tenant, provider or stake side (every
/// transfer has at most one — the other is an escrow, the world, the fee or the slashed
/// account). Indexed alone: half the index entries of indexing both sides, on the hot path
/// of settlement, where the escrow side is never asked for.
fn party(t: &Transfer) -> Option<String> {
    let owned = |a: &AccountId| {
        matches!(
            a.role(),
            cgx_ledger::Role::Tenant | cgx_ledger::Role::Provider | cgx_ledger::Role::Stake
        )
    };
    match (owned(&t.debit), owned(&t.credit)) {
        (true, true) => {
            tracing::error!(transfer = %t.id, "a transfer between two owners' accounts; its statement line is the debit's");
            Some(t.debit.to_string())
        }
        (true, false) => Some(t.debit.to_string()),
        (false, true) => Some(t.credit.to_string()),
        (false, false) => None,
    }
}

/// Rows per JSON batch (one bind each: a settlement pass's hundred thousand transfers are a
/// few dozen statements).
const JSON_ROWS: usize = 4096;

/// Insert `rows` into `table`'s `columns` (name, PostgreSQL type), in order, one bind per
/// batch: each row serializes as a JSON array of the columns' values, and the database's own
/// JSON reader unpacks them (SQLite's `jsonb_each`, PostgreSQL's `jsonb_array_elements`),
/// where binding each value costs the driver a round of conversions (measured: 1.7 µs a
/// bind, which bounded settlement at half the goal). Arrays, not objects, and SQLite's binary
/// JSON: each column is then read from the parsed row by position, where `json_each` handed
/// every column lookup the row as text to parse again (measured: two thirds of the insert).
pub(crate) async fn insert_json<R: serde::Serialize>(
    tx: &mut Tx,
    table: &str,
    columns: &[(&str, &str)],
    rows: &[R],
) -> Result<(), sqlx::Error> {
    let sqlite = matches!(tx.backend_name(), "SQLite");
    let names: Vec<&str> = columns.iter().map(|(n, _)| *n).collect();
    let sql = if sqlite {
        let picks: Vec<String> = (0..names.len()).map(|i| format!("value ->> {i}")).collect();
        format!(
            "INSERT INTO {table} ({}) SELECT {} FROM jsonb_each($1) ORDER BY key",
            names.join(", "),
            picks.join(", ")
        )
    } else {
        let picks: Vec<String> = columns
            .iter()
            .enumerate()
            .map(|(i, (_, t))| format!("(e.v ->> {i})::{t}"))
            .collect();
        format!(
            "INSERT INTO {table} ({}) SELECT {} FROM jsonb_array_elements($1::jsonb) WITH ORDINALITY AS e(v, ord) ORDER BY ord",
            names.join(", "),
            picks.join(", ")
        )
    };
    for chunk in rows.chunks(JSON_ROWS) {
        let doc = serde_json::to_string(chunk).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
        sqlx::query(sqlx::AssertSqlSafe(sql.clone()))
            .bind(doc)
            .execute(&mut **tx)
            .await?;
    }
    Ok(())
}

/// A transfer as [`insert_json`] sends it: its [`TRANSFER_INSERT`] columns, in order.
type TransferJson<'a> = (
    &'a str,
    String,
    String,
    i64,
    &'static str,
    Option<&'a str>,
    i64,
    i64,
    &'static str,
    &'a str,
    Option<&'a str>,
    Option<i64>,
    i64,
    Option<String>,
);

/// Insert transfers, in order.
async fn insert_transfers(tx: &mut Tx, transfers: &[Transfer]) -> Result<(), sqlx::Error> {
    if transfers.is_empty() {
        return Ok(());
    }
    let rows = transfers
        .iter()
        .map(|t| -> Result<TransferJson<'_>, sqlx::Error> {
            Ok((
                t.id.as_str(),
                t.debit.to_string(),
                t.credit.to_string(),
                big(t.amount, "an amount")?,
                t.phase.as_str(),
                t.pending.as_deref(),
                t.expires_at,
                i64::from(t.linked),
                t.cause.as_str(),
                t.reference.as_str(),
                t.lease.as_deref(),
                t.window.map(|w| big(w, "a window")).transpose()?,
                t.at,
                party(t),
            ))
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    let columns: Vec<(&str, &str)> = TRANSFER_INSERT
        .split(", ")
        .map(|c| {
            let t = match c {
                "amount" | "expires_at" | "linked" | "win" | "at" => "bigint",
                _ => "text",
            };
            (c, t)
        })
        .collect();
    insert_json(tx, "ledger_transfers", &columns, &rows).await?;
    insert_transfer_leaves(tx, transfers).await
}

/// The log's leaves for `transfers` (issue 33): one `ledger.transfer` event per linked chain
/// (all of it moved or none did), inserted in the transaction that applies them, in one
/// statement per batch. An auditor replays the ledger from these leaves alone.
async fn insert_transfer_leaves(tx: &mut Tx, transfers: &[Transfer]) -> Result<(), sqlx::Error> {
    let rows: Vec<(i64, &str, &str, &str, String)> = cgx_audit::schema::transfer_leaves(transfers)
        .map_err(|e| sqlx::Error::Encode(Box::new(e)))?
        .into_iter()
        .map(|(at, subject, detail)| (at, "broker", "ledger.transfer", subject, detail))
        .collect();
    insert_json(
        tx,
        "audit",
        &[
            ("at", "bigint"),
            ("actor", "text"),
            ("action", "text"),
            ("subject", "text"),
            ("detail", "text"),
        ],
        &rows,
    )
    .await
}

/// The reason a chain was refused: its first refusal that is not "another transfer of its
/// chain was refused".
fn refusal_of(r: &[Result<Applied, cgx_ledger::Refusal>]) -> Option<String> {
    let errs: Vec<&cgx_ledger::Refusal> = r.iter().filter_map(|a| a.as_ref().err()).collect();
    errs.iter()
        .find(|e| !matches!(e, cgx_ledger::Refusal::LinkedEventFailed))
        .or(errs.first())
        .map(|e| e.to_string())
}

/// Apply `chain` in the transaction: `Ok(true)` when it moved money, `Ok(false)` when it had
/// been applied before (all `Exists`), `Err(reason)` when refused (nothing written).
async fn post(
    tx: &mut Tx,
    chain: &[Transfer],
    at: i64,
) -> Result<Result<bool, String>, sqlx::Error> {
    if chain.is_empty() {
        return Ok(Ok(false));
    }
    let mut book = load_book(tx, &[chain]).await?;
    let r = book.apply(chain);
    if let Some(why) = refusal_of(&r) {
        return Ok(Err(why));
    }
    let changes = book.take_changes();
    if changes.transfers.is_empty() {
        return Ok(Ok(false));
    }
    write_changes(tx, &changes, at).await?;
    Ok(Ok(true))
}

/// What the job's leases other than `except` have spent and still hold.
async fn job_committed(tx: &mut Tx, job: &str, except: &str) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(
        // PostgreSQL's SUM of BIGINTs is NUMERIC: cast back.
        "SELECT CAST(COALESCE(SUM(spent + reserve), 0) AS BIGINT) AS c FROM escrows WHERE job_id = $1 AND lease_id <> $2",
    )
    .bind(job)
    .bind(except)
    .fetch_one(&mut **tx)
    .await?;
    unsigned(&r, "c")
}

/// Check an escrow's opening inside its placement's write, before anything is written: the
/// job's budget left as it was when the lease was signed, the tenant able to fund it. The
/// changes to write once the placement's rows went in ([`finish_escrow`]), or the refusal.
pub(super) async fn prepare_escrow(
    tx: &mut Tx,
    o: &EscrowOpen,
) -> Result<Result<Changes, Refusal>, sqlx::Error> {
    let committed = job_committed(tx, &o.job_id, &o.escrow.lease).await?;
    if committed != o.job_committed {
        return Ok(Err(Refusal::EscrowMoved));
    }
    let Ok((_, chain)) = o.escrow.open(o.reserve, o.started_at) else {
        return Ok(Err(Refusal::Funds("the escrow's accounts".into())));
    };
    let mut book = load_book(tx, &[&chain]).await?;
    let r = book.apply(&chain);
    if let Some(why) = refusal_of(&r) {
        return Ok(Err(Refusal::Funds(why)));
    }
    Ok(Ok(book.take_changes()))
}

/// Write an escrow's opening (see [`prepare_escrow`]).
pub(super) async fn finish_escrow(
    tx: &mut Tx,
    o: &EscrowOpen,
    changes: &Changes,
) -> Result<(), sqlx::Error> {
    write_changes(tx, changes, o.started_at).await?;
    let (opened, _) = o
        .escrow
        .open(o.reserve, o.started_at)
        .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
    insert_escrow(tx, &opened, o).await
}

async fn insert_escrow(tx: &mut Tx, e: &Escrow, o: &EscrowOpen) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO escrows (lease_id, job_id, tenant, operator, node_id, per_gpu_hour, gpus, window_secs, fee_bps, pending_id, reserve, next_win, expires_at, covers, spent, started_at, state, closed_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 0, $12, $13, 0, $14, 'open', NULL)",
    )
    .bind(e.lease.clone())
    .bind(o.job_id.clone())
    .bind(e.tenant.clone())
    .bind(e.operator.clone())
    .bind(o.node_id.clone())
    .bind(big(e.price.per_gpu_hour, "a price")?)
    .bind(i64::from(e.price.gpus))
    .bind(i64::from(e.price.window_secs))
    .bind(i64::from(e.fee_bps))
    .bind(e.pending.clone())
    .bind(big(e.reserve, "a reserve")?)
    .bind(e.expires_at)
    .bind(big(o.covers.min(i64::MAX as u64), "a window count")?)
    .bind(o.started_at)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

async fn escrow_in(tx: &mut Tx, lease: &str) -> Result<Option<EscrowRow>, sqlx::Error> {
    let sql = format!("SELECT {ESCROW_COLUMNS} FROM escrows WHERE lease_id = $1");
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(lease)
        .fetch_optional(&mut **tx)
        .await?
        .map(|r| escrow_row(&r))
        .transpose()
}

async fn save_escrow(tx: &mut Tx, row: &EscrowRow) -> Result<(), sqlx::Error> {
    let e = &row.escrow;
    sqlx::query(
        "UPDATE escrows SET pending_id = $2, reserve = $3, next_win = $4, spent = $5, state = $6, closed_at = $7 WHERE lease_id = $1",
    )
    .bind(e.lease.clone())
    .bind(e.pending.clone())
    .bind(big(e.reserve, "a reserve")?)
    .bind(big(e.next_window, "a window")?)
    .bind(big(row.spent, "a sum")?)
    .bind(row.state.clone())
    .bind(row.closed_at)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Resolve `windows` (in order per lease) in one go: the escrows read at once, every chain
/// built and applied in one book loaded at once, the changes written in multi-row statements
/// — a settlement pass of thousands of windows costs a handful of statements, not thousands.
/// A window that is not its escrow's next, or whose chain the ledger refuses, is answered
/// with why, and its lease's later windows in the batch wait for the next pass.
async fn settle_in(tx: &mut Tx, windows: &[WindowSettle]) -> Result<Outcome, sqlx::Error> {
    let leases: Vec<String> = windows
        .iter()
        .map(|w| w.lease.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let sql = format!("SELECT {ESCROW_COLUMNS} FROM escrows WHERE lease_id IN ({{}})");
    let mut escrows: BTreeMap<String, EscrowRow> = BTreeMap::new();
    for r in select_in(tx, &sql, &leases).await? {
        let row = escrow_row(&r)?;
        escrows.insert(row.escrow.lease.clone(), row);
    }
    // Every chain, built against the escrow as the windows before it leave it.
    let mut plans: Vec<Result<(Escrow, Vec<Transfer>), String>> = Vec::with_capacity(windows.len());
    let mut ahead: BTreeMap<&str, Escrow> = BTreeMap::new();
    for s in windows {
        let Some(row) = escrows.get(&s.lease) else {
            plans.push(Err(format!("lease {} has no escrow", s.lease)));
            continue;
        };
        let e = ahead.get(s.lease.as_str()).unwrap_or(&row.escrow);
        if row.state != "open" || e.next_window != s.window {
            plans.push(Err(format!(
                "window {} of lease {} is not the next to settle (that is {}, escrow {})",
                s.window, s.lease, e.next_window, row.state
            )));
            continue;
        }
        match e.resolve(s.outcome, &s.record, s.at) {
            Ok((next, chain)) => {
                ahead.insert(s.lease.as_str(), next.clone());
                plans.push(Ok((next, chain)));
            }
            Err(err) => plans.push(Err(err.to_string())),
        }
    }
    let chains: Vec<&[Transfer]> = plans
        .iter()
        .filter_map(|p| p.as_ref().ok().map(|(_, c)| c.as_slice()))
        .collect();
    let current: Vec<String> = escrows
        .values()
        .filter_map(|r| r.escrow.pending.clone())
        .collect();
    let mut book = load_book_with(tx, &chains, Some(&current), false).await?;

    let mut out = Vec::with_capacity(windows.len());
    let mut stopped: BTreeSet<&str> = BTreeSet::new();
    let mut settled: Vec<(&WindowSettle, &'static str, u64)> = Vec::new();
    for (s, plan) in windows.iter().zip(plans) {
        let (next, chain) = match plan {
            Ok(p) if !stopped.contains(s.lease.as_str()) => p,
            Ok(_) => {
                out.push(Err(format!(
                    "window {} of lease {} waits: an earlier window of its lease was refused",
                    s.window, s.lease
                )));
                continue;
            }
            Err(why) => {
                stopped.insert(s.lease.as_str());
                out.push(Err(why));
                continue;
            }
        };
        let r = book.apply(&chain);
        if let Some(why) = refusal_of(&r) {
            stopped.insert(s.lease.as_str());
            out.push(Err(why));
            continue;
        }
        let Some(row) = escrows.get_mut(&s.lease) else {
            continue;
        };
        let amount = row.escrow.reserve - next.reserve;
        if s.outcome == WindowOutcome::Paid {
            row.spent = row.spent.saturating_add(amount);
        }
        let outcome = match s.outcome {
            WindowOutcome::Paid if amount > 0 => "paid",
            WindowOutcome::Paid => "unfunded",
            WindowOutcome::Refunded => "refunded",
        };
        settled.push((s, outcome, amount));
        row.escrow = next;
        out.push(Ok(true));
    }
    let at = windows.iter().map(|w| w.at).max().unwrap_or(0);
    write_changes(tx, &book.take_changes(), at).await?;

    let rows = settled
        .iter()
        .map(|(s, outcome, amount)| {
            Ok((
                s.lease.as_str(),
                big(s.window, "a window")?,
                *outcome,
                s.record.as_str(),
                big(*amount, "an amount")?,
                s.reason.as_str(),
                s.at,
            ))
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    insert_json(
        tx,
        "settled_windows",
        &[
            ("lease_id", "text"),
            ("win", "bigint"),
            ("outcome", "text"),
            ("record", "text"),
            ("amount", "bigint"),
            ("reason", "text"),
            ("at", "bigint"),
        ],
        &rows,
    )
    .await?;
    let moved: BTreeSet<&str> = settled.iter().map(|(s, _, _)| s.lease.as_str()).collect();
    for lease in moved {
        if let Some(row) = escrows.get(lease) {
            save_escrow(tx, row).await?;
        }
    }
    Ok(Outcome::Items(out))
}

/// Apply one of these writes inside the batch's transaction (see `store::apply`).
pub(super) async fn apply(tx: &mut Tx, w: &LedgerWrite) -> Result<Outcome, sqlx::Error> {
    match w {
        LedgerWrite::Deposit {
            transfer,
            actor,
            detail,
        } => {
            // Idempotent by reference (its id), whenever the retry comes: the same account,
            // amount and cause are answered as done; anything else is refused.
            let sql = format!("SELECT {TRANSFER_COLUMNS} FROM ledger_transfers WHERE id = $1");
            if let Some(r) = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(transfer.id.clone())
                .fetch_optional(&mut **tx)
                .await?
            {
                let (_, t) = transfer_row(&r)?;
                let same = t.debit == transfer.debit
                    && t.credit == transfer.credit
                    && t.amount == transfer.amount
                    && t.cause == transfer.cause;
                return Ok(if same {
                    Outcome::Items(vec![Ok(false)])
                } else {
                    Outcome::Refused(Refusal::Funds(format!(
                        "reference {} was deposited before, {} to {}",
                        transfer.reference, t.amount, t.credit
                    )))
                });
            }
            match post(tx, std::slice::from_ref(transfer), transfer.at).await? {
                Ok(moved) => {
                    if moved {
                        let action = format!("ledger.{}", transfer.cause.as_str());
                        let subject = transfer.credit.to_string();
                        let event = cgx_service::audit::NewEvent {
                            actor,
                            action: &action,
                            subject: &subject,
                            detail,
                        };
                        cgx_service::audit::record(tx, transfer.at, &event).await?;
                    }
                    Ok(Outcome::Items(vec![Ok(moved)]))
                }
                Err(why) => Ok(Outcome::Refused(Refusal::Funds(why))),
            }
        }
        LedgerWrite::Settle(windows) => settle_in(tx, windows).await,
        LedgerWrite::Open(o) => match prepare_escrow(tx, o).await? {
            Ok(changes) => {
                finish_escrow(tx, o, &changes).await?;
                Ok(Outcome::Done)
            }
            Err(r) => Ok(Outcome::Refused(r)),
        },
        LedgerWrite::Release { lease, at, expiry } => {
            let Some(mut row) = escrow_in(tx, lease).await? else {
                return Ok(Outcome::Refused(Refusal::NoSuchLease));
            };
            if row.state != "open" {
                return Ok(Outcome::Items(vec![Ok(false)]));
            }
            let (next, mut chain) = row
                .escrow
                .release(*at)
                .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
            if *expiry && let Some(t) = chain.first_mut() {
                t.cause = CauseKind::Expiry;
                t.id = format!("expire/{lease}");
                t.at = (*at).max(row.escrow.expires_at);
            }
            match post(tx, &chain, *at).await? {
                Err(why) => Ok(Outcome::Refused(Refusal::Funds(why))),
                Ok(_) => {
                    row.escrow = next;
                    row.state = "closed".into();
                    row.closed_at = Some(*at);
                    save_escrow(tx, &row).await?;
                    Ok(Outcome::Items(vec![Ok(true)]))
                }
            }
        }
        LedgerWrite::Slash {
            operator,
            tenant,
            lease,
            cheat,
            per_gpu,
            gpus,
            at,
            half_life,
            now_ms,
        } => {
            // Slashed before for this cheat, or refused: not counted again.
            let Slashed::Now(stake) =
                slash_in(tx, operator, tenant, lease, cheat, *per_gpu, *gpus, *at).await?
            else {
                return Ok(Outcome::Items(vec![Ok(false)]));
            };
            if let Some(row) = escrow_in(tx, lease).await? {
                let d = crate::server::reputation::Delta {
                    cheats: 1.0,
                    ..Default::default()
                };
                super::reputation::bump_in(tx, &row.node_id, d, *at, *half_life, *now_ms).await?;
            }
            Ok(Outcome::Items(vec![Ok(stake > 0)]))
        }
    }
}

/// At a lease's end (inside the write that ends it): what its escrow holds beyond what the
/// windows it ran may still cost goes back to the tenant now, so its job's next lease can
/// reserve it (a failover does not wait for the old lease's settlement).
/// `until`: the lease's token's end (it runs to that at most, however late it was ended).
pub(super) async fn trim_in(
    tx: &mut Tx,
    lease: &str,
    ended_at: i64,
    until: i64,
) -> Result<(), sqlx::Error> {
    let Some(mut row) = escrow_in(tx, lease).await? else {
        return Ok(());
    };
    if row.state != "open" || row.escrow.pending.is_none() {
        return Ok(());
    }
    let ended_at = ended_at.min(until);
    let ran =
        cgx_protocol::metering::windows_ran(row.started_at, ended_at, row.escrow.price.window_secs);
    let price = row.escrow.price;
    let owed = if ran > row.escrow.next_window {
        price
            .cost(ran)
            .and_then(|c| Ok(c - price.cost(row.escrow.next_window)?))
            .unwrap_or(u64::MAX)
    } else {
        0
    };
    let (next, chain) = row
        .escrow
        .trim(owed, ended_at)
        .map_err(|e| sqlx::Error::Protocol(e.to_string()))?;
    if chain.is_empty() {
        return Ok(());
    }
    match post(tx, &chain, ended_at).await? {
        Ok(_) => {
            row.escrow = next;
            save_escrow(tx, &row).await
        }
        Err(why) => {
            // Past its time-out, say: the settlement pass releases it.
            tracing::warn!(%lease, %why, "escrow not trimmed at the lease's end");
            Ok(())
        }
    }
}

/// What [`slash_in`] did.
pub(super) enum Slashed {
    /// Slashed now: what was forfeited (0 when the operator held no stake).
    Now(u64),
    /// This cheat was slashed before: nothing again.
    Before,
    /// The chain was refused (logged).
    Refused,
}

/// Slash inside any write's transaction (the verdict that proves the cheat).
#[allow(clippy::too_many_arguments)]
pub(super) async fn slash_in(
    tx: &mut Tx,
    operator: &str,
    tenant: &str,
    lease: &str,
    cheat: &str,
    per_gpu: u64,
    gpus: u32,
    at: i64,
) -> Result<Slashed, sqlx::Error> {
    let Ok(stake) = AccountId::new(cgx_ledger::Role::Stake, operator) else {
        return Ok(Slashed::Refused);
    };
    // Slashed once per cheat: its amount depends on the stake left, so a second attempt
    // would be a different chain under the same ids.
    if sqlx::query("SELECT 1 AS one FROM ledger_transfers WHERE id = $1")
        .bind(format!("slash/{cheat}/stake"))
        .fetch_optional(&mut **tx)
        .await?
        .is_some()
    {
        return Ok(Slashed::Before);
    }
    let b = sqlx::query(
        "SELECT debits_pending, debits_posted, credits_pending, credits_posted FROM ledger_accounts WHERE id = $1",
    )
    .bind(stake.to_string())
    .fetch_optional(&mut **tx)
    .await?
    .map(|r| balance_row(&r))
    .transpose()?
    .unwrap_or_default();
    let amount = cgx_ledger::settle::slash_amount(b.available(), per_gpu, gpus);
    let Ok(chain) = cgx_ledger::settle::slash(operator, tenant, lease, cheat, amount, at) else {
        return Ok(Slashed::Refused);
    };
    match post(tx, &chain, at).await? {
        Ok(moved) => Ok(Slashed::Now(if moved { amount } else { 0 })),
        Err(why) => {
            tracing::error!(%operator, %cheat, %why, "slash refused");
            Ok(Slashed::Refused)
        }
    }
}

impl Store {
    /// Every account, in id order.
    pub async fn accounts(&self) -> Result<Vec<(AccountId, Balance)>, BrokerError> {
        let rows = sqlx::query(
            "SELECT id, debits_pending, debits_posted, credits_pending, credits_posted FROM ledger_accounts ORDER BY id",
        )
        .fetch_all(self.db.pool())
        .await?;
        rows.iter()
            .map(|r| {
                let id: String = r.try_get("id")?;
                let id = id
                    .parse()
                    .map_err(|e: cgx_ledger::LedgerError| BrokerError::Internal(e.to_string()))?;
                Ok((id, balance_row(r)?))
            })
            .collect()
    }

    /// Every transfer, in order (the auditor's replay, tests).
    pub async fn transfers(
        &self,
        after: i64,
        limit: i64,
    ) -> Result<Vec<(i64, Transfer)>, BrokerError> {
        let sql = format!(
            "SELECT {TRANSFER_COLUMNS} FROM ledger_transfers WHERE seq > $1 ORDER BY seq LIMIT $2"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(after)
            .bind(limit)
            .fetch_all(self.db.pool())
            .await?;
        Ok(rows.iter().map(transfer_row).collect::<Result<_, _>>()?)
    }

    pub async fn escrow(&self, lease: &str) -> Result<Option<EscrowRow>, BrokerError> {
        let sql = format!("SELECT {ESCROW_COLUMNS} FROM escrows WHERE lease_id = $1");
        Ok(sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(lease)
            .fetch_optional(self.db.pool())
            .await?
            .map(|r| escrow_row(&r))
            .transpose()?)
    }

    /// Open escrows after `(started_at, lease)` in that order, at most `limit`.
    pub async fn open_escrows_after(
        &self,
        after: &(i64, String),
        limit: i64,
    ) -> Result<Vec<EscrowRow>, BrokerError> {
        let sql = format!(
            "SELECT {ESCROW_COLUMNS} FROM escrows WHERE state = 'open' AND (started_at > $1 OR (started_at = $1 AND lease_id > $2)) ORDER BY started_at, lease_id LIMIT $3"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(after.0)
            .bind(after.1.clone())
            .bind(limit)
            .fetch_all(self.db.pool())
            .await?;
        Ok(rows.iter().map(escrow_row).collect::<Result<_, _>>()?)
    }

    /// Whether any lease of `job` was ever opened (its escrow is kept for good).
    pub async fn job_was_leased(&self, job: &str) -> Result<bool, BrokerError> {
        Ok(
            sqlx::query("SELECT 1 AS one FROM escrows WHERE job_id = $1 LIMIT 1")
                .bind(job)
                .fetch_optional(self.db.pool())
                .await?
                .is_some(),
        )
    }

    /// What a job's leases spent and still hold, together.
    pub async fn job_committed(&self, job: &str) -> Result<u64, BrokerError> {
        let mut tx = self.db.pool().begin().await?;
        let v = job_committed(&mut tx, job, "").await?;
        tx.rollback().await?;
        Ok(v)
    }
}

/// One connection's reads of the ledger ([`Store::ledger_read`]), in one read transaction
/// where asked: a snapshot on SQLite's WAL, repeatable read on PostgreSQL. A statement reads its
/// lines, its opening and the stored sums through one, so they add up however much settles
/// meanwhile.
pub struct LedgerRead {
    c: Conn,
}

impl std::fmt::Debug for LedgerRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LedgerRead")
            .field("snapshot", &matches!(self.c, Conn::Snapshot(_)))
            .finish()
    }
}

enum Conn {
    /// Rolled back when dropped, on an error's path too.
    Snapshot(Tx),
    Plain(sqlx::pool::PoolConnection<sqlx::Any>),
}

impl Store {
    /// Reads of the ledger; `snapshot`: all of them from one read transaction.
    pub async fn ledger_read(&self, snapshot: bool) -> Result<LedgerRead, BrokerError> {
        let pool = self.db.pool();
        let c = match (snapshot, self.db.backend()) {
            (false, _) => Conn::Plain(pool.acquire().await?),
            (true, Backend::Sqlite) => Conn::Snapshot(pool.begin().await?),
            (true, Backend::Postgres) => Conn::Snapshot(
                pool.begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                    .await?,
            ),
        };
        Ok(LedgerRead { c })
    }

    /// An account's sums (zero for one never used).
    pub async fn account(&self, id: &AccountId) -> Result<Balance, BrokerError> {
        self.ledger_read(false).await?.account(id).await
    }

    /// The settled windows of `lease`.
    pub async fn settled_windows(&self, lease: &str) -> Result<Vec<SettledWindow>, BrokerError> {
        self.ledger_read(false).await?.settled_windows(lease).await
    }
}

impl LedgerRead {
    fn c(&mut self) -> &mut sqlx::AnyConnection {
        match &mut self.c {
            Conn::Snapshot(tx) => tx,
            Conn::Plain(c) => c,
        }
    }

    /// End the read transaction, if one.
    pub async fn done(self) -> Result<(), BrokerError> {
        if let Conn::Snapshot(tx) = self.c {
            tx.rollback().await?;
        }
        Ok(())
    }

    /// An account's sums (zero for one never used).
    pub async fn account(&mut self, id: &AccountId) -> Result<Balance, BrokerError> {
        let r = sqlx::query(
            "SELECT debits_pending, debits_posted, credits_pending, credits_posted FROM ledger_accounts WHERE id = $1",
        )
        .bind(id.to_string())
        .fetch_optional(self.c())
        .await?;
        Ok(r.map(|r| balance_row(&r)).transpose()?.unwrap_or_default())
    }

    /// The transfers that debit or credit any of `accounts` (tenants', providers' or
    /// stakes': their statement lines), at `from..to`, in order.
    pub async fn transfers_of(
        &mut self,
        accounts: &[String],
        from: i64,
        to: i64,
        limit: i64,
    ) -> Result<Vec<(i64, Transfer)>, BrokerError> {
        let mut out = Vec::new();
        for a in accounts {
            let sql = format!(
                "SELECT {TRANSFER_COLUMNS} FROM ledger_transfers WHERE party = $1 AND at >= $2 AND at < $3 ORDER BY seq LIMIT $4"
            );
            let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(a.clone())
                .bind(from)
                .bind(to)
                .bind(limit)
                .fetch_all(self.c())
                .await?;
            for r in &rows {
                out.push(transfer_row(r)?);
            }
        }
        out.sort_by_key(|(seq, _)| *seq);
        out.dedup_by_key(|(seq, _)| *seq);
        Ok(out)
    }

    /// An account's posted balance and what it held (pending debits) from its transfers at
    /// `at < before`, summed by the database (a statement's opening).
    pub async fn sums_before(
        &mut self,
        account: &str,
        before: i64,
    ) -> Result<(i128, i128), BrokerError> {
        let r = sqlx::query(
            "SELECT CAST(COALESCE(SUM(CASE WHEN credit = $1 AND phase IN ('single', 'post') THEN amount ELSE 0 END), 0) AS BIGINT) AS cin,
                    CAST(COALESCE(SUM(CASE WHEN debit = $1 AND phase IN ('single', 'post') THEN amount ELSE 0 END), 0) AS BIGINT) AS dout,
                    CAST(COALESCE(SUM(CASE WHEN debit = $1 AND phase = 'pending' THEN amount ELSE 0 END), 0) AS BIGINT) AS held
             FROM ledger_transfers WHERE party = $1 AND at < $2",
        )
        .bind(account)
        .bind(before)
        .fetch_one(self.c())
        .await?;
        let released = sqlx::query(
            "SELECT CAST(COALESCE(SUM(p.amount), 0) AS BIGINT) AS rel
             FROM ledger_transfers r JOIN ledger_transfers p ON p.id = r.pending_id
             WHERE r.party = $1 AND r.debit = $1 AND r.at < $2 AND r.phase IN ('post', 'void')",
        )
        .bind(account)
        .bind(before)
        .fetch_one(self.c())
        .await?;
        let get = |r: &sqlx::any::AnyRow, c: &str| -> Result<i128, sqlx::Error> {
            Ok(i128::from(r.try_get::<i64, _>(c)?))
        };
        Ok((
            get(&r, "cin")? - get(&r, "dout")?,
            get(&r, "held")? - get(&released, "rel")?,
        ))
    }

    /// The amounts of the transfers `ids` (the reservations a statement's posts resolve).
    pub async fn transfer_amounts(
        &mut self,
        ids: &[String],
    ) -> Result<Vec<(String, u64)>, BrokerError> {
        let mut out = Vec::new();
        for id in ids {
            if let Some(r) = sqlx::query("SELECT id, amount FROM ledger_transfers WHERE id = $1")
                .bind(id)
                .fetch_optional(self.c())
                .await?
            {
                out.push((r.try_get("id")?, unsigned(&r, "amount")?));
            }
        }
        Ok(out)
    }

    /// The escrows of a tenant's or an operator's leases started at `from..to`.
    pub async fn escrows_of(
        &mut self,
        tenant: Option<&str>,
        operator: Option<&str>,
        from: i64,
        to: i64,
    ) -> Result<Vec<EscrowRow>, BrokerError> {
        let (column, who) = match (tenant, operator) {
            (Some(t), _) => ("tenant", t),
            (None, Some(o)) => ("operator", o),
            (None, None) => return Ok(Vec::new()),
        };
        let sql = format!(
            "SELECT {ESCROW_COLUMNS} FROM escrows WHERE {column} = $1 AND started_at >= $2 AND started_at < $3 ORDER BY started_at"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(who)
            .bind(from)
            .bind(to)
            .fetch_all(self.c())
            .await?;
        Ok(rows.iter().map(escrow_row).collect::<Result<_, _>>()?)
    }

    /// The settled windows of `lease`: (window, outcome, record, amount, reason, at).
    pub async fn settled_windows(
        &mut self,
        lease: &str,
    ) -> Result<Vec<SettledWindow>, BrokerError> {
        let rows = sqlx::query(
            "SELECT win, outcome, record, amount, reason, at FROM settled_windows WHERE lease_id = $1 ORDER BY win",
        )
        .bind(lease)
        .fetch_all(self.c())
        .await?;
        rows.iter()
            .map(settled_window)
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }
}

/// A `settled_windows` row (columns win, outcome, record, amount, reason, at).
pub(super) fn settled_window(r: &sqlx::any::AnyRow) -> Result<SettledWindow, sqlx::Error> {
    Ok(SettledWindow {
        window: unsigned(r, "win")?,
        outcome: r.try_get("outcome")?,
        record: r.try_get("record")?,
        amount: unsigned(r, "amount")?,
        reason: r.try_get("reason")?,
        at: r.try_get("at")?,
    })
}

/// A settled window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettledWindow {
    pub window: u64,
    pub outcome: String,
    pub record: String,
    pub amount: u64,
    pub reason: String,
    pub at: i64,
}
