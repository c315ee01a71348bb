//! `cgx bench kbs`: full KBS flows per second against a loopback KBS, p50/p99 at a paced load,
//! CPU per flow by side, and weights decryption against raw ChaCha20-Poly1305.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cgx_age::Identity;
use serde_json::{Value, json};

use crate::CliResult;

fn now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

// ---------------------------------------------------------------------------- bench

/// What the machine did to the run: hypervisor steal and stalls (see [`stall_probe`]).
fn host_line(run: &Value) -> String {
    let dry = if run["amd_sp_presigned"] == false {
        "; the simulated AMD-SP's precomputed nonces ran out, later reports were signed in the window"
    } else {
        ""
    };
    format!(
        "    host: steal {}% of CPU time, {} wake-ups late by > 10 ms (longest {} ms){dry}",
        run["host_steal_pct"], run["stalls_over_10ms"], run["longest_stall_ms"]
    )
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// `cgx bench kbs`: `clients` concurrent clients doing full flows (auth → attest → resource;
/// every released JWE is then decrypted and checked, after the timed window) against a local
/// KBS with simulated SNP evidence, for `secs`; then weights
/// decryption throughput against raw ChaCha20-Poly1305, per core count.
pub fn bench(
    clients: usize,
    secs: f64,
    rate: Option<f64>,
    gpus: usize,
    weights_mib: usize,
    json_out: bool,
) -> CliResult {
    if rate.is_some_and(|r| !(1.0..=1e6).contains(&r)) {
        return Err("--rate must be between 1 and 1e6 flows/s".into());
    }
    if clients == 0 || !(0.5..=600.0).contains(&secs) {
        return Err("--clients must be positive and --seconds within 0.5..600".into());
    }
    let node = std::sync::Arc::new(sim_node(gpus)?);
    let setup = cgx_devnet::setup(&[&node], None).map_err(|e| e.to_string())?;
    let server =
        cgx_devnet::Server::start_named(&setup.config, SERVER_THREAD).map_err(|e| e.to_string())?;
    server
        .put_resource(&setup.admin, BENCH_RESOURCE, &BENCH_VALUE, false)
        .map_err(|e| e.to_string())?;
    let addr = server.addr;
    let closed = load(addr, &node, clients, secs, None);
    let paced = rate.map(|r| load(addr, &node, clients, secs, Some(r)));
    server.stop();
    setup.cleanup();
    let floor = crypto_floor_ms(gpus)?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let bound = cores * 1e3 / floor;
    let trustee = 220.0;
    let closed = closed?;
    let kbs = json!({
        "clients": clients,
        "gpus_per_node": gpus,
        "closed_loop": closed.json(),
        "paced": match paced { Some(p) => p?.json(), None => Value::Null },
        "vs_trustee_220": (closed.flows_per_s() / trustee * 100.0).round() / 100.0,
        "crypto_floor_ms_per_flow": (floor * 1000.0).round() / 1000.0,
        "crypto_bound_per_s": bound.round(),
        "vs_crypto_bound": (closed.flows_per_s() / bound * 100.0).round() / 100.0,
    });
    let errors = closed.errors;
    let weights = weights_bench(weights_mib)?;
    let out = json!({"kbs": kbs, "weights": weights});
    if json_out {
        crate::print_json(&out)?;
    } else {
        println!(
            "kbs: {} clients (each its own keep-alive connection), {} GPU(s) per node, full flows (auth → attest → resource) with simulated SNP evidence (AMD-SP nonces precomputed before each run; every released JWE decrypted and checked after the window), clients and KBS on this machine",
            clients, gpus
        );
        let c = &out["kbs"]["closed_loop"];
        println!(
            "  closed loop: {} flows/s  p50 {} ms  p99 {} ms  errors {}  ({}× Trustee's ~220 flows/s)",
            c["flows_per_s"], c["p50_ms"], c["p99_ms"], c["errors"], out["kbs"]["vs_trustee_220"]
        );
        println!(
            "    CPU per flow: KBS {} ms, clients {} ms (KBS alone on every core: {} flows/s)",
            c["kbs_cpu_ms_per_flow"], c["client_cpu_ms_per_flow"], c["kbs_capacity_per_s"]
        );
        println!("{}", host_line(c));
        println!(
            "    bound: the flow's public-key operations alone take {} ms, so at most {} flows/s on these cores; ratio {}",
            out["kbs"]["crypto_floor_ms_per_flow"],
            out["kbs"]["crypto_bound_per_s"],
            out["kbs"]["vs_crypto_bound"]
        );
        let p = &out["kbs"]["paced"];
        if !p.is_null() {
            println!(
                "  paced at {} flows/s offered: {} flows/s  p50 {} ms  p99 {} ms  errors {}  (latency from each flow's scheduled start)",
                p["offered_per_s"], p["flows_per_s"], p["p50_ms"], p["p99_ms"], p["errors"]
            );
            println!(
                "    CPU per flow: KBS {} ms, clients {} ms",
                p["kbs_cpu_ms_per_flow"], p["client_cpu_ms_per_flow"]
            );
            println!("{}", host_line(p));
        }
        println!(
            "weights: age decryption of {weights_mib} MiB vs raw ChaCha20-Poly1305 (same chunks)"
        );
        if let Some(rows) = out["weights"]["by_threads"].as_array() {
            for r in rows {
                println!(
                    "  {} thread(s): decrypt {} GB/s  raw {} GB/s  ratio {}  scaling {}×",
                    r["threads"], r["decrypt_gb_s"], r["raw_gb_s"], r["ratio"], r["scaling"]
                );
            }
        }
    }
    Ok(if errors == 0 && !closed.lat.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Thread names that tell the KBS's CPU time from the simulated clients' in [`cpu_by_role`].
const SERVER_THREAD: &str = "kbs-server";
const CLIENT_THREAD: &str = "bench-client";

/// CPU seconds this process's threads have run so far, by role: (KBS, clients), from
/// `/proc/self/task/*/schedstat` (nanoseconds on CPU; robust to a noisy machine's steal time,
/// which wall-clock throughput is not). The KBS's threads: its runtime's workers, its serving
/// threads and the SQLite driver's worker threads. `None` where `/proc` does not say.
fn cpu_by_role() -> Option<(f64, f64)> {
    Some((
        // The serving threads too: with SQLite the KBS serves thread-per-core.
        thread_cpu_secs(&[
            SERVER_THREAD,
            cgx_service::server::SERVING_THREAD,
            "sqlx-sqlite",
        ])?,
        thread_cpu_secs(&[CLIENT_THREAD])?,
    ))
}

/// CPU seconds this process's threads whose names start with one of `prefixes` have used so
/// far (`/proc/self/task/*/schedstat`); `None` where `/proc` does not say.
pub(crate) fn thread_cpu_secs(prefixes: &[&str]) -> Option<f64> {
    tasks_sched(Path::new("/proc/self/task"), |comm| {
        prefixes.iter().any(|p| comm.starts_with(p))
    })
    .map(|t| t.0)
}

/// (CPU seconds, time slices) of the threads under `task_dir` (`/proc/<pid>/task`) whose names
/// `keep`: the sums of their `schedstat` run time (ns) and run count (how many times each was
/// put on a CPU). A thread that exited meanwhile is not counted; `None` where `/proc` does not
/// say.
pub(crate) fn tasks_sched(task_dir: &Path, keep: impl Fn(&str) -> bool) -> Option<(f64, u64)> {
    let (mut ns, mut slices) = (0u64, 0u64);
    for task in std::fs::read_dir(task_dir).ok()?.flatten() {
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(task.path().join("comm")),
            std::fs::read_to_string(task.path().join("schedstat")),
        ) else {
            continue; // the thread exited meanwhile
        };
        if keep(comm.trim()) {
            // Fields: run time (ns), time waiting on a run queue (ns), time slices run.
            let f: Vec<u64> = stat
                .split_whitespace()
                .map(|v| v.parse().unwrap_or(0))
                .collect();
            ns += f.first().copied().unwrap_or(0);
            slices += f.get(2).copied().unwrap_or(0);
        }
    }
    Some((ns as f64 / 1e9, slices))
}

/// (steal, total) jiffies of the whole machine so far, from `/proc/stat`: time the hypervisor
/// ran something else while this VM's CPUs wanted to run. `None` where `/proc` does not say.
pub(crate) fn host_steal() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = cpu
        .split_whitespace()
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is already
    // counted in user, so the total is the first eight.
    Some((*v.get(7)?, v.iter().take(8).sum()))
}

/// Wake-ups of a thread that sleeps 5 ms at a time, late by more than [`STALL`], while `on`
/// holds: how often the machine kept a runnable thread off every CPU that long. On a VM that is
/// mostly the host's doing (an idle 2-core VM here shows a few a minute, up to ~60 ms); a
/// late wake-up is also late for every flow waiting on that CPU, so p99 cannot be read without
/// it. Answers (count, longest in ms). Cost: 200 wake-ups a second.
fn stall_probe(on: Arc<AtomicBool>) -> std::io::Result<std::thread::JoinHandle<(u64, f64)>> {
    // Named, so its few microseconds are not counted as a client's (a thread inherits its
    // creator's name).
    std::thread::Builder::new()
        .name("stall-probe".into())
        .spawn(move || {
            let (mut count, mut longest) = (0u64, 0.0f64);
            let tick = Duration::from_millis(5);
            while on.load(Ordering::Relaxed) {
                let t = Instant::now();
                std::thread::sleep(tick);
                let late = t.elapsed().saturating_sub(tick);
                if late > STALL {
                    count += 1;
                }
                longest = longest.max(late.as_secs_f64() * 1e3);
            }
            (count, longest)
        })
}

/// A wake-up later than this counts as a stall.
const STALL: Duration = Duration::from_millis(10);

/// What one load run measured.
struct Load {
    offered: Option<f64>,
    window: f64,
    lat: Vec<f64>,
    errors: u64,
    first_error: Option<String>,
    /// CPU seconds (KBS, clients) spent during the window.
    cpu: Option<(f64, f64)>,
    /// Share of the machine's CPU time the hypervisor took during the window.
    steal: Option<f64>,
    /// Wake-ups late by more than [`STALL`] during the window, and the longest (ms).
    stalls: (u64, f64),
    /// Whether every report in the window was signed with a precomputed nonce.
    presigned: bool,
    /// Flows whose released JWE the guest decrypted and checked after the window.
    opened_after: usize,
}

impl Load {
    fn flows_per_s(&self) -> f64 {
        self.lat.len() as f64 / self.window.max(1e-9)
    }

    fn json(&self) -> Value {
        let n = self.lat.len().max(1) as f64;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let (server_ms, client_ms) = match self.cpu {
            Some((s, c)) => (Some(s / n * 1e3), Some(c / n * 1e3)),
            None => (None, None),
        };
        let round = |v: Option<f64>, k: f64| v.map(|v| (v * k).round() / k);
        json!({
            // CPU per completed flow, by side; the KBS's capacity if it had every core.
            "kbs_cpu_ms_per_flow": round(server_ms, 1000.0),
            "client_cpu_ms_per_flow": round(client_ms, 1000.0),
            "kbs_capacity_per_s": round(server_ms.map(|ms| cores * 1e3 / ms), 1.0),
            "offered_per_s": self.offered,
            "seconds": (self.window * 100.0).round() / 100.0,
            "flows": self.lat.len(),
            "flows_per_s": self.flows_per_s().round(),
            "p50_ms": (pct(&self.lat, 0.50) * 1e4).round() / 10.0,
            "p99_ms": (pct(&self.lat, 0.99) * 1e4).round() / 10.0,
            "errors": self.errors,
            "first_error": self.first_error,
            // The machine under the measurement (see [`stall_probe`]).
            "host_steal_pct": self.steal.map(|f| (f * 1000.0).round() / 10.0),
            "stalls_over_10ms": self.stalls.0,
            "longest_stall_ms": (self.stalls.1 * 10.0).round() / 10.0,
            "amd_sp_presigned": self.presigned,
            "jwes_opened_after_window": self.opened_after,
        })
    }
}

const BENCH_RESOURCE: &str = "bench/key/model";
const BENCH_VALUE: [u8; 32] = [7u8; 32];

/// One simulated guest's keep-alive HTTP/1.1 connection to the KBS, reopened after an error or
/// when the KBS closes it. Deliberately lean: each request is written whole in one call and
/// each answer parsed with `httparse` (what hyper itself parses with) into one reused buffer,
/// so the load generator leaves as much of the shared cores as it can to the KBS it measures.
/// It reads what the KBS sends: `Content-Length` bodies, no pipelining.
pub(crate) struct Conn {
    addr: std::net::SocketAddr,
    stream: Option<tokio::net::TcpStream>,
    buf: Vec<u8>,
}

/// An answer: status, body, the session cookie if one was set.
type Answer = (u16, Vec<u8>, Option<String>);

impl Conn {
    pub(crate) fn new(addr: std::net::SocketAddr) -> Self {
        Conn {
            addr,
            stream: None,
            buf: Vec::with_capacity(8192),
        }
    }

    /// One request; on any failure the connection is dropped (the next request reconnects).
    async fn request(
        &mut self,
        method: &str,
        path: &str,
        cookie: Option<&str>,
        body: &[u8],
    ) -> Result<Answer, String> {
        let extra = cookie.map(|c| ("cookie", c));
        self.request_with(method, path, extra.as_slice(), body)
            .await
    }

    /// One request with extra headers (e.g. `authorization`).
    pub(crate) async fn request_with(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Answer, String> {
        let answer = self.exchange(method, path, headers, body).await;
        if answer.is_err() {
            self.stream = None;
        }
        answer
    }

    async fn exchange(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Answer, String> {
        use tokio::io::AsyncWriteExt;
        let mut req = Vec::with_capacity(256 + body.len());
        write!(req, "{method} {path} HTTP/1.1\r\nhost: {}\r\n", self.addr)
            .map_err(|e| e.to_string())?;
        if !body.is_empty() {
            write!(
                req,
                "content-type: application/json\r\ncontent-length: {}\r\n",
                body.len()
            )
            .map_err(|e| e.to_string())?;
        }
        for (name, value) in headers {
            write!(req, "{name}: {value}\r\n").map_err(|e| e.to_string())?;
        }
        req.extend_from_slice(b"\r\n");
        req.extend_from_slice(body);
        let stream = match &mut self.stream {
            Some(s) => s,
            empty => {
                let tcp = tokio::net::TcpStream::connect(self.addr)
                    .await
                    .map_err(|e| format!("connect: {e}"))?;
                tcp.set_nodelay(true).map_err(|e| e.to_string())?;
                empty.insert(tcp)
            }
        };
        stream
            .write_all(&req)
            .await
            .map_err(|e| format!("send: {e}"))?;
        self.buf.clear();
        // Read until the head parses, then until the body is complete.
        let head = loop {
            read_more(stream, &mut self.buf, "the KBS closed the connection").await?;
            if let Some(head) = parse_head(&self.buf)? {
                break head;
            }
        };
        let (head_len, body_len) = (head.len, head.body_len);
        while self.buf.len() < head_len + body_len {
            read_more(
                stream,
                &mut self.buf,
                "the KBS closed the connection mid-answer",
            )
            .await?;
        }
        if self.buf.len() > head_len + body_len {
            return Err("bytes after the answer (nothing was pipelined)".into());
        }
        if head.close {
            self.stream = None;
        }
        Ok((head.status, self.buf[head_len..].to_vec(), head.set_cookie))
    }
}

/// What the bench reads of an answer's head.
struct Head {
    status: u16,
    /// Bytes of the head, body excluded.
    len: usize,
    body_len: usize,
    set_cookie: Option<String>,
    close: bool,
}

/// The head of the answer in `buf`, or `None` while it is incomplete.
fn parse_head(buf: &[u8]) -> Result<Option<Head>, String> {
    let mut headers = [httparse::EMPTY_HEADER; 24];
    let mut resp = httparse::Response::new(&mut headers);
    let httparse::Status::Complete(len) = resp.parse(buf).map_err(|e| format!("answer: {e}"))?
    else {
        return Ok(None);
    };
    let (mut body_len, mut set_cookie, mut close) = (None, None, false);
    for h in resp.headers.iter() {
        let v = std::str::from_utf8(h.value).unwrap_or("");
        if h.name.eq_ignore_ascii_case("content-length") {
            body_len = v.trim().parse::<usize>().ok();
        } else if h.name.eq_ignore_ascii_case("set-cookie") {
            set_cookie = Some(v.to_string());
        } else if h.name.eq_ignore_ascii_case("connection") {
            close = v.eq_ignore_ascii_case("close");
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(format!("answer: transfer-encoding {v} is not read here"));
        }
    }
    Ok(Some(Head {
        status: resp.code.unwrap_or(0),
        len,
        body_len: body_len.ok_or("answer without content-length")?,
        set_cookie,
        close,
    }))
}

/// Append what the connection has to `buf`; `closed` is the error when it has ended.
async fn read_more(
    stream: &mut tokio::net::TcpStream,
    buf: &mut Vec<u8>,
    closed: &str,
) -> Result<(), String> {
    use tokio::io::AsyncReadExt;
    match stream.read_buf(buf).await {
        Ok(0) => Err(closed.to_string()),
        Ok(_) => Ok(()),
        Err(e) => Err(format!("receive: {e}")),
    }
}

/// One full flow as a guest does it, through the client library's protocol steps
/// ([`cgx_protocol::kbs::rcar`]) with the guest's TEE key `key`: `auth`, evidence bound to the
/// nonce and key, `attest`, `resource`, and the JWE decrypted with the TEE key.
/// One full flow; answers the released resource as the KBS sent it (a JWE to `key`), which
/// [`opened`] checks.
async fn flow(
    conn: &mut Conn,
    node: &cgx_kbs::sim::SimNode,
    key: &cgx_protocol::kbs::jwe::TeeKey,
) -> Result<cgx_protocol::kbs_types::Response, String> {
    use cgx_protocol::kbs::rcar::{self, EvidenceSource};
    let e = |e: cgx_kbs::client::ClientError| e.to_string();
    let (status, body, set_cookie) = conn
        .request(
            "POST",
            rcar::AUTH_PATH,
            None,
            &rcar::auth_body(node.tee()).map_err(e)?,
        )
        .await?;
    let nonce = rcar::challenge(status, &body).map_err(e)?;
    let cookie =
        rcar::session_cookie(set_cookie.as_deref()).ok_or("the challenge set no cookie")?;
    let att = rcar::attestation(key, node, &nonce).map_err(e)?;
    let att = serde_json::to_vec(&att).map_err(|e| e.to_string())?;
    let (status, body, _) = conn
        .request("POST", rcar::ATTEST_PATH, Some(&cookie), &att)
        .await?;
    rcar::token(status, &body).map_err(e)?;
    let (status, body, _) = conn
        .request(
            "GET",
            &rcar::resource_path(BENCH_RESOURCE, None),
            Some(&cookie),
            &[],
        )
        .await?;
    rcar::jwe(status, &body).map_err(e)
}

/// The guest's side after a flow: decrypt the released JWE and check it is the resource.
fn opened(
    key: &cgx_protocol::kbs::jwe::TeeKey,
    jwe: &cgx_protocol::kbs_types::Response,
) -> Result<(), String> {
    let value = key.decrypt(jwe).map_err(|e| e.to_string())?;
    (value == BENCH_VALUE)
        .then_some(())
        .ok_or_else(|| "wrong resource".to_string())
}

/// Count a failed flow, keeping the first error's text.
fn failed(errors: &AtomicU64, first_error: &Mutex<Option<String>>, e: String) {
    errors.fetch_add(1, Ordering::Relaxed);
    if let Ok(mut f) = first_error.lock() {
        f.get_or_insert(e);
    }
}

/// Released JWEs held for checking after a load's window, across all guests (~0.3 KB each).
const DEFERRED: usize = 400_000;

/// Warm-up before a load's timed window (seconds).
fn warmup(secs: f64) -> f64 {
    (secs / 5.0).min(2.0)
}

/// A guest's TEE key pair. Like CoCo's KBS client (its builder makes one key and every later
/// attestation reuses it), each simulated guest makes one and keeps it for all its sessions.
fn tee_key() -> Result<cgx_protocol::kbs::jwe::TeeKey, String> {
    cgx_protocol::kbs::jwe::TeeKey::generate_ec(cgx_protocol::kbs::jwe::Curve::P256)
        .map_err(|e| e.to_string())
}

/// `clients` simulated guests, each on its own connection, doing full flows for `secs` after a
/// warm-up, as tasks on a load-generator runtime with a thread for every two cores (the clients
/// stand for other machines: on the KBS's own cores they should take as few threads and
/// wake-ups as they can; one thread instead of two cut their CPU per flow by ~13%). Closed
/// loop (`rate` None): each starts its next flow when the last ends. Paced: flows are
/// scheduled at `rate` per second in total, spread over the clients, and latency counts from
/// the scheduled start (so a KBS that falls behind shows it, rather than slowing the clients
/// down) to the resource's answer. Each guest opens its JWEs after the window (see `flow`).
fn load(
    addr: std::net::SocketAddr,
    node: &std::sync::Arc<cgx_kbs::sim::SimNode>,
    clients: usize,
    secs: f64,
    rate: Option<f64>,
) -> Result<Load, String> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let workers = (cores / 2).max(1);
    // Every flow's simulated AMD-SP signature nonce, made before the run on every core (see
    // `SimAmd::presign`): the AMD-SP is another machine's hardware, not a load on these cores.
    // A closed loop gets enough for 1 500 flows/s per core, above what the KBS reaches here;
    // if the pool still runs dry, signing goes on the ordinary way and the run says so.
    // At most 500 000 (~75 MB): a long run past that signs the rest in its window, and says so.
    let per_s = rate.unwrap_or(1500.0 * cores as f64);
    let nonces = (((secs + warmup(secs) + 1.0) * per_s * 1.1) as usize + clients).min(500_000);
    node.amd
        .presign(nonces.saturating_sub(node.amd.presigned_ready()), cores)
        .map_err(|e| e.to_string())?;
    let node = node.clone();
    // With one thread to spare, a current-thread runtime on a thread of our own: no worker
    // handoffs or cross-thread wake-ups among the clients.
    std::thread::Builder::new()
        .name(CLIENT_THREAD.into())
        .spawn(move || {
            let rt = if workers == 1 {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
            } else {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(workers)
                    .thread_name(CLIENT_THREAD)
                    .enable_all()
                    .build()
            }
            .map_err(|e| e.to_string())?;
            load_on(&rt, addr, &node, clients, secs, rate)
        })
        .map_err(|e| e.to_string())?
        .join()
        .map_err(|_| "the load generator's thread panicked".to_string())?
}

fn load_on(
    rt: &tokio::runtime::Runtime,
    addr: std::net::SocketAddr,
    node: &std::sync::Arc<cgx_kbs::sim::SimNode>,
    clients: usize,
    secs: f64,
    rate: Option<f64>,
) -> Result<Load, String> {
    rt.block_on(async {
        let stop = Arc::new(AtomicBool::new(false));
        let measuring = Arc::new(AtomicBool::new(false));
        let errors = Arc::new(AtomicU64::new(0));
        let first_error = Arc::new(Mutex::new(None::<String>));
        // Warm caches (policy memo, VM pools) with one flow before anything is timed.
        let key = tee_key()?;
        opened(&key, &flow(&mut Conn::new(addr), node, &key).await?)?;
        let warmup = Duration::from_secs_f64(warmup(secs));
        let t0 = Instant::now();
        let mut tasks = Vec::with_capacity(clients);
        for i in 0..clients {
            let (stop, measuring, errors, first_error, node) = (
                stop.clone(),
                measuring.clone(),
                errors.clone(),
                first_error.clone(),
                node.clone(),
            );
            tasks.push(tokio::spawn(async move {
                let mut conn = Conn::new(addr);
                let key = tee_key()?;
                let mut mine = Vec::new();
                // Released JWEs, decrypted and checked after the window: the guests' own
                // decryption (an ECDH each) happens on their machines, not on the KBS's cores
                // this bench shares. Past `DEFERRED` per guest, they are checked as they come.
                let mut sealed = Vec::new();
                let defer = (DEFERRED / clients).max(1);
                let mut k = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let start = match rate {
                        Some(r) => {
                            let at = t0
                                + Duration::from_secs_f64(
                                    (k as f64 * clients as f64 + i as f64) / r,
                                );
                            k += 1;
                            tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
                            at
                        }
                        None => Instant::now(),
                    };
                    let r = flow(&mut conn, &node, &key).await;
                    let took = start.elapsed().as_secs_f64();
                    if !measuring.load(Ordering::Relaxed) {
                        continue;
                    }
                    let r = match r {
                        Ok(jwe) if sealed.len() < defer => {
                            sealed.push((took, jwe));
                            continue;
                        }
                        Ok(jwe) => opened(&key, &jwe),
                        Err(e) => Err(e),
                    };
                    match r {
                        Ok(()) => mine.push(took),
                        Err(e) => failed(&errors, &first_error, e),
                    }
                }
                Ok::<_, String>((mine, key, sealed))
            }));
        }
        tokio::time::sleep(warmup).await;
        measuring.store(true, Ordering::Relaxed);
        let t = Instant::now();
        let before = cpu_by_role();
        let steal_before = host_steal();
        let probing = Arc::new(AtomicBool::new(true));
        let probe = stall_probe(probing.clone()).map_err(|e| e.to_string())?;
        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
        measuring.store(false, Ordering::Relaxed);
        let window = t.elapsed().as_secs_f64();
        let presigned = node.amd.presigned_ready() > 0;
        probing.store(false, Ordering::Relaxed);
        let cpu = before
            .zip(cpu_by_role())
            .map(|(b, a)| (a.0 - b.0, a.1 - b.1));
        let steal = steal_before
            .zip(host_steal())
            .and_then(|((s0, t0), (s1, t1))| {
                (t1 > t0).then(|| s1.saturating_sub(s0) as f64 / (t1 - t0) as f64)
            });
        stop.store(true, Ordering::Relaxed);
        let mut lat = Vec::new();
        let mut opened_after = 0;
        for t in tasks {
            match t.await {
                Ok(done) => {
                    let (mine, key, sealed) = done?;
                    lat.extend(mine);
                    // A flow counts once its JWE opens to the resource; one that does not is
                    // an error, as it would have been in the window.
                    opened_after += sealed.len();
                    for (took, jwe) in &sealed {
                        match opened(&key, jwe) {
                            Ok(()) => lat.push(*took),
                            Err(e) => failed(&errors, &first_error, e),
                        }
                    }
                }
                Err(e) => return Err(format!("client task: {e}")),
            }
        }
        lat.sort_by(f64::total_cmp);
        // Stopped with the window; it wakes within 5 ms.
        let stalls = probe.join().map_err(|_| "stall probe")?;
        let first_error = first_error.lock().map_err(|_| "lock")?.take();
        Ok(Load {
            offered: rate,
            window,
            lat,
            errors: errors.load(Ordering::Relaxed),
            first_error,
            cpu,
            steal,
            stalls,
            presigned,
            opened_after,
        })
    })
}

/// The public-key operations one flow cannot do without, timed one at a time on one thread in
/// this run with the fastest backend here, in milliseconds: the report's P-384 verification
/// under a prepared key (the verifier's cached VCEK, with its precomputed tables), the JWE's
/// ephemeral P-256 key generation (a guest keeps its TEE key across sessions, as CoCo's
/// client does), the KBS's P-256 agreement for the JWE and the EAR's EdDSA signature (over a
/// signing input of an EAR's size). Not the
/// AMD-SP's report signature (its nonce is precomputed before the run and what is left is no
/// public-key operation), nor the guest's agreement that opens the JWE (after the window). Per GPU: one more P-384
/// signature (the simulated GPU signs as it goes) and verification. No HTTP, JSON,
/// policy or storage: `cores / floor` bounds flows/s on this machine.
fn crypto_floor_ms(gpus: usize) -> Result<f64, String> {
    use aws_lc_rs::agreement::{ECDH_P256, PrivateKey, UnparsedPublicKey, agree};
    use aws_lc_rs::rand::SystemRandom;
    use aws_lc_rs::signature::{ECDSA_P384_SHA384_FIXED_SIGNING, EcdsaKeyPair, KeyPair};
    let rng = SystemRandom::new();
    let err = |_| "crypto".to_string();
    // Median of 5 rounds of 40 operations each.
    let time = |f: &mut dyn FnMut() -> Result<(), String>| -> Result<f64, String> {
        let mut rounds = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..40 {
                f()?;
            }
            rounds.push(t.elapsed().as_secs_f64() * 1e3 / 40.0);
        }
        rounds.sort_by(f64::total_cmp);
        Ok(rounds[2])
    };
    let vcek = EcdsaKeyPair::generate(&ECDSA_P384_SHA384_FIXED_SIGNING).map_err(err)?;
    let report = [0x5Au8; 0x2A0]; // the signed part of an SNP report
    let sig = vcek.sign(&rng, &report).map_err(err)?;
    let vk = {
        use cgx_attestation::crypto::{CryptoProvider, DEFAULT_PROVIDER, SigAlg};
        DEFAULT_PROVIDER
            .prepare(SigAlg::EcdsaP384Sha384Fixed, vcek.public_key().as_ref())
            .map_err(|_| "prepare VCEK".to_string())?
    };
    let ear = aws_lc_rs::signature::Ed25519KeyPair::generate().map_err(err)?;
    let peer = PrivateKey::generate(&ECDH_P256).map_err(err)?;
    let peer_pub = peer.compute_public_key().map_err(err)?.as_ref().to_vec();
    let p384_sign = time(&mut || vcek.sign(&rng, &report).map(|_| ()).map_err(err))?;
    let p384_verify = time(&mut || {
        vk.verify(&report, sig.as_ref())
            .map_err(|_| "P-384 verify".to_string())
    })?;
    let p256_keygen = time(&mut || {
        let k = PrivateKey::generate(&ECDH_P256).map_err(err)?;
        k.compute_public_key().map(|_| ()).map_err(err)
    })?;
    let mine = PrivateKey::generate(&ECDH_P256).map_err(err)?;
    let p256_agree = time(&mut || {
        agree(
            &mine,
            UnparsedPublicKey::new(&ECDH_P256, &peer_pub),
            "agreement".to_string(),
            |_| Ok(()),
        )
    })?;
    let signing_input = [b'e'; 1200];
    let ear_sign = time(&mut || {
        std::hint::black_box(ear.sign(&signing_input));
        Ok(())
    })?;
    Ok((1 + gpus) as f64 * p384_verify
        + gpus as f64 * p384_sign
        + p256_keygen
        + p256_agree
        + ear_sign)
}

