//! Guardrails: checks of the messages a target understands (MCP requests and results, LLM
//! prompts and completions), by an external checking service over gRPC
//! (`proto/portcullis/guardrail/v1/guardrail.proto`, see [`replicas`]) or by the built-in
//! pattern guard (`portcullis_config::guard_patterns`). Both give the same verdicts (allow,
//! deny with a reason, mutate) and fail the same way: when no verdict can be had, the
//! Guardrail's failure mode decides.
//!
//! A guardrail runs where its messages are understood: the McpBackend target checks each
//! server's requests and results, the LLM stage checks prompts. They ask [`GuardrailIndex`]
//! for the [`Guards`] of their phase once per config version; guards whose spec did not change
//! are kept across versions (replica health and breakers survive).

mod replicas;
mod verdict;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderName};
use portcullis_config::guard_patterns::{PatternGuard, PatternVerdict};
use portcullis_config::{ConfigSet, GuardrailFailureMode, GuardrailPhase, GuardrailSpec, KindSpec};
use portcullis_proto::guardrail::v1 as wire;
use serde_json::Value;

use self::replicas::Replicas;
pub(crate) use self::verdict::JsonKind;
use self::verdict::{Decision, Expected};
use super::RequestContext;
use crate::body::MAX_HELD_ANSWER_BYTES;
use crate::telemetry::LogThrottle;

/// How often one guard's failed checks are logged at most: with every replica down, each
/// request fails its check, and under FailOpen nothing else slows them.
const FAILURE_WARN_INTERVAL: Duration = Duration::from_secs(10);

/// One Guardrail object, compiled.
pub(crate) struct Guard {
    name: Arc<str>,
    spec: GuardrailSpec,
    checker: Checker,
    /// The caller's headers its checks carry (`service.callerHeaders`, which apply keeps
    /// free of credentials); none for the built-in guard, which reads no context.
    caller_headers: Vec<HeaderName>,
    failure_warnings: LogThrottle,
}

enum Checker {
    Service(Arc<Replicas>),
    Builtin(PatternGuard),
}

/// The guards of one phase at one place (an McpBackend's server, an InferencePool), in
/// name order; each sees the payload as the previous one left it. Cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct Guards(Arc<[Arc<Guard>]>);

/// Every Guardrail of a config version, by name.
#[derive(Default)]
pub(crate) struct GuardrailIndex {
    by_name: HashMap<String, Arc<Guard>>,
}

impl GuardrailIndex {
    pub(crate) fn compile(config: &ConfigSet, previous: &GuardrailIndex) -> Result<GuardrailIndex, String> {
        let mut by_name = HashMap::new();
        for (metadata, spec) in config.specs::<GuardrailSpec>() {
            let guard = match previous.by_name.get(&metadata.name) {
                Some(kept) if kept.spec == *spec => kept.clone(),
                _ => Arc::new(Guard::compile(&metadata.name, spec)?),
            };
            by_name.insert(metadata.name.clone(), guard);
        }
        Ok(GuardrailIndex { by_name })
    }

    /// The guards of `phase` on `server` of the McpBackend `backend`.
    pub(crate) fn mcp(&self, phase: GuardrailPhase, backend: &str, server: &str) -> Guards {
        self.select(|spec| spec.applies_to_mcp(phase, backend, server))
    }

    /// The guards of `phase` on the InferencePool `pool`.
    pub(crate) fn pool(&self, phase: GuardrailPhase, pool: &str) -> Guards {
        self.select(|spec| spec.applies_to_pool(phase, pool))
    }

    fn select(&self, applies: impl Fn(&GuardrailSpec) -> bool) -> Guards {
        let mut guards: Vec<Arc<Guard>> = self
            .by_name
            .values()
            .filter(|guard| applies(&guard.spec))
            .cloned()
            .collect();
        guards.sort_by(|a, b| a.name.cmp(&b.name));
        Guards(guards.into())
    }
}

