//! `cgx-guest-agent`: runs inside the confidential VM (the library's doc says what it does).

fn main() -> std::process::ExitCode {
    // Arguments that are not UTF-8 are a usage error, not a panic.
    match std::env::args_os()
        .skip(1)
        .map(std::ffi::OsString::into_string)
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(args) => cgx_guest_agent::main_with(args.into_iter()),
        Err(_) => {
            eprintln!("cgx-guest-agent: an argument is not UTF-8");
            std::process::ExitCode::from(2)
        }
    }
}
