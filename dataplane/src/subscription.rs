//! The control-plane client: receive snapshots, apply, acknowledge; reconnect forever.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use portcullis_proto::v1::config_stream_client::ConfigStreamClient;
use portcullis_proto::v1::proxy_message::Message;
use portcullis_proto::v1::{Ack, Hello, Nack, ProxyMessage};
use rand::Rng;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Endpoint;

use crate::config_state::ConfigState;

/// A whole config version arrives as one message; tonic's 4 MiB default would refuse a
/// large config. Matches the control plane's limit.
const MAX_SNAPSHOT_BYTES: usize = 64 * 1024 * 1024;

const FIRST_RETRY: Duration = Duration::from_millis(100);
const MAX_RETRY: Duration = Duration::from_secs(5);

pub(crate) struct Subscriber {
    pub(crate) state: Arc<ConfigState>,
    pub(crate) controlplane: Endpoint,
    pub(crate) proxy_id: String,
    pub(crate) shard: BTreeMap<String, String>,
}

impl Subscriber {
    /// Never returns: losing the control plane only means serving the last good config
    /// until it is back.
    pub(crate) async fn run(self) {
        let mut backoff = FIRST_RETRY;
        loop {
            let mut received = 0;
            match self.session(&mut received).await {
                Ok(()) => {
                    tracing::warn!(controlplane = %self.controlplane.uri(), "config stream closed by the control plane")
                }
                Err(error) => {
                    tracing::warn!(controlplane = %self.controlplane.uri(), %error, "config stream failed")
                }
            }
            if received > 0 {
                backoff = FIRST_RETRY;
            }
            // Jitter keeps a fleet of proxies from reconnecting in lockstep.
            let delay = backoff.mul_f64(rand::rng().random_range(0.5..=1.0));
            tokio::time::sleep(delay).await;
            backoff = (backoff * 2).min(MAX_RETRY);
        }
    }

    /// One stream, counting the snapshots it delivered.
    async fn session(&self, received: &mut usize) -> anyhow::Result<()> {
        let channel = self
            .controlplane
            .clone()
            .connect_timeout(Duration::from_secs(5))
            // The stream is idle while the config does not change: pings are what notice a
            // control plane that vanished without closing the connection.
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true)
            .connect()
            .await?;
        let mut client = ConfigStreamClient::new(channel).max_decoding_message_size(MAX_SNAPSHOT_BYTES);
        let (outbound, outbound_stream) = mpsc::channel(8);
        let hello = Hello {
            proxy_id: self.proxy_id.clone(),
            shard: self.shard.clone().into_iter().collect(),
            last_version: self.state.current().version.unwrap_or(0),
        };
        outbound
            .send(ProxyMessage {
                message: Some(Message::Hello(hello)),
            })
            .await?;
        let mut snapshots = client
            .subscribe(ReceiverStream::new(outbound_stream))
            .await?
            .into_inner();
        while let Some(snapshot) = snapshots.message().await? {
            *received += 1;
            let reply = match self.state.apply_wire(snapshot.version, &snapshot.objects).await {
                Ok(()) => Message::Ack(Ack {
                    version: snapshot.version,
                }),
                Err(error) => {
                    tracing::warn!(version = snapshot.version, %error, "rejected config version");
                    Message::Nack(Nack {
                        version: snapshot.version,
                        reason: error.to_string(),
                    })
                }
            };
            outbound.send(ProxyMessage { message: Some(reply) }).await?;
        }
        Ok(())
    }
}
