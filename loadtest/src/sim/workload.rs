//! Workload generators shaped like inference-perf's (kubernetes-sigs/inference-perf,
//! `docs/config.md`): what the prompts look like (`data`) and when they are sent (`load`:
//! Poisson stages, optional in-flight limit).
//!
//! Token ids are drawn directly, as inference-perf's synthetic generators do (it samples ids
//! from the tokenizer's vocabulary and decodes them), so no text round trip is needed.

use std::sync::Arc;

use anyhow::{bail, ensure};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use super::request::Prompt;
use super::tokenizer::VOCAB_SIZE;

/// What the prompts look like (inference-perf `data`).
/// Longest stage a load may have: beyond it a duration is a typo, and `Instant` arithmetic
/// on it could overflow.
pub const MAX_STAGE_SECONDS: f64 = 7.0 * 24.0 * 3600.0;
/// Most arrivals one stage may plan: arrivals are generated up front, so a typo such as a
/// rate of 1e9 must be refused rather than allocate billions of them.
pub const MAX_REQUESTS_PER_STAGE: f64 = 10_000_000.0;

/// The one check of an open-loop stage (rate 0 for closed-loop ones), shared by the
/// virtual-time simulator and the load generator: the failing field and why.
pub fn check_stage(rate: f64, duration_s: f64) -> Result<(), (&'static str, String)> {
    if !(rate.is_finite() && rate >= 0.0) {
        return Err(("rate", format!("must be finite and >= 0, got {rate}")));
    }
    if !(duration_s.is_finite() && duration_s > 0.0 && duration_s <= MAX_STAGE_SECONDS) {
        return Err((
            "duration",
            format!("must be positive and at most 7 days, got {duration_s}s"),
        ));
    }
    if rate * duration_s > MAX_REQUESTS_PER_STAGE {
        let planned = rate * duration_s;
        return Err((
            "rate",
            format!("rate x duration plans {planned:.0} requests, more than the {MAX_REQUESTS_PER_STAGE:.0} one stage may hold"),
        ));
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum WorkloadSpec {
    /// `num_groups × num_prompts_per_group` distinct prompts; the prompts of a group share a
    /// `system_prompt_len`-token system prompt followed by a private `question_len`-token
    /// question. As in inference-perf, the prompt list is shuffled once and then cycled.
    SharedPrefix {
        num_groups: usize,
        num_prompts_per_group: usize,
        system_prompt_len: usize,
        question_len: usize,
        output_len: usize,
    },
    /// Independent random prompts with uniformly drawn lengths (bounds inclusive).
    Synthetic {
        input_min: usize,
        input_max: usize,
        output_min: usize,
        output_max: usize,
    },
    /// Independent random prompts of one length.
    Fixed { input_len: usize, output_len: usize },
}

/// One constant-rate Poisson stage.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    /// Mean requests per second.
    pub rate: f64,
    pub duration_s: f64,
}

/// When requests are sent (inference-perf `load`, `type: poisson`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadSpec {
    pub stages: Vec<Stage>,
    pub seed: u64,
    /// Most requests the load generator keeps in flight; later arrivals wait in the client
    /// (their wait is reported as schedule delay; TTFT counts from the actual send, as in
    /// inference-perf). `None` = open loop.
    #[serde(default)]
    pub max_in_flight: Option<usize>,
}

/// A request as the load generator sends it.
#[derive(Debug, Clone)]
pub struct Arrival {
    /// Index into the arrival list.
    pub id: u64,
    /// Intended send time, seconds from the start of the run.
    pub time: f64,
    pub stage: usize,
    pub prompt: Arc<Prompt>,
    pub max_tokens: usize,
}

impl LoadSpec {
    /// `[start, end)` of every stage, back to back from t = 0.
    pub fn stage_windows(&self) -> Vec<(f64, f64)> {
        let mut start = 0.0;
        self.stages
            .iter()
            .map(|s| {
                let window = (start, start + s.duration_s);
                start += s.duration_s;
                window
            })
            .collect()
    }

    fn validate(&self) -> anyhow::Result<()> {
        ensure!(!self.stages.is_empty(), "load.stages is empty");
        for (i, s) in self.stages.iter().enumerate() {
            check_stage(s.rate, s.duration_s)
                .map_err(|(field, problem)| anyhow::anyhow!("stage {i}: {field}: {problem}"))?;
        }
        ensure!(
            self.max_in_flight != Some(0),
            "load.max_in_flight must be positive"
        );
        Ok(())
    }
}

