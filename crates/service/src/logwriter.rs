//! The log writer a service runs over its audit trail (issue 33): `[log]` configuration, the
//! pin kept beside the key (the last tree this writer signed: every later one extends it), the
//! integration pass (the service supplies the write transaction, `tlog::integrate` does the
//! rest), and the witnesses (C2SP tlog-witness) each checkpoint is submitted to, the newest
//! their quorum cosigned being the one published. The broker and the KBS each run one, over
//! their own tables, under their own origin and key.

use std::path::PathBuf;

use cgx_tlog::note::{KeyKind, NoteKey, NoteSigner, open_checkpoint};
use serde::Deserialize;

use crate::ServiceError;
use crate::tlog::{Integrated, LogStoreError, Pinned};

/// `[log]`: the transparency log every audited decision becomes a leaf of.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// The log's origin: the first line of its checkpoints and its key's name
    /// (`broker.example.com/log`).
    pub origin: String,
    /// Ed25519 PKCS#8 (DER) that signs the checkpoints: a key of its own.
    pub key: PathBuf,
    /// How often committed audit rows are integrated and a checkpoint signed (milliseconds;
    /// default 1000).
    #[serde(default = "default_log_interval")]
    pub interval_ms: u64,
    /// Where the last checkpoint this writer signed is kept, outside the database: the log
    /// only ever extends it, whatever the database says (default: the key's path with
    /// `.state` appended).
    #[serde(default)]
    pub state: Option<PathBuf>,
    /// The witnesses asked to cosign each checkpoint (C2SP tlog-witness).
    #[serde(default)]
    pub witnesses: Vec<WitnessRef>,
    /// How many of them must cosign a checkpoint before it is published (0: published as
    /// signed). Acknowledging a decision never waits for witnesses: its leaf is durable at
    /// commit; only publication waits.
    #[serde(default)]
    pub quorum: usize,
    /// Other logs whose checkpoints this log records (`log.anchor` leaves): each new checkpoint
    /// they publish, verified under their key, becomes a leaf here, so that one history is
    /// bound to the other (the broker anchors the KBS's log).
    #[serde(default)]
    pub anchors: Vec<AnchorRef>,
    /// A directory the published log is also written to, laid out as C2SP tlog-tiles serves
    /// it (checkpoint, hash tiles, entry bundles), for any static web server or object store to
    /// serve. Entry bundles name tenants and nodes: serve it to auditors only.
    #[serde(default)]
    pub export_dir: Option<PathBuf>,
}

/// A log this log anchors.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AnchorRef {
    /// Its verifier key (`<origin>+<id>+<key>`).
    pub vkey: String,
    /// Its prefix: `checkpoint` is read under it.
    pub url: String,
    /// The CA its TLS certificate is under (default: the WebPKI roots).
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// A KBS admin key (Ed25519 PKCS#8) with the `:log-reader` scope: the log's entries are
    /// read with it and mirrored, each checked into the log's checkpoint (the broker's
    /// record of the KBS's releases, by lease). None: checkpoints only.
    #[serde(default)]
    pub reader_key: Option<PathBuf>,
}

/// A checkpoint of an anchored log, verified, not recorded before.
#[derive(Debug, Clone)]
pub struct AnchorSeen {
    pub origin: String,
    pub size: u64,
    /// Its root hash, base64.
    pub root: String,
    /// SHA-256 (hex) of the signed note as read.
    pub note_sha256: String,
}

fn default_log_interval() -> u64 {
    1000
}

/// A witness the log submits its checkpoints to.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct WitnessRef {
    /// Its verifier key (`<name>+<id>+<0x04 key>`).
    pub vkey: String,
    /// Its submission prefix: `add-checkpoint` is posted under it.
    pub url: String,
    /// The CA its TLS certificate is under (default: the WebPKI roots).
    #[serde(default)]
    pub ca: Option<PathBuf>,
}

