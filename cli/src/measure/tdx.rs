//! `cgx measure tdx`: a TD's MRTD and the RTMR events its image determines, computed from the
//! image (`cgx-measure`); with `--replay`, a TD's event log replayed and held to the image; with
//! `--quote`, a quote's measurements compared with both. Reads the files; the computation is
//! sans-IO.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use cgx_measure::tdx::event_log::EventLog;
use cgx_measure::tdx::platform::{self, Platform};
use cgx_measure::tdx::{self, DirectBoot, Found, Launch, PageOrder, Tdvf};
use serde_json::{Value, json};

use super::{FIRMWARE, SMALL, add_to_list, image_name, merge_reference_values, read, read_limited};
use crate::output::{CliResult, print_json};

/// `cgx measure tdx`.
#[derive(clap::Args, Debug, Clone)]
pub struct TdxArgs {
    /// The TDVF firmware image (QEMU's `-bios` for a `tdx-guest`).
    #[arg(long)]
    pub tdvf: PathBuf,
    /// A kernel booted directly (QEMU `-kernel`).
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    #[arg(long, requires_all = ["kernel", "memory"])]
    pub initrd: Option<PathBuf>,
    /// The kernel command line (`-append`).
    #[arg(long, requires = "kernel")]
    pub append: Option<String>,
    /// Guest memory (QEMU `-m`): bytes, or a number with K, M, G or T. Where QEMU puts the
    /// initrd depends on it, and the kernel's header, which the firmware measures, says where.
    #[arg(long, requires = "kernel")]
    pub memory: Option<String>,
    /// What the platform measures into RTMR[0], dumped from a VM of the configuration launched
    /// (same QEMU, machine type, vCPUs, devices and firmware build): QEMU's fw_cfg blobs under
    /// their names — DIR/etc/table-loader, DIR/etc/acpi/rsdp, DIR/etc/acpi/tables (a guest's
    /// /sys/firmware/qemu_fw_cfg/by_name/NAME/raw) — and the firmware's variables' data:
    /// DIR/BootOrder and the DIR/Boot#### it lists; DIR/SecureBoot, PK, KEK, db, dbx, dbt where
    /// the firmware has them (efivarfs files less their 4 attribute bytes; absent: none, as in
    /// OVMF's TDX builds). With it RTMR[0] is computed too, in the layout `cgx-measure`'s
    /// `tdx::platform` documents (edk2 builds measuring boot variables into RTMR[0]).
    #[arg(long, requires_all = ["kernel", "memory"])]
    pub platform: Option<PathBuf>,
    /// The vCPUs launched (QEMU -smp): the platform's ACPI tables must describe as many (their
    /// MADT), or they were dumped from another configuration.
    #[arg(long, requires = "platform")]
    pub vcpus: Option<u32>,
    /// per-page (upstream KVM, QEMU ≥ 9) or per-section (QEMU 8 with the TDX preview kernels).
    #[arg(long, default_value = "per-page")]
    pub page_order: String,
    /// A TD's event log (the ACPI CCEL table's log area, e.g. the guest's
    /// /sys/firmware/acpi/tables/data/CCEL): replayed into RTMR values, the image's events
    /// looked for in it.
    #[arg(long)]
    pub replay: Option<PathBuf>,
    /// A TD quote (v4 or v5): its MRTD is compared with the image's, its RTMRs with the replayed
    /// log's (or, without --replay, with the image's RTMR[1] and RTMR[2]). Parsed, not verified.
    #[arg(long)]
    pub quote: Option<PathBuf>,
    // With --replay, RTMR[0]–[2] in the reference values are the log's (RTMR[0] only, without
    // --kernel), written only once the log holds every event of the image, RTMR[1]/[2] nothing
    // else, and it matches --quote (the command's help says so).
    #[command(flatten)]
    pub refs: super::RefsArgs,
    #[arg(long)]
    pub json: bool,
}

