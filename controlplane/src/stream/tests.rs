use std::time::Duration;

use portcullis_proto::v1::admin_client::AdminClient;
use portcullis_proto::v1::config_stream_client::ConfigStreamClient;
use portcullis_proto::v1::proxy_message::Message;
use portcullis_proto::v1::{Ack, AddNodeRequest, ConfigSnapshot, Hello, Nack, ProxyMessage, ProxyStatus};
use serde_json::json;
use tonic::transport::Channel;
use tonic::{Code, Streaming};

use crate::command::tests::{backend, route};
use crate::registry::MAX_REASON_BYTES;
use crate::testutil::*;

async fn next(stream: &mut Streaming<ConfigSnapshot>) -> ConfigSnapshot {
    tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("no snapshot within 10 s")
        .unwrap()
        .expect("stream ended")
}

fn names(snapshot: &ConfigSnapshot) -> Vec<String> {
    snapshot
        .objects
        .iter()
        .map(|o| format!("{}/{}", o.kind, o.name))
        .collect()
}

fn proxy(status: &portcullis_proto::v1::StatusResponse) -> Option<&ProxyStatus> {
    status.proxies.iter().find(|p| p.proxy_id == "edge-1")
}

/// A proxy holding the version the node just applied, before the streams see it (a proxy
/// moving here from a node that died): it waits for that version, and is never sent an older
/// one, as it would be were the applied version taken for another history's.
#[tokio::test]
async fn a_proxy_holding_the_version_just_applied_gets_nothing_older() {
    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut admin = admin(node.local_addr()).await;
    wait_for_leader(&mut admin).await;
    admin
        .apply(apply_request(vec![backend("api", "127.0.0.1:9000")], None))
        .await
        .unwrap();
    let hello = |proxy_id: &str, last_version| Hello {
        proxy_id: proxy_id.into(),
        shard: Default::default(),
        last_version,
        instance: "one".into(),
        accepts_deltas: false,
    };
    // Once another proxy is sent version 1, the streams' copy holds it; then version 2
    // applies, and a proxy holding it arrives within the copy's delay.
    let (earlier_tx, mut earlier) = subscribe(node.local_addr()).await;
    earlier_tx
        .send(proxy_message(Message::Hello(hello("edge-0", 0))))
        .await
        .unwrap();
    assert_eq!(next(&mut earlier).await.version, 1);
    let (tx, mut stream) = subscribe(node.local_addr()).await;
    admin
        .apply(apply_request(vec![backend("api", "127.0.0.1:9100")], None))
        .await
        .unwrap();
    tx.send(proxy_message(Message::Hello(hello("edge-1", 2))))
        .await
        .unwrap();
    let first = next(&mut stream).await;
    assert_eq!(first.version, 2);
}

#[tokio::test]
async fn streams_versions_and_records_acks() {
    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut admin = admin(node.local_addr()).await;
    wait_for_leader(&mut admin).await;
    let config = vec![
        listener("public", 8080, json!({"edge": "true"})),
        listener("internal", 8081, json!({})),
        backend("api", "127.0.0.1:9000"),
        backend("admin", "127.0.0.1:9001"),
        route("web", "public", "api"),
        route("ops", "internal", "admin"),
    ];
    admin.apply(apply_request(config, None)).await.unwrap();

    let (tx, mut stream) = subscribe(node.local_addr()).await;
    // Hello after the call is established: the server must not need it up front.
    let hello = Hello {
        proxy_id: "edge-1".into(),
        shard: [("edge".to_string(), "true".to_string())].into(),
        last_version: 1,
        instance: "one".into(),
        accepts_deltas: false,
    };
    tx.send(proxy_message(Message::Hello(hello))).await.unwrap();

    let first = next(&mut stream).await;
    assert_eq!(first.version, 1);
    assert_eq!(names(&first), ["Listener/public", "Route/web", "Backend/api"]);
    tx.send(proxy_message(Message::Ack(Ack { version: 1 })))
        .await
        .unwrap();
    let status = wait_status(&mut admin, |s| proxy(s).is_some_and(|p| p.applied_version == 1)).await;
    let edge = proxy(&status).unwrap();
    assert!(edge.healthy && edge.connected);
    assert_eq!(edge.shard.get("edge").map(String::as_str), Some("true"));

    admin
        .apply(apply_request(vec![backend("api", "127.0.0.1:9100")], None))
        .await
        .unwrap();
    let second = next(&mut stream).await;
    assert_eq!(second.version, 2);
    assert!(String::from_utf8_lossy(&second.objects[2].json).contains("9100"));

    let nack = Nack {
        version: 2,
        reason: "cannot resolve api".into(),
    };
    tx.send(proxy_message(Message::Nack(nack))).await.unwrap();
    let status = wait_status(&mut admin, |s| proxy(s).is_some_and(|p| !p.healthy)).await;
    let edge = proxy(&status).unwrap();
    assert_eq!((edge.applied_version, edge.sent_version), (1, 2));
    assert!(
        edge.last_error.contains("cannot resolve api"),
        "{}",
        edge.last_error
    );

    drop(tx);
    wait_status(&mut admin, |s| proxy(s).is_some_and(|p| !p.connected)).await;
    node.shutdown().await.unwrap();
}

