//! The McpBackend target: several MCP servers behind one route, spoken to over Streamable
//! HTTP in the session-based revisions (2025-03-26, 2025-06-18, 2025-11-25;
//! <https://modelcontextprotocol.io/specification/2025-11-25/basic/transports>).
//!
//! The target answers by itself. `initialize` opens one upstream session per server and
//! hands the client one session id that seals them all ([`session`]); lists fan out and
//! merge ([`lists`]); a call goes to the server its prefixed name names, and the server's
//! answer, JSON or SSE, passes through as it comes ([`server::relay`], [`remap`]).

mod authz;
mod jsonrpc;
mod lists;
mod remap;
mod server;
mod session;
mod sse;

use std::sync::Arc;

use futures::future::join_all;
use http::header::{ACCEPT, ALLOW, CONTENT_TYPE};
use http::uri::Authority;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use portcullis_config::mcp_rules::{Caller, Item, ItemKind};
use portcullis_config::{ConfigSet, KindSpec, McpBackendSpec, McpFailureMode, MCP_NAME_SEPARATOR};
use serde_json::{json, Map, Value};

use self::authz::{Judgement, ServerRules};
use self::jsonrpc::Message;
use self::server::{Failure, Headers, Server, PROTOCOL_VERSION, SESSION_ID};
use self::session::{Sealer, ServerSession, Session};
use super::{ResponseFuture, Target};
use crate::body::{self, Body, BodyStatus};
use crate::policy::RequestContext;
use crate::route::Route;
use crate::upstream::Upstream;

/// The revisions this target speaks, newest first; a client asking for another one gets
/// the newest (the client then decides whether it can go on).
const SUPPORTED_VERSIONS: &[&str] = &["2025-11-25", "2025-06-18", "2025-03-26"];
/// What a server that sends no `MCP-Protocol-Version` is assumed to speak (the spec's rule).
const VERSION_WITHOUT_HEADER: &str = "2025-03-26";
/// Between a server's name and a resource URI of it: `math+file:///notes`.
const URI_SEPARATOR: char = '+';

pub(crate) struct McpTarget {
    name: Arc<str>,
    servers: Vec<Server>,
    /// Parallel to `servers`.
    rules: Vec<ServerRules>,
    multiplexed: bool,
    sealer: Sealer,
}

/// One request being served: what every handler needs.
struct Exchange<'a> {
    ctx: &'a mut RequestContext,
    route: &'a Route,
    upstream: &'a Upstream,
    headers: http::HeaderMap,
}

