//! The signals group's storage, all in memory: signals are worth keeping for a few hundred
//! milliseconds, so nothing here is written to disk, and a restarted node starts empty and
//! catches up from the leader (a snapshot of the latest readings).
//!
//! Losing the log on restart breaks two assumptions of Raft, handled where they matter: a
//! follower's log can go backwards (openraft's `loosen-follower-log-revert` lets the leader
//! resend instead of panicking), and a forgotten vote could be cast twice in one term (the
//! Raft service ignores signals votes for a while after start, see `network/server.rs`).

// openraft's storage traits dictate the (large) error type; helpers return it as-is.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::RangeBounds;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use openraft::storage::{LogFlushed, RaftLogStorage, RaftStateMachine};
use openraft::{
    AnyError, EntryPayload, LogState, OptionalSend, RaftLogReader, RaftSnapshotBuilder, Snapshot,
    StorageIOError, Vote,
};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::types::{
    Entry, LogId, Reading, SignalEntry, SignalsTypeConfig, SnapshotMeta, StorageError, StoredMembership,
};
use crate::types::NodeId;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update below completes under the lock; a panicking holder leaves no half-write.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[derive(Default)]
struct LogInner {
    vote: Option<Vote<NodeId>>,
    committed: Option<LogId>,
    last_purged: Option<LogId>,
    entries: BTreeMap<u64, Entry>,
}

/// The signals log. Cheap to clone: clones share the entries (the log reader is a clone).
#[derive(Clone, Default)]
pub struct MemLog {
    inner: Arc<Mutex<LogInner>>,
}

impl RaftLogReader<SignalsTypeConfig> for MemLog {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        Ok(lock(&self.inner)
            .entries
            .range(range)
            .map(|(_, entry)| entry.clone())
            .collect())
    }
}

impl RaftLogStorage<SignalsTypeConfig> for MemLog {
    type LogReader = MemLog;

