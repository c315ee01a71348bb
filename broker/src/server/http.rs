//! Routes and handlers: validate, authenticate (API tokens through `cgx-service`'s extractor,
//! nodes through their attested key), delegate to [`Broker`]. Body limits per route apply
//! before any extractor runs, authentication included.
//!
//! | route | who | what |
//! |---|---|---|
//! | `POST /v1/nodes/nonce` | operator | a single-use registration nonce |
//! | `POST /v1/nodes` | operator | register or re-attest a node on composite evidence |
//! | `POST /v1/nodes/{id}/heartbeat` | the node (bearer: heartbeat JWS) | liveness; renewed leases |
//! | `POST /v1/nodes/{id}/reports` | the node (body: workload report JWS) | the workload started, completed or failed: the job follows |
//! | `POST /v1/nodes/{id}/metering` | the node (body: metering record JWS) | a lease's next window, accepted once |
//! | `POST /v1/nodes/{id}/pow/{challenge}` | the node (body: receipt JWS) | a proof-of-work commitment (the root); answered with the opening |
//! | `POST /v1/nodes/{id}/pow/{challenge}/proof` | the node (body: receipt JWS + proof) | the opened rows, judged off the request path |
//! | `GET /v1/nodes`, `GET /v1/nodes/{id}` | operator (own), auditor | registry, why (not) placeable |
//! | `POST /v1/nodes/{id}/reattest` | operator (own), auditor | ask for re-attestation now |
//! | `POST /v1/jobs` | tenant | submit |
//! | `GET /v1/jobs`, `GET /v1/jobs/{id}` | tenant (own), auditor | state, events |
//! | `POST /v1/jobs/{id}/cancel` | tenant | cancel; the lease ends |
//! | `POST /v1/reference-values` | admin (`reference-values`, `*`) | the reference values appraisal uses (the file `cgx measure … --reference-values` writes), `If-Match` the version replaced |
//! | `GET /v1/reference-values` | admin, auditor | those in force, with their version |
//! | `GET /v1/admin-events` | auditor | who changed what setting, when |
//! | `POST /v1/ledger/deposits` | admin, payment adapter (`ledger`, `*`) | money in to a tenant's balance or an operator's stake; idempotent by reference; audited |
//! | `GET /v1/ledger/accounts` | auditor | every account's sums |
//! | `GET /v1/statements?tenant=T\|operator=O[&from&to]` | tenant (own), operator (own), auditor | lines, leases and windows, reconciled |
//! | `POST /v1/log/verdicts` | auditor | an auditor's verdict on the log, recorded as a leaf (the console shows the last) |
//! | `POST /v1/quotes` | tenant | the ranked offers a job would get now, and why other nodes would not; nothing placed |
//! | `GET /openapi.json`, `/metrics`, `/healthz` | anyone | |

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use cgx_protocol::audit::AuditEvent;
use cgx_protocol::broker::{
    AuditTrail, CpuEvidence, GpuEvidence, HeartbeatAnswer, JobEvent, JobList, JobSpec, JobState,
    JobView, LeaseGrant, MeteringAnswer, MeteringPost, NodeList, NodeView, NonceResponse, Offer,
    PowAccepted, PowCommit, PowOpening, PowPost, ReferenceValuesPut, ReferenceValuesView,
    Registered, Registration, ReportAnswer, ReportPost, Workload, WorkloadWeights, routes,
};
use cgx_protocol::ledger::{AccountBalance, DepositAnswer, DepositRequest, QuoteAnswer, Statement};
use cgx_protocol::money::Micros;
use cgx_protocol::records::{TeeKind, Tier};
use cgx_service::auth::Admin;
use cgx_service::error::Problem;
use cgx_service::limits::limited_route as limited;
use utoipa::OpenApi;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::{Broker, BrokerError};

type Shared = State<Arc<Broker>>;

