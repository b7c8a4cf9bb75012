//! `X-Forwarded-For/Proto/Host`: believed only from configured trusted hops, replaced
//! otherwise, so a client cannot pose as another address to the upstream or to a policy
//! keyed on the client address.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use http::header::HOST;
use http::{HeaderMap, HeaderName, HeaderValue};
use ipnet::IpNet;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Other ways clients name their origin; from an untrusted peer they are dropped, since
/// the proxy does not vouch for them.
const UNVOUCHED: [HeaderName; 4] = [
    http::header::FORWARDED,
    HeaderName::from_static("x-forwarded-port"),
    HeaderName::from_static("x-forwarded-prefix"),
    HeaderName::from_static("x-real-ip"),
];

/// A listener's trust in the forwarding headers of its peers.
#[derive(Debug, Clone, Default)]
pub(crate) struct Forwarding {
    trusted: Vec<IpNet>,
}

impl Forwarding {
    pub(crate) fn new(trusted: Vec<IpNet>) -> Forwarding {
        Forwarding { trusted }
    }

    fn trusts(&self, address: IpAddr) -> bool {
        let address = match address {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(address, IpAddr::V4),
            v4 => v4,
        };
        self.trusted.iter().any(|net| net.contains(&address))
    }

    /// Rewrites the headers for the upstream; returns the client address: the peer, or,
    /// behind trusted hops, the nearest address in `X-Forwarded-For` that is not one (the
    /// farthest when all are, as nginx's `real_ip_recursive` reads it).
    pub(crate) fn rewrite(&self, headers: &mut HeaderMap, peer: IpAddr) -> IpAddr {
        let peer_text = peer.to_string();
        if !self.trusts(peer) {
            for name in &UNVOUCHED {
                headers.remove(name);
            }
            headers.remove(&X_FORWARDED_FOR);
            headers.insert(X_FORWARDED_FOR, header_value(&peer_text));
            headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
            match headers.get(HOST).cloned() {
                Some(host) => headers.insert(X_FORWARDED_HOST, host),
                None => headers.remove(X_FORWARDED_HOST),
            };
            return peer;
        }
        let chain: Vec<String> = headers
            .get_all(&X_FORWARDED_FOR)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(','))
            .map(|hop| hop.trim().to_string())
            .filter(|hop| !hop.is_empty())
            .collect();
        // From the nearest hop back: the first address no trusted hop is, else the
        // farthest one every hop vouched for. A hop that cannot be read ends the walk, since
        // nothing before it was vouched for.
        let mut client = peer;
        for hop in chain.iter().rev() {
            let Some(address) = hop_address(hop) else {
                break;
            };
            client = address;
            if !self.trusts(address) {
                break;
            }
        }
        let mut extended = chain.join(", ");
        if !extended.is_empty() {
            extended.push_str(", ");
        }
        extended.push_str(&peer_text);
        headers.insert(X_FORWARDED_FOR, header_value(&extended));
        if !headers.contains_key(&X_FORWARDED_PROTO) {
            headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
        }
        if !headers.contains_key(&X_FORWARDED_HOST) {
            if let Some(host) = headers.get(HOST).cloned() {
                headers.insert(X_FORWARDED_HOST, host);
            }
        }
        client
    }
}

/// An `X-Forwarded-For` entry's address: proxies write `ip`, `ip:port`, `[v6]` and
/// `[v6]:port`.
fn hop_address(hop: &str) -> Option<IpAddr> {
    if let Ok(address) = hop.parse::<IpAddr>() {
        return Some(address);
    }
    if let Ok(socket) = hop.parse::<SocketAddr>() {
        return Some(socket.ip());
    }
    let bracketed = hop.strip_prefix('[')?.strip_suffix(']')?;
    bracketed.parse::<Ipv6Addr>().ok().map(IpAddr::V6)
}

/// Built only from addresses and header values that were valid already.
fn header_value(text: &str) -> HeaderValue {
    HeaderValue::from_str(text).unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        map
    }

    #[test]
    fn untrusted_peers_cannot_forge_forwarding_headers() {
        let forwarding = Forwarding::new(vec!["10.0.0.0/8".parse().unwrap()]);
        let mut map = headers(&[
            ("host", "api.example.com"),
            ("x-forwarded-for", "1.2.3.4"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "evil.example"),
            ("forwarded", "for=1.2.3.4"),
            ("x-real-ip", "1.2.3.4"),
        ]);
        let client = forwarding.rewrite(&mut map, "192.0.2.7".parse().unwrap());
        assert_eq!(client.to_string(), "192.0.2.7");
        assert_eq!(map["x-forwarded-for"], "192.0.2.7");
        assert_eq!(map["x-forwarded-proto"], "http");
        assert_eq!(map["x-forwarded-host"], "api.example.com");
        assert!(!map.contains_key("forwarded") && !map.contains_key("x-real-ip"));
    }

    #[test]
    fn trusted_hops_are_extended_and_the_client_is_the_first_untrusted_address() {
        let forwarding = Forwarding::new(vec!["10.0.0.0/8".parse().unwrap()]);
        let mut map = headers(&[
            ("host", "api.example.com"),
            ("x-forwarded-for", "203.0.113.9, 10.1.1.1"),
            ("x-forwarded-proto", "https"),
        ]);
        let client = forwarding.rewrite(&mut map, "10.2.2.2".parse().unwrap());
        assert_eq!(client.to_string(), "203.0.113.9");
        assert_eq!(map["x-forwarded-for"], "203.0.113.9, 10.1.1.1, 10.2.2.2");
        assert_eq!(map["x-forwarded-proto"], "https");
        assert_eq!(map["x-forwarded-host"], "api.example.com");
    }

    #[test]
    fn the_client_behind_trusted_hops_is_read_as_each_hop_wrote_it() {
        let forwarding = Forwarding::new(vec!["10.0.0.0/8".parse().unwrap()]);
        let client = |chain: &str| {
            let mut map = headers(&[("x-forwarded-for", chain)]);
            forwarding
                .rewrite(&mut map, "10.2.2.2".parse().unwrap())
                .to_string()
        };
        // A hop that writes the port must not let the client's own claim through.
        assert_eq!(client("203.0.113.77, 198.51.100.9:51234"), "198.51.100.9");
        assert_eq!(client("203.0.113.77, [2001:db8::9]:443"), "2001:db8::9");
        assert_eq!(client("203.0.113.77, [2001:db8::9]"), "2001:db8::9");
        assert_eq!(client("203.0.113.77, 10.1.1.1:8080"), "203.0.113.77");
        // Something unreadable ends the walk at the farthest hop vouched for.
        assert_eq!(client("203.0.113.77, unknown, 10.1.1.1"), "10.1.1.1");
        assert_eq!(client("203.0.113.77, _hidden"), "10.2.2.2");
        // Every hop trusted: the farthest is the client, not the nearest proxy.
        assert_eq!(client("10.9.9.9, 10.1.1.1"), "10.9.9.9");
    }

    #[test]
    fn ipv4_mapped_peers_match_ipv4_ranges() {
        let forwarding = Forwarding::new(vec!["127.0.0.0/8".parse().unwrap()]);
        assert!(forwarding.trusts("::ffff:127.0.0.1".parse().unwrap()));
        assert!(!forwarding.trusts("::1".parse().unwrap()));
    }
}
