use serde::{Deserialize, Serialize};

use crate::error::{Checker, FieldError};
use crate::kind::{KindInfo, KindSpec};
use crate::reference::{target_refs, Reference, TargetRef};
use crate::set::{ConfigSet, Scope};
use crate::{ListenerSpec, McpBackendSpec, RouteSpec};

/// Changes request headers on the way to the upstream and response headers on the way
/// back, for the Listeners and Routes it targets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HeaderPolicySpec {
    pub target_refs: Vec<TargetRef>,
    #[serde(default, skip_serializing_if = "HeaderEdits::is_empty")]
    pub request: HeaderEdits,
    #[serde(default, skip_serializing_if = "HeaderEdits::is_empty")]
    pub response: HeaderEdits,
}

/// Applied in order: remove, then set (replacing any value), then add (keeping others).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HeaderEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub set: Vec<Header>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub add: Vec<Header>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Header {
    pub name: String,
    pub value: String,
}

impl HeaderEdits {
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.add.is_empty() && self.remove.is_empty()
    }
}

/// Headers that frame the message or belong to one connection: editing them would
/// corrupt the exchange, so a policy may not.
fn protected(name: &str) -> bool {
    crate::HOP_BY_HOP_HEADERS.contains(&name) || name == "content-length" || name == "te"
}

/// Request headers the proxy writes after the policies ran (W3C trace context: its own span
/// continues the trace), so an edit would never reach the upstream.
const SET_BY_THE_PROXY: &[&str] = &["traceparent", "tracestate"];

pub const POLICY_TARGET_KINDS: &[&str] = &["Listener", "Route"];

fn check_edits(checker: &mut Checker<'_>, field: &str, edits: &HeaderEdits, request: bool) {
    let check_name = |checker: &mut Checker<'_>, field: String, name: &str| {
        match http::HeaderName::from_bytes(
        name.as_bytes(),
    ) {
        Err(_) => checker.fail(field, format!("invalid header name {name:?}")),
        Ok(header) if protected(header.as_str()) => checker.fail(
            field,
            format!("{name:?} frames the message or the connection and cannot be changed"),
        ),
        Ok(header) if request && SET_BY_THE_PROXY.contains(&header.as_str()) => checker.fail(
            field,
            format!("{name:?} is written by the proxy's tracing after policies run, so an edit would not reach the upstream"),
        ),
        Ok(_) => {}
    }
    };
    if request {
        // One Host, and a valid one: the proxy checks the client's before routing, and an
        // upstream must answer a second Host or a malformed one with 400 (RFC 9112 §3.2).
        let host = |name: &str| name.eq_ignore_ascii_case("host");
        for (index, header) in edits.add.iter().enumerate() {
            if host(&header.name) {
                checker.fail(
                    format!("{field}.add[{index}].name"),
                    "a request carries one Host: use set to replace it",
                );
            }
        }
        for (index, name) in edits.remove.iter().enumerate() {
            if host(name) {
                checker.fail(format!("{field}.remove[{index}]"), "a request needs its Host");
            }
        }
        for (index, header) in edits.set.iter().enumerate() {
            if host(&header.name) && !crate::host::is_host_with_port(&header.value) {
                checker.fail(
                    format!("{field}.set[{index}].value"),
                    format!("{:?} is not a host with an optional port", header.value),
                );
            }
        }
    }
    for (list, headers) in [("set", &edits.set), ("add", &edits.add)] {
        for (index, header) in headers.iter().enumerate() {
            let at = format!("{field}.{list}[{index}]");
            check_name(checker, format!("{at}.name"), &header.name);
            if http::HeaderValue::from_str(&header.value).is_err() {
                checker.fail(
                    format!("{at}.value"),
                    format!(
                        "invalid header value {:?}: only visible ASCII, spaces and tabs",
                        header.value
                    ),
                );
            }
        }
    }
    for (index, name) in edits.remove.iter().enumerate() {
        check_name(checker, format!("{field}.remove[{index}]"), name);
    }
}

impl KindSpec for HeaderPolicySpec {
    const INFO: &'static KindInfo =
        &KindInfo::of::<HeaderPolicySpec>("HeaderPolicy", "headerpolicies", &["hp"]);

    fn check(&self, checker: &mut Checker<'_>) {
        crate::reference::check_target_refs(checker, &self.target_refs, false);
        if self.request.is_empty() && self.response.is_empty() {
            checker.fail("spec", "changes nothing: give request or response edits");
        }
        check_edits(checker, "spec.request", &self.request, true);
        check_edits(checker, "spec.response", &self.response, false);
    }

    fn references(&self) -> Vec<Reference> {
        target_refs(&self.target_refs, POLICY_TARGET_KINDS)
    }

    fn retain_attachments(&mut self, keep: &dyn Fn(&crate::ObjectKey) -> bool) {
        crate::reference::retain_targets(&mut self.target_refs, keep);
    }

