//! Holding under load, in-process: load shedding, deadlines (own and the gateway's timeout
//! header, with late grants given back), readiness, graceful shutdown, `/v1/charge`, the
//! memory store's key cap, and the 400 reasons of the new fields.

#![cfg(test)]

// Helpers outside #[test] functions (clippy.toml covers only those).

mod common;

use async_trait::async_trait;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use common::*;
use diana_core::wire::{AcquireResponse, ErrorResponse, ResolvedRule, RuleResult};
use diana_quota::store::{Clock, Grant, MemoryStore, Noted, Outcome, Store, StoreError};
use diana_quota::{app, serve, AppState, Settings};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BODY: &str = r#"{"rules":[{"key":"ab:cd","algo":"TB","rpu":10,"unit":"second","burst":10,"slices":10,"want":1}]}"#;

fn error_of(body: &[u8]) -> String {
    serde_json::from_slice::<ErrorResponse>(body).unwrap().error
}

/// A store that takes `delay` to grant every rule one token, and counts its calls.
#[derive(Default)]
struct SlowStore {
    delay: Duration,
    calls: AtomicUsize,
    released: AtomicUsize,
}

#[async_trait]
impl Store for SlowStore {
    async fn check_and_update(
        &self,
        rules: &[ResolvedRule<'_>],
    ) -> Result<Vec<Outcome>, StoreError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(self.delay).await;
        Ok(rules
            .iter()
            .map(|_| Outcome {
                result: RuleResult {
                    allowed: true,
                    granted: 1,
                    ..RuleResult::default()
                },
                ..Outcome::default()
            })
            .collect())
    }

