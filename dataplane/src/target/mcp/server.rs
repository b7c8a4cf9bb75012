//! One MCP server behind an McpBackend, spoken to over Streamable HTTP
//! (<https://modelcontextprotocol.io/specification/2025-11-25/basic/transports>).

use std::sync::Arc;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use bytes::Bytes;
use http::header::{ACCEPT, CONTENT_TYPE, HOST};
use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, LengthLimitError};
use portcullis_config::{McpFailureMode, McpServerSpec};
use serde_json::Value;

use super::resume::Cursor;
use super::{jsonrpc, remap};
use crate::body::{self, Body, Held};
use crate::sse;
use crate::telemetry::{LogThrottle, RequestTrace};
use crate::upstream::{Background, Http1, Http1Body, Upstream};

pub(super) const SESSION_ID: HeaderName = HeaderName::from_static("mcp-session-id");
pub(super) const PROTOCOL_VERSION: HeaderName = HeaderName::from_static("mcp-protocol-version");
pub(super) const MCP_METHOD: HeaderName = HeaderName::from_static("mcp-method");
pub(super) const MCP_NAME: HeaderName = HeaderName::from_static("mcp-name");
/// The stateless revision: no `initialize`, no sessions, the client's `_meta` on every request.
pub(super) const MODERN_VERSION: &str = "2026-07-28";
pub(super) const META_VERSION: &str = "io.modelcontextprotocol/protocolVersion";
pub(super) const META_CAPABILITIES: &str = "io.modelcontextprotocol/clientCapabilities";
pub(super) const META_CLIENT_INFO: &str = "io.modelcontextprotocol/clientInfo";
pub(super) const META_LOG_LEVEL: &str = "io.modelcontextprotocol/logLevel";
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const LAST_EVENT_ID: HeaderName = HeaderName::from_static("last-event-id");
/// A background DELETE waits at most this long (or the server's timeout, if shorter): a
/// stopping proxy awaits them, and a long tool timeout must not hold its exit.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// A server whose TLS fails, fails every request: its warning is logged once per interval.
const TLS_WARN_INTERVAL: Duration = Duration::from_secs(30);
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");
/// An answer the gateway reads whole (a list, an initialize result) may be this large.
pub(super) const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;

pub(super) struct Server {
    pub(super) name: Arc<str>,
    pub(super) authority: http::uri::Authority,
    /// As configured: what tells this server apart from one that took its name.
    pub(super) url: Arc<str>,
    uri: Uri,
    host: HeaderValue,
    /// Set for an `https://` server with TLS settings of its own (CAs, server name, client
    /// certificate); otherwise the default client (built-in roots for `https://`).
    own_tls: Option<Arc<Http1>>,
    pub(super) timeout: Duration,
    pub(super) failure_mode: McpFailureMode,
    pub(super) list_ttl: Option<Duration>,
    /// Whether the server speaks the 2026-07-28 revision, learned once per config version
    /// from `server/discover`.
    modern: tokio::sync::OnceCell<bool>,
    tls_warnings: LogThrottle,
}

/// Why a server could not answer; the message names the server, never a session id.
#[derive(Debug)]
pub(super) struct Failure {
    pub(super) server: Arc<str>,
    pub(super) reason: String,
    /// The server no longer knows the session (HTTP 404): the client must initialize again.
    pub(super) session_gone: bool,
    /// The server answered, with something other than what was asked for.
    pub(super) answered: bool,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "server {}: {}", self.server, self.reason)
    }
}

/// What to send besides the body.
pub(super) struct Headers<'a> {
    pub(super) session: Option<&'a str>,
    /// Absent on `initialize`.
    pub(super) version: Option<&'a str>,
    /// The 2026-07-28 revision's `Mcp-Method` and `Mcp-Name`, taken from the message.
    pub(super) modern: bool,
    pub(super) trace: &'a RequestTrace,
}

