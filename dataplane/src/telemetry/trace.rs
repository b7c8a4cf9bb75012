//! W3C Trace Context for one request: parsing the incoming `traceparent`, choosing the span id
//! sent upstream, and the OpenTelemetry server span when span export is on.
//!
//! With export off nothing here allocates unless the request carries a valid `traceparent`
//! (then only the `tracestate` handle is cloned: a reference count). The span itself is the
//! SDK's: it is started here, its attributes are set and it is ended in [`end_span`].

use std::borrow::Cow;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use http::HeaderValue;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags, TraceId, TraceState,
    Tracer as _,
};
use opentelemetry::{Context, Key, KeyValue, Value};
use opentelemetry_sdk::trace::{SdkTracer, Span as SdkSpan};
use rand::Rng as _;

use super::{McpRecord, RequestRecord};

/// The `sampled` bit of the trace flags.
const FLAG_SAMPLED: u8 = 0x01;
/// Length of a version-00 `traceparent`, and the minimum length of any later version.
const TRACEPARENT_LEN: usize = 55;
/// The span's name until [`end_span`] knows the route.
const PROVISIONAL_SPAN_NAME: &str = "HTTP";

/// A valid incoming `traceparent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct TraceParent {
    pub(super) trace_id: [u8; 16],
    pub(super) parent_id: [u8; 8],
    pub(super) flags: u8,
}

/// Parses a `traceparent` value as W3C Trace Context (level 1) says: version 00 exactly
/// `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, lowercase hex only, neither id all
/// zeros; a later version (not `ff`) is read for its first four fields, which may be followed
/// only by the end of the value or a `-`. Anything else is `None`: treated as absent.
pub(super) fn parse_traceparent(value: &[u8]) -> Option<TraceParent> {
    if value.len() < TRACEPARENT_LEN {
        return None;
    }
    let [version] = decode_hex::<1>(&value[0..2])?;
    if version == 0xff {
        return None;
    }
    if value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    let trace_id = decode_hex::<16>(&value[3..35])?;
    let parent_id = decode_hex::<8>(&value[36..52])?;
    let [flags] = decode_hex::<1>(&value[53..55])?;
    if trace_id == [0; 16] || parent_id == [0; 8] {
        return None;
    }
    let rest_ok = if version == 0 {
        value.len() == TRACEPARENT_LEN
    } else {
        value.len() == TRACEPARENT_LEN || value[TRACEPARENT_LEN] == b'-'
    };
    rest_ok.then_some(TraceParent {
        trace_id,
        parent_id,
        flags,
    })
}

fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

/// Decodes exactly `2 * N` lowercase hex digits.
fn decode_hex<const N: usize>(digits: &[u8]) -> Option<[u8; N]> {
    debug_assert_eq!(digits.len(), 2 * N);
    let mut out = [0u8; N];
    for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = (hex_digit(pair[0])? << 4) | hex_digit(pair[1])?;
    }
    Some(out)
}

/// Writes `bytes` as lowercase hex into `out` (twice as long).
fn encode_hex(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (pair, byte) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(byte >> 4)];
        pair[1] = DIGITS[usize::from(byte & 0x0f)];
    }
}

/// A random, non-zero span id.
fn random_span_id() -> [u8; 8] {
    let mut rng = rand::rng();
    loop {
        let id: u64 = rng.random();
        if id != 0 {
            return id.to_be_bytes();
        }
    }
}

/// The identifiers of a request's own span.
#[derive(Clone, Copy)]
struct Ids {
    trace_id: [u8; 16],
    span_id: [u8; 8],
    flags: u8,
}

/// The trace context of one request: continues an incoming W3C `traceparent` (same trace id,
/// new span id, same flags) or, when span export is on and there is none, starts a new sampled
/// trace; when export is off and there is none, no trace context is invented.
pub(crate) struct RequestTrace {
    ids: Option<Ids>,
    /// The incoming `tracestate`, kept only when the incoming `traceparent` was valid.
    tracestate: Option<HeaderValue>,
    /// The server span being recorded (export on and the trace sampled).
    span: Option<Box<SdkSpan>>,
}

impl RequestTrace {
    /// No trace context.
    pub(super) const fn none() -> RequestTrace {
        RequestTrace {
            ids: None,
            tracestate: None,
            span: None,
        }
    }

