//! `cgx weights keygen|encrypt`: identities in the KBS, age encryption of model weights.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use cgx_age::{Identity, Recipient};

use crate::kbs::admin_token;
use crate::output::CliResult;

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
            "?lease=optional"
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
