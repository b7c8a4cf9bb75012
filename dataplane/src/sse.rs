//! Server-Sent Events (<https://html.spec.whatwg.org/multipage/server-sent-events.html>), read
//! incrementally from a body passing through (LLM streams, MCP answers): events end at a
//! blank line; lines end in CRLF, LF or CR; `data:` lines join with `\n`; comment lines
//! (`: ping`) are ignored.

use bytes::{Bytes, BytesMut};

/// A comment event, which SSE clients ignore: what a relayed stream sends in place of the
/// comments (keep-alives) it read, and what the gateway's own streams send when idle.
pub(crate) const KEEPALIVE_COMMENT: &[u8] = b": keepalive\n\n";

/// One event's fields that MCP uses.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Event {
    pub(crate) id: Option<String>,
    pub(crate) event: Option<String>,
    pub(crate) data: String,
    pub(crate) retry: Option<String>,
}

impl Event {
    pub(crate) fn encode(&self) -> Bytes {
        let mut out = String::new();
        if let Some(event) = &self.event {
            out.push_str(&format!("event: {event}\n"));
        }
        if let Some(id) = &self.id {
            out.push_str(&format!("id: {id}\n"));
        }
        if let Some(retry) = &self.retry {
            out.push_str(&format!("retry: {retry}\n"));
        }
        for line in self.data.split('\n') {
            out.push_str(&format!("data: {line}\n"));
        }
        out.push('\n');
        Bytes::from(out)
    }
}

/// Incremental parser: feed chunks as they arrive, take whole events out.
#[derive(Default)]
pub(crate) struct Parser {
    /// The unfinished line, line ends normalized to `\n`.
    buffer: BytesMut,
    /// How far `buffer` has been searched for a line end.
    scanned: usize,
    /// The last byte fed was a CR (its LF, if one follows, is dropped).
    after_cr: bool,
    current: Event,
    has_fields: bool,
    data_lines: usize,
    /// A comment line came since [`Parser::took_comment`] was last asked.
    comment: bool,
}

impl Parser {
    /// Bytes held waiting for the end of an event.
    pub(crate) fn pending(&self) -> usize {
        self.buffer.len() + self.current.data.len()
    }

    /// An event has begun and not ended.
    pub(crate) fn in_event(&self) -> bool {
        self.has_fields || !self.buffer.is_empty()
    }

    pub(crate) fn feed(&mut self, chunk: &[u8], events: &mut Vec<Event>) {
        // Most servers end lines with LF alone: such a chunk is copied as it is.
        if self.after_cr || chunk.contains(&b'\r') {
            for &byte in chunk {
                match byte {
                    b'\r' => self.buffer.extend_from_slice(b"\n"),
                    b'\n' if self.after_cr => {}
                    _ => self.buffer.extend_from_slice(&[byte]),
                }
                self.after_cr = byte == b'\r';
            }
        } else {
            self.buffer.extend_from_slice(chunk);
        }
        // Search only what is new: a long line arriving in many chunks stays linear.
        while let Some(end) = self.buffer[self.scanned..].iter().position(|&byte| byte == b'\n') {
            let line = self.buffer.split_to(self.scanned + end + 1);
            self.scanned = 0;
            let line = &line[..line.len() - 1];
            if line.is_empty() {
                if self.has_fields {
                    events.push(std::mem::take(&mut self.current));
                    self.has_fields = false;
                    self.data_lines = 0;
                }
                continue;
            }
            self.line(line);
        }
        self.scanned = self.buffer.len();
    }

    /// Whether a comment line (a keep-alive, mostly) came since the last time this was asked:
    /// a stream relayed event by event passes that on, so idle timeouts downstream see it too.
    pub(crate) fn took_comment(&mut self) -> bool {
        std::mem::take(&mut self.comment)
    }

    fn line(&mut self, line: &[u8]) {
        if line.starts_with(b":") {
            self.comment = true;
            return;
        }
        let text = String::from_utf8_lossy(line);
        let (field, value) = match text.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (text.as_ref(), ""),
        };
        match field {
            "data" => {
                if self.data_lines > 0 {
                    self.current.data.push('\n');
                }
                self.current.data.push_str(value);
                self.data_lines += 1;
            }
            "event" => self.current.event = Some(value.to_string()),
            "id" => self.current.id = Some(value.to_string()),
            "retry" => self.current.retry = Some(value.to_string()),
            _ => return,
        }
        self.has_fields = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(chunks: &[&str]) -> Vec<Event> {
        let mut parser = Parser::default();
        let mut events = Vec::new();
        for chunk in chunks {
            parser.feed(chunk.as_bytes(), &mut events);
        }
        events
    }

    #[test]
    fn events_split_across_chunks_and_line_ends() {
        let events = parse(&[
            ": ping\r\n\r\nevent: message\r\nda",
            "ta: {\"a\":1}\r\n\r",
            "\nid: 7\ndata: x\rdata: y\n\n",
            "data: unfinished",
        ]);
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].event.as_deref(), Some("message"));
        assert_eq!(events[0].data, "{\"a\":1}");
        assert_eq!(events[1].id.as_deref(), Some("7"));
        assert_eq!(events[1].data, "x\ny");
    }

    #[test]
    fn an_event_encodes_back_to_what_parses_the_same() {
        let event = Event {
            id: Some("3".into()),
            event: Some("message".into()),
            data: "one\ntwo".into(),
            retry: None,
        };
        assert_eq!(
            parse(&[std::str::from_utf8(&event.encode()).unwrap()]),
            vec![event]
        );
    }

    #[test]
    fn a_priming_event_with_empty_data_is_an_event() {
        let events = parse(&["id: 1\ndata:\n\n"]);
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].data, "");
    }
}
