//! Reference forwarders for `loadtest/http-bench.sh`: the least work an HTTP/1.1 reverse proxy
//! on tokio does per request, measured in the same run as Portcullis and nginx, so that the
//! benchmark tells how much of a proxy's CPU is the runtime and the HTTP codec and how much
//! its own layers (routing, policies, limits, timeouts, telemetry).
//!
//! **Not a proxy to run.** No routing, no limits, no timeouts; messages framed by
//! `Content-Length` only in the one-pass engine (a chunked message, a response without a
//! length, a `1xx` or an oversized message is refused: `400` to the client for its own,
//! `502` for the upstream's, and the connection closed) — exactly enough for the benchmark's
//! GETs against an nginx origin. What each engine does per request, alike: drop the
//! hop-by-hop headers (RFC 9110 §7.6.1), set `X-Forwarded-For`, keep upstream connections
//! alive in a pool of the thread.
//!
//! Both engines run as Portcullis's proxy does (`dataplane/src/listener/workers.rs`): one
//! current-thread runtime per thread, every thread accepting from the one listening socket
//! and handing each connection to the thread with the fewest open, so that a connection and
//! its upstream connections stay on one thread and a burst of connects is spread evenly:
//!
//! * [`Engine::OnePass`]: the client connection's task parses a request head with `httparse`,
//!   writes it to an upstream connection, reads the response and writes it back: one task per
//!   client connection and nothing else, the shape of nginx's event loop.
//! * [`Engine::Hyper`]: hyper's HTTP/1 server connection, and its client connection
//!   (`hyper::client::conn::http1`) driven by a task of its own, the pool keeping its
//!   senders; bodies are collected whole, up to the same limit (2 bytes here), and framed as
//!   hyper frames them (chunked too). The two hyper dispatchers Portcullis has, without
//!   anything of Portcullis between them.
//!
//! Both skip pooled connections they have seen closed. When a reused one closes under a
//! request, the one-pass engine sends the request once more on a new connection if nothing
//! came back and its method is idempotent (RFC 9110 §9.2.2); the hyper engine only when
//! hyper had not started sending it. Past that an upstream failure is a `502`, after which
//! the one-pass engine closes the client's connection and the hyper engine keeps it.

use std::cell::RefCell;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::rc::Rc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use futures::FutureExt;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

/// A message (head and body) larger than this is refused rather than buffered.
const MAX_MESSAGE_BYTES: usize = 1 << 20;
const BUFFER_BYTES: usize = 8 << 10;
/// How long a thread waits after an accept fails for want of descriptors or memory.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// Headers a message may carry; more is refused.
const MAX_HEADERS: usize = 64;
/// Connection-specific headers, which a proxy does not forward (RFC 9110 §7.6.1).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
];

#[derive(clap::Args, Debug)]
pub struct FloorArgs {
    #[arg(long, default_value = "127.0.0.1:18090")]
    pub listen: SocketAddr,
    /// The origin every request goes to.
    #[arg(long)]
    pub upstream: SocketAddr,
    #[arg(long, value_enum, default_value = "one-pass")]
    pub engine: Engine,
    /// Threads, each with its own runtime; 0 means one per core (as the proxy's workers).
    #[arg(long, env = "PORTCULLIS_WORKERS", default_value_t = 0)]
    pub threads: usize,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    OnePass,
    Hyper,
}

/// Binds `args.listen` and starts the threads; returns the address bound (its port chosen
/// by the kernel when `args.listen` has port 0). The threads serve until the process exits.
pub fn start(args: &FloorArgs) -> anyhow::Result<SocketAddr> {
    let threads = match NonZeroUsize::new(args.threads) {
        Some(threads) => threads.get(),
        None => std::thread::available_parallelism().map_or(1, NonZeroUsize::get),
    };
    let listener =
        std::net::TcpListener::bind(args.listen).with_context(|| format!("cannot bind {}", args.listen))?;
    listener.set_nonblocking(true)?;
    let address = listener.local_addr()?;
    let open = Arc::new(Load(Mutex::new(vec![0; threads])));
    let (hand_offs, inboxes): (Vec<_>, Vec<_>) = (0..threads)
        .map(|_| tokio::sync::mpsc::unbounded_channel())
        .unzip();
    for (index, inbox) in inboxes.into_iter().enumerate() {
        let thread = Thread {
            index,
            listener: listener.try_clone()?,
            inbox,
            hand_offs: hand_offs.clone(),
            open: open.clone(),
            engine: args.engine,
            upstream: args.upstream,
        };
        std::thread::Builder::new()
            .name(format!("floor-{index}"))
            .spawn(move || {
                if let Err(error) = thread.serve() {
                    tracing::warn!(%error, "a forwarder thread stopped");
                }
            })
            .context("starting a forwarder thread")?;
    }
    Ok(address)
}

