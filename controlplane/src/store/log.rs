//! The Raft log on sled: tree `log` holds entries as JSON under big-endian indexes (so
//! key order is index order); tree `meta` holds the vote, the committed id and the last
//! purged id.

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};

use openraft::storage::{LogFlushed, RaftLogStorage};
use openraft::{LogState, RaftLogReader, StorageIOError, Vote};

use super::{Storage, Tree};
use crate::types::{Entry, LogId, NodeId, StorageError, TypeConfig};

const VOTE: &[u8] = b"vote";
const COMMITTED: &[u8] = b"committed";
const LAST_PURGED: &[u8] = b"last_purged";

/// Cheap to clone: sled trees are shared handles, which is how openraft's log reader
/// and the log store see the same data.
#[derive(Clone)]
pub struct LogStore {
    log: Tree,
    meta: Tree,
}

impl LogStore {
    pub fn open(storage: &Storage) -> Result<Self, sled::Error> {
        Ok(Self {
            log: storage.tree("log")?,
            meta: storage.tree("meta")?,
        })
    }

    fn read_meta<T: serde::de::DeserializeOwned>(
        &self,
        key: &[u8],
    ) -> Result<Option<T>, StorageIOError<NodeId>> {
        let Some(bytes) = self.meta.get(key).map_err(|e| StorageIOError::read(&e))? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| StorageIOError::read(&e))
    }

    fn write_meta<T: serde::Serialize>(&self, key: &[u8], value: &T) -> Result<(), StorageIOError<NodeId>> {
        let bytes = serde_json::to_vec(value).map_err(|e| StorageIOError::write(&e))?;
        self.meta
            .insert(key, bytes)
            .map_err(|e| StorageIOError::write(&e))?;
        Ok(())
    }

    async fn flush(&self) -> Result<(), sled::Error> {
        self.log.flush_async().await.map(drop)
    }

    fn decode(bytes: &[u8]) -> Result<Entry, StorageIOError<NodeId>> {
        serde_json::from_slice(bytes).map_err(|e| StorageIOError::read_logs(&e))
    }

    fn last_entry(&self) -> Result<Option<Entry>, StorageIOError<NodeId>> {
        match self.log.last().map_err(|e| StorageIOError::read_logs(&e))? {
            Some((_, bytes)) => Self::decode(&bytes).map(Some),
            None => Ok(None),
        }
    }
}

fn index_key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let start = match range.start_bound() {
            Bound::Included(&index) => Bound::Included(index_key(index)),
            Bound::Excluded(&index) => Bound::Excluded(index_key(index)),
            Bound::Unbounded => Bound::Unbounded,
        };
        let end = match range.end_bound() {
            Bound::Included(&index) => Bound::Included(index_key(index)),
            Bound::Excluded(&index) => Bound::Excluded(index_key(index)),
            Bound::Unbounded => Bound::Unbounded,
        };
        let mut entries = Vec::new();
        for item in self.log.range::<[u8; 8], _>((start, end)) {
            let (_, bytes) = item.map_err(|e| StorageIOError::read_logs(&e))?;
            entries.push(Self::decode(&bytes)?);
        }
        Ok(entries)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged_log_id: Option<LogId> = self.read_meta(LAST_PURGED)?;
        let last_log_id = match self.last_entry()? {
            Some(entry) => Some(entry.log_id),
            None => last_purged_log_id,
        };
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
        self.flush().await.map_err(|e| StorageIOError::write_vote(&e))?;
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        Ok(self.read_meta(VOTE)?)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        Ok(self.write_meta(COMMITTED, &committed)?)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.read_meta::<Option<LogId>>(COMMITTED)?.flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let mut batch = sled::Batch::default();
        for entry in entries {
            let bytes = serde_json::to_vec(&entry).map_err(|e| StorageIOError::write_logs(&e))?;
            batch.insert(&index_key(entry.log_id.index), bytes);
        }
        self.log
            .apply_batch(batch)
            .map_err(|e| StorageIOError::write_logs(&e))?;
        // sled only syncs on its own every 500 ms; openraft treats the callback as "durable".
        match self.flush().await {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(error) => {
                let message = error.to_string();
                callback.log_io_completed(Err(std::io::Error::other(message)));
                Err(StorageIOError::write_logs(&error).into())
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let mut batch = sled::Batch::default();
        for item in self.log.range(index_key(log_id.index)..) {
            let (key, _) = item.map_err(|e| StorageIOError::write_logs(&e))?;
            batch.remove(key);
        }
        self.log
            .apply_batch(batch)
            .map_err(|e| StorageIOError::write_logs(&e))?;
        self.flush().await.map_err(|e| StorageIOError::write_logs(&e))?;
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        // Record the purge point first: a crash midway then leaves extra entries, never a gap.
        self.write_meta(LAST_PURGED, &log_id)?;
        let mut batch = sled::Batch::default();
        for item in self.log.range(..=index_key(log_id.index)) {
            let (key, _) = item.map_err(|e| StorageIOError::write_logs(&e))?;
            batch.remove(key);
        }
        self.log
            .apply_batch(batch)
            .map_err(|e| StorageIOError::write_logs(&e))?;
        self.flush().await.map_err(|e| StorageIOError::write_logs(&e))?;
        Ok(())
    }
}
