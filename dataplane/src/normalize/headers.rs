//! Header hygiene before anything reads the headers: hop-by-hop headers go first, so a
//! client cannot use `Connection: x-forwarded-for` to strip what the proxy sets later, and
//! the host must be one well-formed authority.

use http::header::{CONNECTION, CONTENT_LENGTH, HOST, TE, TRANSFER_ENCODING};
use http::uri::Authority;
use http::{HeaderMap, HeaderName, HeaderValue};

/// Meaningful only for one connection (RFC 9110 §7.6.1), so never forwarded. `upgrade`
/// too: an upgraded connection would need byte splicing, which the proxy does not do. The
/// config refuses routes that match on them by the same list.
static HOP_BY_HOP: std::sync::LazyLock<[HeaderName; 8]> =
    std::sync::LazyLock::new(|| portcullis_config::HOP_BY_HOP_HEADERS.map(HeaderName::from_static));

/// Removes hop-by-hop headers and those `Connection` names. `TE` goes too, unless it is
/// exactly `trailers` and `keep_te_trailers` (requests: HTTP/2 upstreams may take it).
pub(crate) fn strip_hop_by_hop(headers: &mut HeaderMap, keep_te_trailers: bool) {
    // One pass over the message's few names instead of a hashed lookup per hop-by-hop name:
    // this runs on every request and response, and most carry none, or only `Connection`.
    let hop_by_hop = &*HOP_BY_HOP;
    let position = |name: &HeaderName| hop_by_hop.iter().position(|hop| hop == name);
    // Bit i: the message carries `hop_by_hop[i]`.
    const _: () = assert!(portcullis_config::HOP_BY_HOP_HEADERS.len() <= u16::BITS as usize);
    let mut present = 0u16;
    let mut carries_te = false;
    for name in headers.keys() {
        if name == TE {
            carries_te = true;
        } else if let Some(index) = position(name) {
            present |= 1 << index;
        }
    }
    if present == 0 && !carries_te {
        return;
    }
    let carries = |name: &HeaderName| position(name).is_some_and(|index| present & (1 << index) != 0);
    if carries(&CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(CONNECTION)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(','))
            .map(str::trim)
            // Hop-by-hop names go below anyway: the usual `Connection: keep-alive` of every
            // upstream response parses no name.
            .filter(|token| {
                !portcullis_config::HOP_BY_HOP_HEADERS
                    .iter()
                    .any(|hop| token.eq_ignore_ascii_case(hop))
            })
            .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok())
            // Host and Content-Length are end-to-end whatever a client says: the host is
            // checked, the length already framed the body hyper is reading.
            .filter(|name| *name != HOST && *name != CONTENT_LENGTH)
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    // The body was framed by Transfer-Encoding, which overrides a Content-Length sent with
    // it; forwarded, the stale length would frame the body again, cutting it short or
    // leaving the peer waiting (RFC 9112 §6.3: an intermediary removes it).
    if carries(&TRANSFER_ENCODING) {
        headers.remove(CONTENT_LENGTH);
    }
    for (index, name) in hop_by_hop.iter().enumerate() {
        if present & (1 << index) != 0 {
            headers.remove(name);
        }
    }
    let te_trailers_only = headers
        .get_all(TE)
        .iter()
        .all(|te| te.as_bytes().eq_ignore_ascii_case(b"trailers"));
    if carries_te && !(keep_te_trailers && te_trailers_only) {
        headers.remove(TE);
    }
}

