//! Simulated evidence sources for the KBS client: an SNP guest (and optionally GPUs) whose
//! reports the cgx simulator signs, in the shapes CoCo's attesters send. For tests, `cgx bench
//! kbs` and `cgx-guest-agent` outside a confidential VM; a KBS accepts them only when it trusts
//! the simulator's roots.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use cgx_attestation::bundle::Bundle;
use cgx_attestation::sim::{SimAmd, SimGpu, SnpReportOptions};
use cgx_protocol::kbs_types::{Tee, TeePubKey};
use serde_json::{Value, json};

use cgx_protocol::kbs::rcar::{ClientError, EvidenceSource};

/// A simulated SNP guest with `gpus` simulated H100s.
#[derive(Debug)]
pub struct SimNode {
    pub amd: SimAmd,
    pub gpus: Vec<SimGpu>,
    /// Launch measurement the simulated guest reports.
    pub measurement: [u8; 48],
    /// The SNP guest policy it was launched with (tests set the debug bit, 1 << 19).
    pub policy: u64,
}

impl SimNode {
    /// The same node launched with `host_data` (the init-data digest a VMM puts there).
    pub fn with_host_data(&self, host_data: [u8; 32]) -> SimLaunch<'_> {
        SimLaunch {
            node: self,
            host_data,
        }
    }
}

/// A [`SimNode`] launched with HOST_DATA.
#[derive(Debug)]
pub struct SimLaunch<'a> {
    node: &'a SimNode,
    host_data: [u8; 32],
}

impl EvidenceSource for SimLaunch<'_> {
    fn tee(&self) -> Tee {
        Tee::Snp
    }

    fn additional_evidence(&self, nonce: &str, key: &TeePubKey) -> Result<String, ClientError> {
        self.node.additional_evidence(nonce, key)
    }

    fn primary_evidence(&self, report_data: &[u8; 64]) -> Result<Value, ClientError> {
        self.node.snp_evidence(report_data, self.host_data)
    }
}

impl SimNode {
    /// A new simulated Genoa guest (VCEK-signed, random chip id) with `gpus` H100s, reporting
    /// `measurement` as its launch digest; certificates valid from the day before `now`.
    pub fn generate(gpus: usize, measurement: [u8; 48], now: i64) -> Result<Self, ClientError> {
        use cgx_attestation::sim::default_tcb;
        use cgx_attestation::snp::{Product, SigningKey};
        let e = |e: cgx_attestation::Error| ClientError::Evidence(e.to_string());
        let mut chip = [0u8; 64];
        cgx_attestation::sim::fill_random(&mut chip).map_err(e)?;
        Ok(SimNode {
            amd: SimAmd::generate(
                Product::Genoa,
                SigningKey::Vcek,
                default_tcb(Product::Genoa),
                chip,
                now,
            )
            .map_err(e)?,
            gpus: (0..gpus)
                .map(|_| SimGpu::generate(now).map_err(e))
                .collect::<Result<_, _>>()?,
            measurement,
            policy: SnpReportOptions::default().policy,
        })
    }

    /// The pins a KBS must trust for this node's evidence.
    pub fn root_pins(&self) -> Vec<[u8; 32]> {
        let mut p = vec![self.amd.root_pin()];
        p.extend(self.gpus.iter().map(SimGpu::root_pin));
        p
    }
}

impl EvidenceSource for SimNode {
    fn tee(&self) -> Tee {
        Tee::Snp
    }

    fn additional_evidence(&self, nonce: &str, key: &TeePubKey) -> Result<String, ClientError> {
        if self.gpus.is_empty() {
            return Ok(String::new());
        }
        let gpu_nonce = cgx_protocol::kbs::binding::nvidia_nonce(nonce, key);
        let list = self
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let Bundle::Nvidia {
                    report, cert_chain, ..
                } = g
                    .bundle(gpu_nonce, 8)
                    .map_err(|e| ClientError::Evidence(e.to_string()))?
                else {
                    return Err(ClientError::Evidence("sim GPU bundle".into()));
                };
                Ok(json!({
                    "arch": "HOPPER",
                    "uuid": format!("GPU-sim-{i}"),
                    "evidence": hex::encode(report),
                    "certificate": STANDARD.encode(cert_chain),
                }))
            })
            .collect::<Result<Vec<_>, ClientError>>()?;
        Ok(json!({"nvidia": {"device_evidence_list": list}}).to_string())
    }

    fn primary_evidence(&self, report_data: &[u8; 64]) -> Result<Value, ClientError> {
        self.snp_evidence(report_data, [0; 32])
    }
}

impl SimNode {
    fn snp_evidence(
        &self,
        report_data: &[u8; 64],
        host_data: [u8; 32],
    ) -> Result<Value, ClientError> {
        let mut report = self.amd.report_body(&SnpReportOptions {
            report_data: *report_data,
            measurement: self.measurement,
            policy: self.policy,
            host_data,
            ..Default::default()
        });
        self.amd
            .sign_report(&mut report)
            .map_err(|e| ClientError::Evidence(e.to_string()))?;
        // The chain as CoCo's attester sends it: VCEK (or VLEK), ASK, ARK, each DER in base64.
        let leaf = match self.amd.signing_key {
            cgx_attestation::snp::SigningKey::Vcek => "VCEK",
            cgx_attestation::snp::SigningKey::Vlek => "VLEK",
        };
        let entries = [
            (leaf, &self.amd.leaf_der),
            ("ASK", &self.amd.ask_der),
            ("ARK", &self.amd.ark_der),
        ]
        .map(|(kind, der)| json!({"cert_type": kind, "data": STANDARD.encode(der)}));
        Ok(json!({
            "attestation_report": STANDARD.encode(report),
            "cert_chain": entries,
        }))
    }
}

