#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The collateral source against a local server on loopback playing AMD KDS, Intel PCS and the
//! NVIDIA RIM service: caching, outages, 429s, slow and garbage answers, single flight, pacing,
//! and an end-to-end TDX check (fetch → assemble → verify a real quote) with the real vectors.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use cgx_attestation::collateral::fetch::{CollateralSource, Endpoints, FetchPolicy, Origin};
use cgx_attestation::collateral::{CollateralKey, CollateralStore};
use cgx_attestation::sim::{SimAmd, default_tcb};
use cgx_attestation::snp::{Product, SigningKey};

#[derive(Clone)]
enum Reply {
    Ok(Vec<u8>, Vec<(String, String)>),
    Status(u16, Option<u64>),
    Slow(Duration, Vec<u8>),
}

#[derive(Clone, Default)]
struct Vendor {
    routes: Arc<Mutex<HashMap<String, Reply>>>,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    posts: Arc<Mutex<Vec<Posted>>>,
}

/// (method, path, content type, body) of a request with a body.
type Posted = (String, String, String, Vec<u8>);

impl Vendor {
    /// Serve on 127.0.0.1:0 until the test process ends (threads are detached).
    fn start(&self) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let me = self.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let me = me.clone();
                std::thread::spawn(move || me.handle(stream));
            }
        });
        format!("http://{addr}")
    }

    fn set(&self, path: &str, reply: Reply) {
        self.routes.lock().unwrap().insert(path.to_string(), reply);
    }

    fn hits(&self, path: &str) -> usize {
        *self.hits.lock().unwrap().get(path).unwrap_or(&0)
    }

    fn handle(&self, stream: TcpStream) {
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        let mut line = String::new();
        if reader.read_line(&mut line).is_err() {
            return;
        }
        let method = line.split_whitespace().next().unwrap_or("").to_string();
        let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
        let (mut length, mut content_type) = (0usize, String::new());
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                break;
            }
            let lower = h.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            } else if let Some(v) = lower.strip_prefix("content-type:") {
                content_type = v.trim().to_string();
            }
        }
        if length > 0 {
            let mut body = vec![0u8; length];
            if reader.read_exact(&mut body).is_err() {
                return;
            }
            self.posts
                .lock()
                .unwrap()
                .push((method, path.clone(), content_type, body));
        }
        *self.hits.lock().unwrap().entry(path.clone()).or_default() += 1;
        let reply = self.routes.lock().unwrap().get(&path).cloned();
        let mut out = stream;
        let (status, body, headers) = match reply {
            Some(Reply::Ok(b, h)) => (200, b, h),
            Some(Reply::Status(s, retry)) => (
                s,
                b"busy".to_vec(),
                retry
                    .map(|r| vec![("Retry-After".to_string(), r.to_string())])
                    .unwrap_or_default(),
            ),
            Some(Reply::Slow(d, b)) => {
                std::thread::sleep(d);
                (200, b, vec![])
            }
            None => (404, b"not found".to_vec(), vec![]),
        };
        let mut head = format!(
            "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n",
            body.len()
        );
        for (k, v) in headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let _ = out.write_all(head.as_bytes());
        let _ = out.write_all(&body);
        let _ = out.flush();
        let mut sink = [0u8; 64];
        let _ = reader.read(&mut sink);
    }
}

