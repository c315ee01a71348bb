//! Audit events: what an administrator (or a TEE, at a release) changed or was given, as both
//! services record it and an auditor reads it. One shape for the KBS's trail
//! (`GET /kbs/v0/audit`) and the broker's (`GET /v1/admin-events`), written by
//! `cgx_service::audit` in the transaction of the change it records.
//!
//! An event is meant to become a leaf of the transparency log: [`AuditEvent::leaf`] is its
//! canonical encoding (RFC 8785 JSON of every field under a versioned kind and the service's
//! name), so the bytes a log commits to do not depend on how a database returned the row or on
//! the order of a JSON object's members; `seq` makes two like events (two releases of one
//! resource in one second) two leaves.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The kind an event's leaf names (the leaf format's version).
pub const LEAF_KIND: &str = "cgx.audit.v1";

/// One event of a service's audit trail.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEvent {
    /// Its position in the service's trail (1, 2, …; in commit order across replicas).
    pub seq: i64,
    /// Unix seconds, the service's clock.
    pub at: i64,
    /// Who: `admin:<key index>`, `tee`, …
    pub actor: String,
    /// What, as `<object>.<verb>` (`resource.put`, `reference-values.put`) or a flow's name
    /// (`release`).
    pub action: String,
    /// What it was done to: a resource path, a policy scope, a setting's name.
    pub subject: String,
    /// The rest, as the service recorded it (digests rather than contents).
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub detail: Value,
}

impl AuditEvent {
    /// The event's leaf for a transparency log, recorded by `service` (`cgx-kbs`,
    /// `cgx-broker`): canonical JSON of `{kind, service, seq, at, actor, action, subject,
    /// detail}`.
    pub fn leaf(&self, service: &str) -> Vec<u8> {
        crate::jcs::canonical(&serde_json::json!({
            "kind": LEAF_KIND,
            "service": service,
            "seq": self.seq,
            "at": self.at,
            "actor": self.actor,
            "action": self.action,
            "subject": self.subject,
            "detail": self.detail,
        }))
        .into_bytes()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The leaf is canonical: the detail's member order changes nothing; every field changes it.
    #[test]
    fn the_leaf_is_canonical_and_covers_every_field() {
        let e = AuditEvent {
            seq: 7,
            at: 1_700_000_000,
            actor: "admin:0".into(),
            action: "resource.put".into(),
            subject: "acme/weights/key".into(),
            detail: serde_json::from_str(r#"{"bytes": 32, "requires_lease": true}"#).unwrap(),
        };
        let leaf = e.leaf("cgx-kbs");
        assert_eq!(
            String::from_utf8(leaf.clone()).unwrap(),
            r#"{"action":"resource.put","actor":"admin:0","at":1700000000,"detail":{"bytes":32,"requires_lease":true},"kind":"cgx.audit.v1","seq":7,"service":"cgx-kbs","subject":"acme/weights/key"}"#
        );
        let reordered = AuditEvent {
            detail: serde_json::from_str(r#"{"requires_lease": true, "bytes": 32}"#).unwrap(),
            ..e.clone()
        };
        assert_eq!(reordered.leaf("cgx-kbs"), leaf);
        assert_ne!(e.leaf("cgx-broker"), leaf);
        for changed in [
            AuditEvent {
                seq: 8,
                ..e.clone()
            },
            AuditEvent { at: 1, ..e.clone() },
            AuditEvent {
                actor: "tee".into(),
                ..e.clone()
            },
            AuditEvent {
                action: "resource.delete".into(),
                ..e.clone()
            },
            AuditEvent {
                subject: "acme/weights/other".into(),
                ..e.clone()
            },
            AuditEvent {
                detail: Value::Null,
                ..e.clone()
            },
        ] {
            assert_ne!(changed.leaf("cgx-kbs"), leaf);
        }
    }
}
