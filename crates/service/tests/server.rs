#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The listener under the ways clients misbehave: silent connections, stalled TLS handshakes
//! and trickled bodies lose their slot to the timeouts, and one client address holds at most
//! its share of connections and requests in flight, so a full cap does not lock honest
//! clients out; plain HTTP is refused off loopback; shutdown lets a request in flight finish.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::{get, post};
use cgx_service::ListenerConfig;

fn config(max: usize) -> ListenerConfig {
    let mut c = ListenerConfig::new("127.0.0.1:0", None, true);
    c.max_connections = max;
    c.header_timeout = Duration::from_millis(800);
    c.request_timeout = Duration::from_millis(800);
    c.drain = Duration::from_secs(5);
    c
}

fn router() -> Router {
    Router::new()
        .route(
            "/small",
            cgx_service::limits::limited(
                post(|body: axum::body::Bytes| async move { body.len().to_string() }),
                16,
            ),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/big",
            get(|| async { axum::body::Bytes::from(vec![b'x'; 32 << 20]) }),
        )
        .route("/echo", post(|body: axum::body::Bytes| async move { body }))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(400)).await;
                "done"
            }),
        )
}

/// One HTTP/1.1 request on a fresh connection; the status line, or an error within `limit`.
fn get_status(addr: SocketAddr, path: &str, limit: Duration) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(limit))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out.lines().next().unwrap_or("").to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_cap_of_silent_or_trickling_clients_frees_itself() {
    let running = cgx_service::server::start(&config(2), router(), vec![])
        .await
        .unwrap();
    let addr = running.addr();
    let (silent, trickling) = tokio::task::spawn_blocking(move || {
        // Two connections that never send a byte: on Linux the kernel keeps them (deferred
        // accept); elsewhere they fill the cap until the header timeout.
        let a = TcpStream::connect(addr).unwrap();
        let b = TcpStream::connect(addr).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        let status = get_status(addr, "/healthz", Duration::from_secs(5)).unwrap();
        let silent = (status, t.elapsed());
        drop((a, b));
        // Two requests that announce a body and trickle ten bytes of it.
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut s = TcpStream::connect(addr).unwrap();
            write!(
                s,
                "POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n0123456789"
            )
            .unwrap();
            held.push(s);
        }
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        let status = get_status(addr, "/healthz", Duration::from_secs(5)).unwrap();
        let trickling = (status, t.elapsed());
        // The trickling clients were answered 408.
        let mut answer = String::new();
        held[0]
            .set_read_timeout(Some(Duration::from_secs(3)))
            .unwrap();
        let _ = held[0].read_to_string(&mut answer);
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("application/problem+json"), "{answer}");
        (silent, trickling)
    })
    .await
    .unwrap();
    assert_eq!(silent.0, "HTTP/1.1 200 OK");
    assert!(silent.1 < Duration::from_secs(3), "{:?}", silent.1);
    if cfg!(target_os = "linux") {
        // TCP_DEFER_ACCEPT: a connection that has sent nothing stays in the kernel's queue
        // and takes no slot, so the request is answered at once.
        assert!(
            silent.1 < Duration::from_millis(500),
            "silent connections took the slots: {:?}",
            silent.1
        );
    } else {
        assert!(
            silent.1 >= Duration::from_millis(500),
            "the cap held: {:?}",
            silent.1
        );
    }
    assert_eq!(trickling.0, "HTTP/1.1 200 OK");
    assert!(trickling.1 < Duration::from_secs(3), "{:?}", trickling.1);
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_a_request_in_flight() {
    let running = cgx_service::server::start(&config(8), router(), vec![])
        .await
        .unwrap();
    let addr = running.addr();
    let client = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(
            s,
            "GET /slow HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    running.shutdown().await;
    let out = client.await.unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    assert!(out.ends_with("done"), "{out}");
    // Nothing listens any more.
    assert!(TcpStream::connect(addr).is_err());
}

#[tokio::test]
async fn listeners_that_cannot_be_served_safely_are_refused() {
    let mut c = config(8);
    c.listen = "0.0.0.0:0".into();
    let e = cgx_service::server::start(&c, router(), vec![])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("loopback"), "{e}");
    c.insecure_dev = false;
    let e = cgx_service::server::start(&c, router(), vec![])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("no tls"), "{e}");
    let mut c = config(0);
    c.listen = "127.0.0.1:0".into();
    let e = cgx_service::server::start(&c, router(), vec![])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("max_connections"), "{e}");
}

