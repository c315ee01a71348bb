//! A service's transparency log over its audit trail (issue 33): every audit row — recorded in
//! the transaction of the decision it describes, so durable before that decision is
//! acknowledged — becomes a leaf (`AuditEvent::leaf`, one trail, not two). An integrator
//! appends the rows committed since its last pass to the tree (`log_leaves`, and the stored
//! hashes of Go sumdb's layout in `log_hashes`), and signs a checkpoint of the new size
//! (`log_checkpoints`), all in one write transaction: a crash loses nothing (the rows are
//! there; the next pass takes them) and repeats nothing (a leaf's index and its row's `seq`
//! are unique). Tiles and entry bundles are read back from those tables ([`tile`]).
//!
//! Before it signs, the integrator checks that the tree it extends is the one its last
//! checkpoint signed (the frontier's hashes recompute that root): a database writer who edited
//! them stops the log rather than have it sign a fork.

use std::collections::HashMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use cgx_tlog::note::{NoteSigner, open_checkpoint, sign_checkpoint};
use cgx_tlog::tlog_tiles::{self, HashReader};
use cgx_tlog::{Checkpoint, HEIGHT, Hash, MAX_LEAF, paths};
use sqlx::Row;

use crate::audit::AuditEvent;

/// The log's tables (both backends), for each service's migrations.
pub const LOG_TABLES: &str = "CREATE TABLE log_leaves (idx BIGINT PRIMARY KEY, audit_seq BIGINT NOT NULL UNIQUE, leaf TEXT NOT NULL);
     CREATE TABLE log_hashes (idx BIGINT PRIMARY KEY, hash TEXT NOT NULL);
     CREATE TABLE log_checkpoints (size BIGINT PRIMARY KEY, at BIGINT NOT NULL, note TEXT NOT NULL)";

/// The column saying how many witnesses cosigned a checkpoint (a migration after
/// [`LOG_TABLES`]): `/checkpoint` serves the newest with the configured quorum.
pub const LOG_WITNESSED: &str =
    "ALTER TABLE log_checkpoints ADD COLUMN witnessed BIGINT NOT NULL DEFAULT 0";

/// Why the log could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum LogStoreError {
    #[error("log storage: {0}")]
    Db(#[from] sqlx::Error),
    #[error("log: {0}")]
    Log(#[from] cgx_tlog::LogError),
    /// The stored tree is not the one the last checkpoint signed: nothing is signed until an
    /// operator looks.
    #[error("the log's stored tree does not match its last checkpoint: {0}")]
    Tampered(String),
    /// The file keeping the last tree this log signed could not be read or written.
    #[error("the log's pin: {0}")]
    Pin(String),
}

impl From<tlog_tiles::Error> for LogStoreError {
    fn from(e: tlog_tiles::Error) -> Self {
        LogStoreError::Log(e.into())
    }
}

/// Stored hashes by index.
#[derive(Default)]
struct Hashes(HashMap<u64, Hash>);

impl HashReader for Hashes {
    fn read_hashes(&self, indexes: &[u64]) -> Result<Vec<Hash>, tlog_tiles::Error> {
        indexes
            .iter()
            .map(|i| {
                self.0
                    .get(i)
                    .copied()
                    .ok_or(tlog_tiles::Error::IndexesNotInTree)
            })
            .collect()
    }
}

type Tx = sqlx::Transaction<'static, sqlx::Any>;

fn big(v: u64) -> Result<i64, LogStoreError> {
    i64::try_from(v).map_err(|_| LogStoreError::Tampered(format!("{v} does not fit a row")))
}

fn unsigned(v: i64) -> Result<u64, LogStoreError> {
    u64::try_from(v).map_err(|_| LogStoreError::Tampered(format!("a negative index {v}")))
}

async fn load_hashes(
    c: &mut sqlx::AnyConnection,
    indexes: &[u64],
) -> Result<Hashes, LogStoreError> {
    let mut out = Hashes::default();
    for chunk in indexes.chunks(256) {
        let list: Vec<String> = chunk.iter().map(u64::to_string).collect();
        // Integers the code computed, not input: inlined rather than bound one by one.
        let sql = format!(
            "SELECT idx, hash FROM log_hashes WHERE idx IN ({})",
            list.join(", ")
        );
        for r in sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(&mut *c)
            .await?
        {
            let idx = unsigned(r.try_get("idx")?)?;
            let text: String = r.try_get("hash")?;
            let h = B64
                .decode(&text)
                .ok()
                .and_then(|b| <[u8; 32]>::try_from(b).ok())
                .ok_or_else(|| {
                    LogStoreError::Tampered(format!("stored hash {idx} is not a hash"))
                })?;
            out.0.insert(idx, Hash(h));
        }
    }
    Ok(out)
}

/// The log's size and the `seq` of its last leaf's audit row.
async fn head(c: &mut sqlx::AnyConnection) -> Result<(u64, i64), LogStoreError> {
    let r = sqlx::query("SELECT idx, audit_seq FROM log_leaves ORDER BY idx DESC LIMIT 1")
        .fetch_optional(&mut *c)
        .await?;
    Ok(match r {
        Some(r) => (
            unsigned(r.try_get::<i64, _>("idx")?)? + 1,
            r.try_get("audit_seq")?,
        ),
        None => (0, 0),
    })
}

/// The newest signed checkpoint (a signed note), if any.
async fn newest_checkpoint(
    c: &mut sqlx::AnyConnection,
) -> Result<Option<(u64, Vec<u8>)>, LogStoreError> {
    let r = sqlx::query("SELECT size, note FROM log_checkpoints ORDER BY size DESC LIMIT 1")
        .fetch_optional(&mut *c)
        .await?;
    match r {
        Some(r) => {
            let note: String = r.try_get("note")?;
            Ok(Some((unsigned(r.try_get("size")?)?, note.into_bytes())))
        }
        None => Ok(None),
    }
}

/// The leaf an audit row becomes. A leaf must fit an entry bundle (65 535 bytes); a row whose
/// leaf would not (no writer records one: details are digests) is committed to by its leaf's
/// SHA-256 under a kind of its own, so the log never stops on it.
pub fn leaf_of(event: &AuditEvent, service: &str) -> Vec<u8> {
    let leaf = event.leaf(service);
    if leaf.len() <= MAX_LEAF {
        return leaf;
    }
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, &leaf);
    cgx_protocol::jcs::canonical(&serde_json::json!({
        "kind": "cgx.audit.v1.digest",
        "service": service,
        "seq": event.seq,
        "sha256": hex::encode(digest.as_ref()),
    }))
    .into_bytes()
}

