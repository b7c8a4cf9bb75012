//! What the test server answers to one HTTP exchange, independent of hyper: era detection,
//! sessions (legacy), `_meta`/header validation (2026-07-28) and the JSON-RPC methods.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use http::StatusCode;
use serde_json::{json, Map, Value};
use tokio::sync::watch;

use super::protocol::*;
use super::server::ServedEras;
use super::tools::Catalog;

/// Legacy sessions are kept until DELETE; a client (or proxy) that never deletes them would
/// otherwise grow the map without bound during a long load test.
const MAX_SESSIONS: usize = 100_000;

pub struct State {
    pub catalog: Catalog,
    pub delay: Duration,
    era: ServedEras,
    sessions: Mutex<HashMap<String, Session>>,
}

struct Session {
    version: String,
    /// Held GET streams subscribe here and end when the session (and this sender) is dropped.
    streams: watch::Sender<()>,
}

pub struct Reply {
    pub status: StatusCode,
    pub body: ReplyBody,
    /// Legacy era: echoed on every response of the session, like the Python SDK does.
    pub session: Option<String>,
}

pub enum ReplyBody {
    Empty,
    /// Transport-level errors: always `application/json`.
    Json(Value),
    /// The answer to a request: JSON or SSE as the client's `Accept` allows, after `delay`.
    Message {
        message: Value,
        delay: Duration,
    },
    /// A legacy GET stream: no events, open until the session ends.
    Stream(watch::Receiver<()>),
}

/// The request headers dispatch looks at.
#[derive(Default)]
pub struct Headers<'a> {
    pub session: Option<&'a str>,
    pub version: Option<&'a str>,
    pub method: Option<&'a str>,
    pub name: Option<&'a str>,
}

impl Reply {
    fn new(status: StatusCode, body: ReplyBody) -> Self {
        Reply {
            status,
            body,
            session: None,
        }
    }

    fn error(
        status: StatusCode,
        id: Option<&Value>,
        code: i64,
        message: &str,
        data: Option<Value>,
        modern: bool,
    ) -> Self {
        Reply::new(
            status,
            ReplyBody::Json(error_response(id, code, message, data, modern)),
        )
    }

    fn answer(message: Value, delay: Duration) -> Self {
        Reply::new(StatusCode::OK, ReplyBody::Message { message, delay })
    }

    fn with_session(mut self, session: &str) -> Self {
        self.session = Some(session.to_string());
        self
    }
}

/// A JSON-RPC message that passed structural validation.
struct Message<'a> {
    id: Option<&'a Value>,
    method: Option<&'a str>,
    params: Option<&'a Map<String, Value>>,
}

/// Whether the version header alone says "modern" (any value that is not a handshake one,
/// which is how the Python SDK routes, so unsupported versions get the modern `-32022`).
fn modern_header(headers: &Headers) -> bool {
    headers.version.is_some_and(|version| !is_legacy_version(version))
}

impl State {
    pub fn new(tools: usize, delay: Duration, era: ServedEras) -> Self {
        State {
            catalog: Catalog::new(tools),
            delay,
            era,
            sessions: Mutex::new(HashMap::new()),
        }
    }

    pub fn open_sessions(&self) -> usize {
        self.sessions().len()
    }

