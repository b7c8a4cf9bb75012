use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use imbl::ordmap::DiffItem;
use imbl::{OrdMap, OrdSet};

use crate::error::{ConfigError, FieldError};
use crate::kind::{Kind, KindSpec};
use crate::object::{Metadata, Object, ObjectKey};
use crate::reference::Role;

/// A whole config: every object, keyed by kind and name. Only ever built through
/// [`ConfigSet::apply`], [`ConfigSet::delete`] and [`ConfigSet::from_objects`], which
/// validate, so a `ConfigSet` held anywhere is consistent.
///
/// The map is persistent: the next version shares everything a write left untouched, so
/// a write costs what it changes (plus the set-wide rules), not the size of the config.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConfigSet {
    objects: OrdMap<ObjectKey, Object>,
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

/// What a config's set-wide rules judge: a whole config, or a proxy's slice of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Whole,
    /// A slice drops attachments to what lies outside its shard (see
    /// [`KindSpec::retain_attachments`](crate::KindSpec::retain_attachments)); a rule that
    /// needs everything an attachment reached was judged on the whole config, at apply.
    Slice,
}

impl ConfigSet {
    /// Builds a set from objects that must form a complete, valid config on their own.
    pub fn from_objects(objects: Vec<Object>) -> Result<ConfigSet, ConfigError> {
        let (set, _) = ConfigSet::default().apply_in(objects, Scope::Whole)?;
        Ok(set)
    }

    /// Builds a set from a proxy's slice of a valid config (see [`ConfigSet::slice`]).
    pub fn from_slice(objects: Vec<Object>) -> Result<ConfigSet, ConfigError> {
        let (set, _) = ConfigSet::default().apply_in(objects, Scope::Slice)?;
        Ok(set)
    }

    pub fn objects(&self) -> impl Iterator<Item = &Object> {
        self.objects.values()
    }

    pub fn get(&self, key: &ObjectKey) -> Option<&Object> {
        self.objects.get(key)
    }

    pub fn of_kind(&self, kind: Kind) -> impl Iterator<Item = &Object> {
        // Keys order by kind first, and the empty name sorts before every other.
        self.objects
            .range(ObjectKey::new(kind, "")..)
            .take_while(move |(key, _)| key.kind == kind)
            .map(|(_, object)| object)
    }

    /// Every object of kind `T` with its typed spec.
    pub fn specs<T: KindSpec>(&self) -> impl Iterator<Item = (&Metadata, &T)> {
        self.of_kind(Kind::of::<T>())
            .filter_map(|object| Some((object.metadata(), object.spec::<T>()?)))
    }

    pub fn spec<T: KindSpec>(&self, name: &str) -> Option<&T> {
        self.objects
            .get(&ObjectKey::new(Kind::of::<T>(), name))
            .and_then(Object::spec::<T>)
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
        self.apply_in(objects, Scope::Whole)
    }

    fn apply_in(
        &self,
        objects: Vec<Object>,
        scope: Scope,
    ) -> Result<(ConfigSet, Vec<(ObjectKey, Change)>), ConfigError> {
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
        // Creating or replacing an object cannot break another's reference (the target still
        // exists), so only the written objects' references need checking.
        let written: Vec<&Object> = changes
            .iter()
            .filter(|(_, change)| *change != Change::Unchanged)
            .filter_map(|(key, _)| next.objects.get(key))
            .collect();
        next.check(written, scope)?;
        Ok((next, changes))
    }

    /// Returns the config without the named objects. Deleting something another object
    /// still references is an error naming the referrer, as is deleting something that
    /// does not exist. Naming an object twice deletes it once.
    pub fn delete(&self, keys: &[ObjectKey]) -> Result<(ConfigSet, Vec<(ObjectKey, Change)>), ConfigError> {
        let keys: Vec<&ObjectKey> = keys.iter().collect::<BTreeSet<_>>().into_iter().collect();
        let mut next = self.clone();
        let mut errors = Vec::new();
        for key in &keys {
            if next.objects.remove(*key).is_none() {
                errors.push(FieldError::new(key.to_string(), "", "not found"));
            }
        }
        if !errors.is_empty() {
            return Err(ConfigError { errors });
        }
        for object in next.objects.values() {
            for reference in object.dyn_spec().references() {
                let Ok(kind) = reference.target_kind() else {
                    continue;
                };
                let target = ObjectKey::new(kind, reference.name.as_str());
                if keys.contains(&&target) {
                    errors.push(FieldError::new(
                        target.to_string(),
                        "",
                        format!("still referenced by {} at {}", object.key(), reference.field),
                    ));
                }
            }
        }
        if !errors.is_empty() {
            return Err(ConfigError { errors });
        }
        // Every remaining reference was valid and none names what went: only the set-wide
        // rules are left to check.
        next.check([], Scope::Whole)?;
        Ok((
            next,
            keys.into_iter()
                .map(|key| (key.clone(), Change::Deleted))
                .collect(),
        ))
    }