impl Server {
    pub(super) fn compile(spec: &McpServerSpec, upstream: &Upstream) -> Result<Server, String> {
        let url = portcullis_config::parse_mcp_url(&spec.url)?;
        let authority: http::uri::Authority = url.authority.parse().map_err(|error| format!("{error}"))?;
        let own_tls = match &spec.tls {
            Some(tls) => Some(
                upstream
                    .tls_clients
                    .client(tls)
                    .map_err(|problem| format!("tls.{problem}"))?,
            ),
            None => None,
        };
        let uri = Uri::builder()
            .scheme(if url.tls { "https" } else { "http" })
            .authority(authority.clone())
            .path_and_query(url.path_and_query.as_str())
            .build()
            .map_err(|error| error.to_string())?;
        Ok(Server {
            name: Arc::from(spec.name.as_str()),
            url: Arc::from(spec.url.as_str()),
            host: HeaderValue::from_str(&url.host).map_err(|error| error.to_string())?,
            authority,
            uri,
            own_tls,
            timeout: spec.timeout(),
            failure_mode: spec.failure_mode,
            list_ttl: spec.list_ttl.map(|ttl| ttl.0),
            modern: tokio::sync::OnceCell::new(),
            tls_warnings: LogThrottle::new(TLS_WARN_INTERVAL),
        })
    }

    pub(super) fn failure(&self, reason: impl Into<String>) -> Failure {
        Failure {
            server: self.name.clone(),
            reason: reason.into(),
            session_gone: false,
            answered: false,
        }
    }

    /// The server answered, but not with what was asked for.
    pub(super) fn answered(&self, reason: impl Into<String>) -> Failure {
        Failure {
            answered: true,
            ..self.failure(reason)
        }
    }

