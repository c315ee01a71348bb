//! `cgx bench …`: handed to the `cgx-bench` program.

use crate::output::CliResult;

/// `cgx bench ARGS…`: run `cgx-bench ARGS…` — the program beside this one, else on `PATH` — as
/// git and cargo run their external subcommands, so the benchmarks' peer crates (`sev`,
/// `dcap-qvl` on ring, ring) stay out of the user's binary while the command, its flags and its
/// JSON stay as they were.
pub fn run(args: &[String]) -> CliResult {
    let name = format!("cgx-bench{}", std::env::consts::EXE_SUFFIX);
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join(&name)))
        .filter(|p| p.is_file());
    let program = beside.unwrap_or_else(|| name.clone().into());
    let mut cmd = std::process::Command::new(&program);
    cmd.args(args);
    let missing = |e: std::io::Error| {
        if e.kind() == std::io::ErrorKind::NotFound {
            format!(
                "cgx bench runs the {name} program, which is neither beside cgx nor on PATH: \
                 build it with `cargo build --release -p cgx-bench`"
            )
        } else {
            format!("{}: {e}", program.display())
        }
    };
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        // Only returns on failure: on success this process becomes cgx-bench.
        Err(missing(cmd.exec()))
    }
    #[cfg(not(unix))]
    {
        let status = cmd.status().map_err(missing)?;
        Ok(std::process::ExitCode::from(
            status
                .code()
                .and_then(|c| u8::try_from(c).ok())
                .unwrap_or(1),
        ))
    }
}
