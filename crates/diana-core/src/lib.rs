//! Diana's host-agnostic core: everything the rate limiter decides, with no proxy-wasm
//! dependency. Time and state are passed in, so every piece is tested natively with a
//! fake clock and an in-memory host.
//!
//! - [`config`]: parse and validate the Diana document (YAML/JSON) into an immutable [`config::Policy`].
//! - [`path`]: request path normalisation, so a different spelling cannot escape a limit.
//! - [`matching`]: which resource blocks (and so which rules) apply to a path.
//! - [`actor`]: where an identity comes from (header, fallback, client address) and its hash.
//! - [`algo`]: the rate-limiting algorithms (W, SW, LB, TB) as pure functions over a state.
//! - [`local`]: per-worker batches of local rules' tokens (the hot path without host calls).
//! - [`store`]: process-wide state in a key/value host store with compare-and-swap, slot tables.
//! - [`engine`]: one request's evaluation, from facts to a decision, sequenced.
//! - [`decision`]: what an evaluation answers (admit, delay, reject, a complete call).
//! - [`response`]: the rejection response and rate-limit headers.
//! - [`metrics`]: metric names and the counters the engine reports.
//! - [`wire`]: the global protocol, the filter ↔ quota service wire format and its limits.
//! - [`global`]: plans the calls of global rules and reads their answers (lease stash, outage switch).
//! - [`call`]: a call to the quota service or config center, and its answer, as values.
//! - [`places`]: concurrency places, from admission to their return.
//! - [`cx`]: what every step of one event works with (shared data, the instant, metrics).
//! - [`facts`]: what the filter knows of a request (headers, client address, metadata).
//! - [`breaker`]: the circuit breaker of a resource's upstream: the state machine, its shared record.
//! - [`lifecycle`]: releasing the shared-data records of rules a new document dropped.
//! - [`settle`]: settling what a request took up front once its answer is known.
//! - [`nginx`]: how large nginx's `shm_kv` zone must be for a document.
//! - [`remote`]: polling the config center and sharing its document with every worker.
//! - [`report`]: the tick's report to the quota service (the fleet's breakers, the fleet view).
//! - [`properties`]: host property values (Envoy vs nginx spellings).
//! - [`logline`]: one `diana:` per log line, whatever the host prefixes.
//! - [`secret`]: secrets the document carries, never shown (`Debug`, logs, plans).
//! - [`signature`]: signed remote documents (HMAC-SHA256, Ed25519).
//! - [`worker`]: one worker, sans IO: events in (with a host behind one trait), commands out.
//! - [`quota`]: the quota service's decisions, pure, and an in-process quota service.
//! - [`usage`]: token usage read from an LLM answer's body or stream, bounded; a request's reservation.
//! - [`calendar`]: calendar periods (ISO weeks, months) in an IANA time zone, for calendar budgets.
//! - [`hot`]: who is hot: heavy hitters (Space-Saving) in fixed memory, mergeable, by the minute.

pub mod actor;
pub mod algo;
pub mod breaker;
pub mod calendar;
pub mod call;
pub mod config;
pub mod cx;
pub mod decision;
pub mod engine;
pub mod facts;
pub mod global;
pub mod hash;
pub mod hot;
pub mod jwt;
pub mod lifecycle;
pub mod local;
pub mod logline;
pub mod matching;
pub mod metrics;
pub mod nginx;
pub mod path;
pub mod places;
pub mod properties;
pub mod quota;
pub mod remote;
pub mod report;
pub mod response;
pub mod secret;
pub mod settle;
pub mod signature;
pub mod store;
pub mod time;
pub mod usage;
pub mod wire;
pub mod worker;
