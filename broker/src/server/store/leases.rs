//! Leases and GPU allocations: taking a placement's GPUs for its tenant (one tenant per VM,
//! read from signed tokens), opening and ending leases, who holds a VM.

use std::collections::HashMap;

use sqlx::Row;

use super::super::error::BrokerError;
use super::jobs::move_job;
use super::{
    JobState, LEASE_COLUMNS, LEASE_COLUMNS_L, LeaseRow, NodeUse, Outcome, PlacementRow, Refusal,
    Store, Tx, gpus_text, lease_row, touch,
};

/// Writes to leases' rows.
#[derive(Debug)]
pub(crate) enum LeaseWrite {
    EndLease {
        lease: String,
        job_from: &'static [JobState],
        job_to: JobState,
        reason: String,
        now: i64,
        now_ms: i64,
        /// Reputation's half-life: a lease ended to re-place its job (a failover) counts
        /// against the node and its operator.
        half_life: i64,
    },
}

/// Apply one of these writes inside the batch's transaction (see `store::apply`).
pub(super) async fn apply(
    tx: &mut Tx,
    w: &LeaseWrite,
    sqlite: bool,
) -> Result<Outcome, sqlx::Error> {
    match w {
        LeaseWrite::EndLease {
            lease,
            job_from,
            job_to,
            reason,
            now,
            now_ms,
            half_life,
        } => {
            let sql = format!(
                "SELECT {LEASE_COLUMNS_L}, j.state AS job_state FROM leases l JOIN jobs j ON j.id = l.job_id WHERE l.id = $1 AND l.ended_at IS NULL"
            );
            let Some(row) = sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(lease)
                .fetch_optional(&mut **tx)
                .await?
            else {
                return Ok(Outcome::Refused(Refusal::NoSuchLease));
            };
            let l = lease_row(&row)?;
            let job_state: String = row.try_get("job_state")?;
            sqlx::query("UPDATE leases SET ended_at = $1, end_reason = $2 WHERE id = $3")
                .bind(now)
                .bind(reason)
                .bind(lease)
                .execute(&mut **tx)
                .await?;
            // The tenant's hold on the VM now lasts until this lease's last token expired:
            // the trigger `leases_node_hold` (migration 5) records it in `node_holds`.
            free_gpus(tx, lease).await?;
            // Its escrow keeps what the windows it ran may still cost; the rest goes back.
            super::ledger::trim_in(tx, lease, *now, l.ends_at).await?;
            // The lease ends whatever its job's state; the job moves only from `job_from`.
            if let Some(current) = JobState::parse(&job_state).filter(|s| job_from.contains(s)) {
                move_job(
                    tx,
                    &l.job_id,
                    current,
                    *job_to,
                    reason,
                    *now,
                    *job_to == JobState::Pending,
                )
                .await?;
            }
            if *job_to == JobState::Pending {
                let d = crate::server::reputation::Delta {
                    failovers: 1.0,
                    ..Default::default()
                };
                super::reputation::bump_in(tx, &l.node_id, d, *now, *half_life, *now_ms).await?;
            }
            // A leaf of the log (issue 33), in the transaction that ended it.
            cgx_service::audit::record(
                tx,
                *now,
                &cgx_service::audit::NewEvent {
                    actor: "broker",
                    action: "lease.end",
                    subject: lease,
                    detail: &serde_json::json!({
                        "job": l.job_id,
                        "node": l.node_id,
                        "reason": reason,
                        "job_to": job_to.as_str(),
                    }),
                },
            )
            .await?;
            touch(tx, &l.node_id, *now_ms, sqlite).await?;
            Ok(Outcome::Ended(l))
        }
    }
}

/// Count `tenant`'s hold on a node until `until`: one tenant's holds extend each other; of two
/// tenants' (rows from before the one-tenant rule), the longer stands.
fn hold(u: &mut NodeUse, tenant: String, until: i64) {
    match &mut u.tenant {
        Some((t, u)) if *t == tenant => *u = (*u).max(until),
        Some((_, u)) if *u >= until => {}
        slot => *slot = Some((tenant, until)),
    }
}

