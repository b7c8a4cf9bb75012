use std::sync::Arc;

use portcullis_config::ConfigSet;

/// The config as this node's build reads it, as the state machine publishes it. Readers
/// (admin reads, proxy streams) clone the `Arc`, so they never see a half-applied write.
#[derive(Debug, Clone, Default)]
pub struct ConfigView {
    /// Bumped by every entry that changes something (the writes committed in one share it);
    /// 0 means nothing applied yet.
    pub version: u64,
    pub config: Arc<ConfigSet>,
    /// Set when the replicated config has moved past `version` to a version this build
    /// cannot read (it was accepted by a build with other validation rules): `version` and
    /// `config` are then the last version it could read, and this says why it stopped.
    pub unreadable: Option<Arc<str>>,
}
