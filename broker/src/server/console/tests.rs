//! The console through the broker's whole router (in process, no listener): sign-in and its
//! refusals, scoping across tenants and operators, CSRF, headers, escaping of everything a
//! tenant or a node controls, live answers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode, header};
use cgx_protocol::records::ConsoleLogin;
use tower::ServiceExt;

use super::super::testing::{Harness, OTHER_TENANT, Role, TENANT};
use super::session::{self, Session};

/// A browser: the router, a cookie jar, and the headers a same-origin browser sends.
struct Browser {
    app: Router,
    jar: HashMap<String, String>,
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    fn location(&self) -> &str {
        self.headers
            .get(header::LOCATION)
            .map(|v| v.to_str().unwrap())
            .unwrap_or("")
    }
}

impl Browser {
    fn new(h: &Harness) -> Browser {
        Browser {
            app: super::super::http::router(h.broker.clone()).unwrap(),
            jar: HashMap::new(),
        }
    }

    async fn send(
        &mut self,
        method: Method,
        path: &str,
        form: Option<&str>,
        extra: &[(&str, &str)],
    ) -> Answer {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, "127.0.0.1:8080");
        if !self.jar.is_empty() {
            let c: Vec<String> = self.jar.iter().map(|(k, v)| format!("{k}={v}")).collect();
            req = req.header(header::COOKIE, c.join("; "));
        }
        for (k, v) in extra {
            req = req.header(*k, *v);
        }
        let body = match form {
            Some(f) => {
                req = req.header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
                Body::from(f.to_string())
            }
            None => Body::empty(),
        };
        let resp = self
            .app
            .clone()
            .oneshot(req.body(body).unwrap())
            .await
            .unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        for c in headers.get_all(header::SET_COOKIE) {
            let c = c.to_str().unwrap();
            let (kv, attrs) = c.split_once(';').unwrap();
            let (k, v) = kv.split_once('=').unwrap();
            if attrs.contains("Max-Age=0") {
                self.jar.remove(k);
            } else {
                self.jar.insert(k.into(), v.into());
            }
        }
        let bytes = axum::body::to_bytes(resp.into_body(), 1 << 24)
            .await
            .unwrap();
        Answer {
            status,
            headers,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        }
    }

    async fn get(&mut self, path: &str) -> Answer {
        self.send(Method::GET, path, None, &[]).await
    }

    async fn post(&mut self, path: &str, form: &str) -> Answer {
        self.send(
            Method::POST,
            path,
            Some(form),
            &[("sec-fetch-site", "same-origin")],
        )
        .await
    }

    /// The challenge the sign-in page shows.
    async fn challenge(&mut self) -> String {
        let page = self.get("/console/login").await;
        assert_eq!(page.status, StatusCode::OK);
        assert!(self.jar.contains_key(session::LOGIN_COOKIE));
        let at = page.body.find("--challenge ").unwrap() + "--challenge ".len();
        page.body[at..]
            .split(|c: char| c.is_whitespace() || c == '<')
            .next()
            .unwrap()
            .to_string()
    }

    /// Sign in as `role` through the page, as `cgx console login` would answer.
    async fn sign_in(&mut self, h: &Harness, role: Role) -> Answer {
        let challenge = self.challenge().await;
        let token = login_token(h, role, &challenge);
        self.post("/console/login", &format!("token={}", enc(&token)))
            .await
    }

    /// The CSRF token of the signed-in page `path` shows.
    async fn csrf(&mut self, path: &str) -> String {
        let page = self.get(path).await;
        let at = page.body.find("name=\"csrf\" value=\"").unwrap() + 19;
        page.body[at..at + 64].to_string()
    }
}

fn login_token(h: &Harness, role: Role, challenge: &str) -> String {
    let now = h.now();
    h.signer(role)
        .sign(
            &ConsoleLogin {
                challenge: challenge.into(),
            },
            now,
            now + 120,
        )
        .unwrap()
}

fn enc(s: &str) -> String {
    super::layout::urlencode(s)
}

