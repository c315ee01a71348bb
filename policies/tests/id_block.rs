#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! A launch's ID keys through to appraisal: sign an ID block for a launch digest (`cgx-measure`),
//! check the ID auth as the AMD-SP would, make a (simulated) report carrying the digests of the
//! keys that signed it, and appraise it with the default policy against reference values that
//! name the measurement and the keys: executables affirming; a report some other ID key signed,
//! or one with no ID block, names the expected and the found key.

use cgx_attestation::sim::{SimAmd, SnpReportOptions, default_tcb};
use cgx_attestation::snp::{Product, SigningKey};
use cgx_attestation::{SimTrust, Verifier, VerifierConfig};
use cgx_measure::snp::id_block::{self, IdBlock, SigningKey as IdKey};
use cgx_policies::{APPRAISAL_POLICY, Appraiser, PolicyEngine};
use time::OffsetDateTime;

/// The default appraisal policy with `refs`, trusting `amd`'s simulated root.
fn default_appraiser(amd: &SimAmd, refs: &str) -> Appraiser {
    Appraiser::new(
        Verifier::new(VerifierConfig {
            sim: SimTrust::Pinned(vec![amd.root_pin()]),
        }),
        PolicyEngine::new("default", APPRAISAL_POLICY, refs).unwrap(),
        cgx_attestation::results::ResultSigner::generate().unwrap(),
    )
}

#[test]
fn reference_values_naming_id_keys_hold_launches_to_them() {
    let now = OffsetDateTime::now_utc();
    let t = now.unix_timestamp();
    let measurement = [0x5c; 48];
    let (id_key, author_key) = (IdKey::generate().unwrap(), IdKey::generate().unwrap());
    let block = IdBlock {
        launch_digest: measurement,
        family_id: [1; 16],
        image_id: [2; 16],
        guest_svn: 1,
        policy: 0x30000,
    };
    let auth = id_block::id_auth(&block, &id_key, &author_key).unwrap();
    let (id_digest, author_digest) = id_block::verify_id_auth(&block.to_bytes(), &auth).unwrap();
    assert_eq!(id_digest, id_key.digest());

    let amd = SimAmd::generate(
        Product::Milan,
        SigningKey::Vcek,
        default_tcb(Product::Milan),
        [3; 64],
        t,
    )
    .unwrap();
    let refs = serde_json::json!({"snp": {
        "measurements": [hex::encode(measurement)],
        "id_key_digests": [hex::encode(id_digest)],
        "author_key_digests": [hex::encode(author_digest)],
    }})
    .to_string();
    let appraiser = default_appraiser(&amd, &refs);
    let appraise = |id: [u8; 48], author: [u8; 48]| {
        let bundle = amd
            .bundle(&SnpReportOptions {
                measurement,
                id_key_digest: id,
                author_key_digest: author,
                ..Default::default()
            })
            .unwrap();
        appraiser
            .appraise(&bundle.evidence(), now, t, None, None)
            .unwrap()
    };
    let executables = |a: &cgx_policies::appraisal::Appraisal| {
        a.first()
            .unwrap()
            .outcome
            .trust_vector
            .get("executables")
            .copied()
    };

    // The image's keys: the measurement and both keys are recognised.
    let ok = appraise(id_digest, author_digest);
    assert_eq!(executables(&ok), Some(2), "{:?}", ok.violations());
    assert!(
        ok.violations().iter().all(|v| !v.contains("key")),
        "{:?}",
        ok.violations()
    );
    let cgx_attestation::KindClaims::Snp(claims) = &ok.first().unwrap().claims.detail else {
        panic!("not SNP claims");
    };
    assert_eq!(claims.id_key_digest, hex::encode(id_digest));
    assert_eq!(claims.author_key_digest, hex::encode(author_digest));

    // Another ID key (the same author): refused, naming both digests.
    let other = IdKey::generate().unwrap().digest();
    let bad = appraise(other, author_digest);
    assert_eq!(executables(&bad), Some(33));
    let v = bad.violations().join("\n");
    assert!(
        v.contains("snp_id_key_not_allowed") && v.contains(&hex::encode(other)),
        "{v}"
    );
    assert!(v.contains("snp.id_key_digests"), "{v}");
    // No ID block at all: both keys are missing.
    let none = appraise([0; 48], [0; 48]);
    let v = none.violations().join("\n");
    assert!(
        v.contains("snp_id_key_not_allowed") && v.contains("snp_author_key_not_allowed"),
        "{v}"
    );
}

/// Keys named by an image's entry (`snp.images`, as `cgx measure snp --reference-values` writes
/// it) bind reports of that image's measurement only: an unkeyed image beside it still
/// appraises, and the keyed image's measurement with another ID key does not.
#[test]
fn image_entries_bind_keys_to_their_measurement_only() {
    let now = OffsetDateTime::now_utc();
    let t = now.unix_timestamp();
    let (keyed, plain) = ([0x11u8; 48], [0x22u8; 48]);
    let id_key = IdKey::generate().unwrap().digest();
    let refs = serde_json::json!({"snp": {
        "measurements": [hex::encode(keyed), hex::encode(plain)],
        "images": {
            "signed": {"measurement": hex::encode(keyed), "id_key_digest": hex::encode(id_key)},
            "plain": {"measurement": hex::encode(plain)},
        },
    }})
    .to_string();
    let amd = SimAmd::generate(
        Product::Genoa,
        SigningKey::Vcek,
        default_tcb(Product::Genoa),
        [4; 64],
        t,
    )
    .unwrap();
    let appraiser = default_appraiser(&amd, &refs);
    let executables = |measurement: [u8; 48], id: [u8; 48]| {
        let bundle = amd
            .bundle(&SnpReportOptions {
                measurement,
                id_key_digest: id,
                ..Default::default()
            })
            .unwrap();
        let a = appraiser
            .appraise(&bundle.evidence(), now, t, None, None)
            .unwrap();
        (
            a.first()
                .unwrap()
                .outcome
                .trust_vector
                .get("executables")
                .copied(),
            a.violations().join("\n"),
        )
    };
    assert_eq!(executables(plain, [0; 48]).0, Some(2));
    assert_eq!(executables(keyed, id_key).0, Some(2));
    let (code, v) = executables(keyed, [9; 48]);
    assert_eq!(code, Some(33), "{v}");
    assert!(
        v.contains("snp_image_id_key_mismatch") && v.contains(&hex::encode(id_key)),
        "{v}"
    );
    let (code, v) = executables(keyed, [0; 48]);
    assert_eq!(code, Some(33), "{v}");
}
