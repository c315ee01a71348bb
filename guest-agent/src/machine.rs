//! The machine the guest runs on, as the broker's registration needs it: its CPU TEE's report
//! over chosen REPORT_DATA, each GPU's evidence over a chosen nonce, and what the GPUs are —
//! and the composition the binding prescribes (`cgx_protocol::binding`), here once for every
//! machine: each GPU signs its own nonce, and the CPU report signs the digest of every GPU's
//! evidence, the broker's nonce and the node's identity.

use cgx_protocol::binding;
use cgx_protocol::broker::{CpuEvidence, GpuEvidence};
use cgx_protocol::kbs::rcar::EvidenceSource;

/// What a GPU is, as the registration's offer states it (from the driver, not from flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// The product name as the marketplace names it (`H100`, `H200`).
    pub model: String,
    pub memory_gib: u32,
}

/// A confidential VM's hardware, as the guest sees it.
pub trait Machine: Send + Sync {
    /// The GPUs in the order their evidence is bound.
    fn gpus(&self) -> Result<Vec<GpuInfo>, String>;
    /// GPU `index`'s attestation report over `nonce` and its certificate chain (PEM).
    fn gpu_evidence(&self, index: u32, nonce: [u8; 32]) -> Result<(Vec<u8>, Vec<u8>), String>;
    /// The CPU TEE's report carrying `report_data`.
    fn cpu_evidence(&self, report_data: &[u8; 64]) -> Result<CpuEvidence, String>;
    /// The same hardware as the KBS's attester sees it (CoCo's evidence shapes).
    fn kbs_evidence(&self) -> &dyn EvidenceSource;
    /// GPU `index`'s usage and health now (NVML inside the VM; simulated values under
    /// `--sim`).
    fn gpu_usage(&self, index: u32) -> Result<cgx_protocol::metering::GpuUsage, String>;
    /// Whether the evidence is simulated (the broker's claims say so either way).
    fn simulated(&self) -> bool;
}

/// The composite evidence of a registration for the broker's `nonce` binding `identity`
/// (`cgx_protocol::broker::node_identity`).
pub fn registration_evidence(
    m: &dyn Machine,
    nonce: &[u8],
    identity: &[u8],
) -> Result<(CpuEvidence, Vec<GpuEvidence>), String> {
    let n = u32::try_from(m.gpus()?.len()).map_err(|_| "too many GPUs".to_string())?;
    let gpus = (0..n)
        .map(|i| m.gpu_evidence(i, binding::gpu_nonce(nonce, identity, i)))
        .collect::<Result<Vec<_>, _>>()?;
    let parts: Vec<(&[u8], &[u8])> = gpus
        .iter()
        .map(|(r, c)| (r.as_slice(), c.as_slice()))
        .collect();
    let report_data = binding::report_data(nonce, identity, &binding::gpu_evidence_digest(&parts));
    let cpu = m.cpu_evidence(&report_data)?;
    Ok((
        cpu,
        gpus.iter()
            .map(|(r, c)| GpuEvidence::new(r, c, &[]))
            .collect(),
    ))
}

/// A confidential VM on real hardware: the CPU report from configfs-tsm (SEV-SNP or TDX), the
/// GPUs' from NVML.
#[derive(Debug)]
pub struct TsmMachine {
    pub tsm: crate::evidence::ConfigfsTsm,
    /// `None`: no NVIDIA driver library (the machine offers no GPUs).
    pub gpus: Option<crate::gpu::Gpus>,
}

impl TsmMachine {
    /// configfs-tsm at its usual place, and NVML when the driver library loads (why not, if
    /// it does not).
    pub fn load() -> (TsmMachine, Option<String>) {
        let (gpus, why) = match crate::gpu::Nvml::load() {
            Ok(n) => (Some(crate::gpu::Gpus::new(Box::new(n))), None),
            Err(e) => (None, Some(e.to_string())),
        };
        (
            TsmMachine {
                tsm: crate::evidence::ConfigfsTsm::default(),
                gpus,
            },
            why,
        )
    }
}

impl Machine for TsmMachine {
    fn gpus(&self) -> Result<Vec<GpuInfo>, String> {
        match &self.gpus {
            Some(g) => g.inventory().map_err(|e| e.to_string()),
            None => Ok(Vec::new()),
        }
    }

    fn gpu_evidence(&self, index: u32, nonce: [u8; 32]) -> Result<(Vec<u8>, Vec<u8>), String> {
        match &self.gpus {
            Some(g) => g.evidence(index, nonce).map_err(|e| e.to_string()),
            None => Err(format!("no GPU {index}")),
        }
    }

    fn cpu_evidence(&self, report_data: &[u8; 64]) -> Result<CpuEvidence, String> {
        self.tsm
            .cpu_evidence(report_data)
            .map_err(|e| e.to_string())
    }

    fn kbs_evidence(&self) -> &dyn EvidenceSource {
        self
    }

