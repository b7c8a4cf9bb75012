use std::path::Path;

use openraft::storage::RaftStateMachine;
use openraft::testing::{StoreBuilder, Suite};
use openraft::{CommittedLeaderId, EntryPayload, RaftSnapshotBuilder};
use portcullis_config::{Kind, ObjectKey};
use tempfile::TempDir;

use super::*;
use crate::command::tests::{apply, backend, route};
use crate::command::{Command, ErrorCode, Outcome};
use crate::types::{Entry, LogId, StorageError, TypeConfig};

struct TempStore;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for TempStore {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachineStore), StorageError> {
        let dir = tempfile::tempdir().unwrap();
        let storage = Storage::open(dir.path()).unwrap();
        Ok((
            dir,
            LogStore::open(&storage).unwrap(),
            StateMachineStore::open(&storage).unwrap(),
        ))
    }
}

#[test]
fn openraft_storage_suite() {
    Suite::test_all(TempStore).unwrap();
}

fn open_sm(path: &Path) -> StateMachineStore {
    StateMachineStore::open(&Storage::open(path).unwrap()).unwrap()
}

fn entry(index: u64, command: Command) -> Entry {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 0), index),
        payload: EntryPayload::Normal(command),
    }
}

async fn run(sm: &mut StateMachineStore, index: u64, command: Command) -> Outcome {
    sm.apply([entry(index, command)]).await.unwrap().remove(0)
}

#[tokio::test]
async fn applies_rejects_and_versions() {
    let dir = tempfile::tempdir().unwrap();
    let mut sm = open_sm(dir.path());
    let view = sm.subscribe();

    let applied = run(&mut sm, 1, apply(vec![backend("api", "127.0.0.1:1")], None))
        .await
        .unwrap();
    assert_eq!(
        (applied.version, applied.changes[0].action.as_str()),
        (1, "created")
    );
    assert_eq!(view.borrow().version, 1);

    // Same object again: nothing changes, so the version stays.
    let applied = run(&mut sm, 2, apply(vec![backend("api", "127.0.0.1:1")], None))
        .await
        .unwrap();
    assert_eq!(
        (applied.version, applied.changes[0].action.as_str()),
        (1, "unchanged")
    );

    // Rejected: a route to a missing listener. Nothing moves.
    let rejected = run(&mut sm, 3, apply(vec![route("web", "public", "api")], None))
        .await
        .unwrap_err();
    assert_eq!(rejected.code, ErrorCode::InvalidArgument);
    assert!(
        rejected.message.contains("Route/web: spec.listeners[0]"),
        "{}",
        rejected.message
    );
    assert_eq!(view.borrow().version, 1);

    let rejected = run(&mut sm, 4, apply(vec![backend("api", "127.0.0.1:2")], Some(0)))
        .await
        .unwrap_err();
    assert_eq!(rejected.code, ErrorCode::FailedPrecondition);
    assert_eq!(rejected.message, "config is at version 1, expected 0");

    let applied = run(&mut sm, 5, apply(vec![backend("api", "127.0.0.1:2")], Some(1)))
        .await
        .unwrap();
    assert_eq!(
        (applied.version, applied.changes[0].action.as_str()),
        (2, "configured")
    );

    let delete = Command::Delete {
        keys: vec![ObjectKey::new(
            Kind::of::<portcullis_config::BackendSpec>(),
            "api",
        )],
        expected_version: None,
    };
    let applied = run(&mut sm, 6, delete).await.unwrap();
    assert_eq!(
        (applied.version, applied.changes[0].action.as_str()),
        (3, "deleted")
    );
    assert!(view.borrow().config.is_empty());
    let (last_applied, _) = sm.applied_state().await.unwrap();
    assert_eq!(last_applied.map(|id| id.index), Some(6));
}

#[tokio::test]
async fn state_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut sm = open_sm(dir.path());
        run(&mut sm, 1, apply(vec![backend("api", "127.0.0.1:1")], None))
            .await
            .unwrap();
        run(&mut sm, 2, apply(vec![backend("db", "127.0.0.1:2")], None))
            .await
            .unwrap();
    }
    let mut sm = open_sm(dir.path());
    let view = sm.subscribe().borrow().clone();
    assert_eq!(view.version, 2);
    assert_eq!(view.config.len(), 2);
    let (last_applied, _) = sm.applied_state().await.unwrap();
    assert_eq!(last_applied.map(|id| id.index), Some(2));
}

#[tokio::test]
async fn snapshot_round_trip_replaces_state() {
    let source_dir = tempfile::tempdir().unwrap();
    let mut source = open_sm(source_dir.path());
    run(&mut source, 1, apply(vec![backend("api", "127.0.0.1:1")], None))
        .await
        .unwrap();
    run(&mut source, 2, apply(vec![backend("db", "127.0.0.1:2")], None))
        .await
        .unwrap();
    let snapshot = source
        .get_snapshot_builder()
        .await
        .build_snapshot()
        .await
        .unwrap();

    let target_dir = tempfile::tempdir().unwrap();
    {
        let mut target = open_sm(target_dir.path());
        // State the snapshot must replace entirely.
        run(&mut target, 1, apply(vec![backend("stale", "127.0.0.1:9")], None))
            .await
            .unwrap();
        let view = target.subscribe();
        target
            .install_snapshot(&snapshot.meta, snapshot.snapshot)
            .await
            .unwrap();
        let installed = view.borrow().clone();
        assert_eq!(installed.version, 2);
        let names: Vec<&str> = installed.config.objects().map(|o| o.name()).collect();
        assert_eq!(names, ["api", "db"]);
        let current = target.get_current_snapshot().await.unwrap().unwrap();
        assert_eq!(current.meta, snapshot.meta);
    }
    let mut reopened = open_sm(target_dir.path());
    let view = reopened.subscribe().borrow().clone();
    assert_eq!((view.version, view.config.len()), (2, 2));
    assert_eq!(
        reopened.applied_state().await.unwrap().0.map(|id| id.index),
        Some(2)
    );
}

#[test]
fn a_database_being_released_is_waited_for_not_refused() {
    let dir = tempfile::tempdir().unwrap();
    let first = Storage::open(dir.path()).unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(first);
    });
    // Locked when this starts; opens once the first handle is gone.
    let second = Storage::open(dir.path());
    release.join().unwrap();
    assert!(second.is_ok(), "{:?}", second.err());
}
