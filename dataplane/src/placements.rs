//! Prefix placements shared with the other proxies through the control plane's
//! PlacementExchange. Where this proxy's pickers sent prompts goes out; where the other
//! proxies sent theirs comes in and is taught to the pickers of the live config version, so
//! that proxies behind one load balancer keep a prompt family on the same pods instead of
//! each caching it on a pod of its own.
//!
//! Soft state both ways: a full outbox or a slow stream drops placements and a lost stream
//! loses them; either only costs prefix-cache hits.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use portcullis_proto::v1::placement_exchange_client::PlacementExchangeClient;
use portcullis_proto::v1::placement_report::Message;
use portcullis_proto::v1::{Placement, PlacementBatch, PlacementHello, PlacementReport};
use portcullis_proto::MAX_PLACEMENTS_PER_BATCH;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;

use crate::config_state::ConfigState;
use crate::subscription::{connect, ControlPlanes, Stream};

/// Placements waiting to go out; a burst beyond this is dropped.
const OUTBOX_CAPACITY: usize = 4096;

/// Batches on their way to the control plane; while they are all in flight, new batches
/// are dropped rather than queued behind them.
const BATCHES_IN_FLIGHT: usize = 4;

/// Where pickers put the placements the other proxies should learn.
#[derive(Clone)]
pub(crate) struct Outbox(mpsc::Sender<Placement>);

impl Outbox {
    /// Never waits: called under a picker's lock. False when the placement was dropped: the
    /// outbox is full (a burst) or no exchange runs (as in some tests).
    pub(crate) fn post(&self, placement: Placement) -> bool {
        self.0.try_send(placement).is_ok()
    }
}

/// An outbox and the receiving end a [`PlacementExchange`] sends from.
pub(crate) fn outbox() -> (Outbox, mpsc::Receiver<Placement>) {
    let (sender, receiver) = mpsc::channel(OUTBOX_CAPACITY);
    (Outbox(sender), receiver)
}

pub(crate) struct PlacementExchange {
    pub(crate) state: Arc<ConfigState>,
    pub(crate) controlplanes: Arc<ControlPlanes>,
    pub(crate) proxy_id: String,
    pub(crate) shard: BTreeMap<String, String>,
    /// Held by the one session running at a time.
    pub(crate) outbox: tokio::sync::Mutex<mpsc::Receiver<Placement>>,
}

impl Stream for PlacementExchange {
    const NAME: &'static str = "placement";

    fn controlplanes(&self) -> &ControlPlanes {
        &self.controlplanes
    }

    async fn session(&self, controlplane: &Endpoint, received: &mut usize) -> anyhow::Result<()> {
        let mut outbox = self.outbox.lock().await;
        let channel = connect(controlplane).await?;
        let (reports, outgoing) = mpsc::channel(BATCHES_IN_FLIGHT);
        let hello = PlacementHello {
            proxy_id: self.proxy_id.clone(),
            shard: self.shard.clone().into_iter().collect(),
            peer_node: 0,
        };
        reports
            .send(PlacementReport {
                message: Some(Message::Hello(hello)),
            })
            .await?;
        let mut incoming = PlacementExchangeClient::new(channel)
            .exchange(ReceiverStream::new(outgoing))
            .await?
            .into_inner();
        loop {
            tokio::select! {
                batch = incoming.message() => {
                    let Some(batch) = batch? else { return Ok(()) };
                    *received += 1;
                    learn(&self.state, batch);
                }
                placement = outbox.recv() => {
                    // The sender lives in the config state, as long as the proxy.
                    let Some(placement) = placement else { return Ok(()) };
                    let mut placements = vec![placement];
                    while placements.len() < MAX_PLACEMENTS_PER_BATCH {
                        match outbox.try_recv() {
                            Ok(placement) => placements.push(placement),
                            Err(_) => break,
                        }
                    }
                    let report = PlacementReport {
                        message: Some(Message::Batch(PlacementBatch { placements })),
                    };
                    match reports.try_send(report) {
                        // A working stream, also for a proxy that only ever sends.
                        Ok(()) => *received += 1,
                        // The control plane is behind: this batch is lost.
                        Err(mpsc::error::TrySendError::Full(_)) => {}
                        Err(mpsc::error::TrySendError::Closed(_)) => {
                            anyhow::bail!("the control plane stopped reading placements")
                        }
                    }
                }
            }
        }
    }
}

/// Teaches the live version's pickers what other proxies placed, one lock per pool. Placements
/// for pools this version does not have are dropped.
fn learn(state: &ConfigState, batch: PlacementBatch) {
    let snapshot = state.current();
    let mut by_pool: HashMap<&str, Vec<&Placement>> = HashMap::new();
    for placement in &batch.placements {
        by_pool.entry(&placement.pool).or_default().push(placement);
    }
    for (pool, placements) in by_pool {
        if let Some(pool) = snapshot.pool(pool) {
            pool.learn(&placements);
        }
    }
}
