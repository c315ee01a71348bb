//! The age file format (age-encryption.org/v1) with X25519 recipients, for model weights:
//! header, X25519 stanzas, header MAC, and the STREAM payload (64 KiB ChaCha20-Poly1305 chunks,
//! nonce = 88-bit big-endian counter ‖ last-chunk flag). Files we write open with the stock
//! `age -d -i`, and files `age -r` writes open here.
//!
//! Chunks are independent given their index, so both directions work on batches of chunks in
//! parallel (one thread per core) while reading and writing strictly in order: plaintext is only
//! ever written to the caller's writer.

use std::io::{Read, Write};

use aws_lc_rs::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
use aws_lc_rs::agreement::{self, PrivateKey, UnparsedPublicKey, X25519};
use aws_lc_rs::{hkdf, hmac};
use base64::Engine;
use base64::engine::general_purpose::STANDARD_NO_PAD as B64;

/// Plaintext bytes per STREAM chunk.
pub const CHUNK: usize = 64 * 1024;
const TAG: usize = 16;
const CT_CHUNK: usize = CHUNK + TAG;
const INTRO: &str = "age-encryption.org/v1";
const X25519_INFO: &[u8] = b"age-encryption.org/v1/X25519";

/// Why an age operation failed. Never carries key material or plaintext.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgeError {
    #[error("invalid age identity or recipient: {0}")]
    Key(String),
    #[error("malformed age header: {0}")]
    Header(String),
    #[error("no identity matches a recipient of this file")]
    NoMatch,
    #[error("header MAC does not verify (tampered header or wrong file key)")]
    HeaderMac,
    #[error("payload chunk {0} does not decrypt (tampered or truncated)")]
    Chunk(u64),
    #[error("payload is truncated or has trailing data")]
    Length,
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("cryptographic failure: {0}")]
    Crypto(&'static str),
}

type Result<T> = std::result::Result<T, AgeError>;

// ------------------------------------------------------------------ Bech32 (BIP 173)

const CHARSET: &[u8; 32] = b"qpzry9x8gf2tvdw0s3jn54khce6mua7l";

fn polymod(values: &[u8]) -> u32 {
    const GEN: [u32; 5] = [
        0x3b6a_57b2,
        0x2650_8e6d,
        0x1ea1_19fa,
        0x3d42_33dd,
        0x2a14_62b3,
    ];
    let mut chk = 1u32;
    for &v in values {
        let b = chk >> 25;
        chk = ((chk & 0x1ff_ffff) << 5) ^ u32::from(v);
        for (i, g) in GEN.iter().enumerate() {
            if (b >> i) & 1 == 1 {
                chk ^= g;
            }
        }
    }
    chk
}

fn hrp_expand(hrp: &str) -> Vec<u8> {
    let mut v: Vec<u8> = hrp.bytes().map(|b| b >> 5).collect();
    v.push(0);
    v.extend(hrp.bytes().map(|b| b & 31));
    v
}

fn to_5bit(data: &[u8]) -> Vec<u8> {
    let (mut acc, mut bits, mut out) = (0u32, 0u32, Vec::new());
    for &b in data {
        acc = (acc << 8) | u32::from(b);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(((acc >> bits) & 31) as u8);
        }
    }
    if bits > 0 {
        out.push(((acc << (5 - bits)) & 31) as u8);
    }
    out
}

fn from_5bit(data: &[u8]) -> Option<Vec<u8>> {
    let (mut acc, mut bits, mut out) = (0u32, 0u32, Vec::new());
    for &v in data {
        acc = (acc << 5) | u32::from(v);
        bits += 5;
        if bits >= 8 {
            bits -= 8;
            out.push(((acc >> bits) & 0xff) as u8);
        }
    }
    (bits < 5 && (acc & ((1 << bits) - 1)) == 0).then_some(out)
}

fn bech32_encode(hrp: &str, data: &[u8]) -> String {
    let d = to_5bit(data);
    let mut values = hrp_expand(hrp);
    values.extend(&d);
    values.extend([0u8; 6]);
    let m = polymod(&values) ^ 1;
    let mut s = format!("{hrp}1");
    for v in d {
        s.push(char::from(CHARSET[usize::from(v)]));
    }
    for i in 0..6 {
        s.push(char::from(CHARSET[((m >> (5 * (5 - i))) & 31) as usize]));
    }
    s
}

