//! The gateways' tick report (`POST /v1/report`) and the fleet view (`GET /v1/view`,
//! `/metrics`), through the HTTP layer in-process: the fleet's breaker scenario against
//! every store (the embedded memory store, a real Redis, a 3-master Redis Cluster), the
//! report's bounds, Redis down, who may read the view, and the metrics it exports.

#![cfg(test)]

mod common;

use async_trait::async_trait;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use common::*;
use diana_core::breaker::{FleetAnswer, PlaceClaim, ProbeTally, Status, Tally};
use diana_core::hot::SpaceSaving;
use diana_core::report::{
    check_response, BreakerReport, FleetParams, ReportRequest, ReportResponse, RuleLine,
    MAX_BREAKERS, MAX_REPORT_BYTES,
};
use diana_core::wire::{ResolvedRule, RuleResult};
use diana_quota::auth::{parse_secrets, Auth};
use diana_quota::fleet::ViewAccess;
use diana_quota::store::{
    BreakerCall, Decided, FleetBreakers, Grant, MemoryStore, Noted, Outcome, Store, StoreError,
};
use diana_quota::{app, AppState};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A fleet breaker's parameters: open on half the calls failed out of 20, for `open_ms`;
/// probes never time out within a test.
fn params(open_ms: u64) -> FleetParams {
    FleetParams {
        slow_ratio_ppm: 0,
        failure_ratio_ppm: 500_000,
        min_calls: 20,
        window_seconds: 60,
        open_ms,
        half_open_calls: 3,
        probe_timeout_ms: 60_000,
    }
}

/// What one gateway says about one breaker.
#[derive(Clone, Copy, Default)]
struct Said {
    calls: u32,
    failed: u32,
    good: u32,
    bad: u32,
    /// (round, unused, wanted)
    claim: Option<(u64, u32, u32)>,
}

impl Said {
    fn calls(calls: u32, failed: u32) -> Said {
        Said {
            calls,
            failed,
            ..Said::default()
        }
    }

    fn probes(good: u32, bad: u32) -> Said {
        Said {
            good,
            bad,
            ..Said::default()
        }
    }

    fn claim(round: u64, unused: u32, wanted: u32) -> Said {
        Said {
            claim: Some((round, unused, wanted)),
            ..Said::default()
        }
    }
}

fn breaker(key: &str, params: FleetParams, said: Said) -> BreakerReport {
    BreakerReport {
        key: key.to_string(),
        name: "payments".into(),
        fleet: true,
        params,
        status: Status::Closed,
        calls: Tally {
            calls: said.calls,
            slow: 0,
            failed: said.failed,
        },
        probes: ProbeTally {
            good: said.good,
            bad: Tally {
                calls: said.bad,
                slow: 0,
                failed: said.bad,
            },
        },
        places: said.claim.map(|(round, unused, wanted)| PlaceClaim {
            round,
            unused,
            wanted,
        }),
    }
}

fn report(gateway: &str, breakers: Vec<BreakerReport>) -> ReportRequest {
    ReportRequest {
        gateway: gateway.into(),
        interval_ms: 1_000,
        breakers,
        ..ReportRequest::default()
    }
}

