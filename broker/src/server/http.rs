//! Routes and handlers: validate, authenticate (API tokens through `cgx-service`'s extractor,
//! nodes through their attested key), delegate to [`Broker`]. Body limits per route apply
//! before any extractor runs, authentication included.
//!
//! | route | who | what |
//! |---|---|---|
//! | `POST /v1/nodes/nonce` | operator | a single-use registration nonce |
//! | `POST /v1/nodes` | operator | register or re-attest a node on composite evidence |
//! | `POST /v1/nodes/{id}/heartbeat` | the node (bearer: heartbeat JWS) | liveness; renewed leases |
//! | `GET /v1/nodes`, `GET /v1/nodes/{id}` | operator (own), auditor | registry, why (not) placeable |
//! | `POST /v1/nodes/{id}/reattest` | operator (own), auditor | ask for re-attestation now |
//! | `POST /v1/jobs` | tenant | submit |
//! | `GET /v1/jobs`, `GET /v1/jobs/{id}` | tenant (own), auditor | state, events |
//! | `POST /v1/jobs/{id}/cancel` | tenant | cancel; the lease ends |
//! | `POST /v1/reference-values` | admin (`reference-values`, `*`) | the reference values appraisal uses (the file `cgx measure … --reference-values` writes), `If-Match` the version replaced |
//! | `GET /v1/reference-values` | admin, auditor | those in force, with their version |
//! | `GET /v1/admin-events` | auditor | who changed what setting, when |
//! | `GET /openapi.json`, `/metrics`, `/healthz` | anyone | |

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use cgx_service::auth::Admin;
use serde_json::json;

use super::{Broker, BrokerError};

type Shared = State<Arc<Broker>>;

const OPENAPI: &str = include_str!("openapi.json");

/// Bodies: a registration carries a CPU report, up to 64 GPU reports with their chains, and
/// perhaps Intel collateral; everything else is small.
const REGISTRATION_BODY: usize = 2 << 20;
const JOB_BODY: usize = 96 << 10;
const SMALL_BODY: usize = 4 << 10;
/// Reference values name images, measurements and GPU RIM values: 1 MiB is ample.
const REFERENCE_VALUES_BODY: usize = 1 << 20;

pub(super) fn router(broker: Arc<Broker>) -> Router {
    use cgx_protocol::broker::routes;
    use cgx_service::limits::limited;
    let api = Router::new()
        .route(routes::NONCE, limited(post(nonce), SMALL_BODY))
        .route(
            routes::NODES,
            limited(post(register), REGISTRATION_BODY).merge(limited(get(nodes), SMALL_BODY)),
        )
        .route(routes::NODE, limited(get(node), SMALL_BODY))
        .route(routes::HEARTBEAT, limited(post(heartbeat), SMALL_BODY))
        .route(routes::REATTEST, limited(post(reattest), SMALL_BODY))
        .route(
            routes::JOBS,
            limited(post(submit), JOB_BODY).merge(limited(get(jobs), SMALL_BODY)),
        )
        .route(routes::JOB, limited(get(job), SMALL_BODY))
        .route(routes::CANCEL, limited(post(cancel), SMALL_BODY))
        .route(
            routes::REFERENCE_VALUES,
            limited(post(put_reference_values), REFERENCE_VALUES_BODY)
                .merge(limited(get(reference_values), SMALL_BODY)),
        )
        .route(routes::ADMIN_EVENTS, limited(get(admin_events), SMALL_BODY));
    cgx_service::ops::routes(api, routes::OPENAPI, OPENAPI, broker.metrics.clone())
        .route(routes::HEALTHZ, get(healthz))
        .route_layer(cgx_service::metrics::TrackLayer::new(
            broker.metrics.clone(),
        ))
        .fallback(not_found)
        .with_state(broker)
}

fn json_body<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> Result<T, BrokerError> {
    serde_json::from_slice(body).map_err(|e| {
        let e = e.to_string();
        // A client from before integer money: say what to send, not just "unknown field".
        let e = cgx_protocol::money::retired_field_refusal(&e).unwrap_or(e);
        BrokerError::BadRequest(format!("{what}: {e}"))
    })
}

/// Path ids: short and printable (they are looked up, never interpolated).
fn check_id(id: &str) -> Result<(), BrokerError> {
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(BrokerError::BadRequest("malformed id".into()));
    }
    Ok(())
}

