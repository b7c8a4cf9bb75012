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
use std::sync::Arc;

use portcullis_config::mcp_rules::{Caller, Item, ItemKind};
use portcullis_config::{McpFailureMode, MAX_TOOL_LIST_PAGES};
use serde_json::{json, Map, Value};

use super::cache::{self, PageRef};
use super::reach::Downstream;
use super::{inject_trace, invalid_params, session_not_found, upstream_failed, Exchange, McpTarget, Problem};
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

/// One server's page, ready to merge: each item renamed and serialized once, with the
/// rules' verdict when it cannot depend on the caller. What the cache keeps.
#[derive(Debug, PartialEq)]
pub(super) struct Page {
    items: Vec<PageItem>,
    next_cursor: Option<String>,
}

#[derive(Debug, PartialEq)]
struct PageItem {
    /// The item's own name or URI, for rules that read the caller.
    own: String,
    json: String,
    /// Listed or not, when every rule's verdict is the same for every caller.
    listed: Option<bool>,
}

impl Page {
    /// What keeping it costs, roughly.
    pub(super) fn bytes(&self) -> usize {
        self.items
            .iter()
            .map(|item| item.json.len() + item.own.len())
            .sum::<usize>()
            + self.next_cursor.as_ref().map_or(0, String::len)
    }
}

#[cfg(test)]
impl Page {
    pub(super) fn of_names(names: &[&str]) -> Page {
        Page {
            items: names
                .iter()
                .map(|name| PageItem {
                    own: name.to_string(),
                    json: json!({"name": name}).to_string(),
                    listed: Some(true),
                })
                .collect(),
            next_cursor: None,
        }
    }
}

impl McpTarget {
    /// Renames and serializes a server's page, judging its items now if no rule reads the
    /// caller.
    /// `first`: the server's first page, so with no next page it is the whole list.
    /// `changes`: what [`cache::ListCache::changes`] said before the page was asked for.
    fn page(&self, index: usize, kind: &ListKind, mut answer: Value, first: bool, changes: u64) -> Page {
        let server = &self.servers[index].name;
        let pins = self.pins[index]
            .as_ref()
            .filter(|_| kind.judged == Some(ItemKind::Tool));
        let mut pinned_tools = Vec::new();
        let rules = &self.rules[index];
        let fixed_verdicts = kind.judged.is_none() || rules.is_empty() || !rules.reads_caller();
        // Unread by the rules (checked above): any caller will do.
        let nobody = Caller::new(std::net::IpAddr::from([0, 0, 0, 0]), []);
        let next_cursor = answer
            .get("nextCursor")
            .and_then(Value::as_str)
            .map(str::to_string);
        let items = match answer.get_mut(kind.field).map(Value::take) {
            Some(Value::Array(items)) => items,
            _ => Vec::new(),
        };
        let items = items
            .into_iter()
            .filter_map(|mut item| {
                let own = item.get(kind.key)?.as_str()?.to_string();
                let hidden = pins.is_some_and(|pins| {
                    let live = portcullis_config::tool_digest(
                        &own,
                        item.get("description"),
                        item.get("inputSchema"),
                    );
                    let hides = pins.hides(&own, &live);
                    pinned_tools.push((own.clone(), live));
                    hides
                });
                item[kind.key] = Value::from(self.public_name(server, kind.renamed, &own));
                let listed = match kind.judged {
                    _ if hidden => Some(false),
                    None => Some(true),
                    Some(_) if !fixed_verdicts => None,
                    Some(judged) => Some(rules.judge(&nobody, listed_item(judged, server, &own)).permits()),
                };
                Some(PageItem {
                    json: item.to_string(),
                    own,
                    listed,
                })
            })
            .collect();
        if pins.is_some() {
            let whole: Option<Vec<String>> = (first && next_cursor.is_none())
                .then(|| pinned_tools.iter().map(|(tool, _)| tool.clone()).collect());
            let current = || changes == self.lists.changes(index, "tools/list");
            self.saw_tools(index, pinned_tools, whole.as_deref(), current);
        }
        Page { items, next_cursor }
    }

