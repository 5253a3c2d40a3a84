//! The answer Diana gives: the rejection response (status, body, `Retry-After`) and the
//! rate-limit headers of the rule that decided, in the document's header mode
//! (`response.headers`: when) and style (`response.header_style`: which fields).
//!
//! Styles:
//! - `x-ratelimit`: `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`;
//! - `ietf`: the fields of draft-ietf-httpapi-ratelimit-headers-10, each a structured-field
//!   List (RFC 8941) of one Item, a String naming the rule, with Integer parameters:
//!   `RateLimit-Policy: "<name>";q=<rpu>;w=<unit in seconds>` and
//!   `RateLimit: "<name>";r=<remaining>;t=<seconds>`, where `t` is, on a rejection, the
//!   seconds until a request would be admitted (the `Retry-After` value) and, on an admitted
//!   answer, the seconds until the limit has fully recovered;
//! - `both`: both sets.
//!
//! The IETF fields need the rule's name: a rejection whose rule is unknown
//! ([`Rejection::unnamed`]) carries the `X-RateLimit-*` fields only.

use crate::algo::Verdict;
use crate::config::{HeaderMode, ResponseSpec, Rule};
use crate::time::{ceil_seconds, ceil_seconds_at_least_one, Nanos};
use crate::wire::RuleResult;

/// Header names, lower case (HTTP/2 requires it; HTTP/1 hosts print them as given).
pub const RETRY_AFTER: &str = "retry-after";
pub const X_RATELIMIT_LIMIT: &str = "x-ratelimit-limit";
pub const X_RATELIMIT_REMAINING: &str = "x-ratelimit-remaining";
pub const X_RATELIMIT_RESET: &str = "x-ratelimit-reset";
pub const RATELIMIT_POLICY: &str = "ratelimit-policy";
pub const RATELIMIT: &str = "ratelimit";

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
        RuleReport {
            limit: rule.limit.rpu.get(),
            remaining: result.remaining,
            reset_seconds: ceil_seconds(Nanos::saturating_from_millis(result.reset_ms)),
            retry_after_seconds: ceil_seconds_at_least_one(Nanos::saturating_from_millis(
                result.retry_after_ms,
            )),
        }
    }

    /// The three `X-RateLimit-*` headers.
    pub fn headers(&self) -> [(&'static str, String); 3] {
        [
            (X_RATELIMIT_LIMIT, self.limit.to_string()),
            (X_RATELIMIT_REMAINING, self.remaining.to_string()),
            (X_RATELIMIT_RESET, self.reset_seconds.to_string()),
        ]
    }

    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10) of
    /// `rule`. `rejected`: `t` is the wait until a request would be admitted
    /// (`Retry-After`); otherwise the time until the limit has recovered.
    pub fn ietf_headers(&self, rule: &Rule, rejected: bool) -> [(&'static str, String); 2] {
        let name = sf_string(&rule.name);
        let t = if rejected {
            self.retry_after_seconds
        } else {
            self.reset_seconds
        };
        // A concurrency limit has no window: its quota unit says what it counts.
        let policy = if rule.algo.holds_until_done() {
            format!("{name};q={};qu=\"concurrency\"", rule.limit.rpu.get())
        } else if rule.limit.calendar.is_some() {
            // A week or a month is no fixed number of seconds (a month of 28 to 31 days, a
            // week of a change of the clocks): `w` is optional, and left out rather than
            // wrong. `t` still says when the period ends.
            format!("{name};q={}", rule.limit.rpu.get())
        } else {
            format!(
                "{name};q={};w={}",
                rule.limit.rpu.get(),
                rule.limit.unit.seconds()
            )
        };
        [
            (RATELIMIT_POLICY, policy),
            (RATELIMIT, format!("{name};r={};t={t}", self.remaining)),
        ]
    }
}

/// `text` as a structured-field String (RFC 8941 §3.3.3): in double quotes, with `"` and
/// `\` escaped by a backslash. Only printable ASCII (0x20–0x7E) may appear in one; a rule
/// name is refused at load otherwise, so the `_` that would stand for any other character
/// is never sent for a valid policy.
pub fn sf_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('_'),
        }
    }
    out.push('"');
    out
}

