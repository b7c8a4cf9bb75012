//! Telemetry end to end: spans to a real OTLP/gRPC receiver on loopback, the metrics
//! exposition, the access log in a file.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fake_opentelemetry_collector::{ExportedSpan, FakeCollectorServer};
use http::HeaderValue;
use portcullis_config::ConfigSet;

use super::*;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

fn config(access_log: AccessLogDestination, sample: f64, otlp_endpoint: Option<String>) -> TelemetryConfig {
    TelemetryConfig {
        access_log: AccessLogConfig {
            destination: access_log,
            sample,
        },
        otlp_endpoint,
        service_name: "portcullis-proxy".to_owned(),
        proxy_id: "proxy-test-1".to_owned(),
    }
}

/// What a version of `yaml` holds in force, with the endpoint `record` names.
fn in_force(yaml: &str) -> InForce {
    let config = ConfigSet::from_objects(crate::tests::support::objects(yaml)).unwrap();
    InForce::new(&config, ["127.0.0.1:9001"])
}

/// A finished request as the pipeline would report it.
fn record(trace: RequestTrace, route: Option<&str>, status: u16) -> RequestRecord {
    RequestRecord {
        trace,
        client: "127.0.0.1:51234".parse().unwrap(),
        listener: Arc::from("web"),
        method: http::Method::GET,
        path: "/v1/models".to_owned(),
        host: Some("api.example.com:8443".to_owned()),
        route: route.map(Arc::from),
        target: route.map(|_| Arc::from("Backend/api")),
        endpoint: route.map(|_| Arc::from("127.0.0.1:9001")),
        attempts: u32::from(route.is_some()),
        status,
        error: None,
        decisions: Vec::new(),
        start: Instant::now() - Duration::from_millis(3),
        upstream_headers: route.map(|_| Duration::from_millis(2)),
        bytes_received: 0,
        bytes_sent: 120,
        completed: true,
        llm: None,
        mcp: None,
        guardrails: Default::default(),
    }
}

