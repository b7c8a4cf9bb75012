//! The `portcullis loadtest -f FILE` configuration: inference-perf's shape
//! (kubernetes-sigs/inference-perf, `docs/config.md`)
//! trimmed to what this generator does, with several targets compared in one run.
//!
//! Parsing goes YAML → `serde_json::Value` → typed structs through `serde_path_to_error`, as in
//! `portcullis-config`, so every error names the field that caused it (`load.stages[1].rate`).

use std::collections::HashSet;
use std::time::Duration;

use crate::sim::workload::check_stage;
use anyhow::{anyhow, bail, ensure};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};

pub use crate::mcp::Era;

/// Upper bound on one request when `request_timeout` is not set: long enough for a saturated
/// round-robin fleet (the published E2E mean at 60 QPS was ~105 s).
const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadtestConfig {
    pub api: ApiConfig,
    /// LLM only: the `model` of every request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Every target runs the same stages in turn, on identical prompts and arrival times.
    pub targets: Vec<Target>,
    /// LLM only: what the prompts look like (MCP calls carry fixed, tiny arguments).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<DataConfig>,
    pub load: LoadConfig,
    #[serde(
        default = "default_request_timeout",
        deserialize_with = "duration",
        serialize_with = "duration_secs"
    )]
    pub request_timeout: Duration,
}

