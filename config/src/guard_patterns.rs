//! The built-in guard of a Guardrail: regular expressions (the `regex` crate: linear-time
//! matching, no backtracking, so a pattern cannot stall a proxy) over every string of a
//! payload. The control plane compiles patterns at apply and the proxy runs them, both
//! through this module.

use regex::{Regex, RegexBuilder, RegexSet, RegexSetBuilder};
use serde_json::Value;

use crate::BuiltinGuard;

/// Compiled patterns stay small enough that thousands of guards fit in a proxy.
const MAX_COMPILED_BYTES: usize = 1 << 20;
const DEFAULT_REPLACEMENT: &str = "[REDACTED]";

pub(crate) fn compile_pattern(pattern: &str) -> Result<Regex, String> {
    if pattern.is_empty() {
        return Err("must not be empty".into());
    }
    RegexBuilder::new(pattern)
        .size_limit(MAX_COMPILED_BYTES)
        .build()
        .map_err(|error| format!("invalid regular expression: {error}"))
}

/// A built-in guard, compiled once per config version.
#[derive(Debug)]
pub struct PatternGuard {
    /// Every deny pattern in one automaton: one pass over each string, whatever their number.
    deny: RegexSet,
    reasons: Vec<String>,
    redact: Vec<(Regex, String)>,
    max_bytes: u64,
}

/// What the built-in guard decided on one payload.
#[derive(Debug, PartialEq)]
pub enum PatternVerdict {
    Allow,
    Deny(String),
    /// The payload with every match of a redact pattern replaced.
    Mutate(Value),
    /// The payload is larger than `maxBytes`: it could not be checked.
    TooLarge,
}

impl PatternGuard {
    pub fn compile(spec: &BuiltinGuard) -> Result<PatternGuard, String> {
        for rule in &spec.deny {
            compile_pattern(&rule.pattern)?;
        }
        let deny = RegexSetBuilder::new(spec.deny.iter().map(|rule| &rule.pattern))
            .size_limit(MAX_COMPILED_BYTES * spec.deny.len().max(1))
            .build()
            .map_err(|error| format!("the deny patterns together: {error}"))?;
        let reasons = spec
            .deny
            .iter()
            .map(|rule| {
                rule.reason
                    .clone()
                    .unwrap_or_else(|| format!("matches the pattern {:?}", rule.pattern))
            })
            .collect();
        let redact = spec
            .redact
            .iter()
            .map(|rule| {
                let replacement = rule.replacement.as_deref().unwrap_or(DEFAULT_REPLACEMENT);
                Ok((compile_pattern(&rule.pattern)?, replacement.to_string()))
            })
            .collect::<Result<_, String>>()?;
        Ok(PatternGuard {
            deny,
            reasons,
            redact,
            max_bytes: spec.max_bytes(),
        })
    }

    /// Checks `names` (what the payload is about: an MCP item's name or URI) and every
    /// string of `payload` (object keys included) with the deny patterns, then redacts the
    /// payload's strings. `size` is the payload's encoded size.
    pub fn check(&self, names: &[&str], payload: &Value, size: u64) -> PatternVerdict {
        if size > self.max_bytes {
            return PatternVerdict::TooLarge;
        }
        // The first pattern (in the order written) that any string matches.
        let mut first: Option<usize> = None;
        let mut scan = |text: &str| {
            if let Some(index) = self.deny.matches(text).iter().next() {
                first = Some(first.map_or(index, |earlier| earlier.min(index)));
            }
        };
        names.iter().for_each(|name| scan(name));
        visit(payload, &mut scan);
        if let Some(index) = first {
            return PatternVerdict::Deny(self.reasons[index].clone());
        }
        if self.redact.is_empty() {
            return PatternVerdict::Allow;
        }
        let mut redacted = payload.clone();
        if redact(&mut redacted, &self.redact) {
            PatternVerdict::Mutate(redacted)
        } else {
            PatternVerdict::Allow
        }
    }
}

