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
use diana_core::global::wire::{
    AcquireResponse, ErrorResponse, ResolvedRule, RuleResult, MAX_BODY_BYTES,
};
use diana_quota::store::{Outcome, Store, StoreError};
use diana_quota::{app, AppState, Cli, Settings};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
            with(&good.replace("second", "week")),
            "rules[2].unit: unknown unit \"week\"",
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
        .header("content-type", "text/plain")
        .body(Body::from(EXAMPLE))
        .unwrap();
    let (status, _, body) = send(&router, request).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(error_of(&body), "content-type must be application/json");
    // Parameters and case are fine; so is no content type at all.
    let request = Request::post("/v1/acquire")
        .header("content-type", "Application/JSON; charset=utf-8")
        .body(Body::from(EXAMPLE))
        .unwrap();
    assert_eq!(send(&router, request).await.0, StatusCode::OK);
    let request = Request::post("/v1/acquire")
        .body(Body::from(EXAMPLE))
        .unwrap();
    assert_eq!(send(&router, request).await.0, StatusCode::OK);
    let (status, _, _) = send(
        &router,
        Request::get("/v1/acquire").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
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
    ))
}

const FAST: Settings = Settings {
    deadline: Duration::from_millis(200),
    timeout_margin: Duration::from_millis(10),
    max_in_flight: 256,
    max_wait: Duration::from_millis(100),
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
    assert!(settings.deadline + settings.timeout_margin <= diana_quota::http::GATEWAY_TIMEOUT);
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
    assert!(cli.build().err().unwrap().contains("unsupported Redis URL"));
    assert!(Cli::try_parse_from(["diana-quota", "--bogus"]).is_err());
}
