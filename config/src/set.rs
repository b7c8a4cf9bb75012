use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::error::{ConfigError, FieldError};
use crate::object::{Kind, Object, ObjectKey};

/// A whole config: every object, keyed by kind and name. Only ever built through
/// [`ConfigSet::apply`], [`ConfigSet::delete`] and [`ConfigSet::from_objects`], which
/// validate, so a `ConfigSet` held anywhere is consistent.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConfigSet {
    objects: BTreeMap<ObjectKey, Object>,
}

/// What a write did to one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Created,
    Configured,
    Unchanged,
    Deleted,
}

impl Change {
    pub fn as_str(self) -> &'static str {
        match self {
            Change::Created => "created",
            Change::Configured => "configured",
            Change::Unchanged => "unchanged",
            Change::Deleted => "deleted",
        }
    }
}

/// Selects a proxy's slice of the config by Listener labels; empty selects everything.
pub type ShardSelector = BTreeMap<String, String>;

impl ConfigSet {
    /// Builds a set from objects that must form a complete, valid config on their own.
    pub fn from_objects(objects: Vec<Object>) -> Result<ConfigSet, ConfigError> {
        let (set, _) = ConfigSet::default().apply(objects)?;
        Ok(set)
    }

    pub fn objects(&self) -> impl Iterator<Item = &Object> {
        self.objects.values()
    }

    pub fn get(&self, key: &ObjectKey) -> Option<&Object> {
        self.objects.get(key)
    }

    pub fn of_kind(&self, kind: Kind) -> impl Iterator<Item = &Object> {
        self.objects.values().filter(move |object| object.kind() == kind)
    }

    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    /// Returns the config with `objects` created or replaced, and what happened to each,
    /// or every reason the result would be invalid. `self` is never modified.
    pub fn apply(&self, objects: Vec<Object>) -> Result<(ConfigSet, Vec<(ObjectKey, Change)>), ConfigError> {
        let mut seen: HashMap<ObjectKey, usize> = HashMap::new();
        let mut errors = Vec::new();
        for (index, object) in objects.iter().enumerate() {
            if let Some(first) = seen.insert(object.key(), index) {
                errors.push(FieldError::new(
                    object.key().to_string(),
                    "metadata.name",
                    format!(
                        "defined twice in one apply (objects {} and {})",
                        first + 1,
                        index + 1
                    ),
                ));
            }
        }
        if !errors.is_empty() {
            return Err(ConfigError { errors });
        }
        let mut next = self.clone();
        let mut changes = Vec::with_capacity(objects.len());
        for object in objects {
            let key = object.key();
            let change = match next.objects.get(&key) {
                None => Change::Created,
                Some(existing) if *existing == object => Change::Unchanged,
                Some(_) => Change::Configured,
            };
            next.objects.insert(key.clone(), object);
            changes.push((key, change));
        }
        next.validate()?;
        Ok((next, changes))
    }

    /// Returns the config without the named objects. Deleting something another object
    /// still references is an error, as is deleting something that does not exist.
    pub fn delete(&self, keys: &[ObjectKey]) -> Result<(ConfigSet, Vec<(ObjectKey, Change)>), ConfigError> {
        let mut next = self.clone();
        let mut errors = Vec::new();
        for key in keys {
            if next.objects.remove(key).is_none() {
                errors.push(FieldError::new(key.to_string(), "", "not found"));
            }
        }
        if !errors.is_empty() {
            return Err(ConfigError { errors });
        }
        next.validate()?;
        Ok((
            next,
            keys.iter().map(|key| (key.clone(), Change::Deleted)).collect(),
        ))
    }

