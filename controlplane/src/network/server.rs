use portcullis_proto::v1::raft_server;
use portcullis_proto::v1::RaftPayload;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::{Request, Response, Status};

use crate::types::Raft;

/// Hands Raft RPCs from peers to the local Raft node.
pub struct RaftService {
    raft: Raft,
}

impl RaftService {
    pub fn new(raft: Raft) -> Self {
        Self { raft }
    }
}

fn decode<T: DeserializeOwned>(request: Request<RaftPayload>) -> Result<T, Status> {
    serde_json::from_slice(&request.into_inner().json)
        .map_err(|e| Status::invalid_argument(format!("undecodable Raft payload: {e}")))
}

fn encode<T: Serialize>(result: &T) -> Result<Response<RaftPayload>, Status> {
    serde_json::to_vec(result)
        .map(|json| Response::new(RaftPayload { json }))
        .map_err(|e| Status::internal(format!("encoding Raft response: {e}")))
}

#[tonic::async_trait]
impl raft_server::Raft for RaftService {
    async fn append_entries(&self, request: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        encode(&self.raft.append_entries(decode(request)?).await)
    }

    async fn install_snapshot(&self, request: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        encode(&self.raft.install_snapshot(decode(request)?).await)
    }

    async fn vote(&self, request: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        encode(&self.raft.vote(decode(request)?).await)
    }
}
