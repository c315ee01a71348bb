//! Presigned nonces for the simulated AMD-SP's P-384 ECDSA signatures.
//!
//! An ECDSA signature is `r = x(k·G) mod n`, `s = k⁻¹·(z + r·d) mod n`. Everything but the
//! digest `z` can be computed before the message exists: the point multiplication and the
//! inversion, which are almost all of the cost. A [`Presigned`] pool holds `(r, k⁻¹, k⁻¹·r·d)`
//! for fresh random nonces `k`; signing then takes one multiplication and one addition mod `n`.
//!
//! Why a simulator wants this: `cgx bench kbs` runs the guests that load the KBS on the KBS's
//! own cores, while a real AMD-SP signs on its own processor in another machine. Filling the
//! pool before a timed window keeps that simulated hardware's work out of the window; the
//! signatures are ordinary P-384 ECDSA signatures with a new nonce each, and the KBS verifies
//! them as it verifies any other. The arithmetic here is variable-time: simulator only.

use std::sync::Mutex;

use aws_lc_rs::agreement::{ECDH_P384, PrivateKey};
use aws_lc_rs::encoding::{AsBigEndian, EcPrivateKeyBin};

/// One limb-array residue mod n, little-endian 64-bit limbs.
type Limbs = [u64; 6];

/// The P-384 group order n (SEC 2, §2.5.1), little-endian limbs.
const N: Limbs = [
    0xECEC_196A_CCC5_2973,
    0x581A_0DB2_48B0_A77A,
    0xC763_4D81_F437_2DDF,
    0xFFFF_FFFF_FFFF_FFFF,
    0xFFFF_FFFF_FFFF_FFFF,
    0xFFFF_FFFF_FFFF_FFFF,
];

/// −n⁻¹ mod 2⁶⁴ (Montgomery reduction constant), by Newton iteration on the low limb.
const N_INV: u64 = {
    let mut inv: u64 = 1;
    let mut i = 0;
    while i < 6 {
        inv = inv.wrapping_mul(2u64.wrapping_sub(N[0].wrapping_mul(inv)));
        i += 1;
    }
    inv.wrapping_neg()
};

/// `a − n` if `a ≥ n` (with `carry` as a 385th bit), else `a`.
fn reduce_once(a: Limbs, carry: u64) -> Limbs {
    let mut d = [0u64; 6];
    let mut borrow = 0u64;
    for i in 0..6 {
        let (x, b1) = a[i].overflowing_sub(N[i]);
        let (x, b2) = x.overflowing_sub(borrow);
        d[i] = x;
        borrow = (b1 | b2) as u64;
    }
    if carry == 1 || borrow == 0 { d } else { a }
}

fn add_mod(a: &Limbs, b: &Limbs) -> Limbs {
    let mut s = [0u64; 6];
    let mut carry = 0u64;
    for i in 0..6 {
        let (x, c1) = a[i].overflowing_add(b[i]);
        let (x, c2) = x.overflowing_add(carry);
        s[i] = x;
        carry = (c1 | c2) as u64;
    }
    reduce_once(s, carry)
}

/// Montgomery product `a·b·2⁻³⁸⁴ mod n` (CIOS), for `a, b < n`.
fn mont_mul(a: &Limbs, b: &Limbs) -> Limbs {
    let mut t = [0u64; 8];
    for &bi in b {
        let mut c = 0u128;
        for j in 0..6 {
            let s = t[j] as u128 + (a[j] as u128) * (bi as u128) + c;
            t[j] = s as u64;
            c = s >> 64;
        }
        let s = t[6] as u128 + c;
        t[6] = s as u64;
        t[7] = (s >> 64) as u64;
        let m = t[0].wrapping_mul(N_INV);
        let s = t[0] as u128 + (m as u128) * (N[0] as u128);
        let mut c = s >> 64;
        for j in 1..6 {
            let s = t[j] as u128 + (m as u128) * (N[j] as u128) + c;
            t[j - 1] = s as u64;
            c = s >> 64;
        }
        let s = t[6] as u128 + c;
        t[5] = s as u64;
        t[6] = t[7] + (s >> 64) as u64;
        t[7] = 0;
    }
    reduce_once([t[0], t[1], t[2], t[3], t[4], t[5]], t[6])
}

