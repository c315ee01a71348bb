//! The archive the log's leaves name: raw evidence, collateral and EARs, each stored whole
//! under the SHA-256 of its bytes, in the transaction of the leaf that names it
//! (`cgx_protocol::archive`). Rows are only added: a piece's bytes are its address, so a second
//! write of one is the same row.

use sqlx::Row;

use super::super::error::BrokerError;
use super::{Store, Tx};

/// Migration 13: the archive (`doc` is the piece's text: every kind is JSON or a JWT).
pub(super) const ARCHIVE_V13: &str = "CREATE TABLE archive (
    sha256 TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    doc TEXT NOT NULL,
    at BIGINT NOT NULL
)";

/// A piece to archive: its address is computed here, from the bytes stored.
#[derive(Debug, Clone)]
pub(crate) struct Archived {
    pub sha256: String,
    pub kind: cgx_protocol::archive::Kind,
    pub doc: String,
}

impl Archived {
    pub(crate) fn new(kind: cgx_protocol::archive::Kind, doc: String) -> Archived {
        Archived {
            sha256: cgx_protocol::archive::address(doc.as_bytes()),
            kind,
            doc,
        }
    }
}

/// Store `pieces` in the caller's transaction (a piece already there stays as it is: same
/// bytes, same address).
pub(super) async fn insert_in(
    tx: &mut Tx,
    pieces: &[Archived],
    at: i64,
) -> Result<(), sqlx::Error> {
    for p in pieces {
        sqlx::query(
            "INSERT INTO archive (sha256, kind, doc, at) VALUES ($1, $2, $3, $4) ON CONFLICT (sha256) DO NOTHING",
        )
        .bind(&p.sha256)
        .bind(p.kind.as_str())
        .bind(&p.doc)
        .bind(at)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

impl Store {
    /// The archived piece at `sha256` (the caller checked its spelling), and its kind.
    pub async fn archived(&self, sha256: &str) -> Result<Option<(String, String)>, BrokerError> {
        let row = sqlx::query("SELECT kind, doc FROM archive WHERE sha256 = $1")
            .bind(sha256)
            .fetch_optional(self.db.pool())
            .await?;
        Ok(match row {
            Some(r) => Some((r.try_get("kind")?, r.try_get("doc")?)),
            None => None,
        })
    }
}
