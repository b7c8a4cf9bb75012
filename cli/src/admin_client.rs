//! Admin API client that follows the leader: a follower answers writes with UNAVAILABLE
//! and the leader's address, and the call is retried there.

use std::future::Future;
use std::time::Duration;

use portcullis_proto::v1::admin_client::AdminClient;
use portcullis_proto::{LEADER_METADATA_KEY, MAX_MESSAGE_BYTES};
use tonic::transport::Channel;

/// How many leader redirects one call follows before giving up (an election in progress
/// can bounce a call once or twice).
const MAX_REDIRECTS: usize = 3;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Above the control plane's own deadlines, so its clearer error arrives first: the longest
/// call, adding a node, waits up to 10 s for it to catch up between two membership changes
/// that each have a commit deadline.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

pub struct Admin {
    endpoint: String,
}

impl Admin {
    pub fn new(endpoint: &str) -> Self {
        Self {
            endpoint: with_scheme(endpoint),
        }
    }

    pub async fn call<T, F, Fut>(&self, mut call: F) -> anyhow::Result<T>
    where
        F: FnMut(AdminClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let mut endpoint = self.endpoint.clone();
        for _ in 0..=MAX_REDIRECTS {
            let channel = Channel::from_shared(endpoint.clone())
                .map_err(|error| anyhow::anyhow!("invalid control-plane address {endpoint:?}: {error}"))?
                .connect_timeout(CONNECT_TIMEOUT)
                .timeout(CALL_TIMEOUT)
                .connect()
                .await
                .map_err(|error| anyhow::anyhow!("cannot reach the control plane at {endpoint}: {error}"))?;
            let client = AdminClient::new(channel)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES);
            match call(client).await {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) => {
                    let leader = status
                        .metadata()
                        .get(LEADER_METADATA_KEY)
                        .and_then(|value| value.to_str().ok());
                    match leader {
                        Some(leader)
                            if status.code() == tonic::Code::Unavailable
                                && with_scheme(leader) != endpoint =>
                        {
                            endpoint = with_scheme(leader);
                        }
                        _ => return Err(StatusError(status).into()),
                    }
                }
            }
        }
        anyhow::bail!("gave up after {MAX_REDIRECTS} leader redirects (is an election in progress?)")
    }
}

/// `host:port` → `http://host:port`; an address with a scheme is kept as it is.
pub fn with_scheme(address: &str) -> String {
    if address.starts_with("http://") || address.starts_with("https://") {
        address.to_string()
    } else {
        format!("http://{address}")
    }
}

/// Shows a gRPC status the way a person reads it: the message, with the code as context.
#[derive(Debug)]
pub struct StatusError(pub tonic::Status);

impl std::fmt::Display for StatusError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let code = match self.0.code() {
            tonic::Code::InvalidArgument => "rejected",
            tonic::Code::FailedPrecondition => "conflict",
            tonic::Code::NotFound => "not found",
            tonic::Code::Unavailable => "unavailable",
            _ => "failed",
        };
        write!(f, "{code}: {}", self.0.message())
    }
}

impl std::error::Error for StatusError {}
