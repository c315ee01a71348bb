//! Limits that come before parsing and before authentication: a body-size limit per route
//! (a declared `Content-Length` over it is refused before the handler or its extractors run;
//! a chunked body is cut at the same size when read), load shedding (more requests in
//! flight than the server takes are answered 503 with `Retry-After` at once, not queued), and
//! per-client caps on open connections and requests in flight ([`Clients`]: one address, or
//! one IPv6 /64, cannot hold every slot; over its share a client gets 429 with `Retry-After`).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};

use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::MethodRouter;
use tower::{Layer, Service};

use crate::error::Refusal;

// The layers here are tower services written out, not `axum::middleware::from_fn`: a `from_fn`
// layer costs every request a boxed clone of the service below it and a boxed future, and
// these run on every request (about 1.5% of a CoCo flow's server CPU for three of them).

/// Bound `route`'s request bodies to `max` bytes.
pub fn limited<S: Clone + Send + Sync + 'static>(
    route: MethodRouter<S>,
    max: usize,
) -> MethodRouter<S> {
    route
        .layer::<_, Infallible>(DeclaredLengthLayer { max })
        .layer::<_, Infallible>(DefaultBodyLimit::max(max))
}

/// [`limited`] for a route added with its OpenAPI path item (`utoipa_axum::routes!`): the
/// document is kept, the method router limited.
pub fn limited_route<S: Clone + Send + Sync + 'static>(
    (schemas, paths, route): utoipa_axum::router::UtoipaMethodRouter<S>,
    max: usize,
) -> utoipa_axum::router::UtoipaMethodRouter<S> {
    (schemas, paths, limited(route, max))
}

/// Refuses a request whose declared `Content-Length` is over `max`, before anything below it
/// runs (the body limit itself cuts a chunked body when it is read).
#[derive(Debug, Clone, Copy)]
struct DeclaredLengthLayer {
    max: usize,
}

impl<S> Layer<S> for DeclaredLengthLayer {
    type Service = DeclaredLength<S>;

    fn layer(&self, inner: S) -> Self::Service {
        DeclaredLength {
            inner,
            max: self.max,
        }
    }
}

#[derive(Debug, Clone)]
struct DeclaredLength<S> {
    inner: S,
    max: usize,
}

impl<S> Service<Request> for DeclaredLength<S>
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Answer<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        let max = self.max;
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > max as u64) {
            return Answer::now(crate::error::problem(&Refusal {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                code: "PayloadTooLarge",
                detail: format!(
                    "the request body is larger than the {max} bytes this endpoint takes"
                ),
            }));
        }
        Answer::Inner {
            inner: self.inner.call(req),
        }
    }
}

pin_project_lite::pin_project! {
    /// A layer's answer: its own, at once, or the service's below it.
    #[project = AnswerProj]
    pub(crate) enum Answer<F> {
        Now { response: Option<Response> },
        Inner { #[pin] inner: F },
    }
}

impl<F> Answer<F> {
    pub(crate) fn now(response: Response) -> Self {
        Answer::Now {
            response: Some(response),
        }
    }
}

impl<F: Future<Output = Result<Response, Infallible>>> Future for Answer<F> {
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            // Polled again after it answered: the response is gone; an empty 500 rather
            // than a panic (tower's contract says this does not happen).
            AnswerProj::Now { response } => Poll::Ready(Ok(response
                .take()
                .unwrap_or_else(|| StatusCode::INTERNAL_SERVER_ERROR.into_response()))),
            AnswerProj::Inner { inner } => inner.poll(cx),
        }
    }
}

/// What [`AdmitLayer`] holds: the in-flight slots ([`crate::ListenerConfig::max_in_flight`])
/// and the longest a request may take ([`crate::ListenerConfig::request_timeout`]).
#[derive(Debug, Clone)]
pub(crate) struct AdmitLayer {
    pub slots: Arc<tokio::sync::Semaphore>,
    pub timeout: std::time::Duration,
}

impl<S> Layer<S> for AdmitLayer {
    type Service = Admit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Admit {
            inner,
            admission: self.clone(),
        }
    }
}

/// The server-wide layer: past `max_in_flight`, 503 with `Retry-After` at once (load
/// shedding); a request that takes longer than `request_timeout`, 408.
#[derive(Debug, Clone)]
pub(crate) struct Admit<S> {
    inner: S,
    admission: AdmitLayer,
}

