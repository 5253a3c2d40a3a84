//! The answer Diana gives: the rejection response (status, body, `Retry-After`) and the
//! `X-RateLimit-*` headers of the rule that decided, in the document's header mode.

use crate::algo::Verdict;
use crate::config::{HeaderMode, ResponseSpec, Rule};
use crate::time::{ceil_seconds, ceil_seconds_at_least_one};
use crate::wire::RuleResult;

/// What one rule said about a request, in the units of the rate-limit headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuleReport {
    /// `X-RateLimit-Limit`: the rule's requests per unit.
    pub limit: u32,
    /// `X-RateLimit-Remaining`.
    pub remaining: u64,
    /// `X-RateLimit-Reset`: seconds until the limit has recovered.
    pub reset_seconds: u64,
    /// `Retry-After` (only meaningful on rejection): seconds, at least 1.
    pub retry_after_seconds: u64,
}

impl RuleReport {
    pub fn new(rule: &Rule, verdict: &Verdict) -> RuleReport {
        RuleReport {
            limit: rule.limit.rpu.get(),
            remaining: verdict.remaining,
            reset_seconds: ceil_seconds(verdict.reset),
            retry_after_seconds: ceil_seconds_at_least_one(verdict.retry_after),
        }
    }

    /// What the quota service's result for `rule` reports.
    pub fn from_result(rule: &Rule, result: &RuleResult) -> RuleReport {
        let millis = |ms: u64| ms.saturating_mul(1_000_000);
        RuleReport {
            limit: rule.limit.rpu.get(),
            remaining: result.remaining,
            reset_seconds: ceil_seconds(millis(result.reset_ms)),
            retry_after_seconds: ceil_seconds_at_least_one(millis(result.retry_after_ms)),
        }
    }

    /// The three `X-RateLimit-*` headers.
    pub fn headers(&self) -> [(&'static str, String); 3] {
        [
            ("x-ratelimit-limit", self.limit.to_string()),
            ("x-ratelimit-remaining", self.remaining.to_string()),
            ("x-ratelimit-reset", self.reset_seconds.to_string()),
        ]
    }
}

/// A local reply that rejects the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub status: u16,
    pub body: String,
    pub headers: Vec<(&'static str, String)>,
    /// Name of the rule that decided (for logs).
    pub rule: String,
}

impl Rejection {
    pub fn new(spec: &ResponseSpec, rule: &Rule, report: &RuleReport) -> Rejection {
        let mut headers = vec![("retry-after", report.retry_after_seconds.to_string())];
        if spec.headers != HeaderMode::None {
            headers.extend(report.headers());
        }
        Rejection {
            status: spec.status,
            body: spec.body.clone(),
            headers,
            rule: rule.name.clone(),
        }
    }
}

impl Rejection {
    /// A rejection whose rule is unknown (a policy that changed under a paused request).
    pub fn unnamed(spec: &ResponseSpec, report: &RuleReport) -> Rejection {
        let mut headers = vec![("retry-after", report.retry_after_seconds.to_string())];
        if spec.headers != HeaderMode::None {
            headers.extend(report.headers());
        }
        Rejection {
            status: spec.status,
            body: spec.body.clone(),
            headers,
            rule: String::new(),
        }
    }
}

/// Headers to add to an admitted request's response (`headers: all` only).
pub fn admitted_headers(
    spec: &ResponseSpec,
    report: Option<&RuleReport>,
) -> Vec<(&'static str, String)> {
    match (spec.headers, report) {
        (HeaderMode::All, Some(report)) => report.headers().to_vec(),
        _ => Vec::new(),
    }
}
