//! The image's `/init`: when the kernel starts the agent as process 1 (the cgx image's initrd
//! holds nothing else), it sets up the little a VM needs and runs the agent as its child:
//!
//! 1. mounts `/proc`, `/sys`, `/dev` (devtmpfs), `/run` and `/tmp` (tmpfs);
//! 2. loads the kernel modules `/etc/cgx/modules` lists, in order (virtio-serial for the host
//!    channel, configfs for configfs-tsm — the image's builder resolved their dependencies);
//! 3. brings up loopback (the channel's forwarders listen there; the VM has no other network);
//! 4. runs itself with the arguments in `/etc/cgx/agent.args` (one per line), which the image
//!    build wrote: the broker, the KBS, the broker's key, the CA — all inside the initrd, so
//!    all measured into the launch digest;
//! 5. reaps every orphan (a workload's daemons) and, when the agent ends, powers the VM off
//!    (the host agent restarts it).
//!
//! Each step is one system call; the `unsafe` blocks below are those calls, with arguments
//! built from constants or checked strings.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::path::Path;
use std::process::ExitCode;

/// The agent's arguments in the image.
pub const ARGS_FILE: &str = "/etc/cgx/agent.args";
/// Modules to load, one path per line.
pub const MODULES_FILE: &str = "/etc/cgx/modules";

fn say(msg: impl std::fmt::Display) {
    eprintln!("cgx-init: {msg}");
}

fn cstr(s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{s:?}: contains NUL"))
}

fn mount(
    source: &str,
    target: &str,
    fstype: &str,
    flags: libc::c_ulong,
    data: &str,
) -> Result<(), String> {
    let _ = std::fs::create_dir_all(target);
    let (s, t, f, d) = (cstr(source)?, cstr(target)?, cstr(fstype)?, cstr(data)?);
    // SAFETY: four NUL-terminated strings that outlive the call.
    let r = unsafe { libc::mount(s.as_ptr(), t.as_ptr(), f.as_ptr(), flags, d.as_ptr().cast()) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EBUSY) {
            return Err(format!("mount {fstype} on {target}: {e}"));
        }
    }
    Ok(())
}

fn load_module(path: &Path) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let params = c"";
    // SAFETY: finit_module(fd, params, flags) with an open fd and a NUL-terminated string.
    let r = unsafe {
        libc::syscall(
            libc::SYS_finit_module,
            f.as_raw_fd(),
            params.as_ptr(),
            0 as libc::c_int,
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EEXIST) {
            return Err(format!("loading {}: {e}", path.display()));
        }
    }
    Ok(())
}

/// `ip link set lo up` (the kernel gives it 127.0.0.1/8 as it comes up).
fn loopback_up() -> Result<(), String> {
    // SAFETY: socket(2) with constant arguments; the descriptor is closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(format!("socket: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: an all-zero ifreq is a valid value of this plain C struct.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *s as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS on a valid socket with a valid, named ifreq.
    let r = unsafe {
        if libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req) != 0 {
            -1
        } else {
            req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
            libc::ioctl(fd, libc::SIOCSIFFLAGS, &req)
        }
    };
    let e = std::io::Error::last_os_error();
    // SAFETY: closing the descriptor opened above, once.
    unsafe { libc::close(fd) };
    if r != 0 {
        return Err(format!("bringing up lo: {e}"));
    }
    Ok(())
}

/// The lines of a small file of the image, without blanks and `#` comments.
pub fn lines(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect()
}

fn read_small(path: &str) -> Result<String, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{path}: {e}"))?;
    if meta.len() > 64 * 1024 {
        return Err(format!("{path}: over 64 KiB"));
    }
    std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))
}

fn power_off() -> ExitCode {
    // SAFETY: sync(2) and reboot(2) take no pointers; as process 1 the VM ends here.
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_POWER_OFF);
    }
    ExitCode::from(1)
}

fn setup() -> Result<(), String> {
    const NOSUID_NODEV: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV;
    mount("proc", "/proc", "proc", NOSUID_NODEV | libc::MS_NOEXEC, "")?;
    mount("sysfs", "/sys", "sysfs", NOSUID_NODEV | libc::MS_NOEXEC, "")?;
    mount("devtmpfs", "/dev", "devtmpfs", libc::MS_NOSUID, "mode=0755")?;
    mount("tmpfs", "/run", "tmpfs", NOSUID_NODEV, "mode=0755")?;
    mount("tmpfs", "/tmp", "tmpfs", NOSUID_NODEV, "mode=1777")?;
    mount("tmpfs", "/dev/shm", "tmpfs", NOSUID_NODEV, "mode=1777")?;
    if Path::new(MODULES_FILE).exists() {
        for m in lines(&read_small(MODULES_FILE)?) {
            load_module(Path::new(&m))?;
        }
    }
    if Path::new("/sys/kernel/config").is_dir() {
        mount(
            "configfs",
            "/sys/kernel/config",
            "configfs",
            NOSUID_NODEV | libc::MS_NOEXEC,
            "",
        )?;
    }
    loopback_up()
}

/// Process 1: set up, run the agent, reap, power off.
pub fn main() -> ExitCode {
    if let Err(e) = setup() {
        say(e);
        return power_off();
    }
    let args = match read_small(ARGS_FILE) {
        Ok(t) => lines(&t),
        Err(e) => {
            say(e);
            return power_off();
        }
    };
    // A clean environment: what the kernel hands init (unknown command-line words such as
    // `HTTPS_PROXY=…` become variables) is not the agent's.
    let agent = match std::process::Command::new("/proc/self/exe")
        .args(&args)
        .env_clear()
        .env("PATH", "/")
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            say(format_args!("starting the agent: {e}"));
            return power_off();
        }
    };
    let pid = agent.id() as libc::pid_t;
    loop {
        let mut status = 0;
        // SAFETY: waitpid(-1, &status, 0) with a valid out pointer.
        let r = unsafe { libc::waitpid(-1, &mut status, 0) };
        if r == pid {
            say(format_args!(
                "the agent ended (wait status {status}); powering off"
            ));
            break;
        }
        if r < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            break;
        }
    }
    power_off()
}

#[cfg(test)]
mod tests {
    #[test]
    fn image_files_are_lines_without_comments() {
        assert_eq!(
            super::lines("run\n# the broker\n--broker\n  https://b.example \n\n"),
            ["run", "--broker", "https://b.example"]
        );
    }
}
