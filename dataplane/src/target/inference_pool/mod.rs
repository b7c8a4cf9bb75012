//! The InferencePool: model servers behind the endpoint picker (`portcullis-picker`). Each
//! request's pod comes from the picker; its fallbacks are tried, in order, when a pod refuses
//! the connection. The picker is credited when a request starts and released when its
//! response ends, so its in-flight counts are this proxy's real load on each pod.
//!
//! A pool with priority classes admits requests first (`admission.rs`): while every pod is
//! saturated, sheddable requests are refused with 429 and the others wait in the proxy, to be
//! picked highest class first and tenants in turn as requests finish or signals show room.

mod admission;
mod picker_config;
mod sharing;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::Authority;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::{Body as HttpBody, Frame, SizeHint};
use portcullis_config::{EjectionSpec, InferencePoolSpec, PrioritySpec};
use portcullis_picker::{
    block_hashes, LoraSignals, Pick, PickRequest, Picker, PrefixConfig, Refusal, Signals, Strategy,
};
use tokio::sync::oneshot;

use admission::Queue;
use picker_config::picker_config;
use portcullis_proto::v1::{Placement, PodSignals};
use sharing::Sharing;

use super::{ResponseFuture, Target};
use crate::body::{self, Body, BoxError};
use crate::llm;
use crate::policy::RequestContext;
use crate::route::Route;
use crate::upstream::{Dispatch, Endpoint, Upstream};

pub(crate) struct InferencePoolTarget {
    name: Arc<str>,
    /// The spec it was compiled from: an unchanged pool keeps its picker (and what the
    /// picker learned) and its admission queue across config versions.
    spec: InferencePoolSpec,
    /// Endpoint index by its address as written in the spec (how signals name pods).
    by_address: HashMap<String, usize>,
    /// Signals older than this are not handed to the picker.
    staleness: Duration,
    ejection: EjectionSpec,
    /// How the picker cuts prompts, hashed before taking the picker's lock; `None` for the
    /// plain strategies, which do not look at prompts.
    prefix: Option<PrefixConfig>,
    pool: Arc<PoolState>,
}

/// What requests in flight share with the target: their credits give counts back and let
/// the next waiting request in.
struct PoolState {
    endpoints: Vec<Endpoint>,
    picker: Mutex<Picker>,
    /// The picker counts time from here.
    epoch: Instant,
    admission: Option<Admission>,
    /// Where picks are posted for the other proxies; `None` for the plain strategies.
    sharing: Option<Sharing>,
    /// The waiting room: this pool's own (with `admission`), or one inherited from the
    /// pool's previous version that had priority classes, to empty once this version is live.
    room: Option<Arc<WaitingRoom>>,
    /// Where this version's picker was copied to. Lock order: the picker, then this.
    handover: Mutex<Handover>,
}

/// The pool's next version copied this one's picker (in-flight counts included), so a
/// request in flight at the time must give its count back there too when it ends.
#[derive(Default)]
struct Handover {
    /// Copies taken so far: a credit issued before the latest is counted by `next`.
    count: u64,
    next: Weak<PoolState>,
    /// Each endpoint's index in `next`, if it has the endpoint.
    endpoints: Vec<Option<usize>>,
}

/// The requests of one pool waiting for a pod. It outlives config versions: a changed pool
/// spec compiles a new picker, and the newest version that goes live takes the room over
/// ([`PoolState::claim`]), so no waiting request is stranded with a retired picker. Lock
/// order: `queue`, then a picker.
#[derive(Default)]
struct WaitingRoom {
    queue: Mutex<Queue<Waiter>>,
    /// The pool version whose picker lets waiting requests in.
    dispatcher: Mutex<Weak<PoolState>>,
    /// The room's timer runs ([`WaitingRoom::keep_checking`]).
    ticking: AtomicBool,
}

