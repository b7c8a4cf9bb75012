//! The test server's tool catalog: `echo`, `get-sum` and N generated tools whose input
//! schemas look like real ones (required and optional properties of several types), so that
//! large `tools/list` payloads cost a gateway what real catalogs cost.

use serde_json::{json, Map, Value};

/// Why a `tools/call` was refused; both map to JSON-RPC `-32602`.
#[derive(Debug, PartialEq)]
pub enum ToolError {
    UnknownTool(String),
    InvalidArguments(String),
}

impl ToolError {
    pub fn message(&self) -> String {
        match self {
            ToolError::UnknownTool(name) => format!("Unknown tool: {name}"),
            ToolError::InvalidArguments(why) => format!("Invalid arguments: {why}"),
        }
    }
}

pub struct Catalog {
    generated: usize,
    /// `tools/list`'s `tools` array, built once: with 500 tools it is ~150 kB.
    listing: Value,
}

impl Catalog {
    pub fn new(generated: usize) -> Self {
        let mut tools = vec![
            json!({
                "name": "echo",
                "description": "Echo the message back.",
                "inputSchema": {
                    "type": "object",
                    "properties": { "message": { "type": "string" } },
                    "required": ["message"],
                },
            }),
            json!({
                "name": "get-sum",
                "description": "Add two numbers.",
                "inputSchema": {
                    "type": "object",
                    "properties": { "a": { "type": "number" }, "b": { "type": "number" } },
                    "required": ["a", "b"],
                },
                "outputSchema": {
                    "type": "object",
                    "properties": { "result": { "type": "number" } },
                    "required": ["result"],
                },
            }),
        ];
        tools.extend((0..generated).map(generated_tool));
        Self {
            generated,
            listing: Value::Array(tools),
        }
    }

    pub fn listing(&self) -> &Value {
        &self.listing
    }

    /// Runs a tool; the result is a `CallToolResult` (without era-specific fields).
    pub fn call(&self, name: &str, arguments: &Map<String, Value>) -> Result<Value, ToolError> {
        match name {
            "echo" => {
                let message = string_argument(arguments, "message")?;
                Ok(json!({
                    "content": [{ "type": "text", "text": message }],
                    "isError": false,
                }))
            }
            "get-sum" => {
                let sum = sum(number_argument(arguments, "a")?, number_argument(arguments, "b")?)?;
                Ok(json!({
                    "content": [{ "type": "text", "text": sum.to_string() }],
                    "structuredContent": { "result": sum },
                    "isError": false,
                }))
            }
            _ => {
                let index = self
                    .generated_index(name)
                    .ok_or_else(|| ToolError::UnknownTool(name.to_string()))?;
                // The schema says `additionalProperties: false`; hold callers to it.
                if let Some(extra) = arguments
                    .keys()
                    .find(|key| !["query", "limit", "verbose"].contains(&key.as_str()))
                {
                    return Err(ToolError::InvalidArguments(format!(
                        "unexpected property '{extra}'"
                    )));
                }
                let query = string_argument(arguments, "query")?;
                optional(
                    arguments,
                    "limit",
                    |v| v.as_u64().filter(|n| (1..=100).contains(n)).is_some(),
                    "an integer in 1..=100",
                )?;
                optional(arguments, "verbose", Value::is_boolean, "a boolean")?;
                Ok(json!({
                    "content": [{ "type": "text", "text": format!("tool-{index:04}: {query}") }],
                    "isError": false,
                }))
            }
        }
    }

    fn generated_index(&self, name: &str) -> Option<usize> {
        let digits = name.strip_prefix("tool-")?;
        // Only the exact spelling the listing uses, so `tool-1` is as unknown as `nope`.
        let index: usize = digits.parse().ok()?;
        (index < self.generated && format!("{index:04}") == digits).then_some(index)
    }
}

