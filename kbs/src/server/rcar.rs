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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::release::Credential;
    use super::super::store::AdminChange;
    use super::*;
    use cgx_protocol::kbs::jwe::{Curve, TeeKey};
    use cgx_protocol::records::Lease;
    use cgx_protocol::signed::Signer;
    use cgx_service::clock::{Clock, ManualClock};
    use std::collections::HashMap;

    const MEASUREMENT: [u8; 48] = [0x5A; 48];

    fn ed25519() -> Vec<u8> {
        aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .unwrap()
            .as_ref()
            .to_vec()
    }

    fn public_b64(pkcs8: &[u8]) -> String {
        use aws_lc_rs::signature::KeyPair;
        let kp = aws_lc_rs::signature::Ed25519KeyPair::from_pkcs8(pkcs8).unwrap();
        base64::Engine::encode(
            &base64::engine::general_purpose::STANDARD,
            kp.public_key().as_ref(),
        )
    }

    /// A KBS in process on SQLite and a manual clock (no listener), trusting simulator roots,
    /// whose broker key is `broker` (PKCS#8).
    async fn kbs(name: &str, broker: &[u8]) -> (Kbs, ManualClock, std::path::PathBuf) {
        use super::super::config::{AppraisalConfig, KbsConfig, KekSource};
        let dir = std::env::temp_dir().join(format!("cgx-kbs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("kek.hex"), hex::encode([7u8; 32])).unwrap();
        let refs = serde_json::json!({
            "allow_sim": "affirming",
            "snp": {"measurements": [hex::encode(MEASUREMENT)]},
            "nvidia": {
                "require_ocsp": false,
                "driver_versions": [cgx_attestation::sim::SIM_GPU_DRIVER_VERSION],
                "vbios_versions": [cgx_attestation::sim::SIM_GPU_VBIOS_VERSION],
                "measurements": "any",
            },
        });
        std::fs::write(dir.join("refs.json"), refs.to_string()).unwrap();
        let config = KbsConfig {
            listen: "127.0.0.1:0".into(),
            tls: None,
            insecure_dev: true,
            database: format!("sqlite://{}", dir.join("kbs.db").display()),
            kek: KekSource::File(dir.join("kek.hex")),
            log: None,
            admin_keys: Vec::new(),
            broker_keys: vec![public_b64(broker)],
            result_key: None,
            sim_roots: vec!["*".into()],
            allow_sample: false,
            nonce_ttl_secs: 60,
            session_ttl_secs: 300,
            collateral: Default::default(),
            appraisal: AppraisalConfig {
                policy: None,
                reference_values: Some(dir.join("refs.json")),
            },
            tenant_isolation: true,
            version_file: Some(dir.join("kbs.versions")),
            accept_new_version_file: false,
            max_connections: 64,
            max_in_flight: 64,
            max_connections_per_client: 64,
            max_in_flight_per_client: 64,
            serving_threads: None,
            admin_token_max_ttl_secs: 3600,
            lease_max_ttl_secs: 86_400,
            sessions: None,
            max_live_sessions: 1000,
        };
        let clock = ManualClock::default();
        let kbs = Kbs::new(&config, clock.shared()).await.unwrap();
        (kbs, clock, dir)
    }

    async fn put(kbs: &Kbs, path: &str, value: &[u8], requires_lease: bool) {
        let repository = path.split('/').next().unwrap();
        kbs.store
            .admin_change(
                AdminChange::PutResource {
                    path,
                    repository,
                    value,
                    requires_lease,
                },
                None,
            )
            .await
            .unwrap();
    }

    fn request(tee: Tee) -> Request {
        serde_json::from_slice(&cgx_protocol::kbs::rcar::auth_body(tee).unwrap()).unwrap()
    }

    /// The handshake in process: a challenge, its answer from a simulated SNP guest with a
    /// GPU, an EAR; the session then gets its tenant's resource only with a lease for its own
    /// TEE key, encrypted to that key. A second answer to one challenge, an unknown session
    /// and a caller with no credential are refused; a TEE this KBS does not take gets no
    /// challenge.
    #[tokio::test]
    async fn a_guest_attests_and_gets_its_resource_through_its_lease() {
        let broker = ed25519();
        let (kbs, clock, dir) = kbs("rcar", &broker).await;
        let now = clock.unix();
        put(&kbs, "acme/weights/key", b"the weights key", true).await;
        let e = kbs.challenge(&request(Tee::Sample)).unwrap_err();
        assert!(matches!(e, KbsError::UnsupportedTee(_)), "{e}");
        let mut old = request(Tee::Snp);
        old.version = "0.1.0".into();
        assert!(matches!(
            kbs.challenge(&old),
            Err(KbsError::ProtocolVersion(_))
        ));

        let node = crate::sim::SimNode::generate(1, MEASUREMENT, now).unwrap();
        let tee = TeeKey::generate_ec(Curve::P256).unwrap();
        let (id, nonce) = kbs.challenge(&request(Tee::Snp)).unwrap();
        let answer =
            serde_json::to_vec(&cgx_protocol::kbs::rcar::attestation(&tee, &node, &nonce).unwrap())
                .unwrap();
        let client: IpAddr = [127, 0, 0, 1].into();
        let ear = kbs.attest(&id, client, &answer).await.unwrap();
        assert_eq!(ear.split('.').count(), 3);
        let again = kbs.attest(&id, client, &answer).await.unwrap_err();
        assert!(matches!(again, KbsError::UnAuthenticated(_)), "{again}");

        let session = Credential::Session(id.clone());
        let none = HashMap::new();
        let e = kbs
            .release(&session, "acme", "weights", "key", &none)
            .await
            .unwrap_err();
        // Tenant isolation: nothing names this session to tenant acme.
        assert!(matches!(e, KbsError::PolicyDeny(_)), "{e}");
        let e = kbs
            .release(&Credential::None, "acme", "weights", "key", &none)
            .await
            .unwrap_err();
        assert!(matches!(e, KbsError::UnAuthenticated(_)), "{e}");
        let e = kbs
            .release(
                &Credential::Session("not-a-session".into()),
                "acme",
                "weights",
                "key",
                &none,
            )
            .await
            .unwrap_err();
        assert!(matches!(e, KbsError::UnAuthenticated(_)), "{e}");

        let lease = |node_key: String| {
            Signer::from_pkcs8(&broker)
                .unwrap()
                .sign(
                    &Lease {
                        lease: "l1".into(),
                        job: "j1".into(),
                        tenant: "acme".into(),
                        node: "n1".into(),
                        gpus: vec![0],
                        resources: vec!["acme/weights/key".into()],
                        node_key,
                        iss: "cgx-broker".into(),
                        until: now + 600,
                        start: now,
                        window_secs: 0,
                        workload: None,
                    },
                    now,
                    now + 120,
                )
                .unwrap()
        };
        let thumbprint = cgx_protocol::kbs::jwe::thumbprint(&tee.public().unwrap());
        let other_key = TeeKey::generate_ec(Curve::P256).unwrap();
        let others = cgx_protocol::kbs::jwe::thumbprint(&other_key.public().unwrap());
        let with = |token: String| HashMap::from([("lease".to_string(), token)]);
        let e = kbs
            .release(&session, "acme", "weights", "key", &with(lease(others)))
            .await
            .unwrap_err();
        assert!(matches!(e, KbsError::LeaseInvalid(_)), "{e}");
        let jwe = kbs
            .release(&session, "acme", "weights", "key", &with(lease(thumbprint)))
            .await
            .unwrap();
        let jwe: cgx_protocol::kbs_types::Response = serde_json::from_value(jwe).unwrap();
        assert_eq!(tee.decrypt(&jwe).unwrap(), b"the weights key");
        // The session lapses on the clock.
        clock.advance(301);
        let e = kbs
            .release(&session, "acme", "weights", "key", &none)
            .await
            .unwrap_err();
        assert!(matches!(e, KbsError::UnAuthenticated(_)), "{e}");
        kbs.store.close().await;
        let _ = std::fs::remove_dir_all(dir);
    }
}
