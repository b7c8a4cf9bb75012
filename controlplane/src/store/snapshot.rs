//! Snapshots: the whole applied state as one JSON document, in a file of its own
//! (`state.snapshot` beside the log), replaced whole by writing a new file, making it durable
//! and renaming it over the old one: a crash leaves one snapshot or the other, never a mix.
//!
//! Not in sled: to sled a value of megabytes is a blob file, and sled 0.34 leaves the blob
//! files of superseded values behind when its process is killed, so a node in a crash loop
//! filled its disk (docs/operations.md has the measurement). Builds before this one kept the
//! snapshot in sled, first in the state machine's tree, then in a tree of its own;
//! [`take_from_sled`] moves it here on open.
//!
//! Layout: an 8-byte magic, the meta's length (u32, little endian), the CRC-32 of the length,
//! the meta and the payload (u32, little endian), the meta as JSON, then the payload.
//!
//! The log is purged only up to what the durable snapshot covers ([`Storage`]'s
//! `snapshot_covers`, which [`SnapshotFile::store`] moves once the file is in place).

use std::fs;
use std::io::{self, Cursor};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use openraft::{AnyError, RaftSnapshotBuilder, Snapshot, StorageIOError};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use tokio::sync::watch;

use super::file::{replace, sync_parent, temporary_path};
use super::state_machine::AppliedState;
use super::Storage;
use crate::command::{StoredConfig, StoredKey};
use crate::types::{LogId, NodeId, SnapshotMeta, StorageError, TypeConfig};

const FILE_NAME: &str = "state.snapshot";
const MAGIC: &[u8; 8] = b"PCRSNAP1";
const HEADER_LEN: usize = MAGIC.len() + 8;

/// Where builds before the snapshot file kept it, as two sled keys.
pub(super) const SLED_META: &[u8] = b"snapshot/meta";
pub(super) const SLED_DATA: &[u8] = b"snapshot/data";
/// The tree of the builds just before the snapshot file (the others used the state machine's).
pub(super) const SLED_TREE: &str = "snapshot";

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

/// A snapshot as read from disk.
pub(super) struct Stored {
    pub meta: SnapshotMeta,
    pub data: Vec<u8>,
}

/// The current snapshot's file.
pub(super) struct SnapshotFile {
    path: PathBuf,
    covers: Arc<watch::Sender<Option<LogId>>>,
    /// The meta of the snapshot in the file. Its lock serializes writes: a build that started
    /// before an install must not replace the installed snapshot. Reads need no lock: a
    /// rename replaces the file whole, and an open file keeps what it opened.
    current: Mutex<Option<SnapshotMeta>>,
}

impl SnapshotFile {
    /// Opens the snapshot file in `storage`'s directory and reads the snapshot it holds. A
    /// damaged file is an error: the log may have been purged up to it, so it cannot be
    /// dropped.
    pub(super) fn open(storage: &Storage) -> anyhow::Result<(SnapshotFile, Option<Stored>)> {
        let path = storage.dir().join(FILE_NAME);
        // What a crash left of a store: never renamed, so never the snapshot.
        let temporary = temporary_path(&path);
        match fs::remove_file(&temporary) {
            Err(error) if error.kind() != io::ErrorKind::NotFound => {
                return Err(error).with_context(|| format!("removing {}", temporary.display()))
            }
            _ => {}
        }
        let stored = read(&path)?;
        let meta = stored.as_ref().map(|stored| stored.meta.clone());
        storage
            .snapshot_covers
            .send_replace(meta.as_ref().and_then(|meta| meta.last_log_id));
        let file = SnapshotFile {
            path,
            covers: storage.snapshot_covers.clone(),
            current: Mutex::new(meta),
        };
        Ok((file, stored))
    }

