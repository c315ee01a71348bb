//! Session ids that carry their own challenge.
//!
//! `auth` writes nothing: the session id is `<expiry>.<random>.<tee>.<mac>`, and the challenge
//! nonce is a MAC of the id. With `database` sessions the MAC key is derived from the shared
//! key-encryption key, so every replica verifies every id, and `attest` records the answer
//! with one INSERT keyed by the id: a second answer to the same challenge finds the row and is
//! refused, on any replica. With `memory` sessions the key is drawn at start
//! ([`SessionKeys::ephemeral`]) and the answer is recorded in this process
//! ([`super::sessions`]). Either way a challenge is answered once, and failed attestations
//! are recorded too (in memory, while their own cap has room: a new challenge costs nothing,
//! so answering a failed one again gains nothing).
//!
//! The expiry comes first, zero-padded, so ids sort by issue time: the session rows' primary
//! key then grows at its right edge like a log: a checkpoint copies a few index pages back
//! rather than one random page per session (7.3 → 2.4 KB per flow in a model of the pattern).

use aws_lc_rs::hmac;
use base64::Engine;
use base64::engine::general_purpose::STANDARD;

/// Challenge expiries are below this (12 digits), so every id's leading part has one length.
const MAX_EXPIRY: i64 = 1_000_000_000_000;

/// The leading part of the ids of challenges expiring at `t` (Unix seconds, at least 0):
/// zero-padded, so ids compare in byte order as their expiry times do, and an id is less than
/// `id_time_prefix(t)` exactly when its challenge expired before `t`.
pub fn id_time_prefix(t: i64) -> String {
    format!("{:012}", t.max(0))
}

/// Session-id MAC and nonce derivation keys.
pub struct SessionKeys {
    mac: hmac::Key,
}

impl std::fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SessionKeys(…)")
    }
}

/// A challenge whose id verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    pub id: String,
    pub tee: String,
    pub expires_at: i64,
    pub nonce: String,
}

impl SessionKeys {
    /// Keys derived from the key-encryption key, so replicas agree without storing another
    /// secret.
    pub fn derive(kek: &[u8; 32]) -> Self {
        SessionKeys {
            mac: super::keys::mac_key(kek, b"session-mac/v1"),
        }
    }

    fn tag(&self, what: &[u8], body: &str) -> Vec<u8> {
        let mut ctx = hmac::Context::with_key(&self.mac);
        ctx.update(what);
        ctx.update(body.as_bytes());
        ctx.sign().as_ref().to_vec()
    }

    /// Keys drawn at random, for `memory` sessions (`sessions.rs`): only this process, in this
    /// run, issues ids that verify, so only it answers their challenges.
    pub fn ephemeral() -> Option<Self> {
        let mut k = [0u8; 32];
        aws_lc_rs::rand::fill(&mut k).ok()?;
        Some(SessionKeys::derive(&k))
    }

    /// A new challenge for `tee`, valid until `expires_at`.
    pub fn issue(&self, tee: &str, expires_at: i64) -> Option<Challenge> {
        if !(0..MAX_EXPIRY).contains(&expires_at) {
            return None;
        }
        let mut r = [0u8; 16];
        aws_lc_rs::rand::fill(&mut r).ok()?;
        let body = format!("{}.{}.{tee}", id_time_prefix(expires_at), hex::encode(r));
        let id = format!("{body}.{}", hex::encode(&self.tag(b"id\0", &body)[..16]));
        let nonce = STANDARD.encode(self.tag(b"nonce\0", &id));
        Some(Challenge {
            id,
            tee: tee.to_string(),
            expires_at,
            nonce,
        })
    }

    /// The challenge behind `id`, if the id is ours and unexpired at `now`.
    /// The MAC'd body of `id` if this KBS issued it (whatever its expiry): checked wherever a
    /// session id is used, so a row someone wrote into the database under an id of their own
    /// choosing is never looked up.
    pub fn authentic<'a>(&self, id: &'a str) -> Result<&'a str, &'static str> {
        let (body, mac) = id.rsplit_once('.').ok_or("malformed session id")?;
        let mac = hex::decode(mac).map_err(|_| "malformed session id")?;
        let expect = self.tag(b"id\0", body);
        if mac.len() != 16
            || aws_lc_rs::constant_time::verify_slices_are_equal(&mac, &expect[..16]).is_err()
        {
            return Err("session id was not issued by this KBS");
        }
        Ok(body)
    }

    pub fn open(&self, id: &str, now: i64) -> Result<Challenge, &'static str> {
        let body = self.authentic(id)?;
        let mut parts = body.split('.');
        let (Some(exp), Some(_), Some(tee), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err("malformed session id");
        };
        let expires_at: i64 = exp
            .parse()
            .ok()
            .filter(|e| exp.len() == 12 && (0..MAX_EXPIRY).contains(e))
            .ok_or("malformed session id")?;
        if now >= expires_at {
            return Err("the challenge has expired; start again with /auth");
        }
        Ok(Challenge {
            id: id.to_string(),
            tee: tee.to_string(),
            expires_at,
            nonce: STANDARD.encode(self.tag(b"nonce\0", id)),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn issue_open_expire_forge() {
        let k = SessionKeys::derive(&[1; 32]);
        let c = k.issue("snp", 100).unwrap();
        assert_eq!(k.open(&c.id, 50).unwrap(), c);
        assert!(k.open(&c.id, 100).is_err());
        let other = SessionKeys::derive(&[2; 32]);
        assert!(other.open(&c.id, 50).is_err());
        // Extending the expiry breaks the MAC.
        assert!(c.id.starts_with("000000000100."));
        let forged = c.id.replacen("000000000100.", "000000000999.", 1);
        assert!(k.open(&forged, 50).is_err());
        assert!(k.open("x", 50).is_err());
        assert_ne!(k.issue("snp", 100).unwrap().nonce, c.nonce);
        // Expiries that would not lead an id with 12 digits (ids must sort by time).
        assert!(k.issue("snp", MAX_EXPIRY).is_none());
        assert!(k.issue("snp", -1).is_none());
        let body = "1000000000000.00.snp";
        let long = format!("{body}.{}", hex::encode(&k.tag(b"id\0", body)[..16]));
        assert_eq!(k.open(&long, 50).unwrap_err(), "malformed session id");
    }

    #[test]
    fn ephemeral_keys_verify_only_their_own_ids() {
        let a = SessionKeys::ephemeral().unwrap();
        let b = SessionKeys::ephemeral().unwrap();
        let c = a.issue("snp", 100).unwrap();
        assert_eq!(a.open(&c.id, 50).unwrap(), c);
        assert_eq!(
            b.open(&c.id, 50).unwrap_err(),
            "session id was not issued by this KBS"
        );
        assert!(SessionKeys::derive(&[1; 32]).open(&c.id, 50).is_err());
    }
}
