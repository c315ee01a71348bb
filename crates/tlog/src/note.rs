//! Checkpoints as C2SP signed notes: the log's Ed25519 signature (key type `0x01`) and
//! witnesses' C2SP tlog-cosignature/v1 cosignatures (key type `0x04`: a big-endian `u64` time
//! and an Ed25519 signature of `"cosignature/v1\ntime <t>\n"` followed by the checkpoint
//! body). The note format is `signed_note`'s; our keys sign and verify through aws-lc-rs (the
//! workspace's one crypto stack) behind its `Signer` and `Verifier` traits.
//!
//! A key is named by a verifier key (`vkey`): `<name>+<8 hex key id>+<base64(type ‖ 32-byte
//! public key)>`, the key id being the first four bytes of `SHA-256(name ‖ "\n" ‖ type ‖ key)`.

use aws_lc_rs::signature::{ED25519, Ed25519KeyPair, KeyPair, UnparsedPublicKey};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use signed_note::{Note, VerifierList};
use tlog_tiles::Checkpoint;

use crate::LogError;

/// A signed note's key types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// A log's Ed25519 key (`0x01`).
    Ed25519,
    /// A witness's tlog-cosignature/v1 key (`0x04`).
    Cosignature,
}

impl KeyKind {
    fn byte(self) -> u8 {
        match self {
            KeyKind::Ed25519 => 0x01,
            KeyKind::Cosignature => 0x04,
        }
    }
}

fn key_id(name: &str, kind: KeyKind, pk: &[u8; 32]) -> u32 {
    let mut k = Vec::with_capacity(33);
    k.push(kind.byte());
    k.extend_from_slice(pk);
    signed_note::key_id(name, &k)
}

fn vkey_of(name: &str, kind: KeyKind, pk: &[u8; 32]) -> String {
    let mut k = Vec::with_capacity(33);
    k.push(kind.byte());
    k.extend_from_slice(pk);
    format!("{name}+{:08x}+{}", key_id(name, kind, pk), B64.encode(k))
}

/// The message a cosignature signs.
fn cosigned_message(time: u64, body: &[u8]) -> Vec<u8> {
    let mut m = format!("cosignature/v1\ntime {time}\n").into_bytes();
    m.extend_from_slice(body);
    m
}

/// A key that signs notes: a log's (Ed25519) or a witness's (cosignature/v1, at a time).
pub struct NoteSigner {
    name: String,
    kind: KeyKind,
    id: u32,
    key: Ed25519KeyPair,
    public: [u8; 32],
    /// Cosignatures: the time they state (Unix seconds).
    time: u64,
}

impl std::fmt::Debug for NoteSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NoteSigner")
            .field("vkey", &self.vkey())
            .finish()
    }
}

impl NoteSigner {
    /// A signer named `name` (for a log: its origin) from an Ed25519 PKCS#8 document.
    pub fn from_pkcs8(name: &str, kind: KeyKind, pkcs8: &[u8]) -> Result<NoteSigner, LogError> {
        if !signed_note::is_key_name_valid(name) {
            return Err(LogError::Key(format!(
                "{name:?} is not a key name (non-empty, no spaces or '+')"
            )));
        }
        let key = Ed25519KeyPair::from_pkcs8(pkcs8)
            .map_err(|_| LogError::Key("not an Ed25519 PKCS#8 key".into()))?;
        let public: [u8; 32] = key
            .public_key()
            .as_ref()
            .try_into()
            .map_err(|_| LogError::Key("an Ed25519 public key is 32 bytes".into()))?;
        Ok(NoteSigner {
            name: name.to_string(),
            kind,
            id: key_id(name, kind, &public),
            key,
            public,
            time: 0,
        })
    }

    /// A cosigner stating `time` (Unix seconds) from now on.
    pub fn at(mut self, time: u64) -> NoteSigner {
        self.time = time;
        self
    }

    /// Its Ed25519 public key.
    pub fn public_key(&self) -> [u8; 32] {
        self.public
    }

    /// Its name (a log's: its origin).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its verifier key, to give to whoever checks its signatures.
    pub fn vkey(&self) -> String {
        vkey_of(&self.name, self.kind, &self.public)
    }

    /// The key that verifies it.
    pub fn verifier(&self) -> NoteKey {
        NoteKey {
            name: self.name.clone(),
            kind: self.kind,
            id: self.id,
            public: self.public,
        }
    }
}

impl signed_note::Signer for NoteSigner {
    fn name(&self) -> &str {
        &self.name
    }

