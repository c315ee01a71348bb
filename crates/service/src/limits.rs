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

#[derive(Debug)]
struct TooLarge(usize);

impl std::fmt::Display for TooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the request body is larger than the {} bytes this endpoint takes",
            self.0
        )
    }
}

impl crate::error::ApiError for TooLarge {
    fn status(&self) -> StatusCode {
        StatusCode::PAYLOAD_TOO_LARGE
    }

    fn code(&self) -> &'static str {
        "PayloadTooLarge"
    }
}

async fn declared_length(State(max): State<usize>, req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64) {
        return crate::error::problem(&TooLarge(max));
    }
    next.run(req).await
}

#[derive(Debug)]
struct Busy;

impl std::fmt::Display for Busy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the server is at capacity; retry in a moment")
    }
}

impl crate::error::ApiError for Busy {
    fn status(&self) -> StatusCode {
        StatusCode::SERVICE_UNAVAILABLE
    }

    fn code(&self) -> &'static str {
        "Overloaded"
    }
}

/// The layer behind [`crate::ListenerConfig::max_in_flight`].
pub(crate) async fn shed(
    State(slots): State<Arc<tokio::sync::Semaphore>>,
    req: Request,
    next: Next,
) -> Response {
    let Ok(_permit) = slots.try_acquire() else {
        let mut resp = crate::error::problem(&Busy);
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return resp;
    };
    next.run(req).await
}