impl SimNode {
    /// Publish this machine's revocation collateral where a broker or KBS looks it up, as AMD
    /// and NVIDIA publish a real machine's: its AMD CRL (revoking nothing, current for 30
    /// days) and each GPU chain's OCSP response (good), into the collateral store at `dir`.
    /// The broker requires both from its store for every chain and uses none a node sends.
    pub fn publish_collateral(&self, dir: &std::path::Path, now: i64) -> Result<(), ClientError> {
        let e = |e: cgx_attestation::Error| ClientError::Evidence(e.to_string());
        let mut store = cgx_attestation::collateral::CollateralStore::open(dir).map_err(e)?;
        let chain = self.amd.cert_chain_pem();
        let key = cgx_attestation::trust::amd_crl_key(chain.as_bytes(), false)
            .ok_or_else(|| ClientError::Evidence("a simulated AMD chain without a root".into()))?;
        let crl = self
            .amd
            .crl(&[], now - 86_400, now + 30 * 86_400)
            .map_err(e)?;
        store.put(&key.path(), &crl, "sim", now).map_err(e)?;
        for g in &self.gpus {
            let ids =
                cgx_attestation::nvidia::ocsp::chain_cert_ids(g.chain_pem.as_bytes()).map_err(e)?;
            for cert_id in ids {
                let key = cgx_attestation::collateral::CollateralKey::NvidiaOcsp { cert_id };
                store
                    .put(&key.path(), &g.good_ocsp().map_err(e)?, "sim", now)
                    .map_err(e)?;
            }
        }
        Ok(())
    }
}

/// A [`SimNode`] as a file: the simulated machine a host's launcher made (and published the
/// collateral of), for the guest agent it boots to load (`cgx-guest-agent run --sim-machine`).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SavedNode {
    amd: cgx_attestation::sim::SavedAmd,
    gpus: Vec<cgx_attestation::sim::SavedGpu>,
    measurement: String,
    policy: u64,
}

impl SimNode {
    /// This machine's keys, certificates and launch measurement, as JSON (secret: the file
    /// is the machine).
    pub fn to_json(&self) -> Result<Vec<u8>, ClientError> {
        let e = |e: cgx_attestation::Error| ClientError::Evidence(e.to_string());
        let saved = SavedNode {
            amd: self.amd.save().map_err(e)?,
            gpus: self
                .gpus
                .iter()
                .map(|g| g.save().map_err(e))
                .collect::<Result<_, _>>()?,
            measurement: hex::encode(self.measurement),
            policy: self.policy,
        };
        serde_json::to_vec(&saved).map_err(|e| ClientError::Evidence(e.to_string()))
    }

    /// The machine [`SimNode::to_json`] wrote.
    pub fn from_json(bytes: &[u8]) -> Result<SimNode, ClientError> {
        let bad = |why: String| ClientError::Evidence(format!("simulated machine: {why}"));
        let saved: SavedNode = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        let e = |e: cgx_attestation::Error| bad(e.to_string());
        Ok(SimNode {
            amd: SimAmd::load(&saved.amd).map_err(e)?,
            gpus: saved
                .gpus
                .iter()
                .map(|g| SimGpu::load(g).map_err(e))
                .collect::<Result<_, _>>()?,
            measurement: hex::decode(&saved.measurement)
                .ok()
                .and_then(|m| m.try_into().ok())
                .ok_or_else(|| bad("the measurement is not 48 bytes of hex".into()))?,
            policy: saved.policy,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A saved machine loads as the same machine: the same certificates, and its reports and
    /// GPU evidence verify under the roots the original's pins name.
    #[test]
    fn a_saved_machine_loads_as_the_same_machine() {
        let node = SimNode::generate(2, [7; 48], 1_700_000_000).unwrap();
        let again = SimNode::from_json(&node.to_json().unwrap()).unwrap();
        assert_eq!(again.root_pins(), node.root_pins());
        assert_eq!(again.amd.leaf_der, node.amd.leaf_der);
        assert_eq!(again.gpus[1].chain_pem, node.gpus[1].chain_pem);
        assert_eq!(again.measurement, [7; 48]);
        let key = cgx_protocol::kbs::jwe::TeeKey::generate_ec(cgx_protocol::kbs::jwe::Curve::P256)
            .unwrap();
        let ev = again.primary_evidence(&[1; 64]).unwrap();
        assert!(ev["attestation_report"].is_string());
        assert!(
            !again
                .additional_evidence("n", &key.public().unwrap())
                .unwrap()
                .is_empty()
        );
        let e = SimNode::from_json(b"{\"amd\":1}").unwrap_err().to_string();
        assert!(e.contains("simulated machine"), "{e}");
    }
}
