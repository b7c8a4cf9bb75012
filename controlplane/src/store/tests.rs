use std::path::Path;
use std::time::Duration;

use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::testing::{StoreBuilder, Suite};
use openraft::{CommittedLeaderId, EntryPayload, RaftLogReader, RaftSnapshotBuilder};
use portcullis_config::{Kind, ObjectKey};
use tempfile::TempDir;

use super::*;
use crate::command::tests::{backend, submit};
use crate::command::{self, ErrorCode, Outcome, StoredKey, Write};
use crate::types::{Entry, LogId, StorageError, TypeConfig};

struct TempStore;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, TempDir> for TempStore {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachineStore), StorageError> {
        let dir = tempfile::tempdir().unwrap();
        let storage = Storage::open(dir.path()).unwrap();
        let stores = (
            dir,
            LogStore::open(&storage).unwrap(),
            StateMachineStore::open(&storage).unwrap(),
        );
        storage.let_every_purge_through();
        Ok(stores)
    }
}

#[test]
fn openraft_storage_suite() {
    Suite::test_all(TempStore).unwrap();
}

fn open_sm(path: &Path) -> StateMachineStore {
    StateMachineStore::open(&Storage::open(path).unwrap()).unwrap()
}

fn entry(index: u64, write: Write) -> Entry {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 0), index),
        payload: EntryPayload::Normal(write),
    }
}

async fn run(sm: &mut StateMachineStore, index: u64, write: Write) -> Outcome {
    sm.apply([entry(index, write)]).await.unwrap().remove(0)
}

/// Plans `objects` on the state machine's current config, as the leader does, and applies it.
async fn apply(
    sm: &mut StateMachineStore,
    index: u64,
    objects: Vec<serde_json::Value>,
    expected: Option<u64>,
) -> Outcome {
    let view = sm.subscribe().borrow().clone();
    let write = command::plan_apply(&view.config, view.version, &submit(&objects).unwrap(), expected)?.write;
    run(sm, index, write).await
}

fn backend_key(name: &str) -> ObjectKey {
    ObjectKey::new(Kind::of::<portcullis_config::BackendSpec>(), name)
}

#[tokio::test]
async fn applies_writes_and_versions() {
    let dir = tempfile::tempdir().unwrap();
    let mut sm = open_sm(dir.path());
    let view = sm.subscribe();

    let applied = apply(&mut sm, 1, vec![backend("api", "127.0.0.1:1")], None)
        .await
        .unwrap();
    assert_eq!(
        (applied.version, applied.changes[0].action.as_str()),
        (1, "created")
    );
    assert_eq!(view.borrow().version, 1);

    // Same object again: nothing changes, so the version stays.
    let applied = apply(&mut sm, 2, vec![backend("api", "127.0.0.1:1")], None)
        .await
        .unwrap();
    assert_eq!(
        (applied.version, applied.changes[0].action.as_str()),
        (1, "unchanged")
    );

    // A write planned on version 0 that commits after version 1: nothing moves.
    let stale = command::plan_apply(
        &portcullis_config::ConfigSet::default(),
        0,
        &submit(&[backend("db", "127.0.0.1:2")]).unwrap(),
        None,
    )
    .unwrap()
    .write;
    let rejected = run(&mut sm, 3, stale).await.unwrap_err();
    assert_eq!(rejected.code, ErrorCode::FailedPrecondition);
    assert_eq!(rejected.message, "config is at version 1, expected 0");
    assert_eq!(view.borrow().config.len(), 1);

    let applied = apply(&mut sm, 4, vec![backend("api", "127.0.0.1:2")], Some(1))
        .await
        .unwrap();
    assert_eq!(
        (applied.version, applied.changes[0].action.as_str()),
        (2, "configured")
    );

    let current = view.borrow().clone();
    let delete = command::plan_delete(&current.config, current.version, &[backend_key("api")], None)
        .unwrap()
        .write;
    let applied = run(&mut sm, 5, delete).await.unwrap();
    assert_eq!(
        (applied.version, applied.changes[0].action.as_str()),
        (3, "deleted")
    );
    assert!(view.borrow().config.is_empty());
    let (last_applied, _) = sm.applied_state().await.unwrap();
    assert_eq!(last_applied.map(|id| id.index), Some(5));
}

