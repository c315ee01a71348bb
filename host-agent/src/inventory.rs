//! What the provider's machine has: its GPUs and their confidential-computing mode (NVML), the
//! CPU's SEV-SNP or TDX support (the kernel's interfaces and the CPU flags), memory and disk.
//! Each answer says where it came from, and a source that cannot be read says why.
//!
//! The reading is split from the judging: [`Sources`] holds the raw texts (from this machine,
//! or a test's), [`Inventory::from_sources`] judges them.

use serde::Serialize;

/// A GPU as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gpu {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub memory_gib: u32,
    /// Confidential-computing mode on (the system's CC setting, per NVML).
    pub cc_enabled: Option<bool>,
    /// CC developer mode (the GPU's debug features on: not for tenants' secrets).
    pub cc_dev_mode: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pci_bus_id: Option<String>,
}

/// One CPU TEE's support on this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TeeSupport {
    /// The kernel (KVM) enables it for guests.
    pub enabled: bool,
    /// Why, in words: which interfaces say so or not.
    pub evidence: Vec<String>,
}

/// The host's inventory (`cgx-host-agent inventory --json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Inventory {
    pub cpu_model: String,
    pub cpus: u32,
    pub sev_snp: TeeSupport,
    pub tdx: TeeSupport,
    pub memory_bytes: u64,
    pub disk: Option<Disk>,
    pub gpus: Vec<Gpu>,
    /// Why there are no GPUs, when NVML could not be used.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Disk {
    pub path: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
}

/// The raw texts the inventory is judged from.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    pub cpuinfo: String,
    pub meminfo: String,
    /// `/sys/module/kvm_amd/parameters/sev_snp`, if present.
    pub kvm_amd_sev_snp: Option<String>,
    /// `/sys/module/kvm_intel/parameters/tdx`, if present.
    pub kvm_intel_tdx: Option<String>,
    /// `/dev/sev` exists (the AMD-SP's firmware interface).
    pub dev_sev: bool,
    /// `df -Pk` of the image folder: the line for it.
    pub df: Option<String>,
    pub disk_path: String,
}

impl Sources {
    /// This machine's.
    pub fn read(disk_path: &str) -> Sources {
        let text = |p: &str| std::fs::read_to_string(p).ok();
        let df = std::process::Command::new("df")
            .args(["-Pk", "--", disk_path])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .nth(1)
                    .map(str::to_string)
            });
        Sources {
            cpuinfo: text("/proc/cpuinfo").unwrap_or_default(),
            meminfo: text("/proc/meminfo").unwrap_or_default(),
            kvm_amd_sev_snp: text("/sys/module/kvm_amd/parameters/sev_snp"),
            kvm_intel_tdx: text("/sys/module/kvm_intel/parameters/tdx"),
            dev_sev: std::path::Path::new("/dev/sev").exists(),
            df,
            disk_path: disk_path.to_string(),
        }
    }
}

fn yes(v: &Option<String>) -> Option<bool> {
    v.as_deref().map(|t| matches!(t.trim(), "Y" | "y" | "1"))
}

