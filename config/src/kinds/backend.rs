use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Checker;
use crate::kind::{KindInfo, KindSpec};
use crate::HumanDuration;

/// An upstream service: a set of equivalent endpoints.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BackendSpec {
    /// `host:port` of each endpoint; requests are spread across them round-robin.
    pub endpoints: Vec<String>,
    /// Speak HTTP/2 (prior knowledge) to the endpoints instead of HTTP/1.1.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub http2: bool,
    /// Passive health: endpoints whose connections keep failing are taken out for a while.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ejection: Option<EjectionSpec>,
}

/// An endpoint is ejected after `consecutiveFailures` failed connects in a row, for
/// `duration`, doubled each time it fails again right after re-admission (at most 10×).
/// If every endpoint is ejected, they are all tried anyway: a guess beats a certain 503.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct EjectionSpec {
    #[serde(default = "default_consecutive_failures")]
    pub consecutive_failures: u32,
    #[serde(default = "default_ejection_duration")]
    pub duration: HumanDuration,
}

fn default_consecutive_failures() -> u32 {
    3
}

fn default_ejection_duration() -> HumanDuration {
    HumanDuration::secs(10)
}

impl Default for EjectionSpec {
    fn default() -> EjectionSpec {
        EjectionSpec {
            consecutive_failures: default_consecutive_failures(),
            duration: default_ejection_duration(),
        }
    }
}

impl EjectionSpec {
    pub fn duration(&self) -> Duration {
        self.duration.0
    }
}

impl KindSpec for BackendSpec {
    const INFO: &'static KindInfo = &KindInfo::of::<BackendSpec>("Backend", "backends", &["be"]);

    fn check(&self, checker: &mut Checker<'_>) {
        check_endpoints(&self.endpoints, checker);
        if let Some(ejection) = &self.ejection {
            if ejection.consecutive_failures == 0 {
                checker.fail("spec.ejection.consecutiveFailures", "must be at least 1");
            }
            if ejection.duration.0.is_zero() {
                checker.fail("spec.ejection.duration", "must be above 0");
            }
        }
    }
}

/// `spec.endpoints` of a kind that lists `host:port` endpoints (Backend, InferencePool).
pub(super) fn check_endpoints(endpoints: &[String], checker: &mut Checker<'_>) {
    if endpoints.is_empty() {
        checker.fail("spec.endpoints", "at least one endpoint is required");
    }
    for (index, endpoint) in endpoints.iter().enumerate() {
        if let Err(problem) = check_endpoint(endpoint) {
            checker.fail(
                format!("spec.endpoints[{index}]"),
                format!("{endpoint:?}: {problem}"),
            );
        }
        // Proxies keep an endpoint's health, signals and load by its address: a second
        // entry would share them but not its turns or picks.
        if let Some(first) = endpoints[..index].iter().position(|earlier| earlier == endpoint) {
            checker.fail(
                format!("spec.endpoints[{index}]"),
                format!("{endpoint:?} is already spec.endpoints[{first}]"),
            );
        }
    }
}

pub(super) fn check_endpoint(endpoint: &str) -> Result<(), &'static str> {
    let (host, port) = endpoint.rsplit_once(':').ok_or("expected host:port")?;
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        // Colons belong only to bracketed IPv6 literals.
        Some(ipv6) => {
            ipv6.parse::<std::net::Ipv6Addr>()
                .map_err(|_| "invalid IPv6 address")?;
        }
        None => {
            let valid = !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-'));
            if !valid {
                return Err("invalid host (write IPv6 addresses as [addr]:port)");
            }
        }
    }
    match port.parse::<u16>() {
        Ok(0) | Err(_) => return Err("port must be between 1 and 65535"),
        Ok(_) => {}
    }
    // The proxy addresses the endpoint as a URI authority: it must parse as one.
    endpoint
        .parse::<http::uri::Authority>()
        .map(|_| ())
        .map_err(|_| "not a valid host:port")
}

#[cfg(test)]
mod tests {
    use super::check_endpoint;

    #[test]
    fn endpoints() {
        assert!(check_endpoint("127.0.0.1:8080").is_ok());
        assert!(check_endpoint("upstream.svc:80").is_ok());
        assert!(check_endpoint("[::1]:80").is_ok());
        assert!(check_endpoint("127.0.0.1").is_err());
        assert!(check_endpoint("127.0.0.1:0").is_err());
        assert!(check_endpoint("127.0.0.1:70000").is_err());
        assert!(check_endpoint("http://x:80").is_err());
        assert!(check_endpoint("a:b:80").is_err());
        assert!(check_endpoint("::1:80").is_err());
        assert!(check_endpoint("[not-ip]:80").is_err());
    }

    #[test]
    fn an_endpoint_is_listed_once() {
        for kind in ["Backend", "InferencePool"] {
            let models = if kind == "Backend" {
                ""
            } else {
                ", models: [{name: m}]"
            };
            let yaml = format!(
                "apiVersion: portcullis.dev/v1alpha1\nkind: {kind}\nmetadata: {{name: twice}}\nspec: {{endpoints: ['127.0.0.1:1', '127.0.0.1:2', '127.0.0.1:1']{models}}}\n"
            );
            let error = crate::parse_documents(&yaml).unwrap_err().to_string();
            assert!(
                error.contains("spec.endpoints[2]: \"127.0.0.1:1\" is already spec.endpoints[0]"),
                "{kind}: {error}"
            );
        }
    }
}