/// What one pass did.
#[derive(Debug, Clone)]
pub struct Integrated {
    /// Leaves appended.
    pub appended: u64,
    /// The log's size now.
    pub size: u64,
    /// The checkpoint signed for it.
    pub checkpoint: Vec<u8>,
    /// Its root.
    pub root: Hash,
}

/// The last tree this integrator signed, kept outside the log's tables (a file of the
/// caller's): whatever the database says, the log only ever extends it. Without it, a writer
/// who deleted the log's rows back to an earlier checkpoint and changed the audit rows after it
/// would have the key sign a fork.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pinned {
    pub size: u64,
    pub root: Hash,
}

impl Pinned {
    /// The tree a signed checkpoint names (the caller verified the note).
    pub fn of(checkpoint: &Checkpoint) -> Pinned {
        Pinned {
            size: checkpoint.size(),
            root: *checkpoint.hash(),
        }
    }
}

/// The pin kept in `path` (the last checkpoint this integrator signed, as signed), checked
/// under the log's own key; `None` if there is no file yet (a new log, or a new replica).
pub fn load_pin(
    path: &std::path::Path,
    log: &cgx_tlog::note::NoteKey,
) -> Result<Option<Pinned>, LogStoreError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(LogStoreError::Pin(format!("{}: {e}", path.display())));
        }
    };
    let opened = open_checkpoint(&bytes, log, &[], 0)
        .map_err(|e| LogStoreError::Pin(format!("{}: {e}", path.display())))?;
    Ok(Some(Pinned::of(&opened.checkpoint)))
}

/// Keep `checkpoint` (a signed note) in `path` as the new pin: written to a temporary file,
/// synced, renamed over the old one, and the directory synced, so a crash leaves the old pin
/// or the new one.
pub fn save_pin(path: &std::path::Path, checkpoint: &[u8]) -> Result<(), LogStoreError> {
    crate::durable::write_atomic(path, checkpoint)
        .map_err(|e| LogStoreError::Pin(format!("{}: {e}", path.display())))
}

