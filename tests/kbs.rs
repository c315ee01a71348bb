#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The whole system over HTTP: a KBS on loopback (the development network's) with simulated
//! SNP and GPU evidence that the real verifiers, the appraisal policy and the release policies
//! judge — the handshake and release, and each way release must fail, failing with its own error.

use base64::Engine;
use cgx_kbs::client::KbsClient;
use cgx_protocol::kbs::jwe::thumbprint;
use cgx_protocol::kbs::rcar::EvidenceSource;
use cgx_system_tests::*;
use serde_json::json;

fn client(base: &str) -> KbsClient {
    KbsClient::with_new_key(base, None).unwrap()
}

#[test]
fn handshake_and_release_with_gpus_and_every_refusal() {
    let n = node(2);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    let base = srv.base.clone();
    put_resource(
        &base,
        &s.admin,
        "tenant-a/key/model",
        b"the model key",
        false,
    );

    // Full flow: auth -> attest (SNP + 2 GPUs) -> resource, decrypted with the TEE key.
    let mut c = client(&base);
    let token = c.attest(&n).unwrap();
    let ear = cgx_attestation::results::verify(
        &token,
        &json_of(&call("GET", &format!("{base}/kbs/v0/jwks"), None, None).1)["keys"][0],
        now(),
    )
    .unwrap();
    assert_eq!(ear.submods.len(), 3, "cpu0, gpu0, gpu1");
    assert_eq!(
        c.resource("tenant-a/key/model", None).unwrap(),
        b"the model key"
    );

    // A bearer EAR works without the cookie.
    let (st, body) = call(
        "GET",
        &format!("{base}/kbs/v0/resource/tenant-a/key/model"),
        Some(&token),
        None,
    );
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let jwe: cgx_protocol::kbs_types::Response = serde_json::from_slice(&body).unwrap();
    assert_eq!(c.tee_key().decrypt(&jwe).unwrap(), b"the model key");

    // Tampered JWE: refused by the client.
    let mut jwe = c.resource_jwe("tenant-a/key/model", None).unwrap();
    jwe.ciphertext[0] ^= 1;
    assert!(c.tee_key().decrypt(&jwe).is_err());

    // Replayed nonce: the same attestation message twice in one session.
    let mut r = client(&base);
    let nonce = r.auth(n.tee()).unwrap();
    let att = r.attestation(&n, &nonce).unwrap();
    r.send_attestation(&att).unwrap();
    let e = r.send_attestation(&att).unwrap_err();
    assert_eq!(
        (e.status(), e.kind()),
        (Some(401), Some("UnAuthenticated")),
        "{e}"
    );

    // Evidence of another session (its nonce) in a new session: refused.
    let mut other = client(&base);
    other.auth(n.tee()).unwrap();
    let e = other.send_attestation(&att).unwrap_err();
    assert_eq!(e.kind(), Some("AttestationFailed"), "{e}");

    // report_data that does not bind the key: evidence made for key A sent with key B.
    let mut a = client(&base);
    let nonce = a.auth(n.tee()).unwrap();
    let mut att = a.attestation(&n, &nonce).unwrap();
    att.runtime_data.tee_pubkey = client(&base).tee_key().public().unwrap();
    let e = a.send_attestation(&att).unwrap_err();
    assert_eq!(e.kind(), Some("AttestationFailed"), "{e}");
    assert!(e.to_string().contains("report_data"), "{e}");

    // A GPU report swapped for one bound to another nonce: refused (the CPU binds the string).
    let mut g = client(&base);
    let nonce = g.auth(n.tee()).unwrap();
    let mut att = g.attestation(&n, &nonce).unwrap();
    let key = g.tee_key().public().unwrap();
    let stale = n.additional_evidence("another nonce", &key).unwrap();
    att.tee_evidence.additional_evidence = stale;
    let e = g.send_attestation(&att).unwrap_err();
    assert_eq!(e.kind(), Some("AttestationFailed"), "{e}");

    // Policy deny: the tenant forbids release of this resource.
    let (st, b) = set_policy(
        &base,
        &s.tenant_admin,
        "tenant-a/key/model",
        "package policy\nimport rego.v1\ndefault allow := false\n",
    );
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let e = c.resource("tenant-a/key/model", None).unwrap_err();
    assert_eq!(
        (e.status(), e.kind()),
        (Some(401), Some("PolicyDeny")),
        "{e}"
    );
    // ...and allows it again by query: the input carries the query.
    set_policy(
        &base,
        &s.tenant_admin,
        "tenant-a/key/model",
        "package policy\nimport rego.v1\nallow if input.query.purpose == \"inference\"\n",
    );
    assert!(c.resource("tenant-a/key/model", None).is_err());
    let (st, b) = call(
        "GET",
        &format!("{base}/kbs/v0/resource/tenant-a/key/model?purpose=inference"),
        c.token(),
        None,
    );
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));

    // Wrong tenant: tenant-a's admin cannot write tenant-b, nor set global policy.
    let (st, b) = call(
        "POST",
        &format!("{base}/kbs/v0/resource/tenant-b/key/x"),
        Some(&admin_token(&s.tenant_admin)),
        Some(b"x"),
    );
    assert_eq!(st, 401);
    assert!(
        json_of(&b)["type"]
            .as_str()
            .unwrap()
            .ends_with("/AdminAuthFailed")
    );
    let (st, _) = set_policy(
        &base,
        &s.tenant_admin,
        "",
        "package policy\nallow := true\n",
    );
    assert_eq!(st, 401);
    // A policy that does not compile is refused before it is stored.
    let (st, b) = set_policy(&base, &s.admin, "tenant-a", "package policy\nallow if {");
    assert_eq!(st, 400, "{}", String::from_utf8_lossy(&b));

    // Unknown resource: refused like an existing one while tenant A names no requester for it
    // (tenant isolation, before any lookup), 404 once it does; bad paths 404; unauthenticated
    // 401 for existing and missing alike (no leak).
    let e = c.resource("tenant-a/key/nothing", None).unwrap_err();
    assert_eq!(e.kind(), Some("PolicyDeny"), "{e}");
    let (st, _) = set_policy(
        &base,
        &s.admin,
        "tenant-a/key/nothing",
        cgx_policies::RELEASE_POLICY,
    );
    assert_eq!(st, 200);
    let e = c.resource("tenant-a/key/nothing", None).unwrap_err();
    assert_eq!(
        (e.status(), e.kind()),
        (Some(404), Some("ResourceNotFound"))
    );
    let (st, _) = call(
        "GET",
        &format!("{base}/kbs/v0/resource/a/..%2F/b"),
        None,
        None,
    );
    assert_eq!(st, 404);
    let (st1, b1) = call(
        "GET",
        &format!("{base}/kbs/v0/resource/tenant-a/key/model"),
        None,
        None,
    );
    let (st2, b2) = call(
        "GET",
        &format!("{base}/kbs/v0/resource/tenant-a/key/nothing"),
        None,
        None,
    );
    assert_eq!((st1, st2), (401, 401));
    assert_eq!(b1, b2);

    // The audit trail has the admin changes and the releases.
    let (st, b) = call(
        "GET",
        &format!("{base}/kbs/v0/audit"),
        Some(&admin_token(&s.admin)),
        None,
    );
    assert_eq!(st, 200);
    let actions: Vec<String> = json_of(&b)
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap().to_string())
        .collect();
    assert!(actions.contains(&"resource.put".to_string()));
    assert!(actions.contains(&"policy.put".to_string()));
    assert!(actions.iter().filter(|a| *a == "release").count() >= 2);
    // An attested session refused (the tenant's policy) is a decision too.
    assert!(
        actions.contains(&"release.refused".to_string()),
        "{actions:?}"
    );

    // The KBS's own log (issue 33): every audit row a leaf, the log verified offline under the
    // KBS's log key; entry bundles are for unscoped administrators only.
    let events = json_of(&b).as_array().unwrap().clone();
    let dir = s.dir.join("log-copy");
    let token = admin_token(&s.admin);
    let get =
        |p: &str, token: Option<&str>| call("GET", &format!("{base}/kbs/v0/log/{p}"), token, None);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let size = loop {
        let (st, note) = get("checkpoint", None);
        let size: u64 = String::from_utf8_lossy(&note)
            .lines()
            .nth(1)
            .and_then(|l| l.parse().ok())
            .unwrap_or(0);
        if st == 200 && size >= events.len() as u64 {
            let _ = std::fs::remove_dir_all(&dir);
            for t in cgx_tlog::tiles_of(size) {
                let mut ps = vec![(cgx_tlog::paths::tile_path(&t), None)];
                if t.level() == 0 {
                    let e = cgx_tlog::paths::tile_path(&cgx_tlog::paths::bundle_tile(
                        t.level_index(),
                        t.width(),
                    ));
                    assert_eq!(get(&e, None).0, 401, "entries without a token");
                    ps.push((e, Some(token.as_str())));
                }
                for (p, tok) in ps {
                    let (st, data) = get(&p, tok);
                    assert_eq!(st, 200, "{p}");
                    std::fs::create_dir_all(dir.join(&p).parent().unwrap()).unwrap();
                    std::fs::write(dir.join(&p), data).unwrap();
                }
            }
            std::fs::write(dir.join("checkpoint"), &note).unwrap();
            break size;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the KBS log never checkpointed its trail"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let trust = cgx_tlog::verify::Trust {
        log: cgx_tlog::note::NoteKey::parse(&s.log_vkey().unwrap()).unwrap(),
        witnesses: Vec::new(),
        quorum: 0,
    };
    let v = cgx_tlog::verify::verify_dir(&dir, &trust, None).unwrap();
    assert_eq!(v.size, size);
    for (leaf, e) in v.leaves.iter().zip(&events) {
        let e: cgx_protocol::audit::AuditEvent = serde_json::from_value(e.clone()).unwrap();
        assert_eq!(leaf, &e.leaf("cgx-kbs"));
    }

    // Service endpoints.
    let (st, b) = call("GET", &format!("{base}/metrics"), None, None);
    assert_eq!(st, 200);
    assert!(
        String::from_utf8_lossy(&b)
            .contains("cgx_kbs_events_total{event=\"release\",outcome=\"released\"}")
    );
    // The document is derived from the handlers and the wire types, and is the router's.
    const RESOURCE: &str = "/kbs/v0/resource/{repo}/{kind}/{tag}";
    let doc = cgx_system_tests::openapi_contract(
        &base,
        "/kbs/v0/openapi.json",
        &[
            "/kbs/v0/auth",
            "/kbs/v0/attest",
            RESOURCE,
            "/kbs/v0/resource-policy",
            "/kbs/v0/resource-policy/{repo}",
            "/kbs/v0/resource-policy/{repo}/{kind}/{tag}",
            "/kbs/v0/attestation-policy",
            "/kbs/v0/reference-values",
            "/kbs/v0/reference-value",
            "/kbs/v0/reference-value/{id}",
            "/kbs/v0/audit",
            "/kbs/v0/jwks",
            "/kbs/v0/openapi.json",
            "/metrics",
            "/healthz",
        ],
        &[
            ("POST", RESOURCE),
            ("DELETE", RESOURCE),
            ("POST", "/kbs/v0/resource-policy"),
            ("POST", "/kbs/v0/resource-policy/{repo}"),
            ("POST", "/kbs/v0/resource-policy/{repo}/{kind}/{tag}"),
            ("POST", "/kbs/v0/attestation-policy"),
            ("POST", "/kbs/v0/reference-values"),
            ("POST", "/kbs/v0/reference-value"),
        ],
        &[],
    );
    assert_eq!(doc["openapi"], "3.1.0");
    assert_eq!(
        doc["paths"]["/kbs/v0/attest"]["post"]["requestBody"]["content"]["application/json"]["schema"]
            ["$ref"],
        "#/components/schemas/Attestation"
    );
    assert_eq!(call("GET", &format!("{base}/healthz"), None, None).0, 200);
    assert_eq!(call("GET", &format!("{base}/nope"), None, None).0, 404);
    srv.stop();
}

