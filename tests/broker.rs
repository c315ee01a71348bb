#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The broker end to end on loopback: registration on composite evidence and every refusal,
//! heartbeats, freshness, jobs and placement over HTTP, leases the KBS honours for the attested
//! VM only, cancellation, failover with a measured time, restart, the database as an untrusted
//! store, and two replicas on one PostgreSQL without a double-booked GPU.

use std::time::{Duration, Instant};

use cgx_broker::client::{BrokerClient, ClientError};
use cgx_devnet::broker::{
    BrokerServer, BrokerSetup, OPERATOR, SimBrokerNode, TENANT_A, broker_setup, offer,
};
use cgx_protocol::broker::JobSpec;
use cgx_protocol::money::Micros;
use cgx_protocol::records::{TeeKind, Tier, WorkloadState};
use cgx_service::clock::{Clock, ManualClock};

/// A KBS and a broker on loopback, trusting `nodes`' simulator roots.
struct Net {
    kbs: cgx_devnet::Setup,
    broker: BrokerSetup,
}

impl Net {
    fn new(nodes: &[&SimBrokerNode], database: Option<String>) -> Net {
        Self::with(nodes, &[], database)
    }

    /// `nodes` measured as the reference values accept; `also_trusted`'s roots trusted too.
    fn with(
        nodes: &[&SimBrokerNode],
        also_trusted: &[&SimBrokerNode],
        database: Option<String>,
    ) -> Net {
        let sims: Vec<&cgx_kbs::sim::SimNode> = nodes.iter().map(|n| &n.sim).collect();
        let kbs = cgx_devnet::setup(&sims, None).unwrap();
        let mut pins: Vec<String> = kbs.pins.iter().map(hex::encode).collect();
        for n in also_trusted {
            pins.extend(n.sim.root_pins().iter().map(hex::encode));
        }
        let extra: Vec<&cgx_kbs::sim::SimNode> = also_trusted.iter().map(|n| &n.sim).collect();
        cgx_devnet::sim_crls(&kbs.dir.join(cgx_devnet::COLLATERAL_DIR), &extra).unwrap();
        let broker = broker_setup(&kbs, pins, database).unwrap();
        Net { kbs, broker }
    }

    fn operator(&self, s: &BrokerServer) -> BrokerClient {
        self.broker.client(&s.base, &self.broker.operator).unwrap()
    }

    fn tenant(&self, s: &BrokerServer) -> BrokerClient {
        self.broker.client(&s.base, &self.broker.tenant).unwrap()
    }

