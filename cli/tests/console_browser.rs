#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The web console in a real browser: Debian's chromium driven through chromedriver (W3C
//! WebDriver, fantoccini) over a KBS and a broker on loopback with simulated nodes
//! heartbeating. Each kind of user signs in with the real `cgx console login`; a tenant
//! submits a job through the form with script in its fields (nothing runs) and sees it placed,
//! then fail over to another node without a reload, then cancels it; an operator and an
//! auditor walk their pages; a browser with JavaScript off reads every page; axe-core (from
//! the npm registry, `CGX_AXE_JS`) finds no serious or critical violation on any page.
//! Screenshots go to `target/console-screenshots/`.
//!
//! Without chromedriver (or `CGX_AXE_JS` for the accessibility part) the test says SKIPPED;
//! under `CGX_REQUIRE_PEERS=1` (CI) a missing browser is a failure.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cgx_devnet::broker::{BrokerServer, BrokerSetup, SimBrokerNode, broker_setup, offer};
use cgx_protocol::money::Micros;
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;

fn require_peers() -> bool {
    std::env::var("CGX_REQUIRE_PEERS").is_ok_and(|v| v == "1")
}

fn chromedriver() -> Option<PathBuf> {
    let p = std::env::var_os("CGX_CHROMEDRIVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromedriver"));
    p.exists().then_some(p)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// chromedriver on a loopback port, killed on drop.
struct Driver {
    child: Child,
    url: String,
}

impl Driver {
    fn start(bin: &Path) -> Driver {
        let port = free_port();
        let child = Command::new(bin)
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let url = format!("http://127.0.0.1:{port}");
        let t = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "chromedriver did not listen"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Driver { child, url }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A new headless chromium session with a fresh profile (JavaScript on or off).
async fn browser(driver: &Driver, javascript: bool) -> Client {
    let profile = std::env::temp_dir().join(format!(
        "cgx-console-chromium-{}-{}",
        std::process::id(),
        free_port()
    ));
    let mut opts = json!({
        "args": [
            "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run", "--disable-quic", "--window-size=1280,1000",
            format!("--user-data-dir={}", profile.display()),
        ],
    });
    if let Ok(bin) = std::env::var("CGX_CHROMIUM") {
        opts["binary"] = json!(bin);
    }
    if !javascript {
        opts["prefs"] = json!({ "profile.managed_default_content_settings.javascript": 2 });
    }
    let mut caps = serde_json::Map::new();
    caps.insert("browserName".into(), json!("chrome"));
    caps.insert("goog:chromeOptions".into(), opts);
    ClientBuilder::rustls()
        .unwrap()
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .unwrap()
}

/// A KBS and a broker on loopback, two nodes that heartbeat every second from threads until
/// told to stop.
struct Net {
    kbs: cgx_devnet::Setup,
    broker: BrokerSetup,
    keys: PathBuf,
}

impl Drop for Net {
    fn drop(&mut self) {
        self.kbs.cleanup();
        self.broker.cleanup();
        let _ = std::fs::remove_dir_all(&self.keys);
    }
}

fn heartbeating(
    node: Arc<SimBrokerNode>,
    client: cgx_broker::client::BrokerClient,
) -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    std::thread::spawn(move || {
        while !s.load(Ordering::Relaxed) {
            let _ = node.heartbeat(&client);
            std::thread::sleep(Duration::from_millis(500));
        }
    });
    stop
}

fn shots() -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/console-screenshots");
    std::fs::create_dir_all(&d).unwrap();
    d
}

async fn shot(c: &Client, name: &str) {
    let png = c.screenshot().await.unwrap();
    std::fs::write(shots().join(format!("{name}.png")), png).unwrap();
}

