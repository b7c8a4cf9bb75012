//! Accept loops: HTTP/1.1 and HTTP/2 (prior knowledge) on one port, with the listener's
//! limits, each connection watched so a drain lets in-flight requests and streams finish.

mod write_timeout;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use portcullis_config::ListenerLimits;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};

use crate::body::Body;
use write_timeout::WriteTimeout;

/// What a served port does with each request.
pub(crate) trait Handler: Clone + Send + Sync + 'static {
    fn handle(
        &self,
        peer: SocketAddr,
        request: Request<Incoming>,
    ) -> impl Future<Output = Response<Body>> + Send;
}

const HTTP2_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(30);
const HTTP2_KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The limits a listener enforces; swapped in place when a new version changes them, so
/// the socket (and its connections) survive the change.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Limits {
    pub(crate) max_connections: usize,
    pub(crate) header_read_timeout: Duration,
    pub(crate) max_header_bytes: u32,
    pub(crate) write_timeout: Duration,
}

impl Limits {
    pub(crate) fn from_spec(limits: &ListenerLimits) -> Limits {
        Limits {
            max_connections: limits.max_connections() as usize,
            header_read_timeout: limits.header_read_timeout(),
            max_header_bytes: limits.max_header_bytes(),
            write_timeout: limits.write_timeout(),
        }
    }

    /// For the admin port, which serves few, short requests.
    pub(crate) fn admin() -> Limits {
        Limits::from_spec(&ListenerLimits::default())
    }

    fn connection_builder(&self) -> auto::Builder<TokioExecutor> {
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(self.header_read_timeout)
            .max_buf_size(self.max_header_bytes as usize);
        // Pings find HTTP/2 peers that vanished without closing; an idle but live HTTP/2
        // connection stays open until the client closes it (bounded by maxConnections).
        builder
            .http2()
            .timer(TokioTimer::new())
            .max_header_list_size(self.max_header_bytes)
            .keep_alive_interval(HTTP2_KEEP_ALIVE_INTERVAL)
            .keep_alive_timeout(HTTP2_KEEP_ALIVE_TIMEOUT);
        builder
    }
}

/// Written to a connection over the limit, which is then closed: a clear answer rather
/// than a silent backlog.
const OVER_CAPACITY_BODY: &str =
    r#"{"error":{"type":"too_many_connections","message":"the listener is at its connection limit"}}"#;

/// An accepting listener. Dropping it also stops accepting and starts the drain.
pub(crate) struct RunningListener {
    stop: oneshot::Sender<()>,
    /// Fires once the socket is closed (connections may still be draining).
    socket_closed: oneshot::Receiver<()>,
    task: JoinHandle<()>,
    limits: Arc<ArcSwap<Limits>>,
}

impl RunningListener {
    pub(crate) fn spawn<H: Handler>(
        listener: TcpListener,
        handler: H,
        limits: Limits,
        drain_grace: Duration,
    ) -> Self {
        let (stop, stopped) = oneshot::channel();
        let (closed, socket_closed) = oneshot::channel();
        let limits = Arc::new(ArcSwap::from_pointee(limits));
        let task = tokio::spawn(serve(
            listener,
            handler,
            limits.clone(),
            stopped,
            closed,
            drain_grace,
        ));
        RunningListener {
            stop,
            socket_closed,
            task,
            limits,
        }
    }

    pub(crate) fn limits(&self) -> Limits {
        Limits::clone(&self.limits.load())
    }

    /// New limits apply to connections accepted from now on.
    pub(crate) fn set_limits(&self, limits: Limits) {
        if **self.limits.load() != limits {
            self.limits.store(Arc::new(limits));
        }
    }

    /// Stops accepting at once; the returned task ends when open connections have finished
    /// or the drain grace has run out and the rest were closed.
    pub(crate) fn drain(self) -> JoinHandle<()> {
        let _ = self.stop.send(());
        self.task
    }

    /// Like [`drain`](Self::drain), but returns once the port is free again.
    pub(crate) async fn close(self) -> JoinHandle<()> {
        let _ = self.stop.send(());
        let _ = self.socket_closed.await;
        self.task
    }
}

async fn serve<H: Handler>(
    listener: TcpListener,
    handler: H,
    limits: Arc<ArcSwap<Limits>>,
    mut stopped: oneshot::Receiver<()>,
    socket_closed: oneshot::Sender<()>,
    drain_grace: Duration,
) {
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    let open = Arc::new(AtomicUsize::new(0));
    let local = listener.local_addr().ok();
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let limits = limits.load_full();
                    if open.load(Ordering::Relaxed) >= limits.max_connections {
                        tracing::debug!(?local, %peer, "connection limit reached, refusing");
                        connections.spawn(refuse(stream));
                        continue;
                    }
                    let slot = ConnectionSlot::take(&open);
                    // Small writes such as single SSE events must not wait for Nagle.
                    let _ = stream.set_nodelay(true);
                    let handler = handler.clone();
                    let first_request = Arc::new(AtomicBool::new(false));
                    let seen = first_request.clone();
                    let service = service_fn(move |request| {
                        let handler = handler.clone();
                        seen.store(true, Ordering::Relaxed);
                        async move { Ok::<_, Infallible>(handler.handle(peer, request).await) }
                    });
                    let connection = limits
                        .connection_builder()
                        .serve_connection(TokioIo::new(WriteTimeout::new(stream, limits.write_timeout)), service)
                        .into_owned();
                    let connection = graceful.watch(connection);
                    let first_request_within = limits.header_read_timeout;
                    connections.spawn(async move {
                        let mut connection = std::pin::pin!(connection);
                        // A connection must start its first request in time, whatever the
                        // protocol: hyper's header timeout starts only once a connection is
                        // known to be HTTP/1.1, so a silent or half-preface connection would
                        // otherwise hold a slot of the connection limit for ever.
                        let result = tokio::select! {
                            result = &mut connection => Some(result),
                            () = tokio::time::sleep(first_request_within) => {
                                if first_request.load(Ordering::Relaxed) {
                                    Some(connection.await)
                                } else {
                                    tracing::debug!(%peer, "no request within the header read timeout, closing");
                                    None
                                }
                            }
                        };
                        if let Some(Err(error)) = result {
                            tracing::debug!(%peer, %error, "connection ended with an error");
                        }
                        drop(slot);
                    });
                }
                Err(error) => {
                    // Usually out of file descriptors: back off instead of spinning.
                    tracing::warn!(?local, %error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    let _ = socket_closed.send(());
    let open = connections.len();
    if tokio::time::timeout(drain_grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(?local, open, "drain grace elapsed, closing remaining connections");
    }
    connections.shutdown().await;
}

/// One open connection counted against the limit; released when dropped, so a task that
/// ends early (or panics) still gives its slot back.
struct ConnectionSlot(Arc<AtomicUsize>);

impl ConnectionSlot {
    fn take(open: &Arc<AtomicUsize>) -> ConnectionSlot {
        open.fetch_add(1, Ordering::Relaxed);
        ConnectionSlot(open.clone())
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn refuse(mut stream: TcpStream) {
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{OVER_CAPACITY_BODY}",
        OVER_CAPACITY_BODY.len()
    );
    let write = async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}
