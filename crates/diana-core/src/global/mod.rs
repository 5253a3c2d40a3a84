//! Global scope, filter side: the state machine around the one callout per request.
//!
//! ```text
//! evaluate ─ local rules admit ─▶ begin ─┬─ breaker open ─────────────▶ charge locally ─▶ Allow/Delay/Reject
//!                                        ├─ all served by leases ─────▶ Allow/Delay
//!                                        ├─ a cached denial ──────────▶ Reject
//!                                        └─ otherwise ─▶ Callout(Pending)
//! complete_global(Pending, answer) ─┬─ answer ok ──▶ stash leases, cache denials ─▶ Allow/Delay/Reject
//!                                   └─ failure ────▶ open breaker, charge locally ─▶ Allow/Delay/Reject
//! ```
//!
//! All of it lives in proxy-wasm shared data, so every worker of a gateway shares it:
//! - the **lease stash** (`diana/lease/<rule>/<slot>`): tokens granted beyond the one a
//!   request needed (`lease: N`), spent by later requests without a callout, valid until the
//!   service's reset; a denial is cached in the same record until its retry-after, so an
//!   exhausted key is not asked again before it can succeed;
//! - the **circuit breaker** (`diana/breaker`): after a failure, global rules are enforced
//!   locally with the same parameters for `retry_seconds`; then one request (whichever worker
//!   claims it first) probes the service, and its answer closes or re-opens the breaker.

pub mod wire;

use crate::config::Rule;
use crate::engine::{Decision, Engine, LocalOutcome, Progress};
use crate::metrics::{Event, MetricSink, RuleEvent};
use crate::response::RuleReport;
use crate::store::{decode_u64, SharedData, SlotAddress};
use crate::time::{Nanos, NANOS_PER_SECOND};
use wire::{AcquireRequest, AcquireResponse, RuleRequest, RuleResult};

const NANOS_PER_MILLI: Nanos = 1_000_000;

/// The shared-data key of the circuit breaker.
pub const BREAKER_KEY: &str = "diana/breaker";

/// A global rule of the request being evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalRuleRef {
    /// Flat rule index (see [`Engine::rules`]).
    pub index: usize,
    pub address: SlotAddress,
}

/// A request paused for a callout: the body to send and what is needed to finish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    /// JSON body for `POST global.path`.
    pub body: Vec<u8>,
    /// The rules asked, in the order of the request's `rules`.
    pub rules: Vec<GlobalRuleRef>,
    /// True when this callout is the breaker's probe.
    pub probe: bool,
    /// True when the service must do the waiting (leaky-bucket rules on a host that cannot
    /// pause a request): send it to [`wait_path`] instead of `global.path`.
    pub wait: bool,
    tightest: Option<RuleReport>,
    delay: Nanos,
}

/// Why a callout did not give a usable answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CalloutFailure {
    /// `dispatch_http_call` refused (unknown cluster, bad upstream).
    Dispatch(String),
    /// The host answered with no headers: timeout or connection failure.
    NoResponse,
    /// Status other than 200.
    Status(u16),
    /// The body could not be read or parsed, or did not match the request.
    Body(String),
}

impl std::fmt::Display for CalloutFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CalloutFailure::Dispatch(reason) => write!(f, "dispatch failed: {reason}"),
            CalloutFailure::NoResponse => write!(f, "no response (timeout or connection failure)"),
            CalloutFailure::Status(status) => write!(f, "status {status}"),
            CalloutFailure::Body(reason) => write!(f, "unreadable answer: {reason}"),
        }
    }
}

/// The lease stash record of one (rule, identity): tokens left, valid until, denied until.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Lease {
    fingerprint: u64,
    tokens: u64,
    valid_until: Nanos,
    denied_until: Nanos,
}

impl Lease {
    /// An empty record of `address`'s identity.
    fn for_address(address: SlotAddress) -> Lease {
        Lease {
            fingerprint: address.fingerprint,
            ..Lease::default()
        }
    }

    fn decode(bytes: Option<&[u8]>) -> Lease {
        let Some(bytes) = bytes.filter(|b| b.len() == 32) else {
            return Lease::default();
        };
        let mut words = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
        Lease {
            fingerprint: words.next().unwrap_or(0),
            tokens: words.next().unwrap_or(0),
            valid_until: words.next().unwrap_or(0),
            denied_until: words.next().unwrap_or(0),
        }
    }

