//! The write queue: the Apply and Delete writes through a node are planned and proposed one
//! entry at a time, so writes through one leader never race each other, and the writes that
//! queue while an entry commits are proposed together in the next one.
//!
//! A write that finds nothing committing is planned and proposed by its own request, alone:
//! a lone write pays no hand-off to another task. Writes that arrive meanwhile wait in the
//! queue, and once that commit is done a drain task takes them, as many to an entry as may
//! go together, until the queue is empty. Only the drain task batches: a request can be
//! cancelled (its client gone) mid-commit, and must then take no other client's write with
//! it.
//!
//! A batch is planned on the config the leader has applied: its first write on that config,
//! each later one on the config the writes before it leave. The entry ([`Write::batch`]) names
//! the version they were all planned on and applies whole on it or not at all, like any
//! write, so every write of a batch commits at the same version. A write joins a batch only
//! when it cannot change what the others planned: naming no object another write of the batch
//! names, and accepted where it stands in it. Any other waits for the next entry, planned
//! first on the committed config; a refusal is only ever given on that config, never on
//! writes that have not committed. A write pinned to a version goes alone.

use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use openraft::error::RaftError;
use openraft::ServerState;
use portcullis_config::ConfigSet;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;
use tonic::Status;

use super::{leader_address, not_committed, readable_view, wire, COMMIT_TIMEOUT};
use crate::command::{Applied, ErrorCode, ObjectChange, Planned, Rejection, StoredKey, Write};
use crate::metrics::Metrics;
use crate::types::Raft;
use crate::view::ConfigView;

/// How often a write planned on a version that moved before it committed (a write through
/// another node's leadership, during an election) is planned again.
const PLAN_ATTEMPTS: usize = 3;

/// At most this many writes share an entry, and a write joins one only if the entry then names
/// no more than [`BATCH_OBJECTS`] objects and takes no more than [`BATCH_BYTES`] encoded: a
/// batch must stay an entry that replicates about as quickly as one write. A write too large
/// for these goes alone, as before batching.
pub(crate) const BATCH_WRITES: usize = 64;
const BATCH_OBJECTS: usize = 1_000;
const BATCH_BYTES: usize = 1 << 20;

/// The largest entry a write may become, encoded ([`Write::entry_bytes`]). A Raft message
/// over [`portcullis_proto::MAX_MESSAGE_BYTES`] cannot be sent, and openraft 0.9 sends a lone
/// entry that could not be sent again and again: every later write would wait behind it. Half
/// the limit leaves ample room for the AppendEntries request around the entry. Lower in tests,
/// so that a write over it is quick to build.
#[cfg(not(test))]
const ENTRY_BYTES: usize = portcullis_proto::MAX_MESSAGE_BYTES / 2;
#[cfg(test)]
const ENTRY_BYTES: usize = 2 << 20;
// Writes join a batch only within BATCH_BYTES: a batch is never larger than a lone write may be.
const _: () = assert!(BATCH_BYTES <= ENTRY_BYTES);

/// Writes a node lets wait; one more is refused rather than queued without end.
pub(crate) const QUEUE_LIMIT: usize = 1_024;

/// Where a queued write stands; the client and the committer move it with compare-and-swap,
/// so a client told "nothing changed" never has its write proposed after all, and a client
/// gone has its write proposed no more.
const WAITING: u8 = 0;
const PROPOSED: u8 = 1;
/// Its client stopped waiting before it was proposed: it never will be.
const ABANDONED: u8 = 2;
/// Its client went away while it was proposed: if that entry is overtaken, it is not proposed
/// again.
const CANCELLED: u8 = 3;

/// A write's validation: `Ok` with its result on `config` at `version`, or why it is refused.
pub type Plan = Box<dyn Fn(&ConfigSet, u64) -> Result<Planned, Rejection> + Send>;

/// The queue, held by the Admin service.
pub struct WriteQueue {
    committer: Arc<Committer>,
}

