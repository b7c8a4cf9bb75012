use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{Checker, ConfigError, FieldError};
use crate::{BackendSpec, ListenerSpec, RouteSpec};

pub const API_VERSION: &str = "portcullis.dev/v1alpha1";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Kind {
    Listener,
    Route,
    Backend,
}

impl Kind {
    pub const ALL: [Kind; 3] = [Kind::Listener, Kind::Route, Kind::Backend];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Listener => "Listener",
            Kind::Route => "Route",
            Kind::Backend => "Backend",
        }
    }

    /// Accepts the kind as written in objects (`Route`) and the CLI's lowercase and plural
    /// spellings (`route`, `routes`).
    pub fn parse(text: &str) -> Option<Kind> {
        let lower = text.to_ascii_lowercase();
        let singular = lower.strip_suffix('s').unwrap_or(&lower);
        Kind::ALL
            .into_iter()
            .find(|kind| kind.as_str().eq_ignore_ascii_case(singular))
    }
}

/// Lenient, like [`Kind::parse`], with an error that lists the kinds there are.
impl std::str::FromStr for Kind {
    type Err = String;

    fn from_str(text: &str) -> Result<Kind, String> {
        Kind::parse(text).ok_or_else(|| unknown_kind(text))
    }
}

fn unknown_kind(text: &str) -> String {
    let known: Vec<&str> = Kind::ALL.iter().map(|kind| kind.as_str()).collect();
    format!("unknown kind {text:?}, expected one of {}", known.join(", "))
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

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

/// A validated config object.
#[derive(Debug, Clone, PartialEq)]
pub enum Object {
    Listener { metadata: Metadata, spec: ListenerSpec },
    Route { metadata: Metadata, spec: RouteSpec },
    Backend { metadata: Metadata, spec: BackendSpec },
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

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct EnvelopeOut<'a, S> {
    api_version: &'static str,
    kind: Kind,
    metadata: &'a Metadata,
    spec: &'a S,
}

impl Object {
    pub fn kind(&self) -> Kind {
        match self {
            Object::Listener { .. } => Kind::Listener,
            Object::Route { .. } => Kind::Route,
            Object::Backend { .. } => Kind::Backend,
        }
    }

    pub fn metadata(&self) -> &Metadata {
        match self {
            Object::Listener { metadata, .. }
            | Object::Route { metadata, .. }
            | Object::Backend { metadata, .. } => metadata,
        }
    }

    pub fn name(&self) -> &str {
        &self.metadata().name
    }

    pub fn key(&self) -> ObjectKey {
        ObjectKey::new(self.kind(), self.name())
    }

    /// Decodes and validates one object. `location` names it in errors when its own
    /// kind/name cannot be read (e.g. `document 3`).
    pub fn from_json(value: serde_json::Value, location: &str) -> Result<Object, ConfigError> {
        let envelope: Envelope = decode(value, location, "")?;
        // Objects spell the kind exactly; only the CLI and API lookups are lenient.
        let kind = Kind::parse(&envelope.kind)
            .filter(|kind| kind.as_str() == envelope.kind)
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
        check_name(&mut checker, "metadata.name", &envelope.metadata.name);
        for (key, value) in &envelope.metadata.labels {
            check_label(&mut checker, key, value);
        }
        let metadata = envelope.metadata;
        let object = match kind {
            Kind::Listener => {
                let spec: ListenerSpec = decode(envelope.spec, &label, "spec")?;
                spec.check(&mut checker);
                Object::Listener { metadata, spec }
            }
            Kind::Route => {
                let spec: RouteSpec = decode(envelope.spec, &label, "spec")?;
                spec.check(&mut checker);
                Object::Route { metadata, spec }
            }
            Kind::Backend => {
                let spec: BackendSpec = decode(envelope.spec, &label, "spec")?;
                spec.check(&mut checker);
                Object::Backend { metadata, spec }
            }
        };
        if checker.errors.is_empty() {
            Ok(object)
        } else {
            Err(ConfigError {
                errors: checker.errors,
            })
        }
    }

    pub fn from_json_bytes(bytes: &[u8], location: &str) -> Result<Object, ConfigError> {
        let value: serde_json::Value = serde_json::from_slice(bytes)
            .map_err(|error| FieldError::new(location, "", format!("not valid JSON: {error}")))?;
        Object::from_json(value, location)
    }

    pub fn to_json(&self) -> serde_json::Value {
        fn envelope<S: Serialize>(kind: Kind, metadata: &Metadata, spec: &S) -> serde_json::Value {
            let out = EnvelopeOut {
                api_version: API_VERSION,
                kind,
                metadata,
                spec,
            };
            // Serializing plain structs of strings, numbers and maps into a Value cannot fail.
            serde_json::to_value(out).unwrap_or(serde_json::Value::Null)
        }
        match self {
            Object::Listener { metadata, spec } => envelope(Kind::Listener, metadata, spec),
            Object::Route { metadata, spec } => envelope(Kind::Route, metadata, spec),
            Object::Backend { metadata, spec } => envelope(Kind::Backend, metadata, spec),
        }
    }

    pub fn to_json_bytes(&self) -> Vec<u8> {
        self.to_json().to_string().into_bytes()
    }
}

/// Gathers decoded objects, reporting the problems of every one rather than the first.
pub fn collect_objects(
    results: impl IntoIterator<Item = Result<Object, ConfigError>>,
) -> Result<Vec<Object>, ConfigError> {
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

/// Deserializes with the failing field's path in the error.
fn decode<T: serde::de::DeserializeOwned>(
    value: serde_json::Value,
    object: &str,
    prefix: &str,
) -> Result<T, FieldError> {
    serde_path_to_error::deserialize(value).map_err(|error| {
        let inner = error.path().to_string();
        let field = match (prefix.is_empty(), inner.as_str()) {
            (_, ".") => prefix.to_string(),
            (true, inner) => inner.to_string(),
            (false, inner) => format!("{prefix}.{inner}"),
        };
        FieldError::new(object, field, error.into_inner().to_string())
    })
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
    fn kind_parses_cli_spellings() {
        assert_eq!(Kind::parse("routes"), Some(Kind::Route));
        assert_eq!(Kind::parse("Backend"), Some(Kind::Backend));
        assert_eq!(Kind::parse("gateway"), None);
    }
}
