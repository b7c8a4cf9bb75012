//! Telemetry through the whole proxy: a trace continued to the upstream and exported over
//! OTLP, metrics that move with traffic, an access-log line per request.

use std::path::Path;
use std::time::Duration;

use http::{HeaderValue, Request};
use http_body_util::{BodyExt, Full};

use super::support::*;
use crate::{AccessLogConfig, AccessLogDestination, TelemetryConfig};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

/// Every request logged to `path`; spans exported to `otlp_endpoint` if given.
fn logging_every_request(path: &Path, otlp_endpoint: Option<String>) -> TelemetryConfig {
    TelemetryConfig {
        access_log: AccessLogConfig {
            destination: AccessLogDestination::File(path.to_owned()),
            sample: 1.0,
        },
        otlp_endpoint,
        ..quiet_telemetry()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_traced_measured_and_logged() {
    let mut collector = fake_opentelemetry_collector::FakeCollectorServer::start()
        .await
        .unwrap();
    let upstream = spawn_upstream(|request: Request<hyper::body::Incoming>| async move {
        let traceparent = request
            .headers()
            .get("traceparent")
            .and_then(|value| value.to_str().ok())
            .unwrap_or("-")
            .to_string();
        text(traceparent)
    })
    .await;
    let log_dir = tempfile::tempdir().unwrap();
    let log_path = log_dir.path().join("access.log");
    let telemetry = logging_every_request(&log_path, Some(collector.endpoint()));
    let port = free_port();
    let proxy = start_proxy_with(None, Duration::from_secs(1), telemetry).await;
    proxy
        .state
        .apply(1, simple_config(port, upstream, ""))
        .await
        .unwrap();

    let request = Request::get(format!("http://127.0.0.1:{port}/traced?token=secret"))
        .header("traceparent", format!("00-{TRACE_ID}-{PARENT_ID}-01"))
        .body(Full::default())
        .unwrap();
    let response = http1_client().request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let forwarded = response.into_body().collect().await.unwrap().to_bytes();
    let forwarded = String::from_utf8_lossy(&forwarded).into_owned();
    // The same trace, a new span: ours.
    let parts: Vec<&str> = forwarded.split('-').collect();
    assert_eq!(parts.len(), 4, "{forwarded}");
    assert_eq!((parts[0], parts[1], parts[3]), ("00", TRACE_ID, "01"));
    assert_ne!(parts[2], PARENT_ID);
    let our_span = parts[2].to_string();

    let (status, metrics) = get(proxy.admin_addr().port(), "/metrics").await;
    assert_eq!(status, 200);
    let counted = metrics.lines().any(|line| {
        line.starts_with("portcullis_proxy_requests_total{")
            && line.contains("route=\"all\"")
            && line.contains("status=\"200\"")
            && line.ends_with(" 1")
    });
    assert!(counted, "{metrics}");
    assert!(metrics.contains("portcullis_proxy_config_version 1"), "{metrics}");

    proxy.shutdown().await.unwrap();
    let spans = collector.exported_spans(1, Duration::from_secs(10)).await;
    let span = spans
        .iter()
        .find(|span| span.span_id == our_span)
        .unwrap_or_else(|| panic!("no span {our_span} in {spans:?}"));
    assert_eq!(span.trace_id, TRACE_ID);
    assert_eq!(span.parent_span_id, PARENT_ID);
    assert_eq!(span.kind, "SPAN_KIND_SERVER");

    let log = std::fs::read_to_string(&log_path).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 1, "{log}");
    let line: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(line["route"], "all");
    assert_eq!(line["status"], 200);
    assert_eq!(line["trace_id"], TRACE_ID);
    assert_eq!(line["path"], "/traced");
    assert!(!log.contains("secret"), "the query string is never logged: {log}");
}

/// A version without a route, its backend and its policy drops their metrics; what is still in
/// force keeps counting from where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_of_removed_objects_are_dropped() {
    let upstream = spawn_upstream(|_| async { text("ok") }).await;
    let port = free_port();
    let kept = listener("web", port)
        + &backend("b", upstream, false)
        + &route("two", "web", "b", "matches: [{path: {prefix: /two}}]");
    let removed = backend("a", upstream, false)
        + &route("one", "web", "a", "matches: [{path: {prefix: /one}}]")
        + "apiVersion: portcullis.dev/v1alpha1\nkind: HeaderPolicy\nmetadata: {name: tag}\nspec: {targetRefs: [{kind: Route, name: one}], request: {set: [{name: x-tag, value: 'yes'}]}}\n";
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(1, objects(&(kept.clone() + &removed)))
        .await
        .unwrap();
    for path in ["/one", "/two"] {
        assert_eq!(get(port, path).await.0, 200, "{path}");
    }
    let of_removed = |line: &&str| {
        !line.starts_with('#')
            && (line.contains("route=\"one\"")
                || line.contains("target=\"Backend/a\"")
                || line.contains("policy=\"HeaderPolicy/tag\""))
    };
    let two =
        |line: &&str| line.starts_with("portcullis_proxy_requests_total{") && line.contains("route=\"two\"");
    let (_, metrics) = get(proxy.admin_addr().port(), "/metrics").await;
    assert!(metrics.lines().filter(of_removed).count() >= 4, "{metrics}");
    assert!(
        metrics.lines().any(|line| two(&line) && line.ends_with(" 1")),
        "{metrics}"
    );

    proxy.state.apply(2, objects(&kept)).await.unwrap();
    assert_eq!(get(port, "/two").await.0, 200);
    let (_, metrics) = get(proxy.admin_addr().port(), "/metrics").await;
    let left: Vec<&str> = metrics.lines().filter(of_removed).collect();
    assert!(left.is_empty(), "{left:?}");
    assert!(
        metrics.lines().any(|line| two(&line) && line.ends_with(" 2")),
        "{metrics}"
    );
    proxy.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guardrail_decision_is_a_span_event_a_log_entry_and_a_metric() {
    let mut collector = fake_opentelemetry_collector::FakeCollectorServer::start()
        .await
        .unwrap();
    let log_dir = tempfile::tempdir().unwrap();
    let log_path = log_dir.path().join("access.log");
    let telemetry = logging_every_request(&log_path, Some(collector.endpoint()));
    let port = free_port();
    // The prompt is denied before any pod is asked: the pool's endpoint needs no server.
    let guardrail = "apiVersion: portcullis.dev/v1alpha1
kind: Guardrail
metadata: {name: no-secrets}
spec:
  targetRefs: [{kind: InferencePool, name: qwen}]
  phases: [LlmRequest]
  builtin: {deny: [{pattern: 'password', reason: no passwords}]}
";
    let proxy = start_proxy_with(None, Duration::from_secs(1), telemetry).await;
    proxy
        .state
        .apply(1, llm_config(port, "127.0.0.1:9", "", guardrail))
        .await
        .unwrap();

    let body = r#"{"model": "m", "messages": [{"role": "user", "content": "my password is hunter2"}]}"#;
    let request = Request::post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
        .header("traceparent", format!("00-{TRACE_ID}-{PARENT_ID}-01"))
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let response = http1_client().request(request).await.unwrap();
    assert_eq!(response.status(), 403);

    let (_, metrics) = get(proxy.admin_addr().port(), "/metrics").await;
    let counted = metrics.lines().any(|line| {
        line.starts_with("portcullis_proxy_guardrail_checks_total{")
            && line.contains("guardrail=\"Guardrail/no-secrets\"")
            && line.contains("phase=\"LlmRequest\"")
            && line.contains("decision=\"deny\"")
            && line.contains("replica=\"builtin\"")
            && line.ends_with(" 1")
    });
    assert!(counted, "{metrics}");

    proxy.shutdown().await.unwrap();
    let spans = collector.exported_spans(1, Duration::from_secs(10)).await;
    let span = spans
        .iter()
        .find(|span| span.trace_id == TRACE_ID)
        .unwrap_or_else(|| panic!("no span of trace {TRACE_ID} in {spans:?}"));
    let event = span
        .events
        .iter()
        .find(|event| event.name == "portcullis.guardrail")
        .unwrap_or_else(|| panic!("no guardrail event in {span:?}"));
    let attribute = |name: &str| event.attributes.get(name).cloned().unwrap_or_default();
    assert!(
        attribute("portcullis.guardrail.name").contains("Guardrail/no-secrets"),
        "{event:?}"
    );
    assert!(
        attribute("portcullis.guardrail.decision").contains("deny"),
        "{event:?}"
    );

    let log = std::fs::read_to_string(&log_path).unwrap();
    let line: serde_json::Value = serde_json::from_str(log.lines().next().unwrap()).unwrap();
    assert_eq!(line["guardrails"][0]["guardrail"], "Guardrail/no-secrets");
    assert_eq!(line["guardrails"][0]["decision"], "deny");
    assert!(!log.contains("hunter2"), "payloads are never logged: {log}");
}

/// A body that ends in trailers is read no further by hyper's servers, so whatever runs at a
/// body's end must run at its trailers. Through an HTTP/1.1 upstream (whose chunked body does
/// not itself say it ended) to an HTTP/2 client: the client gets the trailers, the requests
/// are logged as completed, and the upstream connection serves the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_ending_in_trailers_reaches_the_client_and_is_logged_as_completed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: grpc-status\r\n\r\n2\r\nok\r\n0\r\ngrpc-status: 0\r\n\r\n";
    let upstream_socket = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = upstream_socket.local_addr().unwrap();
    let (accepts, accepted) = tokio::sync::watch::channel(0);
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = upstream_socket.accept().await.unwrap();
            accepts.send_modify(|count| *count += 1);
            tokio::spawn(async move {
                // Requests without bodies: each head gets the answer.
                let mut head = Vec::new();
                let mut chunk = [0; 1024];
                while let Ok(read @ 1..) = stream.read(&mut chunk).await {
                    head.extend_from_slice(&chunk[..read]);
                    if head.windows(4).any(|window| window == b"\r\n\r\n") {
                        head.clear();
                        if stream.write_all(ANSWER).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    let log_dir = tempfile::tempdir().unwrap();
    let log_path = log_dir.path().join("access.log");
    let telemetry = logging_every_request(&log_path, None);
    let port = free_port();
    let proxy = start_proxy_with(None, Duration::from_secs(1), telemetry).await;
    let config = objects(
        &(listener("web", port)
            + &backend("grpc", upstream, false)
            + &route("to-grpc", "web", "grpc", "matches: [{path: {prefix: /}}]")),
    );
    proxy.state.apply(1, config).await.unwrap();

    let client = http2_client();
    for _ in 0..2 {
        let request = Request::post(format!("http://127.0.0.1:{port}/pkg.Service/Call"))
            .header("te", "trailers")
            .body(Full::default())
            .unwrap();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.status(), 200);
        let collected = response.into_body().collect().await.unwrap();
        assert_eq!(
            collected.trailers().map(|trailers| &trailers["grpc-status"]),
            Some(&HeaderValue::from_static("0"))
        );
        assert_eq!(collected.to_bytes(), "ok");
    }

    proxy.shutdown().await.unwrap();
    assert_eq!(
        *accepted.borrow(),
        1,
        "one upstream connection served both requests"
    );
    let log = std::fs::read_to_string(&log_path).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{log}");
    for line in lines {
        assert_eq!(line["status"], 200, "{line}");
        assert_eq!(line["completed"], true, "{line}");
    }
}
