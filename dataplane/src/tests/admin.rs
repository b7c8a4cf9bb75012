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
