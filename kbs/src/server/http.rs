//! The router and its handlers. Handlers read the request (cookie, bearer, path, body),
//! validate and delegate: the RCAR handshake to `rcar.rs` ([`Kbs::challenge`],
//! [`Kbs::attest`]), a resource's release to `release.rs` ([`Kbs::release`]), persistence to
//! [`Store`](super::store::Store); they write the answer.
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
use axum::{Json, Router};
use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use cgx_policies::PolicyEngine;
use cgx_protocol::audit::AuditEvent;
use cgx_protocol::kbs_types::{Challenge, Request};
use cgx_service::auth::Admin;
use cgx_service::error::Problem;
use cgx_service::limits::limited_route as limited;
use serde_json::{Value, json};
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::Kbs;
use super::error::KbsError;
use super::openapi::{
    ApiDoc, AttestResponse, AttestationPolicyMessage, Health, Jwe, PolicyMessage, RcarAttestation,
    RcarChallenge, RcarRequest, RvpsMessage,
};
use super::release::{Credential, GLOBAL_SCOPE};
use super::store::{AdminChange, NewEvent};

pub const PROTOCOL_VERSION: &str = "0.4.0";
pub const SESSION_COOKIE: &str = "kbs-session-id";
const OPENAPI_PATH: &str = "/kbs/v0/openapi.json";

type Shared = State<Arc<Kbs>>;

/// Body limits per route, enforced before any extractor runs (authentication included).
const SMALL_BODY: usize = 4 << 10;
const EVIDENCE_BODY: usize = 1 << 20;
const POLICY_BODY: usize = 1 << 20;
const RESOURCE_BODY: usize = 16 << 20;

/// The routes and the OpenAPI document, made together: each route is added with its handler's
/// `#[utoipa::path]`, so the router serves no route the document does not describe.
pub(super) fn router(kbs: Arc<Kbs>) -> Result<Router, KbsError> {
    let (api, doc) = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(limited(routes!(auth), SMALL_BODY))
        .routes(limited(routes!(attest), EVIDENCE_BODY))
        .routes(limited(routes!(get_resource), SMALL_BODY))
        .routes(limited(routes!(delete_resource), SMALL_BODY))
        .routes(limited(routes!(put_resource), RESOURCE_BODY))
        .routes(limited(
            routes!(set_global_policy, get_global_policy),
            POLICY_BODY,
        ))
        .routes(limited(
            routes!(set_repo_policy, get_repo_policy),
            POLICY_BODY,
        ))
        .routes(limited(
            routes!(set_resource_policy, get_resource_policy),
            POLICY_BODY,
        ))
        .routes(limited(
            routes!(set_attestation_policy, get_attestation_policy),
            POLICY_BODY,
        ))
        .routes(limited(
            routes!(set_reference_values, get_reference_values),
            POLICY_BODY,
        ))
        .routes(limited(routes!(set_reference_value), SMALL_BODY))
        .routes(routes!(get_reference_value))
        .routes(routes!(audit))
        .routes(routes!(jwks))
        .routes(routes!(healthz))
        .split_for_parts();
    Ok(
        cgx_service::ops::routes(api, OPENAPI_PATH, doc, kbs.metrics.clone())
            .map_err(|e| KbsError::Internal(format!("OpenAPI document: {e}")))?
            // The log, laid out as C2SP tlog-tiles serves it (outside the API's JSON document).
            .route("/kbs/v0/log/checkpoint", axum::routing::get(log_checkpoint))
            .route(
                "/kbs/v0/log/tile/entries/{*path}",
                axum::routing::get(log_entries),
            )
            .route("/kbs/v0/log/tile/{*path}", axum::routing::get(log_tile))
            .route_layer(cgx_service::metrics::TrackLayer::new(kbs.metrics.clone()))
            .fallback(not_found)
            .layer(DefaultBodyLimit::max(16 << 20))
            .with_state(kbs),
    )
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

/// Who asks for a resource: the session cookie first, else a bearer EAR.
fn credential(headers: &HeaderMap) -> Credential {
    match cookie(headers) {
        Some(id) => Credential::Session(id),
        None => match bearer(headers) {
            Some(token) => Credential::Ear(token.to_string()),
            None => Credential::None,
        },
    }
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

/// Start an RCAR handshake: a challenge nonce, and the `kbs-session-id` cookie.
#[utoipa::path(post, path = cgx_protocol::kbs::rcar::AUTH_PATH, tag = "protocol",
    request_body = RcarRequest,
    responses(
        (status = 200, description = "the challenge; Set-Cookie: kbs-session-id", body = RcarChallenge),
        (status = 400, response = Problem),
    ))]
