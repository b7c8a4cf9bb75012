//! The state machine on sled (tree `sm`): last applied log id, last membership, config
//! version and every object as JSON, written in one atomic batch per `apply` call, so a
//! restart reads back exactly the state of some applied log id. The current snapshot is in
//! a file of its own (see [`snapshot`]): an install stores the snapshot first, then the
//! state, and an open that finds a snapshot later than the state restores the state from it.

use std::io::Cursor;
use std::sync::Arc;

use anyhow::Context;
use openraft::storage::RaftStateMachine;
use openraft::{AnyError, EntryPayload, OptionalSend, Snapshot, StorageIOError};
use serde_json::value::RawValue;
use tokio::sync::watch;

use super::snapshot::{self, SnapshotBuilder, SnapshotFile, SnapshotPayload, Stored};
use super::{Storage, Tree};
use crate::command::{Applied, Outcome, Reading, StoredConfig, StoredKey, Write};
use crate::types::{Entry, LogId, SnapshotMeta, StorageError, StoredMembership, TypeConfig};
use crate::view::ConfigView;

const APPLIED: &[u8] = b"applied";
const MEMBERSHIP: &[u8] = b"membership";
const VERSION: &[u8] = b"version";
const OBJECT_PREFIX: &str = "obj/";

fn object_key(key: &StoredKey) -> Vec<u8> {
    format!("{OBJECT_PREFIX}{key}").into_bytes()
}

#[derive(Debug, Clone, Default)]
pub struct AppliedState {
    pub last_applied: Option<LogId>,
    pub membership: StoredMembership,
    /// The replicated config, the same on every node.
    pub stored: StoredConfig,
    /// This build's reading of it, as published.
    pub view: ConfigView,
}

impl AppliedState {
    fn load(tree: &sled::Tree) -> anyhow::Result<Self> {
        fn get<T: serde::de::DeserializeOwned + Default>(tree: &sled::Tree, key: &[u8]) -> anyhow::Result<T> {
            match tree.get(key)? {
                Some(bytes) => serde_json::from_slice(&bytes)
                    .with_context(|| format!("decoding {}", String::from_utf8_lossy(key))),
                None => Ok(T::default()),
            }
        }
        let mut stored = StoredConfig {
            version: get(tree, VERSION)?,
            ..StoredConfig::default()
        };
        for item in tree.scan_prefix(OBJECT_PREFIX) {
            let (key, bytes) = item?;
            let key = String::from_utf8_lossy(&key);
            let stored_key = key
                .strip_prefix(OBJECT_PREFIX)
                .and_then(StoredKey::parse)
                .with_context(|| format!("stored object key {key:?} is not Kind/name"))?;
            let json = String::from_utf8(bytes.to_vec())
                .ok()
                .and_then(|text| RawValue::from_string(text).ok())
                .with_context(|| format!("stored object {key} is not JSON"))?;
            stored.objects.insert(stored_key, json);
        }
        let mut state = Self {
            last_applied: get(tree, APPLIED)?,
            membership: get(tree, MEMBERSHIP)?,
            stored,
            view: ConfigView::default(),
        };
        state.publish(state.stored.read());
        Ok(state)
    }

    /// Takes this build's reading of the stored config as the view to publish.
    fn publish(&mut self, reading: Reading) {
        match reading {
            Reading::Readable(config) => {
                self.view = ConfigView {
                    version: self.stored.version,
                    config,
                    unreadable: None,
                }
            }
            Reading::Unreadable(reason) => {
                // Once when it starts, not once per entry while it lasts.
                if self.view.unreadable.is_none() {
                    tracing::error!(%reason, "this build cannot read the replicated config; proxy streams and admin calls are refused until it can");
                }
                self.view.unreadable = Some(reason);
            }
        }
    }

    /// The state a snapshot holds, read by this build; `view` is the view held so far, so
    /// that an unreadable config is reported once.
    fn from_snapshot(meta: &SnapshotMeta, data: &[u8], view: &ConfigView) -> anyhow::Result<Self> {
        let payload: SnapshotPayload = serde_json::from_slice(data).context("decoding snapshot")?;
        let mut state = AppliedState {
            last_applied: meta.last_log_id,
            membership: meta.last_membership.clone(),
            stored: payload.into_stored(),
            view: view.clone(),
        };
        state.publish(state.stored.read());
        Ok(state)
    }

    fn stage_meta(&self, batch: &mut sled::Batch) -> Result<(), serde_json::Error> {
        batch.insert(APPLIED, serde_json::to_vec(&self.last_applied)?);
        batch.insert(MEMBERSHIP, serde_json::to_vec(&self.membership)?);
        batch.insert(VERSION, serde_json::to_vec(&self.stored.version)?);
        Ok(())
    }
}

/// Writes `state` over `old` in one batch, so a crash leaves one or the other.
fn replace_state(tree: &sled::Tree, old: &StoredConfig, state: &AppliedState) -> anyhow::Result<()> {
    let mut batch = sled::Batch::default();
    for key in old.objects.keys() {
        batch.remove(object_key(key));
    }
    for (key, json) in &state.stored.objects {
        batch.insert(object_key(key), json.get().as_bytes());
    }
    state.stage_meta(&mut batch)?;
    tree.apply_batch(batch)?;
    Ok(())
}

