//! Streams over one link (a virtio-serial port in the guest, QEMU's socket for it on the host).
//!
//! Each stream has two pumps (threads): its *source* (a TCP socket, a file) read into DATA
//! frames as far as the peer's credit allows, and its *sink* fed from one buffer the link's
//! reader appends to, crediting the peer back as it consumes. The link's reader ([`Mux::run`])
//! never blocks on a stream's endpoint, so a slow or stuck stream stalls no other; what a peer
//! may make this side hold is bounded: at most [`WINDOW`] bytes per stream (however it splits
//! them into frames), [`MAX_STREAMS`] streams, one FIN each. A peer that sends past its window,
//! a second FIN or data after one, or anything [`crate::frame`] refuses, is answered by ending
//! that stream or the link.
//!
//! A stream leaves the table only when both its pumps are done, so the table's limit bounds
//! the threads and descriptors a peer can make this side hold. Ending a stream (a reset, the
//! link's end) shuts its TCP endpoint down, so no pump stays blocked on it. A broken link ends
//! every stream (their sinks are told why) and closes this side's copy of the link; whoever
//! owns the link makes a new [`Mux`] on the next one.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::frame::{Decoder, Frame, MAX_PAYLOAD, WINDOW};

/// The most streams a side opens at once on one link (a guest needs a few: pooled connections
/// to the broker and the KBS, a fetch or two; each stream costs the serving side three
/// threads).
pub const MAX_STREAMS: usize = 64;
/// The most streams the serving side holds: twice what the opener may have open, since the
/// opener forgets a stream (both FINs seen) before the server's pumps have finished with it.
pub const MAX_SERVED: usize = 2 * MAX_STREAMS;
/// What one DATA frame from a source carries at most.
const CHUNK: usize = 64 * 1024;
const _: () = assert!(CHUNK <= MAX_PAYLOAD);

/// Unblocks whatever a stream's pumps wait on (shuts a TCP endpoint down).
pub type Aborter = Box<dyn Fn() + Send + Sync>;

/// Where a stream's incoming bytes go.
pub trait Sink: Send {
    /// Bytes that arrived, in order.
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()>;
    /// The stream ended: `Ok` at the peer's FIN, `Err(why)` when it was reset or the link broke.
    fn finish(&mut self, outcome: Result<(), String>);
    /// How to unblock this endpoint's pumps when the stream ends early (`None`: they never
    /// block on it for long).
    fn aborter(&self) -> Option<Aborter> {
        None
    }
}

impl Sink for TcpStream {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.write_all(bytes)
    }

    fn finish(&mut self, outcome: Result<(), String>) {
        // FIN is a half-close: the other direction may still be carrying an answer.
        let _ = self.shutdown(match outcome {
            Ok(()) => Shutdown::Write,
            Err(_) => Shutdown::Both,
        });
    }

    fn aborter(&self) -> Option<Aborter> {
        let c = self.try_clone().ok()?;
        Some(Box::new(move || {
            let _ = c.shutdown(Shutdown::Both);
        }))
    }
}

/// A sink that collects a whole (bounded) answer in memory: a provisioned file.
#[derive(Debug)]
pub struct Collect {
    limit: usize,
    buf: Vec<u8>,
    done: std::sync::mpsc::Sender<Result<Vec<u8>, String>>,
}

impl Sink for Collect {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if self.buf.len() + bytes.len() > self.limit {
            return Err(std::io::Error::other(format!(
                "over the {}-byte limit",
                self.limit
            )));
        }
        self.buf.extend_from_slice(bytes);
        Ok(())
    }

    fn finish(&mut self, outcome: Result<(), String>) {
        let _ = self
            .done
            .send(outcome.map(|()| std::mem::take(&mut self.buf)));
    }
}

/// How the serving side answers an OPEN: a source to send from (`None`: nothing to send) and
/// a sink for what arrives, or the reason it is refused (sent back in the RESET).
pub type Opened = Result<(Option<Box<dyn Read + Send>>, Box<dyn Sink>), String>;
/// The serving side's table of targets.
pub type Handler = Arc<dyn Fn(&str) -> Opened + Send + Sync>;