/// Bodies: a registration carries a CPU report, up to 64 GPU reports with their chains, and
/// perhaps Intel collateral; everything else is small.
const REGISTRATION_BODY: usize = 2 << 20;
const JOB_BODY: usize = 96 << 10;
const SMALL_BODY: usize = 4 << 10;
/// A proof of the largest size a node accepts (n = 16 384, k up to 132: 8.7 MiB) in base64
/// with its receipt; the handler checks the exact bound of the challenge's size.
const POW_BODY: usize = 12 << 20;
/// Reference values name images, measurements and GPU RIM values: 1 MiB is ample.
const REFERENCE_VALUES_BODY: usize = 1 << 20;

/// The document's frame: what the handlers' `#[utoipa::path]`s and the wire types' schemas do
/// not say themselves.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "cgx broker",
        description = "Node registry on composite evidence, jobs, placement, leases the KBS honours. \
            Refusals are RFC 9457 problem details with a stable code (a malformed path, query \
            or body the framework refuses is answered in plain text). Any route may answer 429 \
            or 503 with Retry-After under load."
    ),
    modifiers(&Security),
    components(
        schemas(
            AuditEvent, CpuEvidence, GpuEvidence, JobEvent, JobState, LeaseGrant, Micros, Offer,
            TeeKind, Tier, Workload, WorkloadWeights
        ),
        responses(Problem)
    ),
    tags(
        (name = "nodes", description = "Registration, heartbeats, the registry"),
        (name = "jobs", description = "Submission, state, cancellation"),
        (name = "settings", description = "Reference values and the audit trail"),
        (name = "ledger", description = "Deposits, accounts, statements, quotes"),
        (name = "operations", description = "Health, metrics, this document"),
    )
)]
struct ApiDoc;

/// The security schemes the operations name.
struct Security;

impl utoipa::Modify for Security {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api",
            SecurityScheme::Http(
                Http::builder()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format(
                        "EdDSA JWS, typ cgx-broker-api+jwt, under a configured API key \
                         (scopes tenant:<name>, operator:<name>, auditor, reference-values, ledger, *)",
                    )
                    .build(),
            ),
        );
        components.add_security_scheme(
            "heartbeat",
            SecurityScheme::Http(
                Http::builder()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format(
                        "EdDSA JWS, typ cgx-heartbeat+jwt, under the node's attested key",
                    )
                    .build(),
            ),
        );
    }
}

/// The routes and the OpenAPI document, made together: each route is added with its handler's
/// `#[utoipa::path]` (method, path, parameters, request and response schemas), so the router
/// serves no route the document does not describe.
pub(super) fn router(broker: Arc<Broker>) -> Result<Router, BrokerError> {
    let (api, doc) = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(limited(routes!(nonce), SMALL_BODY))
        .routes(limited(routes!(register), REGISTRATION_BODY))
        .routes(limited(routes!(nodes), SMALL_BODY))
        .routes(limited(routes!(node), SMALL_BODY))
        .routes(limited(routes!(heartbeat), SMALL_BODY))
        .routes(limited(routes!(report), SMALL_BODY))
        .routes(limited(routes!(metering), SMALL_BODY))
        .routes(limited(routes!(pow_commit), SMALL_BODY))
        .routes(limited(routes!(pow_proof), POW_BODY))
        .routes(limited(routes!(reattest), SMALL_BODY))
        .routes(limited(routes!(submit), JOB_BODY))
        .routes(limited(routes!(jobs), SMALL_BODY))
        .routes(limited(routes!(job), SMALL_BODY))
        .routes(limited(routes!(cancel), SMALL_BODY))
        .routes(limited(
            routes!(put_reference_values),
            REFERENCE_VALUES_BODY,
        ))
        .routes(limited(routes!(reference_values), SMALL_BODY))
        .routes(limited(routes!(admin_events), SMALL_BODY))
        .routes(limited(routes!(deposit), SMALL_BODY))
        .routes(limited(routes!(accounts), SMALL_BODY))
        .routes(limited(routes!(statement), SMALL_BODY))
        .routes(limited(routes!(quote), JOB_BODY))
        .routes(limited(routes!(log_verdict), SMALL_BODY))
        .routes(routes!(healthz))
        .split_for_parts();
    Ok(
        cgx_service::ops::routes(api, routes::OPENAPI, doc, broker.metrics.clone())
            .map_err(|e| BrokerError::Internal(format!("OpenAPI document: {e}")))?
            // The log, laid out as C2SP tlog-tiles serves it (a static layout any reader of
            // the spec knows, not part of this API's JSON document).
            .route(LOG_CHECKPOINT, axum::routing::get(log_checkpoint))
            .route(LOG_ENTRIES, axum::routing::get(log_entries))
            .route(LOG_TILE, axum::routing::get(log_tile))
            .route(LOG_ARCHIVE, axum::routing::get(log_archive))
            // The web console: pages over the same functions, same scoping.
            .merge(super::console::router())
            .route_layer(cgx_service::metrics::TrackLayer::new(
                broker.metrics.clone(),
            ))
            .fallback(not_found)
            .with_state(broker),
    )
}