/// A pool's priority classes and how long and how many requests may wait.
struct Admission {
    classes: HashMap<String, i32>,
    default: (Arc<str>, i32),
    header: HeaderName,
    tenant_header: HeaderName,
    max_queued: usize,
    max_wait: Duration,
    /// Whole seconds, rounded up.
    retry_after: HeaderValue,
    /// How often the room looks for room itself while requests wait, should neither a
    /// finished request nor a new signal let them in (the picker's staleness: by then what
    /// it knew has changed).
    recheck: Duration,
}

/// A request waiting for a pod: what the picker needs, and where to send its pick.
struct Waiter {
    model: Arc<str>,
    lora: bool,
    prompt_hashes: Vec<u64>,
    reply: oneshot::Sender<Admitted>,
}

enum Admitted {
    /// Picked (and credited) for the waiting request, or refused by the picker.
    Picked(Result<(Pick, Credit), Refusal>),
    /// A request of a higher class took its place in a full queue.
    Displaced,
}

/// A request's class and tenant, as admission sees them.
struct Class {
    name: Arc<str>,
    value: i32,
    tenant: Arc<str>,
}

impl InferencePoolTarget {
    /// `previous`: the pool's target in the version before, whose waiting room this one
    /// takes over and whose picker's knowledge of the endpoints kept this one's starts from.
    pub(crate) fn compile(
        name: &str,
        spec: &InferencePoolSpec,
        upstream: &Upstream,
        previous: Option<&InferencePoolTarget>,
    ) -> Result<InferencePoolTarget, String> {
        let label = format!("InferencePool/{name}");
        let endpoints = super::endpoints(&label, &spec.endpoints, upstream)?;
        let config = picker_config(spec);
        let prefix = (config.strategy == Strategy::Scored).then_some(config.prefix);
        let staleness = config.staleness;
        let picker = Picker::new(config, endpoints.len());
        let admission = match &spec.priority {
            Some(priority) => Some(Admission::compile(priority, staleness)?),
            None => None,
        };
        let inherited = previous.and_then(|previous| previous.pool.room.clone());
        let room = match (&admission, inherited) {
            (_, Some(room)) => Some(room),
            (Some(_), None) => Some(Arc::default()),
            (None, None) => None,
        };
        // Signals up to `staleness` old are placed after the epoch; what the previous
        // version's picker knows, too.
        let epoch = Instant::now().checked_sub(staleness).unwrap_or_else(Instant::now);
        let epoch = previous.map_or(epoch, |previous| previous.pool.epoch.min(epoch));
        let sharing = prefix.map(|prefix| {
            Sharing::new(
                upstream.placements.clone(),
                name,
                &spec.endpoints,
                prefix.max_blocks,
            )
        });
        let pool = Arc::new(PoolState {
            endpoints,
            picker: Mutex::new(picker),
            epoch,
            admission,
            sharing,
            room,
            handover: Mutex::default(),
        });
        if let Some(previous) = previous {
            let kept: Vec<Option<usize>> = spec
                .endpoints
                .iter()
                .map(|address| previous.by_address.get(address).copied())
                .collect();
            previous.pool.hand_over(&pool, kept);
        }
        Ok(InferencePoolTarget {
            name: Arc::from(label),
            spec: spec.clone(),
            by_address: spec
                .endpoints
                .iter()
                .enumerate()
                .map(|(index, address)| (address.clone(), index))
                .collect(),
            staleness,
            ejection: EjectionSpec::default(),
            prefix,
            pool,
        })
    }

    pub(crate) fn spec(&self) -> &InferencePoolSpec {
        &self.spec
    }

    /// Hands one scrape round to the picker, all under one lock. The age the control plane
    /// measured when it sent the round places the sample on this proxy's clock (transit
    /// time aside), so the proxy needs no clock agreement with the control plane.
    pub(crate) fn observe(&self, pods: &[PodSignals]) {
        self.observe_round(pods);
        // Signals go to live pools only: a good moment to take the waiting room over. The
        // round may show room for waiting requests.
        self.pool.claim();
        self.pool.dispatch(false);
    }

