use openraft::testing::{StoreBuilder, Suite};
use openraft::{CommittedLeaderId, EntryPayload};

use super::*;
use crate::signals::types::{EndpointRound, PoolRound};

struct Fresh;

impl StoreBuilder<SignalsTypeConfig, MemLog, SignalStateMachine, ()> for Fresh {
    async fn build(&self) -> Result<((), MemLog, SignalStateMachine), StorageError> {
        Ok(((), MemLog::default(), SignalStateMachine::new()))
    }
}

#[test]
fn openraft_storage_suite() {
    Suite::test_all(Fresh).unwrap();
}

fn reading(age_ms: u32, waiting: u32) -> Reading {
    Reading {
        age_ms,
        waiting,
        running: 1,
        kv_cache_usage: 0.5,
        lora: None,
    }
}

fn round(pool: &str, endpoints: &[(&str, Option<Reading>)]) -> PoolRound {
    PoolRound {
        pool: pool.into(),
        endpoints: endpoints
            .iter()
            .map(|(endpoint, reading)| EndpointRound {
                endpoint: endpoint.to_string(),
                reading: reading.clone(),
            })
            .collect(),
    }
}

/// The reading a view holds for `endpoint` of `pool`, without when it arrived.
fn held(view: &SignalView, pool: &str, endpoint: &str) -> Option<Reading> {
    view.pools[pool].endpoints[endpoint]
        .as_ref()
        .map(|held| held.reading.clone())
}

fn entry(index: u64, signals: SignalEntry) -> Entry {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 0), index),
        payload: EntryPayload::Normal(signals),
    }
}

#[tokio::test]
async fn rounds_replace_pools_keep_silent_endpoints_and_drop_removed_ones() {
    let mut sm = SignalStateMachine::new();
    let view = sm.subscribe();
    let first = SignalEntry {
        rounds: vec![
            round("a", &[("p1", Some(reading(10, 1))), ("p2", Some(reading(10, 2)))]),
            round("b", &[("q1", None)]),
        ],
        removed_pools: vec![],
    };
    sm.apply([entry(1, first)]).await.unwrap();
    let seen = view.borrow().clone();
    assert_eq!(seen.generation, 1);
    assert_eq!(held(&seen, "a", "p2"), Some(reading(10, 2)));
    assert_eq!(seen.pools["b"].endpoints["q1"], None);

    // p1 did not answer: it keeps its reading (which ages); p2 left the pool.
    let second = SignalEntry {
        rounds: vec![round("a", &[("p1", None), ("p3", Some(reading(60, 0)))])],
        removed_pools: vec!["b".into()],
    };
    sm.apply([entry(2, second)]).await.unwrap();
    let seen = view.borrow().clone();
    assert_eq!(seen.generation, 2);
    assert_eq!(seen.pools["a"].generation, 2);
    assert_eq!(seen.pools["a"].endpoints.keys().collect::<Vec<_>>(), ["p1", "p3"]);
    assert_eq!(held(&seen, "a", "p1"), Some(reading(10, 1)));
    assert!(!seen.pools.contains_key("b"));
}

#[tokio::test]
async fn a_snapshot_carries_the_readings_to_a_new_node() {
    let mut leader = SignalStateMachine::new();
    let signals = SignalEntry {
        rounds: vec![round("a", &[("p1", Some(reading(10, 4)))])],
        removed_pools: vec![],
    };
    leader.apply([entry(1, signals)]).await.unwrap();
    // The reading ages on the leader before the snapshot is built; the snapshot says so.
    tokio::time::sleep(std::time::Duration::from_millis(30)).await;
    let snapshot = leader
        .get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .unwrap();

    let mut joined = SignalStateMachine::new();
    let view = joined.subscribe();
    joined
        .install_snapshot(&snapshot.meta, snapshot.snapshot)
        .await
        .unwrap();
    let installed = held(&view.borrow(), "a", "p1").unwrap();
    assert!(
        installed.age_ms >= 40,
        "10 ms when proposed + 30 ms held: {}",
        installed.age_ms
    );
    assert_eq!(
        installed,
        Reading {
            age_ms: installed.age_ms,
            ..reading(10, 4)
        }
    );
    assert_eq!(joined.applied_state().await.unwrap().0, snapshot.meta.last_log_id);
}
