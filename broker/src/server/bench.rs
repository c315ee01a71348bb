//! Settlement's durable throughput, for `cgx-bench ledger` (issue 32, item 8): a broker on a
//! SQLite file at `synchronous=FULL`, seeded with leases, their escrows (opened through the
//! placement's own ledger write) and their accepted metering records; then the settlement
//! pass itself — the code the broker runs — timed until every record is settled. Beside it,
//! in the same run and the same file, the database's own durable commit rate for the same
//! batches: as many rows as the settlement wrote, in as many transactions, sent the way the
//! ledger sends them (JSON batches) into a table with one key and no other index, and
//! committed.

use std::path::Path;
use std::time::Instant;

use cgx_ledger::settle::{Escrow, Price};
use cgx_service::db::placeholders;

use super::store::{EscrowOpen, LedgerWrite, Outcome};
use super::{Broker, BrokerConfig, BrokerError};

/// What one run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SettleRun {
    pub leases: usize,
    pub windows_per_lease: u64,
    pub records: u64,
    /// Settlement passes it took (each one write, one durable commit).
    pub passes: usize,
    pub settle_secs: f64,
    pub records_per_sec: f64,
    /// Rows the settlement wrote: transfers, settled windows, accounts, escrows.
    pub rows_written: u64,
    /// The same number of rows in the same number of transactions, bare.
    pub raw_secs: f64,
    pub raw_records_per_sec: f64,
    /// records_per_sec ÷ raw_records_per_sec.
    pub ratio: f64,
}

fn e(x: impl std::fmt::Display) -> BrokerError {
    BrokerError::Internal(x.to_string())
}

/// A broker with proofs off (a window is paid on its record alone: the pass's cost is the
/// ledger's) on a fresh SQLite file in `dir`.
async fn broker(dir: &Path) -> Result<Broker, BrokerError> {
    let key =
        aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .map_err(|_| e("key"))?;
    std::fs::create_dir_all(dir).map_err(e)?;
    std::fs::write(dir.join("signing.pk8"), key.as_ref()).map_err(e)?;
    let config: BrokerConfig = serde_json::from_value(serde_json::json!({
        "listen": "127.0.0.1:0",
        "insecure_dev": true,
        "database": format!("sqlite://{}", dir.join("broker.db").display()),
        "signing_key": dir.join("signing.pk8"),
        "pow": {"interval_secs": 0},
    }))
    .map_err(e)?;
    Broker::new(&config, cgx_service::clock::system()).await
}

/// Settle `leases × windows` records on a fresh broker in `dir`.
pub async fn settle_durable(
    dir: &Path,
    leases: usize,
    windows: u64,
) -> Result<SettleRun, BrokerError> {
    let b = broker(dir).await?;
    let now = b.clock.unix();
    let start = now - i64::try_from(windows).map_err(e)? - 10;
    b.deposit_as("tenant/bench", 1_000_000_000_000, "bench-funds", "bench")
        .await?;
    let price = Price {
        per_gpu_hour: 3_600_000,
        gpus: 1,
        window_secs: 1,
    };
    for l in 0..leases {
        let lease = format!("l{l:06}");
        let escrow = Escrow::new(&lease, "bench", "op", price, 1000, now + 86_400).map_err(e)?;
        let o = EscrowOpen {
            escrow,
            job_id: format!("j{l:06}"),
            node_id: "n".into(),
            started_at: start,
            covers: windows,
            reserve: price.cost(windows).map_err(e)?,
            job_committed: 0,
        };
        b.store
            .seed_lease(
                &lease,
                &o.job_id,
                start,
                start + windows as i64 * 2,
                windows,
            )
            .await?;
        match b.store.write(LedgerWrite::Open(Box::new(o))).await? {
            Outcome::Done => {}
            other => return Err(e(format!("escrow: {other:?}"))),
        }
    }
    let records = leases as u64 * windows;
    let rows_before = b.store.row_count().await?;
    let t = Instant::now();
    let mut passes = 0;
    let mut settled = 0;
    while settled < records {
        let n = b.settle_pass().await?;
        passes += 1;
        if n == 0 {
            return Err(e(format!("settlement stopped at {settled} of {records}")));
        }
        settled += n as u64;
    }
    let settle_secs = t.elapsed().as_secs_f64();
    let rows_written = b.store.row_count().await? - rows_before;
    // The bound: as many rows, in as many durable transactions, bare.
    let per_pass = rows_written.div_ceil(passes as u64);
    let t = Instant::now();
    for p in 0..passes {
        b.store.raw_batch(p, per_pass).await?;
    }
    let raw_secs = t.elapsed().as_secs_f64();
    b.store.close().await;
    let records_per_sec = records as f64 / settle_secs;
    let raw_records_per_sec = records as f64 / raw_secs;
    Ok(SettleRun {
        leases,
        windows_per_lease: windows,
        records,
        passes,
        settle_secs,
        records_per_sec,
        rows_written,
        raw_secs,
        raw_records_per_sec,
        ratio: records_per_sec / raw_records_per_sec,
    })
}

