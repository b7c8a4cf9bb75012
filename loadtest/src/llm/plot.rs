//! The two charts gateways are compared with: TTFT p50 and output throughput against the
//! offered rate, one line per target.

use super::report::{Report, StageReport};
use crate::plot::{rate_chart, Line};

type Metric = fn(&StageReport) -> f64;

/// `(file name, SVG document)` of every chart.
pub fn charts(report: &Report) -> anyhow::Result<Vec<(&'static str, String)>> {
    let specs: [(&'static str, &str, &str, Metric); 2] = [
        (
            "ttft_p50_vs_rate.svg",
            "TTFT p50 vs offered rate",
            "TTFT p50 (s)",
            |s| s.successes.latency.time_to_first_token.p50,
        ),
        (
            "output_throughput_vs_rate.svg",
            "Output throughput vs offered rate",
            "output tokens/s",
            |s| s.successes.throughput.output_tokens_per_sec,
        ),
    ];
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
                .map(|s| (s.load_summary.requested_rate, metric(s)))
                .collect();
            (t.name.as_str(), points)
        })
        .collect()
}
