//! The HTTP/1.1 client: hyper's connection API under a pool of our own.
//!
//! Each thread keeps its own idle connections, so a request and its upstream connection stay
//! on the worker that took the request (see `listener::workers`) and the pool needs no lock.
//! A request takes the connection that went idle last, or opens one. Its response body
//! ([`Http1Body`]) gives the connection back when it has been read to the end; one dropped
//! before that is not reused (hyper closes it). Nothing runs per request to hand a connection
//! back, unlike hyper-util's pooled client, which spawned a task for every response still
//! streaming when its head arrived.
//!
//! A request sent on a pooled connection that turns out closed before the request left (the
//! upstream closed it while idle) is sent again, once, on a new connection. A connection idle
//! for [`IDLE_TIMEOUT`] is closed by its own task ([`Idleness`] settles which of that task and
//! a request gets it); what is left of it in its thread's pool (its sender, a few hundred
//! bytes) goes at the thread's next sweep, like a dropped client's bucket.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::HOST;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderValue, Method, Request, Response, Uri};
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use tokio::time::Instant;
use tower_service::Service;

use super::connect_watch::watched;
use crate::body::{ended_with, Body};

/// A connection idle for this long is closed (hyper-util's default).
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// How often a thread's pools are swept of closed connections and of clients no longer in use,
/// when a connection is given back (a checkout drops the closed ones it meets).
const SWEEP_INTERVAL: Duration = Duration::from_secs(30);

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Connector = HttpsConnector<HttpConnector>;

/// A client: how to reach `http://` and `https://` upstreams. Cheap to clone; clones share
/// their connections (on each thread).
#[derive(Clone)]
pub(crate) struct Http1 {
    connector: Arc<Connector>,
    idle_timeout: Duration,
}

/// Why a request got no response.
#[derive(Debug)]
pub(crate) enum Http1Error {
    /// Nothing of the request left the proxy.
    Connect(BoxError),
    /// The request was sent, at least in part.
    Exchange(hyper::Error),
    /// The request's URI names no host to connect to.
    NoAuthority,
}

impl fmt::Display for Http1Error {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Http1Error::Connect(_) => formatter.write_str("could not connect"),
            Http1Error::Exchange(_) => formatter.write_str("the exchange with the upstream failed"),
            Http1Error::NoAuthority => formatter.write_str("the request's URI names no host"),
        }
    }
}

impl std::error::Error for Http1Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Http1Error::Connect(cause) => Some(cause.as_ref()),
            Http1Error::Exchange(cause) => Some(cause),
            Http1Error::NoAuthority => None,
        }
    }
}

impl Http1 {
    pub(super) fn new(connector: Connector) -> Http1 {
        Http1 {
            connector: Arc::new(connector),
            idle_timeout: IDLE_TIMEOUT,
        }
    }

    /// Sends `request` (its URI absolute) and waits for the response's head.
    pub(crate) async fn request(
        &self,
        mut request: Request<Body>,
    ) -> Result<Response<Http1Body>, Http1Error> {
        let uri = request.uri();
        let scheme = uri.scheme().cloned().unwrap_or(Scheme::HTTP);
        let authority = uri.authority().cloned().ok_or(Http1Error::NoAuthority)?;
        if !request.headers().contains_key(HOST) {
            let host = host_header(&scheme, &authority).ok_or(Http1Error::NoAuthority)?;
            request.headers_mut().insert(HOST, host);
        }
        // The connection is the authority's: the request line carries only the path (or, for
        // CONNECT, the authority).
        *request.uri_mut() = if request.method() == Method::CONNECT {
            Uri::from(authority.clone())
        } else {
            Uri::from(
                request
                    .uri()
                    .path_and_query()
                    .cloned()
                    .unwrap_or_else(|| PathAndQuery::from_static("/")),
            )
        };
        let key = Key {
            connector: Arc::as_ptr(&self.connector) as usize,
            scheme,
            authority,
        };
        let mut pooled = true;
        loop {
            let (mut connection, reused) = match pooled.then(|| checkout(&key)).flatten() {
                Some(connection) => (connection, true),
                // Boxed: inline, a connect's future would make every request's exchange
                // future over three times its size (`dataplane/src/tests/future_sizes.rs`).
                None => (Box::pin(self.connect(&key)).await?, false),
            };
            match connection.sender.try_send_request(request).await {
                Ok(response) => {
                    let connection = Returning {
                        key,
                        owner: Arc::downgrade(&self.connector),
                        connection,
                    };
                    return Ok(response.map(|inner| Http1Body {
                        inner,
                        connection: Some(connection),
                    }));
                }
                Err(mut failure) => match failure.take_message() {
                    // The upstream closed the connection before the request left: once more,
                    // on a new one (its other idle connections may have gone the same way).
                    Some(unsent) if reused => {
                        request = unsent;
                        pooled = false;
                    }
                    // Nothing left the proxy: for retries and ejection, a failed connect.
                    Some(_) => return Err(Http1Error::Connect(failure.into_error().into())),
                    None => return Err(Http1Error::Exchange(failure.into_error())),
                },
            }
        }
    }

