//! The Admin gRPC service. The leader validates each write against the config it has
//! applied and proposes the result through Raft (see [`crate::command`]); reads are
//! linearizable (read-index on the leader) unless the client asks for this node's state.

pub(crate) mod wire;
pub(crate) mod writes;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use openraft::{BasicNode, ChangeMembers};
use portcullis_config::ConfigSet;
use portcullis_proto::v1::admin_server::Admin;
use portcullis_proto::v1::{
    AddNodeRequest, ApplyRequest, ApplyResponse, ClusterMember, ClusterStatus, DeleteRequest, GetRequest,
    GetResponse, ListRequest, ListResponse, ProxyStatus, ReadConsistency, RemoveNodeRequest, StatusRequest,
    StatusResponse,
};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::command;
use crate::metrics::Metrics;
use crate::registry::ProxyRegistry;
use crate::types::{NodeId, Raft};
use crate::view::ConfigView;
use writes::WriteQueue;

/// How long AddNode waits for a new node to catch up before giving up on it.
const LEARNER_CATCH_UP: Duration = Duration::from_secs(10);

/// How long a write may take to commit. A leader that lost its quorum keeps accepting
/// writes that never commit; without a deadline the client would wait forever.
const COMMIT_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs a Raft write, giving up with DEADLINE_EXCEEDED after [`COMMIT_TIMEOUT`]. The write
/// may still commit later, once a quorum is back.
async fn with_commit_deadline<T>(write: impl std::future::Future<Output = T>) -> Result<T, Status> {
    tokio::time::timeout(COMMIT_TIMEOUT, write)
        .await
        .map_err(|_| not_committed())
}

/// The address of member `leader`, for a redirect.
fn leader_address(raft: &Raft, leader: NodeId) -> Option<String> {
    let metrics = raft.metrics();
    let metrics = metrics.borrow();
    metrics
        .membership_config
        .membership()
        .get_node(&leader)
        .map(|node| node.addr.clone())
}

/// The config this node's build can read, or why it cannot serve one.
fn readable_view(view: &watch::Receiver<ConfigView>) -> Result<ConfigView, Status> {
    let view = view.borrow().clone();
    match &view.unreadable {
        Some(reason) => Err(Status::failed_precondition(reason.to_string())),
        None => Ok(view),
    }
}

fn not_committed() -> Status {
    Status::deadline_exceeded(format!(
        "no quorum: the write did not commit within {}s (it may still commit once a quorum is back)",
        COMMIT_TIMEOUT.as_secs()
    ))
}

pub struct AdminService {
    raft: Raft,
    view: watch::Receiver<ConfigView>,
    registry: ProxyRegistry,
    metrics: Metrics,
    writes: WriteQueue,
}

impl AdminService {
    pub fn new(
        raft: Raft,
        view: watch::Receiver<ConfigView>,
        registry: ProxyRegistry,
        metrics: Metrics,
    ) -> Self {
        let writes = WriteQueue::new(raft.clone(), view.clone(), metrics.clone());
        Self {
            raft,
            view,
            registry,
            metrics,
            writes,
        }
    }

    /// The view to answer a read from, after the wait `consistency` asks for.
    async fn read(&self, consistency: i32) -> Result<(ConfigView, ReadConsistency), Status> {
        let consistency = ReadConsistency::try_from(consistency)
            .map_err(|_| Status::invalid_argument(format!("unknown read consistency {consistency}")))?;
        if consistency == ReadConsistency::Linearizable {
            // Returns once this node, confirmed as leader by a quorum, has applied every
            // entry committed before the call: the published view is then current.
            tokio::time::timeout(COMMIT_TIMEOUT, self.raft.ensure_linearizable())
                .await
                .map_err(|_| {
                    Status::deadline_exceeded(format!(
                        "no quorum confirmed this node's leadership within {}s; retry, or read with local consistency",
                        COMMIT_TIMEOUT.as_secs()
                    ))
                })?
                .map_err(|error| wire::leadership_error(error, |leader| leader_address(&self.raft, leader)))?;
        }
        Ok((readable_view(&self.view)?, consistency))
    }

