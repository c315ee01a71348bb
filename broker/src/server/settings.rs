//! Settings an admin puts through the API and every replica appraises with: the reference
//! values (the same file `cgx measure … --reference-values` writes and the KBS's
//! `/kbs/v0/reference-values` takes).
//!
//! A setting's row is `(name, body, record, version)`. The record is signed by the broker's key
//! (`{"aud": "cgx-broker/setting", "name", "version", "sha256": hex(body), "iat", "actor"}`), so
//! a database writer can neither change a body nor write one of its own: a row whose record
//! does not verify is refused (at start: the broker does not start; later: the replica keeps
//! what it has and says so). A replica never goes back to a version lower than one it has
//! used, so an older signed row put back is refused too — within the replica's life; a
//! restarted replica takes the row as it finds it (the audit trail shows each change).
//! Versions also serialize admins: a put is made against the version it read and fails if
//! another put came first.

use cgx_policies::PolicyEngine;
use cgx_protocol::broker::{AuditTrail, ReferenceValuesPut, ReferenceValuesView};
use cgx_protocol::records::Setting;
use cgx_service::auth::Admin;
use serde_json::Value;

use super::error::BrokerError;
use super::keys::{Keys, verify_stored};
use super::store::{Outcome, Refusal, SettingWrite};
use super::{Broker, auditor};

/// The reference values' setting name.
pub(crate) const REFERENCE_VALUES: &str = "reference-values";

pub(crate) fn sha256_hex(b: &[u8]) -> String {
    hex::encode(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, b))
}

impl Keys {
    /// The record of `body` as setting `name` at `version`.
    pub(crate) fn sign_setting(
        &self,
        name: &str,
        version: i64,
        body: &str,
        at: i64,
        actor: &str,
    ) -> Result<String, BrokerError> {
        self.sign(
            &Setting {
                name: name.to_string(),
                version,
                sha256: sha256_hex(body.as_bytes()),
                actor: actor.to_string(),
            },
            at,
            // A setting stands until replaced; the envelope wants an expiry.
            i64::MAX,
        )
    }

    /// Does `record` sign `body` as setting `name` at `version`?
    pub(crate) fn verify_setting(
        &self,
        record: &str,
        name: &str,
        version: i64,
        body: &str,
    ) -> Result<(), BrokerError> {
        let bad = |m: &str| Err(BrokerError::Storage(format!("setting {name}: {m}")));
        let Some(c) = verify_stored::<Setting>(record, &self.public) else {
            return bad("its record's signature does not verify (written outside this broker)");
        };
        let c = c.body;
        if c.name != name {
            return bad("its record is not this setting's");
        }
        if c.version != version {
            return bad("its row's version is not the one signed");
        }
        if c.sha256 != sha256_hex(body.as_bytes()) {
            return bad("its body is not the one signed");
        }
        Ok(())
    }
}

/// A reference-values document as an admin sends it: a JSON object, kept as canonical text.
pub(crate) fn reference_values_text(body: &[u8]) -> Result<String, BrokerError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| BrokerError::BadRequest(format!("reference values: {e}")))?;
    if !v.is_object() {
        return Err(BrokerError::BadRequest(
            "reference values: not a JSON object".into(),
        ));
    }
    Ok(v.to_string())
}

