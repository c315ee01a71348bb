//! What the broker signs with its Ed25519 key (the key the KBS lists in `broker_keys`):
//!
//! - **node records** — `{"aud": "cgx-broker/node", "iat": attested_at, "exp": EAR expiry,
//!   "node": NodeRecord}`: what a registration established, stored in the node's row; a replica
//!   builds its index only from records whose signature verifies;
//! - **lease tokens** — `{"lease", "job", "tenant", "node", "gpus", "resources", "node_key":
//!   <RFC 7638 thumbprint of the node's TEE key>, "aud": "cgx-kbs", "iss": "cgx-broker", "iat",
//!   "exp", "until": <the job's end>}`: every resource is the tenant's own (checked at
//!   submission; the KBS checks the `tenant` claim against the resource's repository too);
//!   the token the KBS checks (`kbs/src/server/release.rs`). The thumbprint is the one the
//!   node's hardware evidence bound at registration (`cgx_protocol::broker::node_identity`), so
//!   the KBS releases only to a session that attested that very TEE key. Short-lived; renewed
//!   in heartbeat answers from the signed copy kept in the lease row, never from the row's
//!   columns.
//!
//! And what it MACs: a **job seal**, HMAC-SHA-256 under a key derived from the signing key over
//! the job's id, tenant, spec (the exact stored text) and creation time, made at submission and
//! checked before every lease is signed. A database writer can insert a job row, edit its spec
//! or move it to another tenant, but cannot make a seal for it: such a job is never leased.

use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use cgx_protocol::broker::LeaseGrant;
use cgx_service::jwt;
use serde_json::{Value, json};

use super::error::BrokerError;
use super::index::NodeRecord;
use super::store::LeaseRow;

/// Audience of node records (never accepted as a lease or an API token).
const RECORD_AUDIENCE: &str = "cgx-broker/node";

/// The broker's signing key, and the nonce MAC key derived from it (replicas share both).
pub(crate) struct Keys {
    pkcs8: Vec<u8>,
    pub public: [u8; 32],
    nonce_mac: aws_lc_rs::hmac::Key,
    job_mac: aws_lc_rs::hmac::Key,
}

/// A registration nonce: 16 random bytes ‖ expiry (u64 BE) ‖ 16 bytes of
/// HMAC-SHA-256(nonce key, the first 24). Issuing one writes nothing; using one records it
/// (`store.rs`).
const NONCE_LEN: usize = 40;

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keys")
            .field("public", &hex::encode(self.public))
            .finish_non_exhaustive()
    }
}

/// Claims of a token this broker signed, whatever its age: the signature is checked with the
/// token's own `iat` as "now" (the caller applies its own time rules to what it reads).
pub(super) fn verify_signed(token: &str, key: &[u8; 32]) -> Option<Value> {
    let payload = token.split('.').nth(1)?;
    let claims: Value = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(payload).ok()?).ok()?;
    let iat = claims.get("iat")?.as_i64()?;
    jwt::verify_eddsa(token, std::slice::from_ref(key), iat, i64::MAX)
        .ok()
        .map(|(_, c)| c)
}

/// What a job seal covers, each part length-prefixed so no two jobs share a message.
fn job_message(id: &str, tenant: &str, spec: &str, created_at: i64) -> Vec<u8> {
    let mut m = Vec::with_capacity(64 + spec.len());
    for part in [
        b"cgx/broker/job/v1".as_slice(),
        id.as_bytes(),
        tenant.as_bytes(),
        spec.as_bytes(),
    ] {
        m.extend_from_slice(&(part.len() as u64).to_be_bytes());
        m.extend_from_slice(part);
    }
    m.extend_from_slice(&created_at.to_be_bytes());
    m
}

impl Keys {
    pub(crate) fn load(path: &Path) -> Result<Self, BrokerError> {
        let pkcs8 = std::fs::read(path)
            .map_err(|e| BrokerError::Config(format!("signing_key {}: {e}", path.display())))?;
        Self::from_pkcs8(pkcs8)
    }

