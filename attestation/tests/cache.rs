#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The verifiers' caches under attack (issue 28, items 15 and 16): a cached SNP chain keeps
//! checking its CRLs' windows; junk re-encodings of one chain, public chains with junk reports,
//! trailing bytes and unused OCSP responses make no cache entries (or are refused); and after a
//! flood of them an honest node's verification costs what it did before: a cache hit, one
//! signature through its key's precomputed tables.
//!
//! The table-verification counter is process-wide: the tests here take turns.

use std::sync::Mutex;

use cgx_attestation::bundle::Bundle;
use cgx_attestation::sim::{SimAmd, SimGpu, SnpReportOptions, default_tcb};
use cgx_attestation::snp::{Product, SigningKey};
use cgx_attestation::{CacheStats, Error, SimTrust, Verifier, VerifierConfig};
use time::OffsetDateTime;

static SERIAL: Mutex<()> = Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn at(t: i64) -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp(t).unwrap()
}

fn stats(v: &Verifier, which: &str) -> CacheStats {
    v.cache_stats()
        .into_iter()
        .find(|(n, _)| *n == which)
        .unwrap()
        .1
}

fn chip() -> [u8; 64] {
    [0x5A; 64]
}

fn amd(t: i64) -> SimAmd {
    SimAmd::generate(
        Product::Milan,
        SigningKey::Vcek,
        default_tcb(Product::Milan),
        chip(),
        t,
    )
    .unwrap()
}

/// An SNP bundle's report, signing certificate, chain and CRLs, to tamper with.
type SnpParts<'a> = (
    &'a mut Vec<u8>,
    &'a mut Vec<u8>,
    &'a mut Vec<u8>,
    &'a mut Vec<Vec<u8>>,
);

fn snp_parts(b: &mut Bundle) -> SnpParts<'_> {
    let Bundle::Snp {
        report,
        signing_cert,
        cert_chain,
        crls,
        ..
    } = b
    else {
        panic!("not SNP")
    };
    (report, signing_cert, cert_chain, crls)
}

fn verify(v: &Verifier, b: &Bundle, t: i64) -> Result<(), Error> {
    v.verify(&b.evidence(), at(t)).map(|_| ())
}

/// Item 15: the CRL a chain was cached under stops vouching for it at its nextUpdate, on the
/// cache-hit path too (and before its thisUpdate).
#[test]
fn a_cached_snp_chain_rechecks_its_crl_window() {
    let _turn = turn();
    let t = OffsetDateTime::now_utc().unix_timestamp();
    let sim = amd(t);
    let v = Verifier::new(VerifierConfig {
        sim: SimTrust::Pinned(vec![sim.root_pin()]),
    });
    let mut b = sim.bundle(&SnpReportOptions::default()).unwrap();
    // A CRL (revoking nothing of ours) from t − 100 to t + 1000.
    snp_parts(&mut b)
        .3
        .push(sim.crl(&[77], t - 100, t + 1000).unwrap());
    verify(&v, &b, t).unwrap();
    let s = stats(&v, "snp_chains");
    assert_eq!((s.entries, s.misses, s.hits), (1, 1, 0), "{s:?}");
    // The CRL still current: a hit.
    verify(&v, &b, t + 999).unwrap();
    assert_eq!(stats(&v, "snp_chains").hits, 1);
    // Past nextUpdate (the certificates are still valid for years): refused, from the cache.
    let e = verify(&v, &b, t + 1001).unwrap_err();
    assert_eq!(e.code(), "crl_invalid", "{e}");
    assert!(e.to_string().contains("expired"), "{e}");
    // Before thisUpdate, too.
    let e = verify(&v, &b, t - 101).unwrap_err();
    assert_eq!(e.code(), "crl_invalid", "{e}");
    assert!(e.to_string().contains("not valid before"), "{e}");
    let s = stats(&v, "snp_chains");
    assert_eq!(
        (s.misses, s.hits),
        (1, 3),
        "all but the first from the cache: {s:?}"
    );
    // A fresh verifier agrees.
    let fresh = Verifier::new(VerifierConfig {
        sim: SimTrust::Pinned(vec![sim.root_pin()]),
    });
    assert_eq!(
        verify(&fresh, &b, t + 1001).unwrap_err().code(),
        "crl_invalid"
    );
}

