//! `ShouldRateLimit`: every descriptor of one call decided together, all or nothing.
//!
//! 1. The call is checked (a domain, 1 to 64 descriptors, each with 1 to 64 entries whose
//!    keys are not empty and whose keys and values have at most 4,096 bytes); a bad call is
//!    answered `INVALID_ARGUMENT` naming the field, with a warning in the log.
//! 2. Each descriptor finds its rule ([`RlsConfig::lookup`](super::config::RlsConfig::lookup)), or the limit it carries
//!    itself (`limit`, envoyproxy/ratelimit's override: a fixed window). A descriptor that
//!    matches no rule (or whose domain is unknown: a warning) is `OK` with no limit; an
//!    `unlimited` rule is `OK`; a rule `replaces`d by another matched rule of the same
//!    call is left out.
//! 3. The cost of a descriptor is its `hits_addend`, else the call's, else 1; 0 asks
//!    without taking (`OK`, nothing charged).
//! 4. The other descriptors go to the store in one decision: either every one has its cost
//!    available and each is charged, or none is (the call is `OVER_LIMIT`; the descriptors
//!    that were short say `OVER_LIMIT`, the others `OK`). `shadow_mode` rules are counted
//!    but never refuse (Diana's dry run). `requests_per_unit: 0` refuses everything.
//! 5. Each status carries the rule's limit, what remains and when the limit resets, so
//!    that Envoy's `enable_x_ratelimit_headers` works; with `--rls-headers`, the answer
//!    also asks Envoy to add `X-RateLimit-*` and/or the IETF fields of the tightest
//!    descriptor, and `Retry-After` when refused.
//! 6. A store that fails, or answers after the deadline, gives `UNAVAILABLE` before
//!    Envoy's timeout: Envoy applies `failure_mode_deny`.

use super::config::{self, Lookup, RuleKind};
use super::{budget, decide, HeaderStyle, OwnedRule, Rls, RLS_PATH};
use diana_core::algo::{self, Algorithm, Limit};
use diana_core::response::{
    sf_string, RATELIMIT, RATELIMIT_POLICY, RETRY_AFTER, X_RATELIMIT_LIMIT, X_RATELIMIT_REMAINING,
    X_RATELIMIT_RESET,
};
use diana_core::wire::{self, RuleResult};
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

