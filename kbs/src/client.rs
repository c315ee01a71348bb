//! A KBS client (the guest side of RCAR): `auth` → `attest` → `resource`, over ureq with rustls.
//! Evidence comes from an [`EvidenceSource`]: configfs-tsm on real SNP/TDX guests, or the
//! simulator (in `cgx-guest-agent` and the tests). The TEE key is generated per client and never
//! leaves it; resources arrive as JWEs to it.

use std::sync::Arc;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use kbs_types::{Attestation, CompositeEvidence, Request, Response, RuntimeData, Tee, TeePubKey};
use serde_json::Value;

use crate::jwe::{Curve, TeeKey};

/// Why a client step failed. A refusal carries the KBS's CoCo error type and detail.
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
    Jwe(#[from] crate::jwe::JweError),
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

type Result<T> = std::result::Result<T, ClientError>;

/// Produces evidence bound to the KBS session.
pub trait EvidenceSource: Send + Sync {
    fn tee(&self) -> Tee;
    /// Additional (device) evidence for this session's nonce and TEE key, as the JSON string
    /// that goes into `additional_evidence` (empty: none).
    fn additional_evidence(&self, nonce: &str, key: &TeePubKey) -> Result<String>;
    /// Primary evidence whose report data is `report_data`.
    fn primary_evidence(&self, report_data: &[u8; 64]) -> Result<Value>;
}

/// An HTTP agent for a KBS: rustls on aws-lc-rs, trusting `ca_pem`'s certificates (or the
/// WebPKI roots), error statuses returned as responses (their CoCo bodies are read).
pub fn agent(ca_pem: Option<&[u8]>) -> Result<ureq::Agent> {
    let roots = match ca_pem {
        Some(pem) => {
            let certs: Vec<ureq::tls::Certificate<'static>> = ureq::tls::parse_pem(pem)
                .filter_map(|i| match i {
                    Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
                    _ => None,
                })
                .collect();
            if certs.is_empty() {
                return Err(ClientError::Transport {
                    step: "setup",
                    detail: "no certificate in the CA file".into(),
                });
            }
            ureq::tls::RootCerts::Specific(Arc::new(certs))
        }
        None => ureq::tls::RootCerts::WebPki,
    };
    let tls = ureq::tls::TlsConfig::builder()
        .provider(ureq::tls::TlsProvider::Rustls)
        .root_certs(roots)
        .unversioned_rustls_crypto_provider(Arc::new(rustls::crypto::aws_lc_rs::default_provider()))
        .build();
    Ok(ureq::Agent::new_with_config(
        ureq::Agent::config_builder()
            .timeout_global(Some(std::time::Duration::from_secs(30)))
            .http_status_as_error(false)
            .tls_config(tls)
            .build(),
    ))
}

/// An RCAR client for one KBS.
pub struct KbsClient {
    base: String,
    agent: ureq::Agent,
    key: TeeKey,
    cookie: Option<String>,
    token: Option<String>,
}

impl std::fmt::Debug for KbsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KbsClient")
            .field("base", &self.base)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// The protocol's steps without I/O: what to send and what an answer means. [`KbsClient`]
/// carries them over ureq; a load generator or another transport can carry them as well.
pub mod rcar {
    use super::*;

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
    pub fn attestation(
        key: &TeeKey,
        source: &dyn EvidenceSource,
        nonce: &str,
    ) -> Result<Attestation> {
        let key = key.public()?;
        let additional = source.additional_evidence(nonce, &key)?;
        let rd = crate::binding::cpu_report_data(nonce, &key, &additional);
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

impl KbsClient {
    /// A client for `base` (`https://…` or `http://…`). `ca_pem`: the KBS's CA certificate(s);
    /// `None` uses the WebPKI roots.
    pub fn new(base: &str, ca_pem: Option<&[u8]>, key: TeeKey) -> Result<Self> {
        Ok(Self::with_agent(base, agent(ca_pem)?, key))
    }

    /// A client on an existing agent (its connection pool and TLS configuration are reused;
    /// many sessions from one process, e.g. a benchmark or a node agent with several VMs).
    pub fn with_agent(base: &str, agent: ureq::Agent, key: TeeKey) -> Self {
        KbsClient {
            base: base.trim_end_matches('/').to_string(),
            agent,
            key,
            cookie: None,
            token: None,
        }
    }

    /// A client with a fresh EC P-256 TEE key.
    pub fn with_new_key(base: &str, ca_pem: Option<&[u8]>) -> Result<Self> {
        Self::new(base, ca_pem, TeeKey::generate_ec(Curve::P256)?)
    }

    /// The same client (TEE key, session cookie, token) talking to another replica of the KBS.
    pub fn rebase(self, base: &str) -> Self {
        KbsClient {
            base: base.trim_end_matches('/').to_string(),
            ..self
        }
    }

    pub fn tee_key(&self) -> &TeeKey {
        &self.key
    }

    /// The EAR the KBS issued at the last successful attestation.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    fn post(
        &self,
        step: &'static str,
        path: &str,
        body: &[u8],
    ) -> Result<(u16, Vec<u8>, Option<String>)> {
        let mut req = self
            .agent
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json");
        if let Some(c) = &self.cookie {
            req = req.header("cookie", c);
        }
        let mut resp = req.send(body).map_err(|e| ClientError::Transport {
            step,
            detail: e.to_string(),
        })?;
        let cookie = rcar::session_cookie(
            resp.headers()
                .get("set-cookie")
                .and_then(|v| v.to_str().ok()),
        );
        let status = resp.status().as_u16();
        let body = resp
            .body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_vec()
            .map_err(|e| ClientError::Transport {
                step,
                detail: e.to_string(),
            })?;
        Ok((status, body, cookie))
    }

    /// `auth`: a new session; returns the challenge nonce.
    pub fn auth(&mut self, tee: Tee) -> Result<String> {
        let body = rcar::auth_body(tee)?;
        self.cookie = None;
        let (status, body, cookie) = self.post("auth", rcar::AUTH_PATH, &body)?;
        let nonce = rcar::challenge(status, &body)?;
        self.cookie = cookie;
        Ok(nonce)
    }

    /// The attestation message for `nonce`: evidence bound to it and to this client's key.
    pub fn attestation(&self, source: &dyn EvidenceSource, nonce: &str) -> Result<Attestation> {
        rcar::attestation(&self.key, source, nonce)
    }

    /// Send an attestation message (tests send tampered ones through here).
    pub fn send_attestation(&mut self, att: &Attestation) -> Result<String> {
        let body = serde_json::to_vec(att).map_err(|e| ClientError::Response(e.to_string()))?;
        let (status, body, _) = self.post("attest", rcar::ATTEST_PATH, &body)?;
        let token = rcar::token(status, &body)?;
        self.token = Some(token.clone());
        Ok(token)
    }

    /// `auth` + `attest`; returns the EAR.
    pub fn attest(&mut self, source: &dyn EvidenceSource) -> Result<String> {
        let nonce = self.auth(source.tee())?;
        let att = self.attestation(source, &nonce)?;
        self.send_attestation(&att)
    }

    /// The raw JWE for `path` (`repo/type/tag`), with an optional lease token.
    pub fn resource_jwe(&self, path: &str, lease: Option<&str>) -> Result<Response> {
        let url = format!("{}{}", self.base, rcar::resource_path(path, lease));
        let mut req = self.agent.get(&url);
        if let Some(c) = &self.cookie {
            req = req.header("cookie", c);
        }
        let mut resp = req.call().map_err(|e| ClientError::Transport {
            step: "resource",
            detail: e.to_string(),
        })?;
        let status = resp.status().as_u16();
        let body = resp
            .body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_vec()
            .map_err(|e| ClientError::Transport {
                step: "resource",
                detail: e.to_string(),
            })?;
        rcar::jwe(status, &body)
    }

    /// Fetch and decrypt `path`.
    pub fn resource(&self, path: &str, lease: Option<&str>) -> Result<Vec<u8>> {
        let jwe = self.resource_jwe(path, lease)?;
        Ok(self.key.decrypt(&jwe)?)
    }
}

/// Evidence from Linux configfs-tsm (`/sys/kernel/config/tsm/report`): the kernel asks the SNP
/// or TDX firmware for a report over our 64 bytes. SNP's `auxblob` carries the certificate
/// table (VCEK, ASK, ARK) when the host provides it.
///
/// This is the real-hardware path; it cannot run without a confidential VM, so it is untested
/// here beyond its file handling.
#[derive(Debug, Clone)]
pub struct ConfigfsTsm {
    pub root: std::path::PathBuf,
}

impl Default for ConfigfsTsm {
    fn default() -> Self {
        ConfigfsTsm {
            root: "/sys/kernel/config/tsm/report".into(),
        }
    }
}

/// SNP certificate-table GUIDs (GHCB spec, extended guest request).
const GUID_VCEK: &str = "63da758d-e664-4564-adc5-f4b93be8accd";
const GUID_VLEK: &str = "a8074bc2-a25a-483e-aae6-39c045a0b8a1";
const GUID_ASK: &str = "4ab7b379-bbac-4fe4-a02f-05aef327c782";
const GUID_ARK: &str = "c0b406a4-a803-4952-9743-3fb6014cd0ae";

fn guid(b: &[u8]) -> String {
    // Mixed-endian GUID text form.
    format!(
        "{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{}",
        b[3],
        b[2],
        b[1],
        b[0],
        b[5],
        b[4],
        b[7],
        b[6],
        b[8],
        b[9],
        hex::encode(&b[10..16])
    )
}

/// Entries of an SNP certificate table: 24-byte `{guid, offset u32, length u32}` records ending
/// with an all-zero one; offsets are from the table start.
pub fn snp_cert_table(aux: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for rec in aux.chunks_exact(24) {
        if rec.iter().all(|&b| b == 0) {
            break;
        }
        let off = u32::from_le_bytes([rec[16], rec[17], rec[18], rec[19]]) as usize;
        let len = u32::from_le_bytes([rec[20], rec[21], rec[22], rec[23]]) as usize;
        if let Some(data) = aux.get(off..off.saturating_add(len)) {
            let kind = match guid(&rec[..16]).as_str() {
                GUID_VCEK => "VCEK",
                GUID_VLEK => "VLEK",
                GUID_ASK => "ASK",
                GUID_ARK => "ARK",
                _ => continue,
            };
            out.push((kind.to_string(), data.to_vec()));
        }
    }
    out
}

impl ConfigfsTsm {
    fn report(&self, report_data: &[u8; 64]) -> Result<(String, Vec<u8>, Vec<u8>)> {
        let io = |e: std::io::Error| ClientError::Evidence(format!("configfs-tsm: {e}"));
        let mut name = [0u8; 8];
        aws_lc_rs::rand::fill(&mut name).map_err(|_| ClientError::Evidence("random".into()))?;
        let dir = self.root.join(format!("cgx-{}", hex::encode(name)));
        std::fs::create_dir(&dir).map_err(io)?;
        let result = (|| {
            std::fs::write(dir.join("inblob"), report_data).map_err(io)?;
            let provider = std::fs::read_to_string(dir.join("provider")).map_err(io)?;
            let out = std::fs::read(dir.join("outblob")).map_err(io)?;
            let aux = std::fs::read(dir.join("auxblob")).unwrap_or_default();
            Ok((provider.trim().to_string(), out, aux))
        })();
        let _ = std::fs::remove_dir(&dir);
        result
    }
}

impl EvidenceSource for ConfigfsTsm {
    fn tee(&self) -> Tee {
        if std::path::Path::new("/dev/tdx_guest").exists() {
            Tee::Tdx
        } else {
            Tee::Snp
        }
    }

    fn additional_evidence(&self, _nonce: &str, _key: &TeePubKey) -> Result<String> {
        Ok(String::new())
    }

    fn primary_evidence(&self, report_data: &[u8; 64]) -> Result<Value> {
        let (provider, out, aux) = self.report(report_data)?;
        match provider.as_str() {
            "tdx_guest" => Ok(serde_json::json!({"quote": STANDARD.encode(out)})),
            "sev_guest" => {
                let chain: Vec<Value> = snp_cert_table(&aux)
                    .into_iter()
                    .map(|(k, d)| serde_json::json!({"cert_type": k, "data": STANDARD.encode(d)}))
                    .collect();
                Ok(serde_json::json!({
                    "attestation_report": STANDARD.encode(out),
                    "cert_chain": chain,
                }))
            }
            other => Err(ClientError::Evidence(format!(
                "configfs-tsm provider '{other}' is not sev_guest or tdx_guest"
            ))),
        }
    }
}
