//! `cgx-host-agent`: runs on the provider's machine, outside the confidential VM. It says what
//! the machine has (`inventory`), and boots the node and keeps it running (`run`): the `sim`
//! launcher runs the guest agent as a local process on a simulated machine, the `qemu` launcher
//! boots the confidential VM the launch description describes — the same description `cgx
//! measure launch` computes the reference values from.
//!
//! ```text
//! cgx-host-agent inventory [--json] [--disk PATH]
//! cgx-host-agent run --config host.toml
//! ```
//! Exit codes: 0 done, 1 failed, 2 usage.

use std::process::ExitCode;

pub mod channel;
pub mod config;
pub mod inventory;
pub mod launch;
pub mod launcher;
pub mod supervise;

const USAGE: &str = "usage: cgx-host-agent inventory [--json] [--disk PATH]\n       cgx-host-agent run --config host.toml";

/// A command line.
#[derive(Debug, PartialEq, Eq)]
pub enum Cli {
    Inventory { json: bool, disk: String },
    Run { config: std::path::PathBuf },
}

/// Parse the command line (without the program name).
pub fn parse(mut it: impl Iterator<Item = String>) -> Result<Cli, String> {
    match it.next().as_deref() {
        Some("inventory") => {
            let (mut json, mut disk) = (false, "/".to_string());
            while let Some(f) = it.next() {
                match f.as_str() {
                    "--json" => json = true,
                    "--disk" => disk = it.next().ok_or("--disk needs a value")?,
                    other => return Err(format!("unknown flag '{other}'\n{USAGE}")),
                }
            }
            Ok(Cli::Inventory { json, disk })
        }
        Some("run") => match (it.next().as_deref(), it.next(), it.next()) {
            (Some("--config"), Some(p), None) => Ok(Cli::Run { config: p.into() }),
            _ => Err(USAGE.into()),
        },
        Some("--help" | "-h") | None => Err(USAGE.into()),
        Some(other) => Err(format!("unknown command '{other}'\n{USAGE}")),
    }
}

fn inventory(json: bool, disk: &str) -> Result<(), String> {
    let inv =
        inventory::Inventory::from_sources(&inventory::Sources::read(disk), inventory::nvml_gpus());
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&inv).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!("CPU      {} ({} threads)", inv.cpu_model, inv.cpus);
    println!(
        "SEV-SNP  {} ({})",
        if inv.sev_snp.enabled {
            "enabled"
        } else {
            "not enabled"
        },
        inv.sev_snp.evidence.join("; ")
    );
    println!(
        "TDX      {} ({})",
        if inv.tdx.enabled {
            "enabled"
        } else {
            "not enabled"
        },
        inv.tdx.evidence.join("; ")
    );
    println!("memory   {:.1} GiB", gib(inv.memory_bytes));
    if let Some(d) = &inv.disk {
        println!(
            "disk     {}: {:.1} GiB free of {:.1} GiB",
            d.path,
            gib(d.free_bytes),
            gib(d.total_bytes)
        );
    }
    for g in &inv.gpus {
        println!(
            "GPU {}    {} {} GiB, CC {}{}",
            g.index,
            g.name,
            g.memory_gib,
            match g.cc_enabled {
                Some(true) => "on",
                Some(false) => "off",
                None => "unknown",
            },
            if g.cc_dev_mode == Some(true) {
                " (developer mode)"
            } else {
                ""
            }
        );
    }
    if let Some(e) = &inv.gpu_error {
        println!("GPUs     none: {e}");
    }
    Ok(())
}

fn run(path: &std::path::Path) -> Result<(), String> {
    let config = config::HostConfig::load(path).map_err(|e| e.to_string())?;
    if let (config::LauncherKind::Sim, Some(s)) = (config.launcher.kind, &config.sim) {
        #[cfg(feature = "sim")]
        if launcher::sim_machine(&s.machine, s.gpus, [0u8; 48], None)? {
            eprintln!(
                "cgx-host-agent: made the simulated machine {} ({} GPUs)",
                s.machine.display(),
                s.gpus
            );
        }
        #[cfg(not(feature = "sim"))]
        let _ = s;
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(signal, stop.clone()).map_err(|e| e.to_string())?;
    }
    // The VM's channel, served for the life of the agent (across the VM's restarts).
    if let (config::LauncherKind::Qemu, Some(q)) = (config.launcher.kind, &config.qemu) {
        let table = config.channel_table().map_err(|e| e.to_string())?;
        let (socket, stop) = (q.socket.clone(), stop.clone());
        std::thread::Builder::new()
            .name("cgx-channel".into())
            .spawn(move || channel::serve(&socket, table, &stop))
            .map_err(|e| e.to_string())?;
    }
    let mut backoff = supervise::Backoff::new(
        config.launcher.restart_min_ms,
        config.launcher.restart_max_ms,
    );
    let report = supervise::Report {
        state_file: config.launcher.state_file.clone(),
        launcher: format!("{:?}", config.launcher.kind).to_lowercase(),
        quiet: false,
    };
    supervise::supervise(
        || launcher::command(&config),
        &mut backoff,
        &report,
        &stop,
        std::time::Duration::from_secs(10),
    )
    .map(drop)
}

/// The program from the command line as the OS hands it (without the program name):
/// arguments that are not UTF-8 are a usage error, not a panic.
pub fn main_os(args: impl Iterator<Item = std::ffi::OsString>) -> ExitCode {
    match args
        .map(std::ffi::OsString::into_string)
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(args) => main_with(args.into_iter()),
        Err(_) => {
            eprintln!("cgx-host-agent: an argument is not UTF-8");
            ExitCode::from(2)
        }
    }
}

/// The program: parse `args` (without the program name), run, and say how it ended.
pub fn main_with(args: impl Iterator<Item = String>) -> ExitCode {
    let cli = match parse(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let r = match cli {
        Cli::Inventory { json, disk } => inventory(json, &disk),
        Cli::Run { config } => run(&config),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cgx-host-agent: {e}");
            ExitCode::from(1)
        }
    }
}