/// Whole requests: answer `req` on a fresh connection (status line and body).
fn exchange(addr: SocketAddr, req: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_a_routes_limit_are_refused_before_its_handler() {
    let running = cgx_service::server::start(&config(8), router(), vec![])
        .await
        .unwrap();
    let addr = running.addr();
    let (declared, chunked, fits) = tokio::task::spawn_blocking(move || {
        // Declared too large: refused without reading a byte of it.
        let declared = exchange(
            addr,
            "POST /small HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 1000000\r\n\r\n",
        );
        // Chunked, growing past the limit while it is read.
        let chunked = exchange(
            addr,
            "POST /small HTTP/1.1\r\nhost: x\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n20\r\n0123456789abcdef0123456789abcdef\r\n0\r\n\r\n",
        );
        let fits = exchange(
            addr,
            "POST /small HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 5\r\n\r\nhello",
        );
        (declared, chunked, fits)
    })
    .await
    .unwrap();
    assert!(declared.starts_with("HTTP/1.1 413"), "{declared}");
    assert!(declared.contains("application/problem+json"), "{declared}");
    assert!(declared.contains("PayloadTooLarge"), "{declared}");
    assert!(chunked.starts_with("HTTP/1.1 413"), "{chunked}");
    assert!(
        fits.starts_with("HTTP/1.1 200") && fits.ends_with('5'),
        "{fits}"
    );
    running.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_in_flight_limit_the_server_sheds_with_503_and_retry_after() {
    let mut c = config(8);
    c.max_in_flight = 1;
    let running = cgx_service::server::start(&c, router(), vec![])
        .await
        .unwrap();
    let addr = running.addr();
    let (slow, shed) = tokio::task::spawn_blocking(move || {
        let slow = std::thread::spawn(move || {
            exchange(
                addr,
                "GET /slow HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
            )
        });
        std::thread::sleep(Duration::from_millis(100));
        let shed = exchange(
            addr,
            "GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        );
        (slow.join().unwrap(), shed)
    })
    .await
    .unwrap();
    assert!(slow.starts_with("HTTP/1.1 200"), "{slow}");
    assert!(shed.starts_with("HTTP/1.1 503"), "{shed}");
    assert!(
        shed.to_ascii_lowercase().contains("retry-after: 1"),
        "{shed}"
    );
    assert!(shed.contains("Overloaded"), "{shed}");
    running.shutdown().await;
}

/// Thread-per-core serving: every serving thread accepts on its own socket bound to the one
/// port (port 0 resolved once), each connection is served whole on the thread that accepted it,
/// the kernel spreads connections over the threads, and shutdown stops every one of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_serving_thread_accepts_on_the_one_port_and_all_stop_at_shutdown() {
    let mut c = config(64);
    c.serving_threads = 3;
    let thread_name = || std::thread::current().name().unwrap_or("?").to_string();
    let router = Router::new().route(
        "/thread",
        get(move || async move {
            // The name before and after an await: the connection's work stays on one thread.
            let before = thread_name();
            tokio::task::yield_now().await;
            format!("{before} {}", thread_name())
        }),
    );
    let running = cgx_service::server::start(&c, router, vec![])
        .await
        .unwrap();
    let addr = running.addr();
    assert_ne!(addr.port(), 0);
    let answers = tokio::task::spawn_blocking(move || {
        (0..40)
            .map(|_| {
                exchange(
                    addr,
                    "GET /thread HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
                )
            })
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let mut threads = std::collections::BTreeSet::new();
    for a in &answers {
        assert!(a.starts_with("HTTP/1.1 200"), "{a}");
        let body = a.rsplit("\r\n\r\n").next().unwrap();
        let (before, after) = body.split_once(' ').unwrap();
        assert!(
            before.starts_with(&format!("{}-", cgx_service::server::SERVING_THREAD)),
            "{body}"
        );
        assert_eq!(before, after, "a connection's work moved between threads");
        threads.insert(before.to_string());
    }
    // 40 connections from distinct source ports on 3 sockets: all on one is (1/3)^39.
    assert!(threads.len() >= 2, "{threads:?}");
    running.shutdown().await;
    // Every listening socket is closed: nothing accepts on the port any more.
    let refused = tokio::task::spawn_blocking(move || {
        (0..10).all(|_| get_status(addr, "/thread", Duration::from_secs(2)).is_err())
    })
    .await
    .unwrap();
    assert!(refused, "a serving thread still accepts after shutdown");
}

/// With several serving threads, the connection cap still frees for an honest client whatever
/// socket the kernel hands it to (a slot is taken after accepting, not before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_cap_holds_across_serving_threads_and_frees_itself() {
    let mut c = config(1);
    c.serving_threads = 3;
    let running = cgx_service::server::start(&c, router(), vec![])
        .await
        .unwrap();
    let addr = running.addr();
    let answers = tokio::task::spawn_blocking(move || {
        // The one slot goes to a client that starts a request and says no more (its header
        // timeout frees it). It sends a byte, or deferred accept would keep it in the kernel.
        let mut stalled = TcpStream::connect(addr).unwrap();
        stalled.write_all(b"GET").unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let started = Instant::now();
        let answers: Vec<_> = (0..6)
            .map(|_| get_status(addr, "/healthz", Duration::from_secs(5)))
            .collect();
        (answers, started.elapsed())
    })
    .await
    .unwrap();
    for a in &answers.0 {
        assert_eq!(a.as_deref().ok(), Some("HTTP/1.1 200 OK"), "{answers:?}");
    }
    assert!(answers.1 < Duration::from_secs(4), "{answers:?}");
    assert!(
        answers.1 >= Duration::from_millis(500),
        "the cap held: {answers:?}"
    );
    running.shutdown().await;
}

/// Several serving threads share a port through SO_REUSEPORT, but never someone else's: a port
/// another socket or another server holds is refused as a plain bind refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_someone_holds_is_refused_not_shared() {
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut c = config(8);
    c.listen = holder.local_addr().unwrap().to_string();
    c.serving_threads = 2;
    let e = cgx_service::server::start(&c, router(), vec![])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("in use"), "{e}");
    drop(holder);
    // A second instance of a thread-per-core server on the first one's port.
    let mut first = config(8);
    first.serving_threads = 2;
    let running = cgx_service::server::start(&first, router(), vec![])
        .await
        .unwrap();
    let mut second = config(8);
    second.listen = running.addr().to_string();
    second.serving_threads = 2;
    let e = cgx_service::server::start(&second, router(), vec![])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("in use"), "{e}");
    running.shutdown().await;
}

