use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Checker;

/// Sends matching requests arriving on some listeners to weighted backends.
///
/// A request matches the route when its host matches one of `hostnames` (any host when
/// empty) and it matches at least one entry of `matches` (everything when empty). When
/// several routes match, the most specific wins: the best hostname match (exact, then the
/// longest wildcard, then routes without hostnames), then exact path, then longest prefix,
/// then more header conditions, then a method condition; remaining ties go to the route
/// name that sorts first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RouteSpec {
    /// Names of the Listeners this route is served on.
    pub listeners: Vec<String>,
    /// Host names (without port); `*.example.com` matches any subdomain.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hostnames: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matches: Vec<RouteMatch>,
    pub backends: Vec<BackendRef>,
    /// Time allowed for the upstream to answer with response headers, e.g. `30s`, `500ms`.
    /// Streaming bodies are not cut by it. Defaults to 30s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<String>,
}

pub const DEFAULT_ROUTE_TIMEOUT: Duration = Duration::from_secs(30);

/// All conditions given must hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RouteMatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathMatch>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<HeaderMatch>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub enum PathMatch {
    Exact(String),
    /// Matches whole segments: `/api` matches `/api` and `/api/x`, not `/apix`.
    Prefix(String),
}

/// Header `name` must be present with exactly `value`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HeaderMatch {
    pub name: String,
    pub value: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BackendRef {
    pub name: String,
    /// Relative share of requests; defaults to 1. A weight of 0 sends nothing.
    #[serde(default = "default_weight")]
    pub weight: u32,
}

fn default_weight() -> u32 {
    1
}

const METHODS: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
];

impl RouteSpec {
    /// The upstream response-header timeout. Only call on a validated spec.
    pub fn timeout(&self) -> Duration {
        self.timeout
            .as_deref()
            .and_then(|text| humantime::parse_duration(text).ok())
            .unwrap_or(DEFAULT_ROUTE_TIMEOUT)
    }

    pub(crate) fn check(&self, checker: &mut Checker<'_>) {
        if self.listeners.is_empty() {
            checker.fail("spec.listeners", "at least one listener is required");
        }
        for (index, host) in self.hostnames.iter().enumerate() {
            let bare = host.strip_prefix("*.").unwrap_or(host);
            let valid = !bare.is_empty()
                && bare.len() <= 253
                && bare
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
                && !bare.starts_with('.')
                && !bare.ends_with('.');
            if !valid {
                checker.fail(
                    format!("spec.hostnames[{index}]"),
                    format!("invalid host name {host:?}"),
                );
            }
        }
        for (index, route_match) in self.matches.iter().enumerate() {
            let field = format!("spec.matches[{index}]");
            match &route_match.path {
                Some(PathMatch::Exact(path) | PathMatch::Prefix(path)) if !path.starts_with('/') => {
                    checker.fail(
                        format!("{field}.path"),
                        format!("path {path:?} must start with '/'"),
                    );
                }
                _ => {}
            }
            if let Some(method) = &route_match.method {
                if !METHODS.contains(&method.as_str()) {
                    checker.fail(
                        format!("{field}.method"),
                        format!(
                            "unknown method {method:?}, expected one of {}",
                            METHODS.join(", ")
                        ),
                    );
                }
            }
            for (header_index, header) in route_match.headers.iter().enumerate() {
                let valid = !header.name.is_empty()
                    && header
                        .name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
                if !valid {
                    checker.fail(
                        format!("{field}.headers[{header_index}].name"),
                        format!("invalid header name {:?}", header.name),
                    );
                }
            }
        }
        if self.backends.is_empty() {
            checker.fail("spec.backends", "at least one backend is required");
        } else if self.backends.iter().all(|backend| backend.weight == 0) {
            checker.fail("spec.backends", "at least one backend needs a weight above 0");
        }
        if let Some(text) = &self.timeout {
            match humantime::parse_duration(text) {
                Ok(duration) if duration.is_zero() => checker.fail("spec.timeout", "timeout must be above 0"),
                Ok(_) => {}
                Err(error) => checker.fail("spec.timeout", format!("invalid duration {text:?}: {error}")),
            }
        }
    }
}
