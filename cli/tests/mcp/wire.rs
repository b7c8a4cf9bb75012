//! MCP on the wire: a raw session over HTTP/1.1, for exact checks of status, code and body.

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::*;

/// A raw MCP session over HTTP/1.1, for checks on the wire.
pub(crate) struct Wire {
    pub(crate) port: u16,
    pub(crate) session: String,
    /// The `Authorization` header every request of the session carries, if any.
    pub(crate) authorization: Option<String>,
}

pub(crate) const ACCEPT_BOTH: (&str, &str) = ("Accept", "application/json, text/event-stream");

impl Wire {
    pub(crate) fn initialize(port: u16) -> Wire {
        Wire::initialize_as(port, None)
    }

    /// A session opened with `Authorization: {authorization}`, which its requests carry.
    pub(crate) fn initialize_as(port: u16, authorization: Option<&str>) -> Wire {
        let body = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "wire", "version": "0"}}});
        let mut headers = vec![ACCEPT_BOTH];
        headers.extend(authorization.map(|value| ("Authorization", value)));
        let response = http_request_with(port, "POST", "/mcp", &headers, Some(&body.to_string())).unwrap();
        assert_eq!(response.status, 200, "{}", response.body);
        let session = header(&response, "mcp-session-id").expect("a session id");
        let answer: Value = serde_json::from_str(&response.body).unwrap();
        assert_eq!(answer["result"]["protocolVersion"], "2025-06-18");
        Wire {
            port,
            session,
            authorization: authorization.map(str::to_string),
        }
    }

    pub(crate) fn post(&self, body: &Value) -> (u16, Value) {
        let mut headers = vec![
            ACCEPT_BOTH,
            ("Mcp-Session-Id", self.session.as_str()),
            ("MCP-Protocol-Version", "2025-06-18"),
        ];
        headers.extend(
            self.authorization
                .as_deref()
                .map(|value| ("Authorization", value)),
        );
        let response =
            http_request_with(self.port, "POST", "/mcp", &headers, Some(&body.to_string())).unwrap();
        (response.status, json_or_last_event(&response.body))
    }

    pub(crate) fn call(&self, tool: &str, args: Value) -> (u16, Value) {
        self.post(&json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": tool, "arguments": args}}))
    }

    pub(crate) fn tools(&self) -> Vec<String> {
        let (status, answer) = self.post(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}));
        assert_eq!(status, 200);
        let mut names: Vec<String> = answer["result"]["tools"]
            .as_array()
            .unwrap_or_else(|| panic!("no tools in {answer}"))
            .iter()
            .map(|tool| tool["name"].as_str().unwrap().to_string())
            .collect();
        names.sort();
        names
    }
}

pub(crate) fn header(response: &HttpResponse, name: &str) -> Option<String> {
    response.head.lines().find_map(|line| {
        let (field, value) = line.split_once(':')?;
        field.eq_ignore_ascii_case(name).then(|| value.trim().to_string())
    })
}

/// The JSON body, or the last `data:` of an SSE body.
pub(crate) fn json_or_last_event(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|_| {
        body.lines()
            .rev()
            .filter_map(|line| line.strip_prefix("data:"))
            .find_map(|data| serde_json::from_str(data.trim()).ok())
            .unwrap_or(Value::Null)
    })
}

/// Whether `bytes` hold a whole HTTP/1.1 request with a `Content-Length` body.
pub(crate) fn whole_request(bytes: &[u8]) -> bool {
    let text = String::from_utf8_lossy(bytes);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    let length = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    body.len() >= length
}

/// Request headers, body, expected HTTP status and JSON-RPC error code.
pub(crate) type Case<'a> = (&'a [(&'a str, &'a str)], &'a str, u16, i64);

pub(crate) fn raw_request(port: u16, raw: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream.write_all(raw.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out);
    out
}

/// A response read as it comes over a raw connection: for streams that do not end.
pub(crate) struct Streaming {
    stream: std::net::TcpStream,
    seen: String,
}

impl Streaming {
    pub(crate) fn post(port: u16, headers: &[(&str, &str)], body: &str) -> Streaming {
        use std::io::Write;
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let mut request = format!(
            "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
        request.push_str(body);
        stream.write_all(request.as_bytes()).unwrap();
        Streaming {
            stream,
            seen: String::new(),
        }
    }

    /// Reads until `what` has come (within the suite's timeout); everything read so far.
    pub(crate) fn until(&mut self, what: &str) -> &str {
        use std::io::Read;
        let deadline = std::time::Instant::now() + TIMEOUT;
        let mut buffer = [0; 4096];
        while !self.seen.contains(what) {
            assert!(
                std::time::Instant::now() < deadline,
                "no {what} in: {}",
                self.seen
            );
            match self.stream.read(&mut buffer) {
                Ok(0) => panic!("the stream ended before {what}: {}", self.seen),
                Ok(read) => self.seen.push_str(&String::from_utf8_lossy(&buffer[..read])),
                Err(error)
                    if matches!(
                        error.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(error) => panic!("reading the stream: {error}"),
            }
        }
        &self.seen
    }
}

/// The JSON-RPC messages of the SSE events in `text` (a raw HTTP response, chunked or not).
pub(crate) fn events(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str(data).ok())
        .collect()
}
