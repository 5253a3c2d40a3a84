//! Where a worker's configuration comes from: the local document (`on_configure`), and the
//! config center's, polled by one worker per period and shared with the others through
//! shared data (DESIGN §6: a remote document is judged against the local one).
//!
//! On nginx the local document is installed only once shared data is known to work
//! ([`Zone`]): ngx_wasm_module has shared data only with a `shm_kv` zone, and without one
//! it traps inside the first access (`failed getting value from shm (could not resolve
//! namespace)`, `ngx_wa_shm_kv_resolve_key` declining, for every key and namespace), and
//! no host call tells beforehand. A trap in `on_configure` makes the worker exit for good
//! (`exited with fatal code 2 and cannot be respawned`, and every request hangs); a trap
//! in a request or a tick costs that request (a 500) and the instance, which the module
//! replaces at the next request or tick, running `on_configure` again in a new instance
//! (without `on_vm_start`). So the first access waits for the first request or tick, and
//! a gauge written just before it ([`PROBE_GAUGE`]: the host's metrics are shared memory
//! that outlives the instance) tells the next instance that it trapped: that one answers
//! `on_invalid_config` and logs the `shm_kv` directive to add, with the size `diana
//! check` prints.

use super::counters::Counters;
use super::{Command, Configured, Flight, Host, HostProfile, MetricId, MetricKind, Step, Worker};
use crate::call::{Answer, AnswerShape, BodyError, Callout, DispatchError};
use crate::config::RemoteError;
use crate::config::{parse_policy, MetricsSpec, OnInvalidConfig, Policy, RemoteSpec};
use crate::engine::Engine;
use crate::facts::BearerScheme;
use crate::lifecycle;
use crate::metrics::Event;
use crate::nginx;
use crate::remote::{self, PollBody, PollFailure, PollOutcome};
use crate::store::identity;
use crate::store::HostError;
use crate::time::{Instant, Nanos};
use std::cell::Cell;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The least time between two config-center checks (a little less than the base tick: a
/// tick that lands early must still count, or a worker skips every other one).
const REMOTE_CHECK_SPACING: Nanos = Nanos::from_millis(750);
/// What of a config center's answer is read.
pub(super) const POLL_ANSWER: AnswerShape = AnswerShape {
    headers: &[":status", "etag", remote::SIGNATURE_HEADER],
    max_body: remote::MAX_DOCUMENT_BYTES,
};
/// How long a config-center poll may take.
const POLL_TIMEOUT: Duration = Duration::from_secs(5);

/// The documents a worker runs.
#[derive(Default)]
pub(super) struct Source {
    /// The config center, from the local document (a remote document moves it only if
    /// the local one's `remote.allow` names `remote`).
    pub(super) remote: Option<RemoteSpec>,
    /// The local document: what a remote one is judged against.
    local: Option<Arc<Policy>>,
    /// The metrics path, from the local document too (a remote document cannot move it).
    metrics: Option<MetricsSpec>,
    /// Version of the published remote document this worker runs (0: the local one).
    applied_version: u64,
    next_check: Instant,
    /// A poll is in flight.
    polling: bool,
    /// On hosts where the tick may be set once: it was.
    tick_fixed: bool,
    /// Whether shared data may be used (always, but on nginx before a probe).
    zone: Zone,
}

/// Whether this instance may use shared data (see the module docs).
#[derive(Default)]
enum Zone {
    /// It works (every host but nginx; on nginx once this instance's probe passed).
    #[default]
    Ready,
    /// Not known yet: the first request or tick probes it, then installs `pending`.
    Unprobed {
        marker: Option<MetricId>,
        pending: Option<Box<Policy>>,
    },
    /// An earlier instance trapped probing it: there is no zone. Requests get
    /// `on_invalid_config`; shared data is never touched.
    Missing,
}

/// What [`Worker::shared_data_ready`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ZoneCheck {
    /// Shared data may be used.
    Usable,
    /// The probe passed just now and the document was installed: shared data may be used,
    /// and the tick leaves its own work to the next one, as when `configure` installs it
    /// (the first config-center poll a period after the document is applied).
    Installed,
    /// No zone, or nothing installed: shared data must not be touched.
    Unusable,
}

/// The gauge a probe writes before and after its access: one for every worker process
/// (a gauge reads as the value written last, by any worker). The workers of one nginx
/// configuration share one zone set-up, so their probes all pass or all trap; a new
/// configuration's workers start fresh and do not read it (module docs).
const PROBE_GAUGE: &str = "diana_host_shm_kv_probe";
/// The gauge's values: a probe started (and, read by a later instance, trapped), passed.
const PROBE_STARTED: u64 = 1;
const PROBE_PASSED: u64 = 2;

