//! The pool against a plain TCP server that records what reaches it.

use std::future::Future;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

use super::*;
use crate::body;

/// An upstream that answers every request `ok`. `/hold` gets its head at once and its body
/// when the test releases it; `/last` is answered and then the connection closed, with no
/// `Connection: close` to warn the client; `/empty` gets a 204; `/trailers` a chunked `ok`
/// with a trailer.
struct Upstream {
    address: std::net::SocketAddr,
    /// Request heads, each with the number of the connection it came on.
    heads: Arc<Mutex<Vec<(usize, String)>>>,
    accepted: watch::Receiver<usize>,
    /// Connections the client closed.
    closed: watch::Receiver<usize>,
    release: Arc<Semaphore>,
}

impl Upstream {
    async fn start() -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let (accepts, accepted) = watch::channel(0);
        let (closes, closed) = watch::channel(0);
        let release = Arc::new(Semaphore::new(0));
        let (recorded, holds, closes) = (heads.clone(), release.clone(), Arc::new(closes));
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                accepts.send_modify(|count| *count += 1);
                let number = *accepts.borrow();
                tokio::spawn(serve(
                    stream,
                    number,
                    recorded.clone(),
                    holds.clone(),
                    closes.clone(),
                ));
            }
        });
        Upstream {
            address,
            heads,
            accepted,
            closed,
            release,
        }
    }

    fn uri(&self, path: &str) -> String {
        format!("http://{}{path}", self.address)
    }

    fn accepted(&self) -> usize {
        *self.accepted.borrow()
    }

    fn heads(&self) -> Vec<(usize, String)> {
        self.heads.lock().unwrap().clone()
    }
}

async fn serve(
    mut stream: TcpStream,
    number: usize,
    heads: Arc<Mutex<Vec<(usize, String)>>>,
    release: Arc<Semaphore>,
    closes: Arc<watch::Sender<usize>>,
) {
    let mut buffer = Vec::new();
    loop {
        let end = loop {
            if let Some(end) = buffer.windows(4).position(|window| window == b"\r\n\r\n") {
                break end + 4;
            }
            let mut chunk = [0; 1024];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => {
                    closes.send_modify(|count| *count += 1);
                    return;
                }
                Ok(read) => buffer.extend_from_slice(&chunk[..read]),
            }
        };
        let head = String::from_utf8(buffer.drain(..end).collect()).unwrap();
        heads.lock().unwrap().push((number, head.clone()));
        let path = head.split(' ').nth(1).unwrap_or_default().to_string();
        if path == "/trailers" {
            stream
                .write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-sum\r\n\r\n2\r\nok\r\n0\r\nx-sum: 1\r\n\r\n")
                .await
                .unwrap();
            continue;
        }
        if path == "/empty" {
            stream
                .write_all(b"HTTP/1.1 204 No Content\r\n\r\n")
                .await
                .unwrap();
            continue;
        }
        stream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
            .await
            .unwrap();
        if path == "/hold" {
            release.acquire().await.unwrap().forget();
        }
        stream.write_all(b"ok").await.unwrap();
        if path == "/last" {
            return;
        }
    }
}

/// A client of its own, with its own connections.
fn client() -> Http1 {
    super::super::tls::default_http1()
}

async fn get(client: &Http1, uri: &str, host: Option<&str>) -> Response<Http1Body> {
    let mut request = Request::get(uri);
    if let Some(host) = host {
        request = request.header(HOST, host);
    }
    client
        .request(request.body(body::empty()).unwrap())
        .await
        .unwrap()
}

async fn read_to_end(response: Response<Http1Body>) -> Bytes {
    response.into_body().collect().await.unwrap().to_bytes()
}

fn key(client: &Http1, upstream: &Upstream) -> Key {
    Key {
        connector: Arc::as_ptr(&client.connector) as usize,
        scheme: Scheme::HTTP,
        authority: Authority::try_from(upstream.address.to_string().as_str()).unwrap(),
    }
}

