//! The admin commands: apply, validate, get, delete, status, cluster.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use portcullis_config::{Kind, Object};
use portcullis_proto::v1;

use crate::admin_client::Admin;

#[derive(Args)]
pub struct Connection {
    /// Admin API address of any control-plane node.
    #[arg(long, env = "PORTCULLIS_CONTROLPLANE", default_value = "127.0.0.1:7070")]
    pub controlplane: String,
}

#[derive(Args)]
pub struct ApplyArgs {
    /// YAML (documents separated by `---`) or JSON file; `-` reads standard input.
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Apply only if the config is still at this version (optimistic concurrency).
    #[arg(long)]
    pub expected_version: Option<u64>,
    #[command(flatten)]
    pub connection: Connection,
}

#[derive(Args)]
pub struct ValidateArgs {
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
    /// Check the file as a whole config with this binary's rules, without a control plane:
    /// before an upgrade, run the new binary on the config exported with `get all`.
    #[arg(long)]
    pub local: bool,
    #[command(flatten)]
    pub connection: Connection,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum Format {
    Yaml,
    Json,
}

#[derive(Args)]
pub struct GetArgs {
    /// A kind (Route, McpBackend, McpToolPins, …); any case, singular, plural or short name
    /// (rt, be, mcp, pins, …); or `all`, every object of every kind.
    pub kind: String,
    /// Omit to list every object of the kind.
    pub name: Option<String>,
    #[arg(short = 'o', long, value_enum, default_value = "yaml")]
    pub output: Format,
    /// Answer from the node asked, even a follower or a node without quorum; by default the
    /// read is linearizable (served by the leader once a quorum confirms it still leads).
    #[arg(long)]
    pub local: bool,
    #[command(flatten)]
    pub connection: Connection,
}

#[derive(Args)]
pub struct DeleteArgs {
    /// A kind, written as for `get`.
    pub kind: String,
    pub name: String,
    #[arg(long)]
    pub expected_version: Option<u64>,
    #[command(flatten)]
    pub connection: Connection,
}

/// Changing the control plane's membership; every change goes through the leader.
#[derive(Subcommand)]
pub enum ClusterCommand {
    /// Show the members, their roles and the leader.
    Status {
        #[arg(short = 'o', long, value_enum)]
        output: Option<Format>,
        #[command(flatten)]
        connection: Connection,
    },
    /// Add a node started with `--join`: it joins as a learner, catches up, then votes. For a
    /// member restarted elsewhere on its data directory: move it to its new address.
    Add {
        /// The new node's `--node-id`.
        #[arg(long)]
        node_id: u64,
        /// Where the other nodes reach it (its `--advertise`, or `--listen`).
        #[arg(long)]
        address: String,
        #[command(flatten)]
        connection: Connection,
    },
    /// Remove a node (voter or learner).
    Remove {
        /// The node's `--node-id`.
        #[arg(long)]
        node_id: u64,
        #[command(flatten)]
        connection: Connection,
    },
}

pub async fn cluster(command: ClusterCommand) -> anyhow::Result<()> {
    let (response, output) = match command {
        ClusterCommand::Status { output, connection } => {
            let response = Admin::new(&connection.controlplane)
                .call(|mut client| async move { client.status(v1::StatusRequest::default()).await })
                .await?;
            (response, output)
        }
        ClusterCommand::Add {
            node_id,
            address,
            connection,
        } => {
            let response = Admin::new(&connection.controlplane)
                .call(|mut client| {
                    let request = v1::AddNodeRequest {
                        node_id,
                        address: address.clone(),
                    };
                    async move { client.add_node(request).await }
                })
                .await?;
            (response, None)
        }
        ClusterCommand::Remove { node_id, connection } => {
            let response = Admin::new(&connection.controlplane)
                .call(|mut client| async move { client.remove_node(v1::RemoveNodeRequest { node_id }).await })
                .await?;
            (response, None)
        }
    };
    match output {
        Some(Format::Json) => println!(
            "{}",
            serde_json::to_string_pretty(&status_json(&response)["cluster"])?
        ),
        Some(Format::Yaml) => print!("{}", serde_saphyr::to_string(&status_json(&response)["cluster"])?),
        None => print!("{}", cluster_table(&response)),
    }
    Ok(())
}

#[derive(Args)]
pub struct StatusArgs {
    #[arg(short = 'o', long, value_enum)]
    pub output: Option<Format>,
    #[command(flatten)]
    pub connection: Connection,
}

/// Reads and validates a file locally first, so a typo is reported with its document
/// number before anything is sent.
pub fn read_objects(path: &PathBuf) -> anyhow::Result<Vec<v1::Object>> {
    let text = if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading standard input")?
    } else {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
    };
    let objects = portcullis_config::parse_documents(&text)
        .map_err(|error| anyhow::anyhow!("{}: {error}", path.display()))?;
    Ok(objects.iter().map(to_wire).collect())
}

