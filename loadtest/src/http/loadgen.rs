use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{Request, Uri};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// How long past the end of a run an unanswered request is waited for (then counted as an error).
const ANSWER_GRACE: Duration = Duration::from_secs(5);

/// Results of one closed-loop run against one target.
#[derive(Debug, Clone)]
pub struct Measurement {
    pub ok: u64,
    pub errors: u64,
    pub elapsed: Duration,
    /// Request latency in microseconds, successful requests only.
    pub latency_us: Histogram<u64>,
}

impl Measurement {
    fn empty() -> anyhow::Result<Self> {
        Ok(Self {
            ok: 0,
            errors: 0,
            elapsed: Duration::ZERO,
            latency_us: new_histogram()?,
        })
    }

    pub fn requests_per_second(&self) -> f64 {
        let seconds = self.elapsed.as_secs_f64();
        if seconds > 0.0 {
            self.ok as f64 / seconds
        } else {
            0.0
        }
    }

    pub fn merge(&mut self, other: &Measurement) -> anyhow::Result<()> {
        self.ok += other.ok;
        self.errors += other.errors;
        self.elapsed += other.elapsed;
        self.latency_us
            .add(&other.latency_us)
            .context("merging latency histograms")
    }
}

fn new_histogram() -> anyhow::Result<Histogram<u64>> {
    // 1 µs .. 60 s at 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000, 3).context("creating latency histogram")
}

/// `connections` keep-alive HTTP/1.1 connections, each sending GET `url` back to back for
/// `duration`. Non-2xx answers and connection failures count as errors (a failed
/// connection is re-opened).
pub async fn closed_loop(url: &Uri, connections: usize, duration: Duration) -> anyhow::Result<Measurement> {
    let authority = url.authority().context("target URL needs host:port")?.clone();
    let deadline = Instant::now() + duration;
    let started = Instant::now();
    let mut workers = Vec::with_capacity(connections);
    for _ in 0..connections {
        let url = url.clone();
        let authority = authority.clone();
        workers.push(tokio::spawn(async move {
            one_connection(url, authority, deadline).await
        }));
    }
    let mut total = Measurement::empty()?;
    for worker in workers {
        let part = worker.await.context("load worker panicked")??;
        total.ok += part.ok;
        total.errors += part.errors;
        total
            .latency_us
            .add(&part.latency_us)
            .context("merging latency histograms")?;
    }
    total.elapsed = started.elapsed();
    Ok(total)
}

async fn one_connection(
    url: Uri,
    authority: http::uri::Authority,
    deadline: Instant,
) -> anyhow::Result<Measurement> {
    let mut measurement = Measurement::empty()?;
    while Instant::now() < deadline {
        let stream = match TcpStream::connect(authority.as_str()).await {
            Ok(stream) => stream,
            Err(_) => {
                measurement.errors += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (mut sender, connection) = match hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
        {
            Ok(pair) => pair,
            Err(_) => {
                measurement.errors += 1;
                continue;
            }
        };
        tokio::spawn(connection);
        while Instant::now() < deadline {
            let request = Request::get(url.clone())
                .header(http::header::HOST, authority.as_str())
                .body(Empty::<Bytes>::new())
                .context("building request")?;
            let sent = Instant::now();
            let exchange = async {
                match sender.send_request(request).await {
                    Ok(response) => {
                        let success = response.status().is_success();
                        response.into_body().collect().await.is_ok() && success
                    }
                    Err(_) => false,
                }
            };
            // A target that accepts but never answers must not hang the run past its end.
            let give_up = tokio::time::Instant::from_std(deadline + ANSWER_GRACE);
            let outcome = tokio::time::timeout_at(give_up, exchange).await.unwrap_or(false);
            if outcome {
                measurement.ok += 1;
                let micros = u64::try_from(sent.elapsed().as_micros())
                    .unwrap_or(u64::MAX)
                    .max(1);
                measurement.latency_us.saturating_record(micros);
            } else {
                measurement.errors += 1;
                break;
            }
        }
    }
    Ok(measurement)
}
