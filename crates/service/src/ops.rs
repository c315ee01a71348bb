//! The operations routes every service serves beside its API: its OpenAPI document and its
//! Prometheus metrics. Health stays each service's own route: what "healthy" means (a schema
//! version read, an index held) is the service's.

use std::sync::Arc;

use axum::Router;
use axum::http::header::CONTENT_TYPE;
use axum::routing::get;

use utoipa::openapi::path::{HttpMethod, OperationBuilder, PathItem};
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::{ObjectBuilder, Schema, Type};
use utoipa::openapi::{ContentBuilder, OpenApi};

use crate::metrics::Metrics;

/// Where the metrics are served, for every service.
pub const METRICS_PATH: &str = "/metrics";

/// `router` with the OpenAPI document at `openapi_path` and `metrics` at [`METRICS_PATH`]
/// (Prometheus text format 0.0.4); `doc` gets these two routes' operations first, and is
/// served as JSON. Mount before the service's route layers, so they are tracked like any route.
pub fn routes<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    openapi_path: &str,
    mut doc: OpenApi,
    metrics: Arc<Metrics>,
) -> Result<Router<S>, serde_json::Error> {
    document(&mut doc, openapi_path);
    // Built once; each request clones a reference to the bytes.
    let openapi = axum::body::Bytes::from(doc.to_json()?);
    Ok(router
        .route(
            openapi_path,
            get(move || {
                let doc = openapi.clone();
                async move { ([(CONTENT_TYPE, "application/json")], doc) }
            }),
        )
        .route(
            METRICS_PATH,
            get(move || {
                let m = metrics.clone();
                async move { ([(CONTENT_TYPE, "text/plain; version=0.0.4")], m.render()) }
            }),
        ))
}

/// The operations of the two routes [`routes`] mounts, added to `doc`.
fn document(doc: &mut OpenApi, openapi_path: &str) {
    let get = |summary: &str, content_type: &str, schema: Schema| {
        PathItem::new(
            HttpMethod::Get,
            OperationBuilder::new()
                .summary(Some(summary))
                .tag("operations")
                .response(
                    "200",
                    ResponseBuilder::new().description("OK").content(
                        content_type,
                        ContentBuilder::new().schema(Some(schema)).build(),
                    ),
                ),
        )
    };
    let object = Schema::Object(ObjectBuilder::new().schema_type(Type::Object).build());
    let text = Schema::Object(ObjectBuilder::new().schema_type(Type::String).build());
    doc.paths.paths.insert(
        openapi_path.to_string(),
        get("This OpenAPI document", "application/json", object),
    );
    doc.paths.paths.insert(
        METRICS_PATH.to_string(),
        get(
            "Prometheus metrics (text format 0.0.4): requests by matched route, events",
            "text/plain; version=0.0.4",
            text,
        ),
    );
}
