use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Checker, ConfigError, FieldError};
use crate::kind::{unknown_kind, Kind, KindSpec, Spec};

pub const API_VERSION: &str = "portcullis.dev/v1alpha1";

/// Identity of an object: kind + name. Names are unique per kind.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ObjectKey {
    pub kind: Kind,
    pub name: String,
}

impl ObjectKey {
    pub fn new(kind: Kind, name: impl Into<String>) -> Self {
        Self {
            kind,
            name: name.into(),
        }
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.kind, self.name)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    pub name: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

/// A validated config object of any kind. Cloning is cheap: the spec is shared.
#[derive(Debug, Clone)]
pub struct Object {
    metadata: Metadata,
    spec: Arc<dyn Spec>,
}

impl PartialEq for Object {
    fn eq(&self, other: &Object) -> bool {
        // One spec shared by two versions of a config is equal without a look inside.
        self.metadata == other.metadata
            && (Arc::ptr_eq(&self.spec, &other.spec) || self.spec.same_as(other.spec.as_ref()))
    }
}

/// The envelope every object shares; `spec` is decoded once the kind is known.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Envelope {
    api_version: String,
    kind: String,
    metadata: Metadata,
    spec: serde_json::Value,
}

impl Object {
    /// Builds and validates an object from a typed spec (tests, generated objects).
    pub fn new<T: KindSpec>(metadata: Metadata, spec: T) -> Result<Object, ConfigError> {
        let object = Object {
            metadata,
            spec: Arc::new(spec),
        };
        object.checked()
    }

    pub fn kind(&self) -> Kind {
        self.spec.kind()
    }

    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    pub fn name(&self) -> &str {
        &self.metadata.name
    }

    pub fn key(&self) -> ObjectKey {
        ObjectKey::new(self.kind(), self.name())
    }

    /// The spec, if this object is of kind `T`.
    pub fn spec<T: KindSpec>(&self) -> Option<&T> {
        self.spec.as_any().downcast_ref::<T>()
    }

    pub(crate) fn dyn_spec(&self) -> &dyn Spec {
        self.spec.as_ref()
    }

    pub(crate) fn with_spec(&self, spec: Arc<dyn Spec>) -> Object {
        Object {
            metadata: self.metadata.clone(),
            spec,
        }
    }

    /// Decodes and validates one object. `location` names it in errors when its own
    /// kind/name cannot be read (e.g. `document 3`).
    pub fn from_json(value: serde_json::Value, location: &str) -> Result<Object, ConfigError> {
        let envelope: Envelope = serde_path_to_error::deserialize(value).map_err(|error| {
            let field = error.path().to_string();
            let field = if field == "." { String::new() } else { field };
            FieldError::new(location, field, error.into_inner().to_string())
        })?;
        // Objects spell the kind exactly; only the CLI and API lookups are lenient.
        let kind = Kind::from_name(&envelope.kind)
            .ok_or_else(|| FieldError::new(location, "kind", unknown_kind(&envelope.kind)))?;
        let label = format!("{kind}/{}", envelope.metadata.name);
        let mut checker = Checker::new(&label);
        if envelope.api_version != API_VERSION {
            checker.fail(
                "apiVersion",
                format!(
                    "unsupported apiVersion {:?}, expected {API_VERSION:?}",
                    envelope.api_version
                ),
            );
        }
        let spec = kind.decode(envelope.spec, &label)?;
        let object = Object {
            metadata: envelope.metadata,
            spec,
        };
        checker.errors.extend(object.problems());
        if checker.errors.is_empty() {
            Ok(object)
        } else {
            Err(ConfigError {
                errors: checker.errors,
            })
        }
    }

    fn checked(self) -> Result<Object, ConfigError> {
        let errors = self.problems();
        if errors.is_empty() {
            Ok(self)
        } else {
            Err(ConfigError { errors })
        }
    }

    fn problems(&self) -> Vec<FieldError> {
        let label = self.key().to_string();
        let mut checker = Checker::new(&label);
        check_name(&mut checker, "metadata.name", &self.metadata.name);
        for (key, value) in &self.metadata.labels {
            check_label(&mut checker, key, value);
        }
        self.spec.check(&mut checker);
        checker.errors
    }

    pub fn from_json_bytes(bytes: &[u8], location: &str) -> Result<Object, ConfigError> {
        let value: serde_json::Value = serde_json::from_slice(bytes)
            .map_err(|error| FieldError::new(location, "", format!("not valid JSON: {error}")))?;
        Object::from_json(value, location)
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": API_VERSION,
            "kind": self.kind().as_str(),
            "metadata": &self.metadata,
            "spec": self.spec.to_json(),
        })
    }

    pub fn to_json_bytes(&self) -> Vec<u8> {
        self.to_json().to_string().into_bytes()
    }
}

/// Gathers decoded objects, reporting the problems of every one rather than the first.
pub fn collect_objects<T>(
    results: impl IntoIterator<Item = Result<T, ConfigError>>,
) -> Result<Vec<T>, ConfigError> {
    let mut objects = Vec::new();
    let mut errors = Vec::new();
    for result in results {
        match result {
            Ok(object) => objects.push(object),
            Err(error) => errors.extend(error.errors),
        }
    }
    if errors.is_empty() {
        Ok(objects)
    } else {
        Err(ConfigError { errors })
    }
}

