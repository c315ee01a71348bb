//! Administrator authentication for every service's admin API: a bearer token (a signed
//! record, [`cgx_protocol::signed`]: compact JWS, EdDSA) under one of the configured Ed25519
//! keys, each key scoped to the repositories (tenants) it may change, `*` for all and the
//! global settings. CoCo's kbs-client presents such a token from its `--admin-token-file`.
//!
//! [`Admin`] is an extractor: a handler that takes one cannot run for an unauthenticated
//! caller, and it runs before the handler reads its path or body.
//!
//! Every token is a typed record ([`cgx_protocol::signed`]) of the one service it is for: the
//! KBS's admin API takes [`KbsAdminToken`]s (`typ` `cgx-kbs-admin+jwt`, `aud`
//! [`KBS_ADMIN_AUDIENCE`]), the broker's API [`BrokerApiToken`]s (`cgx-broker-api+jwt`,
//! [`BROKER_API_AUDIENCE`]), so a token made for one is refused by the other even where an
//! operator gave both the same key, and no other record (a lease, a heartbeat) is taken for
//! either. There is no `iss` check: the key that verifies the token is its issuer.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::header;
use axum::http::request::Parts;
use axum::response::IntoResponse;

use cgx_protocol::records::{BrokerApiToken, ConsoleLogin, KbsAdminToken};
use cgx_protocol::signed::{self, Kind, SignedError, When};

/// Why an admin request was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum AuthError {
    #[error("no bearer token")]
    NoToken,
    #[error(transparent)]
    Token(#[from] SignedError),
    #[error("admin key {key} may not change {what}")]
    OutOfScope { key: usize, what: String },
    #[error("no admin keys are configured")]
    NoKeys,
}

/// The audience of KBS admin tokens (`cgx kbs token`, the KBS's admin API).
pub const KBS_ADMIN_AUDIENCE: &str = Kind::KbsAdmin.audience();

/// The audience of broker API tokens (tenants, operators, auditors; `cgx broker …`).
pub const BROKER_API_AUDIENCE: &str = Kind::BrokerApi.audience();

/// The bearer tokens a service takes: which record kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BearerKind {
    /// [`KbsAdminToken`].
    #[default]
    KbsAdmin,
    /// [`BrokerApiToken`].
    BrokerApi,
}

impl BearerKind {
    /// A token of this kind by `signer`, issued at `iat`, expiring at `exp` (the one place
    /// that maps a bearer kind to its record: `cgx kbs token`, `cgx broker token`, the dev
    /// network).
    pub fn sign(self, signer: &signed::Signer, iat: i64, exp: i64) -> Result<String, SignedError> {
        match self {
            BearerKind::KbsAdmin => signer.sign(&KbsAdminToken {}, iat, exp),
            BearerKind::BrokerApi => signer.sign(&BrokerApiToken {}, iat, exp),
        }
    }
}

/// Configured admin keys and their scopes.
#[derive(Debug, Clone, Default)]
pub struct AdminKeys {
    /// The kind of record every token must be: this service's.
    kind: BearerKind,
    keys: Vec<[u8; 32]>,
    scopes: Vec<Arc<Vec<String>>>,
    /// Longest accepted token lifetime (`exp − iat`), seconds.
    max_ttl: i64,
    /// Tokens already verified, by the SHA-256 of their exact text: (key index, expiry). A
    /// client presents the same bearer token on every request of its lifetime; its signature
    /// need not be checked each time. Its expiry still is. Keyed by digest, not text, so the
    /// cache's size does not grow with the tokens' (up to 64 KiB each).
    verified: Arc<std::sync::Mutex<Verified>>,
}

/// Verified tokens: SHA-256 of the text → (key index, expiry).
type Verified = std::collections::HashMap<[u8; 32], (usize, i64)>;

/// Verified tokens remembered at most (then forgotten all at once and verified again).
const VERIFIED_CACHE: usize = 4096;

/// Default cap on an admin token's lifetime: an hour (a leaked long-lived admin token is the
/// failure this bounds).
pub const DEFAULT_ADMIN_TOKEN_TTL: i64 = 3600;

impl AdminKeys {
    /// `(Ed25519 public key, repositories)` pairs of the service whose tokens are `kind`;
    /// tokens live at most `max_ttl` seconds.
    pub fn for_kind(kind: BearerKind, keys: Vec<([u8; 32], Vec<String>)>, max_ttl: i64) -> Self {
        let (keys, scopes) = keys
            .into_iter()
            .map(|(key, scope)| (key, Arc::new(scope)))
            .unzip();
        AdminKeys {
            kind,
            keys,
            scopes,
            max_ttl,
            verified: Arc::default(),
        }
    }

