use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Checker;
use crate::kind::{KindInfo, KindSpec};
use crate::reference::{Reference, Role};
use crate::HumanDuration;

/// Sends matching requests arriving on some listeners to weighted backends.
///
/// A request matches the route when its host matches one of `hostnames` (any host when
/// empty) and it matches at least one entry of `matches` (everything when empty). When
/// several routes match, the most specific wins: the best hostname match (exact, then the
/// longest wildcard, then routes without hostnames), then exact path, then longest prefix,
/// then more header conditions, then a method condition; remaining ties go to the route
/// name that sorts first. Paths are compared after normalization (see [`crate::path`]).
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
    pub timeout: Option<HumanDuration>,
    /// Retries beyond the default (one retry on a failed connect, when nothing was sent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetrySpec>,
    #[serde(default, skip_serializing_if = "RouteLimits::is_default")]
    pub limits: RouteLimits,
}

pub const DEFAULT_ROUTE_TIMEOUT: Duration = Duration::from_secs(30);

/// Headers of one connection (RFC 9110 §7.6.1), which a proxy removes before it routes or
/// forwards a request; `TE` stays only as `trailers`.
pub const HOP_BY_HOP_HEADERS: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

fn is_hop_by_hop(name: &http::HeaderName, value: &str) -> bool {
    HOP_BY_HOP_HEADERS.contains(&name.as_str())
        || (name == http::header::TE && !value.eq_ignore_ascii_case("trailers"))
}

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

/// Where a route sends requests: a typed reference with a weight.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BackendRef {
    /// The target's kind; `Backend` when absent.
    #[serde(default = "default_backend_kind")]
    pub kind: String,
    pub name: String,
    /// Relative share of requests; defaults to 1. A weight of 0 sends nothing.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// For an InferencePool: the priority class of every request this route sends it (one of
    /// the pool's `spec.priority.classes`); the request's priority header is then ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class: Option<String>,
}

/// Kinds a route may send to.
pub const ROUTE_TARGET_KINDS: &[&str] = &["Backend", "InferencePool", "McpBackend"];

fn default_backend_kind() -> String {
    "Backend".to_string()
}

fn default_weight() -> u32 {
    1
}

/// Further attempts, each on the next endpoint in turn (the same one when there is only
/// one). A request is retried only when its body can be sent again (empty, or at most
/// 64 KiB with a `content-length`), and only when nothing of it reached the upstream
/// (failed connect) or its method is idempotent and the upstream answered one of
/// `onStatus`; never beyond the retry budget, which is per route and starts afresh with
/// each config version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RetrySpec {
    /// Retries after the first attempt (0–5; 0 turns retries off). Default 1.
    #[serde(default = "default_attempts")]
    pub attempts: u32,
    /// Upstream statuses that cause a retry of an idempotent request (500–599).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub on_status: Vec<u16>,
    /// Retries may add at most this percentage to the route's request rate. Default 20.
    #[serde(default = "default_budget_percent")]
    pub budget_percent: u32,
}

fn default_attempts() -> u32 {
    1
}

fn default_budget_percent() -> u32 {
    20
}

impl Default for RetrySpec {
    fn default() -> RetrySpec {
        RetrySpec {
            attempts: default_attempts(),
            on_status: Vec::new(),
            budget_percent: default_budget_percent(),
        }
    }
}

/// Per-request limits; every field has a safe default.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RouteLimits {
    /// Request body size; larger bodies get 413. Default 16 MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_request_body_bytes: Option<u64>,
    /// Longest pause inside a request or response body before the exchange is cut.
    /// Default 60s. Long-lived event streams need a value above their keep-alive interval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_idle_timeout: Option<HumanDuration>,
}

pub const DEFAULT_MAX_REQUEST_BODY_BYTES: u64 = 16 * 1024 * 1024;
pub const DEFAULT_BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

impl RouteLimits {
    fn is_default(&self) -> bool {
        *self == RouteLimits::default()
    }

    pub fn max_request_body_bytes(&self) -> u64 {
        self.max_request_body_bytes
            .unwrap_or(DEFAULT_MAX_REQUEST_BODY_BYTES)
    }

    pub fn body_idle_timeout(&self) -> Duration {
        self.body_idle_timeout
            .map_or(DEFAULT_BODY_IDLE_TIMEOUT, |timeout| timeout.0)
    }
}

