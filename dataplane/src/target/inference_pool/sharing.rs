//! A pool's side of prefix-placement sharing (`crate::placements` carries it): this proxy's
//! picks go out to the other proxies, and theirs are taught to this pool's picker.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use portcullis_picker::Picker;
use portcullis_proto::v1::Placement;

use crate::placements::Outbox;

/// What a placement names: the pool and its endpoints as the spec writes them, the same in
/// every proxy.
pub(super) struct Sharing {
    outbox: Outbox,
    pool: String,
    endpoints: Vec<String>,
    /// Prompt blocks this proxy hashes; a placement claiming more is cut to this.
    max_blocks: usize,
    /// Placements posted, and learned from other proxies (for `/signals`).
    posted: AtomicU64,
    learned: AtomicU64,
}

impl Sharing {
    pub(super) fn new(outbox: Outbox, pool: &str, endpoints: &[String], max_blocks: usize) -> Sharing {
        Sharing {
            outbox,
            pool: pool.to_string(),
            endpoints: endpoints.to_vec(),
            max_blocks,
            posted: AtomicU64::new(0),
            learned: AtomicU64::new(0),
        }
    }

    /// Posts that `endpoint` got a prompt with `prompt_hashes`, or, `withdrawn`, that it did
    /// not after all.
    pub(super) fn post(&self, endpoint: usize, prompt_hashes: &[u64], withdrawn: bool) {
        let Some(address) = self.endpoints.get(endpoint) else {
            return;
        };
        let placement = Placement {
            pool: self.pool.clone(),
            endpoint: address.clone(),
            prompt_hashes: prompt_hashes.to_vec(),
            withdrawn,
        };
        if self.outbox.post(placement) {
            self.posted.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Teaches `picker` what other proxies placed (or withdrew) on this pool's endpoints;
    /// placements naming an endpoint the pool does not have are skipped.
    pub(super) fn learn(
        &self,
        picker: &mut Picker,
        by_address: &HashMap<String, usize>,
        placements: &[&Placement],
    ) {
        for placement in placements {
            let Some(&index) = by_address.get(&placement.endpoint) else {
                continue;
            };
            // No more than this proxy would hash itself, whatever the sender claims.
            let hashes = &placement.prompt_hashes;
            let hashes = &hashes[..hashes.len().min(self.max_blocks)];
            if placement.withdrawn {
                picker.forget(index, hashes);
            } else {
                picker.learn(index, hashes);
                self.learned.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The counts `/signals` shows.
    pub(super) fn report(&self) -> serde_json::Value {
        serde_json::json!({
            "posted": self.posted.load(Ordering::Relaxed),
            "learned": self.learned.load(Ordering::Relaxed),
        })
    }
}