/// Another tenant whose lease on `node` is open, or ended at or after `ended_after` (its last
/// token may still be valid): a VM serves one tenant at a time, so one tenant's workload never
/// shares a TEE key, or the leases a node is handed, with another's.
///
/// Read from the node's open leases, its `node_holds` rows (each tenant's latest ended lease
/// there) and rows from before migration 5 — never from every lease the job's own tenant
/// churned through on the node. The tenant columns only narrow the search: who holds the node
/// is read from each lease token the broker signed, never from a column or a job row (a
/// database writer could move a running job to another tenant); a row without a valid
/// signature holds nothing. The database is trusted for whether a lease is live (a writer able
/// to end a lease can hide it either way), the signature for whose it is.
async fn other_tenant(tx: &mut Tx, p: &PlacementRow) -> Result<Option<String>, sqlx::Error> {
    // One statement (it runs in the single writer, on every placement).
    let sql = holds_naming_other_tenants("token", "$1", "$2", "$3");
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&p.node_id)
        .bind(&p.tenant)
        .bind(p.tenant_ended_after)
        .fetch_all(&mut **tx)
        .await?;
    for r in &rows {
        let token: String = r.try_get("token")?;
        if let Some(t) = lease_tenant(&token, &p.broker_key)
            && t != p.tenant
        {
            return Ok(Some(t));
        }
    }
    Ok(None)
}

/// The rows that name a tenant other than `tenant` as holding `node` (placeholders): its open
/// leases, its `node_holds` rows that ended at or after `after`, and rows from before
/// migration 5 that ended then — `select` of each. The placement write's guard and its check
/// from signed tokens ([`other_tenant`]) read the same rows.
///
/// "Another tenant" is written as two ranges (`< t`, `> t`), not `<> t`: each is then a range
/// probe of an index whose key holds the tenant (`leases_open`, migration 6; `node_holds`' key),
/// where `<>` makes SQLite walk the node's rows and read each. Rows from before migration 5
/// (tenant `''`) fall in `< t`, as they fell in `<> t`.
fn holds_naming_other_tenants(select: &str, node: &str, tenant: &str, after: &str) -> String {
    let mut parts = Vec::with_capacity(5);
    for side in ["<", ">"] {
        parts.push(format!(
            "SELECT {select} FROM leases WHERE node_id = {node} AND ended_at IS NULL AND tenant {side} {tenant}"
        ));
    }
    for side in ["<", ">"] {
        parts.push(format!(
            "SELECT {select} FROM node_holds WHERE node_id = {node} AND tenant {side} {tenant} AND last_end >= {after}"
        ));
    }
    parts.push(format!(
        "SELECT {select} FROM leases WHERE node_id = {node} AND tenant = '' AND ended_at >= {after}"
    ));
    parts.join(" UNION ALL ")
}

/// The tenant a lease token this broker signed names (`None`: not its signature, or none).
///
/// Remembered per (key, token): a lease row's token never changes, and the same bytes verify
/// the same way under the same key, so each is verified once per process — the placement
/// write (one writer for every replica's batch) would otherwise verify every lease of a node
/// on each placement. At most 100 000 tokens; cleared when full.
pub(crate) fn lease_tenant(token: &str, key: &[u8; 32]) -> Option<String> {
    type Seen = std::sync::Mutex<HashMap<([u8; 32], String), String>>;
    static SEEN: std::sync::OnceLock<Seen> = std::sync::OnceLock::new();
    let seen = SEEN.get_or_init(Default::default);
    let k = (*key, token.to_string());
    if let Some(t) = seen.lock().ok().and_then(|m| m.get(&k).cloned()) {
        return Some(t);
    }
    let t = super::super::keys::verify_stored::<cgx_protocol::records::Lease>(token, key)?
        .body
        .tenant;
    if let Ok(mut m) = seen.lock() {
        if m.len() >= 100_000 {
            m.clear();
        }
        m.insert(k, t.clone());
    }
    Some(t)
}

