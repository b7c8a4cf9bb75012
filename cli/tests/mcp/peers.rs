//! MCP peers for the tests: servers and a client built with the official Rust SDK
//! (`rmcp`), Portcullis' own MCP test server serving one era, and a server answering garbage.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::*;
use rmcp::service::{Peer, RequestContext};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{schemars, tool, tool_handler, tool_router, ClientHandler, ClientLifecycleMode, ClientServiceExt};
use rmcp::{ErrorData, RoleClient, RoleServer, ServerHandler};
use serde_json::Value;

use crate::support::*;
use crate::wire::whole_request;

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
pub(crate) struct SumArgs {
    a: i64,
    b: i64,
}

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
pub(crate) struct TextArgs {
    text: String,
}

/// An rmcp server: `get-sum`, `echo`, `ask` (asks the client's model through sampling, a
/// request from the server to the client) and `change` (server `math` tells every session
/// its tool list changed and its resource `mem://note` was updated, any other its prompt
/// list, so a client can tell whose it heard), each answer naming the server. It offers no
/// prompts, only their changes, takes subscriptions to resources it does not list, takes
/// any log level, and completes any argument with the same three suggestions.
#[derive(Clone)]
pub(crate) struct Tools {
    name: &'static str,
    tool_router: ToolRouter<Tools>,
    /// Every session's client: a change is news to all of them.
    sessions: Arc<Mutex<Vec<Peer<RoleServer>>>>,
}

#[tool_router]
impl Tools {
    #[tool(name = "get-sum", description = "Adds two integers")]
    fn get_sum(&self, Parameters(SumArgs { a, b }): Parameters<SumArgs>) -> String {
        (a + b).to_string()
    }

    #[tool(description = "Echoes text, prefixed with the server's name")]
    fn echo(&self, Parameters(TextArgs { text }): Parameters<TextArgs>) -> String {
        format!("{}: {text}", self.name)
    }

    #[tool(description = "Returns the traceparent the request's _meta carried")]
    fn traceparent(&self, context: RequestContext<RoleServer>) -> String {
        context
            .meta
            .get("traceparent")
            .and_then(Value::as_str)
            .unwrap_or("none")
            .to_string()
    }

    #[tool(description = "Tells the client a list changed (on the session's stream)")]
    async fn change(&self) -> Result<String, ErrorData> {
        let sessions = self.sessions.lock().unwrap().clone();
        for peer in sessions {
            // A session that has ended hears nothing.
            let _ = if self.name == "math" {
                let _ = peer
                    .notify_resource_updated(ResourceUpdatedNotificationParam::new("mem://note"))
                    .await;
                peer.notify_tool_list_changed().await
            } else {
                peer.notify_prompt_list_changed().await
            };
        }
        Ok("told".into())
    }

    #[tool(description = "Asks the client's model and returns its answer")]
    async fn ask(
        &self,
        Parameters(TextArgs { text }): Parameters<TextArgs>,
        context: RequestContext<RoleServer>,
    ) -> Result<String, ErrorData> {
        let answer = context
            .peer
            .create_message(CreateMessageRequestParams::new(
                vec![SamplingMessage::user_text(text)],
                50,
            ))
            .await
            .map_err(|error| ErrorData::internal_error(error.to_string(), None))?;
        let text = answer
            .message
            .content
            .first()
            .and_then(|content| content.as_text().map(|t| t.text.clone()));
        Ok(format!("{} heard: {}", self.name, text.unwrap_or_default()))
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Tools {
    // `logging` is deprecated in the newest revision, and offered for the older ones.
    #[allow(deprecated)]
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_logging()
                .enable_tools()
                .enable_tool_list_changed()
                .enable_prompts()
                .enable_prompts_list_changed()
                .enable_resources()
                .enable_resources_subscribe()
                .enable_completions()
                .build(),
        )
    }

    /// Takes every level but `emergency`, so a test can tell it was asked.
    async fn set_level(
        &self,
        request: SetLevelRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        match request.level {
            LoggingLevel::Emergency => Err(ErrorData::invalid_params("no emergencies here", None)),
            _ => Ok(()),
        }
    }