impl LogConfig {
    /// The pin's file.
    pub fn state_path(&self) -> PathBuf {
        self.state
            .clone()
            .unwrap_or_else(|| PathBuf::from(format!("{}.state", self.key.display())))
    }
}

/// A witness, as the writer asks it.
struct LogWitness {
    key: NoteKey,
    /// `<prefix>/add-checkpoint`.
    url: String,
    agent: ureq::Agent,
    /// The size it is believed to hold (0 at start: it says otherwise with a 409).
    holds: std::sync::Mutex<u64>,
}

/// `path` under anchor `a`'s prefix, at most `limit` bytes, off the runtime's threads; with
/// its reader's token (a KBS admin token, a minute) when `read_as_reader` and it has one.
async fn get(a: &Anchor, path: &str, limit: u64, read_as_reader: bool) -> Result<Vec<u8>, String> {
    let url = format!("{}/{path}", a.prefix);
    let bearer = match (&a.reader, read_as_reader) {
        (Some(s), true) => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
                .unwrap_or(0);
            Some(
                crate::auth::BearerKind::KbsAdmin
                    .sign(s, now, now + 60)
                    .map_err(|e| e.to_string())?,
            )
        }
        _ => None,
    };
    let agent = a.agent.clone();
    tokio::task::spawn_blocking(move || {
        let mut req = agent.get(&url);
        if let Some(t) = &bearer {
            req = req.header("authorization", &format!("Bearer {t}"));
        }
        let mut r = req.call().map_err(|e| format!("{url}: {e}"))?;
        if r.status().as_u16() != 200 {
            return Err(format!("{url}: {}", r.status()));
        }
        r.body_mut()
            .with_config()
            .limit(limit)
            .read_to_vec()
            .map_err(|e| format!("{url}: {e}"))
    })
    .await
    .map_err(|e| e.to_string())?
}

/// A log anchored, as the writer reads it.
struct Anchor {
    key: NoteKey,
    /// The log's prefix (`<prefix>/checkpoint`, `<prefix>/tile/entries/…`).
    prefix: String,
    /// Reads its entries (KBS admin tokens with `:log-reader`).
    reader: Option<cgx_protocol::signed::Signer>,
    agent: ureq::Agent,
    last: std::sync::Mutex<Option<(u64, cgx_tlog::Hash)>>,
}

/// A service's log writer.
pub struct LogWriter {
    key: NoteSigner,
    anchors: Vec<Anchor>,
    /// Where the published log is exported, and the size exported last.
    export: Option<(PathBuf, tokio::sync::Mutex<u64>)>,
    pin_path: PathBuf,
    /// The pin, and the signed checkpoint it was moved to if its file could not be written
    /// yet (written before the next pass integrates anything).
    pin: tokio::sync::Mutex<(Option<Pinned>, Option<Vec<u8>>)>,
    witnesses: Vec<LogWitness>,
    quorum: usize,
    interval: std::time::Duration,
}

impl std::fmt::Debug for LogWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogWriter")
            .field("vkey", &self.key.vkey())
            .finish_non_exhaustive()
    }
}

