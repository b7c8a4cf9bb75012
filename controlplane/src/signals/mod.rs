//! Inference-pod signals: collected by the control plane, replicated through a second Raft
//! group, streamed to proxies.
//!
//! Signals are not config. They change every few tens of milliseconds, are worth nothing a
//! second later, and must neither move the config version nor pass through the durable
//! config log (sled, flushed before every acknowledgement). So every node runs a second
//! openraft group with the same members, whose log and state machine live in memory
//! (`store.rs`): the latest readings are the same on every node, a new leader starts with
//! them, and a restarted node catches up from a snapshot of them. ARCHITECTURE.md has the
//! measured cost.

mod exposition;
mod scrape;
mod store;
mod stream;
mod types;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use openraft::{BasicNode, ChangeMembers, RaftMetrics, SnapshotPolicy};
use portcullis_proto::v1::RaftGroup;
use tokio::sync::watch;
use tokio::task::JoinSet;

pub use store::SignalView;
pub(crate) use stream::ShardPools;
pub use stream::SignalStreamService;
pub use types::SignalsRaft;

use crate::metrics::Metrics;
use crate::network::NetworkFactory;
use crate::types::{NodeId, Raft};
use crate::view::ConfigView;

/// Longer than an election can last (election timeout 1–2 s): see `RaftService::new`.
pub const VOTE_EMBARGO: Duration = Duration::from_secs(4);

fn raft_config() -> anyhow::Result<Arc<openraft::Config>> {
    let config = openraft::Config {
        cluster_name: "portcullis-signals".to_string(),
        heartbeat_interval: 250,
        election_timeout_min: 1000,
        election_timeout_max: 2000,
        install_snapshot_timeout: 2000,
        // Snapshots are the latest readings, small and in memory: take them often, so the
        // log (also in memory) stays short and a new node catches up from one message.
        snapshot_policy: SnapshotPolicy::LogsSinceLast(64),
        max_in_snapshot_log_to_keep: 16,
        ..Default::default()
    };
    Ok(Arc::new(
        config.validate().context("invalid signals Raft config")?,
    ))
}

pub struct Signals {
    raft: SignalsRaft,
    view: watch::Receiver<SignalView>,
    tasks: JoinSet<()>,
}

impl Signals {
    /// Starts this node's member of the signals group, the task that keeps the group's
    /// members equal to the config group's voters, and collection (active while this node
    /// leads the signals group).
    pub async fn start(
        node_id: NodeId,
        config_raft: Raft,
        config: watch::Receiver<ConfigView>,
        metrics: Metrics,
    ) -> anyhow::Result<Signals> {
        let state_machine = store::SignalStateMachine::new();
        let view = state_machine.subscribe();
        let raft = SignalsRaft::new(
            node_id,
            raft_config()?,
            NetworkFactory::new(RaftGroup::Signals),
            store::MemLog::default(),
            state_machine,
        )
        .await
        .context("starting the signals Raft group")?;
        let mut tasks = JoinSet::new();
        tasks.spawn(follow_membership(node_id, config_raft, raft.clone()));
        tasks.spawn(scrape::run(node_id, raft.clone(), config, metrics));
        Ok(Signals { raft, view, tasks })
    }

    pub fn raft(&self) -> &SignalsRaft {
        &self.raft
    }

    pub fn subscribe(&self) -> watch::Receiver<SignalView> {
        self.view.clone()
    }

    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        self.tasks.shutdown().await;
        self.raft
            .shutdown()
            .await
            .context("stopping the signals Raft group")
    }
}

fn voters(metrics: &RaftMetrics<NodeId, BasicNode>) -> BTreeMap<NodeId, BasicNode> {
    let membership = metrics.membership_config.membership();
    membership
        .voter_ids()
        .filter_map(|id| Some((id, membership.get_node(&id)?.clone())))
        .collect()
}

/// Keeps the signals group's voters equal to the config group's: the signals leader adds
/// and removes members as the config group's change; when no signals group exists (a fresh
/// cluster, or every node restarted and lost the in-memory log), the config leader forms it.
async fn follow_membership(node_id: NodeId, config: Raft, signals: SignalsRaft) {
    let started = Instant::now();
    let mut config_metrics = config.metrics();
    let mut signals_metrics = signals.metrics();
    loop {
        let wanted = voters(&config_metrics.borrow_and_update());
        let config_leader = config_metrics.borrow().current_leader;
        let (signals_leader, signals_log, have) = {
            let metrics = signals_metrics.borrow_and_update();
            (metrics.current_leader, metrics.last_log_index, voters(&metrics))
        };
        let have_ids: BTreeSet<NodeId> = have.keys().copied().collect();
        let wanted_ids: BTreeSet<NodeId> = wanted.keys().copied().collect();
        if wanted.is_empty() {
            // The config group is not initialized yet.
        } else if signals_leader == Some(node_id) && have_ids != wanted_ids {
            for (id, node) in wanted.iter().filter(|(id, _)| !have.contains_key(id)) {
                if let Err(error) = signals.add_learner(*id, node.clone(), false).await {
                    tracing::warn!(%error, node = id, "could not add a node to the signals group");
                }
            }
            match signals.change_membership(wanted_ids, false).await {
                Ok(_) => {
                    tracing::info!(voters = ?wanted.keys().collect::<Vec<_>>(), "signals group members follow the config group")
                }
                Err(error) => tracing::warn!(%error, "could not change the signals group's members"),
            }
        } else if signals_leader == Some(node_id) && have != wanted {
            // The same members, one at a new address (checked when the config group moved it).
            let moved: BTreeMap<NodeId, BasicNode> = wanted
                .iter()
                .filter(|(id, node)| have.get(id) != Some(node))
                .map(|(id, node)| (*id, node.clone()))
                .collect();
            match signals
                .change_membership(ChangeMembers::SetNodes(moved), false)
                .await
            {
                Ok(_) => tracing::info!("signals group members follow the config group's addresses"),
                Err(error) => tracing::warn!(%error, "could not change a signals group member's address"),
            }
        } else if signals_leader.is_none()
            && signals_log.is_none()
            && config_leader == Some(node_id)
            // With other voters, wait as long as they may refuse votes after a restart and a
            // running signals group would take to reach this node.
            && (wanted.len() == 1 || started.elapsed() >= VOTE_EMBARGO)
        {
            match signals.initialize(wanted).await {
                Ok(()) => tracing::info!("formed the signals group"),
                Err(error) => tracing::debug!(%error, "did not form the signals group"),
            }
        }
        tokio::select! {
            changed = config_metrics.changed() => if changed.is_err() { return },
            changed = signals_metrics.changed() => if changed.is_err() { return },
            // The embargo ends without any metrics changing.
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}
