//! `ShouldRateLimit`: every descriptor of one call decided together.
//!
//! 1. The call is checked (a domain, 1 to 64 descriptors, each with 1 to 64 entries whose
//!    keys are not empty and whose keys and values have at most 4,096 bytes); a bad call is
//!    answered `INVALID_ARGUMENT` naming the field, with a warning in the log.
//! 2. Each descriptor finds its rule ([`RlsConfig::lookup`](super::config::RlsConfig::lookup)), or the limit it carries
//!    itself (`limit`, envoyproxy/ratelimit's override: a fixed window). A descriptor that
//!    matches no rule (or whose domain is unknown: a warning) is `OK` with no limit; an
//!    `unlimited` rule is `OK`; a rule `replaces`d by another matched rule of the same
//!    call is left out.
//! 3. Its cost, its `hits_addend`, else the call's, else 1, says how it spends its counter
//!    (envoyproxy/ratelimit's reading of `hits_addend`, where Envoy's filters rely on it):
//!
//!    ```text
//!    hits_addend 0                       check: charges nothing, OVER_LIMIT once nothing is left
//!    a cost Envoy states (≥ 1, the       count: charged whatever is left, even when the call is
//!      descriptor's or the call's)         refused (apply_on_stream_done, response costs);
//!                                          OVER_LIMIT when it did not fit
//!    none (a request counted one)        take: all or nothing with the call's other takes
//!    ```
//! 4. The call is `OVER_LIMIT` when an enforced descriptor is, or every `quota_mode` one is
//!    (`shadow_mode` ones never refuse); `requests_per_unit: 0`, or a take the limit can
//!    never grant, refuses without asking the store (which then only counts the counts,
//!    if any). One store decision for the rest ([`crate::store::Store::spend`]; a call of
//!    takes only, without quota rules, is the store's all-or-nothing acquire, Redis's lean
//!    script for fixed windows).
//! 5. Each status carries the rule's limit, what remains and when the limit resets, so
//!    that Envoy's `enable_x_ratelimit_headers` works; with `--rls-headers`, the answer
//!    also asks Envoy to add headers about the tightest descriptor (`X-RateLimit-*`, the
//!    IETF fields and `Retry-After`, or envoyproxy/ratelimit's `RateLimit-*`); with
//!    `--rls-response-metadata`, envoyproxy/ratelimit's dynamic metadata ([`super::metadata`]).
//! 6. A store that fails, or answers after the deadline, gives `UNAVAILABLE` before
//!    Envoy's timeout: Envoy applies `failure_mode_deny`.

use super::config::{self, Lookup, RuleKind};
use super::{budget, decide, metadata, Ask, HeaderStyle, OwnedRule, Rls, RLS_PATH};
use crate::store::{Clock, Enforcement, Spend, Spending, SystemClock};
use diana_core::algo::{self, Algorithm, Limit};
use diana_core::calendar::Zone;
use diana_core::config::RuleUnit;
use diana_core::response::{
    sf_string, RATELIMIT, RATELIMIT_POLICY, RETRY_AFTER, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING,
    X_RATELIMIT_RESET,
};
use diana_core::wire::{self, RuleResult};

/// envoyproxy/ratelimit's response headers (`LIMIT_RESPONSE_HEADERS_ENABLED`, its default
/// names `LIMIT_LIMIT_HEADER`, `LIMIT_REMAINING_HEADER`, `LIMIT_RESET_HEADER`).
const RATELIMIT_LIMIT: &str = "ratelimit-limit";
const RATELIMIT_REMAINING: &str = "ratelimit-remaining";
const RATELIMIT_RESET: &str = "ratelimit-reset";
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use std::num::NonZeroU32;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

/// The RLS gRPC service.
#[derive(Clone)]
pub struct RateLimiter {
    rls: Rls,
}

impl RateLimiter {
    pub fn new(rls: Rls) -> RateLimiter {
        RateLimiter { rls }
    }
}

#[tonic::async_trait]
impl RateLimitService for RateLimiter {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let started = std::time::Instant::now();
        let answer = self.answer(request).await;
        let code = match &answer {
            Ok(response) if response.overall_code == Code::OverLimit as i32 => 429,
            Ok(_) => 200,
            Err(status) => match status.code() {
                tonic::Code::InvalidArgument => 400,
                tonic::Code::ResourceExhausted | tonic::Code::Unavailable => 503,
                _ => 500,
            },
        };
        self.rls
            .state()
            .metrics()
            .request(RLS_PATH, code, started.elapsed());
        answer.map(Response::new)
    }
}

