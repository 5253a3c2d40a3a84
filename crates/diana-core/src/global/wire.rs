//! The wire protocol between the filter and the quota service (`diana-quota`): JSON over
//! HTTP/1.1. Plain serde types, no I/O, so the wasm filter and the service share them.
//! The full description, with examples, limits and error codes, is `docs/wire-format.md`.
//!
//! ```text
//! POST /v1/acquire   {"rules":[{"key":"…","algo":"TB","rpu":10,"unit":"second","burst":10,"slices":10,"want":1}]}
//! 200                {"results":[{"allowed":true,"granted":1,"remaining":9,"reset_ms":100,"retry_after_ms":0,"delay_ms":0}]}
//! 400 / 413 / 415 / 503   {"error":"rules[2].rpu: must be ≥ 1"}
//! ```

use crate::algo::{self, Algorithm, Limit, Verdict};
use crate::time::{Nanos, Unit};
use serde::{Deserialize, Serialize};
use std::num::NonZeroU32;

/// Asks for tokens; the answer carries admitted leaky-bucket delays for the caller to apply.
pub const ACQUIRE_PATH: &str = "/v1/acquire";
/// Same as [`ACQUIRE_PATH`], but the service itself waits out leaky-bucket delays (hosts
/// that cannot pause a request, e.g. nginx).
pub const WAIT_PATH: &str = "/v1/wait";
/// The content type of requests and answers.
pub const CONTENT_TYPE: &str = "application/json";

/// Most rules in one request.
pub const MAX_RULES: usize = 64;
/// Longest key, in bytes.
pub const MAX_KEY_BYTES: usize = 128;
/// Most sliding-window slices.
pub const MAX_SLICES: u32 = 60;
/// Largest lease one rule may ask for.
pub const MAX_WANT: u32 = 100_000;
/// Largest request body, in bytes (larger: 413).
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// Longest delay `/v1/wait` sleeps before answering, in milliseconds.
pub const MAX_WAIT_MS: u64 = 10_000;

/// `POST /v1/acquire` and `POST /v1/wait` body: every global rule of one gateway request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcquireRequest {
    pub rules: Vec<RuleRequest>,
}

/// One rule of an [`AcquireRequest`]: which counter, its limit, and how many tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuleRequest {
    /// `<rule-id-hex>:<identity-hex>`: at most [`MAX_KEY_BYTES`] of `[A-Za-z0-9:_.-]`.
    pub key: String,
    /// Algorithm code or alias (`W`, `SW`, `LB`, `TB`, `token bucket`, …, case-insensitive).
    pub algo: String,
    /// Requests per unit, ≥ 1.
    pub rpu: u32,
    /// `second`, `minute`, `hour`, `day`.
    pub unit: String,
    /// Token-bucket capacity / leaky-bucket queue length, ≥ 1 (ignored by W and SW).
    pub burst: u32,
    /// Sliding-window slices, 1..=[`MAX_SLICES`] (ignored by the other algorithms).
    pub slices: u32,
    /// Tokens asked for (the lease size), 1..=[`MAX_WANT`]. Default 1.
    #[serde(default = "one")]
    pub want: u32,
}

fn one() -> u32 {
    1
}

/// The answer to an [`AcquireRequest`]: one result per rule, in the same order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AcquireResponse {
    pub results: Vec<RuleResult>,
}

/// The decision for one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RuleResult {
    /// `granted > 0`.
    pub allowed: bool,
    /// Tokens granted, `0..=want`; never more than the limit has available.
    pub granted: u32,
    /// Requests that would still be admitted right now, after this decision.
    pub remaining: u64,
    /// Milliseconds until the limit has fully recovered (window end, bucket full, queue empty).
    pub reset_ms: u64,
    /// When denied: milliseconds until one request would be admitted. 0 when allowed.
    pub retry_after_ms: u64,
    /// Leaky bucket: milliseconds the admitted request must be delayed (its slot is
    /// reserved). The `i`-th token of a lease (from 0) leaves at `delay_ms + i·unit/rpu`.
    #[serde(default)]
    pub delay_ms: u64,
}

/// The body of every non-200 answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorResponse {
    pub error: String,
}

/// A validated [`RuleRequest`], with its algorithm and limit resolved.
#[derive(Debug, Clone, Copy)]
pub struct ResolvedRule<'a> {
    pub key: &'a str,
    pub algo: &'static dyn Algorithm,
    pub limit: Limit,
    pub want: NonZeroU32,
}

const NANOS_PER_MILLI: Nanos = 1_000_000;

