//! The listener every service runs: bind, TLS (rustls) or plain HTTP on loopback, a cap on open
//! connections and one per client (an IPv4 address, an IPv6 /64; `limits::Clients`), a TLS
//! handshake and then a request head each bounded by the header timeout, HTTP/1.1, background
//! tasks tied to the server's life, and a graceful drain at shutdown (SIGINT/SIGTERM or
//! [`Running::shutdown`]).
//!
//! Connections are served on the caller's runtime, or thread-per-core
//! ([`ListenerConfig::serving_threads`], Linux): each serving thread runs a single-threaded
//! runtime and accepts on a listening socket of its own, bound to the same address with
//! `SO_REUSEPORT`, so the kernel hands each new connection to one thread and that thread serves
//! it from accept to close. A work-stealing runtime woke a second worker for most connections (a
//! CoCo client's flow ran on 7.7 thread wake-ups instead of 6.3, and a wake-up costs tens of µs
//! on a VM's idle CPU); there no connection's work moves between threads. Before it binds the
//! group, the server binds the address once without `SO_REUSEPORT`, so a port another process
//! holds is refused as before instead of shared. Background tasks run on the caller's runtime.
//! I/O a serving thread's runtime registers (a PostgreSQL connection a request opened) is
//! driven by that thread: services whose database is reached over the network serve on the
//! caller's runtime.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::ServiceError;
use crate::tls::{TlsFiles, server_config};

/// Where and how a service listens.
#[derive(Debug, Clone)]
pub struct ListenerConfig {
    /// `host:port`; port 0 picks one (tests).
    pub listen: String,
    pub tls: Option<TlsFiles>,
    /// Plain HTTP instead of TLS: refused unless `listen` is a loopback address.
    pub insecure_dev: bool,
    /// Connections served at once; further ones wait in the kernel's accept backlog.
    pub max_connections: usize,
    /// Connections one client (an IPv4 address, an IPv6 /64) may hold open at once; a further
    /// one is closed as soon as it is accepted, before it takes one of `max_connections`.
    /// Behind a load balancer or proxy that hides client addresses, every request comes from
    /// its address: raise this to `max_connections` there.
    pub max_connections_per_client: usize,
    /// How long a client has to finish the TLS handshake, and then to send a request's head.
    pub header_timeout: Duration,
    /// How long one request may take, its body included (answered 408 past it): a client that
    /// trickles a body cannot hold a connection slot for longer.
    pub request_timeout: Duration,
    /// How long open requests may take to finish at shutdown.
    pub drain: Duration,
    /// Requests handled at once; past it, requests are answered 503 with `Retry-After`
    /// instead of queueing (memory stays bounded under overload).
    pub max_in_flight: usize,
    /// Requests one client may have in flight at once (over all its connections); past it,
    /// 429 with `Retry-After`. As `max_connections_per_client` behind a load balancer.
    pub max_in_flight_per_client: usize,
    /// Serving threads, each with its own runtime and socket (see the module's doc; Linux
    /// only, elsewhere one); 0: serve on the caller's runtime.
    pub serving_threads: usize,
}

impl ListenerConfig {
    /// Defaults for the limits: 4 096 connections (64 per client), 1 024 requests in flight (32
    /// per client), 30 s for the TLS handshake and for a request's head, 120 s for a whole
    /// request, 10 s to drain. One address holds at most 1/64 of the connections and 1/32 of
    /// the requests: an attacker needs that many addresses (IPv6: that many /64s) to fill them.
    pub fn new(listen: impl Into<String>, tls: Option<TlsFiles>, insecure_dev: bool) -> Self {
        ListenerConfig {
            listen: listen.into(),
            tls,
            insecure_dev,
            max_connections: 4096,
            max_connections_per_client: DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
            header_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(120),
            drain: Duration::from_secs(10),
            max_in_flight: 1024,
            max_in_flight_per_client: DEFAULT_MAX_IN_FLIGHT_PER_CLIENT,
            serving_threads: 0,
        }
    }