    /// Starts the trace context of a request (see [`RequestTrace`]). `tracer` is `Some` when
    /// span export is on.
    pub(super) fn start(
        tracer: Option<&SdkTracer>,
        traceparent: Option<&HeaderValue>,
        tracestate: Option<&HeaderValue>,
    ) -> RequestTrace {
        let parent = traceparent.and_then(|v| parse_traceparent(v.as_bytes()));
        match (parent, tracer) {
            (None, None) => RequestTrace::none(),
            (Some(parent), Some(tracer)) if parent.flags & FLAG_SAMPLED != 0 => {
                match start_span(tracer, Some((&parent, tracestate))) {
                    Some((span, span_id)) => RequestTrace {
                        ids: Some(Ids {
                            trace_id: parent.trace_id,
                            span_id,
                            flags: parent.flags,
                        }),
                        tracestate: tracestate.cloned(),
                        span: Some(span),
                    },
                    None => RequestTrace::continued(&parent, tracestate),
                }
            }
            // Not sampled upstream (the sampler is parent-based), or export off: pass on.
            (Some(parent), _) => RequestTrace::continued(&parent, tracestate),
            (None, Some(tracer)) => match start_span(tracer, None) {
                Some((span, span_id)) => {
                    let trace_id = span.span_context().trace_id().to_bytes();
                    RequestTrace {
                        ids: Some(Ids {
                            trace_id,
                            span_id,
                            flags: FLAG_SAMPLED,
                        }),
                        tracestate: None,
                        span: Some(span),
                    }
                }
                // The provider is shut down: the proxy is stopping, start nothing.
                None => RequestTrace::none(),
            },
        }
    }

    /// Continues `parent` without recording a span.
    fn continued(parent: &TraceParent, tracestate: Option<&HeaderValue>) -> RequestTrace {
        RequestTrace {
            ids: Some(Ids {
                trace_id: parent.trace_id,
                span_id: random_span_id(),
                flags: parent.flags,
            }),
            tracestate: tracestate.cloned(),
            span: None,
        }
    }

    /// The `traceparent` to send upstream (version 00, our span id), if there is a trace.
    pub(crate) fn traceparent(&self) -> Option<HeaderValue> {
        let ids = self.ids.as_ref()?;
        let mut buf = *b"00-00000000000000000000000000000000-0000000000000000-00";
        encode_hex(&ids.trace_id, &mut buf[3..35]);
        encode_hex(&ids.span_id, &mut buf[36..52]);
        encode_hex(&[ids.flags], &mut buf[53..55]);
        // Hex digits and dashes are always a valid header value; `.ok()` only spares a panic path.
        HeaderValue::from_bytes(&buf).ok()
    }

    /// The incoming `tracestate`, passed through unchanged (only with a valid incoming
    /// `traceparent`: a trace we start has none).
    pub(crate) fn tracestate(&self) -> Option<&HeaderValue> {
        self.tracestate.as_ref()
    }

    /// The same context without the span, for work that outlives the request's handler
    /// (a response body that sends more requests upstream): their headers continue the
    /// trace, the span ends with the handler.
    pub(crate) fn detached(&self) -> RequestTrace {
        RequestTrace {
            ids: self.ids,
            tracestate: self.tracestate.clone(),
            span: None,
        }
    }

    /// The trace id as 32 lowercase hex digits, for the access log.
    pub(crate) fn trace_id(&self) -> Option<String> {
        let mut hex = [0u8; 32];
        self.write_trace_id(&mut hex)?;
        Some(String::from_utf8_lossy(&hex).into_owned())
    }

    /// An id for this request in messages to other services (guardrail checks):
    /// `<trace id>-<span id>` in hex when traced, so it leads to the trace; a random one
    /// otherwise.
    pub(crate) fn request_id(&self) -> String {
        let (trace_id, span_id) = match &self.ids {
            Some(ids) => (ids.trace_id, ids.span_id),
            None => (rand::random(), random_span_id()),
        };
        let mut trace_hex = [0u8; 32];
        let mut span_hex = [0u8; 16];
        encode_hex(&trace_id, &mut trace_hex);
        encode_hex(&span_id, &mut span_hex);
        format!(
            "{}-{}",
            String::from_utf8_lossy(&trace_hex),
            String::from_utf8_lossy(&span_hex)
        )
    }

