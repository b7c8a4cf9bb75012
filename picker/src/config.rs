//! The picker's parameters. The proxy builds them from an InferencePool object (whose
//! validation lives in `portcullis-config`); the simulator builds them directly.

use std::time::Duration;

use crate::prefix::PrefixConfig;

#[derive(Debug, Clone, PartialEq)]
pub struct PickerConfig {
    pub strategy: Strategy,
    pub weights: Weights,
    /// Waiting requests (signalled + sent since the signal) at which an endpoint is saturated.
    pub queue_threshold: f64,
    /// KV-cache use (0–1) at which an endpoint is saturated.
    pub kv_cache_threshold: f64,
    /// Signals sampled longer ago than this are unknown.
    pub staleness: Duration,
    pub failure_mode: FailureMode,
    pub prefix: PrefixConfig,
    /// Endpoints returned per pick: the choice and the ones to try if it refuses.
    pub fallbacks: usize,
    /// Seed of the tie-breaking random generator (fixed in the simulator, random in proxies).
    pub seed: u64,
}

impl Default for PickerConfig {
    fn default() -> Self {
        Self {
            strategy: Strategy::Scored,
            weights: Weights::default(),
            queue_threshold: 5.0,
            kv_cache_threshold: 0.8,
            staleness: Duration::from_millis(200),
            failure_mode: FailureMode::FailOpen,
            prefix: PrefixConfig::default(),
            fallbacks: 3,
            seed: 0,
        }
    }
}

/// How an endpoint is chosen. The two plain strategies stay selectable so that a pool can be
/// compared with itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Filters, then the weighted scorers.
    Scored,
    RoundRobin,
    /// Fewest requests this proxy has in flight.
    LeastRequest,
}

/// Weights of the scorers; each scorer gives 0–1, the endpoint's score is the weighted sum.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    /// Fewest waiting requests (min-max over the candidates).
    pub queue: f64,
    /// Lowest KV-cache use.
    pub kv_cache: f64,
    /// Longest cached prefix of the prompt, as a fraction of the prompt's blocks.
    pub prefix: f64,
    /// LoRA adapter already loaded (1), room to load it (0.8), only queued (0.6).
    pub lora: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Self {
            queue: 2.0,
            kv_cache: 2.0,
            prefix: 3.0,
            lora: 1.0,
        }
    }
}

/// What to do when no endpoint has fresh signals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureMode {
    /// Pick on this proxy's own counts (in-flight requests, prefix index).
    FailOpen,
    /// Refuse: the caller answers 503 with the reason.
    FailClose,
}
