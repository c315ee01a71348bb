//! The operations routes every service serves beside its API: its OpenAPI document and its
//! Prometheus metrics. Health stays each service's own route: what "healthy" means (a schema
//! version read, an index held) is the service's.

use std::sync::Arc;

use axum::Router;
use axum::http::header::CONTENT_TYPE;
use axum::routing::get;

use crate::metrics::Metrics;

/// Where the metrics are served, for every service.
pub const METRICS_PATH: &str = "/metrics";

/// `router` with the OpenAPI document at `openapi_path` (served as given, JSON) and `metrics`
/// at [`METRICS_PATH`] (Prometheus text format 0.0.4). Mount before the service's route layers,
/// so they are tracked like any route.
pub fn routes<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    openapi_path: &str,
    openapi: &'static str,
    metrics: Arc<Metrics>,
) -> Router<S> {
    router
        .route(
            openapi_path,
            get(move || async move { ([(CONTENT_TYPE, "application/json")], openapi) }),
        )
        .route(
            METRICS_PATH,
            get(move || {
                let m = metrics.clone();
                async move { ([(CONTENT_TYPE, "text/plain; version=0.0.4")], m.render()) }
            }),
        )
}
