//! `cgx policy test`: the Rego tests.

use std::path::Path;
use std::process::ExitCode;

use crate::output::CliResult;

pub fn test(dir: &Path) -> CliResult {
    let results = cgx_policies::run_tests(dir).map_err(|e| e.to_string())?;
    let mut failed = 0;
    for r in &results {
        if r.passed {
            println!("PASS {}", r.name);
        } else {
            failed += 1;
            println!("FAIL {}: {}", r.name, r.detail.as_deref().unwrap_or(""));
        }
    }
    println!("{} passed, {} failed", results.len() - failed, failed);
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
