//! The fleet view as Prometheus metrics: read from the view at each scrape (a
//! [`Collector`]), so that what `/metrics` shows is what `/v1/view` shows, and an entry
//! the view dropped (idle for 15 minutes, or never tracked because a table was full)
//! leaves no series behind.
//!
//! | name | type | labels |
//! |---|---|---|
//! | `diana_quota_fleet_reports_total` | counter | — (reports received by this replica) |
//! | `diana_quota_fleet_gateways` | gauge | — (gateways that reported in the last 15 minutes) |
//! | `diana_quota_fleet_gateway_degraded` | gauge | `gateway` (1: its last report said it runs global rules locally) |
//! | `diana_quota_fleet_gateway_last_report_timestamp_seconds` | gauge | `gateway` |
//! | `diana_quota_fleet_requests_total` | counter | `rule`, `outcome` = `admitted`/`limited`/`dry_run_limited` |
//! | `diana_quota_fleet_hot` | gauge | `rule`, `list` = `limited`/`admitted`, `rank` = `1`…`10` (the count of the rank-th hottest identity of the last minute; the identities themselves are in `/v1/view` only) |
//! | `diana_quota_fleet_hot_total` | gauge | `rule`, `list` (requests the hot list counted in the last minute) |
//! | `diana_quota_fleet_hot_error_bound` | gauge | `rule`, `list` (ε of the merged list) |
//! | `diana_quota_fleet_hot_paths` | gauge | `rank` = `1`…`10` (the hottest paths' counts) |
//! | `diana_quota_fleet_breaker_state` | gauge | `breaker` (the fleet's state as last answered here: 0 closed, 1 open, 2 half-open) |
//! | `diana_quota_fleet_breaker_window` | gauge | `breaker`, `figure` = `calls`/`slow`/`failed` (the fleet's window) |
//! | `diana_quota_fleet_breaker_transitions_total` | counter | `breaker`, `to` = `closed`/`open`/`half_open` (made by this replica's writes) |
//! | `diana_quota_fleet_breaker_gateways` | gauge | `breaker`, `status` (gateways whose last report shows it so) |
//! | `diana_quota_fleet_dropped_total` | counter | `what` = `gateways`/`rules`/`breakers` (not tracked: the table was full) |
//!
//! Bounded labels: `gateway` takes at most 1,024 values, `rule` 256, `breaker` 256 (the
//! view's [`super::view::Limits`]), `rank` 10; every value is escaped by the encoder. No
//! label carries an identity.

use super::view::{HotJson, Snapshot};
use super::Fleet;
use diana_core::breaker::Status;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use std::fmt;
use std::sync::Arc;

/// Ranks of a hot list exported (the rest are in `/v1/view`).
pub const HOT_RANKS: usize = 10;

/// Reads the view at each scrape.
pub struct FleetCollector(pub Arc<Fleet>);

impl fmt::Debug for FleetCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("FleetCollector").field(&self.0).finish()
    }
}

type Labels = Vec<(&'static str, String)>;

/// One metric family's samples.
struct Family {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    samples: Vec<(Labels, u64)>,
}

impl Family {
    fn new(name: &'static str, help: &'static str, kind: MetricType) -> Family {
        Family {
            name,
            help,
            kind,
            samples: Vec::new(),
        }
    }

    fn push(&mut self, labels: Labels, value: u64) {
        self.samples.push((labels, value));
    }

    /// Its samples (none: nothing at all, as the registry's own families).
    fn encode(&self, encoder: &mut DescriptorEncoder) -> Result<(), fmt::Error> {
        if self.samples.is_empty() {
            return Ok(());
        }
        let mut metric = encoder.encode_descriptor(self.name, self.help, None, self.kind)?;
        if let [(labels, value)] = self.samples.as_slice() {
            if labels.is_empty() {
                return self.sample(*value, metric);
            }
        }
        for (labels, value) in &self.samples {
            self.sample(*value, metric.encode_family(labels)?)?;
        }
        Ok(())
    }

    fn sample(&self, value: u64, encoder: MetricEncoder) -> Result<(), fmt::Error> {
        match self.kind {
            MetricType::Counter => ConstCounter::new(value).encode(encoder),
            _ => ConstGauge::new(value).encode(encoder),
        }
    }
}

fn status_label(status: Status) -> &'static str {
    match status {
        Status::Closed => "closed",
        Status::Open => "open",
        Status::HalfOpen => "half_open",
    }
}

