//! The broker's wire protocol: node registration on composite evidence, signed heartbeats,
//! jobs, nodes and leases as JSON messages, and the few computations both ends must agree on
//! (the node identity the evidence binds, a node's id, the heartbeat token). No I/O.
//!
//! ```text
//! node                                   broker
//!  │ POST /v1/nodes/nonce ───────────────► nonce (single use, expires)
//!  │ POST /v1/nodes  Registration ───────► verify + bind + appraise + inventory check
//!  │ ◄──────────────────────────────────── Registered {node_id, EAR, fresh_until}
//!  │ POST /v1/nodes/{id}/heartbeat  (EdDSA JWT under the node key, every 5 s)
//!  │ ◄──────────────────────────────────── HeartbeatAnswer {reattest, leases: [LeaseGrant]}
//! ```
//!
//! The identity the CPU report binds ([`node_identity`]) is the node's Ed25519 key *and* the
//! RFC 7638 thumbprint of the TEE key it later presents to the KBS: the broker attests both in
//! one piece of hardware evidence, and the lease it issues names that thumbprint, so the KBS
//! releases a job's keys only to the VM the broker attested (DESIGN.md, "Leases").

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use serde::{Deserialize, Serialize};

use crate::kbs_types::TeePubKey;
use crate::money::Micros;
use crate::records::{TeeKind, Tier};

/// The audience of a heartbeat token: a heartbeat is made for the broker, nothing else.
pub const HEARTBEAT_AUDIENCE: &str = crate::signed::Kind::Heartbeat.audience();

/// The audience of a lease token: made for the KBS's release, nothing else.
pub const LEASE_AUDIENCE: &str = crate::signed::Kind::Lease.audience();

/// The broker API's routes, as the server mounts them and clients call them: `{id}` is a path
/// segment ([`routes::with_id`] fills it).
pub mod routes {
    pub const NONCE: &str = "/v1/nodes/nonce";
    pub const NODES: &str = "/v1/nodes";
    pub const NODE: &str = "/v1/nodes/{id}";
    pub const HEARTBEAT: &str = "/v1/nodes/{id}/heartbeat";
    pub const REATTEST: &str = "/v1/nodes/{id}/reattest";
    pub const REPORTS: &str = "/v1/nodes/{id}/reports";
    pub const METERING: &str = "/v1/nodes/{id}/metering";
    pub const POW: &str = "/v1/nodes/{id}/pow/{challenge}";
    pub const POW_PROOF: &str = "/v1/nodes/{id}/pow/{challenge}/proof";
    pub const JOBS: &str = "/v1/jobs";
    pub const JOB: &str = "/v1/jobs/{id}";
    pub const CANCEL: &str = "/v1/jobs/{id}/cancel";
    pub const REFERENCE_VALUES: &str = "/v1/reference-values";
    pub const ADMIN_EVENTS: &str = "/v1/admin-events";
    pub const DEPOSITS: &str = "/v1/ledger/deposits";
    pub const ACCOUNTS: &str = "/v1/ledger/accounts";
    pub const STATEMENTS: &str = "/v1/statements";
    pub const QUOTES: &str = "/v1/quotes";
    pub const LOG_VERDICTS: &str = "/v1/log/verdicts";
    pub const OPENAPI: &str = "/openapi.json";
    // `/metrics` is every service's (`cgx_service::ops::METRICS_PATH`).
    pub const HEALTHZ: &str = "/healthz";

    /// `template` with its `{id}` segment set to `id`.
    pub fn with_id(template: &str, id: &str) -> String {
        template.replace("{id}", id)
    }
}

/// Label of [`node_identity`].
const IDENTITY_LABEL: &[u8] = b"cgx/node-identity/v1";

fn lp(out: &mut Vec<u8>, x: &[u8]) {
    out.extend_from_slice(&(x.len() as u32).to_be_bytes());
    out.extend_from_slice(x);
}

/// The bytes a node's composite evidence binds as its "node key"
/// (`cgx_attestation::binding`'s `node_pubkey`):
/// `"cgx/node-identity/v1" ‖ lp(ed25519 public key) ‖ lp(TEE key thumbprint)`. Evidence bound to
/// another Ed25519 key or another TEE key does not match.
pub fn node_identity(node_key: &[u8; 32], tee_thumbprint: &str) -> Vec<u8> {
    let mut m = IDENTITY_LABEL.to_vec();
    lp(&mut m, node_key);
    lp(&mut m, tee_thumbprint.as_bytes());
    m
}