    fn observe_round(&self, pods: &[PodSignals]) {
        let now = self.pool.epoch.elapsed();
        let mut picker = self.pool.picker();
        for pod in pods {
            let age = Duration::from_millis(u64::from(pod.age_ms));
            // Already stale: nothing the picker would use. (The epoch lies `staleness` back,
            // so `now - age` below never clamps.)
            if age > self.staleness {
                continue;
            }
            let Some(&index) = self.by_address.get(&pod.endpoint) else {
                continue;
            };
            picker.observe(
                index,
                Signals {
                    sampled_at: now.saturating_sub(age),
                    waiting: pod.waiting,
                    kv_cache_usage: pod.kv_cache_usage,
                    lora: pod.lora.as_ref().map(|lora| LoraSignals {
                        running: lora.running.clone(),
                        waiting: lora.waiting.clone(),
                        max_loras: lora.max_loras,
                    }),
                },
            );
        }
    }

    /// Other proxies sent prompts to this pool's endpoints: the picker learns them, under
    /// one lock. Placements naming an endpoint the pool does not have are skipped.
    pub(crate) fn learn(&self, placements: &[&Placement]) {
        if let Some(sharing) = &self.pool.sharing {
            sharing.learn(&mut self.pool.picker(), &self.by_address, placements);
        }
    }

    /// What the picker holds per endpoint, for the admin port's `/signals`.
    pub(crate) fn report(&self) -> serde_json::Value {
        let queued = self.pool.room.as_ref().map(|room| room.queue().len());
        let now = self.pool.epoch.elapsed();
        let picker = self.pool.picker();
        let endpoints: serde_json::Map<String, serde_json::Value> = self
            .spec
            .endpoints
            .iter()
            .enumerate()
            .map(|(index, address)| {
                let signals = picker.signals(index).map(|signals| {
                    let age = now.saturating_sub(signals.sampled_at);
                    serde_json::json!({
                        "ageMs": age.as_secs_f64() * 1000.0,
                        "fresh": age <= self.staleness,
                        "waiting": signals.waiting,
                        "kvCacheUsage": signals.kv_cache_usage,
                        "lora": signals.lora.as_ref().map(|lora| serde_json::json!({
                            "running": lora.running,
                            "waiting": lora.waiting,
                            "maxLoras": lora.max_loras,
                        })),
                    })
                });
                let entry = serde_json::json!({
                    "inFlight": picker.in_flight(index),
                    "signals": signals,
                });
                (address.clone(), entry)
            })
            .collect();
        let placements = self.pool.sharing.as_ref().map(Sharing::report);
        serde_json::json!({ "endpoints": endpoints, "queued": queued, "placements": placements })
    }

    /// The request's priority class (the route's, else the header's, else the default) and
    /// tenant; an unknown class or an unreadable tenant is the client's error (code, message).
    fn classify(
        &self,
        headers: &HeaderMap,
        route_class: Option<&Arc<str>>,
    ) -> Result<Option<Class>, (&'static str, String)> {
        let Some(admission) = &self.pool.admission else {
            return Ok(None);
        };
        let (name, value) = match route_class {
            Some(name) => {
                // Validation keeps a route's class among its pool's; a stale pairing in
                // flight across a config change falls back to the default.
                let value = admission.classes.get(name.as_ref()).copied();
                value.map_or_else(|| admission.default.clone(), |value| (name.clone(), value))
            }
            None => match headers.get(&admission.header) {
                None => admission.default.clone(),
                Some(raw) => {
                    let text = raw.to_str().unwrap_or_default();
                    match admission.classes.get_key_value(text) {
                        Some((name, &value)) => (Arc::from(name.as_str()), value),
                        None => {
                            let mut known: Vec<&str> = admission.classes.keys().map(String::as_str).collect();
                            known.sort_unstable();
                            return Err((
                                "unknown_priority_class",
                                format!(
                                    "{}: {} names no priority class of this pool (classes: {})",
                                    self.name,
                                    admission.header,
                                    known.join(", ")
                                ),
                            ));
                        }
                    }
                }
            },
        };
        let tenant = match headers.get(&admission.tenant_header) {
            None => Arc::from(""),
            Some(raw) => match raw.to_str() {
                Ok(tenant) if tenant.len() <= 256 => Arc::from(tenant),
                _ => {
                    return Err((
                        "invalid_tenant",
                        format!(
                            "{}: {} must be visible ASCII, at most 256 bytes",
                            self.name, admission.tenant_header
                        ),
                    ))
                }
            },
        };
        Ok(Some(Class { name, value, tenant }))
    }