impl McpTarget {
    pub(crate) fn compile(
        name: &str,
        spec: &McpBackendSpec,
        config: &ConfigSet,
    ) -> Result<McpTarget, String> {
        let target: Arc<str> = Arc::from(format!("{}/{name}", McpBackendSpec::INFO.name));
        let servers = spec
            .servers
            .iter()
            .map(|server| {
                Server::compile(server).map_err(|error| format!("{target}: server {}: {error}", server.name))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let rules = spec
            .servers
            .iter()
            .map(|server| ServerRules::compile(config, name, &server.name))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(McpTarget {
            sealer: Sealer::load(&target, &spec.session_keys)?,
            name: target,
            servers,
            rules,
            multiplexed: spec.multiplexed(),
        })
    }

    async fn serve(
        &self,
        ctx: &mut RequestContext,
        route: &Route,
        upstream: &Upstream,
        request: Request<Body>,
    ) -> Response<Body> {
        let (parts, body) = request.into_parts();
        let mut exchange = Exchange {
            ctx,
            route,
            upstream,
            headers: parts.headers,
        };
        if let Some(answer) = exchange.unsupported_version(&Value::Null) {
            return answer;
        }
        match parts.method {
            Method::POST => self.post(&mut exchange, body).await,
            Method::DELETE => self.delete(&mut exchange).await,
            _ => {
                // No standalone GET stream yet: the spec lets a server answer 405, and
                // clients then get server messages on their POST streams only.
                let mut answer = jsonrpc::error(
                    StatusCode::METHOD_NOT_ALLOWED,
                    &Value::Null,
                    jsonrpc::INVALID_REQUEST,
                    "Method Not Allowed: this endpoint takes POST (messages) and DELETE (end a session)",
                    None,
                    "mcp_method_not_allowed",
                );
                answer
                    .headers_mut()
                    .insert(ALLOW, HeaderValue::from_static("POST, DELETE"));
                answer
            }
        }
    }

    async fn post(&self, exchange: &mut Exchange<'_>, body: Body) -> Response<Body> {
        if let Some(answer) = exchange.unacceptable() {
            return answer;
        }
        let bytes = match body.collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(_) => {
                return BodyStatus::answer(exchange.ctx.request_body.failure(), exchange.ctx.max_body_bytes);
            }
        };
        let message = match jsonrpc::parse(&bytes) {
            Ok(message) => message,
            Err(rejected) => return jsonrpc::rejected(rejected),
        };
        let id = match &message {
            Message::Request { id, .. } | Message::Response { id, .. } => id.clone(),
            Message::Notification { .. } => Value::Null,
        };
        if let Some(answer) = exchange.unsupported_version(&id) {
            return answer;
        }
        if let Message::Request { id, method, params } = &message {
            match method.as_str() {
                "initialize" => return self.initialize(exchange, id, params.as_ref()).await,
                "ping" => return jsonrpc::result(id, json!({})),
                _ => {}
            }
        }
        let session = match self.session(exchange, &id) {
            Ok(session) => session,
            Err(answer) => return *answer,
        };
        match message {
            Message::Request { id, method, params } => {
                let params = match params {
                    Some(Value::Object(params)) => params,
                    _ => Map::new(),
                };
                match method.as_str() {
                    "tools/list" | "prompts/list" | "resources/list" | "resources/templates/list" => {
                        self.list(exchange, &session, &id, &method, params).await
                    }
                    "tools/call" => {
                        self.call(exchange, &session, &id, &method, params, ItemKind::Tool)
                            .await
                    }
                    "prompts/get" => {
                        self.call(exchange, &session, &id, &method, params, ItemKind::Prompt)
                            .await
                    }
                    "resources/read" | "resources/subscribe" | "resources/unsubscribe" => {
                        self.call(exchange, &session, &id, &method, params, ItemKind::Resource)
                            .await
                    }
                    "completion/complete" => self.complete(exchange, &session, &id, params).await,
                    "logging/setLevel" => self.set_level(exchange, &session, &id, params).await,
                    _ if !self.multiplexed => {
                        let message = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
                        self.forward(exchange, &session, 0, message).await
                    }
                    _ => jsonrpc::error(
                        StatusCode::OK,
                        &id,
                        jsonrpc::METHOD_NOT_FOUND,
                        format!("Method not found: {method} (not supported across several servers)"),
                        None,
                        "mcp_method_not_found",
                    ),
                }
            }
            Message::Notification { method, params } => {
                self.notify(exchange, &session, &method, params).await
            }
            Message::Response { id, mut message } => {
                let (index, own_id) = if self.multiplexed {
                    match remap::decode_id(&id)
                        .and_then(|(server, own)| Some((self.server_index(server)?, own)))
                    {
                        Some(found) => found,
                        None => {
                            return jsonrpc::error(
                                StatusCode::BAD_REQUEST,
                                &Value::Null,
                                jsonrpc::INVALID_REQUEST,
                                "Invalid Request: a response to no request of this session",
                                None,
                                "mcp_invalid_message",
                            )
                        }
                    }
                } else {
                    (0, id)
                };
                message.insert("id".into(), own_id);
                self.forward(exchange, &session, index, Value::Object(message))
                    .await
            }
        }
    }

    /// The session of a request other than `initialize`: 400 without one, 404 for one we
    /// did not seal (the client must initialize again).
    fn session(&self, exchange: &Exchange<'_>, id: &Value) -> Result<Session, Box<Response<Body>>> {
        let Some(header) = exchange.headers.get(&SESSION_ID) else {
            return Err(Box::new(jsonrpc::error(
                StatusCode::BAD_REQUEST,
                id,
                jsonrpc::INVALID_REQUEST,
                "Bad Request: Missing session ID (send initialize first)",
                None,
                "mcp_no_session",
            )));
        };
        header
            .to_str()
            .ok()
            .and_then(|sealed| self.sealer.open(sealed))
            .ok_or_else(|| Box::new(session_not_found(id)))
    }

    fn server_index(&self, name: &str) -> Option<usize> {
        self.servers.iter().position(|server| &*server.name == name)
    }

    /// The server and own name of an item named as clients see it.
    fn resolve<'n>(&self, kind: ItemKind, public: &'n str) -> Option<(usize, &'n str)> {
        if !self.multiplexed {
            return Some((0, public));
        }
        let (server, own) = match kind {
            ItemKind::Resource => public.split_once(URI_SEPARATOR)?,
            ItemKind::Tool | ItemKind::Prompt => public.split_once(MCP_NAME_SEPARATOR)?,
        };
        Some((self.server_index(server)?, own))
    }

