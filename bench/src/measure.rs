//! `cgx bench measure`: SEV-SNP launch digests per second for a 4 MiB firmware with a directly
//! booted kernel and initrd, against the bound they chase — raw hashing of the same bytes with
//! the same algorithms in the same run (SHA-384 over the firmware's pages, SHA-256 over kernel
//! and initrd, one-shot) — and AMD's `sev-snp-measure` (Python) on the same files, where it is
//! installed. The launch adds what raw hashing does not: a PAGE_INFO hash per page, the metadata
//! sections and the VMSAs.
//!
//! And the same for TDX (`tdx` in the output): MRTD of a 4 MiB TDVF and the image's RTMR events
//! (the kernel's Authenticode digest after QEMU's header changes, the initrd, the command line)
//! against raw SHA-384 of the firmware, kernel and initrd. MRTD hashes each 256-byte chunk with
//! a 128-byte header, so its bound is not reachable: the firmware is 4 of 64 MiB.

use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use aws_lc_rs::digest::{SHA256, SHA384, digest};
use cgx_measure::ovmf::{Ovmf, testing};
use cgx_measure::snp::{self, LaunchParams, SevHashes, Vmm};
use serde_json::json;

use crate::{CliResult, median};

const FIRMWARE_PAGES: usize = 1024; // 4 MiB
const KERNEL: usize = 12 << 20;
const INITRD: usize = 48 << 20;
const VCPUS: u32 = 4;

/// Bytes that do not repeat page to page (a compressed kernel looks like this).
fn noise(len: usize, seed: u8) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 48);
    let mut block = [seed; 48];
    while out.len() < len {
        let d = digest(&SHA384, &block);
        block.copy_from_slice(d.as_ref());
        out.extend_from_slice(&block);
    }
    out.truncate(len);
    out
}

