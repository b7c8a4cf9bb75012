//! Reference forwarders for `loadtest/http-bench.sh`: the least work an HTTP/1.1 reverse proxy
//! on tokio does per request, measured in the same run as Portcullis and nginx, so that the
//! benchmark tells how much of a proxy's CPU is the runtime and the HTTP codec and how much
//! its own layers (routing, policies, limits, timeouts, telemetry).
//!
//! **Not a proxy to run.** No routing, no limits, no timeouts, no retries; messages framed by
//! `Content-Length` only (a chunked message, a `1xx` or an oversized one is refused: `400` to
//! the client, `502` for the upstream's, and the connection closed) — exactly enough for the
//! benchmark's GETs against an nginx origin. What each engine does per request, alike: drop
//! the hop-by-hop headers (RFC 9110 §7.6.1), set `X-Forwarded-For`, keep upstream connections
//! alive in a pool of the thread.
//!
//! Both engines run one current-thread runtime per thread, each thread accepting from a socket
//! of its own bound with `SO_REUSEPORT`, so the kernel spreads connections over the threads
//! and a connection and its upstream connections stay on one thread (Portcullis's worker
//! model, `dataplane/src/listener/workers.rs`):
//!
//! * [`Engine::OnePass`]: the client connection's task parses a request head with `httparse`,
//!   writes it to an upstream connection, reads the response and writes it back: one task per
//!   client connection and nothing else, the shape of nginx's event loop.
//! * [`Engine::Hyper`]: hyper's HTTP/1 server connection, and its client connection
//!   (`hyper::client::conn::http1`) driven by a task of its own, the pool keeping its
//!   senders; bodies are collected whole (2 bytes here). The two hyper dispatchers Portcullis
//!   has, without anything of Portcullis between them.

use std::cell::RefCell;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::rc::Rc;

use anyhow::Context;
use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A message (head and body) larger than this is refused rather than buffered.
const MAX_MESSAGE_BYTES: usize = 1 << 20;
const BUFFER_BYTES: usize = 8 << 10;
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
    /// Threads, each with its own runtime and listening socket; 0 means one per core.
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    OnePass,
    Hyper,
}

/// Binds `args.listen` once per thread and starts the threads; returns the address bound
/// (its port chosen by the kernel when `args.listen` has port 0). The threads serve until
/// the process exits.
pub fn start(args: &FloorArgs) -> anyhow::Result<SocketAddr> {
    let threads = match NonZeroUsize::new(args.threads) {
        Some(threads) => threads.get(),
        None => std::thread::available_parallelism().map_or(1, NonZeroUsize::get),
    };
    let first = reuse_port_listener(args.listen)?;
    let address = first.local_addr()?;
    let mut sockets = vec![first];
    for _ in 1..threads {
        sockets.push(reuse_port_listener(address)?);
    }
    for (index, socket) in sockets.into_iter().enumerate() {
        let (engine, upstream) = (args.engine, args.upstream);
        std::thread::Builder::new()
            .name(format!("floor-{index}"))
            .spawn(move || {
                if let Err(error) = serve_thread(socket, engine, upstream) {
                    tracing::warn!(%error, "a forwarder thread stopped");
                }
            })
            .context("starting a forwarder thread")?;
    }
    Ok(address)
}

fn reuse_port_listener(address: SocketAddr) -> anyhow::Result<std::net::TcpListener> {
    let socket = socket2::Socket::new(socket2::Domain::for_address(address), socket2::Type::STREAM, None)?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket
        .bind(&address.into())
        .with_context(|| format!("cannot bind {address}"))?;
    socket.listen(1024)?;
    Ok(socket.into())
}

fn serve_thread(socket: std::net::TcpListener, engine: Engine, upstream: SocketAddr) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let tasks = tokio::task::LocalSet::new();
    tasks.block_on(&runtime, async move {
        let listener = TcpListener::from_std(socket)?;
        let streams = Rc::new(RefCell::new(Vec::new()));
        let senders = Rc::new(RefCell::new(Vec::new()));
        loop {
            let (client, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::debug!(%error, "accept failed");
                    continue;
                }
            };
            let _ = client.set_nodelay(true);
            match engine {
                Engine::OnePass => {
                    let pool = streams.clone();
                    tokio::task::spawn_local(async move {
                        if let Err(error) = one_pass(client, peer, upstream, pool).await {
                            tracing::debug!(%error, "connection ended with an error");
                        }
                    });
                }
                Engine::Hyper => {
                    tokio::task::spawn_local(hyper_connection(client, peer, upstream, senders.clone()));
                }
            }
        }
    })
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
    let mut from_upstream = Vec::with_capacity(BUFFER_BYTES);
    let mut out = Vec::with_capacity(BUFFER_BYTES);
    loop {
        let mut facts = Exchange::default();
        let request = read_message(&mut client, &mut from_client, |buffer| {
            out.clear();
            encode_request(buffer, &forwarded_for, &mut out, &mut facts)
        })
        .await;
        let consumed = match request {
            Ok(Some(consumed)) => consumed,
            Ok(None) => return Ok(()),
            Err(_) => return refuse(client, StatusCode::BAD_REQUEST).await,
        };
        from_client.drain(..consumed);

        let pooled = pool.borrow_mut().pop();
        let mut connection = match pooled {
            Some(connection) => connection,
            None => connect(upstream).await?,
        };
        connection.write_all(&out).await?;
        from_upstream.clear();
        let response = read_message(&mut connection, &mut from_upstream, |buffer| {
            out.clear();
            encode_response(buffer, &mut facts, &mut out)
        })
        .await;
        match response {
            // Whatever followed the response would be a second one nobody asked for.
            Ok(Some(consumed)) if consumed == from_upstream.len() && !facts.upstream_closes => {
                pool.borrow_mut().push(connection)
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => return refuse(client, StatusCode::BAD_GATEWAY).await,
        }
        client.write_all(&out).await?;
        if facts.client_closes {
            return client.shutdown().await;
        }
    }
}

