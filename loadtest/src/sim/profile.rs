//! Engine profile: the capacity limits and step-time coefficients of one simulated vLLM replica.
//!
//! Profiles are JSON files under `loadtest/profiles/`; `loadtest/profiles/README.md` documents
//! where every number comes from. The step-time model is our own, not a published one (its
//! coefficients are our estimates, derived in that README): a step costs a fixed overhead
//! (reading the weights once), plus linear prefill compute, plus quadratic prefill attention,
//! plus per-sequence decode overhead, plus KV reads proportional to the context attended in
//! the batch.

use std::path::Path;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

/// The profile that ships with the simulator (Qwen3-32B, TP=2, H100, vLLM V1 defaults).
const QWEN3_32B_TP2_H100: &str = include_str!("../../profiles/qwen3-32b-tp2-h100.json");

/// Capacity limits and step-time coefficients of one replica.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    /// Tokens per KV block (vLLM default 16).
    pub block_size: usize,
    /// KV blocks available to the replica after weights and activations.
    pub num_gpu_blocks: usize,
    /// Most requests in RUNNING at once.
    pub max_num_seqs: usize,
    /// Per-step token budget shared by decodes and prefill chunks.
    pub max_num_batched_tokens: usize,
    /// Longest prompt + output a request may have; longer requests are rejected.
    pub max_model_len: usize,
    pub step: StepCoefficients,
}

/// `t = c0 + c_prefill·P + c_attn·Σ(p·ctx)/1e6 + c_decode·D + c_kv·Σctx`, all in seconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepCoefficients {
    /// Fixed cost of any step: streaming the weights from HBM plus launch/all-reduce overhead.
    pub c0_s: f64,
    /// Per prefill token: the dense matmuls (≈ 2 × parameters FLOPs per token).
    pub c_prefill_s_per_token: f64,
    /// Per million (prefill token × context token) pairs: prefill attention.
    pub c_attn_s_per_mpair: f64,
    /// Per decoding sequence: sampling, per-sequence kernels, the decode token's matmul share.
    pub c_decode_s_per_seq: f64,
    /// Per context token attended in the batch: reading its K and V from HBM.
    pub c_kv_s_per_ctx_token: f64,
}

/// The shape of one scheduled batch, as the step-time model needs it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BatchShape {
    /// Prompt (or recomputed) tokens computed this step.
    pub prefill_tokens: usize,
    /// Σ over prefill chunks of `chunk_tokens × mean context per chunk token`.
    pub prefill_pairs: f64,
    /// Sequences that compute exactly their one pending decode token.
    pub decode_seqs: usize,
    /// Σ over every scheduled sequence of the context it attends (KV read volume).
    pub ctx_tokens: usize,
}

impl Profile {
    /// The built-in Qwen3-32B / TP=2 / H100 profile.
    pub fn qwen3_32b_tp2_h100() -> anyhow::Result<Self> {
        Self::from_json(QWEN3_32B_TP2_H100).context("built-in profile qwen3-32b-tp2-h100")
    }

    /// Reads and validates a profile file.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading profile {}", path.display()))?;
        Self::from_json(&text).with_context(|| format!("profile {}", path.display()))
    }

    /// Parses and validates a profile.
    pub fn from_json(text: &str) -> anyhow::Result<Self> {
        let profile: Self = serde_json::from_str(text).context("parsing profile JSON")?;
        profile.validate()?;
        Ok(profile)
    }

    /// Rejects profiles the engine cannot run: zero capacities would deadlock the scheduler and
    /// negative or non-finite coefficients would move virtual time backwards.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (field, value) in [
            ("block_size", self.block_size),
            ("num_gpu_blocks", self.num_gpu_blocks),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
        ] {
            if value == 0 {
                bail!("{field} must be positive");
            }
        }
        let s = &self.step;
        for (field, value) in [
            ("step.c0_s", s.c0_s),
            ("step.c_prefill_s_per_token", s.c_prefill_s_per_token),
            ("step.c_attn_s_per_mpair", s.c_attn_s_per_mpair),
            ("step.c_decode_s_per_seq", s.c_decode_s_per_seq),
            ("step.c_kv_s_per_ctx_token", s.c_kv_s_per_ctx_token),
        ] {
            if !value.is_finite() || value < 0.0 {
                bail!("{field} must be a finite non-negative number of seconds, got {value}");
            }
        }
        if s.c0_s == 0.0 {
            // A zero-cost step would let an idle-looking pod spin without advancing time.
            bail!("step.c0_s must be positive");
        }
        Ok(())
    }

    /// Duration of a step that computes `batch`, in seconds.
    pub fn step_time(&self, batch: &BatchShape) -> f64 {
        let s = &self.step;
        s.c0_s
            + s.c_prefill_s_per_token * batch.prefill_tokens as f64
            + s.c_attn_s_per_mpair * batch.prefill_pairs / 1e6
            + s.c_decode_s_per_seq * batch.decode_seqs as f64
            + s.c_kv_s_per_ctx_token * batch.ctx_tokens as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_profile_parses_and_is_plausible() {
        let p = Profile::qwen3_32b_tp2_h100().unwrap();
        assert_eq!(p.block_size, 16);
        // A lone decode step is dominated by the weight read (≈ 12–15 ms on H100, our estimate).
        let lone = p.step_time(&BatchShape {
            decode_seqs: 1,
            ctx_tokens: 1000,
            ..Default::default()
        });
        assert!((0.010..0.020).contains(&lone), "{lone}");
        // A full 8192-token prefill chunk takes ≈ 0.55–0.75 s (our estimate: ≈ 13–15 k tok/s).
        let chunk = p.step_time(&BatchShape {
            prefill_tokens: 8192,
            prefill_pairs: 8192.0 * 4096.0,
            ctx_tokens: 8192,
            ..Default::default()
        });
        assert!((0.5..0.8).contains(&chunk), "{chunk}");
    }

    #[test]
    fn invalid_profiles_are_rejected_with_context() {
        let good = serde_json::to_value(Profile::qwen3_32b_tp2_h100().unwrap()).unwrap();
        let mut zero = good.clone();
        zero["num_gpu_blocks"] = 0.into();
        let err = Profile::from_json(&zero.to_string()).unwrap_err();
        assert!(format!("{err:#}").contains("num_gpu_blocks"));
        let mut negative = good.clone();
        negative["step"]["c_kv_s_per_ctx_token"] = (-1.0).into();
        assert!(Profile::from_json(&negative.to_string()).is_err());
        let mut unknown = good;
        unknown["surprise"] = 1.into();
        assert!(Profile::from_json(&unknown.to_string()).is_err());
        assert!(Profile::from_json("{not json").is_err());
        let missing = Profile::load(Path::new("/nonexistent/profile.json")).unwrap_err();
        assert!(format!("{missing:#}").contains("/nonexistent/profile.json"));
    }
}
