//! When requests are sent and what they say.
//!
//! Arrival times and prompt contents come from separate random streams derived from
//! `load.seed` exactly as in the virtual-time simulator (`sim::workload::generate`), and times
//! come from the same `sim::workload::arrival_offsets`, so every target of a run — and a
//! Poisson run of the simulator with the same seed — sees identical arrivals. Shared-prefix
//! prompts reuse the simulator's generator; the prompt token ids are then spelled as text whose
//! stand-in token count (`sim::tokenizer`) equals the requested length, which is how the HTTP
//! vLLM simulator counts them.

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::config::{DataConfig, LengthDist, LoadConfig, LoadKind};
use crate::sim::request::Prompt;
use crate::sim::tokenizer::VOCAB_SIZE;
use crate::sim::workload::{arrival_offsets, ArrivalKind, PromptSource, WorkloadSpec};

/// Same stream split as `sim::workload::generate`.
const DATA_SEED_XOR: u64 = 0x5eed_da7a;

/// The simulator's prompts carry block hashes for its KV model; their size is irrelevant here.
const SIM_BLOCK_SIZE: usize = 16;

/// Send offsets of every stage, in seconds from that stage's start; empty for closed-loop
/// stages, whose clients send whenever their previous request is answered.
pub fn schedule(load: &LoadConfig) -> Vec<Vec<f64>> {
    let kind = match load.kind {
        LoadKind::Poisson => ArrivalKind::Poisson,
        LoadKind::Constant => ArrivalKind::Constant,
        LoadKind::ClosedLoop => return vec![Vec::new(); load.stages.len()],
    };
    let mut rng = StdRng::seed_from_u64(load.seed);
    load.stages
        .iter()
        // `validate` guarantees a rate in every open-loop stage.
        .map(|s| arrival_offsets(kind, s.rate.unwrap_or(0.0), s.duration.as_secs_f64(), &mut rng))
        .collect()
}

/// Token ids of one prompt: shared with other requests (shared prefix) or drawn for it alone.
pub enum PromptIds {
    Shared(Arc<Prompt>),
    Owned(Vec<u32>),
}

impl PromptIds {
    pub fn ids(&self) -> &[u32] {
        match self {
            Self::Shared(p) => p.tokens(),
            Self::Owned(ids) => ids,
        }
    }
}

/// The sequence of prompts and output lengths a target is sent, in order.
pub struct PromptGen {
    source: Source,
    rng: StdRng,
}

enum Source {
    Shared(PromptSource),
    Sampled { input: LengthDist, output: LengthDist },
}

impl PromptGen {
    pub fn new(data: &DataConfig, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed ^ DATA_SEED_XOR);
        let source = match *data {
            DataConfig::SharedPrefix(s) => {
                let spec = WorkloadSpec::SharedPrefix {
                    num_groups: s.num_groups,
                    num_prompts_per_group: s.num_prompts_per_group,
                    system_prompt_len: s.system_prompt_len,
                    question_len: s.question_len,
                    output_len: s.output_len,
                };
                Source::Shared(PromptSource::new(&spec, SIM_BLOCK_SIZE, &mut rng))
            }
            DataConfig::Synthetic(s) => Source::Sampled {
                input: s.input_len,
                output: s.output_len,
            },
            DataConfig::Fixed(f) => Source::Sampled {
                input: exactly(f.input_len),
                output: exactly(f.output_len),
            },
        };
        Self { source, rng }
    }

    /// The next prompt and its `max_tokens`.
    pub fn next_prompt(&mut self) -> (PromptIds, usize) {
        match &mut self.source {
            Source::Shared(source) => {
                let (prompt, output_len) = source.next(&mut self.rng);
                (PromptIds::Shared(prompt), output_len)
            }
            Source::Sampled { input, output } => {
                let input_len = sample_len(input, &mut self.rng);
                let output_len = sample_len(output, &mut self.rng);
                let ids = (0..input_len)
                    .map(|_| self.rng.random_range(0..VOCAB_SIZE))
                    .collect();
                (PromptIds::Owned(ids), output_len)
            }
        }
    }
}

fn exactly(len: usize) -> LengthDist {
    LengthDist {
        mean: None,
        min: len,
        max: len,
    }
}

/// A length in `[min, max]` whose expectation is `mean`: uniform below the mean with
/// probability `(max - mean) / (max - min)`, uniform above it otherwise (plain uniform when the
/// mean is the midpoint). Simple, bounded, and honours all three numbers of the config.
fn sample_len(dist: &LengthDist, rng: &mut StdRng) -> usize {
    let (min, max) = (dist.min as f64, dist.max as f64);
    if dist.min >= dist.max {
        return dist.min;
    }
    let mean = dist.mean.unwrap_or((min + max) / 2.0);
    let below = rng.random::<f64>() < (max - mean) / (max - min);
    let (lo, hi) = if below { (min, mean) } else { (mean, max) };
    (lo + rng.random::<f64>() * (hi - lo)).round() as usize
}

