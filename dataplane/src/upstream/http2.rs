//! HTTP/2 to upstreams over our own connections, one multiplexed connection per
//! endpoint: the request's `:authority` is the host the client asked for (as `Host` is
//! on HTTP/1.1, RFC 9113 §8.3.1), while the TCP connection goes to the chosen endpoint. A
//! client keyed by URI could not separate the two.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use http::uri::Authority;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;

use super::connect_watch::watched;
use super::Failure;
use crate::body::Body;

const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(20);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Concurrent first requests to an endpoint may each open a connection; the last one
/// stays in the map and the others close when their requests end.
#[derive(Default)]
pub(super) struct Connections {
    open: Mutex<HashMap<Authority, SendRequest<Body>>>,
}

impl Connections {
    pub(super) async fn send(
        &self,
        endpoint: &Authority,
        request: Request<Body>,
        connect_timeout: Duration,
    ) -> Result<Response<Incoming>, Failure> {
        let existing = {
            let open = self.open.lock().unwrap_or_else(|poison| poison.into_inner());
            open.get(endpoint).filter(|sender| !sender.is_closed()).cloned()
        };
        let request = match existing {
            Some(mut sender) => match sender.try_send_request(request).await {
                Ok(response) => return Ok(response),
                Err(mut error) => match error.take_message() {
                    // The pooled connection died before the request left: nothing was
                    // sent, so it goes on a fresh connection, not counted as a failure.
                    Some(request) => {
                        self.forget_if_closed(endpoint, &sender);
                        request
                    }
                    None => {
                        self.forget_if_closed(endpoint, &sender);
                        return Err(Failure::Exchange(error.into_error()));
                    }
                },
            },
            None => request,
        };
        let mut sender = tokio::time::timeout(connect_timeout, watched(connect(endpoint)))
            .await
            .map_err(|_| Failure::Connect(format!("no connection within {connect_timeout:?}")))??;
        sender
            .ready()
            .await
            .map_err(|error| Failure::Connect(format!("HTTP/2 connection not ready: {error}")))?;
        {
            let mut open = self.open.lock().unwrap_or_else(|poison| poison.into_inner());
            open.insert(endpoint.clone(), sender.clone());
        }
        let result = sender.send_request(request).await;
        if result.is_err() {
            self.forget_if_closed(endpoint, &sender);
        }
        result.map_err(Failure::Exchange)
    }

    /// Drops the pooled connection after an error only if that connection is gone: a
    /// reset of one stream must not cost every other request a new handshake, and a
    /// healthy connection another request just opened must stay.
    fn forget_if_closed(&self, endpoint: &Authority, sender: &SendRequest<Body>) {
        if !sender.is_closed() {
            return;
        }
        let mut open = self.open.lock().unwrap_or_else(|poison| poison.into_inner());
        if open.get(endpoint).is_some_and(SendRequest::is_closed) {
            open.remove(endpoint);
        }
    }

    pub(super) fn retain(&self, in_use: &HashSet<Authority>) {
        let mut open = self.open.lock().unwrap_or_else(|poison| poison.into_inner());
        open.retain(|endpoint, sender| in_use.contains(endpoint) && !sender.is_closed());
    }
}

async fn connect(endpoint: &Authority) -> Result<SendRequest<Body>, Failure> {
    let stream = TcpStream::connect(endpoint.as_str())
        .await
        .map_err(|error| Failure::Connect(error.to_string()))?;
    let _ = stream.set_nodelay(true);
    // Pings find a peer that vanished without closing, so its connection is dropped
    // rather than handed requests that can only time out.
    let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .keep_alive_interval(KEEP_ALIVE_INTERVAL)
        .keep_alive_timeout(KEEP_ALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
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