    /// Picks now, or, while every pod is saturated, refuses a sheddable request and queues
    /// the others until they are picked or have waited too long.
    async fn admit(
        &self,
        ctx: &mut RequestContext,
        class: Option<Class>,
        request: PickRequest<'_>,
    ) -> Result<(Pick, Credit), Response<Body>> {
        let pool = &self.pool;
        let refused = |refusal: Refusal| {
            let code = match refusal {
                Refusal::NoEndpoint => "no_endpoint",
                Refusal::SignalsUnavailable => "signals_unavailable",
            };
            llm::error(
                StatusCode::SERVICE_UNAVAILABLE,
                code,
                format!("{}: {refusal}", self.name),
            )
        };
        let (Some(admission), Some(room), Some(class)) = (&pool.admission, &pool.room, class) else {
            return pool.pick(&mut pool.picker(), &request).map_err(refused);
        };
        let (id, mut reply) = {
            let mut queue = room.queue();
            let mut picker = pool.picker();
            let now = pool.epoch.elapsed();
            // Waiting requests go first: a newcomer does not overtake them.
            if queue.is_empty() && !picker.saturated(now, |index| pool.healthy(index)) {
                return pool.pick(&mut picker, &request).map_err(refused);
            }
            drop(picker);
            if class.value < 0 {
                ctx.decide(&self.name, "shed");
                return Err(self.too_many(
                    admission,
                    "pool_saturated",
                    format!(
                        "{}: every pod is saturated and priority class {:?} is sheddable; retry later",
                        self.name, class.name
                    ),
                ));
            }
            let mut displaced = None;
            if queue.len() >= admission.max_queued {
                displaced = queue.displace_below(class.value);
                if displaced.is_none() {
                    ctx.decide(&self.name, "shed");
                    return Err(self.too_many(
                        admission,
                        "queue_full",
                        format!(
                            "{}: every pod is saturated and {} requests of priority class {:?} or higher are already waiting",
                            self.name, admission.max_queued, class.name
                        ),
                    ));
                }
            }
            let (reply, waiting) = oneshot::channel();
            let id = queue.push(
                class.value,
                class.tenant,
                Waiter {
                    model: Arc::from(request.model),
                    lora: request.lora,
                    prompt_hashes: request.prompt_hashes.to_vec(),
                    reply,
                },
            );
            drop(queue);
            if let Some(displaced) = displaced {
                let _ = displaced.reply.send(Admitted::Displaced);
            }
            (id, waiting)
        };
        // A client that leaves while waiting takes its place in the queue with it.
        let _leave = Leave { room, id };
        // Someone waits: this (live) version must be the one letting requests in. Signals
        // also claim, so a version that only forwards straight through never needs to.
        pool.claim();
        ctx.decide(&self.name, "queued");
        room.keep_checking(admission.recheck);
        // Room may have opened between the check and the push.
        room.dispatch(false);
        let admitted = match tokio::time::timeout(admission.max_wait, &mut reply).await {
            Ok(admitted) => admitted.ok(),
            Err(_) => {
                if room.queue().remove(id).is_some() {
                    None
                } else {
                    // Taken out of the queue just as the wait ran out: its pick is on the way
                    // (the dispatcher sends right after releasing the locks).
                    (&mut reply).await.ok()
                }
            }
        };
        match admitted {
            Some(Admitted::Picked(result)) => result.map_err(refused),
            Some(Admitted::Displaced) => {
                ctx.decide(&self.name, "shed");
                Err(self.too_many(
                    admission,
                    "queue_full",
                    format!(
                        "{}: every pod is saturated and a request of a higher priority class took this one's place",
                        self.name
                    ),
                ))
            }
            None => {
                ctx.decide(&self.name, "shed");
                Err(self.too_many(
                    admission,
                    "queue_timeout",
                    format!(
                        "{}: every pod stayed saturated for {:?}, the longest a request waits",
                        self.name, admission.max_wait
                    ),
                ))
            }
        }
    }

