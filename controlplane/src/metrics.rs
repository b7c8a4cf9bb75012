//! Prometheus metrics of one control-plane node, served as OpenMetrics text on `GET /metrics`
//! from their own address, so scraping needs no gRPC and exposes nothing of the Admin API.
//!
//! Raft, config-version and proxy gauges are read at scrape time from the same watch channels
//! and registry the node already keeps: they cannot drift from what `portcullis status` says,
//! and no task has to follow them. Only events (config-stream messages, admin writes) are
//! counted as they happen.

use std::convert::Infallible;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use openraft::{BasicNode, RaftMetrics, ServerState};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};
use tonic::{Code, Status};

use crate::registry::ProxyRegistry;
use crate::types::NodeId;
use crate::view::ConfigView;

const OPENMETRICS_TEXT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A client that opens a connection and never finishes its request headers must not hold a
/// task and a socket forever.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AdminLabels {
    method: &'static str,
    code: &'static str,
}

/// The counters the services update. Cheap to clone: every clone counts into the same values.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    stream_messages: Family<MessageLabels, Counter>,
    stream_bytes: Family<MessageLabels, Counter>,
    stream_acks: Counter,
    stream_nacks: Counter,
    admin_requests: Family<AdminLabels, Counter>,
    write_entries: Counter,
    writes_proposed: Counter,
    signal_entries: Counter,
    signal_entry_bytes: Counter,
    signal_write_failures: Counter,
    signal_scrapes: Family<ScrapeLabels, Counter>,
    signal_batches_sent: Counter,
    placement_batches: Family<PlacementLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PlacementLabels {
    /// `received` (from this node's proxies or from another node), `sent` (to a proxy or a
    /// node) or `dropped` (for a receiver too far behind).
    event: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MessageLabels {
    /// `whole` or `delta`.
    form: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ScrapeLabels {
    result: &'static str,
}

impl Metrics {
    /// One config message sent, `bytes` long as protobuf.
    pub fn config_sent(&self, delta: bool, bytes: usize) {
        let labels = MessageLabels {
            form: if delta { "delta" } else { "whole" },
        };
        self.stream_messages.get_or_create(&labels).inc();
        self.stream_bytes.get_or_create(&labels).inc_by(bytes as u64);
    }

    pub fn ack_received(&self) {
        self.stream_acks.inc();
    }

    pub fn nack_received(&self) {
        self.stream_nacks.inc();
    }

    /// One signals-log entry committed, `bytes` long as JSON.
    pub fn signals_committed(&self, bytes: usize) {
        self.signal_entries.inc();
        self.signal_entry_bytes.inc_by(bytes as u64);
    }

    pub fn signals_failed(&self) {
        self.signal_write_failures.inc();
    }

    pub fn signal_scraped(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.signal_scrapes.get_or_create(&ScrapeLabels { result }).inc();
    }

    pub fn signals_sent(&self) {
        self.signal_batches_sent.inc();
    }

    /// `count` batches of prefix placements `event` (`received`, `sent` or `dropped`).
    pub fn placement_batches(&self, event: &'static str, count: u64) {
        self.placement_batches
            .get_or_create(&PlacementLabels { event })
            .inc_by(count);
    }

    /// Counts one Admin write by its outcome and hands the outcome back unchanged.
    pub fn admin_write<T>(&self, method: &'static str, result: Result<T, Status>) -> Result<T, Status> {
        let code = match &result {
            Ok(_) => Code::Ok,
            Err(status) => status.code(),
        };
        self.admin_requests
            .get_or_create(&AdminLabels {
                method,
                code: code_name(code),
            })
            .inc();
        result
    }

    /// One Raft entry handed to Raft for `writes` Admin writes, to commit together.
    pub fn write_entry_proposed(&self, writes: usize) {
        self.write_entries.inc();
        self.writes_proposed.inc_by(writes as u64);
    }

    /// The registry a scrape encodes: these counters plus the node's live state.
    pub fn registry(
        &self,
        raft: watch::Receiver<RaftMetrics<NodeId, BasicNode>>,
        view: watch::Receiver<ConfigView>,
        proxies: ProxyRegistry,
    ) -> Registry {
        let mut registry = Registry::default();
        // Counter names get their `_total` suffix from the encoder.
        registry.register(
            "portcullis_config_stream_messages",
            "Config versions sent to proxies on the config stream, whole or as deltas",
            self.stream_messages.clone(),
        );
        registry.register(
            "portcullis_config_stream_bytes",
            "Protobuf bytes of the config versions sent to proxies, whole or as deltas",
            self.stream_bytes.clone(),
        );
        registry.register(
            "portcullis_config_stream_acks",
            "ACKs received from proxies on the config stream",
            self.stream_acks.clone(),
        );
        registry.register(
            "portcullis_config_stream_nacks",
            "NACKs received from proxies on the config stream",
            self.stream_nacks.clone(),
        );
        registry.register(
            "portcullis_admin_requests",
            "Admin API writes (Apply, Delete, AddNode) by gRPC method and status code",
            self.admin_requests.clone(),
        );
        registry.register(
            "portcullis_admin_write_entries",
            "Raft entries this node handed to Raft for Admin writes (Apply, Delete), retries included; writes queued behind one commit go together in the next entry",
            self.write_entries.clone(),
        );
        registry.register(
            "portcullis_admin_writes_proposed",
            "Admin writes (Apply, Delete) in the entries this node handed to Raft, retries included",
            self.writes_proposed.clone(),
        );
        registry.register(
            "portcullis_signals_entries",
            "Entries committed to the signals log (this node leading the signals group)",
            self.signal_entries.clone(),
        );
        registry.register(
            "portcullis_signals_entry_bytes",
            "Bytes of the signals-log entries committed (JSON, as replicated)",
            self.signal_entry_bytes.clone(),
        );
        registry.register(
            "portcullis_signals_write_failures",
            "Signals-log writes that failed while this node led the signals group",
            self.signal_write_failures.clone(),
        );
        registry.register(
            "portcullis_signals_scrapes",
            "Reads of inference pods' /metrics, by result",
            self.signal_scrapes.clone(),
        );
        registry.register(
            "portcullis_signals_batches_sent",
            "Signal batches sent to proxies on the signal stream",
            self.signal_batches_sent.clone(),
        );
        registry.register(
            "portcullis_placement_batches",
            "Batches of prefix placements relayed between proxies, by event",
            self.placement_batches.clone(),
        );
        registry.register_collector(Box::new(NodeCollector { raft, view, proxies }));
        registry
    }
}

/// gRPC status names as other gRPC servers report them in metrics (Go's `codes.Code`), so
/// dashboards can share queries.
fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

/// Reads the node's state at scrape time. Holds only watch receivers and the in-memory proxy
/// registry, never storage, so a lingering scrape cannot keep the sled database locked.
#[derive(Debug)]
struct NodeCollector {
    raft: watch::Receiver<RaftMetrics<NodeId, BasicNode>>,
    view: watch::Receiver<ConfigView>,
    proxies: ProxyRegistry,
}

fn gauge(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: u64) -> fmt::Result {
    let gauge = ConstGauge::new(value);
    gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)
}

impl Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        // Copy out under the borrow: the watch lock must not be held while encoding.
        let (term, applied, last_log, leader, is_leader) = {
            let raft = self.raft.borrow();
            (
                raft.current_term,
                raft.last_applied.map_or(0, |id| id.index),
                raft.last_log_index.unwrap_or(0),
                raft.current_leader,
                raft.state == ServerState::Leader,
            )
        };
        let version = self.view.borrow().version;

        gauge(&mut encoder, "portcullis_raft_term", "Current Raft term.", term)?;
        // openraft 0.9 does not publish the commit index; a node applies entries as soon as
        // it learns they are committed, so the applied index is the closest it reports.
        gauge(
            &mut encoder,
            "portcullis_raft_commit_index",
            "Highest log index known committed on this node (its last applied index).",
            applied,
        )?;
        gauge(
            &mut encoder,
            "portcullis_raft_last_applied_index",
            "Last log index applied to this node's state machine.",
            applied,
        )?;
        gauge(
            &mut encoder,
            "portcullis_raft_last_log_index",
            "Last log index appended to this node's log.",
            last_log,
        )?;
        gauge(
            &mut encoder,
            "portcullis_raft_is_leader",
            "1 if this node is the Raft leader, else 0.",
            u64::from(is_leader),
        )?;
        // Absent while no leader is known: any number would name a node.
        if let Some(leader) = leader {
            gauge(
                &mut encoder,
                "portcullis_raft_leader_id",
                "Node id of the current Raft leader.",
                leader,
            )?;
        }
        gauge(
            &mut encoder,
            "portcullis_config_version",
            "Config version applied by this node's state machine.",
            version,
        )?;

        let (mut healthy, mut pending, mut rejecting, mut disconnected) = (0u64, 0u64, 0u64, 0u64);
        for status in self.proxies.statuses() {
            // The same states as `portcullis status`.
            match (status.connected, status.healthy) {
                (false, _) => disconnected += 1,
                (true, true) if status.applied_version < status.sent_version => pending += 1,
                (true, true) => healthy += 1,
                (true, false) => rejecting += 1,
            }
        }
        let family = ConstGauge::new(0u64);
        let mut proxies = encoder.encode_descriptor(
            "portcullis_proxies",
            "Proxies streaming from this node, or seen by it within --forget-proxies-after, by state.",
            None,
            family.metric_type(),
        )?;
        // Every state is always present, so a state dropping to zero is a sample, not a gap.
        for (state, count) in [
            ("healthy", healthy),
            ("pending", pending),
            ("rejecting", rejecting),
            ("disconnected", disconnected),
        ] {
            ConstGauge::new(count).encode(proxies.encode_family(&[("state", state)])?)?;
        }
        Ok(())
    }
}

