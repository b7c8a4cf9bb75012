//! Responses the proxy writes itself.

use std::sync::Arc;

use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode};

use crate::body::{full, Body};

pub(crate) fn with_body(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<bytes::Bytes>,
) -> Response<Body> {
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// The error shape clients of an AI gateway already parse: `{"error":{"type","message"}}`.
/// `kind` is also what the access log and metrics record as the request's error.
pub(crate) fn error(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Response<Body> {
    let message: Arc<str> = Arc::from(message.into());
    let body = serde_json::json!({ "error": { "type": kind, "message": &*message } });
    let mut response = with_body(status, "application/json", body.to_string());
    response.extensions_mut().insert(ProxyError(kind));
    response.extensions_mut().insert(ErrorMessage(message));
    response
}

pub(crate) fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    with_body(status, "application/json", value.to_string())
}

/// Marks a response the proxy generated, with its error type.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProxyError(pub(crate) &'static str);

/// The message of an error [`error`] wrote, so that a route speaking another error shape (an
/// LLM route: OpenAI's) can restate it.
#[derive(Debug, Clone)]
pub(crate) struct ErrorMessage(pub(crate) Arc<str>);
