//! Runs the whole generator against a small in-test hyper server whose SSE chunk timings are
//! controlled, so TTFT/ITL, failure classification and the outputs can be checked over real
//! sockets. (The lead adds the end-to-end run against `portcullis sim vllm`, which was being
//! written concurrently with this module.) Bounds are generous: these are behavioural checks,
//! not speed benchmarks, and the machine is shared.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::net::TcpListener;

use super::client::FailureKind;
use super::{run_config, LoadtestConfig};
use crate::sim::tokenizer;

/// Delay before the first content chunk, and between content chunks.
const TTFT: Duration = Duration::from_millis(150);
const GAP: Duration = Duration::from_millis(40);

type Body = BoxBody<Bytes, Infallible>;

/// Serves until the test's runtime ends. The first path segment picks the behaviour:
/// `/ok`, `/fail500`, `/hang`, `/garbage` (unparsable chunk), `/truncated` (no `[DONE]`).
async fn server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                let _ = builder
                    .serve_connection(TokioIo::new(stream), service_fn(handle))
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

async fn handle(request: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let path = request.uri().path().to_string();
    let chat = path.ends_with("/chat/completions");
    let bytes = request
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let prompt = if chat {
        body["messages"][0]["content"].as_str()
    } else {
        body["prompt"].as_str()
    };
    let prompt_tokens = tokenizer::encode(prompt.unwrap_or("")).len();
    let max_tokens = body["max_tokens"].as_u64().unwrap_or(1) as usize;
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                       "total_tokens": prompt_tokens + max_tokens});
    let piece = |text: &str| {
        if chat {
            json!({"choices": [{"index": 0, "delta": {"content": text}}], "usage": null})
        } else {
            json!({"choices": [{"index": 0, "text": text}], "usage": null})
        }
    };
    let event = |v: Value| (Duration::ZERO, format!("data: {v}\n\n"));
    let mut events = Vec::new();
    match path.split('/').nth(1).unwrap_or("") {
        "fail500" => return Ok(reply(StatusCode::INTERNAL_SERVER_ERROR, "{\"error\":{}}")),
        "hang" => tokio::time::sleep(Duration::from_secs(30)).await,
        "garbage" => return Ok(sse(vec![(Duration::ZERO, "data: {oops\n\n".into())])),
        "truncated" => return Ok(sse(vec![event(piece("tok"))])),
        _ => {}
    }
    if body["stream"] != json!(true) {
        tokio::time::sleep(TTFT).await;
        let text = vec!["tok"; max_tokens].join(" ");
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": text}})
        } else {
            json!({"index": 0, "text": text})
        };
        return Ok(reply(
            StatusCode::OK,
            &json!({"choices": [choice], "usage": usage}).to_string(),
        ));
    }
    // A content-free role chunk first: TTFT must wait for the first *content*.
    events.push(event(
        json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    ));
    for i in 0..max_tokens {
        let (_, chunk) = event(piece("tok "));
        events.push((if i == 0 { TTFT } else { GAP }, chunk));
    }
    events.push(event(json!({"choices": [], "usage": usage})));
    events.push((Duration::ZERO, "data: [DONE]\n\n".into()));
    Ok(sse(events))
}

fn reply(status: StatusCode, body: &str) -> Response<Body> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())).boxed());
    *response.status_mut() = status;
    response
}

fn sse(events: Vec<(Duration, String)>) -> Response<Body> {
    let stream = futures::stream::iter(events).then(|(delay, chunk)| async move {
        tokio::time::sleep(delay).await;
        Ok::<_, Infallible>(Frame::data(Bytes::from(chunk)))
    });
    let mut response = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        "text/event-stream".parse().expect("static header"),
    );
    response
}

fn config(api: &str, targets: &[(&str, String)], stages: &str, extra: &str) -> LoadtestConfig {
    let targets: Vec<String> = targets
        .iter()
        .map(|(name, url)| format!("  - {{name: {name}, url: \"{url}\"}}"))
        .collect();
    let text = format!(
        "api: {api}\nmodel: m\ntargets:\n{}\ndata: {{type: fixed, input_len: 20, output_len: 5}}\n\
         load: {{type: constant, stages: {stages}, seed: 1}}\n{extra}",
        targets.join("\n")
    );
    LoadtestConfig::parse(&text).expect("test config parses")
}

