//! The test MCP server over Streamable HTTP: one endpoint, `/mcp`, serving legacy clients
//! (`initialize`, sessions, GET stream, DELETE) and 2026-07-28 stateless clients side by side.
//! HTTP concerns live here (Accept/Content-Type/Origin, JSON vs SSE framing); what to answer
//! is decided in `dispatch`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use super::dispatch::{Headers, Reply, ReplyBody, State};
use super::protocol::{
    error_response, sse_event, HEADER_METHOD, HEADER_NAME, HEADER_SESSION, HEADER_VERSION, PARSE_ERROR,
};

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

pub const ENDPOINT: &str = "/mcp";
/// `GET` it for the number of open sessions.
pub const SESSIONS_PATH: &str = "/sessions";
/// Large enough for any sane tool call, small enough that a bad client cannot exhaust memory.
const MAX_BODY_BYTES: usize = 4 << 20;

#[derive(clap::Args, Debug, Clone)]
pub struct McpServerArgs {
    #[arg(long, default_value = "127.0.0.1:9100")]
    pub listen: SocketAddr,
    /// Generated tools on top of `echo` and `get-sum`.
    #[arg(long, default_value_t = 8)]
    pub tools: usize,
    /// Processing time of every `tools/call`, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub delay_ms: u64,
    /// Answer as SSE when the client accepts both JSON and SSE (the Python SDK's default);
    /// without it such clients get JSON.
    #[arg(long)]
    pub sse: bool,
    /// The protocol revisions served: both (like the official SDKs), or only one, to stand
    /// for a server that predates 2026-07-28 or one that dropped the handshake.
    #[arg(long, value_enum, default_value_t = ServedEras::Both)]
    pub era: ServedEras,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServedEras {
    Both,
    /// Session-based only: a 2026-07-28 request is a request without a session.
    Legacy,
    /// 2026-07-28 only: `initialize` is an unknown method.
    Modern,
}

#[derive(Debug, Clone)]
pub struct McpServerConfig {
    pub listen: SocketAddr,
    pub tools: usize,
    pub delay: Duration,
    pub prefer_sse: bool,
    pub era: ServedEras,
}

impl From<&McpServerArgs> for McpServerConfig {
    fn from(args: &McpServerArgs) -> Self {
        McpServerConfig {
            listen: args.listen,
            tools: args.tools,
            delay: Duration::from_millis(args.delay_ms),
            prefer_sse: args.sse,
            era: args.era,
        }
    }
}

/// A running server; dropping it stops the listener and every open connection.
pub struct McpServer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl McpServer {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}{ENDPOINT}", self.addr)
    }

    /// Runs until the task is cancelled (e.g. by the caller's `select!` on a signal).
    pub async fn wait(mut self) -> anyhow::Result<()> {
        (&mut self.task).await?;
        Ok(())
    }
}

impl Drop for McpServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn start(config: McpServerConfig) -> anyhow::Result<McpServer> {
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|error| anyhow::anyhow!("cannot bind {}: {error}", config.listen))?;
    let addr = listener.local_addr()?;
    let state = Arc::new(State::new(config.tools, config.delay, config.era));
    let task = tokio::spawn(accept_loop(listener, state, config.prefer_sse));
    Ok(McpServer { addr, task })
}

/// `portcullis mcp-server`: start and serve until cancelled.
pub async fn serve(args: McpServerArgs) -> anyhow::Result<()> {
    let config = McpServerConfig::from(&args);
    let server = start(config).await?;
    eprintln!(
        "MCP test server on {} ({} + 2 tools, {} ms per call, {} preferred)",
        server.url(),
        args.tools,
        args.delay_ms,
        if args.sse { "SSE" } else { "JSON" }
    );
    server.wait().await
}