    /// The administrator whose key signed `token`, valid at `now` (the extractor's check; a
    /// service's in-process tests authenticate the same way).
    pub fn authenticate(&self, token: &str, now: i64) -> Result<Admin, AuthError> {
        let admin = |index: usize| Admin {
            index,
            repositories: self.scopes.get(index).cloned().unwrap_or_default(),
        };
        let digest = token_digest(token);
        let seen = self
            .verified
            .lock()
            .ok()
            .and_then(|m| m.get(&digest).copied());
        if let Some((index, exp)) = seen {
            if now > exp {
                return Err(AuthError::Token(SignedError::Expired(exp)));
            }
            return Ok(admin(index));
        }
        if self.keys.is_empty() {
            return Err(AuthError::NoKeys);
        }
        let when = When::At {
            now,
            max_lifetime: self.max_ttl,
        };
        let (index, exp) = match self.kind {
            BearerKind::KbsAdmin => signed::verify::<KbsAdminToken>(token, &self.keys, when)
                .map(|v| (v.key_index, v.exp))?,
            BearerKind::BrokerApi => signed::verify::<BrokerApiToken>(token, &self.keys, when)
                .map(|v| (v.key_index, v.exp))?,
        };
        if let Ok(mut m) = self.verified.lock() {
            if m.len() >= VERIFIED_CACHE {
                m.clear();
            }
            m.insert(digest, (index, exp));
        }
        Ok(admin(index))
    }
}

impl AdminKeys {
    /// A console sign-in ([`ConsoleLogin`]) under one of these keys, valid at `now`: the
    /// administrator, the challenge it answers and its expiry. Never cached: each is spent
    /// once by the console.
    pub fn authenticate_login(
        &self,
        token: &str,
        now: i64,
    ) -> Result<(Admin, String, i64), AuthError> {
        if self.keys.is_empty() {
            return Err(AuthError::NoKeys);
        }
        let when = When::At {
            now,
            max_lifetime: self.max_ttl,
        };
        let v = signed::verify::<ConsoleLogin>(token, &self.keys, when)?;
        Ok((self.admin(v.key_index), v.body.challenge, v.exp))
    }

    fn admin(&self, index: usize) -> Admin {
        Admin {
            index,
            repositories: self.scopes.get(index).cloned().unwrap_or_default(),
        }
    }

    /// The first 8 bytes of SHA-256 of key `index`'s public key: what a console session names
    /// beside the index, so that a session outlives neither its key's removal nor its
    /// replacement at the same position.
    pub fn fingerprint(&self, index: usize) -> Option<[u8; 8]> {
        let key = self.keys.get(index)?;
        let d = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, key);
        let mut out = [0u8; 8];
        out.copy_from_slice(&d.as_ref()[..8]);
        Some(out)
    }

    /// The administrator of key `index` if that key's fingerprint is still `fingerprint` (a
    /// console session, whose cookie's MAC the console has checked, names both).
    pub fn admin_at(&self, index: usize, fingerprint: [u8; 8]) -> Option<Admin> {
        (self.fingerprint(index)? == fingerprint).then(|| self.admin(index))
    }
}

