//! A minimal MCP client over one HTTP/1.1 connection, for the load generator (`caller`): just enough of
//! either era to call tools, with every way of failing classified for the report.

use std::fmt;

use bytes::Bytes;
use http::{header, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpStream;

use super::protocol::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Era {
    /// `initialize` handshake and `Mcp-Session-Id` (2025-11-25).
    Legacy,
    /// Stateless 2026-07-28: `_meta` and `Mcp-*` headers on every request.
    Modern,
}

/// Why one call did not succeed; `kind()` is the key the report counts failures under.
#[derive(Debug)]
pub enum Failure {
    /// TCP connect or HTTP handshake failed.
    Connect(String),
    /// The connection broke while sending or receiving.
    Io(String),
    Status(StatusCode),
    /// A JSON-RPC error, and the HTTP status it came with.
    Rpc(i64, String, StatusCode),
    /// The body was not the JSON-RPC answer it should have been.
    Protocol(String),
    /// A well-formed answer with the wrong content (e.g. a wrong sum) or `isError: true`.
    Mismatch(String),
    Timeout,
}

impl Failure {
    pub fn kind(&self) -> String {
        match self {
            Failure::Connect(_) => "connect".into(),
            Failure::Io(_) => "io".into(),
            Failure::Status(status) => format!("http_{}", status.as_u16()),
            Failure::Rpc(code, _, StatusCode::OK) => format!("rpc_{code}"),
            Failure::Rpc(code, _, status) => format!("http_{}_rpc_{code}", status.as_u16()),
            Failure::Protocol(_) => "protocol".into(),
            Failure::Mismatch(_) => "mismatch".into(),
            Failure::Timeout => "timeout".into(),
        }
    }

    /// After these the connection cannot be trusted for another call.
    pub fn breaks_connection(&self) -> bool {
        matches!(
            self,
            Failure::Connect(_) | Failure::Io(_) | Failure::Timeout | Failure::Protocol(_)
        )
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Connect(why) => write!(f, "connect: {why}"),
            Failure::Io(why) => write!(f, "io: {why}"),
            Failure::Status(status) => write!(f, "HTTP {status}"),
            Failure::Rpc(code, message, status) => {
                write!(f, "JSON-RPC error {code} (HTTP {status}): {message}")
            }
            Failure::Protocol(why) => write!(f, "protocol: {why}"),
            Failure::Mismatch(why) => write!(f, "mismatch: {why}"),
            Failure::Timeout => write!(f, "timed out"),
        }
    }
}

/// Where to send MCP requests: `authority` for TCP and `Host`, `path` for the request line.
#[derive(Debug, Clone)]
pub struct Endpoint {
    authority: http::uri::Authority,
    path: String,
}

impl Endpoint {
    pub fn parse(url: &str) -> anyhow::Result<Endpoint> {
        let uri: Uri = url
            .parse()
            .map_err(|error| anyhow::anyhow!("invalid URL {url:?}: {error}"))?;
        anyhow::ensure!(
            uri.scheme_str() == Some("http"),
            "{url:?}: only http:// is supported"
        );
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("{url:?} needs host:port"))?;
        let path = uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
        Ok(Endpoint { authority, path })
    }
}

/// One keep-alive connection and, in the legacy era, the MCP session opened on it.
pub struct Connection {
    sender: SendRequest<Full<Bytes>>,
    endpoint: Endpoint,
    era: Era,
    session: Option<String>,
    next_id: u64,
}