/// A connection from `from` (a loopback address other than 127.0.0.1 stands for another
/// client: Linux routes all of 127/8 to loopback).
fn connect_from(from: &str, addr: SocketAddr) -> TcpStream {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    let local: SocketAddr = format!("{from}:0").parse().unwrap();
    s.bind(&local.into()).unwrap();
    s.connect(&addr.into()).unwrap();
    s.into()
}

/// Whatever `s` receives within `limit` (until it closes, or the time is up).
fn read_for(s: &mut TcpStream, limit: Duration) -> std::io::Result<String> {
    s.set_read_timeout(Some(limit))?;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if out.is_empty() => return Err(e),
            Err(_) => break,
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Has the server closed `s` within `limit` (end of stream or a reset, not a timeout)?
fn closed_within(s: &TcpStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 64];
    let mut r = s;
    match r.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

/// Issue 28: sockets that send one byte of a TLS ClientHello (enough to pass deferred accept)
/// and stall held their connection slots for ever, since nothing bounded the handshake. Now
/// the handshake has the header timeout: the stalled sockets are closed and an honest TLS
/// client is served once it passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_tls_handshakes_lose_their_slots_to_the_header_timeout() {
    use rustls_pki_types::pem::PemObject;
    let (cert, key) = cgx_service::tls::self_signed(&["localhost"]).unwrap();
    let dir = std::env::temp_dir().join(format!("cgx-service-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("c.pem"), &cert).unwrap();
    std::fs::write(dir.join("k.pem"), &key).unwrap();
    let mut c = config(3);
    c.insecure_dev = false;
    c.tls = Some(cgx_service::tls::TlsFiles {
        cert: dir.join("c.pem"),
        key: dir.join("k.pem"),
    });
    let running = cgx_service::server::start(&c, router(), vec![])
        .await
        .unwrap();
    let addr = running.addr();
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls_pki_types::CertificateDer::from_pem_slice(cert.as_bytes()).unwrap())
        .unwrap();
    let client = Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth(),
    );
    let (stalled, honest) = tokio::task::spawn_blocking(move || {
        // Every slot: a TLS record's first byte (handshake, 0x16), then nothing.
        let stalled: Vec<TcpStream> = (0..3)
            .map(|_| {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(&[0x16]).unwrap();
                s
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        let tcp = TcpStream::connect(addr).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let conn = rustls::ClientConnection::new(client, "localhost".try_into().unwrap()).unwrap();
        let mut tls = rustls::StreamOwned::new(conn, tcp);
        let answer = tls
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .and_then(|()| {
                let mut out = Vec::new();
                let mut buf = [0u8; 1024];
                loop {
                    match tls.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => out.extend_from_slice(&buf[..n]),
                        // No close_notify after the answer is no matter here.
                        Err(_) if !out.is_empty() => break,
                        Err(e) => return Err(e),
                    }
                }
                Ok(String::from_utf8_lossy(&out).into_owned())
            });
        let honest = (answer, started.elapsed());
        // The stalled sockets were closed by the server, not left open.
        let closed = stalled
            .iter()
            .filter(|s| closed_within(s, Duration::from_secs(3)))
            .count();
        (closed, honest)
    })
    .await
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let (answer, waited) = honest;
    let answer = answer.unwrap_or_else(|e| panic!("the honest client was not served: {e}"));
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // It waited for the stalled handshakes' timeout (the cap held), and no longer.
    assert!(waited >= Duration::from_millis(500), "{waited:?}");
    assert!(waited < Duration::from_secs(3), "{waited:?}");
    assert_eq!(stalled, 3, "stalled handshakes still open");
    running.shutdown().await;
}

/// Issue 28: one address cannot hold every connection slot. The attacker (127.0.0.1) opens
/// more connections than its share, each with a request begun and stalled; those over its
/// share are closed at once, those within hold their slots until the header timeout, and
/// an honest client (127.0.0.2) is served meanwhile without waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_hold_every_connection_slot() {
    let mut c = config(6);
    c.max_connections_per_client = 3;
    c.header_timeout = Duration::from_secs(4);
    let running = cgx_service::server::start(&c, router(), vec![])
        .await
        .unwrap();
    let addr = running.addr();
    let (closed_at_once, held, honest, waited) = tokio::task::spawn_blocking(move || {
        let attacker: Vec<TcpStream> = (0..8)
            .map(|_| {
                let mut s = connect_from("127.0.0.1", addr);
                s.write_all(b"GET").unwrap();
                s
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let mut closed_at_once = 0;
        let mut open = Vec::new();
        for s in &attacker {
            if closed_within(s, Duration::from_millis(300)) {
                closed_at_once += 1;
            } else {
                open.push(s);
            }
        }
        let started = Instant::now();
        let mut h = connect_from("127.0.0.2", addr);
        h.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .unwrap();
        let honest = read_for(&mut h, Duration::from_secs(6)).unwrap_or_default();
        let waited = started.elapsed();
        // The attacker's connections within its share are still open (their slots held).
        let held = open
            .into_iter()
            .filter(|s| !closed_within(s, Duration::from_millis(50)))
            .count();
        (closed_at_once, held, honest, waited)
    })
    .await
    .unwrap();
    assert_eq!(
        closed_at_once, 5,
        "connections over the share are closed at once"
    );
    assert_eq!(held, 3, "the attacker holds its whole share");
    assert!(honest.starts_with("HTTP/1.1 200"), "{honest}");
    // Served at once, not after the attacker's header timeout (4 s).
    assert!(waited < Duration::from_millis(1500), "{waited:?}");
    running.shutdown().await;
}

/// Issue 28: trickled bodies hold in-flight slots until the request timeout; one address
/// holds at most its share of them. Past it its requests are answered 429 with `Retry-After`
/// at once, and another client is served although the attacker holds all it may.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trickled_bodies_hold_at_most_one_clients_share_of_requests_in_flight() {
    let mut c = config(16);
    c.max_in_flight = 3;
    c.max_in_flight_per_client = 2;
    c.request_timeout = Duration::from_secs(3);
    c.header_timeout = Duration::from_secs(3);
    let running = cgx_service::server::start(&c, router(), vec![])
        .await
        .unwrap();
    let addr = running.addr();
    let (answers, honest, late) = tokio::task::spawn_blocking(move || {
        let mut attacker: Vec<TcpStream> = (0..4)
            .map(|_| {
                let mut s = connect_from("127.0.0.1", addr);
                s.write_all(
                    b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n0123456789",
                )
                .unwrap();
                s
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let answers: Vec<String> = attacker
            .iter_mut()
            .map(|s| read_for(s, Duration::from_millis(400)).unwrap_or_default())
            .collect();
        let mut h = connect_from("127.0.0.2", addr);
        h.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .unwrap();
        let honest = read_for(&mut h, Duration::from_secs(2)).unwrap_or_default();
        // The two held requests end with the request timeout (408), as before.
        let late: Vec<String> = attacker
            .iter_mut()
            .zip(&answers)
            .filter(|(_, a)| a.is_empty())
            .map(|(s, _)| read_for(s, Duration::from_secs(5)).unwrap_or_default())
            .collect();
        (answers, honest, late)
    })
    .await
    .unwrap();
    let refused: Vec<&String> = answers.iter().filter(|a| !a.is_empty()).collect();
    assert_eq!(refused.len(), 2, "{answers:?}");
    for a in refused {
        assert!(a.starts_with("HTTP/1.1 429"), "{a}");
        assert!(a.to_ascii_lowercase().contains("retry-after: 1"), "{a}");
        assert!(a.contains("TooManyRequests"), "{a}");
    }
    assert!(honest.starts_with("HTTP/1.1 200"), "{honest}");
    assert_eq!(late.len(), 2);
    for a in &late {
        assert!(a.starts_with("HTTP/1.1 408"), "{a}");
    }
    running.shutdown().await;
}

#[tokio::test]
async fn per_client_caps_must_be_positive() {
    for (conns, in_flight) in [(0, 1), (1, 0)] {
        let mut c = config(8);
        c.max_connections_per_client = conns;
        c.max_in_flight_per_client = in_flight;
        let e = cgx_service::server::start(&c, router(), vec![])
            .await
            .unwrap_err();
        assert!(e.to_string().contains("per_client"), "{e}");
    }
}

/// A client that stops reading its response (its receive window closes) loses its connection
/// once the server's writes make no progress for the header timeout: it cannot hold a slot by
/// asking for a large answer and never reading it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_its_response_loses_its_slot() {
    let running = cgx_service::server::start(&config(1), router(), vec![])
        .await
        .unwrap();
    let addr = running.addr();
    let (status, waited) = tokio::task::spawn_blocking(move || {
        let mut hog = TcpStream::connect(addr).unwrap();
        write!(hog, "GET /big HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
        // Never read: the server's writes fill both socket buffers and stall.
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        let status = get_status(addr, "/healthz", Duration::from_secs(10));
        (status, t.elapsed())
    })
    .await
    .unwrap();
    assert_eq!(status.unwrap(), "HTTP/1.1 200 OK");
    assert!(waited < Duration::from_secs(5), "{waited:?}");
    running.shutdown().await;
}
