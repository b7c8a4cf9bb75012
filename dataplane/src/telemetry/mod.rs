//! Request telemetry: Prometheus metrics, the JSON access log and OpenTelemetry server spans
//! exported over OTLP/gRPC.
//!
//! One [`Telemetry`] per proxy, shared as `Arc<Telemetry>`. Per request the pipeline calls
//! [`Telemetry::start`] first (trace context, and the span when export is on) and
//! [`Telemetry::finish`] once the response body has ended or the client went away (metrics,
//! the sampled access-log line, the span's attributes and end).
//!
//! Cost on the request path: with span export and the access log off, `start` is free unless
//! the request carries a valid `traceparent`, and `finish` is a few hashed lookups under shared
//! locks plus atomic adds, with no allocation. A logged line costs one allocation (the record
//! is moved to the writer thread, which formats it); a recorded span costs the SDK's span and
//! its attribute values.

mod access_log;
mod log_throttle;
mod metrics;
mod trace;

#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use http::HeaderValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;

use self::access_log::AccessLog;
pub(crate) use self::log_throttle::LogThrottle;
pub(crate) use self::metrics::InForce;
use self::metrics::Metrics;
pub(crate) use self::trace::RequestTrace;

/// The listener name recorded for a request on a listener that is being removed.
pub(crate) const REMOVED_LISTENER: &str = "(removed)";

/// What the proxy's telemetry does; built by the CLI.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    pub access_log: AccessLogConfig,
    /// OTLP/gRPC endpoint, e.g. `http://127.0.0.1:4317`; `None` (or empty) = no span export.
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans, e.g. `portcullis-proxy`.
    pub service_name: String,
    /// `service.instance.id` of the exported spans.
    pub proxy_id: String,
}

/// The access log: one JSON object per line.
#[derive(Debug, Clone, PartialEq)]
pub struct AccessLogConfig {
    pub destination: AccessLogDestination,
    /// Fraction of requests logged, 0.0..=1.0 (server errors, status >= 500, are always
    /// logged).
    pub sample: f64,
}

/// Where access-log lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessLogDestination {
    Off,
    Stdout,
    /// Appended to (created if missing).
    File(PathBuf),
}