/// Spells token ids as words of 1–4 lowercase letters, one stand-in token each (the stand-in
/// tokenizer splits on whitespace and cuts words into 4-byte chunks). Equal id prefixes give
/// equal text prefixes, so prefix caching and prefix-aware routing see the shared prefixes.
pub fn text_of(ids: &[u32]) -> String {
    let mut text = String::with_capacity(ids.len() * 5);
    for (i, &id) in ids.iter().enumerate() {
        if i > 0 {
            text.push(' ');
        }
        // 26^4 = 456,976 > VOCAB_SIZE, so four letters always suffice.
        let mut rest = id % VOCAB_SIZE;
        loop {
            text.push(char::from(b'a' + (rest % 26) as u8));
            rest /= 26;
            if rest == 0 {
                break;
            }
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::llm::config::{SharedPrefix, StageConfig, Synthetic};
    use crate::sim::tokenizer::encode;

    fn load(kind: LoadKind, stages: &[(f64, u64)]) -> LoadConfig {
        LoadConfig {
            kind,
            stages: stages
                .iter()
                .map(|&(rate, secs)| StageConfig {
                    rate: Some(rate),
                    clients: None,
                    duration: Duration::from_secs(secs),
                })
                .collect(),
            max_concurrency: None,
            seed: 42,
        }
    }

    #[test]
    fn poisson_counts_match_rate_times_duration() {
        let plan = schedule(&load(LoadKind::Poisson, &[(50.0, 40), (0.0, 5), (200.0, 20)]));
        // Expected 2000 and 4000; a Poisson count's sd is sqrt(n), so ±10 % is > 4.5 sd.
        assert!(
            (plan[0].len() as f64 / 2000.0 - 1.0).abs() < 0.1,
            "{}",
            plan[0].len()
        );
        assert!(plan[1].is_empty());
        assert!(
            (plan[2].len() as f64 / 4000.0 - 1.0).abs() < 0.1,
            "{}",
            plan[2].len()
        );
        assert!(plan[0].windows(2).all(|w| w[0] <= w[1]));
        assert!(plan[2].iter().all(|&t| (0.0..20.0).contains(&t)));
        assert_eq!(
            plan,
            schedule(&load(LoadKind::Poisson, &[(50.0, 40), (0.0, 5), (200.0, 20)]))
        );
    }

    #[test]
    fn poisson_plan_matches_the_simulators_arrivals() {
        use crate::sim::workload::{generate, LoadSpec, Stage};
        let plan = schedule(&load(LoadKind::Poisson, &[(50.0, 4), (20.0, 3)]));
        let sim = LoadSpec {
            stages: vec![
                Stage {
                    rate: 50.0,
                    duration_s: 4.0,
                },
                Stage {
                    rate: 20.0,
                    duration_s: 3.0,
                },
            ],
            seed: 42,
            max_in_flight: None,
        };
        let spec = WorkloadSpec::Fixed {
            input_len: 1,
            output_len: 1,
        };
        let arrivals = generate(&spec, &sim, SIM_BLOCK_SIZE).unwrap();
        for (stage, (start, _)) in sim.stage_windows().into_iter().enumerate() {
            let times: Vec<f64> = arrivals
                .iter()
                .filter(|a| a.stage == stage)
                .map(|a| a.time - start)
                .collect();
            assert_eq!(times.len(), plan[stage].len());
            // `start + offset - start` may differ from `offset` in the last bit.
            assert!(times.iter().zip(&plan[stage]).all(|(a, b)| (a - b).abs() < 1e-9));
        }
    }

    #[test]
    fn constant_load_is_evenly_spaced() {
        let plan = schedule(&load(LoadKind::Constant, &[(3.0, 10)]));
        assert_eq!(plan[0].len(), 30);
        assert!(plan[0].windows(2).all(|w| (w[1] - w[0] - 1.0 / 3.0).abs() < 1e-9));
    }

    #[test]
    fn text_has_the_requested_stand_in_token_count() {
        let mut gen = PromptGen::new(
            &DataConfig::SharedPrefix(SharedPrefix {
                num_groups: 2,
                num_prompts_per_group: 2,
                system_prompt_len: 300,
                question_len: 40,
                output_len: 9,
            }),
            1,
        );
        let prompts: Vec<String> = (0..4)
            .map(|_| {
                let (ids, out) = gen.next_prompt();
                assert_eq!(out, 9);
                text_of(ids.ids())
            })
            .collect();
        assert!(prompts.iter().all(|p| encode(p).len() == 340));
        // Each prompt shares its 300-token system prompt with exactly one other prompt.
        let prefix = |p: &String| encode(p)[..300].to_vec();
        for p in &prompts {
            let same = prompts.iter().filter(|q| prefix(q) == prefix(p)).count();
            assert_eq!(same, 2);
        }
        assert_eq!(encode(&text_of(&[0, 25, 26, VOCAB_SIZE - 1])).len(), 4);
    }

    #[test]
    fn synthetic_lengths_honour_bounds_and_mean() {
        let dist = LengthDist {
            mean: Some(30.0),
            min: 10,
            max: 110,
        };
        let mut gen = PromptGen::new(
            &DataConfig::Synthetic(Synthetic {
                input_len: dist,
                output_len: exactly(5),
            }),
            3,
        );
        let lens: Vec<usize> = (0..4000)
            .map(|_| {
                let (ids, out) = gen.next_prompt();
                assert_eq!(out, 5);
                ids.ids().len()
            })
            .collect();
        assert!(lens.iter().all(|l| (10..=110).contains(l)));
        let mean = lens.iter().sum::<usize>() as f64 / lens.len() as f64;
        assert!((mean - 30.0).abs() < 2.0, "{mean}");
    }
}