fn bech32_decode(s: &str) -> Option<(String, Vec<u8>)> {
    if s.bytes().any(|b| b.is_ascii_uppercase()) && s.bytes().any(|b| b.is_ascii_lowercase()) {
        return None;
    }
    let s = s.to_ascii_lowercase();
    let pos = s.rfind('1')?;
    let (hrp, rest) = (&s[..pos], &s[pos + 1..]);
    if hrp.is_empty() || rest.len() < 6 {
        return None;
    }
    let values: Vec<u8> = rest
        .bytes()
        .map(|c| CHARSET.iter().position(|&x| x == c).map(|p| p as u8))
        .collect::<Option<_>>()?;
    let mut all = hrp_expand(hrp);
    all.extend(&values);
    if polymod(&all) != 1 {
        return None;
    }
    Some((hrp.to_string(), from_5bit(&values[..values.len() - 6])?))
}

// ------------------------------------------------------------------ keys

/// An X25519 identity (`AGE-SECRET-KEY-1…`). Debug output never shows it.
pub struct Identity {
    secret: [u8; 32],
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Identity(…)")
    }
}

/// An X25519 recipient (`age1…`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recipient {
    public: [u8; 32],
}

impl Identity {
    pub fn generate() -> Result<Self> {
        let mut secret = [0u8; 32];
        aws_lc_rs::rand::fill(&mut secret).map_err(|_| AgeError::Crypto("random"))?;
        Ok(Identity { secret })
    }

    /// Parse `AGE-SECRET-KEY-1…` (surrounding whitespace and `#` comment lines ignored).
    pub fn parse(text: &str) -> Result<Self> {
        let line = text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty() && !l.starts_with('#'))
            .ok_or_else(|| AgeError::Key("no identity line".into()))?;
        let (hrp, data) = bech32_decode(line).ok_or_else(|| AgeError::Key("not Bech32".into()))?;
        if hrp != "age-secret-key-" || !line.starts_with("AGE-SECRET-KEY-1") {
            return Err(AgeError::Key("not an AGE-SECRET-KEY".into()));
        }
        let secret: [u8; 32] = data
            .try_into()
            .map_err(|_| AgeError::Key("identity is not 32 bytes".into()))?;
        Ok(Identity { secret })
    }

    /// The Bech32 text form. Secret: callers must not log it.
    pub fn to_secret_string(&self) -> String {
        bech32_encode("age-secret-key-", &self.secret).to_ascii_uppercase()
    }

    fn private_key(&self) -> Result<PrivateKey> {
        PrivateKey::from_private_key(&X25519, &self.secret)
            .map_err(|_| AgeError::Key("X25519 secret rejected".into()))
    }

    pub fn recipient(&self) -> Result<Recipient> {
        let p = self
            .private_key()?
            .compute_public_key()
            .map_err(|_| AgeError::Crypto("X25519 public key"))?;
        let public: [u8; 32] = p
            .as_ref()
            .try_into()
            .map_err(|_| AgeError::Crypto("X25519 public key"))?;
        Ok(Recipient { public })
    }
}

impl Recipient {
    pub fn parse(text: &str) -> Result<Self> {
        let text = text.trim();
        let (hrp, data) = bech32_decode(text).ok_or_else(|| AgeError::Key("not Bech32".into()))?;
        if hrp != "age" || !text.starts_with("age1") {
            return Err(AgeError::Key("not an age1 recipient".into()));
        }
        let public: [u8; 32] = data
            .try_into()
            .map_err(|_| AgeError::Key("recipient is not 32 bytes".into()))?;
        Ok(Recipient { public })
    }
}

impl std::fmt::Display for Recipient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&bech32_encode("age", &self.public))
    }
}

// ------------------------------------------------------------------ primitives

fn hkdf32(ikm: &[u8], salt: &[u8], info: &[u8]) -> Result<[u8; 32]> {
    struct Len;
    impl hkdf::KeyType for Len {
        fn len(&self) -> usize {
            32
        }
    }
    let mut out = [0u8; 32];
    hkdf::Salt::new(hkdf::HKDF_SHA256, salt)
        .extract(ikm)
        .expand(&[info], Len)
        .and_then(|okm| okm.fill(&mut out))
        .map_err(|_| AgeError::Crypto("HKDF"))?;
    Ok(out)
}