/// The rate-limit headers of a report in `spec`'s style (the caller checks the mode).
/// `rule`: the rule the report is about; without it the IETF fields, which name the rule,
/// are left out.
fn rate_limit_headers(
    spec: &ResponseSpec,
    rule: Option<&Rule>,
    report: &RuleReport,
    rejected: bool,
) -> Vec<(&'static str, String)> {
    let mut headers = Vec::with_capacity(5);
    if spec.header_style.x_ratelimit() {
        headers.extend(report.headers());
    }
    if let (true, Some(rule)) = (spec.header_style.ietf(), rule) {
        headers.extend(report.ietf_headers(rule, rejected));
    }
    headers
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
        Rejection::build(spec, Some(rule), report)
    }

    /// A rejection whose rule is unknown (a policy that changed under a paused request):
    /// no IETF fields, which would have to name it.
    pub fn unnamed(spec: &ResponseSpec, report: &RuleReport) -> Rejection {
        Rejection::build(spec, None, report)
    }

    /// The fast-fail answer of an open (or full half-open) breaker named `name`: the
    /// document's response, `Retry-After` the seconds until it probes again, and the
    /// rate-limit fields as for a limit that has nothing left (`limit` 0), naming the
    /// breaker in the IETF fields (`RateLimit-Policy: "<name>";q=0`).
    pub fn breaker(spec: &ResponseSpec, name: &str, retry_after_seconds: u64) -> Rejection {
        let report = RuleReport {
            limit: 0,
            remaining: 0,
            reset_seconds: retry_after_seconds,
            retry_after_seconds,
        };
        let mut headers = vec![(RETRY_AFTER, retry_after_seconds.to_string())];
        if spec.headers != HeaderMode::None {
            if spec.header_style.x_ratelimit() {
                headers.extend(report.headers());
            }
            if spec.header_style.ietf() {
                let name = sf_string(name);
                headers.push((RATELIMIT_POLICY, format!("{name};q=0")));
                headers.push((RATELIMIT, format!("{name};r=0;t={retry_after_seconds}")));
            }
        }
        Rejection {
            status: spec.status,
            body: spec.body.clone(),
            headers,
            rule: name.to_string(),
        }
    }

    fn build(spec: &ResponseSpec, rule: Option<&Rule>, report: &RuleReport) -> Rejection {
        let mut headers = vec![(RETRY_AFTER, report.retry_after_seconds.to_string())];
        if spec.headers != HeaderMode::None {
            headers.extend(rate_limit_headers(spec, rule, report, true));
        }
        Rejection {
            status: spec.status,
            body: spec.body.clone(),
            headers,
            rule: rule.map_or_else(String::new, |rule| rule.name.clone()),
        }
    }
}

