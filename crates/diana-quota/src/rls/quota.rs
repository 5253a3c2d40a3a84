//! RLQS: `StreamRateLimitQuotas`. Each Envoy (one stream per filter configuration) reports,
//! per bucket, the requests it allowed and denied since its last report (at once for a new
//! bucket, then every `reporting_interval`); diana-quota answers each report with the
//! bucket's assignment:
//!
//! - **ALLOW_ALL**: no rule matches the bucket (or its domain is unknown, or the rule is
//!   `unlimited`, or in `shadow_mode`);
//! - **DENY_ALL**: `requests_per_unit: 0`, or the rule's counter has nothing left (until
//!   it has: the next report after the wait the store announced asks again);
//! - **token bucket, the gateway's share**: the rule's capacity and rate divided among the
//!   gateways reporting the same counter to this replica (`max_tokens` = capacity / n, at
//!   most what the counter had left when last charged, `tokens_per_fill` =
//!   `requests_per_unit` / n per unit, rounded up).
//!
//! The bucket matches a rule of the `--rls-config` files ([`RlsConfig::lookup_bucket`],
//! the domain is the stream's), and counts on the same counter as the RLS descriptor with
//! the same entries, so RLQS, RLS and the wasm filter spend one budget. Every request a
//! gateway reports as allowed is charged to that counter (past the limit if need be: what
//! Envoy admitted between two reports is owed, and repaid before anything else is
//! admitted); when the counter runs dry the gateways get DENY_ALL until it recovers. The
//! count is exact in the store; what the gateways admit may exceed the limit by what they
//! admit within one reporting interval after the budget ran out (Envoy decides locally
//! between reports, by design of the protocol).
//!
//! Assignments live for a reporting interval plus 2 s (7 s until the first periodic report
//! tells the interval; Envoy 1.40 reports every 5 s whatever the buckets'
//! `reporting_interval` says): if diana-quota goes away, Envoy applies the bucket's
//! `expired_assignment_behavior`, then its `no_assignment_behavior`, that much later.

use super::config::{self, Lookup, RlsConfig, RuleKind};
use super::{OwnedRule, Rls, RLQS_PATH};
use diana_core::algo::{Algorithm, Limit};
use diana_core::wire::{self, ResolvedRule, RuleResult};
use crate::store::{Clock, StoreError, SystemClock};
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaService;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};
use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroU32;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

/// Most buckets one stream may report (more are answered ALLOW_ALL without a counter).
pub const MAX_BUCKETS: usize = 10_000;
/// The reporting interval assumed until a stream's second report tells it (Envoy 1.40
/// reports every 5 s whatever the buckets' `reporting_interval` says).
const FIRST_INTERVAL: Duration = Duration::from_secs(5);
/// A gateway counts in the share of a counter while it reported within this many intervals.
const ACTIVE_INTERVALS: u32 = 3;
/// The longest reporting interval taken from a report; a longer `time_elapsed` counts as
/// this (an hour: an assignment lives at most a minute anyway, and `i64::MAX` seconds
/// would overflow the share's window).
const MAX_INTERVAL: Duration = Duration::from_secs(3600);

/// Why a stream's message of reports is refused (`INVALID_ARGUMENT`, the stream ends);
/// each names the field. The bounds are RLS's: a bucket id is a descriptor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidReport {
    #[error("domain: the first usage report of a stream must name the domain")]
    NoDomain,
    #[error("domain: {bytes} bytes, at most {max}")]
    DomainTooLong { bytes: usize, max: usize },
    #[error("bucket_quota_usages[{usage}].bucket_id.bucket: at most {max} entries, got {got}")]
    TooManyEntries {
        usage: usize,
        max: usize,
        got: usize,
    },
    /// `key`: the entry's key, at most its first [`config::SHOWN_BYTES`].
    #[error("bucket_quota_usages[{usage}].bucket_id.bucket: {field} of {bytes} bytes, at most {max} (key {key:?})")]
    TooLong {
        usage: usize,
        field: &'static str,
        bytes: usize,
        max: usize,
        key: String,
    },
}

