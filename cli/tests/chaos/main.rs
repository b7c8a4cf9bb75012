//! The control plane under faults, with every operation recorded and the history checked
//! (`history.rs`): no acknowledged write lost, no read older than a write acknowledged before
//! it began, never two leaders in one term.
//!
//! - A 3-node cluster, each node in its own network namespace (`netns.rs`), under concurrent
//!   writers and a linearizable reader while the leader is SIGKILLed and restarted and nodes
//!   (the leader among them) are partitioned from the others and healed. Besides the
//!   recorded writers, tasks race to add and remove Routes and the Backends they refer to:
//!   no read may show a Route to a Backend it does not hold.
//! - Crash safety of the storage (log file and sled): one node SIGKILLed mid-write again and
//!   again; every restart must come back, with every acknowledged write.
//!
//! Bounded for the suite; `PORTCULLIS_CHAOS_SECONDS` (default 40) and
//! `PORTCULLIS_CRASH_CYCLES` (default 50) make the longer runs of docs/operations.md, with
//! `--release`: an unoptimized node's whole-config read outgrows `OPERATION_TIMEOUT` as the
//! crash loop's config grows past 100,000 objects.

mod history;
mod netns;
#[path = "../support/mod.rs"]
mod support;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use history::{Leadership, Observed, Read, Report, Write};
use portcullis_proto::v1::admin_client::AdminClient;
use portcullis_proto::v1::{
    ApplyRequest, DeleteRequest, ListRequest, ListResponse, Object, ObjectRef, StatusRequest,
};
use portcullis_proto::LEADER_METADATA_KEY;
use serde_json::json;
use support::*;
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

/// Longer than an election (1–2 s), shorter than the control plane's 10 s commit deadline:
/// an operation that takes longer counts as failed, its effect unknown.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(3);
const PORT: u16 = 7070;

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// Admin clients for every node. Operations follow leader redirects (a follower never
/// proposes, so following one cannot apply a write twice). A refusal on the merits fails the
/// operation and keeps the next one on that node; any other failure moves it to another.
struct Clients {
    channels: Vec<Channel>,
    /// Each node's address as the cluster knows it, to map a redirect to a node.
    cluster_addresses: Vec<String>,
    next: AtomicUsize,
}

impl Clients {
    fn new(client_addresses: &[String], cluster_addresses: Vec<String>) -> Clients {
        let channels = client_addresses
            .iter()
            .map(|address| {
                Endpoint::from_shared(format!("http://{address}"))
                    .unwrap()
                    .connect_timeout(Duration::from_millis(500))
                    .timeout(OPERATION_TIMEOUT)
                    .connect_lazy()
            })
            .collect();
        Clients {
            channels,
            cluster_addresses,
            next: AtomicUsize::new(0),
        }
    }

    async fn call<T, F, Fut>(&self, call: F) -> Option<T>
    where
        F: Fn(AdminClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let mut node = self.next.load(Ordering::Relaxed);
        for _ in 0..3 {
            let client = AdminClient::new(self.channels[node].clone())
                .max_decoding_message_size(portcullis_proto::MAX_MESSAGE_BYTES);
            match tokio::time::timeout(OPERATION_TIMEOUT, call(client)).await {
                Ok(Ok(response)) => {
                    self.next.store(node, Ordering::Relaxed);
                    return Some(response.into_inner());
                }
                Ok(Err(status)) => {
                    let leader = status
                        .metadata()
                        .get(LEADER_METADATA_KEY)
                        .and_then(|value| value.to_str().ok())
                        .and_then(|leader| self.cluster_addresses.iter().position(|a| a == leader));
                    match leader {
                        Some(leader) if leader != node => node = leader,
                        // A refusal on the merits (a delete of an object still referred
                        // to, ...) came from a node that answers: the next operation starts
                        // there too.
                        _ if matches!(
                            status.code(),
                            Code::FailedPrecondition
                                | Code::InvalidArgument
                                | Code::NotFound
                                | Code::AlreadyExists
                        ) =>
                        {
                            self.next.store(node, Ordering::Relaxed);
                            return None;
                        }
                        _ => break,
                    }
                }
                Err(_) => break,
            }
        }
        self.next
            .store((node + 1) % self.channels.len(), Ordering::Relaxed);
        None
    }

    /// Creates the Backend `name`, one of the recorded writes.
    async fn write(&self, name: &str) -> Option<u64> {
        self.apply("Backend", name, json!({"endpoints": ["127.0.0.1:9"]}))
            .await
    }

