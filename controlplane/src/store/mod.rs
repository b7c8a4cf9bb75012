//! Raft storage on one sled database per process. The rest of the crate only sees
//! openraft's storage traits and the published [`ConfigView`](crate::view::ConfigView),
//! so another engine can replace sled by implementing the same two types.

// openraft's storage traits dictate the (large) error type; helpers return it as-is.
#![allow(clippy::result_large_err)]

mod log;
mod snapshot;
mod state_machine;

pub use log::LogStore;
pub use state_machine::StateMachineStore;

use std::path::Path;

use anyhow::Context;

/// Opens the single sled database holding the log, the vote and the state machine.
pub fn open_db(path: &Path) -> anyhow::Result<sled::Db> {
    sled::Config::new()
        .path(path)
        .cache_capacity(64 * 1024 * 1024)
        .open()
        .with_context(|| format!("opening sled database at {}", path.display()))
}

#[cfg(test)]
mod tests;
