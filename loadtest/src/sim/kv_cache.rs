//! KV block pool with vLLM-style automatic prefix caching.
//!
//! Every block is in exactly one of three states:
//! * **in use** (`ref_cnt > 0`), possibly shared by several requests with the same prefix;
//! * **plain free**: no content worth keeping (never filled, or evicted);
//! * **cached free**: `ref_cnt == 0` but it holds a full block whose hash is registered, so a
//!   later request with the same prefix can reuse it. These sit in an LRU list and are evicted
//!   (oldest first) only when no plain free block is left.
//!
//! A full block is identified by a hash chain over token ids (`hash(parent, tokens)`), so a hit
//! on block *i* implies the whole prefix up to *i* matches, as in vLLM's `BlockHash`.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

pub type BlockId = u32;

/// Marks "no neighbour" in the intrusive LRU list.
const NIL: u32 = u32::MAX;

/// Hash of a full block given its parent's hash (0 for the first block) and its token ids.
pub fn hash_block(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = mix(parent ^ 0x9e37_79b9_7f4a_7c15);
    for &t in tokens {
        h = mix(h ^ u64::from(t));
    }
    h
}

/// The hash chain of every full block of `tokens`.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut parent = 0;
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            parent = hash_block(parent, block);
            parent
        })
        .collect()
}

/// splitmix64's finaliser: a cheap, well-distributed, platform-independent mixer.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Block hashes are already uniformly mixed, so the map can use them as they are (SipHash per
/// lookup would dominate the simulator's run time in debug builds).
#[derive(Default)]
pub struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

pub type HashIndex<V> = HashMap<u64, V, BuildHasherDefault<IdentityHasher>>;

#[derive(Debug, Clone)]
struct Block {
    ref_cnt: u32,
    hash: Option<u64>,
    /// LRU neighbours; meaningful only while the block is cached free.
    prev: u32,
    next: u32,
}

/// The block pool of one replica.
pub struct KvCache {
    blocks: Vec<Block>,
    plain_free: Vec<BlockId>,
    lru_head: u32,
    lru_tail: u32,
    lru_len: usize,
    cached: HashIndex<BlockId>,
    num_used: usize,
}

impl KvCache {
    pub fn new(num_blocks: usize) -> Self {
        let blocks = vec![
            Block {
                ref_cnt: 0,
                hash: None,
                prev: NIL,
                next: NIL
            };
            num_blocks
        ];
        // Reversed so that `pop` hands out low ids first, which keeps test output readable.
        let plain_free = (0..num_blocks as BlockId).rev().collect();
        Self {
            blocks,
            plain_free,
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            cached: HashIndex::default(),
            num_used: 0,
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn num_used(&self) -> usize {
        self.num_used
    }

    /// Blocks an allocation can obtain: plain free plus evictable cached ones.
    pub fn num_free(&self) -> usize {
        self.plain_free.len() + self.lru_len
    }

    /// `vllm:kv_cache_usage_perc`: blocks referenced by a request / all blocks.
    pub fn usage(&self) -> f64 {
        self.num_used as f64 / self.blocks.len() as f64
    }

    pub fn is_cached(&self, hash: u64) -> bool {
        self.cached.contains_key(&hash)
    }

    /// Number of leading `hashes` whose blocks are cached (in use or free).
    pub fn cached_prefix_blocks(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.cached.contains_key(h)).count()
    }

    /// How many of the first `n` hashes (all cached) sit in the free LRU: reusing them takes
    /// them out of the free pool, so admission must count them against free capacity.
    pub fn free_among_cached_prefix(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .filter(|h| {
                self.cached
                    .get(h)
                    .is_some_and(|&b| self.blocks[b as usize].ref_cnt == 0)
            })
            .count()
    }

    /// Takes a reference on the cached blocks of `hashes` (all must be cached) and returns them.
    pub fn acquire_cached(&mut self, hashes: &[u64]) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(hashes.len());
        for h in hashes {
            let Some(&id) = self.cached.get(h) else {
                debug_assert!(false, "acquire_cached on an uncached hash");
                break;
            };
            if self.blocks[id as usize].ref_cnt == 0 {
                self.lru_remove(id);
                self.num_used += 1;
            }
            self.blocks[id as usize].ref_cnt += 1;
            out.push(id);
        }
        out
    }