    fn sessions(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        // A panic while holding the lock cannot leave the map inconsistent (single inserts
        // and removes), so a poisoned lock is still usable.
        self.sessions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn post(&self, headers: &Headers, body: &[u8]) -> Reply {
        let modern = modern_header(headers);
        let value: Value = match serde_json::from_slice(body) {
            Ok(value) => value,
            Err(error) => {
                return Reply::error(
                    StatusCode::BAD_REQUEST,
                    None,
                    PARSE_ERROR,
                    &format!("Parse error: {error}"),
                    None,
                    modern,
                )
            }
        };
        let message = match parse_message(&value) {
            Ok(message) => message,
            Err((code, why)) => {
                let id = value.get("id").filter(|id| id.is_string() || id.is_number());
                return Reply::error(StatusCode::BAD_REQUEST, id, code, why, None, modern);
            }
        };
        let has_meta_version = message
            .params
            .and_then(|params| params.get("_meta"))
            .and_then(|meta| meta.get(META_VERSION))
            .is_some();
        // `initialize` only exists in the handshake era; otherwise the header decides, and a
        // header-less request that carries modern `_meta` is a modern one missing its header.
        let is_modern = message.method != Some("initialize")
            && (modern || (headers.version.is_none() && has_meta_version));
        match (is_modern, self.era) {
            // A server that predates 2026-07-28 sees a request without a session.
            (true, ServedEras::Legacy) => Reply::error(
                StatusCode::BAD_REQUEST,
                message.id,
                INVALID_REQUEST,
                "Bad Request: Missing session ID",
                None,
                false,
            ),
            (false, ServedEras::Modern) if message.method == Some("initialize") => Reply::error(
                StatusCode::NOT_FOUND,
                message.id,
                METHOD_NOT_FOUND,
                "Method not found",
                None,
                true,
            ),
            (true, _) => self.modern(headers, &message),
            (false, _) => self.legacy(headers, &message),
        }
    }

    fn legacy(&self, headers: &Headers, message: &Message) -> Reply {
        if message.method == Some("initialize") {
            return match message.id {
                Some(id) => self.initialize(id, message.params),
                None => Reply::new(StatusCode::ACCEPTED, ReplyBody::Empty),
            };
        }
        let session = match self.check_session(headers) {
            Ok(session) => session,
            Err(reply) => return reply,
        };
        let (Some(id), Some(method)) = (message.id, message.method) else {
            // Notifications (`notifications/initialized`, cancellations) and responses.
            return Reply::new(StatusCode::ACCEPTED, ReplyBody::Empty).with_session(session.as_str());
        };
        let (message, delay) = match self.call(method, message.params, false) {
            Ok((result, delay)) => (result_response(id, result), delay),
            Err((code, text)) => (error_response(Some(id), code, &text, None, false), Duration::ZERO),
        };
        Reply::answer(message, delay).with_session(session.as_str())
    }

    fn initialize(&self, id: &Value, params: Option<&Map<String, Value>>) -> Reply {
        let Some(requested) = params
            .and_then(|p| p.get("protocolVersion"))
            .and_then(Value::as_str)
        else {
            return Reply::error(
                StatusCode::BAD_REQUEST,
                Some(id),
                INVALID_PARAMS,
                "initialize needs params.protocolVersion",
                None,
                false,
            );
        };
        let version = if is_legacy_version(requested) {
            requested
        } else {
            LATEST_LEGACY_VERSION
        };
        let session = format!("{:032x}", rand::random::<u128>());
        {
            let mut sessions = self.sessions();
            if sessions.len() >= MAX_SESSIONS {
                return Reply::error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    Some(id),
                    INTERNAL_ERROR,
                    "too many open sessions; DELETE finished ones",
                    None,
                    false,
                );
            }
            let (streams, _) = watch::channel(());
            sessions.insert(
                session.clone(),
                Session {
                    version: version.to_string(),
                    streams,
                },
            );
        }
        let result = json!({
            "protocolVersion": version,
            "capabilities": { "tools": { "listChanged": false } },
            "serverInfo": server_info(),
        });
        Reply::answer(result_response(id, result), Duration::ZERO).with_session(&session)
    }

    /// The session a legacy request names, or the reply the Python SDK gives without one.
    fn check_session(&self, headers: &Headers) -> Result<String, Reply> {
        let Some(id) = headers.session else {
            return Err(Reply::error(
                StatusCode::BAD_REQUEST,
                None,
                INVALID_REQUEST,
                "Bad Request: Missing session ID",
                None,
                false,
            ));
        };
        let sessions = self.sessions();
        let Some(session) = sessions.get(id) else {
            return Err(session_not_found());
        };
        if let Some(version) = headers.version {
            if version != session.version {
                let text = format!(
                    "MCP-Protocol-Version {version} differs from the negotiated {}",
                    session.version
                );
                return Err(
                    Reply::error(StatusCode::BAD_REQUEST, None, INVALID_REQUEST, &text, None, false)
                        .with_session(id),
                );
            }
        }
        Ok(id.to_string())
    }

