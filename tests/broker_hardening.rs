#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The broker against the attacks of issue 28: a database writer who forges, edits or moves
//! job rows, or puts an older node record back; a tenant who floods the pending queue; one GPU
//! offered by two nodes through two replicas; two tenants on one VM. Each attack is refused
//! with its reason.

use std::time::{Duration, Instant};

use cgx_broker::client::{BrokerClient, ClientError};
use cgx_devnet::broker::{BrokerServer, BrokerSetup, OPERATOR, SimBrokerNode, broker_setup, offer};
use cgx_protocol::broker::{JobSpec, JobView};
use cgx_protocol::money::Micros;
use cgx_protocol::records::{TeeKind, Tier, WorkloadState};
use cgx_service::clock::{Clock, ManualClock};

struct Net {
    kbs: cgx_devnet::Setup,
    broker: BrokerSetup,
}

impl Net {
    fn new(nodes: &[&SimBrokerNode], database: Option<String>) -> Net {
        let sims: Vec<&cgx_kbs::sim::SimNode> = nodes.iter().map(|n| &n.sim).collect();
        let kbs = cgx_devnet::setup(&sims, None).unwrap();
        let pins: Vec<String> = kbs.pins.iter().map(hex::encode).collect();
        let broker = broker_setup(&kbs, pins, database).unwrap();
        Net { kbs, broker }
    }

    fn client(&self, s: &BrokerServer, who: &cgx_devnet::Ed) -> BrokerClient {
        self.broker.client(&s.base, who).unwrap()
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.kbs.cleanup();
        self.broker.cleanup();
    }
}

fn job(gpus: u32) -> JobSpec {
    JobSpec {
        tenant: None,
        gpu_model: "H100".into(),
        gpu_count: gpus,
        min_gpu_memory_gib: 40,
        tee: vec![TeeKind::Snp],
        regions: Vec::new(),
        max_price_per_gpu_hour_micros: Micros(4_000_000),
        duration_secs: 3600,
        budget_micros: Micros(4_000_000 * u64::from(gpus)),
        resources: Vec::new(),
        placement_policy: None,
        workload: None,
        offer: None,
    }
}

fn node(gpus: usize) -> SimBrokerNode {
    SimBrokerNode::generate(gpus, offer(gpus as u32, "eu-west", Micros(1_000_000))).unwrap()
}

#[track_caller]
fn code(r: Result<impl std::fmt::Debug, ClientError>) -> (String, String) {
    match r {
        Err(ClientError::Refused { code, detail, .. }) => (code, detail),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Run SQL against the broker's database (the attacker's access).
fn sql(db: &str, statements: &[(&str, Vec<String>)]) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        sqlx::any::install_default_drivers();
        let pool = sqlx::AnyPool::connect(db).await.unwrap();
        for (s, binds) in statements {
            let mut q = sqlx::query(sqlx::AssertSqlSafe(s.to_string()));
            for b in binds {
                q = q.bind(b.clone());
            }
            q.execute(&pool).await.unwrap();
        }
        pool.close().await;
    });
}

fn one_string(db: &str, query: &str, bind: &str) -> Option<String> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        sqlx::any::install_default_drivers();
        let pool = sqlx::AnyPool::connect(db).await.unwrap();
        let row = sqlx::query(sqlx::AssertSqlSafe(query.to_string()))
            .bind(bind.to_string())
            .fetch_optional(&pool)
            .await
            .unwrap();
        pool.close().await;
        row.map(|r| sqlx::Row::get::<String, _>(&r, 0))
    })
}

/// Poll `f` until it holds (the monitor runs every 250 ms on the devnet broker).
#[track_caller]
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{what}: not within 10 s");
}

