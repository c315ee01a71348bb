//! The channel end to end over a socket pair (the link) with real TCP on loopback at both ends:
//! many streams at once past the flow-control window, refusals with their reasons, a stuck
//! stream that stalls no other, a hostile peer, and the link's end ending every stream.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cgx_channel::frame::{Frame, WINDOW};
use cgx_channel::mux::{self, Handler, Mux};

/// An echo server on loopback: each connection's bytes back, then close after its FIN.
fn echo_server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { continue };
            std::thread::spawn(move || {
                let mut w = c.try_clone().unwrap();
                let _ = std::io::copy(&mut c, &mut w);
                let _ = w.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    addr
}

/// A server that accepts and never reads (its socket buffers fill).
fn stuck_server() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in l.incoming() {
            held.push(c);
        }
    });
    addr
}

/// A host (serving `handler`) and a guest over a socket pair; the guest's mux.
fn pair(handler: Handler) -> (Mux, Mux) {
    let (g, h) = UnixStream::pair().unwrap();
    let host = Mux::new(Box::new(h.try_clone().unwrap()));
    let guest = Mux::new(Box::new(g.try_clone().unwrap()));
    let hm = host.clone();
    std::thread::spawn(move || hm.run(h, Some(handler)));
    let gm = guest.clone();
    std::thread::spawn(move || gm.run(g, None));
    (guest, host)
}

fn table(echo: SocketAddr, stuck: SocketAddr, file: std::path::PathBuf) -> Handler {
    Arc::new(move |target: &str| match target {
        "echo" => mux::tcp_target(&echo, Duration::from_secs(5)),
        "stuck" => mux::tcp_target(&stuck, Duration::from_secs(5)),
        "closed" => mux::tcp_target(&"127.0.0.1:1".parse().unwrap(), Duration::from_secs(5)),
        "token" => mux::file_target(&file, 1024),
        other => Err(format!("no target '{other}'")),
    })
}

/// A guest-side local connection carried to `target`: the client end.
fn connect_through(guest: &Mux, target: &str) -> TcpStream {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (conn, _) = l.accept().unwrap();
    guest.forward_tcp(conn, target).unwrap();
    client
}