/// Append the audit rows committed since the last pass (at most `max`) and sign a checkpoint
/// of the new size, in `tx` (the caller's write transaction, which it commits). `None`: nothing
/// new.
pub async fn integrate(
    tx: &mut Tx,
    service: &str,
    signer: &NoteSigner,
    at: i64,
    max: i64,
    pinned: Option<Pinned>,
) -> Result<Option<Integrated>, LogStoreError> {
    let (size, last_seq) = head(tx).await?;
    let rows = sqlx::query(
        "SELECT seq, at, actor, action, subject, detail FROM audit WHERE seq > $1 ORDER BY seq LIMIT $2",
    )
    .bind(last_seq)
    .bind(max)
    .fetch_all(&mut **tx)
    .await?;
    if rows.is_empty() {
        return Ok(None);
    }
    let events = rows
        .iter()
        .map(crate::audit::event_row)
        .collect::<Result<Vec<_>, _>>()?;
    // The frontier: the complete subtrees the tree of `size` is made of.
    let mut hashes = load_hashes(tx, &tlog_tiles::sub_tree_index(0, size, Vec::new())).await?;
    check_tail(tx, service, size, last_seq, &hashes).await?;
    if let Some(p) = pinned {
        if p.size > size {
            return Err(LogStoreError::Tampered(format!(
                "{size} leaves stored, but this log signed a tree of {} before: rolled back",
                p.size
            )));
        }
        if p.size > 0 {
            let old = load_hashes(tx, &tlog_tiles::sub_tree_index(0, p.size, Vec::new())).await?;
            let root = tlog_tiles::tree_hash(p.size, &old)
                .map_err(|e| LogStoreError::Tampered(format!("the tree it signed before: {e}")))?;
            if root != p.root {
                return Err(LogStoreError::Tampered(format!(
                    "the stored tree's first {} leaves are not the tree this log signed",
                    p.size
                )));
            }
        }
    }
    match newest_checkpoint(tx).await? {
        Some((signed_size, note)) => {
            let opened = open_checkpoint(&note, &signer.verifier(), &[], 0)
                .map_err(|e| LogStoreError::Tampered(format!("its last checkpoint: {e}")))?;
            let root = tlog_tiles::tree_hash(size, &hashes)
                .map_err(|e| LogStoreError::Tampered(format!("its frontier: {e}")))?;
            if signed_size != size
                || opened.checkpoint.size() != size
                || *opened.checkpoint.hash() != root
            {
                return Err(LogStoreError::Tampered(format!(
                    "{size} leaves stored, the last checkpoint signed {signed_size} with another root"
                )));
            }
        }
        None if size > 0 => {
            return Err(LogStoreError::Tampered(format!(
                "{size} leaves stored and no checkpoint"
            )));
        }
        None => {}
    }
    let mut leaf_rows = Vec::with_capacity(events.len());
    let mut hash_rows = Vec::with_capacity(events.len() * 2);
    let mut n = size;
    for e in &events {
        let leaf = leaf_of(e, service);
        let new =
            tlog_tiles::stored_hashes_for_record_hash(n, cgx_tlog::record_hash(&leaf), &hashes)?;
        let first = tlog_tiles::stored_hash_index(0, n);
        for (k, h) in new.into_iter().enumerate() {
            let idx = first + k as u64;
            hashes.0.insert(idx, h);
            hash_rows.push((big(idx)?, B64.encode(h.0)));
        }
        let text = String::from_utf8(leaf)
            .map_err(|_| LogStoreError::Tampered(format!("audit row {} is not text", e.seq)))?;
        leaf_rows.push((big(n)?, e.seq, text));
        n += 1;
    }
    for chunk in leaf_rows.chunks(1000) {
        let sql = format!(
            "INSERT INTO log_leaves (idx, audit_seq, leaf) VALUES {}",
            crate::db::placeholders(chunk.len(), 3)
        );
        let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
        for (idx, seq, leaf) in chunk {
            q = q.bind(*idx).bind(*seq).bind(leaf.clone());
        }
        q.execute(&mut **tx).await?;
    }
    for chunk in hash_rows.chunks(1000) {
        let sql = format!(
            "INSERT INTO log_hashes (idx, hash) VALUES {}",
            crate::db::placeholders(chunk.len(), 2)
        );
        let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
        for (idx, h) in chunk {
            q = q.bind(*idx).bind(h.clone());
        }
        q.execute(&mut **tx).await?;
    }
    let root = tlog_tiles::tree_hash(n, &hashes)?;
    let cp = Checkpoint::new(signer.name(), n, root, "")
        .map_err(|e| cgx_tlog::LogError::Checkpoint(e.to_string()))?;
    let note = sign_checkpoint(&cp, signer)?;
    let text = String::from_utf8(note.clone())
        .map_err(|_| LogStoreError::Tampered("a signed note that is not text".into()))?;
    sqlx::query("INSERT INTO log_checkpoints (size, at, note) VALUES ($1, $2, $3)")
        .bind(big(n)?)
        .bind(at)
        .bind(text)
        .execute(&mut **tx)
        .await?;
    Ok(Some(Integrated {
        appended: n - size,
        size: n,
        checkpoint: note,
        root,
    }))
}