impl Inventory {
    /// Judge `s`, with `gpus` as NVML gave them (or why not).
    pub fn from_sources(s: &Sources, gpus: Result<Vec<Gpu>, String>) -> Inventory {
        let field = |name: &str| {
            s.cpuinfo
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
                .unwrap_or_default()
        };
        let flags = field("flags");
        let has_flag = |f: &str| flags.split_whitespace().any(|x| x == f);
        let cpus = s
            .cpuinfo
            .lines()
            .filter(|l| l.starts_with("processor"))
            .count() as u32;
        let mut snp = Vec::new();
        snp.push(format!(
            "cpu flag sev_snp: {}",
            if has_flag("sev_snp") {
                "present"
            } else {
                "absent"
            }
        ));
        snp.push(match yes(&s.kvm_amd_sev_snp) {
            Some(v) => format!("kvm_amd sev_snp={}", if v { "Y" } else { "N" }),
            None => "kvm_amd: not loaded".into(),
        });
        snp.push(format!(
            "/dev/sev: {}",
            if s.dev_sev { "present" } else { "absent" }
        ));
        let mut tdx = Vec::new();
        tdx.push(format!(
            "cpu flag tdx_host_platform: {}",
            if has_flag("tdx_host_platform") {
                "present"
            } else {
                "absent"
            }
        ));
        tdx.push(match yes(&s.kvm_intel_tdx) {
            Some(v) => format!("kvm_intel tdx={}", if v { "Y" } else { "N" }),
            None => "kvm_intel tdx: no such parameter (kernel without TDX host support, or kvm_intel not loaded)".into(),
        });
        let kib = |name: &str| {
            s.meminfo
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let disk = s.df.as_deref().and_then(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let total = f.get(1)?.parse::<u64>().ok()?;
            let free = f.get(3)?.parse::<u64>().ok()?;
            Some(Disk {
                path: s.disk_path.clone(),
                total_bytes: total.saturating_mul(1024),
                free_bytes: free.saturating_mul(1024),
            })
        });
        let (gpus, gpu_error) = match gpus {
            Ok(g) => (g, None),
            Err(e) => (Vec::new(), Some(e)),
        };
        Inventory {
            cpu_model: field("model name"),
            cpus,
            sev_snp: TeeSupport {
                enabled: yes(&s.kvm_amd_sev_snp) == Some(true) && s.dev_sev,
                evidence: snp,
            },
            tdx: TeeSupport {
                enabled: yes(&s.kvm_intel_tdx) == Some(true),
                evidence: tdx,
            },
            memory_bytes: kib("MemTotal:").saturating_mul(1024),
            disk,
            gpus,
            gpu_error,
        }
    }
}

/// The GPUs NVML reports, or why it cannot.
pub fn nvml_gpus() -> Result<Vec<Gpu>, String> {
    let nvml = nvml_wrapper::Nvml::init()
        .map_err(|e| format!("NVIDIA's driver library could not be used: {e}"))?;
    let n = nvml.device_count().map_err(|e| e.to_string())?;
    (0..n)
        .map(|index| {
            let d = nvml
                .device_by_index(index)
                .map_err(|e| format!("GPU {index}: {e}"))?;
            let memory = d
                .memory_info()
                .map_err(|e| format!("GPU {index}: memory: {e}"))?;
            Ok(Gpu {
                index,
                name: d.name().map_err(|e| format!("GPU {index}: name: {e}"))?,
                uuid: d.uuid().map_err(|e| format!("GPU {index}: uuid: {e}"))?,
                memory_gib: u32::try_from(memory.total.saturating_add(1 << 29) >> 30)
                    .unwrap_or(u32::MAX),
                cc_enabled: d.is_cc_enabled().ok(),
                cc_dev_mode: d.is_cc_dev_mode_enabled().ok(),
                pci_bus_id: d.pci_info().ok().map(|p| p.bus_id),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn an_snp_host_and_a_plain_one() {
        let snp = Sources {
            cpuinfo: "processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\nflags\t\t: fpu sev sev_es sev_snp\nprocessor\t: 1\n".into(),
            meminfo: "MemTotal:       1056000000 kB\nMemFree: 1 kB\n".into(),
            kvm_amd_sev_snp: Some("Y\n".into()),
            kvm_intel_tdx: None,
            dev_sev: true,
            df: Some("/dev/nvme0n1p1 1000 10 990 1% /".into()),
            disk_path: "/".into(),
        };
        let inv = Inventory::from_sources(&snp, Err("no driver".into()));
        assert!(inv.sev_snp.enabled && !inv.tdx.enabled);
        assert_eq!(inv.cpus, 2);
        assert_eq!(inv.cpu_model, "AMD EPYC 9654 96-Core Processor");
        assert_eq!(inv.memory_bytes, 1_056_000_000 * 1024);
        assert_eq!(inv.disk.as_ref().unwrap().free_bytes, 990 * 1024);
        assert_eq!(inv.gpu_error.as_deref(), Some("no driver"));
        // The flag without the kernel's parameter is not support.
        let half = Sources {
            kvm_amd_sev_snp: Some("N".into()),
            ..snp.clone()
        };
        let inv = Inventory::from_sources(&half, Ok(vec![]));
        assert!(!inv.sev_snp.enabled);
        assert!(
            inv.sev_snp
                .evidence
                .iter()
                .any(|e| e == "kvm_amd sev_snp=N")
        );
        let json = serde_json::to_value(&inv).unwrap();
        assert!(json["gpus"].as_array().unwrap().is_empty() && json.get("gpu_error").is_none());
    }
}
