#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! TDX quotes from a known platform (`tdx.rs`, `Known`): after one full verification, a quote
//! equal to it but for REPORTDATA and the signature needs one P-256 check and gets the same
//! verdict; a tampered REPORTDATA is refused; anything else, or a time outside the windows the
//! verdict relied on, is verified in full — as a fresh verifier would.

use std::path::{Path, PathBuf};

use cgx_attestation::bundle::Bundle;
use cgx_attestation::{KindClaims, Verifier, VerifierConfig};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

fn vectors() -> Option<PathBuf> {
    let found = cgx_attestation::bundle::shared_vectors(Path::new(env!("CARGO_MANIFEST_DIR")));
    if found.is_none() {
        eprintln!("SKIPPED tdx_known: no vectors (set CGX_VECTORS or place ../shared/vectors)");
    }
    found
}

fn load(dir: &Path) -> (Vec<u8>, Vec<u8>, OffsetDateTime) {
    let Bundle::Tdx { quote, collateral } = Bundle::load(dir).unwrap() else {
        panic!("not a TDX bundle");
    };
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    let at = OffsetDateTime::parse(expected["at"].as_str().unwrap(), &Rfc3339).unwrap();
    (quote, collateral, at)
}

fn verify(
    v: &Verifier,
    quote: &[u8],
    collateral: &[u8],
    at: OffsetDateTime,
) -> Result<cgx_attestation::Claims, cgx_attestation::Error> {
    let ev = cgx_attestation::Evidence::Tdx(cgx_attestation::tdx::TdxEvidence {
        quote,
        collateral_json: collateral,
    });
    v.verify(&ev, at).map(|c| c.into_claims())
}

/// The P-256 counter is process-wide: these tests take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// REPORTDATA of a v4 quote: header 48 + body offset 520.
const REPORT_DATA: std::ops::Range<usize> = 48 + 520..48 + 584;

