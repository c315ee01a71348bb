//! The KBS resource that releases a tenant's model weights: an age identity file that also
//! names the one encrypted weights file it may open.
//!
//! ```text
//! # cgx-weights-sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//! AGE-SECRET-KEY-1…
//! ```
//!
//! age authenticates nothing about who encrypted a file: anyone who knows the recipient (it is
//! public) can make a file that the identity opens. So the resource binds the SHA-256 of the
//! *encrypted* age file, and the guest agent hashes exactly the bytes it decrypts and refuses
//! a file whose digest differs before DEST appears. The encrypted file, not the plaintext:
//! its digest is checked on the bytes as they are read (no second pass over secrets), it can
//! be computed by anyone holding the file (`sha256sum F.age`, a stock `age -r` user included)
//! and it says nothing about the plaintext. age files are randomized, so the digest names one
//! encryption: an attacker's re-encryption to the same recipient has another.
//!
//! The digest rides on an age comment line, so the resource stays a valid age identity file:
//! `age -d -i` and CoCo clients read it as before. A resource without the line (an identity
//! stored by hand or by an older `cgx weights keygen`) is refused by [`WeightsKey::parse`] with
//! [`WeightsKeyError::Unbound`]: it binds no file, so it is never used to open one.

/// The comment label that carries the digest (lowercase hex, 64 digits).
pub const DIGEST_LABEL: &str = "# cgx-weights-sha256:";

/// A resource is an identity line, a digest line and a few comments: anything longer is not one.
pub const MAX_RESOURCE_LEN: usize = 4096;

/// Why a resource is not a weights key.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum WeightsKeyError {
    #[error("weights key resource is {0} bytes (at most {MAX_RESOURCE_LEN})")]
    TooLong(usize),
    #[error("weights key resource is not UTF-8 text")]
    NotText,
    #[error(
        "weights key resource binds no weights file (no '{DIGEST_LABEL}' line): an identity stored \
         without its file's digest opens any file encrypted to it; store it with \
         `cgx weights encrypt --kbs …` or `cgx weights bind`"
    )]
    Unbound,
    #[error("weights key resource has more than one '{DIGEST_LABEL}' line")]
    DuplicateDigest,
    #[error("weights key resource's digest is not 64 hex digits")]
    BadDigest,
    #[error("weights key resource has no AGE-SECRET-KEY-1 line")]
    NoIdentity,
    #[error("weights key resource has more than one identity line")]
    DuplicateIdentity,
    #[error("weights key resource has a line that is neither a comment nor an AGE-SECRET-KEY-1")]
    Unexpected,
}

/// An age identity and the SHA-256 of the one encrypted file it is released to open.
#[derive(Clone, PartialEq, Eq)]
pub struct WeightsKey {
    identity: String,
    sha256: [u8; 32],
}

impl std::fmt::Debug for WeightsKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The identity is the secret: never printed.
        f.debug_struct("WeightsKey")
            .field("sha256", &hex::encode(self.sha256))
            .finish_non_exhaustive()
    }
}

impl WeightsKey {
    /// `identity`: an `AGE-SECRET-KEY-1…` line; `sha256`: the digest of the age file.
    pub fn new(identity: &str, sha256: [u8; 32]) -> Result<Self, WeightsKeyError> {
        let identity = identity.trim();
        if !identity.starts_with("AGE-SECRET-KEY-1") {
            return Err(WeightsKeyError::NoIdentity);
        }
        if identity.contains(['\n', '\r']) {
            return Err(WeightsKeyError::DuplicateIdentity);
        }
        Ok(WeightsKey {
            identity: identity.to_string(),
            sha256,
        })
    }