    fn public_name(&self, server: &str, kind: ItemKind, own: &str) -> String {
        match (self.multiplexed, kind) {
            (false, _) => own.to_string(),
            (true, ItemKind::Resource) => format!("{server}{URI_SEPARATOR}{own}"),
            (true, _) => format!("{server}{MCP_NAME_SEPARATOR}{own}"),
        }
    }

    async fn initialize(
        &self,
        exchange: &mut Exchange<'_>,
        id: &Value,
        params: Option<&Value>,
    ) -> Response<Body> {
        let Some(requested) = params
            .and_then(|params| params.get("protocolVersion"))
            .and_then(Value::as_str)
        else {
            return jsonrpc::error(
                StatusCode::OK,
                id,
                jsonrpc::INVALID_PARAMS,
                "Invalid params: initialize needs params.protocolVersion",
                None,
                "mcp_invalid_message",
            );
        };
        let version = SUPPORTED_VERSIONS
            .iter()
            .find(|supported| **supported == requested)
            .unwrap_or(&SUPPORTED_VERSIONS[0]);
        let mut upstream_params = params.cloned().unwrap_or_else(|| json!({}));
        upstream_params["protocolVersion"] = Value::from(*version);
        inject_trace(&mut upstream_params, exchange);
        let message = json!({"jsonrpc": "2.0", "id": id, "method": "initialize", "params": upstream_params});
        let trace = &exchange.ctx.trace;
        let upstream = exchange.upstream;
        let opened = join_all(
            self.servers
                .iter()
                .map(|server| open_session(server, upstream, trace, &message)),
        )
        .await;
        let mut sessions = Vec::new();
        let mut results = Vec::new();
        let mut failure = None;
        for (server, outcome) in self.servers.iter().zip(opened) {
            match outcome {
                Ok((session, result)) => {
                    sessions.push(session);
                    results.push((server, result));
                }
                Err(error) if server.failure_mode == McpFailureMode::Omit => {
                    tracing::warn!(target = %self.name, %error, "MCP server left out of a new session");
                }
                Err(error) => failure = failure.or(Some(error)),
            }
        }
        if failure.is_some() || sessions.is_empty() {
            // Close what was opened: the client gets no session to close it with.
            let opened = Session {
                version: version.to_string(),
                servers: sessions,
            };
            self.close(exchange.upstream, &exchange.ctx.trace, &opened).await;
            let error = failure.map_or_else(
                || "no server could be reached".to_string(),
                |error| error.to_string(),
            );
            return upstream_failed(id, &self.name, &error);
        }
        let merged = self.merge_initialize(version, &results);
        let session = Session {
            version: version.to_string(),
            servers: sessions,
        };
        let mut answer = jsonrpc::result(id, merged);
        if let Ok(sealed) = HeaderValue::from_str(&self.sealer.seal(&session)) {
            answer.headers_mut().insert(SESSION_ID, sealed);
        }
        answer
    }