    async fn apply(&self, kind: &str, name: &str, spec: serde_json::Value) -> Option<u64> {
        let object = json!({"apiVersion": "portcullis.dev/v1alpha1", "kind": kind,
            "metadata": {"name": name}, "spec": spec});
        let request = ApplyRequest {
            objects: vec![Object {
                kind: kind.into(),
                name: name.into(),
                json: object.to_string().into_bytes().into(),
            }],
            expected_version: None,
        };
        let response = self
            .call(|mut client| {
                let request = request.clone();
                async move { client.apply(request).await }
            })
            .await?;
        Some(response.version)
    }

    async fn delete(&self, kind: &str, name: &str) -> Option<u64> {
        let request = DeleteRequest {
            objects: vec![ObjectRef {
                kind: kind.into(),
                name: name.into(),
            }],
            expected_version: None,
        };
        let response = self
            .call(|mut client| {
                let request = request.clone();
                async move { client.delete(request).await }
            })
            .await?;
        Some(response.version)
    }

    /// A linearizable read of the whole config.
    async fn read(&self) -> Option<Observed> {
        let response = self
            .call(|mut client| async move { client.list(ListRequest::default()).await })
            .await?;
        Some(observed(response))
    }
}

/// What a read of every object shows: the recorded writers' Backends, and every Route that
/// refers to a Listener or a Backend the read does not hold.
fn observed(response: ListResponse) -> Observed {
    let held: BTreeSet<(String, String)> = response
        .objects
        .iter()
        .map(|object| (object.kind.clone(), object.name.clone()))
        .collect();
    let mut broken = Vec::new();
    for object in response.objects.iter().filter(|object| object.kind == "Route") {
        let Ok(route) = serde_json::from_slice::<serde_json::Value>(&object.json) else {
            broken.push(format!("Route/{}'s JSON does not parse", object.name));
            continue;
        };
        let listeners = route["spec"]["listeners"].as_array().into_iter().flatten();
        let backends = route["spec"]["backends"].as_array().into_iter().flatten();
        let references = listeners
            .map(|listener| ("Listener", listener.as_str()))
            .chain(backends.map(|backend| {
                (
                    backend["kind"].as_str().unwrap_or("Backend"),
                    backend["name"].as_str(),
                )
            }));
        for (kind, name) in references {
            let name = name.unwrap_or_default();
            if !held.contains(&(kind.to_string(), name.to_string())) {
                broken.push(format!(
                    "Route/{} refers to {kind}/{name}, which the read does not hold",
                    object.name
                ));
            }
        }
    }
    Observed {
        version: response.version,
        names: response
            .objects
            .into_iter()
            .filter(|object| object.kind == "Backend" && object.name.starts_with(WRITER_PREFIX))
            .map(|object| object.name)
            .collect(),
        broken,
    }
}

/// What the writers and the reader recorded.
#[derive(Default)]
struct Recorder {
    writes: Mutex<Vec<Write>>,
    reads: Mutex<Vec<Read>>,
}

/// Concurrent writers: their writes queue at the leader, so faults also meet writes waiting
/// behind another one's commit.
const WRITERS: usize = 3;
/// Names of the recorded writers' Backends start so; no other object's does.
const WRITER_PREFIX: &str = "recorded-";
/// Tasks racing on Routes and the Backends they refer to, and how many Backends they share.
const LINKERS: usize = 2;
const SHARED_BACKENDS: u64 = 3;
/// The Listener every linker's Route is served on.
const LINKED_LISTENER: &str = "linked";

/// `LINKERS` tasks that, until `stop`, each pick one of a few shared Backends and create it,
/// delete it, give it a Route of the task's own, or delete that Route, counting the Routes
/// created in `routes`. Apply refuses a Route to a missing Backend and delete a Backend a
/// Route still refers to, so a Route pointing nowhere can only come from a write applied on
/// a config it was not planned on.
fn linkers(
    clients: &Arc<Clients>,
    routes: &Arc<AtomicUsize>,
    stop: &Arc<AtomicBool>,
    pause: Duration,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..LINKERS)
        .map(|linker_id| {
            tokio::spawn(linker(
                linker_id,
                clients.clone(),
                routes.clone(),
                stop.clone(),
                pause,
            ))
        })
        .collect()
}