/// A connection handed from the thread that accepted it to the one that serves it, counted
/// on the latter.
type HandOff = (std::net::TcpStream, SocketAddr, Slot);

struct Thread {
    index: usize,
    listener: std::net::TcpListener,
    inbox: UnboundedReceiver<HandOff>,
    hand_offs: Vec<UnboundedSender<HandOff>>,
    open: Arc<Load>,
    engine: Engine,
    upstream: SocketAddr,
}

impl Thread {
    fn serve(self) -> anyhow::Result<()> {
        let Thread {
            index,
            listener,
            mut inbox,
            hand_offs,
            open,
            engine,
            upstream,
        } = self;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let tasks = tokio::task::LocalSet::new();
        tasks.block_on(&runtime, async move {
            let listener = TcpListener::from_std(listener)?;
            let pools = Pools::default();
            loop {
                let (client, peer, slot) = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((client, peer)) => {
                            let slot = open.assign(index, |thread| !hand_offs[thread].is_closed());
                            if slot.thread == index {
                                (client, peer, slot)
                            } else {
                                // Served where it was accepted when the hand-off fails.
                                let target = slot.thread;
                                match client.into_std() {
                                    Ok(std_client) => match hand_offs[target].send((std_client, peer, slot)) {
                                        Ok(()) => continue,
                                        Err(returned) => {
                                            let (std_client, peer, _uncounted) = returned.0;
                                            match TcpStream::from_std(std_client) {
                                                Ok(client) => (client, peer, open.count_on(index)),
                                                Err(_) => continue,
                                            }
                                        }
                                    },
                                    Err(_) => continue,
                                }
                            }
                        }
                        Err(error) => {
                            tracing::debug!(%error, "accept failed");
                            // One client's failure is not a reason to wait; running out of
                            // descriptors or memory is, since the socket stays readable.
                            if !matches!(
                                error.kind(),
                                io::ErrorKind::ConnectionAborted
                                    | io::ErrorKind::ConnectionReset
                                    | io::ErrorKind::Interrupted
                            ) {
                                tokio::time::sleep(ACCEPT_BACKOFF).await;
                            }
                            continue;
                        }
                    },
                    Some((client, peer, slot)) = inbox.recv() => match TcpStream::from_std(client) {
                        Ok(client) => (client, peer, slot),
                        Err(error) => {
                            tracing::debug!(%error, "a handed-off connection could not be registered");
                            continue;
                        }
                    },
                };
                let _ = client.set_nodelay(true);
                let (engine, upstream, pools) = (engine, upstream, pools.clone());
                tokio::task::spawn_local(async move {
                    match engine {
                        Engine::OnePass => {
                            if let Err(error) = one_pass(client, peer, upstream, pools.streams).await {
                                tracing::debug!(%error, "connection ended with an error");
                            }
                        }
                        Engine::Hyper => hyper_connection(client, peer, upstream, pools.senders).await,
                    }
                    drop(slot);
                });
            }
        })
    }
}

/// Open connections per thread. A lock, not atomics: choosing the least loaded thread and
/// counting the connection on it must be one step, or two threads accepting at once both
/// choose the same one.
struct Load(Mutex<Vec<usize>>);

impl Load {
    /// Counts a new connection on the thread with the fewest open among those that `take`
    /// connections, the accepting thread when it is among them.
    fn assign(self: &Arc<Self>, accepting: usize, take: impl Fn(usize) -> bool) -> Slot {
        let mut open = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let fewest = (0..open.len())
            .filter(|&thread| thread == accepting || take(thread))
            .min_by_key(|&thread| (open[thread], thread != accepting))
            .unwrap_or(accepting);
        open[fewest] += 1;
        Slot {
            load: self.clone(),
            thread: fewest,
        }
    }