    async fn connect(&self, key: &Key) -> Result<Pooled, Http1Error> {
        let destination = Uri::builder()
            .scheme(key.scheme.clone())
            .authority(key.authority.clone())
            .path_and_query("/")
            .build()
            .map_err(|error| Http1Error::Connect(error.into()))?;
        let io = watched(HttpsConnector::clone(&self.connector).call(destination))
            .await
            .map_err(Http1Error::Connect)?;
        let (sender, mut connection) = http1::handshake(io)
            .await
            .map_err(|error| Http1Error::Connect(error.into()))?;
        let idleness = Arc::new(Idleness::in_use());
        let (watched_idleness, idle_timeout) = (idleness.clone(), self.idle_timeout);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    biased;
                    ended = &mut connection => {
                        if let Err(error) = ended {
                            tracing::debug!(%error, "upstream HTTP/1.1 connection failed");
                        }
                        return;
                    }
                    () = tokio::time::sleep_until(watched_idleness.expiry(idle_timeout)) => {
                        // Dropping the connection closes it.
                        if watched_idleness.close_if_idle_for(idle_timeout) {
                            return;
                        }
                    }
                }
            }
        });
        Ok(Pooled { sender, idleness })
    }
}

/// `Host` for a request without one: the URI's host, and its port unless the scheme's own.
fn host_header(scheme: &Scheme, authority: &Authority) -> Option<HeaderValue> {
    let default_port = if *scheme == Scheme::HTTPS { 443 } else { 80 };
    match authority.port_u16() {
        Some(port) if port != default_port => {
            HeaderValue::from_str(&format!("{}:{port}", authority.host())).ok()
        }
        _ => HeaderValue::from_str(authority.host()).ok(),
    }
}

/// A response's body, which gives its connection back to the pool of the thread that reads
/// it to the end (or drops it after the end).
pub(crate) struct Http1Body {
    inner: Incoming,
    connection: Option<Returning>,
}

struct Returning {
    key: Key,
    owner: Weak<Connector>,
    connection: Pooled,
}

impl Http1Body {
    fn give_back(&mut self) {
        if let Some(connection) = self.connection.take() {
            checkin(connection);
        }
    }
}

impl HttpBody for Http1Body {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match &frame {
            Some(Ok(frame)) if ended_with(&self.inner, frame) => self.give_back(),
            None => self.give_back(),
            // A connection that failed mid-response is not reused.
            Some(Err(_)) => self.connection = None,
            Some(Ok(_)) => {}
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Http1Body {
    /// hyper's server stops reading a body once it says it ended, and a body without content
    /// (HEAD, 204, 304) is never read: here they give their connection back.
    fn drop(&mut self) {
        if self.inner.is_end_stream() {
            self.give_back();
        }
    }
}

/// Connections are the client's and the destination's: clients with other TLS settings never
/// share one.
#[derive(PartialEq, Eq, Hash)]
struct Key {
    /// The client's connector's address. Whoever holds a key holds a `Weak` of the connector
    /// too, which keeps the address from being reused while the key is in use.
    connector: usize,
    scheme: Scheme,
    authority: Authority,
}

struct Bucket {
    /// When the client is gone, so are its connections.
    owner: Weak<Connector>,
    idle: VecDeque<Pooled>,
}

struct Pooled {
    sender: SendRequest<Body>,
    idleness: Arc<Idleness>,
}

/// Whether a connection is in use, or since when it has been idle (milliseconds after
/// `opened`), or closed for idling. The connection's task closes it only from an idle time it
/// read, and a request takes it only from one, so never both.
struct Idleness {
    /// The connection's own: a clock origin per connection keeps each runtime's clock (tokio's
    /// test clock differs between runtimes) to its own connections.
    opened: Instant,
    state: AtomicU64,
}

const IN_USE: u64 = u64::MAX;
const CLOSED: u64 = u64::MAX - 1;

impl Idleness {
    fn in_use() -> Idleness {
        Idleness {
            opened: Instant::now(),
            state: AtomicU64::new(IN_USE),
        }
    }

