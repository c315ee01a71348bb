//! The web console under `/console/`, on the broker's own listener: pages rendered on the
//! server (maud: every splice escaped by construction), a stylesheet and a small script
//! embedded in the binary. Nothing to build or install; every page reads with JavaScript off;
//! the script only refreshes live pages (polling with `ETag`s and back-off).
//!
//! - `session.rs`: sign-in challenge, session cookie, CSRF token (plain functions).
//! - `login.rs`: sign-in and sign-out.
//! - `tenant.rs`: jobs (state history, node, lease, proofs, windows), submit, cancel, spend.
//! - `provider.rs`: nodes (attestation, claims, why not placeable, proofs), earnings.
//! - `auditor.rs`: the log's checkpoint and cosignatures, the admin trail, how to verify.
//! - `layout.rs`, `chart.rs`, `assets.rs`: the frame, SVG charts, CSS and JS.
//!
//! The boundary: a page calls the same `impl Broker` functions the JSON API does, with the
//! same [`Admin`] the API would authenticate — scoping (a tenant's own jobs, an operator's own
//! nodes, auditors read-only over everything) is the API's tested code, not the console's.

mod assets;
mod auditor;
mod chart;
mod layout;
mod login;
mod provider;
pub(crate) mod session;
mod tenant;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use cgx_service::auth::Admin;
use cgx_service::error::ApiError;
use maud::{Markup, html};

use super::{Broker, BrokerError};
use session::{Session, SessionError};

/// A metering record as the node page charts it, once verified under the node's key: when
/// its window ended and each GPU's utilization; `None`: it did not verify.
pub(crate) type Usage = Option<(i64, Vec<(u32, u8)>)>;

/// The largest form the console takes (a job with its placement policy and workload).
const FORM_BODY: usize = 96 << 10;

/// Rows per list page.
pub(crate) const PAGE: usize = 50;

/// The Content-Security-Policy of every console response: nothing inline, nothing from
/// elsewhere, no framing, forms post only here.
pub(crate) const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; \
    base-uri 'none'";

/// The console's routes (merged into the broker's router).
pub(crate) fn router() -> Router<Arc<Broker>> {
    Router::new()
        .route("/console", get(|| async { Redirect::to("/console/") }))
        .route("/console/", get(home))
        .route("/console/login", get(login::page).post(login::sign_in))
        .route("/console/logout", post(login::sign_out))
        .route("/console/jobs", get(tenant::jobs).post(tenant::submit))
        .route("/console/jobs/{id}", get(tenant::job))
        .route("/console/jobs/{id}/why", get(tenant::why))
        .route("/console/jobs/{id}/cancel", post(tenant::cancel))
        .route("/console/statement", get(tenant::statement))
        .route("/console/nodes", get(provider::nodes))
        .route("/console/nodes/{id}", get(provider::node))
        .route("/console/nodes/{id}/reattest", post(provider::reattest))
        .route("/console/log", get(auditor::log))
        .route("/console/log/events/{seq}", get(auditor::event))
        .route("/console/log/events/{seq}/proof", get(auditor::proof))
        .route("/console/log/archive/{sha256}", get(auditor::archived))
        .route("/console/assets/{name}", get(assets::asset))
        .route("/console/{*rest}", get(|| async { ConsoleError::NotFound }))
        .layer(DefaultBodyLimit::max(FORM_BODY))
        .layer(axum::middleware::from_fn(headers))
}

/// Security headers on every console response, error pages and assets included.
async fn headers(req: Request, next: Next) -> Response {
    let started = std::time::Instant::now();
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    // The server's time on the page (what `cgx-bench console` reports; browsers show it).
    if let Ok(v) = HeaderValue::from_str(&format!(
        "app;dur={:.3}",
        started.elapsed().as_secs_f64() * 1e3
    )) {
        h.insert(header::HeaderName::from_static("server-timing"), v);
    }
    let set = |h: &mut HeaderMap, k: header::HeaderName, v: &'static str| {
        h.insert(k, HeaderValue::from_static(v));
    };
    set(h, header::CONTENT_SECURITY_POLICY, CSP);
    set(h, header::X_CONTENT_TYPE_OPTIONS, "nosniff");
    set(h, header::REFERRER_POLICY, "same-origin");
    set(h, header::X_FRAME_OPTIONS, "DENY");
    h.insert(
        header::HeaderName::from_static("cross-origin-opener-policy"),
        HeaderValue::from_static("same-origin"),
    );
    h.insert(
        header::HeaderName::from_static("cross-origin-resource-policy"),
        HeaderValue::from_static("same-origin"),
    );
    if !h.contains_key(header::CACHE_CONTROL) {
        set(h, header::CACHE_CONTROL, "no-store");
    }
    set(h, header::VARY, "Cookie");
    resp
}