async fn auth(State(kbs): Shared, body: Bytes) -> Result<Response, KbsError> {
    let req: Request = json_body(&body, "auth request")?;
    let (id, nonce) = kbs.challenge(&req)?;
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

/// Answer the session's challenge with evidence bound to its nonce and TEE key: an EAR.
#[utoipa::path(post, path = cgx_protocol::kbs::rcar::ATTEST_PATH, tag = "protocol",
    security(("session" = [])),
    request_body = RcarAttestation,
    responses(
        (status = 200, description = "attested: the signed EAR", body = AttestResponse),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 413, response = Problem),
        (status = 429, response = Problem),
        (status = 503, response = Problem),
    ))]
async fn attest(
    State(kbs): Shared,
    ConnectInfo(client): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, KbsError> {
    let r = match cookie(&headers) {
        Some(id) => kbs
            .attest(&id, client.ip(), &body)
            .await
            .map(|token| Json(AttestResponse { token }).into_response()),
        None => Err(KbsError::UnAuthenticated("no kbs-session-id cookie".into())),
    };
    kbs.metrics.event(
        "attestation",
        match &r {
            Ok(_) => "token_issued",
            Err(_) => "refused",
        },
    );
    r
}

/// A resource, encrypted to the attested session's TEE key: an affirming appraisal, every
/// release policy that applies, and a broker lease where the resource needs one.
#[utoipa::path(get, path = "/kbs/v0/resource/{repo}/{kind}/{tag}", tag = "protocol",
    security(("session" = []), ("ear" = [])),
    params(("repo" = String, Path), ("kind" = String, Path, description = "the resource type"), ("tag" = String, Path), ("lease" = Option<String>, Query, description = "a broker lease token naming this resource and the session's TEE key")),
    responses(
        (status = 200, description = "the resource as a JWE", body = Jwe),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 404, response = Problem),
        (status = 500, response = Problem),
        (status = 503, response = Problem),
    ))]
async fn get_resource(
    State(kbs): Shared,
    Path((repo, kind, tag)): Path<(String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, KbsError> {
    let r = kbs
        .release(&credential(&headers), &repo, &kind, &tag, &query)
        .await
        .map(|jwe| Json(jwe).into_response());
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

// ------------------------------------------------------------------------ admin

/// Store a resource (its repository's administrators).
#[utoipa::path(post, path = "/kbs/v0/resource/{repo}/{kind}/{tag}", tag = "admin",
    security(("adminJwt" = [])),
    params(("repo" = String, Path), ("kind" = String, Path, description = "the resource type"), ("tag" = String, Path), ("lease" = Option<String>, Query, description = "`required`: released only with a broker lease; `optional` (default)")),
    request_body(content = String, description = "the resource's bytes", content_type = "application/octet-stream"),
    responses(
        (status = 200, description = "stored (sealed under the KEK)"),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 413, response = Problem),
    ))]
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
            Some(NewEvent {
                actor: &actor,
                action: "resource.put",
                subject: &path,
                detail: &json!({"bytes": body.len(), "requires_lease": requires_lease}),
            }),
        )
        .await?;
    Ok(StatusCode::OK.into_response())
}

/// Delete a resource (its repository's administrators).
#[utoipa::path(delete, path = "/kbs/v0/resource/{repo}/{kind}/{tag}", tag = "admin",
    security(("adminJwt" = [])),
    params(("repo" = String, Path), ("kind" = String, Path, description = "the resource type"), ("tag" = String, Path)),
    responses(
        (status = 200, description = "deleted"),
        (status = 401, response = Problem),
        (status = 404, response = Problem),
    ))]
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
            Some(NewEvent {
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
            Some(NewEvent {
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
    Ok(Json(PolicyMessage {
        policy: URL_SAFE_NO_PAD.encode(text),
    })
    .into_response())
}

/// Set the global release policy (unscoped administrators): trusted, evaluated inline.
#[utoipa::path(post, path = "/kbs/v0/resource-policy", tag = "admin", security(("adminJwt" = [])),
    request_body = PolicyMessage,
    responses((status = 200, description = "stored"),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 413, response = Problem),))]
