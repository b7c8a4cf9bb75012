//! MCP authorization rules: CEL expressions (<https://cel.dev>, the `cel` crate) over one
//! operation on one item: calling a tool, getting a prompt, reading a resource.
//!
//! The control plane checks rules at apply and the proxy evaluates them, both through this
//! module, so what apply accepts is exactly what proxies can run.
//!
//! A rule sees:
//! * `mcp.method` — `tools/call`, `prompts/get` or `resources/read`;
//! * `mcp.server` — the server's name in its McpBackend;
//! * `mcp.tool.name`, `mcp.tool.arguments` (tools), `mcp.prompt.name`,
//!   `mcp.prompt.arguments` (prompts), `mcp.resource.uri` (resources) — names and URIs as
//!   the server itself knows them, never with the gateway's prefix;
//! * `source.address` — the client's address as a string;
//! * `request.headers` — the HTTP request headers, names in lowercase (repeated headers
//!   joined with `, `).
//!
//! **Phases.** A list (`tools/list`, …) shows an item when calling it could be allowed, so
//! its rules run once per item *without* `arguments`: a rule that needs arguments cannot be
//! decided then, and the item is listed; when it is called, the same rule runs with the
//! real arguments. `has(mcp.tool.arguments)` is false while listing and true when calling.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use cel::common::ast::{EntryExpr, Expr};
use cel::objects::{Key, Map};
use cel::{Context, ExecutionError, Program, Value};

use crate::kinds::MCP_NAME_SEPARATOR;

/// A compiled rule; compile once per config version, evaluate per request.
#[derive(Debug)]
pub struct Rule {
    program: Program,
    /// The one kind of item the rule is about (`mcp.tool`, `mcp.prompt` or `mcp.resource`),
    /// if it names one: it neither allows nor denies an item of another kind.
    about: Option<ItemKind>,
}

/// What an item is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ItemKind {
    Tool,
    Prompt,
    Resource,
}

impl ItemKind {
    /// The operation a rule authorizes on this kind of item.
    pub fn method(self) -> &'static str {
        match self {
            ItemKind::Tool => "tools/call",
            ItemKind::Prompt => "prompts/get",
            ItemKind::Resource => "resources/read",
        }
    }

    fn field(self) -> &'static str {
        match self {
            ItemKind::Tool => "tool",
            ItemKind::Prompt => "prompt",
            ItemKind::Resource => "resource",
        }
    }
}

/// One item as a rule sees it. `arguments` is `None` while listing.
#[derive(Debug, Clone, Copy)]
pub struct Item<'a> {
    pub kind: ItemKind,
    pub server: &'a str,
    /// The tool's or prompt's own name, or the resource's own URI.
    pub name: &'a str,
    pub arguments: Option<&'a serde_json::Value>,
}

/// The caller: the part of a rule's input that is the same for every item of a request.
#[derive(Debug, Clone)]
pub struct Caller {
    source: Value,
    request: Value,
}

impl Caller {
    pub fn new<'h>(address: IpAddr, headers: impl IntoIterator<Item = (&'h str, &'h [u8])>) -> Caller {
        let mut joined: HashMap<Key, String> = HashMap::new();
        for (name, value) in headers {
            let value = String::from_utf8_lossy(value);
            joined
                .entry(Key::String(Arc::new(name.to_ascii_lowercase())))
                .and_modify(|existing| {
                    existing.push_str(", ");
                    existing.push_str(&value);
                })
                .or_insert_with(|| value.into_owned());
        }
        let headers: HashMap<Key, Value> = joined
            .into_iter()
            .map(|(name, value)| (name, Value::String(Arc::new(value))))
            .collect();
        Caller {
            source: map([("address", Value::String(Arc::new(address.to_string())))]),
            request: map([(
                "headers",
                Value::Map(Map {
                    map: Arc::new(headers),
                }),
            )]),
        }
    }
}