impl Guard {
    fn compile(name: &str, spec: &GuardrailSpec) -> Result<Guard, String> {
        let label = format!("{}/{name}", GuardrailSpec::INFO.name);
        let checker = match (&spec.service, &spec.builtin) {
            (Some(service), _) => Checker::Service(
                Replicas::new(service, spec.timeout()).map_err(|error| format!("{label}: {error}"))?,
            ),
            (None, Some(builtin)) => {
                Checker::Builtin(PatternGuard::compile(builtin).map_err(|error| format!("{label}: {error}"))?)
            }
            (None, None) => return Err(format!("{label}: neither service nor builtin")),
        };
        let caller_headers = spec
            .service
            .iter()
            .flat_map(|service| &service.caller_headers)
            .map(|name| {
                HeaderName::from_bytes(name.as_bytes())
                    .map_err(|_| format!("{label}: invalid header name {name:?}"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Guard {
            name: Arc::from(label),
            spec: spec.clone(),
            checker,
            caller_headers,
            failure_warnings: LogThrottle::new(FAILURE_WARN_INTERVAL),
        })
    }
}

/// Who asks, the same for every check of one request.
#[derive(Clone)]
pub(crate) struct Asker {
    request_id: String,
    route: String,
    target: String,
    address: String,
    /// The request's headers, of which each guard's checks carry those it lists.
    headers: Arc<HeaderMap>,
    /// A mutation of a request may not be larger than the route lets a request body be.
    max_request_bytes: u64,
    log: GuardrailLog,
}

impl Asker {
    /// `target` is the `Kind/name` the request goes to.
    pub(crate) fn new(ctx: &RequestContext, target: &str, headers: &HeaderMap) -> Asker {
        Asker {
            request_id: ctx.trace.request_id(),
            route: format!("Route/{}", ctx.route),
            target: target.to_string(),
            address: ctx.client_ip.to_string(),
            headers: Arc::new(headers.clone()),
            max_request_bytes: ctx.max_body_bytes,
            log: ctx.guardrails.clone(),
        }
    }

    fn context(&self, guard: &Guard, server: &str) -> wire::CheckContext {
        wire::CheckContext {
            request_id: self.request_id.clone(),
            guardrail: guard.name.to_string(),
            route: self.route.clone(),
            target: self.target.clone(),
            server: server.to_string(),
            caller: Some(self.caller(guard)),
        }
    }

    /// The caller as `guard` sees it: its address, and the headers the guard lists (the
    /// values of a repeated one joined with ", ").
    fn caller(&self, guard: &Guard) -> wire::Caller {
        let headers = guard
            .caller_headers
            .iter()
            .filter_map(|name| {
                let values: Vec<_> = self
                    .headers
                    .get_all(name)
                    .iter()
                    .map(|value| String::from_utf8_lossy(value.as_bytes()))
                    .collect();
                (!values.is_empty()).then(|| (name.as_str().to_string(), values.join(", ")))
            })
            .collect();
        wire::Caller {
            address: self.address.clone(),
            headers,
        }
    }

    /// The largest mutation `phase` takes: a request's replacement goes upstream, so it has
    /// the route's limit; a result or a completion, held up to its own limit whatever the
    /// route lets a request be, may be replaced by one as large.
    fn max_mutation_bytes(&self, phase: GuardrailPhase) -> u64 {
        match phase {
            GuardrailPhase::McpRequest | GuardrailPhase::LlmRequest | GuardrailPhase::A2aMessage => {
                self.max_request_bytes
            }
            GuardrailPhase::McpResponse | GuardrailPhase::LlmResponse => MAX_HELD_ANSWER_BYTES as u64,
        }
    }
}

/// What is checked, besides the payload.
pub(crate) struct Subject<'a> {
    pub(crate) phase: GuardrailPhase,
    /// The MCP server; empty for LLM traffic.
    pub(crate) server: &'a str,
    /// MCP: the method; LLM: the model.
    pub(crate) method: &'a str,
    /// MCP: the item's own name; empty for LLM traffic.
    pub(crate) name: &'a str,
    /// Whether a replacement can still be applied. When not (a streamed completion already
    /// sent, a resource read without arguments), a mutation counts as a check of that guard
    /// without a verdict, and its failure mode decides.
    pub(crate) mutable: bool,
}

/// One check request, per phase.
pub(crate) enum CheckRequest {
    McpRequest(wire::McpRequestCheck),
    McpResponse(wire::McpResponseCheck),
    LlmRequest(wire::LlmRequestCheck),
    LlmResponse(wire::LlmResponseCheck),
}

/// Every guard of a phase allowed or failed open.
#[derive(Debug)]
pub(crate) struct Passed {
    /// The payload as the last mutation left it.
    pub(crate) payload: Value,
    pub(crate) mutated: bool,
}

/// Why the guards of a phase stopped a message.
#[derive(Debug)]
pub(crate) enum Stop {
    Denied {
        guardrail: Arc<str>,
        reason: String,
    },
    /// A FailClosed guard could not get a verdict (the details are logged, not shown).
    Unavailable {
        guardrail: Arc<str>,
    },
}

/// One decision, for the access log, metrics and the trace.
#[derive(Debug, Clone)]
pub(crate) struct GuardrailRecord {
    pub(crate) guardrail: Arc<str>,
    pub(crate) phase: &'static str,
    /// `allow`, `deny`, `mutate`, `failed_open` or `failed_closed`.
    pub(crate) decision: &'static str,
    /// The replica that answered (or last failed); `builtin` for the built-in guard.
    pub(crate) replica: Option<Arc<str>>,
    pub(crate) latency: Duration,
    pub(crate) attempts: u32,
}

/// The decisions of one request, shared with response bodies that check as they pass.
pub(crate) type GuardrailLog = Arc<Mutex<Vec<GuardrailRecord>>>;

impl Guards {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether any guard checks `phase` of an MCP request with `method` on the item `name`.
    pub(crate) fn select(&self, phase: GuardrailPhase, method: &str, name: &str) -> bool {
        self.0.iter().any(|guard| guard.spec.selects(phase, method, name))
    }

    /// Runs each guard in turn on `payload`.
    pub(crate) async fn check(
        &self,
        asker: &Asker,
        subject: &Subject<'_>,
        mut payload: Value,
    ) -> Result<Passed, Stop> {
        let mut mutated = false;
        for guard in self.applying(subject) {
            let started = Instant::now();
            let (outcome, replica, attempts) = guard.ask(asker, subject, &payload).await;
            let decision = match outcome {
                Ok(Decision::Allow) => "allow",
                Ok(Decision::Mutate(_) | Decision::Oversized { .. }) if !subject.mutable => {
                    let problem = "returned a mutation, which cannot be applied here";
                    guard.failed(asker, subject, problem, replica.clone(), started, attempts)?
                }
                Ok(Decision::Mutate(replacement)) => {
                    payload = replacement;
                    mutated = true;
                    "mutate"
                }
                Ok(Decision::Deny(reason)) => {
                    asker.record(guard, subject, "deny", replica, started, attempts);
                    return Err(Stop::Denied {
                        guardrail: guard.name.clone(),
                        reason,
                    });
                }
                // The checker answered, so the failure mode has no say; it asked for a change
                // that cannot be made, so the message cannot pass as it is either.
                Ok(Decision::Oversized { bytes, limit }) => {
                    asker.record(guard, subject, "deny", replica, started, attempts);
                    return Err(Stop::Denied {
                        guardrail: guard.name.clone(),
                        reason: format!(
                            "the replacement it asked for is {bytes} bytes, over the limit of \
                             {limit}, so neither it nor the original can be passed on"
                        ),
                    });
                }
                Err(problem) => guard.failed(asker, subject, &problem, replica.clone(), started, attempts)?,
            };
            asker.record(guard, subject, decision, replica, started, attempts);
        }
        Ok(Passed { payload, mutated })
    }

    /// The message these guards would check cannot be read (a server's answer that is not
    /// a JSON-RPC response): each guard's failure mode decides, as if its checker had failed.
    pub(crate) fn unreadable(&self, asker: &Asker, subject: &Subject<'_>, problem: &str) -> Result<(), Stop> {
        for guard in self.applying(subject) {
            let decision = guard.failed(asker, subject, problem, None, Instant::now(), 0)?;
            asker.record(guard, subject, decision, None, Instant::now(), 0);
        }
        Ok(())
    }

    fn applying<'a>(&'a self, subject: &'a Subject<'_>) -> impl Iterator<Item = &'a Arc<Guard>> + 'a {
        let mcp = matches!(
            subject.phase,
            GuardrailPhase::McpRequest | GuardrailPhase::McpResponse
        );
        self.0
            .iter()
            .filter(move |guard| !mcp || guard.spec.selects(subject.phase, subject.method, subject.name))
    }
}

impl Asker {
    fn record(
        &self,
        guard: &Guard,
        subject: &Subject<'_>,
        decision: &'static str,
        replica: Option<Arc<str>>,
        started: Instant,
        attempts: u32,
    ) {
        self.log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(GuardrailRecord {
                guardrail: guard.name.clone(),
                phase: subject.phase.as_str(),
                decision,
                replica,
                latency: started.elapsed(),
                attempts,
            });
    }
}

impl Guard {
    /// A check without a verdict: `failed_open`, or the FailClosed stop (recorded).
    fn failed(
        &self,
        asker: &Asker,
        subject: &Subject<'_>,
        problem: &str,
        replica: Option<Arc<str>>,
        started: Instant,
        attempts: u32,
    ) -> Result<&'static str, Stop> {
        if let Some(left_out) = self.failure_warnings.admit() {
            tracing::warn!(
                guardrail = %self.name,
                phase = subject.phase.as_str(),
                %problem,
                same_failures_not_logged = left_out,
                "guardrail check failed"
            );
        }
        match self.spec.failure_mode {
            GuardrailFailureMode::FailOpen => Ok("failed_open"),
            GuardrailFailureMode::FailClosed => {
                asker.record(self, subject, "failed_closed", replica, started, attempts);
                Err(Stop::Unavailable {
                    guardrail: self.name.clone(),
                })
            }
        }
    }

