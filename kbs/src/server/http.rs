//! The router and its handlers. Handlers validate and delegate: attestation to [`Attester`],
//! release decisions to [`ReleasePolicies`] and [`check_lease`], persistence to [`Store`].
//!
//! CoCo protocol: `POST /kbs/v0/auth`, `POST /kbs/v0/attest`, `GET /kbs/v0/resource/{repo}/
//! {type}/{tag}`. Admin (EdDSA bearer tokens): `POST|DELETE /kbs/v0/resource/...`,
//! `/kbs/v0/resource-policy[/{repo}[/{type}/{tag}]]`, `/kbs/v0/attestation-policy`,
//! `/kbs/v0/reference-values`, `/kbs/v0/reference-value[/{id}]` (Trustee's RVPS sample
//! messages), `/kbs/v0/audit`. Public: `/kbs/v0/jwks`, `/kbs/v0/openapi.json`,
//! `/metrics`, `/healthz`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use cgx_attestation::results::Tier;
use cgx_policies::PolicyEngine;
use cgx_policies::release::ReleaseRequest;
use cgx_protocol::kbs_types::{Attestation, Challenge, Request, Tee};
use serde_json::{Value, json};

use cgx_service::auth::Admin;

use super::error::KbsError;
use super::release::{GLOBAL_SCOPE, check_lease};
use super::store::{AdminChange, AuditRow};
use super::{Kbs, LiveSession};

pub const PROTOCOL_VERSION: &str = "0.4.0";
pub const SESSION_COOKIE: &str = "kbs-session-id";
const OPENAPI: &str = include_str!("openapi.json");

type Shared = State<Arc<Kbs>>;

/// Body limits per route, enforced before any extractor runs (authentication included).
const SMALL_BODY: usize = 4 << 10;
const EVIDENCE_BODY: usize = 1 << 20;
const POLICY_BODY: usize = 1 << 20;
const RESOURCE_BODY: usize = 16 << 20;

pub(super) fn router(kbs: Arc<Kbs>) -> Router {
    use cgx_service::limits::limited;
    let api = Router::new()
        .route(
            cgx_protocol::kbs::rcar::AUTH_PATH,
            limited(post(auth), SMALL_BODY),
        )
        .route(
            cgx_protocol::kbs::rcar::ATTEST_PATH,
            limited(post(attest), EVIDENCE_BODY),
        )
        .route(
            "/kbs/v0/resource/{repo}/{kind}/{tag}",
            limited(get(get_resource).delete(delete_resource), SMALL_BODY)
                .merge(limited(post(put_resource), RESOURCE_BODY)),
        )
        .route(
            "/kbs/v0/resource-policy",
            limited(post(set_global_policy).get(get_global_policy), POLICY_BODY),
        )
        .route(
            "/kbs/v0/resource-policy/{repo}",
            limited(post(set_repo_policy).get(get_repo_policy), POLICY_BODY),
        )
        .route(
            "/kbs/v0/resource-policy/{repo}/{kind}/{tag}",
            limited(
                post(set_resource_policy).get(get_resource_policy),
                POLICY_BODY,
            ),
        )
        .route(
            "/kbs/v0/attestation-policy",
            limited(
                post(set_attestation_policy).get(get_attestation_policy),
                POLICY_BODY,
            ),
        )
        .route(
            "/kbs/v0/reference-values",
            limited(
                post(set_reference_values).get(get_reference_values),
                POLICY_BODY,
            ),
        )
        .route(
            "/kbs/v0/reference-value",
            limited(post(set_reference_value), SMALL_BODY),
        )
        .route("/kbs/v0/reference-value/{id}", get(get_reference_value))
        .route("/kbs/v0/audit", get(audit))
        .route("/kbs/v0/jwks", get(jwks));
    cgx_service::ops::routes(api, "/kbs/v0/openapi.json", OPENAPI, kbs.metrics.clone())
        .route("/healthz", get(healthz))
        .route_layer(cgx_service::metrics::TrackLayer::new(kbs.metrics.clone()))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(16 << 20))
        .with_state(kbs)
}

pub(super) fn json_body<T: serde::de::DeserializeOwned>(
    body: &[u8],
    what: &str,
) -> Result<T, KbsError> {
    serde_json::from_slice(body).map_err(|e| KbsError::InvalidRequest(format!("{what}: {e}")))
}

fn cookie(headers: &HeaderMap) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|kv| {
            let (k, v) = kv.trim().split_once('=')?;
            (k == SESSION_COOKIE).then(|| v.to_string())
        })
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