async fn accept_loop(listener: TcpListener, state: Arc<State>, prefer_sse: bool) {
    // Connections live in this set so that aborting the accept task closes them too.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(error) => {
                        // Typically EMFILE under heavy load; back off instead of spinning.
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let state = state.clone();
                connections.spawn(async move {
                    let service = service_fn(move |request| handle(request, state.clone(), prefer_sse));
                    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                    if let Err(error) = builder.serve_connection(TokioIo::new(stream), service).await {
                        tracing::debug!(%error, "MCP connection ended with an error");
                    }
                });
            }
            // Reap finished connections so the set does not grow with every one ever served.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn handle(
    request: Request<Incoming>,
    state: Arc<State>,
    prefer_sse: bool,
) -> Result<Response<Body>, Infallible> {
    if request.uri().path() == SESSIONS_PATH {
        // For tests: how many sessions are open, so a leaked one shows.
        return Ok(plain(StatusCode::OK, &format!("{}\n", state.open_sessions())));
    }
    if request.uri().path() != ENDPOINT {
        return Ok(plain(
            StatusCode::NOT_FOUND,
            "not found; the MCP endpoint is /mcp\n",
        ));
    }
    if !origin_allowed(request.headers()) {
        return Ok(plain(StatusCode::FORBIDDEN, "Invalid Origin header\n"));
    }
    let (parts, body) = request.into_parts();
    let map = &parts.headers;
    let headers = Headers {
        session: header_str(map, HEADER_SESSION),
        version: header_str(map, HEADER_VERSION),
        method: header_str(map, HEADER_METHOD),
        name: header_str(map, HEADER_NAME),
    };
    let accept = Accept::parse(map);
    let reply = match parts.method {
        Method::POST => {
            if !content_type_is_json(map) {
                return Ok(plain(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "Content-Type must be application/json\n",
                ));
            }
            if !accept.json && !accept.sse {
                return Ok(plain(
                    StatusCode::NOT_ACCEPTABLE,
                    "Accept must allow application/json or text/event-stream\n",
                ));
            }
            let bytes = match Limited::new(body, MAX_BODY_BYTES).collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(error) => {
                    let status = if error.is::<http_body_util::LengthLimitError>() {
                        StatusCode::PAYLOAD_TOO_LARGE
                    } else {
                        StatusCode::BAD_REQUEST
                    };
                    let message = error_response(
                        None,
                        PARSE_ERROR,
                        &format!("cannot read body: {error}"),
                        None,
                        false,
                    );
                    return Ok(json(status, &message));
                }
            };
            state.post(&headers, &bytes)
        }
        Method::GET if !accept.sse => {
            return Ok(plain(
                StatusCode::NOT_ACCEPTABLE,
                "GET needs Accept: text/event-stream\n",
            ));
        }
        Method::GET => state.get(&headers),
        Method::DELETE => state.delete(&headers),
        _ => {
            let mut response = plain(StatusCode::METHOD_NOT_ALLOWED, "");
            response
                .headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static("GET, POST, DELETE"));
            return Ok(response);
        }
    };
    let sse = accept.sse && (prefer_sse || !accept.json);
    if let (false, ReplyBody::Message { delay, .. }) = (sse, &reply.body) {
        process(*delay).await;
    }
    Ok(render(reply, sse))
}

/// Waits out a tool's processing time to within a fraction of a millisecond. Tokio's timer
/// fires on millisecond ticks, so a 10 ms sleep lasts 10 to 11 ms depending on when in the
/// tick the request came: a hop in front of the server would shift that phase and read as
/// added latency. The last stretch is slept on a blocking thread, whose timer is precise.
async fn process(delay: Duration) {
    const TICKS: Duration = Duration::from_millis(2);
    if delay.is_zero() {
        return;
    }
    let deadline = std::time::Instant::now() + delay;
    if let Some(coarse) = delay.checked_sub(TICKS) {
        tokio::time::sleep(coarse).await;
    }
    let rest = deadline.saturating_duration_since(std::time::Instant::now());
    if !rest.is_zero() {
        // A failed blocking task only cuts the wait short.
        let _ = tokio::task::spawn_blocking(move || std::thread::sleep(rest)).await;
    }
}

