#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use super::*;
use crate::actor::fake::Facts;
use crate::config::parse_policy;
use crate::global::wire::{AcquireRequest, RuleResult};
use crate::global::CalloutFailure;
use crate::metrics::CountingMetrics;
use crate::store::{CasSemantics, MemoryHost};
use crate::time::NANOS_PER_SECOND;

struct Harness {
    engine: Engine,
    host: MemoryHost,
    metrics: CountingMetrics,
    now: Nanos,
}

/// A fixed instant well inside a minute window: 2026-01-01T00:00:00Z + 1s.
const T0: Nanos = 1_767_225_601 * NANOS_PER_SECOND;

impl Harness {
    fn new(document: &str) -> Harness {
        Harness::on(document, CasSemantics::Envoy)
    }
    fn on(document: &str, semantics: CasSemantics) -> Harness {
        let policy = parse_policy(document).unwrap_or_else(|e| panic!("{e}"));
        Harness {
            engine: Engine::new(policy),
            host: MemoryHost::new(semantics),
            metrics: CountingMetrics::default(),
            now: T0,
        }
    }
    fn request(&mut self, path: &str, facts: &Facts) -> Decision {
        self.engine.evaluate(
            &self.host,
            path.as_bytes(),
            facts,
            self.now,
            &mut self.metrics,
        )
    }
    fn complete(
        &mut self,
        pending: Pending,
        answer: Result<Vec<RuleResult>, CalloutFailure>,
    ) -> Decision {
        self.engine
            .complete_global(&self.host, pending, answer, self.now, &mut self.metrics)
    }
    fn admitted(&mut self, path: &str, facts: &Facts, n: usize) -> usize {
        (0..n)
            .filter(|_| {
                matches!(
                    self.request(path, facts),
                    Decision::Allow { .. } | Decision::Delay { .. }
                )
            })
            .count()
    }
}

fn rejection(decision: Decision) -> Rejection {
    match decision {
        Decision::Reject(rejection) => rejection,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

fn header<'a>(rejection: &'a Rejection, name: &str) -> Option<&'a str> {
    rejection
        .headers
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.as_str())
}

/// The seed design's document, verbatim.
const SEED: &str = include_str!("../../../../tests/fixtures/seed.yaml");

#[test]
fn each_algorithm_admits_exactly_rpu_on_both_hosts() {
    for semantics in [CasSemantics::Envoy, CasSemantics::Nginx] {
        for algo in ["W", "SW", "TB"] {
            let doc = format!("Url: /\nrules:\n  - rpu: 20\n    unit: minute\n    algo: {algo}\n");
            let mut h = Harness::on(&doc, semantics);
            assert_eq!(
                h.admitted("/", &Facts::default(), 100),
                20,
                "{algo} {semantics:?}"
            );
            assert_eq!(h.metrics.rule(0, RuleEvent::Allowed), 20);
            assert_eq!(h.metrics.rule(0, RuleEvent::Limited), 80);
        }
    }
}

#[test]
fn rejection_has_the_configured_shape() {
    let mut h = Harness::new("Url: /\nrules:\n  - rpu: 2\n    unit: minute\n    algo: W\n");
    h.admitted("/", &Facts::default(), 2);
    let r = rejection(h.request("/", &Facts::default()));
    assert_eq!(r.status, 503);
    assert_eq!(r.body, "rate limited\n");
    assert_eq!(header(&r, "x-ratelimit-limit"), Some("2"));
    assert_eq!(header(&r, "x-ratelimit-remaining"), Some("0"));
    assert_eq!(header(&r, "x-ratelimit-reset"), Some("59"));
    assert_eq!(header(&r, "retry-after"), Some("59"));

    let mut h = Harness::new(
        "resources:\n  - Url: /\n    rules:\n      - {rpu: 1, unit: minute}\nresponse: {status: 429, body: slow down, headers: none}\n",
    );
    h.admitted("/", &Facts::default(), 1);
    let r = rejection(h.request("/", &Facts::default()));
    assert_eq!((r.status, r.body.as_str()), (429, "slow down"));
    assert!(header(&r, "x-ratelimit-limit").is_none());
    assert!(header(&r, "retry-after").is_some());
}

