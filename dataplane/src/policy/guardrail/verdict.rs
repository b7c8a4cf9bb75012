//! A checker's verdict, decoded and checked before the proxy acts on it: a verdict without a
//! decision, or a mutation that is not JSON or has another type than the payload it replaces,
//! is a failed check, never forwarded. A mutation larger than its phase allows is a verdict
//! of its own, [`Decision::Oversized`]: the checker answered, so the failure mode does not
//! apply, and the change it asked for cannot be made.

use portcullis_proto::guardrail::v1::verdict::Decision as WireDecision;
use portcullis_proto::guardrail::v1::Verdict as WireVerdict;
use serde_json::Value;

/// Longest deny reason passed on to the client (longer ones are cut at a character
/// boundary): a reason is a message for an agent, not a payload.
const MAX_REASON_CHARS: usize = 1024;

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Decision {
    Allow,
    Deny(String),
    /// The replacement payload.
    Mutate(Value),
    /// A mutation larger than the phase allows: neither it nor the payload it was to replace
    /// may pass.
    Oversized {
        bytes: u64,
        limit: u64,
    },
}

/// What a mutation may replace the payload with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expected {
    pub(crate) kind: JsonKind,
    pub(crate) max_bytes: u64,
}

impl Expected {
    /// Judges a mutation of `bytes` by its size, before it is read: whichever checker made it
    /// (a service or the built-in guard), over the limit it is `Oversized`.
    pub(crate) fn oversized(&self, bytes: u64) -> Option<Decision> {
        (bytes > self.max_bytes).then_some(Decision::Oversized {
            bytes,
            limit: self.max_bytes,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JsonKind {
    Object,
    Array,
    String,
}

impl JsonKind {
    pub(crate) fn of(value: &Value) -> Option<JsonKind> {
        match value {
            Value::Object(_) => Some(JsonKind::Object),
            Value::Array(_) => Some(JsonKind::Array),
            Value::String(_) => Some(JsonKind::String),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            JsonKind::Object => "an object",
            JsonKind::Array => "an array",
            JsonKind::String => "a string",
        }
    }
}

/// The decision, or why the verdict was not acted on (the replica is at fault).
pub(super) fn decode(verdict: WireVerdict, expected: &Expected) -> Result<Decision, String> {
    match verdict.decision {
        None => Err("the verdict has no decision (allow, deny or mutate)".into()),
        Some(WireDecision::Allow(_)) => Ok(Decision::Allow),
        Some(WireDecision::Deny(deny)) => Ok(Decision::Deny(match deny.reason.trim() {
            "" => "denied by the guardrail".to_string(),
            reason => reason.chars().take(MAX_REASON_CHARS).collect(),
        })),
        Some(WireDecision::Mutate(mutate)) => {
            if let Some(oversized) = expected.oversized(mutate.payload_json.len() as u64) {
                return Ok(oversized);
            }
            let payload: Value = serde_json::from_str(&mutate.payload_json)
                .map_err(|error| format!("the mutation is not valid JSON: {error}"))?;
            if JsonKind::of(&payload) != Some(expected.kind) {
                return Err(format!(
                    "the mutation must be {}, like the payload it replaces",
                    expected.kind.name()
                ));
            }
            Ok(Decision::Mutate(payload))
        }
    }
}

#[cfg(test)]
mod tests {
    use portcullis_proto::guardrail::v1::{Allow, Deny, Mutate};

    use super::*;

    const OBJECT: Expected = Expected {
        kind: JsonKind::Object,
        max_bytes: 64,
    };

    fn mutate(payload: &str) -> WireVerdict {
        WireVerdict {
            decision: Some(WireDecision::Mutate(Mutate {
                payload_json: payload.into(),
                reason: String::new(),
            })),
        }
    }

    #[test]
    fn decisions_decode_and_bad_ones_fail() {
        let allow = WireVerdict {
            decision: Some(WireDecision::Allow(Allow {})),
        };
        assert_eq!(decode(allow, &OBJECT), Ok(Decision::Allow));
        let deny = WireVerdict {
            decision: Some(WireDecision::Deny(Deny {
                reason: " a must be 1 ".into(),
            })),
        };
        assert_eq!(decode(deny, &OBJECT), Ok(Decision::Deny("a must be 1".into())));
        assert!(decode(WireVerdict { decision: None }, &OBJECT).is_err());
        assert_eq!(
            decode(mutate(r#"{"a": 1}"#), &OBJECT),
            Ok(Decision::Mutate(serde_json::json!({"a": 1})))
        );
        let not_json = decode(mutate("{not json"), &OBJECT).unwrap_err();
        assert!(not_json.contains("not valid JSON"), "{not_json}");
        let array = decode(mutate("[1]"), &OBJECT).unwrap_err();
        assert!(array.contains("must be an object"), "{array}");
        // Judged by its size before it is read: too large is a decision, not a failure.
        let oversized = format!(r#"{{"a": "{}"}}"#, "x".repeat(100));
        assert_eq!(
            decode(mutate(&oversized), &OBJECT),
            Ok(Decision::Oversized {
                bytes: 109,
                limit: 64
            })
        );
    }
}