/// One client's write, waiting to be planned.
struct Queued {
    plan: Plan,
    /// The client pinned the version (`expected_version`): the write goes alone, planned on
    /// a committed config, and a moved version is its answer. Alone, the version it commits
    /// at holds nothing but it on top of the version it named.
    pinned: bool,
    deadline: Instant,
    attempts: usize,
    /// Objects named and entry bytes, once planned: a write too large to join is not planned
    /// again for every entry it waits behind.
    size: Option<(usize, usize)>,
    /// [`WAITING`], [`PROPOSED`] (in an entry handed to Raft: it may commit whatever its
    /// client does), [`ABANDONED`] or [`CANCELLED`].
    state: Arc<AtomicU8>,
    answer: oneshot::Sender<Result<Applied, Status>>,
}

impl Queued {
    fn reply(self, result: Result<Applied, Status>) {
        // A client that stopped waiting has its own answer already.
        let _ = self.answer.send(result);
    }

    /// Takes the write for an entry once it is planned, unless its client stopped waiting or
    /// its deadline passed: its client then hears that nothing changed.
    fn claim(&self) -> bool {
        if Instant::now() >= self.deadline {
            abandon(&self.state);
            return false;
        }
        self.state
            .compare_exchange(WAITING, PROPOSED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn abandoned(&self) -> bool {
        self.state.load(Ordering::Acquire) == ABANDONED
    }
}

/// A write planned into the batch being built, with what it answers once the batch commits.
struct Member {
    queued: Queued,
    changes: Vec<ObjectChange>,
}

/// Writes planned on `base_version`, each on the config the ones before it leave.
struct Batch {
    base_version: u64,
    /// The latest of the writes' deadlines: each client gives up at its own.
    deadline: Instant,
    writes: Vec<Write>,
    members: Vec<Member>,
    /// Every object the writes name; no two name the same.
    named: BTreeSet<StoredKey>,
    /// Its writes' entry bytes together: no fewer than its own entry's, which has one envelope
    /// where they have one each.
    bytes: usize,
}

impl Batch {
    /// `first` must be claimed ([`Queued::claim`]); `bytes` is its entry's.
    fn new(base_version: u64, first: Queued, planned: Write, bytes: usize) -> Self {
        let mut batch = Batch {
            base_version,
            deadline: first.deadline,
            writes: Vec::new(),
            members: Vec::new(),
            named: BTreeSet::new(),
            bytes: 0,
        };
        batch.push(first, planned, bytes);
        batch
    }

    fn push(&mut self, queued: Queued, write: Write, bytes: usize) {
        self.deadline = self.deadline.max(queued.deadline);
        self.bytes += bytes;
        self.named.extend(names(&write));
        self.members.push(Member {
            queued,
            changes: write.changes.clone(),
        });
        self.writes.push(write);
    }

    /// Takes from `waiting`, in order, the writes that may join: planned on `config` (what
    /// the batch so far leaves), accepted, not pinned, naming nothing the batch names, within
    /// the batch's size. The others keep their places; those whose clients stopped waiting
    /// are dropped. At most [`BATCH_WRITES`] are planned, joining or not, so a long queue of
    /// writes that cannot join costs each entry no more than a full batch.
    fn gather(&mut self, mut config: ConfigSet, waiting: &mut VecDeque<Queued>) {
        let mut index = 0;
        let mut examined = 0;
        while index < waiting.len() && examined < BATCH_WRITES && self.members.len() < BATCH_WRITES {
            if waiting[index].abandoned() {
                waiting.remove(index);
                continue;
            }
            examined += 1;
            let candidate = &mut waiting[index];
            let fits = |(objects, bytes): (usize, usize)| {
                self.named.len() + objects <= BATCH_OBJECTS && self.bytes + bytes <= BATCH_BYTES
            };
            let joins = match candidate.pinned || !candidate.size.is_none_or(fits) {
                true => None,
                false => (candidate.plan)(&config, self.base_version)
                    .ok()
                    .and_then(|planned| {
                        let named = names(&planned.write);
                        let size = (named.len(), planned.write.entry_bytes());
                        candidate.size = Some(size);
                        (named.is_disjoint(&self.named) && fits(size)).then_some((planned, size.1))
                    }),
            };
            let Some((planned, bytes)) = joins else {
                index += 1;
                continue;
            };
            let Some(queued) = waiting.remove(index) else {
                break;
            };
            // Claimed before anything is planned on it.
            if queued.claim() {
                config = planned.config;
                self.push(queued, planned.write, bytes);
            }
        }
    }
}

impl WriteQueue {
    pub fn new(raft: Raft, view: watch::Receiver<ConfigView>, metrics: Metrics) -> Self {
        let committer = Committer {
            raft,
            view,
            metrics,
            queue: Mutex::new(Queue::default()),
        };
        Self {
            committer: Arc::new(committer),
        }
    }

    /// Plans and commits a write. One deadline covers the wait for earlier writes, the
    /// planning and the commit; running out before the proposal is a clean failure (nothing
    /// changed), after it the write may still commit.
    pub async fn write(&self, expected_version: Option<u64>, plan: Plan) -> Result<Applied, Status> {
        let deadline = Instant::now() + COMMIT_TIMEOUT;
        let state = Arc::new(AtomicU8::new(WAITING));
        let (answer, answered) = oneshot::channel();
        let queued = Queued {
            plan,
            pinned: expected_version.is_some(),
            deadline,
            attempts: 0,
            size: None,
            state: state.clone(),
            answer,
        };
        let alone = {
            let mut queue = self.committer.queue();
            if !queue.committing {
                queue.committing = true;
                Some(queued)
            } else if queue.waiting.len() + queue.gathering < QUEUE_LIMIT {
                queue.waiting.push_back(queued);
                None
            } else {
                return Err(Status::resource_exhausted(format!(
                    "{QUEUE_LIMIT} writes are queued on this node; nothing changed, retry"
                )));
            }
        };
        // A request cancelled (its client gone) leaves no write behind to be proposed later.
        let _cancelled = Abandon(state.clone());
        if let Some(queued) = alone {
            let _turn = Turn(self.committer.clone());
            self.committer.commit(queued, false).await;
        }
        match tokio::time::timeout_at(deadline, answered).await {
            Ok(Ok(result)) => result,
            // Dropped unanswered: the node is stopping, or its committer failed.
            Ok(Err(_)) => match state.load(Ordering::Acquire) {
                PROPOSED => Err(outcome_unknown()),
                // Refused a claim past its deadline.
                ABANDONED => Err(not_proposed()),
                _ => Err(shutting_down()),
            },
            Err(_) if abandon(&state) => Err(not_proposed()),
            Err(_) => Err(not_committed()),
        }
    }
}

/// Marks a write its client no longer waits for, unless it was proposed already; true when it
/// was not (it never will be).
fn abandon(state: &AtomicU8) -> bool {
    match state.compare_exchange(WAITING, ABANDONED, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) | Err(ABANDONED) => true,
        Err(_) => false,
    }
}

/// Abandons its write when dropped, or marks it cancelled if it is proposed: held by the
/// request for as long as it waits.
struct Abandon(Arc<AtomicU8>);

impl Drop for Abandon {
    fn drop(&mut self) {
        if !abandon(&self.0) {
            let _ = self
                .0
                .compare_exchange(PROPOSED, CANCELLED, Ordering::AcqRel, Ordering::Acquire);
        }
    }
}

#[cfg(test)]
impl WriteQueue {
    /// Writes waiting behind the one committing.
    pub(crate) fn waiting(&self) -> usize {
        self.committer.queue().waiting.len()
    }
}

fn not_proposed() -> Status {
    Status::unavailable(format!(
        "the write was not proposed within {}s (no quorum, or writes queued before it); nothing changed, retry",
        COMMIT_TIMEOUT.as_secs()
    ))
}

fn outcome_unknown() -> Status {
    Status::unavailable(
        "this control-plane node stopped before the write's outcome was known: it may have committed; read the config before retrying",
    )
}

/// The size of the entry `write` makes, or the refusal of one over [`ENTRY_BYTES`]: Apply
/// gives it, and Validate says so beforehand.
pub(crate) fn entry_size(write: &Write) -> Result<usize, Status> {
    match write.entry_bytes() {
        bytes if bytes > ENTRY_BYTES => Err(Status::invalid_argument(format!(
            "the write would make a Raft entry of {bytes} bytes, over the {} MiB one entry may hold; nothing changed: apply the objects in parts",
            ENTRY_BYTES >> 20
        ))),
        bytes => Ok(bytes),
    }
}

fn shutting_down() -> Status {
    Status::unavailable("this control-plane node is shutting down; retry on another")
}

#[derive(Default)]
struct Queue {
    /// Received and not answered yet, oldest first; a write left out of a batch keeps its
    /// place.
    waiting: VecDeque<Queued>,
    /// Writes taken out of `waiting` while a batch is gathered from them, counted against
    /// [`QUEUE_LIMIT`] all the same.
    gathering: usize,
    /// A request or the drain task is planning or committing an entry.
    committing: bool,
}

/// The committing turn of a request that found nothing committing, or of a drain task. When
/// it ends, done, cancelled or panicking, the writes waiting go to a new drain task; with none
/// waiting, the next write takes the turn.
struct Turn(Arc<Committer>);

impl Drop for Turn {
    fn drop(&mut self) {
        let mut queue = self.0.queue();
        if queue.waiting.is_empty() {
            queue.committing = false;
            return;
        }
        drop(queue);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(self.0.clone().drain())),
            // No runtime: the waiting requests are gone with it.
            Err(_) => self.0.queue().committing = false,
        }
    }
}

