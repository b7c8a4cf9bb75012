//! The one shape of a request's host the proxy accepts and routes on: a host name or address,
//! with an optional port. The proxy checks each request's `Host` with it, and the config a
//! HeaderPolicy's `Host`, so nothing the config sets is what the proxy would refuse.

/// `name[:port]` or `[v6][:port]`: a name of letters, digits, `-`, `.` and `_`, the port all
/// digits when present.
pub fn is_host_with_port(text: &str) -> bool {
    let (name_ok, rest) = match text.strip_prefix('[') {
        Some(bracketed) => match bracketed.split_once(']') {
            Some((v6, rest)) => (v6.parse::<std::net::Ipv6Addr>().is_ok(), rest),
            None => (false, ""),
        },
        None => {
            let (name, rest) = text.find(':').map_or((text, ""), |colon| text.split_at(colon));
            let name_ok = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
            (name_ok, rest)
        }
    };
    let port_ok = rest.is_empty()
        || rest
            .strip_prefix(':')
            .is_some_and(|port| !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()));
    name_ok && port_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts() {
        for good in [
            "a.example",
            "a.example:8443",
            "[::1]:80",
            "[::1]",
            "10.0.0.1:7",
            "a_b-c",
        ] {
            assert!(is_host_with_port(good), "{good}");
        }
        for bad in [
            "",
            "a.example:",
            "a.example:abc",
            "u@a.example",
            "a b",
            "[::1",
            "[nope]:80",
            ":80",
        ] {
            assert!(!is_host_with_port(bad), "{bad}");
        }
    }
}
