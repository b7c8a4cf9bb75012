use std::time::Duration;

use super::support::*;

async fn admin_get(proxy: &crate::Proxy, path: &str) -> (u16, String) {
    get(proxy.admin_addr().port(), path).await
}

#[tokio::test]
async fn readiness_follows_the_applied_config_and_status_reports_it() {
    let upstream = spawn_upstream(|_request| async { text("ok") }).await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;

    assert_eq!(admin_get(&proxy, "/livez").await.0, 200);
    let (status, body) = admin_get(&proxy, "/readyz").await;
    assert_eq!(status, 503);
    assert!(body.contains("no config"), "{body}");

    proxy
        .state
        .apply(9, simple_config(port, upstream, ""))
        .await
        .unwrap();
    assert_eq!(admin_get(&proxy, "/readyz").await.0, 200);
    let (status, body) = admin_get(&proxy, "/status").await;
    assert_eq!(status, 200);
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        status,
        serde_json::json!({
            "proxyId": "test-proxy",
            "version": 9,
            "listeners": [{"name": "web", "address": format!("127.0.0.1:{port}")}],
            "ready": true,
        })
    );
    proxy.shutdown().await.unwrap();
}

/// The other replicas' handovers of MCP answers: only a well-formed one for a call this
/// proxy holds is taken; anything else is refused with a reason and delivers nothing.
#[tokio::test]
async fn handed_over_answers_are_taken_only_for_a_waiting_call() {
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    let post = |body: &'static str| {
        let request = http::Request::post(format!("http://{}/mcp/answers", proxy.admin_addr()))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from_static(
                body.as_bytes(),
            )))
            .unwrap();
        async move {
            let response = http1_client().request(request).await.unwrap();
            let status = response.status().as_u16();
            let body = http_body_util::BodyExt::collect(response.into_body())
                .await
                .unwrap()
                .to_bytes();
            (status, String::from_utf8_lossy(&body).into_owned())
        }
    };
    let (status, body) = post("{not json").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("expected {session, id, response}"), "{body}");
    let (status, body) =
        post(r#"{"session": "s", "id": "portcullis:input:AXh5eg", "response": {"result": {}}}"#).await;
    assert_eq!(status, 404, "{body}");
    assert!(
        body.contains("no call on this proxy awaits this response"),
        "{body}"
    );
    let (status, _) = post(r#"{"session": "s", "id": 7, "response": {}}"#).await;
    assert_eq!(status, 400);
    let (status, body) = admin_get(&proxy, "/mcp/answers").await;
    assert_eq!(status, 405, "only POST takes answers: {body}");
    proxy.shutdown().await.unwrap();
}
