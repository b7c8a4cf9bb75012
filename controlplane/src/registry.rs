//! What each subscribed proxy holds, as seen by this control-plane node. In memory only:
//! proxies re-announce themselves when they reconnect.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use portcullis_config::ShardSelector;
use portcullis_proto::v1::{Findings, ProxyStatus};

#[derive(Debug, Clone)]
struct Entry {
    status: ProxyStatus,
    /// Identifies the live stream, so an old stream ending does not mark a reconnected proxy gone.
    session: u64,
    /// Last version the proxy rejected; only an ACK of it or a later version makes it healthy
    /// again (a proxy may apply a version it first rejected once, e.g., a port is freed).
    nacked_version: u64,
    /// The proxy process behind the id (`Hello.instance`).
    instance: String,
}

#[derive(Debug, Clone)]
pub struct ProxyRegistry {
    inner: Arc<Mutex<Inner>>,
    /// Disconnected proxies are forgotten this long after they were last seen.
    forget_after: Duration,
}

/// Drift entries kept per proxy.
const MAX_TOOL_DRIFT: usize = 256;

/// Disconnected proxies kept, the most recently seen: ids are the proxies' to choose, so a
/// proxy reconnecting under ever new ids could otherwise fill the node's memory within
/// `forget_after`.
const MAX_DEPARTED: usize = 1_024;

/// The bytes of a NACK's reason kept and logged; the proxy's logs have the rest.
pub const MAX_REASON_BYTES: usize = 4 * 1024;

/// `text` cut to at most `max` bytes, on a character boundary.
pub fn truncated(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// How long a departed proxy stays in `portcullis status` unless configured otherwise.
pub const DEFAULT_FORGET_AFTER: Duration = Duration::from_secs(60 * 60);

impl Default for ProxyRegistry {
    fn default() -> Self {
        ProxyRegistry::new(DEFAULT_FORGET_AFTER)
    }
}

#[derive(Debug, Default)]
struct Inner {
    proxies: BTreeMap<String, Entry>,
    sessions: u64,
}

fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or_default()
}

