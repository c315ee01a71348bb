//! Seed corpora for the fuzz targets.
//!
//! `seeds OUT` writes simulator-made inputs (what is committed under `fuzz/corpus/`);
//! `seeds OUT VECTORS` adds inputs cut from the real-hardware vectors (for local runs only: the
//! vectors are never copied into the repository).

use std::path::{Path, PathBuf};

use cgx_attestation::bundle::Bundle;
use cgx_attestation::fuzz::{NOW, SEPARATOR};
use cgx_attestation::sim::{self, SimAmd, SimGpu, SnpReportOptions};
use cgx_attestation::snp::{Product, SigningKey};
use cgx_protocol::kbs::jwe::{Curve, TeeKey};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn join(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(SEPARATOR);
        }
        out.extend_from_slice(p);
    }
    out
}

struct Out(PathBuf);

impl Out {
    fn put(&self, target: &str, name: &str, bytes: &[u8]) -> Res<()> {
        let dir = self.0.join(target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(name), bytes)?;
        Ok(())
    }
}

fn pem_ders(pem: &[u8]) -> Vec<Vec<u8>> {
    cgx_protocol::kbs::der::pem_blocks(&String::from_utf8_lossy(pem), "CERTIFICATE")
}

/// Inputs for every target from one evidence bundle.
fn from_bundle(out: &Out, name: &str, b: &Bundle) -> Res<()> {
    match b {
        Bundle::Snp {
            report,
            signing_cert,
            cert_chain,
            crls,
            ..
        } => {
            out.put(
                "snp",
                name,
                &join(&[report, &aux_table(signing_cert, cert_chain)]),
            )?;
            out.put(
                "x509",
                &format!("{name}-vcek"),
                &join(&[signing_cert, crls.first().map_or(&[][..], |c| c)]),
            )?;
            out.put(
                "x509",
                &format!("{name}-chain"),
                &join(&[cert_chain, crls.first().map_or(&[][..], |c| c)]),
            )?;
            let mut parts: Vec<&[u8]> = vec![report, signing_cert, cert_chain];
            parts.extend(crls.iter().map(Vec::as_slice));
            let mut ev = vec![0u8];
            ev.extend(join(&parts));
            out.put("evidence", name, &ev)?;
        }
        Bundle::Tdx { quote, collateral } => {
            out.put("tdx_quote", name, quote)?;
            let mut ev = vec![1u8];
            ev.extend(join(&[quote, collateral]));
            out.put("evidence", name, &ev)?;
        }
        Bundle::Nvidia {
            report,
            cert_chain,
            ocsp,
        } => {
            out.put("spdm", name, report)?;
            out.put("x509", &format!("{name}-chain"), cert_chain)?;
            let ders = pem_ders(cert_chain);
            if let (Some(resp), Some(leaf), Some(issuer)) =
                (ocsp.first(), ders.first(), ders.get(1))
            {
                out.put("ocsp", name, &join(&[resp, leaf, issuer]))?;
            }
            let mut parts: Vec<&[u8]> = vec![report, cert_chain];
            parts.extend(ocsp.iter().map(Vec::as_slice));
            let mut ev = vec![2u8];
            ev.extend(join(&parts));
            out.put("evidence", name, &ev)?;
        }
    }
    Ok(())
}

/// An SNP extended-report certificate table (GHCB spec, Table 9) holding the VCEK, ASK and ARK.
fn aux_table(vcek: &[u8], chain_pem: &[u8]) -> Vec<u8> {
    const GUIDS: [[u8; 16]; 3] = [
        // VCEK 63da758d-e664-4564-adc5-f4b93be8accd, ASK 4ab7b379-bbac-4fe4-a02f-05aef327c782,
        // ARK c0b406a4-a803-4952-9743-3fb6014cd0ae (mixed-endian GUID encoding).
        [
            0x8d, 0x75, 0xda, 0x63, 0x64, 0xe6, 0x64, 0x45, 0xad, 0xc5, 0xf4, 0xb9, 0x3b, 0xe8,
            0xac, 0xcd,
        ],
        [
            0x79, 0xb3, 0xb7, 0x4a, 0xac, 0xbb, 0xe4, 0x4f, 0xa0, 0x2f, 0x05, 0xae, 0xf3, 0x27,
            0xc7, 0x82,
        ],
        [
            0xa4, 0x06, 0xb4, 0xc0, 0x03, 0xa8, 0x52, 0x49, 0x97, 0x43, 0x3f, 0xb6, 0x01, 0x4c,
            0xd0, 0xae,
        ],
    ];
    let mut certs = vec![vcek.to_vec()];
    certs.extend(pem_ders(chain_pem));
    let n = certs.len().min(3);
    let mut table = Vec::new();
    let mut data = Vec::new();
    let base = 24 * (n + 1);
    for (guid, cert) in GUIDS.iter().zip(&certs) {
        table.extend_from_slice(guid);
        table.extend_from_slice(&((base + data.len()) as u32).to_le_bytes());
        table.extend_from_slice(&(cert.len() as u32).to_le_bytes());
        data.extend_from_slice(cert);
    }
    table.extend_from_slice(&[0u8; 24]);
    table.extend(data);
    table
}