#[test]
fn leases_bind_job_resources_to_the_attested_node() {
    let n = node(0);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    let base = srv.base.clone();
    put_resource(
        &base,
        &s.admin,
        "tenant-a/weights/llama",
        b"weights identity",
        true,
    );
    put_resource(
        &base,
        &s.admin,
        "tenant-a/weights/other-job",
        b"other",
        true,
    );
    let mut c = client(&base);
    c.attest(&n).unwrap();
    let me = thumbprint(&c.tee_key().public().unwrap());
    let path = "tenant-a/weights/llama";

    let e = c.resource(path, None).unwrap_err();
    assert_eq!(e.kind(), Some("PolicyDeny"), "no lease: {e}");
    assert!(e.to_string().contains("needs a lease"), "{e}");
    let good = lease(&s.broker, "lease-1", &[path], &me, now() + 600);
    assert_eq!(c.resource(path, Some(&good)).unwrap(), b"weights identity");

    let other_node = thumbprint(&client(&base).tee_key().public().unwrap());
    for (what, token) in [
        (
            "another node",
            lease(&s.broker, "lease-1", &[path], &other_node, now() + 600),
        ),
        (
            "another job",
            lease(
                &s.broker,
                "lease-2",
                &["tenant-a/weights/other-job"],
                &me,
                now() + 600,
            ),
        ),
        (
            "expired",
            lease(&s.broker, "lease-1", &[path], &me, now() - 5),
        ),
        (
            "not a broker",
            lease(&s.admin, "lease-1", &[path], &me, now() + 600),
        ),
    ] {
        let e = c.resource(path, Some(&token)).unwrap_err();
        assert_eq!(
            (e.status(), e.kind()),
            (Some(401), Some("LeaseInvalid")),
            "{what}: {e}"
        );
    }
    // The lease's claims reach the release policy.
    set_policy(
        &base,
        &s.admin,
        "tenant-a",
        "package policy\nimport rego.v1\nallow if input.lease.lease == \"lease-9\"\n",
    );
    let e = c.resource(path, Some(&good)).unwrap_err();
    assert_eq!(e.kind(), Some("PolicyDeny"), "{e}");
    let nine = lease(&s.broker, "lease-9", &[path], &me, now() + 600);
    assert_eq!(c.resource(path, Some(&nine)).unwrap(), b"weights identity");
    srv.stop();
}