    /// Appends `n` fresh blocks to `out`, evicting least-recently-used cached blocks once no
    /// plain free block remains. All or nothing: returns false and changes nothing if fewer
    /// than `n` blocks are free.
    pub fn allocate(&mut self, n: usize, out: &mut Vec<BlockId>) -> bool {
        if n > self.num_free() {
            return false;
        }
        for _ in 0..n {
            let id = match self.plain_free.pop() {
                Some(id) => id,
                None => self.evict_lru(),
            };
            self.blocks[id as usize].ref_cnt = 1;
            out.push(id);
        }
        self.num_used += n;
        true
    }

    /// Drops one reference on each block. Blocks must be given in eviction order: vLLM frees a
    /// request's blocks tail first so that its prefix, the most reusable part, is evicted last.
    pub fn free(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for id in blocks {
            let block = &mut self.blocks[id as usize];
            debug_assert!(block.ref_cnt > 0, "double free of block {id}");
            block.ref_cnt -= 1;
            if block.ref_cnt == 0 {
                self.num_used -= 1;
                if block.hash.is_some() {
                    self.lru_push_back(id);
                } else {
                    self.plain_free.push(id);
                }
            }
        }
    }

    /// Registers a freshly computed full block under `hash`. If another block already holds
    /// the same content (two requests prefilled it concurrently), the first one stays the
    /// canonical copy and this block stays unhashed, as in vLLM.
    pub fn register(&mut self, id: BlockId, hash: u64) {
        debug_assert!(self.blocks[id as usize].ref_cnt > 0);
        if self.blocks[id as usize].hash.is_none() && !self.cached.contains_key(&hash) {
            self.cached.insert(hash, id);
            self.blocks[id as usize].hash = Some(hash);
        }
    }

    fn evict_lru(&mut self) -> BlockId {
        let id = self.lru_head;
        self.lru_remove(id);
        if let Some(hash) = self.blocks[id as usize].hash.take() {
            self.cached.remove(&hash);
        }
        id
    }