    fn millis_since_opened(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.opened).as_millis()).unwrap_or(CLOSED - 1)
    }

    fn set_idle(&self, now: Instant) {
        self.state.store(self.millis_since_opened(now), Ordering::Release);
    }

    /// Takes the connection for a request, unless its task closed it.
    fn take(&self) -> bool {
        let idle_since = self.state.load(Ordering::Acquire);
        idle_since < CLOSED
            && self
                .state
                .compare_exchange(idle_since, IN_USE, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// When the connection's task looks again: the end of its idle time, or a whole timeout
    /// from now while it is in use.
    fn expiry(&self, timeout: Duration) -> Instant {
        match self.state.load(Ordering::Acquire) {
            IN_USE | CLOSED => Instant::now() + timeout,
            idle_since => self.opened + Duration::from_millis(idle_since) + timeout,
        }
    }

    /// Closes the connection if it has been idle for `timeout`; whether it did.
    fn close_if_idle_for(&self, timeout: Duration) -> bool {
        let idle_since = self.state.load(Ordering::Acquire);
        if idle_since >= CLOSED {
            return false;
        }
        let idle_for = self
            .millis_since_opened(Instant::now())
            .saturating_sub(idle_since);
        u128::from(idle_for) >= timeout.as_millis()
            && self
                .state
                .compare_exchange(idle_since, CLOSED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }
}

#[derive(Default)]
struct Pools {
    /// foldhash, not SipHash: the keys come from the config, and `Authority` hashes byte by
    /// byte (case-folded), which SipHash made a visible share of each request's CPU.
    buckets: HashMap<Key, Bucket, foldhash::fast::RandomState>,
    next_sweep: Option<Instant>,
}

thread_local! {
    static POOLS: RefCell<Pools> = RefCell::default();
}

/// An idle connection to `key` ready for a request, if the thread has one.
fn checkout(key: &Key) -> Option<Pooled> {
    POOLS.with_borrow_mut(|pools| {
        let idle = &mut pools.buckets.get_mut(key)?.idle;
        // The connection idle for the shortest time first: the likeliest to be open still.
        for _ in 0..idle.len() {
            let connection = idle.pop_back()?;
            if connection.sender.is_ready() {
                if connection.idleness.take() {
                    return Some(connection);
                }
                // Its task closed it for idling.
                continue;
            }
            // Given back before hyper's connection task took in the response's end (possible
            // where the body is read on another thread): it will be ready in a moment.
            if !connection.sender.is_closed() {
                idle.push_front(connection);
            }
        }
        None
    })
}

/// Keeps a connection whose response was read to the end for the requests after it. A body
/// dropped as its thread exits drops its connection instead.
fn checkin(returning: Returning) {
    let Returning {
        key,
        owner,
        connection,
    } = returning;
    if connection.sender.is_closed() || owner.strong_count() == 0 {
        return;
    }
    let now = Instant::now();
    connection.idleness.set_idle(now);
    let _ = POOLS.try_with(|pools| {
        let mut pools = pools.borrow_mut();
        pools.sweep_if_due(now);
        match pools.buckets.get_mut(&key) {
            Some(bucket) => bucket.idle.push_back(connection),
            None => {
                pools.buckets.insert(
                    key,
                    Bucket {
                        owner,
                        idle: VecDeque::from([connection]),
                    },
                );
            }
        }
    });
}

impl Pools {
    /// Drops closed connections and those of clients no longer in use (dropping a
    /// connection's sender ends it), and buckets left empty.
    fn sweep_if_due(&mut self, now: Instant) {
        if self.next_sweep.is_some_and(|next| now < next) {
            return;
        }
        self.buckets.retain(|_, bucket| {
            if bucket.owner.strong_count() == 0 {
                return false;
            }
            bucket.idle.retain(|connection| !connection.sender.is_closed());
            !bucket.idle.is_empty()
        });
        self.next_sweep = Some(now + SWEEP_INTERVAL);
    }
}

#[cfg(test)]
mod tests;
