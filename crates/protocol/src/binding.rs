//! The values composite evidence binds (DESIGN.md, "Attestation" → Binding): what a node puts
//! in its CPU report's REPORT_DATA and asks each GPU to sign, and what a verifier recomputes
//! (`cgx-attestation`'s `binding`). Here, where the guest may link them.
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

use aws_lc_rs::digest::{SHA256, SHA512, digest};

const CPU_LABEL: &[u8] = b"cgx/binding/v1";
const GPU_LABEL: &[u8] = b"cgx/binding/v1/gpu";
const GPUS_LABEL: &[u8] = b"cgx/binding/v1/gpus";

fn lp(out: &mut Vec<u8>, x: &[u8]) {
    // Evidence parts are far below 4 GiB (bodies are capped long before); a longer one would
    // not fit the field, so it is cut at the cap rather than wrapped.
    let len = u32::try_from(x.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(x);
}

/// The nonce GPU `index` must sign.
pub fn gpu_nonce(nonce: &[u8], node_pubkey: &[u8], index: u32) -> [u8; 32] {
    let mut m = GPU_LABEL.to_vec();
    lp(&mut m, nonce);
    lp(&mut m, node_pubkey);
    m.extend_from_slice(&index.to_be_bytes());
    let mut out = [0u8; 32];
    out.copy_from_slice(digest(&SHA256, &m).as_ref());
    out
}

/// Digest of the GPUs' evidence, in order: (SPDM report, certificate chain) per GPU.
pub fn gpu_evidence_digest(gpus: &[(&[u8], &[u8])]) -> [u8; 64] {
    let mut m = GPUS_LABEL.to_vec();
    let n = u32::try_from(gpus.len()).unwrap_or(u32::MAX);
    m.extend_from_slice(&n.to_be_bytes());
    for (report, chain) in gpus {
        lp(&mut m, report);
        lp(&mut m, chain);
    }
    let mut out = [0u8; 64];
    out.copy_from_slice(digest(&SHA512, &m).as_ref());
    out
}

/// The REPORT_DATA the CPU report must carry.
pub fn report_data(nonce: &[u8], node_pubkey: &[u8], gpu_digest: &[u8; 64]) -> [u8; 64] {
    let mut m = CPU_LABEL.to_vec();
    lp(&mut m, nonce);
    lp(&mut m, node_pubkey);
    lp(&mut m, gpu_digest);
    let mut out = [0u8; 64];
    out.copy_from_slice(digest(&SHA512, &m).as_ref());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The formulas in the module's doc, computed independently (Python's hashlib, from the
    /// doc's text): the values a guest and a verifier must agree on.
    #[test]
    fn values_match_the_documented_formulas() {
        let (nonce, key) = (b"broker-nonce".as_slice(), [1u8; 32]);
        assert_eq!(
            hex::encode(gpu_nonce(nonce, &key, 3)),
            "a426727b13ce0c056cbadab3525d7f5dd5271b616e483a5a7270068e4f70081d"
        );
        let gpus = gpu_evidence_digest(&[(b"r0", b"c0"), (b"r1", b"c1")]);
        assert_eq!(
            hex::encode(gpus),
            "3c188e03732ff77f83e9e7b4595fcbca8d0893c070737f029acc956a44391a9d\
             55ae73c7ddb20cf10755302f6072bc5416a66868221eb9c36d9a5485c40c871b"
        );
        assert_eq!(
            hex::encode(report_data(nonce, &key, &gpus)),
            "a6d4fe47de67ecfd94c01842db90d0b92f56a5d8ceabc46b6a1052f233baade4\
             ec0bdd239d8b5283dfeb5b63f9443db5ea7a1dc2b8654d6fa751e08317e5671c"
        );
    }
}