/// Reads from `stream` into `buffer` until `parse` finds a whole message; `Ok(None)` when the
/// peer closed before sending any byte of one.
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
            Ok(0) if buffer.is_empty() => return Ok(None),
            Ok(0) | Err(_) => return Err(Refused::Malformed),
            Ok(_) => {}
        }
    }
}

/// The body's length, from the message's headers; a transfer coding is not framed here.
fn body_length(headers: &[httparse::Header]) -> Result<usize, Refused> {
    let mut length = None;
    for header in headers {
        if header.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(Refused::Unsupported);
        }
        if header.name.eq_ignore_ascii_case("content-length") {
            let value = std::str::from_utf8(header.value)
                .ok()
                .and_then(|value| value.trim().parse::<usize>().ok())
                .ok_or(Refused::Malformed)?;
            // Two different lengths leave the framing ambiguous (RFC 9112 §6.3).
            if length.is_some_and(|length| length != value) {
                return Err(Refused::Malformed);
            }
            length = Some(value);
        }
    }
    Ok(length.unwrap_or(0))
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
    let total = head + body_length(request.headers)?;
    if buffer.len() < total {
        return Ok(Parsed::Partial);
    }
    let (Some(method), Some(path)) = (request.method, request.path) else {
        return Err(Refused::Malformed);
    };
    facts.is_head = method == "HEAD";
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
        body_length(response.headers)?
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
    let body = body.collect().await?.to_bytes();
    for hop in HOP_BY_HOP {
        parts.headers.remove(hop);
    }
    parts.headers.insert("x-forwarded-for", forwarded_for);
    let pooled = pool.borrow_mut().pop();
    let mut sender = match pooled {
        Some(sender) => sender,
        None => {
            let (sender, connection) =
                hyper::client::conn::http1::handshake(TokioIo::new(connect(upstream).await?)).await?;
            tokio::task::spawn_local(connection);
            sender
        }
    };
    let response = sender
        .send_request(Request::from_parts(parts, Full::new(body)))
        .await?;
    let (mut parts, body) = response.into_parts();
    let body = body.collect().await?.to_bytes();
    // Taken back only now that its response is read whole, so the next request can go at once.
    pool.borrow_mut().push(sender);
    for hop in HOP_BY_HOP {
        parts.headers.remove(hop);
    }
    Ok(Response::from_parts(parts, Full::new(body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn exchange(address: SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(address).await.unwrap();
        stream.write_all(request).await.unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.unwrap();
        String::from_utf8(answer).unwrap()
    }

    async fn origin_and_floor(engine: Engine) -> SocketAddr {
        let origin = crate::echo::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let upstream = origin.local_addr().unwrap();
        tokio::spawn(crate::echo::serve(origin, "origin".to_string()));
        start(&FloorArgs {
            listen: "127.0.0.1:0".parse().unwrap(),
            upstream,
            engine,
            threads: 2,
        })
        .unwrap()
    }

    #[tokio::test]
    async fn each_engine_forwards_requests_and_bodies_on_one_connection() {
        for engine in [Engine::OnePass, Engine::Hyper] {
            let floor = origin_and_floor(engine).await;
            // Two requests on one connection; the second closes it so that the answer ends.
            let answer = exchange(
                floor,
                b"POST /first HTTP/1.1\r\nhost: test\r\ncontent-length: 5\r\nx-forwarded-for: 10.9.9.9\r\nkeep-alive: timeout=5\r\n\r\nhello\
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
            assert_eq!(bodies[0]["headers"]["x-forwarded-for"], "127.0.0.1", "{engine:?}");
            assert!(bodies[0]["headers"].get("keep-alive").is_none(), "{engine:?}");
            assert_eq!(bodies[1]["uri"], "/second", "{engine:?}");
        }
    }

    #[tokio::test]
    async fn one_pass_refuses_a_chunked_request_instead_of_misframing_it() {
        let floor = origin_and_floor(Engine::OnePass).await;
        let answer = exchange(
            floor,
            b"POST / HTTP/1.1\r\nhost: test\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
        assert!(!answer.contains("origin"), "forwarded: {answer}");
    }
}
