//! MCP load scenarios: `tools/call` or `tools/list` against one or more targets (the test
//! server directly, or a gateway in front of it), closed loop or at a fixed arrival rate,
//! reusing connections+sessions or opening new ones for every call.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use serde_json::{json, Value};
use tokio::time::Instant;

use super::client::{Connection, Endpoint, Era, Failure};
use super::report::{McpReport, Tally};

#[derive(clap::Args, Debug, Clone)]
pub struct McpLoadArgs {
    /// NAME=URL (or just URL), repeated; the first is the baseline
    /// (e.g. direct=http://127.0.0.1:9100/mcp proxy=http://127.0.0.1:8080/mcp).
    #[arg(long = "target", required = true)]
    pub targets: Vec<String>,
    #[arg(long, value_enum, default_value = "modern")]
    pub era: Era,
    #[arg(long, value_enum, default_value = "echo")]
    pub operation: Operation,
    /// Open loop: this many calls per second, whatever the latency. Without it, closed loop.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Open loop: how arrivals are spaced.
    #[arg(long, value_enum, default_value = "poisson")]
    pub arrival: Arrival,
    /// Closed loop: clients each sending the next call when the previous one is answered.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// A new TCP connection (and, legacy era, a new MCP session) for every call, instead of
    /// reusing them; latency then covers connect, initialize, the call and DELETE.
    #[arg(long)]
    pub new_connection: bool,
    /// Measuring time per target and round.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Targets are interleaved round by round so that drift on a shared machine hits all alike.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// A call not answered within this counts as a `timeout` failure.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// Open loop: arrivals beyond this many calls in flight are dropped (`overload`).
    #[arg(long, default_value_t = 10_000)]
    pub max_in_flight: usize,
    /// Also write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    /// `tools/call echo {message}`
    Echo,
    /// `tools/call get-sum {a, b}`, checking a + b
    GetSum,
    /// `tools/list`
    ListTools,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    Poisson,
    Constant,
}

/// Runs the scenario against every target and returns the report (progress goes to stderr).
pub async fn run(args: &McpLoadArgs) -> anyhow::Result<McpReport> {
    anyhow::ensure!(args.rounds > 0, "rounds must be at least 1");
    anyhow::ensure!(
        args.clients > 0 || args.rate.is_some(),
        "clients must be at least 1"
    );
    if let Some(rate) = args.rate {
        anyhow::ensure!(rate.is_finite() && rate > 0.0, "rate must be a positive number");
    }
    let mut targets = Vec::new();
    for (index, target) in args.targets.iter().enumerate() {
        let (name, url) = match target.split_once('=') {
            Some((name, url)) if !name.contains("://") => (name.to_string(), url.to_string()),
            _ => (format!("target{}", index + 1), target.clone()),
        };
        let endpoint = Endpoint::parse(&url).with_context(|| format!("--target {target:?}"))?;
        targets.push((name, url, endpoint, Tally::new()?));
    }
    for round in 0..args.rounds {
        for (name, _, endpoint, total) in &mut targets {
            eprintln!("round {}/{} {name}", round + 1, args.rounds);
            let tally = match args.rate {
                Some(rate) => open_loop(args, endpoint, rate).await?,
                None => closed_loop(args, endpoint).await?,
            };
            total.merge(&tally)?;
        }
    }
    let tallies = targets
        .into_iter()
        .map(|(name, url, _, tally)| (name, url, tally))
        .collect();
    Ok(McpReport::new(
        scenario(args),
        args.duration,
        args.rounds,
        tallies,
    ))
}

/// `portcullis bench mcp`: run, print the table, write the JSON if asked.
pub async fn run_and_print(args: &McpLoadArgs) -> anyhow::Result<McpReport> {
    let report = run(args).await?;
    print!("{}", report.table());
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(report)
}

fn scenario(args: &McpLoadArgs) -> String {
    let era = match args.era {
        Era::Legacy => "legacy 2025-11-25",
        Era::Modern => "modern 2026-07-28",
    };
    let operation = match args.operation {
        Operation::Echo => "tools/call echo",
        Operation::GetSum => "tools/call get-sum",
        Operation::ListTools => "tools/list",
    };
    let load = match (args.rate, args.arrival) {
        (Some(rate), Arrival::Poisson) => format!("open loop {rate}/s Poisson"),
        (Some(rate), Arrival::Constant) => format!("open loop {rate}/s constant"),
        (None, _) => format!("closed loop, {} clients", args.clients),
    };
    let connections = if args.new_connection {
        "new connection+session per call"
    } else {
        "reused connections+sessions"
    };
    format!("{era}, {operation}, {load}, {connections}")
}

