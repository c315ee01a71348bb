//! `cgx-guest-agent`: runs inside the confidential VM.
//!
//! ```text
//! cgx-guest-agent fetch-weights --kbs URL --resource REPO/TYPE/TAG --in F.age --out DEST
//!                               [--lease TOKEN] [--tee-key P256.pk8] [--ca PEM] [--threads N]
//!                               [--sim [--gpus N]]
//! ```
//! Attests to the KBS (configfs-tsm on SNP/TDX; `--sim` for simulated evidence), fetches the
//! weights identity released to this TEE, and decrypts the age file streaming, in parallel
//! chunks, straight into DEST (created 0600, never overwritten; removed on any failure, so no
//! partial plaintext is left). Plaintext is written nowhere else.
//!
//! Exit codes: 0 done, 1 refused or failed, 2 usage.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

mod evidence;

use cgx_age::Identity;
use cgx_kbs::client::KbsClient;
use cgx_protocol::kbs::jwe::{Curve, TeeKey};
use cgx_protocol::kbs::rcar::EvidenceSource;
use evidence::ConfigfsTsm;

const USAGE: &str = "usage: cgx-guest-agent fetch-weights --kbs URL --resource REPO/TYPE/TAG --in F.age --out DEST [--lease TOKEN] [--tee-key P256.pk8] [--ca PEM] [--threads N] [--sim [--gpus N]]";

#[derive(Debug, Default)]
struct Args {
    kbs: String,
    resource: String,
    input: PathBuf,
    output: PathBuf,
    lease: Option<String>,
    /// The node key (EC P-256, PKCS#8) a lease names; a fresh key when absent.
    tee_key: Option<PathBuf>,
    ca: Option<PathBuf>,
    threads: usize,
    sim: bool,
    gpus: usize,
}

fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    match it.next().as_deref() {
        Some("fetch-weights") => {}
        Some("--help" | "-h") | None => return Err(USAGE.into()),
        Some(other) => return Err(format!("unknown command '{other}'\n{USAGE}")),
    }
    let mut a = Args::default();
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--kbs" => a.kbs = val()?,
            "--resource" => a.resource = val()?,
            "--in" => a.input = val()?.into(),
            "--out" => a.output = val()?.into(),
            "--lease" => a.lease = Some(val()?),
            "--tee-key" => a.tee_key = Some(val()?.into()),
            "--ca" => a.ca = Some(val()?.into()),
            "--threads" => a.threads = val()?.parse().map_err(|_| "--threads: a number")?,
            "--gpus" => a.gpus = val()?.parse().map_err(|_| "--gpus: a number")?,
            "--sim" => a.sim = true,
            other => return Err(format!("unknown flag '{other}'\n{USAGE}")),
        }
    }
    if a.kbs.is_empty()
        || a.resource.is_empty()
        || a.input.as_os_str().is_empty()
        || a.output.as_os_str().is_empty()
    {
        return Err(USAGE.into());
    }
    if a.resource.split('/').count() != 3 {
        return Err("--resource must be REPO/TYPE/TAG".into());
    }
    check_kbs_url(&a.kbs)?;
    Ok(a)
}

/// The KBS is reached over TLS; plain `http://` only on this machine's loopback (tests, a
/// development KBS), since the session cookie and the lease travel in the clear.
fn check_kbs_url(url: &str) -> Result<(), String> {
    if url.starts_with("https://") {
        return Ok(());
    }
    let Some(rest) = url.strip_prefix("http://") else {
        return Err(format!("--kbs {url}: not an https:// URL"));
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => authority.rsplit_once(':').map_or(authority, |(h, _)| h),
    };
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if loopback {
        Ok(())
    } else {
        Err(format!(
            "--kbs {url}: plain http:// is refused except on loopback; use https://"
        ))
    }
}