fn chacha(key: &[u8; 32]) -> Result<LessSafeKey> {
    Ok(LessSafeKey::new(
        UnboundKey::new(&CHACHA20_POLY1305, key).map_err(|_| AgeError::Crypto("key"))?,
    ))
}

fn stream_nonce(index: u64, last: bool) -> Nonce {
    let mut n = [0u8; 12];
    n[3..11].copy_from_slice(&index.to_be_bytes());
    n[11] = u8::from(last);
    Nonce::assume_unique_for_key(n)
}

fn header_mac(file_key: &[u8; 16], header_through_dashes: &[u8]) -> Result<[u8; 32]> {
    let k = hkdf32(file_key, &[], b"header")?;
    let tag = hmac::sign(
        &hmac::Key::new(hmac::HMAC_SHA256, &k),
        header_through_dashes,
    );
    let mut out = [0u8; 32];
    out.copy_from_slice(tag.as_ref());
    Ok(out)
}

fn wrap_lines(b64: &str) -> String {
    let mut out = String::new();
    let bytes = b64.as_bytes();
    for chunk in bytes.chunks(64) {
        out.push_str(std::str::from_utf8(chunk).unwrap_or_default());
        out.push('\n');
    }
    if bytes.len().is_multiple_of(64) {
        out.push('\n'); // the last body line is always shorter than 64 columns
    }
    out
}

/// Number of STREAM chunks for a plaintext of `len` bytes (an empty file is one empty chunk).
fn chunk_count(len: u64) -> u64 {
    if len == 0 {
        1
    } else {
        len.div_ceil(CHUNK as u64)
    }
}

fn threads_or_cores(threads: usize) -> usize {
    if threads > 0 {
        threads
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

/// What is done to one chunk in place: (slot, input length, chunk index, is it the last chunk)
/// → output length. The slot has room for the output (a tag more than the input, at most).
type ChunkOp<'a> = dyn Fn(&mut [u8], usize, u64, bool) -> Result<usize> + Sync + 'a;

/// One batch of consecutive chunks in one buffer of fixed-size slots.
struct Batch {
    buf: Vec<u8>,
    first: u64,
    /// (input length, output length) per chunk.
    lens: Vec<(usize, usize)>,
}

/// Stream `total` chunks from `input` through `op` to `out`: batches of `threads × 16` chunks
/// are transformed in parallel while the calling thread writes the previous batch and reads the
/// next one, so I/O overlaps the crypto. Output is written strictly in chunk order. Returns the
/// bytes written.
#[allow(clippy::too_many_arguments)]
fn pipeline(
    input: &mut dyn Read,
    out: &mut dyn Write,
    total: u64,
    in_len: &dyn Fn(u64) -> usize,
    slot: usize,
    threads: usize,
    op: &ChunkOp<'_>,
    progress: &mut dyn FnMut(u64),
) -> Result<u64> {
    let per_batch = (threads * 16) as u64;
    let mut spare: Vec<Vec<u8>> = Vec::new();
    let mut read_batch = |first: u64, spare: &mut Vec<Vec<u8>>| -> Result<Option<Batch>> {
        if first >= total {
            return Ok(None);
        }
        let n = per_batch.min(total - first) as usize;
        let mut buf = spare.pop().unwrap_or_default();
        buf.resize(n * slot, 0);
        let mut lens = Vec::with_capacity(n);
        for (i, s) in buf.chunks_mut(slot).enumerate() {
            let len = in_len(first + i as u64);
            input
                .read_exact(&mut s[..len])
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::UnexpectedEof => AgeError::Length,
                    _ => AgeError::Io(e),
                })?;
            lens.push((len, 0));
        }
        Ok(Some(Batch { buf, first, lens }))
    };
    let mut written = 0u64;
    let mut write_batch = |b: &Batch, written: &mut u64| -> Result<()> {
        for (s, (_, out_len)) in b.buf.chunks(slot).zip(&b.lens) {
            out.write_all(&s[..*out_len])?;
            *written += *out_len as u64;
        }
        Ok(())
    };
    let mut cur = read_batch(0, &mut spare)?;
    let mut ready: Option<Batch> = None;
    while let Some(mut batch) = cur.take() {
        let next_first = batch.first + batch.lens.len() as u64;
        let per_thread = batch.lens.len().div_ceil(threads.max(1)).max(1);
        let (results, io) = std::thread::scope(|s| {
            let first = batch.first;
            let handles: Vec<_> = batch
                .buf
                .chunks_mut(per_thread * slot)
                .zip(batch.lens.chunks_mut(per_thread))
                .enumerate()
                .map(|(t, (group, lens))| {
                    s.spawn(move || {
                        for (j, (slot_buf, (len, out_len))) in
                            group.chunks_mut(slot).zip(lens.iter_mut()).enumerate()
                        {
                            let index = first + (t * per_thread + j) as u64;
                            *out_len = op(slot_buf, *len, index, index + 1 == total)?;
                        }
                        Ok::<(), AgeError>(())
                    })
                })
                .collect();
            // Meanwhile: write what is done, read what comes next.
            let io = (|| {
                if let Some(r) = ready.take() {
                    write_batch(&r, &mut written)?;
                    spare.push(r.buf);
                }
                read_batch(next_first, &mut spare)
            })();
            let results: Result<()> = handles
                .into_iter()
                .try_for_each(|h| h.join().unwrap_or(Err(AgeError::Crypto("worker panicked"))));
            (results, io)
        });
        results?;
        cur = io?;
        ready = Some(batch);
        progress(written);
    }
    if let Some(r) = ready.take() {
        write_batch(&r, &mut written)?;
    }
    progress(written);
    Ok(written)
}