    async fn charge(&self, rules: &[ResolvedRule<'_>]) -> Result<Vec<RuleResult>, StoreError> {
        tokio::time::sleep(self.delay).await;
        Ok(vec![RuleResult::default(); rules.len()])
    }

    async fn release(
        &self,
        _: &[ResolvedRule<'_>],
        outcomes: &[Outcome],
    ) -> Result<(), StoreError> {
        let granted = outcomes.iter().filter(|o| o.result.granted > 0).count();
        self.released.fetch_add(granted, Ordering::SeqCst);
        Ok(())
    }

    async fn renew(
        &self,
        rules: &[ResolvedRule<'_>],
        _: &[diana_core::algo::Mark],
    ) -> Result<Vec<Outcome>, StoreError> {
        tokio::time::sleep(self.delay).await;
        Ok(vec![Outcome::default(); rules.len()])
    }

    async fn spend(
        &self,
        rules: &[ResolvedRule<'_>],
        _: &[diana_quota::store::Spending],
    ) -> Result<diana_quota::store::Spent, StoreError> {
        tokio::time::sleep(self.delay).await;
        Ok(diana_quota::store::Spent {
            outcomes: vec![Outcome::default(); rules.len()],
            admitted: false,
        })
    }

    async fn note_call(&self, _: &str, _: &[Grant]) -> Result<Noted, StoreError> {
        Ok(Noted::Kept)
    }

    async fn take_call(&self, _: &str) -> Result<Option<Vec<Grant>>, StoreError> {
        Ok(None)
    }

    async fn health(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn describe(&self) -> String {
        "slow".to_string()
    }
}

fn settings(deadline_ms: u64, max_in_flight: usize) -> Settings {
    Settings {
        deadline: Duration::from_millis(deadline_ms),
        max_in_flight,
        ..Settings::default()
    }
}

fn slow(delay_ms: u64) -> Arc<SlowStore> {
    Arc::new(SlowStore {
        delay: Duration::from_millis(delay_ms),
        ..SlowStore::default()
    })
}

async fn metrics(router: &Router) -> String {
    let (_, _, body) = send(
        router,
        Request::get("/metrics").body(Body::empty()).unwrap(),
    )
    .await;
    String::from_utf8(body).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturated_requests_are_shed_fast() {
    let store = slow(300);
    let router = app(AppState::new(
        store.clone(),
        settings(2_000, 2),
        test_auth(),
    ));
    let busy: Vec<_> = (0..2)
        .map(|_| {
            let router = router.clone();
            tokio::spawn(async move { send(&router, post_json("/v1/acquire", BODY)).await })
        })
        .collect();
    // Both are in the store now.
    while store.calls.load(Ordering::SeqCst) < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for path in ["/v1/acquire", "/v1/wait", "/v1/charge"] {
        let started = Instant::now();
        let (status, _, body) = send(&router, post_json(path, BODY)).await;
        let took = started.elapsed();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{path}");
        assert_eq!(error_of(&body), "overloaded");
        assert!(took < Duration::from_millis(50), "{path}: shed in {took:?}");
    }
    // Health and metrics are never shed.
    let (status, _, _) = send(
        &router,
        Request::get("/healthz").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let text = metrics(&router).await;
    assert!(
        text.contains("diana_quota_shed_total{path=\"/v1/acquire\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("diana_quota_shed_total{path=\"/v1/charge\"} 1"),
        "{text}"
    );
    assert!(text.contains("diana_quota_in_flight 2"), "{text}");
    for task in busy {
        let (status, _, _) = task.await.unwrap();
        assert_eq!(status, StatusCode::OK);
    }
    // Room again once they are answered.
    let (status, _, _) = send(&router, post_json("/v1/acquire", BODY)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(store.calls.load(Ordering::SeqCst), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_store_is_answered_at_the_deadline_and_its_grants_given_back() {
    let store = slow(300);
    let router = app(AppState::new(store.clone(), settings(100, 16), test_auth()));
    let started = Instant::now();
    let (status, _, body) = send(&router, post_json("/v1/acquire", BODY)).await;
    let took = started.elapsed();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        error_of(&body),
        "deadline exceeded: no answer within 100 ms"
    );
    assert!(
        took >= Duration::from_millis(95) && took < Duration::from_millis(250),
        "{took:?}"
    );
    // The store answers 200 ms later; nobody takes that grant, so it is given back.
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(store.released.load(Ordering::SeqCst), 1);
    let text = metrics(&router).await;
    assert!(
        text.contains("diana_quota_deadline_expired_total{path=\"/v1/acquire\"} 1"),
        "{text}"
    );
    assert!(text.contains("diana_quota_late_releases_total 1"), "{text}");
    assert!(
        text.contains("diana_quota_store_errors_total{kind=\"timeout\"} 1"),
        "{text}"
    );
    // The charge endpoint has the same deadline.
    let (status, _, body) = send(&router, post_json("/v1/charge", BODY)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(error_of(&body).starts_with("deadline exceeded"));
}

fn with_timeout(path: &str, timeout: &str) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .header("authorization", bearer())
        .header("x-diana-timeout-ms", timeout)
        .body(Body::from(BODY))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_timeout_header_shortens_the_deadline() {
    let store = slow(300);
    let router = app(AppState::new(
        store.clone(),
        settings(1_000, 16),
        test_auth(),
    ));
    // 70 ms minus the 10 ms margin: answered at 60 ms, not at the own 1 s.
    let started = Instant::now();
    let (status, _, body) = send(&router, with_timeout("/v1/acquire", "70")).await;
    let took = started.elapsed();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error_of(&body), "deadline exceeded: no answer within 60 ms");
    assert!(took < Duration::from_millis(200), "{took:?}");
    // No time left at all: answered at once, the store never asked.
    let calls = store.calls.load(Ordering::SeqCst);
    let (status, _, body) = send(&router, with_timeout("/v1/acquire", "10")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error_of(&body), "deadline exceeded: no answer within 0 ms");
    assert_eq!(store.calls.load(Ordering::SeqCst), calls);
    // A header that is not a number is the gateway's bug: 400.
    let (status, _, body) = send(&router, with_timeout("/v1/acquire", "soon")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(
        error_of(&body),
        "x-diana-timeout-ms: must be a whole number of milliseconds"
    );
    // A generous header does not lengthen the own deadline.
    let fast = app(AppState::new(slow(300), settings(50, 16), test_auth()));
    let (_, _, body) = send(&fast, with_timeout("/v1/acquire", "5000")).await;
    assert_eq!(error_of(&body), "deadline exceeded: no answer within 50 ms");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_never_sleeps_past_the_gateway_timeout() {
    let router = service(Arc::new(memory_store()));
    let key = unique_key("wait-cap");
    let lb = |max_delay_ms: Option<u64>| {
        let mut r = rule(&key, "LB", 10, "second", 10, 10, 1);
        r.max_delay_ms = max_delay_ms;
        serde_json::to_string(&diana_core::wire::AcquireRequest::new(vec![r])).unwrap()
    };
    let wait = |body: String, timeout: &str| {
        Request::post("/v1/wait")
            .header("content-type", "application/json")
            .header("authorization", bearer())
            .header("x-diana-timeout-ms", timeout)
            .body(Body::from(body))
            .unwrap()
    };
    // Turns at 0, 100, 200 ms. With 1 s for the gateway and an 800 ms deadline, the turn
    // at 100 ms is within the 190 ms left to sleep: slept, answered with delay 0.
    let (status, _, body) = send(&router, wait(lb(None), "1000")).await;
    assert_eq!(status, StatusCode::OK);
    let started = Instant::now();
    let (status, _, body2) = send(&router, wait(lb(None), "1000")).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let answer: AcquireResponse = serde_json::from_slice(&body2).unwrap();
    assert!(answer.results[0].allowed && answer.results[0].delay_ms == 0);
    assert!(started.elapsed() >= Duration::from_millis(80));
    // max_delay_ms 50: the next turn (~200 ms away) is denied, nothing reserved.
    let started = Instant::now();
    let (_, _, body) = send(&router, wait(lb(Some(50)), "1000")).await;
    let answer: AcquireResponse = serde_json::from_slice(&body).unwrap();
    assert!(!answer.results[0].allowed, "{answer:?}");
    assert!(answer.results[0].retry_after_ms > 0 && answer.results[0].retry_after_ms <= 150);
    assert!(started.elapsed() < Duration::from_millis(50));
    assert!(
        (9..=10).contains(&answer.results[0].remaining),
        "{answer:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_store_and_the_shutdown() {
    let state = AppState::new(Arc::new(memory_store()), test_settings(), test_auth());
    let router = app(state.clone());
    let ready = || async {
        let (status, _, body) = send(
            &router,
            Request::get("/readyz").body(Body::empty()).unwrap(),
        )
        .await;
        (status, String::from_utf8(body).unwrap())
    };
    assert_eq!(ready().await, (StatusCode::OK, "ready".to_string()));
    state.begin_shutdown();
    assert_eq!(
        ready().await,
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down".to_string())
    );
    // Still alive, still answering what it is sent.
    let (status, _, _) = send(
        &router,
        Request::get("/healthz").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = send(&router, post_json("/v1/acquire", BODY)).await;
    assert_eq!(status, StatusCode::OK);
}

/// One HTTP/1.1 request on its own connection; the status code.
async fn http_status(port: u16, body: &str) -> std::io::Result<u16> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let request = format!(
        "POST /v1/acquire HTTP/1.1\r\nhost: q\r\ncontent-type: application/json\r\nauthorization: Bearer {TEST_TOKEN}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    let mut buffer = [0u8; 1024];
    loop {
        let n = stream.read(&mut buffer).await?;
        answer.extend_from_slice(&buffer[..n]);
        if n == 0 || answer.windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    let text = String::from_utf8_lossy(&answer);
    Ok(text
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_answers_in_flight_and_refuses_new_connections() {
    let store = slow(300);
    let state = AppState::new(store.clone(), settings(2_000, 16), test_auth());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, state.clone(), async move {
        let _ = stopped.await;
    }));
    let in_flight = tokio::spawn(async move { http_status(port, BODY).await });
    while store.calls.load(Ordering::SeqCst) < 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let asked = Instant::now();
    stop.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(state.is_shutting_down());
    // The listener is closed: a new connection is refused.
    assert!(
        http_status(port, BODY).await.is_err(),
        "a new connection was served"
    );
    // The request in flight is answered.
    assert_eq!(in_flight.await.unwrap().unwrap(), 200);
    // And the server stops once it is.
    let served = tokio::time::timeout(Duration::from_secs(5), server).await;
    assert!(matches!(served, Ok(Ok(Ok(())))), "{served:?}");
    assert!(asked.elapsed() < Duration::from_secs(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charges_go_past_the_limit_and_leaky_buckets_refuse_them() {
    let router = service(Arc::new(memory_store()));
    let key = unique_key("charge");
    let mut tb = rule(&key, "TB", 10, "hour", 10, 10, 15);
    tb.cost = 1;
    let w = rule(&key, "W", 10, "hour", 10, 10, 4);
    let (status, body) = post_rules(&router, "/v1/charge", vec![tb.clone(), w.clone()]).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer: AcquireResponse = serde_json::from_str(&body).unwrap();
    let charged: Vec<(bool, u32, u64)> = answer
        .results
        .iter()
        .map(|r| (r.allowed, r.granted, r.remaining))
        .collect();
    assert_eq!(charged, [(true, 15, 0), (true, 4, 6)]);
    // 15 tokens of 6 min each: full again in 90 min, the next token in 90 - 54 = 36 min.
    assert_eq!(
        (answer.results[0].reset_ms, answer.results[0].retry_after_ms),
        (5_400_000, 2_160_000),
        "{body}"
    );
    assert_eq!(answer.results[1].retry_after_ms, 0);
    // A debt is capped at one bucket beyond empty: 2 × 60 min.
    let mut more = tb.clone();
    more.want = 1_000;
    let (_, body) = post_rules(&router, "/v1/charge", vec![more]).await;
    let answer: AcquireResponse = serde_json::from_str(&body).unwrap();
    assert!(
        answer.results[0].reset_ms <= 7_200_000 && answer.results[0].reset_ms > 7_190_000,
        "{body}"
    );
    // Now the debt denies.
    let results = acquire(&router, vec![rule(&key, "TB", 10, "hour", 10, 10, 1)]).await;
    assert!(!results[0].allowed);
    // A leaky bucket cannot be charged: 400, nothing charged.
    let lb = rule(&unique_key("charge-lb"), "LB", 10, "hour", 10, 10, 1);
    let (status, body) = post_rules(&router, "/v1/charge", vec![w.clone(), lb]).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body.contains("rules[1].algo: LB takes no debts"), "{body}");
    let results = acquire(&router, vec![rule(&key, "W", 10, "hour", 10, 10, 10)]).await;
    assert_eq!(results[0].granted, 6, "the refused charge took nothing");
    let text = metrics(&router).await;
    assert!(
        text.contains("diana_quota_tokens_charged_total{algo=\"TB\"} 1015"),
        "{text}"
    );
}

#[tokio::test]
async fn bad_cost_and_max_delay_get_400_with_the_reason() {
    let router = service(Arc::new(memory_store()));
    let base = r#"{"key":"k:1","algo":"TB","rpu":10,"unit":"second","burst":10,"slices":10"#;
    let cases = [
        (
            format!(r#"{base},"want":2,"cost":3}}"#),
            "rules[0].cost: must be between 1 and want (2), got 3",
        ),
        (
            format!(r#"{base},"want":20,"cost":11}}"#),
            "rules[0].cost: 11 is more than the limit can ever grant (10)",
        ),
        (
            format!(r#"{base},"want":2,"cost":0}}"#),
            "rules[0].cost: must be between 1 and want (2), got 0",
        ),
        (
            format!(r#"{base},"max_delay_ms":86400001}}"#),
            "rules[0].max_delay_ms: at most 86400000",
        ),
        (
            format!(r#"{base},"max_delay_ms":-1}}"#),
            "rules[0].max_delay_ms: invalid value: integer `-1`",
        ),
    ];
    for (rule, expected) in cases {
        for path in ["/v1/acquire", "/v1/wait", "/v1/charge"] {
            let body = format!(r#"{{"rules":[{rule}]}}"#);
            let (status, _, answer) = send(&router, post_json(path, body)).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {rule}");
            let reason = error_of(&answer);
            assert!(
                reason.starts_with(expected),
                "{path}: {reason:?} does not start with {expected:?}"
            );
        }
    }
}

/// A clock the test moves by hand.
#[derive(Default)]
struct HandClock(AtomicU64);

impl Clock for HandClock {
    fn now(&self) -> diana_core::time::Instant {
        diana_core::time::Instant::from_unix_nanos(self.0.load(Ordering::SeqCst))
    }
}

#[tokio::test]
async fn the_memory_store_never_grows_past_its_cap() {
    let clock = Arc::new(HandClock(AtomicU64::new(1_700_000_000_000_000_000)));
    let store = Arc::new(MemoryStore::with_capacity(clock.clone(), 3));
    let router = service(store.clone());
    let one = |key: &str| rule(key, "W", 1, "second", 1, 10, 1);
    for i in 0..3 {
        assert!(acquire(&router, vec![one(&format!("cap:{i}"))]).await[0].allowed);
    }
    // Full of live counters: a fourth is refused, nothing grows; known ones still work.
    let (status, body) = post_rules(&router, "/v1/acquire", vec![one("cap:new")]).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.contains("store full: 3 counters, none idle"), "{body}");
    assert_eq!(store.len(), 3);
    assert!(!acquire(&router, vec![one("cap:0")]).await[0].allowed);
    // A denial needs no room: answered 200 even when full.
    let mut denied_two = one("cap:new2");
    denied_two.want = 1;
    let (status, _) = post_rules(&router, "/v1/acquire", vec![one("cap:1"), denied_two]).await;
    assert_eq!(status, StatusCode::OK);
    // A second later every window has passed: the idle counters are evicted for new ones.
    clock.0.fetch_add(1_000_000_000, Ordering::SeqCst);
    for i in 0..3 {
        assert!(acquire(&router, vec![one(&format!("cap:fresh{i}"))]).await[0].allowed);
    }
    assert_eq!(store.len(), 3);
    let text = metrics(&router).await;
    assert!(text.contains("diana_quota_store_keys 3"), "{text}");
    assert!(
        text.contains("diana_quota_store_evictions_total 3"),
        "{text}"
    );
    assert!(
        text.contains("diana_quota_store_errors_total{kind=\"full\"} 1"),
        "{text}"
    );
}
