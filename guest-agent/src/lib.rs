//! `cgx-guest-agent`: runs inside the confidential VM. The program is [`main_with`]; `main.rs`
//! only hands it the command line.
//!
//! ```text
//! cgx-guest-agent run --broker URL --broker-key ED25519-B64 --kbs URL --token-file F
//!                     --operator NAME --region R --price-micros N [--store DIR] [--work DIR]
//!                     [--workload-uid N] [--ca PEM] [--threads N] [--channel PORT]
//!                     [--sim-machine FILE | --sim [--gpus N]]
//! cgx-guest-agent fetch-weights --kbs URL --resource REPO/TYPE/TAG --in F.age --out DEST
//!                               [--lease TOKEN] [--tee-key P256.pk8] [--ca PEM] [--threads N]
//!                               [--sim [--gpus N]]
//! ```
//! `run` is the node daemon ([`daemon`], over the state machine in [`node`]): it registers the
//! VM with the broker on composite evidence, heartbeats, re-attests, runs each lease's
//! workload with its weights decrypted inside the VM, reports what became of it, and stops
//! its workloads on SIGTERM. `fetch-weights` is one lease's weights, once:
//! Attests to the KBS (configfs-tsm on SNP/TDX; `--sim` for simulated evidence), fetches the
//! weights key released to this TEE — an age identity bound to the SHA-256 of the one age file
//! it may open (`cgx_protocol::weights`) — and decrypts the age file streaming, in parallel
//! chunks, hashing exactly the bytes it decrypts. DEST (0600, never overwritten) appears only
//! once every chunk authenticated and the file's digest equals the bound one: age
//! authenticates nothing about who encrypted a file, so without the digest anyone who knows
//! the (public) recipient could hand the VM weights of their own. On any failure the partial
//! plaintext is removed. Plaintext is written nowhere else.
//!
//! `--kbs` is `https://`, or `http://` to a literal loopback address or `localhost` only,
//! parsed as the transport parses it (no userinfo, query or fragment). `--tee-key` must be
//! private to its owner (mode 0600 or stricter).
//!
//! Exit codes: 0 done, 1 refused or failed, 2 usage.

use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

pub mod daemon;
pub mod evidence;
pub mod gpu;
pub mod init;
pub mod keyfile;
pub mod machine;
pub mod meter;
pub mod node;
pub mod prover;
pub mod reap;
pub mod tunnel;

use cgx_age::Identity;
use cgx_kbs::client::{KbsClient, Uri};
use cgx_protocol::kbs::jwe::{Curve, TeeKey};
use cgx_protocol::kbs::rcar::EvidenceSource;
use cgx_protocol::weights::WeightsKey;
use evidence::ConfigfsTsm;

const RUN_USAGE: &str = "usage: cgx-guest-agent run --broker URL --broker-key ED25519-B64 --kbs URL --token-file F --operator NAME --region R --price-micros N [--store DIR] [--work DIR] [--workload-uid N] [--ca PEM] [--threads N] [--channel PORT] [--sim-machine FILE | --sim [--gpus N]] [--sim-cheat-pow PCT]\n  (--channel: the virtio-serial port to the host agent; the operator token comes over it, --token-file is then unused)";

const USAGE: &str = "usage: cgx-guest-agent fetch-weights --kbs URL --resource REPO/TYPE/TAG --in F.age --out DEST [--lease TOKEN] [--tee-key P256.pk8] [--ca PEM] [--threads N] [--sim [--gpus N]]";

/// `fetch-weights`' arguments.
#[derive(Debug, Default)]
pub struct Args {
    pub kbs: String,
    pub resource: String,
    pub input: PathBuf,
    pub output: PathBuf,
    pub lease: Option<String>,
    /// The node key (EC P-256, PKCS#8) a lease names; a fresh key when absent.
    pub tee_key: Option<PathBuf>,
    pub ca: Option<PathBuf>,
    pub threads: usize,
    pub sim: bool,
    pub gpus: usize,
}

/// The first workload uid when the agent runs as root.
pub const DEFAULT_WORKLOAD_UID: u32 = 524_288;

/// `run`'s arguments.
#[derive(Debug, Default, Clone)]
pub struct RunArgs {
    pub options: daemon::Options,
    pub sim_machine: Option<PathBuf>,
    pub sim: bool,
    pub gpus: usize,
    /// The virtio-serial port to the host agent (a VM with no network address).
    pub channel: Option<String>,
}

