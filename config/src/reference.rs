//! References between objects: typed, checked at apply, and the edges shard slicing follows.

use serde::{Deserialize, Serialize};

use crate::kind::Kind;

/// A reference to another object by kind and name, as policies write it Gateway-API style:
/// `targetRefs: [{kind: Route, name: web}]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TargetRef {
    pub kind: String,
    pub name: String,
    /// A part of the target (an McpBackend's server), where the kind has parts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub section_name: Option<String>,
}

/// What a reference means for the object holding it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The holder attaches to the target (a Route to a Listener, a policy to a Route): it is
    /// part of every shard the target is in.
    AttachTo,
    /// The holder uses the target (a Route sends to a Backend): the target is part of every
    /// shard the holder is in.
    Uses,
}

/// One reference found in a spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// Path of the referencing field, e.g. `spec.targetRefs[0]`.
    pub field: String,
    /// The kind as written; checked against `allowed`.
    pub kind: String,
    pub name: String,
    pub role: Role,
    /// Kinds this field may name.
    pub allowed: &'static [&'static str],
}

impl Reference {
    pub fn new(
        field: impl Into<String>,
        kind: impl Into<String>,
        name: impl Into<String>,
        role: Role,
        allowed: &'static [&'static str],
    ) -> Reference {
        Reference {
            field: field.into(),
            kind: kind.into(),
            name: name.into(),
            role,
            allowed,
        }
    }

    /// The kind named, if it is one this field may name.
    pub fn target_kind(&self) -> Result<Kind, String> {
        if !self.allowed.contains(&self.kind.as_str()) {
            return Err(format!(
                "kind {:?} cannot be referenced here, expected {}",
                self.kind,
                self.allowed.join(" or ")
            ));
        }
        Kind::from_name(&self.kind).ok_or_else(|| crate::kind::unknown_kind(&self.kind))
    }
}

/// The checks every `targetRefs` list gets: at least one target, none twice (a policy
/// attaches once), a `sectionName` only where the policy can attach to parts. Whether each
/// target (and section) exists and may be targeted is checked on the set.
pub(crate) fn check_target_refs(checker: &mut crate::Checker<'_>, refs: &[TargetRef], sections: bool) {
    if !sections {
        if let Some(index) = refs.iter().position(|target| target.section_name.is_some()) {
            checker.fail(
                format!("spec.targetRefs[{index}].sectionName"),
                "this policy attaches to whole objects; sectionName is not supported here",
            );
        }
    }
    if refs.is_empty() {
        checker.fail("spec.targetRefs", "at least one target is required");
    }
    if let Some((index, target)) = refs
        .iter()
        .enumerate()
        .find(|(index, target)| refs[..*index].contains(target))
    {
        checker.fail(
            format!("spec.targetRefs[{index}]"),
            format!("{}/{} is already a target", target.kind, target.name),
        );
    }
}

/// Keeps the targets that are in a shard slice.
pub(crate) fn retain_targets(refs: &mut Vec<TargetRef>, keep: &dyn Fn(&crate::ObjectKey) -> bool) {
    refs.retain(|target| {
        Kind::from_name(&target.kind)
            .is_some_and(|kind| keep(&crate::ObjectKey::new(kind, target.name.as_str())))
    });
}

/// Attachment references of a `targetRefs` list.
pub fn target_refs(refs: &[TargetRef], allowed: &'static [&'static str]) -> Vec<Reference> {
    refs.iter()
        .enumerate()
        .map(|(index, target)| {
            Reference::new(
                format!("spec.targetRefs[{index}]"),
                &target.kind,
                &target.name,
                Role::AttachTo,
                allowed,
            )
        })
        .collect()
}
