//! The endpoint picker: chooses the inference pod for each LLM request, inside the proxy.
//!
//! The Gateway API Inference Extension and llm-d run their endpoint picker as a separate
//! service that every request visits and that scrapes pods itself. Portcullis picks inside
//! each proxy from signals the control plane replicates, plus what only the proxy knows: the
//! requests it sent since the last sample and the prompts it routed where. The same code runs
//! in the virtual-time fleet simulator (`loadtest/src/sim`), so a change to a scorer is
//! measured against round-robin and an exact-state oracle in seconds.
//!
//! A pick: eligibility (model, health) → signals (fresh ones, or this proxy's own counts when
//! none are fresh and the pool fails open) → admission (shed low-priority requests while the
//! pool is saturated) → saturation filter (drop saturated endpoints unless that drops all) →
//! weighted scorers (queue, KV-cache use, prefix affinity, LoRA affinity) → best score, random
//! tie-break, and an ordered fallback list. The chosen endpoint is credited at once (in-flight
//! count, prefix index), so the next pick sees it without waiting for a signal.
//!
//! Scorer formulas follow the Inference Extension's (kubernetes-sigs/gateway-api-inference-extension,
//! `site-src/guides/epp-configuration/config-text.md` and the scorer plugins); the LoRA
//! affinity levels are its `lora-affinity-scorer`'s.
//!
//! Time is whatever the caller counts in (`Duration` since an epoch it chooses): the proxy's
//! monotonic clock, or the simulator's virtual seconds.

mod config;
mod endpoint;
pub mod prefix;

use std::time::Duration;

pub use config::{FailureMode, PickerConfig, Strategy, Weights};
pub use endpoint::{EndpointInfo, LoraSignals, Signals};
pub use prefix::PrefixConfig;

use endpoint::EndpointState;

use prefix::{block_hashes, PrefixIndex};

/// What the picker needs to know about a request.
#[derive(Debug, Clone, Copy)]
pub struct PickRequest<'a> {
    /// The model the request is for, after aliases and rewrites: a base model or, as vLLM
    /// serves them, a LoRA adapter's name.
    pub model: &'a str,
    /// `model` is a LoRA adapter.
    pub lora: bool,
    /// The prompt as bytes (completion prompt, or the chat messages), for prefix affinity.
    pub prompt: &'a [u8],
    pub priority: i32,
}

/// The endpoints to try, in order, and why the first was chosen.
#[derive(Debug, Clone, PartialEq)]
pub struct Pick {
    /// Indexes into the pool's endpoints; the first is the choice, the rest its fallbacks.
    pub endpoints: Vec<usize>,
    pub basis: Basis,
    /// Every candidate was saturated, so the saturation filter kept them all.
    pub saturated: bool,
    /// Leading prompt blocks the chosen endpoint probably has cached, and the prompt's blocks.
    pub prefix_blocks: (u32, u32),
}

/// What a pick was based on; a label for metrics and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Basis {
    /// Fresh signals of at least one endpoint.
    Signals,
    /// No fresh signal: this proxy's in-flight counts and prefix index (FailOpen).
    OwnCounts,
    RoundRobin,
    LeastRequest,
}

impl Basis {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Signals => "signals",
            Self::OwnCounts => "own_counts",
            Self::RoundRobin => "round_robin",
            Self::LeastRequest => "least_request",
        }
    }
}

/// Why no endpoint was picked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No endpoint serves the model.
    NoEndpoint,
    /// FailClose and no endpoint has fresh signals.
    SignalsUnavailable,
    /// The pool is saturated and the request's priority is below the shedding line.
    Saturated { retry_after: Duration },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoEndpoint => f.write_str("no endpoint serves this model"),
            Self::SignalsUnavailable => {
                f.write_str("no endpoint has fresh metrics and the pool is configured to fail closed")
            }
            Self::Saturated { .. } => f.write_str("the pool is saturated; low-priority requests are shed"),
        }
    }
}

pub struct Picker {
    config: PickerConfig,
    endpoints: Vec<EndpointState>,
    prefix: PrefixIndex,
    rng: fastrand::Rng,
    rotation: usize,
    /// Scratch space reused across picks.
    scratch: Scratch,
}

#[derive(Default)]
struct Scratch {
    candidates: Vec<usize>,
    loads: Vec<Load>,
    matched: Vec<u32>,
}

/// A candidate's estimated load at pick time.
struct Load {
    endpoint: usize,
    waiting: f64,
    /// Unknown when the pick runs on own counts.
    kv_cache: Option<f64>,
    saturation: f64,
}