    fn count_on(self: &Arc<Self>, thread: usize) -> Slot {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)[thread] += 1;
        Slot {
            load: self.clone(),
            thread,
        }
    }
}

/// One open connection counted on a thread; uncounted when its task ends.
struct Slot {
    load: Arc<Load>,
    thread: usize,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.load.0.lock().unwrap_or_else(PoisonError::into_inner);
        open[self.thread] = open[self.thread].saturating_sub(1);
    }
}

/// A thread's idle upstream connections, for the engine it runs.
#[derive(Clone, Default)]
struct Pools {
    streams: Rc<RefCell<Vec<TcpStream>>>,
    senders: Senders,
}

async fn connect(upstream: SocketAddr) -> io::Result<TcpStream> {
    let stream = TcpStream::connect(upstream).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

// --- one pass -----------------------------------------------------------------------------

/// Why a message is not forwarded.
#[derive(Debug)]
enum Refused {
    Malformed,
    /// Chunked (or any transfer coding), `1xx`, or more than [`MAX_MESSAGE_BYTES`]: beyond
    /// what this forwarder frames.
    Unsupported,
}

/// What one request and its response say about the exchange, beyond their bytes.
#[derive(Default)]
struct Exchange {
    is_head: bool,
    /// Safe to send again when a reused connection closed before answering (RFC 9110 §9.2.2).
    idempotent: bool,
    /// `Connection: close`, or HTTP/1.0: the client's connection ends after the response.
    client_closes: bool,
    upstream_closes: bool,
}

/// Whether a message's `Connection` header asks to close (RFC 9112 §9.6).
fn asks_to_close(headers: &[httparse::Header]) -> bool {
    headers
        .iter()
        .filter(|header| header.name.eq_ignore_ascii_case("connection"))
        .flat_map(|header| header.value.split(|byte| *byte == b','))
        .any(|token| token.trim_ascii().eq_ignore_ascii_case(b"close"))
}

/// A parse of the bytes read so far.
enum Parsed {
    /// The whole message is in the buffer: this many bytes of it.
    Complete(usize),
    Partial,
}

async fn one_pass(
    mut client: TcpStream,
    peer: SocketAddr,
    upstream: SocketAddr,
    pool: Rc<RefCell<Vec<TcpStream>>>,
) -> io::Result<()> {
    let forwarded_for = peer.ip().to_string();
    let mut from_client = Vec::with_capacity(BUFFER_BYTES);
    let mut to_upstream = Vec::with_capacity(BUFFER_BYTES);
    let mut from_upstream = Vec::with_capacity(BUFFER_BYTES);
    let mut to_client = Vec::with_capacity(BUFFER_BYTES);
    loop {
        let mut facts = Exchange::default();
        let request = read_message(&mut client, &mut from_client, |buffer| {
            to_upstream.clear();
            encode_request(buffer, &forwarded_for, &mut to_upstream, &mut facts)
        })
        .await;
        let consumed = match request {
            Ok(Some(consumed)) => consumed,
            Ok(None) => return Ok(()),
            Err(_) => return refuse(client, StatusCode::BAD_REQUEST).await,
        };
        from_client.drain(..consumed);

        // A pooled connection the upstream closed while idle may look open until it is
        // read: an idempotent request goes once more, on a new connection, if it got no byte
        // back.
        let mut pooled = take_idle(&pool);
        let response = loop {
            let resendable = pooled.is_some() && facts.idempotent;
            let mut connection = match pooled.take() {
                Some(connection) => connection,
                None => match connect(upstream).await {
                    Ok(connection) => connection,
                    Err(_) => return refuse(client, StatusCode::BAD_GATEWAY).await,
                },
            };
            if connection.write_all(&to_upstream).await.is_err() {
                if resendable {
                    continue;
                }
                return refuse(client, StatusCode::BAD_GATEWAY).await;
            }
            from_upstream.clear();
            let response = read_message(&mut connection, &mut from_upstream, |buffer| {
                to_client.clear();
                encode_response(buffer, &mut facts, &mut to_client)
            })
            .await;
            match response {
                Ok(None) if resendable => continue,
                Ok(Some(consumed)) => break Some((consumed, connection)),
                Ok(None) | Err(_) => break None,
            }
        };
        match response {
            // Whatever followed the response would be a second one nobody asked for.
            Some((consumed, connection)) if consumed == from_upstream.len() && !facts.upstream_closes => {
                pool.borrow_mut().push(connection)
            }
            Some(_) => {}
            None => return refuse(client, StatusCode::BAD_GATEWAY).await,
        }
        client.write_all(&to_client).await?;
        if facts.client_closes {
            return client.shutdown().await;
        }
    }
}

/// The connection that went idle last whose upstream has not closed it, as far as the
/// runtime has seen (no system call). On epoll and kqueue targets tokio clears a socket's
/// readiness when a read comes back short or would block (unless a newer event came in), so an idle connection that reads as readable has news: a close, or
/// bytes nobody asked for. (A last read that filled the buffer exactly leaves it readable
/// too: that costs a new connection, never a wrong answer.)
fn take_idle(pool: &Rc<RefCell<Vec<TcpStream>>>) -> Option<TcpStream> {
    std::iter::from_fn(|| pool.borrow_mut().pop())
        .find(|connection| connection.ready(Interest::READABLE).now_or_never().is_none())
}

/// Reads from `stream` into `buffer` until `parse` finds a whole message; `Ok(None)` when the
/// peer closed (or reset) the connection before sending any byte of one.
async fn read_message(
    stream: &mut TcpStream,
    buffer: &mut Vec<u8>,
    mut parse: impl FnMut(&[u8]) -> Result<Parsed, Refused>,
) -> Result<Option<usize>, Refused> {
    loop {
        if !buffer.is_empty() {
            if let Parsed::Complete(consumed) = parse(buffer)? {
                return Ok(Some(consumed));
            }
            if buffer.len() > MAX_MESSAGE_BYTES {
                return Err(Refused::Unsupported);
            }
        }
        match stream.read_buf(buffer).await {
            Ok(0) | Err(_) if buffer.is_empty() => return Ok(None),
            Ok(0) | Err(_) => return Err(Refused::Malformed),
            Ok(_) => {}
        }
    }
}

/// The message's `Content-Length`, if it has one; a transfer coding is not framed here.
fn content_length(headers: &[httparse::Header]) -> Result<Option<usize>, Refused> {
    let mut length = None;
    for header in headers {
        if header.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(Refused::Unsupported);
        }
        if header.name.eq_ignore_ascii_case("content-length") {
            let digits = header.value.trim_ascii();
            if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
                return Err(Refused::Malformed);
            }
            let value = std::str::from_utf8(digits)
                .ok()
                .and_then(|digits| digits.parse::<usize>().ok())
                .filter(|value| *value <= MAX_MESSAGE_BYTES)
                .ok_or(Refused::Unsupported)?;
            // Two different lengths leave the framing ambiguous (RFC 9112 §6.3).
            if length.is_some_and(|length| length != value) {
                return Err(Refused::Malformed);
            }
            length = Some(value);
        }
    }
    Ok(length)
}