impl LogWriter {
    /// The writer `config` describes: its key read (refused if its public key is one of
    /// `other_keys`, the service's other signing keys), its pin read and checked under it, its
    /// witnesses' keys checked.
    pub fn open(config: &LogConfig, other_keys: &[[u8; 32]]) -> Result<LogWriter, ServiceError> {
        let bad = |m: String| ServiceError::Config(format!("[log] {m}"));
        let der = std::fs::read(&config.key)
            .map_err(|e| bad(format!("key {}: {e}", config.key.display())))?;
        let key = NoteSigner::from_pkcs8(&config.origin, KeyKind::Ed25519, &der)
            .map_err(|e| bad(e.to_string()))?;
        if other_keys.contains(&key.public_key()) {
            return Err(bad(
                "the log key is another of this service's keys: checkpoints need a key of their own"
                    .into(),
            ));
        }
        let pin_path = config.state_path();
        let pin = crate::tlog::load_pin(&pin_path, &key.verifier())
            .map_err(|e| bad(format!("state: {e}")))?;
        if config.quorum > config.witnesses.len() {
            return Err(bad(format!(
                "quorum {} is more than the {} witnesses named",
                config.quorum,
                config.witnesses.len()
            )));
        }
        let mut witnesses = Vec::new();
        for w in &config.witnesses {
            let wkey = NoteKey::parse(&w.vkey).map_err(|e| bad(format!("witness: {e}")))?;
            if wkey.kind() != KeyKind::Cosignature {
                return Err(bad(format!(
                    "witness {} is not a cosignature/v1 key",
                    wkey.name()
                )));
            }
            let roots = match &w.ca {
                Some(p) => {
                    let pem = std::fs::read(p)
                        .map_err(|e| bad(format!("witness CA {}: {e}", p.display())))?;
                    cgx_http::Roots::from_pem(&pem).map_err(|e| bad(format!("witness CA: {e}")))?
                }
                None => cgx_http::Roots::WebPki,
            };
            let mut client = cgx_http::Client::service(roots);
            client.timeout = std::time::Duration::from_secs(10);
            witnesses.push(LogWitness {
                key: wkey,
                url: format!("{}/add-checkpoint", w.url.trim_end_matches('/')),
                agent: client.agent(),
                holds: std::sync::Mutex::new(0),
            });
        }
        let mut anchors = Vec::new();
        for a in &config.anchors {
            let akey = NoteKey::parse(&a.vkey).map_err(|e| bad(format!("anchor: {e}")))?;
            if akey.kind() != KeyKind::Ed25519 {
                return Err(bad(format!("anchor {} is not a log's key", akey.name())));
            }
            let roots = match &a.ca {
                Some(p) => {
                    let pem = std::fs::read(p)
                        .map_err(|e| bad(format!("anchor CA {}: {e}", p.display())))?;
                    cgx_http::Roots::from_pem(&pem).map_err(|e| bad(format!("anchor CA: {e}")))?
                }
                None => cgx_http::Roots::WebPki,
            };
            let mut client = cgx_http::Client::service(roots);
            client.timeout = std::time::Duration::from_secs(10);
            let reader =
                match &a.reader_key {
                    Some(p) => {
                        let der = std::fs::read(p)
                            .map_err(|e| bad(format!("anchor reader key {}: {e}", p.display())))?;
                        Some(cgx_protocol::signed::Signer::from_pkcs8(&der).map_err(|_| {
                            bad("anchor reader key: not an Ed25519 PKCS#8 key".into())
                        })?)
                    }
                    None => None,
                };
            anchors.push(Anchor {
                key: akey,
                prefix: a.url.trim_end_matches('/').to_string(),
                reader,
                agent: client.agent(),
                last: std::sync::Mutex::new(None),
            });
        }
        Ok(LogWriter {
            key,
            anchors,
            export: config
                .export_dir
                .clone()
                .map(|d| (d, tokio::sync::Mutex::new(0))),
            pin_path,
            pin: tokio::sync::Mutex::new((pin, None)),
            witnesses,
            quorum: config.quorum,
            interval: std::time::Duration::from_millis(config.interval_ms.max(10)),
        })
    }

    /// The key that signs the checkpoints.
    pub fn key(&self) -> &NoteSigner {
        &self.key
    }

    /// How often the integrator runs.
    pub fn interval(&self) -> std::time::Duration {
        self.interval
    }

