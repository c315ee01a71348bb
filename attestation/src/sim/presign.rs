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

use crate::crypto::p384::{Limbs, ORDER, from_be, to_be};

/// One nonce's precomputation: `r`, and in Montgomery form `k⁻¹` and `k⁻¹·r·d`.
struct Presig {
    r: [u8; 48],
    k_inv: Limbs,
    k_inv_r_d: Limbs,
}

/// A pool of presigned nonces for one P-384 signing key.
pub(crate) struct Presigned {
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
        let d = ORDER.to_mont(&ORDER.reduce(&from_be(d)));
        Presigned {
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
            let r = ORDER.reduce(&from_be(x));
            if r == [0; 6] {
                continue; // probability ~2⁻³⁸⁴; as ECDSA says, take another k
            }
            let n = &ORDER;
            // Fermat, not the binary inversion, whose running time follows its input's bits.
            let k_inv = n.invert(&n.to_mont(&n.reduce(&from_be(k))));
            let r_d = n.mul(&n.to_mont(&r), &self.d);
            return Ok(Presig {
                r: to_be(&r),
                k_inv,
                k_inv_r_d: n.mul(&k_inv, &r_d),
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
        let n = &ORDER;
        let s = n.demont(&n.add(
            &n.mul(&p.k_inv, &n.to_mont(&n.reduce(&from_be(z)))),
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