/// A command line.
#[derive(Debug)]
pub enum Cli {
    Run(RunArgs),
    FetchWeights(Args),
    /// `sha256 FILE`: a file's SHA-256 (the image's smoke workload: it reads the decrypted
    /// weights a lease hands it, in the VM, and says what it read).
    Sha256(PathBuf),
}

/// Parse the command line (without the program name).
pub fn parse_cli(mut it: impl Iterator<Item = String>) -> Result<Cli, String> {
    match it.next().as_deref() {
        Some("run") => parse_run(it).map(Cli::Run),
        Some("fetch-weights") => parse(it).map(Cli::FetchWeights),
        Some("sha256") => match (it.next(), it.next()) {
            (Some(f), None) => Ok(Cli::Sha256(f.into())),
            _ => Err("usage: cgx-guest-agent sha256 FILE".into()),
        },
        Some("--help" | "-h") | None => Err(format!("{RUN_USAGE}\n{USAGE}")),
        Some(other) => Err(format!("unknown command '{other}'\n{RUN_USAGE}\n{USAGE}")),
    }
}

/// Parse `run`'s flags.
pub fn parse_run(mut it: impl Iterator<Item = String>) -> Result<RunArgs, String> {
    let mut a = RunArgs {
        options: daemon::Options {
            store: "/var/lib/cgx/weights".into(),
            work: "/run/cgx".into(),
            ..Default::default()
        },
        gpus: 1,
        ..Default::default()
    };
    let mut ca = None;
    let mut broker_key = None;
    // As root, workloads run as uids 524288 and up (past the ranges systems reserve: systemd's
    // end at 65535, container subordinate ids start above); otherwise as the agent.
    let root = reap::own_uid() == 0;
    a.options.workload_uid = root.then_some(DEFAULT_WORKLOAD_UID);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let o = &mut a.options;
        match flag.as_str() {
            "--broker" => o.broker = val()?,
            "--kbs" => o.kbs = val()?,
            "--broker-key" => broker_key = Some(val()?),
            "--workload-uid" => {
                let u: u32 = val()?
                    .parse()
                    .map_err(|_| "--workload-uid: a user id (1 to 4294967231)")?;
                if !root {
                    return Err("--workload-uid: only an agent running as root can run workloads as another user".into());
                }
                if u == 0 || u > u32::MAX - daemon::MAX_LEASES {
                    return Err(
                        "--workload-uid: a user id other than root's, with room for 64 after it"
                            .into(),
                    );
                }
                o.workload_uid = Some(u);
            }
            "--token-file" => o.token_file = val()?.into(),
            "--operator" => o.operator = val()?,
            "--region" => o.region = val()?,
            "--price-micros" => {
                o.price = cgx_protocol::money::Micros(
                    val()?
                        .parse()
                        .map_err(|_| "--price-micros: a whole number")?,
                )
            }
            "--store" => o.store = val()?.into(),
            "--work" => o.work = val()?.into(),
            "--ca" => ca = Some(PathBuf::from(val()?)),
            "--threads" => o.threads = val()?.parse().map_err(|_| "--threads: a number")?,
            "--sim-machine" => a.sim_machine = Some(val()?.into()),
            "--sim" => a.sim = true,
            "--gpus" => a.gpus = val()?.parse().map_err(|_| "--gpus: a number")?,
            "--sim-cheat-pow" => {
                o.pow_cheat = Some(
                    val()?
                        .parse()
                        .ok()
                        .filter(|p| (1..=100).contains(p))
                        .ok_or("--sim-cheat-pow: a percentage of rows to skip, 1 to 100")?,
                );
            }
            "--channel" => {
                let port = val()?;
                cgx_channel::frame::check_target(&port)
                    .map_err(|_| "--channel: a virtio-serial port's name (cgx.0)")?;
                a.channel = Some(port);
            }
            other => return Err(format!("unknown flag '{other}'\n{RUN_USAGE}")),
        }
    }
    if a.options.pow_cheat.is_some() && !a.sim && a.sim_machine.is_none() {
        return Err(
            "--sim-cheat-pow: only a simulated node (--sim, --sim-machine) may cheat".into(),
        );
    }
    let o = &a.options;
    if o.broker.is_empty()
        || o.kbs.is_empty()
        || (o.token_file.as_os_str().is_empty() && a.channel.is_none())
        || o.operator.is_empty()
        || o.region.is_empty()
    {
        return Err(RUN_USAGE.into());
    }
    check_url("--broker", &o.broker)?;
    check_url("--kbs", &o.kbs)?;
    // Through the host channel a loopback name leads to the host: only TLS protects it there.
    if a.channel.is_some() {
        for (flag, url) in [("--broker", &o.broker), ("--kbs", &o.kbs)] {
            if !url
                .get(..8)
                .is_some_and(|p| p.eq_ignore_ascii_case("https://"))
            {
                return Err(format!(
                    "{flag} {url}: with --channel the service is reached through the host; https:// only"
                ));
            }
        }
    }
    let key = broker_key.ok_or_else(|| {
        format!("--broker-key: the broker's lease-signing key is required (leases are verified under it)\n{RUN_USAGE}")
    })?;
    a.options.broker_key = cgx_protocol::broker::unb64(key.trim())
        .and_then(|k| k.try_into().ok())
        .ok_or("--broker-key: a 32-byte Ed25519 public key in base64")?;
    if let Some(p) = ca {
        a.options.ca = Some(std::fs::read(&p).map_err(|e| format!("{}: {e}", p.display()))?);
    }
    Ok(a)
}