impl WorkloadSpec {
    fn validate(&self) -> anyhow::Result<()> {
        match *self {
            Self::SharedPrefix {
                num_groups,
                num_prompts_per_group,
                system_prompt_len,
                question_len,
                output_len,
            } => {
                ensure!(
                    num_groups > 0 && num_prompts_per_group > 0,
                    "shared_prefix needs groups and prompts"
                );
                ensure!(
                    system_prompt_len + question_len > 0,
                    "shared_prefix prompts would be empty"
                );
                ensure!(output_len > 0, "output_len must be positive");
            }
            Self::Synthetic {
                input_min,
                input_max,
                output_min,
                output_max,
            } => {
                ensure!(
                    0 < input_min && input_min <= input_max,
                    "synthetic needs 0 < input_min <= input_max"
                );
                ensure!(
                    0 < output_min && output_min <= output_max,
                    "synthetic needs 0 < output_min <= output_max"
                );
            }
            Self::Fixed {
                input_len,
                output_len,
            } => {
                if input_len == 0 || output_len == 0 {
                    bail!("fixed needs positive input_len and output_len");
                }
            }
        }
        Ok(())
    }
}

/// How the arrivals of an open-loop stage are spaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArrivalKind {
    /// Exponential gaps (a Poisson process), as inference-perf's `type: poisson`.
    Poisson,
    /// Evenly spaced at `1 / rate`.
    Constant,
}

/// Send offsets of one stage, seconds from its start, ascending; empty when `rate` is not
/// positive. The one arrival generator of the crate: the simulator and the HTTP load
/// generator both draw from it, so the same seed gives them the same Poisson arrivals.
pub fn arrival_offsets(kind: ArrivalKind, rate: f64, duration_s: f64, rng: &mut StdRng) -> Vec<f64> {
    if rate <= 0.0 {
        return Vec::new();
    }
    match kind {
        ArrivalKind::Poisson => {
            let mut out = Vec::new();
            let mut t = 0.0;
            loop {
                // Exponential gaps; 1 - u is in (0, 1], so ln never sees 0.
                t += -(1.0 - rng.random::<f64>()).ln() / rate;
                if t >= duration_s {
                    return out;
                }
                out.push(t);
            }
        }
        ArrivalKind::Constant => {
            // The epsilon keeps 3 req/s × 10 s at 30 requests despite float rounding.
            let n = (rate * duration_s + 1e-9).floor() as usize;
            (0..n).map(|i| i as f64 / rate).collect()
        }
    }
}

/// Generates every arrival of the run. Prompt contents and arrival times use separate random
/// streams derived from `load.seed`, so changing one does not reshuffle the other.
pub fn generate(workload: &WorkloadSpec, load: &LoadSpec, block_size: usize) -> anyhow::Result<Vec<Arrival>> {
    workload.validate()?;
    load.validate()?;
    let mut times_rng = StdRng::seed_from_u64(load.seed);
    let mut data_rng = StdRng::seed_from_u64(load.seed ^ 0x5eed_da7a);
    let mut source = PromptSource::new(workload, block_size, &mut data_rng);
    let mut arrivals = Vec::new();
    for (stage, (&(start, _), spec)) in load.stage_windows().iter().zip(&load.stages).enumerate() {
        for offset in arrival_offsets(ArrivalKind::Poisson, spec.rate, spec.duration_s, &mut times_rng) {
            let (prompt, max_tokens) = source.next(&mut data_rng);
            arrivals.push(Arrival {
                id: arrivals.len() as u64,
                time: start + offset,
                stage,
                prompt,
                max_tokens,
            });
        }
    }
    Ok(arrivals)
}

pub enum PromptSource {
    Cycle {
        prompts: Vec<(Arc<Prompt>, usize)>,
        next: usize,
    },
    /// A new prompt per request; lengths drawn uniformly from the inclusive ranges.
    Fresh {
        input: (usize, usize),
        output: (usize, usize),
        block_size: usize,
    },
}

impl PromptSource {
    pub fn new(spec: &WorkloadSpec, block_size: usize, rng: &mut StdRng) -> Self {
        let (num_groups, num_prompts_per_group, system_prompt_len, question_len, output_len) = match *spec {
            WorkloadSpec::SharedPrefix {
                num_groups,
                num_prompts_per_group,
                system_prompt_len,
                question_len,
                output_len,
            } => (
                num_groups,
                num_prompts_per_group,
                system_prompt_len,
                question_len,
                output_len,
            ),
            WorkloadSpec::Synthetic {
                input_min,
                input_max,
                output_min,
                output_max,
            } => {
                return Self::Fresh {
                    input: (input_min, input_max),
                    output: (output_min, output_max),
                    block_size,
                };
            }
            WorkloadSpec::Fixed {
                input_len,
                output_len,
            } => {
                return Self::Fresh {
                    input: (input_len, input_len),
                    output: (output_len, output_len),
                    block_size,
                };
            }
        };
        let mut prompts = Vec::with_capacity(num_groups * num_prompts_per_group);
        for _ in 0..num_groups {
            let system = random_tokens(rng, system_prompt_len);
            for _ in 0..num_prompts_per_group {
                let mut tokens = system.clone();
                tokens.extend(random_tokens(rng, question_len));
                prompts.push((Arc::new(Prompt::new(tokens, block_size)), output_len));
            }
        }
        prompts.shuffle(rng);
        Self::Cycle { prompts, next: 0 }
    }

