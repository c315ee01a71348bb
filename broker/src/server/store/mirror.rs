//! The broker's mirror of the KBS log's releases (`log.rs`'s mirror pass): each `release` and
//! `release.refused` leaf of an anchored log, by its index, kept only once the leaves read so
//! far reproduce the root of a checkpoint the log's key signed; and how far each log is
//! mirrored (its size and right edge, `cgx_tlog::compact::Frontier`).

use sqlx::Row;

use super::Store;
use crate::server::error::BrokerError;

/// Migration 16 (and the index the console's per-GPU utilization reads metering by).
pub(super) const MIRROR_V16: &str = "CREATE TABLE kbs_mirror (
        origin TEXT PRIMARY KEY, size BIGINT NOT NULL, frontier TEXT NOT NULL);
     CREATE TABLE kbs_releases (
        origin TEXT NOT NULL, idx BIGINT NOT NULL, at BIGINT NOT NULL, action TEXT NOT NULL,
        resource TEXT NOT NULL, lease TEXT, token_sha256 TEXT, tee_key TEXT NOT NULL,
        reason TEXT NOT NULL, PRIMARY KEY (origin, idx));
     CREATE INDEX kbs_releases_lease ON kbs_releases (lease);
     CREATE INDEX kbs_releases_token ON kbs_releases (token_sha256);
     CREATE INDEX metering_accepted ON metering (lease_id, accepted_at)";

/// A release or a refusal as the KBS logged it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirroredRelease {
    pub origin: String,
    pub idx: u64,
    pub at: i64,
    /// `release` or `release.refused`.
    pub action: String,
    pub resource: String,
    /// A release names its lease; a refusal the SHA-256 of the lease token it was shown.
    pub lease: Option<String>,
    pub token_sha256: Option<String>,
    pub tee_key: String,
    pub reason: String,
}

fn big(v: u64) -> Result<i64, BrokerError> {
    i64::try_from(v).map_err(|_| BrokerError::Internal("log index past i64".into()))
}

impl Store {
    /// `origin`'s checkpoints this broker's log anchored (`log.anchor` leaves) after audit
    /// event `after`, in order: (seq, size, root).
    pub async fn anchors_of(
        &self,
        origin: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<(i64, u64, String)>, BrokerError> {
        let rows = sqlx::query(
            "SELECT seq, detail FROM audit WHERE subject = $1 AND action = 'log.anchor' AND seq > $2
             ORDER BY seq LIMIT $3",
        )
        .bind(origin)
        .bind(after)
        .bind(limit)
        .fetch_all(self.db.pool())
        .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            let seq: i64 = r.try_get("seq")?;
            let detail: String = r.try_get("detail")?;
            let d: serde_json::Value = serde_json::from_str(&detail).unwrap_or_default();
            if let (Some(size), Some(root)) = (
                d["size"].as_str().and_then(|s| s.parse::<u64>().ok()),
                d["root"].as_str(),
            ) {
                out.push((seq, size, root.to_string()));
            }
        }
        Ok(out)
    }

    /// How far `origin` is mirrored: its size and frontier text (none: not yet).
    pub async fn mirror_state(&self, origin: &str) -> Result<Option<(u64, String)>, BrokerError> {
        let r = sqlx::query("SELECT size, frontier FROM kbs_mirror WHERE origin = $1")
            .bind(origin)
            .fetch_optional(self.db.pool())
            .await?;
        Ok(match r {
            Some(r) => Some((
                u64::try_from(r.try_get::<i64, _>("size")?).unwrap_or(0),
                r.try_get("frontier")?,
            )),
            None => None,
        })
    }

    /// Keep `rows` and move `origin`'s mirror from `from` leaves to `size` (its frontier
    /// `frontier`), in one transaction; false (nothing kept) when another replica moved it
    /// meanwhile.
    pub async fn mirror_extend(
        &self,
        origin: &str,
        from: u64,
        size: u64,
        frontier: &str,
        rows: &[MirroredRelease],
    ) -> Result<bool, BrokerError> {
        let mut tx = self.db.write_pool().begin().await?;
        let moved = if from == 0 {
            sqlx::query(
                "INSERT INTO kbs_mirror (origin, size, frontier) VALUES ($1, $2, $3) ON CONFLICT (origin) DO NOTHING",
            )
            .bind(origin)
            .bind(big(size)?)
            .bind(frontier)
            .execute(&mut *tx)
            .await?
            .rows_affected()
        } else {
            sqlx::query(
                "UPDATE kbs_mirror SET size = $1, frontier = $2 WHERE origin = $3 AND size = $4",
            )
            .bind(big(size)?)
            .bind(frontier)
            .bind(origin)
            .bind(big(from)?)
            .execute(&mut *tx)
            .await?
            .rows_affected()
        };
        if moved != 1 {
            tx.rollback().await?;
            return Ok(false);
        }
        for r in rows {
            sqlx::query(
                "INSERT INTO kbs_releases (origin, idx, at, action, resource, lease, token_sha256, tee_key, reason)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (origin, idx) DO NOTHING",
            )
            .bind(&r.origin)
            .bind(big(r.idx)?)
            .bind(r.at)
            .bind(&r.action)
            .bind(&r.resource)
            .bind(&r.lease)
            .bind(&r.token_sha256)
            .bind(&r.tee_key)
            .bind(&r.reason)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(true)
    }

    /// The releases through `lease`, and the refusals of any of its tokens (`tokens`: their
    /// SHA-256, hex), in the log's order; at most 500.
    pub async fn releases_of_lease(
        &self,
        lease: &str,
        tokens: &[String],
    ) -> Result<Vec<MirroredRelease>, BrokerError> {
        let mut out = self.releases_where("lease", lease).await?;
        for t in tokens.iter().take(500) {
            out.extend(self.releases_where("token_sha256", t).await?);
        }
        out.sort_by(|a, b| (&a.origin, a.idx).cmp(&(&b.origin, b.idx)));
        out.dedup_by(|a, b| a.origin == b.origin && a.idx == b.idx);
        out.truncate(500);
        Ok(out)
    }
}

impl Store {
    /// The mirrored rows whose `column` (`lease` or `token_sha256`, each indexed) is `value`,
    /// at most 500.
    async fn releases_where(
        &self,
        column: &'static str,
        value: &str,
    ) -> Result<Vec<MirroredRelease>, BrokerError> {
        let sql = format!(
            "SELECT origin, idx, at, action, resource, lease, token_sha256, tee_key, reason
             FROM kbs_releases WHERE {column} = $1 ORDER BY origin, idx LIMIT 500"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(value)
            .fetch_all(self.db.pool())
            .await?;
        Ok(rows
            .iter()
            .map(release_row)
            .collect::<Result<Vec<_>, _>>()?)
    }
}

fn release_row(r: &sqlx::any::AnyRow) -> Result<MirroredRelease, sqlx::Error> {
    Ok(MirroredRelease {
        origin: r.try_get("origin")?,
        idx: u64::try_from(r.try_get::<i64, _>("idx")?).unwrap_or(0),
        at: r.try_get("at")?,
        action: r.try_get("action")?,
        resource: r.try_get("resource")?,
        lease: r.try_get("lease")?,
        token_sha256: r.try_get("token_sha256")?,
        tee_key: r.try_get("tee_key")?,
        reason: r.try_get("reason")?,
    })
}
