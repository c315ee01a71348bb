#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! CoCo's stock `kbs-client` (Trustee's, sample attester only; `../shared/anchors/`) against a
//! cgx KBS, used as a CoCo operator uses it: provisioning, its built-in release policies
//! (`--allow-all`, `--deny-all`, `--affirming`), a policy file, sample reference values through
//! the KBS (`set-sample-reference-value`, `get-reference-value`), sample device evidence
//! (`ENABLE_SAMPLE_DEVICE=1`), over plain HTTP and over TLS. Skipped, visibly, where the client
//! is absent (set `CGX_ANCHORS` or place `../shared/anchors`).

use std::path::{Path, PathBuf};
use std::process::Command;

use base64::Engine;
use cgx_system_tests::*;

fn kbs_client() -> Option<PathBuf> {
    cgx_devnet::shared_anchors(&[Path::new(env!("CARGO_MANIFEST_DIR"))])
        .map(|d| d.join("kbs-client"))
}

/// One run of the stock client: (exit success, stdout, stderr).
struct Client {
    bin: PathBuf,
    url: String,
    ca: Option<PathBuf>,
    token: PathBuf,
}

impl Client {
    fn run(&self, args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
        let mut c = Command::new(&self.bin);
        c.arg("--url").arg(&self.url);
        if let Some(ca) = &self.ca {
            c.arg("--cert-file").arg(ca);
        }
        // The client says why a request failed only in its warnings.
        c.args(args)
            .env("RUST_LOG", "warn")
            .env_remove("ENABLE_SAMPLE_DEVICE");
        for (k, v) in env {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    }

    fn config(&self, args: &[&str]) -> (bool, String, String) {
        let token = self.token.to_str().unwrap();
        let mut all = vec!["config", "--admin-token-file", token];
        all.extend_from_slice(args);
        self.run(&all, &[])
    }

    fn get(&self, path: &str, env: &[(&str, &str)]) -> Result<Vec<u8>, String> {
        let (ok, out, err) = self.run(&["get-resource", "--path", path], env);
        if !ok {
            return Err(err);
        }
        Ok(base64::engine::general_purpose::STANDARD
            .decode(out.lines().last().unwrap_or(""))
            .unwrap())
    }
}

fn flows(c: &Client, s: &Setup) {
    let dir = &s.dir;
    std::fs::write(dir.join("model-key"), b"the model key").unwrap();
    let (ok, out, err) = c.config(&[
        "set-resource",
        "--path",
        "tenant-a/key/model",
        "--resource-file",
        dir.join("model-key").to_str().unwrap(),
    ]);
    assert!(ok, "{out}\n{err}");
    // Sample evidence without reference values: contraindicated, nothing released.
    let (ok, out, err) = c.config(&["set-resource-policy", "--allow-all"]);
    assert!(ok, "{out}\n{err}");
    let e = c.get("tenant-a/key/model", &[]).unwrap_err();
    assert!(e.contains("contraindicated"), "{e}");
    // Trustee's sample reference values, through the KBS as Trustee proxies them to its RVPS.
    for args in [
        &["svn", "1"][..],
        &["launch_digest", "abcde"],
        &["--as-integer", "--as-single-value", "major_version", "1"],
    ] {
        let mut a = vec!["set-sample-reference-value"];
        a.extend_from_slice(args);
        let (ok, out, err) = c.config(&a);
        assert!(
            ok && out.contains("Reference Values Updated"),
            "{out}\n{err}"
        );
    }
    let (ok, out, err) = c.config(&["get-reference-value", "--id", "svn"]);
    assert!(ok && out.contains(r#"[\"1\"]"#), "{out}\n{err}");
    // --allow-all: released, and the client decrypts it.
    assert_eq!(c.get("tenant-a/key/model", &[]).unwrap(), b"the model key");
    // --deny-all: refused.
    let (ok, _, err) = c.config(&["set-resource-policy", "--deny-all"]);
    assert!(ok, "{err}");
    let e = c.get("tenant-a/key/model", &[]).unwrap_err();
    assert!(
        e.contains("PolicyDeny") || e.contains("unauthorized"),
        "{e}"
    );
    // --affirming: it reads `ear.status`, which every part carries.
    let (ok, _, err) = c.config(&["set-resource-policy", "--affirming"]);
    assert!(ok, "{err}");
    assert_eq!(c.get("tenant-a/key/model", &[]).unwrap(), b"the model key");
    // A policy file, written for Trustee: the path as segments in data.
    let policy = dir.join("path.rego");
    std::fs::write(
        &policy,
        "package policy\nimport rego.v1\ndefault allow := false\n\
         allow if data[\"resource-path\"] == [\"tenant-a\", \"key\", \"model\"]\n",
    )
    .unwrap();
    let (ok, _, err) = c.config(&[
        "set-resource-policy",
        "--policy-file",
        policy.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert_eq!(c.get("tenant-a/key/model", &[]).unwrap(), b"the model key");
    std::fs::write(dir.join("other"), b"o").unwrap();
    let (ok, _, err) = c.config(&[
        "set-resource",
        "--path",
        "tenant-a/key/other",
        "--resource-file",
        dir.join("other").to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    assert!(c.get("tenant-a/key/other", &[]).is_err());
    // Sample device evidence is understood: part gpu0, judged by its own reference values.
    let device = [("ENABLE_SAMPLE_DEVICE", "1")];
    let e = c.get("tenant-a/key/model", &device).unwrap_err();
    assert!(e.contains("contraindicated"), "{e}");
    let (ok, token, err) = c.run(&["attest"], &device);
    assert!(ok, "{err}");
    let payload = token
        .trim_matches('"')
        .split('.')
        .nth(1)
        .unwrap()
        .to_string();
    let ear = json_of(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .unwrap(),
    );
    let gpu = &ear["submods"]["gpu0"];
    assert_eq!(
        gpu["ear_verifier_claims"]["cgx.kind"], "sampledevice",
        "{ear}"
    );
    assert_eq!(gpu["ear_status"], "contraindicated", "{ear}");
    assert_eq!(ear["submods"]["cpu0"]["ear_status"], "affirming", "{ear}");
    // Its reference values are set as JSON (the plain-HTTP helper; the TLS run stops here).
    if c.ca.is_none() {
        let (st, b) = call(
            "GET",
            &format!("{}/kbs/v0/reference-values", c.url),
            Some(&admin_token(&s.admin)),
            None,
        );
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
        let mut refs = json_of(&b);
        refs["sampledevice"] = serde_json::json!({"svn": ["2"]});
        let (st, b) = call(
            "POST",
            &format!("{}/kbs/v0/reference-values", c.url),
            Some(&admin_token(&s.admin)),
            Some(refs.to_string().as_bytes()),
        );
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
        assert_eq!(
            c.get("tenant-a/key/model", &device).unwrap(),
            b"the model key"
        );
    }
}

fn start(tls: bool) -> Option<(Setup, Server, Client)> {
    let Some(bin) = kbs_client() else {
        skip(
            "coco kbs-client",
            "no kbs-client (set CGX_ANCHORS or place ../shared/anchors)",
        );
        return None;
    };
    let mut s = setup(&[], None);
    s.config.allow_sample = true;
    // Trustee's single-tenant model, where the global policy speaks for every resource.
    s.config.tenant_isolation = false;
    let mut ca = None;
    if tls {
        use_tls(&mut s);
        ca = Some(s.dir.join("tls.crt"));
    }
    let srv = Server::start(&s.config);
    let token = s.dir.join("admin-token");
    std::fs::write(&token, admin_token(&s.admin)).unwrap();
    let url = if tls {
        srv.base.replace("http://", "https://")
    } else {
        srv.base.clone()
    };
    let client = Client {
        bin,
        url,
        ca,
        token,
    };
    Some((s, srv, client))
}

#[test]
fn stock_kbs_client_over_http() {
    let Some((s, srv, c)) = start(false) else {
        return;
    };
    flows(&c, &s);
    srv.stop();
}

#[test]
fn stock_kbs_client_over_tls() {
    let Some((s, srv, c)) = start(true) else {
        return;
    };
    flows(&c, &s);
    // A client that does not trust the certificate gets nothing.
    let stranger = Client { ca: None, ..c };
    assert!(stranger.get("tenant-a/key/model", &[]).is_err());
    srv.stop();
}
