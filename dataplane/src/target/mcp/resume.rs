//! A session's event stream that its server ends early is taken up again by the gateway
//! itself, after the last event it got: a GET with `Last-Event-ID`, whether the stream was a
//! POST's answer or the session's GET stream
//! (<https://modelcontextprotocol.io/specification/2025-11-25/basic/transports#resumability-and-redelivery>).
//! A 2025-11-25 server may close a stream at any moment once it has sent an event id (SSE
//! polling), so a gateway that does not resume loses the answers still to come. The client
//! never sees the break: its stream stays open, and the ids and `retry` hints, which are the
//! gateway's business now, are left out of what it gets.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use serde_json::Value;

use super::server::{Closing, Failure, Headers};
use crate::body::{self, Body, BodyIdle, BoxError};
use crate::sse;
use crate::telemetry::RequestTrace;
use crate::upstream::Upstream;

/// How long to wait before resuming when the server gave no `retry` hint (the Python and
/// TypeScript SDK clients wait as long).
const DEFAULT_DELAY: Duration = Duration::from_secs(1);
/// The shortest wait, whatever the hint: a server that asks for none and ends every stream
/// at once would otherwise be asked in a tight loop.
const MIN_DELAY: Duration = Duration::from_millis(100);
/// Resumptions in a row that bring no new event id before the gateway gives up. A server
/// that polls (a new priming id on each resumed stream) is followed for as long as the
/// client stays and the server is in the config; one that gives nothing new is not.
const MAX_FRUITLESS: u32 = 5;
/// The longest `retry` hint a session's GET stream is resumed after; an answer waits at most
/// the route's idle timeout. A longer one ends the stream instead.
const MAX_STREAM_DELAY: Duration = Duration::from_secs(300);

/// Where a stream stands for resuming it: the last event id the server gave and how long
/// it asked to wait.
#[derive(Debug)]
pub(super) struct Cursor {
    last_event_id: Option<String>,
    delay: Duration,
    fruitless: u32,
}

impl Default for Cursor {
    fn default() -> Cursor {
        Cursor {
            last_event_id: None,
            delay: DEFAULT_DELAY,
            fruitless: 0,
        }
    }
}

impl Cursor {
    /// Notes what one event of the stream says about resuming it, as an SSE client would
    /// (<https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation>):
    /// an empty id clears the last one; a `retry` of anything but digits is ignored.
    pub(super) fn saw(&mut self, event: &sse::Event) {
        match event.id.as_deref() {
            Some("") => self.last_event_id = None,
            Some(id) if id.contains('\0') => {}
            Some(id) if self.last_event_id.as_deref() != Some(id) => {
                self.last_event_id = Some(id.to_string());
                self.fruitless = 0;
            }
            _ => {}
        }
        if let Some(retry) = event.retry.as_deref() {
            if !retry.is_empty() && retry.bytes().all(|byte| byte.is_ascii_digit()) {
                // Too many digits for a u64 is longer than anyone waits.
                self.delay = retry.parse().map_or(Duration::MAX, Duration::from_millis);
            }
        }
    }

    /// The server gave an event id to resume after (and did not clear it).
    fn has_id(&self) -> bool {
        self.last_event_id.is_some()
    }

    /// The event id to resume after and the wait before, if the stream can be resumed once
    /// more: the server gave an id, and the last resumptions did not all bring nothing new.
    pub(super) fn next(&mut self) -> Option<(String, Duration)> {
        if self.fruitless >= MAX_FRUITLESS {
            return None;
        }
        let id = self.last_event_id.clone()?;
        self.fruitless += 1;
        Some((id, self.delay.max(MIN_DELAY)))
    }
}

/// What becomes of a stream its server ended or broke.
pub(super) enum Interruption {
    /// It is being taken up again.
    Resuming,
    /// It ends as the server left it.
    Ends,
    /// It fails, for this reason.
    Fails(String),
}

/// Whose stream it is: a session at a server of an McpBackend.
pub(super) struct SessionStream {
    /// The McpBackend and the server's name in it: each resumption goes to the server as the
    /// config version in force has it (a new URL or TLS setting is followed), and none is
    /// made once the server is gone from it.
    pub(super) target: Arc<str>,
    pub(super) server: Arc<str>,
    pub(super) session: String,
    pub(super) version: String,
    pub(super) upstream: Arc<Upstream>,
    pub(super) trace: RequestTrace,
}