/// The key the probe reads: any `diana/...` key resolves to the same zone (or to none).
const PROBE_KEY: &str = "diana/host/zone";

/// A refused document's `on_invalid_config`, read leniently (a typo elsewhere in the
/// document does not hide it); deny when it cannot be read.
pub fn on_invalid_config_of(document: &[u8]) -> OnInvalidConfig {
    std::str::from_utf8(document)
        .ok()
        .and_then(|text| serde_yaml::from_str::<serde_yaml::Value>(text).ok())
        .and_then(|value| {
            serde_yaml::from_value::<OnInvalidConfig>(value.get("on_invalid_config")?.clone()).ok()
        })
        .unwrap_or_default()
}

/// What a request gets from a worker without a usable configuration (`None`: through).
pub(super) fn invalid_reply(on_invalid: OnInvalidConfig) -> Option<super::LocalReply> {
    match on_invalid {
        OnInvalidConfig::Allow => None,
        OnInvalidConfig::Deny => Some(super::LocalReply {
            status: 503,
            headers: vec![("content-type", "text/plain".to_string())],
            body: "service unavailable\n".to_string(),
        }),
    }
}

/// For the log line: what requests get meanwhile.
fn meanwhile(on_invalid: OnInvalidConfig) -> &'static str {
    match on_invalid {
        OnInvalidConfig::Deny => "answered 503 (on_invalid_config: deny)",
        OnInvalidConfig::Allow => "let through unlimited (on_invalid_config: allow)",
    }
}

/// Why a local document was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    NotUtf8,
    Invalid(crate::config::ConfigError),
}

/// Why a poll of the config center brought no document in: the center counts as failing
/// (logged once when it turns so, with this reason).
#[derive(Debug)]
enum PollProblem {
    NotSent(DispatchError),
    UnreadableBody(HostError),
    /// A document that was not valid, or that the local one does not let in.
    Document(RemoteError),
    Failed(PollFailure),
}

impl fmt::Display for PollProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PollProblem::NotSent(error) => write!(f, "poll not sent: {error}"),
            PollProblem::UnreadableBody(error) => write!(f, "unreadable body: {error}"),
            PollProblem::Document(reason) => reason.fmt(f),
            PollProblem::Failed(failure) => failure.fmt(f),
        }
    }
}

impl std::error::Error for Refused {}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::NotUtf8 => f.write_str("configuration is not UTF-8"),
            Refused::Invalid(error) => error.fmt(f),
        }
    }
}

impl Worker {
    /// The host's configuration for this worker (the local document). A refused document
    /// is logged with its position and counted; the worker keeps what it ran.
    pub fn configure(&mut self, host: &dyn Host, document: &[u8]) -> Result<Step, Refused> {
        let events = self
            .events
            .get_or_insert_with(|| Counters::define(host, std::iter::empty(), std::iter::empty()));
        let parsed = std::str::from_utf8(document)
            .map_err(|_| Refused::NotUtf8)
            .and_then(|text| parse_policy(text).map_err(Refused::Invalid));
        let policy = match parsed {
            Ok(policy) => policy,
            Err(refused) if self.profile.refusal_stops_the_worker && self.configured.is_none() => {
                let on_invalid = on_invalid_config_of(document);
                log::error!(
                    "diana: configuration rejected: {refused}; requests Diana sees are {} until it is fixed",
                    meanwhile(on_invalid)
                );
                events.event(Event::ConfigRejected);
                events.flush(host);
                self.invalid = Some(on_invalid);
                return Ok(Step::default());
            }
            Err(refused) => {
                log::error!("diana: configuration rejected: {refused}");
                events.event(Event::ConfigRejected);
                events.flush(host);
                return Err(refused);
            }
        };
        if matches!(self.source.zone, Zone::Missing) {
            let on_invalid = policy.on_invalid_config;
            log::error!(
                "diana: no shared data: nginx's `wasm {{ }}` block has no `shm_kv` zone for Diana's keys (diana/...), and ngx_wasm_module traps on every access (\"could not resolve namespace\"): add `{}` to it (the size `diana check` prints for this document) and reload; requests Diana sees are {} until then",
                nginx::directive(&policy),
                meanwhile(on_invalid)
            );
            self.invalid = Some(on_invalid);
            return Ok(Step::default());
        }
        self.invalid = None;
        warn_if_unsigned(&policy);
        if !self.profile.resumes_from_other_contexts {
            log::info!(
                "diana: {}: leaky-bucket waits become Retry-After (local) or are done by the quota service (global)",
                self.profile.name
            );
        }
        let holds_places = policy.holds_global_places();
        let fleet_breakers = policy.has_fleet_breakers();
        self.source.remote = policy.remote.clone();
        self.source.local = Some(Arc::new(policy.clone()));
        self.source.metrics = policy.metrics.clone();
        self.source.applied_version = 0;
        if let Zone::Unprobed { pending, .. } = &mut self.source.zone {
            // Installed by the first request or tick; the tick an installed policy needs
            // (`wanted_base_tick`) is known without shared data.
            *pending = Some(Box::new(policy));
            self.base_tick = super::BASE_TICK;
        } else {
            self.install_local(host, policy);
            self.base_tick = self.wanted_base_tick(host);
        }
        let mut step = Step::default();
        if self.profile.tick_settable_anywhere {
            self.retick(&mut step);
        } else if !self.source.tick_fixed && !self.base_tick.is_zero() {
            // Once, from the root context, and never zero; finer where places go back from
            // it or a breaker of `scope: global` reports from it (a policy from the config
            // center later keeps this period).
            let period = if holds_places {
                super::PLACES_TICK
            } else if fleet_breakers {
                super::FLEET_TICK
            } else {
                self.base_tick
            };
            self.source.tick_fixed = true;
            self.tick = Some(period);
            step.commands.push(Command::SetTick(period));
        }
        Ok(step)
    }