impl super::store::Store {
    /// A lease row and `windows` accepted metering records of it (the bench's seed: what
    /// placement and the metering endpoint would have written).
    pub(crate) async fn seed_lease(
        &self,
        lease: &str,
        job: &str,
        start: i64,
        ends: i64,
        windows: u64,
    ) -> Result<(), BrokerError> {
        let mut tx = self.db.write_pool().begin().await?;
        sqlx::query(
            "INSERT INTO leases (id, job_id, node_id, gpus, token, started_at, ends_at, tenant) VALUES ($1, $2, 'n', '0', '', $3, $4, 'bench')",
        )
        .bind(lease)
        .bind(job)
        .bind(start)
        .bind(ends)
        .execute(&mut *tx)
        .await?;
        let seqs: Vec<u64> = (0..windows).collect();
        for chunk in seqs.chunks(80) {
            let sql = format!(
                "INSERT INTO metering (lease_id, seq, hash, token, accepted_at) VALUES {}",
                placeholders(chunk.len(), 5)
            );
            let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
            for s in chunk {
                q = q
                    .bind(lease.to_string())
                    .bind(i64::try_from(*s).unwrap_or(i64::MAX))
                    .bind(format!("{lease}{s:08}{}", "0".repeat(49)))
                    .bind(String::new())
                    .bind(start);
            }
            q.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Rows in the tables settlement writes.
    pub(crate) async fn row_count(&self) -> Result<u64, BrokerError> {
        let mut n = 0u64;
        // The log's leaves (one per transfer chain) are rows the pass writes too.
        for t in [
            "audit",
            "ledger_transfers",
            "settled_windows",
            "ledger_accounts",
            "escrows",
        ] {
            let r: i64 = sqlx::Row::try_get(
                &sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT COUNT(*) AS c FROM {t}"
                )))
                .fetch_one(self.db.pool())
                .await?,
                "c",
            )?;
            n += u64::try_from(r).unwrap_or(0);
        }
        Ok(n)
    }

    /// `rows` rows of a transfer's width in one durable transaction, sent as the ledger sends
    /// them (JSON batches the database unpacks), into a table with one key and no other
    /// index: the bound `cgx-bench ledger` sets settlement against.
    pub(crate) async fn raw_batch(&self, pass: usize, rows: u64) -> Result<(), BrokerError> {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS bench_raw (id TEXT PRIMARY KEY, debit TEXT, credit TEXT, amount BIGINT, reference TEXT, at BIGINT)",
        )
        .execute(self.db.write_pool())
        .await?;
        let mut tx = self.db.write_pool().begin().await?;
        let batch: Vec<(String, &str, &str, i64, String, i64)> = (0..rows)
            .map(|i| {
                (
                    format!("pay/l{pass:06}/{i}/provider"),
                    "escrow/l000000",
                    "provider/op",
                    900,
                    format!("{i:064}"),
                    0,
                )
            })
            .collect();
        super::store::insert_json(
            &mut tx,
            "bench_raw",
            &[
                ("id", "text"),
                ("debit", "text"),
                ("credit", "text"),
                ("amount", "bigint"),
                ("reference", "text"),
                ("at", "bigint"),
            ],
            &batch,
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }
}