    fn key_id(&self) -> u32 {
        self.id
    }

    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, signature::Error> {
        Ok(match self.kind {
            KeyKind::Ed25519 => self.key.sign(msg).as_ref().to_vec(),
            KeyKind::Cosignature => self.cosignature_at(self.time, msg),
        })
    }
}

impl NoteSigner {
    /// A tlog-cosignature/v1 signature of a checkpoint `body` stating `time`: the time
    /// (big-endian) then the Ed25519 signature.
    pub fn cosignature_at(&self, time: u64, body: &[u8]) -> Vec<u8> {
        let mut out = time.to_be_bytes().to_vec();
        out.extend_from_slice(self.key.sign(&cosigned_message(time, body)).as_ref());
        out
    }

    /// Its key id (the note signature's first four bytes).
    pub fn id(&self) -> u32 {
        self.id
    }
}

/// A key that verifies notes, parsed from its `vkey`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoteKey {
    name: String,
    kind: KeyKind,
    id: u32,
    public: [u8; 32],
}

impl NoteKey {
    /// The key `name` verifies with: `public`, an Ed25519 public key, of kind `kind`.
    pub fn new(name: &str, kind: KeyKind, public: [u8; 32]) -> NoteKey {
        NoteKey {
            name: name.to_string(),
            kind,
            id: key_id(name, kind, &public),
            public,
        }
    }