#[tokio::test]
async fn first_message_must_be_hello() {
    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut client = ConfigStreamClient::connect(format!("http://{}", node.local_addr()))
        .await
        .unwrap();
    let ack = tokio_stream::iter([proxy_message(Message::Ack(Ack { version: 3 }))]);
    let mut stream = client.subscribe(ack).await.unwrap().into_inner();
    let status = stream.message().await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    node.shutdown().await.unwrap();
}

#[tokio::test]
async fn nothing_is_sent_before_the_first_version() {
    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut admin = admin(node.local_addr()).await;
    wait_for_leader(&mut admin).await;
    let (tx, mut stream) = subscribe(node.local_addr()).await;
    let hello = Hello {
        proxy_id: "edge-1".into(),
        ..Hello::default()
    };
    tx.send(proxy_message(Message::Hello(hello))).await.unwrap();
    let early = tokio::time::timeout(Duration::from_millis(300), stream.message()).await;
    assert!(early.is_err(), "got something at version 0: {early:?}");
    admin
        .apply(apply_request(vec![backend("api", "127.0.0.1:9000")], None))
        .await
        .unwrap();
    assert_eq!(next(&mut stream).await.version, 1);

    // Shutdown ends open streams instead of waiting for proxies to hang up. `shutdown`
    // succeeds either way (it drops connections after its grace period), so the test
    // watches the stream: it must end well before that grace period.
    let shutdown = tokio::spawn(node.shutdown());
    let ended = tokio::time::timeout(Duration::from_secs(2), stream.message()).await;
    assert!(
        matches!(ended, Ok(Ok(None))),
        "the stream did not end cleanly within 2 s of shutdown: {ended:?}"
    );
    shutdown.await.unwrap().unwrap();
    // Held until here so that the proxy side never hangs up first.
    drop(tx);
}

/// A node that formed its cluster, at version 1 (one Backend), and an admin client of it.
async fn at_version_one(dir: &std::path::Path) -> (crate::ControlPlane, AdminClient<Channel>) {
    let node = start(dir, 1, false).await;
    let mut client = admin(node.local_addr()).await;
    wait_for_leader(&mut client).await;
    client
        .apply(apply_request(vec![backend("api", "127.0.0.1:9000")], None))
        .await
        .unwrap();
    (node, client)
}

/// A leader at version 1 and a follower that has applied it.
async fn two_nodes(
    dirs: &(tempfile::TempDir, tempfile::TempDir),
) -> (crate::ControlPlane, crate::ControlPlane, AdminClient<Channel>) {
    let (leader, mut client) = at_version_one(dirs.0.path()).await;
    let follower = start(dirs.1.path(), 2, true).await;
    let add = AddNodeRequest {
        node_id: 2,
        address: follower.local_addr().to_string(),
    };
    client.add_node(add).await.unwrap();
    wait_status(&mut admin(follower.local_addr()).await, |s| s.version == 1).await;
    (leader, follower, client)
}

fn holding(version: u64) -> ProxyMessage {
    proxy_message(Message::Hello(Hello {
        proxy_id: "edge-1".into(),
        last_version: version,
        ..Hello::default()
    }))
}