    /// This node's view: the cluster as it sees it and the proxies streaming from it.
    fn status(&self) -> StatusResponse {
        let metrics = self.raft.metrics().borrow().clone();
        let membership = metrics.membership_config.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        StatusResponse {
            version: self.view.borrow().version,
            cluster: Some(ClusterStatus {
                node_id: metrics.id,
                leader_id: metrics.current_leader,
                term: metrics.current_term,
                members: membership
                    .nodes()
                    .map(|(id, node)| ClusterMember {
                        node_id: *id,
                        address: node.addr.clone(),
                        voter: voters.contains(id),
                    })
                    .collect(),
            }),
            proxies: self
                .registry
                .statuses()
                .into_iter()
                .map(|proxy| ProxyStatus {
                    node_id: metrics.id,
                    ..proxy
                })
                .collect(),
            unreachable_nodes: Vec::new(),
        }
    }

    /// This node's status with the proxies of every other member, each asked in parallel.
    async fn cluster_status(&self) -> StatusResponse {
        let mut status = self.status();
        let me = status.cluster.as_ref().map_or(0, |cluster| cluster.node_id);
        let others: Vec<(NodeId, String)> = status
            .cluster
            .iter()
            .flat_map(|cluster| &cluster.members)
            .filter(|member| member.node_id != me)
            .map(|member| (member.node_id, member.address.clone()))
            .collect();
        let mut unanswered: BTreeSet<NodeId> = others.iter().map(|(node_id, _)| *node_id).collect();
        let mut asks = tokio::task::JoinSet::new();
        for (node_id, address) in others {
            asks.spawn(async move { (node_id, local_status_of(&address).await) });
        }
        while let Some(answer) = asks.join_next().await {
            let Ok((asked, Some(theirs))) = answer else {
                continue;
            };
            // An address that reaches another node (or this one) answers for that node.
            if theirs.cluster.as_ref().map(|cluster| cluster.node_id) != Some(asked) {
                continue;
            }
            unanswered.remove(&asked);
            status
                .proxies
                .extend(theirs.proxies.into_iter().map(|proxy| ProxyStatus {
                    node_id: asked,
                    ..proxy
                }));
        }
        status.unreachable_nodes = unanswered.into_iter().collect();
        status.proxies = merge_proxies(std::mem::take(&mut status.proxies));
        status
    }
}

/// How long a member has to answer for its proxies.
const PEER_STATUS_TIMEOUT: Duration = Duration::from_secs(1);

async fn local_status_of(address: &str) -> Option<StatusResponse> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
        .ok()?
        .connect_timeout(PEER_STATUS_TIMEOUT)
        .timeout(PEER_STATUS_TIMEOUT);
    let channel = endpoint.connect().await.ok()?;
    let mut client = portcullis_proto::v1::admin_client::AdminClient::new(channel)
        .max_decoding_message_size(portcullis_proto::MAX_MESSAGE_BYTES);
    let request = StatusRequest { local: true };
    Some(client.status(request).await.ok()?.into_inner())
}

