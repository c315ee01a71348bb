//! Limits that come before parsing and before authentication: a body-size limit per route
//! (a declared `Content-Length` over it is refused before the handler or its extractors run;
//! a chunked body is cut at the same size when read), and load shedding (more requests in
//! flight than the server takes are answered 503 with `Retry-After` at once, not queued).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
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
