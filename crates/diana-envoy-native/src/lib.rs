//! Diana as an Envoy dynamic module: the same [`diana_core::worker::Worker`] as the
//! proxy-wasm filter (`src/`), bound to the native HTTP-filter ABI of
//! `envoy.extensions.filters.http.dynamic_modules` (Envoy 1.40, ABI "v0.2.0"). Host glue
//! only: every decision is the worker's, and the worker is tested natively under each
//! host's rules in diana-core.
//!
//! - `ffi`: the ABI, hand-written for what Diana uses; the only module with `unsafe` (its
//!   docs list the invariants it relies on).
//! - `filter`: per configuration, one worker per Envoy worker thread and the main thread's,
//!   each behind a mutex; hooks to worker events, worker commands to callbacks; the tick
//!   and its calls on the main thread.
//! - `host`: the worker's [`diana_core::worker::Host`] over the ABI, process memory for
//!   shared data and Envoy stats for metrics.
//! - `shared`: the process's shared data, Envoy's compare-and-swap rules without a lock.
//! - `timer`: the workers' tick, posted to the main thread through the configuration's
//!   scheduler.
//! - `logger`: `log` records to Envoy's log.

#![deny(unsafe_code)]

mod ffi;
mod filter;
mod host;
mod logger;
mod shared;
mod timer;

pub use ffi::ABI_VERSION;
