//! HTTP/2 to upstreams over our own connections, one multiplexed connection per
//! endpoint: the request's `:authority` is the host the client asked for (as `Host` is
//! on HTTP/1.1, RFC 9113 §8.3.1), while the TCP connection goes to the chosen endpoint. A
//! client keyed by URI could not separate the two.

use std::collections::HashMap;
use std::sync::Mutex;

use http::uri::Authority;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;

use super::Failure;
use crate::body::Body;

#[derive(Default)]
pub(super) struct Connections {
    open: Mutex<HashMap<Authority, SendRequest<Body>>>,
}

impl Connections {
    pub(super) async fn send(
        &self,
        endpoint: &Authority,
        request: Request<Body>,
    ) -> Result<Response<Incoming>, Failure> {
        let existing = {
            let open = self.open.lock().unwrap_or_else(|poison| poison.into_inner());
            open.get(endpoint).filter(|sender| !sender.is_closed()).cloned()
        };
        let mut sender = match existing {
            Some(sender) => sender,
            None => {
                let sender = connect(endpoint).await?;
                let mut open = self.open.lock().unwrap_or_else(|poison| poison.into_inner());
                open.insert(endpoint.clone(), sender.clone());
                sender
            }
        };
        sender
            .ready()
            .await
            .map_err(|error| Failure::Connect(format!("HTTP/2 connection not ready: {error}")))?;
        sender.send_request(request).await.map_err(Failure::Exchange)
    }
}

async fn connect(endpoint: &Authority) -> Result<SendRequest<Body>, Failure> {
    let stream = TcpStream::connect(endpoint.as_str())
        .await
        .map_err(|error| Failure::Connect(error.to_string()))?;
    let _ = stream.set_nodelay(true);
    let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .handshake(TokioIo::new(stream))
        .await
        .map_err(|error| Failure::Connect(format!("HTTP/2 handshake: {error}")))?;
    let endpoint = endpoint.clone();
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%endpoint, %error, "upstream HTTP/2 connection ended");
        }
    });
    Ok(sender)
}
