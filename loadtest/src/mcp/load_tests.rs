//! MCP scenarios of `portcullis loadtest` against the test server over loopback: every mode
//! must produce throughput and no failures, a dead port must show up as connect failures,
//! and two targets must produce ratios. Bounds are generous: the machine is shared.

use std::time::Duration;

use serde_json::Value;

use super::{start, McpServer, McpServerConfig, ServedEras};
use crate::llm::{run_config, LoadtestConfig, Report};

async fn server() -> anyhow::Result<McpServer> {
    start(McpServerConfig {
        listen: "127.0.0.1:0".parse()?,
        tools: 8,
        delay: Duration::ZERO,
        prefer_sse: false,
        era: ServedEras::Both,
    })
    .await
}

/// A config against `targets` (`name: url`) with the given `api` and `load` YAML flows.
fn config(api: &str, targets: &[(&str, String)], load: &str) -> anyhow::Result<LoadtestConfig> {
    let targets: Vec<String> = targets
        .iter()
        .map(|(name, url)| format!("  - {{name: {name}, url: \"{url}\"}}"))
        .collect();
    let text = format!(
        "api: {api}\ntargets:\n{}\nload: {load}\nrequest_timeout: 5s\n",
        targets.join("\n")
    );
    LoadtestConfig::parse(&text)
}

/// Runs `api` × `load` against two names for one server; every stage must succeed.
async fn run_clean(api: &str, load: &str) -> anyhow::Result<Report> {
    let server = server().await?;
    let targets = [("direct", server.url()), ("again", server.url())];
    let dir = tempfile::tempdir()?;
    let report = run_config(config(api, &targets, load)?, dir.path()).await?;
    for target in &report.targets {
        for s in &target.stages {
            let context = format!("{api} {load} {}: {:?}", target.name, s.failures);
            assert!(s.successes.count > 0, "no successful calls: {context}");
            assert_eq!(s.failures.count, 0, "{context}");
            assert!(s.successes.throughput.requests_per_sec > 0.0, "{context}");
            assert!(s.successes.latency.request_latency.p50 > 0.0, "{context}");
            // MCP rows carry no token metrics at all.
            assert!(s.successes.latency.tokens.is_none() && s.successes.lengths.is_none());
        }
    }
    let base = report.targets[0].stages[0].vs_baseline;
    assert_eq!(base.and_then(|v| v.requests_per_sec_ratio), Some(1.0));
    assert_eq!(base.and_then(|v| v.added_p50_s), Some(0.0));
    Ok(report)
}

const CLOSED: &str = "{type: closed_loop, stages: [{clients: 4, duration: 300ms}]}";

#[tokio::test]
async fn closed_loop_both_eras_and_operations() -> anyhow::Result<()> {
    for era in ["modern", "legacy"] {
        for operation in [
            "operation: tools_call, tool: echo",
            "tool: get-sum",
            "operation: tools_list",
        ] {
            let report = run_clean(&format!("{{type: mcp, era: {era}, {operation}}}"), CLOSED).await?;
            assert_eq!(report.targets[0].stages[0].load_summary.clients, Some(4));
        }
    }
    Ok(())
}

#[tokio::test]
async fn open_loop_at_a_fixed_rate() -> anyhow::Result<()> {
    for kind in ["poisson", "constant"] {
        let load = format!("{{type: {kind}, stages: [{{rate: 200, duration: 300ms}}], seed: 3}}");
        let report = run_clean("{type: mcp, era: legacy, tool: get-sum}", &load).await?;
        // ~60 arrivals in 300 ms; constant is exact, Poisson seeded.
        let sent = report.targets[0].stages[0].load_summary.count;
        assert!((20..=120).contains(&sent), "{kind}: {sent} calls");
        assert_eq!(
            report.targets[1].stages[0].load_summary.count, sent,
            "same arrivals"
        );
    }
    Ok(())
}