/// How a descriptor spends its counter, from its cost (envoyproxy/ratelimit's reading of
/// `hits_addend`, see the module documentation).
fn spend_of(hits: u64, stated: bool) -> Spend {
    match (hits, stated) {
        (0, _) => Spend::Check,
        (_, true) => Spend::Count,
        (_, false) => Spend::Take,
    }
}

/// Whether a rule's refusal refuses the call: `shadow_mode` never, `quota_mode` only
/// with every quota rule of the call.
fn enforcement_of(shadow: bool, quota: bool) -> Enforcement {
    if shadow {
        Enforcement::Shadow
    } else if quota {
        Enforcement::Quota
    } else {
        Enforcement::Enforced
    }
}

/// What one descriptor of the call comes to before the store is asked.
enum Plan<'a> {
    /// No limit applies (no rule, unknown domain, replaced, a refund, unlimited).
    Free {
        remaining: u32,
        limit: Option<RateLimit>,
        /// `unlimited: true` (not a passed descriptor for the metadata).
        unlimited: bool,
    },
    /// Refused without asking the store (`requests_per_unit: 0`, or a take whose cost the
    /// limit can never grant).
    Refused {
        limit: RateLimit,
        enforcement: Enforcement,
    },
    /// Asked of the store: `rules` are its pieces among the store's rules (a cost above
    /// the wire's largest `want` is sent in pieces on the same counter).
    Asked {
        rules: std::ops::Range<usize>,
        spend: Spend,
        cost: u64,
        limit: RateLimit,
        enforcement: Enforcement,
        label: &'a str,
        rpu: u32,
        unit_seconds: u64,
    },
}

/// What an asked descriptor came to.
#[derive(Clone, Copy)]
struct Answered {
    passed: bool,
    remaining: u64,
    reset_ms: u64,
    retry_ms: u64,
}