    fn auditor(&self, s: &BrokerServer) -> BrokerClient {
        self.broker.client(&s.base, &self.broker.auditor).unwrap()
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

#[track_caller]
fn code(r: Result<impl std::fmt::Debug, ClientError>) -> (String, String) {
    match r {
        Err(ClientError::Refused { code, detail, .. }) => (code, detail),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// A node at `price` currency units per GPU-hour (exact decimal text).
fn node(gpus: usize, region: &str, price: &str) -> SimBrokerNode {
    let price = Micros::parse_decimal(price).unwrap();
    SimBrokerNode::generate(gpus, offer(gpus as u32, region, price)).unwrap()
}

#[test]
fn a_job_is_placed_on_the_right_node_and_only_that_vm_gets_its_key() {
    let a = node(2, "eu-west", "2.0");
    let b = node(1, "us-east", "1.0");
    let cheap_far = node(2, "us-east", "0.5");
    let net = Net::new(&[&a, &b, &cheap_far], None);
    let kbs = cgx_devnet::Server::start(&net.kbs.config).unwrap();
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let op = net.operator(&broker);
    for n in [&a, &b, &cheap_far] {
        let r = n.register(&op).unwrap();
        assert_eq!(r.status, Tier::Affirming, "{:?}", r.violations);
        assert_eq!(r.node_id, n.id);
    }
    // The weights key: a job resource, released only with a lease.
    let path = "acme/weights/llama";
    kbs.put_resource(&net.kbs.admin, path, b"the weights key", true)
        .unwrap();
    let tenant = net.tenant(&broker);
    let mut spec = job(2);
    spec.regions = vec!["eu-west".into()];
    spec.resources = vec![path.into()];
    let placed = tenant.submit(&spec).unwrap();
    assert_eq!(placed.state, "placed", "{}", placed.reason);
    assert_eq!(
        placed.node_id.as_deref(),
        Some(a.id.as_str()),
        "eu-west only"
    );
    assert_eq!(placed.gpus, vec![0, 1]);
    assert_eq!(placed.tenant, TENANT_A);
    // The node learns its lease through its heartbeat; the job runs when the node says so.
    let hb = a.heartbeat(&op).unwrap();
    assert_eq!(hb.leases.len(), 1);
    let lease = &hb.leases[0];
    assert_eq!(lease.job_id, placed.id);
    assert_eq!(lease.resources, vec![path.to_string()]);
    assert_eq!(tenant.job(&placed.id).unwrap().state, "placed");
    let answer = a
        .report(
            &op,
            &lease.lease_id,
            &placed.id,
            WorkloadState::Running,
            None,
            cgx_devnet::now(),
        )
        .unwrap();
    assert_eq!(answer.state, "running");
    assert_eq!(tenant.job(&placed.id).unwrap().state, "running");
    // That VM (the TEE key its registration bound) gets the key with the lease.
    let mut vm = a.kbs_client(&kbs.base).unwrap();
    vm.attest(&a.sim).unwrap();
    assert_eq!(
        vm.resource(path, Some(&lease.token)).unwrap(),
        b"the weights key"
    );
    // Another attested VM with the same lease token gets nothing.
    let mut other = b.kbs_client(&kbs.base).unwrap();
    other.attest(&b.sim).unwrap();
    let refused = other.resource(path, Some(&lease.token)).unwrap_err();
    assert!(refused.to_string().contains("node key"), "{refused}");
    // Without the lease, the right VM gets nothing either.
    assert!(vm.resource(path, None).is_err());
    // A tenant's lease covers its own resources only: another tenant's path is refused at
    // submission, and the KBS refuses a lease whose tenant is not the resource's repository.
    let mut theirs = job(1);
    theirs.resources = vec!["globex/weights/secret".into()];
    let (c, d) = code(tenant.submit(&theirs));
    assert_eq!(c, "Forbidden", "{d}");
    let forged = cgx_system_tests::lease_for(
        &net.kbs.broker,
        "globex",
        "l-x",
        &[path],
        &a.tee_thumbprint().unwrap(),
        cgx_devnet::now() + 60,
    );
    let refused = vm.resource(path, Some(&forged)).unwrap_err().to_string();
    assert!(refused.contains("tenant"), "{refused}");
    // Cheapest first when the region allows: a second job with no region goes to the 0.5 node.
    let second = tenant.submit(&job(2)).unwrap();
    assert_eq!(second.node_id.as_deref(), Some(cheap_far.id.as_str()));
    // The events say what happened, in order.
    let events = tenant.job(&placed.id).unwrap().events;
    let states: Vec<&str> = events.iter().map(|e| e.to.as_str()).collect();
    assert_eq!(states, ["pending", "placed", "running"]);
    // Node views for operators and auditors; tenants see none.
    let nodes = net.auditor(&broker).nodes().unwrap();
    assert_eq!(nodes.len(), 3);
    let view = op.node(&a.id).unwrap();
    assert!(view.placeable && view.free_gpus == 0 && view.gpu_chip == "GH100");
    assert!(view.claims.is_some());
    assert_eq!(code(tenant.node(&a.id)).0, "NotFound");
    broker.stop();
    kbs.stop();
}

#[test]
fn registration_refuses_what_the_evidence_does_not_prove() {
    let a = node(2, "eu-west", "2.0");
    let other = node(1, "eu-west", "2.0");
    let mut lying = node(2, "eu-west", "2.0");
    let net = Net::new(&[&a, &other, &lying], None);
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let op = net.operator(&broker);
    // A replayed nonce.
    let n = op.nonce().unwrap();
    let reg = a.registration(&n.nonce).unwrap();
    op.register(&reg).unwrap();
    let (c, d) = code(op.register(&reg));
    assert_eq!(c, "NonceInvalid", "{d}");
    // The same nonce in another base64 spelling (standard alphabet, padded) is the same nonce:
    // spent once, whatever its text.
    let mut respelled = reg.clone();
    respelled.nonce = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        cgx_protocol::broker::unb64(&reg.nonce).unwrap(),
    );
    assert_ne!(respelled.nonce, reg.nonce);
    let (c, d) = code(op.register(&respelled));
    assert_eq!(c, "NonceInvalid", "{d}");
    // A nonce never issued.
    let forged = a
        .registration(&cgx_protocol::broker::b64(&[7; 32]))
        .unwrap();
    assert_eq!(code(op.register(&forged)).0, "NonceInvalid");
    // Evidence bound to another node key (or TEE key): the binding breaks.
    let n = op.nonce().unwrap();
    let raw = cgx_protocol::broker::unb64(&n.nonce).unwrap();
    let reg = a
        .registration_with(&n.nonce, &raw, &[9; 32], &a.tee_thumbprint().unwrap())
        .unwrap();
    let (c, d) = code(op.register(&reg));
    assert_eq!(c, "EvidenceRefused", "{d}");
    assert!(d.contains("binding"), "{d}");
    let n = op.nonce().unwrap();
    let raw = cgx_protocol::broker::unb64(&n.nonce).unwrap();
    let mut reg = a.registration(&n.nonce).unwrap();
    reg.tee_pubkey = other.tee_key().unwrap().public().unwrap();
    let (c, d) = code(op.register(&reg));
    assert_eq!(
        c, "EvidenceRefused",
        "another TEE key than the evidence binds: {d}"
    );
    // Evidence bound to another nonce.
    let n2 = op.nonce().unwrap();
    let reg = a.registration_with(&n2.nonce, &raw, &[0; 32], "x").unwrap();
    assert_eq!(code(op.register(&reg)).0, "EvidenceRefused");
    // Inventory the evidence does not prove: 8 GPUs offered with 2 reports; another model.
    lying.offer.gpu_count = 8;
    let n = op.nonce().unwrap();
    let mut reg = lying.registration(&n.nonce).unwrap();
    let (c, d) = code(op.register(&reg));
    assert_eq!(c, "InventoryNotProven", "{d}");
    assert!(d.contains("8 GPUs") && d.contains("2 GPU reports"), "{d}");
    // A nonce is spent once its evidence is looked at, whatever came of it.
    reg.offer.gpu_count = 2;
    assert_eq!(code(op.register(&reg)).0, "NonceInvalid");
    lying.offer.gpu_count = 2;
    lying.offer.gpu_model = "B200".into();
    let (c, d) = code(lying.register(&op));
    assert_eq!(c, "InventoryNotProven", "{d}");
    assert!(d.contains("GH100"), "{d}");
    lying.offer.gpu_model = "H100".into();
    lying.offer.gpu_memory_gib = 200;
    assert_eq!(code(lying.register(&op)).0, "InventoryNotProven");
    // Sim evidence whose roots the broker does not trust (this node's were not pinned).
    let untrusted = node(1, "eu-west", "2.0");
    let (c, d) = code(untrusted.register(&op));
    assert_eq!(c, "EvidenceRefused", "{d}");
    assert!(d.contains("sim"), "{d}");
    // The same GPUs offered again under another node's keys while their node is live.
    let n = op.nonce().unwrap();
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
    let (c, d) = code(op.register(&twice));
    assert_eq!(c, "InventoryNotProven", "{d}");
    assert!(
        d.contains("already offered by node") && d.contains(&a.id),
        "{d}"
    );
    // Whoever registers must hold the node key the evidence binds: a proof by another key (an
    // attacker who knows a victim's public key and binds it from its own TEE) is refused, and
    // a node stays its operator's.
    let n = op.nonce().unwrap();
    let mut stolen = a.registration(&n.nonce).unwrap();
    stolen.proof = cgx_protocol::broker::registration_proof(
        &other.node_key.pkcs8,
        &cgx_protocol::broker::unb64(&n.nonce).unwrap(),
        OPERATOR,
        &a.tee_thumbprint().unwrap(),
    )
    .unwrap();
    let (c, d) = code(op.register(&stolen));
    assert_eq!(c, "EvidenceRefused", "{d}");
    assert!(d.contains("not signed by the node key"), "{d}");
    // That refusal is cheap and spends nothing: the node itself may still use the nonce.
    let mut fixed = stolen.clone();
    fixed.proof = a.registration(&n.nonce).unwrap().proof;
    assert_eq!(op.register(&fixed).unwrap().status, Tier::Affirming);
    let mut moved = node(1, "eu-west", "1.0");
    moved.offer.operator = "op2".into();
    let n = op.nonce().unwrap();
    let mut reg = a.registration(&n.nonce).unwrap();
    reg.offer.operator = "op2".into();
    reg.proof = cgx_protocol::broker::registration_proof(
        &a.node_key.pkcs8,
        &cgx_protocol::broker::unb64(&n.nonce).unwrap(),
        "op2",
        &a.tee_thumbprint().unwrap(),
    )
    .unwrap();
    let (c, d) = code(op.register(&reg));
    assert_eq!(c, "Forbidden", "{d}");
    assert!(d.contains("belongs to operator op1"), "{d}");
    drop(moved);
    // Operators register their own operator's nodes only; tenants register none.
    let mut foreign = node(1, "eu-west", "1.0");
    foreign.offer.operator = "someone-else".into();
    assert_eq!(code(foreign.register(&op)).0, "Forbidden");
    assert_eq!(code(net.tenant(&broker).nonce()).0, "Forbidden");
    // No token at all.
    let anon = BrokerClient::new(&broker.base, None, None).unwrap();
    assert_eq!(code(anon.nonce()).0, "Unauthorized");
    assert_eq!(code(anon.nodes()).0, "Unauthorized");
    broker.stop();
}

#[test]
fn contraindicated_evidence_registers_but_is_never_placed_and_says_why() {
    let good = node(1, "eu-west", "3.0");
    // A debug guest: the appraisal policy contraindicates it.
    let mut bad = node(1, "eu-west", "0.1");
    bad.snp_policy |= 1 << 19;
    let net = Net::with(&[&good], &[&bad], None);
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let op = net.operator(&broker);
    let r = bad.register(&op).unwrap();
    assert_eq!(r.status, Tier::Contraindicated);
    assert!(!r.violations.is_empty());
    let view = op.node(&bad.id).unwrap();
    assert!(!view.placeable);
    assert!(view.reason.contains("not affirming"), "{}", view.reason);
    // A job the cheap contraindicated node would win on price waits, saying why…
    let tenant = net.tenant(&broker);
    let pending = tenant.submit(&job(1)).unwrap();
    assert_eq!(pending.state, "pending");
    assert!(
        pending.reason.contains("1 not_affirming"),
        "{}",
        pending.reason
    );
    // …and goes to the good node once it registers.
    good.register(&op).unwrap();
    let placed = tenant.job(&pending.id).unwrap();
    assert_eq!(placed.state, "placed", "{}", placed.reason);
    assert_eq!(placed.node_id.as_deref(), Some(good.id.as_str()));
    broker.stop();
}

#[test]
fn heartbeats_are_signed_monotonic_and_freshness_lapses() {
    let a = node(1, "eu-west", "1.0");
    let b = node(1, "eu-west", "1.0");
    let net = Net::new(&[&a, &b], None);
    let clock = ManualClock::default();
    let broker = BrokerServer::start_with_clock(&net.broker.config, clock.shared()).unwrap();
    let op = net.operator(&broker);
    a.register(&op).unwrap();
    b.register(&op).unwrap();
    let t = clock.unix();
    let op_at = |t: i64| {
        net.broker
            .client_at(&broker.base, &net.broker.operator, t)
            .unwrap()
    };
    // Signed by another node's key.
    let forged = cgx_protocol::broker::heartbeat_token(&b.node_key.pkcs8, &a.id, 1, t).unwrap();
    let (c, d) = code(op.heartbeat(&a.id, &forged));
    assert_eq!(c, "HeartbeatInvalid", "{d}");
    // Another node's heartbeat sent for this node.
    let theirs = b.heartbeat_token(t).unwrap();
    assert_eq!(code(op.heartbeat(&a.id, &theirs)).0, "HeartbeatInvalid");
    // A replay.
    let hb = a.heartbeat_token(t).unwrap();
    assert!(!op.heartbeat(&a.id, &hb).unwrap().reattest);
    assert_eq!(code(op.heartbeat(&a.id, &hb)).0, "HeartbeatInvalid");
    // Missed heartbeats: 3 × 5 s later, unplaceable with the reason.
    clock.advance(16);
    let view = op.node(&a.id).unwrap();
    assert!(!view.placeable);
    assert!(view.reason.contains("missed heartbeats"), "{}", view.reason);
    // A heartbeat brings it back.
    op.heartbeat(&a.id, &a.heartbeat_token(clock.unix()).unwrap())
        .unwrap();
    assert!(op.node(&a.id).unwrap().placeable);
    // The operator asks for re-attestation early: every heartbeat answer says so until the
    // node registers again; tenants may not ask.
    assert_eq!(code(net.tenant(&broker).reattest(&a.id)).0, "NotFound");
    let v = op_at(clock.unix()).reattest(&a.id).unwrap();
    assert!(v.reattest_asked && v.placeable);
    let ans = op
        .heartbeat(&a.id, &a.heartbeat_token(clock.unix()).unwrap())
        .unwrap();
    assert!(ans.reattest, "{ans:?}");
    a.register(&op_at(clock.unix())).unwrap();
    let ans = op
        .heartbeat(&a.id, &a.heartbeat_token(clock.unix()).unwrap())
        .unwrap();
    assert!(!ans.reattest, "cleared by re-attesting: {ans:?}");
    // Near the end of the re-attestation interval the answer asks for re-attestation; past
    // it, the node is unplaceable until it re-attests.
    for _ in 0..100 {
        clock.advance(5);
        let ans = op_at(clock.unix())
            .heartbeat(&a.id, &a.heartbeat_token(clock.unix()).unwrap())
            .unwrap();
        if ans.reattest {
            break;
        }
    }
    assert!(clock.unix() - t >= 480, "asked only in the last fifth");
    clock.advance(130);
    let op = op_at(clock.unix());
    let ans = op
        .heartbeat(&a.id, &a.heartbeat_token(clock.unix()).unwrap())
        .unwrap();
    assert!(ans.reattest);
    assert!(
        ans.unplaceable
            .as_deref()
            .unwrap_or("")
            .contains("attestation lapsed"),
        "{ans:?}"
    );
    // Re-attesting (the broker's clock is ahead of the simulator's certificates: fine).
    let r = a.register(&op).unwrap();
    assert_eq!(r.status, Tier::Affirming);
    assert!(op.node(&a.id).unwrap().placeable);
    // A nonce past its lifetime, and one whose MAC does not match.
    let n = op.nonce().unwrap();
    clock.advance(61);
    let op = op_at(clock.unix());
    let (c, d) = code(op.register(&a.registration(&n.nonce).unwrap()));
    assert_eq!(c, "NonceInvalid");
    assert!(d.contains("expired"), "{d}");
    let n = op.nonce().unwrap();
    let mut raw = cgx_protocol::broker::unb64(&n.nonce).unwrap();
    raw[20] ^= 1;
    let forged = cgx_protocol::broker::b64(&raw);
    let (c, d) = code(op.register(&a.registration(&forged).unwrap()));
    assert_eq!(c, "NonceInvalid");
    assert!(d.contains("not a nonce of this broker"), "{d}");
    broker.stop();
}

#[test]
fn budgets_policies_tenants_and_cancellation() {
    let a = node(2, "eu-west", "2.0");
    let mut net = Net::new(&[&a], None);
    net.broker.config.max_pending_per_tenant = 3;
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let op = net.operator(&broker);
    a.register(&op).unwrap();
    let tenant = net.tenant(&broker);
    // The budget must cover max price × GPUs × hours.
    let mut spec = job(2);
    spec.budget_micros = Micros(7_999_999);
    let (c, d) = code(tenant.submit(&spec));
    assert_eq!(c, "BudgetTooSmall", "{d}");
    assert!(
        d.contains("a budget of 7.999999 does not cover 2 GPUs × 3600 s at up to 4.000000 per GPU-hour (8.000000)"),
        "{d}"
    );
    // A placement policy that does not compile is refused at submission.
    let mut spec = job(1);
    spec.placement_policy = Some("package placement\ndeny contains".into());
    assert_eq!(code(tenant.submit(&spec)).0, "PlacementPolicyInvalid");
    // One that refuses the node keeps the job pending, with its reason.
    spec.placement_policy = Some(cgx_policies::PLACEMENT_POLICY.replace("eu-", "ap-"));
    let held = tenant.submit(&spec).unwrap();
    assert_eq!(held.state, "pending");
    assert!(held.reason.contains("placement_policy"), "{}", held.reason);
    tenant.cancel(&held.id).unwrap();
    // Bad shapes.
    assert_eq!(code(tenant.submit(&job(0))).0, "BadRequest");
    // Shapes a typed client cannot send, as JSON: an unknown TEE kind; money as a float.
    let mut raw = serde_json::to_value(job(1)).unwrap();
    raw["tee"] = serde_json::json!(["sgx"]);
    let (c, d) = code(tenant.submit_json(&raw));
    assert!(
        c == "BadRequest" && d.contains("unknown variant `sgx`"),
        "{c}: {d}"
    );
    let mut raw = serde_json::to_value(job(1)).unwrap();
    raw.as_object_mut().unwrap().remove("budget_micros");
    raw["budget"] = serde_json::json!(4.0);
    let (c, d) = code(tenant.submit_json(&raw));
    assert!(
        c == "BadRequest" && d.contains("budget (a float) is no longer read: send budget_micros"),
        "{c}: {d}"
    );
    let mut raw = serde_json::to_value(job(1)).unwrap();
    raw["max_price_per_gpu_hour_micros"] = serde_json::json!(4.5);
    let (c, d) = code(tenant.submit_json(&raw));
    assert!(c == "BadRequest" && d.contains("expected u64"), "{c}: {d}");
    let mut spec = job(1);
    spec.resources = vec!["../etc/passwd".into()];
    assert_eq!(code(tenant.submit(&spec)).0, "BadRequest");
    // Two GPUs: the first job takes both, the second waits, cancelling frees them.
    let first = tenant.submit(&job(2)).unwrap();
    assert_eq!(first.state, "placed");
    let second = tenant.submit(&job(1)).unwrap();
    assert_eq!(second.state, "pending");
    assert!(second.reason.contains("1 full"), "{}", second.reason);
    // Another tenant neither sees nor cancels it.
    let other = net
        .broker
        .client(&broker.base, &net.broker.other_tenant)
        .unwrap();
    assert_eq!(code(other.job(&first.id)).0, "NotFound");
    assert_eq!(code(other.cancel(&first.id)).0, "NotFound");
    assert!(other.jobs(None).unwrap().is_empty());
    assert_eq!(code(other.jobs(Some(TENANT_A))).0, "Forbidden");
    assert_eq!(
        code(net.auditor(&broker).cancel(&first.id)).0,
        "Forbidden",
        "auditors read, tenants cancel"
    );
    assert_eq!(
        net.auditor(&broker).jobs(Some(TENANT_A)).unwrap().len(),
        tenant.jobs(None).unwrap().len()
    );
    let cancelled = tenant.cancel(&first.id).unwrap();
    assert_eq!(cancelled.state, "cancelled");
    assert_eq!(code(tenant.cancel(&first.id)).0, "Conflict");
    let second = tenant.job(&second.id).unwrap();
    assert_eq!(second.state, "placed", "capacity freed: {}", second.reason);
    // A cancelled lease gets no renewal: only the second job's lease comes back.
    let hb = a.heartbeat(&op).unwrap();
    assert_eq!(hb.leases.len(), 1);
    assert_eq!(hb.leases[0].job_id, second.id);
    assert_eq!(tenant.jobs(None).unwrap().len(), 3);
    // One tenant's jobs that cannot be placed are bounded (they would crowd every pass).
    for _ in 0..3 {
        assert_eq!(tenant.submit(&job(64)).unwrap().state, "pending");
    }
    let (c, d) = code(tenant.submit(&job(64)));
    assert_eq!(c, "TooManyPending", "{d}");
    broker.stop();
}

#[test]
fn failover_moves_the_job_within_a_measured_time() {
    let a = node(1, "eu-west", "1.0");
    let b = node(1, "eu-west", "2.0");
    let mut net = Net::new(&[&a, &b], None);
    // The default monitor interval, as production runs it.
    net.broker.config.monitor_interval_ms = 500;
    let clock = ManualClock::default();
    let broker = BrokerServer::start_with_clock(&net.broker.config, clock.shared()).unwrap();
    let op = net.operator(&broker);
    a.register(&op).unwrap();
    b.register(&op).unwrap();
    let tenant = net.tenant(&broker);
    let j = tenant.submit(&job(1)).unwrap();
    assert_eq!(j.node_id.as_deref(), Some(a.id.as_str()), "cheapest first");
    let lease = op
        .heartbeat(&a.id, &a.heartbeat_token(clock.unix()).unwrap())
        .unwrap()
        .leases
        .remove(0);
    a.report(
        &op,
        &lease.lease_id,
        &j.id,
        WorkloadState::Running,
        None,
        clock.unix(),
    )
    .unwrap();
    // A keeps silent; B heartbeats. 15 s is the allowance (3 × 5 s); one more second passes it.
    clock.advance(10);
    op.heartbeat(&b.id, &b.heartbeat_token(clock.unix()).unwrap())
        .unwrap();
    clock.advance(6);
    op.heartbeat(&b.id, &b.heartbeat_token(clock.unix()).unwrap())
        .unwrap();
    // The background monitor (no explicit pass here) detects and re-places.
    let overdue = Instant::now();
    let moved = loop {
        let v = tenant.job(&j.id).unwrap();
        if v.node_id.as_deref() == Some(b.id.as_str()) && v.state == "placed" {
            break v;
        }
        assert!(
            overdue.elapsed() < Duration::from_secs(10),
            "not moved: {v:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = overdue.elapsed();
    println!(
        "failover: detected and re-placed {took:?} after the heartbeat deadline (monitor every 500 ms); \
         with default intervals a node is declared gone 15 s after its last heartbeat"
    );
    assert!(took < Duration::from_secs(2), "{took:?}");
    let states: Vec<String> = moved.events.iter().map(|e| e.to.to_string()).collect();
    assert_eq!(
        states,
        ["pending", "placed", "running", "pending", "placed"]
    );
    assert!(
        moved.events[3].reason.contains("missed heartbeats"),
        "{:?}",
        moved.events[3]
    );
    // A's lease is gone: its heartbeat (when it comes back) renews nothing.
    let hb = op
        .heartbeat(&a.id, &a.heartbeat_token(clock.unix()).unwrap())
        .unwrap();
    assert!(hb.leases.is_empty());
    broker.stop();
}

#[test]
fn a_restarted_broker_rebuilds_from_the_database_and_trusts_no_row_by_itself() {
    let a = node(2, "eu-west", "2.0");
    let net = Net::new(&[&a], None);
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let op = net.operator(&broker);
    a.register(&op).unwrap();
    let tenant = net.tenant(&broker);
    let j = tenant.submit(&job(1)).unwrap();
    assert_eq!(j.state, "placed");
    broker.stop();
    // Restarted: the node, its allocation and the job are back.
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let op = net.operator(&broker);
    let tenant = net.tenant(&broker);
    let view = op.node(&a.id).unwrap();
    assert!(view.placeable, "{}", view.reason);
    assert_eq!(view.free_gpus, 1);
    assert_eq!(tenant.job(&j.id).unwrap().state, "placed");
    broker.stop();
    // A database writer changes the node's record (more GPUs) and forges a lease row: the
    // record's signature fails, so the node is not loaded; the forged lease is never renewed.
    let db = net.broker.config.database.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        sqlx::any::install_default_drivers();
        let pool = sqlx::AnyPool::connect(&db).await.unwrap();
        let row = sqlx::query("SELECT record FROM nodes")
            .fetch_one(&pool)
            .await
            .unwrap();
        let record: String = sqlx::Row::get(&row, "record");
        let mut parts: Vec<String> = record.split('.').map(str::to_string).collect();
        use base64::Engine;
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let payload = String::from_utf8(b64.decode(&parts[1]).unwrap()).unwrap();
        parts[1] = b64.encode(payload.replace("\"gpu_count\":2", "\"gpu_count\":8"));
        sqlx::query("UPDATE nodes SET record = $1")
            .bind(parts.join("."))
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
    });
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let op = net.operator(&broker);
    assert_eq!(
        code(op.node(&a.id)).0,
        "NotFound",
        "a tampered record is no node"
    );
    // Re-registering makes it a node again (its evidence is verified anew).
    a.register(&op).unwrap();
    let view = op.node(&a.id).unwrap();
    assert_eq!(view.gpu_count, 2);
    broker.stop();
}

/// Two replicas on one PostgreSQL, 200 concurrent submissions for fewer GPUs than they ask:
/// exactly the capacity is placed and no GPU is given to two leases.
#[test]
fn two_replicas_never_double_book_a_gpu() {
    let Ok(url) = std::env::var("CGX_TEST_DATABASE_URL") else {
        eprintln!(
            "SKIPPED two_replicas_never_double_book_a_gpu: CGX_TEST_DATABASE_URL is not set (CI sets it to a local PostgreSQL)"
        );
        return;
    };
    let nodes: Vec<SimBrokerNode> = (0..5)
        .map(|i| node(8, "eu-west", &format!("1.{i}")))
        .collect();
    let refs: Vec<&SimBrokerNode> = nodes.iter().collect();
    let db = cgx_devnet::fresh_postgres(&url).unwrap();
    let net = Net::new(&refs, Some(db));
    let r1 = BrokerServer::start(&net.broker.config).unwrap();
    let r2 = BrokerServer::start(&net.broker.config).unwrap();
    let op = net.operator(&r1);
    for n in &nodes {
        n.register(&op).unwrap();
    }
    // Replica 2 learns the nodes through its sync.
    r2.tick().unwrap();
    assert_eq!(net.auditor(&r2).nodes().unwrap().len(), 5);
    let capacity = 40;
    let started = Instant::now();
    let handles: Vec<_> = (0..8)
        .map(|t| {
            let base = if t % 2 == 0 {
                r1.base.clone()
            } else {
                r2.base.clone()
            };
            let tenant = net.broker.tenant.api_token().unwrap();
            std::thread::spawn(move || {
                let c = BrokerClient::new(&base, None, Some(tenant)).unwrap();
                (0..25)
                    .map(|_| c.submit(&job(1)).unwrap())
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let submitted: Vec<_> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    println!("200 submissions over 2 replicas in {:?}", started.elapsed());
    assert_eq!(submitted.len(), 200);
    // Let both monitors settle pending jobs.
    r1.tick().unwrap();
    r2.tick().unwrap();
    let jobs = net.auditor(&r1).jobs(None).unwrap();
    let placed: Vec<_> = jobs.iter().filter(|j| j.state == "placed").collect();
    assert_eq!(placed.len(), capacity, "exactly the capacity is placed");
    let mut seen = std::collections::HashSet::new();
    for j in &placed {
        let view = net.auditor(&r1).job(&j.id).unwrap();
        for g in &view.gpus {
            assert!(
                seen.insert((view.node_id.clone().unwrap(), *g)),
                "GPU {g} of {:?} given twice",
                view.node_id
            );
        }
    }
    assert_eq!(seen.len(), capacity);
    assert_eq!(
        jobs.iter().filter(|j| j.state == "pending").count(),
        200 - capacity
    );
    // How often a replica's choice met the other's commit (and chose again).
    let conflicts: u64 = [&r1.base, &r2.base]
        .iter()
        .map(|b| {
            let (_, m) = cgx_system_tests::call("GET", &format!("{b}/metrics"), None, None);
            String::from_utf8_lossy(&m)
                .lines()
                .find(|l| l.contains("event=\"placement\",outcome=\"conflict\""))
                .and_then(|l| l.rsplit(' ').next()?.parse().ok())
                .unwrap_or(0)
        })
        .sum();
    println!("placement conflicts between the replicas (resolved by choosing again): {conflicts}");
    r1.stop();
    r2.stop();
}

#[test]
fn the_broker_serves_its_contract() {
    let net = Net::new(&[], None);
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    // The document is derived from the handlers and the wire types, and is the router's.
    use cgx_protocol::broker::routes;
    let doc = cgx_system_tests::openapi_contract(
        &broker.base,
        routes::OPENAPI,
        &[
            routes::NONCE,
            routes::NODES,
            routes::NODE,
            routes::HEARTBEAT,
            routes::REPORTS,
            routes::METERING,
            routes::POW,
            routes::POW_PROOF,
            routes::REATTEST,
            routes::JOBS,
            routes::JOB,
            routes::CANCEL,
            routes::REFERENCE_VALUES,
            routes::ADMIN_EVENTS,
            routes::DEPOSITS,
            routes::ACCOUNTS,
            routes::STATEMENTS,
            routes::QUOTES,
            routes::LOG_VERDICTS,
            routes::OPENAPI,
            routes::HEALTHZ,
            "/metrics",
        ],
        &[],
        &[
            ("POST", routes::NONCE),
            ("POST", routes::HEARTBEAT),
            ("POST", routes::REATTEST),
            ("POST", routes::CANCEL),
        ],
    );
    assert_eq!(doc["openapi"], "3.1.0");
    // The wire types' own schemas: a registration's evidence, money as integer micros.
    let schemas = &doc["components"]["schemas"];
    assert_eq!(
        doc["paths"][routes::NODES]["post"]["requestBody"]["content"]["application/json"]["schema"]
            ["$ref"],
        "#/components/schemas/Registration"
    );
    assert_eq!(schemas["Micros"]["type"], "integer");
    assert!(
        schemas["JobSpec"]["required"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("budget_micros"))
    );
    assert!(
        schemas["JobState"]["enum"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("expired"))
    );
    // Reference values are put in place of a version named in If-Match: without one, refused.
    let (s, body) = cgx_system_tests::call(
        "POST",
        &format!("{}/v1/reference-values", broker.base),
        Some(&net.broker.admin.api_token().unwrap()),
        Some(b"{}"),
    );
    assert_eq!(s, 400, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("If-Match"));
    let (s, _) = cgx_system_tests::call("GET", &format!("{}/healthz", broker.base), None, None);
    assert_eq!(s, 200);
    let (s, body) = cgx_system_tests::call("GET", &format!("{}/metrics", broker.base), None, None);
    assert_eq!(s, 200);
    assert!(String::from_utf8_lossy(&body).contains("cgx_broker_requests_total"));
    // Problem details with a stable code; oversized bodies refused before authentication.
    let (s, body) = cgx_system_tests::call("GET", &format!("{}/v1/nope", broker.base), None, None);
    assert_eq!(s, 404);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&body).unwrap()["code"],
        "NotFound"
    );
    let ask = |head: String| {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(broker.addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.write_all(head.as_bytes()).unwrap();
        let mut out = String::new();
        let _ = c.read_to_string(&mut out);
        out
    };
    for (path, len) in [
        ("/v1/jobs", 200 << 10),
        ("/v1/nodes", 3 << 20),
        ("/v1/nodes/nonce", 8192),
        ("/v1/reference-values", 2 << 20),
    ] {
        let out = ask(format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {len}\r\n\r\n"
        ));
        assert!(out.starts_with("HTTP/1.1 413"), "{path}: not a 401: {out}");
        assert!(out.contains("PayloadTooLarge"), "{out}");
    }
    // Plain HTTP only on loopback; a signing key that is also an API key or the result key is
    // refused.
    let mut bad = net.broker.config.clone();
    bad.listen = "0.0.0.0:0".into();
    assert!(bad.check().is_err());
    let mut bad = net.broker.config.clone();
    bad.api_keys.push(cgx_broker::server::config::ApiKey {
        public_key: net.kbs.broker.public_b64.clone(),
        scopes: vec!["*".into()],
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    let err = rt.block_on(cgx_broker::server::start(&bad)).unwrap_err();
    assert!(err.to_string().contains("signing key"), "{err}");
    // One Ed25519 key for EARs and for leases: refused.
    let mut bad = net.broker.config.clone();
    bad.result_key = Some(bad.signing_key.clone());
    let err = rt.block_on(cgx_broker::server::start(&bad)).unwrap_err();
    assert!(
        err.to_string()
            .contains("result_key and signing_key are the same key"),
        "{err}"
    );
    let _ = OPERATOR;
    broker.stop();
}

/// Issue 28 (8): KBS admin tokens and broker API tokens are one scheme, told apart by their
/// audience. With one key known to both services (an operator may well do that), a token
/// made for the KBS is refused by the broker with the reason, and the other way round; a
/// token that names no audience is refused by both.
#[test]
fn a_token_for_one_service_is_refused_by_the_other() {
    let mut net = Net::new(&[], None);
    let both = &net.broker.auditor;
    net.kbs
        .config
        .admin_keys
        .push(cgx_kbs::server::config::AdminKey {
            public_key: both.public_b64.clone(),
            repositories: vec!["*".into()],
        });
    let kbs = cgx_devnet::Server::start(&net.kbs.config).unwrap();
    let broker = BrokerServer::start(&net.broker.config).unwrap();
    let both = &net.broker.auditor;
    let nodes = format!("{}/v1/nodes", broker.base);
    let resource = format!("{}/kbs/v0/resource/tenant-a/key/aud", kbs.base);
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    // Each service takes its own.
    let (s, b) = cgx_system_tests::call("GET", &nodes, Some(&both.api_token().unwrap()), None);
    assert_eq!(s, 200, "{}", text(&b));
    let (s, b) = cgx_system_tests::call(
        "POST",
        &resource,
        Some(&both.admin_token().unwrap()),
        Some(b"v"),
    );
    assert_eq!(s, 200, "{}", text(&b));
    // A KBS admin token at the broker.
    let (s, b) = cgx_system_tests::call("GET", &nodes, Some(&both.admin_token().unwrap()), None);
    assert_eq!(s, 401, "{}", text(&b));
    assert!(
        text(&b).contains("a cgx-kbs-admin+jwt token, not a cgx-broker-api+jwt one"),
        "{}",
        text(&b)
    );
    // A broker API token at the KBS.
    let (s, b) = cgx_system_tests::call(
        "POST",
        &resource,
        Some(&both.api_token().unwrap()),
        Some(b"v"),
    );
    assert_eq!(s, 401, "{}", text(&b));
    assert!(
        text(&b).contains("a cgx-broker-api+jwt token, not a cgx-kbs-admin+jwt one"),
        "{}",
        text(&b)
    );
    // The right type without an audience, and an untyped token: refused by both, saying so.
    let t = cgx_devnet::now();
    let bare = |typ: &str| {
        cgx_system_tests::forge(
            both,
            serde_json::json!({"alg": "EdDSA", "typ": typ}),
            serde_json::json!({"iat": t, "exp": t + 60}),
        )
    };
    let (s, b) = cgx_system_tests::call("GET", &nodes, Some(&bare("cgx-broker-api+jwt")), None);
    assert_eq!(s, 401, "{}", text(&b));
    assert!(
        text(&b).contains("audience none is not cgx-broker/api"),
        "{}",
        text(&b)
    );
    let (s, b) = cgx_system_tests::call(
        "POST",
        &resource,
        Some(&bare("cgx-kbs-admin+jwt")),
        Some(b"v"),
    );
    assert_eq!(s, 401, "{}", text(&b));
    assert!(
        text(&b).contains("audience none is not cgx-kbs/admin"),
        "{}",
        text(&b)
    );
    let (s, b) = cgx_system_tests::call("GET", &nodes, Some(&bare("JWT")), None);
    assert_eq!(s, 401, "{}", text(&b));
    assert!(
        text(&b).contains("a JWT token, not a cgx-broker-api+jwt one"),
        "{}",
        text(&b)
    );
    broker.stop();
    kbs.stop();
}
