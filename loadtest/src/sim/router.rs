//! Routing policies compared by the simulator.
//!
//! * [`RoundRobin`]: what a Kubernetes Service does (the llm-d report's baseline);
//! * [`LeastQueue`]: fewest waiting + running requests, a typical load-aware balancer;
//! * [`Oracle`]: reads every replica's exact state and minimises the request's expected
//!   time to first token. It is the upper bound a practical router (which sees stale metrics
//!   and approximate prefix indexes) can aim for;
//! * [`PickerRouter`]: Portcullis' endpoint picker (`portcullis-picker`, the code every proxy
//!   runs), fed the way a proxy is: sampled metrics, delivered late, plus its own counts.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use portcullis_picker::{block_hashes, PickRequest, Picker, PickerConfig, PrefixConfig, Signals};
use serde::{Deserialize, Serialize};

use super::engine::{Engine, EngineMetrics};
use super::request::Request;

/// What a router may look at for one replica.
pub struct PodView<'a> {
    pub index: usize,
    pub engine: &'a Engine,
}

pub trait Router {
    /// Index into `pods` (never empty) of the replica that gets `request` at `now`, or why
    /// the request is refused.
    fn pick(&mut self, now: f64, request: &Request, pods: &[PodView<'_>]) -> Result<usize, String>;

    /// Every replica's metrics as sampled at `sampled_at`, delivered now (later: the
    /// sampling interval and replication delay of [`super::fleet::SignalSpec`]).
    fn observe(&mut self, _sampled_at: f64, _metrics: &[EngineMetrics]) {}

    /// A request finished (or was refused by its replica).
    fn finished(&mut self, _request_id: u64) {}
}

/// Routers selectable from a config file or the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterKind {
    RoundRobin,
    LeastQueue,
    Oracle,
    Picker,
}

impl RouterKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::RoundRobin => "round_robin",
            Self::LeastQueue => "least_queue",
            Self::Oracle => "oracle",
            Self::Picker => "picker",
        }
    }

    /// `proxies`: how many proxies the picker runs in (the other routers are one process).
    pub fn build(self, pods: usize, proxies: usize) -> Box<dyn Router + Send> {
        match self {
            Self::RoundRobin => Box::<RoundRobin>::default(),
            Self::LeastQueue => Box::<LeastQueue>::default(),
            Self::Oracle => Box::new(Oracle),
            Self::Picker => Box::new(PickerRouter::new(pods, proxies)),
        }
    }
}

#[derive(Default)]
pub struct RoundRobin {
    next: usize,
}

