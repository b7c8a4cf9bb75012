//! Writes a run's results: `report.json` (the full [`Report`]), `report.csv` (one row per
//! target × stage, for spreadsheets) and the comparison charts (see [`super::plot`]).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;

use super::client::FailureKind;
use super::plot;
use super::report::{Report, StageReport};
use crate::sim::report::Summary;

/// Writes every output into `dir` (created if missing); returns the paths written.
pub fn write_all(report: &Report, dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written = Vec::new();
    let mut write = |name: &str, contents: String| -> anyhow::Result<()> {
        let path = dir.join(name);
        std::fs::write(&path, contents).with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
        Ok(())
    };
    write("report.json", serde_json::to_string_pretty(report)?)?;
    write("report.csv", csv(report))?;
    for (name, svg) in plot::charts(report)? {
        write(name, svg)?;
    }
    Ok(written)
}

const LATENCIES: [&str; 5] = ["ttft", "itl", "tpot", "ntpot", "e2e"];

fn latencies(stage: &StageReport) -> [&Summary; 5] {
    let l = &stage.successes.latency;
    [
        &l.time_to_first_token,
        &l.inter_token_latency,
        &l.time_per_output_token,
        &l.normalized_time_per_output_token,
        &l.request_latency,
    ]
}

/// One row per target × stage; latencies in seconds.
pub fn csv(report: &Report) -> String {
    let mut header = vec![
        "target".to_string(),
        "stage".into(),
        "requested_rate".into(),
        "achieved_rate".into(),
        "duration_s".into(),
        "requests".into(),
        "successes".into(),
        "failures".into(),
        "requests_per_sec".into(),
        "input_tokens_per_sec".into(),
        "output_tokens_per_sec".into(),
        "total_tokens_per_sec".into(),
    ];
    for metric in LATENCIES {
        for stat in ["mean", "p50", "p90", "p99"] {
            header.push(format!("{metric}_{stat}"));
        }
    }
    header.extend(FailureKind::ALL.iter().map(|k| format!("failures_{}", k.name())));
    let mut out = header.join(",");
    out.push('\n');
    for target in &report.targets {
        for s in &target.stages {
            let t = &s.successes.throughput;
            let mut row = vec![
                quote(&target.name),
                s.stage.to_string(),
                s.load_summary.requested_rate.to_string(),
                num(s.load_summary.achieved_rate),
                num(s.duration),
                s.load_summary.count.to_string(),
                s.successes.count.to_string(),
                s.failures.count.to_string(),
                num(t.requests_per_sec),
                num(t.input_tokens_per_sec),
                num(t.output_tokens_per_sec),
                num(t.total_tokens_per_sec),
            ];
            for summary in latencies(s) {
                row.extend([summary.mean, summary.p50, summary.p90, summary.p99].map(num));
            }
            row.extend(
                FailureKind::ALL
                    .iter()
                    .map(|&k| s.failures.of_kind(k).to_string()),
            );
            let _ = writeln!(out, "{}", row.join(","));
        }
    }
    out
}

fn num(x: f64) -> String {
    format!("{x:.6}")
}

/// RFC 4180 quoting, needed only when a target name contains a comma, quote or newline.
fn quote(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_with_commas_are_quoted() {
        assert_eq!(quote("plain"), "plain");
        assert_eq!(quote("a,b \"c\""), "\"a,b \"\"c\"\"\"");
    }
}
