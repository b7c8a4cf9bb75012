//! One simulated vLLM replica: a `sim` engine stepped in scaled real time.
//!
//! The engine sits behind a mutex shared by the HTTP handlers (which add requests and read
//! state) and one stepping task. The task runs a step's scheduling half, sleeps for the
//! step's priced duration divided by the time scale, then applies the step and hands each
//! produced token to its request's channel, so clients see tokens exactly when the engine
//! produces them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch, Notify};

use super::metrics::{Histogram, ITL_BUCKETS, TTFT_BUCKETS};
use crate::sim::engine::{Engine, EngineMetrics, Event, Rejected};
use crate::sim::profile::Profile;
use crate::sim::request::{Prompt, Request};
use crate::sim::tokenizer::VOCAB_SIZE;

/// How far behind schedule the stepping task may run and still catch up by shortening the
/// next sleeps. Small lags (timer granularity, a busy CPU) are caught up so that simulated
/// time keeps pace with the profile; a longer stall is forgotten rather than replayed as a
/// burst of instant steps.
const MAX_CATCH_UP: Duration = Duration::from_millis(50);

/// What a pod serves, fixed at start.
#[derive(Debug, Clone)]
pub(super) struct PodSettings {
    pub model: String,
    pub max_model_len: usize,
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub time_scale: f64,
    pub max_loras: usize,
}

/// The model a request named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Target {
    Base,
    Adapter(String),
}

/// Pod state as `/metrics` reports it.
pub(super) struct Snapshot {
    pub engine: EngineMetrics,
    pub running_adapters: BTreeSet<String>,
    pub waiting_adapters: BTreeSet<String>,
    pub ttft: Histogram,
    pub itl: Histogram,
}

pub(super) struct Pod {
    pub settings: PodSettings,
    core: Mutex<Core>,
    /// Wakes the idle stepping task when a request arrives.
    wake: Notify,
}

struct Core {
    engine: Engine,
    next_id: u64,
    /// Unfinished requests by id. Ids grow with submission and the engine is strictly FCFS
    /// (preemption takes the newest running request and puts it at the front of WAITING), so
    /// the engine's RUNNING set is always the first `num_requests_running` entries here; that
    /// is how the LoRA metric learns which adapters are running without engine internals.
    inflight: BTreeMap<u64, Inflight>,
    /// Loaded adapters: name → path.
    adapters: BTreeMap<String, String>,
    ttft: Histogram,
    itl: Histogram,
    clock: SimClock,
}

struct Inflight {
    tokens: mpsc::UnboundedSender<Event>,
    adapter: Option<String>,
    /// Simulated seconds, on the pod's [`SimClock`].
    arrived: f64,
    last_token: Option<f64>,
}

/// The pod's simulated time: the engine's own step durations, added up. TTFT and ITL are
/// measured on it, so `/metrics` reads like a real vLLM's whatever the time scale and however
/// late a loaded machine wakes the stepping task (wall time × scale would magnify both).
#[derive(Default)]
struct SimClock {
    /// Simulated time when the engine last went idle or finished a step.
    settled: f64,
    /// The step in flight: when it started in wall time, and its simulated duration.
    step: Option<(Instant, f64)>,
}

impl SimClock {
    /// Simulated now: inside a step, interpolated from the wall clock but never past its end.
    fn now(&self, scale: f64) -> f64 {
        match self.step {
            Some((started, duration)) => {
                self.settled + (started.elapsed().as_secs_f64() * scale).min(duration)
            }
            None => self.settled,
        }
    }
}

impl Pod {
    pub fn new(settings: PodSettings, profile: Profile, adapters: &[(String, String)]) -> Self {
        Self {
            settings,
            core: Mutex::new(Core {
                engine: Engine::new(profile),
                next_id: 0,
                inflight: BTreeMap::new(),
                adapters: adapters.iter().cloned().collect(),
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                clock: SimClock::default(),
            }),
            wake: Notify::new(),
        }
    }

    /// A panic while holding the lock cannot leave the engine half-stepped in a way that
    /// matters more than losing the whole pod would, so poisoning is ignored.
    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Resolves a request's `model`; `None` for names this pod does not serve.
    pub fn resolve(&self, model: &str) -> Option<Target> {
        if model == self.settings.model {
            return Some(Target::Base);
        }
        self.lock()
            .adapters
            .contains_key(model)
            .then(|| Target::Adapter(model.to_string()))
    }

