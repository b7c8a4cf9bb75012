//! The Raft log: entries in one append-only file beside the sled database
//! ([`LogFile`]); the vote, the committed id and the last purged id in sled's tree `meta`.
//!
//! Why not sled for the entries too: appending is the commit path's one fsync per node, and
//! sled's flush hands the write to its I/O thread pool and waits (0.23–0.28 ms on the
//! benchmark machine), where a `write` and an `fdatasync` of the appended bytes take 0.08 ms.
//! openraft 0.9 waits for the leader's flush before it replicates, so the leader's and a
//! follower's flush are both on every commit's path (docs/benchmarks/fanout.md).

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{AnyError, LogState, RaftLogReader, StorageIOError, Vote};
use tokio::sync::watch;

use super::file::LogFile;
use super::{Storage, Tree};
use crate::types::{Entry, LogId, NodeId, StorageError, TypeConfig};

const VOTE: &[u8] = b"vote";
const COMMITTED: &[u8] = b"committed";
const LAST_PURGED: &[u8] = b"last_purged";
/// How long a purge waits for the snapshot that covers it to be durable: an install's write
/// of the snapshot file takes a fraction of that. Past it the purge fails, and with it the
/// node, rather than leave entries that are nowhere.
const SNAPSHOT_WAIT: Duration = Duration::from_secs(60);
/// Where builds before the log file kept entries (JSON under big-endian indexes).
const LEGACY_LOG_TREE: &str = "log";

/// Cheap to clone: openraft's log reader and the log store share the file and the tree.
#[derive(Clone)]
pub struct LogStore {
    entries: Arc<Mutex<LogFile>>,
    meta: Tree,
    /// The last log id the durable snapshot covers (see [`Storage`]).
    snapshot_covers: watch::Receiver<Option<LogId>>,
}

impl LogStore {
    /// Opens the log file in the database's directory, creating it (with the entries of a
    /// sled log tree an older build left) if it does not exist yet.
    pub fn open(storage: &Storage) -> anyhow::Result<Self> {
        let meta = storage.tree("meta")?;
        let last_purged: Option<LogId> = read_meta(&meta, LAST_PURGED)?;
        let legacy = storage.legacy_tree(LEGACY_LOG_TREE)?;
        let legacy_entries = || -> anyhow::Result<Vec<Entry>> {
            let Some(tree) = &legacy else {
                return Ok(Vec::new());
            };
            tree.iter()
                .values()
                .map(|bytes| Ok(serde_json::from_slice(&bytes?)?))
                .collect()
        };
        let path = storage.dir().join("entries.log");
        if !path.exists() && legacy.is_none() && (last_purged.is_some() || meta.get(VOTE)?.is_some()) {
            anyhow::bail!(
                "{} is missing but this node has voted: its log is lost; restore the node from its \
                 peers (remove it from the cluster, clear its data directory, add it again)",
                path.display()
            );
        }
        let file = LogFile::open(&path, last_purged, legacy_entries)?;
        if let Some(tree) = &legacy {
            // The file exists and the tree too: either a crash came between the two steps
            // (the tree holds nothing the file lacks) or an older build ran on this directory
            // after the migration and wrote to the tree, which cannot be merged back.
            let legacy_last = match tree.last()? {
                Some((key, _)) => Some(u64::from_be_bytes(key.as_ref().try_into()?)),
                None => None,
            };
            let file_last = file.last_log_id().or(last_purged).map(|id| id.index);
            if legacy_last > file_last {
                anyhow::bail!(
                    "sled's log tree holds entries up to {} after {} was written (an older build ran \
                     on this directory after an upgrade); downgrades are not supported",
                    legacy_last.unwrap_or_default(),
                    path.display()
                );
            }
            // Only once the file holds them durably: a crash before this point migrates again.
            storage.drop_tree(LEGACY_LOG_TREE)?;
        }
        Ok(Self {
            entries: Arc::new(Mutex::new(file)),
            meta,
            snapshot_covers: storage.snapshot_covers.subscribe(),
        })
    }