    fn merge_initialize(&self, version: &str, results: &[(&Server, Value)]) -> Value {
        if let [(_, result)] = results {
            if !self.multiplexed {
                let mut result = result.clone();
                result["protocolVersion"] = Value::from(version);
                return result;
            }
        }
        let mut capabilities = Map::new();
        let mut instructions = Vec::new();
        for (server, result) in results {
            if let Some(Value::Object(offered)) = result.get("capabilities") {
                for (name, value) in offered {
                    let merged = capabilities.entry(name.clone()).or_insert_with(|| json!({}));
                    if let (Value::Object(merged), Value::Object(value)) = (merged, value) {
                        for (flag, on) in value {
                            // Change notifications are not relayed across servers yet.
                            if flag == "listChanged" {
                                continue;
                            }
                            if on.as_bool() == Some(true) || !merged.contains_key(flag) {
                                merged.insert(flag.clone(), on.clone());
                            }
                        }
                    }
                }
            }
            if let Some(text) = result.get("instructions").and_then(Value::as_str) {
                instructions.push(format!("[{}] {text}", server.name));
            }
        }
        let mut merged = json!({
            "protocolVersion": version,
            "capabilities": capabilities,
            "serverInfo": {"name": format!("portcullis {}", self.name), "version": env!("CARGO_PKG_VERSION")},
        });
        if !instructions.is_empty() {
            merged["instructions"] = Value::from(instructions.join("\n\n"));
        }
        merged
    }

    /// Ends every upstream session of `session` (best effort).
    async fn close(&self, upstream: &Upstream, trace: &crate::telemetry::RequestTrace, session: &Session) {
        let closing = session.servers.iter().filter_map(|state| {
            let server = &self.servers[self.server_index(&state.name)?];
            let id = state.id.as_deref()?;
            let headers = Headers {
                session: Some(id),
                version: Some(&state.version),
                trace,
            };
            Some(async move {
                if let Err(error) = server.delete(upstream, &headers).await {
                    tracing::debug!(target = %self.name, %error, "closing an upstream MCP session failed");
                }
            })
        });
        join_all(closing).await;
    }

    async fn delete(&self, exchange: &mut Exchange<'_>) -> Response<Body> {
        let session = match self.session(exchange, &Value::Null) {
            Ok(session) => session,
            Err(answer) => return *answer,
        };
        self.close(exchange.upstream, &exchange.ctx.trace, &session).await;
        let mut answer = Response::new(body::empty());
        *answer.status_mut() = StatusCode::OK;
        answer
    }

    async fn call(
        &self,
        exchange: &mut Exchange<'_>,
        session: &Session,
        id: &Value,
        method: &str,
        mut params: Map<String, Value>,
        kind: ItemKind,
    ) -> Response<Body> {
        let field = if kind == ItemKind::Resource { "uri" } else { "name" };
        let Some(public) = params.get(field).and_then(Value::as_str).map(str::to_string) else {
            return invalid_params(id, format!("Invalid params: {method} needs params.{field}"));
        };
        let Some((index, own)) = self.resolve(kind, &public) else {
            let what = match kind {
                ItemKind::Tool => "tool",
                ItemKind::Prompt => "prompt",
                ItemKind::Resource => "resource",
            };
            return invalid_params(id, format!("Unknown {what}: {public}"));
        };
        let empty = Value::Object(Map::new());
        let arguments = match kind {
            ItemKind::Resource => &empty,
            _ => params.get("arguments").unwrap_or(&empty),
        };
        let item = Item {
            kind,
            server: &self.servers[index].name,
            name: own,
            arguments: Some(arguments),
        };
        if let Some(denied) = self.authorize(exchange, id, &public, item) {
            return denied;
        }
        params.insert(field.into(), Value::from(own));
        let mut params = Value::Object(params);
        inject_trace(&mut params, exchange);
        let message = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        self.forward(exchange, session, index, message).await
    }

