//! The auditor's re-appraisal (issue 33): a registration the log archived, re-verified against
//! the trust roots and re-appraised under a policy and reference values, at the time its leaf
//! records — the broker's own code path (`register.rs`), fed from the archive instead of a
//! request and the collateral store. Run by `cgx audit verify --reappraise` with nothing else of
//! ours.

use cgx_attestation::results::ResultSigner;
use cgx_attestation::{Verifier, VerifierConfig};
use cgx_policies::{Appraiser, PolicyEngine};
use cgx_protocol::broker::Registration;
use cgx_protocol::records::Tier;

/// What to re-appraise with: the appraisal policy and reference values (text, as the broker
/// reads them), and the simulator root pins trusted (none in production: vendor roots only).
#[derive(Debug, Clone)]
pub struct Reappraiser {
    appraiser: std::sync::Arc<Appraiser>,
}

impl Reappraiser {
    pub fn new(
        policy: Option<&str>,
        reference_values: Option<&str>,
        sim_roots: &[String],
    ) -> Result<Reappraiser, String> {
        let engine = PolicyEngine::new(
            "broker.appraisal",
            policy.unwrap_or(cgx_policies::APPRAISAL_POLICY),
            reference_values.unwrap_or(cgx_policies::DEFAULT_REFERENCE_VALUES),
        )
        .map_err(|e| format!("appraisal policy: {e}"))?;
        let signer = ResultSigner::generate().map_err(|e| format!("result key: {e}"))?;
        Ok(Reappraiser {
            appraiser: std::sync::Arc::new(Appraiser::new(
                Verifier::new(VerifierConfig {
                    sim: super::sim_trust(sim_roots).map_err(|e| e.to_string())?,
                }),
                engine,
                signer,
            )),
        })
    }

    /// Re-verify and re-appraise the archived `registration` (JSON) with the `collateral`
    /// (JSON) it was appraised on, at `at` (Unix seconds): its tier and violations, or why the
    /// evidence is refused now.
    pub fn reappraise(
        &self,
        registration: &[u8],
        collateral: &[u8],
        at: i64,
    ) -> Result<Reappraised, String> {
        let reg: Registration =
            serde_json::from_slice(registration).map_err(|e| format!("registration: {e}"))?;
        let c: cgx_protocol::archive::Collateral =
            serde_json::from_slice(collateral).map_err(|e| format!("collateral: {e}"))?;
        let d = super::register::decode_archived(&reg, &c).map_err(|e| e.to_string())?;
        super::register::check_proof(&reg, &d).map_err(|e| e.to_string())?;
        let when = time::OffsetDateTime::from_unix_timestamp(at).map_err(|e| e.to_string())?;
        let a = super::register::appraise(&self.appraiser, &d, when).map_err(|e| e.to_string())?;
        Ok(Reappraised {
            tier: a.status(),
            violations: a.violations(),
            node_id: cgx_protocol::broker::node_id(&d.node_key),
            node_key: reg.node_key.clone(),
            tee_thumbprint: d.tee_thumbprint.clone(),
            operator: reg.offer.operator.clone(),
        })
    }
}

/// What a re-appraisal found: the tier, and who the evidence is of (what the registration's
/// leaf must name).
#[derive(Debug, Clone)]
pub struct Reappraised {
    pub tier: Tier,
    pub violations: Vec<String>,
    pub node_id: String,
    pub node_key: String,
    pub tee_thumbprint: String,
    pub operator: String,
}
