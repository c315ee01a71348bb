#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! `cgx measure tdx` end to end on a TDVF image made to order (Debian ships no TDX firmware):
//! MRTD equal to an independent computation (Python's hashlib, in `cgx-measure`'s unit test),
//! the image's RTMR events held to an event log, reference values written only from a log that
//! holds, a real TD quote compared (from `../shared/vectors`, skipped visibly where absent), and
//! bad input refused with exit 2.

use std::path::{Path, PathBuf};
use std::process::Command;

use cgx_measure::tdx::event_log::{
    EV_EFI_ACTION, EV_EFI_BOOT_SERVICES_APPLICATION, EV_EFI_PLATFORM_FIRMWARE_BLOB2, EV_EVENT_TAG,
    EV_SEPARATOR, testing::log,
};
use cgx_measure::tdx::{TAG_INITRD, TAG_LOAD_OPTIONS, testing};
use serde_json::Value;

/// The independently computed MRTD of `tdvf::testing::small()` (see `mrtd.rs`).
const SMALL_MRTD: &str = "2c06e32d145be6f5e9c6a124806b04cb12d894419c279eef8cebaaf3a4b02b696ab6bbb8264591af53089d3e92df7643";

fn tmp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("cgx-tdx-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

fn cgx(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_cgx"))
        .args(["measure", "tdx"])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

struct Files {
    dir: PathBuf,
}

impl Files {
    fn new(name: &str) -> Self {
        let dir = tmp(name);
        std::fs::write(
            dir.join("tdvf.fd"),
            cgx_measure::tdx::tdvf::testing::small(),
        )
        .unwrap();
        std::fs::write(dir.join("bzImage"), testing::kernel()).unwrap();
        std::fs::write(dir.join("initrd"), b"an initrd, twenty-odd bytes").unwrap();
        Files { dir }
    }
    fn p(&self, f: &str) -> String {
        self.dir.join(f).display().to_string()
    }
    /// The direct-boot flags.
    fn boot(&self) -> Vec<String> {
        [
            "--tdvf",
            &self.p("tdvf.fd"),
            "--kernel",
            &self.p("bzImage"),
            "--initrd",
            &self.p("initrd"),
            "--append",
            "console=hvc0 root=/dev/vda",
            "--memory",
            "4G",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }
}

fn json_of(args: &[String]) -> (i32, Value) {
    let mut a: Vec<&str> = args.iter().map(String::as_str).collect();
    a.push("--json");
    let (code, out, err) = cgx(&a);
    assert!(code == 0 || code == 1, "exit {code}: {err}");
    (code, serde_json::from_str(&out).unwrap())
}

/// The direct boot replayed against `log`: it must not match; its problems, as JSON text.
fn mismatches(f: &Files, log: &Path) -> String {
    let mut args = f.boot();
    args.extend(["--replay".into(), log.display().to_string()]);
    let (code, r) = json_of(&args);
    assert_eq!(code, 1, "{r}");
    r["problems"].to_string()
}

fn digest(v: &Value, event: &str) -> [u8; 48] {
    let d = v["image_events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["event"] == event)
        .unwrap()["sha384"]
        .as_str()
        .unwrap();
    hex::decode(d).unwrap().try_into().unwrap()
}

fn fixed(b: &[u8]) -> [u8; 48] {
    let mut out = [0u8; 48];
    out.copy_from_slice(aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA384, b).as_ref());
    out
}

/// A TD's event log as edk2's OVMF writes one for this boot, with `initrd` as the initrd
/// event's digest.
fn td_log(v: &Value, initrd: [u8; 48]) -> Vec<u8> {
    let tagged = |tag: u32| [tag.to_le_bytes().as_slice(), &[0; 4]].concat();
    let (lo, ird) = (tagged(TAG_LOAD_OPTIONS), tagged(TAG_INITRD));
    log(
        &[
            (1, 0x8000_000b, [0x11; 48], b"TdxTable"),
            (
                1,
                EV_EFI_PLATFORM_FIRMWARE_BLOB2,
                digest(v, "configuration firmware volume"),
                b"Fv",
            ),
            (1, EV_SEPARATOR, fixed(&[0; 4]), &[0; 4]),
            (1, 0xa, [0x22; 48], b"ACPI DATA"),
            (
                2,
                EV_EFI_BOOT_SERVICES_APPLICATION,
                digest(v, "kernel"),
                b"kernel",
            ),
            (
                2,
                EV_EFI_ACTION,
                fixed(b"Calling EFI Application from Boot Option"),
                b"Calling EFI Application from Boot Option",
            ),
            (2, EV_SEPARATOR, fixed(&[0; 4]), &[0; 4]),
            (3, EV_EVENT_TAG, digest(v, "kernel command line"), &lo),
            (3, EV_EVENT_TAG, initrd, &ird),
            (
                2,
                EV_EFI_ACTION,
                fixed(b"Exit Boot Services Invocation"),
                b"Exit Boot Services Invocation",
            ),
            (
                2,
                EV_EFI_ACTION,
                fixed(b"Exit Boot Services Returned with Success"),
                b"Exit Boot Services Returned with Success",
            ),
        ],
        4096,
    )
}

#[test]
fn mrtd_and_image_events_from_a_made_to_order_tdvf() {
    let f = Files::new("mrtd");
    let (code, out, err) = cgx(&["--tdvf", &f.p("tdvf.fd")]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("mr_td: {SMALL_MRTD}"));
    let (_, v) = json_of(&[
        "--tdvf".into(),
        f.p("tdvf.fd"),
        "--page-order".into(),
        "per-section".into(),
    ]);
    assert_eq!(
        v["mr_td"],
        "82722f2a0eae6b747361306aef9953311a65e6b36ccf26402c94006815e5dd61c7e6a048413048bf1a805659c0ea239a"
    );
    // Direct boot: four image events, RTMR[1] and RTMR[2] in edk2's layout.
    let (code, v) = json_of(&f.boot());
    assert_eq!(code, 0);
    assert_eq!(v["mr_td"], SMALL_MRTD);
    assert_eq!(v["image_events"].as_array().unwrap().len(), 4);
    assert_eq!(v["rtmr_source"], "image (edk2 direct-boot layout)");
    // The initrd's event is its SHA-384; the memory size moves the initrd, so the kernel's.
    assert_eq!(digest(&v, "initrd"), fixed(b"an initrd, twenty-odd bytes"));
    let mut small = f.boot();
    *small.last_mut().unwrap() = "1G".into();
    let (_, w) = json_of(&small);
    assert_ne!(digest(&v, "kernel"), digest(&w, "kernel"));
    assert_eq!(digest(&v, "initrd"), digest(&w, "initrd"));
}

#[test]
fn an_event_log_is_replayed_and_held_to_the_image() {
    let f = Files::new("replay");
    let (_, v) = json_of(&f.boot());
    let good = f.dir.join("ccel.bin");
    std::fs::write(&good, td_log(&v, digest(&v, "initrd"))).unwrap();
    let mut args = f.boot();
    args.extend(["--replay".into(), good.display().to_string()]);
    let (code, r) = json_of(&args);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["rtmr_source"], "event log");
    // The image's RTMR[1] and RTMR[2] are the log's (this log follows edk2's layout).
    assert_eq!(r["rtmr"]["1"], v["rtmr"]["1"]);
    assert_eq!(r["rtmr"]["2"], v["rtmr"]["2"]);
    assert!(r["rtmr"]["0"].is_string());

    // Reference values from the log that holds: tdx.mr_td, tdx.rtmr.0–2, tdx.images.<name>.
    let refs = f.dir.join("refs.json");
    let mut with_refs = args.clone();
    with_refs.extend(["--reference-values".into(), refs.display().to_string()]);
    with_refs.extend(["--image-name".into(), "td-image".into()]);
    assert_eq!(json_of(&with_refs).0, 0);
    let doc: Value = serde_json::from_slice(&std::fs::read(&refs).unwrap()).unwrap();
    assert_eq!(doc["tdx"]["mr_td"][0], SMALL_MRTD);
    for i in ["0", "1", "2"] {
        assert_eq!(doc["tdx"]["rtmr"][i][0], r["rtmr"][i], "rtmr {i}");
    }
    assert_eq!(doc["tdx"]["images"]["td-image"]["rtmr"], r["rtmr"]);
    assert_eq!(doc["snp"]["measurements"], serde_json::json!([]));

    // A log whose initrd is another: exit 1, the initrd named with both digests, and no
    // reference values written from it.
    let bad = f.dir.join("ccel-other-initrd.bin");
    std::fs::write(&bad, td_log(&v, [0x5a; 48])).unwrap();
    let mut args = f.boot();
    args.extend(["--replay".into(), bad.display().to_string()]);
    let (code, out, _) = cgx(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 1);
    assert!(
        out.contains("MISMATCH RTMR[2] initrd: the log has 5a5a"),
        "{out}"
    );
    let before = std::fs::read(&refs).unwrap();
    args.extend(["--reference-values".into(), refs.display().to_string()]);
    let (code, _, err) = cgx(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 2);
    assert!(err.contains("reference values not written"), "{err}");
    assert_eq!(std::fs::read(&refs).unwrap(), before);

    // A log that lacks the kernel event: named as absent.
    let lacking = f.dir.join("ccel-no-kernel.bin");
    std::fs::write(
        &lacking,
        log(&[(1, EV_SEPARATOR, fixed(&[0; 4]), &[0; 4])], 0),
    )
    .unwrap();
    let problems = mismatches(&f, &lacking);
    assert!(
        problems.contains("RTMR[1] kernel: not in the log"),
        "{problems}"
    );

    // A log with one more EFI application after the kernel (a boot loader's second stage, an
    // implant): the kernel's kind no longer checks out and the event is named.
    let mut with_extra = td_log(&v, digest(&v, "initrd"));
    let pad = with_extra.iter().rposition(|b| *b != 0xff).unwrap() + 1;
    with_extra.truncate(pad);
    for x in [2u32, EV_EFI_BOOT_SERVICES_APPLICATION, 1] {
        with_extra.extend_from_slice(&x.to_le_bytes());
    }
    with_extra.extend_from_slice(&0x000cu16.to_le_bytes());
    with_extra.extend_from_slice(&[0x77; 48]);
    with_extra.extend_from_slice(&0u32.to_le_bytes());
    let extra = f.dir.join("ccel-extra.bin");
    std::fs::write(&extra, with_extra).unwrap();
    let problems = mismatches(&f, &extra);
    assert!(
        problems.contains("RTMR[1] kernel: the log has 7777"),
        "{problems}"
    );
    assert!(problems.contains("does not explain"), "{problems}");

    // Without a kernel (a boot from disk), a replayed log gives RTMR[0] only; the image's name
    // is the firmware's. With one, the firmware's and the kernel's.
    let refs2 = f.dir.join("refs2.json");
    let (code, _, err) = cgx(&[
        "--tdvf",
        &f.p("tdvf.fd"),
        "--replay",
        &good.display().to_string(),
        "--reference-values",
        &refs2.display().to_string(),
    ]);
    assert_eq!(code, 0, "{err}");
    let mut args = f.boot();
    args.extend(["--replay".into(), good.display().to_string()]);
    args.extend(["--reference-values".into(), refs2.display().to_string()]);
    assert_eq!(json_of(&args).0, 0);
    let doc: Value = serde_json::from_slice(&std::fs::read(&refs2).unwrap()).unwrap();
    let images = &doc["tdx"]["images"];
    assert_eq!(
        images["tdvf.fd"]["rtmr"]
            .as_object()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["0"]
    );
    assert_eq!(
        images["tdvf.fd+bzImage"]["rtmr"].as_object().unwrap().len(),
        3
    );
}

/// RTMR[0] (and the TD HOB's digest) for a direct boot of `tdvf::testing::small()` with 4 GiB
/// on the platform [`platform_dir`] writes, computed apart from cgx — from QEMU's `tdx.c` and
/// `tdvf-hob.c`, the TCG `UEFI_VARIABLE_DATA` layout and the event order in
/// `cgx_measure::tdx::platform` — by this Python (hashlib, struct, uuid):
///
/// ```text
/// import hashlib, struct, uuid
/// H = lambda b: hashlib.sha384(b).digest()
/// # tdvf::testing::small(): page n holds byte n; the CFV is pages 0-1.
/// cfv = bytes([0]) * 4096 + bytes([1]) * 4096
/// mem = 4 << 30
/// low = 0x80000000 if mem >= 0xB0000000 else 0xB0000000
/// low = min(mem, low)
/// ram = [(0, low, False)] + ([(1 << 32, mem - low, False)] if mem > low else [])
/// for (a, n) in [(0x809000, 0x1000), (0x80A000, 0x2000)]:  # TD HOB, temporary memory
///     i = next(i for i, (s, l, acc) in enumerate(ram) if not acc and s <= a and a + n <= s + l)
///     s, l, _ = ram[i]
///     ram[i] = (a, n, True)
///     if a > s: ram.append((s, a - s, False))
///     if a + n < s + l: ram.append((a + n, s + l - a - n, False))
/// ram.sort()
/// size = 56 + 48 * len(ram)
/// hob = struct.pack('<HHIIIQQQQQ', 1, 56, 0, 9, 0, 0, 0, 0, 0, 0x809000 + size + 8)
/// for (a, n, acc) in ram:
///     hob += struct.pack('<HHI16sIIQQ', 3, 48, 0, bytes(16), 0 if acc else 7, 7, a, n)
/// def var(guid, name, data=b''):
///     n = name.encode('utf-16-le')
///     return uuid.UUID(guid).bytes_le + struct.pack('<QQ', len(name), len(data)) + n + data
/// G = '8be4df61-93ca-11d2-aa0d-00e098032b8c'; D = 'd719b2cb-3d3a-4596-a3bc-dad00e67656f'
/// def table(sig, body): return sig + struct.pack('<I', 36 + len(body)) + bytes(28) + body
/// facs = b'FACS' + struct.pack('<I', 64) + bytes(56)
/// madt = bytes(8) + b''.join(bytes([0, 8, i, i]) + struct.pack('<I', 1 if i < 2 else 0) for i in range(3))
/// tables = facs + table(b'DSDT', bytes([0x10]) * 20) + table(b'APIC', madt) + bytes(512)
/// events = [hob, cfv, var(G, 'SecureBoot'), var(G, 'PK'), var(G, 'KEK'), var(D, 'db'), var(D, 'dbx'),
///           bytes(4), b'table-loader blob', b'RSD PTR rsdp blob', tables, bytes([1, 0, 0, 0]),
///           b'boot option one', b'boot option zero']
/// mr = bytes(48)
/// for e in events: mr = H(mr + H(e))
/// print(H(hob).hex()); print(mr.hex())
/// ```
const PLATFORM_TD_HOB: &str = "74d13443557ef713bcc94001a6b069e75a0e252f6a11fc70846f99cf927d3b94d4bbe9c0de89e996dcd334b1d25a1483";
const PLATFORM_RTMR0: &str = "bbb7440e839dbdcb6f4cda9ebb8e18b62b8550f8ab057d79e4649539f83beded58a731ee0201eef815142a344b9358ba";

/// A platform as `--platform` reads it: QEMU's fw_cfg blobs (ACPI tables for 2 vCPUs), and
/// BootOrder listing Boot0001 then Boot0000.
fn platform_dir(f: &Files) -> PathBuf {
    let d = f.dir.join("platform");
    std::fs::create_dir_all(d.join("etc/acpi")).unwrap();
    std::fs::write(d.join("etc/table-loader"), b"table-loader blob").unwrap();
    std::fs::write(d.join("etc/acpi/rsdp"), b"RSD PTR rsdp blob").unwrap();
    std::fs::write(
        d.join("etc/acpi/tables"),
        cgx_measure::tdx::platform::testing::acpi_tables(2),
    )
    .unwrap();
    std::fs::write(d.join("BootOrder"), [1, 0, 0, 0]).unwrap();
    std::fs::write(d.join("Boot0001"), b"boot option one").unwrap();
    std::fs::write(d.join("Boot0000"), b"boot option zero").unwrap();
    d
}

#[test]
fn rtmr0_from_the_image_the_memory_and_the_platform() {
    let f = Files::new("platform");
    let dir = platform_dir(&f);
    let mut args = f.boot();
    args.extend(["--platform".into(), dir.display().to_string()]);
    args.extend(["--vcpus".into(), "2".into()]);
    let (code, v) = json_of(&args);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["rtmr"]["0"], PLATFORM_RTMR0);
    assert_eq!(
        v["rtmr_source"],
        "image and platform (edk2 direct-boot layout)"
    );
    let events = v["rtmr0_events"].as_array().unwrap();
    assert_eq!(events.len(), 14);
    assert_eq!(events[0]["event"], "TD HOB");
    assert_eq!(events[0]["sha384"], PLATFORM_TD_HOB);
    // RTMR[1] and RTMR[2] are the image's as without a platform.
    let (_, plain) = json_of(&f.boot());
    assert_eq!(v["rtmr"]["1"], plain["rtmr"]["1"]);
    assert_eq!(v["rtmr"]["2"], plain["rtmr"]["2"]);
    // Another memory size is another TD HOB, so another RTMR[0].
    let mut other = args.clone();
    let at = other.iter().position(|a| a == "4G").unwrap();
    other[at] = "2G".into();
    let (_, w) = json_of(&other);
    assert_ne!(w["rtmr"]["0"], v["rtmr"]["0"]);
    assert_eq!(w["rtmr0_events"][1], v["rtmr0_events"][1]);

    // A log that holds: no problem; one whose ACPI tables differ: that event named.
    let log_of = |acpi: [u8; 48]| {
        let mut ev: Vec<(u32, u32, [u8; 48], &[u8])> = events
            .iter()
            .map(|e| {
                let d: [u8; 48] = hex::decode(e["sha384"].as_str().unwrap())
                    .unwrap()
                    .try_into()
                    .unwrap();
                let d = if e["event"] == "etc/acpi/tables" {
                    acpi
                } else {
                    d
                };
                let kind = match e["event"].as_str().unwrap() {
                    "configuration firmware volume" => EV_EFI_PLATFORM_FIRMWARE_BLOB2,
                    "separator" => EV_SEPARATOR,
                    _ => 0xa,
                };
                (1, kind, d, b"".as_slice())
            })
            .collect();
        let tail = [
            (2, EV_EFI_BOOT_SERVICES_APPLICATION, digest(&v, "kernel")),
            (
                2,
                EV_EFI_ACTION,
                fixed(b"Calling EFI Application from Boot Option"),
            ),
            (2, EV_SEPARATOR, fixed(&[0; 4])),
            (3, EV_EVENT_TAG, digest(&v, "kernel command line")),
            (3, EV_EVENT_TAG, digest(&v, "initrd")),
            (2, EV_EFI_ACTION, fixed(b"Exit Boot Services Invocation")),
            (
                2,
                EV_EFI_ACTION,
                fixed(b"Exit Boot Services Returned with Success"),
            ),
        ];
        let tagged = |tag: u32| [tag.to_le_bytes().as_slice(), &[0; 4]].concat();
        let (lo, ird) = (tagged(TAG_LOAD_OPTIONS), tagged(TAG_INITRD));
        let data: [&[u8]; 7] = [
            b"kernel",
            b"Calling EFI Application from Boot Option",
            &[0; 4],
            &lo,
            &ird,
            b"Exit Boot Services Invocation",
            b"Exit Boot Services Returned with Success",
        ];
        ev.extend(tail.iter().zip(data).map(|(&(m, t, d), x)| (m, t, d, x)));
        log(&ev, 0)
    };
    let acpi: [u8; 48] = hex::decode(events[10]["sha384"].as_str().unwrap())
        .unwrap()
        .try_into()
        .unwrap();
    let good = f.dir.join("ccel-platform.bin");
    std::fs::write(&good, log_of(acpi)).unwrap();
    let mut replay = args.clone();
    replay.extend(["--replay".into(), good.display().to_string()]);
    let (code, r) = json_of(&replay);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["rtmr"]["0"], PLATFORM_RTMR0);
    let bad = f.dir.join("ccel-other-acpi.bin");
    std::fs::write(&bad, log_of([0x3c; 48])).unwrap();
    let mut replay = args.clone();
    replay.extend(["--replay".into(), bad.display().to_string()]);
    let (code, r) = json_of(&replay);
    assert_eq!(code, 1);
    let problems = r["problems"].to_string();
    assert!(
        problems.contains("RTMR[0] event 11 (etc/acpi/tables): the log has 3c3c"),
        "{problems}"
    );
    assert_eq!(r["problems"].as_array().unwrap().len(), 1, "{problems}");
    // …and nothing written from it.
    let refused = f.dir.join("refused.json");
    replay.extend(["--reference-values".into(), refused.display().to_string()]);
    let (code, _, err) = cgx(&replay.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 2, "{err}");
    assert!(!refused.exists());
    // A log with one RTMR[0] event more than the platform explains (here: a vTPM's log blob
    // after the ACPI tables would be one).
    let mut extra = log_of(acpi);
    let pad = extra.iter().rposition(|b| *b != 0xff).unwrap() + 1;
    extra.truncate(pad);
    for x in [1u32, 0xa, 1] {
        extra.extend_from_slice(&x.to_le_bytes());
    }
    extra.extend_from_slice(&0x000cu16.to_le_bytes());
    extra.extend_from_slice(&[0x44; 48]);
    extra.extend_from_slice(&0u32.to_le_bytes());
    let more = f.dir.join("ccel-extra-rtmr0.bin");
    std::fs::write(&more, extra).unwrap();
    let mut replay = args.clone();
    replay.extend(["--replay".into(), more.display().to_string()]);
    let (code, r) = json_of(&replay);
    assert_eq!(code, 1);
    let problems = r["problems"].to_string();
    assert!(
        problems.contains("RTMR[0] event 15: the log has one more, of type 0xa (4444"),
        "{problems}"
    );

    // A dbt is measured after dbx where the platform has one.
    std::fs::write(dir.join("dbt"), b"a dbt").unwrap();
    let (_, t) = json_of(&args);
    assert_eq!(t["rtmr0_events"][7]["event"], "dbt");
    assert_ne!(t["rtmr"]["0"], v["rtmr"]["0"]);
    std::fs::remove_file(dir.join("dbt")).unwrap();

    // Reference values: RTMR[0]–[2] from image and platform, the vCPUs in the image's entry.
    let refs = f.dir.join("refs.json");
    let mut with_refs = args.clone();
    with_refs.extend(["--reference-values".into(), refs.display().to_string()]);
    assert_eq!(json_of(&with_refs).0, 0);
    let doc: Value = serde_json::from_slice(&std::fs::read(&refs).unwrap()).unwrap();
    assert_eq!(doc["tdx"]["rtmr"]["0"][0], PLATFORM_RTMR0);
    let image = &doc["tdx"]["images"]["tdvf.fd+bzImage"];
    assert_eq!(image["rtmr"], v["rtmr"]);
    assert_eq!(image["vcpus"], 2);

    // Tables from another vCPU count, a BootOrder naming an option not given, a platform
    // without the memory size: refused, exit 2.
    let mut four = args.clone();
    *four.last_mut().unwrap() = "4".into();
    let (code, _, err) = cgx(&four.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 2);
    assert!(
        err.contains("--vcpus 4, but the platform's ACPI tables describe 2"),
        "{err}"
    );
    std::fs::remove_file(dir.join("Boot0000")).unwrap();
    let (code, _, err) = cgx(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 2);
    assert!(err.contains("Boot0000"), "{err}");
    let (code, _, err) = cgx(&[
        "--tdvf",
        &f.p("tdvf.fd"),
        "--kernel",
        &f.p("bzImage"),
        "--platform",
        &dir.display().to_string(),
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("--memory"), "{err}");
}

fn vectors() -> Option<PathBuf> {
    let dir = std::env::var_os("CGX_VECTORS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/vectors"));
    dir.join("tdx").is_dir().then_some(dir)
}

