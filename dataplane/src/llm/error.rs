//! Errors in the OpenAI API's shape, so OpenAI SDKs raise their usual exceptions with our
//! message: `{"error": {"message", "type", "param", "code"}}`.

use http::{Response, StatusCode};

use crate::body::Body;
use crate::policy::guardrail::Stop;
use crate::response::{json, ProxyError};

/// `code` is also what the access log and metrics record as the request's error.
pub(crate) fn error(status: StatusCode, code: &'static str, message: impl Into<String>) -> Response<Body> {
    let kind = error_type(status);
    let body = serde_json::json!({
        "error": { "message": message.into(), "type": kind, "param": null, "code": code }
    });
    let mut response = json(status, &body);
    response.extensions_mut().insert(ProxyError(code));
    response
}

/// How a guardrail's stop of `what` (the prompt, the completion) is answered: status, code
/// and message.
pub(crate) fn stopped(stop: Stop, what: &str) -> (StatusCode, &'static str, String) {
    match stop {
        Stop::Denied { guardrail, reason } => (
            StatusCode::FORBIDDEN,
            "guardrail_denied",
            format!("{guardrail} denied the {what}: {reason}"),
        ),
        Stop::Unavailable { guardrail } => (
            StatusCode::SERVICE_UNAVAILABLE,
            "guardrail_unavailable",
            format!(
                "{guardrail} could not check the {what}: no verdict could be had, so it was not \
                 let through (try again later)"
            ),
        ),
    }
}

/// The `type` OpenAI's errors carry for `status`.
pub(crate) fn error_type(status: StatusCode) -> &'static str {
    if status.is_client_error() {
        "invalid_request_error"
    } else {
        "server_error"
    }
}