    /// Cross-object checks: every reference names an allowed kind and an existing object,
    /// and each kind's own set-wide rules (e.g. no two listeners on one socket).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check(self.objects.values(), Scope::Whole)
    }

    /// The references of `objects`, and every kind's set-wide rules.
    fn check<'a>(
        &self,
        objects: impl IntoIterator<Item = &'a Object>,
        scope: Scope,
    ) -> Result<(), ConfigError> {
        let mut errors = Vec::new();
        for object in objects {
            for reference in object.dyn_spec().references() {
                let label = object.key().to_string();
                match reference.target_kind() {
                    Err(problem) => errors.push(FieldError::new(label, &reference.field, problem)),
                    Ok(kind) => {
                        if !self
                            .objects
                            .contains_key(&ObjectKey::new(kind, reference.name.as_str()))
                        {
                            errors.push(FieldError::new(
                                label,
                                &reference.field,
                                format!("{kind} {:?} does not exist", reference.name),
                            ));
                        }
                    }
                }
            }
        }
        for kind in Kind::all() {
            (kind.info().check_set)(self, scope, &mut errors);
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(ConfigError { errors })
        }
    }

    /// What differs from `self` to `next`: the objects created or changed (as in `next`) and
    /// the keys of those removed. Versions that share objects (one derived from the other)
    /// compare in time proportional to what differs.
    pub fn differences<'a>(&'a self, next: &'a ConfigSet) -> (Vec<&'a Object>, Vec<&'a ObjectKey>) {
        let (mut changed, mut removed) = (Vec::new(), Vec::new());
        for difference in self.objects.diff(&next.objects) {
            match difference {
                DiffItem::Add(_, object) | DiffItem::Update { new: (_, object), .. } => changed.push(object),
                DiffItem::Remove(key, _) => removed.push(key),
            }
        }
        (changed, removed)
    }

    /// The part of the config a proxy with this selector serves: the shard roots
    /// (Listeners) whose labels match, everything attached to what is in the slice, and
    /// everything used by what is in the slice; attachments to objects outside the slice
    /// are dropped. A slice of a valid config is valid. To cut several, see [`Slicer`].
    pub fn slice(&self, selector: &ShardSelector) -> ConfigSet {
        if selector.is_empty() {
            return self.clone();
        }
        Slicer::new(self.clone()).slice(selector)
    }
}

/// Cuts slices of one config ([`ConfigSet::slice`]): the edges between its objects are found
/// once, however many selectors are cut, and carried to the next version of the config by
/// what changed ([`Slicer::advance`]), so a write costs what it changed.
#[derive(Clone)]
pub struct Slicer {
    config: ConfigSet,
    /// What each object uses: in a slice with it.
    uses: OrdMap<ObjectKey, Vec<ObjectKey>>,
    /// What each object attaches to: it joins a slice holding one of them, and is kept as it
    /// is (shared) unless one of them is left out.
    attaches: OrdMap<ObjectKey, Vec<ObjectKey>>,
    /// The other way: what is attached to each object.
    attached: OrdMap<ObjectKey, OrdSet<ObjectKey>>,
    /// Set by [`Slicer::advance`] when the change moved no object into or out of any slice:
    /// the objects that changed. See [`Slicer::slice_after`].
    changed_in_place: Option<Vec<ObjectKey>>,
}

impl Slicer {
    /// Takes the config by value: cloning a [`ConfigSet`] shares its objects.
    pub fn new(config: ConfigSet) -> Slicer {
        let mut slicer = Slicer {
            config: ConfigSet::default(),
            uses: OrdMap::new(),
            attaches: OrdMap::new(),
            attached: OrdMap::new(),
            changed_in_place: None,
        };
        for object in config.objects.values() {
            slicer.link(object);
        }
        slicer.config = config;
        slicer
    }