    /// The same suggestions whatever was typed (narrowing them is the gateway's business
    /// here), without the optional `total` and `hasMore`.
    async fn complete(
        &self,
        _request: CompleteRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CompleteResult, ErrorData> {
        let values = ["e7", "e70", "x1"].map(String::from).to_vec();
        let completion =
            CompletionInfo::new(values).map_err(|error| ErrorData::internal_error(error, None))?;
        Ok(CompleteResult::new(completion))
    }

    async fn on_initialized(&self, context: rmcp::service::NotificationContext<RoleServer>) {
        self.sessions.lock().unwrap().push(context.peer);
    }

    #[allow(deprecated)] // resources/subscribe is what session-based clients have
    async fn subscribe(
        &self,
        _request: SubscribeRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        Ok(())
    }
}

/// A client that answers sampling requests with a fixed "model" reply.
#[derive(Clone, Default)]
pub(crate) struct Sampler;

impl ClientHandler for Sampler {
    async fn create_message(
        &self,
        params: CreateMessageRequestParams,
        _context: RequestContext<RoleClient>,
    ) -> Result<CreateMessageResult, ErrorData> {
        let asked = params
            .messages
            .first()
            .and_then(|message| message.content.first())
            .and_then(|content| content.as_text().map(|text| text.text.clone()))
            .unwrap_or_default();
        Ok(CreateMessageResult::new(
            SamplingMessage::assistant_text(format!("model says {asked}")),
            "test-model".into(),
        ))
    }

    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::builder().enable_sampling().build(),
            Implementation::new("portcullis-test", "0"),
        )
    }
}

/// A client that tells `changes` which list a server said changed: `tools` or `prompts`.
#[derive(Clone)]
pub(crate) struct ChangeListener {
    pub(crate) changes: tokio::sync::mpsc::UnboundedSender<String>,
}

impl ClientHandler for ChangeListener {
    async fn on_tool_list_changed(&self, _context: rmcp::service::NotificationContext<RoleClient>) {
        let _ = self.changes.send("tools".into());
    }

    async fn on_prompt_list_changed(&self, _context: rmcp::service::NotificationContext<RoleClient>) {
        let _ = self.changes.send("prompts".into());
    }

    async fn on_resource_updated(
        &self,
        params: ResourceUpdatedNotificationParam,
        _context: rmcp::service::NotificationContext<RoleClient>,
    ) {
        let _ = self.changes.send(format!("updated {}", params.uri));
    }

    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("portcullis-test", "0"),
        )
    }
}

/// Serves an rmcp server on a fresh loopback port; `json` prefers JSON answers over SSE.
pub(crate) async fn serve(name: &'static str, json: bool) -> SocketAddr {
    serve_eras(name, json, false).await.0
}

/// How many sessions a server was asked to open (`initialize`) and to end (`DELETE`), and
/// how often it was asked for its tools.
#[derive(Default)]
pub(crate) struct SessionCount {
    opened: AtomicUsize,
    ended: AtomicUsize,
    tool_lists: AtomicUsize,
}

impl SessionCount {
    pub(crate) fn open(&self) -> usize {
        self.opened.load(Ordering::SeqCst) - self.ended.load(Ordering::SeqCst)
    }

    pub(crate) fn tool_lists(&self) -> usize {
        self.tool_lists.load(Ordering::SeqCst)
    }
}

/// [`serve`]; `session_based_only` refuses 2026-07-28 requests as a server that predates that
/// revision does (a session-based request without a session).
pub(crate) async fn serve_eras(
    name: &'static str,
    json: bool,
    session_based_only: bool,
) -> (SocketAddr, Arc<SessionCount>) {
    let count = Arc::new(SessionCount::default());
    let counting = count.clone();
    let sessions = Arc::default();
    let service: StreamableHttpService<Tools, LocalSessionManager> = StreamableHttpService::new(
        move || {
            Ok(Tools {
                name,
                tool_router: Tools::tool_router(),
                sessions: Arc::clone(&sessions),
            })
        },
        Default::default(),
        StreamableHttpServerConfig::default()
            .with_sse_keep_alive(None)
            .with_json_response(json),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let (service, count) = (service.clone(), counting.clone());
            let handler = hyper::service::service_fn(
                move |request: hyper::Request<hyper::body::Incoming>| {
                    let service = hyper_util::service::TowerToHyperService::new(service.clone());
                    let count = count.clone();
                    async move {
                        let (parts, body) = request.into_parts();
                        let bytes = body
                            .collect()
                            .await
                            .map(|body| body.to_bytes())
                            .unwrap_or_default();
                        let method = serde_json::from_slice::<Value>(&bytes)
                            .map(|message| message["method"].clone())
                            .unwrap_or_default();
                        if parts.method == hyper::Method::DELETE {
                            count.ended.fetch_add(1, Ordering::SeqCst);
                        } else if method == "initialize" {
                            count.opened.fetch_add(1, Ordering::SeqCst);
                        } else if method == "tools/list" {
                            count.tool_lists.fetch_add(1, Ordering::SeqCst);
                        }
                        let modern = parts
                            .headers
                            .get("mcp-protocol-version")
                            .is_some_and(|version| version == "2026-07-28");
                        if session_based_only && parts.method == hyper::Method::POST && modern {
                            let refusal = r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Bad Request: Missing session ID"}}"#;
                            let mut response = hyper::Response::new(Full::new(Bytes::from(refusal)).boxed());
                            *response.status_mut() = hyper::StatusCode::BAD_REQUEST;
                            return Ok(response);
                        }
                        let request = hyper::Request::from_parts(parts, Full::new(bytes));
                        hyper::service::Service::call(&service, request).await
                    }
                },
            );
            tokio::spawn(async move {
                let io = hyper_util::rt::TokioIo::new(stream);
                let _ = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(io, handler)
                    .await;
            });
        }
    });
    (address, count)
}

