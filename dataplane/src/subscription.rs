//! The control-plane client: receive snapshots, apply, acknowledge; reconnect forever.
//! Pod signals come on their own stream ([`crate::signals`]), with the same reconnection.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use portcullis_proto::v1::config_stream_client::ConfigStreamClient;
use portcullis_proto::v1::proxy_message::Message;
use portcullis_proto::v1::{Ack, Hello, Nack, ProxyMessage};
use rand::Rng;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use crate::config_state::ConfigState;

const FIRST_RETRY: Duration = Duration::from_millis(100);
const MAX_RETRY: Duration = Duration::from_secs(5);

pub(crate) struct Subscriber {
    pub(crate) state: Arc<ConfigState>,
    pub(crate) controlplanes: Arc<ControlPlanes>,
    pub(crate) proxy_id: String,
    /// Random per process: another live proxy with this id is told apart (see `Hello`).
    pub(crate) instance: String,
    pub(crate) shard: BTreeMap<String, String>,
}

/// The control-plane nodes a proxy may stream from (any node serves both streams), and the
/// one in use: when a stream fails on it, both streams move on to the next.
pub(crate) struct ControlPlanes {
    endpoints: Vec<Endpoint>,
    current: AtomicUsize,
}

impl ControlPlanes {
    pub(crate) fn new(addresses: &[String]) -> anyhow::Result<ControlPlanes> {
        if addresses.is_empty() {
            anyhow::bail!("no control-plane address");
        }
        let endpoints = addresses
            .iter()
            .map(|address| {
                Endpoint::from_shared(address.clone())
                    .map_err(|error| anyhow::anyhow!("invalid control-plane address {address:?}: {error}"))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(ControlPlanes {
            endpoints,
            // Proxies spread over the nodes rather than all starting on the first.
            current: AtomicUsize::new(rand::rng().random_range(0..addresses.len())),
        })
    }

    fn current(&self) -> (usize, &Endpoint) {
        let index = self.current.load(Ordering::Relaxed) % self.endpoints.len();
        (index, &self.endpoints[index])
    }

    /// The stream on node `index` failed: the next node, unless the other stream already
    /// moved on.
    fn failed(&self, index: usize) {
        let next = (index + 1) % self.endpoints.len();
        let _ = self
            .current
            .compare_exchange(index, next, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// A stream from the control plane, reopened for as long as the proxy runs.
pub(crate) trait Stream {
    /// What the stream carries, for logs.
    const NAME: &'static str;

    fn controlplanes(&self) -> &ControlPlanes;

    /// One stream from `controlplane`, counting the messages it delivered.
    fn session(
        &self,
        controlplane: &Endpoint,
        received: &mut usize,
    ) -> impl Future<Output = anyhow::Result<()>> + Send;
}

/// Never returns: losing the control plane only means serving the last good config (and the
/// picker's own counts) until it is back. A failed stream moves to the next node after a
/// short pause; a round of failures over every node backs off exponentially.
pub(crate) async fn run_forever<S: Stream>(stream: S) {
    let controlplanes = stream.controlplanes();
    let mut backoff = FIRST_RETRY;
    let mut failed_in_a_row = 0;
    loop {
        let mut received = 0;
        let (index, endpoint) = controlplanes.current();
        let controlplane = endpoint.uri().clone();
        match stream.session(endpoint, &mut received).await {
            Ok(()) => tracing::warn!(%controlplane, "{} stream closed by the control plane", S::NAME),
            Err(error) => tracing::warn!(%controlplane, %error, "{} stream failed", S::NAME),
        }
        controlplanes.failed(index);
        if received > 0 {
            backoff = FIRST_RETRY;
            failed_in_a_row = 0;
        }
        failed_in_a_row += 1;
        // Jitter keeps a fleet of proxies from reconnecting in lockstep; even the move to
        // the next node waits a little, so nodes that close streams at once are not spun on.
        let jitter = rand::rng().random_range(0.5..=1.0);
        if failed_in_a_row < controlplanes.endpoints.len() {
            tokio::time::sleep(FIRST_RETRY.mul_f64(jitter)).await;
            continue;
        }
        failed_in_a_row = 0;
        tokio::time::sleep(backoff.mul_f64(jitter)).await;
        backoff = (backoff * 2).min(MAX_RETRY);
    }
}

pub(crate) async fn connect(controlplane: &Endpoint) -> Result<Channel, tonic::transport::Error> {
    controlplane
        .clone()
        .connect_timeout(Duration::from_secs(5))
        // A stream can be idle for long: pings are what notice a control plane that
        // vanished without closing the connection.
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .connect()
        .await
}

impl Stream for Subscriber {
    const NAME: &'static str = "config";

    fn controlplanes(&self) -> &ControlPlanes {
        &self.controlplanes
    }

    async fn session(&self, controlplane: &Endpoint, received: &mut usize) -> anyhow::Result<()> {
        let channel = connect(controlplane).await?;
        let mut client =
            ConfigStreamClient::new(channel).max_decoding_message_size(portcullis_proto::MAX_MESSAGE_BYTES);
        let (outbound, outbound_stream) = mpsc::channel(8);
        let hello = Hello {
            proxy_id: self.proxy_id.clone(),
            shard: self.shard.clone().into_iter().collect(),
            last_version: self.state.current().version.unwrap_or(0),
            instance: self.instance.clone(),
            accepts_deltas: true,
        };
        outbound
            .send(ProxyMessage {
                message: Some(Message::Hello(hello)),
            })
            .await?;
        let mut snapshots = client
            .subscribe(ReceiverStream::new(outbound_stream))
            .await?
            .into_inner();
        // Once the control plane says it takes findings, the stream carries what the proxy has
        // found, then each change.
        let mut findings = self.state.findings();
        findings.mark_changed();
        let mut report_findings = false;
        loop {
            let snapshot = tokio::select! {
                snapshot = snapshots.message() => match snapshot? {
                    Some(snapshot) => snapshot,
                    None => break,
                },
                changed = findings.changed(), if report_findings => {
                    if changed.is_err() {
                        report_findings = false;
                        continue;
                    }
                    let found = findings.borrow_and_update().clone();
                    outbound
                        .send(ProxyMessage {
                            message: Some(Message::Findings(found)),
                        })
                        .await?;
                    continue;
                }
            };
            *received += 1;
            report_findings |= snapshot.takes_findings;
            let reply = match self.state.apply_wire(&snapshot).await {
                Ok(()) => Message::Ack(Ack {
                    version: snapshot.version,
                }),
                Err(error) => {
                    tracing::warn!(version = snapshot.version, %error, "rejected config version");
                    Message::Nack(Nack {
                        version: snapshot.version,
                        reason: error.to_string(),
                    })
                }
            };
            outbound.send(ProxyMessage { message: Some(reply) }).await?;
        }
        Ok(())
    }
}
