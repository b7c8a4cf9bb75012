use serde::{Deserialize, Serialize};

use crate::error::{Checker, FieldError};
use crate::kind::{KindInfo, KindSpec};
use crate::reference::{target_refs, Reference, TargetRef};
use crate::set::{ConfigSet, Scope};
use crate::McpBackendSpec;

/// Who may call which tools, get which prompts and read which resources of an McpBackend,
/// as CEL rules (see [`crate::mcp_rules`] for what a rule sees, and list vs call time).
/// Attached to a whole McpBackend, or with `sectionName` to one of its servers.
///
/// For one item, every McpAuthorization attached to it is considered together: it is
/// allowed when no `deny` rule holds and, if there are `allow` rules at all, at least one
/// of them holds. A rule about another kind of item (`mcp.tool` for a prompt) neither allows
/// nor denies. A rule that fails on its input (a missing argument or header) does not hold;
/// for a `deny` rule that means the item is denied (fail closed): guard optional inputs
/// (`"x-team" in request.headers && …`). Lists show only items that may be
/// allowed; requests without an item (initialize, lists, ping) are not subject to rules.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct McpAuthorizationSpec {
    pub target_refs: Vec<TargetRef>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<String>,
}

const TARGET_KINDS: &[&str] = &["McpBackend"];

impl McpAuthorizationSpec {
    /// Whether this policy applies to `server` of the McpBackend `backend`.
    pub fn applies_to(&self, backend: &str, server: &str) -> bool {
        self.target_refs.iter().any(|target| {
            target.kind == McpBackendSpec::INFO.name
                && target.name == backend
                && target.section_name.as_deref().is_none_or(|section| section == server)
        })
    }
}

impl KindSpec for McpAuthorizationSpec {
    const INFO: &'static KindInfo =
        &KindInfo::of::<McpAuthorizationSpec>("McpAuthorization", "mcpauthorizations", &["mcpauthz"]);

    fn check(&self, checker: &mut Checker<'_>) {
        crate::reference::check_target_refs(checker, &self.target_refs, true);
        if self.allow.is_empty() && self.deny.is_empty() {
            checker.fail("spec", "decides nothing: give allow or deny rules");
        }
        for (list, rules) in [("allow", &self.allow), ("deny", &self.deny)] {
            for (index, rule) in rules.iter().enumerate() {
                if let Err(problem) = crate::mcp_rules::Rule::compile(rule) {
                    checker.fail(format!("spec.{list}[{index}]"), problem);
                }
            }
        }
    }

    fn references(&self) -> Vec<Reference> {
        target_refs(&self.target_refs, TARGET_KINDS)
    }

    fn retain_attachments(&mut self, keep: &dyn Fn(&crate::ObjectKey) -> bool) {
        crate::reference::retain_targets(&mut self.target_refs, keep);
    }

    /// Rules are checked against the servers they apply to, so a comparison with a server
    /// or a prefixed tool name that can never match is refused. Not in a slice: it keeps only
    /// the targets inside its shard, and a rule may rightly name a server of another.
    fn check_set(set: &ConfigSet, scope: Scope, errors: &mut Vec<FieldError>) {
        for (metadata, spec) in set.specs::<McpAuthorizationSpec>() {
            let object = format!("{}/{}", McpAuthorizationSpec::INFO.name, metadata.name);
            let mut servers: Vec<&str> = Vec::new();
            for (index, target) in spec.target_refs.iter().enumerate() {
                // A missing McpBackend is reported by the reference check.
                let Some(backend) = set.spec::<McpBackendSpec>(&target.name) else {
                    continue;
                };
                match &target.section_name {
                    Some(section) if backend.server(section).is_none() => errors.push(FieldError::new(
                        &object,
                        format!("spec.targetRefs[{index}].sectionName"),
                        format!("McpBackend/{} has no server {section:?}", target.name),
                    )),
                    Some(section) => servers.push(section),
                    None => servers.extend(backend.servers.iter().map(|server| server.name.as_str())),
                }
            }
            if servers.is_empty() || scope == Scope::Slice {
                continue;
            }
            servers.sort_unstable();
            servers.dedup();
            for (list, rules) in [("allow", &spec.allow), ("deny", &spec.deny)] {
                // Rules that do not even parse were reported by `check`.
                let parsed = rules
                    .iter()
                    .enumerate()
                    .filter(|(_, rule)| crate::mcp_rules::Rule::compile(rule).is_ok());
                for (index, rule) in parsed {
                    if let Err(problem) = crate::mcp_rules::check(rule, &servers) {
                        errors.push(FieldError::new(&object, format!("spec.{list}[{index}]"), problem));
                    }
                }
            }
        }
    }
}