    /// Request edits cannot reach an McpBackend's servers: the gateway writes each server's
    /// request itself and passes none of the client's headers on (a client's credentials
    /// are not the server's). Refused on a Route to one, or on a Listener serving one.
    fn check_set(set: &ConfigSet, _scope: Scope, errors: &mut Vec<FieldError>) {
        let mut policies = set
            .specs::<HeaderPolicySpec>()
            .filter(|(_, spec)| !spec.request.is_empty())
            .peekable();
        if policies.peek().is_none() {
            return;
        }
        let mcp_routes: Vec<(&str, &RouteSpec)> = set
            .specs::<RouteSpec>()
            .filter(|(_, route)| {
                route
                    .backends
                    .iter()
                    .any(|backend| backend.kind == McpBackendSpec::INFO.name)
            })
            .map(|(metadata, route)| (metadata.name.as_str(), route))
            .collect();
        for (metadata, spec) in policies {
            for (index, target) in spec.target_refs.iter().enumerate() {
                let reached = mcp_routes.iter().find(|(name, route)| {
                    (target.kind == RouteSpec::INFO.name && target.name == *name)
                        || (target.kind == ListenerSpec::INFO.name && route.listeners.contains(&target.name))
                });
                if let Some((route, _)) = reached {
                    errors.push(FieldError::new(
                        format!("{}/{}", HeaderPolicySpec::INFO.name, metadata.name),
                        format!("spec.targetRefs[{index}]"),
                        format!(
                            "request edits would not reach the servers Route/{route} sends to: an \
                             McpBackend writes its servers' requests itself (attach request edits \
                             to other routes; response edits apply)"
                        ),
                    ));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{parse_documents, ConfigSet};

    const BASE: &str = "apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {name: web}\nspec: {port: 8080}\n---\napiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {name: api}\nspec: {endpoints: ['127.0.0.1:9000']}\n---\napiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {name: api}\nspec: {listeners: [web], backends: [{name: api}]}\n---\n";

    const MCP_ROUTE: &str = "apiVersion: portcullis.dev/v1alpha1\nkind: McpBackend\nmetadata: {name: tools}\nspec: {servers: [{name: math, url: 'http://127.0.0.1:9001/mcp'}]}\n---\napiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {name: tools}\nspec: {listeners: [web], backends: [{kind: McpBackend, name: tools}]}\n---\n";

    /// The refusal of a HeaderPolicy with `spec` next to `more`, or `None` when accepted.
    fn refusal(more: &str, spec: &str) -> Option<String> {
        let yaml = format!(
            "{BASE}{more}apiVersion: portcullis.dev/v1alpha1\nkind: HeaderPolicy\nmetadata: {{name: edit}}\nspec: {spec}\n"
        );
        parse_documents(&yaml)
            .and_then(ConfigSet::from_objects)
            .err()
            .map(|error| error.to_string())
    }

    #[test]
    fn edits_the_proxy_could_not_carry_out_are_refused() {
        let on_api = |edits: &str| {
            refusal(
                "",
                &format!("{{targetRefs: [{{kind: Route, name: api}}], {edits}}}"),
            )
        };
        for (edits, expected) in [
            (
                "request: {add: [{name: Host, value: a.example}]}",
                "a request carries one Host",
            ),
            ("request: {remove: [host]}", "a request needs its Host"),
            (
                "request: {set: [{name: host, value: 'a b'}]}",
                "is not a host with an optional port",
            ),
            (
                "request: {set: [{name: host, value: 'u@a.example'}]}",
                "is not a host with an optional port",
            ),
            (
                "request: {set: [{name: traceparent, value: x}]}",
                "written by the proxy's tracing",
            ),
            (
                "request: {remove: [proxy-authorization]}",
                "frames the message or the connection",
            ),
            (
                "response: {set: [{name: content-length, value: '1'}]}",
                "frames the message or the connection",
            ),
        ] {
            let error = on_api(edits).unwrap_or_else(|| panic!("{edits} was accepted"));
            assert!(error.contains(expected), "{edits}: {error}");
        }
        for edits in [
            "request: {set: [{name: host, value: 'a.example:8443'}]}",
            "response: {set: [{name: traceparent, value: x}]}",
            "request: {set: [{name: x-tag, value: a}]}",
        ] {
            assert_eq!(on_api(edits), None, "{edits}");
        }
    }

    #[test]
    fn request_edits_are_refused_where_an_mcp_backend_serves() {
        let error = refusal(
            MCP_ROUTE,
            "{targetRefs: [{kind: Route, name: tools}], request: {set: [{name: authorization, value: 'Bearer t'}]}}",
        )
        .unwrap();
        assert!(
            error.contains("would not reach the servers Route/tools sends to"),
            "{error}"
        );
        let error = refusal(
            MCP_ROUTE,
            "{targetRefs: [{kind: Listener, name: web}], request: {set: [{name: x-tag, value: a}]}}",
        )
        .unwrap();
        assert!(error.contains("Route/tools"), "{error}");
        let responses_only =
            "{targetRefs: [{kind: Listener, name: web}], response: {set: [{name: x-tag, value: a}]}}";
        assert_eq!(refusal(MCP_ROUTE, responses_only), None);
        let other_route =
            "{targetRefs: [{kind: Route, name: api}], request: {set: [{name: x-tag, value: a}]}}";
        assert_eq!(refusal(MCP_ROUTE, other_route), None);
    }
}