impl<S> Service<Request> for Admit<S>
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Answer<Admitted<S::Future>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        let Ok(permit) = self.admission.slots.clone().try_acquire_owned() else {
            let mut resp = crate::error::problem(&Refusal {
                status: StatusCode::SERVICE_UNAVAILABLE,
                code: "Overloaded",
                detail: "the server is at capacity; retry in a moment".into(),
            });
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return Answer::now(resp);
        };
        Answer::Inner {
            inner: Admitted {
                inner: tokio::time::timeout(self.admission.timeout, self.inner.call(req)),
                _permit: permit,
            },
        }
    }
}

pin_project_lite::pin_project! {
    /// An admitted request: its slot is held until it is answered or dropped.
    pub(crate) struct Admitted<F> {
        #[pin]
        inner: tokio::time::Timeout<F>,
        _permit: tokio::sync::OwnedSemaphorePermit,
    }
}

impl<F: Future<Output = Result<Response, Infallible>>> Future for Admitted<F> {
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Poll::Ready(match ready!(self.project().inner.poll(cx)) {
            Ok(answered) => answered,
            Err(_) => Ok(crate::error::problem(&Refusal {
                status: StatusCode::REQUEST_TIMEOUT,
                code: "RequestTimeout",
                detail: "the request took longer than the server allows".into(),
            })),
        })
    }
}

/// Who a per-client cap counts against: an IPv4 address, or the /64 prefix of an IPv6 address
/// (a subscriber's usual allocation: one host there has 2⁶⁴ addresses, and gets one share).
/// An IPv4-mapped IPv6 peer (an IPv4 client of a `[::]` listener) is its IPv4 address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ClientKey {
    V4(u32),
    V6(u64),
}

impl ClientKey {
    pub(crate) fn of(ip: std::net::IpAddr) -> Self {
        match ip {
            std::net::IpAddr::V4(a) => ClientKey::V4(a.into()),
            std::net::IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(v4) => ClientKey::V4(v4.into()),
                None => ClientKey::V6((u128::from(a) >> 64) as u64),
            },
        }
    }
}

/// Open connections and requests in flight per client ([`ClientKey`]), so that one address
/// cannot hold every slot the server-wide caps allow: past
/// [`crate::ListenerConfig::max_connections_per_client`] a new connection is closed at once
/// (before it takes a server-wide slot); past
/// [`crate::ListenerConfig::max_in_flight_per_client`] a request is answered 429 with
/// `Retry-After` (the client is over its share; 503 stays the server's own overload).
///
/// The map is touched once when a connection opens and once when it closes, under a short
/// lock; it holds an entry only while its client has a connection open, so it is no larger
/// than the connections the server holds. A request only counts on the entry its connection
/// already holds (one atomic add and one subtract), no lookup.
#[derive(Debug)]
pub(crate) struct Clients {
    open: std::sync::Mutex<std::collections::HashMap<ClientKey, Arc<Client>>>,
    max_connections: usize,
    max_in_flight: usize,
}

/// One client's counts.
#[derive(Debug)]
pub(crate) struct Client {
    key: ClientKey,
    /// Changed only under [`Clients::open`]'s lock (the entry goes when it reaches 0).
    connections: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: usize,
}

