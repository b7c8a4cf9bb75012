//! Helpers for tests that run real control-plane nodes on tempdirs and 127.0.0.1:0.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use portcullis_proto::v1::admin_client::AdminClient;
use portcullis_proto::v1::config_stream_client::ConfigStreamClient;
use portcullis_proto::v1::proxy_message::Message;
use portcullis_proto::v1::{
    ApplyRequest, ConfigSnapshot, Object, ProxyMessage, StatusRequest, StatusResponse,
};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Streaming;

use crate::{ControlPlane, ControlPlaneConfig};

pub async fn start(data_dir: &Path, node_id: u64, join: bool) -> ControlPlane {
    ControlPlane::start(ControlPlaneConfig {
        node_id,
        listen: "127.0.0.1:0".parse().unwrap(),
        advertise: None,
        data_dir: data_dir.to_path_buf(),
        join,
        metrics_listen: None,
        forget_proxies_after: crate::DEFAULT_FORGET_AFTER,
    })
    .await
    .unwrap()
}

pub async fn admin(addr: SocketAddr) -> AdminClient<Channel> {
    AdminClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_decoding_message_size(portcullis_proto::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(portcullis_proto::MAX_MESSAGE_BYTES)
}

/// Polls Status until `done` holds, failing the test after 15 s.
pub async fn wait_status(
    client: &mut AdminClient<Channel>,
    done: impl Fn(&StatusResponse) -> bool,
) -> StatusResponse {
    for _ in 0..150 {
        let status = client
            .status(StatusRequest::default())
            .await
            .unwrap()
            .into_inner();
        if done(&status) {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("condition on Status not reached");
}

pub async fn wait_for_leader(client: &mut AdminClient<Channel>) {
    wait_status(client, |status| {
        status.cluster.as_ref().is_some_and(|c| c.leader_id.is_some())
    })
    .await;
}

pub fn proxy_message(message: Message) -> ProxyMessage {
    ProxyMessage {
        message: Some(message),
    }
}

/// Opens a config stream as a proxy would; messages go in through the sender.
pub async fn subscribe(addr: SocketAddr) -> (mpsc::Sender<ProxyMessage>, Streaming<ConfigSnapshot>) {
    let mut client = ConfigStreamClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let (tx, rx) = mpsc::channel(8);
    let stream = client
        .subscribe(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, stream)
}

pub fn wire(value: serde_json::Value) -> Object {
    Object {
        kind: String::new(),
        name: String::new(),
        json: value.to_string().into_bytes().into(),
    }
}

pub fn listener(name: &str, port: u16, labels: serde_json::Value) -> serde_json::Value {
    json!({"apiVersion": "portcullis.dev/v1alpha1", "kind": "Listener",
        "metadata": {"name": name, "labels": labels}, "spec": {"port": port}})
}

pub fn apply_request(objects: Vec<serde_json::Value>, expected_version: Option<u64>) -> ApplyRequest {
    ApplyRequest {
        objects: objects.into_iter().map(wire).collect(),
        expected_version,
    }
}
