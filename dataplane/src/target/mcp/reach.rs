//! How one request reaches one server, whichever revision each side speaks
//! (<https://modelcontextprotocol.io/specification/2026-07-28/basic/versioning>):
//!
//! | client ↓ server → | session-based                         | 2026-07-28                    |
//! |-------------------|---------------------------------------|-------------------------------|
//! | session-based     | the server's session from `initialize` | the client's capabilities from `initialize`, as `_meta` |
//! | 2026-07-28        | a session opened for this one request  | passed through                |
//!
//! A server that speaks both is spoken to in the client's revision, so nothing is lost in
//! translation (a legacy client keeps server-to-client requests). Where the revisions
//! differ, the server's questions to the client are translated ([`super::input`]).

use std::sync::Arc;

use http::Response;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use super::input::{Answers, INTERACTIVE};
use super::jsonrpc;
use super::server::{
    Answer, Asked, Failure, Headers, Reply, Server, META_CAPABILITIES, META_CLIENT_INFO, META_LOG_LEVEL,
    META_VERSION, MODERN_VERSION,
};
use super::session::Session;
use crate::telemetry::RequestTrace;
use crate::upstream::{Http1Body, Upstream};

/// The revision a session-based server is spoken to in when the client speaks 2026-07-28.
pub(super) const BRIDGE_VERSION: &str = "2025-11-25";

/// What the client is.
pub(super) enum Downstream {
    /// Session-based: the sealed session of its `initialize`.
    Legacy(Session),
    /// 2026-07-28: the `_meta` fields it sent with this request.
    Modern(Arc<ClientMeta>),
}

/// What a 2026-07-28 server needs to know about the client on every request. A session
/// keeps it when one of its servers speaks that revision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct ClientMeta {
    #[serde(rename = "c")]
    pub(super) capabilities: Value,
    #[serde(rename = "i", default, skip_serializing_if = "Option::is_none")]
    pub(super) info: Option<Value>,
}

impl ClientMeta {
    /// From a modern request's `params._meta`.
    pub(super) fn from_meta(meta: &Map<String, Value>) -> Option<ClientMeta> {
        Some(ClientMeta {
            capabilities: meta.get(META_CAPABILITIES)?.clone(),
            info: meta.get(META_CLIENT_INFO).cloned(),
        })
    }

    /// From a session-based client's `initialize` params.
    pub(super) fn from_initialize(params: &Value) -> ClientMeta {
        ClientMeta {
            capabilities: params.get("capabilities").cloned().unwrap_or_else(|| json!({})),
            info: params.get("clientInfo").cloned(),
        }
    }

    /// Writes the client's fields into `message.params._meta`, as the revision requires.
    fn stamp(&self, message: &mut Value) {
        let Value::Object(object) = message else { return };
        let params = object.entry("params").or_insert_with(|| json!({}));
        let Value::Object(params) = params else { return };
        let meta = params.entry("_meta").or_insert_with(|| json!({}));
        let Value::Object(meta) = meta else { return };
        meta.insert(META_VERSION.into(), Value::from(MODERN_VERSION));
        meta.insert(META_CAPABILITIES.into(), self.capabilities.clone());
        if let Some(info) = &self.info {
            meta.insert(META_CLIENT_INFO.into(), info.clone());
        }
    }
}

/// How this request goes to one server.
pub(super) enum Reach {
    /// The server's own session (or none, for a stateless server) in a session-based revision.
    Session { id: Option<String>, version: String },
    /// 2026-07-28, with the client's `_meta`.
    Modern(Arc<ClientMeta>),
    /// A session-based server for a 2026-07-28 client: a session opened for this request.
    Bridge(Arc<ClientMeta>),
}

/// A server's answer: relayed as it comes, or read whole (a bridged request).
pub(super) enum Sent {
    Relay(Response<Http1Body>),
    Answered(Answer),
}

/// `Ok(None)`: the server is not part of this session (added after it began).
pub(super) async fn reach(
    server: &Server,
    downstream: &Downstream,
    trace: &RequestTrace,
) -> Result<Option<Reach>, Failure> {
    match downstream {
        Downstream::Legacy(session) => {
            let Some(state) = session.server(&server.name) else {
                return Ok(None);
            };
            if state.version == MODERN_VERSION {
                return Ok(Some(Reach::Modern(session.modern_client())));
            }
            Ok(Some(Reach::Session {
                id: state.id.clone(),
                version: state.version.clone(),
            }))
        }
        Downstream::Modern(client) => Ok(Some(if server.speaks_modern(trace).await? {
            Reach::Modern(client.clone())
        } else {
            Reach::Bridge(client.clone())
        })),
    }
}

impl Reach {
    /// The headers for a message sent this way, and the message as the server's revision
    /// wants it; for a bridged request, which opens its own session, the client instead.
    fn prepare<'a>(
        &'a self,
        message: &mut Value,
        trace: &'a RequestTrace,
    ) -> Result<Headers<'a>, &'a ClientMeta> {
        match self {
            Reach::Session { id, version } => Ok(Headers {
                session: id.as_deref(),
                version: Some(version),
                modern: false,
                trace,
            }),
            Reach::Modern(client) => {
                client.stamp(message);
                Ok(Headers {
                    session: None,
                    version: Some(MODERN_VERSION),
                    modern: true,
                    trace,
                })
            }
            Reach::Bridge(client) => Err(client),
        }
    }
}

