//! A request for one item of one server (`tools/call`, `prompts/get`, `resources/read`,
//! `completion/complete`, and messages passed through): authorized, held to pins and
//! guardrails, sent the way the server's revision wants, and its answer relayed as it comes.

use http::{Response, StatusCode};
use portcullis_config::mcp_rules::{Item, ItemKind};
use portcullis_config::{GuardrailPhase, COMPLETION};
use serde_json::{json, Map, Value};

use super::authz::Judgement;
use super::jsonrpc::{self, invalid_params, session_not_found, upstream_failed};
use super::reach::{self, Downstream, Reach, Sent};
use super::resume::{Resumption, SessionStream};
use super::server::Server;
use super::{caller, guarded, inject_trace, input, remap, server, session_header, Exchange, McpTarget};
use crate::body::{self, Body};
use crate::policy::guardrail::Asker;

impl McpTarget {
    pub(super) async fn call(
        &self,
        exchange: &mut Exchange<'_>,
        downstream: &Downstream,
        id: &Value,
        method: &str,
        mut params: Map<String, Value>,
        kind: ItemKind,
    ) -> Response<Body> {
        let field = if kind == ItemKind::Resource { "uri" } else { "name" };
        let Some(public) = params.get(field).and_then(Value::as_str).map(str::to_string) else {
            return invalid_params(id, format!("Invalid params: {method} needs params.{field}"));
        };
        // Tasks (2025-11-25) are not offered: a task's result would come later, by
        // `tasks/result`, past the guardrails that check this call's answer.
        params.remove("task");
        let Some((index, own)) = self.resolve(kind, &public) else {
            let what = match kind {
                ItemKind::Tool => "tool",
                ItemKind::Prompt => "prompt",
                ItemKind::Resource => "resource",
            };
            return invalid_params(id, format!("Unknown {what}: {public}"));
        };
        let empty = Value::Object(Map::new());
        let arguments = match kind {
            ItemKind::Resource => &empty,
            _ => params.get("arguments").unwrap_or(&empty),
        };
        if !arguments.is_object() {
            return invalid_params(
                id,
                format!("Invalid params: {method} takes params.arguments as an object"),
            );
        }
        let item = Item {
            kind,
            server: &self.servers[index].name,
            name: own,
            arguments: Some(arguments),
        };
        if let Some(record) = &mut exchange.ctx.mcp {
            record.server = Some(self.servers[index].name.clone());
            record.name = Some(own.to_string());
        }
        if let Some(denied) = self.authorize(exchange, id, &public, item) {
            return denied;
        }
        if kind == ItemKind::Tool {
            if let Some(refused) = self.hold_to_pins(exchange, downstream, id, index, own).await {
                return refused;
            }
        }
        let guards = &self.guards[index];
        let checked = guarded::Item {
            server: self.servers[index].name.to_string(),
            method: method.to_string(),
            name: own.to_string(),
            public: public.clone(),
        };
        let asker = (guards.request.select(GuardrailPhase::McpRequest, method, own)
            || guards.response.select(GuardrailPhase::McpResponse, method, own))
        .then(|| Asker::new(exchange.ctx, &self.name, &exchange.headers));
        if let (Some(asker), true) = (
            &asker,
            guards.request.select(GuardrailPhase::McpRequest, method, own),
        ) {
            let arguments = arguments.clone();
            match guarded::check_request(&guards.request, asker, &checked, id, arguments).await {
                Ok(Some(arguments)) => {
                    // What is sent must be what the rules allow: they judged the
                    // arguments the client sent, so they judge the replacement too.
                    let item = Item {
                        arguments: Some(&arguments),
                        ..item
                    };
                    if let Some(denied) = self.authorize(exchange, id, &public, item) {
                        return denied;
                    }
                    params.insert("arguments".into(), arguments);
                }
                Ok(_) => {}
                Err(refused) => return refused,
            }
        }
        params.insert(field.into(), Value::from(own));
        let mut params = Value::Object(params);
        inject_trace(&mut params, exchange);
        let message = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        let answer = self.forward(exchange, downstream, index, message).await;
        match asker {
            Some(asker) if guards.response.select(GuardrailPhase::McpResponse, method, own) => {
                guarded::check_response(answer, guards.response.clone(), asker, checked, id.clone()).await
            }
            _ => answer,
        }
    }