/// What one run of the log's durable append measured (`cgx-bench log`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct LogRun {
    pub leaves: u64,
    /// Audit rows per durable transaction (a batch of decisions, as the writer commits them).
    pub batch: u64,
    /// Bytes per leaf (as the log commits to it).
    pub leaf_bytes: usize,
    /// From the first row written to the checkpoint covering the last.
    pub secs: f64,
    pub leaves_per_sec: f64,
    /// Checkpoints signed on the way, and the longest time between two (or from the start to
    /// the first).
    pub checkpoints: u64,
    pub max_checkpoint_gap_ms: f64,
}

/// The log's durable append on SQLite (`synchronous=FULL`): `leaves` audit rows committed in
/// transactions of `batch` while the broker's integrator appends them to the tree and signs a
/// checkpoint, pass after pass (each pass one write transaction), until a checkpoint covers
/// them all. The writer and the integrator share SQLite's one writer, as in the broker.
pub async fn log_durable(
    dir: &Path,
    leaves: u64,
    batch: u64,
    detail: &str,
) -> Result<LogRun, BrokerError> {
    let key =
        aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .map_err(|_| e("key"))?;
    std::fs::create_dir_all(dir).map_err(e)?;
    std::fs::write(dir.join("log.pk8"), key.as_ref()).map_err(e)?;
    let b = std::sync::Arc::new(log_broker(dir).await?);
    let before = cgx_service::tlog::newest(b.store.db.pool())
        .await
        .map_err(e)?
        .map_or(0, |(s, _, _)| s);
    let target = before + leaves;
    let t = Instant::now();
    let integrator = {
        let b = b.clone();
        tokio::spawn(async move {
            let mut last = Instant::now();
            let mut checkpoints = 0u64;
            let mut max_gap = 0f64;
            loop {
                match b.integrate_log_pass().await? {
                    Some(d) => {
                        checkpoints += 1;
                        max_gap = max_gap.max(last.elapsed().as_secs_f64());
                        last = Instant::now();
                        if d.size >= target {
                            return Ok::<_, BrokerError>((checkpoints, max_gap));
                        }
                    }
                    None => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
                }
            }
        })
    };
    let mut written = 0;
    while written < leaves {
        let n = batch.min(leaves - written);
        let rows: Vec<(i64, &str, &str, String, &str)> = (written..written + n)
            .map(|i| {
                (
                    1_800_000_000,
                    "node:n",
                    "metering.accept",
                    format!("l{:06}", i / 1440),
                    detail,
                )
            })
            .collect();
        insert(&b, "audit", AUDIT_COLUMNS, &rows).await?;
        written += n;
        // The writer yields between batches, as requests arrive.
        tokio::task::yield_now().await;
    }
    let (checkpoints, max_gap) = integrator.await.map_err(e)??;
    let secs = t.elapsed().as_secs_f64();
    let sample = sqlx::query("SELECT leaf FROM log_leaves ORDER BY idx DESC LIMIT 1")
        .fetch_one(b.store.db.pool())
        .await?;
    let leaf: String = sqlx::Row::try_get(&sample, "leaf")?;
    b.store.close().await;
    Ok(LogRun {
        leaves,
        batch,
        leaf_bytes: leaf.len(),
        secs,
        leaves_per_sec: leaves as f64 / secs,
        checkpoints,
        max_checkpoint_gap_ms: max_gap * 1e3,
    })
}