impl Clients {
    pub(crate) fn new(max_connections: usize, max_in_flight: usize) -> Arc<Self> {
        Arc::new(Clients {
            open: std::sync::Mutex::default(),
            max_connections,
            max_in_flight,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<ClientKey, Arc<Client>>> {
        // Nothing panics under this lock; a poisoned map is still consistent.
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A connection from `ip`, counted until the guard drops; `None` past the client's cap.
    pub(crate) fn connect(self: &Arc<Self>, ip: std::net::IpAddr) -> Option<ClientConnection> {
        let key = ClientKey::of(ip);
        let mut open = self.lock();
        if let Some(client) = open.get(&key) {
            if client.connections.load(Ordering::Relaxed) >= self.max_connections {
                return None;
            }
            client.connections.fetch_add(1, Ordering::Relaxed);
            return Some(ClientConnection {
                clients: self.clone(),
                client: client.clone(),
            });
        }
        if self.max_connections == 0 {
            return None;
        }
        let client = Arc::new(Client {
            key,
            connections: AtomicUsize::new(1),
            in_flight: AtomicUsize::new(0),
            max_in_flight: self.max_in_flight,
        });
        open.insert(key, client.clone());
        Some(ClientConnection {
            clients: self.clone(),
            client,
        })
    }

    /// Clients with a connection open (tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.lock().len()
    }
}

/// An open connection's place in its client's count; the client's entry goes with its last.
#[derive(Debug)]
pub(crate) struct ClientConnection {
    clients: Arc<Clients>,
    client: Arc<Client>,
}

impl ClientConnection {
    /// The client's entry, for counting this connection's requests.
    pub(crate) fn client(&self) -> Arc<Client> {
        self.client.clone()
    }
}

impl Drop for ClientConnection {
    fn drop(&mut self) {
        let mut open = self.clients.lock();
        if self.client.connections.fetch_sub(1, Ordering::Relaxed) == 1
            && open
                .get(&self.client.key)
                .is_some_and(|c| Arc::ptr_eq(c, &self.client))
        {
            open.remove(&self.client.key);
        }
    }
}

impl Client {
    /// A request in flight, counted until the guard drops; `None` past the client's cap.
    fn admit(self: &Arc<Self>) -> Option<ClientRequest> {
        if self.in_flight.fetch_add(1, Ordering::Relaxed) >= self.max_in_flight {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(ClientRequest(self.clone()))
    }
}

/// A request's place in its client's in-flight count.
#[derive(Debug)]
pub(crate) struct ClientRequest(Arc<Client>);

impl Drop for ClientRequest {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The service one connection is served by: its client's in-flight cap (429 past it), then
/// the peer's address for handlers (`ConnectInfo<SocketAddr>`: per-client budgets), then the
/// router (with the server-wide [`AdmitLayer`] inside it).
#[derive(Debug, Clone)]
pub(crate) struct PerClient<S> {
    pub inner: S,
    pub peer: std::net::SocketAddr,
    pub client: Arc<Client>,
}

impl<S, B> Service<axum::http::Request<B>> for PerClient<S>
where
    S: Service<axum::http::Request<B>, Response = Response, Error = Infallible>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Answer<Counted<S::Future>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: axum::http::Request<B>) -> Self::Future {
        let Some(counted) = self.client.admit() else {
            let mut resp = crate::error::problem(&Refusal {
                status: StatusCode::TOO_MANY_REQUESTS,
                code: "TooManyRequests",
                detail: format!(
                    "this client has {} requests in flight, the most the server takes from \
                     one address; retry once one is answered",
                    self.client.max_in_flight
                ),
            });
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return Answer::now(resp);
        };
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(self.peer));
        Answer::Inner {
            inner: Counted {
                inner: self.inner.call(req),
                _counted: counted,
            },
        }
    }
}

pin_project_lite::pin_project! {
    /// A request counted against its client until it is answered or dropped.
    pub(crate) struct Counted<F> {
        #[pin]
        inner: F,
        _counted: ClientRequest,
    }
}

impl<F: Future<Output = Result<Response, Infallible>>> Future for Counted<F> {
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().inner.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::net::IpAddr;

    #[test]
    fn clients_are_ipv4_addresses_and_ipv6_slash_64s() {
        let key = |s: &str| ClientKey::of(s.parse::<IpAddr>().unwrap());
        assert_eq!(key("10.0.0.1"), key("::ffff:10.0.0.1"));
        assert_ne!(key("10.0.0.1"), key("10.0.0.2"));
        // One /64, whatever the interface identifier.
        assert_eq!(
            key("2001:db8:1:2::1"),
            key("2001:db8:1:2:ffff:ffff:ffff:ffff")
        );
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
        assert_ne!(
            key("::a00:1"),
            key("10.0.0.1"),
            "IPv4-compatible is not mapped"
        );
    }

    #[test]
    fn per_client_counts_cap_and_free_themselves() {
        let clients = Clients::new(2, 1);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "2001:db8::1".parse().unwrap();
        let a1 = clients.connect(a).unwrap();
        let a2 = clients.connect(a).unwrap();
        assert!(clients.connect(a).is_none(), "a third connection from a");
        // Another client, and another address in b's /64, are counted apart from a.
        let b1 = clients.connect(b).unwrap();
        let b2 = clients.connect("2001:db8::2".parse().unwrap()).unwrap();
        assert!(clients.connect("2001:db8::3".parse().unwrap()).is_none());
        assert_eq!(clients.len(), 2);
        // In flight: one per client, counted on the client whatever its connection.
        let r = a1.client().admit().unwrap();
        assert!(a2.client().admit().is_none());
        assert!(b1.client().admit().is_some());
        drop(r);
        assert!(a2.client().admit().is_some());
        // Closing frees the slot; the last one removes the entry.
        drop(a1);
        let a3 = clients.connect(a).unwrap();
        drop((a2, a3, b1, b2));
        assert_eq!(clients.len(), 0);
        assert!(clients.connect(a).is_some());
        assert!(Clients::new(0, 1).connect(a).is_none());
    }
}