    /// 429 with `Retry-After` (RFC 6585 §4, RFC 9110 §10.2.3).
    fn too_many(&self, admission: &Admission, code: &'static str, message: String) -> Response<Body> {
        let mut answer = llm::error(StatusCode::TOO_MANY_REQUESTS, code, message);
        answer
            .headers_mut()
            .insert(http::header::RETRY_AFTER, admission.retry_after.clone());
        answer
    }
}

/// Takes a waiting request out of the queue when its future ends, however it ends (a no-op
/// once it has been picked or displaced).
struct Leave<'a> {
    room: &'a WaitingRoom,
    id: u64,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        // A waiter still in the queue was never picked: no credit goes with it.
        drop(self.room.queue().remove(self.id));
    }
}

impl Admission {
    fn compile(spec: &PrioritySpec, staleness: Duration) -> Result<Admission, String> {
        let header = |name: &str| {
            HeaderName::from_bytes(name.as_bytes()).map_err(|_| format!("invalid header name {name:?}"))
        };
        let default = spec
            .class(&spec.default)
            .ok_or_else(|| format!("the default priority class {:?} is not defined", spec.default))?;
        let retry_after = spec.retry_after().as_secs_f64().ceil().max(1.0) as u64;
        Ok(Admission {
            classes: spec
                .classes
                .iter()
                .map(|class| (class.name.clone(), class.value))
                .collect(),
            default: (Arc::from(default.name.as_str()), default.value),
            header: header(spec.header())?,
            tenant_header: header(spec.tenant_header())?,
            max_queued: spec.max_queued() as usize,
            max_wait: spec.max_wait(),
            retry_after: HeaderValue::from(retry_after),
            recheck: staleness,
        })
    }
}

impl WaitingRoom {
    fn queue(&self) -> MutexGuard<'_, Queue<Waiter>> {
        // Every queue operation completes under the lock, so a panicked holder left it whole.
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn dispatcher(&self) -> MutexGuard<'_, Weak<PoolState>> {
        self.dispatcher.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Lets waiting requests in while the pool has room; `freed` lets one in regardless (a
    /// request of this proxy's just finished, so its seat is free even if the last signal
    /// does not show it yet). The room's current dispatcher picks, whichever version's
    /// request finished.
    fn dispatch(&self, freed: bool) {
        let Some(dispatcher) = self.dispatcher().upgrade() else {
            return;
        };
        dispatcher.let_in(self, freed, false);
    }

    /// Starts the room's timer unless it runs: one per room, not one per waiting request,
    /// looking for room every `every` until nobody waits. It covers what no event would: the
    /// signals stopping (the picker then judges on its own counts) while none of this
    /// proxy's requests to the pool is in flight.
    fn keep_checking(self: &Arc<Self>, every: Duration) {
        if self.ticking.swap(true, Ordering::AcqRel) {
            return;
        }
        let room = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(room) = room.upgrade() else { return };
                room.dispatch(false);
                if room.queue().is_empty() {
                    room.ticking.store(false, Ordering::Release);
                    // A request queued since the check either saw the timer still running
                    // (then this one carries on) or started a new one (then this one stops).
                    if room.queue().is_empty() || room.ticking.swap(true, Ordering::AcqRel) {
                        return;
                    }
                }
            }
        });
    }
}

impl PoolState {
    fn picker(&self) -> MutexGuard<'_, Picker> {
        // The picker's state stays consistent even if a holder panicked: every update is a
        // counter or an index insert completed under the lock.
        self.picker.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn healthy(&self, index: usize) -> bool {
        !self.endpoints[index].health.is_ejected()
    }

