#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Simulated evidence through the real verification path: it verifies only when its root is
//! trusted, and every checked field and chain link, when tampered with, is refused with a
//! specific error. Random mutations never panic and never verify.

use std::sync::OnceLock;

use cgx_attestation::bundle::Bundle;
use cgx_attestation::sim::{SimAmd, SimGpu, SnpReportOptions, default_tcb};
use cgx_attestation::snp::report::offsets;
use cgx_attestation::snp::{Product, SigningKey};
use cgx_attestation::{Error, Evidence, KindClaims, SimTrust, Verifier, VerifierConfig};
use time::OffsetDateTime;

fn now() -> OffsetDateTime {
    OffsetDateTime::now_utc()
}

fn chip() -> [u8; 64] {
    let mut c = [0u8; 64];
    for (i, b) in c.iter_mut().enumerate() {
        *b = i as u8 ^ 0xA5;
    }
    c
}

fn milan() -> &'static SimAmd {
    static S: OnceLock<SimAmd> = OnceLock::new();
    S.get_or_init(|| {
        SimAmd::generate(
            Product::Milan,
            SigningKey::Vcek,
            default_tcb(Product::Milan),
            chip(),
            now().unix_timestamp(),
        )
        .unwrap()
    })
}

fn gpu() -> &'static SimGpu {
    static S: OnceLock<SimGpu> = OnceLock::new();
    S.get_or_init(|| SimGpu::generate(now().unix_timestamp()).unwrap())
}

fn trusting() -> Verifier {
    Verifier::new(VerifierConfig {
        sim: SimTrust::Pinned(vec![milan().root_pin(), gpu().root_pin()]),
    })
}

fn verify(v: &Verifier, b: &Bundle) -> Result<cgx_attestation::Claims, Error> {
    v.verify(&b.evidence(), now()).map(|c| c.into_claims())
}

fn snp_bundle() -> Bundle {
    let opts = SnpReportOptions {
        report_data: [7; 64],
        measurement: [9; 48],
        ..Default::default()
    };
    milan().bundle(&opts).unwrap()
}

fn with_report(b: &Bundle, f: impl FnOnce(&mut Vec<u8>)) -> Bundle {
    let mut b = b.clone();
    if let Bundle::Snp { report, .. } = &mut b {
        f(report);
    }
    b
}

#[test]
fn sim_snp_verifies_only_when_trusted_and_says_sim() {
    let b = snp_bundle();
    let claims = verify(&trusting(), &b).unwrap();
    assert!(claims.sim);
    let KindClaims::Snp(snp) = &claims.detail else {
        panic!()
    };
    assert_eq!(snp.report_data, hex::encode([7u8; 64]));
    assert_eq!(snp.measurement, hex::encode([9u8; 48]));
    assert_eq!(snp.chip_id, hex::encode(chip()));
    let err = verify(&Verifier::new(VerifierConfig::default()), &b).unwrap_err();
    assert_eq!(err.code(), "untrusted_root", "{err}");
    // A pin for another sim root does not trust this one.
    let other = Verifier::new(VerifierConfig {
        sim: SimTrust::Pinned(vec![[0u8; 32]]),
    });
    assert_eq!(verify(&other, &b).unwrap_err().code(), "untrusted_root");
}

#[test]
fn every_products_and_vlek_layout_verifies() {
    for product in [Product::Milan, Product::Genoa, Product::Turin] {
        for key in [SigningKey::Vcek, SigningKey::Vlek] {
            let sim = SimAmd::generate(
                product,
                key,
                default_tcb(product),
                chip(),
                now().unix_timestamp(),
            )
            .unwrap();
            for version in [2, 3, 5] {
                let b = sim
                    .bundle(&SnpReportOptions {
                        version,
                        ..Default::default()
                    })
                    .unwrap();
                let v = Verifier::new(VerifierConfig { sim: SimTrust::Any });
                let c = verify(&v, &b)
                    .unwrap_or_else(|e| panic!("{product:?} {key:?} v{version}: {e}"));
                let KindClaims::Snp(s) = &c.detail else {
                    panic!()
                };
                assert_eq!(s.product, product);
                assert_eq!(s.signing_key, key);
                assert_eq!(s.reported_tcb, default_tcb(product));
            }
        }
    }
}

