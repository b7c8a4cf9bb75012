//! `portcullis sim virtual`: runs a virtual-time experiment and prints per-stage figures
//! for every router, with the JSON report for plots and later comparison.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;

use super::profile::Profile;
use super::report::{Report, StageReport};
use super::{run_virtual, VirtualConfig};
use crate::plot::{line_chart, Line, OFFERED_RATE};

#[derive(Debug, clap::Args)]
pub struct VirtualArgs {
    /// Experiment file (YAML or JSON `VirtualConfig`); without it, the published llm-d
    /// shared-prefix benchmark on 8 simulated Qwen3-32B TP=2 H100 replicas.
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    /// Length of each stage of the built-in llm-d benchmark, in simulated seconds.
    #[arg(long, default_value_t = 30.0)]
    pub stage_seconds: f64,
    /// Proxies the picker runs in, each with its own prefix index and counts (overrides the
    /// experiment file's `proxies`).
    #[arg(long)]
    pub proxies: Option<usize>,
    /// Write the full report (every stage, router and replica counter) here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write SVG charts here: TTFT p50, TTFT p99 and output throughput against the offered
    /// rate, one line per router.
    #[arg(long)]
    pub plot_dir: Option<PathBuf>,
}

pub fn run(args: &VirtualArgs) -> anyhow::Result<Report> {
    let mut config = match &args.file {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let value = serde_saphyr::from_str::<serde_json::Value>(&text)
                .with_context(|| format!("{}: malformed YAML/JSON", path.display()))?;
            serde_path_to_error::deserialize::<_, VirtualConfig>(value)
                .map_err(|error| anyhow::anyhow!("{}: {}: {}", path.display(), error.path(), error.inner()))?
        }
        None => VirtualConfig::llm_d_benchmark(Profile::qwen3_32b_tp2_h100()?, args.stage_seconds),
    };
    if let Some(proxies) = args.proxies {
        config.proxies = proxies;
    }
    let report = run_virtual(&config)?;
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(dir) = &args.plot_dir {
        write_charts(&report, dir)?;
    }
    Ok(report)
}

type Metric = fn(&StageReport) -> f64;

fn write_charts(report: &Report, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let charts: [(&str, &str, &str, Metric); 3] = [
        (
            "ttft_p50_vs_rate.svg",
            "TTFT p50 vs offered rate",
            "TTFT p50 (s)",
            |s| s.ttft.p50,
        ),
        (
            "ttft_p99_vs_rate.svg",
            "TTFT p99 vs offered rate",
            "TTFT p99 (s)",
            |s| s.ttft.p99,
        ),
        (
            "output_throughput_vs_rate.svg",
            "Output throughput vs offered rate",
            "output tokens/s",
            |s| s.output_tokens_per_s,
        ),
    ];
    for (file, title, y_label, metric) in charts {
        let svg = line_chart(title, OFFERED_RATE, y_label, lines(report, metric))?;
        let path = dir.join(file);
        std::fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// One line per router. A rate offered twice (the published run warms up at 15 before
/// ramping through 15 again) keeps its later stage, measured on a warm fleet.
fn lines(report: &Report, metric: Metric) -> Vec<Line> {
    report
        .routers
        .iter()
        .map(|router| {
            let by_rate: BTreeMap<u64, (f64, f64)> = router
                .stages
                .iter()
                .map(|s| (s.rate.to_bits(), (s.rate, metric(s))))
                .collect();
            (router.router.clone(), by_rate.into_values().collect())
        })
        .collect()
}

/// One block per router: offered rate against what it served and how fast.
pub fn table(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "profile {} · {} replicas", report.profile, report.pods);
    for router in &report.routers {
        let _ = writeln!(out, "\n{}", router.router);
        let _ = writeln!(
            out,
            "{:>6} {:>8} {:>9} {:>10} {:>10} {:>10} {:>9} {:>7}",
            "rate", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "E2E p50", "ITL mean", "cached"
        );
        for stage in &router.stages {
            let _ = writeln!(
                out,
                "{:>6.1} {:>8.2} {:>9.0} {:>9.2}s {:>9.2}s {:>9.1}s {:>7.0}ms {:>6.0}%",
                stage.rate,
                stage.requests_per_s,
                stage.output_tokens_per_s,
                stage.ttft.p50,
                stage.ttft.p99,
                stage.e2e.p50,
                stage.itl.mean * 1000.0,
                stage.cached_token_fraction * 100.0
            );
        }
    }
    out
}
