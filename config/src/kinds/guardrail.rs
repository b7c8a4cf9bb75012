use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::backend::check_endpoint;
use crate::error::{Checker, FieldError};
use crate::kind::{KindInfo, KindSpec};
use crate::reference::{target_refs, Reference, TargetRef};
use crate::set::{ConfigSet, Scope};
use crate::{HumanDuration, InferencePoolSpec, McpBackendSpec};

/// A check the proxy makes on the messages of the traffic it is attached to, by an external
/// checking service (`service`: the gRPC contract `portcullis.guardrail.v1.Guardrail`) or by
/// the built-in pattern guard (`builtin`). A check allows, denies with a reason, or mutates
/// (replaces the checked payload). When no answer can be had in time (every replica down,
/// timed out, or answering garbage; a payload too large for the built-in guard), the
/// `failureMode` decides: `FailClosed` (the default) refuses with an error distinct from a
/// denial, `FailOpen` lets the message pass.
///
/// Attached to an McpBackend (or one of its servers, with `sectionName`) for the `Mcp*`
/// phases, or to an InferencePool for the `Llm*` phases. A phase the target's traffic never
/// has is refused at apply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GuardrailSpec {
    pub target_refs: Vec<TargetRef>,
    pub phases: Vec<GuardrailPhase>,
    /// MCP phases: the methods checked, among `tools/call`, `prompts/get` and
    /// `resources/read`. Default: all three.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub methods: Vec<String>,
    /// MCP phases: the items checked, by their own name on their server (a tool or prompt
    /// name, a resource URI); `*` matches any run of characters. Default: every item.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub names: Vec<String>,
    #[serde(default, skip_serializing_if = "GuardrailFailureMode::is_fail_closed")]
    pub failure_mode: GuardrailFailureMode,
    /// Longest wait for one replica's verdict; a call that fails or times out is tried once
    /// more on another replica. Default 1 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<HumanDuration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<GuardrailService>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub builtin: Option<BuiltinGuard>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum GuardrailPhase {
    McpRequest,
    McpResponse,
    LlmRequest,
    LlmResponse,
    A2aMessage,
}

impl GuardrailPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            GuardrailPhase::McpRequest => "McpRequest",
            GuardrailPhase::McpResponse => "McpResponse",
            GuardrailPhase::LlmRequest => "LlmRequest",
            GuardrailPhase::LlmResponse => "LlmResponse",
            GuardrailPhase::A2aMessage => "A2aMessage",
        }
    }

    fn is_mcp(self) -> bool {
        matches!(self, GuardrailPhase::McpRequest | GuardrailPhase::McpResponse)
    }

    fn is_llm(self) -> bool {
        matches!(self, GuardrailPhase::LlmRequest | GuardrailPhase::LlmResponse)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum GuardrailFailureMode {
    #[default]
    FailClosed,
    FailOpen,
}

impl GuardrailFailureMode {
    fn is_fail_closed(&self) -> bool {
        *self == GuardrailFailureMode::FailClosed
    }
}

/// Replicas of an external checking service (gRPC over plain HTTP/2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GuardrailService {
    /// `host:port` of each replica. Each is health-checked with the gRPC health protocol and
    /// checks are spread over the healthy ones.
    pub replicas: Vec<String>,
    /// When set, a check not answered within this delay is also sent to a second replica,
    /// and the first verdict wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hedge_after: Option<HumanDuration>,
    /// How often each replica's health is asked. Default 1 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_interval: Option<HumanDuration>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub circuit_breaker: Option<CircuitBreakerSpec>,
    /// The caller's request headers sent with each check (an identity a trusted front sets,
    /// say); none by default, so nothing the client sent reaches a checker unasked. Headers
    /// that carry credentials are refused ([`is_credential_header`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub caller_headers: Vec<String>,
}