/// What a node signs with its node key when it registers (proof that it holds the key its
/// evidence binds — evidence alone can bind anyone's public key):
/// `"cgx/node-registration/v1" ‖ lp(nonce) ‖ lp(operator) ‖ lp(TEE key thumbprint)`.
pub fn registration_message(nonce: &[u8], operator: &str, tee_thumbprint: &str) -> Vec<u8> {
    let mut m = b"cgx/node-registration/v1".to_vec();
    lp(&mut m, nonce);
    lp(&mut m, operator.as_bytes());
    lp(&mut m, tee_thumbprint.as_bytes());
    m
}

/// The registration proof: an Ed25519 signature (base64url) over [`registration_message`].
pub fn registration_proof(
    pkcs8: &[u8],
    nonce: &[u8],
    operator: &str,
    tee_thumbprint: &str,
) -> Result<String, String> {
    let kp = aws_lc_rs::signature::Ed25519KeyPair::from_pkcs8(pkcs8)
        .map_err(|_| "not an Ed25519 PKCS#8 key".to_string())?;
    Ok(b64(kp
        .sign(&registration_message(nonce, operator, tee_thumbprint))
        .as_ref()))
}

/// A node's id: `n` and the first 16 bytes of SHA-256 of its Ed25519 key, in hex. Stable across
/// re-attestation; a new key is a new node.
pub fn node_id(node_key: &[u8; 32]) -> String {
    let d = aws_lc_rs::digest::digest(&aws_lc_rs::digest::SHA256, node_key);
    format!("n{}", hex::encode(&d.as_ref()[..16]))
}

/// Bytes as unpadded base64url (how every binary field of these messages travels).
pub fn b64(bytes: &[u8]) -> String {
    B64.encode(bytes)
}

/// Bytes from base64url (padded or not) or standard base64.
pub fn unb64(text: &str) -> Option<Vec<u8>> {
    B64.decode(text.trim_end_matches('='))
        .ok()
        .or_else(|| base64::engine::general_purpose::STANDARD.decode(text).ok())
}

/// A heartbeat: a [`crate::records::Heartbeat`] record under the node key, living
/// [`crate::records::HEARTBEAT_TTL_SECS`]. `seq` only grows (replays are refused).
pub fn heartbeat_token(pkcs8: &[u8], node_id: &str, seq: u64, now: i64) -> Result<String, String> {
    let signer = crate::signed::Signer::from_pkcs8(pkcs8).map_err(|e| e.to_string())?;
    signer
        .sign(
            &crate::records::Heartbeat {
                sub: node_id.to_string(),
                seq,
            },
            now,
            now + crate::records::HEARTBEAT_TTL_SECS,
        )
        .map_err(|e| e.to_string())
}

/// A workload report: a [`crate::records::WorkloadReport`] under the node key, living
/// [`crate::records::WORKLOAD_REPORT_TTL_SECS`].
pub fn workload_report_token(
    pkcs8: &[u8],
    report: &crate::records::WorkloadReport,
    now: i64,
) -> Result<String, String> {
    let signer = crate::signed::Signer::from_pkcs8(pkcs8).map_err(|e| e.to_string())?;
    signer
        .sign(report, now, now + crate::records::WORKLOAD_REPORT_TTL_SECS)
        .map_err(|e| e.to_string())
}

/// `POST /v1/nodes/nonce` answer.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NonceResponse {
    /// 32 random bytes, base64url.
    pub nonce: String,
    /// Unix seconds after which the broker no longer accepts it.
    pub expires_at: i64,
}

/// The CPU report of a registration, as the node's TEE produced it; collateral the node does
/// not send comes from the broker's collateral store.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum CpuEvidence {
    Snp {
        /// The 1184-byte ATTESTATION_REPORT, base64url.
        report: String,
        /// The VCEK or VLEK certificate (DER, base64url), if the node has it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signing_cert: Option<String>,
        /// `vcek` or `vlek` (what `signing_cert` is).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signing_key: Option<String>,
        /// ASK/ASVK and ARK, PEM.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cert_chain: Option<String>,
        /// DER CRLs, base64url.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        crls: Vec<String>,
    },
    Tdx {
        /// The quote, base64url.
        quote: String,
        /// Intel collateral as JSON text (dcap-qvl's `QuoteCollateralV3`), if the node has it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        collateral: Option<String>,
    },
}