    pub fn next(&mut self, rng: &mut StdRng) -> (Arc<Prompt>, usize) {
        match self {
            Self::Cycle { prompts, next } => {
                let (prompt, output_len) = &prompts[*next % prompts.len()];
                *next += 1;
                (prompt.clone(), *output_len)
            }
            Self::Fresh {
                input,
                output,
                block_size,
            } => {
                let input_len = rng.random_range(input.0..=input.1);
                let output_len = rng.random_range(output.0..=output.1);
                (
                    Arc::new(Prompt::new(random_tokens(rng, input_len), *block_size)),
                    output_len,
                )
            }
        }
    }
}

fn random_tokens(rng: &mut StdRng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..VOCAB_SIZE)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(stages: &[(f64, f64)]) -> LoadSpec {
        LoadSpec {
            stages: stages
                .iter()
                .map(|&(rate, duration_s)| Stage { rate, duration_s })
                .collect(),
            seed: 1,
            max_in_flight: None,
        }
    }

    #[test]
    fn poisson_stages_have_the_requested_rates_in_order() {
        let spec = WorkloadSpec::Fixed {
            input_len: 8,
            output_len: 2,
        };
        let arrivals = generate(&spec, &load(&[(50.0, 40.0), (0.0, 10.0), (200.0, 20.0)]), 16).unwrap();
        let count = |s| arrivals.iter().filter(|a| a.stage == s).count() as f64;
        assert!((count(0) / 2000.0 - 1.0).abs() < 0.1, "{}", count(0));
        assert_eq!(count(1), 0.0);
        assert!((count(2) / 4000.0 - 1.0).abs() < 0.1, "{}", count(2));
        assert!(arrivals.windows(2).all(|w| w[0].time <= w[1].time));
        assert!(arrivals
            .iter()
            .filter(|a| a.stage == 2)
            .all(|a| (50.0..70.0).contains(&a.time)));
        assert!(arrivals
            .iter()
            .enumerate()
            .all(|(i, a)| a.id == i as u64 && a.prompt.len() == 8));
    }

    #[test]
    fn shared_prefix_groups_share_exactly_the_system_prompt() {
        let spec = WorkloadSpec::SharedPrefix {
            num_groups: 3,
            num_prompts_per_group: 4,
            system_prompt_len: 64,
            question_len: 20,
            output_len: 7,
        };
        let arrivals = generate(&spec, &load(&[(100.0, 1.0)]), 16).unwrap();
        assert!(arrivals.len() > 24, "cycles through the 12 prompts");
        let distinct: Vec<&Arc<Prompt>> = arrivals[..12].iter().map(|a| &a.prompt).collect();
        assert!((0..12).all(|i| Arc::ptr_eq(distinct[i], &arrivals[i + 12].prompt)));
        let mut systems: Vec<&[u32]> = distinct.iter().map(|p| &p.tokens()[..64]).collect();
        systems.sort();
        systems.dedup();
        assert_eq!(systems.len(), 3);
        assert!(arrivals.iter().all(|a| a.prompt.len() == 84 && a.max_tokens == 7));
    }

    #[test]
    fn generation_is_seeded_and_validated() {
        let spec = WorkloadSpec::Synthetic {
            input_min: 5,
            input_max: 50,
            output_min: 1,
            output_max: 9,
        };
        let a = generate(&spec, &load(&[(20.0, 5.0)]), 16).unwrap();
        let b = generate(&spec, &load(&[(20.0, 5.0)]), 16).unwrap();
        assert_eq!(a.len(), b.len());
        assert!(a
            .iter()
            .zip(&b)
            .all(|(x, y)| x.time == y.time && x.prompt.tokens() == y.prompt.tokens()));
        assert!(a
            .iter()
            .all(|x| (5..=50).contains(&x.prompt.len()) && (1..=9).contains(&x.max_tokens)));
        assert!(generate(&spec, &load(&[]), 16).is_err());
        assert!(generate(&spec, &load(&[(-1.0, 5.0)]), 16).is_err());
        let bad = WorkloadSpec::Synthetic {
            input_min: 9,
            input_max: 5,
            output_min: 1,
            output_max: 1,
        };
        assert!(generate(&bad, &load(&[(1.0, 1.0)]), 16).is_err());
    }
}