/// Whether a request header, by its (lowercase) name, usually carries a credential or a
/// session (`x-api-key`, `cf-access-jwt-assertion`, `mcp-session-id`, …): such headers
/// cannot be listed for a checker. By name only, so it errs on the side of refusing
/// (`x-idempotency-key` too).
pub fn is_credential_header(name: &str) -> bool {
    // `dpop`: a signed proof of possession (RFC 9449); `x-registry-auth`: base64 credentials.
    const NAMES: &[&str] = &["cookie", "dpop", "x-registry-auth"];
    const PARTS: &[&str] = &[
        "token",
        "secret",
        "password",
        "passwd",
        "key",
        "credential",
        "session",
        "signature",
        "jwt",
        "assertion",
        "authorization",
        "authentication",
        "oidc",
    ];
    NAMES.contains(&name) || PARTS.iter().any(|part| name.contains(part))
}

/// A replica that fails this many checks in a row is taken out for `openFor`, then one
/// check probes it: success puts it back, failure takes it out again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CircuitBreakerSpec {
    /// Default 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consecutive_failures: Option<u32>,
    /// Default 5 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_for: Option<HumanDuration>,
}

/// Regular expressions (Rust `regex` syntax, linear time) over every string of the checked
/// payload: tool arguments and results, prompt messages, completions. A `deny` match denies
/// with its reason; `redact` replaces matches (a mutation). Deny rules are tried first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct BuiltinGuard {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<DenyPattern>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub redact: Vec<RedactPattern>,
    /// A payload larger than this cannot be checked: the failure mode applies. Default 1 MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DenyPattern {
    pub pattern: String,
    /// Shown to the client. Default: says which pattern matched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RedactPattern {
    pub pattern: String,
    /// Default `[REDACTED]`. Taken literally (no `$1` expansion).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replacement: Option<String>,
}

pub const DEFAULT_GUARDRAIL_TIMEOUT: Duration = Duration::from_secs(1);
pub const DEFAULT_HEALTH_INTERVAL: Duration = Duration::from_secs(1);
pub const DEFAULT_BREAKER_FAILURES: u32 = 3;
pub const DEFAULT_BREAKER_OPEN_FOR: Duration = Duration::from_secs(5);
pub const DEFAULT_BUILTIN_MAX_BYTES: u64 = 1 << 20;
/// The MCP methods a guardrail can check: those that use an item, and `completion/complete`,
/// which sends a server the argument values a client has typed for one (its request only).
pub const GUARDED_MCP_METHODS: &[&str] = &["tools/call", "prompts/get", "resources/read", COMPLETION];
/// Checked in the McpRequest phase only: its suggestions are not a result a guard sees.
pub const COMPLETION: &str = "completion/complete";
const MAX_REPLICAS: usize = 16;
const MAX_TIMEOUT: Duration = Duration::from_secs(60);
const MAX_PATTERNS: usize = 256;

const TARGET_KINDS: &[&str] = &["McpBackend", "InferencePool"];

impl GuardrailSpec {
    pub fn timeout(&self) -> Duration {
        self.timeout.map_or(DEFAULT_GUARDRAIL_TIMEOUT, |timeout| timeout.0)
    }

    /// Whether this guardrail checks `phase` on `server` of the McpBackend `backend`.
    pub fn applies_to_mcp(&self, phase: GuardrailPhase, backend: &str, server: &str) -> bool {
        self.phases.contains(&phase)
            && self.target_refs.iter().any(|target| {
                target.kind == McpBackendSpec::INFO.name
                    && target.name == backend
                    && target.section_name.as_deref().is_none_or(|section| section == server)
            })
    }

    /// Whether this guardrail checks `phase` on the InferencePool `pool`.
    pub fn applies_to_pool(&self, phase: GuardrailPhase, pool: &str) -> bool {
        self.phases.contains(&phase)
            && self
                .target_refs
                .iter()
                .any(|target| target.kind == InferencePoolSpec::INFO.name && target.name == pool)
    }