/// The waiting writes, out of the queue while a batch is gathered from them (planned outside
/// the lock, so that requests queueing meanwhile do not wait on it). Dropped, even by a panic,
/// it puts back those left, ahead of the writes that arrived meanwhile.
struct Taken<'a> {
    committer: &'a Committer,
    waiting: VecDeque<Queued>,
}

impl<'a> Taken<'a> {
    fn new(committer: &'a Committer) -> Self {
        let mut queue = committer.queue();
        queue.gathering = queue.waiting.len();
        let waiting = std::mem::take(&mut queue.waiting);
        drop(queue);
        Taken { committer, waiting }
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        let mut queue = self.committer.queue();
        queue.gathering = 0;
        let mut waiting = std::mem::take(&mut self.waiting);
        waiting.append(&mut queue.waiting);
        queue.waiting = waiting;
    }
}

struct Committer {
    raft: Raft,
    view: watch::Receiver<ConfigView>,
    metrics: Metrics,
    queue: Mutex<Queue>,
}

impl Committer {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        // Nothing panics while holding it; a poisoned queue is still consistent.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Commits what is waiting, an entry at a time, until nothing is.
    async fn drain(self: Arc<Self>) {
        let _turn = Turn(self.clone());
        loop {
            let first = self.queue().waiting.pop_front();
            match first {
                Some(first) => self.commit(first, true).await,
                None => return,
            }
        }
    }