/// A real TD quote (Intel-signed, from the vectors): its MRTD is not this made-to-order image's,
/// and the comparison says so with both values.
#[test]
fn a_real_quote_is_compared_with_the_image() {
    let Some(v) = vectors() else {
        eprintln!("SKIPPED measure tdx --quote: no ../shared/vectors (set CGX_VECTORS)");
        return;
    };
    let quote = v.join("tdx/v4-b0c06f-dcapqvl-phala/quote.bin");
    let f = Files::new("quote");
    let (code, out, err) = cgx(&[
        "--tdvf",
        &f.p("tdvf.fd"),
        "--quote",
        &quote.display().to_string(),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(out.contains("MISMATCH MRTD: the quote has "), "{out}");
    assert!(
        out.contains(&format!("the image gives {SMALL_MRTD}")),
        "{out}"
    );
    // With the image's RTMRs: each RTMR the quote disagrees on is named.
    let mut args = f.boot();
    args.extend(["--quote".into(), quote.display().to_string()]);
    let (code, r) = json_of(&args);
    assert_eq!(code, 1);
    assert!(r["problems"].to_string().contains("RTMR[1]: the quote has"));
    // With a platform, RTMR[0] too.
    let mut with_platform = args.clone();
    with_platform.extend(["--platform".into(), platform_dir(&f).display().to_string()]);
    let (code, r) = json_of(&with_platform);
    assert_eq!(code, 1);
    let problems = r["problems"].to_string();
    assert!(problems.contains("RTMR[0]: the quote has "), "{problems}");
    assert!(
        problems.contains(&format!("the image and platform give {PLATFORM_RTMR0}")),
        "{problems}"
    );
    // With a log: the quote's RTMRs against the log's replay (this log is not that TD's).
    let (_, img) = json_of(&f.boot());
    let ccel = f.dir.join("ccel.bin");
    std::fs::write(&ccel, td_log(&img, digest(&img, "initrd"))).unwrap();
    args.extend(["--replay".into(), ccel.display().to_string()]);
    let (code, r) = json_of(&args);
    assert_eq!(code, 1);
    let problems = r["problems"].to_string();
    assert!(problems.contains("RTMR[0]: the quote has"), "{problems}");
    assert!(problems.contains("the log replays to"), "{problems}");
    assert!(!problems.contains("initrd:"), "{problems}");
    // Not a quote: refused.
    let (code, _, err) = cgx(&["--tdvf", &f.p("tdvf.fd"), "--quote", &f.p("initrd")]);
    assert_eq!(code, 2);
    assert!(err.contains("TDX quote"), "{err}");
}

#[test]
fn bad_input_is_refused_with_exit_2() {
    let f = Files::new("bad");
    let snp = f.dir.join("ovmf.fd");
    std::fs::write(&snp, cgx_measure::ovmf::testing::image(4, &[], None)).unwrap();
    let (code, _, err) = cgx(&["--tdvf", &snp.display().to_string()]);
    assert_eq!(code, 2);
    assert!(err.contains("no TDX metadata"), "{err}");
    let mut args = f.boot();
    *args.last_mut().unwrap() = "lots".into();
    let (code, _, err) = cgx(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 2);
    assert!(err.contains("--memory 'lots'"), "{err}");
    let mut args = f.boot();
    args[3] = f.p("initrd"); // not a kernel
    let (code, _, err) = cgx(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 2);
    assert!(err.contains("bzImage"), "{err}");
    let (code, _, err) = cgx(&["--tdvf", &f.p("tdvf.fd"), "--replay", &f.p("initrd")]);
    assert_eq!(code, 2);
    assert!(err.contains("event log"), "{err}");
    let (code, _, err) = cgx(&["--tdvf", &f.p("tdvf.fd"), "--page-order", "random"]);
    assert_eq!(code, 2);
    assert!(err.contains("per-page or per-section"), "{err}");
    // An initrd needs the memory size.
    let (code, _, _) = cgx(&[
        "--tdvf",
        &f.p("tdvf.fd"),
        "--kernel",
        &f.p("bzImage"),
        "--initrd",
        &f.p("initrd"),
    ]);
    assert_eq!(code, 2);
}