/// A rule's verdict on one item.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    True,
    False,
    /// Listing, and the rule needs the call's arguments: decided at call time.
    NeedsArguments,
    /// The rule failed on this input (a missing key, a type error): it does not hold.
    Error(String),
}

impl Rule {
    pub fn compile(source: &str) -> Result<Rule, String> {
        let program = Program::compile(source).map_err(|errors| errors.to_string())?;
        let mut kinds = Vec::new();
        kinds_named(&program.expression().expr, &mut kinds)?;
        kinds.sort_unstable_by_key(|kind| kind.field());
        kinds.dedup();
        let about = match kinds[..] {
            [] => None,
            [kind] => Some(kind),
            _ => {
                return Err(format!(
                    "names {}: a rule is about one kind of item, so write one rule per kind",
                    kinds
                        .iter()
                        .map(|kind| format!("mcp.{}", kind.field()))
                        .collect::<Vec<_>>()
                        .join(" and ")
                ))
            }
        };
        Ok(Rule { program, about })
    }

    /// Whether the rule reads the caller (`source`, `request`): if not, its verdict on an
    /// item is the same for everyone and may be kept with the item.
    pub fn reads_caller(&self) -> bool {
        let variables = self.program.references();
        variables.has_variable("source") || variables.has_variable("request")
    }

    pub fn evaluate(&self, caller: &Caller, item: Item<'_>) -> Verdict {
        // A rule about another kind of item (a tool rule asked about a prompt) does not apply
        // to this one. Decided from the rule, not from a failed lookup: an argument or a
        // header named `resource` that is missing must fail the rule, not pass it.
        if self.about.is_some_and(|kind| kind != item.kind) {
            return Verdict::False;
        }
        match self.execute(caller, item) {
            Ok(Value::Bool(true)) => Verdict::True,
            Ok(Value::Bool(false)) => Verdict::False,
            Ok(other) => Verdict::Error(format!("the rule gave {other:?}, not a bool")),
            Err(ExecutionError::NoSuchKey(key))
                if item.arguments.is_none() && key.as_str() == "arguments" =>
            {
                Verdict::NeedsArguments
            }
            Err(error) => Verdict::Error(error.to_string()),
        }
    }
}

impl Rule {
    fn execute(&self, caller: &Caller, item: Item<'_>) -> Result<Value, ExecutionError> {
        let mut context = Context::default();
        context.add_variable_from_value("mcp", mcp_value(item));
        context.add_variable_from_value("source", caller.source.clone());
        context.add_variable_from_value("request", caller.request.clone());
        self.program.execute(&context)
    }
}

