//! PlacementExchange on real nodes (gRPC on loopback): placements reach the other proxies of
//! the node and of the other members, never their sender, and bad reports end the stream
//! with the reason.

use std::time::Duration;

use portcullis_proto::v1::placement_exchange_client::PlacementExchangeClient;
use portcullis_proto::v1::placement_report::Message;
use portcullis_proto::v1::{AddNodeRequest, Placement, PlacementBatch, PlacementHello, PlacementReport};
use portcullis_proto::MAX_PLACEMENTS_PER_BATCH;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status, Streaming};

use crate::testutil::*;
use crate::ControlPlane;

fn pool(name: &str) -> serde_json::Value {
    // Nothing listens at the endpoint: placements need the pool, not its pods.
    json!({"apiVersion": "portcullis.dev/v1alpha1", "kind": "InferencePool", "metadata": {"name": name},
        "spec": {"endpoints": ["127.0.0.1:9"], "models": [{"name": "m"}]}})
}

fn hello(proxy_id: &str) -> PlacementReport {
    PlacementReport {
        message: Some(Message::Hello(PlacementHello {
            proxy_id: proxy_id.into(),
            ..PlacementHello::default()
        })),
    }
}

fn batch(placements: Vec<Placement>) -> PlacementReport {
    PlacementReport {
        message: Some(Message::Batch(PlacementBatch { placements })),
    }
}

fn placement(pool: &str, first_hash: u64) -> Placement {
    Placement {
        pool: pool.into(),
        endpoint: "127.0.0.1:9".into(),
        prompt_hashes: vec![first_hash, 2, 3],
        withdrawn: false,
    }
}

type Exchange = (mpsc::Sender<PlacementReport>, Streaming<PlacementBatch>);

async fn exchange(node: &ControlPlane, first: PlacementReport) -> Result<Exchange, Status> {
    let mut client = PlacementExchangeClient::connect(format!("http://{}", node.local_addr()))
        .await
        .unwrap();
    let (reports, outgoing) = mpsc::channel(16);
    reports.send(first).await.unwrap();
    let incoming = client.exchange(ReceiverStream::new(outgoing)).await?.into_inner();
    Ok((reports, incoming))
}

/// Sends `placement` from `from` until `to` receives it (a member's relay may still be
/// connecting); panics after 30 s.
async fn relayed(from: &Exchange, to: &mut Exchange, placement: &Placement) {
    let arrived = async {
        loop {
            from.0.send(batch(vec![placement.clone()])).await.unwrap();
            if let Ok(message) = tokio::time::timeout(Duration::from_millis(200), to.1.message()).await {
                let got = message.unwrap().expect("the stream stays open");
                if got.placements.contains(placement) {
                    return;
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), arrived)
        .await
        .expect("the placement was relayed");
}

/// Nothing arrives on `exchange` for a while.
async fn silent(exchange: &mut Exchange) {
    let heard = tokio::time::timeout(Duration::from_millis(300), exchange.1.message()).await;
    assert!(heard.is_err(), "expected nothing, got {heard:?}");
}

#[tokio::test]
async fn placements_reach_every_other_proxy_on_every_member_but_not_the_sender() {
    let dirs: Vec<_> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let first = start(dirs[0].path(), 1, false).await;
    let mut client = admin(first.local_addr()).await;
    wait_for_leader(&mut client).await;
    let second = start(dirs[1].path(), 2, true).await;
    client
        .add_node(AddNodeRequest {
            node_id: 2,
            address: second.local_addr().to_string(),
        })
        .await
        .unwrap();
    let applied = client
        .apply(apply_request(vec![pool("qwen")], None))
        .await
        .unwrap()
        .into_inner()
        .version;
    // The second node knows the pool before its proxies connect.
    let mut on_second = admin(second.local_addr()).await;
    wait_status(&mut on_second, |status| status.version >= applied).await;

    let mut a = exchange(&first, hello("a")).await.unwrap();
    let mut b = exchange(&first, hello("b")).await.unwrap();
    let mut c = exchange(&second, hello("c")).await.unwrap();

    // A's placement: to B on the same node, to C through the second node.
    let from_a = placement("qwen", 1);
    relayed(&a, &mut c, &from_a).await;
    relayed(&a, &mut b, &from_a).await;
    // C's placement comes back the other way.
    let from_c = placement("qwen", 2);
    relayed(&c, &mut a, &from_c).await;
    // A placement goes to everyone but its sender, and a pool nobody has goes to nobody.
    // (Batches the retries above left in flight may still arrive: they are skipped.)
    let from_b = placement("qwen", 3);
    b.0.send(batch(vec![from_b.clone(), placement("elsewhere", 4)]))
        .await
        .unwrap();
    for receiver in [&mut a, &mut c] {
        let arrived = async {
            loop {
                let got = receiver
                    .1
                    .message()
                    .await
                    .unwrap()
                    .expect("the stream stays open");
                assert!(got.placements.iter().all(|p| p.pool == "qwen"), "{got:?}");
                if got.placements.contains(&from_b) {
                    return;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(30), arrived)
            .await
            .expect("B's placement arrives");
    }
    // B hears only the others' retries, never its own placement.
    while let Ok(Ok(Some(got))) = tokio::time::timeout(Duration::from_millis(300), b.1.message()).await {
        assert!(!got.placements.contains(&from_b), "B got its own placement back");
    }

    second.shutdown().await.unwrap();
    first.shutdown().await.unwrap();
}

#[tokio::test]
async fn bad_reports_end_the_stream_with_the_reason_and_reach_no_one() {
    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut client = admin(node.local_addr()).await;
    wait_for_leader(&mut client).await;
    client
        .apply(apply_request(vec![pool("qwen")], None))
        .await
        .unwrap();
    let mut listening = exchange(&node, hello("listening")).await.unwrap();

    let status = exchange(&node, batch(vec![placement("qwen", 1)]))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("first PlacementReport must be a hello"),
        "{status:?}"
    );
    let status = exchange(&node, hello("")).await.map(|_| ()).unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("neither a proxy"), "{status:?}");

    let too_many = vec![placement("qwen", 1); MAX_PLACEMENTS_PER_BATCH + 1];
    let too_long = Placement {
        prompt_hashes: vec![7; 10_000],
        ..placement("qwen", 1)
    };
    for (bad, reason) in [
        (batch(too_many), "at most 256 placements"),
        (batch(vec![too_long]), "at most 256 prompt hashes"),
        (hello("again"), "must be a batch"),
        (batch(vec![placement("", 1)]), "needs a pool and an endpoint"),
    ] {
        let mut sender = exchange(&node, hello("bad")).await.unwrap();
        sender.0.send(bad).await.unwrap();
        let status = tokio::time::timeout(Duration::from_secs(10), sender.1.message())
            .await
            .expect("the stream ends")
            .unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(
            status.message().contains(reason),
            "{status:?} should say {reason:?}"
        );
    }
    silent(&mut listening).await;
    node.shutdown().await.unwrap();
}