    fn gpu_usage(&self, index: u32) -> Result<cgx_protocol::metering::GpuUsage, String> {
        match &self.gpus {
            Some(g) => g.usage(index).map_err(|e| e.to_string()),
            None => Err(format!("no GPU {index}")),
        }
    }

    fn simulated(&self) -> bool {
        false
    }
}

/// The KBS's attester: the CPU report from configfs-tsm, and each GPU's evidence over the
/// nonce CoCo's binding gives the session (`cgx_protocol::kbs::binding::nvidia_nonce`), in
/// the shape CoCo's NVIDIA attester sends.
impl EvidenceSource for TsmMachine {
    fn tee(&self) -> cgx_protocol::kbs_types::Tee {
        self.tsm.tee()
    }

    fn additional_evidence(
        &self,
        nonce: &str,
        key: &cgx_protocol::kbs_types::TeePubKey,
    ) -> Result<String, cgx_protocol::kbs::rcar::ClientError> {
        use base64::Engine;
        let Some(gpus) = &self.gpus else {
            return Ok(String::new());
        };
        let e =
            |e: crate::gpu::GpuError| cgx_protocol::kbs::rcar::ClientError::Evidence(e.to_string());
        let n = gpus.count().map_err(e)?;
        if n == 0 {
            return Ok(String::new());
        }
        let gpu_nonce = cgx_protocol::kbs::binding::nvidia_nonce(nonce, key);
        let list = (0..n)
            .map(|i| {
                let (report, chain) = gpus.evidence(i, gpu_nonce).map_err(e)?;
                Ok(serde_json::json!({
                    "arch": "HOPPER",
                    "uuid": format!("GPU-{i}"),
                    "evidence": hex::encode(report),
                    "certificate": base64::engine::general_purpose::STANDARD.encode(chain),
                }))
            })
            .collect::<Result<Vec<_>, cgx_protocol::kbs::rcar::ClientError>>()?;
        Ok(serde_json::json!({"nvidia": {"device_evidence_list": list}}).to_string())
    }

    fn primary_evidence(
        &self,
        report_data: &[u8; 64],
    ) -> Result<serde_json::Value, cgx_protocol::kbs::rcar::ClientError> {
        self.tsm.primary_evidence(report_data)
    }
}

/// A simulated machine (the simulator's AMD-SP and GPUs), loaded from the file its host's
/// launcher wrote (`cgx_kbs::sim::SimNode::to_json`), or made here.
#[cfg(feature = "sim")]
#[derive(Debug)]
pub struct SimMachine {
    pub node: cgx_kbs::sim::SimNode,
}

#[cfg(feature = "sim")]
impl Machine for SimMachine {
    fn gpus(&self) -> Result<Vec<GpuInfo>, String> {
        Ok(self
            .node
            .gpus
            .iter()
            .map(|_| GpuInfo {
                model: "H100".into(),
                memory_gib: 80,
            })
            .collect())
    }

    fn gpu_evidence(&self, index: u32, nonce: [u8; 32]) -> Result<(Vec<u8>, Vec<u8>), String> {
        let gpu = self
            .node
            .gpus
            .get(index as usize)
            .ok_or_else(|| format!("no GPU {index}"))?;
        let e = |e: cgx_attestation::Error| e.to_string();
        match gpu.bundle(nonce, 8).map_err(e)? {
            cgx_attestation::bundle::Bundle::Nvidia {
                report, cert_chain, ..
            } => Ok((report, cert_chain)),
            _ => Err("the simulator made no GPU evidence".into()),
        }
    }

    fn cpu_evidence(&self, report_data: &[u8; 64]) -> Result<CpuEvidence, String> {
        let options = cgx_attestation::sim::SnpReportOptions {
            report_data: *report_data,
            measurement: self.node.measurement,
            policy: self.node.policy,
            ..Default::default()
        };
        match self.node.amd.bundle(&options).map_err(|e| e.to_string())? {
            cgx_attestation::bundle::Bundle::Snp {
                report,
                signing_cert,
                cert_chain,
                ..
            } => Ok(CpuEvidence::snp_with_vcek(
                &report,
                &signing_cert,
                &cert_chain,
            )),
            _ => Err("the simulator made no SNP report".into()),
        }
    }

    fn kbs_evidence(&self) -> &dyn EvidenceSource {
        &self.node
    }

    /// Simulated telemetry: a busy H100 whose numbers move with the clock.
    fn gpu_usage(&self, index: u32) -> Result<cgx_protocol::metering::GpuUsage, String> {
        if index as usize >= self.node.gpus.len() {
            return Err(format!("no GPU {index}"));
        }
        let t = crate::daemon::unix_now().unsigned_abs();
        Ok(cgx_protocol::metering::GpuUsage {
            index,
            utilization_pct: 90 + (t % 10) as u8,
            memory_used_mib: 60_000 + (t % 7) * 1024,
            temperature_c: 55 + (t % 9) as i16,
            power_mw: 600_000 + (t % 50) as u32 * 1000,
            ecc_corrected: 0,
            ecc_uncorrected: 0,
            throttle_reasons: 0,
        })
    }

    fn simulated(&self) -> bool {
        true
    }
}
