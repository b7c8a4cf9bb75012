//! The pipeline's stages through real sockets: normalization, policies, limits, retries.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::Request;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::support::*;

/// An upstream answering with the path and the headers it saw.
async fn path_echo() -> std::net::SocketAddr {
    spawn_upstream(|request: Request<hyper::body::Incoming>| async move {
        let header = |name: &str| {
            request
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_string()
        };
        text(format!(
            "path={}\nx-added={}\nx-removed={}\nxff={}\n",
            request.uri().path(),
            header("x-added"),
            header("x-removed"),
            header("x-forwarded-for"),
        ))
    })
    .await
}

/// The proxy's count of failed connects, as its metrics (returned too) say.
async fn connect_errors(proxy: &crate::Proxy) -> (Option<u64>, String) {
    let (_, metrics) = get(proxy.admin_addr().port(), "/metrics").await;
    let count = metrics
        .lines()
        .find(|line| {
            line.starts_with("portcullis_proxy_upstream_errors_total{") && line.contains("kind=\"connect\"")
        })
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|count| count.parse::<u64>().ok());
    (count, metrics)
}

/// Sends raw bytes and returns everything the proxy answers until it closes the
/// connection; fails the test if it never does.
async fn raw(port: u16, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream.write_all(request).await.unwrap();
    read_until_closed(&mut stream).await
}

