//! The Raft type configuration: what a log entry carries and what applying it answers.

use std::io::Cursor;

use openraft::BasicNode;

use crate::command::{Outcome, Write};

pub type NodeId = u64;

openraft::declare_raft_types!(
    /// Raft types of the control plane: entries carry config commands, nodes are gRPC addresses.
    pub TypeConfig:
        D = Write,
        R = Outcome,
        NodeId = NodeId,
        Node = BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
);

pub type Raft = openraft::Raft<TypeConfig>;
pub type Entry = openraft::Entry<TypeConfig>;
pub type LogId = openraft::LogId<NodeId>;
pub type StorageError = openraft::StorageError<NodeId>;
pub type StoredMembership = openraft::StoredMembership<NodeId, BasicNode>;
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, BasicNode>;
