//! `cgx weights encrypt|bind`: age encryption of model weights, and their key in the KBS bound
//! to the encrypted file's SHA-256 (`cgx_protocol::weights`): the guest agent opens only the
//! file the tenant bound, never one someone else encrypted to the same (public) recipient.

use std::io::{Read, Write};
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use cgx_age::{Identity, Recipient};
use cgx_protocol::weights::WeightsKey;

use crate::kbs::admin_token;
use crate::output::CliResult;

/// Where a weights key is stored: the KBS, the resource path, the admin key for its repository.
#[derive(Debug, Clone, Copy)]
pub struct Store<'a> {
    pub kbs: &'a str,
    pub path: &'a str,
    pub admin_key: &'a Path,
    pub ca: Option<&'a Path>,
    /// A job resource (released only with a lease): the default.
    pub lease_required: bool,
}

impl Store<'_> {
    fn check(&self) -> Result<(), String> {
        if self.path.split('/').count() != 3 || self.path.split('/').any(str::is_empty) {
            return Err("--path must be REPO/TYPE/TAG".into());
        }
        Ok(())
    }

    /// Store `key` as the resource (replacing what was there).
    fn put(&self, key: &WeightsKey) -> Result<(), String> {
        let token = admin_token(self.admin_key, 300)?;
        let url = format!(
            "{}/kbs/v0/resource/{}{}",
            self.kbs.trim_end_matches('/'),
            self.path,
            if self.lease_required {
                "?lease=required"
            } else {
                "?lease=optional"
            }
        );
        let pem = match self.ca {
            Some(p) => Some(std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?),
            None => None,
        };
        let agent = cgx_kbs::client::agent(pem.as_deref()).map_err(|e| e.to_string())?;
        let mut resp = agent
            .post(&url)
            .header("authorization", &format!("Bearer {token}"))
            .header("content-type", "application/octet-stream")
            .send(key.to_resource().as_bytes())
            .map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status().as_u16();
        if status != 200 {
            let body = resp.body_mut().read_to_string().unwrap_or_default();
            return Err(format!("KBS refused the weights key: HTTP {status} {body}"));
        }
        Ok(())
    }
}

/// A writer that hashes exactly what it passes on.
struct Sha256Writer<W> {
    inner: W,
    ctx: aws_lc_rs::digest::Context,
}

impl<W: Write> Write for Sha256Writer<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.ctx.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn digest32(d: aws_lc_rs::digest::Digest) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// An identity file (`age-keygen -o`) is a few hundred bytes; the cap comes before reading.
const MAX_IDENTITY_FILE: u64 = 64 * 1024;

/// The one `AGE-SECRET-KEY-1` line of an identity file (several would leave it unclear which
/// one the weights were encrypted to).
fn read_identity(p: &Path) -> Result<String, String> {
    let f = std::fs::File::open(p).map_err(|e| format!("{}: {e}", p.display()))?;
    let mut bytes = Vec::new();
    f.take(MAX_IDENTITY_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{}: {e}", p.display()))?;
    if bytes.len() as u64 > MAX_IDENTITY_FILE {
        return Err(format!(
            "{}: not an age identity file (too long)",
            p.display()
        ));
    }
    let text = std::str::from_utf8(&bytes)
        .map_err(|_| format!("{}: not an age identity file (not text)", p.display()))?;
    let mut lines = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'));
    let (Some(line), None) = (lines.next(), lines.next()) else {
        return Err(format!(
            "{}: an age identity file with exactly one identity is needed",
            p.display()
        ));
    };
    Identity::parse(line).map_err(|e| format!("{}: {e}", p.display()))?;
    Ok(line.to_string())
}

/// `cgx weights bind`: store the identity of an age file made elsewhere (the stock `age -r`)
/// as the KBS resource, bound to that file's SHA-256.
pub fn bind(identity: &Path, input: &Path, store: Store<'_>) -> CliResult {
    store.check()?;
    let line = read_identity(identity)?;
    let mut f = std::fs::File::open(input).map_err(|e| format!("{}: {e}", input.display()))?;
    let mut ctx = aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| format!("{}: {e}", input.display()))?;
        if n == 0 {
            break;
        }
        ctx.update(&buf[..n]);
    }
    let digest = digest32(ctx.finish());
    let key = WeightsKey::new(&line, digest).map_err(|e| e.to_string())?;
    store.put(&key)?;
    eprintln!(
        "weights key stored at {}, bound to {} (SHA-256):",
        store.path,
        input.display()
    );
    println!("{}", hex::encode(digest));
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

/// `cgx weights encrypt`: age-encrypt a file, in parallel, hashing the age file as it is
/// written. To `recipient`; or, with `store`, to a fresh identity that goes to the KBS bound
/// to the file's SHA-256 and is never written to disk or printed. Prints the SHA-256.
pub fn encrypt(
    recipient: Option<&str>,
    store: Option<Store<'_>>,
    input: &Path,
    output: &Path,
    threads: usize,
    quiet: bool,
) -> CliResult {
    let (r, id) = match (recipient, &store) {
        (Some(r), None) => (Recipient::parse(r).map_err(|e| e.to_string())?, None),
        (None, Some(st)) => {
            st.check()?;
            let id = Identity::generate().map_err(|e| e.to_string())?;
            (id.recipient().map_err(|e| e.to_string())?, Some(id))
        }
        _ => return Err("give either -r RECIPIENT or --kbs, --path and --admin-key".into()),
    };
    let mut inp = std::fs::File::open(input).map_err(|e| format!("{}: {e}", input.display()))?;
    let len = inp
        .metadata()
        .map_err(|e| format!("{}: {e}", input.display()))?
        .len();
    let tmp = output.with_extension("age.partial");
    let out = std::fs::File::create(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    let mut out = Sha256Writer {
        inner: std::io::BufWriter::with_capacity(4 << 20, out),
        ctx: aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256),
    };
    let mut bar = Progress::new(len, quiet);
    let result = cgx_age::encrypt(&r, &mut inp, len, &mut out, threads, &mut |d| bar.update(d))
        .map_err(|e| e.to_string())
        .and_then(|()| out.flush().map_err(|e| e.to_string()));
    let digest = digest32(out.ctx.clone().finish());
    drop(out);
    // The key is stored before the file appears: a file whose key failed to reach the KBS
    // (its identity is gone with this process) is never left looking usable.
    let result = result.and_then(|()| match (&store, &id) {
        (Some(st), Some(id)) => {
            let key = WeightsKey::new(&id.to_secret_string(), digest).map_err(|e| e.to_string())?;
            st.put(&key)
        }
        _ => Ok(()),
    });
    match result {
        Ok(()) => {
            std::fs::rename(&tmp, output).map_err(|e| format!("{}: {e}", output.display()))?;
            match &store {
                Some(st) => eprintln!(
                    "{} encrypted; its key is stored at {}, bound to its SHA-256:",
                    output.display(),
                    st.path
                ),
                None => eprintln!(
                    "{} encrypted (bind its identity to it with `cgx weights bind`); SHA-256:",
                    output.display()
                ),
            }
            println!("{}", hex::encode(digest));
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}