/// What is sent: OpenAI-compatible LLM requests or MCP calls. Deserialized by hand (like
/// [`DataConfig`]) so that `type` picks the variant and errors still name the inner field.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ApiConfig {
    Llm(LlmApi),
    Mcp(McpApi),
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmApi {
    #[serde(rename = "type")]
    pub kind: ApiKind,
    #[serde(default = "yes")]
    pub streaming: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiKind {
    /// `POST /v1/completions` with a `prompt` string.
    Completion,
    /// `POST /v1/chat/completions` with the prompt as one user message.
    Chat,
}

/// `api: {type: mcp, ...}`: MCP over Streamable HTTP against the test server or a gateway.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpApi {
    /// Required: the two eras cost very differently (sessions vs stateless), so no default.
    pub era: Era,
    #[serde(default)]
    pub operation: McpOperation,
    /// `tools_call` only; `echo` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<McpTool>,
    #[serde(default)]
    pub connection: ConnectionMode,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum McpOperation {
    #[default]
    ToolsCall,
    ToolsList,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum McpTool {
    /// `echo {message}`, checking the message comes back.
    #[default]
    #[serde(rename = "echo")]
    Echo,
    /// `get-sum {a, b}`, checking a + b.
    #[serde(rename = "get-sum")]
    GetSum,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnectionMode {
    /// Idle connections (and legacy sessions) are pooled and reused, like an HTTP client.
    #[default]
    Reuse,
    /// A new TCP connection (and legacy session, closed by DELETE) per call; latency then
    /// covers connect, `initialize`, the call and the DELETE.
    PerCall,
}

impl McpApi {
    /// The tool `tools/call` invokes; `None` for `tools/list`.
    pub fn tool(&self) -> Option<McpTool> {
        match self.operation {
            McpOperation::ToolsCall => Some(self.tool.unwrap_or_default()),
            McpOperation::ToolsList => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Target {
    pub name: String,
    /// LLM: base URL (`http://host:port`, optionally with a path prefix; `/v1/...` is
    /// appended). MCP: the endpoint itself (`http://host:port/mcp`).
    pub url: String,
}

/// What the prompts look like. Deserialized by hand (see the `Deserialize` impl) because an
/// internally tagged serde enum would hide the path of a bad field inside it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum DataConfig {
    SharedPrefix(SharedPrefix),
    Synthetic(Synthetic),
    Fixed(Fixed),
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedPrefix {
    pub num_groups: usize,
    pub num_prompts_per_group: usize,
    pub system_prompt_len: usize,
    pub question_len: usize,
    pub output_len: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Synthetic {
    pub input_len: LengthDist,
    pub output_len: LengthDist,
}

/// Lengths drawn from `[min, max]` with the given mean (default: the midpoint, i.e. uniform).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LengthDist {
    #[serde(default)]
    pub mean: Option<f64>,
    pub min: usize,
    pub max: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fixed {
    pub input_len: usize,
    pub output_len: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadConfig {
    #[serde(rename = "type")]
    pub kind: LoadKind,
    pub stages: Vec<StageConfig>,
    /// Most requests in flight per target; later arrivals wait in the client and the wait is
    /// reported as schedule delay. Absent = open loop.
    #[serde(default)]
    pub max_concurrency: Option<usize>,
    #[serde(default)]
    pub seed: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadKind {
    /// Exponential gaps (seeded), as inference-perf's `poisson`.
    Poisson,
    /// Evenly spaced sends.
    Constant,
    /// `clients` concurrent clients, each sending its next request when the previous one is
    /// answered: measures capacity rather than behaviour at a given rate.
    ClosedLoop,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageConfig {
    /// Open loop (`poisson`, `constant`): offered requests per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<f64>,
    /// Closed loop: how many clients.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clients: Option<usize>,
    /// Seconds (`30`) or a humantime string (`"30s"`, `"2m"`).
    #[serde(deserialize_with = "duration", serialize_with = "duration_secs")]
    pub duration: Duration,
}

impl LoadtestConfig {
    /// Parses and validates a YAML (or JSON) config; errors start with the offending field.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let value: serde_json::Value =
            serde_saphyr::from_str(text).map_err(|e| anyhow!("malformed YAML: {e}"))?;
        let config: Self = serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            anyhow!("{path}: {}", e.into_inner())
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what the types cannot express; `parse` calls it, programmatic callers should.
    pub fn validate(&self) -> anyhow::Result<()> {
        match (&self.api, &self.model, &self.data) {
            (ApiConfig::Llm(_), None, _) => bail!("model: required for LLM apis"),
            (ApiConfig::Llm(_), _, None) => bail!("data: required for LLM apis"),
            (ApiConfig::Llm(_), Some(model), Some(data)) => {
                ensure!(!model.is_empty(), "model: must not be empty");
                data.validate()?;
            }
            (ApiConfig::Mcp(_), Some(_), _) => bail!("model: not used by api type mcp; remove it"),
            (ApiConfig::Mcp(_), _, Some(_)) => bail!("data: not used by api type mcp; remove it"),
            (ApiConfig::Mcp(mcp), None, None) => ensure!(
                mcp.operation == McpOperation::ToolsCall || mcp.tool.is_none(),
                "api.tool: only for operation tools_call"
            ),
        }
        ensure!(!self.targets.is_empty(), "targets: at least one target is needed");
        let mut names = HashSet::new();
        for (i, t) in self.targets.iter().enumerate() {
            ensure!(!t.name.is_empty(), "targets[{i}].name: must not be empty");
            ensure!(
                names.insert(&t.name),
                "targets[{i}].name: duplicate name {:?}",
                t.name
            );
            let uri: http::Uri = t.url.parse().map_err(|e| anyhow!("targets[{i}].url: {e}"))?;
            // Plain HTTP only: the generator carries no TLS stack, and benchmark runs target
            // gateways and simulators on a private network.
            ensure!(
                uri.scheme_str() == Some("http") && uri.authority().is_some(),
                "targets[{i}].url: expected http://host:port[/path], got {:?}",
                t.url
            );
        }
        self.load.validate()?;
        ensure!(
            !self.request_timeout.is_zero(),
            "request_timeout: must be positive"
        );
        Ok(())
    }
}

impl LoadConfig {
    fn validate(&self) -> anyhow::Result<()> {
        ensure!(
            !self.stages.is_empty(),
            "load.stages: at least one stage is needed"
        );
        let closed = self.kind == LoadKind::ClosedLoop;
        for (i, s) in self.stages.iter().enumerate() {
            if closed {
                ensure!(
                    s.rate.is_none(),
                    "load.stages[{i}].rate: closed_loop stages take clients, not a rate"
                );
                ensure!(
                    s.clients.is_some_and(|n| n > 0),
                    "load.stages[{i}].clients: closed_loop stages need clients >= 1"
                );
            } else {
                ensure!(
                    s.clients.is_none(),
                    "load.stages[{i}].clients: only for load type closed_loop"
                );
                ensure!(
                    s.rate.is_some(),
                    "load.stages[{i}].rate: required for open-loop load types"
                );
            }
            check_stage(s.rate.unwrap_or(0.0), s.duration.as_secs_f64())
                .map_err(|(field, problem)| anyhow!("load.stages[{i}].{field}: {problem}"))?;
        }
        ensure!(
            self.max_concurrency != Some(0),
            "load.max_concurrency: must be positive"
        );
        // The clients already bound concurrency; a second cap would only confuse the report.
        ensure!(
            !(closed && self.max_concurrency.is_some()),
            "load.max_concurrency: not used by closed_loop (clients bound concurrency)"
        );
        Ok(())
    }
}

impl DataConfig {
    fn validate(&self) -> anyhow::Result<()> {
        match self {
            Self::SharedPrefix(s) => {
                ensure!(s.num_groups > 0, "data.num_groups: must be positive");
                ensure!(
                    s.num_prompts_per_group > 0,
                    "data.num_prompts_per_group: must be positive"
                );
                ensure!(
                    s.system_prompt_len + s.question_len > 0,
                    "data.system_prompt_len: prompts would be empty"
                );
                ensure!(s.output_len > 0, "data.output_len: must be positive");
            }
            Self::Synthetic(s) => {
                s.input_len.validate("data.input_len")?;
                s.output_len.validate("data.output_len")?;
            }
            Self::Fixed(f) => {
                ensure!(f.input_len > 0, "data.input_len: must be positive");
                ensure!(f.output_len > 0, "data.output_len: must be positive");
            }
        }
        Ok(())
    }
}

impl LengthDist {
    fn validate(&self, field: &str) -> anyhow::Result<()> {
        ensure!(
            0 < self.min && self.min <= self.max,
            "{field}: needs 0 < min <= max, got min {} max {}",
            self.min,
            self.max
        );
        if let Some(mean) = self.mean {
            ensure!(
                (self.min as f64..=self.max as f64).contains(&mean),
                "{field}.mean: must lie in [min, max], got {mean}"
            );
        }
        Ok(())
    }
}

impl<'de> Deserialize<'de> for DataConfig {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut map = serde_json::Map::deserialize(deserializer)?;
        let kind = match map.remove("type") {
            Some(serde_json::Value::String(kind)) => kind,
            Some(other) => return Err(D::Error::custom(format!("type: expected a string, got {other}"))),
            None => return Err(D::Error::missing_field("type")),
        };
        let rest = serde_json::Value::Object(map);
        match kind.as_str() {
            "shared_prefix" => inner(rest).map(Self::SharedPrefix),
            "synthetic" => inner(rest).map(Self::Synthetic),
            "fixed" => inner(rest).map(Self::Fixed),
            other => Err(D::Error::unknown_variant(
                other,
                &["shared_prefix", "synthetic", "fixed"],
            )),
        }
    }
}

impl<'de> Deserialize<'de> for ApiConfig {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut map = serde_json::Map::deserialize(deserializer)?;
        let kind = match map.get("type") {
            Some(serde_json::Value::String(kind)) => kind.clone(),
            Some(other) => return Err(D::Error::custom(format!("type: expected a string, got {other}"))),
            None => return Err(D::Error::missing_field("type")),
        };
        match kind.as_str() {
            // `LlmApi` keeps `type` as its `kind` field.
            "completion" | "chat" => inner(serde_json::Value::Object(map)).map(Self::Llm),
            "mcp" => {
                map.remove("type");
                inner(serde_json::Value::Object(map)).map(Self::Mcp)
            }
            other => Err(D::Error::custom(format!(
                "type: unknown variant `{other}`, expected one of `completion`, `chat`, `mcp`"
            ))),
        }
    }
}

impl Serialize for ApiConfig {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Tagged<'a> {
            #[serde(rename = "type")]
            kind: &'static str,
            #[serde(flatten)]
            api: &'a McpApi,
        }
        match self {
            Self::Llm(api) => api.serialize(serializer),
            Self::Mcp(api) => Tagged { kind: "mcp", api }.serialize(serializer),
        }
    }
}

/// Deserializes a hand-dispatched variant. The outer path ends at the field (`data`, `api`);
/// the inner path is put in the message instead.
fn inner<T: serde::de::DeserializeOwned, E: serde::de::Error>(value: serde_json::Value) -> Result<T, E> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        E::custom(format!("{path}: {}", e.into_inner()))
    })
}

fn yes() -> bool {
    true
}

fn default_request_timeout() -> Duration {
    DEFAULT_REQUEST_TIMEOUT
}

fn duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    match serde_json::Value::deserialize(deserializer)? {
        serde_json::Value::Number(n) => n
            .as_f64()
            .and_then(|secs| Duration::try_from_secs_f64(secs).ok())
            .ok_or_else(|| D::Error::custom(format!("invalid duration {n}"))),
        serde_json::Value::String(text) => humantime::parse_duration(&text)
            .map_err(|e| D::Error::custom(format!("invalid duration {text:?}: {e}"))),
        other => Err(D::Error::custom(format!(
            "expected seconds or a duration like \"30s\", got {other}"
        ))),
    }
}

fn duration_secs<S: serde::Serializer>(d: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_f64(d.as_secs_f64())
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
