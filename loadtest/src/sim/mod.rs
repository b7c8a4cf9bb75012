//! Deterministic, virtual-time simulator of a fleet of vLLM replicas behind a router.
//!
//! Built to compare routing policies on workloads like the published llm-d benchmark
//! (llm-d/llm-d, `guides/inference-scheduling/README.md`) without GPUs: each replica is a
//! step-based model of the vLLM V1 scheduler (vllm-project/vllm:
//! `vllm/v1/core/sched/scheduler.py`, `vllm/v1/core/kv_cache_manager.py`) with a paged,
//! prefix-cached KV pool and a step-time model of our own (`loadtest/profiles/README.md`), so
//! prefix cache thrash, chunked-prefill cost and KV-capacity preemption — the effects that
//! separate a cache-blind router from a cache-aware one — emerge rather than being scripted.
//!
//! * [`profile`]: capacity limits and step-time coefficients (loaded from `loadtest/profiles/`);
//! * [`tokenizer`]: deterministic stand-in tokenizer;
//! * [`kv_cache`]: block pool with hash-chained prefix caching and LRU eviction;
//! * [`engine`]: one replica's scheduler (WAITING/RUNNING, token budget, preemption);
//! * [`router`]: round-robin, least-queue, an exact-state oracle, and the proxy's picker;
//! * [`workload`]: inference-perf-like prompt generators and Poisson stages;
//! * [`fleet`]: the discrete-event loop over replicas, router and load generator;
//! * [`report`]: per-stage latency and throughput summaries;
//! * [`run_virtual`]: the entry point tying them together.

mod command;
pub mod engine;
pub mod fleet;
pub mod kv_cache;
pub mod profile;
pub mod report;
pub mod request;
pub mod router;
mod run;
pub mod tokenizer;
pub mod workload;

pub use command::{run as run_command, table, VirtualArgs};
pub use run::{run_virtual, VirtualConfig};
