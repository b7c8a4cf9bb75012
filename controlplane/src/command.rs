//! What a Raft entry carries and how every node applies it.
//!
//! The leader validates a write against the config it has applied ([`plan_apply`],
//! [`plan_delete`]) and proposes its result: the objects to store as JSON, the keys to
//! remove, and the version it validated against. Applying an entry ([`StoredConfig::apply`])
//! checks only that version and runs no config validation, so its outcome depends on the
//! entry alone: a node running a build with different (stricter or looser) validation
//! replays the log to the same versions and the same stored objects as every other node.
//! What this build makes of the stored JSON is decided afterwards, per node
//! ([`StoredConfig::read`]), and never feeds back into the replicated state.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use openraft::{CommittedLeaderId, EntryPayload, LogId};
use portcullis_config::{
    collect_objects, Change, ConfigError, ConfigSet, FieldError, Kind, Object, ObjectKey,
};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::types::Entry;

/// An object as a client sent it: decoded and checked by this build, stored as the client
/// wrote it. Stored re-encoded, it would carry whatever fields the leader's build writes (a
/// newer build's defaults included), which a node on an older build could not read.
#[derive(Debug, Clone)]
pub struct Submitted {
    pub object: Object,
    pub json: Box<RawValue>,
}

impl Submitted {
    /// `location` names the object in errors when its own kind/name cannot be read.
    pub fn from_json_bytes(bytes: &[u8], location: &str) -> Result<Submitted, ConfigError> {
        let object = Object::from_json_bytes(bytes, location)?;
        // Valid JSON: `from_json_bytes` just parsed it.
        let json = serde_json::from_slice(bytes)
            .map_err(|error| FieldError::new(location, "", format!("not valid JSON: {error}")))?;
        Ok(Submitted { object, json })
    }
}

/// An object's kind and name as text, so that an entry or a stored object stays readable by
/// a build that does not know its kind.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoredKey {
    pub kind: String,
    pub name: String,
}

impl StoredKey {
    /// Parses the `Kind/name` form of [`fmt::Display`].
    pub fn parse(text: &str) -> Option<StoredKey> {
        let (kind, name) = text.split_once('/')?;
        Some(StoredKey {
            kind: kind.to_string(),
            name: name.to_string(),
        })
    }
}

impl StoredKey {
    /// The typed key, if this build knows the kind.
    pub fn object_key(&self) -> Option<ObjectKey> {
        Some(ObjectKey::new(Kind::from_name(&self.kind)?, self.name.clone()))
    }
}

impl From<&ObjectKey> for StoredKey {
    fn from(key: &ObjectKey) -> Self {
        StoredKey {
            kind: key.kind.to_string(),
            name: key.name.clone(),
        }
    }
}

impl fmt::Display for StoredKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.kind, self.name)
    }
}

/// The payload of a normal Raft entry: a write the leader has validated, stated as its result.
/// A field this build does not know fails the entry's decoding loudly: ignoring it could make
/// this node apply the entry differently from a newer one.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Write {
    /// The config version the leader validated against; the write applies only on top of it.
    pub base_version: u64,
    /// Objects created or replaced, as the documented JSON the API speaks.
    pub put: Vec<(StoredKey, Box<RawValue>)>,
    pub delete: Vec<StoredKey>,
    /// What the write does to each object it names, answered to the client.
    pub changes: Vec<ObjectChange>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    FailedPrecondition,
    InvalidArgument,
    NotFound,
}

/// Why a write changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejection {
    pub code: ErrorCode,
    pub message: String,
}

impl Rejection {
    fn invalid(error: ConfigError) -> Self {
        Self {
            code: ErrorCode::InvalidArgument,
            message: error.to_string(),
        }
    }