/// The log's newest checkpoint (a C2SP signed note).
const LOG_CHECKPOINT: &str = "/v1/log/checkpoint";
/// Entry bundles (auditors).
const LOG_ENTRIES: &str = "/v1/log/tile/entries/{*path}";
/// Hash tiles (anyone).
const LOG_TILE: &str = "/v1/log/tile/{*path}";
/// Archived pieces the leaves name by SHA-256 (auditors).
const LOG_ARCHIVE: &str = "/v1/log/archive/{sha256}";

async fn log_archive(
    State(b): Shared,
    admin: Admin,
    Path(sha256): Path<String>,
) -> Result<Response, BrokerError> {
    if !admin.scopes().iter().any(|s| s == "*" || s == "auditor") {
        return Err(BrokerError::Forbidden(
            "archived evidence names nodes and operators: auditors only".into(),
        ));
    }
    if !cgx_protocol::archive::is_address(&sha256) {
        return Err(BrokerError::NotFound("no such piece".into()));
    }
    let (_, doc) = b
        .store
        .archived(&sha256)
        .await?
        .ok_or_else(|| BrokerError::NotFound(format!("archived piece {sha256}")))?;
    Ok((
        [
            (header::CONTENT_TYPE, "application/octet-stream"),
            (header::CACHE_CONTROL, "private, no-store"),
            (header::VARY, "authorization"),
        ],
        doc,
    )
        .into_response())
}

async fn log_checkpoint(State(b): Shared) -> Result<Response, BrokerError> {
    Ok(cgx_service::tlog::checkpoint_response(
        b.log_checkpoint().await?,
    ))
}

async fn log_tile(State(b): Shared, Path(path): Path<String>) -> Result<Response, BrokerError> {
    let path = format!("tile/{path}");
    Ok(cgx_service::tlog::tile_response(
        b.log_tile(&path, false).await?,
        &path,
    ))
}

async fn log_entries(
    State(b): Shared,
    admin: Admin,
    Path(path): Path<String>,
) -> Result<Response, BrokerError> {
    if !admin.scopes().iter().any(|s| s == "*" || s == "auditor") {
        return Err(BrokerError::Forbidden(
            "entry bundles name tenants, nodes and amounts: auditors only".into(),
        ));
    }
    let path = format!("tile/entries/{path}");
    Ok(cgx_service::tlog::tile_response(
        b.log_tile(&path, true).await?,
        &path,
    ))
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
pub(super) fn check_id(id: &str) -> Result<(), BrokerError> {
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(BrokerError::BadRequest("malformed id".into()));
    }
    Ok(())
}

