//! Errors in the OpenAI API's shape, so OpenAI SDKs raise their usual exceptions with our
//! message: `{"error": {"message", "type", "param", "code"}}`.

use http::{Response, StatusCode};

use crate::body::Body;
use crate::response::{json, ProxyError};

/// `code` is also what the access log and metrics record as the request's error.
pub(crate) fn error(status: StatusCode, code: &'static str, message: impl Into<String>) -> Response<Body> {
    let kind = if status.is_client_error() {
        "invalid_request_error"
    } else {
        "server_error"
    };
    let body = serde_json::json!({
        "error": { "message": message.into(), "type": kind, "param": null, "code": code }
    });
    let mut response = json(status, &body);
    response.extensions_mut().insert(ProxyError(code));
    response
}