/// One GPU's SPDM evidence, in the order the CPU report's binding lists them.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct GpuEvidence {
    /// GET_MEASUREMENTS ‖ MEASUREMENTS, base64url.
    pub report: String,
    /// The device certificate chain, PEM.
    pub cert_chain: String,
    /// DER OCSP responses for the chain, base64url.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ocsp: Vec<String>,
}

/// What a node offers: checked against what its evidence proves.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Offer {
    /// GPU model, e.g. `H100` or `H200`; must be a model of the chip the GPUs' certificates name.
    pub gpu_model: String,
    /// GPUs offered: must equal the number of GPU reports.
    pub gpu_count: u32,
    /// Memory per GPU, GiB; at most the model's.
    pub gpu_memory_gib: u32,
    pub region: String,
    /// Price per GPU-hour, in micros (`crate::money`).
    pub price_per_gpu_hour_micros: Micros,
    /// The operator (provider) the node belongs to.
    pub operator: String,
}

/// `POST /v1/nodes` body.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registration {
    /// The nonce from `POST /v1/nodes/nonce`, base64url.
    pub nonce: String,
    /// The node's Ed25519 public key, base64url: it signs heartbeats and metering records.
    pub node_key: String,
    /// [`registration_proof`] under that key.
    pub proof: String,
    /// The TEE key the node will present to the KBS (a JWK as CoCo sends it).
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub tee_pubkey: TeePubKey,
    pub cpu: CpuEvidence,
    pub gpus: Vec<GpuEvidence>,
    pub offer: Offer,
}

impl CpuEvidence {
    /// SEV-SNP evidence as a node sends it: the report and its VCEK (DER) and chain (PEM, ASK
    /// then ARK) as the TEE's firmware or KDS gave them; no CRLs (the broker uses its own).
    pub fn snp_with_vcek(report: &[u8], vcek_der: &[u8], chain_pem: &[u8]) -> CpuEvidence {
        CpuEvidence::Snp {
            report: b64(report),
            signing_cert: Some(b64(vcek_der)),
            signing_key: Some("vcek".into()),
            cert_chain: Some(String::from_utf8_lossy(chain_pem).into_owned()),
            crls: Vec::new(),
        }
    }
}

impl GpuEvidence {
    /// One GPU's evidence: its SPDM transcript, its device chain (PEM) and any OCSP responses.
    pub fn new(report: &[u8], chain_pem: &[u8], ocsp: &[Vec<u8>]) -> GpuEvidence {
        GpuEvidence {
            report: b64(report),
            cert_chain: String::from_utf8_lossy(chain_pem).into_owned(),
            ocsp: ocsp.iter().map(|o| b64(o)).collect(),
        }
    }
}

/// Why a registration cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistrationError {
    #[error("the nonce is not base64url")]
    Nonce,
    #[error("the node key is not an Ed25519 PKCS#8 key")]
    NodeKey,
}

/// A node's registration (`POST /v1/nodes`), as the guest builds it: the broker's `nonce`
/// (base64url, as `POST /v1/nodes/nonce` gave it), the node key (Ed25519 PKCS#8) that proves
/// possession over the nonce, the operator and the TEE key, and the evidence — which must bind
/// [`node_identity`] of this node key and TEE key through [`crate::binding`] (the caller asks
/// its TEE and GPUs for it). One builder for the guest daemon and the dev network.
pub fn registration(
    nonce: &str,
    node_key_pkcs8: &[u8],
    tee_pubkey: TeePubKey,
    cpu: CpuEvidence,
    gpus: Vec<GpuEvidence>,
    offer: Offer,
) -> Result<Registration, RegistrationError> {
    use aws_lc_rs::signature::KeyPair;
    let raw = unb64(nonce).ok_or(RegistrationError::Nonce)?;
    let pair = aws_lc_rs::signature::Ed25519KeyPair::from_pkcs8(node_key_pkcs8)
        .map_err(|_| RegistrationError::NodeKey)?;
    let thumbprint = crate::kbs::jwe::thumbprint(&tee_pubkey);
    let proof = b64(pair
        .sign(&registration_message(&raw, &offer.operator, &thumbprint))
        .as_ref());
    Ok(Registration {
        nonce: nonce.to_string(),
        node_key: b64(pair.public_key().as_ref()),
        proof,
        tee_pubkey,
        cpu,
        gpus,
        offer,
    })
}