/// Sign in as the holder of `key` through the sign-in page and the real `cgx console login`.
async fn sign_in(c: &Client, base: &str, key: &Path) {
    c.goto(&format!("{base}/console/login")).await.unwrap();
    let command = c
        .find(Locator::Id("login-command"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let challenge = command
        .split_whitespace()
        .skip_while(|w| *w != "--challenge")
        .nth(1)
        .unwrap()
        .to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_cgx"))
        .args(["console", "login", "--broker", base, "--key"])
        .arg(key)
        .args(["--challenge", &challenge])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = String::from_utf8(out.stdout).unwrap();
    let field = c.find(Locator::Id("token")).await.unwrap();
    field.send_keys(token.trim()).await.unwrap();
    c.find(Locator::Css("form button[type=submit]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_until(c, 30, "signed in", |url, _| {
        !url.ends_with("/console/login")
    })
    .await;
}

/// Wait until `ready(url, main's text)` holds, polling; panics with `what` after `secs`.
async fn wait_until(
    c: &Client,
    secs: u64,
    what: &str,
    ready: impl Fn(&str, &str) -> bool,
) -> String {
    let t = Instant::now();
    loop {
        let url = c
            .current_url()
            .await
            .map(|u| u.to_string())
            .unwrap_or_default();
        let text = match c.find(Locator::Id("main")).await {
            Ok(m) => m.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        if ready(&url, &text) {
            return text;
        }
        assert!(
            t.elapsed() < Duration::from_secs(secs),
            "waited {secs} s for {what}: at {url}\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// axe-core's serious and critical violations on the current page (none when `CGX_AXE_JS`
/// names no file: said once by the caller).
async fn axe(c: &Client, axe_js: Option<&str>, page: &str) -> Vec<String> {
    let Some(src) = axe_js else { return Vec::new() };
    // Injected through WebDriver (not the page's own CSP-bound scripts).
    c.execute(src, vec![]).await.unwrap();
    let r = c
        .execute_async(
            "const done = arguments[arguments.length - 1];
             axe.run(document, { resultTypes: ['violations'] })
               .then(r => done(r.violations.map(v => ({ id: v.id, impact: v.impact, nodes: v.nodes.length }))))
               .catch(e => done([{ id: 'axe-error', impact: 'critical', nodes: String(e) }]));",
            vec![],
        )
        .await
        .unwrap();
    r.as_array()
        .unwrap()
        .iter()
        .filter(|v| matches!(v["impact"].as_str(), Some("serious" | "critical")))
        .map(|v| {
            format!(
                "{page}: {} ({}, {} nodes)",
                v["id"], v["impact"], v["nodes"]
            )
        })
        .collect()
}

/// The network runs its own runtimes (as `cgx up`'s does); the browser is driven from one of
/// the test's.
#[test]
fn the_console_in_a_real_browser() {
    let Some(driver_bin) = chromedriver() else {
        assert!(
            !require_peers(),
            "CGX_REQUIRE_PEERS=1 but no chromedriver (apt-get install chromium chromium-driver)"
        );
        eprintln!(
            "SKIPPED the_console_in_a_real_browser: no chromedriver (apt-get install chromium chromium-driver)"
        );
        return;
    };
    let axe_js = std::env::var("CGX_AXE_JS")
        .ok()
        .and_then(|p| std::fs::read_to_string(p).ok());
    if axe_js.is_none() {
        assert!(
            !require_peers(),
            "CGX_REQUIRE_PEERS=1 but CGX_AXE_JS names no axe.min.js"
        );
        eprintln!(
            "SKIPPED the accessibility check: CGX_AXE_JS names no axe.min.js (npm install axe-core)"
        );
    }

    // The network: two nodes in one region, one-second heartbeats so a failover shows fast.
    let a = Arc::new(SimBrokerNode::generate(2, offer(2, "eu-west", Micros(2_000_000))).unwrap());
    let b = Arc::new(SimBrokerNode::generate(2, offer(2, "eu-west", Micros(3_000_000))).unwrap());
    let sims = [&a.sim, &b.sim];
    let kbs = cgx_devnet::setup(&sims, None).unwrap();
    let pins: Vec<String> = kbs.pins.iter().map(hex::encode).collect();
    let mut broker = broker_setup(&kbs, pins, None).unwrap();
    broker.config.heartbeat_secs = 1;
    broker.config.monitor_interval_ms = 200;
    let keys = cgx_devnet::temp_dir("console-keys").unwrap();
    let net = Net { kbs, broker, keys };
    // The KBS, with the tenant's weights key released only through a lease; the broker
    // anchors its log and mirrors its releases with a `:log-reader` key.
    let kbs_server = cgx_devnet::Server::start(&net.kbs.config).unwrap();
    kbs_server
        .put_resource(&net.kbs.admin, RESOURCE, b"the weights key", true)
        .unwrap();
    let mut config = net.broker.config.clone();
    if let Some(l) = config.log.as_mut() {
        l.anchors = vec![cgx_service::logwriter::AnchorRef {
            vkey: net.kbs.log_vkey().unwrap(),
            url: format!("{}/kbs/v0/log", kbs_server.base),
            ca: None,
            reader_key: Some(net.kbs.dir.join(cgx_devnet::LOG_READER_KEY)),
        }];
    }
    let server = BrokerServer::start(&config).unwrap();
    let base = server.base.clone();
    assert!(base.starts_with("http://127.0.0.1:"), "{base}");
    let op = net.broker.client(&base, &net.broker.operator).unwrap();
    a.register(&op).unwrap();
    b.register(&op).unwrap();
    let stop_a = heartbeating(
        a.clone(),
        net.broker.client(&base, &net.broker.operator).unwrap(),
    );
    let stop_b = heartbeating(
        b.clone(),
        net.broker.client(&base, &net.broker.operator).unwrap(),
    );
    let key = |name: &str, ed: &cgx_devnet::Ed| {
        cgx_devnet::write_private(&net.keys, name, &ed.pkcs8).unwrap()
    };
    let tenant_key = key("tenant.pk8", &net.broker.tenant);
    let operator_key = key("operator.pk8", &net.broker.operator);
    let auditor_key = key("auditor.pk8", &net.broker.auditor);

    let driver = Driver::start(&driver_bin);
    let users = Users {
        tenant: tenant_key,
        operator: operator_key,
        auditor: auditor_key,
        operator_client: net.broker.client(&base, &net.broker.operator).unwrap(),
        kbs: kbs_server.base.clone(),
    };
    let serious = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(walk(
            &driver,
            &base,
            &users,
            &a,
            &b,
            [&stop_a, &stop_b],
            axe_js.as_deref(),
        ));
    stop_a.store(true, Ordering::Relaxed);
    stop_b.store(true, Ordering::Relaxed);
    server.stop();
    kbs_server.stop();
    drop(net);
    assert!(serious.is_empty(), "axe-core: {serious:#?}");
}

struct Users {
    tenant: PathBuf,
    operator: PathBuf,
    auditor: PathBuf,
    operator_client: cgx_broker::client::BrokerClient,
    kbs: String,
}

/// The resource the job's lease covers.
const RESOURCE: &str = "acme/weights/key";

/// A client for the node's own calls (each signs its own heartbeat).
fn op_client(_base: &str, users: &Users) -> cgx_broker::client::BrokerClient {
    users.operator_client.with_token(None)
}

/// Every user's walk through the console; axe-core's serious findings.
async fn walk(
    driver: &Driver,
    base: &str,
    users: &Users,
    a: &Arc<SimBrokerNode>,
    b: &Arc<SimBrokerNode>,
    [stop_a, stop_b]: [&Arc<AtomicBool>; 2],
    axe_js: Option<&str>,
) -> Vec<String> {
    let kbs = users.kbs.as_str();
    let (tenant_key, operator_key, auditor_key) = (&users.tenant, &users.operator, &users.auditor);
    let base = base.to_string();
    let axe_js = axe_js.map(str::to_string);
    let mut serious = Vec::new();

    // The tenant: sign in, submit a job whose arguments carry script, see it placed.
    let t = browser(driver, true).await;
    sign_in(&t, &base, tenant_key).await;
    let url = t.current_url().await.unwrap().to_string();
    assert!(url.ends_with("/console/jobs"), "{url}");
    // The session cookie is HttpOnly: the page's scripts cannot read it.
    let cookie = t.execute("return document.cookie", vec![]).await.unwrap();
    assert_eq!(
        cookie,
        json!(""),
        "an HttpOnly cookie is invisible to scripts"
    );
    serious.extend(axe(&t, axe_js.as_deref(), "jobs (empty)").await);
    let fill = |id: &'static str, text: &'static str| {
        let t = &t;
        async move {
            let f = t.find(Locator::Id(id)).await.unwrap();
            f.clear().await.unwrap();
            f.send_keys(text).await.unwrap();
        }
    };
    fill("f-count", "1").await;
    fill("f-price", "3").await;
    fill("f-duration", "3600").await;
    fill("f-budget", "3").await;
    fill("f-command", "/bin/sleep").await;
    fill("f-resources", RESOURCE).await;
    fill(
        "f-args",
        "<img src=x onerror=\"window.__xss=1\">\n<script>window.__xss=2</script>",
    )
    .await;
    t.find(Locator::Css("form.submit button[type=submit]"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let text = wait_until(&t, 30, "the job's page", |url, text| {
        url.contains("/console/jobs/j") && text.contains("placed")
    })
    .await;
    let job_url = t.current_url().await.unwrap().to_string();
    let job_id = job_url.rsplit('/').next().unwrap().to_string();
    assert!(
        text.contains("<img src=x onerror"),
        "the payload is shown as text: {text}"
    );
    assert_eq!(
        t.execute("return window.__xss === undefined", vec![])
            .await
            .unwrap(),
        json!(true)
    );
    let first = if text.contains(&a.id) {
        (a, stop_a, b)
    } else {
        (b, stop_b, a)
    };
    assert!(text.contains(&first.0.id), "{text}");
    shot(&t, "tenant-job-placed").await;
    serious.extend(axe(&t, axe_js.as_deref(), "job").await);

    // The node's VM fetches the key through the lease; another node's VM presents the same
    // lease token and is refused. Both appear on the open page (the KBS's log, mirrored).
    let (node, other) = (first.0.clone(), first.2.clone());
    let kbs = kbs.to_string();
    let op_client = op_client(base.as_str(), users);
    tokio::task::spawn_blocking(move || {
        let hb = node.heartbeat(&op_client).unwrap();
        let token = hb.leases[0].token.clone();
        let mut vm = node.kbs_client(&kbs).unwrap();
        vm.attest(&node.sim).unwrap();
        assert_eq!(
            vm.resource(RESOURCE, Some(&token)).unwrap(),
            b"the weights key"
        );
        let mut thief = other.kbs_client(&kbs).unwrap();
        thief.attest(&other.sim).unwrap();
        assert!(thief.resource(RESOURCE, Some(&token)).is_err());
    })
    .await
    .unwrap();
    let text = wait_until(
        &t,
        60,
        "the release and the refusal on the open page",
        |_, text| text.contains("released") && text.contains("refused"),
    )
    .await;
    assert!(text.contains("node key"), "the refusal says why: {text}");
    shot(&t, "tenant-job-releases").await;

    // Failover, seen without a reload: the node stops heartbeating; the page updates itself.
    t.execute("window.__marker = 'same page'", vec![])
        .await
        .unwrap();
    first.1.store(true, Ordering::Relaxed);
    let other = first.2.id.clone();
    wait_until(&t, 60, "the failover on the open page", |_, text| {
        text.contains(&other)
    })
    .await;
    assert_eq!(
        t.execute("return window.__marker", vec![]).await.unwrap(),
        json!("same page"),
        "updated in place, not reloaded"
    );
    shot(&t, "tenant-job-failover").await;

    // The job's "why" page, the statement, and cancel.
    t.goto(&format!("{job_url}/why")).await.unwrap();
    wait_until(&t, 30, "why", |_, text| text.contains("Offers")).await;
    serious.extend(axe(&t, axe_js.as_deref(), "why").await);
    t.goto(&format!("{base}/console/statement")).await.unwrap();
    wait_until(&t, 30, "statement", |_, text| {
        text.contains("Statement of tenant:acme")
    })
    .await;
    shot(&t, "tenant-statement").await;
    serious.extend(axe(&t, axe_js.as_deref(), "statement").await);
    t.goto(&job_url).await.unwrap();
    t.find(Locator::Css("button.danger"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_until(&t, 30, "cancelled", |_, text| text.contains("cancelled by")).await;
    shot(&t, "tenant-job-cancelled").await;
    t.close().await.unwrap();

    // The operator: its nodes and one node's appraisal.
    let o = browser(driver, true).await;
    sign_in(&o, &base, operator_key).await;
    let text = wait_until(&o, 30, "nodes", |_, text| {
        text.contains(&a.id) && text.contains(&b.id)
    })
    .await;
    assert!(text.contains("affirming"), "{text}");
    shot(&o, "operator-nodes").await;
    serious.extend(axe(&o, axe_js.as_deref(), "nodes").await);
    o.goto(&format!("{base}/console/nodes/{}", b.id))
        .await
        .unwrap();
    wait_until(&o, 30, "node", |_, text| {
        text.contains("Re-attestation due")
    })
    .await;
    shot(&o, "operator-node").await;
    serious.extend(axe(&o, axe_js.as_deref(), "node").await);
    o.close().await.unwrap();

    // The auditor: every job, the log's decisions, a search for the job.
    let au = browser(driver, true).await;
    sign_in(&au, &base, auditor_key).await;
    au.goto(&format!("{base}/console/log?q={job_id}"))
        .await
        .unwrap();
    let text = wait_until(&au, 30, "the log", |_, text| text.contains("Decisions")).await;
    assert!(
        text.contains("lease.open") && text.contains("lease.end"),
        "{text}"
    );
    shot(&au, "auditor-log").await;
    serious.extend(axe(&au, axe_js.as_deref(), "log").await);
    // A decision's page: its leaf's inclusion proof and the evidence it names.
    au.find(Locator::Css("table.list tbody tr td a"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    wait_until(&au, 30, "a decision", |url, text| {
        url.contains("/console/log/events/") && text.contains("Inclusion in the log")
    })
    .await;
    shot(&au, "auditor-decision").await;
    serious.extend(axe(&au, axe_js.as_deref(), "decision").await);
    au.goto(&format!("{base}/console/jobs")).await.unwrap();
    wait_until(&au, 30, "all jobs", |_, text| text.contains(&job_id)).await;
    au.close().await.unwrap();

    // JavaScript off: signing in and every page read work as plain HTML.
    let plain = browser(driver, false).await;
    sign_in(&plain, &base, tenant_key).await;
    for (path, want) in [
        ("/console/jobs".to_string(), job_id.clone()),
        (
            format!("/console/jobs/{job_id}"),
            "State history".to_string(),
        ),
        ("/console/statement".to_string(), "Accounts".to_string()),
    ] {
        plain.goto(&format!("{base}{path}")).await.unwrap();
        wait_until(&plain, 30, &path, |_, text| text.contains(&want)).await;
    }
    shot(&plain, "tenant-no-javascript").await;
    plain.close().await.unwrap();
    serious
}