    fn encode(&self) -> Vec<u8> {
        [
            self.fingerprint,
            self.tokens,
            self.valid_until,
            self.denied_until,
        ]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect()
    }
}

/// `diana/lease/<rule id>/`: the part of a rule's lease-stash keys computed once per rule
/// (the slot number follows, as for [`crate::store::slot_key`]).
pub fn lease_key_prefix(rule_id: u64) -> String {
    format!("diana/lease/{rule_id:016x}/")
}

/// The quota service's wait endpoint beside its acquire endpoint: `/v1/acquire` →
/// `/v1/wait`; any other path gets `/wait` appended.
pub fn wait_path(acquire_path: &str) -> String {
    match acquire_path.strip_suffix("/acquire") {
        Some(base) => format!("{base}/wait"),
        None => format!("{}/wait", acquire_path.trim_end_matches('/')),
    }
}

/// The longest a wait-endpoint callout may take beyond `timeout_ms` (the service caps
/// its waits at 10 s).
pub const MAX_SERVICE_WAIT_MS: u32 = 10_000;

/// The quota service key of one (rule, identity): the same on every gateway.
pub fn global_key(rule: &Rule, address: SlotAddress) -> String {
    format!("{:016x}:{:016x}", rule.id, address.fingerprint)
}

/// What the lease stash says for one rule.
enum StashAnswer {
    /// A leased token was spent.
    Served,
    /// The key is known exhausted until this time.
    Denied(Nanos),
    /// Ask the service.
    Ask,
}

fn take_from_stash(
    engine: &Engine,
    host: &dyn SharedData,
    global: GlobalRuleRef,
    now: Nanos,
) -> StashAnswer {
    let address = global.address;
    let key = engine.lease_key(global.index, address.first);
    let result = engine.store().update(host, &key, |current| {
        let mut lease = Lease::decode(current);
        if lease.fingerprint != address.fingerprint {
            return (None, StashAnswer::Ask);
        }
        // Tokens already granted are spent first: a denial cached by a concurrent request
        // only means the service has nothing more to give.
        if lease.tokens > 0 && lease.valid_until > now {
            lease.tokens -= 1;
            return (Some(lease.encode()), StashAnswer::Served);
        }
        if lease.denied_until > now {
            return (None, StashAnswer::Denied(lease.denied_until));
        }
        (None, StashAnswer::Ask)
    });
    result.unwrap_or(StashAnswer::Ask)
}

/// Records the service's answer for one rule: spare tokens, or a denial to cache.
fn stash(
    engine: &Engine,
    host: &dyn SharedData,
    rule: &Rule,
    global: GlobalRuleRef,
    lease: Lease,
    now: Nanos,
) {
    let key = engine.lease_key(global.index, global.address.first);
    let result = engine.store().update(host, &key, |current| {
        let mut merged = lease;
        let existing = Lease::decode(current);
        // Spare tokens from an earlier refill that are still valid are kept (with the
        // later expiry of the two).
        if existing.fingerprint == lease.fingerprint && existing.valid_until > now {
            merged.tokens = merged.tokens.saturating_add(existing.tokens);
            merged.valid_until = merged.valid_until.max(existing.valid_until);
        }
        (Some(merged.encode()), ())
    });
    if let Err(error) = result {
        log::debug!("diana: lease stash for {}: {error}", rule.name);
    }
}

/// Breaker record: `open_until` (0 = closed).
fn breaker_open_until(host: &dyn SharedData) -> Nanos {
    match host.get(BREAKER_KEY) {
        Ok(Some((bytes, _))) => decode_u64(Some(&bytes)),
        _ => 0,
    }
}

/// How long a VM trusts its last reading of a closed breaker. Another worker's failure
/// reaches this VM within this time (and this VM's own failures open the breaker at once),
/// which saves a shared-data read on every request while the service is healthy.
pub const BREAKER_CACHE: Nanos = 100 * NANOS_PER_MILLI;

/// One VM's last reading of the breaker: (trusted until, `open_until` read).
#[derive(Debug, Default)]
pub struct BreakerCache(std::cell::Cell<(Nanos, Nanos)>);

impl BreakerCache {
    /// `open_until`, from the cache while it is fresh and said "closed", else from the host.
    fn open_until(&self, host: &dyn SharedData, now: Nanos) -> Nanos {
        let (trusted_until, open_until) = self.0.get();
        if open_until == 0 && now < trusted_until {
            return 0;
        }
        let open_until = breaker_open_until(host);
        self.remember(open_until, now);
        open_until
    }