    /// Refuse what cannot be served safely: TLS and plain HTTP at once, neither, or plain HTTP
    /// off loopback.
    pub fn check(&self) -> Result<SocketAddr, ServiceError> {
        let addr: SocketAddr = self
            .listen
            .parse()
            .map_err(|e| ServiceError::Config(format!("listen '{}': {e}", self.listen)))?;
        match (&self.tls, self.insecure_dev) {
            (Some(_), true) => Err(ServiceError::Config(
                "tls and insecure_dev are exclusive".into(),
            )),
            (None, false) => Err(ServiceError::Config(
                "no tls: configure tls, or insecure_dev for plain HTTP on loopback".into(),
            )),
            (None, true) if !addr.ip().is_loopback() => Err(ServiceError::Config(format!(
                "insecure_dev serves plain HTTP on loopback only, not {addr}"
            ))),
            _ if self.max_connections == 0 => Err(ServiceError::Config(
                "max_connections must be positive".into(),
            )),
            _ if self.max_connections_per_client == 0 || self.max_in_flight_per_client == 0 => {
                Err(ServiceError::Config(
                    "max_connections_per_client and max_in_flight_per_client must be positive"
                        .into(),
                ))
            }
            _ => Ok(addr),
        }
    }
}

/// Connections one client may hold open by default ([`ListenerConfig::max_connections_per_client`]).
pub const DEFAULT_MAX_CONNECTIONS_PER_CLIENT: usize = 64;

/// Requests one client may have in flight by default
/// ([`ListenerConfig::max_in_flight_per_client`]).
pub const DEFAULT_MAX_IN_FLIGHT_PER_CLIENT: usize = 32;

/// A task that lives as long as the server (housekeeping); aborted at shutdown, before the drain.
pub type Background = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A running server.
#[derive(Debug)]
pub struct Running {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    /// One per serving thread: closed when its accept loop has drained and returned.
    done: Vec<tokio::sync::oneshot::Receiver<()>>,
    background: Vec<tokio::task::JoinHandle<()>>,
}

impl Running {
    /// The bound address (the port chosen when `listen` asked for 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stop accepting, stop background tasks, let open requests finish (up to the drain time).
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        for b in &self.background {
            b.abort();
        }
        for d in self.done.drain(..) {
            let _ = d.await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // Dropping the stop sender ends the accept loops too; the housekeeping goes with them.
        for b in &self.background {
            b.abort();
        }
    }
}

/// Bind `config.listen` and serve `router` until [`Running::shutdown`].
pub async fn start(
    config: &ListenerConfig,
    router: Router,
    background: Vec<Background>,
) -> Result<Running, ServiceError> {
    config.check()?;
    let tls = config.tls.as_ref().map(server_config).transpose()?;
    // SO_REUSEPORT spreads connections over a group's sockets on Linux only.
    let threads = if cfg!(target_os = "linux") {
        config.serving_threads
    } else {
        config.serving_threads.min(1)
    };
    let listeners = bind(&config.listen, threads.max(1))?;
    let addr = listeners
        .first()
        .and_then(|l| l.local_addr().ok())
        .ok_or_else(|| ServiceError::Bind {
            addr: config.listen.clone(),
            detail: "no listening socket".into(),
        })?;
    let slots = Arc::new(tokio::sync::Semaphore::new(config.max_in_flight.max(1)));
    // One layer for both.
    let router = router.layer(crate::limits::AdmitLayer {
        slots,
        timeout: config.request_timeout,
    });
    let shared = Arc::new(Shared {
        acceptor: tls.map(|c| tokio_rustls::TlsAcceptor::from(Arc::new(c))),
        router,
        connections: Arc::new(tokio::sync::Semaphore::new(config.max_connections)),
        clients: crate::limits::Clients::new(
            config.max_connections_per_client,
            config.max_in_flight_per_client,
        ),
        config: config.clone(),
    });
    // A start that fails below drops `stop`: the threads already started end with it.
    let (stop, stopped) = watch::channel(false);
    let mut done = Vec::with_capacity(listeners.len());
    for (i, listener) in listeners.into_iter().enumerate() {
        let (finished, finished_rx) = tokio::sync::oneshot::channel();
        let (shared, stopped) = (shared.clone(), stopped.clone());
        done.push(finished_rx);
        if threads == 0 {
            tokio::spawn(async move {
                accept_loop(listener, &shared, stopped).await;
                let _ = finished.send(());
            });
            continue;
        }
        let fail = |detail: String| ServiceError::Bind {
            addr: addr.to_string(),
            detail,
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| fail(format!("serving runtime: {e}")))?;
        std::thread::Builder::new()
            .name(format!("{SERVING_THREAD}-{i}"))
            .spawn(move || {
                runtime.block_on(accept_loop(listener, &shared, stopped));
                // Tasks still on this runtime (a blocking appraisal) get the drain time too;
                // `shutdown` returns once they are gone.
                runtime.shutdown_timeout(shared.config.drain);
                let _ = finished.send(());
            })
            .map_err(|e| fail(format!("serving thread: {e}")))?;
    }
    // Housekeeping starts once the server has: a failed start leaves none running.
    let background = background.into_iter().map(tokio::spawn).collect();
    tracing::info!(%addr, tls = config.tls.is_some(), threads, "listening");
    Ok(Running {
        addr,
        stop,
        done,
        background,
    })
}