#[tokio::test]
async fn ttft_and_itl_come_from_chunk_timings() -> anyhow::Result<()> {
    let base = server().await;
    let dir = tempdir()?;
    let cfg = config(
        "{type: chat, streaming: true}",
        &[("ok", format!("{base}/ok"))],
        "[{rate: 4, duration: 1}]",
        "",
    );
    let report = run_config(cfg, dir.path()).await?;
    let s = &report.targets[0].stages[0];
    assert_eq!(
        (s.load_summary.count, s.successes.count, s.failures.count),
        (4, 4, 0)
    );
    let Some(l) = &s.successes.latency.tokens else {
        panic!("LLM stages have token latencies");
    };
    // TTFT ≥ the server's 150 ms (the role chunk at 0 ms must not count).
    assert!(
        (0.14..1.0).contains(&l.time_to_first_token.p50),
        "{:?}",
        l.time_to_first_token
    );
    // Four gaps of 40 ms per request.
    assert_eq!(l.inter_token_latency.count, 16);
    assert!(
        (0.02..0.5).contains(&l.inter_token_latency.p50),
        "{:?}",
        l.inter_token_latency
    );
    assert!(
        (0.02..0.5).contains(&l.time_per_output_token.p50),
        "{:?}",
        l.time_per_output_token
    );
    let e2e = &s.successes.latency.request_latency;
    assert!(e2e.p50 >= 0.3 && e2e.p50 < 2.0);
    // Usage echoes the stand-in token count of our prompt text: exactly input_len.
    let lengths = s
        .successes
        .lengths
        .as_ref()
        .map(|l| (l.prompt_len.max, l.output_len.max));
    assert_eq!(lengths, Some((20.0, 5.0)));
    let tokens = s.successes.throughput.tokens.as_ref();
    assert!(tokens.is_some_and(|t| t.output_tokens_per_sec > 0.0));
    Ok(())
}

#[tokio::test]
async fn failures_are_classified() -> anyhow::Result<()> {
    let base = server().await;
    // Nothing listens there: connecting is refused.
    let refused = SocketAddr::from(([127, 0, 0, 1], portcullis_testkit::free_port()));
    let targets = [
        ("fail500", format!("{base}/fail500")),
        ("refused", format!("http://{refused}")),
        ("hang", format!("{base}/hang")),
        ("garbage", format!("{base}/garbage")),
        ("truncated", format!("{base}/truncated")),
    ];
    let dir = tempdir()?;
    let cfg = config(
        "{type: completion, streaming: true}",
        &targets,
        "[{rate: 4, duration: 0.5}]",
        "request_timeout: 300ms",
    );
    let report = run_config(cfg, dir.path()).await?;
    let expected = [
        FailureKind::Http5xx,
        FailureKind::Connect,
        FailureKind::Timeout,
        FailureKind::MalformedStream,
        FailureKind::MalformedStream,
    ];
    for (target, kind) in report.targets.iter().zip(expected) {
        let s = &target.stages[0];
        assert_eq!(s.load_summary.count, 2, "{}", target.name);
        assert_eq!(
            s.failures.of_kind(kind.name()),
            2,
            "{}: {:?}",
            target.name,
            s.failures
        );
        assert_eq!(s.successes.count, 0);
    }
    Ok(())
}

#[tokio::test]
async fn outputs_have_one_row_per_target_and_stage() -> anyhow::Result<()> {
    let base = server().await;
    let dir = tempdir()?;
    // Non-streamed completions also exercise the whole-body path.
    let cfg = config(
        "{type: completion, streaming: false}",
        &[
            ("direct", format!("{base}/ok")),
            ("gateway", format!("{base}/ok/")),
        ],
        "[{rate: 5, duration: 0.4}, {rate: 10, duration: 0.4}]",
        "",
    );
    let report = run_config(cfg, dir.path()).await?;
    for name in [
        "report.json",
        "report.csv",
        "ttft_p50_vs_rate.svg",
        "output_throughput_vs_rate.svg",
    ] {
        let text = std::fs::read_to_string(dir.path().join(name))?;
        assert!(text.len() > 100, "{name} is nearly empty");
    }
    let csv = std::fs::read_to_string(dir.path().join("report.csv"))?;
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(rows.len(), 1 + 2 * 2);
    assert!(rows[0].starts_with("target,stage,requested_rate"));
    assert!(rows[1].starts_with("direct,0,5,") && rows[4].starts_with("gateway,1,10,"));
    let svg = std::fs::read_to_string(dir.path().join("ttft_p50_vs_rate.svg"))?;
    assert!(svg.contains("<svg") && svg.contains("gateway"));
    let json: Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json"))?)?;
    assert_eq!(json["targets"][1]["stages"][1]["load_summary"]["count"], 4);
    // The printed summary carries the ratios to the baseline (the first target).
    let line = super::runner::describe("gateway", &report.targets[1].stages[0]);
    assert!(
        line.contains("vs base: p50 ") && line.contains(" req/s x"),
        "{line}"
    );
    for target in &report.targets {
        for s in &target.stages {
            assert_eq!(s.failures.count, 0, "{:?}", s.failures);
            // Non-streamed: no TTFT, but output tokens from usage and an E2E ≥ the delay.
            let ttft = s
                .successes
                .latency
                .tokens
                .as_ref()
                .map(|t| t.time_to_first_token.count);
            assert_eq!(ttft, Some(0));
            assert_eq!(s.successes.lengths.as_ref().map(|l| l.output_len.max), Some(5.0));
            assert!(s.successes.latency.request_latency.p50 >= 0.14);
        }
    }
    Ok(())
}

fn tempdir() -> anyhow::Result<tempfile::TempDir> {
    Ok(tempfile::tempdir()?)
}
