//! `cgx collateral fetch|import|export|ls`: the vendor collateral store.

use std::path::Path;
use std::process::ExitCode;

use cgx_attestation::bundle::Bundle;
use serde_json::json;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::output::{CliResult, print_json};

fn store_dir(a: &crate::SourceArgs) -> Result<std::path::PathBuf, String> {
    if let Some(s) = &a.store {
        return Ok(s.clone());
    }
    if let Some(s) = std::env::var_os("CGX_COLLATERAL") {
        return Ok(s.into());
    }
    let home = std::env::var_os("HOME").ok_or("no --store, $CGX_COLLATERAL or $HOME")?;
    Ok(std::path::PathBuf::from(home).join(".cache/cgx/collateral"))
}

fn collateral_source(
    a: &crate::SourceArgs,
) -> Result<cgx_attestation::collateral::fetch::CollateralSource, String> {
    use cgx_attestation::collateral::CollateralStore;
    use cgx_attestation::collateral::fetch::{CollateralSource, Endpoints, FetchPolicy};
    let store = CollateralStore::open(&store_dir(a)?).map_err(|e| e.to_string())?;
    Ok(CollateralSource::new(
        store,
        Endpoints {
            amd_kds: a.kds.clone(),
            intel_pcs: a.pcs.clone(),
            intel_root_ca_crl: a.intel_root_ca_crl.clone(),
            nvidia_rim: a.rim_service.clone(),
            nvidia_ocsp: a.nvidia_ocsp.clone(),
        },
        FetchPolicy::default(),
    ))
}

