use std::time::{Duration, Instant};

use portcullis_proto::v1::raft_server;
use portcullis_proto::v1::{RaftGroup, RaftPayload};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::{Request, Response, Status};

use crate::signals::SignalsRaft;
use crate::types::Raft;

/// Hands Raft RPCs from peers to the local node's Raft group they name.
pub struct RaftService {
    config: Raft,
    signals: SignalsRaft,
    /// Signals votes are refused until then (see [`RaftService::new`]).
    signals_votes_from: Instant,
}

impl RaftService {
    /// `vote_embargo`: the signals group keeps its vote in memory, so a restarted node has
    /// forgotten whom it voted for. It refuses to vote for longer than an election can last,
    /// so the election it may have voted in before the restart has ended (with a leader it
    /// will hear from, or by timing out into a newer term) and it cannot vote twice in one
    /// term.
    pub fn new(config: Raft, signals: SignalsRaft, vote_embargo: Duration) -> Self {
        Self {
            config,
            signals,
            signals_votes_from: Instant::now() + vote_embargo,
        }
    }
}

fn decode<T: DeserializeOwned>(json: &[u8]) -> Result<T, Status> {
    serde_json::from_slice(json)
        .map_err(|e| Status::invalid_argument(format!("undecodable Raft payload: {e}")))
}

fn encode<T: Serialize>(result: &T) -> Result<Response<RaftPayload>, Status> {
    serde_json::to_vec(result)
        .map(|json| {
            Response::new(RaftPayload {
                json,
                group: RaftGroup::Config.into(),
            })
        })
        .map_err(|e| Status::internal(format!("encoding Raft response: {e}")))
}

fn group(payload: &RaftPayload) -> Result<RaftGroup, Status> {
    RaftGroup::try_from(payload.group)
        .map_err(|_| Status::invalid_argument(format!("unknown Raft group {}", payload.group)))
}

#[tonic::async_trait]
impl raft_server::Raft for RaftService {
    async fn append_entries(&self, request: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let payload = request.into_inner();
        match group(&payload)? {
            RaftGroup::Config => encode(&self.config.append_entries(decode(&payload.json)?).await),
            RaftGroup::Signals => encode(&self.signals.append_entries(decode(&payload.json)?).await),
        }
    }

    async fn install_snapshot(&self, request: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let payload = request.into_inner();
        match group(&payload)? {
            RaftGroup::Config => encode(&self.config.install_snapshot(decode(&payload.json)?).await),
            RaftGroup::Signals => encode(&self.signals.install_snapshot(decode(&payload.json)?).await),
        }
    }

    async fn vote(&self, request: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let payload = request.into_inner();
        match group(&payload)? {
            RaftGroup::Config => encode(&self.config.vote(decode(&payload.json)?).await),
            RaftGroup::Signals if Instant::now() < self.signals_votes_from => Err(Status::unavailable(
                "this node restarted recently and does not vote in the signals group yet",
            )),
            RaftGroup::Signals => encode(&self.signals.vote(decode(&payload.json)?).await),
        }
    }
}
