//! Composite evidence: one CPU report and any number of GPU reports, bound to each other, to a
//! broker nonce and to the node's key (DESIGN.md, "Attestation" → Binding).
//!
//! ```text
//! gpu_nonce[i]        = SHA-256("cgx/binding/v1/gpu"  ‖ lp(nonce) ‖ lp(node_pubkey) ‖ u32be(i))
//! gpu_evidence_digest = SHA-512("cgx/binding/v1/gpus" ‖ u32be(n) ‖ lp(report_0) ‖ lp(chain_0) ‖ …)
//! report_data         = SHA-512("cgx/binding/v1"      ‖ lp(nonce) ‖ lp(node_pubkey) ‖ lp(gpu_evidence_digest))
//! ```
//! `lp(x)` is `u32be(len(x)) ‖ x`, so no two different inputs encode alike. Each GPU signs its own
//! nonce (index included: reordering GPUs breaks it); the CPU report signs the digest of every
//! GPU's evidence in order (swapping one breaks it), the nonce (freshness) and the node key (the
//! key that later signs metering records and receives keys).

use crate::claims::{Claims, KindClaims};
use crate::error::{Error, Result};
use crate::nvidia::NvidiaEvidence;
use crate::{Evidence, VerifiedClaims, Verifier};

// The values themselves are `cgx-protocol`'s: the guest computes them too, and may not link
// this crate.
pub use cgx_protocol::binding::{gpu_evidence_digest, gpu_nonce, report_data};

/// A CPU report and its GPUs' reports, with what the broker sent and what the node claims.
#[derive(Debug, Clone)]
pub struct CompositeEvidence<'a> {
    pub cpu: Evidence<'a>,
    /// GPUs in the order the node lists them.
    pub gpus: Vec<NvidiaEvidence<'a>>,
    /// The broker's nonce.
    pub nonce: &'a [u8],
    /// The node's public key (raw bytes, e.g. Ed25519 32 bytes).
    pub node_pubkey: &'a [u8],
}

/// Verified, bound composite evidence. Only [`verify_composite`] builds it.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifiedComposite {
    cpu: VerifiedClaims,
    gpus: Vec<VerifiedClaims>,
    nonce: Vec<u8>,
    node_pubkey: Vec<u8>,
}

impl VerifiedComposite {
    pub fn cpu(&self) -> &Claims {
        self.cpu.claims()
    }
    pub fn gpus(&self) -> impl Iterator<Item = &Claims> {
        self.gpus.iter().map(VerifiedClaims::claims)
    }
    pub fn nonce(&self) -> &[u8] {
        &self.nonce
    }
    pub fn node_pubkey(&self) -> &[u8] {
        &self.node_pubkey
    }

    /// The pieces as named EAR parts: [`CPU_PART`](crate::results::CPU_PART), then `gpu0`, `gpu1`, …
    pub fn into_parts(self) -> Vec<(String, VerifiedClaims)> {
        let mut parts = Vec::with_capacity(1 + self.gpus.len());
        parts.push((crate::results::CPU_PART.to_string(), self.cpu));
        parts.extend(
            self.gpus
                .into_iter()
                .enumerate()
                .map(|(i, c)| (crate::results::gpu_part(i), c)),
        );
        parts
    }
}

/// Verify every piece, then the binding between them. Any mismatch is
/// [`Error::BindingMismatch`](crate::Error) naming which link failed.
pub fn verify_composite(
    verifier: &Verifier,
    ev: &CompositeEvidence<'_>,
    now: time::OffsetDateTime,
) -> Result<VerifiedComposite> {
    if ev.nonce.is_empty() || ev.node_pubkey.is_empty() {
        return Err(Error::invalid(
            "binding",
            "nonce and node key must not be empty",
        ));
    }
    if matches!(ev.cpu, Evidence::Nvidia(_)) {
        return Err(Error::invalid(
            "binding",
            "the primary evidence must be a CPU report",
        ));
    }
    let mut gpus = Vec::with_capacity(ev.gpus.len());
    for (i, gpu) in ev.gpus.iter().enumerate() {
        let index = u32::try_from(i).map_err(|_| Error::invalid("binding", "too many GPUs"))?;
        let expected = gpu_nonce(ev.nonce, ev.node_pubkey, index);
        let mut g = *gpu;
        g.expected_nonce = Some(&expected);
        let claims = verifier
            .verify(&Evidence::Nvidia(g), now)
            .map_err(|e| match e {
                Error::NonceMismatch { .. } => Error::BindingMismatch {
                    link: format!("GPU {i} nonce"),
                },
                other => other,
            })?;
        gpus.push(claims);
    }
    let parts: Vec<(&[u8], &[u8])> = ev.gpus.iter().map(|g| (g.report, g.cert_chain)).collect();
    let expected = report_data(ev.nonce, ev.node_pubkey, &gpu_evidence_digest(&parts));
    let cpu = verifier.verify(&ev.cpu, now)?;
    let actual = match &cpu.claims().detail {
        KindClaims::Snp(s) => s.report_data.clone(),
        KindClaims::Tdx(t) => t.report_data.clone(),
        KindClaims::Sample(s) => s.report_data.clone(),
        KindClaims::Nvidia(_) => String::new(),
    };
    if actual != hex::encode(expected) {
        return Err(Error::BindingMismatch {
            link: "CPU report_data (nonce, node key or GPU evidence)".into(),
        });
    }
    Ok(VerifiedComposite {
        cpu,
        gpus,
        nonce: ev.nonce.to_vec(),
        node_pubkey: ev.node_pubkey.to_vec(),
    })
}
