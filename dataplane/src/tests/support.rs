use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use portcullis_config::{parse_documents, Object};
use tokio::net::TcpListener;

use crate::{Proxy, ProxyConfig};

pub type UpstreamBody = BoxBody<Bytes, Infallible>;

pub fn text(body: impl Into<Bytes>) -> Response<UpstreamBody> {
    Response::new(Full::new(body.into()).boxed())
}

/// A real hyper server speaking HTTP/1.1 and HTTP/2 on 127.0.0.1.
pub async fn spawn_upstream<F, Fut>(handler: F) -> SocketAddr
where
    F: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<UpstreamBody>> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let handler = handler.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request| {
                    let response = handler(request);
                    async move { Ok::<_, Infallible>(response.await) }
                });
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    address
}

pub use portcullis_testkit::free_port;

pub fn http1_client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

pub fn http2_client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http()
}

/// A response's status and its body as text.
pub async fn status_and_text<B>(response: Response<B>) -> (u16, String)
where
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

pub async fn get(port: u16, path: &str) -> (u16, String) {
    let (status, _, body) = get_with(port, path, &[]).await;
    (status, body)
}

/// `GET path` with extra request headers; the status, response headers and body.
pub async fn get_with(port: u16, path: &str, headers: &[(&str, &str)]) -> (u16, http::HeaderMap, String) {
    let mut request = Request::get(format!("http://127.0.0.1:{port}{path}"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = http1_client()
        .request(request.body(Full::default()).unwrap())
        .await
        .unwrap();
    let headers = response.headers().clone();
    let (status, body) = status_and_text(response).await;
    (status, headers, body)
}

pub async fn start_proxy(cache_dir: Option<PathBuf>, drain_grace: Duration) -> Proxy {
    start_proxy_with(cache_dir, drain_grace, quiet_telemetry()).await
}

pub async fn start_proxy_with(
    cache_dir: Option<PathBuf>,
    drain_grace: Duration,
    telemetry: crate::TelemetryConfig,
) -> Proxy {
    Proxy::start(ProxyConfig {
        proxy_id: "test-proxy".into(),
        // Nothing listens there: these proxies get their config applied directly.
        controlplanes: vec![format!("http://127.0.0.1:{}", free_port())],
        shard: Default::default(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        cache_dir,
        drain_grace,
        // More than one even on a one-core machine: every listener accepts on two threads.
        workers: 2,
        peer_address: None,
        telemetry,
    })
    .await
    .unwrap()
}

pub fn listener(name: &str, port: u16) -> String {
    format!("apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: {name}}}\nspec: {{address: 127.0.0.1, port: {port}}}\n---\n")
}

pub fn backend(name: &str, endpoint: SocketAddr, http2: bool) -> String {
    format!("apiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {{name: {name}}}\nspec: {{endpoints: ['{endpoint}'], http2: {http2}}}\n---\n")
}

/// `extra` is more of the spec, e.g. `timeout: 200ms, matches: [...]`.
pub fn route(name: &str, listener: &str, backend: &str, extra: &str) -> String {
    format!("apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {{name: {name}}}\nspec: {{listeners: [{listener}], backends: [{{name: {backend}}}], {extra}}}\n---\n")
}

/// One listener on `port` sending everything to `upstream`.
pub fn simple_config(port: u16, upstream: SocketAddr, route_extra: &str) -> Vec<Object> {
    objects(
        &(listener("web", port) + &backend("up", upstream, false) + &route("all", "web", "up", route_extra)),
    )
}

/// A listener `web` on `port` and an LLM route `llm` (its spec's `route_extra` added) to the
/// pool `qwen` of model `m` at `pod`; `more` is further YAML documents (a Guardrail, ...).
pub fn llm_config(port: u16, pod: &str, route_extra: &str, more: &str) -> Vec<Object> {
    objects(&format!(
        "{}---
apiVersion: portcullis.dev/v1alpha1
kind: InferencePool
metadata: {{name: qwen}}
spec: {{endpoints: ['{pod}'], models: [{{name: m}}]}}
---
apiVersion: portcullis.dev/v1alpha1
kind: Route
metadata: {{name: llm}}
spec: {{listeners: [web], backends: [{{kind: InferencePool, name: qwen}}], {route_extra}}}
---
{more}",
        listener("web", port)
    ))
}

pub fn objects(yaml: &str) -> Vec<Object> {
    parse_documents(yaml).unwrap()
}

/// No access log, no span export: what most tests need.
pub fn quiet_telemetry() -> crate::TelemetryConfig {
    crate::TelemetryConfig {
        access_log: crate::AccessLogConfig {
            destination: crate::AccessLogDestination::Off,
            sample: 1.0,
        },
        otlp_endpoint: None,
        service_name: "portcullis-proxy".into(),
        proxy_id: "test-proxy".into(),
    }
}

/// Waits until `check` holds, polling; fails the test if it does not within 20 s, which a
/// busy machine still meets for anything the proxy does in well under a second.
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if check().await {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what} did not happen within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The status of `GET path`, or `None` when the exchange fails (e.g. the proxy answered
/// 503 before the request, as it does over its connection limit, then closed).
pub async fn try_status(port: u16, path: &str) -> Option<u16> {
    let request = Request::get(format!("http://127.0.0.1:{port}{path}"))
        .body(Full::default())
        .ok()?;
    let response = http1_client().request(request).await.ok()?;
    let status = response.status().as_u16();
    response.into_body().collect().await.ok()?;
    Some(status)
}
