//! Starting out: `initialize` for session-based clients (one session per server, sealed
//! into one id) and `server/discover` for 2026-07-28 clients; both merge what the servers
//! offer.

use std::sync::Arc;

use futures::future::join_all;
use http::{HeaderValue, Response};
use portcullis_config::McpFailureMode;
use serde_json::{json, Map, Value};

use super::downstream::LEGACY_VERSIONS;
use super::reach::{bridge_initialize, ClientMeta, Reach};
use super::server::{Closing, Failure, Headers, Server, META_CAPABILITIES, MODERN_VERSION, SESSION_ID};
use super::session::{caller_digest, unix_now, ServerSession, Session};
use super::{inject_trace, invalid_params, jsonrpc, upstream_failed, Exchange, McpTarget};
use crate::body::Body;
use crate::telemetry::RequestTrace;
use crate::upstream::Upstream;

/// Server capabilities passed on to clients (their flags filtered further).
const DELIVERABLE_CAPABILITIES: &[&str] = &["tools", "prompts", "resources", "logging", "completions"];
/// What a server that sends no version is assumed to speak (the spec's rule).
const VERSION_WITHOUT_HEADER: &str = "2025-03-26";

impl McpTarget {
    pub(super) async fn initialize(
        &self,
        exchange: &mut Exchange<'_>,
        id: &Value,
        params: Option<&Value>,
    ) -> Response<Body> {
        let Some(requested) = params
            .and_then(|params| params.get("protocolVersion"))
            .and_then(Value::as_str)
        else {
            return invalid_params(
                id,
                "Invalid params: initialize needs params.protocolVersion".into(),
            );
        };
        let version = LEGACY_VERSIONS
            .iter()
            .find(|supported| **supported == requested)
            .unwrap_or(&LEGACY_VERSIONS[0]);
        let mut upstream_params = params.cloned().unwrap_or_else(|| json!({}));
        upstream_params["protocolVersion"] = Value::from(*version);
        inject_trace(&mut upstream_params, exchange);
        let client = ClientMeta::from_initialize(&upstream_params);
        let message = json!({"jsonrpc": "2.0", "id": id, "method": "initialize", "params": upstream_params});
        let (upstream, trace) = (exchange.upstream, &exchange.ctx.trace);
        // Each session opened ends in the background unless the client gets its id: also
        // when the client leaves before the answer (this future is dropped). Each server's
        // initialize is background work of its own, run to its end whatever becomes of the
        // client or of this worker: cut off mid-answer, it would leave a session open that
        // the gateway never learned of and so could not close.
        // A session taken and then dropped on the worker is closed on the main runtime too:
        // `Closing` spawns its DELETE there.
        let opening = self.servers.iter().map(|server| {
            let (server, task_upstream, trace) = (server.clone(), upstream.clone(), trace.detached());
            let (message, client) = (message.clone(), client.clone());
            upstream.background.outcome(async move {
                open_any_session(&server, &task_upstream, &trace, &message, &client).await
            })
        });
        let opened: Vec<_> = join_all(opening)
            .await
            .into_iter()
            .zip(&self.servers)
            .map(|(outcome, server)| {
                outcome.unwrap_or_else(|| {
                    // Only a panic ends the task without sending; its message went to stderr.
                    tracing::error!(server = %server.name, "opening an MCP session ended without an outcome");
                    Err(server.failure("opening a session failed"))
                })
            })
            .collect();
        let mut sessions = Vec::new();
        let mut offers = Vec::new();
        let mut closings = Vec::new();
        let mut failure = None;
        for (server, outcome) in self.servers.iter().zip(opened) {
            match outcome {
                Ok(opened) => {
                    let session = opened.session;
                    // What it sends outside requests reaches the client on the session's
                    // stream: a server's own session's stream carries it all, a 2026-07-28
                    // server's subscription held for the stream its list changes.
                    let heard = if session.version == MODERN_VERSION {
                        Heard::ListChanges
                    } else if session.id.is_some() {
                        Heard::Everything
                    } else {
                        Heard::Nothing
                    };
                    sessions.push(session);
                    offers.push((server, opened.offer, heard));
                    closings.extend(opened.closing);
                }
                Err(error) if server.failure_mode == McpFailureMode::Omit => {
                    tracing::warn!(target = %self.name, %error, "MCP server left out of a new session");
                }
                Err(error) => failure = failure.or(Some(error)),
            }
        }
        let modern = sessions.iter().any(|session| session.version == MODERN_VERSION);
        let session = Session {
            version: version.to_string(),
            servers: sessions,
            client: modern.then_some(client),
            issued: unix_now(),
            caller: caller_digest(&exchange.headers),
        };
        if failure.is_some() || session.servers.is_empty() {
            // What was opened closes as `closings` goes: the client gets no session to close.
            let error = failure.map_or_else(
                || "no server could be reached".to_string(),
                |error| error.to_string(),
            );
            return upstream_failed(id, &self.name, &error);
        }
        let mut merged = self.merge_offers(&offers);
        merged.insert("protocolVersion".into(), Value::from(*version));
        let mut answer = jsonrpc::result(id, Value::Object(merged));
        if let Ok(sealed) = HeaderValue::from_str(&self.sealer.seal(&session)) {
            answer.headers_mut().insert(SESSION_ID, sealed);
            // The client ends them now.
            closings.into_iter().for_each(Closing::keep);
        }
        answer
    }