// ------------------------------------------------------------------ encrypt

/// Encrypt `len` bytes from `input` to `recipient`, writing the age file to `out`, on
/// `threads` threads (0 = one per core). `progress` gets the plaintext bytes done so far.
pub fn encrypt(
    recipient: &Recipient,
    input: &mut dyn Read,
    len: u64,
    out: &mut dyn Write,
    threads: usize,
    progress: &mut dyn FnMut(u64),
) -> Result<()> {
    let mut file_key = [0u8; 16];
    aws_lc_rs::rand::fill(&mut file_key).map_err(|_| AgeError::Crypto("random"))?;
    let eph = PrivateKey::generate(&X25519).map_err(|_| AgeError::Crypto("ephemeral key"))?;
    let share = eph
        .compute_public_key()
        .map_err(|_| AgeError::Crypto("ephemeral key"))?;
    let shared = agreement::agree(
        &eph,
        UnparsedPublicKey::new(&X25519, &recipient.public),
        AgeError::Key("recipient is a low-order point".into()),
        |z| Ok(z.to_vec()),
    )?;
    let mut salt = share.as_ref().to_vec();
    salt.extend_from_slice(&recipient.public);
    let wrap_key = hkdf32(&shared, &salt, X25519_INFO)?;
    let mut body = file_key.to_vec();
    chacha(&wrap_key)?
        .seal_in_place_append_tag(
            Nonce::assume_unique_for_key([0; 12]),
            Aad::empty(),
            &mut body,
        )
        .map_err(|_| AgeError::Crypto("wrap"))?;
    let mut header = format!("{INTRO}\n-> X25519 {}\n", B64.encode(share.as_ref()));
    header.push_str(&wrap_lines(&B64.encode(&body)));
    header.push_str("---");
    let mac = header_mac(&file_key, header.as_bytes())?;
    header.push_str(&format!(" {}\n", B64.encode(mac)));
    out.write_all(header.as_bytes())?;
    let mut nonce = [0u8; 16];
    aws_lc_rs::rand::fill(&mut nonce).map_err(|_| AgeError::Crypto("random"))?;
    out.write_all(&nonce)?;
    let key = chacha(&hkdf32(&file_key, &nonce, b"payload")?)?;
    let total = chunk_count(len);
    let last_len = (len - (total - 1) * CHUNK as u64) as usize;
    let in_len = |i: u64| if i + 1 == total { last_len } else { CHUNK };
    pipeline(
        input,
        out,
        total,
        &in_len,
        CT_CHUNK,
        threads_or_cores(threads),
        &|slot, len, index, last| {
            let tag = key
                .seal_in_place_separate_tag(
                    stream_nonce(index, last),
                    Aad::empty(),
                    &mut slot[..len],
                )
                .map_err(|_| AgeError::Crypto("seal"))?;
            slot[len..len + TAG].copy_from_slice(tag.as_ref());
            Ok(len + TAG)
        },
        &mut |w| {
            // Report plaintext bytes: each full chunk grew by a tag.
            progress(w - w.div_ceil(CT_CHUNK as u64) * TAG as u64)
        },
    )?;
    out.flush()?;
    Ok(())
}