    /// Whether an MCP request with `method` on the item `name` is checked in `phase`.
    pub fn selects(&self, phase: GuardrailPhase, method: &str, name: &str) -> bool {
        let method_selected = if phase == GuardrailPhase::McpResponse && method == COMPLETION {
            false
        } else if self.methods.is_empty() {
            GUARDED_MCP_METHODS.contains(&method)
        } else {
            self.methods.iter().any(|selected| selected == method)
        };
        method_selected
            && (self.names.is_empty() || self.names.iter().any(|pattern| glob_matches(pattern, name)))
    }
}

impl CircuitBreakerSpec {
    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures.unwrap_or(DEFAULT_BREAKER_FAILURES)
    }

    pub fn open_for(&self) -> Duration {
        self.open_for.map_or(DEFAULT_BREAKER_OPEN_FOR, |open_for| open_for.0)
    }
}

/// `*` matches any run of characters (also none); everything else matches itself.
pub fn glob_matches(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.ends_with(last)
}

impl KindSpec for GuardrailSpec {
    const INFO: &'static KindInfo = &KindInfo::of::<GuardrailSpec>("Guardrail", "guardrails", &["gr"]);

    fn check(&self, checker: &mut Checker<'_>) {
        crate::reference::check_target_refs(checker, &self.target_refs, true);
        if self.phases.is_empty() {
            checker.fail("spec.phases", "at least one phase is required");
        }
        if let Some(index) = (1..self.phases.len()).find(|&i| self.phases[..i].contains(&self.phases[i])) {
            checker.fail(format!("spec.phases[{index}]"), "listed twice");
        }
        if let Some(index) = self.phases.iter().position(|phase| *phase == GuardrailPhase::A2aMessage) {
            checker.fail(
                format!("spec.phases[{index}]"),
                "no target carries A2A traffic yet, so an A2aMessage check would never run",
            );
        }
        for (index, method) in self.methods.iter().enumerate() {
            if !GUARDED_MCP_METHODS.contains(&method.as_str()) {
                checker.fail(
                    format!("spec.methods[{index}]"),
                    format!(
                        "{method:?} names no item; a guardrail checks {}",
                        GUARDED_MCP_METHODS.join(", ")
                    ),
                );
            } else if method == COMPLETION && self.phases.contains(&GuardrailPhase::McpResponse) {
                checker.fail(
                    format!("spec.methods[{index}]"),
                    "completion/complete is checked in the McpRequest phase only (the values \
                     a client typed), never its suggestions: give it a Guardrail of its own \
                     without McpResponse",
                );
            }
        }
        for (index, name) in self.names.iter().enumerate() {
            if name.is_empty() {
                checker.fail(format!("spec.names[{index}]"), "must not be empty");
            }
        }
        if self.timeout.is_some_and(|timeout| timeout.0.is_zero() || timeout.0 > MAX_TIMEOUT) {
            checker.fail("spec.timeout", "must be above 0 and at most 60s");
        }
        match (&self.service, &self.builtin) {
            (Some(service), None) => service.check(checker),
            (None, Some(builtin)) => builtin.check(checker),
            _ => checker.fail("spec", "give exactly one of service (a checking service) or builtin"),
        }
    }

    fn references(&self) -> Vec<Reference> {
        target_refs(&self.target_refs, TARGET_KINDS)
    }

    fn retain_attachments(&mut self, keep: &dyn Fn(&crate::ObjectKey) -> bool) {
        crate::reference::retain_targets(&mut self.target_refs, keep);
    }

