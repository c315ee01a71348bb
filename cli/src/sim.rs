//! `cgx sim snp|nvidia`: simulated evidence bundles.

use std::path::Path;
use std::process::ExitCode;

use cgx_attestation::sim::{SimAmd, SimGpu, SnpReportOptions, default_tcb};
use cgx_attestation::snp::{Product, SigningKey};
use time::OffsetDateTime;

use crate::output::{CliResult, hex_arg};

pub fn snp(
    out: &Path,
    report_data: Option<&str>,
    measurement: Option<&str>,
    product: Product,
    vlek: bool,
    version: u32,
) -> CliResult {
    if ![2, 3, 5].contains(&version) {
        return Err(format!("--version {version}: use 2, 3 or 5"));
    }
    let opts = SnpReportOptions {
        version,
        report_data: hex_arg::<64>(report_data, "report-data", false)?,
        measurement: hex_arg::<48>(measurement, "measurement", true)?,
        ..Default::default()
    };
    let mut chip = [0u8; 64];
    aws_lc_rs_fill(&mut chip)?;
    let key = if vlek {
        SigningKey::Vlek
    } else {
        SigningKey::Vcek
    };
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let sim = SimAmd::generate(product, key, default_tcb(product), chip, now)
        .map_err(|e| e.to_string())?;
    sim.bundle(&opts)
        .and_then(|b| b.write(out))
        .map_err(|e| e.to_string())?;
    println!(
        "wrote simulated {} SNP evidence ({}) to {}\nverify it with: cgx verify {} --trust-sim",
        product.name(),
        key.name(),
        out.display(),
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn aws_lc_rs_fill(buf: &mut [u8]) -> Result<(), String> {
    cgx_attestation::sim::fill_random(buf).map_err(|e| e.to_string())
}

pub fn nvidia(out: &Path, nonce: Option<&str>) -> CliResult {
    let nonce = match nonce {
        Some(_) => hex_arg::<32>(nonce, "nonce", true)?,
        None => {
            let mut n = [0u8; 32];
            aws_lc_rs_fill(&mut n)?;
            n
        }
    };
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let gpu = SimGpu::generate(now).map_err(|e| e.to_string())?;
    gpu.bundle(nonce, 64)
        .and_then(|b| b.write(out))
        .map_err(|e| e.to_string())?;
    println!(
        "wrote simulated NVIDIA GPU evidence to {}\nverify it with: cgx verify {} --trust-sim",
        out.display(),
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}
