//! A TEE key serves one tenant at a time (issue 28: the isolation unit is the VM).
//!
//! The broker places another tenant on a VM only once every lease of the previous tenant has
//! ended and its last token has expired (`docs/broker.md`, "Jobs"); this holds the KBS to the
//! same rule where it matters, at release: once this KBS has released a tenant's job resource
//! to a TEE key under a lease, it releases no other tenant's job resource to that key until
//! that lease token has expired. A broker database that two replicas read differently, or a
//! broker bug, cannot then put two tenants' keys in one VM through this KBS.
//!
//! The table is this process's (one entry per TEE key seen with a lease, at most
//! [`MAX_TEE_KEYS`]; expired entries are swept when it fills, and a full table of live entries
//! refuses new keys with 503 rather than forget one).

use std::collections::HashMap;
use std::sync::Mutex;

use super::error::KbsError;

/// TEE keys tracked at most.
pub const MAX_TEE_KEYS: usize = 100_000;

/// TEE key thumbprint → (tenant, until when its lease token lives).
#[derive(Debug, Default)]
pub(crate) struct TeeTenants {
    held: Mutex<HashMap<String, (String, i64)>>,
}

impl TeeTenants {
    /// A release of `tenant`'s job resource to TEE key `thumbprint` at `now`, under a lease
    /// token living until `until`: refused if another tenant's lease token for this key is
    /// still alive; otherwise the key is `tenant`'s until `until` (or longer, if it was).
    pub(crate) fn claim(
        &self,
        thumbprint: &str,
        tenant: &str,
        now: i64,
        until: i64,
    ) -> Result<(), KbsError> {
        let mut held = self
            .held
            .lock()
            .map_err(|_| KbsError::Internal("TEE key table lock".into()))?;
        match held.get_mut(thumbprint) {
            // A token is accepted at its `exp` second too (`cgx_protocol::signed::verify`).
            Some((t, u)) if t != tenant && now <= *u => {
                return Err(KbsError::LeaseInvalid(format!(
                    "this TEE key holds another tenant's lease until {u}: a VM serves one tenant at a time"
                )));
            }
            Some((t, u)) if t == tenant => {
                *u = (*u).max(until);
                return Ok(());
            }
            _ => {}
        }
        if held.len() >= MAX_TEE_KEYS && !held.contains_key(thumbprint) {
            held.retain(|_, (_, u)| now <= *u);
            if held.len() >= MAX_TEE_KEYS {
                return Err(KbsError::Overloaded {
                    retry_after: 60,
                    detail: "too many TEE keys hold live leases".into(),
                });
            }
        }
        held.insert(thumbprint.to_string(), (tenant.to_string(), until));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn one_tenant_per_tee_key_while_its_lease_lives() {
        let t = TeeTenants::default();
        t.claim("k", "acme", 100, 200).unwrap();
        t.claim("k", "acme", 150, 250).unwrap();
        let e = t.claim("k", "globex", 240, 400).unwrap_err().to_string();
        assert!(e.contains("one tenant at a time"), "{e}");
        // acme's last token is accepted through second 250: globex gets the key after it.
        assert!(t.claim("k", "globex", 250, 400).is_err());
        t.claim("k", "globex", 251, 400).unwrap();
        assert!(t.claim("k", "acme", 260, 500).is_err());
        t.claim("other", "acme", 260, 500).unwrap();
    }
}
