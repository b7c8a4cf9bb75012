//! A minimal HTTP/1.1 client and Prometheus text parser for the simulator's tests.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;

use super::{start, VllmFleet, VllmSimConfig};
use crate::sim::profile::Profile;
use crate::sse::SseParser;

pub(super) const MODEL: &str = "Qwen/Qwen3-32B";

/// Pods on free loopback ports running `time_scale`× faster than the built-in profile.
pub(super) fn config(pods: usize, time_scale: f64) -> VllmSimConfig {
    VllmSimConfig {
        pods,
        host: [127, 0, 0, 1].into(),
        port: 0,
        model: MODEL.into(),
        profile: Profile::qwen3_32b_tp2_h100().unwrap(),
        time_scale,
        loras: vec![],
        max_loras: 2,
    }
}

pub(super) async fn fleet(pods: usize, time_scale: f64) -> VllmFleet {
    start(config(pods, time_scale)).await.unwrap()
}

/// Sends one request on a fresh connection and returns the response head and body stream.
pub(super) async fn send(
    addr: SocketAddr,
    method: Method,
    path: &str,
    body: &str,
) -> (StatusCode, http::HeaderMap, Incoming) {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    let (head, body) = response.into_parts();
    (head.status, head.headers, body)
}

pub(super) async fn text(addr: SocketAddr, method: Method, path: &str, body: &str) -> (StatusCode, String) {
    let (status, _, body) = send(addr, method, path, body).await;
    let bytes = body.collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

pub(super) async fn post(addr: SocketAddr, path: &str, body: &Value) -> (StatusCode, Value) {
    let (status, text) = text(addr, Method::POST, path, &body.to_string()).await;
    let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, value)
}

/// Reads `data:` payloads of an SSE body one event at a time.
pub(super) struct Sse {
    body: Incoming,
    parser: SseParser,
    ready: VecDeque<String>,
}

impl Sse {
    pub async fn open(addr: SocketAddr, path: &str, body: &Value) -> Self {
        let (status, headers, body) = send(addr, Method::POST, path, &body.to_string()).await;
        assert_eq!(status, StatusCode::OK);
        let content_type = headers
            .get("content-type")
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default();
        assert!(content_type.starts_with("text/event-stream"), "{content_type:?}");
        Self {
            body,
            parser: SseParser::default(),
            ready: VecDeque::new(),
        }
    }

    /// The next event's data, or `None` at the end of the body. A broken or malformed stream
    /// fails the test with what went wrong.
    pub async fn next(&mut self) -> Option<String> {
        loop {
            if let Some(data) = self.ready.pop_front() {
                return Some(data);
            }
            let frame = match self.body.frame().await? {
                Ok(frame) => frame,
                Err(error) => panic!("reading the SSE body: {error}"),
            };
            if let Some(data) = frame.data_ref() {
                let mut payloads = Vec::new();
                if let Err(error) = self.parser.feed(data, &mut payloads) {
                    panic!("malformed SSE body: {error}");
                }
                self.ready.extend(payloads);
            }
        }
    }
}

/// Scrapes `/metrics`, checking every line against the text exposition format.
pub(super) async fn metrics(addr: SocketAddr) -> Metrics {
    let (status, body) = text(addr, Method::GET, "/metrics", "").await;
    assert_eq!(status, StatusCode::OK);
    Metrics::parse(&body)
}

/// Samples keyed by `name{labels}` as exposed.
pub(super) struct Metrics(pub HashMap<String, f64>);

impl Metrics {
    pub fn parse(text: &str) -> Self {
        let mut types: HashMap<String, String> = HashMap::new();
        let mut samples = HashMap::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, _) = rest.split_once(' ').unwrap();
                assert!(valid_name(name), "{line}");
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert!(valid_name(name), "{line}");
                assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
                assert!(
                    types.insert(name.into(), kind.into()).is_none(),
                    "duplicate {line}"
                );
            } else {
                let (series, value) = line.rsplit_once(' ').unwrap();
                let value: f64 = value.parse().unwrap_or_else(|_| panic!("value in {line}"));
                let name = series.split('{').next().unwrap();
                assert!(valid_name(name), "{line}");
                let family = ["_bucket", "_count", "_sum"]
                    .iter()
                    .filter_map(|s| name.strip_suffix(s))
                    .find(|f| types.get(*f).is_some_and(|k| k == "histogram"))
                    .unwrap_or(name);
                assert!(types.contains_key(family), "sample before its # TYPE: {line}");
                if let Some(labels) = series.strip_prefix(name) {
                    if !labels.is_empty() {
                        check_labels(labels);
                    }
                }
                assert!(
                    samples.insert(series.to_string(), value).is_none(),
                    "duplicate {line}"
                );
            }
        }
        Self(samples)
    }

    /// The value of the only series of `name` (panics if there are several or none).
    pub fn get(&self, name: &str) -> f64 {
        let prefix = format!("{name}{{");
        let mut found = self.0.iter().filter(|(k, _)| k.starts_with(&prefix));
        let (_, value) = found.next().unwrap_or_else(|| panic!("no {name}"));
        assert!(found.next().is_none(), "several {name}");
        *value
    }

    /// The labels of the only series of `name`, as exposed.
    pub fn labels(&self, name: &str) -> String {
        let prefix = format!("{name}{{");
        let key = self.0.keys().find(|k| k.starts_with(&prefix)).unwrap();
        key[prefix.len()..key.len() - 1].to_string()
    }
}

fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `{a="x",b="y\"z"}`: names valid, values quoted with only `\\`, `\"`, `\n` escapes.
fn check_labels(labels: &str) {
    let inner = labels
        .strip_prefix('{')
        .and_then(|l| l.strip_suffix('}'))
        .unwrap_or_else(|| panic!("braces in {labels}"));
    let mut rest = inner;
    while !rest.is_empty() {
        let (name, after) = rest.split_once("=\"").unwrap_or_else(|| panic!("{labels}"));
        assert!(valid_name(name) && !name.contains(':'), "{labels}");
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => {
                    let (_, escaped) = chars.next().unwrap();
                    assert!(['\\', '"', 'n'].contains(&escaped), "{labels}");
                }
                Some((i, '"')) => break i,
                Some(_) => {}
                None => panic!("unterminated value in {labels}"),
            }
        };
        rest = &after[end + 1..];
        if let Some(next) = rest.strip_prefix(',') {
            rest = next;
        } else {
            assert!(rest.is_empty(), "{labels}");
        }
    }
}