#[test]
fn each_tampered_report_field_is_refused() {
    let b = snp_bundle();
    let v = trusting();
    let fields: &[(&str, usize, &[&str])] = &[
        ("VERSION", offsets::VERSION, &["unsupported_version"]),
        ("GUEST_SVN", offsets::GUEST_SVN, &["signature_invalid"]),
        ("POLICY", offsets::POLICY, &["signature_invalid"]),
        ("FAMILY_ID", offsets::FAMILY_ID, &["signature_invalid"]),
        ("IMAGE_ID", offsets::IMAGE_ID, &["signature_invalid"]),
        ("VMPL", offsets::VMPL, &["signature_invalid"]),
        (
            "SIGNATURE_ALGO",
            offsets::SIGNATURE_ALGO,
            &["invalid_field"],
        ),
        ("CURRENT_TCB", offsets::CURRENT_TCB, &["signature_invalid"]),
        (
            "PLATFORM_INFO",
            offsets::PLATFORM_INFO,
            &["signature_invalid"],
        ),
        (
            "KEY_INFO (author key)",
            offsets::KEY_INFO,
            &["signature_invalid"],
        ),
        (
            "REPORT_DATA",
            offsets::REPORT_DATA + 5,
            &["signature_invalid"],
        ),
        (
            "MEASUREMENT",
            offsets::MEASUREMENT + 47,
            &["signature_invalid"],
        ),
        ("HOST_DATA", offsets::HOST_DATA, &["signature_invalid"]),
        (
            "ID_KEY_DIGEST",
            offsets::ID_KEY_DIGEST,
            &["signature_invalid"],
        ),
        (
            "AUTHOR_KEY_DIGEST",
            offsets::AUTHOR_KEY_DIGEST,
            &["signature_invalid"],
        ),
        ("REPORT_ID", offsets::REPORT_ID, &["signature_invalid"]),
        (
            "REPORT_ID_MA",
            offsets::REPORT_ID_MA,
            &["signature_invalid"],
        ),
        (
            "REPORTED_TCB",
            offsets::REPORTED_TCB,
            &["signature_invalid", "tcb_mismatch"],
        ),
        ("CPUID_FAM_ID", offsets::CPUID_FAM_ID, &["invalid_field"]),
        (
            "CHIP_ID",
            offsets::CHIP_ID,
            &["signature_invalid", "chip_id_mismatch"],
        ),
        (
            "COMMITTED_TCB",
            offsets::COMMITTED_TCB,
            &["signature_invalid"],
        ),
        (
            "CURRENT_BUILD",
            offsets::CURRENT_BUILD,
            &["signature_invalid"],
        ),
        ("LAUNCH_TCB", offsets::LAUNCH_TCB, &["signature_invalid"]),
        ("reserved 0x04C", 0x04C, &["invalid_field"]),
        ("reserved 0x2A0 area", 0x250, &["invalid_field"]),
        ("SIGNATURE_R", offsets::SIGNATURE_R, &["signature_invalid"]),
        (
            "SIGNATURE_S",
            offsets::SIGNATURE_S + 3,
            &["signature_invalid"],
        ),
        (
            "SIGNATURE_R high bytes",
            offsets::SIGNATURE_R + 60,
            &["invalid_field"],
        ),
        ("signature reserved", 0x400, &["invalid_field"]),
    ];
    for (field, off, codes) in fields {
        let t = with_report(&b, |r| r[*off] ^= 0x01);
        let err = verify(&v, &t).unwrap_err();
        assert!(
            codes.contains(&err.code()),
            "{field}: got {} ({err})",
            err.code()
        );
    }
    // Signing key set to VLEK while a VCEK is supplied; MASK_CHIP_KEY; truncation; extension.
    let t = with_report(&b, |r| r[offsets::KEY_INFO] |= 1 << 2);
    assert_eq!(verify(&v, &t).unwrap_err().code(), "signing_key_mismatch");
    let t = with_report(&b, |r| r[offsets::KEY_INFO] |= 0b10);
    assert_eq!(verify(&v, &t).unwrap_err().code(), "invalid_field");
    let t = with_report(&b, |r| {
        r.pop();
    });
    assert_eq!(verify(&v, &t).unwrap_err().code(), "truncated");
    let t = with_report(&b, |r| r.push(0));
    assert_eq!(verify(&v, &t).unwrap_err().code(), "truncated");
}