    pub fn get(&self, headers: &Headers) -> Reply {
        if modern_header(headers) {
            return Reply::new(StatusCode::METHOD_NOT_ALLOWED, ReplyBody::Empty);
        }
        match self.check_session(headers) {
            Ok(id) => match self.sessions().get(&id) {
                Some(session) => Reply::new(StatusCode::OK, ReplyBody::Stream(session.streams.subscribe()))
                    .with_session(&id),
                // Deleted between the check and now.
                None => session_not_found(),
            },
            Err(reply) => reply,
        }
    }

    pub fn delete(&self, headers: &Headers) -> Reply {
        if modern_header(headers) {
            return Reply::new(StatusCode::METHOD_NOT_ALLOWED, ReplyBody::Empty);
        }
        match self.check_session(headers) {
            Ok(id) => {
                // Dropping the session drops its `streams` sender, which ends held GET streams.
                self.sessions().remove(&id);
                Reply::new(StatusCode::OK, ReplyBody::Empty).with_session(&id)
            }
            Err(reply) => reply,
        }
    }

    fn modern(&self, headers: &Headers, message: &Message) -> Reply {
        let bad = |code: i64, text: &str, data: Option<Value>| {
            Reply::error(StatusCode::BAD_REQUEST, message.id, code, text, data, true)
        };
        let unsupported = |requested: &str| {
            bad(
                UNSUPPORTED_VERSION,
                "Unsupported protocol version",
                Some(json!({"supported": [MODERN_VERSION], "requested": requested})),
            )
        };
        if let Some(version) = headers.version.filter(|version| *version != MODERN_VERSION) {
            return unsupported(version);
        }
        let (Some(id), Some(method)) = (message.id, message.method) else {
            return match message.method {
                Some(_) => Reply::new(StatusCode::ACCEPTED, ReplyBody::Empty),
                None => bad(
                    INVALID_REQUEST,
                    "clients do not send responses in 2026-07-28",
                    None,
                ),
            };
        };
        let meta = message
            .params
            .and_then(|params| params.get("_meta"))
            .and_then(Value::as_object);
        let version = meta
            .and_then(|meta| meta.get(META_VERSION))
            .and_then(Value::as_str);
        let capabilities = meta
            .and_then(|meta| meta.get(META_CAPABILITIES))
            .filter(|c| c.is_object());
        let (Some(version), Some(_)) = (version, capabilities) else {
            let text =
                format!("params._meta must be an object carrying {META_VERSION} and {META_CAPABILITIES}");
            return bad(INVALID_PARAMS, &text, None);
        };
        if headers.version != Some(version) {
            return bad(
                HEADER_MISMATCH,
                "MCP-Protocol-Version header does not match params._meta",
                None,
            );
        }
        if version != MODERN_VERSION {
            return unsupported(version);
        }
        if headers.method != Some(method) {
            return bad(
                HEADER_MISMATCH,
                "Mcp-Method header does not match the request method",
                None,
            );
        }
        let name_key = match method {
            "tools/call" | "prompts/get" => Some("name"),
            "resources/read" => Some("uri"),
            _ => None,
        };
        if let Some(key) = name_key {
            let body_name = message
                .params
                .and_then(|params| params.get(key))
                .and_then(Value::as_str);
            if body_name.is_none() || headers.name != body_name {
                return bad(
                    HEADER_MISMATCH,
                    &format!("Mcp-Name header does not match params.{key}"),
                    None,
                );
            }
        }
        match self.call(method, message.params, true) {
            Ok((mut result, delay)) => {
                result["resultType"] = json!("complete");
                result["_meta"] = json!({ META_SERVER_INFO: server_info() });
                Reply::answer(result_response(id, result), delay)
            }
            // The JSON body tells this 404 apart from a legacy server's plain one.
            Err((METHOD_NOT_FOUND, text)) => Reply::error(
                StatusCode::NOT_FOUND,
                Some(id),
                METHOD_NOT_FOUND,
                &text,
                Some(json!(method)),
                true,
            ),
            Err((code, text)) => {
                Reply::answer(error_response(Some(id), code, &text, None, true), Duration::ZERO)
            }
        }
    }

