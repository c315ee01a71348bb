//! What every command shares: exit codes and usage errors, JSON and text output, argument
//! parsing helpers, and the one way a refusal is printed (with its stable code).

use std::path::Path;
use std::process::ExitCode;

use cgx_attestation::{Claims, KindClaims};
use serde_json::json;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// Pretty JSON on stdout.
pub(crate) fn print_json(v: &impl serde::Serialize) -> Result<(), String> {
    println!(
        "{}",
        serde_json::to_string_pretty(v).map_err(|e| e.to_string())?
    );
    Ok(())
}

/// A usage or I/O problem (exit 2), as opposed to a verification refusal (exit 1).
pub(crate) type CliResult = Result<ExitCode, String>;

pub(crate) fn parse_at(at: Option<&str>) -> Result<OffsetDateTime, String> {
    match at {
        None => Ok(OffsetDateTime::now_utc()),
        Some(s) => OffsetDateTime::parse(s, &Rfc3339)
            .map_err(|e| format!("--at '{s}' is not an RFC 3339 time: {e}")),
    }
}

pub(crate) fn hex_arg<const N: usize>(
    s: Option<&str>,
    name: &str,
    exact: bool,
) -> Result<[u8; N], String> {
    let mut out = [0u8; N];
    let Some(s) = s else { return Ok(out) };
    let bytes =
        hex::decode(s.trim_start_matches("0x")).map_err(|e| format!("--{name} is not hex: {e}"))?;
    if bytes.len() > N || (exact && bytes.len() != N) {
        return Err(format!(
            "--{name} must be {}{N} bytes, got {}",
            if exact { "" } else { "at most " },
            bytes.len()
        ));
    }
    out[..bytes.len()].copy_from_slice(&bytes);
    Ok(out)
}

pub(crate) fn read_text(p: &Path) -> Result<String, String> {
    std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))
}

pub(crate) fn summary(c: &Claims) -> String {
    let sim = if c.sim { " [SIMULATED]" } else { "" };
    let debug = if c.debug { " [DEBUG]" } else { "" };
    match &c.detail {
        KindClaims::Snp(s) => format!(
            "SEV-SNP report v{} from {:?} signed by {}{sim}{debug}\n  measurement  {}\n  report_data  {}\n  chip_id      {}\n  reported_tcb bl={} tee={} snp={} ucode={}{}\n  policy       {}",
            s.version,
            s.product,
            s.signing_key.name(),
            s.measurement,
            s.report_data,
            s.chip_id,
            s.reported_tcb.bootloader,
            s.reported_tcb.tee,
            s.reported_tcb.snp,
            s.reported_tcb.microcode,
            s.reported_tcb
                .fmc
                .map(|f| format!(" fmc={f}"))
                .unwrap_or_default(),
            s.policy
        ),
        KindClaims::Tdx(t) => format!(
            "TDX quote v{} ({}) TCB {}{}{sim}{debug}\n  mr_td        {}\n  report_data  {}\n  td_attributes {}\n  rtmr0..3     {}",
            t.quote_version,
            t.body,
            t.tcb_status,
            if t.advisory_ids.is_empty() {
                String::new()
            } else {
                format!(" ({})", t.advisory_ids.join(", "))
            },
            t.mr_td,
            t.report_data,
            t.td_attributes,
            t.rtmr.join("\n               ")
        ),
        KindClaims::Sample(x) => format!(
            "CoCo sample evidence (unsigned){sim}{debug}\n  report_data  {}",
            x.report_data
        ),
        KindClaims::Nvidia(n) => format!(
            "NVIDIA GPU SPDM {} measurements, {} blocks{sim}\n  nonce        {}\n  vbios        {}\n  driver       {}\n  device       {}",
            n.spdm_version,
            n.measurement_count,
            n.nonce,
            n.vbios_version.as_deref().unwrap_or("-"),
            n.driver_version.as_deref().unwrap_or("-"),
            n.device_serial
        ),
    }
}

/// An error that carries a stable code (the verifier's, or the policy layer's).
pub(crate) trait Coded: std::fmt::Display {
    fn code(&self) -> &'static str;
}

impl Coded for cgx_attestation::Error {
    fn code(&self) -> &'static str {
        cgx_attestation::Error::code(self)
    }
}

impl Coded for cgx_policies::Error {
    fn code(&self) -> &'static str {
        cgx_policies::Error::code(self)
    }
}

pub(crate) fn refused(json_out: bool, kind: Option<&str>, e: &dyn Coded) -> CliResult {
    if json_out {
        let out = json!({
            "valid": false,
            "kind": kind,
            "error": {"code": e.code(), "message": e.to_string()},
        });
        print_json(&out)?;
    } else {
        println!(
            "REFUSED {}: {} ({})",
            kind.unwrap_or("evidence"),
            e,
            e.code()
        );
    }
    Ok(ExitCode::from(1))
}
