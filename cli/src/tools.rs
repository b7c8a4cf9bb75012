//! Test servers and benchmarks (the code lives in `portcullis-loadtest`).

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Args, Subcommand};
use portcullis_loadtest::{floor, mcp, sim, vllm};

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

pub async fn forward_floor(args: floor::FloorArgs) -> anyhow::Result<()> {
    let address = floor::start(&args)?;
    eprintln!(
        "reference forwarder ({:?}) listening on {address}, forwarding to {}",
        args.engine, args.upstream
    );
    crate::signal::terminated().await;
    Ok(())
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
