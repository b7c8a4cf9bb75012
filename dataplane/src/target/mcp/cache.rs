//! List pages kept for reuse, per server, page and — when the server says its lists differ
//! per caller (`cacheScope: "private"`) — per caller: a 2026-07-28 server's `ttlMs` and
//! `cacheScope` decide (<https://modelcontextprotocol.io/specification/2026-07-28/server/utilities/caching>),
//! and a server that says nothing is reused for its `listTtl`, if set. Filtering by rules
//! runs on each answer, per caller, after the cache. A config change starts an empty cache.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::lists::Page;

/// Pages and bytes kept per McpBackend; when either is reached, expired pages go, and if
/// that is not enough, all of them.
const MAX_PAGES: usize = 4096;
const MAX_BYTES: usize = 64 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    server: usize,
    method: String,
    cursor: Option<String>,
    /// 0 for a page every caller may see.
    caller: u64,
}

/// Clones share their pages: a server's stream can make them stale ([`ListCache::forget`]).
#[derive(Default, Clone)]
pub(super) struct ListCache {
    pages: Arc<Mutex<Pages>>,
    hasher: std::hash::RandomState,
}

#[derive(Default)]
struct Pages {
    by_key: HashMap<Key, (Instant, Arc<Page>)>,
    bytes: usize,
}

/// How long a page may be reused, and by whom.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Reuse {
    pub(super) ttl: Duration,
    pub(super) private: bool,
}

impl Reuse {
    /// The server's own hints, else the configured TTL for everyone.
    pub(super) fn of(page: &Value, configured: Option<Duration>) -> Option<Reuse> {
        let reuse = match page.get("ttlMs").and_then(Value::as_u64) {
            Some(millis) => Reuse {
                ttl: Duration::from_millis(millis),
                private: page.get("cacheScope").and_then(Value::as_str) != Some("public"),
            },
            None => Reuse {
                ttl: configured?,
                private: false,
            },
        };
        (!reuse.ttl.is_zero()).then_some(reuse)
    }
}

impl ListCache {
    /// A caller's key: its credentials when it sends some, else what identifies its session.
    pub(super) fn caller(&self, identity: impl Hash) -> u64 {
        // Never 0, which marks pages for everyone.
        self.hasher.hash_one(identity).max(1)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pages> {
        self.pages
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn get(
        &self,
        server: usize,
        method: &str,
        cursor: Option<&str>,
        caller: u64,
    ) -> Option<Arc<Page>> {
        let pages = self.lock();
        let now = Instant::now();
        [0, caller].into_iter().find_map(|caller| {
            let key = Key {
                server,
                method: method.to_string(),
                cursor: cursor.map(str::to_string),
                caller,
            };
            pages
                .by_key
                .get(&key)
                .filter(|(until, _)| *until > now)
                .map(|(_, page)| page.clone())
        })
    }

    /// Drops every page of `server`'s lists `methods`, for every caller: the server said
    /// they changed.
    pub(super) fn forget(&self, server: usize, methods: &[&str]) {
        let mut pages = self.lock();
        pages
            .by_key
            .retain(|key, _| key.server != server || !methods.contains(&key.method.as_str()));
        pages.bytes = pages.by_key.values().map(|(_, page)| page.bytes()).sum();
    }

    pub(super) fn put(
        &self,
        server: usize,
        method: &str,
        cursor: Option<&str>,
        caller: u64,
        reuse: Reuse,
        page: &Arc<Page>,
    ) {
        let size = page.bytes();
        if size > MAX_BYTES {
            return;
        }
        let now = Instant::now();
        let mut pages = self.lock();
        let full = |pages: &Pages| pages.by_key.len() >= MAX_PAGES || pages.bytes + size > MAX_BYTES;
        if full(&pages) {
            pages.by_key.retain(|_, (until, _)| *until > now);
            pages.bytes = pages.by_key.values().map(|(_, page)| page.bytes()).sum();
            if full(&pages) {
                pages.by_key.clear();
                pages.bytes = 0;
            }
        }
        let key = Key {
            server,
            method: method.to_string(),
            cursor: cursor.map(str::to_string),
            caller: if reuse.private { caller } else { 0 },
        };
        if let Some((_, replaced)) = pages.by_key.insert(key, (now + reuse.ttl, Arc::clone(page))) {
            pages.bytes -= replaced.bytes();
        }
        pages.bytes += size;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_server_decides_else_the_config() {
        let public = json!({"tools": [], "ttlMs": 5000, "cacheScope": "public"});
        assert_eq!(
            Reuse::of(&public, None),
            Some(Reuse {
                ttl: Duration::from_secs(5),
                private: false
            })
        );
        let private = json!({"tools": [], "ttlMs": 5000, "cacheScope": "private"});
        assert!(
            Reuse::of(&private, Some(Duration::from_secs(60)))
                .unwrap()
                .private
        );
        assert_eq!(
            Reuse::of(&json!({"tools": [], "ttlMs": 0}), Some(Duration::from_secs(60))),
            None
        );
        assert_eq!(Reuse::of(&json!({"tools": []}), None), None);
        assert_eq!(
            Reuse::of(&json!({"tools": []}), Some(Duration::from_secs(60))).map(|r| r.private),
            Some(false)
        );
    }

    fn page(name: &str) -> Arc<Page> {
        Arc::new(Page::of_names(&[name]))
    }

    #[test]
    fn private_pages_are_kept_per_caller() {
        let cache = ListCache::default();
        let (alice, bob) = (cache.caller("alice"), cache.caller("bob"));
        let reuse = Reuse {
            ttl: Duration::from_secs(60),
            private: true,
        };
        cache.put(0, "tools/list", None, alice, reuse, &page("a"));
        assert_eq!(cache.get(0, "tools/list", None, alice), Some(page("a")));
        assert_eq!(cache.get(0, "tools/list", None, bob), None);
        assert_eq!(cache.get(0, "tools/list", Some("next"), alice), None);
        let shared = Reuse {
            private: false,
            ..reuse
        };
        cache.put(1, "tools/list", None, alice, shared, &page("b"));
        assert_eq!(cache.get(1, "tools/list", None, bob), Some(page("b")));
    }

    #[test]
    fn expired_pages_are_not_served() {
        let cache = ListCache::default();
        let reuse = Reuse {
            ttl: Duration::from_millis(1),
            private: false,
        };
        cache.put(0, "tools/list", None, 1, reuse, &page("a"));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(cache.get(0, "tools/list", None, 1), None);
    }
}
