//! Responses the proxy writes itself, sharing one body type with proxied responses.

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};

/// Streamed upstream bodies and the proxy's own small bodies behind one type.
pub(crate) type ProxyBody = UnsyncBoxBody<Bytes, hyper::Error>;

fn full(body: impl Into<Bytes>) -> ProxyBody {
    Full::new(body.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

pub(crate) fn with_body(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<ProxyBody> {
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// The error shape clients of an AI gateway already parse: `{"error":{"type","message"}}`.
pub(crate) fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response<ProxyBody> {
    let body = serde_json::json!({ "error": { "type": kind, "message": message.into() } });
    with_body(status, "application/json", body.to_string())
}

pub(crate) fn json(status: StatusCode, value: &serde_json::Value) -> Response<ProxyBody> {
    with_body(status, "application/json", value.to_string())
}
