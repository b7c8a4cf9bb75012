//! The two charts gateways are compared with, one line per target, against the offered rate
//! (closed loop: the achieved rate, see [`LoadSummary::offered_rate`]):
//! * LLM: TTFT p50 and output throughput;
//! * MCP: end-to-end call latency p50 and requests/s.
//!
//! [`LoadSummary::offered_rate`]: super::report::LoadSummary::offered_rate

use super::config::ApiConfig;
use super::report::{Report, StageReport, TimelinePoint};
use crate::plot::{line_chart, Line, OFFERED_RATE};

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
    let mut charts = specs
        .into_iter()
        .map(|(file, title, y_label, metric)| {
            Ok((
                file,
                line_chart(title, OFFERED_RATE, y_label, lines(report, metric))?,
            ))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    charts.push((
        "latency_over_time.svg",
        line_chart(
            "End-to-end latency over time (p50, p99 of the requests sent in each slice)",
            "time since the first stage began (s)",
            "latency (s)",
            timeline(report, &[("p50", |p| p.p50), ("p99", |p| p.p99)]),
        )?,
    ));
    charts.push((
        "failures_over_time.svg",
        line_chart(
            "Failed requests over time (by the slice they were sent in)",
            "time since the first stage began (s)",
            "failed requests",
            timeline(report, &[("failures", |p| p.failures as f64)]),
        )?,
    ));
    Ok(charts)
}

/// A measure of a timeline slice, by name.
type Measure = (&'static str, fn(&TimelinePoint) -> f64);

/// One line per target and measure, stages laid end to end.
fn timeline(report: &Report, measures: &[Measure]) -> Vec<Line> {
    let mut lines = Vec::new();
    for target in &report.targets {
        for (measure, value) in measures {
            let mut offset = 0.0;
            let mut points = Vec::new();
            for stage in &target.stages {
                points.extend(
                    stage
                        .timeline
                        .iter()
                        .map(|point| (offset + point.at, value(point))),
                );
                offset += stage.duration;
            }
            lines.push((format!("{} {measure}", target.name), points));
        }
    }
    lines
}

fn lines(report: &Report, metric: Metric) -> Vec<Line> {
    report
        .targets
        .iter()
        .map(|t| {
            let points = t
                .stages
                .iter()
                .map(|s| (s.load_summary.offered_rate(), metric(s)))
                .collect();
            (t.name.clone(), points)
        })
        .collect()
}