fn attribute<'a>(span: &'a ExportedSpan, key: &str) -> &'a str {
    span.attributes.get(key).map_or("", String::as_str)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_otlp_collector() {
    let mut collector = FakeCollectorServer::start()
        .await
        .expect("the fake collector starts");
    let telemetry =
        Telemetry::new(config(AccessLogDestination::Off, 1.0, Some(collector.endpoint()))).unwrap();

    // Continues the caller's trace.
    let incoming = HeaderValue::from_static(TRACEPARENT);
    let state = HeaderValue::from_static("vendor=opaque");
    let trace = telemetry.start(Some(&incoming), Some(&state));
    let outgoing = trace.traceparent().expect("a traceparent for upstream");
    let outgoing = outgoing.to_str().unwrap().to_owned();
    assert!(outgoing.starts_with(&format!("00-{TRACE_ID}-")), "{outgoing}");
    assert!(outgoing.ends_with("-01"), "{outgoing}");
    let our_span_id = outgoing[36..52].to_owned();
    assert_ne!(our_span_id, PARENT_ID);
    assert_eq!(trace.tracestate(), Some(&state));
    let mut continued = record(trace, Some("Route/api"), 200);
    continued.path = "/v1/chat/completions?api_key=secret".to_owned();
    continued.method = http::Method::POST;
    telemetry.finish(continued);

    // No traceparent: a new sampled trace, and a 5xx is an error.
    let trace = telemetry.start(None, None);
    let root = trace
        .traceparent()
        .expect("export on: a new trace")
        .to_str()
        .unwrap()
        .to_owned();
    assert!(root.ends_with("-01"), "{root}");
    assert!(trace.tracestate().is_none());
    let root_trace_id = trace.trace_id().unwrap();
    let mut failed = record(trace, None, 503);
    failed.error = Some("no_healthy_endpoint");
    telemetry.finish(failed);

    // Not sampled upstream: continued, not exported.
    let unsampled = HeaderValue::from_static("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00");
    let trace = telemetry.start(Some(&unsampled), None);
    assert!(trace.traceparent().unwrap().to_str().unwrap().ends_with("-00"));
    telemetry.finish(record(trace, Some("Route/api"), 200));

    telemetry.shutdown().await;
    let spans = collector.exported_spans(2, Duration::from_secs(20)).await;
    assert_eq!(spans.len(), 2, "{spans:#?}");

    let span = spans
        .iter()
        .find(|s| s.trace_id == TRACE_ID)
        .expect("the continued trace's span");
    assert_eq!(span.parent_span_id, PARENT_ID);
    assert_eq!(
        span.span_id, our_span_id,
        "the span id sent upstream is the span's"
    );
    assert_eq!(span.name, "POST Route/api");
    assert_eq!(span.kind, "SPAN_KIND_SERVER");
    assert_eq!(span.trace_state, "vendor=opaque");
    assert!(
        attribute(span, "http.route").contains("\"Route/api\""),
        "{span:#?}"
    );
    assert!(
        attribute(span, "portcullis.route").contains("\"Route/api\""),
        "{span:#?}"
    );
    assert!(
        attribute(span, "portcullis.target").contains("\"Backend/api\""),
        "{span:#?}"
    );
    assert!(
        attribute(span, "portcullis.endpoint").contains("\"127.0.0.1:9001\""),
        "{span:#?}"
    );
    assert!(
        attribute(span, "portcullis.attempts").contains("IntValue(1)"),
        "{span:#?}"
    );
    assert!(
        attribute(span, "http.request.method").contains("\"POST\""),
        "{span:#?}"
    );
    assert!(
        attribute(span, "http.response.status_code").contains("IntValue(200)"),
        "{span:#?}"
    );
    assert!(
        attribute(span, "url.path").contains("\"/v1/chat/completions\""),
        "{span:#?}"
    );
    assert!(
        attribute(span, "server.address").contains("\"api.example.com\""),
        "{span:#?}"
    );
    assert!(
        attribute(span, "server.port").contains("IntValue(8443)"),
        "{span:#?}"
    );
    assert!(
        attribute(span, "client.address").contains("\"127.0.0.1\""),
        "{span:#?}"
    );
    assert!(
        !format!("{span:?}").contains("secret"),
        "no query string in spans: {span:#?}"
    );
    assert!(
        span.status.as_ref().is_none_or(|s| s.code != "STATUS_CODE_ERROR"),
        "{span:#?}"
    );
    assert!(span.end_time_unix_nano >= span.start_time_unix_nano);

    let span = spans
        .iter()
        .find(|s| s.trace_id == root_trace_id)
        .expect("the new trace's span");
    assert_eq!(span.parent_span_id, "");
    assert_eq!(span.name, "GET");
    assert_eq!(
        span.status.as_ref().map(|s| s.code.as_str()),
        Some("STATUS_CODE_ERROR")
    );
    assert!(
        attribute(span, "error.type").contains("\"no_healthy_endpoint\""),
        "{span:#?}"
    );
    assert!(attribute(span, "http.route").is_empty(), "{span:#?}");
    collector.abort();
}

fn metric_line<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    text.lines().find(|line| line.starts_with(prefix))
}

