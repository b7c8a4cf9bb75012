//! Pod signals from the control plane's SignalStream, handed to the pickers of the live
//! config version. A batch holds whole scrape rounds; each pool's round is applied under its
//! picker's lock at once, so a pick sees one round or the next, never a mix.

use std::collections::BTreeMap;
use std::sync::Arc;

use portcullis_proto::v1::signal_stream_client::SignalStreamClient;
use portcullis_proto::v1::SignalSubscription;
use tonic::transport::Endpoint;

use crate::config_state::ConfigState;
use crate::subscription::{connect, ControlPlanes, Stream};

pub(crate) struct SignalSubscriber {
    pub(crate) state: Arc<ConfigState>,
    pub(crate) controlplanes: Arc<ControlPlanes>,
    pub(crate) proxy_id: String,
    pub(crate) shard: BTreeMap<String, String>,
}

impl Stream for SignalSubscriber {
    const NAME: &'static str = "signal";

    fn controlplanes(&self) -> &ControlPlanes {
        &self.controlplanes
    }

    async fn session(&self, controlplane: &Endpoint, received: &mut usize) -> anyhow::Result<()> {
        let channel = connect(controlplane).await?;
        // A batch carries every moved pool of the shard, well past tonic's 4 MiB default
        // when pods list many LoRA adapters; the control plane sends up to this limit.
        let mut batches = SignalStreamClient::new(channel)
            .max_decoding_message_size(portcullis_proto::MAX_MESSAGE_BYTES)
            .subscribe(SignalSubscription {
                proxy_id: self.proxy_id.clone(),
                shard: self.shard.clone().into_iter().collect(),
            })
            .await?
            .into_inner();
        while let Some(batch) = batches.message().await? {
            *received += 1;
            // Pools this version does not have are skipped: their round comes again with
            // the next batch, by which time the version that has them is live.
            let snapshot = self.state.current();
            for pool in &batch.pools {
                if let Some(target) = snapshot.pool(&pool.pool) {
                    target.observe(&pool.pods);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use portcullis_proto::v1::signal_stream_server::{SignalStream, SignalStreamServer};
    use portcullis_proto::v1::{LoraSignals, PodSignals, PoolSignals, SignalBatch, SignalSubscription};
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
    use tonic::{Request, Response, Status};

    use crate::tests::support::*;
    use crate::{Proxy, ProxyConfig};

    /// Plays the control plane: sends the batch to every subscriber, again after each
    /// interval, as rounds come.
    struct Rounds(SignalBatch, Duration);

    #[tonic::async_trait]
    impl SignalStream for Rounds {
        type SubscribeStream = ReceiverStream<Result<SignalBatch, Status>>;

        async fn subscribe(
            &self,
            _request: Request<SignalSubscription>,
        ) -> Result<Response<Self::SubscribeStream>, Status> {
            let (to_proxy, stream) = mpsc::channel(1);
            let (batch, interval) = (self.0.clone(), self.1);
            tokio::spawn(async move {
                while to_proxy.send(Ok(batch.clone())).await.is_ok() {
                    tokio::time::sleep(interval).await;
                }
            });
            Ok(Response::new(ReceiverStream::new(stream)))
        }
    }

    #[tokio::test]
    async fn a_batch_beyond_tonics_default_limit_reaches_the_picker() {
        let pod = "127.0.0.1:9";
        // Another pool of the shard whose pods each list as many adapters, as long, as the
        // control plane lets through: the whole batch is over tonic's 4 MiB default.
        let adapters: Vec<String> = (0..64).map(|n| format!("{n:0>256}")).collect();
        let crowded = PoolSignals {
            pool: "crowded".into(),
            pods: (0..160)
                .map(|n| PodSignals {
                    endpoint: format!("10.0.0.{n}:8000"),
                    lora: Some(LoraSignals {
                        max_loras: 64,
                        running: adapters.clone(),
                        waiting: adapters.clone(),
                    }),
                    ..PodSignals::default()
                })
                .collect(),
        };
        let adapter_bytes: usize = crowded
            .pods
            .iter()
            .filter_map(|pod| pod.lora.as_ref())
            .map(|lora| {
                lora.running
                    .iter()
                    .chain(&lora.waiting)
                    .map(String::len)
                    .sum::<usize>()
            })
            .sum();
        assert!(adapter_bytes > 4 * 1024 * 1024, "{adapter_bytes} bytes");
        let qwen = PoolSignals {
            pool: "qwen".into(),
            pods: vec![PodSignals {
                endpoint: pod.into(),
                waiting: 7,
                ..PodSignals::default()
            }],
        };
        let batch = SignalBatch {
            generation: 1,
            pools: vec![crowded, qwen],
        };
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc_address = grpc.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(SignalStreamServer::new(Rounds(batch, Duration::from_millis(50))))
                .serve_with_incoming(TcpListenerStream::new(grpc)),
        );
        let proxy = Proxy::start(ProxyConfig {
            proxy_id: "edge-1".into(),
            controlplanes: vec![format!("http://{grpc_address}")],
            shard: Default::default(),
            admin_listen: "127.0.0.1:0".parse().unwrap(),
            cache_dir: None,
            drain_grace: Duration::from_secs(1),
            workers: 2,
            peer_address: None,
            telemetry: quiet_telemetry(),
        })
        .await
        .unwrap();
        proxy
            .state
            .apply(1, llm_config(free_port(), pod, "", ""))
            .await
            .unwrap();

        let admin = proxy.admin_addr().port();
        eventually("the pod's signals reach the picker", || async {
            let (status, body) = get(admin, "/signals?pool=qwen").await;
            let report: serde_json::Value = serde_json::from_str(&body).unwrap();
            status == 200 && report["pools"]["qwen"]["endpoints"][pod]["signals"]["waiting"] == 7
        })
        .await;
        proxy.shutdown().await.unwrap();
    }

    #[tokio::test]
    async fn an_edited_pool_keeps_its_pods_signals_and_in_flight_counts() {
        // The pod answers once the test lets it.
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let pod = spawn_upstream({
            let gate = gate.clone();
            move |_| {
                let gate = gate.clone();
                async move {
                    gate.acquire().await.unwrap().forget();
                    text(r#"{"choices": []}"#)
                }
            }
        })
        .await
        .to_string();
        // One round, then none for as long as the test runs: the edit falls between two.
        let batch = SignalBatch {
            generation: 1,
            pools: vec![PoolSignals {
                pool: "qwen".into(),
                pods: vec![PodSignals {
                    endpoint: pod.clone(),
                    ..PodSignals::default()
                }],
            }],
        };
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc_address = grpc.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(SignalStreamServer::new(Rounds(batch, Duration::from_secs(3600))))
                .serve_with_incoming(TcpListenerStream::new(grpc)),
        );
        let proxy = Proxy::start(ProxyConfig {
            proxy_id: "edge-1".into(),
            controlplanes: vec![format!("http://{grpc_address}")],
            shard: Default::default(),
            admin_listen: "127.0.0.1:0".parse().unwrap(),
            cache_dir: None,
            drain_grace: Duration::from_secs(1),
            workers: 2,
            peer_address: None,
            telemetry: quiet_telemetry(),
        })
        .await
        .unwrap();
        let port = free_port();
        let config = |aliases: &str| {
            objects(&format!(
                "{}---
apiVersion: portcullis.dev/v1alpha1
kind: InferencePool
metadata: {{name: qwen}}
spec:
  endpoints: ['{pod}']
  models: [{{name: m, aliases: [{aliases}]}}]
  failureMode: FailClose
  signals: {{interval: 10s}}
  picker: {{staleness: 20s}}
---
apiVersion: portcullis.dev/v1alpha1
kind: Route
metadata: {{name: llm}}
spec: {{listeners: [web], backends: [{{kind: InferencePool, name: qwen}}]}}
",
                listener("web", port)
            ))
        };
        proxy.state.apply(1, config("")).await.unwrap();
        let admin = proxy.admin_addr().port();
        let endpoint = |report: &serde_json::Value| report["pools"]["qwen"]["endpoints"][&pod].clone();
        let pod_report = || async {
            let (_, body) = get(admin, "/signals?pool=qwen").await;
            endpoint(&serde_json::from_str(&body).unwrap())
        };
        eventually("the pod's signals reach the picker", || async {
            pod_report().await["signals"]["fresh"] == true
        })
        .await;
        let complete = |model: &'static str| async move {
            let body =
                format!(r#"{{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}]}}"#);
            let request = http::Request::post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                .unwrap();
            status_and_text(http1_client().request(request).await.unwrap()).await
        };
        let held = tokio::spawn(complete("m"));
        eventually("the request is in flight", || async {
            pod_report().await["inFlight"] == 1
        })
        .await;

        proxy.state.apply(2, config("qwen")).await.unwrap();
        let report = pod_report().await;
        assert_eq!(report["signals"]["fresh"], true, "{report}");
        assert_eq!(report["inFlight"], 1, "{report}");
        gate.add_permits(2);
        assert_eq!(held.await.unwrap().0, 200);
        eventually("the request's end reaches the new version's count", || async {
            pod_report().await["inFlight"] == 0
        })
        .await;
        let (status, body) = complete("qwen").await;
        assert_eq!(status, 200, "{body}");
        proxy.shutdown().await.unwrap();
    }
}
