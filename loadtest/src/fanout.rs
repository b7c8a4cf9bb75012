//! The control plane's fan-out, measured against a running cluster: a config of R routes in
//! S shards (one Listener per shard, labelled `shard=sN`), N lightweight subscribers of the
//! real config stream spread over the nodes (each its own HTTP/2 connection; it applies
//! whole versions and deltas to the objects it holds and ACKs, as a proxy does, without
//! compiling routes), and writes that each change one route:
//!
//! 1. an open-loop stream of writes at a fixed rate: commit latency (the Apply call), and
//!    commit → held by every subscriber;
//! 2. a closed loop of concurrent writers: the writes per second the cluster sustains.
//!
//! It reports bytes received per change, and CPU and memory of the control-plane processes
//! given with `--pids`. `loadtest/fanout-bench.sh` starts the cluster and runs it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;
use portcullis_proto::v1::admin_client::AdminClient;
use portcullis_proto::v1::config_stream_client::ConfigStreamClient;
use portcullis_proto::v1::proxy_message::Message;
use portcullis_proto::v1::{
    Ack, ApplyRequest, ConfigSnapshot, Hello, Nack, Object, ProxyMessage, StatusRequest,
};
use prost::Message as _;
use serde::Serialize;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use crate::plot::line_chart;
use crate::sim::report::Summary;

#[derive(Args, Clone)]
pub struct FanoutBenchArgs {
    /// Every control-plane node (admin address); subscribers are spread over them.
    #[arg(long, value_delimiter = ',', required = true)]
    pub controlplane: Vec<String>,
    #[arg(long, default_value_t = 1000)]
    pub subscribers: usize,
    #[arg(long, default_value_t = 10)]
    pub shards: usize,
    #[arg(long, default_value_t = 10_000)]
    pub routes: usize,
    /// Writes in the open-loop phase.
    #[arg(long, default_value_t = 200)]
    pub writes: usize,
    /// Writes per second in the open-loop phase.
    #[arg(long, default_value_t = 20.0)]
    pub rate: f64,
    /// Length of the closed-loop phase.
    #[arg(long, default_value = "10s")]
    pub sustained: humantime::Duration,
    /// Concurrent writers in the closed-loop phase.
    #[arg(long, default_value_t = 8)]
    pub sustained_writers: usize,
    /// Control-plane processes whose CPU and memory to report.
    #[arg(long, value_delimiter = ',')]
    pub pids: Vec<u32>,
    /// Where to write the report as JSON.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Where to write SVG charts of the open loop: each write's commit and fan-out latency
    /// over time, and both by percentile.
    #[arg(long)]
    pub plot_dir: Option<PathBuf>,
}

/// What the subscribers saw, shared by all of them.
#[derive(Default)]
struct Progress {
    /// Per subscriber, each version it came to hold and when.
    held: Vec<Mutex<Vec<(u64, Instant)>>>,
    /// Per subscriber, the version it holds now.
    current: Vec<AtomicU64>,
    whole_bytes: AtomicU64,
    delta_bytes: AtomicU64,
    whole_messages: AtomicU64,
    delta_messages: AtomicU64,
    refused: AtomicUsize,
}

impl Progress {
    fn new(subscribers: usize) -> Progress {
        Progress {
            held: (0..subscribers).map(|_| Mutex::default()).collect(),
            current: (0..subscribers).map(|_| AtomicU64::new(0)).collect(),
            ..Progress::default()
        }
    }

    fn all_hold(&self, version: u64) -> bool {
        self.current
            .iter()
            .all(|held| held.load(Ordering::Relaxed) >= version)
    }

    fn bytes(&self) -> (u64, u64) {
        (
            self.whole_bytes.load(Ordering::Relaxed),
            self.delta_bytes.load(Ordering::Relaxed),
        )
    }
}