    async fn get_log_state(&mut self) -> Result<LogState<SignalsTypeConfig>, StorageError> {
        let inner = lock(&self.inner);
        let last = inner.entries.values().next_back().map(|entry| entry.log_id);
        Ok(LogState {
            last_purged_log_id: inner.last_purged,
            last_log_id: last.or(inner.last_purged),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        lock(&self.inner).vote = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        Ok(lock(&self.inner).vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        lock(&self.inner).committed = committed;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(lock(&self.inner).committed)
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<SignalsTypeConfig>,
    ) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        {
            let mut inner = lock(&self.inner);
            for entry in entries {
                inner.entries.insert(entry.log_id.index, entry);
            }
        }
        callback.log_io_completed(Ok(()));
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        lock(&self.inner).entries.split_off(&log_id.index);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let mut inner = lock(&self.inner);
        inner.last_purged = Some(log_id);
        let kept = inner.entries.split_off(&(log_id.index + 1));
        inner.entries = kept;
        Ok(())
    }
}

/// The latest reading of every endpoint of every pool, as of one point of the signals log.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SignalView {
    /// Index of the last applied signals entry; 0 before the first.
    pub generation: u64,
    pub pools: BTreeMap<String, Arc<PoolSignals>>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PoolSignals {
    /// The generation that last changed this pool: the stream sends a pool again only when
    /// this moves.
    pub generation: u64,
    /// By endpoint; `None` until the endpoint first answers.
    pub endpoints: BTreeMap<String, Option<HeldReading>>,
}

/// A reading and when this node took it in: its age now is `reading.age_ms` plus the time
/// since, on this node's monotonic clock. A snapshot carries the age as of its building.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "Reading", into = "Reading")]
pub struct HeldReading {
    pub reading: Reading,
    pub received: Instant,
}

impl HeldReading {
    pub fn age_ms(&self) -> u32 {
        super::scrape::add_ms(self.reading.age_ms, self.received.elapsed())
    }
}

impl From<Reading> for HeldReading {
    fn from(reading: Reading) -> Self {
        HeldReading {
            reading,
            received: Instant::now(),
        }
    }
}

impl From<HeldReading> for Reading {
    fn from(held: HeldReading) -> Self {
        Reading {
            age_ms: held.age_ms(),
            ..held.reading
        }
    }
}

impl SignalView {
    fn apply(&mut self, generation: u64, entry: SignalEntry) {
        self.generation = generation;
        for pool in entry.removed_pools {
            self.pools.remove(&pool);
        }
        for round in entry.rounds {
            let previous = self.pools.remove(&round.pool);
            let endpoints = round
                .endpoints
                .into_iter()
                .map(|endpoint| {
                    let reading = endpoint.reading.map(HeldReading::from).or_else(|| {
                        previous
                            .as_ref()
                            .and_then(|pool| pool.endpoints.get(&endpoint.endpoint).cloned().flatten())
                    });
                    (endpoint.endpoint, reading)
                })
                .collect();
            self.pools.insert(
                round.pool,
                Arc::new(PoolSignals {
                    generation,
                    endpoints,
                }),
            );
        }
    }
}

/// The latest snapshot, shared by the state machine and its builders.
type SharedSnapshot = Arc<Mutex<Option<(SnapshotMeta, Vec<u8>)>>>;

#[derive(Clone, Default, Serialize, Deserialize)]
struct SignalState {
    last_applied: Option<LogId>,
    membership: StoredMembership,
    view: SignalView,
}

/// The signals state machine: applies rounds and publishes each new [`SignalView`].
pub struct SignalStateMachine {
    state: SignalState,
    publish: watch::Sender<SignalView>,
    current_snapshot: SharedSnapshot,
}

impl SignalStateMachine {
    pub fn new() -> Self {
        let (publish, _) = watch::channel(SignalView::default());
        Self {
            state: SignalState::default(),
            publish,
            current_snapshot: Arc::default(),
        }
    }

    pub fn subscribe(&self) -> watch::Receiver<SignalView> {
        self.publish.subscribe()
    }
}

pub struct SignalSnapshotBuilder {
    state: SignalState,
    current_snapshot: SharedSnapshot,
}

impl RaftSnapshotBuilder<SignalsTypeConfig> for SignalSnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<SignalsTypeConfig>, StorageError> {
        let data = serde_json::to_vec(&self.state).map_err(|e| StorageIOError::write_snapshot(None, &e))?;
        let index = self.state.last_applied.map(|id| id.index).unwrap_or_default();
        let term = self
            .state
            .last_applied
            .map(|id| id.leader_id.term)
            .unwrap_or_default();
        let meta = SnapshotMeta {
            last_log_id: self.state.last_applied,
            last_membership: self.state.membership.clone(),
            snapshot_id: format!("{term}-{index}"),
        };
        let mut current = lock(&self.current_snapshot);
        // A build that started before an install must not replace the installed snapshot.
        if current
            .as_ref()
            .is_none_or(|(held, _)| held.last_log_id <= meta.last_log_id)
        {
            *current = Some((meta.clone(), data.clone()));
        }
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

impl RaftStateMachine<SignalsTypeConfig> for SignalStateMachine {
    type SnapshotBuilder = SignalSnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        Ok((self.state.last_applied, self.state.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<()>, StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut applied = Vec::new();
        let mut changed = false;
        for entry in entries {
            self.state.last_applied = Some(entry.log_id);
            match entry.payload {
                EntryPayload::Normal(signals) => {
                    self.state.view.apply(entry.log_id.index, signals);
                    changed = true;
                }
                EntryPayload::Membership(membership) => {
                    self.state.membership = StoredMembership::new(Some(entry.log_id), membership);
                }
                EntryPayload::Blank => {}
            }
            applied.push(());
        }
        if changed {
            self.publish.send_replace(self.state.view.clone());
        }
        Ok(applied)
    }

    async fn get_snapshot_builder(&mut self) -> SignalSnapshotBuilder {
        SignalSnapshotBuilder {
            state: self.state.clone(),
            current_snapshot: self.current_snapshot.clone(),
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
        let state: SignalState = serde_json::from_slice(&data).map_err(|e| {
            StorageIOError::read_snapshot(Some(meta.signature()), AnyError::error(format!("decoding: {e}")))
        })?;
        self.state = SignalState {
            last_applied: meta.last_log_id,
            membership: meta.last_membership.clone(),
            view: state.view,
        };
        *lock(&self.current_snapshot) = Some((meta.clone(), data));
        self.publish.send_replace(self.state.view.clone());
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<SignalsTypeConfig>>, StorageError> {
        Ok(lock(&self.current_snapshot).clone().map(|(meta, data)| Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        }))
    }
}

#[cfg(test)]
mod tests;
