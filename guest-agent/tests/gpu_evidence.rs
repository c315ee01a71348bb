#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The guest's GPU path (`cgx_guest_agent::gpu::Gpus`, what the binary runs over NVML) over a
//! double at the library boundary that answers with real recorded H100 evidence
//! (`../shared/vectors/nvidia`): the inventory the offer is built from, the nonce handed to the
//! driver, and evidence that NVIDIA's chain and the verifier accept as it comes out.

use std::path::{Path, PathBuf};

use cgx_attestation::bundle::Bundle;
use cgx_attestation::{Verifier, VerifierConfig};
use cgx_guest_agent::gpu::{GpuDriver, GpuError, Gpus};

fn vectors() -> Option<PathBuf> {
    let found = cgx_attestation::bundle::shared_vectors(Path::new(env!("CARGO_MANIFEST_DIR")));
    if found.is_none() && std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true but no vectors: set CGX_VECTORS or place ../shared/vectors");
    }
    found
}

/// One recorded GPU: it signs only the nonce it signed when recorded (as the hardware signs
/// the nonce it is given), and its chain comes as the driver hands it (PEM, or DER).
struct Recorded {
    report: Vec<u8>,
    chain: Vec<u8>,
    nonce: [u8; 32],
}

impl GpuDriver for Recorded {
    fn count(&self) -> Result<u32, GpuError> {
        Ok(1)
    }
    fn name(&self, _: u32) -> Result<String, GpuError> {
        Ok("NVIDIA H100 80GB HBM3".into())
    }
    fn memory_bytes(&self, _: u32) -> Result<u64, GpuError> {
        Ok(81_559 << 20)
    }
    fn attestation_report(&self, index: u32, nonce: [u8; 32]) -> Result<Vec<u8>, GpuError> {
        if nonce != self.nonce {
            return Err(GpuError::Call {
                index,
                call: "attestation report",
                detail: "recorded for another nonce".into(),
            });
        }
        Ok(self.report.clone())
    }
    fn certificate_chain(&self, _: u32) -> Result<Vec<u8>, GpuError> {
        Ok(self.chain.clone())
    }
    fn usage(&self, index: u32) -> Result<cgx_protocol::metering::GpuUsage, GpuError> {
        Err(GpuError::Call {
            index,
            call: "usage",
            detail: "no telemetry was recorded".into(),
        })
    }
}

fn pem_to_der(pem: &[u8]) -> Vec<u8> {
    use base64::Engine;
    let text = String::from_utf8_lossy(pem);
    let mut out = Vec::new();
    for block in text.split("-----END CERTIFICATE-----") {
        let b64: String = block
            .lines()
            .filter(|l| !l.starts_with("-----") && !l.trim().is_empty())
            .collect();
        if !b64.is_empty() {
            out.extend(
                base64::engine::general_purpose::STANDARD
                    .decode(b64.trim())
                    .unwrap(),
            );
        }
    }
    out
}

#[test]
fn recorded_h100_evidence_through_the_guests_gpu_path_verifies() {
    let Some(root) = vectors() else {
        eprintln!(
            "SKIPPED recorded_h100_evidence_through_the_guests_gpu_path_verifies: no vectors"
        );
        return;
    };
    let verifier = Verifier::new(VerifierConfig::default());
    for name in ["h100-nvtrust-sample", "h100-trustee-coco"] {
        let dir = root.join("nvidia").join(name);
        let expected: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
        let nonce: [u8; 32] = hex::decode(expected["claims"]["nonce"].as_str().unwrap())
            .unwrap()
            .try_into()
            .unwrap();
        let recorded = Bundle::load(&dir).unwrap();
        let Bundle::Nvidia {
            report, cert_chain, ..
        } = &recorded
        else {
            panic!("{name}: not NVIDIA evidence")
        };
        let at = expected["at"]
            .as_str()
            .map(|t| {
                time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
                    .unwrap()
            })
            .unwrap_or_else(time::OffsetDateTime::now_utc);
        // The driver's chain as PEM, and as DER certificates back to back.
        for chain in [cert_chain.clone(), pem_to_der(cert_chain)] {
            let gpus = Gpus::new(Box::new(Recorded {
                report: report.clone(),
                chain,
                nonce,
            }));
            let inventory = gpus.inventory().unwrap();
            assert_eq!(inventory.len(), 1);
            assert_eq!(
                (inventory[0].model.as_str(), inventory[0].memory_gib),
                ("H100", 80)
            );
            let (out_report, out_chain) = gpus
                .evidence(0, nonce)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let bundle = Bundle::Nvidia {
                report: out_report,
                cert_chain: out_chain,
                ocsp: vec![],
            };
            let claims = verifier.verify(&bundle.evidence(), at).unwrap();
            let cgx_attestation::KindClaims::Nvidia(gpu) = &claims.claims().detail else {
                panic!("{name}: not NVIDIA claims")
            };
            assert_eq!(gpu.nonce, hex::encode(nonce), "{name}");
            // Asked for another nonce, the GPU's answer is not this evidence.
            let e = gpus.evidence(0, [0; 32]).unwrap_err().to_string();
            assert!(e.contains("GPU 0: attestation report"), "{e}");
        }
    }
}