/// What a session's stream is resumed with, and how far it got.
pub(super) struct Resumption {
    of: Arc<SessionStream>,
    /// The idle bound of a relayed answer's body, set again on each resumed one.
    idle: Option<Duration>,
    /// A POST's answer ends with the response to this request; a GET stream never ends so.
    request: Option<Value>,
    responded: bool,
    /// The stream is a resumed one, which a server may keep open after the response.
    resumed: bool,
    cursor: Cursor,
    /// `Ok(None)`: the server left the config while the gateway waited to resume.
    resuming: Option<BoxFuture<'static, Result<Option<Body>, Failure>>>,
    /// A session the gateway opened for this stream alone: it ends with the stream.
    session_guard: Option<Closing>,
}

impl Resumption {
    /// For the answer to `request` (its id), POSTed in the session.
    pub(super) fn of_answer(of: SessionStream, request: Value, idle: Duration) -> Resumption {
        Resumption {
            of: Arc::new(of),
            idle: Some(idle),
            request: Some(request),
            responded: false,
            resumed: false,
            cursor: Cursor::default(),
            resuming: None,
            session_guard: None,
        }
    }

    /// For the session's GET stream.
    pub(super) fn of_stream(of: SessionStream) -> Resumption {
        Resumption {
            of: Arc::new(of),
            idle: None,
            request: None,
            responded: false,
            resumed: false,
            cursor: Cursor::default(),
            resuming: None,
            session_guard: None,
        }
    }

    /// The session was opened for this stream alone, and is closed when the stream ends.
    pub(super) fn closing(mut self, closing: Closing) -> Resumption {
        self.session_guard = Some(closing);
        self
    }

    /// Notes one event of the stream and the message it carries, if any.
    pub(super) fn saw(&mut self, event: &sse::Event, message: Option<&serde_json::Map<String, Value>>) {
        self.cursor.saw(event);
        if let (Some(request), Some(message)) = (&self.request, message) {
            self.responded |= !message.contains_key("method") && message.get("id") == Some(request);
        }
    }

    /// The answer is complete and its stream is not to be read to its end: a resumed stream
    /// may stay open after the response. The stream the POST opened is still read to its end
    /// (the server ends it), so its connection can be used again.
    pub(super) fn complete(&self) -> bool {
        self.responded && self.resumed
    }

    /// How a resumption that cannot be made ends the stream: a session's stream just ends
    /// (its client opens another when it wants one), an answer the server meant to go on with
    /// (it gave an event id) fails, since its client would otherwise wait for a response
    /// that cannot come.
    fn cannot_resume(&self, why: String) -> Interruption {
        if self.request.is_some() && self.cursor.has_id() {
            Interruption::Fails(format!("server {}: {why}", self.of.server))
        } else {
            Interruption::Ends
        }
    }

    /// A resumption failed: whether the stream is only over. A server that no longer knows a
    /// session its client opened (it restarted, or the client ended it) ends that session's
    /// stream, which the client hears of on its next request; an answer, or the stream of a
    /// session the gateway opened itself (nobody else would hear of it), fails.
    pub(super) fn over_when(&self, failure: &Failure) -> bool {
        self.request.is_none() && self.session_guard.is_none() && failure.session_gone
    }

    /// The server left the config while the gateway waited to resume.
    pub(super) fn server_left(&self) -> Interruption {
        self.cannot_resume("left the McpBackend".into())
    }

    /// The stream ended or broke with `error`: whether it is being resumed, ends, or fails.
    /// A stream that went quiet for longer than allowed is not resumed: it is not
    /// interrupted, only slow.
    pub(super) fn interrupted(&mut self, error: Option<&BoxError>) -> Interruption {
        if error.is_some_and(|error| error.is::<BodyIdle>()) || self.responded {
            return Interruption::Ends;
        }
        if self
            .of
            .upstream
            .mcp_servers
            .get(&self.of.target, &self.of.server)
            .is_none()
        {
            return self.server_left();
        }
        let Some((last_event_id, delay)) = self.cursor.next() else {
            return self.cannot_resume(format!(
                "its stream ended {MAX_FRUITLESS} times in a row without a new event"
            ));
        };
        let longest = self.idle.unwrap_or(MAX_STREAM_DELAY);
        if delay > longest {
            return self.cannot_resume(format!(
                "asked to wait {delay:?} before its stream is resumed, longer than {longest:?}"
            ));
        }
        let (of, idle) = (self.of.clone(), self.idle);
        tracing::debug!(server = %of.server, ?delay, "resuming an MCP server's event stream");
        self.resuming = Some(
            async move {
                tokio::time::sleep(delay).await;
                // The server as the config has it now, after the wait.
                let Some(server) = of.upstream.mcp_servers.get(&of.target, &of.server) else {
                    return Ok(None);
                };
                let headers = Headers {
                    session: Some(&of.session),
                    version: Some(&of.version),
                    modern: false,
                    trace: &of.trace,
                };
                let incoming = server.resume(&headers, &last_event_id).await?.into_body();
                Ok(Some(match idle {
                    Some(idle) => body::boxed(body::IdleTimeout::new(incoming, idle)),
                    None => body::boxed(incoming),
                }))
            }
            .boxed(),
        );
        Interruption::Resuming
    }