/// Nanoseconds to milliseconds, rounded up (a wait is never announced shorter than it is).
pub fn ceil_millis(duration: Nanos) -> u64 {
    duration.div_ceil(NANOS_PER_MILLI)
}

impl RuleResult {
    /// The wire form of an algorithm's verdict (durations rounded up to milliseconds).
    pub fn from_verdict(verdict: &Verdict) -> RuleResult {
        RuleResult {
            allowed: verdict.allowed(),
            granted: verdict.granted,
            remaining: verdict.remaining,
            reset_ms: ceil_millis(verdict.reset),
            retry_after_ms: if verdict.allowed() {
                0
            } else {
                ceil_millis(verdict.retry_after)
            },
            delay_ms: if verdict.allowed() {
                ceil_millis(verdict.delay)
            } else {
                0
            },
        }
    }
}

impl RuleRequest {
    /// The request for `want` tokens of a rule with this algorithm and limit.
    pub fn new(key: String, algo: &dyn Algorithm, limit: &Limit, want: u32) -> RuleRequest {
        RuleRequest {
            key,
            algo: algo.code().to_string(),
            rpu: limit.rpu.get(),
            unit: limit.unit.name().to_string(),
            burst: limit.burst.get(),
            slices: limit.slices.get(),
            want,
        }
    }

    /// Checks this rule (the `index`-th of its request) and resolves it.
    pub fn resolve(&self, index: usize) -> Result<ResolvedRule<'_>, String> {
        let field = |name: &str| format!("rules[{index}].{name}");
        check_key(&self.key).map_err(|reason| format!("{}: {reason}", field("key")))?;
        let algo = algo::lookup(&self.algo).ok_or_else(|| {
            format!(
                "{}: unknown algorithm {:?} (known: {})",
                field("algo"),
                self.algo,
                algo::known_names().join(", ")
            )
        })?;
        let unit = Unit::parse(&self.unit).ok_or_else(|| {
            format!(
                "{}: unknown unit {:?} (known: second, minute, hour, day)",
                field("unit"),
                self.unit
            )
        })?;
        let rpu =
            NonZeroU32::new(self.rpu).ok_or_else(|| format!("{}: must be ≥ 1", field("rpu")))?;
        let burst = NonZeroU32::new(self.burst)
            .ok_or_else(|| format!("{}: must be ≥ 1", field("burst")))?;
        let slices = NonZeroU32::new(self.slices)
            .filter(|slices| slices.get() <= MAX_SLICES)
            .ok_or_else(|| {
                format!(
                    "{}: must be between 1 and {MAX_SLICES}, got {}",
                    field("slices"),
                    self.slices
                )
            })?;
        let want = NonZeroU32::new(self.want)
            .filter(|want| want.get() <= MAX_WANT)
            .ok_or_else(|| {
                format!(
                    "{}: must be between 1 and {MAX_WANT}, got {}",
                    field("want"),
                    self.want
                )
            })?;
        Ok(ResolvedRule {
            key: &self.key,
            algo,
            limit: Limit {
                rpu,
                unit,
                burst,
                slices,
            },
            want,
        })
    }
}

fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("must not be empty".to_string());
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(format!("{} bytes, at most {MAX_KEY_BYTES}", key.len()));
    }
    match key.char_indices().find(|&(_, c)| !is_key_char(c)) {
        Some((at, c)) => Err(format!(
            "invalid character {c:?} at byte {at} (allowed: A-Z a-z 0-9 : _ . -)"
        )),
        None => Ok(()),
    }
}

fn is_key_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, ':' | '_' | '.' | '-')
}

impl AcquireRequest {
    /// Checks every limit of the format and resolves each rule, in order.
    pub fn resolve(&self) -> Result<Vec<ResolvedRule<'_>>, String> {
        if self.rules.is_empty() {
            return Err("rules: must contain at least one rule".to_string());
        }
        if self.rules.len() > MAX_RULES {
            return Err(format!(
                "rules: at most {MAX_RULES} rules, got {}",
                self.rules.len()
            ));
        }
        self.rules
            .iter()
            .enumerate()
            .map(|(index, rule)| rule.resolve(index))
            .collect()
    }
}

/// Checks a request against every limit of the format; the error names the field
/// (`rules[2].rpu: must be ≥ 1`). Shared by the filter (before sending) and the service.
pub fn validate(request: &AcquireRequest) -> Result<(), String> {
    request.resolve().map(|_| ())
}

/// Parses a request body (without checking its size) and validates it. Syntax and type
/// errors name the field and position: `rules[0].rpu: invalid type: string "10", expected u32 at line 1 column 42`.
pub fn decode_request(body: &[u8]) -> Result<AcquireRequest, String> {
    let request: AcquireRequest = decode_json(body)?;
    validate(&request)?;
    Ok(request)
}

