#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! `cgx-guest-agent fetch-weights` against a KBS on loopback: a job's weights identity is
//! released only with a lease for this node's key, and age files from our encryptor and from the
//! stock `age` tool decrypt into DEST and nowhere else.

use std::path::{Path, PathBuf};
use std::process::Command;

use aws_lc_rs::signature::{Ed25519KeyPair, KeyPair};
use base64::Engine;
use cgx_kbs::age::{Identity, Recipient};
use cgx_kbs::server::config::{AdminKey, AppraisalConfig, KbsConfig, KekSource};
use serde_json::json;

fn now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

fn tmp() -> PathBuf {
    let p = std::env::temp_dir().join(format!("cgx-guest-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

fn ed() -> (Vec<u8>, String) {
    let doc = Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new()).unwrap();
    let kp = Ed25519KeyPair::from_pkcs8(doc.as_ref()).unwrap();
    (
        doc.as_ref().to_vec(),
        base64::engine::general_purpose::STANDARD.encode(kp.public_key().as_ref()),
    )
}

fn agent(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_cgx-guest-agent"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn have_age() -> bool {
    Command::new("age").arg("--version").output().is_ok()
}

#[test]
fn fetch_weights_with_a_lease_and_stock_age_interop() {
    let dir = tmp();
    std::fs::write(dir.join("kek.hex"), hex::encode([3u8; 32])).unwrap();
    std::fs::write(
        dir.join("refs.json"),
        json!({"allow_sim": "affirming", "snp": {"measurements": [hex::encode([0u8; 48])]},
               "nvidia": {"require_ocsp": false}})
        .to_string(),
    )
    .unwrap();
    let (admin_sk, admin_pk) = ed();
    let (broker_sk, broker_pk) = ed();
    let config = KbsConfig {
        listen: "127.0.0.1:0".into(),
        tls: None,
        insecure_dev: true,
        database: format!("sqlite://{}", dir.join("kbs.db").display()),
        kek: KekSource::File(dir.join("kek.hex")),
        admin_keys: vec![AdminKey {
            public_key: admin_pk,
            repositories: vec!["*".into()],
        }],
        broker_keys: vec![broker_pk],
        result_key: None,
        sim_roots: vec!["*".into()],
        allow_sample: false,
        nonce_ttl_secs: 60,
        session_ttl_secs: 300,
        collateral: Default::default(),
        appraisal: AppraisalConfig {
            policy: None,
            reference_values: Some(dir.join("refs.json")),
        },
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let running = rt.block_on(cgx_kbs::server::start(&config)).unwrap();
    let base = format!("http://{}", running.addr);

    // The enterprise: an identity as the KBS resource (a job resource: lease required).
    let id = Identity::generate().unwrap();
    let recipient = id.recipient().unwrap();
    let token =
        cgx_kbs::server::jwt::sign_eddsa(&admin_sk, &json!({"iat": now(), "exp": now() + 60}))
            .unwrap();
    let resp = ureq::post(&format!(
        "{base}/kbs/v0/resource/acme/weights/llama?lease=required"
    ))
    .header("authorization", &format!("Bearer {token}"))
    .send(id.to_secret_string().as_bytes())
    .unwrap();
    assert_eq!(resp.status().as_u16(), 200);

    // Weights: 3 MiB + 5 bytes, encrypted by us.
    let plain: Vec<u8> = (0..(3 << 20) + 5)
        .map(|i: usize| (i * 7 % 253) as u8)
        .collect();
    std::fs::write(dir.join("weights.bin"), &plain).unwrap();
    let mut file = Vec::new();
    cgx_kbs::age::encrypt(
        &recipient,
        &mut &plain[..],
        plain.len() as u64,
        &mut file,
        2,
        &mut |_| {},
    )
    .unwrap();
    std::fs::write(dir.join("weights.age"), &file).unwrap();

    let p = |name: &str| dir.join(name).display().to_string();
    // Without a lease: refused, and no DEST is left behind.
    let (ok, err) = agent(&[
        "fetch-weights",
        "--kbs",
        &base,
        "--resource",
        "acme/weights/llama",
        "--in",
        &p("weights.age"),
        "--out",
        &p("out0.bin"),
        "--sim",
    ]);
    assert!(!ok);
    assert!(err.contains("LeaseInvalid"), "{err}");
    assert!(!Path::new(&p("out0.bin")).exists());

    // The node key the broker knows: a lease names it; the agent attests with it.
    let node = cgx_kbs::jwe::TeeKey::generate_ec(cgx_kbs::jwe::Curve::P256).unwrap();
    std::fs::write(dir.join("node.pk8"), node.ec_pkcs8().unwrap()).unwrap();
    let lease_for = |key: &cgx_kbs::jwe::TeeKey| {
        cgx_kbs::server::jwt::sign_eddsa(
            &broker_sk,
            &json!({"lease": "job-7", "resources": ["acme/weights/llama"],
                    "node_key": cgx_kbs::jwe::thumbprint(&key.public().unwrap()),
                    "iat": now(), "exp": now() + 600}),
        )
        .unwrap()
    };
    // A lease for another node is refused.
    let other = cgx_kbs::jwe::TeeKey::generate_ec(cgx_kbs::jwe::Curve::P256).unwrap();
    let (ok, err) = agent(&[
        "fetch-weights",
        "--kbs",
        &base,
        "--resource",
        "acme/weights/llama",
        "--in",
        &p("weights.age"),
        "--out",
        &p("out1.bin"),
        "--sim",
        "--tee-key",
        &p("node.pk8"),
        "--lease",
        &lease_for(&other),
    ]);
    assert!(!ok);
    assert!(
        err.contains("LeaseInvalid") && err.contains("node key"),
        "{err}"
    );
    assert!(!Path::new(&p("out1.bin")).exists());
    let (ok, err) = agent(&[
        "fetch-weights",
        "--kbs",
        &base,
        "--resource",
        "acme/weights/llama",
        "--in",
        &p("weights.age"),
        "--out",
        &p("out2.bin"),
        "--sim",
        "--gpus",
        "1",
        "--threads",
        "2",
        "--tee-key",
        &p("node.pk8"),
        "--lease",
        &lease_for(&node),
    ]);
    assert!(ok, "{err}");
    assert_eq!(std::fs::read(p("out2.bin")).unwrap(), plain);
    // DEST is never overwritten.
    let (ok, err) = agent(&[
        "fetch-weights",
        "--kbs",
        &base,
        "--resource",
        "acme/weights/llama",
        "--in",
        &p("weights.age"),
        "--out",
        &p("out2.bin"),
        "--sim",
        "--tee-key",
        &p("node.pk8"),
        "--lease",
        &lease_for(&node),
    ]);
    assert!(!ok && err.contains("exists"), "{err}");
    // A tampered file: error, and the partial plaintext is removed.
    let mut bad = file.clone();
    let at = bad.len() / 2;
    bad[at] ^= 1;
    std::fs::write(dir.join("bad.age"), &bad).unwrap();
    let (ok, err) = agent(&[
        "fetch-weights",
        "--kbs",
        &base,
        "--resource",
        "acme/weights/llama",
        "--in",
        &p("bad.age"),
        "--out",
        &p("out3.bin"),
        "--sim",
        "--tee-key",
        &p("node.pk8"),
        "--lease",
        &lease_for(&node),
    ]);
    assert!(!ok && err.contains("chunk"), "{err}");
    assert!(!Path::new(&p("out3.bin")).exists());
    // Usage errors exit 2.
    assert_eq!(
        Command::new(env!("CARGO_BIN_EXE_cgx-guest-agent"))
            .arg("fetch-weights")
            .status()
            .unwrap()
            .code(),
        Some(2)
    );

    // Stock age, both ways.
    if have_age() {
        let st = Command::new("age")
            .args([
                "-r",
                &recipient.to_string(),
                "-o",
                &p("stock.age"),
                &p("weights.bin"),
            ])
            .status()
            .unwrap();
        assert!(st.success());
        let (ok, err) = agent(&[
            "fetch-weights",
            "--kbs",
            &base,
            "--resource",
            "acme/weights/llama",
            "--in",
            &p("stock.age"),
            "--out",
            &p("out4.bin"),
            "--sim",
            "--tee-key",
            &p("node.pk8"),
            "--lease",
            &lease_for(&node),
        ]);
        assert!(ok, "{err}");
        assert_eq!(std::fs::read(p("out4.bin")).unwrap(), plain);
        std::fs::write(dir.join("id.txt"), id.to_secret_string()).unwrap();
        let out = Command::new("age")
            .args(["-d", "-i", &p("id.txt"), &p("weights.age")])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.stdout, plain);
        // The recipient we print parses as age's own.
        assert_eq!(Recipient::parse(&recipient.to_string()).unwrap(), recipient);
    } else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED stock age interoperability: the `age` tool is not installed (CI installs it)"
        );
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must have the age tool"
        );
    }
    rt.block_on(running.shutdown());
    let _ = std::fs::remove_dir_all(&dir);
}