/// `POST /v1/nodes` answer.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Registered {
    pub node_id: String,
    /// The appraisal's status (`affirming`, `warning`, `contraindicated` or `none`).
    pub status: Tier,
    /// The signed EAR.
    pub ear: String,
    /// The policy's violations, readable.
    pub violations: Vec<String>,
    pub attested_at: i64,
    /// Placeable until then at the latest (re-attest before).
    pub fresh_until: i64,
    pub heartbeat_secs: u64,
}

/// A lease as the node sees it: the token it presents to the KBS, renewed through heartbeats.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct LeaseGrant {
    pub lease_id: String,
    pub job_id: String,
    pub gpus: Vec<u32>,
    pub resources: Vec<String>,
    /// The lease token (EdDSA JWT, audience `cgx-kbs`, naming the node's TEE key thumbprint).
    pub token: String,
    pub expires_at: i64,
    /// What the node runs for it: the lease record's own (signed with it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<Workload>,
    /// When the lease began and its metering window (seconds): the node reads both from the
    /// signed lease, never from here (0: not said).
    #[serde(default)]
    pub start: i64,
    #[serde(default)]
    pub window_secs: u32,
}

/// What a job runs on its node: a command in the node's image (an absolute path) and its
/// arguments, and the weights it reads, decrypted inside the VM through the job's lease. The
/// process gets the decrypted weights' path and the lease in its environment (`CGX_WEIGHTS`,
/// `CGX_LEASE_ID`, `CGX_JOB_ID`, `CGX_GPUS`, `CGX_LEASE`). A container image reference is a
/// later step.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
// No `deny_unknown_fields`: a workload travels inside lease records and heartbeat answers,
// which an older node or KBS must still read when a newer broker adds a field.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Workload {
    /// Absolute path of a program in the node's image.
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<WorkloadWeights>,
}

/// The weights a workload reads: the KBS resource holding their key (one of the job's
/// resources) and the age file's name in the node's encrypted weights store.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct WorkloadWeights {
    /// `repo/type/tag`.
    pub resource: String,
    /// A plain file name (no directory), e.g. `llama-70b.age`.
    pub file: String,
}

/// Why a workload is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorkloadError {
    #[error("workload command must be an absolute path of at most {max} bytes without NUL", max = Workload::MAX_ARG)]
    Command,
    #[error("workload args: at most {max_n}, each at most {max} bytes without NUL", max_n = Workload::MAX_ARGS, max = Workload::MAX_ARG)]
    Args,
    #[error(
        "workload weights: the file must be a plain name (letters, digits, '.', '_', '-'; not starting with '.'), at most 255 bytes"
    )]
    WeightsFile,
    #[error("workload weights: resource {0} is not one of the job's resources")]
    WeightsResource(String),
    #[error("the workload takes {0} bytes as JSON; at most {max}", max = Workload::MAX_JSON)]
    TooLarge(usize),
}

impl Workload {
    pub const MAX_ARGS: usize = 32;
    pub const MAX_ARG: usize = 1024;
    /// It travels in every lease token: kept small.
    pub const MAX_JSON: usize = 4096;

    /// The rules a broker applies at submission and a node again before it runs one:
    /// `resources` are the job's.
    pub fn check(&self, resources: &[String]) -> Result<(), WorkloadError> {
        let arg_ok = |a: &str| a.len() <= Self::MAX_ARG && !a.contains('\0');
        if !self.command.starts_with('/') || !arg_ok(&self.command) {
            return Err(WorkloadError::Command);
        }
        if self.args.len() > Self::MAX_ARGS || !self.args.iter().all(|a| arg_ok(a)) {
            return Err(WorkloadError::Args);
        }
        if let Some(w) = &self.weights {
            let f = &w.file;
            if f.is_empty()
                || f.len() > 255
                || f.starts_with('.')
                || !f
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
            {
                return Err(WorkloadError::WeightsFile);
            }
            if !resources.contains(&w.resource) {
                return Err(WorkloadError::WeightsResource(w.resource.clone()));
            }
        }
        let n = serde_json::to_vec(self).map_or(usize::MAX, |v| v.len());
        if n > Self::MAX_JSON {
            return Err(WorkloadError::TooLarge(n));
        }
        Ok(())
    }
}

