//! Conversions between the Admin wire types and the config model, and from internal
//! errors to gRPC statuses.

use openraft::error::{CheckIsLeaderError, ClientWriteError, ForwardToLeader, RaftError};
use openraft::BasicNode;
use portcullis_config::{collect_objects, FieldError, Kind, Object, ObjectKey};
use portcullis_proto::v1;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Status};

use crate::command::{Applied, ErrorCode, Rejection, Submitted};
use crate::types::NodeId;

pub fn to_wire(object: &Object) -> v1::Object {
    v1::Object {
        kind: object.kind().to_string(),
        name: object.name().to_string(),
        json: object.to_json_bytes().into(),
    }
}

/// Decodes `objects[i]` from the JSON each carries; `kind`/`name`, when set, must agree
/// with it. Reports every problem at once.
pub fn decode_objects(objects: &[v1::Object]) -> Result<Vec<Submitted>, Status> {
    collect_objects(objects.iter().enumerate().map(|(index, wire)| {
        let location = format!("objects[{index}]");
        let submitted = Submitted::from_json_bytes(&wire.json, &location)?;
        let object = &submitted.object;
        let kind_differs = !wire.kind.is_empty() && wire.kind != object.kind().as_str();
        let name_differs = !wire.name.is_empty() && wire.name != object.name();
        if kind_differs || name_differs {
            let message = format!(
                "kind/name {}/{} do not match its JSON ({})",
                wire.kind,
                wire.name,
                object.key()
            );
            return Err(FieldError::new(location, "", message).into());
        }
        Ok(submitted)
    }))
    .map_err(|error| Status::invalid_argument(error.to_string()))
}

pub fn parse_kind(kind: &str) -> Result<Kind, Status> {
    kind.parse().map_err(Status::invalid_argument)
}

pub fn object_key(object: Option<&v1::ObjectRef>, field: &str) -> Result<ObjectKey, Status> {
    let object = object.ok_or_else(|| Status::invalid_argument(format!("{field} is required")))?;
    if object.name.is_empty() {
        return Err(Status::invalid_argument(format!("{field}.name is required")));
    }
    Ok(ObjectKey::new(parse_kind(&object.kind)?, object.name.clone()))
}

pub fn apply_response(applied: Applied) -> v1::ApplyResponse {
    v1::ApplyResponse {
        version: applied.version,
        changes: applied
            .changes
            .into_iter()
            .map(|change| v1::ObjectChange {
                object: Some(v1::ObjectRef {
                    kind: change.key.kind,
                    name: change.key.name,
                }),
                action: change.action,
            })
            .collect(),
    }
}

pub fn rejection(rejection: Rejection) -> Status {
    let code = match rejection.code {
        ErrorCode::FailedPrecondition => Code::FailedPrecondition,
        ErrorCode::InvalidArgument => Code::InvalidArgument,
        ErrorCode::NotFound => Code::NotFound,
    };
    Status::new(code, rejection.message)
}

/// UNAVAILABLE, naming the leader's address in metadata when known so clients can retry there.
pub fn forward_to_leader(leader: Option<String>) -> Status {
    let Some(address) = leader else {
        return Status::unavailable("no Raft leader is known; retry shortly");
    };
    let mut metadata = MetadataMap::new();
    if let Ok(value) = MetadataValue::try_from(address.as_str()) {
        metadata.insert(portcullis_proto::LEADER_METADATA_KEY, value);
    }
    Status::with_metadata(
        Code::Unavailable,
        format!("this node is not the leader; the leader is at {address}"),
        metadata,
    )
}

pub type WriteError = RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>;

/// Maps a failed Raft write. `leader_address` resolves a leader id when openraft knows
/// the id but not the node.
pub fn write_error(error: WriteError, leader_address: impl FnOnce(NodeId) -> Option<String>) -> Status {
    match error {
        RaftError::APIError(ClientWriteError::ForwardToLeader(forward)) => redirect(forward, leader_address),
        RaftError::APIError(ClientWriteError::ChangeMembershipError(error)) => {
            Status::failed_precondition(error.to_string())
        }
        RaftError::Fatal(error) => Status::unavailable(format!("Raft is not running: {error}")),
    }
}

pub type LeadershipError = RaftError<NodeId, CheckIsLeaderError<NodeId, BasicNode>>;

/// Maps a failed read-index (before a linearizable read, and before planning a write): a
/// follower redirects to the leader, a leader that cannot reach a quorum says so.
pub fn leadership_error(
    error: LeadershipError,
    leader_address: impl FnOnce(NodeId) -> Option<String>,
) -> Status {
    match error {
        RaftError::APIError(CheckIsLeaderError::ForwardToLeader(forward)) => {
            redirect(forward, leader_address)
        }
        RaftError::APIError(CheckIsLeaderError::QuorumNotEnough(error)) => Status::unavailable(format!(
            "this node could not confirm its leadership with a quorum ({error}); retry"
        )),
        RaftError::Fatal(error) => Status::unavailable(format!("Raft is not running: {error}")),
    }
}

fn redirect(
    forward: ForwardToLeader<NodeId, BasicNode>,
    leader_address: impl FnOnce(NodeId) -> Option<String>,
) -> Status {
    forward_to_leader(
        forward
            .leader_node
            .map(|node| node.addr)
            .or_else(|| forward.leader_id.and_then(leader_address)),
    )
}