/// `/console/`: the first section the viewer may read.
async fn home(viewer: Viewer) -> Redirect {
    if viewer.is_tenant() {
        Redirect::to("/console/jobs")
    } else if viewer.is_operator() {
        Redirect::to("/console/nodes")
    } else {
        Redirect::to("/console/log")
    }
}

/// A signed-in user: the API key's [`Admin`] (what the API would authenticate), its session
/// and the session's CSRF token.
#[derive(Debug, Clone)]
pub(crate) struct Viewer {
    pub admin: Admin,
    pub session: Session,
    pub csrf: String,
}

impl Viewer {
    fn scopes(&self) -> &[String] {
        self.admin.scopes()
    }

    /// Reads everything (`auditor`, `*`).
    pub(crate) fn is_auditor(&self) -> bool {
        self.scopes().iter().any(|s| s == "*" || s == "auditor")
    }

    /// The tenants this key acts for.
    pub(crate) fn tenants(&self) -> Vec<&str> {
        self.scopes()
            .iter()
            .filter_map(|s| s.strip_prefix("tenant:"))
            .collect()
    }

    /// The operators this key acts for.
    pub(crate) fn operators(&self) -> Vec<&str> {
        self.scopes()
            .iter()
            .filter_map(|s| s.strip_prefix("operator:"))
            .collect()
    }

    pub(crate) fn is_tenant(&self) -> bool {
        !self.tenants().is_empty()
    }

    pub(crate) fn is_operator(&self) -> bool {
        !self.operators().is_empty()
    }

    /// Who is signed in, as the header shows it.
    pub(crate) fn who(&self) -> String {
        let s = self.scopes().join(", ");
        if s.is_empty() { self.admin.actor() } else { s }
    }

    /// A change's checks: this session's CSRF token, and a browser's own word that the
    /// request came from this origin (`Sec-Fetch-Site`, else `Origin` against `Host`), where
    /// it says one. SameSite=Strict cookies come on top.
    pub(crate) fn check_change(
        &self,
        b: &Broker,
        headers: &HeaderMap,
        csrf: &str,
    ) -> Result<(), ConsoleError> {
        same_origin(headers)?;
        if !self.session.csrf_ok(&b.keys, csrf) {
            return Err(ConsoleError::Csrf("the form's token is not this session's"));
        }
        Ok(())
    }
}

/// Refuse a request a browser says came from another site: its `Sec-Fetch-Site` where it
/// sends one (every current browser does), else its `Origin` against `Host`. (Chromium sends
/// `Origin: null` on a form post from a `no-referrer` page: hence `same-origin` referrers.)
pub(crate) fn same_origin(headers: &HeaderMap) -> Result<(), ConsoleError> {
    if let Some(site) = headers.get("sec-fetch-site") {
        return if site.as_bytes() == b"same-origin" {
            Ok(())
        } else {
            Err(ConsoleError::Csrf("the request came from another site"))
        };
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let host = headers.get(header::HOST).map(HeaderValue::as_bytes);
        let origin = origin.as_bytes();
        let origin_host = origin
            .strip_prefix(b"http://")
            .or_else(|| origin.strip_prefix(b"https://"));
        if origin_host.is_none() || origin_host != host {
            return Err(ConsoleError::Csrf(
                "the request's origin is not this console",
            ));
        }
    }
    Ok(())
}

impl FromRequestParts<Arc<Broker>> for Viewer {
    type Rejection = ConsoleError;