fn render(reply: Reply, sse: bool) -> Response<Body> {
    let mut response = match reply.body {
        ReplyBody::Empty => {
            let mut response = plain(reply.status, "");
            // The Python SDK labels even its empty 202/200 answers as JSON.
            response
                .headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            response
        }
        ReplyBody::Json(message) => json(reply.status, &message),
        ReplyBody::Message { message, delay } if sse => {
            // Headers go out at once and the event after the processing delay, like a real
            // server that commits to a stream before its tool finishes.
            let event = futures::stream::once(async move {
                process(delay).await;
                Ok::<_, Infallible>(Frame::data(Bytes::from(sse_event(&message))))
            });
            sse_response(reply.status, BodyExt::boxed(StreamBody::new(event)))
        }
        // `handle` already waited out the delay, so the body can carry a Content-Length.
        ReplyBody::Message { message, .. } => json(reply.status, &message),
        ReplyBody::Stream(mut closed) => {
            // Yields nothing and ends when the session's sender is dropped (DELETE).
            let held = futures::stream::once(async move {
                let _ = closed.changed().await;
            })
            .filter_map(|()| async { None::<Result<Frame<Bytes>, Infallible>> });
            sse_response(reply.status, BodyExt::boxed(StreamBody::new(held)))
        }
    };
    if let Some(session) = reply.session.and_then(|id| HeaderValue::from_str(&id).ok()) {
        response.headers_mut().insert(HEADER_SESSION, session);
    }
    response
}

fn sse_response(status: StatusCode, body: Body) -> Response<Body> {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, no-transform"),
    );
    // Asks buffering reverse proxies (nginx and alike) to pass events through at once.
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

fn json(status: StatusCode, message: &serde_json::Value) -> Response<Body> {
    let mut response = plain(status, &message.to_string());
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn plain(status: StatusCode, text: &str) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(text.to_string())).boxed());
    *response.status_mut() = status;
    response
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|value| value.to_str().ok())
}

/// Which response media types the client takes. No `Accept` at all means anything (RFC 9110);
/// q-values are ignored since every MCP client lists the types it wants without them.
struct Accept {
    json: bool,
    sse: bool,
}

impl Accept {
    fn parse(headers: &HeaderMap) -> Accept {
        let mut accept = Accept {
            json: false,
            sse: false,
        };
        let mut any_header = false;
        for value in headers.get_all(header::ACCEPT) {
            any_header = true;
            for item in value.to_str().unwrap_or("").split(',') {
                let media = item.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
                match media.as_str() {
                    "*/*" => (accept.json, accept.sse) = (true, true),
                    "application/json" | "application/*" => accept.json = true,
                    "text/event-stream" | "text/*" => accept.sse = true,
                    _ => {}
                }
            }
        }
        if !any_header {
            accept = Accept {
                json: true,
                sse: true,
            };
        }
        accept
    }
}

fn content_type_is_json(headers: &HeaderMap) -> bool {
    header_str(headers, header::CONTENT_TYPE.as_str())
        .and_then(|value| value.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"))
}

/// DNS-rebinding protection as the spec asks: browsers send `Origin`, and only pages served
/// from loopback or from this very host may talk to the server. Non-browser clients send none.
fn origin_allowed(headers: &HeaderMap) -> bool {
    let Some(origin) = header_str(headers, header::ORIGIN.as_str()) else {
        return headers.get(header::ORIGIN).is_none();
    };
    let Ok(uri) = origin.parse::<http::Uri>() else {
        return false;
    };
    let Some(host) = uri.host() else {
        return false;
    };
    let own_host = header_str(headers, header::HOST.as_str())
        .and_then(|value| value.parse::<http::uri::Authority>().ok())
        .is_some_and(|authority| authority.host().eq_ignore_ascii_case(host));
    own_host || matches!(host, "localhost" | "127.0.0.1" | "[::1]")
}