    /// Writes the trace id as hex into `out` and returns it, without allocating.
    pub(super) fn write_trace_id<'a>(&self, out: &'a mut [u8; 32]) -> Option<&'a str> {
        let ids = self.ids.as_ref()?;
        encode_hex(&ids.trace_id, out);
        std::str::from_utf8(out).ok()
    }

    /// The span id sent upstream.
    #[cfg(test)]
    pub(super) fn span_id(&self) -> Option<[u8; 8]> {
        self.ids.map(|ids| ids.span_id)
    }

    pub(super) fn take_span(&mut self) -> Option<Box<SdkSpan>> {
        self.span.take()
    }
}

/// No trace context (what [`RequestTrace::start`] gives with export off and no valid
/// `traceparent`).
impl Default for RequestTrace {
    fn default() -> RequestTrace {
        RequestTrace::none()
    }
}

impl fmt::Debug for RequestTrace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("RequestTrace");
        if let (Some(trace_id), Some(ids)) = (self.trace_id(), &self.ids) {
            let mut span_id = [0u8; 16];
            encode_hex(&ids.span_id, &mut span_id);
            s.field("trace_id", &trace_id)
                .field("span_id", &String::from_utf8_lossy(&span_id))
                .field("flags", &ids.flags);
        }
        s.field("recording", &self.span.is_some()).finish()
    }
}

/// Starts a server span, child of the remote `parent` when there is one, and returns it with
/// its span id; `None` when the SDK does not record it (provider shut down).
fn start_span(
    tracer: &SdkTracer,
    parent: Option<(&TraceParent, Option<&HeaderValue>)>,
) -> Option<(Box<SdkSpan>, [u8; 8])> {
    let cx = match parent {
        Some((parent, tracestate)) => {
            let state = tracestate
                .and_then(|v| v.to_str().ok())
                .and_then(|s| s.parse::<TraceState>().ok())
                .unwrap_or_default();
            Context::new().with_remote_span_context(SpanContext::new(
                TraceId::from_bytes(parent.trace_id),
                SpanId::from_bytes(parent.parent_id),
                TraceFlags::new(parent.flags),
                true,
                state,
            ))
        }
        None => Context::new(),
    };
    let span = tracer
        .span_builder(PROVISIONAL_SPAN_NAME)
        .with_kind(SpanKind::Server)
        .start_with_context(tracer, &cx);
    let sc = span.span_context();
    if !sc.is_valid() || !span.is_recording() {
        return None;
    }
    let span_id = sc.span_id().to_bytes();
    Some((Box::new(span), span_id))
}

const HTTP_REQUEST_METHOD: Key = Key::from_static_str("http.request.method");
const HTTP_REQUEST_METHOD_ORIGINAL: Key = Key::from_static_str("http.request.method_original");
const HTTP_RESPONSE_STATUS_CODE: Key = Key::from_static_str("http.response.status_code");
const HTTP_ROUTE: Key = Key::from_static_str("http.route");
const HTTP_REQUEST_BODY_SIZE: Key = Key::from_static_str("http.request.body.size");
const HTTP_RESPONSE_BODY_SIZE: Key = Key::from_static_str("http.response.body.size");
const URL_PATH: Key = Key::from_static_str("url.path");
const SERVER_ADDRESS: Key = Key::from_static_str("server.address");
const SERVER_PORT: Key = Key::from_static_str("server.port");
const CLIENT_ADDRESS: Key = Key::from_static_str("client.address");
const CLIENT_PORT: Key = Key::from_static_str("client.port");
const ERROR_TYPE: Key = Key::from_static_str("error.type");
const PORTCULLIS_LISTENER: Key = Key::from_static_str("portcullis.listener");
const PORTCULLIS_ROUTE: Key = Key::from_static_str("portcullis.route");
const PORTCULLIS_TARGET: Key = Key::from_static_str("portcullis.target");
const PORTCULLIS_ENDPOINT: Key = Key::from_static_str("portcullis.endpoint");
const PORTCULLIS_ATTEMPTS: Key = Key::from_static_str("portcullis.attempts");
const PORTCULLIS_COMPLETED: Key = Key::from_static_str("portcullis.completed");

