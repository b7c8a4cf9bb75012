//! The McpBackend target: several MCP servers behind one route, over Streamable HTTP, in
//! the session-based revisions (2025-03-26, 2025-06-18, 2025-11-25;
//! <https://modelcontextprotocol.io/specification/2025-11-25/basic/transports>) and the
//! stateless 2026-07-28 one, a client of either reaching servers of either ([`reach`]).
//!
//! The target answers by itself. `initialize` opens one upstream session per server and
//! hands the client one session id that seals them all ([`session`]); lists fan out and
//! merge ([`lists`]); a call goes to the server its prefixed name names, and the server's
//! answer, JSON or SSE, passes through as it comes ([`server::relay`], [`remap`]).

mod authz;
mod bridged_listen;
mod cache;
mod call;
mod cancel;
mod downstream;
mod guarded;
mod handover;
mod initialize;
mod input;
mod jsonrpc;
mod listen;
mod lists;
mod pins;
mod reach;
mod remap;
mod resume;
mod server;
mod session;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use futures::future::join_all;
use http::header::ALLOW;
use http::uri::Authority;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use portcullis_config::mcp_rules::{Caller, ItemKind};
use portcullis_config::{
    ConfigSet, GuardrailPhase, KindSpec, McpBackendSpec, McpFailureMode, MCP_NAME_SEPARATOR,
};
use serde_json::{json, Map, Value};

use self::authz::ServerRules;
pub(crate) use self::cache::ListChanges;
pub(crate) use self::cancel::Cancellations;
use self::downstream::Era;
use self::guarded::ServerGuards;
pub(crate) use self::handover::ANSWERS_PATH;
pub(crate) use self::input::InputWaits;
use self::jsonrpc::{accepted, invalid_params, session_not_found, upstream_failed, Message};
pub(crate) use self::pins::PinObservations;
use self::pins::ServerPins;
use self::reach::{Downstream, Reach, Sent};
use self::server::{Server, SESSION_ID};
use self::session::{Sealer, Session};
use super::{ResponseFuture, Target};
use crate::body::{self, Body, BodyStatus};
use crate::policy::guardrail::GuardrailIndex;
use crate::policy::RequestContext;
use crate::route::Route;
use crate::telemetry::McpRecord;
use crate::upstream::Upstream;

/// The servers of the config version in force: McpBackend, server name, the server.
type ServerInForce = (Arc<str>, Arc<str>, std::sync::Weak<Server>);

/// The servers of the config version in force, by McpBackend and name: what a subscription
/// held across versions asks again, so it follows a server's new URL or TLS settings and ends
/// with the server.
#[derive(Default)]
pub(crate) struct ServersInForce(std::sync::Mutex<Vec<ServerInForce>>);

impl ServersInForce {
    fn servers(&self) -> std::sync::MutexGuard<'_, Vec<ServerInForce>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Server `server` of McpBackend `target` as the version in force has it.
    fn get(&self, target: &str, server: &str) -> Option<Arc<Server>> {
        self.servers()
            .iter()
            .find(|(of, name, _)| **of == *target && **name == *server)
            .and_then(|(.., server)| server.upgrade())
    }

    /// Puts one server in force, as a config version with it would.
    #[cfg(test)]
    fn put_server_in_force(&self, target: &str, server: &Arc<Server>) {
        self.servers()
            .push((Arc::from(target), server.name.clone(), Arc::downgrade(server)));
    }

    /// The servers of `targets`, the version now in force, in place of the last one's.
    pub(crate) fn put_in_force(&self, targets: &[Arc<McpTarget>]) {
        *self.servers() = targets
            .iter()
            .flat_map(|target| {
                target
                    .servers
                    .iter()
                    .map(|server| (target.name.clone(), server.name.clone(), Arc::downgrade(server)))
            })
            .collect();
    }
}

/// Between a server's name and a resource URI of it: `math+file:///notes`.
pub(super) const URI_SEPARATOR: char = '+';
/// Client notifications sent on to the servers of a session.
const FORWARDED_NOTIFICATIONS: &[&str] = &[
    "notifications/cancelled",
    "notifications/progress",
    "notifications/roots/list_changed",
];
/// Methods recorded by name in metrics and logs; any other is `other` (a client can send
/// any string, and each would be a new metric series).
const KNOWN_METHODS: &[&str] = &[
    "initialize",
    "server/discover",
    "ping",
    "tools/list",
    "tools/call",
    "prompts/list",
    "prompts/get",
    "resources/list",
    "resources/templates/list",
    "resources/read",
    "resources/subscribe",
    "resources/unsubscribe",
    "completion/complete",
    "logging/setLevel",
    "subscriptions/listen",
    "notifications/initialized",
    "notifications/cancelled",
    "notifications/progress",
    "notifications/roots/list_changed",
];