/// Sign-in proves the API key and binds the browser; every forged, replayed, expired,
/// signed-out or orphaned credential is refused with its reason.
#[tokio::test]
async fn sign_in_binds_the_key_to_this_browser_and_refuses_every_forgery() {
    let h = Harness::new("console-login").await;
    let mut anon = Browser::new(&h);
    // Not signed in: every page sends the browser to sign in.
    for path in [
        "/console/",
        "/console/jobs",
        "/console/nodes",
        "/console/log",
    ] {
        let a = anon.get(path).await;
        assert_eq!(a.status, StatusCode::SEE_OTHER, "{path}");
        assert_eq!(a.location(), "/console/login", "{path}");
    }

    let mut tenant = Browser::new(&h);
    let ok = tenant.sign_in(&h, Role::Tenant).await;
    assert_eq!(ok.status, StatusCode::SEE_OTHER, "{}", ok.body);
    assert_eq!(ok.location(), "/console/");
    let set: Vec<&str> = ok
        .headers
        .get_all(header::SET_COOKIE)
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    let session_cookie = set
        .iter()
        .find(|c| c.starts_with("__Host-cgx_session="))
        .unwrap();
    for attr in ["HttpOnly", "Secure", "SameSite=Strict", "Path=/;"] {
        assert!(session_cookie.contains(attr), "{session_cookie}");
    }
    let home = tenant.get("/console/").await;
    assert_eq!(home.location(), "/console/jobs");
    assert_eq!(tenant.get("/console/jobs").await.status, StatusCode::OK);

    // A token answering another browser's challenge signs in nobody here (login CSRF).
    let mut victim = Browser::new(&h);
    let mut attacker = Browser::new(&h);
    let theirs = attacker.challenge().await;
    let _ = victim.challenge().await;
    let token = login_token(&h, Role::Tenant, &theirs);
    let a = victim
        .post("/console/login", &format!("token={}", enc(&token)))
        .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert!(a.body.contains("another challenge"), "{}", a.body);
    // Without any challenge cookie.
    let mut bare = Browser::new(&h);
    let a = bare
        .post("/console/login", &format!("token={}", enc(&token)))
        .await;
    assert!(a.body.contains("no sign-in challenge"), "{}", a.body);

    // The same token twice from its own browser: spent.
    let mut b = Browser::new(&h);
    let c = b.challenge().await;
    let login_cookie = b.jar[session::LOGIN_COOKIE].clone();
    let token = login_token(&h, Role::Operator, &c);
    assert_eq!(
        b.post("/console/login", &format!("token={}", enc(&token)))
            .await
            .status,
        StatusCode::SEE_OTHER
    );
    b.jar.insert(session::LOGIN_COOKIE.into(), login_cookie);
    let a = b
        .post("/console/login", &format!("token={}", enc(&token)))
        .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert!(a.body.contains("already used"), "{}", a.body);

    // A token of another kind (an API bearer token), or by a key the broker does not know.
    let mut b = Browser::new(&h);
    let _ = b.challenge().await;
    let now = h.now();
    let api = cgx_service::auth::BearerKind::BrokerApi
        .sign(&h.signer(Role::Tenant), now, now + 60)
        .unwrap();
    let a = b
        .post("/console/login", &format!("token={}", enc(&api)))
        .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{}", a.body);
    // A cross-site sign-in post.
    let c = b.challenge().await;
    let token = login_token(&h, Role::Tenant, &c);
    let a = b
        .send(
            Method::POST,
            "/console/login",
            Some(&format!("token={}", enc(&token))),
            &[("sec-fetch-site", "cross-site")],
        )
        .await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);

    // Forged session cookies: an edited one, another broker's, a replaced key's.
    let good = tenant.jar[session::SESSION_COOKIE].clone();
    let mut forged = Browser::new(&h);
    for (value, why) in [
        (
            good.replacen("v1.0.", "v1.3.", 1),
            "not made by this broker",
        ),
        (format!("{good}00"), "not made by this broker"),
        ("v1.0.00.00.0.0.00".to_string(), "not made by this broker"),
        ("garbage".to_string(), "malformed"),
    ] {
        forged.jar.insert(session::SESSION_COOKIE.into(), value);
        let a = forged.get("/console/jobs").await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED);
        assert!(a.body.contains(why), "{why}: {}", a.body);
    }
    let other_keys = super::super::keys::Keys::from_pkcs8(
        aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .unwrap()
            .as_ref()
            .to_vec(),
    )
    .unwrap();
    let fp = h.broker.api_keys.fingerprint(0).unwrap();
    let theirs = Session::new(0, fp, now, now + 600)
        .unwrap()
        .encode(&other_keys);
    forged.jar.insert(session::SESSION_COOKIE.into(), theirs);
    assert!(
        forged
            .get("/console/jobs")
            .await
            .body
            .contains("not made by this broker")
    );
    // Made by this broker for key 0, but naming a key that is not key 0 now (replaced).
    let replaced = Session::new(0, [9; 8], now, now + 600)
        .unwrap()
        .encode(&h.broker.keys);
    forged.jar.insert(session::SESSION_COOKIE.into(), replaced);
    let a = forged.get("/console/jobs").await;
    assert!(a.body.contains("no longer configured"), "{}", a.body);

    // Signed out: that cookie is refused from then on, on every replica.
    let csrf = tenant.csrf("/console/jobs").await;
    let out = tenant
        .post("/console/logout", &format!("csrf={csrf}"))
        .await;
    assert_eq!(out.location(), "/console/login");
    let mut replay = Browser::new(&h);
    replay
        .jar
        .insert(session::SESSION_COOKIE.into(), good.clone());
    let a = replay.get("/console/jobs").await;
    assert!(a.body.contains("signed out"), "{}", a.body);

    // Expired: a session lives at most the API tokens' longest lifetime.
    let mut late = Browser::new(&h);
    assert_eq!(
        late.sign_in(&h, Role::Auditor).await.status,
        StatusCode::SEE_OTHER
    );
    h.clock.advance(h.broker.config.api_token_max_ttl_secs + 1);
    let a = late.get("/console/log").await;
    assert!(a.body.contains("expired"), "{}", a.body);
}

