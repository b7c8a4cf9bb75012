//! The state machine on sled (tree `sm`): last applied log id, last membership, config
//! version and every object as JSON, written in one atomic batch per `apply` call, so a
//! restart reads back exactly the state of some applied log id.

use std::io::Cursor;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use openraft::storage::RaftStateMachine;
use openraft::{AnyError, EntryPayload, OptionalSend, Snapshot, StorageIOError};
use portcullis_config::{Change, ConfigSet, ObjectKey};
use tokio::sync::watch;

use super::snapshot::{self, SnapshotBuilder, SnapshotPayload};
use super::{Storage, Tree};
use crate::command::{self, Applied, Outcome};
use crate::types::{Entry, LogId, SnapshotMeta, StorageError, StoredMembership, TypeConfig};
use crate::view::ConfigView;

const APPLIED: &[u8] = b"applied";
const MEMBERSHIP: &[u8] = b"membership";
const VERSION: &[u8] = b"version";
const OBJECT_PREFIX: &str = "obj/";

fn object_key(key: &ObjectKey) -> Vec<u8> {
    format!("{OBJECT_PREFIX}{key}").into_bytes()
}

#[derive(Debug, Clone, Default)]
pub struct AppliedState {
    pub last_applied: Option<LogId>,
    pub membership: StoredMembership,
    pub version: u64,
    pub config: Arc<ConfigSet>,
}

impl AppliedState {
    fn view(&self) -> ConfigView {
        ConfigView {
            version: self.version,
            config: self.config.clone(),
        }
    }

    fn load(tree: &sled::Tree) -> anyhow::Result<Self> {
        fn get<T: serde::de::DeserializeOwned + Default>(tree: &sled::Tree, key: &[u8]) -> anyhow::Result<T> {
            match tree.get(key)? {
                Some(bytes) => serde_json::from_slice(&bytes)
                    .with_context(|| format!("decoding {}", String::from_utf8_lossy(key))),
                None => Ok(T::default()),
            }
        }
        let mut objects = Vec::new();
        for item in tree.scan_prefix(OBJECT_PREFIX) {
            let (key, bytes) = item?;
            let location = String::from_utf8_lossy(&key).into_owned();
            objects.push(portcullis_config::Object::from_json_bytes(&bytes, &location)?);
        }
        Ok(Self {
            last_applied: get(tree, APPLIED)?,
            membership: get(tree, MEMBERSHIP)?,
            version: get(tree, VERSION)?,
            config: Arc::new(ConfigSet::from_objects(objects).context("stored config is invalid")?),
        })
    }

    fn stage_meta(&self, batch: &mut sled::Batch) -> Result<(), serde_json::Error> {
        batch.insert(APPLIED, serde_json::to_vec(&self.last_applied)?);
        batch.insert(MEMBERSHIP, serde_json::to_vec(&self.membership)?);
        batch.insert(VERSION, serde_json::to_vec(&self.version)?);
        Ok(())
    }
}

pub struct StateMachineStore {
    tree: Tree,
    state: AppliedState,
    publish: watch::Sender<ConfigView>,
    snapshot_lock: Arc<Mutex<()>>,
}

impl StateMachineStore {
    /// Loads the applied state from `db` and publishes it.
    pub fn open(storage: &Storage) -> anyhow::Result<Self> {
        let tree = storage.tree("sm").context("opening state machine tree")?;
        let state = AppliedState::load(&tree).context("loading state machine")?;
        let (publish, _) = watch::channel(state.view());
        Ok(Self {
            tree,
            state,
            publish,
            snapshot_lock: Arc::default(),
        })
    }

    /// Follows every applied version, starting with the current one.
    pub fn subscribe(&self) -> watch::Receiver<ConfigView> {
        self.publish.subscribe()
    }

    /// Applies one entry to the in-memory state and stages its writes.
    fn apply_entry(&mut self, entry: Entry, batch: &mut sled::Batch) -> Outcome {
        self.state.last_applied = Some(entry.log_id);
        let command = match entry.payload {
            EntryPayload::Normal(command) => command,
            EntryPayload::Blank => return Ok(self.unchanged()),
            EntryPayload::Membership(membership) => {
                self.state.membership = StoredMembership::new(Some(entry.log_id), membership);
                return Ok(self.unchanged());
            }
        };
        let effect = command::execute(&self.state.config, self.state.version, &command)?;
        if let Some(next) = &effect.next {
            for (key, change) in &effect.changes {
                match (change, next.get(key)) {
                    (Change::Deleted, _) => batch.remove(object_key(key)),
                    (Change::Created | Change::Configured, Some(object)) => {
                        batch.insert(object_key(key), object.to_json_bytes())
                    }
                    _ => {}
                }
            }
            self.state.version += 1;
            self.state.config = Arc::new(next.clone());
        }
        Ok(effect.applied(self.state.version))
    }

    fn unchanged(&self) -> Applied {
        Applied {
            version: self.state.version,
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
        let before = self.state.version;
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
        if self.state.version != before {
            self.publish.send_replace(self.state.view());
        }
        Ok(outcomes)
    }

    async fn get_snapshot_builder(&mut self) -> SnapshotBuilder {
        SnapshotBuilder {
            tree: self.tree.clone(),
            state: self.state.clone(),
            lock: self.snapshot_lock.clone(),
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
        let fail =
            |message: String| StorageIOError::read_snapshot(Some(meta.signature()), AnyError::error(message));
        let payload: SnapshotPayload =
            serde_json::from_slice(&data).map_err(|e| fail(format!("decoding snapshot: {e}")))?;
        let objects = command::decode_objects(&payload.objects)
            .map_err(|e| fail(format!("snapshot holds an invalid object: {e}")))?;
        let config = ConfigSet::from_objects(objects)
            .map_err(|e| fail(format!("snapshot holds an invalid config: {e}")))?;
        let state = AppliedState {
            last_applied: meta.last_log_id,
            membership: meta.last_membership.clone(),
            version: payload.version,
            config: Arc::new(config),
        };
        let write = |e: &dyn std::error::Error| {
            StorageIOError::write_snapshot(Some(meta.signature()), AnyError::error(e))
        };
        // One batch replaces everything, so a crash leaves either the old or the new state.
        let mut batch = sled::Batch::default();
        for key in self.state.config.objects().map(|object| object.key()) {
            batch.remove(object_key(&key));
        }
        for object in state.config.objects() {
            batch.insert(object_key(&object.key()), object.to_json_bytes());
        }
        state.stage_meta(&mut batch).map_err(|e| write(&e))?;
        {
            let _guard = self
                .snapshot_lock
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            snapshot::stage(&self.tree, &mut batch, meta, &data)?;
            self.tree.apply_batch(batch).map_err(|e| write(&e))?;
        }
        self.tree.flush_async().await.map_err(|e| write(&e))?;
        self.state = state;
        self.publish.send_replace(self.state.view());
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        snapshot::read_current(&self.tree, &self.snapshot_lock)
    }
}