/// The method as OpenTelemetry's HTTP conventions name it: the standard ones as they are,
/// any other as `_OTHER` (with the original in `http.request.method_original`).
fn known_method(method: &http::Method) -> Option<&'static str> {
    Some(match *method {
        http::Method::GET => "GET",
        http::Method::HEAD => "HEAD",
        http::Method::POST => "POST",
        http::Method::PUT => "PUT",
        http::Method::DELETE => "DELETE",
        http::Method::CONNECT => "CONNECT",
        http::Method::OPTIONS => "OPTIONS",
        http::Method::TRACE => "TRACE",
        http::Method::PATCH => "PATCH",
        _ => return None,
    })
}

/// Splits a `Host` value into host and port (`example.com:8080`, `[::1]:8080`, `example.com`).
fn split_host(host: &str) -> (&str, Option<u16>) {
    if let Some((name, port)) = host.rsplit_once(':') {
        // An unbracketed IPv6 address has colons and no port.
        if !name.contains(':') || name.ends_with(']') {
            if let Ok(port) = port.parse::<u16>() {
                return (name.trim_start_matches('[').trim_end_matches(']'), Some(port));
            }
        }
    }
    (host.trim_start_matches('[').trim_end_matches(']'), None)
}

/// The path without any query, whatever the caller passed: a query may hold secrets.
pub(super) fn path_without_query(path: &str) -> &str {
    path.split_once('?').map_or(path, |(path, _)| path)
}

/// The item an MCP request named, as the access log and spans record it. A resource's name
/// is its URI, where credentials and tokens travel (`postgres://user:pw@db/x`,
/// `https://h/doc?token=…`): its userinfo, query and fragment are left out. A tool's or a
/// prompt's name is recorded as it is.
pub(super) fn mcp_item_name(mcp: &McpRecord) -> Option<Cow<'_, str>> {
    let name = mcp.name.as_deref()?;
    Some(match &*mcp.method {
        "tools/call" | "prompts/get" => Cow::Borrowed(name),
        _ => uri_without_secrets(name),
    })
}

fn uri_without_secrets(uri: &str) -> Cow<'_, str> {
    let (scheme, rest) = match uri.find("://") {
        Some(at) => uri.split_at(at + 3),
        None => ("", uri),
    };
    // The authority is taken to run to the first '/', not also to '?' or '#' as RFC 3986
    // has it: a password written with those unescaped is cut whole all the same.
    // Without `//` there is no authority (`urn:isbn:…`, `mailto:…`).
    let authority = match scheme.is_empty() {
        true => "",
        false => &rest[..rest.find('/').unwrap_or(rest.len())],
    };
    if let Some(at) = authority.rfind('@') {
        let rest = &rest[at + 1..];
        return Cow::Owned(format!(
            "{scheme}{}",
            &rest[..rest.find(['?', '#']).unwrap_or(rest.len())]
        ));
    }
    // `user:p/w@db`: a password written with a '/' leaves `user:p` for an authority, which
    // no host with a port reads as. Nothing of it is kept.
    let after_host = match authority.strip_prefix('[') {
        Some(bracketed) => bracketed.split_once(']').map_or("", |(_, after)| after),
        None => authority.find(':').map_or("", |colon| &authority[colon..]),
    };
    let port = after_host.strip_prefix(':').unwrap_or(after_host);
    if !port.bytes().all(|b| b.is_ascii_digit()) {
        return Cow::Owned(format!("{scheme}…"));
    }
    let kept = &rest[..rest.find(['?', '#']).unwrap_or(rest.len())];
    // An '@' further on, before the query, may end a user info written with a '/' in it
    // (`dG9r/ZW4@host`, a token), or be part of a path: either way what comes before it is
    // left out, and marked so.
    if let Some(at) = kept.rfind('@') {
        return Cow::Owned(format!("{scheme}…@{}", &kept[at + 1..]));
    }
    if kept.len() == rest.len() {
        Cow::Borrowed(uri)
    } else {
        Cow::Owned(format!("{scheme}{kept}"))
    }
}

fn client_attributes(client: &SocketAddr, attributes: &mut Vec<KeyValue>) {
    attributes.push(KeyValue::new(CLIENT_ADDRESS, client.ip().to_string()));
    attributes.push(KeyValue::new(CLIENT_PORT, i64::from(client.port())));
}

