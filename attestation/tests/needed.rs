#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! `collateral::needed` on real AMD evidence: the items a report needs, under KDS's keys; the
//! CRL found by the chain's root is the one KDS serves for the report's product; a VLEK and a
//! v2 report (no product) are refused with their reasons.

use std::path::{Path, PathBuf};

use cgx_attestation::collateral::CollateralKey;
use cgx_attestation::collateral::needed::{self, NeedError, Role, SnpCarried};
use cgx_attestation::snp::report::{AttestationReport, Product, SigningKey};

fn vectors() -> Option<PathBuf> {
    let found = cgx_attestation::bundle::shared_vectors(Path::new(env!("CARGO_MANIFEST_DIR")));
    if found.is_none() {
        eprintln!("SKIPPED needed: no vectors (set CGX_VECTORS or place ../shared/vectors)");
    }
    found
}

fn read(dir: &Path, name: &str) -> Vec<u8> {
    std::fs::read(dir.join(name)).unwrap()
}

/// The PEM blocks of `pem`, each with its END line.
fn pem_blocks(pem: &[u8]) -> Vec<String> {
    let text = String::from_utf8(pem.to_vec()).unwrap();
    text.split_inclusive("-----END CERTIFICATE-----")
        .filter(|b| b.contains("BEGIN CERTIFICATE"))
        .map(|b| b.trim().to_string() + "\n")
        .collect()
}

fn reversed_pem(pem: &[u8]) -> Vec<u8> {
    let mut blocks = pem_blocks(pem);
    blocks.reverse();
    blocks.concat().into_bytes()
}

fn first_pem(pem: &[u8]) -> Vec<u8> {
    pem_blocks(pem)[0].clone().into_bytes()
}

#[test]
fn real_reports_need_kds_items_and_the_crl_of_their_chains_root() {
    let Some(v) = vectors() else { return };
    for (folder, product) in [
        ("genoa-v5-oak-genoa-oc", Product::Genoa),
        ("milan-v3-oak-cb", Product::Milan),
        ("turin-v5-oak-turin-oc", Product::Turin),
    ] {
        let dir = v.join("snp").join(folder);
        let report = AttestationReport::parse(&read(&dir, "report.bin")).unwrap();
        let chain = read(&dir, "ask_ark.pem");
        // Nothing carried: the VCEK, the chain and the CRL, each under KDS's key.
        let all = needed::snp(&report, SigningKey::Vcek, SnpCarried::default()).unwrap();
        let roles: Vec<Role> = all.iter().map(|n| n.role).collect();
        assert_eq!(
            roles,
            [Role::SigningCert, Role::Chain, Role::Revocation],
            "{folder}"
        );
        assert_eq!(Some(all[0].key.clone()), CollateralKey::vcek_for(&report));
        assert_eq!(
            all[1].key,
            CollateralKey::AmdCertChain {
                product,
                vlek: false
            }
        );
        let crl = CollateralKey::AmdCrl {
            product,
            vlek: false,
        };
        assert_eq!(all[2].key, crl, "{folder}");
        // Chain carried: its root names the same CRL (AMD's root for this product).
        let carried = SnpCarried {
            signing_cert: true,
            chain: Some(&chain),
        };
        let some = needed::snp(&report, SigningKey::Vcek, carried).unwrap();
        assert_eq!(some.len(), 1, "{folder}");
        assert_eq!(some[0].key, crl, "{folder}");
        assert!(crl.path().contains("crl"), "{}", crl.path());
        // Asked again (answered from memory now), the same; for a VLEK's chain, the VLEK CRL
        // (the memory tells the two apart).
        for _ in 0..2 {
            use cgx_attestation::trust::amd_crl_key;
            assert_eq!(amd_crl_key(&chain, false), Some(crl.clone()), "{folder}");
            assert_eq!(
                amd_crl_key(&chain, true),
                Some(CollateralKey::AmdCrl {
                    product,
                    vlek: true
                }),
                "{folder}"
            );
        }
        // Labelled the other way round (ARK first, as the verifier also accepts): the same
        // root, the same CRL — not a key that is never in a store.
        let reversed = reversed_pem(&chain);
        assert_ne!(reversed, chain);
        let flipped = SnpCarried {
            signing_cert: true,
            chain: Some(&reversed),
        };
        let some = needed::snp(&report, SigningKey::Vcek, flipped).unwrap();
        assert_eq!(some[0].key, crl, "{folder} reversed");
        // The ASK alone (no root): no CRL can be named.
        let ask_only = first_pem(&chain);
        let no_root = SnpCarried {
            signing_cert: true,
            chain: Some(&ask_only),
        };
        assert_eq!(
            needed::snp(&report, SigningKey::Vcek, no_root),
            Err(NeedError::UnreadableChain),
            "{folder}"
        );
        // Not a chain: no CRL can be named.
        let junk = SnpCarried {
            signing_cert: true,
            chain: Some(b"not PEM"),
        };
        assert_eq!(
            needed::snp(&report, SigningKey::Vcek, junk),
            Err(NeedError::UnreadableChain)
        );
    }
}

#[test]
fn a_vlek_must_be_carried_and_a_v2_report_names_no_product() {
    let Some(v) = vectors() else { return };
    let dir = v.join("snp/milan-v3-vlek-trustee");
    let report = AttestationReport::parse(&read(&dir, "report.bin")).unwrap();
    assert_eq!(report.signing_key().unwrap(), SigningKey::Vlek);
    assert_eq!(
        needed::snp(&report, SigningKey::Vlek, SnpCarried::default()),
        Err(NeedError::VlekNotServed)
    );
    // Carried, its chain is the ASVK's and its CRL the VLEK one.
    let chain = read(&dir, "asvk_ark.pem");
    let carried = SnpCarried {
        signing_cert: true,
        chain: Some(&chain),
    };
    let needs = needed::snp(&report, SigningKey::Vlek, carried).unwrap();
    assert_eq!(
        needs[0].key,
        CollateralKey::AmdCrl {
            product: Product::Milan,
            vlek: true
        }
    );
    let dir = v.join("snp/milan-v2-trustee");
    let v2 = AttestationReport::parse(&read(&dir, "report.bin")).unwrap();
    assert_eq!(
        needed::snp(&v2, SigningKey::Vcek, SnpCarried::default()),
        Err(NeedError::NoProduct("VCEK"))
    );
    let vcek_carried = SnpCarried {
        signing_cert: true,
        chain: None,
    };
    assert_eq!(
        needed::snp(&v2, SigningKey::Vcek, vcek_carried),
        Err(NeedError::NoProduct("AMD chain"))
    );
}