/// The one host of a request, checked: exactly one `Host` (RFC 9112 §3.2), parsing as an
/// authority with no user info and only host characters, so it routes and forwards as the
/// same thing.
pub(crate) fn checked_host(headers: &HeaderMap) -> Result<Option<HeaderValue>, String> {
    let mut hosts = headers.get_all(HOST).iter();
    let Some(host) = hosts.next() else {
        return Ok(None);
    };
    if hosts.next().is_some() {
        return Err("more than one Host header".to_string());
    }
    let authority = Authority::try_from(host.as_bytes())
        .map_err(|_| "the Host header is not a valid authority".to_string())?;
    if !portcullis_config::host::is_host_with_port(authority.as_str()) {
        return Err("the Host header must be a host name or address, with an optional port".to_string());
    }
    Ok(Some(host.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        headers
    }

    #[test]
    fn hop_by_hop_headers_and_those_named_by_connection_are_removed() {
        let mut headers = map(&[
            ("connection", "keep-alive, X-Secret, host"),
            ("keep-alive", "timeout=5"),
            ("x-secret", "1"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("host", "a.example"),
            ("x-kept", "1"),
        ]);
        strip_hop_by_hop(&mut headers, true);
        let mut names: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["host", "te", "x-kept"]);
        strip_hop_by_hop(&mut headers, false);
        assert!(!headers.contains_key(TE));
        for connection in [None, Some("transfer-encoding")] {
            let mut framed_twice = map(&[("content-length", "2"), ("transfer-encoding", "chunked")]);
            if let Some(named) = connection {
                framed_twice.insert(CONNECTION, HeaderValue::from_static(named));
            }
            strip_hop_by_hop(&mut framed_twice, false);
            assert!(
                framed_twice.is_empty(),
                "a Content-Length sent with Transfer-Encoding goes ({connection:?})"
            );
        }
        let mut gzip = map(&[("te", "gzip, trailers")]);
        strip_hop_by_hop(&mut gzip, true);
        assert!(gzip.is_empty(), "only `TE: trailers` may pass");
        for only in ["keep-alive", "proxy-connection", "trailer", "upgrade", "te"] {
            let mut lone = map(&[(only, "x"), ("x-kept", "1")]);
            strip_hop_by_hop(&mut lone, false);
            assert_eq!(lone, map(&[("x-kept", "1")]), "a lone {only} goes");
        }
        type Pairs = &'static [(&'static str, &'static str)];
        // (sent, keep_te_trailers, forwarded)
        let cases: [(Pairs, bool, Pairs); 5] = [
            (
                &[
                    ("connection", "Keep-Alive, close"),
                    ("keep-alive", "timeout=5"),
                    ("x-kept", "1"),
                ],
                false,
                &[("x-kept", "1")],
            ),
            // `close` is a connection option like any other (RFC 9110 §7.6.1).
            (
                &[("connection", "close"), ("close", "1"), ("x-kept", "1")],
                false,
                &[("x-kept", "1")],
            ),
            (
                &[("connection", "x-secret"), ("x-secret", "1"), ("x-kept", "1")],
                false,
                &[("x-kept", "1")],
            ),
            (
                &[("connection", "content-length"), ("content-length", "2")],
                false,
                &[("content-length", "2")],
            ),
            (&[("te", "trailers")], true, &[("te", "trailers")]),
        ];
        for (sent, keep_te_trailers, forwarded) in cases {
            let mut headers = map(sent);
            strip_hop_by_hop(&mut headers, keep_te_trailers);
            assert_eq!(headers, map(forwarded), "{sent:?}");
        }
        let end_to_end = map(&[
            ("host", "a.example"),
            ("accept", "a"),
            ("accept", "b"),
            ("x-kept", "1"),
        ]);
        let mut untouched = end_to_end.clone();
        strip_hop_by_hop(&mut untouched, false);
        assert_eq!(untouched, end_to_end);
    }

    #[test]
    fn hosts_must_be_single_and_well_formed() {
        assert!(checked_host(&map(&[("host", "api.example.com:8080")])).is_ok());
        assert!(checked_host(&map(&[("host", "[::1]:80")])).is_ok());
        assert_eq!(checked_host(&HeaderMap::new()), Ok(None));
        for bad in [
            &[("host", "a.example"), ("host", "b.example")][..],
            &[("host", "user:pw@api.example.com")],
            &[("host", "evil.com/x.example.com")],
            &[("host", "a b")],
            &[("host", "")],
            &[("host", "[x]evil.com")],
            &[("host", "[::1]evil.com")],
            &[("host", "h:abc")],
            &[("host", "h:")],
        ] {
            assert!(checked_host(&map(bad)).is_err(), "{bad:?}");
        }
    }
}
