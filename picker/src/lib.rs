//! The endpoint picker: chooses the inference pod for each LLM request, inside the proxy.
//!
//! The Gateway API Inference Extension and llm-d run their endpoint picker as a separate
//! service that every request visits and that scrapes pods itself. Portcullis picks inside
//! each proxy from signals the control plane replicates, plus what only the proxy knows: the
//! requests it sent since the last sample and the prompts it routed where. The same code runs
//! in the virtual-time fleet simulator (`loadtest/src/sim`), so a change to a scorer is
//! measured against round-robin and an exact-state oracle in seconds.
//!
//! A pick: eligibility (health) → signals (each endpoint's fresh sample, or this proxy's own
//! counts for an endpoint without one; when no endpoint has one, a pool that fails closed
//! refuses) → saturation filter (saturated endpoints rank after the others, as fallbacks,
//! and endpoints without fresh signals after every one that has them) → weighted scorers
//! (queue, KV-cache use, prefix affinity, LoRA affinity) → best score, random tie-break, and
//! an ordered fallback list. The chosen endpoint is credited at once (in-flight
//! count, prefix index), so the next pick sees it without waiting for a signal.
//! Proxies share where they sent which prompts ([`Picker::learn`], relayed by the control
//! plane): each proxy's prefix index then holds every proxy's placements, and independent
//! proxies keep a prompt family on the same endpoints.
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
pub use endpoint::{LoraSignals, Signals};
pub use prefix::{block_hashes, PrefixConfig};

use endpoint::EndpointState;
use prefix::PrefixIndex;

/// What the picker needs to know about a request.
#[derive(Debug, Clone, Copy)]
pub struct PickRequest<'a> {
    /// The model the request is for, after aliases and rewrites: a base model or, as vLLM
    /// serves them, a LoRA adapter's name.
    pub model: &'a str,
    /// `model` is a LoRA adapter.
    pub lora: bool,
    /// [`block_hashes`] of the prompt (computed by the caller, outside any lock it holds
    /// around the picker).
    pub prompt_hashes: &'a [u64],
}

/// The endpoints to try, in order, and why the first was chosen.
#[derive(Debug, Clone, PartialEq)]
pub struct Pick {
    /// Indexes into the pool's endpoints; the first is the choice, the rest its fallbacks.
    pub endpoints: Vec<usize>,
    pub basis: Basis,
    /// Every candidate was saturated, so the choice is a saturated endpoint too.
    pub saturated: bool,
    /// Leading prompt blocks the chosen endpoint probably has cached.
    pub prefix_hit_blocks: u32,
}

impl Pick {
    /// Whether the chosen endpoint got blocks of the prompt it was not known to hold: only
    /// such placements are worth telling other proxies about ([`Picker::learn`]).
    pub fn placed_new_blocks(&self, prompt_hashes: &[u64]) -> bool {
        (self.prefix_hit_blocks as usize) < prompt_hashes.len()
    }
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
    /// The pool has no endpoints.
    NoEndpoint,
    /// FailClose and no endpoint has fresh signals.
    SignalsUnavailable,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoEndpoint => f.write_str("the pool has no endpoints"),
            Self::SignalsUnavailable => {
                f.write_str("no endpoint has fresh metrics and the pool is configured to fail closed")
            }
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
    /// Unknown when the endpoint has no fresh signals.
    kv_cache: Option<f64>,
    saturation: f64,
}

impl Picker {
    /// A picker over `endpoints` endpoints, known by their index from here on.
    pub fn new(mut config: PickerConfig, endpoints: usize) -> Self {
        // Thresholds divide; a zero or non-finite one would make every saturation NaN.
        let sane = |threshold: f64, default: f64| {
            if threshold.is_finite() && threshold > 0.0 {
                threshold
            } else {
                default
            }
        };
        let defaults = PickerConfig::default();
        config.queue_threshold = sane(config.queue_threshold, defaults.queue_threshold);
        config.kv_cache_threshold = sane(config.kv_cache_threshold, defaults.kv_cache_threshold);
        Self {
            scratch: Scratch {
                matched: vec![0; endpoints],
                ..Scratch::default()
            },
            endpoints: (0..endpoints).map(|_| EndpointState::default()).collect(),
            prefix: PrefixIndex::new(endpoints, &config.prefix),
            rng: fastrand::Rng::with_seed(config.seed),
            rotation: 0,
            config,
        }
    }

    /// Takes over what `previous` (the picker of the pool's version before) knows about the
    /// endpoints both have: their signals, in-flight counts and prefix-index entries, so that
    /// an edit keeping pods keeps what is known about them. `endpoints[e]` is this picker's
    /// endpoint `e` in `previous`, if it was there; `offset` is what this picker's clock
    /// reads more than `previous`'s at the same moment. Prefix entries stay behind when the
    /// pickers cut prompts into different blocks: their hashes would never match.
    pub fn inherit(&mut self, previous: &Picker, endpoints: &[Option<usize>], offset: Duration) {
        for (state, from) in self.endpoints.iter_mut().zip(endpoints) {
            if let Some(held) = from.and_then(|from| previous.endpoints.get(from)) {
                *state = held.shifted(offset);
            }
        }
        if self.config.prefix.block_bytes == previous.config.prefix.block_bytes {
            self.prefix.inherit(&previous.prefix, endpoints);
        }
    }

