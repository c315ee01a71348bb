//! `cgx-bench console` (issue 34, item 9): the web console's pages on a broker holding
//! 100 000 nodes, 100 000 jobs and a log of 1 000 000 leaves — server time per page (the
//! `Server-Timing` the console sends: p50, p99), bytes per page, and the broker's CPU per page
//! view against a plain API call (`GET /v1/nodes/{id}`, `GET /v1/jobs/{id}`) measured in the
//! same run. Each user signs in as a browser would (the sign-in page's challenge, answered
//! with a `ConsoleLogin` record under its API key).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use cgx_broker::server::BrokerConfig;
use cgx_protocol::records::ConsoleLogin;
use cgx_protocol::signed::Signer;
use serde_json::json;

use crate::CliResult;

/// A keep-alive HTTP/1.1 connection (the broker answers every console page with a length).
struct Http {
    addr: SocketAddr,
    stream: Option<TcpStream>,
}

struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn cookies(&self) -> Vec<(String, String)> {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case("set-cookie"))
            .filter_map(|(_, v)| v.split(';').next()?.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// The `Server-Timing` duration (ms).
    fn server_ms(&self) -> Option<f64> {
        self.header("server-timing")?
            .split("dur=")
            .nth(1)?
            .parse()
            .ok()
    }
}

impl Http {
    fn new(addr: SocketAddr) -> Http {
        Http { addr, stream: None }
    }

    fn req(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Resp, String> {
        let r = self.exchange(method, path, headers, body);
        if r.is_err() {
            self.stream = None;
        }
        r
    }

    fn exchange(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Resp, String> {
        if self.stream.is_none() {
            let s = TcpStream::connect(self.addr).map_err(|e| e.to_string())?;
            s.set_nodelay(true).map_err(|e| e.to_string())?;
            s.set_read_timeout(Some(Duration::from_secs(30)))
                .map_err(|e| e.to_string())?;
            self.stream = Some(s);
        }
        let s = self.stream.as_mut().ok_or("no connection")?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes()).map_err(|e| e.to_string())?;
        s.write_all(body).map_err(|e| e.to_string())?;
        let mut buf = Vec::with_capacity(64 * 1024);
        let mut chunk = [0u8; 64 * 1024];
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = s.read(&mut chunk).map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("connection closed".into());
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let text = String::from_utf8_lossy(&buf[..end]).into_owned();
        let mut lines = text.split("\r\n");
        let status: u16 = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|c| c.parse().ok())
            .ok_or("no status line")?;
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect();
        let len: usize = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.parse().ok())
            .ok_or("no content-length")?;
        let mut body = buf[end..].to_vec();
        while body.len() < len {
            let n = s.read(&mut chunk).map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("connection closed mid-body".into());
            }
            body.extend_from_slice(&chunk[..n]);
        }
        body.truncate(len);
        Ok(Resp {
            status,
            headers,
            body,
        })
    }
}

fn signer(key: &Path) -> Result<Signer, String> {
    let der = std::fs::read(key).map_err(|e| format!("{}: {e}", key.display()))?;
    Signer::from_pkcs8(&der).map_err(|e| e.to_string())
}