async fn linker(
    linker_id: usize,
    clients: Arc<Clients>,
    routes: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    pause: Duration,
) {
    let listener = json!({"address": "127.0.0.1", "port": 1});
    while clients
        .apply("Listener", LINKED_LISTENER, listener.clone())
        .await
        .is_none()
    {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        tokio::time::sleep(pause).await;
    }
    let mut dice = Dice::new(&format!("linker {linker_id}"));
    while !stop.load(Ordering::Relaxed) {
        let backend = format!("shared-{}", dice.below(SHARED_BACKENDS));
        let route = format!("linked-{linker_id}-{backend}");
        match dice.below(4) {
            0 => {
                clients
                    .apply("Backend", &backend, json!({"endpoints": ["127.0.0.1:9"]}))
                    .await
            }
            1 => clients.delete("Backend", &backend).await,
            2 => {
                let spec = json!({"listeners": [LINKED_LISTENER], "backends": [{"name": backend}]});
                let acked = clients.apply("Route", &route, spec).await;
                if acked.is_some() {
                    routes.fetch_add(1, Ordering::Relaxed);
                }
                acked
            }
            _ => clients.delete("Route", &route).await,
        };
        tokio::time::sleep(pause).await;
    }
}

/// `WRITERS` tasks, each writing a new object every `pause` until `stop`, recording each
/// outcome.
fn writers(
    clients: &Arc<Clients>,
    recorder: &Arc<Recorder>,
    stop: &Arc<AtomicBool>,
    pause: Duration,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..WRITERS)
        .map(|writer_id| {
            tokio::spawn(writer(
                writer_id,
                clients.clone(),
                recorder.clone(),
                stop.clone(),
                pause,
            ))
        })
        .collect()
}

async fn writer(
    writer_id: usize,
    clients: Arc<Clients>,
    recorder: Arc<Recorder>,
    stop: Arc<AtomicBool>,
    pause: Duration,
) {
    let mut sequence = 0;
    while !stop.load(Ordering::Relaxed) {
        sequence += 1;
        let name = format!("{WRITER_PREFIX}{writer_id}-{sequence}");
        let acked = clients.write(&name).await;
        recorder.writes.lock().unwrap().push(Write {
            name,
            ended: Instant::now(),
            acked,
        });
        tokio::time::sleep(pause).await;
    }
}

/// Reads every `pause` until `stop`, recording each outcome.
async fn reader(clients: Arc<Clients>, recorder: Arc<Recorder>, stop: Arc<AtomicBool>, pause: Duration) {
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let result = clients.read().await;
        recorder.reads.lock().unwrap().push(Read {
            started,
            ended: Instant::now(),
            result,
        });
        tokio::time::sleep(pause).await;
    }
}