fn replace_snp(
    b: &Bundle,
    leaf: Option<Vec<u8>>,
    chain: Option<Vec<u8>>,
    crls: Vec<Vec<u8>>,
) -> Bundle {
    let mut b = b.clone();
    if let Bundle::Snp {
        signing_cert,
        cert_chain,
        crls: c,
        ..
    } = &mut b
    {
        if let Some(l) = leaf {
            *signing_cert = l;
        }
        if let Some(ch) = chain {
            *cert_chain = ch;
        }
        *c = crls;
    }
    b
}

fn pem(der: &[u8]) -> String {
    use base64::Engine;
    format!(
        "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
        base64::engine::general_purpose::STANDARD.encode(der)
    )
}

#[test]
fn each_chain_link_is_checked() {
    let sim = milan();
    let b = snp_bundle();
    let v = trusting();
    let t = now().unix_timestamp();
    // ARK → ASK: an ASK for another key, signed by the right ARK, cannot certify our VCEK.
    let chain = pem(&sim.foreign_ask_der(t).unwrap()) + &pem(&sim.ark_der);
    let e = verify(&v, &replace_snp(&b, None, Some(chain.into_bytes()), vec![])).unwrap_err();
    assert_eq!(e.code(), "signature_invalid", "{e}");
    // ARK → ASK: a chain whose ARK is another (untrusted) sim root.
    let other = SimAmd::generate(
        Product::Milan,
        SigningKey::Vcek,
        default_tcb(Product::Milan),
        chip(),
        t,
    )
    .unwrap();
    let e = verify(
        &v,
        &replace_snp(&b, None, Some(other.cert_chain_pem().into_bytes()), vec![]),
    )
    .unwrap_err();
    assert_eq!(e.code(), "untrusted_root", "{e}");
    // … and with that root trusted, the ASK still did not sign our VCEK.
    let both = Verifier::new(VerifierConfig { sim: SimTrust::Any });
    let e = verify(
        &both,
        &replace_snp(&b, None, Some(other.cert_chain_pem().into_bytes()), vec![]),
    )
    .unwrap_err();
    assert_eq!(e.code(), "signature_invalid", "{e}");
    // ASK → VCEK: a VCEK from another hierarchy.
    let e = verify(
        &v,
        &replace_snp(&b, Some(other.leaf_der.clone()), None, vec![]),
    )
    .unwrap_err();
    assert_eq!(e.code(), "signature_invalid", "{e}");
    // VCEK TCB extensions must equal REPORTED_TCB.
    let mut tcb = default_tcb(Product::Milan);
    tcb.snp += 1;
    let leaf = sim.issue_leaf(tcb, chip(), t - 10, t + 1000).unwrap();
    let e = verify(&v, &replace_snp(&b, Some(leaf), None, vec![])).unwrap_err();
    assert_eq!(e.code(), "tcb_mismatch", "{e}");
    let mut tcb = default_tcb(Product::Milan);
    tcb.microcode += 1;
    let leaf = sim.issue_leaf(tcb, chip(), t - 10, t + 1000).unwrap();
    assert_eq!(
        verify(&v, &replace_snp(&b, Some(leaf), None, vec![]))
            .unwrap_err()
            .code(),
        "tcb_mismatch"
    );
    // hwID must equal CHIP_ID.
    let mut other_chip = chip();
    other_chip[0] ^= 1;
    let leaf = sim
        .issue_leaf(default_tcb(Product::Milan), other_chip, t - 10, t + 1000)
        .unwrap();
    let e = verify(&v, &replace_snp(&b, Some(leaf), None, vec![])).unwrap_err();
    assert_eq!(e.code(), "chip_id_mismatch", "{e}");
    // Certificate validity at the verification time.
    let leaf = sim
        .issue_leaf(default_tcb(Product::Milan), chip(), t - 1000, t - 10)
        .unwrap();
    let e = verify(&v, &replace_snp(&b, Some(leaf), None, vec![])).unwrap_err();
    assert_eq!(e.code(), "certificate_not_valid_at_time", "{e}");
    let leaf = sim
        .issue_leaf(default_tcb(Product::Milan), chip(), t + 1000, t + 2000)
        .unwrap();
    let e = verify(&v, &replace_snp(&b, Some(leaf), None, vec![])).unwrap_err();
    assert_eq!(e.code(), "certificate_not_valid_at_time", "{e}");
    // A cached chain is re-checked against each verification time.
    verify(&v, &b).unwrap();
    let later = now() + time::Duration::days(365 * 20);
    let e = v.verify(&b.evidence(), later).unwrap_err();
    assert_eq!(e.code(), "certificate_not_valid_at_time", "{e}");
    // CRLs: a revoked ASK or VCEK; a CRL that is expired or signed by someone else.
    let crl = sim.crl(&[SimAmd::ASK_SERIAL], t - 100, t + 1000).unwrap();
    assert_eq!(
        verify(&v, &replace_snp(&b, None, None, vec![crl]))
            .unwrap_err()
            .code(),
        "revoked"
    );
    let crl = sim.crl(&[SimAmd::LEAF_SERIAL], t - 100, t + 1000).unwrap();
    assert_eq!(
        verify(&v, &replace_snp(&b, None, None, vec![crl]))
            .unwrap_err()
            .code(),
        "revoked"
    );
    let crl = sim.crl(&[77], t - 100, t + 1000).unwrap();
    verify(&v, &replace_snp(&b, None, None, vec![crl])).unwrap();
    let crl = sim.crl(&[], t - 1000, t - 100).unwrap();
    assert_eq!(
        verify(&v, &replace_snp(&b, None, None, vec![crl]))
            .unwrap_err()
            .code(),
        "crl_invalid"
    );
    let crl = other.crl(&[], t - 100, t + 1000).unwrap();
    assert_eq!(
        verify(&v, &replace_snp(&b, None, None, vec![crl]))
            .unwrap_err()
            .code(),
        "crl_invalid"
    );
    // A chain missing its ARK, and garbage.
    let e = verify(
        &v,
        &replace_snp(&b, None, Some(pem(&sim.ask_der).into_bytes()), vec![]),
    )
    .unwrap_err();
    assert_eq!(e.code(), "chain_invalid", "{e}");
    let e = verify(
        &v,
        &replace_snp(&b, Some(b"not a cert".to_vec()), None, vec![]),
    )
    .unwrap_err();
    assert_eq!(e.code(), "malformed", "{e}");
}