/// `POST /v1/nodes/{id}/heartbeat` answer.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct HeartbeatAnswer {
    /// Re-attest now (the result lapses soon, or the broker asks early).
    pub reattest: bool,
    /// Why the node is not placeable, if it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unplaceable: Option<String>,
    /// The node's open leases with fresh tokens.
    pub leases: Vec<LeaseGrant>,
    /// Proof-of-work challenges the node has not answered yet (`cgx_pow`): commit to each by
    /// its deadline at `POST /v1/nodes/{id}/pow/{challenge}`, then send the proof the opening
    /// asks for to `…/proof`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub challenges: Vec<PowChallenge>,
}

/// A proof-of-work challenge for one GPU of one of the node's leases. Unsigned: the broker
/// verifies the answer against the challenge it stored, so a host that alters one only makes
/// its own node's proof fail.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PowChallenge {
    pub id: String,
    pub lease: String,
    /// The lease's metering window it falls in (its sequence number).
    pub window: u64,
    /// The GPU, as the lease names it.
    pub gpu: u32,
    /// The broker's nonce (hex, 32 bytes).
    pub nonce: String,
    pub n: u32,
    pub k: u32,
    /// The most the work may take on the GPU, as the agent times it (ms).
    pub gpu_deadline_ms: u64,
    /// When the commitment must have reached the broker (Unix ms).
    pub deadline_ms: i64,
}

/// `POST /v1/nodes/{id}/pow/{challenge}` body: the commitment — the receipt alone, naming
/// the root of the product's rows (its `proof_sha256` empty).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PowCommit {
    /// EdDSA JWS, typ `cgx-pow-receipt+jwt` ([`PowReceipt`]).
    pub receipt: String,
}

/// The broker's answer to a commitment: the opening, drawn now, which selects the cells the
/// proof must open; the proof is due by `deadline_ms` (Unix ms).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PowOpening {
    pub challenge: String,
    /// 32 bytes, hex.
    pub opening: String,
    pub deadline_ms: i64,
}

/// `POST /v1/nodes/{id}/pow/{challenge}/proof` body: the opened rows (`cgx_pow::wire`) and a
/// receipt naming their digest.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PowPost {
    /// EdDSA JWS, typ `cgx-pow-receipt+jwt` ([`PowReceipt`], its `proof_sha256` set).
    pub receipt: String,
    /// The proof's bytes (`cgx_pow::wire`), base64 (standard, padded).
    pub proof: String,
}

/// What the node signs: which challenge, the root it committed to, how long the work took on
/// the device, and — with the proof — the proof's digest.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PowReceipt {
    pub sub: String,
    pub challenge: String,
    /// The rows' Merkle root (hex).
    pub root: String,
    /// SHA-256 of the proof's bytes (hex); empty in the commitment.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub proof_sha256: String,
    /// The device time of the work up to the commitment, as the agent measured it (µs).
    pub gpu_us: u64,
    /// What computed it (`cpu (2 threads)`, `cuda: NVIDIA H100 80GB HBM3`).
    pub backend: String,
}

impl crate::signed::Record for PowReceipt {
    const KIND: crate::signed::Kind = crate::signed::Kind::PowReceipt;
}

/// The broker's answer to a proof: accepted for verification (the verdict comes later, in
/// `cgx node show`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PowAccepted {
    pub challenge: String,
    pub state: String,
}

/// `POST /v1/nodes/{id}/reports` body: a workload report under the node key.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ReportPost {
    /// EdDSA JWS, typ `cgx-workload-report+jwt`, under the node's attested key.
    pub report: String,
}

/// `POST /v1/nodes/{id}/metering` body: the next metering record of one of the node's leases,
/// under its node key.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct MeteringPost {
    /// EdDSA JWS, typ `cgx-metering+jwt` (`cgx_protocol::metering::MeteringRecord`).
    pub record: String,
}

