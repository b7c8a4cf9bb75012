//! One control-plane node: sled + Raft + the gRPC server (Admin, ConfigStream, Raft and
//! health on one port).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use openraft::{BasicNode, SnapshotPolicy};
use portcullis_proto::v1::admin_server::AdminServer;
use portcullis_proto::v1::config_stream_server::ConfigStreamServer;
use portcullis_proto::v1::placement_exchange_server::PlacementExchangeServer;
use portcullis_proto::v1::raft_server::RaftServer;
use portcullis_proto::v1::signal_stream_server::SignalStreamServer;
use portcullis_proto::v1::RaftGroup;
use portcullis_proto::MAX_MESSAGE_BYTES;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::admin::AdminService;
use crate::metrics::{Metrics, MetricsListener, MetricsServer};
use crate::network::{NetworkFactory, RaftService};
use crate::placements::{Placements, MAX_REPORT_BYTES};
use crate::registry::ProxyRegistry;
use crate::signals::{SignalStreamService, Signals, VOTE_EMBARGO};
use crate::store::{LogStore, StateMachineStore, Storage};
use crate::stream::ConfigStreamService;
use crate::types::Raft;
use crate::view::ConfigView;

pub(crate) mod standing;

use self::standing::Standing;

/// How long shutdown waits for in-flight requests before dropping connections.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Snapshot bytes per InstallSnapshot request. Raft messages carry JSON, where a chunk (a
/// JSON number array) grows to several times its size, still far below [`MAX_MESSAGE_BYTES`].
const SNAPSHOT_CHUNK: u64 = 1024 * 1024;

#[derive(Debug, Clone)]
pub struct ControlPlaneConfig {
    pub node_id: u64,
    pub listen: SocketAddr,
    /// Address other nodes and clients use to reach this node; defaults to the bound address.
    pub advertise: Option<String>,
    pub data_dir: PathBuf,
    /// Start without initializing a cluster, waiting to be added to one with AddNode.
    pub join: bool,
    /// Serves Prometheus metrics on `GET /metrics`; `None` serves none.
    pub metrics_listen: Option<SocketAddr>,
    /// How long a disconnected proxy stays in `portcullis status`.
    pub forget_proxies_after: Duration,
}

pub struct ControlPlane {
    local_addr: SocketAddr,
    raft: Raft,
    signals: Signals,
    placements: Placements,
    storage: Storage,
    shutdown: watch::Sender<bool>,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    health: JoinHandle<()>,
    sampler: JoinHandle<()>,
    metrics: Option<MetricsServer>,
    /// This node's config, for tests that drive its parts directly.
    #[cfg(test)]
    view: watch::Receiver<ConfigView>,
}

fn raft_config() -> anyhow::Result<Arc<openraft::Config>> {
    let config = openraft::Config {
        cluster_name: "portcullis".to_string(),
        heartbeat_interval: 250,
        election_timeout_min: 1000,
        election_timeout_max: 2000,
        install_snapshot_timeout: 2000,
        snapshot_policy: SnapshotPolicy::LogsSinceLast(1000),
        // Keeping few logs beyond the snapshot keeps compaction honest (and exercised).
        max_in_snapshot_log_to_keep: 100,
        snapshot_max_chunk_size: SNAPSHOT_CHUNK,
        ..Default::default()
    };
    Ok(Arc::new(config.validate().context("invalid Raft config")?))
}

impl ControlPlane {
    /// Opens the sled DB under `data_dir`, starts Raft and serves Admin, ConfigStream, Raft
    /// and grpc.health.v1 on `listen`. A pristine node (unless `join`) initializes a
    /// single-node cluster with itself as the only voter.
    pub async fn start(config: ControlPlaneConfig) -> anyhow::Result<ControlPlane> {
        // Bound before storage is opened: a taken port then fails the start with nothing to undo.
        let metrics_listener = match config.metrics_listen {
            Some(addr) => Some(MetricsListener::bind(addr).await?),
            None => None,
        };
        std::fs::create_dir_all(&config.data_dir)
            .with_context(|| format!("creating data dir {}", config.data_dir.display()))?;
        let storage = Storage::open(&config.data_dir.join("raft"))?;
        let log = LogStore::open(&storage).context("opening Raft log")?;
        let state_machine = StateMachineStore::open(&storage)?;
        let view = state_machine.subscribe();
        #[cfg(test)]
        let state_machine_view = view.clone();
        let raft = Raft::new(
            config.node_id,
            raft_config()?,
            NetworkFactory::new(RaftGroup::Config),
            log,
            state_machine,
        )
        .await
        .context("starting Raft")?;

        let listener = TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("binding {}", config.listen))?;
        let local_addr = listener.local_addr().context("reading bound address")?;
        let advertise = config.advertise.clone().unwrap_or_else(|| local_addr.to_string());

        if !config.join && !raft.is_initialized().await.context("reading Raft state")? {
            let members = BTreeMap::from([(config.node_id, BasicNode::new(&advertise))]);
            raft.initialize(members)
                .await
                .context("initializing single-node cluster")?;
            tracing::info!(node_id = config.node_id, %advertise, "initialized new cluster");
        }