    /// On a host whose shared data needs a zone ([`HostProfile::shared_data_needs_zone`]),
    /// before [`Worker::configure`]: the document then waits for the first request or tick,
    /// which probes shared data first (module docs). `fresh`: the host started this
    /// instance with its worker process (`on_vm_start` came first): whatever the gauge
    /// holds comes from an earlier configuration (the host's metrics outlive a reload), and
    /// this instance probes. Otherwise the host made this instance after one trapped (or
    /// makes one per request): a probe left started means it trapped there, so there is no
    /// zone; anything else, and it probes again (one host call).
    ///
    /// [`HostProfile::shared_data_needs_zone`]: super::HostProfile::shared_data_needs_zone
    pub fn probe_shared_data_first(&mut self, host: &dyn Host, fresh: bool) {
        if !self.profile.shared_data_needs_zone {
            return;
        }
        let marker = host.define_metric(MetricKind::Gauge, PROBE_GAUGE);
        let trapped =
            !fresh && marker.is_some_and(|marker| host.metric_value(marker) == PROBE_STARTED);
        self.source.zone = if trapped {
            Zone::Missing
        } else {
            Zone::Unprobed {
                marker,
                pending: None,
            }
        };
    }

    /// Before a request or a tick uses shared data: whether it may. The first one on a
    /// worker that has not probed it yet does (on nginx without a zone, the instance traps
    /// right there), then installs the document `configure` kept for it.
    pub(super) fn shared_data_ready(&mut self, host: &dyn Host) -> ZoneCheck {
        let (marker, pending) = match &mut self.source.zone {
            Zone::Ready => return ZoneCheck::Usable,
            Zone::Missing | Zone::Unprobed { pending: None, .. } => return ZoneCheck::Unusable,
            Zone::Unprobed { marker, pending } => (*marker, pending.take()),
        };
        if let Some(marker) = marker {
            host.set_metric(marker, PROBE_STARTED);
        }
        // Without a zone ngx_wasm_module traps inside this call: this instance ends here,
        // and the next one finds PROBE_STARTED.
        if let Err(error) = host.get(PROBE_KEY) {
            log::debug!("diana: {error}");
        }
        if let Some(marker) = marker {
            host.set_metric(marker, PROBE_PASSED);
        }
        self.source.zone = Zone::Ready;
        if let Some(policy) = pending {
            self.install_local(host, *policy);
        }
        ZoneCheck::Installed
    }

    /// Makes `policy` the one new requests are evaluated with.
    fn install(&mut self, host: &dyn Host, mut policy: Policy, origin: &str) {
        if !self.claims_warned {
            if let Some(warning) = unverified_claims_warning(&policy, self.profile) {
                log::warn!("{warning}");
                self.claims_warned = true;
            }
        }
        if !self.profile.holds_requests_for_bodies {
            if let Some(warning) = crate::config::body_warning(&policy) {
                log::warn!("{warning}");
            }
        }
        policy.metrics = self.source.metrics.clone();
        // Identities keyed with the process's random key when the document sets no
        // identity_key; one warning when global rules hash with the public key.
        identity::prepare(&mut policy, &self.store, host);
        let dropped = lifecycle::adopt(&self.store, host, &policy);
        if dropped > 0 {
            log::info!("diana: {dropped} rules left the configuration; their records are released");
        }
        let mut engine =
            Engine::new(policy).resuming_elsewhere(self.profile.resumes_from_other_contexts);
        if let Some(now) = host.now() {
            engine = engine.installed_at(now);
        }
        let counters = Counters::define(host, engine.rules(), engine.policy().breakers());
        log::info!(
            "diana: {origin} configuration applied: {} resources, {} rules",
            engine.policy().resources.len(),
            engine.rules().count()
        );
        if let Some(events) = &self.events {
            events.event(Event::ConfigReload);
        }
        self.generations += 1;
        let serves_metrics = engine.policy().metrics.is_some();
        let configured = Configured {
            generation: self.generations,
            engine,
            counters,
            serves_metrics,
            usage_logged: Cell::new(false),
        };
        if let Some(replaced) = self.configured.replace(configured) {
            replaced.engine.retire();
            self.retired.push(replaced);
        }
    }