fn sim_node(gpus: usize) -> Result<cgx_kbs::sim::SimNode, String> {
    cgx_kbs::sim::SimNode::generate(gpus, [0x3C; 48], now()).map_err(|e| e.to_string())
}

/// Decrypt throughput of an in-memory age file at 1..=cores threads, each against raw
/// ChaCha20-Poly1305 over the same 64 KiB chunks on the same threads (the bound).
fn weights_bench(mib: usize) -> Result<Value, String> {
    use aws_lc_rs::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
    let len = mib << 20;
    let id = Identity::generate().map_err(|e| e.to_string())?;
    let plain = vec![0xA5u8; len];
    let mut file = Vec::with_capacity(len + len / 1000 + 1024);
    cgx_age::encrypt(
        &id.recipient().map_err(|e| e.to_string())?,
        &mut &plain[..],
        len as u64,
        &mut file,
        0,
        &mut |_| {},
    )
    .map_err(|e| e.to_string())?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut rows = Vec::new();
    let mut one = 0.0;
    for threads in 1..=cores {
        let mut best_dec = f64::MAX;
        let mut best_raw = f64::MAX;
        for _ in 0..3 {
            let mut sink = std::io::sink();
            let t = Instant::now();
            cgx_age::decrypt(
                &id,
                &mut &file[..],
                file.len() as u64,
                &mut sink,
                threads,
                &mut |_| {},
            )
            .map_err(|e| e.to_string())?;
            best_dec = best_dec.min(t.elapsed().as_secs_f64());
            // Raw: ChaCha20-Poly1305 over the same chunks in memory, in place, on the same
            // threads (sealing costs what opening does); no I/O, no copies: the bound.
            let key = LessSafeKey::new(
                UnboundKey::new(&CHACHA20_POLY1305, &[1u8; 32]).map_err(|_| "key")?,
            );
            let mut bufs: Vec<Vec<u8>> = file.chunks(64 * 1024 + 16).map(<[u8]>::to_vec).collect();
            let t = Instant::now();
            let per = bufs.len().div_ceil(threads);
            std::thread::scope(|s| {
                for group in bufs.chunks_mut(per) {
                    let key = &key;
                    s.spawn(move || {
                        for b in group {
                            let _ = key.open_in_place(
                                Nonce::assume_unique_for_key([0; 12]),
                                Aad::empty(),
                                b,
                            );
                        }
                    });
                }
            });
            best_raw = best_raw.min(t.elapsed().as_secs_f64());
        }
        let dec = len as f64 / best_dec / 1e9;
        let raw = len as f64 / best_raw / 1e9;
        if threads == 1 {
            one = dec;
        }
        rows.push(json!({
            "threads": threads,
            "decrypt_gb_s": (dec * 100.0).round() / 100.0,
            "raw_gb_s": (raw * 100.0).round() / 100.0,
            "ratio": (dec / raw * 100.0).round() / 100.0,
            "scaling": (dec / one * 100.0).round() / 100.0,
        }));
    }
    Ok(json!({"mib": mib, "cores": cores, "by_threads": rows}))
}