pub(crate) struct McpTarget {
    name: Arc<str>,
    servers: Vec<Arc<Server>>,
    /// Parallel to `servers`.
    rules: Vec<ServerRules>,
    /// Parallel to `servers`.
    guards: Vec<ServerGuards>,
    multiplexed: bool,
    sealer: Arc<Sealer>,
    lists: cache::ListCache,
    /// Parallel to `servers`: the McpToolPins covering each, if any.
    pins: Vec<Option<ServerPins>>,
    tool_pins: Arc<PinObservations>,
}

/// One request being served: what every handler needs.
struct Exchange<'a> {
    ctx: &'a mut RequestContext,
    route: &'a Route,
    upstream: &'a Arc<Upstream>,
    headers: http::HeaderMap,
}

impl McpTarget {
    pub(crate) fn compile(
        name: &str,
        spec: &McpBackendSpec,
        config: &ConfigSet,
        guardrails: &GuardrailIndex,
        upstream: &Upstream,
    ) -> Result<McpTarget, String> {
        let target: Arc<str> = Arc::from(format!("{}/{name}", McpBackendSpec::INFO.name));
        let servers = spec
            .servers
            .iter()
            .map(|server| {
                Server::compile(server, upstream)
                    .map(Arc::new)
                    .map_err(|error| format!("{target}: server {}: {error}", server.name))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let rules = spec
            .servers
            .iter()
            .map(|server| ServerRules::compile(config, name, &server.name))
            .collect::<Result<Vec<_>, _>>()?;
        let guards = spec
            .servers
            .iter()
            .map(|server| ServerGuards {
                request: guardrails.mcp(GuardrailPhase::McpRequest, name, &server.name),
                response: guardrails.mcp(GuardrailPhase::McpResponse, name, &server.name),
            })
            .collect();
        let pins = spec
            .servers
            .iter()
            .map(|server| ServerPins::compile(config, name, &server.name))
            .collect();
        let keys = servers
            .iter()
            .map(|server| (target.clone(), server.name.clone(), server.url.clone()))
            .collect();
        Ok(McpTarget {
            pins,
            tool_pins: upstream.tool_pins.clone(),
            lists: cache::ListCache::new(upstream.list_changes.clone(), keys),
            guards,
            sealer: Arc::new(Sealer::load(&target, &spec.session_keys, spec.session_ttl())?),
            name: target,
            servers,
            rules,
            multiplexed: spec.multiplexed(),
        })
    }

    /// What a `list_changed` notification of server `index` makes stale.
    fn list_watch(&self, index: usize) -> remap::ListWatch {
        remap::ListWatch {
            lists: self.lists.clone(),
            server: index,
            tool_pins: self.tool_pins.clone(),
            key: self.pin_key(index),
        }
    }

    /// Each of its servers, as [`PinObservations`] keys them.
    pub(crate) fn server_keys(&self) -> impl Iterator<Item = pins::ServerKey> + '_ {
        (0..self.servers.len()).map(|index| self.pin_key(index))
    }

    async fn serve(
        &self,
        ctx: &mut RequestContext,
        route: &Route,
        upstream: &Arc<Upstream>,
        request: Request<Body>,
    ) -> Response<Body> {
        let (parts, body) = request.into_parts();
        let mut exchange = Exchange {
            ctx,
            route,
            upstream,
            headers: parts.headers,
        };
        exchange.ctx.mcp = Some(McpRecord {
            method: Arc::from(match parts.method {
                Method::DELETE => "(end session)",
                Method::GET => "(stream)",
                _ => "(none)",
            }),
            ..McpRecord::default()
        });
        let answer = match parts.method {
            Method::POST => self.post(&mut exchange, body).await,
            Method::DELETE => self.delete(&mut exchange).await,
            Method::GET => self.listen(&mut exchange).await,
            _ => {
                let mut answer = jsonrpc::error(
                    StatusCode::METHOD_NOT_ALLOWED,
                    &Value::Null,
                    jsonrpc::INVALID_REQUEST,
                    "Method Not Allowed: this endpoint takes POST (messages), GET (the session's stream) \
                     and DELETE (end a session)",
                    None,
                    "mcp_method_not_allowed",
                );
                answer
                    .headers_mut()
                    .insert(ALLOW, HeaderValue::from_static("GET, POST, DELETE"));
                answer
            }
        };
        if let (Some(code), Some(record)) = (
            answer.extensions().get::<jsonrpc::ErrorCode>(),
            &mut exchange.ctx.mcp,
        ) {
            record.error_code = Some(code.0);
        }
        answer
    }

    async fn post(&self, exchange: &mut Exchange<'_>, body: Body) -> Response<Body> {
        if let Some(answer) = downstream::unacceptable(&exchange.headers) {
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
        let (id, method) = match &message {
            Message::Request { id, method, .. } => (id.clone(), Some(method.as_str())),
            Message::Response { id, .. } => (id.clone(), None),
            Message::Notification { method, .. } => (Value::Null, Some(method.as_str())),
        };
        if let Some(record) = &mut exchange.ctx.mcp {
            let known = |method: &str| KNOWN_METHODS.iter().copied().find(|known| *known == method);
            record.method = Arc::from(method.map_or(Some("(response)"), known).unwrap_or("other"));
        }
        match downstream::era(&exchange.headers, method, &id) {
            Err(answer) => *answer,
            Ok(Era::Legacy) => self.legacy(exchange, message).await,
            Ok(Era::Modern) => self.modern(exchange, message).await,
        }
    }

    async fn legacy(&self, exchange: &mut Exchange<'_>, message: Message) -> Response<Body> {
        let id = match &message {
            Message::Request { id, method, params } => match method.as_str() {
                "initialize" => return self.initialize(exchange, id, params.as_ref()).await,
                "ping" => return jsonrpc::result(id, json!({})),
                _ => id.clone(),
            },
            Message::Response { id, .. } => id.clone(),
            Message::Notification { .. } => Value::Null,
        };
        let session = match self.session(exchange, &id) {
            Ok(session) => session,
            Err(answer) => return *answer,
        };
        let downstream = Downstream::Legacy(session);
        match message {
            Message::Request { id, method, params } => {
                // Cancellable from here, by the client's `notifications/cancelled`.
                let session = session_header(&exchange.headers).unwrap_or_default();
                let cancellable = exchange.upstream.cancellations.register(session, &id);
                cancellable
                    .run(self.request(exchange, &downstream, &id, &method, params))
                    .await
            }
            Message::Notification { method, params } => {
                self.notify(exchange, &downstream, &method, params).await
            }
            Message::Response { id, message } => {
                let session = session_header(&exchange.headers).unwrap_or_default();
                let waits = &exchange.upstream.input_waits;
                let mut message = match waits.deliver(&id, session, message) {
                    input::Delivery::NotOurs(message) => message,
                    input::Delivery::Delivered => return accepted(),
                    input::Delivery::NotWaiting(message) => {
                        let id = id.as_str().unwrap_or_default();
                        let idle = exchange.route.body_idle_timeout;
                        return handover::hand_over(&self.sealer, waits, id, session, message, idle).await;
                    }
                };
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
                self.forward(exchange, &downstream, index, Value::Object(message))
                    .await
            }
        }
    }

    async fn modern(&self, exchange: &mut Exchange<'_>, message: Message) -> Response<Body> {
        let (id, method, params) = match message {
            Message::Request { id, method, params } => (id, method, params),
            Message::Notification { method, params } => {
                if let Err(answer) =
                    downstream::modern_client(&exchange.headers, &method, params.as_ref(), &Value::Null)
                {
                    return *answer;
                }
                // 2026-07-28 cancels by closing the stream; other notifications from the
                // client have nowhere to go without sessions.
                return accepted();
            }
            Message::Response { .. } => return jsonrpc::error(
                StatusCode::BAD_REQUEST,
                &Value::Null,
                jsonrpc::INVALID_REQUEST,
                "Invalid Request: 2026-07-28 clients send no responses (answer input requests by retrying)",
                None,
                "mcp_invalid_message",
            ),
        };
        let client = match downstream::modern_client(&exchange.headers, &method, params.as_ref(), &id) {
            Ok(client) => client,
            Err(answer) => return *answer,
        };
        match method.as_str() {
            "server/discover" => self.discover(exchange, &id, &client).await,
            "subscriptions/listen" => self.subscribe(exchange, &id, &client, params).await,
            "ping" => jsonrpc::result(&id, json!({})),
            _ => {
                self.request(exchange, &Downstream::Modern(client), &id, &method, params)
                    .await
            }
        }
    }

    /// A request of either era, once the client is known.
    async fn request(
        &self,
        exchange: &mut Exchange<'_>,
        downstream: &Downstream,
        id: &Value,
        method: &str,
        params: Option<Value>,
    ) -> Response<Body> {
        let params = match params {
            Some(Value::Object(params)) => params,
            _ => Map::new(),
        };
        let modern = matches!(downstream, Downstream::Modern(_));
        match method {
            "tools/list" | "prompts/list" | "resources/list" | "resources/templates/list" => {
                self.list(exchange, downstream, id, method, params).await
            }
            "tools/call" => {
                self.call(exchange, downstream, id, method, params, ItemKind::Tool)
                    .await
            }
            "prompts/get" => {
                self.call(exchange, downstream, id, method, params, ItemKind::Prompt)
                    .await
            }
            "resources/read" | "resources/subscribe" | "resources/unsubscribe" => {
                self.call(exchange, downstream, id, method, params, ItemKind::Resource)
                    .await
            }
            "completion/complete" => self.complete(exchange, downstream, id, params).await,
            "logging/setLevel" if !modern => self.set_level(exchange, downstream, id, params).await,
            // One server with nothing to hold it to: methods the gateway does not know pass
            // through. Rules, guardrails and pins could not be applied to them (`tasks/result`
            // would hand over a result no guardrail saw), so with any of those they are refused.
            _ if !self.multiplexed && self.holds_nothing_to(0) => {
                let message = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
                self.forward(exchange, downstream, 0, message).await
            }
            _ => jsonrpc::error(
                // 2026-07-28 tells an unknown method apart from a missing endpoint by 404.
                if modern {
                    StatusCode::NOT_FOUND
                } else {
                    StatusCode::OK
                },
                id,
                jsonrpc::METHOD_NOT_FOUND,
                if self.multiplexed {
                    format!("Method not found: {method} (not supported across several servers)")
                } else {
                    format!(
                        "Method not found: {method} (not passed to a server held to McpAuthorization, \
                         Guardrails or McpToolPins, which could not be applied to it)"
                    )
                },
                None,
                "mcp_method_not_found",
            ),
        }
    }

    /// The session of a request other than `initialize`: 400 without one, 404 for one we
    /// did not seal, or sealed for another caller (the client must initialize again).
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
            .filter(|session| session.caller == session::caller_digest(&exchange.headers))
            .ok_or_else(|| Box::new(session_not_found(id)))
    }

    /// Whether server `index` has no McpAuthorization rules, Guardrails or McpToolPins.
    fn holds_nothing_to(&self, index: usize) -> bool {
        let guards = &self.guards[index];
        self.rules[index].is_empty()
            && guards.request.is_empty()
            && guards.response.is_empty()
            && self.pins[index].is_none()
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

    async fn delete(&self, exchange: &mut Exchange<'_>) -> Response<Body> {
        let session = match self.session(exchange, &Value::Null) {
            Ok(session) => session,
            Err(answer) => return *answer,
        };
        self.close(&exchange.ctx.trace, &session).await;
        Response::new(body::empty())
    }

    async fn set_level(
        &self,
        exchange: &mut Exchange<'_>,
        downstream: &Downstream,
        id: &Value,
        params: Map<String, Value>,
    ) -> Response<Body> {
        let mut params = Value::Object(params);
        inject_trace(&mut params, exchange);
        let message = json!({"jsonrpc": "2.0", "id": id, "method": "logging/setLevel", "params": params});
        // Only to the servers that offered `logging`: another would answer "method not
        // found" and fail the client's request. A 2026-07-28 server has no such method at
        // all (its level travels in each request's `_meta`); a session sealed by an older
        // build does not say which offered it, but does say which speak 2026-07-28.
        let speaks_set_level = |index: &usize| match downstream {
            Downstream::Legacy(session) => session
                .server(&self.servers[*index].name)
                .is_none_or(|state| !state.takes_no_log_level && state.version != server::MODERN_VERSION),
            Downstream::Modern(_) => true,
        };
        let asked: Vec<usize> = (0..self.servers.len()).filter(speaks_set_level).collect();
        for (index, outcome) in self
            .ask_each(exchange, downstream, &asked, |_| message.clone())
            .await
        {
            match outcome {
                Err(Problem::SessionGone) => return session_not_found(id),
                Err(Problem::Failed(error)) if self.servers[index].failure_mode == McpFailureMode::Fail => {
                    return upstream_failed(id, &self.name, &error)
                }
                _ => {}
            }
        }
        jsonrpc::result(id, json!({}))
    }

    /// Asks each of `indexes` (those in the client's session) at once and reads the results.
    async fn ask_each(
        &self,
        exchange: &Exchange<'_>,
        downstream: &Downstream,
        indexes: &[usize],
        message: impl Fn(usize) -> Value,
    ) -> Vec<(usize, Result<Value, Problem>)> {
        let (upstream, trace) = (exchange.upstream, &exchange.ctx.trace);
        let asks = indexes.iter().map(|&index| {
            let message = message(index);
            async move {
                let server = &self.servers[index];
                let outcome = match reach::reach(server, downstream, trace).await {
                    Ok(None) => return None,
                    Ok(Some(how)) => reach::ask(server, &how, message, upstream, trace).await,
                    Err(error) => Err(error),
                };
                Some((index, outcome.map_err(Problem::from)))
            }
        });
        join_all(asks).await.into_iter().flatten().collect()
    }

    async fn notify(
        &self,
        exchange: &mut Exchange<'_>,
        downstream: &Downstream,
        method: &str,
        params: Option<Value>,
    ) -> Response<Body> {
        // Each server had its own `notifications/initialized` right after `initialize`;
        // anything but these few is dropped: a notification is never a way around routing
        // and rules (a server built on a plain JSON-RPC library would run any method).
        if let (Downstream::Legacy(_), "notifications/cancelled", Some(session)) =
            (downstream, method, session_header(&exchange.headers))
        {
            // Ends the gateway's work on the request (what it sent a 2026-07-28 server
            // included); the session-based servers below get the notification itself.
            if let Some(request) = params.as_ref().and_then(|params| params.get("requestId")) {
                exchange.upstream.cancellations.cancel(session, request);
            }
        }
        if FORWARDED_NOTIFICATIONS.contains(&method) {
            let mut message = json!({"jsonrpc": "2.0", "method": method});
            if let Some(params) = params {
                message["params"] = params;
            }
            let (upstream, trace) = (exchange.upstream, &exchange.ctx.trace);
            let sends = self.servers.iter().map(|server| {
                let message = message.clone();
                async move {
                    let Ok(Some(how @ Reach::Session { .. })) = reach::reach(server, downstream, trace).await
                    else {
                        return;
                    };
                    match reach::send(server, &how, message, upstream, trace).await {
                        Ok(Sent::Relay(response)) => server.drain(response).await,
                        Ok(Sent::Answered(_)) => {}
                        Err(error) => tracing::debug!(%error, "an MCP notification was not delivered"),
                    }
                }
            });
            join_all(sends).await;
        }
        accepted()
    }
}

/// Why a server gave no result.
enum Problem {
    /// The server no longer knows the client's session.
    SessionGone,
    Failed(String),
}

impl From<server::Failure> for Problem {
    fn from(failure: server::Failure) -> Problem {
        if failure.session_gone {
            Problem::SessionGone
        } else {
            Problem::Failed(failure.to_string())
        }
    }
}

/// The client's `Mcp-Session-Id` as it sent it.
fn session_header(headers: &http::HeaderMap) -> Option<&str> {
    headers.get(&SESSION_ID).and_then(|value| value.to_str().ok())
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

impl Target for McpTarget {
    fn name(&self) -> &Arc<str> {
        &self.name
    }

    fn forward<'a>(
        &'a self,
        ctx: &'a mut RequestContext,
        route: &'a Route,
        upstream: &'a Arc<Upstream>,
        request: Request<Body>,
    ) -> ResponseFuture<'a> {
        Box::pin(self.serve(ctx, route, upstream, request))
    }

    fn endpoints(&self) -> Vec<&Authority> {
        self.servers.iter().map(|server| &server.authority).collect()
    }
}