fn tmp(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("cgx-fetch-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    p
}

fn policy() -> FetchPolicy {
    FetchPolicy {
        timeout: Duration::from_millis(500),
        amd_min_interval: Duration::from_millis(0),
        max_wait: Duration::from_secs(5),
        refresh_after_secs: 3600,
        max_body: 1 << 20,
    }
}

fn source(base: &str, name: &str, p: FetchPolicy) -> CollateralSource {
    let store = CollateralStore::open(&tmp(name)).unwrap();
    let endpoints = Endpoints {
        amd_kds: base.into(),
        intel_pcs: base.into(),
        intel_root_ca_crl: format!("{base}/IntelSGXRootCA.der"),
        nvidia_rim: base.into(),
        nvidia_ocsp: format!("{base}/ocsp"),
    };
    CollateralSource::new(store, endpoints, p)
}

fn vcek_key(chip: [u8; 64]) -> (CollateralKey, String) {
    let tcb = default_tcb(Product::Milan);
    let key = CollateralKey::AmdVcek {
        product: Product::Milan,
        hw_id: chip.to_vec(),
        tcb,
    };
    let url = format!(
        "/vcek/v1/Milan/{}?blSPL={}&teeSPL={}&snpSPL={}&ucodeSPL={}",
        hex::encode(chip),
        tcb.bootloader,
        tcb.tee,
        tcb.snp,
        tcb.microcode
    );
    (key, url)
}

#[test]
fn amd_kds_cache_outage_rate_limit_garbage_and_single_flight() {
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let chip = [0x42; 64];
    let amd = SimAmd::generate(
        Product::Milan,
        SigningKey::Vcek,
        default_tcb(Product::Milan),
        chip,
        now,
    )
    .unwrap();
    let vendor = Vendor::default();
    let base = vendor.start();
    let (key, url) = vcek_key(chip);
    vendor.set(&url, Reply::Ok(amd.leaf_der.clone(), vec![]));
    // Callers do not queue behind a Retry-After longer than 100 ms: they get the cache or an error.
    let src = source(
        &base,
        "kds",
        FetchPolicy {
            max_wait: Duration::from_millis(100),
            ..policy()
        },
    );

    // First from the vendor, then from the cache.
    let f = src.get(&key, now).unwrap();
    assert_eq!(
        (f.origin, f.bytes.clone()),
        (Origin::Vendor, amd.leaf_der.clone())
    );
    assert_eq!(src.get(&key, now).unwrap().origin, Origin::Cache);
    assert_eq!(vendor.hits(&url), 1);

    // Past the refresh interval the vendor is asked again; while it is down, the still-valid
    // copy is served and says why.
    let later = now + 7200;
    vendor.set(&url, Reply::Status(500, None));
    let f = src.get(&key, later).unwrap();
    assert!(
        matches!(f.origin, Origin::StaleCache { ref vendor_error } if vendor_error.contains("500")),
        "{:?}",
        f.origin
    );
    assert_eq!(vendor.hits(&url), 2);
    // Past its validity window, it is not served at all.
    let e = src.get(&key, now + 20 * 365 * 86_400).unwrap_err();
    assert_eq!(e.code(), "collateral_invalid");

    // A 429 with Retry-After: the vendor is left alone until then.
    let (key2, url2) = vcek_key([0x43; 64]);
    vendor.set(&url2, Reply::Status(429, Some(2)));
    assert!(src.get(&key2, now).is_err());
    assert_eq!(vendor.hits(&url2), 1);
    let e = src.get(&key2, now).unwrap_err();
    assert!(e.to_string().contains("rate limit"), "{e}");
    assert_eq!(
        vendor.hits(&url2),
        1,
        "a request was sent during Retry-After"
    );
    std::thread::sleep(Duration::from_millis(2100));

    // Garbage and a VCEK of another chip are refused and never stored.
    vendor.set(
        &url2,
        Reply::Ok(b"<html>maintenance</html>".to_vec(), vec![]),
    );
    let e = src.get(&key2, now).unwrap_err();
    assert!(e.to_string().contains("not a certificate"), "{e}");
    vendor.set(&url2, Reply::Ok(amd.leaf_der.clone(), vec![]));
    let e = src.get(&key2, now).unwrap_err();
    assert!(e.to_string().contains("another chip"), "{e}");

    // Slow answers time out; the caller gets an error, not a hang.
    let (key3, url3) = vcek_key([0x44; 64]);
    vendor.set(
        &url3,
        Reply::Slow(Duration::from_secs(3), amd.leaf_der.clone()),
    );
    let t0 = Instant::now();
    assert!(src.get(&key3, now).is_err());
    assert!(t0.elapsed() < Duration::from_secs(2));

    // Single flight: eight concurrent callers for a new key make one request.
    let chain_key = CollateralKey::AmdCertChain {
        product: Product::Milan,
        vlek: false,
    };
    vendor.set(
        "/vcek/v1/Milan/cert_chain",
        Reply::Slow(
            Duration::from_millis(200),
            amd.cert_chain_pem().into_bytes(),
        ),
    );
    let src = Arc::new(src);
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let (src, key) = (src.clone(), chain_key.clone());
            std::thread::spawn(move || src.get(&key, now).unwrap().bytes)
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), amd.cert_chain_pem().into_bytes());
    }
    assert_eq!(vendor.hits("/vcek/v1/Milan/cert_chain"), 1);
}

