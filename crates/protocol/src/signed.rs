//! Signed records: one envelope for every record cgx signs with Ed25519 — leases, node
//! records, heartbeats, settings records, KBS admin and broker API tokens (and, as they
//! arrive, proof-of-work answers, metering records, ledger transactions, log checkpoints).
//!
//! The envelope is a compact JWS (RFC 7515) with `alg` `EdDSA` and a `typ` naming the record's
//! kind (`cgx-lease+jwt`, …; RFC 8725 §3.11 explicit typing), and JWT claims (RFC 7519) `aud`,
//! `iat`, `exp` (and an optional `nbf`) around the record's own body. A record is verified *as
//! one kind*: [`verify`] takes the kind it expects (a type) and refuses a token of any other
//! kind, even under the same key — a lease is never read as a heartbeat, an admin token never
//! as an API token — and a token whose audience is not the kind's.
//!
//! EARs are not records of this module: they keep draft-ietf-rats-ear's own shape
//! (`cgx-attestation`'s `results`).
//!
//! Verification is `jsonwebtoken`'s (on aws-lc); signing is ours, with the key pair parsed
//! once ([`Signer`]): `jsonwebtoken::encode` parses the PKCS#8 key on every token, and the
//! broker signs a lease on every placement. Sans-IO and time-explicit: `now` is passed in.

use aws_lc_rs::signature::{Ed25519KeyPair, KeyPair};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};

/// Tolerated clock skew for `iat`/`nbf` ahead of `now`.
pub const SKEW_SECS: i64 = 60;

/// The largest token read (bytes), before any decoding.
pub const MAX_TOKEN_BYTES: usize = 64 * 1024;

/// The kinds of signed record: each a `typ` and the audience its tokens name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// A broker's lease: the KBS releases a job's resources to the VM it names.
    Lease,
    /// A broker's record of a registration it verified (stored, read back by every replica).
    NodeRecord,
    /// A node's liveness signal under its node key.
    Heartbeat,
    /// A broker's record of an admin's setting (reference values), stored and read back.
    Setting,
    /// A KBS administrator's bearer token.
    KbsAdmin,
    /// A broker tenant's, operator's or auditor's bearer token.
    BrokerApi,
    /// A node's report of a lease's workload (started, exited, failed), under its node key.
    WorkloadReport,
    /// A node's metering record of one lease's window, under its node key, chained.
    Metering,
    /// A node's receipt for its proof-of-work answer, under its node key.
    PowReceipt,
    /// A broker API key holder's answer to the console's sign-in challenge.
    ConsoleLogin,
}

impl Kind {
    /// Every kind (tests present each as every other).
    pub const ALL: [Kind; 10] = [
        Kind::Lease,
        Kind::NodeRecord,
        Kind::Heartbeat,
        Kind::Setting,
        Kind::KbsAdmin,
        Kind::BrokerApi,
        Kind::WorkloadReport,
        Kind::Metering,
        Kind::PowReceipt,
        Kind::ConsoleLogin,
    ];

