use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The longest duration any field takes: beyond it a timer deadline could overflow, and
/// no timeout or interval of a gateway needs more.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 60 * 60);

/// A duration written as text (`500ms`, `30s`, `1m 30s`), at most [`MAX_DURATION`],
/// parsed when the object is decoded so a typo is reported with its field path.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    pub const fn secs(secs: u64) -> HumanDuration {
        HumanDuration(Duration::from_secs(secs))
    }
}

impl fmt::Debug for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&humantime::format_duration(self.0).to_string())
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<HumanDuration, D::Error> {
        let text = String::deserialize(deserializer)?;
        let duration = humantime::parse_duration(&text)
            .map_err(|error| serde::de::Error::custom(format!("invalid duration {text:?}: {error}")))?;
        if duration > MAX_DURATION {
            return Err(serde::de::Error::custom(format!(
                "duration {text:?} is longer than 24h"
            )));
        }
        Ok(HumanDuration(duration))
    }
}