#[test]
fn a_job_row_the_broker_did_not_seal_is_never_leased() {
    let a = node(4);
    let net = Net::new(&[&a], None);
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let acme = net.client(&broker, &net.broker.tenant);
    let globex = net.client(&broker, &net.broker.other_tenant);
    // No node yet: everything waits.
    let honest = acme.submit(&job(1)).unwrap();
    let edited = acme.submit(&job(1)).unwrap();
    let mut theirs = job(1);
    theirs.resources = vec!["globex/weights/secret".into()];
    let moved = globex.submit(&theirs).unwrap();
    assert!(
        [&honest, &edited, &moved]
            .iter()
            .all(|j| j.state == "pending")
    );
    // The database writer: a job row made from nothing (for acme, with globex's resource),
    // an edited spec (a thirty-day lease billed at acme's rate), and globex's job moved to
    // acme (its lease would name acme, whose workload would then get globex's key).
    let db = net.broker.config.database.clone();
    let spec = one_string(&db, "SELECT spec FROM jobs WHERE id = $1", &honest.id).unwrap();
    let forged_spec = spec.replace("\"resources\":[]", "\"resources\":[\"acme/weights/x\"]");
    let longer = spec.replace("\"duration_secs\":3600", "\"duration_secs\":2592000");
    assert_ne!(longer, spec);
    sql(
        &db,
        &[
            (
                "INSERT INTO jobs (id, tenant, spec, state, reason, created_at, updated_at, seal)
                 SELECT 'j0123456789abcdef01234567', tenant, $1, state, reason, created_at - 10, updated_at, seal
                 FROM jobs WHERE id = $2",
                vec![forged_spec, honest.id.clone()],
            ),
            (
                "UPDATE jobs SET spec = $1 WHERE id = $2",
                vec![longer, edited.id.clone()],
            ),
            (
                "UPDATE jobs SET tenant = 'acme' WHERE id = $1",
                vec![moved.id.clone()],
            ),
        ],
    );
    // A node appears: the honest job is placed; the others fail with the reason, unleased.
    let op = net.client(&broker, &net.broker.operator);
    a.register(&op).unwrap();
    eventually("the honest job placed", || {
        acme.job(&honest.id).unwrap().state == "placed"
    });
    let auditor = net.client(&broker, &net.broker.auditor);
    for id in [
        "j0123456789abcdef01234567",
        edited.id.as_str(),
        moved.id.as_str(),
    ] {
        eventually("the forged row failed", || {
            auditor.job(id).unwrap().state == "failed"
        });
        let view = auditor.job(id).unwrap();
        assert!(
            view.reason.contains("was not submitted as stored"),
            "{id}: {}",
            view.reason
        );
        assert!(view.lease_id.is_none(), "{id} was leased");
        assert_eq!(
            one_string(&db, "SELECT id FROM leases WHERE job_id = $1", id),
            None,
            "{id}: no lease row"
        );
    }
    // Only the honest lease reaches the node.
    let hb = a.heartbeat(&op).unwrap();
    let leased: Vec<&str> = hb.leases.iter().map(|l| l.job_id.as_str()).collect();
    assert_eq!(leased, [honest.id.as_str()]);
    broker.stop();
}

#[test]
fn a_flooding_tenant_does_not_starve_another_and_pending_jobs_expire() {
    let a = node(1);
    let mut net = Net::new(&[&a], None);
    net.broker.config.max_pending_per_tenant = 2;
    net.broker.config.placement_batch = 8;
    net.broker.config.pending_ttl_secs = 60;
    // The test drives every monitor pass with `tick()`: a background pass between the clock's
    // jump and the heartbeat that follows would fail the node over (a race, not the subject).
    net.broker.config.monitor_interval_ms = 60_000;
    // One key that may submit for five flooding tenants.
    let flooder = cgx_devnet::Ed::generate().unwrap();
    net.broker
        .config
        .api_keys
        .push(cgx_broker::server::config::ApiKey {
            public_key: flooder.public_b64.clone(),
            scopes: (0..5).map(|t| format!("tenant:flood{t}")).collect(),
        });
    let clock = ManualClock::default();
    let broker = BrokerServer::start_with_clock(&net.broker.config, clock.shared()).unwrap();
    // A tenant past its cap is refused (429); caps above a quarter of a pass are refused at
    // start.
    let admin = net
        .broker
        .client_at(&broker.base, &flooder, clock.unix())
        .unwrap();
    let mut bad = net.broker.config.clone();
    bad.max_pending_per_tenant = 3;
    assert!(BrokerServer::start(&bad).is_err());
    // Five flooding tenants (an admin submits for them), each at its cap with jobs no node
    // will ever fit: ten pending jobs, more than a pass reads (8), all older than the honest
    // one.
    for t in 0..5 {
        broker
            .deposit(
                &format!("tenant/flood{t}"),
                1_000_000_000,
                &format!("flood{t}"),
            )
            .unwrap();
        for _ in 0..2 {
            let mut flood = job(1);
            flood.tenant = Some(format!("flood{t}"));
            flood.gpu_model = "H200".into();
            assert_eq!(admin.submit(&flood).unwrap().state, "pending");
        }
        let mut more = job(1);
        more.tenant = Some(format!("flood{t}"));
        assert_eq!(code(admin.submit(&more)).0, "TooManyPending");
    }
    clock.advance(1);
    let acme = net
        .broker
        .client_at(&broker.base, &net.broker.tenant, clock.unix())
        .unwrap();
    let honest = acme.submit(&job(1)).unwrap();
    assert_eq!(honest.state, "pending");
    // The node appears; one pass reads each tenant's oldest job first: the honest job is in
    // it, though ten older ones wait.
    let op = net
        .broker
        .client_at(&broker.base, &net.broker.operator, clock.unix())
        .unwrap();
    a.register(&op).unwrap();
    broker.tick().unwrap();
    assert_eq!(acme.job(&honest.id).unwrap().state, "placed");
    // Pending jobs expire after pending_ttl_secs, with the reason; the flood is gone.
    clock.advance(61);
    let op = net
        .broker
        .client_at(&broker.base, &net.broker.operator, clock.unix())
        .unwrap();
    let lease = op
        .heartbeat(&a.id, &a.heartbeat_token(clock.unix()).unwrap())
        .unwrap()
        .leases
        .remove(0);
    a.report(
        &op,
        &lease.lease_id,
        &honest.id,
        WorkloadState::Running,
        None,
        clock.unix(),
    )
    .unwrap();
    broker.tick().unwrap();
    let acme = net
        .broker
        .client_at(&broker.base, &net.broker.tenant, clock.unix())
        .unwrap();
    let auditor = net
        .broker
        .client_at(&broker.base, &net.broker.auditor, clock.unix())
        .unwrap();
    let jobs: Vec<JobView> = auditor.jobs(None).unwrap();
    let flood: Vec<&JobView> = jobs
        .iter()
        .filter(|j| j.tenant.starts_with("flood"))
        .collect();
    assert_eq!(flood.len(), 10);
    for j in flood {
        assert_eq!(j.state, "expired", "{}", j.reason);
        assert!(
            j.reason.contains("pending longer than 60 s"),
            "{}",
            j.reason
        );
    }
    let events = auditor
        .job(&jobs.iter().find(|j| j.tenant == "flood0").unwrap().id)
        .unwrap();
    assert_eq!(events.events.last().unwrap().to, "expired");
    assert_eq!(acme.job(&honest.id).unwrap().state, "running");
    broker.stop();
}