    fn remember(&self, open_until: Nanos, now: Nanos) {
        self.0.set((now.saturating_add(BREAKER_CACHE), open_until));
    }
}

/// Decides whether this request may call the service: `Some(probe)` if so, `None` if the
/// breaker keeps it local. A request that finds the retry period over claims the probe
/// by pushing `open_until` forward, so other workers stay local until the probe answers.
fn may_call(engine: &Engine, host: &dyn SharedData, retry: Nanos, now: Nanos) -> Option<bool> {
    let store = engine.store();
    let open_until = engine.breaker.open_until(host, now);
    if open_until == 0 {
        return Some(false);
    }
    if now < open_until {
        return None;
    }
    let claimed = store.update(host, BREAKER_KEY, |current| {
        let current = decode_u64(current);
        if current == 0 || now < current {
            (None, current == 0)
        } else {
            (Some(now.saturating_add(retry).to_le_bytes().to_vec()), true)
        }
    });
    match claimed {
        Ok(true) => Some(true),
        _ => None,
    }
}

fn set_breaker(engine: &Engine, host: &dyn SharedData, open_until: Nanos, now: Nanos) -> bool {
    engine.breaker.remember(open_until, now);
    engine
        .store()
        .update(host, BREAKER_KEY, |current| {
            let before = decode_u64(current);
            let changed = (before == 0) != (open_until == 0);
            (Some(open_until.to_le_bytes().to_vec()), changed)
        })
        .unwrap_or(false)
}

/// After the local rules admitted the request: decide the global ones, from leases and
/// cached denials where possible, else by preparing one callout.
pub(crate) fn begin(
    engine: &Engine,
    host: &dyn SharedData,
    globals: Vec<GlobalRuleRef>,
    mut progress: Progress,
    now: Nanos,
    metrics: &mut dyn MetricSink,
) -> Decision {
    let policy = engine.policy();
    let retry = u64::from(policy.global.retry_seconds) * NANOS_PER_SECOND;
    let Some(probe) = may_call(engine, host, retry, now) else {
        return degrade(engine, host, &globals, progress, now, metrics);
    };
    let mut ask = Vec::new();
    for global in globals {
        let Some(rule) = engine.rule(global.index) else {
            continue;
        };
        match take_from_stash(engine, host, global, now) {
            StashAnswer::Served => {
                metrics.rule_event(global.index, RuleEvent::Allowed);
            }
            StashAnswer::Denied(until) => {
                metrics.event(Event::CachedDenial);
                let report = RuleReport {
                    limit: rule.limit.rpu.get(),
                    remaining: 0,
                    reset_seconds: crate::time::ceil_seconds(until - now),
                    retry_after_seconds: crate::time::ceil_seconds_at_least_one(until - now),
                };
                if let LocalOutcome::Rejected(rejection) =
                    engine.deny(global.index, rule, &report, metrics)
                {
                    return Decision::Reject(rejection);
                }
            }
            StashAnswer::Ask => ask.push(global),
        }
    }
    if ask.is_empty() {
        return engine.finish(progress, now);
    }
    let request = AcquireRequest {
        rules: ask
            .iter()
            .filter_map(|global| {
                let rule = engine.rule(global.index)?;
                Some(RuleRequest {
                    key: global_key(rule, global.address),
                    algo: rule.algo.code().to_string(),
                    rpu: rule.limit.rpu.get(),
                    unit: rule.limit.unit.name().to_string(),
                    burst: rule.limit.burst.get(),
                    slices: rule.limit.slices.get(),
                    want: if rule.algo.code() == "LB" {
                        1
                    } else {
                        rule.lease.get()
                    },
                    cost: 1,
                    max_delay_ms: None,
                })
            })
            .collect(),
    };
    let body = match serde_json::to_vec(&request) {
        Ok(body) => body,
        Err(error) => {
            log::error!("diana: cannot encode the quota request: {error}");
            return degrade(engine, host, &ask, progress, now, metrics);
        }
    };
    metrics.event(Event::GlobalCallout);
    let tightest = progress.tightest.take();
    let wait = !engine.can_pause() && request.rules.iter().any(|rule| rule.algo == "LB");
    Decision::Callout(Pending {
        body,
        rules: ask,
        probe,
        wait,
        tightest,
        delay: progress.delay,
    })
}