    async fn ask(
        &self,
        asker: &Asker,
        subject: &Subject<'_>,
        payload: &Value,
    ) -> (Result<Decision, String>, Option<Arc<str>>, u32) {
        let Some(kind) = JsonKind::of(payload) else {
            return (
                Err("the payload cannot be checked: not an object, array or string".into()),
                None,
                0,
            );
        };
        let expected = Expected {
            kind,
            max_bytes: asker.max_mutation_bytes(subject.phase),
        };
        match &self.checker {
            Checker::Builtin(patterns) => {
                let size = serde_json::to_vec(payload).map_or(u64::MAX, |encoded| encoded.len() as u64);
                // An MCP item's name or URI is checked too: it is part of what is asked.
                let names: &[&str] = if subject.name.is_empty() {
                    &[]
                } else {
                    &[subject.name]
                };
                let outcome = match patterns.check(names, payload, size) {
                    PatternVerdict::Allow => Ok(Decision::Allow),
                    PatternVerdict::Deny(reason) => Ok(Decision::Deny(reason)),
                    PatternVerdict::Mutate(replacement) => {
                        let bytes =
                            serde_json::to_vec(&replacement).map_or(u64::MAX, |encoded| encoded.len() as u64);
                        Ok(expected.oversized(bytes).unwrap_or(Decision::Mutate(replacement)))
                    }
                    PatternVerdict::TooLarge => {
                        Err(format!("the payload ({size} bytes) is larger than maxBytes"))
                    }
                };
                (outcome, Some(Arc::from("builtin")), 1)
            }
            Checker::Service(replicas) => {
                let Some(request) = self.request(asker, subject, payload) else {
                    let phase = subject.phase.as_str();
                    return (Err(format!("this version does not run {phase} checks")), None, 0);
                };
                let called = replicas.call(&request, &expected).await;
                (called.outcome, called.replica, called.attempts)
            }
        }
    }