#[test]
fn a_vm_serves_one_tenant_at_a_time() {
    let a = node(2);
    let net = Net::new(&[&a], None);
    let clock = ManualClock::default();
    let broker = BrokerServer::start_with_clock(&net.broker.config, clock.shared()).unwrap();
    let at = |who: &cgx_devnet::Ed| {
        net.broker
            .client_at(&broker.base, who, clock.unix())
            .unwrap()
    };
    a.register(&at(&net.broker.operator)).unwrap();
    let (acme, globex) = (at(&net.broker.tenant), at(&net.broker.other_tenant));
    let first = acme.submit(&job(1)).unwrap();
    assert_eq!(first.state, "placed");
    // A GPU is free, but the VM holds acme's lease (its TEE key releases acme's resources):
    // globex waits, told why without being told whose.
    let waiting = globex.submit(&job(1)).unwrap();
    assert_eq!(waiting.state, "pending", "{}", waiting.reason);
    assert!(
        waiting.reason.contains("other_tenant"),
        "{}",
        waiting.reason
    );
    assert!(!waiting.reason.contains("acme"), "{}", waiting.reason);
    let status = globex.job(&waiting.id).unwrap();
    assert!(status.reason.contains("other_tenant"), "{}", status.reason);
    // acme's second job shares the VM with its first.
    assert_eq!(acme.submit(&job(1)).unwrap().state, "placed");
    // Every lease the node's heartbeat hands it is acme's.
    let op = at(&net.broker.operator);
    let hb = op
        .heartbeat(&a.id, &a.heartbeat_token(clock.unix()).unwrap())
        .unwrap();
    assert_eq!(hb.leases.len(), 2);
    for l in &hb.leases {
        assert_eq!(acme.job(&l.job_id).unwrap().tenant, "acme");
        acme.cancel(&l.job_id).unwrap();
    }
    // acme's leases ended, but their last tokens live a lease TTL longer (120 s here): the VM
    // is still acme's until then.
    broker.tick().unwrap();
    assert_eq!(globex.job(&waiting.id).unwrap().state, "pending");
    clock.advance(121);
    let op = at(&net.broker.operator);
    op.heartbeat(&a.id, &a.heartbeat_token(clock.unix()).unwrap())
        .unwrap();
    broker.tick().unwrap();
    let globex = at(&net.broker.other_tenant);
    let placed = globex.job(&waiting.id).unwrap();
    assert_eq!(placed.state, "placed", "{}", placed.reason);
    // And now acme waits for globex.
    let acme = at(&net.broker.tenant);
    let held = acme.submit(&job(1)).unwrap();
    assert_eq!(held.state, "pending", "{}", held.reason);
    broker.stop();
}

