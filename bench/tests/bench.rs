#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! `cgx bench verify|kbs` as scripts run them: the JSON shapes, ratios against their bounds,
//! and usage errors.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn cgx(args: &[&str]) -> (i32, String, String) {
    // `cgx bench X` runs `cgx-bench X`; the arguments after `bench` are the same.
    let args = args.strip_prefix(&["bench"][..]).unwrap_or(args);
    let out = Command::new(env!("CARGO_BIN_EXE_cgx-bench"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

fn vectors() -> Option<PathBuf> {
    cgx_attestation::bundle::shared_vectors(Path::new(env!("CARGO_MANIFEST_DIR")))
}

#[test]
fn bench_verify_reports_ratios_in_the_documented_shape() {
    let (code, out, err) = cgx(&["bench", "verify", "--json", "--seconds", "0.05"]);
    assert_eq!(code, 0, "{err}");
    let v = json(&out);
    for kind in ["snp", "nvidia"] {
        for key in ["ops_per_s", "bound_ops_per_s", "ratio"] {
            assert!(
                v[kind][key].as_f64().is_some_and(|x| x > 0.0),
                "{kind}.{key}: {v}"
            );
        }
        assert!(v[kind].get("peer_ops_per_s").is_some());
    }
    assert!(v["snp"]["peer_ops_per_s"].as_f64().is_some_and(|x| x > 0.0));
    // TDX needs the real vectors (there is no TDX simulator).
    if vectors().is_some() {
        assert!(v["tdx"]["ratio"].as_f64().is_some_and(|x| x > 0.0), "{v}");
        assert!(v["tdx"]["peer_ops_per_s"].as_f64().is_some_and(|x| x > 0.0));
    } else {
        assert!(v["tdx"]["skipped"].is_string());
    }
    let (code, _, _) = cgx(&["bench", "verify", "--seconds", "0"]);
    assert_eq!(code, 2);
}

#[test]
fn bench_kbs_runs_full_flows_and_reports_latency_and_cpu() {
    let (code, out, err) = cgx(&[
        "bench",
        "kbs",
        "--clients",
        "4",
        "--seconds",
        "0.5",
        "--rate",
        "40",
        "--weights-mib",
        "1",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v = json(&out);
    for run in ["closed_loop", "paced"] {
        let r = &v["kbs"][run];
        assert_eq!(r["errors"], 0, "{run}: {r}");
        assert!(r["flows"].as_u64().is_some_and(|n| n > 0), "{run}: {r}");
        for key in [
            "p50_ms",
            "p99_ms",
            "kbs_cpu_ms_per_flow",
            "client_cpu_ms_per_flow",
        ] {
            assert!(r[key].as_f64().is_some_and(|x| x > 0.0), "{run}.{key}: {r}");
        }
        // A full flow (SNP verification, a signed EAR, a JWE) costs the KBS well over 50 µs:
        // less means threads that served it went uncounted.
        assert!(
            r["kbs_cpu_ms_per_flow"].as_f64().is_some_and(|x| x >= 0.05),
            "{run}: {r}"
        );
        assert!(r["p50_ms"].as_f64() <= r["p99_ms"].as_f64(), "{r}");
        // What the machine did meanwhile: steal is a share, the probe woke ~200 times a second.
        let steal = r["host_steal_pct"]
            .as_f64()
            .expect("steal read from /proc/stat");
        assert!((0.0..=100.0).contains(&steal), "{run}: {r}");
        assert!(r["stalls_over_10ms"].as_u64().is_some(), "{run}: {r}");
        assert!(
            r["longest_stall_ms"].as_f64().is_some_and(|x| x >= 0.0),
            "{run}: {r}"
        );
        // Every report in the window was signed with a nonce made before the run.
        assert_eq!(r["amd_sp_presigned"], true, "{run}: {r}");
        // Every counted flow's JWE was opened and checked, after the window.
        assert_eq!(r["jwes_opened_after_window"], r["flows"], "{run}: {r}");
    }
    // The bound: the public-key operations of one flow, timed in the same run.
    for key in [
        "crypto_floor_ms_per_flow",
        "crypto_bound_per_s",
        "vs_crypto_bound",
    ] {
        assert!(
            v["kbs"][key].as_f64().is_some_and(|x| x > 0.0),
            "{key}: {v}"
        );
    }
    // Paced: about the offered 40 flows/s over 0.5 s, not as many as the KBS could do.
    let paced = v["kbs"]["paced"]["flows"].as_u64().unwrap_or(0);
    assert!((10..=30).contains(&paced), "{paced} paced flows");
    assert!(
        v["weights"]["by_threads"][0]["ratio"]
            .as_f64()
            .is_some_and(|x| x > 0.0)
    );
    let (code, _, err) = cgx(&["bench", "kbs", "--clients", "0"]);
    assert_ne!(code, 0);
    assert!(err.contains("--clients"), "{err}");
}

/// `cgx bench broker` end to end at a small size: every part runs and reports its ratio.
#[test]
fn bench_broker_reports_placement_submission_and_registration() {
    let (code, out, err) = cgx(&[
        "bench",
        "broker",
        "--nodes",
        "2000",
        "--decisions",
        "2000",
        "--tenants",
        "4",
        "--seconds",
        "0.5",
        "--registrations",
        "8",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v = json(&out);
    let p = &v["placement"];
    assert_eq!(p["nodes"], 2000);
    assert!(p["placed"].as_u64().is_some_and(|n| n > 0), "{p}");
    for key in [
        "p50_us",
        "p99_us",
        "decisions_per_s_one_core",
        "goal_over_p99",
        "index_speedup_p50",
    ] {
        assert!(
            p[key].as_f64().is_some_and(|x| x > 0.0),
            "placement.{key}: {p}"
        );
    }
    let s = &v["submit"];
    assert!(s["placed"].as_u64().is_some_and(|n| n > 0), "{s}");
    assert_eq!(s["not_placed"], 0, "every submission found capacity: {s}");
    assert!(s["p50_ms"].as_f64() <= s["p99_ms"].as_f64(), "{s}");
    let r = &v["registration"];
    assert_eq!(r["registrations"], 8, "every registration affirmed: {r}");
    for key in ["ratio", "cpu_ratio", "server_cpu_ms_per_registration"] {
        assert!(
            r[key].as_f64().is_some_and(|x| x > 0.0),
            "registration.{key}: {r}"
        );
    }
}

/// `cgx bench coco` beside Trustee's KBS with CoCo's stock client and the Python RCAR client,
/// where the anchors are here.
#[test]
fn bench_coco_measures_both_servers_with_both_clients() {
    if cgx_devnet::shared_anchors(&[Path::new(env!("CARGO_MANIFEST_DIR"))]).is_none() {
        eprintln!("SKIPPED bench_coco: no ../shared/anchors (set CGX_ANCHORS)");
        return;
    }
    // It runs `cgx kbs serve` from beside itself (`cargo test --workspace` builds both).
    let beside = Path::new(env!("CARGO_BIN_EXE_cgx-bench")).with_file_name("cgx");
    if !beside.is_file() {
        eprintln!(
            "SKIPPED bench_coco: no {} (cargo build -p cgx-cli, or test the workspace)",
            beside.display()
        );
        return;
    }
    let (code, out, err) = cgx(&["bench", "coco", "--json", "--flows", "5", "--rounds", "2"]);
    assert_eq!(code, 0, "{err}");
    let v = json(&out);
    assert!(v["ratio"].as_f64().is_some_and(|x| x > 0.0), "{v}");
    let clients = v["clients"].as_array().cloned().unwrap_or_default();
    // The Python client runs where python3 and its cryptography package are (CI installs
    // both); elsewhere `both` says so and measures the stock client alone.
    let expected = if v["python_skipped"].is_null() { 2 } else { 1 };
    assert_eq!(clients.len(), expected, "{v}");
    for c in &clients {
        for key in ["trustee_cpu_ms_per_flow", "cgx_cpu_ms_per_flow", "ratio"] {
            assert!(c[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {c}");
        }
        assert_eq!(c["rounds_ratio"].as_array().map(Vec::len), Some(2), "{c}");
        let wakeups = c["thread_wakeups_per_flow"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert!(
            wakeups.iter().all(|w| w.as_f64().is_some_and(|x| x > 0.0)),
            "{c}"
        );
    }
    let (code, _, err) = cgx(&["bench", "coco", "--flows", "0"]);
    assert_eq!(code, 2, "{err}");
}

/// `cgx bench measure`: launch digests per second against raw hashing of the same bytes, and
/// sev-snp-measure on the same files where it is installed (which must print the same digest).
#[test]
fn bench_measure_reports_the_ratio_and_the_peer() {
    let (code, out, err) = cgx(&["bench", "measure", "--json", "--rounds", "1"]);
    assert_eq!(code, 0, "{err}");
    let v = json(&out);
    for key in ["digests_per_sec", "raw_hash_per_sec", "ratio"] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {v}");
    }
    assert_eq!(v["input"]["firmware_mib"], 4);
    for key in ["launches_per_sec", "raw_hash_per_sec", "ratio"] {
        assert!(
            v["tdx"][key].as_f64().is_some_and(|x| x > 0.0),
            "tdx {key}: {v}"
        );
    }
    if v["sev_snp_measure_ms"].is_null() {
        eprintln!(
            "SKIPPED bench_measure peer: no sev-snp-measure (pip install sev-snp-measure==0.0.13)"
        );
    }
    let (code, _, err) = cgx(&["bench", "measure", "--rounds", "0"]);
    assert_eq!(code, 2, "{err}");
}
