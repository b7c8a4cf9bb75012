//! Kinds of config object and the one trait every kind implements.
//!
//! A kind is a spec type implementing [`KindSpec`] plus one line in [`crate::kinds`]'
//! registry. Parsing, validation, references, delete protection and shard slicing are all
//! driven by the trait, so no code elsewhere lists the kinds, and none can drop one.

use std::any::Any;
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Checker, FieldError};
use crate::reference::Reference;
use crate::set::{ConfigSet, Scope};

type DecodeResult = Result<Arc<dyn Spec>, serde_path_to_error::Error<serde_json::Error>>;

/// What the registry knows about a kind: its names and how to decode its spec.
pub struct KindInfo {
    /// As written in objects: `RateLimitPolicy`.
    pub name: &'static str,
    /// Lowercase plural for the CLI and API: `ratelimitpolicies`.
    pub plural: &'static str,
    pub short_names: &'static [&'static str],
    /// Selected by a proxy's shard selector on its own labels; see [`KindSpec::SHARD_ROOT`].
    pub shard_root: bool,
    pub(crate) check_set: fn(&ConfigSet, Scope, &mut Vec<FieldError>),
    decode: fn(serde_json::Value) -> DecodeResult,
}

impl KindInfo {
    pub const fn of<T: KindSpec>(
        name: &'static str,
        plural: &'static str,
        short_names: &'static [&'static str],
    ) -> KindInfo {
        KindInfo {
            name,
            plural,
            short_names,
            shard_root: T::SHARD_ROOT,
            check_set: T::check_set,
            decode: decode_spec::<T>,
        }
    }
}

fn decode_spec<T: KindSpec>(value: serde_json::Value) -> DecodeResult {
    let spec: T = serde_path_to_error::deserialize(value)?;
    Ok(Arc::new(spec))
}

/// A registered kind. Cheap to copy; compares, orders and serializes by its name, ordered
/// as registered (listeners before the routes that use them, and so on).
#[derive(Clone, Copy)]
pub struct Kind(&'static KindInfo);

impl Kind {
    pub fn all() -> impl Iterator<Item = Kind> {
        crate::kinds::REGISTRY.iter().map(|info| Kind(info))
    }

    pub fn info(self) -> &'static KindInfo {
        self.0
    }

    pub fn as_str(self) -> &'static str {
        self.0.name
    }

    /// The kind of a spec type: `Kind::of::<RouteSpec>()`.
    pub fn of<T: KindSpec>() -> Kind {
        Kind(T::INFO)
    }

    /// Exactly as objects spell it: `Route`.
    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::all().find(|kind| kind.as_str() == name)
    }

    /// As users type it: singular, plural or short name, any case (`Route`, `routes`, `rt`).
    pub fn parse(text: &str) -> Option<Kind> {
        let lower = text.to_ascii_lowercase();
        Kind::all().find(|kind| {
            kind.0.name.eq_ignore_ascii_case(&lower)
                || kind.0.plural == lower
                || kind.0.short_names.contains(&lower.as_str())
        })
    }

    fn rank(self) -> usize {
        crate::kinds::REGISTRY
            .iter()
            .position(|info| info.name == self.0.name)
            .unwrap_or(usize::MAX)
    }

    pub(crate) fn decode(self, value: serde_json::Value, object: &str) -> Result<Arc<dyn Spec>, FieldError> {
        (self.0.decode)(value).map_err(|error| {
            let inner = error.path().to_string();
            let field = if inner == "." {
                "spec".to_string()
            } else {
                format!("spec.{inner}")
            };
            FieldError::new(object, field, error.into_inner().to_string())
        })
    }
}

pub(crate) fn unknown_kind(text: &str) -> String {
    let known: Vec<&str> = Kind::all().map(Kind::as_str).collect();
    format!("unknown kind {text:?}, expected one of {}", known.join(", "))
}

