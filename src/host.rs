//! The proxy-wasm host behind the worker's [`Host`] trait, through `proxy_wasm::hostcalls`
//! only (the SDK's trait helpers unwrap host results). Header values are read as bytes: a
//! client's non-UTF-8 bytes must not reach a `String` getter.

use diana_core::call::{Answer, AnswerShape, Callout};
use diana_core::facts::{NoMetadata, RequestFacts};
use diana_core::properties::client_ip_from_address;
use diana_core::store::{HostCall, HostError, SetOutcome, SharedData};
use diana_core::time::{Clock, Instant};
use diana_core::worker::{CallToken, DispatchError, Host, HostProfile, MetricId, MetricKind};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, MapType, MetricType, Status};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, UNIX_EPOCH};

/// The host of this VM.
pub struct ProxyWasm;

/// Which host this is, from the root context's `on_configure`: ngx_wasm_module's
/// `plugin_root_id` is always `"0"` (safe to read, where `plugin_name` crashes its worker
/// from a root context), Envoy's the configured `root_id`. An Envoy listener with
/// `root_id: "0"` would be taken for nginx: leaky-bucket waits become `Retry-After`.
pub fn profile() -> HostProfile {
    let profile = match hostcalls::get_property(vec!["plugin_root_id"]) {
        Ok(Some(root_id)) if root_id.as_slice() == b"0" => HostProfile::NGINX,
        _ => HostProfile::ENVOY,
    };
    ON_ENVOY.store(profile == HostProfile::ENVOY, Ordering::Relaxed);
    profile
}

/// Whether this VM runs in Envoy (from [`profile`]): only Envoy has dynamic metadata, and
/// nginx is never asked for it (its properties are not Envoy's).
static ON_ENVOY: AtomicBool = AtomicBool::new(false);

/// The plugin configuration (the Diana document).
pub fn configuration(size: usize) -> Result<Vec<u8>, Status> {
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size).map(Option::unwrap_or_default)
}

/// The answer to a call, from `on_http_call_response`: none when it came without headers
/// (timeout, reset, refused connection), else the headers and body `shape` names, read
/// one by one (the SDK's whole-map reader panics on what a peer may send).
pub fn call_answer(shape: AnswerShape, headers: usize, body_size: usize) -> Answer {
    if headers == 0 {
        return Answer::NoAnswer;
    }
    let headers = shape.headers.iter().filter_map(|name| {
        header(MapType::HttpCallResponseHeaders, name).map(|value| (name.to_string(), value))
    });
    let body = Answer::read_body(shape, body_size, || {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .map(Option::unwrap_or_default)
            .map_err(|status| HostError::refused(HostCall::CallBody, "", status))
    });
    Answer::from_host(headers, body)
}

/// The chunk of the answer's body `on_http_response_body` was entered for (`size` bytes:
/// the filter returns `Continue`, so the host's buffer holds only the current chunk).
/// Empty when the host refuses it: the reader then misses those bytes, and reads the
/// body as malformed or cut, which keeps the reservation.
pub fn response_body(size: usize) -> Vec<u8> {
    if size == 0 {
        return Vec::new();
    }
    hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size)
        .map(Option::unwrap_or_default)
        .unwrap_or_else(|status| {
            log::debug!("diana: response body unreadable: {status:?}");
            Vec::new()
        })
}

fn header(map: MapType, name: &str) -> Option<Vec<u8>> {
    hostcalls::get_map_value_bytes(map, name).unwrap_or_else(|status| {
        log::debug!("diana: header {name} unreadable: {status:?}");
        None
    })
}

impl SharedData for ProxyWasm {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(value), cas)) => Ok(Some((value, cas.unwrap_or(0)))),
            Ok((None, _)) => Ok(None),
            Err(status) => Err(HostError::refused(HostCall::GetSharedData, key, status)),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<SetOutcome, HostError> {
        // No value releases the key (nginx deletes it; Envoy keeps it empty).
        let value = (!value.is_empty()).then_some(value);
        match hostcalls::set_shared_data(key, value, Some(cas)) {
            Ok(()) => Ok(SetOutcome::Written),
            Err(Status::CasMismatch) => Ok(SetOutcome::CasMismatch),
            Err(status) => Err(HostError::refused(HostCall::SetSharedData, key, status)),
        }
    }
}