/// Everything telemetry needs to know about one finished request.
#[derive(Debug)]
pub(crate) struct RequestRecord {
    pub(crate) trace: RequestTrace,
    pub(crate) client: SocketAddr,
    pub(crate) listener: Arc<str>,
    pub(crate) method: http::Method,
    /// Normalized path, without query (never logged: it may hold secrets; a query passed here
    /// anyway is cut off).
    pub(crate) path: String,
    pub(crate) host: Option<String>,
    /// `None`: no route matched.
    pub(crate) route: Option<Arc<str>>,
    /// E.g. `Backend/api`.
    pub(crate) target: Option<Arc<str>>,
    /// `host:port` actually used, last attempt.
    pub(crate) endpoint: Option<Arc<str>>,
    pub(crate) attempts: u32,
    pub(crate) status: u16,
    /// Proxy-generated error type, e.g. `upstream_timeout`, `rate_limited`.
    pub(crate) error: Option<&'static str>,
    /// `(policy, decision)`, e.g. `("RateLimitPolicy/per-client", "deny")`.
    pub(crate) decisions: Vec<(Arc<str>, &'static str)>,
    pub(crate) start: Instant,
    /// Time until the upstream response headers.
    pub(crate) upstream_headers: Option<Duration>,
    /// Request body bytes from the client.
    pub(crate) bytes_received: u64,
    /// Response body bytes to the client.
    pub(crate) bytes_sent: u64,
    /// `false` when the body was cut (client gone, idle timeout, upstream reset).
    pub(crate) completed: bool,
    /// An LLM route's exchange, filled in as its response passes (see `llm/tap.rs`).
    pub(crate) llm: Option<Arc<std::sync::Mutex<LlmRecord>>>,
    /// An MCP exchange, filled in by the McpBackend target.
    pub(crate) mcp: Option<McpRecord>,
    /// Guardrail decisions (see `policy/guardrail/`).
    pub(crate) guardrails: crate::policy::guardrail::GuardrailLog,
}

impl RequestRecord {
    /// The guardrail decisions taken so far (a streamed response may still add some).
    pub(crate) fn guardrails(&self) -> Vec<crate::policy::guardrail::GuardrailRecord> {
        self.guardrails
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// What an MCP request was. Metrics leave out `name`: a client can send any name.
#[derive(Debug, Clone, Default)]
pub(crate) struct McpRecord {
    /// The JSON-RPC method (`tools/call`), or the kind of message when it had none.
    pub(crate) method: Arc<str>,
    /// The server the request went to, when it went to one.
    pub(crate) server: Option<Arc<str>>,
    /// The tool's or prompt's own name, or the resource's own URI.
    pub(crate) name: Option<String>,
    /// The JSON-RPC error code of an error the gateway answered with.
    pub(crate) error_code: Option<i64>,
    /// How a called tool stands against its McpToolPins (`pinned`, `drifted`, `unpinned`,
    /// `absent`); `None` when no pins cover its server.
    pub(crate) pin: Option<&'static str>,
}

/// What an LLM exchange produced. Times count from when the proxy had the whole request.
#[derive(Debug, Clone, Default)]
pub(crate) struct LlmRecord {
    /// The model the servers know (after aliases and rewrites).
    pub(crate) model: Arc<str>,
    pub(crate) streamed: bool,
    pub(crate) first_token: Option<Duration>,
    pub(crate) last_token: Option<Duration>,
    pub(crate) input_tokens: Option<u64>,
    pub(crate) cached_input_tokens: Option<u64>,
    pub(crate) output_tokens: Option<u64>,
    /// The server's stream broke off; the client got an error event instead of the rest.
    pub(crate) interrupted: bool,
    /// What the picker based its choice on (`signals`, `own_counts`, `round_robin`, …).
    pub(crate) pick_basis: Option<&'static str>,
    /// Leading prompt blocks the chosen pod probably had cached, of the prompt's blocks.
    pub(crate) prefix_blocks: Option<(u32, u32)>,
    /// Every candidate pod was saturated.
    pub(crate) saturated: bool,
}

impl LlmRecord {
    /// Time per output token after the first (OpenTelemetry's `gen_ai.server.time_per_output_token`).
    pub(crate) fn time_per_output_token(&self) -> Option<Duration> {
        let (first, last, tokens) = (self.first_token?, self.last_token?, self.output_tokens?);
        (tokens > 1).then(|| (last.saturating_sub(first)) / u32::try_from(tokens - 1).unwrap_or(u32::MAX))
    }
}

/// The proxy's telemetry; one per proxy, shared as `Arc<Telemetry>`.
pub(crate) struct Telemetry {
    metrics: Metrics,
    access_log: Option<AccessLog>,
    spans: Option<SpanExport>,
}

struct SpanExport {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl Telemetry {
    /// Opens the access log (its writer is a thread of its own) and, with an OTLP endpoint,
    /// sets up span export, which must happen inside a Tokio runtime (the gRPC channel spawns
    /// its worker there; it connects lazily, so an unreachable collector is no error here).
    pub(crate) fn new(config: TelemetryConfig) -> anyhow::Result<Telemetry> {
        let metrics = Metrics::new();
        let access_log = AccessLog::start(
            &config.access_log,
            metrics.access_log_dropped.clone(),
            metrics.access_log_write_errors.clone(),
        )?;
        // An empty endpoint (e.g. an empty OTEL_EXPORTER_OTLP_ENDPOINT) is unset, as
        // OpenTelemetry treats empty variables.
        let endpoint = config
            .otlp_endpoint
            .filter(|endpoint| !endpoint.trim().is_empty());
        let spans = match endpoint {
            Some(endpoint) => Some(SpanExport::start(endpoint, config.service_name, config.proxy_id)?),
            None => None,
        };
        Ok(Telemetry {
            metrics,
            access_log,
            spans,
        })
    }

    /// Called first thing per request. `traceparent`/`tracestate` are the incoming header
    /// values, if any.
    pub(crate) fn start(
        &self,
        traceparent: Option<&HeaderValue>,
        tracestate: Option<&HeaderValue>,
    ) -> RequestTrace {
        RequestTrace::start(self.spans.as_ref().map(|s| &s.tracer), traceparent, tracestate)
    }

    /// Called once per request when the response body has ended (or the client went away):
    /// metrics, the access-log line (sampled), the span's attributes/status and end.
    pub(crate) fn finish(&self, record: RequestRecord) {
        let duration = record.start.elapsed();
        let mut record = self.metrics.request(record, duration);
        if let Some(mcp) = &record.mcp {
            self.metrics.mcp(&record, mcp);
        }
        self.metrics.guardrails(&record.guardrails());
        if let Some(llm) = &record.llm {
            let llm = llm.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            self.metrics.llm(&record, &llm);
        }
        if let Some(span) = record.trace.take_span() {
            trace::end_span(span, &record);
        }
        if let Some(access_log) = &self.access_log {
            access_log.log(record, duration);
        }
    }

    /// Counts a proxy-level upstream error by kind (connect, timeout, exchange), labelled by
    /// route and backend (`target` label: pass the same string as [`RequestRecord::target`],
    /// e.g. `Backend/api`).
    pub(crate) fn upstream_error(&self, route: &str, backend: &str, kind: &'static str) {
        self.metrics.upstream_error(route, backend, kind);
    }

    /// How many tools of one McpBackend server stand in each drift state, now.
    pub(crate) fn tool_drift(
        &self,
        target: &Arc<str>,
        server: &Arc<str>,
        counts: [(&'static str, usize); 3],
    ) {
        self.metrics.tool_drift(target, server, counts);
    }

    /// The config version now applied: `config_version`, and the last apply succeeded.
    /// Metrics that name what `live` no longer holds are dropped.
    pub(crate) fn config_applied(&self, version: u64, live: &InForce) {
        self.metrics.config_applied(version);
        self.metrics.prune(live);
    }

    /// A config version was rejected (NACK): the last apply failed, for this version.
    pub(crate) fn config_rejected(&self, version: u64) {
        self.metrics.config_rejected(version);
    }

    /// Prometheus text exposition (format 0.0.4) of every metric, for `GET /metrics` on the
    /// proxy's admin port: `(content_type, body)`.
    pub(crate) fn encode_metrics(&self) -> (&'static str, String) {
        (
            prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            self.metrics.encode(),
        )
    }

    /// Flushes the access log and the span exporter (the latter is shut down: spans of
    /// requests finished afterwards are not exported). Call it before dropping the last
    /// `Arc<Telemetry>`.
    pub(crate) async fn shutdown(&self) {
        if let Some(access_log) = &self.access_log {
            access_log.flush().await;
        }
        if let Some(spans) = &self.spans {
            let provider = spans.provider.clone();
            match tokio::task::spawn_blocking(move || provider.shutdown()).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%error, "shutting down the span exporter"),
                Err(error) => tracing::warn!(%error, "shutting down the span exporter"),
            }
        }
    }
}

impl SpanExport {
    fn start(endpoint: String, service_name: String, proxy_id: String) -> anyhow::Result<SpanExport> {
        tokio::runtime::Handle::try_current().context("span export must be set up inside a Tokio runtime")?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .build()
            .with_context(|| format!("setting up OTLP span export to {endpoint}"))?;
        let resource = Resource::builder()
            .with_service_name(service_name)
            .with_attribute(KeyValue::new("service.instance.id", proxy_id))
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)))
            .with_resource(resource)
            .build();
        let scope = InstrumentationScope::builder("portcullis-proxy")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build();
        let tracer = provider.tracer_with_scope(scope);
        Ok(SpanExport { provider, tracer })
    }
}