#[test]
fn sim_gpu_verifies_and_each_check_refuses_tampering() {
    let g = gpu();
    let v = trusting();
    let nonce = [3u8; 32];
    let b = g.bundle(nonce, 64).unwrap();
    let c = verify(&v, &b).unwrap();
    assert!(c.sim);
    let KindClaims::Nvidia(n) = &c.detail else {
        panic!()
    };
    assert_eq!(n.nonce, hex::encode(nonce));
    assert_eq!(n.measurement_count, 64);
    assert_eq!(n.fwid, hex::encode(g.fwid));
    assert_eq!(n.vbios_version.as_deref(), Some("96.00.74.00.1A"));
    assert_eq!(
        n.vbios_version.as_deref(),
        Some(cgx_attestation::sim::SIM_GPU_VBIOS_VERSION)
    );
    assert_eq!(
        n.driver_version.as_deref(),
        Some(cgx_attestation::sim::SIM_GPU_DRIVER_VERSION)
    );
    // The opaque fields the real H100 signs: CC mode on, as the shared vectors report.
    assert_eq!(
        n.cc_mode.as_deref(),
        Some(cgx_attestation::nvidia::CC_MODE_ON)
    );
    assert_eq!(
        verify(&Verifier::new(VerifierConfig::default()), &b)
            .unwrap_err()
            .code(),
        "untrusted_root"
    );
    let Bundle::Nvidia {
        report, cert_chain, ..
    } = &b
    else {
        panic!()
    };
    // Expected nonce.
    let ev = Evidence::Nvidia(cgx_attestation::nvidia::NvidiaEvidence {
        report,
        cert_chain,
        expected_nonce: Some(&[4u8; 32]),
        ocsp: &[],
    });
    assert_eq!(v.verify(&ev, now()).unwrap_err().code(), "nonce_mismatch");
    // Flips: request nonce, a measurement, the opaque FWID, the signature.
    let opaque_fwid_at = report.len() - 96 - 48;
    for (what, off, code) in [
        ("nonce", 10, "signature_invalid"),
        ("measurement", 37 + 8 + 7 + 10, "signature_invalid"),
        ("fwid", opaque_fwid_at, "fwid_mismatch"),
        ("signature", report.len() - 1, "signature_invalid"),
        ("request code", 1, "malformed"),
        ("response code", 38, "malformed"),
    ] {
        let mut r = report.clone();
        r[off] ^= 1;
        let t = Bundle::Nvidia {
            report: r,
            cert_chain: cert_chain.clone(),
            ocsp: Vec::new(),
        };
        let e = verify(&v, &t).unwrap_err();
        assert_eq!(e.code(), code, "{what}: {e}");
    }
    // Another GPU's chain cannot vouch for this report (FWID differs).
    let other = SimGpu::generate(now().unix_timestamp()).unwrap();
    let t = Bundle::Nvidia {
        report: report.clone(),
        cert_chain: other.chain_pem.clone().into_bytes(),
        ocsp: Vec::new(),
    };
    let any = Verifier::new(VerifierConfig { sim: SimTrust::Any });
    assert_eq!(verify(&any, &t).unwrap_err().code(), "fwid_mismatch");
    // A chain without its root, and a truncated report.
    let certs: Vec<&str> = g
        .chain_pem
        .split_inclusive("-----END CERTIFICATE-----\n")
        .collect();
    let t = Bundle::Nvidia {
        report: report.clone(),
        cert_chain: (certs[0].to_string() + certs[1]).into_bytes(),
        ocsp: Vec::new(),
    };
    assert_eq!(verify(&v, &t).unwrap_err().code(), "untrusted_root");
    let t = Bundle::Nvidia {
        report: report[..report.len() - 1].to_vec(),
        cert_chain: cert_chain.clone(),
        ocsp: Vec::new(),
    };
    assert_eq!(verify(&v, &t).unwrap_err().code(), "truncated");
}

