//! Global scope: the wire protocol with diana-quota and the filter-side state machine
//! (batched callout, leases, cached denials, circuit breaker).

pub mod wire;