    fn count(&self, event: Event) {
        if let Some(events) = &self.events {
            events.event(event);
        }
    }

    /// From the tick: adopts what another worker published, and polls if this worker
    /// claims this period's poll.
    pub(super) fn check_remote(&mut self, host: &dyn Host, now: Instant) {
        let Some(spec) = self.source.remote.clone() else {
            return;
        };
        if now < self.source.next_check {
            return;
        }
        self.source.next_check = now.saturating_add(REMOTE_CHECK_SPACING);
        self.adopt_published(host);
        self.poll(host, &spec, now);
    }

    /// Installs the local document, then the config center's where one is published: a
    /// worker that starts while the other workers already run a config-center document (it
    /// started later, or the host made it again) runs that one at once, not the local one
    /// until its first tick, in which its breakers' settings (an older `force`) could reach
    /// the shared records.
    fn install_local(&mut self, host: &dyn Host, policy: Policy) {
        self.install(host, policy, "local");
        if self.source.remote.is_some() {
            self.adopt_published(host);
        }
    }

    /// Applies a remote document that any worker published and this one does not run yet.
    fn adopt_published(&mut self, host: &dyn Host) {
        if remote::published_version(&self.store, host) <= self.source.applied_version {
            return;
        }
        let Some(published) = remote::read_published(&self.store, host) else {
            return;
        };
        if published.version <= self.source.applied_version {
            return;
        }
        self.source.applied_version = published.version;
        let Some(local) = self.source.local.clone() else {
            return;
        };
        match remote::adopt(&published, &local) {
            Ok(policy) => self.install_remote(host, policy, published.version),
            Err(error) => {
                log::error!("diana: published {error}; keeping the current configuration")
            }
        }
    }

    /// Installs a remote document, and polls where it says (the local document's config
    /// center unless `remote.allow` lets it move).
    fn install_remote(&mut self, host: &dyn Host, policy: Policy, version: u64) {
        if policy.remote.is_some() {
            self.source.remote.clone_from(&policy.remote);
        }
        self.install(host, policy, &format!("remote (version {version})"));
    }

    fn poll(&mut self, host: &dyn Host, spec: &RemoteSpec, now: Instant) {
        if self.source.polling || !remote::claim_poll(&self.store, host, spec, now) {
            return;
        }
        // Conditional only for the document this worker runs: one it refused (its local
        // document changed since) is asked for again in full.
        let etag = remote::read_published(&self.store, host)
            .filter(|published| published.version == self.source.applied_version)
            .and_then(|published| published.etag);
        let callout = Callout {
            upstream: spec.cluster.clone(),
            headers: remote::poll_headers(spec, etag.as_deref())
                .into_iter()
                .map(|(name, value)| (name, value.to_string()))
                .collect(),
            body: Vec::new(),
            timeout_ms: u64::try_from(POLL_TIMEOUT.as_millis()).unwrap_or(u64::MAX),
        };
        match self.dispatch(host, &callout) {
            Ok(token) => {
                self.source.polling = true;
                self.calls.insert(token, Flight::Poll);
            }
            Err(error) => self.record_poll(host, Err(PollProblem::NotSent(error))),
        }
    }

    fn record_poll(&mut self, host: &dyn Host, result: Result<(), PollProblem>) {
        let switched = remote::record_health(&self.store, host, result.is_ok());
        match result {
            Ok(()) if switched => log::warn!("diana: config center is back"),
            Ok(()) => {}
            Err(reason) => {
                self.count(Event::ConfigFetchError);
                if switched {
                    log::warn!("diana: config center failing ({reason}); keeping the current configuration");
                }
            }
        }
    }

