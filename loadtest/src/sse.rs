//! Server-sent events framing (WHATWG HTML, "server-sent events"): bytes → the `data`
//! payload of each event. One parser for the LLM client (OpenAI-compatible streams), the MCP
//! client (Streamable HTTP responses) and the vLLM simulator's tests; what a payload means is
//! each caller's business.
//!
//! Parsing is incremental because for LLM streams a chunk's arrival time *is* the
//! measurement: TTFT and every inter-token gap are stamped when the bytes carrying a content
//! delta are read, not when the body completes. Lines are buffered as bytes, so a UTF-8
//! character split across reads is decoded whole.

/// Splits a byte stream into SSE events and yields each event's `data` payload.
#[derive(Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Option<String>,
}

impl SseParser {
    /// Feeds bytes; appends the payload of every event they complete to `out`.
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<String>) -> Result<(), String> {
        self.buf.extend_from_slice(bytes);
        let mut start = 0;
        while let Some(pos) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let end = start + pos;
            let line = self.buf[start..end]
                .strip_suffix(b"\r")
                .unwrap_or(&self.buf[start..end]);
            let line = std::str::from_utf8(line).map_err(|_| "SSE line is not UTF-8".to_string())?;
            if line.is_empty() {
                // A blank line ends the event.
                out.extend(self.data.take());
            } else if let Some(value) = line.strip_prefix("data:") {
                let value = value.strip_prefix(' ').unwrap_or(value);
                match &mut self.data {
                    Some(data) => {
                        data.push('\n');
                        data.push_str(value);
                    }
                    None => self.data = Some(value.to_string()),
                }
            }
            // Comments (`:`), `event:`, `id:` and `retry:` carry nothing any caller uses.
            start = end + 1;
        }
        self.buf.drain(..start);
        Ok(())
    }

    /// Ends the stream. An event the body cut off before its blank line is still delivered
    /// (the standard drops it): the callers check every payload anyway, and a complete
    /// JSON-RPC answer should not be lost to a server that omits the final blank line.
    pub fn finish(mut self, out: &mut Vec<String>) -> Result<(), String> {
        self.feed(b"\n\n", out)
    }
}

/// The payloads of a complete body, in order (see [`SseParser::finish`] for its end).
pub fn payloads(body: &[u8]) -> Result<Vec<String>, String> {
    let mut parser = SseParser::default();
    let mut out = Vec::new();
    parser.feed(body, &mut out)?;
    parser.finish(&mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_reads_are_reassembled() {
        let stream = "data: {\"choices\":[{\"text\":\"a\"}]}\r\n\r\n: keep-alive\n\ndata: [DONE]\n\n";
        let mut parser = SseParser::default();
        let mut out = Vec::new();
        for byte in stream.as_bytes().chunks(3) {
            parser.feed(byte, &mut out).unwrap();
        }
        assert_eq!(
            out,
            vec![
                "{\"choices\":[{\"text\":\"a\"}]}".to_string(),
                "[DONE]".to_string()
            ]
        );
        let mut bad = SseParser::default();
        assert!(bad.feed(b"data: \xff\n", &mut out).is_err());
    }

    #[test]
    fn whole_bodies_handle_crlf_comments_multiline_data_and_a_missing_final_blank_line() {
        let body = b": ping\r\n\r\nevent: message\r\ndata: {\"id\":1,\r\ndata: \"x\":2}\r\n\r\nid: 7\ndata: {\"id\":2}";
        assert_eq!(
            payloads(body),
            Ok(vec!["{\"id\":1,\n\"x\":2}".to_string(), "{\"id\":2}".to_string()])
        );
        let split = "data: é\n\n".as_bytes();
        let mut parser = SseParser::default();
        let mut out = Vec::new();
        for byte in split.chunks(1) {
            parser.feed(byte, &mut out).unwrap();
        }
        assert_eq!(out, vec!["é".to_string()]);
    }
}