/// Checks the domain a stream names and the bucket ids of one message.
fn check(domain: Option<&str>, reports: &RateLimitQuotaUsageReports) -> Result<(), InvalidReport> {
    if let Some(domain) = domain {
        if domain.is_empty() {
            return Err(InvalidReport::NoDomain);
        }
        if domain.len() > config::MAX_TEXT_BYTES {
            return Err(InvalidReport::DomainTooLong {
                bytes: domain.len(),
                max: config::MAX_TEXT_BYTES,
            });
        }
    }
    for (usage, report) in reports.bucket_quota_usages.iter().enumerate() {
        let Some(id) = &report.bucket_id else {
            continue;
        };
        if id.bucket.len() > config::MAX_ENTRIES {
            return Err(InvalidReport::TooManyEntries {
                usage,
                max: config::MAX_ENTRIES,
                got: id.bucket.len(),
            });
        }
        for (key, value) in &id.bucket {
            for (field, text) in [("key", key), ("value", value)] {
                if text.len() > config::MAX_TEXT_BYTES {
                    return Err(InvalidReport::TooLong {
                        usage,
                        field,
                        bytes: text.len(),
                        max: config::MAX_TEXT_BYTES,
                        key: config::shown(key).to_string(),
                    });
                }
            }
        }
    }
    Ok(())
}

/// The reporting interval a report's `time_elapsed.seconds` tells: `None` when it tells
/// none (0 or negative), at most [`MAX_INTERVAL`] whatever a caller sends.
fn reported_interval(seconds: i64) -> Option<Duration> {
    let seconds = u64::try_from(seconds).ok().filter(|&seconds| seconds > 0)?;
    Some(Duration::from_secs(seconds).min(MAX_INTERVAL))
}

/// The RLQS gRPC service.
#[derive(Clone)]
pub struct Rlqs {
    rls: Rls,
    shared: Arc<Gateways>,
    stopping: watch::Receiver<bool>,
}

/// Which streams reported which counter lately: the `n` of the shares.
#[derive(Default)]
struct Gateways {
    next_stream: AtomicU64,
    seen: Mutex<HashMap<String, HashMap<u64, Instant>>>,
}

impl Gateways {
    /// Records that `stream` reports `key` now; how many streams did within `window`.
    fn report(&self, key: &str, stream: u64, now: Instant, window: Duration) -> u32 {
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let streams = seen.entry(key.to_string()).or_default();
        streams.insert(stream, now);
        streams.retain(|_, last| now.saturating_duration_since(*last) <= window);
        u32::try_from(streams.len()).unwrap_or(u32::MAX).max(1)
    }

    /// Forgets a stream that ended.
    fn forget(&self, stream: u64) {
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        seen.retain(|_, streams| {
            streams.remove(&stream);
            !streams.is_empty()
        });
    }
}

impl Rlqs {
    pub fn new(rls: Rls, stopping: watch::Receiver<bool>) -> Rlqs {
        Rlqs {
            rls,
            shared: Arc::new(Gateways::default()),
            stopping,
        }
    }
}

type AssignmentStream = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl RateLimitQuotaService for Rlqs {
    type StreamRateLimitQuotasStream = AssignmentStream;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        // Authenticated before (`rls::serve`).
        let inbound = request.into_inner();
        let (sender, receiver) = mpsc::channel(16);
        let stream = self.shared.next_stream.fetch_add(1, Ordering::Relaxed);
        let session = Session {
            rls: self.rls.clone(),
            gateways: self.shared.clone(),
            stream,
            domain: None,
            interval: FIRST_INTERVAL,
            buckets: HashMap::new(),
        };
        tokio::spawn(session.run(inbound, sender, self.stopping.clone()));
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(receiver),
        )))
    }
}

/// One stream: its domain, reporting interval and buckets.
struct Session {
    rls: Rls,
    gateways: Arc<Gateways>,
    stream: u64,
    domain: Option<String>,
    interval: Duration,
    buckets: HashMap<BTreeMap<String, String>, BucketState>,
}

/// What a stream remembers of a bucket.
#[derive(Debug, Default, Clone, Copy)]
struct BucketState {
    /// DENY_ALL until then (the counter had nothing left).
    deny_until: Option<Instant>,
    /// Tokens taken from the counter for this gateway and not yet reported used.
    prepaid: u64,
    /// What the counter had left for this gateway when last known: the bucket's size is
    /// at most that.
    cap: Option<u64>,
}

