//! Test servers and benchmarks (the code lives in `portcullis-loadtest`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use portcullis_loadtest::http::{compare, CompareOptions};
use portcullis_loadtest::{mcp, sim, vllm};

#[derive(Args)]
pub struct EchoArgs {
    #[arg(long, default_value = "127.0.0.1:9001")]
    pub listen: SocketAddr,
    /// Name reported in every echo, to tell upstreams apart.
    #[arg(long, default_value = "echo")]
    pub name: String,
}

pub async fn echo(args: EchoArgs) -> anyhow::Result<()> {
    let listener = portcullis_loadtest::echo::bind(args.listen).await?;
    eprintln!(
        "echo server {:?} listening on {}",
        args.name,
        listener.local_addr()?
    );
    tokio::select! {
        served = portcullis_loadtest::echo::serve(listener, args.name) => served,
        () = crate::signal::terminated() => Ok(()),
    }
}

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Closed-loop HTTP load against several targets in one run, compared with the first.
    Http(HttpBenchArgs),
}

#[derive(Args)]
pub struct HttpBenchArgs {
    /// NAME=URL, repeated; the first is the baseline (e.g. direct=http://127.0.0.1:9001/bench).
    #[arg(long = "target", required = true)]
    pub targets: Vec<String>,
    /// Length of each phase per target and round.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    #[arg(long, default_value_t = 1)]
    pub latency_connections: usize,
    #[arg(long, default_value_t = 64)]
    pub throughput_connections: usize,
    /// Also write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

pub async fn bench(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Http(args) => {
            let mut targets = Vec::new();
            for target in &args.targets {
                let (name, url) = target
                    .split_once('=')
                    .with_context(|| format!("--target {target:?}: expected NAME=URL"))?;
                let url = url
                    .parse()
                    .with_context(|| format!("--target {target:?}: invalid URL"))?;
                targets.push((name.to_string(), url));
            }
            let options = CompareOptions {
                targets,
                latency_connections: args.latency_connections,
                throughput_connections: args.throughput_connections,
                duration: args.duration,
                rounds: args.rounds,
            };
            let report = compare(&options).await?;
            print!("{}", report.table());
            if let Some(path) = args.json {
                std::fs::write(&path, serde_json::to_string_pretty(&report)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            Ok(())
        }
    }
}

#[derive(Subcommand)]
pub enum SimCommand {
    /// A fleet and its routers in virtual time, no network: compares routing policies.
    Virtual(sim::VirtualArgs),
    /// Simulated vLLM pods serving the OpenAI API, /metrics and LoRA endpoints over HTTP.
    Vllm(vllm::VllmSimArgs),
}

pub async fn sim(command: SimCommand) -> anyhow::Result<()> {
    match command {
        SimCommand::Virtual(args) => {
            // CPU-bound for seconds to minutes: keep it off the async workers.
            let report = tokio::task::spawn_blocking(move || sim::run_command(&args))
                .await
                .context("the simulation thread panicked")??;
            print!("{}", sim::table(&report));
            Ok(())
        }
        SimCommand::Vllm(args) => {
            let config = vllm::VllmSimConfig::from_args(&args)?;
            let time_scale = config.time_scale;
            let fleet = vllm::start(config).await?;
            for addr in fleet.addrs() {
                eprintln!("simulated vLLM pod on http://{addr} (time scale {time_scale})");
            }
            crate::signal::terminated().await;
            fleet.shutdown().await;
            Ok(())
        }
    }
}

pub async fn mcp_server(args: mcp::McpServerArgs) -> anyhow::Result<()> {
    tokio::select! {
        served = mcp::serve(args) => served,
        () = crate::signal::terminated() => Ok(()),
    }
}