    /// Plans `first`, and with it (when `gather`) the waiting writes that may join it,
    /// proposes them as one entry and answers each.
    async fn commit(&self, first: Queued, gather: bool) {
        let pinned = first.pinned;
        let planned = match self.plan_applied(first) {
            Ok(planned) => planned,
            Err(first) => self.plan_confirmed(first).await,
        };
        // `None`: refused and answered, or its client stopped waiting and heard that nothing
        // changed.
        let Some((mut batch, config)) = planned else {
            return;
        };
        if gather && !pinned {
            let mut taken = Taken::new(self);
            batch.gather(config, &mut taken.waiting);
        }
        let Batch {
            base_version,
            deadline,
            writes,
            members,
            ..
        } = batch;
        self.metrics.write_entry_proposed(members.len());
        let entry = Write::batch(base_version, writes);
        let committed = match tokio::time::timeout_at(deadline, self.raft.client_write(entry)).await {
            Err(_) => Err(not_committed()),
            // openraft answers this whether Raft stopped before or after it took the entry;
            // taken, the entry may be durable and commit under the next leader.
            Ok(Err(RaftError::Fatal(error))) => {
                tracing::debug!(%error, "Raft stopped with a write proposed");
                Err(outcome_unknown())
            }
            Ok(Err(error)) => Err(wire::write_error(error, |leader| {
                leader_address(&self.raft, leader)
            })),
            Ok(Ok(response)) => Ok(response.data),
        };
        match committed {
            Ok(Ok(applied)) => {
                for member in members {
                    member.queued.reply(Ok(Applied {
                        version: applied.version,
                        changes: member.changes,
                    }));
                }
            }
            Ok(Err(rejection)) if rejection.code == ErrorCode::FailedPrecondition => {
                tracing::debug!(reason = %rejection.message, "write overtaken; planning again");
                // Back at the head of the queue, in their order, to be planned again on the
                // newer config.
                for member in members.into_iter().rev() {
                    self.overtaken(member.queued, &rejection);
                }
            }
            Ok(Err(rejection)) => {
                for member in members {
                    member.queued.reply(Err(wire::rejection(rejection.clone())));
                }
            }
            Err(status) => {
                for member in members {
                    member.queued.reply(Err(status.clone()));
                }
            }
        }
    }