fn to_wire(object: &Object) -> v1::Object {
    v1::Object {
        kind: object.kind().to_string(),
        name: object.name().to_string(),
        json: object.to_json_bytes().into(),
    }
}

pub async fn apply(args: ApplyArgs) -> anyhow::Result<()> {
    let objects = read_objects(&args.file)?;
    let response = apply_objects(
        &Admin::new(&args.connection.controlplane),
        objects,
        args.expected_version,
    )
    .await?;
    print_changes(&response);
    Ok(())
}

pub async fn apply_objects(
    admin: &Admin,
    objects: Vec<v1::Object>,
    expected_version: Option<u64>,
) -> anyhow::Result<v1::ApplyResponse> {
    let request = v1::ApplyRequest {
        objects,
        expected_version,
    };
    admin
        .call(|mut client| {
            let request = request.clone();
            async move { client.apply(request).await }
        })
        .await
}

pub fn print_changes(response: &v1::ApplyResponse) {
    for change in &response.changes {
        if let Some(object) = &change.object {
            println!("{}/{} {}", object.kind, object.name, change.action);
        }
    }
    println!("config version {}", response.version);
}

pub async fn validate(args: ValidateArgs) -> anyhow::Result<()> {
    if args.local {
        let objects = read_objects(&args.file)?
            .iter()
            .enumerate()
            .map(|(index, wire)| Object::from_json_bytes(&wire.json, &format!("object {}", index + 1)))
            .collect::<Result<Vec<_>, _>>()?;
        let count = objects.len();
        portcullis_config::ConfigSet::from_objects(objects)
            .map_err(|error| anyhow::anyhow!("{}: {error}", args.file.display()))?;
        println!("valid as a whole config of {count} objects, by the rules of this build");
        return Ok(());
    }
    let request = v1::ApplyRequest {
        objects: read_objects(&args.file)?,
        expected_version: None,
    };
    let response = Admin::new(&args.connection.controlplane)
        .call(|mut client| {
            let request = request.clone();
            async move { client.validate(request).await }
        })
        .await?;
    for change in &response.changes {
        if let Some(object) = &change.object {
            println!("{}/{} would be {}", object.kind, object.name, change.action);
        }
    }
    println!("valid against config version {}", response.version);
    Ok(())
}

fn parse_kind(text: &str) -> anyhow::Result<Kind> {
    text.parse().map_err(anyhow::Error::msg)
}