/// A log written under other validation rules (here: objects with a field this build
/// refuses, as a later or looser build could have accepted) replays to the same versions,
/// outcomes and stored objects, before and after a restart. The node says it cannot serve
/// those versions instead of refusing to start, and serves again once the config is
/// readable.
#[tokio::test]
async fn a_log_accepted_by_other_rules_replays_unchanged() {
    let later_build_write = |base_version: u64, name: &str| {
        let mut object = backend(name, "127.0.0.1:1");
        object["spec"]["fieldOfALaterBuild"] = serde_json::json!(true);
        let key = StoredKey::parse(&format!("Backend/{name}")).unwrap();
        Write {
            base_version,
            put: vec![(key.clone(), serde_json::value::to_raw_value(&object).unwrap())],
            delete: Vec::new(),
            changes: vec![command::ObjectChange {
                key,
                action: "created".into(),
            }],
        }
    };
    let dir = tempfile::tempdir().unwrap();
    {
        let mut sm = open_sm(dir.path());
        let view = sm.subscribe();
        apply(&mut sm, 1, vec![backend("api", "127.0.0.1:1")], None)
            .await
            .unwrap();
        let applied = run(&mut sm, 2, later_build_write(1, "future")).await.unwrap();
        assert_eq!(
            (applied.version, applied.changes[0].action.as_str()),
            (2, "created")
        );
        let served = view.borrow().clone();
        assert_eq!(
            (served.version, served.config.len()),
            (1, 1),
            "the last readable version stays served"
        );
        let reason = served.unreadable.expect("unreadable version not reported");
        assert!(
            reason.contains("config version 2") && reason.contains("fieldOfALaterBuild"),
            "{reason}"
        );
        // The log goes on: a write planned on version 2 (by a build that can read it) applies.
        let applied = run(&mut sm, 3, later_build_write(2, "next")).await.unwrap();
        assert_eq!(applied.version, 3);
    }
    let mut reopened = open_sm(dir.path());
    assert_eq!(
        reopened.applied_state().await.unwrap().0.map(|id| id.index),
        Some(3)
    );
    let stored: Vec<String> = reopened
        .stored()
        .objects
        .keys()
        .map(ToString::to_string)
        .collect();
    assert_eq!(stored, ["Backend/api", "Backend/future", "Backend/next"]);
    assert_eq!(reopened.stored().version, 3);
    assert!(reopened.subscribe().borrow().unreadable.is_some());

    // Deleting what this build cannot read makes the config readable again.
    let delete = Write {
        base_version: 3,
        put: Vec::new(),
        delete: vec![
            StoredKey::parse("Backend/future").unwrap(),
            StoredKey::parse("Backend/next").unwrap(),
        ],
        changes: Vec::new(),
    };
    assert_eq!(run(&mut reopened, 4, delete).await.unwrap().version, 4);
    let view = reopened.subscribe().borrow().clone();
    assert_eq!((view.version, view.config.len(), view.unreadable), (4, 1, None));
}

#[tokio::test]
async fn state_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut sm = open_sm(dir.path());
        apply(&mut sm, 1, vec![backend("api", "127.0.0.1:1")], None)
            .await
            .unwrap();
        apply(&mut sm, 2, vec![backend("db", "127.0.0.1:2")], None)
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

/// Builds before the log file kept entries in sled's tree `log` (JSON under big-endian
/// indexes); opening the log carries them over once and drops the tree.
#[tokio::test]
async fn a_log_kept_in_sled_by_an_older_build_is_carried_over() {
    let dir = tempfile::tempdir().unwrap();
    {
        let storage = Storage::open(dir.path()).unwrap();
        let legacy = storage.tree("log").unwrap();
        for index in 1..=3 {
            let blank = Entry {
                log_id: LogId::new(CommittedLeaderId::new(1, 0), index),
                payload: EntryPayload::Blank,
            };
            legacy
                .insert(index.to_be_bytes(), serde_json::to_vec(&blank).unwrap())
                .unwrap();
        }
        drop(legacy);
        storage.close(Duration::from_secs(1)).await.unwrap();
    }
    for _ in 0..2 {
        let storage = Storage::open(dir.path()).unwrap();
        let mut log = LogStore::open(&storage).unwrap();
        let entries = log.try_get_log_entries(0..).await.unwrap();
        let indexes: Vec<u64> = entries.iter().map(|entry| entry.log_id.index).collect();
        assert_eq!(indexes, [1, 2, 3]);
        assert!(
            storage.legacy_tree("log").unwrap().is_none(),
            "the sled tree is dropped"
        );
        drop(log);
        storage.close(Duration::from_secs(1)).await.unwrap();
    }
}