    /// Picks for `request` and credits the pick.
    fn pick(
        self: &Arc<Self>,
        picker: &mut Picker,
        request: &PickRequest<'_>,
    ) -> Result<(Pick, Credit), Refusal> {
        let pick = picker.pick(self.epoch.elapsed(), request, |index| self.healthy(index))?;
        if let Some(sharing) = &self.sharing {
            if pick.placed_new_blocks(request.prompt_hashes) {
                sharing.post(pick.endpoints[0], request.prompt_hashes, false);
            }
        }
        let credit = Credit {
            pool: self.clone(),
            endpoint: pick.endpoints[0],
            issued: self.handover().count,
        };
        Ok((pick, credit))
    }

    fn handover(&self) -> MutexGuard<'_, Handover> {
        // Updated whole under the lock, so a panicked holder left it consistent.
        self.handover.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Copies this version's picker into `next`'s, for the endpoints `next` kept
    /// (`kept[e]`: `next`'s endpoint `e` here), and remembers where the copy went.
    fn hand_over(&self, next: &Arc<PoolState>, kept: Vec<Option<usize>>) {
        let picker = self.picker();
        // `next`'s epoch is never later than this one's.
        let offset = self.epoch.saturating_duration_since(next.epoch);
        next.picker().inherit(&picker, &kept, offset);
        let mut endpoints = vec![None; self.endpoints.len()];
        for (there, here) in kept.into_iter().enumerate() {
            if let Some(slot) = here.and_then(|here| endpoints.get_mut(here)) {
                *slot = Some(there);
            }
        }
        let mut handover = self.handover();
        handover.count += 1;
        handover.next = Arc::downgrade(next);
        handover.endpoints = endpoints;
    }

    /// The version that copied a count of `endpoint`, and the endpoint's index there, if
    /// the count was here when the copy was taken: `issued` is the credit's (0 for a count
    /// this version copied itself). Called under this version's picker lock, under which
    /// the copy is taken.
    fn successor(&self, endpoint: usize, issued: u64) -> Option<(Arc<PoolState>, usize)> {
        let handover = self.handover();
        if issued >= handover.count {
            return None;
        }
        let there = handover.endpoints.get(endpoint).copied().flatten()?;
        Some((handover.next.upgrade()?, there))
    }

    /// A request counted at `endpoint` ended: the count is given back here and in every
    /// later version that copied it.
    fn finished(self: &Arc<Self>, endpoint: usize, issued: u64) {
        let (mut pool, mut endpoint, mut issued) = (self.clone(), endpoint, issued);
        loop {
            let next = {
                // The copy is taken under the picker lock: read where it went under the same
                // lock as the count given back, or a copy taken in between would lose it twice.
                let mut picker = pool.picker();
                picker.finished(endpoint);
                pool.successor(endpoint, issued)
            };
            let Some((next, there)) = next else { return };
            (pool, endpoint, issued) = (next, there, 0);
        }
    }

    /// The request counted at `from` went to `to` instead: moved here and in every later
    /// version that copied its count. A version that has `to` but not `from` never counted
    /// it: it is counted at `to` there, since its end is given back there.
    fn moved(self: &Arc<Self>, from: usize, to: usize, prompt_hashes: &[u64], issued: u64) {
        let (mut pool, mut from, mut to, mut issued) = (self.clone(), from, to, issued);
        loop {
            let (next_from, next_to) = {
                let mut picker = pool.picker();
                picker.moved(from, to, pool.epoch.elapsed(), prompt_hashes);
                (pool.successor(from, issued), pool.successor(to, issued))
            };
            match (next_from, next_to) {
                (Some((next, from_there)), Some((_, to_there))) => {
                    (pool, from, to, issued) = (next, from_there, to_there, 0);
                }
                // Counted there at an endpoint the request no longer holds here.
                (Some((next, from_there)), None) => return next.finished(from_there, 0),
                (None, Some((next, to_there))) => return next.counted(to_there),
                (None, None) => return,
            }
        }
    }