    /// The file's state stays consistent across a panic in another holder (every change
    /// either completes or leaves the in-memory index as it was), so a poisoned lock is taken.
    fn entries(&self) -> MutexGuard<'_, LogFile> {
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write_meta<T: serde::Serialize>(&self, key: &[u8], value: &T) -> Result<(), StorageIOError<NodeId>> {
        let bytes = serde_json::to_vec(value).map_err(|e| StorageIOError::write(&e))?;
        self.meta
            .insert(key, bytes)
            .map_err(|e| StorageIOError::write(&e))?;
        Ok(())
    }

    async fn flush_meta(&self) -> Result<(), sled::Error> {
        self.meta.flush_async().await.map(drop)
    }
}

fn read_meta<T: serde::de::DeserializeOwned>(
    meta: &Tree,
    key: &[u8],
) -> Result<Option<T>, StorageIOError<NodeId>> {
    let Some(bytes) = meta.get(key).map_err(|e| StorageIOError::read(&e))? else {
        return Ok(None);
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| StorageIOError::read(&e))
}

fn index_range(range: &impl RangeBounds<u64>) -> (u64, Option<u64>) {
    let start = match range.start_bound() {
        Bound::Included(&index) => index,
        Bound::Excluded(&index) => index.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&index) => Some(index.saturating_add(1)),
        Bound::Excluded(&index) => Some(index),
        Bound::Unbounded => None,
    };
    (start, end)
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let (start, end) = index_range(&range);
        Ok(self
            .entries()
            .read(start, end)
            .map_err(|e| StorageIOError::read_logs(AnyError::new(&e)))?)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged_log_id: Option<LogId> = read_meta(&self.meta, LAST_PURGED)?;
        let last_log_id = self.entries().last_log_id().or(last_purged_log_id);
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        self.write_meta(VOTE, vote)?;
        // A vote must survive a crash before it is acted on, or a node could vote twice in a term.
        self.flush_meta()
            .await
            .map_err(|e| StorageIOError::write_vote(&e))?;
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        Ok(read_meta(&self.meta, VOTE)?)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        Ok(self.write_meta(COMMITTED, &committed)?)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(read_meta::<Option<LogId>>(&self.meta, COMMITTED)?.flatten())
    }

    /// Writes and fsyncs on the calling task: openraft 0.9's core awaits the flush before it
    /// does anything else, so handing the fsync to another thread would only add two thread
    /// wake-ups to every commit.
    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        match self.entries().append(&entries) {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(error) => {
                let failure = StorageIOError::write_logs(AnyError::new(&error));
                callback.log_io_completed(Err(error));
                Err(failure.into())
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.entries()
            .truncate(log_id.index)
            .map_err(|e| StorageIOError::write_logs(AnyError::new(&e)))?;
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        // openraft asks for the purge as it hands the snapshot that covers it to the state
        // machine, which may still be writing it.
        let waited = tokio::time::timeout(
            SNAPSHOT_WAIT,
            self.snapshot_covers.wait_for(|covers| *covers >= Some(log_id)),
        )
        .await
        // Drops the watch's read guard before the message below borrows it again.
        .map(|covered| covered.map(drop));
        let reason = match waited {
            Ok(Ok(())) => None,
            Ok(Err(_)) => Some("the snapshot store is gone".to_string()),
            Err(_) => {
                let covers = match *self.snapshot_covers.borrow() {
                    Some(covers) => format!("covers only up to {covers}"),
                    None => "is missing".to_string(),
                };
                Some(format!(
                    "after {SNAPSHOT_WAIT:?} the durable snapshot {covers} (a failed install, or a \
                     stalled disk; see the state machine's errors)"
                ))
            }
        };
        if let Some(reason) = reason {
            return Err(StorageIOError::write_logs(AnyError::error(format!(
                "not purging the log up to {log_id}: {reason}"
            )))
            .into());
        }
        // The purge point is durable before any entry goes: a crash midway then leaves extra
        // entries, never a gap.
        self.write_meta(LAST_PURGED, &log_id)?;
        self.flush_meta()
            .await
            .map_err(|e| StorageIOError::write_logs(&e))?;
        self.entries()
            .purge(log_id)
            .map_err(|e| StorageIOError::write_logs(AnyError::new(&e)))?;
        Ok(())
    }
}