/// Lenient, like [`Kind::parse`], with an error that lists the kinds there are.
impl std::str::FromStr for Kind {
    type Err = String;

    fn from_str(text: &str) -> Result<Kind, String> {
        Kind::parse(text).ok_or_else(|| unknown_kind(text))
    }
}

impl PartialEq for Kind {
    fn eq(&self, other: &Kind) -> bool {
        // By name: a `const` may be instantiated at more than one address.
        self.0.name == other.0.name
    }
}

impl Eq for Kind {}

impl PartialOrd for Kind {
    fn partial_cmp(&self, other: &Kind) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Kind {
    fn cmp(&self, other: &Kind) -> Ordering {
        // Most comparisons (keys in a map, which group by kind) are of one kind with itself:
        // answered without looking up the registry order.
        if self.0.name == other.0.name {
            return Ordering::Equal;
        }
        self.rank()
            .cmp(&other.rank())
            .then_with(|| self.0.name.cmp(other.0.name))
    }
}

impl Hash for Kind {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.name.hash(state);
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.name)
    }
}

impl fmt::Debug for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.name)
    }
}

impl Serialize for Kind {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.0.name)
    }
}

impl<'de> Deserialize<'de> for Kind {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Kind, D::Error> {
        let name = String::deserialize(deserializer)?;
        Kind::from_name(&name).ok_or_else(|| serde::de::Error::custom(unknown_kind(&name)))
    }
}

/// Implemented by the spec of every kind; this is the whole contract of a kind.
pub trait KindSpec:
    Serialize + DeserializeOwned + Clone + PartialEq + fmt::Debug + Send + Sync + 'static
{
    const INFO: &'static KindInfo;

    /// Selected by a proxy's shard selector on its own labels (Listeners); other kinds are
    /// in a shard when they attach to, or are used by, something in it.
    const SHARD_ROOT: bool = false;

    /// Checks of this object alone (ranges, formats); fields are named from `spec.`.
    fn check(&self, checker: &mut Checker<'_>);

    /// The objects this one names, each with its field path and what the reference means.
    fn references(&self) -> Vec<Reference> {
        Vec::new()
    }

    /// Drops attachments to objects outside a shard, so a slice of a valid config is valid.
    fn retain_attachments(&mut self, _keep: &dyn Fn(&crate::ObjectKey) -> bool) {}

    /// Checks across all objects of this kind, e.g. two Listeners on one socket.
    fn check_set(_set: &ConfigSet, _scope: Scope, _errors: &mut Vec<FieldError>) {}
}

/// The object-safe face of [`KindSpec`], implemented for every kind by the blanket impl.
pub trait Spec: Any + fmt::Debug + Send + Sync {
    fn kind(&self) -> Kind;
    fn check(&self, checker: &mut Checker<'_>);
    fn references(&self) -> Vec<Reference>;
    fn with_attachments(&self, keep: &dyn Fn(&crate::ObjectKey) -> bool) -> Arc<dyn Spec>;
    fn to_json(&self) -> serde_json::Value;
    fn same_as(&self, other: &dyn Spec) -> bool;
    fn as_any(&self) -> &dyn Any;
}

impl<T: KindSpec> Spec for T {
    fn kind(&self) -> Kind {
        Kind(T::INFO)
    }

    fn check(&self, checker: &mut Checker<'_>) {
        KindSpec::check(self, checker)
    }

    fn references(&self) -> Vec<Reference> {
        KindSpec::references(self)
    }

    fn with_attachments(&self, keep: &dyn Fn(&crate::ObjectKey) -> bool) -> Arc<dyn Spec> {
        let mut spec = self.clone();
        spec.retain_attachments(keep);
        Arc::new(spec)
    }

    fn to_json(&self) -> serde_json::Value {
        // Specs are plain structs of strings, numbers, lists and maps: this cannot fail.
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    fn same_as(&self, other: &dyn Spec) -> bool {
        other.as_any().downcast_ref::<T>() == Some(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