/// xorshift64*: deterministic mutations without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn mutate(rng: &mut Rng, data: &[u8]) -> Vec<u8> {
    let mut d = data.to_vec();
    match rng.below(4) {
        0 => {
            for _ in 0..=rng.below(4) {
                let i = rng.below(d.len());
                d[i] ^= 1 << rng.below(8);
            }
        }
        1 => {
            let i = rng.below(d.len());
            d[i] = rng.next() as u8;
        }
        2 => d.truncate(rng.below(d.len())),
        _ => {
            let i = rng.below(d.len());
            d.insert(i, rng.next() as u8);
        }
    }
    d
}

#[test]
fn random_mutations_never_panic_and_never_verify() {
    let v = trusting();
    let snp = snp_bundle();
    let gpu = gpu().bundle([1; 32], 8).unwrap();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut refused = 0;
    for _ in 0..3000 {
        let (
            Bundle::Snp { report, .. },
            Bundle::Nvidia {
                report: g,
                cert_chain,
                ..
            },
        ) = (&snp, &gpu)
        else {
            panic!()
        };
        let m = mutate(&mut rng, report);
        if &m != report {
            assert!(verify(&v, &with_report(&snp, |r| *r = m)).is_err());
            refused += 1;
        }
        let m = mutate(&mut rng, g);
        if &m != g {
            let appended = m.starts_with(g);
            let t = Bundle::Nvidia {
                report: m,
                cert_chain: cert_chain.clone(),
                ocsp: Vec::new(),
            };
            if appended {
                // Bytes after the signature are unsigned and real dumps carry them (the vectors'
                // README: `h100-trustee-coco` has one): accepted, and they change no claim.
                let same = Bundle::Nvidia {
                    report: g.clone(),
                    cert_chain: cert_chain.clone(),
                    ocsp: Vec::new(),
                };
                assert_eq!(
                    verify(&v, &t).map_err(|e| e.to_string()),
                    verify(&v, &same).map_err(|e| e.to_string())
                );
            } else {
                assert!(verify(&v, &t).is_err());
                refused += 1;
            }
        }
        // Certificates too: the chain PEM and the VCEK DER.
        let Bundle::Snp { signing_cert, .. } = &snp else {
            panic!()
        };
        let m = mutate(&mut rng, signing_cert);
        if &m != signing_cert {
            assert!(verify(&v, &replace_snp(&snp, Some(m), None, vec![])).is_err());
        }
    }
    assert!(refused > 5000);
    // The accepted case above, made certain: bytes after the signature verify to the same claims.
    let Bundle::Nvidia {
        report,
        cert_chain,
        ocsp,
    } = &gpu
    else {
        panic!()
    };
    let mut longer = report.clone();
    longer.extend_from_slice(&[0xAB, 0xCD]);
    let t = Bundle::Nvidia {
        report: longer,
        cert_chain: cert_chain.clone(),
        ocsp: ocsp.clone(),
    };
    assert_eq!(
        verify(&v, &t).map_err(|e| e.to_string()),
        verify(&v, &gpu).map_err(|e| e.to_string())
    );
}