    /// The config is not at the version a write was made for.
    pub fn version_moved(current: u64, expected: u64) -> Self {
        Self {
            code: ErrorCode::FailedPrecondition,
            message: format!("config is at version {current}, expected {expected}"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectChange {
    pub key: StoredKey,
    /// [`Change::as_str`]: kept as text because `Change` is not serializable.
    pub action: String,
}

/// What a committed write did: the version after it and what happened to each object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    pub version: u64,
    pub changes: Vec<ObjectChange>,
}

/// The Raft response of every entry.
pub type Outcome = Result<Applied, Rejection>;

/// A validated write and the config it leaves, on which the next write of a batch is planned.
#[derive(Debug)]
pub struct Planned {
    pub write: Write,
    pub config: ConfigSet,
}

/// Validates creating or replacing `objects` on `config` (at `version`) and states the result
/// as a [`Write`]. `expected_version` is the client's optimistic-concurrency guard.
pub fn plan_apply(
    config: &ConfigSet,
    version: u64,
    submitted: &[Submitted],
    expected_version: Option<u64>,
) -> Result<Planned, Rejection> {
    check_expected(version, expected_version)?;
    let objects = submitted.iter().map(|s| s.object.clone()).collect();
    let (next, changes) = config.apply(objects).map_err(Rejection::invalid)?;
    let json_of: BTreeMap<ObjectKey, &RawValue> =
        submitted.iter().map(|s| (s.object.key(), &*s.json)).collect();
    // An apply creates or changes only objects it was given.
    let put = changes
        .iter()
        .filter(|(_, change)| matches!(change, Change::Created | Change::Configured))
        .filter_map(|(key, _)| Some((StoredKey::from(key), (*json_of.get(key)?).to_owned())))
        .collect();
    Ok(Planned {
        write: Write {
            base_version: version,
            put,
            delete: Vec::new(),
            changes: object_changes(&changes),
        },
        config: next,
    })
}

/// Validates deleting `keys` from `config` (at `version`): every key must exist and nothing
/// left may reference it.
pub fn plan_delete(
    config: &ConfigSet,
    version: u64,
    keys: &[ObjectKey],
    expected_version: Option<u64>,
) -> Result<Planned, Rejection> {
    check_expected(version, expected_version)?;
    let missing: Vec<String> = keys
        .iter()
        .filter(|key| config.get(key).is_none())
        .map(|key| format!("{key}: not found"))
        .collect();
    if !missing.is_empty() {
        return Err(Rejection {
            code: ErrorCode::NotFound,
            message: missing.join("\n"),
        });
    }
    let (next, changes) = config.delete(keys).map_err(Rejection::invalid)?;
    Ok(Planned {
        write: Write {
            base_version: version,
            put: Vec::new(),
            delete: changes.iter().map(|(key, _)| StoredKey::from(key)).collect(),
            changes: object_changes(&changes),
        },
        config: next,
    })
}

/// An object's JSON as it is stored and replicated.
fn check_expected(version: u64, expected_version: Option<u64>) -> Result<(), Rejection> {
    match expected_version {
        Some(expected) if expected != version => Err(Rejection::version_moved(version, expected)),
        _ => Ok(()),
    }
}

fn object_changes(changes: &[(ObjectKey, Change)]) -> Vec<ObjectChange> {
    changes
        .iter()
        .map(|(key, change)| ObjectChange {
            key: StoredKey::from(key),
            action: change.as_str().to_string(),
        })
        .collect()
}

impl Write {
    /// One entry for writes planned one after another on `base_version`, each on the config
    /// the ones before it leave, naming no object twice: it applies whole or not at all, as
    /// any write does, and leaves the config the last of them planned. Older builds read it
    /// as they read any write.
    pub fn batch(base_version: u64, writes: Vec<Write>) -> Write {
        let mut batch = Write {
            base_version,
            put: Vec::new(),
            delete: Vec::new(),
            changes: Vec::new(),
        };
        for write in writes {
            batch.put.extend(write.put);
            batch.delete.extend(write.delete);
            batch.changes.extend(write.changes);
        }
        batch
    }

    /// What the write answers when it commits on top of `version`.
    pub fn applied(&self, version: u64) -> Applied {
        Applied {
            version,
            changes: self.changes.clone(),
        }
    }

    pub fn changes_something(&self) -> bool {
        !self.put.is_empty() || !self.delete.is_empty()
    }

    /// The bytes of the log entry this write becomes, as the log file and AppendEntries
    /// encode it (JSON), at the widest log id. Counted without copying the write: an entry
    /// wraps the write's JSON in an envelope (log id, payload tag) that does not depend on the
    /// write, so it is an empty write's entry less that write.
    pub fn entry_bytes(&self) -> usize {
        let empty = Write::batch(0, Vec::new());
        let widest = LogId::new(CommittedLeaderId::new(u64::MAX, u64::MAX), u64::MAX);
        let entry = Entry {
            log_id: widest,
            payload: EntryPayload::Normal(empty.clone()),
        };
        let envelope = json_bytes(&entry).saturating_sub(json_bytes(&empty));
        envelope.saturating_add(json_bytes(self))
    }
}

/// The length of `value`'s JSON. These types encode without fail (no map with keys that are
/// not strings, no fallible `Serialize`); were one to fail, the log could not take it either,
/// so it counts as too large for any entry.
fn json_bytes(value: &impl Serialize) -> usize {
    let mut counter = ByteCounter(0);
    match serde_json::to_writer(&mut counter, value) {
        Ok(()) => counter.0,
        Err(_) => usize::MAX,
    }
}

struct ByteCounter(usize);

impl std::io::Write for ByteCounter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0 = self.0.saturating_add(bytes.len());
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The replicated config: every object's JSON as committed, and the version. Identical on
/// every node whatever its build.
#[derive(Debug, Clone, Default)]
pub struct StoredConfig {
    pub version: u64,
    pub objects: BTreeMap<StoredKey, Box<RawValue>>,
}

/// This build's reading of a [`StoredConfig`].
#[derive(Debug, Clone)]
pub enum Reading {
    Readable(Arc<ConfigSet>),
    /// The stored config holds something this build refuses; the reason names it.
    Unreadable(Arc<str>),
}

impl StoredConfig {
    /// Applies a committed write: the one check is the version it was validated against.
    /// Returns the outcome and, when it changed something, the written keys.
    pub fn apply(&mut self, write: &Write) -> Outcome {
        if write.base_version != self.version {
            return Err(Rejection::version_moved(self.version, write.base_version));
        }
        if write.changes_something() {
            for (key, json) in &write.put {
                self.objects.insert(key.clone(), json.clone());
            }
            for key in &write.delete {
                self.objects.remove(key);
            }
            self.version += 1;
        }
        Ok(write.applied(self.version))
    }

    /// Reads every stored object with this build's decoding and validation.
    pub fn read(&self) -> Reading {
        let decoded = collect_objects(
            self.objects
                .iter()
                .map(|(key, json)| Object::from_json_bytes(json.get().as_bytes(), &key.to_string())),
        );
        match decoded.and_then(ConfigSet::from_objects) {
            Ok(config) => Reading::Readable(Arc::new(config)),
            Err(error) => Reading::Unreadable(self.unreadable(&error)),
        }
    }

    /// Reads `write` onto `previous`, this build's reading of the config before it: only the
    /// written objects are decoded, then the whole set is validated as at apply. Falls back
    /// to reading everything when the shortcut cannot decide.
    pub fn read_after(&self, previous: &ConfigSet, write: &Write) -> Reading {
        let deleted: Option<Vec<ObjectKey>> = write.delete.iter().map(StoredKey::object_key).collect();
        let Some(deleted) = deleted else {
            return self.read();
        };
        let decoded = collect_objects(
            write
                .put
                .iter()
                .map(|(key, json)| Object::from_json_bytes(json.get().as_bytes(), &key.to_string())),
        );
        let next = decoded
            .and_then(|objects| previous.apply(objects))
            .and_then(|(next, _)| match deleted.is_empty() {
                true => Ok(next),
                false => next.delete(&deleted).map(|(next, _)| next),
            });
        match next {
            Ok(config) => Reading::Readable(Arc::new(config)),
            Err(_) => self.read(),
        }
    }

    fn unreadable(&self, error: &ConfigError) -> Arc<str> {
        format!(
            "config version {} stored by the cluster is not valid for this build: {error}",
            self.version
        )
        .into()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use serde_json::json;

    use super::*;

    /// Decodes every object as the admin API does.
    pub fn decode_objects(values: &[serde_json::Value]) -> Result<Vec<Object>, ConfigError> {
        collect_objects(
            values
                .iter()
                .enumerate()
                .map(|(index, value)| Object::from_json(value.clone(), &format!("objects[{index}]"))),
        )
    }

    /// `values` as a client would submit them.
    pub fn submit(values: &[serde_json::Value]) -> Result<Vec<Submitted>, ConfigError> {
        collect_objects(values.iter().enumerate().map(|(index, value)| {
            Submitted::from_json_bytes(value.to_string().as_bytes(), &format!("objects[{index}]"))
        }))
    }

    pub fn backend(name: &str, endpoint: &str) -> serde_json::Value {
        json!({"apiVersion": "portcullis.dev/v1alpha1", "kind": "Backend",
            "metadata": {"name": name}, "spec": {"endpoints": [endpoint]}})
    }

    pub fn route(name: &str, listener: &str, backend: &str) -> serde_json::Value {
        json!({"apiVersion": "portcullis.dev/v1alpha1", "kind": "Route", "metadata": {"name": name},
            "spec": {"listeners": [listener], "backends": [{"name": backend}]}})
    }

    /// Plans creating or replacing `objects` on `stored`, as the leader would.
    pub fn put(
        stored: &StoredConfig,
        objects: Vec<serde_json::Value>,
        expected: Option<u64>,
    ) -> Result<Write, Rejection> {
        let Reading::Readable(config) = stored.read() else {
            panic!("stored config unreadable");
        };
        plan_apply(
            &config,
            stored.version,
            &submit(&objects).map_err(Rejection::invalid)?,
            expected,
        )
        .map(|planned| planned.write)
    }

    fn backend_key(name: &str) -> ObjectKey {
        ObjectKey::new(Kind::of::<portcullis_config::BackendSpec>(), name)
    }

    #[test]
    fn entry_bytes_are_those_of_the_encoded_entry() {
        let stored = StoredConfig::default();
        let write = put(
            &stored,
            vec![backend("api", "127.0.0.1:1"), backend("db", "[::1]:2")],
            None,
        )
        .unwrap();
        let encoded = |log_id| {
            let entry = Entry {
                log_id,
                payload: EntryPayload::Normal(write.clone()),
            };
            serde_json::to_vec(&entry).unwrap().len()
        };
        let widest = LogId::new(CommittedLeaderId::new(u64::MAX, u64::MAX), u64::MAX);
        assert_eq!(write.entry_bytes(), encoded(widest));
        assert!(write.entry_bytes() > encoded(LogId::new(CommittedLeaderId::new(3, 1), 42)));
    }

    #[test]
    fn an_unchanged_write_keeps_the_version() {
        let mut stored = StoredConfig::default();
        let first = put(&stored, vec![backend("api", "127.0.0.1:1")], None).unwrap();
        assert_eq!(stored.apply(&first).unwrap().version, 1);
        let again = put(&stored, vec![backend("api", "127.0.0.1:1")], None).unwrap();
        assert!(again.put.is_empty());
        let applied = stored.apply(&again).unwrap();
        assert_eq!(
            (applied.version, applied.changes[0].action.as_str()),
            (1, "unchanged")
        );
    }

    #[test]
    fn objects_are_stored_as_the_client_wrote_them() {
        let sent = route("web", "gw", "api");
        let config = vec![
            json!({"apiVersion": "portcullis.dev/v1alpha1", "kind": "Listener",
                "metadata": {"name": "gw"}, "spec": {"port": 8080}}),
            backend("api", "127.0.0.1:1"),
            sent.clone(),
        ];
        let write = put(&StoredConfig::default(), config.clone(), None).unwrap();
        let stored = |name: &str| -> serde_json::Value {
            let (_, json) = write.put.iter().find(|(key, _)| key.name == name).unwrap();
            serde_json::from_str(json.get()).unwrap()
        };
        assert_eq!(stored("web"), sent);
        // This build's own encoding would have written fields the client left out.
        let encoded = decode_objects(std::slice::from_ref(&sent)).unwrap()[0].to_json();
        assert_ne!(encoded, sent, "the route's encoding should add defaults");
    }

    #[test]
    fn expected_version_mismatch_is_a_failed_precondition() {
        let rejection = plan_apply(&ConfigSet::default(), 7, &[], Some(5)).unwrap_err();
        assert_eq!(rejection.code, ErrorCode::FailedPrecondition);
        assert_eq!(rejection.message, "config is at version 7, expected 5");
    }

    #[test]
    fn a_write_planned_on_an_older_version_does_not_apply() {
        let mut stored = StoredConfig::default();
        let first = put(&stored, vec![backend("api", "127.0.0.1:1")], None).unwrap();
        let raced = put(&stored, vec![backend("db", "127.0.0.1:2")], None).unwrap();
        stored.apply(&first).unwrap();
        let rejection = stored.apply(&raced).unwrap_err();
        assert_eq!(rejection.message, "config is at version 1, expected 0");
        assert_eq!(stored.objects.len(), 1);
    }

    #[test]
    fn invalid_objects_are_refused_when_planned() {
        let stored = StoredConfig::default();
        let rejection = put(
            &stored,
            vec![route("web", "public", "api"), json!({"kind": 3})],
            None,
        )
        .unwrap_err();
        assert_eq!(rejection.code, ErrorCode::InvalidArgument);
        assert!(rejection.message.contains("objects[1]"), "{}", rejection.message);
    }

    #[test]
    fn deleting_a_missing_object_is_not_found() {
        let rejection = plan_delete(&ConfigSet::default(), 0, &[backend_key("ghost")], None).unwrap_err();
        assert_eq!(rejection.code, ErrorCode::NotFound);
        assert_eq!(rejection.message, "Backend/ghost: not found");
    }

    #[test]
    fn reading_after_a_write_matches_reading_everything() {
        let mut stored = StoredConfig::default();
        let write = put(
            &stored,
            vec![backend("api", "127.0.0.1:1"), backend("db", "127.0.0.1:2")],
            None,
        )
        .unwrap();
        stored.apply(&write).unwrap();
        let Reading::Readable(before) = stored.read() else {
            panic!("unreadable")
        };
        let delete = plan_delete(&before, stored.version, &[backend_key("db")], None)
            .unwrap()
            .write;
        stored.apply(&delete).unwrap();
        let (Reading::Readable(after), Reading::Readable(whole)) =
            (stored.read_after(&before, &delete), stored.read())
        else {
            panic!("unreadable");
        };
        assert_eq!(after, whole);
        assert_eq!(whole.len(), 1);
    }

    /// A write another build accepted (here: a field this build does not know) applies the
    /// same here; only this build's reading of the result says it cannot use it.
    #[test]
    fn applying_never_depends_on_this_builds_validation() {
        let mut stored = StoredConfig::default();
        let mut object = backend("api", "127.0.0.1:1");
        object["spec"]["fieldOfALaterBuild"] = json!(true);
        let write = Write {
            base_version: 0,
            put: vec![(
                StoredKey::parse("Backend/api").unwrap(),
                serde_json::value::to_raw_value(&object).unwrap(),
            )],
            delete: Vec::new(),
            changes: vec![ObjectChange {
                key: StoredKey::parse("Backend/api").unwrap(),
                action: "created".into(),
            }],
        };
        assert_eq!(stored.apply(&write).unwrap().version, 1);
        let Reading::Unreadable(reason) = stored.read() else {
            panic!("read an unknown field")
        };
        assert!(
            reason.contains("config version 1") && reason.contains("fieldOfALaterBuild"),
            "{reason}"
        );
    }
}
