//! The host behind `diana_core`'s traits, through `proxy_wasm::hostcalls` only (the SDK's
//! trait helpers unwrap host results). Header values are read as bytes: a client's
//! non-UTF-8 bytes must not reach a `String` getter.

use diana_core::actor::RequestFacts;
use diana_core::config::Rule;
use diana_core::metrics::{rule_metric_name, Event, MetricSink, RuleEvent, DEGRADED_GAUGE};
use diana_core::properties::client_ip_from_address;
use diana_core::store::{HostError, SetOutcome, SharedData};
use diana_core::time::Nanos;
use proxy_wasm::hostcalls;
use proxy_wasm::types::{MapType, MetricType, Status};
use std::collections::HashMap;
use std::time::UNIX_EPOCH;

/// proxy-wasm shared data (process-wide on Envoy, across worker processes on nginx).
pub struct HostSharedData;

impl SharedData for HostSharedData {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(value), Some(cas))) => Ok(Some((value, cas))),
            Ok((Some(value), None)) => Ok(Some((value, 0))),
            Ok((None, _)) => Ok(None),
            Err(status) => Err(HostError(format!("get {key}: {status:?}"))),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<SetOutcome, HostError> {
        match hostcalls::set_shared_data(key, Some(value), Some(cas)) {
            Ok(()) => Ok(SetOutcome::Written),
            Err(Status::CasMismatch) => Ok(SetOutcome::CasMismatch),
            Err(status) => Err(HostError(format!("set {key}: {status:?}"))),
        }
    }
}

/// The current request, read lazily from the host.
pub struct HostRequest;

impl RequestFacts for HostRequest {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        header_bytes(MapType::HttpRequestHeaders, name)
    }

    fn client_ip(&self) -> Option<Vec<u8>> {
        match hostcalls::get_property(vec!["source", "address"]) {
            Ok(Some(value)) => client_ip_from_address(&value),
            Ok(None) => None,
            Err(status) => {
                log::debug!("diana: source.address unavailable: {status:?}");
                None
            }
        }
    }
}

/// A header value as bytes (`None` when absent or unreadable).
pub fn header_bytes(map: MapType, name: &str) -> Option<Vec<u8>> {
    match hostcalls::get_map_value_bytes(map, name) {
        Ok(value) => value,
        Err(status) => {
            log::debug!("diana: header {name} unreadable: {status:?}");
            None
        }
    }
}

/// True when the host is Envoy (or another proxy-wasm-cpp-host): it knows the plugin's
/// name and root id in the root context. ngx_wasm_module (nginx, Kong) does not, and there
/// a paused request cannot be resumed from the root context (`set_effective_context` is a
/// no-op) and the tick period may be set only once. Its `ngx.*` properties would tell it
/// apart positively, but they exist only inside requests, and this is needed at configure time.
pub fn is_envoy() -> bool {
    [vec!["plugin_name"], vec!["plugin_root_id"]]
        .into_iter()
        .any(|path| matches!(hostcalls::get_property(path), Ok(Some(value)) if !value.is_empty()))
}

/// The `:status` of a callout's answer (0 when missing or unreadable).
pub fn callout_status() -> u16 {
    header_bytes(MapType::HttpCallResponseHeaders, ":status")
        .and_then(|s| std::str::from_utf8(&s).ok()?.trim().parse::<u16>().ok())
        .unwrap_or(0)
}

/// Host time in nanoseconds since the epoch (0 if the host cannot tell, which only makes
/// counters start over: never a failure).
pub fn now() -> Nanos {
    match hostcalls::get_current_time() {
        Ok(time) => time
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0),
        Err(status) => {
            log::warn!("diana: host clock unavailable: {status:?}");
            0
        }
    }
}

fn define(metric_type: MetricType, name: &str) -> Option<u32> {
    match hostcalls::define_metric(metric_type, name) {
        Ok(id) => Some(id),
        Err(status) => {
            log::warn!("diana: cannot define metric {name}: {status:?}");
            None
        }
    }
}

/// Host metrics for one policy: ids defined once at configuration time.
#[derive(Debug, Default)]
pub struct HostMetrics {
    rules: Vec<[Option<u32>; 3]>,
    events: HashMap<Event, u32>,
    degraded: Option<u32>,
}

impl HostMetrics {
    pub fn define<'a>(rules: impl Iterator<Item = &'a Rule>) -> HostMetrics {
        let rules = rules
            .map(|rule| {
                RuleEvent::ALL
                    .map(|event| define(MetricType::Counter, &rule_metric_name(rule, event)))
            })
            .collect();
        let events = Event::ALL
            .iter()
            .filter_map(|&event| define(MetricType::Counter, event.name()).map(|id| (event, id)))
            .collect();
        HostMetrics {
            rules,
            events,
            degraded: define(MetricType::Gauge, DEGRADED_GAUGE),
        }
    }

    /// Only the process-wide counters (before any policy is accepted).
    pub fn events_only() -> HostMetrics {
        HostMetrics::define(std::iter::empty())
    }

    fn bump(id: Option<u32>) {
        if let Some(id) = id {
            if let Err(status) = hostcalls::increment_metric(id, 1) {
                log::debug!("diana: metric {id}: {status:?}");
            }
        }
    }
}

/// A [`MetricSink`] over defined host metrics (defining is done once; reporting needs no
/// mutable state, so no borrow is ever held across a hostcall).
pub struct Sink<'a>(pub &'a HostMetrics);

impl MetricSink for Sink<'_> {
    fn rule_event(&mut self, rule: usize, event: RuleEvent) {
        let metrics = self.0;
        let slot = RuleEvent::ALL.iter().position(|&e| e == event).unwrap_or(0);
        HostMetrics::bump(
            metrics
                .rules
                .get(rule)
                .and_then(|ids| ids.get(slot).copied().flatten()),
        );
    }

    fn event(&mut self, event: Event) {
        HostMetrics::bump(self.0.events.get(&event).copied());
    }

    fn degraded(&mut self, on: bool) {
        if let Some(id) = self.0.degraded {
            if let Err(status) = hostcalls::record_metric(id, u64::from(on)) {
                log::debug!("diana: metric {id}: {status:?}");
            }
        }
    }
}
