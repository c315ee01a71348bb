//! Settings' rows (each with its signed record) and the admin audit trail.

use sqlx::Row;

use super::super::error::BrokerError;
use super::{Outcome, Refusal, Store, Tx};

/// Writes to settings' rows (each with its audit row).
#[derive(Debug)]
pub(crate) enum SettingWrite {
    /// Put a setting at `version`, only where the row is still at `version − 1` (absent for
    /// 1): two admins racing cannot both win. With its audit row.
    PutSetting {
        name: &'static str,
        body: String,
        record: String,
        version: i64,
        at: i64,
        actor: String,
        detail: String,
    },
}

/// Apply one of these writes inside the batch's transaction (see `store::apply`).
pub(super) async fn apply(tx: &mut Tx, w: &SettingWrite) -> Result<Outcome, sqlx::Error> {
    match w {
        SettingWrite::PutSetting {
            name,
            body,
            record,
            version,
            at,
            actor,
            detail,
        } => {
            let r = if *version == 1 {
                sqlx::query(
                    "INSERT INTO settings (name, body, record, version, updated_at) VALUES ($1, $2, $3, $4, $5) ON CONFLICT (name) DO NOTHING",
                )
                .bind(name)
                .bind(body)
                .bind(record)
                .bind(version)
                .bind(at)
                .execute(&mut **tx)
                .await?
            } else {
                sqlx::query(
                    "UPDATE settings SET body = $1, record = $2, version = $3, updated_at = $4 WHERE name = $5 AND version = $6",
                )
                .bind(body)
                .bind(record)
                .bind(version)
                .bind(at)
                .bind(name)
                .bind(version.saturating_sub(1))
                .execute(&mut **tx)
                .await?
            };
            if r.rows_affected() != 1 {
                return Ok(Outcome::Refused(Refusal::SettingChanged));
            }
            sqlx::query(
                "INSERT INTO admin_events (at, actor, action, detail) VALUES ($1, $2, $3, $4)",
            )
            .bind(at)
            .bind(actor)
            .bind(format!("{name}.put"))
            .bind(detail)
            .execute(&mut **tx)
            .await?;
            Ok(Outcome::Done)
        }
    }
}

impl Store {
    /// A setting's row: (body, signed record, version). Proves nothing until the record
    /// verifies (`settings.rs`).
    pub async fn setting(&self, name: &str) -> Result<Option<(String, String, i64)>, BrokerError> {
        let row = sqlx::query("SELECT body, record, version FROM settings WHERE name = $1")
            .bind(name)
            .fetch_optional(self.db.pool())
            .await?;
        Ok(match row {
            Some(r) => Some((
                r.try_get("body")?,
                r.try_get("record")?,
                r.try_get("version")?,
            )),
            None => None,
        })
    }

    /// The admin audit trail's newest thousand entries, oldest first: (at, actor, action,
    /// detail).
    pub async fn admin_events(&self) -> Result<Vec<(i64, String, String, String)>, BrokerError> {
        let rows = sqlx::query(
            "SELECT at, actor, action, detail FROM admin_events ORDER BY seq DESC LIMIT 1000",
        )
        .fetch_all(self.db.pool())
        .await?;
        rows.iter()
            .rev()
            .map(|r| {
                Ok((
                    r.try_get("at")?,
                    r.try_get("actor")?,
                    r.try_get("action")?,
                    r.try_get("detail")?,
                ))
            })
            .collect()
    }
}
