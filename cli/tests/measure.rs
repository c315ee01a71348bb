#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! `cgx measure snp` against AMD's `sev-snp-measure` 0.0.13 (PyPI; CI installs it, and Debian's
//! `ovmf`): the same digest, bit for bit, over a matrix of launches — real firmware (Debian's OVMF
//! builds: with and without SEV metadata), vCPU counts and types, VMM types, guest features, a
//! precomputed firmware digest — and, on a firmware image made to order with a kernel-hashes
//! section (Debian's builds have none), directly booted kernels with and without initrd and
//! command line. Skips, saying so, where the tool or the firmware is absent.

use std::path::{Path, PathBuf};
use std::process::Command;

fn run(cmd: &mut Command) -> (bool, String, String) {
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).trim().to_string(),
    )
}

fn tool_present() -> bool {
    Command::new("sev-snp-measure")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("cgx-measure-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

/// A firmware image made to order (`cgx_measure::ovmf::testing::image`), written to `dir/fw`.
fn firmware(
    dir: &Path,
    pages: usize,
    sections: &[(u32, u32, u32)],
    hashes: Option<u32>,
) -> PathBuf {
    let fw = dir.join("fw");
    std::fs::write(
        &fw,
        cgx_measure::ovmf::testing::image(pages, sections, hashes),
    )
    .unwrap();
    fw
}

/// A measured direct boot in `dir`, on a firmware image made to order (pre-validated memory,
/// secrets, CPUID, an SVSM calling area and the kernel-hashes page, with QEMU's hashes table at
/// 0xC00 in it): `OVMF.amdsev.fd` (its path returned), `vmlinuz`, `initrd`.
fn direct_boot_image(dir: &Path) -> PathBuf {
    let image = cgx_measure::ovmf::testing::direct_boot();
    let fw = dir.join("OVMF.amdsev.fd");
    std::fs::write(&fw, image).unwrap();
    std::fs::write(dir.join("vmlinuz"), vec![0x4d; 3 * 4096 + 17]).unwrap();
    std::fs::write(dir.join("initrd"), vec![0x1f; 5000]).unwrap();
    fw
}

/// Both tools on the same launch: the same digest, or both refuse.
fn same(ovmf: &Path, args: &[&str]) -> String {
    let (ok_cgx, cgx, cgx_err) = run(Command::new(env!("CARGO_BIN_EXE_cgx"))
        .args(["measure", "snp", "--ovmf"])
        .arg(ovmf)
        .args(args));
    let (ok_py, py, py_err) = run(Command::new("sev-snp-measure")
        .args(["--mode", "snp", "--ovmf"])
        .arg(ovmf)
        .args(args));
    assert_eq!(
        (ok_cgx, &cgx),
        (ok_py, &py),
        "{} {args:?}: cgx {cgx_err}, sev-snp-measure {py_err}",
        ovmf.display()
    );
    cgx
}

/// CI installs the peers (`.ci/run` sets CGX_REQUIRE_PEERS): there, a missing one fails.
fn skip(what: &str) {
    assert!(
        std::env::var_os("CGX_REQUIRE_PEERS").is_none(),
        "CGX_REQUIRE_PEERS is set, but {what}"
    );
    eprintln!("SKIPPED {what}");
}

#[test]
fn snp_launch_digests_match_sev_snp_measure() {
    if !tool_present() {
        skip("measure: no sev-snp-measure (pip install sev-snp-measure==0.0.13)");
        return;
    }
    let firmware: Vec<PathBuf> = ["/usr/share/ovmf/OVMF.fd", "/usr/share/OVMF/OVMF_CODE_4M.fd"]
        .iter()
        .map(PathBuf::from)
        .filter(|p| p.is_file())
        .collect();
    if firmware.is_empty() {
        skip("measure (real firmware): no Debian OVMF (apt-get install ovmf)");
    }
    let mut compared = 0;
    let mut digests = std::collections::BTreeSet::new();
    for f in &firmware {
        for vcpus in ["1", "2", "3", "16"] {
            for cpu in ["EPYC-v4", "EPYC-Milan", "EPYC-Genoa"] {
                digests.insert(same(f, &["--vcpus", vcpus, "--vcpu-type", cpu]));
                compared += 1;
            }
        }
        for vmm in ["ec2", "gce"] {
            for vcpus in ["1", "4"] {
                digests.insert(same(f, &["--vcpus", vcpus, "--vmm-type", vmm]));
                compared += 1;
            }
        }
        for extra in [
            &["--guest-features", "0x21"][..],
            &["--vcpu-sig", "0xa00f11"],
            &[
                "--vcpu-family",
                "25",
                "--vcpu-model",
                "17",
                "--vcpu-stepping",
                "1",
            ],
        ] {
            let mut args = vec!["--vcpus", "2", "--vcpu-type", "EPYC-Milan"];
            if extra[0] != "--guest-features" {
                args.truncate(2);
            }
            args.extend_from_slice(extra);
            digests.insert(same(f, &args));
            compared += 1;
        }
        // A firmware digest computed beforehand stands in for the image's pages.
        let seed = "ab".repeat(48);
        digests.insert(same(
            f,
            &[
                "--vcpus",
                "2",
                "--vcpu-type",
                "EPYC-Genoa",
                "--snp-ovmf-hash",
                &seed,
            ],
        ));
        compared += 1;
        // Debian's builds have no kernel-hashes section: both refuse a kernel.
        let dir = tmp("refuse");
        std::fs::write(dir.join("k"), b"kernel").unwrap();
        let k = dir.join("k").to_string_lossy().to_string();
        assert_eq!(
            same(
                f,
                &["--vcpus", "1", "--vcpu-type", "EPYC-v4", "--kernel", &k]
            ),
            ""
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    // Measured direct boot, on an image made to order.
    let dir = tmp("direct");
    let fw = direct_boot_image(&dir);
    let kernel = dir.join("vmlinuz").to_string_lossy().to_string();
    let initrd = dir.join("initrd").to_string_lossy().to_string();
    // sev-snp-measure spells the VMM types QEMU, ec2 and gce (cgx takes any case).
    for vmm in ["QEMU", "ec2", "gce"] {
        for boot in [
            &[][..],
            &["--kernel", &kernel],
            &["--kernel", &kernel, "--initrd", &initrd],
            &[
                "--kernel",
                &kernel,
                "--append",
                "console=ttyS0 root=/dev/vda",
            ],
            &[
                "--kernel", &kernel, "--initrd", &initrd, "--append", "quiet",
            ],
        ] {
            let mut args = vec![
                "--vcpus",
                "2",
                "--vcpu-type",
                "EPYC-Milan",
                "--vmm-type",
                vmm,
            ];
            args.extend_from_slice(boot);
            let d = same(&fw, &args);
            assert_eq!(d.len(), 96, "{args:?}: {d}");
            digests.insert(d);
            compared += 1;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    // Every launch above differs from every other but one per firmware (`--vcpu-sig 0xa00f11`
    // is EPYC-Milan's signature): the comparisons are not all of one digest.
    assert_eq!(
        digests.len(),
        compared - firmware.len(),
        "{} digests of {compared}",
        digests.len()
    );
    eprintln!("measure: {compared} launches, cgx and sev-snp-measure agree on each");
}

#[test]
fn bad_launches_are_refused_with_reasons() {
    let dir = tmp("bad");
    let fw = dir.join("fw");
    std::fs::write(&fw, vec![0u8; 4096 * 4]).unwrap();
    let cgx = |args: &[&str]| {
        run(Command::new(env!("CARGO_BIN_EXE_cgx"))
            .args(["measure", "snp"])
            .args(args))
    };
    let f = fw.to_string_lossy().to_string();
    let (ok, _, err) = cgx(&["--ovmf", &f, "--vcpus", "1", "--vcpu-type", "EPYC-v4"]);
    assert!(!ok && err.contains("footer table"), "{err}");
    let good = dir.join("good");
    std::fs::write(&good, cgx_measure::ovmf::testing::image(8, &[], None)).unwrap();
    let g = good.to_string_lossy().to_string();
    for (args, says) in [
        (vec!["--vcpus", "1"], "needs --vcpu-type"),
        (vec!["--vcpus", "0", "--vcpu-type", "EPYC-v4"], "vcpus 0"),
        (
            vec!["--vcpus", "1", "--vcpu-type", "Skylake"],
            "unknown --vcpu-type",
        ),
        (
            vec![
                "--vcpus",
                "1",
                "--vcpu-type",
                "EPYC-v4",
                "--vmm-type",
                "xen",
            ],
            "unknown VMM",
        ),
        (
            vec![
                "--vcpus",
                "1",
                "--vcpu-type",
                "EPYC-v4",
                "--snp-ovmf-hash",
                "abcd",
            ],
            "not 48",
        ),
        (
            vec!["--vcpus", "1", "--vcpu-sig", "0x1ffffffff"],
            "wider than 32 bits",
        ),
    ] {
        let mut all = vec!["--ovmf", g.as_str()];
        all.extend_from_slice(&args);
        let (ok, _, err) = cgx(&all);
        assert!(!ok && err.contains(says), "{args:?}: {err}");
    }
    let (ok, out, err) = cgx(&[
        "--ovmf",
        &g,
        "--vcpus",
        "1",
        "--vcpu-type",
        "EPYC-v4",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["measurement"].as_str().map(str::len), Some(96), "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--id-key --author-key --out`: the ID block and ID auth QEMU takes, checked as the AMD-SP
/// checks them; the block and the key digests are bit-identical to `snp-create-id-block`'s
/// (sev-snp-measure 0.0.13; its signatures are randomized, so those are verified instead).
#[test]
fn id_block_and_auth_for_a_launch() {
    use aws_lc_rs::rand::SystemRandom;
    use aws_lc_rs::signature::{ECDSA_P384_SHA384_FIXED_SIGNING, EcdsaKeyPair};
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let dir = tmp("idblock");
    let fw = firmware(&dir, 8, &[], None);
    // PKCS#8 PEM keys, as openssl genpkey writes them.
    let pem = |name: &str| {
        let der =
            EcdsaKeyPair::generate_pkcs8(&ECDSA_P384_SHA384_FIXED_SIGNING, &SystemRandom::new())
                .unwrap();
        let body = b64.encode(der.as_ref());
        let lines: Vec<&str> = body
            .as_bytes()
            .chunks(64)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect();
        let p = dir.join(name);
        std::fs::write(
            &p,
            format!(
                "-----BEGIN PRIVATE KEY-----\n{}\n-----END PRIVATE KEY-----\n",
                lines.join("\n")
            ),
        )
        .unwrap();
        p.to_string_lossy().to_string()
    };
    let (idk, authk) = (pem("id.pem"), pem("author.pem"));
    let out = dir.join("launch");
    let (ok, stdout, err) = run(Command::new(env!("CARGO_BIN_EXE_cgx"))
        .args([
            "measure",
            "snp",
            "--vcpus",
            "2",
            "--vcpu-type",
            "EPYC-Milan",
            "--json",
            "--ovmf",
        ])
        .arg(&fw)
        .args([
            "--id-key",
            &idk,
            "--author-key",
            &authk,
            "--author-key-enabled",
            "--host-data",
            &"11".repeat(32),
            "--out",
        ])
        .arg(&out));
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let read = |name: &str| {
        b64.decode(std::fs::read_to_string(out.join(name)).unwrap().trim())
            .unwrap()
    };
    let block: [u8; 0x60] = read("id-block.b64").try_into().unwrap();
    let auth: [u8; 0x1000] = read("id-auth.b64").try_into().unwrap();
    assert_eq!(read("host-data.b64"), vec![0x11; 32]);
    assert_eq!(
        hex::encode(&block[..48]),
        v["measurement"].as_str().unwrap()
    );
    let (id_digest, author_digest) =
        cgx_measure::snp::id_block::verify_id_auth(&block, &auth).unwrap();
    assert_eq!(v["launch"]["id_key_digest"], hex::encode(id_digest));
    assert_eq!(v["launch"]["author_key_digest"], hex::encode(author_digest));

    if !Command::new("snp-create-id-block")
        .arg("--help")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        eprintln!(
            "SKIPPED id block comparison: no snp-create-id-block (pip install sev-snp-measure==0.0.13)"
        );
        return;
    }
    let (ok, py, err) = run(Command::new("snp-create-id-block").args([
        "--measurement",
        &b64.encode(&block[..48]),
        "--idkey",
        &idk,
        "--authorkey",
        &authk,
    ]));
    assert!(ok, "{err}");
    let field = |name: &str| {
        py.split([',', '\n'])
            .find_map(|p| p.trim().strip_prefix(name))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|| panic!("{name} in {py}"))
    };
    assert_eq!(b64.decode(field("id-block=")).unwrap(), block.to_vec());
    assert_eq!(
        b64.decode(field("id_key_hash:")).unwrap(),
        id_digest.to_vec()
    );
    assert_eq!(
        b64.decode(field("author_key:")).unwrap(),
        author_digest.to_vec()
    );
    // Its ID auth verifies against our block too: same layout, same keys.
    let py_auth: [u8; 0x1000] = b64.decode(field("id-auth=")).unwrap().try_into().unwrap();
    assert_eq!(
        cgx_measure::snp::id_block::verify_id_auth(&block, &py_auth).unwrap(),
        (id_digest, author_digest)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--reference-values`: the launch's digest goes into the file the appraisal policy reads, so
/// a report of that launch appraises its executables as affirming, and a report of another
/// image names the found digest and the expected ones. Merging keeps what the file held; a file
/// that is not a JSON object is refused and left alone.
#[test]
fn reference_values_from_the_image_decide_appraisal() {
    let dir = tmp("refvals");
    let fw = firmware(&dir, 8, &[(0x80_0000, 0x2000, 1)], None);
    let rv = dir.join("rv.json");
    let measure = |vcpus: &str, name: &str| {
        let (ok, out, err) = run(Command::new(env!("CARGO_BIN_EXE_cgx"))
            .args([
                "measure",
                "snp",
                "--vcpu-type",
                "EPYC-Genoa",
                "--vcpus",
                vcpus,
                "--ovmf",
            ])
            .arg(&fw)
            .arg("--reference-values")
            .arg(&rv)
            .args(["--image-name", name]));
        assert!(ok, "{err}");
        out
    };
    let two = measure("2", "two-vcpus");
    let four = measure("4", "four-vcpus");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&rv).unwrap()).unwrap();
    assert_eq!(v["snp"]["measurements"], serde_json::json!([two, four]));
    assert_eq!(v["snp"]["images"]["four-vcpus"]["vcpus"], 4);
    assert_eq!(v["nvidia"]["require_ocsp"], true, "the defaults are kept");

    let appraise = |measurement: &str| {
        let bundle = dir.join(format!("b-{}", &measurement[..8]));
        let (ok, _, err) = run(Command::new(env!("CARGO_BIN_EXE_cgx"))
            .args(["sim", "snp", "--measurement", measurement, "--out"])
            .arg(&bundle));
        assert!(ok, "{err}");
        let (_, out, err) = run(Command::new(env!("CARGO_BIN_EXE_cgx"))
            .arg("appraise")
            .arg(&bundle)
            .arg("--reference-values")
            .arg(&rv)
            .args(["--trust-sim", "--json"]));
        serde_json::from_str::<serde_json::Value>(&out).unwrap_or_else(|_| panic!("{out} {err}"))
    };
    let ok = appraise(&two);
    assert_eq!(ok["trust_vector"]["executables"], 2, "{ok}");
    let other = "ab".repeat(48);
    let bad = appraise(&other);
    assert_eq!(bad["trust_vector"]["executables"], 33, "{bad}");
    let v = bad["violations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["rule"] == "snp_measurement_not_allowed")
        .unwrap()
        .clone();
    assert_eq!(v["value"], other);
    let expected = v["expected"].as_str().unwrap();
    assert!(
        expected.contains(&two) && expected.contains(&four),
        "{expected}"
    );

    // Not a JSON object: refused, the file untouched.
    std::fs::write(&rv, "[1, 2]").unwrap();
    let (ok, _, err) = run(Command::new(env!("CARGO_BIN_EXE_cgx"))
        .args([
            "measure",
            "snp",
            "--vcpu-type",
            "EPYC-Genoa",
            "--vcpus",
            "1",
            "--ovmf",
        ])
        .arg(&fw)
        .arg("--reference-values")
        .arg(&rv));
    assert!(!ok && err.contains("not a JSON object"), "{err}");
    assert_eq!(std::fs::read_to_string(&rv).unwrap(), "[1, 2]");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `cgx measure check`: 0 when a report's measurement is this launch's; 1 with both digests and
/// the neighbouring parameters that would match (here the vCPU count), or none for another image.
#[test]
fn check_names_the_likely_cause_of_a_mismatch() {
    let dir = tmp("check");
    let fw = firmware(&dir, 8, &[(0x80_0000, 0x2000, 1)], None);
    let cgx = |args: &[&str]| run(Command::new(env!("CARGO_BIN_EXE_cgx")).args(args));
    let f = fw.to_string_lossy().to_string();
    let (ok, digest, err) = cgx(&[
        "measure",
        "snp",
        "--ovmf",
        &f,
        "--vcpus",
        "4",
        "--vcpu-type",
        "EPYC-Milan",
    ]);
    assert!(ok, "{err}");
    let bundle = dir.join("bundle").to_string_lossy().to_string();
    let (ok, _, err) = cgx(&["sim", "snp", "--measurement", &digest, "--out", &bundle]);
    assert!(ok, "{err}");
    let check = |extra: &[&str]| {
        let mut args = vec![
            "measure",
            "check",
            bundle.as_str(),
            "--ovmf",
            f.as_str(),
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = Command::new(env!("CARGO_BIN_EXE_cgx"))
            .args(&args)
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
        (out.status.code(), v)
    };
    let (code, v) = check(&["--vcpus", "4", "--vcpu-type", "EPYC-Milan"]);
    assert_eq!(
        (code, v["match"].clone()),
        (Some(0), serde_json::json!(true)),
        "{v}"
    );
    let (code, v) = check(&["--vcpus", "2", "--vcpu-type", "EPYC-Milan"]);
    assert_eq!(code, Some(1), "{v}");
    assert_eq!(v["report_measurement"], digest);
    assert_ne!(v["expected_measurement"], digest);
    assert_eq!(
        v["likely_causes"],
        serde_json::json!(["4 vCPUs, not 2"]),
        "{v}"
    );
    // Another image: no neighbour matches.
    let other = dir.join("other");
    std::fs::write(&other, cgx_measure::ovmf::testing::image(9, &[], None)).unwrap();
    let o = other.to_string_lossy().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_cgx"))
        .args([
            "measure",
            "check",
            &bundle,
            "--ovmf",
            &o,
            "--vcpus",
            "4",
            "--vcpu-type",
            "EPYC-Milan",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("no launch one parameter away"));
    // Not a report: a usage error, exit 2.
    let (ok, _, err) = cgx(&[
        "measure",
        "check",
        &f,
        "--ovmf",
        &f,
        "--vcpus",
        "1",
        "--vcpu-type",
        "EPYC",
    ]);
    assert!(!ok && err.contains("cgx:"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--init-data`: HOST_DATA is the init-data's digest as the KBS checks it (the algorithm the
/// TOML names, fitted to 32 bytes); an unknown algorithm is refused.
#[test]
fn host_data_from_init_data_is_what_the_kbs_compares() {
    use base64::Engine;
    let dir = tmp("initdata");
    let fw = firmware(&dir, 8, &[], None);
    let toml = "algorithm = \"sha384\"\nversion = \"0.1.0\"\n\n[data]\n\"policy.rego\" = \"\"\"\npackage agent_policy\n\"\"\"\n";
    std::fs::write(dir.join("init.toml"), toml).unwrap();
    let run_with = |file: &str| {
        run(Command::new(env!("CARGO_BIN_EXE_cgx"))
            .args([
                "measure",
                "snp",
                "--vcpus",
                "1",
                "--vcpu-type",
                "EPYC-v4",
                "--ovmf",
            ])
            .arg(&fw)
            .arg("--init-data")
            .arg(dir.join(file))
            .arg("--out")
            .arg(dir.join("out")))
    };
    let (ok, _, err) = run_with("init.toml");
    assert!(ok, "{err}");
    let got = base64::engine::general_purpose::STANDARD
        .decode(
            std::fs::read_to_string(dir.join("out/host-data.b64"))
                .unwrap()
                .trim(),
        )
        .unwrap();
    let (_, want) = cgx_protocol::kbs::binding::init_data_digest(toml, 32).unwrap();
    assert_eq!(got, want);
    let sha384 = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA384, toml.as_bytes());
    assert_eq!(got, sha384.as_ref()[..32].to_vec());
    std::fs::write(dir.join("md5.toml"), "algorithm = \"md5\"\n").unwrap();
    let (ok, _, err) = run_with("md5.toml");
    assert!(!ok && err.contains("md5"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The launch a host agent's configuration describes, measured by `cgx measure launch`, is
/// the digest `sev-snp-measure` computes for the same launch: the VM `cgx-host-agent run`
/// boots (QEMU's arguments from the same table) is the VM the reference values name.
#[test]
fn the_launch_the_host_agent_boots_is_the_launch_measured() {
    if !tool_present() {
        skip("measure launch: no sev-snp-measure (pip install sev-snp-measure==0.0.13)");
        return;
    }
    let dir = tmp("launch");
    direct_boot_image(&dir);
    let p = |n: &str| dir.join(n).display().to_string();
    let config = dir.join("host.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[agent]
broker = "https://broker.example"
broker_key = "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"
kbs = "https://kbs.example"
operator = "op1"
region = "eu-west"
price_micros = 2100000
token_file = "/etc/cgx/operator.token"
[launcher]
kind = "qemu"
[qemu]
socket = "/run/cgx/vm.sock"
[qemu.launch]
tee = "snp"
firmware = "{}"
kernel = "{}"
initrd = "{}"
append = "console=ttyS0 quiet"
vcpus = 2
vcpu_type = "EPYC-Milan"
memory_mib = 4096
"#,
            p("OVMF.amdsev.fd"),
            p("vmlinuz"),
            p("initrd")
        ),
    )
    .unwrap();
    let (ok, ours, err) = run(Command::new(env!("CARGO_BIN_EXE_cgx"))
        .args(["measure", "launch"])
        .arg(&config));
    assert!(ok, "{err}");
    let (ok, theirs, err) = run(Command::new("sev-snp-measure").args([
        "--mode",
        "snp",
        "--ovmf",
        &p("OVMF.amdsev.fd"),
        "--vcpus",
        "2",
        "--vcpu-type",
        "EPYC-Milan",
        "--kernel",
        &p("vmlinuz"),
        "--initrd",
        &p("initrd"),
        "--append",
        "console=ttyS0 quiet",
    ]));
    assert!(ok, "{err}");
    assert_eq!(ours, theirs);
    // A description QEMU could not boot is refused before anything is measured.
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("vcpus = 2", "vcpus = 0")).unwrap();
    let (ok, _, err) = run(Command::new(env!("CARGO_BIN_EXE_cgx"))
        .args(["measure", "launch"])
        .arg(&config));
    assert!(!ok && err.contains("launch.vcpus"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
