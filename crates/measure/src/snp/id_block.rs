//! The ID block and ID authentication structure a guest owner hands to `SNP_LAUNCH_FINISH`
//! (QEMU `sev-snp-guest` `id-block=` / `id-auth=`, base64): the AMD-SP refuses the launch unless
//! its digest equals the block's, and the report then carries the digests of the keys that signed
//! it (`ID_KEY_DIGEST`, `AUTHOR_KEY_DIGEST`), which reference values can name.
//!
//! **ID block** (SEV-SNP ABI specification, Table 75 `ID_BLOCK`, 0x60 bytes):
//!
//! | offset | field |
//! |---|---|
//! | 0x00 | `LD`: the expected launch digest (48 bytes) |
//! | 0x30 | `FAMILY_ID` (16 bytes) |
//! | 0x40 | `IMAGE_ID` (16 bytes) |
//! | 0x50 | `VERSION` (u32): 1 |
//! | 0x54 | `GUEST_SVN` (u32) |
//! | 0x58 | `POLICY` (u64): the guest policy the launch must have |
//!
//! **ID authentication information** (Table 76 `ID_AUTH_INFO`, 0x1000 bytes):
//!
//! | offset | field |
//! |---|---|
//! | 0x000 | `ID_KEY_ALGO` (u32): 1, ECDSA P-384 with SHA-384 |
//! | 0x004 | `AUTH_KEY_ALGO` (u32): 1 |
//! | 0x040 | `ID_BLOCK_SIG`: the ID key's signature over the ID block (0x200) |
//! | 0x240 | `ID_KEY`: the ID public key (0x404) |
//! | 0x680 | `ID_KEY_SIG`: the author key's signature over `ID_KEY` (0x200) |
//! | 0x880 | `AUTHOR_KEY`: the author public key (0x404) |
//!
//! A public key (Appendix "Public Key Formats", ECDSA): `CURVE` (u32, 2 = P-384) at 0x0, `QX` at
//! 0x4 and `QY` at 0x4C (72 bytes each, little-endian, zero-extended), zeros to 0x404. A signature
//! ("Signature Formats", ECDSA P-384 with SHA-384): `R` at 0x0 and `S` at 0x48 (72 bytes each,
//! little-endian), zeros to 0x200. A key's digest in the report is SHA-384 of its 0x404 bytes.

use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{
    ECDSA_P384_SHA384_FIXED, ECDSA_P384_SHA384_FIXED_SIGNING, EcdsaKeyPair, KeyPair,
    UnparsedPublicKey,
};

use crate::{Error, Result, sha384};

pub const ID_BLOCK_LEN: usize = 0x60;
pub const ID_AUTH_LEN: usize = 0x1000;
pub const PUBLIC_KEY_LEN: usize = 0x404;
pub const SIGNATURE_LEN: usize = 0x200;
/// `ID_KEY_ALGO` / `AUTH_KEY_ALGO`: ECDSA P-384 with SHA-384.
pub const ALGO_ECDSA_P384_SHA384: u32 = 1;
/// `CURVE`: P-384.
pub const CURVE_P384: u32 = 2;

/// Table 75.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdBlock {
    pub launch_digest: [u8; 48],
    pub family_id: [u8; 16],
    pub image_id: [u8; 16],
    pub guest_svn: u32,
    pub policy: u64,
}

impl IdBlock {
    pub fn to_bytes(&self) -> [u8; ID_BLOCK_LEN] {
        let mut b = [0u8; ID_BLOCK_LEN];
        b[..0x30].copy_from_slice(&self.launch_digest);
        b[0x30..0x40].copy_from_slice(&self.family_id);
        b[0x40..0x50].copy_from_slice(&self.image_id);
        b[0x50..0x54].copy_from_slice(&1u32.to_le_bytes());
        b[0x54..0x58].copy_from_slice(&self.guest_svn.to_le_bytes());
        b[0x58..0x60].copy_from_slice(&self.policy.to_le_bytes());
        b
    }
}

/// A P-384 signing key (ID key or author key).
#[derive(Debug)]
pub struct SigningKey(EcdsaKeyPair);