    /// `None` when the item may be used; otherwise the denial, recorded in the context.
    fn authorize(
        &self,
        exchange: &mut Exchange<'_>,
        id: &Value,
        public: &str,
        item: Item<'_>,
    ) -> Option<Response<Body>> {
        let rules = &self.rules[self.server_index(item.server)?];
        if rules.is_empty() {
            return None;
        }
        let caller = caller(exchange);
        match rules.judge(&caller, item) {
            Judgement::Unrestricted => None,
            Judgement::Allowed { policy } => {
                exchange.ctx.decisions.push((policy, "allow"));
                None
            }
            // At call time arguments are present, so only a completion can be undecided.
            Judgement::Undecided => None,
            Judgement::Denied { policy, reason } => {
                exchange.ctx.decisions.push((policy.clone(), "deny"));
                Some(jsonrpc::error(
                    StatusCode::OK,
                    id,
                    jsonrpc::DENIED,
                    format!(
                        "{policy}: {} of {public} is not allowed: {reason}",
                        item.kind.method()
                    ),
                    Some(json!({"policy": &*policy, "reason": reason})),
                    "mcp_denied",
                ))
            }
        }
    }

    async fn complete(
        &self,
        exchange: &mut Exchange<'_>,
        session: &Session,
        id: &Value,
        mut params: Map<String, Value>,
    ) -> Response<Body> {
        let reference = params.get("ref").cloned().unwrap_or(Value::Null);
        let (kind, field) = match reference.get("type").and_then(Value::as_str) {
            Some("ref/prompt") => (ItemKind::Prompt, "name"),
            Some("ref/resource") => (ItemKind::Resource, "uri"),
            _ => {
                return invalid_params(
                    id,
                    "Invalid params: ref.type must be ref/prompt or ref/resource".into(),
                )
            }
        };
        let Some(public) = reference.get(field).and_then(Value::as_str) else {
            return invalid_params(
                id,
                format!("Invalid params: completion/complete needs ref.{field}"),
            );
        };
        let Some((index, own)) = self.resolve(kind, public) else {
            return invalid_params(id, format!("Unknown reference: {public}"));
        };
        let item = Item {
            kind,
            server: &self.servers[index].name,
            name: own,
            arguments: None,
        };
        if let Some(denied) = self.authorize(exchange, id, public, item) {
            return denied;
        }
        let mut reference = reference.clone();
        reference[field] = Value::from(own);
        params.insert("ref".into(), reference);
        let mut params = Value::Object(params);
        inject_trace(&mut params, exchange);
        let message = json!({"jsonrpc": "2.0", "id": id, "method": "completion/complete", "params": params});
        self.forward(exchange, session, index, message).await
    }

    async fn set_level(
        &self,
        exchange: &mut Exchange<'_>,
        session: &Session,
        id: &Value,
        params: Map<String, Value>,
    ) -> Response<Body> {
        let mut params = Value::Object(params);
        inject_trace(&mut params, exchange);
        let message = json!({"jsonrpc": "2.0", "id": id, "method": "logging/setLevel", "params": params});
        let outcomes = self.fan_out(exchange, session, &message).await;
        for (server, outcome) in outcomes {
            match outcome {
                Err(error) if error.session_gone => return session_not_found(id),
                Err(error) if server.failure_mode == McpFailureMode::Fail => {
                    return upstream_failed(id, &self.name, &error.to_string())
                }
                _ => {}
            }
        }
        jsonrpc::result(id, json!({}))
    }