/// Sends `message` to `server` the way `reach` says.
pub(super) async fn send(
    server: &Arc<Server>,
    reach: &Reach,
    mut message: Value,
    upstream: &Arc<Upstream>,
    trace: &RequestTrace,
) -> Result<Sent, Failure> {
    match reach.prepare(&mut message, trace) {
        Ok(headers) => server.post(&headers, &message).await.map(Sent::Relay),
        Err(client) => bridge(server, client, &message, upstream, trace)
            .await
            .map(Sent::Answered),
    }
}

/// Sends `message` and reads the server's result.
pub(super) async fn ask(
    server: &Arc<Server>,
    reach: &Reach,
    message: Value,
    upstream: &Arc<Upstream>,
    trace: &RequestTrace,
) -> Result<Value, Failure> {
    answer(server, reach, message, upstream, trace)
        .await?
        .result(server)
}

/// Sends `message` and reads the server's whole answer, its own error included.
pub(super) async fn answer(
    server: &Arc<Server>,
    reach: &Reach,
    mut message: Value,
    upstream: &Arc<Upstream>,
    trace: &RequestTrace,
) -> Result<Answer, Failure> {
    match reach.prepare(&mut message, trace) {
        Ok(headers) => server.call(&headers, &message).await,
        Err(client) => bridge(server, client, &message, upstream, trace).await,
    }
}

/// The `_meta` fields of a 2026-07-28 request that the session's `initialize` already said:
/// a server that speaks both revisions would take them for a 2026-07-28 request in a session
/// of an older one, and refuse it (`-32020`).
const MODERN_META: &[&str] = &[META_VERSION, META_CAPABILITIES, META_CLIENT_INFO, META_LOG_LEVEL];

fn strip_modern_meta(message: &mut Value) {
    let Some(Value::Object(params)) = message.get_mut("params") else {
        return;
    };
    let Some(Value::Object(meta)) = params.get_mut("_meta") else {
        return;
    };
    meta.retain(|key, _| !MODERN_META.contains(&key.as_str()));
    if meta.is_empty() {
        params.remove("_meta");
    }
}

/// The `initialize` that opens a session with a session-based server for a 2026-07-28
/// client: its capabilities and info, in the bridge's revision.
pub(super) fn bridge_initialize(client: &ClientMeta) -> Value {
    let mut params = json!({"protocolVersion": BRIDGE_VERSION, "capabilities": client.capabilities});
    params["clientInfo"] = client
        .info
        .clone()
        .unwrap_or_else(|| json!({"name": "portcullis", "version": env!("CARGO_PKG_VERSION")}));
    json!({"jsonrpc": "2.0", "id": "portcullis-bridge", "method": "initialize", "params": params})
}

/// One request to a session-based server for a 2026-07-28 client: initialize, send, read
/// the answer, end the session. The server's questions to the client become an
/// `input_required` result, answered in the next round ([`Answers`]).
async fn bridge(
    server: &Arc<Server>,
    client: &ClientMeta,
    message: &Value,
    upstream: &Arc<Upstream>,
    trace: &RequestTrace,
) -> Result<Answer, Failure> {
    let mut message = message.clone();
    let mut answers = match Answers::take(&mut message) {
        Ok(answers) => answers,
        Err(problem) => {
            let id = message.get("id").cloned().unwrap_or(Value::Null);
            return Ok(Answer {
                message: json!({"jsonrpc": "2.0", "id": id, "error": {
                    "code": jsonrpc::INVALID_PARAMS, "message": problem,
                }}),
                session: None,
            });
        }
    };
    strip_modern_meta(&mut message);
    let initialize = bridge_initialize(client);
    // The session ends with the request, in the background: also when the client leaves
    // (which is how a 2026-07-28 client cancels), and how a call stopped at a question is
    // cancelled.
    let super::initialize::NewSession {
        session,
        closing: _closing,
        ..
    } = super::initialize::open_session_detached(server, upstream, trace, &initialize).await?;
    let headers = Headers {
        session: session.id.as_deref(),
        version: Some(&session.version),
        modern: false,
        trace,
    };
    // Only a result may ask the client (`input_required`); a list or a completion may not.
    let interactive = message
        .get("method")
        .and_then(Value::as_str)
        .is_some_and(|method| INTERACTIVE.contains(&method));
    let asked = &mut |method: &str, params: &Value| {
        if interactive {
            answers.reply(method, params)
        } else {
            Reply::Refuse
        }
    };
    match server.call_asked(&headers, &message, asked).await? {
        Asked::Answered(answer) => Ok(answer),
        Asked::Stopped => {
            let id = message.get("id").cloned().unwrap_or(Value::Null);
            Ok(Answer {
                message: answers.input_required(&id),
                session: None,
            })
        }
    }
}
