//! Parsing and validation of `portcullis loadtest` configs, LLM and MCP, and of every
//! shipped scenario.

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
        ApiConfig::Llm(LlmApi {
            kind: ApiKind::Chat,
            streaming: true
        })
    );
    assert_eq!(c.targets.len(), 2);
    assert_eq!(c.load.stages[1].duration, Duration::from_secs(60));
    assert_eq!(c.load.stages[1].rate, Some(4.5));
    assert_eq!(c.load.max_concurrency, Some(8));
    assert_eq!(c.request_timeout, Duration::from_secs(30));
    assert!(matches!(
        c.data,
        Some(DataConfig::SharedPrefix(SharedPrefix { num_groups: 2, .. }))
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
    assert!(e.starts_with("api: type:") && e.contains("chatt"), "{e}");
    let e = error(&SMOKE.replace("model: m1\n", ""));
    assert!(e.starts_with("model:"), "{e}");
    let e = error(&SMOKE.replace("rate: 2,", "clients: 2,"));
    assert!(e.starts_with("load.stages[0].clients:"), "{e}");
}

/// Every file in `loadtest/scenarios/` must parse, so shipped examples cannot rot.
#[test]
fn shipped_scenarios_parse() -> anyhow::Result<()> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let mut parsed = Vec::new();
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        let text = std::fs::read_to_string(&path)?;
        let config = LoadtestConfig::parse(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        parsed.push((path, config));
    }
    let find = |name: &str| {
        parsed
            .iter()
            .find(|(p, _)| p.ends_with(name))
            .map(|(_, c)| c)
            .ok_or_else(|| anyhow!("scenarios/{name} is missing"))
    };
    let llm_d = find("llm-d-shared-prefix.yaml")?;
    assert_eq!(llm_d.load.stages.len(), 17);
    assert_eq!(llm_d.load.stages.last().and_then(|s| s.rate), Some(60.0));
    assert!(matches!(
        llm_d.data,
        Some(DataConfig::SharedPrefix(SharedPrefix {
            num_groups: 150,
            num_prompts_per_group: 5,
            system_prompt_len: 6000,
            question_len: 1200,
            output_len: 1000
        }))
    ));
    find("llm-smoke.yaml")?;
    let mcp = find("mcp-smoke.yaml")?;
    assert!(matches!(mcp.api, ApiConfig::Mcp(_)));
    assert_eq!(mcp.targets.len(), 2);
    Ok(())
}

const MCP: &str = r#"
api: {type: mcp, era: legacy, operation: tools_call, tool: get-sum, connection: per_call}
targets:
  - {name: direct, url: "http://127.0.0.1:9100/mcp"}
load:
  type: closed_loop
  stages: [{clients: 1, duration: 5s}, {clients: 8, duration: 5s}]
"#;

#[test]
fn parses_an_mcp_config() -> anyhow::Result<()> {
    let c = LoadtestConfig::parse(MCP)?;
    let expected = McpApi {
        era: Era::Legacy,
        operation: McpOperation::ToolsCall,
        tool: Some(McpTool::GetSum),
        connection: ConnectionMode::PerCall,
    };
    assert_eq!(c.api, ApiConfig::Mcp(expected));
    assert_eq!(c.load.kind, LoadKind::ClosedLoop);
    assert_eq!(c.load.stages[1].clients, Some(8));
    // Defaults: tools/call of echo on pooled connections.
    let c = LoadtestConfig::parse(
        &MCP.replace(", operation: tools_call, tool: get-sum, connection: per_call", ""),
    )?;
    let ApiConfig::Mcp(api) = c.api else {
        panic!("not mcp: {:?}", c.api);
    };
    assert_eq!(
        (api.tool(), api.connection),
        (Some(McpTool::Echo), ConnectionMode::Reuse)
    );
    // The report embeds the config: `type: mcp` must survive serialization.
    let json = serde_json::to_value(&c)?;
    assert_eq!(
        (json["api"]["type"].as_str(), json["api"]["era"].as_str()),
        (Some("mcp"), Some("legacy"))
    );
    assert!(json.get("data").is_none() && json.get("model").is_none());
    Ok(())
}

#[test]
fn mcp_errors_name_the_field() {
    let e = error(&MCP.replace("era: legacy", "era: ancient"));
    assert!(e.starts_with("api: era:") && e.contains("ancient"), "{e}");
    let e = error(&MCP.replace("era: legacy, ", ""));
    assert!(e.starts_with("api:") && e.contains("era"), "{e}");
    let e = error(&MCP.replace("tool: get-sum", "tool: get_sum"));
    assert!(e.starts_with("api: tool:"), "{e}");
    let e = error(&MCP.replace("operation: tools_call", "operation: tools_list"));
    assert!(e.starts_with("api.tool:"), "{e}");
    let e = error(&format!(
        "{MCP}data: {{type: fixed, input_len: 1, output_len: 1}}\n"
    ));
    assert!(e.starts_with("data:") && e.contains("mcp"), "{e}");
    let e = error(&format!("{MCP}model: m\n"));
    assert!(e.starts_with("model:"), "{e}");
    let e = error(&MCP.replace("{clients: 8,", "{rate: 8,"));
    assert!(e.starts_with("load.stages[1].rate:"), "{e}");
    let e = error(&MCP.replace("{clients: 8,", "{clients: 0,"));
    assert!(e.starts_with("load.stages[1].clients:"), "{e}");
    let e = error(&MCP.replace("type: closed_loop", "type: closed_loop\n  max_concurrency: 4"));
    assert!(e.starts_with("load.max_concurrency:"), "{e}");
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
