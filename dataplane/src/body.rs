//! One body type for everything the proxy sends and receives, and the body wrappers that
//! enforce per-route limits.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Empty, Full};
use tokio::time::{Instant, Sleep};

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Boxed so a policy can replace a body, or end a stream with an error, whatever its type.
pub(crate) type Body = UnsyncBoxBody<Bytes, BoxError>;

pub(crate) fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub(crate) fn empty() -> Body {
    Empty::new().map_err(|never| match never {}).boxed_unsync()
}

pub(crate) fn boxed<B>(body: B) -> Body
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// The client's request body failed (cut off, malformed chunking): marks the error so it
/// is not blamed on the upstream the body was being sent to.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct ClientBodyError(#[source] pub(crate) BoxError);

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

/// Whether an error chain contains an `E`.
pub(crate) fn caused_by<E: std::error::Error + 'static>(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(error) = current {
        if error.is::<E>() {
            return true;
        }
        current = error.source();
    }
    false
}