    fn request(
        &self,
        method: Method,
        headers: &Headers<'_>,
        message: Option<&Value>,
    ) -> Result<Request<Body>, Failure> {
        let body = message.map_or_else(body::empty, |message| body::full(message.to_string()));
        let mut request = Request::new(body);
        *request.method_mut() = method;
        *request.uri_mut() = self.uri.clone();
        let map = request.headers_mut();
        // The server's own authority: MCP servers bound to loopback refuse other hosts
        // (DNS-rebinding protection).
        map.insert(HOST, self.host.clone());
        map.insert(
            ACCEPT,
            HeaderValue::from_static("application/json, text/event-stream"),
        );
        if message.is_some() {
            map.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        for (name, value) in [
            (&SESSION_ID, headers.session),
            (&PROTOCOL_VERSION, headers.version),
        ] {
            if let Some(value) = value {
                let value = HeaderValue::from_str(value)
                    .map_err(|_| self.failure("the session holds a value that is not a valid header"))?;
                map.insert(name, value);
            }
        }
        if let (true, Some(message)) = (headers.modern, message) {
            for (name, value) in modern_headers(message) {
                map.insert(name, value);
            }
        }
        if let Some(traceparent) = headers.trace.traceparent() {
            map.insert(TRACEPARENT, traceparent);
            if let Some(tracestate) = headers.trace.tracestate() {
                map.insert(TRACESTATE, tracestate.clone());
            }
        }
        Ok(request)
    }

    /// Sends one message; the response headers must come within the server's timeout.
    pub(super) async fn post(
        &self,
        headers: &Headers<'_>,
        message: &Value,
    ) -> Result<Response<Http1Body>, Failure> {
        let request = self.request(Method::POST, headers, Some(message))?;
        self.send(request, headers.session.is_some()).await
    }

    /// Opens the stream of the server's session; only its response headers are waited for.
    pub(super) async fn get(&self, headers: &Headers<'_>) -> Result<Response<Http1Body>, Failure> {
        let request = self.request(Method::GET, headers, None)?;
        self.send(request, headers.session.is_some()).await
    }

    /// Takes up a stream of the session that the server ended, after `last_event_id`
    /// ([`super::resume`]); only an event stream is taken as the answer.
    pub(super) async fn resume(
        &self,
        headers: &Headers<'_>,
        last_event_id: &str,
    ) -> Result<Response<Http1Body>, Failure> {
        let mut request = self.request(Method::GET, headers, None)?;
        let last_event_id = HeaderValue::from_bytes(last_event_id.as_bytes())
            .map_err(|_| self.answered("gave an event id that cannot be sent back as a header"))?;
        request.headers_mut().insert(LAST_EVENT_ID, last_event_id);
        let response = self.send(request, headers.session.is_some()).await?;
        if response.status() != StatusCode::OK || !is_event_stream(response.headers()) {
            return Err(self.answered(format!(
                "answered HTTP {} when its stream was resumed",
                response.status()
            )));
        }
        Ok(response)
    }

    fn client(&self) -> Http1 {
        self.own_tls.as_deref().map_or_else(Upstream::http1, Http1::clone)
    }

    /// Ends `session` when the returned guard is dropped, in the background: for sessions
    /// whose end comes with no request to send it in (a client that left, a stream dropped).
    pub(super) fn close_on_drop(&self, upstream: &Upstream, session: &str, version: &str) -> Closing {
        let headers = Headers {
            session: Some(session),
            version: Some(version),
            modern: false,
            trace: &RequestTrace::default(),
        };
        Closing {
            client: self.client(),
            background: upstream.background.clone(),
            delete: self.request(Method::DELETE, &headers, None).ok(),
            timeout: self.timeout.min(CLOSE_TIMEOUT),
        }
    }

    /// Ends the server's session (best effort: a server may answer 405).
    pub(super) async fn delete(&self, headers: &Headers<'_>) -> Result<StatusCode, Failure> {
        let request = self.request(Method::DELETE, headers, None)?;
        let response = self.send(request, headers.session.is_some()).await?;
        Ok(response.status())
    }

    /// A 404 to a request in a session means the server dropped the session; the client
    /// must initialize again. Without a session, a 404's body says what went wrong.
    async fn send(&self, request: Request<Body>, in_session: bool) -> Result<Response<Http1Body>, Failure> {
        let client = self.client();
        match tokio::time::timeout(self.timeout, Upstream::http1_exchange(&client, request)).await {
            Err(_) => Err(self.failure(format!("no answer within {:?}", self.timeout))),
            Ok(Err(failure)) => {
                if let Some(detail) = &failure.tls_detail {
                    if let Some(left_out) = self.tls_warnings.admit() {
                        tracing::warn!(
                            server = %self.name,
                            upstream = %self.authority,
                            reason = %detail,
                            same_failures_not_logged = left_out,
                            "TLS to an MCP server failed"
                        );
                    }
                }
                Err(self.failure(failure.reason))
            }
            Ok(Ok(response)) if in_session && response.status() == StatusCode::NOT_FOUND => Err(Failure {
                session_gone: true,
                ..self.answered("no longer knows this session")
            }),
            Ok(Ok(response)) => Ok(response),
        }
    }

    /// Reads and drops an answer nobody needs (a notification's), within the server's
    /// timeout and the answer size limit, so the connection can be reused.
    pub(super) async fn drain(&self, response: Response<Http1Body>) {
        let body = http_body_util::Limited::new(response.into_body(), MAX_ANSWER_BYTES);
        if tokio::time::timeout(self.timeout, body.collect()).await.is_err() {
            tracing::debug!(server = %self.name, "an MCP server's answer to a notification did not end in time");
        }
    }

    /// Whether the server speaks the 2026-07-28 revision: it answers `server/discover`
    /// listing it. Learned once; a server that cannot be reached is asked again next time.
    pub(super) async fn speaks_modern(&self, trace: &RequestTrace) -> Result<bool, Failure> {
        self.modern
            .get_or_try_init(|| async {
                let probe = serde_json::json!({
                    "jsonrpc": "2.0", "id": "portcullis-discover", "method": "server/discover",
                    "params": {"_meta": {META_VERSION: MODERN_VERSION, META_CAPABILITIES: {}}},
                });
                let headers = Headers {
                    session: None,
                    version: Some(MODERN_VERSION),
                    modern: true,
                    trace,
                };
                match self.call(&headers, &probe).await {
                    Ok(answer) => Ok(answer.message["result"]["supportedVersions"]
                        .as_array()
                        .is_some_and(|versions| versions.iter().any(|version| version == MODERN_VERSION))),
                    // It answered, but not as a modern server would.
                    Err(failure) if failure.answered => Ok(false),
                    Err(failure) => Err(failure),
                }
            })
            .await
            .copied()
    }

    /// Sends a request and reads its JSON-RPC response, from a JSON body or from the SSE
    /// stream the server may answer with. The gateway calls this for requests it answers
    /// itself (lists, `initialize`), with no client to ask: a request the server sends the
    /// client meanwhile is refused, so the server does not wait for an answer in vain.
    pub(super) async fn call(&self, headers: &Headers<'_>, message: &Value) -> Result<Answer, Failure> {
        let refuse = &mut |_: &str, _: &Value| Reply::Refuse;
        match self.call_asked(headers, message, refuse).await? {
            Asked::Answered(answer) => Ok(answer),
            Asked::Stopped => Err(self.failure("stopped reading its answer")),
        }
    }

    /// [`Server::call`], with `asked` deciding what becomes of each request the server
    /// sends the client while it answers (`ping` is answered here).
    pub(super) async fn call_asked(
        &self,
        headers: &Headers<'_>,
        message: &Value,
        asked: &mut (dyn FnMut(&str, &Value) -> Reply + Send),
    ) -> Result<Asked, Failure> {
        let id = message.get("id").cloned().unwrap_or(Value::Null);
        let exchange = async {
            let response = self.post(headers, message).await?;
            self.read_answer(headers, response, &id, asked).await
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .unwrap_or_else(|_| Err(self.failure(format!("no answer within {:?}", self.timeout))))
    }

    async fn read_answer(
        &self,
        headers: &Headers<'_>,
        response: Response<Http1Body>,
        id: &Value,
        asked: &mut (dyn FnMut(&str, &Value) -> Reply + Send),
    ) -> Result<Asked, Failure> {
        let status = response.status();
        let session = response
            .headers()
            .get(&SESSION_ID)
            .and_then(|value| value.to_str().ok())
            .map(str::to_string);
        let streamed = is_event_stream(response.headers());
        let mut body = http_body_util::Limited::new(response.into_body(), MAX_ANSWER_BYTES);
        if !streamed {
            let bytes = body
                .collect()
                .await
                .map_err(|error| self.failure(format!("reading the answer: {error}")))?
                .to_bytes();
            let message = self.message(&bytes, status, id)?;
            return Ok(Asked::Answered(Answer { message, session }));
        }
        let mut parser = sse::Parser::default();
        let mut events = Vec::new();
        let mut cursor = Cursor::default();
        loop {
            let frame = match body.frame().await {
                Some(Ok(frame)) => frame,
                ended => {
                    let too_large = matches!(&ended, Some(Err(error)) if error.is::<LengthLimitError>());
                    if let (false, Some(_), Some((last_event_id, delay))) =
                        (too_large, headers.session, cursor.next())
                    {
                        tokio::time::sleep(delay).await;
                        let resumed = self.resume(headers, &last_event_id).await?;
                        body = http_body_util::Limited::new(resumed.into_body(), MAX_ANSWER_BYTES);
                        parser = sse::Parser::default();
                        continue;
                    }
                    return Err(match ended {
                        Some(Err(error)) => self.failure(format!("reading the event stream: {error}")),
                        _ => self.failure("the event stream ended without the response"),
                    });
                }
            };
            let Ok(data) = frame.into_data() else { continue };
            parser.feed(&data, &mut events);
            for event in std::mem::take(&mut events) {
                cursor.saw(&event);
                let Ok(message) = serde_json::from_str::<Value>(&event.data) else {
                    continue;
                };
                let (Some(method), Some(request)) =
                    (message.get("method").and_then(Value::as_str), message.get("id"))
                else {
                    if message.get("id") == Some(id) && message.get("method").is_none() {
                        return Ok(Asked::Answered(Answer { message, session }));
                    }
                    continue;
                };
                let params = message.get("params").unwrap_or(&Value::Null);
                let reply = if method == "ping" {
                    Reply::Result(serde_json::json!({}))
                } else {
                    asked(method, params)
                };
                let reply = match reply {
                    Reply::Stop => return Ok(Asked::Stopped),
                    Reply::Result(result) => {
                        serde_json::json!({"jsonrpc": "2.0", "id": request, "result": result})
                    }
                    Reply::Refuse => serde_json::json!({"jsonrpc": "2.0", "id": request, "error": {
                        "code": jsonrpc::METHOD_NOT_FOUND,
                        "message": format!("{method} cannot reach the client through the gateway here"),
                    }}),
                };
                let replied = self.post(headers, &reply).await?;
                self.drain(replied).await;
            }
        }
    }

    /// A JSON answer to request `id`, read whole (up to [`MAX_ANSWER_BYTES`]) to see that it
    /// is the response to that request: any other would settle another request of the
    /// client's, unseen by the rules and guardrails of the server that request went to.
    pub(super) async fn own_response(
        &self,
        answer: Body,
        status: StatusCode,
        id: &Value,
    ) -> Result<Bytes, Failure> {
        let bytes = match body::hold(answer, MAX_ANSWER_BYTES).await {
            Held::Whole(bytes) => bytes,
            Held::TooLarge { .. } => {
                return Err(self.answered(format!(
                    "answered more than {MAX_ANSWER_BYTES} bytes, more than the gateway reads to know what it answers"
                )))
            }
            Held::Broken(problem) => return Err(self.failure(format!("reading the answer: {problem}"))),
        };
        match jsonrpc::message_id(&bytes) {
            Some(answered) if answered == *id => Ok(bytes),
            other => {
                if other.is_some() {
                    remap::dropped_stray_response(&self.name);
                }
                Err(self.answered(format!(
                    "answered HTTP {status} without the response to this request"
                )))
            }
        }
    }

    /// The response to request `id` that a JSON answer holds. One with another id answers
    /// nothing this exchange sent: relayed, it could settle another request of the client's.
    fn message(&self, bytes: &Bytes, status: StatusCode, id: &Value) -> Result<Value, Failure> {
        let reason = match serde_json::from_slice::<Value>(bytes) {
            Ok(message)
                if message.get("id") == Some(id)
                    && (message.get("result").is_some() || message.get("error").is_some()) =>
            {
                return Ok(message)
            }
            // A server error may pass: not an answer to learn anything from.
            _ if status.is_server_error() => return Err(self.failure(format!("answered HTTP {status}"))),
            _ if !status.is_success() => format!("answered HTTP {status}"),
            Ok(message) if message.get("result").is_some() || message.get("error").is_some() => {
                "answered with the response to another request".to_string()
            }
            _ => "answered something that is not a JSON-RPC response".to_string(),
        };
        Err(self.answered(reason))
    }
}

pub(super) fn is_event_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.trim_start().starts_with("text/event-stream"))
}

