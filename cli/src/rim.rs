//! `cgx rim verify`: NVIDIA reference integrity manifests.

use std::process::ExitCode;

use cgx_attestation::nvidia::rim::{self, RimOptions};
use serde_json::json;

use crate::output::{CliResult, parse_at, print_json};

pub fn verify(
    files: &[std::path::PathBuf],
    at: Option<&str>,
    ignore: bool,
    json_out: bool,
) -> CliResult {
    if files.is_empty() {
        return Err("name at least one RIM file".into());
    }
    let now = parse_at(at)?.unix_timestamp();
    let opts = RimOptions {
        ignore_signer_expiry: ignore,
    };
    let mut all_ok = true;
    let mut results = Vec::new();
    for f in files {
        let xml = std::fs::read(f).map_err(|e| format!("{}: {e}", f.display()))?;
        let r = rim::verify(&xml, &cgx_attestation::crypto::DEFAULT_PROVIDER, now, opts);
        match &r {
            Ok(v) => {
                if !json_out {
                    println!(
                        "VALID   {} {} {} ({} golden measurements){}",
                        f.display(),
                        v.product,
                        v.version,
                        v.golden.len(),
                        if v.signer_expired {
                            " [signer expired, accepted]"
                        } else {
                            ""
                        }
                    );
                }
                results.push(json!({"file": f.display().to_string(), "valid": true, "rim": v}));
            }
            Err(e) => {
                all_ok = false;
                if !json_out {
                    println!("REFUSED {}: {e} ({})", f.display(), e.code());
                }
                results.push(json!({"file": f.display().to_string(), "valid": false,
                    "error": {"code": e.code(), "message": e.to_string()}}));
            }
        }
    }
    if json_out {
        print_json(&results)?;
    }
    Ok(if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
