//! Snapshots: the whole applied state as one JSON document, kept in a tree of its own
//! (`snapshot`) so that the current snapshot survives restarts. Not in the state machine's
//! tree: sled rewrites a whole page every few updates to it, and a page shared with a key
//! every apply writes (the version) would rewrite the snapshot, megabytes, every few applies.

use std::io::Cursor;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use openraft::{AnyError, RaftSnapshotBuilder, Snapshot, StorageIOError};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use super::state_machine::AppliedState;
use super::Tree;
use crate::command::{StoredConfig, StoredKey};
use crate::types::{NodeId, SnapshotMeta, StorageError, TypeConfig};

pub(super) const META: &[u8] = b"snapshot/meta";
pub(super) const DATA: &[u8] = b"snapshot/data";

/// The replicated config as stored: objects travel as their committed JSON, never decoded,
/// so a snapshot moves between builds as the log does.
#[derive(Serialize, Deserialize)]
pub(super) struct SnapshotPayload {
    pub version: u64,
    pub objects: Vec<(StoredKey, Box<RawValue>)>,
}

impl SnapshotPayload {
    pub fn of(state: &AppliedState) -> Self {
        Self {
            version: state.stored.version,
            objects: state
                .stored
                .objects
                .iter()
                .map(|(key, json)| (key.clone(), json.clone()))
                .collect(),
        }
    }

    pub fn into_stored(self) -> StoredConfig {
        StoredConfig {
            version: self.version,
            objects: self.objects.into_iter().collect(),
        }
    }
}

/// Reads meta and data under `lock`, the lock every snapshot write holds: the two keys
/// are separate reads, and a write landing between them would pair one snapshot's meta
/// with another's data.
pub(super) fn read_current(
    tree: &sled::Tree,
    lock: &Mutex<()>,
) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
    let read = |e: &dyn std::error::Error| StorageIOError::<NodeId>::read_snapshot(None, AnyError::error(e));
    let guard = lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let (Some(meta), Some(data)) = (
        tree.get(META).map_err(|e| read(&e))?,
        tree.get(DATA).map_err(|e| read(&e))?,
    ) else {
        return Ok(None);
    };
    drop(guard);
    let meta: SnapshotMeta = serde_json::from_slice(&meta).map_err(|e| read(&e))?;
    Ok(Some(Snapshot {
        meta,
        snapshot: Box::new(Cursor::new(data.to_vec())),
    }))
}

/// Adds the snapshot keys to `batch` unless a newer snapshot is already stored: a build
/// that started before an install must not replace the installed snapshot.
pub(super) fn stage(
    tree: &sled::Tree,
    batch: &mut sled::Batch,
    meta: &SnapshotMeta,
    data: &[u8],
) -> Result<(), StorageError> {
    let write = |e: &dyn std::error::Error| {
        StorageIOError::<NodeId>::write_snapshot(Some(meta.signature()), AnyError::error(e))
    };
    if let Some(existing) = tree.get(META).map_err(|e| write(&e))? {
        let existing: SnapshotMeta = serde_json::from_slice(&existing).map_err(|e| write(&e))?;
        if existing.last_log_id > meta.last_log_id {
            return Ok(());
        }
    }
    batch.insert(META, serde_json::to_vec(meta).map_err(|e| write(&e))?);
    batch.insert(DATA, data);
    Ok(())
}

/// Builds from the state captured when openraft asked for a builder, so building runs
/// concurrently with further applies without seeing them.
pub struct SnapshotBuilder {
    /// The `snapshot` tree.
    pub(super) tree: Tree,
    pub(super) state: AppliedState,
    /// Serializes snapshot writes with installs (see [`stage`]) and with [`read_current`].
    pub(super) lock: Arc<Mutex<()>>,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let data = serde_json::to_vec(&SnapshotPayload::of(&self.state))
            .map_err(|e| StorageIOError::write_snapshot(None, &e))?;
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|elapsed| elapsed.as_nanos())
            .unwrap_or_default();
        let index = self.state.last_applied.map(|id| id.index).unwrap_or_default();
        let meta = SnapshotMeta {
            last_log_id: self.state.last_applied,
            last_membership: self.state.membership.clone(),
            snapshot_id: format!("{index}-{nanos}"),
        };
        {
            let _guard = self.lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let mut batch = sled::Batch::default();
            stage(&self.tree, &mut batch, &meta, &data)?;
            self.tree
                .apply_batch(batch)
                .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        }
        // The log is purged after this returns, so the snapshot must be on disk first.
        self.tree
            .flush_async()
            .await
            .map_err(|e| StorageIOError::write_snapshot(Some(meta.signature()), &e))?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}
