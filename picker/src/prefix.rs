//! Approximate prefix-cache index: which endpoints probably hold a prompt's leading KV blocks.
//!
//! The idea is the Gateway API Inference Extension's approximate prefix scorer
//! (kubernetes-sigs/gateway-api-inference-extension, `docs/proposals/0602-prefix-cache-aware-routing-proposal`):
//! the prompt is cut into fixed-size byte blocks, each block's hash chains the previous one
//! (so a hash names the whole prefix up to it), and every endpoint remembers the hashes
//! routed to it. Nothing asks the server; the index is updated when a request is picked.
//!
//! Three choices keep a pick cheap at hundreds of endpoints:
//! * each endpoint's memory is two generations of hash sets instead of an exact LRU: inserts
//!   go to the current set; when it holds half the capacity it becomes the previous one and
//!   the old previous is dropped whole. An entry lives between half and all of the capacity
//!   in inserts, refreshed whenever it is routed again: LRU-like, with no per-entry list to
//!   maintain. The keys are already hashes, so the sets do not hash them again;
//! * a request's hashes are inserted last block first, so a prefix's head is never older
//!   than its tail and the tail goes first (as in vLLM's own cache). "Has block i" then
//!   implies "has blocks 0..i", and an endpoint's match length is a binary search;
//! * only first blocks have a reverse map (hash → endpoints), so a match looks only at the
//!   endpoints that share the prompt's first block.

use std::collections::{HashMap, HashSet};

use nohash_hasher::BuildNoHashHasher;
use xxhash_rust::xxh3::xxh3_64;

/// How prompts are cut into blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixConfig {
    /// Bytes per block: about 4 bytes of English text per token, so 256 bytes ≈ 64 tokens.
    pub block_bytes: usize,
    /// Blocks hashed per prompt; the rest of a longer prompt is ignored.
    pub max_blocks: usize,
    /// Blocks remembered per endpoint.
    pub blocks_per_endpoint: usize,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        Self {
            block_bytes: 256,
            max_blocks: 128,
            blocks_per_endpoint: 8192,
        }
    }
}

/// Hash chain of a prompt's blocks, seeded by the model so that two models never share
/// cache entries. A trailing partial block is hashed too: the server's cache holds only full
/// blocks, but the next request of a conversation extends exactly this prefix.
pub fn block_hashes(model: &str, prompt: &[u8], config: &PrefixConfig) -> Vec<u64> {
    // Chained as H(previous ‖ H(block)): a seeded xxh3 over a long block would derive a new
    // secret from the seed for every block, several times the cost of hashing the block.
    let mut previous = xxh3_64(model.as_bytes());
    prompt
        .chunks(config.block_bytes.max(1))
        .take(config.max_blocks)
        .map(|block| {
            let mut link = [0; 16];
            link[..8].copy_from_slice(&previous.to_le_bytes());
            link[8..].copy_from_slice(&xxh3_64(block).to_le_bytes());
            previous = xxh3_64(&link);
            previous
        })
        .collect()
}

type HashSet64 = HashSet<u64, BuildNoHashHasher<u64>>;

#[derive(Clone)]
struct Generations {
    current: HashSet64,
    previous: HashSet64,
    /// The first-block hashes among `current` and `previous`, to unlink from the reverse
    /// map when their generation goes (a few per generation: one per distinct prompt head).
    current_firsts: Vec<u64>,
    previous_firsts: Vec<u64>,
    generation_size: usize,
}

impl Generations {
    fn new(capacity: usize) -> Self {
        Self {
            current: HashSet64::default(),
            previous: HashSet64::default(),
            current_firsts: Vec::new(),
            previous_firsts: Vec::new(),
            generation_size: (capacity / 2).max(1),
        }
    }

    fn contains(&self, hash: u64) -> bool {
        self.current.contains(&hash) || self.previous.contains(&hash)
    }

    /// Inserts `hash`; returns the first-block hashes of the generation dropped to make
    /// room, if one was.
    fn insert(&mut self, hash: u64, is_first: bool) -> Option<Vec<u64>> {
        let mut dropped = None;
        if self.current.len() >= self.generation_size && !self.current.contains(&hash) {
            // The dropped generation's table becomes the new current one: no allocation,
            // no page faults on the request path.
            std::mem::swap(&mut self.current, &mut self.previous);
            self.current.clear();
            let firsts = std::mem::take(&mut self.current_firsts);
            dropped = Some(std::mem::replace(&mut self.previous_firsts, firsts));
        }
        if self.current.insert(hash) && is_first {
            self.current_firsts.push(hash);
        }
        dropped
    }

