use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use serde::{Deserialize, Serialize};

use crate::error::Checker;

/// A port a proxy listens on. Plain HTTP: HTTP/1.1 and HTTP/2 (prior knowledge) on one port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ListenerSpec {
    /// IP address to bind; `0.0.0.0` when absent.
    #[serde(default = "default_address")]
    pub address: IpAddr,
    pub port: u16,
}

fn default_address() -> IpAddr {
    IpAddr::V4(Ipv4Addr::UNSPECIFIED)
}

impl ListenerSpec {
    pub fn socket_addr(&self) -> SocketAddr {
        SocketAddr::new(self.address, self.port)
    }

    pub(crate) fn check(&self, checker: &mut Checker<'_>) {
        if self.port == 0 {
            checker.fail("spec.port", "port must be between 1 and 65535");
        }
    }
}
