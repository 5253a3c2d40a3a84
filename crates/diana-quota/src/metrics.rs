//! The service's Prometheus metrics (OpenMetrics text at `GET /metrics`).
//!
//! | name | type | labels |
//! |---|---|---|
//! | `diana_quota_decisions_total` | counter | `algo`, `result` = `allowed`/`spared`/`limited` |
//! | `diana_quota_tokens_granted_total` | counter | `algo` |
//! | `diana_quota_tokens_charged_total` | counter | `algo` (debts, `/v1/charge`) |
//! | `diana_quota_http_requests_total` | counter | `path`, `status` |
//! | `diana_quota_request_duration_seconds` | histogram | `path` |
//! | `diana_quota_store_errors_total` | counter | `kind` = `unavailable`/`internal`/`unsupported`/`full`/`timeout` |
//! | `diana_quota_shed_total` | counter | `path` (refused at once: too many requests in flight) |
//! | `diana_quota_deadline_expired_total` | counter | `path` (answered 503 at the request's deadline) |
//! | `diana_quota_late_releases_total` | counter | — (grants given back: their answer came after the deadline) |
//! | `diana_quota_call_releases_total` | counter | — (grants given back at a gateway's `/v1/release`: its request went away before the answer) |
//! | `diana_quota_in_flight` | gauge | — (decisions being made) |
//! | `diana_quota_store_keys` | gauge | — (memory store: counters held) |
//! | `diana_quota_store_key_capacity` | gauge | — (memory store: `--memory-max-keys`) |
//! | `diana_quota_store_evictions_total` | counter | — (memory store: idle counters evicted) |
//! | `diana_quota_wait_seconds` | histogram | — (time `/v1/wait` slept) |
//! | `diana_quota_unauthorized_total` | counter | `reason` = `missing`/`invalid` (gateway requests refused 401) |
//! | `diana_quota_auth_required` | gauge | — (1: a secret is required; 0: `--insecure-no-auth`) |
//! | `diana_quota_connections` | gauge | `port` = `http`/`grpc` (connections open) |
//! | `diana_quota_connections_refused_total` | counter | `port`, `reason` = `port`/`peer` (closed at once: `--max-connections`, `--max-connections-per-peer`) |
//! | `diana_quota_connections_closed_total` | counter | `port`, `reason` = `header`/`idle` (closed by the service: no request head within `--header-timeout-ms`, nothing read for `--idle-timeout-ms`) |
//!
//! No label carries a key, an identity or a counter's value: every label set is one of a
//! few fixed names (routes, algorithms, statuses, kinds), so `/metrics` can stay open.
//! The fleet view's metrics (`diana_quota_fleet_*`, `crate::fleet::metrics`) add labels
//! from the gateways' reports (gateway ids, rule and breaker names: bounded in count,
//! escaped), never an identity.