/// One entry per proxy id: a proxy that moved keeps only the node it is connected to (or,
/// disconnected everywhere, the node that saw it last); two connected entries both stay,
/// since two live proxies then share the id.
fn merge_proxies(entries: Vec<ProxyStatus>) -> Vec<ProxyStatus> {
    let mut by_id: std::collections::BTreeMap<String, Vec<ProxyStatus>> = Default::default();
    for entry in entries {
        by_id.entry(entry.proxy_id.clone()).or_default().push(entry);
    }
    by_id
        .into_values()
        .flat_map(|mut entries| {
            if entries.iter().any(|entry| entry.connected) {
                entries.retain(|entry| entry.connected);
            } else {
                entries.sort_by_key(|entry| std::cmp::Reverse(entry.last_seen_unix_ms));
                entries.truncate(1);
            }
            entries.sort_by_key(|entry| entry.node_id);
            entries
        })
        .collect()
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn apply(&self, request: Request<ApplyRequest>) -> Result<Response<ApplyResponse>, Status> {
        let result = async {
            let request = request.into_inner();
            let objects = wire::decode_objects(&request.objects)?;
            let expected = request.expected_version;
            let plan =
                move |config: &ConfigSet, version| command::plan_apply(config, version, &objects, expected);
            let applied = self.writes.write(expected, Box::new(plan)).await?;
            Ok(Response::new(wire::apply_response(applied)))
        }
        .await;
        self.metrics.admin_write("Apply", result)
    }

    async fn validate(&self, request: Request<ApplyRequest>) -> Result<Response<ApplyResponse>, Status> {
        let request = request.into_inner();
        let objects = wire::decode_objects(&request.objects)?;
        let view = readable_view(&self.view)?;
        let planned = command::plan_apply(&view.config, view.version, &objects, request.expected_version)
            .map_err(wire::rejection)?;
        writes::entry_size(&planned.write)?;
        Ok(Response::new(wire::apply_response(
            planned.write.applied(view.version),
        )))
    }

    async fn delete(&self, request: Request<DeleteRequest>) -> Result<Response<ApplyResponse>, Status> {
        let result = async {
            let request = request.into_inner();
            let keys = request
                .objects
                .iter()
                .enumerate()
                .map(|(index, object)| wire::object_key(Some(object), &format!("objects[{index}]")))
                .collect::<Result<Vec<_>, _>>()?;
            let expected = request.expected_version;
            let plan =
                move |config: &ConfigSet, version| command::plan_delete(config, version, &keys, expected);
            let applied = self.writes.write(expected, Box::new(plan)).await?;
            Ok(Response::new(wire::apply_response(applied)))
        }
        .await;
        self.metrics.admin_write("Delete", result)
    }

    async fn get(&self, request: Request<GetRequest>) -> Result<Response<GetResponse>, Status> {
        let request = request.into_inner();
        let key = wire::object_key(request.object.as_ref(), "object")?;
        let (view, served) = self.read(request.consistency).await?;
        let object = view
            .config
            .get(&key)
            .ok_or_else(|| Status::not_found(format!("{key}: not found")))?;
        Ok(Response::new(GetResponse {
            object: Some(wire::to_wire(object)),
            version: view.version,
            served: served.into(),
        }))
    }

    async fn list(&self, request: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        let request = request.into_inner();
        let kind = match request.kind.as_str() {
            "" => None,
            kind => Some(wire::parse_kind(kind)?),
        };
        let (view, served) = self.read(request.consistency).await?;
        let objects = view
            .config
            .objects()
            .filter(|object| kind.is_none_or(|kind| object.kind() == kind))
            .map(wire::to_wire)
            .collect();
        Ok(Response::new(ListResponse {
            objects,
            version: view.version,
            served: served.into(),
        }))
    }

    async fn status(&self, request: Request<StatusRequest>) -> Result<Response<StatusResponse>, Status> {
        Ok(Response::new(match request.get_ref().local {
            true => self.status(),
            false => self.cluster_status().await,
        }))
    }

    async fn add_node(&self, request: Request<AddNodeRequest>) -> Result<Response<StatusResponse>, Status> {
        let result = self.add_and_promote(request.into_inner()).await;
        self.metrics.admin_write("AddNode", result)
    }

    async fn remove_node(
        &self,
        request: Request<RemoveNodeRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        let result = self.remove(request.into_inner().node_id).await;
        self.metrics.admin_write("RemoveNode", result)
    }
}

impl AdminService {
    /// Removes a voter or learner; the last voter cannot be removed.
    async fn remove(&self, node_id: NodeId) -> Result<Response<StatusResponse>, Status> {
        // Decided on the leader's membership: a lagging follower's could be out of date.
        let (me, leader) = {
            let metrics = self.raft.metrics();
            let metrics = metrics.borrow();
            (metrics.id, metrics.current_leader)
        };
        if leader != Some(me) {
            return Err(wire::forward_to_leader(
                leader.and_then(|leader| leader_address(&self.raft, leader)),
            ));
        }
        let membership = self
            .raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .clone();
        if !membership.nodes().any(|(id, _)| *id == node_id) {
            return Err(Status::not_found(format!(
                "node {node_id} is not a member of the cluster"
            )));
        }
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        if voters.len() == 1 && voters.contains(&node_id) {
            return Err(Status::failed_precondition(format!(
                "node {node_id} is the last voter: a cluster cannot remove its last voter"
            )));
        }
        let leader_address = |leader| leader_address(&self.raft, leader);
        let change = if voters.contains(&node_id) {
            // A removed voter leaves as a voter and as a node at once (`retain: false`).
            ChangeMembers::RemoveVoters(BTreeSet::from([node_id]))
        } else {
            ChangeMembers::RemoveNodes(BTreeSet::from([node_id]))
        };
        with_commit_deadline(self.raft.change_membership(change, false))
            .await?
            .map_err(|error| wire::write_error(error, leader_address))?;
        Ok(Response::new(self.status()))
    }

