//! An InferencePool spec as the picker's parameters: the config model's names mapped onto
//! `portcullis-picker`'s, defaults where the spec leaves a field out.

use portcullis_config::InferencePoolSpec;
use portcullis_picker::{PickerConfig, Strategy, Weights};

pub(super) fn picker_config(spec: &InferencePoolSpec) -> PickerConfig {
    let defaults = PickerConfig::default();
    let picker = &spec.picker;
    PickerConfig {
        strategy: match picker.strategy {
            portcullis_config::Strategy::Scored => Strategy::Scored,
            portcullis_config::Strategy::RoundRobin => Strategy::RoundRobin,
            portcullis_config::Strategy::LeastRequest => Strategy::LeastRequest,
        },
        weights: picker.weights.map_or(defaults.weights, |w| Weights {
            queue: w.queue.unwrap_or(defaults.weights.queue),
            kv_cache: w.kv_cache.unwrap_or(defaults.weights.kv_cache),
            prefix: w.prefix.unwrap_or(defaults.weights.prefix),
            lora: w.lora.unwrap_or(defaults.weights.lora),
        }),
        queue_threshold: picker.queue_threshold.unwrap_or(defaults.queue_threshold),
        kv_cache_threshold: picker.kv_cache_threshold.unwrap_or(defaults.kv_cache_threshold),
        staleness: picker.staleness(),
        failure_mode: match spec.failure_mode {
            portcullis_config::FailureMode::FailOpen => portcullis_picker::FailureMode::FailOpen,
            portcullis_config::FailureMode::FailClose => portcullis_picker::FailureMode::FailClose,
        },
        fallbacks: picker.fallbacks.map_or(defaults.fallbacks, |n| n as usize),
        seed: rand::random(),
        ..defaults
    }
}
