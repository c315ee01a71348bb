//! A KBS client (the guest side of RCAR): `auth` → `attest` → `resource`, over ureq with rustls.
//! Evidence comes from an [`EvidenceSource`]: configfs-tsm on real SNP/TDX guests, or the
//! simulator (in `cgx-guest-agent` and the tests). The TEE key is generated per client and never
//! leaves it; resources arrive as JWEs to it.

use cgx_protocol::kbs::jwe::{Curve, TeeKey};
pub use cgx_protocol::kbs::rcar::ClientError;
use cgx_protocol::kbs::rcar::{self, EvidenceSource};
use cgx_protocol::kbs_types::{Attestation, Response, Tee};

/// The HTTP agent type the clients share ([`agent`], [`agent_with`]), and a pinned service.
pub use cgx_http::Pin;
pub use ureq::Agent;
/// The URI type the transport parses URLs with (the `http` crate's, through ureq): a caller that
/// checks a KBS URL (the guest agent's loopback rule) parses it as the transport will.
pub use ureq::http::Uri;

type Result<T> = std::result::Result<T, ClientError>;

/// An HTTP agent for a cgx service (a KBS, a broker): [`cgx_http::Client::service`], trusting
/// `ca_pem`'s certificates (or the WebPKI roots).
pub fn agent(ca_pem: Option<&[u8]>) -> Result<ureq::Agent> {
    agent_with(ca_pem, &[])
}

/// [`agent`], connecting to the pinned host names at their addresses (a guest reaching its
/// services through the host channel's local forwarders; TLS still verifies the names).
pub fn agent_with(ca_pem: Option<&[u8]>, pins: &[cgx_http::Pin]) -> Result<ureq::Agent> {
    let roots = match ca_pem {
        Some(pem) => cgx_http::Roots::from_pem(pem).map_err(|e| ClientError::Transport {
            step: "setup",
            detail: e.to_string(),
        })?,
        None => cgx_http::Roots::WebPki,
    };
    let mut client = cgx_http::Client::service(roots);
    client.pins = pins.to_vec();
    Ok(client.agent())
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
