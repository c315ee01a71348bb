//! `cgx measure snp`: the launch digest an SEV-SNP launch of an image produces, computed from the
//! image (`cgx-measure`). Reads the files; the computation is sans-IO.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use cgx_measure::ovmf::Ovmf;
use cgx_measure::snp::id_block::{self, IdBlock, SigningKey};
use cgx_measure::snp::{self, LaunchParams, SevHashes, Vmm};
use serde_json::json;

use crate::output::{CliResult, hex_arg, print_json};

pub mod tdx;

/// The largest kernel or initrd read (a kernel is tens of MiB, an initrd at most a few hundred).
const MAX_BLOB: u64 = 1 << 30;
/// The largest firmware image (what `cgx-measure` takes).
const FIRMWARE: u64 = cgx_measure::ovmf::MAX_IMAGE as u64;
/// Keys, reports, init-data (×16), reference values (×256): 64 KiB.
const SMALL: u64 = 64 << 10;

/// How the image is launched.
#[derive(clap::Args, Debug, Clone)]
pub struct LaunchArgs {
    /// The OVMF firmware image (whole, as QEMU's `-bios` or the code flash).
    #[arg(long)]
    pub ovmf: PathBuf,
    /// A kernel booted directly (QEMU `-kernel` with `kernel-hashes=on`).
    #[arg(long)]
    pub kernel: Option<PathBuf>,
    #[arg(long, requires = "kernel")]
    pub initrd: Option<PathBuf>,
    /// The kernel command line (`-append`).
    #[arg(long, requires = "kernel")]
    pub append: Option<String>,
    #[arg(long)]
    pub vcpus: u32,
    /// A QEMU CPU model (`EPYC-Milan`, `EPYC-Genoa`, …).
    #[arg(long, conflicts_with_all = ["vcpu_sig", "vcpu_family"])]
    pub vcpu_type: Option<String>,
    /// The vCPU signature (CPUID Fn0000_0001_EAX), hex or decimal.
    #[arg(long, conflicts_with = "vcpu_family")]
    pub vcpu_sig: Option<String>,
    #[arg(long, requires_all = ["vcpu_model", "vcpu_stepping"])]
    pub vcpu_family: Option<u32>,
    #[arg(long, requires = "vcpu_family")]
    pub vcpu_model: Option<u32>,
    #[arg(long, requires = "vcpu_family")]
    pub vcpu_stepping: Option<u32>,
    /// qemu, ec2 or gce.
    #[arg(long, default_value = "qemu")]
    pub vmm_type: String,
    /// The VMSA's SEV_FEATURES, hex (0x1: SNP active).
    #[arg(long, default_value = "0x1")]
    pub guest_features: String,
    /// The firmware pages' digest computed beforehand (hex, 48 bytes): the image's pages are
    /// not hashed again.
    #[arg(long)]
    pub snp_ovmf_hash: Option<String>,
}

/// `cgx measure snp`: the launch, and what to make of it.
#[derive(clap::Args, Debug, Clone)]
pub struct SnpArgs {
    #[command(flatten)]
    pub launch: LaunchArgs,
    /// Sign an ID block for this launch with this P-384 ID key (PEM or DER, PKCS#8 or SEC1);
    /// needs --author-key and --out.
    #[arg(long, requires_all = ["author_key", "out"])]
    pub id_key: Option<PathBuf>,
    /// The P-384 author key that signs the ID key.
    #[arg(long, requires = "id_key")]
    pub author_key: Option<PathBuf>,
    /// The launch enables the author key (QEMU `author-key-enabled=on`), so reports carry its
    /// digest and the reference values name it.
    #[arg(long, requires = "author_key")]
    pub author_key_enabled: bool,
    /// The guest policy the ID block requires (hex), as the launch's `policy=`.
    #[arg(long, default_value = "0x30000", requires = "id_key")]
    pub policy: String,
    /// FAMILY_ID and IMAGE_ID (hex, up to 16 bytes each, zero-padded).
    #[arg(long, requires = "id_key")]
    pub family_id: Option<String>,
    #[arg(long, requires = "id_key")]
    pub image_id: Option<String>,
    #[arg(long, default_value_t = 0, requires = "id_key")]
    pub guest_svn: u32,
    /// HOST_DATA for the launch (32 bytes, hex).
    #[arg(long, conflicts_with = "init_data", requires = "out")]
    pub host_data: Option<String>,
    /// A CoCo init-data file (TOML) whose digest becomes HOST_DATA, as the KBS compares it (the
    /// algorithm the file names, sha256 when unnamed; fitted to 32 bytes).
    #[arg(long, requires = "out")]
    pub init_data: Option<PathBuf>,
    /// Where the QEMU `sev-snp-guest` values go: id-block.b64, id-auth.b64, host-data.b64.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Write this launch's digest (and ID key digests) into the reference values.
    #[command(flatten)]
    pub refs: RefsArgs,
    #[arg(long)]
    pub json: bool,
}