impl Picker {
    pub fn new(config: PickerConfig, endpoints: Vec<EndpointInfo>) -> Self {
        let prefix = PrefixIndex::new(endpoints.len(), &config.prefix);
        let rng = fastrand::Rng::with_seed(config.seed);
        Self {
            scratch: Scratch {
                matched: vec![0; endpoints.len()],
                ..Scratch::default()
            },
            endpoints: endpoints.into_iter().map(EndpointState::new).collect(),
            config,
            prefix,
            rng,
            rotation: 0,
        }
    }

    pub fn config(&self) -> &PickerConfig {
        &self.config
    }

    pub fn len(&self) -> usize {
        self.endpoints.len()
    }

    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }

    /// Takes a new sample of `endpoint`'s signals.
    pub fn observe(&mut self, endpoint: usize, signals: Signals) {
        if let Some(state) = self.endpoints.get_mut(endpoint) {
            state.observe(signals);
        }
    }

    /// Forgets what the prefix index says about `endpoint` (it restarted: its cache is empty).
    pub fn forget_cache(&mut self, endpoint: usize) {
        if endpoint < self.endpoints.len() {
            self.prefix.clear(endpoint);
        }
    }

    /// A request was sent to `endpoint` (a fallback after the pick's first choice refused).
    pub fn started(&mut self, endpoint: usize, now: Duration) {
        if let Some(state) = self.endpoints.get_mut(endpoint) {
            state.started(now);
        }
    }

    /// A request sent to `endpoint` finished (or failed).
    pub fn finished(&mut self, endpoint: usize) {
        if let Some(state) = self.endpoints.get_mut(endpoint) {
            state.finished();
        }
    }

    /// Requests this proxy has in flight at `endpoint`.
    pub fn in_flight(&self, endpoint: usize) -> u32 {
        self.endpoints.get(endpoint).map_or(0, |e| e.in_flight)
    }

    /// Chooses the endpoints for `request` and credits the first with it. `healthy` says
    /// which endpoints the proxy currently sends to (passive ejection); if none is healthy all
    /// are candidates, since trying a suspect endpoint beats refusing outright.
    pub fn pick(
        &mut self,
        now: Duration,
        request: &PickRequest<'_>,
        healthy: impl Fn(usize) -> bool,
    ) -> Result<Pick, Refusal> {
        let mut candidates = std::mem::take(&mut self.scratch.candidates);
        candidates.clear();
        candidates.extend((0..self.endpoints.len()).filter(|&e| self.endpoints[e].serves(request.model)));
        if candidates.iter().any(|&e| healthy(e)) {
            candidates.retain(|&e| healthy(e));
        }
        let result = if candidates.is_empty() {
            Err(Refusal::NoEndpoint)
        } else {
            match self.config.strategy {
                Strategy::RoundRobin => Ok(self.round_robin(&candidates)),
                Strategy::LeastRequest => Ok(self.least_request(&candidates)),
                Strategy::Scored => self.scored(now, request, &candidates),
            }
        };
        self.scratch.candidates = candidates;
        let pick = result?;
        self.endpoints[pick.endpoints[0]].started(now);
        Ok(pick)
    }

    fn round_robin(&mut self, candidates: &[usize]) -> Pick {
        let n = candidates.len();
        let start = self.rotation % n;
        self.rotation = self.rotation.wrapping_add(1);
        Pick {
            endpoints: (0..n.min(self.config.fallbacks.max(1)))
                .map(|k| candidates[(start + k) % n])
                .collect(),
            basis: Basis::RoundRobin,
            saturated: false,
            prefix_blocks: (0, 0),
        }
    }

    fn least_request(&mut self, candidates: &[usize]) -> Pick {
        let endpoints = &self.endpoints;
        let endpoints = rank(
            &mut self.rng,
            self.config.fallbacks,
            candidates
                .iter()
                .map(|&e| (-f64::from(endpoints[e].in_flight), e)),
        );
        Pick {
            endpoints,
            basis: Basis::LeastRequest,
            saturated: false,
            prefix_blocks: (0, 0),
        }
    }

    fn scored(
        &mut self,
        now: Duration,
        request: &PickRequest<'_>,
        candidates: &[usize],
    ) -> Result<Pick, Refusal> {
        let config = &self.config;
        let staleness = config.staleness;
        let endpoints = &self.endpoints;
        // Per candidate, once: estimated waiting requests, KV-cache use and saturation (the
        // larger of the two as a fraction of its threshold; the Inference Extension's
        // utilization detector).
        let per_waiting = 1.0 / config.queue_threshold;
        let per_kv_cache = 1.0 / config.kv_cache_threshold;
        let loads = &mut self.scratch.loads;
        loads.clear();
        loads.extend(candidates.iter().filter_map(|&e| {
            let state = &endpoints[e];
            state.fresh_signals(now, staleness).map(|s| {
                let waiting = state.estimated_waiting(s);
                Load {
                    endpoint: e,
                    waiting,
                    kv_cache: Some(s.kv_cache_usage),
                    saturation: (waiting * per_waiting).max(s.kv_cache_usage * per_kv_cache),
                }
            })
        }));
        let basis = if !loads.is_empty() {
            Basis::Signals
        } else if config.failure_mode == FailureMode::FailClose {
            return Err(Refusal::SignalsUnavailable);
        } else {
            loads.extend(candidates.iter().map(|&e| Load {
                endpoint: e,
                waiting: f64::from(endpoints[e].in_flight),
                kv_cache: None,
                // Unknown: a pool running on own counts never sheds or filters.
                saturation: 0.0,
            }));
            Basis::OwnCounts
        };
        if request.priority < config.shed_below_priority {
            let mean = loads.iter().map(|load| load.saturation).sum::<f64>() / loads.len() as f64;
            if mean >= 1.0 {
                return Err(Refusal::Saturated {
                    retry_after: config.shed_retry_after,
                });
            }
        }
        let saturated = loads.iter().all(|load| load.saturation >= 1.0);
        if !saturated {
            loads.retain(|load| load.saturation < 1.0);
        }

        let hashes = block_hashes(request.model, request.prompt, &config.prefix);
        self.prefix.match_lengths(&hashes, &mut self.scratch.matched);
        let matched = &self.scratch.matched;
        let (min_wait, max_wait) = loads.iter().fold((f64::INFINITY, 0.0f64), |(lo, hi), load| {
            (lo.min(load.waiting), hi.max(load.waiting))
        });
        let per_wait_range = if max_wait > min_wait {
            1.0 / (max_wait - min_wait)
        } else {
            0.0
        };
        let per_block = 1.0 / hashes.len().max(1) as f64;
        let weights = config.weights;
        let score = |load: &Load| {
            let queue = if per_wait_range > 0.0 {
                (max_wait - load.waiting) * per_wait_range
            } else {
                1.0
            };
            let kv_cache = load.kv_cache.map_or(0.0, |kv| 1.0 - kv.clamp(0.0, 1.0));
            let prefix = f64::from(matched[load.endpoint]) * per_block;
            let lora = if request.lora {
                lora_affinity(endpoints[load.endpoint].signals.as_ref(), request.model)
            } else {
                0.0
            };
            weights.queue * queue
                + weights.kv_cache * kv_cache
                + weights.prefix * prefix
                + weights.lora * lora
        };
        let ranked = rank(
            &mut self.rng,
            config.fallbacks,
            loads.iter().map(|load| (score(load), load.endpoint)),
        );
        let chosen = ranked[0];
        let prefix_blocks = (self.scratch.matched[chosen], hashes.len() as u32);
        self.prefix.insert(chosen, &hashes);
        Ok(Pick {
            endpoints: ranked,
            basis,
            saturated,
            prefix_blocks,
        })
    }
}

