//! Each config message is built once and shared. When the config moves to a new version,
//! every proxy of a shard that held the same version gets the same message (a delta
//! against that version, or the whole slice), sliced and JSON-encoded once: the cost of a
//! change grows with the number of shards and bases, not with the number of proxies.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use portcullis_config::{ConfigSet, ShardSelector};
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

type MessageKey = (ShardSelector, Option<u64>);
type Built = Arc<OnceCell<Arc<ConfigSnapshot>>>;

#[derive(Default)]
pub(crate) struct Fanout {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Configs of recently sent versions: the bases of deltas.
    sent: BTreeMap<u64, Arc<ConfigSet>>,
    /// By target version, then shard and base (`None`: whole).
    built: BTreeMap<u64, HashMap<MessageKey, Built>>,
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
        let (cell, base) = {
            let mut inner = self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            inner
                .sent
                .entry(view.version)
                .or_insert_with(|| view.config.clone());
            while inner.sent.len() > KEPT_BASES {
                inner.sent.pop_first();
            }
            let base = base
                .filter(|base| *base < view.version)
                .and_then(|base| Some((base, inner.sent.get(&base)?.clone())));
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
            (cell, base)
        };
        cell.get_or_init(|| async {
            Arc::new(match base {
                Some((base_version, base)) => delta(&base, base_version, view, shard),
                None => whole(view, shard),
            })
        })
        .await
        .clone()
    }
}

fn whole(view: &ConfigView, shard: &ShardSelector) -> ConfigSnapshot {
    ConfigSnapshot {
        version: view.version,
        objects: view.config.slice(shard).objects().map(to_wire).collect(),
        base_version: None,
        removed: Vec::new(),
    }
}

fn delta(base: &ConfigSet, base_version: u64, view: &ConfigView, shard: &ShardSelector) -> ConfigSnapshot {
    let (old, new) = (base.slice(shard), view.config.slice(shard));
    ConfigSnapshot {
        version: view.version,
        objects: new
            .objects()
            .filter(|object| old.get(&object.key()) != Some(*object))
            .map(to_wire)
            .collect(),
        base_version: Some(base_version),
        removed: old
            .objects()
            .filter(|object| new.get(&object.key()).is_none())
            .map(|object| ObjectRef {
                kind: object.kind().to_string(),
                name: object.name().to_string(),
            })
            .collect(),
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
