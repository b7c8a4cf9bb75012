//! JSON-RPC 2.0 (<https://www.jsonrpc.org/specification>) as MCP's Streamable HTTP carries
//! it: one message per POST, no batches (removed in MCP 2025-06-18), ids strings or numbers.

use http::{Response, StatusCode};
use serde_json::{json, Map, Value};

use crate::body::{self, Body};
use crate::response::{self, ProxyError};

pub(super) const PARSE_ERROR: i64 = -32700;
pub(super) const INVALID_REQUEST: i64 = -32600;
pub(super) const METHOD_NOT_FOUND: i64 = -32601;
pub(super) const INVALID_PARAMS: i64 = -32602;
/// Implementation-defined range (-32000…-32019 in MCP 2026-07-28): an McpAuthorization
/// rule refused the operation.
pub(super) const DENIED: i64 = -32010;
/// Implementation-defined: an MCP server behind the gateway failed or did not answer in time.
pub(super) const UPSTREAM_FAILED: i64 = -32011;
/// Implementation-defined: a Guardrail denied the request or its result.
pub(super) const GUARDRAIL_DENIED: i64 = -32012;
/// Implementation-defined: a FailClosed Guardrail could not get a verdict, so the request
/// (or its result) was not let through. Not a denial: trying again later may succeed.
pub(super) const GUARDRAIL_UNAVAILABLE: i64 = -32013;
/// Implementation-defined: the client did not answer a server's question (sampling,
/// elicitation, roots) that the gateway passed on across revisions, so the call could not
/// go on.
pub(super) const INPUT_UNANSWERED: i64 = -32015;
/// MCP 2026-07-28 `UnsupportedProtocolVersionError`.
pub(super) const UNSUPPORTED_PROTOCOL_VERSION: i64 = -32022;

/// One message from the client.
#[derive(Debug)]
pub(super) enum Message {
    Request {
        id: Value,
        method: String,
        params: Option<Value>,
    },
    Notification {
        method: String,
        params: Option<Value>,
    },
    /// The client's answer to a request a server sent it (sampling, elicitation, roots).
    Response {
        id: Value,
        message: Map<String, Value>,
    },
}

/// Why a body is not a message we accept; answered with HTTP 400 and a JSON-RPC error.
#[derive(Debug)]
pub(super) struct Rejected {
    pub(super) code: i64,
    pub(super) message: String,
    /// Echoed when the body had a usable id.
    pub(super) id: Value,
}

pub(super) fn parse(bytes: &[u8]) -> Result<Message, Rejected> {
    let value: Value = serde_json::from_slice(bytes).map_err(|error| Rejected {
        code: PARSE_ERROR,
        message: format!("Parse error: {error}"),
        id: Value::Null,
    })?;
    let invalid = |message: &str, id: &Value| Rejected {
        code: INVALID_REQUEST,
        message: format!("Invalid Request: {message}"),
        id: id.clone(),
    };
    let mut object = match value {
        Value::Object(object) => object,
        Value::Array(_) => {
            return Err(invalid(
                "batches are not supported (removed in MCP 2025-06-18): send one message per request",
                &Value::Null,
            ))
        }
        _ => return Err(invalid("a message is a JSON object", &Value::Null)),
    };
    let id = object.get("id").cloned();
    let echo = id.clone().filter(valid_id).unwrap_or(Value::Null);
    if object.get("jsonrpc") != Some(&Value::String("2.0".into())) {
        return Err(invalid("\"jsonrpc\" must be \"2.0\"", &echo));
    }
    if let Some(id) = &id {
        if !valid_id(id) {
            return Err(invalid("\"id\" must be a string or an integer", &Value::Null));
        }
    }
    match (object.remove("method"), id) {
        (Some(Value::String(method)), id) => {
            let params = object.remove("params");
            if params.as_ref().is_some_and(|params| !params.is_object()) {
                return Err(Rejected {
                    code: INVALID_PARAMS,
                    message: "Invalid params: \"params\" must be an object".into(),
                    id: echo,
                });
            }
            Ok(match id {
                Some(id) => Message::Request { id, method, params },
                None => Message::Notification { method, params },
            })
        }
        (Some(_), _) => Err(invalid("\"method\" must be a string", &echo)),
        (None, Some(id)) if object.contains_key("result") || object.contains_key("error") => {
            object.insert("jsonrpc".into(), Value::String("2.0".into()));
            Ok(Message::Response { id, message: object })
        }
        (None, _) => Err(invalid("neither a request, a notification nor a response", &echo)),
    }
}

fn valid_id(id: &Value) -> bool {
    match id {
        Value::String(_) => true,
        Value::Number(number) => number.is_i64() || number.is_u64(),
        _ => false,
    }
}

/// The id of the one JSON-RPC message `bytes` hold (`None`: none, or not one message), read
/// without building the message: an answer may be large.
pub(super) fn message_id(bytes: &[u8]) -> Option<Value> {
    #[derive(serde::Deserialize)]
    struct Envelope {
        id: Option<Value>,
    }
    // A struct also reads from an array, which is no message (and a batch may hold any id).
    if bytes.trim_ascii_start().first() != Some(&b'{') {
        return None;
    }
    serde_json::from_slice::<Envelope>(bytes).ok()?.id
}