// ------------------------------------------------------------------ decrypt

/// A parsed header: X25519 stanzas (share, body), the bytes the MAC covers, and the MAC.
struct Header {
    x25519: Vec<([u8; 32], Vec<u8>)>,
    others: Vec<String>,
    covered: Vec<u8>,
    mac: [u8; 32],
    len: usize,
}

fn read_line(input: &mut dyn Read, raw: &mut Vec<u8>) -> Result<String> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        if input.read(&mut b)? == 0 {
            return Err(AgeError::Header("unexpected end of header".into()));
        }
        raw.push(b[0]);
        if b[0] == b'\n' {
            break;
        }
        line.push(b[0]);
        if line.len() > 4096 {
            return Err(AgeError::Header("header line too long".into()));
        }
    }
    String::from_utf8(line).map_err(|_| AgeError::Header("not UTF-8".into()))
}

fn b64_strict(s: &str, what: &str) -> Result<Vec<u8>> {
    if s.contains('=') || s.contains(['\r', ' ']) {
        return Err(AgeError::Header(format!("{what}: not canonical base64")));
    }
    let v = B64
        .decode(s)
        .map_err(|_| AgeError::Header(format!("{what}: not base64")))?;
    if B64.encode(&v) != s {
        return Err(AgeError::Header(format!("{what}: not canonical base64")));
    }
    Ok(v)
}

/// Largest header read (every byte of it is kept for the MAC).
const MAX_HEADER: usize = 64 << 10;
/// Most recipient stanzas read: each X25519 stanza costs an agreement when opening.
const MAX_STANZAS: usize = 64;

fn parse_header(input: &mut dyn Read) -> Result<Header> {
    let mut raw = Vec::new();
    if read_line(input, &mut raw)? != INTRO {
        return Err(AgeError::Header("not an age v1 file".into()));
    }
    let mut x25519 = Vec::new();
    let mut others = Vec::new();
    loop {
        if x25519.len() + others.len() >= MAX_STANZAS {
            return Err(AgeError::Header(format!(
                "more than {MAX_STANZAS} recipient stanzas"
            )));
        }
        let before = raw.len();
        let line = read_line(input, &mut raw)?;
        if let Some(mac) = line.strip_prefix("--- ") {
            let mut covered = raw[..before].to_vec();
            covered.extend_from_slice(b"---");
            let mac: [u8; 32] = b64_strict(mac, "MAC")?
                .try_into()
                .map_err(|_| AgeError::Header("MAC is not 32 bytes".into()))?;
            if x25519.is_empty() && others.is_empty() {
                return Err(AgeError::Header("no recipient stanza".into()));
            }
            return Ok(Header {
                x25519,
                others,
                covered,
                mac,
                len: raw.len(),
            });
        }
        let args = line
            .strip_prefix("-> ")
            .ok_or_else(|| AgeError::Header("expected a stanza or the MAC line".into()))?;
        let args: Vec<&str> = args.split(' ').collect();
        if args.iter().any(|a| a.is_empty()) {
            return Err(AgeError::Header("empty stanza argument".into()));
        }
        let mut body = String::new();
        loop {
            let l = read_line(input, &mut raw)?;
            if raw.len() > MAX_HEADER {
                return Err(AgeError::Header(format!("header over {MAX_HEADER} bytes")));
            }
            if l.len() > 64 {
                return Err(AgeError::Header("stanza body line over 64 columns".into()));
            }
            body.push_str(&l);
            if l.len() < 64 {
                break;
            }
        }
        let body = b64_strict(&body, "stanza body")?;
        match args.as_slice() {
            ["X25519", share] => {
                let share: [u8; 32] = b64_strict(share, "X25519 share")?
                    .try_into()
                    .map_err(|_| AgeError::Header("X25519 share is not 32 bytes".into()))?;
                if body.len() != 32 {
                    return Err(AgeError::Header("X25519 body is not 32 bytes".into()));
                }
                x25519.push((share, body));
            }
            ["X25519", ..] => return Err(AgeError::Header("malformed X25519 stanza".into())),
            [kind, ..] => others.push((*kind).to_string()),
            [] => return Err(AgeError::Header("empty stanza".into())),
        }
    }
}

