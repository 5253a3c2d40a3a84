use super::*;
use crate::actor::fake::Facts;
use crate::call::{Answer, Answered, BodyError, Callout};
use crate::config::parse_policy;
use crate::cx::Cx;
use crate::decision::AfterResponse;
use crate::metrics::CountingMetrics;
use crate::quota::MemoryQuota;
use crate::store::{CasSemantics, HostError, MemoryHost, SetOutcome};
use crate::time::NANOS_PER_SECOND;
use crate::wire::{self, AcquireRequest, AcquireResponse, RuleResult};
use std::sync::{Arc, Barrier};

const S: Nanos = NANOS_PER_SECOND;

/// A fixed instant well inside a minute window: 2026-01-01T00:00:00Z + 1s.
const T0: Instant = Instant::EPOCH.saturating_add(Nanos::from_secs(1_767_225_601));

struct Harness {
    engine: Engine,
    host: MemoryHost,
    metrics: CountingMetrics,
    service: MemoryQuota,
    now: Instant,
}

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
            service: MemoryQuota::new(),
            now: T0,
        }
    }

    fn evaluate(&mut self, path: &str, facts: &Facts) -> EngineDecision {
        let mut cx = Cx::new(&self.host, self.now, &mut self.metrics);
        self.engine.evaluate(&mut cx, path.as_bytes(), facts)
    }

    /// The answer to a request's own call: that request's decision.
    fn complete(&mut self, then: Then, answer: Answer) -> EngineDecision {
        let mut cx = Cx::new(&self.host, self.now, &mut self.metrics);
        self.engine
            .answered(&mut cx, then, answer)
            .expect("a request's call gives its decision")
    }

    /// Any call's answer (the tick's calls give no decision).
    fn answer(&mut self, then: Then, answer: Answer) -> Option<EngineDecision> {
        let mut cx = Cx::new(&self.host, self.now, &mut self.metrics);
        self.engine.answered(&mut cx, then, answer)
    }

    /// A parked request planned again.
    fn resume(&mut self, pending: Pending) -> EngineDecision {
        let mut cx = Cx::new(&self.host, self.now, &mut self.metrics);
        self.engine.resume(&mut cx, pending)
    }

    /// The request of a call went away before the answer, which will never come.
    fn abandon_call(&mut self, then: Then) {
        let mut cx = Cx::new(&self.host, self.now, &mut self.metrics);
        self.engine.abandon_call(&mut cx, then);
    }

    /// A parked request went away.
    fn abandon(&mut self, pending: Pending) {
        let mut cx = Cx::new(&self.host, self.now, &mut self.metrics);
        self.engine.abandon(&mut cx, pending);
    }

    /// The engine's tick at `now`: the calls it makes.
    fn tick(&mut self) -> Vec<Call> {
        let mut cx = Cx::new(&self.host, self.now, &mut self.metrics);
        self.engine.tick(&mut cx)
    }

    /// Settles an admitted request with its response headers' values.
    fn after_response(&mut self, after: &AfterResponse, values: &[Option<Vec<u8>>]) {
        let mut cx = Cx::new(&self.host, self.now, &mut self.metrics);
        self.engine
            .after_response(&mut cx, after, values, Some(200));
    }

    /// A whole request: a callout is answered by the in-memory service.
    fn request(&mut self, path: &str, facts: &Facts) -> EngineDecision {
        match self.evaluate(path, facts) {
            Decision::Call(Call { callout, then }) => {
                let answer = self.service.answer(&callout, self.now);
                self.complete(then, answer)
            }
            decided => decided,
        }
    }

    fn admitted(&mut self, path: &str, facts: &Facts, n: usize) -> usize {
        (0..n)
            .filter(|_| admits(&self.request(path, facts)))
            .count()
    }
}

fn admits(decision: &EngineDecision) -> bool {
    matches!(decision, Decision::Allow { .. } | Decision::Delay { .. })
}

fn rejection(decision: EngineDecision) -> Rejection {
    match decision {
        Decision::Reject(rejection) => rejection,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

fn call(decision: EngineDecision) -> (Callout, Then) {
    match decision {
        Decision::Call(Call { callout, then }) => (callout, then),
        other => panic!("expected a callout, got {other:?}"),
    }
}

fn header<'a>(rejection: &'a Rejection, name: &str) -> Option<&'a str> {
    rejection
        .headers
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.as_str())
}

fn answered(results: Vec<RuleResult>) -> Answer {
    Answer::with(
        200,
        serde_json::to_vec(&AcquireResponse { results }).unwrap(),
    )
}

fn granted(tokens: u32) -> RuleResult {
    RuleResult {
        allowed: true,
        granted: tokens,
        remaining: 0,
        reset_ms: 1_000,
        ..RuleResult::default()
    }
}

fn denied(retry_after_ms: u64) -> RuleResult {
    RuleResult {
        allowed: false,
        reset_ms: retry_after_ms,
        retry_after_ms,
        ..RuleResult::default()
    }
}

/// The seed design's document, verbatim.
const SEED: &str = include_str!("../../../../tests/fixtures/seed.yaml");

/// The hot-event shape of the issue: `/` shared by every page, `/login` flooded.
fn hierarchy(root_scope: &str, login_scope: &str) -> String {
    format!(
        "resources:\n  - Url: /\n    rules: [{{name: root, rpu: 10, unit: minute, algo: W, scope: {root_scope}}}]\n  - Url: /login\n    rules: [{{name: login, rpu: 1, unit: minute, algo: W, scope: {login_scope}}}]\n"
    )
}

