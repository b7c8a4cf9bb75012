//! McpToolPins on the proxy: each tool a pinned server lists is hashed as
//! [`portcullis_config::tool_digest`] says and compared with its pin. Under `onDrift: Refuse` a
//! tool that is not its pinned self is left out of lists and its calls are refused; under
//! `Report` it is served. Either way what was found goes to metrics, the access log and, as
//! [`Findings`](portcullis_proto::v1::Findings), to the control plane for `portcullis status`.
//!
//! A call is judged on the definition the proxy saw last, from any client's list; when that is
//! older than the pins' `recheckAfter` (or there is none), the server's list is fetched first,
//! in the caller's session. What was seen outlives config versions ([`PinObservations`]), so
//! new pins are judged against it at once.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use http::{Response, StatusCode};
use portcullis_config::{ConfigSet, KindSpec, McpToolPinsSpec, PinEnforcement};
use portcullis_proto::v1::{Findings, ToolDrift};
use serde_json::{json, Value};
use tokio::sync::watch;

use super::jsonrpc;
use super::reach::Downstream;
use super::{Exchange, McpTarget, Problem};
use crate::body::Body;
use crate::telemetry::Telemetry;

/// Refused: the tool is not the one pinned. In the range MCP leaves to implementations.
const PIN_REFUSED: i64 = -32014;

/// An McpBackend (`McpBackend/name`), one of its servers, and that server's URL: a server
/// that moves is another server, judged on its own lists.
pub(crate) type ServerKey = (Arc<str>, Arc<str>, Arc<str>);
/// Tools remembered per server; a server listing more is judged on those it listed first.
const MAX_TOOLS_SEEN: usize = 4096;
/// Findings a proxy reports in all: the control plane keeps no more.
const MAX_FINDINGS: usize = 256;
/// Ids of the proxy's own `tools/list` requests, unique within the proxy.
static PIN_CHECKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The pins covering one server, as a proxy applies them.
pub(super) struct ServerPins {
    /// `McpToolPins/name`.
    object: Arc<str>,
    refuse: bool,
    recheck: Duration,
    /// Own tool name → pinned digest.
    tools: HashMap<String, String>,
}

impl ServerPins {
    /// The one McpToolPins covering `server` of `backend`, if any (apply allows one).
    pub(super) fn compile(config: &ConfigSet, backend: &str, server: &str) -> Option<ServerPins> {
        let (metadata, spec) = config
            .specs::<McpToolPinsSpec>()
            .find(|(_, spec)| spec.applies_to(backend, server))?;
        Some(ServerPins {
            object: Arc::from(format!("{}/{}", McpToolPinsSpec::INFO.name, metadata.name)),
            refuse: spec.on_drift == PinEnforcement::Refuse,
            recheck: spec.recheck_after(),
            tools: spec
                .tools
                .iter()
                .map(|tool| (tool.name.clone(), tool.digest.clone()))
                .collect(),
        })
    }

    /// How `tool`, listed with digest `live` (or not listed), stands against these pins.
    fn state(&self, tool: &str, live: Option<&str>) -> PinState {
        match (self.tools.get(tool), live) {
            (Some(pinned), Some(live)) if pinned == live => PinState::Pinned,
            (Some(pinned), Some(live)) => PinState::Drifted {
                pinned: pinned.clone(),
                live: live.to_string(),
            },
            (Some(pinned), None) => PinState::Absent {
                pinned: pinned.clone(),
            },
            (None, live) => PinState::Unpinned {
                live: live.unwrap_or_default().to_string(),
            },
        }
    }

    /// Whether a listed tool with digest `live` is left out of lists.
    pub(super) fn hides(&self, tool: &str, live: &str) -> bool {
        self.refuse && self.state(tool, Some(live)) != PinState::Pinned
    }
}

#[derive(Debug, PartialEq)]
enum PinState {
    Pinned,
    Drifted { pinned: String, live: String },
    Unpinned { live: String },
    Absent { pinned: String },
}