/// X25519 with a stanza's ephemeral share; `None` for a share aws-lc refuses or a low-order
/// point (an all-zero shared secret, which age requires recipients to refuse).
fn x25519_shared(sk: &PrivateKey, share: &[u8]) -> Option<Vec<u8>> {
    agreement::agree(sk, UnparsedPublicKey::new(&X25519, share), (), |z| {
        Ok(z.to_vec())
    })
    .ok()
    .filter(|z| z.iter().any(|&b| b != 0))
}

/// Open one STREAM chunk in place: ChaCha20-Poly1305 under the payload key, no AAD. Returns the
/// plaintext length.
fn open_chunk(key: &LessSafeKey, nonce: Nonce, chunk: &mut [u8]) -> std::result::Result<usize, ()> {
    key.open_in_place(nonce, Aad::empty(), chunk)
        .map(|p| p.len())
        .map_err(|_| ())
}

fn unwrap_file_key(identity: &Identity, h: &Header) -> Result<[u8; 16]> {
    let sk = identity.private_key()?;
    let me = identity.recipient()?;
    for (share, body) in &h.x25519 {
        let Some(shared) = x25519_shared(&sk, share) else {
            continue;
        };
        let mut salt = share.to_vec();
        salt.extend_from_slice(&me.public);
        let wrap_key = hkdf32(&shared, &salt, X25519_INFO)?;
        let mut b = body.clone();
        if let Ok(k) = chacha(&wrap_key)?.open_in_place(
            Nonce::assume_unique_for_key([0; 12]),
            Aad::empty(),
            &mut b,
        ) && let Ok(k) = <[u8; 16]>::try_from(&k[..])
        {
            return Ok(k);
        }
    }
    if h.x25519.is_empty() {
        return Err(AgeError::Header(format!(
            "no X25519 stanza (found {})",
            h.others.join(", ")
        )));
    }
    Err(AgeError::NoMatch)
}