fn is_hop_by_hop(name: &str) -> bool {
    HOP_BY_HOP.iter().any(|hop| name.eq_ignore_ascii_case(hop))
}

fn push_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

fn encode_request(
    buffer: &[u8],
    forwarded_for: &str,
    out: &mut Vec<u8>,
    facts: &mut Exchange,
) -> Result<Parsed, Refused> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    let head = match request.parse(buffer) {
        Ok(httparse::Status::Complete(head)) => head,
        Ok(httparse::Status::Partial) => return Ok(Parsed::Partial),
        Err(_) => return Err(Refused::Malformed),
    };
    // A request without a length has no body (RFC 9112 §6.3); both parts are capped, so the
    // sum cannot overflow.
    let total = head + content_length(request.headers)?.unwrap_or(0);
    if buffer.len() < total {
        return Ok(Parsed::Partial);
    }
    let (Some(method), Some(path)) = (request.method, request.path) else {
        return Err(Refused::Malformed);
    };
    facts.is_head = method == "HEAD";
    facts.idempotent = matches!(method, "GET" | "HEAD" | "OPTIONS" | "TRACE" | "PUT" | "DELETE");
    facts.client_closes = request.version == Some(0) || asks_to_close(request.headers);
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for header in request.headers.iter() {
        if !is_hop_by_hop(header.name) && !header.name.eq_ignore_ascii_case("x-forwarded-for") {
            push_header(out, header.name.as_bytes(), header.value);
        }
    }
    push_header(out, b"x-forwarded-for", forwarded_for.as_bytes());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&buffer[head..total]);
    Ok(Parsed::Complete(total))
}