/// `POST /v1/nodes/{id}/metering` answer: the record accepted as the chain's next link.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct MeteringAnswer {
    pub lease: String,
    pub seq: u64,
    /// The hash the next record of the lease carries as `prev`.
    pub hash: String,
}

/// `POST /v1/nodes/{id}/reports` answer: the job's state once the report is applied.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReportAnswer {
    pub job_id: String,
    pub state: JobState,
}

/// A job as a tenant submits it.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// The tenant the job is billed to; defaults to the token's only tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    pub gpu_model: String,
    pub gpu_count: u32,
    #[serde(default)]
    pub min_gpu_memory_gib: u32,
    /// TEE kinds allowed (`snp`, `tdx`); empty: any.
    #[serde(default)]
    pub tee: Vec<TeeKind>,
    /// Regions allowed, in order of preference; empty: any.
    #[serde(default)]
    pub regions: Vec<String>,
    /// The most the tenant pays per GPU-hour, in micros.
    pub max_price_per_gpu_hour_micros: Micros,
    pub duration_secs: u64,
    /// What the tenant escrows, in micros: at least `max price × GPUs × hours`.
    pub budget_micros: Micros,
    /// KBS resource paths the job's lease covers (`repo/type/tag`).
    #[serde(default)]
    pub resources: Vec<String>,
    /// Rego, package `placement`: `deny` is a set of readable reasons (empty: the node fits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement_policy: Option<String>,
    /// What the node runs; none: the node holds the lease for the tenant's own use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<Workload>,
    /// An offer from `POST /v1/quotes` to hold the job to: placed on that node at that
    /// price, or refused with the reason the offer no longer holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offer: Option<crate::ledger::ChosenOffer>,
}

impl JobSpec {
    /// A job spec as the broker stored it: today's form, or one stored before integer money
    /// (`max_price_per_gpu_hour`, `budget` as floats), read exactly as the broker of then read
    /// it ([`Micros::from_stored_float`]). The API takes today's form only.
    pub fn from_stored(text: &str) -> Result<JobSpec, String> {
        let mut v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if let Some(obj) = v.as_object_mut() {
            for (old, new) in crate::money::RETIRED_FLOAT_FIELDS {
                if let Some(f) = obj.remove(old) {
                    let m = f
                        .as_f64()
                        .and_then(Micros::from_stored_float)
                        .ok_or_else(|| format!("stored {old} {f} is not an amount"))?;
                    obj.insert(new.into(), serde_json::json!(m));
                }
            }
        }
        serde_json::from_value(v).map_err(|e| e.to_string())
    }
}

/// A job's state. On the wire and in storage, its lowercase name.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Pending,
    Placed,
    Running,
    Completed,
    Failed,
    Cancelled,
    /// Pending longer than the broker's `pending_ttl_secs`: never placed, never paid for.
    Expired,
}

impl JobState {
    pub const ALL: [JobState; 7] = [
        JobState::Pending,
        JobState::Placed,
        JobState::Running,
        JobState::Completed,
        JobState::Failed,
        JobState::Cancelled,
        JobState::Expired,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Placed => "placed",
            JobState::Running => "running",
            JobState::Completed => "completed",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
            JobState::Expired => "expired",
        }
    }

    pub fn parse(s: &str) -> Option<JobState> {
        JobState::ALL.into_iter().find(|j| j.as_str() == s)
    }

    /// States a job leaves no more.
    pub const fn is_final(self) -> bool {
        matches!(
            self,
            JobState::Completed | JobState::Failed | JobState::Cancelled | JobState::Expired
        )
    }
}

/// A state equals its wire name (`JobState::Pending == "pending"`).
impl PartialEq<&str> for JobState {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One state change of a job.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct JobEvent {
    pub at: i64,
    pub from: Option<JobState>,
    pub to: JobState,
    pub reason: String,
}

/// A job as the broker reports it.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct JobView {
    pub id: String,
    pub tenant: String,
    pub state: JobState,
    pub reason: String,
    pub spec: JobSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<u32>,
    pub created_at: i64,
    pub updated_at: i64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<JobEvent>,
    /// Metering records the broker accepted for the job's current lease (its windows
    /// metered so far; in a single job's view).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub metered_windows: u64,
}

fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}

/// One proof-of-work challenge of a node and its verdict (`cgx node show`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProofView {
    pub challenge: String,
    pub lease: String,
    pub gpu: u32,
    pub n: u32,
    /// `issued`, `answered`, `passed`, `failed` or `missed`.
    pub state: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    pub issued_ms: i64,
    /// The device time the node signed (µs), once answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_us: Option<i64>,
}

/// A node as the broker reports it (`cgx node ls|show`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NodeView {
    pub id: String,
    pub operator: String,
    pub region: String,
    pub tee: TeeKind,
    pub sim: bool,
    pub gpu_model: String,
    pub gpu_chip: String,
    pub gpu_count: u32,
    pub gpu_memory_gib: u32,
    pub free_gpus: u32,
    pub price_per_gpu_hour_micros: Micros,
    pub reputation: i64,
    /// The appraisal's status.
    pub status: Tier,
    pub placeable: bool,
    /// Why the node is not placeable (empty when it is).
    pub reason: String,
    pub violations: Vec<String>,
    pub attested_at: i64,
    pub fresh_until: i64,
    pub last_heartbeat: i64,
    /// An operator or auditor asked it to re-attest before its interval ends.
    #[serde(default)]
    pub reattest_asked: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub claims: Option<serde_json::Value>,
    /// Its latest proof-of-work challenges, newest first (in a single node's view).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub proofs: Vec<ProofView>,
}

/// `GET /v1/nodes` answer: the nodes the caller may see.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeList {
    pub nodes: Vec<NodeView>,
}

/// `GET /v1/jobs` answer: newest first, at most a thousand.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobList {
    pub jobs: Vec<JobView>,
}

/// An auditor's verdict on the log (`cgx audit verify --report`): what tree it checked and
/// what it found. Recorded as an `audit.verdict` leaf, so the next auditor sees it too.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LogVerdict {
    /// The checkpoint's origin, size (decimal) and root (base64) the verdict is on.
    pub origin: String,
    pub size: String,
    pub root: String,
    /// How many violations it found (0: the log held).
    pub violations: u64,
    /// What it checked beyond the log itself (`archive`, `reappraise`, `kbs-log`).
    #[serde(default)]
    pub checks: Vec<String>,
}

/// `POST /v1/log/verdicts` answer: the verdict is a leaf of the log (once integrated).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct VerdictRecorded {
    /// Committed as an `audit.verdict` event, which the log integrates on its next pass.
    pub recorded: bool,
}

/// `GET /v1/reference-values` answer: the values a replica appraises with.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReferenceValuesView {
    /// 0: the configuration file's; then each put's.
    pub version: i64,
    /// The document `cgx measure … --reference-values` writes.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub reference_values: serde_json::Value,
}

/// `POST /v1/reference-values` answer: what was put.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReferenceValuesPut {
    pub version: i64,
    /// The version these values replaced (`If-Match`).
    pub replaces: i64,
    /// SHA-256 (hex) of the values' canonical text.
    pub sha256: String,
    /// The appraisal policy's id with these values (`broker.appraisal@sha256:…`).
    pub policy_id: String,
}

/// `GET /v1/admin-events` answer: the audit trail's newest thousand events, oldest first.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditTrail {
    pub events: Vec<crate::audit::AuditEvent>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn identity_separates_its_inputs() {
        let a = node_identity(&[1; 32], "abc");
        assert_ne!(a, node_identity(&[2; 32], "abc"));
        assert_ne!(a, node_identity(&[1; 32], "abd"));
        assert!(a.starts_with(IDENTITY_LABEL));
        assert_eq!(node_id(&[1; 32]).len(), 33);
        assert_ne!(node_id(&[1; 32]), node_id(&[2; 32]));
    }

    #[test]
    fn messages_refuse_unknown_fields() {
        let bad = r#"{"kind":"tdx","quote":"AA","extra":1}"#;
        assert!(serde_json::from_str::<CpuEvidence>(bad).is_err());
        let ok = r#"{"kind":"tdx","quote":"AA"}"#;
        assert!(serde_json::from_str::<CpuEvidence>(ok).is_ok());
    }
}

