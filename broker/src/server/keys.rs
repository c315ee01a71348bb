//! What the broker signs with its Ed25519 key (the key the KBS lists in `broker_keys`):
//!
//! - **node records** — [`NodeRecordClaims`] (issued at the attestation, expiring with its EAR):
//!   what a registration established, stored in the node's row; a replica builds its index only
//!   from records whose signature verifies;
//! - **lease tokens** — [`cgx_protocol::records::Lease`]: every resource is the tenant's own
//!   (checked at submission; the KBS checks the `tenant` claim against the resource's
//!   repository too);
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
use cgx_protocol::records::{Lease, NodeRecordClaims};
use cgx_protocol::signed::{self, Record, Signer, Untyped, Verified, When};

use super::error::BrokerError;
use super::index::NodeRecord;
use super::store::LeaseRow;

/// The broker's signing key, and the nonce MAC key derived from it (replicas share both).
pub(crate) struct Keys {
    signer: Signer,
    pub public: [u8; 32],
    nonce_mac: aws_lc_rs::hmac::Key,
    job_mac: aws_lc_rs::hmac::Key,
    /// Proof-of-work challenges: their nonces, seals and openings (`pow.rs`).
    pow_mac: aws_lc_rs::hmac::Key,
    /// The web console's sign-in challenges, session cookies and CSRF tokens (`console/`):
    /// the same on every replica, so any replica serves any session.
    console_mac: aws_lc_rs::hmac::Key,
}

/// A registration nonce: 16 random bytes ‖ expiry (u64 BE) ‖ 16 bytes of
/// HMAC-SHA-256(nonce key, the first 24). Issuing one writes nothing; using one records it
/// (`store/nodes.rs`).
const NONCE_LEN: usize = 40;

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keys")
            .field("public", &hex::encode(self.public))
            .finish_non_exhaustive()
    }
}