/// The kinds of item `expr` names (`mcp.tool`, …). Variables a comprehension binds may not be
/// called like the rule's own (`mcp`, `source`, `request`): a lookup on such a variable would
/// be taken for what it shadows.
fn kinds_named(expr: &Expr, kinds: &mut Vec<ItemKind>) -> Result<(), String> {
    fn each(exprs: &[&Expr], kinds: &mut Vec<ItemKind>) -> Result<(), String> {
        exprs.iter().try_for_each(|expr| kinds_named(expr, kinds))
    }
    let is_mcp = |expr: &Expr| matches!(expr, Expr::Ident(name) if name == "mcp");
    let kind_of = |field: &str| {
        [ItemKind::Tool, ItemKind::Prompt, ItemKind::Resource]
            .into_iter()
            .find(|kind| kind.field() == field)
    };
    match expr {
        // `has(mcp.tool)` asks which kind an item is; it is not about one.
        Expr::Select(select) if is_mcp(&select.operand.expr) => {
            if !select.test {
                kinds.extend(kind_of(&select.field));
            }
            Ok(())
        }
        Expr::Select(select) => each(&[&select.operand.expr], kinds),
        Expr::Call(call)
            if call.func_name == "_[_]" && call.args.len() == 2 && is_mcp(&call.args[0].expr) =>
        {
            match string_literal(&call.args[1].expr) {
                Some(field) => {
                    kinds.extend(kind_of(field));
                    Ok(())
                }
                None => Err("index mcp with a literal name (mcp.tool, mcp[\"tool\"])".into()),
            }
        }
        Expr::Ident(name) if name == "mcp" => {
            Err("use mcp only to read its fields (mcp.tool, mcp.server, …)".into())
        }
        Expr::Call(call) => {
            let parts: Vec<&Expr> = call
                .target
                .iter()
                .map(|target| &target.expr)
                .chain(call.args.iter().map(|argument| &argument.expr))
                .collect();
            each(&parts, kinds)
        }
        Expr::Comprehension(comprehension) => {
            let bound = [Some(&comprehension.iter_var), comprehension.iter_var2.as_ref()];
            if let Some(name) = bound
                .into_iter()
                .flatten()
                .find(|name| ["mcp", "source", "request"].contains(&name.as_str()))
            {
                return Err(format!("a variable named {name} would hide the rule's own"));
            }
            each(
                &[
                    &comprehension.iter_range.expr,
                    &comprehension.accu_init.expr,
                    &comprehension.loop_cond.expr,
                    &comprehension.loop_step.expr,
                    &comprehension.result.expr,
                ],
                kinds,
            )
        }
        Expr::List(list) => each(
            &list
                .elements
                .iter()
                .map(|element| &element.expr)
                .collect::<Vec<_>>(),
            kinds,
        ),
        Expr::Map(map) => map.entries.iter().try_for_each(|entry| match &entry.expr {
            EntryExpr::MapEntry(entry) => {
                kinds_named(&entry.key.expr, kinds)?;
                kinds_named(&entry.value.expr, kinds)
            }
            EntryExpr::StructField(field) => kinds_named(&field.value.expr, kinds),
        }),
        Expr::Struct(structure) => structure.entries.iter().try_for_each(|entry| match &entry.expr {
            EntryExpr::StructField(field) => kinds_named(&field.value.expr, kinds),
            EntryExpr::MapEntry(_) => Ok(()),
        }),
        Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => Ok(()),
    }
}

fn map<const N: usize>(entries: [(&str, Value); N]) -> Value {
    let map: HashMap<Key, Value> = entries
        .into_iter()
        .map(|(key, value)| (Key::String(Arc::new(key.to_string())), value))
        .collect();
    Value::Map(Map { map: Arc::new(map) })
}

fn mcp_value(item: Item<'_>) -> Value {
    let text = |text: &str| Value::String(Arc::new(text.to_string()));
    let object = match (item.kind, item.arguments) {
        (ItemKind::Resource, _) => map([("uri", text(item.name))]),
        (_, Some(arguments)) => map([("name", text(item.name)), ("arguments", json_value(arguments))]),
        (_, None) => map([("name", text(item.name))]),
    };
    map([
        ("method", text(item.kind.method())),
        ("server", text(item.server)),
        (item.kind.field(), object),
    ])
}

/// JSON to CEL: whole numbers become `int` (so `arguments.a == 1` means what it says),
/// others `double`.
pub fn json_value(json: &serde_json::Value) -> Value {
    match json {
        serde_json::Value::Null => Value::Null,
        serde_json::Value::Bool(flag) => Value::Bool(*flag),
        serde_json::Value::Number(number) => match (number.as_i64(), number.as_u64()) {
            (Some(int), _) => Value::Int(int),
            (None, Some(uint)) => Value::UInt(uint),
            _ => Value::Float(number.as_f64().unwrap_or(f64::NAN)),
        },
        serde_json::Value::String(text) => Value::String(Arc::new(text.clone())),
        serde_json::Value::Array(items) => Value::List(Arc::new(items.iter().map(json_value).collect())),
        serde_json::Value::Object(fields) => {
            let map: HashMap<Key, Value> = fields
                .iter()
                .map(|(key, value)| (Key::String(Arc::new(key.clone())), json_value(value)))
                .collect();
            Value::Map(Map { map: Arc::new(map) })
        }
    }
}