    /// `None` when the item may be used; otherwise the denial, recorded in the context.
    pub(super) fn authorize(
        &self,
        exchange: &mut Exchange<'_>,
        id: &Value,
        public: &str,
        item: Item<'_>,
    ) -> Option<Response<Body>> {
        let rules = &self.rules[self.server_index(item.server)?];
        if rules.is_empty() {
            return None;
        }
        match rules.judge(&caller(exchange), item) {
            Judgement::Unrestricted => None,
            Judgement::Allowed { policy } => {
                exchange.ctx.decisions.push((policy, "allow"));
                None
            }
            // Every use passes its arguments: only a listing leaves rules undecided.
            Judgement::Undecided => Some(jsonrpc::error(
                StatusCode::OK,
                id,
                jsonrpc::DENIED,
                format!(
                    "{} of {public} is not allowed: its rules read arguments this request does not carry",
                    item.kind.method()
                ),
                None,
                "mcp_denied",
            )),
            Judgement::Denied { policy, reason } => {
                exchange.ctx.decisions.push((policy.clone(), "deny"));
                Some(jsonrpc::error(
                    StatusCode::OK,
                    id,
                    jsonrpc::DENIED,
                    format!(
                        "{policy}: {} of {public} is not allowed: {reason}",
                        item.kind.method()
                    ),
                    Some(json!({"policy": &*policy, "reason": reason})),
                    "mcp_denied",
                ))
            }
        }
    }

    pub(super) async fn complete(
        &self,
        exchange: &mut Exchange<'_>,
        downstream: &Downstream,
        id: &Value,
        mut params: Map<String, Value>,
    ) -> Response<Body> {
        let reference = params.get("ref").cloned().unwrap_or(Value::Null);
        let (kind, field) = match reference.get("type").and_then(Value::as_str) {
            Some("ref/prompt") => (ItemKind::Prompt, "name"),
            Some("ref/resource") => (ItemKind::Resource, "uri"),
            _ => {
                return invalid_params(
                    id,
                    "Invalid params: ref.type must be ref/prompt or ref/resource".into(),
                )
            }
        };
        let Some(public) = reference.get(field).and_then(Value::as_str) else {
            return invalid_params(
                id,
                format!("Invalid params: completion/complete needs ref.{field}"),
            );
        };
        let Some((index, own)) = self.resolve(kind, public) else {
            return invalid_params(id, format!("Unknown reference: {public}"));
        };
        let listing = Item {
            kind,
            server: &self.servers[index].name,
            name: own,
            arguments: None,
        };
        // Rules that read arguments judge a completion by its suggestions: each is judged as
        // a use with it (and the arguments `context` holds), and only those a use could pass
        // reach the client, since suggestions could reveal the values such a rule guards.
        // Other rules judge it as a list judges the item.
        let rules = &self.rules[index];
        let by_suggestion = rules.reads_arguments();
        let denied_outright = matches!(rules.judge(&caller(exchange), listing), Judgement::Denied { .. });
        if !by_suggestion || denied_outright {
            if let Some(denied) = self.authorize(exchange, id, public, listing) {
                return denied;
            }
        }
        // Else what a server reads there is what no rule or guard judged.
        let chosen = match params.get("context") {
            None | Some(Value::Null) => Some(Map::new()),
            Some(Value::Object(context)) => match context.get("arguments") {
                None | Some(Value::Null) => Some(Map::new()),
                Some(Value::Object(chosen)) => Some(chosen.clone()),
                Some(_) => None,
            },
            Some(_) => None,
        };
        let Some(chosen) = chosen else {
            return invalid_params(
                id,
                "Invalid params: completion/complete takes context and context.arguments as objects".into(),
            );
        };
        let completed = params
            .get("argument")
            .and_then(|argument| argument.get("name"))
            .and_then(Value::as_str)
            .map(str::to_string);
        if let Some(refused) = self
            .check_typed(exchange, id, index, own, public, &chosen, &params)
            .await
        {
            return refused;
        }
        let mut reference = reference.clone();
        reference[field] = Value::from(own);
        params.insert("ref".into(), reference);
        let mut params = Value::Object(params);
        inject_trace(&mut params, exchange);
        let message = json!({"jsonrpc": "2.0", "id": id, "method": COMPLETION, "params": params});
        if !by_suggestion {
            return self.forward(exchange, downstream, index, message).await;
        }
        let Some(completed) = completed else {
            return invalid_params(
                id,
                "Invalid params: completion/complete needs argument.name".into(),
            );
        };
        let suggestion = Suggestion {
            listing,
            chosen,
            completed,
        };
        self.complete_by_suggestion(exchange, downstream, index, id, message, suggestion)
            .await
    }