fn generated_tool(index: usize) -> Value {
    json!({
        "name": format!("tool-{index:04}"),
        "description": format!("Generated test tool number {index}: looks up records matching a query."),
        "inputSchema": {
            "type": "object",
            "properties": {
                "query": { "type": "string", "description": "What to look for." },
                "limit": { "type": "integer", "minimum": 1, "maximum": 100, "description": "Maximum number of records." },
                "verbose": { "type": "boolean", "description": "Include details." },
            },
            "required": ["query"],
            "additionalProperties": false,
        },
    })
}

fn string_argument<'a>(arguments: &'a Map<String, Value>, key: &str) -> Result<&'a str, ToolError> {
    arguments
        .get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| ToolError::InvalidArguments(format!("'{key}' must be a string")))
}

fn number_argument<'a>(
    arguments: &'a Map<String, Value>,
    key: &str,
) -> Result<&'a serde_json::Number, ToolError> {
    match arguments.get(key) {
        Some(Value::Number(number)) => Ok(number),
        _ => Err(ToolError::InvalidArguments(format!("'{key}' must be a number"))),
    }
}

fn optional(
    arguments: &Map<String, Value>,
    key: &str,
    valid: impl Fn(&Value) -> bool,
    expected: &str,
) -> Result<(), ToolError> {
    match arguments.get(key) {
        Some(value) if !valid(value) => {
            Err(ToolError::InvalidArguments(format!("'{key}' must be {expected}")))
        }
        _ => Ok(()),
    }
}

/// Integers stay integers (clients compare `5`, not `5.0`); anything else is added as f64.
fn sum(a: &serde_json::Number, b: &serde_json::Number) -> Result<Value, ToolError> {
    if let (Some(a), Some(b)) = (a.as_i64(), b.as_i64()) {
        if let Some(sum) = a.checked_add(b) {
            return Ok(Value::from(sum));
        }
    }
    let (Some(a), Some(b)) = (a.as_f64(), b.as_f64()) else {
        return Err(ToolError::InvalidArguments("numbers out of range".into()));
    };
    serde_json::Number::from_f64(a + b)
        .map(Value::Number)
        .ok_or_else(|| ToolError::InvalidArguments("sum is not finite".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn listing_has_generated_tools_plus_two() {
        let catalog = Catalog::new(8);
        assert_eq!(catalog.listing().as_array().map(Vec::len), Some(10));
    }

    #[test]
    fn get_sum_keeps_integers_and_adds_floats() {
        let catalog = Catalog::new(0);
        let result = catalog.call("get-sum", &args(json!({"a": 2, "b": 3})));
        assert_eq!(
            result.map(|r| r["structuredContent"]["result"].clone()),
            Ok(json!(5))
        );
        let result = catalog.call("get-sum", &args(json!({"a": 0.5, "b": 1})));
        assert_eq!(result.map(|r| r["content"][0]["text"].clone()), Ok(json!("1.5")));
        let overflow = catalog.call("get-sum", &args(json!({"a": i64::MAX, "b": 1})));
        assert!(overflow.is_ok());
    }

    #[test]
    fn bad_arguments_and_unknown_tools_are_refused() {
        let catalog = Catalog::new(3);
        assert!(matches!(
            catalog.call("get-sum", &args(json!({"a": "2", "b": 3}))),
            Err(ToolError::InvalidArguments(_))
        ));
        assert!(matches!(
            catalog.call("echo", &args(json!({}))),
            Err(ToolError::InvalidArguments(_))
        ));
        assert!(matches!(
            catalog.call("tool-0003", &args(json!({"query": "q"}))),
            Err(ToolError::UnknownTool(_))
        ));
        assert!(matches!(
            catalog.call("tool-2", &args(json!({"query": "q"}))),
            Err(ToolError::UnknownTool(_))
        ));
        assert!(matches!(
            catalog.call("tool-0002", &args(json!({"query": "q", "limit": 0}))),
            Err(ToolError::InvalidArguments(_))
        ));
        let ok = catalog.call(
            "tool-0002",
            &args(json!({"query": "q", "limit": 5, "verbose": true})),
        );
        assert_eq!(
            ok.map(|r| r["content"][0]["text"].clone()),
            Ok(json!("tool-0002: q"))
        );
    }
}