impl RateLimiter {
    async fn answer(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<RateLimitResponse, Status> {
        let rls = &self.rls;
        // Authenticated before (`rls::serve`).
        let state = rls.state();
        let budget = budget(state, request.metadata());
        let arrived = Instant::now();
        let request = request.into_inner();
        if let Err(reason) = check(&request) {
            rls.warn(format_args!(
                "RLS call refused: {reason} (domain {:?}, {} descriptors)",
                config::shown(&request.domain),
                request.descriptors.len()
            ));
            return Err(Status::invalid_argument(reason.to_string()));
        }
        let Some(permit) = state.try_admit(RLS_PATH) else {
            return Err(Status::resource_exhausted(crate::app::OVERLOADED));
        };
        let config = rls.config();
        // The call's cost is stated when Envoy sends one (`hits_addend` ≥ 1); 0 is the
        // protocol's "not set", a cost of 1.
        let call_stated = request.hits_addend > 0;
        let default_hits = u64::from(request.hits_addend.max(1));

        // Each descriptor's rule and counter.
        let mut found = Vec::with_capacity(request.descriptors.len());
        let mut unknown_domain = false;
        for (index, descriptor) in request.descriptors.iter().enumerate() {
            let entries: Vec<(&str, &str)> = descriptor
                .entries
                .iter()
                .map(|entry| (entry.key.as_str(), entry.value.as_str()))
                .collect();
            let (hits, stated) = match &descriptor.hits_addend {
                Some(hits) => (hits.value, true),
                None => (default_hits, call_stated),
            };
            let target = match &descriptor.limit {
                Some(over) => {
                    let Some(unit) = config::unit_of_proto(over.unit) else {
                        let reason = format!(
                            "descriptors[{index}].limit.unit: {} is not supported (second, minute, hour, day, week, month)",
                            over.unit
                        );
                        rls.warn(format_args!(
                            "RLS call refused: {reason} (domain {:?})",
                            request.domain
                        ));
                        return Err(Status::invalid_argument(reason));
                    };
                    Target::Override {
                        key: config.keys().counter_key(&request.domain, &entries),
                        rpu: over.requests_per_unit,
                        unit,
                    }
                }
                None => match config.lookup(&request.domain, &entries) {
                    Lookup::UnknownDomain => {
                        unknown_domain = true;
                        Target::None
                    }
                    Lookup::NoMatch => Target::None,
                    Lookup::Matched(matched) => Target::Rule(matched.rule, matched.key),
                },
            };
            found.push((target, hits, stated, descriptor.is_negative_hits));
        }
        if unknown_domain {
            rls.warn(format_args!(
                "RLS call for domain {:?}, which no --rls-config file has (known: {}): no limit applies",
                request.domain,
                config.domains().join(", ")
            ));
        }
        // `replaces`: a matched rule drops the rules it names.
        let replaced: Vec<&str> = found
            .iter()
            .filter_map(|(target, ..)| match target {
                Target::Rule(rule, _) => Some(rule.replaces.iter().map(String::as_str)),
                _ => None,
            })
            .flatten()
            .collect();

        let mut rules = Vec::new();
        let mut how = Vec::new();
        let mut plans = Vec::with_capacity(found.len());
        // A calendar rule counts in the period that contains this instant.
        let now = SystemClock.now();
        for (target, hits, stated, negative) in &found {
            let spend = spend_of(*hits, *stated);
            let plan = match target {
                Target::None => Plan::Free {
                    remaining: 0,
                    limit: None,
                    unlimited: false,
                },
                Target::Rule(rule, _)
                    if rule
                        .name
                        .as_deref()
                        .is_some_and(|name| replaced.contains(&name)) =>
                {
                    Plan::Free {
                        remaining: 0,
                        limit: None,
                        unlimited: false,
                    }
                }
                Target::Rule(rule, key) => {
                    let limit = RateLimit {
                        name: rule.name.clone().unwrap_or_default(),
                        requests_per_unit: rule.requests_per_unit,
                        unit: rule.unit.map_or(0, config::proto_unit),
                    };
                    let enforcement = enforcement_of(rule.shadow, rule.quota);
                    match &rule.kind {
                        RuleKind::Unlimited => Plan::Free {
                            remaining: u32::MAX,
                            limit: None,
                            unlimited: true,
                        },
                        _ if *negative => Plan::Free {
                            remaining: 0,
                            limit: Some(limit),
                            unlimited: false,
                        },
                        RuleKind::Blocked => Plan::Refused { limit, enforcement },
                        RuleKind::Limited {
                            algo, limit: diana, ..
                        } => ask(
                            &mut rules,
                            &mut how,
                            Piece {
                                key,
                                algo: *algo,
                                limit: &diana.at(now),
                                spend,
                                cost: *hits,
                                enforcement,
                            },
                            limit,
                            rule.label(),
                        ),
                    }
                }
                Target::Override { key, rpu, unit } => {
                    let limit = RateLimit {
                        name: String::new(),
                        requests_per_unit: *rpu,
                        unit: config::proto_unit(*unit),
                    };
                    match NonZeroU32::new(*rpu) {
                        _ if *negative => Plan::Free {
                            remaining: 0,
                            limit: Some(limit),
                            unlimited: false,
                        },
                        None => Plan::Refused {
                            limit,
                            enforcement: Enforcement::Enforced,
                        },
                        Some(rpu) => {
                            // A fixed window of `rpu` per unit; `MONTH` and `WEEK` by
                            // UTC's calendar (Envoy's override names no zone).
                            let diana = config::limit_of(
                                rpu,
                                *unit,
                                Zone::utc(),
                                |_| rpu,
                                NonZeroU32::new(config::DEFAULT_SLICES).unwrap_or(NonZeroU32::MIN),
                            )
                            .at(now);
                            ask(
                                &mut rules,
                                &mut how,
                                Piece {
                                    key,
                                    algo: &algo::FixedWindow,
                                    limit: &diana,
                                    spend,
                                    cost: *hits,
                                    enforcement: Enforcement::Enforced,
                                },
                                limit,
                                "override",
                            )
                        }
                    }
                }
            };
            plans.push(plan);
        }

        // Refused without asking: an enforced rule refused (a block, or a cost that can
        // never pass), or every quota rule of the call. The takes are then not charged:
        // the store only counts the counts and reads the rest (all as shadow checks).
        let refused = |wanted: Enforcement| {
            plans.iter().filter(move |plan| {
                matches!(plan, Plan::Refused { enforcement, .. } if *enforcement == wanted)
            })
        };
        let quotas = plans
            .iter()
            .filter(|plan| {
                matches!(
                    plan,
                    Plan::Refused {
                        enforcement: Enforcement::Quota,
                        ..
                    } | Plan::Asked {
                        enforcement: Enforcement::Quota,
                        ..
                    }
                )
            })
            .count();
        let refused_early = refused(Enforcement::Enforced).next().is_some()
            || (quotas > 0 && refused(Enforcement::Quota).count() == quotas);
        let total_want: u64 = rules.iter().map(|rule| u64::from(rule.want.get())).sum();
        if total_want > wire::MAX_TOTAL_WANT {
            let reason = format!(
                "hits_addend adds up to {total_want} over the call's descriptors, at most {}",
                wire::MAX_TOTAL_WANT
            );
            rls.warn(format_args!(
                "RLS call refused: {reason} (domain {:?})",
                request.domain
            ));
            return Err(Status::invalid_argument(reason));
        }
        if refused_early {
            if how.iter().any(|spending| spending.spend == Spend::Count) {
                for spending in &mut how {
                    if spending.spend == Spend::Take {
                        spending.spend = Spend::Check;
                    }
                    spending.enforcement = Enforcement::Shadow;
                }
            } else {
                // Nothing to count: the store is not asked (a blocked caller hammering
                // costs no round trip), and the other descriptors say nothing is known.
                rules.clear();
                how.clear();
            }
        }
        let legacy = how.iter().all(|spending| {
            spending.spend == Spend::Take && spending.enforcement != Enforcement::Quota
        });
        let ask_for = if legacy {
            Ask::Acquire
        } else {
            Ask::Spend(how)
        };
        let (outcomes, admitted) = if rules.is_empty() {
            (Vec::new(), true)
        } else {
            let algos: Vec<&'static str> = rules.iter().map(|rule| rule.algo.code()).collect();
            let spent = decide(
                state,
                RLS_PATH,
                rules,
                ask_for,
                arrived + budget,
                budget,
                Some(permit),
            )
            .await
            .map_err(|failure| {
                tracing::debug!(failure = ?failure, "RLS call answered with an error");
                failure.status()
            })?;
            for (algo, outcome) in algos.iter().zip(&spent.outcomes) {
                state
                    .metrics()
                    .decision(algo, outcome.result.allowed, outcome.result.granted);
            }
            (spent.outcomes, spent.admitted)
        };
        let over = refused_early || !admitted;

        let answered = |plan: &Plan<'_>| -> Option<Answered> {
            let Plan::Asked {
                rules: pieces,
                spend,
                cost,
                ..
            } = plan
            else {
                return None;
            };
            let results: Vec<&RuleResult> = outcomes
                .get(pieces.clone())
                .unwrap_or_default()
                .iter()
                .map(|outcome| &outcome.result)
                .collect();
            let last = results.last()?;
            // A take read as a check (the call was refused before the store was asked)
            // passes when its whole cost is there.
            let passed = if refused_early && *spend == Spend::Take {
                last.remaining >= *cost
            } else {
                results.iter().all(|result| result.allowed)
            };
            Some(Answered {
                passed,
                remaining: last.remaining,
                reset_ms: last.reset_ms,
                retry_ms: results
                    .iter()
                    .map(|result| result.retry_after_ms)
                    .max()
                    .unwrap_or(0),
            })
        };

        let mut statuses = Vec::with_capacity(plans.len());
        let mut passed_rules = Vec::new();
        // The descriptor the headers describe: the first that refused, else the one with
        // the least remaining.
        let mut tightest: Option<(bool, u64, Report<'_>)> = None;
        for (plan, (target, ..)) in plans.iter().zip(&found) {
            let status = match plan {
                Plan::Free {
                    remaining,
                    limit,
                    unlimited,
                } => {
                    // No limit (replaced, or none): passed, without metadata.
                    if !unlimited {
                        passed_rules.push(None);
                    }
                    DescriptorStatus {
                        code: Code::Ok as i32,
                        current_limit: limit.clone(),
                        limit_remaining: *remaining,
                        ..DescriptorStatus::default()
                    }
                }
                Plan::Refused { limit, enforcement } => {
                    let shadow = *enforcement == Enforcement::Shadow;
                    if shadow {
                        passed_rules.push(target.rule());
                    }
                    DescriptorStatus {
                        code: if shadow { Code::Ok } else { Code::OverLimit } as i32,
                        current_limit: Some(limit.clone()),
                        limit_remaining: 0,
                        ..DescriptorStatus::default()
                    }
                }
                Plan::Asked {
                    limit,
                    enforcement,
                    label,
                    rpu,
                    unit_seconds,
                    ..
                } => {
                    // Not answered (nothing asked): nothing known, nothing refused.
                    let answer = answered(plan);
                    let passed = answer.is_none_or(|answer| answer.passed);
                    let over_here = !passed && *enforcement != Enforcement::Shadow;
                    if !over_here {
                        passed_rules.push(target.rule());
                    }
                    if let Some(answer) = answer {
                        let refuses = !passed && *enforcement == Enforcement::Enforced;
                        let better = match &tightest {
                            None => true,
                            Some((refused, least, _)) => {
                                (refuses && !refused)
                                    || (refuses == *refused && answer.remaining < *least)
                            }
                        };
                        if better {
                            tightest = Some((
                                refuses,
                                answer.remaining,
                                Report {
                                    refused: refuses,
                                    remaining: answer.remaining,
                                    reset_ms: answer.reset_ms,
                                    retry_ms: answer.retry_ms,
                                    label,
                                    rpu: *rpu,
                                    unit_seconds: *unit_seconds,
                                },
                            ));
                        }
                    }
                    DescriptorStatus {
                        code: if over_here { Code::OverLimit } else { Code::Ok } as i32,
                        current_limit: Some(limit.clone()),
                        limit_remaining: answer.map_or(0, |answer| {
                            u32::try_from(answer.remaining).unwrap_or(u32::MAX)
                        }),
                        duration_until_reset: answer
                            .map(|answer| duration_of_millis(answer.reset_ms)),
                        ..DescriptorStatus::default()
                    }
                }
            };
            statuses.push(status);
        }
        let mut response = RateLimitResponse {
            overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
            statuses,
            ..RateLimitResponse::default()
        };
        if let Some((_, _, report)) = tightest {
            response.response_headers_to_add = headers(
                rls.headers(),
                Report {
                    refused: report.refused && over,
                    ..report
                },
            );
        }
        if rls.response_metadata() {
            response.dynamic_metadata = Some(metadata::answer(&request, &passed_rules));
        }
        Ok(response)
    }
}

/// Where a descriptor's counter is.
enum Target<'a> {
    None,
    Rule(&'a config::Rule, String),
    Override {
        key: String,
        rpu: u32,
        unit: RuleUnit,
    },
}

impl<'a> Target<'a> {
    /// The configured rule, if any.
    fn rule(&self) -> Option<&'a config::Rule> {
        match self {
            Target::Rule(rule, _) => Some(rule),
            _ => None,
        }
    }
}

