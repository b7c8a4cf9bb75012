//! Response helpers and vLLM's error envelope.

use std::convert::Infallible;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};

pub(super) type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

pub(super) fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    with_type(status, value.to_string(), "application/json")
}

pub(super) fn with_type(
    status: StatusCode,
    body: impl Into<Bytes>,
    content_type: &'static str,
) -> Response<Body> {
    let mut response = Response::new(Full::new(body.into()).boxed());
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// vLLM's `ErrorResponse`: `{"error": {message, type, param, code}}` where `code` is the HTTP
/// status as an integer (vLLM's `ErrorResponse`/`ErrorInfo` in its OpenAI protocol module).
pub(super) fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response<Body> {
    json(
        status,
        &serde_json::json!({
            "error": {
                "message": message.into(),
                "type": kind,
                "param": null,
                "code": status.as_u16(),
            }
        }),
    )
}

/// Invalid input: vLLM maps validation failures and `ValueError`s to 400 `BadRequestError`.
pub(super) fn bad_request(message: impl Into<String>) -> Response<Body> {
    error(StatusCode::BAD_REQUEST, "BadRequestError", message)
}

/// Routing errors: vLLM's `HTTPException` handler uses the status phrase as message and type.
pub(super) fn http_status(status: StatusCode) -> Response<Body> {
    let phrase = status.canonical_reason().unwrap_or("Error");
    error(status, phrase, phrase)
}

/// Seconds since the Unix epoch, for `created` fields.
pub(super) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
