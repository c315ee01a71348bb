//! The host's end of the guest channel: QEMU's socket for the VM's virtio-serial port, served
//! with [`cgx_channel`]. The guest names what it wants; this table decides what that is — a
//! connection to the broker or the KBS, the operator's token, a simulated machine, an
//! encrypted weights file — so a guest can make its host connect nowhere else and read no
//! other file. What crosses is TLS from the guest (or signed, or encrypted to its TEE key);
//! this side only carries it.

use std::net::{SocketAddr, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cgx_channel::mux::{self, Handler, Opened};

/// What the host serves its guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    /// Where `broker` and `kbs` streams connect (`host:port`, resolved at each connection).
    pub broker: String,
    pub kbs: String,
    /// `operator-token`.
    pub token_file: PathBuf,
    /// `sim-machine` (a VM without a TEE, in tests).
    pub sim_machine: Option<PathBuf>,
    /// `store/<file>`: the encrypted weights.
    pub store: Option<PathBuf>,
}

fn connect(addr: &str) -> Opened {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|_| "the service's address does not resolve".to_string())?
        .collect();
    let mut last = "no address".to_string();
    for a in addrs {
        match mux::tcp_target(&a, Duration::from_secs(10)) {
            Ok(o) => return Ok(o),
            Err(e) => last = e,
        }
    }
    Err(last)
}

impl Table {
    /// What the guest's `target` is, or why not. Reasons name no host path.
    pub fn open(&self, target: &str) -> Opened {
        match target {
            "broker" => connect(&self.broker),
            "kbs" => connect(&self.kbs),
            "operator-token" => mux::file_target(&self.token_file, 64 * 1024),
            "sim-machine" => match &self.sim_machine {
                Some(p) => mux::file_target(p, 4 << 20),
                None => Err("no simulated machine on this host".into()),
            },
            t => match (t.strip_prefix("store/"), &self.store) {
                // One name inside the store (the frame rules already refused `..`), not a
                // hidden one (partial downloads, the store's own files).
                (Some(file), Some(dir)) if !file.contains('/') && !file.starts_with('.') => {
                    mux::file_target(&dir.join(file), u64::MAX)
                }
                _ => Err(format!("no target '{t}'")),
            },
        }
    }
}

/// Serve the guest at QEMU's `socket` until `stop`: connect (QEMU listens there once the VM
/// starts), carry streams until the link breaks, reconnect.
pub fn serve(socket: &Path, table: Table, stop: &AtomicBool) {
    let table = Arc::new(table);
    let handler: Handler = {
        let table = table.clone();
        Arc::new(move |target: &str| {
            let r = table.open(target);
            if let Err(why) = &r {
                eprintln!("cgx-host-agent: channel: the guest's '{target}' refused: {why}");
            }
            r
        })
    };
    let mut said = false;
    let mut pause = Duration::from_millis(100);
    while !stop.load(Ordering::SeqCst) {
        let conn = match UnixStream::connect(socket) {
            Ok(c) => c,
            Err(e) => {
                if !said {
                    eprintln!(
                        "cgx-host-agent: channel {}: {e}; waiting for the VM",
                        socket.display()
                    );
                    said = true;
                }
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        said = false;
        let m = match cgx_channel::Mux::on_socket(&conn) {
            Ok(m) => m,
            Err(e) => {
                eprintln!("cgx-host-agent: channel: {e}");
                std::thread::sleep(Duration::from_millis(500));
                continue;
            }
        };
        let t = std::time::Instant::now();
        let why = m.run(conn, Some(handler.clone()));
        eprintln!("cgx-host-agent: channel: {why}");
        // A guest that breaks its link at once (bad framing, say) waits longer each time:
        // every link's streams start from nothing, and its old ones take a moment to end.
        pause = if t.elapsed() < Duration::from_secs(1) {
            (pause * 2).min(Duration::from_secs(5))
        } else {
            Duration::from_millis(100)
        };
        std::thread::sleep(pause);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_table_serves_what_it_names_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("cgx-channel-table-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("store")).unwrap();
        std::fs::write(dir.join("token"), b"t").unwrap();
        std::fs::write(dir.join("store/llama.age"), b"age").unwrap();
        std::fs::write(dir.join("secret"), b"s").unwrap();
        let t = Table {
            broker: "127.0.0.1:1".into(),
            kbs: "no-such-host.invalid:1".into(),
            token_file: dir.join("token"),
            sim_machine: None,
            store: Some(dir.join("store")),
        };
        for ok in ["operator-token", "store/llama.age"] {
            assert!(t.open(ok).is_ok(), "{ok}");
        }
        std::os::unix::fs::symlink(dir.join("secret"), dir.join("store/link.age")).unwrap();
        std::fs::write(dir.join("store/.partial"), b"p").unwrap();
        for (target, why) in [
            ("store/missing.age", "not available"),
            ("store/link.age", "not available"),
            ("store/.partial", "no target"),
            ("store/sub/llama.age", "no target"),
            ("secret", "no target 'secret'"),
            ("sim-machine", "no simulated machine"),
            ("broker", "connect:"),
            ("kbs", "does not resolve"),
        ] {
            let e = t.open(target).err().unwrap();
            assert!(e.contains(why), "{target}: {e}");
            assert!(!e.contains(&dir.display().to_string()), "{target}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
