#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Helpers of the whole-system tests (this crate's `tests` targets): the development network's KBS (`cgx-devnet`: 127.0.0.1:0, SQLite or `CGX_TEST_DATABASE_URL`'s
//! PostgreSQL, simulated nodes, admin and broker keys) and small HTTP helpers.

use std::path::{Path, PathBuf};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use cgx_kbs::server::config::KbsConfig;
use cgx_kbs::sim::SimNode;
use serde_json::{Value, json};

pub use cgx_devnet::{Ed, Setup, now};

pub fn tmp(name: &str) -> PathBuf {
    cgx_devnet::temp_dir(name).unwrap()
}

pub fn node(gpus: usize) -> SimNode {
    cgx_devnet::node(gpus).unwrap()
}

pub fn ed25519() -> Ed {
    Ed::generate().unwrap()
}

pub fn setup(nodes: &[&SimNode], database: Option<String>) -> Setup {
    cgx_devnet::setup(nodes, database).unwrap()
}

/// A KBS on its own runtime (the development network's); shut down on drop.
#[derive(Debug)]
pub struct Server {
    pub base: String,
    inner: cgx_devnet::Server,
}

impl Server {
    pub fn start(config: &KbsConfig) -> Server {
        let inner = cgx_devnet::Server::start(config).unwrap();
        Server {
            base: inner.base.clone(),
            inner,
        }
    }

    pub fn start_with_clock(config: &KbsConfig, clock: cgx_service::SharedClock) -> Server {
        let inner = cgx_devnet::Server::start_with_clock(config, clock).unwrap();
        Server {
            base: inner.base.clone(),
            inner,
        }
    }

    pub fn stop(self) {
        self.inner.stop();
    }
}

/// Serve `s`'s KBS over TLS with a fresh self-signed certificate for localhost and 127.0.0.1,
/// written beside its other files (`tls.crt`, `tls.key`); returns the certificate's PEM.
pub fn use_tls(s: &mut Setup) -> String {
    let (cert, key) = cgx_service::tls::self_signed(&["localhost", "127.0.0.1"]).unwrap();
    std::fs::write(s.dir.join("tls.crt"), &cert).unwrap();
    std::fs::write(s.dir.join("tls.key"), &key).unwrap();
    s.config.insecure_dev = false;
    s.config.tls = Some(cgx_kbs::server::config::TlsConfig {
        cert: s.dir.join("tls.crt"),
        key: s.dir.join("tls.key"),
    });
    cert
}

pub fn admin_token(key: &Ed) -> String {
    key.admin_token().unwrap()
}

/// The agent the services' own clients use ([`cgx_http::Client::service`], WebPKI roots).
pub fn agent() -> ureq::Agent {
    cgx_http::Client::service(cgx_http::Roots::WebPki).agent()
}

/// (status, body) of an HTTP call.
pub fn call(method: &str, url: &str, token: Option<&str>, body: Option<&[u8]>) -> (u16, Vec<u8>) {
    let a = agent();
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut resp = match (method, body) {
        ("GET", _) => {
            let mut r = a.get(url);
            if let Some(h) = &auth {
                r = r.header("authorization", h);
            }
            r.call()
        }
        ("DELETE", _) => {
            let mut r = a.delete(url);
            if let Some(h) = &auth {
                r = r.header("authorization", h);
            }
            r.call()
        }
        (_, b) => {
            let mut r = a.post(url);
            if let Some(h) = &auth {
                r = r.header("authorization", h);
            }
            r.send(b.unwrap_or_default())
        }
    }
    .unwrap();
    let status = resp.status().as_u16();
    (status, resp.body_mut().read_to_vec().unwrap())
}

/// Store a resource. `lease`: a job resource (released with a lease only). Otherwise its tenant
/// names its requesters with a policy on the resource — the shipped default, any requester
/// whose every part is affirming — as tenant isolation requires; [`put_resource_unnamed`]
/// stores one without.
pub fn put_resource(base: &str, admin: &Ed, path: &str, value: &[u8], lease: bool) {
    put_resource_unnamed(base, admin, path, value, lease);
    if !lease {
        let (s, b) = set_policy(base, admin, path, cgx_policies::RELEASE_POLICY);
        assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    }
}

/// Store a resource with no release policy of its tenant.
pub fn put_resource_unnamed(base: &str, admin: &Ed, path: &str, value: &[u8], lease: bool) {
    let q = if lease {
        "?lease=required"
    } else {
        "?lease=optional"
    };
    let (s, b) = call(
        "POST",
        &format!("{base}/kbs/v0/resource/{path}{q}"),
        Some(&admin_token(admin)),
        Some(value),
    );
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
}

pub fn set_policy(base: &str, admin: &Ed, scope: &str, rego: &str) -> (u16, Vec<u8>) {
    let url = if scope.is_empty() {
        format!("{base}/kbs/v0/resource-policy")
    } else {
        format!("{base}/kbs/v0/resource-policy/{scope}")
    };
    let body = json!({"policy": URL_SAFE_NO_PAD.encode(rego)}).to_string();
    call(
        "POST",
        &url,
        Some(&admin_token(admin)),
        Some(body.as_bytes()),
    )
}

pub fn lease(broker: &Ed, lease: &str, resources: &[&str], node_key: &str, exp: i64) -> String {
    broker.lease(lease, resources, node_key, exp).unwrap()
}

/// A typed lease record for `tenant`, signed by `broker` (issued a second ago).
pub fn lease_for(
    broker: &Ed,
    tenant: &str,
    lease: &str,
    resources: &[&str],
    node_key: &str,
    exp: i64,
) -> String {
    let now = cgx_devnet::now();
    broker
        .lease_for(tenant, lease, resources, node_key, now - 1, exp)
        .unwrap()
}