    /// Reads server `index`'s whole tool list (up to [`MAX_TOOL_LIST_PAGES`] pages) in the
    /// client's session, so its tools can be judged against their pins.
    pub(super) async fn list_whole(
        &self,
        exchange: &Exchange<'_>,
        downstream: &Downstream,
        index: usize,
    ) -> Result<(), Problem> {
        let Some(kind) = list_kind("tools/list") else {
            return Ok(());
        };
        let mut cursor: Option<String> = None;
        let mut names = Vec::new();
        let changes = self.lists.changes(index, "tools/list");
        for page_number in 0..MAX_TOOL_LIST_PAGES {
            let mut params = json!({});
            if let Some(cursor) = &cursor {
                params["cursor"] = Value::from(cursor.as_str());
            }
            let message = json!({"jsonrpc": "2.0", "id": Self::pin_check_id(), "method": "tools/list", "params": params});
            // Not in the client's session: its session began before the server was added.
            let Some((_, answer)) = self
                .ask_each(exchange, downstream, &[index], |_| message.clone())
                .await
                .pop()
            else {
                return Err(Problem::SessionGone);
            };
            let page = self.page(index, &kind, answer?, cursor.is_none(), changes);
            names.extend(page.items.iter().map(|item| item.own.clone()));
            match page.next_cursor {
                Some(next) => cursor = Some(next),
                // One page: `page` recorded it whole.
                None if page_number == 0 => return Ok(()),
                None => {
                    // Page by page, each recorded as it came; now what the whole lacks is gone.
                    let current = || changes == self.lists.changes(index, "tools/list");
                    self.saw_tools(index, Vec::new(), Some(&names), current);
                    return Ok(());
                }
            }
        }
        Err(Problem::Failed(format!(
            "its tools/list runs beyond {MAX_TOOL_LIST_PAGES} pages"
        )))
    }

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
        let mut pages: Vec<(usize, Result<Arc<Page>, Problem>)> = Vec::new();
        let mut indexes = Vec::new();
        // A session lists only its own servers, reused pages included.
        let in_session = |name: &str| match downstream {
            Downstream::Legacy(session) => session.server(name).is_some(),
            Downstream::Modern(_) => true,
        };
        for index in asked
            .keys()
            .filter(|name| in_session(name))
            .filter_map(|name| self.server_index(name))
        {
            let cursor = cursor_of(index);
            let at = PageRef {
                server: index,
                method,
                cursor: cursor.as_deref(),
            };
            match self.lists.get(at, caller_key) {
                Some(page) => pages.push((index, Ok(page))),
                None => indexes.push(index),
            }
        }
        // Read before asking: a change the server tells while its page is on the way wins.
        let changes: Vec<u64> = (0..self.servers.len())
            .map(|index| self.lists.changes(index, method))
            .collect();
        let message = |index: usize| {
            let mut params = base.clone();
            if let Some(cursor) = cursor_of(index) {
                params["cursor"] = Value::from(cursor);
            }
            json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
        };
        for (index, outcome) in self.ask_each(exchange, downstream, &indexes, message).await {
            let outcome = outcome.map(|answer| {
                let reuse = cache::Reuse::of(&answer, self.servers[index].list_ttl);
                let cursor = cursor_of(index);
                let page = Arc::new(self.page(index, &kind, answer, cursor.is_none(), changes[index]));
                if let Some(reuse) = reuse {
                    let at = PageRef {
                        server: index,
                        method,
                        cursor: cursor.as_deref(),
                    };
                    self.lists.put(at, caller_key, changes[index], reuse, &page);
                }
                page
            });
            pages.push((index, outcome));
        }
        pages.sort_by_key(|(index, _)| *index);

        let mut caller = None;
        let mut items = String::new();
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
            if let Some(cursor) = &page.next_cursor {
                next.insert(server.name.to_string(), Some(cursor.clone()));
            }
            for item in &page.items {
                let listed = match (item.listed, kind.judged) {
                    (Some(listed), _) => listed,
                    (None, None) => true,
                    (None, Some(judged)) => {
                        let caller = caller.get_or_insert_with(|| super::caller(exchange));
                        self.rules[index]
                            .judge(caller, listed_item(judged, &server.name, &item.own))
                            .permits()
                    }
                };
                if listed {
                    if !items.is_empty() {
                        items.push(',');
                    }
                    items.push_str(&item.json);
                }
            }
        }
        // Assembled from the items' serialized forms: a reused page is not serialized again.
        let mut result = format!(r#"{{"{}":[{items}]"#, kind.field);
        if !next.is_empty() {
            result.push_str(&format!(r#","nextCursor":{}"#, Value::from(encode_cursor(&next))));
        }
        if matches!(downstream, Downstream::Modern(_)) {
            // Filtered per caller: a shared cache must not keep it.
            result.push_str(r#","ttlMs":0,"cacheScope":"private","resultType":"complete""#);
        }
        super::jsonrpc::serialized(format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{result}}}}}"#))
    }
}

/// An item as rules see it while listing: no arguments.
fn listed_item<'a>(kind: ItemKind, server: &'a str, own: &'a str) -> Item<'a> {
    Item {
        kind,
        server,
        name: own,
        arguments: None,
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