/// The metrics socket, bound apart from serving so that a taken port fails a start before
/// anything else is opened, and serving cannot fail once the rest is running.
pub struct MetricsListener {
    listener: TcpListener,
    local_addr: SocketAddr,
}

impl MetricsListener {
    pub async fn bind(addr: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding metrics address {addr}"))?;
        let local_addr = listener.local_addr().context("reading bound metrics address")?;
        Ok(MetricsListener { listener, local_addr })
    }

    pub fn serve(self, registry: Registry, grace: Duration) -> MetricsServer {
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(serve(self.listener, Arc::new(registry), stopped, grace));
        tracing::info!(local_addr = %self.local_addr, "serving metrics on /metrics");
        MetricsServer {
            local_addr: self.local_addr,
            stop,
            task,
        }
    }
}

/// The HTTP server of `GET /metrics`. Dropping it also stops it.
pub struct MetricsServer {
    local_addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl MetricsServer {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting at once and returns when open connections have finished, or the grace
    /// has run out and they were closed.
    pub async fn shutdown(self) {
        let _ = self.stop.send(());
        if let Err(error) = self.task.await {
            tracing::warn!(%error, "metrics server task failed");
        }
    }
}

async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    mut stopped: oneshot::Receiver<()>,
    grace: Duration,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            // A dropped sender (the control plane was dropped) also stops the server.
            _ = &mut stopped => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let registry = registry.clone();
                    let service = service_fn(move |request| {
                        let response = handle(&registry, &request);
                        async move { Ok::<_, Infallible>(response) }
                    });
                    let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
                    connections.spawn(async move {
                        if let Err(error) = connection.await {
                            tracing::debug!(%peer, %error, "metrics connection ended with an error");
                        }
                    });
                }
                Err(error) => {
                    // Usually out of file descriptors: back off instead of spinning.
                    tracing::warn!(%error, "metrics accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        tracing::warn!("metrics connections still open after the grace; closing them");
    }
    connections.shutdown().await;
}