    fn lru_push_back(&mut self, id: BlockId) {
        let tail = self.lru_tail;
        {
            let block = &mut self.blocks[id as usize];
            block.prev = tail;
            block.next = NIL;
        }
        if tail == NIL {
            self.lru_head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.lru_tail = id;
        self.lru_len += 1;
    }

    fn lru_remove(&mut self, id: BlockId) {
        let (prev, next) = {
            let block = &self.blocks[id as usize];
            (block.prev, block.next)
        };
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let block = &mut self.blocks[id as usize];
        block.prev = NIL;
        block.next = NIL;
        self.lru_len -= 1;
    }

    /// Checks every structural invariant; `Err` describes the first violation. O(blocks).
    pub fn check_invariants(&self) -> Result<(), String> {
        let used = self.blocks.iter().filter(|b| b.ref_cnt > 0).count();
        if used != self.num_used {
            return Err(format!("num_used {} but {used} blocks referenced", self.num_used));
        }
        if used + self.num_free() != self.blocks.len() {
            return Err(format!(
                "over-allocation: {used} used + {} plain + {} cached != {} blocks",
                self.plain_free.len(),
                self.lru_len,
                self.blocks.len()
            ));
        }
        for &id in &self.plain_free {
            let b = &self.blocks[id as usize];
            if b.ref_cnt != 0 || b.hash.is_some() {
                return Err(format!("plain free block {id} is referenced or hashed"));
            }
        }
        let (mut id, mut walked, mut prev) = (self.lru_head, 0, NIL);
        while id != NIL {
            let b = &self.blocks[id as usize];
            if b.ref_cnt != 0 || b.hash.is_none() || b.prev != prev {
                return Err(format!(
                    "cached free block {id} is referenced, unhashed or mislinked"
                ));
            }
            walked += 1;
            if walked > self.lru_len {
                return Err("LRU list longer than its length (cycle?)".into());
            }
            prev = id;
            id = b.next;
        }
        if walked != self.lru_len || prev != self.lru_tail {
            return Err(format!(
                "LRU walk found {walked} blocks, length says {}",
                self.lru_len
            ));
        }
        for (hash, &id) in &self.cached {
            if self.blocks[id as usize].hash != Some(*hash) {
                return Err(format!(
                    "index maps {hash:x} to block {id} which holds another hash"
                ));
            }
        }
        let hashed = self.blocks.iter().filter(|b| b.hash.is_some()).count();
        if hashed != self.cached.len() {
            return Err(format!(
                "{hashed} hashed blocks but {} index entries",
                self.cached.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;

    #[test]
    fn hash_chain_identifies_prefixes() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 999;
        let (ha, hb) = (block_hashes(&a, 16), block_hashes(&b, 16));
        assert_eq!(ha.len(), 4);
        assert_eq!(ha[..2], hb[..2]);
        assert_ne!(ha[2], hb[2]);
        // Same block content under a different parent is a different block.
        assert_ne!(ha[3], hb[3]);
        assert_eq!(block_hashes(&a[..63], 16).len(), 3);
    }

    #[test]
    fn freed_hashed_blocks_stay_cached_and_are_evicted_lru_first() {
        let mut kv = KvCache::new(4);
        let mut a = Vec::new();
        assert!(kv.allocate(2, &mut a));
        kv.register(a[0], 10);
        kv.register(a[1], 11);
        let mut b = Vec::new();
        assert!(kv.allocate(2, &mut b));
        kv.register(b[0], 20);
        kv.free(a.iter().rev().copied());
        kv.free(b.iter().rev().copied());
        kv.check_invariants().unwrap();
        assert_eq!((kv.num_used(), kv.num_free()), (0, 4));
        assert_eq!(kv.cached_prefix_blocks(&[10, 11, 12]), 2);
        // One plain block (b[1]) is used before any cached block is evicted; then LRU order:
        // a[1] (freed first) goes before a[0].
        let mut c = Vec::new();
        assert!(kv.allocate(2, &mut c));
        assert_eq!(c, vec![b[1], a[1]]);
        assert!(kv.is_cached(10) && !kv.is_cached(11) && kv.is_cached(20));
        // A hit takes the block out of the free pool.
        assert_eq!(kv.free_among_cached_prefix(&[10]), 1);
        assert_eq!(kv.acquire_cached(&[10]), vec![a[0]]);
        assert_eq!((kv.num_used(), kv.num_free()), (3, 1));
        assert!(!kv.allocate(2, &mut c), "all-or-nothing");
        assert_eq!(c.len(), 2);
        kv.check_invariants().unwrap();
    }

    #[test]
    fn duplicate_content_keeps_the_first_copy() {
        let mut kv = KvCache::new(2);
        let mut ids = Vec::new();
        assert!(kv.allocate(2, &mut ids));
        kv.register(ids[0], 7);
        kv.register(ids[1], 7);
        kv.free(ids.clone());
        assert_eq!(kv.num_free(), 2);
        assert_eq!(kv.acquire_cached(&[7]), vec![ids[0]]);
        kv.check_invariants().unwrap();
    }

    #[test]
    fn random_operations_never_over_allocate() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut kv = KvCache::new(64);
        let mut owners: Vec<Vec<BlockId>> = Vec::new();
        for _ in 0..5_000 {
            match rng.random_range(0..4) {
                0 | 1 => {
                    let mut ids = Vec::new();
                    let hashes: Vec<u64> = (0..rng.random_range(0..4))
                        .map(|_| rng.random_range(0..40))
                        .collect();
                    let hit = kv.cached_prefix_blocks(&hashes);
                    let need = rng.random_range(0..10);
                    if need + kv.free_among_cached_prefix(&hashes[..hit]) <= kv.num_free() {
                        ids.extend(kv.acquire_cached(&hashes[..hit]));
                        assert!(kv.allocate(need, &mut ids));
                        for (i, &id) in ids.iter().enumerate().skip(hit) {
                            kv.register(id, rng.random_range(0..40) + i as u64);
                        }
                        owners.push(ids);
                    } else {
                        assert!(!kv.allocate(need + kv.num_free() + 1, &mut ids));
                    }
                }
                2 if !owners.is_empty() => {
                    let victim = owners.swap_remove(rng.random_range(0..owners.len()));
                    kv.free(victim.into_iter().rev());
                }
                _ => {}
            }
            kv.check_invariants().unwrap();
            assert!(kv.num_used() <= kv.num_blocks());
            assert_eq!(kv.num_used(), {
                let mut all: Vec<_> = owners.iter().flatten().copied().collect();
                all.sort_unstable();
                all.dedup();
                all.len()
            });
        }
    }
}