    /// A write whose entry applied on a version that had moved: planned again, unless the
    /// client pinned that version or it was planned too often already.
    fn overtaken(&self, mut queued: Queued, rejection: &Rejection) {
        queued.attempts += 1;
        // The entry did not apply: nothing of the write is in the config. A client gone
        // meanwhile (cancelled) has its write dropped here.
        let waits = queued
            .state
            .compare_exchange(PROPOSED, WAITING, Ordering::AcqRel, Ordering::Acquire);
        if waits.is_err() {
            return;
        }
        if queued.pinned {
            queued.reply(Err(wire::rejection(rejection.clone())));
        } else if queued.attempts >= PLAN_ATTEMPTS {
            queued.reply(Err(Status::aborted(format!(
                "the write was overtaken by other writes {PLAN_ATTEMPTS} times; retry"
            ))));
        } else {
            self.queue().waiting.push_front(queued);
        }
    }

    /// Plans `first` on the config this leader holds, when it has applied its whole log;
    /// returns it claimed, with the config it leaves, or `None` if its client stopped waiting.
    /// Hands `first` back when it must be planned on a confirmed config instead: this node may
    /// not lead, or may not hold everything committed, or refuses the write.
    ///
    /// A leader that has applied its whole log plans on what it holds: the entry names the
    /// version it was planned on and applies only on that version, whoever commits it, so an
    /// accepted plan needs no confirmation first.
    fn plan_applied(&self, first: Queued) -> Result<Option<(Batch, ConfigSet)>, Queued> {
        if !self.leads_with_its_log_applied() {
            return Err(first);
        }
        let Ok(view) = readable_view(&self.view) else {
            return Err(first);
        };
        let Ok(planned) = (first.plan)(&view.config, view.version) else {
            return Err(first);
        };
        let Ok(bytes) = entry_size(&planned.write) else {
            return Err(first);
        };
        Ok(first.claim().then(|| {
            (
                Batch::new(view.version, first, planned.write, bytes),
                planned.config,
            )
        }))
    }

    /// Plans `first` on a config a read-index confirmed: a follower redirects, a new leader
    /// waits for what its predecessor committed, and a refusal is answered only from there. A
    /// deposed leader that does not know it yet must not refuse on a stale config.
    async fn plan_confirmed(&self, first: Queued) -> Option<(Batch, ConfigSet)> {
        let confirmed = tokio::time::timeout_at(first.deadline, self.raft.ensure_linearizable()).await;
        let planned = match confirmed {
            Err(_) => Err(not_proposed()),
            Ok(Err(error)) => Err(wire::leadership_error(error, |leader| {
                leader_address(&self.raft, leader)
            })),
            Ok(Ok(_)) => readable_view(&self.view).and_then(|view| {
                let planned = (first.plan)(&view.config, view.version).map_err(wire::rejection)?;
                let bytes = entry_size(&planned.write)?;
                Ok((view.version, planned, bytes))
            }),
        };
        match planned {
            Ok((version, planned, bytes)) => first
                .claim()
                .then(|| (Batch::new(version, first, planned.write, bytes), planned.config)),
            Err(status) => {
                first.reply(Err(status));
                None
            }
        }
    }