/// `count` listening sockets on one address (the first one's port when `listen` asks for port
/// 0), non-blocking; with `SO_REUSEPORT` where there is more than one.
fn bind(listen: &str, count: usize) -> Result<Vec<std::net::TcpListener>, ServiceError> {
    use socket2::{Domain, Protocol, Socket, Type};
    let fail = |detail: String| ServiceError::Bind {
        addr: listen.to_string(),
        detail,
    };
    let mut addr: SocketAddr = listen.parse().map_err(|e| fail(format!("{e}")))?;
    let domain = Domain::for_address(addr);
    let socket = |reuse_port: bool| -> Result<Socket, ServiceError> {
        let s = Socket::new(domain, Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| fail(e.to_string()))?;
        // As tokio's `TcpListener::bind`: a restarted server rebinds despite TIME_WAIT.
        s.set_reuse_address(true).map_err(|e| fail(e.to_string()))?;
        #[cfg(target_os = "linux")]
        if reuse_port {
            s.set_reuse_port(true)
                .map_err(|e| fail(format!("SO_REUSEPORT: {e}")))?;
        }
        #[cfg(not(target_os = "linux"))]
        let _ = reuse_port;
        Ok(s)
    };
    let group = count > 1;
    if group && addr.port() != 0 {
        // Refuse a port someone holds (another instance, with or without SO_REUSEPORT) as a
        // plain bind would, rather than join its group and take half its connections. (For
        // port 0 the kernel picks a port no socket holds, SO_REUSEPORT or not.)
        socket(false)?
            .bind(&addr.into())
            .map_err(|e| fail(e.to_string()))?;
    }
    let mut out = Vec::with_capacity(count);
    for _ in 0..count.max(1) {
        let s = socket(group)?;
        s.bind(&addr.into()).map_err(|e| fail(e.to_string()))?;
        // An optimisation: a kernel or sandbox without it serves as before.
        #[cfg(target_os = "linux")]
        if let Err(e) = defer_accept(&s) {
            tracing::warn!(error = %e, "TCP_DEFER_ACCEPT not set; connections wake twice");
        }
        s.listen(1024).map_err(|e| fail(e.to_string()))?;
        s.set_nonblocking(true).map_err(|e| fail(e.to_string()))?;
        let listener = std::net::TcpListener::from(s);
        // The others join the port the first one got.
        addr = listener.local_addr().map_err(|e| fail(e.to_string()))?;
        out.push(listener);
    }
    Ok(out)
}

/// The name of each serving thread, `-` and its number after it (benchmarks count their CPU
/// by name).
pub const SERVING_THREAD: &str = "cgx-serve";

/// How long the kernel holds a connection that has sent nothing before handing it over anyway
/// (then the header timeout applies as to any slow client).
#[cfg(target_os = "linux")]
const DEFER_ACCEPT_SECS: libc::c_int = 3;