    /// Makes `meta` and `data` the current snapshot, durably, unless the file already holds a
    /// later one. Blocks on the disk.
    pub(super) fn store(&self, meta: &SnapshotMeta, data: &[u8]) -> anyhow::Result<()> {
        let mut current = self
            .current
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if current
            .as_ref()
            .is_some_and(|current| current.last_log_id > meta.last_log_id)
        {
            return Ok(());
        }
        let meta_json = serde_json::to_vec(meta)?;
        let meta_len = u32::try_from(meta_json.len())
            .context("snapshot meta over 4 GiB")?
            .to_le_bytes();
        let mut contents = Vec::with_capacity(HEADER_LEN + meta_json.len() + data.len());
        contents.extend_from_slice(MAGIC);
        contents.extend_from_slice(&meta_len);
        contents.extend_from_slice(&checksum(&meta_len, &meta_json, data).to_le_bytes());
        contents.extend_from_slice(&meta_json);
        contents.extend_from_slice(data);
        replace(&self.path, &contents)?;
        // Only a durable rename may let the log be purged up to this snapshot.
        sync_parent(&self.path)?;
        *current = Some(meta.clone());
        self.covers
            .send_if_modified(|covers| raise(covers, meta.last_log_id));
        Ok(())
    }

    /// Reads the current snapshot. Blocks on the disk.
    pub(super) fn read(&self) -> anyhow::Result<Option<Stored>> {
        read(&self.path)
    }
}

/// Moves `covers` up to `to`, never down; says whether it moved.
fn raise(covers: &mut Option<LogId>, to: Option<LogId>) -> bool {
    let moved = to > *covers;
    if moved {
        *covers = to;
    }
    moved
}

fn checksum(meta_len: &[u8; 4], meta: &[u8], data: &[u8]) -> u32 {
    let mut checksum = crc32fast::Hasher::new();
    checksum.update(meta_len);
    checksum.update(meta);
    checksum.update(data);
    checksum.finalize()
}

fn read(path: &Path) -> anyhow::Result<Option<Stored>> {
    let contents = match fs::read(path) {
        Ok(contents) => contents,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(error).with_context(|| format!("reading {}", path.display())),
    };
    decode(contents)
        .map(Some)
        .with_context(|| format!("reading snapshot {}", path.display()))
}

fn decode(mut contents: Vec<u8>) -> anyhow::Result<Stored> {
    if contents.len() < HEADER_LEN || &contents[..MAGIC.len()] != MAGIC {
        bail!("not a snapshot file (bad magic or shorter than its header): the file is damaged");
    }
    let word = |at: usize| {
        let mut bytes = [0; 4];
        bytes.copy_from_slice(&contents[at..at + 4]);
        bytes
    };
    let (meta_len, stored_checksum) = (word(MAGIC.len()), u32::from_le_bytes(word(MAGIC.len() + 4)));
    let meta_end = HEADER_LEN + u32::from_le_bytes(meta_len) as usize;
    if meta_end > contents.len() {
        bail!("the meta's length runs past the end of the file: the file is damaged");
    }
    let (meta, data) = contents[HEADER_LEN..].split_at(meta_end - HEADER_LEN);
    if checksum(&meta_len, meta, data) != stored_checksum {
        bail!("checksum mismatch: the file is damaged");
    }
    let meta: SnapshotMeta = serde_json::from_slice(meta).context("decoding the meta")?;
    let data = contents.split_off(meta_end);
    Ok(Stored { meta, data })
}