    /// The methods both eras share (plus each era's own: `ping` legacy, `server/discover`
    /// modern). Returns the result and how long to wait before sending it.
    fn call(
        &self,
        method: &str,
        params: Option<&Map<String, Value>>,
        modern: bool,
    ) -> Result<(Value, Duration), (i64, String)> {
        match method {
            "ping" if !modern => Ok((json!({}), Duration::ZERO)),
            "server/discover" if modern => Ok((
                json!({
                    "supportedVersions": [MODERN_VERSION],
                    "capabilities": { "tools": { "listChanged": false } },
                    "ttlMs": 0,
                    "cacheScope": "public",
                }),
                Duration::ZERO,
            )),
            "tools/list" => {
                // One page holds everything, so any cursor is one this server never minted.
                if params
                    .and_then(|p| p.get("cursor"))
                    .is_some_and(|cursor| !cursor.is_null())
                {
                    return Err((INVALID_PARAMS, "Invalid cursor".into()));
                }
                let mut result = json!({ "tools": self.catalog.listing() });
                if modern {
                    result["ttlMs"] = json!(0);
                    result["cacheScope"] = json!("public");
                }
                Ok((result, Duration::ZERO))
            }
            "tools/call" => {
                let Some(name) = params.and_then(|p| p.get("name")).and_then(Value::as_str) else {
                    return Err((INVALID_PARAMS, "tools/call needs params.name".into()));
                };
                let empty = Map::new();
                let arguments = match params.and_then(|p| p.get("arguments")) {
                    None | Some(Value::Null) => &empty,
                    Some(Value::Object(arguments)) => arguments,
                    Some(_) => return Err((INVALID_PARAMS, "params.arguments must be an object".into())),
                };
                let result = self
                    .catalog
                    .call(name, arguments)
                    .map_err(|error| (INVALID_PARAMS, error.message()))?;
                Ok((result, self.delay))
            }
            _ => Err((METHOD_NOT_FOUND, "Method not found".into())),
        }
    }
}

fn server_info() -> Value {
    json!({ "name": "portcullis-mcp-test", "version": env!("CARGO_PKG_VERSION") })
}

/// Structural JSON-RPC checks; MCP adds that ids are never null and params are objects.
fn parse_message(value: &Value) -> Result<Message<'_>, (i64, &'static str)> {
    if value.is_array() {
        return Err((INVALID_REQUEST, "JSON-RPC batches are not supported"));
    }
    let Some(object) = value.as_object() else {
        return Err((INVALID_REQUEST, "a JSON-RPC message must be an object"));
    };
    if object.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return Err((INVALID_REQUEST, "jsonrpc must be \"2.0\""));
    }
    let id = match object.get("id") {
        None => None,
        Some(id) if id.is_string() || id.is_i64() || id.is_u64() => Some(id),
        Some(_) => return Err((INVALID_REQUEST, "id must be a string or an integer")),
    };
    let method = match object.get("method") {
        None => None,
        Some(Value::String(method)) => Some(method.as_str()),
        Some(_) => return Err((INVALID_REQUEST, "method must be a string")),
    };
    if method.is_none() && (id.is_none() || !(object.contains_key("result") || object.contains_key("error")))
    {
        return Err((
            INVALID_REQUEST,
            "neither a request, a notification nor a response",
        ));
    }
    let params = match object.get("params") {
        None => None,
        Some(Value::Object(params)) => Some(params),
        Some(_) => return Err((INVALID_PARAMS, "params must be an object")),
    };
    Ok(Message { id, method, params })
}

/// The answer to a request naming a session this server does not hold (ended or unknown).
fn session_not_found() -> Reply {
    Reply::error(
        StatusCode::NOT_FOUND,
        None,
        INVALID_REQUEST,
        "Session not found",
        None,
        false,
    )
}