pub async fn get(args: GetArgs) -> anyhow::Result<()> {
    let kind = match args.kind.eq_ignore_ascii_case("all") {
        true => None,
        false => Some(parse_kind(&args.kind)?),
    };
    let admin = Admin::new(&args.connection.controlplane);
    let consistency = match args.local {
        true => v1::ReadConsistency::Local,
        false => v1::ReadConsistency::Linearizable,
    };
    let (wire, version, served) = match (&args.name, kind) {
        (Some(_), None) => anyhow::bail!("`all` lists objects: name a kind to get one by name"),
        (Some(name), Some(kind)) => {
            let request = v1::GetRequest {
                object: Some(v1::ObjectRef {
                    kind: kind.to_string(),
                    name: name.clone(),
                }),
                consistency: consistency.into(),
            };
            let response = admin
                .call(|mut client| {
                    let request = request.clone();
                    async move { client.get(request).await }
                })
                .await?;
            let served = response.served();
            (
                response.object.into_iter().collect::<Vec<_>>(),
                response.version,
                served,
            )
        }
        (None, kind) => {
            let request = v1::ListRequest {
                kind: kind.map(|kind| kind.to_string()).unwrap_or_default(),
                consistency: consistency.into(),
            };
            let response = admin
                .call(|mut client| {
                    let request = request.clone();
                    async move { client.list(request).await }
                })
                .await?;
            let served = response.served();
            (response.objects, response.version, served)
        }
    };
    // On stderr, so the objects on stdout stay valid YAML or JSON.
    let served = match served {
        v1::ReadConsistency::Linearizable => "linearizable read",
        v1::ReadConsistency::Local => "local read (may trail the leader)",
    };
    eprintln!("# {served} at config version {version}");
    let objects = wire
        .iter()
        .map(|object| Object::from_json_bytes(&object.json, &format!("{}/{}", object.kind, object.name)))
        .collect::<Result<Vec<_>, _>>()
        .context("the control plane sent an object this CLI cannot read (version skew?)")?;
    match args.output {
        Format::Yaml => print!("{}", portcullis_config::to_yaml(&objects)),
        Format::Json => {
            let values: Vec<serde_json::Value> = objects.iter().map(Object::to_json).collect();
            println!("{}", serde_json::to_string_pretty(&values)?);
        }
    }
    Ok(())
}

pub async fn delete(args: DeleteArgs) -> anyhow::Result<()> {
    let kind = parse_kind(&args.kind)?;
    let request = v1::DeleteRequest {
        objects: vec![v1::ObjectRef {
            kind: kind.to_string(),
            name: args.name.clone(),
        }],
        expected_version: args.expected_version,
    };
    let response = Admin::new(&args.connection.controlplane)
        .call(|mut client| {
            let request = request.clone();
            async move { client.delete(request).await }
        })
        .await?;
    print_changes(&response);
    Ok(())
}

pub async fn status(args: StatusArgs) -> anyhow::Result<()> {
    let response = Admin::new(&args.connection.controlplane)
        .call(|mut client| async move { client.status(v1::StatusRequest::default()).await })
        .await?;
    match args.output {
        Some(Format::Json) => println!("{}", serde_json::to_string_pretty(&status_json(&response))?),
        Some(Format::Yaml) => print!("{}", serde_saphyr::to_string(&status_json(&response))?),
        None => print!("{}", status_table(&response)),
    }
    Ok(())
}

fn shard_text(shard: &std::collections::HashMap<String, String>) -> String {
    if shard.is_empty() {
        return "*".to_string();
    }
    let mut pairs: Vec<String> = shard
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect();
    pairs.sort();
    pairs.join(",")
}

fn status_table(status: &v1::StatusResponse) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(out, "config version {}", status.version);
    out.push_str(&cluster_table(status));
    if !status.unreachable_nodes.is_empty() {
        let nodes: Vec<String> = status.unreachable_nodes.iter().map(u64::to_string).collect();
        let _ = writeln!(
            out,
            "nodes {} did not answer: their proxies are not listed",
            nodes.join(", ")
        );
    }
    let _ = writeln!(
        out,
        "{:<24} {:<16} {:>8} {:>6} {:<12} {:>4} LAST ERROR",
        "PROXY", "SHARD", "APPLIED", "SENT", "STATE", "NODE"
    );
    for proxy in &status.proxies {
        let state = proxy_state(proxy);
        let _ = writeln!(
            out,
            "{:<24} {:<16} {:>8} {:>6} {:<12} {:>4} {}",
            proxy.proxy_id,
            shard_text(&proxy.shard),
            proxy.applied_version,
            proxy.sent_version,
            state,
            proxy.node_id,
            proxy.last_error
        );
    }
    out.push_str(&drift_table(status));
    out
}