    /// Cross-object checks: every reference resolves, no two listeners share a socket.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut errors = Vec::new();
        let mut sockets: HashMap<std::net::SocketAddr, &str> = HashMap::new();
        for object in self.objects.values() {
            let label = object.key().to_string();
            match object {
                Object::Listener { metadata, spec } => {
                    let addr = spec.socket_addr();
                    // 0.0.0.0:P also conflicts with any specific address on port P.
                    let clash = sockets.iter().find(|(other, _)| {
                        other.port() == addr.port()
                            && (other.ip() == addr.ip()
                                || other.ip().is_unspecified()
                                || addr.ip().is_unspecified())
                    });
                    if let Some((_, other)) = clash {
                        errors.push(FieldError::new(
                            &label,
                            "spec.port",
                            format!("port {} is already used by Listener/{other}", addr.port()),
                        ));
                    }
                    sockets.insert(addr, &metadata.name);
                }
                Object::Route { spec, .. } => {
                    for (index, listener) in spec.listeners.iter().enumerate() {
                        if !self
                            .objects
                            .contains_key(&ObjectKey::new(Kind::Listener, listener.as_str()))
                        {
                            errors.push(FieldError::new(
                                &label,
                                format!("spec.listeners[{index}]"),
                                format!("Listener {listener:?} does not exist"),
                            ));
                        }
                    }
                    for (index, backend) in spec.backends.iter().enumerate() {
                        if !self
                            .objects
                            .contains_key(&ObjectKey::new(Kind::Backend, backend.name.as_str()))
                        {
                            errors.push(FieldError::new(
                                &label,
                                format!("spec.backends[{index}].name"),
                                format!("Backend {:?} does not exist", backend.name),
                            ));
                        }
                    }
                }
                Object::Backend { .. } => {}
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ConfigError { errors })
        }
    }

    /// The part of the config a proxy with this selector serves: the selected Listeners,
    /// the Routes attached to them (listing only selected listeners) and the Backends those
    /// Routes use. A slice of a valid config is valid.
    pub fn slice(&self, selector: &ShardSelector) -> ConfigSet {
        if selector.is_empty() {
            return self.clone();
        }
        let listeners: BTreeSet<&str> = self
            .of_kind(Kind::Listener)
            .filter(|listener| {
                selector
                    .iter()
                    .all(|(key, value)| listener.metadata().labels.get(key) == Some(value))
            })
            .map(Object::name)
            .collect();
        let mut slice = ConfigSet::default();
        let mut backends = BTreeSet::new();
        for object in self.objects.values() {
            match object {
                Object::Listener { metadata, .. } if listeners.contains(metadata.name.as_str()) => {
                    slice.objects.insert(object.key(), object.clone());
                }
                Object::Route { metadata, spec } => {
                    let mut spec = spec.clone();
                    spec.listeners.retain(|name| listeners.contains(name.as_str()));
                    if !spec.listeners.is_empty() {
                        backends.extend(spec.backends.iter().map(|backend| backend.name.clone()));
                        let route = Object::Route {
                            metadata: metadata.clone(),
                            spec,
                        };
                        slice.objects.insert(route.key(), route);
                    }
                }
                _ => {}
            }
        }
        for name in backends {
            let key = ObjectKey::new(Kind::Backend, name);
            if let Some(backend) = self.objects.get(&key) {
                slice.objects.insert(key, backend.clone());
            }
        }
        slice
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_documents;

    const BASE: &str = r#"
apiVersion: portcullis.dev/v1alpha1
kind: Listener
metadata: { name: public, labels: { edge: "true" } }
spec: { port: 8080 }
---
apiVersion: portcullis.dev/v1alpha1
kind: Listener
metadata: { name: internal }
spec: { port: 8081 }
---
apiVersion: portcullis.dev/v1alpha1
kind: Backend
metadata: { name: api }
spec: { endpoints: ["127.0.0.1:9000"] }
---
apiVersion: portcullis.dev/v1alpha1
kind: Backend
metadata: { name: admin }
spec: { endpoints: ["127.0.0.1:9001"] }
---
apiVersion: portcullis.dev/v1alpha1
kind: Route
metadata: { name: web }
spec: { listeners: [public, internal], backends: [{ name: api }] }
---
apiVersion: portcullis.dev/v1alpha1
kind: Route
metadata: { name: ops }
spec: { listeners: [internal], backends: [{ name: admin }] }
"#;

    fn base() -> ConfigSet {
        ConfigSet::from_objects(parse_documents(BASE).unwrap()).unwrap()
    }

    #[test]
    fn missing_backend_is_named() {
        let route = parse_documents(
            "apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {name: web}\nspec: {listeners: [public], backends: [{name: nope}]}",
        )
        .unwrap();
        let error = base().apply(route).unwrap_err().to_string();
        assert_eq!(
            error,
            "Route/web: spec.backends[0].name: Backend \"nope\" does not exist"
        );
    }

    #[test]
    fn duplicate_names_in_one_apply() {
        let doc = "apiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {name: x}\nspec: {endpoints: ['127.0.0.1:1']}\n";
        let twice = parse_documents(&format!("{doc}---\n{doc}")).unwrap();
        let error = ConfigSet::default().apply(twice).unwrap_err().to_string();
        assert!(
            error.contains("Backend/x: metadata.name: defined twice"),
            "{error}"
        );
    }

    #[test]
    fn port_conflicts_are_rejected() {
        let doc = "apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {name: other}\nspec: {address: 127.0.0.1, port: 8080}";
        let error = base()
            .apply(parse_documents(doc).unwrap())
            .unwrap_err()
            .to_string();
        assert!(error.contains("port 8080 is already used"), "{error}");
    }

    #[test]
    fn apply_reports_changes_and_leaves_original() {
        let original = base();
        let doc = "apiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {name: api}\nspec: {endpoints: ['127.0.0.1:9999']}";
        let (next, changes) = original.apply(parse_documents(doc).unwrap()).unwrap();
        assert_eq!(changes[0].1, Change::Configured);
        assert_ne!(next, original);
        let (_, again) = next.apply(parse_documents(doc).unwrap()).unwrap();
        assert_eq!(again[0].1, Change::Unchanged);
    }

    #[test]
    fn delete_of_referenced_backend_fails() {
        let error = base()
            .delete(&[ObjectKey::new(Kind::Backend, "api")])
            .unwrap_err()
            .to_string();
        assert!(error.contains("Route/web: spec.backends[0].name"), "{error}");
        let error = base()
            .delete(&[ObjectKey::new(Kind::Backend, "ghost")])
            .unwrap_err()
            .to_string();
        assert_eq!(error, "Backend/ghost: not found");
    }

    #[test]
    fn slice_follows_listener_labels() {
        let selector = ShardSelector::from([("edge".to_string(), "true".to_string())]);
        let slice = base().slice(&selector);
        let keys: Vec<String> = slice.objects().map(|o| o.key().to_string()).collect();
        assert_eq!(keys, ["Listener/public", "Route/web", "Backend/api"]);
        slice.validate().unwrap();
        match slice.get(&ObjectKey::new(Kind::Route, "web")) {
            Some(Object::Route { spec, .. }) => assert_eq!(spec.listeners, ["public"]),
            other => panic!("unexpected {other:?}"),
        }
    }
}