impl SigningKey {
    /// From DER: PKCS#8 or SEC1 `ECPrivateKey` (what `openssl ecparam -genkey` writes).
    pub fn from_der(der: &[u8]) -> Result<Self> {
        EcdsaKeyPair::from_private_key_der(&ECDSA_P384_SHA384_FIXED_SIGNING, der)
            .or_else(|_| EcdsaKeyPair::from_pkcs8(&ECDSA_P384_SHA384_FIXED_SIGNING, der))
            .map(SigningKey)
            .map_err(|_| Error::Parameter("not a P-384 private key (PKCS#8 or SEC1 DER)".into()))
    }

    pub fn generate() -> Result<Self> {
        EcdsaKeyPair::generate(&ECDSA_P384_SHA384_FIXED_SIGNING)
            .map(SigningKey)
            .map_err(|_| Error::Parameter("P-384 key generation failed".into()))
    }

    /// The key in the SNP public-key format.
    pub fn public_key(&self) -> [u8; PUBLIC_KEY_LEN] {
        // Uncompressed point: 0x04 ‖ X ‖ Y, big-endian.
        let q = self.0.public_key().as_ref();
        let mut k = [0u8; PUBLIC_KEY_LEN];
        k[..4].copy_from_slice(&CURVE_P384.to_le_bytes());
        if q.len() == 97 {
            little_endian(&mut k[4..52], &q[1..49]);
            little_endian(&mut k[0x4c..0x7c], &q[49..97]);
        }
        k
    }

    /// SHA-384 of [`Self::public_key`]: what the report's key digest fields hold.
    pub fn digest(&self) -> [u8; 48] {
        key_digest(&self.public_key())
    }

    /// An ECDSA P-384/SHA-384 signature over `msg`, in the SNP signature format.
    pub fn sign(&self, msg: &[u8]) -> Result<[u8; SIGNATURE_LEN]> {
        let sig = self
            .0
            .sign(&SystemRandom::new(), msg)
            .map_err(|_| Error::Parameter("ECDSA signing failed".into()))?;
        let rs = sig.as_ref(); // r ‖ s, 48 bytes each, big-endian
        let mut out = [0u8; SIGNATURE_LEN];
        if rs.len() == 96 {
            little_endian(&mut out[..48], &rs[..48]);
            little_endian(&mut out[0x48..0x78], &rs[48..]);
        }
        Ok(out)
    }
}

/// `be` (a big-endian number) into `le`, least significant byte first (the SNP formats).
fn little_endian(le: &mut [u8], be: &[u8]) {
    for (d, s) in le.iter_mut().zip(be.iter().rev()) {
        *d = *s;
    }
}

/// SHA-384 of a public key in the SNP format.
pub fn key_digest(public_key: &[u8; PUBLIC_KEY_LEN]) -> [u8; 48] {
    sha384(public_key)
}

/// Table 76, signed: the ID key signs the block, the author key signs the ID key.
pub fn id_auth(
    block: &IdBlock,
    id_key: &SigningKey,
    author_key: &SigningKey,
) -> Result<[u8; ID_AUTH_LEN]> {
    let id_public = id_key.public_key();
    let mut a = [0u8; ID_AUTH_LEN];
    a[0..4].copy_from_slice(&ALGO_ECDSA_P384_SHA384.to_le_bytes());
    a[4..8].copy_from_slice(&ALGO_ECDSA_P384_SHA384.to_le_bytes());
    a[0x040..0x240].copy_from_slice(&id_key.sign(&block.to_bytes())?);
    a[0x240..0x644].copy_from_slice(&id_public);
    a[0x680..0x880].copy_from_slice(&author_key.sign(&id_public)?);
    a[0x880..0xc84].copy_from_slice(&author_key.public_key());
    Ok(a)
}

