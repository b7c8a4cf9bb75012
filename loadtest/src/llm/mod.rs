//! `portcullis loadtest -f FILE`: a load generator in the spirit of inference-perf
//! (kubernetes-sigs/inference-perf), for comparing targets — direct vs gateway,
//! round-robin vs prefix-aware picker — on identical, seeded traffic over real HTTP. The
//! same config shape and reports serve LLM requests and MCP calls (`api: {type: mcp}`, sent
//! by [`crate::mcp::McpCaller`]).
//!
//! * [`config`]: the YAML config (api, model, targets, data, load, request_timeout);
//! * [`prompts`]: Poisson/constant arrival plans (drawn by the simulator's
//!   `sim::workload::arrival_offsets`) and prompt text (shared-prefix prompts come from the
//!   simulator's generator, spelled so the stand-in tokenizer counts them exactly);
//! * [`sse`]: what the payloads of OpenAI-compatible streams mean (the framing is
//!   [`crate::sse`]);
//! * [`client`]: one timed request over a pooled hyper client, failures classified;
//! * [`workload`]: "the next request" of a target, LLM or MCP;
//! * [`runner`]: targets × stages, open loop (with an optional in-flight cap) or closed loop;
//! * [`report`]: per-stage TTFT/ITL/TPOT/normalized TPOT/E2E and throughput;
//! * [`baseline`]: [`crate::baseline`]'s latency added and requests/s ratio against the first
//!   target, stage by stage;
//! * [`output`] and [`plot`]: `report.json`, `report.csv` and SVG charts.

pub mod baseline;
pub mod client;
pub mod config;
pub mod output;
pub mod plot;
pub mod prompts;
pub mod report;
mod runner;
pub mod sse;
mod workload;

#[cfg(test)]
mod run_tests;

use std::path::{Path, PathBuf};

use anyhow::Context;

pub use config::LoadtestConfig;
pub use report::Report;

/// Command-line arguments of `portcullis loadtest`.
#[derive(Debug, Clone, clap::Args)]
pub struct LoadtestArgs {
    /// Load test configuration (YAML).
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Where report.json, report.csv and the charts are written.
    #[arg(long, default_value = "./loadtest-results")]
    pub output_dir: PathBuf,
    /// Do not draw progress bars.
    #[arg(long)]
    pub no_progress: bool,
}

/// Runs the load test described by `args.file` and prints a summary.
pub async fn run(args: LoadtestArgs) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let config = LoadtestConfig::parse(&text).with_context(|| format!("in {}", args.file.display()))?;
    let report = runner::execute(&config, !args.no_progress).await?;
    let written = output::write_all(&report, &args.output_dir)?;
    for target in &report.targets {
        for stage in &target.stages {
            println!("{}", runner::describe(&target.name, stage));
        }
    }
    for path in written {
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// Runs `config` without progress bars and writes every output into `output_dir`.
pub async fn run_config(config: LoadtestConfig, output_dir: &Path) -> anyhow::Result<Report> {
    config.validate()?;
    let report = runner::execute(&config, false).await?;
    output::write_all(&report, output_dir)?;
    Ok(report)
}