impl Broker {
    /// The reference values in force: (version, text).
    pub(super) fn refs_in_force(&self) -> (i64, String) {
        match self.refs_in_force.lock() {
            Ok(r) => r.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// The engine and the values GET reports switch together: under the values' lock.
    pub(super) fn set_refs_in_force(&self, version: i64, text: String, engine: PolicyEngine) {
        let mut r = match self.refs_in_force.lock() {
            Ok(r) => r,
            Err(poisoned) => poisoned.into_inner(),
        };
        self.appraiser.set_engine(engine);
        *r = (version, text);
    }

    /// Pick up reference values an admin stored (on this replica or another): a newer
    /// version whose record verifies goes into force. A row at the version in force with
    /// another body, or at an older version, is refused (an older row put back, or a version
    /// signed twice after one was): the engine stays as it is.
    pub(crate) async fn refresh_reference_values(&self) -> Result<(), BrokerError> {
        let _one = self.settings_lock.lock().await;
        let Some((body, record, version)) = self.store.setting(REFERENCE_VALUES).await? else {
            return Ok(());
        };
        let (current, text) = self.refs_in_force();
        if version == current && body == text {
            return Ok(());
        }
        if version <= current {
            return Err(BrokerError::Storage(format!(
                "setting reference-values: the row holds version {version}, and version \
                 {current} with {} is in force (an older row put back, or a version signed \
                 twice): kept version {current}",
                if version == current {
                    "another body"
                } else {
                    "its own body"
                }
            )));
        }
        self.keys
            .verify_setting(&record, REFERENCE_VALUES, version, &body)?;
        let engine =
            PolicyEngine::new("broker.appraisal", &self.appraisal_policy, &body).map_err(|e| {
                BrokerError::Storage(format!("setting reference-values v{version}: {e}"))
            })?;
        self.set_refs_in_force(version, body, engine);
        tracing::info!(version, "reference values in force");
        Ok(())
    }

    /// Store reference values (the document `cgx measure … --reference-values` writes) in
    /// place of version `replaces` and put them in force: they judge registrations from now on
    /// (registered nodes at their next re-attestation, or at once with `reattest`). Refused
    /// unless they compile with the appraisal policy; a conflict where the stored values are no
    /// longer at `replaces`.
    pub(crate) async fn put_reference_values(
        &self,
        admin: &Admin,
        body: &[u8],
        replaces: i64,
    ) -> Result<ReferenceValuesPut, BrokerError> {
        if !admin
            .scopes()
            .iter()
            .any(|s| s == "*" || s == REFERENCE_VALUES)
        {
            return Err(BrokerError::Forbidden(
                "reference values are set by admins (scope reference-values or *)".into(),
            ));
        }
        let text = reference_values_text(body)?;
        let engine = PolicyEngine::new("broker.appraisal", &self.appraisal_policy, &text)
            .map_err(|e| BrokerError::BadRequest(format!("reference values: {e}")))?;
        let policy_id = engine.id().to_string();
        let _one = self.settings_lock.lock().await;
        let stored = self
            .store
            .setting(REFERENCE_VALUES)
            .await?
            .map_or(0, |(_, _, v)| v);
        if stored != replaces {
            return Err(BrokerError::Conflict(format!(
                "the reference values are at version {stored}, not {replaces}: read them and \
                 put again"
            )));
        }
        let (current, _) = self.refs_in_force();
        if stored < current {
            return Err(BrokerError::Storage(format!(
                "setting reference-values: the row holds version {stored}, older than the \
                 {current} in force (an older row put back?): nothing put"
            )));
        }
        let version = replaces.checked_add(1).ok_or_else(|| {
            BrokerError::Conflict(format!("version {replaces} cannot be followed"))
        })?;
        let at = self.clock.unix();
        let actor = admin.actor();
        let record = self
            .keys
            .sign_setting(REFERENCE_VALUES, version, &text, at, &actor)?;
        let put = ReferenceValuesPut {
            version,
            replaces,
            sha256: sha256_hex(text.as_bytes()),
            policy_id,
        };
        let detail =
            serde_json::to_value(&put).map_err(|e| BrokerError::Internal(e.to_string()))?;
        match self
            .store
            .write(SettingWrite::PutSetting {
                name: REFERENCE_VALUES,
                body: text.clone(),
                record,
                version,
                at,
                actor: actor.clone(),
                detail: detail.clone(),
            })
            .await?
        {
            Outcome::Done => cgx_service::audit::NewEvent {
                actor: &actor,
                action: &format!("{REFERENCE_VALUES}.put"),
                subject: REFERENCE_VALUES,
                detail: &detail,
            }
            .trace(at),
            Outcome::Refused(Refusal::SettingChanged) => {
                return Err(BrokerError::Conflict(format!(
                    "the reference values changed from version {replaces} meanwhile (another \
                     admin or replica): read them and put again"
                )));
            }
            other => return Err(BrokerError::Internal(format!("setting write: {other:?}"))),
        }
        self.set_refs_in_force(version, text, engine);
        tracing::info!(version, by = %actor, "reference values put");
        Ok(put)
    }

    /// The reference values this replica appraises with, and their version (0: the
    /// configuration's).
    pub(crate) fn reference_values(
        &self,
        admin: &Admin,
    ) -> Result<ReferenceValuesView, BrokerError> {
        if !admin
            .scopes()
            .iter()
            .any(|s| s == "*" || s == REFERENCE_VALUES || s == "auditor")
        {
            return Err(BrokerError::Forbidden(
                "reference values are read by admins and auditors".into(),
            ));
        }
        let (version, text) = self.refs_in_force();
        let reference_values = serde_json::from_str(&text)
            .map_err(|e| BrokerError::Internal(format!("reference values: {e}")))?;
        Ok(ReferenceValuesView {
            version,
            reference_values,
        })
    }

    /// The audit trail (auditors and `*`), oldest first.
    pub(super) async fn admin_events(&self, admin: &Admin) -> Result<AuditTrail, BrokerError> {
        if !auditor(admin) {
            return Err(BrokerError::Forbidden(
                "the audit trail is for auditors".into(),
            ));
        }
        Ok(AuditTrail {
            events: self.store.audit_events().await?,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn keys() -> Keys {
        let rng = aws_lc_rs::rand::SystemRandom::new();
        let pkcs8 = aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
        Keys::from_pkcs8(pkcs8.as_ref().to_vec()).unwrap()
    }

    #[test]
    fn a_setting_row_verifies_only_as_signed() {
        let k = keys();
        let r = k
            .sign_setting(REFERENCE_VALUES, 3, "{\"a\":1}", 10, "admin")
            .unwrap();
        k.verify_setting(&r, REFERENCE_VALUES, 3, "{\"a\":1}")
            .unwrap();
        let refused = |e: Result<(), BrokerError>| e.unwrap_err().to_string();
        assert!(refused(k.verify_setting(&r, REFERENCE_VALUES, 3, "{\"a\":2}")).contains("body"));
        assert!(
            refused(k.verify_setting(&r, REFERENCE_VALUES, 4, "{\"a\":1}")).contains("version")
        );
        assert!(refused(k.verify_setting(&r, "other", 3, "{\"a\":1}")).contains("setting's"));
        let other = keys();
        assert!(
            refused(other.verify_setting(&r, REFERENCE_VALUES, 3, "{\"a\":1}"))
                .contains("signature")
        );
        assert!(reference_values_text(b"[1]").is_err());
        assert!(reference_values_text(b"{").is_err());
    }
}

#[cfg(test)]
mod domain_tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::testing::{Harness, Role};
    use super::*;

    /// Reference values are put by admins against the version they read, go into force at
    /// once, and leave an audit row; a stale version, a caller without the scope and values
    /// that are not a JSON object are refused and change nothing.
    #[tokio::test]
    async fn reference_values_are_put_by_version_and_audited() {
        let h = Harness::new("settings-put").await;
        let admin = h.admin(Role::ReferenceValues);
        let auditor = h.admin(Role::Auditor);
        let before = h.broker.reference_values(&auditor).unwrap();
        assert_eq!(before.version, 0);
        let mut refs = before.reference_values.clone();
        refs["snp"]["measurements"] = serde_json::json!([hex::encode([0x11u8; 48])]);
        let body = refs.to_string();
        let e = h
            .broker
            .put_reference_values(&admin, body.as_bytes(), 1)
            .await
            .unwrap_err();
        assert!(matches!(e, BrokerError::Conflict(_)), "{e}");
        let e = h
            .broker
            .put_reference_values(&auditor, body.as_bytes(), 0)
            .await
            .unwrap_err();
        assert!(matches!(e, BrokerError::Forbidden(_)), "{e}");
        for bad in [&b"[1, 2]"[..], b"{\"snp\": "] {
            let e = h
                .broker
                .put_reference_values(&admin, bad, 0)
                .await
                .unwrap_err();
            assert!(matches!(e, BrokerError::BadRequest(_)), "{e}");
        }
        assert_eq!(h.broker.reference_values(&auditor).unwrap().version, 0);
        let put = h
            .broker
            .put_reference_values(&admin, body.as_bytes(), 0)
            .await
            .unwrap();
        assert_eq!((put.version, put.replaces), (1, 0));
        let now = h.broker.reference_values(&auditor).unwrap();
        assert_eq!(now.version, 1);
        assert_eq!(now.reference_values["snp"], refs["snp"]);
        // In force: a node measured as before no longer affirms.
        let node = h.node(1);
        let registered = h.register(&node).await.unwrap();
        assert_ne!(registered.status, cgx_protocol::records::Tier::Affirming);
        // (The harness's deposits are audited too, and the registration: every decision is.)
        let all = h.broker.admin_events(&auditor).await.unwrap().events;
        let reg = all.iter().find(|e| e.action == "node.register").unwrap();
        assert_eq!(reg.subject, node.id);
        assert_eq!(reg.detail["status"], registered.status.to_string());
        let events: Vec<_> = all
            .into_iter()
            .filter(|e| !e.action.starts_with("ledger.") && !e.action.starts_with("node."))
            .collect();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].action, "reference-values.put");
        assert_eq!(events[0].actor, admin.actor());
        assert_eq!(events[0].subject, "reference-values");
        assert_eq!(events[0].detail["version"], 1);
        assert!(matches!(
            h.broker.admin_events(&admin).await,
            Err(BrokerError::Forbidden(_))
        ));
    }
}
