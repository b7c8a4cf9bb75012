//! The request handler of every proxy listener: match, pick, forward, stream back.

use std::error::Error as _;
use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use http::header::{CONNECTION, HOST, TE};
use http::uri::{PathAndQuery, Scheme};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::backend::UpstreamClients;
use crate::config_state::Snapshot;
use crate::listener::Handler;
use crate::response::{self, ProxyBody};
use crate::route::request_host;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Meaningful only for one connection (RFC 9110 §7.6.1), so never forwarded. `upgrade`
/// too: an upgraded connection would need byte splicing, which the proxy does not do.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Serves the requests arriving on one listener, always against the latest config.
#[derive(Clone)]
pub(crate) struct Forwarder {
    pub(crate) snapshots: Arc<ArcSwap<Snapshot>>,
    pub(crate) clients: UpstreamClients,
    /// The listener's configured address: its key in the snapshot's route tables.
    pub(crate) listener: SocketAddr,
}

impl Handler for Forwarder {
    async fn handle(&self, peer: SocketAddr, mut request: Request<Incoming>) -> Response<ProxyBody> {
        // Route on, and forward, the path the upstream will resolve: otherwise
        // `/public/../admin` matches a `/public` route and reaches `/admin` upstream.
        if let Err(error) = normalize_path(&mut request) {
            return response::error(StatusCode::BAD_REQUEST, "invalid_request", error.to_string());
        }
        if let Some(problem) = conflicting_host(&request) {
            return response::error(StatusCode::BAD_REQUEST, "invalid_request", problem);
        }
        // Loaded once: the request completes on the version it started on.
        let snapshot = self.snapshots.load_full();
        let Some(table) = snapshot.routes.get(&self.listener) else {
            // A request that slipped onto a connection of a listener the new version removed.
            return response::error(
                StatusCode::SERVICE_UNAVAILABLE,
                "listener_draining",
                "this listener was removed from the config and is draining",
            );
        };
        let Some(route) = table.find(&request) else {
            let host = request_host(&request).unwrap_or_default();
            return response::error(
                StatusCode::NOT_FOUND,
                "route_not_found",
                format!("no route for {} {host}{}", request.method(), request.uri().path()),
            );
        };
        let Some(backend) = route.backends.pick() else {
            return response::error(
                StatusCode::BAD_GATEWAY,
                "no_backend",
                format!("Route/{} has no backend with a weight above 0", route.name),
            );
        };
        let Some(endpoint) = backend.next_endpoint() else {
            return response::error(
                StatusCode::BAD_GATEWAY,
                "no_backend",
                format!("Backend/{} has no endpoints", backend.name),
            );
        };
        let upstream = match upstream_request(request, endpoint.clone(), peer, backend.http2) {
            Ok(upstream) => upstream,
            Err(error) => {
                return response::error(StatusCode::BAD_REQUEST, "invalid_request", error.to_string());
            }
        };
        let client = self.clients.for_backend(backend);
        // The timeout covers connecting and the response headers only: a streamed body
        // (e.g. server-sent events) may then run as long as it needs.
        match tokio::time::timeout(route.timeout, client.request(upstream)).await {
            Ok(Ok(mut upstream_response)) => {
                strip_hop_by_hop(upstream_response.headers_mut());
                upstream_response.map(|body| body.boxed_unsync())
            }
            Ok(Err(error)) => {
                let mut message = format!("Backend/{}: {error}", backend.name);
                let mut source = error.source();
                while let Some(cause) = source {
                    message.push_str(&format!(": {cause}"));
                    source = cause.source();
                }
                // The endpoint goes to the log only: clients need not learn internal addresses.
                tracing::warn!(route = %route.name, %endpoint, %message, "upstream request failed");
                response::error(StatusCode::BAD_GATEWAY, "upstream_error", message)
            }
            Err(_) => {
                tracing::warn!(route = %route.name, %endpoint, timeout = ?route.timeout, "upstream timed out");
                response::error(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream_timeout",
                    format!(
                        "Backend/{} sent no response headers within {:?} (Route/{} timeout)",
                        backend.name, route.timeout, route.name
                    ),
                )
            }
        }
    }
}

