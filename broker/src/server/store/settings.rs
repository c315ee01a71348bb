//! Settings' rows (each with its signed record) and the audit trail (`cgx_service::audit`).

use cgx_service::audit::{AuditEvent, NewEvent};
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
        detail: serde_json::Value,
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
            let action = format!("{name}.put");
            let event = NewEvent {
                actor,
                action: &action,
                subject: name,
                detail,
            };
            cgx_service::audit::record(tx, *at, &event).await?;
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

    /// The audit trail's newest thousand events, oldest first.
    pub async fn audit_events(&self) -> Result<Vec<AuditEvent>, BrokerError> {
        Ok(cgx_service::audit::latest(self.db.pool(), 1000).await?)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::super::{MIGRATION_LOCK, MIGRATIONS};
    use super::*;
    use cgx_service::db::Database;

    /// Migration 7 moves the admin trail into the shared audit table: each row kept, in order,
    /// its setting's name as the subject, its detail still JSON.
    #[tokio::test]
    async fn migration_7_keeps_the_admin_trail_as_audit_events() {
        let dir = std::env::temp_dir().join(format!("cgx-broker-audit7-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("sqlite://{}", dir.join("broker.db").display());
        let db = Database::open_durable(&url).await.unwrap();
        db.migrate(MIGRATION_LOCK, &MIGRATIONS[..6], 1_000)
            .await
            .unwrap();
        for (at, version) in [(10, 1), (20, 2)] {
            sqlx::query(
                "INSERT INTO admin_events (at, actor, action, detail) VALUES ($1, 'admin:4', 'reference-values.put', $2)",
            )
            .bind(at)
            .bind(format!("{{\"version\": {version}}}"))
            .execute(db.pool())
            .await
            .unwrap();
        }
        db.close().await;
        let store = Store::open(&url, 2_000).await.unwrap();
        let events = store.audit_events().await.unwrap();
        assert_eq!(events.len(), 2);
        for (e, (seq, at, version)) in events.iter().zip([(1, 10, 1), (2, 20, 2)]) {
            assert_eq!(
                (e.seq, e.at, e.detail["version"].as_i64()),
                (seq, at, Some(version))
            );
            assert_eq!(e.action, "reference-values.put");
            assert_eq!(
                (e.subject.as_str(), e.actor.as_str()),
                ("reference-values", "admin:4")
            );
        }
        store.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }
}
