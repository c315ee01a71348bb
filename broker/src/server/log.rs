//! The broker's transparency log (issue 33; the format is `cgx_tlog`'s, the storage
//! `cgx_service::tlog`'s): every audit row the broker commits is a leaf; a task integrates them
//! and signs a checkpoint every `[log] interval_ms`; `GET /v1/log/checkpoint` and
//! `GET /v1/log/tile/…` serve the log as C2SP tlog-tiles lays it out — the checkpoint and hash
//! tiles to anyone, entry bundles (they name tenants, nodes and amounts) to auditors.

use std::sync::Arc;

use super::{Broker, BrokerError};

impl Broker {
    /// One integration pass: the log's size after it, if anything was appended.
    pub(crate) async fn integrate_log(&self) -> Result<Option<u64>, BrokerError> {
        let Some(key) = &self.log_key else {
            return Ok(None);
        };
        let done = self.store.integrate_log(key, self.clock.unix()).await?;
        Ok(done.map(|d| d.size))
    }

    /// The newest signed checkpoint.
    pub(crate) async fn log_checkpoint(&self) -> Result<Vec<u8>, BrokerError> {
        if self.log_key.is_none() {
            return Err(BrokerError::NotFound("this broker keeps no log".into()));
        }
        cgx_service::tlog::checkpoint(self.store.db.pool())
            .await
            .map_err(|e| BrokerError::Storage(e.to_string()))?
            .ok_or_else(|| BrokerError::NotFound("no checkpoint yet".into()))
    }

    /// A tile (`tile/…`) of the newest checkpoint's tree; entry bundles need `auditor` (or
    /// `*`).
    pub(crate) async fn log_tile(&self, path: &str, auditor: bool) -> Result<Vec<u8>, BrokerError> {
        if self.log_key.is_none() {
            return Err(BrokerError::NotFound("this broker keeps no log".into()));
        }
        if path.len() > 64 {
            return Err(BrokerError::NotFound("no such tile".into()));
        }
        match cgx_service::tlog::tile(self.store.db.pool(), path, auditor).await {
            Ok(Some(t)) => Ok(t),
            Ok(None) => Err(BrokerError::NotFound(format!("no tile {path} (yet)"))),
            Err(cgx_service::tlog::LogStoreError::Log(cgx_tlog::LogError::Path(p)))
                if p.starts_with("entry bundles") =>
            {
                Err(BrokerError::Forbidden(p))
            }
            Err(cgx_service::tlog::LogStoreError::Log(e)) => {
                Err(BrokerError::NotFound(e.to_string()))
            }
            Err(e) => Err(BrokerError::Storage(e.to_string())),
        }
    }
}

