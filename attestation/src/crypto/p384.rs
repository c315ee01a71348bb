//! P-384 arithmetic, and ECDSA P-384/SHA-384 verification under a key with precomputed tables.
//!
//! Why: a verifier in a marketplace checks many signatures under few keys — every SNP report
//! of a chip is signed by its VCEK, every SPDM measurement of a GPU by its device key — and
//! the chains behind those keys are cached ([`crate::cache`]), so each key is prepared once and
//! used thousands of times. ECDSA verification computes `u1·G + u2·Q`. A generic
//! double-scalar multiplication (aws-lc's) takes ~384 doublings and ~100 additions; with tables
//! of `j·2^(w·i)·P` for every digit position `i` of a signed base-2^w recoding it takes one
//! mixed addition per digit and no doublings: 49 for `G` (w = 8, built once per process) plus
//! 65 for `Q` (w = 6, built when the key is prepared). `cgx bench verify` compares the two.
//!
//! Verification handles public data only (key, message, signature), so this arithmetic is
//! variable-time: no production secret may pass through it. (The simulator's presigning,
//! `sim/presign.rs`, uses the scalar field for its stand-in AMD-SP key: simulator only.)
//! Tests check it against aws-lc: key generation, signatures that verify, tampered and
//! out-of-range ones that must not, and a signature whose `x(R)` exceeds the order.
//!
//! Curve: SEC 2 v2 §2.5.1 / FIPS 186-5 (`secp384r1`): `y² = x³ − 3x + b` over `p`, order `n`.

// Carry chains walk two or three limb arrays in step; an index says that most plainly.
#![allow(clippy::needless_range_loop)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};

/// A residue as little-endian 64-bit limbs.
pub(crate) type Limbs = [u64; 6];

/// An odd 384-bit modulus and its Montgomery constants (`R = 2³⁸⁴`).
#[derive(Debug)]
pub(crate) struct Modulus {
    pub(crate) m: Limbs,
    /// −m⁻¹ mod 2⁶⁴.
    inv: u64,
    /// R² mod m: `mul(a, r2)` takes `a` into Montgomery form.
    r2: Limbs,
    /// R mod m: 1 in Montgomery form.
    pub(crate) one: Limbs,
}

/// The base field: p = 2³⁸⁴ − 2¹²⁸ − 2⁹⁶ + 2³² − 1.
pub(crate) const FIELD: Modulus = Modulus::new([
    0x0000_0000_FFFF_FFFF,
    0xFFFF_FFFF_0000_0000,
    0xFFFF_FFFF_FFFF_FFFE,
    0xFFFF_FFFF_FFFF_FFFF,
    0xFFFF_FFFF_FFFF_FFFF,
    0xFFFF_FFFF_FFFF_FFFF,
]);

/// The group order n: the scalar field.
pub(crate) const ORDER: Modulus = Modulus::new([
    0xECEC_196A_CCC5_2973,
    0x581A_0DB2_48B0_A77A,
    0xC763_4D81_F437_2DDF,
    0xFFFF_FFFF_FFFF_FFFF,
    0xFFFF_FFFF_FFFF_FFFF,
    0xFFFF_FFFF_FFFF_FFFF,
]);

/// The curve coefficient b, big-endian.
const B: [u8; 48] = hex48(
    "b3312fa7e23ee7e4988e056be3f82d19181d9c6efe8141120314088f5013875ac656398d8a2ed19d2a85c8edd3ec2aef",
);
/// The base point G, big-endian coordinates.
const GX: [u8; 48] = hex48(
    "aa87ca22be8b05378eb1c71ef320ad746e1d3b628ba79b9859f741e082542a385502f25dbf55296c3a545e3872760ab7",
);
const GY: [u8; 48] = hex48(
    "3617de4a96262c6f5d9e98bf9292dc29f8f41dbd289a147ce9da3113b5f0b8c00a60b1ce1d7e819d7a431d7c90ea0e5f",
);

/// Evaluated only for the constants above, at compile time: a bad digit fails the build.
#[allow(clippy::panic)]
const fn hex48(s: &str) -> [u8; 48] {
    const fn nibble(c: u8) -> u8 {
        match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => panic!("not lower-case hex"),
        }
    }
    let s = s.as_bytes();
    assert!(s.len() == 96);
    let mut out = [0u8; 48];
    let mut i = 0;
    while i < 48 {
        out[i] = (nibble(s[2 * i]) << 4) | nibble(s[2 * i + 1]);
        i += 1;
    }
    out
}

/// A big-endian 48-byte integer as limbs (not reduced).
pub(crate) const fn from_be(bytes: &[u8; 48]) -> Limbs {
    let mut l = [0u64; 6];
    let mut i = 0;
    while i < 6 {
        let mut w = 0u64;
        let mut j = 0;
        while j < 8 {
            w = (w << 8) | bytes[48 - 8 * (i + 1) + j] as u64;
            j += 1;
        }
        l[i] = w;
        i += 1;
    }
    l
}

#[cfg(any(feature = "sim", test))]
pub(crate) fn to_be(l: &Limbs) -> [u8; 48] {
    let mut out = [0u8; 48];
    for (i, limb) in l.iter().enumerate() {
        out[48 - 8 * (i + 1)..48 - 8 * i].copy_from_slice(&limb.to_be_bytes());
    }
    out
}

pub(crate) fn is_zero(a: &Limbs) -> bool {
    a.iter().all(|&l| l == 0)
}

/// `a < b`.
pub(crate) fn less(a: &Limbs, b: &Limbs) -> bool {
    for i in (0..6).rev() {
        if a[i] != b[i] {
            return a[i] < b[i];
        }
    }
    false
}

impl Modulus {
    const fn new(m: Limbs) -> Self {
        // Newton's iteration doubles the correct low bits of m⁻¹ mod 2⁶⁴: 1 → 64 in 6 steps.
        let mut inv: u64 = 1;
        let mut i = 0;
        while i < 6 {
            inv = inv.wrapping_mul(2u64.wrapping_sub(m[0].wrapping_mul(inv)));
            i += 1;
        }
        let mut md = Modulus {
            m,
            inv: inv.wrapping_neg(),
            r2: [0; 6],
            one: [0; 6],
        };
        // R² mod m by doubling 1 768 times (compile time).
        let mut x: Limbs = [1, 0, 0, 0, 0, 0];
        let mut k = 0;
        while k < 768 {
            x = md.add(&x, &x);
            k += 1;
        }
        md.r2 = x;
        md.one = md.mul(&[1, 0, 0, 0, 0, 0], &md.r2);
        md
    }

    /// `a − m` if `a ≥ m` (with `carry` as a 385th bit), else `a`.
    const fn reduce_once(&self, a: Limbs, carry: u64) -> Limbs {
        let (d, borrow) = sub_borrow(&a, &self.m);
        if carry == 1 || borrow == 0 { d } else { a }
    }

