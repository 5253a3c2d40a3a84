//! The host behind `diana_core`'s traits, through `proxy_wasm::hostcalls` only (the SDK's
//! trait helpers unwrap host results). Header values are read as bytes: a client's
//! non-UTF-8 bytes must not reach a `String` getter.

use diana_core::actor::RequestFacts;
use diana_core::config::Rule;
use diana_core::decision::{Callout, Reply};
use diana_core::metrics::{
    prometheus_text, rule_metric_name, Event, MetricSink, RuleEvent, DEGRADED_GAUGE,
};
use diana_core::properties::client_ip_from_address;
use diana_core::store::{HostError, SetOutcome, SharedData};
use diana_core::time::{Clock, Nanos};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};
use std::cell::Cell;
use std::collections::HashMap;
use std::time::Duration;
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
        // No value releases the key (nginx deletes it; Envoy keeps it empty).
        let value = (!value.is_empty()).then_some(value);
        match hostcalls::set_shared_data(key, value, Some(cas)) {
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

/// The proxy-wasm host Diana runs in, as far as its behaviour differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostKind {
    /// Envoy (and any proxy-wasm-cpp-host): a paused request can be resumed from the root
    /// context's tick; the tick period may change at will.
    Envoy,
    /// ngx_wasm_module (nginx, Kong): resuming a request from `on_tick` crashes the worker
    /// (its request context is NULL there), `set_effective_context` is a no-op, the tick
    /// period may be set once and only from the root context, callout upstreams are
    /// `host:port` (a malformed one traps).
    Nginx,
}

impl HostKind {
    /// A paused request can be resumed later from the tick (leaky-bucket waits).
    pub fn can_pause(self) -> bool {
        self == HostKind::Envoy
    }
}

/// Which host this is, from the root context.
///
/// ngx_wasm_module (0.1.0 through 0.6.0) crashes the worker (SIGSEGV in
/// `get_filter_name`, a NULL filter-chain entry) when the `plugin_name` property is read
/// from a root context outside `on_tick`: context creation, `on_vm_start`, `on_configure`,
/// a root callout's answer. It is never read here. Its `plugin_root_id` is safe and always
/// `"0"` (it formats an empty `ngx_str_t` with `%i`), which tells it apart: Envoy answers
/// the configured `root_id` (`diana` in every configuration of this repository; empty when
/// none is configured). An Envoy listener configured with `root_id: "0"` would be treated
/// as nginx: leaky-bucket waits become `Retry-After` there, nothing worse.
pub fn detect() -> HostKind {
    match hostcalls::get_property(vec!["plugin_root_id"]) {
        Ok(Some(root_id)) if root_id.as_slice() == b"0" => HostKind::Nginx,
        _ => HostKind::Envoy,
    }
}

/// True when `upstream` is `host:port` with a decimal port, as ngx_wasm_module needs it
/// (a malformed one traps inside `dispatch_http_call`, killing the request with a 500).
pub fn is_host_port(upstream: &str) -> bool {
    let Some((host, port)) = upstream.rsplit_once(':') else {
        return false;
    };
    !host.is_empty()
        && !port.is_empty()
        && port.bytes().all(|b| b.is_ascii_digit())
        && port.parse::<u16>().is_ok_and(|port| port > 0)
}

/// Makes `callout` (`dispatch_http_call`); the token, or why it was not sent. On nginx a
/// malformed `host:port` traps inside the host call, so it is checked first.
pub fn dispatch(host: HostKind, callout: &Callout) -> Result<u32, String> {
    if host == HostKind::Nginx && !is_host_port(&callout.upstream) {
        return Err(format!(
            "upstream {:?} is not host:port, which nginx needs",
            callout.upstream
        ));
    }
    let headers: Vec<(&str, &str)> = callout
        .headers
        .iter()
        .map(|(name, value)| (*name, value.as_str()))
        .collect();
    hostcalls::dispatch_http_call(
        &callout.upstream,
        headers,
        Some(&callout.body),
        vec![],
        Duration::from_millis(callout.timeout_ms),
    )
    .map_err(|status| format!("{status:?} (upstream {})", callout.upstream))
}

/// The host's account of a callout, in `on_http_call_response`: no headers means no
/// answer; a body larger than `max_body` (0: not wanted) is not read.
pub fn callout_reply(num_headers: usize, body_size: usize, max_body: usize) -> Reply {
    if num_headers == 0 {
        return Reply::NoAnswer;
    }
    let status = callout_status();
    let body = if body_size > max_body {
        None
    } else {
        match hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size) {
            Ok(body) => Some(body.unwrap_or_default()),
            Err(status) => {
                log::debug!("diana: callout body unreadable: {status:?}");
                None
            }
        }
    };
    Reply::Answered { status, body }
}

/// The `:status` of a callout's answer (0 when missing or unreadable).
pub fn callout_status() -> u16 {
    header_bytes(MapType::HttpCallResponseHeaders, ":status")
        .and_then(|s| std::str::from_utf8(&s).ok()?.trim().parse::<u16>().ok())
        .unwrap_or(0)
}

/// The host clock, read when a decision needs it.
pub struct HostClock;

impl Clock for HostClock {
    fn now(&self) -> Option<Nanos> {
        now()
    }
}

