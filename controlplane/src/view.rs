use std::sync::Arc;

use portcullis_config::ConfigSet;

/// One applied config version, as the state machine publishes it. Readers (admin reads,
/// proxy streams) clone the `Arc`, so they never see a half-applied write.
#[derive(Debug, Clone, Default)]
pub struct ConfigView {
    /// Bumped by every command that changes something; 0 means nothing applied yet.
    pub version: u64,
    pub config: Arc<ConfigSet>,
}