    /// Queues a request; its tokens arrive on the returned channel as steps produce them.
    pub fn submit(
        &self,
        mut tokens: Vec<u32>,
        max_tokens: usize,
        target: Target,
    ) -> Result<mpsc::UnboundedReceiver<Event>, Rejected> {
        let adapter = match target {
            Target::Base => None,
            Target::Adapter(name) => {
                salt_for_adapter(&mut tokens, &name);
                Some(name)
            }
        };
        let prompt = Arc::new(Prompt::new(tokens, self.settings.block_size));
        let (tx, rx) = mpsc::unbounded_channel();
        let mut core = self.lock();
        let id = core.next_id;
        core.engine.add_request(Request {
            id,
            prompt,
            max_tokens,
        })?;
        core.next_id += 1;
        let arrived = core.clock.now(self.settings.time_scale);
        core.inflight.insert(
            id,
            Inflight {
                tokens: tx,
                adapter,
                arrived,
                last_token: None,
            },
        );
        drop(core);
        self.wake.notify_one();
        Ok(rx)
    }

    /// Loaded adapters as (name, path).
    pub fn adapters(&self) -> Vec<(String, String)> {
        self.lock()
            .adapters
            .iter()
            .map(|(n, p)| (n.clone(), p.clone()))
            .collect()
    }

    /// Loads an adapter; `false` if one with that name is already loaded.
    pub fn load_adapter(&self, name: &str, path: &str) -> bool {
        let mut core = self.lock();
        if core.adapters.contains_key(name) {
            return false;
        }
        core.adapters.insert(name.to_string(), path.to_string());
        true
    }

    /// Unloads an adapter (requests already queued for it still finish, as in vLLM);
    /// `false` if it was not loaded.
    pub fn unload_adapter(&self, name: &str) -> bool {
        self.lock().adapters.remove(name).is_some()
    }

    pub fn snapshot(&self) -> Snapshot {
        let core = self.lock();
        let engine = core.engine.metrics();
        let mut running_adapters = BTreeSet::new();
        let mut waiting_adapters = BTreeSet::new();
        for (i, request) in core.inflight.values().enumerate() {
            if let Some(adapter) = &request.adapter {
                let set = if i < engine.num_requests_running {
                    &mut running_adapters
                } else {
                    &mut waiting_adapters
                };
                set.insert(adapter.clone());
            }
        }
        Snapshot {
            engine,
            running_adapters,
            waiting_adapters,
            ttft: core.ttft.clone(),
            itl: core.itl.clone(),
        }
    }

    /// Steps the engine in scaled real time until `shutdown` fires.
    pub async fn drive(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let scale = self.settings.time_scale;
        // When the step in flight is due to end, in wall time.
        let mut clock = Instant::now();
        loop {
            let plan = self.lock().engine.begin_step();
            let Some(plan) = plan else {
                tokio::select! {
                    () = self.wake.notified() => {}
                    _ = shutdown.changed() => return,
                }
                clock = Instant::now();
                continue;
            };
            let now = Instant::now();
            let start = clock.max(now.checked_sub(MAX_CATCH_UP).unwrap_or(now));
            // Validated profile coefficients and time scale keep this finite and non-negative.
            clock = start + Duration::from_secs_f64(plan.duration / scale);
            self.lock().clock.step = Some((start, plan.duration));
            tokio::select! {
                () = tokio::time::sleep_until(clock.into()) => {}
                _ = shutdown.changed() => return,
            }
            self.lock().finish_step();
        }
    }
}

impl Core {
    /// Applies the step in flight and delivers its tokens, recording TTFT and ITL in
    /// simulated seconds.
    fn finish_step(&mut self) {
        let duration = self.clock.step.take().map_or(0.0, |(_, duration)| duration);
        self.clock.settled += duration;
        let now = self.clock.settled;
        for event in self.engine.end_step() {
            let Some(request) = self.inflight.get_mut(&event.request_id) else {
                continue;
            };
            match request.last_token {
                None => self.ttft.observe((now - request.arrived).max(0.0)),
                Some(last) => self.itl.observe(now - last),
            }
            request.last_token = Some(now);
            // A client that went away no longer listens; the engine has no abort, so the
            // request runs to completion like an un-aborted vLLM request would.
            let _ = request.tokens.send(event);
            if event.finished.is_some() {
                self.inflight.remove(&event.request_id);
            }
        }
    }
}

/// vLLM keys prefix-cache blocks by adapter as well as tokens, so the same text under two
/// adapters never shares KV. The engine hashes tokens only; shifting every token id by an
/// adapter-specific offset gives the same separation while keeping prompt lengths and
/// same-adapter prefixes intact.
fn salt_for_adapter(tokens: &mut [u32], adapter: &str) {
    // Never 0, which would make the adapter share the base model's blocks.
    let offset = 1 + adapter.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    }) % (VOCAB_SIZE - 1);
    for token in tokens {
        *token = ((u64::from(*token) + u64::from(offset)) % u64::from(VOCAB_SIZE)) as u32;
    }
}
