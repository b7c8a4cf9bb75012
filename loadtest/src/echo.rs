//! A small upstream HTTP server for the quickstart, the end-to-end tests and the benchmarks.
//!
//! * `GET /sse?events=N&interval_ms=M` streams N server-sent events, M ms apart;
//! * `GET /delay?ms=M` answers after M ms;
//! * `GET /status/CODE` answers with that status;
//! * anything else answers a JSON echo of the request, tagged with the server's name.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// Serves every connection `listener` accepts, HTTP/1.1 and HTTP/2, until the task is dropped.
pub async fn serve(listener: TcpListener, name: String) -> anyhow::Result<()> {
    let name: &'static str = Box::leak(name.into_boxed_str());
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!(%error, "accept failed");
                continue;
            }
        };
        tokio::spawn(async move {
            let service = service_fn(move |request| handle(request, name, peer));
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            if let Err(error) = builder.serve_connection(TokioIo::new(stream), service).await {
                tracing::debug!(%error, "connection ended with an error");
            }
        });
    }
}

pub async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|error| anyhow::anyhow!("cannot bind {addr}: {error}"))
}

async fn handle(
    request: Request<Incoming>,
    name: &'static str,
    peer: SocketAddr,
) -> Result<Response<Body>, Infallible> {
    let path = request.uri().path().to_string();
    let query = request.uri().query().unwrap_or("").to_string();
    let param = |key: &str| -> Option<u64> {
        query
            .split('&')
            .filter_map(|pair| pair.split_once('='))
            .find(|(k, _)| *k == key)
            .and_then(|(_, v)| v.parse().ok())
    };
    if path == "/sse" {
        return Ok(sse(
            param("events").unwrap_or(3),
            Duration::from_millis(param("interval_ms").unwrap_or(100)),
        ));
    }
    if path == "/delay" {
        tokio::time::sleep(Duration::from_millis(param("ms").unwrap_or(0))).await;
    }
    if let Some(code) = path.strip_prefix("/status/") {
        let status = code
            .parse::<u16>()
            .ok()
            .and_then(|code| StatusCode::from_u16(code).ok())
            .unwrap_or(StatusCode::BAD_REQUEST);
        return Ok(text(status, format!("{}\n", status.as_u16())));
    }
    if path == "/bench" {
        return Ok(text(StatusCode::OK, "ok\n".to_string()));
    }
    let headers: serde_json::Map<String, serde_json::Value> = request
        .headers()
        .iter()
        .map(|(key, value)| (key.to_string(), String::from_utf8_lossy(value.as_bytes()).into()))
        .collect();
    let method = request.method().to_string();
    let version = format!("{:?}", request.version());
    let uri = request.uri().to_string();
    let body = match request.into_body().collect().await {
        Ok(collected) => String::from_utf8_lossy(&collected.to_bytes()).into_owned(),
        Err(error) => {
            return Ok(text(
                StatusCode::BAD_REQUEST,
                format!("cannot read body: {error}\n"),
            ))
        }
    };
    let echo = serde_json::json!({
        "server": name, "method": method, "uri": uri, "version": version,
        "peer": peer.to_string(), "headers": headers, "body": body,
    });
    let mut response = text(StatusCode::OK, format!("{echo}\n"));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    Ok(response)
}

fn text(status: StatusCode, body: String) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(body)).boxed());
    *response.status_mut() = status;
    response
}

fn sse(events: u64, interval: Duration) -> Response<Body> {
    let stream = futures::stream::iter(0..events).then(move |index| async move {
        if index > 0 {
            tokio::time::sleep(interval).await;
        }
        Ok::<_, Infallible>(Frame::data(Bytes::from(format!(
            "id: {index}\ndata: event {index}\n\n"
        ))))
    });
    let mut response = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/event-stream"),
    );
    response.headers_mut().insert(
        http::header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-cache"),
    );
    response
}