    /// `a mod m` for any 384-bit `a` (one subtraction suffices: m > 2³⁸³).
    pub(crate) const fn reduce(&self, a: &Limbs) -> Limbs {
        self.reduce_once(*a, 0)
    }

    /// `a + b mod m`, for `a, b < m`.
    pub(crate) const fn add(&self, a: &Limbs, b: &Limbs) -> Limbs {
        let (s, carry) = add_carry(a, b);
        self.reduce_once(s, carry)
    }

    /// `a − b mod m`, for `a, b < m`.
    pub(crate) fn sub(&self, a: &Limbs, b: &Limbs) -> Limbs {
        match sub_borrow(a, b) {
            (d, 0) => d,
            (d, _) => add_carry(&d, &self.m).0, // the carry out cancels the borrow
        }
    }

    pub(crate) fn neg(&self, a: &Limbs) -> Limbs {
        self.sub(&[0; 6], a)
    }

    /// Montgomery product `a·b·R⁻¹ mod m` (CIOS), for `a, b < m`.
    pub(crate) const fn mul(&self, a: &Limbs, b: &Limbs) -> Limbs {
        let mut t = [0u64; 8];
        let mut i = 0;
        while i < 6 {
            let bi = b[i] as u128;
            let mut c = 0u128;
            let mut j = 0;
            while j < 6 {
                let s = t[j] as u128 + (a[j] as u128) * bi + c;
                t[j] = s as u64;
                c = s >> 64;
                j += 1;
            }
            let s = t[6] as u128 + c;
            t[6] = s as u64;
            t[7] = (s >> 64) as u64;
            let q = t[0].wrapping_mul(self.inv) as u128;
            let s = t[0] as u128 + q * (self.m[0] as u128);
            let mut c = s >> 64;
            let mut j = 1;
            while j < 6 {
                let s = t[j] as u128 + q * (self.m[j] as u128) + c;
                t[j - 1] = s as u64;
                c = s >> 64;
                j += 1;
            }
            let s = t[6] as u128 + c;
            t[5] = s as u64;
            t[6] = t[7] + (s >> 64) as u64;
            t[7] = 0;
            i += 1;
        }
        self.reduce_once([t[0], t[1], t[2], t[3], t[4], t[5]], t[6])
    }

    pub(crate) fn sqr(&self, a: &Limbs) -> Limbs {
        self.mul(a, a)
    }

    pub(crate) fn to_mont(&self, a: &Limbs) -> Limbs {
        self.mul(a, &self.r2)
    }

    #[cfg(any(feature = "sim", test))]
    pub(crate) fn demont(&self, a: &Limbs) -> Limbs {
        self.mul(a, &[1, 0, 0, 0, 0, 0])
    }

    /// `a⁻¹` in Montgomery form, for `a ≠ 0` in Montgomery form: `a^(m−2)` (Fermat; both
    /// moduli are prime).
    pub(crate) fn invert(&self, a: &Limbs) -> Limbs {
        let mut e = self.m;
        e[0] -= 2; // both moduli are odd with a low limb far above 2: no borrow
        self.pow(a, &e)
    }

    /// `a⁻¹` for a plain residue `0 < a < m` (`0` for `a = 0`), by the binary extended
    /// Euclidean algorithm: variable-time, several times faster than [`Modulus::invert`],
    /// for public values only (a signature's `s`).
    pub(crate) fn invert_vartime(&self, a: &Limbs) -> Limbs {
        const ONE: Limbs = [1, 0, 0, 0, 0, 0];
        if is_zero(a) || !less(a, &self.m) {
            return [0; 6];
        }
        // Invariants: x1·a ≡ u and x2·a ≡ v (mod m); gcd(u, v) = gcd(a, m) = 1 throughout, so
        // neither reaches 0 and one of them reaches 1.
        let (mut u, mut v) = (*a, self.m);
        let (mut x1, mut x2) = (ONE, [0; 6]);
        while u != ONE && v != ONE {
            while u[0] & 1 == 0 {
                shr1(&mut u, 0);
                self.halve(&mut x1);
            }
            while v[0] & 1 == 0 {
                shr1(&mut v, 0);
                self.halve(&mut x2);
            }
            if less(&u, &v) {
                v = sub_borrow(&v, &u).0;
                x2 = self.sub(&x2, &x1);
            } else {
                u = sub_borrow(&u, &v).0;
                x1 = self.sub(&x1, &x2);
            }
        }
        if u == ONE { x1 } else { x2 }
    }

    /// `x/2 mod m`.
    fn halve(&self, x: &mut Limbs) {
        if x[0] & 1 == 0 {
            shr1(x, 0);
            return;
        }
        let (sum, carry) = add_carry(x, &self.m);
        *x = sum;
        shr1(x, carry);
    }

    /// `a^e` in Montgomery form, four exponent bits per multiplication.
    pub(crate) fn pow(&self, a: &Limbs, e: &Limbs) -> Limbs {
        let mut powers = [self.one; 16];
        for i in 1..16 {
            powers[i] = self.mul(&powers[i - 1], a);
        }
        let mut acc = self.one;
        for limb in e.iter().rev() {
            for nib in (0..16).rev() {
                for _ in 0..4 {
                    acc = self.sqr(&acc);
                }
                let d = ((limb >> (4 * nib)) & 15) as usize;
                if d != 0 {
                    acc = self.mul(&acc, &powers[d]);
                }
            }
        }
        acc
    }
}

/// `a >> 1`, shifting `top` (0 or 1) into bit 383.
fn shr1(a: &mut Limbs, top: u64) {
    for i in 0..5 {
        a[i] = (a[i] >> 1) | (a[i + 1] << 63);
    }
    a[5] = (a[5] >> 1) | (top << 63);
}

/// `a + b` and the carry out of bit 383.
const fn add_carry(a: &Limbs, b: &Limbs) -> (Limbs, u64) {
    let mut s = [0u64; 6];
    let mut carry = 0u64;
    let mut i = 0;
    while i < 6 {
        let (x, c1) = a[i].overflowing_add(b[i]);
        let (x, c2) = x.overflowing_add(carry);
        s[i] = x;
        carry = (c1 | c2) as u64;
        i += 1;
    }
    (s, carry)
}

/// `a − b` (mod 2³⁸⁴) and the borrow out of bit 383.
const fn sub_borrow(a: &Limbs, b: &Limbs) -> (Limbs, u64) {
    let mut d = [0u64; 6];
    let mut borrow = 0u64;
    let mut i = 0;
    while i < 6 {
        let (x, b1) = a[i].overflowing_sub(b[i]);
        let (x, b2) = x.overflowing_sub(borrow);
        d[i] = x;
        borrow = (b1 | b2) as u64;
        i += 1;
    }
    (d, borrow)
}