#[test]
fn a_known_platform_costs_one_signature_and_keeps_its_verdict() {
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(v) = vectors() else { return };
    let mut seen = 0;
    for entry in std::fs::read_dir(v.join("tdx")).unwrap().flatten() {
        let dir = entry.path();
        let name = dir.display().to_string();
        let valid = std::fs::read(dir.join("expected.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .is_some_and(|e| e["valid"] == true);
        if !valid {
            continue;
        }
        seen += 1;
        let (quote, collateral, at) = load(&dir);
        let verifier = Verifier::new(VerifierConfig::default());
        let before = cgx_attestation::tdx::p256_verifications();
        let cold = verify(&verifier, &quote, &collateral, at).unwrap();
        let full = cgx_attestation::tdx::p256_verifications() - before;
        let before = cgx_attestation::tdx::p256_verifications();
        // The same instant (these vectors' CRLs expire a second or so after theirs).
        let warm = verify(&verifier, &quote, &collateral, at).unwrap();
        let fast = cgx_attestation::tdx::p256_verifications() - before;
        assert_eq!(cold, warm, "{name}: the same verdict");
        assert_eq!(fast, 1, "{name}: one signature check ({full} cold)");
        assert!(full >= 2, "{name}: {full}");
    }
    assert!(seen > 0, "no valid TDX vector");
}

#[test]
fn anything_but_a_known_quote_is_verified_in_full() {
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(v) = vectors() else { return };
    let dir = v.join("tdx/v4-b0c06f-dcapqvl-phala");
    let (quote, collateral, at) = load(&dir);
    let warm = Verifier::new(VerifierConfig::default());
    verify(&warm, &quote, &collateral, at).unwrap();
    // New REPORTDATA under the old signature: the one check there is refuses it, and so does a
    // fresh verifier.
    let mut tampered = quote.clone();
    tampered[REPORT_DATA.start] ^= 1;
    let fresh = Verifier::new(VerifierConfig::default());
    let a = verify(&warm, &tampered, &collateral, at).unwrap_err();
    let b = verify(&fresh, &tampered, &collateral, at).unwrap_err();
    assert_eq!(a.code(), b.code(), "{a} / {b}");
    // Another byte of the body (MRTD) is another quote: verified in full, refused alike.
    let mut other = quote.clone();
    other[48 + 136] ^= 1;
    let a = verify(&warm, &other, &collateral, at).unwrap_err();
    let b = verify(&fresh, &other, &collateral, at).unwrap_err();
    assert_eq!(a.code(), b.code(), "{a} / {b}");
    // Before the verdict was reached, and past the windows it relied on: in full again.
    let before = cgx_attestation::tdx::p256_verifications();
    let earlier = verify(&warm, &quote, &collateral, at - time::Duration::seconds(1));
    assert!(cgx_attestation::tdx::p256_verifications() - before >= 2);
    let fresh_earlier = verify(&fresh, &quote, &collateral, at - time::Duration::seconds(1));
    assert_eq!(
        earlier.map_err(|e| e.code()),
        fresh_earlier.map_err(|e| e.code())
    );
    // phala's PCK CRL's next update is one second after its `at`: from that second on the
    // remembered verdict no longer applies, and the quote is refused as a fresh verifier does.
    for late in [
        at + time::Duration::seconds(1),
        at + time::Duration::seconds(2),
    ] {
        let a = verify(&warm, &quote, &collateral, late).unwrap_err();
        let b = verify(&fresh, &quote, &collateral, late).unwrap_err();
        assert_eq!(a.code(), b.code(), "{a} / {b}");
    }
    // A collateral carrying another PCK chain than the quote's is refused.
    let mut coll: serde_json::Value = serde_json::from_slice(&collateral).unwrap();
    coll["pck_certificate_chain"] =
        serde_json::Value::String("-----BEGIN CERTIFICATE-----\n".into());
    let swapped = serde_json::to_vec(&coll).unwrap();
    let e = verify(&warm, &quote, &swapped, at).unwrap_err();
    assert!(e.to_string().contains("not the quote's"), "{e}");
    // Other collateral bytes are another verdict.
    let mut coll: serde_json::Value = serde_json::from_slice(&collateral).unwrap();
    coll["tcb_info"] = serde_json::Value::String(coll["tcb_info"].as_str().unwrap().replacen(
        "UpToDate",
        "OutOfDate",
        1,
    ));
    let changed = serde_json::to_vec(&coll).unwrap();
    let a = verify(&warm, &quote, &changed, at).unwrap_err();
    assert_eq!(
        a.code(),
        verify(&fresh, &quote, &changed, at).unwrap_err().code()
    );
    // The warm verifier's verdict on the real quote stands, with its own REPORTDATA.
    let again = verify(&warm, &quote, &collateral, at).unwrap();
    let KindClaims::Tdx(t) = &again.detail else {
        panic!("not TDX claims")
    };
    assert_eq!(t.report_data, hex::encode(&quote[REPORT_DATA]));
}

/// Flip one hex digit of a collateral JSON string field (a signature).
fn flip_hex(collateral: &[u8], field: &str) -> Vec<u8> {
    let mut coll: serde_json::Value = serde_json::from_slice(collateral).unwrap();
    let mut s = coll[field].as_str().unwrap().to_string();
    let c = if s.as_bytes()[10] == b'0' { "1" } else { "0" };
    s.replace_range(10..11, c);
    coll[field] = serde_json::Value::String(s);
    serde_json::to_vec(&coll).unwrap()
}

/// A platform seen for the first time by a running verifier, under Intel collateral the verifier
/// verified before (one TCB info per FMSPC, one QE identity and two CRLs serve a fleet): the
/// collateral's signatures are not checked again, the platform's own three — its PCK
/// certificate, its QE report, its quote — always are, and every refusal stands as a fresh
/// verifier's.
#[test]
fn a_new_platform_under_known_collateral_costs_its_own_signatures_only() {
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let Some(v) = vectors() else { return };
    let dir = v.join("tdx/v4-b0c06f-dcapqvl-phala");
    let (quote, collateral, at) = load(&dir);
    let stats = |v: &Verifier, name: &str| {
        v.cache_stats()
            .into_iter()
            .find(|(n, _)| *n == name)
            .unwrap()
            .1
    };
    let running = Verifier::new(VerifierConfig::default());
    let before = cgx_attestation::tdx::p256_verifications();
    let first = verify(&running, &quote, &collateral, at).unwrap();
    let full = cgx_attestation::tdx::p256_verifications() - before;
    assert_eq!(full, 9, "a verifier's first quote: every signature");
    assert_eq!(stats(&running, "tdx_collateral").entries, 1);
    running.forget_tdx_platforms();
    let before = cgx_attestation::tdx::p256_verifications();
    let new_platform = verify(&running, &quote, &collateral, at).unwrap();
    let own = cgx_attestation::tdx::p256_verifications() - before;
    assert_eq!(own, 3, "PCK certificate, QE report and quote");
    assert_eq!(first, new_platform, "the same verdict");

    let fresh = Verifier::new(VerifierConfig::default());
    let refused_alike = |tampered: &[u8], coll: &[u8], what: &str| {
        running.forget_tdx_platforms();
        let a = verify(&running, tampered, coll, at).unwrap_err();
        let b = verify(&fresh, tampered, coll, at).unwrap_err();
        assert_eq!(a.code(), b.code(), "{what}: {a} / {b}");
    };
    // The platform's signatures: the quote's (after header and body, its length field), the QE
    // report's (after the attestation key, the certification data's type and size, the
    // 384-byte report).
    let sig = 48 + 584 + 4;
    let mut bad_quote_sig = quote.clone();
    bad_quote_sig[sig] ^= 1;
    refused_alike(&bad_quote_sig, &collateral, "quote signature");
    let qe_report_sig = sig + 64 + 64 + 6 + 384;
    let mut bad_qe_sig = quote.clone();
    bad_qe_sig[qe_report_sig] ^= 1;
    refused_alike(&bad_qe_sig, &collateral, "QE report signature");
    // The collateral's signatures are checked again wherever its bytes differ from what was
    // verified, and a refused collateral is not remembered.
    for field in ["tcb_info_signature", "qe_identity_signature"] {
        let bad = flip_hex(&collateral, field);
        refused_alike(&quote, &bad, field);
    }
    assert_eq!(stats(&running, "tdx_collateral").entries, 1);
    // And the known collateral still serves the real quote.
    running.forget_tdx_platforms();
    assert_eq!(verify(&running, &quote, &collateral, at).unwrap(), first);
}