async fn post_report(router: &Router, body: impl Into<Body>) -> (StatusCode, String) {
    let (status, _, body) = send(router, post_json("/v1/report", body)).await;
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Sends a report, expects 200 and an answer that matches it.
async fn answers(router: &Router, sent: &ReportRequest) -> Vec<FleetAnswer> {
    let (status, body) = post_report(router, serde_json::to_vec(sent).unwrap()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let response: ReportResponse = serde_json::from_str(&body).unwrap();
    check_response(sent, &response).unwrap();
    response.breakers
}

/// One gateway's word on one breaker; the fleet's answer.
async fn say(
    router: &Router,
    gateway: &str,
    key: &str,
    params: FleetParams,
    said: Said,
) -> FleetAnswer {
    answers(router, &report(gateway, vec![breaker(key, params, said)])).await[0]
}

/// Waits until the fleet's opening (answered `answer` at `answered`) is over.
async fn wait_out(answer: FleetAnswer, answered: Instant) {
    let until = answered + Duration::from_millis(answer.half_open_in_ms + 50);
    tokio::time::sleep_until(until.into()).await;
}

// ---------------------------------------------------------------------------------------
// The scenario, against every store.

/// Two gateways share one breaker: the one that never saw a bad call fails fast from the
/// other's evidence; the half-open places are shared (2 + 1, nobody more); withdrawn
/// places are granted again; a bad probe reopens, all good close; other parameters have a
/// state of their own.
async fn fleet_breaker(router: &Router) {
    let key = unique_key("fleet");
    let p = params(600);
    let (a, b) = ("gw-a", "gw-b");
    // A: 12 failed calls, too few alone.
    let answer = say(router, a, &key, p, Said::calls(12, 12)).await;
    assert_eq!(answer.status, Status::Closed);
    // B never saw a bad call: with its 10 good ones the fleet has 22, 12 failed: open.
    let answered = Instant::now();
    let opened = say(router, b, &key, p, Said::calls(10, 0)).await;
    assert_eq!(opened.status, Status::Open, "{opened:?}");
    assert!((1..=600).contains(&opened.half_open_in_ms), "{opened:?}");
    let answer = say(router, a, &key, p, Said::default()).await;
    assert_eq!(answer.status, Status::Open);
    // Other parameters under the same key: a state of their own, still closed.
    let other = FleetParams { min_calls: 21, ..p };
    assert_eq!(
        say(router, b, &key, other, Said::default()).await.status,
        Status::Closed
    );
    // Half-open once open_ms is over: three places for the fleet.
    wait_out(opened, answered).await;
    let half_open = say(router, a, &key, p, Said::default()).await;
    assert_eq!((half_open.status, half_open.places), (Status::HalfOpen, 0));
    let round = half_open.round;
    let claim = |unused, wanted| Said::claim(round, unused, wanted);
    let mut granted = Vec::new();
    for (gateway, unused, wanted) in [(a, 0, 2), (b, 0, 3), (a, 0, 3), (b, 0, 3)] {
        let answer = say(router, gateway, &key, p, claim(unused, wanted)).await;
        assert_eq!((answer.status, answer.round), (Status::HalfOpen, round));
        granted.push(answer.places);
    }
    assert_eq!(granted, vec![2, 1, 0, 0], "exactly half_open_calls places");
    // A gives one back unused: B gets it, nobody else.
    assert_eq!(say(router, a, &key, p, claim(1, 0)).await.places, 0);
    assert_eq!(say(router, b, &key, p, claim(0, 3)).await.places, 1);
    assert_eq!(say(router, a, &key, p, claim(0, 3)).await.places, 0);
    // One bad probe (B's) opens it again, for every gateway.
    let answered = Instant::now();
    let reopened = say(router, b, &key, p, Said::probes(0, 1)).await;
    assert_eq!(reopened.status, Status::Open);
    assert_eq!(
        say(router, a, &key, p, Said::default()).await.status,
        Status::Open
    );
    // The next round: three good probes close it.
    wait_out(reopened, answered).await;
    let half_open = say(router, a, &key, p, Said::default()).await;
    assert_eq!(half_open.status, Status::HalfOpen);
    assert_ne!(half_open.round, round, "a new round");
    let claim = Said::claim(half_open.round, 0, 3);
    assert_eq!(say(router, a, &key, p, claim).await.places, 3);
    let answer = say(router, a, &key, p, Said::probes(2, 0)).await;
    assert_eq!(answer.status, Status::HalfOpen);
    let answer = say(router, b, &key, p, Said::probes(1, 0)).await;
    assert_eq!(answer.status, Status::Closed);
    // A local breaker is echoed, never kept.
    let mut local = breaker(&key, p, Said::calls(50, 50));
    local.fleet = false;
    local.status = Status::Open;
    let mixed = report(a, vec![local, breaker(&key, p, Said::default())]);
    let echoed = answers(router, &mixed).await;
    assert_eq!(echoed[0].status, Status::Open);
    assert_eq!(echoed[1].status, Status::Closed);
}

/// Bad reports: 400 naming the field, 413 past the bound; nothing decided.
async fn bad_reports(router: &Router) {
    let key = unique_key("bounds");
    let good = breaker(&key, params(1_000), Said::default());
    let too_many = report("gw", vec![good.clone(); MAX_BREAKERS + 1]);
    let broken = report(
        "gw",
        vec![breaker(
            &key,
            FleetParams {
                min_calls: 0,
                ..params(1_000)
            },
            Said::default(),
        )],
    );
    let cases: Vec<(Vec<u8>, StatusCode, &str)> = vec![
        (
            serde_json::to_vec(&too_many).unwrap(),
            StatusCode::BAD_REQUEST,
            "breakers: at most 64",
        ),
        (
            serde_json::to_vec(&broken).unwrap(),
            StatusCode::BAD_REQUEST,
            "breakers[0].params: out of range",
        ),
        (b"garbage".to_vec(), StatusCode::BAD_REQUEST, "body: "),
        (
            b"{\"gateway\":\"gw\",\"interval_ms\":1,\"breakers\":[],\"extra\":1}".to_vec(),
            StatusCode::BAD_REQUEST,
            "unknown field",
        ),
        (
            b"{\"gateway\":\"a b\",\"interval_ms\":1}".to_vec(),
            StatusCode::BAD_REQUEST,
            "gateway: ",
        ),
        (
            vec![b' '; MAX_REPORT_BYTES + 1],
            StatusCode::PAYLOAD_TOO_LARGE,
            "larger than 1048576 bytes",
        ),
    ];
    for (body, expected, says) in cases {
        let (status, answer) = post_report(router, body).await;
        assert_eq!(status, expected, "{answer}");
        assert!(answer.contains(says), "{answer} does not say {says:?}");
    }
    // Nothing of the refused reports was kept: the key's state is fresh.
    let answer = say(router, "gw", &key, params(1_000), Said::calls(19, 19)).await;
    assert_eq!(answer.status, Status::Closed);
}

suite!(fleet_breaker, bad_reports);

// ---------------------------------------------------------------------------------------
// Redis: the state in one key, concurrency, outages.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_gateways_share_exactly_the_places_across_replicas() {
    let server = RedisServer::start();
    // Two replicas of the service on one Redis, 24 gateways asking at once.
    let replicas = [
        service(Arc::new(redis_store(&server.url()))),
        service(Arc::new(redis_store(&server.url()))),
    ];
    let key = unique_key("race");
    let p = FleetParams {
        half_open_calls: 5,
        ..params(300)
    };
    let answered = Instant::now();
    let opened = say(&replicas[0], "gw-0", &key, p, Said::calls(20, 20)).await;
    assert_eq!(opened.status, Status::Open);
    wait_out(opened, answered).await;
    let round = say(&replicas[1], "gw-0", &key, p, Said::default())
        .await
        .round;
    let mut tasks = Vec::new();
    for n in 0..24 {
        let router = replicas[n % 2].clone();
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            let said = Said {
                calls: 1,
                ..Said::claim(round, 0, 2)
            };
            say(&router, &format!("gw-{n}"), &key, p, said).await.places
        }));
    }
    let mut granted = 0;
    for task in tasks {
        granted += task.await.unwrap();
    }
    assert_eq!(granted, 5, "every place granted once, no more");
    let stored = server.cli(&["--scan", "--pattern", "diana:{breaker:*"]);
    assert_eq!(stored.lines().count(), 1, "{stored}");
    let ttl: i64 = server.cli(&["pttl", stored.trim()]).trim().parse().unwrap();
    let idle_ms = 60_000 + 300 + 60_000 + 60_000;
    assert!(ttl > 0 && ttl <= idle_ms, "pttl {ttl}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_answers_503_fast_and_the_view_still_takes_the_report() {
    let mut server = RedisServer::start();
    let router = service(Arc::new(redis_store(&server.url())));
    let key = unique_key("down");
    say(&router, "gw", &key, params(1_000), Said::calls(1, 0)).await;
    server.kill();
    let started = Instant::now();
    let mut sent = report(
        "gw-down",
        vec![breaker(&key, params(1_000), Said::calls(3, 0))],
    );
    sent.rules = vec![RuleLine {
        name: "per-user".into(),
        admitted: 4,
        limited: 2,
        dry_run_limited: 0,
        hot_limited: None,
        hot_admitted: None,
    }];
    let (status, body) = post_report(&router, serde_json::to_vec(&sent).unwrap()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    // Local breakers need no store.
    let mut local = breaker(&key, params(1_000), Said::default());
    local.fleet = false;
    let echoed = answers(&router, &report("gw-down", vec![local])).await;
    assert_eq!(echoed[0].status, Status::Closed);
    let view = get_view(&router, Some(&bearer())).await;
    assert_eq!(view["rules"][0]["totals"]["limited"], 2);
    assert!(
        view["gateways"]
            .as_array()
            .unwrap()
            .iter()
            .any(|g| g["id"] == "gw-down"),
        "{view}"
    );
    // Redis back: the state it held is gone with it (no persistence in the test), a
    // fresh closed one answers.
    server.restart();
    let started = Instant::now();
    loop {
        let (status, _) = post_report(
            &router,
            serde_json::to_vec(&report(
                "gw",
                vec![breaker(&key, params(1_000), Said::default())],
            ))
            .unwrap(),
        )
        .await;
        if status == StatusCode::OK {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "Redis not picked up again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------------------------------
// The view: who may read it, what it shows, the metrics.

async fn get_view(router: &Router, authorization: Option<&str>) -> serde_json::Value {
    let (status, body) = view_status(router, authorization).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    serde_json::from_str(&body).unwrap()
}

async fn view_status(router: &Router, authorization: Option<&str>) -> (StatusCode, String) {
    let mut request = Request::builder().method("GET").uri("/v1/view");
    if let Some(value) = authorization {
        request = request.header("authorization", value);
    }
    let (status, _, body) = send(router, request.body(Body::empty()).unwrap()).await;
    (status, String::from_utf8_lossy(&body).into_owned())
}

const VIEW_TOKEN: &str = "view-only-secret-0123456789abcdefghij";

fn auth_of(secret: &str) -> Arc<Auth> {
    Arc::new(Auth::with_secrets(&parse_secrets(secret, "test").unwrap()).unwrap())
}

fn router_with(auth: Auth, access: ViewAccess) -> Router {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::default());
    app(AppState::with_view(store, test_settings(), auth, access))
}

#[tokio::test]
async fn the_view_is_never_open_by_default() {
    let view_bearer = format!("Bearer {VIEW_TOKEN}");
    let gateway_bearer = bearer();
    let wrong = "Bearer not-a-secret-of-this-service-0123456789";
    // (auth, access, authorization, expected)
    let cases: Vec<(Auth, ViewAccess, Option<&str>, StatusCode)> = vec![
        (
            test_auth(),
            ViewAccess::Service,
            Some(&gateway_bearer),
            StatusCode::OK,
        ),
        (
            test_auth(),
            ViewAccess::Service,
            None,
            StatusCode::UNAUTHORIZED,
        ),
        (
            test_auth(),
            ViewAccess::Service,
            Some(wrong),
            StatusCode::UNAUTHORIZED,
        ),
        (
            test_auth(),
            ViewAccess::Tokens(auth_of(VIEW_TOKEN)),
            Some(&view_bearer),
            StatusCode::OK,
        ),
        (
            test_auth(),
            ViewAccess::Tokens(auth_of(VIEW_TOKEN)),
            Some(&gateway_bearer),
            StatusCode::OK,
        ),
        (
            test_auth(),
            ViewAccess::Tokens(auth_of(VIEW_TOKEN)),
            Some(wrong),
            StatusCode::UNAUTHORIZED,
        ),
        // --insecure-no-auth: the view stays closed without a secret of its own...
        (
            Auth::insecure(),
            ViewAccess::Service,
            None,
            StatusCode::UNAUTHORIZED,
        ),
        (
            Auth::insecure(),
            ViewAccess::Service,
            Some(&gateway_bearer),
            StatusCode::UNAUTHORIZED,
        ),
        (
            Auth::insecure(),
            ViewAccess::Tokens(auth_of(VIEW_TOKEN)),
            Some(&view_bearer),
            StatusCode::OK,
        ),
        (
            Auth::insecure(),
            ViewAccess::Tokens(auth_of(VIEW_TOKEN)),
            None,
            StatusCode::UNAUTHORIZED,
        ),
        // ... unless told --insecure-open-view.
        (Auth::insecure(), ViewAccess::Open, None, StatusCode::OK),
    ];
    for (at, (auth, access, authorization, expected)) in cases.into_iter().enumerate() {
        let router = router_with(auth, access);
        let (status, body) = view_status(&router, authorization).await;
        assert_eq!(status, expected, "case {at}: {body}");
        assert!(
            !body.contains(TEST_TOKEN) && !body.contains(VIEW_TOKEN),
            "case {at}"
        );
    }
    // The read-only secret reads; it does not report nor decide.
    let router = router_with(test_auth(), ViewAccess::Tokens(auth_of(VIEW_TOKEN)));
    let request = Request::builder()
        .method("POST")
        .uri("/v1/report")
        .header("content-type", "application/json")
        .header("authorization", &view_bearer)
        .body(Body::from(
            serde_json::to_vec(&report("gw", vec![])).unwrap(),
        ))
        .unwrap();
    assert_eq!(send(&router, request).await.0, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn the_credential_is_checked_before_the_report_is_read() {
    let router = service(Arc::new(memory_store()));
    // Larger than any report: a caller without the credential gets 401, not 413.
    let request = Request::builder()
        .method("POST")
        .uri("/v1/report")
        .header("content-type", "application/json")
        .body(Body::from(vec![b' '; MAX_REPORT_BYTES * 2]))
        .unwrap();
    let (status, _, body) = send(&router, request).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "{}",
        String::from_utf8_lossy(&body)
    );
    let view = get_view(&router, Some(&bearer())).await;
    assert_eq!(view["reports"], 0);
}

fn hot(items: &[(&str, u64)]) -> diana_core::hot::Summary {
    let mut sketch = SpaceSaving::new(10);
    for (label, weight) in items {
        sketch.add(label.as_bytes(), *weight);
    }
    sketch.summary()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_and_the_metrics_show_what_the_gateways_reported() {
    let router = service(Arc::new(memory_store()));
    let key = unique_key("shown");
    let rule = |name: &str, admitted, limited, items: &[(&str, u64)]| RuleLine {
        name: name.into(),
        admitted,
        limited,
        dry_run_limited: 1,
        hot_limited: Some(hot(items)),
        hot_admitted: None,
    };
    let weird = "we\"ird\\rule";
    let mut first = report(
        "gw-1",
        vec![breaker(&key, params(30_000), Said::calls(12, 12))],
    );
    first.rules = vec![
        rule(
            "per-user",
            90,
            7,
            &[("acct-7", 6), ("<img src=x onerror=alert(1)>", 1)],
        ),
        rule(weird, 1, 0, &[]),
    ];
    answers(&router, &first).await;
    let mut second = report(
        "gw-2",
        vec![breaker(&key, params(30_000), Said::calls(10, 0))],
    );
    second.degraded = true;
    second.rules = vec![rule("per-user", 10, 5, &[("acct-7", 4), ("acct-9", 1)])];
    let opened = answers(&router, &second).await;
    assert_eq!(opened[0].status, Status::Open);

    let view = get_view(&router, Some(&bearer())).await;
    assert_eq!(view["reports"], 2);
    let gateways: Vec<(&str, bool)> = view["gateways"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| (g["id"].as_str().unwrap(), g["degraded"].as_bool().unwrap()))
        .collect();
    assert_eq!(gateways, vec![("gw-1", false), ("gw-2", true)]);
    let per_user = view["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "per-user")
        .unwrap();
    assert_eq!(per_user["totals"]["admitted"], 100);
    assert_eq!(per_user["totals"]["limited"], 12);
    assert_eq!(per_user["limited"].as_array().unwrap().len(), 90);
    assert_eq!(
        per_user["limited"][89], 12,
        "both reports in the current bucket"
    );
    let top = &per_user["hot_limited"]["items"];
    assert_eq!(top[0]["label"], "acct-7");
    assert_eq!(top[0]["count"], 10);
    assert_eq!(
        top[1]["label"], "<img src=x onerror=alert(1)>",
        "a label is data"
    );
    let payments = &view["breakers"][0];
    assert_eq!(payments["name"], "payments");
    assert_eq!(payments["state"]["status"], "open");
    assert_eq!(payments["state"]["window"]["calls"], 22);
    assert_eq!(payments["transitions"][0]["from"], "closed");
    assert_eq!(payments["transitions"][0]["to"], "open");
    assert_eq!(payments["transitions"][0]["failed"], 12);
    assert_eq!(payments["gateways"].as_array().unwrap().len(), 2);

    let (status, _, body) = send(
        &router,
        Request::builder()
            .uri("/metrics")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(body).unwrap();
    let expected = [
        "diana_quota_fleet_reports_total 2",
        "diana_quota_fleet_gateways 2",
        "diana_quota_fleet_gateway_degraded{gateway=\"gw-1\"} 0",
        "diana_quota_fleet_gateway_degraded{gateway=\"gw-2\"} 1",
        "diana_quota_fleet_requests_total{rule=\"per-user\",outcome=\"admitted\"} 100",
        "diana_quota_fleet_requests_total{rule=\"per-user\",outcome=\"limited\"} 12",
        "diana_quota_fleet_requests_total{rule=\"per-user\",outcome=\"dry_run_limited\"} 2",
        "diana_quota_fleet_requests_total{rule=\"we\\\"ird\\\\rule\",outcome=\"admitted\"} 1",
        "diana_quota_fleet_hot{rule=\"per-user\",list=\"limited\",rank=\"1\"} 10",
        "diana_quota_fleet_hot{rule=\"per-user\",list=\"limited\",rank=\"2\"} 1",
        "diana_quota_fleet_hot_total{rule=\"per-user\",list=\"limited\"} 12",
        "diana_quota_fleet_hot_error_bound{rule=\"per-user\",list=\"limited\"} 0",
        "diana_quota_fleet_breaker_state{breaker=\"payments\"} 1",
        "diana_quota_fleet_breaker_window{breaker=\"payments\",figure=\"failed\"} 12",
        "diana_quota_fleet_breaker_transitions_total{breaker=\"payments\",to=\"open\"} 1",
        "diana_quota_fleet_breaker_transitions_total{breaker=\"payments\",to=\"closed\"} 0",
        "diana_quota_fleet_breaker_gateways{breaker=\"payments\",status=\"closed\"} 2",
        "diana_quota_fleet_dropped_total{what=\"gateways\"} 0",
    ];
    for line in expected {
        assert!(
            text.lines().any(|l| l == line),
            "no line {line:?} in:\n{text}"
        );
    }
    // No identity becomes a label value.
    assert!(
        !text.contains("acct-7") && !text.contains("onerror"),
        "{text}"
    );
    assert!(text.trim_end().ends_with("# EOF"), "{text}");
}

// ---------------------------------------------------------------------------------------
// The deadline.

/// The memory store, whose breakers answer after `delay` and note every call and answer.
struct SlowBreakers {
    inner: MemoryStore,
    delay: Duration,
    seen: Mutex<Vec<(BreakerCall, Decided)>>,
}

#[async_trait]
impl FleetBreakers for SlowBreakers {
    async fn report(&self, calls: &[BreakerCall]) -> Result<Vec<Decided>, StoreError> {
        tokio::time::sleep(self.delay).await;
        let decided = self.inner.breakers().unwrap().report(calls).await?;
        let mut seen = self.seen.lock().unwrap();
        seen.extend(calls.iter().cloned().zip(decided.iter().cloned()));
        Ok(decided)
    }
}

#[async_trait]
impl Store for SlowBreakers {
    async fn check_and_update(
        &self,
        rules: &[ResolvedRule<'_>],
    ) -> Result<Vec<Outcome>, StoreError> {
        self.inner.check_and_update(rules).await
    }

    async fn charge(&self, rules: &[ResolvedRule<'_>]) -> Result<Vec<RuleResult>, StoreError> {
        self.inner.charge(rules).await
    }

    async fn spend(
        &self,
        rules: &[ResolvedRule<'_>],
        how: &[diana_quota::store::Spending],
    ) -> Result<diana_quota::store::Spent, StoreError> {
        self.inner.spend(rules, how).await
    }

    async fn release(
        &self,
        rules: &[ResolvedRule<'_>],
        outcomes: &[Outcome],
    ) -> Result<(), StoreError> {
        self.inner.release(rules, outcomes).await
    }

    async fn renew(
        &self,
        rules: &[ResolvedRule<'_>],
        places: &[diana_core::algo::Mark],
    ) -> Result<Vec<Outcome>, StoreError> {
        self.inner.renew(rules, places).await
    }

    async fn note_call(&self, call: &str, grants: &[Grant]) -> Result<Noted, StoreError> {
        self.inner.note_call(call, grants).await
    }

    async fn take_call(&self, call: &str) -> Result<Option<Vec<Grant>>, StoreError> {
        self.inner.take_call(call).await
    }

    async fn health(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn describe(&self) -> String {
        "slow breakers".into()
    }

    fn breakers(&self) -> Option<&dyn FleetBreakers> {
        Some(self)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_is_answered_by_the_gateways_deadline_and_late_places_go_back() {
    let store = Arc::new(SlowBreakers {
        inner: MemoryStore::default(),
        delay: Duration::from_millis(150),
        seen: Mutex::new(Vec::new()),
    });
    let router = service(store.clone());
    let key = unique_key("late");
    let p = params(200);
    let answered = Instant::now();
    let opened = say(&router, "gw-a", &key, p, Said::calls(20, 20)).await;
    wait_out(opened, answered).await;
    let round = say(&router, "gw-a", &key, p, Said::default()).await.round;
    // The gateway waits 60 ms (50 after the margin): the store's 150 ms are too long.
    let wants = report("gw-a", vec![breaker(&key, p, Said::claim(round, 0, 2))]);
    let request = Request::builder()
        .method("POST")
        .uri("/v1/report")
        .header("content-type", "application/json")
        .header("authorization", bearer())
        .header("x-diana-timeout-ms", "60")
        .body(Body::from(serde_json::to_vec(&wants).unwrap()))
        .unwrap();
    let started = Instant::now();
    let (status, _, body) = send(&router, request).await;
    let waited = started.elapsed();
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert!(String::from_utf8_lossy(&body).contains("deadline exceeded"));
    assert!(waited < Duration::from_millis(150), "{waited:?}");
    // The late answer granted two places; nobody will use them: they go back.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let seen = store.seen.lock().unwrap().clone();
        let late = seen
            .iter()
            .find(|(call, _)| call.places.is_some_and(|c| c.wanted == 2));
        let back = seen.iter().find(|(call, _)| {
            call.places
                .is_some_and(|c| c.unused == 2 && c.round == round)
        });
        if let (Some((_, late)), Some(_)) = (late, back) {
            assert_eq!(late.answer.places, 2);
            break;
        }
        assert!(Instant::now() < deadline, "no give-back: {seen:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = say(&router, "gw-b", &key, p, Said::claim(round, 0, 3)).await;
    assert_eq!(b.places, 3, "every place free again");
}
