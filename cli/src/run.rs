//! The long-running commands: `up`, `controlplane`, `proxy`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use portcullis_controlplane::{ControlPlane, ControlPlaneConfig};
use portcullis_dataplane::{AccessLogConfig, AccessLogDestination, Proxy, ProxyConfig, TelemetryConfig};

use crate::admin::{apply_objects, print_changes, read_objects};
use crate::admin_client::Admin;

#[derive(Args)]
pub struct UpArgs {
    /// Objects to apply once the control plane is up.
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    /// Where the control plane keeps its data and the proxy its config cache.
    #[arg(long, default_value = ".portcullis")]
    pub data_dir: PathBuf,
    /// Admin API (gRPC) of the embedded control plane.
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub admin_listen: SocketAddr,
    /// Health and status endpoints of the embedded proxy.
    #[arg(long, default_value = "127.0.0.1:7071")]
    pub proxy_admin_listen: SocketAddr,
    /// Prometheus metrics (GET /metrics) of the embedded control plane.
    #[arg(long, default_value = "127.0.0.1:7072")]
    pub metrics_listen: SocketAddr,
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub drain_grace: Duration,
    /// Threads serving traffic, each with its own runtime and connections; 0: one per core.
    #[arg(long, env = "PORTCULLIS_WORKERS", default_value_t = 0)]
    pub workers: usize,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

/// The proxy's access log and trace export; metrics are always on its admin port.
#[derive(Args)]
pub struct TelemetryArgs {
    /// One JSON line per request: `off`, `stdout`, or a file path (appended to).
    #[arg(long, default_value = "off")]
    pub access_log: String,
    /// Fraction of requests logged (0–1); server errors (5xx) are always logged.
    #[arg(long, default_value_t = 1.0)]
    pub access_log_sample: f64,
    /// OTLP/gRPC collector for request spans, e.g. http://127.0.0.1:4317; none: no export.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

impl TelemetryArgs {
    fn config(self, proxy_id: &str) -> anyhow::Result<TelemetryConfig> {
        if !(0.0..=1.0).contains(&self.access_log_sample) {
            anyhow::bail!("--access-log-sample must be between 0 and 1");
        }
        let destination = match self.access_log.as_str() {
            "off" => AccessLogDestination::Off,
            "stdout" => AccessLogDestination::Stdout,
            path => AccessLogDestination::File(PathBuf::from(path)),
        };
        Ok(TelemetryConfig {
            access_log: AccessLogConfig {
                destination,
                sample: self.access_log_sample,
            },
            otlp_endpoint: self.otlp_endpoint,
            service_name: "portcullis-proxy".to_string(),
            proxy_id: proxy_id.to_string(),
        })
    }
}

#[derive(Args)]
pub struct ControlPlaneArgs {
    /// Raft node id, unique in the cluster.
    #[arg(long, default_value_t = 1)]
    pub node_id: u64,
    /// Serves the admin API, the config stream, Raft and gRPC health.
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Address other nodes and clients use to reach this one (defaults to --listen).
    #[arg(long)]
    pub advertise: Option<String>,
    #[arg(long, default_value = ".portcullis/controlplane")]
    pub data_dir: PathBuf,
    /// Start without forming a cluster, waiting to be added to one with AddNode.
    #[arg(long)]
    pub join: bool,
    /// Serves Prometheus metrics (GET /metrics).
    #[arg(long, default_value = "127.0.0.1:7072")]
    pub metrics_listen: SocketAddr,
    /// How long a disconnected proxy stays in `portcullis status`.
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    pub forget_proxies_after: Duration,
}

#[derive(Args)]
pub struct ProxyArgs {
    /// Control-plane nodes, comma-separated (any node serves the config; when the one in use
    /// fails, the proxy moves to the next without restarting).
    #[arg(
        long,
        env = "PORTCULLIS_CONTROLPLANE",
        default_value = "127.0.0.1:7070",
        value_delimiter = ','
    )]
    pub controlplane: Vec<String>,
    /// Name shown in `portcullis status` (e.g. the pod name); defaults to proxy-<pid>.
    #[arg(long, env = "PORTCULLIS_PROXY_ID")]
    pub id: Option<String>,
    /// Serve only Listeners with this label (KEY=VALUE, repeatable).
    #[arg(long = "shard", value_parser = parse_label)]
    pub shard: Vec<(String, String)>,
    /// Health (/livez, /readyz), status and metrics endpoints; other replicas hand MCP
    /// answers over here too (see --peer-address).
    #[arg(long, default_value = "127.0.0.1:7071")]
    pub admin_listen: SocketAddr,
    /// Keep the last good config here, to serve it after a restart while the control plane is down.
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// How long in-flight requests may take to finish after SIGTERM.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub drain_grace: Duration,
    /// Threads serving traffic, each with its own runtime and connections; 0: one per core.
    #[arg(long, env = "PORTCULLIS_WORKERS", default_value_t = 0)]
    pub workers: usize,
    /// Where the other proxy replicas reach this one's admin port, to hand it MCP clients'
    /// answers that reached them: HOST:PORT, or an IP address (e.g. the pod IP) for the
    /// --admin-listen port; defaults to --admin-listen unless that is 0.0.0.0, [::] or loopback.
    #[arg(long, env = "PORTCULLIS_PEER_ADDRESS")]
    pub peer_address: Option<String>,
    #[command(flatten)]
    pub telemetry: TelemetryArgs,
}