// ------------------------------------------------------------------------------------ points

/// An affine point, coordinates in Montgomery form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Affine {
    x: Limbs,
    y: Limbs,
}

/// A Jacobian point `(X/Z², Y/Z³)`, Montgomery form; `Z = 0` is the point at infinity.
#[derive(Debug, Clone, Copy)]
struct Jacobian {
    x: Limbs,
    y: Limbs,
    z: Limbs,
}

const INFINITY: Jacobian = Jacobian {
    x: [0; 6],
    y: [0; 6],
    z: [0; 6],
};

const F: &Modulus = &FIELD;

impl Affine {
    /// From big-endian coordinates, if both are below p and the point is on the curve.
    fn from_be(x: &[u8; 48], y: &[u8; 48]) -> Option<Affine> {
        let (x, y) = (from_be(x), from_be(y));
        if !less(&x, &F.m) || !less(&y, &F.m) {
            return None;
        }
        let p = Affine {
            x: F.to_mont(&x),
            y: F.to_mont(&y),
        };
        p.on_curve().then_some(p)
    }

    /// `y² = x³ − 3x + b`.
    fn on_curve(&self) -> bool {
        let b = F.to_mont(&from_be(&B));
        let x3 = F.mul(&F.sqr(&self.x), &self.x);
        let three_x = F.add(&F.add(&self.x, &self.x), &self.x);
        F.sqr(&self.y) == F.add(&F.sub(&x3, &three_x), &b)
    }

    fn neg(&self) -> Affine {
        Affine {
            x: self.x,
            y: F.neg(&self.y),
        }
    }

    fn to_jacobian(self) -> Jacobian {
        Jacobian {
            x: self.x,
            y: self.y,
            z: F.one,
        }
    }
}

impl Jacobian {
    fn is_infinity(&self) -> bool {
        is_zero(&self.z)
    }

    /// `2P` (dbl-2001-b, a = −3).
    fn double(&self) -> Jacobian {
        if self.is_infinity() {
            return *self;
        }
        let delta = F.sqr(&self.z);
        let gamma = F.sqr(&self.y);
        let beta = F.mul(&self.x, &gamma);
        let t = F.mul(&F.sub(&self.x, &delta), &F.add(&self.x, &delta));
        let alpha = F.add(&F.add(&t, &t), &t);
        let beta2 = F.add(&beta, &beta);
        let beta4 = F.add(&beta2, &beta2);
        let beta8 = F.add(&beta4, &beta4);
        let x = F.sub(&F.sqr(&alpha), &beta8);
        let yz = F.add(&self.y, &self.z);
        let z = F.sub(&F.sub(&F.sqr(&yz), &gamma), &delta);
        let gamma_sq = F.sqr(&gamma);
        let gamma_sq2 = F.add(&gamma_sq, &gamma_sq);
        let gamma_sq4 = F.add(&gamma_sq2, &gamma_sq2);
        let gamma_sq8 = F.add(&gamma_sq4, &gamma_sq4);
        let y = F.sub(&F.mul(&alpha, &F.sub(&beta4, &x)), &gamma_sq8);
        // A point of order 2 would give z = 0 (infinity); P-384 has none (prime order).
        Jacobian { x, y, z }
    }

    /// `P + Q` for an affine `Q` (8M + 3S), with the doubling and `P = −Q` cases.
    fn add_affine(&self, q: &Affine) -> Jacobian {
        if self.is_infinity() {
            #[cfg(test)]
            tests::rare(2);
            return q.to_jacobian();
        }
        let z1z1 = F.sqr(&self.z);
        let u2 = F.mul(&q.x, &z1z1);
        let s2 = F.mul(&q.y, &F.mul(&self.z, &z1z1));
        let h = F.sub(&u2, &self.x);
        let r = F.sub(&s2, &self.y);
        if is_zero(&h) {
            #[cfg(test)]
            tests::rare(usize::from(!is_zero(&r)));
            return if is_zero(&r) { self.double() } else { INFINITY };
        }
        let hh = F.sqr(&h);
        let hhh = F.mul(&h, &hh);
        let v = F.mul(&self.x, &hh);
        let x = F.sub(&F.sub(&F.sub(&F.sqr(&r), &hhh), &v), &v);
        let y = F.sub(&F.mul(&r, &F.sub(&v, &x)), &F.mul(&self.y, &hhh));
        let z = F.mul(&self.z, &h);
        Jacobian { x, y, z }
    }

    /// `P + Q` (Jacobian both), with the doubling and `P = −Q` cases.
    fn add(&self, q: &Jacobian) -> Jacobian {
        if self.is_infinity() {
            return *q;
        }
        if q.is_infinity() {
            return *self;
        }
        let z1z1 = F.sqr(&self.z);
        let z2z2 = F.sqr(&q.z);
        let u1 = F.mul(&self.x, &z2z2);
        let u2 = F.mul(&q.x, &z1z1);
        let s1 = F.mul(&self.y, &F.mul(&q.z, &z2z2));
        let s2 = F.mul(&q.y, &F.mul(&self.z, &z1z1));
        let h = F.sub(&u2, &u1);
        let r = F.sub(&s2, &s1);
        if is_zero(&h) {
            return if is_zero(&r) { self.double() } else { INFINITY };
        }
        let hh = F.sqr(&h);
        let hhh = F.mul(&h, &hh);
        let v = F.mul(&u1, &hh);
        let x = F.sub(&F.sub(&F.sub(&F.sqr(&r), &hhh), &v), &v);
        let y = F.sub(&F.mul(&r, &F.sub(&v, &x)), &F.mul(&s1, &hhh));
        let z = F.mul(&F.mul(&self.z, &q.z), &h);
        Jacobian { x, y, z }
    }
}

/// Jacobian points to affine with one inversion (Montgomery's trick); `None` if any is the
/// point at infinity.
fn normalize(points: &[Jacobian]) -> Option<Vec<Affine>> {
    let mut prefix = Vec::with_capacity(points.len());
    let mut acc = F.one;
    for p in points {
        if p.is_infinity() {
            return None;
        }
        acc = F.mul(&acc, &p.z);
        prefix.push(acc);
    }
    let mut inv = F.invert(&acc);
    let mut out = vec![
        Affine {
            x: [0; 6],
            y: [0; 6]
        };
        points.len()
    ];
    for i in (0..points.len()).rev() {
        let z_inv = if i == 0 {
            inv
        } else {
            F.mul(&inv, &prefix[i - 1])
        };
        inv = F.mul(&inv, &points[i].z);
        let z2 = F.sqr(&z_inv);
        out[i] = Affine {
            x: F.mul(&points[i].x, &z2),
            y: F.mul(&points[i].y, &F.mul(&z2, &z_inv)),
        };
    }
    Some(out)
}

