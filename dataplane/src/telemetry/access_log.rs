//! The access log: one JSON object per line, sampled, written off the request path.
//!
//! A finished request's record is moved (boxed) through a bounded channel to a dedicated
//! thread that formats and writes it through a buffer flushed at least every
//! [`FLUSH_INTERVAL`]. The request path never blocks: when the channel is full the line is
//! dropped and counted (`portcullis_proxy_access_log_dropped_total`). Header values and query
//! strings are never written, nor a resource URI's userinfo, query and fragment.

use std::fs::OpenOptions;
use std::io::{self, BufWriter, Write};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use prometheus_client::metrics::counter::Counter;
use rand::Rng as _;
use serde::ser::{Serialize, SerializeMap as _, Serializer};

use super::trace::{mcp_item_name, path_without_query};
use super::{AccessLogConfig, AccessLogDestination, RequestRecord};

/// Lines waiting for the writer; past this they are dropped.
const CHANNEL_CAPACITY: usize = 16 * 1024;
/// Longest time a written line stays in the buffer.
const FLUSH_INTERVAL: Duration = Duration::from_millis(100);
/// How often the writer looks for new lines; with [`CHANNEL_CAPACITY`] this bounds the
/// rate it can take (1.6 million lines a second) before lines are dropped.
const POLL_INTERVAL: Duration = Duration::from_millis(10);
const BUFFER_SIZE: usize = 64 * 1024;
/// How long [`AccessLog::flush`] waits for the writer.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(5);

/// Which non-error requests are logged.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Sampling {
    All,
    None,
    /// Logged when a random `u64` is below this.
    Below(u64),
}

impl Sampling {
    fn new(sample: f64) -> anyhow::Result<Sampling> {
        anyhow::ensure!(
            sample.is_finite() && (0.0..=1.0).contains(&sample),
            "the access-log sample must be a fraction between 0.0 and 1.0, not {sample}"
        );
        Ok(if sample >= 1.0 {
            Sampling::All
        } else if sample <= 0.0 {
            Sampling::None
        } else {
            // 2^64 * sample; the cast saturates.
            Sampling::Below((sample * 18_446_744_073_709_551_616.0) as u64)
        })
    }

    fn sampled(self) -> bool {
        match self {
            Sampling::All => true,
            Sampling::None => false,
            Sampling::Below(threshold) => rand::rng().random::<u64>() < threshold,
        }
    }
}

enum Message {
    Line(Box<Entry>),
    Flush(SyncSender<()>),
}

struct Entry {
    record: RequestRecord,
    /// When the request arrived.
    time: SystemTime,
    duration: Duration,
}

/// The sending side of the access log; the writer thread ends when it is dropped.
pub(super) struct AccessLog {
    tx: SyncSender<Message>,
    sampling: Sampling,
    dropped: Counter,
}

impl AccessLog {
    /// Opens the destination and starts the writer thread; `None` when the log is off.
    pub(super) fn start(
        config: &AccessLogConfig,
        dropped: Counter,
        write_errors: Counter,
    ) -> anyhow::Result<Option<AccessLog>> {
        let sampling = Sampling::new(config.sample)?;
        let sink: Box<dyn Write + Send> = match &config.destination {
            AccessLogDestination::Off => return Ok(None),
            AccessLogDestination::Stdout => Box::new(io::stdout()),
            AccessLogDestination::File(path) => Box::new(
                OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .with_context(|| format!("opening the access log {}", path.display()))?,
            ),
        };
        let (tx, rx) = mpsc::sync_channel(CHANNEL_CAPACITY);
        std::thread::Builder::new()
            .name("access-log".to_owned())
            .spawn(move || write_lines(rx, sink, write_errors))
            .context("starting the access-log writer")?;
        Ok(Some(AccessLog {
            tx,
            sampling,
            dropped,
        }))
    }