/// Connections to `upstream` idle in this thread's pool for `client`.
fn idle(client: &Http1, upstream: &Upstream) -> usize {
    POOLS.with_borrow(|pools| {
        pools
            .buckets
            .get(&key(client, upstream))
            .map_or(0, |bucket| bucket.idle.len())
    })
}

/// Waits, for a bounded time, until the client has closed `count` connections to `upstream`.
async fn closed(upstream: &Upstream, count: usize) {
    let mut closed = upstream.closed.clone();
    tokio::time::timeout(
        Duration::from_secs(10),
        closed.wait_for(|closed| *closed >= count),
    )
    .await
    .expect("connections closed in time")
    .unwrap();
}

#[tokio::test]
async fn requests_in_turn_share_a_connection_and_name_the_path_and_host() {
    let upstream = Upstream::start().await;
    let client = client();
    assert_eq!(
        read_to_end(get(&client, &upstream.uri("/a?b=1"), None).await).await,
        "ok"
    );
    assert_eq!(
        read_to_end(get(&client, &upstream.uri("/c"), Some("example.test")).await).await,
        "ok"
    );
    let heads = upstream.heads();
    let port = upstream.address.port();
    assert!(
        heads[0].1.starts_with("GET /a?b=1 HTTP/1.1\r\n"),
        "origin form: {:?}",
        heads[0].1
    );
    assert!(
        heads[0].1.contains(&format!("\r\nhost: 127.0.0.1:{port}\r\n")),
        "the URI's authority as Host when the request had none: {:?}",
        heads[0].1
    );
    assert!(
        heads[1].1.contains("\r\nhost: example.test\r\n"),
        "{:?}",
        heads[1].1
    );
    assert_eq!(
        heads
            .iter()
            .map(|(connection, _)| *connection)
            .collect::<Vec<_>>(),
        [1, 1]
    );
    assert_eq!(upstream.accepted(), 1);
}

#[tokio::test]
async fn a_connection_still_streaming_is_not_shared_and_serves_again_once_its_response_ends() {
    let upstream = Upstream::start().await;
    let client = client();
    let held = get(&client, &upstream.uri("/hold"), None).await;
    assert_eq!(
        read_to_end(get(&client, &upstream.uri("/a"), None).await).await,
        "ok"
    );
    assert_eq!(
        upstream.accepted(),
        2,
        "the busy connection was not given the second request"
    );
    upstream.release.add_permits(1);
    assert_eq!(read_to_end(held).await, "ok");
    for _ in 0..3 {
        assert_eq!(
            read_to_end(get(&client, &upstream.uri("/a"), None).await).await,
            "ok"
        );
    }
    assert_eq!(upstream.accepted(), 2, "the connections were reused");
}

#[tokio::test]
async fn a_response_dropped_before_its_end_takes_its_connection_with_it() {
    let upstream = Upstream::start().await;
    let client = client();
    drop(get(&client, &upstream.uri("/empty"), None).await);
    assert_eq!(
        read_to_end(get(&client, &upstream.uri("/a"), None).await).await,
        "ok"
    );
    assert_eq!(
        upstream.accepted(),
        1,
        "a response without content ended at its head"
    );

    let unread = get(&client, &upstream.uri("/hold"), None).await;
    upstream.release.add_permits(1);
    drop(unread);
    assert_eq!(idle(&client, &upstream), 0, "not given back");
    assert_eq!(
        read_to_end(get(&client, &upstream.uri("/a"), None).await).await,
        "ok"
    );
    assert_eq!(
        upstream.accepted(),
        2,
        "a connection with a response half read is not reused"
    );
}

#[tokio::test]
async fn a_connection_the_upstream_closed_while_idle_is_not_the_end_of_the_next_request() {
    let upstream = Upstream::start().await;
    let client = client();
    assert_eq!(
        read_to_end(get(&client, &upstream.uri("/last"), None).await).await,
        "ok"
    );
    assert_eq!(
        read_to_end(get(&client, &upstream.uri("/a"), None).await).await,
        "ok"
    );
    assert_eq!(upstream.accepted(), 2);
}

