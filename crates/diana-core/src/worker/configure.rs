//! Where a worker's configuration comes from: the local document (`on_configure`), and the
//! config center's, polled by one worker per period and shared with the others through
//! shared data (DESIGN §6: a remote document is judged against the local one).

use super::counters::Counters;
use super::{call_status, Call, Command, Configured, Host, Step, Worker};
use crate::config::{parse_policy, MetricsSpec, OnInvalidConfig, Policy, RemoteSpec};
use crate::decision::Callout;
use crate::engine::Engine;
use crate::lifecycle;
use crate::metrics::Event;
use crate::remote::{self, PollBody, PollOutcome};
use crate::store::identity;
use crate::time::{Instant, Nanos, NANOS_PER_SECOND};
use std::rc::Rc;
use std::time::Duration;

/// The least time between two config-center checks (a little less than the base tick: a
/// tick that lands early must still count, or a worker skips every other one).
const REMOTE_CHECK_SPACING: Nanos = NANOS_PER_SECOND * 3 / 4;
/// How long a config-center poll may take.
const POLL_TIMEOUT: Duration = Duration::from_secs(5);

/// The documents a worker runs.
#[derive(Default)]
pub(super) struct Source {
    /// The config center, from the local document (a remote document moves it only if
    /// the local one's `remote.allow` names `remote`).
    pub(super) remote: Option<RemoteSpec>,
    /// The local document: what a remote one is judged against.
    local: Option<Rc<Policy>>,
    /// The metrics path, from the local document too (a remote document cannot move it).
    metrics: Option<MetricsSpec>,
    /// Version of the published remote document this worker runs (0: the local one).
    applied_version: u64,
    next_check: Instant,
    /// A poll is in flight.
    polling: bool,
    /// On hosts where the tick may be set once: it was.
    tick_fixed: bool,
}

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
            .get_or_insert_with(|| Counters::define(host, std::iter::empty()));
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
        self.invalid = None;
        if !self.profile.resumes_from_other_contexts {
            log::info!(
                "diana: {}: leaky-bucket waits become Retry-After (local) or are done by the quota service (global)",
                self.profile.name
            );
        }
        self.source.remote = policy.remote.clone();
        self.source.local = Some(Rc::new(policy.clone()));
        self.source.metrics = policy.metrics.clone();
        self.source.applied_version = 0;
        self.install(host, policy, "local");
        self.base_tick = self.wanted_base_tick(host);
        let mut step = Step::default();
        if self.profile.tick_settable_anywhere {
            self.retick(&mut step);
        } else if !self.source.tick_fixed && !self.base_tick.is_zero() {
            // Once, from the root context, and never zero.
            self.source.tick_fixed = true;
            self.tick = Some(self.base_tick);
            step.commands.push(Command::SetTick(self.base_tick));
        }
        Ok(step)
    }

    /// Makes `policy` the one new requests are evaluated with.
    fn install(&mut self, host: &dyn Host, mut policy: Policy, origin: &str) {
        policy.metrics = self.source.metrics.clone();
        // Identities keyed with the process's random key when the document sets no
        // identity_key; one warning when global rules hash with the public key.
        identity::prepare(&mut policy, &self.store, host);
        let dropped = lifecycle::adopt(&self.store, host, &policy);
        if dropped > 0 {
            log::info!("diana: {dropped} rules left the configuration; their records are released");
        }
        let engine = Engine::new(policy).with_pausing(self.profile.resumes_from_other_contexts);
        let counters = Counters::define(host, engine.rules());
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
        let configured = Rc::new(Configured {
            generation: self.generations,
            engine,
            counters,
            serves_metrics,
        });
        if let Some(replaced) = self.configured.replace(configured) {
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
                self.calls.insert(token, Call::Poll);
            }
            Err(error) => self.record_poll(host, Err(format!("poll not sent: {error}"))),
        }
    }

    fn record_poll(&mut self, host: &dyn Host, result: Result<(), String>) {
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

    pub(super) fn on_poll_answer(&mut self, host: &dyn Host, headers: usize, body_size: usize) {
        self.source.polling = false;
        let (status, etag, signature) = if headers == 0 {
            (0, None, None)
        } else {
            let etag = host
                .call_header("etag")
                .and_then(|etag| String::from_utf8(etag).ok());
            (
                call_status(host),
                etag,
                host.call_header(remote::SIGNATURE_HEADER),
            )
        };
        let Some(local) = self.source.local.clone() else {
            return;
        };
        let body = if status == 200 && body_size <= remote::MAX_DOCUMENT_BYTES {
            match host.call_body(body_size) {
                Ok(body) => PollBody::Read(body),
                Err(error) => {
                    self.record_poll(host, Err(format!("unreadable body: {error}")));
                    return;
                }
            }
        } else {
            PollBody::NotRead(body_size)
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
                let reason = reason.to_string();
                self.count(Event::ConfigRejected);
                self.count(Event::ConfigRemoteRefused);
                // Once per document and reason: the same body unsigned, then badly signed,
                // is logged twice.
                let refusal = [text, reason.as_bytes()].concat();
                if remote::first_rejection(&self.store, host, &refusal) {
                    log::error!("diana: {reason}; keeping the current configuration");
                }
                self.record_poll(host, Err(reason));
            }
            PollOutcome::Rejected(reason) => {
                let reason = reason.to_string();
                self.count(Event::ConfigRejected);
                let rejection = [text, reason.as_bytes()].concat();
                if remote::first_rejection(&self.store, host, &rejection) {
                    log::error!("diana: {reason}; keeping the current configuration");
                }
                self.record_poll(host, Err(reason));
            }
            PollOutcome::Failed(failure) => self.record_poll(host, Err(failure.to_string())),
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
