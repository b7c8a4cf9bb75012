//! JSON-RPC and MCP wire constants shared by the test server and the load client.

use serde_json::{json, Value};

/// The stateless revision: no `initialize`, version and capabilities in every `params._meta`.
pub const MODERN_VERSION: &str = "2026-07-28";
/// Handshake revisions a legacy client may ask for in `initialize`; the last one is offered
/// when the client asks for something else (lifecycle: answer with the latest supported).
pub const LEGACY_VERSIONS: [&str; 4] = ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"];
pub const LATEST_LEGACY_VERSION: &str = "2025-11-25";

pub const HEADER_SESSION: &str = "mcp-session-id";
pub const HEADER_VERSION: &str = "mcp-protocol-version";
pub const HEADER_METHOD: &str = "mcp-method";
pub const HEADER_NAME: &str = "mcp-name";

pub const META_VERSION: &str = "io.modelcontextprotocol/protocolVersion";
pub const META_CAPABILITIES: &str = "io.modelcontextprotocol/clientCapabilities";
pub const META_CLIENT_INFO: &str = "io.modelcontextprotocol/clientInfo";
pub const META_SERVER_INFO: &str = "io.modelcontextprotocol/serverInfo";

pub const PARSE_ERROR: i64 = -32700;
pub const INVALID_REQUEST: i64 = -32600;
pub const METHOD_NOT_FOUND: i64 = -32601;
pub const INVALID_PARAMS: i64 = -32602;
pub const INTERNAL_ERROR: i64 = -32603;
/// 2026-07-28: an `Mcp-*` header disagrees with the body (or is missing).
pub const HEADER_MISMATCH: i64 = -32020;
/// 2026-07-28: the requested revision is not served; `data` lists the supported ones.
pub const UNSUPPORTED_VERSION: i64 = -32022;

pub fn is_legacy_version(version: &str) -> bool {
    LEGACY_VERSIONS.contains(&version)
}

/// A JSON-RPC error response. `id: None` is written as `null` in the legacy era and left out
/// in the modern one (2026-07-28 makes `id` optional when the request id is unknown).
pub fn error_response(
    id: Option<&Value>,
    code: i64,
    message: &str,
    data: Option<Value>,
    modern: bool,
) -> Value {
    let mut error = json!({ "code": code, "message": message });
    if let Some(data) = data {
        error["data"] = data;
    }
    let mut response = json!({ "jsonrpc": "2.0", "error": error });
    match id {
        Some(id) => response["id"] = id.clone(),
        None if !modern => response["id"] = Value::Null,
        None => {}
    }
    response
}

pub fn result_response(id: &Value, result: Value) -> Value {
    json!({ "jsonrpc": "2.0", "id": id, "result": result })
}

/// One SSE event carrying a JSON-RPC message, framed like the Python SDK does (`\r\n`).
pub fn sse_event(message: &Value) -> String {
    format!("event: message\r\ndata: {message}\r\n\r\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_id_is_null_in_legacy_and_absent_in_modern() {
        let legacy = error_response(None, PARSE_ERROR, "x", None, false);
        assert_eq!(legacy["id"], Value::Null);
        assert!(legacy.as_object().is_some_and(|o| o.contains_key("id")));
        let modern = error_response(None, PARSE_ERROR, "x", None, true);
        assert!(modern.as_object().is_some_and(|o| !o.contains_key("id")));
    }
}
