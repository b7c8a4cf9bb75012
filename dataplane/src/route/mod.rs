//! The per-listener route table: which route a request belongs to, and what a route does
//! with it (its policy chain, its targets, its limits).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use http::header::HOST;
use http::{HeaderName, HeaderValue, Method, Request};
use portcullis_config::{HeaderMatch, PathMatch, RouteMatch, RouteSpec};

use crate::llm::Models;
use crate::policy::Policy;
use crate::target::WeightedTargets;
use crate::upstream::RetryPolicy;

/// A compiled Route: shared by the tables of every listener it is attached to.
pub(crate) struct Route {
    pub(crate) name: Arc<str>,
    hostnames: Vec<HostPattern>,
    conditions: Vec<Condition>,
    /// The route's own policies; those of the listener the request came in on run first.
    pub(crate) policies: Vec<Arc<dyn Policy>>,
    pub(crate) targets: WeightedTargets,
    /// For a route to InferencePools: the models it serves, which choose the pool.
    pub(crate) llm: Option<Models>,
    pub(crate) timeout: Duration,
    pub(crate) retry: RetryPolicy,
    pub(crate) max_request_body_bytes: u64,
    pub(crate) body_idle_timeout: Duration,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, PartialEq, Eq)]
enum HostPattern {
    Exact(String),
    /// `*.example.com` stored as `.example.com`, so a suffix test matches any depth of
    /// subdomain but never the apex itself.
    Wildcard(String),
}

#[derive(Debug)]
struct Condition {
    path: PathCondition,
    method: Option<Method>,
    headers: Vec<(HeaderName, HeaderValue)>,
}

#[derive(Debug)]
enum PathCondition {
    Exact(String),
    /// Stored without a trailing `/`, so `/`, `/api` and `/api/` compare by whole segments
    /// and an absent path condition is the empty prefix.
    Prefix(String),
}

/// Ordering key of a rule; greater is more specific, following the rule documented on
/// [`RouteSpec`].
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Specificity {
    exact_path: bool,
    prefix_len: usize,
    header_count: usize,
    has_method: bool,
}

impl Route {
    /// `policies` are the route's own (targeting it); the table adds the listener's.
    pub(crate) fn compile(
        name: &str,
        spec: &RouteSpec,
        targets: WeightedTargets,
        llm: Option<Models>,
        policies: Vec<Arc<dyn Policy>>,
        retry: RetryPolicy,
    ) -> Result<Route, String> {
        let hostnames = spec
            .hostnames
            .iter()
            .map(|host| {
                let host = host.to_ascii_lowercase();
                match host.strip_prefix('*') {
                    Some(suffix) => HostPattern::Wildcard(suffix.to_string()),
                    None => HostPattern::Exact(host),
                }
            })
            .collect();
        let conditions = if spec.matches.is_empty() {
            vec![Condition::everything()]
        } else {
            spec.matches
                .iter()
                .map(Condition::compile)
                .collect::<Result<_, _>>()
                .map_err(|problem| format!("Route/{name}: {problem}"))?
        };
        Ok(Route {
            name: Arc::from(name),
            hostnames,
            conditions,
            policies,
            targets,
            llm,
            timeout: spec.timeout(),
            retry,
            max_request_body_bytes: spec.limits.max_request_body_bytes(),
            body_idle_timeout: spec.limits.body_idle_timeout(),
        })
    }
}

impl Condition {
    fn everything() -> Condition {
        Condition {
            path: PathCondition::Prefix(String::new()),
            method: None,
            headers: Vec::new(),
        }
    }

    fn compile(route_match: &RouteMatch) -> Result<Condition, String> {
        let path = match &route_match.path {
            Some(PathMatch::Exact(path)) => PathCondition::Exact(path.clone()),
            Some(PathMatch::Prefix(prefix)) => {
                PathCondition::Prefix(prefix.trim_end_matches('/').to_string())
            }
            None => PathCondition::Prefix(String::new()),
        };
        let method = route_match
            .method
            .as_deref()
            .map(|method| Method::from_bytes(method.as_bytes()).map_err(|_| format!("method {method:?}")))
            .transpose()?;
        let headers = route_match
            .headers
            .iter()
            .map(|HeaderMatch { name, value }| {
                let name =
                    HeaderName::from_bytes(name.as_bytes()).map_err(|_| format!("header name {name:?}"))?;
                let value =
                    HeaderValue::from_str(value).map_err(|_| format!("value {value:?} of header {name}"))?;
                Ok((name, value))
            })
            .collect::<Result<_, String>>()?;
        Ok(Condition {
            path,
            method,
            headers,
        })
    }

    fn specificity(&self) -> Specificity {
        let (exact_path, prefix_len) = match &self.path {
            PathCondition::Exact(_) => (true, 0),
            PathCondition::Prefix(prefix) => (false, prefix.len()),
        };
        Specificity {
            exact_path,
            prefix_len,
            header_count: self.headers.len(),
            has_method: self.method.is_some(),
        }
    }