#[tokio::test]
async fn snapshot_round_trip_replaces_state() {
    let source_dir = tempfile::tempdir().unwrap();
    let mut source = open_sm(source_dir.path());
    apply(&mut source, 1, vec![backend("api", "127.0.0.1:1")], None)
        .await
        .unwrap();
    apply(&mut source, 2, vec![backend("db", "127.0.0.1:2")], None)
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
        apply(&mut target, 1, vec![backend("stale", "127.0.0.1:9")], None)
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
    // The installed state is in sled, not only in the snapshot an open would restore it from.
    std::fs::remove_file(target_dir.path().join("state.snapshot")).unwrap();
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

/// Applies a Backend named after `index` and builds a snapshot; returns it as stored.
async fn snapshot_at(sm: &mut StateMachineStore, index: u64) -> snapshot::Stored {
    let name = format!("b{index}");
    apply(sm, index, vec![backend(&name, "127.0.0.1:1")], None)
        .await
        .unwrap();
    let built = sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
    snapshot::Stored {
        meta: built.meta,
        data: built.snapshot.into_inner(),
    }
}

fn put_in_sled(tree: &sled::Tree, stored: &snapshot::Stored) {
    tree.insert(snapshot::SLED_META, serde_json::to_vec(&stored.meta).unwrap())
        .unwrap();
    tree.insert(snapshot::SLED_DATA, stored.data.as_slice()).unwrap();
}

/// The names of the objects in the config `sm` publishes.
fn config_names(sm: &StateMachineStore) -> Vec<String> {
    let view = sm.subscribe().borrow().clone();
    view.config.objects().map(|o| o.name().to_string()).collect()
}

/// Opens the state machine in `dir`; returns its current snapshot's last index and the
/// object names of its config, checking that sled holds no snapshot any more.
async fn reopened(dir: &Path) -> (Option<u64>, Vec<String>) {
    let storage = Storage::open(dir).unwrap();
    let mut sm = StateMachineStore::open(&storage).unwrap();
    let current = sm.get_current_snapshot().await.unwrap().unwrap();
    let payload: snapshot::SnapshotPayload = serde_json::from_slice(current.snapshot.get_ref()).unwrap();
    assert_eq!(payload.version, current.meta.last_log_id.unwrap().index);
    let sm_tree = storage.tree("sm").unwrap();
    for key in [snapshot::SLED_META, snapshot::SLED_DATA] {
        assert!(
            sm_tree.get(key).unwrap().is_none(),
            "a snapshot key left in tree sm"
        );
    }
    assert!(
        storage.legacy_tree(snapshot::SLED_TREE).unwrap().is_none(),
        "tree snapshot left"
    );
    let names = config_names(&sm);
    drop((sm, sm_tree));
    storage.close(Duration::from_secs(1)).await.unwrap();
    (current.meta.last_log_id.map(|id| id.index), names)
}

/// Opens the storage in `dir` and makes `stored` its snapshot file's content.
async fn store_in_file(dir: &Path, stored: &snapshot::Stored) {
    let storage = Storage::open(dir).unwrap();
    let (file, _) = snapshot::SnapshotFile::open(&storage).unwrap();
    file.store(&stored.meta, &stored.data).unwrap();
    drop(file);
    storage.close(Duration::from_secs(1)).await.unwrap();
}

/// Snapshots at indexes 1, 2 and 3 of one state machine.
async fn three_snapshots() -> Vec<snapshot::Stored> {
    let dir = tempfile::tempdir().unwrap();
    let mut sm = open_sm(dir.path());
    let mut snapshots = Vec::new();
    for index in 1..=3 {
        snapshots.push(snapshot_at(&mut sm, index).await);
    }
    snapshots
}

/// The snapshot is a file: to sled it would be a blob file, which sled leaves behind when
/// killed. A snapshot older builds kept in sled (tree `sm`, then tree `snapshot`) moves to
/// the file on open, the latest of all kept, wherever it is.
#[tokio::test]
async fn a_snapshot_kept_in_sled_by_an_older_build_moves_to_the_file() {
    let snapshots = three_snapshots().await;
    // (in the file, in tree sm, in tree snapshot), as indexes into `snapshots`.
    for (in_file, in_sm, in_tree) in [(0, Some(1), Some(2)), (0, Some(2), Some(1)), (2, Some(0), None)] {
        let dir = tempfile::tempdir().unwrap();
        store_in_file(dir.path(), &snapshots[in_file]).await;
        let storage = Storage::open(dir.path()).unwrap();
        if let Some(index) = in_sm {
            put_in_sled(&storage.tree("sm").unwrap(), &snapshots[index]);
        }
        if let Some(index) = in_tree {
            put_in_sled(&storage.tree(snapshot::SLED_TREE).unwrap(), &snapshots[index]);
        }
        storage.close(Duration::from_secs(1)).await.unwrap();
        let case = format!("file {in_file}, tree sm {in_sm:?}, tree snapshot {in_tree:?}");
        assert_eq!(reopened(dir.path()).await.0, Some(3), "{case}");
        assert_eq!(reopened(dir.path()).await.0, Some(3), "{case}, opened again");
    }
}

/// A build that began before an install must not replace the installed snapshot with its
/// older one; the log may be purged only up to the snapshot on disk.
#[tokio::test]
async fn an_older_snapshot_never_replaces_a_later_one() {
    let snapshots = three_snapshots().await;
    let dir = tempfile::tempdir().unwrap();
    let storage = Storage::open(dir.path()).unwrap();
    let (file, _) = snapshot::SnapshotFile::open(&storage).unwrap();
    file.store(&snapshots[2].meta, &snapshots[2].data).unwrap();
    file.store(&snapshots[1].meta, &snapshots[1].data).unwrap();
    let current = file.read().unwrap().unwrap();
    assert_eq!(current.meta, snapshots[2].meta);
    assert_eq!(*storage.snapshot_covers.borrow(), snapshots[2].meta.last_log_id);
}

/// openraft asks for a purge while the state machine may still be writing the snapshot that
/// covers it: the purge waits for it, so a crash never leaves entries that are nowhere.
#[tokio::test]
async fn the_log_is_purged_only_up_to_a_durable_snapshot() {
    let snapshots = three_snapshots().await;
    let dir = tempfile::tempdir().unwrap();
    let storage = Storage::open(dir.path()).unwrap();
    let mut log = LogStore::open(&storage).unwrap();
    let (file, _) = snapshot::SnapshotFile::open(&storage).unwrap();
    file.store(&snapshots[0].meta, &snapshots[0].data).unwrap();
    let up_to = |index: usize| snapshots[index].meta.last_log_id.unwrap();

    log.purge(up_to(0)).await.unwrap();
    let mut purge = log.clone();
    let to = up_to(2);
    let mut waiting = tokio::spawn(async move { purge.purge(to).await });
    // A purge takes a sled flush and a file write, well under this; a busy machine can only
    // make the check pass without proving the wait, never fail it.
    let early = tokio::time::timeout(Duration::from_millis(300), &mut waiting).await;
    assert!(early.is_err(), "purged past the snapshot on disk");
    file.store(&snapshots[2].meta, &snapshots[2].data).unwrap();
    waiting.await.unwrap().unwrap();
    assert_eq!(
        log.get_log_state().await.unwrap().last_purged_log_id,
        Some(up_to(2))
    );
}

/// An install stores the snapshot, then the state: an open that finds the snapshot later
/// than the state (the install cut short, or a build whose state had not reached the disk)
/// restores the state from the snapshot, since the log may be purged up to it.
#[tokio::test]
async fn an_open_restores_the_state_from_a_later_snapshot() {
    let snapshots = three_snapshots().await;
    let dir = tempfile::tempdir().unwrap();
    {
        let mut sm = open_sm(dir.path());
        snapshot_at(&mut sm, 1).await;
        apply(
            &mut sm,
            2,
            vec![backend("not-in-the-snapshot", "127.0.0.1:2")],
            None,
        )
        .await
        .unwrap();
    }
    store_in_file(dir.path(), &snapshots[2]).await;
    let all_three = vec!["b1".to_string(), "b2".into(), "b3".into()];
    assert_eq!(reopened(dir.path()).await, (Some(3), all_three.clone()));
    // The restored state reached sled: without the snapshot, the state machine holds it.
    std::fs::remove_file(dir.path().join("state.snapshot")).unwrap();
    let mut sm = open_sm(dir.path());
    assert_eq!(sm.applied_state().await.unwrap().0.map(|id| id.index), Some(3));
    let names = config_names(&sm);
    assert_eq!(names, all_three);
}

#[tokio::test]
async fn a_damaged_snapshot_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut sm = open_sm(dir.path());
    snapshot_at(&mut sm, 1).await;
    drop(sm);
    let path = dir.path().join("state.snapshot");
    let contents = std::fs::read(&path).unwrap();
    // A flipped bit in the payload, in the meta's length, and a file cut short.
    let mut flipped = contents.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    let mut long_meta = contents.clone();
    long_meta[9] ^= 0x10;
    for damaged in [flipped, long_meta, contents[..contents.len() / 2].to_vec()] {
        std::fs::write(&path, damaged).unwrap();
        let error = StateMachineStore::open(&Storage::open(dir.path()).unwrap())
            .err()
            .expect("a damaged snapshot is refused");
        assert!(format!("{error:#}").contains("damaged"), "{error:#}");
    }
}
