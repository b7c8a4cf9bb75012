use std::time::Duration;

use openraft::error::{
    Infallible, InstallSnapshotError, NetworkError, PayloadTooLarge, RPCError, RaftError, RemoteError,
    Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{AnyError, BasicNode, RaftTypeConfig};
use portcullis_proto::v1::raft_client::RaftClient;
use portcullis_proto::v1::{RaftGroup, RaftPayload};
use portcullis_proto::MAX_MESSAGE_BYTES;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::transport::{Channel, Endpoint};

use crate::types::NodeId;

/// Creates one lazily connected client per target node, for the Raft group `group`.
#[derive(Clone)]
pub struct NetworkFactory {
    group: RaftGroup,
}

impl NetworkFactory {
    pub fn new(group: RaftGroup) -> Self {
        Self { group }
    }
}

impl<C> RaftNetworkFactory<C> for NetworkFactory
where
    C: RaftTypeConfig<NodeId = NodeId, Node = BasicNode>,
{
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> PeerClient {
        let channel = Endpoint::from_shared(format!("http://{}", node.addr))
            .map(|endpoint| endpoint.connect_timeout(Duration::from_secs(1)).connect_lazy())
            .map_err(|error| format!("invalid address {:?} of node {target}: {error}", node.addr));
        PeerClient {
            target,
            group: self.group,
            client: channel.map(|channel| {
                RaftClient::new(channel)
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES)
            }),
        }
    }
}

pub struct PeerClient {
    target: NodeId,
    group: RaftGroup,
    /// An unusable address is kept as an error so every RPC reports it as unreachable.
    client: Result<RaftClient<Channel>, String>,
}

type RpcResult<T, E> = Result<T, RPCError<NodeId, BasicNode, RaftError<NodeId, E>>>;

#[derive(Debug, Clone, Copy)]
enum Rpc {
    AppendEntries,
    InstallSnapshot,
    Vote,
}

impl PeerClient {
    /// `entries_hint` is how many entries to retry with if the request turns out too large;
    /// `None` where openraft cannot shrink the request (Vote, InstallSnapshot, or a single
    /// entry), as a payload-too-large error there would be retried at once and forever.
    async fn call<Req, Resp, E>(
        &mut self,
        rpc: Rpc,
        request: &Req,
        entries_hint: Option<u64>,
    ) -> RpcResult<Resp, E>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let client = match &mut self.client {
            Ok(client) => client,
            Err(message) => return Err(Unreachable::new(&AnyError::error(message)).into()),
        };
        let json = serde_json::to_vec(request).map_err(|e| NetworkError::new(&e))?;
        let payload = RaftPayload {
            json,
            group: self.group.into(),
        };
        let response = match rpc {
            Rpc::AppendEntries => client.append_entries(payload).await,
            Rpc::InstallSnapshot => client.install_snapshot(payload).await,
            Rpc::Vote => client.vote(payload).await,
        };
        let response = response.map_err(|status| match (status.code(), entries_hint) {
            // Connection refused, reset or not yet established: back off before retrying.
            (tonic::Code::Unavailable | tonic::Code::DeadlineExceeded, _) => {
                RPCError::Unreachable(Unreachable::new(&status))
            }
            // tonic refuses an over-limit message with one of these; openraft then resends
            // the entries in smaller requests instead of the same payload again.
            (tonic::Code::OutOfRange | tonic::Code::ResourceExhausted, Some(hint)) => {
                RPCError::PayloadTooLarge(PayloadTooLarge::new_entries_hint(hint).with_source_error(&status))
            }
            _ => RPCError::Network(NetworkError::new(&status)),
        })?;
        let result: Result<Resp, RaftError<NodeId, E>> = serde_json::from_slice(&response.into_inner().json)
            .map_err(|e| {
                NetworkError::new(&AnyError::error(format!(
                    "undecodable {rpc:?} response from node {} ({:?} group): {e}",
                    self.target, self.group
                )))
            })?;
        result.map_err(|error| RPCError::RemoteError(RemoteError::new(self.target, error)))
    }
}

impl<C> RaftNetwork<C> for PeerClient
where
    C: RaftTypeConfig<NodeId = NodeId, Node = BasicNode>,
{
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<C>,
        _option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>, Infallible> {
        // Halving converges on a size that fits; one entry cannot be split further.
        let entries = u64::try_from(rpc.entries.len()).unwrap_or(u64::MAX);
        let entries_hint = (entries > 1).then_some(entries / 2);
        self.call(Rpc::AppendEntries, &rpc, entries_hint).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<C>,
        _option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, InstallSnapshotError> {
        self.call(Rpc::InstallSnapshot, &rpc, None).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        _option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>, Infallible> {
        self.call(Rpc::Vote, &rpc, None).await
    }
}
