//! `cgx kbs serve|dev-cert|token`, `cgx weights keygen|encrypt`, and `cgx up`'s key release.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use cgx_age::{Identity, Recipient};
use cgx_kbs::client::KbsClient;
use cgx_kbs::server::config::KbsConfig;
use serde_json::json;

use crate::commands::CliResult;

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
}

/// `cgx kbs serve --config F`.
pub fn serve(config: &Path, insecure_dev: bool) -> CliResult {
    let cfg = KbsConfig::from_file_with(config, |c| {
        if insecure_dev {
            c.insecure_dev = true;
            c.tls = None;
        }
    })
    .map_err(|e| e.to_string())?;
    if insecure_dev {
        eprintln!("cgx kbs: plain HTTP (--insecure-dev): development on loopback only");
    }
    runtime()?
        .block_on(cgx_kbs::server::serve(&cfg, |addr| {
            println!(
                "cgx kbs listening on {}://{addr}",
                if cfg.tls.is_some() { "https" } else { "http" }
            );
            let _ = std::io::stdout().flush();
        }))
        .map_err(|e| e.to_string())?;
    eprintln!("cgx kbs: stopped");
    Ok(ExitCode::SUCCESS)
}

fn now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

/// An admin bearer token signed with an Ed25519 PKCS#8 key (as CoCo's kbs-client makes them).
fn admin_token(key: &Path, ttl: i64) -> Result<String, String> {
    let der = std::fs::read(key).map_err(|e| format!("{}: {e}", key.display()))?;
    let der = pem_or_der(&der, "PRIVATE KEY");
    cgx_service::jwt::sign_eddsa(&der, &json!({"iat": now(), "exp": now() + ttl}))
}

fn pem_or_der(bytes: &[u8], label: &str) -> Vec<u8> {
    use base64::Engine;
    let text = String::from_utf8_lossy(bytes);
    let begin = format!("-----BEGIN {label}-----");
    match text.find(&begin) {
        Some(i) => {
            let body: String = text[i + begin.len()..]
                .split("-----END")
                .next()
                .unwrap_or("")
                .split_whitespace()
                .collect();
            base64::engine::general_purpose::STANDARD
                .decode(body)
                .unwrap_or_default()
        }
        None => bytes.to_vec(),
    }
}

/// `cgx kbs dev-cert`: a self-signed certificate for a development KBS.
pub fn dev_cert(out: &Path, names: &[String]) -> CliResult {
    let names: Vec<&str> = if names.is_empty() {
        vec!["localhost", "127.0.0.1"]
    } else {
        names.iter().map(String::as_str).collect()
    };
    let (cert, key) = cgx_service::tls::self_signed(&names).map_err(|e| e.to_string())?;
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    std::fs::write(out.join("dev.crt"), cert).map_err(|e| e.to_string())?;
    let key_path = out.join("dev.key");
    std::fs::write(&key_path, key).map_err(|e| e.to_string())?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| e.to_string())?;
    }
    println!("{}", out.join("dev.crt").display());
    Ok(ExitCode::SUCCESS)
}

/// `cgx kbs token --admin-key K`: print an admin token.
pub fn token(admin_key: &Path, ttl: i64) -> CliResult {
    println!("{}", admin_token(admin_key, ttl)?);
    Ok(ExitCode::SUCCESS)
}

fn agent(ca: Option<&Path>) -> Result<ureq::Agent, String> {
    let pem = match ca {
        Some(p) => Some(std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?),
        None => None,
    };
    cgx_kbs::client::agent(pem.as_deref()).map_err(|e| e.to_string())
}

/// `cgx weights keygen`: make an X25519 identity, store it in the KBS as the resource `path`,
/// print the recipient. The identity is never written to disk or printed.
pub fn keygen(
    kbs: &str,
    path: &str,
    admin_key: &Path,
    ca: Option<&Path>,
    lease_required: bool,
) -> CliResult {
    if path.split('/').count() != 3 || path.split('/').any(str::is_empty) {
        return Err("--path must be REPO/TYPE/TAG".into());
    }
    let id = Identity::generate().map_err(|e| e.to_string())?;
    let recipient = id.recipient().map_err(|e| e.to_string())?;
    let token = admin_token(admin_key, 300)?;
    let url = format!(
        "{}/kbs/v0/resource/{path}{}",
        kbs.trim_end_matches('/'),
        if lease_required {
            "?lease=required"
        } else {
            ""
        }
    );
    let secret = id.to_secret_string();
    let mut resp = agent(ca)?
        .post(&url)
        .header("authorization", &format!("Bearer {token}"))
        .header("content-type", "application/octet-stream")
        .send(secret.as_bytes())
        .map_err(|e| format!("{url}: {e}"))?;
    let status = resp.status().as_u16();
    if status != 200 {
        let body = resp.body_mut().read_to_string().unwrap_or_default();
        return Err(format!("KBS refused the identity: HTTP {status} {body}"));
    }
    eprintln!("identity stored at {path}; encrypt weights to:");
    println!("{recipient}");
    Ok(ExitCode::SUCCESS)
}