/// Where a launch's measurements go, for `cgx measure snp` and `tdx`.
#[derive(clap::Args, Debug, Clone)]
pub struct RefsArgs {
    /// Write the launch's measurements into this reference-values file, created from the
    /// defaults where it does not exist, merged where it does.
    #[arg(long)]
    pub reference_values: Option<PathBuf>,
    /// The image's name in the reference values (`snp.images`, `tdx.images`); default: the
    /// firmware's file name (for a TDX direct boot, and the kernel's after a `+`).
    #[arg(long, requires = "reference_values")]
    pub image_name: Option<String>,
}

/// Read at most `limit` bytes of `path` (a device or pipe that reports no size is bounded too).
pub(crate) fn read_limited(path: &Path, what: &str, limit: u64) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let fail = |e: std::io::Error| format!("{what} {}: {e}", path.display());
    let mut out = Vec::new();
    std::fs::File::open(path)
        .map_err(fail)?
        .take(limit + 1)
        .read_to_end(&mut out)
        .map_err(fail)?;
    if out.len() as u64 > limit {
        return Err(format!(
            "{what} {}: larger than the {} KiB taken",
            path.display(),
            limit >> 10
        ));
    }
    Ok(out)
}

/// A kernel or initrd (tens of MiB; at most 1 GiB read).
fn read(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    read_limited(path, what, MAX_BLOB)
}

fn int(s: &str, what: &str) -> Result<u64, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|_| format!("--{what} '{s}' is not a number (hex with 0x, or decimal)"))
}

impl LaunchArgs {
    fn vcpu_signature(&self, vmm: Vmm) -> Result<u32, String> {
        if let Some(t) = &self.vcpu_type {
            return snp::cpu_type(t).ok_or_else(|| {
                let known: Vec<&str> = snp::cpu::CPU_TYPES.iter().map(|t| t.0).collect();
                format!("unknown --vcpu-type {t} (known: {})", known.join(", "))
            });
        }
        if let Some(s) = &self.vcpu_sig {
            return u32::try_from(int(s, "vcpu-sig")?)
                .map_err(|_| format!("--vcpu-sig {s} is wider than 32 bits"));
        }
        if let (Some(f), Some(m), Some(s)) = (self.vcpu_family, self.vcpu_model, self.vcpu_stepping)
        {
            return Ok(snp::cpu_signature(f, m, s));
        }
        // EC2 and GCE write their own RDX; QEMU writes the signature, which must be named.
        match vmm {
            Vmm::Qemu => Err("a QEMU launch needs --vcpu-type, --vcpu-sig or --vcpu-family".into()),
            _ => Ok(0),
        }
    }

    /// The launch parameters, files read.
    pub fn params(&self) -> Result<LaunchParams, String> {
        let vmm: Vmm = self
            .vmm_type
            .parse()
            .map_err(|e: cgx_measure::Error| e.to_string())?;
        let kernel_hashes = match &self.kernel {
            Some(k) => {
                let kernel = read(k, "kernel")?;
                let initrd = self
                    .initrd
                    .as_deref()
                    .map(|p| read(p, "initrd"))
                    .transpose()?;
                Some(SevHashes::new(
                    &kernel,
                    initrd.as_deref(),
                    self.append.as_deref(),
                ))
            }
            None => None,
        };
        let firmware_digest = match &self.snp_ovmf_hash {
            Some(h) => {
                let b = hex::decode(h).map_err(|e| format!("--snp-ovmf-hash is not hex: {e}"))?;
                Some(
                    <[u8; 48]>::try_from(b.as_slice())
                        .map_err(|_| format!("--snp-ovmf-hash is {} bytes, not 48", b.len()))?,
                )
            }
            None => None,
        };
        let vcpu_signature = self.vcpu_signature(vmm)?;
        Ok(LaunchParams {
            vcpus: self.vcpus,
            // EC2 and GCE put 0x600 in RDX whatever the CPU type: a signature changes nothing.
            vcpu_signature: if vmm == Vmm::Qemu { vcpu_signature } else { 0 },
            vmm,
            guest_features: int(&self.guest_features, "guest-features")?,
            kernel_hashes,
            firmware_digest,
        })
    }
}