    /// `server/discover` for a 2026-07-28 client: what the servers offer, merged.
    pub(super) async fn discover(
        &self,
        exchange: &mut Exchange<'_>,
        id: &Value,
        client: &ClientMeta,
    ) -> Response<Body> {
        let (upstream, trace) = (exchange.upstream, &exchange.ctx.trace);
        let offers = join_all(
            self.servers
                .iter()
                .map(|server| offer(server, upstream, trace, client)),
        )
        .await;
        let mut merged_offers = Vec::new();
        for (server, outcome) in self.servers.iter().zip(offers) {
            match outcome {
                Ok((offer, heard)) => merged_offers.push((server, offer, heard)),
                Err(error) if server.failure_mode == McpFailureMode::Omit => {
                    tracing::warn!(target = %self.name, %error, "MCP server left out of server/discover");
                }
                Err(error) => return upstream_failed(id, &self.name, &error.to_string()),
            }
        }
        let mut merged = self.merge_offers(&merged_offers);
        let server_info = merged.remove("serverInfo").unwrap_or(Value::Null);
        merged.insert("supportedVersions".into(), json!([MODERN_VERSION]));
        merged.insert("ttlMs".into(), Value::from(0));
        merged.insert("cacheScope".into(), Value::from("private"));
        merged.insert("resultType".into(), Value::from("complete"));
        merged.insert(
            "_meta".into(),
            json!({"io.modelcontextprotocol/serverInfo": server_info}),
        );
        jsonrpc::result(id, Value::Object(merged))
    }

