use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Checker, FieldError};
use crate::kind::{KindInfo, KindSpec};
use crate::set::ConfigSet;
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
    /// How the control plane collects the pods' signals.
    #[serde(default, skip_serializing_if = "SignalsSpec::is_default")]
    pub signals: SignalsSpec,
    /// What the picker does when no pod has fresh signals.
    #[serde(default, skip_serializing_if = "FailureMode::is_default")]
    pub failure_mode: FailureMode,
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
    /// their signals).
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
        if self.picker.strategy != Strategy::Scored && self.picker.weights.is_some() {
            checker.fail(
                "spec.picker.weights",
                "weights apply to the Scored strategy only; RoundRobin and LeastRequest ignore them",
            );
        }
    }

    fn check_set(set: &ConfigSet, errors: &mut Vec<FieldError>) {
        // A route sends each request to the pool serving its model, so two pools of one
        // route must not both answer to a name.
        for (metadata, route) in set.specs::<RouteSpec>() {
            let mut owner: HashMap<&str, &str> = HashMap::new();
            for (index, backend) in route.backends.iter().enumerate() {
                if backend.kind != Self::INFO.name {
                    continue;
                }
                let Some(pool) = set.spec::<InferencePoolSpec>(&backend.name) else {
                    continue;
                };
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
            if staleness.0.is_zero() {
                checker.fail("spec.picker.staleness", "must be above 0");
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
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], picker: {strategy: LeastRequest, weights: {queue: 1}}}", "spec.picker.weights: weights apply to the Scored strategy only"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], signals: {interval: 1ms}}", "spec.signals.interval: must be between 10ms and 10s"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], signals: {interval: 1m}}", "spec.signals.interval: must be between 10ms and 10s"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], signals: {interval: 150ms}}", "spec.picker.staleness: 200ms is less than twice spec.signals.interval (150ms)"),
            ("{endpoints: ['127.0.0.1:1'], models: [{name: m}], picker: {staleness: 60ms}}", "spec.picker.staleness: 60ms is less than twice"),
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
}
