//! `cgx witness serve`: a C2SP tlog-witness (issue 33). `POST /add-checkpoint` cosigns
//! (tlog-cosignature/v1) a checkpoint of a log it is configured to witness when it extends the
//! latest checkpoint it cosigned for that log; the decision is `cgx_tlog::witness`'s, this
//! module is its I/O.
//!
//! **State.** For each log, the latest checkpoint cosigned, as the log signed it, in a file of
//! its own under `state_dir` (named by the SHA-256 of the origin). It is read back and checked
//! under the log's key at start. Check and persist are one step per log (a lock held across
//! both), and the file is replaced atomically (`durable::write_atomic`) before the answer is sent:
//! a witness never cosigns two checkpoints of one size, nor one that does not extend the last,
//! across crashes.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use cgx_tlog::note::{KeyKind, NoteKey, NoteSigner, open_checkpoint};
use cgx_tlog::witness::{self, AddCheckpoint, Latest, Refusal};
use serde::Deserialize;

use crate::ServiceError;

/// `cgx witness serve`'s configuration (TOML or JSON; overrides under `CGX_WITNESS__`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WitnessConfig {
    /// `host:port`.
    pub listen: String,
    #[serde(default)]
    pub tls: Option<crate::tls::TlsFiles>,
    #[serde(default)]
    pub insecure_dev: bool,
    /// The witness's name (its key's name in cosignature lines), e.g. `witness.example/w1`.
    pub name: String,
    /// Its Ed25519 PKCS#8 key (DER): a key of its own, used for nothing else.
    pub key: PathBuf,
    /// Where the latest cosigned checkpoint of each log is kept.
    pub state_dir: PathBuf,
    /// The logs it witnesses: their verifier keys (`<origin>+<id>+<key>`).
    pub logs: Vec<String>,
}

impl crate::config::ServiceConfig for WitnessConfig {
    const ENV_PREFIX: &'static str = "CGX_WITNESS";
    type Error = ServiceError;

    fn check(&self) -> Result<(), ServiceError> {
        if self.logs.is_empty() {
            return Err(ServiceError::Config(
                "[witness] logs: name at least one log".into(),
            ));
        }
        Ok(())
    }

    fn set_insecure_dev(&mut self) {
        self.insecure_dev = true;
        self.tls = None;
    }

    fn listener(&self) -> crate::ListenerConfig {
        crate::ListenerConfig::new(self.listen.clone(), self.tls.clone(), self.insecure_dev)
    }
}

/// A running witness's state.
pub struct Witness {
    key: NoteSigner,
    logs: Vec<NoteKey>,
    state_dir: PathBuf,
    /// Per log (origin): the latest cosigned, behind a lock held across check and persist.
    latest: HashMap<String, std::sync::Arc<tokio::sync::Mutex<Option<Latest>>>>,
}

impl std::fmt::Debug for Witness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Witness")
            .field("vkey", &self.key.vkey())
            .finish_non_exhaustive()
    }
}