fn tmp_file(bytes: &[u8]) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!(
        "cgx-channel-test-{}-{}",
        std::process::id(),
        bytes.len()
    ));
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn many_streams_past_the_window_arrive_whole_and_in_order() {
    let (guest, _host) = pair(table(echo_server(), stuck_server(), tmp_file(b"t")));
    let size = 3 * WINDOW as usize + 12_345;
    let threads: Vec<_> = (0..8u8)
        .map(|k| {
            let c = connect_through(&guest, "echo");
            std::thread::spawn(move || {
                let data: Vec<u8> = (0..size).map(|i| (i as u8).wrapping_mul(31) ^ k).collect();
                let mut w = c.try_clone().unwrap();
                let sent = data.clone();
                let writer = std::thread::spawn(move || {
                    w.write_all(&sent).unwrap();
                    w.shutdown(std::net::Shutdown::Write).unwrap();
                });
                let mut back = Vec::new();
                let mut c = c;
                c.read_to_end(&mut back).unwrap();
                writer.join().unwrap();
                assert!(
                    back == data,
                    "stream {k}: {} bytes back of {}",
                    back.len(),
                    data.len()
                );
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // Both halves closed: the streams are forgotten on both sides.
    let t = Instant::now();
    while guest.streams() > 0 && t.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(guest.streams(), 0);
}

#[test]
fn a_stuck_stream_stalls_no_other() {
    let (guest, _host) = pair(table(echo_server(), stuck_server(), tmp_file(b"t")));
    // Fill the stuck stream far past its window: the peer stops crediting it.
    let stuck = connect_through(&guest, "stuck");
    let mut s = stuck.try_clone().unwrap();
    std::thread::spawn(move || {
        let chunk = vec![0u8; 64 * 1024];
        while s.write_all(&chunk).is_ok() {}
    });
    std::thread::sleep(Duration::from_millis(300));
    let mut c = connect_through(&guest, "echo");
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    c.write_all(b"ping").unwrap();
    let mut buf = [0u8; 4];
    c.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"ping");
}

#[test]
fn streams_past_the_limit_are_refused_on_either_side() {
    let (guest, _host) = pair(table(echo_server(), stuck_server(), tmp_file(b"t")));
    let held: Vec<TcpStream> = (0..cgx_channel::mux::MAX_STREAMS)
        .map(|_| connect_through(&guest, "stuck"))
        .collect();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let _client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (conn, _) = l.accept().unwrap();
    let e = guest.forward_tcp(conn, "echo").unwrap_err().to_string();
    assert!(e.contains("64 streams open on the channel already"), "{e}");
    drop(held);
}

#[test]
fn files_are_served_and_refusals_carry_their_reason() {
    let (guest, _host) = pair(table(
        echo_server(),
        stuck_server(),
        tmp_file(b"operator-token"),
    ));
    let t = Duration::from_secs(5);
    assert_eq!(guest.fetch("token", 1024, t).unwrap(), b"operator-token");
    let e = guest.fetch("token", 4, t).unwrap_err();
    assert!(e.contains("over the 4-byte limit"), "{e}");
    let e = guest.fetch("nothing", 1024, t).unwrap_err();
    assert!(e.contains("reset by the peer: no target 'nothing'"), "{e}");
    let e = guest.fetch("closed", 1024, t).unwrap_err();
    assert!(e.contains("reset by the peer: connect:"), "{e}");
    // A name the frame rules refuse never leaves.
    assert!(guest.fetch("../etc/passwd", 1024, t).is_err());
    // The link still carries streams after all that.
    assert_eq!(guest.fetch("token", 1024, t).unwrap(), b"operator-token");
}

/// Frames written by hand, as a hostile host would.
fn raw_host() -> (Mux, UnixStream, std::thread::JoinHandle<String>) {
    let (g, h) = UnixStream::pair().unwrap();
    let guest = Mux::new(Box::new(g.try_clone().unwrap()));
    let gm = guest.clone();
    let run = std::thread::spawn(move || gm.run(g, None));
    (guest, h, run)
}

fn send(link: &mut UnixStream, f: Frame) {
    let mut v = Vec::new();
    f.encode(&mut v).unwrap();
    link.write_all(&v).unwrap();
}

#[test]
fn a_hostile_host_is_refused_stream_by_stream_or_link_by_link() {
    // Past the window (a sink that is slow to consume, so no credit went back): that stream
    // is reset, the link lives.
    let (guest, mut h, _run) = raw_host();
    struct Slow(std::sync::mpsc::Sender<Result<(), String>>);
    impl cgx_channel::Sink for Slow {
        fn write(&mut self, _: &[u8]) -> std::io::Result<()> {
            std::thread::sleep(Duration::from_millis(500));
            Ok(())
        }
        fn finish(&mut self, outcome: Result<(), String>) {
            let _ = self.0.send(outcome);
        }
    }
    let (tx, rx) = std::sync::mpsc::channel();
    guest.open("token", None, Box::new(Slow(tx))).unwrap();
    let chunk = vec![1u8; 64 * 1024];
    for _ in 0..5 {
        send(
            &mut h,
            Frame::Data {
                stream: 1,
                bytes: &chunk,
            },
        );
    }
    let e = rx
        .recv_timeout(Duration::from_secs(5))
        .unwrap()
        .unwrap_err();
    assert!(e.contains("the peer sent past its window"), "{e}");
    assert!(guest.is_alive());
    // Credit beyond what was sent: reset.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn({
        let guest = guest.clone();
        move || tx.send(guest.fetch("token", 10, Duration::from_secs(5)))
    });
    std::thread::sleep(Duration::from_millis(200));
    send(
        &mut h,
        Frame::Credit {
            stream: 2,
            bytes: 1,
        },
    );
    let e = rx.recv().unwrap().unwrap_err();
    assert!(e.contains("the peer credited more than was sent"), "{e}");
    // An OPEN from the host, and garbage: the link ends, saying why.
    send(
        &mut h,
        Frame::Open {
            stream: 9,
            target: "x",
        },
    );
    let why = _run.join().unwrap();
    assert!(why.contains("the peer opened a stream"), "{why}");
    assert!(!guest.is_alive());
    assert!(
        guest
            .fetch("token", 10, Duration::from_secs(1))
            .unwrap_err()
            .contains("down")
    );

    let (_guest, mut h, run) = raw_host();
    h.write_all(&[0, 0, 0, 1, 7, 0, 0, 0, 0]).unwrap();
    let why = run.join().unwrap();
    assert!(why.contains("framing: frame kind 7"), "{why}");
}

#[test]
fn the_links_end_ends_every_stream() {
    let (g, h) = UnixStream::pair().unwrap();
    let guest = Mux::new(Box::new(g.try_clone().unwrap()));
    let gm = guest.clone();
    let run = std::thread::spawn(move || gm.run(g, None));
    let (tx, rx) = std::sync::mpsc::channel();
    for _ in 0..3 {
        let (guest, tx) = (guest.clone(), tx.clone());
        std::thread::spawn(move || tx.send(guest.fetch("token", 10, Duration::from_secs(10))));
    }
    std::thread::sleep(Duration::from_millis(200));
    drop(h);
    for _ in 0..3 {
        // Closed, or reset (the host end went away with the guest's frames unread).
        let e = rx
            .recv_timeout(Duration::from_secs(5))
            .unwrap()
            .unwrap_err();
        assert!(
            e.contains("the link closed") || e.contains("reading the link"),
            "{e}"
        );
    }
    let why = run.join().unwrap();
    assert!(
        why == "the link closed" || why.starts_with("reading the link"),
        "{why}"
    );
    assert_eq!(guest.streams(), 0);
}

/// A host whose guest stops reading: its pumps block writing the link; closing the link
/// (a socket: shut down) unblocks them, and they end, dropping their endpoints.
#[test]
fn closing_a_socket_link_unblocks_its_writers() {
    struct Endless(std::sync::mpsc::Sender<()>);
    impl Read for Endless {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            buf.fill(9);
            Ok(buf.len())
        }
    }
    impl Drop for Endless {
        fn drop(&mut self) {
            let _ = self.0.send(());
        }
    }
    let (g, h) = UnixStream::pair().unwrap();
    let host = Mux::on_socket(&h).unwrap();
    let (dropped_tx, dropped) = std::sync::mpsc::channel();
    let handler: Handler = Arc::new(move |_: &str| {
        Ok((
            Some(Box::new(Endless(dropped_tx.clone())) as Box<dyn Read + Send>),
            Box::new(cgx_channel::mux::Refuse) as Box<dyn cgx_channel::Sink>,
        ))
    });
    let hm = host.clone();
    std::thread::spawn(move || hm.run(h, Some(handler)));
    // The guest asks for the endless stream, then never reads its end of the link again.
    let mut g = g;
    send(
        &mut g,
        Frame::Open {
            stream: 1,
            target: "endless",
        },
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        dropped.try_recv().is_err(),
        "the pump should be blocked writing"
    );
    host.close("the test ends the link");
    dropped
        .recv_timeout(Duration::from_secs(5))
        .expect("the blocked pump ended once the link was shut down");
    drop(g);
}
