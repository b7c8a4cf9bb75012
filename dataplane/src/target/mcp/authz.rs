//! McpAuthorization, compiled once per config version: for each server, the rules of every
//! policy attached to it (or to its whole McpBackend). Semantics are in
//! `portcullis_config::McpAuthorizationSpec` and `portcullis_config::mcp_rules`.

use std::sync::Arc;

use portcullis_config::mcp_rules::{Caller, Item, Rule, Verdict};
use portcullis_config::{ConfigSet, KindSpec, McpAuthorizationSpec};

struct Compiled {
    policy: Arc<str>,
    source: String,
    rule: Rule,
}

/// The rules that apply to one server.
#[derive(Default)]
pub(super) struct ServerRules {
    allow: Vec<Compiled>,
    deny: Vec<Compiled>,
}

/// How a rule set judged an item.
#[derive(Debug, PartialEq)]
pub(super) enum Judgement {
    /// No policy applies to the server.
    Unrestricted,
    Allowed {
        policy: Arc<str>,
    },
    /// Listing only: a rule needs the call's arguments, so the item is shown.
    Undecided,
    Denied {
        policy: Arc<str>,
        reason: String,
    },
}

impl Judgement {
    pub(super) fn permits(&self) -> bool {
        !matches!(self, Judgement::Denied { .. })
    }
}

impl ServerRules {
    pub(super) fn compile(config: &ConfigSet, backend: &str, server: &str) -> Result<ServerRules, String> {
        let mut rules = ServerRules::default();
        for (metadata, spec) in config.specs::<McpAuthorizationSpec>() {
            if !spec.applies_to(backend, server) {
                continue;
            }
            let policy: Arc<str> =
                Arc::from(format!("{}/{}", McpAuthorizationSpec::INFO.name, metadata.name));
            for (list, sources) in [(&mut rules.allow, &spec.allow), (&mut rules.deny, &spec.deny)] {
                for source in sources {
                    let rule = Rule::compile(source).map_err(|error| format!("{policy}: {error}"))?;
                    list.push(Compiled {
                        policy: policy.clone(),
                        source: source.clone(),
                        rule,
                    });
                }
            }
        }
        Ok(rules)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.allow.is_empty() && self.deny.is_empty()
    }

    /// Whether a rule may read an item's arguments: a completion is then judged by its
    /// suggestions. Read off the rules' text, so it may say yes when none does, never no
    /// when one does.
    pub(super) fn reads_arguments(&self) -> bool {
        self.allow
            .iter()
            .chain(&self.deny)
            .any(|compiled| compiled.source.contains("arguments"))
    }

    /// Whether a verdict can differ between callers.
    pub(super) fn reads_caller(&self) -> bool {
        self.allow
            .iter()
            .chain(&self.deny)
            .any(|compiled| compiled.rule.reads_caller())
    }

    /// Deny rules first: one that holds, or fails, denies. Then, if there are allow rules,
    /// one must hold. Listing (`item.arguments` is `None`), a rule that needs arguments
    /// leaves the item to be decided at call time.
    pub(super) fn judge(&self, caller: &Caller, item: Item<'_>) -> Judgement {
        if self.is_empty() {
            return Judgement::Unrestricted;
        }
        let mut undecided = false;
        for deny in &self.deny {
            match deny.rule.evaluate(caller, item) {
                Verdict::False => {}
                Verdict::NeedsArguments => undecided = true,
                // The client learns which policy, not the rule: rules are the operator's.
                Verdict::True => {
                    tracing::debug!(policy = %deny.policy, rule = %deny.source, "deny rule holds");
                    return Judgement::Denied {
                        policy: deny.policy.clone(),
                        reason: "a deny rule holds".into(),
                    };
                }
                Verdict::Error(error) => {
                    tracing::debug!(policy = %deny.policy, rule = %deny.source, %error, "deny rule failed, so it holds");
                    return Judgement::Denied {
                        policy: deny.policy.clone(),
                        reason: "a deny rule could not be evaluated, so it holds".into(),
                    };
                }
            }
        }
        if self.allow.is_empty() {
            return if undecided {
                Judgement::Undecided
            } else {
                Judgement::Allowed {
                    policy: self.deny[0].policy.clone(),
                }
            };
        }
        for allow in &self.allow {
            match allow.rule.evaluate(caller, item) {
                Verdict::True if !undecided => {
                    return Judgement::Allowed {
                        policy: allow.policy.clone(),
                    }
                }
                Verdict::True | Verdict::NeedsArguments => return Judgement::Undecided,
                Verdict::False | Verdict::Error(_) => {}
            }
        }
        Judgement::Denied {
            policy: self.allow[0].policy.clone(),
            reason: "no allow rule holds".into(),
        }
    }
}