/// A runtime for the MCP servers and clients; the gateway helpers block, so they run on
/// the test's own thread while the servers keep serving on the runtime's workers.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

pub(crate) async fn rmcp_client(port: u16) -> rmcp::service::RunningService<RoleClient, Sampler> {
    let transport = StreamableHttpClientTransport::from_uri(format!("http://127.0.0.1:{port}/mcp"));
    Sampler
        .serve_with_lifecycle(transport, ClientLifecycleMode::Initialize)
        .await
        .expect("the client initializes through the gateway")
}

/// Every tool the client can list, sorted.
pub(crate) async fn tool_names(client: &rmcp::service::RunningService<RoleClient, Sampler>) -> Vec<String> {
    let mut names: Vec<String> = client
        .list_all_tools()
        .await
        .expect("tools/list through the gateway")
        .into_iter()
        .map(|tool| tool.name.to_string())
        .collect();
    names.sort();
    names
}

pub(crate) fn arguments(value: Value) -> serde_json::Map<String, Value> {
    value.as_object().cloned().unwrap_or_default()
}

pub(crate) fn text_of(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|content| content.as_text().map(|text| text.text.clone()))
        .collect()
}

/// Portcullis' MCP test server (`portcullis mcp-server`) serving only `era`: stands for a
/// server from before 2026-07-28, or one that dropped the handshake. The official SDKs
/// serve both.
pub(crate) fn era_server(dir: &std::path::Path, era: &str) -> (Process, SocketAddr) {
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let process = Process::start(
        &format!("mcp-{era}"),
        dir,
        &["mcp-server", "--listen", &listen, "--tools", "0", "--era", era],
    );
    wait_for("the MCP test server", TIMEOUT, || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    (process, listen.parse().unwrap())
}

/// A server that takes connections and never answers.
pub(crate) async fn silent_server() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    address
}

/// A server that answers every request, on a kept-alive connection, with a well-framed
/// body that is not JSON-RPC.
pub(crate) async fn garbage_server() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                // Each whole request first (answering early races the client's write),
                // then a well-framed answer that is not JSON-RPC; keep-alive.
                let mut request = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    while !whole_request(&request) {
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(read) => request.extend_from_slice(&chunk[..read]),
                        }
                    }
                    request.clear();
                    let answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 5\r\n\r\nhello";
                    if stream.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    address
}

/// A TCP relay to `server` that holds each piece of the server's answers for `hold`: to its
/// clients, a slow server that acts on requests at once (a session it opens exists before
/// the client hears of it).
pub(crate) async fn slow_answers(server: SocketAddr, hold: std::time::Duration) -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(upstream) = tokio::net::TcpStream::connect(server).await else {
                    return;
                };
                let (mut from_client, mut to_client) = client.into_split();
                let (mut from_server, mut to_server) = upstream.into_split();
                let answers = async {
                    let mut chunk = [0u8; 4096];
                    while let Ok(read @ 1..) = from_server.read(&mut chunk).await {
                        tokio::time::sleep(hold).await;
                        if to_client.write_all(&chunk[..read]).await.is_err() {
                            return;
                        }
                    }
                };
                // Either side closing ends the relay's connection.
                tokio::select! {
                    _ = tokio::io::copy(&mut from_client, &mut to_server) => {}
                    () = answers => {}
                }
            });
        }
    });
    address
}
