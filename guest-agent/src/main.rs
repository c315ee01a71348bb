//! `cgx-guest-agent`: runs inside the confidential VM (the library's doc says what it does).

fn main() -> std::process::ExitCode {
    cgx_guest_agent::main_os(std::env::args_os().skip(1))
}