    /// `None` for a phase apply refuses (see `GuardrailSpec`), which no stage asks for.
    fn request(&self, asker: &Asker, subject: &Subject<'_>, payload: &Value) -> Option<CheckRequest> {
        let context = Some(asker.context(self, subject.server));
        Some(match subject.phase {
            GuardrailPhase::McpRequest => CheckRequest::McpRequest(wire::McpRequestCheck {
                context,
                method: subject.method.to_string(),
                name: subject.name.to_string(),
                arguments_json: payload.to_string(),
            }),
            GuardrailPhase::McpResponse => CheckRequest::McpResponse(wire::McpResponseCheck {
                context,
                method: subject.method.to_string(),
                name: subject.name.to_string(),
                result_json: payload.to_string(),
            }),
            GuardrailPhase::LlmRequest => CheckRequest::LlmRequest(wire::LlmRequestCheck {
                context,
                model: subject.method.to_string(),
                prompt_json: payload.to_string(),
            }),
            GuardrailPhase::LlmResponse => CheckRequest::LlmResponse(wire::LlmResponseCheck {
                context,
                model: subject.method.to_string(),
                completion: payload.as_str().unwrap_or_default().to_string(),
                streamed: !subject.mutable,
            }),
            GuardrailPhase::A2aMessage => return None,
        })
    }
}

#[cfg(test)]
mod tests;