    /// Adds the node as a learner and makes it a voter once it has caught up. For a voter,
    /// moves it to `address` if it has a new one.
    async fn add_and_promote(&self, request: AddNodeRequest) -> Result<Response<StatusResponse>, Status> {
        let AddNodeRequest { node_id, address } = request;
        if address.is_empty() {
            return Err(Status::invalid_argument("address is required"));
        }
        let (known, voter) = {
            let metrics = self.raft.metrics();
            let metrics = metrics.borrow();
            let membership = metrics.membership_config.membership();
            (
                membership.get_node(&node_id).map(|node| node.addr.clone()),
                membership.voter_ids().any(|id| id == node_id),
            )
        };
        match known {
            Some(known) if known != address => return self.move_node(node_id, known, address).await,
            Some(_) if voter => return Ok(Response::new(self.status())),
            _ => {}
        }
        self.check_joining(node_id, &address).await?;
        let leader_address = |leader| leader_address(&self.raft, leader);
        let added = with_commit_deadline(self.raft.add_learner(
            node_id,
            BasicNode::new(address.clone()),
            false,
        ))
        .await?
        .map_err(|error| wire::write_error(error, leader_address))?;
        // Promoting a node that cannot be reached would make it part of every quorum and
        // stall all writes, so it becomes a voter only once it has caught up.
        let target = added.log_id.index;
        let mut metrics = self.raft.metrics();
        let caught_up = metrics.wait_for(|m| {
            let matched = m
                .replication
                .as_ref()
                .and_then(|replication| replication.get(&node_id));
            matched.is_some_and(|log_id| log_id.is_some_and(|id| id.index >= target))
        });
        if !matches!(tokio::time::timeout(LEARNER_CATCH_UP, caught_up).await, Ok(Ok(_))) {
            let removal = ChangeMembers::RemoveNodes(BTreeSet::from([node_id]));
            let removed = match with_commit_deadline(self.raft.change_membership(removal, false)).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(error)) => Err(error.to_string()),
                Err(status) => Err(status.message().to_owned()),
            };
            let waited = LEARNER_CATCH_UP.as_secs();
            return Err(Status::unavailable(match removed {
                Ok(()) => format!("node {node_id} at {address} did not catch up within {waited}s; it was not added"),
                Err(error) => format!(
                    "node {node_id} at {address} did not catch up within {waited}s and stays a learner, since removing it failed ({error}): remove it with `portcullis cluster remove --node-id {node_id}`"
                ),
            }));
        }
        let promote = ChangeMembers::AddVoterIds(BTreeSet::from([node_id]));
        with_commit_deadline(self.raft.change_membership(promote, false))
            .await?
            .map_err(|error| wire::write_error(error, leader_address))?;
        Ok(Response::new(self.status()))
    }
}

impl AdminService {
    /// Refuses to add `node_id` at `address` unless the node answering there is that node,
    /// waiting to join (started with `--join`, never a member of a cluster) or a member of
    /// this one before. Raft messages name neither their target nor a cluster: whatever answers
    /// at the address would take the id's place, so another member there would hold two
    /// votes, and a node of another cluster would have its log overwritten.
    async fn check_joining(&self, node_id: NodeId, address: &str) -> Result<(), Status> {
        let refuse = |reason: String| {
            Err(Status::failed_precondition(format!(
                "{reason}; node {node_id} was not added"
            )))
        };
        let (me, my_address, holder) = {
            let metrics = self.raft.metrics();
            let metrics = metrics.borrow();
            let membership = metrics.membership_config.membership();
            let holder = membership
                .nodes()
                .find(|(id, node)| **id != node_id && node.addr == address)
                .map(|(id, _)| *id);
            let my_address = membership.get_node(&metrics.id).map(|node| node.addr.clone());
            (metrics.id, my_address, holder)
        };
        if let Some(holder) = holder {
            return refuse(format!("{address} is the address of node {holder}"));
        }
        let Some(there) = local_status_of(address).await.and_then(|status| status.cluster) else {
            return Err(Status::unavailable(format!(
                "no control-plane node answers at {address}: start node {node_id} there with --join first; it was not added"
            )));
        };
        if there.node_id != node_id {
            return refuse(format!(
                "the node at {address} is node {}, not node {node_id}",
                there.node_id
            ));
        }
        let waiting = there.term == 0 && there.members.is_empty();
        let ours = there
            .members
            .iter()
            .any(|member| member.node_id == me && Some(&member.address) == my_address.as_ref());
        if !waiting && !ours {
            return refuse(format!(
                "the node at {address} belongs to another cluster (term {}, members {:?}): clear its data directory and start it with --join",
                there.term,
                there.members.iter().map(|member| member.node_id).collect::<Vec<_>>()
            ));
        }
        Ok(())
    }

