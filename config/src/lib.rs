//! The Portcullis config model, shared by the control plane, the proxies, the CLI and the
//! operator: one definition of every kind, one parser and one validator.
//!
//! Objects look like Kubernetes objects (`apiVersion`, `kind`, `metadata.name` + labels,
//! `spec`). Validation happens at two levels:
//! * per object ([`Object::from_json`]): shape, unknown fields, value ranges;
//! * per config ([`ConfigSet::validate`]): references between objects, conflicts.
//!
//! Every error names the object and the field path, e.g.
//! `Route/web: spec.backends[0].name: Backend "api" does not exist`.

mod backend;
mod document;
mod error;
mod listener;
mod object;
mod route;
mod set;

pub use backend::BackendSpec;
pub use document::{parse_documents, to_yaml};
pub use error::{ConfigError, FieldError};
pub use listener::ListenerSpec;
pub use object::{collect_objects, Kind, Metadata, Object, ObjectKey, API_VERSION};
pub use route::{BackendRef, HeaderMatch, PathMatch, RouteMatch, RouteSpec};
pub use set::{Change, ConfigSet, ShardSelector};