impl ProxyRegistry {
    pub fn new(forget_after: Duration) -> Self {
        ProxyRegistry {
            inner: Arc::default(),
            forget_after,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The map stays consistent even if a holder panicked: every update is a plain field write.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn update(&self, proxy_id: &str, session: u64, change: impl FnOnce(&mut Entry)) {
        if let Some(entry) = self.lock().proxies.get_mut(proxy_id) {
            if entry.session == session {
                change(entry);
                entry.status.last_seen_unix_ms = now_unix_ms();
            }
        }
    }

    /// Records a new stream from `proxy_id` and returns its session. `last_version` is what
    /// the proxy says it serves (from its cache, or 0 after a restart with nothing applied),
    /// so the registry reflects the proxy rather than what an earlier stream acknowledged.
    /// Refused while another live proxy process holds the id.
    pub fn connect(
        &self,
        proxy_id: &str,
        instance: &str,
        shard: &ShardSelector,
        last_version: u64,
    ) -> Result<u64, String> {
        let mut inner = self.lock();
        if let Some(live) = inner.proxies.get(proxy_id).filter(|entry| entry.status.connected) {
            if !live.instance.is_empty() && !instance.is_empty() && live.instance != instance {
                return Err(format!(
                    "proxy id {proxy_id:?} is in use by another live proxy; give each proxy its own --id"
                ));
            }
        }
        inner.sessions += 1;
        let session = inner.sessions;
        let entry = inner
            .proxies
            .entry(proxy_id.to_string())
            .or_insert_with(|| Entry {
                status: ProxyStatus {
                    proxy_id: proxy_id.to_string(),
                    healthy: true,
                    ..ProxyStatus::default()
                },
                session,
                nacked_version: 0,
                instance: String::new(),
            });
        entry.session = session;
        entry.instance = instance.to_string();
        entry.status.shard = shard
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect::<HashMap<_, _>>();
        entry.status.applied_version = last_version;
        // Nothing has been sent on this stream yet.
        entry.status.sent_version = 0;
        entry.status.connected = true;
        entry.status.last_seen_unix_ms = now_unix_ms();
        // A stream starts with the proxy's findings; an earlier stream's may be stale.
        entry.status.tool_drift.clear();
        entry.status.tool_drift_not_shown = 0;
        Ok(session)
    }

    pub fn sent(&self, proxy_id: &str, session: u64, version: u64) {
        self.update(proxy_id, session, |entry| entry.status.sent_version = version);
    }

    /// ACKs and NACKs of versions never sent on this stream are ignored: a confused or
    /// malicious proxy must not report a state the control plane never offered.
    pub fn ack(&self, proxy_id: &str, session: u64, version: u64) {
        self.update(proxy_id, session, |entry| {
            if version > entry.status.sent_version {
                return;
            }
            entry.status.applied_version = version;
            if version >= entry.nacked_version {
                entry.status.healthy = true;
                entry.status.last_error.clear();
            }
        });
    }

    pub fn nack(&self, proxy_id: &str, session: u64, version: u64, reason: &str) {
        self.update(proxy_id, session, |entry| {
            if version > entry.status.sent_version {
                return;
            }
            entry.nacked_version = entry.nacked_version.max(version);
            entry.status.healthy = false;
            entry.status.last_error = format!("version {version}: {reason}");
        });
    }

    /// What the proxy finds while serving, replacing what it reported before; capped, so a
    /// confused proxy cannot grow the status without bound.
    pub fn findings(&self, proxy_id: &str, session: u64, findings: Findings) {
        let mut tool_drift = findings.tool_drift;
        let cut = tool_drift.len().saturating_sub(MAX_TOOL_DRIFT);
        tool_drift.truncate(MAX_TOOL_DRIFT);
        let not_shown = findings
            .tool_drift_not_shown
            .saturating_add(u32::try_from(cut).unwrap_or(u32::MAX));
        self.update(proxy_id, session, |entry| {
            entry.status.tool_drift = tool_drift;
            entry.status.tool_drift_not_shown = not_shown;
        });
    }

    pub fn disconnect(&self, proxy_id: &str, session: u64) {
        self.update(proxy_id, session, |entry| entry.status.connected = false);
        self.forget_departed(&mut self.lock());
    }

    /// Every proxy connected, or seen within `forget_after`, ordered by id.
    pub fn statuses(&self) -> Vec<ProxyStatus> {
        let mut inner = self.lock();
        self.forget_departed(&mut inner);
        inner.proxies.values().map(|entry| entry.status.clone()).collect()
    }

    /// Drops the disconnected proxies last seen before `forget_after`, then the longest gone
    /// beyond [`MAX_DEPARTED`].
    fn forget_departed(&self, inner: &mut Inner) {
        let forget_after = i64::try_from(self.forget_after.as_millis()).unwrap_or(i64::MAX);
        let cutoff = now_unix_ms().saturating_sub(forget_after);
        inner
            .proxies
            .retain(|_, entry| entry.status.connected || entry.status.last_seen_unix_ms >= cutoff);
        let departed = inner
            .proxies
            .values()
            .filter(|entry| !entry.status.connected)
            .count();
        let excess = departed.saturating_sub(MAX_DEPARTED);
        if excess == 0 {
            return;
        }
        // Seen in the same millisecond, the proxy that connected first is taken as gone longest.
        let mut oldest: Vec<(i64, u64, String)> = inner
            .proxies
            .iter()
            .filter(|(_, entry)| !entry.status.connected)
            .map(|(id, entry)| (entry.status.last_seen_unix_ms, entry.session, id.clone()))
            .collect();
        oldest.sort_unstable();
        for (_, _, id) in oldest.into_iter().take(excess) {
            inner.proxies.remove(&id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn findings_are_capped_and_a_new_stream_starts_without_them() {
        use portcullis_proto::v1::ToolDrift;
        let registry = ProxyRegistry::default();
        let session = registry.connect("p1", "i", &ShardSelector::new(), 0).unwrap();
        let drift = |tool: usize| ToolDrift {
            tool: format!("t{tool}"),
            state: "drifted".into(),
            ..ToolDrift::default()
        };
        registry.findings(
            "p1",
            session,
            Findings {
                tool_drift: (0..MAX_TOOL_DRIFT + 3).map(drift).collect(),
                tool_drift_not_shown: 2,
            },
        );
        let status = &registry.statuses()[0];
        assert_eq!(
            (status.tool_drift.len(), status.tool_drift_not_shown),
            (MAX_TOOL_DRIFT, 5)
        );
        // Another stream's findings do not land on this one.
        registry.findings("p1", session + 1, Findings::default());
        assert_eq!(registry.statuses()[0].tool_drift.len(), MAX_TOOL_DRIFT);
        registry.connect("p1", "i", &ShardSelector::new(), 0).unwrap();
        let status = &registry.statuses()[0];
        assert_eq!((status.tool_drift.len(), status.tool_drift_not_shown), (0, 0));
    }

    #[test]
    fn nack_stays_unhealthy_until_that_version_or_a_later_one_is_acked() {
        let registry = ProxyRegistry::default();
        let session = registry.connect("p1", "i", &ShardSelector::new(), 0).unwrap();
        registry.sent("p1", session, 3);
        registry.nack("p1", session, 3, "bad route");
        registry.ack("p1", session, 2);
        let status = &registry.statuses()[0];
        assert!(!status.healthy);
        assert_eq!(status.last_error, "version 3: bad route");
        // The proxy retried v3 and it applied this time (e.g., the port was freed).
        registry.ack("p1", session, 3);
        let status = &registry.statuses()[0];
        assert!(status.healthy);
        assert!(status.last_error.is_empty());
        assert_eq!((status.applied_version, status.sent_version), (3, 3));
    }

    #[test]
    fn connect_reports_the_proxy_version_and_unsent_versions_are_ignored() {
        let registry = ProxyRegistry::default();
        let session = registry.connect("p1", "i", &ShardSelector::new(), 5).unwrap();
        assert_eq!(registry.statuses()[0].applied_version, 5);
        registry.sent("p1", session, 6);
        registry.ack("p1", session, 7);
        registry.nack("p1", session, 7, "never sent");
        let status = &registry.statuses()[0];
        assert_eq!(status.applied_version, 5);
        assert!(status.healthy);
        // A restart with nothing applied shows 0 again.
        registry.connect("p1", "i", &ShardSelector::new(), 0).unwrap();
        assert_eq!(registry.statuses()[0].applied_version, 0);
    }

    #[test]
    fn stale_session_does_not_disconnect_a_reconnected_proxy() {
        let registry = ProxyRegistry::default();
        let old = registry.connect("p1", "i", &ShardSelector::new(), 0).unwrap();
        let new = registry.connect("p1", "i", &ShardSelector::new(), 0).unwrap();
        registry.disconnect("p1", old);
        assert!(registry.statuses()[0].connected);
        registry.disconnect("p1", new);
        assert!(!registry.statuses()[0].connected);
    }

    #[test]
    fn a_second_live_proxy_with_the_same_id_is_refused_not_merged() {
        let registry = ProxyRegistry::default();
        let first = registry.connect("p1", "a", &ShardSelector::new(), 3).unwrap();
        let refused = registry.connect("p1", "b", &ShardSelector::new(), 0).unwrap_err();
        assert!(refused.contains("in use by another live proxy"), "{refused}");
        assert_eq!(registry.statuses()[0].applied_version, 3);
        // Once the first is gone, the id is free again.
        registry.disconnect("p1", first);
        registry.connect("p1", "b", &ShardSelector::new(), 0).unwrap();
        assert_eq!(registry.statuses()[0].applied_version, 0);
    }

    #[test]
    fn departed_proxies_beyond_the_bound_are_forgotten_oldest_first() {
        let registry = ProxyRegistry::default();
        registry.connect("live", "l", &ShardSelector::new(), 0).unwrap();
        for index in 0..MAX_DEPARTED + 2 {
            let id = format!("gone-{index:04}");
            let session = registry.connect(&id, "g", &ShardSelector::new(), 0).unwrap();
            registry.disconnect(&id, session);
        }
        let statuses = registry.statuses();
        assert_eq!(statuses.len(), MAX_DEPARTED + 1);
        let ids: Vec<&str> = statuses.iter().map(|status| status.proxy_id.as_str()).collect();
        assert!(
            !ids.contains(&"gone-0000") && !ids.contains(&"gone-0001"),
            "oldest kept"
        );
        assert!(ids.contains(&"gone-0002") && ids.contains(&"live"));
    }

    #[test]
    fn truncation_keeps_whole_characters() {
        assert_eq!(truncated("port taken", 4), "port");
        assert_eq!(truncated("é", 1), "");
        assert_eq!(truncated("aé", 2), "a");
        assert_eq!(truncated("short", MAX_REASON_BYTES), "short");
    }

    #[test]
    fn departed_proxies_are_forgotten() {
        let registry = ProxyRegistry::new(Duration::ZERO);
        let gone = registry.connect("gone", "a", &ShardSelector::new(), 0).unwrap();
        registry.connect("live", "b", &ShardSelector::new(), 0).unwrap();
        registry.disconnect("gone", gone);
        std::thread::sleep(Duration::from_millis(5));
        let ids: Vec<String> = registry
            .statuses()
            .into_iter()
            .map(|status| status.proxy_id)
            .collect();
        assert_eq!(ids, ["live"]);
    }
}
