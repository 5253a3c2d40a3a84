//! What the worker needs from its host: the synchronous services behind one trait
//! ([`Host`]), and how hosts differ, as a value ([`HostProfile`]) rather than branches in
//! each binding.

use crate::breaker::Transition;
use crate::call::{Callout, DispatchError};
use crate::facts::{BearerScheme, NoMetadata, RequestFacts};
use crate::store::SharedData;
use crate::time::{Clock, Instant};
use crate::usage::JsonPath;

/// The host's id of an HTTP context (one request).
pub type ContextId = u32;

/// The host's token for a call it dispatched; its answer comes back with it.
pub type CallToken = u32;

/// The host's id of a metric it defined.
pub type MetricId = u32;

/// What a metric is, for the host to define it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
}

/// Everything the host provides synchronously, each through a call that reports failure
/// rather than trapping: shared data with compare-and-swap, the current request's facts,
/// the clock, the current response's headers, dispatching calls and metrics. (A call's
/// answer is not read through here: the binding hands it over whole, as an
/// [`crate::call::Answer`].) What changes a request's stream (resume, local reply, headers) is
/// not here: the worker returns it as a [`super::Command`], carried out once the worker
/// is no longer borrowed (a local reply re-enters the filter at once on Envoy).
pub trait Host: SharedData + RequestFacts + Clock {
    /// A header of the current response, as bytes (`None`: absent or unreadable).
    fn response_header(&self, name: &str) -> Option<Vec<u8>>;
    /// The current response's status, as a breaker judges it (`None`: unreadable): its
    /// `:status`, unless the host records the status apart (Envoy's `response.code`, what
    /// the upstream answered or Envoy itself did) and can tell it for less.
    fn response_status(&self) -> Option<u16> {
        self.response_header(":status")
            .as_deref()
            .and_then(crate::decision::status_code)
    }
    /// Sends `callout`; its answer is delivered with the returned token.
    fn dispatch(&self, callout: &Callout) -> Result<CallToken, DispatchError>;
    /// Defines a metric (`None`: the host refused; its events are then not counted).
    fn define_metric(&self, kind: MetricKind, name: &str) -> Option<MetricId>;
    /// Adds `count` to a counter.
    fn add_to_metric(&self, metric: MetricId, count: u64);
    /// Sets a gauge.
    fn set_metric(&self, metric: MetricId, value: u64);
    /// A metric's value as the host keeps it (summed over the workers).
    fn metric_value(&self, metric: MetricId) -> u64;
    /// A breaker (`breaker`: its index among the policy's breakers) changed state at `at`,
    /// handed over with the metrics. Gateways log the transition instead and keep nothing
    /// here; the simulated gateway keeps them as data (one source: the log line is
    /// rendered from the same [`Transition`]).
    fn breaker_transition(&self, _breaker: usize, _at: Instant, _transition: &Transition) {}
}

