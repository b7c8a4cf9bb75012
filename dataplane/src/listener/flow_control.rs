//! An HTTP/2 client can stop taking a response without the socket ever blocking: it grants
//! no flow-control window (RFC 9113 §5.2). hyper then holds the body's next chunk and stops
//! polling the body, so neither the write timeout (the socket never waits) nor a body's idle
//! timeout (nothing polls it) fires, and the upstream exchange feeding the response stays
//! open for as long as the client likes. Each response body of an HTTP/2 connection records
//! when it handed hyper a chunk that hyper has not come back for; a chunk waiting longer than
//! the write timeout closes the connection, as a socket that takes no bytes does.
//!
//! The same records tell when the connection last had an open stream, for its idle timeout.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};

use crate::body::{Body, BoxError};

/// Most bytes handed to hyper at once. hyper comes back for more only once the client made
/// room for all it holds, so the clock measures the time to take one chunk: at most a frame's
/// worth (RFC 9113's default frame size), a client is cut only when it takes less than that
/// per write timeout, not when an upstream read of hundreds of KiB outlasts it.
const MAX_HANDED_BYTES: usize = 16 * 1024;

/// The streams of one connection and their response bodies.
pub(super) struct Streams {
    opened: Instant,
    bodies: Mutex<Bodies>,
    /// Streams from their request to their response body's end (or drop).
    open: AtomicUsize,
    /// Milliseconds from `opened` to when the last open stream ended.
    last_ended: AtomicU64,
}

#[derive(Default)]
struct Bodies {
    /// Per body: 0 while hyper is not holding one of its chunks, else 1 + the milliseconds
    /// from `opened` to when it was handed over.
    handed: Vec<Weak<AtomicU64>>,
    /// How many were left at the last sweep of finished bodies: the next comes once as many
    /// again have been added, so a busy connection's list stays within twice its live bodies.
    after_sweep: usize,
}

impl Bodies {
    fn sweep(&mut self) {
        self.handed.retain(|body| body.strong_count() > 0);
        self.after_sweep = self.handed.len();
    }
}

impl Streams {
    pub(super) fn new() -> Arc<Streams> {
        Arc::new(Streams {
            opened: Instant::now(),
            bodies: Mutex::default(),
            open: AtomicUsize::new(0),
            last_ended: AtomicU64::new(0),
        })
    }

    /// Counts a stream open from its request on; it ends when the returned [`OpenStream`]
    /// (or the response body it goes into) is dropped.
    pub(super) fn open(self: &Arc<Self>) -> OpenStream {
        self.open.fetch_add(1, Ordering::Relaxed);
        OpenStream(self.clone())
    }

    /// How long the connection has had no open stream; `None` while it has one.
    pub(super) fn idle_for(&self) -> Option<Duration> {
        if self.open.load(Ordering::Acquire) != 0 {
            return None;
        }
        let since = millis_since(self.opened).saturating_sub(self.last_ended.load(Ordering::Relaxed));
        Some(Duration::from_millis(since))
    }

    fn watch(&self, body: Body, stream: OpenStream) -> Body {
        let handed = Arc::new(AtomicU64::new(0));
        let mut bodies = self.bodies.lock().unwrap_or_else(PoisonError::into_inner);
        if bodies.handed.len() >= (2 * bodies.after_sweep).max(64) {
            bodies.sweep();
        }
        bodies.handed.push(Arc::downgrade(&handed));
        drop(bodies);
        crate::body::boxed(Watched {
            inner: body,
            rest: None,
            handed,
            opened: self.opened,
            _stream: stream,
        })
    }

    /// Whether a chunk of a body still being sent has waited for the client `timeout` or
    /// longer.
    pub(super) fn stalled(&self, timeout: Duration) -> bool {
        let now = millis_since(self.opened);
        let timeout = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let mut bodies = self.bodies.lock().unwrap_or_else(PoisonError::into_inner);
        bodies.sweep();
        bodies.handed.iter().filter_map(Weak::upgrade).any(|handed| {
            let handed = handed.load(Ordering::Relaxed);
            handed != 0 && now.saturating_sub(handed - 1) >= timeout
        })
    }
}

/// One open stream of a connection: its request, then its response body.
pub(super) struct OpenStream(Arc<Streams>);

impl OpenStream {
    /// Hands the stream to its response body, watched for the client's window.
    pub(super) fn watch(self, body: Body) -> Body {
        let streams = self.0.clone();
        streams.watch(body, self)
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        let streams = &self.0;
        // Written before the count drops, so an idle connection never reads a stale end.
        streams
            .last_ended
            .store(millis_since(streams.opened), Ordering::Relaxed);
        streams.open.fetch_sub(1, Ordering::Release);
    }
}

fn millis_since(opened: Instant) -> u64 {
    u64::try_from(opened.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
}

struct Watched {
    inner: Body,
    /// What is left of a chunk larger than [`MAX_HANDED_BYTES`].
    rest: Option<Bytes>,
    handed: Arc<AtomicU64>,
    opened: Instant,
    _stream: OpenStream,
}

impl HttpBody for Watched {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        // Polled again: hyper has sent what it held.
        this.handed.store(0, Ordering::Relaxed);
        let frame = match this.rest.take() {
            Some(rest) => Frame::data(rest),
            None => match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => frame,
                other => return Poll::Ready(other),
            },
        };
        let frame = match frame.into_data() {
            Ok(mut data) => {
                if data.len() > MAX_HANDED_BYTES {
                    this.rest = Some(data.split_off(MAX_HANDED_BYTES));
                }
                if !data.is_empty() {
                    this.handed
                        .store(millis_since(this.opened) + 1, Ordering::Relaxed);
                }
                Frame::data(data)
            }
            Err(frame) => frame,
        };
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let held = self.rest.as_ref().map_or(0, |rest| rest.len() as u64);
        let inner = self.inner.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + held);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + held);
        }
        hint
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
        let mut body = streams.open().watch(crate::body::boxed(StreamBody::new(chunks)));
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
        // A large read reaches hyper a frame's worth at a time.
        let large = Bytes::from(vec![b'b'; MAX_HANDED_BYTES + 1]);
        upstream.send(Ok(Frame::data(large))).await.unwrap();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first.len(), MAX_HANDED_BYTES);
        assert!(
            streams.stalled(Duration::ZERO),
            "the rest waits for room for the first"
        );
        let second = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(second.len(), 1);
        assert_eq!(streams.idle_for(), None, "its stream is open while its body is");
        drop(body);
        assert!(!streams.stalled(Duration::ZERO), "a body gone is not watched");
        assert!(streams.idle_for().is_some(), "and its stream is closed");
    }
}
