//! The console's credentials, as plain functions over the broker's console MAC key (sans-IO:
//! the handlers read and set the cookies).
//!
//! - **Sign-in challenge.** `GET /console/login` puts 16 random bytes `r` in a cookie of that
//!   browser's (`__Host-cgx_login`) and shows `challenge = exp "." hex(MAC("login", r, exp))`. The
//!   user signs it with their API key (`cgx console login`, a [`ConsoleLogin`] record) and
//!   pastes the token. The broker checks the token under its API keys, recomputes the challenge
//!   from *this* browser's cookie (so a token made for another browser's challenge is refused
//!   here: an attacker cannot sign a victim's browser into the attacker's account) and spends it
//!   once. What it cannot tell: whose browser showed the challenge. A user who runs `cgx
//!   console login` on a challenge someone else sent them signs that person in as themselves
//!   (as with any code-pasting sign-in); the command says so.
//! - **Session cookie.** `v1.<key index>.<key fingerprint>.<sid>.<iat>.<exp>.<MAC>`: stateless,
//!   so any replica (same signing key, same MAC key) serves it; it names the API key by index
//!   *and* fingerprint, so removing or replacing the key ends its sessions; it lives at most the
//!   API tokens' longest lifetime; signing out spends its `sid` (checked on every request).
//! - **CSRF token.** `hex(MAC("csrf", sid))`, in every form, compared in constant time.
//!
//! [`ConsoleLogin`]: cgx_protocol::records::ConsoleLogin

use super::super::keys::Keys;

/// The session cookie's name. `__Host-`: the browser keeps it only as set by this origin over
/// a secure context, for `Path=/`, with no `Domain` — a sibling host cannot toss one in.
pub(crate) const SESSION_COOKIE: &str = "__Host-cgx_session";
/// The sign-in challenge's cookie.
pub(crate) const LOGIN_COOKIE: &str = "__Host-cgx_login";
/// How long a sign-in challenge may be answered.
pub(crate) const LOGIN_TTL: i64 = 300;

const SESSION_LABEL: &[u8] = b"cgx/broker/console/session/v1";
const LOGIN_LABEL: &[u8] = b"cgx/broker/console/login/v1";
const CSRF_LABEL: &[u8] = b"cgx/broker/console/csrf/v1";

/// Why a session cookie or a sign-in was refused (shown to the user as is: no secrets).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SessionError {
    #[error("not signed in")]
    Missing,
    #[error("the session cookie is malformed")]
    Malformed,
    #[error("the session cookie was not made by this broker")]
    BadMac,
    #[error("the session expired: sign in again")]
    Expired,
    #[error("the key this session was made with is no longer configured")]
    KeyGone,
    #[error("this session was signed out")]
    SignedOut,
    #[error("no sign-in challenge in this browser: open the sign-in page again")]
    NoChallenge,
    #[error("the token answers another challenge than this browser's")]
    WrongChallenge,
    #[error("the sign-in challenge expired: open the sign-in page again")]
    ChallengeExpired,
    #[error("this sign-in token was already used")]
    ChallengeUsed,
}

/// A session the broker made, once its MAC is checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Session {
    pub index: usize,
    pub fingerprint: [u8; 8],
    pub sid: [u8; 16],
    pub iat: i64,
    pub exp: i64,
}

impl Session {
    /// A new session for API key `index` (its `fingerprint`) from `now` to `exp`.
    pub(crate) fn new(index: usize, fingerprint: [u8; 8], now: i64, exp: i64) -> Option<Self> {
        let mut sid = [0u8; 16];
        aws_lc_rs::rand::fill(&mut sid).ok()?;
        Some(Session {
            index,
            fingerprint,
            sid,
            iat: now,
            exp,
        })
    }

    fn body(&self) -> String {
        format!(
            "v1.{}.{}.{}.{}.{}",
            self.index,
            hex::encode(self.fingerprint),
            hex::encode(self.sid),
            self.iat,
            self.exp
        )
    }

    /// The cookie's value.
    pub(crate) fn encode(&self, keys: &Keys) -> String {
        let body = self.body();
        let mac = keys.console_mac(SESSION_LABEL, &[body.as_bytes()]);
        format!("{body}.{}", hex::encode(mac))
    }