    /// Capabilities, instructions and server info of the servers as one server's. Each offer
    /// comes with which of the server's notifications can reach the client: `listChanged`
    /// and resource `subscribe` are offered only where they can.
    fn merge_offers(&self, offers: &[(&Arc<Server>, Value, Heard)]) -> Map<String, Value> {
        let mut capabilities = Map::new();
        let mut instructions = Vec::new();
        for (server, offer, heard) in offers {
            if let Some(Value::Object(offered)) = offer.get("capabilities") {
                // Only what the gateway delivers: no tasks, no extensions.
                let deliverable = offered
                    .iter()
                    .filter(|(name, _)| DELIVERABLE_CAPABILITIES.contains(&name.as_str()));
                for (name, value) in deliverable {
                    let merged = capabilities.entry(name.clone()).or_insert_with(|| json!({}));
                    if let (Value::Object(merged), Value::Object(value)) = (merged, value) {
                        for (flag, on) in value {
                            let deliverable = match flag.as_str() {
                                "subscribe" => *heard == Heard::Everything,
                                "listChanged" => *heard != Heard::Nothing,
                                _ => true,
                            };
                            if !deliverable {
                                continue;
                            }
                            if on.as_bool() == Some(true) || !merged.contains_key(flag) {
                                merged.insert(flag.clone(), on.clone());
                            }
                        }
                    }
                }
            }
            if let Some(text) = offer.get("instructions").and_then(Value::as_str) {
                instructions.push(format!("[{}] {text}", server.name));
            }
        }
        let mut merged = Map::new();
        merged.insert("capabilities".into(), Value::Object(capabilities));
        if let ([(_, offer, _)], false) = (offers, self.multiplexed) {
            // One server: its own name and instructions, as if the gateway were not there.
            for field in ["instructions", "serverInfo"] {
                if let Some(value) = offer.get(field) {
                    merged.insert(field.into(), value.clone());
                }
            }
            return merged;
        }
        merged.insert(
            "serverInfo".into(),
            json!({"name": format!("portcullis {}", self.name), "version": env!("CARGO_PKG_VERSION")}),
        );
        if !instructions.is_empty() {
            merged.insert("instructions".into(), Value::from(instructions.join("\n\n")));
        }
        merged
    }

    /// Ends every upstream session of `session` (best effort).
    pub(super) async fn close(&self, trace: &RequestTrace, session: &Session) {
        let closing = session.servers.iter().filter_map(|state| {
            let server = &self.servers[self.server_index(&state.name)?];
            let id = state.id.as_deref()?;
            let headers = Headers {
                session: Some(id),
                version: Some(&state.version),
                modern: false,
                trace,
            };
            Some(async move {
                if let Err(error) = server.delete(&headers).await {
                    tracing::debug!(target = %self.name, %error, "closing an upstream MCP session failed");
                }
            })
        });
        join_all(closing).await;
    }
}

/// A session-based client's session with one server: the server's own session when it
/// takes `initialize`, else (a 2026-07-28-only server) none, the client's capabilities
/// then going with every request. Returns what the server offers.
async fn open_any_session(
    server: &Arc<Server>,
    upstream: &Arc<Upstream>,
    trace: &RequestTrace,
    message: &Value,
    client: &ClientMeta,
) -> Result<NewSession, Failure> {
    let refused = match open_session(server, upstream, trace, message).await {
        Ok(opened) => return Ok(opened),
        Err(error) if error.answered => error,
        Err(error) => return Err(error),
    };
    if !server.speaks_modern(trace).await? {
        return Err(refused);
    }
    let offer = modern_offer(server, upstream, trace, client).await?;
    Ok(NewSession {
        session: ServerSession {
            name: server.name.to_string(),
            id: None,
            version: MODERN_VERSION.to_string(),
            // Its level travels in each request's `_meta` instead.
            takes_no_log_level: true,
        },
        offer,
        closing: None,
    })
}

/// Which of a server's notifications reach the client: what decides the `listChanged` and
/// resource `subscribe` flags the gateway offers for it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Heard {
    Nothing,
    /// Its list changes only (a 2026-07-28 server behind a session-based client's stream).
    ListChanges,
    Everything,
}

/// What a server offers, in whichever revision it speaks, and what of its notifications can
/// reach a 2026-07-28 client's `subscriptions/listen`: all of a 2026-07-28 server's, and a
/// session-based server's in a session opened for the subscription (if it keeps sessions).
async fn offer(
    server: &Arc<Server>,
    upstream: &Arc<Upstream>,
    trace: &RequestTrace,
    client: &ClientMeta,
) -> Result<(Value, Heard), Failure> {
    if server.speaks_modern(trace).await? {
        return Ok((
            modern_offer(server, upstream, trace, client).await?,
            Heard::Everything,
        ));
    }
    // Only the offer is wanted: the session ends at once, in the background.
    let opened = open_session_detached(server, upstream, trace, &bridge_initialize(client)).await?;
    let heard = if opened.session.id.is_some() {
        Heard::Everything
    } else {
        Heard::Nothing
    };
    Ok((opened.offer, heard))
}