/// Take `p`'s GPUs for its tenant, or say why not: all or none, and only while no other
/// tenant holds the VM ([`other_tenant`]).
///
/// One statement on the common path (it runs in the single writer, on every placement): the
/// GPUs' rows are inserted only where no row *names* another tenant as holding the node — open
/// leases, `node_holds`, rows from before migration 5. Where that guard or a taken GPU stops
/// the insert, the holds are read and checked from their signed tokens: a confirmed other
/// tenant refuses; rows naming another tenant that their tokens do not confirm (a forged or
/// edited row) hold nothing, and the GPUs are taken as if they were not there.
pub(super) async fn take_gpus_for_tenant(
    tx: &mut Tx,
    p: &PlacementRow,
) -> Result<Option<Refusal>, sqlx::Error> {
    if p.gpus.is_empty() {
        return Ok(other_tenant(tx, p).await?.map(Refusal::OtherTenant));
    }
    let gpus = (0..p.gpus.len())
        .map(|i| format!("SELECT CAST(${} AS BIGINT) AS gpu", i + 5))
        .collect::<Vec<_>>()
        .join(" UNION ALL ");
    let others = holds_naming_other_tenants("1", "$1", "$3", "$4");
    let sql = format!(
        "INSERT INTO allocations (node_id, gpu, lease_id)
         SELECT $1, g.gpu, $2 FROM ({gpus}) g
         WHERE NOT EXISTS ({others})
         ON CONFLICT (node_id, gpu) DO NOTHING"
    );
    let mut q = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&p.node_id)
        .bind(&p.lease_id)
        .bind(&p.tenant)
        .bind(p.tenant_ended_after);
    for g in &p.gpus {
        q = q.bind(i64::from(*g));
    }
    if q.execute(&mut **tx).await?.rows_affected() == p.gpus.len() as u64 {
        return Ok(None);
    }
    free_gpus(tx, &p.lease_id).await?;
    if let Some(t) = other_tenant(tx, p).await? {
        return Ok(Some(Refusal::OtherTenant(t)));
    }
    Ok((!take_gpus(tx, p).await?).then_some(Refusal::GpuTaken))
}

/// Take `p`'s GPUs: all or none (a GPU another lease holds undoes this lease's rows).
async fn take_gpus(tx: &mut Tx, p: &PlacementRow) -> Result<bool, sqlx::Error> {
    let sql = format!(
        "INSERT INTO allocations (node_id, gpu, lease_id) VALUES {} ON CONFLICT (node_id, gpu) DO NOTHING",
        cgx_service::db::placeholders(p.gpus.len(), 3)
    );
    let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
    for g in &p.gpus {
        q = q.bind(&p.node_id).bind(i64::from(*g)).bind(&p.lease_id);
    }
    if q.execute(&mut **tx).await?.rows_affected() == p.gpus.len() as u64 {
        return Ok(true);
    }
    free_gpus(tx, &p.lease_id).await?;
    Ok(false)
}

pub(super) async fn free_gpus(tx: &mut Tx, lease: &str) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM allocations WHERE lease_id = $1")
        .bind(lease)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

pub(super) async fn open_lease(
    tx: &mut Tx,
    p: &PlacementRow,
    sqlite: bool,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO leases (id, job_id, node_id, gpus, token, started_at, ends_at, tenant) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(&p.lease_id)
    .bind(&p.job_id)
    .bind(&p.node_id)
    .bind(gpus_text(&p.gpus))
    .bind(&p.token)
    .bind(p.started_at)
    .bind(p.ends_at)
    .bind(&p.tenant)
    .execute(&mut **tx)
    .await?;
    // A leaf of the log (issue 33), in the placement's transaction: the lease's terms and the
    // digest of the token the broker signed for it.
    let token = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, p.token.as_bytes());
    cgx_service::audit::record(
        tx,
        p.started_at,
        &cgx_service::audit::NewEvent {
            actor: "broker",
            action: "lease.open",
            subject: &p.lease_id,
            detail: &serde_json::json!({
                "job": p.job_id,
                "tenant": p.tenant,
                "node": p.node_id,
                "gpus": p.gpus,
                "started_at": p.started_at,
                "ends_at": p.ends_at,
                "token_sha256": hex::encode(token.as_ref()),
            }),
        },
    )
    .await?;
    touch(tx, &p.node_id, p.now_ms, sqlite).await
}

/// Lease rows in id order, sorted here rather than by `ORDER BY id`: with that clause SQLite
/// walks the whole table (every lease ever, in key order) instead of the open leases' index.
fn sorted_by_id(rows: &[sqlx::any::AnyRow]) -> Result<Vec<LeaseRow>, BrokerError> {
    let mut leases = rows.iter().map(lease_row).collect::<Result<Vec<_>, _>>()?;
    leases.sort_unstable_by(|a, b| a.id.cmp(&b.id));
    Ok(leases)
}

