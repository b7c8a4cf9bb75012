//! `portcullis`: one binary for the control plane, the proxy, the embedded single-node mode
//! (`up`), the admin commands, and the test servers and benchmarks.

mod admin;
mod admin_client;
mod mcp;
mod run;
mod signal;
mod tools;

use std::process::ExitCode;

/// The proxy allocates and frees small buffers on every request; mimalloc's per-thread
/// free lists cost less there than glibc's allocator (measured in docs/benchmarks/http.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "portcullis",
    version,
    about = "A gateway for AI traffic: MCP, A2A and LLM APIs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a single-node control plane and a proxy in one process (the embedded default).
    Up(run::UpArgs),
    /// Run a control-plane node.
    Controlplane(run::ControlPlaneArgs),
    /// Run a proxy subscribed to a control plane.
    Proxy(run::ProxyArgs),
    /// Create or update the objects in a file, all or nothing.
    Apply(admin::ApplyArgs),
    /// Check the objects in a file against the current config without changing it.
    Validate(admin::ValidateArgs),
    /// Show objects as YAML or JSON.
    Get(admin::GetArgs),
    /// Delete an object.
    Delete(admin::DeleteArgs),
    /// Control-plane membership: status, add a node, remove a node.
    #[command(subcommand)]
    Cluster(admin::ClusterCommand),
    /// Show the config version, the cluster and what each proxy has applied.
    Status(admin::StatusArgs),
    /// MCP helpers: `mcp pin` writes McpToolPins from what an McpBackend's servers offer.
    #[command(subcommand)]
    Mcp(mcp::McpCommand),
    /// Run the built-in upstream test server (echo, SSE, delays).
    Echo(tools::EchoArgs),
    /// Simulated vLLM fleets.
    #[command(subcommand)]
    Sim(tools::SimCommand),
    /// Run the MCP test server (both protocol eras, N tools, a processing delay).
    McpServer(portcullis_loadtest::mcp::McpServerArgs),
    /// Run the reference guardrail checker (gRPC; `--behave` for failure tests).
    GuardrailServer(portcullis_loadtest::guardrail::GuardrailServerArgs),
    /// Run a load scenario (LLM or MCP; inference-perf style) against one or more targets.
    Loadtest(portcullis_loadtest::llm::LoadtestArgs),
    /// Measure a running control plane's config fan-out: many subscribers, a large config, a
    /// stream of writes (loadtest/fanout-bench.sh runs it against a 3-node cluster).
    FanoutBench(portcullis_loadtest::fanout::FanoutBenchArgs),
    /// Run a reference forwarder that loadtest/http-bench.sh measures beside Portcullis: the
    /// least an HTTP/1.1 proxy on tokio does per request. Not a proxy to deploy.
    ForwardFloor(portcullis_loadtest::floor::FloorArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("PORTCULLIS_LOG").unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("info,openraft=warn,sled=warn,h2=warn")
            }),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        match cli.command {
            Command::Up(args) => run::up(args).await,
            Command::Controlplane(args) => run::controlplane(args).await,
            Command::Proxy(args) => run::proxy(args).await,
            Command::Apply(args) => admin::apply(args).await,
            Command::Validate(args) => admin::validate(args).await,
            Command::Get(args) => admin::get(args).await,
            Command::Delete(args) => admin::delete(args).await,
            Command::Status(args) => admin::status(args).await,
            Command::Mcp(command) => mcp::run(command).await,
            Command::Cluster(command) => admin::cluster(command).await,
            Command::Echo(args) => tools::echo(args).await,
            Command::Sim(command) => tools::sim(command).await,
            Command::McpServer(args) => tools::mcp_server(args).await,
            Command::GuardrailServer(args) => {
                portcullis_loadtest::guardrail::serve(args, crate::signal::terminated()).await
            }
            Command::Loadtest(args) => portcullis_loadtest::llm::run(args).await,
            Command::FanoutBench(args) => portcullis_loadtest::fanout::run(args).await,
            Command::ForwardFloor(args) => tools::forward_floor(args).await,
        }
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