    async fn from_request_parts(
        parts: &mut Parts,
        b: &Arc<Broker>,
    ) -> Result<Self, Self::Rejection> {
        let value = session::cookie(&parts.headers, session::SESSION_COOKIE)
            .ok_or(SessionError::Missing)?;
        let session = Session::decode(value, &b.keys, b.clock.unix())?;
        // The key is looked up by index and fingerprint now: a key removed or replaced since
        // ends the session.
        let admin = b
            .api_keys
            .admin_at(session.index, session.fingerprint)
            .ok_or(SessionError::KeyGone)?;
        if b.store.nonce_used(&session.spent_name()).await? {
            return Err(SessionError::SignedOut.into());
        }
        let csrf = session.csrf(&b.keys);
        Ok(Viewer {
            admin,
            session,
            csrf,
        })
    }
}

/// Why a console request was refused: an HTML page with the reason (never internals), or a
/// redirect to sign in.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ConsoleError {
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error(transparent)]
    Broker(#[from] BrokerError),
    #[error("refused: {0}")]
    Csrf(&'static str),
    #[error("{0}")]
    BadRequest(String),
    #[error("no such page")]
    NotFound,
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let (status, code, detail) = match &self {
            ConsoleError::Session(SessionError::Missing) => {
                return Redirect::to("/console/login").into_response();
            }
            ConsoleError::Session(e) => (StatusCode::UNAUTHORIZED, "SessionRefused", e.to_string()),
            // As the API's problem details: a server error's text stays in the log.
            ConsoleError::Broker(e) => (e.status(), e.code(), cgx_service::error::detail(e)),
            ConsoleError::Csrf(_) => (StatusCode::FORBIDDEN, "CsrfRefused", self.to_string()),
            ConsoleError::BadRequest(_) => {
                (StatusCode::BAD_REQUEST, "BadRequest", self.to_string())
            }
            ConsoleError::NotFound => (StatusCode::NOT_FOUND, "NotFound", self.to_string()),
        };
        let body = layout::page(
            status.canonical_reason().unwrap_or("Error"),
            None,
            false,
            html! {
                h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or("")) }
                p.error role="alert" { (detail) }
                p { "Code: " code { (code) } }
                p { a href="/console/" { "Back to the console" } }
            },
        );
        (status, html_response(body)).into_response()
    }
}

/// A rendered page as a response.
pub(crate) fn html_response(m: Markup) -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        m.into_string(),
    )
        .into_response()
}

/// A live page: answered 304 when the browser's `If-None-Match` names what it would get (the
/// body's SHA-256), so a poll that finds nothing new moves a few bytes.
pub(crate) fn live_response(headers: &HeaderMap, m: Markup) -> Response {
    let body = m.into_string();
    let d = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, body.as_bytes());
    let etag = format!("\"{}\"", hex::encode(&d.as_ref()[..16]));
    let matches = headers
        .get(header::IF_NONE_MATCH)
        .is_some_and(|v| v.as_bytes() == etag.as_bytes());
    let mut resp = if matches {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], body).into_response()
    };
    if let Ok(v) = HeaderValue::from_str(&etag) {
        resp.headers_mut().insert(header::ETAG, v);
    }
    // Revalidated each time, kept nowhere shared.
    resp.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("private, no-cache"),
    );
    resp
}

/// The broker's address as this browser reached it (for the command the page shows).
pub(crate) fn origin(b: &Broker, headers: &HeaderMap) -> String {
    let scheme = if b.config.tls.is_some() {
        "https"
    } else {
        "http"
    };
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .filter(|h| {
            h.len() <= 255
                && h.bytes().all(|c| {
                    c.is_ascii_alphanumeric() || matches!(c, b'.' | b'-' | b':' | b'[' | b']')
                })
        })
        .unwrap_or("BROKER");
    format!("{scheme}://{host}")
}

/// A 303 to `to` after a change.
pub(crate) fn see_other(to: &str) -> Response {
    Redirect::to(to).into_response()
}

/// An id from a path, checked as the API checks it (`http::check_id`), so a URL cannot carry
/// markup or path tricks into a query; a page that is not there is "not found".
pub(crate) fn check_id(id: &str) -> Result<(), ConsoleError> {
    super::http::check_id(id).map_err(|_| ConsoleError::NotFound)
}

/// A change's form: the session's CSRF token alone (cancel, re-attest, sign out).
#[derive(Debug, serde::Deserialize)]
pub(crate) struct CsrfForm {
    pub csrf: String,
}
