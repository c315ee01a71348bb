//! Sign-in with an existing API key (`session.rs` says how the challenge binds the browser),
//! and sign-out.

use std::sync::Arc;

use axum::Form;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use maud::html;
use serde::Deserialize;

use super::super::Broker;
use super::super::store::{NodeWrite, Outcome};
use super::session::{self, Session, SessionError};
use super::{ConsoleError, Viewer, html_response, layout, origin, same_origin, see_other};

/// `GET /console/login`: a new challenge for this browser, the command that answers it.
pub(super) async fn page(State(b): State<Arc<Broker>>, headers: HeaderMap) -> Response {
    let now = b.clock.unix();
    // One secret per browser while it lasts: every tab's challenge answers to it (a new one
    // per view would undo a sign-in begun in another tab).
    let kept = session::cookie(&headers, session::LOGIN_COOKIE)
        .filter(|s| session::is_secret(s))
        .map(str::to_string);
    let Some(secret) = kept.or_else(session::login_secret) else {
        return ConsoleError::Broker(super::super::BrokerError::Internal("random".into()))
            .into_response();
    };
    let exp = now + session::LOGIN_TTL;
    let challenge = session::challenge(&b.keys, &secret, exp);
    let command = format!(
        "cgx console login --broker {} --key YOUR-API-KEY.pk8 --challenge {challenge}",
        origin(&b, &headers)
    );
    let body = html! {
        h1 { "Sign in" }
        p { "Sign in with the API key the broker knows you by (a tenant's, an operator's or an "
            "auditor's). Run this where the key is, then paste what it prints:" }
        pre.command { code id="login-command" { (command) } }
        form method="post" action="/console/login" {
            label for="token" { "Sign-in token" }
            textarea id="token" name="token" rows="4" required autocomplete="off" spellcheck="false" {}
            button type="submit" { "Sign in" }
        }
        p.hint { "The challenge is this browser's alone and lasts "
            (layout::span(session::LOGIN_TTL)) "; the session lasts at most "
            (layout::span(b.config.api_token_max_ttl_secs)) "." }
    };
    let mut resp = html_response(layout::page("Sign in", None, false, body));
    if let Ok(v) = HeaderValue::from_str(&session::set_cookie(
        session::LOGIN_COOKIE,
        &secret,
        session::LOGIN_TTL,
    )) {
        resp.headers_mut().append(header::SET_COOKIE, v);
    }
    resp
}

#[derive(Debug, Deserialize)]
pub(super) struct SignIn {
    token: String,
}

/// `POST /console/login`: the token checked under the API keys, its challenge against this
/// browser's, spent once; a session cookie set.
pub(super) async fn sign_in(
    State(b): State<Arc<Broker>>,
    headers: HeaderMap,
    Form(form): Form<SignIn>,
) -> Result<Response, ConsoleError> {
    same_origin(&headers)?;
    let now = b.clock.unix();
    let token = form.token.trim();
    if token.len() > cgx_protocol::signed::MAX_TOKEN_BYTES {
        return Err(ConsoleError::BadRequest("the token is too long".into()));
    }
    // The cheap check first: no challenge in this browser, no signature is checked.
    let secret = session::cookie(&headers, session::LOGIN_COOKIE)
        .filter(|s| session::is_secret(s))
        .ok_or(SessionError::NoChallenge)?;
    let (admin, answered, _) = b
        .api_keys
        .authenticate_login(token, now)
        .map_err(super::super::BrokerError::from)?;
    let (challenge, challenge_exp) =
        session::check_challenge(&b.keys, Some(secret), &answered, now)?;
    let spent = b
        .store
        .write(NodeWrite::UseNonce {
            nonce: format!("console-login:{challenge}"),
            expires_at: challenge_exp,
        })
        .await?;
    if !matches!(spent, Outcome::Done) {
        return Err(SessionError::ChallengeUsed.into());
    }
    let index = admin.index();
    let fingerprint = b.api_keys.fingerprint(index).ok_or(SessionError::KeyGone)?;
    let exp = now + b.config.api_token_max_ttl_secs;
    let s = Session::new(index, fingerprint, now, exp)
        .ok_or_else(|| super::super::BrokerError::Internal("random".into()))?;
    tracing::info!(actor = %admin.actor(), "console sign-in");
    let mut resp = see_other("/console/");
    for c in [
        session::set_cookie(session::SESSION_COOKIE, &s.encode(&b.keys), exp - now),
        session::set_cookie(session::LOGIN_COOKIE, "", 0),
    ] {
        if let Ok(v) = HeaderValue::from_str(&c) {
            resp.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    Ok(resp)
}

/// `POST /console/logout`: the session spent (every replica refuses it from now on).
pub(super) async fn sign_out(
    State(b): State<Arc<Broker>>,
    viewer: Viewer,
    headers: HeaderMap,
    Form(form): Form<super::CsrfForm>,
) -> Result<Response, ConsoleError> {
    viewer.check_change(&b, &headers, &form.csrf)?;
    b.store
        .write(NodeWrite::UseNonce {
            nonce: viewer.session.spent_name(),
            expires_at: viewer.session.exp,
        })
        .await?;
    let mut resp = see_other("/console/login");
    if let Ok(v) = HeaderValue::from_str(&session::set_cookie(session::SESSION_COOKIE, "", 0)) {
        resp.headers_mut().append(header::SET_COOKIE, v);
    }
    Ok(resp)
}