#[test]
fn an_older_node_record_put_back_is_refused() {
    let mut a = node(1);
    let net = Net::new(&[&a], None);
    let clock = ManualClock::default();
    let broker = BrokerServer::start_with_clock(&net.broker.config, clock.shared()).unwrap();
    let op_at = |t: i64| {
        net.broker
            .client_at(&broker.base, &net.broker.operator, t)
            .unwrap()
    };
    assert_eq!(
        a.register(&op_at(clock.unix())).unwrap().status,
        Tier::Affirming
    );
    let db = net.broker.config.database.clone();
    let old = one_string(&db, "SELECT record FROM nodes WHERE id = $1", &a.id).unwrap();
    // The node re-attests later, now as a debug guest: contraindicated, unplaceable.
    clock.advance(5);
    a.snp_policy |= 1 << 19;
    let r = a.register(&op_at(clock.unix())).unwrap();
    assert_ne!(r.status, Tier::Affirming);
    // The database writer puts the older, validly signed, affirming record back.
    sql(
        &db,
        &[(
            "UPDATE nodes SET record = $1, updated_ms = updated_ms + 1000 WHERE id = $2",
            vec![old, a.id.clone()],
        )],
    );
    broker.tick().unwrap();
    let view = op_at(clock.unix()).node(&a.id).unwrap();
    assert!(!view.placeable, "the older record came back: {view:?}");
    assert_eq!(view.attested_at, r.attested_at);
    broker.stop();
}

/// One GPU, one live node, across replicas: the check is the database's, not a replica's
/// index (which learns of another replica's registration only at its next sync).
#[test]
fn one_gpu_is_one_live_node_across_replicas() {
    let a = node(1);
    let other = node(1);
    let db = match std::env::var("CGX_TEST_DATABASE_URL") {
        Ok(url) => Some(cgx_devnet::fresh_postgres(&url).unwrap()),
        Err(_) => {
            eprintln!(
                "one_gpu_is_one_live_node_across_replicas: CGX_TEST_DATABASE_URL is not set; two replicas on one SQLite file"
            );
            None
        }
    };
    let net = Net::new(&[&a, &other], db);
    let r1 = BrokerServer::start(&net.broker.config).unwrap();
    // The second replica syncs at start and then only once a minute: what refuses below is
    // the database, not its index.
    let mut slow = net.broker.config.clone();
    slow.monitor_interval_ms = 60_000;
    let r2 = BrokerServer::start(&slow).unwrap();
    let op1 = net.client(&r1, &net.broker.operator);
    let op2 = net.client(&r2, &net.broker.operator);
    a.register(&op1).unwrap();
    // `a`'s GPU, bound to another node's keys, offered to the other replica before it synced.
    let n = op2.nonce().unwrap();
    let raw = cgx_protocol::broker::unb64(&n.nonce).unwrap();
    let mut twice = a
        .registration_with(
            &n.nonce,
            &raw,
            &other.node_key_raw(),
            &other.tee_thumbprint().unwrap(),
        )
        .unwrap();
    twice.node_key = cgx_protocol::broker::b64(&other.node_key_raw());
    twice.tee_pubkey = other.tee_key().unwrap().public().unwrap();
    twice.proof = cgx_protocol::broker::registration_proof(
        &other.node_key.pkcs8,
        &raw,
        OPERATOR,
        &other.tee_thumbprint().unwrap(),
    )
    .unwrap();
    let (c, d) = code(op2.register(&twice));
    assert_eq!(c, "InventoryNotProven", "{d}");
    assert!(
        d.contains("already offered by node") && d.contains(&a.id),
        "{d}"
    );
    r1.stop();
    r2.stop();
}