/// SHA-256 of a bearer token's text (the verified-token cache's key).
fn token_digest(token: &str) -> [u8; 32] {
    let d = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, token.as_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
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

    /// The position of its key among the configured keys.
    pub fn index(&self) -> usize {
        self.index
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
        use cgx_protocol::signed::Signer;
        let (all_sk, all_pk) = key();
        let (tenant_sk, tenant_pk) = key();
        let (stranger_sk, _) = key();
        let keys = AdminKeys::for_kind(
            BearerKind::KbsAdmin,
            vec![(all_pk, vec!["*".into()]), (tenant_pk, vec!["acme".into()])],
            3600,
        );
        let now = 1_000_000;
        let token = |sk: &[u8], exp: i64| {
            Signer::from_pkcs8(sk)
                .unwrap()
                .sign(&KbsAdminToken {}, now, exp)
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
        assert_eq!(
            keys.authenticate(&token(&stranger_sk, now + 60), now)
                .unwrap_err(),
            AuthError::Token(SignedError::Signature)
        );
        assert!(matches!(
            keys.authenticate(&token(&all_sk, now - 1), now),
            Err(AuthError::Token(SignedError::Expired(_)))
        ));
        assert_eq!(
            AdminKeys::default()
                .authenticate(&token(&all_sk, now + 60), now)
                .unwrap_err(),
            AuthError::NoKeys
        );
        // Past the lifetime cap.
        assert!(matches!(
            keys.authenticate(&token(&all_sk, now + 3601), now),
            Err(AuthError::Token(SignedError::TooLong { .. }))
        ));
        // Another kind of record, signed by an admin key, is not an admin token.
        let heartbeat = Signer::from_pkcs8(&all_sk)
            .unwrap()
            .sign(
                &cgx_protocol::records::Heartbeat {
                    sub: "n".into(),
                    seq: 1,
                },
                now,
                now + 30,
            )
            .unwrap();
        assert_eq!(
            keys.authenticate(&heartbeat, now).unwrap_err(),
            AuthError::Token(SignedError::WrongKind {
                expected: "cgx-kbs-admin+jwt",
                found: "cgx-heartbeat+jwt".into()
            })
        );
        // A remembered token is still refused once it expires.
        let short = token(&tenant_sk, now + 5);
        assert!(keys.authenticate(&short, now).is_ok());
        assert!(keys.authenticate(&short, now + 5).is_ok());
        assert!(matches!(
            keys.authenticate(&short, now + 6),
            Err(AuthError::Token(SignedError::Expired(_)))
        ));
        // One service's token is refused by the other's, under the same key.
        let broker = AdminKeys::for_kind(
            BearerKind::BrokerApi,
            vec![(all_pk, vec!["*".into()])],
            3600,
        );
        let for_kbs = token(&all_sk, now + 60);
        let e = broker.authenticate(&for_kbs, now).unwrap_err();
        assert_eq!(
            e.to_string(),
            "a cgx-kbs-admin+jwt token, not a cgx-broker-api+jwt one"
        );
        let for_broker = Signer::from_pkcs8(&all_sk)
            .unwrap()
            .sign(&BrokerApiToken {}, now, now + 60)
            .unwrap();
        assert!(broker.authenticate(&for_broker, now).is_ok());
        assert!(matches!(
            keys.authenticate(&for_broker, now),
            Err(AuthError::Token(SignedError::WrongKind { .. }))
        ));
        // The right type with another audience, none, a near miss, a huge one: refused, and
        // the refusal stays short.
        use aws_lc_rs::signature::Ed25519KeyPair;
        let b64 = |b: &[u8]| {
            use base64::Engine;
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
        };
        let with = |claims: serde_json::Value| {
            let mut c = serde_json::json!({"iat": now, "exp": now + 60});
            c.as_object_mut()
                .unwrap()
                .extend(claims.as_object().unwrap().clone());
            let m = format!(
                "{}.{}",
                b64(br#"{"alg":"EdDSA","typ":"cgx-kbs-admin+jwt"}"#),
                b64(c.to_string().as_bytes())
            );
            let sig = Ed25519KeyPair::from_pkcs8(&all_sk)
                .unwrap()
                .sign(m.as_bytes());
            format!("{m}.{}", b64(sig.as_ref()))
        };
        assert!(
            keys.authenticate(&with(serde_json::json!({"aud": KBS_ADMIN_AUDIENCE})), now)
                .is_ok()
        );
        for aud in [
            serde_json::json!(BROKER_API_AUDIENCE),
            serde_json::json!("cgx-kbs/admin "),
            serde_json::json!("CGX-KBS/ADMIN"),
            serde_json::json!(""),
            serde_json::json!(cgx_protocol::broker::LEASE_AUDIENCE),
            serde_json::json!("x".repeat(10_000)),
        ] {
            let e = keys
                .authenticate(&with(serde_json::json!({ "aud": aud })), now)
                .unwrap_err();
            assert!(
                matches!(e, AuthError::Token(SignedError::WrongAudience { .. })),
                "{aud}: {e}"
            );
            assert!(e.to_string().len() < 200, "{e}");
        }
        assert!(matches!(
            keys.authenticate(&with(serde_json::json!({})), now),
            Err(AuthError::Token(SignedError::WrongAudience { .. }))
        ));
        // Scopes match whole names, case and all.
        for other in ["acm", "acme2", "ACME", "acme/x", "*"] {
            assert!(tenant.may(Some(other)).is_err(), "{other}");
        }
    }
}
