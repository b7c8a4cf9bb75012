use std::collections::HashMap;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

fn small_profile(num_gpu_blocks: usize, budget: usize, max_num_seqs: usize) -> Profile {
    let mut p = Profile::qwen3_32b_tp2_h100().unwrap();
    p.num_gpu_blocks = num_gpu_blocks;
    p.max_num_batched_tokens = budget;
    p.max_num_seqs = max_num_seqs;
    p
}

fn prompt(tokens: impl IntoIterator<Item = u32>) -> Arc<Prompt> {
    Arc::new(Prompt::new(tokens.into_iter().collect(), 16))
}

/// Per-request token counts and first-token flags seen in events.
#[derive(Default)]
struct Seen {
    tokens: HashMap<u64, usize>,
    firsts: HashMap<u64, usize>,
    finished: HashMap<u64, Completion>,
}

impl Seen {
    fn record(&mut self, events: &[Event]) {
        for e in events {
            assert!(!self.finished.contains_key(&e.request_id), "token after finish");
            *self.tokens.entry(e.request_id).or_default() += 1;
            if e.first {
                *self.firsts.entry(e.request_id).or_default() += 1;
            }
            if let Some(c) = e.finished {
                self.finished.insert(e.request_id, c);
            }
        }
    }
}

/// Steps until idle, checking the invariants, the token budget and the metrics after every
/// step. Returns the number of steps.
fn drain(engine: &mut Engine, seen: &mut Seen) -> usize {
    let mut steps = 0;
    while let Some((plan, events)) = engine.step() {
        assert_checked(engine, &plan);
        seen.record(&events);
        steps += 1;
        assert!(steps < 1_000_000, "engine does not converge");
    }
    assert!(!engine.has_work(), "idle with queued work");
    steps
}

fn assert_checked(engine: &Engine, plan: &StepPlan) {
    engine.check_invariants().unwrap();
    let budget = engine.profile.max_num_batched_tokens;
    assert!(
        plan.scheduled_tokens <= budget,
        "budget exceeded: {} > {budget}",
        plan.scheduled_tokens
    );
    assert_eq!(
        plan.batch.prefill_tokens + plan.batch.decode_seqs,
        plan.scheduled_tokens
    );
    let m = engine.metrics();
    assert_eq!(m.num_requests_waiting, engine.waiting.len());
    assert_eq!(m.num_requests_running, engine.running.len());
    assert_eq!(
        m.kv_cache_usage,
        engine.kv.num_used() as f64 / engine.profile.num_gpu_blocks as f64
    );
    assert!((0.0..=1.0).contains(&m.kv_cache_usage));
    assert!(m.prefix_cache_hits <= m.prefix_cache_queries);
}

#[test]
fn heavy_random_load_never_over_allocates_or_exceeds_the_budget() {
    let mut rng = StdRng::seed_from_u64(42);
    let mut engine = Engine::new(small_profile(400, 512, 24));
    let prefixes: Vec<Vec<u32>> = (0..5)
        .map(|_| {
            (0..rng.random_range(16..300))
                .map(|_| rng.random_range(0..1000))
                .collect()
        })
        .collect();
    let mut seen = Seen::default();
    let mut expected = HashMap::new();
    for id in 0..300u64 {
        let mut tokens = prefixes[rng.random_range(0..prefixes.len())].clone();
        tokens.extend((0..rng.random_range(1..400)).map(|_| rng.random_range(0..1000)));
        let max_tokens = rng.random_range(1..300);
        engine
            .add_request(Request {
                id,
                prompt: prompt(tokens),
                max_tokens,
            })
            .unwrap();
        expected.insert(id, max_tokens);
        for _ in 0..rng.random_range(0..4) {
            if let Some((plan, events)) = engine.step() {
                assert_checked(&engine, &plan);
                seen.record(&events);
            }
        }
    }
    drain(&mut engine, &mut seen);
    assert_eq!(
        seen.tokens, expected,
        "every request gets exactly max_tokens tokens"
    );
    assert!(seen.firsts.values().all(|&n| n == 1));
    let m = engine.metrics();
    assert_eq!(m.request_success, 300);
    assert!(
        m.num_preemptions > 0,
        "the load is meant to be heavy enough to preempt"
    );
    assert!(m.prefix_cache_hits > 0);
    assert_eq!(m.generation_tokens, expected.values().sum::<usize>() as u64);
    assert_eq!(m.kv_cache_usage, 0.0);
}