/// Headers to add to an admitted request's response (`headers: all` only), from the
/// admitting rule with the fewest remaining requests and its report.
pub fn admitted_rule_headers(
    spec: &ResponseSpec,
    tightest: Option<(&Rule, &RuleReport)>,
) -> Vec<(&'static str, String)> {
    match (spec.headers, tightest) {
        (HeaderMode::All, Some((rule, report))) => {
            rate_limit_headers(spec, Some(rule), report, false)
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_policy;

    /// A policy with one rule `name` of `rpu` per `unit`, and `response` as its section.
    fn document(name: &str, rpu: u32, unit: &str, response: &str) -> crate::config::Policy {
        let text = format!(
            "resources:\n  - Url: /\n    rules:\n      - {{rpu: {rpu}, unit: {unit}, name: '{}'}}\nresponse: {response}\n",
            name.replace('\'', "''")
        );
        match parse_policy(&text) {
            Ok(policy) => policy,
            Err(err) => panic!("{err}\n{text}"),
        }
    }

    fn first_rule(policy: &crate::config::Policy) -> &Rule {
        policy.rules().next().expect("one rule")
    }

    /// The rejection of [`REPORT`] by the one rule of [`document`]`(name, rpu, unit, response)`.
    fn reject(name: &str, rpu: u32, unit: &str, response: &str) -> Rejection {
        let policy = document(name, rpu, unit, response);
        Rejection::new(&policy.response, first_rule(&policy), &REPORT)
    }

    const REPORT: RuleReport = RuleReport {
        limit: 10,
        remaining: 0,
        reset_seconds: 42,
        retry_after_seconds: 6,
    };

    fn names(headers: &[(&'static str, String)]) -> Vec<&'static str> {
        headers.iter().map(|(name, _)| *name).collect()
    }

    fn value<'h>(headers: &'h [(&'static str, String)], name: &str) -> Option<&'h str> {
        headers
            .iter()
            .find(|(known, _)| *known == name)
            .map(|(_, value)| value.as_str())
    }

    #[test]
    fn x_ratelimit_is_the_default_style() {
        let rejection = reject("login_burst", 10, "minute", "{}");
        assert_eq!(
            rejection.headers,
            vec![
                ("retry-after", "6".to_string()),
                ("x-ratelimit-limit", "10".to_string()),
                ("x-ratelimit-remaining", "0".to_string()),
                ("x-ratelimit-reset", "42".to_string()),
            ]
        );
        assert_eq!(rejection.rule, "login_burst");
    }

    #[test]
    fn ietf_rejection_names_the_rule_and_waits_for_retry_after() {
        let rejection = reject("login_burst", 10, "minute", "{header_style: ietf}");
        assert_eq!(
            rejection.headers,
            vec![
                ("retry-after", "6".to_string()),
                ("ratelimit-policy", "\"login_burst\";q=10;w=60".to_string()),
                ("ratelimit", "\"login_burst\";r=0;t=6".to_string()),
            ]
        );
    }

    #[test]
    fn both_styles_on_a_rejection() {
        let rejection = reject("daily", 1000, "day", "{header_style: both, status: 429}");
        assert_eq!(rejection.status, 429);
        assert_eq!(
            names(&rejection.headers),
            [
                "retry-after",
                "x-ratelimit-limit",
                "x-ratelimit-remaining",
                "x-ratelimit-reset",
                "ratelimit-policy",
                "ratelimit",
            ]
        );
        assert_eq!(
            value(&rejection.headers, "ratelimit-policy"),
            Some("\"daily\";q=1000;w=86400")
        );
        assert_eq!(
            value(&rejection.headers, "ratelimit"),
            Some("\"daily\";r=0;t=6")
        );
    }

    #[test]
    fn headers_none_sends_only_retry_after_in_every_style() {
        for style in ["x-ratelimit", "ietf", "both"] {
            let policy = document(
                "r",
                5,
                "second",
                &format!("{{headers: none, header_style: {style}}}"),
            );
            let rejection = Rejection::new(&policy.response, first_rule(&policy), &REPORT);
            assert_eq!(
                rejection.headers,
                vec![("retry-after", "6".to_string())],
                "{style}"
            );
            let admitted =
                admitted_rule_headers(&policy.response, Some((first_rule(&policy), &REPORT)));
            assert!(admitted.is_empty(), "{style}: {admitted:?}");
        }
    }

    #[test]
    fn admitted_answers_carry_the_reset_as_t_with_headers_all() {
        let report = RuleReport {
            limit: 3,
            remaining: 2,
            reset_seconds: 1200,
            retry_after_seconds: 1,
        };
        let policy = document(
            "three_per_hour",
            3,
            "hour",
            "{headers: all, header_style: ietf}",
        );
        let rule = first_rule(&policy);
        assert_eq!(
            admitted_rule_headers(&policy.response, Some((rule, &report))),
            vec![
                (
                    "ratelimit-policy",
                    "\"three_per_hour\";q=3;w=3600".to_string()
                ),
                ("ratelimit", "\"three_per_hour\";r=2;t=1200".to_string()),
            ]
        );

        let both = document(
            "three_per_hour",
            3,
            "hour",
            "{headers: all, header_style: both}",
        );
        let headers = admitted_rule_headers(&both.response, Some((first_rule(&both), &report)));
        assert_eq!(
            names(&headers),
            [
                "x-ratelimit-limit",
                "x-ratelimit-remaining",
                "x-ratelimit-reset",
                "ratelimit-policy",
                "ratelimit",
            ]
        );
        assert_eq!(headers[..3], report.headers()[..]);

        // `headers: limited`: admitted answers carry nothing.
        let limited = document("x", 3, "hour", "{header_style: both}");
        assert!(
            admitted_rule_headers(&limited.response, Some((first_rule(&limited), &report)))
                .is_empty()
        );
    }

    #[test]
    fn an_unnamed_rejection_has_no_ietf_fields() {
        let policy = document("r", 5, "second", "{header_style: both}");
        let rejection = Rejection::unnamed(&policy.response, &REPORT);
        assert_eq!(
            names(&rejection.headers),
            [
                "retry-after",
                "x-ratelimit-limit",
                "x-ratelimit-remaining",
                "x-ratelimit-reset"
            ]
        );
        assert_eq!(rejection.rule, "");
    }

    #[test]
    fn rule_names_become_sf_strings() {
        // Quotes and backslashes are escaped; every other printable character is itself.
        let rejection = reject(r#"say "hi" \ bye"#, 7, "second", "{header_style: ietf}");
        assert_eq!(
            value(&rejection.headers, "ratelimit-policy"),
            Some(r#""say \"hi\" \\ bye";q=7;w=1"#)
        );
        assert_eq!(
            value(&rejection.headers, "ratelimit"),
            Some(r#""say \"hi\" \\ bye";r=0;t=6"#)
        );
        // Default names (`<Url>#<index>`) are printable ASCII too.
        let text =
            "resources:\n  - Url: /api/v1\n    rules: [{rpu: 2}]\nresponse: {header_style: ietf}\n";
        let policy = match parse_policy(text) {
            Ok(policy) => policy,
            Err(err) => panic!("{err}\n{text}"),
        };
        let rejection = Rejection::new(&policy.response, first_rule(&policy), &REPORT);
        assert_eq!(
            value(&rejection.headers, "ratelimit-policy"),
            Some("\"/api/v1#0\";q=2;w=1")
        );
    }

    #[test]
    fn sf_string_escapes_and_never_lets_a_control_through() {
        for (text, expected) in [
            ("", r#""""#),
            ("plain", r#""plain""#),
            (r#"a"b"#, r#""a\"b""#),
            (r"a\b", r#""a\\b""#),
            (
                " ~!#$%&'()*+,-./:;<=>?@[]^_`{|}",
                r#"" ~!#$%&'()*+,-./:;<=>?@[]^_`{|}""#,
            ),
            ("tab\there", r#""tab_here""#),
            ("del\u{7f}", r#""del_""#),
            ("é", r#""_""#),
        ] {
            assert_eq!(sf_string(text), expected, "{text:?}");
        }
    }
}