/// Moves a snapshot a build before the snapshot file kept in sled (tree `sm` or tree
/// `snapshot`) into `file`, keeping the latest of all of them (a rollback to such a build
/// and a second upgrade leave two; the older build may have purged the log up to its own),
/// then removes it from sled. Once the file is durable: a crash in between moves it again.
pub(super) fn take_from_sled(
    storage: &Storage,
    state_machine: &sled::Tree,
    file: &SnapshotFile,
    mut current: Option<Stored>,
) -> anyhow::Result<Option<Stored>> {
    let tree = storage.legacy_tree(SLED_TREE)?;
    let in_state_machine = state_machine.contains_key(SLED_META)? || state_machine.contains_key(SLED_DATA)?;
    for holder in [Some(state_machine), tree.as_ref()].into_iter().flatten() {
        // Both keys were written in one batch: one without the other is no snapshot.
        let (Some(meta), Some(data)) = (holder.get(SLED_META)?, holder.get(SLED_DATA)?) else {
            continue;
        };
        let meta: SnapshotMeta = serde_json::from_slice(&meta).context("decoding a snapshot meta in sled")?;
        if current
            .as_ref()
            .is_none_or(|current| meta.last_log_id > current.meta.last_log_id)
        {
            file.store(&meta, &data)?;
            current = Some(Stored {
                meta,
                data: data.to_vec(),
            });
        }
    }
    if in_state_machine {
        let mut batch = sled::Batch::default();
        batch.remove(SLED_META);
        batch.remove(SLED_DATA);
        state_machine.apply_batch(batch)?;
        state_machine.flush()?;
    }
    if tree.is_some() {
        storage.drop_tree(SLED_TREE)?;
    }
    Ok(current)
}

/// Runs `work` on a blocking thread; a panic in it is an error like the ones it returns.
pub(super) async fn off_runtime<T: Send + 'static>(
    work: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(work).await?
}

/// Stores the snapshot `encode` gives on a blocking thread, and returns its bytes: encoding
/// megabytes of JSON, writing them and two fsyncs must not stall the runtime that serves Raft.
pub(super) async fn store(
    file: &Arc<SnapshotFile>,
    meta: &SnapshotMeta,
    encode: impl FnOnce() -> anyhow::Result<Vec<u8>> + Send + 'static,
) -> Result<Vec<u8>, StorageError> {
    let (file, owned_meta) = (file.clone(), meta.clone());
    off_runtime(move || {
        let data = encode()?;
        file.store(&owned_meta, &data).map(|()| data)
    })
    .await
    .map_err(|error| {
        StorageIOError::<NodeId>::write_snapshot(
            Some(meta.signature()),
            AnyError::error(format!("{error:#}")),
        )
        .into()
    })
}

/// Reads the current snapshot on a blocking thread.
pub(super) async fn current(file: &Arc<SnapshotFile>) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
    let file = file.clone();
    let stored = off_runtime(move || file.read()).await.map_err(|error| {
        StorageIOError::<NodeId>::read_snapshot(None, AnyError::error(format!("{error:#}")))
    })?;
    Ok(stored.map(|Stored { meta, data }| Snapshot {
        meta,
        snapshot: Box::new(Cursor::new(data)),
    }))
}

/// Builds from the state captured when openraft asked for a builder, so building runs
/// concurrently with further applies without seeing them.
pub struct SnapshotBuilder {
    pub(super) file: Arc<SnapshotFile>,
    /// Taken by the build, which moves it to a blocking thread: openraft builds once per
    /// builder.
    pub(super) state: Option<AppliedState>,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let Some(state) = self.state.take() else {
            return Err(StorageIOError::write_snapshot(
                None,
                AnyError::error("a snapshot builder was asked to build a second time"),
            )
            .into());
        };
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|elapsed| elapsed.as_nanos())
            .unwrap_or_default();
        let index = state.last_applied.map(|id| id.index).unwrap_or_default();
        let meta = SnapshotMeta {
            last_log_id: state.last_applied,
            last_membership: state.membership.clone(),
            snapshot_id: format!("{index}-{nanos}"),
        };
        // The log is purged after this returns, so the snapshot is durable first. The state
        // machine's tree may not yet hold what the snapshot does: the open after a crash
        // restores it from the snapshot.
        let encode = move || Ok(serde_json::to_vec(&SnapshotPayload::of(&state))?);
        let data = store(&self.file, &meta, encode).await?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}