/// `TCP_DEFER_ACCEPT` on a listening socket: a connection is handed to `accept` once its first
/// bytes have arrived (HTTP and TLS clients speak first), so a serving thread wakes once per
/// new connection, to accept and read together, instead of twice. Each wake-up after idle costs
/// this machine tens of microseconds; a CoCo flow's five or six are most of its CPU (issue 15).
/// A connection that sends nothing stays in the kernel's queue, not in a connection slot,
/// until the deferral ends (then the kernel hands it over and the header timeout applies).
///
/// The one `unsafe` in the workspace: socket2 does not expose the option, and std's
/// `TcpStreamExt::set_deferaccept` is unstable (rust-lang/rust#119639).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn defer_accept(socket: &socket2::Socket) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let secs = DEFER_ACCEPT_SECS;
    // SAFETY: `fd` is open for the whole call (`socket` is borrowed); the option value is a
    // `c_int` on the stack, and its exact size is passed, as tcp(7) specifies for this option.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            std::ptr::from_ref(&secs).cast::<libc::c_void>(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// What every serving thread shares.
struct Shared {
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    router: Router,
    /// The cap on open connections, over all threads.
    connections: Arc<tokio::sync::Semaphore>,
    /// Connections and requests per client, over all threads.
    clients: Arc<crate::limits::Clients>,
    config: ListenerConfig,
}

async fn accept_loop(
    listener: std::net::TcpListener,
    shared: &Shared,
    mut stopped: watch::Receiver<bool>,
) {
    let listener = match TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "serving thread could not register its listener");
            return;
        }
    };
    // A dropped sender (the `Running` dropped) stops the loop as `shutdown` does.
    let stop = async move {
        while !*stopped.borrow_and_update() {
            if stopped.changed().await.is_err() {
                break;
            }
        }
    };
    tokio::pin!(stop);
    let graceful = GracefulShutdown::new();
    let _anchor = AbortOnDrop(tokio::spawn(timer_anchor(shared.config.header_timeout)));
    loop {
        let conn = tokio::select! {
            c = listener.accept() => c,
            _ = &mut stop => break,
        };
        let (stream, peer) = match conn {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors (or another accept error): the listener stays readable,
                // so retrying at once would spin; wait a little for connections to close.
                tracing::warn!(error = %e, "accept failed; retrying in 100 ms");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(100)) => continue,
                    _ = &mut stop => break,
                }
            }
        };
        // Past its client's cap a connection is closed at once, before it can wait for (or
        // take) a server-wide slot: one address cannot hold them all.
        let Some(client) = shared.clients.connect(peer.ip()) else {
            tracing::debug!(%peer, "connection over the per-client cap; closed");
            drop(stream);
            continue;
        };
        // A slot before serving. At the cap each accept loop holds the one connection it took
        // and accepts no more, so the rest wait in the kernel's backlog. (Taking the slot before
        // accepting would strand slots on threads the kernel sends no connection to.)
        let permit = tokio::select! {
            p = shared.connections.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            _ = &mut stop => break,
        };
        let _ = stream.set_nodelay(true);
        // The client's in-flight cap, then who is calling for handlers
        // (`ConnectInfo<SocketAddr>`: per-client budgets), then the router.
        let svc = TowerToHyperService::new(crate::limits::PerClient {
            inner: shared.router.clone(),
            peer,
            client: client.client(),
        });
        let watcher = graceful.watcher();
        let acceptor = shared.acceptor.clone();
        let header_timeout = shared.config.header_timeout;
        tokio::spawn(async move {
            let _permit = permit;
            let _client = client;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            // A response the client does not read (a zero receive window) would hold the
            // connection for ever: no timer covers a write. Writes that make no progress for
            // the header timeout close it.
            let stream = StallGuard::new(stream, header_timeout);
            match acceptor {
                Some(a) => {
                    // The handshake has the header timeout too: hyper's timer starts only once
                    // there is a stream to read a head from, and a client that sends one byte
                    // (past deferred accept) and stalls would otherwise hold its slots for ever.
                    let Ok(Ok(s)) = tokio::time::timeout(header_timeout, a.accept(stream)).await
                    else {
                        return;
                    };
                    let _ = watcher
                        .watch(builder.serve_connection(TokioIo::new(s), svc))
                        .await;
                }
                None => {
                    let _ = watcher
                        .watch(builder.serve_connection(TokioIo::new(stream), svc))
                        .await;
                }
            }
        });
    }
    drop(listener);
    let drain = shared.config.drain;
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(drain) => {
            tracing::warn!(?drain, "connections still open after the drain time; closing");
        }
    }
}