// ------------------------------------------------------------------------------------ tables

/// `j·2^(w·i)·P` for every digit position `i` and `j = 1..=2^(w−1)`: a scalar's signed
/// base-2^w digits pick one entry (or its negation) each, and their sum is the product.
#[derive(Debug)]
struct Table {
    w: u32,
    points: Vec<Affine>,
}

impl Table {
    fn positions(w: u32) -> usize {
        // One position more than 384/w rounds up to: the recoding's last carry lands there.
        385usize.div_ceil(w as usize)
    }

    fn per_position(w: u32) -> usize {
        1 << (w - 1)
    }

    fn bytes(w: u32) -> usize {
        Self::positions(w) * Self::per_position(w) * std::mem::size_of::<Affine>()
    }

    fn build(p: &Affine, w: u32) -> Option<Table> {
        let per = Self::per_position(w);
        let mut jac = Vec::with_capacity(Self::positions(w) * per);
        let mut base = p.to_jacobian();
        for _ in 0..Self::positions(w) {
            let mut acc = base;
            jac.push(acc);
            for _ in 1..per {
                acc = acc.add(&base);
                jac.push(acc);
            }
            base = acc.double(); // 2·2^(w−1)·B = 2^w·B, the next position's base
        }
        Some(Table {
            w,
            points: normalize(&jac)?,
        })
    }

    /// Add `k·P` to `acc`, for `k < 2³⁸⁴`.
    fn accumulate(&self, mut acc: Jacobian, k: &Limbs) -> Jacobian {
        let per = Self::per_position(self.w);
        let full = 1i64 << self.w;
        let mut carry = 0i64;
        for i in 0..Self::positions(self.w) {
            let d = window(k, i * self.w as usize, self.w) as i64 + carry;
            let d = if d >= full / 2 {
                carry = 1;
                d - full
            } else {
                carry = 0;
                d
            };
            if d != 0 {
                let entry = &self.points[i * per + d.unsigned_abs() as usize - 1];
                acc = if d > 0 {
                    acc.add_affine(entry)
                } else {
                    acc.add_affine(&entry.neg())
                };
            }
        }
        acc
    }
}

/// `w` bits of `k` from bit `at` (bits past 384 read as 0).
fn window(k: &Limbs, at: usize, w: u32) -> u64 {
    let (limb, shift) = (at / 64, at % 64);
    if limb >= 6 {
        return 0;
    }
    let mut v = k[limb] >> shift;
    if shift + w as usize > 64 && limb + 1 < 6 {
        v |= k[limb + 1] << (64 - shift);
    }
    v & ((1u64 << w) - 1)
}

/// Window of the per-key tables: 65 additions per verification, 200 KB per key.
const KEY_WINDOW: u32 = 6;
/// Window of the base point's table: 49 additions, 600 KB, once per process.
const BASE_WINDOW: u32 = 8;
/// Per-key tables live at most this many bytes together; keys prepared past it verify the
/// generic way (aws-lc), so a verifier that sees very many devices stays bounded.
const TABLE_BUDGET: usize = 64 << 20;

static TABLE_BYTES: AtomicUsize = AtomicUsize::new(0);

/// Tables by public key (`x ‖ y`), shared by every prepared key for that point: one device's
/// key cached under several chains (or prepared again by another verifier) costs one table and
/// one share of the budget. Dead entries are swept when the map grows past what the budget
/// could keep alive.
static SHARED: LazyLock<Mutex<HashMap<[u8; 96], Weak<Shared>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Verifications made with tables, process-wide (tests check that a key kept its tables).
#[cfg(feature = "test-support")]
static TABLE_VERIFICATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Number of P-384 verifications made through precomputed tables in this process.
#[cfg(feature = "test-support")]
pub fn table_verifications() -> u64 {
    TABLE_VERIFICATIONS.load(Ordering::Relaxed)
}

static BASE: LazyLock<Option<Table>> =
    LazyLock::new(|| Table::build(&Affine::from_be(&GX, &GY)?, BASE_WINDOW));

/// One point's tables and the meter they are counted in (given back when the last key using
/// them is dropped).
#[derive(Debug)]
struct Shared {
    table: Table,
    meter: &'static AtomicUsize,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.meter
            .fetch_sub(Table::bytes(self.table.w), Ordering::AcqRel);
    }
}

/// A P-384 public key with its tables, for ECDSA P-384/SHA-384 with fixed `r ‖ s` signatures.
#[derive(Debug)]
pub(crate) struct TabledKey {
    shared: Arc<Shared>,
}

impl TabledKey {
    /// Tables for an uncompressed SEC1 point (`04 ‖ x ‖ y`), shared with any live key for the
    /// same point; `None` when the point is not on the curve or the table budget is spent (the
    /// caller verifies the generic way).
    pub(crate) fn new(sec1: &[u8]) -> Option<TabledKey> {
        let point = sec1
            .strip_prefix(&[0x04])
            .and_then(|p| <[u8; 96]>::try_from(p).ok())?;
        if let Some(shared) = SHARED
            .lock()
            .ok()
            .and_then(|m| m.get(&point).and_then(Weak::upgrade))
        {
            return Some(TabledKey { shared });
        }
        // Built outside the lock (milliseconds); two threads racing on one new point may both
        // build, and the map keeps the later one — both within the budget.
        let key = Self::metered(sec1, &TABLE_BYTES, TABLE_BUDGET)?;
        if let Ok(mut m) = SHARED.lock() {
            if m.len() >= 2 * (TABLE_BUDGET / Table::bytes(KEY_WINDOW)).max(1) {
                m.retain(|_, w| w.strong_count() > 0);
            }
            m.insert(point, Arc::downgrade(&key.shared));
        }
        Some(key)
    }

