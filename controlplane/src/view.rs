use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use portcullis_config::ConfigSet;
use tokio::sync::watch;

/// How late the proxy streams' first group sees a new version (the others follow, a run of
/// the runtime's queue apart): long enough for the write that made it to
/// be answered first (the writer waits on it; proxies can take a few milliseconds more),
/// short against the fan-out's budget. Longer in tests, so a test can act inside the window.
#[cfg(not(test))]
pub const STREAMED_LATE_BY: Duration = Duration::from_millis(2);
#[cfg(test)]
pub const STREAMED_LATE_BY: Duration = Duration::from_millis(100);

/// The config as this node's build reads it, as the state machine publishes it. Readers
/// (admin reads, proxy streams) clone the `Arc`, so they never see a half-applied write.
#[derive(Debug, Clone, Default)]
pub struct ConfigView {
    /// Bumped by every entry that changes something (the writes committed in one share it);
    /// 0 means nothing applied yet.
    pub version: u64,
    pub config: Arc<ConfigSet>,
    /// Set when the replicated config has moved past `version` to a version this build
    /// cannot read (it was accepted by a build with other validation rules): `version` and
    /// `config` are then the last version it could read, and this says why it stopped.
    pub unreadable: Option<Arc<str>>,
}

/// How many groups the proxy streams are split into: the republishing task wakes one group,
/// then lets the runtime run what else is ready (the Raft RPCs and writes of this node)
/// before the next, so a write's tasks queue behind one group's sends, not the whole fleet's.
const STREAMED_GROUPS: usize = 16;

impl ConfigView {
    /// `view`, followed [`STREAMED_LATE_BY`] late: what the proxy streams (config, signals,
    /// placements) watch. The write that made a version is answered on this node's runtime;
    /// were the thousand streams of a large fleet woken by the apply itself, their sends
    /// would hold its answer back. One task waits instead, then wakes them group by group,
    /// starting each round at the next group so that no group is always last. It ends on
    /// shutdown or when the applied view ends (it cannot tell that every stream is gone: a
    /// `Streamed` keeps a receiver of each group).
    pub fn streamed(mut view: watch::Receiver<ConfigView>, mut shutdown: watch::Receiver<bool>) -> Streamed {
        let initial = view.borrow_and_update().clone();
        let (senders, groups): (Vec<_>, Vec<_>) = (0..STREAMED_GROUPS)
            .map(|_| watch::channel(initial.clone()))
            .unzip();
        tokio::spawn(async move {
            let mut first = 0;
            loop {
                tokio::select! {
                    changed = view.changed() => if changed.is_err() { return },
                    _ = shutdown.changed() => return,
                }
                tokio::time::sleep(STREAMED_LATE_BY).await;
                let latest = view.borrow_and_update().clone();
                for turn in 0..STREAMED_GROUPS {
                    senders[(first + turn) % STREAMED_GROUPS].send_replace(latest.clone());
                    // tokio (1.54) wakes a yielded task only after the worker has polled the
                    // I/O driver: once it finds nothing to run or steal, or at its maintenance
                    // every 61 polls. Not a documented guarantee; at worst the groups go out
                    // at once, as before they were split.
                    tokio::task::yield_now().await;
                }
                first = (first + 1) % STREAMED_GROUPS;
            }
        });
        Streamed {
            groups: groups.into(),
            next: Arc::default(),
        }
    }
}

/// The proxy streams' copy of the config ([`ConfigView::streamed`]); each stream takes its
/// receiver with [`Streamed::subscribe`], in one of the groups in turn.
#[derive(Clone)]
pub struct Streamed {
    groups: Arc<[watch::Receiver<ConfigView>]>,
    next: Arc<AtomicUsize>,
}

impl Streamed {
    pub fn subscribe(&self) -> watch::Receiver<ConfigView> {
        let group = self.next.fetch_add(1, Ordering::Relaxed) % self.groups.len();
        self.groups[group].clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(version: u64) -> ConfigView {
        ConfigView {
            version,
            ..ConfigView::default()
        }
    }

    #[tokio::test]
    async fn the_streamed_copy_reaches_the_last_version_of_a_burst_and_stops_with_the_node() {
        let (applied, view) = watch::channel(at(1));
        let (stop, shutdown) = watch::channel(false);
        let copy = ConfigView::streamed(view, shutdown);
        let mut streamed = copy.subscribe();
        // Every group of streams, not only the first, gets the last version.
        let mut others: Vec<_> = (1..2 * STREAMED_GROUPS).map(|_| copy.subscribe()).collect();
        assert_eq!(streamed.borrow_and_update().version, 1);

        let started = tokio::time::Instant::now();
        for version in 2..=5 {
            applied.send_replace(at(version));
        }
        let reached = streamed.wait_for(|view| view.version == 5);
        tokio::time::timeout(Duration::from_secs(10), reached)
            .await
            .expect("the last version of the burst comes")
            .unwrap();
        assert!(started.elapsed() >= STREAMED_LATE_BY, "told only after its delay");

        applied.send_replace(at(6));
        tokio::time::timeout(Duration::from_secs(10), streamed.changed())
            .await
            .expect("the next version comes")
            .unwrap();
        assert_eq!(
            streamed.borrow_and_update().version,
            6,
            "and the next version alone"
        );

        for other in &mut others {
            let reached = other.wait_for(|view| view.version == 6);
            tokio::time::timeout(Duration::from_secs(10), reached)
                .await
                .expect("every group gets the version")
                .unwrap();
        }

        stop.send_replace(true);
        assert!(streamed.changed().await.is_err(), "the copy ends with the node");
    }
}
