//! KBS errors and their wire form: RFC 9457 problem details ([`cgx_service::error`]) whose
//! `type` and `detail` are what CoCo's KBS writes —
//! `{"type": "https://github.com/confidential-containers/kbs/errors/<Variant>", "detail": "…"}` —
//! so CoCo clients read them unchanged, plus `status` and a stable `code` (the variant). 401 for
//! refusals, 404 for unknown paths and resources, 400 for malformed requests. Details name what
//! was refused and why, never secret material; server errors carry only a log reference.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use cgx_service::auth::AuthError;
use cgx_service::db::DbError;
use cgx_service::error::ApiError;

pub const ERROR_TYPE_PREFIX: &str = "https://github.com/confidential-containers/kbs/errors/";

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KbsError {
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("protocol version {0} is not supported (this KBS speaks 0.4.0)")]
    ProtocolVersion(String),
    #[error("TEE '{0}' is not accepted")]
    UnsupportedTee(String),
    #[error("no session: {0}")]
    UnAuthenticated(String),
    #[error("attestation failed: {0}")]
    AttestationFailed(String),
    /// The verifier refused one part's evidence; its stable code goes on the wire.
    #[error("attestation failed: {part}: {error} ({code})", code = error.code())]
    Verification {
        part: String,
        error: cgx_attestation::Error,
    },
    #[error("token: {0}")]
    TokenInvalid(String),
    #[error("release policy denied {0}")]
    PolicyDeny(String),
    #[error("lease: {0}")]
    LeaseInvalid(String),
    #[error("admin: {0}")]
    AdminAuth(String),
    #[error("resource {0} not found")]
    ResourceNotFound(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("policy: {0}")]
    PolicyInvalid(String),
    #[error("JWE: {0}")]
    Jwe(String),
    #[error("storage: {0}")]
    Storage(String),
    #[error("configuration: {0}")]
    Config(String),
    #[error("internal: {0}")]
    Internal(String),
    /// A client past its budget (per-client limits on work its unverified input causes).
    #[error("{detail}")]
    TooManyRequests { retry_after: u64, detail: String },
    /// The server is at a bound shared by all clients; try again later.
    #[error("{detail}")]
    Overloaded { retry_after: u64, detail: String },
}

impl KbsError {
    /// The CoCo error variant name.
    pub fn variant(&self) -> &'static str {
        match self {
            KbsError::InvalidRequest(_) => "InvalidRequest",
            KbsError::ProtocolVersion(_) => "ProtocolVersionMismatch",
            KbsError::UnsupportedTee(_) => "UnsupportedTee",
            KbsError::UnAuthenticated(_) => "UnAuthenticated",
            KbsError::AttestationFailed(_) | KbsError::Verification { .. } => "AttestationFailed",
            KbsError::TokenInvalid(_) => "TokenInvalid",
            KbsError::PolicyDeny(_) => "PolicyDeny",
            KbsError::LeaseInvalid(_) => "LeaseInvalid",
            KbsError::AdminAuth(_) => "AdminAuthFailed",
            KbsError::ResourceNotFound(_) => "ResourceNotFound",
            KbsError::NotFound(_) => "NotFound",
            KbsError::PolicyInvalid(_) => "PolicyInvalid",
            KbsError::Jwe(_) => "JWEFailed",
            KbsError::Storage(_) => "StorageError",
            KbsError::Config(_) => "ConfigError",
            KbsError::Internal(_) => "InternalError",
            KbsError::TooManyRequests { .. } => "TooManyRequests",
            KbsError::Overloaded { .. } => "ServiceUnavailable",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            KbsError::InvalidRequest(_)
            | KbsError::ProtocolVersion(_)
            | KbsError::UnsupportedTee(_)
            | KbsError::PolicyInvalid(_) => StatusCode::BAD_REQUEST,
            KbsError::UnAuthenticated(_)
            | KbsError::AttestationFailed(_)
            | KbsError::Verification { .. }
            | KbsError::TokenInvalid(_)
            | KbsError::PolicyDeny(_)
            | KbsError::LeaseInvalid(_)
            | KbsError::AdminAuth(_) => StatusCode::UNAUTHORIZED,
            KbsError::ResourceNotFound(_) | KbsError::NotFound(_) => StatusCode::NOT_FOUND,
            KbsError::Jwe(_)
            | KbsError::Storage(_)
            | KbsError::Config(_)
            | KbsError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            KbsError::TooManyRequests { .. } => StatusCode::TOO_MANY_REQUESTS,
            KbsError::Overloaded { .. } => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

impl ApiError for KbsError {
    fn status(&self) -> StatusCode {
        KbsError::status(self)
    }

    fn code(&self) -> &'static str {
        self.variant()
    }

    fn type_uri(&self) -> String {
        format!("{ERROR_TYPE_PREFIX}{}", self.variant())
    }

    fn extensions(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        if let KbsError::Verification { part, error } = self {
            m.insert("part".into(), part.clone().into());
            m.insert("evidence_code".into(), error.code().into());
        }
        m
    }
}

impl IntoResponse for KbsError {
    fn into_response(self) -> Response {
        let mut resp = cgx_service::error::problem(&self);
        if let KbsError::TooManyRequests { retry_after, .. }
        | KbsError::Overloaded { retry_after, .. } = &self
        {
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(*retry_after),
            );
        }
        resp
    }
}

impl From<cgx_service::ServiceError> for KbsError {
    fn from(e: cgx_service::ServiceError) -> Self {
        KbsError::Config(e.to_string())
    }
}

impl From<cgx_service::tlog::LogStoreError> for KbsError {
    fn from(e: cgx_service::tlog::LogStoreError) -> Self {
        KbsError::Storage(e.to_string())
    }
}

impl From<DbError> for KbsError {
    fn from(e: DbError) -> Self {
        match e {
            DbError::Url(u) => KbsError::Config(format!("database: {u}")),
            other => KbsError::Storage(other.to_string()),
        }
    }
}

impl From<sqlx::Error> for KbsError {
    fn from(e: sqlx::Error) -> Self {
        KbsError::Storage(e.to_string())
    }
}

impl From<AuthError> for KbsError {
    fn from(e: AuthError) -> Self {
        KbsError::AdminAuth(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn limits_say_when_to_come_back() {
        for (e, status) in [
            (
                KbsError::TooManyRequests {
                    retry_after: 7,
                    detail: "budget".into(),
                },
                429,
            ),
            (
                KbsError::Overloaded {
                    retry_after: 5,
                    detail: "queue".into(),
                },
                503,
            ),
        ] {
            let want = match &e {
                KbsError::TooManyRequests { retry_after, .. }
                | KbsError::Overloaded { retry_after, .. } => retry_after.to_string(),
                _ => unreachable!(),
            };
            let r = e.into_response();
            assert_eq!(r.status().as_u16(), status);
            assert_eq!(r.headers()[axum::http::header::RETRY_AFTER], want.as_str());
        }
    }
}