/// The last leaf is still its audit row: the row exists, unchanged, and the leaf is the one the
/// tree hashed. A writer who deleted the logged tail of `audit` (on SQLite its `seq`s would be
/// used again, by rows never logged) or edited a logged row is caught here.
async fn check_tail(
    tx: &mut Tx,
    service: &str,
    size: u64,
    last_seq: i64,
    hashes: &Hashes,
) -> Result<(), LogStoreError> {
    if size == 0 {
        return Ok(());
    }
    let idx = big(size - 1)?;
    let stored: String = sqlx::query("SELECT leaf FROM log_leaves WHERE idx = $1")
        .bind(idx)
        .fetch_one(&mut **tx)
        .await?
        .try_get("leaf")?;
    let row =
        sqlx::query("SELECT seq, at, actor, action, subject, detail FROM audit WHERE seq = $1")
            .bind(last_seq)
            .fetch_optional(&mut **tx)
            .await?;
    let Some(row) = row else {
        return Err(LogStoreError::Tampered(format!(
            "audit row {last_seq}, leaf {idx}, is gone"
        )));
    };
    let event = crate::audit::event_row(&row)?;
    if leaf_of(&event, service).as_slice() != stored.as_bytes() {
        return Err(LogStoreError::Tampered(format!(
            "audit row {last_seq}, leaf {idx}, was changed after it was logged"
        )));
    }
    let at = tlog_tiles::stored_hash_index(0, size - 1);
    let h = match hashes.0.get(&at) {
        Some(h) => *h,
        None => load_hashes(tx, &[at])
            .await?
            .0
            .get(&at)
            .copied()
            .ok_or_else(|| LogStoreError::Tampered(format!("leaf {idx}'s hash is gone")))?,
    };
    if cgx_tlog::record_hash(stored.as_bytes()) != h {
        return Err(LogStoreError::Tampered(format!(
            "leaf {idx} is not the leaf the tree hashed"
        )));
    }
    Ok(())
}

/// Whether audit rows were committed after the log's last leaf (a read, no lock): a pass
/// with nothing to append need not begin a write transaction.
pub async fn behind(pool: &sqlx::AnyPool) -> Result<bool, LogStoreError> {
    let r = sqlx::query(
        "SELECT (SELECT COALESCE(MAX(seq), 0) FROM audit) AS audited, (SELECT COALESCE(MAX(audit_seq), 0) FROM log_leaves) AS logged",
    )
    .fetch_one(pool)
    .await?;
    Ok(r.try_get::<i64, _>("audited")? > r.try_get::<i64, _>("logged")?)
}

/// The newest checkpoint (signed note), if the log has one.
pub async fn checkpoint(pool: &sqlx::AnyPool) -> Result<Option<Vec<u8>>, LogStoreError> {
    let mut c = pool.acquire().await?;
    Ok(newest_checkpoint(&mut c).await?.map(|(_, n)| n))
}

/// The newest checkpoint at least `quorum` witnesses cosigned (with their cosignatures): what
/// the log publishes.
pub async fn published(
    pool: &sqlx::AnyPool,
    quorum: usize,
) -> Result<Option<Vec<u8>>, LogStoreError> {
    let r = sqlx::query(
        "SELECT note FROM log_checkpoints WHERE witnessed >= $1 ORDER BY size DESC LIMIT 1",
    )
    .bind(i64::try_from(quorum).unwrap_or(i64::MAX))
    .fetch_optional(pool)
    .await?;
    Ok(match r {
        Some(r) => Some(r.try_get::<String, _>("note")?.into_bytes()),
        None => None,
    })
}