    /// Holds what a completion sends the server (the value typed so far and the arguments
    /// already chosen, as one arguments object) to the McpRequest guards that select
    /// `completion/complete` on the item: `Some` answer when they refuse it. Those values
    /// reach the server as a `prompts/get` or `resources/read` with them would.
    ///
    /// A `context.arguments` that also names the argument being completed, with another
    /// value, is checked as it is too: the server receives both.
    #[allow(clippy::too_many_arguments)]
    async fn check_typed(
        &self,
        exchange: &mut Exchange<'_>,
        id: &Value,
        index: usize,
        own: &str,
        public: &str,
        chosen: &Map<String, Value>,
        params: &Map<String, Value>,
    ) -> Option<Response<Body>> {
        let guards = &self.guards[index].request;
        if !guards.select(GuardrailPhase::McpRequest, COMPLETION, own) {
            return None;
        }
        let argument = params.get("argument");
        let (Some(name), Some(value)) = (
            argument
                .and_then(|argument| argument.get("name"))
                .and_then(Value::as_str),
            argument
                .and_then(|argument| argument.get("value"))
                .filter(|value| value.is_string()),
        ) else {
            return Some(invalid_params(
                id,
                "Invalid params: completion/complete needs argument.name and a string argument.value".into(),
            ));
        };
        let mut checked = vec![with_value(chosen, name, value.clone())];
        if chosen.get(name).is_some_and(|chosen| chosen != value) {
            checked.push(chosen.clone());
        }
        let asker = Asker::new(exchange.ctx, &self.name, &exchange.headers);
        let item = guarded::Item {
            server: self.servers[index].name.to_string(),
            method: COMPLETION.to_string(),
            name: own.to_string(),
            public: public.to_string(),
        };
        for arguments in checked {
            // Not mutable (`guarded::Item::subject`), so a pass never carries a replacement.
            if let Err(refused) =
                guarded::check_request(guards, &asker, &item, id, Value::Object(arguments)).await
            {
                return Some(refused);
            }
        }
        None
    }