    /// Whether it held `hash`.
    fn remove(&mut self, hash: u64) -> bool {
        let in_current = self.current.remove(&hash);
        if in_current {
            // Inserting it again pushes it again: left here, a placement learned and
            // forgotten over and over would grow the list without the generation ever turning.
            self.current_firsts.retain(|&first| first != hash);
        }
        let in_previous = self.previous.remove(&hash);
        in_current || in_previous
    }
}

pub(crate) struct PrefixIndex {
    per_endpoint: Vec<Generations>,
    /// First-block hash → endpoints that hold it.
    first_blocks: HashMap<u64, Vec<u32>, BuildNoHashHasher<u64>>,
}

impl PrefixIndex {
    pub fn new(endpoints: usize, config: &PrefixConfig) -> Self {
        Self {
            per_endpoint: (0..endpoints)
                .map(|_| Generations::new(config.blocks_per_endpoint))
                .collect(),
            first_blocks: HashMap::default(),
        }
    }

    /// Takes over what `previous` holds for the endpoints both indexes have:
    /// `endpoints[e]` is this index's endpoint `e` in `previous`, if it was there.
    pub fn inherit(&mut self, previous: &PrefixIndex, endpoints: &[Option<usize>]) {
        let mut renamed = vec![None; previous.per_endpoint.len()];
        for (to, from) in endpoints.iter().enumerate() {
            let Some((from, held)) = from.and_then(|from| Some((from, previous.per_endpoint.get(from)?)))
            else {
                continue;
            };
            let Some(generations) = self.per_endpoint.get_mut(to) else {
                continue;
            };
            // This index's capacity holds: a smaller one turns over at the next insert.
            *generations = Generations {
                generation_size: generations.generation_size,
                ..held.clone()
            };
            renamed[from] = Some(to as u32);
        }
        for (first, holders) in &previous.first_blocks {
            let kept: Vec<u32> = holders
                .iter()
                .filter_map(|&from| renamed.get(from as usize).copied().flatten())
                .collect();
            if !kept.is_empty() {
                self.first_blocks.insert(*first, kept);
            }
        }
    }

    /// Fills `matched[e]` with the number of leading blocks of `hashes` endpoint `e` holds.
    pub fn match_lengths(&self, hashes: &[u64], matched: &mut [u32]) {
        matched.fill(0);
        let Some(first) = hashes.first() else { return };
        let Some(holders) = self.first_blocks.get(first) else {
            return;
        };
        for &endpoint in holders {
            let held = &self.per_endpoint[endpoint as usize];
            // Largest n with hashes[n - 1] held; hashes[0] is, by construction.
            let (mut low, mut high) = (1, hashes.len());
            while low < high {
                let mid = (low + high).div_ceil(2);
                if held.contains(hashes[mid - 1]) {
                    low = mid;
                } else {
                    high = mid - 1;
                }
            }
            matched[endpoint as usize] = low as u32;
        }
    }

    /// Records that `endpoint` was given a request with these hashes.
    pub fn insert(&mut self, endpoint: usize, hashes: &[u64]) {
        let Some(&first) = hashes.first() else { return };
        for (position, &hash) in hashes.iter().enumerate().rev() {
            if let Some(dropped) = self.per_endpoint[endpoint].insert(hash, position == 0) {
                self.unlink_dropped(endpoint, &dropped);
            }
        }
        let holders = self.first_blocks.entry(first).or_default();
        if !holders.contains(&(endpoint as u32)) {
            holders.push(endpoint as u32);
        }
    }

    /// Removes `endpoint` from the reverse map of first blocks it no longer holds.
    fn unlink_dropped(&mut self, endpoint: usize, dropped: &[u64]) {
        let held = &self.per_endpoint[endpoint];
        for hash in dropped {
            if held.contains(*hash) {
                continue;
            }
            if let Some(holders) = self.first_blocks.get_mut(hash) {
                holders.retain(|&e| e as usize != endpoint);
                if holders.is_empty() {
                    self.first_blocks.remove(hash);
                }
            }
        }
    }

