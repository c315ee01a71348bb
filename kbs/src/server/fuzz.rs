//! Entry points for cargo-fuzz (feature `fuzzing`): every KBS request body and credential,
//! through the functions the handlers call, in the order they call them. HTTP framing and the
//! database are not here: hyper and sqlx are fuzzed upstream, and a body reaches these
//! functions only after the route's size limit.

use std::sync::OnceLock;

use cgx_attestation::results::ResultSigner;
use cgx_attestation::{SimTrust, Verifier, VerifierConfig};
use cgx_policies::{Appraiser, PolicyEngine};
use cgx_protocol::kbs_types::{Attestation, Request, Tee};

use super::attest::Attester;
use super::release::ReleasePolicies;

/// Fixed "now" (2026-01-01): inputs must replay identically.
const NOW: i64 = 1_767_225_600;

fn attester() -> Option<&'static Attester> {
    static A: OnceLock<Option<Attester>> = OnceLock::new();
    A.get_or_init(|| {
        let engine = PolicyEngine::new(
            super::KBS_POLICY_NAME,
            cgx_policies::APPRAISAL_POLICY,
            cgx_policies::DEFAULT_REFERENCE_VALUES,
        )
        .ok()?;
        let verifier = Verifier::new(VerifierConfig { sim: SimTrust::Any }).allowing_sample(true);
        let appraiser = Appraiser::new(verifier, engine, ResultSigner::generate().ok()?);
        Some(Attester::new(appraiser, None, true))
    })
    .as_ref()
}

/// `POST /auth`.
pub fn auth_body(body: &[u8]) {
    let _ = super::http::json_body::<Request>(body, "auth request");
}

/// `POST /attest`: the body, then verification and appraisal for each TEE the session may have
/// named. The nonce is taken from the body itself, so inputs get past the nonce check.
pub fn attest_body(body: &[u8]) {
    let Ok(att) = super::http::json_body::<Attestation>(body, "attestation") else {
        return;
    };
    let Some(attester) = attester() else {
        return;
    };
    let now =
        time::OffsetDateTime::from_unix_timestamp(NOW).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    let nonce = att.runtime_data.nonce.clone();
    for tee in [Tee::Snp, Tee::Tdx, Tee::Sample] {
        let _ = attester.attest(tee, &att, &nonce, now);
    }
    if let Some(init) = &att.init_data {
        let _ = cgx_protocol::kbs::jwe::encrypt(&att.runtime_data.tee_pubkey, init.body.as_bytes());
    }
}

/// Admin bodies: a policy (`{"policy": base64}`) compiled as a release policy, and the path
/// segments of a resource request.
pub fn admin_body(body: &[u8]) {
    if let Ok(text) = super::http::policy_text(body) {
        static P: OnceLock<Option<ReleasePolicies>> = OnceLock::new();
        if let Some(p) = P.get_or_init(|| ReleasePolicies::new(false, true).ok()) {
            let _ = p.program("resource:fuzz", &text);
        }
        let _ = PolicyEngine::new("fuzz", &text, cgx_policies::DEFAULT_REFERENCE_VALUES);
        let _ = PolicyEngine::new("fuzz", cgx_policies::APPRAISAL_POLICY, &text);
    }
    let text = String::from_utf8_lossy(body);
    let mut segs = text.splitn(3, '/');
    let (repo, kind, tag) = (
        segs.next().unwrap_or(""),
        segs.next().unwrap_or(""),
        segs.next().unwrap_or(""),
    );
    let _ = super::http::resource_path(repo, kind, tag);
}

/// Bearer credentials: an admin JWT, a lease (for a fixed path and TEE key) and a bearer EAR.
pub fn credential(token: &[u8]) {
    let Ok(token) = std::str::from_utf8(token) else {
        return;
    };
    let keys = [[7u8; 32]];
    let _ = cgx_protocol::signed::verify::<cgx_protocol::records::KbsAdminToken>(
        token,
        &keys,
        cgx_protocol::signed::When::At {
            now: NOW,
            max_lifetime: 3600,
        },
    );
    let tee = cgx_protocol::kbs_types::TeePubKey::EC {
        crv: "P-256".into(),
        alg: "ES256".into(),
        x: "AAAA".into(),
        y: "AAAA".into(),
    };
    let _ = super::release::check_lease(token, &keys, "default/key/a", &tee, NOW, 86_400);
    if let Some(a) = attester() {
        let _ = cgx_attestation::results::verify(token, &a.signer().jwk(), NOW);
    }
}