/// Each user sees what the API would show its key and nothing else: another tenant's job, an
/// operator's page for a tenant, the log for anyone but an auditor.
#[tokio::test]
async fn each_user_sees_only_what_its_scopes_allow() {
    let h = Harness::new("console-scopes").await;
    let node = h.node(2);
    h.register(&node).await.unwrap();
    let mine = h
        .broker
        .submit(&h.admin(Role::Tenant), Harness::job(1, 600))
        .await
        .unwrap();
    let mut spec = Harness::job(1, 600);
    spec.resources = vec![format!("{OTHER_TENANT}/weights/key")];
    let theirs = h
        .broker
        .submit(&h.admin(Role::OtherTenant), spec)
        .await
        .unwrap();

    let mut t = Browser::new(&h);
    t.sign_in(&h, Role::Tenant).await;
    let list = t.get("/console/jobs").await;
    assert!(list.body.contains(&mine.id));
    assert!(!list.body.contains(&theirs.id));
    let page = t.get(&format!("/console/jobs/{}", mine.id)).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.body.contains(&node.id), "the job names its node");
    // Another tenant's job, by URL and by the list's tenant filter; another's statement.
    assert_eq!(
        t.get(&format!("/console/jobs/{}", theirs.id)).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        t.get(&format!("/console/jobs/{}/why", theirs.id))
            .await
            .status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        t.get(&format!("/console/jobs?tenant={OTHER_TENANT}"))
            .await
            .status,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        t.get(&format!("/console/statement?tenant={OTHER_TENANT}"))
            .await
            .status,
        StatusCode::FORBIDDEN
    );
    // Cancelling another tenant's job, with this session's valid CSRF token.
    let csrf = t.csrf("/console/jobs").await;
    let a = t
        .post(
            &format!("/console/jobs/{}/cancel", theirs.id),
            &format!("csrf={csrf}"),
        )
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    // Nodes are operators' and auditors'.
    assert!(!t.get("/console/nodes").await.body.contains(&node.id));
    assert_eq!(
        t.get(&format!("/console/nodes/{}", node.id)).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(t.get("/console/log").await.status, StatusCode::FORBIDDEN);
    // Path tricks are not ids.
    assert_eq!(
        t.get("/console/jobs/..%2Fnodes").await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(t.get("/console/nope").await.status, StatusCode::NOT_FOUND);
    let st = t.get("/console/statement").await;
    assert_eq!(st.status, StatusCode::OK, "{}", st.body);
    let csv = t
        .get(&format!("/console/statement?tenant={TENANT}&format=csv"))
        .await;
    assert!(csv.body.starts_with("seq,transfer,at,"), "{}", csv.body);
    let json = t
        .get(&format!("/console/statement?tenant={TENANT}&format=json"))
        .await;
    let v: serde_json::Value = serde_json::from_str(&json.body).unwrap();
    assert_eq!(v["owner"], format!("tenant:{TENANT}"));

    let mut op = Browser::new(&h);
    op.sign_in(&h, Role::Operator).await;
    assert_eq!(op.get("/console/").await.location(), "/console/nodes");
    assert!(op.get("/console/nodes").await.body.contains(&node.id));
    let n = op.get(&format!("/console/nodes/{}", node.id)).await;
    assert_eq!(n.status, StatusCode::OK);
    assert!(n.body.contains("Claims") && n.body.contains("Re-attestation due"));
    assert_eq!(op.get("/console/log").await.status, StatusCode::FORBIDDEN);
    assert_eq!(
        op.get(&format!("/console/jobs/{}", mine.id)).await.status,
        StatusCode::NOT_FOUND
    );
    let csrf = op.csrf("/console/nodes").await;
    let a = op
        .post(
            &format!("/console/nodes/{}/reattest", node.id),
            &format!("csrf={csrf}"),
        )
        .await;
    assert_eq!(a.status, StatusCode::SEE_OTHER, "{}", a.body);
    assert!(h.broker.node_view(&node.id, false).unwrap().reattest_asked);

    let mut au = Browser::new(&h);
    au.sign_in(&h, Role::Auditor).await;
    let all = au.get("/console/jobs").await;
    assert!(all.body.contains(&mine.id) && all.body.contains(&theirs.id));
    let log = au.get("/console/log").await;
    assert_eq!(log.status, StatusCode::OK);
    assert!(log.body.contains("lease.open"), "the decisions are listed");
    let found = au.get(&format!("/console/log?q={}", mine.id)).await;
    assert!(found.body.contains(&mine.id));
    // Read-only: an auditor does not cancel.
    let csrf = au.csrf("/console/jobs").await;
    let a = au
        .post(
            &format!("/console/jobs/{}/cancel", mine.id),
            &format!("csrf={csrf}"),
        )
        .await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
}

/// A change needs this session's CSRF token and a same-origin request; with both, a tenant
/// submits and cancels through the forms.
#[tokio::test]
async fn changes_need_the_sessions_token_and_this_origin() {
    let h = Harness::new("console-csrf").await;
    let node = h.node(2);
    h.register(&node).await.unwrap();
    let mut t = Browser::new(&h);
    t.sign_in(&h, Role::Tenant).await;
    let csrf = t.csrf("/console/jobs").await;
    let form = format!(
        "csrf={csrf}&gpu_model=H100&gpu_count=1&max_price=3&duration_secs=600&budget=3&resources={}",
        enc(&format!("{TENANT}/weights/key"))
    );
    let a = t.post("/console/jobs", &form).await;
    assert_eq!(a.status, StatusCode::SEE_OTHER, "{}", a.body);
    let job = a
        .location()
        .strip_prefix("/console/jobs/")
        .unwrap()
        .to_string();
    let page = t.get(a.location()).await;
    assert!(page.body.contains("placed"), "{}", page.body);

    let cancel = format!("/console/jobs/{job}/cancel");
    // No token, another session's token, a cross-site or foreign-origin request.
    let mut other = Browser::new(&h);
    other.sign_in(&h, Role::Tenant).await;
    let theirs = other.csrf("/console/jobs").await;
    assert_ne!(theirs, csrf);
    let refusals = [
        (t.post(&cancel, "csrf=").await, StatusCode::FORBIDDEN),
        (
            t.post(&cancel, &format!("csrf={theirs}")).await,
            StatusCode::FORBIDDEN,
        ),
        (t.post(&cancel, "").await, StatusCode::UNPROCESSABLE_ENTITY),
        (
            t.send(
                Method::POST,
                &cancel,
                Some(&format!("csrf={csrf}")),
                &[("sec-fetch-site", "cross-site")],
            )
            .await,
            StatusCode::FORBIDDEN,
        ),
        (
            t.send(
                Method::POST,
                &cancel,
                Some(&format!("csrf={csrf}")),
                &[("origin", "https://evil.example")],
            )
            .await,
            StatusCode::FORBIDDEN,
        ),
    ];
    for (i, (a, want)) in refusals.iter().enumerate() {
        assert_eq!(a.status, *want, "refusal {i}: {}", a.body);
    }
    assert!(
        !h.broker
            .job_view_by_id(&job)
            .await
            .unwrap()
            .state
            .is_final()
    );
    let a = t
        .send(
            Method::POST,
            &cancel,
            Some(&format!("csrf={csrf}")),
            &[
                ("origin", "http://127.0.0.1:8080"),
                ("sec-fetch-site", "same-origin"),
            ],
        )
        .await;
    assert_eq!(a.status, StatusCode::SEE_OTHER, "{}", a.body);
    assert_eq!(
        h.broker.job_view_by_id(&job).await.unwrap().state,
        cgx_protocol::broker::JobState::Cancelled
    );
    // A refused submission says why, stores nothing.
    let a = t
        .post(
            "/console/jobs",
            &format!("csrf={csrf}&gpu_model=H100&gpu_count=1&max_price=3&duration_secs=0&budget=3"),
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(a.body.contains("duration_secs"), "{}", a.body);
}

/// Markup a tenant writes into a job (its arguments, its policy and the reasons its policy
/// gives) is shown as text: escaped on every page that shows it, and the responses carry
/// the headers that would stop a script anyway.
#[tokio::test]
async fn tenant_and_node_text_is_rendered_inert() {
    let h = Harness::new("console-xss").await;
    let node = h.node(2);
    h.register(&node).await.unwrap();
    let payloads = [
        "<script>alert(1)</script>",
        "\"><img src=x onerror=alert(2)>",
        "</pre><svg onload=alert(3)>",
    ];
    let mut spec = Harness::job(1, 600);
    spec.workload = Some(cgx_protocol::broker::Workload {
        command: "/bin/<script>alert(4)</script>".into(),
        args: payloads.iter().map(|p| p.to_string()).collect(),
        weights: None,
    });
    spec.placement_policy = Some(format!(
        "package placement\n# {}\ndeny contains \"<img src=x onerror=alert(5)>\" if input.node.sim",
        payloads[2]
    ));
    let job = h.broker.submit(&h.admin(Role::Tenant), spec).await.unwrap();
    let mut t = Browser::new(&h);
    t.sign_in(&h, Role::Tenant).await;
    let mut au = Browser::new(&h);
    au.sign_in(&h, Role::Auditor).await;
    let pages = [
        t.get("/console/jobs").await,
        t.get(&format!("/console/jobs/{}", job.id)).await,
        t.get(&format!("/console/jobs/{}/why", job.id)).await,
        au.get(&format!("/console/jobs/{}", job.id)).await,
        au.get("/console/log").await,
        au.get(&format!("/console/nodes/{}", node.id)).await,
        // A search term is echoed back into the form.
        au.get("/console/log?q=%22%3E%3Cscript%3Ealert(6)%3C%2Fscript%3E")
            .await,
    ];
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(p.status, StatusCode::OK, "page {i}: {}", p.body);
        for raw in ["<script>alert", "<img src=x", "<svg onload", "\"><img"] {
            assert!(!p.body.contains(raw), "page {i} carries {raw} raw");
        }
        assert_eq!(
            p.headers.get(header::CONTENT_SECURITY_POLICY).unwrap(),
            super::CSP
        );
        assert_eq!(
            p.headers.get(header::X_CONTENT_TYPE_OPTIONS).unwrap(),
            "nosniff"
        );
        assert_eq!(p.headers.get(header::X_FRAME_OPTIONS).unwrap(), "DENY");
    }
    // It is there, as text.
    assert!(
        pages[1]
            .body
            .contains("&lt;script&gt;alert(1)&lt;/script&gt;")
    );
    assert!(
        pages[2].body.contains("&lt;img src=x onerror=alert(5)&gt;"),
        "{}",
        pages[2].body
    );
    assert!(pages[6].body.contains("&quot;&gt;&lt;script&gt;"));
    // The error pages and the assets carry the headers too.
    for path in [
        "/console/nope",
        "/console/assets/console.js",
        "/console/login",
    ] {
        let a = t.get(path).await;
        assert_eq!(
            a.headers.get(header::CONTENT_SECURITY_POLICY).unwrap(),
            super::CSP,
            "{path}"
        );
    }
    // No inline script or style anywhere: the CSP allows 'self' only.
    for p in &pages {
        assert!(!p.body.contains("<script>") && !p.body.contains("style="));
    }
}

/// A live page answers 304 to the ETag of what it would send, and 200 once something changed.
#[tokio::test]
async fn live_pages_answer_not_modified_until_something_changes() {
    let h = Harness::new("console-live").await;
    let node = h.node(2);
    h.register(&node).await.unwrap();
    let mut t = Browser::new(&h);
    t.sign_in(&h, Role::Tenant).await;
    let first = t.get("/console/jobs").await;
    let etag = first
        .headers
        .get(header::ETAG)
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let again = t
        .send(
            Method::GET,
            "/console/jobs",
            None,
            &[("if-none-match", &etag)],
        )
        .await;
    assert_eq!(again.status, StatusCode::NOT_MODIFIED);
    assert!(again.body.is_empty());
    h.broker
        .submit(&h.admin(Role::Tenant), Harness::job(1, 600))
        .await
        .unwrap();
    let changed = t
        .send(
            Method::GET,
            "/console/jobs",
            None,
            &[("if-none-match", &etag)],
        )
        .await;
    assert_eq!(changed.status, StatusCode::OK);
    assert_ne!(
        changed.headers.get(header::ETAG).unwrap().to_str().unwrap(),
        etag
    );
}

/// Pages of nodes joined together are every node the viewer may see, once, in order.
#[tokio::test]
async fn node_pages_join_into_the_whole_list() {
    let h = Harness::new("console-pages").await;
    for _ in 0..5 {
        h.register(&h.node(1)).await.unwrap();
    }
    let mut all = h.broker.index().ids();
    all.sort();
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let (page, next) = h.broker.nodes_page(after.as_deref(), 2, |_| true);
        assert!(page.len() <= 2);
        seen.extend(page.into_iter().map(|v| v.id));
        match next {
            Some(n) => after = Some(n),
            None => break,
        }
    }
    assert_eq!(seen, all);
    let (none, next) = h.broker.nodes_page(None, 2, |op| op == "nobody");
    assert!(none.is_empty() && next.is_none());
}

