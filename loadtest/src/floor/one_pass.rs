//! The one-pass engine: the client connection's task reads a request, writes it to an
//! upstream connection, reads the response and writes it back.

use std::cell::RefCell;
use std::io;
use std::net::SocketAddr;
use std::rc::Rc;

use futures::FutureExt;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::TcpStream;

use super::{connect, BUFFER_BYTES, HOP_BY_HOP, MAX_HEADERS, MAX_MESSAGE_BYTES};

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

pub(super) async fn one_pass(
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