async fn read_until_closed(stream: &mut TcpStream) -> String {
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), stream.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the proxy did not close the connection");
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test]
async fn path_bypass_attempts_route_on_the_normalized_path() {
    let public = path_echo().await;
    let admin = spawn_upstream(|_| async { text("admin") }).await;
    let port = free_port();
    let config = objects(
        &(listener("web", port)
            + &backend("public", public, false)
            + &backend("admin", admin, false)
            + &route("public", "web", "public", "matches: [{path: {prefix: /public}}]")
            + &route("admin", "web", "admin", "matches: [{path: {prefix: /admin}}]")),
    );
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();
    // Each resolves to /admin: the admin route, never the public upstream with an admin path.
    for attack in [
        "/public/../admin",
        "/public/%2e%2e/admin",
        "/public/.%2E/admin",
        "//admin",
        "/public//..//admin",
        "/%61dmin",
    ] {
        let (status, body) = get(port, attack).await;
        assert_eq!((status, body.as_str()), (200, "admin"), "{attack}");
    }
    // Double encoding stays encoded: a public path, forwarded as it was normalized.
    let (status, body) = get(port, "/public/%252e%252e/admin").await;
    assert_eq!(status, 200);
    assert!(body.contains("path=/public/%252e%252e/admin\n"), "{body}");
    let (status, body) = get(port, "/public/a%2fb").await;
    assert_eq!(status, 200);
    assert!(body.contains("path=/public/a%2Fb\n"), "{body}");
    // Invalid percent-encoding is refused, not forwarded.
    let answer = raw(
        port,
        b"GET /public/%zz HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("invalid request path"), "{answer}");
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn header_policy_edits_requests_and_responses() {
    let upstream = path_echo().await;
    let port = free_port();
    let policy = "apiVersion: portcullis.dev/v1alpha1\nkind: HeaderPolicy\nmetadata: {name: tag}\nspec: {targetRefs: [{kind: Route, name: all}], request: {set: [{name: x-added, value: 'yes'}], remove: [x-removed]}, response: {add: [{name: x-served-by, value: portcullis}]}}\n";
    let mut config = simple_config(port, upstream, "");
    config.extend(objects(policy));
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();
    let (_, headers, body) = get_with(port, "/x", &[("x-removed", "secret")]).await;
    assert_eq!(headers["x-served-by"], "portcullis");
    assert!(body.contains("x-added=yes\n"), "{body}");
    assert!(body.contains("x-removed=-\n"), "{body}");
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn rate_limit_answers_429_with_retry_after_per_client_key() {
    let upstream = path_echo().await;
    let port = free_port();
    let policy = "apiVersion: portcullis.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: per-tenant}\nspec: {targetRefs: [{kind: Listener, name: web}], requestsPerSecond: 0.01, burst: 2, key: {header: x-tenant}}\n";
    let mut config = simple_config(port, upstream, "");
    config.extend(objects(policy));
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();
    let send = |tenant: &'static str| async move { get_with(port, "/x", &[("x-tenant", tenant)]).await };
    assert_eq!(send("a").await.0, 200);
    assert_eq!(send("a").await.0, 200);
    let (status, headers, body) = send("a").await;
    assert_eq!(status, 429);
    // One token per 100 s: the wait is a whole number of seconds, at most 100.
    let retry_after: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((90..=100).contains(&retry_after), "Retry-After: {retry_after}");
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["type"], "rate_limited");
    // Another tenant has its own bucket.
    assert_eq!(send("b").await.0, 200);
    assert_eq!(send("b").await.0, 200);
    assert_eq!(send("b").await.0, 429);
    // An unrelated config change keeps the buckets: tenant a is still limited.
    let mut changed = simple_config(port, upstream, "timeout: 5s");
    changed.extend(objects(policy));
    proxy.state.apply(2, changed).await.unwrap();
    assert_eq!(send("a").await.0, 429);
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn listener_limits_answer_with_documented_errors_and_keep_serving() {
    let upstream = path_echo().await;
    let port = free_port();
    let listener = format!("apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: web}}\nspec: {{address: 127.0.0.1, port: {port}, limits: {{headerReadTimeout: 300ms, maxHeaderBytes: 8192}}}}\n---\n");
    let config = objects(
        &(listener
            + &backend("up", upstream, false)
            + &route(
                "all",
                "web",
                "up",
                "limits: {maxRequestBodyBytes: 16, bodyIdleTimeout: 300ms}",
            )),
    );
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();

    // Oversized headers: 431.
    let big = format!(
        "GET / HTTP/1.1\r\nhost: h\r\nx-big: {}\r\n\r\n",
        "a".repeat(10_000)
    );
    assert!(raw(port, big.as_bytes()).await.starts_with("HTTP/1.1 431"));
    // Slowloris: headers never finished, the connection is closed (`raw` waits for that).
    let answer = raw(port, b"GET / HTTP/1.1\r\nhost: h\r\nx-slow: ").await;
    assert!(!answer.contains("200 OK"), "{answer}");
    // A connection that says nothing at all, or half an HTTP/2 preface, is closed too.
    assert_eq!(raw(port, b"").await, "");
    assert_eq!(raw(port, b"PRI * HTTP/2.0\r\n").await, "");
    // A declared body over the route's limit: 413 before anything is forwarded.
    let answer = raw(
        port,
        b"POST / HTTP/1.1\r\nhost: h\r\ncontent-length: 17\r\nconnection: close\r\n\r\n12345678901234567",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    // A chunked body that grows over the limit: 413 too.
    let answer = raw(port, b"POST / HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n20\r\n0123456789abcdef0123456789abcdef\r\n0\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    // A body that stalls: 408.
    let answer = raw(
        port,
        b"POST / HTTP/1.1\r\nhost: h\r\ncontent-length: 10\r\nconnection: close\r\n\r\n123",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    // A truncated body (the client half-closes) is refused.
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream
        .write_all(b"POST / HTTP/1.1\r\nhost: h\r\ncontent-length: 10\r\n\r\n123")
        .await
        .unwrap();
    stream.shutdown().await.unwrap();
    let answer = read_until_closed(&mut stream).await;
    assert!(!answer.contains("200 OK"), "{answer}");
    // And it keeps serving.
    assert_eq!(get(port, "/ok").await.0, 200);
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn connections_over_the_limit_get_503_and_slots_come_back() {
    let upstream = path_echo().await;
    let port = free_port();
    let listener = format!("apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: web}}\nspec: {{address: 127.0.0.1, port: {port}, limits: {{maxConnections: 2, headerReadTimeout: 60s}}}}\n---\n");
    let config = objects(&(listener + &backend("up", upstream, false) + &route("all", "web", "up", "")));
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();
    // Accepted in order, so these two hold both slots before the third arrives.
    let first = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let second = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let answer = raw(port, b"GET / HTTP/1.1\r\nhost: h\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("too_many_connections"), "{answer}");
    drop((first, second));
    eventually("a freed slot serving again", || async {
        try_status(port, "/ok").await == Some(200)
    })
    .await;
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn trusted_proxies_keep_forwarding_headers_others_are_replaced() {
    let upstream = path_echo().await;
    let port = free_port();
    let listener = format!("apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: web}}\nspec: {{address: 127.0.0.1, port: {port}, trustedProxies: [127.0.0.0/8]}}\n---\n");
    let config = objects(&(listener + &backend("up", upstream, false) + &route("all", "web", "up", "")));
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();
    let (_, _, body) = get_with(port, "/x", &[("x-forwarded-for", "203.0.113.9")]).await;
    assert!(body.contains("xff=203.0.113.9, 127.0.0.1\n"), "{body}");
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn failed_connects_are_retried_on_another_endpoint_and_the_endpoint_ejected() {
    let served = Arc::new(AtomicUsize::new(0));
    let counter = served.clone();
    let alive = spawn_upstream(move |_| {
        let counter = counter.clone();
        async move {
            counter.fetch_add(1, Ordering::Relaxed);
            text("alive")
        }
    })
    .await;
    let dead = format!("127.0.0.1:{}", free_port());
    let port = free_port();
    let backend = format!("apiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {{name: up}}\nspec: {{endpoints: ['{dead}', '{alive}'], ejection: {{consecutiveFailures: 2, duration: 30s}}}}\n---\n");
    let config = objects(&(listener("web", port) + &backend + &route("all", "web", "up", "")));
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();
    // Every request succeeds, POSTs too: nothing reached the dead endpoint.
    for index in 0..10 {
        let request = Request::post(format!("http://127.0.0.1:{port}/x"))
            .body(http_body_util::Full::new(bytes::Bytes::from("payload")))
            .unwrap();
        let response = http1_client().request(request).await.unwrap();
        assert_eq!(response.status(), 200, "request {index}");
    }
    assert_eq!(served.load(Ordering::Relaxed), 10);
    // Two failed connects ejected the dead endpoint: it was not tried again.
    let (count, metrics) = connect_errors(&proxy).await;
    assert_eq!(count, Some(2), "{metrics}");
    proxy.shutdown().await.unwrap();
}

/// A listener whose accept queue is full: the kernel drops further SYNs, so a connect to it
/// neither succeeds nor fails, as with a host that silently drops them. Holds the listener
/// and the connections that fill it.
async fn blackhole() -> (std::net::SocketAddr, tokio::net::TcpListener, Vec<TcpStream>) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let address = listener.local_addr().unwrap();
    let mut queued = Vec::new();
    while let Ok(connected) =
        tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(address)).await
    {
        queued.push(connected.unwrap());
        assert!(queued.len() < 64, "the accept queue never filled");
    }
    (address, listener, queued)
}

#[tokio::test]
async fn an_endpoint_that_accepts_no_connection_within_the_route_timeout_is_ejected() {
    let alive = spawn_upstream(|_| async { text("alive") }).await;
    let (dead, _listener, _queued) = blackhole().await;
    let port = free_port();
    let backend = format!("apiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {{name: up}}\nspec: {{endpoints: ['{dead}', '{alive}'], ejection: {{consecutiveFailures: 2, duration: 30s}}}}\n---\n");
    // A route timeout well below the 3 s connect timeout: the route's timer ends each
    // attempt on the dead endpoint while it is still connecting.
    let config = objects(&(listener("web", port) + &backend + &route("all", "web", "up", "timeout: 1s")));
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();
    let mut statuses = Vec::new();
    for _ in 0..8 {
        statuses.push(get(port, "/x").await.0);
    }
    // Round-robin puts the dead endpoint first for every other request until two of them
    // ejected it.
    assert_eq!(statuses, [504, 200, 504, 200, 200, 200, 200, 200]);
    let (count, metrics) = connect_errors(&proxy).await;
    assert_eq!(count, Some(2), "{metrics}");
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_content_length_sent_with_transfer_encoding_does_not_frame_the_forwarded_body() {
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = upstream.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = upstream.accept().await {
            tokio::spawn(async move {
                let mut request = [0; 4096];
                let _ = stream.read(&mut request).await;
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
                    .await;
                let _ = stream.read(&mut request).await;
            });
        }
    });
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(1, simple_config(port, address, ""))
        .await
        .unwrap();
    assert_eq!(get(port, "/x").await, (200, "hello".to_string()));
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn retries_on_configured_status_only_for_idempotent_requests() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let flaky = spawn_upstream(move |_| {
        let counter = counter.clone();
        async move {
            // Every other call fails.
            if counter.fetch_add(1, Ordering::Relaxed).is_multiple_of(2) {
                let mut response = text("busy");
                *response.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
                response
            } else {
                text("ok")
            }
        }
    })
    .await;
    let port = free_port();
    let config = simple_config(port, flaky, "retry: {attempts: 1, onStatus: [503]}");
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();
    assert_eq!(get(port, "/x").await, (200, "ok".to_string()));
    assert_eq!(calls.load(Ordering::Relaxed), 2, "one retry");
    let request = Request::post(format!("http://127.0.0.1:{port}/x"))
        .body(http_body_util::Full::default())
        .unwrap();
    let response = http1_client().request(request).await.unwrap();
    assert_eq!(
        response.status(),
        503,
        "a POST that reached the upstream is not retried"
    );
    assert_eq!(calls.load(Ordering::Relaxed), 3);
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn moving_a_listener_to_another_address_on_the_same_port_applies() {
    let upstream = path_echo().await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(1, simple_config(port, upstream, ""))
        .await
        .unwrap();
    assert_eq!(get(port, "/x").await.0, 200);
    let moved = format!("apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: web}}\nspec: {{address: 0.0.0.0, port: {port}}}\n---\n");
    let config = objects(&(moved + &backend("up", upstream, false) + &route("all", "web", "up", "")));
    proxy.state.apply(2, config).await.unwrap();
    assert_eq!(get(port, "/x").await.0, 200);
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_policy_on_a_listener_and_its_route_runs_once_and_each_target_has_its_buckets() {
    let upstream = path_echo().await;
    let port = free_port();
    let policy = "apiVersion: portcullis.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: two}\nspec: {targetRefs: [{kind: Listener, name: web}, {kind: Route, name: a}, {kind: Route, name: b}], requestsPerSecond: 0.01, burst: 2}\n---\n";
    let other_port = free_port();
    let other = format!("apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: other}}\nspec: {{address: 127.0.0.1, port: {other_port}}}\n---\n");
    let config = objects(
        &(listener("web", port)
            + &other
            + &backend("up", upstream, false)
            + &route("a", "web", "up", "matches: [{path: {prefix: /a}}]")
            + "apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {name: b}\nspec: {listeners: [other], backends: [{name: up}]}\n---\n"
            + policy),
    );
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();
    // Route a is on the limited listener: the policy decides once per request, not twice.
    assert_eq!(get(port, "/a").await.0, 200);
    assert_eq!(get(port, "/a").await.0, 200);
    assert_eq!(get(port, "/a").await.0, 429);
    let (_, metrics) = get(proxy.admin_addr().port(), "/metrics").await;
    let decisions = |decision: &str| {
        metrics
            .lines()
            .find(|line| {
                line.starts_with("portcullis_proxy_policy_decisions_total{")
                    && line.contains(&format!("decision=\"{decision}\""))
            })
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|count| count.parse::<u64>().ok())
    };
    assert_eq!(decisions("allow"), Some(2), "{metrics}");
    assert_eq!(decisions("deny"), Some(1), "{metrics}");
    // Route b, on the other listener, has buckets of its own, still full.
    assert_eq!(get(other_port, "/b").await.0, 200);
    assert_eq!(get(other_port, "/b").await.0, 200);
    assert_eq!(get(other_port, "/b").await.0, 429);
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn retargeting_a_rate_limit_keeps_the_buckets_of_the_targets_it_still_has() {
    let upstream = path_echo().await;
    let port = free_port();
    let config = |targets: &str| {
        objects(
            &(listener("web", port)
                + &backend("up", upstream, false)
                + &route("a", "web", "up", "matches: [{path: {prefix: /a}}]")
                + &route("b", "web", "up", "matches: [{path: {prefix: /b}}]")
                + &format!("apiVersion: portcullis.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: limit}}\nspec: {{targetRefs: [{targets}], requestsPerSecond: 0.01, burst: 2}}\n")),
        )
    };
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(1, config("{kind: Route, name: a}"))
        .await
        .unwrap();
    assert_eq!(get(port, "/a").await.0, 200);
    assert_eq!(get(port, "/a").await.0, 200);
    assert_eq!(get(port, "/a").await.0, 429);
    // Attached to b as well: a's bucket stays empty, b starts with a full one of its own.
    proxy
        .state
        .apply(2, config("{kind: Route, name: a}, {kind: Route, name: b}"))
        .await
        .unwrap();
    assert_eq!(get(port, "/a").await.0, 429);
    assert_eq!(get(port, "/b").await.0, 200);
    // Detached from a: b's bucket is kept, a is no longer limited.
    proxy
        .state
        .apply(3, config("{kind: Route, name: b}"))
        .await
        .unwrap();
    assert_eq!(get(port, "/b").await.0, 200);
    assert_eq!(get(port, "/b").await.0, 429);
    assert_eq!(get(port, "/a").await.0, 200);
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_client_that_breaks_off_its_upload_is_not_counted_against_the_upstream() {
    let upstream = spawn_upstream(|request: Request<hyper::body::Incoming>| async move {
        let _ = http_body_util::BodyExt::collect(request.into_body()).await;
        text("read")
    })
    .await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(1, simple_config(port, upstream, ""))
        .await
        .unwrap();
    // 100 KiB declared, too big to replay, so it streams; the client leaves after 1 KiB.
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream
        .write_all(b"POST / HTTP/1.1\r\nhost: h\r\ncontent-length: 102400\r\n\r\n")
        .await
        .unwrap();
    stream.write_all(&[b'x'; 1024]).await.unwrap();
    drop(stream);
    // Once its request is on record (as 400 or 499, whichever the proxy noticed first),
    // no upstream error may have been counted for it.
    let admin = proxy.admin_addr().port();
    eventually("the abandoned request's record", || async move {
        get(admin, "/metrics")
            .await
            .1
            .contains("portcullis_proxy_requests_total{")
    })
    .await;
    let (_, metrics) = get(proxy.admin_addr().port(), "/metrics").await;
    assert!(
        !metrics.contains("portcullis_proxy_upstream_errors_total{"),
        "{metrics}"
    );
    assert_eq!(get(port, "/still-serving").await.0, 200);
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn clients_cannot_strip_or_smuggle_the_headers_the_proxy_vouches_for() {
    let upstream = path_echo().await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(1, simple_config(port, upstream, ""))
        .await
        .unwrap();
    // `Connection` naming X-Forwarded-For must not remove what the proxy sets.
    let answer = raw(
        port,
        b"GET /x HTTP/1.1\r\nhost: h\r\nconnection: close, x-forwarded-for, host\r\nx-forwarded-for: 6.6.6.6\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("xff=127.0.0.1\n"), "{answer}");
    // Two Host headers, user info, or a path in Host: refused before routing.
    for request in [
        &b"GET /x HTTP/1.1\r\nhost: a.example\r\nhost: b.example\r\nconnection: close\r\n\r\n"[..],
        b"GET http://user:pw@h/x HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n",
        b"GET /x HTTP/1.1\r\nhost: evil.com/x.example.com\r\nconnection: close\r\n\r\n",
        b"GET /public/%5c../admin HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n",
        b"GET /x HTTP/1.1\r\nhost: [x]evil.com\r\nconnection: close\r\n\r\n",
        b"GET /x HTTP/1.1\r\nhost: h:abc\r\nconnection: close\r\n\r\n",
    ] {
        let answer = raw(port, request).await;
        assert!(
            answer.starts_with("HTTP/1.1 400"),
            "{}: {answer}",
            String::from_utf8_lossy(request)
        );
        assert!(!answer.contains("xff="), "nothing was forwarded: {answer}");
    }
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_response_body_that_stalls_is_cut_after_the_idle_timeout() {
    let upstream = spawn_upstream(|_request| async {
        // One chunk, then silence for longer than the route allows.
        let chunks = futures::stream::unfold(0, |sent| async move {
            match sent {
                0 => Some((
                    Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(bytes::Bytes::from("first"))),
                    1,
                )),
                _ => {
                    tokio::time::sleep(Duration::from_secs(300)).await;
                    None
                }
            }
        });
        http::Response::new(http_body_util::BodyExt::boxed(http_body_util::StreamBody::new(
            chunks,
        )))
    })
    .await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(
            1,
            simple_config(port, upstream, "limits: {bodyIdleTimeout: 300ms}"),
        )
        .await
        .unwrap();
    let response = http1_client()
        .request(
            Request::get(format!("http://127.0.0.1:{port}/stream"))
                .body(http_body_util::Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let first = http_body_util::BodyExt::frame(&mut body).await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), "first");
    // The stream ends in an error (the proxy cut it), long before the upstream's 300 s.
    let rest = tokio::time::timeout(Duration::from_secs(60), http_body_util::BodyExt::collect(body)).await;
    assert!(matches!(rest, Ok(Err(_))), "the stalled body was not cut");
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_upload_that_stalls_longer_than_the_idle_timeout_is_answered_408() {
    let upstream = spawn_upstream(|request: Request<hyper::body::Incoming>| async move {
        let _ = http_body_util::BodyExt::collect(request.into_body()).await;
        text("read")
    })
    .await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(
            1,
            simple_config(port, upstream, "timeout: 5s, limits: {bodyIdleTimeout: 300ms}"),
        )
        .await
        .unwrap();
    // Too large to replay, so it streams; the client stops after 1 KiB and waits.
    let mut stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream
        .write_all(b"POST / HTTP/1.1\r\nhost: h\r\ncontent-length: 102400\r\n\r\n")
        .await
        .unwrap();
    stream.write_all(&[b'x'; 1024]).await.unwrap();
    let mut answer = vec![0; 1024];
    let read = tokio::time::timeout(Duration::from_secs(20), stream.read(&mut answer))
        .await
        .unwrap()
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..read]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    let (_, metrics) = get(proxy.admin_addr().port(), "/metrics").await;
    assert!(
        !metrics.contains("portcullis_proxy_upstream_errors_total{"),
        "{metrics}"
    );
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn one_listener_split_into_two_on_the_same_port_serves_on_both() {
    let upstream = path_echo().await;
    let port = free_port();
    let listener_at = |name: &str, address: &str| {
        format!("apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: {name}}}\nspec: {{address: {address}, port: {port}}}\n---\n")
    };
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    let wide =
        listener_at("web", "0.0.0.0") + &backend("up", upstream, false) + &route("all", "web", "up", "");
    proxy.state.apply(1, objects(&wide)).await.unwrap();
    let split = listener_at("web", "127.0.0.1")
        + &listener_at("web-2", "127.0.0.2")
        + &backend("up", upstream, false)
        + "apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {name: all}\nspec: {listeners: [web, web-2], backends: [{name: up}]}\n";
    proxy.state.apply(2, objects(&split)).await.unwrap();
    assert_eq!(get(port, "/x").await.0, 200);
    let mut stream = TcpStream::connect(("127.0.0.2", port)).await.unwrap();
    stream
        .write_all(b"GET /x HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    proxy.shutdown().await.unwrap();
}

/// Over HTTP/2 a client stops reading by granting no flow-control window: the socket never
/// blocks, so only the proxy's watch on what its response bodies wait for can end it.
#[tokio::test]
async fn an_http2_client_granting_no_window_is_disconnected_after_the_write_timeout() {
    let upstream = spawn_upstream(|_request| async { text("hello") }).await;
    let port = free_port();
    let listener = format!("apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: web}}\nspec: {{address: 127.0.0.1, port: {port}, limits: {{maxConnections: 1, writeTimeout: 300ms}}}}\n---\n");
    let config = objects(&(listener + &backend("up", upstream, false) + &route("all", "web", "up", "")));
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();
    let stingy = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .http2_initial_stream_window_size(0)
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let request = Request::get(format!("http://127.0.0.1:{port}/stuck"))
        .body(http_body_util::Full::default())
        .unwrap();
    // The headers need no window; the body, held unread, never gets any.
    let response = stingy.request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    // Until the proxy gives up on it, the stingy client holds the only connection slot.
    eventually("the stingy client's slot given back", || async {
        try_status(port, "/small").await == Some(200)
    })
    .await;
    drop(response);
    proxy.shutdown().await.unwrap();
}

/// An idle HTTP/2 connection whose client answers pings would otherwise hold its connection
/// slot for ever; one with a stream open, however long, is not idle.
#[tokio::test]
async fn an_http2_connection_without_streams_is_closed_after_the_idle_timeout() {
    let upstream = spawn_upstream(|request: Request<hyper::body::Incoming>| async move {
        if request.uri().path() == "/slow" {
            tokio::time::sleep(Duration::from_millis(1_000)).await;
        }
        text("done")
    })
    .await;
    let port = free_port();
    let listener = format!("apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: web}}\nspec: {{address: 127.0.0.1, port: {port}, limits: {{maxConnections: 1, http2IdleTimeout: 300ms}}}}\n---\n");
    let config = objects(&(listener + &backend("up", upstream, false) + &route("all", "web", "up", "")));
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();
    let stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    let connection = tokio::spawn(connection);
    let request = Request::get(format!("http://127.0.0.1:{port}/slow"))
        .version(http::Version::HTTP_2)
        .body(http_body_util::Full::<bytes::Bytes>::default())
        .unwrap();
    // Open for three idle timeouts: answered, not cut.
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap();
    assert_eq!(body.to_bytes(), "done");
    // Then idle: the proxy sends GOAWAY and closes, which ends the client's connection
    // cleanly and gives the only slot back.
    let ended = tokio::time::timeout(Duration::from_secs(10), connection).await;
    assert!(matches!(ended, Ok(Ok(Ok(())))), "{ended:?}");
    // The client may be gone before the proxy's side has seen it go.
    eventually("the idle connection's slot given back", || async {
        try_status(port, "/fast").await == Some(200)
    })
    .await;
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_client_that_stops_reading_is_disconnected_after_the_write_timeout() {
    // 32 MiB: far more than the socket buffers between the proxy and a client not reading.
    let upstream = spawn_upstream(|_request| async { text(vec![b'x'; 32 * 1024 * 1024]) }).await;
    let port = free_port();
    let listener = format!("apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: web}}\nspec: {{address: 127.0.0.1, port: {port}, limits: {{maxConnections: 1, writeTimeout: 300ms}}}}\n---\n");
    let config = objects(&(listener + &backend("up", upstream, false) + &route("all", "web", "up", "")));
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();
    let mut stuck = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stuck
        .write_all(b"GET /big HTTP/1.1\r\nhost: h\r\n\r\n")
        .await
        .unwrap();
    // The stuck client holds the only connection slot until the write timeout
    // disconnects it; without that, every later request would get 503 for ever.
    eventually("the stuck client's slot given back", || async {
        try_status(port, "/small").await == Some(200)
    })
    .await;
    drop(stuck);
    proxy.shutdown().await.unwrap();
}