#[derive(Default)]
struct State {
    /// Bytes this side may still send.
    credit: u32,
    /// Bytes received and not yet credited back (in `pending` or being written).
    inflight: u32,
    /// Bytes received, not yet handed to the sink: one buffer, whatever the frames were.
    pending: Vec<u8>,
    /// The peer's FIN arrived.
    fin: bool,
    /// Ended by a reset (either side's) or the link's end, and why.
    reset: Option<String>,
    source_done: bool,
    sink_done: bool,
}

struct Stream {
    state: Mutex<State>,
    cv: Condvar,
    abort: Mutex<Option<Aborter>>,
}

impl Stream {
    fn new() -> Arc<Stream> {
        Arc::new(Stream {
            state: Mutex::new(State {
                credit: WINDOW,
                ..State::default()
            }),
            cv: Condvar::new(),
            abort: Mutex::new(None),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A pump that panicked leaves consistent counters (each update is one statement).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// End the stream (`true` if this call ended it, `false` if it had ended already).
    fn end(&self, why: &str) -> bool {
        let mut s = self.lock();
        let first = s.reset.is_none();
        if first {
            s.reset = Some(why.to_string());
        }
        drop(s);
        self.cv.notify_all();
        // A pump blocked on its endpoint (a read from a silent socket, a write to one that
        // does not read) returns.
        if let Some(abort) = self
            .abort
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            abort();
        }
        first
    }
}

struct Inner {
    /// The link's write half (`None` once the link ended: its descriptor is closed then).
    out: Mutex<Option<Box<dyn Write + Send>>>,
    /// Unblocks a write stuck on the link when it ends (a socket's shutdown), where there is one.
    shutdown: Mutex<Option<Aborter>>,
    streams: Mutex<HashMap<u32, Arc<Stream>>>,
    next: Mutex<u32>,
    alive: AtomicBool,
}

impl Inner {
    fn streams(&self) -> MutexGuard<'_, HashMap<u32, Arc<Stream>>> {
        self.streams.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One frame onto the link, whole (frames from many pumps never interleave).
    fn send(&self, f: &Frame) -> std::io::Result<()> {
        // DATA's payload is written as it is (after its header, under the same lock): the
        // bulk of the bytes is never copied into a frame buffer.
        let (head, payload): (Vec<u8>, &[u8]) = match f {
            Frame::Data { stream, bytes } if !bytes.is_empty() && bytes.len() <= MAX_PAYLOAD => {
                let len = bytes.len() as u32;
                (
                    crate::frame::header(*stream, crate::frame::Kind::Data, len).to_vec(),
                    bytes,
                )
            }
            f => {
                let mut v = Vec::with_capacity(64);
                f.encode(&mut v).map_err(|e| {
                    std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
                })?;
                (v, &[])
            }
        };
        let down = || std::io::Error::new(std::io::ErrorKind::NotConnected, "the channel is down");
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        // Nothing is written once the link ended (a pump that waited for the lock meanwhile).
        if !self.alive.load(Ordering::SeqCst) {
            *out = None;
            return Err(down());
        }
        let Some(w) = out.as_mut() else {
            return Err(down());
        };
        let r = w
            .write_all(&head)
            .and_then(|()| w.write_all(payload))
            .and_then(|()| w.flush());
        // A failed write may have left part of a frame on the link: nothing more goes after
        // it, and this side's copy of the link is closed.
        if r.is_err() || !self.alive.load(Ordering::SeqCst) {
            self.alive.store(false, Ordering::SeqCst);
            *out = None;
        }
        r
    }

    fn reset(&self, id: u32, s: &Stream, why: &str) {
        // Told to the peer once, by whichever caller ended the stream.
        if s.end(why) {
            let reason = truncate(why, crate::frame::MAX_REASON);
            let _ = self.send(&Frame::Reset {
                stream: id,
                reason: &reason,
            });
        }
    }

    /// Forget a stream once both its pumps are done (until then it counts against the
    /// table's limit), and only this stream: its id may have been reused meanwhile.
    fn retire(&self, id: u32, s: &Arc<Stream>) {
        let done = {
            let st = s.lock();
            st.source_done && st.sink_done
        };
        if done {
            self.forget(id, s);
        }
    }

    fn forget(&self, id: u32, s: &Arc<Stream>) {
        let mut streams = self.streams();
        if streams.get(&id).is_some_and(|cur| Arc::ptr_eq(cur, s)) {
            streams.remove(&id);
        }
    }
}

fn truncate(s: &str, max: usize) -> String {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// The streams of one link.
#[derive(Clone)]
pub struct Mux {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Mux {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mux")
            .field("alive", &self.is_alive())
            .field("streams", &self.inner.streams().len())
            .finish()
    }
}

impl Mux {
    /// A mux writing its frames to `out` (the link's write half).
    pub fn new(out: Box<dyn Write + Send>) -> Mux {
        Mux {
            inner: Arc::new(Inner {
                shutdown: Mutex::new(None),
                out: Mutex::new(Some(out)),
                streams: Mutex::new(HashMap::new()),
                next: Mutex::new(0),
                alive: AtomicBool::new(true),
            }),
        }
    }

    /// A mux on a socket link: its end shuts the socket down, so a write blocked on a peer
    /// that stopped reading returns (a file such as a virtio port has no such call: a write
    /// there waits for the host, which is what the guest would do anyway).
    pub fn on_socket(link: &std::os::unix::net::UnixStream) -> std::io::Result<Mux> {
        let m = Mux::new(Box::new(link.try_clone()?));
        let s = link.try_clone()?;
        *m.inner.shutdown.lock().unwrap_or_else(|p| p.into_inner()) = Some(Box::new(move || {
            let _ = s.shutdown(Shutdown::Both);
        }));
        Ok(m)
    }

    pub fn is_alive(&self) -> bool {
        self.inner.alive.load(Ordering::SeqCst)
    }

    /// Streams open now.
    pub fn streams(&self) -> usize {
        self.inner.streams().len()
    }

    /// Open a stream to `target` (the guest's side): `source`'s bytes go to the peer, the
    /// peer's to `sink`. The peer refuses with a RESET (the sink hears why).
    pub fn open(
        &self,
        target: &str,
        source: Option<Box<dyn Read + Send>>,
        sink: Box<dyn Sink>,
    ) -> std::io::Result<u32> {
        if !self.is_alive() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                "the channel is down",
            ));
        }
        let s = Stream::new();
        let id = {
            let mut streams = self.inner.streams();
            // Checked under the table's lock, which `close` takes to drain it: a stream is
            // never added to a table that was drained.
            if !self.is_alive() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::NotConnected,
                    "the channel is down",
                ));
            }
            if streams.len() >= MAX_STREAMS {
                return Err(std::io::Error::other(format!(
                    "{MAX_STREAMS} streams open on the channel already"
                )));
            }
            let mut next = self.inner.next.lock().unwrap_or_else(|p| p.into_inner());
            // Ids are never reused on a link while one is open (2³² opens wrap past 0).
            loop {
                *next = next.wrapping_add(1);
                if *next != 0 && !streams.contains_key(&*next) {
                    break;
                }
            }
            streams.insert(*next, s.clone());
            *next
        };
        if let Err(e) = self.inner.send(&Frame::Open { stream: id, target }) {
            self.inner.streams().remove(&id);
            return Err(e);
        }
        self.start(id, s, source, sink);
        Ok(id)
    }

    /// Fetch a provisioned file: open `target`, send nothing, collect up to `limit` bytes
    /// until the peer's FIN, within `timeout`.
    pub fn fetch(&self, target: &str, limit: usize, timeout: Duration) -> Result<Vec<u8>, String> {
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = Collect {
            limit,
            buf: Vec::new(),
            done: tx,
        };
        let id = self
            .open(target, None, Box::new(sink))
            .map_err(|e| format!("channel {target}: {e}"))?;
        match rx.recv_timeout(timeout) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(why)) => Err(format!("channel {target}: {why}")),
            Err(_) => {
                let why = format!("no answer within {} s", timeout.as_secs());
                self.reset(id, &why);
                Err(format!("channel {target}: {why}"))
            }
        }
    }

    /// End stream `id` (a caller that gave up on it), telling the peer why.
    pub fn reset(&self, id: u32, why: &str) {
        let s = self.inner.streams().get(&id).cloned();
        if let Some(s) = s {
            self.inner.reset(id, &s, why);
        }
    }

    fn start(
        &self,
        id: u32,
        s: Arc<Stream>,
        source: Option<Box<dyn Read + Send>>,
        sink: Box<dyn Sink>,
    ) {
        *s.abort.lock().unwrap_or_else(|p| p.into_inner()) = sink.aborter();
        // Ended before it started (the link broke while a handler connected): unblock now.
        let ended = s.lock().reset.clone();
        if let Some(why) = ended {
            s.end(&why);
        }
        let (inner, st) = (self.inner.clone(), s.clone());
        let sink_pump = std::thread::Builder::new()
            .name(format!("cgx-channel-{id}-in"))
            .spawn(move || pump_sink(&inner, id, &st, sink));
        let (inner, st) = (self.inner.clone(), s.clone());
        let source_pump = std::thread::Builder::new()
            .name(format!("cgx-channel-{id}-out"))
            .spawn(move || pump_source(&inner, id, &st, source));
        if sink_pump.is_err() || source_pump.is_err() {
            // A pump that never ran is done; the other sees the reset and ends.
            {
                let mut st = s.lock();
                st.sink_done |= sink_pump.is_err();
                st.source_done |= source_pump.is_err();
            }
            self.inner.reset(id, &s, "no thread for the stream");
            self.inner.retire(id, &s);
        }
    }

    /// Read the link until it ends, dispatching frames; `handler` serves the peer's OPENs
    /// (`None`: this side only opens, and an OPEN from the peer breaks the link). Returns why
    /// the link ended; every stream has ended by then.
    pub fn run(&self, mut link: impl Read, handler: Option<Handler>) -> String {
        let mut decoder = Decoder::new();
        let mut buf = vec![0u8; MAX_PAYLOAD + crate::frame::HEADER];
        let why = 'link: loop {
            let n = match link.read(&mut buf) {
                Ok(0) => break 'link "the link closed".to_string(),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => break 'link format!("reading the link: {e}"),
            };
            decoder.feed(&buf[..n]);
            loop {
                match decoder.next_frame() {
                    Ok(None) => break,
                    Ok(Some(f)) => {
                        if let Err(why) = self.dispatch(f, handler.as_ref()) {
                            break 'link why;
                        }
                    }
                    Err(e) => break 'link format!("the peer broke the channel's framing: {e}"),
                }
            }
        };
        self.close(&why);
        why
    }

    /// End the link: every stream is reset with `why`.
    pub fn close(&self, why: &str) {
        let streams: Vec<Arc<Stream>> = {
            let mut table = self.inner.streams();
            self.inner.alive.store(false, Ordering::SeqCst);
            table.drain().map(|(_, s)| s).collect()
        };
        // This side's copy of the link is closed now, or by the pump in the middle of a
        // write to it once that write returns (which a socket's shutdown makes it do).
        if let Some(shutdown) = self
            .inner
            .shutdown
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            shutdown();
        }
        if let Ok(mut out) = self.inner.out.try_lock() {
            *out = None;
        }
        // A served stream whose handler has not answered yet gets its pumps later, which see
        // the reset at once.
        for s in streams {
            s.end(why);
        }
    }

    /// Carry a local TCP connection to `target` (the guest's forwarders).
    pub fn forward_tcp(&self, conn: TcpStream, target: &str) -> std::io::Result<u32> {
        let _ = conn.set_nodelay(true);
        let read_half = conn.try_clone()?;
        self.open(target, Some(Box::new(read_half)), Box::new(conn))
    }

    fn dispatch(&self, f: Frame, handler: Option<&Handler>) -> Result<(), String> {
        let id = f.stream();
        let stream = self.inner.streams().get(&id).cloned();
        match f {
            Frame::Open { target, .. } => {
                let Some(handler) = handler else {
                    return Err("the peer opened a stream (only this side opens)".into());
                };
                if stream.is_some() {
                    return Err(format!("the peer reopened stream {id}"));
                }
                let s = Stream::new();
                {
                    let mut streams = self.inner.streams();
                    if streams.len() >= MAX_SERVED {
                        drop(streams);
                        let _ = self.inner.send(&Frame::Reset {
                            stream: id,
                            reason: "too many streams",
                        });
                        return Ok(());
                    }
                    streams.insert(id, s.clone());
                }
                // The handler may connect somewhere (seconds): not on the link's thread.
                let (mux, handler, target) = (self.clone(), handler.clone(), target.to_string());
                let spawned = std::thread::Builder::new()
                    .name(format!("cgx-channel-{id}-open"))
                    .spawn(move || {
                        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            handler(&target)
                        }))
                        .unwrap_or_else(|_| Err("the target's handler failed".into()))
                        {
                            Ok((source, sink)) => mux.start(id, s, source, sink),
                            Err(why) => {
                                mux.inner.reset(id, &s, &why);
                                mux.inner.forget(id, &s);
                            }
                        }
                    });
                if spawned.is_err() {
                    let removed = self.inner.streams().remove(&id);
                    if let Some(s) = removed {
                        self.inner.reset(id, &s, "no thread for the stream");
                    }
                }
            }
            Frame::Data { bytes, .. } => {
                // Data for a stream that ended here meanwhile is dropped (its reset is on its way).
                let Some(s) = stream else { return Ok(()) };
                let mut st = s.lock();
                if st.reset.is_some() {
                    return Ok(());
                }
                let why = if st.fin {
                    Some("the peer sent data after its FIN")
                } else if st.inflight as usize + bytes.len() > WINDOW as usize {
                    Some("the peer sent past its window")
                } else {
                    None
                };
                if let Some(why) = why {
                    drop(st);
                    self.inner.reset(id, &s, why);
                    return Ok(());
                }
                st.inflight += bytes.len() as u32;
                st.pending.extend_from_slice(bytes);
                drop(st);
                s.cv.notify_all();
            }
            Frame::Fin { .. } => {
                if let Some(s) = stream {
                    let mut st = s.lock();
                    if st.fin {
                        drop(st);
                        self.inner.reset(id, &s, "the peer sent a second FIN");
                        return Ok(());
                    }
                    st.fin = true;
                    drop(st);
                    s.cv.notify_all();
                }
            }
            Frame::Reset { reason, .. } => {
                if let Some(s) = stream {
                    s.end(&format!("reset by the peer: {reason}"));
                }
            }
            Frame::Credit { bytes, .. } => {
                let Some(s) = stream else { return Ok(()) };
                let mut st = s.lock();
                match st.credit.checked_add(bytes) {
                    Some(c) if c <= WINDOW => st.credit = c,
                    _ => {
                        drop(st);
                        self.inner
                            .reset(id, &s, "the peer credited more than was sent");
                        return Ok(());
                    }
                }
                drop(st);
                s.cv.notify_all();
            }
        }
        Ok(())
    }
}

