//! Accept loops, one per worker thread: HTTP/1.1 and HTTP/2 (prior knowledge) on one port,
//! with the listener's limits, each connection watched so a drain lets in-flight requests
//! and streams finish.

mod flow_control;
mod workers;
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
use portcullis_config::ListenerLimits;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio::task::{JoinHandle, JoinSet};

use crate::body::Body;
use flow_control::Streams;
pub(crate) use workers::Workers;
use workers::{WorkerLoad, WorkerSlot};
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
    pub(crate) http2_idle_timeout: Duration,
}

impl Limits {
    pub(crate) fn from_spec(limits: &ListenerLimits) -> Limits {
        Limits {
            max_connections: limits.max_connections() as usize,
            header_read_timeout: limits.header_read_timeout(),
            max_header_bytes: limits.max_header_bytes(),
            write_timeout: limits.write_timeout(),
            http2_idle_timeout: limits.http2_idle_timeout(),
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
        // Pings find HTTP/2 peers that vanished without closing; one that answers them but
        // opens no stream is closed by the idle timeout (`serve_connection`).
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

/// A listening socket, bound before the version that needs it is committed, with one
/// handle of it per worker thread: the same socket, in each worker's epoll. A new
/// connection wakes the idle workers and the first to `accept` takes it (the others find
/// nothing), then hands it to the least loaded worker (`workers.rs`); one `SO_REUSEPORT`
/// socket per worker would avoid those wake-ups, but a socket closed on drain would reset
/// the connections queued on it.
pub(crate) struct BoundSocket {
    local: SocketAddr,
    per_worker: Vec<(Handle, std::net::TcpListener)>,
    load: Arc<WorkerLoad>,
}

impl BoundSocket {
    pub(crate) async fn bind(address: SocketAddr, workers: &Workers) -> std::io::Result<BoundSocket> {
        let socket = TcpListener::bind(address).await?.into_std()?;
        let local = socket.local_addr()?;
        let mut per_worker = Vec::with_capacity(workers.handles().len());
        for handle in workers.handles() {
            per_worker.push((handle.clone(), socket.try_clone()?));
        }
        Ok(BoundSocket {
            local,
            per_worker,
            load: workers.load().clone(),
        })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

/// An accepting listener: an accept loop on every worker. Dropping it also stops
/// accepting and starts the drain.
pub(crate) struct RunningListener {
    stop: watch::Sender<bool>,
    /// Each fires once that worker's handle of the socket is closed (connections may
    /// still be draining); the port is free when all have.
    sockets_closed: Vec<oneshot::Receiver<()>>,
    accept_loops: Vec<JoinHandle<()>>,
    limits: Arc<ArcSwap<Limits>>,
}

impl RunningListener {
    pub(crate) fn spawn<H: Handler>(
        socket: BoundSocket,
        handler: H,
        limits: Limits,
        drain_grace: Duration,
    ) -> Self {
        let (stop, stopped) = watch::channel(false);
        let limits = Arc::new(ArcSwap::from_pointee(limits));
        let open = Arc::new(AtomicUsize::new(0));
        let mut sockets_closed = Vec::with_capacity(socket.per_worker.len());
        let mut accept_loops = Vec::with_capacity(socket.per_worker.len());
        let (inboxes, handed): (Vec<_>, Vec<_>) = socket
            .per_worker
            .iter()
            .map(|_| mpsc::unbounded_channel())
            .unzip();
        let inboxes: Arc<[mpsc::UnboundedSender<Handoff>]> = inboxes.into();
        for (index, ((worker, listener), handed)) in socket.per_worker.into_iter().zip(handed).enumerate() {
            let (closed, socket_closed) = oneshot::channel();
            sockets_closed.push(socket_closed);
            let accept = Accept {
                handler: handler.clone(),
                limits: limits.clone(),
                open: open.clone(),
                local: socket.local,
                worker: index,
                load: socket.load.clone(),
                inboxes: inboxes.clone(),
            };
            let stopped = stopped.clone();
            accept_loops.push(worker.spawn(async move {
                // Registering with the reactor needs the worker's own runtime.
                match TcpListener::from_std(listener) {
                    Ok(listener) => accept.serve(listener, handed, stopped, closed, drain_grace).await,
                    Err(error) => tracing::error!(local = %accept.local, %error, "a worker cannot accept on the listener"),
                }
            }));
        }
        RunningListener {
            stop,
            sockets_closed,
            accept_loops,
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
        let _ = self.stop.send(true);
        let accept_loops = self.accept_loops;
        tokio::spawn(async move {
            for accept_loop in accept_loops {
                match accept_loop.await {
                    Err(error) if error.is_panic() => tracing::error!(%error, "an accept loop panicked"),
                    // Cancelled: its worker stopped first, taking the connections with it.
                    Err(_) | Ok(()) => {}
                }
            }
        })
    }

    /// Like [`drain`](Self::drain), but returns once the port is free again.
    pub(crate) async fn close(mut self) -> JoinHandle<()> {
        let sockets_closed = std::mem::take(&mut self.sockets_closed);
        let drained = self.drain();
        for socket_closed in sockets_closed {
            let _ = socket_closed.await;
        }
        drained
    }
}

/// One worker's accept loop of a listener.
struct Accept<H> {
    handler: H,
    limits: Arc<ArcSwap<Limits>>,
    /// Connections open on this listener across all workers.
    open: Arc<AtomicUsize>,
    local: SocketAddr,
    /// This loop's worker, an index into `load` and `inboxes`.
    worker: usize,
    load: Arc<WorkerLoad>,
    /// Each worker's loop of this listener takes the connections handed to it here.
    inboxes: Arc<[mpsc::UnboundedSender<Handoff>]>,
}

/// An accepted connection on its way to the worker that serves it, already counted
/// against the listener's limit and on that worker. One that cannot be handed over (that
/// worker's loop has stopped) is served by the worker that accepted it.
struct Handoff {
    stream: std::net::TcpStream,
    peer: SocketAddr,
    slots: (ConnectionSlot, WorkerSlot),
}

impl<H: Handler> Accept<H> {
    async fn serve(
        self,
        listener: TcpListener,
        mut handed: mpsc::UnboundedReceiver<Handoff>,
        mut stopped: watch::Receiver<bool>,
        socket_closed: oneshot::Sender<()>,
        drain_grace: Duration,
    ) {
        // Tells this loop's connections to finish what they serve and close.
        let (drain, draining) = watch::channel(());
        let mut connections = JoinSet::new();
        let local = self.local;
        loop {
            tokio::select! {
                // A send or the sender's drop both stop the loop.
                _ = stopped.changed() => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        let Some(slot) = ConnectionSlot::take(&self.open, self.limits.load().max_connections) else {
                            tracing::debug!(%local, %peer, "connection limit reached, refusing");
                            connections.spawn(refuse(stream));
                            continue;
                        };
                        let takes = |worker: usize| self.inboxes.get(worker).is_some_and(|inbox| !inbox.is_closed());
                        let mut slots = (slot, self.load.assign(self.worker, takes));
                        // Its loop may have stopped since it was chosen.
                        let inbox = self
                            .inboxes
                            .get(slots.1.worker())
                            .filter(|inbox| slots.1.worker() != self.worker && !inbox.is_closed());
                        let Some(inbox) = inbox else {
                            if slots.1.worker() != self.worker {
                                slots.1 = self.load.count_on(self.worker);
                            }
                            self.serve_connection(stream, peer, slots, &draining, &mut connections);
                            continue;
                        };
                        // Taken out of this worker's reactor; the receiving loop registers it
                        // with its own.
                        match stream.into_std() {
                            // That loop may have stopped since (the listener drains): the
                            // connection is then served here instead.
                            Ok(stream) => {
                                if let Err(mpsc::error::SendError(handoff)) = inbox.send(Handoff { stream, peer, slots }) {
                                    self.take_handoff(handoff, &draining, &mut connections);
                                }
                            }
                            Err(error) => tracing::debug!(%peer, %error, "cannot hand the connection to another worker"),
                        }
                    }
                    Err(error) => {
                        // Usually out of file descriptors: back off instead of spinning.
                        tracing::warn!(%local, %error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                Some(handoff) = handed.recv() => self.take_handoff(handoff, &draining, &mut connections),
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
            }
        }
        drop(listener);
        // Connections other workers handed over before they stopped too are served (and
        // drained) like this loop's own; later ones stay with their acceptor.
        handed.close();
        while let Ok(handoff) = handed.try_recv() {
            self.take_handoff(handoff, &draining, &mut connections);
        }
        let _ = socket_closed.send(());
        let open = connections.len();
        let _ = drain.send(());
        let finished = async { while connections.join_next().await.is_some() {} };
        if tokio::time::timeout(drain_grace, finished).await.is_err() {
            tracing::warn!(%local, open, "drain grace elapsed, closing remaining connections");
        }
        connections.shutdown().await;
    }

    /// Serves a connection accepted by another worker, counted on this one.
    fn take_handoff(&self, handoff: Handoff, draining: &watch::Receiver<()>, connections: &mut JoinSet<()>) {
        let Handoff { stream, peer, slots } = handoff;
        let slots = match slots.1.worker() == self.worker {
            true => slots,
            false => (slots.0, self.load.count_on(self.worker)),
        };
        match TcpStream::from_std(stream) {
            Ok(stream) => self.serve_connection(stream, peer, slots, draining, connections),
            Err(error) => tracing::debug!(%peer, %error, "cannot take a connection another worker accepted"),
        }
    }

    /// Serves one connection on this worker until it closes, the drain ends it, or a watch
    /// below closes it; `slots` are given back when it ends.
    fn serve_connection(
        &self,
        stream: TcpStream,
        peer: SocketAddr,
        slots: (ConnectionSlot, WorkerSlot),
        draining: &watch::Receiver<()>,
        connections: &mut JoinSet<()>,
    ) {
        let limits = self.limits.load_full();
        // Small writes such as single SSE events must not wait for Nagle.
        let _ = stream.set_nodelay(true);
        let handler = self.handler.clone();
        let first_request = Arc::new(AtomicBool::new(false));
        let seen = first_request.clone();
        let streams = Streams::new();
        let http2 = Arc::new(Notify::new());
        let (watched, on_http2) = (streams.clone(), http2.clone());
        let service = service_fn(move |request: Request<Incoming>| {
            let handler = handler.clone();
            let first = !seen.swap(true, Ordering::Relaxed);
            let stream = (request.version() == http::Version::HTTP_2).then(|| {
                if first {
                    on_http2.notify_one();
                }
                watched.open()
            });
            async move {
                let response = handler.handle(peer, request).await;
                Ok::<_, Infallible>(match stream {
                    Some(stream) => response.map(|body| stream.watch(body)),
                    None => response,
                })
            }
        });
        let connection = limits
            .connection_builder()
            .serve_connection(
                TokioIo::new(WriteTimeout::new(stream, limits.write_timeout)),
                service,
            )
            .into_owned();
        let mut draining = draining.clone();
        connections.spawn(async move {
            let mut connection = std::pin::pin!(connection);
            // A connection must start its first request in time, whatever the protocol:
            // hyper's header timeout starts only once a connection is known to be HTTP/1.1,
            // so a silent or half-preface connection would otherwise hold a slot of the
            // connection limit for ever.
            let mut first_request_by = std::pin::pin!(tokio::time::sleep(limits.header_read_timeout));
            let mut awaiting_first = true;
            // An HTTP/2 connection is also watched, a few times per timeout, for responses
            // waiting on the client's flow-control window (see `flow_control.rs`; a stall is
            // found within 1.25 × `write_timeout`) and for going without a stream for
            // `http2_idle_timeout` (likewise within 1.25 × it).
            let mut watching = false;
            let every = limits.write_timeout.min(limits.http2_idle_timeout) / 4;
            let mut checks = tokio::time::interval(every.max(Duration::from_millis(10)));
            // Once told to close (drain or idle), hyper finishes what is under way: HTTP/2
            // sends GOAWAY, HTTP/1.1 closes after the response in flight.
            let mut closing = false;
            let result = loop {
                tokio::select! {
                    result = connection.as_mut() => break Some(result),
                    _ = draining.changed(), if !closing => {
                        connection.as_mut().graceful_shutdown();
                        closing = true;
                    }
                    () = &mut first_request_by, if awaiting_first => {
                        if !first_request.load(Ordering::Relaxed) {
                            tracing::debug!(%peer, "no request within the header read timeout, closing");
                            break None;
                        }
                        awaiting_first = false;
                    }
                    () = http2.notified(), if !watching => watching = true,
                    _ = checks.tick(), if watching => {
                        if streams.stalled(limits.write_timeout) {
                            tracing::debug!(%peer, write_timeout = ?limits.write_timeout, "the client granted no flow-control window for the write timeout, closing");
                            break None;
                        }
                        if !closing && streams.idle_for().is_some_and(|idle| idle >= limits.http2_idle_timeout) {
                            tracing::debug!(%peer, idle_timeout = ?limits.http2_idle_timeout, "no stream for the HTTP/2 idle timeout, closing");
                            connection.as_mut().graceful_shutdown();
                            closing = true;
                        }
                    }
                }
            };
            if let Some(Err(error)) = result {
                tracing::debug!(%peer, %error, "connection ended with an error");
            }
            drop(slots);
        });
    }
}

/// One open connection counted against the limit; released when dropped, so a task that
/// ends early (or panics) still gives its slot back.
struct ConnectionSlot(Arc<AtomicUsize>);

impl ConnectionSlot {
    /// `None` when the listener is at `max` already; workers accept concurrently, so the
    /// check and the count are one atomic step.
    fn take(open: &Arc<AtomicUsize>, max: usize) -> Option<ConnectionSlot> {
        open.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |count| {
            (count < max).then_some(count + 1)
        })
        .ok()?;
        Some(ConnectionSlot(open.clone()))
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

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt;

    use super::*;

    /// Answers with the name of the worker thread that serves the connection.
    #[derive(Clone)]
    struct ThreadName;

    impl Handler for ThreadName {
        async fn handle(&self, _: SocketAddr, _: Request<Incoming>) -> Response<Body> {
            let name = std::thread::current().name().unwrap_or("unnamed").to_string();
            Response::new(crate::body::full(name))
        }
    }

    async fn served_by(connection: &mut TcpStream) -> String {
        connection
            .write_all(b"GET / HTTP/1.1\r\nhost: test\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let mut buffer = [0; 1024];
        while !answer
            .windows(b"portcullis-worker-".len())
            .any(|window| window == b"portcullis-worker-")
            || !answer.last().is_some_and(u8::is_ascii_digit)
        {
            let read = connection.read(&mut buffer).await.unwrap();
            assert!(
                read > 0,
                "closed before answering: {}",
                String::from_utf8_lossy(&answer)
            );
            answer.extend_from_slice(&buffer[..read]);
        }
        let answer = String::from_utf8(answer).unwrap();
        answer.rsplit("\r\n\r\n").next().unwrap().to_string()
    }

    #[tokio::test]
    async fn a_burst_of_connections_is_spread_over_the_workers() {
        let mut workers = Workers::start(2).unwrap();
        let socket = BoundSocket::bind("127.0.0.1:0".parse().unwrap(), &workers)
            .await
            .unwrap();
        let address = socket.local_addr();
        let listener = RunningListener::spawn(socket, ThreadName, Limits::admin(), Duration::from_secs(1));

        // All connected before any is served, as a load generator or a client pool does:
        // whichever worker wakes first accepts them all.
        let mut connections = Vec::new();
        for _ in 0..8 {
            connections.push(TcpStream::connect(address).await.unwrap());
        }
        let mut per_worker = std::collections::BTreeMap::<String, usize>::new();
        for connection in &mut connections {
            *per_worker.entry(served_by(connection).await).or_default() += 1;
        }
        assert_eq!(
            per_worker.into_iter().collect::<Vec<_>>(),
            [
                ("portcullis-worker-0".to_string(), 4),
                ("portcullis-worker-1".to_string(), 4)
            ]
        );

        drop(connections);
        listener.close().await.await.unwrap();
        workers.stop().await;
    }
}
