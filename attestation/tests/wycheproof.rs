#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Project Wycheproof's ECDSA P-384/SHA-384 vectors (vendored under `tests/data/wycheproof`)
//! through the production verification path: P1363 (`r ‖ s`, as SNP reports and SPDM sign)
//! through prepared keys — cgx's own precomputed-table code, asserted — and DER through
//! aws-lc-rs; then a differential run of signed and mutated signatures against aws-lc.

use cgx_attestation::crypto::{CryptoProvider, DEFAULT_PROVIDER, SigAlg};
use serde_json::Value;

const P1363: &str = include_str!("data/wycheproof/ecdsa_secp384r1_sha384_p1363_test.json");
const DER: &str = include_str!("data/wycheproof/ecdsa_secp384r1_sha384_test.json");

/// (tests run, of which valid) for one file; panics on the first disagreement.
fn run(file: &str, alg: SigAlg, want_backend: &str) -> (usize, usize) {
    let v: Value = serde_json::from_str(file).unwrap();
    let (mut ran, mut valid) = (0, 0);
    for group in v["testGroups"].as_array().unwrap() {
        let key = hex::decode(group["publicKey"]["uncompressed"].as_str().unwrap()).unwrap();
        let prepared = DEFAULT_PROVIDER.prepare(alg, &key);
        for t in group["tests"].as_array().unwrap() {
            let id = t["tcId"].as_u64().unwrap();
            let msg = hex::decode(t["msg"].as_str().unwrap()).unwrap();
            let sig = hex::decode(t["sig"].as_str().unwrap()).unwrap();
            let result = t["result"].as_str().unwrap();
            let ok = match &prepared {
                Ok(k) => {
                    assert_eq!(k.backend(), want_backend, "tcId {id}");
                    k.verify(&msg, &sig).is_ok()
                }
                Err(_) => false,
            };
            // The unprepared path must agree with the prepared one.
            assert_eq!(
                ok,
                DEFAULT_PROVIDER.verify(alg, &key, &msg, &sig).is_ok(),
                "tcId {id}: prepared and unprepared disagree ({})",
                t["comment"]
            );
            match result {
                "valid" => assert!(ok, "tcId {id} ({}) must verify", t["comment"]),
                "invalid" => assert!(!ok, "tcId {id} ({}) must be refused", t["comment"]),
                _ => {}
            }
            ran += 1;
            valid += usize::from(result == "valid");
        }
    }
    (ran, valid)
}

#[test]
fn wycheproof_p1363_through_the_p384_tables() {
    let (ran, valid) = run(P1363, SigAlg::EcdsaP384Sha384Fixed, "cgx-p384-tables");
    assert!(ran >= 270 && valid >= 100, "{ran} tests, {valid} valid");
}

#[test]
fn wycheproof_der_through_aws_lc() {
    let (ran, valid) = run(DER, SigAlg::EcdsaP384Sha384Der, "aws-lc-rs");
    assert!(ran >= 400 && valid >= 100, "{ran} tests, {valid} valid");
}

/// Signatures made by aws-lc under random keys, as made and mutated (a flipped bit in r, in s,
/// in the message; s → n − s), verified by the tables and by aws-lc: the verdicts agree.
#[test]
fn tables_agree_with_aws_lc_on_signed_and_mutated_signatures() {
    use aws_lc_rs::rand::SystemRandom;
    use aws_lc_rs::signature::{ECDSA_P384_SHA384_FIXED_SIGNING, EcdsaKeyPair, KeyPair};
    // n, the order of P-384's base point, big-endian.
    let n = hex::decode(
        "ffffffffffffffffffffffffffffffffffffffffffffffffc7634d81f4372ddf581a0db248b0a77aecec196accc52973",
    )
    .unwrap();
    let neg = |s: &[u8]| -> Vec<u8> {
        // n − s over 48 big-endian bytes.
        let mut out = vec![0u8; 48];
        let mut borrow = 0i32;
        for i in (0..48).rev() {
            let d = i32::from(n[i]) - i32::from(s[i]) - borrow;
            borrow = i32::from(d < 0);
            out[i] = (d + 256 * borrow) as u8;
        }
        out
    };
    let rng = SystemRandom::new();
    let mut compared = 0;
    for k in 0..12 {
        let doc = EcdsaKeyPair::generate_pkcs8(&ECDSA_P384_SHA384_FIXED_SIGNING, &rng).unwrap();
        let kp = EcdsaKeyPair::from_pkcs8(&ECDSA_P384_SHA384_FIXED_SIGNING, doc.as_ref()).unwrap();
        let public = kp.public_key().as_ref().to_vec();
        let tables = DEFAULT_PROVIDER
            .prepare(SigAlg::EcdsaP384Sha384Fixed, &public)
            .unwrap();
        assert_eq!(tables.backend(), "cgx-p384-tables");
        for m in 0..10u32 {
            let msg = format!("message {k}.{m}").into_bytes();
            let sig = kp.sign(&rng, &msg).unwrap().as_ref().to_vec();
            let mut cases: Vec<(Vec<u8>, Vec<u8>)> = vec![(msg.clone(), sig.clone())];
            let mut high_s = sig.clone();
            high_s[48..].copy_from_slice(&neg(&sig[48..]));
            cases.push((msg.clone(), high_s));
            for bit in [0usize, 7, 200, 383, 384, 500, 767] {
                let mut s = sig.clone();
                s[bit / 8] ^= 1 << (bit % 8);
                cases.push((msg.clone(), s));
            }
            let mut other = msg.clone();
            other[0] ^= 1;
            cases.push((other, sig.clone()));
            for (msg, sig) in cases {
                let by_tables = tables.verify(&msg, &sig).is_ok();
                let by_aws = DEFAULT_PROVIDER
                    .verify(SigAlg::EcdsaP384Sha384Fixed, &public, &msg, &sig)
                    .is_ok();
                assert_eq!(by_tables, by_aws, "key {k} message {m}");
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 12 * 10 * 10);
}