    /// Takes a new sample of `endpoint`'s signals. A sample with a non-finite KV-cache use is
    /// dropped: it says nothing.
    pub fn observe(&mut self, endpoint: usize, mut signals: Signals) {
        if !signals.kv_cache_usage.is_finite() {
            return;
        }
        signals.kv_cache_usage = signals.kv_cache_usage.clamp(0.0, 1.0);
        if let Some(state) = self.endpoints.get_mut(endpoint) {
            state.observe(signals);
        }
    }

    /// A request sent to `endpoint` finished (or failed, or was abandoned).
    pub fn finished(&mut self, endpoint: usize) {
        if let Some(state) = self.endpoints.get_mut(endpoint) {
            state.finished();
        }
    }

    /// A request this picker did not pick runs at `endpoint` from `now` on: counted in flight
    /// there (one a pool's earlier version picked, that moved to an endpoint this one kept).
    pub fn counted(&mut self, endpoint: usize, now: Duration) {
        if let Some(state) = self.endpoints.get_mut(endpoint) {
            state.started(now);
        }
    }

    /// The request picked for `from` went to `to` instead (`from` refused the connection):
    /// moves its in-flight count and its prefix credit.
    pub fn moved(&mut self, from: usize, to: usize, now: Duration, prompt_hashes: &[u64]) {
        if from == to || from >= self.endpoints.len() || to >= self.endpoints.len() {
            return;
        }
        self.endpoints[from].moved_away();
        self.endpoints[to].started(now);
        self.prefix.remove(from, prompt_hashes);
        self.prefix.insert(to, prompt_hashes);
    }

    /// Another proxy sent a prompt with these [`block_hashes`] to `endpoint`: the prefix
    /// index holds them as if this proxy had. No in-flight count moves; that proxy's requests
    /// show in the endpoint's signals.
    pub fn learn(&mut self, endpoint: usize, prompt_hashes: &[u64]) {
        if endpoint < self.endpoints.len() {
            self.prefix.insert(endpoint, prompt_hashes);
        }
    }

    /// Another proxy's placement of a prompt with these hashes on `endpoint` did not happen
    /// (the endpoint refused it): the prefix index forgets the prompt's family there.
    pub fn forget(&mut self, endpoint: usize, prompt_hashes: &[u64]) {
        if endpoint < self.endpoints.len() {
            self.prefix.remove(endpoint, prompt_hashes);
        }
    }