/// Parse `fetch-weights`' flags.
pub fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
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
    check_url("--kbs", &a.kbs)?;
    Ok(a)
}

/// The KBS and the broker are reached over TLS; plain `http://` only on this machine's
/// loopback (tests, a development network, or the host agent's forwarder on a guest with no
/// network address), since the session cookie, the lease and the heartbeats travel in the
/// clear.
///
/// The URL is parsed with the transport's own URI parser, and anything that could make the
/// host we check differ from the host ureq connects to is refused: userinfo
/// (`http://localhost:80@evil.example/` connects to evil.example), a query or a fragment (the
/// client appends its paths to the base). Loopback means a literal loopback address or the
/// name `localhost`; `127.0.0.1.evil.example` is a name like any other.
fn check_url(flag: &str, url: &str) -> Result<(), String> {
    let refuse = |why: &str| Err(format!("{flag} {url}: {why}"));
    let uri: Uri = match url.parse() {
        Ok(u) => u,
        Err(e) => return refuse(&format!("not a URL ({e})")),
    };
    let Some(authority) = uri.authority() else {
        return refuse("not an https:// URL");
    };
    // The parser keeps userinfo in the authority, and `host()` skips it: the host ureq
    // connects to is the one after the '@', whatever precedes it.
    if authority.as_str().contains('@') {
        return refuse("a base URL has no userinfo (user@host)");
    }
    if uri.query().is_some() {
        return refuse("a base URL has no query");
    }
    // The parser drops a fragment without a trace, so it is looked for in the text.
    if url.contains('#') {
        return refuse("a base URL has no fragment");
    }
    let scheme = uri.scheme_str().unwrap_or("");
    if !scheme.eq_ignore_ascii_case("http") && !scheme.eq_ignore_ascii_case("https") {
        return refuse("not an https:// URL");
    }
    // What the client will request: the same authority, or the check proved nothing.
    let joined: Result<Uri, _> = format!("{}/kbs/v0/auth", url.trim_end_matches('/')).parse();
    if joined.ok().and_then(|j| j.authority().cloned()).as_ref() != Some(authority) {
        return refuse("the service's paths do not join onto this URL");
    }
    if scheme.eq_ignore_ascii_case("https") {
        return Ok(());
    }
    let host = authority.host();
    let literal = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let loopback = host.eq_ignore_ascii_case("localhost")
        || literal
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    if loopback {
        Ok(())
    } else {
        refuse("plain http:// is refused except to a loopback address or localhost; use https://")
    }
}

/// A reader that hashes every byte it hands on: the digest is of exactly the bytes decrypted,
/// so a file swapped on disk between a check and a read cannot slip past it.
struct Sha256Reader<R> {
    inner: R,
    ctx: aws_lc_rs::digest::Context,
}

impl<R: std::io::Read> std::io::Read for Sha256Reader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.ctx.update(&buf[..n]);
        Ok(n)
    }
}