/// The host channel: a guest's request and the host's answer, frame by frame.
fn channel(out: &Out) -> Res<()> {
    use cgx_channel::frame::Frame;
    let frames = [
        Frame::Open { stream: 1, target: "kbs" },
        Frame::Data { stream: 1, bytes: b"\x16\x03\x01\x00\x05hello" },
        Frame::Credit { stream: 1, bytes: 4096 },
        Frame::Fin { stream: 1 },
        Frame::Reset { stream: 2, reason: "connect: refused" },
        Frame::Open { stream: 3, target: "store/llama.age" },
    ];
    let mut all = vec![0u8];
    for (i, f) in frames.iter().enumerate() {
        let mut one = vec![5u8];
        f.encode(&mut one).map_err(|e| e.to_string())?;
        f.encode(&mut all).map_err(|e| e.to_string())?;
        out.put("channel", &format!("frame-{i}"), &one)?;
    }
    out.put("channel", "conversation", &all)?;
    Ok(())
}

fn simulated(out: &Out) -> Res<()> {
    channel(out)?;
    for (i, (product, key)) in [
        (Product::Milan, SigningKey::Vcek),
        (Product::Genoa, SigningKey::Vlek),
        (Product::Turin, SigningKey::Vcek),
    ]
    .into_iter()
    .enumerate()
    {
        let amd = SimAmd::generate(
            product,
            key,
            sim::default_tcb(product),
            [i as u8 + 1; 64],
            NOW,
        )?;
        let mut b = amd.bundle(&SnpReportOptions::default())?;
        if let Bundle::Snp { crls, .. } = &mut b {
            crls.push(amd.crl(&[7, 9], NOW - 3600, NOW + 86_400)?);
        }
        from_bundle(out, &format!("sim-{}-{}", product.name(), i), &b)?;
    }
    let gpu = SimGpu::generate(NOW)?;
    from_bundle(out, "sim-gpu", &gpu.bundle([5; 32], 4)?)?;

    // TDX: no simulator; a v4 TD quote's skeleton (header: version 4, ECDSA P-256 key,
    // TEE type 0x81; a zero TD 1.0 body; no signature data), real quotes come from the vectors.
    let mut quote = vec![0u8; 48 + 584 + 4];
    quote[0..2].copy_from_slice(&4u16.to_le_bytes());
    quote[2..4].copy_from_slice(&2u16.to_le_bytes());
    quote[4..8].copy_from_slice(&0x81u32.to_le_bytes());
    out.put("tdx_quote", "skeleton", &quote)?;
    let mut ev = vec![1u8];
    ev.extend(join(&[&quote, b"{}"]));
    out.put("evidence", "tdx-skeleton", &ev)?;

    // RIM: the SWID skeleton with an enveloped signature, as NVIDIA publishes them.
    out.put("rim", "skeleton.xml", RIM_SKELETON.as_bytes())?;

    // JWE: a response to each key kind, and the JWKs themselves.
    let kbs_tee = TeeKey::generate_ec(Curve::P384)?;
    for (n, k) in [
        ("p256", TeeKey::generate_ec(Curve::P256)?),
        ("p384", kbs_tee),
        ("rsa", TeeKey::generate_rsa()?),
    ] {
        let pk = k.public()?;
        out.put("jwe", &format!("jwk-{n}"), &serde_json::to_vec(&pk)?)?;
        let r = cgx_protocol::kbs::jwe::encrypt(&pk, b"a resource")?;
        out.put("jwe", &format!("response-{n}"), &serde_json::to_vec(&r)?)?;
    }

    // age: files encrypted to the fuzz identity (empty, one chunk, two chunks).
    let id = cgx_age::Identity::parse(include_str!("../fuzz_targets/age_identity.txt").trim())?;
    for (n, len) in [
        ("empty", 0usize),
        ("small", 100),
        ("two-chunks", 65_536 + 10),
    ] {
        let plain = vec![0x5a; len];
        let mut file = Vec::new();
        cgx_age::encrypt(
            &id.recipient()?,
            &mut &plain[..],
            len as u64,
            &mut file,
            1,
            &mut |_| {},
        )?;
        out.put("age", n, &file)?;
    }

    // KBS: an auth request, an attestation from a simulated node with a GPU, admin bodies and
    // credentials.
    out.put(
        "kbs_request",
        "auth",
        &[
            &[0u8][..],
            br#"{"version":"0.4.0","tee":"snp","extra-params":""}"#,
        ]
        .concat(),
    )?;
    let node = cgx_kbs::sim::SimNode::generate(1, [3; 48], NOW)?;
    let key = TeeKey::generate_ec(Curve::P256)?;
    let att = cgx_protocol::kbs::rcar::attestation(&key, &node, "bm9uY2U")?;
    let mut body = vec![1u8];
    body.extend(serde_json::to_vec(&att)?);
    out.put("kbs_request", "attest-snp-gpu", &body)?;
    let sample = r#"{"runtime-data":{"nonce":"bm9uY2U","tee-pubkey":{"kty":"EC","crv":"P-256","alg":"ES256","x":"AAAA","y":"AAAA"}},"tee-evidence":{"primary_evidence":{"svn":"1","report_data":"AAAA"},"additional_evidence":""}}"#;
    out.put(
        "kbs_request",
        "attest-sample",
        &[&[1u8][..], sample.as_bytes()].concat(),
    )?;
    let policy = base64::Engine::encode(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD,
        "package policy\ndefault allow := false\nallow if { input.submods.cpu0.ear_status == \"affirming\" }\n",
    );
    out.put(
        "kbs_request",
        "policy",
        &[&[2u8][..], format!(r#"{{"policy":"{policy}"}}"#).as_bytes()].concat(),
    )?;
    out.put("kbs_request", "path", b"\x02default/key/tenant-a")?;
    out.put(
        "kbs_request",
        "jwt",
        b"\x03eyJhbGciOiJFZERTQSJ9.eyJpYXQiOjEsImV4cCI6MiwiYXVkIjoiY2d4LWticyJ9.AAAA",
    )?;
    Ok(())
}

const RIM_SKELETON: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<SoftwareIdentity xmlns="http://standards.iso.org/iso/19770/-2/2015/schema.xsd" xmlns:ds="http://www.w3.org/2000/09/xmldsig#" xmlns:SHA384="http://www.w3.org/2001/04/xmldsig-more#sha384" name="GH100" tagId="NV_GPU_VBIOS_FUZZ" version="1.0"><Meta colloquialVersion="96.00.9F.00.01" product="GH100" edition="FUZZ"/><Payload><Resource type="Measurement" index="0" active="True" alternatives="1" SHA384:Hash0="00"/></Payload><ds:Signature><ds:SignedInfo><ds:CanonicalizationMethod Algorithm="http://www.w3.org/2001/10/xml-exc-c14n#"/><ds:SignatureMethod Algorithm="http://www.w3.org/2001/04/xmldsig-more#ecdsa-sha384"/><ds:Reference URI=""><ds:Transforms><ds:Transform Algorithm="http://www.w3.org/2000/09/xmldsig#enveloped-signature"/><ds:Transform Algorithm="http://www.w3.org/2001/10/xml-exc-c14n#"/></ds:Transforms><ds:DigestMethod Algorithm="http://www.w3.org/2001/04/xmldsig-more#sha384"/><ds:DigestValue>AA==</ds:DigestValue></ds:Reference></ds:SignedInfo><ds:SignatureValue>AA==</ds:SignatureValue><ds:KeyInfo><ds:X509Data><ds:X509Certificate>AA==</ds:X509Certificate></ds:X509Data></ds:KeyInfo></ds:Signature></SoftwareIdentity>
"#;

/// Inputs cut from the real-hardware vectors (local runs; never committed).
fn vectors(out: &Out, dir: &Path) -> Res<()> {
    for kind in ["snp", "tdx", "nvidia"] {
        let Ok(entries) = std::fs::read_dir(dir.join(kind)) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if let Ok(b) = Bundle::load(&p) {
                let name = format!("vec-{kind}-{}", e.file_name().to_string_lossy());
                from_bundle(out, &name, &b)?;
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir(dir.join("nvidia/rims")) {
        for e in entries.flatten().take(20) {
            let bytes = std::fs::read(e.path())?;
            out.put(
                "rim",
                &format!("vec-{}", e.file_name().to_string_lossy()),
                &bytes,
            )?;
        }
    }
    Ok(())
}

fn main() -> Res<()> {
    let mut args = std::env::args_os().skip(1);
    let out = Out(args
        .next()
        .map(PathBuf::from)
        .ok_or("usage: seeds OUT [VECTORS]")?);
    match args.next() {
        Some(v) => vectors(&out, Path::new(&v))?,
        None => simulated(&out)?,
    }
    Ok(())
}
