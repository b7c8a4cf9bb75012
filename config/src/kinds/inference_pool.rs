use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Checker, FieldError};
use crate::kind::{KindInfo, KindSpec};
use crate::set::{ConfigSet, Scope};
use crate::{HumanDuration, RouteSpec};

use super::backend::check_endpoints;

/// Model servers (vLLM pods) serving the same models, behind an endpoint picker. A Route
/// whose backends are InferencePools is an OpenAI-compatible LLM route: each request goes to
/// the pool serving the model its body names (after aliases and rewrites), and the pool's
/// picker chooses the pod. The idea and the name follow the Gateway API Inference Extension's
/// InferencePool (gateway-api-inference-extension.sigs.k8s.io).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// `host:port` of each model server. A static list; the Kubernetes operator will keep it
    /// in step with the pool's pods.
    pub endpoints: Vec<String>,
    /// Models the servers serve, by the name the servers know them by.
    pub models: Vec<ModelSpec>,
    /// Names clients may send that map to one of `models` by weight (canaries, traffic
    /// splits); the request's `model` is rewritten before it reaches the server.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rewrites: Vec<ModelRewrite>,
    #[serde(default, skip_serializing_if = "PickerSpec::is_default")]
    pub picker: PickerSpec,
    /// How the control plane collects the pods' signals (of Scored pools: no other strategy
    /// reads them).
    #[serde(default, skip_serializing_if = "SignalsSpec::is_default")]
    pub signals: SignalsSpec,
    /// What the picker does when no pod has fresh signals.
    #[serde(default, skip_serializing_if = "FailureMode::is_default")]
    pub failure_mode: FailureMode,
    /// Priority classes, load shedding and per-tenant fairness when every pod is saturated.
    /// Absent: every request is picked as it arrives, saturated or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<PrioritySpec>,
}

/// When every pod is saturated (the picker's saturation filter), requests wait in the proxy
/// instead of piling onto pods' first-come-first-served queues: the highest class first and,
/// within a class, tenants in turn, one request each. Classes with a negative value are
/// sheddable (the Inference Extension's convention): at saturation they are refused at once
/// with 429 and `Retry-After`. A request that waits longer than `maxWait`, or finds
/// `maxQueued` requests of its class or above waiting, is refused the same way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PrioritySpec {
    pub classes: Vec<PriorityClass>,
    /// The class of a request that names none (and whose route fixes none).
    pub default: String,
    /// The request header naming a class; a route's `backends[].priorityClass` overrides it.
    /// Default `x-portcullis-priority`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// The request header naming the tenant, for fairness within a class; requests without
    /// it share one anonymous tenant. Default `x-portcullis-tenant`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_header: Option<String>,
    /// Requests a proxy holds for this pool at most. Default 1024; 1 to 65,536.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queued: Option<u32>,
    /// The longest a request waits for a pod. Default 30s; 1ms to 10m.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait: Option<HumanDuration>,
    /// Sent as `Retry-After` (whole seconds, rounded up) with a 429. Default 1s; 1s to 1h.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<HumanDuration>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PriorityClass {
    pub name: String,
    /// Higher goes first; below 0 is sheddable.
    pub value: i32,
}

impl PrioritySpec {
    pub const DEFAULT_HEADER: &'static str = "x-portcullis-priority";
    pub const DEFAULT_TENANT_HEADER: &'static str = "x-portcullis-tenant";
    pub const DEFAULT_MAX_QUEUED: u32 = 1024;
    pub const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(30);
    pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

    pub fn header(&self) -> &str {
        self.header.as_deref().unwrap_or(Self::DEFAULT_HEADER)
    }

    pub fn tenant_header(&self) -> &str {
        self.tenant_header.as_deref().unwrap_or(Self::DEFAULT_TENANT_HEADER)
    }

    pub fn max_queued(&self) -> u32 {
        self.max_queued.unwrap_or(Self::DEFAULT_MAX_QUEUED)
    }

    pub fn max_wait(&self) -> Duration {
        self.max_wait.map_or(Self::DEFAULT_MAX_WAIT, |wait| wait.0)
    }

    pub fn retry_after(&self) -> Duration {
        self.retry_after.map_or(Self::DEFAULT_RETRY_AFTER, |after| after.0)
    }