#[test]
fn sessions_expire_and_sample_evidence_is_refused() {
    let n = node(0);
    let mut s = setup(&[&n], None);
    // The KBS runs on a manual clock: expiry is tested by moving it, not by sleeping.
    s.config.session_ttl_secs = 2;
    s.config.nonce_ttl_secs = 2;
    let clock = cgx_service::clock::ManualClock::default();
    let srv = Server::start_with_clock(&s.config, clock.shared());
    let base = srv.base.clone();
    put_resource(&base, &s.admin, "tenant-a/key/k", b"k", false);
    // Expired session.
    let mut c = client(&base);
    c.attest(&n).unwrap();
    assert_eq!(c.resource("tenant-a/key/k", None).unwrap(), b"k");
    clock.advance(1);
    assert_eq!(
        c.resource("tenant-a/key/k", None).unwrap(),
        b"k",
        "one second left"
    );
    clock.advance(1);
    let e = c.resource("tenant-a/key/k", None).unwrap_err();
    assert_eq!(e.kind(), Some("UnAuthenticated"), "{e}");
    // Expired challenge.
    let mut late = client(&base);
    let nonce = late.auth(n.tee()).unwrap();
    let att = late.attestation(&n, &nonce).unwrap();
    clock.advance(2);
    let e = late.send_attestation(&att).unwrap_err();
    assert_eq!(e.kind(), Some("UnAuthenticated"), "{e}");
    // Protocol errors.
    let (st, b) = call(
        "POST",
        &format!("{base}/kbs/v0/auth"),
        None,
        Some(br#"{"version":"0.1.0","tee":"snp","extra-params":""}"#),
    );
    assert_eq!(st, 400);
    assert!(
        json_of(&b)["type"]
            .as_str()
            .unwrap()
            .ends_with("/ProtocolVersionMismatch")
    );
    // Sample evidence: not accepted unless a dev flag enables it.
    let (st, b) = call(
        "POST",
        &format!("{base}/kbs/v0/auth"),
        None,
        Some(br#"{"version":"0.4.0","tee":"sample","extra-params":""}"#),
    );
    assert_eq!(st, 400, "{}", String::from_utf8_lossy(&b));
    assert_eq!(
        call("POST", &format!("{base}/kbs/v0/auth"), None, Some(b"{")).0,
        400
    );
    srv.stop();

    // With the dev flag, sample evidence is appraised: the default policy refuses it.
    let mut s2 = setup(&[&n], None);
    s2.config.allow_sample = true;
    s2.config.appraisal.reference_values = None;
    let srv = Server::start(&s2.config);
    put_resource(&srv.base, &s2.admin, "tenant-a/key/k", b"k", false);
    struct Sample;
    impl cgx_protocol::kbs::rcar::EvidenceSource for Sample {
        fn tee(&self) -> cgx_protocol::kbs_types::Tee {
            cgx_protocol::kbs_types::Tee::Sample
        }
        fn additional_evidence(
            &self,
            _: &str,
            _: &cgx_protocol::kbs_types::TeePubKey,
        ) -> Result<String, cgx_kbs::client::ClientError> {
            Ok(String::new())
        }
        fn primary_evidence(
            &self,
            rd: &[u8; 64],
        ) -> Result<serde_json::Value, cgx_kbs::client::ClientError> {
            Ok(
                json!({"svn": "1", "report_data": base64::engine::general_purpose::STANDARD.encode(rd)}),
            )
        }
    }
    let mut c = client(&srv.base);
    c.attest(&Sample).unwrap();
    let e = c.resource("tenant-a/key/k", None).unwrap_err();
    assert_eq!(e.kind(), Some("PolicyDeny"), "{e}");
    assert!(e.to_string().contains("contraindicated"), "{e}");
    srv.stop();
}

#[test]
fn coco_shaped_snp_report_json_is_accepted() {
    // CoCo's snp attester sends sev's AttestationReport as JSON, not bytes.
    let n = node(0);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    put_resource(&srv.base, &s.admin, "tenant-a/key/k", b"k", false);
    let mut c = client(&srv.base);
    let nonce = c.auth(n.tee()).unwrap();
    let mut att = c.attestation(&n, &nonce).unwrap();
    let raw = base64::engine::general_purpose::STANDARD
        .decode(
            att.tee_evidence.primary_evidence["attestation_report"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
    use sev::parser::ByteParser;
    let report = sev::firmware::guest::AttestationReport::from_bytes(&raw).unwrap();
    att.tee_evidence.primary_evidence["attestation_report"] = serde_json::to_value(report).unwrap();
    c.send_attestation(&att).unwrap();
    assert_eq!(c.resource("tenant-a/key/k", None).unwrap(), b"k");
    srv.stop();
}

#[test]
fn restart_keeps_resources_and_two_replicas_share_sessions() {
    let n = node(0);
    let mut s = setup(&[&n], None);
    // Processes on one SQLite file share sessions when asked to (PostgreSQL always does).
    s.config.sessions = Some(cgx_kbs::server::config::SessionMode::Database);
    let srv = Server::start(&s.config);
    put_resource(
        &srv.base,
        &s.admin,
        "tenant-a/key/persist",
        b"survives",
        false,
    );
    srv.stop();
    // Restart on the same database: the sealed resource is still there.
    let a = Server::start(&s.config);
    let b = Server::start(&s.config);
    let mut c = client(&a.base);
    c.attest(&n).unwrap();
    assert_eq!(
        c.resource("tenant-a/key/persist", None).unwrap(),
        b"survives"
    );
    replicas_serve_one_session(&a.base, &b.base, &n);
    a.stop();
    b.stop();
}

/// auth on A, attest on B, resource on A: sessions live in the shared database.
fn replicas_serve_one_session(a: &str, b: &str, n: &cgx_kbs::sim::SimNode) {
    let mut on_a = client(a);
    let nonce = on_a.auth(n.tee()).unwrap();
    let att = on_a.attestation(n, &nonce).unwrap();
    // The same client (key and session cookie) pointed at B.
    let mut on_b = on_a.rebase(b);
    on_b.send_attestation(&att).unwrap();
    let on_a = on_b.rebase(a);
    assert_eq!(
        on_a.resource("tenant-a/key/persist", None).unwrap(),
        b"survives"
    );
    // And the nonce consumed on B cannot be replayed on A.
    let mut again = on_a.rebase(a);
    let e = again.send_attestation(&att).unwrap_err();
    assert_eq!(e.kind(), Some("UnAuthenticated"), "{e}");
}

/// SQLite's default, `memory` sessions: a challenge is answered once without a database
/// write, only by the process that issued it, and a restart ends its sessions (the client
/// attests again); the resources stay.
#[test]
fn memory_sessions_answer_once_and_end_with_the_process() {
    let n = node(0);
    let s = setup(&[&n], None);
    assert_eq!(
        s.config.session_mode(),
        cgx_kbs::server::config::SessionMode::Memory
    );
    let a = Server::start(&s.config);
    put_resource(&a.base, &s.admin, "tenant-a/key/mem", b"m", false);
    let mut c = client(&a.base);
    let nonce = c.auth(n.tee()).unwrap();
    let att = c.attestation(&n, &nonce).unwrap();
    c.send_attestation(&att).unwrap();
    assert_eq!(c.resource("tenant-a/key/mem", None).unwrap(), b"m");
    // The same answer again, on the same challenge: refused.
    let e = c.send_attestation(&att).unwrap_err();
    assert_eq!(e.kind(), Some("UnAuthenticated"), "{e}");
    assert!(e.to_string().contains("already answered"), "{e}");
    // A failed answer uses the challenge up too.
    let mut f = client(&a.base);
    let nonce = f.auth(n.tee()).unwrap();
    let mut bad = f.attestation(&n, &nonce).unwrap();
    bad.runtime_data.nonce = "not the nonce".into();
    let e = f.send_attestation(&bad).unwrap_err();
    assert_eq!(e.kind(), Some("AttestationFailed"), "{e}");
    let good = f.attestation(&n, &nonce).unwrap();
    let e = f.send_attestation(&good).unwrap_err();
    assert!(e.to_string().contains("already answered"), "{e}");

    // Another process on the same file did not issue this challenge: it cannot answer it
    // (so no challenge is answered twice across processes), nor serve the session.
    let b = Server::start(&s.config);
    let mut on_a = client(&a.base);
    let nonce = on_a.auth(n.tee()).unwrap();
    let att = on_a.attestation(&n, &nonce).unwrap();
    let mut on_b = on_a.rebase(&b.base);
    let e = on_b.send_attestation(&att).unwrap_err();
    assert!(e.to_string().contains("not issued by this KBS"), "{e}");
    let mut on_a = on_b.rebase(&a.base);
    on_a.send_attestation(&att).unwrap();
    let on_b = on_a.rebase(&b.base);
    let e = on_b.resource("tenant-a/key/mem", None).unwrap_err();
    assert_eq!(e.kind(), Some("UnAuthenticated"), "{e}");
    b.stop();

    // A restart ends the sessions; the client attests again and the resource is there.
    a.stop();
    let a = Server::start(&s.config);
    let on_a = on_b.rebase(&a.base);
    let e = on_a.resource("tenant-a/key/mem", None).unwrap_err();
    assert_eq!(e.kind(), Some("UnAuthenticated"), "{e}");
    let mut again = on_a;
    again.attest(&n).unwrap();
    assert_eq!(again.resource("tenant-a/key/mem", None).unwrap(), b"m");
    a.stop();
}

/// What each mode leaves in the database: `memory` sessions write no session row at all;
/// `database` sessions record every answer there, a failed one included, so the failed
/// challenge cannot be answered by this process or another on the same file.
#[test]
fn memory_sessions_write_no_row_and_database_sessions_record_failed_answers() {
    let n = node(0);
    let mut s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    put_resource(&srv.base, &s.admin, "tenant-a/key/rows", b"r", false);
    let mut c = client(&srv.base);
    c.attest(&n).unwrap();
    assert_eq!(c.resource("tenant-a/key/rows", None).unwrap(), b"r");
    srv.stop();
    let rows = |s: &Setup| {
        let path = s.database.trim_start_matches("sqlite://");
        let db = rusqlite::Connection::open(path).unwrap();
        db.query_row("SELECT count(*) FROM sessions", [], |r| r.get::<_, i64>(0))
            .unwrap()
    };
    assert_eq!(rows(&s), 0, "memory sessions wrote a session row");

    s.config.sessions = Some(cgx_kbs::server::config::SessionMode::Database);
    let a = Server::start(&s.config);
    let b = Server::start(&s.config);
    let mut f = client(&a.base);
    let nonce = f.auth(n.tee()).unwrap();
    let mut bad = f.attestation(&n, &nonce).unwrap();
    bad.runtime_data.nonce = "not the nonce".into();
    let e = f.send_attestation(&bad).unwrap_err();
    assert_eq!(e.kind(), Some("AttestationFailed"), "{e}");
    assert_eq!(rows(&s), 1, "the failed answer is a row");
    let good = f.attestation(&n, &nonce).unwrap();
    for base in [&a.base, &b.base] {
        let mut again = f.rebase(base);
        let e = again.send_attestation(&good).unwrap_err();
        assert!(e.to_string().contains("already answered"), "{e}");
        f = again;
    }
    a.stop();
    b.stop();
}

/// At `max_live_sessions` live answers, attestation is refused with 503 rather than any
/// answer forgotten (which would let its challenge be answered again); the sessions held
/// still release.
#[test]
fn a_full_session_table_refuses_attestation_and_forgets_nothing() {
    let n = node(0);
    let mut s = setup(&[&n], None);
    s.config.max_live_sessions = 2;
    let srv = Server::start(&s.config);
    put_resource(&srv.base, &s.admin, "tenant-a/key/full", b"f", false);
    let mut one = client(&srv.base);
    one.attest(&n).unwrap();
    let mut two = client(&srv.base);
    let nonce = two.auth(n.tee()).unwrap();
    let att = two.attestation(&n, &nonce).unwrap();
    two.send_attestation(&att).unwrap();
    let mut three = client(&srv.base);
    let e = three.attest(&n).unwrap_err();
    // A 5xx carries a log reference only; the log names max_live_sessions.
    assert_eq!(e.kind(), Some("ServiceUnavailable"), "{e}");
    assert_eq!(one.resource("tenant-a/key/full", None).unwrap(), b"f");
    assert_eq!(two.resource("tenant-a/key/full", None).unwrap(), b"f");
    let e = two.send_attestation(&att).unwrap_err();
    assert!(e.to_string().contains("already answered"), "{e}");
    srv.stop();
}

#[test]
fn two_kbs_on_one_postgresql() {
    let Ok(url) = std::env::var("CGX_TEST_DATABASE_URL") else {
        skip(
            "two_kbs_on_one_postgresql",
            "CGX_TEST_DATABASE_URL is not set (CI sets it to a local PostgreSQL)",
        );
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must provide PostgreSQL"
        );
        return;
    };
    let n = node(1);
    let s = setup(&[&n], Some(url));
    let a = Server::start(&s.config);
    let b = Server::start(&s.config);
    put_resource(
        &a.base,
        &s.admin,
        "tenant-a/key/persist",
        b"survives",
        false,
    );
    replicas_serve_one_session(&a.base, &b.base, &n);
    a.stop();
    b.stop();
    // Restart: still there.
    let a = Server::start(&s.config);
    let mut c = client(&a.base);
    c.attest(&n).unwrap();
    assert_eq!(
        c.resource("tenant-a/key/persist", None).unwrap(),
        b"survives"
    );
    a.stop();
}

#[test]
fn a_toml_configuration_serves_as_its_json_twin_does() {
    let n = node(0);
    let s = setup(&[&n], None);
    let admin = &s.config.admin_keys[0].public_key;
    let broker = &s.config.broker_keys[0];
    let kek = s.dir.join("kek.hex");
    let refs = s.dir.join("refs.json");
    let toml = format!(
        r#"listen = "127.0.0.1:0"
insecure_dev = true
database = "sqlite://{db}"
sim_roots = [{pins}]
broker_keys = ["{broker}"]
[kek]
file = "{kek}"
[[admin_keys]]
public_key = "{admin}"
repositories = ["*"]
[appraisal]
reference_values = "{refs}"
"#,
        db = s.dir.join("toml.db").display(),
        pins = s
            .pins
            .iter()
            .map(|p| format!("\"{}\"", hex::encode(p)))
            .collect::<Vec<_>>()
            .join(", "),
        kek = kek.display(),
        refs = refs.display(),
    );
    let path = s.dir.join("kbs.toml");
    std::fs::write(&path, toml).unwrap();
    let config = cgx_kbs::server::config::KbsConfig::from_file_with(&path, |_| {}).unwrap();
    assert_eq!(config.max_connections, 4096, "defaults apply as in JSON");
    let srv = Server::start(&config);
    put_resource(
        &srv.base,
        &s.admin,
        "tenant-a/key/toml",
        b"from toml",
        false,
    );
    let mut c = client(&srv.base);
    c.attest(&n).unwrap();
    assert_eq!(c.resource("tenant-a/key/toml", None).unwrap(), b"from toml");
    srv.stop();
    // An unknown key is refused, in TOML as in JSON.
    std::fs::write(&path, "listen = \"127.0.0.1:0\"\nnot_a_key = 1\n").unwrap();
    let e = cgx_kbs::server::config::KbsConfig::from_file_with(&path, |_| {}).unwrap_err();
    assert!(e.to_string().contains("not_a_key"), "{e}");
}

#[test]
fn bad_configs_are_refused() {
    let n = node(0);
    let mut s = setup(&[&n], None);
    s.config.listen = "0.0.0.0:0".into();
    let e = cgx_kbs::server::config::KbsConfig::check(&s.config).unwrap_err();
    assert!(e.to_string().contains("loopback"), "{e}");
    s.config.listen = "127.0.0.1:0".into();
    s.config.insecure_dev = false;
    assert!(s.config.check().is_err());
    s.config.insecure_dev = true;
    s.config.database = "mysql://x".into();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let e = rt.block_on(cgx_kbs::server::start(&s.config)).unwrap_err();
    assert!(e.to_string().contains("sqlite://"), "{e}");
    // Replicas on a shared database must share the result key that signs their sessions.
    s.config.database = "postgres://kbs@db/kbs".into();
    s.config.result_key = None;
    let e = s.config.check().unwrap_err();
    assert!(e.to_string().contains("result_key"), "{e}");
    // A session (and its bearer EAR) lives a day at most.
    s.config.database = "sqlite://x.db".into();
    s.config.session_ttl_secs = 86_401;
    let e = s.config.check().unwrap_err();
    assert!(e.to_string().contains("session_ttl_secs"), "{e}");
    s.config.session_ttl_secs = i64::MAX;
    assert!(s.config.check().is_err());
    // A session shorter than its challenge.
    s.config.session_ttl_secs = 30;
    s.config.nonce_ttl_secs = 60;
    let e = s.config.check().unwrap_err();
    assert!(e.to_string().contains("nonce_ttl_secs"), "{e}");
    s.config.nonce_ttl_secs = 30;
    // A session table that holds nothing.
    s.config.max_live_sessions = 0;
    let e = s.config.check().unwrap_err();
    assert!(e.to_string().contains("max_live_sessions"), "{e}");
    s.config.max_live_sessions = 100_000;
    // Development trust off loopback.
    s.config.insecure_dev = false;
    s.config.tls = Some(cgx_kbs::server::config::TlsConfig {
        cert: s.dir.join("none.crt"),
        key: s.dir.join("none.key"),
    });
    s.config.listen = "0.0.0.0:0".into();
    let e = s.config.check().unwrap_err();
    assert!(e.to_string().contains("sim_roots"), "{e}");
    s.config.sim_roots.clear();
    s.config.allow_sample = true;
    assert!(
        s.config
            .check()
            .unwrap_err()
            .to_string()
            .contains("allow_sample")
    );
    s.config.allow_sample = false;
    s.config.check().unwrap();
    // An admin key must name its repositories.
    s.config.admin_keys[0].repositories.clear();
    let e = s.config.check().unwrap_err();
    assert!(e.to_string().contains("repositories"), "{e}");
    let path = s.dir.join("no-scope.json");
    std::fs::write(
        &path,
        json!({"listen": "127.0.0.1:0", "insecure_dev": true, "database": "sqlite://x.db",
               "kek": {"env": "X"}, "admin_keys": [{"public_key": "k"}]})
        .to_string(),
    )
    .unwrap();
    let e = cgx_kbs::server::config::KbsConfig::from_file_with(&path, |_| {}).unwrap_err();
    assert!(e.to_string().contains("repositories"), "{e}");
}

#[test]
fn one_key_cannot_be_both_admin_and_broker() {
    let n = node(0);
    let mut s = setup(&[&n], None);
    s.config.broker_keys = vec![s.admin.public_b64.clone()];
    let rt = tokio::runtime::Runtime::new().unwrap();
    let e = rt.block_on(cgx_kbs::server::start(&s.config)).unwrap_err();
    assert!(e.to_string().contains("both"), "{e}");
}

/// Someone who can write the database inserts a session row under an id of their choosing,
/// carrying a genuine token copied from another session: the id's MAC is checked before any
/// lookup, so nothing is released (not even a JWE only the victim could open).
#[test]
fn a_session_row_written_into_the_database_is_not_a_session() {
    let n = node(0);
    let mut s = setup(&[&n], None);
    // The mode in which the KBS reads session rows at all.
    s.config.sessions = Some(cgx_kbs::server::config::SessionMode::Database);
    let srv = Server::start(&s.config);
    put_resource(&srv.base, &s.admin, "tenant-a/key/db", b"k", false);
    let mut victim = client(&srv.base);
    let token = victim.attest(&n).unwrap();
    let kek: [u8; 32] = hex::decode(
        std::fs::read_to_string(s.dir.join("kek.hex"))
            .unwrap()
            .trim(),
    )
    .unwrap()
    .try_into()
    .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let forged = "9999999999.00.snp.00000000000000000000000000000000";
    rt.block_on(async {
        let store =
            cgx_kbs::server::store::Store::open(&s.database, &kek, cgx_service::clock::system())
                .await
                .unwrap();
        assert!(
            store
                .record_session(
                    forged,
                    "nonce",
                    "snp",
                    cgx_kbs::server::store::ATTESTED,
                    now() + 300,
                    Some(&token),
                )
                .await
                .unwrap()
        );
        store.close().await;
    });
    let mut resp = agent()
        .get(&format!("{}/kbs/v0/resource/tenant-a/key/db", srv.base))
        .header("cookie", &format!("kbs-session-id={forged}"))
        .call()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let body = json_of(&resp.body_mut().read_to_vec().unwrap());
    assert_eq!(body["code"], "UnAuthenticated", "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("not issued"),
        "{body}"
    );
    // The victim's own session still works.
    assert_eq!(victim.resource("tenant-a/key/db", None).unwrap(), b"k");
    srv.stop();
}

/// A part the appraisal policy left at `none` is not affirming, even under a global release
/// policy that allows everything: the KBS checks every part of the typed result itself.
#[test]
fn every_part_must_be_affirming_whatever_the_release_policy() {
    let n = node(1);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    let base = srv.base.clone();
    // An appraisal policy that affirms CPU evidence and says nothing about GPUs.
    let appraisal = r#"package cgx.appraisal
import rego.v1
result := {"affirming": {"hardware": 2}, "violations": []} if input.kind != "nvidia"
result := {"affirming": {}, "violations": []} if input.kind == "nvidia"
"#;
    let body = json!({"type": "rego", "policy": base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(appraisal)});
    let (st, b) = call(
        "POST",
        &format!("{base}/kbs/v0/attestation-policy"),
        Some(&admin_token(&s.admin)),
        Some(body.to_string().as_bytes()),
    );
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let (st, _) = set_policy(&base, &s.admin, "", "package policy\nallow := true\n");
    assert_eq!(st, 200);
    put_resource(&base, &s.admin, "tenant-a/key/parts", b"k", false);
    let mut c = client(&base);
    c.attest(&n).unwrap();
    let e = c.resource("tenant-a/key/parts", None).unwrap_err();
    assert_eq!(e.kind(), Some("PolicyDeny"), "{e}");
    assert!(e.to_string().contains("gpu0"), "{e}");
    srv.stop();
}

/// A bearer EAR must be one of this KBS's session results: an EAR signed by the same key for
/// another purpose (no challenge nonce, another policy) is refused, even binding a TEE key.
#[test]
fn an_ear_that_is_not_a_session_of_this_kbs_is_refused() {
    use cgx_attestation::results::{Outcome, ResultSigner, Submod, Tier};
    let n = node(0);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    put_resource(&srv.base, &s.admin, "tenant-a/key/bearer", b"k", false);
    let signer = ResultSigner::from_pkcs8(&std::fs::read(s.dir.join("ear.pk8")).unwrap()).unwrap();
    let mut c = client(&srv.base);
    let key = c.tee_key().public().unwrap();
    let node_key = cgx_protocol::jcs::canonical(&serde_json::to_value(&key).unwrap());
    let mut tv = std::collections::BTreeMap::new();
    tv.insert("hardware".to_string(), 2);
    let ok = Outcome {
        status: Tier::Affirming,
        trust_vector: tv,
        violations: vec![],
    };
    let claims: cgx_attestation::Claims = serde_json::from_value(json!({
        "schema": "cgx.claims.v1", "kind": "sample", "sim": false, "debug": false,
        "svn": 1, "report_data": "00"
    }))
    .unwrap();
    let sub = [Submod::of("cpu0", &claims, [0; 32], &ok)];
    for (policy, nonce) in [
        ("cgx.appraisal@sha256:00", Some(&b"0123456789abcdef"[..])),
        ("kbs.appraisal@sha256:00", None),
    ] {
        let ear = signer
            .build(&sub, policy, nonce, Some(node_key.as_bytes()), now())
            .unwrap();
        let token = signer.sign(&ear).unwrap();
        let (st, b) = call(
            "GET",
            &format!("{}/kbs/v0/resource/tenant-a/key/bearer", srv.base),
            Some(&token),
            None,
        );
        assert_eq!(st, 401, "{policy}: {}", String::from_utf8_lossy(&b));
        assert_eq!(json_of(&b)["code"], "TokenInvalid", "{policy}");
    }
    // The KBS's own session EAR, as a bearer token, works.
    let token = c.attest(&n).unwrap();
    let (st, b) = call(
        "GET",
        &format!("{}/kbs/v0/resource/tenant-a/key/bearer", srv.base),
        Some(&token),
        None,
    );
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    srv.stop();
}

#[test]
fn tls_by_default() {
    let n = node(0);
    let mut s = setup(&[&n], None);
    let cert = use_tls(&mut s);
    let srv = Server::start(&s.config);
    let base = srv.base.replace("http://", "https://");
    put_resource_tls(&base, &cert, &s.admin);
    let mut c = KbsClient::with_new_key(&base, Some(cert.as_bytes())).unwrap();
    c.attest(&n).unwrap();
    assert_eq!(c.resource("tenant-a/key/tls", None).unwrap(), b"over tls");
    // A client that does not trust the certificate cannot talk to it.
    let mut stranger = KbsClient::with_new_key(&base, None).unwrap();
    let e = stranger.attest(&n).unwrap_err();
    assert!(
        matches!(e, cgx_kbs::client::ClientError::Transport { .. }),
        "{e}"
    );
    // Plain HTTP to the TLS port fails too.
    let mut plain = KbsClient::with_new_key(&srv.base, None).unwrap();
    assert!(plain.attest(&n).is_err());
    srv.stop();
}

fn put_resource_tls(base: &str, ca: &str, admin: &Ed) {
    let agent =
        cgx_http::Client::service(cgx_http::Roots::from_pem(ca.as_bytes()).unwrap()).agent();
    let r = agent
        .post(&format!("{base}/kbs/v0/resource/tenant-a/key/tls"))
        .header("authorization", &format!("Bearer {}", admin_token(admin)))
        .send(&b"over tls"[..])
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // Tenant A names its requesters: any whose every part is affirming.
    let policy = json!({
        "policy": base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(cgx_policies::RELEASE_POLICY)
    });
    let r = agent
        .post(&format!("{base}/kbs/v0/resource-policy/tenant-a"))
        .header("authorization", &format!("Bearer {}", admin_token(admin)))
        .send(policy.to_string().as_bytes())
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
}

#[test]
fn init_data_must_match_host_data() {
    let n = node(0);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    put_resource(&srv.base, &s.admin, "tenant-a/key/k", b"k", false);
    let body = "version = \"0.1.0\"\nalgorithm = \"sha384\"\n[data]\n\"policy.rego\" = \"allow\"\n";
    let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA384, body.as_bytes());
    let mut host_data = [0u8; 32];
    host_data.copy_from_slice(&digest.as_ref()[..32]);
    let launched = n.with_host_data(host_data);
    let init = cgx_protocol::kbs_types::InitData {
        format: "toml".into(),
        body: body.into(),
    };
    // Matching init-data: released.
    let mut c = client(&srv.base);
    let nonce = c.auth(launched.tee()).unwrap();
    let mut att = c.attestation(&launched, &nonce).unwrap();
    att.init_data = Some(init.clone());
    c.send_attestation(&att).unwrap();
    assert_eq!(c.resource("tenant-a/key/k", None).unwrap(), b"k");
    // Other init-data than the VM was launched with: refused.
    let mut c = client(&srv.base);
    let nonce = c.auth(launched.tee()).unwrap();
    let mut att = c.attestation(&launched, &nonce).unwrap();
    att.init_data = Some(cgx_protocol::kbs_types::InitData {
        format: "toml".into(),
        body: body.replace("allow", "deny"),
    });
    let e = c.send_attestation(&att).unwrap_err();
    assert_eq!(e.kind(), Some("AttestationFailed"), "{e}");
    assert!(e.to_string().contains("init-data"), "{e}");
    // And init-data with a VM launched without it.
    let mut c = client(&srv.base);
    let nonce = c.auth(n.tee()).unwrap();
    let mut att = c.attestation(&n, &nonce).unwrap();
    att.init_data = Some(init);
    assert_eq!(
        c.send_attestation(&att).unwrap_err().kind(),
        Some("AttestationFailed")
    );
    srv.stop();
}

/// A refusal on the wire: RFC 9457 problem details whose `type` is CoCo's, with the stable
/// `code`, and — when the verifier refused the evidence — its own code and the part it refused.
#[test]
fn a_tampered_report_is_refused_as_problem_details_with_the_verifiers_code() {
    use cgx_protocol::kbs::rcar;
    let n = node(0);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    let a = agent();
    let mut resp = a
        .post(&format!("{}{}", srv.base, rcar::AUTH_PATH))
        .send(rcar::auth_body(n.tee()).unwrap())
        .unwrap();
    let cookie = rcar::session_cookie(
        resp.headers()
            .get("set-cookie")
            .and_then(|v| v.to_str().ok()),
    )
    .unwrap();
    let nonce = rcar::challenge(200, &resp.body_mut().read_to_vec().unwrap()).unwrap();
    let key =
        cgx_protocol::kbs::jwe::TeeKey::generate_ec(cgx_protocol::kbs::jwe::Curve::P256).unwrap();
    let mut att = rcar::attestation(&key, &n, &nonce).unwrap();
    // One bit of the report's signature flipped.
    let b64 = att.tee_evidence.primary_evidence["attestation_report"]
        .as_str()
        .unwrap()
        .to_string();
    let mut report = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap();
    report[0x2A0] ^= 1;
    att.tee_evidence.primary_evidence["attestation_report"] =
        json!(base64::engine::general_purpose::STANDARD.encode(&report));
    let mut resp = a
        .post(&format!("{}{}", srv.base, rcar::ATTEST_PATH))
        .header("cookie", &cookie)
        .send(serde_json::to_vec(&att).unwrap())
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "application/problem+json"
    );
    let body = json_of(&resp.body_mut().read_to_vec().unwrap());
    assert_eq!(
        body["type"],
        "https://github.com/confidential-containers/kbs/errors/AttestationFailed"
    );
    assert_eq!(body["code"], "AttestationFailed");
    assert_eq!(body["status"], 401);
    assert_eq!(body["part"], "cpu0");
    assert_eq!(body["evidence_code"], "signature_invalid", "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("signature"),
        "{body}"
    );
    srv.stop();
}

/// Admin tokens: EdDSA only, `exp` and `iat` integers, a capped lifetime, no future `nbf`, no
/// lease claims; scopes are whole repository names; a tenant key reaches nothing global.
#[test]
fn admin_tokens_and_tenant_scopes_are_refused_precisely() {
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let n = node(0);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    let base = srv.base.clone();
    let url = |p: &str| format!("{base}{p}");
    // Every token below is typed a KBS admin token and names the KBS's audience unless it
    // says otherwise.
    let typed = |typ: &str, key: &Ed, mut claims: serde_json::Value| {
        let c = claims.as_object_mut().unwrap();
        if !c.contains_key("aud") {
            c.insert("aud".into(), cgx_service::auth::KBS_ADMIN_AUDIENCE.into());
        }
        if c.get("aud") == Some(&serde_json::Value::Null) {
            c.remove("aud");
        }
        cgx_system_tests::forge(key, json!({"alg": "EdDSA", "typ": typ}), claims)
    };
    let sign = |key: &Ed, claims: serde_json::Value| typed("cgx-kbs-admin+jwt", key, claims);
    let t = now();
    let refused = |token: &str, what: &str| {
        let (st, b) = call(
            "POST",
            &url("/kbs/v0/resource/tenant-a/key/adm"),
            Some(token),
            Some(b"v"),
        );
        assert_eq!(st, 401, "{what}: {}", String::from_utf8_lossy(&b));
        assert_eq!(json_of(&b)["code"], "AdminAuthFailed", "{what}");
    };
    let good = sign(&s.admin, json!({"iat": t, "exp": t + 60}));
    let body = good.split('.').nth(1).unwrap();
    let sig = good.rsplit('.').next().unwrap();
    for alg in ["none", "HS256", "ES256", "Ed25519"] {
        let h = URL_SAFE_NO_PAD.encode(format!(r#"{{"alg":"{alg}","typ":"cgx-kbs-admin+jwt"}}"#));
        refused(&format!("{h}.{body}.{sig}"), alg);
        refused(&format!("{h}.{body}."), alg);
    }
    refused(&sign(&s.admin, json!({"iat": t})), "no exp");
    refused(
        &sign(&s.admin, json!({"iat": t, "exp": (t + 60).to_string()})),
        "string exp",
    );
    refused(&sign(&s.admin, json!({"exp": t + 60})), "no iat");
    refused(
        &sign(&s.admin, json!({"iat": t, "exp": t + 60, "nbf": t + 600})),
        "future nbf",
    );
    refused(
        &sign(&s.admin, json!({"iat": t, "exp": t + 7200})),
        "two hours",
    );
    // Another kind of record, or none, under the admin's own key: a lease, a broker API token,
    // an untyped token (as tokens were before records were typed).
    for typ in ["cgx-lease+jwt", "cgx-broker-api+jwt", "JWT"] {
        refused(&typed(typ, &s.admin, json!({"iat": t, "exp": t + 60})), typ);
    }
    refused(
        &cgx_system_tests::forge(
            &s.admin,
            json!({"alg": "EdDSA"}),
            json!({"iat": t, "exp": t + 60, "aud": cgx_service::auth::KBS_ADMIN_AUDIENCE}),
        ),
        "no typ",
    );
    refused(
        &sign(&s.broker, json!({"iat": t, "exp": t + 60})),
        "a broker's key",
    );
    // Issue 28: a token names the service it is for. Another service's (the broker's API,
    // whose keys may be the same), a lease's, none at all, or a list: refused.
    for aud in [
        json!(cgx_service::auth::BROKER_API_AUDIENCE),
        json!(cgx_protocol::broker::LEASE_AUDIENCE),
        json!(null),
        json!([cgx_service::auth::BROKER_API_AUDIENCE]),
        json!(7),
    ] {
        refused(
            &sign(&s.admin, json!({"iat": t, "exp": t + 60, "aud": aud})),
            &format!("audience {aud}"),
        );
    }
    let (st, _) = call(
        "POST",
        &url("/kbs/v0/resource/tenant-a/key/adm"),
        Some(&good),
        Some(b"v"),
    );
    assert_eq!(st, 200);
    // The tenant key: its own repository only, by whole name, and nothing global.
    let tenant = admin_token(&s.tenant_admin);
    let (st, _) = call(
        "POST",
        &url("/kbs/v0/resource/tenant-a/key/own"),
        Some(&tenant),
        Some(b"v"),
    );
    assert_eq!(st, 200);
    let policy = json!({"policy": URL_SAFE_NO_PAD.encode("package policy\nallow := true\n")});
    for (method, path, body) in [
        (
            "POST",
            "/kbs/v0/resource/tenant-ab/key/x",
            Some(b"v".to_vec()),
        ),
        (
            "POST",
            "/kbs/v0/resource/Tenant-A/key/x",
            Some(b"v".to_vec()),
        ),
        ("DELETE", "/kbs/v0/resource/tenant-b/key/x", None),
        (
            "POST",
            "/kbs/v0/resource-policy/tenant-b",
            Some(policy.to_string().into_bytes()),
        ),
        (
            "POST",
            "/kbs/v0/resource-policy",
            Some(policy.to_string().into_bytes()),
        ),
        ("GET", "/kbs/v0/audit", None),
        (
            "POST",
            "/kbs/v0/attestation-policy",
            Some(policy.to_string().into_bytes()),
        ),
        ("POST", "/kbs/v0/reference-values", Some(b"{}".to_vec())),
        ("GET", "/kbs/v0/reference-values", None),
    ] {
        let (st, b) = call(method, &url(path), Some(&tenant), body.as_deref());
        assert_eq!(st, 401, "{method} {path}: {}", String::from_utf8_lossy(&b));
        assert_eq!(json_of(&b)["code"], "AdminAuthFailed", "{method} {path}");
    }
    srv.stop();
}

/// Leases: typed lease records, the audience this KBS's, the lifetime capped, `iat` required,
/// a tenant named (and the resource's repository its own).
#[test]
fn leases_need_their_audience_and_a_bounded_life() {
    let n = node(0);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    put_resource(&srv.base, &s.admin, "tenant-a/weights/job", b"w", true);
    let mut c = client(&srv.base);
    c.attest(&n).unwrap();
    let me = thumbprint(&c.tee_key().public().unwrap());
    let t = now();
    let lease = |typ: &str, claims: serde_json::Value| {
        cgx_system_tests::forge(&s.broker, json!({"alg": "EdDSA", "typ": typ}), claims)
    };
    let base = json!({"lease": "l-1", "job": "j", "tenant": "tenant-a", "node": "n", "gpus": [],
        "resources": ["tenant-a/weights/job"], "node_key": me, "iss": "cgx-broker",
        "until": t + 600});
    let with = |extra: serde_json::Value| {
        let mut v = base.clone();
        for (k, x) in extra.as_object().unwrap() {
            if x.is_null() {
                v.as_object_mut().unwrap().remove(k);
            } else {
                v[k] = x.clone();
            }
        }
        v
    };
    for (typ, claims, what) in [
        (
            "cgx-lease+jwt",
            with(json!({"iat": t, "exp": t + 60})),
            "no audience",
        ),
        (
            "cgx-lease+jwt",
            with(json!({"aud": "cgx-broker", "iat": t, "exp": t + 60})),
            "another audience",
        ),
        (
            "cgx-lease+jwt",
            with(json!({"aud": "cgx-kbs", "exp": t + 60})),
            "no iat",
        ),
        (
            "cgx-lease+jwt",
            with(json!({"aud": "cgx-kbs", "iat": t, "exp": t + 2 * 86_400})),
            "two days",
        ),
        (
            "cgx-lease+jwt",
            with(json!({"aud": "cgx-kbs", "iat": t, "exp": t + 60, "tenant": null})),
            "no tenant",
        ),
        (
            "cgx-lease+jwt",
            with(json!({"aud": "cgx-kbs", "iat": t, "exp": t + 60, "tenant": "tenant-b"})),
            "another tenant",
        ),
        (
            "JWT",
            with(json!({"aud": "cgx-kbs", "iat": t, "exp": t + 60})),
            "untyped",
        ),
        (
            "cgx-broker-api+jwt",
            with(json!({"aud": "cgx-kbs", "iat": t, "exp": t + 60})),
            "an API token",
        ),
    ] {
        let e = c
            .resource("tenant-a/weights/job", Some(&lease(typ, claims)))
            .unwrap_err();
        assert_eq!(e.kind(), Some("LeaseInvalid"), "{what}: {e}");
    }
    let ok = lease(
        "cgx-lease+jwt",
        with(json!({"aud": ["cgx-kbs"], "iat": t, "exp": t + 60})),
    );
    assert_eq!(c.resource("tenant-a/weights/job", Some(&ok)).unwrap(), b"w");
    srv.stop();
}

/// Someone who can write the database: a flipped lease requirement, a sealed value moved to
/// another path, an older value put back, and a restart under another KEK — each refused, and
/// nothing released.
#[test]
fn a_database_writer_cannot_weaken_move_or_roll_back_a_resource() {
    let n = node(0);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    let base = srv.base.clone();
    // Tenant A names its requesters for every resource of its own, so each request below
    // reaches the sealed value (tenant isolation would refuse it earlier).
    let (st, _) = set_policy(&base, &s.admin, "tenant-a", cgx_policies::RELEASE_POLICY);
    assert_eq!(st, 200);
    put_resource(&base, &s.admin, "tenant-a/weights/job", b"job key", true);
    put_resource(&base, &s.admin, "tenant-a/key/other", b"other", false);
    put_resource(&base, &s.admin, "tenant-a/key/moved", b"moved", false);
    put_resource(&base, &s.admin, "tenant-a/key/roll", b"old", false);
    let rt = tokio::runtime::Runtime::new().unwrap();
    sqlx::any::install_default_drivers();
    let db = rt.block_on(sqlx::AnyPool::connect(&s.database)).unwrap();
    let exec = |sql: &str| {
        rt.block_on(sqlx::query(sqlx::AssertSqlSafe(sql.to_string())).execute(&db))
            .unwrap();
    };
    let mut c = client(&base);
    c.attest(&n).unwrap();
    // The version this replica has seen.
    assert_eq!(c.resource("tenant-a/key/roll", None).unwrap(), b"old");
    let old: Vec<u8> = rt
        .block_on(
            sqlx::query_scalar("SELECT sealed FROM resources WHERE path = 'tenant-a/key/roll'")
                .fetch_one(&db),
        )
        .unwrap();
    put_resource(&base, &s.admin, "tenant-a/key/roll", b"new", false);
    // The writes.
    exec("UPDATE resources SET requires_lease = 0 WHERE path = 'tenant-a/weights/job'");
    exec(
        "UPDATE resources SET sealed = (SELECT sealed FROM resources WHERE path = 'tenant-a/key/other') \
         WHERE path = 'tenant-a/key/moved'",
    );
    rt.block_on(
        sqlx::query("UPDATE resources SET sealed = $1 WHERE path = 'tenant-a/key/roll'")
            .bind(old)
            .execute(&db),
    )
    .unwrap();
    for path in [
        "tenant-a/weights/job",
        "tenant-a/key/moved",
        "tenant-a/key/roll",
    ] {
        let e = c.resource(path, None).unwrap_err();
        assert_eq!(e.status(), Some(500), "{path}: {e}");
        assert_eq!(e.kind(), Some("StorageError"), "{path}: {e}");
    }
    // Untouched values still come out.
    assert_eq!(c.resource("tenant-a/key/other", None).unwrap(), b"other");
    // Policy rows: one written outside the KBS to name requesters for tenant B's resource (with
    // tenant A's MAC, or none), and tenant A's policy body swapped under its MAC — refused,
    // never obeyed.
    put_resource_unnamed(&base, &s.admin, "tenant-b/key/b", b"b", false);
    let e = c.resource("tenant-b/key/b", None).unwrap_err();
    assert_eq!(e.kind(), Some("PolicyDeny"), "{e}");
    // Release policies are cached for a second: each write below is seen after it.
    let cache = || std::thread::sleep(std::time::Duration::from_millis(1100));
    exec(
        "INSERT INTO policies (scope, body, updated_at, mac) SELECT 'resource:tenant-b', \
         'package policy\ndefault allow := true', 0, mac FROM policies WHERE scope = 'resource:tenant-a'",
    );
    cache();
    let e = c.resource("tenant-b/key/b", None).unwrap_err();
    assert_eq!(e.kind(), Some("StorageError"), "{e}");
    exec("UPDATE policies SET mac = NULL WHERE scope = 'resource:tenant-b'");
    cache();
    let e = c.resource("tenant-b/key/b", None).unwrap_err();
    assert_eq!(e.kind(), Some("StorageError"), "{e}");
    exec("DELETE FROM policies WHERE scope = 'resource:tenant-b'");
    exec(
        "UPDATE policies SET body = 'package policy\ndefault allow := true' WHERE scope = 'resource:tenant-a'",
    );
    cache();
    let e = c.resource("tenant-a/key/other", None).unwrap_err();
    assert_eq!(e.kind(), Some("StorageError"), "{e}");
    // The administrator puts it again (a MAC'd row).
    let (st, _) = set_policy(&base, &s.admin, "tenant-a", cgx_policies::RELEASE_POLICY);
    assert_eq!(st, 200);
    cache();
    assert_eq!(c.resource("tenant-a/key/other", None).unwrap(), b"other");
    // An older policy row put back whole (its own valid MAC), and a row removed: refused by
    // a replica that has read the newer one (there is no API that removes a policy).
    let row = |scope: &str| -> (String, String, i64) {
        use sqlx::Row;
        let r = rt
            .block_on(
                sqlx::query("SELECT body, mac, version FROM policies WHERE scope = $1")
                    .bind(scope.to_string())
                    .fetch_one(&db),
            )
            .unwrap();
        (r.get("body"), r.get("mac"), r.get("version"))
    };
    let older = row("resource:tenant-a");
    let tighter = "package policy\ndefault allow := false\nallow if { input.submods.cpu0.ear_status == \"affirming\" }\n";
    let (st, _) = set_policy(&base, &s.admin, "tenant-a", tighter);
    assert_eq!(st, 200);
    cache();
    assert_eq!(c.resource("tenant-a/key/other", None).unwrap(), b"other");
    rt.block_on(
        sqlx::query("UPDATE policies SET body = $1, mac = $2, version = $3 WHERE scope = 'resource:tenant-a'")
            .bind(older.0.clone())
            .bind(older.1.clone())
            .bind(older.2)
            .execute(&db),
    )
    .unwrap();
    cache();
    let e = c.resource("tenant-a/key/other", None).unwrap_err();
    assert_eq!(e.kind(), Some("StorageError"), "older policy row: {e}");
    exec("DELETE FROM policies WHERE scope = 'resource:tenant-a'");
    cache();
    let e = c.resource("tenant-a/key/other", None).unwrap_err();
    assert_eq!(e.kind(), Some("StorageError"), "removed policy row: {e}");
    let (st, _) = set_policy(&base, &s.admin, "tenant-a", cgx_policies::RELEASE_POLICY);
    assert_eq!(st, 200);
    rt.block_on(db.close());
    srv.stop();
    // A restart: the new process remembers nothing, the version file (outside the database)
    // does — the older value is still refused. The old value opens under its AAD, so the
    // version is the only thing that refuses it: without the file it would be released.
    let roll = |config: &cgx_kbs::server::config::KbsConfig| {
        let srv = Server::start(config);
        let mut c = client(&srv.base);
        c.attest(&n).unwrap();
        let r = c.resource("tenant-a/key/roll", None);
        srv.stop();
        r
    };
    let e = roll(&s.config).unwrap_err();
    assert_eq!(e.kind(), Some("StorageError"), "{e}");
    let mut forgetful = s.config.clone();
    forgetful.version_file = Some(s.dir.join("elsewhere.versions"));
    let e = rt.block_on(cgx_kbs::server::start(&forgetful)).unwrap_err();
    assert!(e.to_string().contains("is missing"), "{e}");
    forgetful.accept_new_version_file = true;
    assert_eq!(
        roll(&forgetful).unwrap(),
        b"old",
        "a new replica, told it knows nothing"
    );
    // The marks cannot be lowered by editing the file.
    let marks = s.dir.join("kbs.versions");
    let text = std::fs::read_to_string(&marks).unwrap();
    let mut lowered = json_of(text.as_bytes());
    lowered["versions"]["tenant-a/key/roll"] = json!(1);
    std::fs::write(&marks, lowered.to_string()).unwrap();
    let e = rt.block_on(cgx_kbs::server::start(&s.config)).unwrap_err();
    assert!(e.to_string().contains("MAC"), "{e}");
    std::fs::write(&marks, text).unwrap();
    // Another KEK: the KBS does not start on this database.
    std::fs::write(s.dir.join("kek.hex"), hex::encode([0x42u8; 32])).unwrap();
    let e = rt.block_on(cgx_kbs::server::start(&s.config)).unwrap_err();
    assert!(e.to_string().contains("key-encryption key"), "{e}");
}

/// An administrator's change and its audit row commit together: when the audit row cannot be
/// written, the change is not made either.
#[test]
fn an_admin_change_lands_with_its_audit_row_or_not_at_all() {
    let n = node(0);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    let (st, _) = set_policy(
        &srv.base,
        &s.admin,
        "tenant-a",
        cgx_policies::RELEASE_POLICY,
    );
    assert_eq!(st, 200);
    let rt = tokio::runtime::Runtime::new().unwrap();
    sqlx::any::install_default_drivers();
    let db = rt.block_on(sqlx::AnyPool::connect(&s.database)).unwrap();
    let exec = |sql: &'static str| {
        rt.block_on(sqlx::query(sql).execute(&db)).unwrap();
    };
    exec("ALTER TABLE audit RENAME TO audit_away");
    let (st, b) = call(
        "POST",
        &format!("{}/kbs/v0/resource/tenant-a/key/atomic", srv.base),
        Some(&admin_token(&s.admin)),
        Some(b"v"),
    );
    assert_eq!(st, 500, "{}", String::from_utf8_lossy(&b));
    let detail = json_of(&b)["detail"].as_str().unwrap().to_string();
    assert!(
        !detail.contains("audit"),
        "no internals on the wire: {detail}"
    );
    exec("ALTER TABLE audit_away RENAME TO audit");
    let mut c = client(&srv.base);
    c.attest(&n).unwrap();
    let e = c.resource("tenant-a/key/atomic", None).unwrap_err();
    assert_eq!(e.kind(), Some("ResourceNotFound"), "{e}");
    rt.block_on(db.close());
    srv.stop();
}

/// Body limits come before parsing and before authentication: an oversized `auth` body, and an
/// unauthenticated upload declaring more than any resource may be, are refused 413 unread.
#[test]
fn oversized_bodies_are_refused_before_parsing_or_authentication() {
    use std::io::{Read, Write};
    let n = node(0);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    let addr = srv.base.trim_start_matches("http://").to_string();
    let ask = |head: String| {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        c.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        c.write_all(head.as_bytes()).unwrap();
        let mut out = String::new();
        let _ = c.read_to_string(&mut out);
        out
    };
    let big_auth = ask(format!(
        "POST /kbs/v0/auth HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: 8192\r\n\r\n{}",
        " ".repeat(8192)
    ));
    assert!(big_auth.starts_with("HTTP/1.1 413"), "{big_auth}");
    let upload = ask(
        "POST /kbs/v0/resource/tenant-a/key/huge HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 17000000\r\n\r\n"
            .to_string(),
    );
    assert!(upload.starts_with("HTTP/1.1 413"), "not a 401: {upload}");
    assert!(upload.contains("PayloadTooLarge"), "{upload}");
    srv.stop();
}

/// Tenants are isolated by default: an affirming requester gets a resource only when the
/// resource's tenant names it — a lease for it, or a release policy on its repository or on the
/// resource. The global policy speaks for every tenant, so it names nobody, even one that allows
/// everything. `tenant_isolation = false` is Trustee's single-tenant model.
#[test]
fn tenants_are_isolated_by_default() {
    let n = node(0);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    let base = srv.base.clone();
    for (path, v) in [
        ("tenant-a/key/k", b"a"),
        ("tenant-b/key/k", b"b"),
        ("tenant-c/job/w", b"w"),
    ] {
        put_resource_unnamed(&base, &s.admin, path, v, false);
    }
    let mut c = client(&base);
    c.attest(&n).unwrap();
    let isolated = |c: &mut KbsClient, path: &str, lease: Option<&str>| {
        let e = c.resource(path, lease).unwrap_err();
        assert_eq!(e.kind(), Some("PolicyDeny"), "{path}: {e}");
        assert!(e.to_string().contains("tenant isolation"), "{path}: {e}");
    };
    // Affirming, no lease, no policy of the tenant's: refused, saying why.
    isolated(&mut c, "tenant-a/key/k", None);
    // A global policy that allows everything names nobody.
    let (st, b) = set_policy(
        &base,
        &s.admin,
        "",
        "package policy\ndefault allow := true\n",
    );
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    isolated(&mut c, "tenant-a/key/k", None);
    // Tenant A's administrator names requesters for tenant A's repository: A's resource is
    // released, B's still is not, and A's administrator cannot name requesters for B.
    let (st, b) = set_policy(
        &base,
        &s.tenant_admin,
        "tenant-a",
        cgx_policies::RELEASE_POLICY,
    );
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    assert_eq!(c.resource("tenant-a/key/k", None).unwrap(), b"a");
    isolated(&mut c, "tenant-b/key/k", None);
    for scope in ["tenant-b", "tenant-b/key/k"] {
        let (st, _) = set_policy(&base, &s.tenant_admin, scope, cgx_policies::RELEASE_POLICY);
        assert_ne!(st, 200, "tenant A's key on {scope}");
    }
    isolated(&mut c, "tenant-b/key/k", None);
    // A policy on one resource names requesters for that resource only.
    let (st, _) = set_policy(
        &base,
        &s.admin,
        "tenant-b/key/k",
        cgx_policies::RELEASE_POLICY,
    );
    assert_eq!(st, 200);
    assert_eq!(c.resource("tenant-b/key/k", None).unwrap(), b"b");
    // A lease names its node without any policy of the tenant's.
    isolated(&mut c, "tenant-c/job/w", None);
    let me = thumbprint(&c.tee_key().public().unwrap());
    let l = lease(&s.broker, "l-1", &["tenant-c/job/w"], &me, now() + 60);
    assert_eq!(c.resource("tenant-c/job/w", Some(&l)).unwrap(), b"w");
    srv.stop();

    // Trustee's model: the global policy alone releases (same database, isolation off).
    let mut open = s.config.clone();
    open.tenant_isolation = false;
    let srv = Server::start(&open);
    let mut c = client(&srv.base);
    c.attest(&n).unwrap();
    assert_eq!(c.resource("tenant-c/job/w", None).unwrap(), b"w");
    srv.stop();
}

/// Release policies written for Trustee run unchanged: its data (`plugin`, `resource-path` as
/// segments, `query`) is given per request, and each part of the EAR carries Trustee's dotted
/// claim names too, so a policy checking `ear.status` checks it rather than finding nothing.
#[test]
fn trustee_release_policies_see_what_they_see_on_trustee() {
    let n = node(1);
    let s = setup(&[&n], None);
    let srv = Server::start(&s.config);
    let base = srv.base.clone();
    put_resource(&base, &s.admin, "tenant-a/key/k", b"k", false);
    let mut c = client(&base);
    c.attest(&n).unwrap();
    let release = |rego: &str, query: &str| {
        let (st, b) = set_policy(&base, &s.admin, "tenant-a", rego);
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
        let (st, b) = call(
            "GET",
            &format!("{base}/kbs/v0/resource/tenant-a/key/k{query}"),
            Some(c.token().unwrap()),
            None,
        );
        (st, String::from_utf8_lossy(&b).to_string())
    };
    // kbs-client's `--allow-all` shape: allow the resource plugin.
    let allow_all = "package policy\ndefault allow = false\nplugin = data.plugin\nallow if {\n\tplugin == \"resource\"\n}\n";
    let (st, b) = release(allow_all, "");
    assert_eq!(st, 200, "{b}");
    // Its `--affirming` shape allows. (It cannot deny here: release already requires every part
    // affirming, and a missing `ear.status` would make it allow too — `reads_status` below is
    // what fails when the dotted names are missing.)
    let affirming = r#"package policy
import rego.v1
default allow = false
allow if {
    not any_not_affirming
    count(input.submods) > 0
}
any_not_affirming if {
    some _, submod in input.submods
    submod["ear.status"] != "affirming"
}
"#;
    assert_eq!(release(affirming, "").0, 200);
    let reads_status = "package policy\nimport rego.v1\nallow if input.submods.gpu0[\"ear.status\"] == \"affirming\"\nallow if false\n";
    assert_eq!(release(reads_status, "").0, 200);
    let reads_vector = "package policy\nimport rego.v1\nallow if {\n input.submods.cpu0[\"ear.trustworthiness-vector\"].hardware >= 2\n input.submods.cpu0[\"ear.trustworthiness-vector\"][\"file-system\"] == 0\n}\n";
    assert_eq!(release(reads_vector, "").0, 200);
    // The path as segments and the query, as Trustee parses them.
    let by_path = r#"package policy
import rego.v1
default allow := false
allow if {
    data["resource-path"] == ["tenant-a", "key", "k"]
    data.query.version == "2"
}
"#;
    assert_eq!(release(by_path, "?version=2").0, 200);
    let (st, b) = release(by_path, "?version=1");
    assert_eq!(st, 401, "{b}");
    assert!(b.contains("PolicyDeny"), "{b}");
    // The data is per request: another resource's path is not this one's.
    put_resource(&base, &s.admin, "tenant-a/key/other", b"o", false);
    let (st, b) = call(
        "GET",
        &format!("{base}/kbs/v0/resource/tenant-a/key/other?version=2"),
        Some(c.token().unwrap()),
        None,
    );
    assert_eq!(st, 401, "{}", String::from_utf8_lossy(&b));
    // `--deny-all`: denied.
    assert_eq!(
        release("package policy\ndefault allow = false\n", "").0,
        401
    );
    srv.stop();
}

/// CoCo's sample CPU and device evidence, with the reference values that affirm them.
struct SampleVm {
    /// The sample device's report data: `None` binds the session, `Some` sends these bytes.
    device: Option<Option<Vec<u8>>>,
}

impl cgx_protocol::kbs::rcar::EvidenceSource for SampleVm {
    fn tee(&self) -> cgx_protocol::kbs_types::Tee {
        cgx_protocol::kbs_types::Tee::Sample
    }
    fn additional_evidence(
        &self,
        nonce: &str,
        key: &cgx_protocol::kbs_types::TeePubKey,
    ) -> Result<String, cgx_kbs::client::ClientError> {
        let Some(device) = &self.device else {
            return Ok(String::new());
        };
        let rd = device
            .clone()
            .unwrap_or_else(|| cgx_protocol::kbs::binding::device_report_data(nonce, key).to_vec());
        let b64 = base64::engine::general_purpose::STANDARD;
        Ok(json!({"sampledevice": {"svn": "2", "report_data": b64.encode(rd)}}).to_string())
    }
    fn primary_evidence(
        &self,
        rd: &[u8; 64],
    ) -> Result<serde_json::Value, cgx_kbs::client::ClientError> {
        let b64 = base64::engine::general_purpose::STANDARD;
        Ok(json!({"svn": "1", "report_data": b64.encode(&rd[..48])}))
    }
}

/// Sample reference values through Trustee's `/kbs/v0/reference-value`, and every way that path
/// and sample device evidence must fail.
#[test]
fn sample_reference_values_and_device_evidence_are_checked() {
    let n = node(0);
    let mut s = setup(&[&n], None);
    s.config.allow_sample = true;
    let srv = Server::start(&s.config);
    let base = srv.base.clone();
    put_resource(&base, &s.admin, "tenant-a/key/k", b"k", false);
    let (st, _) = set_policy(
        &base,
        &s.admin,
        "tenant-a",
        "package policy\nallow := true\n",
    );
    assert_eq!(st, 200);
    let b64 = base64::engine::general_purpose::STANDARD;
    let message = |kind: &str, version: &str, payload: &str| {
        json!({"version": version, "type": kind, "payload": payload}).to_string()
    };
    let post = |token: &str, body: &str| {
        let (st, b) = call(
            "POST",
            &format!("{base}/kbs/v0/reference-value"),
            Some(token),
            Some(body.as_bytes()),
        );
        (st, String::from_utf8_lossy(&b).to_string())
    };
    let admin = admin_token(&s.admin);
    let svn = b64.encode(br#"{"svn": ["1"]}"#);
    // Refused: a tenant's admin, another extractor, another version, not base64, not an object.
    assert_eq!(
        post(
            &admin_token(&s.tenant_admin),
            &message("sample", "0.1.0", &svn)
        )
        .0,
        401
    );
    for (body, why) in [
        (message("sample_ext", "0.1.0", &svn), "sample extractor"),
        (message("sample", "0.2.0", &svn), "0.1.0"),
        (message("sample", "0.1.0", "%%%"), "base64"),
        (message("sample", "0.1.0", &b64.encode("[1]")), "payload"),
        ("{}".to_string(), "version"),
    ] {
        let (st, b) = post(&admin, &body);
        assert_eq!(st, 400, "{b}");
        assert!(b.contains(why), "{why}: {b}");
    }
    // Before: sample evidence is contraindicated.
    let mut c = client(&base);
    c.attest(&SampleVm { device: None }).unwrap();
    let e = c.resource("tenant-a/key/k", None).unwrap_err();
    assert!(e.to_string().contains("contraindicated"), "{e}");
    // Set, read back, and the sample VM is affirming; a merge keeps earlier names.
    assert_eq!(post(&admin, &message("sample", "0.1.0", &svn)).0, 200);
    let other = b64.encode(br#"{"launch_digest": "abcde"}"#);
    assert_eq!(post(&admin, &message("sample", "0.1.0", &other)).0, 200);
    let (st, b) = call(
        "GET",
        &format!("{base}/kbs/v0/reference-value/svn"),
        Some(&admin),
        None,
    );
    assert_eq!((st, json_of(&b)), (200, json!(["1"])));
    let (st, _) = call(
        "GET",
        &format!("{base}/kbs/v0/reference-value/nope"),
        Some(&admin),
        None,
    );
    assert_eq!(st, 404);
    let (st, _) = call(
        "GET",
        &format!("{base}/kbs/v0/reference-value/svn"),
        Some(&admin_token(&s.tenant_admin)),
        None,
    );
    assert_eq!(st, 401);
    let mut c = client(&base);
    c.attest(&SampleVm { device: None }).unwrap();
    assert_eq!(c.resource("tenant-a/key/k", None).unwrap(), b"k");
    // Setting the other reference values whole keeps the sample section in force.
    let (st, b) = call(
        "GET",
        &format!("{base}/kbs/v0/reference-values"),
        Some(&admin),
        None,
    );
    assert_eq!(st, 200);
    let mut refs = json_of(&b);
    assert_eq!(refs["sample"]["svn"], json!(["1"]), "{refs}");
    refs["sample"] = json!({});
    let (st, _) = call(
        "POST",
        &format!("{base}/kbs/v0/reference-values"),
        Some(&admin),
        Some(refs.to_string().as_bytes()),
    );
    assert_eq!(st, 200);
    let mut c = client(&base);
    c.attest(&SampleVm { device: None }).unwrap();
    assert_eq!(c.resource("tenant-a/key/k", None).unwrap(), b"k");
    // Sample device evidence bound to another session (or to nothing) is refused at attest.
    let mut c = client(&base);
    let e = c
        .attest(&SampleVm {
            device: Some(Some(vec![7; 48])),
        })
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("sampledevice report_data does not bind"),
        "{e}"
    );
    // Bound: part gpu0, contraindicated until its svn is listed.
    let mut c = client(&base);
    c.attest(&SampleVm { device: Some(None) }).unwrap();
    let e = c.resource("tenant-a/key/k", None).unwrap_err();
    assert!(e.to_string().contains("contraindicated"), "{e}");
    // A sample session is honoured only by a KBS that takes sample evidence: a replica on the
    // same database and result key without allow_sample refuses it.
    let mut c = client(&base);
    c.attest(&SampleVm { device: None }).unwrap();
    let mut strict = s.config.clone();
    strict.allow_sample = false;
    let b = Server::start(&strict);
    let (st, body) = call(
        "GET",
        &format!("{}/kbs/v0/resource/tenant-a/key/k", b.base),
        c.token(),
        None,
    );
    let body = String::from_utf8_lossy(&body);
    assert_eq!(st, 401, "{body}");
    assert!(
        body.contains("sample evidence, which this KBS does not take"),
        "{body}"
    );
    b.stop();
    srv.stop();

    // An SNP VM smuggling sample device evidence: refused (only a sample VM's is read so).
    struct Smuggler<'a>(&'a cgx_kbs::sim::SimNode);
    impl cgx_protocol::kbs::rcar::EvidenceSource for Smuggler<'_> {
        fn tee(&self) -> cgx_protocol::kbs_types::Tee {
            self.0.tee()
        }
        fn additional_evidence(
            &self,
            nonce: &str,
            key: &cgx_protocol::kbs_types::TeePubKey,
        ) -> Result<String, cgx_kbs::client::ClientError> {
            SampleVm { device: Some(None) }.additional_evidence(nonce, key)
        }
        fn primary_evidence(
            &self,
            rd: &[u8; 64],
        ) -> Result<serde_json::Value, cgx_kbs::client::ClientError> {
            self.0.primary_evidence(rd)
        }
    }
    let srv = Server::start(&s.config);
    let mut c = client(&srv.base);
    let e = c.attest(&Smuggler(&n)).unwrap_err();
    assert!(e.to_string().contains("nvidia"), "{e}");
    srv.stop();
}