    /// Forgets the whole prefix family of `hashes` at `endpoint`, including blocks other
    /// prompts sharing the prefix brought there: used when the endpoint refused a request,
    /// where losing its affinity is the point.
    pub fn remove(&mut self, endpoint: usize, hashes: &[u64]) {
        let Some(&first) = hashes.first() else { return };
        for &hash in hashes {
            self.per_endpoint[endpoint].remove(hash);
        }
        self.unlink_dropped(endpoint, &[first]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(blocks_per_endpoint: usize) -> PrefixConfig {
        PrefixConfig {
            block_bytes: 4,
            max_blocks: 8,
            blocks_per_endpoint,
        }
    }

    #[test]
    fn hashes_chain_so_a_shared_prefix_shares_hashes_and_nothing_after_it() {
        let c = config(100);
        let a = block_hashes("m", b"aaaabbbbccccdd", &c);
        let b = block_hashes("m", b"aaaabbbbxxxxdd", &c);
        assert_eq!(a.len(), 4, "three full blocks and a partial one");
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_ne!(a[3], b[3], "the same last block after a different prefix differs");
        assert_ne!(block_hashes("other", b"aaaa", &c), block_hashes("m", b"aaaa", &c));
        assert_eq!(
            block_hashes("m", &[b'x'; 400], &c).len(),
            8,
            "capped at max_blocks"
        );
        assert!(block_hashes("m", b"", &c).is_empty());
    }

    #[test]
    fn match_lengths_counts_leading_blocks_per_endpoint() {
        let c = config(100);
        let mut index = PrefixIndex::new(3, &c);
        index.insert(0, &block_hashes("m", b"aaaabbbbcccc", &c));
        index.insert(1, &block_hashes("m", b"aaaabbbb", &c));
        index.insert(2, &block_hashes("m", b"zzzzbbbbcccc", &c));
        let mut matched = [9; 3];
        index.match_lengths(&block_hashes("m", b"aaaabbbbccccdddd", &c), &mut matched);
        assert_eq!(matched, [3, 2, 0]);
        index.match_lengths(&block_hashes("m", b"qqqq", &c), &mut matched);
        assert_eq!(matched, [0, 0, 0]);
        index.remove(0, &block_hashes("m", b"aaaabbbbcccc", &c));
        index.match_lengths(&block_hashes("m", b"aaaabbbbcccc", &c), &mut matched);
        assert_eq!(matched, [0, 2, 0]);
        let first = block_hashes("m", b"aaaa", &c)[0];
        assert_eq!(
            index.first_blocks[&first],
            [1],
            "the reverse map forgot endpoint 0"
        );
    }

    #[test]
    fn eviction_takes_the_tail_first_and_unlinks_evicted_first_blocks() {
        let c = config(4);
        let mut index = PrefixIndex::new(1, &c);
        let old = block_hashes("m", b"aaaabbbbcccc", &c);
        index.insert(0, &old);
        // Generations of two blocks: the old prompt's tail went into the first, its head
        // opened the second; three new blocks drop the first.
        index.insert(0, &block_hashes("m", b"xxxxyyyyzzzz", &c));
        let mut matched = [0];
        index.match_lengths(&old, &mut matched);
        assert_eq!(matched, [1], "the head survives, the tail went");
        // Enough new blocks to evict the head too: the reverse map must forget it.
        index.insert(0, &block_hashes("m", b"ppppqqqqrrrr", &c));
        index.match_lengths(&old, &mut matched);
        assert_eq!(matched, [0]);
        assert!(!index.first_blocks.contains_key(&old[0]));
    }

    #[test]
    fn learning_and_forgetting_a_prompt_over_and_over_holds_its_first_block_once() {
        let c = config(100);
        let mut index = PrefixIndex::new(1, &c);
        let prompt = block_hashes("m", b"aaaabbbb", &c);
        for _ in 0..1000 {
            index.insert(0, &prompt);
            index.remove(0, &prompt);
        }
        index.insert(0, &prompt);
        assert_eq!(index.per_endpoint[0].current_firsts, [prompt[0]]);
    }
}