/// A descriptor's counter and how it spends it.
struct Piece<'k> {
    key: &'k str,
    algo: &'static dyn Algorithm,
    limit: &'k Limit,
    spend: Spend,
    cost: u64,
    enforcement: Enforcement,
}

/// Adds the store rules of a descriptor (its cost in pieces of at most the wire's largest
/// `want`, on the same counter; a check is one rule), or refuses a take at once when the
/// limit can never grant its cost.
fn ask<'a>(
    rules: &mut Vec<OwnedRule>,
    how: &mut Vec<Spending>,
    piece: Piece<'_>,
    proto: RateLimit,
    label: &'a str,
) -> Plan<'a> {
    let Piece {
        key,
        algo,
        limit,
        spend,
        cost,
        enforcement,
    } = piece;
    if spend == Spend::Take && cost > algo.capacity(limit) {
        return Plan::Refused {
            limit: proto,
            enforcement,
        };
    }
    let start = rules.len();
    // A count above what one call may carry counts as that much (the counter is then past
    // any limit it could be compared with); a check is one rule of 1.
    let mut left = match spend {
        Spend::Check => 1,
        Spend::Count | Spend::Take => cost.clamp(1, wire::MAX_TOTAL_WANT),
    };
    while left > 0 {
        let want = left.min(u64::from(wire::MAX_WANT));
        left -= want;
        let Some(want) = u32::try_from(want).ok().and_then(NonZeroU32::new) else {
            break;
        };
        rules.push(OwnedRule {
            key: key.to_string(),
            algo,
            limit: limit.clone(),
            want,
            cost: want,
            dry_run: enforcement == Enforcement::Shadow,
        });
        how.push(Spending { spend, enforcement });
    }
    Plan::Asked {
        rules: start..rules.len(),
        spend,
        cost,
        limit: proto,
        enforcement,
        label,
        rpu: limit.rpu.get(),
        unit_seconds: limit.unit_seconds(),
    }
}