/// A single-use registration nonce (operators).
#[utoipa::path(post, path = routes::NONCE, tag = "nodes", security(("api" = [])),
    responses(
        (status = 200, description = "a nonce, MAC'd by the broker, single use across replicas", body = NonceResponse),
        (status = 401, response = Problem),
        (status = 403, response = Problem),
    ))]
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

/// Register (or re-attest) a node on composite evidence: the offer is checked against what the
/// evidence proves (operators, for their own nodes).
#[utoipa::path(post, path = routes::NODES, tag = "nodes", security(("api" = [])),
    request_body = Registration,
    responses(
        (status = 200, description = "attested: the appraisal and the EAR", body = Registered),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 403, response = Problem),
        (status = 413, response = Problem),
        (status = 422, response = Problem),
    ))]
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

/// A node's signed heartbeat: liveness, and its leases with fresh tokens.
#[utoipa::path(post, path = routes::HEARTBEAT, tag = "nodes", security(("heartbeat" = [])),
    params(("id" = String, Path, description = "the node's id")),
    responses(
        (status = 200, description = "re-attest or not, why not placeable, the node's leases", body = HeartbeatAnswer),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 404, response = Problem),
    ))]
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

/// A node's signed workload report: the job follows it (running, completed, failed with the
/// node's reason), and a finished workload ends its lease.
#[utoipa::path(post, path = routes::REPORTS, tag = "nodes",
    params(("id" = String, Path, description = "the node's id")),
    request_body = ReportPost,
    responses(
        (status = 200, description = "the job's state once the report is applied", body = ReportAnswer),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 404, response = Problem),
        (status = 409, response = Problem),
        (status = 413, response = Problem),
    ))]
async fn report(
    State(b): Shared,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, BrokerError> {
    check_id(&id)?;
    let post: ReportPost = json_body(&body, "workload report")?;
    Ok(Json(b.report(&id, post.report.trim()).await?).into_response())
}

/// A node's signed metering record of one of its leases' windows: accepted once, as the next
/// link of the lease's chain, and stored.
#[utoipa::path(post, path = routes::METERING, tag = "nodes",
    params(("id" = String, Path, description = "the node's id")),
    request_body = MeteringPost,
    responses(
        (status = 200, description = "the record accepted as its lease's next link", body = MeteringAnswer),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 404, response = Problem),
        (status = 409, response = Problem),
        (status = 413, response = Problem),
    ))]
async fn metering(
    State(b): Shared,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, BrokerError> {
    check_id(&id)?;
    let post: MeteringPost = json_body(&body, "metering record")?;
    Ok(Json(b.metering(&id, post.record.trim()).await?).into_response())
}

/// A node's commitment to a proof-of-work challenge: its receipt under the node's attested
/// key, naming the root of its product's rows. Answered with the opening (which cells the
/// proof must open), drawn only now.
#[utoipa::path(post, path = routes::POW, tag = "nodes",
    params(
        ("id" = String, Path, description = "the node's id"),
        ("challenge" = String, Path, description = "the challenge's id"),
    ),
    request_body = PowCommit,
    responses(
        (status = 200, description = "the commitment stored; the opening", body = PowOpening),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 404, response = Problem),
        (status = 409, response = Problem),
        (status = 413, response = Problem),
        (status = 422, response = Problem),
    ))]
async fn pow_commit(
    State(b): Shared,
    Path((id, challenge)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, BrokerError> {
    check_id(&id)?;
    check_id(&challenge)?;
    let post: PowCommit = json_body(&body, "proof-of-work commitment")?;
    Ok(Json(b.pow_commit(&id, &challenge, &post).await?).into_response())
}

/// A node's proof for its commitment: the rows the opening selects, and a receipt naming
/// their digest. Stored for a verdict given off the request path (`cgx node show` tells it).
#[utoipa::path(post, path = routes::POW_PROOF, tag = "nodes",
    params(
        ("id" = String, Path, description = "the node's id"),
        ("challenge" = String, Path, description = "the challenge's id"),
    ),
    request_body = PowPost,
    responses(
        (status = 202, description = "the proof stored for its verdict", body = PowAccepted),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 404, response = Problem),
        (status = 409, response = Problem),
        (status = 413, response = Problem),
        (status = 422, response = Problem),
    ))]