#[derive(Serialize)]
pub struct FanoutReport {
    pub subscribers: usize,
    pub shards: usize,
    pub routes: usize,
    pub nodes: usize,
    /// From the first subscriber's Hello to every subscriber holding the whole config.
    pub initial_sync_seconds: f64,
    /// Open loop.
    pub writes: usize,
    pub rate: f64,
    pub commit_ms: Summary,
    /// Open-loop writes whose commit took longer than the p99 target (5 ms): a count that one
    /// stall of the machine moves by the writes it spans, where it can move the p99 itself
    /// (the 198th of 200, nearest rank) by its whole length.
    pub commits_over_5ms: usize,
    /// Commit (the Apply call returning) → every subscriber holding the version or a later one.
    pub applied_by_all_ms: Summary,
    /// Commit → each subscriber holding it (one sample per subscriber and version).
    pub applied_by_each_ms: Summary,
    /// Bytes the subscribers received per write, all of them together (protobuf).
    pub bytes_per_change: f64,
    pub whole_messages: u64,
    pub delta_messages: u64,
    /// Closed loop.
    pub sustained_writers: usize,
    pub sustained_writes_per_second: f64,
    pub sustained_commit_ms: Summary,
    pub controlplane: Vec<ProcessUsage>,
}

#[derive(Serialize)]
pub struct ProcessUsage {
    pub pid: u32,
    /// CPU time over the open-loop phase, in cores (1.0 = one core busy throughout).
    pub open_loop_cores: f64,
    pub sustained_cores: f64,
    pub rss_mib: f64,
    pub peak_rss_mib: f64,
}

/// A runtime started inside another, which cannot be dropped there the usual way (that
/// blocks): it stops in the background.
struct InnerRuntime(Option<tokio::runtime::Runtime>);

impl InnerRuntime {
    fn spawn(&self, work: impl std::future::Future<Output = ()> + Send + 'static) {
        if let Some(runtime) = &self.0 {
            runtime.spawn(work);
        }
    }
}

impl Drop for InnerRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