    /// The JWS `typ` header value.
    pub const fn typ(self) -> &'static str {
        match self {
            Kind::Lease => "cgx-lease+jwt",
            Kind::NodeRecord => "cgx-node-record+jwt",
            Kind::Heartbeat => "cgx-heartbeat+jwt",
            Kind::Setting => "cgx-setting+jwt",
            Kind::KbsAdmin => "cgx-kbs-admin+jwt",
            Kind::BrokerApi => "cgx-broker-api+jwt",
            Kind::WorkloadReport => "cgx-workload-report+jwt",
            Kind::Metering => "cgx-metering+jwt",
            Kind::PowReceipt => "cgx-pow-receipt+jwt",
            Kind::ConsoleLogin => "cgx-console-login+jwt",
        }
    }

    /// The `aud` claim tokens of this kind carry.
    pub const fn audience(self) -> &'static str {
        match self {
            Kind::Lease => "cgx-kbs",
            Kind::NodeRecord => "cgx-broker/node",
            Kind::Heartbeat => "cgx-broker/heartbeat",
            Kind::Setting => "cgx-broker/setting",
            Kind::KbsAdmin => "cgx-kbs/admin",
            Kind::BrokerApi => "cgx-broker/api",
            Kind::WorkloadReport => "cgx-broker/report",
            Kind::Metering => "cgx-broker/metering",
            Kind::PowReceipt => "cgx-broker/pow",
            Kind::ConsoleLogin => "cgx-broker/console",
        }
    }

    /// The compact header, base64url (fixed per kind).
    fn header(self) -> String {
        B64.encode(format!(r#"{{"alg":"EdDSA","typ":"{}"}}"#, self.typ()))
    }
}

/// A record's body: the claims besides `aud`, `iat`, `exp` and `nbf`, which the envelope keeps.
pub trait Record: Serialize + DeserializeOwned {
    /// What this record is; verification refuses every other kind.
    const KIND: Kind;
}

/// Why a token was refused (or could not be made). Never carries key material or a whole token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignedError {
    #[error("token of {0} bytes, more than the {MAX_TOKEN_BYTES} read")]
    TooLarge(usize),
    #[error("not a compact JWS ({0})")]
    Malformed(&'static str),
    #[error("algorithm {0} is not EdDSA")]
    Algorithm(String),
    #[error("a {found} token, not a {expected} one")]
    WrongKind {
        expected: &'static str,
        found: String,
    },
    #[error("signature does not verify under any trusted key")]
    Signature,
    #[error("audience {found} is not {expected}")]
    WrongAudience {
        expected: &'static str,
        found: String,
    },
    #[error("claims are not a {kind} record: {reason}")]
    Claims { kind: &'static str, reason: String },
    #[error("expired at {0}")]
    Expired(i64),
    #[error("not valid yet (iat/nbf {0})")]
    NotYetValid(i64),
    #[error("lives {lifetime} s (exp − iat), more than the {max} s allowed")]
    TooLong { lifetime: i64, max: i64 },
    #[error("not an Ed25519 PKCS#8 key")]
    Key,
    #[error("could not encode the record: {0}")]
    Encode(String),
}

/// How a token's times are judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// Valid at `now` (exp not passed; iat and nbf not ahead by more than [`SKEW_SECS`]), living
    /// at most `max_lifetime` seconds (`exp − iat`).
    At { now: i64, max_lifetime: i64 },
    /// Whatever its times: for records read back from storage, whose liveness the reader
    /// decides from other facts (a lease row's end, a node's freshness), and which the broker
    /// needs to know only *whose* they are.
    Any,
}

/// Tokens signed before records were typed (`typ` `JWT`): accepted only where a record is read
/// back from the broker's own storage, and only if their audience is the kind's — which, then,
/// told the kinds apart. Tokens that arrive over the wire must be typed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Untyped {
    Refuse,
    AcceptStored,
}

/// A verified record: its body and the envelope's claims.
#[derive(Debug, Clone, PartialEq)]
pub struct Verified<T> {
    pub body: T,
    pub iat: i64,
    pub exp: i64,
    /// Which of the trusted keys signed it.
    pub key_index: usize,
}

/// `aud` as RFC 7519 §4.1.3 allows it: one string or an array of strings.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Audience(Vec<String>);

impl<'de> Deserialize<'de> for Audience {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Aud {
            One(String),
            Many(Vec<String>),
        }
        Ok(Audience(match Aud::deserialize(d)? {
            Aud::One(a) => vec![a],
            Aud::Many(v) => v,
        }))
    }
}

#[derive(Deserialize)]
struct Envelope<T> {
    aud: Option<Audience>,
    iat: Option<i64>,
    exp: Option<i64>,
    nbf: Option<i64>,
    #[serde(flatten)]
    body: T,
}

#[derive(Serialize)]
struct EnvelopeOut<'a, T> {
    aud: &'static str,
    iat: i64,
    exp: i64,
    #[serde(flatten)]
    body: &'a T,
}

/// An Ed25519 signing key, parsed once.
pub struct Signer {
    pair: Ed25519KeyPair,
    public: [u8; 32],
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("public", &B64.encode(self.public))
            .finish()
    }
}