fn signing_key(path: &Path, what: &str) -> Result<SigningKey, String> {
    let bytes = read_limited(path, what, SMALL)?;
    let text = String::from_utf8_lossy(&bytes);
    let label = if text.contains("BEGIN EC PRIVATE KEY") {
        "EC PRIVATE KEY"
    } else {
        "PRIVATE KEY"
    };
    SigningKey::from_der(&crate::kbs::pem_or_der(&bytes, label))
        .map_err(|e| format!("{what} {}: {e}", path.display()))
}

/// The ID block, ID auth and host data files (`--out`), and what the report will carry.
fn launch_files(args: &SnpArgs, digest: [u8; 48]) -> Result<serde_json::Value, String> {
    use base64::Engine;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let Some(out) = &args.out else {
        return Ok(json!(null));
    };
    // Everything is parsed and signed before anything is written.
    let host_data = match (&args.host_data, &args.init_data) {
        (Some(h), _) => Some(hex_arg::<32>(Some(h), "host-data", true)?),
        (None, Some(f)) => {
            // As the KBS checks it: the TOML's algorithm, fitted to HOST_DATA's 32 bytes.
            let body = String::from_utf8(read_limited(f, "init-data", SMALL << 4)?)
                .map_err(|_| format!("init-data {}: not UTF-8 text", f.display()))?;
            let (_, d) = cgx_protocol::kbs::binding::init_data_digest(&body, 32)?;
            <[u8; 32]>::try_from(d.as_slice()).ok()
        }
        (None, None) => None,
    };
    let mut summary = serde_json::Map::new();
    let mut files: Vec<(&str, String)> = Vec::new();
    if let Some(h) = host_data {
        files.push(("host-data.b64", b64(&h)));
        summary.insert("host_data".into(), json!(hex::encode(h)));
    }
    if let (Some(idk), Some(authk)) = (&args.id_key, &args.author_key) {
        let (id_key, author_key) = (
            signing_key(idk, "id key")?,
            signing_key(authk, "author key")?,
        );
        let block = IdBlock {
            launch_digest: digest,
            family_id: hex_arg(args.family_id.as_deref(), "family-id", false)?,
            image_id: hex_arg(args.image_id.as_deref(), "image-id", false)?,
            guest_svn: args.guest_svn,
            policy: int(&args.policy, "policy")?,
        };
        let auth = id_block::id_auth(&block, &id_key, &author_key).map_err(|e| e.to_string())?;
        files.push(("id-block.b64", b64(&block.to_bytes())));
        files.push(("id-auth.b64", b64(&auth)));
        summary.insert("id_key_digest".into(), json!(hex::encode(id_key.digest())));
        // The report carries the author key's digest only where the launch enables it (QEMU
        // `author-key-enabled=on`; off by default): otherwise AUTHOR_KEY_DIGEST is zero.
        let author = hex::encode(author_key.digest());
        if args.author_key_enabled {
            summary.insert("author_key_digest".into(), json!(author));
        } else {
            summary.insert("author_key_digest_if_enabled".into(), json!(author));
        }
        summary.insert("policy".into(), json!(format!("{:#x}", block.policy)));
    }
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    for name in ["host-data.b64", "id-block.b64", "id-auth.b64"] {
        let p = out.join(name);
        match files.iter().find(|(n, _)| *n == name) {
            Some((_, text)) => {
                std::fs::write(&p, text).map_err(|e| format!("{}: {e}", p.display()))?;
            }
            // An earlier run's file would hand QEMU values for another launch.
            None if p.exists() => {
                std::fs::remove_file(&p).map_err(|e| format!("{}: {e}", p.display()))?;
            }
            None => {}
        }
    }
    summary.insert("out".into(), json!(out.display().to_string()));
    Ok(serde_json::Value::Object(summary))
}