    /// A cookie's value checked: its MAC, then its lifetime at `now`.
    pub(crate) fn decode(value: &str, keys: &Keys, now: i64) -> Result<Session, SessionError> {
        // Limits before parsing: a session cookie is about 140 bytes.
        if value.len() > 256 {
            return Err(SessionError::Malformed);
        }
        let (body, mac) = value.rsplit_once('.').ok_or(SessionError::Malformed)?;
        let mac = hex::decode(mac).map_err(|_| SessionError::Malformed)?;
        if !keys.console_mac_ok(SESSION_LABEL, &[body.as_bytes()], &mac) {
            return Err(SessionError::BadMac);
        }
        // Made by this broker: the fields are its own spelling.
        let parts: Vec<&str> = body.split('.').collect();
        let [v, index, fp, sid, iat, exp] = parts.as_slice() else {
            return Err(SessionError::Malformed);
        };
        if *v != "v1" {
            return Err(SessionError::Malformed);
        }
        let hex_array = |s: &str| hex::decode(s).map_err(|_| SessionError::Malformed);
        let s = Session {
            index: index.parse().map_err(|_| SessionError::Malformed)?,
            fingerprint: hex_array(fp)?
                .try_into()
                .map_err(|_| SessionError::Malformed)?,
            sid: hex_array(sid)?
                .try_into()
                .map_err(|_| SessionError::Malformed)?,
            iat: iat.parse().map_err(|_| SessionError::Malformed)?,
            exp: exp.parse().map_err(|_| SessionError::Malformed)?,
        };
        if now >= s.exp {
            return Err(SessionError::Expired);
        }
        Ok(s)
    }

    /// What signing out spends (in `used_nonces`).
    pub(crate) fn spent_name(&self) -> String {
        format!("console-session:{}", hex::encode(self.sid))
    }

    /// This session's CSRF token.
    pub(crate) fn csrf(&self, keys: &Keys) -> String {
        hex::encode(keys.console_mac(CSRF_LABEL, &[&self.sid]))
    }

    /// Is `token` this session's CSRF token? In constant time.
    pub(crate) fn csrf_ok(&self, keys: &Keys, token: &str) -> bool {
        match hex::decode(token) {
            Ok(tag) => keys.console_mac_ok(CSRF_LABEL, &[&self.sid], &tag),
            Err(_) => false,
        }
    }
}

/// A new sign-in secret for a browser's cookie (hex of 16 random bytes).
pub(crate) fn login_secret() -> Option<String> {
    let mut r = [0u8; 16];
    aws_lc_rs::rand::fill(&mut r).ok()?;
    Some(hex::encode(r))
}

/// The challenge shown beside a browser's sign-in secret, answerable until `exp`.
pub(crate) fn challenge(keys: &Keys, secret: &str, exp: i64) -> String {
    let mac = keys.console_mac(LOGIN_LABEL, &[secret.as_bytes(), &exp.to_be_bytes()]);
    format!("{exp}.{}", hex::encode(mac))
}

/// Is `answered` (the challenge a sign-in token carries) the challenge of this browser's
/// `secret`, still open at `now`? Its one spelling (what is spent: `+1300` and `01300` are the
/// same expiry) and its expiry.
pub(crate) fn check_challenge(
    keys: &Keys,
    secret: Option<&str>,
    answered: &str,
    now: i64,
) -> Result<(String, i64), SessionError> {
    let secret = secret
        .filter(|s| is_secret(s))
        .ok_or(SessionError::NoChallenge)?;
    let (exp, mac) = answered
        .split_once('.')
        .ok_or(SessionError::WrongChallenge)?;
    let exp: i64 = exp.parse().map_err(|_| SessionError::WrongChallenge)?;
    let mac = hex::decode(mac).map_err(|_| SessionError::WrongChallenge)?;
    if !keys.console_mac_ok(LOGIN_LABEL, &[secret.as_bytes(), &exp.to_be_bytes()], &mac) {
        return Err(SessionError::WrongChallenge);
    }
    if now > exp {
        return Err(SessionError::ChallengeExpired);
    }
    Ok((challenge(keys, secret, exp), exp))
}

/// A sign-in secret as [`login_secret`] makes them: 32 lowercase hex digits.
pub(crate) fn is_secret(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The value of cookie `name` in a request's `Cookie` headers; none where the request carries
/// two of that name (which one the browser meant cannot be told).
pub(crate) fn cookie<'a>(headers: &'a axum::http::HeaderMap, name: &str) -> Option<&'a str> {
    let mut found = headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .filter(|(k, _)| *k == name)
        .map(|(_, v)| v);
    let first = found.next()?;
    found.next().is_none().then_some(first)
}