    /// One integration pass: `integrate` runs `tlog::integrate` in the service's write
    /// transaction, extending the pin it is given; once it committed, the pin moves to the
    /// checkpoint it signed (a crash in between leaves an older pin, which the log still
    /// extends). One pass at a time.
    pub async fn pass<F, Fut, E>(&self, integrate: F) -> Result<Option<Integrated>, E>
    where
        F: FnOnce(Option<Pinned>) -> Fut,
        Fut: std::future::Future<Output = Result<Option<Integrated>, E>>,
        E: From<LogStoreError>,
    {
        let mut pin = self.pin.lock().await;
        // A pin whose file failed to be written is written first: nothing more is signed
        // while the file lags behind what was signed (a database rolled back to it would
        // otherwise get a fork signed after a restart).
        if let Some(note) = &pin.1 {
            crate::tlog::save_pin(&self.pin_path, note)?;
            pin.1 = None;
        }
        let done = integrate(pin.0).await?;
        if let Some(d) = &done {
            // The checkpoint is signed and committed: this process holds to it whether or not
            // its file is written now.
            pin.0 = Some(Pinned {
                size: d.size,
                root: d.root,
            });
            if let Err(e) = crate::tlog::save_pin(&self.pin_path, &d.checkpoint) {
                pin.1 = Some(d.checkpoint.clone());
                return Err(e.into());
            }
        }
        Ok(done)
    }

    /// The anchored logs' checkpoints not recorded yet: each read, verified under its log's
    /// key, and new (another size or root than the last recorded, which includes one that went
    /// backwards: the leaf keeps what was seen, and the auditor judges). A log that does not
    /// answer or whose checkpoint does not verify is logged and skipped.
    pub async fn new_anchors(&self) -> Vec<AnchorSeen> {
        let mut out = Vec::new();
        for a in &self.anchors {
            // Read as anyone reads it: the checkpoint recorded is the one every reader sees.
            let read = get(a, "checkpoint", 64 * 1024, false).await;
            let note = match read {
                Ok(n) => n,
                Err(e) => {
                    tracing::debug!(log = %a.key.name(), error = %e, "anchored log not read");
                    continue;
                }
            };
            let opened = match open_checkpoint(&note, &a.key, &[], 0) {
                Ok(o) => o,
                Err(e) => {
                    tracing::warn!(log = %a.key.name(), error = %e, "anchored log's checkpoint refused");
                    continue;
                }
            };
            let now = (opened.checkpoint.size(), *opened.checkpoint.hash());
            let Ok(mut last) = a.last.lock() else {
                continue;
            };
            if *last == Some(now) {
                continue;
            }
            *last = Some(now);
            out.push(AnchorSeen {
                origin: a.key.name().to_string(),
                size: now.0,
                root: now.1.to_string(),
                note_sha256: cgx_protocol::archive::address(&note),
            });
        }
        out
    }

    /// The anchored logs whose entries this writer may read (a reader key): their origins.
    pub fn mirrored(&self) -> Vec<String> {
        self.anchors
            .iter()
            .filter(|a| a.reader.is_some())
            .map(|a| a.key.name().to_string())
            .collect()
    }

    /// `path` under the anchored log `origin`'s prefix, at most `limit` bytes, with a reader's
    /// token where this writer has one.
    pub async fn anchored_get(
        &self,
        origin: &str,
        path: &str,
        limit: u64,
    ) -> Result<Vec<u8>, String> {
        let a = self
            .anchors
            .iter()
            .find(|a| a.key.name() == origin)
            .ok_or_else(|| format!("{origin} is not anchored"))?;
        get(a, path, limit, true).await
    }

    /// Forget what was recorded of `origin` (its leaf did not commit: record it again).
    pub fn anchor_unrecorded(&self, origin: &str) {
        for a in &self.anchors {
            if a.key.name() == origin
                && let Ok(mut l) = a.last.lock()
            {
                *l = None;
            }
        }
    }

