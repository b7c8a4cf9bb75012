//! Turning the client's request into the upstream's.

use http::header::{CONNECTION, HOST, TE};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Uri, Version};

use crate::body::Body;
use crate::telemetry::RequestTrace;

const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// Meaningful only for one connection (RFC 9110 §7.6.1), so never forwarded. `upgrade`
/// too: an upgraded connection would need byte splicing, which the proxy does not do.
const HOP_BY_HOP: [HeaderName; 9] = [
    CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    http::header::PROXY_AUTHENTICATE,
    http::header::PROXY_AUTHORIZATION,
    TE,
    http::header::TRAILER,
    http::header::TRANSFER_ENCODING,
    http::header::UPGRADE,
];

/// The upstream request for one attempt. The client's host goes in `Host` (HTTP/1.1) or
/// `:authority` (HTTP/2, with no `Host` beside it); the connection goes to `endpoint`.
pub(super) fn for_upstream(
    parts: &http::request::Parts,
    body: Body,
    endpoint: &Authority,
    http2: bool,
    trace: &RequestTrace,
) -> Result<Request<Body>, http::Error> {
    let path_and_query = parts
        .uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    let mut headers = parts.headers.clone();
    let keep_te_trailers = headers
        .get(TE)
        .is_some_and(|te| te.as_bytes().eq_ignore_ascii_case(b"trailers"));
    strip_hop_by_hop(&mut headers);
    let client_host = headers.get(HOST).cloned();
    let authority = if http2 {
        // gRPC needs it and HTTP/2 allows exactly this value.
        if keep_te_trailers {
            headers.insert(TE, HeaderValue::from_static("trailers"));
        }
        headers.remove(HOST);
        match client_host
            .as_ref()
            .and_then(|host| Authority::try_from(host.as_bytes()).ok())
        {
            Some(authority) => authority,
            None => endpoint.clone(),
        }
    } else {
        endpoint.clone()
    };
    // Our span continues the trace; an invalid incoming traceparent is not passed on.
    headers.remove(TRACEPARENT);
    headers.remove(TRACESTATE);
    if let Some(traceparent) = trace.traceparent() {
        headers.insert(TRACEPARENT, traceparent);
        if let Some(tracestate) = trace.tracestate() {
            headers.insert(TRACESTATE, tracestate.clone());
        }
    }
    let uri = Uri::builder()
        .scheme(Scheme::HTTP)
        .authority(authority)
        .path_and_query(path_and_query)
        .build()?;
    let mut request = Request::new(body);
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = uri;
    *request.version_mut() = if http2 { Version::HTTP_2 } else { Version::HTTP_11 };
    *request.headers_mut() = headers;
    Ok(request)
}

pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap) {
    if headers.contains_key(CONNECTION) {
        let named_by_connection: Vec<HeaderName> = headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
            .collect();
        for name in named_by_connection {
            headers.remove(name);
        }
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_those_named_by_connection_are_removed() {
        let mut headers = HeaderMap::new();
        headers.insert(CONNECTION, HeaderValue::from_static("keep-alive, X-Secret"));
        headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        headers.insert("x-secret", HeaderValue::from_static("1"));
        headers.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        headers.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut headers);
        let names: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["x-kept"]);
    }
}