/// A message already serialized.
pub(super) fn serialized(message: String) -> Response<Body> {
    response::with_body(StatusCode::OK, "application/json", message)
}

/// A whole JSON-RPC message, as a server sent it.
pub(super) fn message(message: &Value) -> Response<Body> {
    response::json(StatusCode::OK, message)
}

pub(super) fn result(id: &Value, result: Value) -> Response<Body> {
    response::json(
        StatusCode::OK,
        &json!({"jsonrpc": "2.0", "id": id, "result": result}),
    )
}

/// A JSON-RPC error; `kind` is what the access log and metrics record.
pub(super) fn error(
    status: StatusCode,
    id: &Value,
    code: i64,
    message: impl Into<String>,
    data: Option<Value>,
    kind: &'static str,
) -> Response<Body> {
    let mut error = json!({"code": code, "message": message.into()});
    if let Some(data) = data {
        error["data"] = data;
    }
    let mut response = response::json(status, &json!({"jsonrpc": "2.0", "id": id, "error": error}));
    response.extensions_mut().insert(ProxyError(kind));
    response.extensions_mut().insert(ErrorCode(code));
    response
}

/// The JSON-RPC error code of an error the gateway answered with, for the record.
#[derive(Debug, Clone, Copy)]
pub(super) struct ErrorCode(pub(super) i64);

pub(super) fn rejected(rejected: Rejected) -> Response<Body> {
    error(
        StatusCode::BAD_REQUEST,
        &rejected.id,
        rejected.code,
        rejected.message,
        None,
        "mcp_invalid_message",
    )
}

pub(super) fn accepted() -> Response<Body> {
    let mut accepted = Response::new(body::empty());
    *accepted.status_mut() = StatusCode::ACCEPTED;
    accepted
}

pub(super) fn session_not_found(id: &Value) -> Response<Body> {
    error(
        StatusCode::NOT_FOUND,
        id,
        INVALID_REQUEST,
        "Session not found: initialize again",
        None,
        "mcp_session_not_found",
    )
}

pub(super) fn invalid_params(id: &Value, message: String) -> Response<Body> {
    error(
        StatusCode::OK,
        id,
        INVALID_PARAMS,
        message,
        None,
        "mcp_invalid_params",
    )
}

pub(super) fn upstream_failed(id: &Value, target: &str, problem: &str) -> Response<Body> {
    error(
        StatusCode::OK,
        id,
        UPSTREAM_FAILED,
        format!("{target}: {problem}"),
        None,
        "mcp_upstream_failed",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejected_code(body: &str) -> i64 {
        parse(body.as_bytes()).expect_err(body).code
    }

    #[test]
    fn messages_are_told_apart() {
        assert!(matches!(
            parse(br#"{"jsonrpc":"2.0","id":1,"method":"tools/list"}"#),
            Ok(Message::Request { method, .. }) if method == "tools/list"
        ));
        assert!(matches!(
            parse(br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#),
            Ok(Message::Notification { .. })
        ));
        assert!(matches!(
            parse(br#"{"jsonrpc":"2.0","id":"s-1","result":{}}"#),
            Ok(Message::Response { .. })
        ));
    }

    #[test]
    fn bad_messages_get_the_json_rpc_code() {
        assert_eq!(rejected_code("{"), PARSE_ERROR);
        assert_eq!(
            rejected_code(r#"[{"jsonrpc":"2.0","id":1,"method":"ping"}]"#),
            INVALID_REQUEST
        );
        assert_eq!(
            rejected_code(r#"{"jsonrpc":"1.0","id":1,"method":"ping"}"#),
            INVALID_REQUEST
        );
        assert_eq!(rejected_code(r#"{"id":1,"method":"ping"}"#), INVALID_REQUEST);
        assert_eq!(
            rejected_code(r#"{"jsonrpc":"2.0","id":1.5,"method":"ping"}"#),
            INVALID_REQUEST
        );
        assert_eq!(
            rejected_code(r#"{"jsonrpc":"2.0","id":null,"method":"ping"}"#),
            INVALID_REQUEST
        );
        assert_eq!(
            rejected_code(r#"{"jsonrpc":"2.0","id":1,"method":7}"#),
            INVALID_REQUEST
        );
        assert_eq!(
            rejected_code(r#"{"jsonrpc":"2.0","id":1,"method":"x","params":[1]}"#),
            INVALID_PARAMS
        );
        assert_eq!(rejected_code(r#"{"jsonrpc":"2.0","id":1}"#), INVALID_REQUEST);
        assert_eq!(rejected_code("42"), INVALID_REQUEST);
    }

    #[test]
    fn a_usable_id_is_echoed_in_the_rejection() {
        let rejected = parse(br#"{"jsonrpc":"1.0","id":"a","method":"ping"}"#).unwrap_err();
        assert_eq!(rejected.id, Value::String("a".into()));
    }
}