#[tokio::test]
async fn a_proxy_holding_a_newer_version_waits_for_a_follower_to_catch_up() {
    let dirs = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (leader, follower, mut client) = two_nodes(&dirs).await;
    // The proxy comes from a node that had already applied version 2. The follower cannot
    // tell that from a version this cluster never reached: it waits.
    let (tx, mut stream) = subscribe(follower.local_addr()).await;
    tx.send(holding(2)).await.unwrap();
    let early = tokio::time::timeout(Duration::from_millis(500), stream.message()).await;
    assert!(
        early.is_err(),
        "sent an older version than the proxy holds: {early:?}"
    );
    client
        .apply(apply_request(vec![backend("api", "127.0.0.1:9001")], None))
        .await
        .unwrap();
    assert_eq!(next(&mut stream).await.version, 2);
    drop(tx);
    follower.shutdown().await.unwrap();
    leader.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_leader_serves_a_proxy_holding_a_version_this_cluster_never_reached() {
    let dirs = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (leader, follower, _client) = two_nodes(&dirs).await;
    // The proxy served version 50 of a control plane this one replaced, rebuilt from empty
    // storage: the leader, current by a quorum's word, knows version 50 is not its own.
    let (tx, mut stream) = subscribe(leader.local_addr()).await;
    tx.send(holding(50)).await.unwrap();
    // Well before the 10 s a follower would wait for its log to catch up.
    let served = tokio::time::timeout(Duration::from_secs(8), stream.message())
        .await
        .expect("the leader kept the proxy waiting")
        .unwrap()
        .unwrap();
    assert_eq!(
        (served.version, names(&served)),
        (1, vec!["Backend/api".to_string()])
    );
    drop(tx);
    follower.shutdown().await.unwrap();
    leader.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_second_live_proxy_with_the_same_id_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (node, _admin) = at_version_one(dir.path()).await;
    let hello = |instance: &str| Hello {
        proxy_id: "edge-1".into(),
        instance: instance.into(),
        ..Hello::default()
    };
    let (first_tx, mut first) = subscribe(node.local_addr()).await;
    first_tx
        .send(proxy_message(Message::Hello(hello("a"))))
        .await
        .unwrap();
    assert_eq!(next(&mut first).await.version, 1);
    let (second_tx, mut second) = subscribe(node.local_addr()).await;
    second_tx
        .send(proxy_message(Message::Hello(hello("b"))))
        .await
        .unwrap();
    let refused = second.message().await.unwrap_err();
    assert_eq!(refused.code(), Code::AlreadyExists);
    assert!(refused.message().contains("edge-1"), "{}", refused.message());
    // The same process reconnecting takes its id back.
    let (again_tx, mut again) = subscribe(node.local_addr()).await;
    again_tx
        .send(proxy_message(Message::Hello(hello("a"))))
        .await
        .unwrap();
    assert_eq!(next(&mut again).await.version, 1);
    drop((first_tx, second_tx, again_tx));
    node.shutdown().await.unwrap();
}

#[tokio::test]
async fn deltas_follow_acknowledgements_and_a_refused_delta_is_resent_whole() {
    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut admin = admin(node.local_addr()).await;
    wait_for_leader(&mut admin).await;
    let config = vec![
        listener("public", 8080, json!({"edge": "true"})),
        listener("internal", 8081, json!({})),
        backend("api", "127.0.0.1:9000"),
        backend("admin", "127.0.0.1:9001"),
        route("web", "public", "api"),
        route("ops", "internal", "admin"),
    ];
    admin.apply(apply_request(config, None)).await.unwrap();
    let (tx, mut stream) = subscribe(node.local_addr()).await;
    let hello = Hello {
        proxy_id: "edge-1".into(),
        shard: [("edge".to_string(), "true".to_string())].into(),
        accepts_deltas: true,
        ..Hello::default()
    };
    tx.send(proxy_message(Message::Hello(hello))).await.unwrap();
    let ack = |version| proxy_message(Message::Ack(Ack { version }));

    // A stream starts whole.
    let first = next(&mut stream).await;
    assert_eq!((first.version, first.base_version), (1, None));
    assert_eq!(names(&first), ["Listener/public", "Route/web", "Backend/api"]);
    tx.send(ack(1)).await.unwrap();

    // Then only what changed in the slice, against the acknowledged version.
    admin
        .apply(apply_request(vec![backend("api", "127.0.0.1:9100")], None))
        .await
        .unwrap();
    let second = next(&mut stream).await;
    assert_eq!((second.version, second.base_version), (2, Some(1)));
    assert_eq!(names(&second), ["Backend/api"]);
    assert!(second.removed.is_empty());

    // Nothing more goes out until the proxy answers; a refused delta comes back whole, at
    // the newest version.
    admin
        .apply(apply_request(vec![backend("admin", "127.0.0.1:9101")], None))
        .await
        .unwrap();
    let early = tokio::time::timeout(Duration::from_millis(300), stream.message()).await;
    assert!(
        early.is_err(),
        "sent before the last version was answered: {early:?}"
    );
    let nack = Nack {
        version: 2,
        reason: "delta against version 1, but this proxy holds none".into(),
    };
    tx.send(proxy_message(Message::Nack(nack))).await.unwrap();
    let third = next(&mut stream).await;
    assert_eq!((third.version, third.base_version), (3, None));
    assert_eq!(names(&third), ["Listener/public", "Route/web", "Backend/api"]);
    tx.send(ack(3)).await.unwrap();

    // An object leaving the slice is listed as removed.
    let moved = vec![backend("api2", "127.0.0.1:9200"), route("web", "public", "api2")];
    admin.apply(apply_request(moved, None)).await.unwrap();
    let fourth = next(&mut stream).await;
    assert_eq!((fourth.version, fourth.base_version), (4, Some(3)));
    assert_eq!(names(&fourth), ["Route/web", "Backend/api2"]);
    let removed: Vec<String> = fourth
        .removed
        .iter()
        .map(|r| format!("{}/{}", r.kind, r.name))
        .collect();
    assert_eq!(removed, ["Backend/api"]);
    drop(tx);
    node.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_version_refused_whole_is_offered_again() {
    let dir = tempfile::tempdir().unwrap();
    let (node, mut admin) = at_version_one(dir.path()).await;
    let (tx, mut stream) = subscribe(node.local_addr()).await;
    let hello = Hello {
        proxy_id: "edge-1".into(),
        accepts_deltas: true,
        ..Hello::default()
    };
    tx.send(proxy_message(Message::Hello(hello))).await.unwrap();
    assert_eq!(next(&mut stream).await.version, 1);
    // Refused for a reason that can pass (a port in use), with no write to follow.
    let nack = Nack {
        version: 1,
        reason: "127.0.0.1:8080: address in use".into(),
    };
    tx.send(proxy_message(Message::Nack(nack))).await.unwrap();
    let again = next(&mut stream).await;
    assert_eq!((again.version, again.base_version), (1, None));
    tx.send(proxy_message(Message::Ack(Ack { version: 1 })))
        .await
        .unwrap();
    let status = wait_status(&mut admin, |s| proxy(s).is_some_and(|p| p.applied_version == 1)).await;
    assert!(proxy(&status).unwrap().healthy);
    drop(tx);
    node.shutdown().await.unwrap();
}

/// What a Hello carries stays in the registry until the proxy is forgotten: a Hello over the
/// bounds is refused, one at them is served.
#[tokio::test]
async fn a_hello_over_the_bounds_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (node, _admin) = at_version_one(dir.path()).await;
    let labels = |count: usize, key_bytes: usize, value_bytes: usize| {
        (0..count)
            .map(|index| (format!("{index:0>key_bytes$}"), "v".repeat(value_bytes)))
            .collect()
    };
    let edge = |shard| Hello {
        proxy_id: "edge-1".into(),
        shard,
        ..Hello::default()
    };
    let refused = [
        Hello {
            proxy_id: "p".repeat(257),
            ..Hello::default()
        },
        Hello {
            instance: "i".repeat(257),
            ..edge(labels(0, 0, 0))
        },
        edge(labels(17, 2, 1)),
        edge(labels(1, 64, 1)),
        edge(labels(1, 2, 64)),
    ];
    for hello in refused {
        let (tx, mut stream) = subscribe(node.local_addr()).await;
        tx.send(proxy_message(Message::Hello(hello))).await.unwrap();
        let status = stream.message().await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{}", status.message());
    }
    let (tx, mut stream) = subscribe(node.local_addr()).await;
    let at_bounds = Hello {
        proxy_id: "p".repeat(256),
        instance: "i".repeat(256),
        shard: labels(16, 63, 63),
        ..Hello::default()
    };
    tx.send(proxy_message(Message::Hello(at_bounds))).await.unwrap();
    assert_eq!(next(&mut stream).await.version, 1);
    drop(tx);
    node.shutdown().await.unwrap();
}

/// A NACK's reason is kept (and logged) cut to a bound, on a character boundary.
#[tokio::test]
async fn a_long_nack_reason_is_kept_cut() {
    let dir = tempfile::tempdir().unwrap();
    let (node, mut admin) = at_version_one(dir.path()).await;
    let (tx, mut stream) = subscribe(node.local_addr()).await;
    let hello = Hello {
        proxy_id: "edge-1".into(),
        ..Hello::default()
    };
    tx.send(proxy_message(Message::Hello(hello))).await.unwrap();
    assert_eq!(next(&mut stream).await.version, 1);
    let nack = Nack {
        version: 1,
        reason: format!("x{}", "é".repeat(1 << 20)),
    };
    tx.send(proxy_message(Message::Nack(nack))).await.unwrap();
    let status = wait_status(&mut admin, |s| proxy(s).is_some_and(|p| !p.healthy)).await;
    let kept = &proxy(&status).unwrap().last_error;
    let expected = format!("version 1: x{}", "é".repeat((MAX_REASON_BYTES - 1) / 2));
    assert_eq!(kept.len(), expected.len());
    assert_eq!(kept, &expected);
    drop(tx);
    node.shutdown().await.unwrap();
}