    fn matches<B>(&self, request: &Request<B>) -> bool {
        let path = request.uri().path();
        let path_matches = match &self.path {
            PathCondition::Exact(exact) => path == exact,
            PathCondition::Prefix(prefix) => path
                .strip_prefix(prefix.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/')),
        };
        path_matches
            && self
                .method
                .as_ref()
                .is_none_or(|method| method == request.method())
            && self.headers.iter().all(|(name, value)| {
                request
                    .headers()
                    .get_all(name)
                    .iter()
                    .any(|candidate| candidate == value)
            })
    }
}

/// A route and one of its match conditions.
type Rule = (Arc<Route>, usize);

/// One listener's routes, flattened to (route, condition) rules and indexed by hostname,
/// so a lookup among thousands of routes only scans those that can match the host. Each
/// list is sorted most specific first.
#[derive(Debug, Default)]
pub(crate) struct RouteTable {
    exact: HashMap<String, Vec<Rule>>,
    /// By suffix (`.example.com`), longest first.
    wildcards: Vec<(String, Vec<Rule>)>,
    any_host: Vec<Rule>,
}

impl RouteTable {
    pub(crate) fn new(routes: Vec<Arc<Route>>) -> RouteTable {
        let mut table = RouteTable::default();
        let mut wildcards: HashMap<String, Vec<Rule>> = HashMap::new();
        for route in routes {
            let rules = (0..route.conditions.len()).map(|index| (route.clone(), index));
            if route.hostnames.is_empty() {
                table.any_host.extend(rules);
                continue;
            }
            let rules: Vec<Rule> = rules.collect();
            for pattern in &route.hostnames {
                let bucket = match pattern {
                    HostPattern::Exact(host) => table.exact.entry(host.clone()).or_default(),
                    HostPattern::Wildcard(suffix) => wildcards.entry(suffix.clone()).or_default(),
                };
                bucket.extend(rules.iter().cloned());
            }
        }
        table.wildcards = wildcards.into_iter().collect();
        table
            .wildcards
            .sort_by(|(a, _), (b, _)| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        let buckets = table
            .exact
            .values_mut()
            .chain(table.wildcards.iter_mut().map(|(_, rules)| rules))
            .chain(std::iter::once(&mut table.any_host));
        for rules in buckets {
            rules.sort_by(|(a, a_index), (b, b_index)| {
                let a_key = a.conditions[*a_index].specificity();
                let b_key = b.conditions[*b_index].specificity();
                b_key.cmp(&a_key).then_with(|| a.name.cmp(&b.name))
            });
        }
        table
    }

    /// The most specific matching rule: best hostname match first (exact, then the longest
    /// wildcard, then routes without hostnames), then the rule order (condition
    /// specificity, then route name).
    /// `host` is [`request_host`] of the request, computed once by the caller.
    pub(crate) fn find<B>(&self, host: Option<&str>, request: &Request<B>) -> Option<&Arc<Route>> {
        if let Some(host) = host {
            if let Some(route) = self.exact.get(host).and_then(|rules| first_match(rules, request)) {
                return Some(route);
            }
            let wildcard = self
                .wildcards
                .iter()
                .filter(|(suffix, _)| host.len() > suffix.len() && host.ends_with(suffix.as_str()))
                .find_map(|(_, rules)| first_match(rules, request));
            if wildcard.is_some() {
                return wildcard;
            }
        }
        first_match(&self.any_host, request)
    }
}

fn first_match<'a, B>(rules: &'a [Rule], request: &Request<B>) -> Option<&'a Arc<Route>> {
    rules
        .iter()
        .find(|(route, index)| route.conditions[*index].matches(request))
        .map(|(route, _)| route)
}