#[test]
fn offline_source_never_calls_a_vendor() {
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let vendor = Vendor::default();
    let _base = vendor.start();
    let amd = SimAmd::generate(
        Product::Milan,
        SigningKey::Vcek,
        default_tcb(Product::Milan),
        [9; 64],
        now,
    )
    .unwrap();
    let dir = tmp("offline");
    let mut store = CollateralStore::open(&dir).unwrap();
    let (key, url) = vcek_key([9; 64]);
    store
        .put(&key.path(), &amd.leaf_der, "test", now - 10 * 86_400)
        .unwrap();
    let src = CollateralSource::offline(store);
    // Old but valid: served from the store without asking anyone.
    assert_eq!(src.get(&key, now).unwrap().origin, Origin::Cache);
    let e = src
        .get(
            &CollateralKey::AmdCrl {
                product: Product::Milan,
                vlek: false,
            },
            now,
        )
        .unwrap_err();
    assert!(e.to_string().contains("offline"), "{e}");
    assert_eq!(vendor.hits(&url), 0);
}

#[test]
fn amd_kds_requests_are_paced() {
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let vendor = Vendor::default();
    let base = vendor.start();
    let mut p = policy();
    p.amd_min_interval = Duration::from_millis(400);
    let src = source(&base, "pace", p);
    let amd = SimAmd::generate(
        Product::Milan,
        SigningKey::Vcek,
        default_tcb(Product::Milan),
        [1; 64],
        now,
    )
    .unwrap();
    vendor.set(
        "/vcek/v1/Milan/crl",
        Reply::Ok(amd.crl(&[], now - 10, now + 1000).unwrap(), vec![]),
    );
    vendor.set(
        "/vcek/v1/Milan/cert_chain",
        Reply::Ok(amd.cert_chain_pem().into_bytes(), vec![]),
    );
    let t0 = Instant::now();
    src.get(
        &CollateralKey::AmdCrl {
            product: Product::Milan,
            vlek: false,
        },
        now,
    )
    .unwrap();
    src.get(
        &CollateralKey::AmdCertChain {
            product: Product::Milan,
            vlek: false,
        },
        now,
    )
    .unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(400),
        "second KDS request was not paced"
    );
}