#[cfg(feature = "sim")]
fn sim_source(gpus: usize) -> Result<Box<dyn EvidenceSource>, String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    Ok(Box::new(
        cgx_kbs::sim::SimNode::generate(gpus, [0u8; 48], now).map_err(|e| e.to_string())?,
    ))
}

#[cfg(not(feature = "sim"))]
fn sim_source(_: usize) -> Result<Box<dyn EvidenceSource>, String> {
    Err("this build has no simulator (built without the sim feature)".into())
}

fn run(a: &Args) -> Result<(), String> {
    let source: Box<dyn EvidenceSource> = if a.sim {
        sim_source(a.gpus)?
    } else {
        let tsm = ConfigfsTsm::default();
        if !tsm.root.is_dir() {
            return Err(format!(
                "{} does not exist: not a confidential VM with configfs-tsm (use --sim outside one)",
                tsm.root.display()
            ));
        }
        Box::new(tsm)
    };
    let ca = match &a.ca {
        Some(p) => Some(std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?),
        None => None,
    };
    let key = match &a.tee_key {
        Some(p) => {
            let der = std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?;
            TeeKey::ec_from_der(Curve::P256, &der).map_err(|e| e.to_string())?
        }
        None => TeeKey::generate_ec(Curve::P256).map_err(|e| e.to_string())?,
    };
    let mut client = KbsClient::new(&a.kbs, ca.as_deref(), key).map_err(|e| e.to_string())?;
    client.attest(source.as_ref()).map_err(|e| e.to_string())?;
    let secret = client
        .resource(&a.resource, a.lease.as_deref())
        .map_err(|e| e.to_string())?;
    let identity = Identity::parse(&String::from_utf8_lossy(&secret)).map_err(|e| e.to_string())?;
    drop(secret);
    let mut input =
        std::fs::File::open(&a.input).map_err(|e| format!("{}: {e}", a.input.display()))?;
    let len = input
        .metadata()
        .map_err(|e| format!("{}: {e}", a.input.display()))?
        .len();
    // Plaintext goes to a temporary file beside DEST (created 0600), and DEST appears only
    // once every chunk has been authenticated: a reader of DEST never sees a prefix of weights
    // that a later chunk would have refused. DEST is never overwritten.
    if a.output.exists() {
        return Err(format!("{}: exists; not overwritten", a.output.display()));
    }
    let name = a
        .output
        .file_name()
        .ok_or_else(|| format!("{}: not a file name", a.output.display()))?
        .to_string_lossy()
        .into_owned();
    let mut tag = [0u8; 6];
    aws_lc_rs::rand::fill(&mut tag).map_err(|_| "random".to_string())?;
    let tmp = a
        .output
        .with_file_name(format!(".{name}.partial-{}", hex::encode(tag)));
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let out = opts
        .open(&tmp)
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    let mut out = std::io::BufWriter::with_capacity(4 << 20, out);
    let t = Instant::now();
    let result = cgx_age::decrypt(&identity, &mut input, len, &mut out, a.threads, &mut |_| {})
        .map_err(|e| e.to_string())
        .and_then(|n| {
            out.flush().map_err(|e| e.to_string())?;
            out.get_ref().sync_all().map_err(|e| e.to_string())?;
            Ok(n)
        })
        // Linking fails if DEST appeared meanwhile: never overwritten.
        .and_then(|n| {
            std::fs::hard_link(&tmp, &a.output)
                .map(|()| n)
                .map_err(|e| format!("{}: {e}", a.output.display()))
        });
    drop(out);
    let _ = std::fs::remove_file(&tmp);
    match result {
        Ok(n) => {
            let s = t.elapsed().as_secs_f64();
            eprintln!(
                "decrypted {n} bytes into {} in {s:.2} s ({:.2} GB/s)",
                a.output.display(),
                n as f64 / s.max(1e-9) / 1e9
            );
            Ok(())
        }
        Err(e) => Err(e),
    }
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "cgx-guest-agent: {e}");
            ExitCode::from(1)
        }
    }
}
