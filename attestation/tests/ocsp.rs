#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! OCSP for the NVIDIA device chain: responses the simulator signs as NVIDIA's responder would
//! (by the issuer, or by a delegated responder) are checked at an explicit time; revoked,
//! unknown, stale, future, foreign, forged and garbage responses are each refused with a
//! specific error, and the claims say whether revocation was checked. Real chains from the
//! vectors give the CertIDs NVIDIA's verifier asks about.

use cgx_attestation::bundle::{Bundle, shared_vectors};
use cgx_attestation::nvidia::ocsp::{self, CertStatus, OcspResponse};
use cgx_attestation::sim::{SimGpu, SimOcsp, SimOcspSigner};
use cgx_attestation::{KindClaims, SimTrust, Verifier, VerifierConfig};
use time::OffsetDateTime;

fn setup() -> (SimGpu, Verifier, Bundle, i64) {
    let t = OffsetDateTime::now_utc().unix_timestamp();
    let g = SimGpu::generate(t).unwrap();
    let v = Verifier::new(VerifierConfig {
        sim: SimTrust::Pinned(vec![g.root_pin()]),
    });
    let b = g.bundle([3; 32], 4).unwrap();
    (g, v, b, t)
}

fn with_ocsp(b: &Bundle, responses: Vec<Vec<u8>>) -> Bundle {
    let Bundle::Nvidia {
        report, cert_chain, ..
    } = b
    else {
        panic!()
    };
    Bundle::Nvidia {
        report: report.clone(),
        cert_chain: cert_chain.clone(),
        ocsp: responses,
    }
}

fn ocsp_claim(v: &Verifier, b: &Bundle, at: i64) -> Result<String, cgx_attestation::Error> {
    let at = OffsetDateTime::from_unix_timestamp(at).unwrap();
    let c = v.verify(&b.evidence(), at)?.into_claims();
    let KindClaims::Nvidia(n) = c.detail else {
        panic!()
    };
    Ok(n.ocsp)
}

fn response(g: &SimGpu, status: CertStatus, this: i64, next: Option<i64>) -> Vec<u8> {
    g.ocsp_response(&SimOcsp {
        status,
        this_update: this,
        next_update: next,
        signer: SimOcspSigner::Issuer,
    })
    .unwrap()
}

#[test]
fn good_response_is_checked_and_absence_is_reported() {
    let (g, v, b, t) = setup();
    assert_eq!(ocsp_claim(&v, &b, t).unwrap(), "good");
    assert_eq!(
        ocsp_claim(&v, &with_ocsp(&b, vec![]), t).unwrap(),
        "not_checked"
    );
    // A response without nextUpdate is good while it is young.
    let young = response(&g, CertStatus::Good, t - 60, None);
    assert_eq!(
        ocsp_claim(&v, &with_ocsp(&b, vec![young]), t).unwrap(),
        "good"
    );
}

#[test]
fn revoked_unknown_stale_and_future_are_refused() {
    let (g, v, b, t) = setup();
    let revoked = response(
        &g,
        CertStatus::Revoked {
            at: t - 3600,
            reason: Some(1),
        },
        t - 60,
        Some(t + 3600),
    );
    let e = ocsp_claim(&v, &with_ocsp(&b, vec![revoked]), t).unwrap_err();
    assert_eq!(e.code(), "revoked", "{e}");
    assert!(e.to_string().contains("OCSP"), "{e}");
    for (what, r, at) in [
        (
            "unknown",
            response(&g, CertStatus::Unknown, t - 60, Some(t + 3600)),
            t,
        ),
        (
            "past nextUpdate",
            response(&g, CertStatus::Good, t - 7200, Some(t - 3600)),
            t,
        ),
        (
            "from the future",
            response(&g, CertStatus::Good, t + 3600, Some(t + 7200)),
            t,
        ),
        (
            "old without nextUpdate",
            response(&g, CertStatus::Good, t - 3 * 86_400, None),
            t,
        ),
    ] {
        let e = ocsp_claim(&v, &with_ocsp(&b, vec![r]), at).unwrap_err();
        assert_eq!(e.code(), "ocsp_invalid", "{what}: {e}");
    }
    // The bundle's own 30-day response is refused once it has expired, though the chain is
    // still valid then.
    let e = ocsp_claim(&v, &b, t + 40 * 86_400).unwrap_err();
    assert_eq!(e.code(), "ocsp_invalid", "{e}");
}

