//! Requests as the engine sees them, and their per-request scheduler state.

use std::sync::Arc;

use super::kv_cache::{block_hashes, hash_block, BlockId};
use super::tokenizer::VOCAB_SIZE;

/// A prompt's token ids with the hash chain of its full blocks, computed once and shared by
/// every request that sends the same prompt.
#[derive(Debug)]
pub struct Prompt {
    tokens: Vec<u32>,
    block_hashes: Vec<u64>,
}

impl Prompt {
    pub fn new(tokens: Vec<u32>, block_size: usize) -> Self {
        let block_hashes = block_hashes(&tokens, block_size);
        Self { tokens, block_hashes }
    }

    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Hash chain of the full blocks of the prompt.
    pub fn block_hashes(&self) -> &[u64] {
        &self.block_hashes
    }
}

/// One completion request. `max_tokens` has `ignore_eos` semantics: exactly that many tokens
/// are generated.
#[derive(Debug, Clone)]
pub struct Request {
    pub id: u64,
    pub prompt: Arc<Prompt>,
    pub max_tokens: usize,
}

/// Scheduler state of a request inside one engine (vLLM's `Request`).
pub(super) struct Seq {
    pub id: u64,
    pub prompt: Arc<Prompt>,
    pub max_tokens: usize,
    pub num_output: usize,
    /// Tokens whose KV is computed; chases `num_tokens()`.
    pub num_computed: usize,
    pub blocks: Vec<BlockId>,
    /// Hash chain over prompt + output tokens (full blocks only), grown as tokens appear.
    pub hashes: Vec<u64>,
    /// Leading blocks already offered to the prefix cache.
    pub num_registered: usize,
    /// Tokens reused from the prefix cache at first admission.
    pub cached_tokens: Option<usize>,
    /// Cache hit the request could expect when it was queued; lets routers estimate queued
    /// work without a cache lookup per queued request.
    pub expected_hit: usize,
    pub num_preemptions: u32,
    /// Tokens scheduled in the step in flight (0 when not scheduled).
    pub scheduled: usize,
}

impl Seq {
    pub fn new(request: Request) -> Self {
        let hashes = request.prompt.block_hashes().to_vec();
        Self {
            id: request.id,
            prompt: request.prompt,
            max_tokens: request.max_tokens,
            num_output: 0,
            num_computed: 0,
            blocks: Vec::new(),
            hashes,
            num_registered: 0,
            cached_tokens: None,
            expected_hit: 0,
            num_preemptions: 0,
            scheduled: 0,
        }
    }

    /// Prompt plus generated tokens.
    pub fn num_tokens(&self) -> usize {
        self.prompt.len() + self.num_output
    }

    /// Still computing its prompt (or recomputing after preemption) rather than decoding.
    pub fn is_prefilling(&self) -> bool {
        self.num_tokens() - self.num_computed > 1 || self.num_output == 0
    }

    /// Peak blocks the request needs (prompt + every output token).
    pub fn final_blocks(&self, block_size: usize) -> usize {
        (self.prompt.len() + self.max_tokens).div_ceil(block_size)
    }

    /// Generated tokens are synthetic but deterministic per request, so that blocks filled
    /// during decode get stable hashes (a preempted request can hit its own cached output).
    fn token_at(&self, pos: usize) -> u32 {
        match self.prompt.tokens().get(pos) {
            Some(&t) => t,
            None => {
                let k = (self.id << 20) ^ (pos as u64);
                (hash_block(k, &[]) % u64::from(VOCAB_SIZE)) as u32
            }
        }
    }

    /// Extends the hash chain to every full block of the known tokens.
    pub fn extend_hashes(&mut self, block_size: usize) {
        let full = self.num_tokens() / block_size;
        while self.hashes.len() < full {
            let i = self.hashes.len();
            let parent = if i == 0 { 0 } else { self.hashes[i - 1] };
            let tokens: Vec<u32> = (i * block_size..(i + 1) * block_size)
                .map(|p| self.token_at(p))
                .collect();
            self.hashes.push(hash_block(parent, &tokens));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_blocks_extend_the_prompt_chain() {
        let prompt = Arc::new(Prompt::new((0..40).collect(), 16));
        let mut seq = Seq::new(Request {
            id: 3,
            prompt: prompt.clone(),
            max_tokens: 30,
        });
        assert_eq!(seq.hashes.len(), 2);
        seq.num_output = 8;
        seq.extend_hashes(16);
        assert_eq!(seq.hashes.len(), 3);
        assert_eq!(seq.hashes[..2], prompt.block_hashes()[..]);
        // Deterministic: a second copy of the request derives the same output hashes.
        let mut again = Seq::new(Request {
            id: 3,
            prompt,
            max_tokens: 30,
        });
        again.num_output = 8;
        again.extend_hashes(16);
        assert_eq!(again.hashes, seq.hashes);
        assert_eq!(seq.final_blocks(16), 5);
    }
}