impl Signer {
    /// From a PKCS#8 Ed25519 private key (DER).
    pub fn from_pkcs8(pkcs8: &[u8]) -> Result<Self, SignedError> {
        let pair = Ed25519KeyPair::from_pkcs8(pkcs8).map_err(|_| SignedError::Key)?;
        let public = pair
            .public_key()
            .as_ref()
            .try_into()
            .map_err(|_| SignedError::Key)?;
        Ok(Signer { pair, public })
    }

    /// The raw public key.
    pub fn public_key(&self) -> [u8; 32] {
        self.public
    }

    /// Sign `body` as a record of its kind, issued at `iat`, expiring at `exp`.
    pub fn sign<T: Record>(&self, body: &T, iat: i64, exp: i64) -> Result<String, SignedError> {
        let claims = serde_json::to_vec(&EnvelopeOut {
            aud: T::KIND.audience(),
            iat,
            exp,
            body,
        })
        .map_err(|e| SignedError::Encode(e.to_string()))?;
        let mut token = T::KIND.header();
        token.push('.');
        B64.encode_string(claims, &mut token);
        let sig = self.pair.sign(token.as_bytes());
        token.push('.');
        B64.encode_string(sig.as_ref(), &mut token);
        Ok(token)
    }
}

/// The `typ` a token's header names (`None`: none, or not a JWS header), read without
/// verifying anything: for messages that say what a refused token was.
pub fn token_typ(token: &str) -> Option<String> {
    if token.len() > MAX_TOKEN_BYTES {
        return None;
    }
    jsonwebtoken::decode_header(token).ok()?.typ
}

/// Make `jsonwebtoken` verify on aws-lc whatever features the build graph unifies: with both
/// its `aws_lc_rs` and `rust_crypto` features on (another crate asking for the second), it
/// picks no provider by itself and panics on the first verification. An installed provider
/// (ours, or one the binary chose first) stands.
fn crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = jsonwebtoken::crypto::CryptoProvider::install_default(
            &jsonwebtoken::crypto::aws_lc::DEFAULT_PROVIDER,
        );
    });
}

/// Verify `token` as a `T` record signed by any of `keys`, its times judged by `when`.
pub fn verify<T: Record>(
    token: &str,
    keys: &[[u8; 32]],
    when: When,
) -> Result<Verified<T>, SignedError> {
    verify_as(token, keys, when, Untyped::Refuse)
}

/// [`verify`], saying whether an untyped token from before typed records is accepted
/// ([`Untyped`]).
pub fn verify_as<T: Record>(
    token: &str,
    keys: &[[u8; 32]],
    when: When,
    untyped: Untyped,
) -> Result<Verified<T>, SignedError> {
    let kind = T::KIND;
    if token.len() > MAX_TOKEN_BYTES {
        return Err(SignedError::TooLarge(token.len()));
    }
    crypto_provider();
    if token.split('.').count() != 3 {
        return Err(SignedError::Malformed("three parts"));
    }
    let header = jsonwebtoken::decode_header(token).map_err(|_| match alg_name(token) {
        // An algorithm the crate has no name for (`none`, say) fails the header's parse.
        Some(alg) if alg != "EdDSA" => SignedError::Algorithm(alg),
        _ => SignedError::Malformed("header"),
    })?;
    if header.alg != Algorithm::EdDSA {
        return Err(SignedError::Algorithm(format!("{:?}", header.alg)));
    }
    let legacy = match header.typ.as_deref() {
        Some(t) if t == kind.typ() => false,
        Some("JWT") if untyped == Untyped::AcceptStored => true,
        found => {
            return Err(SignedError::WrongKind {
                expected: kind.typ(),
                found: shown(found.unwrap_or("untyped")),
            });
        }
    };
    if header.crit.is_some() {
        return Err(SignedError::Malformed("crit header"));
    }
    let mut validation = Validation::new(Algorithm::EdDSA);
    validation.required_spec_claims.clear();
    validation.validate_exp = false;
    validation.validate_nbf = false;
    validation.validate_aud = false;
    let mut outcome = Err(SignedError::Signature);
    for (index, key) in keys.iter().enumerate() {
        match jsonwebtoken::decode::<Envelope<T>>(
            token,
            &DecodingKey::from_ed_der(key),
            &validation,
        ) {
            Ok(data) => {
                outcome = Ok((index, data.claims));
                break;
            }
            Err(e) if matches!(e.kind(), ErrorKind::InvalidSignature) => continue,
            Err(e) => {
                return Err(match e.kind() {
                    ErrorKind::Json(_) => SignedError::Claims {
                        kind: kind.typ(),
                        reason: e.to_string().chars().take(200).collect(),
                    },
                    _ => SignedError::Malformed("payload or signature encoding"),
                });
            }
        }
    }
    let (key_index, env) = outcome?;
    let expected = kind.audience();
    match &env.aud {
        Some(Audience(auds)) if auds.iter().any(|a| a == expected) => {}
        Some(Audience(auds)) => {
            return Err(SignedError::WrongAudience {
                expected,
                found: shown(&auds.join(",")),
            });
        }
        None => {
            return Err(SignedError::WrongAudience {
                expected,
                found: "none".into(),
            });
        }
    }
    // An untyped token told kinds apart by audience alone: it must name this kind's only.
    if legacy && env.aud.as_ref().is_some_and(|a| a.0.len() != 1) {
        return Err(SignedError::WrongKind {
            expected: kind.typ(),
            found: "untyped, several audiences".into(),
        });
    }
    let missing = |claim: &str| SignedError::Claims {
        kind: kind.typ(),
        reason: format!("no integer {claim}"),
    };
    let iat = env.iat.ok_or_else(|| missing("iat"))?;
    let exp = env.exp.ok_or_else(|| missing("exp"))?;
    if let When::At { now, max_lifetime } = when {
        let lifetime = exp.saturating_sub(iat);
        if lifetime > max_lifetime {
            return Err(SignedError::TooLong {
                lifetime,
                max: max_lifetime,
            });
        }
        if now > exp {
            return Err(SignedError::Expired(exp));
        }
        for t in [Some(iat), env.nbf].into_iter().flatten() {
            if t > now.saturating_add(SKEW_SECS) {
                return Err(SignedError::NotYetValid(t));
            }
        }
    }
    Ok(Verified {
        body: env.body,
        iat,
        exp,
        key_index,
    })
}