fn duration_of_millis(millis: u64) -> PbDuration {
    PbDuration {
        seconds: i64::try_from(millis / 1000).unwrap_or(i64::MAX),
        nanos: i32::try_from((millis % 1000) * 1_000_000).unwrap_or(0),
    }
}

/// What the headers describe.
#[derive(Clone, Copy)]
struct Report<'a> {
    refused: bool,
    remaining: u64,
    reset_ms: u64,
    retry_ms: u64,
    label: &'a str,
    rpu: u32,
    unit_seconds: u64,
}

/// The headers `style` asks for, about `report`.
fn headers(style: HeaderStyle, report: Report<'_>) -> Vec<HeaderValue> {
    let seconds = |ms: u64| ms.div_ceil(1000);
    let mut out = Vec::new();
    let mut add = |key: &str, value: String| {
        out.push(HeaderValue {
            key: key.to_string(),
            value,
            ..HeaderValue::default()
        });
    };
    match style {
        HeaderStyle::None => return out,
        HeaderStyle::Ratelimit => {
            // envoyproxy/ratelimit's three, and nothing else (no Retry-After).
            add(RATELIMIT_LIMIT, report.rpu.to_string());
            add(RATELIMIT_REMAINING, report.remaining.to_string());
            add(RATELIMIT_RESET, seconds(report.reset_ms).to_string());
            return out;
        }
        HeaderStyle::XRatelimit | HeaderStyle::Ietf | HeaderStyle::Both => {}
    }
    if report.refused {
        add(RETRY_AFTER, seconds(report.retry_ms).max(1).to_string());
    }
    if style.x_ratelimit() {
        add(X_RATELIMIT_LIMIT, report.rpu.to_string());
        add(X_RATELIMIT_REMAINING, report.remaining.to_string());
        add(X_RATELIMIT_RESET, seconds(report.reset_ms).to_string());
    }
    if style.ietf() {
        let name = sf_string(report.label);
        let t = if report.refused {
            seconds(report.retry_ms).max(1)
        } else {
            seconds(report.reset_ms)
        };
        add(
            RATELIMIT_POLICY,
            format!("{name};q={};w={}", report.rpu, report.unit_seconds),
        );
        add(RATELIMIT, format!("{name};r={};t={t}", report.remaining));
    }
    out
}