/// A simulated machine made here (launch measurement all zeros, certificates from now).
#[cfg(feature = "sim")]
fn sim_node(gpus: usize) -> Result<cgx_kbs::sim::SimNode, String> {
    cgx_kbs::sim::SimNode::generate(gpus, [0u8; 48], daemon::unix_now()).map_err(|e| e.to_string())
}

#[cfg(feature = "sim")]
fn sim_source(gpus: usize) -> Result<Box<dyn EvidenceSource>, String> {
    Ok(Box::new(sim_node(gpus)?))
}

#[cfg(not(feature = "sim"))]
fn sim_source(_: usize) -> Result<Box<dyn EvidenceSource>, String> {
    Err("this build has no simulator (built without the sim feature)".into())
}

/// Attest, fetch the weights key, decrypt: what `fetch-weights` does.
pub fn run(a: &Args) -> Result<(), String> {
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
            let der = keyfile::read_private_key(p)?;
            TeeKey::ec_from_der(Curve::P256, &der).map_err(|e| e.to_string())?
        }
        None => TeeKey::generate_ec(Curve::P256).map_err(|e| e.to_string())?,
    };
    let mut client = KbsClient::new(&a.kbs, ca.as_deref(), key).map_err(|e| e.to_string())?;
    client.attest(source.as_ref()).map_err(|e| e.to_string())?;
    let secret = client
        .resource(&a.resource, a.lease.as_deref())
        .map_err(|e| e.to_string())?;
    let (n, s) = decrypt_weights(secret, &a.resource, &a.input, &a.output, a.threads)?;
    eprintln!(
        "decrypted {n} bytes into {} in {s:.2} s ({:.2} GB/s)",
        a.output.display(),
        n as f64 / s.max(1e-9) / 1e9
    );
    Ok(())
}

/// Decrypt `input` (an age file) into `output` with the weights key `secret` the KBS released
/// for `resource`: streaming, `threads` chunks in parallel, hashing exactly the bytes decrypted.
/// `output` (0600, never overwritten) appears only once every chunk authenticated and the
/// file's digest equals the one the key binds; on failure the partial plaintext is removed.
/// The bytes written and the seconds it took.
pub fn decrypt_weights(
    secret: Vec<u8>,
    resource: &str,
    input: &std::path::Path,
    output: &std::path::Path,
    threads: usize,
) -> Result<(u64, f64), String> {
    let key = WeightsKey::parse(&secret).map_err(|e| format!("{resource}: {e}"))?;
    drop(secret);
    let identity = Identity::parse(key.identity()).map_err(|e| e.to_string())?;
    let input_path = input;
    let input =
        std::fs::File::open(input_path).map_err(|e| format!("{}: {e}", input_path.display()))?;
    let len = input
        .metadata()
        .map_err(|e| format!("{}: {e}", input_path.display()))?
        .len();
    let mut input = Sha256Reader {
        inner: input,
        ctx: aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256),
    };
    // Plaintext goes to a temporary file beside DEST (created 0600), and DEST appears only
    // once every chunk has been authenticated: a reader of DEST never sees a prefix of weights
    // that a later chunk would have refused. DEST is never overwritten.
    if output.exists() {
        return Err(format!("{}: exists; not overwritten", output.display()));
    }
    let name = output
        .file_name()
        .ok_or_else(|| format!("{}: not a file name", output.display()))?
        .to_string_lossy()
        .into_owned();
    let mut tag = [0u8; 6];
    aws_lc_rs::rand::fill(&mut tag).map_err(|_| "random".to_string())?;
    let tmp = output.with_file_name(format!(".{name}.partial-{}", hex::encode(tag)));
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
    let result = cgx_age::decrypt(&identity, &mut input, len, &mut out, threads, &mut |_| {})
        .map_err(|e| e.to_string())
        .and_then(|n| {
            out.flush().map_err(|e| e.to_string())?;
            out.get_ref().sync_all().map_err(|e| e.to_string())?;
            Ok(n)
        })
        // Every byte of the file went through the hasher (decrypt reads to its end and refuses
        // trailing bytes); DEST appears only for the file the key was bound to.
        .and_then(|n| {
            let got = input.ctx.clone().finish();
            if got.as_ref() == key.sha256() {
                Ok(n)
            } else {
                Err(format!(
                    "{}: weights digest mismatch: the file's SHA-256 is {}, the key {} binds {}; \
                     not the tenant's weights, refused",
                    input_path.display(),
                    hex::encode(got.as_ref()),
                    resource,
                    hex::encode(key.sha256())
                ))
            }
        })
        // Linking fails if DEST appeared meanwhile: never overwritten.
        .and_then(|n| {
            std::fs::hard_link(&tmp, output)
                .map(|()| n)
                .map_err(|e| format!("{}: {e}", output.display()))
        });
    drop(out);
    let _ = std::fs::remove_file(&tmp);
    result.map(|n| (n, t.elapsed().as_secs_f64()))
}

