//! Why cgx-protocol signs records itself (issue 29): one lease record signed by its `Signer`
//! (the Ed25519 key pair parsed once) against `jsonwebtoken::encode` (which parses the PKCS#8
//! key on every token), same claims, same key; verification stays jsonwebtoken's.
//!
//! `cargo run --release -p cgx-bench --example sign_cost`
use std::error::Error;
use std::time::Instant;

use cgx_protocol::records::Lease;
use cgx_protocol::signed::Signer;

fn main() -> Result<(), Box<dyn Error>> {
    let pkcs8 =
        aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&aws_lc_rs::rand::SystemRandom::new())
            .map_err(|_| "key generation failed")?;
    let pkcs8 = pkcs8.as_ref().to_vec();
    let lease = Lease {
        lease: "l0123456789abcdef01234567".into(),
        job: "j0123456789abcdef01234567".into(),
        tenant: "acme".into(),
        node: "n".repeat(52),
        gpus: vec![0, 1, 2, 3],
        resources: vec!["acme/weights/llama".into()],
        node_key: "k".repeat(43),
        iss: "cgx-broker".into(),
        until: 1_800_000_000,
        start: 1_700_000_000,
        window_secs: 0,
        workload: None,
    };
    // The claims ours writes: the envelope's aud/iat/exp around the record's body.
    let mut claims = serde_json::to_value(&lease)?;
    if let Some(m) = claims.as_object_mut() {
        m.insert("aud".into(), "cgx-kbs".into());
        m.insert("iat".into(), 1_700_000_000.into());
        m.insert("exp".into(), 1_700_000_120.into());
    }
    let _ = jsonwebtoken::crypto::CryptoProvider::install_default(
        &jsonwebtoken::crypto::aws_lc::DEFAULT_PROVIDER,
    );
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::EdDSA);
    header.typ = Some("cgx-lease+jwt".into());
    let signer = Signer::from_pkcs8(&pkcs8)?;
    let n = 20_000;
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _round in 0..5 {
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(signer.sign(&lease, 1_700_000_000, 1_700_000_120)?);
        }
        ours.push(t.elapsed().as_secs_f64() * 1e6 / f64::from(n));
        let t = Instant::now();
        for _ in 0..n {
            let key = jsonwebtoken::EncodingKey::from_ed_der(&pkcs8);
            std::hint::black_box(jsonwebtoken::encode(&header, &claims, &key)?);
        }
        theirs.push(t.elapsed().as_secs_f64() * 1e6 / f64::from(n));
    }
    ours.sort_by(f64::total_cmp);
    theirs.sort_by(f64::total_cmp);
    println!(
        "sign one lease: cgx Signer {:.2} us, jsonwebtoken::encode {:.2} us (medians of 5 x {n}); ratio {:.2}x",
        ours[2],
        theirs[2],
        theirs[2] / ours[2]
    );
    Ok(())
}