#[tokio::test]
async fn metrics_move_with_finished_requests() {
    let telemetry = Telemetry::new(config(AccessLogDestination::Off, 1.0, None)).unwrap();
    let ok = r#"portcullis_proxy_requests_total{listener="web",route="Route/api",target="Backend/api",status="200"} "#;
    let not_found = r#"portcullis_proxy_requests_total{listener="web",route="",target="",status="404"} "#;

    let (content_type, text) = telemetry.encode_metrics();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    assert!(metric_line(&text, ok).is_none(), "{text}");

    let mut first = record(telemetry.start(None, None), Some("Route/api"), 200);
    first.bytes_received = 42;
    first.decisions = vec![(Arc::from("RateLimitPolicy/per-client"), "allow")];
    telemetry.finish(first);
    let (_, text) = telemetry.encode_metrics();
    assert_eq!(metric_line(&text, ok), Some(&*format!("{ok}1")), "{text}");

    telemetry.finish(record(telemetry.start(None, None), Some("Route/api"), 200));
    telemetry.finish(record(telemetry.start(None, None), None, 404));
    telemetry.upstream_error("Route/api", "Backend/api", "connect");
    let in_force = in_force(
        "apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {name: web}\nspec: {port: 8080}\n---\n\
         apiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {name: api}\nspec: {endpoints: ['127.0.0.1:9001']}\n---\n\
         apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {name: api}\nspec: {listeners: [web], backends: [{name: api}]}\n---\n\
         apiVersion: portcullis.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: per-client}\nspec: {targetRefs: [{kind: Route, name: api}], requestsPerSecond: 1, burst: 1}\n",
    );
    telemetry.config_applied(7, &in_force);
    telemetry.config_rejected(8);
    let (_, text) = telemetry.encode_metrics();
    let expected = [
        format!("{ok}2"),
        format!("{not_found}1"),
        "# HELP portcullis_proxy_requests_total Requests answered".to_owned(),
        "# TYPE portcullis_proxy_requests_total counter".to_owned(),
        "# TYPE portcullis_proxy_request_duration_seconds histogram".to_owned(),
        r#"portcullis_proxy_request_duration_seconds_count{route="Route/api",target="Backend/api"} 2"#
            .to_owned(),
        r#"portcullis_proxy_request_duration_seconds_bucket{route="Route/api",target="Backend/api",le="0.0001"} 0"#
            .to_owned(),
        r#"portcullis_proxy_request_duration_seconds_bucket{route="Route/api",target="Backend/api",le="+Inf"} 2"#
            .to_owned(),
        r#"portcullis_proxy_request_bytes_total{route="Route/api"} 42"#.to_owned(),
        r#"portcullis_proxy_response_bytes_total{route="Route/api"} 240"#.to_owned(),
        r#"portcullis_proxy_response_bytes_total{route=""} 120"#.to_owned(),
        r#"portcullis_proxy_upstream_errors_total{route="Route/api",target="Backend/api",kind="connect"} 1"#
            .to_owned(),
        r#"portcullis_proxy_policy_decisions_total{policy="RateLimitPolicy/per-client",decision="allow"} 1"#
            .to_owned(),
        "portcullis_proxy_config_version 7".to_owned(),
        "portcullis_proxy_config_last_apply_ok 0".to_owned(),
        "portcullis_proxy_config_last_apply_version 8".to_owned(),
        "portcullis_proxy_access_log_dropped_total 0".to_owned(),
    ];
    for line in expected {
        assert!(
            text.lines().any(|l| l.starts_with(&line)),
            "missing {line:?} in:\n{text}"
        );
    }
    telemetry.config_applied(8, &in_force);
    let (_, text) = telemetry.encode_metrics();
    assert!(
        text.lines()
            .any(|l| l == "portcullis_proxy_config_last_apply_ok 1"),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l == "portcullis_proxy_config_version 8"),
        "{text}"
    );
    telemetry.shutdown().await;
}

fn read_lines(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(
        text.is_empty() || text.ends_with('\n'),
        "whole lines only: {text:?}"
    );
    text.lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
        .collect()
}