/// The best `keep` of the (score, endpoint) pairs, highest score first, ties broken at random.
/// One pass with a short sorted list: `keep` is a handful, candidates can be hundreds.
fn rank(rng: &mut fastrand::Rng, keep: usize, scored: impl Iterator<Item = (f64, usize)>) -> Vec<usize> {
    let keep = keep.max(1);
    let mut best: Vec<(f64, u32, usize)> = Vec::with_capacity(keep + 1);
    for (score, endpoint) in scored {
        if best.len() == keep && score < best[keep - 1].0 {
            continue;
        }
        let entry = (score, rng.u32(..), endpoint);
        let at = best.partition_point(|held| held.0 > entry.0 || (held.0 == entry.0 && held.1 <= entry.1));
        if at < keep {
            best.insert(at, entry);
            best.truncate(keep);
        }
    }
    best.into_iter().map(|(_, _, endpoint)| endpoint).collect()
}

/// The Inference Extension's LoRA affinity levels.
fn lora_affinity(signals: Option<&Signals>, adapter: &str) -> f64 {
    let Some(lora) = signals.and_then(|s| s.lora.as_ref()) else {
        return 0.0;
    };
    let has = |list: &[String]| list.iter().any(|a| a == adapter);
    if has(&lora.running) {
        1.0
    } else if (lora.running.len() + lora.waiting.len()) < lora.max_loras as usize {
        0.8
    } else if has(&lora.waiting) {
        0.6
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests;
