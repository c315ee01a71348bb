//! The guest's end of the host channel (`--channel NAME`): in a VM with no network address the
//! agent reaches the broker and the KBS through a virtio-serial port to its host agent
//! ([`cgx_channel`]). For each service a forwarder listens on this VM's loopback and carries
//! each connection to the host as a stream; the service's host name is pinned to that
//! forwarder, so TLS runs end to end through the channel and still verifies the service's
//! name (the host sees ciphertext and can only deny service). The operator's token, a
//! simulated machine and the encrypted weights come over the same channel as named files.
//!
//! The port is reopened whenever the link breaks (the host agent restarted, QEMU's socket
//! reconnected); connections made meanwhile are refused, and the daemon's requests retry as
//! they would over a network.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cgx_channel::Mux;

/// How long a caller waits for the link to come (back) up.
const LINK_WAIT: Duration = Duration::from_secs(30);

/// The guest's channel.
#[derive(Clone)]
pub struct Tunnel {
    name: String,
    current: Arc<(Mutex<Option<Mux>>, Condvar)>,
}

impl std::fmt::Debug for Tunnel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tunnel").field("port", &self.name).finish()
    }
}

/// The device of the virtio-serial port named `name` (`/sys/class/virtio-ports/*/name`).
pub fn port_device(sys: &Path, dev: &Path, name: &str) -> Result<PathBuf, String> {
    let entries = std::fs::read_dir(sys).map_err(|e| {
        format!(
            "{}: {e} (no virtio-serial ports: is virtio_console loaded?)",
            sys.display()
        )
    })?;
    for e in entries.flatten() {
        let Ok(n) = std::fs::read_to_string(e.path().join("name")) else {
            continue;
        };
        if n.trim_end() == name {
            return Ok(dev.join(e.file_name()));
        }
    }
    Err(format!(
        "no virtio-serial port named '{name}' in {}",
        sys.display()
    ))
}

impl Tunnel {
    /// Open the port named `name` and keep it open (reopening after a broken link) for the
    /// life of the process.
    pub fn start(name: &str) -> Result<Tunnel, String> {
        let t = Tunnel {
            name: name.to_string(),
            current: Arc::new((Mutex::new(None), Condvar::new())),
        };
        let device = wait_for_port(name, Duration::from_secs(10))?;
        let link = t.clone();
        std::thread::Builder::new()
            .name("cgx-channel-link".into())
            .spawn(move || link.keep_open(&device))
            .map_err(|e| e.to_string())?;
        Ok(t)
    }