async fn pow_proof(
    State(b): Shared,
    Path((id, challenge)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, BrokerError> {
    check_id(&id)?;
    check_id(&challenge)?;
    let post: PowPost = json_body(&body, "proof-of-work proof")?;
    let a = b.pow_answer(&id, &challenge, &post).await?;
    Ok((axum::http::StatusCode::ACCEPTED, Json(a)).into_response())
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

/// Put the reference values every replica appraises with (the document `cgx measure …
/// --reference-values` writes), in place of the version named in `If-Match`.
#[utoipa::path(post, path = routes::REFERENCE_VALUES, tag = "settings", security(("api" = [])),
    params(("If-Match" = String, Header, description = "the version these values replace (0: the configuration's)")),
    request_body(content = Object, description = "reference values", content_type = "application/json"),
    responses(
        (status = 200, description = "in force: the new version", body = ReferenceValuesPut),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 403, response = Problem),
        (status = 409, response = Problem),
        (status = 413, response = Problem),
    ))]
async fn put_reference_values(
    State(b): Shared,
    admin: Admin,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, BrokerError> {
    let replaces = replaces(&headers)?;
    Ok(Json(b.put_reference_values(&admin, &body, replaces).await?).into_response())
}

/// The reference values this replica appraises with, and their version (admins, auditors).
#[utoipa::path(get, path = routes::REFERENCE_VALUES, tag = "settings", security(("api" = [])),
    responses(
        (status = 200, description = "the values in force", body = ReferenceValuesView),
        (status = 401, response = Problem),
        (status = 403, response = Problem),
    ))]
async fn reference_values(State(b): Shared, admin: Admin) -> Result<Response, BrokerError> {
    Ok(Json(b.reference_values(&admin)?).into_response())
}

/// An auditor's verdict on the log, recorded as an `audit.verdict` leaf (auditors).
#[utoipa::path(post, path = routes::LOG_VERDICTS, tag = "settings", security(("api" = [])),
    request_body = cgx_protocol::broker::LogVerdict,
    responses(
        (status = 200, description = "recorded as an audit.verdict leaf", body = cgx_protocol::broker::VerdictRecorded),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 403, response = Problem),
    ))]
async fn log_verdict(State(b): Shared, admin: Admin, body: Bytes) -> Result<Response, BrokerError> {
    let v: cgx_protocol::broker::LogVerdict = json_body(&body, "verdict")?;
    Ok(Json(b.record_verdict(&admin, v).await?).into_response())
}

/// The audit trail: who changed which setting, when (auditors).
#[utoipa::path(get, path = routes::ADMIN_EVENTS, tag = "settings", security(("api" = [])),
    responses(
        (status = 200, description = "the newest thousand events, oldest first", body = AuditTrail),
        (status = 401, response = Problem),
        (status = 403, response = Problem),
    ))]
async fn admin_events(State(b): Shared, admin: Admin) -> Result<Response, BrokerError> {
    Ok(Json(b.admin_events(&admin).await?).into_response())
}

/// The nodes the caller may see (operators: their own; auditors: all).
#[utoipa::path(get, path = routes::NODES, tag = "nodes", security(("api" = [])),
    responses(
        (status = 200, description = "the registry", body = NodeList),
        (status = 401, response = Problem),
    ))]
async fn nodes(State(b): Shared, admin: Admin) -> Result<Response, BrokerError> {
    Ok(Json(NodeList {
        nodes: b.nodes(&admin),
    })
    .into_response())
}