#[test]
fn each_algorithm_admits_exactly_rpu_on_both_hosts() {
    for semantics in [CasSemantics::Envoy, CasSemantics::Nginx] {
        for algo in ["W", "SW", "TB"] {
            let doc = format!("Url: /\nrules:\n  - rpu: 20\n    unit: minute\n    algo: {algo}\n");
            let mut h = Harness::on(&doc, semantics);
            assert_eq!(h.admitted("/", &Facts::default(), 100), 20, "{algo}");
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
        Decision::Allow { headers, .. } => {
            assert!(headers.contains(&("x-ratelimit-limit", "3".to_string())));
            assert!(headers.contains(&("x-ratelimit-remaining", "2".to_string())));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_flood_rejected_on_one_resource_does_not_drain_its_parent_local() {
    for semantics in [CasSemantics::Envoy, CasSemantics::Nginx] {
        let mut h = Harness::on(&hierarchy("local", "local"), semantics);
        let login: Vec<bool> = (0..10)
            .map(|_| admits(&h.request("/login", &Facts::default())))
            .collect();
        assert_eq!(login.iter().filter(|&&a| a).count(), 1);
        // Only the admitted /login request counts against `/`: nine pages are left.
        assert_eq!(
            h.admitted("/home", &Facts::default(), 20),
            9,
            "{semantics:?}"
        );
        assert_eq!(h.metrics.rule(0, RuleEvent::Allowed), 10);
        assert_eq!(h.metrics.rule(1, RuleEvent::Allowed), 1);
        assert_eq!(h.metrics.rule(1, RuleEvent::Limited), 9);
    }
}

#[test]
fn a_flood_rejected_on_one_resource_does_not_drain_its_parent_global_and_mixed() {
    for (root, login) in [
        ("global", "global"),
        ("local", "global"),
        ("global", "local"),
    ] {
        let mut h = Harness::new(&hierarchy(root, login));
        assert_eq!(
            h.admitted("/login", &Facts::default(), 10),
            1,
            "{root}/{login}"
        );
        assert_eq!(
            h.admitted("/home", &Facts::default(), 20),
            9,
            "{root} / over {login} /login"
        );
    }
}

#[test]
fn every_spelling_of_a_path_counts_as_that_path() {
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
        .map(|p| admits(&h.request(p, &Facts::default())))
        .collect();
    assert_eq!(admitted, [true, true, true, false, false]);
    // `/` counted only the three admitted.
    assert_eq!(h.metrics.rule(0, RuleEvent::Allowed), 3);
    assert_eq!(h.admitted("/samples", &Facts::default(), 5), 2);
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
    assert_eq!(h.admitted("/", &Facts::default().ip(b"10.0.0.2"), 3), 1);
    assert_eq!(h.admitted("/", &Facts::default().ip(b"10.0.0.3"), 3), 1);

    let doc =
        "resources:\n  - Url: /\n    rules:\n      - {actor: account, rpu: 1, unit: minute}\n";
    let mut h = Harness::new(doc);
    assert_eq!(h.admitted("/", &Facts::default(), 5), 5);
    let hostile = Facts::default().header("x-account-id", b"\xff\xfe");
    assert_eq!(h.admitted("/", &hostile, 5), 1);
}

#[test]
fn dry_run_counts_but_never_rejects_and_charges_nothing_it_would_reject() {
    for doc in [
        "resources:\n  - Url: /\n    rules: [{rpu: 2, unit: minute}]\ndry_run: true\n",
        "resources:\n  - Url: /\n    rules: [{rpu: 2, unit: minute, dry_run: true}]\n",
        "resources:\n  - Url: /\n    rules: [{rpu: 2, unit: minute, scope: global, dry_run: true}]\n",
    ] {
        let mut h = Harness::new(doc);
        assert_eq!(h.admitted("/", &Facts::default(), 10), 10, "{doc}");
        assert_eq!(h.metrics.rule(0, RuleEvent::Allowed), 2);
        assert_eq!(h.metrics.rule(0, RuleEvent::DryRunLimited), 8);
        assert_eq!(h.metrics.rule(0, RuleEvent::Limited), 0);
    }
    // A dry-run global rule's denial does not stop an enforcing one from being charged.
    let doc = "resources:\n  - Url: /\n    rules:\n      - {name: probe, rpu: 1, unit: minute, scope: global, dry_run: true}\n      - {name: real, rpu: 3, unit: minute, scope: global}\n";
    let mut h = Harness::new(doc);
    assert_eq!(h.admitted("/", &Facts::default(), 5), 3);
    assert_eq!(h.metrics.rule(1, RuleEvent::Allowed), 3);
    // It would have rejected the four after the first (two of which `real` rejected).
    assert_eq!(h.metrics.rule(0, RuleEvent::DryRunLimited), 4);
    assert_eq!(h.metrics.rule(0, RuleEvent::Allowed), 1);
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
                untils.push(Instant::EPOCH)
            }
            other => panic!("{other:?}"),
        }
    }
    let step = S / 10;
    assert_eq!(untils, [T0, T0 + step, T0 + 2 * step, Instant::EPOCH]);
    assert_eq!(h.metrics.event_count(Event::Delayed), 2);
}

#[test]
fn a_leaky_bucket_never_holds_a_request_longer_than_max_wait() {
    // 1 per hour: the second request's turn is an hour away.
    let doc = "Url: /\nrules:\n  - {algo: LB, rpu: 1, unit: hour, burst: 5}\n";
    let mut h = Harness::new(doc);
    assert!(matches!(
        h.request("/", &Facts::default()),
        Decision::Allow { .. }
    ));
    let r = rejection(h.request("/", &Facts::default()));
    // Rejected at once, told to come back when its turn is within 10 s.
    assert_eq!(header(&r, "retry-after"), Some("3590"));
    // Nothing was reserved: an hour later exactly one passes at once again.
    h.now += 3_600 * S;
    assert!(matches!(
        h.request("/", &Facts::default()),
        Decision::Allow { .. }
    ));
    // A shorter limit is honoured too: 2 per minute, max_wait_seconds 40.
    let doc =
        "Url: /\nrules:\n  - {algo: LB, rpu: 2, unit: minute, burst: 5, max_wait_seconds: 40}\n";
    let mut h = Harness::new(doc);
    assert!(admits(&h.request("/", &Facts::default())));
    assert!(matches!(
        h.request("/", &Facts::default()),
        Decision::Delay { until, .. } if until == T0 + 30 * S
    ));
    assert!(matches!(
        h.request("/", &Facts::default()),
        Decision::Reject(_)
    ));
}

#[test]
fn a_rejected_request_gives_back_its_leaky_bucket_turn() {
    // The turn is the last reserved when the later rule denies: given back exactly.
    let doc = "Url: /\nrules:\n  - {name: pace, algo: LB, rpu: 10, unit: second, burst: 5}\n  - {name: cap, algo: W, rpu: 2, unit: minute}\n";
    let mut h = Harness::new(doc);
    assert!(admits(&h.request("/", &Facts::default())));
    assert!(admits(&h.request("/", &Facts::default())));
    for _ in 0..5 {
        assert!(matches!(
            h.request("/", &Facts::default()),
            Decision::Reject(_)
        ));
    }
    // Two turns reserved, not seven: the queue is back to idle 200 ms later.
    h.now += 2 * S / 10;
    let rule = h.engine.policy().rule(0).unwrap();
    let state = h
        .engine
        .local
        .store()
        .peek(&h.host, &h.engine.table(rule), SlotAddress::single(), h.now)
        .unwrap();
    assert!(rule.algo.is_idle(&rule.limit, &state, h.now));
}

#[test]
fn the_seed_document_sends_its_global_rule_in_one_callout_after_the_local_rule() {
    let mut h = Harness::new(SEED);
    let device = Facts::default().header("x-device-id", b"phone-1");
    let (callout, pending) = call(h.evaluate("/any", &device));
    assert_eq!(callout.upstream, "diana_quota");
    assert_eq!(
        callout.headers[..3],
        [
            (":method", "POST".to_string()),
            (":path", "/v1/acquire".to_string()),
            (":authority", "diana-quota".to_string())
        ]
    );
    assert!(callout
        .headers
        .contains(&("x-diana-timeout-ms", "50".to_string())));
    assert_eq!(callout.timeout_ms, 50);
    let request: AcquireRequest = serde_json::from_slice(&callout.body).unwrap();
    let rule = &request.rules[0];
    assert_eq!(
        (
            rule.algo.as_str(),
            rule.rpu,
            rule.unit.as_str(),
            rule.want,
            rule.cost
        ),
        ("TB", 10, "second", 1, 1)
    );
    assert!(matches!(
        h.complete(pending, answered(vec![granted(1)])),
        Decision::Allow { .. }
    ));
    // Both rules counted the admitted request.
    assert_eq!(h.metrics.rule(0, RuleEvent::Allowed), 1);
    assert_eq!(h.metrics.rule(1, RuleEvent::Allowed), 1);
    let (_, pending) = call(h.evaluate("/any", &device));
    let r = rejection(h.complete(pending, answered(vec![denied(2_500)])));
    assert_eq!(header(&r, "retry-after"), Some("3"));
    // The local rule's charge was given back with the global denial.
    assert_eq!(h.metrics.rule(1, RuleEvent::Allowed), 1);
    // The denial is cached: the next request is rejected without a callout.
    assert!(matches!(h.evaluate("/any", &device), Decision::Reject(_)));
    assert_eq!(h.metrics.event_count(Event::CachedDenial), 1);
    h.now += 3 * S;
    assert!(matches!(h.evaluate("/any", &device), Decision::Call(..)));
}

#[test]
fn a_lease_is_spent_locally_by_later_requests() {
    let doc =
        "resources:\n  - Url: /\n    rules: [{rpu: 100, unit: minute, scope: global, lease: 10}]\n";
    let mut h = Harness::new(doc);
    let (callout, pending) = call(h.evaluate("/", &Facts::default()));
    let request: AcquireRequest = serde_json::from_slice(&callout.body).unwrap();
    assert_eq!((request.rules[0].want, request.rules[0].cost), (10, 1));
    assert!(admits(&h.complete(pending, answered(vec![granted(10)]))));
    for _ in 0..9 {
        assert!(matches!(
            h.evaluate("/", &Facts::default()),
            Decision::Allow { .. }
        ));
    }
    assert!(matches!(
        h.evaluate("/", &Facts::default()),
        Decision::Call(..)
    ));
    assert_eq!(h.metrics.event_count(Event::GlobalCallout), 2);
    assert_eq!(h.metrics.rule(0, RuleEvent::Allowed), 10);
}

#[test]
fn leased_tokens_go_back_to_the_stash_when_another_rule_rejects() {
    let doc = "resources:\n  - Url: /\n    rules: [{name: site, rpu: 100, unit: minute, scope: global, lease: 10}]\n  - Url: /x\n    rules: [{name: x, rpu: 1, unit: minute, algo: W}]\n";
    let mut h = Harness::new(doc);
    // One callout fills the stash: 1 spent, 9 left.
    assert!(admits(&h.request("/", &Facts::default())));
    // /x admits one request (a leased token spent), then rejects: its tokens come back.
    // Without the give-back, 9 more /x attempts would eat the 8 tokens left.
    assert_eq!(h.admitted("/x", &Facts::default(), 10), 1);
    assert_eq!(h.admitted("/", &Facts::default(), 8), 8);
    assert_eq!(h.service.calls(), 1, "all served from the stash");
}

#[test]
fn a_service_that_grants_more_than_asked_is_not_believed() {
    let doc =
        "resources:\n  - Url: /\n    rules: [{rpu: 3, unit: minute, scope: global, lease: 2}]\n";
    let mut h = Harness::new(doc);
    let (_, pending) = call(h.evaluate("/", &Facts::default()));
    // granted: 1000 to a want of 2.
    let lie = answered(vec![granted(1_000)]);
    assert!(admits(&h.complete(pending, lie)));
    assert_eq!(h.metrics.event_count(Event::GlobalInvalidAnswer), 1);
    assert_eq!(h.metrics.event_count(Event::GlobalError), 1);
    assert!(h.metrics.degraded);
    // Decided locally with the rule's own limit: 3 in all, not 1000.
    assert_eq!(h.admitted("/", &Facts::default(), 30), 2);
    for lie in [
        answered(vec![]),
        answered(vec![granted(1), granted(1)]),
        answered(vec![RuleResult {
            allowed: false,
            granted: 2,
            ..RuleResult::default()
        }]),
        answered(vec![RuleResult {
            remaining: 1_000_000,
            ..granted(1)
        }]),
        answered(vec![RuleResult {
            retry_after_ms: u64::MAX,
            ..denied(1)
        }]),
        Answer::with(200, b"\xff not json".to_vec()),
        Answer::Answered(Answered {
            status: 200,
            headers: Vec::new(),
            body: Err(BodyError::TooLarge(usize::MAX)),
        }),
    ] {
        let mut h = Harness::new(doc);
        let (_, pending) = call(h.evaluate("/", &Facts::default()));
        assert!(admits(&h.complete(pending, lie.clone())), "{lie:?}");
        assert_eq!(h.metrics.event_count(Event::GlobalError), 1, "{lie:?}");
    }
}

#[test]
fn grants_of_an_older_service_that_charged_anyway_are_kept() {
    // An older service decided each rule on its own: it charged `a` although `b` denied.
    let doc = "resources:\n  - Url: /\n    rules:\n      - {name: a, rpu: 100, unit: minute, scope: global, lease: 5}\n      - {name: b, rpu: 1, unit: minute, scope: global}\n";
    let mut h = Harness::new(doc);
    let (_, pending) = call(h.evaluate("/", &Facts::default()));
    let r = rejection(h.complete(pending, answered(vec![granted(5), denied(30_000)])));
    assert_eq!(header(&r, "x-ratelimit-limit"), Some("1"));
    // The five tokens granted to `a` are in the stash: the next request of `a` needs no
    // tokens from the service (b's denial is cached).
    assert!(matches!(
        h.evaluate("/", &Facts::default()),
        Decision::Reject(_)
    ));
    assert_eq!(h.metrics.rule(1, RuleEvent::Limited), 2);
    assert_eq!(h.metrics.rule(0, RuleEvent::Allowed), 0);
}

#[test]
fn a_refusal_is_decided_locally_counted_apart_and_leaves_the_breaker_closed() {
    let doc = "resources:\n  - Url: /\n    rules: [{rpu: 3, unit: minute, scope: global}]\n";
    let mut h = Harness::new(doc);
    let (_, pending) = call(h.evaluate("/", &Facts::default()));
    let refused = Answer::with(
        400,
        br#"{"error":"rules[0].want: must be between 1 and 100000, got 0"}"#.to_vec(),
    );
    assert!(admits(&h.complete(pending, refused)));
    assert_eq!(h.metrics.event_count(Event::GlobalRefused), 1);
    assert_eq!(h.metrics.event_count(Event::GlobalError), 0);
    assert!(!h.metrics.degraded);
    // The next request calls the service again.
    assert!(matches!(
        h.evaluate("/", &Facts::default()),
        Decision::Call(..)
    ));
}

#[test]
fn every_callout_carries_the_configured_credential_and_none_without_one() {
    let token = "t0ken-".repeat(6);
    let with = format!(
        "resources:\n  - Url: /\n    rules: [{{rpu: 3, unit: minute, scope: global}}]\nglobal: {{token: \"{token}\"}}\n"
    );
    let mut h = Harness::new(&with);
    let (callout, _) = call(h.evaluate("/", &Facts::default()));
    let authorization: Vec<&str> = callout
        .headers
        .iter()
        .filter(|(name, _)| *name == "authorization")
        .map(|(_, value)| value.as_str())
        .collect();
    assert_eq!(authorization, [format!("Bearer {token}").as_str()]);

    let without = "resources:\n  - Url: /\n    rules: [{rpu: 3, unit: minute, scope: global}]\n";
    let mut h = Harness::new(without);
    let (callout, _) = call(h.evaluate("/", &Facts::default()));
    assert!(callout
        .headers
        .iter()
        .all(|(name, _)| *name != "authorization"));
}

#[test]
fn a_refused_credential_or_any_4xx_never_opens_the_breaker_whatever_its_body() {
    let doc = "resources:\n  - Url: /\n    rules: [{rpu: 3, unit: minute, scope: global}]\n";
    let huge = vec![b'x'; 200 * 1024];
    for refusal in [
        Answer::with(401, br#"{"error":"missing or wrong credential"}"#.to_vec()),
        Answer::with(403, b"forbidden".to_vec()),
        // Larger than any answer the filter reads: still a refusal, not an invalid answer.
        Answer::with(413, huge.clone()),
        Answer::Answered(Answered {
            status: 401,
            headers: Vec::new(),
            body: Err(BodyError::TooLarge(usize::MAX)),
        }),
    ] {
        let mut h = Harness::new(doc);
        let (_, pending) = call(h.evaluate("/", &Facts::default()));
        assert!(admits(&h.complete(pending, refusal.clone())));
        let status = match &refusal {
            Answer::Answered(Answered { status, .. }) => *status,
            _ => 0,
        };
        assert_eq!(h.metrics.event_count(Event::GlobalRefused), 1, "{status}");
        assert_eq!(h.metrics.event_count(Event::GlobalError), 0, "{status}");
        assert_eq!(
            h.metrics.event_count(Event::GlobalInvalidAnswer),
            0,
            "{status}"
        );
        assert!(!h.metrics.degraded, "{status}");
        assert!(matches!(
            h.evaluate("/", &Facts::default()),
            Decision::Call(..)
        ));
    }
}

#[test]
fn a_failing_service_degrades_to_local_and_the_breaker_probes_after_retry_seconds() {
    for failure in [
        Answer::NoAnswer,
        Answer::NotSent(crate::call::DispatchError::Refused {
            upstream: "diana_quota".into(),
            status: "BadArgument".into(),
        }),
        Answer::with(503, b"{\"error\":\"overloaded\"}".to_vec()),
    ] {
        let doc = "resources:\n  - Url: /\n    rules: [{rpu: 3, unit: minute, scope: global}]\nglobal: {retry_seconds: 5}\n";
        let mut h = Harness::new(doc);
        let (_, pending) = call(h.evaluate("/", &Facts::default()));
        assert!(admits(&h.complete(pending, failure.clone())));
        assert!(h.metrics.degraded);
        // While the breaker is open: no callout, the same limit enforced locally.
        assert_eq!(h.admitted("/", &Facts::default(), 5), 2, "{failure:?}");
        assert_eq!(h.metrics.event_count(Event::GlobalCallout), 1);
        // After retry_seconds one request probes; another request of this worker waits
        // for the probe's answer (single flight), then calls the service again.
        h.now += 5 * S;
        let (_, probe) = call(h.evaluate("/", &Facts::default()));
        assert!(probe.asked().is_some_and(|asked| asked.is_probe()));
        let Decision::Wait(rider) = h.evaluate("/", &Facts::default()) else {
            panic!("the second request should wait for the probe");
        };
        assert!(h.engine.woken(h.now).is_empty());
        assert!(admits(&h.complete(probe, answered(vec![granted(1)]))));
        assert!(!h.metrics.degraded);
        assert_eq!(h.engine.woken(h.now), vec![rider.rider().unwrap()]);
        let resumed = h.resume(rider);
        assert!(matches!(resumed, Decision::Call(..)), "{resumed:?}");
    }
}

#[test]
fn a_host_that_cannot_pause_turns_a_wait_into_retry_after_and_reserves_nothing() {
    let doc = "Url: /\nrules:\n  - {algo: LB, rpu: 10, unit: second, burst: 2}\n";
    let mut h = Harness::new(doc);
    h.engine = Engine::new(parse_policy(doc).unwrap()).resuming_elsewhere(false);
    assert!(matches!(
        h.request("/", &Facts::default()),
        Decision::Allow { .. }
    ));
    let r = rejection(h.request("/", &Facts::default()));
    assert_eq!(header(&r, "retry-after"), Some("1"));
    h.now += S / 10;
    assert!(matches!(
        h.request("/", &Facts::default()),
        Decision::Allow { .. }
    ));
}

#[test]
fn global_leaky_bucket_rules_use_the_wait_endpoint_where_the_host_cannot_pause() {
    let doc = "Url: /\nrules:\n  - {algo: LB, rpu: 10, scope: global}\n";
    let mut h = Harness::new(doc);
    let (callout, _) = call(h.evaluate("/", &Facts::default()));
    assert!(callout
        .headers
        .contains(&(":path", "/v1/acquire".to_string())));
    let request: AcquireRequest = serde_json::from_slice(&callout.body).unwrap();
    assert_eq!(request.rules[0].max_delay_ms, Some(10_000));
    h.engine = Engine::new(parse_policy(doc).unwrap()).resuming_elsewhere(false);
    let (callout, _) = call(h.evaluate("/", &Facts::default()));
    assert!(callout.headers.contains(&(":path", "/v1/wait".to_string())));
    assert_eq!(callout.timeout_ms, 50 + 10_000);
    assert_eq!(
        crate::global::endpoint_beside("/quota/", "wait"),
        "/quota/wait"
    );
}

/// Another worker of the gateway: its own engine and metrics, the shared data of the
/// harness it is given.
struct Worker {
    engine: Engine,
    metrics: CountingMetrics,
}

impl Worker {
    fn new(document: &str) -> Worker {
        Worker {
            engine: Engine::new(parse_policy(document).unwrap()),
            metrics: CountingMetrics::default(),
        }
    }

    /// Decides a request for `/` at `now`.
    fn request(&mut self, host: &MemoryHost, now: Instant) -> EngineDecision {
        let mut cx = Cx::new(host, now, &mut self.metrics);
        self.engine.evaluate(&mut cx, b"/", &Facts::default())
    }

    fn complete(
        &mut self,
        host: &MemoryHost,
        then: Then,
        answer: Answer,
        now: Instant,
    ) -> EngineDecision {
        let mut cx = Cx::new(host, now, &mut self.metrics);
        self.engine
            .answered(&mut cx, then, answer)
            .expect("a request's decision")
    }

    /// Calls for a request to `/`, which the service denies for 30 s.
    fn denied(&mut self, host: &MemoryHost, now: Instant) {
        let (_, pending) = call(self.request(host, now));
        let answer = self.complete(host, pending, answered(vec![denied(30_000)]), now);
        assert!(matches!(answer, Decision::Reject(_)));
    }
}

/// Worker B is denied by the service while worker A's flight, granted before the service
/// ran out, is still on its way; A's spare token lands after B's denial. With `lease: 1`
/// B never answers from a denial it remembers: it reads the shared record, finds the
/// token, and the gateway admits exactly what the service granted.
#[test]
fn at_lease_1_a_remembered_denial_never_hides_a_token_another_worker_brings() {
    let doc = "resources:\n  - Url: /\n    rules: [{rpu: 100, unit: minute, scope: global}]\n";
    let mut h = Harness::new(doc);
    let mut other = Worker::new(doc);
    let (_, leader) = call(h.evaluate("/", &Facts::default()));
    let riders = park(&mut h, 2);
    assert!(admits(&h.complete(leader, answered(vec![granted(1)]))));
    assert_eq!(h.engine.woken(h.now).len(), 2);
    let mut riders = riders.into_iter();
    let (second_flight, first_rider) = call(h.resume(riders.next().unwrap()));
    assert_eq!(want(&second_flight), 2, "itself and the rider behind it");
    let Decision::Wait(second_rider) = h.resume(riders.next().unwrap()) else {
        panic!("expected to wait behind the second flight");
    };
    // Worker B: its call is denied; its next request is rejected from the cached denial.
    other.denied(&h.host, h.now);
    assert!(matches!(other.request(&h.host, h.now), Decision::Reject(_)));
    // A's second flight lands: 2 granted, one spare in the shared stash.
    assert!(admits(&h.complete(first_rider, answered(vec![granted(2)]))));
    // B sees the token at once (not after its memory of the denial lapses).
    assert!(admits(&other.request(&h.host, h.now)));
    // The rider it was asked for finds the stash empty and the denial: 3 granted, 3
    // admitted.
    assert_eq!(h.engine.woken(h.now).len(), 1);
    assert!(matches!(h.resume(second_rider), Decision::Reject(_)));
}

/// Two workers call at once and the second is denied: the first worker's leased tokens
/// are still spent. It remembers the denial for a moment when it reads it, but forgets it
/// when its own flight brings tokens.
#[test]
fn leased_tokens_are_spent_even_after_a_concurrent_denial_was_cached() {
    let doc =
        "resources:\n  - Url: /\n    rules: [{rpu: 100, unit: minute, scope: global, lease: 10}]\n";
    let mut h = Harness::new(doc);
    let mut other = Worker::new(doc);
    let (_, first) = call(h.evaluate("/", &Facts::default()));
    other.denied(&h.host, h.now);
    // A reads the denial and remembers it (no shared read for the next one).
    assert!(matches!(
        h.evaluate("/", &Facts::default()),
        Decision::Reject(_)
    ));
    let before = h.host.calls();
    assert!(matches!(
        h.evaluate("/", &Facts::default()),
        Decision::Reject(_)
    ));
    assert_eq!(h.host.calls(), before, "remembered");
    // A's flight lands with 10: its nine spare tokens are spent at once.
    assert!(admits(&h.complete(first, answered(vec![granted(10)]))));
    assert_eq!(h.admitted("/", &Facts::default(), 12), 9);
    assert_eq!(h.metrics.event_count(Event::GlobalCallout), 1);
}

#[test]
fn another_workers_breaker_reaches_this_worker_within_the_cache_time() {
    let doc = "resources:\n  - Url: /\n    rules: [{rpu: 1000, unit: minute, scope: global}]\nglobal: {retry_seconds: 5}\n";
    let mut a = Harness::new(doc);
    let mut b = Worker::new(doc);
    let now = a.now;
    let (_, first) = call(b.request(&a.host, now));
    assert!(admits(&b.complete(
        &a.host,
        first,
        answered(vec![granted(1)]),
        now
    )));
    let (_, pending) = call(a.evaluate("/", &Facts::default()));
    a.complete(pending, Answer::NoAnswer);
    assert!(a.metrics.degraded);
    let (_, second) = call(b.request(&a.host, now + Nanos::new(1)));
    assert!(admits(&b.complete(
        &a.host,
        second,
        answered(vec![granted(1)]),
        now + Nanos::new(1)
    )));
    let later = now + crate::global::outage::OUTAGE_CACHE;
    assert!(matches!(b.request(&a.host, later), Decision::Allow { .. }));
    assert_eq!(b.metrics.event_count(Event::GlobalDegradedRequest), 1);
}

#[test]
fn leased_tokens_last_one_unit_even_when_the_bucket_reports_an_early_reset() {
    let doc =
        "resources:\n  - Url: /\n    rules: [{rpu: 1000, unit: second, scope: global, lease: 10}]\n";
    let mut h = Harness::new(doc);
    let (_, pending) = call(h.evaluate("/", &Facts::default()));
    let mut grant = granted(10);
    grant.reset_ms = 1;
    assert!(admits(&h.complete(pending, answered(vec![grant]))));
    h.now += S / 2;
    assert!(matches!(
        h.evaluate("/", &Facts::default()),
        Decision::Allow { .. }
    ));
    h.now += S;
    assert!(matches!(
        h.evaluate("/", &Facts::default()),
        Decision::Call(..)
    ));
}

#[test]
fn a_cached_denial_from_a_clock_that_stepped_back_is_ignored() {
    let doc = "resources:\n  - Url: /\n    rules: [{rpu: 1, unit: second, scope: global}]\n";
    let mut h = Harness::new(doc);
    let (_, pending) = call(h.evaluate("/", &Facts::default()));
    assert!(matches!(
        h.complete(pending, answered(vec![denied(900)])),
        Decision::Reject(_)
    ));
    assert!(matches!(
        h.evaluate("/", &Facts::default()),
        Decision::Reject(_)
    ));
    // The clock steps back a day: the cached denial is a day and a second away, which
    // no limit of one per second explains: the service is asked again.
    h.now = h.now - 86_400 * S;
    assert!(matches!(
        h.evaluate("/", &Facts::default()),
        Decision::Call(..)
    ));
}

/// A host where every write loses the race.
struct AlwaysRaced(MemoryHost);

impl SharedData for AlwaysRaced {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        self.0.get(key)
    }
    fn set(&self, key: &str, value: &[u8], _cas: u32) -> Result<SetOutcome, HostError> {
        self.0.put_raw(key, value);
        Ok(SetOutcome::CasMismatch)
    }
}

#[test]
fn a_request_that_loses_every_race_is_rejected_not_admitted_uncounted() {
    let engine =
        Engine::new(parse_policy("Url: /\nrules:\n  - {rpu: 100, unit: minute}\n").unwrap());
    let host = AlwaysRaced(MemoryHost::new(CasSemantics::Envoy));
    let mut metrics = CountingMetrics::default();
    let r = rejection(engine.evaluate(
        &mut Cx::new(&host, T0, &mut metrics),
        b"/",
        &Facts::default(),
    ));
    assert_eq!(header(&r, "retry-after"), Some("1"));
    assert_eq!(metrics.event_count(Event::StoreContention), 1);
    assert_eq!(metrics.rule(0, RuleEvent::Limited), 1);
}

#[test]
fn racing_workers_charge_all_or_nothing_on_both_hosts() {
    // Four workers (one engine each, as one VM per Envoy worker) flood /login while
    // they race on `/`: afterwards `/` has counted exactly the admitted /login requests.
    for semantics in [CasSemantics::Envoy, CasSemantics::Nginx] {
        for round in 0..10 {
            let doc = hierarchy("local", "local")
                .replace("rpu: 10,", "rpu: 40,")
                .replace("rpu: 1,", "rpu: 3,");
            let policy = parse_policy(&doc).unwrap();
            let host = Arc::new(MemoryHost::new(semantics));
            let start = Arc::new(Barrier::new(4));
            let workers: Vec<_> = (0..4)
                .map(|_| {
                    let host = Arc::clone(&host);
                    let start = Arc::clone(&start);
                    let policy = policy.clone();
                    std::thread::spawn(move || {
                        let engine = Engine::new(policy);
                        let mut metrics = CountingMetrics::default();
                        start.wait();
                        let admitted = (0..50)
                            .filter(|_| {
                                admits(&engine.evaluate(
                                    &mut Cx::new(host.as_ref(), T0, &mut metrics),
                                    b"/login",
                                    &Facts::default(),
                                ))
                            })
                            .count();
                        // The worker's tick gives back the batch it no longer spends.
                        engine.tick(&mut Cx::new(host.as_ref(), T0 + S, &mut NoMetrics));
                        admitted
                    })
                })
                .collect();
            let login: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
            assert_eq!(login, 3, "{semantics:?} round {round}");
            let engine = Engine::new(policy);
            let mut metrics = CountingMetrics::default();
            let pages = (0..100)
                .filter(|_| {
                    admits(&engine.evaluate(
                        &mut Cx::new(host.as_ref(), T0, &mut metrics),
                        b"/home",
                        &Facts::default(),
                    ))
                })
                .count();
            assert_eq!(
                pages, 37,
                "{semantics:?} round {round}: / lost budget to rejections"
            );
        }
    }
}

#[test]
fn a_request_takes_its_cost_from_every_algorithm_all_or_nothing() {
    for algo in ["W", "SW", "TB"] {
        let doc = format!(
            "Url: /\nrules:\n  - {{algo: {algo}, rpu: 10, unit: minute, cost: {{header: x-cost, default: 2, max: 6}}}}\n"
        );
        let mut h = Harness::new(&doc);
        let cost = |value: &[u8]| Facts::default().header("x-cost", value);
        // 6 taken, then 4: nothing is left for the default cost of 2.
        assert!(admits(&h.request("/", &cost(b"6"))), "{algo}");
        assert!(admits(&h.request("/", &cost(b"4"))), "{algo}");
        assert!(
            matches!(h.request("/", &cost(b"junk")), Decision::Reject(_)),
            "{algo}"
        );
        // A rejected costly request took nothing: one of cost 1 would still be refused.
        assert!(
            matches!(h.request("/", &cost(b"1")), Decision::Reject(_)),
            "{algo}"
        );
    }
    // Above max: max; missing: default; zero or signs: default.
    let doc = "Url: /\nrules:\n  - {algo: W, rpu: 10, unit: minute, cost: {header: x-cost, default: 3, max: 4}}\n";
    let mut h = Harness::new(doc);
    assert!(admits(&h.request(
        "/",
        &Facts::default().header("x-cost", b"999999999999999999999")
    )));
    assert!(admits(&h.request("/", &Facts::default())));
    assert!(admits(
        &h.request("/", &Facts::default().header("x-cost", b"-1"))
    ));
    // 4 + 3 + 3 = 10 taken.
    assert!(matches!(
        h.request("/", &Facts::default().header("x-cost", b"1")),
        Decision::Reject(_)
    ));
}

#[test]
fn a_costly_request_rejected_by_a_later_rule_gives_back_its_whole_cost() {
    let doc = "resources:\n  - Url: /\n    rules: [{name: tokens, algo: TB, rpu: 100, unit: minute, cost: {header: x-cost, max: 50}}]\n  - Url: /chat\n    rules: [{name: calls, algo: W, rpu: 1, unit: minute}]\n";
    let mut h = Harness::new(doc);
    let big = Facts::default().header("x-cost", b"40");
    assert!(admits(&h.request("/chat", &big)));
    for _ in 0..5 {
        assert!(matches!(h.request("/chat", &big), Decision::Reject(_)));
    }
    // 100 - 40 = 60 tokens left for other pages, not 60 - 5 x 40.
    let sixty = Facts::default().header("x-cost", b"30");
    assert_eq!(h.admitted("/page", &sixty, 3), 2);
}

#[test]
fn a_global_rule_sends_the_cost_and_a_lease_that_covers_it() {
    let doc = "Url: /\nrules:\n  - {algo: TB, rpu: 100, unit: minute, scope: global, lease: 10, cost: {header: x-cost, max: 8}}\n";
    let mut h = Harness::new(doc);
    let (callout, pending) = call(h.evaluate("/", &Facts::default().header("x-cost", b"7")));
    let request: AcquireRequest = serde_json::from_slice(&callout.body).unwrap();
    assert_eq!((request.rules[0].want, request.rules[0].cost), (10, 7));
    assert!(admits(&h.complete(pending, answered(vec![granted(10)]))));
    // 3 tokens stashed: a request of cost 3 is served locally, one of cost 4 asks again.
    assert!(matches!(
        h.evaluate("/", &Facts::default().header("x-cost", b"3")),
        Decision::Allow { .. }
    ));
    assert!(matches!(
        h.evaluate("/", &Facts::default().header("x-cost", b"4")),
        Decision::Call(..)
    ));
}

fn after(decision: EngineDecision) -> AfterResponse {
    match decision {
        Decision::Allow {
            after: Some(after), ..
        } => after,
        other => panic!("expected an admission with response costs, got {other:?}"),
    }
}

#[test]
fn response_costs_are_charged_past_the_limit_and_deny_until_paid_back() {
    // An LLM token budget: 1000 tokens a minute per account, charged from the answer.
    let doc = "Url: /\nrules:\n  - {name: llm, actor: account, algo: TB, rpu: 1000, unit: minute, response_cost: {header: x-llm-tokens, max: 100000}}\n";
    let mut h = Harness::new(doc);
    let alice = Facts::default().header("x-account-id", b"alice");
    let charge = after(h.request("/", &alice));
    assert_eq!(charge.headers().collect::<Vec<_>>(), ["x-llm-tokens"]);
    // The answer used 2500 tokens: 1000 - 1 - 2500 is a debt, capped at one bucket.
    h.after_response(&charge, &[Some(b"2500".to_vec())]);
    assert!(matches!(h.request("/", &alice), Decision::Reject(_)));
    // A minute refills 1000 tokens: still owing.
    h.now += 60 * S;
    assert!(matches!(h.request("/", &alice), Decision::Reject(_)));
    // Two minutes refill the capped debt (one bucket below empty) and one token more.
    h.now += 61 * S;
    assert!(admits(&h.request("/", &alice)));
    // Another account was never charged.
    assert!(admits(
        &h.request("/", &Facts::default().header("x-account-id", b"bob"))
    ));
    // A missing or unreadable value charges nothing.
    let charge = after(h.request("/", &Facts::default().header("x-account-id", b"carol")));
    h.after_response(&charge, &[None]);
    assert_eq!(
        h.admitted(
            "/",
            &Facts::default().header("x-account-id", b"carol"),
            2000
        ),
        999
    );
}

#[test]
fn a_response_cost_is_paid_from_the_workers_batch_before_it_is_spent_again() {
    // The e2e LLM budget: 1000 tokens an hour; two answers of 600 tokens each. The second
    // request takes a batch (the counter had 399 left); its 600-token answer must use up
    // that batch, or the third request would be admitted from it.
    let doc = "Url: /\nrules:\n  - {name: llm, actor: account, algo: TB, rpu: 1000, unit: hour, response_cost: {header: x-llm-tokens, max: 100000}}\n";
    let mut h = Harness::new(doc);
    let alice = Facts::default().header("x-account-id", b"alice");
    for _ in 0..2 {
        let charge = after(h.request("/", &alice));
        h.now += Nanos::from_millis(1);
        h.after_response(&charge, &[Some(b"600".to_vec())]);
        h.now += Nanos::from_millis(1);
    }
    assert!(matches!(h.request("/", &alice), Decision::Reject(_)));
}

#[test]
fn global_response_costs_are_paid_from_the_tick_or_charged_locally() {
    let doc = "resources:\n  - Url: /\n    rules: [{name: llm, algo: W, rpu: 100, unit: minute, scope: global, response_cost: {header: x-tokens, max: 500}}]\nglobal: {retry_seconds: 5}\n";
    let mut h = Harness::new(doc);
    let charge = after(h.request("/", &Facts::default()));
    h.after_response(&charge, &[Some(b"60".to_vec())]);
    assert!(h.engine.owes());
    let [Call { callout, then }] = <[Call; 1]>::try_from(h.tick()).unwrap();
    assert!(callout
        .headers
        .contains(&(":path", "/v1/charge".to_string())));
    assert_eq!(want(&callout), 60);
    // The service is down: the 60 tokens are charged locally instead, and the breaker opens.
    assert!(h.answer(then, Answer::NoAnswer).is_none());
    assert!(!h.engine.owes());
    assert!(h.metrics.degraded);
    // Degraded: the local counter holds the 60 owed (the first request was counted by the
    // service): 40 more requests pass.
    assert_eq!(h.admitted("/", &Facts::default(), 100), 40);
}

#[test]
fn global_debts_beyond_one_charge_are_all_sent_over_the_next_ticks() {
    // 200 identities owe in one tick (more than the 64 rules one charge carries), and one
    // of them owes 250,000 tokens (more than one rule's 100,000): every token is sent, in
    // charges of at most 64 rules and MAX_TOTAL_WANT tokens. Before, nothing was ever sent.
    let doc = "resources:\n  - Url: /\n    rules: [{name: llm, actor: account, algo: TB, rpu: 1000000, unit: hour, scope: global, lease: 1, response_cost: {header: x-tokens, max: 1000000}}]\nglobal: {retry_seconds: 5}\n";
    let mut h = Harness::new(doc);
    let mut owed = 0u64;
    for i in 0..200u64 {
        let facts = Facts::default().header("x-account-id", format!("acct-{i}").as_bytes());
        let (_, pending) = call(h.evaluate("/", &facts));
        let charge = after(h.complete(pending, answered(vec![granted(1)])));
        let tokens: u64 = if i == 7 { 250_000 } else { 100 + i };
        owed += tokens;
        h.after_response(&charge, &[Some(tokens.to_string().into_bytes())]);
    }
    let mut sent = 0u64;
    let mut charges = 0;
    while let Some(Call { callout, then }) = h.tick().pop() {
        let request: AcquireRequest = serde_json::from_slice(&callout.body).unwrap();
        assert!(request.rules.len() <= wire::MAX_RULES);
        let total: u64 = request.rules.iter().map(|rule| u64::from(rule.want)).sum();
        assert!(total <= wire::MAX_TOTAL_WANT);
        assert!(wire::validate(&request).is_ok());
        assert_eq!(
            total,
            then.debts().iter().map(|debt| debt.tokens).sum::<u64>()
        );
        sent += total;
        charges += 1;
        let paid = h.answer(then, Answer::with(200, b"{\"results\":[]}".to_vec()));
        assert!(paid.is_none());
        assert!(charges < 50, "charges never end");
    }
    assert!(!h.engine.owes());
    assert_eq!(sent, owed);
    assert!(charges >= 200 / wire::MAX_RULES, "{charges}");
}

#[test]
fn one_requests_wants_add_up_to_what_the_service_accepts() {
    // Twelve global rules, each with a lease of 100,000: 1.2 million asked at once would be
    // refused (400); the wants are lowered to 1,000,000 in all, each keeping its cost.
    let mut doc = String::from("resources:\n  - Url: /\n    rules:\n");
    for i in 0..12 {
        doc.push_str(&format!(
            "      - {{name: r{i}, algo: TB, rpu: 1000000, unit: hour, scope: global, lease: 100000}}\n"
        ));
    }
    let mut h = Harness::new(&doc);
    let (callout, _) = call(h.evaluate("/", &Facts::default()));
    let request: AcquireRequest = serde_json::from_slice(&callout.body).unwrap();
    assert_eq!(request.rules.len(), 12);
    let total: u64 = request.rules.iter().map(|rule| u64::from(rule.want)).sum();
    assert!(total <= wire::MAX_TOTAL_WANT, "{total}");
    assert!(total > wire::MAX_TOTAL_WANT - 12, "{total}");
    assert!(request.rules.iter().all(|rule| rule.want >= rule.cost));
    assert!(wire::validate(&request).is_ok());
}

#[test]
fn a_busy_counter_is_charged_in_batches_without_host_calls_and_stays_exact() {
    for algo in ["W", "SW", "TB"] {
        let doc = format!("Url: /\nrules:\n  - {{algo: {algo}, rpu: 100000, unit: hour}}\n");
        let mut h = Harness::new(&doc);
        assert_eq!(h.admitted("/", &Facts::default(), 1000), 1000);
        let (reads, writes) = h.host.calls();
        // One read and one compare-and-swap per batch of up to 64, not per request.
        assert!(writes <= 40, "{algo}: {writes} writes for 1000 requests");
        assert!(reads <= 80, "{algo}: {reads} reads for 1000 requests");
        // The worker's tick gives the unspent tokens back: the counter holds exactly 1000.
        h.engine
            .tick(&mut Cx::new(&h.host, h.now + S, &mut NoMetrics));
        let rule = h.engine.policy().rule(0).unwrap();
        let mut state = h
            .engine
            .local
            .store()
            .peek(&h.host, &h.engine.table(rule), SlotAddress::single(), h.now)
            .unwrap();
        let left = rule
            .algo
            .acquire(&rule.limit, &mut state, h.now, 0)
            .remaining;
        assert_eq!(left, 99_000, "{algo}");
    }
}

#[test]
fn near_the_limit_four_racing_workers_admit_exactly_the_limit() {
    for semantics in [CasSemantics::Envoy, CasSemantics::Nginx] {
        for (algo, rpu) in [("W", 20), ("SW", 20), ("TB", 20), ("W", 500), ("TB", 500)] {
            let doc = format!("Url: /\nrules:\n  - {{algo: {algo}, rpu: {rpu}, unit: hour}}\n");
            let policy = parse_policy(&doc).unwrap();
            let host = Arc::new(MemoryHost::new(semantics));
            let start = Arc::new(Barrier::new(4));
            let workers: Vec<_> = (0..4)
                .map(|_| {
                    let (host, start, policy) =
                        (Arc::clone(&host), Arc::clone(&start), policy.clone());
                    std::thread::spawn(move || {
                        let engine = Engine::new(policy);
                        let mut metrics = CountingMetrics::default();
                        start.wait();
                        (0..rpu + 40)
                            .filter(|_| {
                                admits(&engine.evaluate(
                                    &mut Cx::new(host.as_ref(), T0, &mut metrics),
                                    b"/",
                                    &Facts::default(),
                                ))
                            })
                            .count()
                    })
                })
                .collect();
            let admitted: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
            // Every worker offers more than the limit: the batches end one by one and
            // nothing is left held.
            assert_eq!(admitted, rpu as usize, "{algo} rpu {rpu} {semantics:?}");
        }
    }
}

#[test]
fn a_denial_is_remembered_briefly_without_host_calls() {
    let mut h = Harness::new("Url: /\nrules:\n  - {algo: W, rpu: 2, unit: minute}\n");
    assert_eq!(h.admitted("/", &Facts::default(), 3), 2);
    let before = h.host.calls();
    assert_eq!(h.admitted("/", &Facts::default(), 50), 0);
    assert_eq!(h.host.calls(), before, "remembered denials read nothing");
    h.now += crate::local::DENIAL_CACHE;
    assert_eq!(h.admitted("/", &Facts::default(), 1), 0);
    assert!(
        h.host.calls().0 > before.0,
        "after the cache time the counter is read again"
    );
}

#[test]
fn lease_auto_grows_with_the_spending_rate_up_to_its_cap() {
    let doc = "resources:\n  - Url: /\n    rules: [{algo: W, rpu: 100000, unit: second, scope: global, lease: auto}]\n";
    let mut h = Harness::new(doc);
    let mut wants = Vec::new();
    // 10,000 requests a second for one second.
    for _ in 0..10_000 {
        h.now += S / 10_000;
        match h.evaluate("/", &Facts::default()) {
            Decision::Call(Call {
                callout,
                then: pending,
            }) => {
                let request: AcquireRequest = serde_json::from_slice(&callout.body).unwrap();
                wants.push(request.rules[0].want);
                let reply = h.service.answer(&callout, h.now);
                assert!(admits(&h.complete(pending, reply)));
            }
            decided => assert!(admits(&decided)),
        }
    }
    // The first callout asks for one request's cost; then what 100 ms of this rate spends,
    // at most 1% of the limit (1,000).
    assert_eq!(wants[0], 1);
    assert!(wants.iter().all(|&want| want <= 1_000), "{wants:?}");
    assert!(*wants.last().unwrap() >= 500, "{wants:?}");
    assert!(
        wants.len() < 100,
        "{} callouts for 10,000 requests",
        wants.len()
    );
}

/// `n` requests that find a flight in the air and park behind it.
fn park(h: &mut Harness, n: usize) -> Vec<Pending> {
    (0..n)
        .map(|_| match h.evaluate("/", &Facts::default()) {
            Decision::Wait(pending) => pending,
            other => panic!("expected to wait for the flight, got {other:?}"),
        })
        .collect()
}

/// The tokens a callout asks for its first rule.
fn want(callout: &Callout) -> u32 {
    let request: AcquireRequest = serde_json::from_slice(&callout.body).unwrap();
    request.rules[0].want
}

/// Drives one worker's parked requests the way the host's tick does: resumes every woken
/// request, answers the calls they make at once, and repeats until nobody is parked.
/// Returns the decisions, in order, and the `want` of each call they made.
fn drive_riders(h: &mut Harness, mut parked: Vec<Pending>) -> (Vec<EngineDecision>, Vec<u32>) {
    let mut decided = Vec::new();
    let mut calls = Vec::new();
    while !parked.is_empty() {
        let woken = h.engine.woken(h.now);
        assert!(!woken.is_empty(), "parked requests but nobody woken");
        let mut flying = Vec::new();
        for id in woken {
            let at = parked.iter().position(|p| p.rider() == Some(id)).unwrap();
            let pending = parked.remove(at);
            match h.resume(pending) {
                Decision::Wait(again) => parked.push(again),
                Decision::Call(Call { callout, then }) => flying.push((callout, then)),
                other => decided.push(other),
            }
        }
        for (callout, pending) in flying {
            let request: AcquireRequest = serde_json::from_slice(&callout.body).unwrap();
            calls.push(request.rules[0].want);
            let reply = h.service.answer(&callout, h.now);
            decided.push(h.complete(pending, reply));
        }
    }
    (decided, calls)
}

#[test]
fn concurrent_requests_of_one_worker_make_one_callout_per_rule_and_identity() {
    let doc = "resources:\n  - Url: /\n    rules: [{rpu: 1000, unit: minute, scope: global}]\n";
    let mut h = Harness::new(doc);
    let (callout, leader) = call(h.evaluate("/", &Facts::default()));
    let parked = park(&mut h, 9);
    assert_eq!(h.metrics.event_count(Event::GlobalCoalesced), 9);
    let reply = h.service.answer(&callout, h.now);
    assert!(admits(&h.complete(leader, reply)));
    // The first woken request leads the next flight and asks for the other eight too.
    assert!(h.engine.has_riders());
    let (decided, calls) = drive_riders(&mut h, parked);
    assert_eq!(calls, vec![9], "one callout for the nine parked requests");
    assert_eq!(decided.len(), 9);
    assert!(decided.iter().all(admits), "{decided:?}");
    assert_eq!(h.metrics.event_count(Event::GlobalCallout), 2);
    assert!(!h.engine.has_riders());
    // Nothing was over-leased: the next request calls again, for itself alone (the eight
    // served from the stash are not expected any more: asking for them would leave eight
    // tokens in this gateway's stash that another gateway is refused).
    let (next, _) = call(h.evaluate("/", &Facts::default()));
    assert_eq!(want(&next), 1);
}

#[test]
fn a_flight_asks_only_for_the_woken_requests_still_waiting() {
    let doc = "resources:\n  - Url: /\n    rules: [{rpu: 1000, unit: minute, scope: global}]\n";
    let mut h = Harness::new(doc);
    let (callout, leader) = call(h.evaluate("/", &Facts::default()));
    let parked = park(&mut h, 4);
    let reply = h.service.answer(&callout, h.now);
    assert!(admits(&h.complete(leader, reply)));
    // Woken, not yet planned again: a new request leads and asks for the four as well.
    let (fresh, fresh_pending) = call(h.evaluate("/", &Facts::default()));
    assert_eq!(want(&fresh), 5);
    let reply = h.service.answer(&fresh, h.now);
    assert!(admits(&h.complete(fresh_pending, reply)));
    // Two of them leave; the two others are served by the new request's grant, and the
    // two tokens asked for the leavers are what is left in the stash.
    let mut parked = parked;
    for _ in 0..2 {
        let gone = parked.pop().unwrap();
        h.abandon(gone);
    }
    let (decided, calls) = drive_riders(&mut h, parked);
    assert!(calls.is_empty(), "{calls:?}");
    assert_eq!(decided.iter().filter(|d| admits(d)).count(), 2);
    for _ in 0..2 {
        assert!(matches!(
            h.evaluate("/", &Facts::default()),
            Decision::Allow { .. }
        ));
    }
    // Nobody is expected any more: the next flight is for one.
    let (next, _) = call(h.evaluate("/", &Facts::default()));
    assert_eq!(want(&next), 1);
}

#[test]
fn parked_requests_admit_exactly_the_global_limit() {
    for algo in ["W", "SW", "TB"] {
        let doc = format!(
            "resources:\n  - Url: /\n    rules: [{{algo: {algo}, rpu: 5, unit: minute, scope: global, lease: 2}}]\n"
        );
        let mut h = Harness::new(&doc);
        let (callout, leader) = call(h.evaluate("/", &Facts::default()));
        let parked: Vec<Pending> = (0..11)
            .map(|_| match h.evaluate("/", &Facts::default()) {
                Decision::Wait(pending) => pending,
                other => panic!("{algo}: expected to wait, got {other:?}"),
            })
            .collect();
        let reply = h.service.answer(&callout, h.now);
        assert!(admits(&h.complete(leader, reply)));
        let (decided, wants) = drive_riders(&mut h, parked);
        let admitted = decided.iter().filter(|d| admits(d)).count();
        assert_eq!(admitted + 1, 5, "{algo}: {decided:?}");
        assert_eq!(decided.len(), 11);
        // One flight at a time, each asking for everyone still waiting: the leader's
        // spare token serves the first woken request; the second leads, asks for its
        // lease plus the nine behind it (2 + 9) and is granted the 3 left; of the nine
        // that wait again two are served by that grant, the third asks for 2 + 6 and is
        // denied, and the denial is cached for the other six.
        assert_eq!(wants, vec![11, 8], "{algo}");
    }
}

#[test]
fn a_request_that_leaves_while_parked_or_calling_gives_its_charges_back() {
    // A local rule charged first, then the global one.
    let doc = "resources:\n  - Url: /\n    rules: [{rpu: 2, unit: minute}, {rpu: 100, unit: minute, scope: global}]\n";
    let mut h = Harness::new(doc);
    let (callout, leader) = call(h.evaluate("/", &Facts::default()));
    let Decision::Wait(rider) = h.evaluate("/", &Facts::default()) else {
        panic!("expected to wait");
    };
    // The local rule (2 per minute) is full: both hold a charge.
    assert!(matches!(
        h.evaluate("/", &Facts::default()),
        Decision::Reject(_)
    ));
    // The parked request's client goes away: its local charge comes back.
    h.abandon(rider);
    assert!(!h.engine.has_riders());
    let again = h.evaluate("/", &Facts::default());
    let Decision::Wait(rider) = again else {
        panic!("expected to wait, got {again:?}");
    };
    // The caller goes away too (the host cancels its call): the parked request is woken
    // and leads the next flight.
    h.abandon_call(leader);
    assert_eq!(h.engine.woken(h.now), vec![rider.rider().unwrap()]);
    let (next, pending) = call(h.resume(rider));
    let reply = h.service.answer(&next, h.now);
    assert!(admits(&h.complete(pending, reply)));
    // One local token left for the abandoned caller's.
    assert!(matches!(
        h.request("/", &Facts::default()),
        Decision::Allow { .. }
    ));
    assert!(matches!(
        h.evaluate("/", &Facts::default()),
        Decision::Reject(_)
    ));
    drop(callout);
}

#[test]
fn leaky_buckets_and_hosts_that_cannot_resume_never_park() {
    let lb =
        "resources:\n  - Url: /\n    rules: [{algo: LB, rpu: 100, unit: second, scope: global}]\n";
    let mut h = Harness::new(lb);
    let _first = call(h.evaluate("/", &Facts::default()));
    let _second = call(h.evaluate("/", &Facts::default()));
    let tb = "resources:\n  - Url: /\n    rules: [{rpu: 100, unit: second, scope: global}]\n";
    let mut h = Harness::new(tb);
    h.engine = Engine::new(parse_policy(tb).unwrap()).resuming_elsewhere(false);
    let _first = call(h.evaluate("/", &Facts::default()));
    let _second = call(h.evaluate("/", &Facts::default()));
    assert_eq!(h.metrics.event_count(Event::GlobalCoalesced), 0);
}

#[test]
fn a_lost_flight_wakes_its_riders_after_its_deadline() {
    let doc = "resources:\n  - Url: /\n    rules: [{rpu: 100, unit: minute, scope: global}]\nglobal: {timeout_ms: 50}\n";
    let mut h = Harness::new(doc);
    let _lost = call(h.evaluate("/", &Facts::default()));
    let Decision::Wait(rider) = h.evaluate("/", &Facts::default()) else {
        panic!("expected to wait");
    };
    h.now += S;
    assert!(h.engine.woken(h.now).is_empty());
    h.now += 50 * S / 1000;
    assert_eq!(h.engine.woken(h.now), vec![rider.rider().unwrap()]);
    assert!(matches!(h.resume(rider), Decision::Call(..)));
}

/// Sends the refills the engine wants ahead, answered by the in-memory service at once,
/// as the host's tick does. Returns how many were sent.
fn send_refills(h: &mut Harness) -> usize {
    let refills = h.tick();
    let sent = refills.len();
    for Call { callout, then } in refills {
        assert!(then.asked().is_some_and(|asked| asked.is_refill()));
        let request: AcquireRequest = serde_json::from_slice(&callout.body).unwrap();
        assert_eq!(
            request.rules[0].cost, 1,
            "a refill takes nothing for a request"
        );
        let answer = h.service.answer(&callout, h.now);
        assert!(h.answer(then, answer).is_none());
    }
    sent
}

#[test]
fn a_stash_running_low_is_refilled_ahead_and_no_request_waits_for_a_callout() {
    let doc = "resources:\n  - Url: /\n    rules: [{rpu: 100000, unit: minute, scope: global, lease: 10}]\n";
    let mut h = Harness::new(doc);
    assert!(admits(&h.request("/", &Facts::default())));
    let mut refills = 0;
    for i in 0..200 {
        let decision = h.evaluate("/", &Facts::default());
        assert!(
            matches!(decision, Decision::Allow { .. }),
            "request {i} did not get leased tokens at once: {decision:?}"
        );
        refills += send_refills(&mut h);
    }
    // The first request's call, then one refill per lease spent.
    assert_eq!(refills, 20, "one refill per lease of 10");
    assert_eq!(h.metrics.event_count(Event::RefillAhead), 20);
    assert_eq!(h.metrics.event_count(Event::GlobalCallout), 21);
    assert!(!h.engine.wants_tick_soon());
}

#[test]
fn refills_ahead_stay_exact_at_the_limit_and_requests_park_behind_one_in_flight() {
    for algo in ["W", "SW", "TB"] {
        let doc = format!(
            "resources:\n  - Url: /\n    rules: [{{algo: {algo}, rpu: 25, unit: minute, scope: global, lease: 10}}]\n"
        );
        let mut h = Harness::new(&doc);
        let mut admitted = 0;
        for _ in 0..60 {
            if admits(&h.request("/", &Facts::default())) {
                admitted += 1;
            }
            send_refills(&mut h);
        }
        assert_eq!(admitted, 25, "{algo}");
        // A refill in flight: the request that finds the stash empty parks behind it.
        let mut h = Harness::new(&doc);
        assert!(admits(&h.request("/", &Facts::default())));
        while !h.engine.wants_tick_soon() {
            assert!(admits(&h.evaluate("/", &Facts::default())), "{algo}");
        }
        let mut in_flight = h.tick();
        assert_eq!(in_flight.len(), 1, "{algo}");
        let mut parked = Vec::new();
        loop {
            match h.evaluate("/", &Facts::default()) {
                Decision::Allow { .. } => {}
                Decision::Wait(pending) => {
                    parked.push(pending);
                    break;
                }
                other => panic!("{algo}: expected leased tokens, then to park: {other:?}"),
            }
        }
        let Call { callout, then } = in_flight.remove(0);
        let answer = h.service.answer(&callout, h.now);
        assert!(h.answer(then, answer).is_none());
        let (decided, calls) = drive_riders(&mut h, parked);
        assert!(decided.iter().all(admits), "{algo}: {decided:?}");
        assert!(
            calls.is_empty(),
            "{algo}: the refill served the parked request"
        );
    }
}

/// The rate-limit fields of a rejection: `Retry-After`, `X-RateLimit-Reset` and the
/// IETF `RateLimit` field's `t` (`None` where the style leaves a field out).
fn waits(rejection: &Rejection) -> (Option<u64>, Option<u64>, Option<u64>) {
    let number = |name: &str| header(rejection, name).and_then(|v| v.parse().ok());
    let t = header(rejection, "ratelimit")
        .and_then(|v| v.rsplit(";t=").next())
        .and_then(|t| t.parse().ok());
    (number("retry-after"), number("x-ratelimit-reset"), t)
}

/// W 5/minute: five requests at T0 (one second into a minute), then more from five seconds
/// on. The 6th is computed (the counter, or the quota service); later ones within 100 ms
/// are answered from what the worker or the gateway remembers of that denial. Every one
/// says the real wait, 54 s (the window ends at :60), in every header style — not the
/// memory's own life (`Retry-After: 1` before).
#[test]
fn every_rejection_says_the_real_wait_computed_or_remembered_in_every_style() {
    let rules = [
        ("local", "algo: W"),
        ("global, lease 1", "algo: W, scope: global"),
        ("global, lease 10", "algo: W, scope: global, lease: 10"),
    ];
    let styles = [
        ("x-ratelimit", true, false),
        ("ietf", false, true),
        ("both", true, true),
    ];
    // Offsets after T0 + 5 s: computed, then remembered (the worker's memory lasts 100 ms).
    let offsets = [Nanos::ZERO, S / 20, 80 * S / 1000, 99 * S / 1000];
    for (label, rule) in rules {
        for (style, legacy, ietf) in styles {
            let doc = format!(
                "resources:\n  - Url: /\n    rules: [{{name: w, rpu: 5, unit: minute, {rule}}}]\nresponse: {{header_style: {style}}}\n"
            );
            let mut h = Harness::new(&doc);
            assert_eq!(h.admitted("/", &Facts::default(), 5), 5, "{label}");
            for (n, offset) in offsets.into_iter().enumerate() {
                h.now = T0 + 5 * S + offset;
                let rejection = rejection(h.request("/", &Facts::default()));
                let expected = (Some(54), legacy.then_some(54), ietf.then_some(54));
                assert_eq!(
                    waits(&rejection),
                    expected,
                    "{label}, {style}: request {} at +{offset:?}: {:?}",
                    n + 6,
                    rejection.headers
                );
            }
        }
    }
}

/// The same for algorithms whose wait depends on the time left and the cost (sliding
/// window, token bucket): a worker's remembered answer is what a worker with no memory
/// computes from the counter at the same instant.
#[test]
fn a_remembered_denial_answers_what_the_counter_says_at_that_instant() {
    for algo in ["W", "SW", "TB"] {
        let doc = format!(
            "resources:\n  - Url: /\n    rules: [{{name: r, rpu: 5, unit: minute, algo: {algo}}}]\nresponse: {{header_style: both}}\n"
        );
        let mut h = Harness::new(&doc);
        let mut fresh = Worker::new(&doc);
        assert_eq!(h.admitted("/", &Facts::default(), 5), 5, "{algo}");
        h.now = T0 + 5 * S;
        let computed = rejection(h.request("/", &Facts::default()));
        for offset in [S / 20, 99 * S / 1000] {
            h.now = T0 + 5 * S + offset;
            let before = h.host.calls();
            let remembered = rejection(h.request("/", &Facts::default()));
            assert_eq!(h.host.calls(), before, "{algo}: answered from memory");
            let counted = rejection(fresh.request(&h.host, h.now));
            assert_eq!(waits(&remembered), waits(&counted), "{algo} +{offset:?}");
            assert!(
                waits(&remembered).0 > Some(1),
                "{algo}: {:?}",
                remembered.headers
            );
        }
        assert!(
            waits(&computed).0 > Some(1),
            "{algo}: {:?}",
            computed.headers
        );
    }
}

/// A request takes a local token from its worker's batch, then waits for its global
/// callout; meanwhile the worker's tick retires the batch (its span ended). The service
/// denies: the token goes back to the shared counter, which then admits exactly the 999
/// the first request left (998 before: the token was dropped with the retired batch).
#[test]
fn a_token_from_a_batch_retired_during_the_callout_goes_back_when_the_request_is_rejected() {
    let doc = "resources:\n  - Url: /\n    rules: [{name: site, rpu: 1000, unit: hour, algo: W}]\n  - Url: /g\n    rules: [{name: g, rpu: 10, unit: minute, scope: global}]\n";
    let mut h = Harness::new(doc);
    assert!(admits(&h.request("/", &Facts::default())));
    // The second request's local charge takes a batch (999 left: 62 beyond its own).
    let (_, pending) = call(h.evaluate("/g", &Facts::default()));
    h.now += S;
    assert_eq!(
        h.engine
            .return_unspent(&mut Cx::new(&h.host, h.now, &mut NoMetrics)),
        62,
        "the idle batch is retired, its unspent tokens returned"
    );
    assert!(matches!(
        h.complete(pending, answered(vec![denied(30_000)])),
        Decision::Reject(_)
    ));
    assert_eq!(h.admitted("/", &Facts::default(), 1_100), 999);
}

/// Identities whose lease stashes share a slot (`slots: 1`: every identity in slot 0).
fn same_slot(rpu: u32) -> String {
    format!("resources:\n  - Url: /\n    rules: [{{actor: ip, rpu: {rpu}, unit: minute, scope: global, lease: 10, slots: 1}}]\n")
}

fn ip(last: u8) -> Facts {
    Facts::default().ip(format!("10.0.0.{last}").as_bytes())
}

/// Three identities in one stash slot each get a lease of 10: each spends its own nine
/// spare tokens without another callout (two in the slot's ways, the third in its
/// worker's batch); before, each grant overwrote the record, and the tokens the service
/// had charged for the others were lost (and called for again).
#[test]
fn identities_sharing_a_stash_slot_keep_their_own_tokens() {
    let mut h = Harness::new(&same_slot(100));
    for last in 1..=3 {
        assert!(admits(&h.request("/", &ip(last))));
    }
    assert_eq!(h.service.calls(), 3);
    for last in 1..=3 {
        assert_eq!(h.admitted("/", &ip(last), 9), 9, "10.0.0.{last}");
    }
    assert_eq!(
        h.service.calls(),
        3,
        "every spare token spent, none asked again"
    );
    // The next request of each asks the service.
    assert!(matches!(h.evaluate("/", &ip(1)), Decision::Call(..)));
}

/// One identity's denial, cached in the slot it shares, neither destroys another's tokens
/// nor is destroyed by another's grant.
#[test]
fn a_denial_cached_in_a_shared_stash_slot_keeps_the_other_identitys_tokens() {
    let mut h = Harness::new(&same_slot(10));
    let (a, b) = (ip(1), ip(2));
    assert!(admits(&h.request("/", &a)));
    assert!(admits(&h.request("/", &b)));
    assert_eq!(h.admitted("/", &a, 9), 9);
    // a's limit is spent: the service denies it, and the denial is cached.
    assert!(matches!(h.request("/", &a), Decision::Reject(_)));
    assert_eq!(h.service.calls(), 3);
    // b still spends its nine spare tokens; a is still denied without a callout.
    assert_eq!(h.admitted("/", &b, 9), 9);
    h.now += S / 5;
    assert!(matches!(h.evaluate("/", &a), Decision::Reject(_)));
    assert_eq!(h.service.calls(), 3);
}

/// A token bucket's wait grows with the cost: a remembered denial of a request of cost 1
/// does not answer one of cost 3 (which reads the counter and is told its own wait).
#[test]
fn a_remembered_denial_answers_only_requests_of_the_cost_it_was_about() {
    let doc = "Url: /\nrules:\n  - {name: r, algo: TB, rpu: 6, unit: minute, cost: {header: x-cost, default: 1, max: 6}}\n";
    let mut h = Harness::new(doc);
    let mut fresh = Worker::new(doc);
    let cost = |value: &[u8]| Facts::default().header("x-cost", value);
    assert!(admits(&h.request("/", &cost(b"6"))));
    let one = rejection(h.request("/", &cost(b"1")));
    h.now += S / 20;
    let three = rejection(h.request("/", &cost(b"3")));
    let counted = rejection(fresh.engine.evaluate(
        &mut Cx::new(&h.host, h.now, &mut fresh.metrics),
        b"/",
        &cost(b"3"),
    ));
    assert_eq!(waits(&one).0, Some(10), "one token back in 10 s");
    assert_eq!(waits(&three), waits(&counted));
    assert_eq!(waits(&three).0, Some(30), "three tokens back in 30 s");
}

#[test]
fn each_plan_has_its_limit_and_counter_and_other_values_share_the_default() {
    for scope in ["local", "global"] {
        let doc = format!(
            "resources:\n  - Url: /\n    rules:\n      - name: api\n        actor: account\n        \
             scope: {scope}\n        unit: minute\n        \
             rpu: {{by: x-plan, values: {{free: 2, pro: 5}}, default: 1}}\n"
        );
        let mut h = Harness::new(&doc);
        let account = |plan: Option<&[u8]>| {
            let facts = Facts::default().header("x-account-id", b"acme");
            match plan {
                Some(plan) => facts.header("x-plan", plan),
                None => facts,
            }
        };
        assert_eq!(h.admitted("/", &account(Some(b"free")), 10), 2, "{scope}");
        assert_eq!(h.admitted("/", &account(Some(b"pro")), 10), 5, "{scope}");
        // A value sent with spaces is the same plan; one that names no plan, and no
        // header at all, count on the default's counter together.
        let mut h = Harness::new(&doc);
        assert_eq!(h.admitted("/", &account(Some(b" pro ")), 10), 5, "{scope}");
        assert_eq!(h.admitted("/", &account(Some(b"gold")), 10), 1, "{scope}");
        assert_eq!(h.admitted("/", &account(None), 10), 0, "{scope}");
        assert_eq!(h.admitted("/", &account(Some(b"free")), 10), 2, "{scope}");
        // Each plan reports its own metrics.
        let names: Vec<&str> = h.engine.rules().map(|rule| rule.name.as_str()).collect();
        assert_eq!(names, ["api.free", "api.pro", "api.default"], "{scope}");
    }
}

#[test]
fn a_plan_can_come_from_a_claim_of_the_bearer_token() {
    let doc =
        "resources:\n  - Url: /\n    rules:\n      - name: api\n        unit: minute\n        \
               rpu: {by: {jwt_claim: /tier/name}, values: {pro: 3}, default: 1}\n";
    let mut h = Harness::new(doc);
    // {"tier":{"name":"pro"}}, unsigned: Diana reads claims, a filter before it verifies.
    let bearer = b"Bearer eyJhbGciOiJub25lIn0.eyJ0aWVyIjp7Im5hbWUiOiJwcm8ifX0.";
    let pro = Facts::default().header("authorization", bearer);
    assert_eq!(h.admitted("/", &pro, 10), 3);
    assert_eq!(h.admitted("/", &Facts::default(), 10), 1);
}

/// Settles `charge` with the answer's header value, then runs the tick as a worker would:
/// what it sends (a global rule's tokens given back to the service) is answered by the
/// in-memory service.
fn settle_with(h: &mut Harness, charge: AfterResponse, value: &str) {
    h.after_response(&charge, &[Some(value.as_bytes().to_vec())]);
    for Call { callout, then } in h.tick() {
        let answer = h.service.answer(&callout, h.now);
        assert!(
            h.answer(then, answer).is_none(),
            "the tick's calls decide no request"
        );
    }
}

#[test]
fn a_reservation_keeps_concurrent_requests_within_the_budget_and_settles_to_the_actual_cost() {
    // 1000 tokens an hour per account; each request reserves 200 up front. 20 requests in
    // flight at once: 5 pass (before: all 20, each on the last token, ending 20 answers in
    // debt). The answers used 120 each: 80 of each reservation comes back, so the budget
    // was charged 600 and 400 are left: two more reservations of 200 pass.
    for scope in ["local", "global"] {
        let lease = if scope == "global" {
            ", lease: 200"
        } else {
            ""
        };
        let doc = format!(
            "Url: /\nrules:\n  - {{name: llm, actor: account, algo: TB, rpu: 1000, unit: hour, scope: {scope}{lease}, \
             response_cost: {{header: x-llm-tokens, max: 100000, reserve: 200}}}}\n"
        );
        let mut h = Harness::new(&doc);
        let alice = Facts::default().header("x-account-id", b"alice");
        let mut charges = Vec::new();
        for _ in 0..20 {
            let decision = h.request("/", &alice);
            if admits(&decision) {
                charges.push(after(decision));
            }
        }
        assert_eq!(charges.len(), 5, "{scope}");
        for charge in charges {
            settle_with(&mut h, charge, "120");
        }
        assert_eq!(h.admitted("/", &alice, 10), 2, "{scope}");
        // Another account has its whole budget.
        assert_eq!(
            h.admitted("/", &Facts::default().header("x-account-id", b"bob"), 10),
            5,
            "{scope}"
        );
    }
}

#[test]
fn a_reservation_is_settled_up_past_the_limit_and_kept_without_an_answer() {
    let doc = "Url: /\nrules:\n  - {name: llm, actor: account, algo: TB, rpu: 1000, unit: hour, \
               response_cost: {header: x-llm-tokens, max: 100000, reserve: {header: x-max-tokens, default: 100, max: 500}}}\n";
    let mut h = Harness::new(doc);
    let asks = |max: &str| {
        Facts::default()
            .header("x-account-id", b"carol")
            .header("x-max-tokens", max.as_bytes())
    };
    // Reserves 500 (the request's own x-max-tokens), used 900: 400 more are owed.
    let charge = after(h.request("/", &asks("500")));
    settle_with(&mut h, charge, "900");
    // 100 left: a reservation of 100 passes, one of 101 does not.
    assert!(matches!(h.request("/", &asks("101")), Decision::Reject(_)));
    let kept = after(h.request("/", &asks("100")));
    // An answer without the header keeps its reservation: nothing is left.
    h.after_response(&kept, &[None]);
    assert!(matches!(h.request("/", &asks("1")), Decision::Reject(_)));
}

/// A reservation read from a request header is the client's choice (issue 41, item 5d):
/// `x-max-tokens: 1` on 60 concurrent calls of a 10,000-token budget whose answers used
/// 400 each spent 24,000 (each reserved 1, all 60 admitted, then charged 399 more each).
/// The floor (`reserve.min`, by default `default`: 400 here) makes each take at least 400:
/// 25 are admitted, the budget is spent exactly, and a late one is refused.
#[test]
fn a_reservation_cannot_go_below_its_floor_whatever_the_client_asks() {
    for scope in ["local", "global"] {
        let lease = if scope == "global" {
            ", lease: 8000"
        } else {
            ""
        };
        let doc = format!(
            "Url: /\nrules:\n  - {{name: llm, actor: account, algo: TB, rpu: 10000, unit: hour, scope: {scope}{lease}, \
             response_cost: {{header: x-llm-tokens, max: 8000, reserve: {{header: x-max-tokens, default: 400, max: 8000}}}}}}\n"
        );
        let mut h = Harness::new(&doc);
        let cheap = Facts::default()
            .header("x-account-id", b"mallory")
            .header("x-max-tokens", b"1");
        let charges: Vec<AfterResponse> = (0..60)
            .map(|_| h.request("/", &cheap))
            .filter(admits)
            .map(after)
            .collect();
        assert_eq!(charges.len(), 25, "{scope}: 10,000 / 400");
        for charge in charges {
            settle_with(&mut h, charge, "400");
        }
        assert_eq!(
            h.admitted("/", &cheap, 5),
            0,
            "{scope}: the budget is spent, not overrun"
        );
    }
}

#[test]
fn only_answers_of_the_counted_statuses_are_counted() {
    // Brute-force protection: 5 failed logins an hour per account. Successful logins are
    // given back; five failures deny the account, whatever it sends next.
    for scope in ["local", "global"] {
        let doc = format!(
            "Url: /login\nrules:\n  - {{name: failed_logins, actor: account, algo: W, rpu: 5, unit: hour, \
             scope: {scope}, count: {{status: [401, 403]}}}}\n"
        );
        let mut h = Harness::new(&doc);
        let dave = Facts::default().header("x-account-id", b"dave");
        let answer = |h: &mut Harness, status: &str| {
            let decision = h.request("/login", &dave);
            if !admits(&decision) {
                return false;
            }
            let charge = after(decision);
            assert_eq!(charge.headers().collect::<Vec<_>>(), [":status"]);
            settle_with(h, charge, status);
            true
        };
        for _ in 0..20 {
            assert!(answer(&mut h, "200"), "{scope}: a success is never counted");
        }
        for attempt in 0..5 {
            assert!(answer(&mut h, "401"), "{scope}: failure {attempt} passes");
        }
        assert!(
            !answer(&mut h, "200"),
            "{scope}: the sixth attempt is denied"
        );
        // Five requests in flight at once can each hold the last attempt: only one does.
        let mut h = Harness::new(&doc);
        for _ in 0..4 {
            assert!(answer(&mut h, "403"));
        }
        let in_flight: Vec<_> = (0..5)
            .map(|_| h.request("/login", &dave))
            .filter(admits)
            .collect();
        assert_eq!(in_flight.len(), 1, "{scope}");
    }
}

#[test]
fn reservations_settled_across_workers_give_back_exactly_what_was_unused() {
    // Four workers of one gateway share the local counter: 20 requests in flight reserve
    // 200 each of 1000, answers of 120 settle them; then exactly 400 are left.
    let doc = "Url: /\nrules:\n  - {name: llm, actor: account, algo: TB, rpu: 1000, unit: hour, \
               response_cost: {header: x-llm-tokens, max: 100000, reserve: 200}}\n";
    let mut h = Harness::new(doc);
    let mut workers: Vec<Worker> = (0..4).map(|_| Worker::new(doc)).collect();
    let alice = Facts::default().header("x-account-id", b"alice");
    let mut held = Vec::new();
    for i in 0..20 {
        let worker = &mut workers[i % 4];
        let decision = worker.engine.evaluate(
            &mut Cx::new(&h.host, h.now, &mut worker.metrics),
            b"/",
            &alice,
        );
        if admits(&decision) {
            held.push((i % 4, after(decision)));
        }
    }
    assert_eq!(held.len(), 5);
    h.now += S / 2;
    for (index, charge) in held {
        let worker = &mut workers[index];
        worker.engine.after_response(
            &mut Cx::new(&h.host, h.now, &mut worker.metrics),
            &charge,
            &[Some(b"120".to_vec())],
            Some(200),
        );
    }
    for worker in &workers {
        worker
            .engine
            .tick(&mut Cx::new(&h.host, h.now, &mut NoMetrics));
    }
    let mut admitted = 0;
    for i in 0..6 {
        let worker = &mut workers[i % 4];
        let decision = worker.engine.evaluate(
            &mut Cx::new(&h.host, h.now, &mut worker.metrics),
            b"/",
            &alice,
        );
        if admits(&decision) {
            admitted += 1;
            worker.engine.after_response(
                &mut Cx::new(&h.host, h.now, &mut worker.metrics),
                &after(decision),
                &[Some(b"200".to_vec())],
                Some(200),
            );
        }
    }
    assert_eq!(admitted, 2);
}

/// The report a tick's call carries, decoded.
fn report_of(call: &Call) -> crate::report::ReportRequest {
    crate::report::decode(&call.callout.body).unwrap_or_else(|error| panic!("{error}"))
}

#[test]
fn a_lost_report_drops_the_views_counts_and_keeps_the_breakers_calls() {
    let doc = "resources:\n  - Url: /\n    breaker: {name: pay, failure_ratio: 0.5, min_calls: 4, open_seconds: 30, scope: global}\n    rules: [{name: dev, actor: device, rpu: 1, unit: minute}]\nglobal: {cluster: q}\n";
    let mut h = Harness::new(doc);
    let device = Facts::default().header("x-device-id", b"device-42");
    let mut limited = 0;
    for _ in 0..3 {
        match h.evaluate("/", &device) {
            Decision::Allow {
                after: Some(after), ..
            } => h.after_response(&after, &[]),
            Decision::Reject(_) => limited += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(limited, 2);
    h.now = T0 + S;
    let mut calls = h.tick();
    assert_eq!(calls.len(), 1);
    let sent = report_of(&calls[0]);
    let line = &sent.rules[0];
    assert_eq!(
        (line.name.as_str(), line.admitted, line.limited),
        ("dev", 1, 2)
    );
    let hot = line.hot_limited.as_ref().unwrap().top(1)[0];
    assert_eq!((hot.label.as_str(), hot.count), ("device-42", 2));
    assert_eq!(sent.breakers.len(), 1);
    assert_ne!(sent.breakers[0].calls, Default::default());
    // Lost: the breaker's calls go into the next report, the view's counts do not.
    let Some(Call { then, .. }) = calls.pop() else {
        panic!("no call");
    };
    assert!(h.answer(then, Answer::NoAnswer).is_none());
    h.now = T0 + S + S / 2;
    let next = h.tick();
    let resent = report_of(&next[0]);
    assert!(resent.rules.is_empty() && resent.paths.is_none());
    assert_eq!(resent.breakers[0].calls, sent.breakers[0].calls);
    // The real time since the previous report.
    assert_eq!(resent.interval_ms, 500);
}

/// A breaker's settings are dated by the instant the worker installed their document, not
/// by the engine's first use: a worker's local document (`force: auto`) that the worker
/// replaces at its first tick by the config center's newer one is still ticked once, and
/// must not then count as the newest, which would switch every worker back to `auto` while
/// the config center says `open` (the symptom of a CI failure on Envoy: eight requests
/// failed fast, the ninth went through).
#[test]
fn a_document_installed_earlier_never_overrides_a_newer_one_whenever_it_is_first_used() {
    let breaker = |force: &str| {
        format!("resources:\n  - Url: /\n    breaker: {{name: dep, failure_ratio: 0.5, open_seconds: 9, force: {force}}}\n")
    };
    let host = MemoryHost::new(CasSemantics::Envoy);
    let mut metrics = CountingMetrics::default();
    // Worker A installed the local document at T0 and has not ticked yet; worker B runs the
    // config center's `force: open` since T0 + 1 s.
    let local = Engine::new(parse_policy(&breaker("auto")).unwrap()).installed_at(T0);
    let remote = Engine::new(parse_policy(&breaker("open")).unwrap()).installed_at(T0 + S);
    let fast_fails = |engine: &Engine, metrics: &mut CountingMetrics, at: Instant| {
        let mut cx = Cx::new(&host, at, metrics);
        matches!(
            engine.evaluate(&mut cx, b"/", &Facts::default()),
            Decision::Reject(_)
        )
    };
    assert!(fast_fails(&remote, &mut metrics, T0 + S));
    // A's first tick, two seconds later: the local engine's handles are made now, dated by
    // its install.
    let mut cx = Cx::new(&host, T0 + 3 * S, &mut metrics);
    local.tick(&mut cx);
    // Past the verdict B keeps in memory: B reads the record again, still forced open.
    let later = T0 + 3 * S + crate::breaker::record::VERDICT_CACHE + Nanos::new(1);
    assert!(fast_fails(&remote, &mut metrics, later));
    // And the local engine, used now, obeys the newer document's switch as well.
    assert!(fast_fails(&local, &mut metrics, later));
    // A worker that started late installed its local document after B's: newer by its
    // date, older by its document. Retired (the worker adopted the config center's at
    // once), it makes no handle at its one tick, so its settings never reach the record.
    let late = Engine::new(parse_policy(&breaker("auto")).unwrap()).installed_at(T0 + 5 * S);
    late.retire();
    let mut cx = Cx::new(&host, T0 + 6 * S, &mut metrics);
    late.tick(&mut cx);
    assert!(fast_fails(&remote, &mut metrics, T0 + 7 * S));
}