impl Router for RoundRobin {
    fn pick(&mut self, _: f64, _: &Request, pods: &[PodView<'_>]) -> Result<usize, String> {
        let pick = self.next % pods.len();
        self.next = pick + 1;
        Ok(pick)
    }
}

/// Fewest waiting + running; ties go round-robin so that an idle fleet is not piled onto the
/// first replica.
#[derive(Default)]
pub struct LeastQueue {
    rotation: usize,
}

impl Router for LeastQueue {
    fn pick(&mut self, _: f64, _: &Request, pods: &[PodView<'_>]) -> Result<usize, String> {
        let n = pods.len();
        self.rotation = (self.rotation + 1) % n;
        let load = |i: usize| {
            let m = pods[i].engine.metrics();
            m.num_requests_waiting + m.num_requests_running
        };
        (0..n)
            .map(|k| (self.rotation + k) % n)
            .min_by_key(|&i| load(i))
            .ok_or_else(|| "no replicas".to_string())
    }
}

/// Picks the replica with the lowest estimated cost of serving the request there, in seconds
/// of prefill compute:
///
/// `cost = c_prefill × (queued prefill tokens + 2 × uncached tokens
///                      + block_size × KV blocks over capacity)`
///
/// * Queued prefill tokens (net of their own expected hits) are the work ahead of the
///   request; its uncached tokens count once for its own time to first token and once more
///   for the compute it takes from everyone queued behind it. A cached prefix (including
///   prefixes of queued requests, which will be cached by the time this one runs) is thus
///   worth twice the prefill it saves, and is abandoned only when the replica's queue is
///   longer than that.
/// * KV over-commitment: if the replica's admitted and queued work will need more blocks than
///   it has, the request waits for blocks or causes preemptions whose recomputation costs
///   about one prefill token per token over capacity.
///
/// Ties (an idle fleet, a brand-new prefix) go to the replica with the lowest KV demand, then
/// the lowest index, which spreads new prefixes evenly.
pub struct Oracle;

impl Router for Oracle {
    fn pick(&mut self, _: f64, request: &Request, pods: &[PodView<'_>]) -> Result<usize, String> {
        let mut best = (f64::INFINITY, usize::MAX, 0);
        for (i, pod) in pods.iter().enumerate() {
            let engine = pod.engine;
            let profile = engine.profile();
            let bs = profile.block_size;
            let hit = engine.prefix_hit_tokens(&request.prompt);
            let uncached = request.prompt.len() - hit;
            let need = (request.prompt.len() + request.max_tokens).div_ceil(bs) - hit / bs;
            let demand = engine.kv_demand_blocks() + need;
            let over = demand.saturating_sub(profile.num_gpu_blocks);
            let per_token = profile.step.c_prefill_s_per_token;
            let cost = per_token * (engine.remaining_prefill_tokens() + 2 * uncached + over * bs) as f64;
            if (cost, demand) < (best.0, best.1) {
                best = (cost, demand, i);
            }
        }
        Ok(best.2)
    }
}

/// The proxy's picker with its default configuration. It never looks at an engine: it sees
/// what a proxy sees, the prompt and the signals.
///
/// With several proxies, each has its own picker (its own prefix index and in-flight
/// counts), requests reach them in turn as a layer-4 load balancer would spread them, and
/// every sample of signals reaches all of them. Each proxy's placements reach the others
/// with the first round of signals sampled after them, i.e. as late as signals arrive: a
/// pessimistic model, since the control plane relays each batch of placements as it comes.
pub struct PickerRouter {
    proxies: Vec<Picker>,
    next_proxy: usize,
    prefix: PrefixConfig,
    prompt: Vec<u8>,
    /// Request id → (proxy, pod), to report where a finished request ran.
    in_flight: HashMap<u64, (usize, usize)>,
    /// Placements on their way to the other proxies, oldest first.
    relayed: VecDeque<Placement>,
}

struct Placement {
    at: f64,
    proxy: usize,
    pod: usize,
    prompt_hashes: Vec<u64>,
}

impl PickerRouter {
    /// The model name seeds the prefix hashes; any fixed name does.
    const MODEL: &'static str = "simulated";

