//! Routing policies compared by the simulator.
//!
//! * [`RoundRobin`]: what a Kubernetes Service does (the llm-d report's baseline);
//! * [`LeastQueue`]: fewest waiting + running requests, a typical load-aware balancer;
//! * [`Oracle`]: reads every replica's exact state and minimises the request's expected
//!   time to first token. It is the upper bound a practical router (which sees stale metrics
//!   and approximate prefix indexes) can aim for.

use serde::{Deserialize, Serialize};

use super::engine::Engine;
use super::request::Request;

/// What a router may look at for one replica.
pub struct PodView<'a> {
    pub index: usize,
    pub engine: &'a Engine,
}

pub trait Router {
    /// Index into `pods` (never empty) of the replica that gets `request`.
    fn pick(&mut self, request: &Request, pods: &[PodView<'_>]) -> usize;
}

/// Routers selectable from a config file or the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterKind {
    RoundRobin,
    LeastQueue,
    Oracle,
}

impl RouterKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::RoundRobin => "round_robin",
            Self::LeastQueue => "least_queue",
            Self::Oracle => "oracle",
        }
    }

    pub fn build(self) -> Box<dyn Router + Send> {
        match self {
            Self::RoundRobin => Box::<RoundRobin>::default(),
            Self::LeastQueue => Box::<LeastQueue>::default(),
            Self::Oracle => Box::new(Oracle),
        }
    }
}

#[derive(Default)]
pub struct RoundRobin {
    next: usize,
}

impl Router for RoundRobin {
    fn pick(&mut self, _: &Request, pods: &[PodView<'_>]) -> usize {
        let pick = self.next % pods.len();
        self.next = pick + 1;
        pick
    }
}

/// Fewest waiting + running; ties go round-robin so that an idle fleet is not piled onto the
/// first replica.
#[derive(Default)]
pub struct LeastQueue {
    rotation: usize,
}

impl Router for LeastQueue {
    fn pick(&mut self, _: &Request, pods: &[PodView<'_>]) -> usize {
        let n = pods.len();
        self.rotation = (self.rotation + 1) % n;
        let load = |i: usize| {
            let m = pods[i].engine.metrics();
            m.num_requests_waiting + m.num_requests_running
        };
        (0..n)
            .map(|k| (self.rotation + k) % n)
            .min_by_key(|&i| load(i))
            .unwrap_or(0)
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
    fn pick(&mut self, request: &Request, pods: &[PodView<'_>]) -> usize {
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
        best.2
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
            .map(|i| rr.pick(&request(i, 0..10), &views(&engines)))
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0]);
        engines[0].add_request(request(1, 0..10)).unwrap();
        engines[1].add_request(request(2, 0..10)).unwrap();
        let mut lq = LeastQueue::default();
        assert!((0..5).all(|i| lq.pick(&request(i, 0..10), &views(&engines)) == 2));
    }

    #[test]
    fn oracle_follows_the_prefix_until_the_queue_costs_more() {
        let mut engines = fleet(2);
        engines[1].add_request(request(1, 0..5000)).unwrap();
        // Same 5000-token prefix: pod 1 will have it cached, its queue costs less than
        // recomputing the prefix on pod 0.
        assert_eq!(Oracle.pick(&request(2, 0..5100), &views(&engines)), 1);
        // Unrelated prompt: pod 0 is idle.
        assert_eq!(Oracle.pick(&request(3, 90_000..95_000), &views(&engines)), 0);
        // Pile a long queue of other work on pod 1: the prefix is no longer worth the wait.
        for i in 0..5 {
            engines[1]
                .add_request(request(
                    10 + i,
                    (100_000 * (i as u32 + 1))..(100_000 * (i as u32 + 1) + 4000),
                ))
                .unwrap();
        }
        assert_eq!(Oracle.pick(&request(4, 0..5100), &views(&engines)), 0);
    }
}