#[tokio::test]
async fn access_log_has_one_json_line_per_request() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("access.log");
    let telemetry = Telemetry::new(config(AccessLogDestination::File(path.clone()), 1.0, None)).unwrap();

    let incoming = HeaderValue::from_static(TRACEPARENT);
    let mut traced = record(telemetry.start(Some(&incoming), None), Some("Route/api"), 200);
    traced.path = "/v1/chat/completions?api_key=secret".to_owned();
    traced.decisions = vec![
        (Arc::from("RateLimitPolicy/per-client"), "allow"),
        (Arc::from("HeaderPolicy/strip"), "apply"),
    ];
    traced.bytes_received = 512;
    telemetry.finish(traced);
    telemetry.finish(record(telemetry.start(None, None), None, 404));
    let mut cut = record(telemetry.start(None, None), Some("Route/api"), 200);
    cut.completed = false;
    telemetry.finish(cut);
    telemetry.shutdown().await;

    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        !text.contains("secret") && !text.contains('?'),
        "no query string: {text}"
    );
    let lines = read_lines(&path);
    assert_eq!(lines.len(), 3, "{text}");
    let fields = [
        "time",
        "client",
        "listener",
        "method",
        "host",
        "path",
        "route",
        "target",
        "endpoint",
        "attempts",
        "status",
        "error",
        "duration_ms",
        "upstream_headers_ms",
        "bytes_received",
        "bytes_sent",
        "completed",
        "trace_id",
        "decisions",
    ];
    for line in &lines {
        let object = line.as_object().expect("each line is an object");
        for field in fields {
            assert!(object.contains_key(field), "no {field:?} in {line}");
        }
        assert_eq!(object.len(), fields.len(), "{line}");
        let time = line["time"].as_str().unwrap();
        let parsed = humantime::parse_rfc3339(time).unwrap_or_else(|e| panic!("{e}: {time}"));
        let age = std::time::SystemTime::now().duration_since(parsed).unwrap();
        assert!(age < Duration::from_secs(60), "{time}");
        assert!(time.ends_with('Z'), "{time}");
        assert!(line["duration_ms"].as_f64().unwrap() >= 3.0, "{line}");
    }

    let first = &lines[0];
    assert_eq!(first["client"], "127.0.0.1:51234");
    assert_eq!(first["listener"], "web");
    assert_eq!(first["method"], "GET");
    assert_eq!(first["host"], "api.example.com:8443");
    assert_eq!(first["path"], "/v1/chat/completions");
    assert_eq!(first["route"], "Route/api");
    assert_eq!(first["target"], "Backend/api");
    assert_eq!(first["endpoint"], "127.0.0.1:9001");
    assert_eq!(first["attempts"], 1);
    assert_eq!(first["status"], 200);
    assert!(first["error"].is_null());
    assert_eq!(first["upstream_headers_ms"], 2.0);
    assert_eq!(first["bytes_received"], 512);
    assert_eq!(first["bytes_sent"], 120);
    assert_eq!(first["completed"], true);
    assert_eq!(first["trace_id"], TRACE_ID);
    assert_eq!(
        first["decisions"],
        serde_json::json!({"RateLimitPolicy/per-client": "allow", "HeaderPolicy/strip": "apply"})
    );

    let second = &lines[1];
    assert_eq!(second["status"], 404);
    assert!(second["route"].is_null() && second["target"].is_null() && second["endpoint"].is_null());
    assert!(second["trace_id"].is_null(), "no trace invented with export off");
    assert!(second["upstream_headers_ms"].is_null());
    assert_eq!(second["decisions"], serde_json::json!({}));
    assert_eq!(lines[2]["completed"], false);
}

/// A finished MCP request that named `name` with `method`.
fn mcp_record(telemetry: &Telemetry, method: &str, name: &str) -> RequestRecord {
    let mut mcp = record(telemetry.start(None, None), Some("Route/mcp"), 200);
    mcp.mcp = Some(McpRecord {
        method: Arc::from(method),
        server: Some(Arc::from("docs")),
        name: Some(name.to_owned()),
        ..McpRecord::default()
    });
    mcp
}

const SECRET_URI: &str = "postgres://reader:hunter2@db/orders?token=t0k3n#frag";