    /// This node leads and has applied every entry of its log, so its config holds
    /// everything committed so far.
    fn leads_with_its_log_applied(&self) -> bool {
        let metrics = self.raft.metrics();
        let metrics = metrics.borrow();
        metrics.state == ServerState::Leader
            && metrics.current_leader == Some(metrics.id)
            && metrics.last_applied.map(|applied| applied.index) == metrics.last_log_index
    }
}

/// Every object a write names, changed or not.
fn names(write: &Write) -> BTreeSet<StoredKey> {
    write.changes.iter().map(|change| change.key.clone()).collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::*;
    use crate::command::tests::{backend, put, route, submit};
    use crate::command::{plan_apply, plan_delete, Reading, StoredConfig};

    fn queued(pinned: bool, plan: Plan) -> Queued {
        Queued {
            plan,
            pinned,
            deadline: Instant::now() + Duration::from_secs(10),
            attempts: 0,
            size: None,
            state: Arc::new(AtomicU8::new(WAITING)),
            answer: oneshot::channel().0,
        }
    }

    fn applying(objects: Vec<serde_json::Value>, expected: Option<u64>) -> Queued {
        let submitted = submit(&objects).unwrap();
        queued(
            expected.is_some(),
            Box::new(move |config, version| plan_apply(config, version, &submitted, expected)),
        )
    }

    fn abandoned(queued: Queued) -> Queued {
        queued.state.store(ABANDONED, Ordering::Release);
        queued
    }

    fn expired(mut queued: Queued) -> Queued {
        queued.deadline = Instant::now() - Duration::from_millis(1);
        queued
    }

    fn deleting_backend(name: &str) -> Queued {
        let key = portcullis_config::ObjectKey::new(
            portcullis_config::Kind::of::<portcullis_config::BackendSpec>(),
            name,
        );
        queued(
            false,
            Box::new(move |config, version| plan_delete(config, version, std::slice::from_ref(&key), None)),
        )
    }

    fn started(base_version: u64, first: Queued, write: Write) -> Batch {
        let bytes = write.entry_bytes();
        Batch::new(base_version, first, write, bytes)
    }

    fn named(writes: &[Write]) -> Vec<String> {
        writes
            .iter()
            .map(|write| {
                let keys: Vec<String> = write
                    .changes
                    .iter()
                    .map(|change| change.key.to_string())
                    .collect();
                keys.join("+")
            })
            .collect()
    }

    /// `stored` holding the Listener `gw` and the Backend `shared`, and this build's reading.
    fn base() -> (StoredConfig, Arc<ConfigSet>) {
        let mut stored = StoredConfig::default();
        let listener = json!({"apiVersion": "portcullis.dev/v1alpha1", "kind": "Listener",
            "metadata": {"name": "gw"}, "spec": {"port": 8080}});
        let write = put(&stored, vec![listener, backend("shared", "127.0.0.1:1")], None).unwrap();
        stored.apply(&write).unwrap();
        let Reading::Readable(config) = stored.read() else {
            panic!("unreadable")
        };
        (stored, config)
    }

    #[test]
    fn waiting_writes_join_only_where_they_change_nothing_the_batch_planned() {
        let (mut stored, config) = base();
        let first = applying(vec![backend("a", "127.0.0.1:2")], None);
        let planned = (first.plan)(&config, stored.version).unwrap();
        let mut batch = started(stored.version, first, planned.write);
        let mut waiting = VecDeque::from([
            // Valid only after the first write: joins.
            applying(vec![route("to-a", "gw", "a")], None),
            // Pinned to the version: waits, to be planned on a committed config.
            applying(vec![backend("pinned", "127.0.0.1:3")], Some(stored.version)),
            // Names what the first names: waits.
            applying(vec![backend("a", "127.0.0.1:4")], None),
            deleting_backend("shared"),
            // Refused after the delete before it, though valid on the committed config: waits.
            applying(vec![route("to-shared", "gw", "shared")], None),
            applying(vec![backend("c", "127.0.0.1:5")], None),
            // Its client stopped waiting: dropped, and nothing is planned on top of it.
            abandoned(applying(vec![backend("gone", "127.0.0.1:6")], None)),
            applying(vec![route("to-gone", "gw", "gone")], None),
            // Past its deadline: its client hears, from its own timer, that nothing changed.
            expired(applying(vec![backend("late", "127.0.0.1:7")], None)),
        ]);
        let late = waiting[waiting.len() - 1].state.clone();
        batch.gather(planned.config, &mut waiting);

        assert_eq!(
            named(&batch.writes),
            ["Backend/a", "Route/to-a", "Backend/shared", "Backend/c"]
        );
        assert_eq!(
            batch
                .members
                .iter()
                .map(|member| member.changes.len())
                .collect::<Vec<_>>(),
            [1, 1, 1, 1],
            "each member answers its own changes"
        );
        let left: Vec<bool> = waiting.iter().map(|queued| queued.pinned).collect();
        assert_eq!(left, [true, false, false, false]);
        // Left out for the batch's sake, not refused: each is valid on the committed config.
        for queued in waiting.iter().take(3) {
            assert!((queued.plan)(&config, stored.version).is_ok());
        }
        let joined = batch
            .members
            .iter()
            .map(|member| member.queued.state.load(Ordering::Acquire));
        assert!(joined.skip(1).all(|state| state == PROPOSED), "joined unclaimed");
        assert_eq!(late.load(Ordering::Acquire), ABANDONED);

        // One entry: applies whole on the version the batch was planned on.
        let applied = stored.apply(&Write::batch(1, batch.writes)).unwrap();
        assert_eq!(applied.version, 2);
        let Reading::Readable(after) = stored.read() else {
            panic!("the batch left a config this build cannot read")
        };
        let names: Vec<String> = after.objects().map(|object| object.key().to_string()).collect();
        assert_eq!(names, ["Listener/gw", "Route/to-a", "Backend/a", "Backend/c"]);
    }

    #[test]
    fn a_batch_stops_at_its_size() {
        let (stored, config) = base();
        let first = applying(vec![backend("first", "127.0.0.1:2")], None);
        let planned = (first.plan)(&config, stored.version).unwrap();
        let mut batch = started(stored.version, first, planned.write);
        let mut waiting: VecDeque<Queued> = (0..BATCH_WRITES)
            .map(|index| applying(vec![backend(&format!("b-{index}"), "127.0.0.1:3")], None))
            .collect();
        batch.gather(planned.config, &mut waiting);
        assert_eq!((batch.members.len(), waiting.len()), (BATCH_WRITES, 1));
        let entry = Write::batch(stored.version, batch.writes.clone()).entry_bytes();
        assert!(
            entry <= batch.bytes,
            "the batch's entry is {entry} bytes, counted {}",
            batch.bytes
        );

        let many: Vec<serde_json::Value> = (0..BATCH_OBJECTS)
            .map(|index| backend(&format!("many-{index}"), "127.0.0.1:3"))
            .collect();
        let first = applying(many, None);
        let planned = (first.plan)(&config, stored.version).unwrap();
        let mut batch = started(stored.version, first, planned.write);
        let mut waiting = VecDeque::from([applying(vec![backend("late", "127.0.0.1:3")], None)]);
        batch.gather(planned.config, &mut waiting);
        assert_eq!((batch.members.len(), waiting.len()), (1, 1));

        // Writes that cannot join are planned for one batch's worth, no further.
        let first = applying(vec![backend("contended", "127.0.0.1:2")], None);
        let planned = (first.plan)(&config, stored.version).unwrap();
        let mut batch = started(stored.version, first, planned.write);
        let mut waiting: VecDeque<Queued> = (0..BATCH_WRITES)
            .map(|port| {
                applying(
                    vec![backend("contended", &format!("127.0.0.1:{}", port + 3))],
                    None,
                )
            })
            .chain([applying(vec![backend("free", "127.0.0.1:3")], None)])
            .collect();
        batch.gather(planned.config, &mut waiting);
        assert_eq!((batch.members.len(), waiting.len()), (1, BATCH_WRITES + 1));

        // Within the object count, but over the bytes an entry may carry.
        let endpoints: Vec<String> = (0..80)
            .map(|port| format!("127.0.0.1:{}", 10_000 + port))
            .collect();
        let heavy: Vec<serde_json::Value> = (0..900)
            .map(|index| {
                let mut object = backend(&format!("heavy-{index}"), "127.0.0.1:3");
                object["spec"]["endpoints"] = json!(endpoints);
                object
            })
            .collect();
        assert!(heavy.iter().map(|object| object.to_string().len()).sum::<usize>() > BATCH_BYTES);
        let first = applying(vec![backend("light", "127.0.0.1:2")], None);
        let planned = (first.plan)(&config, stored.version).unwrap();
        let mut batch = started(stored.version, first, planned.write);
        let mut waiting = VecDeque::from([applying(heavy, None)]);
        batch.gather(planned.config, &mut waiting);
        assert_eq!((batch.members.len(), waiting.len()), (1, 1));
        assert!(
            (waiting[0].plan)(&config, stored.version).is_ok(),
            "left out, not refused"
        );
    }

    /// `count` Backends of one size each, together about `count` times the bytes of one.
    fn heavy_backends(count: usize) -> Vec<serde_json::Value> {
        let endpoints: Vec<String> = (0..100)
            .map(|port| format!("10.0.0.1:{}", 10_000 + port))
            .collect();
        (0..count)
            .map(|index| {
                let mut object = backend(&format!("heavy-{index:05}"), "127.0.0.1:3");
                object["spec"]["endpoints"] = json!(endpoints);
                object
            })
            .collect()
    }

    fn entry_bytes_of(objects: Vec<serde_json::Value>) -> usize {
        put(&StoredConfig::default(), objects, None)
            .unwrap()
            .entry_bytes()
    }

    /// A write whose entry would be over the budget is refused on the leader, and replication
    /// goes on: one just within it commits on both nodes, and so do the writes after it.
    #[tokio::test]
    async fn a_write_over_the_entry_budget_is_refused_and_the_cluster_keeps_committing() {
        use portcullis_proto::v1::{AddNodeRequest, ListRequest, ReadConsistency};
        use tonic::Code;

        use crate::testutil::{admin, apply_request, start, wait_for_leader, wait_status};

        let one = entry_bytes_of(heavy_backends(1));
        let per_object = entry_bytes_of(heavy_backends(2)) - one;
        let over = (ENTRY_BYTES - one) / per_object + 2;
        let (within, beyond) = (
            entry_bytes_of(heavy_backends(over - 1)),
            entry_bytes_of(heavy_backends(over)),
        );
        assert!(
            within <= ENTRY_BYTES && ENTRY_BYTES < beyond,
            "{within}, {beyond}"
        );

        let (dir1, dir2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let leader = start(dir1.path(), 1, false).await;
        let mut client = admin(leader.local_addr()).await;
        wait_for_leader(&mut client).await;
        let follower = start(dir2.path(), 2, true).await;
        let add = AddNodeRequest {
            node_id: 2,
            address: follower.local_addr().to_string(),
        };
        client.add_node(add).await.unwrap();

        // Validate says so beforehand, as Apply does.
        let judged = client
            .validate(apply_request(heavy_backends(over), None))
            .await
            .unwrap_err();
        let refused = client
            .apply(apply_request(heavy_backends(over), None))
            .await
            .unwrap_err();
        for refused in [judged, refused] {
            assert_eq!(refused.code(), Code::InvalidArgument, "{}", refused.message());
            assert!(
                refused.message().contains("apply the objects in parts"),
                "{}",
                refused.message()
            );
        }
        client
            .validate(apply_request(heavy_backends(over - 1), None))
            .await
            .unwrap();
        let applied = client
            .apply(apply_request(heavy_backends(over - 1), None))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(applied.version, 1);
        let applied = client
            .apply(apply_request(vec![backend("small", "127.0.0.1:4")], None))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(applied.version, 2);

        let mut on_follower = admin(follower.local_addr()).await;
        wait_status(&mut on_follower, |status| status.version == 2).await;
        let local = ListRequest {
            consistency: ReadConsistency::Local.into(),
            ..Default::default()
        };
        let listed = on_follower.list(local).await.unwrap().into_inner();
        assert_eq!(listed.objects.len(), over);
        follower.shutdown().await.unwrap();
        leader.shutdown().await.unwrap();
    }
}
