//! Request-path normalization: the one definition the proxy routes on and the config
//! validates route paths against, so a route can only name paths a request can have.
//!
//! Following RFC 3986 §6.2.2: percent-encodings of unreserved characters are decoded
//! (`%41` → `A`, `%2e` → `.`), other percent-encodings keep their meaning and are written
//! in upper case (`%2f` → `%2F`, never decoded to `/`; `%25` stays, so double encoding
//! stays encoded), dot segments are removed (§5.2.4, never above the root), and, when the
//! listener asks for it, runs of `/` are merged.

use std::borrow::Cow;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("invalid percent-encoding at byte {0}")]
    InvalidEncoding(usize),
    /// Some servers read `\` as `/`: a path with one could mean another path upstream.
    #[error("backslash in the path")]
    Backslash,
}

fn is_unreserved(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~')
}

fn hex(byte: u8) -> Option<u8> {
    char::from(byte)
        .to_digit(16)
        .and_then(|digit| u8::try_from(digit).ok())
}

/// Normalizes an origin-form path (no query). Borrows when nothing changes, which is
/// almost every request.
pub fn normalize(path: &str, merge_slashes: bool) -> Result<Cow<'_, str>, PathError> {
    let bytes = path.as_bytes();
    if bytes.contains(&b'\\') {
        return Err(PathError::Backslash);
    }
    let needs_work = bytes.iter().enumerate().any(|(index, &byte)| {
        byte == b'%'
            || (byte == b'/'
                && match bytes.get(index + 1) {
                    Some(b'.') => true,
                    Some(b'/') => merge_slashes,
                    _ => false,
                })
    });
    if !needs_work {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode_unreserved(path)?;
    let mut segments: Vec<&str> = Vec::new();
    let parts: Vec<&str> = decoded.split('/').skip(1).collect();
    let last = parts.len().saturating_sub(1);
    let mut trailing_slash = false;
    for (index, segment) in parts.iter().enumerate() {
        // `..;x` is `..` to servlet containers (path parameters): treat it as one.
        let bare = segment.split(';').next().unwrap_or_default();
        let segment = if matches!(bare, "." | "..") { bare } else { segment };
        match segment {
            "." => trailing_slash = index == last,
            ".." => {
                segments.pop();
                trailing_slash = index == last;
            }
            "" if merge_slashes && index != last => {}
            other => {
                segments.push(other);
                trailing_slash = false;
            }
        }
    }
    let mut normalized = String::with_capacity(decoded.len());
    for segment in &segments {
        normalized.push('/');
        normalized.push_str(segment);
    }
    if normalized.is_empty() || (trailing_slash && !normalized.ends_with('/')) {
        normalized.push('/');
    }
    Ok(Cow::Owned(normalized))
}

fn decode_unreserved(path: &str) -> Result<String, PathError> {
    let bytes = path.as_bytes();
    // Bytes, not chars: a multi-byte UTF-8 sequence passes through untouched, and only
    // ASCII is ever substituted, so the result is UTF-8 again.
    let mut out: Vec<u8> = Vec::with_capacity(path.len());
    let mut index = 0;
    while let Some(&byte) = bytes.get(index) {
        if byte != b'%' {
            out.push(byte);
            index += 1;
            continue;
        }
        let (Some(high), Some(low)) = (
            bytes.get(index + 1).copied().and_then(hex),
            bytes.get(index + 2).copied().and_then(hex),
        ) else {
            return Err(PathError::InvalidEncoding(index));
        };
        let decoded = high * 16 + low;
        if decoded == b'\\' {
            return Err(PathError::Backslash);
        }
        if is_unreserved(decoded) {
            out.push(decoded);
        } else {
            out.extend_from_slice(format!("%{decoded:02X}").as_bytes());
        }
        index += 3;
    }
    String::from_utf8(out).map_err(|_| PathError::InvalidEncoding(0))
}

/// Why a route path could never match a normalized request path, if it could not.
pub(crate) fn check_route_path(path: &str) -> Result<(), String> {
    if !path.starts_with('/') {
        return Err("must start with '/'".into());
    }
    if path.contains(['?', '#']) {
        return Err("must not contain a query or fragment".into());
    }
    if path.parse::<http::uri::PathAndQuery>().is_err()
        || path.bytes().any(|b| b.is_ascii_control() || b == b' ')
    {
        return Err("contains characters a request path cannot have".into());
    }
    if path.contains("//") {
        return Err(
            "contains '//': routes name paths with single slashes (listeners merge slashes by default)"
                .into(),
        );
    }
    match normalize(path, true) {
        Err(error) => Err(error.to_string()),
        Ok(normalized) if normalized != path => Err(format!(
            "is not normalized, requests are matched as {normalized:?}"
        )),
        Ok(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bypass_attempts_normalize_to_what_the_upstream_sees() {
        let cases: &[(&str, bool, &str)] = &[
            ("/public/../admin", true, "/admin"),
            ("/public/%2e%2e/admin", true, "/admin"),
            ("/public/.%2E/admin", true, "/admin"),
            ("/public/%2E./admin", true, "/admin"),
            ("/public/./admin", true, "/public/admin"),
            ("//admin", true, "/admin"),
            ("//admin", false, "//admin"),
            ("/public//..//admin", true, "/admin"),
            ("/../../etc/passwd", true, "/etc/passwd"),
            ("/%61dmin", true, "/admin"),
            ("/a%2fb", true, "/a%2Fb"),
            ("/a%2Fb/../c", true, "/c"),
            ("/%252e%252e/admin", true, "/%252e%252e/admin"),
            ("/a/b/..", true, "/a/"),
            ("/a/b/.", true, "/a/b/"),
            ("/", true, "/"),
            ("/..", true, "/"),
            ("/a/", true, "/a/"),
            ("/a..b/c", true, "/a..b/c"),
            ("/~user/%7Efile", true, "/~user/~file"),
            ("/public/..;/admin", true, "/admin"),
            ("/public/..;jsessionid=x/admin", true, "/admin"),
            ("/a;b/c", true, "/a;b/c"),
        ];
        for (input, merge, expected) in cases {
            assert_eq!(
                normalize(input, *merge).unwrap(),
                *expected,
                "{input} (merge slashes: {merge})"
            );
        }
    }

    #[test]
    fn invalid_percent_encoding_is_an_error() {
        for input in [
            "/a%",
            "/a%2",
            "/a%zz",
            "/%g0",
            "/a\\..\\admin",
            "/a/%5c../admin",
            "/a/%5C",
        ] {
            assert!(normalize(input, true).is_err(), "{input}");
        }
    }

    #[test]
    fn plain_paths_are_borrowed() {
        assert!(matches!(
            normalize("/v1/chat/completions", true),
            Ok(Cow::Borrowed(_))
        ));
    }

    #[test]
    fn route_paths_must_be_normalized() {
        assert!(check_route_path("/api").is_ok());
        assert!(check_route_path("/a%2Fb").is_ok());
        for bad in ["api", "/a/../b", "/%61", "/a//b", "/a?x", "/a b", "/a\u{1}"] {
            assert!(check_route_path(bad).is_err(), "{bad:?}");
        }
    }
}