pub struct StateMachineStore {
    tree: Tree,
    snapshots: Arc<SnapshotFile>,
    state: AppliedState,
    publish: watch::Sender<ConfigView>,
}

impl StateMachineStore {
    /// Loads the applied state from `db` and publishes it.
    pub fn open(storage: &Storage) -> anyhow::Result<Self> {
        let tree = storage.tree("sm").context("opening state machine tree")?;
        let (snapshots, current) = SnapshotFile::open(storage)?;
        let current = snapshot::take_from_sled(storage, &tree, &snapshots, current)
            .context("moving the snapshot out of sled")?;
        let mut state = AppliedState::load(&tree).context("loading state machine")?;
        if let Some(Stored { meta, data }) =
            current.filter(|stored| stored.meta.last_log_id > state.last_applied)
        {
            // An install cut short after its snapshot was stored, or a build whose state had
            // not reached the disk yet: the snapshot is the later state, and the log may
            // already be purged up to it.
            tracing::info!(snapshot = %meta.snapshot_id, "restoring the state machine from the snapshot");
            let restored = AppliedState::from_snapshot(&meta, &data, &state.view)?;
            replace_state(&tree, &state.stored, &restored)
                .and_then(|()| Ok(tree.flush()?))
                .context("writing the state restored from the snapshot")?;
            state = restored;
        }
        let (publish, _) = watch::channel(state.view.clone());
        Ok(Self {
            tree,
            snapshots: Arc::new(snapshots),
            state,
            publish,
        })
    }

    #[cfg(test)]
    pub(super) fn stored(&self) -> &StoredConfig {
        &self.state.stored
    }

    /// Follows every applied version, starting with the current one.
    pub fn subscribe(&self) -> watch::Receiver<ConfigView> {
        self.publish.subscribe()
    }

    /// Applies one entry to the in-memory state and stages its writes.
    fn apply_entry(&mut self, entry: Entry, batch: &mut sled::Batch) -> Outcome {
        self.state.last_applied = Some(entry.log_id);
        let write = match entry.payload {
            EntryPayload::Normal(write) => write,
            EntryPayload::Blank => return Ok(self.unchanged()),
            EntryPayload::Membership(membership) => {
                self.state.membership = StoredMembership::new(Some(entry.log_id), membership);
                return Ok(self.unchanged());
            }
        };
        let applied = self.state.stored.apply(&write)?;
        if write.changes_something() {
            for (key, json) in &write.put {
                batch.insert(object_key(key), json.get().as_bytes());
            }
            for key in &write.delete {
                batch.remove(object_key(key));
            }
            self.read_after(&write);
        }
        Ok(applied)
    }

    fn read_after(&mut self, write: &Write) {
        let view = &self.state.view;
        let reading = if view.unreadable.is_none() && view.version + 1 == self.state.stored.version {
            self.state.stored.read_after(&view.config, write)
        } else {
            self.state.stored.read()
        };
        self.state.publish(reading);
    }

    fn unchanged(&self) -> Applied {
        Applied {
            version: self.state.stored.version,
            changes: Vec::new(),
        }
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        Ok((self.state.last_applied, self.state.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Outcome>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let before = self.state.stored.version;
        let mut batch = sled::Batch::default();
        let outcomes: Vec<Outcome> = entries
            .into_iter()
            .map(|entry| self.apply_entry(entry, &mut batch))
            .collect();
        self.state
            .stage_meta(&mut batch)
            .map_err(|e| StorageIOError::write_state_machine(&e))?;
        self.tree
            .apply_batch(batch)
            .map_err(|e| StorageIOError::write_state_machine(&e))?;
        if self.state.stored.version != before {
            self.publish.send_replace(self.state.view.clone());
        }
        Ok(outcomes)
    }

    async fn get_snapshot_builder(&mut self) -> SnapshotBuilder {
        SnapshotBuilder {
            file: self.snapshots.clone(),
            state: Some(self.state.clone()),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let data = snapshot.into_inner();
        // Decoding and reading megabytes of JSON run off the runtime that serves Raft.
        let (owned_meta, view) = (meta.clone(), self.state.view.clone());
        let (state, data) = snapshot::off_runtime(move || {
            AppliedState::from_snapshot(&owned_meta, &data, &view).map(|state| (state, data))
        })
        .await
        .map_err(|e| {
            StorageIOError::read_snapshot(Some(meta.signature()), AnyError::error(format!("{e:#}")))
        })?;
        // The snapshot first: once it is durable, a crash before the state below is written
        // leaves an open to restore the state from it.
        snapshot::store(&self.snapshots, meta, move || Ok(data)).await?;
        let write = |e: &dyn std::error::Error| StorageIOError::write_state_machine(AnyError::error(e));
        replace_state(&self.tree, &self.state.stored, &state).map_err(|e| write(&*e))?;
        self.tree.flush_async().await.map_err(|e| write(&e))?;
        self.state = state;
        self.publish.send_replace(self.state.view.clone());
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        snapshot::current(&self.snapshots).await
    }
}