/// `repo/type/tag` with each part `[A-Za-z0-9._-]+` and not `.`/`..`; anything else is 404.
pub(super) fn resource_path(repo: &str, kind: &str, tag: &str) -> Result<String, KbsError> {
    let ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 128
            && s != "."
            && s != ".."
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    };
    if ok(repo) && ok(kind) && ok(tag) {
        Ok(format!("{repo}/{kind}/{tag}"))
    } else {
        Err(KbsError::NotFound("resource path".into()))
    }
}

// ------------------------------------------------------------------------ RCAR

async fn auth(State(kbs): Shared, body: Bytes) -> Result<Response, KbsError> {
    let req: Request = json_body(&body, "auth request")?;
    if req.version != PROTOCOL_VERSION {
        return Err(KbsError::ProtocolVersion(req.version));
    }
    match req.tee {
        Tee::Snp | Tee::Tdx => {}
        Tee::Sample if kbs.allow_sample => {}
        other => return Err(KbsError::UnsupportedTee(other.to_string())),
    }
    let ch = kbs
        .session_keys
        .issue(req.tee.as_ref(), kbs.clock.unix() + kbs.nonce_ttl)
        .ok_or_else(|| KbsError::Internal("challenge: no randomness, or the clock".into()))?;
    let (id, nonce) = (ch.id, ch.nonce);
    let mut resp = Json(Challenge {
        nonce,
        extra_params: json!({}),
    })
    .into_response();
    let c = format!(
        "{SESSION_COOKIE}={id}; Path=/kbs; HttpOnly; SameSite=Strict; Max-Age={}",
        kbs.session_ttl
    );
    resp.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_str(&c).map_err(|e| KbsError::Internal(e.to_string()))?,
    );
    Ok(resp)
}

