//! What every step of one event works with: the host's shared data, the instant the event
//! happened, and where its metrics go. The worker reads the clock once, at its door, and
//! hands this inward; an event whose clock cannot be read never gets this far (the worker
//! applies the "no clock" rule once: nothing is written, a request is admitted uncounted).
//!
//! Not to be confused with a host's request *context* ([`crate::worker::ContextId`]).

use crate::metrics::MetricSink;
use crate::store::SharedData;
use crate::time::Instant;

/// One event's services (see the module docs).
pub struct Cx<'a> {
    /// The host's process-wide key/value store.
    pub shared: &'a dyn SharedData,
    /// When the event happened.
    pub now: Instant,
    /// Where the event's counts go (the configuration's counters).
    pub metrics: &'a mut dyn MetricSink,
}

impl<'a> Cx<'a> {
    pub fn new(
        shared: &'a dyn SharedData,
        now: Instant,
        metrics: &'a mut dyn MetricSink,
    ) -> Cx<'a> {
        Cx {
            shared,
            now,
            metrics,
        }
    }
}