fn visit(value: &Value, each: &mut impl FnMut(&str)) {
    match value {
        Value::String(text) => each(text),
        Value::Array(items) => items.iter().for_each(|item| visit(item, each)),
        Value::Object(members) => {
            for (key, member) in members {
                each(key);
                visit(member, each);
            }
        }
        Value::Null | Value::Bool(_) | Value::Number(_) => {}
    }
}

/// Whether anything was replaced.
fn redact(value: &mut Value, rules: &[(Regex, String)]) -> bool {
    match value {
        Value::String(text) => {
            let mut changed = false;
            for (pattern, replacement) in rules {
                if let std::borrow::Cow::Owned(replaced) =
                    pattern.replace_all(text, regex::NoExpand(replacement))
                {
                    *text = replaced;
                    changed = true;
                }
            }
            changed
        }
        // Every member is visited (no short circuit): each may hold a match.
        Value::Array(items) => items
            .iter_mut()
            .map(|item| redact(item, rules))
            .fold(false, |a, b| a | b),
        Value::Object(members) => members
            .values_mut()
            .map(|member| redact(member, rules))
            .fold(false, |a, b| a | b),
        Value::Null | Value::Bool(_) | Value::Number(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::{DenyPattern, RedactPattern};

    fn guard(deny: &[&str], redact: &[&str], max_bytes: Option<u64>) -> PatternGuard {
        PatternGuard::compile(&BuiltinGuard {
            deny: deny
                .iter()
                .map(|pattern| DenyPattern {
                    pattern: pattern.to_string(),
                    reason: None,
                })
                .collect(),
            redact: redact
                .iter()
                .map(|pattern| RedactPattern {
                    pattern: pattern.to_string(),
                    replacement: None,
                })
                .collect(),
            max_bytes,
        })
        .unwrap()
    }

    #[test]
    fn deny_looks_at_every_string_and_key_but_not_numbers() {
        let guard = guard(&["(?i)drop\\s+table"], &[], None);
        let payload = json!({"q": [{"sql": "select 1; DROP  table users"}]});
        assert_eq!(
            guard.check(&[], &payload, 10),
            PatternVerdict::Deny("matches the pattern \"(?i)drop\\\\s+table\"".into())
        );
        assert_eq!(
            guard.check(&[], &json!({"drop table": 1}), 10),
            PatternVerdict::Deny("matches the pattern \"(?i)drop\\\\s+table\"".into())
        );
        assert_eq!(guard.check(&[], &json!({"n": 12}), 10), PatternVerdict::Allow);
        assert!(matches!(
            guard.check(&["drop table"], &json!({}), 10),
            PatternVerdict::Deny(_)
        ));
    }

    #[test]
    fn redact_replaces_matches_literally_and_deny_wins() {
        let guard = guard(&["secret-\\d+"], &["\\b\\d{3}-\\d{2}-\\d{4}\\b"], None);
        assert_eq!(
            guard.check(&[], &json!({"ssn": "mine is 123-45-6789, $1"}), 10),
            PatternVerdict::Mutate(json!({"ssn": "mine is [REDACTED], $1"}))
        );
        assert_eq!(
            guard.check(&[], &json!({"note": "fine"}), 10),
            PatternVerdict::Allow
        );
        assert!(matches!(
            guard.check(&[], &json!(["123-45-6789 secret-7"]), 10),
            PatternVerdict::Deny(_)
        ));
    }

    #[test]
    fn oversized_payload_cannot_be_checked() {
        let guard = guard(&["x"], &[], Some(4));
        assert_eq!(guard.check(&[], &json!("y"), 5), PatternVerdict::TooLarge);
    }

    #[test]
    fn bad_patterns_are_refused() {
        assert!(compile_pattern("(").is_err());
        assert!(compile_pattern("").is_err());
        assert!(compile_pattern("a{1000}{1000}").is_err());
    }
}