/// Sign in as a browser does: the session cookie header.
fn sign_in(http: &mut Http, key: &Path) -> Result<String, String> {
    let page = http.req("GET", "/console/login", &[], b"")?;
    let login = page
        .cookies()
        .into_iter()
        .find(|(k, _)| k == "__Host-cgx_login")
        .ok_or("no sign-in cookie")?;
    let body = String::from_utf8_lossy(&page.body).into_owned();
    let challenge = body
        .split("--challenge ")
        .nth(1)
        .and_then(|r| r.split(|c: char| c.is_whitespace() || c == '<').next())
        .ok_or("no challenge on the sign-in page")?
        .to_string();
    let now = cgx_devnet::now();
    let token = signer(key)?
        .sign(&ConsoleLogin { challenge }, now, now + 120)
        .map_err(|e| e.to_string())?;
    let form = format!("token={token}");
    let cookie = format!("__Host-cgx_login={}", login.1);
    let r = http.req(
        "POST",
        "/console/login",
        &[
            ("Cookie", &cookie),
            ("Content-Type", "application/x-www-form-urlencoded"),
            ("Sec-Fetch-Site", "same-origin"),
        ],
        form.as_bytes(),
    )?;
    let session = r
        .cookies()
        .into_iter()
        .find(|(k, _)| k == "__Host-cgx_session")
        .ok_or_else(|| {
            format!(
                "sign-in refused ({}): {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            )
        })?;
    Ok(format!("__Host-cgx_session={}", session.1))
}

fn server_cpu() -> f64 {
    crate::kbs::thread_cpu_secs(&["broker-server", "sqlx-sqlite"]).unwrap_or(0.0)
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// `n` views of `path` with `headers`: (p50 ms, p99 ms, bytes, server CPU µs per view).
fn measure(
    http: &mut Http,
    path: &str,
    headers: &[(&str, &str)],
    n: usize,
    server_time: bool,
) -> Result<serde_json::Value, String> {
    for _ in 0..5 {
        let r = http.req("GET", path, headers, b"")?;
        if r.status != 200 {
            return Err(format!(
                "{path}: {} {}",
                r.status,
                String::from_utf8_lossy(&r.body)
                    .chars()
                    .take(300)
                    .collect::<String>()
            ));
        }
    }
    let mut times = Vec::with_capacity(n);
    let mut bytes = 0usize;
    let cpu0 = server_cpu();
    for _ in 0..n {
        let r = http.req("GET", path, headers, b"")?;
        if r.status != 200 {
            return Err(format!("{path}: {}", r.status));
        }
        bytes = r.body.len();
        if server_time {
            times.push(r.server_ms().ok_or("no Server-Timing")?);
        }
    }
    let cpu_us = (server_cpu() - cpu0) * 1e6 / n as f64;
    times.sort_by(f64::total_cmp);
    Ok(json!({
        "path": path, "views": n, "bytes": bytes,
        "server_ms_p50": pct(&times, 0.5), "server_ms_p99": pct(&times, 0.99),
        "cpu_us_per_view": cpu_us,
    }))
}

/// `cgx-bench console`.
pub fn bench(
    nodes: usize,
    jobs: usize,
    leaves: u64,
    views: usize,
    keep: Option<&Path>,
    json_out: bool,
) -> CliResult {
    if nodes == 0 || jobs < 20 || leaves == 0 || views == 0 {
        return Err("--nodes, --leaves and --views positive, --jobs at least 20".into());
    }
    let dir = match keep {
        Some(d) => d.to_path_buf(),
        None => std::env::temp_dir().join(format!("cgx-bench-console-{}", std::process::id())),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    eprintln!(
        "seeding {nodes} nodes, {jobs} jobs and {leaves} log leaves in {} …",
        dir.display()
    );
    let seed = rt
        .block_on(cgx_broker::server::bench::console_seed(
            &dir, nodes, jobs, leaves,
        ))
        .map_err(|e| e.to_string())?;
    drop(rt);
    let config: BrokerConfig =
        serde_json::from_value(seed.config.clone()).map_err(|e| e.to_string())?;
    let t = std::time::Instant::now();
    let server = cgx_devnet::broker::BrokerServer::start(&config).map_err(|e| e.to_string())?;
    let start_secs = t.elapsed().as_secs_f64();
    let mut http = Http::new(server.addr);
    let tenant = sign_in(&mut http, &seed.tenant_key)?;
    let operator = sign_in(&mut http, &seed.operator_key)?;
    let auditor = sign_in(&mut http, &seed.auditor_key)?;
    let first_node = "n00000000";
    let pages: Vec<(&str, String, &String)> = vec![
        ("tenant: jobs, first page", "/console/jobs".into(), &tenant),
        (
            "tenant: jobs, a middle page",
            format!("/console/jobs?after={}", seed.job_cursor_mid),
            &tenant,
        ),
        (
            "tenant: a job",
            format!("/console/jobs/{}", seed.job_id),
            &tenant,
        ),
        ("tenant: statement", "/console/statement".into(), &tenant),
        (
            "operator: nodes, first page",
            "/console/nodes".into(),
            &operator,
        ),
        (
            "operator: nodes, a middle page",
            format!("/console/nodes?after={}", seed.node_mid),
            &operator,
        ),
        (
            "operator: a node",
            format!("/console/nodes/n{:08}", 1),
            &operator,
        ),
        (
            "auditor: nodes, a middle page",
            format!("/console/nodes?after={}", seed.node_mid),
            &auditor,
        ),
        (
            "auditor: jobs, a middle page",
            format!("/console/jobs?after={}", seed.job_cursor_mid),
            &auditor,
        ),
        ("auditor: log", "/console/log".into(), &auditor),
        (
            "auditor: log, older page",
            format!("/console/log?before={}", seed.seq_mid),
            &auditor,
        ),
        (
            "auditor: log search (a node)",
            format!("/console/log?q={}", seed.node_mid),
            &auditor,
        ),
        (
            "auditor: a decision with its proof",
            format!("/console/log/events/{}", seed.seq_mid),
            &auditor,
        ),
    ];
    let mut results = Vec::new();
    for (name, path, cookie) in &pages {
        let mut r = measure(&mut http, path, &[("Cookie", cookie)], views, true)?;
        r["page"] = json!(name);
        eprintln!(
            "{name:<38} p50 {:>7.2} ms  p99 {:>7.2} ms  {:>7} bytes  {:>7.0} µs CPU",
            r["server_ms_p50"].as_f64().unwrap_or(0.0),
            r["server_ms_p99"].as_f64().unwrap_or(0.0),
            r["bytes"],
            r["cpu_us_per_view"].as_f64().unwrap_or(0.0)
        );
        results.push(r);
    }
    // The API's reads of one node and one job, under the same keys.
    let now = cgx_devnet::now();
    let bearer = |key: &Path| -> Result<String, String> {
        let t = cgx_service::auth::BearerKind::BrokerApi
            .sign(&signer(key)?, now, now + 3000)
            .map_err(|e| e.to_string())?;
        Ok(format!("Bearer {t}"))
    };
    let auditor_bearer = bearer(&seed.auditor_key)?;
    let api_node = measure(
        &mut http,
        &format!("/v1/nodes/{first_node}"),
        &[("Authorization", &auditor_bearer)],
        views,
        false,
    )?;
    let api_job = measure(
        &mut http,
        &format!("/v1/jobs/{}", seed.job_id),
        &[("Authorization", &auditor_bearer)],
        views,
        false,
    )?;
    server.stop();
    if keep.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let api_cpu = (api_node["cpu_us_per_view"].as_f64().unwrap_or(0.0)
        + api_job["cpu_us_per_view"].as_f64().unwrap_or(0.0))
        / 2.0;
    let p99_max = results
        .iter()
        .filter_map(|r| r["server_ms_p99"].as_f64())
        .fold(0.0, f64::max);
    let mut cpus: Vec<f64> = results
        .iter()
        .filter_map(|r| r["cpu_us_per_view"].as_f64())
        .collect();
    cpus.sort_by(f64::total_cmp);
    let page_cpu = pct(&cpus, 0.5);
    let out = json!({
        "nodes": nodes, "jobs": jobs, "log_leaves": leaves, "views_per_page": views,
        "seed_secs": seed.seed_secs, "broker_start_secs": start_secs,
        "pages": results,
        "api": { "node": api_node, "job": api_job },
        "worst_page_p99_ms": p99_max, "goal_p99_ms": 50.0,
        "median_page_cpu_us": page_cpu, "api_call_cpu_us": api_cpu,
        "page_cpu_over_api_call": page_cpu / api_cpu.max(1e-9),
    });
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(&out).map_err(|e| e.to_string())?
        );
    } else {
        println!(
            "console over {nodes} nodes, {jobs} jobs, {leaves} log leaves: worst page p99 {p99_max:.2} ms server time (goal < 50 ms); a page view costs the broker {page_cpu:.0} µs CPU (median over pages), an API read {api_cpu:.0} µs: ratio {:.1}",
            page_cpu / api_cpu.max(1e-9)
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}