/// Ends a session when dropped, unless [`Closing::keep`] says it lives on.
pub(super) struct Closing {
    client: Http1,
    /// Where the DELETE runs: not the worker that dropped the guard, which may be stopping.
    background: Background,
    delete: Option<Request<Body>>,
    timeout: Duration,
}

impl Closing {
    /// The session is not to end (its id went to the client, which ends it).
    pub(super) fn keep(mut self) {
        self.delete = None;
    }
}

impl Drop for Closing {
    fn drop(&mut self) {
        let Some(delete) = self.delete.take() else {
            return;
        };
        let (client, timeout) = (self.client.clone(), self.timeout);
        self.background.spawn(async move {
            if !matches!(
                tokio::time::timeout(timeout, client.request(delete)).await,
                Ok(Ok(_))
            ) {
                tracing::debug!("closing an MCP session in the background failed");
            }
        });
    }
}

/// What becomes of a request a server sends the client while it answers.
pub(super) enum Reply {
    /// Answered with this result.
    Result(Value),
    /// Answered with an error: there is no client to ask.
    Refuse,
    /// Not answered: the gateway stops reading (and the caller ends the exchange).
    Stop,
}

/// How [`Server::call_asked`] ended.
pub(super) enum Asked {
    Answered(Answer),
    /// A request to the client was met with [`Reply::Stop`].
    Stopped,
}