    fn keep_open(&self, device: &Path) {
        let mut quiet = false;
        loop {
            match std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(device)
            {
                Ok(port) => match port.try_clone() {
                    Ok(out) => {
                        let mux = Mux::new(Box::new(out));
                        self.set(Some(mux.clone()));
                        let why = mux.run(port, None);
                        self.set(None);
                        if !quiet {
                            crate::daemon::log(format_args!(
                                "channel {}: {why}; reopening",
                                self.name
                            ));
                        }
                        // A port whose host end is absent reads as closed at once: say so
                        // once, then wait quietly for the host.
                        quiet = why == "the link closed";
                    }
                    Err(e) => crate::daemon::log(format_args!("channel {}: {e}", device.display())),
                },
                Err(e) => crate::daemon::log(format_args!("channel {}: {e}", device.display())),
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn set(&self, mux: Option<Mux>) {
        let (lock, cv) = &*self.current;
        *lock.lock().unwrap_or_else(|p| p.into_inner()) = mux;
        cv.notify_all();
    }

    /// The live link, waiting up to `wait` for one.
    pub fn mux(&self, wait: Duration) -> Result<Mux, String> {
        let (lock, cv) = &*self.current;
        let deadline = Instant::now() + wait;
        let mut cur = lock.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(m) = cur.as_ref().filter(|m| m.is_alive()) {
                return Ok(m.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!("channel {}: the host is not answering", self.name));
            }
            cur = cv
                .wait_timeout(cur, left.min(Duration::from_millis(200)))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// A loopback forwarder to `target`: its address (pin the service's name to it).
    pub fn forward(&self, target: &str) -> Result<SocketAddr, String> {
        cgx_channel::frame::check_target(target).map_err(|e| e.to_string())?;
        let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("loopback: {e}"))?;
        let addr = l.local_addr().map_err(|e| e.to_string())?;
        let (t, target) = (self.clone(), target.to_string());
        std::thread::Builder::new()
            .name(format!("cgx-forward-{target}"))
            .spawn(move || {
                let own = crate::reap::own_uid();
                for conn in l.incoming().flatten() {
                    // Only the agent's own connections: a workload (another uid) reaches
                    // neither the broker nor the KBS through its host, and cannot fill the
                    // channel's stream table.
                    let uid = match (conn.peer_addr(), conn.local_addr()) {
                        (Ok(SocketAddr::V4(peer)), Ok(SocketAddr::V4(local))) => {
                            std::fs::read_to_string("/proc/net/tcp")
                                .ok()
                                .and_then(|t| uid_of_connection(&t, peer, local))
                        }
                        _ => None,
                    };
                    if uid != Some(own) {
                        crate::daemon::log(format_args!(
                            "channel {target}: a connection from uid {uid:?} refused (only the agent's own)"
                        ));
                        continue;
                    }
                    // Refused (closed) at once while the link is down: the client retries.
                    match t.mux(Duration::from_secs(5)) {
                        Ok(m) => {
                            if let Err(e) = m.forward_tcp(conn, &target) {
                                crate::daemon::log(format_args!("channel {target}: {e}"));
                            }
                        }
                        Err(e) => crate::daemon::log(e),
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        Ok(addr)
    }

    /// A provisioned file from the host (at most `limit` bytes).
    pub fn fetch(&self, target: &str, limit: usize) -> Result<Vec<u8>, String> {
        self.mux(LINK_WAIT)?.fetch(target, limit, LINK_WAIT)
    }

    /// A provisioned file from the host written to `dest` (0600, created new, removed on
    /// failure): the encrypted weights, which may be large. Their digest is checked at
    /// decryption (the key binds it), so the host cannot substitute another file.
    pub fn fetch_to(&self, target: &str, dest: &Path, timeout: Duration) -> Result<u64, String> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dest)
            .map_err(|e| format!("{}: {e}", dest.display()))?;
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = FileSink {
            f: std::io::BufWriter::with_capacity(1 << 20, f),
            n: 0,
            done: tx,
        };
        let opened = self.mux(LINK_WAIT).and_then(|m| {
            m.open(target, None, Box::new(sink))
                .map(|id| (m, id))
                .map_err(|e| e.to_string())
        });
        let result = opened.and_then(|(m, id)| match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(_) => {
                let why = format!("no whole file within {} s", timeout.as_secs());
                m.reset(id, &why);
                Err(why)
            }
        });
        if result.is_err() {
            let _ = std::fs::remove_file(dest);
        }
        result.map_err(|e| format!("channel {target}: {e}"))
    }
}

/// The owner of the TCP connection from `client` to `server`, from `/proc/net/tcp`'s text
/// (`sl local rem st queues timers retransmits uid …`; IPv4 addresses as the kernel's
/// little-endian hex, ports big-endian hex).
pub fn uid_of_connection(
    table: &str,
    client: std::net::SocketAddrV4,
    server: std::net::SocketAddrV4,
) -> Option<u32> {
    let parse = |a: &str| -> Option<std::net::SocketAddrV4> {
        let (ip, port) = a.split_once(':')?;
        let ip = u32::from_str_radix(ip, 16).ok()?;
        let port = u16::from_str_radix(port, 16).ok()?;
        Some(std::net::SocketAddrV4::new(ip.to_le_bytes().into(), port))
    };
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        (f.len() > 7 && parse(f[1])? == client && parse(f[2])? == server)
            .then(|| f[7].parse().ok())
            .flatten()
    })
}

/// Wait for the port to appear (the module that makes it was just loaded).
fn wait_for_port(name: &str, wait: Duration) -> Result<PathBuf, String> {
    let t = Instant::now();
    loop {
        match port_device(
            Path::new("/sys/class/virtio-ports"),
            Path::new("/dev"),
            name,
        ) {
            Ok(p) if p.exists() => return Ok(p),
            Ok(p) if t.elapsed() > wait => return Err(format!("{}: no such device", p.display())),
            Err(e) if t.elapsed() > wait => return Err(e),
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

struct FileSink {
    f: std::io::BufWriter<std::fs::File>,
    n: u64,
    done: std::sync::mpsc::Sender<Result<u64, String>>,
}

impl cgx_channel::Sink for FileSink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        self.f.write_all(bytes)?;
        self.n += bytes.len() as u64;
        Ok(())
    }

    fn finish(&mut self, outcome: Result<(), String>) {
        use std::io::Write;
        let r = outcome.and_then(|()| {
            self.f.flush().map_err(|e| e.to_string())?;
            self.f.get_ref().sync_all().map_err(|e| e.to_string())?;
            Ok(self.n)
        });
        let _ = self.done.send(r);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_connections_owner_is_read_from_the_kernels_table() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:A1B2 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 0100007F:D431 0100007F:A1B2 01 00000000:00000000 00:00000000 00000000 524288        0 2 1 0 20 4 30 10 -1
   2: 0100007F:D432 0100007F:A1B2 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0 20 4 30 10 -1
";
        let server = "127.0.0.1:41394".parse().unwrap();
        assert_eq!(
            uid_of_connection(table, "127.0.0.1:54321".parse().unwrap(), server),
            Some(524_288)
        );
        assert_eq!(
            uid_of_connection(table, "127.0.0.1:54322".parse().unwrap(), server),
            Some(0)
        );
        assert_eq!(
            uid_of_connection(table, "127.0.0.1:54323".parse().unwrap(), server),
            None
        );
        assert_eq!(
            uid_of_connection("garbage\n1: x y z", "127.0.0.1:1".parse().unwrap(), server),
            None
        );
    }

    /// This process's own loopback connection is found as its own.
    #[test]
    fn this_processs_connection_is_its_own() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (conn, _) = l.accept().unwrap();
        let (SocketAddr::V4(peer), SocketAddr::V4(local)) =
            (conn.peer_addr().unwrap(), conn.local_addr().unwrap())
        else {
            panic!("not IPv4");
        };
        let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
        assert_eq!(
            uid_of_connection(&table, peer, local),
            Some(crate::reap::own_uid())
        );
        drop(c);
    }

    #[test]
    fn the_port_is_found_by_its_name() {
        let d = std::env::temp_dir().join(format!("cgx-ports-{}", std::process::id()));
        for (port, name) in [
            ("vport0p1", "org.qemu.guest_agent.0"),
            ("vport1p1", "cgx.0"),
        ] {
            std::fs::create_dir_all(d.join(port)).unwrap();
            std::fs::write(d.join(port).join("name"), format!("{name}\n")).unwrap();
        }
        assert_eq!(
            port_device(&d, Path::new("/dev"), "cgx.0").unwrap(),
            Path::new("/dev/vport1p1")
        );
        let e = port_device(&d, Path::new("/dev"), "cgx.1").unwrap_err();
        assert!(e.contains("no virtio-serial port named 'cgx.1'"), "{e}");
        let e = port_device(&d.join("none"), Path::new("/dev"), "cgx.0").unwrap_err();
        assert!(e.contains("is virtio_console loaded?"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