#[test]
fn preempted_requests_restart_and_complete() {
    // 20 blocks = 320 tokens of KV; each request ends at 200 tokens (13 blocks), so two
    // running requests cannot both finish without one being preempted.
    let mut engine = Engine::new(small_profile(20, 8192, 256));
    for id in 0..6u64 {
        let tokens = (0..100).map(|t| t + 1000 * id as u32);
        engine
            .add_request(Request {
                id,
                prompt: prompt(tokens),
                max_tokens: 100,
            })
            .unwrap();
    }
    let mut seen = Seen::default();
    drain(&mut engine, &mut seen);
    assert!(engine.metrics().num_preemptions > 0);
    assert_eq!(seen.finished.len(), 6);
    assert!(seen.tokens.values().all(|&n| n == 100));
    assert!(
        seen.firsts.values().all(|&n| n == 1),
        "a restarted request does not re-send its first token"
    );
    assert!(seen.finished.values().any(|c| c.preemptions > 0));
}

#[test]
fn prefix_hits_cut_prefill_work_and_ttft() {
    let mut engine = Engine::new(small_profile(2000, 2048, 256));
    let system: Vec<u32> = (0..4000).collect();
    let ask = |question: u32| {
        let mut t = system.clone();
        t.extend((0..200).map(|i| 50_000 + question * 1000 + i));
        prompt(t)
    };
    let measure = |engine: &mut Engine, id, prompt| {
        engine
            .add_request(Request {
                id,
                prompt,
                max_tokens: 4,
            })
            .unwrap();
        let (mut ttft, mut prefilled) = (0.0, 0);
        while let Some((plan, events)) = engine.step() {
            prefilled += plan.batch.prefill_tokens;
            ttft += plan.duration;
            if events.iter().any(|e| e.first) {
                break;
            }
        }
        let mut seen = Seen::default();
        drain(engine, &mut seen);
        (ttft, prefilled)
    };
    let (cold_ttft, cold_prefill) = measure(&mut engine, 1, ask(1));
    let (warm_ttft, warm_prefill) = measure(&mut engine, 2, ask(2));
    assert_eq!(cold_prefill, 4200);
    // 4000 shared tokens = 250 full blocks are reused; only the question is computed.
    assert_eq!(warm_prefill, 200);
    assert!(
        warm_ttft < cold_ttft / 5.0,
        "warm {warm_ttft} vs cold {cold_ttft}"
    );
    let m = engine.metrics();
    assert_eq!(m.prefix_cache_hits, 4000);
    assert_eq!(m.prefix_cache_queries, 8400);
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let mut engine = Engine::new(small_profile(100, 8192, 8));
    for id in 0..2 {
        engine
            .add_request(Request {
                id,
                prompt: prompt(0..64),
                max_tokens: 2,
            })
            .unwrap();
        let mut seen = Seen::default();
        drain(&mut engine, &mut seen);
        assert_eq!(seen.tokens[&id], 2);
    }
    // 64 tokens = 4 full blocks, but only 3 can be reused: the 4th holds the last prompt token.
    assert_eq!(engine.metrics().prefix_cache_hits, 48);
}

#[test]
fn impossible_requests_are_rejected() {
    let mut engine = Engine::new(small_profile(10, 8192, 8));
    let reject = |engine: &mut Engine, p, max_tokens| {
        engine.add_request(Request {
            id: 0,
            prompt: p,
            max_tokens,
        })
    };
    assert_eq!(reject(&mut engine, prompt([]), 1), Err(Rejected::EmptyPrompt));
    assert_eq!(
        reject(&mut engine, prompt(0..10), 0),
        Err(Rejected::ZeroMaxTokens)
    );
    assert_eq!(
        reject(&mut engine, prompt(0..150), 20),
        Err(Rejected::ExceedsKvCapacity)
    );
    assert_eq!(
        reject(&mut engine, prompt(0..40_000), 1000),
        Err(Rejected::ExceedsMaxModelLen)
    );
    assert!(!engine.has_work());
}

#[test]
fn queued_prefixes_count_for_routing() {
    let mut engine = Engine::new(small_profile(100, 8192, 8));
    let p = prompt(0..100);
    assert_eq!(engine.prefix_hit_tokens(&p), 0);
    engine
        .add_request(Request {
            id: 0,
            prompt: p.clone(),
            max_tokens: 1,
        })
        .unwrap();
    // Not computed yet, but queued: 6 full blocks will be cached once it runs.
    assert_eq!(engine.prefix_hit_tokens(&p), 96);
    assert_eq!(engine.remaining_prefill_tokens(), 100);
    assert_eq!(engine.kv_demand_blocks(), 7);
    let mut seen = Seen::default();
    drain(&mut engine, &mut seen);
    assert_eq!(engine.prefix_hit_tokens(&p), 96, "now cached in the pool");
    assert_eq!(engine.remaining_prefill_tokens(), 0);
}
