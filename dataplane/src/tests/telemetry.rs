//! Telemetry through the whole proxy: a trace continued to the upstream and exported over
//! OTLP, metrics that move with traffic, an access-log line per request.

use std::time::Duration;

use http::Request;
use http_body_util::{BodyExt, Full};

use super::support::*;
use crate::{AccessLogConfig, AccessLogDestination, TelemetryConfig};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

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
    let telemetry = TelemetryConfig {
        access_log: AccessLogConfig {
            destination: AccessLogDestination::File(log_path.clone()),
            sample: 1.0,
        },
        otlp_endpoint: Some(collector.endpoint()),
        service_name: "portcullis-proxy".into(),
        proxy_id: "test-proxy".into(),
    };
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