    /// Asks the server for its suggestions and answers with those a use with them could pass
    /// (at most [`MAX_COMPLETION_VALUES`]); the server's own error passes as it is.
    async fn complete_by_suggestion(
        &self,
        exchange: &mut Exchange<'_>,
        downstream: &Downstream,
        index: usize,
        id: &Value,
        message: Value,
        suggestion: Suggestion<'_>,
    ) -> Response<Body> {
        let server = &self.servers[index];
        exchange.ctx.endpoint = Some(server.name.clone());
        exchange.ctx.attempts = 1;
        if let Some(record) = &mut exchange.ctx.mcp {
            record.server = Some(server.name.clone());
        }
        let started = std::time::Instant::now();
        let (upstream, trace) = (exchange.upstream, &exchange.ctx.trace);
        let answered = match reach::reach(server, downstream, trace).await {
            Ok(None) => return session_not_found(id),
            Ok(Some(how)) => reach::answer(server, &how, message, upstream, trace).await,
            Err(error) => Err(error),
        };
        let answer = match answered {
            Ok(answer) => answer.message,
            Err(error) if error.session_gone => return session_not_found(id),
            Err(error) => return upstream_failed(id, &self.name, &error.to_string()),
        };
        exchange.ctx.upstream_headers = Some(started.elapsed());
        if answer.get("error").is_some() {
            return jsonrpc::message(&answer);
        }
        let completion = answer["result"]["completion"].as_object();
        let Some(values) = completion
            .and_then(|completion| completion.get("values"))
            .and_then(Value::as_array)
        else {
            return upstream_failed(
                id,
                &self.name,
                "answered a completion without completion.values, which cannot be judged",
            );
        };
        let rules = &self.rules[index];
        let caller = caller(exchange);
        let permitted: Vec<Value> = values
            .iter()
            .take(MAX_COMPLETION_VALUES)
            .filter_map(Value::as_str)
            .filter(|value| {
                let arguments = Value::Object(with_value(
                    &suggestion.chosen,
                    &suggestion.completed,
                    Value::from(*value),
                ));
                let item = Item {
                    arguments: Some(&arguments),
                    ..suggestion.listing
                };
                rules.judge(&caller, item).permits()
            })
            .map(Value::from)
            .collect();
        // Only what was judged is counted: more the server has stay "more", uncounted.
        let more = values.len() > MAX_COMPLETION_VALUES
            || completion
                .and_then(|completion| completion.get("hasMore"))
                .and_then(Value::as_bool)
                == Some(true);
        let judged = if more {
            json!({"values": permitted, "hasMore": true})
        } else {
            json!({"values": permitted, "total": permitted.len(), "hasMore": false})
        };
        let mut result = json!({"completion": judged});
        if matches!(downstream, Downstream::Modern(_)) {
            result["resultType"] = Value::from("complete");
        }
        jsonrpc::result(id, result)
    }

    /// Sends one message to one server and relays its answer as it comes.
    pub(super) async fn forward(
        &self,
        exchange: &mut Exchange<'_>,
        downstream: &Downstream,
        index: usize,
        message: Value,
    ) -> Response<Body> {
        let server = &self.servers[index];
        let id = message.get("id").cloned().unwrap_or(Value::Null);
        exchange.ctx.endpoint = Some(server.name.clone());
        exchange.ctx.attempts = 1;
        if let Some(record) = &mut exchange.ctx.mcp {
            record.server = Some(server.name.clone());
        }
        let trace = &exchange.ctx.trace;
        let how = match reach::reach(server, downstream, trace).await {
            // A server added to the McpBackend after this session began is not in it: the
            // client initializes again and gets it.
            Ok(None) => return session_not_found(&id),
            Ok(Some(how)) => how,
            Err(error) if error.session_gone => return session_not_found(&id),
            Err(error) => return upstream_failed(&id, &self.name, &error.to_string()),
        };
        self.send(exchange, downstream, index, how, message).await
    }

