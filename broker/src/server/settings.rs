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

use cgx_protocol::records::Setting;
use serde_json::Value;

use super::error::BrokerError;
use super::lease::{Keys, verify_stored};

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