/// The audit table's columns as the benchmarks write rows: (at, actor, action, subject, detail).
const AUDIT_COLUMNS: &[(&str, &str)] = &[
    ("at", "bigint"),
    ("actor", "text"),
    ("action", "text"),
    ("subject", "text"),
    ("detail", "text"),
];

/// `rows` into `table`'s `columns`, in one durable transaction on the broker's SQLite writer.
async fn insert<R: serde::Serialize>(
    b: &Broker,
    table: &str,
    columns: &[(&str, &str)],
    rows: &[R],
) -> Result<(), BrokerError> {
    let mut tx = b
        .store
        .db
        .write_pool()
        .begin_with("BEGIN IMMEDIATE")
        .await?;
    super::store::insert_json(&mut tx, table, columns, rows).await?;
    tx.commit().await?;
    Ok(())
}

/// A broker keeping a log (its key `log.pk8` in `dir`) on a fresh SQLite file there.
async fn log_broker(dir: &Path) -> Result<Broker, BrokerError> {
    let key =
        aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .map_err(|_| e("key"))?;
    std::fs::write(dir.join("signing.pk8"), key.as_ref()).map_err(e)?;
    let config: BrokerConfig = serde_json::from_value(serde_json::json!({
        "listen": "127.0.0.1:0",
        "insecure_dev": true,
        "database": format!("sqlite://{}", dir.join("broker.db").display()),
        "signing_key": dir.join("signing.pk8"),
        "pow": {"interval_secs": 0},
        "log": {"origin": "bench.cgx/log", "key": dir.join("log.pk8")},
    }))
    .map_err(e)?;
    Broker::new(&config, cgx_service::clock::system()).await
}

/// A broker's database as the console benchmark reads it (`cgx-bench console`): what was
/// seeded, and where the users' keys are.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ConsoleSeed {
    pub nodes: usize,
    pub jobs: usize,
    pub leaves: u64,
    /// The broker's configuration on that database (its log, the three users' API keys).
    pub config: serde_json::Value,
    /// PKCS#8 files: a tenant (`tenant:acme`), an operator (`operator:op1`), an auditor.
    pub tenant_key: std::path::PathBuf,
    pub operator_key: std::path::PathBuf,
    pub auditor_key: std::path::PathBuf,
    /// A node id, a jobs-page cursor and an audit seq from the middle of each.
    pub node_mid: String,
    pub job_cursor_mid: String,
    pub job_id: String,
    pub seq_mid: i64,
    /// Seconds it took to seed.
    pub seed_secs: f64,
}

/// The tenant the benchmark signs in as: a tenth of the jobs are its own.
pub const CONSOLE_TENANT: &str = "acme";
/// The operator it signs in as: one of 100, each a hundredth of the fleet.
pub const CONSOLE_OPERATOR: &str = "op1";