fn encode_response(buffer: &[u8], facts: &mut Exchange, out: &mut Vec<u8>) -> Result<Parsed, Refused> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut headers);
    let head = match response.parse(buffer) {
        Ok(httparse::Status::Complete(head)) => head,
        Ok(httparse::Status::Partial) => return Ok(Parsed::Partial),
        Err(_) => return Err(Refused::Malformed),
    };
    let Some(code) = response.code else {
        return Err(Refused::Malformed);
    };
    if code < 200 {
        return Err(Refused::Unsupported);
    }
    // No body after a HEAD request's response, nor in a 204 or 304 (RFC 9112 §6.3).
    let body = if facts.is_head || code == 204 || code == 304 {
        0
    } else {
        // Without a length the body runs to the connection's close: not framed here.
        content_length(response.headers)?.ok_or(Refused::Unsupported)?
    };
    let total = head + body;
    if buffer.len() < total {
        return Ok(Parsed::Partial);
    }
    facts.upstream_closes = response.version == Some(0) || asks_to_close(response.headers);
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(code.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(response.reason.unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    for header in response.headers.iter() {
        if !is_hop_by_hop(header.name) {
            push_header(out, header.name.as_bytes(), header.value);
        }
    }
    if facts.client_closes {
        push_header(out, b"connection", b"close");
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(&buffer[head..total]);
    Ok(Parsed::Complete(total))
}

/// Answers `status` with an empty body and closes the connection.
async fn refuse(mut client: TcpStream, status: StatusCode) -> io::Result<()> {
    let answer = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
    client.write_all(answer.as_bytes()).await?;
    client.shutdown().await
}

// --- hyper --------------------------------------------------------------------------------

type Senders = Rc<RefCell<Vec<SendRequest<Full<Bytes>>>>>;

async fn hyper_connection(client: TcpStream, peer: SocketAddr, upstream: SocketAddr, pool: Senders) {
    let forwarded_for = match HeaderValue::try_from(peer.ip().to_string()) {
        Ok(value) => value,
        Err(_) => return,
    };
    let service = hyper::service::service_fn(move |request| {
        forward(request, forwarded_for.clone(), upstream, pool.clone())
    });
    if let Err(error) = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(client), service)
        .await
    {
        tracing::debug!(%error, "connection ended with an error");
    }
}

async fn forward(
    request: Request<Incoming>,
    forwarded_for: HeaderValue,
    upstream: SocketAddr,
    pool: Senders,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let answer = match forward_to(request, forwarded_for, upstream, &pool).await {
        Ok(response) => response,
        Err(error) => {
            tracing::debug!(%error, "forwarding failed");
            let mut response = Response::new(Full::default());
            *response.status_mut() = StatusCode::BAD_GATEWAY;
            response
        }
    };
    Ok(answer)
}

async fn forward_to(
    request: Request<Incoming>,
    forwarded_for: HeaderValue,
    upstream: SocketAddr,
    pool: &Senders,
) -> anyhow::Result<Response<Full<Bytes>>> {
    let (mut parts, body) = request.into_parts();
    let body = collect(body).await?;
    for hop in HOP_BY_HOP {
        parts.headers.remove(hop);
    }
    parts.headers.insert("x-forwarded-for", forwarded_for);
    let mut request = Request::from_parts(parts, Full::new(body));
    // A sender whose connection the upstream closed while idle is dropped, not used; one that
    // closes under the request gives it back unsent, and it goes once more on a new connection.
    let mut pooled = std::iter::from_fn(|| pool.borrow_mut().pop()).find(|sender| !sender.is_closed());
    let (response, sender) = loop {
        let reused = pooled.is_some();
        let mut sender = match pooled.take() {
            Some(sender) => sender,
            None => {
                let (sender, connection) =
                    hyper::client::conn::http1::handshake(TokioIo::new(connect(upstream).await?)).await?;
                tokio::task::spawn_local(connection);
                sender
            }
        };
        // hyper takes the connection back from the last response only when its task next runs.
        if let Err(error) = sender.ready().await {
            if reused {
                continue;
            }
            return Err(error.into());
        }
        match sender.try_send_request(request).await {
            Ok(response) => break (response, sender),
            Err(mut error) => match error.take_message() {
                Some(unsent) if reused => request = unsent,
                _ => return Err(error.into_error().into()),
            },
        }
    };
    let (mut parts, body) = response.into_parts();
    let body = collect(body).await?;
    // Taken back only now that its response is read whole, so the next request can go at once;
    // not when the upstream said it closes the connection.
    if !sender.is_closed() {
        pool.borrow_mut().push(sender);
    }
    for hop in HOP_BY_HOP {
        parts.headers.remove(hop);
    }
    Ok(Response::from_parts(parts, Full::new(body)))
}

/// The body, whole, up to [`MAX_MESSAGE_BYTES`].
async fn collect(body: Incoming) -> anyhow::Result<Bytes> {
    let collected = http_body_util::Limited::new(body, MAX_MESSAGE_BYTES)
        .collect()
        .await
        .map_err(|error| anyhow::anyhow!("{error}"))?;
    Ok(collected.to_bytes())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::mpsc::unbounded_channel;

    use super::*;

    const ENGINES: [Engine; 2] = [Engine::OnePass, Engine::Hyper];

    /// Sends `request` and reads until the forwarder closes the connection.
    async fn exchange(address: SocketAddr, request: &[u8]) -> String {
        let talk = async {
            let mut stream = TcpStream::connect(address).await.unwrap();
            stream.write_all(request).await.unwrap();
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer).await.unwrap();
            String::from_utf8(answer).unwrap()
        };
        tokio::time::timeout(Duration::from_secs(10), talk)
            .await
            .expect("the forwarder neither answered nor closed")
    }

    fn forwarder(engine: Engine, upstream: SocketAddr) -> SocketAddr {
        start(&FloorArgs {
            listen: "127.0.0.1:0".parse().unwrap(),
            upstream,
            engine,
            threads: 2,
        })
        .unwrap()
    }

    async fn echo_origin() -> SocketAddr {
        let origin = crate::echo::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let address = origin.local_addr().unwrap();
        tokio::spawn(crate::echo::serve(origin, "origin".to_string()));
        address
    }

    /// When a raw origin closes a connection, without saying so (as a server's idle timeout
    /// does).
    #[derive(Clone, Copy, PartialEq)]
    enum Closes {
        Never,
        /// On reading a connection's second request, unanswered.
        AtTheSecondRequest,
    }

    /// An origin that hands the test every request head it reads, as sent, and answers each
    /// with `answer`, closing connections as `closes` says.
    async fn raw_origin(answer: &'static [u8], closes: Closes) -> (SocketAddr, UnboundedReceiver<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (heads, received) = unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let heads = heads.clone();
                tokio::spawn(async move {
                    let mut buffer = Vec::new();
                    let mut requests = 0;
                    loop {
                        while let Some(end) = buffer.windows(4).position(|window| window == b"\r\n\r\n") {
                            let _ = heads.send(String::from_utf8_lossy(&buffer[..end]).into_owned());
                            buffer.drain(..end + 4);
                            requests += 1;
                            if closes == Closes::AtTheSecondRequest && requests == 2 {
                                return;
                            }
                            if stream.write_all(answer).await.is_err() {
                                return;
                            }
                        }
                        if stream.read_buf(&mut buffer).await.unwrap_or(0) == 0 {
                            return;
                        }
                    }
                });
            }
        });
        (address, received)
    }

    #[tokio::test]
    async fn each_engine_forwards_requests_and_bodies_on_one_upstream_connection() {
        let origin = echo_origin().await;
        for engine in ENGINES {
            // Two requests on one connection; the second closes it so that the answer ends.
            let answer = exchange(
                forwarder(engine, origin),
                b"POST /first HTTP/1.1\r\nhost: test\r\ncontent-length: 5\r\n\r\nhello\
                  GET /second HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n",
            )
            .await;
            let bodies: Vec<serde_json::Value> = answer
                .split("\r\n\r\n")
                .filter_map(|part| part.lines().next())
                .filter_map(|line| serde_json::from_str(line).ok())
                .collect();
            assert_eq!(bodies.len(), 2, "{engine:?}: {answer}");
            assert_eq!(bodies[0]["uri"], "/first", "{engine:?}");
            assert_eq!(bodies[0]["body"], "hello", "{engine:?}");
            assert_eq!(bodies[1]["uri"], "/second", "{engine:?}");
            // The origin saw both on one connection: the pool gave it back and took it again.
            assert_eq!(bodies[0]["peer"], bodies[1]["peer"], "{engine:?}");
        }
    }

    #[tokio::test]
    async fn each_engine_replaces_forwarded_for_and_drops_hop_by_hop_headers() {
        for engine in ENGINES {
            let (origin, mut heads) =
                raw_origin(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", Closes::Never).await;
            let answer = exchange(
                forwarder(engine, origin),
                b"GET / HTTP/1.1\r\nhost: test\r\nx-forwarded-for: 10.9.9.9\r\nkeep-alive: timeout=5\r\nconnection: close\r\n\r\n",
            )
            .await;
            assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{engine:?}: {answer}");
            let head = tokio::time::timeout(Duration::from_secs(10), heads.recv())
                .await
                .expect("the origin got no request")
                .unwrap()
                .to_ascii_lowercase();
            assert!(head.contains("x-forwarded-for: 127.0.0.1"), "{engine:?}: {head}");
            assert!(!head.contains("10.9.9.9"), "{engine:?}: {head}");
            assert!(!head.contains("keep-alive"), "{engine:?}: {head}");
            assert!(!head.contains("connection"), "{engine:?}: {head}");
        }
    }

    /// Sends `requests` one after another on one connection; the answers, as read.
    async fn one_by_one(floor: SocketAddr, requests: &[&[u8]]) -> String {
        let mut stream = TcpStream::connect(floor).await.unwrap();
        let mut answers = String::new();
        for request in requests {
            stream.write_all(request).await.unwrap();
            let mut answer = [0; 1024];
            let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut answer))
                .await
                .expect("no answer")
                .unwrap();
            answers.push_str(&String::from_utf8_lossy(&answer[..read]));
        }
        answers
    }

    #[tokio::test]
    async fn one_pass_sends_an_idempotent_request_again_when_a_reused_connection_closes_under_it() {
        let (origin, _heads) = raw_origin(
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
            Closes::AtTheSecondRequest,
        )
        .await;
        let floor = forwarder(Engine::OnePass, origin);
        let get = &b"GET / HTTP/1.1\r\nhost: test\r\n\r\n"[..];
        let answers = one_by_one(floor, &[get, get]).await;
        assert_eq!(answers.matches("HTTP/1.1 200 OK\r\n").count(), 2, "{answers}");

        // The origin may have acted on a POST it did not answer: it is not sent twice. (A
        // forwarder of its own, so that its pool holds no connection from the above.)
        let (origin, _heads) = raw_origin(
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
            Closes::AtTheSecondRequest,
        )
        .await;
        let floor = forwarder(Engine::OnePass, origin);
        let post = &b"POST / HTTP/1.1\r\nhost: test\r\ncontent-length: 0\r\n\r\n"[..];
        let answers = one_by_one(floor, &[post, post]).await;
        assert!(answers.starts_with("HTTP/1.1 200 OK\r\n"), "{answers}");
        assert!(answers.contains("HTTP/1.1 502 "), "{answers}");
    }

    #[tokio::test]
    async fn one_pass_refuses_what_it_cannot_frame_instead_of_misframing_it() {
        let origin = echo_origin().await;
        let floor = forwarder(Engine::OnePass, origin);
        for request in [
            &b"POST / HTTP/1.1\r\nhost: test\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nhost: test\r\ncontent-length: 99999999999999999999999\r\n\r\n",
            b"POST / HTTP/1.1\r\nhost: test\r\ncontent-length: +5\r\n\r\nhello",
        ] {
            let answer = exchange(floor, request).await;
            assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
            assert!(!answer.contains("origin"), "forwarded: {answer}");
        }

        // A response whose body runs to the connection's close.
        let (origin, _heads) = raw_origin(b"HTTP/1.1 200 OK\r\n\r\nunframed", Closes::Never).await;
        let answer = exchange(
            forwarder(Engine::OnePass, origin),
            b"GET / HTTP/1.1\r\nhost: test\r\n\r\n",
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 502 "), "{answer}");
        assert!(!answer.contains("unframed"), "{answer}");
    }
}