    /// Write the newest published checkpoint's tiles and entry bundles that are new since the
    /// last export into `[log] export_dir`, then the checkpoint (last, atomically): a reader of
    /// the directory never finds a checkpoint whose tiles are not there yet. The size exported.
    pub async fn export(&self, pool: &sqlx::AnyPool) -> Result<u64, LogStoreError> {
        let Some((dir, done)) = &self.export else {
            return Ok(0);
        };
        let mut done = done.lock().await;
        let Some(note) = self.published(pool).await? else {
            return Ok(*done);
        };
        let opened = open_checkpoint(&note, &self.key.verifier(), &[], 0)?;
        let size = opened.checkpoint.size();
        if size <= *done {
            return Ok(*done);
        }
        let io = |p: &std::path::Path, e: std::io::Error| {
            LogStoreError::Pin(format!("export {}: {e}", p.display()))
        };
        for t in cgx_tlog::Tile::new_tiles(cgx_tlog::HEIGHT, *done, size) {
            let mut paths = vec![cgx_tlog::paths::tile_path(&t)];
            if t.level() == 0 {
                paths.push(cgx_tlog::paths::tile_path(&cgx_tlog::paths::bundle_tile(
                    t.level_index(),
                    t.width(),
                )));
            }
            for p in paths {
                let Some(bytes) = crate::tlog::tile(pool, &p, true).await? else {
                    return Err(LogStoreError::Tampered(format!(
                        "{p} of a published tree is not stored"
                    )));
                };
                let file = dir.join(&p);
                if let Some(parent) = file.parent() {
                    std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
                }
                std::fs::write(&file, bytes).map_err(|e| io(&file, e))?;
            }
        }
        let cp = dir.join("checkpoint");
        crate::durable::write_atomic(&cp, &note).map_err(|e| io(&cp, e))?;
        *done = size;
        Ok(size)
    }

    /// The newest published checkpoint: the newest the quorum of witnesses cosigned (any signed
    /// one with no quorum), with its cosignatures.
    pub async fn published(&self, pool: &sqlx::AnyPool) -> Result<Option<Vec<u8>>, LogStoreError> {
        crate::tlog::published(pool, self.quorum).await
    }

    /// Submit the newest checkpoint to the witnesses: each answer's line is checked under its
    /// witness's key before it is kept. A witness that holds an older size than believed says
    /// so (409) and is asked again with a proof from there; one that refuses otherwise is
    /// logged and asked again at the next round. How many cosigned it.
    pub async fn witness_round(&self, pool: &sqlx::AnyPool) -> Result<usize, LogStoreError> {
        if self.witnesses.is_empty() {
            return Ok(0);
        }
        let Some((size, note, witnessed)) = crate::tlog::newest(pool).await? else {
            return Ok(0);
        };
        if witnessed >= self.witnesses.len() as u64 {
            return Ok(witnessed as usize);
        }
        let signed = log_signed_only(&note).ok_or_else(|| {
            LogStoreError::Tampered("a stored checkpoint without its signature".into())
        })?;
        let mut lines = Vec::new();
        for w in &self.witnesses {
            match self.submit(pool, w, size, &signed).await {
                Ok(line) => lines.push(line),
                Err(e) => {
                    tracing::warn!(witness = %w.key.name(), error = %e, "checkpoint not cosigned")
                }
            }
        }
        if (lines.len() as u64) <= witnessed {
            return Ok(witnessed as usize);
        }
        let cosigned = cgx_tlog::witness::add_cosignatures(&signed, &lines);
        let keys: Vec<NoteKey> = self.witnesses.iter().map(|w| w.key.clone()).collect();
        let opened = open_checkpoint(&cosigned, &self.key.verifier(), &keys, 0)?;
        crate::tlog::set_witnessed(pool, size, &cosigned, opened.cosigned.len()).await?;
        if opened.cosigned.len() >= self.quorum {
            tracing::debug!(
                size,
                cosigned = opened.cosigned.len(),
                "checkpoint published"
            );
        }
        Ok(opened.cosigned.len())
    }