/// Seed `dir` with `nodes` signed node records (100 operators), `jobs` sealed jobs (a tenth of
/// them [`CONSOLE_TENANT`]'s) and `leaves` audited decisions integrated into the log, written
/// straight to the database as the broker's own rows (a replica reading them verifies each
/// record's signature at its start). Where `dir` holds a finished seed, that one is reused.
pub async fn console_seed(
    dir: &Path,
    nodes: usize,
    jobs: usize,
    leaves: u64,
) -> Result<ConsoleSeed, BrokerError> {
    let marker = dir.join("seed.json");
    if let Ok(text) = std::fs::read_to_string(&marker)
        && let Ok(seed) = serde_json::from_str::<ConsoleSeed>(&text)
        && (seed.nodes, seed.jobs, seed.leaves) == (nodes, jobs, leaves)
    {
        return Ok(seed);
    }
    let t = Instant::now();
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(e)?;
    let pk8 = || {
        aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .map(|k| k.as_ref().to_vec())
            .map_err(|_| e("key"))
    };
    let public = |der: &[u8]| -> Result<String, BrokerError> {
        use aws_lc_rs::signature::KeyPair;
        let kp = aws_lc_rs::signature::Ed25519KeyPair::from_pkcs8(der).map_err(|_| e("key"))?;
        Ok(base64::Engine::encode(
            &base64::engine::general_purpose::STANDARD,
            kp.public_key().as_ref(),
        ))
    };
    std::fs::write(dir.join("signing.pk8"), pk8()?).map_err(e)?;
    std::fs::write(dir.join("log.pk8"), pk8()?).map_err(e)?;
    let mut api_keys = Vec::new();
    let mut files = Vec::new();
    for (file, scope) in [
        ("tenant.pk8", format!("tenant:{CONSOLE_TENANT}")),
        ("operator.pk8", format!("operator:{CONSOLE_OPERATOR}")),
        ("auditor.pk8", "auditor".to_string()),
    ] {
        let der = pk8()?;
        std::fs::write(dir.join(file), &der).map_err(e)?;
        api_keys.push(serde_json::json!({ "public_key": public(&der)?, "scopes": [scope] }));
        files.push(dir.join(file));
    }
    let config = serde_json::json!({
        "listen": "127.0.0.1:0",
        "insecure_dev": true,
        "database": format!("sqlite://{}", dir.join("broker.db").display()),
        "signing_key": dir.join("signing.pk8"),
        "pow": {"interval_secs": 0},
        "api_keys": api_keys,
        "log": {"origin": "bench.cgx/log", "key": dir.join("log.pk8")},
    });
    let parsed: BrokerConfig = serde_json::from_value(config.clone()).map_err(e)?;
    let b = Broker::new(&parsed, cgx_service::clock::system()).await?;
    let now = b.clock.unix();
    let now_ms = now * 1000;

    // Nodes: signed records, as registration stores them.
    let ids: Vec<String> = (0..nodes).map(|i| format!("n{i:08}")).collect();
    for chunk in ids.chunks(8192) {
        let mut rows = Vec::with_capacity(chunk.len());
        for (k, id) in chunk.iter().enumerate() {
            let i = id[1..].parse::<usize>().unwrap_or(k);
            let mut node_key = [0u8; 32];
            aws_lc_rs::rand::fill(&mut node_key).map_err(|_| e("random"))?;
            let record = super::index::NodeRecord {
                id: id.clone(),
                node_key: cgx_protocol::broker::b64(&node_key),
                tee_thumbprint: String::new(),
                operator: format!("op{}", i % 100),
                region: ["eu-west", "us-east", "ap-south", "eu-north"][i % 4].into(),
                tee: cgx_protocol::records::TeeKind::Snp,
                sim: false,
                gpu_model: "H100".into(),
                gpu_chip: "GH100".into(),
                gpu_count: 8,
                gpu_memory_gib: 80,
                price: cgx_protocol::money::Micros(1_000_000 + (i as u64 % 300) * 10_000),
                status: cgx_protocol::records::Tier::Affirming,
                violations: Vec::new(),
                attested_at: now,
                ear_expires_at: now + 86_400,
                ear_digest: String::new(),
                claims: serde_json::json!({"cpu": {"tee": "snp"}, "gpus": []}),
            };
            let token = b.keys.sign_record(&record)?;
            rows.push((
                id.clone(),
                record.operator,
                token,
                now,
                now,
                1i64,
                0i64,
                now_ms,
            ));
        }
        insert(
            &b,
            "nodes",
            &[
                ("id", "text"),
                ("operator", "text"),
                ("record", "text"),
                ("attested_at", "bigint"),
                ("last_heartbeat", "bigint"),
                ("heartbeat_seq", "bigint"),
                ("reputation", "bigint"),
                ("updated_ms", "bigint"),
            ],
            &rows,
        )
        .await?;
    }

    // Jobs: sealed, a tenth the benchmark tenant's, newest last.
    let spec = serde_json::json!({
        "tenant": CONSOLE_TENANT, "gpu_model": "H100", "gpu_count": 1,
        "max_price_per_gpu_hour_micros": 3_000_000, "duration_secs": 3600,
        "budget_micros": 3_000_000,
    })
    .to_string();
    let states = [
        "completed",
        "completed",
        "completed",
        "failed",
        "cancelled",
        "expired",
    ];
    let mut mid = (String::new(), String::new());
    for start in (0..jobs).step_by(8192) {
        let mut rows = Vec::with_capacity(8192);
        for i in start..(start + 8192).min(jobs) {
            let id = format!("j{i:09}");
            let tenant = if i % 10 == 0 {
                CONSOLE_TENANT.to_string()
            } else {
                format!("t{}", i % 1000)
            };
            let created = now - 86_400 + i64::try_from(i).map_err(e)?;
            let seal = b.keys.seal_job(&id, &tenant, &spec, created);
            if i == jobs / 2 - (jobs / 2) % 10 {
                mid = (format!("{created}.{id}"), id.clone());
            }
            let node = ids.get(i % ids.len().max(1)).cloned();
            rows.push((
                id,
                tenant,
                spec.clone(),
                states[i % states.len()],
                "seeded",
                node,
                Option::<String>::None,
                created,
                created + 60,
                seal,
            ));
        }
        insert(
            &b,
            "jobs",
            &[
                ("id", "text"),
                ("tenant", "text"),
                ("spec", "text"),
                ("state", "text"),
                ("reason", "text"),
                ("node_id", "text"),
                ("lease_id", "text"),
                ("created_at", "bigint"),
                ("updated_at", "bigint"),
                ("seal", "text"),
            ],
            &rows,
        )
        .await?;
    }

    // Decisions: the log's leaves, integrated pass after pass.
    let detail =
        serde_json::json!({"seq": "0", "hash": "00".repeat(32), "window_start": "1800000000"})
            .to_string();
    let actions = [
        "metering.accept",
        "lease.renew",
        "pow.verdict",
        "ledger.transfer",
        "lease.open",
        "lease.end",
    ];
    let mut written = 0u64;
    while written < leaves {
        let n = 8192.min(leaves - written);
        let rows: Vec<(i64, &str, &str, String, &str)> = (written..written + n)
            .map(|i| {
                let subject = match i % 3 {
                    0 => format!("n{:08}", i % nodes.max(1) as u64),
                    1 => format!("l{:09}", i / 1440),
                    _ => format!("j{:09}", i % jobs.max(1) as u64),
                };
                (
                    now - 86_400,
                    "node:n",
                    actions[(i % 6) as usize],
                    subject,
                    detail.as_str(),
                )
            })
            .collect();
        insert(&b, "audit", AUDIT_COLUMNS, &rows).await?;
        written += n;
    }
    let base = cgx_service::tlog::newest(b.store.db.pool())
        .await
        .map_err(e)?
        .map_or(0, |(s, _, _)| s);
    loop {
        match b.integrate_log_pass().await? {
            Some(d) if d.size >= base + leaves => break,
            Some(_) => {}
            None => {
                if cgx_service::tlog::newest(b.store.db.pool())
                    .await
                    .map_err(e)?
                    .is_some_and(|(s, _, _)| s >= base + leaves)
                {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        }
    }
    let seq_mid = i64::try_from(leaves / 2).map_err(e)?.max(1);
    b.store.close().await;
    let seed = ConsoleSeed {
        nodes,
        jobs,
        leaves,
        config,
        tenant_key: files[0].clone(),
        operator_key: files[1].clone(),
        auditor_key: files[2].clone(),
        node_mid: ids.get(nodes / 2).cloned().unwrap_or_default(),
        job_cursor_mid: mid.0,
        job_id: mid.1,
        seq_mid,
        seed_secs: t.elapsed().as_secs_f64(),
    };
    std::fs::write(&marker, serde_json::to_vec_pretty(&seed).map_err(e)?).map_err(e)?;
    Ok(seed)
}