/// `4G`, `4096M`, `2147483648`.
fn memory_bytes(s: &str) -> Result<u64, String> {
    let bad = || format!("--memory '{s}' is not a size (bytes, or a number with K, M, G or T)");
    let (num, shift) = match s.as_bytes().last().map(u8::to_ascii_uppercase) {
        Some(b'K') => (&s[..s.len() - 1], 10),
        Some(b'M') => (&s[..s.len() - 1], 20),
        Some(b'G') => (&s[..s.len() - 1], 30),
        Some(b'T') => (&s[..s.len() - 1], 40),
        _ => (s, 0),
    };
    let n: u64 = num.parse().map_err(|_| bad())?;
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}

fn h(d: &[u8; 48]) -> String {
    hex::encode(d)
}

/// The platform's RTMR[0] inputs, read from `--platform DIR`.
struct PlatformFiles {
    table_loader: Vec<u8>,
    acpi_rsdp: Vec<u8>,
    acpi_tables: Vec<u8>,
    boot_order: Option<Vec<u8>>,
    boot_options: Vec<(u16, Vec<u8>)>,
    secure_boot: [Vec<u8>; 5],
    dbt: Option<Vec<u8>>,
}

/// The largest ACPI blob read (QEMU pads its tables to 128 KiB steps).
const ACPI_FILE: u64 = 4 << 20;
/// The largest variable read (a dbx is tens of KiB; a boot option well under one).
const VARIABLE_FILE: u64 = 1 << 20;

/// `dir/name`, or `None` where there is no such file (any other failure is an error: a
/// variable that cannot be read is not one the firmware lacks).
fn optional(dir: &Path, name: &str, limit: u64) -> Result<Option<Vec<u8>>, String> {
    let path = dir.join(name);
    match std::fs::symlink_metadata(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
        Ok(_) => read_limited(&path, name, limit).map(Some),
    }
}

impl PlatformFiles {
    fn read(dir: &Path) -> Result<Self, String> {
        let acpi = |name: &str| read_limited(&dir.join(name), name, ACPI_FILE);
        let boot_order = optional(dir, "BootOrder", VARIABLE_FILE)?;
        let listed = match &boot_order {
            Some(order) => platform::boot_order(order)
                .map_err(|e| format!("{}: {e}", dir.join("BootOrder").display()))?,
            None => vec![],
        };
        let mut boot_options: Vec<(u16, Vec<u8>)> = Vec::new();
        for n in listed {
            if boot_options.iter().any(|(m, _)| *m == n) {
                continue;
            }
            let name = format!("Boot{n:04X}");
            let data = optional(dir, &name, SMALL)?.ok_or_else(|| {
                format!(
                    "BootOrder lists {name}, and {} has no such file",
                    dir.display()
                )
            })?;
            boot_options.push((n, data));
        }
        let mut secure_boot: [Vec<u8>; 5] = Default::default();
        for ((name, _), data) in platform::SECURE_BOOT_VARIABLES.iter().zip(&mut secure_boot) {
            *data = optional(dir, name, VARIABLE_FILE)?.unwrap_or_default();
        }
        Ok(Self {
            table_loader: acpi("etc/table-loader")?,
            acpi_rsdp: acpi("etc/acpi/rsdp")?,
            acpi_tables: acpi("etc/acpi/tables")?,
            boot_order,
            boot_options,
            secure_boot,
            dbt: optional(dir, "dbt", VARIABLE_FILE)?,
        })
    }

    fn platform(&self) -> Platform<'_> {
        Platform {
            table_loader: &self.table_loader,
            acpi_rsdp: &self.acpi_rsdp,
            acpi_tables: &self.acpi_tables,
            boot_order: self.boot_order.as_deref(),
            boot_options: self
                .boot_options
                .iter()
                .map(|(n, d)| (*n, d.as_slice()))
                .collect(),
            secure_boot: std::array::from_fn(|i| self.secure_boot[i].as_slice()),
            dbt: self.dbt.as_deref(),
        }
    }
}

/// What `--replay` found: the log's RTMRs, each image event's fate, and the events in
/// RTMR[1]/[2] a direct boot of the image does not explain (`(rtmr, type, digest)`).
struct Replayed {
    rtmr: [[u8; 48]; 4],
    events: Vec<(tdx::Expected, Found)>,
    unexplained: Vec<(usize, u32, Option<[u8; 48]>)>,
    /// RTMR[0]'s extended events: `(type, SHA-384)`.
    rtmr0: Vec<(u32, [u8; 48])>,
}