/// The newest stored checkpoint's size and note, and how many witnesses cosigned it.
pub async fn newest(pool: &sqlx::AnyPool) -> Result<Option<(u64, Vec<u8>, u64)>, LogStoreError> {
    let r =
        sqlx::query("SELECT size, note, witnessed FROM log_checkpoints ORDER BY size DESC LIMIT 1")
            .fetch_optional(pool)
            .await?;
    match r {
        Some(r) => Ok(Some((
            unsigned(r.try_get("size")?)?,
            r.try_get::<String, _>("note")?.into_bytes(),
            unsigned(r.try_get("witnessed")?)?,
        ))),
        None => Ok(None),
    }
}

/// Keep checkpoint `size` with the cosignatures gathered (`note`, checked by the caller) and
/// their count.
pub async fn set_witnessed(
    pool: &sqlx::AnyPool,
    size: u64,
    note: &[u8],
    witnessed: usize,
) -> Result<(), LogStoreError> {
    let text = std::str::from_utf8(note)
        .map_err(|_| LogStoreError::Tampered("a cosigned note that is not text".into()))?;
    sqlx::query("UPDATE log_checkpoints SET note = $1, witnessed = $2 WHERE size = $3")
        .bind(text)
        .bind(i64::try_from(witnessed).unwrap_or(i64::MAX))
        .bind(big(size)?)
        .execute(pool)
        .await?;
    Ok(())
}

/// A consistency proof from the tree of `old` leaves to the tree of `size` (both at most the
/// stored tree's size), from the stored hashes.
pub async fn prove_tree(
    pool: &sqlx::AnyPool,
    size: u64,
    old: u64,
) -> Result<Vec<Hash>, LogStoreError> {
    if old == 0 || old == size {
        return Ok(Vec::new());
    }
    // Which hashes the proof reads (`prove_tree` asks for them in one call), then those.
    let wanted = std::cell::RefCell::new(Vec::new());
    let _ = tlog_tiles::prove_tree(size, old, &Recorder(&wanted));
    let indexes = wanted.into_inner();
    let mut c = pool.acquire().await?;
    let hashes = load_hashes(&mut c, &indexes).await?;
    Ok(tlog_tiles::prove_tree(size, old, &hashes)?)
}

/// An inclusion proof of leaf `index` in the tree of `size` leaves (at most the stored
/// tree's), from the stored hashes.
pub async fn prove_leaf(
    pool: &sqlx::AnyPool,
    size: u64,
    index: u64,
) -> Result<Vec<Hash>, LogStoreError> {
    if index >= size {
        return Err(LogStoreError::Log(cgx_tlog::LogError::Leaf {
            index,
            why: format!("not in a tree of {size} leaves"),
        }));
    }
    let wanted = std::cell::RefCell::new(Vec::new());
    let _ = tlog_tiles::prove_record(size, index, &Recorder(&wanted));
    let indexes = wanted.into_inner();
    let mut c = pool.acquire().await?;
    let hashes = load_hashes(&mut c, &indexes).await?;
    Ok(tlog_tiles::prove_record(size, index, &hashes)?)
}

/// The root of the tree of its first `size` leaves (at most the stored tree's), from the
/// stored hashes.
pub async fn tree_root(pool: &sqlx::AnyPool, size: u64) -> Result<Hash, LogStoreError> {
    let wanted = std::cell::RefCell::new(Vec::new());
    let _ = tlog_tiles::tree_hash(size, &Recorder(&wanted));
    let indexes = wanted.into_inner();
    let mut c = pool.acquire().await?;
    let hashes = load_hashes(&mut c, &indexes).await?;
    Ok(tlog_tiles::tree_hash(size, &hashes)?)
}

/// The leaf the audit event `seq` became, and its index; `None` before it is integrated.
pub async fn leaf_of_seq(
    pool: &sqlx::AnyPool,
    seq: i64,
) -> Result<Option<(u64, Vec<u8>)>, LogStoreError> {
    let r = sqlx::query("SELECT idx, leaf FROM log_leaves WHERE audit_seq = $1")
        .bind(seq)
        .fetch_optional(pool)
        .await?;
    match r {
        Some(r) => Ok(Some((
            unsigned(r.try_get("idx")?)?,
            r.try_get::<String, _>("leaf")?.into_bytes(),
        ))),
        None => Ok(None),
    }
}

