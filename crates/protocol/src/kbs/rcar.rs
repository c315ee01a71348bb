//! RCAR, the Confidential Containers KBS handshake (`auth` → `attest` → `resource`), as plain
//! functions over bytes: each step builds a request body or reads an answer, and the transport
//! is the caller's (ureq in `cgx-kbs`'s client, hand-rolled HTTP/1.1 in `cgx bench kbs`).

use kbs_types::{Attestation, CompositeEvidence, Request, Response, RuntimeData, Tee, TeePubKey};
use serde_json::Value;

use crate::kbs::jwe::TeeKey;

/// Why a protocol step failed. A refusal carries the KBS's CoCo error type and detail.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    #[error("{step}: HTTP {status} {kind}: {detail}")]
    Refused {
        step: &'static str,
        status: u16,
        /// The CoCo error variant (last segment of `type`), e.g. `PolicyDeny`.
        kind: String,
        detail: String,
    },
    #[error("{step}: {detail}")]
    Transport { step: &'static str, detail: String },
    #[error("evidence: {0}")]
    Evidence(String),
    #[error("response: {0}")]
    Response(String),
    #[error("JWE: {0}")]
    Jwe(#[from] crate::kbs::jwe::JweError),
}

impl ClientError {
    /// The CoCo error variant of a refusal.
    pub fn kind(&self) -> Option<&str> {
        match self {
            ClientError::Refused { kind, .. } => Some(kind),
            _ => None,
        }
    }

    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// Result of a protocol step.
pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// Produces evidence bound to the KBS session.
pub trait EvidenceSource: Send + Sync {
    fn tee(&self) -> Tee;
    /// Additional (device) evidence for this session's nonce and TEE key, as the JSON string
    /// that goes into `additional_evidence` (empty: none).
    fn additional_evidence(&self, nonce: &str, key: &TeePubKey) -> Result<String>;
    /// Primary evidence whose report data is `report_data`.
    fn primary_evidence(&self, report_data: &[u8; 64]) -> Result<Value>;
}

pub const AUTH_PATH: &str = "/kbs/v0/auth";
pub const ATTEST_PATH: &str = "/kbs/v0/attest";

/// `GET` path of a resource (`repo/type/tag`), with an optional lease token.
pub fn resource_path(path: &str, lease: Option<&str>) -> String {
    match lease {
        Some(l) => format!("/kbs/v0/resource/{path}?lease={l}"),
        None => format!("/kbs/v0/resource/{path}"),
    }
}

/// The `auth` request body.
pub fn auth_body(tee: Tee) -> Result<Vec<u8>> {
    let req = Request {
        version: "0.4.0".into(),
        tee,
        extra_params: Value::String(String::new()),
    };
    serde_json::to_vec(&req).map_err(|e| ClientError::Response(e.to_string()))
}

/// The session cookie (`name=value`) from a `set-cookie` header.
pub fn session_cookie(set_cookie: Option<&str>) -> Option<String> {
    set_cookie
        .and_then(|v| v.split(';').next())
        .map(|v| v.trim().to_string())
}

/// The string `field` of a JSON answer to `step`, or the refusal it carries.
fn answer_field(
    step: &'static str,
    status: u16,
    body: &[u8],
    field: &str,
    missing: &str,
) -> Result<String> {
    if status != 200 {
        return Err(refused(step, status, body));
    }
    let v: Value =
        serde_json::from_slice(body).map_err(|e| ClientError::Response(e.to_string()))?;
    v[field]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| ClientError::Response(missing.into()))
}

/// The challenge nonce from the answer to `auth`.
pub fn challenge(status: u16, body: &[u8]) -> Result<String> {
    answer_field("auth", status, body, "nonce", "challenge without nonce")
}

/// The attestation message for `nonce`: evidence bound to it and to `key`.
pub fn attestation(key: &TeeKey, source: &dyn EvidenceSource, nonce: &str) -> Result<Attestation> {
    let key = key.public()?;
    let additional = source.additional_evidence(nonce, &key)?;
    let rd = crate::kbs::binding::cpu_report_data(nonce, &key, &additional)
        .map_err(|e| ClientError::Evidence(format!("runtime data: {e}")))?;
    Ok(Attestation {
        init_data: None,
        runtime_data: RuntimeData {
            nonce: nonce.to_string(),
            tee_pubkey: key,
        },
        tee_evidence: CompositeEvidence {
            primary_evidence: source.primary_evidence(&rd)?,
            additional_evidence: additional,
        },
    })
}

/// The EAR from the answer to `attest`.
pub fn token(status: u16, body: &[u8]) -> Result<String> {
    answer_field(
        "attest",
        status,
        body,
        "token",
        "attest answer without token",
    )
}

/// The JWE from the answer to a resource request.
pub fn jwe(status: u16, body: &[u8]) -> Result<Response> {
    if status != 200 {
        return Err(refused("resource", status, body));
    }
    serde_json::from_slice(body).map_err(|e| ClientError::Response(format!("JWE: {e}")))
}

fn refused(step: &'static str, status: u16, body: &[u8]) -> ClientError {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    ClientError::Refused {
        step,
        status,
        kind: v["type"]
            .as_str()
            .and_then(|t| t.rsplit('/').next())
            .unwrap_or("")
            .to_string(),
        detail: v["detail"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned()),
    }
}