    /// Sends one message to one server, reached `how`, and relays its answer as it comes.
    async fn send(
        &self,
        exchange: &mut Exchange<'_>,
        downstream: &Downstream,
        index: usize,
        how: Reach,
        message: Value,
    ) -> Response<Body> {
        let server = &self.servers[index];
        let id = message.get("id").cloned().unwrap_or(Value::Null);
        let started = std::time::Instant::now();
        let (upstream, trace) = (exchange.upstream, &exchange.ctx.trace);
        // A 2026-07-28 server's questions reach a session-based client as requests.
        let mut translated = None;
        if let (Downstream::Legacy(_), Reach::Modern(client)) = (downstream, &how) {
            let method = message.get("method").and_then(Value::as_str).unwrap_or_default();
            if input::INTERACTIVE.contains(&method) {
                translated = Some(input::Call {
                    target: self.name.clone(),
                    server: server.clone(),
                    upstream: upstream.clone(),
                    client: client.clone(),
                    trace: trace.detached(),
                    session: session_header(&exchange.headers).unwrap_or_default().to_string(),
                    sealer: self.sealer.clone(),
                    message: message.clone(),
                    idle: exchange.route.body_idle_timeout,
                });
            }
        }
        let in_session = matches!(how, Reach::Session { .. });
        // Only a request has an answer; a response or notification the client sent has none.
        let request = message.get("method").is_some();
        let names_resources = self.multiplexed
            && message
                .get("method")
                .and_then(Value::as_str)
                .is_some_and(|method| remap::NAMES_RESOURCES.contains(&method));
        let sent = reach::send(server, &how, message, upstream, trace).await;
        match sent {
            Err(error) if error.session_gone => session_not_found(&id),
            Err(error) => upstream_failed(&id, &self.name, &error.to_string()),
            Ok(Sent::Answered(answer)) => {
                exchange.ctx.upstream_headers = Some(started.elapsed());
                let mut message = answer.message;
                if let Some(result) = message.get_mut("result") {
                    if names_resources {
                        remap::prefix_result_uris(&server.name, result);
                    }
                    if let Value::Object(result) = result {
                        result
                            .entry("resultType")
                            .or_insert_with(|| Value::from("complete"));
                    }
                }
                jsonrpc::message(&message)
            }
            Ok(Sent::Relay(response)) => {
                exchange.ctx.upstream_headers = Some(started.elapsed());
                if let Some(call) = translated {
                    return input::relay(call, response).await;
                }
                let streamed = server::is_event_stream(response.headers());
                let relayed = server::relay(response, exchange.route.body_idle_timeout);
                if streamed {
                    let (mut parts, inner) = relayed.into_parts();
                    // Events are re-encoded: the server's length no longer holds.
                    parts.headers.remove(http::header::CONTENT_LENGTH);
                    let mut events = remap::RemapRequests::new(inner, &server.name).remapping(false);
                    if request {
                        events = events.answering(id.clone());
                    }
                    // Only a session-based server sends the client requests, and list changes,
                    // on its stream.
                    if in_session {
                        events = events
                            .remapping(self.multiplexed)
                            .watching(self.list_watch(index));
                    }
                    // Should the server end the stream early, it is taken up again.
                    if let Reach::Session {
                        id: Some(session),
                        version,
                    } = &how
                    {
                        events = events.resuming(Resumption::of_answer(
                            SessionStream {
                                target: self.name.clone(),
                                server: server.name.clone(),
                                session: session.clone(),
                                version: version.clone(),
                                upstream: exchange.upstream.clone(),
                                trace: exchange.ctx.trace.detached(),
                            },
                            id,
                            exchange.route.body_idle_timeout,
                        ));
                    }
                    Response::from_parts(parts, body::boxed(events))
                } else if request {
                    answer_json(relayed, server, &id, &self.name, names_resources).await
                } else {
                    relayed
                }
            }
        }
    }
}

/// The most suggestions one completion answers with (the MCP specification's limit).
const MAX_COMPLETION_VALUES: usize = 100;

/// A completion whose suggestions are each judged as a use of the item.
struct Suggestion<'a> {
    /// The item, as a list judges it.
    listing: Item<'a>,
    /// The arguments the client chose already (`context.arguments`).
    chosen: Map<String, Value>,
    /// The argument being completed.
    completed: String,
}

