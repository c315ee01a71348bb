//! Limits that come before parsing and before authentication: a body-size limit per route
//! (a declared `Content-Length` over it is refused before the handler or its extractors run;
//! a chunked body is cut at the same size when read), and load shedding (more requests in
//! flight than the server takes are answered 503 with `Retry-After` at once, not queued).

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::MethodRouter;

use crate::error::Refusal;

/// Bound `route`'s request bodies to `max` bytes.
pub fn limited<S: Clone + Send + Sync + 'static>(
    route: MethodRouter<S>,
    max: usize,
) -> MethodRouter<S> {
    route
        .layer::<_, std::convert::Infallible>(axum::middleware::from_fn_with_state(
            max,
            declared_length,
        ))
        .layer::<_, std::convert::Infallible>(DefaultBodyLimit::max(max))
}

async fn declared_length(State(max): State<usize>, req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return crate::error::problem(&Refusal {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            code: "PayloadTooLarge",
            detail: format!("the request body is larger than the {max} bytes this endpoint takes"),
        });
    }
    next.run(req).await
}

/// What [`admit`] holds: the in-flight slots ([`crate::ListenerConfig::max_in_flight`]) and
/// the longest a request may take ([`crate::ListenerConfig::request_timeout`]).
#[derive(Clone)]
pub(crate) struct Admission {
    pub slots: Arc<tokio::sync::Semaphore>,
    pub timeout: std::time::Duration,
}

/// The server-wide layer: past `max_in_flight`, 503 with `Retry-After` at once (load
/// shedding); a request that takes longer than `request_timeout`, 408.
pub(crate) async fn admit(State(a): State<Admission>, req: Request, next: Next) -> Response {
    let Ok(_permit) = a.slots.try_acquire() else {
        let mut resp = crate::error::problem(&Refusal {
            status: StatusCode::SERVICE_UNAVAILABLE,
            code: "Overloaded",
            detail: "the server is at capacity; retry in a moment".into(),
        });
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return resp;
    };
    match tokio::time::timeout(a.timeout, next.run(req)).await {
        Ok(resp) => resp,
        Err(_) => crate::error::problem(&Refusal {
            status: StatusCode::REQUEST_TIMEOUT,
            code: "RequestTimeout",
            detail: "the request took longer than the server allows".into(),
        }),
    }
}
