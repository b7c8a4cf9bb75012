//! One timed MCP call for `portcullis loadtest` (api type `mcp`): `tools/call` or
//! `tools/list` over a pooled or per-call [`Connection`], checked and classified into the
//! same [`Trace`] the LLM requests produce, so both share the runner and the report.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::client::{Connection, Endpoint, Failure};
use crate::llm::client::{Failure as TraceFailure, Trace};
use crate::llm::config::{ConnectionMode, McpApi, McpTool};

/// Failure kinds always given a CSV column for MCP rows; others (`http_404`, `rpc_-32602`,
/// …) get one only when they occur, since their set is open-ended.
pub const CORE_FAILURE_KINDS: [&str; 5] = ["connect", "io", "timeout", "protocol", "mismatch"];

/// Sends MCP calls to one target.
pub struct McpCaller {
    endpoint: Endpoint,
    api: McpApi,
    timeout: Duration,
    /// Idle connections (with their legacy sessions) for the next call, like an HTTP client
    /// pool: it grows to the peak concurrency. Always empty with `connection: per_call`.
    idle: Mutex<Vec<Connection>>,
    /// Distinct arguments per call, so a proxy cannot answer from a cache.
    sequence: AtomicU64,
}

impl McpCaller {
    pub fn new(url: &str, api: McpApi, timeout: Duration) -> anyhow::Result<McpCaller> {
        Ok(McpCaller {
            endpoint: Endpoint::parse(url)?,
            api,
            timeout,
            idle: Mutex::default(),
            sequence: AtomicU64::new(0),
        })
    }

    /// One call; times are seconds since `epoch`. Latency covers opening a connection (and
    /// session) whenever none is idle, which is every call with `per_call`.
    pub async fn call(&self, epoch: Instant) -> Trace {
        let sequence = self.sequence.fetch_add(1, Ordering::Relaxed) + 1;
        let sent = epoch.elapsed().as_secs_f64();
        let mut connection = match self.api.connection {
            ConnectionMode::Reuse => lock(&self.idle).pop(),
            ConnectionMode::PerCall => None,
        };
        let outcome = tokio::time::timeout(self.timeout, self.attempt(&mut connection, sequence))
            .await
            .unwrap_or(Err(Failure::Timeout));
        let finish = epoch.elapsed().as_secs_f64();
        if let Some(connection) = connection {
            lock(&self.idle).push(connection);
        }
        Trace {
            sent,
            finish,
            failure: outcome
                .err()
                .map(|failure| TraceFailure::named(failure.kind(), failure.to_string())),
            ..Trace::default()
        }
    }

    /// Ends the pooled sessions (legacy era) once a target is done; failures are irrelevant
    /// to the measurement by then.
    pub async fn close_idle(&self) {
        let idle = std::mem::take(&mut *lock(&self.idle));
        for connection in idle {
            let _ = connection.close().await;
        }
    }

    /// Leaves a still-usable connection in `connection` for the pool; with `per_call` the
    /// connection is opened and closed around the call. After a successful call a failed
    /// DELETE fails it; after a failed call the session is still closed (best effort), so a
    /// failure-heavy run does not pile up sessions on the target.
    async fn attempt(&self, connection: &mut Option<Connection>, sequence: u64) -> Result<(), Failure> {
        let mut current = match connection.take() {
            Some(current) => current,
            None => Connection::open(&self.endpoint, self.api.era).await?,
        };
        let outcome = call(self.api.tool(), &mut current, sequence).await;
        match &outcome {
            _ if self.api.connection == ConnectionMode::PerCall => {
                let closed = current.close().await;
                if outcome.is_ok() {
                    closed?;
                }
            }
            Err(failure) if failure.breaks_connection() => {}
            _ => *connection = Some(current),
        }
        outcome
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Only idle connections live behind this lock; a panicked holder leaves them usable.
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `tools/call` of `tool`, or `tools/list` when `tool` is `None`, with the answer checked.
async fn call(tool: Option<McpTool>, connection: &mut Connection, sequence: u64) -> Result<(), Failure> {
    match tool {
        Some(McpTool::Echo) => {
            let message = format!("ping-{sequence}");
            let result = connection
                .request(
                    "tools/call",
                    json!({ "name": "echo", "arguments": { "message": message } }),
                )
                .await?;
            expect_text(&result, &message)
        }
        Some(McpTool::GetSum) => {
            let (a, b) = (sequence % 1000, sequence / 1000 % 1000);
            let result = connection
                .request(
                    "tools/call",
                    json!({ "name": "get-sum", "arguments": { "a": a, "b": b } }),
                )
                .await?;
            expect_text(&result, &(a + b).to_string())
        }
        None => {
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