/// How a host behaves, where hosts differ. Each binding passes one; the worker does the
/// rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostProfile {
    /// Its name in log lines.
    pub name: &'static str,
    /// A paused request can be resumed later from another context (the tick, another
    /// request's call answer): leaky-bucket waits and parking behind another request's
    /// call are possible.
    pub resumes_from_other_contexts: bool,
    /// After a request's own call is answered, the host resumes it by itself (nginx) —
    /// otherwise the filter must resume it (Envoy).
    pub resumes_after_own_call: bool,
    /// The tick period may be set from any context, any number of times (Envoy). Otherwise
    /// it is set once, from configuration, and never to zero (nginx: zero re-arms at once,
    /// a busy loop; a period set from a request traps).
    pub tick_settable_anywhere: bool,
    /// Call upstreams must be `host:port` (nginx) rather than cluster names.
    pub upstreams_are_host_port: bool,
    /// The host appends a line feed to every local reply's body (ngx_wasm_module).
    pub appends_line_feed_to_replies: bool,
    /// Shared data's compare-and-swap rule: a CAS of 0 is not "unconditional" (nginx),
    /// so every write reads first ([`crate::store::Store::strict`]).
    pub strict_compare_and_swap: bool,
    /// Refusing the configuration stops the worker for good (nginx: `exited with fatal
    /// code 2 and cannot be respawned`, while the master keeps the port open and every
    /// request hangs). There the worker accepts it and answers requests with
    /// `on_invalid_config` instead.
    pub refusal_stops_the_worker: bool,
    /// The host holds a paused request only with this directive in its configuration
    /// (ngx_wasm_module: `proxy_wasm_request_headers_in_access on;`). Without it the host
    /// runs a later request of a keep-alive connection on while it is paused for its call,
    /// and its worker crashes when the call answers; nothing the filter can read before
    /// pausing tells (every property and variable, and the order of callbacks, are the
    /// same either way). What shows it is a request deleted while its own call is in
    /// flight, which with the directive does not happen (the client of a paused request is
    /// not even read): the worker then keeps every worker from pausing for
    /// [`super::UNHELD_FOR`] (`worker/unheld.rs`).
    pub pausing_needs: Option<&'static str>,
    /// Shared data exists only with a zone in the host's configuration (ngx_wasm_module: a
    /// `shm_kv` zone for Diana's `diana/...` keys, or the default `shm_kv *`), and without
    /// one the first access traps inside the host call; no host call tells beforehand.
    /// There the binding calls [`super::Worker::probe_shared_data_first`], so that the first
    /// access happens in a request or a tick, where a trap costs that request, not the
    /// worker's start (`worker/configure.rs`).
    pub shared_data_needs_zone: bool,
    /// How the token verifier in front of Diana here finds the bearer token, which is how
    /// Diana reads a claim of the `authorization` header ([`crate::jwt::bearer`]): on
    /// Envoy its `jwt_authn` filter (`Bearer ` as written), in front of nginx the scheme
    /// in any case too.
    pub bearer: BearerScheme,
    /// Claims can be read from the payload `jwt_authn` verified (`from: {jwt_authn:
    /// NAME}`): Envoy's wasm filter. Envoy's dynamic modules read metadata one level deep
    /// only, and nginx has no jwt_authn.
    pub jwt_authn_metadata: bool,
    /// The binding runs the tick soon after an event asks ([`super::Command::TickNow`]),
    /// cheaper than a period's wait: Envoy's dynamic modules, whose tick runs on the main
    /// thread and is posted there at once. Elsewhere the tick runs only on its period (the
    /// finest is 1 ms on proxy-wasm).
    pub ticks_on_demand: bool,
    /// A request header the filter removes still reaches the upstream: ngx_wasm_module
    /// only marks it (its hash set to 0), and nginx's proxy module sends every header of
    /// the request without looking at the mark, nor matching a marked one against
    /// `proxy_set_header`. There a header is cleared by setting it empty instead, which
    /// keeps the entry's name: `proxy_set_header NAME $http_NAME;` then replaces it with
    /// its empty value, and nginx sends no header with an empty value (nginx/README.md).
    pub removed_headers_reach_upstream: bool,
    /// A request can be held at its headers until its body has been read, then decided
    /// (`reserve.json`): Envoy's dynamic modules stop header iteration alone
    /// (`StopIteration`), get the body, and buffer it (`StopIterationAndBuffer`, up to
    /// the buffer limit, past which Envoy answers 413 itself). Not on proxy-wasm: Envoy's
    /// wasm host turns a paused request's `StopIteration` into `StopAllIteration` (no body
    /// reaches the filter until it resumes, and resuming sends the headers on), and
    /// ngx_wasm_module hands a filter the request body only in nginx's content phase,
    /// after the access phase where Diana decides. There a request reserves its
    /// `reserve.default`.
    pub holds_requests_for_bodies: bool,
    /// The binding keeps a request's breaker calls itself when judging them is all the
    /// worker would keep it for ([`super::Watch`], handed over in [`super::Step::watch`]),
    /// and counts a closed breaker's good call in the breaker's tap at its response headers
    /// without the worker: Envoy's dynamic modules, whose worker of a thread sits behind a
    /// lock that the main thread takes too (for its tick), so that a request through a
    /// closed breaker takes it once, at its request headers, as a request through no breaker
    /// does. On proxy-wasm a worker is its VM's alone (no lock to spare), and a response
    /// event that finds no request in the worker costs about what one that judges does.
    pub keeps_breaker_calls: bool,
}

impl HostProfile {
    /// Envoy, and any proxy-wasm-cpp-host.
    pub const ENVOY: HostProfile = HostProfile {
        name: "envoy",
        resumes_from_other_contexts: true,
        resumes_after_own_call: false,
        tick_settable_anywhere: true,
        upstreams_are_host_port: false,
        appends_line_feed_to_replies: false,
        strict_compare_and_swap: false,
        refusal_stops_the_worker: false,
        pausing_needs: None,
        shared_data_needs_zone: false,
        bearer: BearerScheme::AsWritten,
        jwt_authn_metadata: true,
        ticks_on_demand: false,
        removed_headers_reach_upstream: false,
        keeps_breaker_calls: false,
        holds_requests_for_bodies: false,
    };

