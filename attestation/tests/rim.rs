#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! RIM signature checks refuse tampering, including signature-wrapping shapes. Uses a real
//! NVIDIA RIM from the shared vectors; skipped with a message where they are absent.

use cgx_attestation::crypto::DEFAULT_PROVIDER;
use cgx_attestation::nvidia::rim::{self, RimOptions};

fn rim_text() -> Option<String> {
    let root =
        cgx_attestation::bundle::shared_vectors(std::path::Path::new(env!("CARGO_MANIFEST_DIR")))?;
    let p = root.join("nvidia/rims/1010_0200_882_960074001A_PROD.swidtag");
    std::fs::read_to_string(p).ok()
}

/// A time at which every certificate of this RIM's chain is valid.
const AT: i64 = 1_700_000_000; // 2023-11-14

fn check(xml: &str) -> Result<rim::VerifiedRim, cgx_attestation::Error> {
    rim::verify(xml.as_bytes(), &DEFAULT_PROVIDER, AT, RimOptions::default())
}

#[test]
fn rim_tampering_is_refused() {
    let Some(xml) = rim_text() else {
        skip("SKIPPED rim_tampering_is_refused: no vectors");
        return;
    };
    let ok = check(&xml).unwrap();
    // Canonicalization: whitespace inside a tag and an XML declaration do not change the
    // signed form, so they still verify.
    let same = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n{}",
        xml.replacen("<ns0:Entity ", "<ns0:Entity \t ", 1)
    );
    assert_ne!(same, xml);
    check(&same).unwrap();
    assert!(!ok.signer_expired);
    assert_eq!(ok.version, "96.00.74.00.1A");
    let cases: Vec<(&str, String)> = vec![
        (
            "golden value",
            xml.replacen("ns2:Hash0=\"c", "ns2:Hash0=\"d", 1),
        ),
        (
            "whitespace in content",
            xml.replacen("\n    <ns0:Entity", "\n     <ns0:Entity", 1),
        ),
        ("signature value", {
            let i = xml.find("<ds:SignatureValue>").unwrap() + "<ds:SignatureValue>".len();
            let c = if &xml[i..i + 1] == "A" { "B" } else { "A" };
            format!("{}{}{}", &xml[..i], c, &xml[i + 1..])
        }),
        ("digest value", {
            let i = xml.find("<ds:DigestValue>").unwrap() + "<ds:DigestValue>".len();
            let c = if &xml[i..i + 1] == "A" { "B" } else { "A" };
            format!("{}{}{}", &xml[..i], c, &xml[i + 1..])
        }),
        ("reference URI", xml.replacen("<ds:Reference URI=\"\">", "<ds:Reference URI=\"#x\">", 1)),
        (
            "transforms",
            xml.replacen(
                "<ds:Transform Algorithm=\"http://www.w3.org/2000/09/xmldsig#enveloped-signature\"/>",
                "",
                1,
            ),
        ),
        (
            "second signature (wrapping)",
            {
                let s = xml.find("<ds:Signature").unwrap();
                let e = xml.find("</ds:Signature>").unwrap() + "</ds:Signature>".len();
                let sig = &xml[s..e];
                xml.replacen("</SoftwareIdentity>", &format!("{sig}</SoftwareIdentity>"), 1)
            },
        ),
        (
            "signer certificate dropped",
            {
                let s = xml.find("<ds:X509Certificate>").unwrap();
                let e = xml.find("</ds:X509Certificate>").unwrap() + "</ds:X509Certificate>".len();
                format!("{}{}", &xml[..s], &xml[e..])
            },
        ),
        ("DOCTYPE", format!("<!DOCTYPE x>{xml}")),
        ("truncated", xml[..xml.len() / 2].to_string()),
    ];
    for (what, t) in cases {
        assert_ne!(t, xml, "{what}: mutation did not apply");
        let e = check(&t).expect_err(what);
        eprintln!("{what}: {} ({e})", e.code());
    }
    // Outside the signer's validity window, refused unless told to ignore signer expiry.
    let late = 1_900_000_000; // 2030
    let e = rim::verify(
        xml.as_bytes(),
        &DEFAULT_PROVIDER,
        late,
        RimOptions::default(),
    )
    .unwrap_err();
    assert_eq!(e.code(), "certificate_not_valid_at_time");
    let r = rim::verify(
        xml.as_bytes(),
        &DEFAULT_PROVIDER,
        late,
        RimOptions {
            ignore_signer_expiry: true,
        },
    )
    .unwrap();
    assert!(r.signer_expired);
}

/// Say that a test skipped, past libtest's output capture (a plain `eprintln!` in a passing
/// test is swallowed), so a user without the vectors sees it.
fn skip(msg: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{msg}");
}