/// A server's JSON answer to request `id`, if it is the response to it
/// ([`Server::own_response`]); with `prefix`, the resources its result names get their
/// server's prefix ([`remap::prefix_result_uris`]).
async fn answer_json(
    answer: Response<Body>,
    server: &Server,
    id: &Value,
    target: &str,
    prefix: bool,
) -> Response<Body> {
    let (mut parts, inner) = answer.into_parts();
    let bytes = match server.own_response(inner, parts.status, id).await {
        Ok(bytes) => bytes,
        Err(failure) => return upstream_failed(id, target, &failure.to_string()),
    };
    if prefix {
        if let Ok(mut message) = serde_json::from_slice::<Value>(&bytes) {
            if message
                .get_mut("result")
                .is_some_and(|result| remap::prefix_result_uris(&server.name, result))
            {
                parts.headers.remove(http::header::CONTENT_LENGTH);
                return Response::from_parts(parts, body::full(message.to_string()));
            }
        }
    }
    Response::from_parts(parts, body::full(bytes))
}

/// The arguments a completion would use: those chosen before, with `name` set to `value`.
fn with_value(chosen: &Map<String, Value>, name: &str, value: Value) -> Map<String, Value> {
    let mut arguments = chosen.clone();
    arguments.insert(name.to_string(), value);
    arguments
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    #[tokio::test]
    async fn a_json_result_names_resources_with_their_servers_prefix_and_answers_only_its_request() {
        let telemetry = std::sync::Arc::new(
            crate::telemetry::Telemetry::new(crate::tests::support::quiet_telemetry()).unwrap(),
        );
        let upstream = crate::upstream::Upstream::new(telemetry, crate::placements::outbox().0, None);
        let spec = portcullis_config::McpServerSpec {
            name: "math".into(),
            url: "http://127.0.0.1:9/mcp".into(),
            tls: None,
            timeout: None,
            failure_mode: portcullis_config::McpFailureMode::Fail,
            list_ttl: None,
        };
        let server = Server::compile(&spec, &upstream).unwrap();
        let answer = |text: &str| {
            let mut answer = Response::new(body::full(text.to_string()));
            answer
                .headers_mut()
                .insert(http::header::CONTENT_LENGTH, text.len().into());
            answer
        };
        let read = |answer: Response<Body>| async move {
            let bytes = answer.into_body().collect().await.unwrap().to_bytes();
            serde_json::from_slice::<Value>(&bytes).unwrap()
        };
        let linked = r#"{"jsonrpc":"2.0","id":4,"result":{"content":[{"type":"resource_link","uri":"file:///r.md"}]}}"#;
        let prefixed = answer_json(answer(linked), &server, &json!(4), "McpBackend/tools", true).await;
        assert!(prefixed.headers().get(http::header::CONTENT_LENGTH).is_none());
        let message = read(prefixed).await;
        assert_eq!(message["result"]["content"][0]["uri"], "math+file:///r.md");
        // Nothing to prefix: the answer passes byte for byte.
        let plain = r#"{"jsonrpc":"2.0","id":5,"result":{"content":[{"type":"text","text":"3"}]}}"#;
        let passed = answer_json(answer(plain), &server, &json!(5), "McpBackend/tools", true).await;
        assert_eq!(passed.into_body().collect().await.unwrap().to_bytes(), plain);
        // A response to another request, a batch that holds one, or none at all, answers
        // nothing this request asked.
        for other in [
            r#"{"jsonrpc":"2.0","id":6,"result":{"content":[]}}"#,
            r#"{"jsonrpc":"2.0","id":"5","result":{"content":[]}}"#,
            r#"[{"jsonrpc":"2.0","id":5,"result":{"content":[]}}]"#,
            r#"{"jsonrpc":"2.0","result":{"content":[]}}"#,
            "Internal Server Error",
        ] {
            let failed =
                read(answer_json(answer(other), &server, &json!(5), "McpBackend/tools", false).await).await;
            assert_eq!(failed["id"], 5, "{other}");
            assert_eq!(failed["error"]["code"], jsonrpc::UPSTREAM_FAILED, "{other}");
            assert_eq!(
                failed["error"]["message"],
                "McpBackend/tools: server math: answered HTTP 200 OK without the response to this request",
                "{other}"
            );
        }
    }
}