    /// Every phase must be one its targets' traffic has, so no check is accepted and idle.
    fn check_set(set: &ConfigSet, _scope: Scope, errors: &mut Vec<FieldError>) {
        for (metadata, spec) in set.specs::<GuardrailSpec>() {
            let object = format!("{}/{}", GuardrailSpec::INFO.name, metadata.name);
            for (index, target) in spec.target_refs.iter().enumerate() {
                let field = format!("spec.targetRefs[{index}]");
                if target.kind == McpBackendSpec::INFO.name {
                    // A missing McpBackend is reported by the reference check.
                    if let (Some(backend), Some(section)) =
                        (set.spec::<McpBackendSpec>(&target.name), &target.section_name)
                    {
                        if backend.server(section).is_none() {
                            errors.push(FieldError::new(
                                &object,
                                format!("{field}.sectionName"),
                                format!("McpBackend/{} has no server {section:?}", target.name),
                            ));
                        }
                    }
                    if let Some(phase) = spec.phases.iter().find(|phase| phase.is_llm()) {
                        errors.push(FieldError::new(
                            &object,
                            "spec.phases",
                            format!(
                                "{} checks LLM traffic, which McpBackend/{} never carries \
                                 (attach it to an InferencePool)",
                                phase.as_str(),
                                target.name
                            ),
                        ));
                    }
                } else if target.kind == InferencePoolSpec::INFO.name {
                    if target.section_name.is_some() {
                        errors.push(FieldError::new(
                            &object,
                            format!("{field}.sectionName"),
                            "an InferencePool has no sections",
                        ));
                    }
                    if let Some(phase) = spec.phases.iter().find(|phase| phase.is_mcp()) {
                        errors.push(FieldError::new(
                            &object,
                            "spec.phases",
                            format!(
                                "{} checks MCP traffic, which InferencePool/{} never carries \
                                 (attach it to an McpBackend)",
                                phase.as_str(),
                                target.name
                            ),
                        ));
                    }
                    if !spec.methods.is_empty() || !spec.names.is_empty() {
                        errors.push(FieldError::new(
                            &object,
                            if spec.methods.is_empty() { "spec.names" } else { "spec.methods" },
                            format!(
                                "methods and names select MCP items; InferencePool/{} carries LLM traffic",
                                target.name
                            ),
                        ));
                    }
                }
            }
        }
    }
}

impl GuardrailService {
    fn check(&self, checker: &mut Checker<'_>) {
        if self.replicas.is_empty() {
            checker.fail("spec.service.replicas", "at least one replica is required");
        }
        if self.replicas.len() > MAX_REPLICAS {
            checker.fail("spec.service.replicas", format!("at most {MAX_REPLICAS} replicas"));
        }
        for (index, replica) in self.replicas.iter().enumerate() {
            let field = format!("spec.service.replicas[{index}]");
            if let Err(problem) = check_endpoint(replica) {
                checker.fail(&field, format!("{replica:?}: {problem}"));
            } else if self.replicas[..index].contains(replica) {
                checker.fail(&field, format!("{replica:?} is listed twice"));
            }
        }
        if self.hedge_after.is_some_and(|delay| delay.0.is_zero()) {
            checker.fail("spec.service.hedgeAfter", "must be above 0 (leave it out for no hedging)");
        }
        if self.health_interval.is_some_and(|interval| interval.0 < Duration::from_millis(100)) {
            checker.fail("spec.service.healthInterval", "must be at least 100ms");
        }
        for (index, name) in self.caller_headers.iter().enumerate() {
            let field = format!("spec.service.callerHeaders[{index}]");
            match http::HeaderName::from_bytes(name.as_bytes()) {
                Err(_) => checker.fail(&field, format!("invalid header name {name:?}")),
                Ok(header) if is_credential_header(header.as_str()) => checker.fail(
                    &field,
                    format!("{name:?} carries credentials, which are never sent to a checker (judged by the name)"),
                ),
                Ok(header)
                    if self.caller_headers[..index]
                        .iter()
                        .any(|earlier| earlier.eq_ignore_ascii_case(header.as_str())) =>
                {
                    checker.fail(&field, format!("{name:?} is listed twice"))
                }
                Ok(_) => {}
            }
        }
        if let Some(breaker) = &self.circuit_breaker {
            if breaker.consecutive_failures == Some(0) {
                checker.fail("spec.service.circuitBreaker.consecutiveFailures", "must be at least 1");
            }
            if breaker.open_for.is_some_and(|open_for| open_for.0.is_zero()) {
                checker.fail("spec.service.circuitBreaker.openFor", "must be above 0");
            }
        }
    }
}