/// Fields a rule may read, as dotted paths; below a `*` anything goes (arguments, headers).
const FIELDS: &[&str] = &[
    "mcp",
    "mcp.method",
    "mcp.server",
    "mcp.tool",
    "mcp.tool.name",
    "mcp.tool.arguments.*",
    "mcp.prompt",
    "mcp.prompt.name",
    "mcp.prompt.arguments.*",
    "mcp.resource",
    "mcp.resource.uri",
    "source",
    "source.address",
    "request",
    "request.headers.*",
];

/// Checks a rule before it is accepted: it parses, reads only fields that exist, can be
/// true, and can be evaluated in at least one phase. `servers` are the names of the
/// servers it may apply to.
pub fn check(source: &str, servers: &[&str]) -> Result<(), String> {
    let rule = Rule::compile(source)?;
    let mut problems = Vec::new();
    walk(
        &rule.program.expression().expr,
        &mut Vec::new(),
        servers,
        &mut problems,
    );
    if let Some(problem) = problems.into_iter().next() {
        return Err(problem);
    }
    let caller = Caller::new(IpAddr::from([127, 0, 0, 1]), []);
    let empty = serde_json::Value::Object(Default::default());
    let mut outcomes = Vec::new();
    let kinds = match rule.about {
        Some(kind) => vec![kind],
        None => vec![ItemKind::Tool, ItemKind::Prompt, ItemKind::Resource],
    };
    for server in servers {
        for &kind in &kinds {
            for arguments in [None, Some(&empty)] {
                let item = Item {
                    kind,
                    server,
                    name: "x",
                    arguments,
                };
                outcomes.push(rule.execute(&caller, item));
            }
        }
    }
    // Asked only about its own kind of item, a missing key is a matter of input (an
    // argument, a header).
    let evaluable = |outcome: &Result<Value, ExecutionError>| match outcome {
        Ok(value) => matches!(value, Value::Bool(_)),
        Err(ExecutionError::NoSuchKey(_)) => true,
        Err(_) => false,
    };
    if !outcomes.iter().any(evaluable) {
        let reason = outcomes
            .iter()
            .find_map(|outcome| match outcome {
                Err(ExecutionError::NoSuchKey(_)) => None,
                Err(error) => Some(error.to_string()),
                Ok(Value::Bool(_)) => None,
                Ok(other) => Some(format!("it gives {other:?}, not a bool")),
            })
            .unwrap_or_else(|| "it reads no field of any item".into());
        return Err(format!(
            "cannot be evaluated for any tool, prompt or resource: {reason}"
        ));
    }
    let never_true = outcomes
        .iter()
        .all(|outcome| matches!(outcome, Ok(Value::Bool(false))));
    if rule.program.references().variables().is_empty() && never_true {
        return Err("is always false: it never allows or denies anything".into());
    }
    Ok(())
}

/// The dotted path an expression reads (`mcp.tool.name`), if it is a plain field path.
fn field_path(expr: &Expr) -> Option<Vec<&str>> {
    match expr {
        Expr::Ident(name) => Some(vec![name.as_str()]),
        Expr::Select(select) => {
            let mut path = field_path(&select.operand.expr)?;
            path.push(&select.field);
            Some(path)
        }
        _ => None,
    }
}

fn known_field(path: &[&str]) -> bool {
    FIELDS.iter().any(|field| {
        let pattern: Vec<&str> = field.split('.').collect();
        match pattern.split_last() {
            Some((&"*", parent)) => path.len() >= parent.len() && path[..parent.len()] == *parent,
            _ => pattern == path,
        }
    })
}

fn string_literal(expr: &Expr) -> Option<&str> {
    match expr {
        Expr::Literal(cel::common::ast::LiteralValue::String(text)) => Some(text.inner()),
        _ => None,
    }
}