    pub(super) fn metered(
        sec1: &[u8],
        meter: &'static AtomicUsize,
        budget: usize,
    ) -> Option<TabledKey> {
        let (0x04, Some(x), Some(y)) = (
            *sec1.first()?,
            sec1.get(1..49).and_then(|x| <&[u8; 48]>::try_from(x).ok()),
            sec1.get(49..).and_then(|y| <&[u8; 48]>::try_from(y).ok()),
        ) else {
            return None;
        };
        let q = Affine::from_be(x, y)?;
        BASE.as_ref()?;
        let size = Table::bytes(KEY_WINDOW);
        meter
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used + size <= budget).then_some(used + size)
            })
            .ok()?;
        match Table::build(&q, KEY_WINDOW) {
            Some(table) => Some(TabledKey {
                shared: Arc::new(Shared { table, meter }),
            }),
            None => {
                meter.fetch_sub(size, Ordering::AcqRel);
                None
            }
        }
    }

    /// ECDSA verification (FIPS 186-5 §6.4.2) of `sig = r ‖ s` over `msg`.
    pub(crate) fn verify(&self, msg: &[u8], sig: &[u8]) -> bool {
        #[cfg(feature = "test-support")]
        TABLE_VERIFICATIONS.fetch_add(1, Ordering::Relaxed);
        let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA384, msg);
        <&[u8; 48]>::try_from(digest.as_ref()).is_ok_and(|e| self.verify_digest(e, sig))
    }

    /// [`Self::verify`] over a SHA-384 digest `e` (the tests choose digests that drive the
    /// table walk into its rare branches).
    fn verify_digest(&self, e: &[u8; 48], sig: &[u8]) -> bool {
        let (Some(r), Some(s)) = (
            sig.get(..48).and_then(|r| <&[u8; 48]>::try_from(r).ok()),
            sig.get(48..).and_then(|s| <&[u8; 48]>::try_from(s).ok()),
        ) else {
            return false;
        };
        let (r, s) = (from_be(r), from_be(s));
        let n = &ORDER;
        if is_zero(&r) || is_zero(&s) || !less(&r, &n.m) || !less(&s, &n.m) {
            return false;
        }
        let z = n.reduce(&from_be(e));
        // w = s⁻¹, taken into Montgomery form: a product of a plain residue with it is plain.
        let w = n.to_mont(&n.invert_vartime(&s));
        let u1 = n.mul(&z, &w);
        let u2 = n.mul(&r, &w);
        let Some(base) = BASE.as_ref() else {
            return false;
        };
        let sum = self
            .shared
            .table
            .accumulate(base.accumulate(INFINITY, &u1), &u2);
        if sum.is_infinity() {
            return false;
        }
        // x(R) = X/Z² ∈ [0, p) and p < 2n, so x(R) mod n = r means X = r·Z² or X = (r + n)·Z².
        let z2 = F.sqr(&sum.z);
        if F.mul(&F.to_mont(&r), &z2) == sum.x {
            return true;
        }
        let (rn, carry) = add_carry(&r, &n.m);
        carry == 0 && less(&rn, &F.m) && F.mul(&F.to_mont(&rn), &z2) == sum.x
    }
}

#[cfg(test)]
impl TabledKey {
    /// Whether two keys use the very same tables.
    fn shares_tables_with(&self, other: &TabledKey) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use aws_lc_rs::agreement::{ECDH_P384, PrivateKey};
    use aws_lc_rs::encoding::AsBigEndian;
    use aws_lc_rs::signature::{
        ECDSA_P384_SHA384_FIXED, ECDSA_P384_SHA384_FIXED_SIGNING, EcdsaKeyPair, KeyPair,
        UnparsedPublicKey,
    };

    thread_local! {
        /// Rare branches of `add_affine` taken on this thread: [doubling (P = Q), cancellation
        /// (P = −Q), addition to the point at infinity].
        static RARE: std::cell::Cell<[u32; 3]> = const { std::cell::Cell::new([0; 3]) };
    }

    pub(super) fn rare(which: usize) {
        RARE.with(|c| {
            let mut v = c.get();
            v[which] += 1;
            c.set(v);
        });
    }

    fn rare_taken<T>(f: impl FnOnce() -> T) -> (T, [u32; 3]) {
        RARE.with(|c| c.set([0; 3]));
        let out = f();
        (out, RARE.with(std::cell::Cell::get))
    }

    // Scalars mod n, as plain residues.
    fn nmul(a: &Limbs, b: &Limbs) -> Limbs {
        let n = &ORDER;
        n.demont(&n.mul(&n.to_mont(a), &n.to_mont(b)))
    }

    fn ninv(a: &Limbs) -> Limbs {
        let n = &ORDER;
        n.demont(&n.invert(&n.to_mont(a)))
    }

    fn random_scalar() -> Limbs {
        let mut b = [0u8; 48];
        aws_lc_rs::rand::fill(&mut b).unwrap();
        b[0] &= 0x7f; // below n
        from_be(&b)
    }

    /// `k·G`, affine, SEC1 uncompressed.
    fn times_g(k: &Limbs) -> Vec<u8> {
        affine_be(&BASE.as_ref().unwrap().accumulate(INFINITY, k))
    }

    /// The signed base-2^w digits the table walk reads from `k` (position, digit), the same
    /// recoding as [`Table::accumulate`], written out independently.
    fn signed_digits(k: &Limbs, w: u32) -> Vec<(usize, i64)> {
        let full = 1i64 << w;
        let mut carry = 0;
        let mut out = Vec::new();
        for i in 0..Table::positions(w) {
            let mut d = window(k, i * w as usize, w) as i64 + carry;
            carry = i64::from(d >= full / 2);
            if carry == 1 {
                d -= full;
            }
            if d != 0 {
                out.push((i, d));
            }
        }
        out
    }

    /// `d·2^(w·i)` mod n, for a signed digit.
    fn digit_value(i: usize, d: i64, w: u32) -> Limbs {
        let n = &ORDER;
        let mut v = n.reduce(&[d.unsigned_abs(), 0, 0, 0, 0, 0]);
        for _ in 0..i * w as usize {
            v = n.add(&v, &v);
        }
        if d < 0 { n.neg(&v) } else { v }
    }

    /// A valid signature (digest, r ‖ s) under key `d` whose verification computes exactly
    /// `u1 = z/s` and `u2 = r/s`, built backwards: R = (u1 + u2·d)·G, r = x(R) mod n,
    /// s = r/u2, z = u1·s. `None` when R is the point at infinity.
    fn signature_for(d: &Limbs, u1: &Limbs, u2: &Limbs) -> Option<([u8; 48], Vec<u8>)> {
        let n = &ORDER;
        let k = n.add(u1, &nmul(u2, d));
        let big_r = BASE.as_ref().unwrap().accumulate(INFINITY, &k);
        let big_r = normalize(&[big_r])?[0];
        let r = n.reduce(&F.demont(&big_r.x));
        let s = nmul(&r, &ninv(u2));
        let z = nmul(u1, &s);
        let mut sig = to_be(&r).to_vec();
        sig.extend_from_slice(&to_be(&s));
        Some((to_be(&z), sig))
    }

    fn aws_verify_digest(q: &[u8], z: &[u8; 48], sig: &[u8]) -> bool {
        let digest =
            aws_lc_rs::digest::Digest::import_less_safe(z, &aws_lc_rs::digest::SHA384).unwrap();
        UnparsedPublicKey::new(&ECDSA_P384_SHA384_FIXED, q)
            .verify_digest(&digest, sig)
            .is_ok()
    }