impl Session {
    async fn run(
        mut self,
        mut inbound: Streaming<RateLimitQuotaUsageReports>,
        sender: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
        mut stopping: watch::Receiver<bool>,
    ) {
        tracing::debug!(stream = self.stream, "RLQS stream opened");
        loop {
            let message = tokio::select! {
                message = inbound.message() => message,
                _ = stopping.changed() => break,
            };
            let reports = match message {
                Ok(Some(reports)) => reports,
                Ok(None) => break,
                Err(status) => {
                    tracing::debug!(stream = self.stream, %status, "RLQS stream ended by the client");
                    break;
                }
            };
            let started = std::time::Instant::now();
            let answer = self.answer(reports).await;
            let code = if answer.is_ok() { 200 } else { 400 };
            self.rls
                .state()
                .metrics()
                .request(RLQS_PATH, code, started.elapsed());
            match answer {
                Ok(Some(response)) => {
                    if sender.send(Ok(response)).await.is_err() {
                        break;
                    }
                }
                Ok(None) => {}
                Err(status) => {
                    let _ = sender.send(Err(status)).await;
                    break;
                }
            }
        }
        self.gateways.forget(self.stream);
        tracing::debug!(stream = self.stream, "RLQS stream closed");
    }

    /// The assignments answering one message of reports.
    async fn answer(
        &mut self,
        reports: RateLimitQuotaUsageReports,
    ) -> Result<Option<RateLimitQuotaResponse>, Status> {
        // The domain is the first message's; later ones may leave it out.
        let naming = self.domain.is_none().then_some(reports.domain.as_str());
        if let Err(reason) = check(naming, &reports) {
            self.rls.warn(format_args!("RLQS stream refused: {reason}"));
            return Err(Status::invalid_argument(reason.to_string()));
        }
        if self.domain.is_none() {
            self.domain = Some(reports.domain.clone());
        }
        let domain = self.domain.clone().unwrap_or_default();
        let config = self.rls.config();
        let mut actions = Vec::with_capacity(reports.bucket_quota_usages.len());
        for usage in reports.bucket_quota_usages {
            let Some(id) = usage.bucket_id else {
                continue;
            };
            if id.bucket.is_empty() {
                continue;
            }
            if let Some(elapsed) = usage.time_elapsed {
                if let Some(interval) = reported_interval(elapsed.seconds) {
                    self.interval = interval;
                }
            }
            let bucket: BTreeMap<String, String> = id.bucket.clone().into_iter().collect();
            let strategy = self
                .assign(
                    &config,
                    &domain,
                    &bucket,
                    usage.num_requests_allowed,
                    usage.num_requests_denied,
                )
                .await;
            actions.push(BucketAction {
                bucket_id: Some(BucketId { bucket: id.bucket }),
                bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
                    assignment_time_to_live: Some(PbDuration {
                        seconds: i64::try_from(self.ttl().as_secs()).unwrap_or(60),
                        nanos: 0,
                    }),
                    rate_limit_strategy: Some(strategy),
                })),
            });
        }
        if actions.is_empty() {
            return Ok(None);
        }
        Ok(Some(RateLimitQuotaResponse {
            bucket_action: actions,
        }))
    }

    /// An assignment lives for a reporting interval and 2 s (whole seconds: Envoy reads
    /// only the seconds), at most a minute: the next report renews it.
    fn ttl(&self) -> Duration {
        self.interval
            .saturating_add(Duration::from_secs(2))
            .min(Duration::from_secs(60))
    }

    /// The strategy for one reported bucket; charges what the gateway allowed.
    async fn assign(
        &mut self,
        config: &RlsConfig,
        domain: &str,
        bucket: &BTreeMap<String, String>,
        allowed: u64,
        denied: u64,
    ) -> RateLimitStrategy {
        let (lookup, _) = config.lookup_bucket(domain, bucket);
        let matched = match lookup {
            Lookup::UnknownDomain => {
                self.rls.warn(format_args!(
                    "RLQS stream for domain {domain:?}, which no --rls-config file has (known: {}): ALLOW_ALL",
                    config.domains().join(", ")
                ));
                return blanket(BlanketRule::AllowAll);
            }
            Lookup::NoMatch => return blanket(BlanketRule::AllowAll),
            Lookup::Matched(matched) => matched,
        };
        let rule = matched.rule;
        let (algo, limit) = match &rule.kind {
            RuleKind::Unlimited => return blanket(BlanketRule::AllowAll),
            RuleKind::Blocked if rule.shadow => return blanket(BlanketRule::AllowAll),
            RuleKind::Blocked => return blanket(BlanketRule::DenyAll),
            // A calendar rule counts in the period that contains this instant.
            RuleKind::Limited { algo, limit, .. } => (*algo, limit.at(SystemClock.now())),
        };
        if !self.buckets.contains_key(bucket) && self.buckets.len() >= MAX_BUCKETS {
            self.rls.warn(format_args!(
                "RLQS stream reports more than {MAX_BUCKETS} buckets: ALLOW_ALL for the others"
            ));
            return blanket(BlanketRule::AllowAll);
        }
        let now = Instant::now();
        let gateways = self.gateways.report(
            &matched.key,
            self.stream,
            now,
            self.interval.saturating_mul(ACTIVE_INTERVALS),
        );
        let mut bucket_state = self.buckets.get(bucket).copied().unwrap_or_default();
        let state = self.rls.state().clone();
        let deadline = now + state.settings().deadline;

        // What the gateway admitted beyond what was taken for it already is owed.
        let used = allowed.min(bucket_state.prepaid);
        bucket_state.prepaid -= used;
        let owed = allowed - used;
        let mut left = None;
        if owed > 0 {
            match charge(&state, &matched.key, algo, &limit, owed, deadline).await {
                Ok(result) => left = Some(result.remaining),
                Err(failure) => {
                    // Not counted: the store is away. Keep the gateway on its share.
                    tracing::debug!(%failure, "RLQS usage could not be charged");
                }
            }
        }
        if rule.shadow {
            self.buckets.insert(bucket.clone(), bucket_state);
            return blanket(BlanketRule::AllowAll);
        }
        if bucket_state.deny_until.is_some_and(|until| now < until) {
            self.buckets.insert(bucket.clone(), bucket_state);
            return blanket(BlanketRule::DenyAll);
        }
        // Is anything left? After a dry charge, at the end of a wait, or when the gateway
        // refused requests while nothing tells what the counter holds now: take one token
        // (the gateway's next request) to know.
        let recheck =
            left == Some(0) || bucket_state.deny_until.is_some() || (left.is_none() && denied > 0);
        if recheck {
            match probe(&state, &matched.key, algo, &limit, deadline).await {
                Some(result) if result.allowed => {
                    bucket_state.deny_until = None;
                    bucket_state.prepaid += u64::from(result.granted);
                    left = Some(result.remaining);
                }
                Some(result) => {
                    let wait = Duration::from_millis(result.retry_after_ms.max(1));
                    bucket_state.deny_until = Some(now + wait);
                    self.buckets.insert(bucket.clone(), bucket_state);
                    return blanket(BlanketRule::DenyAll);
                }
                None => {}
            }
        }
        if let Some(left) = left {
            bucket_state.cap = Some(left.saturating_add(bucket_state.prepaid).max(1));
        }
        tracing::debug!(
            stream = self.stream,
            key = %matched.key,
            allowed,
            denied,
            owed,
            left = ?left,
            gateways,
            "RLQS report: the gateway's share"
        );
        self.buckets.insert(bucket.clone(), bucket_state);
        share(algo, &limit, gateways, bucket_state.cap)
    }
}

