use std::fmt;

/// One problem, located as precisely as we can: which object, which field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// `Kind/name`, or `document N` when the object could not even be identified.
    pub object: String,
    /// Dotted path inside the object, e.g. `spec.backends[0].name`; empty for the whole object.
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(object: impl Into<String>, field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            object: object.into(),
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}: {}", self.object, self.message)
        } else {
            write!(f, "{}: {}: {}", self.object, self.field, self.message)
        }
    }
}

/// Why a config (or a change to it) was rejected. Carries every problem found, not just the first.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    pub errors: Vec<FieldError>,
}

impl ConfigError {
    pub fn single(error: FieldError) -> Self {
        Self { errors: vec![error] }
    }
}

impl From<FieldError> for ConfigError {
    fn from(error: FieldError) -> Self {
        Self::single(error)
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.errors.as_slice() {
            [] => write!(f, "invalid config"),
            [one] => write!(f, "{one}"),
            many => {
                write!(f, "{} problems:", many.len())?;
                for error in many {
                    write!(f, "\n  - {error}")?;
                }
                Ok(())
            }
        }
    }
}

/// Collects field errors while validating one object.
pub struct Checker<'a> {
    object: &'a str,
    pub(crate) errors: Vec<FieldError>,
}

impl<'a> Checker<'a> {
    pub(crate) fn new(object: &'a str) -> Self {
        Self {
            object,
            errors: Vec::new(),
        }
    }

    pub fn fail(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.errors.push(FieldError::new(self.object, field, message));
    }
}