    /// The slicer of `config`, a later version of this slicer's config: only the objects
    /// that differ are looked at.
    pub fn advance(&self, config: ConfigSet) -> Slicer {
        let mut next = self.clone();
        // In place: only objects replaced, none a shard root, each with the same edges, so
        // every slice holds the same objects as before.
        let mut in_place = Some(Vec::new());
        for change in self.config.objects.diff(&config.objects) {
            match change {
                DiffItem::Add(_, object) => {
                    in_place = None;
                    next.link(object);
                }
                DiffItem::Remove(key, _) => {
                    in_place = None;
                    next.unlink(key);
                }
                DiffItem::Update {
                    new: (key, object), ..
                } => {
                    next.unlink(key);
                    next.link(object);
                    let same_edges = !key.kind.info().shard_root
                        && self.uses.get(key) == next.uses.get(key)
                        && self.attaches.get(key) == next.attaches.get(key);
                    match (&mut in_place, same_edges) {
                        (Some(changed), true) => changed.push(key.clone()),
                        _ => in_place = None,
                    }
                }
            }
        }
        next.config = config;
        next.changed_in_place = in_place;
        next
    }

    /// Whether the change this slicer was advanced by moved nothing into or out of a slice,
    /// so that [`Slicer::slice_after`] has only the changed objects to look at.
    pub fn changed_in_place(&self) -> bool {
        self.changed_in_place.is_some()
    }

    /// `selector`'s slice, given `previous`: the same selector's slice of the version this
    /// slicer was advanced from. When the change moved nothing into or out of a slice, only
    /// the changed objects are looked at, and the result shares the rest with `previous`.
    pub fn slice_after(&self, previous: &ConfigSet, selector: &ShardSelector) -> ConfigSet {
        let Some(changed) = self.changed_in_place.as_ref().filter(|_| !selector.is_empty()) else {
            return self.slice(selector);
        };
        let mut next = previous.clone();
        let keep = |key: &ObjectKey| previous.objects.contains_key(key);
        for key in changed.iter().filter(|key| keep(key)) {
            if let Some(object) = self.config.objects.get(key) {
                next.objects.insert(key.clone(), self.trimmed(key, object, &keep));
            }
        }
        next
    }

    /// `object` without its attachments to what `keep` leaves out (shared if there are none).
    fn trimmed(&self, key: &ObjectKey, object: &Object, keep: &dyn Fn(&ObjectKey) -> bool) -> Object {
        let all_kept = self
            .attaches
            .get(key)
            .is_none_or(|targets| targets.iter().all(keep));
        match all_kept {
            true => object.clone(),
            false => object.with_spec(object.dyn_spec().with_attachments(keep)),
        }
    }

    fn link(&mut self, object: &Object) {
        let key = object.key();
        let (mut uses, mut attaches) = (Vec::new(), Vec::new());
        for reference in object.dyn_spec().references() {
            let Ok(kind) = reference.target_kind() else {
                continue;
            };
            let target = ObjectKey::new(kind, reference.name);
            match reference.role {
                Role::AttachTo => {
                    self.attached
                        .entry(target.clone())
                        .or_default()
                        .insert(key.clone());
                    attaches.push(target);
                }
                Role::Uses => uses.push(target),
            }
        }
        if !uses.is_empty() {
            self.uses.insert(key.clone(), uses);
        }
        if !attaches.is_empty() {
            self.attaches.insert(key, attaches);
        }
    }

    fn unlink(&mut self, key: &ObjectKey) {
        self.uses.remove(key);
        for target in self.attaches.remove(key).into_iter().flatten() {
            if let Some(attached) = self.attached.get_mut(&target) {
                attached.remove(key);
                if attached.is_empty() {
                    self.attached.remove(&target);
                }
            }
        }
    }

