#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! Online collateral fetching under a flood: evidence names the collateral it needs before it
//! can be verified, so unknown chips cost a vendor request each. A client flooding `/attest`
//! with reports of random chip ids gets a few fetches (its budget), then 429; a chip whose
//! fetch failed is refused without asking the vendor again; and a platform whose collateral the
//! KBS holds keeps attesting in its normal time throughout.

use std::io::{Read, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use cgx_attestation::collateral::fetch::Endpoints;
use cgx_attestation::collateral::{CollateralKey, CollateralStore};
use cgx_attestation::snp::AttestationReport;
use cgx_kbs::client::KbsClient;
use cgx_kbs::server::config::CollateralConfig;
use cgx_kbs::sim::SimNode;
use cgx_protocol::kbs::rcar::{ClientError, EvidenceSource};
use cgx_protocol::kbs_types::{Tee, TeePubKey};
use cgx_system_tests::*;
use serde_json::Value;

/// A node that sends no VCEK (CoCo's attester on a host without the certificate table), with
/// its report's chip id replaced when `chip` is given (signature then invalid: nothing can
/// tell before the VCEK is fetched).
struct NoVcek<'a> {
    node: &'a SimNode,
    chip: Option<[u8; 64]>,
}

impl EvidenceSource for NoVcek<'_> {
    fn tee(&self) -> Tee {
        Tee::Snp
    }

    fn additional_evidence(&self, nonce: &str, key: &TeePubKey) -> Result<String, ClientError> {
        self.node.additional_evidence(nonce, key)
    }

    fn primary_evidence(&self, report_data: &[u8; 64]) -> Result<Value, ClientError> {
        let mut v = self.node.primary_evidence(report_data)?;
        if let Some(chain) = v["cert_chain"].as_array_mut() {
            chain.retain(|e| e["cert_type"] != "VCEK");
        }
        if let Some(chip) = self.chip {
            let mut report = STANDARD
                .decode(v["attestation_report"].as_str().unwrap())
                .unwrap();
            report[0x1A0..0x1E0].copy_from_slice(&chip);
            v["attestation_report"] = STANDARD.encode(report).into();
        }
        Ok(v)
    }
}

/// A vendor that knows no chip: every request answers 404 after 50 ms, and is counted.
fn fake_kds() -> (String, Arc<AtomicUsize>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let h = h.clone();
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                h.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(50));
                let _ = s.write_all(
                    b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                );
            });
        }
    });
    (format!("http://{addr}"), hits)
}

/// Put `node`'s AMD CRL in the collateral store at `dir` (online, the KBS requires one), under
/// the key of its chain's root (`collateral::needed`: a simulator's ARK has a key of its own).
fn store_crl(dir: &std::path::Path, node: &SimNode) {
    let mut store = CollateralStore::open(dir).unwrap();
    let key =
        cgx_attestation::trust::amd_crl_key(node.amd.cert_chain_pem().as_bytes(), false).unwrap();
    let crl = node.amd.crl(&[], now() - 3600, now() + 86_400).unwrap();
    store.put(&key.path(), &crl, "test", now()).unwrap();
}

/// The setup's KBS fetching collateral online into `<dir>/collateral`, from the AMD KDS at
/// `kds`, unpaced.
fn online(s: &Setup, kds: String) -> cgx_kbs::server::config::KbsConfig {
    let mut config = s.config.clone();
    config.collateral = CollateralConfig {
        store: Some(s.dir.join("collateral")),
        online: true,
        endpoints: Some(Endpoints {
            amd_kds: kds,
            ..Endpoints::default()
        }),
        amd_min_interval_ms: 0,
        ..CollateralConfig::default()
    };
    config
}

fn random_chip() -> [u8; 64] {
    let mut c = [0u8; 64];
    cgx_attestation::sim::fill_random(&mut c).unwrap();
    c
}

