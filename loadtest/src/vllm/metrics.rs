//! `/metrics` in the Prometheus text format (0.0.4) with vLLM V1's metric names and labels
//! (vllm-project/vllm, `vllm/v1/metrics/loggers.py`; vLLM docs, "Production Metrics").
//!
//! Written by hand rather than with the `prometheus-client` crate: that crate only speaks
//! OpenMetrics, where a counter's `# TYPE` line drops the `_total` suffix and the body ends in
//! `# EOF`, and it would append `_info` to the info metrics. vLLM serves the classic text
//! format from Python's `prometheus_client` (`# TYPE vllm:prompt_tokens_total counter`), and
//! scrapers such as the GIE endpoint picker look families up by those exact names. Every
//! value is computed from the engine at scrape time, so there is no registry to keep in sync.

use std::fmt::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use super::pod::{PodSettings, Snapshot};

/// vLLM's `vllm:time_to_first_token_seconds` buckets.
pub(super) const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's `vllm:inter_token_latency_seconds` buckets.
pub(super) const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];

/// A cumulative-on-render Prometheus histogram.
#[derive(Debug, Clone)]
pub(super) struct Histogram {
    bounds: &'static [f64],
    /// Per-bucket (non-cumulative) counts; the last entry is the +Inf overflow.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        }
    }

    pub fn observe(&mut self, value: f64) {
        let bucket = self.bounds.partition_point(|&b| b < value);
        self.counts[bucket] += 1;
        self.sum += value;
    }
}

/// Renders the pod's metrics.
pub(super) fn render(settings: &PodSettings, s: &Snapshot) -> String {
    let labels = format!("model_name=\"{}\",engine=\"0\"", escape(&settings.model));
    let e = &s.engine;
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, value: f64| {
        family(&mut out, name, help, "gauge");
        sample(&mut out, name, &labels, value);
    };
    gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        e.num_requests_running as f64,
    );
    gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        e.num_requests_waiting as f64,
    );
    gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        e.kv_cache_usage,
    );
    gauge(
        "vllm:gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        e.kv_cache_usage,
    );

    // Info metrics carry their payload in labels; vLLM sets the LoRA one to the time of the
    // last update so scrapers can pick the newest series.
    family(
        &mut out,
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        "gauge",
    );
    let join = |set: &std::collections::BTreeSet<String>| {
        escape(&set.iter().map(String::as_str).collect::<Vec<_>>().join(","))
    };
    let lora_labels = format!(
        "max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"",
        settings.max_loras,
        join(&s.running_adapters),
        join(&s.waiting_adapters)
    );
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    sample(&mut out, "vllm:lora_requests_info", &lora_labels, now);
    family(
        &mut out,
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        "gauge",
    );
    let cache_labels = format!(
        "block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",num_cpu_blocks=\"0\",num_gpu_blocks=\"{}\"",
        settings.block_size, settings.num_gpu_blocks
    );
    sample(&mut out, "vllm:cache_config_info", &cache_labels, 1.0);

    let mut counter = |name: &str, help: &str, value: u64| {
        family(&mut out, name, help, "counter");
        sample(&mut out, name, &labels, value as f64);
    };
    counter(
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        e.prompt_tokens,
    );
    counter(
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        e.generation_tokens,
    );
    counter(
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        e.prefix_cache_queries,
    );
    counter(
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        e.prefix_cache_hits,
    );
    counter(
        "vllm:num_preemptions_total",
        "Cumulative number of preemption from the engine.",
        e.num_preemptions,
    );
    // Output lengths are exact (`ignore_eos`), so every request finishes by length.
    family(
        &mut out,
        "vllm:request_success_total",
        "Count of successfully processed requests.",
        "counter",
    );
    sample(
        &mut out,
        "vllm:request_success_total",
        &format!("{labels},finished_reason=\"length\""),
        e.request_success as f64,
    );

    histogram(
        &mut out,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &labels,
        &s.ttft,
    );
    histogram(
        &mut out,
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &labels,
        &s.itl,
    );
    out
}

fn family(out: &mut String, name: &str, help: &str, kind: &str) {
    // Writing to a String cannot fail.
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

fn sample(out: &mut String, name: &str, labels: &str, value: f64) {
    let _ = writeln!(out, "{name}{{{labels}}} {}", number(value));
}

fn histogram(out: &mut String, name: &str, help: &str, labels: &str, h: &Histogram) {
    family(out, name, help, "histogram");
    let mut cumulative = 0;
    for (bound, count) in h.bounds.iter().zip(&h.counts) {
        cumulative += count;
        let le = format!("{labels},le=\"{}\"", number(*bound));
        sample(out, &format!("{name}_bucket"), &le, cumulative as f64);
    }
    let total: u64 = h.counts.iter().sum();
    let inf = format!("{labels},le=\"+Inf\"");
    sample(out, &format!("{name}_bucket"), &inf, total as f64);
    sample(out, &format!("{name}_count"), labels, total as f64);
    sample(out, &format!("{name}_sum"), labels, h.sum);
}

/// Python's `prometheus_client` style: integral values keep a `.0`.
fn number(value: f64) -> String {
    if value.is_finite() && value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{value:.1}")
    } else {
        format!("{value}")
    }
}

/// Label values may hold user-chosen model and adapter names.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