impl Connection {
    /// Connects and, for the legacy era, performs `initialize` + `notifications/initialized`.
    pub async fn open(endpoint: &Endpoint, era: Era) -> Result<Connection, Failure> {
        let stream = TcpStream::connect(endpoint.authority.as_str())
            .await
            .map_err(|error| Failure::Connect(error.to_string()))?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|error| Failure::Connect(error.to_string()))?;
        tokio::spawn(connection);
        let mut connection = Connection {
            sender,
            endpoint: endpoint.clone(),
            era,
            session: None,
            next_id: 1,
        };
        if era == Era::Legacy {
            connection.initialize().await?;
        }
        Ok(connection)
    }

    async fn initialize(&mut self) -> Result<(), Failure> {
        let params = json!({
            "protocolVersion": LATEST_LEGACY_VERSION,
            "capabilities": {},
            "clientInfo": { "name": "portcullis-loadtest", "version": env!("CARGO_PKG_VERSION") },
        });
        let (result, session) = self.exchange("initialize", Some(params)).await?;
        if result.get("protocolVersion").and_then(Value::as_str) != Some(LATEST_LEGACY_VERSION) {
            return Err(Failure::Protocol(format!(
                "server negotiated {}",
                result["protocolVersion"]
            )));
        }
        self.session =
            Some(session.ok_or_else(|| Failure::Protocol("initialize without Mcp-Session-Id".into()))?);
        let notification = json!({ "jsonrpc": "2.0", "method": "notifications/initialized" });
        let (status, _, _) = self.post(&notification, None).await?;
        if status != StatusCode::ACCEPTED {
            return Err(Failure::Status(status));
        }
        Ok(())
    }

    /// Sends one request and returns its `result`.
    pub async fn request(&mut self, method: &str, params: Value) -> Result<Value, Failure> {
        self.exchange(method, Some(params))
            .await
            .map(|(result, _)| result)
    }

    /// Ends the legacy session (a no-op for the stateless era).
    pub async fn close(mut self) -> Result<(), Failure> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        let request = self
            .builder(http::Method::DELETE)
            .header(HEADER_SESSION, session)
            .body(Full::new(Bytes::new()))
            .map_err(|error| Failure::Protocol(error.to_string()))?;
        let response = self.send(request).await?;
        let status = response.status();
        let _ = response.into_body().collect().await;
        if status.is_success() {
            Ok(())
        } else {
            Err(Failure::Status(status))
        }
    }

    async fn exchange(
        &mut self,
        method: &str,
        params: Option<Value>,
    ) -> Result<(Value, Option<String>), Failure> {
        let id = self.next_id;
        self.next_id += 1;
        let mut params = params.unwrap_or_else(|| json!({}));
        if self.era == Era::Modern {
            params["_meta"] = json!({
                META_VERSION: MODERN_VERSION,
                META_CAPABILITIES: {},
                META_CLIENT_INFO: { "name": "portcullis-loadtest", "version": env!("CARGO_PKG_VERSION") },
            });
        }
        let name = params.get("name").and_then(Value::as_str).map(str::to_string);
        let message = json!({ "jsonrpc": "2.0", "id": id, "method": method, "params": params });
        let (status, body, session) = self.post(&message, Some((method, name.as_deref()))).await?;
        let answer = match find_answer(&body, id) {
            Ok(answer) => answer,
            Err(_) if !status.is_success() => return Err(Failure::Status(status)),
            Err(failure) => return Err(failure),
        };
        if let Some(error) = answer.get("error") {
            let code = error.get("code").and_then(Value::as_i64).unwrap_or(0);
            let text = error
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            return Err(Failure::Rpc(code, text, status));
        }
        if !status.is_success() {
            return Err(Failure::Status(status));
        }
        let result = answer
            .get("result")
            .cloned()
            .ok_or_else(|| Failure::Protocol("answer without result".into()))?;
        Ok((result, session))
    }

    /// POSTs one message; returns status, body and the response's session id.
    async fn post(
        &mut self,
        message: &Value,
        request: Option<(&str, Option<&str>)>,
    ) -> Result<(StatusCode, Bytes, Option<String>), Failure> {
        let mut builder = self
            .builder(http::Method::POST)
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "application/json, text/event-stream");
        match (self.era, &self.session) {
            (Era::Legacy, Some(session)) => {
                builder = builder
                    .header(HEADER_SESSION, session.as_str())
                    .header(HEADER_VERSION, LATEST_LEGACY_VERSION);
            }
            (Era::Legacy, None) => {}
            (Era::Modern, _) => {
                builder = builder.header(HEADER_VERSION, MODERN_VERSION);
                if let Some((method, name)) = request {
                    builder = builder.header(HEADER_METHOD, method);
                    if let Some(name) = name {
                        builder = builder.header(HEADER_NAME, name);
                    }
                }
            }
        }
        let request = builder
            .body(Full::new(Bytes::from(message.to_string())))
            .map_err(|error| Failure::Protocol(format!("building request: {error}")))?;
        let response = self.send(request).await?;
        let status = response.status();
        let session = response
            .headers()
            .get(HEADER_SESSION)
            .and_then(|value| value.to_str().ok())
            .map(str::to_string);
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|error| Failure::Io(error.to_string()))?
            .to_bytes();
        Ok((status, body, session))
    }

    async fn send(
        &mut self,
        request: http::Request<Full<Bytes>>,
    ) -> Result<http::Response<hyper::body::Incoming>, Failure> {
        // The connection takes the next request only once it has finished the last one;
        // sending before that fails with "connection was not ready".
        self.sender
            .ready()
            .await
            .map_err(|error| Failure::Io(error.to_string()))?;
        self.sender
            .send_request(request)
            .await
            .map_err(|error| Failure::Io(error.to_string()))
    }

    fn builder(&self, method: http::Method) -> http::request::Builder {
        Request::builder()
            .method(method)
            .uri(self.endpoint.path.as_str())
            .header(header::HOST, self.endpoint.authority.as_str())
    }
}

/// The JSON-RPC messages of an SSE body. An empty payload is a priming event (it only carries
/// an event id to resume from) and holds no message; any other payload must be JSON, and one
/// that is not is a protocol failure rather than a message silently lost.
pub(super) fn sse_messages(body: &[u8]) -> Result<Vec<Value>, Failure> {
    let payloads = crate::sse::payloads(body).map_err(Failure::Protocol)?;
    payloads
        .iter()
        .filter(|payload| !payload.is_empty())
        .map(|payload| {
            serde_json::from_str(payload).map_err(|error| {
                let shown: String = payload.chars().take(120).collect();
                Failure::Protocol(format!("SSE payload is not JSON ({error}): {shown:?}"))
            })
        })
        .collect()
}

/// The response to request `id` in a JSON or SSE body (SSE may carry notifications first).
fn find_answer(body: &[u8], id: u64) -> Result<Value, Failure> {
    let text = std::str::from_utf8(body).map_err(|_| Failure::Protocol("body is not UTF-8".into()))?;
    let candidates = match serde_json::from_str::<Value>(text) {
        Ok(value) => vec![value],
        Err(_) => sse_messages(body)?,
    };
    candidates
        .into_iter()
        .find(|message| {
            message.get("id") == Some(&json!(id))
                || (message.get("error").is_some() && message.get("id").is_none_or(Value::is_null))
        })
        .ok_or_else(|| {
            let shown: String = text.chars().take(120).collect();
            Failure::Protocol(format!("no answer to request {id} in {shown:?}"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_answers_skip_priming_events_and_refuse_payloads_that_are_not_json() {
        let body = b"id: 1\ndata:\n\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":3,\"result\":{}}\n\n";
        assert_eq!(find_answer(body, 3).ok().map(|m| m["id"].clone()), Some(json!(3)));
        let bad = b"data: {\"jsonrpc\":\"2.0\",\"id\":3,\"result\":{}}\n\ndata: not json\n\n";
        assert!(matches!(find_answer(bad, 3), Err(Failure::Protocol(m)) if m.contains("not JSON")));
    }
}