/// Revocation is judged on the broker's own CRL: the store's current CRL for the chain's ARK is
/// required, and CRLs a node sends (one from before its revocation, say) are not used.
#[test]
fn revocation_is_judged_on_the_brokers_crl_not_the_nodes() {
    use cgx_attestation::collateral::CollateralStore;
    use cgx_attestation::sim::SimAmd;
    use cgx_protocol::broker::CpuEvidence;
    let a = node(1);
    let net = Net::new(&[&a], None);
    let store_dir = net.kbs.dir.join(cgx_devnet::COLLATERAL_DIR);
    let t = cgx_devnet::now();
    let chain = a.sim.amd.cert_chain_pem();
    let key = cgx_attestation::trust::amd_crl_key(chain.as_bytes(), false).unwrap();
    let unrevoked = a.sim.amd.crl(&[], t - 2 * 86_400, t + 86_400).unwrap();
    let with_old_crl = |op: &BrokerClient| {
        let n = op.nonce().unwrap();
        let mut reg = a.registration(&n.nonce).unwrap();
        let CpuEvidence::Snp { crls, .. } = &mut reg.cpu else {
            panic!("an SNP registration")
        };
        crls.push(cgx_protocol::broker::b64(&unrevoked));
        reg
    };
    // The store's CRL revokes the node's VCEK; the node sends an older CRL that does not.
    std::fs::remove_dir_all(&store_dir).unwrap();
    let mut store = CollateralStore::open(&store_dir).unwrap();
    let revoking = a
        .sim
        .amd
        .crl(&[SimAmd::LEAF_SERIAL], t - 60, t + 86_400)
        .unwrap();
    store.put(&key.path(), &revoking, "test", t).unwrap();
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let op = net.client(&broker, &net.broker.operator);
    let (c, d) = code(op.register(&with_old_crl(&op)));
    assert_eq!(c, "EvidenceRefused", "{d}");
    assert!(d.contains("revoked"), "{d}");
    broker.stop();
    // No current CRL in the store: refused, whatever the node sends.
    std::fs::remove_dir_all(&store_dir).unwrap();
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let op = net.client(&broker, &net.broker.operator);
    let (c, d) = code(op.register(&with_old_crl(&op)));
    assert_eq!(c, "EvidenceRefused", "{d}");
    assert!(
        d.contains("no current one") && d.contains("CRLs a node sends are not used"),
        "{d}"
    );
    broker.stop();
}

/// The KBS holds the same line at release: a TEE key that received one tenant's job resource
/// under a live lease gets no other tenant's, even under a lease the broker's key signed.
#[test]
fn a_tee_key_holding_one_tenants_lease_gets_no_other_tenants_key() {
    let a = node(1);
    let net = Net::new(&[&a], None);
    let kbs = cgx_devnet::Server::start(&net.kbs.config).unwrap();
    for (path, value) in [
        ("acme/weights/m", b"acme key".as_slice()),
        ("globex/weights/m", b"globex key".as_slice()),
    ] {
        kbs.put_resource(&net.kbs.admin, path, value, true).unwrap();
    }
    let now = cgx_devnet::now();
    let lease = |tenant: &str, path: &str, exp: i64| {
        cgx_system_tests::lease_for(
            &net.kbs.broker,
            tenant,
            &format!("l-{tenant}"),
            &[path],
            &a.tee_thumbprint().unwrap(),
            exp,
        )
    };
    let mut vm = a.kbs_client(&kbs.base).unwrap();
    vm.attest(&a.sim).unwrap();
    let acme = lease("acme", "acme/weights/m", now + 60);
    assert_eq!(
        vm.resource("acme/weights/m", Some(&acme)).unwrap(),
        b"acme key"
    );
    let globex = lease("globex", "globex/weights/m", now + 60);
    let refused = vm
        .resource("globex/weights/m", Some(&globex))
        .unwrap_err()
        .to_string();
    assert!(refused.contains("one tenant at a time"), "{refused}");
    // acme's own resources still flow to it.
    assert_eq!(
        vm.resource("acme/weights/m", Some(&acme)).unwrap(),
        b"acme key"
    );
    kbs.stop();
}

