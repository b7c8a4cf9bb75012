//! A session-based client cancels a request with `notifications/cancelled`
//! (<https://modelcontextprotocol.io/specification/2025-11-25/basic/utilities/cancellation>).
//! Servers that keep sessions get the notification itself; a 2026-07-28 server takes no such
//! notification: in that revision a client cancels by closing the request's stream. So every
//! request of a session-based client is cancellable on the proxy from the moment it arrives:
//! the notification ends the gateway's work on it (pins, guardrails, whatever it sent
//! upstream, which a 2026-07-28 server hears as its client leaving) and ends the client's
//! answer without a response, as the cancellation utility asks.
//!
//! Only the proxy that carries the request can end it: a notification that reaches another
//! replica finds nothing to cancel there (the request runs to its end, and its answer is
//! ignored by the client).
//!
//! The same registry holds the subscriptions the gateway keeps at 2026-07-28 servers for a
//! session's stream ([`Cancellations::reserve`]): one per session and server, so a server's
//! notification reaches the client on one stream only.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::StreamExt;
use http::Response;
use http_body_util::{BodyStream, StreamBody};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::listen::event_stream;
use super::server::is_event_stream;
use crate::body::{self, Body};
use crate::response::ProxyError;

/// A request in flight: the client's session id as it sent it, and the request's id as JSON
/// (`5` and `"5"` are different ids). A held subscription's second part is not JSON, so no
/// request id can name it.
type Key = (String, String);

/// The requests a session-based client may cancel, on this proxy; kept across config
/// versions, as requests outlive them.
#[derive(Default)]
pub(crate) struct Cancellations {
    requests: Mutex<HashMap<Key, (u64, CancellationToken)>>,
    serial: AtomicU64,
}

impl Cancellations {
    fn requests(&self) -> MutexGuard<'_, HashMap<Key, (u64, CancellationToken)>> {
        self.requests
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Makes request `id` of `session` cancellable until the returned guard is dropped.
    pub(super) fn register(self: &Arc<Self>, session: &str, id: &Value) -> Cancellable {
        let key = (session.to_string(), id.to_string());
        let serial = self.serial.fetch_add(1, Ordering::Relaxed);
        let token = CancellationToken::new();
        // A client that reuses the id of a request still in flight can cancel only the
        // newer one.
        self.requests().insert(key.clone(), (serial, token.clone()));
        Cancellable {
            registry: self.clone(),
            key,
            serial,
            token,
        }
    }

    /// A guard for the subscription to `server` held for `session`'s stream, not in force
    /// until [`Cancellable::hold`]: a stream that fails to open must not end the one before.
    pub(super) fn reserve(self: &Arc<Self>, session: &str, server: &str) -> Cancellable {
        Cancellable {
            registry: self.clone(),
            key: (session.to_string(), format!("stream of {server}")),
            serial: self.serial.fetch_add(1, Ordering::Relaxed),
            token: CancellationToken::new(),
        }
    }

    /// Cancels request `id` of `session`; `false` when no such request is in flight here.
    pub(super) fn cancel(&self, session: &str, id: &Value) -> bool {
        let key = (session.to_string(), id.to_string());
        match self.requests().remove(&key) {
            Some((_, token)) => {
                token.cancel();
                true
            }
            None => false,
        }
    }

    #[cfg(test)]
    fn in_flight(&self) -> usize {
        self.requests().len()
    }
}

/// A request that a `notifications/cancelled` may end, while this lives.
pub(super) struct Cancellable {
    registry: Arc<Cancellations>,
    key: Key,
    serial: u64,
    token: CancellationToken,
}

impl Drop for Cancellable {
    fn drop(&mut self) {
        let mut requests = self.registry.requests();
        if requests
            .get(&self.key)
            .is_some_and(|(serial, _)| *serial == self.serial)
        {
            requests.remove(&self.key);
        }
    }
}

impl Cancellable {
    /// Puts a reserved subscription in force, ending the one held before for the same
    /// session and server (a client that opened its stream again).
    pub(super) fn hold(&self) {
        let entry = (self.serial, self.token.clone());
        if let Some((_, previous)) = self.registry.requests().insert(self.key.clone(), entry) {
            previous.cancel();
        }
    }

    /// `answering` (the request handled, its answer relayed), unless the client cancels it
    /// first: then everything it was doing is dropped, upstream requests included, and the
    /// client's answer is an event stream that ends with no response. An answer that is an
    /// event stream ends where it is when the client cancels later; any other is decided by
    /// then, and goes out as it is (its framing intact).
    pub(super) async fn run(
        self,
        answering: impl std::future::Future<Output = Response<Body>>,
    ) -> Response<Body> {
        let answer = tokio::select! {
            answer = answering => answer,
            () = self.token.cancelled() => {
                let mut answer = event_stream(body::empty());
                // Recorded as such: a 200 that carried nothing would look like a success.
                answer.extensions_mut().insert(ProxyError("mcp_cancelled"));
                return answer;
            }
        };
        if !is_event_stream(answer.headers()) {
            return answer;
        }
        let (parts, inner) = answer.into_parts();
        Response::from_parts(parts, Arc::new(self).until_cancelled(inner))
    }