/// A stream whose writes must make progress: a write (or flush) that stays pending for
/// `limit` fails with `TimedOut`, and the connection closes. Reads are bounded elsewhere
/// (the header timeout, the request timeout); nothing else bounds a client that stops reading
/// its responses. The timer exists only while a write is pending.
struct StallGuard<S> {
    inner: S,
    limit: Duration,
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> StallGuard<S> {
    fn new(inner: S, limit: Duration) -> Self {
        StallGuard {
            inner,
            limit,
            stalled: None,
        }
    }

    /// `poll` (a write or flush) answered: a pending one arms the timer (once), past which it
    /// fails; progress disarms it.
    fn guard<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        poll: std::task::Poll<std::io::Result<T>>,
    ) -> std::task::Poll<std::io::Result<T>> {
        use std::task::Poll;
        match poll {
            Poll::Pending => {
                let limit = self.limit;
                let timer = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the client read nothing of its response for the header timeout",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for StallGuard<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for StallGuard<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.guard(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.guard(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.guard(cx, poll)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.guard(cx, poll)
    }
}

/// A task that ends when this is dropped, however its owner ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A timer that is always set, sooner than any connection's header-read timer.
///
/// tokio's timer wakes its event loop (a write to its eventfd, then one more turn of the loop)
/// whenever a timer is set earlier than every timer it already holds. With none set, that is
/// every new connection's first header-read timer: about 1% of a CoCo flow's server CPU.
/// With this one always due within half a header timeout, a connection's timer is never the
/// earliest, and the loop is woken once per period instead of once per connection.
async fn timer_anchor(header_timeout: Duration) {
    let period = (header_timeout / 2).max(Duration::from_millis(100));
    loop {
        tokio::time::sleep(period).await;
    }
}

/// Serve until SIGINT or SIGTERM, as every `cgx … serve` does. The signal handlers are
/// installed first; then `run` starts the service with a shutdown future and an `on_listen`
/// that prints "`name` listening on http(s)://ADDR" on stdout (callers and tests wait for that
/// line, after which a signal drains the service rather than killing it). A failure to install
/// the handlers is reported on stderr and stops the service the same way.
pub async fn serve_until_signal<E, F, Fut>(name: &str, tls: bool, run: F) -> Result<(), E>
where
    F: FnOnce(Pin<Box<dyn Future<Output = ()> + Send>>, Box<dyn FnOnce(SocketAddr) + Send>) -> Fut,
    Fut: Future<Output = Result<(), E>>,
{
    let signals = shutdown_signals();
    let who = name.to_string();
    let shutdown = Box::pin(async move {
        if let Err(e) = signals.await {
            eprintln!("{who}: {e}; stopping");
        }
    });
    let scheme = if tls { "https" } else { "http" };
    let who = name.to_string();
    let on_listen = Box::new(move |addr: SocketAddr| {
        use std::io::Write;
        println!("{who} listening on {scheme}://{addr}");
        let _ = std::io::stdout().flush();
    });
    run(shutdown, on_listen).await
}

/// SIGINT or SIGTERM. The handlers are installed when this is called (inside the runtime),
/// not when the future is first polled: call it before announcing that the service listens,
/// or a signal sent right after the announcement would kill the process instead of draining it.
pub fn shutdown_signals() -> impl Future<Output = Result<(), ServiceError>> + Send {
    #[cfg(unix)]
    let installed = {
        use tokio::signal::unix::{SignalKind, signal};
        let install = |kind| signal(kind).map_err(|e| ServiceError::Signal(e.to_string()));
        install(SignalKind::terminate()).and_then(|t| Ok((t, install(SignalKind::interrupt())?)))
    };
    async move {
        #[cfg(unix)]
        {
            let (mut term, mut int) = installed?;
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
        Ok(())
    }
}
