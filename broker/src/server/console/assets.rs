//! The stylesheet and the script, embedded in the binary (no build tool chain, nothing
//! fetched from elsewhere: the CSP allows `'self'` only).

use axum::extract::Path;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::ConsoleError;

const CSS: &str = include_str!("assets/console.css");
const JS: &str = include_str!("assets/console.js");

/// `GET /console/assets/{name}`.
pub(super) async fn asset(Path(name): Path<String>) -> Response {
    let (body, kind) = match name.as_str() {
        "console.css" => (CSS, "text/css; charset=utf-8"),
        "console.js" => (JS, "text/javascript; charset=utf-8"),
        _ => return ConsoleError::NotFound.into_response(),
    };
    (
        [
            (header::CONTENT_TYPE, kind),
            // The same bytes for the binary's life; revalidated after a day.
            (header::CACHE_CONTROL, "public, max-age=86400"),
        ],
        body,
    )
        .into_response()
}