async fn set_global_policy(
    State(kbs): Shared,
    admin: Admin,
    body: Bytes,
) -> Result<Response, KbsError> {
    set_policy(&kbs, &admin, None, GLOBAL_SCOPE.into(), &body).await
}

/// The global release policy (the shipped one until set).
#[utoipa::path(get, path = "/kbs/v0/resource-policy", tag = "admin", security(("adminJwt" = [])),
    responses((status = 200, description = "the policy", body = PolicyMessage),
        (status = 401, response = Problem),))]
async fn get_global_policy(State(kbs): Shared, admin: Admin) -> Result<Response, KbsError> {
    get_policy(&kbs, &admin, None, GLOBAL_SCOPE).await
}

/// Set a repository's release policy (its administrators): untrusted, sandboxed.
#[utoipa::path(post, path = "/kbs/v0/resource-policy/{repo}", tag = "admin", security(("adminJwt" = [])),
    params(("repo" = String, Path)),
    request_body = PolicyMessage,
    responses((status = 200, description = "stored"),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 404, response = Problem),
        (status = 413, response = Problem),))]
async fn set_repo_policy(
    State(kbs): Shared,
    admin: Admin,
    Path(repo): Path<String>,
    body: Bytes,
) -> Result<Response, KbsError> {
    resource_path(&repo, "x", "x")?;
    set_policy(&kbs, &admin, Some(&repo), format!("resource:{repo}"), &body).await
}

/// A repository's release policy.
#[utoipa::path(get, path = "/kbs/v0/resource-policy/{repo}", tag = "admin", security(("adminJwt" = [])),
    params(("repo" = String, Path)),
    responses((status = 200, description = "the policy", body = PolicyMessage),
        (status = 401, response = Problem),
        (status = 404, response = Problem),))]
async fn get_repo_policy(
    State(kbs): Shared,
    admin: Admin,
    Path(repo): Path<String>,
) -> Result<Response, KbsError> {
    resource_path(&repo, "x", "x")?;
    get_policy(&kbs, &admin, Some(&repo), &format!("resource:{repo}")).await
}

/// Set one resource's release policy (its repository's administrators): untrusted, sandboxed.
#[utoipa::path(post, path = "/kbs/v0/resource-policy/{repo}/{kind}/{tag}", tag = "admin",
    security(("adminJwt" = [])),
    params(("repo" = String, Path), ("kind" = String, Path, description = "the resource type"), ("tag" = String, Path)),
    request_body = PolicyMessage,
    responses((status = 200, description = "stored"),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 404, response = Problem),
        (status = 413, response = Problem),))]
async fn set_resource_policy(
    State(kbs): Shared,
    admin: Admin,
    Path((repo, kind, tag)): Path<(String, String, String)>,
    body: Bytes,
) -> Result<Response, KbsError> {
    let path = resource_path(&repo, &kind, &tag)?;
    set_policy(&kbs, &admin, Some(&repo), format!("resource:{path}"), &body).await
}

/// One resource's release policy.
#[utoipa::path(get, path = "/kbs/v0/resource-policy/{repo}/{kind}/{tag}", tag = "admin",
    security(("adminJwt" = [])),
    params(("repo" = String, Path), ("kind" = String, Path, description = "the resource type"), ("tag" = String, Path)),
    responses((status = 200, description = "the policy", body = PolicyMessage),
        (status = 401, response = Problem),
        (status = 404, response = Problem),))]
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
            Some(NewEvent {
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

/// Set the appraisal policy (Rego; unscoped administrators).
#[utoipa::path(post, path = "/kbs/v0/attestation-policy", tag = "admin", security(("adminJwt" = [])),
    request_body = AttestationPolicyMessage,
    responses((status = 200, description = "in force"),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 413, response = Problem),))]
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