/// What one descriptor of the call comes to before the store is asked.
enum Plan<'a> {
    /// No limit applies (no rule, unknown domain, replaced, a cost of 0, unlimited).
    Free {
        remaining: u32,
        limit: Option<RateLimit>,
    },
    /// Refused without asking the store (`requests_per_unit: 0`, or a cost the limit can
    /// never grant); `shadow`: counted as refused, the call not refused for it.
    Refused { limit: RateLimit, shadow: bool },
    /// Asked of the store: index into the store's rules.
    Asked {
        index: usize,
        limit: RateLimit,
        shadow: bool,
        label: &'a str,
        rpu: u32,
        unit_seconds: u64,
    },
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
            return Err(Status::resource_exhausted(crate::http::OVERLOADED));
        };
        let config = rls.config();
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
            let hits = descriptor
                .hits_addend
                .map_or(default_hits, |hits| hits.value);
            let target = match &descriptor.limit {
                Some(over) => {
                    let Some(unit) = config::unit_of_proto(over.unit) else {
                        let reason = format!(
                            "descriptors[{index}].limit.unit: {} is not supported (second, minute, hour, day)",
                            over.unit
                        );
                        rls.warn(format_args!(
                            "RLS call refused: {reason} (domain {:?})",
                            request.domain
                        ));
                        return Err(Status::invalid_argument(reason));
                    };
                    Target::Override {
                        key: config::counter_key(&request.domain, &entries),
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
            found.push((target, hits, descriptor.is_negative_hits));
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
            .filter_map(|(target, _, _)| match target {
                Target::Rule(rule, _) => Some(rule.replaces.iter().map(String::as_str)),
                _ => None,
            })
            .flatten()
            .collect();

        let mut rules = Vec::new();
        let mut plans = Vec::with_capacity(found.len());
        for (target, hits, negative) in &found {
            let plan = match target {
                Target::None => Plan::Free {
                    remaining: 0,
                    limit: None,
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
                    }
                }
                Target::Rule(rule, key) => {
                    let limit = RateLimit {
                        name: rule.name.clone().unwrap_or_default(),
                        requests_per_unit: rule.requests_per_unit,
                        unit: rule.unit.map_or(0, config::proto_unit),
                    };
                    match &rule.kind {
                        RuleKind::Unlimited => Plan::Free {
                            remaining: u32::MAX,
                            limit: None,
                        },
                        _ if *hits == 0 || *negative => Plan::Free {
                            remaining: 0,
                            limit: Some(limit),
                        },
                        RuleKind::Blocked => Plan::Refused {
                            limit,
                            shadow: rule.shadow,
                        },
                        RuleKind::Limited {
                            algo, limit: diana, ..
                        } => ask(
                            &mut rules,
                            key,
                            *algo,
                            diana,
                            *hits,
                            rule.shadow,
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
                        _ if *hits == 0 || *negative => Plan::Free {
                            remaining: 0,
                            limit: Some(limit),
                        },
                        None => Plan::Refused {
                            limit,
                            shadow: false,
                        },
                        Some(rpu) => {
                            let algo: &'static dyn Algorithm = &algo::FixedWindow;
                            let diana = Limit {
                                rpu,
                                unit: *unit,
                                burst: rpu,
                                slices: NonZeroU32::new(config::DEFAULT_SLICES)
                                    .unwrap_or(NonZeroU32::MIN),
                            };
                            ask(
                                &mut rules, key, algo, &diana, *hits, false, limit, "override",
                            )
                        }
                    }
                }
            };
            plans.push(plan);
        }

        // Refused without asking (a block, or a cost that can never pass): all or nothing,
        // so nothing is charged.
        let refused_early = plans
            .iter()
            .any(|plan| matches!(plan, Plan::Refused { shadow: false, .. }));
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
        let results: Vec<Option<RuleResult>> = if refused_early || rules.is_empty() {
            vec![None; rules.len()]
        } else {
            let algos: Vec<&'static str> = rules.iter().map(|rule| rule.algo.code()).collect();
            let outcomes = decide(
                state,
                RLS_PATH,
                rules,
                arrived + budget,
                budget,
                Some(permit),
            )
            .await
            .map_err(|failure| {
                tracing::debug!(failure = ?failure, "RLS call answered with an error");
                failure.status()
            })?;
            for (algo, outcome) in algos.iter().zip(&outcomes) {
                state
                    .metrics()
                    .decision(algo, outcome.result.allowed, outcome.result.granted);
            }
            outcomes
                .into_iter()
                .map(|outcome| Some(outcome.result))
                .collect()
        };

        let mut statuses = Vec::with_capacity(plans.len());
        let mut over = false;
        // The descriptor the headers describe: the first that refused, else the one with
        // the least remaining.
        let mut tightest: Option<(bool, u64, u64, u64, &str, u32, u64)> = None;
        for plan in &plans {
            let status = match plan {
                Plan::Free { remaining, limit } => DescriptorStatus {
                    code: Code::Ok as i32,
                    current_limit: limit.clone(),
                    limit_remaining: *remaining,
                    ..DescriptorStatus::default()
                },
                Plan::Refused { limit, shadow } => {
                    over |= !shadow;
                    DescriptorStatus {
                        code: if *shadow { Code::Ok } else { Code::OverLimit } as i32,
                        current_limit: Some(limit.clone()),
                        limit_remaining: 0,
                        ..DescriptorStatus::default()
                    }
                }
                Plan::Asked {
                    index,
                    limit,
                    shadow,
                    label,
                    rpu,
                    unit_seconds,
                } => {
                    let result = results.get(*index).copied().flatten();
                    // Not asked (another descriptor refused first): nothing known.
                    let allowed = result.is_none_or(|result| result.allowed);
                    let refuses = !allowed && !shadow;
                    over |= refuses;
                    let remaining = result.map_or(0, |result| result.remaining);
                    let reset_ms = result.map_or(0, |result| result.reset_ms);
                    let retry_ms = result.map_or(0, |result| result.retry_after_ms);
                    if result.is_some() {
                        let better = match tightest {
                            None => true,
                            Some((refused, least, ..)) => {
                                (refuses && !refused) || (refuses == refused && remaining < least)
                            }
                        };
                        if better {
                            tightest = Some((
                                refuses,
                                remaining,
                                reset_ms,
                                retry_ms,
                                label,
                                *rpu,
                                *unit_seconds,
                            ));
                        }
                    }
                    DescriptorStatus {
                        code: if refuses { Code::OverLimit } else { Code::Ok } as i32,
                        current_limit: Some(limit.clone()),
                        limit_remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
                        duration_until_reset: result.map(|_| duration_of_millis(reset_ms)),
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
        if let Some((refused, remaining, reset_ms, retry_ms, label, rpu, unit_seconds)) = tightest {
            response.response_headers_to_add = headers(
                rls.headers(),
                Report {
                    refused: refused && over,
                    remaining,
                    reset_ms,
                    retry_ms,
                    label,
                    rpu,
                    unit_seconds,
                },
            );
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
        unit: diana_core::time::Unit,
    },
}

/// Adds a store rule for a descriptor with a cost of `hits`, or refuses it at once when
/// the limit can never grant that much.
#[allow(clippy::too_many_arguments)]
fn ask<'a>(
    rules: &mut Vec<OwnedRule>,
    key: &str,
    algo: &'static dyn Algorithm,
    limit: &Limit,
    hits: u64,
    shadow: bool,
    proto: RateLimit,
    label: &'a str,
) -> Plan<'a> {
    let cost = u32::try_from(hits)
        .ok()
        .filter(|&hits| hits <= wire::MAX_WANT && u64::from(hits) <= algo.capacity(limit))
        .and_then(NonZeroU32::new);
    let Some(cost) = cost else {
        return Plan::Refused {
            limit: proto,
            shadow,
        };
    };
    rules.push(OwnedRule {
        key: key.to_string(),
        algo,
        limit: *limit,
        want: cost,
        cost,
        dry_run: shadow,
    });
    Plan::Asked {
        index: rules.len() - 1,
        limit: proto,
        shadow,
        label,
        rpu: limit.rpu.get(),
        unit_seconds: limit.unit.seconds(),
    }
}

fn duration_of_millis(millis: u64) -> PbDuration {
    PbDuration {
        seconds: i64::try_from(millis / 1000).unwrap_or(i64::MAX),
        nanos: i32::try_from((millis % 1000) * 1_000_000).unwrap_or(0),
    }
}

/// What the headers describe.
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
    if style == HeaderStyle::None {
        return out;
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