/// A server's JSON-RPC response, with the session id its HTTP response carried.
pub(super) struct Answer {
    pub(super) message: Value,
    pub(super) session: Option<String>,
}

impl Answer {
    /// The result, or the server's JSON-RPC error as a failure.
    pub(super) fn result(self, server: &Server) -> Result<Value, Failure> {
        match self.message {
            Value::Object(mut message) => match message.remove("result") {
                Some(result) => Ok(result),
                None => {
                    let error = message.remove("error").unwrap_or(Value::Null);
                    Err(server.answered(format!(
                        "error {}: {}",
                        error.get("code").unwrap_or(&Value::Null),
                        error
                            .get("message")
                            .and_then(Value::as_str)
                            .unwrap_or("(no message)")
                    )))
                }
            },
            _ => Err(server.answered("answered something that is not a JSON-RPC response")),
        }
    }
}

/// Passes a server's answer on to the client as it comes (JSON or SSE), its idle time
/// bounded like any response body.
pub(super) fn relay(response: Response<Http1Body>, idle: Duration) -> Response<Body> {
    let (mut parts, incoming) = response.into_parts();
    crate::normalize::strip_hop_by_hop(&mut parts.headers, false);
    // The upstream session id is the gateway's business, not the client's.
    parts.headers.remove(&SESSION_ID);
    Response::from_parts(parts, body::boxed(body::IdleTimeout::new(incoming, idle)))
}

