//! What a Raft entry asks of the config, and the deterministic rule that answers it. Every
//! node runs [`execute`] on the same inputs in the same order, so all replicas agree.

use portcullis_config::{collect_objects, Change, ConfigError, ConfigSet, Object, ObjectKey};
use serde::{Deserialize, Serialize};

/// The payload of a normal Raft entry. Objects travel as JSON, not as [`Object`], so the
/// entry format is the same documented JSON the API speaks, and decoding stays in the
/// shared config crate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Command {
    Apply {
        objects: Vec<serde_json::Value>,
        expected_version: Option<u64>,
    },
    Delete {
        keys: Vec<ObjectKey>,
        expected_version: Option<u64>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    FailedPrecondition,
    InvalidArgument,
    NotFound,
}

/// Why a command changed nothing.
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
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectChange {
    pub key: ObjectKey,
    /// [`Change::as_str`]: kept as text because `Change` is not serializable.
    pub action: String,
}

/// What a committed command did: the version after it and what happened to each object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    pub version: u64,
    pub changes: Vec<ObjectChange>,
}

/// The Raft response of every entry.
pub type Outcome = Result<Applied, Rejection>;

/// The effect of an accepted command on the config.
#[derive(Debug)]
pub struct Effect {
    pub changes: Vec<(ObjectKey, Change)>,
    /// The new config, or `None` when every object was unchanged.
    pub next: Option<ConfigSet>,
}

impl Effect {
    pub fn applied(&self, version: u64) -> Applied {
        Applied {
            version,
            changes: self
                .changes
                .iter()
                .map(|(key, change)| ObjectChange {
                    key: key.clone(),
                    action: change.as_str().to_string(),
                })
                .collect(),
        }
    }
}

/// Runs `command` against `config` at `version` without modifying either.
pub fn execute(config: &ConfigSet, version: u64, command: &Command) -> Result<Effect, Rejection> {
    let expected = match command {
        Command::Apply { expected_version, .. } | Command::Delete { expected_version, .. } => {
            *expected_version
        }
    };
    if let Some(expected) = expected {
        if expected != version {
            return Err(Rejection {
                code: ErrorCode::FailedPrecondition,
                message: format!("config is at version {version}, expected {expected}"),
            });
        }
    }
    let (next, changes) = match command {
        Command::Apply { objects, .. } => {
            let objects = decode_objects(objects).map_err(Rejection::invalid)?;
            config.apply(objects).map_err(Rejection::invalid)?
        }
        Command::Delete { keys, .. } => {
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
            config.delete(keys).map_err(Rejection::invalid)?
        }
    };
    let changed = changes.iter().any(|(_, change)| *change != Change::Unchanged);
    Ok(Effect {
        changes,
        next: changed.then_some(next),
    })
}

/// Decodes every object, reporting the problems of all of them rather than the first.
pub fn decode_objects(values: &[serde_json::Value]) -> Result<Vec<Object>, ConfigError> {
    collect_objects(
        values
            .iter()
            .enumerate()
            .map(|(index, value)| Object::from_json(value.clone(), &format!("objects[{index}]"))),
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use portcullis_config::Kind;
    use serde_json::json;

    use super::*;

    pub fn backend(name: &str, endpoint: &str) -> serde_json::Value {
        json!({"apiVersion": "portcullis.dev/v1alpha1", "kind": "Backend",
            "metadata": {"name": name}, "spec": {"endpoints": [endpoint]}})
    }

    pub fn route(name: &str, listener: &str, backend: &str) -> serde_json::Value {
        json!({"apiVersion": "portcullis.dev/v1alpha1", "kind": "Route", "metadata": {"name": name},
            "spec": {"listeners": [listener], "backends": [{"name": backend}]}})
    }

    pub fn apply(objects: Vec<serde_json::Value>, expected_version: Option<u64>) -> Command {
        Command::Apply {
            objects,
            expected_version,
        }
    }

    #[test]
    fn unchanged_write_has_no_next_config() {
        let first = execute(
            &ConfigSet::default(),
            0,
            &apply(vec![backend("api", "127.0.0.1:1")], None),
        )
        .unwrap();
        let config = first.next.unwrap();
        let again = execute(&config, 1, &apply(vec![backend("api", "127.0.0.1:1")], None)).unwrap();
        assert!(again.next.is_none());
        assert_eq!(again.applied(1).changes[0].action, "unchanged");
    }

    #[test]
    fn expected_version_mismatch_is_a_failed_precondition() {
        let rejection = execute(&ConfigSet::default(), 7, &apply(vec![], Some(5))).unwrap_err();
        assert_eq!(rejection.code, ErrorCode::FailedPrecondition);
        assert_eq!(rejection.message, "config is at version 7, expected 5");
    }

    #[test]
    fn invalid_objects_carry_the_config_error_text() {
        let rejection = execute(
            &ConfigSet::default(),
            0,
            &apply(vec![route("web", "public", "api"), json!({"kind": 3})], None),
        )
        .unwrap_err();
        assert_eq!(rejection.code, ErrorCode::InvalidArgument);
        assert!(rejection.message.contains("objects[1]"), "{}", rejection.message);
    }

    #[test]
    fn deleting_a_missing_object_is_not_found() {
        let command = Command::Delete {
            keys: vec![ObjectKey::new(
                Kind::of::<portcullis_config::BackendSpec>(),
                "ghost",
            )],
            expected_version: None,
        };
        let rejection = execute(&ConfigSet::default(), 0, &command).unwrap_err();
        assert_eq!(rejection.code, ErrorCode::NotFound);
        assert_eq!(rejection.message, "Backend/ghost: not found");
    }
}