async fn closed_loop(args: &McpLoadArgs, endpoint: &Endpoint) -> anyhow::Result<Tally> {
    let started = Instant::now();
    let deadline = started.checked_add(args.duration).context("duration too long")?;
    let mut workers = Vec::with_capacity(args.clients);
    for client in 0..args.clients {
        let (args, endpoint) = (args.clone(), endpoint.clone());
        workers.push(tokio::spawn(async move {
            let mut tally = Tally::new()?;
            let mut connection = None;
            let mut sequence = 0u64;
            while Instant::now() < deadline {
                sequence += 1;
                let sent = Instant::now();
                let outcome = one_call(
                    &args,
                    &endpoint,
                    &mut connection,
                    client as u64 * 1_000_000_000 + sequence,
                )
                .await;
                if let Err(Failure::Connect(_)) = &outcome {
                    // Refused connections fail in microseconds; don't spin on them.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                tally.record(outcome.map(|()| sent.elapsed()));
            }
            if let Some(connection) = connection {
                let _ = connection.close().await;
            }
            anyhow::Ok(tally)
        }));
    }
    let mut total = Tally::new()?;
    for worker in workers {
        total.merge(&worker.await.context("load worker panicked")??)?;
    }
    total.elapsed = started.elapsed();
    Ok(total)
}

async fn open_loop(args: &McpLoadArgs, endpoint: &Endpoint, rate: f64) -> anyhow::Result<Tally> {
    // Idle connections (with their sessions) for the next arrivals, like an HTTP client pool.
    let pool: Arc<Mutex<Vec<Connection>>> = Arc::default();
    let tally = Arc::new(Mutex::new(Tally::new()?));
    let in_flight = Arc::new(AtomicUsize::new(0));
    let mut calls = tokio::task::JoinSet::new();
    let started = Instant::now();
    // Every arrival is at most `duration` after the start, so this bounds `started + offset`.
    started.checked_add(args.duration).context("duration too long")?;
    let mut offset = Duration::ZERO;
    let mut sequence = 0u64;
    loop {
        let gap = match args.arrival {
            Arrival::Constant => 1.0 / rate,
            // Exponential gaps; 1 - U is in (0, 1] so the logarithm is finite.
            Arrival::Poisson => -(1.0 - rand::random::<f64>()).ln() / rate,
        };
        // Past the end (or beyond what a Duration holds, for absurdly low rates): done.
        match Duration::try_from_secs_f64(gap)
            .ok()
            .and_then(|gap| offset.checked_add(gap))
        {
            Some(next) if next < args.duration => offset = next,
            _ => break,
        }
        let scheduled = started + offset;
        tokio::time::sleep_until(scheduled).await;
        while calls.try_join_next().is_some() {}
        sequence += 1;
        if in_flight.load(Ordering::Relaxed) >= args.max_in_flight {
            lock(&tally).record(Err(Failure::Overload));
            continue;
        }
        in_flight.fetch_add(1, Ordering::Relaxed);
        let (args, endpoint) = (args.clone(), endpoint.clone());
        let (pool, tally, in_flight) = (pool.clone(), tally.clone(), in_flight.clone());
        calls.spawn(async move {
            let mut connection = if args.new_connection {
                None
            } else {
                lock(&pool).pop()
            };
            let outcome = one_call(&args, &endpoint, &mut connection, sequence).await;
            // Latency from the scheduled arrival, so a slow target cannot hide its queueing
            // (no coordinated omission).
            lock(&tally).record(outcome.map(|()| scheduled.elapsed()));
            if let Some(connection) = connection {
                lock(&pool).push(connection);
            }
            in_flight.fetch_sub(1, Ordering::Relaxed);
        });
    }
    while calls.join_next().await.is_some() {}
    let connections: Vec<Connection> = std::mem::take(&mut *lock(&pool));
    for connection in connections {
        let _ = connection.close().await;
    }
    let mut total = Tally::new()?;
    total.merge(&lock(&tally))?;
    total.elapsed = started.elapsed();
    Ok(total)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Only counters and a pool live behind these locks; a panicked holder leaves them usable.
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One call, including opening a connection (and session) when there is none. With
/// `--new-connection` the connection is opened and closed around the call, so `connection`
/// is left empty; otherwise it is kept unless the failure broke it.
async fn one_call(
    args: &McpLoadArgs,
    endpoint: &Endpoint,
    connection: &mut Option<Connection>,
    sequence: u64,
) -> Result<(), Failure> {
    let attempt = async {
        let mut current = match connection.take() {
            Some(current) => current,
            None => Connection::open(endpoint, args.era).await?,
        };
        let outcome = call(args.operation, &mut current, sequence).await;
        match &outcome {
            _ if args.new_connection => {
                // The session ends with its one call; a failed DELETE is a failed call.
                if outcome.is_ok() {
                    current.close().await?;
                }
            }
            Err(failure) if failure.breaks_connection() => {}
            _ => *connection = Some(current),
        }
        outcome
    };
    match tokio::time::timeout(args.timeout, attempt).await {
        Ok(outcome) => outcome,
        Err(_) => Err(Failure::Timeout),
    }
}

async fn call(operation: Operation, connection: &mut Connection, sequence: u64) -> Result<(), Failure> {
    match operation {
        Operation::Echo => {
            let message = format!("ping-{sequence}");
            let result = connection
                .request(
                    "tools/call",
                    json!({ "name": "echo", "arguments": { "message": message } }),
                )
                .await?;
            expect_text(&result, &message)
        }
        Operation::GetSum => {
            let (a, b) = (sequence % 1000, sequence / 1000 % 1000);
            let result = connection
                .request(
                    "tools/call",
                    json!({ "name": "get-sum", "arguments": { "a": a, "b": b } }),
                )
                .await?;
            expect_text(&result, &(a + b).to_string())
        }
        Operation::ListTools => {
            let result = connection.request("tools/list", json!({})).await?;
            match result.get("tools").and_then(Value::as_array) {
                Some(tools) if !tools.is_empty() => Ok(()),
                _ => Err(Failure::Mismatch("tools/list without tools".into())),
            }
        }
    }
}

fn expect_text(result: &Value, expected: &str) -> Result<(), Failure> {
    if result.get("isError").and_then(Value::as_bool) == Some(true) {
        return Err(Failure::Mismatch(format!("isError: {}", result["content"])));
    }
    let text = result.pointer("/content/0/text").and_then(Value::as_str);
    if text == Some(expected) {
        Ok(())
    } else {
        Err(Failure::Mismatch(format!("expected {expected:?}, got {text:?}")))
    }
}
