//! The service's Prometheus metrics (OpenMetrics text at `GET /metrics`).
//!
//! | name | type | labels |
//! |---|---|---|
//! | `diana_quota_decisions_total` | counter | `algo`, `result` = `allowed`/`limited` |
//! | `diana_quota_tokens_granted_total` | counter | `algo` |
//! | `diana_quota_http_requests_total` | counter | `path`, `status` |
//! | `diana_quota_request_duration_seconds` | histogram | `path` |
//! | `diana_quota_store_errors_total` | counter | `kind` = `unavailable`/`internal`/`unsupported`/`timeout` |
//! | `diana_quota_wait_seconds` | histogram | — (time `/v1/wait` slept) |

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
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
    waits: Histogram,
}

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
            "Rule decisions, by algorithm and result (allowed = at least one token granted)",
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
        for kind in ["unavailable", "timeout", "internal", "unsupported"] {
            // Present at 0 from the start, so rate() and alerts work before the first failure.
            let _ = store_errors.get_or_create(&ErrorLabels { kind });
        }
        let waits = latency_histogram();
        registry.register(
            "diana_quota_wait_seconds",
            "Time /v1/wait slept before answering",
            waits.clone(),
        );
        Metrics {
            registry,
            decisions,
            granted,
            requests,
            latency,
            store_errors,
            waits,
        }
    }

    /// One rule decided.
    pub fn decision(&self, algo: &str, granted: u32) {
        let result = if granted > 0 { "allowed" } else { "limited" };
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

    /// `/v1/wait` slept this long.
    pub fn waited(&self, slept: Duration) {
        self.waits.observe(slept.as_secs_f64());
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)?;
        Ok(text)
    }
}