fn pct(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[test]
fn intel_pcs_and_nvidia_rims_from_real_collateral() {
    let Some(v) =
        cgx_attestation::bundle::shared_vectors(std::path::Path::new(env!("CARGO_MANIFEST_DIR")))
    else {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED intel_pcs_and_nvidia_rims_from_real_collateral: no vectors"
        );
        return;
    };
    let dir = v.join("tdx/v4-b0c06f-dcapqvl-phala");
    let quote = std::fs::read(dir.join("quote.bin")).unwrap();
    let c: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("collateral.json")).unwrap()).unwrap();
    let s = |k: &str| c[k].as_str().unwrap().to_string();
    let (fmspc, ca) = cgx_attestation::tdx::collateral_ids(&quote).unwrap();
    assert_eq!(hex::encode(fmspc), "b0c06f000000");

    // The vendor answers as PCS v4 does: JSON bodies, issuer chains in URL-encoded headers.
    let vendor = Vendor::default();
    let base = vendor.start();
    let tcb_body = format!(
        r#"{{"tcbInfo":{},"signature":"{}"}}"#,
        s("tcb_info"),
        s("tcb_info_signature")
    );
    let qe_body = format!(
        r#"{{"enclaveIdentity":{},"signature":"{}"}}"#,
        s("qe_identity"),
        s("qe_identity_signature")
    );
    vendor.set(
        &format!(
            "/tdx/certification/v4/tcb?fmspc={}",
            hex::encode_upper(fmspc)
        ),
        Reply::Ok(
            tcb_body.into_bytes(),
            vec![(
                "TCB-Info-Issuer-Chain".into(),
                pct(&s("tcb_info_issuer_chain")),
            )],
        ),
    );
    vendor.set(
        "/tdx/certification/v4/qe/identity",
        Reply::Ok(
            qe_body.into_bytes(),
            vec![(
                "SGX-Enclave-Identity-Issuer-Chain".into(),
                pct(&s("qe_identity_issuer_chain")),
            )],
        ),
    );
    vendor.set(
        &format!("/sgx/certification/v4/pckcrl?ca={ca}"),
        Reply::Ok(
            hex::decode(s("pck_crl")).unwrap(),
            vec![(
                "SGX-PCK-CRL-Issuer-Chain".into(),
                pct(&s("pck_crl_issuer_chain")),
            )],
        ),
    );
    vendor.set(
        "/IntelSGXRootCA.der",
        Reply::Ok(hex::decode(s("root_ca_crl")).unwrap(), vec![]),
    );
    let src = source(&base, "pcs", policy());
    let at = time::macros::datetime!(2025-07-19 10:00:34 UTC);
    let assembled = src.tdx_collateral(fmspc, ca, at.unix_timestamp()).unwrap();

    // The assembled collateral verifies the real quote, exactly like the bundled one.
    let verifier = cgx_attestation::Verifier::new(cgx_attestation::VerifierConfig::default());
    let ev = cgx_attestation::Evidence::Tdx(cgx_attestation::tdx::TdxEvidence {
        quote: &quote,
        collateral_json: &assembled,
    });
    let claims = verifier.verify(&ev, at).unwrap();
    let cgx_attestation::KindClaims::Tdx(t) = &claims.claims().detail else {
        panic!()
    };
    assert_eq!(t.tcb_status, "UpToDate");
    // TCB info with a one-byte change no longer verifies: the exact signed text was kept.
    let tampered = String::from_utf8(assembled.clone())
        .unwrap()
        .replacen("UpToDate", "UpToDatf", 1);
    let ev = cgx_attestation::Evidence::Tdx(cgx_attestation::tdx::TdxEvidence {
        quote: &quote,
        collateral_json: tampered.as_bytes(),
    });
    assert!(verifier.verify(&ev, at).is_err());

    // NVIDIA RIM service: JSON with the base64 SWID tag.
    let name = "1010_0200_882_960074001A_PROD";
    let xml = std::fs::read(v.join(format!("nvidia/rims/{name}.swidtag"))).unwrap();
    let body = serde_json::json!({"id": name, "rim": base64::engine::general_purpose::STANDARD.encode(&xml), "sha256": ""});
    vendor.set(
        &format!("/v1/rim/{name}"),
        Reply::Ok(body.to_string().into_bytes(), vec![]),
    );
    vendor.set(
        "/v1/rim/garbage",
        Reply::Ok(b"{\"rim\": \"bm90IHhtbA==\"}".to_vec(), vec![]),
    );
    let f = src
        .get(
            &CollateralKey::NvidiaRim { id: name.into() },
            at.unix_timestamp(),
        )
        .unwrap();
    assert_eq!(f.bytes, xml);
    assert!(
        src.get(
            &CollateralKey::NvidiaRim {
                id: "garbage".into()
            },
            at.unix_timestamp()
        )
        .is_err()
    );
}