fn parse_label(text: &str) -> Result<(String, String), String> {
    text.split_once('=')
        .map(|(key, value)| (key.to_string(), value.to_string()))
        .ok_or_else(|| format!("expected KEY=VALUE, got {text:?}"))
}

pub async fn up(args: UpArgs) -> anyhow::Result<()> {
    // Read the file before starting anything, so a typo fails fast and changes nothing.
    let objects = args.file.as_ref().map(read_objects).transpose()?;
    let controlplane = ControlPlane::start(ControlPlaneConfig {
        node_id: 1,
        listen: args.admin_listen,
        advertise: None,
        data_dir: args.data_dir.join("controlplane"),
        join: false,
        metrics_listen: Some(args.metrics_listen),
        forget_proxies_after: portcullis_controlplane::DEFAULT_FORGET_AFTER,
    })
    .await
    .context("starting the control plane")?;
    let endpoint = format!("http://{}", controlplane.local_addr());
    eprintln!(
        "control plane: admin API on {endpoint}, data in {}",
        args.data_dir.join("controlplane").display()
    );
    if let Some(metrics) = controlplane.metrics_addr() {
        eprintln!("control plane: metrics on http://{metrics}/metrics");
    }
    if let Some(objects) = objects {
        match apply_objects(&Admin::new(&endpoint), objects, None).await {
            Ok(response) => print_changes(&response),
            Err(error) => {
                let _ = controlplane.shutdown().await;
                return Err(error.context("applying the file"));
            }
        }
    }
    let proxy_id = "embedded";
    let proxy = Proxy::start(ProxyConfig {
        proxy_id: proxy_id.to_string(),
        controlplanes: vec![endpoint],
        shard: BTreeMap::new(),
        admin_listen: args.proxy_admin_listen,
        cache_dir: Some(args.data_dir.join("proxy")),
        drain_grace: args.drain_grace,
        workers: args.workers,
        peer_address: None,
        telemetry: args.telemetry.config(proxy_id)?,
    })
    .await
    .context("starting the proxy")?;
    eprintln!(
        "proxy: health on http://{}/readyz; Ctrl-C to stop",
        proxy.admin_addr()
    );
    crate::signal::terminated().await;
    eprintln!("draining…");
    // The control plane stops even if the proxy did not drain cleanly: its storage is flushed
    // and its lock freed either way.
    let drained = proxy.shutdown().await.context("draining the proxy");
    let stopped = controlplane
        .shutdown()
        .await
        .context("stopping the control plane");
    if let (Err(_), Err(error)) = (&drained, &stopped) {
        eprintln!("error: {error:#}");
    }
    drained.and(stopped)
}

pub async fn controlplane(args: ControlPlaneArgs) -> anyhow::Result<()> {
    let controlplane = ControlPlane::start(ControlPlaneConfig {
        node_id: args.node_id,
        listen: args.listen,
        advertise: args.advertise,
        data_dir: args.data_dir,
        join: args.join,
        metrics_listen: Some(args.metrics_listen),
        forget_proxies_after: args.forget_proxies_after,
    })
    .await
    .context("starting the control plane")?;
    eprintln!(
        "control plane node {} serving on {}",
        args.node_id,
        controlplane.local_addr()
    );
    if let Some(metrics) = controlplane.metrics_addr() {
        eprintln!("metrics on http://{metrics}/metrics");
    }
    crate::signal::terminated().await;
    controlplane.shutdown().await
}

pub async fn proxy(args: ProxyArgs) -> anyhow::Result<()> {
    let controlplanes = args
        .controlplane
        .iter()
        .map(|address| crate::admin_client::with_scheme(address.trim()))
        .collect();
    let proxy_id = args.id.unwrap_or_else(|| format!("proxy-{}", std::process::id()));
    let proxy = Proxy::start(ProxyConfig {
        telemetry: args.telemetry.config(&proxy_id)?,
        proxy_id,
        controlplanes,
        shard: args.shard.into_iter().collect(),
        admin_listen: args.admin_listen,
        cache_dir: args.cache_dir,
        drain_grace: args.drain_grace,
        workers: args.workers,
        peer_address: args.peer_address,
    })
    .await
    .context("starting the proxy")?;
    eprintln!("proxy: health on http://{}/readyz", proxy.admin_addr());
    crate::signal::terminated().await;
    eprintln!("draining…");
    proxy.shutdown().await
}