    /// The key walk's rare branches, forced: choose u2, read its signed digits, and pick u1
    /// from them and the key's discrete log d so that, when the walk reaches digit position i,
    /// the accumulator u1·G + (digits below i)·Q equals the table entry (doubling), or its
    /// negation (the sum is the point at infinity, and the walk continues from it). Every
    /// forced signature is valid; the tables and aws-lc must both accept it, and both refuse
    /// it with r or s changed.
    #[test]
    fn table_walk_doubling_and_cancellation_agree_with_aws_lc() {
        let n = &ORDER;
        let mut forced = [0u32; 3];
        for round in 0..6 {
            let d = random_scalar();
            let q = times_g(&d);
            let key = TabledKey::new(&q).unwrap();
            let u2 = random_scalar();
            let digits = signed_digits(&u2, KEY_WINDOW);
            // A position early, mid-walk and late.
            for &(at, digit) in [
                digits[1],
                digits[digits.len() / 2],
                digits[digits.len() - 2],
            ]
            .iter()
            {
                let below = digits
                    .iter()
                    .take_while(|(i, _)| *i < at)
                    .fold([0u64; 6], |acc, (i, dd)| {
                        n.add(&acc, &digit_value(*i, *dd, KEY_WINDOW))
                    });
                let entry = digit_value(at, digit, KEY_WINDOW);
                // acc = u1 + d·below (in units of G); entry = d·entry.
                let doubling = nmul(&d, &n.sub(&entry, &below));
                let cancelling = n.neg(&nmul(&d, &n.add(&entry, &below)));
                for (case, u1) in [(0, doubling), (1, cancelling)] {
                    // Doubling makes R = (2·entry + digits above)·Q, which is the point at
                    // infinity when the next digit is 1 and this one −32: no signature exists.
                    let Some((z, sig)) = signature_for(&d, &u1, &u2) else {
                        assert_eq!(case, 0, "cancelling leaves R = (digits above)·Q ≠ O");
                        continue;
                    };
                    let (ok, taken) = rare_taken(|| key.verify_digest(&z, &sig));
                    assert!(ok, "round {round} position {at} case {case}");
                    assert!(aws_verify_digest(&q, &z, &sig));
                    assert!(taken[case] >= 1, "case {case} at {at}: branches {taken:?}");
                    if case == 1 {
                        // After cancelling, the next digit is added to the point at infinity.
                        assert!(taken[2] >= 2, "{taken:?}");
                    }
                    for (k, v) in taken.iter().enumerate() {
                        forced[k] += v;
                    }
                    let mut bad = sig.clone();
                    bad[47] ^= 1;
                    assert!(!key.verify_digest(&z, &bad));
                    assert!(!aws_verify_digest(&q, &z, &bad));
                    let mut bad = sig.clone();
                    bad[95] ^= 2;
                    assert_eq!(key.verify_digest(&z, &bad), aws_verify_digest(&q, &z, &bad));
                }
            }
            // u1 = −u2·d: the whole sum is the point at infinity; both refuse.
            let u1 = n.neg(&nmul(&u2, &d));
            assert!(signature_for(&d, &u1, &u2).is_none());
        }
        assert!(forced[0] >= 12 && forced[1] >= 18, "{forced:?}");
    }

    /// A few thousand signatures, valid and mutated (s → n − s, r ↔ s, bit flips, r + n,
    /// other messages), verified by the tables and by aws-lc: the verdicts are equal.
    #[test]
    fn differential_against_aws_lc() {
        let rng = aws_lc_rs::rand::SystemRandom::new();
        let n_be = to_be(&ORDER.m);
        let (mut cases, mut accepted) = (0, 0);
        for round in 0..12 {
            let kp = EcdsaKeyPair::generate(&ECDSA_P384_SHA384_FIXED_SIGNING).unwrap();
            let pk = kp.public_key().as_ref().to_vec();
            let key = TabledKey::new(&pk).unwrap();
            let aws = UnparsedPublicKey::new(&ECDSA_P384_SHA384_FIXED, &pk);
            for i in 0..24u32 {
                let msg = format!("evidence {round}/{i}").into_bytes();
                let sig = kp.sign(&rng, &msg).unwrap().as_ref().to_vec();
                let s = from_be(sig[48..].try_into().unwrap());
                let mut variants = vec![sig.clone()];
                // s → n − s: the same signature's other half, which ECDSA accepts.
                let mut neg = sig.clone();
                neg[48..].copy_from_slice(&to_be(&ORDER.neg(&s)));
                variants.push(neg);
                let mut swapped = sig[48..].to_vec();
                swapped.extend_from_slice(&sig[..48]);
                variants.push(swapped);
                for bit in [
                    0usize,
                    5,
                    47 * 8 + 7,
                    48 * 8,
                    95 * 8 + 7,
                    (i as usize * 37) % 768,
                ] {
                    let mut v = sig.clone();
                    v[bit / 8] ^= 1 << (bit % 8);
                    variants.push(v);
                }
                let mut r_plus_n = sig.clone();
                let (rn, _) = add_carry(&from_be(sig[..48].try_into().unwrap()), &ORDER.m);
                r_plus_n[..48].copy_from_slice(&to_be(&rn));
                variants.push(r_plus_n);
                let mut s_is_n = sig.clone();
                s_is_n[48..].copy_from_slice(&n_be);
                variants.push(s_is_n);
                for v in &variants {
                    for m in [&msg[..], b"other"] {
                        let ours = key.verify(m, v);
                        assert_eq!(ours, aws.verify(m, v).is_ok(), "round {round} sig {i}");
                        cases += 1;
                        accepted += usize::from(ours);
                    }
                }
            }
        }
        // Valid and s → n − s, per signature.
        assert_eq!(accepted, 12 * 24 * 2);
        assert!(cases > 3000, "{cases}");
    }

    /// Past the table budget a key gets no tables and the provider verifies with aws-lc: the
    /// verdicts are those of the tables.
    #[test]
    fn budget_exhausted_fallback_agrees_with_the_tables() {
        use crate::crypto::{CryptoProvider, DEFAULT_PROVIDER, SigAlg};
        static EMPTY: AtomicUsize = AtomicUsize::new(0);
        let rng = aws_lc_rs::rand::SystemRandom::new();
        let kp = EcdsaKeyPair::generate(&ECDSA_P384_SHA384_FIXED_SIGNING).unwrap();
        let pk = kp.public_key().as_ref();
        assert!(
            TabledKey::metered(pk, &EMPTY, 0).is_none(),
            "no budget, no tables"
        );
        let tabled = TabledKey::new(pk).unwrap();
        let prepared = DEFAULT_PROVIDER
            .prepare(SigAlg::EcdsaP384Sha384Fixed, pk)
            .unwrap();
        // The provider's own path, with the budget spent.
        let generic = crate::crypto::prepare_with_tables(SigAlg::EcdsaP384Sha384Fixed, pk, |k| {
            TabledKey::metered(k, &EMPTY, 0)
        })
        .unwrap();
        assert_eq!(prepared.backend(), "cgx-p384-tables");
        assert_eq!(generic.backend(), "aws-lc-rs");
        for i in 0..64u32 {
            let msg = format!("m{i}").into_bytes();
            let mut sig = kp.sign(&rng, &msg).unwrap().as_ref().to_vec();
            if i % 2 == 1 {
                sig[(i as usize * 11) % 96] ^= 1 << (i % 8);
            }
            let t = tabled.verify(&msg, &sig);
            assert_eq!(t, generic.verify(&msg, &sig).is_ok());
            assert_eq!(t, prepared.verify(&msg, &sig).is_ok());
            assert_eq!(t, i % 2 == 0);
        }
    }