/// The log's size over time: `(unix seconds, size)` of the newest `limit` checkpoints, oldest
/// first.
pub async fn history(pool: &sqlx::AnyPool, limit: i64) -> Result<Vec<(i64, u64)>, LogStoreError> {
    let rows = sqlx::query("SELECT size, at FROM log_checkpoints ORDER BY size DESC LIMIT $1")
        .bind(limit)
        .fetch_all(pool)
        .await?;
    let mut out = rows
        .iter()
        .map(|r| Ok((r.try_get::<i64, _>("at")?, unsigned(r.try_get("size")?)?)))
        .collect::<Result<Vec<_>, LogStoreError>>()?;
    out.reverse();
    Ok(out)
}

/// A reader that notes the indexes asked for and answers none.
struct Recorder<'a>(&'a std::cell::RefCell<Vec<u64>>);

impl HashReader for Recorder<'_> {
    fn read_hashes(&self, indexes: &[u64]) -> Result<Vec<Hash>, tlog_tiles::Error> {
        self.0.borrow_mut().extend_from_slice(indexes);
        Err(tlog_tiles::Error::IndexesNotInTree)
    }
}

/// A tile or entry bundle at its C2SP path (`tile/…`), within the newest checkpoint's tree;
/// `None` where there is no such tile (yet). `entries`: whether entry bundles may be read
/// (they name tenants, nodes and resources: auditors only).
pub async fn tile(
    pool: &sqlx::AnyPool,
    path: &str,
    entries: bool,
) -> Result<Option<Vec<u8>>, LogStoreError> {
    let t = paths::parse_tile_path(path)?;
    let mut c = pool.acquire().await?;
    let Some((size, _)) = newest_checkpoint(&mut c).await? else {
        return Ok(None);
    };
    // The leaves (or, above level 0, the full tiles below) the tile covers must all be in the
    // checkpointed tree; a path naming a tile past it, however far, is simply not there.
    match cgx_tlog::tile_reach(&t) {
        Some(reach) if reach <= size => {}
        _ => return Ok(None),
    }
    // In range now: `reach` ≤ size ≤ 2⁴⁸ bounds both.
    let start = t.level_index() * cgx_tlog::TILE_WIDTH;
    let width = u64::from(t.width());
    if t.is_data() {
        if !entries {
            return Err(LogStoreError::Log(cgx_tlog::LogError::Path(
                "entry bundles are read by auditors".into(),
            )));
        }
        let rows = sqlx::query(
            "SELECT idx, leaf FROM log_leaves WHERE idx >= $1 AND idx < $2 ORDER BY idx",
        )
        .bind(big(start)?)
        .bind(big(start + width)?)
        .fetch_all(&mut *c)
        .await?;
        if rows.len() as u64 != width {
            return Ok(None);
        }
        let leaves = rows
            .iter()
            .map(|r| r.try_get::<String, _>("leaf"))
            .collect::<Result<Vec<_>, _>>()?;
        return Ok(Some(cgx_tlog::bundle::encode(&leaves)?));
    }
    let level = HEIGHT * t.level();
    let indexes: Vec<u64> = (start..start + width)
        .map(|i| tlog_tiles::stored_hash_index(level, i))
        .collect();
    let hashes = load_hashes(&mut c, &indexes).await?;
    if hashes.0.len() != indexes.len() {
        return Ok(None);
    }
    Ok(Some(t.read_data(&hashes)?))
}

/// A checkpoint as both services serve it at `…/log/checkpoint`: never cached (it moves).
pub fn checkpoint_response(note: Vec<u8>) -> axum::response::Response {
    use axum::http::header;
    use axum::response::IntoResponse as _;
    (
        [
            (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        note,
    )
        .into_response()
}

/// A tile or entry bundle (at its C2SP `path`) as both services serve it. A full hash tile never
/// changes and anyone may read it: any cache may keep it. An entry bundle is an auditor's answer,
/// never a shared cache's to serve to others; a partial tile is replaced by wider ones as the
/// log grows.
pub fn tile_response(data: Vec<u8>, path: &str) -> axum::response::Response {
    use axum::http::header;
    use axum::response::IntoResponse as _;
    let cache = if path.starts_with("tile/entries/") {
        "private, no-store"
    } else if path.contains(".p/") {
        "no-store"
    } else {
        "public, max-age=31536000, immutable"
    };
    (
        [
            (header::CONTENT_TYPE, "application/octet-stream"),
            (header::CACHE_CONTROL, cache),
            (header::VARY, "authorization"),
        ],
        data,
    )
        .into_response()
}