async fn attest(
    State(kbs): Shared,
    ConnectInfo(client): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, KbsError> {
    let r = attest_inner(&kbs, client, &headers, &body).await;
    kbs.metrics.event(
        "attestation",
        match &r {
            Ok(_) => "token_issued",
            Err(_) => "refused",
        },
    );
    r
}

async fn attest_inner(
    kbs: &Arc<Kbs>,
    client: SocketAddr,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, KbsError> {
    let id = cookie(headers)
        .ok_or_else(|| KbsError::UnAuthenticated("no kbs-session-id cookie".into()))?;
    let ch = kbs
        .session_keys
        .open(&id, kbs.clock.unix())
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
    if kbs.answered_here(&id) {
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
                gate.prefetch(Some(client.ip()), &attempt.missing);
                break;
            }
            if let Err(e) = gate.fetch(client.ip(), &attempt.missing).await {
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
    Ok(Json(AttestResponse { token }).into_response())
}

/// What `/attest` answers: the EAR, signed.
#[derive(serde::Serialize)]
struct AttestResponse {
    token: String,
}

/// The attested session of the requester: its session cookie, or a bearer EAR this KBS issued.
async fn requester(kbs: &Kbs, headers: &HeaderMap) -> Result<Arc<LiveSession>, KbsError> {
    if let Some(id) = cookie(headers) {
        kbs.session_keys
            .authentic(&id)
            .map_err(|e| KbsError::UnAuthenticated(e.into()))?;
        return kbs
            .attested_session(&id)
            .await?
            .filter(|s| s.expires_at > kbs.clock.unix())
            .ok_or_else(|| {
                KbsError::UnAuthenticated("no attested, unexpired session for this cookie".into())
            });
    }
    if let Some(token) = bearer(headers) {
        return kbs.verified_ear(token).map(Arc::new);
    }
    Err(KbsError::UnAuthenticated(
        "no session cookie and no bearer token".into(),
    ))
}

async fn get_resource(
    State(kbs): Shared,
    Path((repo, kind, tag)): Path<(String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, KbsError> {
    let r = release(&kbs, &repo, &kind, &tag, &query, &headers).await;
    kbs.metrics.event(
        "release",
        match &r {
            Ok(_) => "released",
            Err(KbsError::PolicyDeny(_) | KbsError::LeaseInvalid(_)) => "denied",
            Err(KbsError::ResourceNotFound(_)) => "not_found",
            Err(_) => "refused",
        },
    );
    r
}

async fn release(
    kbs: &Kbs,
    repo: &str,
    kind: &str,
    tag: &str,
    query: &HashMap<String, String>,
    headers: &HeaderMap,
) -> Result<Response, KbsError> {
    let path = resource_path(repo, kind, tag)?;
    // Authentication first: an unauthenticated caller learns nothing about what exists.
    let session = requester(kbs, headers).await?;
    let key = &session.tee_pubkey;
    // Every part must be affirming: a part the policy left at `none` is not a pass, whatever
    // release policy an administrator installs.
    let status = session.ear.tier();
    if status != Tier::Affirming {
        return Err(KbsError::PolicyDeny(format!(
            "{path}: the session's appraisal is {}, not affirming",
            status.as_str()
        )));
    }
    if let Some((part, a)) = session
        .ear
        .submods
        .iter()
        .find(|(_, a)| a.status != Tier::Affirming)
    {
        return Err(KbsError::PolicyDeny(format!(
            "{path}: part {part} of the session's appraisal is {}, not affirming",
            a.status.as_str()
        )));
    }
    // Sample evidence is released only by a KBS that takes it: a session another replica (or a
    // development KBS sharing the result key) appraised from it is not this one's to honour.
    if !kbs.allow_sample
        && let Some((part, _)) = session.ear.submods.iter().find(|(_, a)| {
            matches!(
                a.verifier_claims.get("cgx.kind").and_then(Value::as_str),
                Some("sample" | "sampledevice")
            )
        })
    {
        return Err(KbsError::PolicyDeny(format!(
            "{path}: part {part} is sample evidence, which this KBS does not take"
        )));
    }
    let lease = match query.get("lease") {
        Some(token) => Some(check_lease(
            token,
            &kbs.broker_keys,
            &path,
            key,
            kbs.clock.unix(),
            kbs.lease_max_ttl,
        )?),
        None => None,
    };
    let lease_claims = lease.as_ref().map(super::release::lease_input);
    let stored = kbs.release_policies(&path, repo).await?;
    // Policies, tenant isolation included, before the lookup: a denied requester learns
    // nothing about what exists. They read the EAR as Trustee's do (`input.submods.cpu0…`),
    // plus the request.
    let request = ReleaseRequest {
        path: &path,
        repository: repo,
        kind,
        tag,
        query,
        lease: lease_claims.as_ref(),
    };
    kbs.release.check(&session.ear, &request, &stored).await?;
    let resource = kbs
        .store
        .resource(&path)
        .await?
        .ok_or_else(|| KbsError::ResourceNotFound(path.clone()))?;
    if resource.requires_lease && lease.is_none() {
        return Err(KbsError::LeaseInvalid(format!(
            "{path} is a job resource and needs a lease token (query parameter lease)"
        )));
    }
    // A TEE key serves one tenant at a time: another tenant's lease for this key must have
    // expired (`tenancy.rs`). The lease names its tenant (checked against the repository).
    if let Some(l) = &lease {
        kbs.tee_tenants.claim(
            &cgx_protocol::kbs::jwe::thumbprint(key),
            &l.body.tenant,
            kbs.clock.unix(),
            l.exp,
        )?;
    }
    let jwe = cgx_protocol::kbs::jwe::encrypt(key, &resource.value).map_err(|e| match e {
        cgx_protocol::kbs::jwe::JweError::UnsupportedKey(_)
        | cgx_protocol::kbs::jwe::JweError::InvalidKey(_) => {
            KbsError::InvalidRequest(format!("TEE key: {e}"))
        }
        e => KbsError::Jwe(e.to_string()),
    })?;
    kbs.store
        .audit(
            "tee",
            "release",
            &path,
            &json!({
                "tee_key": cgx_protocol::kbs::jwe::thumbprint(key),
                "lease": lease.as_ref().map(|l| l.body.lease.as_str()),
            }),
        )
        .await?;
    Ok(Json(jwe).into_response())
}

// ------------------------------------------------------------------------ admin

async fn put_resource(
    State(kbs): Shared,
    admin: Admin,
    Path((repo, kind, tag)): Path<(String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
    body: Bytes,
) -> Result<Response, KbsError> {
    let path = resource_path(&repo, &kind, &tag)?;
    admin.may(Some(&repo))?;
    let actor = admin.actor();
    let requires_lease = match query.get("lease").map(String::as_str) {
        None | Some("optional") => false,
        Some("required") => true,
        Some(other) => {
            return Err(KbsError::InvalidRequest(format!(
                "lease={other}: use required or optional"
            )));
        }
    };
    kbs.store
        .admin_change(
            AdminChange::PutResource {
                path: &path,
                repository: &repo,
                value: &body,
                requires_lease,
            },
            Some(AuditRow {
                actor: &actor,
                action: "resource.put",
                subject: &path,
                detail: &json!({"bytes": body.len(), "requires_lease": requires_lease}),
            }),
        )
        .await?;
    Ok(StatusCode::OK.into_response())
}

async fn delete_resource(
    State(kbs): Shared,
    admin: Admin,
    Path((repo, kind, tag)): Path<(String, String, String)>,
) -> Result<Response, KbsError> {
    let path = resource_path(&repo, &kind, &tag)?;
    admin.may(Some(&repo))?;
    let actor = admin.actor();
    let deleted = kbs
        .store
        .admin_change(
            AdminChange::DeleteResource { path: &path },
            Some(AuditRow {
                actor: &actor,
                action: "resource.delete",
                subject: &path,
                detail: &json!({}),
            }),
        )
        .await?;
    if !deleted {
        return Err(KbsError::ResourceNotFound(path));
    }
    Ok(StatusCode::OK.into_response())
}

/// `{"policy": base64(text)}` (standard or URL-safe alphabet) → the text.
pub(super) fn policy_text(body: &[u8]) -> Result<String, KbsError> {
    let v: Value = json_body(body, "policy request")?;
    let b64 = v
        .get("policy")
        .and_then(Value::as_str)
        .ok_or_else(|| KbsError::InvalidRequest("no policy field".into()))?;
    let raw = URL_SAFE_NO_PAD
        .decode(b64.trim_end_matches('='))
        .or_else(|_| STANDARD.decode(b64))
        .map_err(|_| KbsError::InvalidRequest("policy is not base64".into()))?;
    String::from_utf8(raw).map_err(|_| KbsError::InvalidRequest("policy is not UTF-8".into()))
}

async fn set_policy(
    kbs: &Kbs,
    admin: &Admin,
    repository: Option<&str>,
    scope: String,
    body: &[u8],
) -> Result<Response, KbsError> {
    admin.may(repository)?;
    let actor = admin.actor();
    let text = policy_text(body)?;
    // Refuse what does not compile, or (below the global scope) what the allow-list refuses,
    // before storing it.
    kbs.release.program_off_thread(&scope, &text).await?;
    let digest = hex::encode(aws_lc_rs::digest::digest(
        &aws_lc_rs::digest::SHA256,
        text.as_bytes(),
    ));
    kbs.store
        .admin_change(
            AdminChange::PutPolicy {
                scope: &scope,
                body: &text,
            },
            Some(AuditRow {
                actor: &actor,
                action: "policy.put",
                subject: &scope,
                detail: &json!({"sha256": digest}),
            }),
        )
        .await?;
    kbs.forget_release_policies();
    Ok(StatusCode::OK.into_response())
}

async fn get_policy(
    kbs: &Kbs,
    admin: &Admin,
    repository: Option<&str>,
    scope: &str,
) -> Result<Response, KbsError> {
    admin.may(repository)?;
    let text = match kbs.store.policy(scope).await? {
        Some(t) => t,
        None if scope == GLOBAL_SCOPE => cgx_policies::RELEASE_POLICY.to_string(),
        None => return Err(KbsError::NotFound(format!("no policy at {scope}"))),
    };
    Ok(Json(json!({"policy": URL_SAFE_NO_PAD.encode(text)})).into_response())
}

async fn set_global_policy(
    State(kbs): Shared,
    admin: Admin,
    body: Bytes,
) -> Result<Response, KbsError> {
    set_policy(&kbs, &admin, None, GLOBAL_SCOPE.into(), &body).await
}

async fn get_global_policy(State(kbs): Shared, admin: Admin) -> Result<Response, KbsError> {
    get_policy(&kbs, &admin, None, GLOBAL_SCOPE).await
}

async fn set_repo_policy(
    State(kbs): Shared,
    admin: Admin,
    Path(repo): Path<String>,
    body: Bytes,
) -> Result<Response, KbsError> {
    resource_path(&repo, "x", "x")?;
    set_policy(&kbs, &admin, Some(&repo), format!("resource:{repo}"), &body).await
}

async fn get_repo_policy(
    State(kbs): Shared,
    admin: Admin,
    Path(repo): Path<String>,
) -> Result<Response, KbsError> {
    resource_path(&repo, "x", "x")?;
    get_policy(&kbs, &admin, Some(&repo), &format!("resource:{repo}")).await
}

async fn set_resource_policy(
    State(kbs): Shared,
    admin: Admin,
    Path((repo, kind, tag)): Path<(String, String, String)>,
    body: Bytes,
) -> Result<Response, KbsError> {
    let path = resource_path(&repo, &kind, &tag)?;
    set_policy(&kbs, &admin, Some(&repo), format!("resource:{path}"), &body).await
}

async fn get_resource_policy(
    State(kbs): Shared,
    admin: Admin,
    Path((repo, kind, tag)): Path<(String, String, String)>,
) -> Result<Response, KbsError> {
    let path = resource_path(&repo, &kind, &tag)?;
    get_policy(&kbs, &admin, Some(&repo), &format!("resource:{path}")).await
}

/// Store the appraisal policy, the reference values or the sample reference values (`scope`)
/// with its audit row (naming the sample values a merge set), then put the engine compiled from
/// them in force.
async fn put_appraisal(
    kbs: &Kbs,
    actor: &str,
    scope: &'static str,
    text: &str,
    engine: PolicyEngine,
    names: Option<&[String]>,
) -> Result<Response, KbsError> {
    let action = match scope {
        SCOPE_ATTESTATION => "attestation-policy.put",
        SCOPE_SAMPLE_REFERENCE_VALUES => "reference-value.put",
        _ => "reference-values.put",
    };
    let mut detail = json!({"policy_id": engine.id()});
    if let Some(names) = names {
        detail["names"] = json!(names);
    }
    kbs.store
        .admin_change(
            AdminChange::PutPolicy { scope, body: text },
            Some(AuditRow {
                actor,
                action,
                subject: scope,
                detail: &detail,
            }),
        )
        .await?;
    kbs.attester.set_engine(engine);
    Ok(StatusCode::OK.into_response())
}

pub(super) const SCOPE_ATTESTATION: &str = "attestation";
pub(super) const SCOPE_REFERENCE_VALUES: &str = "reference-values";
/// The sample reference values (`/kbs/v0/reference-value`), kept apart from the rest.
pub(super) const SCOPE_SAMPLE_REFERENCE_VALUES: &str = "reference-values.sample";

/// Bound on the sample reference values, so merges cannot grow them without end.
const SAMPLE_REFERENCE_VALUES_MAX: usize = 64 << 10;

async fn set_attestation_policy(
    State(kbs): Shared,
    admin: Admin,
    body: Bytes,
) -> Result<Response, KbsError> {
    admin.may(None)?;
    let actor = admin.actor();
    let v: Value = json_body(&body, "attestation policy")?;
    if let Some(kind) = v.get("type").and_then(Value::as_str)
        && !kind.eq_ignore_ascii_case("rego")
    {
        return Err(KbsError::InvalidRequest(format!(
            "policy type {kind}: only rego"
        )));
    }
    let text = policy_text(&body)?;
    let engine = super::appraisal_engine(&text, &kbs.reference_values().await?)?;
    put_appraisal(&kbs, &actor, SCOPE_ATTESTATION, &text, engine, None).await
}

async fn get_attestation_policy(State(kbs): Shared, admin: Admin) -> Result<Response, KbsError> {
    admin.may(None)?;
    let text = kbs.appraisal_policy().await?;
    Ok(Json(json!({"type": "rego", "policy": URL_SAFE_NO_PAD.encode(text)})).into_response())
}

async fn set_reference_values(
    State(kbs): Shared,
    admin: Admin,
    body: Bytes,
) -> Result<Response, KbsError> {
    admin.may(None)?;
    let actor = admin.actor();
    let v: Value = json_body(&body, "reference values")?;
    let text = v.to_string();
    let policy = kbs.appraisal_policy().await?;
    let effective = super::with_sample(&text, kbs.sample_reference_values().await?.as_deref())?;
    let engine = super::appraisal_engine(&policy, &effective)?;
    put_appraisal(&kbs, &actor, SCOPE_REFERENCE_VALUES, &text, engine, None).await
}

async fn get_reference_values(State(kbs): Shared, admin: Admin) -> Result<Response, KbsError> {
    admin.may(None)?;
    let text = kbs.reference_values().await?;
    let v: Value = serde_json::from_str(&text).map_err(|e| KbsError::Internal(e.to_string()))?;
    Ok(Json(v).into_response())
}

/// Trustee's RVPS message (`{"version": "0.1.0", "type", "payload": base64 JSON}`), as
/// kbs-client's `set-sample-reference-value` proxies it through a KBS. Of the RVPS extractors
/// cgx speaks the `sample` one: its payload (`{name: value}`) is merged into the reference
/// values' `sample` section, kept apart from the document `/kbs/v0/reference-values` sets (that
/// document's own `sample` section is replaced by it).
async fn set_reference_value(
    State(kbs): Shared,
    admin: Admin,
    body: Bytes,
) -> Result<Response, KbsError> {
    admin.may(None)?;
    let actor = admin.actor();
    let m: Value = json_body(&body, "reference value message")?;
    let field = |name: &str| {
        m.get(name).and_then(Value::as_str).ok_or_else(|| {
            KbsError::InvalidRequest(format!("reference value message: no {name} string"))
        })
    };
    if field("version")? != "0.1.0" {
        return Err(KbsError::InvalidRequest(
            "reference value message: version is not 0.1.0".into(),
        ));
    }
    let kind = field("type")?;
    if kind != "sample" {
        return Err(KbsError::InvalidRequest(format!(
            "reference value type {kind}: of RVPS messages cgx takes the sample extractor's; \
             set other reference values as JSON at /kbs/v0/reference-values"
        )));
    }
    let payload = field("payload")?;
    let raw = STANDARD
        .decode(payload)
        .or_else(|_| URL_SAFE_NO_PAD.decode(payload.trim_end_matches('=')))
        .map_err(|_| KbsError::InvalidRequest("reference value payload is not base64".into()))?;
    let values: serde_json::Map<String, Value> = json_body(&raw, "reference value payload")?;
    if values.keys().any(|k| k.is_empty() || k.len() > 128) {
        return Err(KbsError::InvalidRequest(
            "reference value names are 1 to 128 characters".into(),
        ));
    }
    // Only the sample section is read and written: a concurrent change to the other
    // reference values cannot be overwritten by a merge.
    let mut sample: serde_json::Map<String, Value> = match kbs.sample_reference_values().await? {
        Some(text) => serde_json::from_str(&text).map_err(|e| KbsError::Internal(e.to_string()))?,
        None => Default::default(),
    };
    let names: Vec<String> = values.keys().cloned().collect();
    sample.extend(values);
    let text = Value::Object(sample).to_string();
    if text.len() > SAMPLE_REFERENCE_VALUES_MAX {
        return Err(KbsError::InvalidRequest(format!(
            "sample reference values would exceed {SAMPLE_REFERENCE_VALUES_MAX} bytes"
        )));
    }
    let effective = super::with_sample(&kbs.stored_reference_values().await?, Some(&text))?;
    let engine = super::appraisal_engine(&kbs.appraisal_policy().await?, &effective)?;
    put_appraisal(
        &kbs,
        &actor,
        SCOPE_SAMPLE_REFERENCE_VALUES,
        &text,
        engine,
        Some(&names),
    )
    .await
}

/// A sample reference value by name (kbs-client's `get-reference-value --id`).
async fn get_reference_value(
    State(kbs): Shared,
    admin: Admin,
    Path(id): Path<String>,
) -> Result<Response, KbsError> {
    admin.may(None)?;
    let sample: Value = match kbs.sample_reference_values().await? {
        Some(text) => serde_json::from_str(&text).map_err(|e| KbsError::Internal(e.to_string()))?,
        None => Value::Null,
    };
    match sample.get(&id) {
        Some(v) => Ok(Json(v.clone()).into_response()),
        None => Err(KbsError::NotFound(format!("reference value {id}"))),
    }
}

async fn audit(
    State(kbs): Shared,
    admin: Admin,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, KbsError> {
    admin.may(None)?;
    let num = |k: &str, d: i64| -> Result<i64, KbsError> {
        q.get(k).map_or(Ok(d), |v| {
            v.parse()
                .map_err(|_| KbsError::InvalidRequest(format!("{k} is not a number")))
        })
    };
    let events = kbs
        .store
        .audit_events(num("after", 0)?, num("limit", 1000)?.clamp(1, 10_000))
        .await?;
    Ok(Json(events).into_response())
}

// ------------------------------------------------------------------------ public

async fn jwks(State(kbs): Shared) -> Response {
    Json(kbs.attester.signer().jwks()).into_response()
}

async fn healthz(State(kbs): Shared) -> Response {
    match kbs.store.schema_version().await {
        Ok(v) => Json(json!({"status": "ok", "schema_version": v})).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn not_found() -> Response {
    KbsError::NotFound("no such endpoint".into()).into_response()
}
