//! Errors on the wire: RFC 9457 problem details (`application/problem+json`) with a stable
//! machine-readable `code`. A client error says what was refused and why; a server error says
//! only that it happened and a reference to find it in the server's log, never a driver's or a
//! library's text (those name tables, files and hosts).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// What a service's error enum tells the wire.
pub trait ApiError: std::fmt::Display {
    /// HTTP status.
    fn status(&self) -> StatusCode;
    /// Stable code, e.g. `PolicyDeny` (what scripts and clients branch on).
    fn code(&self) -> &'static str;
    /// The problem type URI; by default `urn:cgx:problem:<code>`.
    fn type_uri(&self) -> String {
        format!("urn:cgx:problem:{}", self.code())
    }
    /// Extra members of the problem object (e.g. the verifier's code of a refused evidence).
    fn extensions(&self) -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }
}

/// A refusal the service layer itself makes (timeouts, limits, load): a fixed status and code,
/// a detail for the client.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub status: StatusCode,
    pub code: &'static str,
    pub detail: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

impl ApiError for Refusal {
    fn status(&self) -> StatusCode {
        self.status
    }

    fn code(&self) -> &'static str {
        self.code
    }
}

/// What a client is told of `e`: a refusal's text; for a server error, a reference to the
/// server log's line, which has the text (never a driver's or a library's words).
pub fn detail<E: ApiError + ?Sized>(e: &E) -> String {
    if e.status().is_server_error() {
        let mut id = [0u8; 6];
        let _ = aws_lc_rs::rand::fill(&mut id);
        let reference = hex::encode(id);
        tracing::error!(error = %e, code = e.code(), reference, "request failed");
        format!("internal error (reference {reference}); the server log has the details")
    } else {
        tracing::debug!(error = %e, code = e.code(), "request refused");
        e.to_string()
    }
}

/// The problem-details response for `e`. Server errors (5xx) are logged with a reference that
/// the body carries instead of their text.
pub fn problem<E: ApiError + ?Sized>(e: &E) -> Response {
    let status = e.status();
    let detail = detail(e);
    let mut body = e.extensions();
    body.insert("type".into(), e.type_uri().into());
    body.insert(
        "title".into(),
        status.canonical_reason().unwrap_or("Error").into(),
    );
    body.insert("status".into(), status.as_u16().into());
    body.insert("code".into(), e.code().into());
    body.insert("detail".into(), detail.into());
    let mut resp = (status, axum::Json(serde_json::Value::Object(body))).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    resp
}

/// A refusal as every service answers it (RFC 9457 problem details, `application/problem+json`):
/// the shape [`problem`] writes, for the services' OpenAPI documents.
#[derive(Debug, serde::Serialize, utoipa::ToSchema, utoipa::ToResponse)]
#[response(
    description = "problem details (RFC 9457) with a stable code",
    content_type = "application/problem+json"
)]
pub struct Problem {
    /// A URI naming the problem: `urn:cgx:problem:<code>` by default; the KBS uses CoCo's
    /// error type URIs, as CoCo's clients read them.
    #[serde(rename = "type")]
    pub type_uri: String,
    /// The status's reason phrase.
    pub title: String,
    /// The HTTP status.
    pub status: u16,
    /// The stable code clients branch on (e.g. `PolicyDeny`).
    pub code: String,
    /// What was refused and why; for a server error, a reference into the server's log.
    pub detail: String,
    /// A service may add members of its own (the KBS: `part` and `evidence_code` of a refused
    /// piece of evidence).
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub extensions: serde_json::Map<String, serde_json::Value>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[derive(Debug)]
    struct E(StatusCode, &'static str);
    impl std::fmt::Display for E {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{}: table sessions at /var/lib/secret.db", self.1)
        }
    }
    impl ApiError for E {
        fn status(&self) -> StatusCode {
            self.0
        }
        fn code(&self) -> &'static str {
            self.1
        }
    }

    async fn body(r: Response) -> (StatusCode, String, serde_json::Value) {
        let status = r.status();
        let ct = r.headers()[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .to_string();
        let b = axum::body::to_bytes(r.into_body(), 1 << 16).await.unwrap();
        (status, ct, serde_json::from_slice(&b).unwrap())
    }

    #[tokio::test]
    async fn client_errors_say_why_server_errors_say_nothing_internal() {
        let (s, ct, v) = body(problem(&E(StatusCode::UNAUTHORIZED, "PolicyDeny"))).await;
        assert_eq!(s, 401);
        assert_eq!(ct, "application/problem+json");
        assert_eq!(v["code"], "PolicyDeny");
        assert_eq!(v["status"], 401);
        assert_eq!(v["type"], "urn:cgx:problem:PolicyDeny");
        assert!(v["detail"].as_str().unwrap().contains("PolicyDeny"));
        let (s, _, v) = body(problem(&E(
            StatusCode::INTERNAL_SERVER_ERROR,
            "StorageError",
        )))
        .await;
        assert_eq!(s, 500);
        let d = v["detail"].as_str().unwrap();
        assert!(!d.contains("sessions") && !d.contains("/var/lib"), "{d}");
        assert!(d.contains("reference "), "{d}");
        assert_eq!(v["code"], "StorageError");
    }
}
