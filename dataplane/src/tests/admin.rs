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
/// proxy holds is taken; anything else is refused with a reason and delivers nothing (a
/// handover that is taken is in the two-replica test of `cli/tests/peers/mcp.rs`).
#[tokio::test]
async fn handed_over_answers_are_taken_only_for_a_waiting_call() {
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    let post = |content_type: &'static str, body: &'static str| {
        let request = http::Request::post(format!("http://{}/mcp/answers", proxy.admin_addr()))
            .header("content-type", content_type)
            .body(http_body_util::Full::new(bytes::Bytes::from_static(
                body.as_bytes(),
            )))
            .unwrap();
        async move { status_and_text(http1_client().request(request).await.unwrap()).await }
    };
    let json = "application/json";
    let (status, body) = post(json, "{not json").await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("expected {id, sealed}"), "{body}");
    let (status, body) = post(json, r#"{"id": "portcullis:input:AXh5eg", "sealed": "AXh5eg"}"#).await;
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("not_waiting"), "{body}");
    let (status, body) = post("text/plain", r#"{"id": "portcullis:input:AXh5eg", "sealed": ""}"#).await;
    assert_eq!(status, 415, "{body}");
    let (status, body) = admin_get(&proxy, "/mcp/answers").await;
    assert_eq!(status, 405, "only POST takes answers: {body}");
    proxy.shutdown().await.unwrap();
}

#[test]
fn the_peer_address_is_checked_and_an_ip_takes_the_admin_port() {
    let admin: std::net::SocketAddr = "0.0.0.0:7071".parse().unwrap();
    let peer =
        |given: Option<&str>, admin| crate::peer_address(given, admin).map_err(|error| error.to_string());
    assert_eq!(peer(Some("10.1.2.3"), admin), Ok(Some("10.1.2.3:7071".into())));
    assert_eq!(peer(Some("fd00::1"), admin), Ok(Some("[fd00::1]:7071".into())));
    assert_eq!(
        peer(Some("proxy-0.proxies:9000"), admin),
        Ok(Some("proxy-0.proxies:9000".into()))
    );
    assert_eq!(
        peer(Some("[fd00::1]:9000"), admin),
        Ok(Some("[fd00::1]:9000".into()))
    );
    for bad in [
        "[fd00::1]",
        "proxy-0",
        "http://10.1.2.3:7071",
        "10.1.2.3:x",
        "user@10.1.2.3:7071",
    ] {
        let error = peer(Some(bad), admin).unwrap_err();
        assert!(
            error.contains("--peer-address") && error.contains("HOST:PORT"),
            "{bad}: {error}"
        );
    }
    // Without one, the admin address if other hosts can reach it.
    assert_eq!(peer(None, admin), Ok(None));
    assert_eq!(peer(None, "127.0.0.1:7071".parse().unwrap()), Ok(None));
    assert_eq!(
        peer(None, "10.1.2.3:7071".parse().unwrap()),
        Ok(Some("10.1.2.3:7071".into()))
    );
}