/// The integrator: a pass every `every`; a pass that appended goes again at once (a backlog
/// drains at the database's pace).
pub(super) async fn integrator(broker: Arc<Broker>, every: std::time::Duration) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        match broker.integrate_log().await {
            Ok(Some(size)) => tracing::debug!(size, "log checkpoint signed"),
            Ok(None) => {}
            Err(e) => tracing::error!(error = %e, "log not integrated"),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::super::config::LogConfig;
    use super::super::testing::Harness;
    use super::*;
    use cgx_tlog::note::{KeyKind, NoteSigner};
    use cgx_tlog::tlog_tiles::Tile;
    use cgx_tlog::verify::{Trust, verify_dir};
    use cgx_tlog::{HEIGHT, paths};

    const ORIGIN: &str = "broker.test/log";

    /// The log as a reader fetches it: the checkpoint, every hash tile and entry bundle of
    /// its tree, written to `dir`.
    async fn fetch(b: &Broker, dir: &std::path::Path) -> Vec<u8> {
        let note = b.log_checkpoint().await.unwrap();
        let size = {
            let text = String::from_utf8(note.clone()).unwrap();
            text.lines().nth(1).unwrap().parse::<u64>().unwrap()
        };
        for t in Tile::new_tiles(HEIGHT, 0, size) {
            let p = paths::tile_path(&t);
            let data = b.log_tile(&p, false).await.unwrap();
            std::fs::create_dir_all(dir.join(&p).parent().unwrap()).unwrap();
            std::fs::write(dir.join(&p), data).unwrap();
            if t.level() == 0 {
                let e = paths::tile_path(&paths::bundle_tile(t.level_index(), t.width()));
                assert!(matches!(
                    b.log_tile(&e, false).await,
                    Err(BrokerError::Forbidden(_))
                ));
                let data = b.log_tile(&e, true).await.unwrap();
                std::fs::create_dir_all(dir.join(&e).parent().unwrap()).unwrap();
                std::fs::write(dir.join(&e), data).unwrap();
            }
        }
        std::fs::write(dir.join("checkpoint"), &note).unwrap();
        note
    }

    /// Every audit row becomes a leaf, in order, and the log the broker serves verifies
    /// offline and extends the checkpoint seen before; a stored hash edited behind the
    /// broker's back stops the log rather than have it sign another tree.
    #[tokio::test]
    async fn the_audit_trail_is_a_log_that_verifies_offline() {
        audit_trail_log(None, "sqlite").await;
    }

    /// The same on PostgreSQL (the integrator under the replicas' write lock). Skipped, said
    /// so, where CI names no PostgreSQL.
    #[tokio::test]
    async fn the_audit_trail_is_a_log_on_postgres_too() {
        let Some(db) = Harness::postgres().await else {
            eprintln!("SKIPPED: CGX_TEST_DATABASE_URL is not set");
            return;
        };
        audit_trail_log(Some(db), "pg").await;
    }

    async fn audit_trail_log(database: Option<String>, tag: &str) {
        let dir = std::env::temp_dir().join(format!("cgx-broker-log-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let der = aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(
            &aws_lc_rs::rand::SystemRandom::new(),
        )
        .unwrap();
        let key = dir.join("log.pk8");
        std::fs::write(&key, der.as_ref()).unwrap();
        let signer = NoteSigner::from_pkcs8(ORIGIN, KeyKind::Ed25519, der.as_ref()).unwrap();
        let trust = Trust {
            log: signer.verifier(),
            witnesses: Vec::new(),
            quorum: 0,
        };
        let log = LogConfig {
            origin: ORIGIN.into(),
            key: key.clone(),
            interval_ms: 1000,
        };
        let ear = dir.join("ear.pk8");
        let ear_key = aws_lc_rs::signature::EcdsaKeyPair::generate_pkcs8(
            &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            &aws_lc_rs::rand::SystemRandom::new(),
        )
        .unwrap();
        std::fs::write(&ear, ear_key.as_ref()).unwrap();
        let h = Harness::with("log", |c| {
            c.log = Some(log);
            if let Some(db) = database {
                c.database = db;
                c.result_key = Some(ear.clone());
            }
        })
        .await;
        assert!(matches!(
            h.broker.log_checkpoint().await,
            Err(BrokerError::NotFound(_))
        ));
        // The harness's deposits are audited: each a leaf.
        let size = h.broker.integrate_log().await.unwrap().unwrap();
        assert!(size >= 2, "{size}");
        assert_eq!(h.broker.integrate_log().await.unwrap(), None);
        let first = fetch(&h.broker, &dir.join("one")).await;
        let v = verify_dir(&dir.join("one"), &trust, None).unwrap();
        assert_eq!(v.size, size);
        let events = cgx_service::audit::read(h.broker.store.db.pool(), 0, 1000)
            .await
            .unwrap();
        assert_eq!(events.len() as u64, size);
        for (leaf, e) in v.leaves.iter().zip(&events) {
            assert_eq!(leaf, &e.leaf(crate::server::store::SERVICE));
            let j: serde_json::Value = serde_json::from_slice(leaf).unwrap();
            assert_eq!(j["kind"], "cgx.audit.v1");
            assert_eq!(j["service"], "cgx-broker");
        }
        // More decisions — deposits, a lease opened and ended — and the next checkpoint
        // extends the first.
        for i in 0..300 {
            h.deposit("tenant/acme", 1 + i, &format!("log-{i}"))
                .await
                .unwrap();
        }
        let node = h.node(2);
        h.register(&node).await.unwrap();
        let tenant = h.admin(super::super::testing::Role::Tenant);
        let job = h
            .broker
            .submit(&tenant, Harness::job(2, 3600))
            .await
            .unwrap();
        let lease = job.lease_id.clone().unwrap();
        h.broker.cancel(&tenant, &job.id).await.unwrap();
        let size2 = h.broker.integrate_log().await.unwrap().unwrap();
        assert!(size2 >= size + 302, "{size2}");
        fetch(&h.broker, &dir.join("two")).await;
        let v = verify_dir(&dir.join("two"), &trust, Some(&first)).unwrap();
        assert_eq!(v.size, size2);
        let leaves: Vec<serde_json::Value> = v
            .leaves
            .iter()
            .map(|l| serde_json::from_slice(l).unwrap())
            .collect();
        let deposit = &leaves[size as usize + 299];
        assert_eq!(deposit["action"], "ledger.deposit");
        assert_eq!(deposit["subject"], "tenant/acme");
        let of_lease: Vec<&serde_json::Value> =
            leaves.iter().filter(|l| l["subject"] == lease).collect();
        assert_eq!(of_lease.len(), 2, "{of_lease:?}");
        assert_eq!(of_lease[0]["action"], "lease.open");
        assert_eq!(of_lease[0]["detail"]["node"], node.id);
        assert_eq!(of_lease[0]["detail"]["tenant"], "acme");
        assert_eq!(of_lease[1]["action"], "lease.end");
        assert_eq!(of_lease[1]["detail"]["job"], job.id);
        // A tile path that is not one, or beyond the tree: not found, nothing read.
        for p in [
            "tile/0/x001/000",
            "tile/7/000",
            "tile/6/000.p/1",
            "tile/0/x072/x057/x594/x037/x927/935",
            "tile/0/x072/x057/x594/x037/x927/936",
            "tile/entries/x072/x057/x594/x037/x927/935",
            "tile/9/000",
            "tile/0/000.p/0",
            "tile/../x",
            "checkpoint",
        ] {
            assert!(
                matches!(
                    h.broker.log_tile(p, true).await,
                    Err(BrokerError::NotFound(_))
                ),
                "{p}"
            );
        }
        // A stored frontier hash edited: the next pass refuses to sign, and says why.
        sqlx::query(
            "UPDATE log_hashes SET hash = $1 WHERE idx = (SELECT MAX(idx) FROM log_hashes)",
        )
        .bind("AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=")
        .execute(h.broker.store.db.pool())
        .await
        .unwrap();
        h.deposit("tenant/acme", 1, "after-edit").await.unwrap();
        let e = h.broker.integrate_log().await.unwrap_err().to_string();
        assert!(e.contains("does not match its last checkpoint"), "{e}");
        assert_eq!(
            h.broker.log_checkpoint().await.unwrap(),
            cgx_service::tlog::checkpoint(h.broker.store.db.pool())
                .await
                .unwrap()
                .unwrap()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
