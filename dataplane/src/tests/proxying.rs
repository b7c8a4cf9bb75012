use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http::{Request, Version};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::support::*;

/// Echoes what the upstream saw, one `key=value` per line.
async fn echo_upstream() -> std::net::SocketAddr {
    spawn_upstream(|request: Request<hyper::body::Incoming>| async move {
        let header = |name: &str| {
            request
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-")
                .to_string()
        };
        let summary = format!(
            "version={:?}\nmethod={}\npath={}\nauthority={}\nhost={}\nxff={}\nxfp={}\nconnection-named={}\n",
            request.version(),
            request.method(),
            request
                .uri()
                .path_and_query()
                .map(|pq| pq.as_str())
                .unwrap_or("-"),
            request.uri().authority().map_or("-", |a| a.as_str()),
            header("host"),
            header("x-forwarded-for"),
            header("x-forwarded-proto"),
            header("x-drop-me"),
        );
        let body = request.into_body().collect().await.unwrap().to_bytes();
        text(format!("{summary}body={}", String::from_utf8_lossy(&body)))
    })
    .await
}

#[tokio::test]
async fn proxies_http1_and_http2_clients_to_http1_and_http2_upstreams() {
    let upstream = echo_upstream().await;
    let port = free_port();
    let config = objects(
        &(listener("web", port)
            + &backend("plain", upstream, false)
            + &backend("h2", upstream, true)
            + &route("to-h1", "web", "plain", "matches: [{path: {prefix: /h1}}]")
            + &route("to-h2", "web", "h2", "matches: [{path: {prefix: /h2}}]")),
    );
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();

    for (client, client_name) in [(http1_client(), "h1"), (http2_client(), "h2")] {
        for (path, upstream_version) in [("/h1/chat?x=1", "HTTP/1.1"), ("/h2/chat?x=1", "HTTP/2.0")] {
            // HTTP/1 carries the host in Host; HTTP/2 in :authority, which comes from the URI.
            let expected_host = match client_name {
                "h1" => "api.example.com".to_string(),
                _ => format!("127.0.0.1:{port}"),
            };
            let mut request = Request::post(format!("http://127.0.0.1:{port}{path}"));
            if client_name == "h1" {
                request = request.header("host", "api.example.com");
            }
            let request = request
                .header("connection", "x-drop-me")
                .header("x-drop-me", "1")
                .header("x-forwarded-for", "10.1.1.1")
                .body(Full::new(Bytes::from_static(b"hello")))
                .unwrap();
            let response = client.request(request).await.unwrap();
            assert_eq!(response.status(), 200, "{client_name} {path}");
            let body = response.into_body().collect().await.unwrap().to_bytes();
            let body = String::from_utf8(body.to_vec()).unwrap();
            assert!(
                body.contains(&format!("version={upstream_version}")),
                "{client_name} {path}: {body}"
            );
            assert!(body.contains("method=POST"), "{body}");
            assert!(body.contains(&format!("path={path}")), "{body}");
            assert!(body.contains("body=hello"), "{body}");
            // The client is not a trusted hop: its X-Forwarded-For is replaced.
            assert!(body.contains("xff=127.0.0.1\n"), "{body}");
            assert!(body.contains("xfp=http"), "{body}");
            assert!(body.contains("connection-named=-"), "{body}");
            // HTTP/1.1 upstreams get the client's host in Host; HTTP/2 upstreams in
            // :authority, with no Host beside it to disagree (RFC 9113 §8.3.1).
            let (authority, host) = match upstream_version {
                "HTTP/2.0" => (expected_host.as_str(), "-"),
                _ => ("-", expected_host.as_str()),
            };
            assert!(
                body.contains(&format!("authority={authority}\nhost={host}\n")),
                "{client_name} {path}: {body}"
            );
        }
    }
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_upstream_sees_the_host_the_route_was_chosen_by() {
    let upstream = echo_upstream().await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(1, simple_config(port, upstream, "hostnames: [public.example]"))
        .await
        .unwrap();

    // HTTP/1 absolute form: the target's host wins over the Host header (RFC 9112 §3.2.2).
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let head = "GET http://public.example/x HTTP/1.1\r\nHost: admin.internal\r\nConnection: close\r\n\r\n";
    tokio::io::AsyncWriteExt::write_all(&mut stream, head.as_bytes())
        .await
        .unwrap();
    let mut answer = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut stream, &mut answer)
        .await
        .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("host=public.example\n"), "{answer}");

    // HTTP/2 with a Host header naming another host than :authority is malformed.
    let request = Request::get(format!("http://127.0.0.1:{port}/x"))
        .header("host", "admin.internal")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = http2_client().request(request).await.unwrap();
    assert_eq!(response.status(), 400);
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn http2_authority_reaches_the_upstream_as_host() {
    let upstream = echo_upstream().await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(1, simple_config(port, upstream, "hostnames: [api.example.com]"))
        .await
        .unwrap();
    // HTTP/2 carries the host in :authority only, which the proxy must route on and keep.
    let (sender, connection) = {
        let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await
        .unwrap()
    };
    tokio::spawn(connection);
    let mut sender = sender;
    let request = Request::get("http://api.example.com:8443/models")
        .version(Version::HTTP_2)
        .body(Full::<Bytes>::default())
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8(body.to_vec()).unwrap();
    assert!(body.contains("host=api.example.com:8443"), "{body}");
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn server_sent_events_reach_the_client_one_by_one() {
    let (streams_tx, mut streams_rx) = mpsc::channel::<mpsc::Sender<Bytes>>(1);
    let upstream = spawn_upstream(move |_request| {
        let streams_tx = streams_tx.clone();
        async move {
            let (events_tx, events_rx) = mpsc::channel::<Bytes>(4);
            streams_tx.send(events_tx).await.unwrap();
            let body = StreamBody::new(ReceiverStream::new(events_rx).map(|event| Ok(Frame::data(event))));
            let mut response = http::Response::new(http_body_util::BodyExt::boxed(body));
            response.headers_mut().insert(
                "content-type",
                http::HeaderValue::from_static("text/event-stream"),
            );
            response
        }
    })
    .await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(1, simple_config(port, upstream, "timeout: 1s"))
        .await
        .unwrap();

    for client in [http1_client(), http2_client()] {
        let request = Request::get(format!("http://127.0.0.1:{port}/v1/stream"))
            .body(Full::default())
            .unwrap();
        // Spawned: the client only sends the request while its future is polled.
        let response = tokio::spawn(client.request(request));
        let events = streams_rx.recv().await.unwrap();
        events.send(Bytes::from_static(b"data: one\n\n")).await.unwrap();
        let response = response.await.unwrap().unwrap();
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        let mut body = response.into_body();
        let first = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .expect("event 1 must arrive while the upstream still holds event 2")
            .unwrap()
            .unwrap();
        assert_eq!(first.into_data().unwrap(), "data: one\n\n");
        // Longer than the route timeout: it limits the response headers, not the stream.
        tokio::time::sleep(Duration::from_millis(1200)).await;
        events.send(Bytes::from_static(b"data: two\n\n")).await.unwrap();
        drop(events);
        let rest = body.collect().await.unwrap().to_bytes();
        assert_eq!(rest, "data: two\n\n");
    }
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn errors_are_json_with_404_502_and_504() {
    let slow = spawn_upstream(|_request| async {
        tokio::time::sleep(Duration::from_secs(3)).await;
        text("late")
    })
    .await;
    let dead: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let port = free_port();
    let config = objects(
        &(listener("web", port)
            + &backend("slow", slow, false)
            + &backend("dead", dead, false)
            + &route(
                "slow",
                "web",
                "slow",
                "timeout: 200ms, matches: [{path: {prefix: /slow}}]",
            )
            + &route("dead", "web", "dead", "matches: [{path: {prefix: /dead}}]")),
    );
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy.state.apply(1, config).await.unwrap();

    for (path, status, kind) in [
        ("/nowhere", 404, "route_not_found"),
        ("/dead", 502, "upstream_connect_error"),
        ("/slow", 504, "upstream_timeout"),
    ] {
        let (actual, body) = get(port, path).await;
        assert_eq!(actual, status, "{path}: {body}");
        let error: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(error["error"]["type"], kind, "{body}");
        assert!(
            error["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{body}"
        );
    }
    proxy.shutdown().await.unwrap();
}