#[test]
fn real_tdx_quote_mutations_never_panic_and_never_verify() {
    let dir =
        cgx_attestation::bundle::shared_vectors(std::path::Path::new(env!("CARGO_MANIFEST_DIR")))
            .map(|v| v.join("tdx/v4-b0c06f-dcapqvl-phala"))
            .unwrap_or_default();
    if !dir.is_dir() {
        skip("SKIPPED real_tdx_quote_mutations_never_panic_and_never_verify: no vectors");
        return;
    }
    let b = Bundle::load(&dir).unwrap();
    let at = time::macros::datetime!(2025-07-19 10:00:34 UTC);
    let v = Verifier::new(VerifierConfig::default());
    v.verify(&b.evidence(), at).unwrap();
    let Bundle::Tdx { quote, collateral } = &b else {
        panic!()
    };
    let mut rng = Rng(42);
    for i in 0..300 {
        let m = mutate(&mut rng, quote);
        // Dropping zero padding after the quote structure leaves the same quote.
        let padding_only = quote.starts_with(&m) && quote[m.len()..].iter().all(|&b| b == 0);
        if &m == quote || padding_only {
            continue;
        }
        let t = Bundle::Tdx {
            quote: m,
            collateral: collateral.clone(),
        };
        assert!(
            v.verify(&t.evidence(), at).is_err(),
            "mutation {i} verified"
        );
    }
}

