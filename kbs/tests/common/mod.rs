#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]
//! A KBS on 127.0.0.1:0 with SQLite (or `CGX_TEST_DATABASE_URL`'s PostgreSQL), simulated nodes,
//! admin and broker keys, and small HTTP helpers.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use aws_lc_rs::signature::{Ed25519KeyPair, KeyPair};
use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use cgx_kbs::server::config::{AdminKey, AppraisalConfig, KbsConfig, KekSource};
use cgx_kbs::server::{Running, start};
use cgx_kbs::sim::SimNode;
use serde_json::{Value, json};

pub const MEASUREMENT: [u8; 48] = [0x5A; 48];

pub fn now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

pub fn tmp(name: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let p = std::env::temp_dir().join(format!(
        "cgx-kbs-{}-{}-{name}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

pub fn node(gpus: usize) -> SimNode {
    SimNode::generate(gpus, MEASUREMENT, now()).unwrap()
}

pub struct Ed {
    pub pkcs8: Vec<u8>,
    pub public_b64: String,
}

pub fn ed25519() -> Ed {
    let doc = Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new()).unwrap();
    let kp = Ed25519KeyPair::from_pkcs8(doc.as_ref()).unwrap();
    Ed {
        pkcs8: doc.as_ref().to_vec(),
        public_b64: STANDARD.encode(kp.public_key().as_ref()),
    }
}

/// Everything a test KBS needs, kept so a second replica or a restart shares it.
pub struct Setup {
    pub dir: PathBuf,
    pub database: String,
    pub admin: Ed,
    pub tenant_admin: Ed,
    pub broker: Ed,
    pub pins: Vec<[u8; 32]>,
    pub config: KbsConfig,
}

pub fn setup(nodes: &[&SimNode], database: Option<String>) -> Setup {
    let dir = tmp("kbs");
    std::fs::write(dir.join("kek.hex"), hex::encode([0x11u8; 32])).unwrap();
    let doc = aws_lc_rs::signature::EcdsaKeyPair::generate_pkcs8(
        &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
        &aws_lc_rs::rand::SystemRandom::new(),
    )
    .unwrap();
    std::fs::write(dir.join("ear.pk8"), doc.as_ref()).unwrap();
    let refs = json!({
        "allow_sim": "affirming",
        "snp": {"measurements": [hex::encode(MEASUREMENT)]},
        "nvidia": {"require_ocsp": false}
    });
    std::fs::write(dir.join("refs.json"), refs.to_string()).unwrap();
    let database = database.unwrap_or_else(|| format!("sqlite://{}", dir.join("kbs.db").display()));
    let admin = ed25519();
    let tenant_admin = ed25519();
    let broker = ed25519();
    let pins: Vec<[u8; 32]> = nodes.iter().flat_map(|n| n.root_pins()).collect();
    let config = KbsConfig {
        listen: "127.0.0.1:0".into(),
        tls: None,
        insecure_dev: true,
        database: database.clone(),
        kek: KekSource::File(dir.join("kek.hex")),
        admin_keys: vec![
            AdminKey {
                public_key: admin.public_b64.clone(),
                repositories: vec!["*".into()],
            },
            AdminKey {
                public_key: tenant_admin.public_b64.clone(),
                repositories: vec!["tenant-a".into()],
            },
        ],
        broker_keys: vec![broker.public_b64.clone()],
        result_key: Some(dir.join("ear.pk8")),
        sim_roots: pins.iter().map(hex::encode).collect(),
        allow_sample: false,
        nonce_ttl_secs: 60,
        session_ttl_secs: 300,
        collateral: Default::default(),
        appraisal: AppraisalConfig {
            policy: None,
            reference_values: Some(dir.join("refs.json")),
        },
    };
    Setup {
        dir,
        database,
        admin,
        tenant_admin,
        broker,
        pins,
        config,
    }
}

/// A KBS on its own runtime; shut down on drop.
pub struct Server {
    pub base: String,
    rt: tokio::runtime::Runtime,
    running: Option<Running>,
}

impl Server {
    pub fn start(config: &KbsConfig) -> Server {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let running = rt.block_on(start(config)).unwrap();
        Server {
            base: format!("http://{}", running.addr),
            rt,
            running: Some(running),
        }
    }

    pub fn stop(mut self) {
        if let Some(r) = self.running.take() {
            self.rt.block_on(r.shutdown());
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            self.rt.block_on(r.shutdown());
        }
    }
}

pub fn admin_token(key: &Ed) -> String {
    cgx_kbs::server::jwt::sign_eddsa(&key.pkcs8, &json!({"iat": now(), "exp": now() + 300}))
        .unwrap()
}

pub fn agent() -> ureq::Agent {
    ureq::Agent::new_with_config(
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build(),
    )
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

pub fn put_resource(base: &str, admin: &Ed, path: &str, value: &[u8], lease: bool) {
    let q = if lease { "?lease=required" } else { "" };
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
    cgx_kbs::server::jwt::sign_eddsa(
        &broker.pkcs8,
        &json!({"lease": lease, "resources": resources, "node_key": node_key,
                "iat": now(), "exp": exp}),
    )
    .unwrap()
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