/// The source's bytes to the peer, within its credit; FIN at the source's end.
fn pump_source(inner: &Inner, id: u32, s: &Arc<Stream>, source: Option<Box<dyn Read + Send>>) {
    if let Some(mut source) = source {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let room = {
                let mut st = s.lock();
                while st.credit == 0 && st.reset.is_none() {
                    st = s.cv.wait(st).unwrap_or_else(|p| p.into_inner());
                }
                if st.reset.is_some() {
                    break;
                }
                (st.credit as usize).min(CHUNK)
            };
            let n = match source.read(&mut buf[..room]) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    inner.reset(id, s, &format!("reading the source: {e}"));
                    break;
                }
            };
            {
                let mut st = s.lock();
                if st.reset.is_some() {
                    break;
                }
                st.credit -= n as u32;
            }
            if inner
                .send(&Frame::Data {
                    stream: id,
                    bytes: &buf[..n],
                })
                .is_err()
            {
                s.end("the link broke");
                break;
            }
        }
    }
    let reset = s.lock().reset.is_some();
    if !reset && inner.send(&Frame::Fin { stream: id }).is_err() {
        s.end("the link broke");
    }
    s.lock().source_done = true;
    inner.retire(id, s);
}

/// The peer's bytes into the sink, crediting the peer as they are consumed.
fn pump_sink(inner: &Inner, id: u32, s: &Arc<Stream>, mut sink: Box<dyn Sink>) {
    let outcome = loop {
        let next = {
            let mut st = s.lock();
            loop {
                if let Some(why) = &st.reset {
                    break Err(why.clone());
                }
                if !st.pending.is_empty() {
                    break Ok(Some(std::mem::take(&mut st.pending)));
                }
                if st.fin {
                    break Ok(None);
                }
                st = s.cv.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        match next {
            Err(why) => break Err(why),
            Ok(None) => break Ok(()),
            Ok(Some(bytes)) => {
                if let Err(e) = sink.write(&bytes) {
                    let why = format!("writing the sink: {e}");
                    inner.reset(id, s, &why);
                    break Err(why);
                }
                // At most WINDOW bytes were pending (the window's check), so this fits.
                let len = bytes.len() as u32;
                {
                    let mut st = s.lock();
                    st.inflight = st.inflight.saturating_sub(len);
                }
                // Credited in frames the peer accepts (at most WINDOW each, above 0).
                let _ = inner.send(&Frame::Credit {
                    stream: id,
                    bytes: len,
                });
            }
        }
    };
    sink.finish(outcome);
    s.lock().sink_done = true;
    inner.retire(id, s);
}

/// A served target that connects to `addr` (the host's broker, its KBS), within `timeout`.
pub fn tcp_target(addr: &std::net::SocketAddr, timeout: Duration) -> Opened {
    let conn = TcpStream::connect_timeout(addr, timeout).map_err(|e| format!("connect: {e}"))?;
    let _ = conn.set_nodelay(true);
    let read_half = conn.try_clone().map_err(|e| e.to_string())?;
    Ok((Some(Box::new(read_half)), Box::new(conn)))
}

/// A sink that refuses any byte: a served file takes nothing from the guest.
#[derive(Debug)]
pub struct Refuse;

impl Sink for Refuse {
    fn write(&mut self, _: &[u8]) -> std::io::Result<()> {
        Err(std::io::Error::other("this target takes no data"))
    }

    fn finish(&mut self, _: Result<(), String>) {}
}

/// A served target that sends the file at `path` (at most `limit` bytes) and takes nothing.
/// Only a regular file, opened without following a symbolic link at its last component and
/// without blocking (a FIFO put there is refused, not waited on), and only as many bytes as it
/// had when opened (a device or a growing file does not stream without end).
pub fn file_target(path: &std::path::Path, limit: u64) -> Opened {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| format!("not available ({})", e.kind()))?;
    let meta = f
        .metadata()
        .map_err(|e| format!("not available ({})", e.kind()))?;
    if !meta.is_file() {
        return Err("not available (not a regular file)".into());
    }
    if meta.len() > limit {
        return Err(format!("over {limit} bytes"));
    }
    Ok((Some(Box::new(f.take(meta.len()))), Box::new(Refuse)))
}
