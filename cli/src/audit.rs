//! `cgx audit fetch|verify`: the broker's transparency log copied to a directory and checked
//! there with nothing else of ours running — the checkpoint's signature under the log's key,
//! every leaf by its inclusion proof, and consistency with the last checkpoint this auditor
//! saw (kept in a state file). Prints by exception; exits 1 on any violation.

use std::path::Path;
use std::process::ExitCode;

use cgx_tlog::note::NoteKey;
use cgx_tlog::paths;
use cgx_tlog::verify::{Trust, verify_dir};

use crate::broker::Conn;
use crate::output::{CliResult, print_json};

/// Copy the broker's log (its newest checkpoint, every hash tile and entry bundle of that tree)
/// into `out`, checkpoint last: its size. Entry bundles need an auditor's key.
pub fn fetch_log(client: &cgx_broker::client::BrokerClient, out: &Path) -> Result<u64, String> {
    let note = client.log_file("checkpoint").map_err(|e| e.to_string())?;
    // The size only: the checkpoint is verified by `verify`, not here.
    let size: u64 = String::from_utf8_lossy(&note)
        .lines()
        .nth(1)
        .and_then(|l| l.parse().ok())
        .ok_or("the broker's checkpoint has no size line")?;
    if size > cgx_tlog::MAX_SIZE {
        return Err(format!(
            "the broker's checkpoint claims {size} leaves, more than the {} a log holds",
            cgx_tlog::MAX_SIZE
        ));
    }
    let put = |rel: &str, bytes: &[u8]| -> Result<(), String> {
        let p = out.join(rel);
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
        }
        std::fs::write(&p, bytes).map_err(|e| format!("{}: {e}", p.display()))
    };
    for t in cgx_tlog::tiles_of(size) {
        let p = paths::tile_path(&t);
        put(&p, &client.log_file(&p).map_err(|e| format!("{p}: {e}"))?)?;
        if t.level() == 0 {
            let b = paths::tile_path(&paths::bundle_tile(t.level_index(), t.width()));
            put(&b, &client.log_file(&b).map_err(|e| format!("{b}: {e}"))?)?;
        }
    }
    put("checkpoint", &note)?;
    Ok(size)
}

/// `cgx audit fetch --out DIR`.
pub fn fetch(conn: &Conn, out: &Path) -> CliResult {
    let client = conn.client()?;
    let size = fetch_log(&client, out)?;
    println!("fetched {size} leaves into {}", out.display());
    Ok(ExitCode::SUCCESS)
}

/// `cgx audit verify --log DIR --log-key VKEY [--state FILE] [--json]`.
pub fn verify(
    log: &Path,
    log_key: &str,
    witnesses: &[String],
    quorum: usize,
    state: Option<&Path>,
    json: bool,
) -> CliResult {
    let witnesses = witnesses
        .iter()
        .map(|w| NoteKey::parse(w).map_err(|e| format!("--witness: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    if quorum > witnesses.len() {
        return Err(format!(
            "--quorum {quorum}: only {} witnesses named",
            witnesses.len()
        ));
    }
    let trust = Trust {
        log: NoteKey::parse(log_key).map_err(|e| format!("--log-key: {e}"))?,
        witnesses,
        quorum,
    };
    let seen = match state {
        Some(p) if p.exists() => {
            Some(std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()))?)
        }
        _ => None,
    };
    match verify_dir(log, &trust, seen.as_deref()) {
        Ok(v) => {
            let seen_size = seen.as_deref().and_then(|s| {
                String::from_utf8_lossy(s)
                    .lines()
                    .nth(1)
                    .and_then(|l| l.parse::<u64>().ok())
            });
            if let Some(p) = state {
                // The checkpoint verified (the bytes read and checked, not the file again):
                // what the next run must extend.
                let tmp = p.with_extension("tmp");
                std::fs::write(&tmp, &v.note)
                    .and_then(|_| std::fs::rename(&tmp, p))
                    .map_err(|e| format!("{}: {e}", p.display()))?;
            }
            if json {
                print_json(&serde_json::json!({
                    "valid": true,
                    "origin": v.opened.checkpoint.origin(),
                    "size": v.size,
                    "root": v.root.to_string(),
                    "extends": seen_size,
                }))?;
            } else {
                println!(
                    "ok: log {} — {} leaves, root {}; every leaf included{}",
                    v.opened.checkpoint.origin(),
                    v.size,
                    v.root,
                    match seen_size {
                        Some(n) => format!("; extends the checkpoint of {n} leaves seen before"),
                        None => String::new(),
                    }
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            if json {
                print_json(&serde_json::json!({"valid": false, "error": e.to_string()}))?;
            } else {
                println!("VIOLATION: {e}");
            }
            Ok(ExitCode::from(1))
        }
    }
}

/// `cgx witness vkey --config FILE`: the witness's verifier key.
pub fn witness_vkey(config: &Path) -> CliResult {
    let cfg: cgx_service::witness::WitnessConfig =
        cgx_service::config::load_service(config, |_: &mut cgx_service::witness::WitnessConfig| {})
            .map_err(|e: cgx_service::ServiceError| e.to_string())?;
    let w = cgx_service::witness::Witness::open(&cfg).map_err(|e| e.to_string())?;
    println!("{}", w.vkey());
    Ok(ExitCode::SUCCESS)
}