impl PinState {
    fn label(&self) -> &'static str {
        match self {
            PinState::Pinned => "pinned",
            PinState::Drifted { .. } => "drifted",
            PinState::Unpinned { .. } => "unpinned",
            PinState::Absent { .. } => "absent",
        }
    }
}

/// What a call can go by for one tool.
enum Lookup {
    /// Listed, with this digest, within `recheckAfter`.
    Listed(String),
    /// The server's whole list, seen within `recheckAfter`, lacks it.
    Unlisted,
    /// Not seen recently enough: list first.
    Unknown,
}

/// What the proxy saw of pinned servers' tools, and what it found: proxy-wide, kept across
/// config versions.
pub(crate) struct PinObservations {
    seen: Mutex<Seen>,
    findings: watch::Sender<Findings>,
    telemetry: Arc<Telemetry>,
}

#[derive(Default)]
struct Seen {
    servers: HashMap<ServerKey, ServerSeen>,
    findings: BTreeMap<ServerKey, Vec<ToolDrift>>,
    /// Whose turn it is to list a server for calls that found its tools unknown, and how
    /// the last such list went.
    checks: HashMap<ServerKey, Arc<tokio::sync::Mutex<LastCheck>>>,
}

/// How the last list of a server for a pin check went: when it failed, and why. One that
/// succeeded left its tools in what was seen.
#[derive(Default)]
struct LastCheck {
    failed: Option<(Instant, String)>,
}

#[derive(Default)]
struct ServerSeen {
    /// The server said its tools changed since they were listed: list again before a call.
    stale: bool,
    /// Own tool name → its digest and when it was listed.
    tools: HashMap<String, (String, Instant)>,
    /// When the server's whole list was last read: what it lacked is gone.
    whole: Option<Instant>,
}

impl PinObservations {
    pub(crate) fn new(telemetry: Arc<Telemetry>) -> PinObservations {
        PinObservations {
            seen: Mutex::default(),
            findings: watch::Sender::new(Findings::default()),
            telemetry,
        }
    }

    /// Every drifted, unpinned or absent tool, as it changes.
    pub(crate) fn subscribe(&self) -> watch::Receiver<Findings> {
        self.findings.subscribe()
    }

    fn lock(&self) -> MutexGuard<'_, Seen> {
        // Every update leaves the maps whole; a panicking holder cannot tear them.
        self.seen.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn lookup(&self, key: &ServerKey, tool: &str, max_age: Duration) -> Lookup {
        let seen = self.lock();
        let Some(server) = seen.servers.get(key).filter(|server| !server.stale) else {
            return Lookup::Unknown;
        };
        let fresh = |at: &Instant| at.elapsed() < max_age;
        match server.tools.get(tool) {
            Some((digest, at)) if fresh(at) => Lookup::Listed(digest.clone()),
            _ if server.whole.as_ref().is_some_and(fresh) && !server.tools.contains_key(tool) => {
                Lookup::Unlisted
            }
            _ => Lookup::Unknown,
        }
    }

    /// The turn to list server `key` for calls that found its tools unknown: one list at a
    /// time per server, so calls that arrive together (after a list change, or once what was
    /// seen is older than `recheckAfter`) wait for one list and take its outcome instead of
    /// each asking the server.
    async fn check_turn(&self, key: &ServerKey) -> tokio::sync::OwnedMutexGuard<LastCheck> {
        let turn = self.lock().checks.entry(key.clone()).or_default().clone();
        turn.lock_owned().await
    }

