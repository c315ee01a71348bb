//! Guest-side evidence: Linux configfs-tsm on real SNP and TDX guests, in the shapes CoCo's
//! attesters send (`{"attestation_report", "cert_chain"}` for SNP, `{"quote"}` for TDX).

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use cgx_protocol::kbs::rcar::{ClientError, EvidenceSource, Result};
use cgx_protocol::kbs_types::{Tee, TeePubKey};
use serde_json::Value;

/// Evidence from Linux configfs-tsm (`/sys/kernel/config/tsm/report`): the kernel asks the SNP
/// or TDX firmware for a report over our 64 bytes. SNP's `auxblob` carries the certificate
/// table (VCEK, ASK, ARK) when the host provides it.
///
/// This is the real-hardware path; it cannot run without a confidential VM, so it is untested
/// here beyond its file handling.
#[derive(Debug, Clone)]
pub struct ConfigfsTsm {
    pub root: std::path::PathBuf,
}

impl Default for ConfigfsTsm {
    fn default() -> Self {
        ConfigfsTsm {
            root: "/sys/kernel/config/tsm/report".into(),
        }
    }
}

/// SNP certificate-table GUIDs (GHCB spec, extended guest request).
const GUID_VCEK: &str = "63da758d-e664-4564-adc5-f4b93be8accd";
const GUID_VLEK: &str = "a8074bc2-a25a-483e-aae6-39c045a0b8a1";
const GUID_ASK: &str = "4ab7b379-bbac-4fe4-a02f-05aef327c782";
const GUID_ARK: &str = "c0b406a4-a803-4952-9743-3fb6014cd0ae";

fn guid(b: &[u8]) -> String {
    // Mixed-endian GUID text form.
    format!(
        "{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{}",
        b[3],
        b[2],
        b[1],
        b[0],
        b[5],
        b[4],
        b[7],
        b[6],
        b[8],
        b[9],
        hex::encode(&b[10..16])
    )
}

/// Entries of an SNP certificate table: 24-byte `{guid, offset u32, length u32}` records ending
/// with an all-zero one; offsets are from the table start.
pub fn snp_cert_table(aux: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for rec in aux.chunks_exact(24) {
        if rec.iter().all(|&b| b == 0) {
            break;
        }
        let off = u32::from_le_bytes([rec[16], rec[17], rec[18], rec[19]]) as usize;
        let len = u32::from_le_bytes([rec[20], rec[21], rec[22], rec[23]]) as usize;
        if let Some(data) = aux.get(off..off.saturating_add(len)) {
            let kind = match guid(&rec[..16]).as_str() {
                GUID_VCEK => "VCEK",
                GUID_VLEK => "VLEK",
                GUID_ASK => "ASK",
                GUID_ARK => "ARK",
                _ => continue,
            };
            out.push((kind.to_string(), data.to_vec()));
        }
    }
    out
}

impl ConfigfsTsm {
    fn report(&self, report_data: &[u8; 64]) -> Result<(String, Vec<u8>, Vec<u8>)> {
        let io = |e: std::io::Error| ClientError::Evidence(format!("configfs-tsm: {e}"));
        let mut name = [0u8; 8];
        aws_lc_rs::rand::fill(&mut name).map_err(|_| ClientError::Evidence("random".into()))?;
        let dir = self.root.join(format!("cgx-{}", hex::encode(name)));
        std::fs::create_dir(&dir).map_err(io)?;
        let result = (|| {
            std::fs::write(dir.join("inblob"), report_data).map_err(io)?;
            let provider = std::fs::read_to_string(dir.join("provider")).map_err(io)?;
            let out = std::fs::read(dir.join("outblob")).map_err(io)?;
            let aux = std::fs::read(dir.join("auxblob")).unwrap_or_default();
            Ok((provider.trim().to_string(), out, aux))
        })();
        let _ = std::fs::remove_dir(&dir);
        result
    }
}

impl ConfigfsTsm {
    /// The CPU report over `report_data` as a broker registration carries it: SNP's report
    /// with the VCEK (or VLEK) and the ASK/ARK chain from the host's certificate table when it
    /// provides one (else the broker's collateral store supplies them); TDX's quote.
    pub fn cpu_evidence(
        &self,
        report_data: &[u8; 64],
    ) -> Result<cgx_protocol::broker::CpuEvidence> {
        use cgx_protocol::broker::{CpuEvidence, b64};
        let (provider, out, aux) = self.report(report_data)?;
        match provider.as_str() {
            "tdx_guest" => Ok(CpuEvidence::Tdx {
                quote: b64(&out),
                collateral: None,
            }),
            "sev_guest" => {
                let table = snp_cert_table(&aux);
                let pem = |kind: &str| {
                    table
                        .iter()
                        .find(|(k, _)| k == kind)
                        .map(|(_, d)| pem_certificate(d))
                };
                let leaf = table.iter().find(|(k, _)| k == "VCEK" || k == "VLEK");
                let chain = match (pem("ASK"), pem("ARK")) {
                    (Some(ask), Some(ark)) => Some(ask + &ark),
                    _ => None,
                };
                Ok(CpuEvidence::Snp {
                    report: b64(&out),
                    signing_cert: leaf.map(|(_, d)| b64(d)),
                    signing_key: leaf.map(|(k, _)| k.to_ascii_lowercase()),
                    cert_chain: chain,
                    crls: Vec::new(),
                })
            }
            other => Err(ClientError::Evidence(format!(
                "configfs-tsm provider '{other}' is not sev_guest or tdx_guest"
            ))),
        }
    }
}

/// A DER certificate as PEM.
pub(crate) fn pem_certificate(der: &[u8]) -> String {
    let b = STANDARD.encode(der);
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in b.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

impl EvidenceSource for ConfigfsTsm {
    fn tee(&self) -> Tee {
        if std::path::Path::new("/dev/tdx_guest").exists() {
            Tee::Tdx
        } else {
            Tee::Snp
        }
    }

    fn additional_evidence(&self, _nonce: &str, _key: &TeePubKey) -> Result<String> {
        Ok(String::new())
    }

    fn primary_evidence(&self, report_data: &[u8; 64]) -> Result<Value> {
        let (provider, out, aux) = self.report(report_data)?;
        match provider.as_str() {
            "tdx_guest" => Ok(serde_json::json!({"quote": STANDARD.encode(out)})),
            "sev_guest" => {
                let chain: Vec<Value> = snp_cert_table(&aux)
                    .into_iter()
                    .map(|(k, d)| serde_json::json!({"cert_type": k, "data": STANDARD.encode(d)}))
                    .collect();
                Ok(serde_json::json!({
                    "attestation_report": STANDARD.encode(out),
                    "cert_chain": chain,
                }))
            }
            other => Err(ClientError::Evidence(format!(
                "configfs-tsm provider '{other}' is not sev_guest or tdx_guest"
            ))),
        }
    }
}