    /// One witness's cosignature line for checkpoint `signed` (of `size` leaves).
    async fn submit(
        &self,
        pool: &sqlx::AnyPool,
        w: &LogWitness,
        size: u64,
        signed: &[u8],
    ) -> Result<Vec<u8>, String> {
        for _ in 0..2 {
            let old = *w.holds.lock().map_err(|_| "a poisoned lock")?;
            if old > size {
                return Err(format!(
                    "the witness holds {old} leaves, more than this checkpoint's {size}: a fork, or another log under this name"
                ));
            }
            let proof = crate::tlog::prove_tree(pool, size, old)
                .await
                .map_err(|e| e.to_string())?;
            let body = cgx_tlog::witness::AddCheckpoint {
                old,
                proof,
                checkpoint: signed.to_vec(),
            }
            .to_bytes();
            let (agent, url) = (w.agent.clone(), w.url.clone());
            let (status, ct, answer) = tokio::task::spawn_blocking(move || {
                let mut r = agent
                    .post(&url)
                    .content_type("text/plain; charset=utf-8")
                    .send(&body[..])
                    .map_err(|e| format!("{url}: {e}"))?;
                let ct = r
                    .headers()
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string();
                let answer = r
                    .body_mut()
                    .with_config()
                    .limit(16 * 1024)
                    .read_to_vec()
                    .map_err(|e| format!("{url}: {e}"))?;
                Ok::<_, String>((r.status().as_u16(), ct, answer))
            })
            .await
            .map_err(|e| e.to_string())??;
            match status {
                200 => {
                    // Only this witness's own line is kept: a line it adds in another
                    // witness's name would otherwise spoil the note the others cosigned.
                    let prefix = format!("\u{2014} {} ", w.key.name());
                    let answer: Vec<u8> = String::from_utf8_lossy(&answer)
                        .lines()
                        .find(|l| l.starts_with(&prefix))
                        .map(|l| format!("{l}\n").into_bytes())
                        .ok_or("no cosignature line of this witness in its answer")?;
                    let cosigned =
                        cgx_tlog::witness::add_cosignatures(signed, std::slice::from_ref(&answer));
                    open_checkpoint(
                        &cosigned,
                        &self.key.verifier(),
                        std::slice::from_ref(&w.key),
                        1,
                    )
                    .map_err(|e| format!("its answer is not its cosignature: {e}"))?;
                    *w.holds.lock().map_err(|_| "a poisoned lock")? = size;
                    return Ok(answer);
                }
                409 if ct.starts_with(cgx_tlog::witness::SIZE_CONTENT_TYPE) => {
                    let held = cgx_tlog::witness::parse_size(&answer)
                        .ok_or("a 409 without the size it holds")?;
                    if held == old {
                        return Err(format!(
                            "the witness holds {held} leaves with another root: a fork"
                        ));
                    }
                    *w.holds.lock().map_err(|_| "a poisoned lock")? = held;
                }
                other => {
                    let text =
                        String::from_utf8_lossy(&answer[..answer.len().min(512)]).into_owned();
                    return Err(format!("{other}: {}", text.trim_end()));
                }
            }
        }
        Err("the witness moved twice while asked".into())
    }
}

/// A checkpoint note as the log signed it: its text and the log's signature line, which comes
/// first (cosignatures are added after it).
pub fn log_signed_only(note: &[u8]) -> Option<Vec<u8>> {
    let split = note.windows(2).position(|w| w == b"\n\n")? + 2;
    let first = note[split..].iter().position(|&b| b == b'\n')?;
    Some(note[..split + first + 1].to_vec())
}

/// The integrator a service runs: every `writer.interval()`, passes until one appends less
/// than `full` rows (a backlog drains one bounded transaction after another), then a witness
/// round. `pass` runs one pass; `round` one witness round.
pub async fn integrator<P, PF, R, RF, E>(
    interval: std::time::Duration,
    full: u64,
    pass: P,
    round: R,
) where
    P: Fn() -> PF,
    PF: std::future::Future<Output = Result<Option<Integrated>, E>>,
    R: Fn() -> RF,
    RF: std::future::Future<Output = Result<usize, E>>,
    E: std::fmt::Display,
{
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        loop {
            match pass().await {
                Ok(Some(d)) => {
                    tracing::debug!(size = d.size, "log checkpoint signed");
                    if d.appended < full {
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::error!(error = %e, "log not integrated");
                    break;
                }
            }
        }
        if let Err(e) = round().await {
            tracing::warn!(error = %e, "witnesses not asked");
        }
    }
}
