//! Prometheus metrics in the text exposition format, kept in small maps: no metrics crate,
//! nothing on the hot path heavier than a mutex around a counter bump. [`TrackLayer`] is the
//! layer that counts every request by its matched route (`/kbs/v0/resource/{repo}/{kind}/{tag}`, not
//! the path a client sent, so the label set stays bounded) and status, with a latency
//! histogram; services add their own outcome counters with [`Metrics::event`].

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request};
use axum::response::Response;
use tower::{Layer, Service};

/// Upper bounds (seconds) of the request-duration histogram buckets.
const BUCKETS: [f64; 10] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

/// One route's requests.
#[derive(Debug, Default)]
struct Route {
    by_status: BTreeMap<u16, u64>,
    latency: Histogram,
}

/// A service's metrics, named `<prefix>_requests_total`, `<prefix>_request_duration_seconds`
/// and `<prefix>_events_total`.
#[derive(Debug)]
pub struct Metrics {
    prefix: &'static str,
    /// Route → its counts by status and its latencies (looked up by `&str`: no allocation
    /// per request; one lock per request).
    routes: Mutex<BTreeMap<String, Route>>,
    events: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
}

/// The layer (`Router::route_layer(TrackLayer::new(metrics))`) that records every matched
/// request. A tower service written out, not `from_fn` (see `limits.rs`): no boxing per request.
#[derive(Debug, Clone)]
pub struct TrackLayer {
    metrics: Arc<Metrics>,
}

impl TrackLayer {
    pub fn new(metrics: Arc<Metrics>) -> Self {
        TrackLayer { metrics }
    }
}

impl<S> Layer<S> for TrackLayer {
    type Service = Track<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Track {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

/// [`TrackLayer`]'s service.
#[derive(Debug, Clone)]
pub struct Track<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S> Service<Request> for Track<S>
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Tracked<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        Tracked {
            route: req.extensions().get::<MatchedPath>().cloned(),
            started: Instant::now(),
            metrics: self.metrics.clone(),
            inner: self.inner.call(req),
        }
    }
}

pin_project_lite::pin_project! {
    /// A request being answered, recorded when it is.
    pub struct Tracked<F> {
        #[pin]
        inner: F,
        route: Option<MatchedPath>,
        started: Instant,
        metrics: Arc<Metrics>,
    }
}

impl<F: Future<Output = Result<Response, Infallible>>> Future for Tracked<F> {
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let answered = ready!(this.inner.poll(cx));
        if let Ok(resp) = &answered {
            this.metrics.request(
                this.route.as_ref().map_or("unmatched", |r| r.as_str()),
                resp.status().as_u16(),
                this.started.elapsed(),
            );
        }
        Poll::Ready(answered)
    }
}

impl Metrics {
    pub fn new(prefix: &'static str) -> Self {
        Metrics {
            prefix,
            routes: Mutex::new(BTreeMap::new()),
            events: Mutex::new(BTreeMap::new()),
        }
    }

    pub(crate) fn request(&self, route: &str, status: u16, took: Duration) {
        let Ok(mut routes) = self.routes.lock() else {
            return;
        };
        if !routes.contains_key(route) {
            routes.insert(route.to_string(), Route::default());
        }
        let Some(r) = routes.get_mut(route) else {
            return;
        };
        *r.by_status.entry(status).or_default() += 1;
        let h = &mut r.latency;
        let s = took.as_secs_f64();
        for (i, b) in BUCKETS.iter().enumerate() {
            if s <= *b {
                h.counts[i] += 1;
            }
        }
        h.sum += s;
        h.count += 1;
    }

    /// Count an outcome, e.g. `("attestation", "affirming")`, `("release", "denied")`.
    pub fn event(&self, what: &'static str, outcome: &'static str) {
        if let Ok(mut e) = self.events.lock() {
            *e.entry((what, outcome)).or_default() += 1;
        }
    }

    pub fn render(&self) -> String {
        let p = self.prefix;
        let mut out = String::new();
        out.push_str(&format!(
            "# HELP {p}_requests_total HTTP requests by route and status.\n"
        ));
        out.push_str(&format!("# TYPE {p}_requests_total counter\n"));
        if let Ok(r) = self.routes.lock() {
            for (e, route) in r.iter() {
                for (s, n) in &route.by_status {
                    out.push_str(&format!(
                        "{p}_requests_total{{route=\"{e}\",status=\"{s}\"}} {n}\n"
                    ));
                }
            }
        }
        out.push_str(&format!(
            "# HELP {p}_request_duration_seconds Request latency by route.\n"
        ));
        out.push_str(&format!("# TYPE {p}_request_duration_seconds histogram\n"));
        if let Ok(d) = self.routes.lock() {
            for (e, h) in d.iter().map(|(e, r)| (e, &r.latency)) {
                for (i, b) in BUCKETS.iter().enumerate() {
                    out.push_str(&format!(
                        "{p}_request_duration_seconds_bucket{{route=\"{e}\",le=\"{b}\"}} {}\n",
                        h.counts[i]
                    ));
                }
                out.push_str(&format!(
                    "{p}_request_duration_seconds_bucket{{route=\"{e}\",le=\"+Inf\"}} {}\n",
                    h.count
                ));
                out.push_str(&format!(
                    "{p}_request_duration_seconds_sum{{route=\"{e}\"}} {}\n",
                    h.sum
                ));
                out.push_str(&format!(
                    "{p}_request_duration_seconds_count{{route=\"{e}\"}} {}\n",
                    h.count
                ));
            }
        }
        out.push_str(&format!(
            "# HELP {p}_events_total Outcomes the service counts.\n"
        ));
        out.push_str(&format!("# TYPE {p}_events_total counter\n"));
        if let Ok(e) = self.events.lock() {
            for ((w, o), n) in e.iter() {
                out.push_str(&format!(
                    "{p}_events_total{{event=\"{w}\",outcome=\"{o}\"}} {n}\n"
                ));
            }
        }
        out
    }
}