/// Names the span after the request, sets its attributes (OpenTelemetry HTTP semantic
/// conventions plus `portcullis.*`) and status (Error for 5xx), and ends it.
pub(super) fn end_span(mut span: Box<SdkSpan>, record: &RequestRecord) {
    let method = known_method(&record.method);
    let method_name = method.unwrap_or("HTTP");
    span.update_name(match &record.route {
        Some(route) => format!("{method_name} {route}"),
        None => method_name.to_owned(),
    });

    let mut attributes = Vec::with_capacity(20);
    match method {
        Some(method) => attributes.push(KeyValue::new(HTTP_REQUEST_METHOD, method)),
        None => {
            attributes.push(KeyValue::new(HTTP_REQUEST_METHOD, "_OTHER"));
            attributes.push(KeyValue::new(
                HTTP_REQUEST_METHOD_ORIGINAL,
                record.method.as_str().to_owned(),
            ));
        }
    }
    attributes.push(KeyValue::new(HTTP_RESPONSE_STATUS_CODE, i64::from(record.status)));
    attributes.push(KeyValue::new(
        URL_PATH,
        path_without_query(&record.path).to_owned(),
    ));
    if let Some(host) = &record.host {
        let (name, port) = split_host(host);
        attributes.push(KeyValue::new(SERVER_ADDRESS, name.to_owned()));
        if let Some(port) = port {
            attributes.push(KeyValue::new(SERVER_PORT, i64::from(port)));
        }
    }
    client_attributes(&record.client, &mut attributes);
    attributes.push(KeyValue::new(
        PORTCULLIS_LISTENER,
        Value::from(record.listener.clone()),
    ));
    if let Some(route) = &record.route {
        attributes.push(KeyValue::new(HTTP_ROUTE, Value::from(route.clone())));
        attributes.push(KeyValue::new(PORTCULLIS_ROUTE, Value::from(route.clone())));
    }
    if let Some(target) = &record.target {
        attributes.push(KeyValue::new(PORTCULLIS_TARGET, Value::from(target.clone())));
    }
    if let Some(endpoint) = &record.endpoint {
        attributes.push(KeyValue::new(PORTCULLIS_ENDPOINT, Value::from(endpoint.clone())));
    }
    attributes.push(KeyValue::new(PORTCULLIS_ATTEMPTS, i64::from(record.attempts)));
    if let Some(mcp) = &record.mcp {
        // OpenTelemetry's MCP semantic conventions.
        attributes.push(KeyValue::new("mcp.method.name", Value::from(mcp.method.clone())));
        if let Some(server) = &mcp.server {
            attributes.push(KeyValue::new(
                "portcullis.mcp.server",
                Value::from(server.clone()),
            ));
        }
        if let Some(name) = mcp_item_name(mcp) {
            let key = if mcp.method.as_ref() == "tools/call" {
                "gen_ai.tool.name"
            } else {
                "mcp.item.name"
            };
            attributes.push(KeyValue::new(key, name.into_owned()));
        }
        if let Some(pin) = mcp.pin {
            attributes.push(KeyValue::new("portcullis.mcp.tool.pin", pin));
        }
        if let Some(code) = mcp.error_code {
            attributes.push(KeyValue::new("rpc.jsonrpc.error_code", code));
        }
    }
    if let Some(llm) = &record.llm {
        let llm = llm.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        attributes.push(KeyValue::new(
            "gen_ai.request.model",
            Value::from(llm.model.clone()),
        ));
        for (name, tokens) in [
            ("gen_ai.usage.input_tokens", llm.input_tokens),
            ("gen_ai.usage.output_tokens", llm.output_tokens),
            ("gen_ai.usage.cache_read.input_tokens", llm.cached_input_tokens),
        ] {
            if let Some(tokens) = tokens {
                attributes.push(KeyValue::new(name, saturating_i64(tokens)));
            }
        }
    }
    attributes.push(KeyValue::new(
        HTTP_REQUEST_BODY_SIZE,
        saturating_i64(record.bytes_received),
    ));
    attributes.push(KeyValue::new(
        HTTP_RESPONSE_BODY_SIZE,
        saturating_i64(record.bytes_sent),
    ));
    if !record.completed {
        attributes.push(KeyValue::new(PORTCULLIS_COMPLETED, false));
    }
    let server_error = record.status >= 500;
    match record.error {
        Some(error) => attributes.push(KeyValue::new(ERROR_TYPE, error)),
        None if server_error => attributes.push(KeyValue::new(ERROR_TYPE, record.status.to_string())),
        None => {}
    }
    span.set_attributes(attributes);
    for check in record.guardrails() {
        span.add_event(
            "portcullis.guardrail",
            vec![
                KeyValue::new("portcullis.guardrail.name", Value::from(check.guardrail)),
                KeyValue::new("portcullis.guardrail.phase", check.phase),
                KeyValue::new("portcullis.guardrail.decision", check.decision),
                KeyValue::new(
                    "portcullis.guardrail.replica",
                    Value::from(check.replica.unwrap_or_else(|| Arc::from(""))),
                ),
                KeyValue::new("portcullis.guardrail.attempts", i64::from(check.attempts)),
                KeyValue::new(
                    "portcullis.guardrail.latency_ms",
                    check.latency.as_secs_f64() * 1000.0,
                ),
            ],
        );
    }
    if server_error {
        span.set_status(Status::error(record.error.unwrap_or("")));
    }
    span.end();
}

