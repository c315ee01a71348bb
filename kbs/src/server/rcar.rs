//! CoCo's RCAR handshake (request, challenge, attestation, response), the flow behind
//! `POST /kbs/v0/auth` and `POST /kbs/v0/attest`: a challenge for a supported TEE, then its
//! answer verified (`attest.rs`'s [`super::attest::Attester`]), appraised and recorded once.
//! The handlers (`http.rs`) read the cookie and the body and write the answer; nothing here
//! knows HTTP.

use std::net::IpAddr;

use cgx_protocol::kbs_types::{Attestation, Request, Tee};

use super::error::KbsError;
use super::http::{PROTOCOL_VERSION, json_body};
use super::{Kbs, LiveSession};

impl Kbs {
    /// A challenge for `req` (protocol version and TEE checked): the session id (the cookie's
    /// value) and the nonce.
    pub(crate) fn challenge(&self, req: &Request) -> Result<(String, String), KbsError> {
        if req.version != PROTOCOL_VERSION {
            return Err(KbsError::ProtocolVersion(req.version.clone()));
        }
        match req.tee {
            Tee::Snp | Tee::Tdx => {}
            Tee::Sample if self.allow_sample => {}
            other => return Err(KbsError::UnsupportedTee(other.to_string())),
        }
        let ch = self
            .session_keys
            .issue(req.tee.as_ref(), self.clock.unix() + self.nonce_ttl)
            .ok_or_else(|| KbsError::Internal("challenge: no randomness, or the clock".into()))?;
        Ok((ch.id, ch.nonce))
    }

    /// Answer the challenge of session `id` with the attestation in `body` (from `client`): the
    /// evidence verified and appraised, collateral the store lacks fetched (charged to `client`),
    /// the answer recorded once across replicas; the signed EAR.
    pub(crate) async fn attest(
        &self,
        id: &str,
        client: IpAddr,
        body: &[u8],
    ) -> Result<String, KbsError> {
        let kbs = self;
        let ch = kbs
            .session_keys
            .open(id, kbs.clock.unix())
            .map_err(|e| KbsError::UnAuthenticated(e.into()))?;
        let replayed = || {
            KbsError::UnAuthenticated(
                "this challenge was already answered; start again with /auth".into(),
            )
        };
        // Replays are caught when the answer is recorded (`sessions.rs`: one INSERT on any replica,
        // or this process's table). Checking the database first would cost every honest
        // attestation a read; this process's table costs a lookup, and spares a replay the
        // appraisal.
        if kbs.answered_here(id) {
            return Err(replayed());
        }
        let att: Attestation = json_body(body, "attestation")?;
        let tee: Tee = ch
            .tee
            .parse()
            .map_err(|_| KbsError::Internal("session TEE".into()))?;
        let nonce = ch.nonce.clone();
        // Pure computation over the store (a few hundred microseconds): no thread hand-off. What the
        // store lacks is fetched through the bounded gate, charged to this client, and the
        // attestation tried again; known platforms never get that far.
        let mut attempt = kbs.attester.attest(tee, &att, &nonce, kbs.clock.now());
        if let Some(gate) = &kbs.fetcher {
            for _ in 0..2 {
                if attempt.missing.is_empty() {
                    break;
                }
                if attempt.outcome.is_ok() {
                    // Only what it could do without (OCSP answers): fetch for the next time.
                    gate.prefetch(Some(client), &attempt.missing);
                    break;
                }
                if let Err(e) = gate.fetch(client, &attempt.missing).await {
                    attempt.outcome = Err(e);
                    break;
                }
                attempt = kbs.attester.attest(tee, &att, &nonce, kbs.clock.now());
            }
            gate.prefetch(None, &attempt.refresh);
        }
        let attested = match attempt.outcome {
            Ok(a) => a,
            Err(e) => {
                // A failed answer uses up the challenge too.
                kbs.answer_failed(&ch).await?;
                return Err(e);
            }
        };
        // A session lives at most `session_ttl` past its challenge's expiry, however long the
        // attestation took (collateral fetches): the session sweep relies on it.
        let expires_at = kbs.clock.unix().min(ch.expires_at) + kbs.session_ttl;
        let status = attested.status();
        let (ear, token) = attested.into_signed();
        let session = LiveSession {
            // No longer than its EAR (attestation may have taken a while).
            expires_at: expires_at.min(ear.exp.unwrap_or(expires_at)),
            tee_pubkey: att.runtime_data.tee_pubkey,
            ear,
        };
        if !kbs
            .answer_attested(&ch, expires_at, &token, session)
            .await?
        {
            return Err(replayed());
        }
        // The session id is a bearer credential: it is not logged.
        tracing::info!(status = status.as_str(), "attested");
        Ok(token)
    }
}