    /// Sends a request to every server of the session and reads each result.
    async fn fan_out<'s>(
        &'s self,
        exchange: &Exchange<'_>,
        session: &Session,
        message: &Value,
    ) -> Vec<(&'s Server, Result<Value, Failure>)> {
        let trace = &exchange.ctx.trace;
        let upstream = exchange.upstream;
        let calls = session.servers.iter().filter_map(|state| {
            let server = &self.servers[self.server_index(&state.name)?];
            Some(async move {
                let headers = Headers {
                    session: state.id.as_deref(),
                    version: Some(&state.version),
                    trace,
                };
                let outcome = match server.call(upstream, &headers, message).await {
                    Ok(answer) => answer.result(server),
                    Err(error) => Err(error),
                };
                (server, outcome)
            })
        });
        join_all(calls).await
    }

    async fn notify(
        &self,
        exchange: &mut Exchange<'_>,
        session: &Session,
        method: &str,
        params: Option<Value>,
    ) -> Response<Body> {
        // Each server had its own `notifications/initialized` right after `initialize`.
        if method != "notifications/initialized" {
            let mut message = json!({"jsonrpc": "2.0", "method": method});
            if let Some(params) = params {
                message["params"] = params;
            }
            let trace = &exchange.ctx.trace;
            let upstream = exchange.upstream;
            let sends = session.servers.iter().filter_map(|state| {
                let server = &self.servers[self.server_index(&state.name)?];
                let message = &message;
                Some(async move {
                    let headers = Headers {
                        session: state.id.as_deref(),
                        version: Some(&state.version),
                        trace,
                    };
                    match server.post(upstream, &headers, message).await {
                        Ok(response) => drop(response.into_body().collect().await),
                        Err(error) => tracing::debug!(%error, "an MCP notification was not delivered"),
                    }
                })
            });
            join_all(sends).await;
        }
        let mut accepted = Response::new(body::empty());
        *accepted.status_mut() = StatusCode::ACCEPTED;
        accepted
    }

    /// Sends one message to one server and relays its answer as it comes.
    async fn forward(
        &self,
        exchange: &mut Exchange<'_>,
        session: &Session,
        index: usize,
        message: Value,
    ) -> Response<Body> {
        let server = &self.servers[index];
        let id = message.get("id").cloned().unwrap_or(Value::Null);
        // A server added to the McpBackend after this session began is not in it: the
        // client initializes again and gets it.
        let Some(state) = session.server(&server.name) else {
            return session_not_found(&id);
        };
        exchange.ctx.endpoint = Some(server.name.clone());
        exchange.ctx.attempts = 1;
        let headers = Headers {
            session: state.id.as_deref(),
            version: Some(&state.version),
            trace: &exchange.ctx.trace,
        };
        let started = std::time::Instant::now();
        match server.post(exchange.upstream, &headers, &message).await {
            Err(error) if error.session_gone => session_not_found(&id),
            Err(error) => upstream_failed(&id, &self.name, &error.to_string()),
            Ok(response) => {
                exchange.ctx.upstream_headers = Some(started.elapsed());
                let streamed = server::is_event_stream(response.headers());
                let relayed = server::relay(response, exchange.route.body_idle_timeout);
                if self.multiplexed && streamed {
                    let (parts, inner) = relayed.into_parts();
                    Response::from_parts(parts, body::boxed(remap::RemapRequests::new(inner, &server.name)))
                } else {
                    relayed
                }
            }
        }
    }
}

impl Exchange<'_> {
    /// A protocol version this target does not speak, named by the client's header. The
    /// 2026-07-28 revision answers so: a dual-era client then falls back to `initialize`.
    fn unsupported_version(&self, id: &Value) -> Option<Response<Body>> {
        let requested = self.headers.get(&PROTOCOL_VERSION)?;
        let requested = String::from_utf8_lossy(requested.as_bytes());
        if SUPPORTED_VERSIONS.contains(&requested.as_ref()) {
            return None;
        }
        Some(jsonrpc::error(
            StatusCode::BAD_REQUEST,
            id,
            jsonrpc::UNSUPPORTED_PROTOCOL_VERSION,
            format!("Unsupported protocol version: {requested}"),
            Some(json!({"supported": SUPPORTED_VERSIONS, "requested": requested})),
            "mcp_unsupported_version",
        ))
    }

    /// Streamable HTTP: the body is JSON and the client takes both JSON and SSE answers.
    fn unacceptable(&self) -> Option<Response<Body>> {
        let content_type = self
            .headers
            .get(CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default();
        let media_type = content_type.split(';').next().unwrap_or_default().trim();
        if !media_type.eq_ignore_ascii_case("application/json") {
            return Some(jsonrpc::error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                &Value::Null,
                jsonrpc::INVALID_REQUEST,
                "Unsupported Media Type: Content-Type must be application/json",
                None,
                "mcp_invalid_message",
            ));
        }
        let accepts = |wanted: &str| {
            self.headers.get_all(ACCEPT).iter().any(|value| {
                value.to_str().unwrap_or_default().split(',').any(|range| {
                    let range = range.split(';').next().unwrap_or_default().trim();
                    range.eq_ignore_ascii_case(wanted) || range == "*/*"
                })
            })
        };
        if !(accepts("application/json") && accepts("text/event-stream")) {
            return Some(jsonrpc::error(
                StatusCode::NOT_ACCEPTABLE,
                &Value::Null,
                jsonrpc::INVALID_REQUEST,
                "Not Acceptable: Accept must list application/json and text/event-stream",
                None,
                "mcp_invalid_message",
            ));
        }
        None
    }
}