    /// Gives member `node_id` (now at `old`) the address `address`, once the node answering
    /// there is that member of this cluster, restarted on its data directory, and nothing
    /// answers as it at `old` any more. Pointing an id at another node, at an empty node
    /// that took the id, or at a second copy of a live node would let two quorums form
    /// (openraft's warning on `ChangeMembers::SetNodes`).
    async fn move_node(
        &self,
        node_id: NodeId,
        old: String,
        address: String,
    ) -> Result<Response<StatusResponse>, Status> {
        let refuse = |reason: String| {
            Err(Status::failed_precondition(format!(
                "{reason}; the address of node {node_id} was not changed"
            )))
        };
        let Some(there) = local_status_of(&address).await.and_then(|status| status.cluster) else {
            return Err(Status::unavailable(format!(
                "no control-plane node answers at {address}: start node {node_id} there first, on its data directory; the address of node {node_id} was not changed"
            )));
        };
        if there.node_id != node_id {
            return refuse(format!(
                "the node at {address} is node {}, not node {node_id}",
                there.node_id
            ));
        }
        // What it restarted with: this cluster's membership, with this node where it is.
        let (me, my_address) = {
            let metrics = self.raft.metrics();
            let metrics = metrics.borrow();
            let address = metrics
                .membership_config
                .membership()
                .get_node(&metrics.id)
                .map(|node| node.addr.clone());
            (metrics.id, address)
        };
        let knows_me = there
            .members
            .iter()
            .any(|member| member.node_id == me && Some(&member.address) == my_address.as_ref());
        if there.term == 0 || !knows_me {
            return refuse(format!(
                "the node at {address} is not node {node_id} of this cluster restarted on its data directory (it does not hold this cluster's membership)"
            ));
        }
        if local_status_of(&old)
            .await
            .and_then(|status| status.cluster)
            .is_some_and(|cluster| cluster.node_id == node_id)
        {
            return refuse(format!(
                "node {node_id} still answers at {old}: stop it there first"
            ));
        }
        let leader_address = |leader| leader_address(&self.raft, leader);
        let nodes = BTreeMap::from([(node_id, BasicNode::new(address))]);
        with_commit_deadline(self.raft.change_membership(ChangeMembers::SetNodes(nodes), false))
            .await?
            .map_err(|error| wire::write_error(error, leader_address))?;
        Ok(Response::new(self.status()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(proxy_id: &str, node_id: NodeId, connected: bool, last_seen_unix_ms: i64) -> ProxyStatus {
        ProxyStatus {
            proxy_id: proxy_id.into(),
            node_id,
            connected,
            last_seen_unix_ms,
            ..ProxyStatus::default()
        }
    }

    #[test]
    fn a_proxy_that_moved_is_listed_once_where_it_is() {
        let merged = merge_proxies(vec![
            entry("moved", 1, false, 100),
            entry("moved", 2, true, 50),
            entry("gone", 1, false, 10),
            entry("gone", 3, false, 20),
            entry("twin", 1, true, 5),
            entry("twin", 2, true, 5),
        ]);
        let listed: Vec<(&str, NodeId)> = merged.iter().map(|p| (p.proxy_id.as_str(), p.node_id)).collect();
        assert_eq!(listed, [("gone", 3), ("moved", 2), ("twin", 1), ("twin", 2)]);
    }
}
