//! The first stage after accept: one normalized form of the request that routing, every
//! policy and the upstream all see, or a 400 for a request that has none.

mod forwarded;
mod headers;

use std::net::{IpAddr, SocketAddr};

use http::header::HOST;
use http::{HeaderValue, StatusCode, Uri, Version};
use portcullis_config::path;

pub(crate) use forwarded::Forwarding;
pub(crate) use headers::strip_hop_by_hop;

use crate::body::Body;
use crate::response;

/// Normalizes the request in place and returns the client address as far as trusted
/// proxies tell.
pub(crate) fn request(
    parts: &mut http::request::Parts,
    merge_slashes: bool,
    forwarding: &Forwarding,
    peer: SocketAddr,
) -> Result<IpAddr, Box<http::Response<Body>>> {
    let invalid = |message: String| {
        Box::new(response::error(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            message,
        ))
    };
    headers::strip_hop_by_hop(&mut parts.headers, true);
    if let Some(problem) = conflicting_host(parts) {
        return Err(invalid(problem));
    }
    // One place for the host from here on: the Host header (HTTP/2 carries it as
    // :authority; an absolute-form HTTP/1 target wins over Host, RFC 9112 §3.2.2).
    if let Some(authority) = parts.uri.authority() {
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|_| invalid("invalid :authority".to_string()))?;
        parts.headers.insert(HOST, host);
    }
    headers::checked_host(&parts.headers).map_err(invalid)?;
    // Route on, and forward, the path the upstream will resolve: otherwise
    // `/public/%2e%2e/admin` matches a `/public` route and reaches `/admin` upstream.
    match path::normalize(parts.uri.path(), merge_slashes) {
        Err(error) => return Err(invalid(format!("invalid request path: {error}"))),
        Ok(std::borrow::Cow::Borrowed(_)) => {}
        Ok(std::borrow::Cow::Owned(normalized)) => {
            let target = match parts.uri.query() {
                Some(query) => format!("{normalized}?{query}"),
                None => normalized,
            };
            let mut uri = parts.uri.clone().into_parts();
            uri.path_and_query = Some(
                target
                    .parse()
                    .map_err(|error| invalid(format!("invalid request path: {error}")))?,
            );
            parts.uri =
                Uri::from_parts(uri).map_err(|error| invalid(format!("invalid request target: {error}")))?;
        }
    }
    Ok(forwarding.rewrite(&mut parts.headers, peer.ip()))
}

/// An HTTP/2 request whose Host header names another host than its :authority is
/// malformed (RFC 9113 §8.3.1): routing on one and forwarding the other would let a client
/// reach a route it did not match.
fn conflicting_host(parts: &http::request::Parts) -> Option<String> {
    if parts.version != Version::HTTP_2 {
        return None;
    }
    let authority = parts.uri.authority()?;
    let host = parts.headers.get(HOST)?;
    let same = host
        .to_str()
        .is_ok_and(|host| host.eq_ignore_ascii_case(authority.as_str()));
    (!same).then(|| "the Host header differs from :authority".to_string())
}