/// A one-line progress bar on stderr.
struct Progress {
    total: u64,
    started: Instant,
    last: Instant,
    quiet: bool,
}

impl Progress {
    fn new(total: u64, quiet: bool) -> Self {
        let now = Instant::now();
        Progress {
            total,
            started: now,
            last: now - Duration::from_secs(1),
            quiet,
        }
    }

    fn update(&mut self, done: u64) {
        if self.quiet || (self.last.elapsed() < Duration::from_millis(100) && done < self.total) {
            return;
        }
        self.last = Instant::now();
        let frac = if self.total == 0 {
            1.0
        } else {
            done as f64 / self.total as f64
        };
        let width = 30;
        let filled = ((frac * width as f64) as usize).min(width);
        let rate = done as f64 / self.started.elapsed().as_secs_f64().max(1e-6) / 1e9;
        eprint!(
            "\r[{}{}] {:5.1}%  {:.2} GB/s ",
            "#".repeat(filled),
            ".".repeat(width - filled),
            frac * 100.0,
            rate
        );
        if done >= self.total {
            eprintln!();
        }
    }
}

/// `cgx weights encrypt`: age-encrypt a file to a recipient, in parallel.
pub fn encrypt(
    recipient: &str,
    input: &Path,
    output: &Path,
    threads: usize,
    quiet: bool,
) -> CliResult {
    let r = Recipient::parse(recipient).map_err(|e| e.to_string())?;
    let mut inp = std::fs::File::open(input).map_err(|e| format!("{}: {e}", input.display()))?;
    let len = inp
        .metadata()
        .map_err(|e| format!("{}: {e}", input.display()))?
        .len();
    let tmp = output.with_extension("age.partial");
    let out = std::fs::File::create(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    let mut out = std::io::BufWriter::with_capacity(4 << 20, out);
    let mut bar = Progress::new(len, quiet);
    let result = cgx_age::encrypt(&r, &mut inp, len, &mut out, threads, &mut |d| bar.update(d))
        .map_err(|e| e.to_string())
        .and_then(|()| out.flush().map_err(|e| e.to_string()));
    drop(out);
    match result {
        Ok(()) => {
            std::fs::rename(&tmp, output).map_err(|e| format!("{}: {e}", output.display()))?;
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// `cgx up`, KBS part: a job's weights key released into the simulated VM only with a lease
/// for its key, and the weights decrypted with it.
pub fn up_release(node: &cgx_kbs::sim::SimNode) -> Result<(), String> {
    let setup = cgx_devnet::setup(&[node], None).map_err(|e| e.to_string())?;
    let result = (|| {
        let local = cgx_devnet::Server::start(&setup.config).map_err(|e| e.to_string())?;
        let id = Identity::generate().map_err(|e| e.to_string())?;
        let path = "acme/weights/llama";
        local
            .put_resource(&setup.admin, path, id.to_secret_string().as_bytes(), true)
            .map_err(|e| e.to_string())?;
        let weights: Vec<u8> = (0..(4u32 << 20)).map(|i| (i % 251) as u8).collect();
        let mut file = Vec::new();
        cgx_age::encrypt(
            &id.recipient().map_err(|e| e.to_string())?,
            &mut &weights[..],
            weights.len() as u64,
            &mut file,
            0,
            &mut |_| {},
        )
        .map_err(|e| e.to_string())?;
        println!(
            "[kbs] {} up; weights identity stored at {path} (job resource: lease required); 4 MiB of weights age-encrypted to it",
            local.base
        );
        let mut c = KbsClient::with_new_key(&local.base, None).map_err(|e| e.to_string())?;
        c.attest(node).map_err(|e| e.to_string())?;
        println!(
            "[kbs] attested: SNP report + {} GPU report(s) bound to the KBS nonce and TEE key; EAR issued",
            node.gpus.len()
        );
        match c.resource(path, None) {
            Err(e) => println!("[kbs] without a lease: refused as it must be: {e}"),
            Ok(_) => return Err("released without a lease".into()),
        }
        let tee = c.tee_key().public().map_err(|e| e.to_string())?;
        let lease = setup
            .broker
            .lease(
                "lease-1",
                &[path],
                &cgx_protocol::kbs::jwe::thumbprint(&tee),
                now() + 600,
            )
            .map_err(|e| e.to_string())?;
        let secret = c.resource(path, Some(&lease)).map_err(|e| e.to_string())?;
        let identity =
            Identity::parse(&String::from_utf8_lossy(&secret)).map_err(|e| e.to_string())?;
        let mut plain = Vec::new();
        cgx_age::decrypt(
            &identity,
            &mut &file[..],
            file.len() as u64,
            &mut plain,
            0,
            &mut |_| {},
        )
        .map_err(|e| e.to_string())?;
        if plain != weights {
            return Err("decrypted weights differ".into());
        }
        println!(
            "[kbs] with the broker's lease for this node's key: identity released as a JWE to the TEE key; weights decrypted and equal"
        );
        local.stop();
        Ok(())
    })();
    setup.cleanup();
    result
}
