//! `cgx measure snp`: the launch digest an SEV-SNP launch of an image produces, computed from the
//! image (`cgx-measure`). Reads the files; the computation is sans-IO.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use cgx_measure::ovmf::Ovmf;
use cgx_measure::snp::{self, LaunchParams, SevHashes, Vmm};
use serde_json::json;

use crate::output::{CliResult, print_json};

/// The largest kernel or initrd read (a kernel is tens of MiB, an initrd at most a few hundred).
const MAX_BLOB: u64 = 1 << 30;

/// How the image is launched.
#[derive(clap::Args, Debug, Clone)]
pub struct SnpArgs {
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
    #[arg(long)]
    pub vcpu_model: Option<u32>,
    #[arg(long)]
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
    #[arg(long)]
    pub json: bool,
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    let len = std::fs::metadata(path)
        .map_err(|e| format!("{what} {}: {e}", path.display()))?
        .len();
    if len > MAX_BLOB {
        return Err(format!(
            "{what} {}: {len} bytes is more than the {} MiB read",
            path.display(),
            MAX_BLOB >> 20
        ));
    }
    std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))
}

fn int(s: &str, what: &str) -> Result<u64, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u64::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|_| format!("--{what} '{s}' is not a number (hex with 0x, or decimal)"))
}

impl SnpArgs {
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
        Ok(LaunchParams {
            vcpus: self.vcpus,
            vcpu_signature: self.vcpu_signature(vmm)?,
            vmm,
            guest_features: int(&self.guest_features, "guest-features")?,
            kernel_hashes,
            firmware_digest,
        })
    }
}

/// `cgx measure snp`: print the launch digest (hex; `--json` with what went into it).
pub fn snp(args: &SnpArgs) -> CliResult {
    let firmware = read(&args.ovmf, "firmware")?;
    let ovmf = Ovmf::parse(&firmware).map_err(|e| format!("{}: {e}", args.ovmf.display()))?;
    let params = args.params()?;
    let digest = snp::launch_digest(&ovmf, &params).map_err(|e| e.to_string())?;
    if args.json {
        print_json(&json!({
            "kind": "snp",
            "measurement": hex::encode(digest),
            "firmware": args.ovmf.display().to_string(),
            "vcpus": params.vcpus,
            "vcpu_signature": format!("{:#010x}", params.vcpu_signature),
            "vmm": args.vmm_type.to_ascii_lowercase(),
            "guest_features": format!("{:#x}", params.guest_features),
            "kernel_hashes": params.kernel_hashes.as_ref().map(|h| json!({
                "kernel_sha256": hex::encode(h.kernel),
                "initrd_sha256": hex::encode(h.initrd),
                "cmdline_sha256": hex::encode(h.cmdline),
            })),
        }))?;
    } else {
        println!("{}", hex::encode(digest));
    }
    Ok(ExitCode::SUCCESS)
}