fn text(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

fn handle(registry: &Registry, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    if request.uri().path() != "/metrics" {
        return text(
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            "not found: metrics are served on GET /metrics\n",
        );
    }
    if request.method() != Method::GET {
        let mut response = text(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain; charset=utf-8",
            "method not allowed: use GET\n",
        );
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET"));
        return response;
    }
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, registry) {
        Ok(()) => text(StatusCode::OK, OPENMETRICS_TEXT, body),
        Err(error) => {
            tracing::warn!(%error, "encoding metrics failed");
            text(
                StatusCode::INTERNAL_SERVER_ERROR,
                "text/plain; charset=utf-8",
                "encoding metrics failed\n",
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::path::Path;
    use std::time::{Duration, Instant};

    use portcullis_proto::v1::proxy_message::Message;
    use portcullis_proto::v1::{Ack, Hello, Nack};
    use serde_json::json;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tonic::Code;

    use crate::command::tests::{backend, route};
    use crate::testutil::*;
    use crate::{ControlPlane, ControlPlaneConfig};

    async fn start_with_metrics(dir: &Path, metrics_listen: SocketAddr) -> ControlPlane {
        ControlPlane::start(ControlPlaneConfig {
            node_id: 1,
            listen: "127.0.0.1:0".parse().unwrap(),
            advertise: None,
            data_dir: dir.to_path_buf(),
            join: false,
            metrics_listen: Some(metrics_listen),
            forget_proxies_after: crate::DEFAULT_FORGET_AFTER,
        })
        .await
        .unwrap()
    }

    struct HttpResponse {
        status: u16,
        /// Status line and headers, lowercased.
        head: String,
        body: String,
    }

    /// Sends raw bytes and reads until the server closes the connection.
    async fn http(addr: SocketAddr, request: &str) -> HttpResponse {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut bytes = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut bytes))
            .await
            .expect("no complete answer within 10 s")
            .unwrap();
        let text = String::from_utf8(bytes).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        HttpResponse {
            status: head
                .split(' ')
                .nth(1)
                .and_then(|code| code.parse().ok())
                .unwrap_or(0),
            head: head.to_ascii_lowercase(),
            body: body.to_string(),
        }
    }

    fn request(method: &str, path: &str) -> String {
        format!("{method} {path} HTTP/1.1\r\nHost: metrics\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    }

    async fn scrape(addr: SocketAddr) -> String {
        let response = http(addr, &request("GET", "/metrics")).await;
        assert_eq!(response.status, 200, "{}", response.body);
        assert!(
            response
                .head
                .contains("content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"),
            "{}",
            response.head
        );
        assert!(response.body.ends_with("# EOF\n"), "{}", response.body);
        response.body
    }

    /// The value of `series` (name and labels exactly as exposed), if present.
    fn sample(body: &str, series: &str) -> Option<f64> {
        body.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    fn value(body: &str, series: &str) -> f64 {
        sample(body, series).unwrap_or_else(|| panic!("no sample {series} in:\n{body}"))
    }

    /// Scrapes until `done` holds (gauges follow openraft's metrics channel, which may lag a
    /// write's answer by a moment), failing the test after 10 s.
    async fn scrape_until(addr: SocketAddr, done: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let body = scrape(addr).await;
            if done(&body) {
                return body;
            }
            assert!(
                Instant::now() < deadline,
                "condition not reached; last scrape:\n{body}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[tokio::test]
    async fn scrape_follows_raft_config_writes_and_proxies() {
        let dir = tempfile::tempdir().unwrap();
        let node = start_with_metrics(dir.path(), "127.0.0.1:0".parse().unwrap()).await;
        let addr = node.metrics_addr().expect("metrics_listen was set");
        let mut client = admin(node.local_addr()).await;
        wait_for_leader(&mut client).await;

        let before = scrape_until(addr, |body| {
            sample(body, "portcullis_raft_is_leader") == Some(1.0)
        })
        .await;
        assert!(value(&before, "portcullis_raft_term") >= 1.0, "{before}");
        assert_eq!(value(&before, "portcullis_raft_leader_id"), 1.0);
        assert_eq!(value(&before, "portcullis_config_version"), 0.0);
        for state in ["healthy", "pending", "rejecting", "disconnected"] {
            assert_eq!(
                value(&before, &format!("portcullis_proxies{{state=\"{state}\"}}")),
                0.0
            );
        }
        let commit_before = value(&before, "portcullis_raft_commit_index");

        let objects = vec![
            listener("public", 8080, json!({})),
            backend("api", "127.0.0.1:9000"),
            route("web", "public", "api"),
        ];
        let applied = client
            .apply(apply_request(objects, None))
            .await
            .unwrap()
            .into_inner();
        let invalid = apply_request(vec![route("ops", "public", "missing")], None);
        assert_eq!(
            client.apply(invalid).await.unwrap_err().code(),
            Code::InvalidArgument
        );

        let after = scrape_until(addr, |body| {
            sample(body, "portcullis_raft_commit_index").is_some_and(|index| index > commit_before)
        })
        .await;
        assert_eq!(value(&after, "portcullis_config_version"), applied.version as f64);
        assert!(value(&after, "portcullis_config_version") > value(&before, "portcullis_config_version"));
        assert!(value(&after, "portcullis_raft_last_applied_index") > commit_before);
        assert!(
            value(&after, "portcullis_raft_last_log_index") >= value(&after, "portcullis_raft_commit_index")
        );
        assert!(value(&after, "portcullis_raft_term") >= 1.0);
        assert_eq!(value(&after, "portcullis_raft_is_leader"), 1.0);
        assert_eq!(
            value(
                &after,
                "portcullis_admin_requests_total{method=\"Apply\",code=\"OK\"}"
            ),
            1.0
        );
        assert_eq!(
            value(
                &after,
                "portcullis_admin_requests_total{method=\"Apply\",code=\"InvalidArgument\"}"
            ),
            1.0
        );

        // A proxy that ACKs, then NACKs, then goes away passes through every state.
        let (tx, mut stream) = subscribe(node.local_addr()).await;
        let hello = Hello {
            proxy_id: "edge-1".into(),
            shard: Default::default(),
            last_version: 0,
            instance: "test".into(),
            accepts_deltas: false,
        };
        tx.send(proxy_message(Message::Hello(hello))).await.unwrap();
        let snapshot = stream.message().await.unwrap().expect("a snapshot");
        tx.send(proxy_message(Message::Ack(Ack {
            version: snapshot.version,
        })))
        .await
        .unwrap();
        // A proxy counts as healthy from its Hello on, so wait for the ACK itself.
        let acked = scrape_until(addr, |body| {
            sample(body, "portcullis_config_stream_acks_total") == Some(1.0)
        })
        .await;
        assert_eq!(
            value(&acked, "portcullis_config_stream_messages_total{form=\"whole\"}"),
            1.0
        );
        assert!(value(&acked, "portcullis_config_stream_bytes_total{form=\"whole\"}") > 0.0);
        assert_eq!(value(&acked, "portcullis_proxies{state=\"healthy\"}"), 1.0);
        let nack = Nack {
            version: snapshot.version,
            reason: "port taken".into(),
        };
        tx.send(proxy_message(Message::Nack(nack))).await.unwrap();
        let nacked = scrape_until(addr, |body| {
            sample(body, "portcullis_proxies{state=\"rejecting\"}") == Some(1.0)
        })
        .await;
        assert_eq!(value(&nacked, "portcullis_config_stream_nacks_total"), 1.0);
        assert_eq!(value(&nacked, "portcullis_proxies{state=\"healthy\"}"), 0.0);
        drop(tx);
        scrape_until(addr, |body| {
            sample(body, "portcullis_proxies{state=\"disconnected\"}") == Some(1.0)
        })
        .await;

        // Shutdown frees both the metrics port and the database: a node restarted on the
        // same address and directory serves the version it had.
        node.shutdown().await.unwrap();
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "metrics still served after shutdown"
        );
        let node = start_with_metrics(dir.path(), addr).await;
        assert_eq!(node.metrics_addr(), Some(addr));
        let restarted = scrape(addr).await;
        assert_eq!(
            value(&restarted, "portcullis_config_version"),
            applied.version as f64
        );
        node.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn bad_requests_get_an_answer_and_serving_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let node = start_with_metrics(dir.path(), "127.0.0.1:0".parse().unwrap()).await;
        let addr = node.metrics_addr().unwrap();

        let post = http(addr, &request("POST", "/metrics")).await;
        assert_eq!(post.status, 405, "{}", post.head);
        assert!(post.head.contains("allow: get"), "{}", post.head);
        assert_eq!(post.body, "method not allowed: use GET\n");

        for path in ["/", "/metricsz", "/metrics/x"] {
            let unknown = http(addr, &request("GET", path)).await;
            assert_eq!(unknown.status, 404, "{path}: {}", unknown.head);
            assert_eq!(unknown.body, "not found: metrics are served on GET /metrics\n");
        }

        let garbage = http(addr, "\u{1}\u{2} not http at all\r\n\r\n").await;
        assert_eq!(garbage.status, 400, "{}", garbage.head);

        // A client that connects and never sends a request holds neither the server nor
        // its shutdown.
        let mut idle = TcpStream::connect(addr).await.unwrap();
        scrape(addr).await;
        // Keep-alive: two scrapes on one connection.
        let twice = format!(
            "GET /metrics HTTP/1.1\r\nHost: metrics\r\n\r\n{}",
            request("GET", "/metrics")
        );
        let both = http(addr, &twice).await;
        assert_eq!(both.status, 200);
        assert_eq!(both.body.matches("# EOF\n").count(), 2, "{}", both.body);

        // An idle connection kept alive to the end would make shutdown wait out its whole
        // 5 s grace.
        let started = Instant::now();
        node.shutdown().await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "shutdown took {:?}",
            started.elapsed()
        );
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(1), idle.read_to_end(&mut rest)).await;
        assert!(
            matches!(read, Ok(Ok(0)) | Ok(Err(_))),
            "idle connection still open"
        );
    }

    #[tokio::test]
    async fn no_metrics_listen_serves_no_metrics() {
        let dir = tempfile::tempdir().unwrap();
        let node = start(dir.path(), 1, false).await;
        assert_eq!(node.metrics_addr(), None);
        node.shutdown().await.unwrap();
    }
}