/// Decrypt an age file of `file_len` bytes from `input` with `identity`, writing the plaintext
/// to `out` in order, on `threads` threads (0 = one per core). Returns the plaintext length.
/// Nothing is written before the header verifies; a tampered chunk stops the output there with
/// an error (the caller discards `out`).
pub fn decrypt(
    identity: &Identity,
    input: &mut dyn Read,
    file_len: u64,
    out: &mut dyn Write,
    threads: usize,
    progress: &mut dyn FnMut(u64),
) -> Result<u64> {
    let h = parse_header(input)?;
    let file_key = unwrap_file_key(identity, &h)?;
    let expect = header_mac(&file_key, &h.covered)?;
    if !constant_time_eq(&expect, &h.mac) {
        return Err(AgeError::HeaderMac);
    }
    let mut nonce = [0u8; 16];
    input.read_exact(&mut nonce).map_err(|_| AgeError::Length)?;
    let payload = file_len
        .checked_sub(h.len as u64 + 16)
        .ok_or(AgeError::Length)?;
    let total = payload.div_ceil(CT_CHUNK as u64).max(1);
    let last_len = payload - (total - 1) * CT_CHUNK as u64;
    if last_len < TAG as u64 || (last_len == TAG as u64 && total > 1) {
        return Err(AgeError::Length);
    }
    let key = chacha(&hkdf32(&file_key, &nonce, b"payload")?)?;
    let in_len = |i: u64| {
        if i + 1 == total {
            last_len as usize
        } else {
            CT_CHUNK
        }
    };
    let written = pipeline(
        input,
        out,
        total,
        &in_len,
        CT_CHUNK,
        threads_or_cores(threads),
        &|slot, len, index, last| {
            open_chunk(&key, stream_nonce(index, last), &mut slot[..len])
                .map_err(|_| AgeError::Chunk(index))
        },
        progress,
    )?;
    let mut probe = [0u8; 1];
    if input.read(&mut probe)? != 0 {
        return Err(AgeError::Length);
    }
    out.flush()?;
    Ok(written)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn round(len: usize, threads: usize) {
        let id = Identity::generate().unwrap();
        let r = id.recipient().unwrap();
        let plain: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let mut file = Vec::new();
        encrypt(
            &r,
            &mut &plain[..],
            len as u64,
            &mut file,
            threads,
            &mut |_| {},
        )
        .unwrap();
        let mut back = Vec::new();
        let n = decrypt(
            &id,
            &mut &file[..],
            file.len() as u64,
            &mut back,
            threads,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(n as usize, len);
        assert_eq!(back, plain, "len {len}");
    }

    #[test]
    fn round_trips_at_chunk_edges() {
        for len in [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK, 40 * CHUNK + 7] {
            round(len, 3);
        }
    }

    #[test]
    fn keys_encode_like_age() {
        let id = Identity::generate().unwrap();
        let s = id.to_secret_string();
        assert!(s.starts_with("AGE-SECRET-KEY-1"));
        let back = Identity::parse(&format!("# created\n{s}\n")).unwrap();
        assert_eq!(back.recipient().unwrap(), id.recipient().unwrap());
        let r = id.recipient().unwrap().to_string();
        assert!(r.starts_with("age1") && r.len() == 62, "{r}");
        assert_eq!(Recipient::parse(&r).unwrap(), id.recipient().unwrap());
        // A flipped character breaks the checksum.
        let mut bad = r.into_bytes();
        bad[10] = if bad[10] == b'q' { b'p' } else { b'q' };
        assert!(Recipient::parse(std::str::from_utf8(&bad).unwrap()).is_err());
        assert!(Identity::parse("age1xyz").is_err());
    }

    #[test]
    fn tampering_is_detected() {
        let id = Identity::generate().unwrap();
        let plain = vec![7u8; 2 * CHUNK + 5];
        let mut file = Vec::new();
        encrypt(
            &id.recipient().unwrap(),
            &mut &plain[..],
            plain.len() as u64,
            &mut file,
            2,
            &mut |_| {},
        )
        .unwrap();
        let open = |f: &[u8]| {
            let mut out = Vec::new();
            decrypt(&id, &mut &f[..], f.len() as u64, &mut out, 2, &mut |_| {})
        };
        assert!(open(&file).is_ok());
        // Header byte (in the share), MAC, a payload byte, truncation, an extra byte.
        let mut t = file.clone();
        t[35] ^= 1;
        assert!(open(&t).is_err());
        let hl = file.windows(4).position(|w| w == b"--- ").unwrap();
        let mut t = file.clone();
        t[hl + 6] ^= 1;
        assert!(open(&t).is_err());
        let mut t = file.clone();
        let last = t.len() - 3;
        t[last] ^= 1;
        assert!(matches!(open(&t), Err(AgeError::Chunk(2))));
        assert!(open(&file[..file.len() - 1]).is_err());
        let mut t = file.clone();
        t.push(0);
        assert!(open(&t).is_err());
        // Dropping the final chunk entirely: the new last chunk lacks the last flag.
        assert!(open(&file[..file.len() - (5 + TAG)]).is_err());
        // Another identity.
        let other = Identity::generate().unwrap();
        let mut out = Vec::new();
        assert!(matches!(
            decrypt(
                &other,
                &mut &file[..],
                file.len() as u64,
                &mut out,
                1,
                &mut |_| {}
            ),
            Err(AgeError::NoMatch)
        ));
        for n in 0..200usize {
            let junk: Vec<u8> = (0..n).map(|i| (i * 7 + n) as u8).collect();
            let mut out = Vec::new();
            let _ = decrypt(&id, &mut &junk[..], n as u64, &mut out, 1, &mut |_| {});
        }
    }

    #[test]
    fn headers_are_bounded_before_any_key_agreement() {
        // Many small stanzas (each would cost an X25519 agreement): refused at the bound.
        let share = B64.encode([9u8; 32]);
        let body = B64.encode([1u8; 32]);
        let mut h = format!("{INTRO}\n");
        for _ in 0..(MAX_STANZAS + 1) {
            h.push_str(&format!("-> X25519 {share}\n{body}\n"));
        }
        h.push_str(&format!("--- {}\n", B64.encode([0u8; 32])));
        let e = parse_header(&mut h.as_bytes()).err().unwrap();
        assert!(e.to_string().contains("stanzas"), "{e}");
        // One stanza whose body never ends (full 64-column lines): refused at the size bound.
        let mut h = format!("{INTRO}\n-> other\n");
        let line = "A".repeat(64);
        for _ in 0..(MAX_HEADER / 65 + 2) {
            h.push_str(&line);
            h.push('\n');
        }
        let e = parse_header(&mut h.as_bytes()).err().unwrap();
        assert!(e.to_string().contains("header over"), "{e}");
        // Within the bounds a well-formed header still parses.
        let id = Identity::generate().unwrap();
        let mut file = Vec::new();
        encrypt(
            &id.recipient().unwrap(),
            &mut &b"x"[..],
            1,
            &mut file,
            1,
            &mut |_| {},
        )
        .unwrap();
        assert!(parse_header(&mut &file[..]).is_ok());
    }
}

/// Project Wycheproof vectors through cgx-age's own functions.
#[cfg(test)]
mod vectors {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::Value;

    fn tests(name: &str) -> Vec<(Value, Value)> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/wycheproof")
            .join(name);
        let v: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        v["testGroups"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|g| {
                g["tests"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(move |t| (g.clone(), t.clone()))
            })
            .collect()
    }

    fn hx(v: &Value) -> Vec<u8> {
        hex::decode(v.as_str().unwrap()).unwrap()
    }

    /// Every share whose shared secret is not all zeros agrees as the vector says; low-order
    /// shares (all-zero secret) are refused.
    #[test]
    fn x25519_recipient_agreement() {
        let (mut agreed, mut refused) = (0, 0);
        for (_, t) in tests("x25519_test.json") {
            let sk = PrivateKey::from_private_key(&X25519, &hx(&t["private"])).unwrap();
            let shared = hx(&t["shared"]);
            let ours = x25519_shared(&sk, &hx(&t["public"]));
            if shared.iter().all(|&b| b == 0) || t["result"] == "invalid" {
                assert!(ours.is_none(), "tcId {}", t["tcId"]);
                refused += 1;
            } else {
                assert_eq!(ours.as_deref(), Some(&shared[..]), "tcId {}", t["tcId"]);
                agreed += 1;
            }
        }
        assert!(agreed > 100 && refused > 10, "{agreed} {refused}");
    }

    #[test]
    fn hkdf_sha256_key_derivation() {
        let mut checked = 0;
        for (_, t) in tests("hkdf_sha256_test.json") {
            if t["size"] != 32 {
                continue; // age derives 32-byte keys only
            }
            let ours = hkdf32(&hx(&t["ikm"]), &hx(&t["salt"]), &hx(&t["info"]));
            assert_eq!(ours.is_ok(), t["result"] == "valid", "tcId {}", t["tcId"]);
            if let Ok(k) = ours {
                assert_eq!(k.to_vec(), hx(&t["okm"]), "tcId {}", t["tcId"]);
            }
            checked += 1;
        }
        assert!(checked > 5, "{checked}");
    }

    /// The chunk opener with the vectors' keys and nonces (no AAD: age's STREAM has none).
    #[test]
    fn chacha20_poly1305_chunks() {
        let mut checked = 0;
        for (g, t) in tests("chacha20_poly1305_test.json") {
            if g["keySize"] != 256 || g["ivSize"] != 96 || g["tagSize"] != 128 || t["aad"] != "" {
                continue;
            }
            let key: [u8; 32] = hx(&t["key"]).try_into().unwrap();
            let nonce = Nonce::assume_unique_for_key(hx(&t["iv"]).try_into().unwrap());
            let mut buf = hx(&t["ct"]);
            buf.extend(hx(&t["tag"]));
            let ours = open_chunk(&chacha(&key).unwrap(), nonce, &mut buf);
            assert_eq!(ours.is_ok(), t["result"] == "valid", "tcId {}", t["tcId"]);
            if let Ok(n) = ours {
                assert_eq!(buf[..n].to_vec(), hx(&t["msg"]));
            }
            checked += 1;
        }
        assert!(checked > 30, "{checked}");
    }
}
