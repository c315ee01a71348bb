//! Administrator authentication for every service's admin API: a bearer EdDSA token (compact
//! JWS, as CoCo's kbs-client signs them) under one of the configured Ed25519 keys, each key
//! scoped to the repositories (tenants) it may change, `*` for all and the global settings.
//!
//! [`Admin`] is an extractor: a handler that takes one cannot run for an unauthenticated
//! caller, and it runs before the handler reads its path or body.
//!
//! Every token names the one service it is for in `aud` (a single string): the KBS's admin
//! API takes [`KBS_ADMIN_AUDIENCE`], the broker's API [`BROKER_API_AUDIENCE`], so a token
//! made for one is refused by the other even where an operator gave both the same key. A
//! token without `aud` is refused. There is no `iss` check: the key that verifies the token
//! is its issuer.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use axum::response::IntoResponse;

use crate::jwt;

/// Why an admin request was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum AuthError {
    #[error("no bearer token")]
    NoToken,
    #[error(transparent)]
    Token(#[from] jwt::JwtError),
    #[error("admin key {key} may not change {what}")]
    OutOfScope { key: usize, what: String },
    #[error("a lease is not an admin token")]
    NotAnAdminToken,
    #[error("the token names no audience (aud); this service takes tokens for {expected}")]
    NoAudience { expected: &'static str },
    #[error("the token is for {found}, not for {expected}")]
    WrongAudience {
        expected: &'static str,
        found: String,
    },
}

/// The audience of KBS admin tokens (`cgx kbs token`, the KBS's admin API).
pub const KBS_ADMIN_AUDIENCE: &str = "cgx-kbs/admin";

/// The audience of broker API tokens (tenants, operators, auditors; `cgx broker …`).
pub const BROKER_API_AUDIENCE: &str = "cgx-broker/api";

/// The longest audience echoed in a refusal (the rest is the caller's own text).
const MAX_AUDIENCE_SHOWN: usize = 64;

/// Configured admin keys and their scopes.
#[derive(Debug, Clone, Default)]
pub struct AdminKeys {
    /// The `aud` every token must name: this service's.
    audience: &'static str,
    keys: Vec<[u8; 32]>,
    scopes: Vec<Arc<Vec<String>>>,
    /// Longest accepted token lifetime (`exp − iat`), seconds.
    max_ttl: i64,
    /// Tokens already verified, by their exact text: (key index, expiry). A client presents
    /// the same bearer token on every request of its lifetime; its signature need not be
    /// checked each time. Its expiry still is.
    verified: Arc<std::sync::Mutex<std::collections::HashMap<String, (usize, i64)>>>,
}

/// Verified tokens remembered at most (then forgotten all at once and verified again).
const VERIFIED_CACHE: usize = 4096;

/// Default cap on an admin token's lifetime: an hour (a leaked long-lived admin token is the
/// failure this bounds).
pub const DEFAULT_ADMIN_TOKEN_TTL: i64 = 3600;

impl AdminKeys {
    /// `(Ed25519 public key, repositories)` pairs of the service whose tokens name `audience`;
    /// tokens live at most `max_ttl` seconds.
    pub fn for_audience(
        audience: &'static str,
        keys: Vec<([u8; 32], Vec<String>)>,
        max_ttl: i64,
    ) -> Self {
        let (keys, scopes) = keys
            .into_iter()
            .map(|(key, scope)| (key, Arc::new(scope)))
            .unzip();
        AdminKeys {
            audience,
            keys,
            scopes,
            max_ttl,
            verified: Arc::default(),
        }
    }

    /// The administrator whose key signed `token`, valid at `now`.
    pub(crate) fn authenticate(&self, token: &str, now: i64) -> Result<Admin, AuthError> {
        let admin = |index: usize| Admin {
            index,
            repositories: self.scopes.get(index).cloned().unwrap_or_default(),
        };
        let seen = self
            .verified
            .lock()
            .ok()
            .and_then(|m| m.get(token).copied());
        if let Some((index, exp)) = seen {
            if now > exp {
                return Err(AuthError::Token(jwt::JwtError::Expired(exp)));
            }
            return Ok(admin(index));
        }
        let (index, claims) = jwt::verify_eddsa(token, &self.keys, now, self.max_ttl)?;
        // Lease claims in an admin token: a token made for one role is not taken for another.
        if claims.get("lease").is_some() || claims.get("resources").is_some() {
            return Err(AuthError::NotAnAdminToken);
        }
        // Another service's token is not this one's, whoever signed it.
        let expected = self.audience;
        match claims.get("aud") {
            None => return Err(AuthError::NoAudience { expected }),
            Some(serde_json::Value::String(aud)) if aud == expected => {}
            Some(other) => {
                let found = match other {
                    serde_json::Value::String(aud) => aud.clone(),
                    v => v.to_string(),
                };
                return Err(AuthError::WrongAudience {
                    expected,
                    found: found.chars().take(MAX_AUDIENCE_SHOWN).collect(),
                });
            }
        }
        if let (Some(exp), Ok(mut m)) = (
            claims.get("exp").and_then(serde_json::Value::as_i64),
            self.verified.lock(),
        ) {
            if m.len() >= VERIFIED_CACHE {
                m.clear();
            }
            m.insert(token.to_string(), (index, exp));
        }
        Ok(admin(index))
    }
}

/// State that can authenticate administrators: its keys, its clock, and how it reports a
/// refusal (its own error type, so the wire form is the service's).
pub trait AdminState: Send + Sync + 'static {
    type Rejection: From<AuthError> + IntoResponse;
    fn admin_keys(&self) -> &AdminKeys;
    /// Unix seconds now (the service's injected clock).
    fn unix_now(&self) -> i64;
}