pub fn bench(rounds: usize, json_out: bool) -> CliResult {
    if rounds == 0 {
        return Err("--rounds must be positive".into());
    }
    let mut firmware = testing::image(
        FIRMWARE_PAGES,
        &[
            (0x80_0000, 0x9000, 1),
            (0x80_9000, 0x1000, 2),
            (0x80_a000, 0x1000, 3),
            (0x80_b000, 0x1000, 0x10),
        ],
        Some(0x80_bc00),
    );
    // Firmware code, not a fill byte, in front of the tables at the end.
    let code = noise(firmware.len() - 4 * 4096, 1);
    firmware[..code.len()].copy_from_slice(&code);
    let (kernel, initrd) = (noise(KERNEL, 2), noise(INITRD, 3));
    let cmdline = "console=ttyS0 root=/dev/vda1 ro";
    let ovmf = Ovmf::parse(&firmware).map_err(|e| e.to_string())?;

    let launch = || -> Result<[u8; 48], String> {
        let params = LaunchParams {
            vcpus: VCPUS,
            vcpu_signature: snp::cpu_type("EPYC-Genoa").unwrap_or_default(),
            vmm: Vmm::Qemu,
            guest_features: 1,
            kernel_hashes: Some(SevHashes::new(&kernel, Some(&initrd), Some(cmdline))),
            firmware_digest: None,
        };
        snp::launch_digest(&ovmf, &params).map_err(|e| e.to_string())
    };
    let raw = || {
        let a = digest(&SHA384, &firmware);
        let b = digest(&SHA256, &kernel);
        let c = digest(&SHA256, &initrd);
        a.as_ref()[0] ^ b.as_ref()[0] ^ c.as_ref()[0]
    };
    let expected = launch()?;
    let (ours, bound) = interleaved(rounds, raw, launch)?;
    let tdx = tdx_rates(&kernel, &initrd, cmdline, rounds)?;

    // The peer, on the same files.
    let peer = peer_seconds(&firmware, &kernel, &initrd, cmdline, &expected)?;
    let round3 = |x: f64| (x * 1000.0).round() / 1000.0;
    let out = json!({
        "input": {
            "firmware_mib": firmware.len() >> 20,
            "kernel_mib": KERNEL >> 20,
            "initrd_mib": INITRD >> 20,
            "vcpus": VCPUS,
        },
        "rounds": rounds,
        "digests_per_sec": round3(1.0 / ours),
        "raw_hash_per_sec": round3(1.0 / bound),
        "ratio": round3(bound / ours),
        "goal_ratio": 0.8,
        "cgx_ms": round3(ours * 1e3),
        "sev_snp_measure_ms": peer.map(|p| round3(p * 1e3)),
        "speedup_over_sev_snp_measure": peer.map(|p| round3(p / ours)),
        "tdx": {
            "launches_per_sec": round3(1.0 / tdx.0),
            "raw_hash_per_sec": round3(1.0 / tdx.1),
            "ratio": round3(tdx.1 / tdx.0),
            "cgx_ms": round3(tdx.0 * 1e3),
        },
    });
    if json_out {
        crate::print_json(&out)?;
    } else {
        println!(
            "measure: SNP launch digest of a {} MiB firmware + {} MiB kernel + {} MiB initrd, {VCPUS} vCPUs, median of {rounds}",
            firmware.len() >> 20,
            KERNEL >> 20,
            INITRD >> 20
        );
        println!(
            "  {} digests/s; raw SHA-384/SHA-256 of the same bytes {} /s: ratio {} (goal ≥ 0.8)",
            out["digests_per_sec"], out["raw_hash_per_sec"], out["ratio"]
        );
        println!(
            "  TDX (MRTD + kernel, initrd, command line events): {} /s; raw SHA-384 of the same bytes {} /s: ratio {}",
            out["tdx"]["launches_per_sec"], out["tdx"]["raw_hash_per_sec"], out["tdx"]["ratio"]
        );
        match peer {
            Some(p) => println!(
                "  sev-snp-measure: {:.0} ms, cgx {:.1} ms ({}× faster)",
                p * 1e3,
                ours * 1e3,
                out["speedup_over_sev_snp_measure"]
            ),
            None => {
                println!("  sev-snp-measure: not installed (pip install sev-snp-measure==0.0.13)")
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Median seconds of a TDX measurement (MRTD of a 4 MiB TDVF whose code volume is measured,
/// and the image's RTMR events for a direct boot) and of raw SHA-384 over the firmware, the
/// kernel and the initrd, interleaved.
fn tdx_rates(
    kernel_noise: &[u8],
    initrd: &[u8],
    cmdline: &str,
    rounds: usize,
) -> Result<(f64, f64), String> {
    use cgx_measure::tdx::{self, DirectBoot, PageOrder, Tdvf};
    let pages = FIRMWARE_PAGES as u64;
    // edk2's shape: CFV (528 KiB) and BFV measured, a TD HOB and temporary memory added.
    let mut firmware = tdx::tdvf::testing::image(
        FIRMWARE_PAGES,
        &[
            (0, 0x84000, 0xffc0_0000, 0x84000, 1, 1),
            (0x84000, 0x37c000, 0xffc8_4000, 0x37c000, 0, 1),
            (0, 0, 0x80_9000, 0x2000, 2, 0),
            (0, 0, 0x80_0000, 0x9000, 3, 0),
        ],
    );
    let code = noise(((pages - 1) * 4096) as usize, 4);
    firmware[..code.len()].copy_from_slice(&code);
    let tdvf = Tdvf::parse(&firmware).map_err(|e| e.to_string())?;
    // A bzImage with an EFI stub: the made-to-order headers in front of the kernel's bytes.
    let mut kernel = kernel_noise.to_vec();
    let head = tdx::testing::kernel();
    kernel[..head.len()].copy_from_slice(&head);
    let boot = DirectBoot {
        kernel: &kernel,
        initrd: Some(initrd),
        cmdline: Some(cmdline),
        memory: 8 << 30,
        platform: None,
    };
    let raw = || {
        let a = digest(&SHA384, &firmware);
        let b = digest(&SHA384, &kernel);
        let c = digest(&SHA384, initrd);
        a.as_ref()[0] ^ b.as_ref()[0] ^ c.as_ref()[0]
    };
    interleaved(rounds, raw, || {
        tdx::measure(&tdvf, PageOrder::PerPage, Some(&boot)).map_err(|e| e.to_string())
    })
}

/// Median seconds of `ours` and of `bound`, run alternately `rounds` times so drift on the
/// machine falls on both.
fn interleaved<B, T>(
    rounds: usize,
    mut bound: impl FnMut() -> B,
    mut ours: impl FnMut() -> Result<T, String>,
) -> Result<(f64, f64), String> {
    let (mut o, mut b) = (vec![], vec![]);
    for _ in 0..rounds {
        let t = Instant::now();
        std::hint::black_box(bound());
        b.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        std::hint::black_box(ours()?);
        o.push(t.elapsed().as_secs_f64());
    }
    Ok((median(o), median(b)))
}

/// `sev-snp-measure` on the same inputs (median of 3 runs, wall time, process start included);
/// it must print the same digest. `None` where it is not installed.
fn peer_seconds(
    firmware: &[u8],
    kernel: &[u8],
    initrd: &[u8],
    cmdline: &str,
    expected: &[u8; 48],
) -> Result<Option<f64>, String> {
    let present = Command::new("sev-snp-measure")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !present {
        return Ok(None);
    }
    let dir = cgx_devnet::temp_dir("bench-measure").map_err(|e| e.to_string())?;
    let write = |name: &str, b: &[u8]| -> Result<String, String> {
        let p = dir.join(name);
        std::fs::write(&p, b).map_err(|e| e.to_string())?;
        Ok(p.to_string_lossy().to_string())
    };
    let (f, k, i) = (
        write("fw", firmware)?,
        write("k", kernel)?,
        write("i", initrd)?,
    );
    let mut times = vec![];
    for _ in 0..3 {
        let t = Instant::now();
        let out = Command::new("sev-snp-measure")
            .args([
                "--mode",
                "snp",
                "--vcpus",
                &VCPUS.to_string(),
                "--vcpu-type",
                "EPYC-Genoa",
            ])
            .args([
                "--ovmf", &f, "--kernel", &k, "--initrd", &i, "--append", cmdline,
            ])
            .output()
            .map_err(|e| e.to_string())?;
        times.push(t.elapsed().as_secs_f64());
        let got = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if got != hex::encode(expected) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(format!(
                "sev-snp-measure computed {got}, cgx {}: they must agree",
                hex::encode(expected)
            ));
        }
    }
    let _ = std::fs::remove_dir_all(Path::new(&dir));
    Ok(Some(median(times)))
}
