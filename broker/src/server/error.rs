//! The broker's errors, each with an HTTP status and a stable code (RFC 9457 problem details
//! through `cgx-service`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use cgx_service::error::ApiError;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    #[error("configuration: {0}")]
    Config(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("authentication: {0}")]
    Unauthorized(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0} not found")]
    NotFound(String),
    #[error("nonce: {0}")]
    Nonce(String),
    /// The evidence was refused by the verifier or its binding; `code` is the verifier's.
    #[error("evidence refused: {detail}")]
    Evidence { code: &'static str, detail: String },
    /// The offer claims what the evidence does not prove.
    #[error("inventory: {0}")]
    Inventory(String),
    #[error("heartbeat: {0}")]
    Heartbeat(String),
    /// A workload report not signed by the node's attested key, or not of this node.
    #[error("workload report: {0}")]
    Report(String),
    /// A metering record not signed by the node's attested key, or not a metering record.
    #[error("metering record: {0}")]
    Metering(String),
    /// A proof-of-work answer refused before it is stored (its receipt, its challenge, its
    /// time, its bytes).
    #[error("proof of work: {0}")]
    Pow(String),
    #[error("budget: {0}")]
    Budget(String),
    /// The tenant's balance does not cover what it asks to hold (a job's budget).
    #[error("funds: {0}")]
    Funds(String),
    /// A quoted offer no longer holds.
    #[error("offer: {0}")]
    OfferGone(String),
    #[error("placement policy: {0}")]
    PlacementPolicy(String),
    #[error("{0}")]
    Conflict(String),
    /// A bound shared by every caller (the policy sandbox) is reached: try again.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// A job row whose seal does not verify (made or edited in the database).
    #[error("job record: {0}")]
    JobSeal(String),
    #[error("quota: {0}")]
    Quota(String),
    #[error("storage: {0}")]
    Storage(String),
    #[error("internal: {0}")]
    Internal(String),
}

impl From<cgx_service::tlog::LogStoreError> for BrokerError {
    fn from(e: cgx_service::tlog::LogStoreError) -> Self {
        BrokerError::Storage(e.to_string())
    }
}

impl From<cgx_service::ServiceError> for BrokerError {
    fn from(e: cgx_service::ServiceError) -> Self {
        BrokerError::Config(e.to_string())
    }
}

impl From<cgx_service::db::DbError> for BrokerError {
    fn from(e: cgx_service::db::DbError) -> Self {
        BrokerError::Storage(e.to_string())
    }
}

impl From<sqlx::Error> for BrokerError {
    fn from(e: sqlx::Error) -> Self {
        BrokerError::Storage(e.to_string())
    }
}

impl From<cgx_service::auth::AuthError> for BrokerError {
    fn from(e: cgx_service::auth::AuthError) -> Self {
        match e {
            cgx_service::auth::AuthError::OutOfScope { .. } => {
                BrokerError::Forbidden(e.to_string())
            }
            other => BrokerError::Unauthorized(other.to_string()),
        }
    }
}

impl ApiError for BrokerError {
    fn status(&self) -> StatusCode {
        match self {
            BrokerError::BadRequest(_) => StatusCode::BAD_REQUEST,
            BrokerError::Unauthorized(_)
            | BrokerError::Heartbeat(_)
            | BrokerError::Report(_)
            | BrokerError::Metering(_) => StatusCode::UNAUTHORIZED,
            BrokerError::Pow(_) => StatusCode::UNPROCESSABLE_ENTITY,
            BrokerError::Forbidden(_) => StatusCode::FORBIDDEN,
            BrokerError::NotFound(_) => StatusCode::NOT_FOUND,
            BrokerError::Nonce(_)
            | BrokerError::Evidence { .. }
            | BrokerError::Inventory(_)
            | BrokerError::Budget(_)
            | BrokerError::PlacementPolicy(_) => StatusCode::UNPROCESSABLE_ENTITY,
            BrokerError::Conflict(_) | BrokerError::OfferGone(_) => StatusCode::CONFLICT,
            BrokerError::Funds(_) => StatusCode::PAYMENT_REQUIRED,
            BrokerError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            BrokerError::Quota(_) => StatusCode::TOO_MANY_REQUESTS,
            BrokerError::Config(_)
            | BrokerError::Storage(_)
            | BrokerError::Internal(_)
            | BrokerError::JobSeal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn code(&self) -> &'static str {
        match self {
            BrokerError::Config(_) => "Config",
            BrokerError::BadRequest(_) => "BadRequest",
            BrokerError::Unauthorized(_) => "Unauthorized",
            BrokerError::Forbidden(_) => "Forbidden",
            BrokerError::NotFound(_) => "NotFound",
            BrokerError::Nonce(_) => "NonceInvalid",
            BrokerError::Evidence { .. } => "EvidenceRefused",
            BrokerError::Inventory(_) => "InventoryNotProven",
            BrokerError::Heartbeat(_) => "HeartbeatInvalid",
            BrokerError::Report(_) => "ReportInvalid",
            BrokerError::Metering(_) => "MeteringRecordInvalid",
            BrokerError::Pow(_) => "ProofRefused",
            BrokerError::Budget(_) => "BudgetTooSmall",
            BrokerError::Funds(_) => "InsufficientFunds",
            BrokerError::OfferGone(_) => "OfferNoLongerHolds",
            BrokerError::PlacementPolicy(_) => "PlacementPolicyInvalid",
            BrokerError::Conflict(_) => "Conflict",
            BrokerError::JobSeal(_) => "JobRecordInvalid",
            BrokerError::Unavailable(_) => "ServiceUnavailable",
            BrokerError::Quota(_) => "TooManyPending",
            BrokerError::Storage(_) => "StorageError",
            BrokerError::Internal(_) => "InternalError",
        }
    }

    fn extensions(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        if let BrokerError::Evidence { code, .. } = self {
            m.insert("evidence_code".into(), (*code).into());
        }
        m
    }
}

impl IntoResponse for BrokerError {
    fn into_response(self) -> Response {
        cgx_service::error::problem(&self)
    }
}
