//! Prefix placements: proxies tell each other, through the control plane, which pod they
//! sent which prompt to (`proto/portcullis/v1/placements.proto`), so that every proxy's
//! picker knows where the others placed a prompt family and sends it there too.
//!
//! Soft state, kept out of Raft on purpose: a placement is worth something for seconds,
//! needs neither order nor agreement between nodes, and losing one only costs cache hits;
//! through a Raft log it would pay a commit per batch for guarantees nobody uses. So each
//! node keeps a broadcast hub: what its own proxies report goes to its other proxies
//! (`exchange.rs`) and, pulled by every other member of the cluster (`relay.rs`), to theirs.
//! Nothing is stored; a slow receiver loses placements instead of holding anyone up.

mod exchange;
mod relay;

#[cfg(test)]
mod tests;

use std::sync::Arc;

use portcullis_proto::v1::Placement;
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;

pub use exchange::PlacementExchangeService;

use crate::metrics::Metrics;
use crate::types::{NodeId, Raft};
use crate::view::Streamed;

/// Batches the hub keeps for receivers that fall behind; beyond this they skip the oldest.
/// With batches of at most [`MAX_REPORT_BYTES`], this bounds the hub's memory.
const HUB_CAPACITY: usize = 64;

/// Largest PlacementReport the service decodes: room for a full batch of the longest
/// placements a proxy sends.
pub const MAX_REPORT_BYTES: usize = 2 * 1024 * 1024;

/// Who reported a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Origin {
    /// A proxy connected to this node, by id.
    Proxy(String),
    /// Another control-plane node, for its own proxies.
    Peer,
}

#[derive(Debug)]
struct Relayed {
    origin: Origin,
    placements: Vec<Placement>,
}

type Hub = broadcast::Sender<Arc<Relayed>>;

/// This node's hub and the task pulling the other nodes' placements into it.
pub struct Placements {
    hub: Hub,
    relay: JoinHandle<()>,
}

impl Placements {
    pub fn start(node_id: NodeId, raft: Raft, metrics: Metrics) -> Placements {
        let (hub, _) = broadcast::channel(HUB_CAPACITY);
        let relay = tokio::spawn(relay::run(node_id, raft, hub.clone(), metrics));
        Placements { hub, relay }
    }

    /// The PlacementExchange service of this node's hub.
    pub fn service(
        &self,
        config: Streamed,
        shutdown: watch::Receiver<bool>,
        metrics: Metrics,
    ) -> PlacementExchangeService {
        PlacementExchangeService::new(self.hub.clone(), config, shutdown, metrics)
    }

    pub fn shutdown(self) {
        self.relay.abort();
    }
}