#[tokio::test]
async fn a_request_that_comes_back_unsent_goes_out_again_on_a_new_connection() {
    let upstream = Upstream::start().await;
    let client = client();
    // A connection the test drives itself, so it can end it between the request's checkout
    // and its sending, as an upstream's close would.
    let stream = TcpStream::connect(upstream.address).await.unwrap();
    let (mut sender, mut connection) = http1::handshake::<_, Body>(hyper_util::rt::TokioIo::new(stream))
        .await
        .unwrap();
    std::future::poll_fn(|cx| {
        let _ = Pin::new(&mut connection).poll(cx);
        sender.poll_ready(cx)
    })
    .await
    .unwrap();
    checkin(Returning {
        key: key(&client, &upstream),
        owner: Arc::downgrade(&client.connector),
        connection: Pooled {
            sender,
            idleness: Arc::new(Idleness::in_use()),
        },
    });
    assert_eq!(idle(&client, &upstream), 1);
    let request = Request::get(upstream.uri("/a")).body(body::empty()).unwrap();
    let mut response = std::pin::pin!(client.request(request));
    assert!(
        futures::poll!(response.as_mut()).is_pending(),
        "sent on the pooled connection, which the test has not driven"
    );
    drop(connection);
    assert_eq!(read_to_end(response.await.unwrap()).await, "ok");
    let heads = upstream.heads();
    assert_eq!(heads.len(), 1, "{heads:?}");
    assert_eq!(
        heads[0].0, 2,
        "the request went out on the connection opened for it"
    );
}

#[tokio::test]
async fn a_connection_idle_for_the_timeout_is_closed_and_one_in_use_is_not() {
    let upstream = Upstream::start().await;
    let mut client = client();
    client.idle_timeout = Duration::from_millis(200);
    let held = get(&client, &upstream.uri("/hold"), None).await;
    assert_eq!(
        read_to_end(get(&client, &upstream.uri("/a"), None).await).await,
        "ok"
    );
    closed(&upstream, 1).await;
    // Time enough for several idle timeouts, on the clock the connections' tasks read.
    tokio::time::pause();
    tokio::time::advance(Duration::from_secs(1)).await;
    tokio::time::resume();
    upstream.release.add_permits(1);
    assert_eq!(read_to_end(held).await, "ok", "the connection in use stayed open");
    closed(&upstream, 2).await;
    assert_eq!(
        read_to_end(get(&client, &upstream.uri("/a"), None).await).await,
        "ok"
    );
    assert_eq!(upstream.accepted(), 3, "closed connections are not handed out");
}

#[tokio::test]
async fn a_response_with_trailers_gives_its_connection_back_at_them() {
    let upstream = Upstream::start().await;
    let client = client();
    let mut body = get(&client, &upstream.uri("/trailers"), None).await.into_body();
    // As hyper's server does: no read past the trailers.
    loop {
        let frame = body.frame().await.expect("a frame").unwrap();
        if let Some(trailers) = frame.trailers_ref() {
            assert_eq!(trailers["x-sum"], "1");
            break;
        }
    }
    drop(body);
    assert_eq!(
        read_to_end(get(&client, &upstream.uri("/a"), None).await).await,
        "ok"
    );
    assert_eq!(upstream.accepted(), 1);
}

#[tokio::test]
async fn connections_of_a_client_dropped_are_closed() {
    let upstream = Upstream::start().await;
    let dropped = client();
    assert_eq!(
        read_to_end(get(&dropped, &upstream.uri("/a"), None).await).await,
        "ok"
    );
    drop(dropped);
    POOLS.with_borrow_mut(|pools| {
        pools.next_sweep = None;
        pools.sweep_if_due(Instant::now());
    });
    closed(&upstream, 1).await;
    let other = client();
    assert_eq!(
        read_to_end(get(&other, &upstream.uri("/a"), None).await).await,
        "ok"
    );
    assert_eq!(upstream.accepted(), 2, "clients do not share connections");
}
