//! KBS errors and their wire form, as CoCo's KBS writes them:
//! `{"type": "https://github.com/confidential-containers/kbs/errors/<Variant>", "detail": "…"}`,
//! 401 for refusals, 404 for unknown paths and resources, 400 for malformed requests.
//! Details name what was refused and why, never secret material.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

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
        }
    }
}

impl IntoResponse for KbsError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(error = %self, "request failed");
        } else {
            tracing::debug!(error = %self, "request refused");
        }
        let body = serde_json::json!({
            "type": format!("{ERROR_TYPE_PREFIX}{}", self.variant()),
            "detail": self.to_string(),
        });
        (status, axum::Json(body)).into_response()
    }
}

impl From<sqlx::Error> for KbsError {
    fn from(e: sqlx::Error) -> Self {
        KbsError::Storage(e.to_string())
    }
}
