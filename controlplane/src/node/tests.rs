use std::sync::Arc;

use portcullis_proto::v1::{
    DeleteRequest, GetRequest, ListRequest, Object, ObjectRef, ReadConsistency, StatusRequest,
};
use serde_json::json;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus as HealthStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::admin::writes::{Plan, WriteQueue, BATCH_WRITES, QUEUE_LIMIT};
use crate::command::tests::{backend, route};
use crate::metrics::Metrics;
use crate::testutil::*;

#[tokio::test]
async fn serves_admin_and_keeps_config_across_restart() {
    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut client = admin(node.local_addr()).await;
    wait_for_leader(&mut client).await;

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", node.local_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let mut serving = false;
    for _ in 0..50 {
        let request = HealthCheckRequest {
            service: "portcullis.v1.Admin".to_string(),
        };
        if let Ok(response) = health.check(request).await {
            if response.into_inner().status == HealthStatus::Serving as i32 {
                serving = true;
                break;
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(serving, "Admin never reported SERVING");

    let objects = vec![
        listener("public", 8080, json!({})),
        backend("api", "127.0.0.1:9000"),
        route("web", "public", "api"),
    ];
    let applied = client
        .apply(apply_request(objects.clone(), Some(0)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(applied.version, 1);
    let actions: Vec<&str> = applied.changes.iter().map(|c| c.action.as_str()).collect();
    assert_eq!(actions, ["created", "created", "created"]);

    // Re-applying the same objects is a no-op that does not move the version.
    let again = client
        .apply(apply_request(objects, None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.version, 1);

    let garbage = portcullis_proto::v1::ApplyRequest {
        objects: vec![Object {
            kind: "Backend".into(),
            name: "x".into(),
            json: b"{not json".to_vec().into(),
        }],
        expected_version: None,
    };
    let status = client.apply(garbage.clone()).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with("objects[0]: not valid JSON"),
        "{}",
        status.message()
    );
    assert_eq!(
        client.validate(garbage).await.unwrap_err().code(),
        Code::InvalidArgument
    );

    let invalid = apply_request(vec![route("ops", "public", "missing")], None);
    let status = client.validate(invalid.clone()).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        status.message(),
        "Route/ops: spec.backends[0]: Backend \"missing\" does not exist"
    );
    assert_eq!(
        client.apply(invalid).await.unwrap_err().code(),
        Code::InvalidArgument
    );

    let stale = apply_request(vec![backend("api", "127.0.0.1:9001")], Some(5));
    let status = client.apply(stale).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(status.message(), "config is at version 1, expected 5");

    let validated = client
        .validate(apply_request(vec![backend("api", "127.0.0.1:9001")], None))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (validated.version, validated.changes[0].action.as_str()),
        (1, "configured")
    );

    let ghost = DeleteRequest {
        objects: vec![ObjectRef {
            kind: "backend".into(),
            name: "ghost".into(),
        }],
        expected_version: None,
    };
    assert_eq!(client.delete(ghost).await.unwrap_err().code(), Code::NotFound);
    let missing = GetRequest {
        object: Some(ObjectRef {
            kind: "Route".into(),
            name: "nope".into(),
        }),
        ..Default::default()
    };
    assert_eq!(client.get(missing).await.unwrap_err().code(), Code::NotFound);
    let bad_kind = ListRequest {
        kind: "gateway".into(),
        ..Default::default()
    };
    assert_eq!(
        client.list(bad_kind).await.unwrap_err().code(),
        Code::InvalidArgument
    );

    let get = GetRequest {
        object: Some(ObjectRef {
            kind: "Backend".into(),
            name: "api".into(),
        }),
        ..Default::default()
    };
    let got = client.get(get.clone()).await.unwrap().into_inner();
    assert_eq!(got.version, 1);
    assert_eq!(got.served(), ReadConsistency::Linearizable);
    let before = got.object.unwrap();

    node.shutdown().await.unwrap();

    let node = start(dir.path(), 1, false).await;
    let mut client = admin(node.local_addr()).await;
    wait_for_leader(&mut client).await;
    let got = client.get(get).await.unwrap().into_inner();
    assert_eq!((got.version, got.object.unwrap()), (1, before));
    let listed = client.list(ListRequest::default()).await.unwrap().into_inner();
    assert_eq!((listed.version, listed.objects.len()), (1, 3));
    // Still writable: the restarted node elected itself again.
    let applied = client
        .apply(apply_request(vec![backend("api", "127.0.0.1:9001")], Some(1)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(applied.version, 2);
    node.shutdown().await.unwrap();
}

/// Writes that queue while an entry commits go together in the next one: each client hears
/// its own changes at the version they share, and writes that cannot both stand are never
/// both accepted.
#[tokio::test]
async fn concurrent_writes_commit_together_and_each_hears_its_own_changes() {
    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut client = admin(node.local_addr()).await;
    wait_for_leader(&mut client).await;
    let base = vec![
        listener("public", 8080, json!({})),
        backend("shared", "127.0.0.1:9000"),
    ];
    client.apply(apply_request(base, None)).await.unwrap();

    const WRITERS: usize = 48;
    let creates = (0..WRITERS).map(|index| {
        let mut client = client.clone();
        async move {
            let request = apply_request(vec![backend(&format!("b-{index}"), "127.0.0.1:9001")], None);
            let applied = client.apply(request).await.unwrap().into_inner();
            let changes: Vec<(String, String)> = applied
                .changes
                .into_iter()
                .map(|change| {
                    let object = change.object.unwrap_or_default();
                    (format!("{}/{}", object.kind, object.name), change.action)
                })
                .collect();
            assert_eq!(changes, [(format!("Backend/b-{index}"), "created".to_string())]);
            applied.version
        }
    });
    let mut route_client = client.clone();
    let mut delete_client = client.clone();
    let route_to_shared = route_client.apply(apply_request(vec![route("web", "public", "shared")], None));
    let delete_shared = delete_client.delete(DeleteRequest {
        objects: vec![ObjectRef {
            kind: "Backend".into(),
            name: "shared".into(),
        }],
        expected_version: None,
    });
    let (versions, routed, deleted) =
        tokio::join!(futures::future::join_all(creates), route_to_shared, delete_shared);

    // A Route to the Backend and the Backend's deletion: exactly one of them stands.
    let (routed, deleted) = (
        routed.map(|answer| answer.into_inner().version),
        deleted.map(|answer| answer.into_inner().version),
    );
    let ((Ok(either), Err(_)) | (Err(_), Ok(either))) = (&routed, &deleted) else {
        panic!("route: {routed:?}, delete: {deleted:?}");
    };
    let distinct: std::collections::BTreeSet<u64> = versions.iter().copied().collect();
    assert!(
        distinct.len() < WRITERS,
        "{WRITERS} writes sent at once each had an entry of its own: {distinct:?}"
    );
    let listed = client.list(ListRequest::default()).await.unwrap().into_inner();
    assert_eq!(Some(listed.version), distinct.into_iter().chain([*either]).max());
    let holds = |kind: &str, name: &str| {
        listed
            .objects
            .iter()
            .any(|object| object.kind == kind && object.name == name)
    };
    assert!((0..WRITERS).all(|index| holds("Backend", &format!("b-{index}"))));
    // What stands is what its client was told.
    assert_eq!(
        (holds("Route", "web"), holds("Backend", "shared")),
        (routed.is_ok(), routed.is_ok())
    );
    node.shutdown().await.unwrap();
}

/// A plan creating the Backend `name`, as the Admin service's Apply would.
fn create_backend(name: &str) -> Plan {
    let submitted = crate::command::tests::submit(&[backend(name, "127.0.0.1:9000")]).unwrap();
    Box::new(move |config, version| crate::command::plan_apply(config, version, &submitted, None))
}

/// The queue driven directly: a request that found nothing committing holds the turn while
/// the others queue; the queue refuses one write beyond its limit; a queued request that is
/// cancelled leaves nothing behind; when the first request is cancelled mid-commit, the writes
/// queued behind it are committed, in full batches.
#[tokio::test]
async fn a_cancelled_request_hands_the_queued_writes_on_in_batches() {
    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut client = admin(node.local_addr()).await;
    wait_for_leader(&mut client).await;
    let queue = Arc::new(WriteQueue::new(
        node.raft.clone(),
        node.view.clone(),
        Metrics::default(),
    ));

    // Polled once: it took the turn, and is committing (its entry handed to Raft, or waiting
    // for a read-index when the leader's first entry is not applied yet).
    let mut cut = Box::pin(queue.write(None, create_backend("cut")));
    assert!(futures::poll!(&mut cut).is_pending());
    let doomed = {
        let queue = queue.clone();
        tokio::spawn(async move { queue.write(None, create_backend("doomed")).await })
    };
    let mut queued = tokio::task::JoinSet::new();
    for index in 1..QUEUE_LIMIT {
        let queue = queue.clone();
        queued.spawn(async move { queue.write(None, create_backend(&format!("q-{index}"))).await });
    }
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while queue.waiting() < QUEUE_LIMIT {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the spawned writes did not all queue");
    let refused = queue
        .write(None, create_backend("one-too-many"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{}", refused.message());
    doomed.abort();
    assert!(doomed.await.unwrap_err().is_cancelled());

    drop(cut);
    let mut versions = std::collections::BTreeSet::new();
    while let Some(joined) = tokio::time::timeout(std::time::Duration::from_secs(10), queued.join_next())
        .await
        .expect("the queued writes were not committed")
    {
        versions.insert(joined.unwrap().unwrap().version);
    }
    // 64 writes to an entry (the last one 63). A batch overtaken by the cancelled write's
    // entry goes again whole, and one planned on a confirmed config gathers as well.
    assert_eq!(
        versions.len(),
        QUEUE_LIMIT / BATCH_WRITES,
        "entries for {} writes",
        QUEUE_LIMIT - 1
    );
    let listed = client.list(ListRequest::default()).await.unwrap().into_inner();
    let names: Vec<&str> = listed.objects.iter().map(|object| object.name.as_str()).collect();
    assert!(
        !names.contains(&"doomed"),
        "a cancelled request's write was proposed"
    );
    assert_eq!(
        names.iter().filter(|name| name.starts_with("q-")).count(),
        QUEUE_LIMIT - 1
    );
    node.shutdown().await.unwrap();
}

#[tokio::test]
async fn added_node_replicates_and_forwards_writes() {
    let (dir1, dir2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let leader = start(dir1.path(), 1, false).await;
    let mut client1 = admin(leader.local_addr()).await;
    wait_for_leader(&mut client1).await;
    client1
        .apply(apply_request(vec![backend("api", "127.0.0.1:9000")], None))
        .await
        .unwrap();

    let follower = start(dir2.path(), 2, true).await;
    let add = portcullis_proto::v1::AddNodeRequest {
        node_id: 2,
        address: follower.local_addr().to_string(),
    };
    let status = client1.add_node(add).await.unwrap().into_inner();
    let voters: Vec<u64> = status
        .cluster
        .unwrap()
        .members
        .iter()
        .filter(|m| m.voter)
        .map(|m| m.node_id)
        .collect();
    assert_eq!(voters, [1, 2]);

    client1
        .apply(apply_request(vec![backend("db", "127.0.0.1:9001")], None))
        .await
        .unwrap();
    let mut client2 = admin(follower.local_addr()).await;
    let status = wait_status(&mut client2, |s| s.version == 2).await;
    assert_eq!(status.cluster.unwrap().leader_id, Some(1));
    let local = ListRequest {
        consistency: ReadConsistency::Local.into(),
        ..Default::default()
    };
    let listed = client2.list(local).await.unwrap().into_inner();
    assert_eq!(
        (listed.objects.len(), listed.served()),
        (2, ReadConsistency::Local)
    );
    // A linearizable read is the leader's to serve: the follower redirects it like a write.
    let redirected = client2.list(ListRequest::default()).await.unwrap_err();
    assert_eq!(redirected.code(), Code::Unavailable);
    assert_eq!(
        redirected
            .metadata()
            .get(portcullis_proto::LEADER_METADATA_KEY)
            .unwrap()
            .to_str()
            .unwrap(),
        leader.local_addr().to_string()
    );

    let status = client2
        .apply(apply_request(vec![backend("cache", "127.0.0.1:9002")], None))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    let leader_address = status
        .metadata()
        .get(portcullis_proto::LEADER_METADATA_KEY)
        .unwrap();
    assert_eq!(leader_address.to_str().unwrap(), leader.local_addr().to_string());

    follower.shutdown().await.unwrap();
    leader.shutdown().await.unwrap();
}

#[tokio::test]
async fn restarts_from_snapshot_after_log_purge() {
    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut client = admin(node.local_addr()).await;
    wait_for_leader(&mut client).await;
    for port in 9000..9003 {
        let endpoint = format!("127.0.0.1:{port}");
        client
            .apply(apply_request(vec![backend("api", &endpoint)], None))
            .await
            .unwrap();
    }
    let last = node.raft.metrics().borrow().last_applied.unwrap().index;
    node.raft.trigger().snapshot().await.unwrap();
    let mut metrics = node.raft.metrics();
    metrics
        .wait_for(|m| m.snapshot.is_some_and(|id| id.index >= last))
        .await
        .unwrap();
    node.raft.trigger().purge_log(last).await.unwrap();
    metrics
        .wait_for(|m| m.purged.is_some_and(|id| id.index >= last))
        .await
        .unwrap();
    node.shutdown().await.unwrap();

    let node = start(dir.path(), 1, false).await;
    let mut client = admin(node.local_addr()).await;
    wait_for_leader(&mut client).await;
    let listed = client.list(ListRequest::default()).await.unwrap().into_inner();
    assert_eq!(listed.version, 3);
    assert!(String::from_utf8_lossy(&listed.objects[0].json).contains("9002"));
    let applied = client
        .apply(apply_request(vec![backend("db", "127.0.0.1:9100")], Some(3)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(applied.version, 4);
    node.shutdown().await.unwrap();
}

fn disk_usage(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| {
            let entry = entry.unwrap();
            let metadata = entry.metadata().unwrap();
            if metadata.is_dir() {
                disk_usage(&entry.path())
            } else {
                metadata.len()
            }
        })
        .sum()
}

/// Under a steady stream of writes the log is snapshotted and purged (every 1,000 entries,
/// keeping 100), so neither the log nor the database grows with the number of writes.
#[tokio::test]
async fn steady_writes_keep_the_log_and_the_disk_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut client = admin(node.local_addr()).await;
    wait_for_leader(&mut client).await;
    let log_file = dir.path().join("raft/entries.log");
    let snapshot_file = dir.path().join("raft/state.snapshot");
    let mut sled_sizes = Vec::new();
    for round in 0..12 {
        for i in 0..1000 {
            let endpoint = format!("127.0.0.1:{}", 1000 + (round * 1000 + i) % 50000);
            client
                .apply(apply_request(vec![backend("api", &endpoint)], None))
                .await
                .unwrap();
        }
        // 1,000 entries take about 0.36 MB here: the file is rewritten once 1 MiB of it is
        // purged, so it stays under 1.5 MiB where 12,000 entries kept would take 4.3 MB.
        let log_size = std::fs::metadata(&log_file).unwrap().len();
        assert!(
            log_size <= 1536 * 1024,
            "the log file grew to {log_size} bytes after round {round}"
        );
        let snapshot_size = std::fs::metadata(&snapshot_file).map_or(0, |file| file.len());
        sled_sizes.push(disk_usage(dir.path()) - log_size - snapshot_size);
    }
    let metrics = node.raft.metrics().borrow().clone();
    let last = metrics.last_log_index.unwrap();
    let purged = metrics.purged.map_or(0, |id| id.index);
    assert!(
        last - purged <= 1100 + 100,
        "{} entries kept after {last} writes",
        last - purged
    );
    // sled grows in segments (here to five of 512 KiB, after about 6,000 writes) and then
    // reuses them as compaction frees them: 12,000 writes must not take twice what 5,000 did.
    assert!(
        sled_sizes[11] <= 2 * sled_sizes[4],
        "the database grew with the writes: {sled_sizes:?} bytes"
    );
    node.shutdown().await.unwrap();
}

/// A node added after the log was compacted catches up from a snapshot several chunks long
/// (openraft sends it in `SNAPSHOT_CHUNK` pieces over the Raft gRPC service).
#[tokio::test]
async fn a_new_node_catches_up_from_a_snapshot_larger_than_4_mib() {
    let (dir1, dir2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let leader = start(dir1.path(), 1, false).await;
    let mut client1 = admin(leader.local_addr()).await;
    wait_for_leader(&mut client1).await;
    let endpoints: Vec<String> = (0..8).map(|i| format!("10.0.{i}.1:8000")).collect();
    for batch in 0..10 {
        let objects = (0..2000)
            .map(|i| {
                json!({"apiVersion": "portcullis.dev/v1alpha1", "kind": "Backend",
                    "metadata": {"name": format!("backend-{batch}-{i}")}, "spec": {"endpoints": endpoints}})
            })
            .collect();
        client1.apply(apply_request(objects, None)).await.unwrap();
    }
    let last = leader.raft.metrics().borrow().last_applied.unwrap().index;
    leader.raft.trigger().snapshot().await.unwrap();
    let mut metrics = leader.raft.metrics();
    metrics
        .wait_for(|m| m.snapshot.is_some_and(|id| id.index >= last))
        .await
        .unwrap();
    leader.raft.trigger().purge_log(last).await.unwrap();
    metrics
        .wait_for(|m| m.purged.is_some_and(|id| id.index >= last))
        .await
        .unwrap();
    let on_leader = client1.list(ListRequest::default()).await.unwrap().into_inner();
    let config_bytes: usize = on_leader.objects.iter().map(|object| object.json.len()).sum();
    assert!(
        config_bytes > 4 * 1024 * 1024,
        "config is only {config_bytes} bytes"
    );

    let follower = start(dir2.path(), 2, true).await;
    let add = portcullis_proto::v1::AddNodeRequest {
        node_id: 2,
        address: follower.local_addr().to_string(),
    };
    client1.add_node(add).await.unwrap();
    let installed = follower.raft.metrics().borrow().snapshot;
    assert!(
        installed.is_some_and(|id| id.index >= last),
        "caught up without a snapshot: {installed:?}"
    );
    let mut client2 = admin(follower.local_addr()).await;
    let local = ListRequest {
        consistency: ReadConsistency::Local.into(),
        ..Default::default()
    };
    let on_follower = client2.list(local).await.unwrap().into_inner();
    assert_eq!(on_follower.version, on_leader.version);
    assert_eq!(on_follower.objects, on_leader.objects);

    follower.shutdown().await.unwrap();
    leader.shutdown().await.unwrap();
}

#[tokio::test]
async fn unreachable_node_is_not_added() {
    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut client = admin(node.local_addr()).await;
    wait_for_leader(&mut client).await;
    let closed = std::net::SocketAddr::from(([127, 0, 0, 1], portcullis_testkit::free_port()));
    let add = portcullis_proto::v1::AddNodeRequest {
        node_id: 7,
        address: closed.to_string(),
    };
    assert_eq!(client.add_node(add).await.unwrap_err().code(), Code::Unavailable);
    let status = wait_status(&mut client, |s| {
        s.cluster.as_ref().is_some_and(|c| c.members.len() == 1)
    })
    .await;
    assert_eq!(status.cluster.unwrap().members[0].node_id, 1);
    let applied = client
        .apply(apply_request(vec![backend("api", "127.0.0.1:9000")], None))
        .await
        .unwrap();
    assert_eq!(applied.into_inner().version, 1);
    node.shutdown().await.unwrap();
}

/// Raft messages name no target and no cluster: only the node waiting to join as that id (or
/// a member of this cluster before) may be added at an address.
#[tokio::test]
async fn only_the_node_waiting_as_that_id_is_added() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let leader = start(dirs[0].path(), 1, false).await;
    let mut client = admin(leader.local_addr()).await;
    wait_for_leader(&mut client).await;
    let waiting = start(dirs[1].path(), 2, true).await;
    let other_cluster = start(dirs[2].path(), 3, false).await;
    wait_for_leader(&mut admin(other_cluster.local_addr()).await).await;
    let refusal = |node_id: u64, address: std::net::SocketAddr| {
        let mut client = client.clone();
        async move {
            let add = portcullis_proto::v1::AddNodeRequest {
                node_id,
                address: address.to_string(),
            };
            let status = client.add_node(add).await.unwrap_err();
            assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
            status.message().to_owned()
        }
    };
    let message = refusal(5, leader.local_addr()).await;
    assert!(message.contains("is the address of node 1"), "{message}");
    let message = refusal(4, waiting.local_addr()).await;
    assert!(message.contains("is node 2, not node 4"), "{message}");
    let message = refusal(3, other_cluster.local_addr()).await;
    assert!(message.contains("belongs to another cluster"), "{message}");
    let status = client
        .status(StatusRequest { local: true })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.cluster.unwrap().members.len(), 1, "nothing was added");

    let add = portcullis_proto::v1::AddNodeRequest {
        node_id: 2,
        address: waiting.local_addr().to_string(),
    };
    client.add_node(add).await.unwrap();
    for node in [other_cluster, waiting, leader] {
        node.shutdown().await.unwrap();
    }
}

/// The serving status `node` reports for the Admin service, if it answers.
async fn admin_health(node: &crate::ControlPlane) -> Option<i32> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", node.local_addr()))
        .ok()?
        .connect()
        .await
        .ok()?;
    let request = HealthCheckRequest {
        service: "portcullis.v1.Admin".to_string(),
    };
    let response = HealthClient::new(channel).check(request).await.ok()?;
    Some(response.into_inner().status)
}

#[tokio::test]
async fn a_leader_that_lost_its_quorum_stops_serving() {
    let (dir1, dir2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let leader = start(dir1.path(), 1, false).await;
    let mut client = admin(leader.local_addr()).await;
    wait_for_leader(&mut client).await;
    let follower = start(dir2.path(), 2, true).await;
    let add = portcullis_proto::v1::AddNodeRequest {
        node_id: 2,
        address: follower.local_addr().to_string(),
    };
    client.add_node(add).await.unwrap();
    let mut serving = false;
    for _ in 0..100 {
        serving = admin_health(&leader).await == Some(HealthStatus::Serving as i32);
        if serving {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(serving, "the leader of two never reported SERVING");

    // Without its follower, the leader of two has no quorum: it still calls itself leader,
    // but nothing it is asked to write can commit.
    follower.shutdown().await.unwrap();
    let mut not_serving = false;
    for _ in 0..150 {
        not_serving = admin_health(&leader).await == Some(HealthStatus::NotServing as i32);
        if not_serving {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(not_serving, "a leader without quorum kept reporting SERVING");
    leader.shutdown().await.unwrap();
}

/// A committed write this build cannot read (as a build with looser rules could have made):
/// the node keeps running, refuses admin calls and proxy streams with the reason, and serves
/// again once the object is gone.
#[tokio::test]
async fn a_config_this_build_cannot_read_is_refused_with_the_reason_until_it_can() {
    use portcullis_proto::v1::proxy_message::Message;
    use portcullis_proto::v1::Hello;

    use crate::command::{ObjectChange, StoredKey, Write};

    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut client = admin(node.local_addr()).await;
    wait_for_leader(&mut client).await;
    client
        .apply(apply_request(vec![backend("api", "127.0.0.1:9000")], None))
        .await
        .unwrap();
    let key = StoredKey::parse("Backend/future").unwrap();
    let mut object = backend("future", "127.0.0.1:9001");
    object["spec"]["fieldOfALaterBuild"] = json!(true);
    let foreign = Write {
        base_version: 1,
        put: vec![(key.clone(), serde_json::value::to_raw_value(&object).unwrap())],
        delete: Vec::new(),
        changes: vec![ObjectChange {
            key: key.clone(),
            action: "created".into(),
        }],
    };
    node.raft.client_write(foreign).await.unwrap().data.unwrap();
    let refused = client.list(ListRequest::default()).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(
        refused.message().contains("fieldOfALaterBuild"),
        "{}",
        refused.message()
    );
    let refused = client
        .apply(apply_request(vec![backend("db", "127.0.0.1:9002")], None))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    let (tx, mut stream) = subscribe(node.local_addr()).await;
    let hello = Hello {
        proxy_id: "edge-1".into(),
        ..Hello::default()
    };
    tx.send(proxy_message(Message::Hello(hello))).await.unwrap();
    // The streams' copy of the config follows the applied one a little late: until it has
    // caught up, the stream may still serve the last readable version.
    let ended = loop {
        match stream.message().await {
            Ok(Some(served)) => {
                assert_eq!(served.version, 1, "only the last readable version");
                let ack = portcullis_proto::v1::Ack { version: 1 };
                tx.send(proxy_message(Message::Ack(ack))).await.unwrap();
            }
            Ok(None) => panic!("the stream ended without saying why"),
            Err(ended) => break ended,
        }
    };
    assert_eq!(ended.code(), Code::Unavailable);
    assert!(
        ended.message().contains("fieldOfALaterBuild"),
        "{}",
        ended.message()
    );

    let removal = Write {
        base_version: 2,
        put: Vec::new(),
        delete: vec![key.clone()],
        changes: vec![ObjectChange {
            key,
            action: "deleted".into(),
        }],
    };
    node.raft.client_write(removal).await.unwrap().data.unwrap();
    let listed = client.list(ListRequest::default()).await.unwrap().into_inner();
    assert_eq!((listed.version, listed.objects.len()), (3, 1));
    node.shutdown().await.unwrap();
}

/// Raft stopping once it has a write's entry leaves the write's outcome open: the entry may be
/// durable and commit under the next leader, so the client must read before retrying.
#[tokio::test]
async fn a_write_raft_stops_under_is_answered_as_possibly_committed() {
    let (dir1, dir2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let leader = start(dir1.path(), 1, false).await;
    let mut client = admin(leader.local_addr()).await;
    wait_for_leader(&mut client).await;
    let follower = start(dir2.path(), 2, true).await;
    let add = portcullis_proto::v1::AddNodeRequest {
        node_id: 2,
        address: follower.local_addr().to_string(),
    };
    client.add_node(add).await.unwrap();
    // Without its one follower, the leader takes the write into its log and cannot commit it.
    follower.shutdown().await.unwrap();

    let mut metrics = leader.raft.metrics();
    let proposed = metrics.borrow().last_log_index.map_or(0, |index| index + 1);
    let write = tokio::spawn(async move {
        client
            .apply(apply_request(vec![backend("open", "127.0.0.1:9000")], None))
            .await
    });
    metrics
        .wait_for(|m| m.last_log_index >= Some(proposed))
        .await
        .unwrap();
    leader.raft.shutdown().await.unwrap();
    let status = write.await.unwrap().unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status.message().contains("it may have committed"),
        "{}",
        status.message()
    );
    leader.shutdown().await.unwrap();
}
