//! An HTTP/2 client can stop taking a response without the socket ever blocking: it grants
//! no flow-control window (RFC 9113 §5.2). hyper then holds the body's next chunk and stops
//! polling the body, so neither the write timeout (the socket never waits) nor a body's idle
//! timeout (nothing polls it) fires, and the upstream exchange feeding the response stays
//! open for as long as the client likes. Each response body of an HTTP/2 connection records
//! when it handed hyper a chunk that hyper has not come back for; a chunk waiting longer than
//! the write timeout closes the connection, as a socket that takes no bytes does.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};

use crate::body::{Body, BoxError};

/// The response bodies of one connection.
pub(super) struct Streams {
    opened: Instant,
    /// Per body: 0 while hyper is not holding one of its chunks, else 1 + the milliseconds
    /// from `opened` to when it was handed over.
    bodies: Mutex<Vec<Weak<AtomicU64>>>,
}

impl Streams {
    pub(super) fn new() -> Arc<Streams> {
        Arc::new(Streams {
            opened: Instant::now(),
            bodies: Mutex::default(),
        })
    }

    pub(super) fn watch(&self, body: Body) -> Body {
        let handed = Arc::new(AtomicU64::new(0));
        self.bodies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::downgrade(&handed));
        crate::body::boxed(Watched {
            inner: body,
            handed,
            opened: self.opened,
        })
    }

    /// Whether a chunk of a body still being sent has waited for the client `timeout` or
    /// longer.
    pub(super) fn stalled(&self, timeout: Duration) -> bool {
        let now = millis_since(self.opened);
        let timeout = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let mut bodies = self.bodies.lock().unwrap_or_else(PoisonError::into_inner);
        bodies.retain(|body| body.strong_count() > 0);
        bodies.iter().filter_map(Weak::upgrade).any(|handed| {
            let handed = handed.load(Ordering::Relaxed);
            handed != 0 && now.saturating_sub(handed - 1) >= timeout
        })
    }
}

fn millis_since(opened: Instant) -> u64 {
    u64::try_from(opened.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
}

struct Watched {
    inner: Body,
    handed: Arc<AtomicU64>,
    opened: Instant,
}

impl HttpBody for Watched {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        // Polled again: hyper has sent what it held.
        self.handed.store(0, Ordering::Relaxed);
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if frame.is_data() {
                let at = millis_since(self.opened) + 1;
                self.handed.store(at, Ordering::Relaxed);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use futures::SinkExt as _;
    use http_body_util::{BodyExt as _, StreamBody};

    use super::*;

    #[tokio::test]
    async fn a_chunk_hyper_holds_counts_until_it_comes_back() {
        let streams = Streams::new();
        let (mut upstream, chunks) = futures::channel::mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
        let mut body = streams.watch(crate::body::boxed(StreamBody::new(chunks)));
        let timeout = Duration::from_secs(60);
        assert!(!streams.stalled(Duration::ZERO), "nothing handed yet");

        upstream
            .send(Ok(Frame::data(Bytes::from_static(b"a"))))
            .await
            .unwrap();
        assert!(body.frame().await.is_some());
        assert!(streams.stalled(Duration::ZERO), "handed, not yet come back for");
        assert!(!streams.stalled(timeout));

        // Polled again and waiting for the upstream: not the client's doing.
        assert!(futures::poll!(std::pin::pin!(body.frame())).is_pending());
        assert!(!streams.stalled(Duration::ZERO));
        upstream
            .send(Ok(Frame::data(Bytes::from_static(b"b"))))
            .await
            .unwrap();
        assert!(body.frame().await.is_some());
        drop(body);
        assert!(!streams.stalled(Duration::ZERO), "a body gone is not watched");
    }
}