    /// Hands the record to the writer if it is sampled: server errors (status >= 500)
    /// always are. Client-side refusals (404, 429, 413…) are sampled like successes, so a
    /// scan or a flood cannot turn every request into a line.
    pub(super) fn log(&self, record: RequestRecord, duration: Duration) {
        let error = record.status >= 500;
        if !error && !self.sampling.sampled() {
            return;
        }
        let time = SystemTime::now().checked_sub(duration).unwrap_or(UNIX_EPOCH);
        let entry = Box::new(Entry {
            record,
            time,
            duration,
        });
        if self.tx.try_send(Message::Line(entry)).is_err() {
            // Full, or the writer is gone.
            self.dropped.inc();
        }
    }

    /// Waits until every line handed over so far is written and flushed.
    pub(super) async fn flush(&self) {
        let tx = self.tx.clone();
        let flushed = tokio::task::spawn_blocking(move || {
            let deadline = Instant::now() + FLUSH_TIMEOUT;
            let (ack_tx, ack_rx) = mpsc::sync_channel(1);
            let mut message = Message::Flush(ack_tx);
            loop {
                match tx.try_send(message) {
                    Ok(()) => break,
                    Err(TrySendError::Disconnected(_)) => return false,
                    Err(TrySendError::Full(m)) if Instant::now() < deadline => {
                        message = m;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(TrySendError::Full(_)) => return false,
                }
            }
            ack_rx
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .is_ok()
        })
        .await;
        if !matches!(flushed, Ok(true)) {
            tracing::warn!("the access log could not be flushed");
        }
    }
}

/// The writer thread: wakes every [`POLL_INTERVAL`], formats and writes what has queued,
/// flushes when a line has waited [`FLUSH_INTERVAL`], when asked, and when every sender is
/// gone. It polls rather than blocks on the channel so that a request handing over its line
/// never has to wake a sleeping thread: that wake-up, once per request, cost more than the
/// line itself.
fn write_lines(rx: Receiver<Message>, sink: Box<dyn Write + Send>, write_errors: Counter) {
    let mut out = Output {
        writer: BufWriter::with_capacity(BUFFER_SIZE, sink),
        write_errors,
        warned: false,
    };
    let mut line = Vec::with_capacity(1024);
    // When the oldest line not yet flushed was written.
    let mut unflushed_since: Option<Instant> = None;
    loop {
        loop {
            match rx.try_recv() {
                Ok(Message::Line(entry)) => {
                    line.clear();
                    if serde_json::to_writer(&mut line, &Line(&entry)).is_ok() {
                        line.push(b'\n');
                        out.write(&line);
                        unflushed_since.get_or_insert_with(Instant::now);
                    }
                }
                Ok(Message::Flush(ack)) => {
                    out.flush();
                    unflushed_since = None;
                    let _ = ack.send(());
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    out.flush();
                    return;
                }
            }
        }
        if unflushed_since.is_some_and(|since| since.elapsed() >= FLUSH_INTERVAL) {
            out.flush();
            unflushed_since = None;
        }
        std::thread::sleep(POLL_INTERVAL);
    }
}

struct Output {
    writer: BufWriter<Box<dyn Write + Send>>,
    write_errors: Counter,
    warned: bool,
}

impl Output {
    fn write(&mut self, line: &[u8]) {
        let result = self.writer.write_all(line);
        self.check(result);
    }

    fn flush(&mut self) {
        let result = self.writer.flush();
        self.check(result);
    }

    fn check(&mut self, result: io::Result<()>) {
        if let Err(error) = result {
            self.write_errors.inc();
            if !self.warned {
                self.warned = true;
                tracing::warn!(%error, "writing the access log failed (further failures are only counted)");
            }
        }
    }
}

/// One entry as a JSON object.
struct Line<'a>(&'a Entry);