fn saturating_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRACE: [u8; 16] = [
        0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36,
    ];
    const PARENT: [u8; 8] = [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7];

    #[test]
    fn resource_uris_are_recorded_without_credentials() {
        let recorded = |method: &str, name: &str| {
            let mcp = McpRecord {
                method: Arc::from(method),
                name: Some(name.to_owned()),
                ..McpRecord::default()
            };
            mcp_item_name(&mcp).map(Cow::into_owned)
        };
        let read = "resources/read";
        for (uri, kept) in [
            ("postgres://user:pw@db/x", "postgres://db/x"),
            ("https://h/doc?token=abc#part", "https://h/doc"),
            ("https://user@h:8443/doc#part", "https://h:8443/doc"),
            // Unescaped in the password: cut with the userinfo, not taken for a query.
            ("https://u:p?w#d@h/x?t=1", "https://h/x"),
            ("urn:isbn:123?token=abc", "urn:isbn:123"),
            ("file:///etc/hosts", "file:///etc/hosts"),
            ("https://h/users/@me", "https://…@me"),
            ("postgres://user:p/w@db/x", "postgres://…"),
            ("postgres://u:p/w?x@db/x", "postgres://…"),
            ("https://dG9r/ZW4@h/x", "https://…@h/x"),
            ("https://api/doc?user=a@b.com&api_key=SECRET", "https://api/doc"),
            ("https://[::1]:8443/doc", "https://[::1]:8443/doc"),
            ("https://[::1]/doc", "https://[::1]/doc"),
            ("urn:isbn:123", "urn:isbn:123"),
            ("https://h:8443/doc?k=v", "https://h:8443/doc"),
            ("", ""),
            ("https://h/x@", "https://…@"),
        ] {
            assert_eq!(recorded(read, uri).as_deref(), Some(kept), "{uri}");
        }
        assert_eq!(recorded("tools/call", "get?sum#1").as_deref(), Some("get?sum#1"));
        assert_eq!(recorded("prompts/get", "a@b?c").as_deref(), Some("a@b?c"));
        assert_eq!(mcp_item_name(&McpRecord::default()), None);
    }

    #[test]
    fn traceparent_parsing_table() {
        let valid = Some(TraceParent {
            trace_id: TRACE,
            parent_id: PARENT,
            flags: 0x01,
        });
        let cases: &[(&str, &str, Option<TraceParent>)] = &[
            (
                "valid, sampled",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                valid,
            ),
            (
                "valid, not sampled",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
                Some(TraceParent {
                    trace_id: TRACE,
                    parent_id: PARENT,
                    flags: 0x00,
                }),
            ),
            (
                "unknown flags kept",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09",
                Some(TraceParent {
                    trace_id: TRACE,
                    parent_id: PARENT,
                    flags: 0x09,
                }),
            ),
            (
                "uppercase trace id",
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                None,
            ),
            (
                "uppercase parent id",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",
                None,
            ),
            (
                "uppercase flags",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0A",
                None,
            ),
            (
                "uppercase version",
                "0A-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                None,
            ),
            (
                "zero trace id",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                None,
            ),
            (
                "zero parent id",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                None,
            ),
            (
                "short trace id",
                "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
                None,
            ),
            (
                "long trace id",
                "00-4bf92f3577b34da6a3ce929d0e0e47366-00f067aa0ba902b7-01",
                None,
            ),
            (
                "short parent id",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b-01",
                None,
            ),
            (
                "long parent id",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b77-01",
                None,
            ),
            (
                "one-digit flags",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
                None,
            ),
            (
                "three-digit flags",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-011",
                None,
            ),
            (
                "version 00 with more fields",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
                None,
            ),
            (
                "version ff",
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                None,
            ),
            (
                "non-hex version",
                "0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                None,
            ),
            (
                "non-hex in trace id",
                "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
                None,
            ),
            (
                "wrong separator",
                "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
                None,
            ),
            (
                "leading space",
                " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                None,
            ),
            (
                "trailing space",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 ",
                None,
            ),
            ("empty", "", None),
            (
                "future version",
                "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                valid,
            ),
            (
                "future version, more fields",
                "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future",
                valid,
            ),
            (
                "future version, no dash after flags",
                "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01.what",
                None,
            ),
            (
                "future version, zero trace id",
                "cc-00000000000000000000000000000000-00f067aa0ba902b7-01-x",
                None,
            ),
            (
                "future version, too short",
                "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
                None,
            ),
        ];
        for (name, header, expected) in cases {
            assert_eq!(
                parse_traceparent(header.as_bytes()),
                *expected,
                "case {name:?}: {header:?}"
            );
        }
    }

    #[test]
    fn hex_round_trip() {
        let mut out = [0u8; 32];
        encode_hex(&TRACE, &mut out);
        assert_eq!(&out, b"4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(decode_hex::<16>(&out), Some(TRACE));
    }

    #[test]
    fn continuation_keeps_trace_id_and_flags_and_changes_span_id() {
        let incoming = HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        let state = HeaderValue::from_static("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE");
        let trace = RequestTrace::start(None, Some(&incoming), Some(&state));
        let outgoing = trace.traceparent().expect("a continued trace has a traceparent");
        let outgoing = outgoing.to_str().unwrap();
        assert_eq!(outgoing.len(), 55);
        assert!(
            outgoing.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
            "{outgoing}"
        );
        assert!(outgoing.ends_with("-01"), "{outgoing}");
        let parsed = parse_traceparent(outgoing.as_bytes()).expect("we send a valid traceparent");
        assert_eq!(parsed.trace_id, TRACE);
        assert_ne!(parsed.parent_id, PARENT, "our own span id, not the caller's");
        assert_eq!(Some(parsed.parent_id), trace.span_id());
        assert_eq!(trace.tracestate(), Some(&state));
        assert_eq!(
            trace.trace_id().as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );

        // Not sampled upstream: still continued, flags unchanged.
        let unsampled = HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00");
        let trace = RequestTrace::start(None, Some(&unsampled), None);
        let outgoing = trace.traceparent().unwrap();
        assert!(outgoing.to_str().unwrap().ends_with("-00"));
        assert_eq!(trace.tracestate(), None);

        // A later version is continued as version 00.
        let future =
            HeaderValue::from_static("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra");
        let trace = RequestTrace::start(None, Some(&future), None);
        assert!(trace
            .traceparent()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("00-4bf92f3577b34da6"));

        // Two requests of one trace get two span ids.
        let a = RequestTrace::start(None, Some(&incoming), None);
        let b = RequestTrace::start(None, Some(&incoming), None);
        assert_ne!(a.span_id(), b.span_id());
    }

    #[test]
    fn without_export_no_context_is_invented() {
        let trace = RequestTrace::start(None, None, None);
        assert!(trace.traceparent().is_none());
        assert!(trace.trace_id().is_none());
        // An invalid traceparent is absent, and its tracestate is not passed on.
        let bad = HeaderValue::from_static("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01");
        let state = HeaderValue::from_static("rojo=00f067aa0ba902b7");
        let trace = RequestTrace::start(None, Some(&bad), Some(&state));
        assert!(trace.traceparent().is_none());
        assert!(trace.tracestate().is_none());
    }

    #[test]
    fn host_split() {
        assert_eq!(split_host("example.com"), ("example.com", None));
        assert_eq!(split_host("example.com:8080"), ("example.com", Some(8080)));
        assert_eq!(split_host("[::1]:8080"), ("::1", Some(8080)));
        assert_eq!(split_host("[::1]"), ("::1", None));
        assert_eq!(split_host("::1"), ("::1", None));
        assert_eq!(split_host("example.com:http"), ("example.com:http", None));
    }

    #[test]
    fn query_is_cut() {
        assert_eq!(path_without_query("/a/b?key=secret"), "/a/b");
        assert_eq!(path_without_query("/a/b"), "/a/b");
    }
}