/// Every family, from one snapshot.
fn families(view: &Snapshot) -> Vec<Family> {
    use MetricType::{Counter, Gauge};
    let mut reports = Family::new(
        "diana_quota_fleet_reports",
        "Gateway reports (POST /v1/report) received by this replica.",
        Counter,
    );
    reports.push(Vec::new(), view.reports);
    let mut gateways = Family::new(
        "diana_quota_fleet_gateways",
        "Gateways that reported to this replica in the last 15 minutes.",
        Gauge,
    );
    gateways.push(Vec::new(), view.gateways.len() as u64);
    let mut degraded = Family::new(
        "diana_quota_fleet_gateway_degraded",
        "1 when the gateway's last report said it runs global rules locally (quota service unreachable).",
        Gauge,
    );
    let mut last_report = Family::new(
        "diana_quota_fleet_gateway_last_report_timestamp_seconds",
        "When the gateway last reported to this replica (seconds since the epoch).",
        Gauge,
    );
    for gateway in &view.gateways {
        let labels = || vec![("gateway", gateway.id.clone())];
        degraded.push(labels(), u64::from(gateway.degraded));
        last_report.push(labels(), gateway.last_report_ms / 1_000);
    }
    let mut requests = Family::new(
        "diana_quota_fleet_requests",
        "Requests the gateways reported per rule (admitted, limited, dry_run_limited), since this replica tracks the rule.",
        Counter,
    );
    let mut hot = Family::new(
        "diana_quota_fleet_hot",
        "Count of the rank-th hottest identity of the rule in the last minute, fleet-wide (identities in /v1/view).",
        Gauge,
    );
    let mut hot_total = Family::new(
        "diana_quota_fleet_hot_total",
        "Requests the rule's hot list counted in the last minute.",
        Gauge,
    );
    let mut hot_bound = Family::new(
        "diana_quota_fleet_hot_error_bound",
        "The merged hot list's error bound: an identity not listed counted at most this many.",
        Gauge,
    );
    for rule in &view.rules {
        let totals = [
            ("admitted", rule.totals.admitted),
            ("limited", rule.totals.limited),
            ("dry_run_limited", rule.totals.dry_run_limited),
        ];
        for (outcome, value) in totals {
            requests.push(
                vec![
                    ("rule", rule.name.clone()),
                    ("outcome", outcome.to_string()),
                ],
                value,
            );
        }
        for (list, summary) in [
            ("limited", &rule.hot_limited),
            ("admitted", &rule.hot_admitted),
        ] {
            let Some(summary) = summary else { continue };
            let labels = || vec![("rule", rule.name.clone()), ("list", list.to_string())];
            hot_total.push(labels(), summary.total);
            hot_bound.push(labels(), summary.floor);
            for (rank, count) in ranks(summary) {
                let mut labels = labels();
                labels.push(("rank", rank));
                hot.push(labels, count);
            }
        }
    }
    let mut paths = Family::new(
        "diana_quota_fleet_hot_paths",
        "Count of the rank-th hottest path in the last minute, fleet-wide (paths in /v1/view).",
        Gauge,
    );
    if let Some(summary) = &view.paths {
        for (rank, count) in ranks(summary) {
            paths.push(vec![("rank", rank)], count);
        }
    }
    let mut state = Family::new(
        "diana_quota_fleet_breaker_state",
        "The fleet's breaker state as this replica last answered it: 0 closed, 1 open, 2 half-open.",
        Gauge,
    );
    let mut window = Family::new(
        "diana_quota_fleet_breaker_window",
        "The fleet's breaker window (calls, slow, failed) as last answered.",
        Gauge,
    );
    let mut transitions = Family::new(
        "diana_quota_fleet_breaker_transitions",
        "Transitions of the fleet's breaker made by this replica's writes, by the state they went to.",
        Counter,
    );
    let mut seen = Family::new(
        "diana_quota_fleet_breaker_gateways",
        "Gateways whose last report shows the breaker in this status.",
        Gauge,
    );
    for breaker in &view.breakers {
        let name = || ("breaker", breaker.name.clone());
        if let Some(fleet) = &breaker.state {
            state.push(vec![name()], u64::from(fleet.status.gauge()));
            for (figure, value) in [
                ("calls", fleet.window.calls),
                ("slow", fleet.window.slow),
                ("failed", fleet.window.failed),
            ] {
                window.push(
                    vec![name(), ("figure", figure.to_string())],
                    u64::from(value),
                );
            }
        }
        if breaker.fleet {
            let totals = &breaker.transitions_total;
            for (to, value) in [
                (Status::Closed, totals.closed),
                (Status::Open, totals.open),
                (Status::HalfOpen, totals.half_open),
            ] {
                transitions.push(vec![name(), ("to", status_label(to).to_string())], value);
            }
        }
        for status in [Status::Closed, Status::Open, Status::HalfOpen] {
            let count = breaker
                .gateways
                .iter()
                .filter(|view| view.status == status)
                .count();
            seen.push(
                vec![name(), ("status", status_label(status).to_string())],
                count as u64,
            );
        }
    }
    let mut dropped = Family::new(
        "diana_quota_fleet_dropped",
        "Gateways, rules or breakers the fleet view did not track because its table was full.",
        Counter,
    );
    for (what, value) in [
        ("gateways", view.dropped.gateways),
        ("rules", view.dropped.rules),
        ("breakers", view.dropped.breakers),
    ] {
        dropped.push(vec![("what", what.to_string())], value);
    }
    vec![
        reports,
        gateways,
        degraded,
        last_report,
        requests,
        hot,
        hot_total,
        hot_bound,
        paths,
        state,
        window,
        transitions,
        seen,
        dropped,
    ]
}

/// The counts of the first [`HOT_RANKS`] items, with their rank as a label value.
fn ranks(summary: &HotJson) -> impl Iterator<Item = (String, u64)> + '_ {
    summary
        .items
        .iter()
        .take(HOT_RANKS)
        .enumerate()
        .map(|(at, item)| ((at + 1).to_string(), item.count))
}

impl Collector for FleetCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let view = self.0.snapshot();
        for family in families(&view) {
            family.encode(&mut encoder)?;
        }
        Ok(())
    }
}