    /// The resumed stream's body, once a resumption begun by [`Resumption::interrupted`]
    /// has it; `None` when none is under way.
    pub(super) fn poll_resumed(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Option<Poll<Result<Option<Body>, Failure>>> {
        let polled = self.resuming.as_mut()?.poll_unpin(cx);
        if let Poll::Ready(resumed) = &polled {
            self.resumed |= matches!(resumed, Ok(Some(_)));
            self.resuming = None;
        }
        Some(polled)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use bytes::Bytes;
    use http::{Request, Response};
    use http_body_util::{BodyExt, Full, StreamBody};
    use hyper::body::{Frame, Incoming};
    use portcullis_config::{McpFailureMode, McpServerSpec};

    use super::super::remap::RemapRequests;
    use super::super::server::Server;
    use super::*;
    use crate::tests::support::{quiet_telemetry, spawn_upstream, UpstreamBody};

    const TARGET: &str = "tools";
    const SESSION: &str = "session-1";
    const VERSION: &str = "2025-11-25";

    fn event(id: Option<&str>, retry: Option<&str>) -> sse::Event {
        sse::Event {
            id: id.map(str::to_string),
            retry: retry.map(str::to_string),
            ..sse::Event::default()
        }
    }

    #[test]
    fn a_stream_resumes_after_its_last_id_with_the_server_s_delay_and_not_for_ever() {
        let mut cursor = Cursor::default();
        assert_eq!(cursor.next(), None, "nothing to resume after without an id");
        cursor.saw(&event(Some("s1-1"), Some("250")));
        cursor.saw(&event(None, None));
        assert_eq!(cursor.next(), Some(("s1-1".into(), Duration::from_millis(250))));
        // Only digits make a retry hint; none makes a tight loop.
        cursor.saw(&event(Some("s1-2"), Some("+5")));
        assert_eq!(cursor.next(), Some(("s1-2".into(), Duration::from_millis(250))));
        cursor.saw(&event(None, Some("0")));
        assert_eq!(cursor.next(), Some(("s1-2".into(), MIN_DELAY)));
        // The same id again is nothing new.
        cursor.saw(&event(Some("s1-2"), None));
        for _ in 2..MAX_FRUITLESS {
            assert!(cursor.next().is_some());
        }
        assert_eq!(cursor.next(), None, "resumptions that bring nothing new end");
        // A polling server's new priming id each time keeps it going.
        cursor.saw(&event(Some("s1-3"), None));
        assert_eq!(cursor.next(), Some(("s1-3".into(), MIN_DELAY)));
        // An empty id clears it: nothing to resume after.
        cursor.saw(&event(Some(""), None));
        assert_eq!(cursor.next(), None);
    }

    /// Every request's method and `Last-Event-ID`, and whether it named the session.
    type Seen = Arc<Mutex<Vec<(String, Option<String>, bool)>>>;

    /// An MCP server on loopback, in force as server `py` of McpBackend `tools`, whose
    /// streams go as `answer` says for each request's method and `Last-Event-ID`.
    async fn server_answering(
        answer: fn(&str, Option<&str>) -> Option<UpstreamBody>,
    ) -> (Arc<Server>, Arc<Upstream>, Seen) {
        let seen = Seen::default();
        let noted = seen.clone();
        let address = spawn_upstream(move |request: Request<Incoming>| {
            let last = request
                .headers()
                .get("last-event-id")
                .and_then(|value| value.to_str().ok())
                .map(str::to_string);
            let in_session = request
                .headers()
                .get("mcp-session-id")
                .is_some_and(|value| value == SESSION);
            let method = request.method().to_string();
            noted
                .lock()
                .unwrap()
                .push((method.clone(), last.clone(), in_session));
            let body = answer(&method, last.as_deref());
            async move {
                match body {
                    Some(body) => Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(body)
                        .unwrap(),
                    None => Response::builder()
                        .status(404)
                        .body(Full::new(Bytes::new()).boxed())
                        .unwrap(),
                }
            }
        })
        .await;
        let telemetry = Arc::new(crate::telemetry::Telemetry::new(quiet_telemetry()).unwrap());
        let upstream = Arc::new(Upstream::new(telemetry, crate::placements::outbox().0, None));
        let spec = McpServerSpec {
            name: "py".into(),
            url: format!("http://{address}/mcp"),
            tls: None,
            timeout: None,
            failure_mode: McpFailureMode::Fail,
            list_ttl: None,
        };
        let server = Arc::new(Server::compile(&spec, &upstream).unwrap());
        upstream.mcp_servers.put_server_in_force(TARGET, &server);
        (server, upstream, seen)
    }

    fn session_stream(upstream: &Arc<Upstream>) -> SessionStream {
        SessionStream {
            target: Arc::from(TARGET),
            server: Arc::from("py"),
            session: SESSION.into(),
            version: VERSION.into(),
            upstream: upstream.clone(),
            trace: RequestTrace::default(),
        }
    }

    fn events(text: &'static str) -> UpstreamBody {
        Full::new(Bytes::from_static(text.as_bytes())).boxed()
    }

    /// What the client gets, and how its stream ended (`None`: cleanly).
    async fn read(mut events: RemapRequests) -> (String, Option<String>) {
        let mut text = String::new();
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(10), events.frame())
                .await
                .expect("the stream ends");
            match frame {
                None => return (text, None),
                Some(Err(error)) => return (text, Some(error.to_string())),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        text.push_str(&String::from_utf8_lossy(&data));
                    }
                }
            }
        }
    }

    fn in_session() -> Headers<'static> {
        static TRACE: std::sync::LazyLock<RequestTrace> = std::sync::LazyLock::new(RequestTrace::default);
        Headers {
            session: Some(SESSION),
            version: Some(VERSION),
            modern: false,
            trace: &TRACE,
        }
    }

    #[tokio::test]
    async fn a_session_stream_the_server_ends_is_taken_up_after_its_last_event() {
        let (server, upstream, seen) = server_answering(|_, last| match last {
            None => Some(events(
                "id: a1\nretry: 10\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/resources/list_changed\"}\n\n",
            )),
            Some("a1") => Some(events(
                ": a priming event\nid: a2\ndata: \n\nid: a3\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/tools/list_changed\"}\n\n",
            )),
            // The server restarted, say: the session is gone, and so is the stream.
            _ => None,
        })
        .await;
        let opened = server.get(&in_session()).await.unwrap();
        let relayed = RemapRequests::new(body::boxed(opened.into_body()), "py")
            .remapping(false)
            .resuming(Resumption::of_stream(session_stream(&upstream)));
        let (text, ended) = read(relayed).await;
        let resources = text.find("resources/list_changed").expect(&text);
        let tools = text.find("tools/list_changed").expect(&text);
        assert!(resources < tools, "{text}");
        assert!(
            !text
                .lines()
                .any(|line| line.starts_with("id:") || line.starts_with("retry:")),
            "the client has nothing to resume with: {text}"
        );
        assert_eq!(
            ended, None,
            "a stream of a session the server lost is over, not broken"
        );
        let seen = seen.lock().unwrap().clone();
        let resumed_after: Vec<Option<&str>> = seen.iter().map(|(_, last, _)| last.as_deref()).collect();
        assert_eq!(resumed_after, [None, Some("a1"), Some("a3")]);
        assert!(
            seen.iter()
                .all(|(method, _, in_session)| method == "GET" && *in_session),
            "{seen:?}"
        );
    }

    #[tokio::test]
    async fn an_answer_the_server_cuts_short_is_resumed_and_ends_with_its_response() {
        let (server, upstream, seen) = server_answering(|method, last| match (method, last) {
            ("POST", None) => Some(events(
                "id: p1\nretry: 10\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{\"data\":\"before\"}}\n\n",
            )),
            // The resumed stream carries a request to the client and a response to another
            // request, then, a moment later, the response, and is not ended by the server.
            ("GET", Some("p1")) => {
                let frame = |text: &'static str| -> Result<Frame<Bytes>, std::convert::Infallible> {
                    Ok(Frame::data(Bytes::from_static(text.as_bytes())))
                };
                let first = frame(
                    "id: p2\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"method\":\"roots/list\"}\n\n\
                     id: p3\ndata: {\"jsonrpc\":\"2.0\",\"id\":6,\"result\":{}}\n\n",
                );
                let response = frame("id: p4\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"ok\":true}}\n\n");
                let later = futures::FutureExt::into_stream(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    response
                });
                let stream = futures::StreamExt::chain(
                    futures::StreamExt::chain(futures::stream::iter([first]), later),
                    futures::stream::pending(),
                );
                Some(BodyExt::boxed(StreamBody::new(stream)))
            }
            _ => None,
        })
        .await;
        let call = serde_json::json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "slow"}});
        let answer = server.post(&in_session(), &call).await.unwrap();
        let resumption =
            Resumption::of_answer(session_stream(&upstream), Value::from(7), Duration::from_secs(30));
        let relayed = RemapRequests::new(body::boxed(answer.into_body()), "py")
            .remapping(false)
            .answering(Value::from(7))
            .resuming(resumption);
        let (text, ended) = read(relayed).await;
        assert_eq!(ended, None, "{text}");
        assert!(
            text.contains("\"before\"") && text.contains("roots/list"),
            "{text}"
        );
        assert!(
            !text.contains("\"id\":6"),
            "the response to another request is dropped: {text}"
        );
        assert!(text.ends_with("\"result\":{\"ok\":true}}\n\n"), "{text}");
        let seen: Vec<(String, Option<String>)> = seen
            .lock()
            .unwrap()
            .iter()
            .map(|(method, last, _)| (method.clone(), last.clone()))
            .collect();
        assert_eq!(seen, [("POST".into(), None), ("GET".into(), Some("p1".into()))]);
    }

    #[tokio::test]
    async fn an_answer_that_cannot_be_resumed_fails_and_a_stream_just_ends() {
        let (server, upstream, seen) = server_answering(|method, _| match method {
            "POST" => Some(events("id: p1\nretry: 10\ndata: \n\n")),
            _ => None,
        })
        .await;
        let call = serde_json::json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call"});
        let answer_of = |resumption: Resumption| {
            let (server, call) = (server.clone(), call.clone());
            async move {
                let answer = server.post(&in_session(), &call).await.unwrap();
                RemapRequests::new(body::boxed(answer.into_body()), "py")
                    .remapping(false)
                    .resuming(resumption)
            }
        };
        let answer = |idle| Resumption::of_answer(session_stream(&upstream), Value::from(7), idle);
        // The server lost the session: the answer fails, and its body ends there.
        let mut relayed = answer_of(answer(Duration::from_secs(30))).await;
        let failed = failure(&mut relayed).await;
        assert!(failed.contains("no longer knows this session"), "{failed}");
        assert!(relayed.frame().await.is_none(), "nothing after the failure");

        // It asks to be resumed after longer than the route lets an answer go quiet.
        let failed = failure(&mut answer_of(answer(Duration::from_millis(5))).await).await;
        assert!(failed.contains("longer than"), "{failed}");

        // The config no longer has the server: no resumption; the answer fails, a session's
        // stream just ends.
        upstream.mcp_servers.put_in_force(&[]);
        let failed = failure(&mut answer_of(answer(Duration::from_secs(30))).await).await;
        assert!(failed.contains("left the McpBackend"), "{failed}");
        let stream = answer_of(Resumption::of_stream(session_stream(&upstream))).await;
        assert_eq!(read(stream).await, (String::new(), None));
        let methods: Vec<String> = seen
            .lock()
            .unwrap()
            .iter()
            .map(|(method, ..)| method.clone())
            .collect();
        assert_eq!(methods, ["POST", "GET", "POST", "POST", "POST"]);
    }

    /// Why the client's stream failed (it must).
    async fn failure(events: &mut RemapRequests) -> String {
        loop {
            let frame = tokio::time::timeout(Duration::from_secs(10), events.frame())
                .await
                .expect("the stream ends");
            match frame {
                None => panic!("the stream ended without an error"),
                Some(Err(error)) => return error.to_string(),
                Some(Ok(_)) => {}
            }
        }
    }
}
