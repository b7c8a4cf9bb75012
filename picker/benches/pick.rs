//! Decision time of one pick, per pool size: `cargo bench -p portcullis-picker`.
//!
//! The workload is the llm-d shared-prefix shape scaled to the pool (about 19 prompt groups
//! per endpoint, a 24,000-byte shared system prompt and a 4,800-byte question, i.e. 6,000 and
//! 1,200 tokens), with every endpoint's signals refreshed every 50 simulated milliseconds
//! and each request finishing 200 picks after it started, so queues, the prefix index and
//! in-flight counts are all populated. A pick includes hashing the prompt. The target is
//! p99 ≤ 20 µs at 512 endpoints. Measured after a warm-up, on one thread; the generation of
//! each next prompt (not timed) evicts much of the CPU cache between picks, as serving other
//! requests would.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use portcullis_picker::{block_hashes, PickRequest, Picker, PickerConfig, Signals};

/// Picks before measuring: enough for every endpoint's prefix memory to fill and turn over,
/// so the figures are the steady state, not the index growing.
const WARM_UP: usize = 100_000;
const PICKS: usize = 200_000;
const RATE_PER_S: f64 = 60.0;

fn main() {
    println!("pool size   picks      p50       p99     p99.9       max");
    for pods in [8, 64, 512] {
        let histogram = run(pods);
        let us = |q: f64| histogram.value_at_quantile(q) as f64 / 1000.0;
        println!(
            "{pods:>9} {:>7} {:>7.2}µs {:>7.2}µs {:>7.2}µs {:>7.2}µs",
            histogram.len(),
            us(0.5),
            us(0.99),
            us(0.999),
            histogram.max() as f64 / 1000.0
        );
    }
}

fn run(pods: usize) -> Histogram<u64> {
    let config = PickerConfig::default();
    let prefix = config.prefix;
    let mut picker = Picker::new(config, pods);
    let groups = pods * 19;
    let system_prompts: Vec<Vec<u8>> = (0..groups)
        .map(|g| format!("{g:08}").bytes().cycle().take(24_000).collect())
        .collect();
    let mut histogram = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("valid bounds");
    let mut rng = fastrand::Rng::with_seed(7);
    let mut outstanding = std::collections::VecDeque::new();
    let mut prompt = Vec::with_capacity(30_000);
    let mut next_signal = Duration::ZERO;
    for i in 0..WARM_UP + PICKS {
        let now = Duration::from_secs_f64(i as f64 / RATE_PER_S);
        if now >= next_signal {
            for e in 0..pods {
                picker.observe(
                    e,
                    Signals {
                        sampled_at: now,
                        waiting: rng.u32(0..8),
                        kv_cache_usage: rng.f64() * 0.9,
                        lora: None,
                    },
                );
            }
            next_signal = now + Duration::from_millis(50);
        }
        prompt.clear();
        prompt.extend_from_slice(&system_prompts[rng.usize(0..groups)]);
        prompt.extend((0..4_800).map(|_| rng.alphanumeric() as u8));
        let started = Instant::now();
        let hashes = block_hashes("Qwen/Qwen3-32B", &prompt, &prefix);
        let request = PickRequest {
            model: "Qwen/Qwen3-32B",
            lora: false,
            prompt_hashes: &hashes,
        };
        let pick = picker.pick(now, &request, |_| true);
        let elapsed = started.elapsed();
        let chosen = pick.expect("the bench pool always has an endpoint").endpoints[0];
        if i >= WARM_UP {
            histogram.saturating_record(elapsed.as_nanos() as u64);
        }
        outstanding.push_back(chosen);
        if outstanding.len() > 200 {
            if let Some(done) = outstanding.pop_front() {
                picker.finished(done);
            }
        }
    }
    histogram
}