/// The machine `run` attests: configfs-tsm inside a confidential VM, or a simulated one.
fn machine(a: &RunArgs) -> Result<std::sync::Arc<dyn machine::Machine>, String> {
    if let Some(p) = &a.sim_machine {
        return sim_machine(Some(p), 0);
    }
    if a.sim {
        return sim_machine(None, a.gpus);
    }
    let (m, no_gpus) = machine::TsmMachine::load();
    if let Some(why) = no_gpus {
        eprintln!("cgx-guest-agent: {why}");
    }
    if !m.tsm.root.is_dir() {
        return Err(format!(
            "{} does not exist: not a confidential VM with configfs-tsm (use --sim-machine or --sim outside one)",
            m.tsm.root.display()
        ));
    }
    Ok(std::sync::Arc::new(m))
}

#[cfg(feature = "sim")]
fn sim_machine(
    file: Option<&std::path::Path>,
    gpus: usize,
) -> Result<std::sync::Arc<dyn machine::Machine>, String> {
    let node = match file {
        Some(p) => {
            let bytes = keyfile::read_private(p, 4 << 20)?;
            cgx_kbs::sim::SimNode::from_json(&bytes).map_err(|e| format!("{}: {e}", p.display()))?
        }
        None => sim_node(gpus)?,
    };
    Ok(std::sync::Arc::new(machine::SimMachine { node }))
}

#[cfg(not(feature = "sim"))]
fn sim_machine(
    _: Option<&std::path::Path>,
    _: usize,
) -> Result<std::sync::Arc<dyn machine::Machine>, String> {
    Err("this build has no simulator (built without the sim feature)".into())
}

/// With `--channel`: the forwarders the broker's and the KBS's names are pinned to, and a
/// simulated machine the host provisions, fetched once into its file when absent (0600).
fn through_channel(a: &mut RunArgs) -> Result<(), String> {
    let Some(port) = a.channel.clone() else {
        return Ok(());
    };
    let t = tunnel::Tunnel::start(&port)?;
    let o = &mut a.options;
    for (target, url) in [("broker", o.broker.clone()), ("kbs", o.kbs.clone())] {
        let addr = t.forward(target)?;
        let pin = cgx_kbs::client::Pin::of_url(&url, addr)
            .ok_or_else(|| format!("{url}: not a URL with a host"))?;
        // One forwarder per service: a second pin of the same host and port would never be
        // used, and the KBS's traffic would go to the broker's target.
        if o.pins
            .iter()
            .any(|p| p.host == pin.host && p.port == pin.port)
        {
            return Err(format!(
                "--broker and --kbs name the same service ({url}); they must differ"
            ));
        }
        o.pins.push(pin);
    }
    // The operator's token is asked for at each registration (daemon::register).
    let mut files = Vec::new();
    if let Some(m) = &a.sim_machine {
        files.push(("sim-machine", m.clone()));
    }
    if !a.options.store.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&a.options.store)
            .map_err(|e| format!("{}: {e}", a.options.store.display()))?;
    }
    for (target, path) in files {
        if !path.exists() {
            t.fetch_to(target, &path, std::time::Duration::from_secs(60))?;
        }
    }
    a.options.channel = Some(t);
    Ok(())
}

fn sha256_file(p: &std::path::Path) -> Result<(), String> {
    let mut f = std::fs::File::open(p).map_err(|e| format!("{}: {e}", p.display()))?;
    let mut r = Sha256Reader {
        inner: &mut f,
        ctx: aws_lc_rs::digest::Context::new(&aws_lc_rs::digest::SHA256),
    };
    let n =
        std::io::copy(&mut r, &mut std::io::sink()).map_err(|e| format!("{}: {e}", p.display()))?;
    println!(
        "{}  {} ({n} bytes)",
        hex::encode(r.ctx.finish()),
        p.display()
    );
    Ok(())
}

