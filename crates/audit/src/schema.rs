//! How a ledger's transfers are written as leaves (`ledger.transfer`, docs/audit.md): the
//! writer (the broker) and the reader (the auditor) share it here.

use cgx_ledger::Transfer;
use serde::Serialize;

/// At most this many transfers share a leaf: a longer chain is several leaves, in order, all but
/// the last marked `continues` (a leaf stays far under the log's 65,535-byte bound).
pub const TRANSFERS_PER_LEAF: usize = 64;

/// One transfer as its leaf carries it: amounts and windows as decimal strings (a leaf's
/// numbers are exact only below 2^53).
#[derive(Serialize)]
struct TransferLeaf<'a> {
    id: &'a str,
    debit: String,
    credit: String,
    amount: String,
    phase: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pending: Option<&'a str>,
    #[serde(skip_serializing_if = "is_zero")]
    expires_at: i64,
    cause: &'a str,
    reference: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    lease: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    window: Option<String>,
}

/// A `ledger.transfer` leaf's detail.
#[derive(Serialize)]
struct ChainLeaf<'a> {
    transfers: &'a [TransferLeaf<'a>],
    #[serde(skip_serializing_if = "Option::is_none")]
    continues: Option<bool>,
}

fn is_zero(v: &i64) -> bool {
    *v == 0
}

/// The `ledger.transfer` leaves of `transfers` (applied in this order): one per linked chain
/// (all of it moved or none did), cut every [`TRANSFERS_PER_LEAF`]. Each: its time (the first
/// transfer's), its subject (the first transfer's id) and its detail as JSON text.
pub fn transfer_leaves(
    transfers: &[Transfer],
) -> Result<Vec<(i64, &str, String)>, serde_json::Error> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < transfers.len() {
        // A chain ends at its first transfer not linked to the next.
        let end = transfers[start..]
            .iter()
            .position(|t| !t.linked)
            .map_or(transfers.len(), |i| start + i + 1);
        let chain = &transfers[start..end];
        let parts = chain.chunks(TRANSFERS_PER_LEAF);
        let n = parts.len();
        for (i, part) in parts.enumerate() {
            let leaf: Vec<TransferLeaf<'_>> = part
                .iter()
                .map(|t| TransferLeaf {
                    id: &t.id,
                    debit: t.debit.to_string(),
                    credit: t.credit.to_string(),
                    amount: t.amount.to_string(),
                    phase: t.phase.as_str(),
                    pending: t.pending.as_deref(),
                    expires_at: t.expires_at,
                    cause: t.cause.as_str(),
                    reference: &t.reference,
                    lease: t.lease.as_deref(),
                    window: t.window.map(|w| w.to_string()),
                })
                .collect();
            let detail = serde_json::to_string(&ChainLeaf {
                transfers: &leaf,
                continues: (i + 1 < n).then_some(true),
            })?;
            if let Some(first) = part.first() {
                out.push((first.at, first.id.as_str(), detail));
            }
        }
        start = end;
    }
    Ok(out)
}
