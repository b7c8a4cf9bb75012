//! List pages kept for reuse, per server, page and — when the server says its lists differ
//! per caller (`cacheScope: "private"`) — per caller: a 2026-07-28 server's `ttlMs` and
//! `cacheScope` decide (<https://modelcontextprotocol.io/specification/2026-07-28/server/utilities/caching>),
//! and a server that says nothing is reused for its `listTtl`, if set. Filtering by rules
//! runs on each answer, per caller, after the cache. A config change starts an empty cache,
//! but not a forgetful one: a server's `list_changed` counts against every version's pages
//! ([`ListChanges`]), also those asked for before it came.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::lists::Page;
use super::pins::ServerKey;

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

/// The lists a `list_changed` notification concerns, by family: tools, prompts, resources
/// (with their templates).
fn family(method: &str) -> Option<usize> {
    match method {
        "tools/list" => Some(0),
        "prompts/list" => Some(1),
        "resources/list" | "resources/templates/list" => Some(2),
        _ => None,
    }
}

/// How many times each server said each family of its lists changed. It outlives config
/// versions (a server's stream does): a page is reused only while its server's count is the
/// one read before the page was asked for, so a change that came while the page was on its
/// way, or on the stream of an older version, is not missed.
#[derive(Default)]
pub(crate) struct ListChanges {
    counts: Mutex<HashMap<ServerKey, [u64; 3]>>,
}

impl ListChanges {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ServerKey, [u64; 3]>> {
        self.counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn count(&self, server: &ServerKey, method: &str) -> u64 {
        family(method)
            .and_then(|family| self.lock().get(server).map(|counts| counts[family]))
            .unwrap_or(0)
    }

    fn changed(&self, server: &ServerKey, methods: &[&str]) {
        let mut counts = self.lock();
        let counts = counts.entry(server.clone()).or_default();
        for family in methods.iter().filter_map(|method| family(method)) {
            counts[family] += 1;
        }
    }

    /// Forgets the servers the config no longer has.
    pub(crate) fn retain(&self, servers: &[ServerKey]) {
        self.lock().retain(|server, _| servers.contains(server));
    }
}

/// One page of one server's list.
#[derive(Debug, Clone, Copy)]
pub(super) struct PageRef<'a> {
    pub(super) server: usize,
    pub(super) method: &'a str,
    pub(super) cursor: Option<&'a str>,
}

impl PageRef<'_> {
    fn key(&self, caller: u64) -> Key {
        Key {
            server: self.server,
            method: self.method.to_string(),
            cursor: self.cursor.map(str::to_string),
            caller,
        }
    }
}

/// Clones share their pages: a server's stream can make them stale ([`ListCache::forget`]).
#[derive(Clone)]
pub(super) struct ListCache {
    pages: Arc<Mutex<Pages>>,
    hasher: std::hash::RandomState,
    changes: Arc<ListChanges>,
    /// Index to key, parallel to the target's servers.
    servers: Arc<[ServerKey]>,
}

#[derive(Default)]
struct Pages {
    /// Until when, and at which count of its server's changes.
    by_key: HashMap<Key, (Instant, u64, Arc<Page>)>,
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
    pub(super) fn new(changes: Arc<ListChanges>, servers: Vec<ServerKey>) -> ListCache {
        ListCache {
            pages: Arc::default(),
            hasher: std::hash::RandomState::default(),
            changes,
            servers: servers.into(),
        }
    }

    /// What server `server` said of its list `method` so far: read before asking for a page,
    /// given to [`ListCache::put`] with it.
    pub(super) fn changes(&self, server: usize, method: &str) -> u64 {
        self.changes.count(&self.servers[server], method)
    }

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

    pub(super) fn get(&self, page: PageRef<'_>, caller: u64) -> Option<Arc<Page>> {
        let changes = self.changes(page.server, page.method);
        let pages = self.lock();
        let now = Instant::now();
        [0, caller].into_iter().find_map(|caller| {
            pages
                .by_key
                .get(&page.key(caller))
                .filter(|(until, seen, _)| *until > now && *seen == changes)
                .map(|(_, _, page)| page.clone())
        })
    }

