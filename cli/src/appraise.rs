//! `cgx appraise`: verify, appraise with a policy and print the signed result.

use std::path::Path;
use std::process::ExitCode;

use cgx_attestation::bundle::Bundle;
use cgx_attestation::{SimTrust, Verifier, VerifierConfig};
use serde_json::json;
use time::OffsetDateTime;

use crate::output::{CliResult, parse_at, print_json, read_text, refused, summary};

/// Options of `cgx appraise`.
#[derive(Debug)]
pub struct AppraiseOptions<'a> {
    pub policy: Option<&'a Path>,
    pub reference_values: Option<&'a Path>,
    pub signing_key: Option<&'a Path>,
    pub nonce: Option<&'a str>,
}

pub fn appraise(e: &crate::EvidenceArgs, o: &AppraiseOptions<'_>) -> CliResult {
    use cgx_attestation::results::{ResultSigner, Tier};
    use cgx_policies::{Appraiser, PolicyEngine};
    let dir = e.bundle.as_path();
    let now = parse_at(e.at.as_deref())?;
    let nonce = match o.nonce {
        Some(n) => Some(hex::decode(n).map_err(|e| format!("--nonce is not hex: {e}"))?),
        None => None,
    };
    let rego = match o.policy {
        Some(p) => read_text(p)?,
        None => cgx_policies::APPRAISAL_POLICY.to_string(),
    };
    let refs = match o.reference_values {
        Some(p) => read_text(p)?,
        None => cgx_policies::DEFAULT_REFERENCE_VALUES.to_string(),
    };
    let engine = PolicyEngine::new("cgx.appraisal", &rego, &refs).map_err(|e| e.to_string())?;
    let signer = match o.signing_key {
        Some(p) => {
            let der = std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?;
            ResultSigner::from_pkcs8(&der).map_err(|e| e.to_string())?
        }
        None => ResultSigner::generate().map_err(|e| e.to_string())?,
    };
    let policy_id = engine.id().to_string();
    let appraiser = Appraiser::new(
        Verifier::new(VerifierConfig {
            sim: if e.trust_sim {
                SimTrust::Any
            } else {
                SimTrust::Refuse
            },
        }),
        engine,
        signer,
    );
    let bundle = match Bundle::load(dir) {
        Ok(b) => b,
        Err(err) => return refused(e.json, None, &err),
    };
    let kind = Some(bundle.kind().as_str());
    let issued_at = OffsetDateTime::now_utc().unix_timestamp();
    let appraisal =
        match appraiser.appraise(&bundle.evidence(), now, issued_at, nonce.as_deref(), None) {
            Ok(a) => a,
            Err(err) => return refused(e.json, kind, &err),
        };
    let Some(a) = appraisal.first() else {
        return Err("the appraisal has no part".into());
    };
    // Decode what was signed, through the same verification a relying party does.
    let ear =
        cgx_attestation::results::verify(appraisal.token(), &appraiser.signer().jwk(), issued_at)
            .map_err(|e| e.to_string())?;
    let ear_json = serde_json::to_value(&ear).map_err(|e| e.to_string())?;
    if e.json {
        let out = json!({
            "status": a.outcome.status.as_str(),
            "trust_vector": a.outcome.trust_vector,
            "violations": a.outcome.violations,
            "ear": ear_json,
            "token": appraisal.token(),
            "jwks": appraiser.signer().jwks(),
        });
        print_json(&out)?;
    } else {
        println!(
            "{} {}",
            a.outcome.status.as_str().to_uppercase(),
            summary(&a.claims)
        );
        let tv: Vec<String> = a
            .outcome
            .trust_vector
            .iter()
            .filter(|(_, c)| **c != 0)
            .map(|(k, c)| format!("{k}={c}"))
            .collect();
        println!("  trust vector {}", tv.join(" "));
        for v in &a.outcome.violations {
            println!("  {}", v.describe());
        }
        println!("  policy       {policy_id}");
        println!(
            "  result       EAR, {}, kid {}, expires in {} s",
            appraiser.signer().alg(),
            appraiser.signer().kid(),
            appraiser.signer().ttl_secs
        );
    }
    Ok(ExitCode::from(match a.outcome.status {
        Tier::Affirming => 0,
        Tier::Warning | Tier::None => 3,
        Tier::Contraindicated => 4,
    }))
}