    fn affine_be(p: &Jacobian) -> Vec<u8> {
        let a = normalize(&[*p]).unwrap()[0];
        let mut out = vec![4u8];
        out.extend_from_slice(&to_be(&F.demont(&a.x)));
        out.extend_from_slice(&to_be(&F.demont(&a.y)));
        out
    }

    #[test]
    fn constants() {
        for md in [&FIELD, &ORDER] {
            assert_eq!(md.m[0].wrapping_mul(md.inv), u64::MAX); // m·(−m⁻¹) ≡ −1
            let seven = md.to_mont(&[7, 0, 0, 0, 0, 0]);
            assert_eq!(md.demont(&seven), [7, 0, 0, 0, 0, 0]);
            let inv = md.invert(&seven);
            assert_eq!(md.demont(&md.mul(&inv, &seven)), [1, 0, 0, 0, 0, 0]);
            let mut m1 = md.m;
            m1[0] -= 1; // m − 1 ≡ −1, and (−1)² = 1
            let m1 = md.to_mont(&m1);
            assert_eq!(md.demont(&md.sqr(&m1)), [1, 0, 0, 0, 0, 0]);
            assert_eq!(md.add(&m1, &md.one), [0; 6]);
            assert_eq!(md.sub(&[0; 6], &md.one), m1);
            assert_eq!(md.reduce(&md.m), [0; 6]);
        }
        assert!(Affine::from_be(&GX, &GY).is_some());
    }

    #[test]
    fn binary_and_fermat_inversions_agree() {
        let n = &ORDER;
        let mut nm1 = n.m;
        nm1[0] -= 1;
        let mut cases = vec![
            [1, 0, 0, 0, 0, 0],
            [2, 0, 0, 0, 0, 0],
            nm1,
            [0, 0, 0, 0, 0, 1 << 63],
        ];
        for i in 0..64u64 {
            let mut b = [0u8; 48];
            aws_lc_rs::rand::fill(&mut b).unwrap();
            b[0] >>= i % 8; // various lengths
            cases.push(n.reduce(&from_be(&b)));
        }
        for a in cases.into_iter().filter(|a| !is_zero(a)) {
            let fermat = n.demont(&n.invert(&n.to_mont(&a)));
            let binary = n.invert_vartime(&a);
            assert_eq!(binary, fermat);
            assert_eq!(
                n.demont(&n.mul(&n.to_mont(&a), &n.to_mont(&binary))),
                [1, 0, 0, 0, 0, 0]
            );
        }
        assert_eq!(n.invert_vartime(&[0; 6]), [0; 6]);
        assert_eq!(n.invert_vartime(&n.m), [0; 6]);
    }

    /// k·G through the tables equals aws-lc's public key for the private key k.
    #[test]
    fn base_table_matches_aws_lc_key_generation() {
        let base = BASE.as_ref().unwrap();
        for _ in 0..32 {
            let k = PrivateKey::generate(&ECDH_P384).unwrap();
            let d: aws_lc_rs::encoding::EcPrivateKeyBin = k.as_be_bytes().unwrap();
            let d = from_be(d.as_ref().try_into().unwrap());
            let ours = affine_be(&base.accumulate(INFINITY, &d));
            assert_eq!(ours, k.compute_public_key().unwrap().as_ref());
        }
        // d = 1 is G; n − 1 is −G; 2 is G + G through the doubling case of the addition.
        let g = Affine::from_be(&GX, &GY).unwrap();
        let one = base.accumulate(INFINITY, &[1, 0, 0, 0, 0, 0]);
        assert_eq!(normalize(&[one]).unwrap()[0], g);
        let mut nm1 = ORDER.m;
        nm1[0] -= 1;
        assert_eq!(
            normalize(&[base.accumulate(INFINITY, &nm1)]).unwrap()[0],
            g.neg()
        );
        let two = g.to_jacobian().add_affine(&g);
        assert_eq!(
            normalize(&[two]).unwrap(),
            normalize(&[g.to_jacobian().double()]).unwrap()
        );
        // G + (−G) is infinity; n·G too (the sum of (n−1)·G and G).
        assert!(g.to_jacobian().add_affine(&g.neg()).is_infinity());
        assert!(base.accumulate(INFINITY, &nm1).add_affine(&g).is_infinity());
    }

    #[test]
    fn signatures_verify_as_aws_lc_verifies_them() {
        let rng = aws_lc_rs::rand::SystemRandom::new();
        for round in 0..8 {
            let kp = EcdsaKeyPair::generate(&ECDSA_P384_SHA384_FIXED_SIGNING).unwrap();
            let pk = kp.public_key().as_ref().to_vec();
            let key = TabledKey::new(&pk).unwrap();
            let aws = UnparsedPublicKey::new(&ECDSA_P384_SHA384_FIXED, &pk);
            for i in 0..16u32 {
                let msg = format!("report {round}/{i}").into_bytes();
                let sig = kp.sign(&rng, &msg).unwrap().as_ref().to_vec();
                assert!(key.verify(&msg, &sig));
                assert!(aws.verify(&msg, &sig).is_ok());
                // Another message, a flipped bit anywhere in the signature, a truncation.
                assert!(!key.verify(b"another report", &sig));
                let mut bad = sig.clone();
                bad[(i as usize * 7) % 96] ^= 1 << (i % 8);
                assert_eq!(key.verify(&msg, &bad), aws.verify(&msg, &bad).is_ok());
                assert!(!key.verify(&msg, &bad));
                assert!(!key.verify(&msg, &sig[..95]));
            }
        }
    }