use crate::store::Usage;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Content type of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    algo: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AlgoLabels {
    algo: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    path: &'static str,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabels {
    path: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PortLabels {
    port: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PortReasonLabels {
    port: &'static str,
    reason: &'static str,
}

const LATENCY_BUCKETS: [f64; 14] = [
    0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// Every metric of the service.
pub struct Metrics {
    registry: Registry,
    decisions: Family<DecisionLabels, Counter>,
    granted: Family<AlgoLabels, Counter>,
    requests: Family<RequestLabels, Counter>,
    latency: Family<PathLabels, Histogram, fn() -> Histogram>,
    store_errors: Family<ErrorLabels, Counter>,
    charged: Family<AlgoLabels, Counter>,
    shed: Family<PathLabels, Counter>,
    expired: Family<PathLabels, Counter>,
    late_releases: Counter,
    call_releases: Counter,
    in_flight: Gauge,
    keys: Gauge,
    key_capacity: Gauge,
    evictions: Counter,
    waits: Histogram,
    unauthorized: Family<ReasonLabels, Counter>,
    auth_required: Gauge,
    connections: Family<PortLabels, Gauge>,
    connections_refused: Family<PortReasonLabels, Counter>,
    connections_closed: Family<PortReasonLabels, Counter>,
}

/// The routes that decide (shed and deadline counters exist for each from the start).
const DECISION_PATHS: [&str; 4] = ["/v1/acquire", "/v1/wait", "/v1/charge", "/v1/release"];

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "diana_quota_decisions",
            "Rule decisions, by algorithm and result (allowed: tokens granted; spared: the rule had them but another rule of the request denied; limited: denied)",
            decisions.clone(),
        );
        let granted = Family::<AlgoLabels, Counter>::default();
        registry.register(
            "diana_quota_tokens_granted",
            "Tokens granted, by algorithm",
            granted.clone(),
        );
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "diana_quota_http_requests",
            "HTTP requests, by route and status",
            requests.clone(),
        );
        let latency: Family<PathLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "diana_quota_request_duration_seconds",
            "Time to answer an HTTP request, by route",
            latency.clone(),
        );
        let store_errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "diana_quota_store_errors",
            "Store (Redis) failures, by kind (unavailable, timeout, internal, unsupported)",
            store_errors.clone(),
        );
        for kind in ["unavailable", "timeout", "internal", "unsupported", "full"] {
            // Present at 0 from the start, so rate() and alerts work before the first failure.
            let _ = store_errors.get_or_create(&ErrorLabels { kind });
        }
        let charged = Family::<AlgoLabels, Counter>::default();
        registry.register(
            "diana_quota_tokens_charged",
            "Tokens charged past the limit by /v1/charge (debts), by algorithm",
            charged.clone(),
        );
        let shed = Family::<PathLabels, Counter>::default();
        registry.register(
            "diana_quota_shed",
            "Requests refused at once with 503 overloaded: too many decisions in flight",
            shed.clone(),
        );
        let expired = Family::<PathLabels, Counter>::default();
        registry.register(
            "diana_quota_deadline_expired",
            "Requests answered 503 at their deadline (min(--deadline-ms, x-diana-timeout-ms - --timeout-margin-ms))",
            expired.clone(),
        );
        for path in DECISION_PATHS {
            let _ = shed.get_or_create(&PathLabels { path });
            let _ = expired.get_or_create(&PathLabels { path });
        }
        let late_releases = Counter::default();
        registry.register(
            "diana_quota_late_releases",
            "Decisions whose grants were given back because their answer came after the deadline",
            late_releases.clone(),
        );
        let call_releases = Counter::default();
        registry.register(
            "diana_quota_call_releases",
            "Grants given back at a gateway's release: its request went away before the answer",
            call_releases.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "diana_quota_in_flight",
            "Decisions being made right now (at most --max-in-flight)",
            in_flight.clone(),
        );
        let keys = Gauge::default();
        registry.register(
            "diana_quota_store_keys",
            "Counters held by the memory store",
            keys.clone(),
        );
        let key_capacity = Gauge::default();
        registry.register(
            "diana_quota_store_key_capacity",
            "Most counters the memory store may hold (--memory-max-keys)",
            key_capacity.clone(),
        );
        let evictions = Counter::default();
        registry.register(
            "diana_quota_store_evictions",
            "Idle counters evicted by the memory store",
            evictions.clone(),
        );
        let waits = latency_histogram();
        registry.register(
            "diana_quota_wait_seconds",
            "Time /v1/wait slept before answering",
            waits.clone(),
        );
        let unauthorized = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "diana_quota_unauthorized",
            "Gateway requests refused with 401 (no valid authorization: Bearer <secret>), by reason (missing, invalid)",
            unauthorized.clone(),
        );
        for reason in ["missing", "invalid"] {
            let _ = unauthorized.get_or_create(&ReasonLabels { reason });
        }
        let auth_required = Gauge::default();
        registry.register(
            "diana_quota_auth_required",
            "1 when the gateway endpoints require a secret, 0 when started with --insecure-no-auth",
            auth_required.clone(),
        );
        let connections = Family::<PortLabels, Gauge>::default();
        registry.register(
            "diana_quota_connections",
            "Connections open, by port (http, grpc)",
            connections.clone(),
        );
        let connections_refused = Family::<PortReasonLabels, Counter>::default();
        registry.register(
            "diana_quota_connections_refused",
            "Connections closed as soon as accepted, by port and reason (port: --max-connections open; peer: --max-connections-per-peer open from its address)",
            connections_refused.clone(),
        );
        let connections_closed = Family::<PortReasonLabels, Counter>::default();
        registry.register(
            "diana_quota_connections_closed",
            "Connections the service closed, by port and reason (header: no request head within --header-timeout-ms; idle: nothing read for --idle-timeout-ms)",
            connections_closed.clone(),
        );
        for port in ["http", "grpc"] {
            let _ = connections.get_or_create(&PortLabels { port });
            for reason in ["port", "peer"] {
                let _ = connections_refused.get_or_create(&PortReasonLabels { port, reason });
            }
            for reason in ["header", "idle"] {
                let _ = connections_closed.get_or_create(&PortReasonLabels { port, reason });
            }
        }
        Metrics {
            registry,
            decisions,
            granted,
            requests,
            latency,
            store_errors,
            charged,
            shed,
            expired,
            late_releases,
            call_releases,
            in_flight,
            keys,
            key_capacity,
            evictions,
            waits,
            unauthorized,
            auth_required,
            connections,
            connections_refused,
            connections_closed,
        }
    }

    /// Connections open on `port` now.
    pub fn set_connections(&self, port: &'static str, open: usize) {
        self.connections
            .get_or_create(&PortLabels { port })
            .set(i64::try_from(open).unwrap_or(i64::MAX));
    }

    /// One connection closed as soon as accepted.
    pub fn connection_refused(&self, port: &'static str, reason: &'static str) {
        self.connections_refused
            .get_or_create(&PortReasonLabels { port, reason })
            .inc();
    }

    /// One connection closed by the service's timeouts.
    pub fn connection_closed(&self, port: &'static str, reason: &'static str) {
        self.connections_closed
            .get_or_create(&PortReasonLabels { port, reason })
            .inc();
    }

    /// One gateway request refused 401 (`missing` or `invalid` credential).
    pub fn unauthorized(&self, reason: &'static str) {
        self.unauthorized
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Whether a secret is required.
    pub fn set_auth_required(&self, required: bool) {
        self.auth_required.set(i64::from(required));
    }

    /// One rule decided.
    pub fn decision(&self, algo: &str, allowed: bool, granted: u32) {
        let result = match (allowed, granted > 0) {
            (_, true) => "allowed",
            (true, false) => "spared",
            (false, false) => "limited",
        };
        self.decisions
            .get_or_create(&DecisionLabels {
                algo: algo.to_string(),
                result,
            })
            .inc();
        if granted > 0 {
            self.granted
                .get_or_create(&AlgoLabels {
                    algo: algo.to_string(),
                })
                .inc_by(u64::from(granted));
        }
    }

    /// One HTTP request answered.
    pub fn request(&self, path: &'static str, status: u16, elapsed: Duration) {
        self.requests
            .get_or_create(&RequestLabels { path, status })
            .inc();
        self.latency
            .get_or_create(&PathLabels { path })
            .observe(elapsed.as_secs_f64());
    }

    /// One store failure.
    pub fn store_error(&self, kind: &'static str) {
        self.store_errors.get_or_create(&ErrorLabels { kind }).inc();
    }

    /// One rule charged `tokens` past its limit.
    pub fn charged(&self, algo: &str, tokens: u32) {
        self.charged
            .get_or_create(&AlgoLabels {
                algo: algo.to_string(),
            })
            .inc_by(u64::from(tokens));
    }

    /// One request refused at once (overloaded).
    pub fn shed(&self, path: &'static str) {
        self.shed.get_or_create(&PathLabels { path }).inc();
    }

    /// One request answered at its deadline.
    pub fn expired(&self, path: &'static str) {
        self.expired.get_or_create(&PathLabels { path }).inc();
    }

    /// One decision given back because its answer came too late.
    pub fn late_release(&self) {
        self.late_releases.inc();
    }

    /// One grant given back at a gateway's release.
    pub fn call_release(&self) {
        self.call_releases.inc();
    }

    /// Decisions in flight now.
    pub fn set_in_flight(&self, count: usize) {
        self.in_flight.set(i64::try_from(count).unwrap_or(i64::MAX));
    }

    /// The store's table, as it is now.
    pub fn store_usage(&self, usage: Usage) {
        let gauge = |value: u64| i64::try_from(value).unwrap_or(i64::MAX);
        self.keys.set(gauge(usage.keys));
        self.key_capacity.set(gauge(usage.capacity));
        // A counter that only follows the store's own (monotonic) count.
        self.evictions
            .inner()
            .fetch_max(usage.evicted, Ordering::Relaxed);
    }

    /// `/v1/wait` slept this long.
    pub fn waited(&self, slept: Duration) {
        self.waits.observe(slept.as_secs_f64());
    }

    /// Adds metrics read at each scrape (the fleet view's: `crate::fleet::metrics`).
    pub fn register_collector(&mut self, collector: impl Collector) {
        self.registry.register_collector(Box::new(collector));
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}