fn blanket(rule: BlanketRule) -> RateLimitStrategy {
    RateLimitStrategy {
        strategy: Some(Strategy::BlanketRule(rule as i32)),
    }
}

/// The gateway's share of a limit as Envoy's token bucket: capacity and rate divided by
/// `gateways`, rounded up, the capacity at most `cap` (what the counter has left);
/// refilled over the limit's unit (whole seconds, as Envoy reads `fill_interval`).
pub fn share(
    algo: &dyn Algorithm,
    limit: &Limit,
    gateways: u32,
    cap: Option<u64>,
) -> RateLimitStrategy {
    let gateways = u64::from(gateways.max(1));
    let capacity = algo
        .capacity(limit)
        .div_ceil(gateways)
        .min(cap.unwrap_or(u64::MAX))
        .max(1);
    let rate = u64::from(limit.rpu.get()).div_ceil(gateways).max(1);
    RateLimitStrategy {
        strategy: Some(Strategy::TokenBucket(TokenBucket {
            max_tokens: u32::try_from(capacity).unwrap_or(u32::MAX),
            tokens_per_fill: Some(UInt32Value {
                value: u32::try_from(rate).unwrap_or(u32::MAX),
            }),
            fill_interval: Some(PbDuration {
                seconds: i64::try_from(limit.unit_seconds()).unwrap_or(1),
                nanos: 0,
            }),
        })),
    }
}

