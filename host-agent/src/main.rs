//! `cgx-host-agent`: on the provider's machine (the library's doc says what it does).

fn main() -> std::process::ExitCode {
    cgx_host_agent::main_os(std::env::args_os().skip(1))
}
