//! The HTTP layer in-process (tower `oneshot`): answers, error reasons and codes, health,
//! metrics, the wait endpoint, and store failures through fake stores.

#![cfg(test)]

mod common;

use async_trait::async_trait;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use clap::Parser;
use common::*;
use diana_core::wire::{AcquireResponse, ErrorResponse, ResolvedRule, RuleResult, MAX_BODY_BYTES};
use diana_quota::auth::{Auth, AuthError};
use diana_quota::store::{Grant, MemoryStore, Noted, Outcome, RedisUrlError, Store, StoreError};
use diana_quota::{app, AppState, Cli, Settings, StartError};
use http_body_util::BodyExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};
use tower::ServiceExt;

fn memory_service() -> Router {
    service(Arc::new(memory_store()))
}

fn error_of(body: &[u8]) -> String {
    serde_json::from_slice::<ErrorResponse>(body).unwrap().error
}

const EXAMPLE: &str = r#"{"rules":[{"key":"5f3a09:9c2e","algo":"TB","rpu":10,"unit":"second","burst":10,"slices":10,"want":1}]}"#;

#[tokio::test]
async fn the_documented_example() {
    let router = memory_service();
    let (status, content_type, body) = send(&router, post_json("/v1/acquire", EXAMPLE)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(content_type, "application/json");
    let text = String::from_utf8(body).unwrap();
    let answer: AcquireResponse = serde_json::from_str(&text).unwrap();
    let expected = RuleResult {
        place: None,
        allowed: true,
        granted: 1,
        remaining: 9,
        reset_ms: 100,
        retry_after_ms: 0,
        delay_ms: 0,
    };
    assert_eq!(answer.results, [expected]);
    assert_eq!(
        text,
        r#"{"results":[{"allowed":true,"granted":1,"remaining":9,"reset_ms":100,"retry_after_ms":0,"delay_ms":0}]}"#
    );
}

#[tokio::test]
async fn bad_requests_get_400_with_the_field_named() {
    let router = memory_service();
    let good =
        r#"{"key":"k:1","algo":"TB","rpu":10,"unit":"second","burst":10,"slices":10,"want":1}"#;
    let with = |bad: &str| format!(r#"{{"rules":[{good},{good},{bad}]}}"#);
    let many = format!(r#"{{"rules":[{}]}}"#, vec![good; 65].join(","));
    let cases: Vec<(String, &str)> = vec![
        (
            with(&good.replace(r#""rpu":10"#, r#""rpu":0"#)),
            "rules[2].rpu: must be ≥ 1",
        ),
        (
            with(&good.replace(r#""burst":10"#, r#""burst":0"#)),
            "rules[2].burst: must be ≥ 1",
        ),
        (
            with(&good.replace(r#""slices":10"#, r#""slices":61"#)),
            "rules[2].slices: must be between 1 and 60, got 61",
        ),
        (
            with(&good.replace(r#""want":1"#, r#""want":0"#)),
            "rules[2].want: must be between 1 and 100000, got 0",
        ),
        (
            with(&good.replace(r#""want":1"#, r#""want":100001"#)),
            "rules[2].want: must be between 1 and 100000",
        ),
        (
            with(&good.replace("k:1", "k 1")),
            "rules[2].key: invalid character ' ' at byte 1",
        ),
        (
            with(&good.replace("k:1", &"k".repeat(129))),
            "rules[2].key: 129 bytes, at most 128",
        ),
        (
            with(&good.replace("k:1", "")),
            "rules[2].key: must not be empty",
        ),
        (
            with(&good.replace(r#""TB""#, r#""GCRA""#)),
            "rules[2].algo: unknown algorithm \"GCRA\"",
        ),
        (
            with(&good.replace("second", "fortnight")),
            "rules[2].unit: unknown unit \"fortnight\"",
        ),
        (
            with(&good.replace("second", "week")),
            "rules[2].unit: unit \"week\" needs the calendar period it is in",
        ),
        (
            with(&good.replace(r#""unit":"second""#, r#""unit":"month","period":{"start_ms":0,"len_ms":2592000000}"#)),
            "rules[2].period: the period 0..2592000000 ms is not the one around now",
        ),
        (
            with(&good.replace(r#""unit":"second""#, r#""unit":"month","period":{"start_ms":0,"len_ms":3600000}"#)),
            "rules[2].period: len_ms must be between 86400000 (a day) and 2682000000",
        ),
        (
            with(&good.replace(r#""unit":"second""#, r#""unit":"second","period":{"start_ms":0,"len_ms":86400000}"#)),
            "rules[2].unit: a period goes with unit week or month",
        ),
        (
            with(&good.replace(r#""rpu":10"#, r#""rpu":"10""#)),
            "rules[2].rpu: invalid type: string \"10\", expected u32",
        ),
        (
            with(&good.replace(r#""rpu":10"#, r#""rpu":-5"#)),
            "rules[2].rpu: invalid value: integer `-5`",
        ),
        (
            with(&good.replace(r#""rpu":10"#, r#""rpu":4294967296"#)),
            "rules[2].rpu: invalid value: integer `4294967296`",
        ),
        (
            with(&good.replace(r#","unit":"second""#, "")),
            "rules[2]: missing field `unit`",
        ),
        (many, "rules: at most 64 rules, got 65"),
        (
            with(&good.replace(r#""burst":10"#, r#""burst":864001"#)),
            "rules[2].burst: 864001 at 10 per second spans 86401 s (burst × unit / rpu), more than a day",
        ),
        (
            format!(
                r#"{{"rules":[{}]}}"#,
                vec![good.replace(r#""want":1"#, r#""want":100000"#); 11].join(",")
            ),
            "rules: want adds up to 1100000 over the request's rules, at most 1000000",
        ),
        (
            r#"{"rules":[]}"#.to_string(),
            "rules: must contain at least one rule",
        ),
        (
            r#"{"rules":{}}"#.to_string(),
            "rules: invalid type: map, expected a sequence",
        ),
        ("{}".to_string(), "missing field `rules`"),
        ("".to_string(), "EOF while parsing a value"),
        (
            "{\"rules\":[".to_string(),
            "rules: EOF while parsing a list",
        ),
        (format!("{} x", with(good)), "trailing characters"),
    ];
    for (body, expected) in cases {
        for path in ["/v1/acquire", "/v1/wait"] {
            let (status, content_type, answer) = send(&router, post_json(path, body.clone())).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}");
            assert_eq!(content_type, "application/json");
            let reason = error_of(&answer);
            assert!(
                reason.starts_with(expected),
                "{path}: {reason:?} does not start with {expected:?}"
            );
        }
    }
}

#[tokio::test]
async fn oversized_bodies_get_413() {
    let router = memory_service();
    // Declared too large.
    let big = format!(r#"{{"rules":[],"pad":"{}"}}"#, "x".repeat(MAX_BODY_BYTES));
    let (status, _, body) = send(&router, post_json("/v1/acquire", big.clone())).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(error_of(&body), "request body larger than 65536 bytes");
    // Streamed without a length.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = big
        .into_bytes()
        .chunks(4096)
        .map(|c| Ok(c.to_vec()))
        .collect();
    let request = Request::post("/v1/acquire")
        .header("authorization", bearer())
        .header("content-type", "application/json")
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .unwrap();
    let (status, _, body) = send(&router, request).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(error_of(&body), "request body larger than 65536 bytes");
    // Exactly at the limit is read (and then judged on its content).
    let body = format!(
        r#"{{"rules":[],"pad":"{}"}}"#,
        "x".repeat(MAX_BODY_BYTES - r#"{"rules":[],"pad":""}"#.len())
    );
    assert_eq!(body.len(), MAX_BODY_BYTES);
    let (status, _, answer) = send(&router, post_json("/v1/acquire", body)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&answer), "rules: must contain at least one rule");
}

#[tokio::test]
async fn content_type_methods_and_routes() {
    let router = memory_service();
    let request = Request::post("/v1/acquire")
        .header("authorization", bearer())
        .header("content-type", "text/plain")
        .body(Body::from(EXAMPLE))
        .unwrap();
    let (status, _, body) = send(&router, request).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(error_of(&body), "content-type must be application/json");
    // Parameters and case are fine; so is no content type at all.
    let request = Request::post("/v1/acquire")
        .header("authorization", bearer())
        .header("content-type", "Application/JSON; charset=utf-8")
        .body(Body::from(EXAMPLE))
        .unwrap();
    assert_eq!(send(&router, request).await.0, StatusCode::OK);
    let request = Request::post("/v1/acquire")
        .header("authorization", bearer())
        .body(Body::from(EXAMPLE))
        .unwrap();
    assert_eq!(send(&router, request).await.0, StatusCode::OK);
    let (status, _, _) = send(
        &router,
        Request::get("/v1/acquire")
            .header("authorization", bearer())
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    // Without the secret, a gateway route tells nothing, not even its methods.
    let (status, _, _) = send(
        &router,
        Request::get("/v1/acquire").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, _) = send(&router, Request::get("/nope").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn healthz_readyz_and_metrics() {
    let router = memory_service();
    let (status, _, body) = send(
        &router,
        Request::get("/healthz").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(
        (status, body.as_slice()),
        (StatusCode::OK, b"ok".as_slice())
    );
    let (status, _, body) = send(
        &router,
        Request::get("/readyz").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(
        (status, body.as_slice()),
        (StatusCode::OK, b"ready".as_slice())
    );

    let key = unique_key("metrics");
    for _ in 0..3 {
        let _ = acquire(
            &router,
            vec![
                rule(&key, "W", 2, "hour", 2, 10, 1),
                rule(&key, "SW", 5, "hour", 5, 10, 1),
            ],
        )
        .await;
    }
    let _ = send(&router, post_json("/v1/acquire", "{")).await;
    let (status, content_type, body) = send(
        &router,
        Request::get("/metrics").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    let text = String::from_utf8(body).unwrap();
    for line in [
        "diana_quota_decisions_total{algo=\"W\",result=\"allowed\"} 2",
        "diana_quota_decisions_total{algo=\"W\",result=\"limited\"} 1",
        "diana_quota_decisions_total{algo=\"SW\",result=\"allowed\"} 2",
        "diana_quota_decisions_total{algo=\"SW\",result=\"spared\"} 1",
        "diana_quota_tokens_granted_total{algo=\"SW\"} 2",
        "diana_quota_http_requests_total{path=\"/v1/acquire\",status=\"200\"} 3",
        "diana_quota_http_requests_total{path=\"/v1/acquire\",status=\"400\"} 1",
        "diana_quota_http_requests_total{path=\"/healthz\",status=\"200\"} 1",
        "diana_quota_request_duration_seconds_count{path=\"/v1/acquire\"} 4",
        "# TYPE diana_quota_request_duration_seconds histogram",
        "diana_quota_store_errors_total{kind=\"unavailable\"} 0",
        "diana_quota_shed_total{path=\"/v1/acquire\"} 0",
        "diana_quota_deadline_expired_total{path=\"/v1/charge\"} 0",
        "diana_quota_in_flight 0",
        "diana_quota_store_keys 2",
        "diana_quota_store_key_capacity 100000",
        "diana_quota_store_evictions_total 0",
        "# EOF",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    // No key, no identity, no counter value: only fixed label values.
    assert!(!text.contains(&key), "{text}");
    assert!(!text.contains("key="), "{text}");
}

/// A store that fails (or hangs) on demand.
struct FakeStore {
    answer: Result<Vec<RuleResult>, StoreError>,
    hang: bool,
}

#[async_trait]
impl Store for FakeStore {
    async fn check_and_update(
        &self,
        rules: &[ResolvedRule<'_>],
    ) -> Result<Vec<Outcome>, StoreError> {
        if self.hang {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        self.answer.clone().map(|results| {
            results
                .into_iter()
                .cycle()
                .take(rules.len())
                .map(|result| Outcome {
                    result,
                    ..Outcome::default()
                })
                .collect()
        })
    }

    async fn charge(&self, rules: &[ResolvedRule<'_>]) -> Result<Vec<RuleResult>, StoreError> {
        self.check_and_update(rules)
            .await
            .map(|outcomes| outcomes.into_iter().map(|o| o.result).collect())
    }

    async fn release(&self, _: &[ResolvedRule<'_>], _: &[Outcome]) -> Result<(), StoreError> {
        Ok(())
    }

    async fn renew(
        &self,
        rules: &[ResolvedRule<'_>],
        _: &[diana_core::algo::Mark],
    ) -> Result<Vec<Outcome>, StoreError> {
        self.check_and_update(rules).await
    }

    async fn spend(
        &self,
        rules: &[ResolvedRule<'_>],
        _: &[diana_quota::store::Spending],
    ) -> Result<diana_quota::store::Spent, StoreError> {
        let outcomes = self.check_and_update(rules).await?;
        Ok(diana_quota::store::Spent {
            admitted: outcomes.iter().all(|outcome| outcome.result.allowed),
            outcomes,
        })
    }

    async fn note_call(&self, _: &str, _: &[Grant]) -> Result<Noted, StoreError> {
        Ok(Noted::Kept)
    }

    async fn take_call(&self, _: &str) -> Result<Option<Vec<Grant>>, StoreError> {
        Ok(None)
    }

    async fn health(&self) -> Result<(), StoreError> {
        if self.hang {
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
        self.answer.clone().map(|_| ())
    }

    fn describe(&self) -> String {
        "fake".to_string()
    }
}

fn fake_service(
    answer: Result<Vec<RuleResult>, StoreError>,
    hang: bool,
    settings: Settings,
) -> Router {
    app(AppState::new(
        Arc::new(FakeStore { answer, hang }),
        settings,
        test_auth(),
    ))
}

const FAST: Settings = Settings {
    deadline: Duration::from_millis(200),
    timeout_margin: Duration::from_millis(10),
    max_in_flight: 256,
    max_wait: Duration::from_millis(100),
    connections: diana_quota::conn::ConnectionLimits::DEFAULT,
};

#[tokio::test]
async fn store_failures_become_503_or_500() {
    let down = fake_service(
        Err(StoreError::Unavailable("connection refused".into())),
        false,
        FAST,
    );
    let (status, _, body) = send(&down, post_json("/v1/acquire", EXAMPLE)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(error_of(&body), "store unavailable: connection refused");
    let (status, _, _) = send(&down, Request::get("/healthz").body(Body::empty()).unwrap()).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "liveness does not depend on the store"
    );
    let (status, _, body) = send(&down, Request::get("/readyz").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        String::from_utf8(body).unwrap(),
        "store unavailable: connection refused"
    );

    let hung = fake_service(Ok(vec![]), true, FAST);
    for path in ["/v1/acquire", "/v1/wait"] {
        let started = Instant::now();
        let (status, _, body) = send(&hung, post_json(path, EXAMPLE)).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            error_of(&body),
            "deadline exceeded: no answer within 200 ms"
        );
        assert!(started.elapsed() < Duration::from_millis(500));
    }
    let started = Instant::now();
    let (status, _, _) = send(&hung, Request::get("/readyz").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(started.elapsed() < Duration::from_millis(500));

    let broken = fake_service(Err(StoreError::Internal("WRONGTYPE".into())), false, FAST);
    let (status, _, body) = send(&broken, post_json("/v1/acquire", EXAMPLE)).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(error_of(&body), "store error: WRONGTYPE");

    let (_, _, metrics) = send(&hung, Request::get("/metrics").body(Body::empty()).unwrap()).await;
    let text = String::from_utf8(metrics).unwrap();
    assert!(
        text.contains("diana_quota_store_errors_total{kind=\"timeout\"} 3"),
        "{text}"
    );
}

#[tokio::test]
async fn wait_sleeps_at_most_max_wait() {
    let long = RuleResult {
        place: None,
        allowed: true,
        granted: 1,
        remaining: 0,
        reset_ms: 30_000,
        retry_after_ms: 0,
        delay_ms: 20_000,
    };
    let router = fake_service(Ok(vec![long]), false, FAST);
    let started = Instant::now();
    let (status, _, body) = send(&router, post_json("/v1/wait", EXAMPLE)).await;
    let took = started.elapsed();
    assert_eq!(status, StatusCode::OK);
    let answer: AcquireResponse = serde_json::from_slice(&body).unwrap();
    // Slept the cap (100 ms here, 10 s by default) and reports the rest.
    assert_eq!(answer.results[0].delay_ms, 19_900);
    assert!(
        took >= Duration::from_millis(100) && took < Duration::from_millis(400),
        "{took:?}"
    );
    // /v1/acquire does not sleep.
    let started = Instant::now();
    let (_, _, body) = send(&router, post_json("/v1/acquire", EXAMPLE)).await;
    assert!(started.elapsed() < Duration::from_millis(50));
    assert_eq!(
        serde_json::from_slice::<AcquireResponse>(&body)
            .unwrap()
            .results[0]
            .delay_ms,
        20_000
    );
}

#[test]
fn command_line() {
    let cli = Cli::try_parse_from(["diana-quota"]).unwrap();
    assert_eq!(cli.listen, "127.0.0.1:8081");
    assert_eq!(cli.redis, None);
    assert_eq!(
        (
            cli.redis_connect_timeout_ms,
            cli.redis_timeout_ms,
            cli.max_wait_ms,
            cli.deadline_ms,
            cli.timeout_margin_ms,
            cli.max_in_flight,
            cli.memory_max_keys,
        ),
        (20, 20, 10_000, 40, 10, 256, 100_000)
    );
    let (store, settings) = cli.build().unwrap();
    assert!(store.describe().starts_with("memory"));
    assert_eq!(settings, Settings::default());
    // The arithmetic of the defaults: the service answers before the gateway gives up
    // (50 ms), and a connection plus an answer from Redis fit in its deadline.
    assert!(settings.deadline + settings.timeout_margin <= diana_quota::app::GATEWAY_TIMEOUT);
    assert!(
        Duration::from_millis(cli.redis_connect_timeout_ms + cli.redis_timeout_ms)
            <= settings.deadline
    );
    let cli = Cli::try_parse_from([
        "diana-quota",
        "--memory-max-keys",
        "5",
        "--deadline-ms",
        "30",
        "--max-in-flight",
        "8",
    ])
    .unwrap();
    let (store, settings) = cli.build().unwrap();
    assert_eq!(store.usage().unwrap().capacity, 5);
    assert_eq!(
        (settings.deadline, settings.max_in_flight),
        (Duration::from_millis(30), 8)
    );
    assert!(Cli::try_parse_from(["diana-quota", "--max-in-flight", "0"]).is_err());
    assert!(Cli::try_parse_from(["diana-quota", "--deadline-ms", "0"]).is_err());

    let cli = Cli::try_parse_from([
        "diana-quota",
        "--listen",
        "0.0.0.0:9000",
        "--redis",
        "redis+cluster://:secret@10.0.0.1:7000,10.0.0.2:7000",
        "--redis-timeout-ms",
        "100",
    ])
    .unwrap();
    let (store, _) = cli.build().unwrap();
    assert_eq!(
        store.describe(),
        "redis cluster [redis://***@10.0.0.1:7000, redis://***@10.0.0.2:7000]"
    );

    let cli = Cli::try_parse_from(["diana-quota", "--redis", "http://nope"]).unwrap();
    assert!(matches!(
        cli.build(),
        Err(StartError::Redis(RedisUrlError::Unsupported { .. }))
    ));
    assert!(Cli::try_parse_from(["diana-quota", "--bogus"]).is_err());
}

fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

/// A body that records whether anyone polled it.
fn watched_body(polled: Arc<AtomicBool>, body: String) -> Body {
    let mut sent = false;
    Body::from_stream(futures_util::stream::poll_fn(move |_| {
        polled.store(true, Ordering::SeqCst);
        if std::mem::replace(&mut sent, true) {
            Poll::Ready(None)
        } else {
            Poll::Ready(Some(Ok::<_, std::io::Error>(body.clone().into_bytes())))
        }
    }))
}

#[tokio::test]
async fn gateway_endpoints_need_the_secret_and_a_refusal_touches_nothing() {
    let store = Arc::new(MemoryStore::default());
    let router = service(store.clone());
    let key = unique_key("auth");
    // What each refused request asks for: the one token of `key` (or a debt on it).
    let body = serde_json::to_string(&diana_core::wire::AcquireRequest::new(vec![rule(
        &key, "W", 1, "hour", 1, 10, 1,
    )]))
    .unwrap();
    let wrong = format!("Bearer {}x", TEST_TOKEN);
    let credentials: [(Option<&str>, &str); 5] = [
        (None, "missing"),
        (Some(wrong.as_str()), "invalid"),
        (Some(&TEST_TOKEN[..TEST_TOKEN.len() - 1]), "invalid"),
        (Some(TEST_TOKEN), "invalid"), // no scheme
        (Some("Basic dGVzdDp0ZXN0"), "invalid"),
    ];
    let paths = [
        "/v1/acquire",
        "/v1/wait",
        "/v1/charge",
        "/v1/release",
        "/v1/leave",
        "/v1/renew",
    ];
    for path in paths {
        for (credential, _) in credentials {
            let polled = Arc::new(AtomicBool::new(false));
            let mut request = Request::post(path).header("content-type", "application/json");
            if let Some(value) = credential {
                request = request.header("authorization", value);
            }
            let request = request
                .body(watched_body(polled.clone(), body.clone()))
                .unwrap();
            let response = router.clone().oneshot(request).await.unwrap();
            assert_eq!(
                response.status(),
                StatusCode::UNAUTHORIZED,
                "{path} {credential:?}"
            );
            assert_eq!(response.headers()["www-authenticate"], "Bearer");
            assert_eq!(response.headers()["content-type"], "application/json");
            let answer = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(error_of(&answer), "unauthorized");
            assert!(!polled.load(Ordering::SeqCst), "{path}: the body was read");
        }
        // Even a body too large: refused for the credential, before its size matters.
        let big = format!(r#"{{"pad":"{}"}}"#, "x".repeat(MAX_BODY_BYTES));
        let request = Request::post(path).body(Body::from(big)).unwrap();
        assert_eq!(send(&router, request).await.0, StatusCode::UNAUTHORIZED);
    }
    assert!(store.is_empty(), "a refused request created a counter");
    // With the secret: the counter is whole (1 of 1 left), then spent.
    let first = acquire_one(&router, rule(&key, "W", 1, "hour", 1, 10, 1)).await;
    assert!(first.allowed && first.remaining == 0, "{first:?}");
    // Health and metrics need no secret; metrics name no key.
    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(send(&router, get(path)).await.0, StatusCode::OK, "{path}");
    }
    let (_, _, text) = send(&router, get("/metrics")).await;
    let text = String::from_utf8(text).unwrap();
    for line in [
        "diana_quota_unauthorized_total{reason=\"missing\"} 12",
        "diana_quota_unauthorized_total{reason=\"invalid\"} 24",
        "diana_quota_http_requests_total{path=\"/v1/leave\",status=\"401\"} 6",
        "diana_quota_http_requests_total{path=\"/v1/renew\",status=\"401\"} 6",
        "diana_quota_http_requests_total{path=\"/v1/charge\",status=\"401\"} 6",
        "diana_quota_auth_required 1",
        "diana_quota_decisions_total{algo=\"W\",result=\"allowed\"} 1",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
    assert!(!text.contains(&key) && !text.contains(TEST_TOKEN), "{text}");
}

#[tokio::test]
async fn insecure_no_auth_serves_without_a_secret() {
    let router = app(AppState::new(
        Arc::new(memory_store()),
        test_settings(),
        Auth::insecure(),
    ));
    let request = Request::post("/v1/acquire")
        .body(Body::from(EXAMPLE))
        .unwrap();
    assert_eq!(send(&router, request).await.0, StatusCode::OK);
    let (_, _, text) = send(&router, get("/metrics")).await;
    assert!(String::from_utf8(text)
        .unwrap()
        .contains("diana_quota_auth_required 0"));
}

#[test]
fn command_line_authentication() {
    let plain = Cli::try_parse_from(["diana-quota"]).unwrap();
    // No secret: refused, naming every way out.
    let refused = plain.auth_with(None).unwrap_err();
    assert!(matches!(refused, AuthError::NoSecret));
    let refused = refused.to_string();
    for name in ["--token-file", "DIANA_QUOTA_TOKEN", "--insecure-no-auth"] {
        assert!(refused.contains(name), "{refused}");
    }
    // A short secret: refused, the secret not repeated.
    let short = "0123456789abcdef0123456789abcde";
    let refused = plain.auth_with(Some(short)).unwrap_err();
    assert!(matches!(refused, AuthError::BadSecret { .. }));
    let refused = refused.to_string();
    assert!(refused.contains("at least 32 bytes"), "{refused}");
    assert!(!refused.contains(short));
    // The environment's secret.
    let auth = plain.auth_with(Some(&format!("{TEST_TOKEN}\n"))).unwrap();
    assert!(auth.is_required() && auth.accepts(TEST_TOKEN.as_bytes()));
    // A token file of two lines: both accepted; with the environment's, three.
    let second = "second-secret-abcdefghijklmnopqrstuvwxyz";
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(&file, format!("{TEST_TOKEN}\n{second}\n")).unwrap();
    let cli = Cli::try_parse_from(["diana-quota", "--token-file", file.path().to_str().unwrap()])
        .unwrap();
    let auth = cli.auth_with(None).unwrap();
    assert_eq!(auth.secrets(), 2);
    assert!(auth.accepts(TEST_TOKEN.as_bytes()) && auth.accepts(second.as_bytes()));
    assert!(!auth.accepts(b"third-secret-abcdefghijklmnopqrstuvwxyz"));
    let third = "third-secret-abcdefghijklmnopqrstuvwxyz";
    assert_eq!(cli.auth_with(Some(third)).unwrap().secrets(), 3);
    // A file with a short line, or none at all: refused.
    let bad = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(&bad, format!("{TEST_TOKEN}\nshort\n")).unwrap();
    let cli =
        Cli::try_parse_from(["diana-quota", "--token-file", bad.path().to_str().unwrap()]).unwrap();
    let refused = cli.auth_with(None).unwrap_err().to_string();
    assert!(
        refused.contains("line 2: a secret must be at least 32 bytes"),
        "{refused}"
    );
    let cli = Cli::try_parse_from(["diana-quota", "--token-file", "/nonexistent/token"]).unwrap();
    let refused = cli.auth_with(None).unwrap_err();
    assert!(matches!(refused, AuthError::Unreadable { .. }));
    assert!(refused
        .to_string()
        .starts_with("--token-file /nonexistent/token: "));
    // --insecure-no-auth: no secret needed, and none allowed alongside.
    let insecure = Cli::try_parse_from(["diana-quota", "--insecure-no-auth"]).unwrap();
    assert!(!insecure.auth_with(None).unwrap().is_required());
    assert!(matches!(
        insecure.auth_with(Some(TEST_TOKEN)),
        Err(AuthError::InsecureWithSecret)
    ));
    // There is no flag that takes the secret itself.
    for flag in ["--token", "--secret", "--auth-token", "--bearer"] {
        assert!(
            Cli::try_parse_from(["diana-quota", flag, TEST_TOKEN]).is_err(),
            "{flag}"
        );
        assert!(Cli::try_parse_from(["diana-quota", &format!("{flag}={TEST_TOKEN}")]).is_err());
    }
    // --help explains it.
    let help = Cli::try_parse_from(["diana-quota", "--help"])
        .unwrap_err()
        .to_string();
    for text in [
        "--token-file <PATH>",
        "--insecure-no-auth",
        "DIANA_QUOTA_TOKEN",
        "Rotation:",
        "SIGHUP",
    ] {
        assert!(help.contains(text), "{text:?} not in --help:\n{help}");
    }
}