/// Charges `tokens` to a counter whatever is left (in chunks the wire format allows).
async fn charge(
    state: &crate::app::AppState,
    key: &str,
    algo: &'static dyn Algorithm,
    limit: &Limit,
    tokens: u64,
    deadline: Instant,
) -> Result<RuleResult, StoreError> {
    let tokens = tokens.min(wire::MAX_TOTAL_WANT);
    let max = u64::from(wire::MAX_WANT);
    let mut rules = Vec::new();
    let mut left = tokens;
    while left > 0 {
        let chunk = left.min(max);
        left -= chunk;
        let want = NonZeroU32::new(u32::try_from(chunk).unwrap_or(1)).unwrap_or(NonZeroU32::MIN);
        rules.push(ResolvedRule {
            key,
            algo,
            limit: limit.clone(),
            want,
            cost: NonZeroU32::MIN,
            max_delay: None,
            dry_run: false,
        });
    }
    let answer = tokio::time::timeout_at(deadline, state.store().charge(&rules)).await;
    match answer {
        Ok(Ok(results)) => {
            state
                .metrics()
                .charged(algo.code(), u32::try_from(tokens).unwrap_or(u32::MAX));
            results
                .last()
                .copied()
                .ok_or_else(|| StoreError::Internal("no result".to_string()))
        }
        Ok(Err(failure)) => {
            state.metrics().store_error(failure.kind());
            Err(failure)
        }
        Err(_) => {
            state.metrics().store_error("timeout");
            Err(StoreError::Unavailable("deadline exceeded".to_string()))
        }
    }
}

/// Takes one token if the counter has one (the answer says when it will otherwise);
/// `None` when the store does not answer.
async fn probe(
    state: &crate::app::AppState,
    key: &str,
    algo: &'static dyn Algorithm,
    limit: &Limit,
    deadline: Instant,
) -> Option<RuleResult> {
    let rule = OwnedRule {
        key: key.to_string(),
        algo,
        limit: limit.clone(),
        want: NonZeroU32::MIN,
        cost: NonZeroU32::MIN,
        dry_run: false,
    };
    let budget = deadline.saturating_duration_since(Instant::now());
    match super::decide(
        state,
        RLQS_PATH,
        vec![rule],
        super::Ask::Acquire,
        deadline,
        budget,
        None,
    )
    .await
    {
        Ok(spent) => {
            let result = spent.outcomes.first().map(|outcome| outcome.result)?;
            state
                .metrics()
                .decision(algo.code(), result.allowed, result.granted);
            Some(result)
        }
        Err(failure) => {
            tracing::debug!(failure = ?failure, "RLQS probe failed");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diana_core::algo;
    use diana_core::time::Unit;

    #[test]
    fn shares_divide_capacity_and_rate() {
        let limit = Limit {
            rpu: NonZeroU32::new(10).unwrap(),
            unit: Unit::Minute,
            burst: NonZeroU32::new(10).unwrap(),
            slices: NonZeroU32::new(10).unwrap(),
            calendar: None,
            period: None,
        };
        let window = algo::lookup("W").unwrap();
        let Some(Strategy::TokenBucket(one)) = share(window, &limit, 1, None).strategy else {
            panic!()
        };
        assert_eq!(one.max_tokens, 10);
        assert_eq!(one.tokens_per_fill.unwrap().value, 10);
        assert_eq!(one.fill_interval.unwrap().seconds, 60);
        let Some(Strategy::TokenBucket(three)) = share(window, &limit, 3, None).strategy else {
            panic!()
        };
        assert_eq!(three.max_tokens, 4);
        assert_eq!(three.tokens_per_fill.unwrap().value, 4);
        let bucket = Limit {
            burst: NonZeroU32::new(50).unwrap(),
            ..limit
        };
        let Some(Strategy::TokenBucket(tb)) =
            share(algo::lookup("TB").unwrap(), &bucket, 2, Some(20)).strategy
        else {
            panic!()
        };
        assert_eq!(tb.max_tokens, 20);
        assert_eq!(tb.tokens_per_fill.unwrap().value, 5);
    }

    #[test]
    fn a_reported_interval_is_positive_and_at_most_an_hour() {
        for (seconds, interval) in [
            (i64::MIN, None),
            (-1, None),
            (0, None),
            (1, Some(Duration::from_secs(1))),
            (3600, Some(MAX_INTERVAL)),
            (3601, Some(MAX_INTERVAL)),
            (i64::MAX, Some(MAX_INTERVAL)),
        ] {
            assert_eq!(reported_interval(seconds), interval, "{seconds}");
        }
    }

    #[test]
    fn gateways_are_counted_while_they_report() {
        let gateways = Gateways::default();
        let now = Instant::now();
        let window = Duration::from_secs(3);
        assert_eq!(gateways.report("k", 1, now, window), 1);
        assert_eq!(gateways.report("k", 2, now, window), 2);
        assert_eq!(gateways.report("other", 3, now, window), 1);
        assert_eq!(
            gateways.report("k", 1, now + Duration::from_secs(5), window),
            1
        );
        gateways.forget(1);
        assert_eq!(
            gateways.report("k", 2, now + Duration::from_secs(5), window),
            1
        );
    }
}