    /// Read a resource strictly: one identity line, one digest line, comments and blank lines.
    pub fn parse(resource: &[u8]) -> Result<Self, WeightsKeyError> {
        if resource.len() > MAX_RESOURCE_LEN {
            return Err(WeightsKeyError::TooLong(resource.len()));
        }
        let text = std::str::from_utf8(resource).map_err(|_| WeightsKeyError::NotText)?;
        let mut identity = None;
        let mut sha256 = None;
        for line in text.lines().map(str::trim) {
            if let Some(hex_digest) = line.strip_prefix(DIGEST_LABEL) {
                if sha256.is_some() {
                    return Err(WeightsKeyError::DuplicateDigest);
                }
                let hex_digest = hex_digest.trim();
                let mut d = [0u8; 32];
                if hex_digest.len() != 64 {
                    return Err(WeightsKeyError::BadDigest);
                }
                hex::decode_to_slice(hex_digest, &mut d).map_err(|_| WeightsKeyError::BadDigest)?;
                sha256 = Some(d);
            } else if line.is_empty() || line.starts_with('#') {
                continue;
            } else if line.starts_with("AGE-SECRET-KEY-1") {
                if identity.is_some() {
                    return Err(WeightsKeyError::DuplicateIdentity);
                }
                identity = Some(line);
            } else {
                return Err(WeightsKeyError::Unexpected);
            }
        }
        let identity = identity.ok_or(WeightsKeyError::NoIdentity)?;
        let sha256 = sha256.ok_or(WeightsKeyError::Unbound)?;
        Self::new(identity, sha256)
    }

    /// The resource's bytes: an age identity file (`age -d -i` reads it).
    pub fn to_resource(&self) -> String {
        format!(
            "{DIGEST_LABEL} {}\n{}\n",
            hex::encode(self.sha256),
            self.identity
        )
    }

    /// The `AGE-SECRET-KEY-1…` line. Secret: callers must not log it.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// The SHA-256 of the age file this key may open.
    pub fn sha256(&self) -> &[u8; 32] {
        &self.sha256
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const ID: &str = "AGE-SECRET-KEY-1QQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQQ";

    #[test]
    fn round_trip_and_age_comments() {
        let k = WeightsKey::new(ID, [7; 32]).unwrap();
        let text = k.to_resource();
        assert!(text.starts_with("# cgx-weights-sha256: 0707"), "{text}");
        assert_eq!(WeightsKey::parse(text.as_bytes()).unwrap(), k);
        // Other comments (age-keygen writes some) and CRLF are fine; order is free.
        let with = format!(
            "# created: 2025-01-01\r\n# public key: age1…\r\n{ID}\r\n\r\n{DIGEST_LABEL} {}\r\n",
            "07".repeat(32)
        );
        assert_eq!(WeightsKey::parse(with.as_bytes()).unwrap(), k);
        // Debug never shows the identity.
        assert!(!format!("{k:?}").contains("AGE-SECRET"));
    }

    #[test]
    fn refusals() {
        let d = format!("{DIGEST_LABEL} {}", "07".repeat(32));
        let cases: Vec<(String, WeightsKeyError)> = vec![
            (format!("{ID}\n"), WeightsKeyError::Unbound),
            (format!("{d}\n"), WeightsKeyError::NoIdentity),
            (
                format!("{d}\n{d}\n{ID}\n"),
                WeightsKeyError::DuplicateDigest,
            ),
            (
                format!("{d}\n{ID}\n{ID}\n"),
                WeightsKeyError::DuplicateIdentity,
            ),
            (format!("{d}\n{ID}\nhello\n"), WeightsKeyError::Unexpected),
            (
                format!("{DIGEST_LABEL} {}\n{ID}\n", "07".repeat(31)),
                WeightsKeyError::BadDigest,
            ),
            (
                format!("{DIGEST_LABEL} {}zz\n{ID}\n", "07".repeat(31)),
                WeightsKeyError::BadDigest,
            ),
            (
                "#".repeat(MAX_RESOURCE_LEN + 1),
                WeightsKeyError::TooLong(MAX_RESOURCE_LEN + 1),
            ),
        ];
        for (text, want) in cases {
            assert_eq!(
                WeightsKey::parse(text.as_bytes()).unwrap_err(),
                want,
                "{text}"
            );
        }
        assert_eq!(
            WeightsKey::parse(&[0xff, 0xfe]).unwrap_err(),
            WeightsKeyError::NotText
        );
        assert_eq!(
            WeightsKey::new("age1abc", [0; 32]).unwrap_err(),
            WeightsKeyError::NoIdentity
        );
        assert!(
            WeightsKeyError::Unbound
                .to_string()
                .contains("binds no weights file")
        );
    }
}
