#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The storage layer under concurrency: group-committed session and audit rows, and the sealed
//! resource cache. SQLite always; PostgreSQL too where `CGX_TEST_DATABASE_URL` names a server.

use std::sync::Arc;

use cgx_kbs::server::store::{ATTESTED, FAILED, Store};

fn unique(prefix: &str) -> String {
    let mut b = [0u8; 8];
    aws_lc_rs::rand::fill(&mut b).unwrap();
    format!("{prefix}-{}", hex::encode(b))
}

/// A folder under the temporary directory, removed when dropped.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new() -> Self {
        let p = std::env::temp_dir().join(unique("cgx-store-test"));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn backends() -> Vec<(String, Arc<Store>, Option<TempDir>)> {
    let kek = [9u8; 32];
    let dir = TempDir::new();
    let url = format!("sqlite://{}", dir.path().join("kbs.db").display());
    let mut out = vec![(
        "sqlite".to_string(),
        Arc::new(
            Store::open(&url, &kek, cgx_service::clock::system())
                .await
                .unwrap(),
        ),
        Some(dir),
    )];
    match std::env::var("CGX_TEST_DATABASE_URL") {
        Ok(pg) if !pg.is_empty() => out.push((
            "postgres".to_string(),
            Arc::new(
                Store::open(&pg, &kek, cgx_service::clock::system())
                    .await
                    .unwrap(),
            ),
            None,
        )),
        _ => eprintln!("SKIPPED (PostgreSQL part): CGX_TEST_DATABASE_URL is not set"),
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_challenge_answered_many_times_at_once_is_recorded_once() {
    for (name, store, _dir) in backends().await {
        // 200 answers at once: 20 sessions answered 10 times each (replays racing the first,
        // several in one batch), as many replicas would send them.
        let ids: Vec<String> = (0..20).map(|_| unique("s")).collect();
        let mut tasks = Vec::new();
        for round in 0..10 {
            for id in &ids {
                let (store, id) = (store.clone(), id.clone());
                tasks.push(tokio::spawn(async move {
                    let state = if round % 2 == 0 { ATTESTED } else { FAILED };
                    let first = store
                        .record_session(&id, "nonce", "snp", state, i64::MAX, None)
                        .await
                        .unwrap();
                    (id, first)
                }));
            }
        }
        let mut firsts = std::collections::HashMap::<String, usize>::new();
        for t in tasks {
            let (id, first) = t.await.unwrap();
            *firsts.entry(id).or_default() += usize::from(first);
        }
        for id in &ids {
            assert_eq!(
                firsts[id], 1,
                "{name}: {id} recorded as first {} times",
                firsts[id]
            );
            assert!(
                store.session(id).await.unwrap().is_some(),
                "{name}: {id} stored"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_audit_events_are_all_kept_each_once() {
    for (name, store, _dir) in backends().await {
        let subject = unique("audit");
        let before = store.audit_events(0, 1_000_000).await.unwrap().len();
        let mut tasks = Vec::new();
        for i in 0..150 {
            let (store, subject) = (store.clone(), subject.clone());
            tasks.push(tokio::spawn(async move {
                store
                    .audit("tee", "release", &subject, &serde_json::json!({ "i": i }))
                    .await
                    .unwrap();
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let events = store.audit_events(0, 1_000_000).await.unwrap();
        let mine: Vec<_> = events.iter().filter(|e| e.subject == subject).collect();
        assert_eq!(mine.len(), 150, "{name}");
        let mut seen: Vec<i64> = mine
            .iter()
            .map(|e| e.detail["i"].as_i64().unwrap())
            .collect();
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..150).collect::<Vec<_>>(),
            "{name}: each event once"
        );
        assert!(events.len() >= before + 150);
        // Sequence numbers are strictly increasing in the order they are read.
        assert!(events.windows(2).all(|w| w[0].seq < w[1].seq), "{name}");
    }
}

#[tokio::test]
async fn a_changed_or_deleted_resource_is_never_served_from_the_cache() {
    for (name, store, _dir) in backends().await {
        let path = format!("{}/key/k", unique("t"));
        store.put_resource(&path, "t", b"one", false).await.unwrap();
        assert_eq!(store.resource(&path).await.unwrap().unwrap().value, b"one");
        // Within the cache lifetime: a change on this replica is seen at once.
        store.put_resource(&path, "t", b"two", true).await.unwrap();
        let r = store.resource(&path).await.unwrap().unwrap();
        assert_eq!(
            (r.value.as_slice(), r.requires_lease),
            (&b"two"[..], true),
            "{name}"
        );
        assert!(store.delete_resource(&path).await.unwrap());
        assert!(
            store.resource(&path).await.unwrap().is_none(),
            "{name}: deleted"
        );
        assert!(!store.delete_resource(&path).await.unwrap());
    }
}

#[tokio::test]
async fn another_replicas_change_is_seen_within_the_cache_lifetime() {
    for (name, a, dir) in backends().await {
        // A second store on the same database plays the other replica.
        let url = match &dir {
            Some(d) => format!("sqlite://{}", d.path().join("kbs.db").display()),
            None => std::env::var("CGX_TEST_DATABASE_URL").unwrap(),
        };
        let b = Store::open(&url, &[9u8; 32], cgx_service::clock::system())
            .await
            .unwrap();
        let path = format!("{}/key/k", unique("r"));
        a.put_resource(&path, "r", b"one", false).await.unwrap();
        assert_eq!(b.resource(&path).await.unwrap().unwrap().value, b"one");
        a.delete_resource(&path).await.unwrap();
        tokio::time::sleep(cgx_kbs::server::store::RESOURCE_CACHE).await;
        assert!(
            b.resource(&path).await.unwrap().is_none(),
            "{name}: stale past the cache lifetime"
        );
    }
}

/// A database written by the first schema (audit numbered by AUTOINCREMENT) is migrated in
/// place: its audit events keep their numbers and new ones follow them.
#[tokio::test]
async fn a_version_1_database_keeps_its_audit_trail_through_migration_2() {
    use sqlx::Executor;
    let dir = TempDir::new();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("kbs.db").display());
    sqlx::any::install_default_drivers();
    let old = sqlx::AnyPool::connect(&url).await.unwrap();
    // The version-1 tables this test needs, as version 1 created them.
    for stmt in [
        "CREATE TABLE schema_migrations (version BIGINT PRIMARY KEY, applied_at BIGINT NOT NULL)",
        "INSERT INTO schema_migrations (version, applied_at) VALUES (1, 0)",
        "CREATE TABLE sessions (id TEXT PRIMARY KEY, nonce TEXT NOT NULL, tee TEXT NOT NULL, state TEXT NOT NULL, created_at BIGINT NOT NULL, expires_at BIGINT NOT NULL, tee_pubkey TEXT, token TEXT)",
        "CREATE INDEX sessions_expiry ON sessions (expires_at)",
        "CREATE TABLE resources (path TEXT PRIMARY KEY, repository TEXT NOT NULL, sealed BLOB NOT NULL, requires_lease BIGINT NOT NULL, updated_at BIGINT NOT NULL)",
        "CREATE TABLE policies (scope TEXT PRIMARY KEY, body TEXT NOT NULL, updated_at BIGINT NOT NULL)",
        "CREATE TABLE audit (seq INTEGER PRIMARY KEY AUTOINCREMENT, at BIGINT NOT NULL, actor TEXT NOT NULL, action TEXT NOT NULL, subject TEXT NOT NULL, detail TEXT NOT NULL)",
        "INSERT INTO audit (at, actor, action, subject, detail) VALUES (1, 'admin:0', 'put_resource', 'a/b/c', '{}'), (2, 'tee', 'release', 'a/b/c', '{\"lease\":null}'), (3, 'tee', 'release', 'a/b/c', '{}')",
        // A gap, as AUTOINCREMENT leaves after a failed insert: numbers are kept, not redone.
        "DELETE FROM audit WHERE seq = 2",
    ] {
        old.execute(stmt).await.unwrap();
    }
    old.close().await;

    let store = Store::open(&url, &[9u8; 32], cgx_service::clock::system())
        .await
        .unwrap();
    assert_eq!(store.schema_version().await.unwrap(), 8);
    let kept = store.audit_events(0, 100).await.unwrap();
    assert_eq!(kept.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 3]);
    assert_eq!(kept[1].action, "release");
    store
        .audit("tee", "release", "a/b/c", &serde_json::json!({}))
        .await
        .unwrap();
    let after = store.audit_events(3, 100).await.unwrap();
    assert_eq!(after.iter().map(|e| e.seq).collect::<Vec<_>>(), [4]);
    store.close().await;
    // Opening again runs nothing twice.
    let again = Store::open(&url, &[9u8; 32], cgx_service::clock::system())
        .await
        .unwrap();
    assert_eq!(again.audit_events(0, 100).await.unwrap().len(), 3);
    again.close().await;
}

/// Replicas started together on one new database: each opens, the schema is migrated once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_starting_together_migrate_once() {
    let dir = TempDir::new();
    let url = format!("sqlite://{}", dir.path().join("kbs.db").display());
    let opening: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                Store::open(&url, &[9u8; 32], cgx_service::clock::system()).await
            })
        })
        .collect();
    let mut stores = Vec::new();
    for o in opening {
        stores.push(o.await.unwrap().expect("every replica opens"));
    }
    for s in &stores {
        assert_eq!(s.schema_version().await.unwrap(), 8);
    }
    if let Ok(pg) = std::env::var("CGX_TEST_DATABASE_URL")
        && !pg.is_empty()
    {
        let opening: Vec<_> = (0..3)
            .map(|_| {
                let pg = pg.clone();
                tokio::spawn(async move {
                    Store::open(&pg, &[9u8; 32], cgx_service::clock::system()).await
                })
            })
            .collect();
        for o in opening {
            let s = o.await.unwrap().expect("every PostgreSQL replica opens");
            assert_eq!(s.schema_version().await.unwrap(), 8);
        }
    }
}

/// Audit order across PostgreSQL replicas: a reader that pages by `seq` (`/audit?after=`) sees
/// every row exactly once, while two replicas write concurrently. `seq` comes from a sequence
/// drawn inside the insert's transaction; were the draws not in commit order, a row with a
/// lower `seq` could commit after the reader had passed it, and be missed for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn audit_order_across_postgresql_replicas_misses_no_row() {
    let Ok(pg) = std::env::var("CGX_TEST_DATABASE_URL") else {
        eprintln!("SKIPPED: CGX_TEST_DATABASE_URL is not set");
        return;
    };
    let kek = [9u8; 32];
    let a = Arc::new(
        Store::open(&pg, &kek, cgx_service::clock::system())
            .await
            .unwrap(),
    );
    let b = Arc::new(
        Store::open(&pg, &kek, cgx_service::clock::system())
            .await
            .unwrap(),
    );
    let start = a
        .audit_events(0, i64::MAX)
        .await
        .unwrap()
        .last()
        .map_or(0, |e| e.seq);
    let run = unique("order");
    let (writers, per) = (16, 40);
    let mut tasks = Vec::new();
    for w in 0..writers {
        let store = if w % 2 == 0 { a.clone() } else { b.clone() };
        let run = run.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..per {
                store
                    .audit(
                        "test",
                        "order",
                        &format!("{run}/{w}/{i}"),
                        &serde_json::json!({}),
                    )
                    .await
                    .unwrap();
            }
        }));
    }
    // The reader: pages forward from its cursor, as an auditor's tail would.
    let reader = {
        let a = a.clone();
        let run = run.clone();
        tokio::spawn(async move {
            let mut cursor = start;
            let mut seen = std::collections::HashSet::new();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            while seen.len() < writers * per && std::time::Instant::now() < deadline {
                for e in a.audit_events(cursor, 50).await.unwrap() {
                    assert!(e.seq > cursor);
                    cursor = e.seq;
                    if e.subject.starts_with(&run) {
                        assert!(seen.insert(e.subject.clone()), "{} twice", e.subject);
                    }
                }
            }
            seen.len()
        })
    };
    for t in tasks {
        t.await.unwrap();
    }
    let seen = reader.await.unwrap();
    assert_eq!(seen, writers * per, "rows the paging reader never saw");
}