    /// Parse a verifier key: refused unless its id is its name's and key's.
    pub fn parse(vkey: &str) -> Result<NoteKey, LogError> {
        let bad = |why: &str| LogError::Key(format!("verifier key: {why}"));
        let mut parts = vkey.splitn(3, '+');
        let (Some(name), Some(id), Some(key)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad("not <name>+<id>+<key>"));
        };
        if !signed_note::is_key_name_valid(name) {
            return Err(bad("not a key name"));
        }
        if id.len() != 8 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad("the key id is not 8 hex digits"));
        }
        let id = u32::from_str_radix(id, 16).map_err(|_| bad("the key id is not hex"))?;
        let key = B64.decode(key).map_err(|_| bad("the key is not base64"))?;
        let (kind, public) = match key.split_first() {
            Some((0x01, pk)) => (KeyKind::Ed25519, pk),
            Some((0x04, pk)) => (KeyKind::Cosignature, pk),
            _ => return Err(bad("not an Ed25519 (0x01) or cosignature/v1 (0x04) key")),
        };
        let public: [u8; 32] = public
            .try_into()
            .map_err(|_| bad("an Ed25519 public key is 32 bytes"))?;
        if key_id(name, kind, &public) != id {
            return Err(bad("the key id is not this name's and key's"));
        }
        Ok(NoteKey {
            name: name.to_string(),
            kind,
            id,
            public,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn kind(&self) -> KeyKind {
        self.kind
    }

    pub fn vkey(&self) -> String {
        vkey_of(&self.name, self.kind, &self.public)
    }
}

impl signed_note::Verifier for NoteKey {
    fn name(&self) -> &str {
        &self.name
    }

    fn key_id(&self) -> u32 {
        self.id
    }

    fn verify(&self, msg: &[u8], sig: &[u8]) -> bool {
        let pk = UnparsedPublicKey::new(&ED25519, self.public);
        match self.kind {
            KeyKind::Ed25519 => pk.verify(msg, sig).is_ok(),
            KeyKind::Cosignature => {
                let Some((time, sig)) = sig.split_first_chunk::<8>() else {
                    return false;
                };
                sig.len() == 64
                    && pk
                        .verify(&cosigned_message(u64::from_be_bytes(*time), msg), sig)
                        .is_ok()
            }
        }
    }
}

/// A checkpoint signed by the log, as a note's bytes.
pub fn sign_checkpoint(cp: &Checkpoint, log: &NoteSigner) -> Result<Vec<u8>, LogError> {
    if cp.origin() != log.name {
        return Err(LogError::Checkpoint(format!(
            "origin {:?} is not the log key's name {:?}",
            cp.origin(),
            log.name
        )));
    }
    let mut note = Note::new(&cp.to_bytes(), &[]).map_err(|e| LogError::Note(e.to_string()))?;
    note.add_sigs(&[log])
        .map_err(|e| LogError::Note(e.to_string()))?;
    Ok(note.to_bytes())
}

/// Add `cosigners`' cosignatures to a signed checkpoint.
pub fn cosign(signed: &[u8], cosigners: &[&NoteSigner]) -> Result<Vec<u8>, LogError> {
    let mut note = Note::from_bytes(signed).map_err(|e| LogError::Note(e.to_string()))?;
    let signers: Vec<&dyn signed_note::Signer> = cosigners
        .iter()
        .map(|c| *c as &dyn signed_note::Signer)
        .collect();
    note.add_sigs(&signers)
        .map_err(|e| LogError::Note(e.to_string()))?;
    Ok(note.to_bytes())
}

/// A checkpoint whose signatures held.
#[derive(Debug)]
pub struct Opened {
    pub checkpoint: Checkpoint,
    /// The note's text: the checkpoint body, as signed.
    pub body: Vec<u8>,
    /// The witnesses whose cosignature verified: (name, the time it states).
    pub cosigned: Vec<(String, u64)>,
}

/// Open a signed checkpoint: the log's signature must verify (with `log`, whose name must be
/// the checkpoint's origin) and at least `quorum` of `witnesses` must have cosigned it;
/// signatures by keys not named are ignored, a named key's bad signature refuses the note.
pub fn open_checkpoint(
    note: &[u8],
    log: &NoteKey,
    witnesses: &[NoteKey],
    quorum: usize,
) -> Result<Opened, LogError> {
    if log.kind != KeyKind::Ed25519 {
        return Err(LogError::Key("a log's key is an Ed25519 (0x01) key".into()));
    }
    let n = Note::from_bytes(note).map_err(|e| LogError::Note(e.to_string()))?;
    let mut keys: Vec<Box<dyn signed_note::Verifier>> = vec![Box::new(log.clone())];
    for w in witnesses {
        if w.kind != KeyKind::Cosignature {
            return Err(LogError::Key(format!(
                "witness {} is not a cosignature/v1 (0x04) key",
                w.name
            )));
        }
        keys.push(Box::new(w.clone()));
    }
    let (verified, _) = n
        .verify(&VerifierList::new(keys))
        .map_err(|e| LogError::Note(e.to_string()))?;
    if !verified
        .iter()
        .any(|s| s.name() == log.name && s.id() == log.id)
    {
        return Err(LogError::Note(format!(
            "not signed by the log's key {}",
            log.name
        )));
    }
    let cosigned: Vec<(String, u64)> = verified
        .iter()
        .filter(|s| {
            witnesses
                .iter()
                .any(|w| w.name == s.name() && w.id == s.id())
        })
        .filter_map(|s| {
            let t = s.signature().first_chunk::<8>()?;
            Some((s.name().to_string(), u64::from_be_bytes(*t)))
        })
        .collect();
    if cosigned.len() < quorum {
        return Err(LogError::Note(format!(
            "cosigned by {} of the {} witnesses named, the quorum is {quorum}",
            cosigned.len(),
            witnesses.len()
        )));
    }
    let body = n.text().to_vec();
    let checkpoint =
        Checkpoint::from_bytes(&body).map_err(|e| LogError::Checkpoint(e.to_string()))?;
    if checkpoint.origin() != log.name {
        return Err(LogError::Checkpoint(format!(
            "origin {:?} is not the log key's name {:?}",
            checkpoint.origin(),
            log.name
        )));
    }
    Ok(Opened {
        checkpoint,
        body,
        cosigned,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use signed_note::{Signer as _, Verifier as _};

    pub(crate) fn key() -> Vec<u8> {
        Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .unwrap()
            .as_ref()
            .to_vec()
    }

    fn checkpoint(origin: &str, size: u64) -> Checkpoint {
        Checkpoint::new(origin, size, crate::record_hash(b"root"), "").unwrap()
    }

    /// Go's `sumdb/note` known answer (note_test.go): PeterNeumann's key verifies its note
    /// through our verifier, and a byte changed anywhere refuses it.
    #[test]
    fn go_sumdb_notes_known_answer() {
        let vkey = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW";
        let msg = b"If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n\n\xe2\x80\x94 PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n";
        let k = NoteKey::parse(vkey).unwrap();
        let n = Note::from_bytes(msg).unwrap();
        let (ok, _) = n
            .verify(&VerifierList::new(vec![Box::new(k.clone())]))
            .unwrap();
        assert_eq!(ok.len(), 1);
        let mut bad = msg.to_vec();
        bad[3] ^= 1;
        let n = Note::from_bytes(&bad).unwrap();
        assert!(n.verify(&VerifierList::new(vec![Box::new(k)])).is_err());
    }

    /// Our keys against signed_note's own (ed25519-dalek): the same vkey and key id, and each
    /// verifies the other's signatures.
    #[test]
    fn our_keys_and_signed_notes_agree() {
        let s = NoteSigner::from_pkcs8("log.example/a", KeyKind::Ed25519, &key()).unwrap();
        let theirs = signed_note::StandardVerifier::new(&s.vkey()).unwrap();
        assert_eq!(theirs.key_id(), s.key_id());
        let sig = s.sign(b"text\n").unwrap();
        assert!(theirs.verify(b"text\n", &sig));
        assert!(!theirs.verify(b"text!\n", &sig));
        assert_eq!(NoteKey::parse(&s.vkey()).unwrap(), s.verifier());
        // signed_note's own signer, from a seed: its signature verifies with our key.
        let seed = [7u8; 32];
        let pair = Ed25519KeyPair::from_seed_unchecked(&seed).unwrap();
        let public: [u8; 32] = pair.public_key().as_ref().try_into().unwrap();
        let ours = NoteKey::new("other", KeyKind::Ed25519, public);
        let mut k = vec![1u8];
        k.extend_from_slice(&seed);
        let skey = format!("PRIVATE+KEY+other+{:08x}+{}", ours.id, B64.encode(k));
        let their_signer = signed_note::StandardSigner::new(&skey).unwrap();
        assert_eq!(their_signer.key_id(), ours.id);
        assert!(ours.verify(b"m", &their_signer.sign(b"m").unwrap()));
        assert!(!ours.verify(b"n", &their_signer.sign(b"m").unwrap()));
        for bad in [
            "",
            "a+b",
            "log+0000000+AQ==",
            "log+zzzzzzzz+AQ==",
            "log+00000000+AQ==",
            &s.vkey().replace("log.example/a", "log.example/b"),
        ] {
            assert!(NoteKey::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn checkpoints_open_only_with_the_logs_key_and_the_quorum() {
        let log = NoteSigner::from_pkcs8("log.example/a", KeyKind::Ed25519, &key()).unwrap();
        let w1 = NoteSigner::from_pkcs8("w1.example", KeyKind::Cosignature, &key())
            .unwrap()
            .at(1_700_000_000);
        let w2 = NoteSigner::from_pkcs8("w2.example", KeyKind::Cosignature, &key())
            .unwrap()
            .at(1_700_000_001);
        let cp = checkpoint("log.example/a", 5);
        let signed = sign_checkpoint(&cp, &log).unwrap();
        let witnesses = [w1.verifier(), w2.verifier()];
        let o = open_checkpoint(&signed, &log.verifier(), &witnesses, 0).unwrap();
        assert_eq!(o.checkpoint.size(), 5);
        assert_eq!(o.body, cp.to_bytes());
        assert!(
            open_checkpoint(&signed, &log.verifier(), &witnesses, 1)
                .unwrap_err()
                .to_string()
                .contains("cosigned by 0 of the 2")
        );
        let both = cosign(&signed, &[&w1, &w2]).unwrap();
        let o = open_checkpoint(&both, &log.verifier(), &witnesses, 2).unwrap();
        assert_eq!(
            o.cosigned,
            vec![
                ("w1.example".to_string(), 1_700_000_000),
                ("w2.example".to_string(), 1_700_000_001)
            ]
        );
        // Another log's key; the log's key as a witness; a checkpoint of another origin.
        let other = NoteSigner::from_pkcs8("log.example/a", KeyKind::Ed25519, &key()).unwrap();
        assert!(open_checkpoint(&both, &other.verifier(), &witnesses, 0).is_err());
        assert!(open_checkpoint(&both, &log.verifier(), &[log.verifier()], 0).is_err());
        assert!(sign_checkpoint(&checkpoint("elsewhere", 5), &log).is_err());
        // A cosignature whose stated time was changed, or whose body was, does not verify.
        let mut t = both.clone();
        let line = t.len() - 1 - t.iter().rev().skip(1).position(|&b| b == b'\n').unwrap();
        let sig_b64 = String::from_utf8(t[line..].to_vec()).unwrap();
        let sig = sig_b64.trim().rsplit(' ').next().unwrap();
        let mut raw = B64.decode(sig).unwrap();
        raw[4 + 7] ^= 1;
        let forged = B64.encode(raw);
        t = String::from_utf8(both.clone())
            .unwrap()
            .replace(sig, &forged)
            .into_bytes();
        assert!(open_checkpoint(&t, &log.verifier(), &witnesses, 1).is_err());
        let edited = String::from_utf8(both)
            .unwrap()
            .replacen("\n5\n", "\n6\n", 1);
        assert!(open_checkpoint(edited.as_bytes(), &log.verifier(), &witnesses, 0).is_err());
    }
}