    /// Records tools listed by one server. `whole`: they are its whole list (their names, when
    /// given: the digests came page by page), so a tool not among them is gone.
    fn record(
        &self,
        key: &ServerKey,
        pins: &ServerPins,
        listed: Vec<(String, String)>,
        whole: Option<&[String]>,
        current: impl FnOnce() -> bool,
    ) {
        let now = Instant::now();
        let mut seen = self.lock();
        // A list asked for before the server said its tools changed says nothing of them now.
        // Asked under the lock: a change counted after this is marked stale after this.
        if !current() {
            return;
        }
        let server = seen.servers.entry(key.clone()).or_default();
        server.stale = false;
        for (tool, digest) in listed {
            if server.tools.len() < MAX_TOOLS_SEEN || server.tools.contains_key(&tool) {
                server.tools.insert(tool, (digest, now));
            }
        }
        if let Some(names) = whole {
            server.tools.retain(|tool, _| names.contains(tool));
            server.whole = Some(now);
        }
        self.find(&mut seen, key, Some(pins));
    }

    /// The server's tools changed (`notifications/tools/list_changed`): calls wait for a new
    /// list.
    pub(super) fn stale(&self, key: &ServerKey) {
        if let Some(server) = self.lock().servers.get_mut(key) {
            server.stale = true;
        }
    }

    /// Judges what was seen of `key` against `pins` (a new config version's), or drops it when
    /// no pins cover the server any more.
    fn refresh(&self, key: &ServerKey, pins: Option<&ServerPins>) {
        let mut seen = self.lock();
        if pins.is_none() {
            seen.servers.remove(key);
        }
        self.find(&mut seen, key, pins);
    }

    /// Forgets servers no McpBackend of the config has any more.
    pub(crate) fn retain(&self, servers: &[ServerKey]) {
        let mut seen = self.lock();
        let gone: Vec<ServerKey> = seen
            .servers
            .keys()
            .chain(seen.findings.keys())
            .filter(|key| !servers.contains(key))
            .cloned()
            .collect();
        seen.checks.retain(|key, _| servers.contains(key));
        for key in gone {
            seen.servers.remove(&key);
            self.find(&mut seen, &key, None);
        }
    }

    fn find(&self, seen: &mut Seen, key: &ServerKey, pins: Option<&ServerPins>) {
        let found = match (pins, seen.servers.get(key)) {
            (Some(pins), Some(server)) => findings(key, pins, server),
            _ => Vec::new(),
        };
        let count = |state: &str| found.iter().filter(|drift| drift.state == state).count();
        self.telemetry.tool_drift(
            &key.0,
            &key.1,
            [
                ("drifted", count("drifted")),
                ("unpinned", count("unpinned")),
                ("absent", count("absent")),
            ],
        );
        if found.is_empty() {
            seen.findings.remove(key);
        } else {
            seen.findings.insert(key.clone(), found);
        }
        let found = seen.findings.values().map(Vec::len).sum::<usize>();
        let all = Findings {
            tool_drift: seen
                .findings
                .values()
                .flatten()
                .take(MAX_FINDINGS)
                .cloned()
                .collect(),
            tool_drift_not_shown: u32::try_from(found.saturating_sub(MAX_FINDINGS)).unwrap_or(u32::MAX),
        };
        self.findings.send_if_modified(|current| {
            let changed = *current != all;
            if changed {
                *current = all;
            }
            changed
        });
    }
}

/// The tools of one server that are not their pinned selves, by name.
fn findings(key: &ServerKey, pins: &ServerPins, server: &ServerSeen) -> Vec<ToolDrift> {
    let listed = server
        .tools
        .iter()
        .map(|(tool, (digest, _))| (tool.as_str(), pins.state(tool, Some(digest))));
    let absent = pins
        .tools
        .keys()
        .filter(|_| server.whole.is_some())
        .filter(|tool| !server.tools.contains_key(*tool))
        .map(|tool| (tool.as_str(), pins.state(tool, None)));
    let mut found: Vec<ToolDrift> = listed
        .chain(absent)
        .filter(|(_, state)| *state != PinState::Pinned)
        .map(|(tool, state)| {
            let (pinned_digest, live_digest) = match &state {
                PinState::Drifted { pinned, live } => (pinned.clone(), live.clone()),
                PinState::Unpinned { live } => (String::new(), live.clone()),
                PinState::Absent { pinned } => (pinned.clone(), String::new()),
                PinState::Pinned => (String::new(), String::new()),
            };
            ToolDrift {
                mcp_backend: key
                    .0
                    .split_once('/')
                    .map_or(&*key.0, |(_, name)| name)
                    .to_string(),
                server: key.1.to_string(),
                tool: tool.to_string(),
                pins: pins.object.to_string(),
                state: state.label().to_string(),
                pinned_digest,
                live_digest,
                refused: pins.refuse,
            }
        })
        .collect();
    found.sort_by(|a, b| a.tool.cmp(&b.tool));
    found
}