    pub(crate) fn from_pkcs8(pkcs8: Vec<u8>) -> Result<Self, BrokerError> {
        use aws_lc_rs::signature::KeyPair;
        let kp = aws_lc_rs::signature::Ed25519KeyPair::from_pkcs8(&pkcs8)
            .map_err(|_| BrokerError::Config("signing_key is not an Ed25519 PKCS#8 key".into()))?;
        let public = kp
            .public_key()
            .as_ref()
            .try_into()
            .map_err(|_| BrokerError::Config("signing_key: public key".into()))?;
        // The nonce key: a hash of the signing key under its own label (never used to sign).
        let mut m = b"cgx/broker/nonce-mac/v1".to_vec();
        m.extend_from_slice(&pkcs8);
        let k = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &m);
        let nonce_mac = aws_lc_rs::hmac::Key::new(aws_lc_rs::hmac::HMAC_SHA256, k.as_ref());
        // The job seal's key, under a label of its own.
        let mut m = b"cgx/broker/job-seal/v1".to_vec();
        m.extend_from_slice(&pkcs8);
        let k = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &m);
        let job_mac = aws_lc_rs::hmac::Key::new(aws_lc_rs::hmac::HMAC_SHA256, k.as_ref());
        Ok(Keys {
            pkcs8,
            public,
            nonce_mac,
            job_mac,
        })
    }

    /// A new nonce valid until `expires_at`.
    pub(crate) fn make_nonce(&self, expires_at: i64) -> Result<(String, i64), BrokerError> {
        let mut n = [0u8; NONCE_LEN];
        aws_lc_rs::rand::fill(&mut n[..16]).map_err(|_| BrokerError::Internal("random".into()))?;
        n[16..24].copy_from_slice(&expires_at.to_be_bytes());
        let tag = aws_lc_rs::hmac::sign(&self.nonce_mac, &n[..24]);
        n[24..].copy_from_slice(&tag.as_ref()[..16]);
        Ok((cgx_protocol::broker::b64(&n), expires_at))
    }

    /// A nonce this broker issued, unexpired at `now`: its expiry.
    pub(crate) fn check_nonce(&self, nonce: &str, now: i64) -> Result<i64, BrokerError> {
        let bad = |m: &str| Err(BrokerError::Nonce(m.into()));
        let Some(n) = cgx_protocol::broker::unb64(nonce).filter(|n| n.len() == NONCE_LEN) else {
            return bad("not a nonce of this broker: ask for a new one");
        };
        let tag = aws_lc_rs::hmac::sign(&self.nonce_mac, &n[..24]);
        // Constant-time comparison: the tag is a MAC.
        if aws_lc_rs::constant_time::verify_slices_are_equal(&tag.as_ref()[..16], &n[24..]).is_err()
        {
            return bad("not a nonce of this broker: ask for a new one");
        }
        let mut e = [0u8; 8];
        e.copy_from_slice(&n[16..24]);
        let expires_at = i64::from_be_bytes(e);
        if now >= expires_at {
            return bad("expired: ask for a new one");
        }
        Ok(expires_at)
    }

    /// The seal of a job: HMAC over length-prefixed id, tenant and spec text, and the creation
    /// time (base64url).
    pub(crate) fn seal_job(&self, id: &str, tenant: &str, spec: &str, created_at: i64) -> String {
        let tag = aws_lc_rs::hmac::sign(&self.job_mac, &job_message(id, tenant, spec, created_at));
        URL_SAFE_NO_PAD.encode(tag.as_ref())
    }

    /// The job row as submitted: its seal verifies over its id, tenant, spec and creation
    /// time. Checked before every lease is signed (the row is the database's word only).
    pub(crate) fn check_job(&self, row: &super::store::JobRow) -> Result<(), BrokerError> {
        let refused = || {
            BrokerError::JobSeal(format!(
                "job {} was not submitted as stored (its seal does not verify over its tenant and spec); it is never leased",
                row.id
            ))
        };
        let tag = URL_SAFE_NO_PAD.decode(&row.seal).map_err(|_| refused())?;
        aws_lc_rs::hmac::verify(
            &self.job_mac,
            &job_message(&row.id, &row.tenant, &row.spec, row.created_at),
            &tag,
        )
        .map_err(|_| refused())
    }

    /// The signing key (PKCS#8), for the records other modules sign (`settings.rs`).
    pub(super) fn pkcs8(&self) -> &[u8] {
        &self.pkcs8
    }

    fn sign(&self, claims: &Value) -> Result<String, BrokerError> {
        jwt::sign_eddsa(&self.pkcs8, claims).map_err(BrokerError::Internal)
    }

    pub(crate) fn sign_record(&self, record: &NodeRecord) -> Result<String, BrokerError> {
        self.sign(&json!({
            "aud": RECORD_AUDIENCE,
            "iat": record.attested_at,
            "exp": record.ear_expires_at.max(record.attested_at),
            "node": record,
        }))
    }

    /// A node record from a row: signed by this broker, as a record.
    pub(crate) fn verify_record(&self, token: &str) -> Result<NodeRecord, BrokerError> {
        let claims = verify_signed(token, &self.public)
            .ok_or_else(|| BrokerError::Internal("node record signature".into()))?;
        if claims.get("aud").and_then(Value::as_str) != Some(RECORD_AUDIENCE) {
            return Err(BrokerError::Internal("not a node record".into()));
        }
        serde_json::from_value(claims.get("node").cloned().unwrap_or(Value::Null))
            .map_err(|e| BrokerError::Internal(format!("node record: {e}")))
    }

    /// A lease token for `record`'s VM.
    #[allow(clippy::too_many_arguments)]
    /// `until`: when the job's time ends; no renewal reaches past it (a lease row a database
    /// writer re-opens or extends is not renewed beyond what was signed).
    pub(crate) fn lease_token(
        &self,
        lease: &str,
        job: &str,
        tenant: &str,
        record: &NodeRecord,
        gpus: &[u32],
        resources: &[String],
        now: i64,
        until: i64,
        ttl: i64,
    ) -> Result<String, BrokerError> {
        self.sign(&json!({
            "lease": lease, "job": job, "tenant": tenant, "node": record.id, "gpus": gpus,
            "resources": resources, "node_key": record.tee_thumbprint,
            "aud": cgx_protocol::broker::LEASE_AUDIENCE, "iss": "cgx-broker",
            "iat": now, "exp": (now + ttl).min(until), "until": until,
        }))
    }

    /// A fresh token for an open lease, from the signed copy in its row (`None`: the row's token
    /// is not this broker's, or does not match the row).
    pub(crate) fn renew(&self, row: &LeaseRow, now: i64, ttl: i64) -> Option<LeaseGrant> {
        let mut claims = verify_signed(&row.token, &self.public)?;
        let matches = claims.get("lease").and_then(Value::as_str) == Some(row.id.as_str())
            && claims.get("job").and_then(Value::as_str) == Some(row.job_id.as_str())
            && claims.get("node").and_then(Value::as_str) == Some(row.node_id.as_str());
        if !matches {
            return None;
        }
        let until = claims.get("until").and_then(Value::as_i64)?;
        if now >= until {
            return None;
        }
        let gpus: Vec<u32> = serde_json::from_value(claims.get("gpus")?.clone()).ok()?;
        let resources: Vec<String> =
            serde_json::from_value(claims.get("resources")?.clone()).ok()?;
        let obj = claims.as_object_mut()?;
        let exp = (now + ttl).min(until);
        obj.insert("iat".into(), now.into());
        obj.insert("exp".into(), exp.into());
        let token = self.sign(&claims).ok()?;
        Some(LeaseGrant {
            lease_id: row.id.clone(),
            job_id: row.job_id.clone(),
            gpus,
            resources,
            token,
            expires_at: exp,
        })
    }
}