/// A tenant's placement policy is untrusted code: what cannot be bounded is refused at
/// submission, and a bomb that goes off only on a real node fails its own job when that node
/// appears — the broker goes on serving.
#[test]
fn a_tenants_policy_bomb_fails_its_job_not_the_broker() {
    // Room for both jobs, whichever a pass takes first.
    let a = node(2);
    let net = Net::new(&[&a], None);
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let acme = net.client(&broker, &net.broker.tenant);
    // The review's bomb: four nested self-substitutions (10^16 bytes asked for).
    let mut spec = job(1);
    spec.placement_policy = Some(
        "package placement\n\
         deny contains msg if {\n\
           s := concat(\"\", [\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\"])\n\
           s1 := replace(s, \"a\", s)\n s2 := replace(s1, \"a\", s1)\n\
           s3 := replace(s2, \"a\", s2)\n s4 := replace(s3, \"a\", s3)\n\
           msg := s4\n}\n"
            .into(),
    );
    let (c, d) = code(acme.submit(&spec));
    assert_eq!(c, "PlacementPolicyInvalid", "{d}");
    assert!(d.contains("replace"), "{d}");
    // A bomb that waits for a node in eu-west (the submission's sample node is elsewhere).
    let squarings: String = (1..=22)
        .map(|i| format!("  x{i} := x{} * x{}\n", i - 1, i - 1))
        .collect();
    spec.placement_policy = Some(format!(
        "package placement\n\
         deny contains \"too big\" if {{\n  input.node.region == \"eu-west\"\n  x0 := 12345678901234567\n{squarings}  x22 > 0\n}}\n"
    ));
    let armed = acme.submit(&spec).unwrap();
    assert_eq!(armed.state, "pending", "{}", armed.reason);
    let honest = acme.submit(&job(1)).unwrap();
    assert_eq!(honest.state, "pending");
    let started = Instant::now();
    let op = net.client(&broker, &net.broker.operator);
    a.register(&op).unwrap();
    eventually("the armed job failed", || {
        acme.job(&armed.id).unwrap().state == "failed"
    });
    let failed = acme.job(&armed.id).unwrap();
    assert!(failed.reason.contains("limit"), "{}", failed.reason);
    // The broker is up, and the honest job got the node.
    eventually("the honest job placed", || {
        acme.job(&honest.id).unwrap().state == "placed"
    });
    println!(
        "bomb failed and honest job placed in {:?}",
        started.elapsed()
    );
    broker.stop();
}

/// A GPU taken over by a later registration of another VM (its first VM silent meanwhile)
/// leaves the first VM unplaceable when it speaks again: one GPU, one live node.
#[test]
fn a_gpu_registered_by_another_vm_leaves_the_first_unplaceable() {
    let a = node(1);
    let other = node(1);
    let net = Net::new(&[&a, &other], None);
    let clock = ManualClock::default();
    let broker = BrokerServer::start_with_clock(&net.broker.config, clock.shared()).unwrap();
    let op_at = |t: i64| {
        net.broker
            .client_at(&broker.base, &net.broker.operator, t)
            .unwrap()
    };
    a.register(&op_at(clock.unix())).unwrap();
    // `a` goes silent past its heartbeat allowance; its GPU is registered by another VM.
    clock.advance(16);
    let op = op_at(clock.unix());
    let n = op.nonce().unwrap();
    let raw = cgx_protocol::broker::unb64(&n.nonce).unwrap();
    let mut moved = a
        .registration_with(
            &n.nonce,
            &raw,
            &other.node_key_raw(),
            &other.tee_thumbprint().unwrap(),
        )
        .unwrap();
    moved.node_key = cgx_protocol::broker::b64(&other.node_key_raw());
    moved.tee_pubkey = other.tee_key().unwrap().public().unwrap();
    moved.proof = cgx_protocol::broker::registration_proof(
        &other.node_key.pkcs8,
        &raw,
        OPERATOR,
        &other.tee_thumbprint().unwrap(),
    )
    .unwrap();
    assert_eq!(op.register(&moved).unwrap().status, Tier::Affirming);
    // `a` speaks again: it no longer has that GPU, and is told to register again (which the
    // database refuses while the other VM is live).
    let ans = op
        .heartbeat(&a.id, &a.heartbeat_token(clock.unix()).unwrap())
        .unwrap();
    assert!(ans.reattest, "{ans:?}");
    let view = op.node(&a.id).unwrap();
    assert!(!view.placeable);
    assert!(
        view.reason.contains("now offered by node"),
        "{}",
        view.reason
    );
    let (c, d) = code(a.register(&op));
    assert_eq!(c, "InventoryNotProven", "{d}");
    broker.stop();
}

