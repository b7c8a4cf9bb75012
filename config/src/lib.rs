//! The Portcullis config model, shared by the control plane, the proxies, the CLI and the
//! operator: one definition of every kind, one parser and one validator.
//!
//! Objects look like Kubernetes objects (`apiVersion`, `kind`, `metadata.name` + labels,
//! `spec`). Validation happens at two levels:
//! * per object ([`Object::from_json`]): shape, unknown fields, value ranges, and every value
//!   a proxy would refuse (a proxy never NACKs what the control plane accepted);
//! * per config ([`ConfigSet::validate`]): typed references between objects, conflicts.
//!
//! Every error names the object and the field path, e.g.
//! `Route/web: spec.backends[0]: Backend "api" does not exist`.
//!
//! Kinds live in [`kinds`], one file each, behind the [`KindSpec`] trait.

mod document;
mod duration;
mod error;
pub mod guard_patterns;
pub mod host;
mod kind;
pub mod kinds;
pub mod mcp_rules;
mod object;
pub mod path;
mod reference;
mod secret;
mod set;
pub mod tls;

pub use document::{parse_documents, to_yaml};
pub use duration::HumanDuration;
pub use error::{Checker, ConfigError, FieldError};
pub use kind::{Kind, KindInfo, KindSpec};
pub use kinds::*;
pub use object::{collect_objects, Metadata, Object, ObjectKey, API_VERSION};
pub use reference::{target_refs, Reference, Role, TargetRef};
pub use secret::SecretSource;
pub use set::{Change, ConfigSet, Scope, ShardSelector, Slicer};