/// A compact JWS with any header and claims, signed EdDSA by `key`: what an attacker holding a
/// key (or a careless issuer) could make, for the tests that show it refused.
pub fn forge(key: &Ed, header: Value, claims: Value) -> String {
    let m = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header.to_string()),
        URL_SAFE_NO_PAD.encode(claims.to_string())
    );
    let pair = aws_lc_rs::signature::Ed25519KeyPair::from_pkcs8(&key.pkcs8).unwrap();
    let sig = pair.sign(m.as_bytes());
    format!("{m}.{}", URL_SAFE_NO_PAD.encode(sig.as_ref()))
}

pub fn json_of(b: &[u8]) -> Value {
    serde_json::from_slice(b).unwrap_or(Value::Null)
}

pub fn skip(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

pub fn exists(p: &Path) -> bool {
    p.exists()
}

/// The OpenAPI contract of a service at `base`, its document at `doc_path`: the document
/// parses as OpenAPI 3.1 (utoipa's model of it) and every `$ref` in it resolves; its paths are
/// exactly `expected` (the routes the router is built with); every operation answers each
/// status with a schema — a problem-details response for refusals — except the successes
/// `bodiless` names (method, path: an empty 200), and takes a request body with a schema
/// unless `no_body` names it or it is a GET or DELETE; every operation is served (asked
/// without credentials, each answers one of its documented statuses, never the router's
/// fallback 404 or a 405); and no method the document does not list is served on a documented
/// path (405). The parsed document.
pub fn openapi_contract(
    base: &str,
    doc_path: &str,
    expected: &[&str],
    bodiless: &[(&str, &str)],
    no_body: &[(&str, &str)],
) -> serde_json::Value {
    let (s, body) = call("GET", &format!("{base}{doc_path}"), None, None);
    assert_eq!(s, 200);
    let typed: Result<utoipa::openapi::OpenApi, _> = serde_json::from_slice(&body);
    assert!(typed.is_ok(), "not an OpenAPI document: {:?}", typed.err());
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(
        doc["openapi"].as_str().unwrap().starts_with("3.1"),
        "{}",
        doc["openapi"]
    );
    // Every reference resolves.
    fn refs(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(r) = m.get("$ref").and_then(|r| r.as_str()) {
                    out.push(r.to_string());
                }
                m.values().for_each(|v| refs(v, out));
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| refs(v, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    refs(&doc, &mut all);
    assert!(!all.is_empty());
    for r in &all {
        let pointer = r
            .strip_prefix('#')
            .unwrap_or_else(|| panic!("external ref {r}"));
        assert!(doc.pointer(pointer).is_some(), "unresolved {r}");
    }
    let paths = doc["paths"].as_object().unwrap();
    let mut documented: Vec<&str> = paths.keys().map(String::as_str).collect();
    let mut wanted = expected.to_vec();
    documented.sort_unstable();
    wanted.sort_unstable();
    assert_eq!(documented, wanted, "documented paths ≠ routes");
    let resolve = |v: &serde_json::Value| -> serde_json::Value {
        match v.get("$ref").and_then(|r| r.as_str()) {
            Some(r) => doc.pointer(&r[1..]).cloned().unwrap(),
            None => v.clone(),
        }
    };
    let url_of = |path: &str| {
        format!("{base}{path}")
            .replace("{id}", "x1")
            .replace("{repo}", "r")
            .replace("{kind}", "k")
            .replace("{tag}", "t")
    };
    for (path, item) in paths {
        // Methods the document does not list are not served there.
        for m in ["GET", "POST", "DELETE"] {
            if item.get(m.to_lowercase()).is_none() {
                let (s, body) = call(m, &url_of(path), None, Some(b"{}"));
                assert_eq!(
                    s,
                    405,
                    "{m} {path} is served but not documented: {}",
                    String::from_utf8_lossy(&body)
                );
            }
        }
        for (method, op) in item.as_object().unwrap() {
            if !["get", "post", "put", "delete", "patch"].contains(&method.as_str()) {
                continue;
            }
            let m = method.to_uppercase();
            let here = format!("{m} {path}");
            let responses = op["responses"]
                .as_object()
                .unwrap_or_else(|| panic!("{here}"));
            assert!(
                responses.keys().any(|k| k.starts_with('2')),
                "{here}: no success"
            );
            for (status, r) in responses {
                let r = resolve(r);
                let with_schema = r["content"]
                    .as_object()
                    .is_some_and(|c| !c.is_empty() && c.values().all(|m| m["schema"].is_object()));
                let named = bodiless.contains(&(m.as_str(), path.as_str()));
                if status.starts_with('2') && named {
                    continue;
                }
                assert!(with_schema, "{here} {status}: no response schema");
                if !status.starts_with('2') {
                    assert!(
                        r["content"]["application/problem+json"].is_object(),
                        "{here} {status}: a refusal is not problem details"
                    );
                }
            }
            if m == "POST" && !no_body.contains(&(m.as_str(), path.as_str())) {
                let b = resolve(&op["requestBody"]);
                assert!(
                    b["content"].as_object().is_some_and(
                        |c| !c.is_empty() && c.values().all(|m| m["schema"].is_object())
                    ),
                    "{here}: no request body schema"
                );
            }
            // Served, with a documented answer: never the fallback's 404 nor a 405.
            let (s, body) = call(&m, &url_of(path), None, Some(b"{}"));
            let text = String::from_utf8_lossy(&body);
            assert!(
                s != 405 && !(s == 404 && text.contains("no such endpoint")),
                "{here} is documented but not served: {s} {text}"
            );
            assert!(
                responses.contains_key(&s.to_string()),
                "{here} answered {s}, which it does not document: {text}"
            );
        }
    }
    doc
}