/// Each node's own word on the term and its leader, polled until `stop`.
async fn observe_leadership(clients: Arc<Clients>, seen: Arc<Mutex<Vec<Leadership>>>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        for channel in &clients.channels {
            let mut client = AdminClient::new(channel.clone());
            let status = tokio::time::timeout(
                Duration::from_millis(300),
                client.status(StatusRequest::default()),
            )
            .await;
            if let Ok(Ok(status)) = status {
                if let Some(cluster) = status.into_inner().cluster {
                    seen.lock().unwrap().push(Leadership {
                        node: cluster.node_id,
                        term: cluster.term,
                        leader: cluster.leader_id,
                    });
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn print_report(what: &str, report: &Report, faults: &str) {
    println!(
        "{what}: {} writes ({} acknowledged, {} of them at a version another shares, {} failed or unknown), {} reads ({} failed), {} terms with a leader, {faults}; violations: {}",
        report.writes,
        report.acked,
        report.acked_together,
        report.failed_writes,
        report.reads,
        report.failed_reads,
        report.terms,
        report.violations.len()
    );
}

fn assert_no_violations(report: &Report) {
    assert!(
        report.violations.is_empty(),
        "{} violations:\n{}",
        report.violations.len(),
        report.violations.join("\n")
    );
}

/// A small xorshift generator seeded from the clock, for fault timing and the linkers' choices:
/// cheap, and its seed printed so a failed run's log says which sequence it drew.
struct Dice(u64);

impl Dice {
    /// `what` names the dice in the line that prints its seed.
    fn new(what: &str) -> Dice {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|elapsed| elapsed.as_nanos() as u64)
            .unwrap_or(1)
            | 1;
        println!("{what} seed {seed}");
        Dice(seed)
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound
    }
}

/// Dropped in field order: the nodes stop (printing their logs if the test failed) before
/// their network and their data go.
struct Cluster {
    nodes: Vec<Option<Process>>,
    lab: netns::Lab,
    dir: tempfile::TempDir,
}

impl Cluster {
    fn start_node(&mut self, node: usize) {
        let (node_id, listen) = ((node + 1).to_string(), format!("0.0.0.0:{PORT}"));
        let advertise = format!("{}:{PORT}", self.lab.cluster_ip(node));
        let data = self.dir.path().join(format!("node-{node_id}"));
        let mut args = vec![
            "controlplane",
            "--node-id",
            &node_id,
            "--listen",
            &listen,
            "--advertise",
            &advertise,
            "--data-dir",
            data.to_str().unwrap(),
            "--metrics-listen",
            "127.0.0.1:0",
        ];
        if node > 0 {
            args.push("--join");
        }
        let wrapper = self.lab.wrapper(node);
        let wrapper: Vec<&str> = wrapper.iter().map(String::as_str).collect();
        let name = format!("node-{node_id}");
        self.nodes[node] = Some(Process::start_within(&name, self.dir.path(), &wrapper, &args));
    }

    fn kill(&mut self, node: usize) {
        if let Some(mut process) = self.nodes[node].take() {
            process.kill();
        }
    }
}

/// The node most nodes name as leader, if any.
async fn leader(clients: &Clients) -> Option<usize> {
    let mut named = Vec::new();
    for channel in &clients.channels {
        let mut client = AdminClient::new(channel.clone());
        if let Ok(Ok(status)) = tokio::time::timeout(
            Duration::from_millis(500),
            client.status(StatusRequest::default()),
        )
        .await
        {
            if let Some(leader) = status.into_inner().cluster.and_then(|cluster| cluster.leader_id) {
                named.push(leader);
            }
        }
    }
    let leader =
        (1..=clients.channels.len() as u64).max_by_key(|id| named.iter().filter(|n| *n == id).count())?;
    (named.iter().filter(|n| **n == leader).count() >= 2).then_some(leader as usize - 1)
}

/// Polls `check` until it gives a value, failing the test after `timeout`.
async fn until_some<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Some(value) = check().await {
            return value;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out after {timeout:?} waiting for {what}");
}

/// This node's own state, whatever its role.
async fn local_read(channel: &Channel) -> Option<Observed> {
    let mut client =
        AdminClient::new(channel.clone()).max_decoding_message_size(portcullis_proto::MAX_MESSAGE_BYTES);
    let local = ListRequest {
        consistency: portcullis_proto::v1::ReadConsistency::Local.into(),
        ..ListRequest::default()
    };
    Some(observed(client.list(local).await.ok()?.into_inner()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_under_kills_and_partitions_keeps_a_linearizable_history() {
    let seconds = env_number("PORTCULLIS_CHAOS_SECONDS", 40);
    let lab = netns::Lab::create(3).unwrap_or_else(|error| panic!("cannot build the test network: {error}"));
    let client_addresses: Vec<String> = (0..3).map(|n| format!("{}:{PORT}", lab.client_ip(n))).collect();
    let cluster_addresses: Vec<String> = (0..3).map(|n| format!("{}:{PORT}", lab.cluster_ip(n))).collect();
    let mut cluster = Cluster {
        nodes: (0..3).map(|_| None).collect(),
        lab,
        dir: tempfile::tempdir().unwrap(),
    };
    for node in 0..3 {
        cluster.start_node(node);
    }
    let clients = Arc::new(Clients::new(&client_addresses, cluster_addresses.clone()));
    until_some("node 1 answering", TIMEOUT, || clients.read()).await;
    // Formed through node 1, the first leader, with the CLI.
    for (node, address) in cluster_addresses.iter().enumerate().skip(1) {
        let node_id = (node + 1).to_string();
        let output = cli(&[
            "cluster",
            "add",
            "--node-id",
            &node_id,
            "--address",
            address,
            "--controlplane",
            &client_addresses[0],
        ]);
        assert!(
            output.status.success(),
            "adding node {node_id}: {}",
            stderr(&output)
        );
    }
    until_some("a leader named by a majority", TIMEOUT, || leader(&clients)).await;

    let recorder = Arc::new(Recorder::default());
    let leadership = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = writers(&clients, &recorder, &stop, Duration::from_millis(20));
    let linked_routes = Arc::new(AtomicUsize::new(0));
    tasks.extend(linkers(
        &clients,
        &linked_routes,
        &stop,
        Duration::from_millis(20),
    ));
    tasks.extend([
        tokio::spawn(reader(
            clients.clone(),
            recorder.clone(),
            stop.clone(),
            Duration::from_millis(50),
        )),
        tokio::spawn(observe_leadership(
            clients.clone(),
            leadership.clone(),
            stop.clone(),
        )),
    ]);

    // The faults: rounds alternate killing the leader (SIGKILL, restarted 5–6 s later) and
    // partitioning a node for 5–6 s, the leader every other time.
    let mut dice = Dice::new("fault schedule");
    let (mut kills, mut partitions) = (0, 0);
    let began = Instant::now();
    let deadline = began + Duration::from_secs(seconds);
    let mut round = 0;
    // Past the deadline only until both kinds of fault happened twice (a busy machine may
    // leave rounds without a leader), and at most a minute (eight rounds) longer.
    let cap = deadline + Duration::from_secs(60);
    while (Instant::now() < deadline || kills < 2 || partitions < 2) && Instant::now() < cap {
        tokio::time::sleep(Duration::from_millis(1000 + dice.below(1000))).await;
        let Some(target) = leader(&clients).await else {
            continue;
        };
        round += 1;
        if round % 2 == 1 {
            println!(
                "{:>6.1}s SIGKILL node {} (the leader)",
                began.elapsed().as_secs_f64(),
                target + 1
            );
            cluster.kill(target);
            kills += 1;
            // Down long enough for the others to elect a leader: a follower that knew a
            // leader waits out its lease and then an election timeout (3–4 s in all); a
            // leader back sooner resumes its term.
            tokio::time::sleep(Duration::from_millis(5000 + dice.below(1000))).await;
            cluster.start_node(target);
        } else {
            let node = match round % 4 {
                0 => target,
                _ => (target + 1 + dice.below(2) as usize) % 3,
            };
            println!(
                "{:>6.1}s partition node {} (leader: node {})",
                began.elapsed().as_secs_f64(),
                node + 1,
                target + 1
            );
            cluster.lab.partition(node);
            partitions += 1;
            tokio::time::sleep(Duration::from_millis(5000 + dice.below(1000))).await;
            cluster.lab.heal(node);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }

    // Healed and all running: the last read, and every node converging on it.
    let last = until_some("a linearizable read after the faults", TIMEOUT, || clients.read()).await;
    for channel in &clients.channels {
        until_some("every node holding the last read's state", TIMEOUT, || async {
            local_read(channel).await.filter(|state| *state == last)
        })
        .await;
    }

    let report = history::check(
        &recorder.writes.lock().unwrap(),
        &recorder.reads.lock().unwrap(),
        &leadership.lock().unwrap(),
        &last,
    );
    print_report(
        &format!("chaos ({seconds} s)"),
        &report,
        &format!(
            "{kills} leader kills, {partitions} partitions, {} Routes to shared Backends created",
            linked_routes.load(Ordering::Relaxed)
        ),
    );
    assert!(
        kills >= 2 && partitions >= 2,
        "too few faults: {kills} kills, {partitions} partitions"
    );
    assert!(
        linked_routes.load(Ordering::Relaxed) > 0,
        "no Route to a shared Backend was created"
    );
    assert!(
        report.acked > 0 && report.reads > report.failed_reads,
        "no operation succeeded"
    );
    assert_no_violations(&report);
}

/// The harness's control plane (data in `dir/controlplane`, kept across restarts), started
/// without holding up the writer tasks on the other worker.
fn start_single(dir: &Path, port: u16) -> Process {
    tokio::task::block_in_place(|| start_controlplane(dir, port))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_mid_write_again_and_again_keeps_every_acknowledged_write() {
    let cycles = env_number("PORTCULLIS_CRASH_CYCLES", 50);
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let address = format!("127.0.0.1:{port}");
    let clients = Arc::new(Clients::new(
        std::slice::from_ref(&address),
        vec![address.clone()],
    ));
    let recorder = Arc::new(Recorder::default());
    let stop = Arc::new(AtomicBool::new(false));
    let writers = writers(&clients, &recorder, &stop, Duration::from_millis(2));
    let mut dice = Dice::new("fault schedule");
    for _ in 0..cycles {
        let mut node = start_single(dir.path(), port);
        // Each restart must come back, with everything acknowledged before it.
        let started = Instant::now();
        let read = until_some("the restarted node answering a read", TIMEOUT, || clients.read()).await;
        recorder.reads.lock().unwrap().push(Read {
            started,
            ended: Instant::now(),
            result: Some(read),
        });
        tokio::time::sleep(Duration::from_millis(50 + dice.below(200))).await;
        node.kill();
    }
    stop.store(true, Ordering::Relaxed);
    for writer in writers {
        writer.await.unwrap();
    }
    let _node = start_single(dir.path(), port);
    let last = until_some("the last restart answering", TIMEOUT, || clients.read()).await;
    let report = history::check(
        &recorder.writes.lock().unwrap(),
        &recorder.reads.lock().unwrap(),
        &[],
        &last,
    );
    print_report("crash safety", &report, &format!("{cycles} SIGKILLs mid-write"));
    assert!(
        report.acked >= cycles as usize,
        "too few writes acknowledged to mean anything"
    );
    assert_no_violations(&report);
}