    /// `body` until this is cancelled; the guard goes with it, so what it carries stays
    /// cancellable until it ends.
    pub(super) fn until_cancelled(self: Arc<Self>, body: Body) -> Body {
        let cancelled = self.token.clone().cancelled_owned();
        let frames = BodyStream::new(body).take_until(cancelled).map(move |frame| {
            let _registered = &self;
            frame
        });
        body::boxed(StreamBody::new(frames))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http_body::Frame;
    use http_body_util::BodyExt;
    use serde_json::json;

    use super::*;

    #[tokio::test]
    async fn a_cancelled_request_is_dropped_and_its_stream_ends_without_an_answer() {
        let registry = Arc::new(Cancellations::default());
        // Before the answer: the upstream request is dropped.
        let pending = registry.register("session-a", &json!(5));
        assert!(
            !registry.cancel("session-b", &json!(5)),
            "another session's request"
        );
        assert!(!registry.cancel("session-a", &json!("5")), "another id");
        let cancelling = registry.clone();
        let answer = pending
            .run(async move {
                assert!(cancelling.cancel("session-a", &json!(5)));
                std::future::pending::<Response<Body>>().await
            })
            .await;
        assert!(is_event_stream(answer.headers()));
        assert_eq!(
            answer.extensions().get::<ProxyError>().map(|error| error.0),
            Some("mcp_cancelled")
        );
        assert!(answer.into_body().collect().await.unwrap().to_bytes().is_empty());
        assert_eq!(registry.in_flight(), 0);

        // During an event stream: it ends where it is.
        let (events, receiver) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, body::BoxError>>(4);
        let streaming = registry.register("session-a", &json!(6));
        let answer = streaming
            .run(async move {
                let frames = tokio_stream::wrappers::ReceiverStream::new(receiver);
                event_stream(body::boxed(StreamBody::new(frames)))
            })
            .await;
        let mut body = answer.into_body();
        events
            .send(Ok(Frame::data(Bytes::from_static(
                b"event: message\ndata: {}\n\n",
            ))))
            .await
            .unwrap();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&first[..], b"event: message\ndata: {}\n\n");
        assert_eq!(registry.in_flight(), 1, "cancellable while it streams");
        assert!(registry.cancel("session-a", &json!(6)));
        let end = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .unwrap();
        assert!(end.is_none(), "the stream ends with no response");
    }

    #[tokio::test]
    async fn a_request_that_ends_is_no_longer_cancellable_and_a_reused_id_keeps_the_newer() {
        let registry = Arc::new(Cancellations::default());
        let answered = registry
            .register("s", &json!(1))
            .run(async { Response::new(body::full("{}")) })
            .await;
        assert_eq!(
            registry.in_flight(),
            0,
            "a JSON answer is decided: nothing left to cancel"
        );
        let body = answered.into_body();
        assert_eq!(
            http_body::Body::size_hint(&body).exact(),
            Some(2),
            "and it goes out as it was framed"
        );
        assert_eq!(body.collect().await.unwrap().to_bytes(), "{}");
        let older = registry.register("s", &json!(2));
        let newer = registry.register("s", &json!(2));
        drop(older);
        assert_eq!(
            registry.in_flight(),
            1,
            "the older one's end leaves the newer one"
        );
        drop(newer);
        assert_eq!(registry.in_flight(), 0);
    }

    #[tokio::test]
    async fn a_stream_held_again_ends_the_one_held_before_and_no_request_id_names_it() {
        let registry = Arc::new(Cancellations::default());
        let first = registry.reserve("s", "math");
        first.hold();
        let first_held = first.token.clone();
        assert!(
            !registry.cancel("s", &json!("stream of math")),
            "a client cannot cancel it"
        );
        let second = registry.reserve("s", "math");
        drop(registry.reserve("s", "math"));
        assert!(
            !first_held.is_cancelled(),
            "a stream that never opened ends nothing"
        );
        assert_eq!(registry.in_flight(), 1);
        second.hold();
        assert!(first_held.is_cancelled(), "the earlier stream ends");
        assert!(!second.token.is_cancelled());
        drop(first);
        assert_eq!(
            registry.in_flight(),
            1,
            "the earlier one's end leaves the later one held"
        );
        drop(second);
        assert_eq!(registry.in_flight(), 0);
    }
}
