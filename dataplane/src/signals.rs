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
        let mut batches = SignalStreamClient::new(channel)
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