/// Names follow Kubernetes DNS labels, so the same objects can later be CRDs.
pub(crate) fn check_name(checker: &mut Checker<'_>, field: &str, name: &str) {
    let valid_chars = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    let valid_ends = !name.starts_with('-') && !name.ends_with('-');
    if name.is_empty() || name.len() > 63 || !valid_chars || !valid_ends {
        checker.fail(
            field,
            format!("invalid name {name:?}: use 1-63 lowercase letters, digits or '-', starting and ending with a letter or digit"),
        );
    }
}

fn check_label(checker: &mut Checker<'_>, key: &str, value: &str) {
    let ok = |s: &str, allow_empty: bool| {
        (allow_empty || !s.is_empty())
            && s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/'))
    };
    if !ok(key, false) {
        checker.fail(format!("metadata.labels.{key}"), "invalid label key");
    }
    if !ok(value, true) {
        checker.fail(
            format!("metadata.labels.{key}"),
            format!("invalid label value {value:?}"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BackendSpec, RouteSpec};
    use serde_json::json;

    #[test]
    fn round_trips_through_json() {
        let value = json!({
            "apiVersion": API_VERSION, "kind": "Backend",
            "metadata": {"name": "api", "labels": {"team": "a"}},
            "spec": {"endpoints": ["127.0.0.1:9000"]}
        });
        let object = Object::from_json(value, "document 1").unwrap();
        assert_eq!(object.key().to_string(), "Backend/api");
        assert!(object.spec::<BackendSpec>().is_some());
        assert!(object.spec::<RouteSpec>().is_none());
        let again = Object::from_json_bytes(&object.to_json_bytes(), "wire").unwrap();
        assert_eq!(object, again);
    }

    #[test]
    fn unknown_kind_names_the_document() {
        let value =
            json!({"apiVersion": API_VERSION, "kind": "Gateway", "metadata": {"name": "x"}, "spec": {}});
        let error = Object::from_json(value, "document 2").unwrap_err().to_string();
        assert!(
            error.starts_with("document 2: kind: unknown kind \"Gateway\""),
            "{error}"
        );
        // Objects spell kinds exactly; the lenient spellings are for the CLI.
        let value =
            json!({"apiVersion": API_VERSION, "kind": "route", "metadata": {"name": "x"}, "spec": {}});
        assert!(Object::from_json(value, "document 3").is_err());
    }

    #[test]
    fn unknown_spec_field_names_the_path() {
        let value = json!({"apiVersion": API_VERSION, "kind": "Backend", "metadata": {"name": "api"},
            "spec": {"endpoints": ["127.0.0.1:1"], "timeuot": "1s"}});
        let error = Object::from_json(value, "document 1").unwrap_err().to_string();
        assert!(
            error.starts_with("Backend/api: spec.timeuot: unknown field `timeuot`"),
            "{error}"
        );
    }

    #[test]
    fn bad_name_is_rejected() {
        let value = json!({"apiVersion": API_VERSION, "kind": "Backend", "metadata": {"name": "Bad_Name"},
            "spec": {"endpoints": ["127.0.0.1:1"]}});
        let error = Object::from_json(value, "document 1").unwrap_err().to_string();
        assert!(error.contains("metadata.name: invalid name"), "{error}");
    }

    #[test]
    fn kinds_parse_as_users_type_them() {
        let parse = |text: &str| Kind::parse(text).map(Kind::as_str);
        assert_eq!(parse("routes"), Some("Route"));
        assert_eq!(parse("ROUTE"), Some("Route"));
        assert_eq!(parse("rt"), Some("Route"));
        assert_eq!(parse("be"), Some("Backend"));
        assert_eq!(parse("Backend"), Some("Backend"));
        assert_eq!(parse("listeners"), Some("Listener"));
        assert_eq!(parse("ratelimitpolicies"), Some("RateLimitPolicy"));
        assert_eq!(parse("RateLimitPolicy"), Some("RateLimitPolicy"));
        assert_eq!(parse("rlp"), Some("RateLimitPolicy"));
        assert_eq!(parse("headerpolicies"), Some("HeaderPolicy"));
        assert_eq!(parse("gateway"), None);
        assert_eq!(parse("routess"), None);
    }

    #[test]
    fn kind_names_are_unique_across_the_registry() {
        let mut seen = std::collections::HashSet::new();
        for kind in Kind::all() {
            let info = kind.info();
            let names = std::iter::once(info.name.to_ascii_lowercase())
                .chain(std::iter::once(info.plural.to_string()))
                .chain(info.short_names.iter().map(|short| short.to_string()))
                // A kind named in the plural (McpToolPins, like Kubernetes' Endpoints) has
                // one name for both.
                .collect::<std::collections::BTreeSet<_>>();
            for name in names {
                assert!(seen.insert(name.clone()), "{name} names two kinds");
            }
        }
    }
}
