//! One vLLM replica's scheduler, stepped like vLLM V1 (vllm-project/vllm:
//! `vllm/v1/core/sched/scheduler.py`, `vllm/v1/core/kv_cache_manager.py`).
//!
//! A step has two halves so that a discrete-event driver can let time pass in between:
//! [`Engine::begin_step`] picks the batch (allocating KV blocks, preempting if needed) and
//! returns its duration; [`Engine::end_step`] applies the computed tokens and reports the
//! tokens produced. Requests added between the two halves wait for the next step, as they do
//! in vLLM while the GPU is busy.

use std::collections::VecDeque;
use std::fmt;

use serde::Serialize;

use super::kv_cache::{HashIndex, KvCache};
use super::profile::{BatchShape, Profile};
use super::request::{Prompt, Request, Seq};

/// Why a request was refused at admission (vLLM answers these with HTTP 400).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    EmptyPrompt,
    ZeroMaxTokens,
    ExceedsMaxModelLen,
    /// Even an empty KV cache could not hold the finished request, so it could never finish.
    ExceedsKvCapacity,
}

impl fmt::Display for Rejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::EmptyPrompt => "empty prompt",
            Self::ZeroMaxTokens => "max_tokens must be at least 1",
            Self::ExceedsMaxModelLen => "prompt + max_tokens exceeds max_model_len",
            Self::ExceedsKvCapacity => "request does not fit in the KV cache",
        })
    }
}

/// A token produced by a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub request_id: u64,
    /// The request's first output token (TTFT); later tokens measure ITL.
    pub first: bool,
    /// Set on the request's last token.
    pub finished: Option<Completion>,
}

/// Per-request facts reported when a request finishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// Prompt tokens reused from the prefix cache at first admission.
    pub cached_tokens: usize,
    pub preemptions: u32,
}

/// The batch chosen by [`Engine::begin_step`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepPlan {
    pub duration: f64,
    pub batch: BatchShape,
    pub scheduled_tokens: usize,
    pub scheduled_seqs: usize,
}

/// The state vLLM exports on `/metrics` (vLLM docs, "Production Metrics"), as the simulator
/// sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct EngineMetrics {
    pub num_requests_waiting: usize,
    pub num_requests_running: usize,
    /// Referenced blocks / all blocks, 0..1.
    pub kv_cache_usage: f64,
    /// Tokens looked up in the prefix cache at admission.
    pub prefix_cache_queries: u64,
    /// Tokens found there.
    pub prefix_cache_hits: u64,
    pub num_preemptions: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub request_success: u64,
    pub steps: u64,
}

pub struct Engine {
    profile: Profile,
    kv: KvCache,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// Prompt block hashes of every admitted-but-unfinished request, counted, so that a router
    /// with exact knowledge can see prefixes that will be cached once queued work runs.
    pending_prefix: HashIndex<u32>,
    metrics: EngineMetrics,
    in_step: bool,
}