/// `run`: the daemon until SIGTERM or SIGINT.
pub fn run_daemon(a: &RunArgs) -> Result<(), String> {
    let mut a = a.clone();
    through_channel(&mut a)?;
    let a = &a;
    let machine = machine(a)?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, stop.clone()).map_err(|e| e.to_string())?;
    }
    daemon::run(&a.options, machine, &stop)
}

/// The program from the command line as the OS hands it (without the program name):
/// arguments that are not UTF-8 are a usage error, not a panic.
pub fn main_os(args: impl Iterator<Item = std::ffi::OsString>) -> ExitCode {
    // The image's /init: the kernel starts it as process 1, with no arguments (a container's
    // process 1 is given its command, and runs it).
    let args: Vec<std::ffi::OsString> = args.collect();
    if std::process::id() == 1 && args.is_empty() {
        return init::main();
    }
    match args
        .into_iter()
        .map(std::ffi::OsString::into_string)
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(args) => main_with(args.into_iter()),
        Err(_) => {
            eprintln!("cgx-guest-agent: an argument is not UTF-8");
            ExitCode::from(2)
        }
    }
}

/// The program: parse `args` (without the program name), run, and say how it ended.
pub fn main_with(args: impl Iterator<Item = String>) -> ExitCode {
    let cli = match parse_cli(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let result = match cli {
        Cli::FetchWeights(a) => run(&a),
        Cli::Run(a) => run_daemon(&a),
        Cli::Sha256(f) => sha256_file(&f),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "cgx-guest-agent: {e}");
            ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn through_the_host_channel_only_tls() {
        let base = |broker: &str, kbs: &str| {
            [
                "--broker",
                broker,
                "--kbs",
                kbs,
                "--broker-key",
                "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo",
                "--operator",
                "op1",
                "--region",
                "eu",
                "--channel",
                "cgx.0",
            ]
            .map(String::from)
            .to_vec()
        };
        // No --token-file with a channel: the token comes over it.
        let a = parse_run(base("https://b.example", "https://k.example").into_iter()).unwrap();
        assert_eq!(a.channel.as_deref(), Some("cgx.0"));
        for (broker, kbs, flag) in [
            ("http://127.0.0.1:1", "https://k.example", "--broker"),
            ("https://b.example", "http://localhost:2", "--kbs"),
        ] {
            let e = parse_run(base(broker, kbs).into_iter()).unwrap_err();
            assert!(e.starts_with(flag) && e.contains("https:// only"), "{e}");
        }
        let mut bad = base("https://b.example", "https://k.example");
        bad[11] = "../cgx.0".into();
        assert!(
            parse_run(bad.into_iter())
                .unwrap_err()
                .contains("--channel")
        );
        // Without a channel the token file is required.
        let mut no_channel = base("https://b.example", "https://k.example");
        no_channel.truncate(10);
        assert!(
            parse_run(no_channel.into_iter())
                .unwrap_err()
                .starts_with("usage")
        );
    }

    #[test]
    fn kbs_url_rule() {
        for (url, why) in [
            ("http://localhost:80@evil.example/", "userinfo"),
            ("https://user:pw@kbs.example/", "userinfo"),
            ("http://127.0.0.1.evil.example/", "loopback"),
            ("http://localhost.evil.example:8080", "loopback"),
            ("http://kbs.example:8080", "loopback"),
            ("http://10.0.0.1/", "loopback"),
            ("http://[::ffff:127.0.0.1]/", "loopback"),
            ("http://127.0.0.1/?a", "query"),
            ("http://127.0.0.1/#a", "fragment"),
            ("ftp://kbs.example", "https://"),
            ("file:///etc/passwd", "not a URL"),
            ("file://localhost/etc/passwd", "https://"),
            ("127.0.0.1:8080", "https://"),
            ("http://", "not a URL"),
            ("http://127.0.0.1 /", "not a URL"),
        ] {
            let e = check_url("--kbs", url).unwrap_err();
            assert!(e.starts_with("--kbs ") && e.contains(why), "{url}: {e}");
        }
        for url in [
            "https://kbs.example",
            "https://kbs.example:8443/",
            "http://127.0.0.1:1",
            "http://127.9.9.9:1/",
            "http://localhost:1",
            "HTTP://LOCALHOST:1",
            "http://[::1]:1",
        ] {
            check_url("--kbs", url).unwrap();
        }
    }
}
