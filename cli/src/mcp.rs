//! `portcullis mcp pin`: writes McpToolPins for an McpBackend's servers from the tools they
//! offer now, for the user to review and apply.

use anyhow::Context as _;
use clap::{Args, Subcommand, ValueEnum};
use portcullis_config::{
    tool_digest, KindSpec, McpBackendSpec, McpToolPinsSpec, Metadata, Object, PinEnforcement, PinnedTool,
    TargetRef, MAX_TOOL_LIST_PAGES,
};
use portcullis_loadtest::mcp::{Connection, Endpoint, Era};
use portcullis_proto::v1;
use serde_json::{json, Value};

use crate::admin::Connection as AdminConnection;
use crate::admin_client::Admin;

#[derive(Subcommand)]
pub enum McpCommand {
    /// Print McpToolPins that pin every tool the McpBackend's servers list now (one object
    /// per server), for review before `portcullis apply`. Asks the servers directly, so run
    /// it where they are reachable.
    Pin(PinArgs),
}

#[derive(Args)]
pub struct PinArgs {
    /// The McpBackend.
    pub backend: String,
    /// Only these servers (by default every one).
    #[arg(long = "server")]
    pub servers: Vec<String>,
    /// What proxies do with a tool that no longer matches its pin.
    #[arg(long, value_enum, default_value = "refuse")]
    pub on_drift: OnDrift,
    #[command(flatten)]
    pub connection: AdminConnection,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum OnDrift {
    Refuse,
    Report,
}

pub async fn run(command: McpCommand) -> anyhow::Result<()> {
    match command {
        McpCommand::Pin(args) => pin(args).await,
    }
}

async fn pin(args: PinArgs) -> anyhow::Result<()> {
    let request = v1::GetRequest {
        object: Some(v1::ObjectRef {
            kind: McpBackendSpec::INFO.name.to_string(),
            name: args.backend.clone(),
        }),
        consistency: v1::ReadConsistency::Linearizable.into(),
    };
    let response = Admin::new(&args.connection.controlplane)
        .call(|mut client| {
            let request = request.clone();
            async move { client.get(request).await }
        })
        .await?;
    let wire = response
        .object
        .with_context(|| format!("McpBackend/{} does not exist", args.backend))?;
    let object = Object::from_json_bytes(&wire.json, &format!("McpBackend/{}", args.backend))
        .context("the control plane sent an object this CLI cannot read (version skew?)")?;
    let backend = object
        .spec::<McpBackendSpec>()
        .context("the control plane answered with another kind")?;
    if let Some(unknown) = args.servers.iter().find(|name| backend.server(name).is_none()) {
        anyhow::bail!("McpBackend/{} has no server {unknown:?}", args.backend);
    }
    let mut objects = Vec::new();
    for server in backend
        .servers
        .iter()
        .filter(|server| args.servers.is_empty() || args.servers.contains(&server.name))
    {
        let tools = list_tools(&server.url)
            .await
            .with_context(|| format!("listing the tools of server {} ({})", server.name, server.url))?;
        let spec = McpToolPinsSpec {
            target_refs: vec![TargetRef {
                kind: McpBackendSpec::INFO.name.to_string(),
                name: args.backend.clone(),
                section_name: Some(server.name.clone()),
            }],
            on_drift: match args.on_drift {
                OnDrift::Refuse => PinEnforcement::Refuse,
                OnDrift::Report => PinEnforcement::Report,
            },
            recheck_after: None,
            tools: tools.iter().filter_map(pinned).collect(),
        };
        eprintln!("# server {}: {} tools pinned", server.name, spec.tools.len());
        let metadata = Metadata {
            name: format!("{}-{}", args.backend, server.name),
            labels: Default::default(),
        };
        objects.push(Object::new(metadata, spec).context("the pins written do not validate")?);
    }
    print!("{}", portcullis_config::to_yaml(&objects));
    Ok(())
}

/// A tool as pinned: its digest, and what it pins for the reviewer to read.
fn pinned(tool: &Value) -> Option<PinnedTool> {
    let name = tool.get("name")?.as_str()?;
    let (description, schema) = (tool.get("description"), tool.get("inputSchema"));
    let mut definition = json!({});
    if let Some(description) = description {
        definition["description"] = description.clone();
    }
    if let Some(schema) = schema {
        definition["inputSchema"] = schema.clone();
    }
    Some(PinnedTool {
        name: name.to_string(),
        digest: tool_digest(name, description, schema),
        definition: Some(definition),
    })
}

/// Every tool the server lists, in its session-based era if it has one, else 2026-07-28.
async fn list_tools(url: &str) -> anyhow::Result<Vec<Value>> {
    let endpoint = Endpoint::parse(url)?;
    let mut connection = match Connection::open(&endpoint, Era::Legacy).await {
        Ok(connection) => connection,
        Err(legacy) => Connection::open(&endpoint, Era::Modern)
            .await
            .map_err(|modern| anyhow::anyhow!("session-based: {legacy}; 2026-07-28: {modern}"))?,
    };
    let mut tools = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..MAX_TOOL_LIST_PAGES {
        let params = match &cursor {
            Some(cursor) => json!({"cursor": cursor}),
            None => json!({}),
        };
        let mut page = connection
            .request("tools/list", params)
            .await
            .map_err(|failure| anyhow::anyhow!("tools/list: {failure}"))?;
        if let Some(Value::Array(listed)) = page.get_mut("tools").map(Value::take) {
            tools.extend(listed);
        }
        cursor = page.get("nextCursor").and_then(Value::as_str).map(str::to_string);
        if cursor.is_none() {
            let _ = connection.close().await;
            return Ok(tools);
        }
    }
    anyhow::bail!("more than {MAX_TOOL_LIST_PAGES} pages of tools: proxies could not check them against pins")
}
