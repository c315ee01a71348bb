#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! `cgx-guest-agent fetch-weights` against a KBS on loopback: a job's weights identity is
//! released only with a lease for this node's key, it opens only the age file whose SHA-256 the
//! resource binds, and age files from our encryptor and from the stock `age` tool decrypt into
//! DEST and nowhere else.

use std::path::Path;
use std::process::Command;

use cgx_age::{Identity, Recipient};
use cgx_protocol::weights::WeightsKey;

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut d = [0u8; 32];
    d.copy_from_slice(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, bytes).as_ref());
    d
}

fn partials(dir: &Path) -> Vec<std::fs::DirEntry> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".partial-"))
        .collect()
}

#[cfg(unix)]
fn chmod(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
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
    // The development network's KBS, trusting any simulator root: the agent's `--sim` node is
    // made in its own process (launch measurement all zeros).
    let setup = cgx_devnet::setup_any_sim([0u8; 48]).unwrap();
    let dir = setup.dir.clone();
    let server = cgx_devnet::Server::start(&setup.config).unwrap();
    let base = server.base.clone();

    // The enterprise: an identity as the KBS resource (a job resource: lease required), bound
    // to the SHA-256 of the age file it was made for.
    let id = Identity::generate().unwrap();
    let recipient = id.recipient().unwrap();
    let put = |path: &str, value: &[u8]| {
        let token = setup.admin.admin_token().unwrap();
        let resp = ureq::post(&format!("{base}/kbs/v0/resource/{path}?lease=required"))
            .header("authorization", &format!("Bearer {token}"))
            .send(value)
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
    };

    // Weights: 3 MiB + 5 bytes, encrypted by us.
    let plain: Vec<u8> = (0..(3 << 20) + 5)
        .map(|i: usize| (i * 7 % 253) as u8)
        .collect();
    std::fs::write(dir.join("weights.bin"), &plain).unwrap();
    let mut file = Vec::new();
    cgx_age::encrypt(
        &recipient,
        &mut &plain[..],
        plain.len() as u64,
        &mut file,
        2,
        &mut |_| {},
    )
    .unwrap();
    std::fs::write(dir.join("weights.age"), &file).unwrap();
    let bound = WeightsKey::new(&id.to_secret_string(), sha256(&file)).unwrap();
    put("acme/weights/llama", bound.to_resource().as_bytes());
    // The same identity stored bare (as before digests were bound): it binds no file.
    put("acme/weights/unbound", id.to_secret_string().as_bytes());

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
    // (Tenant isolation refuses before the lookup: nothing names this requester.)
    assert!(!ok);
    assert!(
        err.contains("PolicyDeny") && err.contains("needs a lease"),
        "{err}"
    );
    assert!(!Path::new(&p("out0.bin")).exists());

    // The node key the broker knows: a lease names it; the agent attests with it.
    let node =
        cgx_protocol::kbs::jwe::TeeKey::generate_ec(cgx_protocol::kbs::jwe::Curve::P256).unwrap();
    std::fs::write(dir.join("node.pk8"), node.ec_pkcs8().unwrap()).unwrap();
    #[cfg(unix)]
    chmod(&dir.join("node.pk8"), 0o600);
    let lease_for = |key: &cgx_protocol::kbs::jwe::TeeKey| {
        setup
            .broker
            .lease(
                "job-7",
                &[
                    "acme/weights/llama",
                    "acme/weights/unbound",
                    "acme/weights/stock",
                ],
                &cgx_protocol::kbs::jwe::thumbprint(&key.public().unwrap()),
                cgx_devnet::now() + 600,
            )
            .unwrap()
    };
    // A lease for another node is refused.
    let other =
        cgx_protocol::kbs::jwe::TeeKey::generate_ec(cgx_protocol::kbs::jwe::Curve::P256).unwrap();
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
    // Nor is a partial plaintext left beside it: it was decrypted into a temporary file that
    // DEST would have been linked to only after the last chunk authenticated.
    assert!(partials(&dir).is_empty(), "{:?}", partials(&dir));

    // Weights the tenant never made: an attacker who knows the (public) recipient encrypts
    // weights of their own to it. age opens the file (every chunk authenticates under the
    // attacker's file key), so only the digest the resource binds tells it apart: refused,
    // and neither DEST nor any partial plaintext is left.
    let evil: Vec<u8> = vec![0x66; (1 << 20) + 3];
    let mut forged = Vec::new();
    cgx_age::encrypt(
        &recipient,
        &mut &evil[..],
        evil.len() as u64,
        &mut forged,
        2,
        &mut |_| {},
    )
    .unwrap();
    std::fs::write(dir.join("forged.age"), &forged).unwrap();
    let fetch = |resource: &str, input: &str, out: &str| {
        agent(&[
            "fetch-weights",
            "--kbs",
            &base,
            "--resource",
            resource,
            "--in",
            &p(input),
            "--out",
            &p(out),
            "--sim",
            "--tee-key",
            &p("node.pk8"),
            "--lease",
            &lease_for(&node),
        ])
    };
    let (ok, err) = fetch("acme/weights/llama", "forged.age", "out5.bin");
    assert!(!ok);
    assert!(
        err.contains("weights digest mismatch")
            && err.contains(&hex::encode(sha256(&forged)))
            && err.contains(&hex::encode(sha256(&file))),
        "{err}"
    );
    assert!(!Path::new(&p("out5.bin")).exists());
    assert!(partials(&dir).is_empty(), "{:?}", partials(&dir));
    // An identity that binds no file is never used to open one.
    let (ok, err) = fetch("acme/weights/unbound", "weights.age", "out6.bin");
    assert!(!ok);
    assert!(
        err.contains("acme/weights/unbound") && err.contains("binds no weights file"),
        "{err}"
    );
    assert!(!Path::new(&p("out6.bin")).exists());
    // A node key that others can read is refused before anything is sent.
    #[cfg(unix)]
    {
        chmod(&dir.join("node.pk8"), 0o644);
        let (ok, err) = fetch("acme/weights/llama", "weights.age", "out7.bin");
        assert!(!ok);
        assert!(
            err.contains("node.pk8") && err.contains("group or others"),
            "{err}"
        );
        assert!(!Path::new(&p("out7.bin")).exists());
        chmod(&dir.join("node.pk8"), 0o600);
        let (ok, err) = fetch("acme/weights/llama", "weights.age", "out7.bin");
        assert!(ok, "{err}");
        assert_eq!(std::fs::read(p("out7.bin")).unwrap(), plain);
    }
    // Usage errors exit 2.
    assert_eq!(
        Command::new(env!("CARGO_BIN_EXE_cgx-guest-agent"))
            .arg("fetch-weights")
            .status()
            .unwrap()
            .code(),
        Some(2)
    );
    // Plain HTTP only on loopback: the cookie and the lease would travel in the clear.
    for (url, refused) in [
        ("http://kbs.example:8080", true),
        ("http://10.0.0.1/", true),
        ("ftp://kbs.example", true),
        // Userinfo: the host is evil.example, whatever precedes the '@'.
        ("http://localhost:80@evil.example/", true),
        ("http://127.0.0.1:1@evil.example:1/", true),
        ("https://user@kbs.example/", true),
        // A name that begins like an address is a name.
        ("http://127.0.0.1.evil.example/", true),
        ("http://localhost.evil.example/", true),
        ("http://127.0.0.1:1/?x=@evil.example", true),
        ("http://127.0.0.1:1/#@evil.example", true),
        ("127.0.0.1:1", true),
        ("http://[::ffff:10.0.0.1]:1", true),
        ("http://127.0.0.1:1", false),
        ("http://localhost:1", false),
        ("http://[::1]:1", false),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_cgx-guest-agent"))
            .args([
                "fetch-weights",
                "--kbs",
                url,
                "--resource",
                "a/b/c",
                "--in",
                &p("weights.age"),
                "--out",
                &p("never.bin"),
                "--sim",
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        if refused {
            assert_eq!(out.status.code(), Some(2), "{url}: {err}");
            assert!(err.contains("--kbs"), "{url}: {err}");
        } else {
            // Accepted as a URL; nothing listens there, so the attestation fails (exit 1).
            assert_eq!(out.status.code(), Some(1), "{url}: {err}");
        }
        assert!(!Path::new(&p("never.bin")).exists());
    }

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
        // Stock age's file is another file: the tenant's own key, bound to our file, refuses it.
        let (ok, err) = fetch("acme/weights/llama", "stock.age", "out4.bin");
        assert!(!ok && err.contains("weights digest mismatch"), "{err}");
        let stock = std::fs::read(p("stock.age")).unwrap();
        put(
            "acme/weights/stock",
            WeightsKey::new(&id.to_secret_string(), sha256(&stock))
                .unwrap()
                .to_resource()
                .as_bytes(),
        );
        let (ok, err) = agent(&[
            "fetch-weights",
            "--kbs",
            &base,
            "--resource",
            "acme/weights/stock",
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
        // The bound resource is still an age identity file: stock age reads it as one.
        std::fs::write(dir.join("id.txt"), bound.to_resource()).unwrap();
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
    server.stop();
    setup.cleanup();
}
