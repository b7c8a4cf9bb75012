//! The signals group on real nodes (gRPC on loopback): collection, replication to every
//! node, the stream, and a new leader that starts with the readings it replicated.
//!
//! The pods are a few lines of HTTP serving a vLLM-shaped `/metrics` body whose queue length
//! the test sets: vLLM itself needs a GPU, and the control plane reads nothing else from it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use portcullis_proto::v1::signal_stream_client::SignalStreamClient;
use portcullis_proto::v1::{AddNodeRequest, SignalBatch, SignalSubscription};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tonic::Streaming;

use crate::testutil::*;
use crate::ControlPlane;

/// Serves `vllm:num_requests_waiting` = the current value of `waiting`, keep-alive.
async fn metrics_pod(waiting: Arc<AtomicU32>) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let waiting = waiting.clone();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buffer = [0u8; 1024];
                loop {
                    let Ok(read) = socket.read(&mut buffer).await else {
                        return;
                    };
                    if read == 0 {
                        return;
                    }
                    request.extend_from_slice(&buffer[..read]);
                    while let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                        request.drain(..end + 4);
                        let body = format!(
                            "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"m\"}} {}\n\
                             vllm:num_requests_running{{model_name=\"m\"}} 1\nvllm:kv_cache_usage_perc{{model_name=\"m\"}} 0.25\n",
                            waiting.load(Ordering::Relaxed)
                        );
                        let response = format!(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if socket.write_all(response.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, task)
}

fn pool(endpoint: SocketAddr) -> serde_json::Value {
    json!({"apiVersion": "portcullis.dev/v1alpha1", "kind": "InferencePool", "metadata": {"name": "qwen"},
        "spec": {"endpoints": [endpoint.to_string()], "models": [{"name": "m"}]}})
}

async fn signals(node: &ControlPlane) -> Streaming<SignalBatch> {
    let mut client = SignalStreamClient::connect(format!("http://{}", node.local_addr()))
        .await
        .unwrap();
    client
        .subscribe(SignalSubscription {
            proxy_id: "test".into(),
            shard: Default::default(),
        })
        .await
        .unwrap()
        .into_inner()
}

/// Reads batches until the pod shows `waiting`; returns that pod's age.
async fn wait_for_waiting(stream: &mut Streaming<SignalBatch>, endpoint: SocketAddr, waiting: u32) -> u32 {
    let endpoint = endpoint.to_string();
    let found = async {
        loop {
            let batch = stream.message().await.unwrap().expect("the stream stays open");
            for pool in &batch.pools {
                assert_eq!(pool.pool, "qwen");
                for pod in &pool.pods {
                    if pod.endpoint == endpoint && pod.waiting == waiting {
                        assert_eq!((pod.running, pod.kv_cache_usage), (1, 0.25));
                        return pod.age_ms;
                    }
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), found)
        .await
        .unwrap_or_else(|_| panic!("no batch with waiting = {waiting}"))
}

#[tokio::test]
async fn signals_reach_every_node_and_outlive_their_leader() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let first = start(dirs[0].path(), 1, false).await;
    let mut client = admin(first.local_addr()).await;
    wait_for_leader(&mut client).await;
    let mut others = Vec::new();
    for (id, dir) in [(2, &dirs[1]), (3, &dirs[2])] {
        let node = start(dir.path(), id, true).await;
        let add = AddNodeRequest {
            node_id: id,
            address: node.local_addr().to_string(),
        };
        client.add_node(add).await.unwrap();
        others.push(node);
    }

    let waiting = Arc::new(AtomicU32::new(7));
    let (pod, pod_task) = metrics_pod(waiting.clone()).await;
    client.apply(apply_request(vec![pool(pod)], None)).await.unwrap();

    // Collected on the leader, replicated, and served by a follower's stream.
    let mut on_third = signals(&others[1]).await;
    wait_for_waiting(&mut on_third, pod, 7).await;
    waiting.store(9, Ordering::Relaxed);
    let age = wait_for_waiting(&mut on_third, pod, 9).await;
    // Read every 50 ms: a broken age (a timestamp taken for an age, a clock mixed up) is
    // far beyond this bound, which a slow machine cannot reach. The arithmetic itself is
    // checked in `store/tests.rs`.
    assert!(age < 5_000, "a fresh reading is not {age} ms old");

    // The pod stops answering and the leader goes: the next leader still holds the last
    // readings and serves them to a new subscriber at once.
    pod_task.abort();
    first.shutdown().await.unwrap();
    let mut second = admin(others[0].local_addr()).await;
    wait_status(&mut second, |status| {
        status
            .cluster
            .as_ref()
            .is_some_and(|c| c.leader_id.is_some_and(|leader| leader != 1))
    })
    .await;
    let mut on_second = signals(&others[0]).await;
    wait_for_waiting(&mut on_second, pod, 9).await;

    for node in others {
        node.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn a_pool_outside_the_shard_is_not_sent() {
    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut client = admin(node.local_addr()).await;
    wait_for_leader(&mut client).await;
    let (pod, _pod_task) = metrics_pod(Arc::new(AtomicU32::new(3))).await;
    client.apply(apply_request(vec![pool(pod)], None)).await.unwrap();
    let mut everything = signals(&node).await;
    wait_for_waiting(&mut everything, pod, 3).await;

    let mut sharded = SignalStreamClient::connect(format!("http://{}", node.local_addr()))
        .await
        .unwrap()
        .subscribe(SignalSubscription {
            proxy_id: "edge".into(),
            shard: [("zone".to_string(), "edge".to_string())].into(),
        })
        .await
        .unwrap()
        .into_inner();
    // Several rounds pass on the unsharded stream while the sharded one stays silent.
    for _ in 0..5 {
        wait_for_waiting(&mut everything, pod, 3).await;
    }
    let silent = tokio::time::timeout(Duration::from_millis(100), sharded.message()).await;
    assert!(silent.is_err(), "a proxy outside the pool's shard got {silent:?}");
    node.shutdown().await.unwrap();
}

#[tokio::test]
async fn pools_whose_strategy_reads_no_signals_are_not_scraped() {
    let dir = tempfile::tempdir().unwrap();
    let node = start(dir.path(), 1, false).await;
    let mut client = admin(node.local_addr()).await;
    wait_for_leader(&mut client).await;
    let (pod, _pod_task) = metrics_pod(Arc::new(AtomicU32::new(4))).await;
    // A pod of a RoundRobin pool counts who connects to it.
    let plain = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let plain_address = plain.local_addr().unwrap();
    let asked = Arc::new(AtomicU32::new(0));
    let counting = asked.clone();
    let _plain_task = tokio::spawn(async move {
        while let Ok((_socket, _)) = plain.accept().await {
            counting.fetch_add(1, Ordering::Relaxed);
        }
    });
    let rotating = json!({"apiVersion": "portcullis.dev/v1alpha1", "kind": "InferencePool", "metadata": {"name": "rotating"},
        "spec": {"endpoints": [plain_address.to_string()], "models": [{"name": "r"}], "picker": {"strategy": "RoundRobin"}}});
    client
        .apply(apply_request(vec![pool(pod), rotating], None))
        .await
        .unwrap();
    // Rounds of the Scored pool come and go (and no batch names the other pool).
    let mut stream = signals(&node).await;
    for _ in 0..5 {
        wait_for_waiting(&mut stream, pod, 4).await;
    }
    assert_eq!(
        asked.load(Ordering::Relaxed),
        0,
        "the RoundRobin pool's pod was read"
    );
    node.shutdown().await.unwrap();
}