/// What a node's evidence carries into its record (claim strings, the appraisal's violation
/// texts, which quote evidence values) is rendered as text. Names it offers (region, model,
/// operator) are refused at registration unless plain (`register::check_offer`); here a
/// record holding markup everywhere it can is put in the index as a replica would read one.
#[tokio::test]
async fn node_evidence_text_is_rendered_inert() {
    let h = Harness::new("console-node-xss").await;
    let node = h.node(1);
    h.register(&node).await.unwrap();
    let evil = "<script>alert('claim')</script>";
    {
        let mut idx = h.broker.index();
        let mut r = (*idx.record(&node.id).unwrap()).clone();
        let token = idx.record_token(&node.id).unwrap().to_string();
        r.violations = vec![format!("driver {evil} is not in the reference values")];
        r.claims = serde_json::json!({ "gpu": { "driver": evil, "vbios": "\"><img src=x onerror=alert(1)>" } });
        let (last, seq) = idx.last_heartbeat(&node.id).unwrap();
        idx.upsert(r, token, 0, last, seq, 0);
    }
    let mut op = Browser::new(&h);
    op.sign_in(&h, Role::Operator).await;
    for path in [
        "/console/nodes".to_string(),
        format!("/console/nodes/{}", node.id),
    ] {
        let p = op.get(&path).await;
        assert_eq!(p.status, StatusCode::OK, "{path}");
        assert!(
            !p.body.contains("<script>alert") && !p.body.contains("<img src=x"),
            "{path}"
        );
    }
    let page = op.get(&format!("/console/nodes/{}", node.id)).await;
    assert!(
        page.body
            .contains("driver &lt;script&gt;alert('claim')&lt;/script&gt; is not")
    );
    assert!(
        page.body.contains("onerror=alert(1)"),
        "the claim is shown, as text"
    );
}