#[tokio::test]
async fn new_connection_per_call() -> anyhow::Result<()> {
    for era in ["legacy", "modern"] {
        run_clean(
            &format!("{{type: mcp, era: {era}, connection: per_call}}"),
            CLOSED,
        )
        .await?;
    }
    let open = "{type: constant, stages: [{rate: 100, duration: 300ms}]}";
    run_clean("{type: mcp, era: legacy, connection: per_call}", open).await?;
    Ok(())
}

#[tokio::test]
async fn a_dead_port_counts_connect_failures() -> anyhow::Result<()> {
    let port = portcullis_testkit::free_port();
    let targets = [("dead", format!("http://127.0.0.1:{port}/mcp"))];
    let load = "{type: closed_loop, stages: [{clients: 2, duration: 100ms}]}";
    let dir = tempfile::tempdir()?;
    let report = run_config(config("{type: mcp, era: modern}", &targets, load)?, dir.path()).await?;
    let s = &report.targets[0].stages[0];
    assert_eq!(s.successes.count, 0);
    assert!(s.failures.of_kind("connect") > 0, "{:?}", s.failures);
    assert_eq!(s.failures.count, s.load_summary.count);
    // Nothing succeeded: no made-up latency difference or ratio.
    let vs = s.vs_baseline;
    assert!(vs.is_some_and(|v| v.added_p50_s.is_none() && v.requests_per_sec_ratio.is_none()));
    Ok(())
}

#[tokio::test]
async fn two_targets_write_ratios_and_mcp_outputs() -> anyhow::Result<()> {
    let fast = server().await?;
    let slow = start(McpServerConfig {
        listen: "127.0.0.1:0".parse()?,
        tools: 8,
        delay: Duration::from_millis(20),
        prefer_sse: false,
        era: ServedEras::Both,
    })
    .await?;
    let targets = [("direct", fast.url()), ("slow", slow.url())];
    let load = "{type: closed_loop, stages: [{clients: 1, duration: 300ms}, {clients: 2, duration: 300ms}]}";
    let dir = tempfile::tempdir()?;
    let report = run_config(config("{type: mcp, era: modern}", &targets, load)?, dir.path()).await?;
    assert_eq!(report.baseline, "direct");
    for s in &report.targets[1].stages {
        let vs = s.vs_baseline.ok_or_else(|| anyhow::anyhow!("no ratios"))?;
        // 20 ms of server delay on every call: latency up, throughput down.
        assert!(vs.added_p50_s.is_some_and(|d| d > 0.01), "{vs:?}");
        assert!(vs.requests_per_sec_ratio.is_some_and(|r| r < 1.0), "{vs:?}");
    }
    for name in [
        "report.json",
        "report.csv",
        "latency_p50_vs_rate.svg",
        "requests_per_sec_vs_rate.svg",
    ] {
        let text = std::fs::read_to_string(dir.path().join(name))?;
        assert!(text.len() > 100, "{name} is nearly empty");
    }
    let csv = std::fs::read_to_string(dir.path().join("report.csv"))?;
    let rows: Vec<Vec<&str>> = csv.lines().map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 1 + 2 * 2);
    let column = |name: &str| rows[0].iter().position(|h| *h == name);
    let (ttft, clients, ratio) = (
        column("ttft_p50"),
        column("clients"),
        column("requests_per_sec_ratio"),
    );
    let (Some(ttft), Some(clients), Some(ratio)) = (ttft, clients, ratio) else {
        panic!("missing columns in {:?}", rows[0]);
    };
    assert!(column("failures_connect").is_some());
    assert_eq!(
        (rows[4][ttft], rows[4][clients]),
        ("", "2"),
        "LLM-only columns stay empty"
    );
    assert!(rows[4][ratio].parse::<f64>().is_ok_and(|r| r < 1.0));
    let json: Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json"))?)?;
    let stage = &json["targets"][1]["stages"][0];
    assert!(stage["vs_baseline"]["requests_per_sec_ratio"].is_f64());
    assert!(stage["successes"]["latency"].get("time_to_first_token").is_none());
    assert_eq!(json["config"]["api"]["type"], "mcp");
    Ok(())
}