#[test]
fn foreign_forged_and_garbage_responses_are_refused() {
    let (g, v, b, t) = setup();
    // Another GPU's responder speaks of another certificate.
    let other = SimGpu::generate(t).unwrap();
    let e = ocsp_claim(&v, &with_ocsp(&b, vec![other.good_ocsp().unwrap()]), t).unwrap_err();
    assert_eq!(e.code(), "ocsp_invalid", "{e}");
    assert!(e.to_string().contains("no OCSP response holds"), "{e}");
    // A flipped signature byte.
    let mut forged = g.good_ocsp().unwrap();
    let last = forged.len() - 1;
    forged[last] ^= 1;
    let e = ocsp_claim(&v, &with_ocsp(&b, vec![forged]), t).unwrap_err();
    assert_eq!(e.code(), "ocsp_invalid", "{e}");
    // Garbage, and a responder that said tryLater.
    for junk in [
        b"not der".to_vec(),
        vec![0x30, 0x03, 0x0A, 0x01, 0x03],
        vec![],
    ] {
        let e = ocsp_claim(&v, &with_ocsp(&b, vec![junk]), t).unwrap_err();
        assert_eq!(e.code(), "ocsp_invalid", "{e}");
    }
    let e = ocsp_claim(
        &v,
        &with_ocsp(&b, vec![vec![0x30, 0x03, 0x0A, 0x01, 0x03]]),
        t,
    )
    .unwrap_err();
    assert!(e.to_string().contains("tryLater"), "{e}");
    // A good response next to garbage: garbage is an error, not skipped.
    let e = ocsp_claim(
        &v,
        &with_ocsp(&b, vec![b"junk".to_vec(), g.good_ocsp().unwrap()]),
        t,
    )
    .unwrap_err();
    assert_eq!(e.code(), "ocsp_invalid", "{e}");
    // Mutations never panic and never turn into a different good answer.
    let good = g.good_ocsp().unwrap();
    for i in 0..good.len() {
        for bit in [0x01u8, 0x80] {
            let mut m = good.clone();
            m[i] ^= bit;
            if let Ok(s) = ocsp_claim(&v, &with_ocsp(&b, vec![m.clone()]), t) {
                // Only bytes nobody signs may change (the outer response status wrapper cannot).
                panic!("mutation at {i} ({bit:#x}) still verified as {s}");
            }
        }
    }
}

#[test]
fn delegated_responder_needs_the_ocsp_signing_eku() {
    let (g, v, b, t) = setup();
    let delegated = |eku| {
        g.ocsp_response(&SimOcsp {
            status: CertStatus::Good,
            this_update: t - 60,
            next_update: Some(t + 3600),
            signer: SimOcspSigner::Delegated { eku },
        })
        .unwrap()
    };
    assert_eq!(
        ocsp_claim(&v, &with_ocsp(&b, vec![delegated(true)]), t).unwrap(),
        "good"
    );
    let e = ocsp_claim(&v, &with_ocsp(&b, vec![delegated(false)]), t).unwrap_err();
    assert_eq!(e.code(), "ocsp_invalid", "{e}");
    assert!(e.to_string().contains("OCSPSigning"), "{e}");
    // A delegate of another root is not a delegate of ours.
    let other = SimGpu::generate(t).unwrap();
    let foreign = other
        .ocsp_response(&SimOcsp {
            status: CertStatus::Good,
            this_update: t - 60,
            next_update: Some(t + 3600),
            signer: SimOcspSigner::Delegated { eku: true },
        })
        .unwrap();
    assert!(ocsp_claim(&v, &with_ocsp(&b, vec![foreign]), t).is_err());
}

#[test]
fn bundles_carry_responses_through_disk() {
    let (_, v, b, t) = setup();
    let dir = std::env::temp_dir().join(format!("cgx-ocsp-bundle-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    b.write(&dir).unwrap();
    assert!(dir.join("device-0.ocsp").is_file());
    let back = Bundle::load(&dir).unwrap();
    assert_eq!(back, b);
    assert_eq!(ocsp_claim(&v, &back, t).unwrap(), "good");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn real_device_chains_give_the_cert_ids_nvidia_asks_about() {
    let Some(vectors) = shared_vectors(std::path::Path::new(env!("CARGO_MANIFEST_DIR"))) else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED real_device_chains_give_the_cert_ids_nvidia_asks_about: no ../shared/vectors (set CGX_VECTORS)"
        );
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must have ../shared/vectors"
        );
        return;
    };
    for sample in ["h100-nvtrust-sample", "h100-trustee-coco"] {
        let pem =
            std::fs::read(vectors.join("nvidia").join(sample).join("cert_chain.pem")).unwrap();
        // Leaf (FMC, minted at boot) and root are not asked about: BROM, Provisioner ICA and
        // GH100 Identity are.
        let ids = ocsp::chain_cert_ids(&pem).unwrap();
        assert_eq!(ids.len(), 3, "{sample}");
        for id in &ids {
            assert_eq!(id.issuer_name_hash.len(), 48);
            assert_eq!(id.issuer_key_hash.len(), 48);
        }
        // Each certificate's issuer is the next one: the key hash of id i names cert i+2's key.
        assert_ne!(ids[0].issuer_key_hash, ids[1].issuer_key_hash);
        let req = ocsp::request(&ids, None);
        assert_eq!(req[0], 0x30);
        // The response parser refuses a request (it is not a response).
        assert!(OcspResponse::parse(&req).is_err());
    }
}