#[test]
fn header_mode_all_reports_the_tightest_rule_on_admitted_requests() {
    let mut h = Harness::new(
        "resources:\n  - Url: /\n    rules:\n      - {rpu: 10, unit: minute}\n      - {rpu: 3, unit: minute}\nresponse: {headers: all}\n",
    );
    match h.request("/", &Facts::default()) {
        Decision::Allow { headers } => {
            assert!(
                headers.contains(&("x-ratelimit-limit", "3".to_string())),
                "{headers:?}"
            );
            assert!(
                headers.contains(&("x-ratelimit-remaining", "2".to_string())),
                "{headers:?}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn least_specific_first_and_the_first_denial_charges_nothing_after_it() {
    let doc = "- Url: /\n  rules: [{rpu: 5, unit: minute}]\n- Url: /sample\n  rules: [{rpu: 3, unit: minute}]\n";
    let mut h = Harness::new(doc);
    let spellings = [
        "//sample",
        "/sample/./x",
        "/x/../sample",
        "/%73ample",
        "/sample?q=1",
    ];
    let admitted: Vec<bool> = spellings
        .iter()
        .map(|p| matches!(h.request(p, &Facts::default()), Decision::Allow { .. }))
        .collect();
    assert_eq!(
        admitted,
        [true, true, true, false, false],
        "every spelling counts as /sample"
    );
    // `/` counted the three admitted and the two denied by /sample (it was charged first).
    assert_eq!(h.metrics.rule(0, RuleEvent::Allowed), 5);
    assert!(matches!(
        h.request("/samples", &Facts::default()),
        Decision::Reject(_)
    ));
    // Denied by `/`: /sample's counter is not charged.
    assert_eq!(h.metrics.rule(1, RuleEvent::Allowed), 3);
    assert_eq!(h.metrics.rule(1, RuleEvent::Limited), 2);
}

#[test]
fn actors_have_separate_counters_and_fallbacks() {
    let doc = "resources:\n  - Url: /\n    rules:\n      - {actor: device, rpu: 1, unit: minute}\n";
    let mut h = Harness::new(doc);
    let a = Facts::default().header("x-device-id", b"a").ip(b"10.0.0.1");
    let b = Facts::default().header("x-device-id", b"b").ip(b"10.0.0.1");
    assert_eq!(h.admitted("/", &a, 3), 1);
    assert_eq!(h.admitted("/", &b, 3), 1);
    // No device id: falls back to the client IP; two IPs, two counters.
    assert_eq!(h.admitted("/", &Facts::default().ip(b"10.0.0.2"), 3), 1);
    assert_eq!(h.admitted("/", &Facts::default().ip(b"10.0.0.3"), 3), 1);

    let doc =
        "resources:\n  - Url: /\n    rules:\n      - {actor: account, rpu: 1, unit: minute}\n";
    let mut h = Harness::new(doc);
    // account falls back to skip: requests without an account are not limited by it.
    assert_eq!(h.admitted("/", &Facts::default(), 5), 5);
    assert_eq!(
        h.admitted(
            "/",
            &Facts::default().header("x-account-id", b"\xff\xfe"),
            5
        ),
        1
    );
}

#[test]
fn dry_run_counts_but_never_rejects() {
    for doc in [
        "resources:\n  - Url: /\n    rules: [{rpu: 2, unit: minute}]\ndry_run: true\n",
        "resources:\n  - Url: /\n    rules: [{rpu: 2, unit: minute, dry_run: true}]\n",
    ] {
        let mut h = Harness::new(doc);
        assert_eq!(h.admitted("/", &Facts::default(), 10), 10);
        assert_eq!(h.metrics.rule(0, RuleEvent::DryRunLimited), 8);
        assert_eq!(h.metrics.rule(0, RuleEvent::Limited), 0);
    }
}

#[test]
fn leaky_bucket_delays_then_rejects_past_the_queue() {
    let doc = "Url: /\nrules:\n  - {algo: LB, rpu: 10, unit: second, burst: 2}\n";
    let mut h = Harness::new(doc);
    let mut untils = Vec::new();
    for _ in 0..4 {
        match h.request("/", &Facts::default()) {
            Decision::Allow { .. } => untils.push(h.now),
            Decision::Delay { until, .. } => untils.push(until),
            Decision::Reject(r) => {
                assert_eq!(header(&r, "retry-after"), Some("1"));
                untils.push(0)
            }
            other => panic!("{other:?}"),
        }
    }
    let step = NANOS_PER_SECOND / 10;
    assert_eq!(untils, [T0, T0 + step, T0 + 2 * step, 0]);
}

fn answer(granted: u32, retry_after_ms: u64) -> RuleResult {
    RuleResult {
        allowed: granted > 0,
        granted,
        remaining: 0,
        reset_ms: 1_000,
        retry_after_ms,
        delay_ms: 0,
    }
}

fn callout(decision: Decision) -> Pending {
    match decision {
        Decision::Callout(pending) => pending,
        other => panic!("expected a callout, got {other:?}"),
    }
}

#[test]
fn the_seed_document_sends_its_global_rule_in_one_callout_after_the_local_rule() {
    let mut h = Harness::new(SEED);
    let device = Facts::default().header("x-device-id", b"phone-1");
    let pending = callout(h.request("/any", &device));
    let request: AcquireRequest = serde_json::from_slice(&pending.body).unwrap();
    assert_eq!(request.rules.len(), 1);
    let rule = &request.rules[0];
    assert_eq!(
        (rule.algo.as_str(), rule.rpu, rule.unit.as_str(), rule.want),
        ("TB", 10, "second", 1)
    );
    // The local `all` rule was charged before the callout.
    assert_eq!(h.metrics.rule(1, RuleEvent::Allowed), 1);
    assert!(matches!(
        h.complete(pending, Ok(vec![answer(1, 0)])),
        Decision::Allow { .. }
    ));
    let pending = callout(h.request("/any", &device));
    let r = rejection(h.complete(pending, Ok(vec![answer(0, 2_500)])));
    assert_eq!(header(&r, "retry-after"), Some("3"));
    // The denial is cached: the next request is rejected without a callout.
    assert!(matches!(h.request("/any", &device), Decision::Reject(_)));
    assert_eq!(h.metrics.event_count(Event::CachedDenial), 1);
    h.now += 3 * NANOS_PER_SECOND;
    assert!(matches!(h.request("/any", &device), Decision::Callout(_)));
}

#[test]
fn a_lease_is_spent_locally_by_later_requests() {
    let doc =
        "resources:\n  - Url: /\n    rules: [{rpu: 100, unit: minute, scope: global, lease: 10}]\n";
    let mut h = Harness::new(doc);
    let pending = callout(h.request("/", &Facts::default()));
    let request: AcquireRequest = serde_json::from_slice(&pending.body).unwrap();
    assert_eq!(request.rules[0].want, 10);
    assert!(matches!(
        h.complete(pending, Ok(vec![answer(10, 0)])),
        Decision::Allow { .. }
    ));
    // Nine spare tokens: nine requests without a callout, then a callout again.
    for _ in 0..9 {
        assert!(matches!(
            h.request("/", &Facts::default()),
            Decision::Allow { .. }
        ));
    }
    assert!(matches!(
        h.request("/", &Facts::default()),
        Decision::Callout(_)
    ));
    assert_eq!(h.metrics.event_count(Event::GlobalCallout), 2);
    assert_eq!(h.metrics.rule(0, RuleEvent::Allowed), 10);
}

#[test]
fn a_failing_service_degrades_to_local_and_the_breaker_probes_after_retry_seconds() {
    for failure in [
        CalloutFailure::NoResponse,
        CalloutFailure::Status(503),
        CalloutFailure::Body("garbage".into()),
        CalloutFailure::Dispatch("BadArgument".into()),
    ] {
        let doc = "resources:\n  - Url: /\n    rules: [{rpu: 3, unit: minute, scope: global}]\nglobal: {retry_seconds: 5}\n";
        let mut h = Harness::new(doc);
        let pending = callout(h.request("/", &Facts::default()));
        // The failed request is decided locally at once (first local token).
        assert!(matches!(
            h.complete(pending, Err(failure.clone())),
            Decision::Allow { .. }
        ));
        assert!(h.metrics.degraded);
        // While the breaker is open: no callout, same limit enforced locally.
        assert_eq!(h.admitted("/", &Facts::default(), 5), 2, "{failure:?}");
        assert_eq!(h.metrics.event_count(Event::GlobalCallout), 1);
        // After retry_seconds one request probes; the others stay local meanwhile.
        h.now += 5 * NANOS_PER_SECOND;
        let probe = callout(h.request("/", &Facts::default()));
        assert!(probe.probe);
        assert!(matches!(
            h.request("/", &Facts::default()),
            Decision::Reject(_)
        ));
        assert!(matches!(
            h.complete(probe, Ok(vec![answer(1, 0)])),
            Decision::Allow { .. }
        ));
        assert!(!h.metrics.degraded);
        assert!(matches!(
            h.request("/", &Facts::default()),
            Decision::Callout(_)
        ));
    }
}

#[test]
fn an_answer_that_does_not_match_the_request_is_a_failure() {
    let doc = "resources:\n  - Url: /\n    rules: [{rpu: 3, unit: minute, scope: global}]\n";
    let mut h = Harness::new(doc);
    let pending = callout(h.request("/", &Facts::default()));
    assert!(crate::global::parse_answer(&pending, 200, b"{\"results\":[]}").is_err());
    assert!(crate::global::parse_answer(&pending, 200, b"\xff").is_err());
    assert!(crate::global::parse_answer(&pending, 500, b"").is_err());
    assert!(crate::global::parse_answer(&pending, 200, br#"{"results":[{"allowed":true,"granted":1,"remaining":2,"reset_ms":5,"retry_after_ms":0,"delay_ms":0}]}"#).is_ok());
}

#[test]
fn a_host_that_cannot_pause_turns_a_wait_into_retry_after_and_reserves_nothing() {
    let doc = "Url: /\nrules:\n  - {algo: LB, rpu: 10, unit: second, burst: 2}\n";
    let mut h = Harness::new(doc);
    h.engine = Engine::new(parse_policy(doc).unwrap()).with_pausing(false);
    assert!(matches!(
        h.request("/", &Facts::default()),
        Decision::Allow { .. }
    ));
    let r = rejection(h.request("/", &Facts::default()));
    assert_eq!(header(&r, "retry-after"), Some("1"));
    // Nothing was reserved by the rejected request: 100 ms later one passes at once.
    h.now += NANOS_PER_SECOND / 10;
    assert!(matches!(
        h.request("/", &Facts::default()),
        Decision::Allow { .. }
    ));
}

#[test]
fn global_leaky_bucket_rules_use_the_wait_endpoint_where_the_host_cannot_pause() {
    let doc = "Url: /\nrules:\n  - {algo: LB, rpu: 10, scope: global}\n";
    let mut h = Harness::new(doc);
    assert!(!callout(h.request("/", &Facts::default())).wait);
    h.engine = Engine::new(parse_policy(doc).unwrap()).with_pausing(false);
    assert!(callout(h.request("/", &Facts::default())).wait);
    assert_eq!(crate::global::wait_path("/v1/acquire"), "/v1/wait");
    assert_eq!(crate::global::wait_path("/quota/"), "/quota/wait");
}

#[test]
fn leased_tokens_are_spent_even_after_a_concurrent_denial_was_cached() {
    let doc =
        "resources:\n  - Url: /\n    rules: [{rpu: 100, unit: minute, scope: global, lease: 10}]\n";
    let mut h = Harness::new(doc);
    // Two requests call out at once; one brings 10 tokens, the other is denied.
    let first = callout(h.request("/", &Facts::default()));
    let second = callout(h.request("/", &Facts::default()));
    assert!(matches!(
        h.complete(first, Ok(vec![answer(10, 0)])),
        Decision::Allow { .. }
    ));
    assert!(matches!(
        h.complete(second, Ok(vec![answer(0, 30_000)])),
        Decision::Reject(_)
    ));
    // The nine spare tokens are still served, then the cached denial answers.
    for _ in 0..9 {
        assert!(matches!(
            h.request("/", &Facts::default()),
            Decision::Allow { .. }
        ));
    }
    assert!(matches!(
        h.request("/", &Facts::default()),
        Decision::Reject(_)
    ));
    assert_eq!(h.metrics.event_count(Event::GlobalCallout), 2);
}

#[test]
fn another_workers_breaker_reaches_this_worker_within_the_cache_time() {
    let doc =
        "resources:\n  - Url: /\n    rules: [{rpu: 1000, unit: minute, scope: global}]\nglobal: {retry_seconds: 5}\n";
    let mut a = Harness::new(doc);
    let b = Engine::new(parse_policy(doc).unwrap());
    let mut b_metrics = CountingMetrics::default();
    // Worker B reads the breaker closed.
    assert!(matches!(
        b.evaluate(&a.host, b"/", &Facts::default(), a.now, &mut b_metrics),
        Decision::Callout(_)
    ));
    // Worker A sees the service fail: the breaker opens in shared data.
    let pending = callout(a.request("/", &Facts::default()));
    a.complete(pending, Err(CalloutFailure::NoResponse));
    assert!(a.metrics.degraded);
    // B trusts its reading for BREAKER_CACHE, then goes local like A.
    assert!(matches!(
        b.evaluate(&a.host, b"/", &Facts::default(), a.now + 1, &mut b_metrics),
        Decision::Callout(_)
    ));
    let later = a.now + crate::global::BREAKER_CACHE;
    assert!(matches!(
        b.evaluate(&a.host, b"/", &Facts::default(), later, &mut b_metrics),
        Decision::Allow { .. }
    ));
    assert_eq!(b_metrics.event_count(Event::GlobalDegradedRequest), 1);
}

#[test]
fn leased_tokens_last_one_unit_even_when_the_bucket_reports_an_early_reset() {
    let doc =
        "resources:\n  - Url: /\n    rules: [{rpu: 1000, unit: second, scope: global, lease: 10}]\n";
    let mut h = Harness::new(doc);
    let pending = callout(h.request("/", &Facts::default()));
    let mut granted = answer(10, 0);
    granted.reset_ms = 1; // a token bucket far from its limit is full again almost at once
    assert!(matches!(
        h.complete(pending, Ok(vec![granted])),
        Decision::Allow { .. }
    ));
    h.now += NANOS_PER_SECOND / 2;
    assert!(matches!(
        h.request("/", &Facts::default()),
        Decision::Allow { .. }
    ));
    h.now += NANOS_PER_SECOND;
    assert!(matches!(
        h.request("/", &Facts::default()),
        Decision::Callout(_)
    ));
}