/// One node, with its claims and why it is (not) placeable.
#[utoipa::path(get, path = routes::NODE, tag = "nodes", security(("api" = [])),
    params(("id" = String, Path, description = "the node's id")),
    responses(
        (status = 200, description = "the node", body = NodeView),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 404, response = Problem),
    ))]
async fn node(
    State(b): Shared,
    admin: Admin,
    Path(id): Path<String>,
) -> Result<Response, BrokerError> {
    check_id(&id)?;
    Ok(Json(b.node_show(&admin, &id).await?).into_response())
}

/// Ask a node to re-attest at its next heartbeat (its operator, auditors).
#[utoipa::path(post, path = routes::REATTEST, tag = "nodes", security(("api" = [])),
    params(("id" = String, Path, description = "the node's id")),
    responses(
        (status = 200, description = "asked", body = NodeView),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 404, response = Problem),
    ))]
async fn reattest(
    State(b): Shared,
    admin: Admin,
    Path(id): Path<String>,
) -> Result<Response, BrokerError> {
    check_id(&id)?;
    Ok(Json(b.ask_reattest(&admin, &id).await?).into_response())
}

/// Submit a job for the caller's tenant: checked, stored, placed at once if a node fits.
#[utoipa::path(post, path = routes::JOBS, tag = "jobs", security(("api" = [])),
    request_body = JobSpec,
    responses(
        (status = 201, description = "stored: placed, or pending with the reason", body = JobView),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 403, response = Problem),
        (status = 413, response = Problem),
        (status = 422, response = Problem),
        (status = 429, response = Problem),
        (status = 503, response = Problem),
    ))]
async fn submit(State(b): Shared, admin: Admin, body: Bytes) -> Result<Response, BrokerError> {
    let spec = json_body(&body, "job")?;
    let view = b.submit(&admin, spec).await?;
    Ok((axum::http::StatusCode::CREATED, Json(view)).into_response())
}

/// Money in: a deposit to a tenant's balance or an operator's stake (scope `ledger` or `*`).
#[utoipa::path(post, path = routes::DEPOSITS, tag = "ledger", security(("api" = [])),
    request_body = DepositRequest,
    responses(
        (status = 200, description = "deposited, or deposited before under this reference (new: false)", body = DepositAnswer),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 403, response = Problem),
        (status = 409, response = Problem),
    ))]
async fn deposit(State(b): Shared, admin: Admin, body: Bytes) -> Result<Response, BrokerError> {
    let req: DepositRequest = json_body(&body, "deposit")?;
    Ok(Json(b.deposit(&admin, req).await?).into_response())
}

/// Every account of the ledger, with its sums (auditors).
#[utoipa::path(get, path = routes::ACCOUNTS, tag = "ledger", security(("api" = [])),
    responses(
        (status = 200, description = "in id order", body = Vec<AccountBalance>),
        (status = 401, response = Problem),
        (status = 403, response = Problem),
    ))]
async fn accounts(State(b): Shared, admin: Admin) -> Result<Response, BrokerError> {
    Ok(Json(b.accounts(&admin).await?).into_response())
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct StatementQuery {
    tenant: Option<String>,
    operator: Option<String>,
    from: Option<i64>,
    to: Option<i64>,
}

/// A tenant's or an operator's statement over `[from, to)`.
#[utoipa::path(get, path = routes::STATEMENTS, tag = "ledger", security(("api" = [])),
    params(
        ("tenant" = Option<String>, Query, description = "a tenant's statement"),
        ("operator" = Option<String>, Query, description = "an operator's statement"),
        ("from" = Option<i64>, Query, description = "Unix seconds, inclusive (default: the start)"),
        ("to" = Option<i64>, Query, description = "Unix seconds, exclusive (default: now)"),
    ),
    responses(
        (status = 200, description = "lines, leases and windows, reconciled", body = Statement),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 403, response = Problem),
    ))]