impl McpTarget {
    pub(super) fn pin_key(&self, index: usize) -> ServerKey {
        let server = &self.servers[index];
        (self.name.clone(), server.name.clone(), server.url.clone())
    }

    /// A unique id for a `tools/list` the proxy sends on its own.
    pub(super) fn pin_check_id() -> String {
        let n = PIN_CHECKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("portcullis-pin-check-{n}")
    }

    /// Judges the pinned servers' tools seen so far against this version's pins; once the
    /// version is in force, so what is reported is what is enforced.
    pub(crate) fn refresh_pins(&self) {
        for (index, pins) in self.pins.iter().enumerate() {
            self.tool_pins.refresh(&self.pin_key(index), pins.as_ref());
        }
    }

    /// Records the tools of a page server `index` listed; see [`PinObservations::record`].
    pub(super) fn saw_tools(
        &self,
        index: usize,
        listed: Vec<(String, String)>,
        whole: Option<&[String]>,
        current: impl FnOnce() -> bool,
    ) {
        if let Some(pins) = &self.pins[index] {
            self.tool_pins
                .record(&self.pin_key(index), pins, listed, whole, current);
        }
    }

    /// `None` when the call of tool `own` of server `index` may go ahead; otherwise the
    /// refusal. Records how the tool stands in the request's MCP record.
    pub(super) async fn hold_to_pins(
        &self,
        exchange: &mut Exchange<'_>,
        downstream: &Downstream,
        id: &Value,
        index: usize,
        own: &str,
    ) -> Option<Response<Body>> {
        let pins = self.pins[index].as_ref()?;
        let key = self.pin_key(index);
        let mut lookup = self.tool_pins.lookup(&key, own, pins.recheck);
        if matches!(lookup, Lookup::Unknown) {
            let asked = Instant::now();
            let mut turn = self.tool_pins.check_turn(&key).await;
            // A list that succeeded while this call waited left what it saw; one that failed
            // would fail again now. A list in a session the server had lost says nothing of
            // this caller's, and one that saw too little (it began before a change) is not
            // relied on: the call lists in its own session then.
            lookup = self.tool_pins.lookup(&key, own, pins.recheck);
            let outcome = match (&lookup, &turn.failed) {
                (Lookup::Listed(_) | Lookup::Unlisted, _) => Ok(()),
                (Lookup::Unknown, Some((at, failure))) if *at >= asked => {
                    Err(Problem::Failed(failure.clone()))
                }
                (Lookup::Unknown, _) => {
                    let outcome = self.list_whole(exchange, downstream, index).await;
                    turn.failed = match &outcome {
                        Err(Problem::Failed(failure)) => Some((Instant::now(), failure.clone())),
                        Ok(()) | Err(Problem::SessionGone) => None,
                    };
                    outcome
                }
            };
            drop(turn);
            match outcome {
                Ok(()) => lookup = self.tool_pins.lookup(&key, own, pins.recheck),
                Err(Problem::SessionGone) => return Some(jsonrpc::session_not_found(id)),
                Err(Problem::Failed(error)) => {
                    let server = &self.servers[index].name;
                    tracing::warn!(target = %self.name, %server, %error, "a pinned tool could not be checked");
                    if !pins.refuse {
                        return None;
                    }
                    return Some(refusal(
                        id,
                        pins,
                        format!(
                            "tool {own} of server {server} could not be checked against its pin: {error}"
                        ),
                        "unchecked",
                    ));
                }
            }
        }
        let state = match lookup {
            Lookup::Listed(live) => pins.state(own, Some(&live)),
            Lookup::Unlisted => pins.state(own, None),
            // The list just read tells nothing of the tool now: the server said its tools
            // changed while it was read (or `recheckAfter` is shorter than a list takes).
            Lookup::Unknown => {
                if !pins.refuse {
                    return None;
                }
                let server = &self.servers[index].name;
                return Some(refusal(
                    id,
                    pins,
                    format!(
                        "tool {own} of server {server} could not be checked against its pin: its tools \
                         changed while they were listed; retry"
                    ),
                    "unchecked",
                ));
            }
        };
        if let Some(record) = &mut exchange.ctx.mcp {
            record.pin = Some(state.label());
        }
        if !pins.refuse || state == PinState::Pinned {
            return None;
        }
        let server = &self.servers[index].name;
        let why = match &state {
            PinState::Drifted { pinned, live } => format!(
                "tool {own} of server {server} changed since it was pinned (pinned {}, now {}): \
                 review the new definition and pin it again",
                short(pinned),
                short(live)
            ),
            PinState::Unpinned { live } if live.is_empty() => format!(
                "tool {own} is not in the tools/list of server {server}, nor pinned: only listed, \
                 pinned tools are called"
            ),
            PinState::Unpinned { .. } => {
                format!("tool {own} of server {server} is not pinned: review it and pin it to use it")
            }
            PinState::Absent { .. } => {
                format!("tool {own} of server {server} is pinned but no longer listed by it")
            }
            PinState::Pinned => return None,
        };
        Some(refusal(id, pins, why, state.label()))
    }
}