/// The appraisal policy in force.
#[utoipa::path(get, path = "/kbs/v0/attestation-policy", tag = "admin", security(("adminJwt" = [])),
    responses((status = 200, description = "the policy", body = AttestationPolicyMessage),
        (status = 401, response = Problem),))]
async fn get_attestation_policy(State(kbs): Shared, admin: Admin) -> Result<Response, KbsError> {
    admin.may(None)?;
    let text = kbs.appraisal_policy().await?;
    Ok(Json(AttestationPolicyMessage {
        kind: "rego".into(),
        policy: URL_SAFE_NO_PAD.encode(text),
    })
    .into_response())
}

/// Set the reference values appraisal uses (the document `cgx measure … --reference-values`
/// writes; unscoped administrators).
#[utoipa::path(post, path = "/kbs/v0/reference-values", tag = "admin", security(("adminJwt" = [])),
    request_body(content = Object, description = "reference values", content_type = "application/json"),
    responses((status = 200, description = "in force"),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 413, response = Problem),))]
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

/// The reference values in force.
#[utoipa::path(get, path = "/kbs/v0/reference-values", tag = "admin", security(("adminJwt" = [])),
    responses((status = 200, description = "the reference values", body = Object),
        (status = 401, response = Problem),))]
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
#[utoipa::path(post, path = "/kbs/v0/reference-value", tag = "admin", security(("adminJwt" = [])),
    request_body = RvpsMessage,
    responses((status = 200, description = "merged, in force"),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 413, response = Problem),))]
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
#[utoipa::path(get, path = "/kbs/v0/reference-value/{id}", tag = "admin", security(("adminJwt" = [])),
    params(("id" = String, Path, description = "the value's name")),
    responses((status = 200, description = "the value", body = Object),
        (status = 401, response = Problem),
        (status = 404, response = Problem),))]
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

/// Audit events (admin changes and releases), oldest first (unscoped administrators).
#[utoipa::path(get, path = "/kbs/v0/audit", tag = "admin", security(("adminJwt" = [])),
    params(
        ("after" = Option<i64>, Query, description = "events after this seq (0)"),
        ("limit" = Option<i64>, Query, description = "at most this many (1000; 1 to 10000)"),
    ),
    responses((status = 200, description = "the events", body = Vec<AuditEvent>),
        (status = 400, response = Problem),
        (status = 401, response = Problem),))]
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

async fn log_checkpoint(State(kbs): Shared) -> Result<Response, KbsError> {
    Ok(cgx_service::tlog::checkpoint_response(
        kbs.log_checkpoint().await?,
    ))
}

async fn log_tile(State(kbs): Shared, Path(path): Path<String>) -> Result<Response, KbsError> {
    let path = format!("tile/{path}");
    Ok(cgx_service::tlog::tile_response(
        kbs.log_tile(&path, false).await?,
        &path,
    ))
}

async fn log_entries(
    State(kbs): Shared,
    admin: Admin,
    Path(path): Path<String>,
) -> Result<Response, KbsError> {
    // Entries name tenants' resources: unscoped administrators (auditors), and a key scoped
    // `:log-reader` (the broker's mirror of releases by lease), only.
    if !admin.scopes().iter().any(|s| s == super::LOG_READER_SCOPE) {
        admin.may(None)?;
    }
    let path = format!("tile/entries/{path}");
    Ok(cgx_service::tlog::tile_response(
        kbs.log_tile(&path, true).await?,
        &path,
    ))
}

// ------------------------------------------------------------------------ public

/// The EAR signing key (JWKS), to verify the tokens /attest issues.
#[utoipa::path(get, path = "/kbs/v0/jwks", tag = "operations",
    responses((status = 200, description = "JWKS", body = Object)))]
async fn jwks(State(kbs): Shared) -> Response {
    Json(kbs.attester.signer().jwks()).into_response()
}

/// Liveness: the database answers with its schema version.
#[utoipa::path(get, path = "/healthz", tag = "operations",
    responses((status = 200, description = "serving", body = Health),
        (status = 500, response = Problem),))]
async fn healthz(State(kbs): Shared) -> Response {
    match kbs.store.schema_version().await {
        Ok(schema_version) => Json(Health {
            status: "ok",
            schema_version,
        })
        .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn not_found() -> Response {
    KbsError::NotFound("no such endpoint".into()).into_response()
}