async fn statement(
    State(b): Shared,
    admin: Admin,
    Query(q): Query<StatementQuery>,
) -> Result<Response, BrokerError> {
    let owner = match (q.tenant, q.operator) {
        (Some(t), None) => super::statements::Owner::Tenant(t),
        (None, Some(o)) => super::statements::Owner::Operator(o),
        _ => {
            return Err(BrokerError::BadRequest(
                "say whose statement: tenant or operator (one)".into(),
            ));
        }
    };
    Ok(Json(b.statement(&admin, owner, q.from, q.to).await?).into_response())
}

/// The offers a job would get now, ranked, and why other nodes would not: nothing placed.
#[utoipa::path(post, path = routes::QUOTES, tag = "ledger", security(("api" = [])),
    request_body = JobSpec,
    responses(
        (status = 200, description = "offers, best first, and exclusions", body = QuoteAnswer),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 403, response = Problem),
        (status = 422, response = Problem),
    ))]
async fn quote(State(b): Shared, admin: Admin, body: Bytes) -> Result<Response, BrokerError> {
    let spec: JobSpec = json_body(&body, "job")?;
    Ok(Json(b.quote(&admin, spec).await?).into_response())
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct JobsQuery {
    tenant: Option<String>,
}

/// The caller's tenant's jobs (auditors: every tenant's, or `tenant`'s).
#[utoipa::path(get, path = routes::JOBS, tag = "jobs", security(("api" = [])),
    params(("tenant" = Option<String>, Query, description = "whose jobs (a token with several tenants must say)")),
    responses(
        (status = 200, description = "newest first", body = JobList),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 403, response = Problem),
    ))]
async fn jobs(
    State(b): Shared,
    admin: Admin,
    Query(q): Query<JobsQuery>,
) -> Result<Response, BrokerError> {
    Ok(Json(JobList {
        jobs: b.jobs(&admin, q.tenant.as_deref()).await?,
    })
    .into_response())
}

/// One job with its events.
#[utoipa::path(get, path = routes::JOB, tag = "jobs", security(("api" = [])),
    params(("id" = String, Path, description = "the job's id")),
    responses(
        (status = 200, description = "the job", body = JobView),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 404, response = Problem),
    ))]
async fn job(
    State(b): Shared,
    admin: Admin,
    Path(id): Path<String>,
) -> Result<Response, BrokerError> {
    check_id(&id)?;
    Ok(Json(b.job_for(&admin, &id).await?).into_response())
}

/// Cancel a job (its tenant): its lease ends and its GPUs are free at once.
#[utoipa::path(post, path = routes::CANCEL, tag = "jobs", security(("api" = [])),
    params(("id" = String, Path, description = "the job's id")),
    responses(
        (status = 200, description = "cancelled", body = JobView),
        (status = 400, response = Problem),
        (status = 401, response = Problem),
        (status = 403, response = Problem),
        (status = 404, response = Problem),
        (status = 409, response = Problem),
    ))]
async fn cancel(
    State(b): Shared,
    admin: Admin,
    Path(id): Path<String>,
) -> Result<Response, BrokerError> {
    check_id(&id)?;
    Ok(Json(b.cancel(&admin, &id).await?).into_response())
}

/// `GET /healthz` answer.
#[derive(serde::Serialize, utoipa::ToSchema)]
struct Health {
    /// `ok`.
    status: &'static str,
    /// Nodes this replica indexes.
    nodes: usize,
}

/// Liveness: the replica answers, and how many nodes it indexes.
#[utoipa::path(get, path = routes::HEALTHZ, tag = "operations",
    responses((status = 200, description = "serving", body = Health)))]
async fn healthz(State(b): Shared) -> Response {
    let nodes = b.index.lock().map(|i| i.len()).unwrap_or(0);
    Json(Health {
        status: "ok",
        nodes,
    })
    .into_response()
}

async fn not_found() -> Response {
    BrokerError::NotFound("no such endpoint".into()).into_response()
}