/// The host a request is for, lowercased and without port: from the URI authority
/// (HTTP/2 `:authority`, absolute-form HTTP/1) or else the Host header.
pub(crate) fn request_host<B>(request: &Request<B>) -> Option<String> {
    let authority = match request.uri().authority() {
        Some(authority) => authority.as_str(),
        None => request.headers().get(HOST)?.to_str().ok()?,
    };
    let host = match authority.rsplit_once(':') {
        // A colon inside brackets belongs to an IPv6 literal, not a port.
        Some((host, port)) if !port.contains(']') => host,
        _ => authority,
    };
    let host = host.trim_end_matches('.');
    (!host.is_empty()).then(|| host.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;
    use portcullis_config::parse_documents;

    fn table(yaml: &str) -> RouteTable {
        let routes = parse_documents(yaml)
            .unwrap()
            .into_iter()
            .map(|object| {
                let spec = object.spec::<RouteSpec>().unwrap();
                let route = Route::compile(
                    object.name(),
                    spec,
                    WeightedTargets::default(),
                    None,
                    Vec::new(),
                    RetryPolicy::default(),
                )
                .unwrap();
                Arc::new(route)
            })
            .collect();
        RouteTable::new(routes)
    }

    fn route(name: &str, spec: &str) -> String {
        format!(
            "apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {{name: {name}}}\nspec: {{listeners: [l], backends: [{{name: b}}], {spec}}}\n---\n"
        )
    }

    fn find(table: &RouteTable, request: Request<()>) -> Option<&str> {
        table
            .find(request_host(&request).as_deref(), &request)
            .map(|route| &*route.name)
    }

    fn get(host: &str, path: &str) -> Request<()> {
        Request::get(path).header(HOST, host).body(()).unwrap()
    }

    #[test]
    fn hosts_match_exactly_or_by_wildcard_ignoring_port_and_case() {
        let table = table(
            &(route("exact", "hostnames: [api.example.com]")
                + &route("wild", "hostnames: ['*.example.com']")),
        );
        assert_eq!(find(&table, get("API.example.com:8080", "/")), Some("exact"));
        assert_eq!(find(&table, get("a.b.example.com", "/")), Some("wild"));
        assert_eq!(find(&table, get("example.com", "/")), None);
        assert_eq!(find(&table, get("other.org", "/")), None);
        let http2 = Request::get("http://x.example.com:443/").body(()).unwrap();
        assert_eq!(find(&table, http2), Some("wild"));
        assert_eq!(find(&table, Request::get("/").body(()).unwrap()), None);
    }

    #[test]
    fn request_host_handles_ipv6_and_trailing_dot() {
        assert_eq!(request_host(&get("[::1]:80", "/")).as_deref(), Some("[::1]"));
        assert_eq!(request_host(&get("[::1]", "/")).as_deref(), Some("[::1]"));
        assert_eq!(
            request_host(&get("Example.com.", "/")).as_deref(),
            Some("example.com")
        );
    }

    #[test]
    fn prefix_matches_whole_segments() {
        let api = table(&route("api", "matches: [{path: {prefix: /api/}}]"));
        assert_eq!(find(&api, get("h", "/api")), Some("api"));
        assert_eq!(find(&api, get("h", "/api/v1?x=1")), Some("api"));
        assert_eq!(find(&api, get("h", "/apix")), None);
        let root = table(&route("root", "matches: [{path: {prefix: /}}]"));
        assert_eq!(find(&root, get("h", "/anything")), Some("root"));
    }

    #[test]
    fn precedence_exact_then_longest_prefix_then_headers_then_method_then_name() {
        let table = table(
            &(route("a-catchall", "matches: [{path: {prefix: /}}]")
                + &route("b-prefix", "matches: [{path: {prefix: /v1}}]")
                + &route("c-longer", "matches: [{path: {prefix: /v1/chat}}]")
                + &route("d-exact", "matches: [{path: {exact: /v1/chat/completions}}]")
                + &route(
                    "e-header",
                    "matches: [{path: {prefix: /v1}, headers: [{name: X-Tier, value: gold}]}]",
                )
                + &route("f-method", "matches: [{path: {prefix: /v1}, method: POST}]")
                + &route("g-tie", "matches: [{path: {prefix: /v1}}]")),
        );
        assert_eq!(find(&table, get("h", "/v1/chat/completions")), Some("d-exact"));
        assert_eq!(find(&table, get("h", "/v1/chat/other")), Some("c-longer"));
        let gold = Request::post("/v1/models")
            .header("x-tier", "gold")
            .body(())
            .unwrap();
        assert_eq!(find(&table, gold), Some("e-header"));
        let post = Request::post("/v1/models").body(()).unwrap();
        assert_eq!(find(&table, post), Some("f-method"));
        // b-prefix and g-tie are equally specific: the name sorting first wins.
        assert_eq!(find(&table, get("h", "/v1/models")), Some("b-prefix"));
        assert_eq!(find(&table, get("h", "/other")), Some("a-catchall"));
    }

    #[test]
    fn hostname_specificity_comes_before_path_specificity() {
        let table = table(
            &(route("a-any-host", "matches: [{path: {exact: /v1/models}}]")
                + &route("b-wildcard", "hostnames: ['*.example.com']")
                + &route("c-longer-wildcard", "hostnames: ['*.api.example.com']")
                + &route("d-exact-host", "hostnames: [api.example.com]")),
        );
        assert_eq!(
            find(&table, get("api.example.com", "/v1/models")),
            Some("d-exact-host")
        );
        assert_eq!(
            find(&table, get("x.api.example.com", "/v1/models")),
            Some("c-longer-wildcard")
        );
        assert_eq!(
            find(&table, get("www.example.com", "/v1/models")),
            Some("b-wildcard")
        );
        assert_eq!(find(&table, get("other.org", "/v1/models")), Some("a-any-host"));
        assert_eq!(find(&table, get("other.org", "/v2")), None);
    }

    #[test]
    fn any_match_entry_of_a_route_suffices() {
        let table = table(&route(
            "multi",
            "matches: [{path: {exact: /a}}, {path: {prefix: /b}, method: GET}]",
        ));
        assert_eq!(find(&table, get("h", "/a")), Some("multi"));
        assert_eq!(find(&table, get("h", "/b/c")), Some("multi"));
        assert_eq!(find(&table, Request::delete("/b").body(()).unwrap()), None);
    }
}