/// Walks the expression: unknown variables and fields, and comparisons that can never hold.
/// `bound` are comprehension variables in scope.
fn walk<'e>(expr: &'e Expr, bound: &mut Vec<&'e str>, servers: &[&str], problems: &mut Vec<String>) {
    if let Some(path) = field_path(expr) {
        if !bound.contains(&path[0]) && !known_field(&path) {
            let root_known = ["mcp", "source", "request"].contains(&path[0]);
            let path = path.join(".");
            problems.push(if root_known {
                format!(
                    "unknown field `{path}`; rules read {}",
                    FIELDS.join(", ").replace(".*", ".…")
                )
            } else {
                format!(
                    "unknown variable `{}`; rules see mcp, source and request",
                    path.split('.').next().unwrap_or_default()
                )
            });
        }
        return;
    }
    match expr {
        Expr::Call(call) => {
            if matches!(call.func_name.as_str(), "_==_" | "_!=_") && call.args.len() == 2 {
                for (field, other) in [(&call.args[0], &call.args[1]), (&call.args[1], &call.args[0])] {
                    if let (Some(path), Some(text)) = (field_path(&field.expr), string_literal(&other.expr)) {
                        compared(&path, text, servers, problems);
                    }
                }
            }
            if call.func_name == "@in" && call.args.len() == 2 {
                if let (Some(path), Expr::List(list)) = (field_path(&call.args[0].expr), &call.args[1].expr) {
                    for element in &list.elements {
                        if let Some(text) = string_literal(&element.expr) {
                            compared(&path, text, servers, problems);
                        }
                    }
                }
            }
            if let Some(target) = &call.target {
                walk(&target.expr, bound, servers, problems);
            }
            for argument in &call.args {
                walk(&argument.expr, bound, servers, problems);
            }
        }
        Expr::Comprehension(comprehension) => {
            walk(&comprehension.iter_range.expr, bound, servers, problems);
            walk(&comprehension.accu_init.expr, bound, servers, problems);
            let scope = bound.len();
            bound.push(&comprehension.iter_var);
            if let Some(second) = &comprehension.iter_var2 {
                bound.push(second);
            }
            bound.push(&comprehension.accu_var);
            for part in [
                &comprehension.loop_cond,
                &comprehension.loop_step,
                &comprehension.result,
            ] {
                walk(&part.expr, bound, servers, problems);
            }
            bound.truncate(scope);
        }
        Expr::List(list) => {
            for element in &list.elements {
                walk(&element.expr, bound, servers, problems);
            }
        }
        Expr::Map(map) => {
            for entry in &map.entries {
                match &entry.expr {
                    EntryExpr::MapEntry(entry) => {
                        walk(&entry.key.expr, bound, servers, problems);
                        walk(&entry.value.expr, bound, servers, problems);
                    }
                    EntryExpr::StructField(field) => walk(&field.value.expr, bound, servers, problems),
                }
            }
        }
        Expr::Select(select) => walk(&select.operand.expr, bound, servers, problems),
        Expr::Struct(structure) => {
            for entry in &structure.entries {
                if let EntryExpr::StructField(field) = &entry.expr {
                    walk(&field.value.expr, bound, servers, problems);
                }
            }
        }
        Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => {}
    }
}

