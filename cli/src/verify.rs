//! `cgx verify`: verify an evidence bundle, print claims or the refusal with its code.

use std::path::Path;
use std::process::ExitCode;

use cgx_attestation::bundle::Bundle;
use cgx_attestation::nvidia::rim::{self, RimOptions};
use cgx_attestation::{KindClaims, SimTrust, Verifier, VerifierConfig};
use serde_json::json;

use crate::output::{CliResult, hex_arg, parse_at, print_json, refused, summary};

/// Options of `cgx verify`.
#[derive(Debug)]
pub struct VerifyOptions<'a> {
    pub nonce: Option<&'a str>,
    pub collateral: Option<&'a Path>,
    pub rims: &'a [std::path::PathBuf],
    pub rim_ignore_signer_expiry: bool,
}

pub fn verify(e: &crate::EvidenceArgs, o: &VerifyOptions<'_>) -> CliResult {
    let (dir, at, json_out, trust_sim) = (e.bundle.as_path(), e.at.as_deref(), e.json, e.trust_sim);
    let (rim_files, rim_ignore_expiry) = (o.rims, o.rim_ignore_signer_expiry);
    let nonce = match o.nonce {
        Some(n) => Some(hex_arg::<32>(Some(n), "nonce", true)?),
        None => None,
    };
    let now = parse_at(at)?;
    let verifier = Verifier::new(VerifierConfig {
        sim: if trust_sim {
            SimTrust::Any
        } else {
            SimTrust::Refuse
        },
    });
    let bundle = match o.collateral {
        Some(store) => {
            // Verification reads a prepared store and never goes online (`cgx collateral fetch`
            // is the online step).
            let store = cgx_attestation::collateral::CollateralStore::open(store)
                .map_err(|e| e.to_string())?;
            let src = cgx_attestation::collateral::fetch::CollateralSource::offline(store);
            Bundle::load_with(dir, &src, now.unix_timestamp())
        }
        None => Bundle::load(dir),
    };
    let kind = bundle.as_ref().ok().map(|b| b.kind().as_str());
    let result = bundle.and_then(|b| {
        let mut ev = b.evidence();
        if let Some(n) = &nonce {
            match &mut ev {
                cgx_attestation::Evidence::Nvidia(gpu) => gpu.expected_nonce = Some(n.as_slice()),
                _ => {
                    return Err(cgx_attestation::Error::InvalidField {
                        field: "--nonce",
                        detail:
                            "applies to NVIDIA evidence; CPU evidence binds nonces in report_data"
                                .into(),
                    });
                }
            }
        }
        verifier.verify(&ev, now)
    });
    match result {
        Ok(verified) => {
            let claims = verified.claims();
            let mut comparison = None;
            if !rim_files.is_empty() {
                let KindClaims::Nvidia(gpu) = &claims.detail else {
                    return Err("--rim applies to NVIDIA evidence only".into());
                };
                let opts = RimOptions {
                    ignore_signer_expiry: rim_ignore_expiry,
                };
                let mut rims = Vec::new();
                for f in rim_files {
                    let xml = std::fs::read(f).map_err(|e| format!("{}: {e}", f.display()))?;
                    match rim::verify(
                        &xml,
                        &cgx_attestation::crypto::DEFAULT_PROVIDER,
                        now.unix_timestamp(),
                        opts,
                    ) {
                        Ok(r) => rims.push(r),
                        Err(e) => return refused(json_out, Some("nvidia"), &e),
                    }
                }
                let refs: Vec<_> = rims.iter().collect();
                comparison =
                    Some(rim::compare(&gpu.measurements, &refs).map_err(|e| e.to_string())?);
            }
            if json_out {
                let mut out = json!({"valid": true, "kind": claims.kind, "claims": claims});
                if let Some(c) = &comparison {
                    out["rim_comparison"] = json!(c);
                }
                print_json(&out)?;
            } else {
                println!("VALID {}", summary(claims));
                if let Some(c) = &comparison {
                    println!(
                        "  RIMs: {} match, {} differ, {} without reference",
                        c.matched.len(),
                        c.mismatched.len(),
                        c.no_reference.len()
                    );
                    for m in &c.mismatched {
                        println!(
                            "    index {} measured {} expected {} ({})",
                            m.index,
                            m.measured.as_deref().unwrap_or("(absent)"),
                            m.expected.join(" | "),
                            m.rim
                        );
                    }
                }
            }
            let rims_ok = comparison.as_ref().is_none_or(|c| c.all_match());
            Ok(if rims_ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Err(e) => refused(json_out, kind, &e),
    }
}