    pub fn class(&self, name: &str) -> Option<&PriorityClass> {
        self.classes.iter().find(|class| class.name == name)
    }

    fn check(&self, strategy: Strategy, checker: &mut Checker<'_>) {
        if strategy != Strategy::Scored {
            checker.fail(
                "spec.priority",
                "priority classes need the Scored strategy: only it detects saturation, so \
                 with RoundRobin or LeastRequest nothing would ever wait or be shed",
            );
        }
        if self.classes.is_empty() {
            checker.fail("spec.priority.classes", "at least one class is required");
        }
        for (index, class) in self.classes.iter().enumerate() {
            let valid = !class.name.is_empty()
                && class.name.len() <= 63
                && class
                    .name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
            if !valid {
                checker.fail(
                    format!("spec.priority.classes[{index}].name"),
                    format!("{:?}: must be 1 to 63 lowercase letters, digits or '-'", class.name),
                );
            }
            if self.classes[..index].iter().any(|earlier| earlier.name == class.name) {
                checker.fail(
                    format!("spec.priority.classes[{index}].name"),
                    format!("{:?} is defined twice", class.name),
                );
            }
        }
        if self.class(&self.default).is_none() {
            checker.fail(
                "spec.priority.default",
                format!("{:?} is not one of spec.priority.classes", self.default),
            );
        }
        for (field, header) in [("header", self.header()), ("tenantHeader", self.tenant_header())] {
            if http::HeaderName::from_bytes(header.as_bytes()).is_err() {
                checker.fail(
                    format!("spec.priority.{field}"),
                    format!("invalid header name {header:?}"),
                );
            }
        }
        if self.header().eq_ignore_ascii_case(self.tenant_header()) {
            checker.fail(
                "spec.priority.tenantHeader",
                "must differ from spec.priority.header",
            );
        }
        if !(1..=65_536).contains(&self.max_queued()) {
            checker.fail("spec.priority.maxQueued", "must be between 1 and 65,536");
        }
        if !(Duration::from_millis(1)..=Duration::from_secs(600)).contains(&self.max_wait()) {
            checker.fail("spec.priority.maxWait", "must be between 1ms and 10m");
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&self.retry_after()) {
            checker.fail("spec.priority.retryAfter", "must be between 1s and 1h");
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ModelSpec {
    /// As the servers know it (vLLM's `--served-model-name`, or a LoRA adapter's name).
    pub name: String,
    /// Other names clients may use; rewritten to `name` before forwarding.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// The model is a LoRA adapter (the picker then prefers pods that have it loaded, from
    /// their signals; Scored strategy only).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lora: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ModelRewrite {
    /// The name clients send.
    pub model: String,
    pub targets: Vec<RewriteTarget>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RewriteTarget {
    /// One of the pool's `models`.
    pub model: String,
    /// Relative share; 0 sends nothing.
    pub weight: u32,
}

/// The control plane's leader reads every endpoint's vLLM `/metrics` (waiting and running
/// requests, KV-cache use, loaded LoRA adapters) once per `interval` and replicates the
/// readings to every control-plane node and, beside the config stream, to every proxy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SignalsSpec {
    /// Time between two reads of a pod. Default 50ms (the Inference Extension's refresh
    /// interval); at least 10ms, at most 10s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<HumanDuration>,
}

impl SignalsSpec {
    pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(50);

    fn is_default(&self) -> bool {
        *self == SignalsSpec::default()
    }

    pub fn interval(&self) -> Duration {
        self.interval.map_or(Self::DEFAULT_INTERVAL, |interval| interval.0)
    }
}

/// How the pool's picker chooses a pod; the defaults are the Inference Extension's.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PickerSpec {
    #[serde(default, skip_serializing_if = "Strategy::is_default")]
    pub strategy: Strategy,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<WeightsSpec>,
    /// Waiting requests at which a pod counts as saturated. Default 5.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_threshold: Option<f64>,
    /// KV-cache use (0–1) at which a pod counts as saturated. Default 0.8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_threshold: Option<f64>,
    /// Signals older than this are unknown. Default 200ms; at least twice `signals.interval`,
    /// or pods would fall stale between two reads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness: Option<HumanDuration>,
    /// Pods tried per request: the pick and the ones to try when it refuses the connection.
    /// Default 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallbacks: Option<u32>,
}

impl PickerSpec {
    pub const DEFAULT_STALENESS: Duration = Duration::from_millis(200);
    pub const MIN_STALENESS: Duration = Duration::from_millis(100);

    fn is_default(&self) -> bool {
        *self == PickerSpec::default()
    }

    pub fn staleness(&self) -> Duration {
        self.staleness.map_or(Self::DEFAULT_STALENESS, |staleness| staleness.0)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Strategy {
    /// Filters and weighted scorers over pod signals, prefix affinity and in-flight counts.
    #[default]
    Scored,
    RoundRobin,
    /// Fewest requests this proxy has in flight.
    LeastRequest,
}

impl Strategy {
    fn is_default(&self) -> bool {
        *self == Strategy::default()
    }
}

/// Scorer weights; each scorer gives 0–1 and a pod's score is the weighted sum. Unset
/// weights keep the picker's defaults (the Inference Extension's: queue 2, KV-cache 2,
/// prefix 3; LoRA 1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct WeightsSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<f64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum FailureMode {
    /// Pick on the proxy's own counts (in-flight requests, prefix affinity).
    #[default]
    FailOpen,
    /// Answer 503 with the reason.
    FailClose,
}

impl FailureMode {
    fn is_default(&self) -> bool {
        *self == FailureMode::default()
    }
}

/// Every name a client may send to a pool, and what it becomes.
pub enum ModelName<'a> {
    Served(&'a ModelSpec),
    Alias(&'a ModelSpec),
    Rewrite(&'a ModelRewrite),
}

impl InferencePoolSpec {
    /// Every name clients may send, with what it stands for.
    pub fn names(&self) -> impl Iterator<Item = (&str, ModelName<'_>)> {
        let served = self
            .models
            .iter()
            .map(|model| (model.name.as_str(), ModelName::Served(model)));
        let aliases = self.models.iter().flat_map(|model| {
            model
                .aliases
                .iter()
                .map(move |alias| (alias.as_str(), ModelName::Alias(model)))
        });
        let rewrites = self
            .rewrites
            .iter()
            .map(|rewrite| (rewrite.model.as_str(), ModelName::Rewrite(rewrite)));
        served.chain(aliases).chain(rewrites)
    }
}

impl KindSpec for InferencePoolSpec {
    const INFO: &'static KindInfo =
        &KindInfo::of::<InferencePoolSpec>("InferencePool", "inferencepools", &["ip", "pool"]);

    fn check(&self, checker: &mut Checker<'_>) {
        check_endpoints(&self.endpoints, checker);
        if self.models.is_empty() {
            checker.fail("spec.models", "at least one model is required");
        }
        let mut seen: HashMap<&str, String> = HashMap::new();
        let fields = self
            .models
            .iter()
            .enumerate()
            .flat_map(|(index, model)| {
                std::iter::once((format!("spec.models[{index}].name"), model.name.as_str())).chain(
                    model.aliases.iter().enumerate().map(move |(alias_index, alias)| {
                        (format!("spec.models[{index}].aliases[{alias_index}]"), alias.as_str())
                    }),
                )
            })
            .chain(
                self.rewrites
                    .iter()
                    .enumerate()
                    .map(|(index, rewrite)| (format!("spec.rewrites[{index}].model"), rewrite.model.as_str())),
            );
        for (field, name) in fields {
            if let Err(problem) = check_model_name(name) {
                checker.fail(field.clone(), format!("{name:?}: {problem}"));
            }
            if let Some(first) = seen.get(name) {
                checker.fail(field, format!("{name:?} is already named at {first}"));
            } else {
                seen.insert(name, field);
            }
        }
        for (index, rewrite) in self.rewrites.iter().enumerate() {
            let field = format!("spec.rewrites[{index}].targets");
            if rewrite.targets.iter().all(|target| target.weight == 0) {
                checker.fail(&field, "at least one target needs a weight above 0");
            }
            for (target_index, target) in rewrite.targets.iter().enumerate() {
                if !self.models.iter().any(|model| model.name == target.model) {
                    checker.fail(
                        format!("{field}[{target_index}].model"),
                        format!("{:?} is not one of spec.models", target.model),
                    );
                }
            }
        }
        self.picker.check(checker);
        let interval = self.signals.interval();
        if !(Duration::from_millis(10)..=Duration::from_secs(10)).contains(&interval) {
            checker.fail("spec.signals.interval", "must be between 10ms and 10s");
        } else if self.picker.staleness() < interval * 2 {
            checker.fail(
                "spec.picker.staleness",
                format!(
                    "{:?} is less than twice spec.signals.interval ({interval:?}): pods would \
                     fall stale between two reads",
                    self.picker.staleness()
                ),
            );
        }
        if let Some(priority) = &self.priority {
            priority.check(self.picker.strategy, checker);
        }
        if self.picker.strategy != Strategy::Scored {
            // What only the Scored strategy reads would be accepted and silently ignored.
            const SCORED_ONLY: &str =
                "applies to the Scored strategy only; RoundRobin and LeastRequest do not read pod signals";
            let scored_only = [
                ("spec.picker.weights", self.picker.weights.is_some()),
                ("spec.picker.queueThreshold", self.picker.queue_threshold.is_some()),
                ("spec.picker.kvCacheThreshold", self.picker.kv_cache_threshold.is_some()),
                ("spec.picker.staleness", self.picker.staleness.is_some()),
                ("spec.failureMode", self.failure_mode == FailureMode::FailClose),
                // Nothing would read the signals: such a pool's pods are not scraped.
                ("spec.signals.interval", self.signals.interval.is_some()),
            ];
            for (field, set) in scored_only {
                if set {
                    checker.fail(field, SCORED_ONLY);
                }
            }
            // LoRA affinity is a scorer, fed by the pods' signals.
            for (index, model) in self.models.iter().enumerate() {
                if model.lora {
                    checker.fail(format!("spec.models[{index}].lora"), SCORED_ONLY);
                }
            }
        }
    }

    fn check_set(set: &ConfigSet, _scope: Scope, errors: &mut Vec<FieldError>) {
        // A route sends each request to the pool serving its model, so two pools of one
        // route must not both answer to a name. Without pools, no route is concerned (and a
        // large config of plain routes skips reading them all on every write).
        if set.specs::<InferencePoolSpec>().next().is_none() {
            return;
        }
        for (metadata, route) in set.specs::<RouteSpec>() {
            let mut owner: HashMap<&str, &str> = HashMap::new();
            for (index, backend) in route.backends.iter().enumerate() {
                if backend.kind != Self::INFO.name {
                    continue;
                }
                let Some(pool) = set.spec::<InferencePoolSpec>(&backend.name) else {
                    continue;
                };
                if let Some(class) = &backend.priority_class {
                    let defined = pool
                        .priority
                        .as_ref()
                        .is_some_and(|priority| priority.class(class).is_some());
                    if !defined {
                        errors.push(FieldError::new(
                            format!("Route/{}", metadata.name),
                            format!("spec.backends[{index}].priorityClass"),
                            format!(
                                "{class:?} is not a class of InferencePool/{} (its spec.priority.classes)",
                                backend.name
                            ),
                        ));
                    }
                }
                let listed_before = route.backends[..index]
                    .iter()
                    .any(|earlier| earlier.kind == backend.kind && earlier.name == backend.name);
                if listed_before {
                    errors.push(FieldError::new(
                        format!("Route/{}", metadata.name),
                        format!("spec.backends[{index}]"),
                        format!("InferencePool/{} is listed twice", backend.name),
                    ));
                    continue;
                }
                for (name, _) in pool.names() {
                    if let Some(other) = owner.insert(name, &backend.name) {
                        if other != backend.name {
                            errors.push(FieldError::new(
                                format!("Route/{}", metadata.name),
                                format!("spec.backends[{index}]"),
                                format!(
                                    "model {name:?} is served by both InferencePool/{other} and \
                                     InferencePool/{}: a request naming it could go to either",
                                    backend.name
                                ),
                            ));
                        }
                    }
                }
            }
        }
    }
}

impl PickerSpec {
    fn check(&self, checker: &mut Checker<'_>) {
        if let Some(weights) = &self.weights {
            for (field, weight) in [
                ("queue", weights.queue),
                ("kvCache", weights.kv_cache),
                ("prefix", weights.prefix),
                ("lora", weights.lora),
            ] {
                let Some(weight) = weight else { continue };
                if !(0.0..=1000.0).contains(&weight) {
                    checker.fail(
                        format!("spec.picker.weights.{field}"),
                        format!("{weight} is outside 0–1000"),
                    );
                }
            }
        }
        if let Some(threshold) = self.queue_threshold {
            if !(threshold > 0.0 && threshold <= 1_000_000.0) {
                checker.fail("spec.picker.queueThreshold", "must be above 0 (and at most 1,000,000)");
            }
        }
        if let Some(threshold) = self.kv_cache_threshold {
            if !(threshold > 0.0 && threshold <= 1.0) {
                checker.fail("spec.picker.kvCacheThreshold", "must be above 0 and at most 1");
            }
        }
        if let Some(staleness) = self.staleness {
            if staleness.0 < Self::MIN_STALENESS {
                checker.fail(
                    "spec.picker.staleness",
                    format!(
                        "must be at least {:?}: a reading takes up to one interval plus a Raft \
                         commit and a stream message to reach a proxy, so anything shorter \
                         marks pods stale while their signals are on the way",
                        Self::MIN_STALENESS
                    ),
                );
            }
        }
        if let Some(fallbacks) = self.fallbacks {
            if !(1..=16).contains(&fallbacks) {
                checker.fail("spec.picker.fallbacks", "must be between 1 and 16");
            }
        }
    }
}

/// Model names travel in JSON bodies and in `/v1/models`; keep them printable and bounded.
fn check_model_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > 256 {
        return Err("must be 1 to 256 characters");
    }
    if name.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err("must not contain whitespace or control characters");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::{parse_documents, ConfigSet};

    const LISTENER: &str = "apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {name: gw}\nspec: {address: 127.0.0.1, port: 8080}\n";

    fn pool(name: &str, spec: &str) -> String {
        format!("---\napiVersion: portcullis.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: {name}}}\nspec: {spec}\n")
    }

    fn route(backends: &str) -> String {
        format!("---\napiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {{name: llm}}\nspec: {{listeners: [gw], backends: {backends}}}\n")
    }

    fn apply(yaml: &str) -> Result<ConfigSet, String> {
        let objects = parse_documents(yaml).map_err(|error| error.to_string())?;
        ConfigSet::default()
            .apply(objects)
            .map(|(set, _)| set)
            .map_err(|error| error.to_string())
    }

    #[test]
    fn a_pool_with_aliases_and_rewrites_applies_and_routes_reference_it() {
        let yaml = format!(
            "{LISTENER}{}{}",
            pool(
                "qwen",
                "{endpoints: ['127.0.0.1:8000'], models: [{name: Qwen/Qwen3-32B, aliases: [qwen]}, {name: sql}], \
                 rewrites: [{model: chat, targets: [{model: Qwen/Qwen3-32B, weight: 9}, {model: sql, weight: 1}]}], \
                 picker: {weights: {prefix: 5, kvCache: 1, lora: 2}, fallbacks: 2, queueThreshold: 3, staleness: 1s}, \
                 signals: {interval: 100ms}, failureMode: FailClose}"
            ),
            route("[{kind: InferencePool, name: qwen}]")
        );
        let set = apply(&yaml).unwrap();
        let spec = set.spec::<super::InferencePoolSpec>("qwen").unwrap();
        let names: Vec<&str> = spec.names().map(|(name, _)| name).collect();
        assert_eq!(names, ["Qwen/Qwen3-32B", "sql", "qwen", "chat"]);
        assert_eq!(spec.picker.weights.unwrap().queue, None, "unset weights keep the picker's defaults");
    }

    #[test]
    fn unusable_pools_are_refused_with_the_reason() {
        let cases = [
            ("{endpoints: [], models: [{name: m}]}", "spec.endpoints: at least one endpoint is required"),
            ("{endpoints: ['127.0.0.1:1'], models: []}", "spec.models: at least one model is required"),
            (
                "{endpoints: ['127.0.0.1:1'], models: [{name: m, aliases: [m]}]}",
                "spec.models[0].aliases[0]: \"m\" is already named at spec.models[0].name",
            ),
            (
                "{endpoints: ['127.0.0.1:1'], models: [{name: m}], rewrites: [{model: r, targets: [{model: nope, weight: 1}]}]}",
                "spec.rewrites[0].targets[0].model: \"nope\" is not one of spec.models",
            ),
            (
                "{endpoints: ['127.0.0.1:1'], models: [{name: m}], rewrites: [{model: r, targets: [{model: m, weight: 0}]}]}",
                "spec.rewrites[0].targets: at least one target needs a weight above 0",
            ),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: 'a b'}]}", "must not contain whitespace"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], picker: {weights: {queue: -1}}}", "spec.picker.weights.queue: -1 is outside 0–1000"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], picker: {fallbacks: 0}}", "spec.picker.fallbacks"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], picker: {strategy: LeastRequest, weights: {queue: 1}}}", "spec.picker.weights: applies to the Scored strategy only"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], picker: {strategy: RoundRobin, queueThreshold: 2}}", "spec.picker.queueThreshold: applies to the Scored strategy only"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], picker: {strategy: RoundRobin}, failureMode: FailClose}", "spec.failureMode: applies to the Scored strategy only"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], picker: {strategy: LeastRequest}, signals: {interval: 1s}}", "spec.signals.interval: applies to the Scored strategy only"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}, {name: a, lora: true}], picker: {strategy: RoundRobin}}", "spec.models[1].lora: applies to the Scored strategy only"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], picker: {staleness: 50ms}, signals: {interval: 10ms}}", "spec.picker.staleness: must be at least 100ms"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], signals: {interval: 1ms}}", "spec.signals.interval: must be between 10ms and 10s"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], signals: {interval: 1m}}", "spec.signals.interval: must be between 10ms and 10s"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], signals: {interval: 150ms}}", "spec.picker.staleness: 200ms is less than twice spec.signals.interval (150ms)"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], picker: {staleness: 150ms}, signals: {interval: 100ms}}", "spec.picker.staleness: 150ms is less than twice"),
            (
                "{endpoints: ['127.0.0.1:1'], models: [{name: m}], picker: {strategy: RoundRobin}, priority: {classes: [{name: a, value: 0}], default: a}}",
                "spec.priority: priority classes need the Scored strategy",
            ),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], priority: {classes: [], default: a}}", "spec.priority.classes: at least one class is required"),
            (
                "{endpoints: ['127.0.0.1:1'], models: [{name: m}], priority: {classes: [{name: a, value: 0}], default: b}}",
                "spec.priority.default: \"b\" is not one of spec.priority.classes",
            ),
            (
                "{endpoints: ['127.0.0.1:1'], models: [{name: m}], priority: {classes: [{name: a, value: 0}, {name: a, value: 1}], default: a}}",
                "spec.priority.classes[1].name: \"a\" is defined twice",
            ),
            (
                "{endpoints: ['127.0.0.1:1'], models: [{name: m}], priority: {classes: [{name: A, value: 0}], default: A}}",
                "spec.priority.classes[0].name: \"A\": must be 1 to 63 lowercase letters",
            ),
            (
                "{endpoints: ['127.0.0.1:1'], models: [{name: m}], priority: {classes: [{name: a, value: 0}], default: a, header: 'bad header'}}",
                "spec.priority.header: invalid header name",
            ),
            (
                "{endpoints: ['127.0.0.1:1'], models: [{name: m}], priority: {classes: [{name: a, value: 0}], default: a, header: x-t, tenantHeader: X-T}}",
                "spec.priority.tenantHeader: must differ from spec.priority.header",
            ),
            (
                "{endpoints: ['127.0.0.1:1'], models: [{name: m}], priority: {classes: [{name: a, value: 0}], default: a, maxQueued: 0, maxWait: 0s, retryAfter: 100ms}}",
                "spec.priority.maxQueued: must be between 1 and 65,536",
            ),
            (
                "{endpoints: ['127.0.0.1:1'], models: [{name: m}], priority: {classes: [{name: a, value: 0}], default: a, maxWait: 0s}}",
                "spec.priority.maxWait: must be between 1ms and 10m",
            ),
            (
                "{endpoints: ['127.0.0.1:1'], models: [{name: m}], priority: {classes: [{name: a, value: 0}], default: a, retryAfter: 100ms}}",
                "spec.priority.retryAfter: must be between 1s and 1h",
            ),
        ];
        for (spec, expected) in cases {
            let error = apply(&pool("p", spec)).unwrap_err();
            assert!(error.contains(expected), "{spec}: {error}");
        }
    }

    #[test]
    fn routes_to_pools_are_by_model_only() {
        let pools = format!(
            "{}{}{}",
            pool("a", "{endpoints: ['127.0.0.1:1'], models: [{name: m, aliases: [shared]}]}"),
            pool("b", "{endpoints: ['127.0.0.1:2'], models: [{name: shared}]}"),
            "---\napiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {name: plain}\nspec: {endpoints: ['127.0.0.1:3']}\n"
        );
        let error = apply(&format!(
            "{LISTENER}{pools}{}",
            route("[{kind: InferencePool, name: a}, {kind: InferencePool, name: b}]")
        ))
        .unwrap_err();
        assert!(
            error.contains("Route/llm: spec.backends[1]: model \"shared\" is served by both InferencePool/a and InferencePool/b"),
            "{error}"
        );
        let error = apply(&format!(
            "{LISTENER}{pools}{}",
            route("[{kind: InferencePool, name: a}, {name: plain}]")
        ))
        .unwrap_err();
        assert!(error.contains("not both"), "{error}");
        let error = apply(&format!(
            "{LISTENER}{pools}{}",
            route("[{kind: InferencePool, name: a}, {kind: InferencePool, name: a}]")
        ))
        .unwrap_err();
        assert!(error.contains("spec.backends[1]: InferencePool/a is listed twice"), "{error}");
        let error = apply(&format!(
            "{LISTENER}{pools}{}",
            route("[{kind: InferencePool, name: a, weight: 5}]")
        ))
        .unwrap_err();
        assert!(
            error.contains("spec.backends[0].weight: weights do not apply to InferencePools"),
            "{error}"
        );
    }

    #[test]
    fn a_route_fixes_a_priority_class_only_of_its_pool() {
        let prioritized = pool(
            "p",
            "{endpoints: ['127.0.0.1:1'], models: [{name: m}], \
             priority: {classes: [{name: interactive, value: 10}, {name: batch, value: -1}], default: interactive}}",
        );
        let set = apply(&format!(
            "{LISTENER}{prioritized}{}",
            route("[{kind: InferencePool, name: p, priorityClass: batch}]")
        ))
        .unwrap();
        let priority = set.spec::<super::InferencePoolSpec>("p").unwrap().priority.clone().unwrap();
        assert_eq!(priority.header(), "x-portcullis-priority");
        assert_eq!(priority.class("batch").map(|class| class.value), Some(-1));
        let error = apply(&format!(
            "{LISTENER}{prioritized}{}",
            route("[{kind: InferencePool, name: p, priorityClass: bulk}]")
        ))
        .unwrap_err();
        assert!(
            error.contains("Route/llm: spec.backends[0].priorityClass: \"bulk\" is not a class of InferencePool/p"),
            "{error}"
        );
        let plain = pool("q", "{endpoints: ['127.0.0.1:1'], models: [{name: k}]}");
        let error = apply(&format!(
            "{LISTENER}{plain}{}",
            route("[{kind: InferencePool, name: q, priorityClass: batch}]")
        ))
        .unwrap_err();
        assert!(error.contains("is not a class of InferencePool/q"), "{error}");
        let backend = "---\napiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {name: b}\nspec: {endpoints: ['127.0.0.1:3']}\n";
        let error = apply(&format!("{LISTENER}{backend}{}", route("[{name: b, priorityClass: batch}]"))).unwrap_err();
        assert!(
            error.contains("spec.backends[0].priorityClass: priority classes apply to InferencePools only"),
            "{error}"
        );
        // Taking away the class a route fixes is refused while the route names it.
        let unprioritized = parse_documents(&pool("p", "{endpoints: ['127.0.0.1:1'], models: [{name: m}]}")).unwrap();
        let error = set.apply(unprioritized).map(|_| ()).unwrap_err().to_string();
        assert!(error.contains("is not a class of InferencePool/p"), "{error}");
    }
}