fn pem(label: &str, der: &[u8]) -> Vec<u8> {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(76) {
        out.push_str(std::str::from_utf8(line).unwrap());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out.into_bytes()
}

/// Item 16 for SNP: re-encodings of one chain share its entry; trailing bytes after a CRL are
/// refused; public chains with junk reports make no entries and build no tables; after the
/// flood the honest node's report is a hit verified through its key's tables.
#[test]
fn snp_junk_makes_no_entries_and_the_honest_node_keeps_its_cost() {
    let _turn = turn();
    let t = OffsetDateTime::now_utc().unix_timestamp();
    let sim = amd(t);
    let v = Verifier::new(VerifierConfig {
        sim: SimTrust::Pinned(vec![sim.root_pin()]),
    });
    let honest = sim.bundle(&SnpReportOptions::default()).unwrap();
    // Seen twice: cached on the first, tables built and used on the second.
    verify(&v, &honest, t).unwrap();
    let tabled = cgx_attestation::crypto::table_verifications();
    verify(&v, &honest, t).unwrap();
    assert_eq!(cgx_attestation::crypto::table_verifications(), tabled + 1);
    let before = stats(&v, "snp_chains");
    assert_eq!(before.entries, 1);

    // Re-encodings of the same chain: the leaf as PEM with text around it, the chain with
    // junk between its blocks, 76-column lines, ARK before ASK. All verify — from the entry.
    let (_, leaf_der, chain_pem, _) = {
        let mut b = honest.clone();
        let (r, l, c, x) = snp_parts(&mut b);
        (r.clone(), l.clone(), c.clone(), x.clone())
    };
    let blocks: Vec<&str> = std::str::from_utf8(&chain_pem)
        .unwrap()
        .split_inclusive("-----END CERTIFICATE-----\n")
        .collect();
    assert_eq!(blocks.len(), 2);
    let mut variants: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    for i in 0..50 {
        let mut leaf = format!("junk {i} before\n").into_bytes();
        leaf.extend(pem("CERTIFICATE", &leaf_der));
        leaf.extend(format!("junk {i} after\n").into_bytes());
        let chain = format!("{}{}\n{}", blocks[1], "x".repeat(i), blocks[0]).into_bytes();
        variants.push((leaf, chain));
    }
    for (leaf, chain) in &variants {
        let mut b = honest.clone();
        let parts = snp_parts(&mut b);
        *parts.1 = leaf.clone();
        *parts.2 = chain.clone();
        verify(&v, &b, t).unwrap();
    }
    let s = stats(&v, "snp_chains");
    assert_eq!(s.entries, 1, "{s:?}");
    assert_eq!(s.misses, before.misses, "re-encodings are hits: {s:?}");

    // Trailing bytes after a CRL: refused, no entry.
    let mut crl = sim.crl(&[], t - 100, t + 1000).unwrap();
    crl.extend_from_slice(b"tail");
    let mut b = honest.clone();
    snp_parts(&mut b).3.push(crl);
    let e = verify(&v, &b, t).unwrap_err();
    assert_eq!(e.code(), "crl_invalid", "{e}");
    assert!(e.to_string().contains("trailing"), "{e}");

    // Public chains with junk reports: other valid certificates for the key (as AMD reissues
    // them), each with a report whose signature does not verify. Refused; nothing cached, no
    // tables built.
    let tabled = cgx_attestation::crypto::table_verifications();
    for i in 0..20 {
        let leaf = sim
            .issue_leaf(
                default_tcb(Product::Milan),
                chip(),
                t - 1000 - i,
                t + 100_000,
            )
            .unwrap();
        let mut b = honest.clone();
        let parts = snp_parts(&mut b);
        parts.0[0x50] ^= 1; // REPORT_DATA: the signature no longer covers it
        *parts.1 = leaf;
        let e = verify(&v, &b, t).unwrap_err();
        assert_eq!(e.code(), "signature_invalid", "{e}");
    }
    let s = stats(&v, "snp_chains");
    assert_eq!(s.entries, 1, "junk reports make no entries: {s:?}");
    assert_eq!(cgx_attestation::crypto::table_verifications(), tabled);

    // The honest node after the flood: a hit, one verification through its tables.
    let misses = s.misses;
    let next = sim
        .bundle(&SnpReportOptions {
            report_data: [9; 64],
            ..Default::default()
        })
        .unwrap();
    verify(&v, &next, t).unwrap();
    assert_eq!(stats(&v, "snp_chains").misses, misses);
    assert_eq!(cgx_attestation::crypto::table_verifications(), tabled + 1);

    // A reissued certificate for the same key, with a genuine report, is a second entry
    // that shares the key's tables (one table per point, not per certificate).
    let leaf = sim
        .issue_leaf(default_tcb(Product::Milan), chip(), t - 5000, t + 100_000)
        .unwrap();
    let mut b = next.clone();
    *snp_parts(&mut b).1 = leaf;
    verify(&v, &b, t).unwrap();
    verify(&v, &b, t).unwrap();
    assert_eq!(stats(&v, "snp_chains").entries, 2);
}

fn nvidia_parts(b: &mut Bundle) -> (&mut Vec<u8>, &mut Vec<u8>, &mut Vec<Vec<u8>>) {
    let Bundle::Nvidia {
        report,
        cert_chain,
        ocsp,
    } = b
    else {
        panic!("not NVIDIA")
    };
    (report, cert_chain, ocsp)
}

/// Item 16 for NVIDIA: re-encoded chains share the entry, junk SPDM reports make none, OCSP
/// responses must all parse and each answer for a certificate of the chain, and the honest GPU
/// stays a hit through its tables.
#[test]
fn nvidia_junk_makes_no_entries_and_the_honest_gpu_keeps_its_cost() {
    let _turn = turn();
    let t = OffsetDateTime::now_utc().unix_timestamp();
    let g = SimGpu::generate(t).unwrap();
    let v = Verifier::new(VerifierConfig {
        sim: SimTrust::Pinned(vec![g.root_pin()]),
    });
    // The simulator's bundles carry the chain's `good` OCSP response.
    let honest = g.bundle([1; 32], 4).unwrap();
    let good = g.good_ocsp().unwrap();
    assert_eq!(nvidia_parts(&mut honest.clone()).2, &vec![good.clone()]);
    verify(&v, &honest, t).unwrap();
    verify(&v, &honest, t).unwrap();
    let chains = stats(&v, "nvidia_chains");
    let ocsp = stats(&v, "nvidia_ocsp");
    assert_eq!((chains.entries, ocsp.entries), (1, 1));

    // The chain with junk around and between its blocks: the same entry.
    let chain = nvidia_parts(&mut honest.clone()).1.clone();
    for i in 0..30 {
        let mut b = honest.clone();
        let mut junked = format!("# copy {i}\n").into_bytes();
        junked.extend(
            String::from_utf8(chain.clone())
                .unwrap()
                .replace(
                    "-----END CERTIFICATE-----\n",
                    &format!("-----END CERTIFICATE-----\njunk {i}\n"),
                )
                .into_bytes(),
        );
        *nvidia_parts(&mut b).1 = junked;
        verify(&v, &b, t).unwrap();
    }
    assert_eq!(stats(&v, "nvidia_chains").entries, 1);
    assert_eq!(stats(&v, "nvidia_chains").misses, chains.misses);
    assert_eq!(stats(&v, "nvidia_ocsp").entries, 1);

    // Junk SPDM reports under the public chain: refused, no entries, no tables used.
    let tabled = cgx_attestation::crypto::table_verifications();
    let other = SimGpu::generate(t).unwrap();
    for i in 0..10u8 {
        // A genuine chain (another GPU's, trusted too) with a report it did not sign.
        let v2 = Verifier::new(VerifierConfig {
            sim: SimTrust::Pinned(vec![g.root_pin(), other.root_pin()]),
        });
        let mut b = other.bundle([i; 32], 4).unwrap();
        let report = nvidia_parts(&mut b).0;
        let last = report.len() - 1;
        report[last] ^= 1;
        let e = verify(&v2, &b, t).unwrap_err();
        assert_eq!(e.code(), "signature_invalid", "{e}");
        assert_eq!(stats(&v2, "nvidia_chains").entries, 0);
    }
    assert_eq!(cgx_attestation::crypto::table_verifications(), tabled);

    // OCSP: a junk tail after the good response, the good response twice, and a response
    // about nothing in this chain: each refused with its reason, none cached.
    let cases: [(Vec<Vec<u8>>, &str); 3] = [
        (vec![good.clone(), b"tail".to_vec()], "parse"),
        (
            vec![good.clone(), good.clone()],
            "answers for no certificate",
        ),
        (
            vec![good.clone(), other.good_ocsp().unwrap()],
            "answers for no certificate",
        ),
    ];
    for (responses, why) in cases {
        let mut b = honest.clone();
        *nvidia_parts(&mut b).2 = responses;
        let e = verify(&v, &b, t).unwrap_err();
        assert_eq!(e.code(), "ocsp_invalid", "{e}");
        assert!(e.to_string().contains(why), "{why}: {e}");
    }
    // Trailing bytes inside one response: refused.
    let mut b = honest.clone();
    let mut tailed = good.clone();
    tailed.push(0);
    *nvidia_parts(&mut b).2 = vec![tailed];
    assert_eq!(verify(&v, &b, t).unwrap_err().code(), "ocsp_invalid");
    assert_eq!(stats(&v, "nvidia_ocsp").entries, 1);

    // The honest GPU after all that: hits, through its tables.
    let (cm, om) = (
        stats(&v, "nvidia_chains").misses,
        stats(&v, "nvidia_ocsp").misses,
    );
    let tabled = cgx_attestation::crypto::table_verifications();
    let next = g.bundle([2; 32], 4).unwrap();
    verify(&v, &next, t).unwrap();
    assert_eq!(stats(&v, "nvidia_chains").misses, cm);
    assert_eq!(stats(&v, "nvidia_ocsp").misses, om);
    assert_eq!(cgx_attestation::crypto::table_verifications(), tabled + 1);
}

/// Item 16 for TDX: the same quote with more NUL padding in its certification data, and its
/// collateral re-spaced, do not add entries; the quote keeps its one-signature cost.
#[test]
fn tdx_padding_and_respaced_collateral_make_no_new_entries() {
    let _turn = turn();
    let Some(vectors) =
        cgx_attestation::bundle::shared_vectors(std::path::Path::new(env!("CARGO_MANIFEST_DIR")))
    else {
        eprintln!("SKIPPED tdx cache test: no vectors (set CGX_VECTORS)");
        return;
    };
    let dir = vectors.join("tdx/v4-b0c06f-dcapqvl-phala");
    let Bundle::Tdx { quote, collateral } = Bundle::load(&dir).unwrap() else {
        panic!("not TDX")
    };
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    let when = OffsetDateTime::parse(
        expected["at"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    let check = |v: &Verifier, q: &[u8], c: &[u8]| {
        let ev = cgx_attestation::Evidence::Tdx(cgx_attestation::tdx::TdxEvidence {
            quote: q,
            collateral_json: c,
        });
        v.verify(&ev, when).map(|_| ())
    };
    let v = Verifier::new(VerifierConfig::default());
    check(&v, &quote, &collateral).unwrap();
    assert_eq!(stats(&v, "tdx_known").entries, 1);

    // More NUL padding inside the PCK chain data (its three sizes adjusted): unsigned bytes.
    // v4: header 48, body 584; signature data length at 632; outer certification data size at
    // 632 + 4 + 64 + 64 + 2; the inner (PCK chain) size just before the PEM.
    let begin = quote.windows(11).position(|w| w == b"-----BEGIN ").unwrap();
    let inner_len = u32::from_le_bytes(quote[begin - 4..begin].try_into().unwrap()) as usize;
    let end = begin + inner_len;
    for extra in [1usize, 7, 300] {
        let mut q = quote[..end].to_vec();
        q.extend(std::iter::repeat_n(0u8, extra));
        for at in [632usize, 632 + 134, begin - 4] {
            let n = u32::from_le_bytes(q[at..at + 4].try_into().unwrap()) as usize + extra;
            q[at..at + 4].copy_from_slice(&(n as u32).to_le_bytes());
        }
        check(&v, &q, &collateral).unwrap();
    }
    let s = stats(&v, "tdx_known");
    assert_eq!((s.entries, s.misses), (1, 1), "padding variants hit: {s:?}");

    // The collateral re-spaced: verified in full (its bytes differ), replacing the entry.
    let value: serde_json::Value = serde_json::from_slice(&collateral).unwrap();
    for pretty in [true, false] {
        let c = if pretty {
            serde_json::to_vec_pretty(&value).unwrap()
        } else {
            serde_json::to_vec(&value).unwrap()
        };
        check(&v, &quote, &c).unwrap();
        assert_eq!(stats(&v, "tdx_known").entries, 1);
    }
    // Junk collateral: refused, nothing cached (there is no collateral cache).
    let e = check(&v, &quote, b"{\"junk\": 1}").unwrap_err();
    assert_eq!(e.code(), "collateral_invalid", "{e}");
    assert_eq!(stats(&v, "tdx_known").entries, 1);
    // Back to the original collateral: one full verification, then one signature per quote.
    check(&v, &quote, &collateral).unwrap();
    let before = cgx_attestation::tdx::p256_verifications();
    check(&v, &quote, &collateral).unwrap();
    assert_eq!(cgx_attestation::tdx::p256_verifications() - before, 1);
}