    pub(super) fn on_poll_answer(&mut self, host: &dyn Host, answer: Answer) {
        self.source.polling = false;
        let (status, etag, signature, body) = match answer {
            Answer::Answered(answered) => {
                let etag = answered
                    .header("etag")
                    .and_then(|etag| String::from_utf8(etag.to_vec()).ok());
                let signature = answered
                    .header(remote::SIGNATURE_HEADER)
                    .map(<[u8]>::to_vec);
                (answered.status, etag, signature, Some(answered.body))
            }
            Answer::NoAnswer | Answer::NotSent(_) => (0, None, None, None),
        };
        let Some(local) = self.source.local.clone() else {
            return;
        };
        let body = match body {
            Some(Ok(body)) if status == 200 => PollBody::Read(body),
            Some(Err(BodyError::Unreadable(error))) if status == 200 => {
                self.record_poll(host, Err(PollProblem::UnreadableBody(error)));
                return;
            }
            Some(Err(BodyError::TooLarge(size))) => PollBody::NotRead(size),
            Some(Ok(body)) => PollBody::NotRead(body.len()),
            Some(Err(BodyError::Unreadable(_))) | None => PollBody::NotRead(0),
        };
        let published = remote::read_published(&self.store, host);
        let outcome = remote::interpret(
            status,
            etag,
            signature.as_deref(),
            &body,
            published.as_ref(),
            &local,
        );
        let text = body.bytes();
        match outcome {
            PollOutcome::Unchanged => self.record_poll(host, Ok(())),
            PollOutcome::Refused(reason) => {
                self.count(Event::ConfigRejected);
                self.count(Event::ConfigRemoteRefused);
                // Once per document and reason: the same body unsigned, then badly signed,
                // is logged twice.
                let refusal = [text, reason.to_string().as_bytes()].concat();
                if remote::first_rejection(&self.store, host, &refusal) {
                    log::error!("diana: {reason}; keeping the current configuration");
                }
                self.record_poll(host, Err(PollProblem::Document(reason)));
            }
            PollOutcome::Rejected(reason) => {
                self.count(Event::ConfigRejected);
                let rejection = [text, reason.to_string().as_bytes()].concat();
                if remote::first_rejection(&self.store, host, &rejection) {
                    log::error!("diana: {reason}; keeping the current configuration");
                }
                self.record_poll(host, Err(PollProblem::Document(reason)));
            }
            PollOutcome::Failed(failure) => {
                self.record_poll(host, Err(PollProblem::Failed(failure)))
            }
            PollOutcome::New {
                policy,
                text,
                etag,
                signature,
            } => {
                self.record_poll(host, Ok(()));
                match remote::publish(&self.store, host, &text, etag, signature) {
                    Some(version) => {
                        self.source.applied_version = version;
                        self.install_remote(host, *policy, version);
                    }
                    None => log::warn!(
                        "diana: could not publish the remote document; retrying next poll"
                    ),
                }
            }
        }
    }
}

/// One warning when the local document polls a config center whose documents are not
/// signed: the pinned fields hold whatever it serves, but everything else (every limit, a
/// rule's dry run) is whoever answers in its place's to set (SECURITY.md §5).
fn warn_if_unsigned(policy: &Policy) {
    if let Some(remote) = policy
        .remote
        .as_ref()
        .filter(|remote| remote.signature.is_none())
    {
        log::warn!(
            "diana: documents from the config center ({}{}) are adopted unsigned: whoever can \
             answer in its place can change every limit but the pinned fields; set \
             remote.signature",
            remote.cluster,
            remote.path
        );
    }
}