pub async fn run(args: FanoutBenchArgs) -> anyhow::Result<()> {
    if args.shards == 0 || args.subscribers == 0 || args.routes < args.shards {
        bail!("need at least one shard, one subscriber and a route per shard");
    }
    let mut admin = Admin::connect(&args.controlplane).await?;
    eprintln!("applying {} routes in {} shards", args.routes, args.shards);
    let mut version = 0;
    for chunk in base_config(&args).chunks(2_000) {
        version = admin.apply(chunk.to_vec()).await?.0;
    }

    let progress = Arc::new(Progress::new(args.subscribers));
    let started = Instant::now();
    // The subscribers stand for proxies elsewhere: on a runtime of their own, so a write's
    // answer is not read only after a thousand subscribers handled the version it made.
    let subscribers = InnerRuntime(Some(
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_name("subscribers")
            .build()
            .context("starting the subscribers' runtime")?,
    ));
    for index in 0..args.subscribers {
        let node = args.controlplane[index % args.controlplane.len()].clone();
        let shard = format!("s{}", index % args.shards);
        subscribers.spawn(subscribe(node, index, shard, progress.clone()));
    }
    wait_for(&progress, version, Duration::from_secs(300)).await?;
    let initial_sync_seconds = started.elapsed().as_secs_f64();
    eprintln!(
        "{} subscribers hold version {version} after {initial_sync_seconds:.1} s",
        args.subscribers
    );

    // Open loop: one write every 1/rate seconds, each changing one route.
    let cpu_before = cpu_ticks(&args.pids);
    let (bytes_before, messages_before) = (progress.bytes(), messages(&progress));
    let phase_started = Instant::now();
    let mut commits = Vec::with_capacity(args.writes);
    for write in 0..args.writes {
        let due = phase_started + Duration::from_secs_f64(write as f64 / args.rate);
        tokio::time::sleep_until(due.into()).await;
        let sent = Instant::now();
        let (committed, at) = admin
            .apply(vec![route_object(&args, write % args.routes, write + 1)])
            .await?;
        commits.push((committed, at, at - sent));
    }
    let last = commits.last().map_or(version, |(version, _, _)| *version);
    wait_for(&progress, last, Duration::from_secs(60)).await?;
    let open_loop = phase_started.elapsed();
    let cpu_open = cpu_ticks(&args.pids);
    let (bytes_after, messages_after) = (progress.bytes(), messages(&progress));

    let (by_all, by_each) = fan_out_latency(&progress, &commits);
    let commit_ms = Summary::of(commits.iter().map(|(_, _, took)| millis(*took)).collect());
    let commits_over_5ms = commits
        .iter()
        .filter(|(_, _, took)| *took > Duration::from_millis(5))
        .count();
    if let Some(dir) = &args.plot_dir {
        plot_open_loop(dir, phase_started, &commits, &by_all, args.subscribers)?;
    }

    // Closed loop: writers as fast as commits come back.
    eprintln!(
        "closed loop: {} writers for {}",
        args.sustained_writers, args.sustained
    );
    let sustained_started = Instant::now();
    let deadline = sustained_started + *args.sustained;
    let mut writers = tokio::task::JoinSet::new();
    for writer in 0..args.sustained_writers {
        let (mut admin, args) = (admin.clone(), args.clone());
        writers.spawn(async move {
            let mut took = Vec::new();
            let mut n = 0;
            while Instant::now() < deadline {
                let sent = Instant::now();
                let route = (writer * 7919 + n) % args.routes;
                admin
                    .apply(vec![route_object(&args, route, 1_000_000 + writer * 100_000 + n)])
                    .await?;
                took.push(millis(sent.elapsed()));
                n += 1;
            }
            anyhow::Ok(took)
        });
    }
    let mut sustained = Vec::new();
    while let Some(joined) = writers.join_next().await {
        sustained.extend(joined.context("writer task")??);
    }
    let sustained_seconds = sustained_started.elapsed().as_secs_f64();
    let cpu_sustained = cpu_ticks(&args.pids);

    let changes = args.writes.max(1) as f64;
    let report = FanoutReport {
        subscribers: args.subscribers,
        shards: args.shards,
        routes: args.routes,
        nodes: args.controlplane.len(),
        initial_sync_seconds,
        writes: args.writes,
        rate: args.rate,
        commit_ms,
        commits_over_5ms,
        applied_by_all_ms: Summary::of(by_all),
        applied_by_each_ms: Summary::of(by_each),
        bytes_per_change: ((bytes_after.0 + bytes_after.1) - (bytes_before.0 + bytes_before.1)) as f64
            / changes,
        whole_messages: messages_after.0 - messages_before.0,
        delta_messages: messages_after.1 - messages_before.1,
        sustained_writers: args.sustained_writers,
        sustained_writes_per_second: sustained.len() as f64 / sustained_seconds,
        sustained_commit_ms: Summary::of(sustained),
        controlplane: args
            .pids
            .iter()
            .enumerate()
            .map(|(index, pid)| {
                let (rss_mib, peak_rss_mib) = memory(*pid);
                let cores = |from: &[u64], to: &[u64], seconds: f64| {
                    to.get(index).zip(from.get(index)).map_or(0.0, |(to, from)| {
                        (to - from) as f64 / CLOCK_TICKS_PER_SECOND / seconds
                    })
                };
                ProcessUsage {
                    pid: *pid,
                    open_loop_cores: cores(&cpu_before, &cpu_open, open_loop.as_secs_f64()),
                    sustained_cores: cores(&cpu_open, &cpu_sustained, sustained_seconds),
                    rss_mib,
                    peak_rss_mib,
                }
            })
            .collect(),
    };
    if progress.refused.load(Ordering::Relaxed) > 0 {
        eprintln!(
            "warning: subscribers refused {} messages",
            progress.refused.load(Ordering::Relaxed)
        );
    }
    let text = serde_json::to_string_pretty(&report)?;
    println!("{text}");
    if let Some(path) = &args.report {
        std::fs::write(path, &text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Each write's commit and commit → held by all, against when it was sent, and both sorted
/// by percentile (where the p50 and p99 targets read off).
fn plot_open_loop(
    dir: &Path,
    started: Instant,
    commits: &[(u64, Instant, Duration)],
    by_all: &[f64],
    subscribers: usize,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let held = format!("commit → held by all {subscribers}");
    let sent_at = |(_, at, took): &(u64, Instant, Duration)| (*at - *took - started).as_secs_f64();
    let over_time = vec![
        (
            "commit".to_string(),
            commits.iter().map(|c| (sent_at(c), millis(c.2))).collect(),
        ),
        (
            held.clone(),
            commits
                .iter()
                .zip(by_all)
                .map(|(c, all)| (sent_at(c), *all))
                .collect(),
        ),
    ];
    let by_percentile = |mut values: Vec<f64>| -> Vec<(f64, f64)> {
        values.sort_by(f64::total_cmp);
        let n = values.len().max(1) as f64;
        values
            .iter()
            .enumerate()
            .map(|(rank, value)| (100.0 * (rank + 1) as f64 / n, *value))
            .collect()
    };
    let percentiles = vec![
        (
            "commit".to_string(),
            by_percentile(commits.iter().map(|c| millis(c.2)).collect()),
        ),
        (held, by_percentile(by_all.to_vec())),
    ];
    for (file, title, x, lines) in [
        (
            "latency_over_time.svg",
            "Each write, open loop",
            "sent at (s)",
            over_time,
        ),
        (
            "latency_by_percentile.svg",
            "Writes by percentile, open loop",
            "percentile",
            percentiles,
        ),
    ] {
        let svg = line_chart(title, x, "latency (ms)", lines)?;
        let path = dir.join(file);
        std::fs::write(&path, svg).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}

fn messages(progress: &Progress) -> (u64, u64) {
    (
        progress.whole_messages.load(Ordering::Relaxed),
        progress.delta_messages.load(Ordering::Relaxed),
    )
}

/// For each write, commit → the last subscriber to hold it (or a later version), and
/// commit → each subscriber.
fn fan_out_latency(progress: &Progress, commits: &[(u64, Instant, Duration)]) -> (Vec<f64>, Vec<f64>) {
    let held: Vec<Vec<(u64, Instant)>> = progress
        .held
        .iter()
        .map(|held| {
            held.lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .clone()
        })
        .collect();
    let mut by_all = Vec::new();
    let mut by_each = Vec::new();
    for (version, committed, _) in commits {
        let mut slowest = Duration::ZERO;
        for subscriber in &held {
            // Versions come in order, so the first at or past `version` is when it arrived.
            if let Some((_, at)) = subscriber.iter().find(|(held, _)| held >= version) {
                let took = at.saturating_duration_since(*committed);
                slowest = slowest.max(took);
                by_each.push(millis(took));
            }
        }
        by_all.push(millis(slowest));
    }
    (by_all, by_each)
}

async fn wait_for(progress: &Progress, version: u64, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !progress.all_hold(version) {
        if Instant::now() > deadline {
            let behind = progress
                .current
                .iter()
                .filter(|held| held.load(Ordering::Relaxed) < version)
                .count();
            bail!("{behind} subscribers did not reach version {version} within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// One subscriber: holds its slice as a proxy would and ACKs each version, reconnecting
/// (whole again) if its stream fails.
async fn subscribe(node: String, index: usize, shard: String, progress: Arc<Progress>) {
    let instance = format!("{index}-{}", rand::random::<u32>());
    loop {
        if let Err(error) = session(&node, index, &shard, &instance, &progress).await {
            eprintln!("subscriber {index}: {error:#}; reconnecting");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

async fn session(
    node: &str,
    index: usize,
    shard: &str,
    instance: &str,
    progress: &Progress,
) -> anyhow::Result<()> {
    let channel = Endpoint::from_shared(format!("http://{node}"))?.connect().await?;
    let mut client =
        ConfigStreamClient::new(channel).max_decoding_message_size(portcullis_proto::MAX_MESSAGE_BYTES);
    let (outbound, outbound_stream) = mpsc::channel(4);
    let hello = Hello {
        proxy_id: format!("bench-{index}"),
        shard: [("shard".to_string(), shard.to_string())].into(),
        last_version: progress.current[index].load(Ordering::Relaxed),
        instance: instance.to_string(),
        accepts_deltas: true,
    };
    outbound
        .send(ProxyMessage {
            message: Some(Message::Hello(hello)),
        })
        .await?;
    let mut stream = client
        .subscribe(ReceiverStream::new(outbound_stream))
        .await?
        .into_inner();
    let mut objects: HashMap<(String, String), Bytes> = HashMap::new();
    let mut held = None;
    while let Some(message) = stream.message().await? {
        let bytes = message.encoded_len() as u64;
        let reply = match apply(&mut objects, held, &message) {
            Ok(()) => {
                let (count, total) = match message.base_version {
                    Some(_) => (&progress.delta_messages, &progress.delta_bytes),
                    None => (&progress.whole_messages, &progress.whole_bytes),
                };
                count.fetch_add(1, Ordering::Relaxed);
                total.fetch_add(bytes, Ordering::Relaxed);
                held = Some(message.version);
                progress.current[index].store(message.version, Ordering::Relaxed);
                progress.held[index]
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .push((message.version, Instant::now()));
                Message::Ack(Ack {
                    version: message.version,
                })
            }
            Err(reason) => {
                progress.refused.fetch_add(1, Ordering::Relaxed);
                Message::Nack(Nack {
                    version: message.version,
                    reason,
                })
            }
        };
        outbound.send(ProxyMessage { message: Some(reply) }).await?;
    }
    Ok(())
}

/// What a proxy does with a message, short of compiling: a whole version replaces what it
/// holds; a delta applies only to its base.
fn apply(
    objects: &mut HashMap<(String, String), Bytes>,
    held: Option<u64>,
    message: &ConfigSnapshot,
) -> Result<(), String> {
    match message.base_version {
        None => objects.clear(),
        Some(base) if Some(base) != held => return Err(format!("delta against {base}, holding {held:?}")),
        Some(_) => {
            for removed in &message.removed {
                if objects
                    .remove(&(removed.kind.clone(), removed.name.clone()))
                    .is_none()
                {
                    return Err(format!("removes {}/{}, not held", removed.kind, removed.name));
                }
            }
        }
    }
    for object in &message.objects {
        objects.insert((object.kind.clone(), object.name.clone()), object.json.clone());
    }
    Ok(())
}

/// Admin calls on the leader, found through any node.
#[derive(Clone)]
struct Admin {
    client: AdminClient<Channel>,
}

impl Admin {
    async fn connect(nodes: &[String]) -> anyhow::Result<Admin> {
        for node in nodes {
            let Ok(channel) = Endpoint::from_shared(format!("http://{node}"))?.connect().await else {
                continue;
            };
            let mut client = AdminClient::new(channel.clone());
            let Ok(status) = client.status(StatusRequest::default()).await else {
                continue;
            };
            let Some(cluster) = status.into_inner().cluster else {
                continue;
            };
            let Some(leader) = cluster
                .leader_id
                .and_then(|leader| cluster.members.iter().find(|member| member.node_id == leader))
            else {
                continue;
            };
            let channel = Endpoint::from_shared(format!("http://{}", leader.address))?
                .connect()
                .await?;
            return Ok(Admin {
                client: AdminClient::new(channel)
                    .max_encoding_message_size(portcullis_proto::MAX_MESSAGE_BYTES),
            });
        }
        bail!("no control-plane node named a leader")
    }

    /// Applies `objects`; returns the version and when the call returned.
    async fn apply(&mut self, objects: Vec<serde_json::Value>) -> anyhow::Result<(u64, Instant)> {
        let request = ApplyRequest {
            objects: objects
                .into_iter()
                .map(|object| Object {
                    kind: String::new(),
                    name: String::new(),
                    json: object.to_string().into(),
                })
                .collect(),
            expected_version: None,
        };
        let response = self.client.apply(request).await.context("apply")?;
        Ok((response.into_inner().version, Instant::now()))
    }
}

const API_VERSION: &str = "portcullis.dev/v1alpha1";
const BACKENDS: usize = 100;

fn base_config(args: &FanoutBenchArgs) -> Vec<serde_json::Value> {
    let mut objects: Vec<serde_json::Value> = (0..args.shards)
        .map(|shard| {
            json!({"apiVersion": API_VERSION, "kind": "Listener",
                "metadata": {"name": format!("l{shard}"), "labels": {"shard": format!("s{shard}")}},
                "spec": {"address": "127.0.0.1", "port": 20_000 + shard}})
        })
        .collect();
    objects.extend((0..BACKENDS).map(|backend| {
        json!({"apiVersion": API_VERSION, "kind": "Backend", "metadata": {"name": format!("b{backend}")},
            "spec": {"endpoints": [format!("127.0.0.1:{}", 30_000 + backend)]}})
    }));
    objects.extend((0..args.routes).map(|route| route_object(args, route, 0)));
    objects
}

/// Route `index`, in shard `index % shards`, at revision `revision` (its path changes with it).
fn route_object(args: &FanoutBenchArgs, index: usize, revision: usize) -> serde_json::Value {
    json!({"apiVersion": API_VERSION, "kind": "Route", "metadata": {"name": format!("r{index}")},
        "spec": {"listeners": [format!("l{}", index % args.shards)],
            "matches": [{"path": {"prefix": format!("/svc/{index}/{revision}")}}],
            "backends": [{"name": format!("b{}", index % BACKENDS)}]}})
}

/// Linux's USER_HZ, the unit of /proc/PID/stat's CPU times.
const CLOCK_TICKS_PER_SECOND: f64 = 100.0;

/// utime + stime of each process, in clock ticks (0 for one that cannot be read).
fn cpu_ticks(pids: &[u32]) -> Vec<u64> {
    pids.iter()
        .map(|pid| cpu_of_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default()))
        .collect()
}

/// utime + stime from the text of /proc/PID/stat.
fn cpu_of_stat(stat: &str) -> u64 {
    // Fields after the command name (which may hold spaces and parentheses) start at its
    // last ')'; utime and stime are fields 14 and 15 of the line, so 12th and 13th after it.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let field = |n: usize| {
        fields
            .get(n)
            .and_then(|value| value.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(11) + field(12)
}

/// VmRSS and VmHWM in MiB.
fn memory(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse::<f64>().ok())
            .map_or(0.0, |kib| kib / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

#[cfg(test)]
mod tests {
    use portcullis_proto::v1::ObjectRef;

    use super::*;

    fn object(name: &str, json: &'static str) -> Object {
        Object {
            kind: "Route".into(),
            name: name.into(),
            json: Bytes::from_static(json.as_bytes()),
        }
    }

    #[test]
    fn deltas_apply_only_to_their_base() {
        let mut held = HashMap::new();
        let whole = ConfigSnapshot {
            version: 1,
            objects: vec![object("a", "1"), object("b", "1")],
            base_version: None,
            removed: Vec::new(),
            takes_findings: true,
        };
        apply(&mut held, None, &whole).unwrap();
        let delta = ConfigSnapshot {
            version: 2,
            objects: vec![object("a", "2")],
            base_version: Some(1),
            removed: vec![ObjectRef {
                kind: "Route".into(),
                name: "b".into(),
            }],
            takes_findings: true,
        };
        assert!(apply(&mut held, Some(3), &delta).is_err());
        apply(&mut held, Some(1), &delta).unwrap();
        assert_eq!(held.len(), 1);
        assert_eq!(
            held[&("Route".to_string(), "a".to_string())],
            Bytes::from_static(b"2")
        );
    }

    #[test]
    fn cpu_time_is_read_past_a_command_with_spaces() {
        let stat = "4242 (a (weird) name) S 1 4242 4242 0 -1 4194560 1500 0 0 0 731 269 0 0 20 0 3 0";
        assert_eq!(cpu_of_stat(stat), 731 + 269);
        assert_eq!(cpu_of_stat(""), 0);
    }
}
