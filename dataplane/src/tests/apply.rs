use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use http::Request;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::support::*;

async fn hello_upstream() -> std::net::SocketAddr {
    spawn_upstream(|_request| async { text("hello") }).await
}

async fn refuses(port: u16) -> bool {
    tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err()
}

#[tokio::test]
async fn a_taken_port_rejects_the_version_and_the_previous_one_keeps_serving() {
    let upstream = hello_upstream().await;
    let (port, other_port) = (free_port(), free_port());
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(1, simple_config(port, upstream, ""))
        .await
        .unwrap();

    let squatter = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let taken = squatter.local_addr().unwrap().port();
    // "a-fresh" sorts first, so it is bound before the failure and must be released.
    let next = objects(
        &(listener("web", port)
            + &listener("a-fresh", other_port)
            + &listener("b-taken", taken)
            + &backend("up", upstream, false)
            + &route("all", "web, a-fresh, b-taken", "up", "")),
    );
    let error = proxy.state.apply(2, next).await.unwrap_err().to_string();
    assert!(
        error.contains(&format!("Listener/b-taken: cannot listen on 127.0.0.1:{taken}")),
        "{error}"
    );
    assert_eq!(proxy.state.current().version, Some(1));
    assert_eq!(get(port, "/").await, (200, "hello".to_string()));
    assert!(
        refuses(other_port).await,
        "a listener bound by the failed version was left open"
    );
    proxy.shutdown().await.unwrap();
}

/// A listener moving to an address someone else holds on its port: closing ours would not
/// free it, so the version is refused without touching the listener's open connections.
#[tokio::test]
async fn a_move_to_an_address_another_holds_leaves_the_listener_alone() {
    let upstream = hello_upstream().await;
    let squatter = std::net::TcpListener::bind(("127.0.0.2", 0)).unwrap();
    let port = squatter.local_addr().unwrap().port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(1, simple_config(port, upstream, ""))
        .await
        .unwrap();
    let client = http1_client();
    let ask = || {
        let request = Request::get(format!("http://127.0.0.1:{port}/"))
            .body(Full::default())
            .unwrap();
        client.request(request)
    };
    let (status, _) = status_and_text(ask().await.unwrap()).await;
    assert_eq!(status, 200);

    let moved = objects(
        &(format!("apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: web}}\nspec: {{address: 127.0.0.2, port: {port}}}\n---\n")
            + &backend("up", upstream, false)
            + &route("all", "web", "up", "")),
    );
    let error = proxy.state.apply(2, moved).await.unwrap_err().to_string();
    assert!(error.contains("cannot listen on 127.0.0.2"), "{error}");
    // The pooled keep-alive connection is still served: it was not drained.
    let (status, _) = status_and_text(ask().await.unwrap()).await;
    assert_eq!(status, 200);
    assert_eq!(proxy.state.current().version, Some(1));
    drop(squatter);
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn moved_and_removed_listeners_stop_accepting() {
    let upstream = hello_upstream().await;
    let (first, second) = (free_port(), free_port());
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(1, simple_config(first, upstream, ""))
        .await
        .unwrap();
    assert_eq!(get(first, "/").await.0, 200);

    proxy
        .state
        .apply(2, simple_config(second, upstream, ""))
        .await
        .unwrap();
    assert_eq!(get(second, "/").await.0, 200);
    assert!(refuses(first).await);

    let only_backend = objects(&backend("up", upstream, false));
    proxy.state.apply(3, only_backend).await.unwrap();
    assert!(refuses(second).await);
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn renaming_a_listener_keeps_its_socket() {
    let upstream = hello_upstream().await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(1)).await;
    proxy
        .state
        .apply(1, simple_config(port, upstream, ""))
        .await
        .unwrap();
    let renamed = objects(
        &(listener("renamed", port) + &backend("up", upstream, false) + &route("all", "renamed", "up", "")),
    );
    proxy.state.apply(2, renamed).await.unwrap();
    assert_eq!(get(port, "/").await, (200, "hello".to_string()));
    proxy.shutdown().await.unwrap();
}

#[tokio::test]
async fn shutdown_lets_an_in_flight_request_finish() {
    let (arrived_tx, mut arrived_rx) = mpsc::channel::<()>(1);
    let upstream = spawn_upstream(move |_request| {
        let arrived_tx = arrived_tx.clone();
        async move {
            arrived_tx.send(()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(500)).await;
            text("finished")
        }
    })
    .await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_secs(120)).await;
    proxy
        .state
        .apply(1, simple_config(port, upstream, ""))
        .await
        .unwrap();

    let admin_port = proxy.admin_addr().port();
    let in_flight = tokio::spawn(get(port, "/slow"));
    arrived_rx.recv().await.unwrap();
    let started = Instant::now();
    let shutdown = tokio::spawn(proxy.shutdown());
    eventually("the listener refusing new connections while draining", || {
        refuses(port)
    })
    .await;
    assert_eq!(
        get(admin_port, "/readyz").await,
        (503, "not ready: draining\n".to_string())
    );
    assert_eq!(in_flight.await.unwrap(), (200, "finished".to_string()));
    shutdown.await.unwrap().unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "waited for the whole grace period (120 s)"
    );
}

#[tokio::test]
async fn shutdown_closes_streams_still_open_after_the_grace_period() {
    let (streams_tx, mut streams_rx) = mpsc::channel::<mpsc::Sender<Bytes>>(1);
    let upstream = spawn_upstream(move |_request| {
        let streams_tx = streams_tx.clone();
        async move {
            let (events_tx, events_rx) = mpsc::channel::<Bytes>(1);
            streams_tx.send(events_tx).await.unwrap();
            let body = StreamBody::new(ReceiverStream::new(events_rx).map(|event| Ok(Frame::data(event))));
            http::Response::new(BodyExt::boxed(body))
        }
    })
    .await;
    let port = free_port();
    let proxy = start_proxy(None, Duration::from_millis(300)).await;
    proxy
        .state
        .apply(1, simple_config(port, upstream, ""))
        .await
        .unwrap();
    let request = Request::get(format!("http://127.0.0.1:{port}/"))
        .body(Full::<Bytes>::default())
        .unwrap();
    let response = http1_client().request(request).await.unwrap();
    let _endless = streams_rx.recv().await.unwrap();

    let started = Instant::now();
    proxy.shutdown().await.unwrap();
    // The stream is endless: only the grace (300 ms) can end the drain.
    assert!(started.elapsed() < Duration::from_secs(30));
    let outcome = tokio::time::timeout(Duration::from_secs(30), response.into_body().collect()).await;
    assert!(matches!(outcome, Ok(Err(_))), "the stream should have been cut");
}

#[tokio::test]
async fn a_restarted_proxy_serves_its_cached_config_without_the_control_plane() {
    let upstream = hello_upstream().await;
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let proxy = start_proxy(Some(dir.path().to_path_buf()), Duration::from_secs(1)).await;
    proxy
        .state
        .apply(4, simple_config(port, upstream, ""))
        .await
        .unwrap();
    proxy.shutdown().await.unwrap();
    assert!(refuses(port).await);

    let restarted = start_proxy(Some(dir.path().to_path_buf()), Duration::from_secs(1)).await;
    assert_eq!(restarted.state.current().version, Some(4));
    assert_eq!(get(port, "/").await, (200, "hello".to_string()));
    restarted.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_corrupt_cache_is_ignored() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config-cache.json"), b"\x00not json").unwrap();
    let proxy = start_proxy(Some(dir.path().to_path_buf()), Duration::from_secs(1)).await;
    assert_eq!(proxy.state.current().version, None);
    proxy.shutdown().await.unwrap();
}