/// An authenticated administrator.
#[derive(Debug, Clone)]
pub struct Admin {
    index: usize,
    repositories: Arc<Vec<String>>,
}

impl Admin {
    /// How the audit trail names this administrator.
    pub fn actor(&self) -> String {
        format!("admin:{}", self.index)
    }

    /// The scopes its key was configured with (`*`, repositories, or a service's own names
    /// such as `tenant:acme`).
    pub fn scopes(&self) -> &[String] {
        &self.repositories
    }

    /// May this administrator change `repository` (`None`: a global setting, which needs `*`)?
    pub fn may(&self, repository: Option<&str>) -> Result<(), AuthError> {
        let all = self.repositories.iter().any(|r| r == "*");
        if all || repository.is_some_and(|want| self.repositories.iter().any(|r| r == want)) {
            Ok(())
        } else {
            Err(AuthError::OutOfScope {
                key: self.index,
                what: repository
                    .map_or("global settings".to_string(), |r| format!("repository {r}")),
            })
        }
    }
}

/// The bearer token of a request, if any.
fn bearer(parts: &Parts) -> Option<&str> {
    parts
        .headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

impl<T: AdminState> FromRequestParts<Arc<T>> for Admin {
    type Rejection = T::Rejection;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<T>,
    ) -> Result<Self, Self::Rejection> {
        let token = bearer(parts).ok_or(AuthError::NoToken)?;
        Ok(state.admin_keys().authenticate(token, state.unix_now())?)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use aws_lc_rs::signature::{Ed25519KeyPair, KeyPair};

    fn key() -> (Vec<u8>, [u8; 32]) {
        let doc = Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new()).unwrap();
        let kp = Ed25519KeyPair::from_pkcs8(doc.as_ref()).unwrap();
        (
            doc.as_ref().to_vec(),
            kp.public_key().as_ref().try_into().unwrap(),
        )
    }

    #[test]
    fn scopes_tokens_and_refusals() {
        let (all_sk, all_pk) = key();
        let (tenant_sk, tenant_pk) = key();
        let (stranger_sk, _) = key();
        let keys = AdminKeys::for_audience(
            KBS_ADMIN_AUDIENCE,
            vec![(all_pk, vec!["*".into()]), (tenant_pk, vec!["acme".into()])],
            3600,
        );
        let now = 1_000_000;
        let token = |sk: &[u8], exp: i64| {
            jwt::sign_eddsa(
                sk,
                &serde_json::json!({"iat": now, "exp": exp, "aud": KBS_ADMIN_AUDIENCE}),
            )
            .unwrap()
        };
        let root = keys.authenticate(&token(&all_sk, now + 60), now).unwrap();
        assert_eq!(root.actor(), "admin:0");
        assert!(root.may(None).is_ok() && root.may(Some("other")).is_ok());
        let tenant = keys
            .authenticate(&token(&tenant_sk, now + 60), now)
            .unwrap();
        assert!(tenant.may(Some("acme")).is_ok());
        assert_eq!(
            tenant.may(Some("other")),
            Err(AuthError::OutOfScope {
                key: 1,
                what: "repository other".into()
            })
        );
        assert!(tenant.may(None).is_err(), "global settings need *");
        assert!(matches!(
            keys.authenticate(&token(&stranger_sk, now + 60), now),
            Err(AuthError::Token(jwt::JwtError::Signature))
        ));
        assert!(matches!(
            keys.authenticate(&token(&all_sk, now - 1), now),
            Err(AuthError::Token(jwt::JwtError::Expired(_)))
        ));
        assert!(
            AdminKeys::default()
                .authenticate(&token(&all_sk, now + 60), now)
                .is_err()
        );
        // Past the lifetime cap; lease claims.
        assert!(matches!(
            keys.authenticate(&token(&all_sk, now + 3601), now),
            Err(AuthError::Token(jwt::JwtError::TooLong { .. }))
        ));
        let lease = jwt::sign_eddsa(
            &all_sk,
            &serde_json::json!({"iat": now, "exp": now + 60, "lease": "l", "resources": [],
                                "aud": KBS_ADMIN_AUDIENCE}),
        )
        .unwrap();
        assert_eq!(
            keys.authenticate(&lease, now).unwrap_err(),
            AuthError::NotAnAdminToken
        );
        // A remembered token is still refused once it expires.
        let short = token(&tenant_sk, now + 5);
        assert!(keys.authenticate(&short, now).is_ok());
        assert!(keys.authenticate(&short, now + 5).is_ok());
        assert!(matches!(
            keys.authenticate(&short, now + 6),
            Err(AuthError::Token(jwt::JwtError::Expired(_)))
        ));
        // Audiences: this service's, as one string, and nothing else — not the other
        // service's, not none, not a list, not a near miss.
        let with = |claims: serde_json::Value| {
            let mut c = serde_json::json!({"iat": now, "exp": now + 60});
            c.as_object_mut()
                .unwrap()
                .extend(claims.as_object().unwrap().clone());
            jwt::sign_eddsa(&all_sk, &c).unwrap()
        };
        assert_eq!(
            keys.authenticate(&with(serde_json::json!({})), now)
                .unwrap_err(),
            AuthError::NoAudience {
                expected: KBS_ADMIN_AUDIENCE
            }
        );
        let broker =
            AdminKeys::for_audience(BROKER_API_AUDIENCE, vec![(all_pk, vec!["*".into()])], 3600);
        let for_kbs = with(serde_json::json!({"aud": KBS_ADMIN_AUDIENCE}));
        assert!(keys.authenticate(&for_kbs, now).is_ok());
        let e = broker.authenticate(&for_kbs, now).unwrap_err();
        assert_eq!(
            e,
            AuthError::WrongAudience {
                expected: BROKER_API_AUDIENCE,
                found: KBS_ADMIN_AUDIENCE.into()
            }
        );
        assert_eq!(
            e.to_string(),
            "the token is for cgx-kbs/admin, not for cgx-broker/api"
        );
        let for_broker = with(serde_json::json!({"aud": BROKER_API_AUDIENCE}));
        assert!(broker.authenticate(&for_broker, now).is_ok());
        assert!(matches!(
            keys.authenticate(&for_broker, now),
            Err(AuthError::WrongAudience { .. })
        ));
        for aud in [
            serde_json::json!([KBS_ADMIN_AUDIENCE]),
            serde_json::json!([KBS_ADMIN_AUDIENCE, BROKER_API_AUDIENCE]),
            serde_json::json!("cgx-kbs/admin "),
            serde_json::json!("CGX-KBS/ADMIN"),
            serde_json::json!(""),
            serde_json::json!(null),
            serde_json::json!(cgx_protocol::broker::LEASE_AUDIENCE),
            serde_json::json!("x".repeat(10_000)),
        ] {
            let e = keys
                .authenticate(&with(serde_json::json!({ "aud": aud })), now)
                .unwrap_err();
            assert!(matches!(e, AuthError::WrongAudience { .. }), "{aud}: {e}");
            assert!(e.to_string().len() < 200, "{e}");
        }
        // Scopes match whole names, case and all.
        for other in ["acm", "acme2", "ACME", "acme/x", "*"] {
            assert!(tenant.may(Some(other)).is_err(), "{other}");
        }
    }
}