#[tokio::test]
async fn resource_uris_leave_their_credentials_out_of_the_access_log() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("access.log");
    let telemetry = Telemetry::new(config(AccessLogDestination::File(path.clone()), 1.0, None)).unwrap();
    telemetry.finish(mcp_record(&telemetry, "resources/read", SECRET_URI));
    telemetry.finish(mcp_record(&telemetry, "tools/call", "get-sum"));
    telemetry.shutdown().await;

    let text = std::fs::read_to_string(&path).unwrap();
    for secret in ["reader", "hunter2", "t0k3n", "frag"] {
        assert!(!text.contains(secret), "{secret} in {text}");
    }
    let lines = read_lines(&path);
    assert_eq!(lines[0]["mcp"]["name"], "postgres://db/orders", "{text}");
    assert_eq!(lines[1]["mcp"]["name"], "get-sum", "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resource_uris_leave_their_credentials_out_of_spans() {
    let mut collector = FakeCollectorServer::start()
        .await
        .expect("the fake collector starts");
    let telemetry =
        Telemetry::new(config(AccessLogDestination::Off, 1.0, Some(collector.endpoint()))).unwrap();
    telemetry.finish(mcp_record(&telemetry, "resources/read", SECRET_URI));
    telemetry.finish(mcp_record(&telemetry, "tools/call", "get-sum"));
    telemetry.shutdown().await;

    let spans = collector.exported_spans(2, Duration::from_secs(20)).await;
    assert_eq!(spans.len(), 2, "{spans:#?}");
    for secret in ["reader", "hunter2", "t0k3n", "frag"] {
        assert!(!format!("{spans:?}").contains(secret), "{secret} in {spans:#?}");
    }
    let named = |key: &str| spans.iter().map(|span| attribute(span, key)).collect::<String>();
    assert!(
        named("mcp.item.name").contains("\"postgres://db/orders\""),
        "{spans:#?}"
    );
    assert!(named("gen_ai.tool.name").contains("\"get-sum\""), "{spans:#?}");
    collector.abort();
}

#[tokio::test]
async fn sampling_zero_logs_only_server_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("access.log");
    let telemetry = Telemetry::new(config(AccessLogDestination::File(path.clone()), 0.0, None)).unwrap();
    for _ in 0..20 {
        telemetry.finish(record(telemetry.start(None, None), Some("Route/api"), 200));
        telemetry.finish(record(telemetry.start(None, None), None, 404));
    }
    telemetry.finish(record(telemetry.start(None, None), Some("Route/api"), 502));
    let mut limited = record(telemetry.start(None, None), Some("Route/api"), 429);
    limited.error = Some("rate_limited");
    telemetry.finish(limited);
    telemetry.shutdown().await;

    let lines = read_lines(&path);
    let statuses: Vec<_> = lines.iter().map(|l| l["status"].as_u64().unwrap()).collect();
    // A refusal the proxy answered itself (429) is sampled like any request: a flood of
    // them must not become a flood of lines.
    assert_eq!(statuses, [502]);
}

#[tokio::test]
async fn access_log_is_flushed_without_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("access.log");
    let telemetry = Telemetry::new(config(AccessLogDestination::File(path.clone()), 1.0, None)).unwrap();
    telemetry.finish(record(telemetry.start(None, None), Some("Route/api"), 200));
    let deadline = Instant::now() + Duration::from_secs(5);
    while read_lines(&path).is_empty() {
        assert!(Instant::now() < deadline, "the line was not flushed within 5 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(read_lines(&path).len(), 1);
}

#[test]
fn bad_config_is_an_error() {
    // Span export needs a runtime: an error, not a panic.
    let error = Telemetry::new(config(
        AccessLogDestination::Off,
        1.0,
        Some("http://127.0.0.1:4317".into()),
    ))
    .err()
    .expect("no runtime");
    assert!(format!("{error:#}").contains("Tokio runtime"), "{error:#}");
    assert!(Telemetry::new(config(AccessLogDestination::Off, 1.5, None)).is_err());
    // An empty endpoint is no endpoint: no runtime needed.
    assert!(Telemetry::new(config(AccessLogDestination::Off, 1.0, Some(String::new()))).is_ok());
    let trace = RequestTrace::default();
    assert!(trace.traceparent().is_none() && trace.tracestate().is_none());
    let missing = AccessLogDestination::File("/nonexistent-dir/access.log".into());
    assert!(Telemetry::new(config(missing, 1.0, None)).is_err());
}

#[test]
fn shareable_across_tasks() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<Telemetry>();
    send::<RequestTrace>();
    send::<RequestRecord>();
}
