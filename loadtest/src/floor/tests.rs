use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::*;

const ENGINES: [Engine; 2] = [Engine::OnePass, Engine::Hyper];

/// Sends `request` and reads until the forwarder closes the connection.
async fn exchange(address: SocketAddr, request: &[u8]) -> String {
    let talk = async {
        let mut stream = TcpStream::connect(address).await.unwrap();
        stream.write_all(request).await.unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.unwrap();
        String::from_utf8(answer).unwrap()
    };
    tokio::time::timeout(Duration::from_secs(10), talk)
        .await
        .expect("the forwarder neither answered nor closed")
}

fn forwarder(engine: Engine, upstream: SocketAddr) -> SocketAddr {
    start(&FloorArgs {
        listen: "127.0.0.1:0".parse().unwrap(),
        upstream,
        engine,
        threads: 2,
    })
    .unwrap()
}

async fn echo_origin() -> SocketAddr {
    let origin = crate::echo::bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let address = origin.local_addr().unwrap();
    tokio::spawn(crate::echo::serve(origin, "origin".to_string()));
    address
}

/// When a raw origin closes a connection, without saying so (as a server's idle timeout
/// does).
#[derive(Clone, Copy, PartialEq)]
enum Closes {
    Never,
    /// On reading a connection's second request, unanswered.
    AtTheSecondRequest,
}

/// An origin that hands the test every request head it reads, as sent, and answers each
/// with `answer`, closing connections as `closes` says.
async fn raw_origin(answer: &'static [u8], closes: Closes) -> (SocketAddr, UnboundedReceiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (heads, received) = unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let heads = heads.clone();
            tokio::spawn(async move {
                let mut buffer = Vec::new();
                let mut requests = 0;
                loop {
                    while let Some(end) = buffer.windows(4).position(|window| window == b"\r\n\r\n") {
                        let _ = heads.send(String::from_utf8_lossy(&buffer[..end]).into_owned());
                        buffer.drain(..end + 4);
                        requests += 1;
                        if closes == Closes::AtTheSecondRequest && requests == 2 {
                            return;
                        }
                        if stream.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                    if stream.read_buf(&mut buffer).await.unwrap_or(0) == 0 {
                        return;
                    }
                }
            });
        }
    });
    (address, received)
}

#[tokio::test]
async fn each_engine_forwards_requests_and_bodies_on_one_upstream_connection() {
    let origin = echo_origin().await;
    for engine in ENGINES {
        // Two requests on one connection; the second closes it so that the answer ends.
        let answer = exchange(
            forwarder(engine, origin),
            b"POST /first HTTP/1.1\r\nhost: test\r\ncontent-length: 5\r\n\r\nhello\
              GET /second HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n",
        )
        .await;
        let bodies: Vec<serde_json::Value> = answer
            .split("\r\n\r\n")
            .filter_map(|part| part.lines().next())
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect();
        assert_eq!(bodies.len(), 2, "{engine:?}: {answer}");
        assert_eq!(bodies[0]["uri"], "/first", "{engine:?}");
        assert_eq!(bodies[0]["body"], "hello", "{engine:?}");
        assert_eq!(bodies[1]["uri"], "/second", "{engine:?}");
        // The origin saw both on one connection: the pool gave it back and took it again.
        assert_eq!(bodies[0]["peer"], bodies[1]["peer"], "{engine:?}");
    }
}

#[tokio::test]
async fn each_engine_replaces_forwarded_for_and_drops_hop_by_hop_headers() {
    for engine in ENGINES {
        let (origin, mut heads) =
            raw_origin(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", Closes::Never).await;
        let answer = exchange(
            forwarder(engine, origin),
            b"GET / HTTP/1.1\r\nhost: test\r\nx-forwarded-for: 10.9.9.9\r\nkeep-alive: timeout=5\r\nconnection: close\r\n\r\n",
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{engine:?}: {answer}");
        let head = tokio::time::timeout(Duration::from_secs(10), heads.recv())
            .await
            .expect("the origin got no request")
            .unwrap()
            .to_ascii_lowercase();
        assert!(head.contains("x-forwarded-for: 127.0.0.1"), "{engine:?}: {head}");
        assert!(!head.contains("10.9.9.9"), "{engine:?}: {head}");
        assert!(!head.contains("keep-alive"), "{engine:?}: {head}");
        assert!(!head.contains("connection"), "{engine:?}: {head}");
    }
}

/// Sends `requests` one after another on one connection; the answers, as read.
async fn one_by_one(floor: SocketAddr, requests: &[&[u8]]) -> String {
    let mut stream = TcpStream::connect(floor).await.unwrap();
    let mut answers = String::new();
    for request in requests {
        stream.write_all(request).await.unwrap();
        let mut answer = [0; 1024];
        let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut answer))
            .await
            .expect("no answer")
            .unwrap();
        answers.push_str(&String::from_utf8_lossy(&answer[..read]));
    }
    answers
}

/// Sends `request` twice on one connection through a one-pass forwarder of its own (so that
/// its pool holds no connection from another test) to an origin that closes each upstream
/// connection at its second request, unanswered.
async fn twice_through_an_origin_closing_at_the_second_request(request: &[u8]) -> String {
    let (origin, _heads) = raw_origin(
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
        Closes::AtTheSecondRequest,
    )
    .await;
    one_by_one(forwarder(Engine::OnePass, origin), &[request, request]).await
}

#[tokio::test]
async fn one_pass_sends_an_idempotent_request_again_when_a_reused_connection_closes_under_it() {
    let answers =
        twice_through_an_origin_closing_at_the_second_request(b"GET / HTTP/1.1\r\nhost: test\r\n\r\n").await;
    assert_eq!(answers.matches("HTTP/1.1 200 OK\r\n").count(), 2, "{answers}");

    // The origin may have acted on a POST it did not answer: it is not sent twice.
    let answers = twice_through_an_origin_closing_at_the_second_request(
        b"POST / HTTP/1.1\r\nhost: test\r\ncontent-length: 0\r\n\r\n",
    )
    .await;
    assert!(answers.starts_with("HTTP/1.1 200 OK\r\n"), "{answers}");
    assert!(answers.contains("HTTP/1.1 502 "), "{answers}");
}

#[tokio::test]
async fn one_pass_refuses_what_it_cannot_frame_instead_of_misframing_it() {
    let origin = echo_origin().await;
    let floor = forwarder(Engine::OnePass, origin);
    for request in [
        &b"POST / HTTP/1.1\r\nhost: test\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"[..],
        b"POST / HTTP/1.1\r\nhost: test\r\ncontent-length: 99999999999999999999999\r\n\r\n",
        b"POST / HTTP/1.1\r\nhost: test\r\ncontent-length: +5\r\n\r\nhello",
    ] {
        let answer = exchange(floor, request).await;
        assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
        assert!(!answer.contains("origin"), "forwarded: {answer}");
    }

    // A response whose body runs to the connection's close.
    let (origin, _heads) = raw_origin(b"HTTP/1.1 200 OK\r\n\r\nunframed", Closes::Never).await;
    let answer = exchange(
        forwarder(Engine::OnePass, origin),
        b"GET / HTTP/1.1\r\nhost: test\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 502 "), "{answer}");
    assert!(!answer.contains("unframed"), "{answer}");
}