/// A residue out of Montgomery form.
fn demont(a: &Limbs) -> Limbs {
    mont_mul(a, &[1, 0, 0, 0, 0, 0])
}

/// 2⁷⁶⁸ mod n, which takes a residue into Montgomery form.
fn r_squared() -> Limbs {
    let mut x: Limbs = [1, 0, 0, 0, 0, 0];
    for _ in 0..768 {
        x = add_mod(&x, &x);
    }
    x
}

/// A 48-byte big-endian integer, reduced mod n (one subtraction suffices: n > 2³⁸³).
fn from_be(bytes: &[u8; 48]) -> Limbs {
    let mut l = [0u64; 6];
    for (i, limb) in l.iter_mut().enumerate() {
        let mut w = [0u8; 8];
        w.copy_from_slice(&bytes[48 - 8 * (i + 1)..48 - 8 * i]);
        *limb = u64::from_be_bytes(w);
    }
    reduce_once(l, 0)
}

fn to_be(l: &Limbs) -> [u8; 48] {
    let mut out = [0u8; 48];
    for (i, limb) in l.iter().enumerate() {
        out[48 - 8 * (i + 1)..48 - 8 * i].copy_from_slice(&limb.to_be_bytes());
    }
    out
}

/// Arithmetic mod n in Montgomery form.
struct Field {
    r2: Limbs,
}

impl Field {
    fn new() -> Self {
        Field { r2: r_squared() }
    }

    fn to_mont(&self, a: &Limbs) -> Limbs {
        mont_mul(a, &self.r2)
    }

    /// `a⁻¹` for `a ≠ 0` in Montgomery form: `a^(n−2)` (Fermat; n is prime).
    fn invert(&self, a: &Limbs) -> Limbs {
        let mut e = N;
        e[0] -= 2; // n is odd and its low limb is far above 2: no borrow
        let mut acc = self.to_mont(&[1, 0, 0, 0, 0, 0]);
        for limb in e.iter().rev() {
            for bit in (0..64).rev() {
                acc = mont_mul(&acc, &acc);
                if (limb >> bit) & 1 == 1 {
                    acc = mont_mul(&acc, a);
                }
            }
        }
        acc
    }
}

/// One nonce's precomputation: `r`, and in Montgomery form `k⁻¹` and `k⁻¹·r·d`.
struct Presig {
    r: [u8; 48],
    k_inv: Limbs,
    k_inv_r_d: Limbs,
}

/// A pool of presigned nonces for one P-384 signing key.
pub(crate) struct Presigned {
    field: Field,
    /// The signing key `d`, in Montgomery form.
    d: Limbs,
    pool: Mutex<Vec<Presig>>,
}

impl std::fmt::Debug for Presigned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Presigned")
            .field("ready", &self.ready())
            .finish_non_exhaustive()
    }
}

impl Presigned {
    /// An empty pool for the P-384 private scalar `d` (48 bytes, big-endian).
    pub(crate) fn new(d: &[u8; 48]) -> Self {
        let field = Field::new();
        let d = field.to_mont(&from_be(d));
        Presigned {
            field,
            d,
            pool: Mutex::new(Vec::new()),
        }
    }

    /// Presignatures ready.
    pub(crate) fn ready(&self) -> usize {
        self.pool.lock().map_or(0, |p| p.len())
    }