/// A field compared with a literal that it can never hold.
fn compared(path: &[&str], text: &str, servers: &[&str], problems: &mut Vec<String>) {
    match path {
        ["mcp", "server"] if !servers.contains(&text) => problems.push(format!(
            "compares mcp.server with {text:?}, which is not a server it applies to ({}): it can never match",
            servers.join(", ")
        )),
        ["mcp", "tool" | "prompt", "name"] => {
            if let Some((server, own)) = text.split_once(MCP_NAME_SEPARATOR) {
                if servers.contains(&server) {
                    problems.push(format!(
                        "compares {} with the prefixed name {text:?}: rules see the server's own \
                         name, {own:?} (with mcp.server == {server:?} to pick the server)",
                        path.join(".")
                    ));
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(rule: &str, name: &str, arguments: Option<serde_json::Value>) -> Verdict {
        let rule = Rule::compile(rule).unwrap();
        let caller = Caller::new(IpAddr::from([10, 0, 0, 7]), [("X-Team", b"blue".as_slice())]);
        rule.evaluate(
            &caller,
            Item {
                kind: ItemKind::Tool,
                server: "math",
                name,
                arguments: arguments.as_ref(),
            },
        )
    }

    /// A missing argument or header named like a kind of item fails the rule as any missing
    /// input does; only a rule about another kind of item is simply not about this one.
    #[test]
    fn an_input_named_like_a_kind_of_item_is_not_that_kind() {
        let rule = r#"mcp.tool.name == "query" && mcp.tool.arguments.resource != "public""#;
        let without = verdict(rule, "query", Some(serde_json::json!({"table": "users"})));
        assert!(matches!(without, Verdict::Error(_)), "{without:?}");
        let public = verdict(rule, "query", Some(serde_json::json!({"resource": "public"})));
        assert_eq!(public, Verdict::False);
        for rule in [
            r#"mcp.tool.arguments.tool == "x""#,
            r#"request.headers["prompt"] == "x""#,
        ] {
            let verdict = verdict(rule, "query", Some(serde_json::json!({})));
            assert!(matches!(verdict, Verdict::Error(_)), "{rule}: {verdict:?}");
        }
        assert_eq!(
            verdict(r#"mcp.prompt.name == "query""#, "query", None),
            Verdict::False
        );
        let indexed = r#"mcp.tool.arguments[mcp.tool.name] == "x""#;
        let missing = verdict(indexed, "query", Some(serde_json::json!({})));
        assert!(matches!(missing, Verdict::Error(_)), "{missing:?}");
    }

    /// A rule is about one kind of item, which the rule itself says: asked about another kind
    /// it does not apply, whatever else is missing; rules naming two kinds are refused.
    #[test]
    fn a_rule_is_about_one_kind_of_item() {
        let prompt = |rule: &str| {
            Rule::compile(rule).unwrap().evaluate(
                &Caller::new(IpAddr::from([10, 0, 0, 7]), []),
                Item {
                    kind: ItemKind::Prompt,
                    server: "math",
                    name: "p",
                    arguments: Some(&serde_json::json!({})),
                },
            )
        };
        let about_tools = r#"mcp.tool.name == "query" && mcp.tool.arguments.resource != "public""#;
        assert_eq!(prompt(about_tools), Verdict::False);
        assert_eq!(
            prompt(r#"mcp["tool"].name == "rm""#),
            Verdict::False,
            "indexed, still about tools"
        );
        // `has` asks the kind, so the rule is about every item.
        assert_eq!(
            prompt(r#"!has(mcp.tool) && source.address == "10.0.0.7""#),
            Verdict::True
        );
        assert!(matches!(
            prompt(r#"mcp.prompt.arguments.tool == "x""#),
            Verdict::Error(_)
        ));
        for (rule, expected) in [
            (
                r#"(mcp.tool.name == "query" && mcp.tool.arguments.resource != "public") || mcp.resource.uri.startsWith("file:///private")"#,
                "names mcp.resource and mcp.tool: a rule is about one kind of item",
            ),
            (
                r#"mcp.tool.arguments.files.exists(mcp, mcp.resource.startsWith("/etc"))"#,
                "a variable named mcp would hide the rule's own",
            ),
            (
                r#"[mcp].exists(m, m.tool.name == "rm")"#,
                "use mcp only to read its fields",
            ),
            (
                r#"(true ? mcp : mcp).tool.name == "rm""#,
                "use mcp only to read its fields",
            ),
        ] {
            let error = Rule::compile(rule).unwrap_err();
            assert!(error.contains(expected), "{rule}: {error}");
        }
    }

    #[test]
    fn list_time_cannot_decide_on_arguments_call_time_can() {
        let rule = r#"mcp.tool.name == "get-sum" && mcp.tool.arguments.a == 1"#;
        assert_eq!(verdict(rule, "get-sum", None), Verdict::NeedsArguments);
        let prompt = Rule::compile(rule).unwrap().evaluate(
            &Caller::new(IpAddr::from([10, 0, 0, 7]), []),
            Item {
                kind: ItemKind::Prompt,
                server: "math",
                name: "get-sum",
                arguments: None,
            },
        );
        assert_eq!(prompt, Verdict::False, "a tool rule does not apply to a prompt");
        assert_eq!(verdict(rule, "echo", None), Verdict::False);
        assert_eq!(
            verdict(rule, "get-sum", Some(serde_json::json!({"a": 1}))),
            Verdict::True
        );
        assert_eq!(
            verdict(rule, "get-sum", Some(serde_json::json!({"a": 2}))),
            Verdict::False
        );
        assert!(matches!(
            verdict(rule, "get-sum", Some(serde_json::json!({"b": 1}))),
            Verdict::Error(_)
        ));
        assert_eq!(
            verdict(rule, "echo", Some(serde_json::json!({"a": 1}))),
            Verdict::False
        );
    }

    #[test]
    fn has_arguments_is_false_while_listing() {
        let rule = "!has(mcp.tool.arguments) || mcp.tool.arguments.a == 1";
        assert_eq!(verdict(rule, "anything", None), Verdict::True);
        assert_eq!(
            verdict(rule, "anything", Some(serde_json::json!({"a": 1}))),
            Verdict::True
        );
        assert_eq!(
            verdict(rule, "anything", Some(serde_json::json!({"a": 2}))),
            Verdict::False
        );
    }

    #[test]
    fn the_caller_is_visible() {
        let rule = r#"request.headers["x-team"] == "blue" && source.address == "10.0.0.7""#;
        assert_eq!(verdict(rule, "t", None), Verdict::True);
        assert_eq!(
            verdict("mcp.server == 'math' && mcp.method == 'tools/call'", "t", None),
            Verdict::True
        );
    }

    #[test]
    fn arguments_compare_as_written() {
        let rule =
            "mcp.tool.arguments.x == 2.5 && mcp.tool.arguments.tags[0] == 'a' && mcp.tool.arguments.n > 10";
        assert_eq!(
            verdict(
                rule,
                "t",
                Some(serde_json::json!({"x": 2.5, "tags": ["a"], "n": 11}))
            ),
            Verdict::True
        );
    }

    #[test]
    fn apply_time_checks_name_the_problem() {
        let servers = ["math", "web"];
        let ok = [
            r#"mcp.tool.name == "get-sum" && mcp.tool.arguments.a == 1"#,
            "!has(mcp.tool.arguments) || mcp.tool.arguments.a == 1",
            r#"mcp.server == "web""#,
            r#"mcp.tool.arguments.all(k, k != "password")"#,
            r#"request.headers["x-team"] == "blue""#,
            r#"mcp.resource.uri.startsWith("file:///public/")"#,
        ];
        for rule in ok {
            assert_eq!(check(rule, &servers), Ok(()), "{rule}");
        }
        let bad = [
            ("mcp.tool.name ==", "Syntax error"),
            ("tool.name == 'x'", "unknown variable `tool`"),
            ("mcp.tol.name == 'x'", "unknown field `mcp.tol.name`"),
            ("mcp.tool.name == 'math__add'", "prefixed name"),
            ("mcp.server == 'mail'", "not a server it applies to"),
            ("mcp.tool.name > 5", "cannot be evaluated"),
            ("1 == 2", "always false"),
            ("mcp.tool.name", "cannot be evaluated"),
        ];
        for (rule, expected) in bad {
            let error = check(rule, &servers).expect_err(rule);
            assert!(error.contains(expected), "{rule}: {error}");
        }
    }
}