    pub fn slice(&self, selector: &ShardSelector) -> ConfigSet {
        if selector.is_empty() {
            return self.config.clone();
        }
        let mut queue: VecDeque<&ObjectKey> = Kind::all()
            .filter(|kind| kind.info().shard_root)
            .flat_map(|kind| {
                self.config
                    .objects
                    .range(ObjectKey::new(kind, "")..)
                    .take_while(move |(key, _)| key.kind == kind)
            })
            .filter(|(_, object)| {
                selector
                    .iter()
                    .all(|(key, value)| object.metadata().labels.get(key) == Some(value))
            })
            .map(|(key, _)| key)
            .collect();
        let mut included: BTreeSet<&ObjectKey> = queue.iter().copied().collect();
        while let Some(key) = queue.pop_front() {
            let uses = self.uses.get(key).into_iter().flatten();
            let attached = self.attached.get(key).into_iter().flatten();
            for next in uses.chain(attached) {
                if included.insert(next) {
                    queue.push_back(next);
                }
            }
        }
        let keep = |key: &ObjectKey| included.contains(key);
        let objects = included
            .iter()
            .filter_map(|key| {
                let object = self.config.objects.get(*key)?;
                Some(((*key).clone(), self.trimmed(key, object, &keep)))
            })
            .collect();
        ConfigSet { objects }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{parse_documents, BackendSpec, RouteSpec};

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
            "Route/web: spec.backends[0]: Backend \"nope\" does not exist"
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
            .delete(&[ObjectKey::new(Kind::of::<BackendSpec>(), "api")])
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            "Backend/api: still referenced by Route/web at spec.backends[0]"
        );
        let error = base()
            .delete(&[ObjectKey::new(Kind::of::<BackendSpec>(), "ghost")])
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
        assert_eq!(slice.spec::<RouteSpec>("web").unwrap().listeners, ["public"]);
    }

    fn apply_yaml(set: &ConfigSet, yaml: &str) -> Result<ConfigSet, String> {
        let objects = parse_documents(yaml).map_err(|error| error.to_string())?;
        set.apply(objects)
            .map(|(next, _)| next)
            .map_err(|error| error.to_string())
    }

    #[test]
    fn policies_attach_by_typed_reference() {
        let policy = |targets: &str| {
            format!("apiVersion: portcullis.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {{name: limit}}\nspec: {{targetRefs: {targets}, requestsPerSecond: 5}}")
        };
        let set = apply_yaml(
            &base(),
            &policy("[{kind: Route, name: web}, {kind: Listener, name: internal}]"),
        )
        .unwrap();
        assert_eq!(set.len(), 7);
        let error = apply_yaml(&base(), &policy("[{kind: Backend, name: api}]")).unwrap_err();
        assert_eq!(
            error,
            "RateLimitPolicy/limit: spec.targetRefs[0]: kind \"Backend\" cannot be referenced here, expected Listener or Route"
        );
        let error = apply_yaml(
            &base(),
            &policy("[{kind: Route, name: web}, {kind: Route, name: web}]"),
        )
        .unwrap_err();
        assert_eq!(
            error,
            "RateLimitPolicy/limit: spec.targetRefs[1]: Route/web is already a target"
        );
        let error = apply_yaml(&base(), &policy("[{kind: Route, name: nope}]")).unwrap_err();
        assert_eq!(
            error,
            "RateLimitPolicy/limit: spec.targetRefs[0]: Route \"nope\" does not exist"
        );
        let error = set
            .delete(&[ObjectKey::new(Kind::of::<RouteSpec>(), "web")])
            .unwrap_err()
            .to_string();
        assert_eq!(
            error,
            "Route/web: still referenced by RateLimitPolicy/limit at spec.targetRefs[0]"
        );
    }

    #[test]
    fn backend_refs_name_their_kind() {
        let route = "apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {name: web}\nspec: {listeners: [public], backends: [{kind: Listener, name: internal}]}";
        let error = apply_yaml(&base(), route).unwrap_err();
        assert_eq!(
            error,
            "Route/web: spec.backends[0]: kind \"Listener\" cannot be referenced here, expected Backend or InferencePool or McpBackend"
        );
    }

    #[test]
    fn slice_carries_the_policies_of_what_it_holds() {
        let policies = "apiVersion: portcullis.dev/v1alpha1\nkind: HeaderPolicy\nmetadata: {name: tag}\nspec: {targetRefs: [{kind: Route, name: web}, {kind: Route, name: ops}], request: {set: [{name: x-tag, value: a}]}}\n---\napiVersion: portcullis.dev/v1alpha1\nkind: RateLimitPolicy\nmetadata: {name: internal-only}\nspec: {targetRefs: [{kind: Listener, name: internal}], requestsPerSecond: 1}";
        let set = apply_yaml(&base(), policies).unwrap();
        let selector = ShardSelector::from([("edge".to_string(), "true".to_string())]);
        let slice = set.slice(&selector);
        let keys: Vec<String> = slice.objects().map(|o| o.key().to_string()).collect();
        assert_eq!(
            keys,
            ["Listener/public", "Route/web", "Backend/api", "HeaderPolicy/tag"]
        );
        let tag = slice.spec::<crate::HeaderPolicySpec>("tag").unwrap();
        assert_eq!(
            tag.target_refs.len(),
            1,
            "the attachment to Route/ops is outside the slice"
        );
        slice.validate().unwrap();
    }

    /// A rule naming a server of another shard is checked on the whole config; the slice
    /// that keeps only this shard's McpBackend is still a valid config for its proxy.
    #[test]
    fn a_slice_keeps_rules_about_servers_of_other_shards() {
        let mcp = r#"
apiVersion: portcullis.dev/v1alpha1
kind: McpBackend
metadata: {name: near}
spec: {servers: [{name: a, url: 'http://127.0.0.1:9000/mcp'}]}
---
apiVersion: portcullis.dev/v1alpha1
kind: McpBackend
metadata: {name: far}
spec: {servers: [{name: b, url: 'http://127.0.0.1:9001/mcp'}]}
---
apiVersion: portcullis.dev/v1alpha1
kind: Route
metadata: {name: tools-x}
spec: {listeners: [public], backends: [{kind: McpBackend, name: near}]}
---
apiVersion: portcullis.dev/v1alpha1
kind: Route
metadata: {name: tools-y}
spec: {listeners: [internal], backends: [{kind: McpBackend, name: far}]}
---
apiVersion: portcullis.dev/v1alpha1
kind: McpAuthorization
metadata: {name: authz}
spec:
  targetRefs: [{kind: McpBackend, name: near}, {kind: McpBackend, name: far}]
  deny: ['mcp.server == "b" && mcp.tool.name == "rm"']
"#;
        let set = apply_yaml(&base(), mcp).unwrap();
        let edge = ShardSelector::from([("edge".to_string(), "true".to_string())]);
        let slice = set.slice(&edge);
        let authz = slice.spec::<crate::McpAuthorizationSpec>("authz").unwrap();
        assert_eq!(authz.target_refs.len(), 1, "McpBackend/far is outside the slice");
        let objects: Vec<Object> = slice.objects().cloned().collect();
        assert!(
            ConfigSet::from_objects(objects.clone()).is_err(),
            "as a whole config, the rule about server b could never match"
        );
        assert_eq!(ConfigSet::from_slice(objects).unwrap(), slice);
        // On the whole config, a rule that no target's server can match is still refused.
        let never = mcp.replace(r#"mcp.server == "b""#, r#"mcp.server == "c""#);
        let error = apply_yaml(&base(), &never).unwrap_err();
        assert!(error.contains("\"c\""), "{error}");
    }

    /// Whatever attaches across shards, each shard's slice is a config its proxies accept:
    /// attachments outside the shard are dropped, and nothing left refers to them.
    #[test]
    fn every_slice_of_a_config_spanning_shards_is_valid() {
        let doc = |kind: &str, name: &str, spec: &str| {
            format!("apiVersion: portcullis.dev/v1alpha1\nkind: {kind}\nmetadata: {{name: {name}}}\nspec: {spec}\n---\n")
        };
        let listener = |name: &str, shard: &str, port: u16| {
            format!("apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: {name}, labels: {{shard: {shard}}}}}\nspec: {{port: {port}}}\n---\n")
        };
        let yaml = [
            listener("east", "a", 8080),
            listener("west", "b", 8081),
            doc("Backend", "api", "{endpoints: ['127.0.0.1:9000']}"),
            doc("McpBackend", "tools-a", "{servers: [{name: math, url: 'http://127.0.0.1:9001/mcp'}]}"),
            doc("McpBackend", "tools-b", "{servers: [{name: web, url: 'http://127.0.0.1:9002/mcp'}]}"),
            doc("InferencePool", "qwen", "{endpoints: ['127.0.0.1:9003'], models: [{name: m}]}"),
            doc("Route", "api-a", "{listeners: [east], backends: [{name: api}]}"),
            doc("Route", "api-both", "{listeners: [east, west], backends: [{name: api}], hostnames: [both.example]}"),
            doc("Route", "mcp-a", "{listeners: [east], backends: [{kind: McpBackend, name: tools-a}], matches: [{path: {prefix: /mcp}}]}"),
            doc("Route", "mcp-b", "{listeners: [west], backends: [{kind: McpBackend, name: tools-b}], matches: [{path: {prefix: /mcp}}]}"),
            doc("Route", "llm-b", "{listeners: [west], backends: [{kind: InferencePool, name: qwen}], matches: [{path: {prefix: /v1}}]}"),
            doc("HeaderPolicy", "tag", "{targetRefs: [{kind: Route, name: api-a}, {kind: Route, name: api-both}], request: {set: [{name: x-tag, value: a}]}}"),
            doc("HeaderPolicy", "served-by", "{targetRefs: [{kind: Listener, name: east}, {kind: Listener, name: west}], response: {set: [{name: x-served-by, value: p}]}}"),
            doc("RateLimitPolicy", "limit", "{targetRefs: [{kind: Listener, name: east}, {kind: Route, name: llm-b}], requestsPerSecond: 5}"),
            doc("McpAuthorization", "authz", r#"{targetRefs: [{kind: McpBackend, name: tools-a}, {kind: McpBackend, name: tools-b}], deny: ['mcp.server == "web" && mcp.tool.name == "fetch"', 'mcp.server == "math" && mcp.tool.name == "div"']}"#),
            doc("Guardrail", "no-secrets", "{targetRefs: [{kind: McpBackend, name: tools-a}, {kind: McpBackend, name: tools-b, sectionName: web}], phases: [McpRequest], builtin: {deny: [{pattern: password}]}}"),
        ]
        .concat();
        let config = ConfigSet::from_objects(parse_documents(&yaml).unwrap());
        let config = config.unwrap_or_else(|error| panic!("{error}"));
        for shard in ["a", "b", "c"] {
            let selector = ShardSelector::from([("shard".to_string(), shard.to_string())]);
            let slice = config.slice(&selector);
            let objects: Vec<Object> = slice.objects().cloned().collect();
            if let Err(error) = ConfigSet::from_slice(objects) {
                panic!("the slice of shard {shard} is refused: {error}");
            }
        }
    }

    /// A slicer carried across versions cuts exactly what a fresh one cuts: policies added,
    /// a route moved between listeners, a listener relabelled, objects deleted.
    #[test]
    fn an_advanced_slicer_cuts_what_a_new_one_cuts() {
        let edge = ShardSelector::from([("edge".to_string(), "true".to_string())]);
        let steps = [
            "apiVersion: portcullis.dev/v1alpha1\nkind: HeaderPolicy\nmetadata: {name: tag}\nspec: {targetRefs: [{kind: Route, name: web}, {kind: Route, name: ops}], request: {set: [{name: x-tag, value: a}]}}",
            "apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {name: ops}\nspec: {listeners: [public], backends: [{name: admin}]}",
            "apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {name: internal, labels: {edge: \"true\"}}\nspec: {port: 8081}",
            "apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {name: web}\nspec: {listeners: [internal], backends: [{name: api}]}",
            // In place: new endpoints, a new header value; nothing joins or leaves a slice.
            "apiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {name: api}\nspec: {endpoints: [\"127.0.0.1:9100\"]}",
            "apiVersion: portcullis.dev/v1alpha1\nkind: HeaderPolicy\nmetadata: {name: tag}\nspec: {targetRefs: [{kind: Route, name: web}, {kind: Route, name: ops}], request: {set: [{name: x-tag, value: b}]}}",
        ];
        let mut config = base();
        let mut slicer = Slicer::new(config.clone());
        let mut previous = slicer.slice(&edge);
        for step in steps {
            config = apply_yaml(&config, step).unwrap();
            slicer = slicer.advance(config.clone());
            let fresh = Slicer::new(config.clone()).slice(&edge);
            assert_eq!(slicer.slice(&edge), fresh, "after {step}");
            let after = slicer.slice_after(&previous, &edge);
            assert_eq!(after, fresh, "after {step}");
            let in_place = step.contains("kind: Backend") || step.contains("x-tag, value: b");
            assert_eq!(slicer.changed_in_place.is_some(), in_place, "after {step}");
            previous = after;
        }
        let policy = ObjectKey::new(Kind::of::<crate::HeaderPolicySpec>(), "tag");
        config = config.delete(&[policy]).unwrap().0;
        slicer = slicer.advance(config.clone());
        assert_eq!(slicer.slice(&edge), Slicer::new(config.clone()).slice(&edge));
        assert_eq!(slicer.slice(&edge).len(), 6);
    }

    #[test]
    fn deleting_one_object_named_twice_deletes_it_once() {
        let key = ObjectKey::new(Kind::of::<RouteSpec>(), "ops");
        let (next, changes) = base().delete(&[key.clone(), key]).unwrap();
        assert_eq!(changes.len(), 1);
        assert_eq!(next.len(), 5);
    }

    #[test]
    fn values_a_proxy_would_refuse_are_refused_at_apply() {
        let route = |matches: &str| {
            format!("apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {{name: web}}\nspec: {{listeners: [public], backends: [{{name: api}}], matches: [{matches}]}}")
        };
        let error =
            apply_yaml(&base(), &route(r#"{headers: [{name: x-a, value: "a\u0001b"}]}"#)).unwrap_err();
        assert!(
            error.contains("spec.matches[0].headers[0].value: invalid header value"),
            "{error}"
        );
        let error = apply_yaml(&base(), &route("{path: {prefix: /a/../b}}")).unwrap_err();
        assert!(
            error.contains("spec.matches[0].path: path \"/a/../b\" is not normalized"),
            "{error}"
        );
    }

    /// The proxy removes a client's hop-by-hop headers before it routes: a route that needs
    /// one could never match.
    #[test]
    fn a_route_cannot_match_on_a_header_of_the_connection() {
        let route = |name: &str, value: &str| {
            format!("apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {{name: web}}\nspec: {{listeners: [public], backends: [{{name: api}}], matches: [{{headers: [{{name: {name}, value: {value}}}]}}]}}")
        };
        for (name, value) in [("Upgrade", "websocket"), ("connection", "close"), ("te", "gzip")] {
            let error = apply_yaml(&base(), &route(name, value)).unwrap_err();
            assert!(
                error.contains("spec.matches[0].headers[0].name") && error.contains("could never match"),
                "{name}: {error}"
            );
        }
        apply_yaml(&base(), &route("te", "trailers")).unwrap();
        apply_yaml(&base(), &route("x-tenant", "a")).unwrap();
    }

    /// A proxy's dual-stack socket on `::ffff:127.0.0.1` takes `127.0.0.1` too.
    #[test]
    fn an_ipv4_mapped_address_clashes_with_its_ipv4_address() {
        let listener = |address: &str| {
            format!("apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: mapped}}\nspec: {{address: '{address}', port: 9090}}\n---\napiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: plain}}\nspec: {{address: 127.0.0.1, port: 9090}}")
        };
        let error = apply_yaml(&base(), &listener("::ffff:127.0.0.1")).unwrap_err();
        assert!(
            error.contains("port 9090 is already used by Listener/"),
            "{error}"
        );
        apply_yaml(&base(), &listener("::1")).unwrap();
    }

    /// An McpBackend times and sends its servers' messages itself: a route's timeout and
    /// retries would be accepted and never used.
    #[test]
    fn a_route_to_an_mcp_backend_takes_no_timeout_or_retry() {
        let route = |extra: &str| {
            format!("apiVersion: portcullis.dev/v1alpha1\nkind: McpBackend\nmetadata: {{name: tools}}\nspec: {{servers: [{{name: math, url: 'http://127.0.0.1:9001/mcp'}}]}}\n---\napiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {{name: tools}}\nspec: {{listeners: [public], backends: [{{kind: McpBackend, name: tools}}]{extra}}}")
        };
        let error = apply_yaml(&base(), &route(", timeout: 2s")).unwrap_err();
        assert!(
            error.contains("spec.timeout: a route to an McpBackend does not time its servers"),
            "{error}"
        );
        let error = apply_yaml(&base(), &route(", retry: {attempts: 2}")).unwrap_err();
        assert!(
            error.contains("spec.retry: retries apply to Backends and InferencePools"),
            "{error}"
        );
        apply_yaml(&base(), &route("")).unwrap();
    }
}
