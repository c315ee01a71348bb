//! `cgx kbs serve|dev-cert|token`: run the key broker and act as its administrator.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use cgx_kbs::server::config::KbsConfig;

use crate::output::CliResult;

/// The multi-threaded runtime a serving command runs on.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
}

/// `cgx kbs serve --config F`: load the configuration, then run until SIGINT/SIGTERM.
pub fn serve(config: &Path, insecure_dev: bool) -> CliResult {
    serve_service::<KbsConfig, _, _>(
        "cgx kbs",
        config,
        insecure_dev,
        |cfg, stop, on_listen| async move { cgx_kbs::server::run(&cfg, stop, on_listen).await },
    )
}

/// `cgx kbs|broker serve`: the configuration read as every service reads it
/// ([`cgx_service::config::load_service`], `--insecure-dev` applied), then served until a
/// signal ([`cgx_service::server::serve_until_signal`]).
pub(crate) fn serve_service<C, F, Fut>(
    name: &str,
    config: &Path,
    insecure_dev: bool,
    run: F,
) -> CliResult
where
    C: cgx_service::config::ServiceConfig,
    C::Error: std::fmt::Display,
    F: FnOnce(
        C,
        std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
        Box<dyn FnOnce(std::net::SocketAddr) + Send>,
    ) -> Fut,
    Fut: std::future::Future<Output = Result<(), C::Error>>,
{
    let cfg: C = cgx_service::config::load_service(config, |c: &mut C| {
        if insecure_dev {
            c.set_insecure_dev();
        }
    })
    .map_err(|e| e.to_string())?;
    if insecure_dev {
        eprintln!("{name}: plain HTTP (--insecure-dev): development on loopback only");
    }
    let tls = cgx_service::config::ServiceConfig::listener(&cfg)
        .tls
        .is_some();
    runtime()?
        .block_on(cgx_service::server::serve_until_signal(
            name,
            tls,
            |stop, on_listen| run(cfg, stop, on_listen),
        ))
        .map_err(|e| e.to_string())?;
    eprintln!("{name}: stopped");
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

/// A KBS admin bearer token signed with an Ed25519 PKCS#8 key (a typed record of its own: the
/// broker refuses it, whatever key signed it; CoCo's kbs-client presents it as given).
pub(crate) fn admin_token(key: &Path, ttl: i64) -> Result<String, String> {
    bearer_token(key, cgx_service::auth::BearerKind::KbsAdmin, ttl)
}

/// A bearer token of `kind` (a KBS admin or a broker API token), signed with an Ed25519
/// PKCS#8 key (DER or PEM), living `ttl` seconds.
pub(crate) fn bearer_token(
    key: &Path,
    kind: cgx_service::auth::BearerKind,
    ttl: i64,
) -> Result<String, String> {
    let der = std::fs::read(key).map_err(|e| format!("{}: {e}", key.display()))?;
    let der = pem_or_der(&der, "PRIVATE KEY");
    let signer = cgx_protocol::signed::Signer::from_pkcs8(&der).map_err(|e| e.to_string())?;
    let now = now();
    kind.sign(&signer, now, now + ttl)
        .map_err(|e| e.to_string())
}

pub(crate) fn pem_or_der(bytes: &[u8], label: &str) -> Vec<u8> {
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
    let key_path = out.join("dev.key");
    // Created 0600 (never written readable and tightened after), and never over another key.
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    opts.open(&key_path)
        .and_then(|mut f| f.write_all(key.as_bytes()))
        .map_err(|e| format!("{}: {e}", key_path.display()))?;
    // The certificate after its key: a refused key leaves the old pair as it was.
    std::fs::write(out.join("dev.crt"), cert).map_err(|e| e.to_string())?;
    println!("{}", out.join("dev.crt").display());
    Ok(ExitCode::SUCCESS)
}

/// `cgx kbs token --admin-key K`: print an admin token.
pub fn token(admin_key: &Path, ttl: i64) -> CliResult {
    // The KBS refuses admin tokens living longer than its cap (an hour by default).
    if !(1..=86_400).contains(&ttl) {
        return Err(
            "--ttl must be 1 to 86400 seconds (the KBS caps admin tokens, 3600 by default)".into(),
        );
    }
    println!("{}", admin_token(admin_key, ttl)?);
    Ok(ExitCode::SUCCESS)
}
