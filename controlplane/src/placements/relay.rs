//! Pulls into this node's hub what every other member's own proxies report: one
//! PlacementExchange stream per member, following the config group's membership.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use portcullis_proto::v1::placement_exchange_client::PlacementExchangeClient;
use portcullis_proto::v1::placement_report::Message;
use portcullis_proto::v1::{PlacementHello, PlacementReport};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;

use super::{Hub, Origin, Relayed};
use crate::metrics::Metrics;
use crate::types::{NodeId, Raft};

/// Pause before pulling again from a member whose stream failed.
const RETRY: Duration = Duration::from_secs(1);

/// A pull from one member, stopped when dropped: aborting `run` (node shutdown) drops them
/// all.
struct Pulling {
    address: String,
    task: JoinHandle<()>,
}

impl Drop for Pulling {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub(super) async fn run(node_id: NodeId, raft: Raft, hub: Hub, metrics: Metrics) {
    let mut raft_metrics = raft.metrics();
    let mut pulling: HashMap<NodeId, Pulling> = HashMap::new();
    let mut seen = None;
    loop {
        let members: Option<HashMap<NodeId, String>> = {
            let current = raft_metrics.borrow_and_update();
            let membership = &current.membership_config;
            // Raft metrics change with every heartbeat; the membership seldom does.
            (seen != Some(*membership.log_id())).then(|| {
                seen = Some(*membership.log_id());
                membership
                    .membership()
                    .nodes()
                    .filter(|(id, _)| **id != node_id)
                    .map(|(id, node)| (*id, node.addr.clone()))
                    .collect()
            })
        };
        if let Some(members) = members {
            // A member that left or moved to another address is pulled from no longer (or anew).
            pulling.retain(|id, pull| members.get(id) == Some(&pull.address));
            for (id, address) in members {
                pulling.entry(id).or_insert_with(|| Pulling {
                    task: tokio::spawn(pull(node_id, address.clone(), hub.clone(), metrics.clone())),
                    address,
                });
            }
        }
        if raft_metrics.changed().await.is_err() {
            return;
        }
    }
}

async fn pull(node_id: NodeId, address: String, hub: Hub, metrics: Metrics) {
    loop {
        if let Err(error) = pull_once(node_id, &address, &hub, &metrics).await {
            tracing::debug!(%address, %error, "pulling placements from a member failed");
        }
        tokio::time::sleep(RETRY).await;
    }
}

async fn pull_once(node_id: NodeId, address: &str, hub: &Hub, metrics: &Metrics) -> anyhow::Result<()> {
    let channel = Endpoint::from_shared(format!("http://{address}"))?
        .connect_timeout(Duration::from_secs(1))
        // A member that vanished without closing the connection is noticed.
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .connect()
        .await?;
    // The hello, then nothing: the sender is held so the request stream stays open.
    let (reports, outgoing) = mpsc::channel(1);
    reports
        .send(PlacementReport {
            message: Some(Message::Hello(PlacementHello {
                proxy_id: String::new(),
                shard: HashMap::new(),
                peer_node: node_id,
            })),
        })
        .await?;
    let mut batches = PlacementExchangeClient::new(channel)
        .exchange(ReceiverStream::new(outgoing))
        .await?
        .into_inner();
    while let Some(batch) = batches.message().await? {
        metrics.placement_batches("received", 1);
        let _ = hub.send(Arc::new(Relayed {
            origin: Origin::Peer,
            placements: batch.placements,
        }));
    }
    drop(reports);
    Ok(())
}