/// The sweep drops sessions whose challenge (and so the session) expired long enough ago, and
/// keeps live ones; on SQLite it goes by the ids' time prefix, with no index on the expiry.
#[tokio::test]
async fn the_sweep_drops_dead_sessions_and_keeps_live_ones() {
    use cgx_kbs::server::store::id_time_prefix;
    for (name, store, _dir) in backends().await {
        let tag = unique("sweep");
        // Challenge expired at 600, session at 850: dead at 1000 with a 300 s session lifetime.
        let dead = format!("{}.{tag}.snp.00", id_time_prefix(600));
        // Challenge expiring at 990, session at 1200: alive at 1000.
        let live = format!("{}.{tag}.snp.00", id_time_prefix(990));
        assert!(
            store
                .record_session(&dead, "n", "snp", ATTESTED, 850, None)
                .await
                .unwrap()
        );
        assert!(
            store
                .record_session(&live, "n", "snp", ATTESTED, 1200, None)
                .await
                .unwrap()
        );
        assert!(
            store.sweep_sessions(1000, 300).await.unwrap() >= 1,
            "{name}"
        );
        assert!(
            store.session(&dead).await.unwrap().is_none(),
            "{name}: dead kept"
        );
        assert!(
            store.session(&live).await.unwrap().is_some(),
            "{name}: live dropped"
        );
    }
}

#[test]
fn session_ids_compare_as_their_times() {
    use cgx_kbs::server::store::id_time_prefix;
    assert_eq!(id_time_prefix(-5), "000000000000");
    let id = format!("{}.ab.snp.cd", id_time_prefix(700));
    assert!(id.as_str() >= id_time_prefix(700).as_str());
    assert!(id.as_str() < id_time_prefix(701).as_str());
    assert!(format!("{}.ff", id_time_prefix(99)).as_str() < id_time_prefix(100).as_str());
}
