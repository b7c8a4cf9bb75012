//! The hyper engine: hyper's HTTP/1 server connection, and its client connection driven by a
//! task of its own.

use std::cell::RefCell;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::rc::Rc;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::{connect, HOP_BY_HOP, MAX_MESSAGE_BYTES};

pub(super) type Senders = Rc<RefCell<Vec<SendRequest<Full<Bytes>>>>>;

pub(super) async fn hyper_connection(
    client: TcpStream,
    peer: SocketAddr,
    upstream: SocketAddr,
    pool: Senders,
) {
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
