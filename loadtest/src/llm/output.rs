//! Writes a run's results: `report.json` (the full [`Report`]), `report.csv` (one row per
//! target × stage, for spreadsheets) and the comparison charts (see [`super::plot`]).

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;

use super::client::FailureKind;
use super::config::ApiConfig;
use super::plot;
use super::report::{Report, StageReport};
use crate::mcp::CORE_FAILURE_KINDS;
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

/// Token latencies (LLM only), then the end-to-end latency every row has.
const TOKEN_LATENCIES: [&str; 4] = ["ttft", "itl", "tpot", "ntpot"];

/// One row per target × stage; latencies in seconds, rates per second. Columns:
/// * every row: `target, stage, achieved_rate, duration_s, requests, successes, failures,
///   requests_per_sec, e2e_{mean,p50,p90,p99}` and the ratios to the baseline (first target)
///   `added_p50_s, added_p99_s, requests_per_sec_ratio` (empty when a side had no success);
/// * `requested_rate` for open-loop stages, `clients` for closed-loop ones (else empty);
/// * LLM only, empty for MCP: `{input,output,total}_tokens_per_sec` and
///   `{ttft,itl,tpot,ntpot}_{mean,p50,p90,p99}`;
/// * `failures_<kind>`: LLM rows have one per `FailureKind`; MCP rows have `connect, io,
///   timeout, protocol, mismatch` plus any other kind that occurred (`http_404`, `rpc_…`).
pub fn csv(report: &Report) -> String {
    let mut header: Vec<String> = [
        "target",
        "stage",
        "requested_rate",
        "clients",
        "achieved_rate",
        "duration_s",
        "requests",
        "successes",
        "failures",
        "requests_per_sec",
        "input_tokens_per_sec",
        "output_tokens_per_sec",
        "total_tokens_per_sec",
    ]
    .map(String::from)
    .to_vec();
    for metric in TOKEN_LATENCIES.iter().chain(&["e2e"]) {
        for stat in ["mean", "p50", "p90", "p99"] {
            header.push(format!("{metric}_{stat}"));
        }
    }
    header.extend(["added_p50_s", "added_p99_s", "requests_per_sec_ratio"].map(String::from));
    let kinds = failure_kinds(report);
    header.extend(kinds.iter().map(|k| format!("failures_{k}")));
    let mut out = header.join(",");
    out.push('\n');
    for target in &report.targets {
        for s in &target.stages {
            let _ = writeln!(out, "{}", row(&target.name, s, &kinds).join(","));
        }
    }
    out
}

fn row(target: &str, s: &StageReport, kinds: &[String]) -> Vec<String> {
    let l = &s.load_summary;
    let throughput = &s.successes.throughput;
    let tokens = throughput.tokens.as_ref();
    let mut row = vec![
        quote(target),
        s.stage.to_string(),
        l.requested_rate.map(|r| r.to_string()).unwrap_or_default(),
        l.clients.map(|c| c.to_string()).unwrap_or_default(),
        num(l.achieved_rate),
        num(s.duration),
        l.count.to_string(),
        s.successes.count.to_string(),
        s.failures.count.to_string(),
        num(throughput.requests_per_sec),
        opt(tokens.map(|t| t.input_tokens_per_sec)),
        opt(tokens.map(|t| t.output_tokens_per_sec)),
        opt(tokens.map(|t| t.total_tokens_per_sec)),
    ];
    let token_latencies: [Option<&Summary>; 4] = match &s.successes.latency.tokens {
        Some(t) => [
            Some(&t.time_to_first_token),
            Some(&t.inter_token_latency),
            Some(&t.time_per_output_token),
            Some(&t.normalized_time_per_output_token),
        ],
        None => [None; 4],
    };
    let e2e = Some(&s.successes.latency.request_latency);
    let stats: [fn(&Summary) -> f64; 4] = [|x| x.mean, |x| x.p50, |x| x.p90, |x| x.p99];
    for summary in token_latencies.into_iter().chain([e2e]) {
        row.extend(stats.map(|stat| opt(summary.map(stat))));
    }
    let vs = s.vs_baseline.as_ref();
    row.extend([
        opt(vs.and_then(|v| v.added_p50_s)),
        opt(vs.and_then(|v| v.added_p99_s)),
        opt(vs.and_then(|v| v.requests_per_sec_ratio)),
    ]);
    row.extend(kinds.iter().map(|k| s.failures.of_kind(k).to_string()));
    row
}

/// The fixed failure columns of the run's api, then any other kind that occurred, sorted.
fn failure_kinds(report: &Report) -> Vec<String> {
    let mut kinds: Vec<String> = match report.config.api {
        ApiConfig::Llm(_) => FailureKind::ALL.iter().map(|k| k.name().to_string()).collect(),
        ApiConfig::Mcp(_) => CORE_FAILURE_KINDS.map(String::from).to_vec(),
    };
    let seen: BTreeSet<&String> = report
        .targets
        .iter()
        .flat_map(|t| &t.stages)
        .flat_map(|s| s.failures.by_kind.keys())
        .collect();
    let extra: Vec<String> = seen.into_iter().filter(|k| !kinds.contains(k)).cloned().collect();
    kinds.extend(extra);
    kinds
}

fn opt(x: Option<f64>) -> String {
    x.map(num).unwrap_or_default()
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