    /// The latest signals of `endpoint`, fresh or not.
    pub fn signals(&self, endpoint: usize) -> Option<&Signals> {
        self.endpoints.get(endpoint)?.signals.as_ref()
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
        let candidates = self.candidates(healthy);
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
        let chosen = *pick.endpoints.first().ok_or(Refusal::NoEndpoint)?;
        self.endpoints[chosen].started(now);
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
            prefix_hit_blocks: 0,
        }
    }

    fn least_request(&mut self, candidates: &[usize]) -> Pick {
        let endpoints = &self.endpoints;
        let endpoints = rank(
            &mut self.rng,
            self.config.fallbacks,
            candidates
                .iter()
                .map(|&e| (0, -f64::from(endpoints[e].in_flight), e)),
        );
        Pick {
            endpoints,
            basis: Basis::LeastRequest,
            saturated: false,
            prefix_hit_blocks: 0,
        }
    }

    /// The healthy endpoints, or all if none is healthy (the scratch list; hand it back).
    fn candidates(&mut self, healthy: impl Fn(usize) -> bool) -> Vec<usize> {
        let mut candidates = std::mem::take(&mut self.scratch.candidates);
        candidates.clear();
        candidates.extend((0..self.endpoints.len()).filter(|&e| healthy(e)));
        if candidates.is_empty() {
            candidates.extend(0..self.endpoints.len());
        }
        candidates
    }

    /// Whether every candidate is saturated now, judged as a pick would judge it, without
    /// crediting anyone: an admission queue asks this before letting a request through. Only
    /// the Scored strategy detects saturation.
    pub fn saturated(&mut self, now: Duration, healthy: impl Fn(usize) -> bool) -> bool {
        if self.config.strategy != Strategy::Scored {
            return false;
        }
        let candidates = self.candidates(healthy);
        let saturated = matches!(self.assess(now, &candidates), Ok((_, true)));
        self.scratch.candidates = candidates;
        saturated
    }

    /// Fills `scratch.loads` with the candidates' loads; the basis of the pick and whether
    /// every candidate is saturated.
    fn assess(&mut self, now: Duration, candidates: &[usize]) -> Result<(Basis, bool), Refusal> {
        let config = &self.config;
        let staleness = config.staleness;
        let endpoints = &self.endpoints;
        // Per candidate, once: estimated waiting requests, KV-cache use and saturation (the
        // larger of the two as a fraction of its threshold; the Inference Extension's
        // utilization detector). An endpoint without fresh signals is judged on this
        // proxy's own counts: its in-flight requests, KV-cache use unknown; while other
        // endpoints have fresh signals it counts as saturated (as in the Inference Extension:
        // a late scrape is often an overloaded pod) and ranks after all of them (`scored`).
        let per_waiting = 1.0 / config.queue_threshold;
        let per_kv_cache = 1.0 / config.kv_cache_threshold;
        let loads = &mut self.scratch.loads;
        loads.clear();
        let mut fresh = 0;
        loads.extend(candidates.iter().map(|&e| {
            let state = &endpoints[e];
            match state.fresh_signals(now, staleness) {
                Some(s) => {
                    fresh += 1;
                    let waiting = state.estimated_waiting(s);
                    Load {
                        endpoint: e,
                        waiting,
                        kv_cache: Some(s.kv_cache_usage),
                        saturation: (waiting * per_waiting).max(s.kv_cache_usage * per_kv_cache),
                    }
                }
                None => Load {
                    endpoint: e,
                    waiting: f64::from(state.in_flight),
                    kv_cache: None,
                    saturation: 0.0,
                },
            }
        }));
        let basis = if fresh > 0 {
            for load in loads.iter_mut().filter(|load| load.kv_cache.is_none()) {
                load.saturation = 1.0;
            }
            Basis::Signals
        } else if config.failure_mode == FailureMode::FailClose {
            return Err(Refusal::SignalsUnavailable);
        } else {
            Basis::OwnCounts
        };
        let saturated = loads.iter().all(|load| load.saturation >= 1.0);
        Ok((basis, saturated))
    }

    fn scored(
        &mut self,
        now: Duration,
        request: &PickRequest<'_>,
        candidates: &[usize],
    ) -> Result<Pick, Refusal> {
        let (basis, saturated) = self.assess(now, candidates)?;
        let loads = &self.scratch.loads;
        // Lower tiers rank first, whatever the scores. Saturated endpoints still fill the
        // fallback slots the others leave, since a busy pod beats no pod when the choice
        // refuses. An endpoint without fresh signals comes after every one with them: its
        // queue is only this proxy's share, which would beat the whole queue others report.
        let tier = |load: &Load| -> u8 {
            if basis == Basis::Signals && load.kv_cache.is_none() {
                2
            } else if load.saturation < 1.0 {
                0
            } else {
                1
            }
        };
        let first_tier = loads.iter().map(tier).min().unwrap_or(0);
        let config = &self.config;
        let endpoints = &self.endpoints;

        self.prefix
            .match_lengths(request.prompt_hashes, &mut self.scratch.matched);
        let matched = &self.scratch.matched;
        // Over the endpoints competing for the choice only: the others' queues, known or
        // not, must not stretch the range the choice is made on.
        let (min_wait, max_wait) = loads
            .iter()
            .filter(|load| tier(load) == first_tier)
            .fold((f64::INFINITY, 0.0f64), |(lo, hi), load| {
                (lo.min(load.waiting), hi.max(load.waiting))
            });
        let per_wait_range = if max_wait > min_wait {
            1.0 / (max_wait - min_wait)
        } else {
            0.0
        };
        let per_block = 1.0 / request.prompt_hashes.len().max(1) as f64;
        let weights = config.weights;
        let score = |load: &Load| {
            let queue = if per_wait_range > 0.0 {
                (max_wait - load.waiting) * per_wait_range
            } else {
                1.0
            };
            let kv_cache = load.kv_cache.map_or(0.0, |kv| 1.0 - kv);
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
            loads.iter().map(|load| (tier(load), score(load), load.endpoint)),
        );
        let chosen = *ranked.first().ok_or(Refusal::NoEndpoint)?;
        let prefix_hit_blocks = self.scratch.matched[chosen];
        self.prefix.insert(chosen, request.prompt_hashes);
        Ok(Pick {
            endpoints: ranked,
            basis,
            saturated,
            prefix_hit_blocks,
        })
    }
}

/// The best `keep` of the (tier, score, endpoint) triples: lowest tier first, then highest
/// score, ties broken at random. One pass with a short sorted list: `keep` is a handful,
/// candidates can be hundreds. Scores are ordered with `total_cmp`, so even a NaN cannot
/// break the order.
fn rank(rng: &mut fastrand::Rng, keep: usize, scored: impl Iterator<Item = (u8, f64, usize)>) -> Vec<usize> {
    let keep = keep.max(1);
    let mut best: Vec<(u8, f64, u32, usize)> = Vec::with_capacity(keep + 1);
    let before = |a: &(u8, f64, u32, usize), b: &(u8, f64, u32, usize)| {
        a.0.cmp(&b.0)
            .then(b.1.total_cmp(&a.1))
            .then(a.2.cmp(&b.2))
            .is_le()
    };
    for (tier, score, endpoint) in scored {
        let entry = (tier, score, rng.u32(..), endpoint);
        if best.len() == keep && before(&best[keep - 1], &entry) {
            continue;
        }
        let at = best.partition_point(|held| before(held, &entry));
        best.insert(at, entry);
        best.truncate(keep);
    }
    best.into_iter().map(|(_, _, _, endpoint)| endpoint).collect()
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
