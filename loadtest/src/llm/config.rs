//! The `portcullis loadtest -f FILE` configuration: inference-perf's shape (reference §5.1)
//! trimmed to what this generator does, with several targets compared in one run.
//!
//! Parsing goes YAML → `serde_json::Value` → typed structs through `serde_path_to_error`, as in
//! `portcullis-config`, so every error names the field that caused it (`load.stages[1].rate`).

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{anyhow, ensure};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};

/// Upper bound on one request when `request_timeout` is not set: long enough for a saturated
/// round-robin fleet (the published E2E mean at 60 QPS was ~105 s).
const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadtestConfig {
    pub api: ApiConfig,
    pub model: String,
    /// Every target runs the same stages in turn, on identical prompts and arrival times.
    pub targets: Vec<Target>,
    pub data: DataConfig,
    pub load: LoadConfig,
    #[serde(
        default = "default_request_timeout",
        deserialize_with = "duration",
        serialize_with = "duration_secs"
    )]
    pub request_timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiConfig {
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Target {
    pub name: String,
    /// Base URL (`http://host:port`, optionally with a path prefix); `/v1/...` is appended.
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
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageConfig {
    /// Offered requests per second.
    pub rate: f64,
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
        ensure!(!self.model.is_empty(), "model: must not be empty");
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
                "targets[{i}].url: expected http://host:port[/prefix], got {:?}",
                t.url
            );
        }
        self.data.validate()?;
        let load = &self.load;
        ensure!(
            !load.stages.is_empty(),
            "load.stages: at least one stage is needed"
        );
        for (i, s) in load.stages.iter().enumerate() {
            ensure!(
                s.rate.is_finite() && s.rate >= 0.0,
                "load.stages[{i}].rate: must be finite and >= 0, got {}",
                s.rate
            );
            ensure!(
                !s.duration.is_zero(),
                "load.stages[{i}].duration: must be positive"
            );
        }
        ensure!(
            load.max_concurrency != Some(0),
            "load.max_concurrency: must be positive"
        );
        ensure!(
            !self.request_timeout.is_zero(),
            "request_timeout: must be positive"
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
        // The outer path ends at `data`; the inner path is put in the message instead.
        fn inner<T: serde::de::DeserializeOwned, E: serde::de::Error>(
            value: serde_json::Value,
        ) -> Result<T, E> {
            serde_path_to_error::deserialize(value).map_err(|e| {
                let path = e.path().to_string();
                E::custom(format!("{path}: {}", e.into_inner()))
            })
        }
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
mod tests {
    use super::*;

    const SMOKE: &str = r#"
api: {type: chat, streaming: true}
model: m1
targets:
  - {name: direct, url: "http://127.0.0.1:8000"}
  - {name: gateway, url: "http://127.0.0.1:8080/prefix"}
data: {type: shared_prefix, num_groups: 2, num_prompts_per_group: 3, system_prompt_len: 10, question_len: 5, output_len: 4}
load:
  type: poisson
  stages: [{rate: 2, duration: 3}, {rate: 4.5, duration: "1m"}]
  max_concurrency: 8
  seed: 7
request_timeout: 30s
"#;

    fn error(text: &str) -> String {
        match LoadtestConfig::parse(text) {
            Ok(c) => panic!("expected an error, parsed {c:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn parses_a_full_config() -> anyhow::Result<()> {
        let c = LoadtestConfig::parse(SMOKE)?;
        assert_eq!(
            c.api,
            ApiConfig {
                kind: ApiKind::Chat,
                streaming: true
            }
        );
        assert_eq!(c.targets.len(), 2);
        assert_eq!(c.load.stages[1].duration, Duration::from_secs(60));
        assert_eq!(c.load.stages[1].rate, 4.5);
        assert_eq!(c.load.max_concurrency, Some(8));
        assert_eq!(c.request_timeout, Duration::from_secs(30));
        assert!(matches!(
            c.data,
            DataConfig::SharedPrefix(SharedPrefix { num_groups: 2, .. })
        ));
        Ok(())
    }

    #[test]
    fn errors_name_the_field() {
        let e = error(&SMOKE.replace("rate: 2,", "rate: fast,"));
        assert!(e.starts_with("load.stages[0].rate:"), "{e}");
        let e = error(&SMOKE.replace("num_groups: 2", "num_groups: -2"));
        assert!(e.starts_with("data: num_groups:"), "{e}");
        let e = error(&SMOKE.replace("seed: 7", "seed: 7\n  sede: 1"));
        assert!(e.contains("load") && e.contains("sede"), "{e}");
        let e = error(&SMOKE.replace("type: shared_prefix", "type: sharde"));
        assert!(e.starts_with("data:") && e.contains("sharde"), "{e}");
        let e = error(&SMOKE.replace("duration: 3", "duration: soon"));
        assert!(e.starts_with("load.stages[0].duration:"), "{e}");
        let e = error(&SMOKE.replace("http://127.0.0.1:8080/prefix", "https://x"));
        assert!(e.starts_with("targets[1].url:"), "{e}");
        let e = error(&SMOKE.replace("name: gateway", "name: direct"));
        assert!(e.starts_with("targets[1].name:"), "{e}");
        let e = error(&SMOKE.replace("rate: 4.5", "rate: -1"));
        assert!(e.starts_with("load.stages[1].rate:"), "{e}");
        let e = error(&SMOKE.replace("max_concurrency: 8", "max_concurrency: 0"));
        assert!(e.starts_with("load.max_concurrency:"), "{e}");
        let e = error(&SMOKE.replace("type: chat", "type: chatt"));
        assert!(e.starts_with("api.type:"), "{e}");
    }

    #[test]
    fn shipped_scenarios_parse() -> anyhow::Result<()> {
        LoadtestConfig::parse(include_str!("../../scenarios/llm-smoke.yaml"))?;
        let llm_d = LoadtestConfig::parse(include_str!("../../scenarios/llm-d-shared-prefix.yaml"))?;
        assert_eq!(llm_d.load.stages.len(), 17);
        assert_eq!(llm_d.load.stages.last().map(|s| s.rate), Some(60.0));
        assert!(matches!(
            llm_d.data,
            DataConfig::SharedPrefix(SharedPrefix {
                num_groups: 150,
                num_prompts_per_group: 5,
                system_prompt_len: 6000,
                question_len: 1200,
                output_len: 1000
            })
        ));
        Ok(())
    }

    #[test]
    fn synthetic_lengths_are_checked() {
        let data =
            "data: {type: synthetic, input_len: {min: 10, max: 20, mean: 30}, output_len: {min: 1, max: 2}}";
        let text = SMOKE
            .lines()
            .map(|l| if l.starts_with("data:") { data } else { l })
            .collect::<Vec<_>>()
            .join("\n");
        let e = error(&text);
        assert!(e.starts_with("data.input_len.mean:"), "{e}");
        let ok = text.replace("mean: 30", "mean: 12");
        assert!(LoadtestConfig::parse(&ok).is_ok());
    }
}