/// An auditor's pages over a broker that keeps a log: the checkpoint, its size over time, a
/// decision with its inclusion proof (which verifies alone, and is refused once changed) and
/// the archived evidence it names, and the last auditor's verdict recorded through the API.
#[tokio::test]
async fn an_auditor_reads_each_decision_with_its_proof_and_evidence() {
    let dir = std::env::temp_dir().join(format!("cgx-console-log-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let der =
        aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .unwrap();
    let key = dir.join("log.pk8");
    std::fs::write(&key, der.as_ref()).unwrap();
    let h = Harness::with("console-log", |c| {
        c.log = Some(cgx_service::logwriter::LogConfig {
            origin: "console.test/log".into(),
            key,
            interval_ms: 1000,
            state: None,
            witnesses: Vec::new(),
            quorum: 0,
            anchors: Vec::new(),
            export_dir: None,
        })
    })
    .await;
    let node = h.node(1);
    h.register(&node).await.unwrap();
    h.broker.integrate_log().await.unwrap();
    let events = h
        .broker
        .store
        .audit_page(Some("node.register"), None, 10)
        .await
        .unwrap();
    let seq = events[0].seq;

    let mut au = Browser::new(&h);
    au.sign_in(&h, Role::Auditor).await;
    let log = au.get("/console/log").await;
    assert!(log.body.contains("console.test/log") && log.body.contains("Log size over time"));
    assert!(log.body.contains("No auditor has recorded a verdict yet"));
    let page = au.get(&format!("/console/log/events/{seq}")).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(
        page.body
            .contains("is included in the published checkpoint"),
        "{}",
        page.body
    );
    assert!(page.body.contains("registration") && page.body.contains("/console/log/archive/"));
    let file = au.get(&format!("/console/log/events/{seq}/proof")).await;
    let proof = cgx_tlog::proof::TlogProof::parse(file.body.as_bytes()).unwrap();
    let vkey = h.broker.log.as_ref().unwrap().key().vkey();
    let k = cgx_tlog::note::NoteKey::parse(&vkey).unwrap();
    proof.verify(&k, &[], 0).unwrap();
    let leaf: serde_json::Value = serde_json::from_slice(proof.extra.as_ref().unwrap()).unwrap();
    assert_eq!(leaf["action"], "node.register");
    let mut changed = proof.clone();
    changed.extra = Some(
        String::from_utf8(proof.extra.clone().unwrap())
            .unwrap()
            .replacen("node.register", "node.registe_", 1)
            .into_bytes(),
    );
    assert!(changed.verify(&k, &[], 0).is_err());
    // The archived registration hashes to its name.
    let sha = leaf["detail"]["registration_sha256"].as_str().unwrap();
    let piece = au.get(&format!("/console/log/archive/{sha}")).await;
    assert_eq!(piece.status, StatusCode::OK);
    assert_eq!(cgx_protocol::archive::address(piece.body.as_bytes()), sha);
    // Not an auditor's: refused; junk paths: not found.
    let mut t = Browser::new(&h);
    t.sign_in(&h, Role::Tenant).await;
    for path in [
        format!("/console/log/events/{seq}"),
        format!("/console/log/events/{seq}/proof"),
        format!("/console/log/archive/{sha}"),
    ] {
        assert_eq!(t.get(&path).await.status, StatusCode::FORBIDDEN, "{path}");
    }
    for path in [
        "/console/log/events/0",
        "/console/log/events/x",
        "/console/log/archive/zz",
    ] {
        assert_eq!(au.get(path).await.status, StatusCode::NOT_FOUND, "{path}");
    }
    // A verdict through the API, then on the log page.
    let opened = cgx_tlog::note::open_checkpoint(&proof.checkpoint, &k, &[], 0).unwrap();
    let verdict = cgx_protocol::broker::LogVerdict {
        origin: "console.test/log".into(),
        size: opened.checkpoint.size().to_string(),
        root: base64::Engine::encode(
            &base64::engine::general_purpose::STANDARD,
            opened.checkpoint.hash().0,
        ),
        violations: 0,
        checks: vec!["archive".into(), "reappraise".into()],
    };
    let auditor = h.admin(Role::Auditor);
    h.broker
        .record_verdict(&auditor, verdict.clone())
        .await
        .unwrap();
    for (bad, why) in [
        (
            cgx_protocol::broker::LogVerdict {
                origin: "other/log".into(),
                ..verdict.clone()
            },
            "not this broker's",
        ),
        (
            cgx_protocol::broker::LogVerdict {
                size: "-1".into(),
                ..verdict.clone()
            },
            "decimal",
        ),
        (
            cgx_protocol::broker::LogVerdict {
                root: "<b>".into(),
                ..verdict.clone()
            },
            "base64",
        ),
        (
            cgx_protocol::broker::LogVerdict {
                checks: vec!["<x>".into()],
                ..verdict.clone()
            },
            "checks",
        ),
        (
            cgx_protocol::broker::LogVerdict {
                size: "999999".into(),
                ..verdict.clone()
            },
            "this log has",
        ),
        (
            cgx_protocol::broker::LogVerdict {
                root: base64::Engine::encode(&base64::engine::general_purpose::STANDARD, [7u8; 32]),
                ..verdict.clone()
            },
            "not this log's",
        ),
    ] {
        let e = h.broker.record_verdict(&auditor, bad).await.unwrap_err();
        assert!(e.to_string().contains(why), "{e}");
    }
    assert!(matches!(
        h.broker
            .record_verdict(&h.admin(Role::Tenant), verdict)
            .await,
        Err(super::super::BrokerError::Forbidden(_))
    ));
    let log = au.get("/console/log").await;
    assert!(
        log.body.contains("checks: archive, reappraise"),
        "{}",
        log.body
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A provider's node page charts each GPU's utilization from the node's signed metering
/// records; a record the node's key did not sign is left out and counted.
#[tokio::test]
async fn a_provider_sees_each_gpus_utilization_from_signed_records() {
    use cgx_protocol::metering::{WINDOW_SECS, genesis};
    let h = Harness::new("console-util").await;
    let node = h.node(2);
    h.register(&node).await.unwrap();
    let job = h
        .broker
        .submit(&h.admin(Role::Tenant), Harness::job(2, 3600))
        .await
        .unwrap();
    let lease = job.lease_id.clone().unwrap();
    let (row, _) = h.broker.store.lease_any(&lease).await.unwrap().unwrap();
    let mut prev = genesis(&lease);
    for seq in 0..3u64 {
        h.clock
            .set(row.started_at + i64::from(WINDOW_SECS) * (seq as i64 + 1));
        let t = node.meter(
            &lease,
            row.started_at,
            WINDOW_SECS,
            seq,
            &row.gpus,
            prev.clone(),
            h.now(),
        );
        prev = h.broker.metering(&node.id, &t).await.unwrap().hash;
    }
    let mut op = Browser::new(&h);
    op.sign_in(&h, Role::Operator).await;
    let page = op.get(&format!("/console/nodes/{}", node.id)).await;
    assert_eq!(page.status, StatusCode::OK);
    for gpu in &row.gpus {
        assert!(page.body.contains(&format!("GPU {gpu}")), "{}", page.body);
    }
    assert!(page.body.contains("90.0 %"), "the records' utilization");
    assert!(!page.body.contains("did not verify"));
    // A row a database writer changed (another key's signature) is not charted.
    sqlx::query("UPDATE metering SET token = $1 WHERE seq = 0")
        .bind(h.node(1).meter(
            &lease,
            row.started_at,
            WINDOW_SECS,
            0,
            &row.gpus,
            genesis(&lease),
            h.now(),
        ))
        .execute(h.broker.store.db.pool())
        .await
        .unwrap();
    let page = op.get(&format!("/console/nodes/{}", node.id)).await;
    assert!(
        page.body.contains("1 records did not verify"),
        "{}",
        page.body
    );
}

/// The mirror of the KBS's log keeps a release only when the entries it read make the root of
/// the checkpoint the log's key signed: served honestly, the releases and refusals appear by
/// lease; a bundle with one leaf changed (the checkpoint intact) keeps nothing, and says why.
#[tokio::test]
async fn the_kbs_log_is_mirrored_only_as_its_signed_root_allows() {
    use cgx_tlog::note::{KeyKind, NoteSigner, sign_checkpoint};
    use cgx_tlog::tree::MemoryTree;
    use std::sync::{Arc, Mutex};
    const ORIGIN: &str = "kbs.test/log";
    let dir = std::env::temp_dir().join(format!("cgx-console-mirror-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let pk8 = || {
        aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .unwrap()
            .as_ref()
            .to_vec()
    };
    let kbs_key = NoteSigner::from_pkcs8(ORIGIN, KeyKind::Ed25519, &pk8()).unwrap();
    std::fs::write(dir.join("log.pk8"), pk8()).unwrap();
    std::fs::write(dir.join("reader.pk8"), pk8()).unwrap();
    // The KBS's leaves: a release through lease l1, a refusal of l1's token, other events.
    let leaf = |seq: i64, action: &str, detail: serde_json::Value| {
        cgx_protocol::audit::AuditEvent {
            seq,
            at: 1_800_000_000 + seq,
            actor: "tee".into(),
            action: action.into(),
            subject: "acme/weights/key".into(),
            detail,
        }
        .leaf("cgx-kbs")
    };
    let mut leaves = Vec::new();
    for i in 0..300 {
        leaves.push(leaf(i, "resource.put", serde_json::json!({})));
    }
    leaves.push(leaf(
        300,
        "release",
        serde_json::json!({"tee_key": "k1", "lease": "l1", "tenant": "acme"}),
    ));
    leaves.push(leaf(301, "release.refused", serde_json::json!({"tee_key": "<script>k2", "lease": "l1", "lease_token_sha256": "ab", "reason": "lease l1 is for node key X"})));
    let mut tree = MemoryTree::new();
    for l in &leaves {
        tree.append(l).unwrap();
    }
    let cp = cgx_tlog::Checkpoint::new(ORIGIN, tree.size(), tree.root().unwrap(), "").unwrap();
    let note = sign_checkpoint(&cp, &kbs_key).unwrap();
    // A log server that can be told to change one leaf of a bundle.
    let lie = Arc::new(Mutex::new(false));
    let served = {
        let (leaves, note, lie) = (leaves.clone(), note.clone(), lie.clone());
        axum::Router::new().route(
            "/log/{*path}",
            axum::routing::get(
                move |axum::extract::Path(path): axum::extract::Path<String>| {
                    let (leaves, note, lie) = (leaves.clone(), note.clone(), lie.clone());
                    async move {
                        if path == "checkpoint" {
                            return note;
                        }
                        let t = cgx_tlog::paths::parse_tile_path(&path).unwrap();
                        let start = usize::try_from(t.level_index() * 256).unwrap();
                        let mut part: Vec<Vec<u8>> =
                            leaves[start..start + t.width() as usize].to_vec();
                        if *lie.lock().unwrap() {
                            let last = part.len() - 1;
                            part[last] = String::from_utf8(part[last].clone())
                                .unwrap()
                                .replace("l1", "l9")
                                .into_bytes();
                        }
                        cgx_tlog::bundle::encode(&part).unwrap()
                    }
                },
            ),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, served).await.unwrap() });
    let h = Harness::with("console-mirror", |c| {
        c.log = Some(cgx_service::logwriter::LogConfig {
            origin: "broker.test/log".into(),
            key: dir.join("log.pk8"),
            interval_ms: 1000,
            state: None,
            witnesses: Vec::new(),
            quorum: 0,
            anchors: vec![cgx_service::logwriter::AnchorRef {
                vkey: kbs_key.vkey(),
                url: format!("http://{addr}/log"),
                ca: None,
                reader_key: Some(dir.join("reader.pk8")),
            }],
            export_dir: None,
        })
    })
    .await;
    // Nothing is mirrored before this broker's log anchored a checkpoint of it.
    assert_eq!(h.broker.mirror_kbs_logs().await.unwrap(), 0);
    assert_eq!(h.broker.anchor_logs().await.unwrap(), 1);
    // Lying: nothing kept, and the reason.
    *lie.lock().unwrap() = true;
    let e = h.broker.mirror_kbs_logs().await.unwrap_err().to_string();
    assert!(e.contains("do not make the root"), "{e}");
    assert_eq!(h.broker.store.mirror_state(ORIGIN).await.unwrap(), None);
    assert!(
        h.broker
            .store
            .releases_of_lease("l1", &[])
            .await
            .unwrap()
            .is_empty()
    );
    // Honest: both kept, by lease; a second pass reads nothing new.
    *lie.lock().unwrap() = false;
    assert_eq!(h.broker.mirror_kbs_logs().await.unwrap(), 302);
    assert_eq!(h.broker.mirror_kbs_logs().await.unwrap(), 0);
    let got = h.broker.store.releases_of_lease("l1", &[]).await.unwrap();
    let actions: Vec<&str> = got.iter().map(|r| r.action.as_str()).collect();
    assert_eq!(actions, ["release", "release.refused"]);
    assert_eq!((got[0].idx, got[1].idx), (300, 301));
    assert_eq!(
        h.broker
            .store
            .releases_of_lease("l2", &["ab".into()])
            .await
            .unwrap()
            .len(),
        1
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Markup in the job's other free fields — its GPU model, regions, resources — is refused at
/// submission through the form, with the reason shown as text, and nothing is stored.
#[tokio::test]
async fn markup_in_a_jobs_names_is_refused_or_inert() {
    let h = Harness::new("console-xss-names").await;
    h.register(&h.node(1)).await.unwrap();
    let mut t = Browser::new(&h);
    t.sign_in(&h, Role::Tenant).await;
    let csrf = t.csrf("/console/jobs").await;
    let evil = enc("<script>alert(1)</script>");
    for (field, value) in [
        ("gpu_model", evil.clone()),
        ("regions", evil.clone()),
        (
            "resources",
            enc(&format!("{TENANT}/<img src=x onerror=alert(2)>/k")),
        ),
    ] {
        let mut form = format!(
            "csrf={csrf}&gpu_model=H100&gpu_count=1&max_price=3&duration_secs=600&budget=3"
        );
        form = form.replace(&format!("&{field}=H100"), "");
        form.push_str(&format!("&{field}={value}"));
        let a = t.post("/console/jobs", &form).await;
        assert!(
            !a.body.contains("<script>alert") && !a.body.contains("<img src=x"),
            "{field}"
        );
        if a.status == StatusCode::SEE_OTHER {
            // Accepted: then every page shows it as text.
            let page = t.get(a.location()).await;
            assert!(
                !page.body.contains("<script>alert") && !page.body.contains("<img src=x"),
                "{field}"
            );
        }
    }
    let list = t.get("/console/jobs").await;
    assert!(!list.body.contains("<script>alert") && !list.body.contains("<img src=x"));
}
