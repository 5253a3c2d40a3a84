//! The worker's [`Host`] over Envoy's handles (`crate::envoy`): one event's view.
//!
//! - Shared data: process memory, one store for every Envoy worker thread of the process
//!   (what proxy-wasm's shared data is for every VM of a `vm_id`), with Envoy's CAS rules,
//!   read and written without a lock ([`SharedStore`]: a key is never freed, so the slot
//!   tables bound it as they bound Envoy's).
//! - Request facts, response headers: the current stream's filter, when the event has one.
//! - Calls: a worker-thread event's are callouts of its stream (a request's own call); a
//!   main-thread event's (the tick, an answer to the tick's calls) are callouts of the
//!   filter configuration, bound to no stream.
//! - Metrics: Envoy stats defined once per configuration (Envoy freezes metric creation
//!   after `on_http_filter_config_new`), by name, with the process-wide value kept beside
//!   them for `metrics.path`.

use crate::envoy::{EnvoyConfig, EnvoyFilter};
use crate::shared::SharedStore;
use diana_core::call::Callout;
use diana_core::facts::RequestFacts;
use diana_core::properties::client_ip_from_address;
use diana_core::store::{HostError, SetOutcome, SharedData};
use diana_core::time::{Clock, Instant};
use diana_core::worker::{CallToken, DispatchError, Host, MetricId, MetricKind};
use hashbrown::HashMap;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

/// The process's shared data (each configuration is handed it when it is made).
pub fn store() -> &'static SharedStore {
    static STORE: OnceLock<SharedStore> = OnceLock::new();
    STORE.get_or_init(SharedStore::default)
}

/// The wall clock in nanoseconds since the epoch (`None` when it cannot tell).
pub fn now() -> Option<Instant> {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .ok()
        .and_then(|since| u64::try_from(since.as_nanos()).ok())
        .filter(|&nanos| nanos > 0)
        .map(Instant::from_unix_nanos)
}

/// The status a breaker judges a response by: the one Envoy recorded for the stream
/// (`response.code`: the upstream's, as the router received it, or Envoy's own answer),
/// else its `:status` as it stands, read in place. Not a copy of the header map: the
/// recorded code is an integer Envoy keeps, a tenth of a header lookup's cost.
pub fn response_status(filter: &dyn EnvoyFilter) -> Option<u16> {
    filter.response_code().or_else(|| {
        let mut status = None;
        filter.read_response_header(":status", &mut |value| {
            status = value.and_then(diana_core::decision::status_code);
        });
        status
    })
}

/// One metric of a configuration: Envoy's id and the value summed over the workers.
struct Metric {
    kind: MetricKind,
    envoy: usize,
    value: AtomicU64,
}

/// A configuration's metrics, defined on the main thread in `on_http_filter_config_new`.
#[derive(Default)]
pub struct Metrics {
    by_name: Mutex<HashMap<String, MetricId>>,
    metrics: Mutex<Vec<Metric>>,
    frozen: std::sync::atomic::AtomicBool,
}

impl Metrics {
    /// Defines `name` in Envoy (only before [`Metrics::freeze`]), or finds it.
    fn define(&self, config: &dyn EnvoyConfig, kind: MetricKind, name: &str) -> Option<MetricId> {
        let mut by_name = self.by_name.lock().ok()?;
        if let Some(&id) = by_name.get(name) {
            return Some(id);
        }
        if self.frozen.load(Ordering::Acquire) {
            log::debug!("diana: metric {name} was not defined at configuration time; not counted");
            return None;
        }
        let envoy = config.define_metric(kind, name)?;
        let mut metrics = self.metrics.lock().ok()?;
        let id = MetricId::try_from(metrics.len()).ok()?;
        metrics.push(Metric {
            kind,
            envoy,
            value: AtomicU64::new(0),
        });
        by_name.insert(name.to_string(), id);
        Some(id)
    }

    /// No more definitions: Envoy refuses them after configuration.
    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::Release);
    }

    fn with<T>(&self, id: MetricId, f: impl FnOnce(&Metric) -> T) -> Option<T> {
        let metrics = self.metrics.lock().ok()?;
        metrics.get(usize::try_from(id).ok()?).map(f)
    }
}

/// The host as one event sees it.
pub struct NativeHost<'a> {
    pub config: &'a dyn EnvoyConfig,
    pub store: &'a SharedStore,
    pub metrics: &'a Metrics,
    /// The stream the event is for (none: the main thread, or a filter being destroyed).
    pub filter: Option<&'a dyn EnvoyFilter>,
    /// The event runs on the main thread: its calls are the configuration's callouts.
    pub main: bool,
    /// Calls dispatched during the event: Envoy's callout id and the worker's token.
    pub dispatched: RefCell<Vec<(u64, CallToken)>>,
    pub next_token: &'a Cell<CallToken>,
}

impl SharedData for NativeHost<'_> {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        self.store.get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<SetOutcome, HostError> {
        self.store.set(key, value, cas)
    }
}

impl RequestFacts for NativeHost<'_> {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.filter?.request_header(name)
    }

    fn client_ip(&self) -> Option<Vec<u8>> {
        self.filter?
            .source_address()
            .and_then(|address| client_ip_from_address(&address))
    }
}

impl Clock for NativeHost<'_> {
    fn now(&self) -> Option<Instant> {
        now()
    }
}

impl Host for NativeHost<'_> {
    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        self.filter?.response_header(name)
    }

    fn response_status(&self) -> Option<u16> {
        response_status(self.filter?)
    }

    fn dispatch(&self, callout: &Callout) -> Result<CallToken, DispatchError> {
        let sent = match (self.filter, self.main) {
            (Some(filter), _) => filter.callout(callout),
            (None, true) => self.config.callout(callout),
            (None, false) => {
                return Err(DispatchError::Refused {
                    upstream: callout.upstream.clone(),
                    status: "NoStream".to_string(),
                })
            }
        };
        let id = sent.map_err(|refused| DispatchError::Refused {
            upstream: callout.upstream.clone(),
            status: refused.to_string(),
        })?;
        let token = self.next_token.get().wrapping_add(1).max(1);
        self.next_token.set(token);
        if let Ok(mut dispatched) = self.dispatched.try_borrow_mut() {
            dispatched.push((id, token));
        }
        Ok(token)
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<MetricId> {
        self.metrics.define(self.config, kind, name)
    }

    fn add_to_metric(&self, metric: MetricId, count: u64) {
        let config = self.config;
        self.metrics.with(metric, |metric| {
            metric.value.fetch_add(count, Ordering::Relaxed);
            if !config.add_to_counter(metric.envoy, count) {
                log::debug!("diana: a counter was not incremented");
            }
        });
    }

    fn set_metric(&self, metric: MetricId, value: u64) {
        let config = self.config;
        self.metrics.with(metric, |metric| {
            metric.value.store(value, Ordering::Relaxed);
            if !config.set_gauge(metric.envoy, value) {
                log::debug!("diana: a gauge was not set");
            }
        });
    }

    fn metric_value(&self, metric: MetricId) -> u64 {
        self.metrics
            .with(metric, |metric| match metric.kind {
                MetricKind::Counter | MetricKind::Gauge => metric.value.load(Ordering::Relaxed),
            })
            .unwrap_or(0)
    }
}
