//! A broker client over ureq (rustls on aws-lc-rs, as the KBS client): tenants submit and
//! watch jobs, operators register nodes and list them, nodes heartbeat. Errors keep the
//! broker's stable problem code.

use cgx_protocol::broker::{
    HeartbeatAnswer, JobSpec, JobView, MeteringAnswer, MeteringPost, NodeView, NonceResponse,
    PowAccepted, PowCommit, PowOpening, PowPost, Registered, Registration, ReportAnswer,
    ReportPost, routes,
};
use serde::de::DeserializeOwned;

/// What went wrong talking to the broker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    #[error("{url}: {detail}")]
    Transport { url: String, detail: String },
    /// The broker refused: its HTTP status, problem `code` and `detail`.
    #[error("HTTP {status} {code}: {detail}")]
    Refused {
        status: u16,
        code: String,
        detail: String,
    },
    #[error("unexpected answer: {0}")]
    Decode(String),
}

impl ClientError {
    /// The broker's problem code, if it refused.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Refused { code, .. } => Some(code),
            _ => None,
        }
    }
}

type Result<T> = std::result::Result<T, ClientError>;

/// A client for one broker.
pub struct BrokerClient {
    base: String,
    agent: ureq::Agent,
    /// Bearer API token (tenant, operator, auditor).
    token: Option<String>,
}

