//! Turning the client's request into the upstream's.

use http::header::{HOST, TE};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderName, Request, Uri, Version};

use crate::body::Body;
use crate::telemetry::RequestTrace;

const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

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
    // Hop-by-hop headers went at normalization, except `TE: trailers`, which gRPC needs
    // and HTTP/2 allows as the only TE value; HTTP/1.1 upstreams do not get it.
    let mut headers = parts.headers.clone();
    let client_host = headers.get(HOST).cloned();
    let authority = if http2 {
        headers.remove(HOST);
        match client_host
            .as_ref()
            .and_then(|host| Authority::try_from(host.as_bytes()).ok())
        {
            Some(authority) => authority,
            None => endpoint.clone(),
        }
    } else {
        headers.remove(TE);
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