/// At most 64 characters of a value an attacker chose, for an error message.
fn shown(s: &str) -> String {
    s.chars().take(64).collect()
}

/// The `alg` a header names, for the message that refuses it.
fn alg_name(token: &str) -> Option<String> {
    token
        .split('.')
        .next()
        .and_then(|h| B64.decode(h).ok())
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v.get("alg").and_then(|a| a.as_str()).map(shown))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    struct Probe {
        n: u32,
    }
    impl Record for Probe {
        const KIND: Kind = Kind::Heartbeat;
    }

    fn signer() -> Signer {
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new()).unwrap();
        Signer::from_pkcs8(pkcs8.as_ref()).unwrap()
    }

    #[test]
    fn a_record_verifies_as_its_kind_with_its_times() {
        let s = signer();
        let t = s.sign(&Probe { n: 7 }, 1_000, 1_030).unwrap();
        let at = When::At {
            now: 1_010,
            max_lifetime: 60,
        };
        let v = verify::<Probe>(&t, &[[0; 32], s.public_key()], at).unwrap();
        assert_eq!(
            (v.body, v.iat, v.exp, v.key_index),
            (Probe { n: 7 }, 1_000, 1_030, 1)
        );
        let when = |now, max_lifetime| When::At { now, max_lifetime };
        assert_eq!(
            verify::<Probe>(&t, &[s.public_key()], when(1_031, 60)),
            Err(SignedError::Expired(1_030))
        );
        assert_eq!(
            verify::<Probe>(&t, &[s.public_key()], when(900, 60)),
            Err(SignedError::NotYetValid(1_000))
        );
        assert_eq!(
            verify::<Probe>(&t, &[s.public_key()], when(1_010, 10)),
            Err(SignedError::TooLong {
                lifetime: 30,
                max: 10
            })
        );
        assert!(verify::<Probe>(&t, &[s.public_key()], When::Any).is_ok());
        assert_eq!(
            verify::<Probe>(&t, &[signer().public_key()], When::Any),
            Err(SignedError::Signature)
        );
    }

    #[test]
    fn tokens_we_sign_verify_under_the_crate_and_its_headers_are_typed() {
        let s = signer();
        let t = s.sign(&Probe { n: 1 }, 5, 6).unwrap();
        let h = jsonwebtoken::decode_header(&t).unwrap();
        assert_eq!(h.typ.as_deref(), Some("cgx-heartbeat+jwt"));
        assert_eq!(token_typ(&t).as_deref(), Some("cgx-heartbeat+jwt"));
        let claims: serde_json::Value =
            serde_json::from_slice(&B64.decode(t.split('.').nth(1).unwrap()).unwrap()).unwrap();
        assert_eq!(
            claims,
            serde_json::json!({"aud": "cgx-broker/heartbeat", "iat": 5, "exp": 6, "n": 1})
        );
    }

    #[test]
    fn malformed_tokens_are_refused_with_their_reason() {
        let s = signer();
        let t = s.sign(&Probe { n: 1 }, 5, 6).unwrap();
        let keys = [s.public_key()];
        let v = |t: &str| verify::<Probe>(t, &keys, When::Any);
        assert_eq!(v("a.b"), Err(SignedError::Malformed("three parts")));
        assert_eq!(v("a.b.c.d"), Err(SignedError::Malformed("three parts")));
        assert_eq!(v("!!.b.c"), Err(SignedError::Malformed("header")));
        let big = "a".repeat(MAX_TOKEN_BYTES + 1);
        assert_eq!(v(&big), Err(SignedError::TooLarge(MAX_TOKEN_BYTES + 1)));
        // Another algorithm, though the signature were good.
        let (_, rest) = t.split_once('.').unwrap();
        let hs = format!(
            "{}.{rest}",
            B64.encode(r#"{"alg":"HS256","typ":"cgx-heartbeat+jwt"}"#)
        );
        assert!(matches!(v(&hs), Err(SignedError::Algorithm(a)) if a.contains("HS256")));
        let none = format!("{}.{rest}", B64.encode(r#"{"alg":"none"}"#));
        assert!(
            matches!(v(&none), Err(SignedError::Algorithm(_))),
            "{:?}",
            v(&none)
        );
        // A critical header we do not understand.
        let crit = format!(
            "{}.{rest}",
            B64.encode(r#"{"alg":"EdDSA","typ":"cgx-heartbeat+jwt","crit":["x"],"x":1}"#)
        );
        assert!(matches!(
            v(&crit),
            Err(SignedError::Malformed(_) | SignedError::Signature)
        ));
        // Claims that are not the record's.
        let p = B64.encode(r#"{"aud":"cgx-broker/heartbeat","iat":1,"exp":2,"n":"x"}"#);
        let h = t.split('.').next().unwrap();
        let sig = s.pair.sign(format!("{h}.{p}").as_bytes());
        let bad = format!("{h}.{p}.{}", B64.encode(sig.as_ref()));
        assert!(
            matches!(v(&bad), Err(SignedError::Claims { .. })),
            "{:?}",
            v(&bad)
        );
        // Another token's signature; a signature that is not base64url.
        let other = s.sign(&Probe { n: 2 }, 5, 6).unwrap();
        let (m, _) = t.rsplit_once('.').unwrap();
        let (_, sig) = other.rsplit_once('.').unwrap();
        assert_eq!(v(&format!("{m}.{sig}")), Err(SignedError::Signature));
        assert_eq!(
            v(&format!("{m}.!{}", &sig[1..])),
            Err(SignedError::Malformed("payload or signature encoding"))
        );
    }

    /// Registered claims of the wrong shape, and times out of bounds, each with its reason.
    #[test]
    fn envelope_claims_are_checked() {
        let s = signer();
        let sign = |claims: serde_json::Value| {
            let m = format!(
                "{}.{}",
                Kind::Heartbeat.header(),
                B64.encode(claims.to_string())
            );
            let sig = s.pair.sign(m.as_bytes());
            format!("{m}.{}", B64.encode(sig.as_ref()))
        };
        let at = When::At {
            now: 150,
            max_lifetime: 100,
        };
        let aud = "cgx-broker/heartbeat";
        for (claims, want) in [
            (
                serde_json::json!({"aud": aud, "n": 1, "iat": 100}),
                "no integer exp",
            ),
            (
                serde_json::json!({"aud": aud, "n": 1, "exp": 200}),
                "no integer iat",
            ),
            (
                serde_json::json!({"aud": aud, "n": 1, "iat": 100, "exp": "200"}),
                "invalid type",
            ),
            (
                serde_json::json!({"aud": aud, "n": 1, "iat": "100", "exp": 200}),
                "invalid type",
            ),
            (
                serde_json::json!({"aud": aud, "n": 1, "iat": 100, "exp": 200, "nbf": "x"}),
                "invalid type",
            ),
        ] {
            let r = verify::<Probe>(&sign(claims.clone()), &[s.public_key()], at);
            assert!(
                matches!(&r, Err(SignedError::Claims { reason, .. }) if reason.contains(want)),
                "{claims}: {r:?}"
            );
        }
        let r = |claims| verify::<Probe>(&sign(claims), &[s.public_key()], at);
        assert_eq!(
            r(serde_json::json!({"aud": aud, "n": 1, "iat": 100, "exp": 200, "nbf": 1000})),
            Err(SignedError::NotYetValid(1000))
        );
        assert_eq!(
            r(serde_json::json!({"aud": aud, "n": 1, "iat": i64::MIN, "exp": i64::MAX})),
            Err(SignedError::TooLong {
                lifetime: i64::MAX,
                max: 100
            })
        );
        // Other algorithms, whatever their signature: refused before any key is tried.
        let t = s.sign(&Probe { n: 1 }, 100, 200).unwrap();
        let (_, rest) = t.split_once('.').unwrap();
        for alg in ["none", "HS256", "ES256", "RS256", "Ed25519"] {
            let h = B64.encode(format!(r#"{{"alg":"{alg}","typ":"cgx-heartbeat+jwt"}}"#));
            let forged = format!("{h}.{rest}");
            assert!(
                matches!(verify::<Probe>(&forged, &[s.public_key()], at), Err(SignedError::Algorithm(a)) if a.contains(alg)),
                "{alg}"
            );
        }
    }

    #[test]
    fn untyped_tokens_are_read_only_from_storage_and_only_under_their_audience() {
        let s = signer();
        let forge = |header: &str, claims: serde_json::Value| {
            let m = format!("{}.{}", B64.encode(header), B64.encode(claims.to_string()));
            let sig = s.pair.sign(m.as_bytes());
            format!("{m}.{}", B64.encode(sig.as_ref()))
        };
        let old = forge(
            r#"{"alg":"EdDSA","typ":"JWT"}"#,
            serde_json::json!({"aud": "cgx-broker/heartbeat", "iat": 1, "exp": 2, "n": 3}),
        );
        let keys = [s.public_key()];
        assert_eq!(
            verify::<Probe>(&old, &keys, When::Any),
            Err(SignedError::WrongKind {
                expected: "cgx-heartbeat+jwt",
                found: "JWT".into()
            })
        );
        let v = verify_as::<Probe>(&old, &keys, When::Any, Untyped::AcceptStored).unwrap();
        assert_eq!(v.body, Probe { n: 3 });
        let other = forge(
            r#"{"alg":"EdDSA","typ":"JWT"}"#,
            serde_json::json!({"aud": "cgx-kbs", "iat": 1, "exp": 2, "n": 3}),
        );
        assert!(matches!(
            verify_as::<Probe>(&other, &keys, When::Any, Untyped::AcceptStored),
            Err(SignedError::WrongAudience { .. })
        ));
        let both = forge(
            r#"{"alg":"EdDSA","typ":"JWT"}"#,
            serde_json::json!({"aud": ["cgx-kbs", "cgx-broker/heartbeat"], "iat": 1, "exp": 2, "n": 3}),
        );
        assert!(matches!(
            verify_as::<Probe>(&both, &keys, When::Any, Untyped::AcceptStored),
            Err(SignedError::WrongKind { .. })
        ));
        let untyped = forge(
            r#"{"alg":"EdDSA"}"#,
            serde_json::json!({"aud": "cgx-broker/heartbeat", "iat": 1, "exp": 2, "n": 3}),
        );
        assert!(matches!(
            verify_as::<Probe>(&untyped, &keys, When::Any, Untyped::AcceptStored),
            Err(SignedError::WrongKind { .. })
        ));
    }
}
