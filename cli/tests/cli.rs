#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The `cgx` binary as a user runs it: exit codes, JSON shapes, sim trust, refusals.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn cgx(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_cgx"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("cgx-cli-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

/// A server process: killed if the test fails before stopping it (a leaked server would hold
/// the test's stderr open, and `cargo test` would wait for it forever).
struct Reaper(std::process::Child);

impl Drop for Reaper {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

impl Reaper {
    /// SIGTERM, then it must exit 0 within 15 s.
    fn stop_on_sigterm(&mut self) {
        let st = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status()
            .unwrap();
        assert!(st.success());
        let t = std::time::Instant::now();
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                assert!(status.success(), "{status}");
                break;
            }
            assert!(t.elapsed().as_secs() < 15, "did not stop on SIGTERM");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

/// `cgx ARGS --config CONFIG` as a server; its base URL from the line it prints.
fn serve(args: &[&str], config: &Path) -> (Reaper, String) {
    use std::io::BufRead;
    let mut child = Reaper(
        Command::new(env!("CARGO_BIN_EXE_cgx"))
            .args(args)
            .arg("--config")
            .arg(config)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    std::io::BufReader::new(child.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line.trim().rsplit(' ').next().unwrap().to_string();
    assert!(base.starts_with("http://127.0.0.1:"), "{line}");
    (child, base)
}

fn json(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

#[test]
fn sim_snp_round_trip_needs_trust_sim() {
    let dir = tmp("snp");
    let d = dir.to_str().unwrap();
    let (code, _, err) = cgx(&[
        "sim",
        "snp",
        "--out",
        d,
        "--report-data",
        "00ff",
        "--measurement",
        &"ab".repeat(48),
        "--product",
        "turin",
    ]);
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = cgx(&["verify", d, "--json"]);
    assert_eq!(code, 1);
    let v = json(&out);
    assert_eq!(v["valid"], false);
    assert_eq!(v["kind"], "snp");
    assert_eq!(v["error"]["code"], "untrusted_root");
    let (code, out, _) = cgx(&["verify", d, "--json", "--trust-sim"]);
    assert_eq!(code, 0, "{out}");
    let v = json(&out);
    assert_eq!(v["valid"], true);
    assert_eq!(v["claims"]["sim"], true);
    assert_eq!(v["claims"]["product"], "turin");
    assert_eq!(v["claims"]["measurement"], "ab".repeat(48));
    assert!(
        v["claims"]["report_data"]
            .as_str()
            .unwrap()
            .starts_with("00ff00")
    );
    assert!(v["claims"]["reported_tcb"]["fmc"].is_number());
    // A truncated report is a refusal (exit 1, JSON), not a crash.
    let report = dir.join("report.bin");
    let bytes = std::fs::read(&report).unwrap();
    std::fs::write(&report, &bytes[..1000]).unwrap();
    let (code, out, _) = cgx(&["verify", d, "--json", "--trust-sim"]);
    assert_eq!(code, 1);
    assert_eq!(json(&out)["error"]["code"], "truncated");
    // Human output.
    std::fs::write(&report, &bytes).unwrap();
    let (code, out, _) = cgx(&["verify", d, "--trust-sim"]);
    assert_eq!(code, 0);
    assert!(
        out.starts_with("VALID SEV-SNP report v5 from Turin"),
        "{out}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sim_nvidia_round_trip() {
    let dir = tmp("gpu");
    let d = dir.to_str().unwrap();
    let nonce = "11".repeat(32);
    let (code, _, err) = cgx(&["sim", "nvidia", "--out", d, "--nonce", &nonce]);
    assert_eq!(code, 0, "{err}");
    let (code, out, _) = cgx(&["verify", d, "--json", "--trust-sim"]);
    assert_eq!(code, 0, "{out}");
    let v = json(&out);
    assert_eq!(v["kind"], "nvidia");
    assert_eq!(v["claims"]["nonce"], nonce);
    assert_eq!(v["claims"]["measurement_count"], 64);
    // The requester nonce, when the caller names it, must be the one the GPU signed.
    let (code, _, _) = cgx(&["verify", d, "--trust-sim", "--nonce", &nonce]);
    assert_eq!(code, 0);
    let (code, out, _) = cgx(&[
        "verify",
        d,
        "--json",
        "--trust-sim",
        "--nonce",
        &"22".repeat(32),
    ]);
    assert_eq!(code, 1);
    assert_eq!(json(&out)["error"]["code"], "nonce_mismatch");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn usage_errors_exit_2_with_a_message() {
    let (code, _, err) = cgx(&["verify", ".", "--at", "yesterday"]);
    assert_eq!(code, 2);
    assert!(err.contains("RFC 3339"), "{err}");
    let dir = tmp("bad");
    let d = dir.to_str().unwrap();
    let (code, _, err) = cgx(&["sim", "snp", "--out", d, "--measurement", "abcd"]);
    assert_eq!(code, 2);
    assert!(err.contains("48 bytes"), "{err}");
    let (code, _, err) = cgx(&["sim", "snp", "--out", d, "--report-data", "zz"]);
    assert_eq!(code, 2, "{err}");
    assert!(!dir.exists(), "a refused command wrote files");
    let (code, out, _) = cgx(&["verify", "/nonexistent/cgx", "--json"]);
    assert_eq!(code, 1);
    assert_eq!(json(&out)["error"]["code"], "bundle_unreadable");
}

#[test]
fn up_runs_on_embedded_defaults() {
    let (code, out, err) = cgx(&["up"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("simulated evidence refused as it must be"),
        "{out}"
    );
    assert!(out.contains("4 guest agents registered"), "{out}");
    // The console's URL and a sign-in command per user.
    assert!(out.contains("/console/ — sign in as each user"), "{out}");
    for user in [
        "tenant acme",
        "tenant globex",
        "operators op1, op2",
        "auditor",
    ] {
        assert!(
            out.lines()
                .any(|l| l.contains(user)
                    && l.contains("cgx console login --broker http://127.0.0.1:")),
            "{user}: {out}"
        );
    }
    assert!(out.contains("→ CONTRAINDICATED"), "{out}");
    assert!(out.contains("→ PLACED on node-1"), "{out}");
    // The real guest agent on node-1 decrypted the weights inside its VM, the workload checked
    // their digest, and its state reached the broker.
    assert!(
        out.contains("decrypted 4194304 bytes of llama.age"),
        "{out}"
    );
    assert!(
        out.contains("RUNNING") && out.contains("workload started"),
        "{out}"
    );
    assert!(
        out.contains("COMPLETED") && out.contains("exited with status 0"),
        "{out}"
    );
    assert!(out.contains("job running on node-2"), "{out}");
    assert!(
        out.contains("fetched the weights key through its new lease"),
        "{out}"
    );
}

fn vectors() -> Option<PathBuf> {
    cgx_attestation::bundle::shared_vectors(Path::new(env!("CARGO_MANIFEST_DIR")))
}

#[test]
fn verify_real_vectors_through_the_binary() {
    let Some(v) = vectors() else {
        skip("SKIPPED verify_real_vectors_through_the_binary: no vectors");
        return;
    };
    let b = v.join("snp/milan-v3-vlek-trustee");
    let (code, out, _) = cgx(&[
        "verify",
        b.to_str().unwrap(),
        "--json",
        "--at",
        "2025-06-01T00:00:00Z",
    ]);
    assert_eq!(code, 0, "{out}");
    let j = json(&out);
    assert_eq!(j["claims"]["signing_key"], "VLEK");
    assert_eq!(j["claims"]["sim"], false);
    // Outside the VLEK's validity the same bundle is refused.
    let (code, out, _) = cgx(&[
        "verify",
        b.to_str().unwrap(),
        "--json",
        "--at",
        "2019-01-01T00:00:00Z",
    ]);
    assert_eq!(code, 1);
    assert_eq!(json(&out)["error"]["code"], "certificate_not_valid_at_time");
    let t = v.join("tdx/v5-90c06f-trustee");
    let (code, out, _) = cgx(&[
        "verify",
        t.to_str().unwrap(),
        "--json",
        "--at",
        "2026-03-20T10:41:14Z",
    ]);
    assert_eq!(code, 1);
    assert_eq!(json(&out)["error"]["code"], "tcb_level_not_found");
    let rims = v.join("nvidia/rims");
    let (code, out, _) = cgx(&[
        "rim",
        "verify",
        rims.join("g520_0228_889_96006D0029_PROD.swidtag")
            .to_str()
            .unwrap(),
        "--ignore-signer-expiry",
        "--json",
    ]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json(&out)[0]["valid"], true);
}

/// Say that a test skipped, past libtest's output capture (a plain `eprintln!` in a passing
/// test is swallowed), so a user without the vectors sees it.
fn skip(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{msg}");
}

#[test]
fn bench_is_handed_to_cgx_bench_with_its_arguments() {
    // `cargo test --workspace` builds cgx-bench beside cgx; `cgx bench` then runs it with the
    // arguments as given (an invalid --seconds comes back as cgx-bench's usage error). Without
    // it, `cgx bench` says what to build instead.
    let beside = Path::new(env!("CARGO_BIN_EXE_cgx"))
        .with_file_name(format!("cgx-bench{}", std::env::consts::EXE_SUFFIX));
    let (code, _, err) = cgx(&["bench", "verify", "--seconds", "0"]);
    assert_eq!(code, 2, "{err}");
    if beside.is_file() {
        assert!(err.starts_with("cgx bench: "), "{err}");
        assert!(!err.contains("neither beside cgx"), "{err}");
        let (code, out, err) = cgx(&["bench", "--help"]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("verify") && out.contains("kbs"), "{out}");
    } else {
        assert!(err.contains("cargo build --release -p cgx-bench"), "{err}");
    }
}

#[test]
fn appraise_exit_codes_follow_the_tier() {
    let dir = tmp("appraise");
    let d = dir.to_str().unwrap();
    let m = "cd".repeat(48);
    assert_eq!(cgx(&["sim", "snp", "--out", d, "--measurement", &m]).0, 0);
    // Default reference values refuse sim evidence: contraindicated, exit 4.
    let (code, out, _) = cgx(&["appraise", d, "--trust-sim", "--json"]);
    assert_eq!(code, 4, "{out}");
    let v = json(&out);
    assert_eq!(v["status"], "contraindicated");
    assert_eq!(v["trust_vector"]["hardware"], 97);
    assert!(v["token"].as_str().unwrap().split('.').count() == 3);
    assert_eq!(v["jwks"]["keys"][0]["kty"], "OKP");
    assert_eq!(v["jwks"]["keys"][0]["alg"], "EdDSA");
    // Reference values that know the image and accept sim: affirming would still be sim; with
    // allow_sim the hardware claim is a warning (exit 3).
    let refs = dir.join("refs.json");
    std::fs::write(
        &refs,
        format!(r#"{{"allow_sim": true, "snp": {{"measurements": ["{m}"]}}}}"#),
    )
    .unwrap();
    let (code, out, _) = cgx(&[
        "appraise",
        d,
        "--trust-sim",
        "--json",
        "--reference-values",
        refs.to_str().unwrap(),
    ]);
    assert_eq!(code, 3, "{out}");
    assert_eq!(json(&out)["trust_vector"]["executables"], 2);
    // A policy that accepts everything: affirming, exit 0.
    let pol = dir.join("p.rego");
    std::fs::write(&pol, "package cgx.appraisal\nimport rego.v1\nresult := {\"affirming\": {\"hardware\": 2}, \"violations\": []}\n").unwrap();
    let (code, out, _) = cgx(&[
        "appraise",
        d,
        "--trust-sim",
        "--policy",
        pol.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("AFFIRMING"), "{out}");
    // Refused by the verifier (no --trust-sim): exit 1; a bad policy: exit 2.
    assert_eq!(cgx(&["appraise", d]).0, 1);
    std::fs::write(&pol, "package x\nnot rego at all").unwrap();
    let (code, _, err) = cgx(&[
        "appraise",
        d,
        "--trust-sim",
        "--policy",
        pol.to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("policy"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn policy_test_runs_the_shipped_rego_tests() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies");
    let (code, out, err) = cgx(&["policy", "test", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(" passed, 0 failed"), "{out}");
}

#[test]
fn collateral_store_feeds_verification_of_a_bare_report() {
    let Some(v) = vectors() else {
        skip("SKIPPED collateral_store_feeds_verification_of_a_bare_report: no vectors");
        return;
    };
    let dir = tmp("coll");
    let store = dir.join("store");
    let s = store.to_str().unwrap();
    let bundle = v.join("snp/genoa-v5-oak-genoa-oc");
    let (code, out, err) = cgx(&[
        "collateral",
        "import",
        bundle.to_str().unwrap(),
        "--store",
        s,
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, _) = cgx(&["collateral", "ls", "--json", "--store", s]);
    assert_eq!(code, 0);
    let rows = json(&out);
    assert!(
        rows.as_array()
            .unwrap()
            .iter()
            .any(|r| r["key"].as_str().unwrap().starts_with("amd/vcek/v1/Genoa/")),
        "{rows}"
    );
    // A bundle holding only the report verifies with the store's VCEK and chain.
    let bare = dir.join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    std::fs::copy(bundle.join("report.bin"), bare.join("report.bin")).unwrap();
    let (code, out, _) = cgx(&[
        "verify",
        bare.to_str().unwrap(),
        "--json",
        "--at",
        "2025-10-01T00:00:00Z",
    ]);
    assert_eq!(code, 1, "without collateral it is refused: {out}");
    let (code, out, _) = cgx(&[
        "verify",
        bare.to_str().unwrap(),
        "--json",
        "--at",
        "2025-10-01T00:00:00Z",
        "--collateral",
        s,
    ]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(json(&out)["claims"]["product"], "genoa");
    // Export and import into another store carry the same items.
    let exported = dir.join("export");
    assert_eq!(
        cgx(&[
            "collateral",
            "export",
            exported.to_str().unwrap(),
            "--store",
            s
        ])
        .0,
        0
    );
    let other = dir.join("other");
    assert_eq!(
        cgx(&[
            "collateral",
            "import",
            exported.to_str().unwrap(),
            "--store",
            other.to_str().unwrap()
        ])
        .0,
        0
    );
    let (_, out, _) = cgx(&[
        "collateral",
        "ls",
        "--json",
        "--store",
        other.to_str().unwrap(),
    ]);
    assert_eq!(
        json(&out).as_array().unwrap().len(),
        rows.as_array().unwrap().len()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `cgx kbs serve` as a process: it prints where it listens, answers /healthz and /metrics,
/// and exits 0 on SIGTERM; `cgx weights encrypt` and `cgx kbs dev-cert` work from the shell.
#[test]
fn kbs_serve_health_metrics_and_graceful_stop() {
    let dir = tmp("kbs-serve");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("kek.hex"), "22".repeat(32)).unwrap();
    // TLS configured, overridden by --insecure-dev on loopback.
    let config = serde_json::json!({
        "listen": "127.0.0.1:0",
        "tls": {"cert": dir.join("none.crt"), "key": dir.join("none.key")},
        "database": format!("sqlite://{}", dir.join("kbs.db").display()),
        "kek": {"file": dir.join("kek.hex")},
    });
    std::fs::write(dir.join("kbs.json"), config.to_string()).unwrap();
    let (mut child, base) = serve(&["kbs", "serve", "--insecure-dev"], &dir.join("kbs.json"));
    let get = |p: &str| {
        let mut r = ureq::get(&format!("{base}{p}")).call().unwrap();
        (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
    };
    let (s, body) = get("/healthz");
    assert_eq!(s, 200);
    assert!(body.contains("\"schema_version\":8"), "{body}");
    let (s, body) = get("/metrics");
    assert_eq!(s, 200);
    assert!(
        body.contains("cgx_kbs_requests_total{endpoint=\"healthz\"") || body.contains("# TYPE"),
        "{body}"
    );
    child.stop_on_sigterm();
    // A config that cannot be served safely is refused with a clear message.
    std::fs::write(
        dir.join("bad.json"),
        serde_json::json!({"listen": "0.0.0.0:0", "insecure_dev": true,
            "database": "sqlite://x.db", "kek": {"env": "NOPE"}})
        .to_string(),
    )
    .unwrap();
    let (code, _, err) = cgx(&[
        "kbs",
        "serve",
        "--config",
        dir.join("bad.json").to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("loopback"), "{err}");

    // Weights: encrypt, and a bad recipient is a usage error.
    std::fs::write(dir.join("w.bin"), vec![9u8; 200_000]).unwrap();
    let id = cgx_age::Identity::generate().unwrap();
    let r = id.recipient().unwrap().to_string();
    let (code, _, err) = cgx(&[
        "weights",
        "encrypt",
        "-r",
        &r,
        "--in",
        dir.join("w.bin").to_str().unwrap(),
        "--out",
        dir.join("w.age").to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let file = std::fs::read(dir.join("w.age")).unwrap();
    let mut back = Vec::new();
    cgx_age::decrypt(
        &id,
        &mut &file[..],
        file.len() as u64,
        &mut back,
        1,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(back, vec![9u8; 200_000]);
    let (code, _, err) = cgx(&[
        "weights",
        "encrypt",
        "-r",
        "age1nope",
        "--in",
        dir.join("w.bin").to_str().unwrap(),
        "--out",
        dir.join("x.age").to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("recipient"), "{err}");
    let (code, out, _) = cgx(&[
        "kbs",
        "dev-cert",
        "--out",
        dir.join("tls").to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    assert!(
        std::fs::read_to_string(out.trim())
            .unwrap()
            .contains("BEGIN CERTIFICATE")
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("tls/dev.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    }
    // An existing key is never overwritten.
    let (code, _, err) = cgx(&[
        "kbs",
        "dev-cert",
        "--out",
        dir.join("tls").to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("dev.key"), "{err}");
}

/// `cgx broker serve` as a process, and the tenant's and auditor's commands against it:
/// `job submit|ls|status|cancel`, `node ls|show`, tables by default, `--json`, refusals with
/// their codes (exit 1), SIGTERM stops it (exit 0).
#[test]
fn broker_serve_and_the_job_and_node_commands() {
    use aws_lc_rs::signature::{Ed25519KeyPair, KeyPair};
    use base64::Engine;
    let dir = tmp("broker-serve");
    std::fs::create_dir_all(&dir).unwrap();
    let key = |name: &str| {
        let doc = Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new()).unwrap();
        let kp = Ed25519KeyPair::from_pkcs8(doc.as_ref()).unwrap();
        std::fs::write(dir.join(name), doc.as_ref()).unwrap();
        base64::engine::general_purpose::STANDARD.encode(kp.public_key().as_ref())
    };
    let (tenant, auditor, ledger) = (key("tenant.pk8"), key("auditor.pk8"), key("ledger.pk8"));
    key("signing.pk8");
    let toml = format!(
        "listen = \"127.0.0.1:0\"\ninsecure_dev = true\ndatabase = \"sqlite://{}\"\nsigning_key = \"{}\"\n\
         api_keys = [{{ public_key = \"{tenant}\", scopes = [\"tenant:acme\"] }}, {{ public_key = \"{auditor}\", scopes = [\"auditor\"] }}, {{ public_key = \"{ledger}\", scopes = [\"ledger\"] }}]\n",
        dir.join("broker.db").display(),
        dir.join("signing.pk8").display()
    );
    std::fs::write(dir.join("broker.toml"), toml).unwrap();
    let (mut child, base) = serve(&["broker", "serve"], &dir.join("broker.toml"));
    let tk = dir.join("tenant.pk8");
    let ak = dir.join("auditor.pk8");
    let as_tenant = |args: &[&str]| {
        let mut a = args.to_vec();
        a.extend(["--broker", &base, "--key", tk.to_str().unwrap()]);
        cgx(&a)
    };
    // Unfunded: refused with what the tenant has. A payment adapter's key deposits (once per
    // reference: the retry moves nothing), and the job is taken.
    let submit = [
        "job",
        "submit",
        "--gpus",
        "2",
        "--max-price",
        "2.5",
        "--duration",
        "30m",
    ];
    let (code, _, err) = as_tenant(&submit);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("InsufficientFunds") && err.contains("deposit the difference first"),
        "{err}"
    );
    let lk = dir.join("ledger.pk8");
    for again in [false, true] {
        let (code, out, err) = cgx(&[
            "ledger",
            "deposit",
            "--account",
            "tenant/acme",
            "--amount",
            "10",
            "--reference",
            "wire-1",
            "--broker",
            &base,
            "--key",
            lk.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{out}{err}");
        assert!(
            out.contains(if again {
                "nothing moved"
            } else {
                "deposited 10.000000 to tenant/acme"
            }),
            "{out}"
        );
    }
    let (code, out, err) = as_tenant(&submit);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("PENDING") && out.contains("no node is registered"),
        "{out}"
    );
    let (code, out, _) = as_tenant(&["job", "ls", "--json"]);
    assert_eq!(code, 0);
    let jobs = json(&out);
    let id = jobs[0]["id"].as_str().unwrap().to_string();
    assert_eq!(jobs[0]["spec"]["duration_secs"], 1800);
    // 2 GPUs × 30 min at 2.5 per GPU-hour, exactly, in micros.
    assert_eq!(jobs[0]["spec"]["budget_micros"], 2_500_000);
    assert_eq!(jobs[0]["spec"]["max_price_per_gpu_hour_micros"], 2_500_000);
    let (code, out, _) = as_tenant(&["job", "status", &id]);
    assert_eq!(code, 0);
    assert!(
        out.contains("pending → ") || out.contains("- → pending"),
        "{out}"
    );
    let (code, out, _) = as_tenant(&["job", "cancel", &id]);
    assert_eq!(code, 0);
    assert!(out.contains("CANCELLED"), "{out}");
    // Refusals: exit 1 with the code.
    let (code, _, err) = as_tenant(&["job", "submit", "--max-price", "2", "--budget", "0.1"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("BudgetTooSmall"), "{err}");
    // Amounts are exact decimals: a seventh decimal or a sign is refused before any request.
    for bad in ["0.0000001", "-2", "2e3"] {
        let flag = format!("--max-price={bad}");
        let (code, _, err) = as_tenant(&["job", "submit", &flag]);
        assert_eq!(code, 2, "{bad}: {err}");
        assert!(err.contains("--max-price"), "{bad}: {err}");
    }
    let (code, out, _) = as_tenant(&["job", "cancel", &id, "--json"]);
    assert_eq!(code, 1);
    assert_eq!(json(&out)["error"]["code"], "Conflict");
    // The auditor sees the node table (empty) and every job.
    let (code, out, _) = cgx(&[
        "node",
        "ls",
        "--broker",
        &base,
        "--key",
        ak.to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    assert!(out.starts_with("NODE"), "{out}");
    let (code, _, err) = cgx(&[
        "node",
        "show",
        "n00",
        "--broker",
        &base,
        "--key",
        ak.to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("NotFound"), "{err}");
    // No key: refused by the broker, not a crash.
    let (code, _, err) = cgx(&["job", "ls", "--broker", &base]);
    assert_eq!(code, 1);
    assert!(err.contains("Unauthorized"), "{err}");
    child.stop_on_sigterm();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `cgx weights encrypt --kbs` stores a fresh identity bound to the SHA-256 of the age file it
/// wrote (and prints that digest); `cgx weights bind` binds an identity file to a file made
/// elsewhere. What a VM gets through its lease is exactly that binding.
#[test]
fn weights_keys_in_the_kbs_are_bound_to_the_file_digest() {
    use cgx_protocol::weights::WeightsKey;
    let sha256 = |b: &[u8]| hex::encode(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, b));
    let setup = cgx_devnet::setup_any_sim([0u8; 48]).unwrap();
    let server = cgx_devnet::Server::start(&setup.config).unwrap();
    let base = server.base.clone();
    let dir = setup.dir.clone();
    let admin = cgx_devnet::write_private(&dir, "admin.pk8", &setup.admin.pkcs8).unwrap();
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let plain = vec![5u8; 300_000];
    std::fs::write(dir.join("w.bin"), &plain).unwrap();
    // What a VM with a lease for `path` is released.
    let released = |path: &str| {
        let node = cgx_kbs::sim::SimNode::generate(0, [0u8; 48], cgx_devnet::now()).unwrap();
        let mut c = cgx_kbs::client::KbsClient::with_new_key(&base, None).unwrap();
        let me = cgx_protocol::kbs::jwe::thumbprint(&c.tee_key().public().unwrap());
        let lease = setup
            .broker
            .lease("job-1", &[path], &me, cgx_devnet::now() + 600)
            .unwrap();
        c.attest(&node).unwrap();
        WeightsKey::parse(&c.resource(path, Some(&lease)).unwrap()).unwrap()
    };

    let (code, out, err) = cgx(&[
        "weights",
        "encrypt",
        "--in",
        &p("w.bin"),
        "--out",
        &p("w.age"),
        "--kbs",
        &base,
        "--path",
        "acme/weights/m",
        "--admin-key",
        admin.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let file = std::fs::read(dir.join("w.age")).unwrap();
    assert_eq!(out.trim(), sha256(&file));
    let key = released("acme/weights/m");
    assert_eq!(hex::encode(key.sha256()), sha256(&file));
    let id = cgx_age::Identity::parse(key.identity()).unwrap();
    let mut back = Vec::new();
    cgx_age::decrypt(
        &id,
        &mut &file[..],
        file.len() as u64,
        &mut back,
        1,
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(back, plain);
    // The identity was never written next to the file.
    for e in std::fs::read_dir(&dir).unwrap() {
        let text = std::fs::read(e.unwrap().path()).unwrap_or_default();
        assert!(!String::from_utf8_lossy(&text).contains(key.identity()));
    }

    // `bind`: an identity file (as age-keygen writes it) and a file encrypted elsewhere.
    let mine = cgx_age::Identity::generate().unwrap();
    let mut other = Vec::new();
    cgx_age::encrypt(
        &mine.recipient().unwrap(),
        &mut &plain[..],
        plain.len() as u64,
        &mut other,
        1,
        &mut |_| {},
    )
    .unwrap();
    std::fs::write(dir.join("o.age"), &other).unwrap();
    cgx_devnet::write_private(
        &dir,
        "id.txt",
        format!(
            "# created: now\n# public key: {}\n{}\n",
            mine.recipient().unwrap(),
            mine.to_secret_string()
        )
        .as_bytes(),
    )
    .unwrap();
    let bind = |id_file: &str| {
        cgx(&[
            "weights",
            "bind",
            "--identity",
            &p(id_file),
            "--in",
            &p("o.age"),
            "--kbs",
            &base,
            "--path",
            "acme/weights/o",
            "--admin-key",
            admin.to_str().unwrap(),
        ])
    };
    let (code, out, err) = bind("id.txt");
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), sha256(&other));
    let key = released("acme/weights/o");
    assert_eq!(hex::encode(key.sha256()), sha256(&other));
    assert_eq!(key.identity(), mine.to_secret_string());
    // Two identities in one file: which one the file was made for is unclear; refused.
    let two = format!(
        "{}\n{}\n",
        mine.to_secret_string(),
        cgx_age::Identity::generate().unwrap().to_secret_string()
    );
    cgx_devnet::write_private(&dir, "two.txt", two.as_bytes()).unwrap();
    let (code, _, err) = bind("two.txt");
    assert_eq!(code, 2);
    assert!(err.contains("exactly one identity"), "{err}");
    // Neither a recipient nor a KBS: usage error, nothing written.
    let (code, _, _) = cgx(&[
        "weights",
        "encrypt",
        "--in",
        &p("w.bin"),
        "--out",
        &p("n.age"),
    ]);
    assert_eq!(code, 2);
    assert!(!dir.join("n.age").exists());
    // A path that is not REPO/TYPE/TAG is refused before anything is encrypted.
    let (code, _, err) = cgx(&[
        "weights",
        "encrypt",
        "--in",
        &p("w.bin"),
        "--out",
        &p("n.age"),
        "--kbs",
        &base,
        "--path",
        "acme/m",
        "--admin-key",
        admin.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("REPO/TYPE/TAG"), "{err}");
    assert!(!dir.join("n.age").exists());
    server.stop();
    setup.cleanup();
}