pub fn fetch(
    a: &crate::SourceArgs,
    bundles: &[std::path::PathBuf],
    rim_ids: &[String],
) -> CliResult {
    use cgx_attestation::collateral::CollateralKey;
    if bundles.is_empty() && rim_ids.is_empty() {
        return Err("name bundles or --rim-id".into());
    }
    let src = collateral_source(a)?;
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let mut failed = 0;
    for b in bundles {
        match Bundle::load_with(b, &src, now) {
            Ok(Bundle::Nvidia { ocsp, .. }) if ocsp.is_empty() => {
                failed += 1;
                println!(
                    "FAIL {}: OCSP responses for the device chain could not be had",
                    b.display()
                );
            }
            Ok(bundle) => println!(
                "ok   {} ({} collateral in the store)",
                b.display(),
                bundle.kind().as_str()
            ),
            Err(e) => {
                failed += 1;
                println!("FAIL {}: {e}", b.display());
            }
        }
    }
    for id in rim_ids {
        match src.get(&CollateralKey::NvidiaRim { id: id.clone() }, now) {
            Ok(f) => println!("ok   RIM {id} ({:?})", f.origin),
            Err(e) => {
                failed += 1;
                println!("FAIL RIM {id}: {e}");
            }
        }
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

pub fn import(a: &crate::SourceArgs, paths: &[std::path::PathBuf]) -> CliResult {
    use cgx_attestation::collateral::{CollateralKey, CollateralStore};
    let mut store = CollateralStore::open(&store_dir(a)?).map_err(|e| e.to_string())?;
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let mut n = 0;
    for p in paths {
        let src = format!("import:{}", p.display());
        if p.join("index.json").is_file() {
            n += store.import(p, now).map_err(|e| e.to_string())?;
        } else if p.extension().is_some_and(|x| x == "swidtag" || x == "xml") {
            let xml = std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?;
            cgx_attestation::nvidia::c14n::parse(&xml)
                .map_err(|e| format!("{}: {e}", p.display()))?;
            let id = p
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            store
                .put(&CollateralKey::NvidiaRim { id }.path(), &xml, &src, now)
                .map_err(|e| e.to_string())?;
            n += 1;
        } else {
            let bundle = Bundle::load(p).map_err(|e| e.to_string())?;
            match bundle {
                Bundle::Snp {
                    report,
                    signing_cert,
                    signing_key,
                    cert_chain,
                    crls,
                } => {
                    use cgx_attestation::collateral::needed::{self, Role, SnpCarried};
                    let r = cgx_attestation::snp::AttestationReport::parse(&report)
                        .map_err(|e| e.to_string())?;
                    // Stored under the keys a reader without this bundle's files asks for:
                    // what `needed::snp` names for evidence that carries nothing but its report.
                    // A VLEK is not served by KDS, so no reader looks one up by key: its
                    // chain and CRLs are imported as for a VCEK's, under the VLEK paths.
                    let vlek = signing_key == cgx_attestation::snp::SigningKey::Vlek;
                    let carried = SnpCarried {
                        signing_cert: vlek,
                        chain: None,
                    };
                    let needs = needed::snp(&r, signing_key, carried)
                        .map_err(|e| format!("{}: {e}", p.display()))?;
                    let key = |role| needed::keys_of(&needs, role).next().cloned();
                    if let Some(vcek_key) = key(Role::SigningCert) {
                        if signing_cert.first() != Some(&0x30) {
                            return Err("import the VCEK as DER".into());
                        }
                        store
                            .put(&vcek_key.path(), &signing_cert, &src, now)
                            .map_err(|e| e.to_string())?;
                        n += 1;
                    }
                    if let Some(chain_key) = key(Role::Chain) {
                        store
                            .put(&chain_key.path(), &cert_chain, &src, now)
                            .map_err(|e| e.to_string())?;
                        n += 1;
                    }
                    // The CRL under the key a reader without the bundle asks for, and under the
                    // one a reader of evidence carrying this chain asks for (the chain's root:
                    // the same key for AMD's own chains, a simulator's own otherwise).
                    let by_root = cgx_attestation::trust::amd_crl_key(&cert_chain, vlek);
                    let mut crl_keys: Vec<_> = key(Role::Revocation).into_iter().collect();
                    crl_keys.extend(by_root.filter(|k| !crl_keys.contains(k)));
                    for crl_key in &crl_keys {
                        for crl in &crls {
                            store
                                .put(&crl_key.path(), crl, &src, now)
                                .map_err(|e| e.to_string())?;
                            n += 1;
                        }
                    }
                }
                _ => {
                    return Err(format!(
                        "{}: only SNP bundles, exported stores and RIM files import",
                        p.display()
                    ));
                }
            }
        }
    }
    println!("imported {n} items into {}", store_dir(a)?.display());
    Ok(ExitCode::SUCCESS)
}

pub fn export(a: &crate::SourceArgs, dir: &Path) -> CliResult {
    use cgx_attestation::collateral::CollateralStore;
    let store = CollateralStore::open(&store_dir(a)?).map_err(|e| e.to_string())?;
    let n = store
        .export(dir, OffsetDateTime::now_utc().unix_timestamp())
        .map_err(|e| e.to_string())?;
    println!("exported {n} items to {}", dir.display());
    Ok(ExitCode::SUCCESS)
}

pub fn ls(a: &crate::SourceArgs, json_out: bool) -> CliResult {
    use cgx_attestation::collateral::CollateralStore;
    let store = CollateralStore::open(&store_dir(a)?).map_err(|e| e.to_string())?;
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let rows: Vec<serde_json::Value> = store
        .list()
        .map(|(k, e)| {
            json!({"key": k, "freshness": format!("{:?}", e.freshness(now)).to_lowercase(),
            "not_after": e.not_after.map(crate_rfc3339), "source": e.source, "sha256": e.sha256})
        })
        .collect();
    if json_out {
        print_json(&rows)?;
    } else {
        for r in &rows {
            println!(
                "{:<12} {:<22} {}",
                r["freshness"].as_str().unwrap_or(""),
                r["not_after"].as_str().unwrap_or("-"),
                r["key"].as_str().unwrap_or("")
            );
        }
        println!("{} items", rows.len());
    }
    Ok(ExitCode::SUCCESS)
}

fn crate_rfc3339(ts: i64) -> String {
    OffsetDateTime::from_unix_timestamp(ts)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| ts.to_string())
}
