//! What the client must send, checked before anything goes upstream: the transport's
//! content negotiation, the revision it speaks, and in 2026-07-28 the agreement of the
//! `MCP-Protocol-Version`, `Mcp-Method` and `Mcp-Name` headers with the body (an
//! intermediary that routes on headers must not be fooled by a body that says otherwise).

use std::sync::Arc;

use http::header::{ACCEPT, CONTENT_TYPE};
use http::{HeaderMap, Response, StatusCode};
use serde_json::{json, Value};

use super::jsonrpc;
use super::reach::ClientMeta;
use super::server::{
    decode_header_value, MCP_METHOD, MCP_NAME, META_VERSION, MODERN_VERSION, PROTOCOL_VERSION,
};
use crate::body::Body;

/// Session-based revisions this gateway speaks, newest first; an `initialize` asking for
/// another one gets the newest (the client then decides whether it can go on).
pub(super) const LEGACY_VERSIONS: &[&str] = &["2025-11-25", "2025-06-18", "2025-03-26"];
/// MCP 2026-07-28 `HeaderMismatch`.
const HEADER_MISMATCH: i64 = -32020;

/// The revision a request is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Era {
    Legacy,
    Modern,
}

/// By the `MCP-Protocol-Version` header, as the revision says: absent or a session-based
/// version is legacy; `initialize` is always legacy. Anything else is refused with the
/// versions we speak, which tells a dual-era client what to fall back to.
pub(super) fn era(headers: &HeaderMap, method: Option<&str>, id: &Value) -> Result<Era, Box<Response<Body>>> {
    let Some(requested) = headers.get(&PROTOCOL_VERSION) else {
        return Ok(Era::Legacy);
    };
    let requested = String::from_utf8_lossy(requested.as_bytes());
    if method == Some("initialize") || LEGACY_VERSIONS.contains(&requested.as_ref()) {
        return Ok(Era::Legacy);
    }
    if requested == MODERN_VERSION {
        return Ok(Era::Modern);
    }
    let mut supported = vec![MODERN_VERSION];
    supported.extend_from_slice(LEGACY_VERSIONS);
    Err(Box::new(jsonrpc::error(
        StatusCode::BAD_REQUEST,
        id,
        jsonrpc::UNSUPPORTED_PROTOCOL_VERSION,
        format!("Unsupported protocol version: {requested}"),
        Some(json!({"supported": supported, "requested": requested})),
        "mcp_unsupported_version",
    )))
}

/// Streamable HTTP: the body is JSON and the client takes both JSON and SSE answers.
pub(super) fn unacceptable(headers: &HeaderMap) -> Option<Response<Body>> {
    let content_type = headers
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
        headers.get_all(ACCEPT).iter().any(|value| {
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

/// A 2026-07-28 message: its `_meta` must carry the client's version and capabilities,
/// and the headers must say what the body says.
pub(super) fn modern_client(
    headers: &HeaderMap,
    method: &str,
    params: Option<&Value>,
    id: &Value,
) -> Result<Arc<ClientMeta>, Box<Response<Body>>> {
    let mismatch = |message: String| {
        Box::new(jsonrpc::error(
            StatusCode::BAD_REQUEST,
            id,
            HEADER_MISMATCH,
            message,
            None,
            "mcp_header_mismatch",
        ))
    };
    let meta = params
        .and_then(|params| params.get("_meta"))
        .and_then(Value::as_object);
    let client = meta.and_then(ClientMeta::from_meta);
    let (Some(meta), Some(client)) = (meta, client) else {
        return Err(Box::new(jsonrpc::error(
            StatusCode::BAD_REQUEST,
            id,
            jsonrpc::INVALID_PARAMS,
            format!("Invalid params: params._meta must carry {META_VERSION} and io.modelcontextprotocol/clientCapabilities"),
            None,
            "mcp_invalid_message",
        )));
    };
    let header_version = headers
        .get(&PROTOCOL_VERSION)
        .and_then(|value| value.to_str().ok());
    if meta.get(META_VERSION).and_then(Value::as_str) != header_version {
        return Err(mismatch(format!(
            "MCP-Protocol-Version header does not match params._meta[\"{META_VERSION}\"]"
        )));
    }
    if headers.get(&MCP_METHOD).and_then(|value| value.to_str().ok()) != Some(method) {
        return Err(mismatch(format!(
            "Mcp-Method header must be {method:?}, the body's method"
        )));
    }
    let named = match method {
        "tools/call" | "prompts/get" => Some("name"),
        "resources/read" => Some("uri"),
        _ => None,
    };
    if let Some(field) = named {
        let body = params
            .and_then(|params| params.get(field))
            .and_then(Value::as_str);
        let header = headers.get(&MCP_NAME).and_then(decode_header_value);
        if body.is_none() || header.as_deref() != body {
            return Err(mismatch(format!(
                "Mcp-Name header does not match the body's params.{field}"
            )));
        }
    }
    Ok(Arc::new(client))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(name, value)| {
                (
                    http::HeaderName::from_static(name),
                    HeaderValue::from_str(value).unwrap(),
                )
            })
            .collect()
    }

    fn params(name: &str) -> Value {
        json!({"name": name, "_meta": {META_VERSION: MODERN_VERSION, "io.modelcontextprotocol/clientCapabilities": {}}})
    }

    fn code(result: Result<Arc<ClientMeta>, Box<Response<Body>>>) -> Option<u16> {
        result.err().map(|answer| answer.status().as_u16())
    }

    #[test]
    fn headers_must_agree_with_the_body() {
        let good = headers(&[
            ("mcp-protocol-version", MODERN_VERSION),
            ("mcp-method", "tools/call"),
            ("mcp-name", "add"),
        ]);
        let id = Value::from(1);
        assert!(modern_client(&good, "tools/call", Some(&params("add")), &id).is_ok());
        assert_eq!(
            code(modern_client(&good, "tools/call", Some(&params("echo")), &id)),
            Some(400)
        );
        assert_eq!(
            code(modern_client(&good, "tools/list", Some(&params("add")), &id)),
            Some(400)
        );
        let old = headers(&[
            ("mcp-protocol-version", "2025-11-25"),
            ("mcp-method", "tools/call"),
            ("mcp-name", "add"),
        ]);
        assert_eq!(
            code(modern_client(&old, "tools/call", Some(&params("add")), &id)),
            Some(400)
        );
        assert_eq!(
            code(modern_client(
                &good,
                "tools/call",
                Some(&json!({"name": "add"})),
                &id
            )),
            Some(400)
        );
    }

    #[test]
    fn the_header_decides_the_era() {
        let id = Value::Null;
        assert_eq!(
            era(&headers(&[]), Some("tools/list"), &id).ok(),
            Some(Era::Legacy)
        );
        assert_eq!(
            era(
                &headers(&[("mcp-protocol-version", "2025-06-18")]),
                Some("tools/list"),
                &id
            )
            .ok(),
            Some(Era::Legacy)
        );
        assert_eq!(
            era(
                &headers(&[("mcp-protocol-version", MODERN_VERSION)]),
                Some("tools/list"),
                &id
            )
            .ok(),
            Some(Era::Modern)
        );
        assert!(era(
            &headers(&[("mcp-protocol-version", "2099-01-01")]),
            Some("tools/list"),
            &id
        )
        .is_err());
    }
}