impl Engine {
    pub fn new(profile: Profile) -> Self {
        let kv = KvCache::new(profile.num_gpu_blocks);
        Self {
            profile,
            kv,
            waiting: VecDeque::new(),
            running: Vec::new(),
            pending_prefix: HashIndex::default(),
            metrics: EngineMetrics::default(),
            in_step: false,
        }
    }

    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// Queues a request at the back of WAITING, or refuses it as vLLM's front end would.
    pub fn add_request(&mut self, request: Request) -> Result<(), Rejected> {
        let total = request.prompt.len() + request.max_tokens;
        if request.prompt.is_empty() {
            return Err(Rejected::EmptyPrompt);
        }
        if request.max_tokens == 0 {
            return Err(Rejected::ZeroMaxTokens);
        }
        if total > self.profile.max_model_len {
            return Err(Rejected::ExceedsMaxModelLen);
        }
        if total.div_ceil(self.profile.block_size) > self.profile.num_gpu_blocks {
            return Err(Rejected::ExceedsKvCapacity);
        }
        let expected_hit = self.prefix_hit_tokens(&request.prompt);
        for &h in request.prompt.block_hashes() {
            *self.pending_prefix.entry(h).or_insert(0) += 1;
        }
        let mut seq = Seq::new(request);
        seq.expected_hit = expected_hit;
        self.waiting.push_back(seq);
        Ok(())
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn metrics(&self) -> EngineMetrics {
        EngineMetrics {
            num_requests_waiting: self.waiting.len(),
            num_requests_running: self.running.len(),
            kv_cache_usage: self.kv.usage(),
            ..self.metrics
        }
    }

    /// Runs both halves of a step at once (for callers that do not interleave arrivals).
    pub fn step(&mut self) -> Option<(StepPlan, Vec<Event>)> {
        let plan = self.begin_step()?;
        Some((plan, self.end_step()))
    }

    /// Schedules the next batch; `None` when there is nothing to run (or a step is in flight).
    pub fn begin_step(&mut self) -> Option<StepPlan> {
        if self.in_step {
            return None;
        }
        // A pass that preempts every running request schedules nothing and (as in vLLM) admits
        // nothing; the second pass then starts from an empty RUNNING list and always admits.
        for _ in 0..2 {
            let (plan, preempted) = self.schedule();
            if plan.scheduled_seqs > 0 {
                self.in_step = true;
                self.metrics.steps += 1;
                return Some(plan);
            }
            if !preempted {
                break;
            }
        }
        None
    }

    fn schedule(&mut self) -> (StepPlan, bool) {
        let bs = self.profile.block_size;
        let mut budget = self.profile.max_num_batched_tokens;
        let mut batch = BatchShape::default();
        let mut scheduled = 0;
        let mut preempted = false;

        // RUNNING first, in order: decodes take one token, unfinished prefills a chunk.
        let mut i = 0;
        'running: while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            let n = (seq.num_tokens() - seq.num_computed).min(budget);
            let need = (seq.num_computed + n)
                .div_ceil(bs)
                .saturating_sub(seq.blocks.len());
            while !self.kv.allocate(need, &mut self.running[i].blocks) {
                // Out of blocks: preempt the newest running request (recompute later).
                let Some(victim) = self.running.pop() else {
                    break 'running;
                };
                let was_self = self.running.len() == i;
                self.preempt(victim);
                preempted = true;
                if was_self {
                    break 'running;
                }
            }
            account(&mut batch, &mut self.running[i], n);
            scheduled += 1;
            budget -= n;
            i += 1;
        }

        // Then WAITING, FCFS, unless this step preempted (vLLM skips admission then).
        while !preempted && budget > 0 && self.running.len() < self.profile.max_num_seqs {
            let Some(seq) = self.waiting.front_mut() else {
                break;
            };
            seq.extend_hashes(bs);
            // The last token is always computed so that there are logits to sample from.
            let max_hit = ((seq.num_tokens() - 1) / bs).min(seq.hashes.len());
            let hit = self.kv.cached_prefix_blocks(&seq.hashes[..max_hit]);
            let computed = hit * bs;
            let n = (seq.num_tokens() - computed).min(budget);
            let need = (computed + n).div_ceil(bs) - hit;
            // Cheap test first: a blocked head is re-probed every step.
            if need > self.kv.num_free()
                || need + self.kv.free_among_cached_prefix(&seq.hashes[..hit]) > self.kv.num_free()
            {
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            seq.blocks = self.kv.acquire_cached(&seq.hashes[..hit]);
            let allocated = self.kv.allocate(need, &mut seq.blocks);
            debug_assert!(allocated, "admission checked free blocks");
            seq.num_computed = computed;
            seq.num_registered = hit;
            seq.cached_tokens.get_or_insert(computed);
            self.metrics.prefix_cache_queries += seq.num_tokens() as u64;
            self.metrics.prefix_cache_hits += computed as u64;
            account(&mut batch, &mut seq, n);
            scheduled += 1;
            budget -= n;
            self.running.push(seq);
        }

        let plan = StepPlan {
            duration: self.profile.step_time(&batch),
            scheduled_tokens: self.profile.max_num_batched_tokens - budget,
            scheduled_seqs: scheduled,
            batch,
        };
        (plan, preempted)
    }

    fn preempt(&mut self, mut seq: Seq) {
        self.kv.free(seq.blocks.drain(..).rev());
        seq.num_computed = 0;
        seq.num_registered = 0;
        seq.scheduled = 0;
        seq.num_preemptions += 1;
        self.metrics.num_preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Applies the step in flight: computed tokens become cached blocks, caught-up requests
    /// sample a token, finished requests release their blocks.
    pub fn end_step(&mut self) -> Vec<Event> {
        if !std::mem::take(&mut self.in_step) {
            return Vec::new();
        }
        let bs = self.profile.block_size;
        let mut events = Vec::new();
        let mut kept = Vec::with_capacity(self.running.len());
        for mut seq in std::mem::take(&mut self.running) {
            if seq.scheduled == 0 {
                kept.push(seq);
                continue;
            }
            seq.num_computed += std::mem::take(&mut seq.scheduled);
            seq.extend_hashes(bs);
            let full = (seq.num_computed / bs).min(seq.hashes.len());
            for b in seq.num_registered..full {
                self.kv.register(seq.blocks[b], seq.hashes[b]);
            }
            seq.num_registered = seq.num_registered.max(full);
            if seq.num_computed < seq.num_tokens() {
                kept.push(seq); // mid-prefill
                continue;
            }
            seq.num_output += 1;
            self.metrics.generation_tokens += 1;
            let first = seq.num_output == 1;
            if first {
                self.metrics.prompt_tokens += seq.prompt.len() as u64;
            }
            if seq.num_output < seq.max_tokens {
                events.push(Event {
                    request_id: seq.id,
                    first,
                    finished: None,
                });
                kept.push(seq);
                continue;
            }
            let completion = Completion {
                cached_tokens: seq.cached_tokens.unwrap_or(0),
                preemptions: seq.num_preemptions,
            };
            events.push(Event {
                request_id: seq.id,
                first,
                finished: Some(completion),
            });
            self.kv.free(seq.blocks.drain(..).rev());
            self.forget_prefix(&seq.prompt);
            self.metrics.request_success += 1;
        }
        self.running = kept;
        events
    }

    fn forget_prefix(&mut self, prompt: &Prompt) {
        for h in prompt.block_hashes() {
            if let Some(count) = self.pending_prefix.get_mut(h) {
                *count -= 1;
                if *count == 0 {
                    self.pending_prefix.remove(h);
                }
            }
        }
    }

    /// Prompt tokens this replica would serve from cache if `prompt` arrived now, counting
    /// prefixes of queued requests that will be cached by the time it runs.
    pub fn prefix_hit_tokens(&self, prompt: &Prompt) -> usize {
        let bs = self.profile.block_size;
        let max_hit = (prompt.len().saturating_sub(1) / bs).min(prompt.block_hashes().len());
        let hit = prompt.block_hashes()[..max_hit]
            .iter()
            .take_while(|h| self.kv.is_cached(**h) || self.pending_prefix.contains_key(h))
            .count();
        hit * bs
    }

    /// Prompt tokens still to be computed by running and queued requests (queued ones net of
    /// the cache hit they could expect when they arrived).
    pub fn remaining_prefill_tokens(&self) -> usize {
        let running: usize = self
            .running
            .iter()
            .filter(|s| s.is_prefilling())
            .map(|s| s.num_tokens() - s.num_computed)
            .sum();
        let waiting: usize = self
            .waiting
            .iter()
            .map(|s| s.num_tokens().saturating_sub(s.expected_hit))
            .sum();
        running + waiting
    }

    /// Blocks the replica needs if every admitted and queued request runs to completion:
    /// what is held now plus what running requests will still grow by plus queued requests'
    /// uncached needs.
    pub fn kv_demand_blocks(&self) -> usize {
        let bs = self.profile.block_size;
        let growth: usize = self
            .running
            .iter()
            .map(|s| s.final_blocks(bs).saturating_sub(s.blocks.len()))
            .sum();
        let queued: usize = self
            .waiting
            .iter()
            .map(|s| s.final_blocks(bs).saturating_sub(s.expected_hit / bs))
            .sum();
        self.kv.num_used() + growth + queued
    }

    /// Checks the KV pool and the engine's bookkeeping against it.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv.check_invariants()?;
        let bs = self.profile.block_size;
        if self.running.len() > self.profile.max_num_seqs {
            return Err(format!("{} running > max_num_seqs", self.running.len()));
        }
        if let Some(s) = self
            .waiting
            .iter()
            .find(|s| !s.blocks.is_empty() || s.num_computed != 0)
        {
            return Err(format!(
                "waiting request {} holds blocks or computed tokens",
                s.id
            ));
        }
        let mut held: Vec<u32> = Vec::new();
        for s in &self.running {
            if s.blocks.len() < (s.num_computed + s.scheduled).div_ceil(bs) || s.num_output >= s.max_tokens {
                return Err(format!(
                    "running request {} has too few blocks or is overdue",
                    s.id
                ));
            }
            held.extend(&s.blocks);
        }
        held.sort_unstable();
        held.dedup();
        if held.len() != self.kv.num_used() {
            return Err(format!(
                "requests hold {} distinct blocks, pool says {} used",
                held.len(),
                self.kv.num_used()
            ));
        }
        Ok(())
    }
}

/// Marks `n` tokens of `seq` as scheduled and adds them to the batch shape.
fn account(batch: &mut BatchShape, seq: &mut Seq, n: usize) {
    if seq.is_prefilling() {
        batch.prefill_tokens += n;
        // Each chunk token attends, on average, to the context before the chunk plus half of it.
        batch.prefill_pairs += n as f64 * (seq.num_computed as f64 + n as f64 / 2.0);
    } else {
        batch.decode_seqs += 1;
    }
    batch.ctx_tokens += seq.num_computed + n;
    seq.scheduled = n;
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