#[test]
fn gpu_chain_links_and_validity_are_checked() {
    let g = gpu();
    let v = trusting();
    let b = g.bundle([5; 32], 16).unwrap();
    let Bundle::Nvidia {
        report, cert_chain, ..
    } = &b
    else {
        panic!()
    };
    let mine: Vec<String> = g
        .chain_pem
        .split_inclusive("-----END CERTIFICATE-----\n")
        .map(str::to_string)
        .collect();
    let other = SimGpu::generate(now().unix_timestamp()).unwrap();
    let theirs: Vec<String> = other
        .chain_pem
        .split_inclusive("-----END CERTIFICATE-----\n")
        .map(str::to_string)
        .collect();
    // Leaf → intermediate: another GPU's intermediate did not sign our leaf.
    let t = Bundle::Nvidia {
        report: report.clone(),
        cert_chain: format!("{}{}{}", mine[0], theirs[1], mine[2]).into_bytes(),
        ocsp: Vec::new(),
    };
    let any = Verifier::new(VerifierConfig { sim: SimTrust::Any });
    let e = verify(&any, &t).unwrap_err();
    assert!(
        matches!(e.code(), "signature_invalid" | "chain_invalid"),
        "{e}"
    );
    // Intermediate → root: another root did not sign our intermediate.
    let t = Bundle::Nvidia {
        report: report.clone(),
        cert_chain: format!("{}{}{}", mine[0], mine[1], theirs[2]).into_bytes(),
        ocsp: Vec::new(),
    };
    let e = verify(&any, &t).unwrap_err();
    assert!(
        matches!(e.code(), "signature_invalid" | "chain_invalid"),
        "{e}"
    );
    // Validity at the verification time, also on a cache hit.
    verify(&v, &b).unwrap();
    let later = now() + time::Duration::days(365 * 20);
    let e = v.verify(&b.evidence(), later).unwrap_err();
    assert_eq!(e.code(), "certificate_not_valid_at_time", "{e}");
    let earlier = now() - time::Duration::days(30);
    let e = v.verify(&b.evidence(), earlier).unwrap_err();
    assert_eq!(e.code(), "certificate_not_valid_at_time", "{e}");
    // The chain is read as given: garbage is malformed, not a panic.
    let t = Bundle::Nvidia {
        report: report.clone(),
        cert_chain: b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".to_vec(),
        ocsp: Vec::new(),
    };
    assert!(verify(&v, &t).is_err());
    let _ = cert_chain;
}

/// Say that a test skipped, past libtest's output capture (a plain `eprintln!` in a passing
/// test is swallowed), so a user without the vectors sees it.
fn skip(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{msg}");
}

#[test]
fn reports_signed_with_presigned_nonces_verify_and_tampering_is_still_refused() {
    // Its own chain: the shared one's pool would change what the other tests sign with.
    let amd = SimAmd::generate(
        Product::Genoa,
        SigningKey::Vcek,
        default_tcb(Product::Genoa),
        chip(),
        now().unix_timestamp(),
    )
    .unwrap();
    let v = Verifier::new(VerifierConfig {
        sim: SimTrust::Pinned(vec![amd.root_pin()]),
    });
    amd.presign(3, 2).unwrap();
    assert_eq!(amd.presigned_ready(), 3);
    let mut sigs = std::collections::HashSet::new();
    // Three from the pool, then one the ordinary way once it is empty.
    for i in 0..4u8 {
        let b = amd
            .bundle(&SnpReportOptions {
                report_data: [i; 64],
                ..Default::default()
            })
            .unwrap();
        let claims = verify(&v, &b).unwrap();
        let KindClaims::Snp(snp) = &claims.detail else {
            panic!()
        };
        assert_eq!(snp.report_data, hex::encode([i; 64]));
        let Bundle::Snp { report, .. } = &b else {
            panic!()
        };
        assert!(sigs.insert(report[offsets::SIGNATURE_R..offsets::SIGNATURE_R + 48].to_vec()));
        let forged = with_report(&b, |r| r[offsets::REPORT_DATA] ^= 1);
        assert_eq!(verify(&v, &forged).unwrap_err().code(), "signature_invalid");
    }
    assert_eq!(amd.presigned_ready(), 0);
}