/// A job that fails over waits anew: its pending time counts from the failover, not from its
/// submission (a long job is not expired by its node's failure).
#[test]
fn a_failed_over_job_waits_anew_and_does_not_expire() {
    let a = node(1);
    let mut net = Net::new(&[&a], None);
    net.broker.config.pending_ttl_secs = 60;
    let clock = ManualClock::default();
    let broker = BrokerServer::start_with_clock(&net.broker.config, clock.shared()).unwrap();
    let at = |who: &cgx_devnet::Ed| {
        net.broker
            .client_at(&broker.base, who, clock.unix())
            .unwrap()
    };
    a.register(&at(&net.broker.operator)).unwrap();
    let mut long = job(1);
    long.duration_secs = 30 * 86_400;
    long.budget_micros = Micros(4_000_000 * 30 * 24);
    let j = at(&net.broker.tenant).submit(&long).unwrap();
    assert_eq!(j.state, "placed");
    // Two minutes of service (past pending_ttl_secs since submission), then the node goes
    // silent and the job fails over to pending.
    for _ in 0..24 {
        clock.advance(5);
        at(&net.broker.operator)
            .heartbeat(&a.id, &a.heartbeat_token(clock.unix()).unwrap())
            .unwrap();
    }
    clock.advance(16);
    broker.tick().unwrap();
    let view = at(&net.broker.tenant).job(&j.id).unwrap();
    assert_eq!(view.state, "pending", "{}", view.reason);
    // It expires only after waiting pending_ttl_secs from the failover.
    clock.advance(61);
    broker.tick().unwrap();
    let view = at(&net.broker.tenant).job(&j.id).unwrap();
    assert_eq!(view.state, "expired", "{}", view.reason);
    broker.stop();
}

/// What a tenant's placement policy sees of a node: what placement needs, not what identifies
/// a machine (chip id, GPU serials, FWIDs, report data, nonces).
#[test]
fn a_placement_policy_sees_no_machine_identifiers() {
    let a = node(1);
    let net = Net::new(&[&a], None);
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    a.register(&net.client(&broker, &net.broker.operator))
        .unwrap();
    let acme = net.client(&broker, &net.broker.tenant);
    let mut spec = job(1);
    spec.placement_policy = Some(
        "package placement\n\
         deny contains \"sees a chip id\" if input.node.claims.cpu.chip_id\n\
         deny contains \"sees report data\" if input.node.claims.cpu.report_data\n\
         deny contains \"sees a GPU serial\" if input.node.claims.gpus[_].device_serial\n\
         deny contains \"sees a FWID\" if input.node.claims.gpus[_].fwid\n\
         deny contains \"sees a nonce\" if input.node.claims.gpus[_].nonce\n\
         deny contains \"sees its own text\" if input.job.placement_policy\n\
         deny contains \"sees no measurement\" if not input.node.claims.cpu.measurement\n\
         deny contains \"sees no CC mode\" if not input.node.claims.gpus[0].cc_mode\n"
            .into(),
    );
    let placed = acme.submit(&spec).unwrap();
    assert_eq!(placed.state, "placed", "{}", placed.reason);
    broker.stop();
}

/// A database writer moving a running job to another tenant does not open its VM to that
/// tenant: which tenant holds a VM is read from the lease tokens the broker signed.
#[test]
fn a_job_moved_to_another_tenant_in_the_database_does_not_open_its_vm() {
    let a = node(2);
    let net = Net::new(&[&a], None);
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let op = net.client(&broker, &net.broker.operator);
    a.register(&op).unwrap();
    let acme = net.client(&broker, &net.broker.tenant);
    let first = acme.submit(&job(1)).unwrap();
    assert_eq!(first.state, "placed");
    sql(
        &net.broker.config.database,
        &[(
            "UPDATE jobs SET tenant = 'globex' WHERE id = $1",
            vec![first.id.clone()],
        )],
    );
    // A replica (re)starting reads who holds each VM from the database.
    broker.stop();
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let globex = net.client(&broker, &net.broker.other_tenant);
    let waiting = globex.submit(&job(1)).unwrap();
    assert_eq!(waiting.state, "pending", "{}", waiting.reason);
    assert!(
        waiting.reason.contains("other_tenant"),
        "{}",
        waiting.reason
    );
    broker.stop();
}

/// A tenant's policy is not evaluated again on a node it denied that has not changed: a
/// pending job's passes cost no sandbox time until a node changes (registers again, say).
#[test]
fn a_denial_is_remembered_until_the_node_changes() {
    let a = node(1);
    let net = Net::new(&[&a], None);
    let clock = ManualClock::default();
    let broker = BrokerServer::start_with_clock(&net.broker.config, clock.shared()).unwrap();
    let at = |who: &cgx_devnet::Ed| {
        net.broker
            .client_at(&broker.base, who, clock.unix())
            .unwrap()
    };
    a.register(&at(&net.broker.operator)).unwrap();
    let batches = || {
        let text = ureq::get(format!("{}/metrics", broker.base))
            .call()
            .unwrap()
            .into_body()
            .read_to_string()
            .unwrap();
        text.lines()
            .find(|l| l.contains("outcome=\"policy_batch\""))
            .and_then(|l| l.rsplit(' ').next())
            .map_or(0, |n| n.parse::<u64>().unwrap())
    };
    let mut spec = job(1);
    spec.placement_policy = Some(cgx_policies::PLACEMENT_POLICY.replace("eu-", "ap-"));
    let held = at(&net.broker.tenant).submit(&spec).unwrap();
    assert_eq!(held.state, "pending", "{}", held.reason);
    let after_submit = batches();
    assert!(after_submit >= 1);
    for _ in 0..3 {
        broker.tick().unwrap();
    }
    assert_eq!(
        batches(),
        after_submit,
        "the unchanged node was judged again"
    );
    // The node registers again (a new record): judged again.
    clock.advance(1);
    a.register(&at(&net.broker.operator)).unwrap();
    broker.tick().unwrap();
    assert!(batches() > after_submit);
    assert_eq!(
        at(&net.broker.tenant).job(&held.id).unwrap().state,
        "pending"
    );
    broker.stop();
}