    #[test]
    fn out_of_range_signatures_and_keys_are_refused() {
        let rng = aws_lc_rs::rand::SystemRandom::new();
        let kp = EcdsaKeyPair::generate(&ECDSA_P384_SHA384_FIXED_SIGNING).unwrap();
        let pk = kp.public_key().as_ref().to_vec();
        let key = TabledKey::new(&pk).unwrap();
        let sig = kp.sign(&rng, b"m").unwrap().as_ref().to_vec();
        let n = to_be(&ORDER.m);
        // s + n encodes the same residue but is out of range; r = 0, s = 0 likewise.
        let mut high = sig.clone();
        high[48..].copy_from_slice(&n);
        assert!(!key.verify(b"m", &high));
        let mut zero_r = sig.clone();
        zero_r[..48].fill(0);
        assert!(!key.verify(b"m", &zero_r));
        let mut zero_s = sig.clone();
        zero_s[48..].fill(0);
        assert!(!key.verify(b"m", &zero_s));
        // Off-curve, wrongly tagged, compressed and short keys get no tables.
        let mut off = pk.clone();
        off[96] ^= 1;
        assert!(TabledKey::new(&off).is_none());
        let mut tag = pk.clone();
        tag[0] = 0x03;
        assert!(TabledKey::new(&tag).is_none());
        assert!(TabledKey::new(&pk[..49]).is_none());
        assert!(TabledKey::new(&[]).is_none());
    }

    #[test]
    fn tables_stay_within_their_budget() {
        static METER: AtomicUsize = AtomicUsize::new(0);
        let kp = EcdsaKeyPair::generate(&ECDSA_P384_SHA384_FIXED_SIGNING).unwrap();
        let pk = kp.public_key().as_ref();
        let one = Table::bytes(KEY_WINDOW);
        let a = TabledKey::metered(pk, &METER, 2 * one).unwrap();
        let b = TabledKey::metered(pk, &METER, 2 * one).unwrap();
        assert_eq!(METER.load(Ordering::Acquire), 2 * one);
        assert!(TabledKey::metered(pk, &METER, 2 * one).is_none());
        drop(a);
        let c = TabledKey::metered(pk, &METER, 2 * one).unwrap();
        drop((b, c));
        assert_eq!(METER.load(Ordering::Acquire), 0);
        // The provider prepares the same key (tables, within the process budget).
        use crate::crypto::{CryptoProvider, DEFAULT_PROVIDER, SigAlg};
        let prepared = DEFAULT_PROVIDER
            .prepare(SigAlg::EcdsaP384Sha384Fixed, pk)
            .unwrap();
        let sig = kp
            .sign(&aws_lc_rs::rand::SystemRandom::new(), b"m")
            .unwrap();
        assert!(prepared.verify(b"m", sig.as_ref()).is_ok());
        assert!(prepared.verify(b"n", sig.as_ref()).is_err());
    }

    /// One point prepared twice (a device's key under two chains, or a junk re-encoding of its
    /// certificate) shares one set of tables; a new point gets its own.
    #[test]
    fn one_point_has_one_table() {
        let kp = EcdsaKeyPair::generate(&ECDSA_P384_SHA384_FIXED_SIGNING).unwrap();
        let other = EcdsaKeyPair::generate(&ECDSA_P384_SHA384_FIXED_SIGNING).unwrap();
        let a = TabledKey::new(kp.public_key().as_ref()).unwrap();
        let b = TabledKey::new(kp.public_key().as_ref()).unwrap();
        let c = TabledKey::new(other.public_key().as_ref()).unwrap();
        assert!(a.shares_tables_with(&b));
        assert!(!a.shares_tables_with(&c));
        let sig = kp
            .sign(&aws_lc_rs::rand::SystemRandom::new(), b"m")
            .unwrap();
        assert!(b.verify(b"m", sig.as_ref()));
        // Once every key for the point is gone, a new one builds afresh.
        drop((a, b));
        let d = TabledKey::new(kp.public_key().as_ref()).unwrap();
        assert!(d.verify(b"m", sig.as_ref()));
    }

    /// x(R) ≥ n: the signature's r is x(R) − n, and only the `r + n` comparison accepts it.
    /// Random keys meet such an R with probability ~2⁻¹⁹⁰, so build one: a point R with
    /// x = n + t, a message, an s, and the key Q = r⁻¹·(s·R − z·G) that makes (r = t, s) its
    /// signature. aws-lc must agree that it verifies.
    #[test]
    fn x_coordinate_above_the_order_is_reduced() {
        let (f, n) = (&FIELD, &ORDER);
        let b = f.to_mont(&from_be(&B));
        // (p + 1)/4: p ≡ 3 (mod 4), so a square's root is its (p + 1)/4-th power.
        let mut e = f.m;
        e[0] += 1; // the low limb of p is 2³² − 1: no carry
        let e = [
            (e[0] >> 2) | (e[1] << 62),
            (e[1] >> 2) | (e[2] << 62),
            (e[2] >> 2) | (e[3] << 62),
            (e[3] >> 2) | (e[4] << 62),
            (e[4] >> 2) | (e[5] << 62),
            e[5] >> 2,
        ];
        let mut t = 1u64;
        let (r_point, r) = loop {
            let mut x = n.m;
            x[0] += t; // the low limb of n is far from 2⁶⁴
            let xm = f.to_mont(&x);
            let rhs = f.add(
                &f.sub(&f.mul(&f.sqr(&xm), &xm), &f.add(&f.add(&xm, &xm), &xm)),
                &b,
            );
            let y = f.pow(&rhs, &e);
            if f.sqr(&y) == rhs {
                break (Affine { x: xm, y }, [t, 0, 0, 0, 0, 0]);
            }
            t += 1;
        };
        assert!(r_point.on_curve());
        let msg = b"a report whose R lies above the order";
        let digest = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA384, msg);
        let z = n.reduce(&from_be(digest.as_ref().try_into().unwrap()));
        let s: Limbs = [0x1234_5678_9abc_def1, 7, 0, 0, 0, 0x0fff];
        // Q = r⁻¹·(s·R − z·G).
        let base = BASE.as_ref().unwrap();
        let s_r = Table::build(&r_point, 4).unwrap().accumulate(INFINITY, &s);
        let neg_z = n.sub(&[0; 6], &z);
        let p = base.accumulate(s_r, &neg_z);
        let r_inv = n.demont(&n.invert(&n.to_mont(&r)));
        let p = normalize(&[p]).unwrap()[0];
        let q = Table::build(&p, 4).unwrap().accumulate(INFINITY, &r_inv);
        let q = affine_be(&q);
        let mut sig = to_be(&r).to_vec();
        sig.extend_from_slice(&to_be(&s));
        let aws = UnparsedPublicKey::new(&ECDSA_P384_SHA384_FIXED, &q);
        assert!(
            aws.verify(msg, &sig).is_ok(),
            "aws-lc accepts the built signature"
        );
        let key = TabledKey::new(&q).unwrap();
        assert!(key.verify(msg, &sig));
        // r = x(R) itself (≥ n) is out of range; r + 1 is another residue.
        let mut wrong = sig.clone();
        wrong[..48].copy_from_slice(&to_be(&F.demont(&r_point.x)));
        assert!(!key.verify(msg, &wrong));
        let mut wrong = sig.clone();
        wrong[47] ^= 1;
        assert!(!key.verify(msg, &wrong));
        assert!(aws.verify(msg, &wrong).is_err());
    }
}
