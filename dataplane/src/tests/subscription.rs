//! The subscription against a real gRPC server playing the control plane's part.

use std::time::Duration;

use portcullis_config::Object;
use portcullis_proto::v1::config_stream_server::{ConfigStream, ConfigStreamServer};
use portcullis_proto::v1::proxy_message::Message;
use portcullis_proto::v1::{self as proto, ConfigSnapshot, ProxyMessage};
use tokio::sync::{mpsc, Mutex};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};

use super::support::*;
use crate::{Proxy, ProxyConfig};

/// Hands each subscription to the test, which scripts the snapshots and reads the replies.
struct ScriptedControlPlane {
    sessions: mpsc::Sender<Session>,
}

struct Session {
    from_proxy: Streaming<ProxyMessage>,
    to_proxy: mpsc::Sender<Result<ConfigSnapshot, Status>>,
}

#[tonic::async_trait]
impl ConfigStream for ScriptedControlPlane {
    type SubscribeStream = ReceiverStream<Result<ConfigSnapshot, Status>>;

    async fn subscribe(
        &self,
        request: Request<Streaming<ProxyMessage>>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let (to_proxy, stream) = mpsc::channel(4);
        let session = Session {
            from_proxy: request.into_inner(),
            to_proxy,
        };
        self.sessions
            .send(session)
            .await
            .map_err(|_| Status::unavailable("test over"))?;
        Ok(Response::new(ReceiverStream::new(stream)))
    }
}

fn snapshot(version: u64, objects: &[Object]) -> ConfigSnapshot {
    ConfigSnapshot {
        version,
        objects: objects
            .iter()
            .map(|object| proto::Object {
                kind: object.kind().to_string(),
                name: object.name().to_string(),
                json: object.to_json_bytes().into(),
            })
            .collect(),
        base_version: None,
        removed: Vec::new(),
        takes_findings: false,
    }
}

/// A delta against `base` that deletes `removed` (as `Kind/name`).
fn delta(version: u64, base: u64, removed: &[&str]) -> ConfigSnapshot {
    ConfigSnapshot {
        version,
        objects: Vec::new(),
        base_version: Some(base),
        takes_findings: false,
        removed: removed
            .iter()
            .map(|key| {
                let (kind, name) = key.split_once('/').unwrap();
                proto::ObjectRef {
                    kind: kind.into(),
                    name: name.into(),
                }
            })
            .collect(),
    }
}

async fn expect_nack(session: &mut Session, version: u64, reason: &str) {
    match session.reply().await {
        Message::Nack(nack) => {
            assert_eq!(nack.version, version);
            assert!(nack.reason.contains(reason), "{}", nack.reason);
        }
        other => panic!("expected Nack, got {other:?}"),
    }
}

impl Session {
    async fn send(&self, snapshot: ConfigSnapshot) {
        self.to_proxy.send(Ok(snapshot)).await.unwrap();
    }

    async fn reply(&mut self) -> Message {
        let next = tokio::time::timeout(Duration::from_secs(10), self.from_proxy.message());
        next.await.unwrap().unwrap().unwrap().message.unwrap()
    }
}

#[tokio::test]
async fn acks_applied_versions_nacks_bad_ones_and_resubscribes_after_a_disconnect() {
    let upstream = spawn_upstream(|_request| async { text("hello") }).await;
    let port = free_port();
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc_address = grpc.local_addr().unwrap();
    let (sessions_tx, sessions) = mpsc::channel(1);
    let sessions = Mutex::new(sessions);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(ConfigStreamServer::new(ScriptedControlPlane {
                sessions: sessions_tx,
            }))
            .serve_with_incoming(TcpListenerStream::new(grpc)),
    );
    let proxy = Proxy::start(ProxyConfig {
        proxy_id: "edge-1".into(),
        controlplanes: vec![format!("http://{grpc_address}")],
        shard: [("zone".to_string(), "a".to_string())].into(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        cache_dir: None,
        drain_grace: Duration::from_secs(1),
        workers: 2,
        peer_address: None,
        telemetry: super::support::quiet_telemetry(),
    })
    .await
    .unwrap();

    let mut session = sessions.lock().await.recv().await.unwrap();
    match session.reply().await {
        Message::Hello(hello) => {
            assert_eq!(hello.proxy_id, "edge-1");
            assert_eq!(hello.shard.get("zone").map(String::as_str), Some("a"));
            assert_eq!(hello.last_version, 0);
            assert!(hello.accepts_deltas);
        }
        other => panic!("expected Hello, got {other:?}"),
    }
    let good = simple_config(port, upstream, "");
    session.send(snapshot(1, &good)).await;
    assert_eq!(session.reply().await, Message::Ack(proto::Ack { version: 1 }));
    assert_eq!(get(port, "/").await, (200, "hello".to_string()));

    session.send(snapshot(1, &good)).await;
    assert_eq!(session.reply().await, Message::Ack(proto::Ack { version: 1 }));

    let mut broken = snapshot(2, &good);
    broken.objects[0].json = b"{not json".to_vec().into();
    session.send(broken).await;
    expect_nack(&mut session, 2, "not valid JSON").await;
    assert_eq!(get(port, "/").await.0, 200);

    // Deltas apply to the version held, whole or not at all.
    session.send(delta(2, 1, &["Route/all"])).await;
    assert_eq!(session.reply().await, Message::Ack(proto::Ack { version: 2 }));
    assert_eq!(get(port, "/").await.0, 404);
    session.send(delta(3, 1, &[])).await;
    expect_nack(&mut session, 3, "this proxy holds version 2").await;
    session.send(delta(3, 2, &["Route/all"])).await;
    expect_nack(
        &mut session,
        3,
        "removes Route/all, which this proxy does not hold",
    )
    .await;
    session.send(snapshot(3, &good)).await;
    assert_eq!(session.reply().await, Message::Ack(proto::Ack { version: 3 }));
    assert_eq!(get(port, "/").await.0, 200);

    // The control plane drops the stream: the proxy keeps serving and comes back.
    drop(session);
    let mut session = sessions.lock().await.recv().await.unwrap();
    match session.reply().await {
        Message::Hello(hello) => assert_eq!(hello.last_version, 3),
        other => panic!("expected Hello, got {other:?}"),
    }
    assert_eq!(get(port, "/").await.0, 200);
    proxy.shutdown().await.unwrap();
}

/// Every node would refuse such a Hello: the proxy says so instead of starting to wait.
#[tokio::test]
async fn an_id_or_shard_the_control_plane_would_refuse_stops_the_start() {
    let config = |proxy_id: String, shard: Vec<(String, String)>| ProxyConfig {
        proxy_id,
        controlplanes: vec![format!("http://127.0.0.1:{}", free_port())],
        shard: shard.into_iter().collect(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        cache_dir: None,
        drain_grace: Duration::from_secs(1),
        workers: 1,
        peer_address: None,
        telemetry: quiet_telemetry(),
    };
    for (proxy_id, shard, expected) in [
        ("p".repeat(257), vec![], "Hello.proxy_id is 257 bytes"),
        (
            "edge".to_string(),
            vec![("zone".to_string(), "z".repeat(64))],
            "Hello.shard label \"zone\"",
        ),
    ] {
        let error = match Proxy::start(config(proxy_id, shard)).await {
            Ok(_) => panic!("started"),
            Err(error) => format!("{error:#}"),
        };
        assert!(error.contains(expected), "{error}");
    }
}