    /// Make `count` more, on `threads` threads.
    pub(crate) fn fill(&self, count: usize, threads: usize) -> Result<(), &'static str> {
        let threads = threads.clamp(1, 64);
        let made: Vec<Result<Vec<Presig>, &'static str>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let share = count / threads + usize::from(t < count % threads);
                    s.spawn(move || (0..share).map(|_| self.one()).collect())
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(Err("presigning thread panicked")))
                .collect()
        });
        let mut pool = self.pool.lock().map_err(|_| "presign pool poisoned")?;
        for batch in made {
            pool.extend(batch?);
        }
        Ok(())
    }

    fn one(&self) -> Result<Presig, &'static str> {
        loop {
            // k and k·G from aws-lc's key generation (a uniform scalar in [1, n−1]).
            let k = PrivateKey::generate(&ECDH_P384).map_err(|_| "nonce generation")?;
            let point = k.compute_public_key().map_err(|_| "nonce point")?;
            let point = point.as_ref();
            let k: EcPrivateKeyBin<'static> = k.as_be_bytes().map_err(|_| "nonce scalar")?;
            let (Ok(k), Some(x)) = (
                <&[u8; 48]>::try_from(k.as_ref()),
                point.get(1..49).and_then(|x| <&[u8; 48]>::try_from(x).ok()),
            ) else {
                return Err("unexpected P-384 encoding");
            };
            let r = from_be(x);
            if r == [0; 6] {
                continue; // probability ~2⁻³⁸⁴; as ECDSA says, take another k
            }
            let f = &self.field;
            let k_inv = f.invert(&f.to_mont(&from_be(k)));
            let r_d = mont_mul(&f.to_mont(&r), &self.d);
            return Ok(Presig {
                r: to_be(&r),
                k_inv,
                k_inv_r_d: mont_mul(&k_inv, &r_d),
            });
        }
    }

    /// Sign `msg` (ECDSA P-384 with SHA-384) with a presigned nonce: `r ‖ s` big-endian (as
    /// aws-lc's fixed-length signatures are), or
    /// `None` when the pool is empty (or `s` came out 0, with probability ~2⁻³⁸⁴) and the
    /// caller signs the ordinary way. Each nonce is used once.
    pub(crate) fn sign(&self, msg: &[u8]) -> Option<[u8; 96]> {
        let p = self.pool.lock().ok()?.pop()?;
        let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA384, msg);
        let z: &[u8; 48] = digest.as_ref().try_into().ok()?;
        let f = &self.field;
        let s = demont(&add_mod(
            &mont_mul(&p.k_inv, &f.to_mont(&from_be(z))),
            &p.k_inv_r_d,
        ));
        if s == [0; 6] {
            return None;
        }
        let mut rs = [0u8; 96];
        rs[..48].copy_from_slice(&p.r);
        rs[48..].copy_from_slice(&to_be(&s));
        Some(rs)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use aws_lc_rs::signature::{
        ECDSA_P384_SHA384_FIXED, ECDSA_P384_SHA384_FIXED_SIGNING, EcdsaKeyPair, KeyPair,
        UnparsedPublicKey,
    };

    #[test]
    fn montgomery_constants() {
        assert_eq!(N[0].wrapping_mul(N_INV), u64::MAX); // n·(−n⁻¹) ≡ −1
        let f = Field::new();
        let seven = f.to_mont(&[7, 0, 0, 0, 0, 0]);
        assert_eq!(demont(&seven), [7, 0, 0, 0, 0, 0]);
        let inv = f.invert(&seven);
        assert_eq!(demont(&mont_mul(&inv, &seven)), [1, 0, 0, 0, 0, 0]);
        // n − 1 ≡ −1: (−1)² = 1.
        let mut m1 = N;
        m1[0] -= 1;
        let m1 = f.to_mont(&m1);
        assert_eq!(demont(&mont_mul(&m1, &m1)), [1, 0, 0, 0, 0, 0]);
        assert_eq!(from_be(&to_be(&N)), [0; 6]);
    }

    #[test]
    fn presigned_signatures_verify_and_use_each_nonce_once() {
        let key = EcdsaKeyPair::generate(&ECDSA_P384_SHA384_FIXED_SIGNING).unwrap();
        let d: EcPrivateKeyBin<'static> = key.private_key().as_be_bytes().unwrap();
        let pool = Presigned::new(d.as_ref().try_into().unwrap());
        pool.fill(20, 2).unwrap();
        assert_eq!(pool.ready(), 20);
        let vk = UnparsedPublicKey::new(&ECDSA_P384_SHA384_FIXED, key.public_key().as_ref());
        let mut rs = std::collections::HashSet::new();
        for i in 0..20u8 {
            let msg = [i; 100];
            let sig = pool.sign(&msg).unwrap();
            vk.verify(&msg, &sig).unwrap();
            // The signature is over this message only.
            assert!(vk.verify(&[i ^ 1; 100], &sig).is_err());
            assert!(rs.insert(sig[..48].to_vec()), "a nonce was used twice");
        }
        assert_eq!(pool.ready(), 0);
        assert!(pool.sign(b"more").is_none());
    }
}
