//! Each config message is built once and shared. When the config moves to a new version,
//! every proxy of a shard that held the same version gets the same message (a delta
//! against that version, or the whole slice), sliced and JSON-encoded once: the cost of a
//! change grows with the number of shards and bases, not with the number of proxies. Each
//! shard's slice of a version is cut once too, and serves again as the base of the next.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use portcullis_config::{ConfigSet, ShardSelector, Slicer};
use portcullis_proto::v1::{ConfigSnapshot, ObjectRef};
use tokio::sync::OnceCell;

use crate::admin::wire::to_wire;
use crate::view::ConfigView;

/// How many recent versions deltas can start from. A proxy that acknowledged an older one
/// gets the whole slice.
const KEPT_BASES: usize = 16;

/// How many target versions keep their built messages: the newest, and the one before it
/// for streams that have not seen the newest yet.
const KEPT_TARGETS: usize = 2;

type Cell<T> = Arc<OnceCell<Arc<T>>>;

/// A message's shard and base version (`None`: whole).
type MessageKey = (ShardSelector, Option<u64>);

#[derive(Default)]
pub(crate) struct Fanout {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Recently sent versions: the bases of deltas.
    versions: BTreeMap<u64, Arc<Version>>,
    /// Built messages by target version.
    built: BTreeMap<u64, HashMap<MessageKey, Cell<ConfigSnapshot>>>,
}

/// One version's config and the slices cut from it, each cut once.
struct Version {
    config: Arc<ConfigSet>,
    /// The version before it, until its slicer is made: a slicer carried over from the last
    /// version costs what the write changed; a new one costs the whole config.
    previous: Mutex<Option<Arc<Version>>>,
    /// The slicer, and the version it was carried over from while that one is still kept.
    slicer: OnceCell<(Arc<Slicer>, Option<Weak<Version>>)>,
    slices: Mutex<HashMap<ShardSelector, Cell<ConfigSet>>>,
}

impl Version {
    async fn slicer(&self) -> &(Arc<Slicer>, Option<Weak<Version>>) {
        self.slicer
            .get_or_init(|| async {
                let config = ConfigSet::clone(&self.config);
                let previous = lock(&self.previous).take();
                let carried = previous
                    .as_ref()
                    .and_then(|previous| Some((previous, previous.slicer.get()?)));
                match carried {
                    Some((previous, (slicer, _))) => {
                        (Arc::new(slicer.advance(config)), Some(Arc::downgrade(previous)))
                    }
                    None => (Arc::new(Slicer::new(config)), None),
                }
            })
            .await
    }

    /// `shard`'s slice: from the previous version's slice when the write changed objects
    /// in place (only they are looked at), else cut whole.
    async fn slice(&self, shard: &ShardSelector) -> Arc<ConfigSet> {
        let cell = lock(&self.slices).entry(shard.clone()).or_default().clone();
        cell.get_or_init(|| async {
            let (slicer, from) = self.slicer().await;
            let previous = from
                .as_ref()
                .and_then(Weak::upgrade)
                .filter(|_| slicer.changed_in_place());
            Arc::new(match previous {
                Some(previous) => slicer.slice_after(&*Box::pin(previous.slice(shard)).await, shard),
                None => slicer.slice(shard),
            })
        })
        .await
        .clone()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Fanout {
    /// The message taking a proxy of `shard` to `view`'s version: a delta when the proxy
    /// holds `base` and it is recent enough, else the whole slice.
    pub(crate) async fn message(
        &self,
        view: &ConfigView,
        shard: &ShardSelector,
        base: Option<u64>,
    ) -> Arc<ConfigSnapshot> {
        let (cell, target, base) = {
            let mut inner = lock(&self.inner);
            let previous = inner
                .versions
                .range(..view.version)
                .next_back()
                .map(|(_, version)| version.clone());
            let target = inner
                .versions
                .entry(view.version)
                .or_insert_with(|| {
                    Arc::new(Version {
                        config: view.config.clone(),
                        previous: Mutex::new(previous),
                        slicer: OnceCell::new(),
                        slices: Mutex::default(),
                    })
                })
                .clone();
            while inner.versions.len() > KEPT_BASES {
                inner.versions.pop_first();
            }
            let base = base
                .filter(|base| *base < view.version)
                .and_then(|base| Some((base, inner.versions.get(&base)?.clone())));
            let key = (shard.clone(), base.as_ref().map(|(version, _)| *version));
            let cell = inner
                .built
                .entry(view.version)
                .or_default()
                .entry(key)
                .or_default()
                .clone();
            while inner.built.len() > KEPT_TARGETS {
                inner.built.pop_first();
            }
            (cell, target, base)
        };
        cell.get_or_init(|| async {
            let new = target.slice(shard).await;
            Arc::new(match base {
                Some((base_version, base)) => {
                    delta(&*base.slice(shard).await, base_version, &new, view.version)
                }
                None => whole(&new, view.version),
            })
        })
        .await
        .clone()
    }
}

fn whole(slice: &ConfigSet, version: u64) -> ConfigSnapshot {
    ConfigSnapshot {
        version,
        objects: slice.objects().map(to_wire).collect(),
        base_version: None,
        removed: Vec::new(),
        takes_findings: true,
    }
}

fn delta(old: &ConfigSet, base_version: u64, new: &ConfigSet, version: u64) -> ConfigSnapshot {
    let (changed, removed) = old.differences(new);
    ConfigSnapshot {
        version,
        objects: changed.into_iter().map(to_wire).collect(),
        base_version: Some(base_version),
        removed: removed
            .into_iter()
            .map(|key| ObjectRef {
                kind: key.kind.to_string(),
                name: key.name.clone(),
            })
            .collect(),
        takes_findings: true,
    }
}

#[cfg(test)]
mod tests {
    use portcullis_config::ConfigSet;

    use super::*;
    use crate::command::tests::{backend, decode_objects};

    fn view(version: u64, endpoints: &[&str]) -> ConfigView {
        let objects = endpoints
            .iter()
            .enumerate()
            .map(|(index, endpoint)| backend(&format!("b{index}"), endpoint))
            .collect::<Vec<_>>();
        ConfigView {
            version,
            config: Arc::new(ConfigSet::from_objects(decode_objects(&objects).unwrap()).unwrap()),
            unreadable: None,
        }
    }

    #[tokio::test]
    async fn proxies_moving_between_the_same_versions_share_one_message() {
        let fanout = Fanout::default();
        let shard = ShardSelector::default();
        let first = view(1, &["127.0.0.1:1", "127.0.0.1:2"]);
        let whole = fanout.message(&first, &shard, None).await;
        assert!(Arc::ptr_eq(&whole, &fanout.message(&first, &shard, None).await));
        assert_eq!(whole.objects.len(), 2);

        let second = view(2, &["127.0.0.1:1", "127.0.0.1:3"]);
        let delta = fanout.message(&second, &shard, Some(1)).await;
        assert!(Arc::ptr_eq(
            &delta,
            &fanout.message(&second, &shard, Some(1)).await
        ));
        assert_eq!((delta.base_version, delta.objects.len()), (Some(1), 1));
        assert_eq!(delta.objects[0].name, "b1");

        // A base never sent from this node is unknown to it: the version goes whole.
        let unknown = Fanout::default().message(&second, &shard, Some(1)).await;
        assert_eq!((unknown.base_version, unknown.objects.len()), (None, 2));
    }
}