/// The same for GPUs: the store's OCSP response for the device chain decides, not the good
/// one the node sends.
#[test]
fn gpu_revocation_is_judged_on_the_brokers_ocsp_not_the_nodes() {
    use cgx_attestation::collateral::{CollateralKey, CollateralStore};
    use cgx_attestation::nvidia::ocsp::{CertStatus, chain_cert_ids};
    use cgx_attestation::sim::{SimOcsp, SimOcspSigner};
    let a = node(1);
    let net = Net::new(&[&a], None);
    let store_dir = net.kbs.dir.join(cgx_devnet::COLLATERAL_DIR);
    let t = cgx_devnet::now();
    let gpu = &a.sim.gpus[0];
    let revoked = gpu
        .ocsp_response(&SimOcsp {
            status: CertStatus::Revoked {
                at: t - 3600,
                reason: None,
            },
            this_update: t - 60,
            next_update: Some(t + 86_400),
            signer: SimOcspSigner::Issuer,
        })
        .unwrap();
    // Keep the CRL the setup wrote; replace the GPU chain's good response with a revocation.
    let crl_key =
        cgx_attestation::trust::amd_crl_key(a.sim.amd.cert_chain_pem().as_bytes(), false).unwrap();
    let crl = a.sim.amd.crl(&[], t - 86_400, t + 86_400).unwrap();
    std::fs::remove_dir_all(&store_dir).unwrap();
    let mut store = CollateralStore::open(&store_dir).unwrap();
    store.put(&crl_key.path(), &crl, "test", t).unwrap();
    for cert_id in chain_cert_ids(gpu.chain_pem.as_bytes()).unwrap() {
        let key = CollateralKey::NvidiaOcsp { cert_id };
        store.put(&key.path(), &revoked, "test", t).unwrap();
    }
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let op = net.client(&broker, &net.broker.operator);
    // The node's registration carries the simulator's good responses.
    let n = op.nonce().unwrap();
    let reg = a.registration(&n.nonce).unwrap();
    assert!(!reg.gpus[0].ocsp.is_empty());
    let (c, d) = code(op.register(&reg));
    assert_eq!(c, "EvidenceRefused", "{d}");
    assert!(d.contains("revoked"), "{d}");
    broker.stop();
}

/// A chain of a few thousand rules (within regorus's 4 000 and the 64 KiB a policy may have)
/// recurses once per rule in the VM and in the compile-time fold: on a thread with the default
/// stack it overflowed it and aborted the broker. It compiles and runs on the sandbox's threads.
#[test]
fn a_deep_chain_of_rules_does_not_overflow_a_stack() {
    let a = node(1);
    let net = Net::new(&[&a], None);
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    a.register(&net.client(&broker, &net.broker.operator))
        .unwrap();
    let acme = net.client(&broker, &net.broker.tenant);
    let chain: String = (1..3000)
        .map(|i| format!("x{i} := x{} + 1\n", i - 1))
        .collect();
    let mut spec = job(1);
    spec.placement_policy = Some(format!(
        "package placement\nx0 := 1\n{chain}deny contains \"negative\" if x2999 < 0\n"
    ));
    assert!(spec.placement_policy.as_ref().unwrap().len() < 64 << 10);
    let j = acme.submit(&spec);
    // Refused with a reason or placed: either way the broker still answers.
    match j {
        Ok(j) => assert_eq!(j.state, "placed", "{}", j.reason),
        Err(ClientError::Refused { code, .. }) => assert_eq!(code, "PlacementPolicyInvalid"),
        Err(e) => panic!("{e}"),
    }
    assert!(acme.jobs(None).is_ok(), "the broker is up");
    broker.stop();
}