impl BuiltinGuard {
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes.unwrap_or(DEFAULT_BUILTIN_MAX_BYTES)
    }

    fn check(&self, checker: &mut Checker<'_>) {
        if self.deny.is_empty() && self.redact.is_empty() {
            checker.fail("spec.builtin", "checks nothing: give deny or redact patterns");
        }
        if self.deny.len() + self.redact.len() > MAX_PATTERNS {
            checker.fail("spec.builtin", format!("at most {MAX_PATTERNS} patterns"));
        }
        if self.max_bytes == Some(0) {
            checker.fail("spec.builtin.maxBytes", "must be at least 1");
        }
        let patterns = self
            .deny
            .iter()
            .map(|rule| ("deny", &rule.pattern))
            .enumerate()
            .chain(self.redact.iter().map(|rule| ("redact", &rule.pattern)).enumerate());
        for (index, (list, pattern)) in patterns {
            if let Err(problem) = crate::guard_patterns::compile_pattern(pattern) {
                checker.fail(format!("spec.builtin.{list}[{index}].pattern"), problem);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_documents;

    const BASE: &str = "\
apiVersion: portcullis.dev/v1alpha1
kind: McpBackend
metadata: {name: tools}
spec: {servers: [{name: math, url: 'http://127.0.0.1:9000/mcp'}]}
---
apiVersion: portcullis.dev/v1alpha1
kind: InferencePool
metadata: {name: qwen}
spec: {endpoints: ['127.0.0.1:8000'], models: [{name: m}]}
";

    /// Applies a Guardrail with `spec` to the base config: the error, or `None`.
    fn refusal(spec: &str) -> Option<String> {
        let base = ConfigSet::from_objects(parse_documents(BASE).unwrap()).unwrap();
        let guardrail = format!(
            "apiVersion: portcullis.dev/v1alpha1\nkind: Guardrail\nmetadata: {{name: g}}\nspec: {spec}"
        );
        match parse_documents(&guardrail) {
            Err(error) => Some(error.to_string()),
            Ok(objects) => base.apply(objects).err().map(|error| error.to_string()),
        }
    }

    #[test]
    fn phases_a_target_never_carries_are_refused_with_the_reason() {
        let service = "service: {replicas: ['127.0.0.1:9100']}";
        let mcp = "targetRefs: [{kind: McpBackend, name: tools}]";
        let pool = "targetRefs: [{kind: InferencePool, name: qwen}]";
        assert_eq!(refusal(&format!("{{{mcp}, phases: [McpRequest, McpResponse], {service}}}")), None);
        assert_eq!(refusal(&format!("{{{pool}, phases: [LlmRequest, LlmResponse], {service}}}")), None);
        assert_eq!(
            refusal(&format!("{{{mcp}, phases: [McpRequest], methods: [completion/complete], {service}}}")),
            None
        );
        assert_eq!(
            refusal(&format!("{{{mcp}, phases: [McpRequest], service: {{replicas: ['127.0.0.1:9100'], callerHeaders: [X-Authenticated-User, user-agent]}}}}")),
            None
        );
        for (spec, expected) in [
            (
                format!("{{{mcp}, phases: [LlmRequest], {service}}}"),
                "spec.phases: LlmRequest checks LLM traffic, which McpBackend/tools never carries",
            ),
            (
                format!("{{{pool}, phases: [McpRequest], {service}}}"),
                "spec.phases: McpRequest checks MCP traffic, which InferencePool/qwen never carries",
            ),
            (
                format!("{{{pool}, phases: [LlmRequest], names: [get-sum], {service}}}"),
                "spec.names: methods and names select MCP items",
            ),
            (
                format!("{{{mcp}, phases: [A2aMessage], {service}}}"),
                "spec.phases[0]: no target carries A2A traffic yet",
            ),
            (
                format!("{{{mcp}, phases: [LlmResponse], {service}}}"),
                "spec.phases: LlmResponse checks LLM traffic, which McpBackend/tools never carries",
            ),
            (
                format!("{{targetRefs: [{{kind: McpBackend, name: tools, sectionName: web}}], phases: [McpRequest], {service}}}"),
                "spec.targetRefs[0].sectionName: McpBackend/tools has no server \"web\"",
            ),
            (
                format!("{{targetRefs: [{{kind: Route, name: r}}], phases: [McpRequest], {service}}}"),
                "kind \"Route\" cannot be referenced here",
            ),
            (
                format!("{{{mcp}, phases: [McpRequest], methods: [tools/list], {service}}}"),
                "spec.methods[0]: \"tools/list\" names no item",
            ),
            (
                format!("{{{mcp}, phases: [McpRequest, McpResponse], methods: [tools/call, completion/complete], {service}}}"),
                "spec.methods[1]: completion/complete is checked in the McpRequest phase only",
            ),
            (
                format!("{{{mcp}, phases: [McpRequest]}}"),
                "spec: give exactly one of service (a checking service) or builtin",
            ),
            (
                format!("{{{mcp}, phases: [McpRequest], service: {{replicas: ['127.0.0.1:9100'], callerHeaders: [x-user, X-Api-Key]}}}}"),
                "spec.service.callerHeaders[1]: \"X-Api-Key\" carries credentials, which are never sent to a checker",
            ),
            (
                format!("{{{mcp}, phases: [McpRequest], service: {{replicas: ['127.0.0.1:9100'], callerHeaders: [authorization]}}}}"),
                "spec.service.callerHeaders[0]: \"authorization\" carries credentials",
            ),
            (
                format!("{{{mcp}, phases: [McpRequest], service: {{replicas: ['127.0.0.1:9100'], callerHeaders: [cf-access-jwt-assertion, ocp-apim-subscription-key]}}}}"),
                "spec.service.callerHeaders[0]: \"cf-access-jwt-assertion\" carries credentials",
            ),
            (
                format!("{{{mcp}, phases: [McpRequest], service: {{replicas: ['127.0.0.1:9100'], callerHeaders: [x-user, x-amzn-oidc-data]}}}}"),
                "spec.service.callerHeaders[1]: \"x-amzn-oidc-data\" carries credentials",
            ),
            (
                format!("{{{mcp}, phases: [McpRequest], service: {{replicas: ['127.0.0.1:9100'], callerHeaders: [x-user, X-User]}}}}"),
                "spec.service.callerHeaders[1]: \"X-User\" is listed twice",
            ),
            (
                format!("{{{mcp}, phases: [McpRequest], service: {{replicas: ['127.0.0.1:9100'], callerHeaders: ['x user']}}}}"),
                "spec.service.callerHeaders[0]: invalid header name",
            ),
            (
                format!("{{{mcp}, phases: [McpRequest], service: {{replicas: ['127.0.0.1:9100', '127.0.0.1:9100']}}}}"),
                "spec.service.replicas[1]: \"127.0.0.1:9100\" is listed twice",
            ),
            (
                format!("{{{mcp}, phases: [McpRequest], builtin: {{deny: [{{pattern: '('}}]}}}}"),
                "spec.builtin.deny[0].pattern: invalid regular expression",
            ),
        ] {
            let error = refusal(&spec).unwrap_or_else(|| panic!("accepted: {spec}"));
            assert!(error.contains(expected), "{spec}\n  gave: {error}\n  expected: {expected}");
        }
    }

    #[test]
    fn globs_match_runs_of_characters() {
        for (pattern, text, expected) in [
            ("get-sum", "get-sum", true),
            ("get-sum", "get-sums", false),
            ("get-*", "get-sum", true),
            ("*", "", true),
            ("*-sum", "get-sum", true),
            ("g*t*m", "get-sum", true),
            ("g*x*m", "get-sum", false),
            ("a*a", "a", false),
            ("file:///*", "file:///notes", true),
        ] {
            assert_eq!(glob_matches(pattern, text), expected, "{pattern} vs {text}");
        }
    }
}