/// A `Set-Cookie` value: HttpOnly, Secure, SameSite=Strict, host-only (`__Host-` names need
/// `Path=/`; the API reads no cookie). Chromium and Firefox keep `Secure` cookies on
/// `http://127.0.0.1`, a secure context.
pub(crate) fn set_cookie(name: &str, value: &str, max_age: i64) -> String {
    format!(
        "{name}={value}; Path=/; Max-Age={}; HttpOnly; Secure; SameSite=Strict",
        max_age.max(0)
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn keys() -> Keys {
        let pkcs8 = aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(
            &aws_lc_rs::rand::SystemRandom::new(),
        )
        .unwrap();
        Keys::from_pkcs8(pkcs8.as_ref().to_vec()).unwrap()
    }

    #[test]
    fn a_session_cookie_verifies_only_as_made_and_until_it_expires() {
        let k = keys();
        let s = Session::new(2, [7; 8], 1_000, 4_600).unwrap();
        let c = s.encode(&k);
        assert_eq!(Session::decode(&c, &k, 1_001), Ok(s.clone()));
        assert_eq!(Session::decode(&c, &k, 4_600), Err(SessionError::Expired));
        // Another broker's key, an edited field, a truncated MAC, junk, a huge value.
        assert_eq!(
            Session::decode(&c, &keys(), 1_001),
            Err(SessionError::BadMac)
        );
        let edited = c.replacen("v1.2.", "v1.0.", 1);
        assert_eq!(
            Session::decode(&edited, &k, 1_001),
            Err(SessionError::BadMac)
        );
        let longer = c.replacen(".4600.", ".999999.", 1);
        assert_eq!(
            Session::decode(&longer, &k, 1_001),
            Err(SessionError::BadMac)
        );
        assert_eq!(
            Session::decode(&c[..c.len() - 2], &k, 1_001),
            Err(SessionError::BadMac)
        );
        assert_eq!(
            Session::decode("nodots", &k, 1_001),
            Err(SessionError::Malformed)
        );
        assert_eq!(
            Session::decode(&"a.".repeat(200), &k, 1_001),
            Err(SessionError::Malformed)
        );
        // CSRF tokens are per session.
        let other = Session::new(2, [7; 8], 1_000, 4_600).unwrap();
        assert!(s.csrf_ok(&k, &s.csrf(&k)));
        assert!(!s.csrf_ok(&k, &other.csrf(&k)));
        assert!(!s.csrf_ok(&k, ""));
        assert!(!s.csrf_ok(&k, "zz"));
    }

    #[test]
    fn a_challenge_is_answered_only_from_its_own_browser_and_in_time() {
        let k = keys();
        let mine = login_secret().unwrap();
        let theirs = login_secret().unwrap();
        let c = challenge(&k, &mine, 1_300);
        assert_eq!(
            check_challenge(&k, Some(&mine), &c, 1_000),
            Ok((c.clone(), 1_300))
        );
        // Another spelling of the same expiry is the same challenge, spent as one.
        let respelled = c.replacen("1300.", "+01300.", 1);
        assert_eq!(
            check_challenge(&k, Some(&mine), &respelled, 1_000),
            Ok((c.clone(), 1_300))
        );
        assert_eq!(
            check_challenge(&k, Some(&theirs), &c, 1_000),
            Err(SessionError::WrongChallenge)
        );
        assert_eq!(
            check_challenge(&k, None, &c, 1_000),
            Err(SessionError::NoChallenge)
        );
        assert_eq!(
            check_challenge(&k, Some(&mine), &c, 1_301),
            Err(SessionError::ChallengeExpired)
        );
        // A later expiry under the same MAC is another challenge.
        let moved = c.replacen("1300.", "9999.", 1);
        assert_eq!(
            check_challenge(&k, Some(&mine), &moved, 1_000),
            Err(SessionError::WrongChallenge)
        );
        assert_eq!(
            check_challenge(&k, Some(&mine), "junk", 1_000),
            Err(SessionError::WrongChallenge)
        );
    }

    #[test]
    fn cookies_are_read_by_name() {
        let mut h = axum::http::HeaderMap::new();
        h.append(
            axum::http::header::COOKIE,
            "a=1; __Host-cgx_session=v1.x; __Host-cgx_login=abc"
                .parse()
                .unwrap(),
        );
        assert_eq!(cookie(&h, SESSION_COOKIE), Some("v1.x"));
        assert_eq!(cookie(&h, LOGIN_COOKIE), Some("abc"));
        assert_eq!(cookie(&h, "b"), None);
        // Two of one name (one tossed in by another host): neither is taken.
        h.append(
            axum::http::header::COOKIE,
            "__Host-cgx_session=v1.y".parse().unwrap(),
        );
        assert_eq!(cookie(&h, SESSION_COOKIE), None);
        assert!(set_cookie("n", "v", 60).contains("HttpOnly; Secure; SameSite=Strict"));
    }
}
