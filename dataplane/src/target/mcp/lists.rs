//! Lists across servers: `tools/list`, `prompts/list`, `resources/list` and
//! `resources/templates/list` fan out to every server (of the client's session) at once; the answer
//! merges their pages, names prefixed, items no rule could allow left out. When servers
//! have further pages, `nextCursor` holds each one's own cursor, so the next call asks only
//! those servers for their next page
//! (<https://modelcontextprotocol.io/specification/2025-11-25/server/utilities/pagination>).

use std::collections::BTreeMap;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use http::Response;
use portcullis_config::mcp_rules::{Item, ItemKind};
use portcullis_config::McpFailureMode;
use serde_json::{json, Map, Value};

use super::cache;
use super::reach::Downstream;
use super::{
    caller, inject_trace, invalid_params, session_not_found, upstream_failed, Exchange, McpTarget, Problem,
};
use crate::body::Body;

/// The shape of one kind of list.
struct ListKind {
    /// The result's array.
    field: &'static str,
    /// Each item's name or URI, prefixed with its server.
    key: &'static str,
    /// What rules judge, if they judge these items at all (templates are not items).
    judged: Option<ItemKind>,
    renamed: ItemKind,
}

fn list_kind(method: &str) -> Option<ListKind> {
    let (field, key, judged, renamed) = match method {
        "tools/list" => ("tools", "name", Some(ItemKind::Tool), ItemKind::Tool),
        "prompts/list" => ("prompts", "name", Some(ItemKind::Prompt), ItemKind::Prompt),
        "resources/list" => ("resources", "uri", Some(ItemKind::Resource), ItemKind::Resource),
        "resources/templates/list" => ("resourceTemplates", "uriTemplate", None, ItemKind::Resource),
        _ => return None,
    };
    Some(ListKind {
        field,
        key,
        judged,
        renamed,
    })
}

/// Each server still to be asked, with its own cursor (`None`: its first page).
type Cursor = BTreeMap<String, Option<String>>;

fn encode_cursor(cursor: &Cursor) -> String {
    URL_SAFE_NO_PAD.encode(serde_json::to_vec(cursor).unwrap_or_default())
}

fn decode_cursor(text: &str) -> Option<Cursor> {
    serde_json::from_slice(&URL_SAFE_NO_PAD.decode(text).ok()?).ok()
}

impl McpTarget {
    pub(super) async fn list(
        &self,
        exchange: &mut Exchange<'_>,
        downstream: &Downstream,
        id: &Value,
        method: &str,
        mut params: Map<String, Value>,
    ) -> Response<Body> {
        let Some(kind) = list_kind(method) else {
            return invalid_params(id, format!("{method} is not a list"));
        };
        let asked: Cursor = match params.remove("cursor") {
            None | Some(Value::Null) => self
                .servers
                .iter()
                .map(|server| (server.name.to_string(), None))
                .collect(),
            Some(Value::String(text)) => match decode_cursor(&text) {
                Some(cursor) if cursor.keys().all(|server| self.server_index(server).is_some()) => cursor,
                _ => return invalid_params(id, "Invalid params: unknown cursor".into()),
            },
            Some(_) => return invalid_params(id, "Invalid params: cursor must be a string".into()),
        };
        let mut base = Value::Object(params);
        inject_trace(&mut base, exchange);
        let cursor_of = |index: usize| asked.get(&*self.servers[index].name).cloned().flatten();
        // Credentials when the client sends some, else its session, else its address.
        let caller_key = match (exchange.headers.get(http::header::AUTHORIZATION), downstream) {
            (Some(credentials), _) => self.lists.caller(credentials.as_bytes()),
            (None, Downstream::Legacy(_)) => self.lists.caller(
                exchange
                    .headers
                    .get(&super::server::SESSION_ID)
                    .map(|id| id.as_bytes()),
            ),
            (None, Downstream::Modern(_)) => self.lists.caller(exchange.ctx.client_ip),
        };
        let mut pages = Vec::new();
        let mut indexes = Vec::new();
        for index in asked.keys().filter_map(|name| self.server_index(name)) {
            match self
                .lists
                .get(index, method, cursor_of(index).as_deref(), caller_key)
            {
                Some(page) => pages.push((index, Ok(page))),
                None => indexes.push(index),
            }
        }
        let message = |index: usize| {
            let mut params = base.clone();
            if let Some(Some(cursor)) = asked.get(&*self.servers[index].name) {
                params["cursor"] = Value::from(cursor.as_str());
            }
            json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
        };
        for (index, outcome) in self.ask_each(exchange, downstream, &indexes, message).await {
            if let Ok(page) = &outcome {
                if let Some(reuse) = cache::Reuse::of(page, self.servers[index].list_ttl) {
                    self.lists.put(
                        index,
                        method,
                        cursor_of(index).as_deref(),
                        caller_key,
                        reuse,
                        page,
                    );
                }
            }
            pages.push((index, outcome));
        }
        pages.sort_by_key(|(index, _)| *index);

        let judging = kind.judged.is_some() && pages.iter().any(|(index, _)| !self.rules[*index].is_empty());
        let caller = judging.then(|| caller(exchange));
        let mut items = Vec::new();
        let mut next = Cursor::new();
        for (index, outcome) in pages {
            let server = &self.servers[index];
            let page = match outcome {
                Ok(page) => page,
                Err(Problem::SessionGone) => return session_not_found(id),
                Err(Problem::Failed(error)) if server.failure_mode == McpFailureMode::Omit => {
                    tracing::warn!(target = %self.name, %error, "MCP server left out of a list");
                    continue;
                }
                Err(Problem::Failed(error)) => return upstream_failed(id, &self.name, &error),
            };
            if let Some(cursor) = page.get("nextCursor").and_then(Value::as_str) {
                next.insert(server.name.to_string(), Some(cursor.to_string()));
            }
            let Some(Value::Array(page_items)) = page.get(kind.field) else {
                continue;
            };
            for item in page_items {
                let Some(own) = item.get(kind.key).and_then(Value::as_str) else {
                    continue;
                };
                if let (Some(judged), Some(caller)) = (kind.judged, &caller) {
                    let listed = Item {
                        kind: judged,
                        server: &server.name,
                        name: own,
                        arguments: None,
                    };
                    if !self.rules[index].judge(caller, listed).permits() {
                        continue;
                    }
                }
                let mut item = item.clone();
                item[kind.key] = Value::from(self.public_name(&server.name, kind.renamed, own));
                items.push(item);
            }
        }
        let mut result = json!({ kind.field: items });
        if !next.is_empty() {
            result["nextCursor"] = Value::from(encode_cursor(&next));
        }
        if matches!(downstream, Downstream::Modern(_)) {
            // Filtered per caller: a shared cache must not keep it.
            result["ttlMs"] = Value::from(0);
            result["cacheScope"] = Value::from("private");
            result["resultType"] = Value::from("complete");
        }
        super::jsonrpc::result(id, result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_garbage_is_refused() {
        let cursor: Cursor = [
            ("math".to_string(), Some("p2".to_string())),
            ("web".to_string(), None),
        ]
        .into();
        assert_eq!(decode_cursor(&encode_cursor(&cursor)), Some(cursor));
        assert_eq!(decode_cursor("not a cursor"), None);
        assert_eq!(decode_cursor(&URL_SAFE_NO_PAD.encode(b"[1,2]")), None);
    }
}
