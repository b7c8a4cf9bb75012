//! What the picker knows about one endpoint: its replicated signals and this proxy's own
//! counts.

use std::collections::VecDeque;
use std::time::Duration;

/// One sample of an endpoint's vLLM metrics, as the control plane replicates it.
#[derive(Debug, Clone, PartialEq)]
pub struct Signals {
    /// When the sample was taken, on the caller's clock.
    pub sampled_at: Duration,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc`, 0–1.
    pub kv_cache_usage: f64,
    /// From `vllm:lora_requests_info`, when the server reports it.
    pub lora: Option<LoraSignals>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraSignals {
    pub running: Vec<String>,
    pub waiting: Vec<String>,
    pub max_loras: u32,
}

/// Requests sent since the last signal are remembered at most this many at a time; beyond
/// that the signals are so late that the figures are unknown anyway.
const MAX_RECENT: usize = 4096;

#[derive(Default, Clone)]
pub(crate) struct EndpointState {
    pub signals: Option<Signals>,
    /// Requests this proxy sent that have not finished.
    pub in_flight: u32,
    /// When this proxy sent requests that the latest signal may not show yet.
    recent: VecDeque<Duration>,
}

impl EndpointState {
    /// Signals young enough to trust at `now`.
    pub fn fresh_signals(&self, now: Duration, staleness: Duration) -> Option<&Signals> {
        self.signals
            .as_ref()
            .filter(|s| now.saturating_sub(s.sampled_at) <= staleness)
    }

    /// Waiting requests as of now: the signalled queue plus what this proxy sent after the
    /// sample was taken (the server cannot have reported those yet) and has not seen finish:
    /// a proxy sending faster than the signal interval must not count finished requests as
    /// queued, or a pod serving short requests quickly would look saturated.
    pub fn estimated_waiting(&self, signals: &Signals) -> f64 {
        let unreported = self.recent.len().min(self.in_flight as usize);
        f64::from(signals.waiting) + unreported as f64
    }

    pub fn started(&mut self, now: Duration) {
        self.in_flight += 1;
        if self.recent.len() == MAX_RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back(now);
    }

    /// The last request started here went elsewhere: as if it had never been sent here.
    pub fn moved_away(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.recent.pop_back();
    }

    pub fn finished(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// This state on a clock that reads `offset` more for the same moment.
    pub fn shifted(&self, offset: Duration) -> EndpointState {
        let mut state = self.clone();
        if let Some(signals) = &mut state.signals {
            signals.sampled_at += offset;
        }
        for sent in &mut state.recent {
            *sent += offset;
        }
        state
    }

    /// Takes a new sample; an older one than held (reordered delivery) is ignored.
    pub fn observe(&mut self, signals: Signals) {
        if self
            .signals
            .as_ref()
            .is_some_and(|held| held.sampled_at > signals.sampled_at)
        {
            return;
        }
        while self
            .recent
            .front()
            .is_some_and(|&sent| sent <= signals.sampled_at)
        {
            self.recent.pop_front();
        }
        self.signals = Some(signals);
    }
}