impl Store {
    /// Allocated GPUs of `nodes` (every node for `None`) as bitmaps, with the tenant whose
    /// leases hold each VM: open ones, or ones that ended after `ended_after` (their last
    /// token may still be valid until `ended_at + ttl`).
    ///
    /// Read as [`other_tenant`] reads them: open leases, `node_holds` (each tenant's latest
    /// ended lease per node, so a node's many leases of one tenant cost one row) and rows from
    /// before migration 5; each hold counts only for the tenant its token, which the broker
    /// signed, names.
    pub async fn allocations(
        &self,
        nodes: Option<&[String]>,
        ended_after: i64,
        ttl: i64,
        key: &[u8; 32],
    ) -> Result<HashMap<String, NodeUse>, BrokerError> {
        const GPUS: &str = "SELECT node_id, gpu FROM allocations WHERE 1 = 1";
        /// (node, token, end): `NULL` end while open.
        const OPEN: &str = "SELECT node_id, token, ended_at FROM leases WHERE ended_at IS NULL";
        const HOLDS: &str =
            "SELECT node_id, token, last_end AS ended_at FROM node_holds WHERE last_end >= $1";
        const LEGACY: &str =
            "SELECT node_id, token, ended_at FROM leases WHERE tenant = '' AND ended_at >= $1";
        let (mut gpus, mut holds) = (Vec::new(), Vec::new());
        // In chunks: a statement takes a bounded number of parameters (every node: one
        // statement each, unfiltered).
        let chunks: Vec<&[String]> = match nodes {
            None => vec![&[]],
            Some([]) => Vec::new(),
            Some(ids) => ids.chunks(500).collect(),
        };
        for chunk in chunks {
            let filter = |from: usize| {
                if nodes.is_none() {
                    return String::new();
                }
                let list = (from..from + chunk.len())
                    .map(|i| format!("${i}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                format!(" AND node_id IN ({list})")
            };
            for (i, (sql, timed)) in [(GPUS, false), (OPEN, false), (HOLDS, true), (LEGACY, true)]
                .into_iter()
                .enumerate()
            {
                let from = if timed { 2 } else { 1 };
                let sql = format!("{sql}{}", filter(from));
                let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
                if timed {
                    q = q.bind(ended_after);
                }
                if nodes.is_some() {
                    for id in chunk {
                        q = q.bind(id.clone());
                    }
                }
                let rows = q.fetch_all(self.db.pool()).await?;
                if i == 0 {
                    gpus.extend(rows);
                } else {
                    holds.extend(rows);
                }
            }
        }
        let mut out: HashMap<String, NodeUse> = HashMap::new();
        for r in gpus {
            let id: String = r.try_get("node_id")?;
            let gpu: i64 = r.try_get("gpu")?;
            if (0..64).contains(&gpu) {
                out.entry(id).or_default().gpus |= 1u64 << gpu;
            }
        }
        for r in holds {
            let id: String = r.try_get("node_id")?;
            let token: String = r.try_get("token")?;
            let Some(tenant) = lease_tenant(&token, key) else {
                tracing::error!(node = %id, "a lease row without a valid broker signature; it holds no tenant");
                continue;
            };
            let ended: Option<i64> = r.try_get("ended_at")?;
            let until = ended.map_or(i64::MAX, |e| e.saturating_add(ttl));
            hold(out.entry(id).or_default(), tenant, until);
        }
        Ok(out)
    }

    /// Open leases of `node` (every node for `None`).
    pub async fn open_leases(&self, node: Option<&str>) -> Result<Vec<LeaseRow>, BrokerError> {
        let rows = match node {
            Some(n) => {
                let sql = format!(
                    "SELECT {LEASE_COLUMNS} FROM leases WHERE node_id = $1 AND ended_at IS NULL"
                );
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(n)
                    .fetch_all(self.db.pool())
                    .await?
            }
            None => {
                let sql = format!("SELECT {LEASE_COLUMNS} FROM leases WHERE ended_at IS NULL");
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .fetch_all(self.db.pool())
                    .await?
            }
        };
        sorted_by_id(&rows)
    }

    /// Open leases whose job ran its duration by `now`.
    pub async fn due_leases(&self, now: i64) -> Result<Vec<LeaseRow>, BrokerError> {
        let sql =
            format!("SELECT {LEASE_COLUMNS} FROM leases WHERE ended_at IS NULL AND ends_at <= $1");
        let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(now)
            .fetch_all(self.db.pool())
            .await?;
        sorted_by_id(&rows)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn record(id: &str) -> crate::server::index::NodeRecord {
        serde_json::from_value(serde_json::json!({
            "id": id, "node_key": "k", "tee_thumbprint": "t", "operator": "op",
            "region": "eu-west", "tee": "snp", "sim": true, "gpu_model": "H100",
            "gpu_chip": "GH100", "gpu_count": 8, "gpu_memory_gib": 80, "price": 1_000_000,
            "status": "affirming", "violations": [], "attested_at": 0, "ear_expires_at": 0,
            "ear_digest": "", "claims": {},
        }))
        .unwrap()
    }

    /// The placement write's one-tenant-per-VM check reads whose a lease is from its signed
    /// token: the `tenant` column (migration 5) only narrows which rows it reads. A row from
    /// before the column (`''`) still holds the VM for its token's tenant; a column naming
    /// another tenant over a token of the placing tenant's holds nothing; a row naming another
    /// tenant without a valid signature holds nothing.
    #[tokio::test]
    async fn who_holds_a_vm_is_read_from_signed_tokens_not_the_tenant_column() {
        let dir = std::env::temp_dir().join(format!("cgx-store-holds-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("sqlite://{}", dir.join("broker.db").display());
        let store = Store::open(&url, 1_000).await.unwrap();
        let pkcs8 = aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(
            &aws_lc_rs::rand::SystemRandom::new(),
        )
        .unwrap();
        let keys = crate::server::keys::Keys::from_pkcs8(pkcs8.as_ref().to_vec()).unwrap();
        let node = record("n1");
        let token = |lease: &str, tenant: &str| {
            keys.lease_token(
                lease,
                "j",
                tenant,
                &node,
                &[0],
                &[],
                None,
                1_000,
                5_000,
                120,
                60,
            )
            .unwrap()
        };
        let place = |tenant: &str| PlacementRow {
            job_id: "j".into(),
            tenant: tenant.into(),
            tenant_ended_after: 1_000 - 120,
            broker_key: keys.public,
            node_id: "n1".into(),
            lease_id: "new".into(),
            gpus: vec![1],
            token: String::new(),
            started_at: 1_000,
            ends_at: 5_000,
            reason: String::new(),
            now_ms: 1_000_000,
            escrow: None,
        };
        let insert = |id: &'static str, tenant: &'static str, token: String| async move {
            (
                "INSERT INTO leases (id, job_id, node_id, gpus, token, started_at, ends_at, tenant) VALUES ($1, 'j', 'n1', '0', $2, 1000, 5000, $3)",
                vec![id.to_string(), token, tenant.to_string()],
            )
        };
        let run = |rows: Vec<(&'static str, Vec<String>)>| {
            let store = &store;
            async move {
                sqlx::query("DELETE FROM leases")
                    .execute(store.db.pool())
                    .await
                    .unwrap();
                for (sql, binds) in rows {
                    let mut q = sqlx::query(sqlx::AssertSqlSafe(sql.to_string()));
                    for b in binds {
                        q = q.bind(b);
                    }
                    q.execute(store.db.pool()).await.unwrap();
                }
            }
        };
        // The write's answer: the check alone, and the guarded insert that runs it (they must
        // agree), each in a transaction rolled back.
        let exec = |sql: &'static str| {
            let store = &store;
            async move {
                sqlx::query(sql).execute(store.db.pool()).await.unwrap();
            }
        };
        let check = |tenant: &'static str| {
            let store = &store;
            async move {
                let mut tx = store.db.pool().begin().await.unwrap();
                let t = other_tenant(&mut tx, &place(tenant)).await.unwrap();
                tx.rollback().await.unwrap();
                let mut tx = store.db.pool().begin().await.unwrap();
                let taken = take_gpus_for_tenant(&mut tx, &place(tenant)).await.unwrap();
                tx.rollback().await.unwrap();
                match (&t, taken) {
                    (None, None) => {}
                    (Some(a), Some(Refusal::OtherTenant(b))) => assert_eq!(*a, b),
                    (t, taken) => panic!("check {t:?}, guarded insert {taken:?}"),
                }
                t
            }
        };
        // What a replica's index learns (`allocations`, on sync): the same, as (tenant, until).
        let held = || {
            let store = &store;
            let key = keys.public;
            async move {
                store
                    .allocations(Some(&["n1".to_string()]), 1_000 - 120, 120, &key)
                    .await
                    .unwrap()
                    .remove("n1")
                    .and_then(|u| u.tenant)
            }
        };
        // Acme's own leases, however many, hold nothing against acme; they hold against globex.
        run(vec![
            insert("a1", "acme", token("a1", "acme")).await,
            insert("a2", "acme", token("a2", "acme")).await,
        ])
        .await;
        assert_eq!(check("acme").await, None);
        assert_eq!(check("globex").await.as_deref(), Some("acme"));
        assert_eq!(held().await, Some(("acme".into(), i64::MAX)));
        // The other way round: the holder's name sorts after the placing tenant's (the guard
        // looks on both sides of the placing tenant's name, `< t` and `> t`).
        run(vec![insert("g1", "globex", token("g1", "globex")).await]).await;
        assert_eq!(check("acme").await.as_deref(), Some("globex"));
        assert_eq!(check("umbrella").await.as_deref(), Some("globex"));
        assert_eq!(check("globex").await, None);
        // A row from before migration 5: no tenant column value, its token still decides.
        run(vec![insert("old", "", token("old", "globex")).await]).await;
        assert_eq!(check("acme").await.as_deref(), Some("globex"));
        assert_eq!(check("globex").await, None);
        assert_eq!(held().await, Some(("globex".into(), i64::MAX)));
        // A lease row signed before records were typed (`typ` JWT, the lease audience): still
        // this broker's lease, read back from its own row.
        let untyped = |lease: &str, tenant: &str, aud: &str| {
            use base64::Engine;
            let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
            let claims = serde_json::json!({"lease": lease, "job": "j", "tenant": tenant,
                "node": "n1", "gpus": [0], "resources": [], "node_key": "t", "aud": aud,
                "iss": "cgx-broker", "iat": 1_000, "exp": 1_120, "until": 5_000});
            let m = format!(
                "{}.{}",
                b64.encode(br#"{"alg":"EdDSA","typ":"JWT"}"#),
                b64.encode(claims.to_string())
            );
            let pair = aws_lc_rs::signature::Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).unwrap();
            format!("{m}.{}", b64.encode(pair.sign(m.as_bytes()).as_ref()))
        };
        run(vec![
            insert("old-typ", "", untyped("old-typ", "globex", "cgx-kbs")).await,
        ])
        .await;
        assert_eq!(check("acme").await.as_deref(), Some("globex"));
        assert_eq!(held().await, Some(("globex".into(), i64::MAX)));
        // Untyped under another kind's audience (a node record's): no lease, holds nothing.
        run(vec![
            insert(
                "old-aud",
                "",
                untyped("old-aud", "globex", "cgx-broker/node"),
            )
            .await,
        ])
        .await;
        assert_eq!(check("acme").await, None);
        assert_eq!(held().await, None);
        // The column names globex, the signed token acme: acme's lease, not globex's.
        run(vec![insert("lie", "globex", token("lie", "acme")).await]).await;
        assert_eq!(check("acme").await, None);
        assert_eq!(held().await, Some(("acme".into(), i64::MAX)));
        // A row naming globex without this broker's signature holds nothing.
        run(vec![insert("forged", "globex", "not.a.token".into()).await]).await;
        assert_eq!(check("acme").await, None);
        assert_eq!(held().await, None);
        // A GPU another lease holds: refused as taken, nothing left behind.
        sqlx::query("INSERT INTO allocations (node_id, gpu, lease_id) VALUES ('n1', 1, 'x')")
            .execute(store.db.pool())
            .await
            .unwrap();
        let mut tx = store.db.pool().begin().await.unwrap();
        let taken = take_gpus_for_tenant(&mut tx, &place("acme")).await.unwrap();
        assert!(matches!(taken, Some(Refusal::GpuTaken)), "{taken:?}");
        let mine: i64 = sqlx::query("SELECT COUNT(*) AS n FROM allocations WHERE lease_id = 'new'")
            .fetch_one(&mut *tx)
            .await
            .unwrap()
            .try_get("n")
            .unwrap();
        assert_eq!(mine, 0);
        tx.rollback().await.unwrap();
        exec("DELETE FROM allocations").await;
        // An ended lease (ended by the broker's own write) holds while its last token may
        // live, then no more; of one tenant's leases the latest end counts, ended in any order.
        run(vec![
            insert("ended", "globex", token("ended", "globex")).await,
            insert("earlier", "globex", token("earlier", "globex")).await,
            (
                "INSERT INTO jobs (id, tenant, spec, state, reason, created_at, updated_at) VALUES ('j', 'globex', '{}', 'placed', '', 0, 0)",
                vec![],
            ),
        ])
        .await;
        let end = |lease: &'static str, at: i64| {
            let store = &store;
            async move {
                let w = LeaseWrite::EndLease {
                    lease: lease.into(),
                    job_from: &[],
                    job_to: JobState::Cancelled,
                    reason: "test".into(),
                    now: at,
                    now_ms: at * 1000,
                    half_life: 86_400,
                };
                assert!(matches!(store.write(w).await.unwrap(), Outcome::Ended(_)));
            }
        };
        end("ended", 890).await;
        end("earlier", 885).await;
        assert_eq!(check("acme").await.as_deref(), Some("globex"));
        assert_eq!(check("umbrella").await.as_deref(), Some("globex"));
        assert_eq!(held().await, Some(("globex".into(), 890 + 120)));
        // However many leases a tenant churned through on the node, one row says so.
        let n: i64 = sqlx::query("SELECT COUNT(*) AS n FROM node_holds")
            .fetch_one(store.db.pool())
            .await
            .unwrap()
            .try_get("n")
            .unwrap();
        assert_eq!(n, 1);
        // A lease ending in the same second writes nothing: the row keeps the first token.
        run(vec![
            insert("same", "globex", token("same", "globex")).await,
        ])
        .await;
        end("same", 890).await;
        let kept: String = sqlx::query("SELECT token FROM node_holds")
            .fetch_one(store.db.pool())
            .await
            .unwrap()
            .try_get("token")
            .unwrap();
        assert_eq!(kept, token("ended", "globex"));
        exec("UPDATE node_holds SET last_end = 870").await;
        assert_eq!(check("acme").await, None);
        assert_eq!(held().await, None);
        // A node_holds row naming globex over another tenant's token holds for that tenant.
        sqlx::query("UPDATE node_holds SET last_end = 890, token = $1")
            .bind(token("x", "initech"))
            .execute(store.db.pool())
            .await
            .unwrap();
        assert_eq!(check("acme").await.as_deref(), Some("initech"));
        assert_eq!(check("initech").await, None);
        assert_eq!(held().await, Some(("initech".into(), 890 + 120)));
        // A lease ended by any statement (another replica, an operator's SQL) leaves its hold:
        // the trigger writes it, and an earlier end never overwrites a later one.
        run(vec![
            insert("other", "umbrella", token("other", "umbrella")).await,
        ])
        .await;
        for at in [950, 940] {
            sqlx::query("UPDATE leases SET ended_at = $1 WHERE id = 'other'")
                .bind(at)
                .execute(store.db.pool())
                .await
                .unwrap();
        }
        let last: i64 = sqlx::query("SELECT last_end FROM node_holds WHERE tenant = 'umbrella'")
            .fetch_one(store.db.pool())
            .await
            .unwrap()
            .try_get("last_end")
            .unwrap();
        assert_eq!(last, 950);
        exec("DELETE FROM node_holds WHERE tenant = 'umbrella'").await;
        // Legacy rows (no tenant column value) that ended within the TTL still hold.
        run(vec![
            insert("old-ended", "", token("old-ended", "globex")).await,
        ])
        .await;
        exec("DELETE FROM node_holds").await;
        exec("UPDATE leases SET ended_at = 900").await;
        assert_eq!(check("acme").await.as_deref(), Some("globex"));
        assert_eq!(held().await, Some(("globex".into(), 900 + 120)));
        store.close().await;
        let _ = std::fs::remove_dir_all(&dir);
    }
}