    /// Drops every page of `server`'s lists `methods`, for every caller and in every config
    /// version: the server said they changed.
    pub(super) fn forget(&self, server: usize, methods: &[&str]) {
        self.changes.changed(&self.servers[server], methods);
        let mut pages = self.lock();
        pages
            .by_key
            .retain(|key, _| key.server != server || !methods.contains(&key.method.as_str()));
        pages.bytes = pages.by_key.values().map(|(_, _, page)| page.bytes()).sum();
    }

    /// Keeps `page` for reuse unless its server's list changed since `changes`
    /// ([`ListCache::changes`]) was read.
    pub(super) fn put(&self, at: PageRef<'_>, caller: u64, changes: u64, reuse: Reuse, page: &Arc<Page>) {
        let size = page.bytes();
        if size > MAX_BYTES || changes != self.changes(at.server, at.method) {
            return;
        }
        let now = Instant::now();
        let mut pages = self.lock();
        let full = |pages: &Pages| pages.by_key.len() >= MAX_PAGES || pages.bytes + size > MAX_BYTES;
        if full(&pages) {
            pages.by_key.retain(|_, (until, _, _)| *until > now);
            pages.bytes = pages.by_key.values().map(|(_, _, page)| page.bytes()).sum();
            if full(&pages) {
                pages.by_key.clear();
                pages.bytes = 0;
            }
        }
        let key = at.key(if reuse.private { caller } else { 0 });
        if let Some((_, _, replaced)) = pages
            .by_key
            .insert(key, (now + reuse.ttl, changes, Arc::clone(page)))
        {
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

    /// A cache of two servers, `math` and `web`.
    fn two_servers(changes: &Arc<ListChanges>) -> ListCache {
        let key = |server: &str| -> ServerKey {
            (
                Arc::from("McpBackend/tools"),
                Arc::from(server),
                Arc::from(format!("http://127.0.0.1:9000/{server}")),
            )
        };
        ListCache::new(changes.clone(), vec![key("math"), key("web")])
    }

    fn tools(server: usize) -> PageRef<'static> {
        PageRef {
            server,
            method: "tools/list",
            cursor: None,
        }
    }

    const MINUTE: Reuse = Reuse {
        ttl: Duration::from_secs(60),
        private: false,
    };

    #[test]
    fn private_pages_are_kept_per_caller() {
        let cache = two_servers(&Arc::default());
        let (alice, bob) = (cache.caller("alice"), cache.caller("bob"));
        let reuse = Reuse {
            private: true,
            ..MINUTE
        };
        cache.put(tools(0), alice, 0, reuse, &page("a"));
        assert_eq!(cache.get(tools(0), alice), Some(page("a")));
        assert_eq!(cache.get(tools(0), bob), None);
        let next = PageRef {
            cursor: Some("next"),
            ..tools(0)
        };
        assert_eq!(cache.get(next, alice), None);
        cache.put(tools(1), alice, 0, MINUTE, &page("b"));
        assert_eq!(cache.get(tools(1), bob), Some(page("b")));
    }

    #[test]
    fn expired_pages_are_not_served() {
        let cache = two_servers(&Arc::default());
        let reuse = Reuse {
            ttl: Duration::from_millis(1),
            ..MINUTE
        };
        cache.put(tools(0), 1, 0, reuse, &page("a"));
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(cache.get(tools(0), 1), None);
    }

    #[test]
    fn a_change_reaches_every_version_and_pages_on_their_way() {
        let changes = Arc::new(ListChanges::default());
        let (old, new) = (two_servers(&changes), two_servers(&changes));
        new.put(tools(0), 1, 0, MINUTE, &page("a"));
        new.put(tools(1), 1, 0, MINUTE, &page("b"));
        let asked_at = new.changes(0, "tools/list");
        // The stream of an older version's session says math's tools changed.
        old.forget(0, &["tools/list"]);
        assert_eq!(new.get(tools(0), 1), None, "the newer version asks again");
        assert_eq!(new.get(tools(1), 1), Some(page("b")), "other servers' are kept");
        new.put(tools(0), 1, asked_at, MINUTE, &page("a"));
        assert_eq!(
            new.get(tools(0), 1),
            None,
            "a page asked for before the change is not kept"
        );
        new.put(tools(0), 1, new.changes(0, "tools/list"), MINUTE, &page("a2"));
        assert_eq!(new.get(tools(0), 1), Some(page("a2")));
    }
}