/// Global rules enforced in local scope with the same parameters.
fn degrade(
    engine: &Engine,
    host: &dyn SharedData,
    globals: &[GlobalRuleRef],
    mut progress: Progress,
    now: Nanos,
    metrics: &mut dyn MetricSink,
) -> Decision {
    metrics.event(Event::GlobalDegradedRequest);
    for global in globals {
        let Some(rule) = engine.rule(global.index) else {
            continue;
        };
        if let LocalOutcome::Rejected(rejection) = engine.charge_locally(
            host,
            global.index,
            rule,
            global.address,
            now,
            &mut progress,
            metrics,
        ) {
            return Decision::Reject(rejection);
        }
    }
    engine.finish(progress, now)
}

/// Parses and checks the service's answer against what was asked.
pub fn parse_answer(
    pending: &Pending,
    status: u16,
    body: &[u8],
) -> Result<Vec<RuleResult>, CalloutFailure> {
    if status != 200 {
        return Err(CalloutFailure::Status(status));
    }
    let answer: AcquireResponse =
        serde_json::from_slice(body).map_err(|e| CalloutFailure::Body(e.to_string()))?;
    if answer.results.len() != pending.rules.len() {
        return Err(CalloutFailure::Body(format!(
            "{} results for {} rules",
            answer.results.len(),
            pending.rules.len()
        )));
    }
    Ok(answer.results)
}

/// Finishes a request paused for a callout, with the service's answer or its failure.
pub fn complete(
    engine: &Engine,
    host: &dyn SharedData,
    pending: Pending,
    answer: Result<Vec<RuleResult>, CalloutFailure>,
    now: Nanos,
    metrics: &mut dyn MetricSink,
) -> Decision {
    let policy = engine.policy();
    let mut progress = Progress {
        tightest: pending.tightest,
        delay: pending.delay,
    };
    let results = match answer {
        Ok(results) => results,
        Err(failure) => {
            metrics.event(Event::GlobalError);
            let retry = u64::from(policy.global.retry_seconds) * NANOS_PER_SECOND;
            if set_breaker(engine, host, now.saturating_add(retry).max(1), now) {
                log::warn!(
                    "diana: quota service unavailable ({failure}); global rules are enforced locally for {}s",
                    policy.global.retry_seconds
                );
                metrics.degraded(true);
            }
            return degrade(engine, host, &pending.rules, progress, now, metrics);
        }
    };
    if pending.probe && set_breaker(engine, host, 0, now) {
        log::warn!("diana: quota service is back; global rules are global again");
        metrics.degraded(false);
    }
    for (global, result) in pending.rules.iter().zip(results) {
        let Some(rule) = engine.rule(global.index) else {
            continue;
        };
        let verdict = crate::algo::Verdict {
            granted: result
                .granted
                .min(if result.allowed { u32::MAX } else { 0 }),
            remaining: result.remaining,
            reset: result.reset_ms.saturating_mul(NANOS_PER_MILLI),
            retry_after: result.retry_after_ms.saturating_mul(NANOS_PER_MILLI),
            delay: result.delay_ms.saturating_mul(NANOS_PER_MILLI),
            mark: crate::algo::Mark::default(),
        };
        let report = RuleReport::new(rule, &verdict);
        if verdict.allowed() {
            metrics.rule_event(global.index, RuleEvent::Allowed);
            if rule.lease.get() > 1 {
                metrics.event(Event::LeaseRefill);
                // Spare tokens were taken from the global count when granted; spending
                // them within one unit stays inside the design's bound (lease × gateways).
                // The service's reset alone would be too short for a token bucket far
                // from its limit (its "time until full" is then about nothing).
                let lifetime = verdict.reset.max(rule.limit.unit.nanos());
                let spare = Lease {
                    tokens: u64::from(verdict.granted - 1),
                    valid_until: now.saturating_add(lifetime),
                    ..Lease::for_address(global.address)
                };
                stash(engine, host, rule, *global, spare, now);
            }
            progress.admit(report, verdict.delay);
        } else {
            let denial = Lease {
                denied_until: now.saturating_add(verdict.retry_after),
                ..Lease::for_address(global.address)
            };
            stash(engine, host, rule, *global, denial, now);
            if let LocalOutcome::Rejected(rejection) =
                engine.deny(global.index, rule, &report, metrics)
            {
                return Decision::Reject(rejection);
            }
        }
    }
    engine.finish(progress, now)
}