impl std::fmt::Debug for BrokerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerClient")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl BrokerClient {
    /// `base`: `https://…` (or `http://127.0.0.1:…` in development); `ca_pem`: the broker's CA
    /// (WebPKI roots when `None`); `token`: an API token.
    pub fn new(base: &str, ca_pem: Option<&[u8]>, token: Option<String>) -> Result<Self> {
        let agent = cgx_kbs::client::agent(ca_pem).map_err(|e| ClientError::Transport {
            url: base.to_string(),
            detail: e.to_string(),
        })?;
        Ok(BrokerClient {
            base: base.trim_end_matches('/').to_string(),
            agent,
            token,
        })
    }

    /// A client for `base` on an existing agent ([`cgx_kbs::client::agent_with`]).
    pub fn with_agent(base: &str, agent: ureq::Agent, token: Option<String>) -> Self {
        BrokerClient {
            base: base.trim_end_matches('/').to_string(),
            agent,
            token,
        }
    }

    /// The same broker with another API token.
    pub fn with_token(&self, token: Option<String>) -> Self {
        BrokerClient {
            base: self.base.clone(),
            agent: self.agent.clone(),
            token,
        }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
        bearer: Option<&str>,
    ) -> Result<T> {
        self.call_if(method, path, body, bearer, None)
    }

    /// [`Self::call`] with an `If-Match` precondition.
    fn call_if<T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
        bearer: Option<&str>,
        if_match: Option<&str>,
    ) -> Result<T> {
        let bytes = self.request(method, path, body, bearer, if_match)?;
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// A file of the broker's transparency log, by its path under `/v1/log/` (`checkpoint`,
    /// `tile/…`, `tile/entries/…` — the last for auditors): its bytes as served.
    pub fn log_file(&self, path: &str) -> Result<Vec<u8>> {
        self.request("GET", &format!("/v1/log/{path}"), None, None, None)
    }

    /// The response body of a request answered 2xx.
    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<Vec<u8>>,
        bearer: Option<&str>,
        if_match: Option<&str>,
    ) -> Result<Vec<u8>> {
        let url = format!("{}{path}", self.base);
        let transport = |e: &dyn std::fmt::Display| ClientError::Transport {
            url: url.clone(),
            detail: e.to_string(),
        };
        let bearer = bearer.or(self.token.as_deref());
        let mut resp = match method {
            "GET" => {
                let mut r = self.agent.get(&url);
                if let Some(t) = bearer {
                    r = r.header("authorization", &format!("Bearer {t}"));
                }
                r.call()
            }
            _ => {
                let mut r = self
                    .agent
                    .post(&url)
                    .header("content-type", "application/json");
                if let Some(t) = bearer {
                    r = r.header("authorization", &format!("Bearer {t}"));
                }
                if let Some(m) = if_match {
                    r = r.header("if-match", m);
                }
                r.send(body.unwrap_or_default())
            }
        }
        .map_err(|e| transport(&e))?;
        let status = resp.status().as_u16();
        let bytes = resp
            .body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_vec()
            .map_err(|e| transport(&e))?;
        if !(200..300).contains(&status) {
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            return Err(ClientError::Refused {
                status,
                code: v["code"].as_str().unwrap_or("unknown").to_string(),
                detail: v["detail"]
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| String::from_utf8_lossy(&bytes).chars().take(200).collect()),
            });
        }
        Ok(bytes)
    }

    fn post<T: DeserializeOwned>(&self, path: &str, body: &impl serde::Serialize) -> Result<T> {
        let body = serde_json::to_vec(body).map_err(|e| ClientError::Decode(e.to_string()))?;
        self.call("POST", path, Some(body), None)
    }

    pub fn nonce(&self) -> Result<NonceResponse> {
        self.call("POST", routes::NONCE, None, None)
    }

    pub fn register(&self, reg: &Registration) -> Result<Registered> {
        self.post(routes::NODES, reg)
    }

    /// A heartbeat: `token` is the node's signed heartbeat
    /// ([`cgx_protocol::broker::heartbeat_token`]).
    pub fn heartbeat(&self, node_id: &str, token: &str) -> Result<HeartbeatAnswer> {
        self.call(
            "POST",
            &routes::with_id(routes::HEARTBEAT, node_id),
            None,
            Some(token),
        )
    }

    /// Send a node's signed workload report (`cgx_protocol::broker::workload_report_token`).
    pub fn report(&self, node_id: &str, report: &str) -> Result<ReportAnswer> {
        let body = serde_json::to_vec(&ReportPost {
            report: report.to_string(),
        })
        .map_err(|e| ClientError::Decode(e.to_string()))?;
        self.call(
            "POST",
            &routes::with_id(routes::REPORTS, node_id),
            Some(body),
            None,
        )
    }

    /// Send a node's signed metering record (`cgx_protocol::metering::MeteringRecord`).
    pub fn metering(&self, node_id: &str, record: &str) -> Result<MeteringAnswer> {
        let body = serde_json::to_vec(&MeteringPost {
            record: record.to_string(),
        })
        .map_err(|e| ClientError::Decode(e.to_string()))?;
        self.call(
            "POST",
            &routes::with_id(routes::METERING, node_id),
            Some(body),
            None,
        )
    }

    /// Commit to a proof-of-work challenge: the receipt (`cgx_protocol::broker::PowReceipt`
    /// under the node key) naming the root. The answer carries the opening.
    pub fn pow_commit(&self, node_id: &str, challenge: &str, receipt: &str) -> Result<PowOpening> {
        let body = serde_json::to_vec(&PowCommit {
            receipt: receipt.to_string(),
        })
        .map_err(|e| ClientError::Decode(e.to_string()))?;
        let path = routes::with_id(routes::POW, node_id).replace("{challenge}", challenge);
        self.call("POST", &path, Some(body), None)
    }

    /// Send the proof the opening asked for: its receipt and bytes (`cgx_pow::wire`).
    pub fn pow_proof(
        &self,
        node_id: &str,
        challenge: &str,
        receipt: &str,
        proof: &[u8],
    ) -> Result<PowAccepted> {
        use base64::Engine as _;
        let body = serde_json::to_vec(&PowPost {
            receipt: receipt.to_string(),
            proof: base64::engine::general_purpose::STANDARD.encode(proof),
        })
        .map_err(|e| ClientError::Decode(e.to_string()))?;
        let path = routes::with_id(routes::POW_PROOF, node_id).replace("{challenge}", challenge);
        self.call("POST", &path, Some(body), None)
    }

    pub fn nodes(&self) -> Result<Vec<NodeView>> {
        #[derive(serde::Deserialize)]
        struct Nodes {
            nodes: Vec<NodeView>,
        }
        Ok(self.call::<Nodes>("GET", routes::NODES, None, None)?.nodes)
    }

    pub fn node(&self, id: &str) -> Result<NodeView> {
        self.call("GET", &routes::with_id(routes::NODE, id), None, None)
    }

    /// Ask node `id` to re-attest at its next heartbeat.
    pub fn reattest(&self, id: &str) -> Result<NodeView> {
        self.call("POST", &routes::with_id(routes::REATTEST, id), None, None)
    }

    pub fn submit(&self, spec: &JobSpec) -> Result<JobView> {
        self.post(routes::JOBS, spec)
    }

    /// Submit a job spec given as JSON as it stands (a file a tenant wrote): the broker, not
    /// this client, judges its shape.
    pub fn submit_json(&self, spec: &serde_json::Value) -> Result<JobView> {
        self.post(routes::JOBS, spec)
    }

    pub fn job(&self, id: &str) -> Result<JobView> {
        self.call("GET", &routes::with_id(routes::JOB, id), None, None)
    }

    pub fn jobs(&self, tenant: Option<&str>) -> Result<Vec<JobView>> {
        #[derive(serde::Deserialize)]
        struct Jobs {
            jobs: Vec<JobView>,
        }
        let path = match tenant {
            Some(t) => format!("{}?tenant={t}", routes::JOBS),
            None => routes::JOBS.into(),
        };
        Ok(self.call::<Jobs>("GET", &path, None, None)?.jobs)
    }

    /// Store reference values (the document `cgx measure … --reference-values` writes) in
    /// place of version `replaces` (what [`Self::reference_values`] said; 0: the
    /// configuration's) and put them in force: `{"version", "sha256", "policy_id"}`. Another
    /// put since is a `Conflict`.
    pub fn set_reference_values(
        &self,
        doc: &serde_json::Value,
        replaces: i64,
    ) -> Result<serde_json::Value> {
        let body = serde_json::to_vec(doc).map_err(|e| ClientError::Decode(e.to_string()))?;
        let tag = format!("\"{replaces}\"");
        self.call_if(
            "POST",
            routes::REFERENCE_VALUES,
            Some(body),
            None,
            Some(&tag),
        )
    }

    /// The reference values in force: `{"version", "reference_values"}`.
    pub fn reference_values(&self) -> Result<serde_json::Value> {
        self.call("GET", routes::REFERENCE_VALUES, None, None)
    }

    /// The admin audit trail: `{"events": [{"at", "actor", "action", "detail"}]}`.
    pub fn admin_events(&self) -> Result<serde_json::Value> {
        self.call("GET", routes::ADMIN_EVENTS, None, None)
    }

    pub fn cancel(&self, id: &str) -> Result<JobView> {
        self.call("POST", &routes::with_id(routes::CANCEL, id), None, None)
    }

    /// Deposit to `tenant/<name>` or `stake/<operator>` (a `ledger` or `*` key).
    pub fn deposit(
        &self,
        req: &cgx_protocol::ledger::DepositRequest,
    ) -> Result<cgx_protocol::ledger::DepositAnswer> {
        self.post(routes::DEPOSITS, req)
    }

    /// Every account's sums (auditors).
    pub fn accounts(&self) -> Result<Vec<cgx_protocol::ledger::AccountBalance>> {
        self.call("GET", routes::ACCOUNTS, None, None)
    }

    /// A tenant's (`tenant`) or an operator's (`operator`) statement over `[from, to)`.
    pub fn statement(
        &self,
        tenant: Option<&str>,
        operator: Option<&str>,
        from: Option<i64>,
        to: Option<i64>,
    ) -> Result<cgx_protocol::ledger::Statement> {
        let mut q = Vec::new();
        if let Some(t) = tenant {
            q.push(format!("tenant={t}"));
        }
        if let Some(o) = operator {
            q.push(format!("operator={o}"));
        }
        if let Some(f) = from {
            q.push(format!("from={f}"));
        }
        if let Some(t) = to {
            q.push(format!("to={t}"));
        }
        self.call(
            "GET",
            &format!("{}?{}", routes::STATEMENTS, q.join("&")),
            None,
            None,
        )
    }

    /// The offers `spec` would get now; nothing is placed.
    pub fn quote(&self, spec: &JobSpec) -> Result<cgx_protocol::ledger::QuoteAnswer> {
        self.post(routes::QUOTES, spec)
    }

    /// Record an auditor's verdict on the log (an `audit.verdict` leaf).
    pub fn log_verdict(
        &self,
        v: &cgx_protocol::broker::LogVerdict,
    ) -> Result<cgx_protocol::broker::VerdictRecorded> {
        self.post(routes::LOG_VERDICTS, v)
    }
}