#[cfg(test)]
mod money_tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const TODAY: &str = r#"{"gpu_model":"H100","gpu_count":2,"max_price_per_gpu_hour_micros":2500000,"duration_secs":3600,"budget_micros":5000000}"#;
    const STORED_BEFORE: &str = r#"{"gpu_model":"H100","gpu_count":2,"max_price_per_gpu_hour":2.5,"duration_secs":3600,"budget":5.0000004}"#;

    #[test]
    fn job_specs_carry_integer_micros_and_old_stored_ones_read_exactly() {
        let today: JobSpec = serde_json::from_str(TODAY).unwrap();
        assert_eq!(today.max_price_per_gpu_hour_micros, Micros(2_500_000));
        assert_eq!(JobSpec::from_stored(TODAY).unwrap(), today);
        // A spec a broker from before stored: its floats, rounded as that broker rounded.
        assert_eq!(JobSpec::from_stored(STORED_BEFORE).unwrap(), today);
        // The API takes today's form only: the float field is unknown, and says so.
        let e = serde_json::from_str::<JobSpec>(STORED_BEFORE)
            .unwrap_err()
            .to_string();
        let said = crate::money::retired_field_refusal(&e).unwrap();
        assert!(
            said.contains("send max_price_per_gpu_hour_micros"),
            "{said}"
        );
        // A float where an integer belongs is refused, not rounded.
        let e = serde_json::from_str::<JobSpec>(&TODAY.replace("5000000}", "5000000.5}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected u64"), "{e}");
        // A stored amount that was never valid stays an error.
        let bad = STORED_BEFORE.replace("5.0000004", "-1");
        assert!(
            JobSpec::from_stored(&bad)
                .unwrap_err()
                .contains("not an amount")
        );
    }
}

#[cfg(test)]
mod registration_tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use aws_lc_rs::signature::{ED25519, UnparsedPublicKey};

    fn offer() -> Offer {
        Offer {
            gpu_model: "H100".into(),
            gpu_count: 1,
            gpu_memory_gib: 80,
            region: "eu-west".into(),
            price_per_gpu_hour_micros: Micros(2_000_000),
            operator: "op1".into(),
        }
    }

    #[test]
    fn a_registration_proves_the_node_key_over_nonce_operator_and_tee_key() {
        let rng = aws_lc_rs::rand::SystemRandom::new();
        let pkcs8 = aws_lc_rs::signature::Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
        let tee = crate::kbs::jwe::TeeKey::generate_ec(crate::kbs::jwe::Curve::P256)
            .unwrap()
            .public()
            .unwrap();
        let nonce = b64(&[5; 32]);
        let cpu = CpuEvidence::snp_with_vcek(&[1; 1184], &[0x30, 1], b"-----BEGIN");
        let gpus = vec![GpuEvidence::new(&[2; 8], b"chain", &[vec![3]])];
        let reg = registration(
            &nonce,
            pkcs8.as_ref(),
            tee.clone(),
            cpu.clone(),
            gpus,
            offer(),
        )
        .unwrap();
        assert_eq!((reg.nonce.as_str(), &reg.cpu), (nonce.as_str(), &cpu));
        assert_eq!(reg.gpus[0].ocsp, vec![b64(&[3])]);
        // The broker's check: the node key signed (nonce, operator, TEE key thumbprint).
        let message = registration_message(&[5; 32], "op1", &crate::kbs::jwe::thumbprint(&tee));
        let key = UnparsedPublicKey::new(&ED25519, unb64(&reg.node_key).unwrap());
        assert!(key.verify(&message, &unb64(&reg.proof).unwrap()).is_ok());
        // Over another operator it does not verify.
        let other = registration_message(&[5; 32], "op2", &crate::kbs::jwe::thumbprint(&tee));
        assert!(key.verify(&other, &unb64(&reg.proof).unwrap()).is_err());
        // Refusals, before anything is signed.
        let bad = registration(
            "not base64!",
            pkcs8.as_ref(),
            tee.clone(),
            cpu.clone(),
            vec![],
            offer(),
        );
        assert_eq!(bad.unwrap_err(), RegistrationError::Nonce);
        let bad = registration(&nonce, b"not a key", tee, cpu, vec![], offer());
        assert_eq!(bad.unwrap_err(), RegistrationError::NodeKey);
    }
}