/// Rewrites a client request for the upstream; the body is passed through untouched so
/// it streams.
fn upstream_request(
    mut request: Request<Incoming>,
    endpoint: http::uri::Authority,
    peer: SocketAddr,
    http2: bool,
) -> Result<Request<Incoming>, http::Error> {
    let original_authority = request.uri().authority().cloned();
    let path_and_query = request
        .uri()
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    *request.uri_mut() = Uri::builder()
        .scheme(Scheme::HTTP)
        .authority(endpoint)
        .path_and_query(path_and_query)
        .build()?;
    *request.version_mut() = if http2 { Version::HTTP_2 } else { Version::HTTP_11 };

    let headers = request.headers_mut();
    let keep_te_trailers = headers
        .get(TE)
        .is_some_and(|te| te.as_bytes().eq_ignore_ascii_case(b"trailers"));
    strip_hop_by_hop(headers);
    if keep_te_trailers && http2 {
        // gRPC needs it and HTTP/2 allows exactly this value.
        headers.insert(TE, HeaderValue::from_static("trailers"));
    }
    // The route was chosen by the URI authority when there is one (HTTP/2 :authority, an
    // absolute-form HTTP/1 target), so the upstream must see that host, not a different
    // Host header the client sent beside it (RFC 9112 §3.2.2, RFC 9113 §8.3.1).
    if let Some(authority) = original_authority {
        if let Ok(host) = HeaderValue::from_str(authority.as_str()) {
            headers.insert(HOST, host);
        }
    }
    let peer_ip = peer.ip().to_string();
    let forwarded_for = headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .chain(std::iter::once(peer_ip.as_str()))
        .collect::<Vec<_>>()
        .join(", ");
    headers.insert(X_FORWARDED_FOR, HeaderValue::from_str(&forwarded_for)?);
    // A TLS-terminating load balancer in front of the proxy knows the real scheme.
    if !headers.contains_key(&X_FORWARDED_PROTO) {
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    }
    Ok(request)
}

/// An HTTP/2 request whose Host header names another host than its :authority is
/// malformed (RFC 9113 §8.3.1): routing on one and forwarding the other would let a client
/// reach a route it did not match.
fn conflicting_host<B>(request: &Request<B>) -> Option<String> {
    if request.version() != Version::HTTP_2 {
        return None;
    }
    let authority = request.uri().authority()?;
    let host = request.headers().get(HOST)?;
    let same = host
        .to_str()
        .is_ok_and(|host| host.eq_ignore_ascii_case(authority.as_str()));
    (!same).then(|| "the Host header differs from :authority".to_string())
}

/// Removes `.` and `..` segments (also percent-encoded, `%2e`) from the request path, as
/// RFC 3986 §5.2.4 does; `..` never climbs above the root. Leaves other encodings alone.
fn normalize_path<B>(request: &mut Request<B>) -> Result<(), http::Error> {
    let is_dot = |segment: &str| segment == "." || segment.eq_ignore_ascii_case("%2e");
    let is_dot_dot = |segment: &str| {
        let lower = segment.to_ascii_lowercase();
        matches!(lower.as_str(), ".." | "%2e%2e" | ".%2e" | "%2e.")
    };
    let path = request.uri().path();
    // Hot path: almost no request has a segment starting with `.` or `%2e`.
    let may_have_dots = path.contains("/.") || path.contains("/%2e") || path.contains("/%2E");
    if !may_have_dots {
        return Ok(());
    }
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    if !segments
        .iter()
        .any(|segment| is_dot(segment) || is_dot_dot(segment))
    {
        return Ok(());
    }
    let mut kept: Vec<&str> = Vec::with_capacity(segments.len());
    for segment in &segments {
        if is_dot_dot(segment) {
            kept.pop();
        } else if !is_dot(segment) {
            kept.push(segment);
        }
    }
    // `/a/b/..` names the directory `/a/`: keep the trailing slash a dot segment implied.
    let trailing = segments
        .last()
        .is_some_and(|last| is_dot(last) || is_dot_dot(last));
    let mut normalized = format!("/{}", kept.join("/"));
    if trailing && !normalized.ends_with('/') {
        normalized.push('/');
    }
    if let Some(query) = request.uri().query() {
        normalized = format!("{normalized}?{query}");
    }
    let mut parts = request.uri().clone().into_parts();
    parts.path_and_query = Some(normalized.parse()?);
    *request.uri_mut() = Uri::from_parts(parts)?;
    Ok(())
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
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
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn normalized(target: &str) -> String {
        let mut request = Request::get(target).body(()).unwrap();
        normalize_path(&mut request).unwrap();
        request.uri().to_string()
    }

    #[test]
    fn dot_segments_are_resolved_before_routing() {
        assert_eq!(normalized("/public/../admin"), "/admin");
        assert_eq!(normalized("/public/%2e%2E/admin?x=1"), "/admin?x=1");
        assert_eq!(normalized("/a/./b/.%2e/c"), "/a/c");
        assert_eq!(normalized("/../../etc"), "/etc");
        assert_eq!(normalized("/a/b/.."), "/a/");
        assert_eq!(normalized("/a/b"), "/a/b");
        assert_eq!(normalized("/a..b/c%2fd"), "/a..b/c%2fd");
        assert_eq!(normalized("http://h:1/x/../y"), "http://h:1/y");
    }

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