/// CONNECT is absent: the proxy does not tunnel, so a route for it could never work.
const METHODS: [&str; 8] = ["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "TRACE", "PATCH"];

impl RouteSpec {
    pub fn timeout(&self) -> Duration {
        self.timeout.map_or(DEFAULT_ROUTE_TIMEOUT, |timeout| timeout.0)
    }
}

impl KindSpec for RouteSpec {
    const INFO: &'static KindInfo = &KindInfo::of::<RouteSpec>("Route", "routes", &["rt"]);

    fn references(&self) -> Vec<Reference> {
        let listeners = self.listeners.iter().enumerate().map(|(index, name)| {
            Reference::new(
                format!("spec.listeners[{index}]"),
                "Listener",
                name,
                Role::AttachTo,
                &["Listener"],
            )
        });
        let backends = self.backends.iter().enumerate().map(|(index, backend)| {
            Reference::new(
                format!("spec.backends[{index}]"),
                &backend.kind,
                &backend.name,
                Role::Uses,
                ROUTE_TARGET_KINDS,
            )
        });
        listeners.chain(backends).collect()
    }

    fn retain_attachments(&mut self, keep: &dyn Fn(&crate::ObjectKey) -> bool) {
        self.listeners.retain(|name| {
            keep(&crate::ObjectKey::new(
                crate::Kind::of::<crate::ListenerSpec>(),
                name.as_str(),
            ))
        });
    }

    fn check(&self, checker: &mut Checker<'_>) {
        if self.listeners.is_empty() {
            checker.fail("spec.listeners", "at least one listener is required");
        }
        let pool = crate::InferencePoolSpec::INFO.name;
        let pools = self.backends.iter().filter(|backend| backend.kind == pool).count();
        if pools > 0 && pools < self.backends.len() {
            checker.fail(
                "spec.backends",
                "a route sends either to InferencePools (chosen by the request's model) or to \
                 other backends (chosen by weight), not both",
            );
        }
        let mcp = crate::McpBackendSpec::INFO.name;
        if self.backends.len() > 1 && self.backends.iter().any(|backend| backend.kind == mcp) {
            checker.fail(
                "spec.backends",
                "an McpBackend must be the route's only backend: an MCP session belongs to one \
                 McpBackend (put several servers in one McpBackend to serve them together)",
            );
        }
        for (index, backend) in self.backends.iter().enumerate() {
            if backend.kind != pool && backend.priority_class.is_some() {
                checker.fail(
                    format!("spec.backends[{index}].priorityClass"),
                    "priority classes apply to InferencePools only",
                );
            }
            if backend.kind == pool && backend.weight != default_weight() {
                checker.fail(
                    format!("spec.backends[{index}].weight"),
                    "weights do not apply to InferencePools: each request goes to the pool \
                     serving its model; split traffic with the pool's spec.rewrites",
                );
            }
        }
        for (index, host) in self.hostnames.iter().enumerate() {
            let bare = host.strip_prefix("*.").unwrap_or(host);
            let valid = !bare.is_empty()
                && bare.len() <= 253
                && bare
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
                && !bare.starts_with('.')
                && !bare.ends_with('.')
                && !bare.contains("..");
            if !valid {
                checker.fail(
                    format!("spec.hostnames[{index}]"),
                    format!("invalid host name {host:?}"),
                );
            }
        }
        for (index, route_match) in self.matches.iter().enumerate() {
            let field = format!("spec.matches[{index}]");
            if let Some(PathMatch::Exact(path) | PathMatch::Prefix(path)) = &route_match.path {
                if let Err(problem) = crate::path::check_route_path(path) {
                    checker.fail(format!("{field}.path"), format!("path {path:?} {problem}"));
                }
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
                let field = format!("{field}.headers[{header_index}]");
                match http::HeaderName::from_bytes(header.name.as_bytes()) {
                    Err(_) => checker.fail(
                        format!("{field}.name"),
                        format!("invalid header name {:?}", header.name),
                    ),
                    Ok(name) if is_hop_by_hop(&name, &header.value) => checker.fail(
                        format!("{field}.name"),
                        format!(
                            "{:?} belongs to the client's connection and is removed before routing, so the route could never match",
                            header.name
                        ),
                    ),
                    Ok(_) => {}
                }
                if http::HeaderValue::from_str(&header.value).is_err() {
                    checker.fail(
                        format!("{field}.value"),
                        format!(
                            "invalid header value {:?}: only visible ASCII, spaces and tabs",
                            header.value
                        ),
                    );
                }
            }
        }
        if self.backends.is_empty() {
            checker.fail("spec.backends", "at least one backend is required");
        } else if self.backends.iter().all(|backend| backend.weight == 0) {
            checker.fail("spec.backends", "at least one backend needs a weight above 0");
        }
        if self.timeout.is_some_and(|timeout| timeout.0.is_zero()) {
            checker.fail("spec.timeout", "timeout must be above 0");
        }
        if self.backends.iter().any(|backend| backend.kind == mcp) {
            // An McpBackend sends each message to its servers itself, with its own per-server
            // timeout, and a message that reached a server is never sent twice.
            if self.timeout.is_some() {
                checker.fail(
                    "spec.timeout",
                    "a route to an McpBackend does not time its servers: set the McpBackend's servers[].timeout",
                );
            }
            if self.retry.is_some() {
                checker.fail(
                    "spec.retry",
                    "retries apply to Backends and InferencePools: an McpBackend does not send a message to its servers twice",
                );
            }
        }
        if let Some(retry) = &self.retry {
            if retry.attempts > 5 {
                checker.fail("spec.retry.attempts", "must be between 0 and 5");
            }
            for (index, status) in retry.on_status.iter().enumerate() {
                if !(500..=599).contains(status) {
                    checker.fail(
                        format!("spec.retry.onStatus[{index}]"),
                        format!("{status} is not a 5xx status"),
                    );
                }
            }
            if !(1..=100).contains(&retry.budget_percent) {
                checker.fail("spec.retry.budgetPercent", "must be between 1 and 100");
            }
        }
        if self.limits.max_request_body_bytes == Some(0) {
            checker.fail("spec.limits.maxRequestBodyBytes", "must be at least 1");
        }
        if self
            .limits
            .body_idle_timeout
            .is_some_and(|timeout| timeout.0.is_zero())
        {
            checker.fail("spec.limits.bodyIdleTimeout", "must be above 0");
        }
    }
}