async fn modern_offer(
    server: &Arc<Server>,
    upstream: &Arc<Upstream>,
    trace: &RequestTrace,
    client: &ClientMeta,
) -> Result<Value, Failure> {
    let message = json!({"jsonrpc": "2.0", "id": "portcullis-discover", "method": "server/discover",
        "params": {"_meta": {META_CAPABILITIES: client.capabilities}}});
    let mut offer = super::reach::ask(
        server,
        &Reach::Modern(std::sync::Arc::new(client.clone())),
        message,
        upstream,
        trace,
    )
    .await?;
    if let Some(info) = offer
        .get("_meta")
        .and_then(|meta| meta.get("io.modelcontextprotocol/serverInfo"))
        .cloned()
    {
        offer["serverInfo"] = info;
    }
    Ok(offer)
}

/// Opens a server's session: `initialize`, then `notifications/initialized`.
/// A session just opened with a server.
pub(super) struct NewSession {
    pub(super) session: ServerSession,
    /// What the server offers (its `initialize` result).
    pub(super) offer: Value,
    /// Ends the session when dropped, unless kept: one whose id nobody will use must not
    /// linger. `None` for a server that keeps no session.
    pub(super) closing: Option<Closing>,
}

/// [`open_session`] as background work of its own, run to its end whatever becomes of the
/// request that wants the session: cut off mid-answer, it would leave a session open that
/// the gateway never learned of and so could not close.
pub(super) async fn open_session_detached(
    server: &Arc<Server>,
    upstream: &Arc<Upstream>,
    trace: &RequestTrace,
    message: &Value,
) -> Result<NewSession, Failure> {
    let (task_server, task_upstream) = (server.clone(), upstream.clone());
    let (trace, message) = (trace.detached(), message.clone());
    upstream
        .background
        .outcome(async move { open_session(&task_server, &task_upstream, &trace, &message).await })
        .await
        .unwrap_or_else(|| {
            // Only a panic ends the task without an outcome; its message went to stderr.
            tracing::error!(server = %server.name, "opening an MCP session ended without an outcome");
            Err(server.failure("opening a session failed"))
        })
}

async fn open_session(
    server: &Server,
    upstream: &Upstream,
    trace: &RequestTrace,
    message: &Value,
) -> Result<NewSession, Failure> {
    let initial = Headers {
        session: None,
        version: None,
        modern: false,
        trace,
    };
    let answer = server.call(&initial, message).await?;
    let session = answer.session.clone();
    let result = answer.result(server)?;
    let version = result
        .get("protocolVersion")
        .and_then(Value::as_str)
        .unwrap_or(VERSION_WITHOUT_HEADER)
        .to_string();
    // From here the server holds a session: it ends whatever becomes of this request.
    let closing = session
        .as_deref()
        .map(|id| server.close_on_drop(upstream, id, &version));
    let headers = Headers {
        session: session.as_deref(),
        version: Some(&version),
        modern: false,
        trace,
    };
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let refused = match server.post(&headers, &initialized).await {
        Ok(response) if response.status().is_success() => {
            server.drain(response).await;
            None
        }
        Ok(response) => Some(server.failure(format!(
            "refused notifications/initialized with HTTP {}",
            response.status()
        ))),
        Err(error) => Some(error),
    };
    if let Some(error) = refused {
        return Err(error);
    }
    let takes_no_log_level = result
        .get("capabilities")
        .and_then(|capabilities| capabilities.get("logging"))
        .is_none();
    Ok(NewSession {
        session: ServerSession {
            name: server.name.to_string(),
            id: session,
            version,
            takes_no_log_level,
        },
        offer: result,
        closing,
    })
}