/// Check an ID authentication structure as the AMD-SP does at launch: both signatures, over
/// this block. Returns the (ID key, author key) digests.
pub fn verify_id_auth(
    block: &[u8; ID_BLOCK_LEN],
    auth: &[u8; ID_AUTH_LEN],
) -> Result<([u8; 48], [u8; 48])> {
    let field = |at: usize, len: usize| &auth[at..at + len];
    for (at, what) in [(0usize, "ID_KEY_ALGO"), (4, "AUTH_KEY_ALGO")] {
        let algo = u32::from_le_bytes([auth[at], auth[at + 1], auth[at + 2], auth[at + 3]]);
        if algo != ALGO_ECDSA_P384_SHA384 {
            return Err(Error::Parameter(format!(
                "{what} {algo} (1, ECDSA P-384, is known)"
            )));
        }
    }
    // Reserved areas and the unused high bytes of each 72-byte coordinate must be zero: a
    // key's digest covers all 0x404 bytes, and two encodings of one key must not give two.
    let zero = |at: usize, len: usize, what: &str| -> Result<()> {
        if auth[at..at + len].iter().any(|b| *b != 0) {
            return Err(Error::Parameter(format!("{what} is not zero")));
        }
        Ok(())
    };
    zero(0x008, 0x38, "reserved bytes 0x008–0x03F")?;
    zero(0x644, 0x3c, "reserved bytes 0x644–0x67F")?;
    zero(0xc84, ID_AUTH_LEN - 0xc84, "reserved bytes from 0xC84")?;
    for (base, what) in [(0x240, "ID_KEY"), (0x880, "AUTHOR_KEY")] {
        zero(base + 4 + 48, 24, &format!("{what} QX's high bytes"))?;
        zero(base + 0x4c + 48, 24, &format!("{what} QY's high bytes"))?;
        zero(
            base + 0x94,
            PUBLIC_KEY_LEN - 0x94,
            &format!("{what}'s reserved bytes"),
        )?;
    }
    for (base, what) in [(0x040, "ID_BLOCK_SIG"), (0x680, "ID_KEY_SIG")] {
        zero(base + 48, 24, &format!("{what} R's high bytes"))?;
        zero(base + 0x48 + 48, 24, &format!("{what} S's high bytes"))?;
        zero(
            base + 0x90,
            SIGNATURE_LEN - 0x90,
            &format!("{what}'s reserved bytes"),
        )?;
    }
    let verify = |key: &[u8], sig: &[u8], msg: &[u8], what: &str| -> Result<()> {
        let curve = u32::from_le_bytes([key[0], key[1], key[2], key[3]]);
        if curve != CURVE_P384 {
            return Err(Error::Parameter(format!(
                "{what}: key curve {curve}, not P-384"
            )));
        }
        // Back to big-endian: 0x04 ‖ X ‖ Y, and R ‖ S.
        let mut q = vec![4u8];
        q.extend(key[4..52].iter().rev());
        q.extend(key[0x4c..0x7c].iter().rev());
        let mut rs: Vec<u8> = sig[..48].iter().rev().copied().collect();
        rs.extend(sig[0x48..0x78].iter().rev());
        UnparsedPublicKey::new(&ECDSA_P384_SHA384_FIXED, &q)
            .verify(msg, &rs)
            .map_err(|_| Error::Parameter(format!("{what}: the signature does not verify")))
    };
    let id_key = field(0x240, PUBLIC_KEY_LEN);
    let author = field(0x880, PUBLIC_KEY_LEN);
    verify(id_key, field(0x040, SIGNATURE_LEN), block, "ID_BLOCK_SIG")?;
    verify(author, field(0x680, SIGNATURE_LEN), id_key, "ID_KEY_SIG")?;
    Ok((sha384(id_key), sha384(author)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn sign_verify_and_tamper() {
        let (id, author) = (
            SigningKey::generate().unwrap(),
            SigningKey::generate().unwrap(),
        );
        let block = IdBlock {
            launch_digest: [7; 48],
            family_id: [1; 16],
            image_id: [2; 16],
            guest_svn: 3,
            policy: 0x30000,
        };
        let b = block.to_bytes();
        assert_eq!(&b[0x50..0x54], &[1, 0, 0, 0]);
        assert_eq!(&b[0x58..0x60], &0x30000u64.to_le_bytes());
        let auth = id_auth(&block, &id, &author).unwrap();
        let (idd, ad) = verify_id_auth(&b, &auth).unwrap();
        assert_eq!((idd, ad), (id.digest(), author.digest()));
        // Another block, or any flipped byte in a signature or key, is refused.
        let mut other = b;
        other[0] ^= 1;
        assert!(verify_id_auth(&other, &auth).is_err());
        for at in [
            0x040, 0x088, 0x250, 0x690, 0x890, 0x010, 0x0a0, 0x2a0, 0x650, 0xd00,
        ] {
            let mut t = auth;
            t[at] ^= 1;
            assert!(verify_id_auth(&b, &t).is_err(), "{at:#x}");
        }
    }
}
