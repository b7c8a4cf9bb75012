//! The public entry point: one configuration, every router on identical arrivals, one report.

use anyhow::{ensure, Context};
use serde::{Deserialize, Serialize};

use super::fleet::{simulate, SignalSpec};
use super::profile::Profile;
use super::report::{summarize, Report};
use super::router::RouterKind;
use super::workload::{generate, LoadSpec, Stage, WorkloadSpec};

/// A virtual-time experiment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VirtualConfig {
    pub profile: Profile,
    /// Number of identical replicas.
    pub pods: usize,
    /// Routers to compare; each gets its own fresh fleet and the same arrivals.
    pub routers: Vec<RouterKind>,
    pub workload: WorkloadSpec,
    pub load: LoadSpec,
    /// How metrics reach routers that read them.
    #[serde(default)]
    pub signals: SignalSpec,
    /// Proxies the picker runs in, each with its own prefix index and counts (requests reach
    /// them in turn). Default 1.
    #[serde(default = "one_proxy")]
    pub proxies: usize,
}

fn one_proxy() -> usize {
    1
}

impl VirtualConfig {
    /// The published llm-d benchmark (llm-d/llm-d, `guides/inference-scheduling/README.md`):
    /// Qwen3-32B on 8 TP=2 replicas, 150 groups × 5 prompts of 6,000 shared + 1,200 private
    /// tokens, 1,000 output tokens, Poisson stages rising to 60 QPS. The report lists the stage
    /// rates but not every stage's duration (20–50 s), so each stage lasts `stage_s`. The load
    /// generator keeps at most 900 requests in flight: to report TTFT 0.12 s while 60 QPS were
    /// offered and 14.4 req/s served, the published client must have held the excess back, and
    /// Little's law on its figures (14.41 req/s × 67.9 s E2E) gives ≈ 980 in flight. 900 rather
    /// than 980 because in this model 1,000 in flight slightly exceeds the fleet's KV under
    /// perfect affinity (≈ 19 × 6 k shared + 125 × 1.7 k private tokens per replica > 320 k),
    /// see `loadtest/profiles/README.md`.
    pub fn llm_d_benchmark(profile: Profile, stage_s: f64) -> Self {
        const RATES: [f64; 17] = [
            15.0, 3.0, 10.0, 15.0, 20.0, 22.0, 25.0, 30.0, 35.0, 40.0, 43.0, 46.0, 49.0, 52.0, 55.0, 57.0,
            60.0,
        ];
        Self {
            profile,
            pods: 8,
            routers: vec![
                RouterKind::RoundRobin,
                RouterKind::LeastQueue,
                RouterKind::Picker,
                RouterKind::Oracle,
            ],
            workload: WorkloadSpec::SharedPrefix {
                num_groups: 150,
                num_prompts_per_group: 5,
                system_prompt_len: 6000,
                question_len: 1200,
                output_len: 1000,
            },
            load: LoadSpec {
                stages: RATES
                    .iter()
                    .map(|&rate| Stage {
                        rate,
                        duration_s: stage_s,
                    })
                    .collect(),
                seed: 1,
                max_in_flight: Some(900),
            },
            signals: SignalSpec::default(),
            proxies: 1,
        }
    }
}

/// Runs every configured router (in parallel threads; each run is independent and
/// deterministic) and summarises them per stage.
pub fn run_virtual(config: &VirtualConfig) -> anyhow::Result<Report> {
    config.profile.validate().context("profile")?;
    ensure!(config.pods > 0, "pods must be positive");
    ensure!(!config.routers.is_empty(), "no routers to compare");
    ensure!(config.proxies > 0, "proxies must be positive");
    let signals = config.signals;
    ensure!(
        signals.interval_s.is_finite() && (signals.interval_s == 0.0 || signals.interval_s >= 0.001),
        "signals.interval_s must be 0 (no samples) or at least 0.001"
    );
    ensure!(
        signals.delay_s.is_finite() && signals.delay_s >= 0.0,
        "signals.delay_s must be a finite number of seconds, 0 or more"
    );
    let arrivals = generate(&config.workload, &config.load, config.profile.block_size).context("workload")?;
    let routers = std::thread::scope(|scope| {
        let runs: Vec<_> = config
            .routers
            .iter()
            .map(|&kind| {
                let arrivals = &arrivals;
                scope.spawn(move || {
                    let mut router = kind.build(config.pods, config.proxies);
                    let outcome = simulate(
                        &config.profile,
                        config.pods,
                        router.as_mut(),
                        arrivals,
                        config.load.max_in_flight,
                        config.signals,
                    );
                    summarize(kind.name(), &config.load, &outcome)
                })
            })
            .collect();
        runs.into_iter()
            .map(|run| {
                run.join()
                    .map_err(|_| anyhow::anyhow!("a simulation thread panicked"))
            })
            .collect::<anyhow::Result<Vec<_>>>()
    })?;
    Ok(Report {
        profile: config.profile.name.clone(),
        pods: config.pods,
        routers,
    })
}

#[cfg(test)]
#[path = "run_tests.rs"]
mod tests;