    /// Envoy's dynamic modules (`crates/diana-envoy-native`): the same rules as proxy-wasm
    /// on Envoy. A paused request is resumed from another context through its own scheduler
    /// (a scheduled event), a request's own call answers in its own filter, which resumes it.
    pub const ENVOY_NATIVE: HostProfile = HostProfile {
        name: "envoy-native",
        ticks_on_demand: true,
        jwt_authn_metadata: false,
        holds_requests_for_bodies: true,
        keeps_breaker_calls: true,
        ..HostProfile::ENVOY
    };

    /// ngx_wasm_module (nginx, Kong, OpenResty): resuming a request from `on_tick` crashes
    /// the worker (its request context is NULL there) and `set_effective_context` is a
    /// no-op; the request is resumed by the host once its last call is answered.
    pub const NGINX: HostProfile = HostProfile {
        name: "ngx_wasm_module",
        resumes_from_other_contexts: false,
        resumes_after_own_call: true,
        tick_settable_anywhere: false,
        upstreams_are_host_port: true,
        appends_line_feed_to_replies: true,
        strict_compare_and_swap: true,
        refusal_stops_the_worker: true,
        pausing_needs: Some("proxy_wasm_request_headers_in_access on;"),
        shared_data_needs_zone: true,
        bearer: BearerScheme::AnyCase,
        jwt_authn_metadata: false,
        ticks_on_demand: false,
        removed_headers_reach_upstream: true,
        keeps_breaker_calls: false,
        holds_requests_for_bodies: false,
    };

    /// Every host's rules, for tests that run every scenario under each.
    pub const ALL: [HostProfile; 3] = [
        HostProfile::ENVOY,
        HostProfile::ENVOY_NATIVE,
        HostProfile::NGINX,
    ];
}

/// The current request's facts as the engine reads them: the host's, with a bearer token
/// read as this host's verifier reads it ([`HostProfile::bearer`]).
pub(crate) struct ProfiledFacts<'h> {
    pub host: &'h dyn Host,
    pub bearer: BearerScheme,
}

impl RequestFacts for ProfiledFacts<'_> {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.host.header(name)
    }

    fn client_ip(&self) -> Option<Vec<u8>> {
        self.host.client_ip()
    }

    fn filter_metadata(
        &self,
        namespace: &str,
        path: &[&str],
    ) -> Result<Option<Vec<u8>>, NoMetadata> {
        self.host.filter_metadata(namespace, path)
    }

    fn bearer_scheme(&self) -> BearerScheme {
        self.bearer
    }
}

/// A request's facts with the numbers its body had at the paths its rules reserve from
/// (`reserve.json`), once the worker read it.
pub(crate) struct BodyFacts<'f> {
    pub facts: &'f dyn RequestFacts,
    pub numbers: &'f [(JsonPath, Option<u64>)],
}

impl RequestFacts for BodyFacts<'_> {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.facts.header(name)
    }

    fn client_ip(&self) -> Option<Vec<u8>> {
        self.facts.client_ip()
    }

    fn filter_metadata(
        &self,
        namespace: &str,
        path: &[&str],
    ) -> Result<Option<Vec<u8>>, NoMetadata> {
        self.facts.filter_metadata(namespace, path)
    }

    fn bearer_scheme(&self) -> BearerScheme {
        self.facts.bearer_scheme()
    }

    fn body_number(&self, path: &JsonPath) -> Option<u64> {
        self.numbers
            .iter()
            .find(|(read, _)| read == path)
            .and_then(|(_, number)| *number)
    }
}

/// True when `upstream` is `host:port` with a decimal port.
pub fn is_host_port(upstream: &str) -> bool {
    let Some((host, port)) = upstream.rsplit_once(':') else {
        return false;
    };
    !host.is_empty()
        && !port.is_empty()
        && port.bytes().all(|b| b.is_ascii_digit())
        && port.parse::<u16>().is_ok_and(|port| port > 0)
}

#[cfg(test)]
mod tests {
    use super::is_host_port;

    #[test]
    fn host_port_needs_a_host_and_a_decimal_port() {
        for (upstream, ok) in [
            ("127.0.0.1:8080", true),
            ("quota.internal:1", true),
            ("[::1]:80", true),
            ("diana_quota", false),
            (":80", false),
            ("host:", false),
            ("host:0", false),
            ("host:65536", false),
            ("host:8o", false),
        ] {
            assert_eq!(is_host_port(upstream), ok, "{upstream}");
        }
    }
}