fn refusal(id: &Value, pins: &ServerPins, why: String, state: &str) -> Response<Body> {
    jsonrpc::error(
        StatusCode::OK,
        id,
        PIN_REFUSED,
        format!("{}: {why}", pins.object),
        Some(json!({"pins": &*pins.object, "state": state})),
        "mcp_pin_refused",
    )
}

/// A digest cut for a message: enough to tell two apart.
fn short(digest: &str) -> &str {
    digest.get(..19).unwrap_or(digest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pins(refuse: bool) -> ServerPins {
        ServerPins {
            object: Arc::from("McpToolPins/math"),
            refuse,
            recheck: Duration::from_secs(60),
            tools: [
                ("get-sum".to_string(), "sha256:a".to_string()),
                ("echo".to_string(), "sha256:e".to_string()),
            ]
            .into(),
        }
    }

    fn observations() -> PinObservations {
        PinObservations::new(Arc::new(
            Telemetry::new(crate::tests::support::quiet_telemetry()).unwrap(),
        ))
    }

    #[test]
    fn tools_are_judged_against_their_pins_and_findings_follow_what_was_seen() {
        let (observations, pins) = (observations(), pins(true));
        let key: ServerKey = (
            Arc::from("McpBackend/tools"),
            Arc::from("math"),
            Arc::from("http://127.0.0.1:9000/mcp"),
        );
        let findings = observations.subscribe();
        observations.record(
            &key,
            &pins,
            vec![("get-sum".into(), "sha256:a".into())],
            None,
            || true,
        );
        assert!(
            findings.borrow().tool_drift.is_empty(),
            "a tool as pinned is no finding"
        );
        assert!(
            matches!(observations.lookup(&key, "get-sum", pins.recheck), Lookup::Listed(digest) if digest == "sha256:a")
        );
        assert!(matches!(
            observations.lookup(&key, "echo", pins.recheck),
            Lookup::Unknown
        ));

        observations.record(
            &key,
            &pins,
            vec![
                ("get-sum".into(), "sha256:b".into()),
                ("mail".into(), "sha256:m".into()),
            ],
            Some(&["get-sum".to_string(), "mail".to_string()]),
            || true,
        );
        let found: Vec<(String, String, String)> = findings
            .borrow()
            .tool_drift
            .iter()
            .map(|drift| (drift.tool.clone(), drift.state.clone(), drift.mcp_backend.clone()))
            .collect();
        assert_eq!(
            found,
            [
                ("echo".into(), "absent".into(), "tools".into()),
                ("get-sum".into(), "drifted".into(), "tools".into()),
                ("mail".into(), "unpinned".into(), "tools".into())
            ]
        );
        assert!(matches!(
            observations.lookup(&key, "echo", pins.recheck),
            Lookup::Unlisted
        ));
        assert!(
            pins.hides("get-sum", "sha256:b")
                && pins.hides("mail", "sha256:m")
                && !pins.hides("get-sum", "sha256:a")
        );
        assert!(
            !self::pins(false).hides("get-sum", "sha256:b"),
            "Report only reports"
        );

        // New pins, taking the new definition: judged at once on what was seen.
        let mut repinned = self::pins(true);
        repinned.tools.insert("get-sum".into(), "sha256:b".into());
        observations.refresh(&key, Some(&repinned));
        let states: Vec<String> = findings
            .borrow()
            .tool_drift
            .iter()
            .map(|drift| drift.state.clone())
            .collect();
        assert_eq!(states, ["absent", "unpinned"]);
        // Unpinned, then gone from the config: nothing is reported any more.
        observations.retain(&[]);
        assert!(findings.borrow().tool_drift.is_empty());
    }

    #[test]
    fn a_stale_sighting_is_not_relied_on() {
        let (observations, mut pins) = (observations(), pins(true));
        pins.recheck = Duration::from_millis(1);
        let key: ServerKey = (
            Arc::from("McpBackend/tools"),
            Arc::from("math"),
            Arc::from("http://127.0.0.1:9000/mcp"),
        );
        observations.record(
            &key,
            &pins,
            vec![("get-sum".into(), "sha256:a".into())],
            Some(&["get-sum".into()]),
            || true,
        );
        std::thread::sleep(Duration::from_millis(5));
        assert!(matches!(
            observations.lookup(&key, "get-sum", pins.recheck),
            Lookup::Unknown
        ));
        assert!(matches!(
            observations.lookup(&key, "echo", pins.recheck),
            Lookup::Unknown
        ));
    }

    #[test]
    fn a_list_change_sends_calls_back_to_the_list() {
        let (observations, pins) = (observations(), pins(true));
        let key: ServerKey = (
            Arc::from("McpBackend/tools"),
            Arc::from("math"),
            Arc::from("http://127.0.0.1:9000/mcp"),
        );
        observations.record(
            &key,
            &pins,
            vec![("get-sum".into(), "sha256:a".into())],
            Some(&["get-sum".into()]),
            || true,
        );
        observations.stale(&key);
        assert!(matches!(
            observations.lookup(&key, "get-sum", pins.recheck),
            Lookup::Unknown
        ));
        assert!(matches!(
            observations.lookup(&key, "echo", pins.recheck),
            Lookup::Unknown
        ));
        // A list asked for before the change still says nothing of the tools now.
        observations.record(
            &key,
            &pins,
            vec![("get-sum".into(), "sha256:a".into())],
            None,
            || false,
        );
        assert!(matches!(
            observations.lookup(&key, "get-sum", pins.recheck),
            Lookup::Unknown
        ));
        observations.record(
            &key,
            &pins,
            vec![("get-sum".into(), "sha256:a".into())],
            None,
            || true,
        );
        assert!(matches!(
            observations.lookup(&key, "get-sum", pins.recheck),
            Lookup::Listed(_)
        ));
    }
}