fn caller(exchange: &Exchange<'_>) -> Caller {
    Caller::new(
        exchange.ctx.client_ip,
        exchange
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_bytes())),
    )
}

/// Continues the trace in `params._meta` too (SEP-414): servers read it there.
fn inject_trace(params: &mut Value, exchange: &Exchange<'_>) {
    let Some(traceparent) = exchange.ctx.trace.traceparent() else {
        return;
    };
    let Value::Object(params) = params else { return };
    let meta = params.entry("_meta").or_insert_with(|| json!({}));
    if let Value::Object(meta) = meta {
        meta.insert(
            "traceparent".into(),
            Value::from(String::from_utf8_lossy(traceparent.as_bytes())),
        );
        match exchange.ctx.trace.tracestate() {
            Some(tracestate) => {
                meta.insert(
                    "tracestate".into(),
                    Value::from(String::from_utf8_lossy(tracestate.as_bytes())),
                );
            }
            None => {
                meta.remove("tracestate");
            }
        }
    }
}

/// Opens a server's session: `initialize`, then `notifications/initialized`.
async fn open_session(
    server: &Server,
    upstream: &Upstream,
    trace: &crate::telemetry::RequestTrace,
    message: &Value,
) -> Result<(ServerSession, Value), Failure> {
    let initial = Headers {
        session: None,
        version: None,
        trace,
    };
    let answer = server.call(upstream, &initial, message).await?;
    let session = answer.session.clone();
    let result = answer.result(server)?;
    let version = result
        .get("protocolVersion")
        .and_then(Value::as_str)
        .unwrap_or(VERSION_WITHOUT_HEADER)
        .to_string();
    let headers = Headers {
        session: session.as_deref(),
        version: Some(&version),
        trace,
    };
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let response = server.post(upstream, &headers, &initialized).await?;
    if !response.status().is_success() {
        return Err(server.failure(format!(
            "refused notifications/initialized with HTTP {}",
            response.status()
        )));
    }
    drop(response.into_body().collect().await);
    Ok((
        ServerSession {
            name: server.name.to_string(),
            id: session,
            version,
        },
        result,
    ))
}

fn session_not_found(id: &Value) -> Response<Body> {
    jsonrpc::error(
        StatusCode::NOT_FOUND,
        id,
        jsonrpc::INVALID_REQUEST,
        "Session not found: initialize again",
        None,
        "mcp_session_not_found",
    )
}

fn invalid_params(id: &Value, message: String) -> Response<Body> {
    jsonrpc::error(
        StatusCode::OK,
        id,
        jsonrpc::INVALID_PARAMS,
        message,
        None,
        "mcp_invalid_params",
    )
}

fn upstream_failed(id: &Value, target: &str, error: &str) -> Response<Body> {
    jsonrpc::error(
        StatusCode::OK,
        id,
        jsonrpc::UPSTREAM_FAILED,
        format!("{target}: {error}"),
        None,
        "mcp_upstream_failed",
    )
}

impl Target for McpTarget {
    fn name(&self) -> &Arc<str> {
        &self.name
    }

    fn forward<'a>(
        &'a self,
        ctx: &'a mut RequestContext,
        route: &'a Route,
        upstream: &'a Upstream,
        request: Request<Body>,
    ) -> ResponseFuture<'a> {
        Box::pin(self.serve(ctx, route, upstream, request))
    }

    fn endpoints(&self) -> Vec<&Authority> {
        self.servers.iter().map(|server| &server.authority).collect()
    }
}