async fn nonce(State(b): Shared, admin: Admin) -> Result<Response, BrokerError> {
    // Only operators (or `*`) register nodes: nonces are not handed to anyone else.
    if !admin
        .scopes()
        .iter()
        .any(|s| s == "*" || s.starts_with("operator:"))
    {
        return Err(BrokerError::Forbidden(
            "nonces are for operators registering nodes (scope operator:<name>)".into(),
        ));
    }
    Ok(Json(b.nonce().await?).into_response())
}

async fn register(State(b): Shared, admin: Admin, body: Bytes) -> Result<Response, BrokerError> {
    let reg = json_body(&body, "registration")?;
    let out = b.register(&admin, reg).await;
    b.metrics.event(
        "registration",
        match &out {
            Ok(_) => "ok",
            Err(_) => "refused",
        },
    );
    Ok(Json(out?).into_response())
}

async fn heartbeat(
    State(b): Shared,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response, BrokerError> {
    check_id(&id)?;
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| BrokerError::Heartbeat("no bearer heartbeat token".into()))?;
    Ok(Json(b.heartbeat(&id, token.trim()).await?).into_response())
}

/// The version a put replaces, as `If-Match: "N"` (or `N`): required, so an admin's edit of
/// version N cannot silently undo a put that came after N.
fn replaces(headers: &HeaderMap) -> Result<i64, BrokerError> {
    headers
        .get(header::IF_MATCH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().trim_matches('"').parse::<i64>().ok())
        .filter(|v| *v >= 0)
        .ok_or_else(|| {
            BrokerError::BadRequest(
                "If-Match: the version these values replace is required (GET \
                 /v1/reference-values; 0 for the configuration's)"
                    .into(),
            )
        })
}

async fn put_reference_values(
    State(b): Shared,
    admin: Admin,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, BrokerError> {
    let replaces = replaces(&headers)?;
    Ok(Json(b.put_reference_values(&admin, &body, replaces).await?).into_response())
}

async fn reference_values(State(b): Shared, admin: Admin) -> Result<Response, BrokerError> {
    Ok(Json(b.reference_values(&admin)?).into_response())
}

async fn admin_events(State(b): Shared, admin: Admin) -> Result<Response, BrokerError> {
    Ok(Json(b.admin_events(&admin).await?).into_response())
}

async fn nodes(State(b): Shared, admin: Admin) -> Result<Response, BrokerError> {
    Ok(Json(json!({"nodes": b.nodes(&admin)})).into_response())
}

async fn node(
    State(b): Shared,
    admin: Admin,
    Path(id): Path<String>,
) -> Result<Response, BrokerError> {
    check_id(&id)?;
    Ok(Json(b.node_for(&admin, &id)?).into_response())
}

async fn reattest(
    State(b): Shared,
    admin: Admin,
    Path(id): Path<String>,
) -> Result<Response, BrokerError> {
    check_id(&id)?;
    Ok(Json(b.ask_reattest(&admin, &id).await?).into_response())
}

async fn submit(State(b): Shared, admin: Admin, body: Bytes) -> Result<Response, BrokerError> {
    let spec = json_body(&body, "job")?;
    let view = b.submit(&admin, spec).await?;
    Ok((axum::http::StatusCode::CREATED, Json(view)).into_response())
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct JobsQuery {
    tenant: Option<String>,
}

async fn jobs(
    State(b): Shared,
    admin: Admin,
    Query(q): Query<JobsQuery>,
) -> Result<Response, BrokerError> {
    Ok(Json(json!({"jobs": b.jobs(&admin, q.tenant.as_deref()).await?})).into_response())
}

async fn job(
    State(b): Shared,
    admin: Admin,
    Path(id): Path<String>,
) -> Result<Response, BrokerError> {
    check_id(&id)?;
    Ok(Json(b.job_for(&admin, &id).await?).into_response())
}

async fn cancel(
    State(b): Shared,
    admin: Admin,
    Path(id): Path<String>,
) -> Result<Response, BrokerError> {
    check_id(&id)?;
    Ok(Json(b.cancel(&admin, &id).await?).into_response())
}

async fn healthz(State(b): Shared) -> Response {
    let nodes = b.index.lock().map(|i| i.len()).unwrap_or(0);
    Json(json!({"status": "ok", "nodes": nodes})).into_response()
}

async fn not_found() -> Response {
    BrokerError::NotFound("no such endpoint".into()).into_response()
}