/// NVIDIA's OCSP responder on loopback: the device chain's status is fetched by POST, cached by
/// CertID, served stale-but-valid in an outage, and garbage is never stored.
#[test]
fn nvidia_ocsp_fetch_cache_outage_and_garbage() {
    use cgx_attestation::bundle::Bundle;
    use cgx_attestation::nvidia::ocsp::{self, CertStatus};
    use cgx_attestation::sim::{SimGpu, SimOcsp, SimOcspSigner};
    use cgx_attestation::{KindClaims, SimTrust, Verifier, VerifierConfig};

    let t = time::OffsetDateTime::now_utc();
    let now = t.unix_timestamp();
    let gpu = SimGpu::generate(now).unwrap();
    let verifier = Verifier::new(VerifierConfig {
        sim: SimTrust::Pinned(vec![gpu.root_pin()]),
    });
    // A bundle as a guest sends it: evidence and chain, no OCSP responses.
    let dir = tmp("ocsp-bundle");
    let Bundle::Nvidia {
        report, cert_chain, ..
    } = gpu.bundle([8; 32], 4).unwrap()
    else {
        panic!()
    };
    Bundle::Nvidia {
        report,
        cert_chain: cert_chain.clone(),
        ocsp: vec![],
    }
    .write(&dir)
    .unwrap();
    let ocsp_claim = |b: &Bundle| {
        let c = verifier.verify(&b.evidence(), t)?.into_claims();
        let KindClaims::Nvidia(n) = c.detail else {
            panic!()
        };
        Ok::<_, cgx_attestation::Error>(n.ocsp)
    };

    let vendor = Vendor::default();
    let base = vendor.start();
    vendor.set(
        "/ocsp",
        Reply::Ok(
            gpu.good_ocsp().unwrap(),
            vec![("Content-Type".into(), "application/ocsp-response".into())],
        ),
    );
    let src = source(&base, "ocsp", policy());
    let b = Bundle::load_with(&dir, &src, now).unwrap();
    assert_eq!(ocsp_claim(&b).unwrap(), "good");
    // What went out is an RFC 6960 request for exactly the chain's middle certificate.
    let posts = vendor.posts.lock().unwrap().clone();
    assert_eq!(posts.len(), 1);
    let (method, path, content_type, body) = &posts[0];
    assert_eq!(
        (method.as_str(), path.as_str(), content_type.as_str()),
        ("POST", "/ocsp", "application/ocsp-request")
    );
    let ids = ocsp::chain_cert_ids(&cert_chain).unwrap();
    assert_eq!(body, &ocsp::request(&ids, None));
    // Second load: from the store, no request.
    let b = Bundle::load_with(&dir, &src, now).unwrap();
    assert_eq!(ocsp_claim(&b).unwrap(), "good");
    assert_eq!(vendor.hits("/ocsp"), 1);

    // Responder down, refresh due: the stored response is served while it is valid.
    let refresh_now = source(
        &base,
        "ocsp-refresh",
        FetchPolicy {
            refresh_after_secs: 0,
            ..policy()
        },
    );
    refresh_now
        .get(
            &CollateralKey::NvidiaOcsp {
                cert_id: ids[0].clone(),
            },
            now,
        )
        .unwrap();
    vendor.set("/ocsp", Reply::Status(503, None));
    let f = refresh_now
        .get(
            &CollateralKey::NvidiaOcsp {
                cert_id: ids[0].clone(),
            },
            now + 10,
        )
        .unwrap();
    assert!(
        matches!(f.origin, Origin::StaleCache { .. }),
        "{:?}",
        f.origin
    );
    // ... and not once it has expired (30 days): then revocation is not checked.
    let late = now + 40 * 86_400;
    assert!(
        refresh_now
            .get(
                &CollateralKey::NvidiaOcsp {
                    cert_id: ids[0].clone()
                },
                late
            )
            .is_err()
    );

    // Garbage and a response about another certificate are never stored; revocation then reads
    // `not_checked` and the default policy does not affirm it.
    for junk in [
        b"<html>oops</html>".to_vec(),
        SimGpu::generate(now).unwrap().good_ocsp().unwrap(),
    ] {
        vendor.set("/ocsp", Reply::Ok(junk, vec![]));
        let fresh = source(&base, "ocsp-garbage", policy());
        let b = Bundle::load_with(&dir, &fresh, now).unwrap();
        assert_eq!(ocsp_claim(&b).unwrap(), "not_checked");
        assert!(
            !std::fs::read_to_string(tmp("ocsp-garbage").join("index.json"))
                .unwrap_or_default()
                .contains("nvidia/ocsp")
        );
    }

    // A revoked answer is stored (it is a valid answer) and refuses the evidence.
    vendor.set(
        "/ocsp",
        Reply::Ok(
            gpu.ocsp_response(&SimOcsp {
                status: CertStatus::Revoked {
                    at: now - 60,
                    reason: Some(1),
                },
                this_update: now - 30,
                next_update: Some(now + 3600),
                signer: SimOcspSigner::Issuer,
            })
            .unwrap(),
            vec![],
        ),
    );
    let fresh = source(&base, "ocsp-revoked", policy());
    let b = Bundle::load_with(&dir, &fresh, now).unwrap();
    assert_eq!(ocsp_claim(&b).unwrap_err().code(), "revoked");
}