/// Why a call's shape is refused (`INVALID_ARGUMENT`); each names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidCall {
    #[error("domain: must not be empty")]
    NoDomain,
    #[error("domain: {bytes} bytes, at most {max}")]
    DomainTooLong { bytes: usize, max: usize },
    #[error("descriptors: must not be empty")]
    NoDescriptors,
    #[error("descriptors: at most {max} in one call, got {got}")]
    TooManyDescriptors { max: usize, got: usize },
    #[error("descriptors[{descriptor}].entries: must not be empty")]
    NoEntries { descriptor: usize },
    #[error("descriptors[{descriptor}].entries: at most {max}, got {got}")]
    TooManyEntries {
        descriptor: usize,
        max: usize,
        got: usize,
    },
    #[error("descriptors[{descriptor}].entries[{entry}].key: must not be empty")]
    EmptyKey { descriptor: usize, entry: usize },
    /// `key`: the entry's key, at most its first 64 bytes.
    #[error("descriptors[{descriptor}].entries[{entry}].{field}: {bytes} bytes, at most {max} (key {key:?})")]
    TooLong {
        descriptor: usize,
        entry: usize,
        field: &'static str,
        bytes: usize,
        max: usize,
        key: String,
    },
}

/// Checks the shape of a call.
pub fn check(request: &RateLimitRequest) -> Result<(), InvalidCall> {
    if request.domain.is_empty() {
        return Err(InvalidCall::NoDomain);
    }
    if request.domain.len() > config::MAX_TEXT_BYTES {
        return Err(InvalidCall::DomainTooLong {
            bytes: request.domain.len(),
            max: config::MAX_TEXT_BYTES,
        });
    }
    if request.descriptors.is_empty() {
        return Err(InvalidCall::NoDescriptors);
    }
    if request.descriptors.len() > wire::MAX_RULES {
        return Err(InvalidCall::TooManyDescriptors {
            max: wire::MAX_RULES,
            got: request.descriptors.len(),
        });
    }
    for (index, descriptor) in request.descriptors.iter().enumerate() {
        check_descriptor(index, descriptor)?;
    }
    Ok(())
}

