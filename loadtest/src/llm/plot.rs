//! The two charts gateways are compared with, one line per target, against the offered rate
//! (closed loop: the achieved rate, see [`LoadSummary::offered_rate`]):
//! * LLM: TTFT p50 and output throughput;
//! * MCP: end-to-end call latency p50 and requests/s.
//!
//! [`LoadSummary::offered_rate`]: super::report::LoadSummary::offered_rate

use super::config::ApiConfig;
use super::report::{Report, StageReport};
use crate::plot::{rate_chart, Line};

type Metric = fn(&StageReport) -> f64;
type Spec = (&'static str, &'static str, &'static str, Metric);

const LLM: [Spec; 2] = [
    (
        "ttft_p50_vs_rate.svg",
        "TTFT p50 vs offered rate",
        "TTFT p50 (s)",
        // LLM stages always carry token metrics; 0 only if that invariant broke.
        |s| {
            s.successes
                .latency
                .tokens
                .as_ref()
                .map_or(0.0, |t| t.time_to_first_token.p50)
        },
    ),
    (
        "output_throughput_vs_rate.svg",
        "Output throughput vs offered rate",
        "output tokens/s",
        |s| {
            s.successes
                .throughput
                .tokens
                .as_ref()
                .map_or(0.0, |t| t.output_tokens_per_sec)
        },
    ),
];

const MCP: [Spec; 2] = [
    (
        "latency_p50_vs_rate.svg",
        "MCP call latency p50 vs offered rate",
        "latency p50 (s)",
        |s| s.successes.latency.request_latency.p50,
    ),
    (
        "requests_per_sec_vs_rate.svg",
        "MCP requests/s vs offered rate",
        "successful requests/s",
        |s| s.successes.throughput.requests_per_sec,
    ),
];

/// `(file name, SVG document)` of every chart.
pub fn charts(report: &Report) -> anyhow::Result<Vec<(&'static str, String)>> {
    let specs = match report.config.api {
        ApiConfig::Llm(_) => LLM,
        ApiConfig::Mcp(_) => MCP,
    };
    specs
        .into_iter()
        .map(|(file, title, y_label, metric)| Ok((file, rate_chart(title, y_label, lines(report, metric))?)))
        .collect()
}

fn lines(report: &Report, metric: Metric) -> Vec<Line<'_>> {
    report
        .targets
        .iter()
        .map(|t| {
            let points = t
                .stages
                .iter()
                .map(|s| (s.load_summary.offered_rate(), metric(s)))
                .collect();
            (t.name.as_str(), points)
        })
        .collect()
}