/// `Mcp-Method`, and `Mcp-Name` where the revision requires it, matching the message.
fn modern_headers(message: &Value) -> Vec<(HeaderName, HeaderValue)> {
    let mut headers = Vec::new();
    let Some(method) = message.get("method").and_then(Value::as_str) else {
        return headers;
    };
    if let Ok(value) = HeaderValue::from_str(method) {
        headers.push((MCP_METHOD, value));
    }
    let name = match method {
        "tools/call" | "prompts/get" => message["params"]["name"].as_str(),
        "resources/read" => message["params"]["uri"].as_str(),
        _ => None,
    };
    if let Some(name) = name {
        headers.push((MCP_NAME, encode_header_value(name)));
    }
    headers
}

/// A value as the 2026-07-28 revision puts it in a header: plain when it is visible ASCII
/// without surrounding spaces, otherwise `=?base64?…?=` of its UTF-8.
pub(super) fn encode_header_value(value: &str) -> HeaderValue {
    let plain = !value.is_empty()
        && value.bytes().all(|byte| (0x20..0x7f).contains(&byte))
        && !value.starts_with(' ')
        && !value.ends_with(' ')
        && !value.starts_with("=?base64?");
    let text = if plain {
        value.to_string()
    } else {
        format!("=?base64?{}?=", STANDARD.encode(value))
    };
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// The inverse of [`encode_header_value`]; `None` for a malformed encoding.
pub(super) fn decode_header_value(value: &HeaderValue) -> Option<String> {
    let text = value.to_str().ok()?;
    match text
        .strip_prefix("=?base64?")
        .and_then(|rest| rest.strip_suffix("?="))
    {
        Some(encoded) => String::from_utf8(STANDARD.decode(encoded).ok()?).ok(),
        None => Some(text.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn host_is_the_url_s_authority_as_written() {
        let telemetry =
            Arc::new(crate::telemetry::Telemetry::new(crate::tests::support::quiet_telemetry()).unwrap());
        let upstream = Upstream::new(telemetry, crate::placements::outbox().0, None);
        for (url, host, connect_to) in [
            ("https://tools.example/mcp", "tools.example", "tools.example:443"),
            ("http://tools.internal/mcp", "tools.internal", "tools.internal:80"),
            ("http://127.0.0.1:9001/mcp", "127.0.0.1:9001", "127.0.0.1:9001"),
        ] {
            let spec = McpServerSpec {
                name: "tools".into(),
                url: url.into(),
                tls: None,
                timeout: None,
                failure_mode: McpFailureMode::Fail,
                list_ttl: None,
            };
            let server = Server::compile(&spec, &upstream).unwrap();
            let headers = Headers {
                session: None,
                version: None,
                modern: false,
                trace: &RequestTrace::default(),
            };
            let request = server.request(Method::POST, &headers, None).unwrap();
            assert_eq!(request.headers()[HOST], host, "{url}");
            assert_eq!(server.authority.as_str(), connect_to, "{url}");
        }
    }

    #[test]
    fn header_values_encode_what_headers_cannot_carry() {
        for name in ["get-sum", "file:///a b", "naïve", " padded", ""] {
            let encoded = encode_header_value(name);
            assert_eq!(decode_header_value(&encoded).as_deref(), Some(name), "{name}");
        }
        assert_eq!(encode_header_value("get-sum"), "get-sum");
        assert_eq!(encode_header_value("naïve"), "=?base64?bmHDr3Zl?=");
    }
}