impl Witness {
    /// Load the key and each log's state (checked under the log's key).
    pub fn open(config: &WitnessConfig) -> Result<Witness, ServiceError> {
        let der = std::fs::read(&config.key).map_err(|e| {
            ServiceError::Config(format!("witness key {}: {e}", config.key.display()))
        })?;
        let key = NoteSigner::from_pkcs8(&config.name, KeyKind::Cosignature, &der)
            .map_err(|e| ServiceError::Config(format!("witness key: {e}")))?;
        let mut logs = Vec::new();
        for v in &config.logs {
            let k = NoteKey::parse(v).map_err(|e| ServiceError::Config(format!("logs: {e}")))?;
            if k.kind() != KeyKind::Ed25519 {
                return Err(ServiceError::Config(format!(
                    "logs: {} is not a log's Ed25519 key",
                    k.name()
                )));
            }
            logs.push(k);
        }
        std::fs::create_dir_all(&config.state_dir).map_err(|e| {
            ServiceError::Config(format!("state_dir {}: {e}", config.state_dir.display()))
        })?;
        let mut latest = HashMap::new();
        for k in &logs {
            let path = state_file(&config.state_dir, k.name());
            let l = match std::fs::read(&path) {
                Ok(note) => {
                    let o = open_checkpoint(&note, k, &[], 0).map_err(|e| {
                        ServiceError::Config(format!("witness state {}: {e}", path.display()))
                    })?;
                    Some(Latest {
                        size: o.checkpoint.size(),
                        root: *o.checkpoint.hash(),
                    })
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => {
                    return Err(ServiceError::Config(format!(
                        "witness state {}: {e}",
                        path.display()
                    )));
                }
            };
            latest.insert(
                k.name().to_string(),
                std::sync::Arc::new(tokio::sync::Mutex::new(l)),
            );
        }
        Ok(Witness {
            key,
            logs,
            state_dir: config.state_dir.clone(),
            latest,
        })
    }

    /// Its verifier key (`<name>+<id>+<0x04 key>`), for logs and auditors.
    pub fn vkey(&self) -> String {
        self.key.vkey()
    }

    /// One `add-checkpoint`: the cosignature line(s), or the refusal. `now` is the time the
    /// cosignature states.
    pub async fn add_checkpoint(&self, body: &[u8], now: u64) -> Result<Vec<u8>, Refused> {
        let req = AddCheckpoint::parse(body)?;
        let (log, opened) = witness::open(&req, &self.logs)?;
        let slot = self
            .latest
            .get(log.name())
            .ok_or_else(|| Refusal::UnknownLog(log.name().to_string()))?
            .clone();
        // Check and persist in a task of its own that holds the log's lock throughout: a
        // request cancelled mid-way (its client gone) cannot release the lock while its state
        // file is still being written.
        let path = state_file(&self.state_dir, log.name());
        let note = req.checkpoint.clone();
        let judged = tokio::spawn(async move {
            let mut latest = slot.lock_owned().await;
            let new = witness::judge(&req, &opened, *latest).map_err(Refused::Protocol)?;
            if *latest != Some(new) {
                let file = path.clone();
                tokio::task::spawn_blocking(move || crate::durable::write_atomic(&file, &note))
                    .await
                    .map_err(|e| Refused::Internal(format!("persist: {e}")))?
                    .map_err(|e| Refused::Internal(format!("persist {}: {e}", path.display())))?;
                *latest = Some(new);
            }
            Ok::<_, Refused>(opened)
        })
        .await
        .map_err(|e| Refused::Internal(format!("check: {e}")))?;
        let opened = judged?;
        witness::cosignature(&opened, &self.key, now).map_err(|e| Refused::Internal(e.to_string()))
    }
}

/// Why a request got no cosignature: the protocol's refusal, or the witness's own failure.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error(transparent)]
    Protocol(#[from] Refusal),
    #[error("internal: {0}")]
    Internal(String),
}

fn state_file(dir: &std::path::Path, origin: &str) -> PathBuf {
    dir.join(format!(
        "{}.checkpoint",
        cgx_protocol::archive::address(origin.as_bytes())
    ))
}

/// The witness's routes: `POST /add-checkpoint`.
pub fn router(w: Arc<Witness>) -> Router {
    Router::new()
        .route("/add-checkpoint", axum::routing::post(add_checkpoint))
        .layer(axum::extract::DefaultBodyLimit::max(witness::MAX_BODY))
        .with_state(w)
}

async fn add_checkpoint(State(w): State<Arc<Witness>>, body: Bytes) -> Response {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    match w.add_checkpoint(&body, now).await {
        Ok(lines) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            )],
            lines,
        )
            .into_response(),
        Err(Refused::Protocol(r)) => {
            tracing::info!(status = r.status(), reason = %r, "add-checkpoint refused");
            let (ct, body) = r.body();
            let status = StatusCode::from_u16(r.status()).unwrap_or(StatusCode::BAD_REQUEST);
            (
                status,
                [(header::CONTENT_TYPE, HeaderValue::from_static(ct))],
                body,
            )
                .into_response()
        }
        Err(Refused::Internal(e)) => {
            tracing::error!(error = %e, "add-checkpoint failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "the witness could not persist\n",
            )
                .into_response()
        }
    }
}

/// Serve until `shutdown`.
pub async fn run(
    config: &WitnessConfig,
    shutdown: impl std::future::Future<Output = ()>,
    on_listen: impl FnOnce(std::net::SocketAddr),
) -> Result<(), ServiceError> {
    let w = Arc::new(Witness::open(config)?);
    tracing::info!(vkey = %w.vkey(), logs = w.logs.len(), "witness");
    let running = crate::server::start(
        &crate::config::ServiceConfig::listener(config),
        router(w),
        Vec::new(),
    )
    .await?;
    on_listen(running.addr());
    shutdown.await;
    running.shutdown().await;
    Ok(())
}