#[test]
fn a_flood_of_unknown_chips_is_bounded_and_known_chips_still_attest() {
    let n = node(0);
    let s = setup(&[&n], None);
    // The KBS holds this node's VCEK (it has attested before, or the operator loaded it).
    let store_dir = s.dir.join("collateral");
    let known = NoVcek {
        node: &n,
        chip: None,
    };
    {
        let mut store = CollateralStore::open(&store_dir).unwrap();
        let report = STANDARD
            .decode(
                known.primary_evidence(&[0; 64]).unwrap()["attestation_report"]
                    .as_str()
                    .unwrap(),
            )
            .unwrap();
        let key = CollateralKey::vcek_for(&AttestationReport::parse(&report).unwrap()).unwrap();
        store
            .put(&key.path(), &n.amd.leaf_der, "test", now())
            .unwrap();
    }
    store_crl(&store_dir, &n);
    let (kds, hits) = fake_kds();
    let mut config = online(&s, kds);
    config.collateral.fetch_burst = 4;
    config.collateral.fetch_refill_secs = 3600;
    let srv = Server::start(&config);
    let base = srv.base.clone();
    put_resource(&base, &s.admin, "tenant-a/key/k", b"k", false);
    let attest_known = || {
        let t = Instant::now();
        let mut c = KbsClient::with_new_key(&base, None).unwrap();
        c.attest(&known).unwrap();
        assert_eq!(c.resource("tenant-a/key/k", None).unwrap(), b"k");
        t.elapsed()
    };
    let baseline = attest_known();

    // An unknown chip: fetched once (404), then refused without asking again.
    let chip = random_chip();
    let unknown = NoVcek {
        node: &n,
        chip: Some(chip),
    };
    let before = hits.load(Ordering::SeqCst);
    let e = KbsClient::with_new_key(&base, None)
        .unwrap()
        .attest(&unknown)
        .unwrap_err();
    assert_eq!(e.kind(), Some("AttestationFailed"), "{e}");
    assert!(e.to_string().contains("collateral"), "{e}");
    assert_eq!(hits.load(Ordering::SeqCst), before + 1);
    let e = KbsClient::with_new_key(&base, None)
        .unwrap()
        .attest(&unknown)
        .unwrap_err();
    assert!(e.to_string().contains("not asked again"), "{e}");
    assert_eq!(hits.load(Ordering::SeqCst), before + 1, "negative cache");

    // The flood: 4 threads × 10 attestations of random chips, while the known node attests.
    let (during, results) = std::thread::scope(|sc| {
        let flood: Vec<_> = (0..4)
            .map(|_| {
                sc.spawn(|| {
                    (0..10)
                        .map(|_| {
                            let src = NoVcek {
                                node: &n,
                                chip: Some(random_chip()),
                            };
                            let e = KbsClient::with_new_key(&base, None)
                                .unwrap()
                                .attest(&src)
                                .unwrap_err();
                            (e.status(), e.kind().map(str::to_string))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let during = attest_known();
        let results: Vec<_> = flood.into_iter().flat_map(|t| t.join().unwrap()).collect();
        (during, results)
    });
    let limited = results
        .iter()
        .filter(|(st, k)| *st == Some(429) && k.as_deref() == Some("TooManyRequests"))
        .count();
    let fetched = hits.load(Ordering::SeqCst) - before - 1;
    eprintln!(
        "known node: {baseline:?} before the flood, {during:?} during it; flood: {limited} of {} \
         refused 429, {fetched} vendor requests",
        results.len()
    );
    // The budget (4) less the one chip above.
    assert!(fetched <= 3, "vendor requests from the flood: {fetched}");
    assert!(limited >= 37, "{results:?}");
    assert!(
        results
            .iter()
            .all(|(st, _)| *st == Some(429) || *st == Some(401)),
        "{results:?}"
    );
    assert!(during < Duration::from_secs(2), "{during:?}");
    // And after it.
    attest_known();
    srv.stop();
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Saturation, measured: `CGX_SATURATION_SECS` (default 300) of 8 clients flooding the KBS —
/// unknown chips, 900 KB junk attestations, 2 MB bodies past the limit, idle half-sent requests
/// — while a known node attests and fetches over and over. Prints the process's RSS every 10 s
/// (KBS and clients share the process) and the known node's times; fails if RSS keeps growing.
/// Run: `cargo test -p cgx-system-tests --test collateral_flood -- --ignored --nocapture`
#[test]
#[ignore = "a 5-minute measurement, not a check for every run"]
fn saturation_keeps_memory_bounded() {
    let secs: u64 = std::env::var("CGX_SATURATION_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let n = node(0);
    let s = setup(&[&n], None);
    let (kds, hits) = fake_kds();
    store_crl(&s.dir.join("collateral"), &n);
    let config = online(&s, kds);
    let srv = Server::start(&config);
    let base = srv.base.clone();
    let addr = base.trim_start_matches("http://").to_string();
    put_resource(&base, &s.admin, "tenant-a/key/k", b"k", false);
    let end = Instant::now() + Duration::from_secs(secs);
    let counts: Vec<AtomicUsize> = (0..5).map(|_| AtomicUsize::new(0)).collect();
    let (series, known) = std::thread::scope(|sc| {
        for t in 0..8usize {
            let (base, addr, n, counts) = (&base, &addr, &n, &counts);
            sc.spawn(move || {
                let mut i = t;
                let mut idle = Vec::new();
                while Instant::now() < end {
                    i += 1;
                    match i % 5 {
                        0 | 1 => {
                            let src = NoVcek {
                                node: n,
                                chip: Some(random_chip()),
                            };
                            let _ = KbsClient::with_new_key(base, None).unwrap().attest(&src);
                        }
                        2 => {
                            let junk = format!("{{\"junk\": \"{}\"}}", "x".repeat(900_000));
                            let _ =
                                ureq::post(&format!("{base}/kbs/v0/attest")).send(junk.as_bytes());
                        }
                        3 => {
                            let _ = ureq::post(&format!("{base}/kbs/v0/resource/tenant-a/key/k"))
                                .send(&vec![0u8; 2 << 20][..]);
                        }
                        _ => {
                            // A half-sent request, left open (the header timeout closes it).
                            if let Ok(mut c) = std::net::TcpStream::connect(addr.as_str()) {
                                let _ = c.write_all(b"POST /kbs/v0/auth HTTP/1.1\r\nHost: x\r\n");
                                idle.push(c);
                                if idle.len() > 50 {
                                    idle.remove(0);
                                }
                            }
                        }
                    }
                    counts[i % 5].fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        // The known node sends its whole chain (this vendor knows no chip).
        let known = sc.spawn(|| {
            let mut times = Vec::new();
            while Instant::now() < end {
                let t = Instant::now();
                let mut c = KbsClient::with_new_key(&base, None).unwrap();
                c.attest(&n).unwrap();
                assert_eq!(c.resource("tenant-a/key/k", None).unwrap(), b"k");
                times.push(t.elapsed());
                std::thread::sleep(Duration::from_millis(200));
            }
            times
        });
        let mut series = Vec::new();
        while Instant::now() < end {
            series.push(rss_kib());
            std::thread::sleep(
                Duration::from_secs(10).min(end.saturating_duration_since(Instant::now())),
            );
        }
        series.push(rss_kib());
        (series, known.join().unwrap())
    });
    let mut sorted = known.clone();
    sorted.sort();
    let median = sorted[sorted.len() / 2];
    let max = sorted[sorted.len() - 1];
    eprintln!(
        "RSS (MiB) every 10 s: {:?}",
        series.iter().map(|k| k / 1024).collect::<Vec<_>>()
    );
    eprintln!(
        "requests by kind (unknown chip ×2, junk attest, 2 MB upload, idle): {:?}; vendor \
         requests {}; known node: {} attestations, median {median:?}, max {max:?}",
        counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect::<Vec<_>>(),
        hits.load(Ordering::SeqCst),
        known.len()
    );
    // Bounded: the last minute's RSS is within 64 MiB of the second minute's.
    let settle = series.len().min(7) - 1;
    let later = *series[settle..].iter().max().unwrap();
    assert!(
        later <= series[settle] + 64 * 1024,
        "RSS grew from {} to {} KiB",
        series[settle],
        later
    );
    srv.stop();
}

/// Online, the AMD CRL is required: a node whose VCEK the KBS holds but whose CRL neither the
/// store nor the vendor can provide is refused, not attested without a revocation check.
#[test]
fn online_attestation_does_not_skip_the_amd_crl() {
    let n = node(0);
    let s = setup(&[&n], None);
    let (kds, hits) = fake_kds();
    let mut config = online(&s, kds);
    // A store without the CRL the setup put in its own (`sim_crls`).
    let empty = s.dir.join("collateral-without-crl");
    config.collateral.store = Some(empty.clone());
    let srv = Server::start(&config);
    let e = KbsClient::with_new_key(&srv.base, None)
        .unwrap()
        .attest(&n)
        .unwrap_err();
    assert_eq!(e.kind(), Some("AttestationFailed"), "{e}");
    assert!(e.to_string().contains("crl"), "{e}");
    // The CRL is found by the chain's root, and a simulator's root is no AMD product's: there
    // is no vendor CRL to fetch for it, so KDS is not asked (for AMD's own chains it is:
    // `collateral::needed`'s tests name KDS's CRL path for them).
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "KDS asked for a simulator's CRL"
    );
    srv.stop();
    // With the CRL in the store (loaded at start), the same node attests.
    store_crl(&empty, &n);
    let srv = Server::start(&config);
    KbsClient::with_new_key(&srv.base, None)
        .unwrap()
        .attest(&n)
        .unwrap();
    srv.stop();
}