/// `cgx measure snp`: print the launch digest (hex; `--json` with what went into it), and with
/// `--out` write the launch's ID block, ID auth and host data.
pub fn snp(args: &SnpArgs) -> CliResult {
    let firmware = read_limited(&args.launch.ovmf, "firmware", FIRMWARE)?;
    let ovmf =
        Ovmf::parse(&firmware).map_err(|e| format!("{}: {e}", args.launch.ovmf.display()))?;
    let params = args.launch.params()?;
    let digest = snp::launch_digest(&ovmf, &params).map_err(|e| e.to_string())?;
    let launch = launch_files(args, digest)?;
    if let Some(path) = &args.refs.reference_values {
        let name = image_name(args.refs.image_name.as_deref(), &args.launch.ovmf);
        let mut image = described(args, &params, &digest);
        image.insert(
            "direct_kernel_boot".into(),
            json!(params.kernel_hashes.is_some()),
        );
        for key in ["id_key_digest", "author_key_digest", "policy", "host_data"] {
            if let Some(v) = launch.get(key) {
                image.insert(key.into(), v.clone());
            }
        }
        let measurement = json!(hex::encode(digest));
        merge_reference_values(
            path,
            "snp",
            &name,
            &serde_json::Value::Object(image),
            |snp| add_to_list(snp, "measurements", "snp.measurements", measurement),
        )?;
    }
    if args.json {
        let mut out = described(args, &params, &digest);
        out.insert("kind".into(), json!("snp"));
        out.insert(
            "firmware".into(),
            json!(args.launch.ovmf.display().to_string()),
        );
        out.insert(
            "kernel_hashes".into(),
            json!(params.kernel_hashes.as_ref().map(|h| json!({
                "kernel_sha256": hex::encode(h.kernel),
                "initrd_sha256": hex::encode(h.initrd),
                "cmdline_sha256": hex::encode(h.cmdline),
            }))),
        );
        out.insert("launch".into(), launch);
        print_json(&out)?;
    } else {
        println!("{}", hex::encode(digest));
        if let Some(o) = launch.as_object() {
            for (k, v) in o {
                eprintln!("{k}: {}", v.as_str().unwrap_or_default());
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A launch's digest and parameters, as `--json` prints them and the reference values keep them.
fn described(
    args: &SnpArgs,
    params: &LaunchParams,
    digest: &[u8; 48],
) -> serde_json::Map<String, serde_json::Value> {
    serde_json::Map::from_iter([
        ("measurement".to_string(), json!(hex::encode(digest))),
        ("vcpus".into(), json!(params.vcpus)),
        (
            "vcpu_signature".into(),
            json!(format!("{:#010x}", params.vcpu_signature)),
        ),
        (
            "vmm".into(),
            json!(args.launch.vmm_type.to_ascii_lowercase()),
        ),
        (
            "guest_features".into(),
            json!(format!("{:#x}", params.guest_features)),
        ),
    ])
}

/// Add a launch to a reference-values file: `add` puts its digests into the lists of `kind`'s
/// section (for SNP `snp.measurements`), and what it was computed from goes to
/// `<kind>.images.<name>` (a name already there is replaced; its old digests stay listed until
/// removed by hand). A file that is not a JSON object is refused and left as it was. The new
/// file replaces the old one whole: written to a fresh file beside the one a link points to,
/// synced, renamed over it with its permissions, under a lock (`<file>.lock`) so concurrent
/// runs do not lose each other's images.
pub(crate) fn merge_reference_values(
    path: &Path,
    kind: &str,
    name: &str,
    image: &serde_json::Value,
    add: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>) -> Result<(), String>,
) -> Result<(), String> {
    use serde_json::Value;
    // Write where a link points, not over the link.
    let target = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let lock_path = target.with_extension("lock");
    let lock =
        std::fs::File::create(&lock_path).map_err(|e| format!("{}: {e}", lock_path.display()))?;
    lock.lock()
        .map_err(|e| format!("{}: {e}", lock_path.display()))?;
    let path = target.as_path();
    let mut doc: Value = match read_limited(path, "reference values", SMALL << 8) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", path.display()))?,
        Err(_) if !path.exists() => serde_json::from_str(cgx_policies::DEFAULT_REFERENCE_VALUES)
            .map_err(|e| e.to_string())?,
        Err(e) => return Err(e),
    };
    let shape = |what: &str| format!("{}: {what} is not a JSON object", path.display());
    let section = doc
        .as_object_mut()
        .ok_or_else(|| shape("the file"))?
        .entry(kind)
        .or_insert_with(|| json!({}))
        .as_object_mut()
        .ok_or_else(|| shape(kind))?;
    add(section).map_err(|e| format!("{}: {e}", path.display()))?;
    section
        .entry("images")
        .or_insert_with(|| json!({}))
        .as_object_mut()
        .ok_or_else(|| shape(&format!("{kind}.images")))?
        .insert(name.to_string(), image.clone());
    let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())? + "\n";
    replace_file(&target, text.as_bytes())
}

/// Add `value` to the list at `key` of `map` (created where absent) unless it is there.
pub(crate) fn add_to_list(
    map: &mut serde_json::Map<String, serde_json::Value>,
    key: &str,
    what: &str,
    value: serde_json::Value,
) -> Result<(), String> {
    let l = map
        .entry(key)
        .or_insert_with(|| json!([]))
        .as_array_mut()
        .ok_or_else(|| format!("{what} is not a list"))?;
    if !l.contains(&value) {
        l.push(value);
    }
    Ok(())
}

/// The image's name in the reference values: as given, or the firmware's file name.
fn image_name(given: Option<&str>, firmware: &Path) -> String {
    match given {
        Some(n) => n.to_string(),
        None => firmware
            .file_name()
            .map_or_else(|| "image".to_string(), |n| n.to_string_lossy().to_string()),
    }
}

/// The report's MEASUREMENT: from an evidence bundle (a folder) or a raw report file. Only
/// parsed: whether the report is genuine is `cgx verify`'s question.
fn report_of(path: &Path) -> Result<cgx_attestation::snp::report::AttestationReport, String> {
    let bytes = if path.is_dir() {
        match cgx_attestation::bundle::Bundle::load(path).map_err(|e| e.to_string())? {
            cgx_attestation::bundle::Bundle::Snp { report, .. } => report,
            other => {
                return Err(format!(
                    "{}: a {:?} bundle, not an SEV-SNP report",
                    path.display(),
                    other.kind()
                ));
            }
        }
    } else {
        read_limited(path, "report", SMALL)?
    };
    cgx_attestation::snp::report::AttestationReport::parse(&bytes)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Launches one change away from `base` (and vCPU count × CPU type pairs) whose digest is
/// `want`, described as what differs. The firmware's pages are hashed once.
fn likely_causes(
    ovmf: &Ovmf<'_>,
    base: &LaunchParams,
    want: &[u8; 48],
) -> Result<Vec<String>, String> {
    let seeded = LaunchParams {
        firmware_digest: Some(match base.firmware_digest {
            Some(d) => d,
            None => snp::firmware_digest(ovmf).map_err(|e| e.to_string())?,
        }),
        ..base.clone()
    };
    let sig_name = |sig: u32| {
        snp::cpu::CPU_TYPES
            .iter()
            .find(|(_, f, m, s)| snp::cpu_signature(*f, *m, *s) == sig)
            .map_or_else(|| format!("{sig:#010x}"), |t| t.0.to_string())
    };
    let mut signatures: Vec<u32> = snp::cpu::CPU_TYPES
        .iter()
        .map(|(_, f, m, s)| snp::cpu_signature(*f, *m, *s))
        .collect();
    signatures.dedup();
    let mut candidates: Vec<(String, LaunchParams)> = Vec::new();
    let with = |f: &dyn Fn(&mut LaunchParams)| {
        let mut p = seeded.clone();
        f(&mut p);
        p
    };
    for v in 1..=snp::MAX_VCPUS.min(256) {
        if v != base.vcpus {
            candidates.push((
                format!("{v} vCPUs, not {}", base.vcpus),
                with(&|p| p.vcpus = v),
            ));
        }
    }
    for &sig in &signatures {
        if base.vmm == Vmm::Qemu && sig != base.vcpu_signature {
            let what = format!(
                "vCPU type {}, not {}",
                sig_name(sig),
                sig_name(base.vcpu_signature)
            );
            candidates.push((what.clone(), with(&|p| p.vcpu_signature = sig)));
            for v in 1..=64 {
                if v != base.vcpus {
                    candidates.push((
                        format!("{what}, and {v} vCPUs, not {}", base.vcpus),
                        with(&|p| {
                            p.vcpu_signature = sig;
                            p.vcpus = v;
                        }),
                    ));
                }
            }
        }
    }
    for vmm in [Vmm::Ec2, Vmm::Gce] {
        if vmm != base.vmm {
            candidates.push((
                format!("VMM {vmm:?}, not {:?}", base.vmm),
                with(&|p| p.vmm = vmm),
            ));
        }
    }
    if base.vmm != Vmm::Qemu {
        // QEMU writes the CPU type's signature, which the EC2/GCE launch did not need.
        for &sig in &signatures {
            candidates.push((
                format!(
                    "VMM Qemu with vCPU type {}, not {:?}",
                    sig_name(sig),
                    base.vmm
                ),
                with(&|p| {
                    p.vmm = Vmm::Qemu;
                    p.vcpu_signature = sig;
                }),
            ));
        }
    }
    for bit in 0..16 {
        let f = base.guest_features ^ (1 << bit);
        candidates.push((
            format!("guest features {f:#x}, not {:#x}", base.guest_features),
            with(&|p| p.guest_features = f),
        ));
    }
    if base.kernel_hashes.is_some() {
        candidates.push((
            "no kernel hashes (the launch did not boot this kernel directly)".into(),
            with(&|p| p.kernel_hashes = None),
        ));
    }
    let mut found = Vec::new();
    for (what, p) in candidates {
        // A candidate the firmware cannot launch (no kernel-hashes section…) is no cause.
        if snp::launch_digest(ovmf, &p).is_ok_and(|d| &d == want) {
            found.push(what);
        }
    }
    Ok(found)
}

/// `cgx measure check REPORT --ovmf …`: exit 0 when the report's measurement is this launch's,
/// 1 (with both digests and the likely cause) when it is not.
pub fn check(report: &Path, launch: &LaunchArgs, json_out: bool) -> CliResult {
    let r = report_of(report)?;
    let firmware = read_limited(&launch.ovmf, "firmware", FIRMWARE)?;
    let ovmf = Ovmf::parse(&firmware).map_err(|e| format!("{}: {e}", launch.ovmf.display()))?;
    let params = launch.params()?;
    let expected = snp::launch_digest(&ovmf, &params).map_err(|e| e.to_string())?;
    let matches = expected == r.measurement;
    let causes = if matches {
        vec![]
    } else {
        likely_causes(&ovmf, &params, &r.measurement)?
    };
    let out = json!({
        "match": matches,
        "report_measurement": hex::encode(r.measurement),
        "expected_measurement": hex::encode(expected),
        "likely_causes": causes,
        "id_key_digest": hex::encode(r.id_key_digest),
        "author_key_digest": hex::encode(r.author_key_digest),
        "host_data": hex::encode(r.host_data),
        "note": "the report is parsed, not verified: cgx verify checks its signature and chain",
    });
    if json_out {
        print_json(&out)?;
    } else if matches {
        println!("match: {}", hex::encode(expected));
    } else {
        println!("MISMATCH");
        println!("  report:   {}", hex::encode(r.measurement));
        println!("  expected: {}", hex::encode(expected));
        if causes.is_empty() {
            println!(
                "  no launch one parameter away matches: another firmware, kernel, initrd or command line"
            );
        }
        for c in &causes {
            println!("  matches with: {c}");
        }
    }
    Ok(if matches {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Replace `path` with `bytes` whole: a fresh file beside it (this process's own name), synced,
/// given the old file's permissions, renamed over it; the fresh file is removed if any step fails.
fn replace_file(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        if let Ok(m) = std::fs::metadata(path) {
            f.set_permissions(m.permissions())?;
        }
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("{}: {e}", path.display())
    })
}