/// Parses an answer body and checks it against the request it answers: one result per
/// rule, `granted ≤ want`, `allowed == (granted > 0)`.
pub fn decode_response(request: &AcquireRequest, body: &[u8]) -> Result<AcquireResponse, String> {
    let response: AcquireResponse = decode_json(body)?;
    validate_response(request, &response)?;
    Ok(response)
}

/// Checks an answer against the request it answers (see [`decode_response`]).
pub fn validate_response(
    request: &AcquireRequest,
    response: &AcquireResponse,
) -> Result<(), String> {
    if response.results.len() != request.rules.len() {
        return Err(format!(
            "results: {} results for {} rules",
            response.results.len(),
            request.rules.len()
        ));
    }
    for (index, (rule, result)) in request.rules.iter().zip(&response.results).enumerate() {
        if result.granted > rule.want {
            return Err(format!(
                "results[{index}].granted: {} granted, {} asked",
                result.granted, rule.want
            ));
        }
        if result.allowed != (result.granted > 0) {
            return Err(format!(
                "results[{index}].allowed: {} with {} granted",
                result.allowed, result.granted
            ));
        }
    }
    Ok(())
}

fn decode_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, String> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let value: T = serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let path = error.path().to_string();
        if path == "." {
            error.into_inner().to_string()
        } else {
            format!("{path}: {}", error.into_inner())
        }
    })?;
    deserializer.end().map_err(|error| error.to_string())?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )]
    use super::*;

    fn rule() -> RuleRequest {
        RuleRequest {
            key: "00ff:abc".to_string(),
            algo: "TB".to_string(),
            rpu: 10,
            unit: "second".to_string(),
            burst: 10,
            slices: 10,
            want: 1,
        }
    }

    type Mutation = Box<dyn Fn(&mut RuleRequest)>;

    fn request(rules: Vec<RuleRequest>) -> AcquireRequest {
        AcquireRequest { rules }
    }

    #[test]
    fn example_round_trips() {
        let body = br#"{"rules":[{"key":"5f3a:9c","algo":"TB","rpu":10,"unit":"second","burst":10,"slices":10,"want":1}]}"#;
        let decoded = decode_request(body).unwrap();
        assert_eq!(decoded.rules[0].key, "5f3a:9c");
        let encoded = serde_json::to_vec(&decoded).unwrap();
        assert_eq!(encoded, body.to_vec());
        let answer = br#"{"results":[{"allowed":true,"granted":1,"remaining":9,"reset_ms":100,"retry_after_ms":0,"delay_ms":0}]}"#;
        let response = decode_response(&decoded, answer).unwrap();
        assert_eq!(serde_json::to_vec(&response).unwrap(), answer.to_vec());
    }

    #[test]
    fn want_defaults_to_one_and_unknown_fields_are_ignored() {
        let body = br#"{"rules":[{"key":"k","algo":"sliding window","rpu":3,"unit":"Minutes","burst":1,"slices":6,"future":true}]}"#;
        let decoded = decode_request(body).unwrap();
        assert_eq!(decoded.rules[0].want, 1);
        let resolved = decoded.resolve().unwrap();
        assert_eq!(resolved[0].limit.unit, Unit::Minute);
        assert_eq!(resolved[0].limit.slices.get(), 6);
    }

    #[test]
    fn every_limit_has_a_named_reason() {
        let cases: Vec<(Mutation, &str)> = vec![
            (Box::new(|r| r.rpu = 0), "rules[2].rpu: must be ≥ 1"),
            (Box::new(|r| r.burst = 0), "rules[2].burst: must be ≥ 1"),
            (
                Box::new(|r| r.slices = 0),
                "rules[2].slices: must be between 1 and 60, got 0",
            ),
            (
                Box::new(|r| r.slices = 61),
                "rules[2].slices: must be between 1 and 60, got 61",
            ),
            (
                Box::new(|r| r.want = 0),
                "rules[2].want: must be between 1 and 100000, got 0",
            ),
            (
                Box::new(|r| r.want = 100_001),
                "rules[2].want: must be between 1 and 100000, got 100001",
            ),
            (
                Box::new(|r| r.key = String::new()),
                "rules[2].key: must not be empty",
            ),
            (
                Box::new(|r| r.key = "k".repeat(129)),
                "rules[2].key: 129 bytes, at most 128",
            ),
            (
                Box::new(|r| r.key = "ab{c}".to_string()),
                "rules[2].key: invalid character '{' at byte 2 (allowed: A-Z a-z 0-9 : _ . -)",
            ),
            (
                Box::new(|r| r.unit = "fortnight".to_string()),
                "rules[2].unit: unknown unit \"fortnight\"",
            ),
            (
                Box::new(|r| r.algo = "XX".to_string()),
                "rules[2].algo: unknown algorithm \"XX\"",
            ),
        ];
        for (mutate, expected) in cases {
            let mut bad = rule();
            mutate(&mut bad);
            let error = validate(&request(vec![rule(), rule(), bad])).unwrap_err();
            assert!(
                error.starts_with(expected),
                "{error:?} does not start with {expected:?}"
            );
        }
        assert!(validate(&request(vec![rule(); MAX_RULES])).is_ok());
        assert_eq!(
            validate(&request(vec![rule(); MAX_RULES + 1])).unwrap_err(),
            "rules: at most 64 rules, got 65"
        );
        assert_eq!(
            validate(&request(vec![])).unwrap_err(),
            "rules: must contain at least one rule"
        );
        let mut longest = rule();
        longest.key = "a".repeat(MAX_KEY_BYTES);
        assert!(validate(&request(vec![longest])).is_ok());
    }

    #[test]
    fn syntax_errors_name_the_field() {
        let cases: [(&[u8], &str); 6] = [
            (
                br#"{"rules":[{"key":"k","algo":"TB","rpu":"10"}]}"#,
                "rules[0].rpu: invalid type: string \"10\", expected u32",
            ),
            (
                br#"{"rules":[{"key":"k","algo":"TB","rpu":-1}]}"#,
                "rules[0].rpu: invalid value: integer `-1`, expected u32",
            ),
            (
                br#"{"rules":[{"key":"k","algo":"TB","rpu":1}]}"#,
                "rules[0]: missing field `unit`",
            ),
            (br#"{"rule":[]}"#, "missing field `rules`"),
            (b"not json", "expected ident"),
            (br#"{"rules":[]} trailing"#, "trailing characters"),
        ];
        for (body, expected) in cases {
            let error = decode_request(body).unwrap_err();
            assert!(
                error.starts_with(expected),
                "{error:?} does not start with {expected:?}"
            );
        }
    }

    #[test]
    fn answers_are_checked_against_the_request() {
        let asked = request(vec![rule(), rule()]);
        let ok = RuleResult {
            allowed: true,
            granted: 1,
            ..RuleResult::default()
        };
        assert!(validate_response(
            &asked,
            &AcquireResponse {
                results: vec![ok, ok]
            }
        )
        .is_ok());
        assert_eq!(
            validate_response(&asked, &AcquireResponse { results: vec![ok] }).unwrap_err(),
            "results: 1 results for 2 rules"
        );
        let greedy = RuleResult { granted: 2, ..ok };
        assert_eq!(
            validate_response(
                &asked,
                &AcquireResponse {
                    results: vec![ok, greedy]
                }
            )
            .unwrap_err(),
            "results[1].granted: 2 granted, 1 asked"
        );
        let liar = RuleResult {
            allowed: true,
            granted: 0,
            ..ok
        };
        assert!(validate_response(
            &asked,
            &AcquireResponse {
                results: vec![liar, ok]
            }
        )
        .is_err());
    }

    #[test]
    fn verdicts_round_up_to_milliseconds() {
        let verdict = Verdict {
            granted: 2,
            remaining: 3,
            reset: 1_000_001,
            retry_after: 0,
            delay: 1,
        };
        let result = RuleResult::from_verdict(&verdict);
        assert_eq!(
            result,
            RuleResult {
                allowed: true,
                granted: 2,
                remaining: 3,
                reset_ms: 2,
                retry_after_ms: 0,
                delay_ms: 1
            }
        );
        let denied = Verdict {
            granted: 0,
            remaining: 0,
            reset: 5_000_000,
            retry_after: 2_500_000,
            delay: 0,
        };
        let result = RuleResult::from_verdict(&denied);
        assert!(!result.allowed);
        assert_eq!((result.reset_ms, result.retry_after_ms), (5, 3));
    }

    #[test]
    fn new_copies_the_limit() {
        let algo = algo::default_algorithm();
        let limit = Limit {
            rpu: NonZeroU32::new(5).unwrap(),
            unit: Unit::Hour,
            burst: NonZeroU32::new(7).unwrap(),
            slices: NonZeroU32::new(4).unwrap(),
        };
        let rule = RuleRequest::new("a:b".to_string(), algo, &limit, 3);
        let resolved = rule.resolve(0).unwrap();
        assert_eq!(resolved.limit, limit);
        assert_eq!(resolved.want.get(), 3);
        assert_eq!(resolved.algo.code(), algo.code());
    }
}
