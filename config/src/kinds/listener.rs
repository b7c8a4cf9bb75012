use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::error::{Checker, FieldError};
use crate::kind::{KindInfo, KindSpec};
use crate::set::{ConfigSet, Scope};
use crate::HumanDuration;

/// A port a proxy listens on. Plain HTTP: HTTP/1.1 and HTTP/2 (prior knowledge) on one port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ListenerSpec {
    /// IP address to bind; `0.0.0.0` when absent.
    #[serde(default = "default_address")]
    pub address: IpAddr,
    pub port: u16,
    /// Peers whose `X-Forwarded-For/Proto/Host` are kept and extended; from anyone else
    /// they are replaced. Empty: trust nobody.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub trusted_proxies: Vec<IpNet>,
    /// Collapse `//` into `/` before routing (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merge_slashes: Option<bool>,
    #[serde(default, skip_serializing_if = "ListenerLimits::is_default")]
    pub limits: ListenerLimits,
}

/// Protection of the listener itself; every field has a safe default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ListenerLimits {
    /// Open connections at once; further ones get a 503 and are closed. Default 10,000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
    /// Time a new connection has to start its first request (any protocol), and an
    /// HTTP/1.1 client to send each request's headers, which is also the longest an
    /// HTTP/1.1 keep-alive connection may sit idle; then the connection is closed without
    /// an answer. Default 10s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header_read_timeout: Option<HumanDuration>,
    /// Size of a request's header section (HTTP/1.1: with the request line; HTTP/2: the
    /// decoded header list); larger ones get 431. Default 64 KiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_header_bytes: Option<u32>,
    /// Longest a response may wait for the client to take more bytes; a client that stops
    /// reading is disconnected after it. Default 60s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_timeout: Option<HumanDuration>,
    /// Longest an HTTP/2 connection may go without an open stream; then the proxy sends
    /// GOAWAY and closes it. Default 5m. (An idle HTTP/1.1 connection is bounded by
    /// `header_read_timeout`.)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http2_idle_timeout: Option<HumanDuration>,
}

pub const DEFAULT_MAX_CONNECTIONS: u32 = 10_000;
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_MAX_HEADER_BYTES: u32 = 64 * 1024;
pub const DEFAULT_WRITE_TIMEOUT: Duration = Duration::from_secs(60);
pub const DEFAULT_HTTP2_IDLE_TIMEOUT: Duration = Duration::from_secs(5 * 60);
/// Below this hyper cannot parse an ordinary request line.
const MIN_HEADER_BYTES: u32 = 8 * 1024;
const MAX_HEADER_BYTES: u32 = 1024 * 1024;

impl ListenerLimits {
    fn is_default(&self) -> bool {
        *self == ListenerLimits::default()
    }

    pub fn max_connections(&self) -> u32 {
        self.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS)
    }

    pub fn header_read_timeout(&self) -> Duration {
        self.header_read_timeout
            .map_or(DEFAULT_HEADER_READ_TIMEOUT, |timeout| timeout.0)
    }

    pub fn max_header_bytes(&self) -> u32 {
        self.max_header_bytes.unwrap_or(DEFAULT_MAX_HEADER_BYTES)
    }

    pub fn write_timeout(&self) -> Duration {
        self.write_timeout.map_or(DEFAULT_WRITE_TIMEOUT, |timeout| timeout.0)
    }

    pub fn http2_idle_timeout(&self) -> Duration {
        self.http2_idle_timeout
            .map_or(DEFAULT_HTTP2_IDLE_TIMEOUT, |timeout| timeout.0)
    }
}

fn default_address() -> IpAddr {
    IpAddr::V4(Ipv4Addr::UNSPECIFIED)
}

impl ListenerSpec {
    pub fn socket_addr(&self) -> SocketAddr {
        SocketAddr::new(self.address, self.port)
    }

    pub fn merge_slashes(&self) -> bool {
        self.merge_slashes.unwrap_or(true)
    }
}

impl KindSpec for ListenerSpec {
    const INFO: &'static KindInfo = &KindInfo::of::<ListenerSpec>("Listener", "listeners", &["li"]);
    const SHARD_ROOT: bool = true;

    fn check(&self, checker: &mut Checker<'_>) {
        if self.port == 0 {
            checker.fail("spec.port", "port must be between 1 and 65535");
        }
        let limits = &self.limits;
        if limits.max_connections == Some(0) {
            checker.fail("spec.limits.maxConnections", "must be at least 1");
        }
        if let Some(bytes) = limits.max_header_bytes {
            if !(MIN_HEADER_BYTES..=MAX_HEADER_BYTES).contains(&bytes) {
                checker.fail(
                    "spec.limits.maxHeaderBytes",
                    format!("must be between {MIN_HEADER_BYTES} and {MAX_HEADER_BYTES}"),
                );
            }
        }
        if limits
            .header_read_timeout
            .is_some_and(|duration| duration.0.is_zero())
        {
            checker.fail("spec.limits.headerReadTimeout", "must be above 0");
        }
        if limits.write_timeout.is_some_and(|duration| duration.0.is_zero()) {
            checker.fail("spec.limits.writeTimeout", "must be above 0");
        }
        if limits
            .http2_idle_timeout
            .is_some_and(|duration| duration.0.is_zero())
        {
            checker.fail("spec.limits.http2IdleTimeout", "must be above 0");
        }
    }

    /// No two listeners on one socket; `0.0.0.0:P` also conflicts with any address on P, and
    /// `::ffff:a.b.c.d` is `a.b.c.d` (proxies bind dual-stack sockets).
    fn check_set(set: &ConfigSet, _scope: Scope, errors: &mut Vec<FieldError>) {
        let mut by_port: HashMap<u16, Vec<(IpAddr, &str)>> = HashMap::new();
        for (metadata, spec) in set.specs::<ListenerSpec>() {
            let address = spec.address.to_canonical();
            let taken = by_port.entry(spec.port).or_default();
            let clash = taken
                .iter()
                .find(|(ip, _)| *ip == address || ip.is_unspecified() || address.is_unspecified());
            if let Some((_, other)) = clash {
                errors.push(FieldError::new(
                    format!("Listener/{}", metadata.name),
                    "spec.port",
                    format!("port {} is already used by Listener/{other}", spec.port),
                ));
            }
            taken.push((address, &metadata.name));
        }
    }
}
