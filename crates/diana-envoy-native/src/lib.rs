//! Diana as an Envoy dynamic module: the same [`diana_core::worker::Worker`] as the
//! proxy-wasm filter (`src/`), bound to the native HTTP-filter ABI of
//! `envoy.extensions.filters.http.dynamic_modules` (Envoy 1.40, ABI "v0.2.0"). Host glue
//! only: every decision is the worker's, and the worker is tested natively under each
//! host's rules in diana-core.
//!
//! From the bottom up (each module uses only those below it):
//!
//! - `envoy`: what the binding asks of Envoy — its handles as traits (a stream's filter,
//!   the configuration, their schedulers) and the values that cross.
//! - `shared`: the process's shared data, Envoy's compare-and-swap rules without a lock.
//! - `logger`: `log` records to a writer it is handed (Envoy's log).
//! - `timer`: the workers' tick, posted to the main thread through the configuration's
//!   scheduler.
//! - `host`: the worker's [`diana_core::worker::Host`] over the handles, process memory
//!   for shared data and Envoy stats for metrics.
//! - `filter`: per configuration, one worker per Envoy worker thread and the main thread's,
//!   each behind a mutex; hooks to worker events, worker commands to the handles; the tick
//!   and its calls on the main thread.
//! - `ffi`: the ABI, hand-written for what Diana uses: the handles over Envoy's callbacks
//!   and the exported hooks; the only module with `unsafe` (its docs list the invariants
//!   it relies on).
//! - `fake` (tests): an Envoy of threads that keeps 1.40's threading rules, driving
//!   `filter` as `ffi` does; `tests`: the binding's scenarios on it.

#![deny(unsafe_code)]

mod envoy;
mod ffi;
mod filter;
mod host;
mod logger;
mod shared;
mod timer;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;

pub use ffi::{Buf, ABI_VERSION};
