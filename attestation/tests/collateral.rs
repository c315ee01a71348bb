#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The on-disk collateral store: content addressing, validity windows read from content,
//! freshness at a given time, no eviction by older answers, corruption detection, export/import.

use cgx_attestation::collateral::{CollateralKey, CollateralStore, Freshness, validity_window};
use cgx_attestation::sim::{SimAmd, default_tcb};
use cgx_attestation::snp::{Product, SigningKey};

fn tmp(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("cgx-coll-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

#[test]
fn store_keeps_windows_and_freshness() {
    let t = 1_800_000_000;
    let amd = SimAmd::generate(
        Product::Turin,
        SigningKey::Vcek,
        default_tcb(Product::Turin),
        [1; 64],
        t,
    )
    .unwrap();
    let key = CollateralKey::AmdVcek {
        product: Product::Turin,
        hw_id: vec![1; 8],
        tcb: default_tcb(Product::Turin),
    }
    .path();
    assert_eq!(
        key,
        "amd/vcek/v1/Turin/0101010101010101?blSPL=9&teeSPL=0&snpSPL=23&ucodeSPL=72&fmcSPL=1"
    );
    let dir = tmp("a");
    let mut store = CollateralStore::open(&dir).unwrap();
    let e = store.put(&key, &amd.leaf_der, "test", t).unwrap();
    assert_eq!(
        (e.not_before, e.not_after.is_some()),
        (Some(t - 86_400), true)
    );
    let (bytes, fresh, _) = store.get(&key, t).unwrap().unwrap();
    assert_eq!(bytes, amd.leaf_der);
    assert_eq!(fresh, Freshness::Valid);
    assert_eq!(
        store.get(&key, t - 200_000).unwrap().unwrap().1,
        Freshness::NotYetValid
    );
    assert_eq!(
        store.get(&key, t + 20 * 365 * 86_400).unwrap().unwrap().1,
        Freshness::Expired
    );
    assert!(store.get("amd/vcek/v1/Milan/unknown", t).unwrap().is_none());

    // The chain's window is the intersection of its certificates'; a CRL's is this/next update.
    let chain = amd.cert_chain_pem();
    assert!(validity_window(chain.as_bytes()).1.is_some());
    let crl = amd.crl(&[], t - 10, t + 1000).unwrap();
    assert_eq!(validity_window(&crl), (Some(t - 10), Some(t + 1000)));

    // A replayed older CRL does not evict a newer one; a newer one replaces it.
    let ckey = CollateralKey::AmdCrl {
        product: Product::Turin,
        vlek: false,
    }
    .path();
    store.put(&ckey, &crl, "new", t).unwrap();
    let old = amd.crl(&[], t - 5000, t + 10).unwrap();
    store.put(&ckey, &old, "replay", t).unwrap();
    assert_eq!(store.get(&ckey, t).unwrap().unwrap().2.source, "new");
    let newer = amd.crl(&[], t, t + 5000).unwrap();
    store.put(&ckey, &newer, "newer", t).unwrap();
    assert_eq!(store.get(&ckey, t).unwrap().unwrap().2.source, "newer");

    // Reopened from disk, the index is the same; export and import carry everything.
    let again = CollateralStore::open(&dir).unwrap();
    assert_eq!(again.list().count(), 2);
    let out = tmp("b");
    assert_eq!(again.export(&out, t).unwrap(), 2);
    let mut third = CollateralStore::open(&tmp("c")).unwrap();
    assert_eq!(third.import(&out, t).unwrap(), 2);
    assert_eq!(third.get(&key, t).unwrap().unwrap().0, amd.leaf_der);

    // A corrupted object is an error, never collateral; bad keys are refused.
    let sha = again
        .list()
        .find(|(k, _)| **k == key)
        .unwrap()
        .1
        .sha256
        .clone();
    std::fs::write(dir.join("objects").join(&sha), b"tampered").unwrap();
    assert_eq!(again.get(&key, t).unwrap_err().code(), "collateral_invalid");
    assert!(store.put("../escape", b"x", "t", t).is_err());
    for d in ["a", "b", "c"] {
        let _ = std::fs::remove_dir_all(tmp(d));
    }
}

#[test]
fn intel_collateral_window_from_real_vectors() {
    let Some(v) =
        cgx_attestation::bundle::shared_vectors(std::path::Path::new(env!("CARGO_MANIFEST_DIR")))
    else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED intel_collateral_window_from_real_vectors: no vectors"
        );
        return;
    };
    let json = std::fs::read(v.join("tdx/v4-b0c06f-dcapqvl-phala/collateral.json")).unwrap();
    let (nb, na) = validity_window(&json);
    let at = 1_752_919_234; // 2025-07-19T10:00:34Z, the bundle's verification time
    assert!(nb.unwrap() <= at && at <= na.unwrap(), "{nb:?} {na:?}");
    // The expired variant is the same collateral judged later: its window has closed by then.
    let late = 1_787_479_234; // 2026-08-23T10:00:34Z, that variant's verification time
    assert!(na.unwrap() < late);
}
