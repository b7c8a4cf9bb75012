//! The load runner against the test server over loopback: every mode must produce
//! throughput and no failures.

use std::time::Duration;

use clap::Parser;

use super::{run, start, McpLoadArgs, McpReport, McpServerConfig};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    load: McpLoadArgs,
}

async fn run_against_server(extra: &[&str]) -> anyhow::Result<McpReport> {
    let server = start(McpServerConfig {
        listen: "127.0.0.1:0".parse()?,
        tools: 8,
        delay: Duration::ZERO,
        prefer_sse: false,
    })
    .await?;
    let url = format!("direct={}", server.url());
    let second = format!("again={}", server.url());
    let mut argv = vec![
        "load",
        "--target",
        &url,
        "--target",
        &second,
        "--duration",
        "300ms",
        "--clients",
        "4",
    ];
    argv.extend_from_slice(extra);
    let cli = Cli::try_parse_from(argv)?;
    let report = run(&cli.load).await?;
    for target in &report.targets {
        assert!(
            target.ok > 0,
            "{extra:?}: no successful calls\n{}",
            report.table()
        );
        assert_eq!(target.failed, 0, "{extra:?}: failures\n{}", report.table());
        assert!(target.rps > 0.0 && target.p50_us > 0);
    }
    assert!((report.targets[0].rps_ratio - 1.0).abs() < 1e-9);
    Ok(report)
}

#[tokio::test]
async fn closed_loop_both_eras_and_operations() -> anyhow::Result<()> {
    for era in ["modern", "legacy"] {
        for operation in ["echo", "get-sum", "list-tools"] {
            run_against_server(&["--era", era, "--operation", operation]).await?;
        }
    }
    Ok(())
}

#[tokio::test]
async fn open_loop_at_a_fixed_rate() -> anyhow::Result<()> {
    for arrival in ["poisson", "constant"] {
        let report = run_against_server(&[
            "--rate",
            "200",
            "--arrival",
            arrival,
            "--era",
            "legacy",
            "--operation",
            "get-sum",
        ])
        .await?;
        // ~60 arrivals in 300 ms; generous bounds for a loaded machine.
        let calls = report.targets[0].ok;
        assert!((20..=120).contains(&calls), "{arrival}: {calls} calls");
    }
    Ok(())
}

#[tokio::test]
async fn new_connection_per_call() -> anyhow::Result<()> {
    for era in ["legacy", "modern"] {
        run_against_server(&["--new-connection", "--era", era]).await?;
    }
    run_against_server(&["--new-connection", "--rate", "100", "--era", "legacy"]).await?;
    Ok(())
}

#[tokio::test]
async fn failures_are_counted_by_kind() -> anyhow::Result<()> {
    // Nothing listens on a just-released port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let url = format!("http://127.0.0.1:{port}/mcp");
    let cli = Cli::try_parse_from(["load", "--target", &url, "--duration", "100ms", "--clients", "2"])?;
    let report = run(&cli.load).await?;
    assert_eq!(report.targets[0].ok, 0);
    assert!(report.targets[0].failures.get("connect").is_some_and(|n| *n > 0));
    assert_eq!(report.targets[0].name, "target1");
    Ok(())
}