        let (shutdown, shutdown_rx) = watch::channel(false);
        let registry = ProxyRegistry::new(config.forget_proxies_after);
        let metrics = Metrics::default();
        let signals = Signals::start(config.node_id, raft.clone(), view.clone(), metrics.clone()).await?;
        let placements = Placements::start(config.node_id, raft.clone(), metrics.clone());
        let (reporter, health_service) = tonic_health::server::health_reporter();
        reporter.set_service_status("", ServingStatus::NotServing).await;
        let (standing, sampler) = standing::watch(raft.clone());
        let health = tokio::spawn(report_health(standing.clone(), reporter));
        let streamed = ConfigView::streamed(view.clone(), shutdown_rx.clone());

        let server = tonic::transport::Server::builder()
            // A proxy (or node) that vanished without closing its connection is noticed, so
            // its stream ends and its id is free for the proxy that replaces it.
            .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
            .add_service(health_service)
            .add_service(
                AdminServer::new(AdminService::new(
                    raft.clone(),
                    view.clone(),
                    registry.clone(),
                    metrics.clone(),
                ))
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            )
            .add_service(
                ConfigStreamServer::new(ConfigStreamService::new(
                    raft.clone(),
                    view.clone(),
                    streamed.clone(),
                    standing,
                    registry.clone(),
                    shutdown_rx.clone(),
                    metrics.clone(),
                ))
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            )
            .add_service(
                // A batch carries every moved pool of a proxy's shard; proxies accept up to
                // the same limit.
                SignalStreamServer::new(SignalStreamService::new(
                    signals.subscribe(),
                    streamed.clone(),
                    shutdown_rx.clone(),
                    metrics.clone(),
                ))
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            )
            .add_service(
                PlacementExchangeServer::new(placements.service(
                    streamed,
                    shutdown_rx.clone(),
                    metrics.clone(),
                ))
                .max_decoding_message_size(MAX_REPORT_BYTES),
            )
            .add_service(
                RaftServer::new(RaftService::new(
                    raft.clone(),
                    signals.raft().clone(),
                    VOTE_EMBARGO,
                ))
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            )
            .serve_with_incoming_shutdown(
                // tonic applies no socket options to an incoming stream it is handed; without
                // NODELAY a small answer (a Raft ACK, a write's result) can wait for the peer's
                // ACK of the previous segment.
                TcpIncoming::from(listener).with_nodelay(Some(true)),
                wait_for_shutdown(shutdown_rx),
            );
        let metrics = metrics_listener
            .map(|listener| listener.serve(metrics.registry(raft.metrics(), view, registry), SHUTDOWN_GRACE));
        let server = tokio::spawn(server);
        tracing::info!(node_id = config.node_id, %local_addr, "control plane serving");

        Ok(ControlPlane {
            local_addr,
            raft,
            signals,
            placements,
            storage,
            shutdown,
            server,
            health,
            sampler,
            metrics,
            #[cfg(test)]
            view: state_machine_view,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Where `GET /metrics` is served, if `metrics_listen` was set.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(MetricsServer::local_addr)
    }

    /// Stops the metrics server and the gRPC server (ending proxy streams), then Raft, then
    /// flushes sled. Every step runs whatever the ones before it met, so a failed server still
    /// leaves the log flushed and the storage lock free; the first error is returned, the
    /// others logged.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.health.abort();
        self.sampler.abort();
        if let Some(metrics) = self.metrics {
            metrics.shutdown().await;
        }
        self.shutdown.send_replace(true);
        let mut server = self.server;
        let served = match tokio::time::timeout(SHUTDOWN_GRACE, &mut server).await {
            Ok(joined) => joined
                .context("server task failed")
                .and_then(|served| served.context("gRPC server failed")),
            Err(_) => {
                tracing::warn!("gRPC server did not stop in time; dropping its connections");
                server.abort();
                Ok(())
            }
        };
        self.placements.shutdown();
        let signals = self.signals.shutdown().await;
        let raft = self.raft.shutdown().await.context("stopping Raft");
        let storage = self
            .storage
            .close(SHUTDOWN_GRACE)
            .await
            .context("closing Raft storage");
        let mut errors = [served, signals, raft, storage]
            .into_iter()
            .filter_map(Result::err);
        let first = errors.next();
        for error in errors {
            tracing::warn!(error = %format_args!("{error:#}"), "a further step of shutdown failed");
        }
        first.map_or(Ok(()), Err)
    }
}

async fn wait_for_shutdown(mut shutdown: watch::Receiver<bool>) {
    // An error means the sender is gone, which is also a reason to stop.
    let _ = shutdown.wait_for(|stop| *stop).await;
}

/// Health is SERVING while writes can succeed through this node (see [`Standing`]), and
/// follows it as it is lost and regained.
async fn report_health(
    mut standing: watch::Receiver<Standing>,
    reporter: tonic_health::server::HealthReporter,
) {
    loop {
        if standing.borrow_and_update().in_touch {
            reporter.set_service_status("", ServingStatus::Serving).await;
            reporter.set_serving::<AdminServer<AdminService>>().await;
        } else {
            reporter.set_service_status("", ServingStatus::NotServing).await;
            reporter.set_not_serving::<AdminServer<AdminService>>().await;
        }
        // An error means the sampler stopped: the node is shutting down.
        if standing.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests;