/// Tools that are not their pinned selves (McpToolPins), each with the proxies that saw it so.
fn drift_table(status: &v1::StatusResponse) -> String {
    use std::fmt::Write as _;
    // Keyed by backend, server, tool, state, and refused or reported (proxies on two config
    // versions may differ); the digests are the first proxy's.
    type Row<'a> = (&'a v1::ToolDrift, Vec<&'a str>);
    let mut seen: std::collections::BTreeMap<([&str; 4], bool), Row<'_>> = Default::default();
    let not_shown: u32 = status
        .proxies
        .iter()
        .map(|proxy| proxy.tool_drift_not_shown)
        .sum();
    for proxy in &status.proxies {
        for drift in &proxy.tool_drift {
            seen.entry((
                [&drift.mcp_backend, &drift.server, &drift.tool, &drift.state],
                drift.refused,
            ))
            .or_insert_with(|| (drift, Vec::new()))
            .1
            .push(&proxy.proxy_id);
        }
    }
    let mut out = String::new();
    if seen.is_empty() {
        return out;
    }
    let _ = writeln!(out, "\ntools that do not match their McpToolPins:");
    let _ = writeln!(
        out,
        "{:<16} {:<12} {:<24} {:<9} {:<8} {:<21} {:<21} PROXIES",
        "MCPBACKEND", "SERVER", "TOOL", "STATE", "ON DRIFT", "PINNED", "NOW"
    );
    let short = |digest: &str| match digest.get(..19) {
        Some(prefix) if digest.len() > 19 => format!("{prefix}…"),
        _ if digest.is_empty() => "-".to_string(),
        _ => digest.to_string(),
    };
    for (drift, proxies) in seen.values() {
        let _ = writeln!(
            out,
            "{:<16} {:<12} {:<24} {:<9} {:<8} {:<21} {:<21} {}",
            drift.mcp_backend,
            drift.server,
            drift.tool,
            drift.state,
            if drift.refused { "refused" } else { "reported" },
            short(&drift.pinned_digest),
            short(&drift.live_digest),
            proxies.join(",")
        );
    }
    if not_shown > 0 {
        let _ = writeln!(out, "… and {not_shown} more findings not shown");
    }
    out
}

/// The members as `node ID ADDRESS ROLE`, after a line naming the node asked and the leader.
fn cluster_table(status: &v1::StatusResponse) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    if let Some(cluster) = &status.cluster {
        let leader = cluster.leader_id.map_or("none".to_string(), |id| id.to_string());
        let _ = writeln!(
            out,
            "control plane: node {} (leader {leader}, term {})",
            cluster.node_id, cluster.term
        );
        for member in &cluster.members {
            let role = if member.voter { "voter" } else { "learner" };
            let _ = writeln!(out, "  node {} {} {role}", member.node_id, member.address);
        }
    }
    out
}

/// `pending`: sent a version it has not acknowledged yet.
fn proxy_state(proxy: &v1::ProxyStatus) -> &'static str {
    match (proxy.connected, proxy.healthy) {
        (false, _) => "disconnected",
        (true, false) => "rejecting",
        (true, true) if proxy.applied_version < proxy.sent_version => "pending",
        (true, true) => "healthy",
    }
}

fn status_json(status: &v1::StatusResponse) -> serde_json::Value {
    let cluster = status.cluster.as_ref().map(|cluster| {
        serde_json::json!({
            "nodeId": cluster.node_id, "leaderId": cluster.leader_id, "term": cluster.term,
            "members": cluster.members.iter().map(|m| serde_json::json!({"nodeId": m.node_id, "address": m.address, "voter": m.voter})).collect::<Vec<_>>(),
        })
    });
    let proxies: Vec<serde_json::Value> = status
        .proxies
        .iter()
        .map(|proxy| {
            serde_json::json!({
                "proxyId": proxy.proxy_id, "shard": proxy.shard, "appliedVersion": proxy.applied_version,
                "sentVersion": proxy.sent_version, "healthy": proxy.healthy, "connected": proxy.connected,
                "lastError": proxy.last_error, "lastSeenUnixMs": proxy.last_seen_unix_ms,
                "state": proxy_state(proxy), "nodeId": proxy.node_id,
                "toolDrift": proxy.tool_drift.iter().map(|drift| serde_json::json!({
                    "mcpBackend": drift.mcp_backend, "server": drift.server, "tool": drift.tool,
                    "pins": drift.pins, "state": drift.state, "pinnedDigest": drift.pinned_digest,
                    "liveDigest": drift.live_digest, "refused": drift.refused,
                })).collect::<Vec<_>>(),
                "toolDriftNotShown": proxy.tool_drift_not_shown,
            })
        })
        .collect();
    serde_json::json!({
        "version": status.version, "cluster": cluster, "proxies": proxies,
        "unreachableNodes": status.unreachable_nodes,
    })
}