    pub fn new(pods: usize, proxies: usize) -> Self {
        let config = PickerConfig {
            seed: 1,
            ..PickerConfig::default()
        };
        Self {
            prefix: config.prefix,
            proxies: (0..proxies.max(1) as u64)
                .map(|proxy| {
                    let config = PickerConfig {
                        seed: 1 + proxy,
                        ..config.clone()
                    };
                    Picker::new(config, pods)
                })
                .collect(),
            next_proxy: 0,
            prompt: Vec::new(),
            in_flight: HashMap::new(),
            relayed: VecDeque::new(),
        }
    }
}

impl Router for PickerRouter {
    fn pick(&mut self, now: f64, request: &Request, pods: &[PodView<'_>]) -> Result<usize, String> {
        // The proxy hashes the prompt's text; the simulator's prompts are token ids, four
        // bytes each, so a 256-byte picker block is 64 tokens (about 256 characters of text).
        self.prompt.clear();
        self.prompt
            .extend(request.prompt.tokens().iter().flat_map(|t| t.to_le_bytes()));
        let hashes = block_hashes(Self::MODEL, &self.prompt, &self.prefix);
        let proxy = self.next_proxy;
        self.next_proxy = (self.next_proxy + 1) % self.proxies.len();
        let pick = self.proxies[proxy].pick(
            Duration::from_secs_f64(now),
            &PickRequest {
                model: Self::MODEL,
                lora: false,
                prompt_hashes: &hashes,
            },
            |_| true,
        );
        let pick = pick.map_err(|refusal| format!("picker refused: {refusal}"))?;
        let pod = pick.endpoints[0].min(pods.len() - 1);
        if self.proxies.len() > 1 && pick.placed_new_blocks(&hashes) {
            self.relayed.push_back(Placement {
                at: now,
                proxy,
                pod,
                prompt_hashes: hashes,
            });
        }
        self.in_flight.insert(request.id, (proxy, pod));
        Ok(pod)
    }

    fn observe(&mut self, sampled_at: f64, metrics: &[EngineMetrics]) {
        while let Some(placement) = self.relayed.front().filter(|p| p.at <= sampled_at) {
            for (proxy, picker) in self.proxies.iter_mut().enumerate() {
                if proxy != placement.proxy {
                    picker.learn(placement.pod, &placement.prompt_hashes);
                }
            }
            self.relayed.pop_front();
        }
        for picker in &mut self.proxies {
            for (pod, m) in metrics.iter().enumerate() {
                picker.observe(
                    pod,
                    Signals {
                        sampled_at: Duration::from_secs_f64(sampled_at),
                        waiting: m.num_requests_waiting as u32,
                        kv_cache_usage: m.kv_cache_usage,
                        lora: None,
                    },
                );
            }
        }
    }

    fn finished(&mut self, request_id: u64) {
        if let Some((proxy, pod)) = self.in_flight.remove(&request_id) {
            self.proxies[proxy].finished(pod);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::sim::profile::Profile;
    use crate::sim::request::Prompt;

    fn fleet(n: usize) -> Vec<Engine> {
        (0..n)
            .map(|_| Engine::new(Profile::qwen3_32b_tp2_h100().unwrap()))
            .collect()
    }

    fn views(engines: &[Engine]) -> Vec<PodView<'_>> {
        engines
            .iter()
            .enumerate()
            .map(|(index, engine)| PodView { index, engine })
            .collect()
    }

    fn request(id: u64, tokens: std::ops::Range<u32>) -> Request {
        Request {
            id,
            prompt: Arc::new(Prompt::new(tokens.collect(), 16)),
            max_tokens: 10,
        }
    }

    #[test]
    fn round_robin_cycles_and_least_queue_avoids_busy_pods() {
        let mut engines = fleet(3);
        let mut rr = RoundRobin::default();
        let picks: Vec<usize> = (0..4)
            .map(|i| rr.pick(0.0, &request(i, 0..10), &views(&engines)).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0]);
        engines[0].add_request(request(1, 0..10)).unwrap();
        engines[1].add_request(request(2, 0..10)).unwrap();
        let mut lq = LeastQueue::default();
        assert!((0..5).all(|i| lq.pick(0.0, &request(i, 0..10), &views(&engines)) == Ok(2)));
    }

    #[test]
    fn oracle_follows_the_prefix_until_the_queue_costs_more() {
        let mut engines = fleet(2);
        engines[1].add_request(request(1, 0..5000)).unwrap();
        // Same 5000-token prefix: pod 1 will have it cached, its queue costs less than
        // recomputing the prefix on pod 0.
        assert_eq!(Oracle.pick(0.0, &request(2, 0..5100), &views(&engines)), Ok(1));
        // Unrelated prompt: pod 0 is idle.
        assert_eq!(
            Oracle.pick(0.0, &request(3, 90_000..95_000), &views(&engines)),
            Ok(0)
        );
        // Pile a long queue of other work on pod 1: the prefix is no longer worth the wait.
        for i in 0..5 {
            engines[1]
                .add_request(request(
                    10 + i,
                    (100_000 * (i as u32 + 1))..(100_000 * (i as u32 + 1) + 4000),
                ))
                .unwrap();
        }
        assert_eq!(Oracle.pick(0.0, &request(4, 0..5100), &views(&engines)), Ok(0));
    }
}