pub fn tdx(args: &TdxArgs) -> CliResult {
    let firmware = read_limited(&args.tdvf, "firmware", FIRMWARE)?;
    let tdvf = Tdvf::parse(&firmware).map_err(|e| format!("{}: {e}", args.tdvf.display()))?;
    let order: PageOrder = args
        .page_order
        .parse()
        .map_err(|e: cgx_measure::Error| e.to_string())?;
    let (kernel, initrd) = match &args.kernel {
        Some(k) => (
            Some(read(k, "kernel")?),
            args.initrd
                .as_deref()
                .map(|p| read(p, "initrd"))
                .transpose()?,
        ),
        None => (None, None),
    };
    // Without an initrd the memory size changes nothing measured; 2 GiB stands in.
    let memory = args
        .memory
        .as_deref()
        .map(memory_bytes)
        .transpose()?
        .unwrap_or(2 << 30);
    let files = args
        .platform
        .as_deref()
        .map(PlatformFiles::read)
        .transpose()?;
    let platform = files.as_ref().map(PlatformFiles::platform);
    if let (Some(p), Some(n)) = (&platform, args.vcpus) {
        let described = platform::acpi_vcpus(p.acpi_tables).map_err(|e| e.to_string())?;
        if described != n {
            return Err(format!(
                "--vcpus {n}, but the platform's ACPI tables describe {described}: dump them \
                 from a VM launched with {n}"
            ));
        }
    }
    let boot = kernel.as_deref().map(|kernel| DirectBoot {
        kernel,
        initrd: initrd.as_deref(),
        cmdline: args.append.as_deref(),
        memory,
        platform: platform.as_ref(),
    });
    let launch = tdx::measure(&tdvf, order, boot.as_ref()).map_err(|e| e.to_string())?;

    let replayed = match &args.replay {
        Some(p) => {
            let bytes = read_limited(p, "event log", tdx::event_log::MAX_LOG as u64)?;
            let log = EventLog::parse(&bytes).map_err(|e| format!("{}: {e}", p.display()))?;
            // Without a kernel the boot is not a direct one: RTMR[1]/[2] are a boot loader's,
            // which the image does not explain, and go unjudged (and unrecorded).
            let unexplained = match boot {
                Some(_) => tdx::unexplained(&launch, &log)
                    .into_iter()
                    .map(|e| (e.mr_index as usize - 1, e.event_type, e.sha384))
                    .collect(),
                None => vec![],
            };
            Some(Replayed {
                rtmr: log.replay(),
                events: tdx::check_events(&launch, &log),
                unexplained,
                rtmr0: log
                    .rtmr_events(0)
                    .filter_map(|e| Some((e.event_type, e.sha384?)))
                    .collect(),
            })
        }
        None => None,
    };
    let quote = match &args.quote {
        Some(p) => {
            let q = read_limited(p, "quote", SMALL)?;
            Some(
                cgx_attestation::tdx::td_measurements(&q)
                    .map_err(|e| format!("{}: {e}", p.display()))?,
            )
        }
        None => None,
    };

    // What must hold for exit 0, each with its finding.
    let mut problems: Vec<String> = Vec::new();
    if let Some(r) = &replayed {
        for (x, found) in &r.events {
            match found {
                Found::Same => {}
                Found::Differs(d) => problems.push(format!(
                    "RTMR[{}] {}: the log has {}, the image gives {}",
                    x.kind.rtmr(),
                    x.kind.name(),
                    h(d),
                    h(&x.digest)
                )),
                Found::Absent => problems.push(format!(
                    "RTMR[{}] {}: not in the log (the image gives {})",
                    x.kind.rtmr(),
                    x.kind.name(),
                    h(&x.digest)
                )),
            }
        }
        for (i, ty, d) in &r.unexplained {
            problems.push(format!(
                "RTMR[{i}]: an event of type {ty:#x} ({}) the image's direct boot does not explain",
                d.as_ref().map_or_else(|| "no SHA-384".to_string(), h)
            ));
        }
    }
    let rtmr0 = launch.rtmr0.as_deref().map(platform::rtmr0);
    if let (Some(r), Some(ours)) = (&replayed, &launch.rtmr0) {
        // Event by event, so a mismatch names what differs (the ACPI tables, a variable…).
        for i in 0..ours.len().max(r.rtmr0.len()) {
            match (ours.get(i), r.rtmr0.get(i)) {
                (Some(o), Some((_, d))) if o.digest == *d => {}
                (Some(o), Some((_, d))) => problems.push(format!(
                    "RTMR[0] event {} ({}): the log has {}, the image and platform give {}",
                    i + 1,
                    o.name,
                    h(d),
                    h(&o.digest)
                )),
                (Some(o), None) => problems.push(format!(
                    "RTMR[0] event {} ({}): not in the log",
                    i + 1,
                    o.name
                )),
                (None, Some((ty, d))) => problems.push(format!(
                    "RTMR[0] event {}: the log has one more, of type {ty:#x} ({})",
                    i + 1,
                    h(d)
                )),
                (None, None) => {}
            }
        }
    }
    if let Some((mrtd, rtmr)) = &quote {
        if *mrtd != launch.mrtd {
            problems.push(format!(
                "MRTD: the quote has {}, the image gives {}",
                h(mrtd),
                h(&launch.mrtd)
            ));
        }
        match (&replayed, &launch.rtmr) {
            (Some(r), _) => {
                for (i, (q, l)) in rtmr.iter().zip(&r.rtmr).enumerate() {
                    if q != l {
                        problems.push(format!(
                            "RTMR[{i}]: the quote has {}, the log replays to {} (the log is not \
                             this TD's, or not whole)",
                            h(q),
                            h(l)
                        ));
                    }
                }
            }
            (None, Some(computed)) => {
                if let Some(r0) = &rtmr0
                    && rtmr[0] != *r0
                {
                    problems.push(format!(
                        "RTMR[0]: the quote has {}, the image and platform give {} (--replay the \
                         TD's event log to see which event differs)",
                        h(&rtmr[0]),
                        h(r0)
                    ));
                }
                for (i, c) in computed.iter().enumerate() {
                    if rtmr[i + 1] != *c {
                        problems.push(format!(
                            "RTMR[{}]: the quote has {}, the image gives {} in edk2's layout \
                             (--replay the TD's event log to see which event differs)",
                            i + 1,
                            h(&rtmr[i + 1]),
                            h(c)
                        ));
                    }
                }
            }
            (None, None) => {}
        }
    }

    // The RTMRs the reference values name: the log's where a log is given (and holds), else
    // the image's RTMR[1] and RTMR[2].
    let rtmr_refs: Vec<(usize, [u8; 48])> = match (&replayed, &launch.rtmr) {
        (Some(r), Some(_)) => (0..3).map(|i| (i, r.rtmr[i])).collect(),
        (Some(r), None) => vec![(0, r.rtmr[0])],
        (None, Some([r1, r2])) => rtmr0
            .map(|r0| (0, r0))
            .into_iter()
            .chain([(1, *r1), (2, *r2)])
            .collect(),
        (None, None) => vec![],
    };
    let out = describe(
        &launch,
        replayed.as_ref(),
        &rtmr_refs,
        memory,
        args,
        &problems,
    );
    if let Some(path) = &args.refs.reference_values {
        if !problems.is_empty() {
            return Err(format!(
                "reference values not written: {}",
                problems.join("; ")
            ));
        }
        write_reference_values(path, args, &launch, &rtmr_refs, &out)?;
    }
    if args.json {
        print_json(&out)?;
    } else {
        print_text(&launch, replayed.as_ref(), &rtmr_refs, &problems);
    }
    Ok(if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// What the replayed log made of one of the image's events.
fn found(replayed: Option<&Replayed>, x: &tdx::Expected) -> Option<Found> {
    replayed?
        .events
        .iter()
        .find(|(e, _)| e == x)
        .map(|(_, f)| *f)
}

fn describe(
    launch: &Launch,
    replayed: Option<&Replayed>,
    rtmr_refs: &[(usize, [u8; 48])],
    memory: u64,
    args: &TdxArgs,
    problems: &[String],
) -> Value {
    let events: Vec<Value> = launch
        .events
        .iter()
        .map(|x| {
            let found = found(replayed, x).map(|f| match f {
                Found::Same => json!("in the log"),
                Found::Differs(d) => json!({"differs": h(&d)}),
                Found::Absent => json!("absent from the log"),
            });
            json!({
                "rtmr": x.kind.rtmr(),
                "event": x.kind.name(),
                "sha384": h(&x.digest),
                "log": found,
            })
        })
        .collect();
    json!({
        "kind": "tdx",
        "firmware": args.tdvf.display().to_string(),
        "mr_td": h(&launch.mrtd),
        "rtmr": rtmr_refs.iter().map(|(i, d)| (i.to_string(), json!(h(d)))).collect::<serde_json::Map<_, _>>(),
        "rtmr_source": match (replayed.is_some(), launch.rtmr.is_some(), launch.rtmr0.is_some()) {
            (true, _, _) => "event log",
            (false, true, true) => "image and platform (edk2 direct-boot layout)",
            (false, true, false) => "image (edk2 direct-boot layout)",
            (false, false, _) => "none (no kernel, no event log)",
        },
        "rtmr0_events": launch.rtmr0.as_ref().map(|events| events.iter().map(|e| json!({
            "event": e.name,
            "sha384": h(&e.digest),
        })).collect::<Vec<_>>()),
        "vcpus": args.vcpus,
        "replayed_rtmr": replayed.map(|r| r.rtmr.iter().map(h).collect::<Vec<_>>()),
        "image_events": events,
        "page_order": args.page_order,
        "memory": args.kernel.as_ref().map(|_| memory),
        "direct_kernel_boot": args.kernel.is_some(),
        "match": problems.is_empty(),
        "problems": problems,
    })
}

fn print_text(
    launch: &Launch,
    replayed: Option<&Replayed>,
    rtmr_refs: &[(usize, [u8; 48])],
    problems: &[String],
) {
    println!("mr_td: {}", h(&launch.mrtd));
    for (i, d) in rtmr_refs {
        println!("rtmr{i}: {}", h(d));
    }
    for e in launch.rtmr0.iter().flatten() {
        eprintln!("RTMR[0] {}: {}", e.name, h(&e.digest));
    }
    for x in &launch.events {
        let found = found(replayed, x).map_or("", |f| match f {
            Found::Same => " (in the log)",
            Found::Differs(_) => " (DIFFERS in the log)",
            Found::Absent => " (ABSENT from the log)",
        });
        eprintln!(
            "RTMR[{}] {}: {}{found}",
            x.kind.rtmr(),
            x.kind.name(),
            h(&x.digest)
        );
    }
    for p in problems {
        println!("MISMATCH {p}");
    }
}

/// `tdx.mr_td` and `tdx.rtmr.<i>` gain the values; `tdx.images.<name>` records them together,
/// which the policy then requires of a TD with that MRTD (no mixing of one image's RTMRs with
/// another's).
fn write_reference_values(
    path: &Path,
    args: &TdxArgs,
    launch: &Launch,
    rtmr_refs: &[(usize, [u8; 48])],
    described: &Value,
) -> Result<(), String> {
    // By default the firmware's and the kernel's file names: another kernel is another image.
    let name = match (&args.refs.image_name, &args.kernel) {
        (Some(n), _) => n.clone(),
        (None, Some(k)) => format!("{}+{}", image_name(None, &args.tdvf), image_name(None, k)),
        (None, None) => image_name(None, &args.tdvf),
    };
    let mut image = serde_json::Map::new();
    for key in [
        "mr_td",
        "rtmr",
        "rtmr_source",
        "page_order",
        "memory",
        "vcpus",
        "direct_kernel_boot",
    ] {
        if let Some(v) = described.get(key).filter(|v| !v.is_null()) {
            image.insert(key.into(), v.clone());
        }
    }
    let mrtd = json!(h(&launch.mrtd));
    merge_reference_values(path, "tdx", &name, &Value::Object(image), |tdx| {
        add_to_list(tdx, "mr_td", "tdx.mr_td", mrtd)?;
        let rtmr = tdx
            .entry("rtmr")
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .ok_or("tdx.rtmr is not a JSON object")?;
        for (i, d) in rtmr_refs {
            add_to_list(rtmr, &i.to_string(), &format!("tdx.rtmr.{i}"), json!(h(d)))?;
        }
        Ok(())
    })
}