/// A record this broker signed and stored, whatever its age (the caller decides liveness from
/// other facts): the signature under `key`, the kind, the kind's audience. Tokens from before
/// typed records are accepted here, and only here ([`Untyped::AcceptStored`]).
pub(super) fn verify_stored<T: Record>(token: &str, key: &[u8; 32]) -> Option<Verified<T>> {
    signed::verify_as(
        token,
        std::slice::from_ref(key),
        When::Any,
        Untyped::AcceptStored,
    )
    .ok()
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

/// Length-prefixed parts under a label: no two different part lists share a message.
fn framed(label: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut m = Vec::with_capacity(256);
    for part in std::iter::once(label).chain(parts.iter().copied()) {
        m.extend_from_slice(&(part.len() as u64).to_be_bytes());
        m.extend_from_slice(part);
    }
    m
}

impl Keys {
    /// A proof-of-work MAC over `parts` under `label`: a challenge's nonce (over its id), its
    /// seal (over every field it is judged by) and its opening (over its id and the root the
    /// node committed to) — unpredictable to a node, the same on every replica, and not
    /// something a database writer can make.
    pub(crate) fn pow_mac(&self, label: &[u8], parts: &[&[u8]]) -> [u8; 32] {
        let tag = aws_lc_rs::hmac::sign(&self.pow_mac, &framed(label, parts));
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// A console MAC over `parts` under `label` (sign-in challenges, session cookies, CSRF
    /// tokens: `console/session.rs`).
    pub(crate) fn console_mac(&self, label: &[u8], parts: &[&[u8]]) -> [u8; 32] {
        let tag = aws_lc_rs::hmac::sign(&self.console_mac, &framed(label, parts));
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Does `tag` match the console MAC over `parts` under `label`? In constant time.
    pub(crate) fn console_mac_ok(&self, label: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
        aws_lc_rs::hmac::verify(&self.console_mac, &framed(label, parts), tag).is_ok()
    }

    pub(crate) fn load(path: &Path) -> Result<Self, BrokerError> {
        let pkcs8 = std::fs::read(path)
            .map_err(|e| BrokerError::Config(format!("signing_key {}: {e}", path.display())))?;
        Self::from_pkcs8(pkcs8)
    }

    pub(crate) fn from_pkcs8(pkcs8: Vec<u8>) -> Result<Self, BrokerError> {
        let signer = Signer::from_pkcs8(&pkcs8)
            .map_err(|_| BrokerError::Config("signing_key is not an Ed25519 PKCS#8 key".into()))?;
        let public = signer.public_key();
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
        let mut m = b"cgx/broker/pow/v1".to_vec();
        m.extend_from_slice(&pkcs8);
        let k = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &m);
        let pow_mac = aws_lc_rs::hmac::Key::new(aws_lc_rs::hmac::HMAC_SHA256, k.as_ref());
        let mut m = b"cgx/broker/console/v1".to_vec();
        m.extend_from_slice(&pkcs8);
        let k = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &m);
        let console_mac = aws_lc_rs::hmac::Key::new(aws_lc_rs::hmac::HMAC_SHA256, k.as_ref());
        Ok(Keys {
            signer,
            public,
            nonce_mac,
            job_mac,
            pow_mac,
            console_mac,
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

    /// A nonce this broker issued (its bytes, decoded once at the edge), unexpired at `now`:
    /// its expiry.
    pub(crate) fn check_nonce(&self, n: &[u8], now: i64) -> Result<i64, BrokerError> {
        let bad = |m: &str| Err(BrokerError::Nonce(m.into()));
        if n.len() != NONCE_LEN {
            return bad("not a nonce of this broker: ask for a new one");
        }
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

    /// Sign `body` as a record of its kind (the key pair parsed once, at start).
    pub(super) fn sign<T: Record>(
        &self,
        body: &T,
        iat: i64,
        exp: i64,
    ) -> Result<String, BrokerError> {
        self.signer
            .sign(body, iat, exp)
            .map_err(|e| BrokerError::Internal(e.to_string()))
    }

    pub(crate) fn sign_record(&self, record: &NodeRecord) -> Result<String, BrokerError> {
        self.sign(
            &NodeRecordClaims {
                node: record.clone(),
            },
            record.attested_at,
            record.ear_expires_at.max(record.attested_at),
        )
    }

    /// A node record from a row: signed by this broker, as a record.
    pub(crate) fn verify_record(&self, token: &str) -> Result<NodeRecord, BrokerError> {
        signed::verify_as::<NodeRecordClaims>(
            token,
            std::slice::from_ref(&self.public),
            When::Any,
            Untyped::AcceptStored,
        )
        .map(|v| v.body.node)
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
        workload: Option<&cgx_protocol::broker::Workload>,
        now: i64,
        until: i64,
        ttl: i64,
        window_secs: u32,
    ) -> Result<String, BrokerError> {
        let exp = (now + ttl).min(until);
        let body = Lease {
            lease: lease.to_string(),
            job: job.to_string(),
            tenant: tenant.to_string(),
            node: record.id.clone(),
            gpus: gpus.to_vec(),
            resources: resources.to_vec(),
            node_key: record.tee_thumbprint.clone(),
            iss: "cgx-broker".into(),
            until,
            start: now,
            window_secs,
            workload: workload.cloned(),
        };
        self.sign(&body, now, exp)
    }

    /// The lease a row stands for: this broker signed it, for the row's id, job and node.
    pub(crate) fn lease_of(&self, row: &LeaseRow) -> Option<Lease> {
        let lease = verify_stored::<Lease>(&row.token, &self.public)?.body;
        (lease.lease == row.id && lease.job == row.job_id && lease.node == row.node_id)
            .then_some(lease)
    }

    /// A fresh token for an open lease, from the signed copy in its row (`None`: the row's token
    /// is not this broker's, or does not match the row).
    pub(crate) fn renew(&self, row: &LeaseRow, now: i64, ttl: i64) -> Option<LeaseGrant> {
        let lease = self.lease_of(row)?;
        if now >= lease.until {
            return None;
        }
        let exp = (now + ttl).min(lease.until);
        let token = self.sign(&lease, now, exp).ok()?;
        let window_secs = lease.window();
        Some(LeaseGrant {
            lease_id: row.id.clone(),
            job_id: row.job_id.clone(),
            gpus: lease.gpus,
            resources: lease.resources,
            token,
            expires_at: exp,
            start: lease.start,
            window_secs,
            workload: lease.workload,
        })
    }
}
