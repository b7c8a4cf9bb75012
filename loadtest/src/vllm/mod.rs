//! The HTTP face of the vLLM simulator: `portcullis sim vllm --pods N --port P`.
//!
//! Each pod is one [`crate::sim::engine::Engine`] (the same step-based vLLM V1 scheduler the
//! virtual-time fleet uses) stepped in scaled real time and served over HTTP/1.1 with vLLM's
//! OpenAI-compatible surface (vLLM docs, "OpenAI-Compatible Server"), so
//! the real gateway, its endpoint picker and external load generators can run end to end on CPUs.
//!
//! * [`fleet`]: binding pods to consecutive ports, [`start`], [`VllmFleet`];
//! * [`pod`]: one engine, its stepping task and the per-request token channels;
//! * [`server`]: connection handling and routing, `/health`, `/v1/models`, LoRA admin;
//! * [`openai`]: `/v1/completions` and `/v1/chat/completions`, plain and SSE;
//! * [`metrics`]: `/metrics` in Prometheus text format with vLLM's names;
//! * [`text`]: chat template and synthetic output words;
//! * [`reply`]: response helpers and vLLM's error envelope.
//!
//! **Time scale.** `--time-scale F` makes every engine step last `d / F` wall seconds where the
//! profile prices it at `d` simulated seconds: `F = 10` runs ten times faster than the modelled
//! GPUs. Everything a client measures (TTFT, ITL, throughput) is therefore in wall time, i.e.
//! simulated time ÷ F; to replay a scenario specified at `R` req/s in real time, send `F × R`
//! req/s. The latency histograms on `/metrics` report simulated seconds, measured on the
//! pod's own clock (the engine's step durations added up), so they read like a real vLLM's
//! at any time scale. Idle time between requests is not scaled. What clients measure in wall
//! time includes host overhead, which a large F makes large relative to the scaled steps:
//! on a shared 2-core debug build F = 10 keeps up, F = 1000 does not.

mod fleet;
mod metrics;
mod openai;
mod pod;
mod reply;
mod server;
mod text;

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

use anyhow::{bail, Context};

use crate::sim::profile::Profile;

pub use fleet::{start, VllmFleet};

/// Command-line flags of `portcullis sim vllm`.
#[derive(Debug, Clone, clap::Args)]
pub struct VllmSimArgs {
    /// Number of simulated vLLM replicas, served from one process.
    #[arg(long, default_value_t = 1)]
    pub pods: usize,
    /// Port of the first pod; pod i listens on PORT + i. 0 picks a free run of ports.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Address every pod listens on.
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    pub host: IpAddr,
    /// Served model name (what `/v1/models` lists and requests must name).
    #[arg(long, default_value = "Qwen/Qwen3-32B")]
    pub model: String,
    /// Engine profile JSON (see `loadtest/profiles/README.md`); default: the built-in
    /// qwen3-32b-tp2-h100 profile.
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Simulated seconds per wall second: 10 runs every engine step 10× faster than the
    /// modelled GPU, keeping all latency ratios. `/metrics` histograms report simulated time.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Overrides the profile's maximum context length (prompt + output tokens).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// LoRA adapter loaded at start, as NAME or NAME=PATH (repeatable).
    #[arg(long = "lora", value_name = "NAME[=PATH]")]
    pub loras: Vec<String>,
    /// Adapters per batch, as vLLM's `--max-loras`; reported in `vllm:lora_requests_info`
    /// (the engine does not model per-batch adapter limits).
    #[arg(long, default_value_t = 1)]
    pub max_loras: usize,
}

/// Time scales outside this range would make steps shorter than the timer can resolve or
/// overflow step durations; neither is a meaningful simulation.
const TIME_SCALE_RANGE: std::ops::RangeInclusive<f64> = 0.001..=100_000.0;

/// A validated fleet configuration, for [`start`].
#[derive(Debug, Clone)]
pub struct VllmSimConfig {
    pub pods: usize,
    pub host: IpAddr,
    pub port: u16,
    pub model: String,
    /// Engine profile; its `max_model_len` is the served context length.
    pub profile: Profile,
    pub time_scale: f64,
    /// Preloaded adapters as (name, path).
    pub loras: Vec<(String, String)>,
    pub max_loras: usize,
}

impl VllmSimConfig {
    /// Loads the profile and applies the overrides in `args`.
    pub fn from_args(args: &VllmSimArgs) -> anyhow::Result<Self> {
        let mut profile = match &args.profile {
            Some(path) => Profile::load(path)?,
            None => Profile::qwen3_32b_tp2_h100()?,
        };
        if let Some(len) = args.max_model_len {
            profile.max_model_len = len;
        }
        let loras = args
            .loras
            .iter()
            .map(|spec| match spec.split_once('=') {
                Some((name, path)) => (name.to_string(), path.to_string()),
                None => (spec.clone(), spec.clone()),
            })
            .collect();
        let config = Self {
            pods: args.pods,
            host: args.host,
            port: args.port,
            model: args.model.clone(),
            profile,
            time_scale: args.time_scale,
            loras,
            max_loras: args.max_loras,
        };
        config.validate()?;
        Ok(config)
    }

    /// Rejects configurations a pod could not serve; [`start`] calls it too.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.pods == 0 {
            bail!("--pods must be at least 1");
        }
        if !TIME_SCALE_RANGE.contains(&self.time_scale) {
            bail!(
                "--time-scale must be within {}..={}, got {}",
                TIME_SCALE_RANGE.start(),
                TIME_SCALE_RANGE.end(),
                self.time_scale
            );
        }
        self.profile.validate().context("engine profile")?;
        // vLLM refuses to start when one max-length sequence cannot fit in the KV cache.
        let kv_tokens = self.profile.num_gpu_blocks * self.profile.block_size;
        if self.profile.max_model_len > kv_tokens {
            bail!(
                "max_model_len {} exceeds the KV cache capacity of {kv_tokens} tokens",
                self.profile.max_model_len
            );
        }
        if self.model.is_empty() {
            bail!("--model must not be empty");
        }
        if let Some((name, _)) = self
            .loras
            .iter()
            .find(|(name, _)| name.is_empty() || *name == self.model)
        {
            bail!("invalid LoRA adapter name {name:?}");
        }
        Ok(())
    }
}

#[cfg(test)]
mod api_tests;
#[cfg(test)]
mod fleet_tests;
#[cfg(test)]
mod test_client;