/// On a host whose verifier is Envoy's `jwt_authn`: what reads a claim from the
/// `authorization` header, and what to do instead (`None`: nothing does, or the host is
/// not Envoy). Diana reads the header as jwt_authn does (`Bearer ` as written), but
/// jwt_authn checks only what its rules cover: a route they miss, a path spelled so that
/// they miss it, an optional token, and a forged claim counts.
pub(crate) fn unverified_claims_warning(policy: &Policy, profile: HostProfile) -> Option<String> {
    if profile.bearer != BearerScheme::AsWritten {
        return None;
    }
    let readers = policy.header_claims();
    if readers.is_empty() {
        return None;
    }
    let instead = if profile.jwt_authn_metadata {
        "read it from the payload jwt_authn verified instead (`from: {jwt_authn: NAME}`, with the provider's `payload_in_metadata: NAME`)"
    } else {
        "this host cannot read jwt_authn's metadata: have jwt_authn copy the verified claim to a header (`claim_to_headers`) and count by that header"
    };
    Some(format!(
        "diana: {} read a claim from the authorization header, which Diana does not verify: a token jwt_authn does not check (a route its rules miss, an optional token) is counted under whatever claim it carries; {instead}",
        readers.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::facts::RequestFacts;
    use crate::store::{HostError, SetOutcome, SharedData};
    use crate::time::Clock;
    use crate::worker::sim::SimHost;
    use crate::worker::{CallToken, HostProfile, LocalReply};
    use std::cell::{Cell, RefCell};
    use std::panic::{catch_unwind, AssertUnwindSafe};

    const DOCUMENT: &str = "resources:\n  - Url: /\n    rules:\n      - {rpu: 100}\n";
    const T0: Instant = Instant::EPOCH.saturating_add(Nanos::from_secs(1_000));

    /// nginx's host as the probe meets it: shared data with or without a `shm_kv` zone
    /// (without one every access traps, here a panic that ends the "instance"), and
    /// metrics that outlive an instance and are defined once per name.
    struct Nginx {
        sim: SimHost,
        zone: bool,
        accesses: Cell<u32>,
        probes: Cell<u32>,
        gauges: RefCell<Vec<(String, u64)>>,
    }

    impl Nginx {
        fn new(zone: bool) -> Nginx {
            Nginx {
                sim: SimHost::new(HostProfile::NGINX, T0),
                zone,
                accesses: Cell::new(0),
                probes: Cell::new(0),
                gauges: RefCell::new(Vec::new()),
            }
        }

        fn gauge(&self) -> u64 {
            let gauges = self.gauges.borrow();
            gauges
                .iter()
                .find(|(name, _)| name == PROBE_GAUGE)
                .map_or(0, |(_, value)| *value)
        }

        fn access(&self) {
            self.accesses.set(self.accesses.get() + 1);
            assert!(
                self.zone,
                "host trap (bad usage): failed getting value from shm (could not resolve namespace)"
            );
        }
    }

    impl SharedData for Nginx {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
            if key == PROBE_KEY {
                self.probes.set(self.probes.get() + 1);
            }
            self.access();
            self.sim.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<SetOutcome, HostError> {
            self.access();
            self.sim.set(key, value, cas)
        }
    }

    impl RequestFacts for Nginx {
        fn header(&self, name: &str) -> Option<Vec<u8>> {
            self.sim.header(name)
        }
        fn client_ip(&self) -> Option<Vec<u8>> {
            Some(b"10.0.0.1".to_vec())
        }
    }

    impl Clock for Nginx {
        fn now(&self) -> Option<Instant> {
            Clock::now(&self.sim)
        }
    }

    /// Gauges by name, as the host keeps them (ids are offsets past the sim's own).
    const GAUGE_IDS: MetricId = 1 << 20;

    impl Host for Nginx {
        fn response_header(&self, name: &str) -> Option<Vec<u8>> {
            self.sim.response_header(name)
        }
        fn dispatch(&self, callout: &Callout) -> Result<CallToken, DispatchError> {
            self.sim.dispatch(callout)
        }
        fn define_metric(&self, kind: MetricKind, name: &str) -> Option<MetricId> {
            if kind != MetricKind::Gauge {
                return self.sim.define_metric(kind, name);
            }
            let mut gauges = self.gauges.borrow_mut();
            let index = match gauges.iter().position(|(defined, _)| defined == name) {
                Some(index) => index,
                None => {
                    gauges.push((name.to_string(), 0));
                    gauges.len() - 1
                }
            };
            MetricId::try_from(index)
                .ok()
                .map(|index| GAUGE_IDS + index)
        }
        fn add_to_metric(&self, metric: MetricId, count: u64) {
            self.sim.add_to_metric(metric, count)
        }
        fn set_metric(&self, metric: MetricId, value: u64) {
            match metric.checked_sub(GAUGE_IDS) {
                Some(index) => self.gauges.borrow_mut()[index as usize].1 = value,
                None => self.sim.set_metric(metric, value),
            }
        }
        fn metric_value(&self, metric: MetricId) -> u64 {
            match metric.checked_sub(GAUGE_IDS) {
                Some(index) => self.gauges.borrow()[index as usize].1,
                None => self.sim.metric_value(metric),
            }
        }
    }

    /// A new instance's `on_configure`, as the binding runs it on nginx.
    fn instance(host: &Nginx, fresh: bool, document: &str) -> (Worker, Step) {
        let mut worker = Worker::new(HostProfile::NGINX);
        worker.probe_shared_data_first(host, fresh);
        let step = worker.configure(host, document.as_bytes());
        (worker, step.unwrap())
    }

    fn reply_of(step: &Step) -> Option<&LocalReply> {
        step.commands.iter().find_map(|command| match command {
            Command::Reply(_, reply) => Some(reply),
            _ => None,
        })
    }

    #[test]
    fn on_nginx_configure_touches_no_shared_data_and_the_first_request_installs() {
        let host = Nginx::new(true);
        let (mut worker, step) = instance(&host, true, DOCUMENT);
        assert_eq!(
            host.accesses.get(),
            0,
            "configure must not touch shared data"
        );
        assert!(worker.engine().is_none());
        // The tick is set now, from the root context, as an installed policy needs it.
        assert_eq!(step.commands, [Command::SetTick(super::super::BASE_TICK)]);
        let step = worker.on_request_headers(&host, 1);
        assert!(worker.engine().is_some());
        assert_eq!(host.gauge(), PROBE_PASSED);
        assert!(!step.pause && reply_of(&step).is_none(), "{step:?}");
        // One probe per instance.
        worker.on_request_headers(&host, 2);
        worker.on_tick(&host);
        assert_eq!(host.probes.get(), 1);
    }

    /// On nginx a request cannot ask for the tick, and places at the quota service go back
    /// from it: a policy holding them ticks every 100 ms, any other every second.
    #[test]
    fn on_nginx_global_places_tick_finer() {
        let global = "resources:\n  - Url: /\n    rules:\n      - {max_in_flight: 5, scope: global}\nglobal: {cluster: \"127.0.0.1:18081\"}\n";
        let local = "resources:\n  - Url: /\n    rules:\n      - {max_in_flight: 5}\n";
        for (document, period) in [
            (global, super::super::PLACES_TICK),
            (local, super::super::BASE_TICK),
        ] {
            let host = Nginx::new(true);
            let (_, step) = instance(&host, true, document);
            assert_eq!(step.commands, [Command::SetTick(period)], "{document}");
        }
    }

    #[test]
    fn the_first_tick_installs_as_well() {
        let host = Nginx::new(true);
        let (mut worker, _) = instance(&host, true, DOCUMENT);
        worker.on_tick(&host);
        assert!(worker.engine().is_some());
        assert_eq!(host.gauge(), PROBE_PASSED);
    }

    #[test]
    fn without_a_zone_the_probe_traps_and_the_next_instance_answers_on_invalid_config() {
        for (document, expected) in [
            (DOCUMENT.to_string(), Some(503)),
            (format!("on_invalid_config: deny\n{DOCUMENT}"), Some(503)),
            (format!("on_invalid_config: allow\n{DOCUMENT}"), None),
        ] {
            let host = Nginx::new(false);
            let (mut worker, _) = instance(&host, true, &document);
            assert_eq!(host.accesses.get(), 0);
            // The first tick probes and traps: the instance ends there.
            let trapped = catch_unwind(AssertUnwindSafe(|| worker.on_tick(&host)));
            assert!(trapped.is_err());
            assert_eq!(host.gauge(), PROBE_STARTED);
            // The host's next instance: on_configure without on_vm_start.
            let (mut worker, step) = instance(&host, false, &document);
            assert!(step.commands.is_empty(), "no tick: {step:?}");
            let step = worker.on_request_headers(&host, 1);
            assert_eq!(
                reply_of(&step).map(|reply| reply.status),
                expected,
                "{document}"
            );
            assert_eq!(step.pause, expected.is_some());
            assert!(worker.on_tick(&host).commands.is_empty());
            worker.on_response_headers(&host, 1);
            worker.on_context_gone(&host, 1);
            assert_eq!(host.accesses.get(), 1, "only the probe touched shared data");
        }
    }

    #[test]
    fn a_request_that_probes_first_traps_alone() {
        let host = Nginx::new(false);
        let (mut worker, _) = instance(&host, true, DOCUMENT);
        let trapped = catch_unwind(AssertUnwindSafe(|| worker.on_request_headers(&host, 1)));
        assert!(trapped.is_err());
        let (mut worker, _) = instance(&host, false, DOCUMENT);
        let step = worker.on_request_headers(&host, 2);
        assert_eq!(reply_of(&step).map(|reply| reply.status), Some(503));
    }

    #[test]
    fn a_fresh_instance_probes_whatever_an_earlier_configuration_left() {
        // A reload after adding the zone: the gauge still says a probe trapped.
        let host = Nginx::new(true);
        let marker = host.define_metric(MetricKind::Gauge, PROBE_GAUGE).unwrap();
        host.set_metric(marker, PROBE_STARTED);
        let (mut worker, _) = instance(&host, true, DOCUMENT);
        worker.on_request_headers(&host, 1);
        assert!(worker.engine().is_some());
        assert_eq!(host.gauge(), PROBE_PASSED);
    }

    #[test]
    fn a_later_instance_after_a_passed_probe_probes_again_and_installs() {
        let host = Nginx::new(true);
        let (mut worker, _) = instance(&host, true, DOCUMENT);
        worker.on_request_headers(&host, 1);
        // Some other trap: the host makes a new instance.
        let (mut worker, _) = instance(&host, false, DOCUMENT);
        assert!(worker.engine().is_none());
        worker.on_request_headers(&host, 2);
        assert!(worker.engine().is_some());
    }

    #[test]
    fn a_refused_document_is_reported_before_a_missing_zone() {
        let host = Nginx::new(false);
        let marker = host.define_metric(MetricKind::Gauge, PROBE_GAUGE).unwrap();
        host.set_metric(marker, PROBE_STARTED);
        let (mut worker, step) = instance(
            &host,
            false,
            "resources:\n  - Url: /\n    rules:\n      - {rpu: 0}\n",
        );
        assert!(step.commands.is_empty());
        let step = worker.on_request_headers(&host, 1);
        assert_eq!(reply_of(&step).map(|reply| reply.status), Some(503));
        assert_eq!(host.accesses.get(), 0);
    }

    /// On Envoy, a document that reads a claim from the `authorization` header is warned
    /// about at load (issue 41, item 3b), with what to read instead on that host; nginx
    /// reads the header (its verifier is in front), and a claim from jwt_authn's metadata
    /// needs no warning.
    #[test]
    fn claims_read_from_the_header_are_warned_about_on_envoy() {
        let header = concat!(
            "resources:\n  - Url: /\n    rules:\n",
            "      - {actor: user, rpu: 5}\n",
            "      - {actor: user, rpu: 9, unit: minute}\n",
            "      - {name: api, rpu: {by: {jwt_claim: tier}, values: {pro: 9}, default: 1}}\n",
            "actors:\n  user: {jwt_claim: sub}\n",
        );
        let verified = concat!(
            "resources:\n  - Url: /\n    rules:\n",
            "      - {actor: user, rpu: 5}\n",
            "      - {name: api, rpu: {by: {jwt_claim: tier, from: {jwt_authn: p}}, values: {pro: 9}, default: 1}}\n",
            "actors:\n  user: {jwt_claim: sub, from: {jwt_authn: p}}\n",
        );
        let warning = |document: &str, profile: HostProfile| {
            let policy = crate::config::parse_policy(document).unwrap();
            unverified_claims_warning(&policy, profile)
        };
        let envoy = warning(header, HostProfile::ENVOY).unwrap();
        assert!(
            envoy.starts_with("diana: actor `user`, the plan of rule `api` read a claim from the authorization header"),
            "{envoy}"
        );
        assert!(envoy.contains("`from: {jwt_authn: NAME}`"), "{envoy}");
        let native = warning(header, HostProfile::ENVOY_NATIVE).unwrap();
        assert!(native.contains("`claim_to_headers`"), "{native}");
        assert_eq!(warning(header, HostProfile::NGINX), None);
        for profile in HostProfile::ALL {
            assert_eq!(warning(verified, profile), None, "{}", profile.name);
            assert_eq!(warning(DOCUMENT, profile), None, "{}", profile.name);
        }
    }

    /// A worker that starts while the others run a config-center document runs it from its
    /// configure on (Envoy) or its first request (nginx), not the local document until
    /// its first tick.
    #[test]
    fn a_late_worker_joins_the_published_remote_document_at_once() {
        let local = "resources:\n  - Url: /\n    rules:\n      - {rpu: 100}\nremote: {cluster: config, path: /d.yaml}\n";
        let remote = "resources:\n  - Url: /\n    rules:\n      - {rpu: 7}\n";
        let rpu = |worker: &Worker| {
            worker
                .engine()
                .and_then(|e| e.rules().next())
                .map(|r| r.limit.rpu.get())
        };
        for profile in [HostProfile::ENVOY, HostProfile::NGINX] {
            let host = Nginx::new(true);
            let store = crate::store::Store::new();
            assert_eq!(remote::publish(&store, &host, remote, None, None), Some(1));
            // Configured, and on nginx installed by a first request.
            let started = |document: &str, context| {
                let mut worker = Worker::new(profile);
                worker.probe_shared_data_first(&host, true);
                worker.configure(&host, document.as_bytes()).unwrap();
                if profile.shared_data_needs_zone {
                    worker.on_request_headers(&host, context);
                }
                worker
            };
            assert_eq!(rpu(&started(local, 1)), Some(7), "{}", profile.name);
            // Without a `remote:` of its own, a published document is not adopted.
            assert_eq!(rpu(&started(DOCUMENT, 2)), Some(100), "{}", profile.name);
        }
    }

    #[test]
    fn envoy_installs_in_configure() {
        let host = Nginx::new(true);
        let mut worker = Worker::new(HostProfile::ENVOY);
        worker.probe_shared_data_first(&host, true);
        worker.configure(&host, DOCUMENT.as_bytes()).unwrap();
        assert!(worker.engine().is_some());
        assert_eq!(host.gauge(), 0);
    }
}
