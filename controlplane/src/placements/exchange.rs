//! PlacementExchange: a proxy's placements go into the node's hub, and every batch in the
//! hub that someone else reported goes out to the proxy, cut to the pools of its shard. A
//! peer node gets only what this node's own proxies reported, so no batch travels twice.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use portcullis_config::ShardSelector;
use portcullis_proto::v1::placement_exchange_server::PlacementExchange;
use portcullis_proto::v1::placement_report::Message;
use portcullis_proto::v1::{PlacementBatch, PlacementHello, PlacementReport};
use portcullis_proto::{MAX_PLACEMENTS_PER_BATCH, MAX_PROMPT_HASHES};
use tokio::sync::{broadcast, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::{Hub, Origin, Relayed};
use crate::metrics::Metrics;
use crate::signals::ShardPools;
use crate::view::{ConfigView, Streamed};

/// A client must say who it is this soon after opening the stream.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Batches on their way to one receiver; a receiver this far behind loses the next ones.
const OUTBOUND_BATCHES: usize = 8;

/// How long the reason a stream ends may wait for a client that does not read.
const FAREWELL_TIMEOUT: Duration = Duration::from_secs(1);

/// Longest pool name or endpoint address a placement may carry.
const MAX_NAME_BYTES: usize = 1024;

pub struct PlacementExchangeService {
    hub: Hub,
    config: Streamed,
    shutdown: watch::Receiver<bool>,
    metrics: Metrics,
    pools: ShardPools,
}

impl PlacementExchangeService {
    pub(super) fn new(hub: Hub, config: Streamed, shutdown: watch::Receiver<bool>, metrics: Metrics) -> Self {
        Self {
            hub,
            config,
            shutdown,
            metrics,
            pools: ShardPools::default(),
        }
    }
}

/// Who is at the other end of a stream.
enum Peer {
    Proxy { id: String, shard: ShardSelector },
    Node,
}

#[tonic::async_trait]
impl PlacementExchange for PlacementExchangeService {
    type ExchangeStream = ReceiverStream<Result<PlacementBatch, Status>>;

    async fn exchange(
        &self,
        request: Request<Streaming<PlacementReport>>,
    ) -> Result<Response<Self::ExchangeStream>, Status> {
        let mut reports = request.into_inner();
        let mut shutdown = self.shutdown.clone();
        let first = tokio::select! {
            first = tokio::time::timeout(HELLO_TIMEOUT, reports.message()) => first
                .map_err(|_| Status::invalid_argument("no PlacementHello within 10 s"))??,
            _ = shutdown.changed() => return Err(Status::unavailable("the control plane is stopping")),
        };
        let Some(PlacementReport {
            message: Some(Message::Hello(hello)),
        }) = first
        else {
            return Err(Status::invalid_argument(
                "the first PlacementReport must be a hello",
            ));
        };
        let peer = peer(hello)?;
        let (outbound, receiver) = mpsc::channel(OUTBOUND_BATCHES);
        let session = Session {
            peer,
            outbound,
            hub: self.hub.clone(),
            config: self.config.subscribe(),
            shutdown: self.shutdown.clone(),
            metrics: self.metrics.clone(),
            pools: self.pools.clone(),
        };
        tokio::spawn(session.run(reports));
        Ok(Response::new(ReceiverStream::new(receiver)))
    }
}

fn peer(hello: PlacementHello) -> Result<Peer, Status> {
    match (hello.peer_node, hello.proxy_id.is_empty()) {
        (0, false) => Ok(Peer::Proxy {
            id: hello.proxy_id,
            shard: hello.shard.into_iter().collect(),
        }),
        (0, true) => Err(Status::invalid_argument(
            "PlacementHello names neither a proxy (proxy_id) nor a node (peer_node)",
        )),
        (_, true) => Ok(Peer::Node),
        (_, false) => Err(Status::invalid_argument(
            "PlacementHello names both a proxy (proxy_id) and a node (peer_node)",
        )),
    }
}

struct Session {
    peer: Peer,
    outbound: mpsc::Sender<Result<PlacementBatch, Status>>,
    hub: Hub,
    config: watch::Receiver<ConfigView>,
    shutdown: watch::Receiver<bool>,
    metrics: Metrics,
    pools: ShardPools,
}

impl Session {
    async fn run(mut self, mut reports: Streaming<PlacementReport>) {
        let mut relayed = self.hub.subscribe();
        let mut pools = match &self.peer {
            Peer::Proxy { shard, .. } => self.pools.latest(&mut self.config, shard).await,
            Peer::Node => Arc::default(),
        };
        let mut reporting = true;
        loop {
            tokio::select! {
                report = reports.message(), if reporting => match report {
                    Ok(Some(report)) => {
                        if let Err(status) = self.take(report) {
                            // The client learns why (what it sent before stays relayed),
                            // unless it stopped reading: the hub must not keep batches for
                            // it meanwhile.
                            drop(relayed);
                            let farewell = self.outbound.send(Err(status));
                            let _ = tokio::time::timeout(FAREWELL_TIMEOUT, farewell).await;
                            return;
                        }
                    }
                    // The client closed its side: it may still listen.
                    Ok(None) => reporting = false,
                    Err(_) => return,
                },
                batch = relayed.recv() => match batch {
                    Ok(batch) => {
                        if !self.forward(&batch, &pools) {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(batches)) => {
                        self.metrics.placement_batches("dropped", batches);
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                changed = self.config.changed(), if matches!(self.peer, Peer::Proxy { .. }) => {
                    if changed.is_err() {
                        return;
                    }
                    if let Peer::Proxy { shard, .. } = &self.peer {
                        pools = self.pools.latest(&mut self.config, shard).await;
                    }
                }
                _ = self.shutdown.changed() => return,
                () = self.outbound.closed() => return,
            }
        }
    }

    /// Checks a report from the client and puts its placements into the hub.
    fn take(&self, report: PlacementReport) -> Result<(), Status> {
        let Peer::Proxy { id, .. } = &self.peer else {
            return Err(Status::invalid_argument("a node relaying placements sends none"));
        };
        let Some(Message::Batch(batch)) = report.message else {
            return Err(Status::invalid_argument(
                "after the hello, a PlacementReport must be a batch",
            ));
        };
        check(&batch)?;
        self.metrics.placement_batches("received", 1);
        // No receiver (this proxy is the only one anywhere) is fine.
        let _ = self.hub.send(Arc::new(Relayed {
            origin: Origin::Proxy(id.clone()),
            placements: batch.placements,
        }));
        Ok(())
    }

    /// Sends what of `batch` the client should have; false once the client is gone.
    fn forward(&self, batch: &Relayed, pools: &BTreeSet<String>) -> bool {
        let placements = match (&self.peer, &batch.origin) {
            (Peer::Proxy { id, .. }, Origin::Proxy(from)) if id == from => return true,
            (Peer::Proxy { .. }, _) => batch
                .placements
                .iter()
                .filter(|placement| pools.contains(&placement.pool))
                .cloned()
                .collect(),
            (Peer::Node, Origin::Proxy(_)) => batch.placements.clone(),
            (Peer::Node, Origin::Peer) => return true,
        };
        if placements.is_empty() {
            return true;
        }
        match self.outbound.try_send(Ok(PlacementBatch { placements })) {
            Ok(()) => {
                self.metrics.placement_batches("sent", 1);
                true
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.metrics.placement_batches("dropped", 1);
                true
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        }
    }
}

fn check(batch: &PlacementBatch) -> Result<(), Status> {
    if batch.placements.len() > MAX_PLACEMENTS_PER_BATCH {
        return Err(Status::invalid_argument(format!(
            "a PlacementBatch carries at most {MAX_PLACEMENTS_PER_BATCH} placements, this one {}",
            batch.placements.len()
        )));
    }
    for placement in &batch.placements {
        if placement.pool.is_empty() || placement.endpoint.is_empty() {
            return Err(Status::invalid_argument(
                "a Placement needs a pool and an endpoint",
            ));
        }
        if placement.pool.len() > MAX_NAME_BYTES || placement.endpoint.len() > MAX_NAME_BYTES {
            return Err(Status::invalid_argument(format!(
                "a Placement's pool and endpoint are at most {MAX_NAME_BYTES} bytes"
            )));
        }
        if placement.prompt_hashes.len() > MAX_PROMPT_HASHES {
            return Err(Status::invalid_argument(format!(
                "a Placement carries at most {MAX_PROMPT_HASHES} prompt hashes, one for pool {:?} {}",
                placement.pool,
                placement.prompt_hashes.len()
            )));
        }
    }
    Ok(())
}