impl RequestFacts for ProxyWasm {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        header(MapType::HttpRequestHeaders, name)
    }

    fn client_ip(&self) -> Option<Vec<u8>> {
        match hostcalls::get_property(vec!["source", "address"]) {
            Ok(value) => value.and_then(|value| client_ip_from_address(&value)),
            Err(status) => {
                log::debug!("diana: source.address unavailable: {status:?}");
                None
            }
        }
    }

    /// Envoy walks `metadata.filter_metadata[namespace]` and `path` (CEL values: a
    /// `Struct` is a map, a list takes an index) and returns the leaf serialised
    /// (`serializeValue` in Envoy's source/extensions/common/wasm/context.cc): a string's
    /// bytes, a number's eight bytes, a boolean's one. Not found: `None`; a `null` leaf
    /// (SerializationFailure) or a host failure: `None`, logged at debug.
    fn filter_metadata(
        &self,
        namespace: &str,
        path: &[&str],
    ) -> Result<Option<Vec<u8>>, NoMetadata> {
        if !ON_ENVOY.load(Ordering::Relaxed) {
            return Err(NoMetadata);
        }
        let mut property = vec!["metadata", "filter_metadata", namespace];
        property.extend_from_slice(path);
        match hostcalls::get_property(property) {
            Ok(value) => Ok(value),
            Err(status) => {
                log::debug!("diana: metadata {namespace} {path:?} unreadable: {status:?}");
                Ok(None)
            }
        }
    }
}

/// `None` when the host cannot tell (the engine then writes nothing: a broken clock must
/// not rewrite counters near the epoch).
impl Clock for ProxyWasm {
    fn now(&self) -> Option<Instant> {
        match hostcalls::get_current_time() {
            Ok(time) => time
                .duration_since(UNIX_EPOCH)
                .ok()
                .and_then(|since| u64::try_from(since.as_nanos()).ok())
                .filter(|&nanos| nanos > 0)
                .map(Instant::from_unix_nanos),
            Err(status) => {
                log::debug!("diana: host clock unavailable: {status:?}");
                None
            }
        }
    }
}

impl Host for ProxyWasm {
    fn response_header(&self, name: &str) -> Option<Vec<u8>> {
        header(MapType::HttpResponseHeaders, name)
    }

    fn dispatch(&self, callout: &Callout) -> Result<CallToken, DispatchError> {
        let headers: Vec<(&str, &str)> = callout
            .headers
            .iter()
            .map(|(name, value)| (*name, value.as_str()))
            .collect();
        let body = (!callout.body.is_empty()).then_some(callout.body.as_slice());
        let timeout = Duration::from_millis(callout.timeout_ms);
        hostcalls::dispatch_http_call(&callout.upstream, headers, body, vec![], timeout).map_err(
            |status| DispatchError::Refused {
                upstream: callout.upstream.clone(),
                status: format!("{status:?}"),
            },
        )
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<MetricId> {
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Gauge => MetricType::Gauge,
        };
        hostcalls::define_metric(kind, name)
            .map_err(|status| log::warn!("diana: cannot define metric {name}: {status:?}"))
            .ok()
    }

    fn add_to_metric(&self, metric: MetricId, count: u64) {
        let count = i64::try_from(count).unwrap_or(i64::MAX);
        if let Err(status) = hostcalls::increment_metric(metric, count) {
            log::debug!("diana: metric {metric}: {status:?}");
        }
    }

    fn set_metric(&self, metric: MetricId, value: u64) {
        if let Err(status) = hostcalls::record_metric(metric, value) {
            log::debug!("diana: metric {metric}: {status:?}");
        }
    }

    fn metric_value(&self, metric: MetricId) -> u64 {
        hostcalls::get_metric(metric).unwrap_or_else(|status| {
            log::debug!("diana: metric {metric}: {status:?}");
            0
        })
    }
}
