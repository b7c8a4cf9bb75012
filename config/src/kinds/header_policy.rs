use serde::{Deserialize, Serialize};

use crate::error::Checker;
use crate::kind::{KindInfo, KindSpec};
use crate::reference::{target_refs, Reference, TargetRef};

/// Changes request headers on the way to the upstream and response headers on the way
/// back, for the Listeners and Routes it targets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HeaderPolicySpec {
    pub target_refs: Vec<TargetRef>,
    #[serde(default, skip_serializing_if = "HeaderEdits::is_empty")]
    pub request: HeaderEdits,
    #[serde(default, skip_serializing_if = "HeaderEdits::is_empty")]
    pub response: HeaderEdits,
}

/// Applied in order: remove, then set (replacing any value), then add (keeping others).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HeaderEdits {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub set: Vec<Header>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub add: Vec<Header>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remove: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Header {
    pub name: String,
    pub value: String,
}

impl HeaderEdits {
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.add.is_empty() && self.remove.is_empty()
    }
}

/// Headers that frame the message or belong to one connection: editing them would
/// corrupt the exchange, so a policy may not.
const PROTECTED: &[&str] = &[
    "connection",
    "content-length",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

pub const POLICY_TARGET_KINDS: &[&str] = &["Listener", "Route"];

fn check_edits(checker: &mut Checker<'_>, field: &str, edits: &HeaderEdits) {
    let check_name = |checker: &mut Checker<'_>, field: String, name: &str| match http::HeaderName::from_bytes(
        name.as_bytes(),
    ) {
        Err(_) => checker.fail(field, format!("invalid header name {name:?}")),
        Ok(header) if PROTECTED.contains(&header.as_str()) => checker.fail(
            field,
            format!("{name:?} frames the message or the connection and cannot be changed"),
        ),
        Ok(_) => {}
    };
    for (list, headers) in [("set", &edits.set), ("add", &edits.add)] {
        for (index, header) in headers.iter().enumerate() {
            let at = format!("{field}.{list}[{index}]");
            check_name(checker, format!("{at}.name"), &header.name);
            if http::HeaderValue::from_str(&header.value).is_err() {
                checker.fail(
                    format!("{at}.value"),
                    format!(
                        "invalid header value {:?}: only visible ASCII, spaces and tabs",
                        header.value
                    ),
                );
            }
        }
    }
    for (index, name) in edits.remove.iter().enumerate() {
        check_name(checker, format!("{field}.remove[{index}]"), name);
    }
}

impl KindSpec for HeaderPolicySpec {
    const INFO: &'static KindInfo =
        &KindInfo::of::<HeaderPolicySpec>("HeaderPolicy", "headerpolicies", &["hp"]);

    fn check(&self, checker: &mut Checker<'_>) {
        crate::reference::check_target_refs(checker, &self.target_refs, false);
        if self.request.is_empty() && self.response.is_empty() {
            checker.fail("spec", "changes nothing: give request or response edits");
        }
        check_edits(checker, "spec.request", &self.request);
        check_edits(checker, "spec.response", &self.response);
    }

    fn references(&self) -> Vec<Reference> {
        target_refs(&self.target_refs, POLICY_TARGET_KINDS)
    }

    fn retain_attachments(&mut self, keep: &dyn Fn(&crate::ObjectKey) -> bool) {
        crate::reference::retain_targets(&mut self.target_refs, keep);
    }
}