fn check_descriptor(index: usize, descriptor: &RateLimitDescriptor) -> Result<(), InvalidCall> {
    if descriptor.entries.is_empty() {
        return Err(InvalidCall::NoEntries { descriptor: index });
    }
    if descriptor.entries.len() > config::MAX_ENTRIES {
        return Err(InvalidCall::TooManyEntries {
            descriptor: index,
            max: config::MAX_ENTRIES,
            got: descriptor.entries.len(),
        });
    }
    for (entry, pair) in descriptor.entries.iter().enumerate() {
        if pair.key.is_empty() {
            return Err(InvalidCall::EmptyKey {
                descriptor: index,
                entry,
            });
        }
        for (field, text) in [("key", &pair.key), ("value", &pair.value)] {
            if text.len() > config::MAX_TEXT_BYTES {
                return Err(InvalidCall::TooLong {
                    descriptor: index,
                    entry,
                    field,
                    bytes: text.len(),
                    max: config::MAX_TEXT_BYTES,
                    key: config::shown(&pair.key).to_string(),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;

    fn call(domain: &str, entries: &[(&str, &str)]) -> RateLimitRequest {
        RateLimitRequest {
            domain: domain.to_string(),
            descriptors: vec![RateLimitDescriptor {
                entries: entries
                    .iter()
                    .map(|(key, value)| Entry {
                        key: key.to_string(),
                        value: value.to_string(),
                    })
                    .collect(),
                ..RateLimitDescriptor::default()
            }],
            hits_addend: 0,
        }
    }

    #[test]
    fn calls_are_checked_naming_the_field() {
        assert_eq!(check(&call("d", &[("k", "v")])), Ok(()));
        assert_eq!(check(&call("", &[("k", "v")])), Err(InvalidCall::NoDomain));
        let mut empty = call("d", &[]);
        assert_eq!(
            check(&empty).map_err(|error| error.to_string()),
            Err("descriptors[0].entries: must not be empty".to_string())
        );
        empty.descriptors.clear();
        assert_eq!(check(&empty), Err(InvalidCall::NoDescriptors));
        assert_eq!(
            check(&call("d", &[("k", "v"), ("", "v")])),
            Err(InvalidCall::EmptyKey {
                descriptor: 0,
                entry: 1
            })
        );
        let long = "x".repeat(config::MAX_TEXT_BYTES + 1);
        assert_eq!(
            check(&call("d", &[("path", &long)])).map_err(|error| error.to_string()),
            Err(
                "descriptors[0].entries[0].value: 4097 bytes, at most 4096 (key \"path\")"
                    .to_string()
            )
        );
    }

    #[test]
    fn headers_describe_the_tightest_descriptor() {
        let report = || Report {
            refused: true,
            remaining: 0,
            reset_ms: 41_250,
            retry_ms: 1_500,
            label: "per \"ip\"",
            rpu: 10,
            unit_seconds: 60,
        };
        assert!(headers(HeaderStyle::None, report()).is_empty());
        let both: Vec<(String, String)> = headers(HeaderStyle::Both, report())
            .into_iter()
            .map(|header| (header.key, header.value))
            .collect();
        let expected = [
            ("retry-after", "2"),
            ("x-ratelimit-limit", "10"),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "42"),
            ("ratelimit-policy", "\"per \\\"ip\\\"\";q=10;w=60"),
            ("ratelimit", "\"per \\\"ip\\\"\";r=0;t=2"),
        ];
        assert_eq!(
            both,
            expected.map(|(key, value)| (key.to_string(), value.to_string()))
        );
        let admitted = Report {
            refused: false,
            remaining: 7,
            ..report()
        };
        let ietf: Vec<String> = headers(HeaderStyle::Ietf, admitted)
            .into_iter()
            .map(|header| format!("{}: {}", header.key, header.value))
            .collect();
        assert_eq!(
            ietf,
            [
                "ratelimit-policy: \"per \\\"ip\\\"\";q=10;w=60",
                "ratelimit: \"per \\\"ip\\\"\";r=7;t=42"
            ]
        );
    }
}