    /// A request runs at `endpoint` that this version and the later ones that copied its
    /// counts never counted: counted in each, as its end will be given back in each.
    fn counted(self: &Arc<Self>, endpoint: usize) {
        let (mut pool, mut endpoint) = (self.clone(), endpoint);
        loop {
            let next = {
                let mut picker = pool.picker();
                picker.counted(endpoint, pool.epoch.elapsed());
                pool.successor(endpoint, 0)
            };
            let Some((next, there)) = next else { return };
            (pool, endpoint) = (next, there);
        }
    }

    /// Makes this version the one that lets the room's waiting requests in. A version
    /// without priority classes lets them all in at once: nothing holds requests any more.
    fn claim(self: &Arc<Self>) {
        let Some(room) = &self.room else { return };
        {
            let mut dispatcher = room.dispatcher();
            if std::ptr::eq(dispatcher.as_ptr(), Arc::as_ptr(self)) {
                return;
            }
            *dispatcher = Arc::downgrade(self);
        }
        if self.admission.is_none() {
            self.let_in(room, true, true);
        }
    }

    fn dispatch(&self, freed: bool) {
        if let Some(room) = &self.room {
            room.dispatch(freed);
        }
    }

    /// `all`: everyone, saturated or not.
    fn let_in(self: &Arc<Self>, room: &WaitingRoom, mut freed: bool, all: bool) {
        let mut picked = Vec::new();
        {
            let mut queue = room.queue();
            if queue.is_empty() {
                return;
            }
            let mut picker = self.picker();
            while !queue.is_empty() {
                let now = self.epoch.elapsed();
                if !all && !freed && picker.saturated(now, |index| self.healthy(index)) {
                    break;
                }
                freed = false;
                let Some(waiter) = queue.pop() else { break };
                let request = PickRequest {
                    model: &waiter.model,
                    lora: waiter.lora,
                    prompt_hashes: &waiter.prompt_hashes,
                };
                let result = self.pick(&mut picker, &request);
                picked.push((waiter.reply, result));
            }
        }
        // Outside the locks: a request that stopped waiting drops its pick here, and the
        // credit's drop gives the count back and dispatches again.
        for (reply, result) in picked {
            let _ = reply.send(Admitted::Picked(result));
        }
    }
}

impl Target for InferencePoolTarget {
    fn name(&self) -> &Arc<str> {
        &self.name
    }

    fn forward<'a>(
        &'a self,
        ctx: &'a mut RequestContext,
        route: &'a Route,
        upstream: &'a Arc<Upstream>,
        request: Request<Body>,
    ) -> ResponseFuture<'a> {
        Box::pin(async move {
            let Some(llm) = ctx.llm.as_ref() else {
                // Route compilation sends only parsed LLM requests here.
                return llm::error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "not_an_llm_request",
                    format!("{} received a request the LLM stage did not read", self.name),
                );
            };
            let hashes = self
                .prefix
                .map(|prefix| block_hashes(&llm.model, &llm.prompt, &prefix))
                .unwrap_or_default();
            let class = match self.classify(request.headers(), llm.priority_class.as_ref()) {
                Ok(class) => class,
                Err((code, message)) => return llm::error(StatusCode::BAD_REQUEST, code, message),
            };
            let (model, lora, record, since) = (llm.model.clone(), llm.lora, llm.record.clone(), llm.since);
            let pick_request = PickRequest {
                model: &model,
                lora,
                prompt_hashes: &hashes,
            };
            // Whatever happens from here (the client leaves, the exchange fails), dropping
            // the credit gives the picker its count back.
            let (pick, mut credit) = match self.admit(ctx, class, pick_request).await {
                Ok(picked) => picked,
                Err(answer) => return answer,
            };
            {
                let mut record = record.lock().unwrap_or_else(PoisonError::into_inner);
                record.pick_basis = Some(pick.basis.as_str());
                record.prefix_blocks = Some((pick.prefix_hit_blocks, hashes.len() as u32));
                record.saturated = pick.saturated;
            }
            ctx.decide(&self.name, pick.basis.as_str());
            // A waiting request may have been picked by a later version of the pool, whose
            // endpoints the pick's indexes name.
            let pool = credit.pool.clone();
            let dispatch = Dispatch {
                target: &self.name,
                endpoints: pick
                    .endpoints
                    .iter()
                    .map(|&index| &pool.endpoints[index])
                    .collect(),
                http2: false,
                ejection: &self.ejection,
                connect_fallback: true,
            };
            let response = upstream.send(ctx, route, dispatch, request).await;
            let used = ctx.endpoint.as_ref().and_then(|label| {
                pick.endpoints
                    .iter()
                    .copied()
                    .find(|&index| pool.endpoints[index].label == *label)
            });
            if let Some(used) = used.filter(|&used| used != credit.endpoint) {
                pool.moved(credit.endpoint, used, &hashes, credit.issued);
                if let Some(sharing) = &pool.sharing {
                    sharing.post(credit.endpoint, &hashes, true);
                    sharing.post(used, &hashes, false);
                }
                credit.endpoint = used;
            }
            let (parts, body) = response.into_parts();
            let streamed = parts
                .headers
                .get(http::header::CONTENT_TYPE)
                .is_some_and(|value| {
                    // Media types are case-insensitive (RFC 9110 §8.3.1).
                    value.as_bytes().len() >= 17
                        && value.as_bytes()[..17].eq_ignore_ascii_case(b"text/event-stream")
                });
            let release = Release {
                inner: llm::Tap::new(body, record, since, streamed),
                _credit: credit,
            };
            Response::from_parts(parts, body::boxed(release))
        })
    }

    fn endpoints(&self) -> Vec<&Authority> {
        self.pool
            .endpoints
            .iter()
            .map(|endpoint| &endpoint.authority)
            .collect()
    }
}