/// Host time in nanoseconds since the epoch; `None` when the host cannot tell (the engine
/// then writes nothing: a broken clock must not rewrite counters near the epoch).
pub fn now() -> Option<Nanos> {
    match hostcalls::get_current_time() {
        Ok(time) => time
            .duration_since(UNIX_EPOCH)
            .ok()
            .and_then(|d| u64::try_from(d.as_nanos()).ok())
            .filter(|&nanos| nanos > 0),
        Err(status) => {
            log::debug!("diana: host clock unavailable: {status:?}");
            None
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
///
/// Counts are kept in the worker and handed to the host in one `increment_metric` per
/// counter from the root context's tick ([`HostMetrics::flush`], at least once a second),
/// not one host call per event: a host call costs the request path as much as the rest
/// of a local rule's decision (BENCHMARKS.md, "Where the time goes"). So the host's
/// counters run behind by one tick at most; the filter's own metrics path flushes the
/// answering worker first, and nothing counted is lost (a policy replaced or a VM
/// stopped flushes when its metrics are dropped).
#[derive(Debug, Default)]
pub struct HostMetrics {
    /// Per rule, per [`RuleEvent`]: the index in `defined`.
    rules: Vec<[Option<usize>; 3]>,
    events: HashMap<Event, usize>,
    degraded: Option<u32>,
    /// Every metric defined, for the `metrics.path` answer and the flush.
    defined: Vec<Defined>,
}

#[derive(Debug)]
struct Defined {
    name: String,
    id: u32,
    gauge: bool,
    /// Counted in this worker and not yet handed to the host.
    unflushed: Cell<u64>,
}

impl HostMetrics {
    pub fn define<'a>(rules: impl Iterator<Item = &'a Rule>) -> HostMetrics {
        let mut defined = Vec::new();
        let mut define_named = |kind: MetricType, name: String| {
            let id = define(kind, &name)?;
            defined.push(Defined {
                name,
                id,
                gauge: kind == MetricType::Gauge,
                unflushed: Cell::new(0),
            });
            Some((defined.len() - 1, id))
        };
        let rules = rules
            .map(|rule| {
                RuleEvent::ALL.map(|event| {
                    define_named(
                        MetricType::Counter,
                        rule_metric_name(&rule.metric_name, event),
                    )
                    .map(|(index, _)| index)
                })
            })
            .collect();
        let events = Event::ALL
            .iter()
            .filter_map(|&event| {
                define_named(MetricType::Counter, event.name().to_string())
                    .map(|(index, _)| (event, index))
            })
            .collect();
        let degraded =
            define_named(MetricType::Gauge, DEGRADED_GAUGE.to_string()).map(|(_, id)| id);
        HostMetrics {
            rules,
            events,
            degraded,
            defined,
        }
    }

    /// Every metric's current value (summed over the workers by the host), in the
    /// Prometheus text format; this worker's counts are flushed first.
    pub fn exposition(&self) -> String {
        self.flush();
        let values: Vec<(&str, u64, bool)> = self
            .defined
            .iter()
            .map(|metric| {
                let value = hostcalls::get_metric(metric.id).unwrap_or_else(|status| {
                    log::debug!("diana: metric {}: {status:?}", metric.name);
                    0
                });
                (metric.name.as_str(), value, metric.gauge)
            })
            .collect();
        prometheus_text(values)
    }

    /// Only the process-wide counters (before any policy is accepted).
    pub fn events_only() -> HostMetrics {
        HostMetrics::define(std::iter::empty())
    }

    /// Hands this worker's counts to the host: one call per counter that moved.
    pub fn flush(&self) {
        for metric in &self.defined {
            let count = metric.unflushed.take();
            if count > 0 {
                if let Err(status) =
                    hostcalls::increment_metric(metric.id, i64::try_from(count).unwrap_or(i64::MAX))
                {
                    log::debug!("diana: metric {}: {status:?}", metric.name);
                }
            }
        }
    }

    fn count(&self, index: Option<usize>) {
        if let Some(metric) = index.and_then(|index| self.defined.get(index)) {
            metric
                .unflushed
                .set(metric.unflushed.get().saturating_add(1));
        }
    }
}

impl Drop for HostMetrics {
    fn drop(&mut self) {
        self.flush();
    }
}

/// A [`MetricSink`] over defined host metrics (defining is done once; reporting needs no
/// mutable state, so no borrow is ever held across a hostcall).
pub struct Sink<'a>(pub &'a HostMetrics);

impl MetricSink for Sink<'_> {
    fn rule_event(&mut self, rule: usize, event: RuleEvent) {
        let metrics = self.0;
        let slot = RuleEvent::ALL.iter().position(|&e| e == event).unwrap_or(0);
        metrics.count(
            metrics
                .rules
                .get(rule)
                .and_then(|indices| indices.get(slot).copied().flatten()),
        );
    }

    fn event(&mut self, event: Event) {
        self.0.count(self.0.events.get(&event).copied());
    }

    fn degraded(&mut self, on: bool) {
        if let Some(id) = self.0.degraded {
            if let Err(status) = hostcalls::record_metric(id, u64::from(on)) {
                log::debug!("diana: metric {id}: {status:?}");
            }
        }
    }
}