impl Serialize for Line<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let Entry {
            record: r,
            time,
            duration,
        } = self.0;
        let mut trace_id = [0u8; 32];
        let guardrails = r.guardrails();
        let mut map = serializer.serialize_map(Some(
            19 + usize::from(r.llm.is_some())
                + usize::from(r.mcp.is_some())
                + usize::from(!guardrails.is_empty()),
        ))?;
        map.serialize_entry(
            "time",
            &format_args!("{}", humantime::format_rfc3339_millis(*time)),
        )?;
        map.serialize_entry("client", &r.client)?;
        map.serialize_entry("listener", &*r.listener)?;
        map.serialize_entry("method", r.method.as_str())?;
        map.serialize_entry("host", &r.host)?;
        map.serialize_entry("path", path_without_query(&r.path))?;
        map.serialize_entry("route", &r.route.as_deref())?;
        map.serialize_entry("target", &r.target.as_deref())?;
        map.serialize_entry("endpoint", &r.endpoint.as_deref())?;
        map.serialize_entry("attempts", &r.attempts)?;
        map.serialize_entry("status", &r.status)?;
        map.serialize_entry("error", &r.error)?;
        map.serialize_entry("duration_ms", &millis(*duration))?;
        map.serialize_entry("upstream_headers_ms", &r.upstream_headers.map(millis))?;
        map.serialize_entry("bytes_received", &r.bytes_received)?;
        map.serialize_entry("bytes_sent", &r.bytes_sent)?;
        map.serialize_entry("completed", &r.completed)?;
        map.serialize_entry("trace_id", &r.trace.write_trace_id(&mut trace_id))?;
        map.serialize_entry("decisions", &Decisions(&r.decisions))?;
        if let Some(mcp) = &r.mcp {
            map.serialize_entry(
                "mcp",
                &serde_json::json!({
                    "method": &*mcp.method,
                    "server": mcp.server.as_deref(),
                    "name": mcp_item_name(mcp),
                    "error_code": mcp.error_code,
                    "pin": mcp.pin,
                }),
            )?;
        }
        if !guardrails.is_empty() {
            let checks: Vec<serde_json::Value> = guardrails
                .iter()
                .map(|check| {
                    serde_json::json!({
                        "guardrail": &*check.guardrail,
                        "phase": check.phase,
                        "decision": check.decision,
                        "replica": check.replica.as_deref(),
                        "attempts": check.attempts,
                        "latency_ms": millis(check.latency),
                    })
                })
                .collect();
            map.serialize_entry("guardrails", &checks)?;
        }
        if let Some(llm) = &r.llm {
            let llm = llm.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            map.serialize_entry(
                "llm",
                &serde_json::json!({
                    "model": &*llm.model,
                    "streamed": llm.streamed,
                    "input_tokens": llm.input_tokens,
                    "cached_input_tokens": llm.cached_input_tokens,
                    "output_tokens": llm.output_tokens,
                    "time_to_first_token_ms": llm.first_token.map(millis),
                    "time_per_output_token_ms": llm.time_per_output_token().map(millis),
                    "interrupted": llm.interrupted,
                    "pick": llm.pick_basis,
                    "prefix_hit_blocks": llm.prefix_blocks.map(|(hit, _)| hit),
                    "prompt_blocks": llm.prefix_blocks.map(|(_, total)| total),
                    "pool_saturated": llm.saturated,
                }),
            )?;
        }
        map.end()
    }
}

/// Milliseconds with microsecond precision.
fn millis(duration: Duration) -> f64 {
    duration.as_micros() as f64 / 1000.0
}

/// `(policy, decision)` pairs as an object.
struct Decisions<'a>(&'a [(Arc<str>, &'static str)]);

impl Serialize for Decisions<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (policy, decision) in self.0 {
            map.serialize_entry(&**policy, decision)?;
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_fractions() {
        assert_eq!(Sampling::new(1.0).unwrap(), Sampling::All);
        assert_eq!(Sampling::new(0.0).unwrap(), Sampling::None);
        assert_eq!(Sampling::new(0.5).unwrap(), Sampling::Below(1 << 63));
        assert!(Sampling::new(1.5).is_err());
        assert!(Sampling::new(-0.1).is_err());
        assert!(Sampling::new(f64::NAN).is_err());
        let half = Sampling::new(0.5).unwrap();
        let logged = (0..10_000).filter(|_| half.sampled()).count();
        assert!(
            (4_000..6_000).contains(&logged),
            "{logged} of 10000 sampled at 0.5"
        );
    }
}
