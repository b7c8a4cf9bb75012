//! One body type for everything the proxy sends and receives, and the body wrappers that
//! enforce per-route limits.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, BodyStream, Empty, Full, StreamBody};
use tokio::time::{Instant, Sleep};

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Boxed so a policy can replace a body, or end a stream with an error, whatever its type.
pub(crate) type Body = UnsyncBoxBody<Bytes, BoxError>;

pub(crate) fn full(bytes: impl Into<Bytes>) -> Body {
    let bytes = bytes.into();
    // `Empty` is zero-sized, so its box allocates nothing; an empty `Full` is not. Both say
    // they have ended, so hyper frames them alike.
    if bytes.is_empty() {
        return empty();
    }
    Full::new(bytes).map_err(|never| match never {}).boxed_unsync()
}

pub(crate) fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

/// Whether `frame`, just read from `body`, was its last. Trailers always are, and hyper's
/// servers read no further after them; a data frame is when the body says it ended (an HTTP/1.1
/// chunked body does not, before its trailers).
pub(crate) fn ended_with<B: HttpBody>(body: &B, frame: &Frame<B::Data>) -> bool {
    frame.is_trailers() || body.is_end_stream()
}

pub(crate) fn boxed<B>(body: B) -> Body
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// Largest answer a stage holds whole to check it (guardrails on results and completions).
pub(crate) const MAX_HELD_ANSWER_BYTES: usize = 16 << 20;

/// A body read whole, up to a limit.
pub(crate) enum Held {
    Whole(Bytes),
    /// The body failed while being read.
    Broken(String),
    /// Over the limit: what was read, and the rest of the body, unread.
    TooLarge {
        start: Bytes,
        rest: Body,
    },
}

/// Reads `body` whole, up to `limit` bytes.
pub(crate) async fn hold(mut body: Body, limit: usize) -> Held {
    let mut buffer = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(error) => return Held::Broken(error.to_string()),
        };
        if let Ok(data) = frame.into_data() {
            buffer.extend_from_slice(&data);
            if buffer.len() > limit {
                return Held::TooLarge {
                    start: buffer.freeze(),
                    rest: body,
                };
            }
        }
    }
    Held::Whole(buffer.freeze())
}

/// `start` followed by the rest of a body: a held answer passed on after all.
pub(crate) fn prepend(start: Bytes, rest: Body) -> Body {
    let start = futures::stream::once(async move { Ok(Frame::data(start)) });
    boxed(StreamBody::new(futures::StreamExt::chain(
        start,
        BodyStream::new(rest),
    )))
}

/// A body followed by `last`: a stream that ends with a closing message.
pub(crate) fn append(body: Body, last: Bytes) -> Body {
    let last = futures::stream::once(async move { Ok(Frame::data(last)) });
    boxed(StreamBody::new(futures::StreamExt::chain(
        BodyStream::new(body),
        last,
    )))
}

/// A body that went quiet for longer than allowed.
#[derive(Debug, thiserror::Error)]
#[error("no body data for {0:?}")]
pub(crate) struct BodyIdle(pub(crate) Duration);

/// Fails the body when no frame arrives for `idle`: a stalled upload or download must not
/// hold a connection (and an upstream slot) forever.
pub(crate) struct IdleTimeout<B> {
    inner: B,
    idle: Duration,
    /// Armed on the first wait only: most bodies are ready at once and never need a timer.
    timer: Option<Pin<Box<Sleep>>>,
}

impl<B> IdleTimeout<B> {
    pub(crate) fn new(inner: B, idle: Duration) -> IdleTimeout<B> {
        IdleTimeout {
            inner,
            idle,
            timer: None,
        }
    }
}

impl<B> HttpBody for IdleTimeout<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                // The next wait starts a new idle period.
                if let Some(timer) = &mut this.timer {
                    timer.as_mut().reset(Instant::now() + this.idle);
                }
                Poll::Ready(frame.map(|frame| frame.map_err(Into::into)))
            }
            Poll::Pending => {
                let idle = this.idle;
                let timer = this
                    .timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(Box::new(BodyIdle(idle))))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

use std::future::Future as _;

/// Why a client's request body failed, recorded where it fails (the wrapper around it)
/// so every stage that sees the failure — a policy buffering the body, the upstream
/// exchange, on HTTP/1.1 or HTTP/2 — answers it the same way, and never blames the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyFailure {
    TooLarge = 1,
    Stalled = 2,
    Broken = 3,
}

/// Shared between the request body wrapper and the stages that read the request.
#[derive(Debug, Default)]
pub(crate) struct BodyStatus {
    failure: std::sync::atomic::AtomicU8,
    received: std::sync::atomic::AtomicU64,
}

impl BodyStatus {
    pub(crate) fn failure(&self) -> Option<BodyFailure> {
        match self.failure.load(std::sync::atomic::Ordering::Relaxed) {
            1 => Some(BodyFailure::TooLarge),
            2 => Some(BodyFailure::Stalled),
            3 => Some(BodyFailure::Broken),
            _ => None,
        }
    }

    pub(crate) fn received(&self) -> u64 {
        self.received.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn fail(&self, error: &(dyn std::error::Error + 'static)) {
        let failure = if caused_by::<http_body_util::LengthLimitError>(error) {
            BodyFailure::TooLarge
        } else if caused_by::<BodyIdle>(error) {
            BodyFailure::Stalled
        } else {
            BodyFailure::Broken
        };
        self.failure
            .store(failure as u8, std::sync::atomic::Ordering::Relaxed);
    }

    /// The client's answer for a request whose body failed.
    pub(crate) fn answer(failure: Option<BodyFailure>, limit: u64) -> http::Response<Body> {
        use http::StatusCode;
        match failure {
            Some(BodyFailure::TooLarge) => crate::response::error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "request_too_large",
                format!("the request body exceeds this route's limit of {limit} bytes"),
            ),
            Some(BodyFailure::Stalled) => crate::response::error(
                StatusCode::REQUEST_TIMEOUT,
                "request_body_timeout",
                "the request body stalled longer than this route allows",
            ),
            Some(BodyFailure::Broken) | None => crate::response::error(
                StatusCode::BAD_REQUEST,
                "client_body_error",
                "the request body could not be read (cut off or malformed)",
            ),
        }
    }
}

/// The client's request body: counts its bytes and records why it failed, if it does.
pub(crate) struct ClientBody<B> {
    pub(crate) inner: B,
    pub(crate) status: std::sync::Arc<BodyStatus>,
}

impl<B> HttpBody for ClientBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.status
                        .received
                        .fetch_add(data.len() as u64, std::sync::atomic::Ordering::Relaxed);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(error))) => {
                let error: BoxError = error.into();
                this.status.fail(error.as_ref());
                Poll::Ready(Some(Err(error)))
            }
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Whether an error chain contains an `E`.
fn caused_by<E: std::error::Error + 'static>(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(error) = current {
        if error.is::<E>() {
            return true;
        }
        current = error.source();
    }
    false
}
