//! The proxy's Prometheus metrics (`portcullis_proxy_*`).
//!
//! The per-request path does one `Family` lookup per metric (a shared read lock and a hash of
//! the labels) and atomic adds; label sets are built by moving the record's `Arc<str>`s in and
//! back out, so not even a reference count moves. The request-duration histogram is our own
//! lock-free one: prometheus-client's takes a mutex per observation.
//!
//! Label sets that name objects (listeners, routes, targets, policies, guardrails, servers,
//! endpoints) are dropped once a config version without those objects is applied
//! ([`Metrics::prune`]): otherwise every route, pod address or replica a proxy ever served
//! would stay in its memory and on every scrape for as long as it runs.

use std::collections::HashSet;
use std::fmt;
use std::hash::Hash;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::{Registry, Unit};

use portcullis_config::{ConfigSet, McpBackendSpec};

use super::{LlmRecord, McpRecord, RequestRecord};
use crate::policy::guardrail::GuardrailRecord;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    listener: Arc<str>,
    route: Option<Arc<str>>,
    target: Option<Arc<str>>,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteTargetLabels {
    route: Option<Arc<str>>,
    target: Option<Arc<str>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: Option<Arc<str>>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UpstreamErrorLabels {
    route: Arc<str>,
    target: Arc<str>,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GuardrailLabels {
    guardrail: Arc<str>,
    phase: &'static str,
    /// `allow`, `deny`, `mutate`, `failed_open`, `failed_closed`.
    decision: &'static str,
    /// The replica that answered or last failed; `builtin`; empty when none was tried.
    replica: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GuardrailPhaseLabels {
    guardrail: Arc<str>,
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PolicyLabels {
    policy: Arc<str>,
    decision: &'static str,
}

/// An LLM exchange's pool (`InferencePool/name`), model as served, and pod. Names follow
/// OpenTelemetry's GenAI semantic conventions (`gen_ai.request.model`, `gen_ai.token.type`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GenAiLabels {
    pool: Arc<str>,
    gen_ai_request_model: Arc<str>,
    endpoint: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GenAiRequestLabels {
    pool: Arc<str>,
    gen_ai_request_model: Arc<str>,
    endpoint: Arc<str>,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct McpLabels {
    target: Arc<str>,
    mcp_method_name: Arc<str>,
    /// Empty when the request went to no single server.
    server: Arc<str>,
    /// `ok`, or the JSON-RPC error code the gateway answered with.
    outcome: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ToolDriftLabels {
    target: Arc<str>,
    server: Arc<str>,
    /// `drifted`, `unpinned` or `absent`.
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GenAiTokenLabels {
    pool: Arc<str>,
    gen_ai_request_model: Arc<str>,
    endpoint: Arc<str>,
    /// `input`, `output`, or `cached_input` (the part of the input the server had cached).
    gen_ai_token_type: &'static str,
}

/// A metric family whose label sets can be dropped. prometheus-client's `Family` can remove
/// a label set but cannot list them, so the sets created are also kept here. Lookups of an
/// existing set cost what `Family`'s do; creating one takes `created`'s lock, held across the
/// creation so that [`Pruned::retain`] never misses a set being created.
struct Pruned<S, M> {
    family: Family<S, M>,
    created: Mutex<HashSet<S>>,
}

impl<S: Clone + Hash + Eq, M: Default> Default for Pruned<S, M> {
    fn default() -> Self {
        Pruned {
            family: Family::default(),
            created: Mutex::default(),
        }
    }
}

impl<S: Clone + Hash + Eq, M: Default> Pruned<S, M> {
    fn get_or_create(&self, labels: &S) -> impl Deref<Target = M> + '_ {
        if let Some(metric) = self.family.get(labels) {
            return metric;
        }
        let mut created = self.created.lock().unwrap_or_else(PoisonError::into_inner);
        let metric = self.family.get_or_create(labels);
        created.insert(labels.clone());
        metric
    }

    /// Keeps the label sets for which `keep` holds, removes the others.
    fn retain(&self, keep: impl Fn(&S) -> bool) {
        let mut created = self.created.lock().unwrap_or_else(PoisonError::into_inner);
        created.retain(|labels| {
            let kept = keep(labels);
            if !kept {
                self.family.remove(labels);
            }
            kept
        });
    }
}

/// Every label value that names something of the config version in force: each object as
/// `name` and as `Kind/name`, the McpBackends' servers and every upstream endpoint
/// (`host:port`). The empty value (no route, no server, ...) always is. A guardrail's series
/// go with the guardrail, not with a replica: replicas change with the checker's deployment,
/// and its decision counts should not.
pub(crate) struct InForce {
    names: HashSet<String>,
}

impl InForce {
    pub(crate) fn new<'a>(config: &ConfigSet, endpoints: impl IntoIterator<Item = &'a str>) -> InForce {
        let mut names: HashSet<String> = endpoints.into_iter().map(str::to_owned).collect();
        names.extend(["", super::REMOVED_LISTENER].map(str::to_owned));
        for object in config.objects() {
            names.insert(object.name().to_owned());
            names.insert(object.key().to_string());
            if let Some(spec) = object.spec::<McpBackendSpec>() {
                names.extend(spec.servers.iter().map(|server| server.name.clone()));
            }
        }
        InForce { names }
    }

    fn has(&self, name: &str) -> bool {
        self.names.contains(name)
    }

    fn has_opt(&self, name: &Option<Arc<str>>) -> bool {
        name.as_deref().is_none_or(|name| self.has(name))
    }
}

/// Every metric of one proxy, and the registry that exposes them.
pub(super) struct Metrics {
    registry: Registry,
    requests: Pruned<RequestLabels, Counter>,
    duration: Pruned<RouteTargetLabels, DurationHistogram>,
    request_bytes: Pruned<RouteLabels, Counter>,
    response_bytes: Pruned<RouteLabels, Counter>,
    upstream_errors: Pruned<UpstreamErrorLabels, Counter>,
    policy_decisions: Pruned<PolicyLabels, Counter>,
    gen_ai_requests: Pruned<GenAiRequestLabels, Counter>,
    mcp_requests: Pruned<McpLabels, Counter>,
    mcp_tool_drift: Pruned<ToolDriftLabels, Gauge>,
    guardrail_checks: Pruned<GuardrailLabels, Counter>,
    guardrail_check_duration: Pruned<GuardrailPhaseLabels, DurationHistogram>,
    gen_ai_tokens: Pruned<GenAiTokenLabels, Counter>,
    gen_ai_time_to_first_token: Pruned<GenAiLabels, DurationHistogram>,
    gen_ai_time_per_output_token: Pruned<GenAiLabels, DurationHistogram>,
    config_version: Gauge,
    config_last_apply_ok: Gauge,
    config_last_apply_version: Gauge,
    pub(super) access_log_dropped: Counter,
    pub(super) access_log_write_errors: Counter,
}

impl Metrics {
    pub(super) fn new() -> Metrics {
        let mut registry = Registry::with_prefix("portcullis_proxy");
        let metrics = Metrics {
            requests: Pruned::default(),
            duration: Pruned::default(),
            request_bytes: Pruned::default(),
            response_bytes: Pruned::default(),
            upstream_errors: Pruned::default(),
            policy_decisions: Pruned::default(),
            gen_ai_requests: Pruned::default(),
            mcp_requests: Pruned::default(),
            mcp_tool_drift: Pruned::default(),
            guardrail_checks: Pruned::default(),
            guardrail_check_duration: Pruned::default(),
            gen_ai_tokens: Pruned::default(),
            gen_ai_time_to_first_token: Pruned::default(),
            gen_ai_time_per_output_token: Pruned::default(),
            config_version: Gauge::default(),
            config_last_apply_ok: Gauge::default(),
            config_last_apply_version: Gauge::default(),
            access_log_dropped: Counter::default(),
            access_log_write_errors: Counter::default(),
            registry: Registry::default(),
        };
        // prometheus-client appends `_total` to counters and the unit to the name, and ends
        // each help text with a period.
        registry.register(
            "requests",
            "Requests answered, by listener, route and target (empty when none matched) and \
             response status",
            metrics.requests.family.clone(),
        );
        registry.register_with_unit(
            "request_duration",
            "Time from the request's arrival to the end of its response body, by route and \
             target",
            Unit::Seconds,
            metrics.duration.family.clone(),
        );
        registry.register(
            "request_bytes",
            "Request body bytes received from clients, by route",
            metrics.request_bytes.family.clone(),
        );
        registry.register(
            "response_bytes",
            "Response body bytes sent to clients, by route",
            metrics.response_bytes.family.clone(),
        );
        registry.register(
            "upstream_errors",
            "Failed upstream attempts, by route, target and kind (connect, timeout, exchange)",
            metrics.upstream_errors.family.clone(),
        );
        registry.register(
            "policy_decisions",
            "Policy decisions taken on requests, by policy and decision",
            metrics.policy_decisions.family.clone(),
        );
        registry.register(
            "mcp_requests",
            "MCP requests through McpBackends, by target, JSON-RPC method, server and outcome \
             (ok or the gateway's JSON-RPC error code)",
            metrics.mcp_requests.family.clone(),
        );
        registry.register(
            "mcp_tool_drift",
            "Tools of McpBackend servers covered by McpToolPins that do not match them, by target, \
             server and state (drifted: another definition than the pinned one; unpinned: not \
             pinned; absent: pinned but no longer listed), as last seen",
            metrics.mcp_tool_drift.family.clone(),
        );
        registry.register(
            "guardrail_checks",
            "Guardrail decisions, by guardrail, phase, decision (allow, deny, mutate, \
             failed_open, failed_closed) and the replica that answered or last failed",
            metrics.guardrail_checks.family.clone(),
        );
        registry.register_with_unit(
            "guardrail_check_duration",
            "Time to a guardrail's decision (retries and hedging included), by guardrail and phase",
            Unit::Seconds,
            metrics.guardrail_check_duration.family.clone(),
        );
        registry.register(
            "gen_ai_requests",
            "LLM requests answered through InferencePools, by pool, model, pod and status",
            metrics.gen_ai_requests.family.clone(),
        );
        registry.register(
            "gen_ai_token_usage",
            "Tokens of LLM exchanges as the servers reported them, by pool, model, pod and \
             token type (input, cached_input, output)",
            metrics.gen_ai_tokens.family.clone(),
        );
        registry.register_with_unit(
            "gen_ai_server_time_to_first_token",
            "Time from the proxy having a streamed LLM request to the first generated token, by \
             pool, model and pod",
            Unit::Seconds,
            metrics.gen_ai_time_to_first_token.family.clone(),
        );
        registry.register_with_unit(
            "gen_ai_server_time_per_output_token",
            "Time per generated token after the first, of streamed LLM responses, by pool, model \
             and pod",
            Unit::Seconds,
            metrics.gen_ai_time_per_output_token.family.clone(),
        );
        registry.register(
            "config_version",
            "Config version the proxy is enforcing",
            metrics.config_version.clone(),
        );
        registry.register(
            "config_last_apply_ok",
            "Result of the last config apply: 1 applied (ACK), 0 rejected (NACK)",
            metrics.config_last_apply_ok.clone(),
        );
        registry.register(
            "config_last_apply_version",
            "Config version the last apply was for, applied or rejected",
            metrics.config_last_apply_version.clone(),
        );
        registry.register(
            "access_log_dropped",
            "Access-log lines dropped because the writer was behind",
            metrics.access_log_dropped.clone(),
        );
        registry.register(
            "access_log_write_errors",
            "Access-log writes that failed",
            metrics.access_log_write_errors.clone(),
        );
        Metrics { registry, ..metrics }
    }

    /// Counts one finished request. Takes the record and gives it back, so that its `Arc<str>`
    /// labels are moved in and out of the label sets rather than cloned.
    pub(super) fn request(&self, mut record: RequestRecord, duration: Duration) -> RequestRecord {
        let labels = RequestLabels {
            listener: record.listener,
            route: record.route,
            target: record.target,
            status: record.status,
        };
        self.requests.get_or_create(&labels).inc();
        record.listener = labels.listener;

        let labels = RouteTargetLabels {
            route: labels.route,
            target: labels.target,
        };
        self.duration.get_or_create(&labels).observe(duration);
        record.target = labels.target;

        let labels = RouteLabels { route: labels.route };
        let received = self.request_bytes.get_or_create(&labels);
        if record.bytes_received > 0 {
            received.inc_by(record.bytes_received);
        }
        drop(received);
        let sent = self.response_bytes.get_or_create(&labels);
        if record.bytes_sent > 0 {
            sent.inc_by(record.bytes_sent);
        }
        drop(sent);
        record.route = labels.route;

        for &(ref policy, decision) in &record.decisions {
            let labels = PolicyLabels {
                policy: policy.clone(),
                decision,
            };
            self.policy_decisions.get_or_create(&labels).inc();
        }
        record
    }

    /// Counts guardrail decisions and their latency.
    pub(super) fn guardrails(&self, checks: &[GuardrailRecord]) {
        for check in checks {
            self.guardrail_checks
                .get_or_create(&GuardrailLabels {
                    guardrail: check.guardrail.clone(),
                    phase: check.phase,
                    decision: check.decision,
                    replica: check.replica.clone().unwrap_or_else(|| Arc::from("")),
                })
                .inc();
            self.guardrail_check_duration
                .get_or_create(&GuardrailPhaseLabels {
                    guardrail: check.guardrail.clone(),
                    phase: check.phase,
                })
                .observe(check.latency);
        }
    }

    pub(super) fn tool_drift(
        &self,
        target: &Arc<str>,
        server: &Arc<str>,
        counts: [(&'static str, usize); 3],
    ) {
        for (state, count) in counts {
            let labels = ToolDriftLabels {
                target: target.clone(),
                server: server.clone(),
                state,
            };
            self.mcp_tool_drift
                .get_or_create(&labels)
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
    }

    /// Counts an MCP request (a request whose route sends to an McpBackend).
    pub(super) fn mcp(&self, record: &RequestRecord, mcp: &McpRecord) {
        let outcome: Arc<str> = match mcp.error_code {
            None => Arc::from("ok"),
            Some(code) => Arc::from(code.to_string()),
        };
        self.mcp_requests
            .get_or_create(&McpLabels {
                target: record.target.clone().unwrap_or_else(|| Arc::from("")),
                mcp_method_name: mcp.method.clone(),
                server: mcp.server.clone().unwrap_or_else(|| Arc::from("")),
                outcome,
            })
            .inc();
    }

    /// Counts an LLM exchange (a request whose route sends to InferencePools).
    pub(super) fn llm(&self, record: &RequestRecord, llm: &LlmRecord) {
        let unknown = || Arc::from("");
        let labels = GenAiLabels {
            pool: record.target.clone().unwrap_or_else(unknown),
            gen_ai_request_model: llm.model.clone(),
            endpoint: record.endpoint.clone().unwrap_or_else(unknown),
        };
        self.gen_ai_requests
            .get_or_create(&GenAiRequestLabels {
                pool: labels.pool.clone(),
                gen_ai_request_model: labels.gen_ai_request_model.clone(),
                endpoint: labels.endpoint.clone(),
                status: record.status,
            })
            .inc();
        for (token_type, count) in [
            ("input", llm.input_tokens),
            ("cached_input", llm.cached_input_tokens),
            ("output", llm.output_tokens),
        ] {
            if let Some(count) = count {
                self.gen_ai_tokens
                    .get_or_create(&GenAiTokenLabels {
                        pool: labels.pool.clone(),
                        gen_ai_request_model: labels.gen_ai_request_model.clone(),
                        endpoint: labels.endpoint.clone(),
                        gen_ai_token_type: token_type,
                    })
                    .inc_by(count);
            }
        }
        if let Some(first) = llm.first_token {
            self.gen_ai_time_to_first_token
                .get_or_create(&labels)
                .observe(first);
        }
        if let Some(per_token) = llm.time_per_output_token() {
            self.gen_ai_time_per_output_token
                .get_or_create(&labels)
                .observe(per_token);
        }
    }

    pub(super) fn upstream_error(&self, route: &str, target: &str, kind: &'static str) {
        let labels = UpstreamErrorLabels {
            route: Arc::from(route),
            target: Arc::from(target),
            kind,
        };
        self.upstream_errors.get_or_create(&labels).inc();
    }

    pub(super) fn config_applied(&self, version: u64) {
        let version = gauge_value(version);
        self.config_version.set(version);
        self.config_last_apply_version.set(version);
        self.config_last_apply_ok.set(1);
    }

    pub(super) fn config_rejected(&self, version: u64) {
        self.config_last_apply_version.set(gauge_value(version));
        self.config_last_apply_ok.set(0);
    }

    /// Drops the label sets that name something no longer in force. A request still under
    /// way on a removed route counts once it ends, and its sets go at the next version.
    pub(super) fn prune(&self, live: &InForce) {
        self.requests
            .retain(|l| live.has(&l.listener) && live.has_opt(&l.route) && live.has_opt(&l.target));
        self.duration
            .retain(|l| live.has_opt(&l.route) && live.has_opt(&l.target));
        self.request_bytes.retain(|l| live.has_opt(&l.route));
        self.response_bytes.retain(|l| live.has_opt(&l.route));
        self.upstream_errors
            .retain(|l| live.has(&l.route) && live.has(&l.target));
        self.policy_decisions.retain(|l| live.has(&l.policy));
        self.gen_ai_requests
            .retain(|l| live.has(&l.pool) && live.has(&l.endpoint));
        self.gen_ai_tokens
            .retain(|l| live.has(&l.pool) && live.has(&l.endpoint));
        self.gen_ai_time_to_first_token
            .retain(|l| live.has(&l.pool) && live.has(&l.endpoint));
        self.gen_ai_time_per_output_token
            .retain(|l| live.has(&l.pool) && live.has(&l.endpoint));
        self.mcp_requests
            .retain(|l| live.has(&l.target) && live.has(&l.server));
        self.mcp_tool_drift
            .retain(|l| live.has(&l.target) && live.has(&l.server));
        self.guardrail_checks.retain(|l| live.has(&l.guardrail));
        self.guardrail_check_duration.retain(|l| live.has(&l.guardrail));
    }

    pub(super) fn encode(&self) -> String {
        let mut body = String::with_capacity(8 * 1024);
        if let Err(error) = prometheus_client::encoding::prometheus_text::encode(&mut body, &self.registry) {
            tracing::warn!(%error, "encoding the metrics failed");
        }
        body
    }
}

fn gauge_value(version: u64) -> i64 {
    i64::try_from(version).unwrap_or(i64::MAX)
}

/// Upper bounds of the request-duration buckets, in seconds: 100 µs to 60 s, 1-2.5-5 steps.
const DURATION_BUCKETS: [f64; 18] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0,
];

/// The same bounds in nanoseconds (an observation `<=` a bound falls in its bucket).
const DURATION_BUCKETS_NANOS: [u64; 18] = {
    let mut nanos = [0u64; 18];
    let mut i = 0;
    while i < 18 {
        // Every bound is a whole number of microseconds.
        nanos[i] = (DURATION_BUCKETS[i] * 1e6 + 0.5) as u64 * 1_000;
        i += 1;
    }
    nanos
};

/// A histogram of durations with fixed buckets, lock-free: two atomic adds per observation.
/// The count is the sum of the buckets, so a scrape always sees them agree.
#[derive(Default)]
pub(super) struct DurationHistogram {
    /// Per-bucket (not cumulative) counts; the last one is `+Inf`.
    buckets: [AtomicU64; DURATION_BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
}

impl DurationHistogram {
    pub(super) fn observe(&self, duration: Duration) {
        let nanos = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        let bucket = DURATION_BUCKETS_NANOS.partition_point(|&bound| bound < nanos);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }
}

impl fmt::Debug for DurationHistogram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DurationHistogram").finish_non_exhaustive()
    }
}

impl TypedMetric for DurationHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for DurationHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), fmt::Error> {
        let mut buckets = [(0.0, 0u64); DURATION_BUCKETS.len() + 1];
        let mut count = 0;
        for (i, (bucket, counter)) in buckets.iter_mut().zip(&self.buckets).enumerate() {
            let n = counter.load(Ordering::Relaxed);
            *bucket = (DURATION_BUCKETS.get(i).copied().unwrap_or(f64::INFINITY), n);
            count += n;
        }
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_bounds_in_nanos() {
        assert_eq!(DURATION_BUCKETS_NANOS[0], 100_000);
        assert_eq!(DURATION_BUCKETS_NANOS[1], 250_000);
        assert_eq!(DURATION_BUCKETS_NANOS[17], 60_000_000_000);
        assert!(DURATION_BUCKETS_NANOS.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn histogram_buckets_are_inclusive_upper_bounds() {
        let h = DurationHistogram::default();
        h.observe(Duration::from_micros(50)); // <= 0.0001
        h.observe(Duration::from_micros(100)); // <= 0.0001 (inclusive)
        h.observe(Duration::from_micros(101)); // <= 0.00025
        h.observe(Duration::from_millis(1500)); // <= 2.5
        h.observe(Duration::from_secs(120)); // +Inf
        let counts: Vec<u64> = h.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        assert_eq!(counts[0], 2);
        assert_eq!(counts[1], 1);
        assert_eq!(counts[13], 1);
        assert_eq!(counts[18], 1);
        assert_eq!(counts.iter().sum::<u64>(), 5);
    }

    #[test]
    fn histogram_exposition() {
        let mut registry = Registry::with_prefix("portcullis_proxy");
        let family = Family::<RouteTargetLabels, DurationHistogram>::default();
        registry.register_with_unit("request_duration", "Duration", Unit::Seconds, family.clone());
        let labels = RouteTargetLabels {
            route: Some(Arc::from("Route/a")),
            target: None,
        };
        family.get_or_create(&labels).observe(Duration::from_millis(3));
        family.get_or_create(&labels).observe(Duration::from_millis(7));
        let mut text = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("# TYPE portcullis_proxy_request_duration_seconds histogram"),
            "{text}"
        );
        let bucket =
            r#"portcullis_proxy_request_duration_seconds_bucket{route="Route/a",target="",le="0.005"} 1"#;
        assert!(text.contains(bucket), "{text}");
        let bucket =
            r#"portcullis_proxy_request_duration_seconds_bucket{route="Route/a",target="",le="+Inf"} 2"#;
        assert!(text.contains(bucket), "{text}");
        let count = r#"portcullis_proxy_request_duration_seconds_count{route="Route/a",target=""} 2"#;
        assert!(text.contains(count), "{text}");
        let sum = r#"portcullis_proxy_request_duration_seconds_sum{route="Route/a",target=""} 0.01"#;
        assert!(text.contains(sum), "{text}");
    }
}
