//! Raft storage in one directory per process: the log's entries in an append-only file
//! (`file.rs`), the current snapshot in a file of its own (`snapshot.rs`), the vote and the
//! state machine in one sled database. The rest of the crate only sees openraft's storage
//! traits and the published [`ConfigView`](crate::view::ConfigView), so another engine can
//! replace either by implementing the same two types.

// openraft's storage traits dictate the (large) error type; helpers return it as-is.
#![allow(clippy::result_large_err)]

mod file;
mod log;
mod snapshot;
mod state_machine;

pub use log::LogStore;
pub use state_machine::StateMachineStore;

use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::sync::watch;

use crate::types::LogId;

/// How long [`Storage::open`] waits for a database lock that is being released.
const LOCK_GRACE: Duration = Duration::from_secs(5);

/// The one sled database of a process. sled holds its file lock until the last tree handle
/// is dropped, and openraft drops its storage workers only after `Raft::shutdown` returns, so
/// [`Storage::close`] waits for every [`Tree`] handed out before it returns: a node restarted
/// in the same process (or a test) then finds the database free.
pub struct Storage {
    dir: PathBuf,
    db: sled::Db,
    open_trees: Arc<()>,
    /// The last log id the durable snapshot covers, which the log is never purged past:
    /// openraft purges the log while the state machine is still installing the snapshot that
    /// covers it, and a crash in between would leave entries that are nowhere.
    snapshot_covers: Arc<watch::Sender<Option<LogId>>>,
}

impl Storage {
    /// Opens the database, waiting up to [`LOCK_GRACE`] for its file lock: after a database
    /// of this process is dropped, sled's I/O threads may still hold the lock for a moment
    /// (a node restarted in-process, or a test that reopens, hit that on a busy machine).
    /// Another process holding the lock gets the lock error after the grace.
    pub fn open(path: &Path) -> anyhow::Result<Storage> {
        let deadline = Instant::now() + LOCK_GRACE;
        let db = loop {
            let opened = sled::Config::new()
                .path(path)
                .cache_capacity(64 * 1024 * 1024)
                .open();
            match opened {
                Err(sled::Error::Io(error))
                    if error.to_string().contains("could not acquire lock") && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
                opened => {
                    break opened.with_context(|| format!("opening sled database at {}", path.display()))?
                }
            }
        };
        Ok(Storage {
            dir: path.to_owned(),
            db,
            open_trees: Arc::default(),
            snapshot_covers: Arc::new(watch::Sender::new(None)),
        })
    }

    /// The directory sled's lock guards, which also holds the log and the snapshot.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A tree an older build wrote, if the database has it (`tree` would create it).
    fn legacy_tree(&self, name: &str) -> Result<Option<sled::Tree>, sled::Error> {
        if self
            .db
            .tree_names()
            .iter()
            .any(|tree| tree.as_ref() == name.as_bytes())
        {
            self.db.open_tree(name).map(Some)
        } else {
            Ok(None)
        }
    }

    /// For tests that purge the log without snapshots (openraft's storage suite), which
    /// openraft itself never does.
    #[cfg(test)]
    fn let_every_purge_through(&self) {
        use openraft::CommittedLeaderId;
        let last = LogId::new(CommittedLeaderId::new(u64::MAX, u64::MAX), u64::MAX);
        self.snapshot_covers.send_replace(Some(last));
    }

    fn drop_tree(&self, name: &str) -> Result<(), sled::Error> {
        self.db.drop_tree(name).map(drop)
    }

    pub fn tree(&self, name: &str) -> Result<Tree, sled::Error> {
        Ok(Tree {
            inner: self.db.open_tree(name)?,
            _open: self.open_trees.clone(),
        })
    }

    /// Waits up to `grace` for every tree to be dropped, then flushes.
    pub async fn close(self, grace: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + grace;
        while Arc::strong_count(&self.open_trees) > 1 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if Arc::strong_count(&self.open_trees) > 1 {
            tracing::warn!(
                "Raft storage still in use after shutdown; the database stays locked until it is released"
            );
        }
        self.db.flush_async().await.context("flushing sled")?;
        Ok(())
    }
}

/// A sled tree that keeps [`Storage::close`] waiting while it lives.
#[derive(Clone)]
pub struct Tree {
    inner: sled::Tree,
    _open: Arc<()>,
}

impl Deref for Tree {
    type Target = sled::Tree;

    fn deref(&self) -> &sled::Tree {
        &self.inner
    }
}

#[cfg(test)]
mod tests;
