//! What the signals Raft group replicates: scrape rounds of inference pods.

use std::io::Cursor;

use openraft::BasicNode;
use serde::{Deserialize, Serialize};

use crate::types::NodeId;

/// One entry of the signals log: the rounds that finished since the previous entry (at most
/// one per pool) and the pools that no longer exist.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SignalEntry {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rounds: Vec<PoolRound>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removed_pools: Vec<String>,
}

/// One scrape of every endpoint of a pool. Its endpoint list is the pool's whole list at the
/// time: an endpoint absent from it is gone, one listed without a reading did not answer and
/// keeps its previous (ageing) reading.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolRound {
    pub pool: String,
    pub endpoints: Vec<EndpointRound>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EndpointRound {
    pub endpoint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reading: Option<Reading>,
}

/// What a vLLM server's `/metrics` said, and how old that was when the leader proposed it.
/// Ages, not timestamps: each node counts on from when it applied the entry with its own
/// monotonic clock, so no two machines' clocks need to agree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reading {
    pub age_ms: u32,
    pub waiting: u32,
    pub running: u32,
    pub kv_cache_usage: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraReading>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoraReading {
    pub max_loras: u32,
    pub running: Vec<String>,
    pub waiting: Vec<String>,
}

openraft::declare_raft_types!(
    /// Raft types of the signals group: entries carry scrape rounds; same node ids and
    /// addresses as the config group.
    pub SignalsTypeConfig:
        D = SignalEntry,
        R = (),
        NodeId = NodeId,
        Node = BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
);

pub type SignalsRaft = openraft::Raft<SignalsTypeConfig>;
pub type Entry = openraft::Entry<SignalsTypeConfig>;
pub type LogId = openraft::LogId<NodeId>;
pub type StorageError = openraft::StorageError<NodeId>;
pub type StoredMembership = openraft::StoredMembership<NodeId, BasicNode>;
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, BasicNode>;