/// A request counted in flight at `endpoint`; dropping it gives the count back and lets the
/// next waiting request in.
struct Credit {
    pool: Arc<PoolState>,
    endpoint: usize,
    /// Copies of the pool's picker taken when it was issued: every later copy counts it too.
    issued: u64,
}

impl Drop for Credit {
    fn drop(&mut self) {
        self.pool.finished(self.endpoint, self.issued);
        self.pool.dispatch(true);
    }
}

/// The response body; holds the request's credit until the exchange ends (the body is
/// dropped at its end, on error, or when the client leaves).
struct Release {
    inner: llm::Tap,
    _credit: Credit,
}

impl HttpBody for Release {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::Telemetry;

    fn compiled(
        endpoints: &[&str],
        upstream: &Upstream,
        previous: Option<&InferencePoolTarget>,
    ) -> InferencePoolTarget {
        let spec: InferencePoolSpec =
            serde_json::from_value(serde_json::json!({"endpoints": endpoints, "models": [{"name": "m"}]}))
                .unwrap();
        InferencePoolTarget::compile("qwen", &spec, upstream, previous).unwrap()
    }

    /// A request picked for a pod the pool's next version dropped, that went to a pod it kept:
    /// the next version counts it there, and gives it back when it ends.
    #[tokio::test]
    async fn a_request_moved_to_a_pod_the_next_version_kept_is_counted_there() {
        let telemetry = Arc::new(Telemetry::new(crate::tests::support::quiet_telemetry()).unwrap());
        let upstream = Upstream::new(telemetry, crate::placements::outbox().0, None);
        let (dropped, kept) = ("127.0.0.1:1", "127.0.0.1:2");
        let first = compiled(&[dropped, kept], &upstream, None);
        let (from, to) = (first.by_address[dropped], first.by_address[kept]);
        // Picked for `dropped` before the next version was compiled.
        first.pool.picker().counted(from, first.pool.epoch.elapsed());
        let issued = first.pool.handover().count;
        let next = compiled(&[kept], &upstream, Some(&first));
        let there = next.by_address[kept];
        assert_eq!(next.pool.picker().in_flight(there), 0);

        // `dropped` refused the connection; the request went to `kept`.
        first.pool.moved(from, to, &[], issued);
        assert_eq!(next.pool.picker().in_flight(there), 1);
        first.pool.finished(to, issued);
        assert_eq!(next.pool.picker().in_flight(there), 0);
        assert_eq!(first.pool.picker().in_flight(to), 0);
    }
}
