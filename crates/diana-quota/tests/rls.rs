//! Envoy's protocols over real gRPC (loopback, memory store): RLS decisions (exact counts,
//! all or nothing, hits_addend, unlimited, replaces, shadow mode, blocks, overrides,
//! headers, bad calls, authentication, failures before the deadline) and RLQS
//! assignments (share, deny when dry, allow-all, charges of reported usage).

#![cfg(test)]

use async_trait::async_trait;
use diana_core::wire::{ResolvedRule, RuleResult};
use diana_quota::auth::{checked, Auth};
use diana_quota::rls::{self, HeaderStyle, Rls};
use diana_quota::store::{Grant, MemoryStore, Noted, Outcome, Store, StoreError, SystemClock};
use diana_quota::{AppState, Settings, StartError};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tempfile::TempDir;
use tonic::transport::Channel;

const SECRET: &str = "0123456789abcdef0123456789abcdef-rls";

const CONFIG: &str = r#"
domain: edge
descriptors:
  - key: tenant
    value: a
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: tenant
    value: wide
    rate_limit: {unit: hour, requests_per_unit: 5, name: wide}
  - key: tenant
    value: narrow
    rate_limit: {unit: hour, requests_per_unit: 1, replaces: [{name: wide}]}
  - key: tenant
    value: one
    rate_limit: {unit: hour, requests_per_unit: 1, name: one}
  - key: tenant
    value: blocked
    rate_limit: {unit: hour, requests_per_unit: 0}
  - key: tenant
    value: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: tenant
    value: free
    rate_limit: {unlimited: true}
  - key: tenant
    value: bucket
    rate_limit: {unit: hour, requests_per_unit: 100, algorithm: TB, burst: 4}
  - key: tenant
    value: shared
    rate_limit: {unit: hour, requests_per_unit: 4, diana_key: "8f3a2c1d00e1b7a4:0000000000000001"}
  - key: remote_address
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: budget
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: tokens
    rate_limit: {unit: hour, requests_per_unit: 1000000}
  - key: service
    value: service_1
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
    metadata: {service_with_quota: {name: service_1}}
  - key: service
    value: service_2
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 2}
    metadata: {service_with_quota: {name: service_2}, tier: [gold, 2]}
  - key: monthly
    rate_limit: {unit: month, requests_per_unit: 3, timezone: Pacific/Auckland}
  - key: weekly
    rate_limit: {unit: week, requests_per_unit: 2, algorithm: TB}
"#;

struct Server {
    port: u16,
    state: AppState,
    rls: Rls,
    file: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), StartError>>,
    _dir: TempDir,
}

async fn start_with(
    name: &str,
    store: Arc<dyn Store>,
    auth: Auth,
    headers: HeaderStyle,
    settings: Settings,
) -> Server {
    let dir = tempfile::Builder::new()
        .prefix(&format!("diana-rls-test-{name}-"))
        .tempdir()
        .unwrap();
    let file = dir.path().join("edge.yaml");
    std::fs::write(&file, CONFIG).unwrap();
    let config = rls::load(std::slice::from_ref(&file), &rls::CounterKeys::public()).unwrap();
    let auth = Arc::new(auth);
    let state = AppState::new(store, settings, auth.clone());
    let rls = Rls::new(state.clone(), config, vec![file.clone()], headers, auth);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(rls::serve(listener, rls.clone(), async move {
        let _ = stopped.await;
    }));
    Server {
        port,
        state,
        rls,
        file,
        stop: Some(stop),
        task,
        _dir: dir,
    }
}

async fn start(name: &str) -> Server {
    let store = Arc::new(MemoryStore::with_capacity(Arc::new(SystemClock), 10_000));
    start_with(
        name,
        store,
        Auth::insecure(),
        HeaderStyle::None,
        Settings::default(),
    )
    .await
}

impl Server {
    async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://127.0.0.1:{}", self.port))
            .await
            .unwrap()
    }

    async fn quota_client(&self) -> RateLimitQuotaServiceClient<Channel> {
        RateLimitQuotaServiceClient::connect(format!("http://127.0.0.1:{}", self.port))
            .await
            .unwrap()
    }

    /// An open RLQS stream: where its reports go, and its answers.
    async fn quota_stream(&self) -> (Reports, tonic::Streaming<RateLimitQuotaResponse>) {
        let (sender, receiver) = tokio::sync::mpsc::channel(8);
        let answers = self
            .quota_client()
            .await
            .stream_rate_limit_quotas(tokio_stream::wrappers::ReceiverStream::new(receiver))
            .await
            .unwrap()
            .into_inner();
        (sender, answers)
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), &mut self.task).await;
    }
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| Entry {
                key: key.to_string(),
                value: value.to_string(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

fn call(descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: "edge".to_string(),
        descriptors,
        hits_addend: 0,
    }
}

async fn ask(
    client: &mut RateLimitServiceClient<Channel>,
    request: RateLimitRequest,
) -> RateLimitResponse {
    client
        .should_rate_limit(request)
        .await
        .unwrap()
        .into_inner()
}

fn codes(response: &RateLimitResponse) -> (i32, Vec<i32>) {
    (
        response.overall_code,
        response.statuses.iter().map(|status| status.code).collect(),
    )
}

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

#[tokio::test]
async fn descriptors_are_counted_exactly_and_decided_together() {
    let server = start("exact").await;
    let mut client = server.client().await;
    // Exactly 3 of 5 pass; each status says what remains and when it resets.
    let mut remaining = Vec::new();
    for _ in 0..5 {
        let answer = ask(&mut client, call(vec![descriptor(&[("tenant", "a")])])).await;
        remaining.push((answer.overall_code, answer.statuses[0].limit_remaining));
        let limit = answer.statuses[0].current_limit.clone().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit), (3, 3));
        assert!(answer.statuses[0].duration_until_reset.is_some());
    }
    assert_eq!(remaining, [(OK, 2), (OK, 1), (OK, 0), (OVER, 0), (OVER, 0)]);

    // All or nothing: `one` has 1; the call with `one` and remote_address 1.2.3.4 passes,
    // the next one is refused by `one` and charges remote_address nothing.
    let both = || {
        call(vec![
            descriptor(&[("tenant", "one")]),
            descriptor(&[("remote_address", "1.2.3.4")]),
        ])
    };
    assert_eq!(codes(&ask(&mut client, both()).await), (OK, vec![OK, OK]));
    let refused = ask(&mut client, both()).await;
    assert_eq!(codes(&refused), (OVER, vec![OVER, OK]));
    assert_eq!(
        refused.statuses[1].limit_remaining, 1,
        "remote_address not charged"
    );
    let alone = ask(
        &mut client,
        call(vec![descriptor(&[("remote_address", "1.2.3.4")])]),
    )
    .await;
    assert_eq!(
        (alone.overall_code, alone.statuses[0].limit_remaining),
        (OK, 0)
    );
    // Each value of a descriptor without a value counts apart.
    let other = ask(
        &mut client,
        call(vec![descriptor(&[("remote_address", "5.6.7.8")])]),
    )
    .await;
    assert_eq!(
        (other.overall_code, other.statuses[0].limit_remaining),
        (OK, 1)
    );
    server.stop().await;
}

/// Seconds from the system clock's now to the end of the calendar period that contains it.
fn seconds_to_end(unit: diana_core::calendar::CalendarUnit, zone: &str) -> u64 {
    use diana_quota::store::Clock;
    let zone = diana_core::calendar::Zone::parse(zone).unwrap();
    let now = SystemClock.now();
    diana_core::calendar::period(now, unit, &zone).seconds_to_end(now)
}

#[tokio::test]
async fn week_and_month_count_in_calendar_periods_and_reset_at_their_end() {
    use diana_core::calendar::CalendarUnit;
    let server = start("calendar").await;
    let mut client = server.client().await;
    // A month in Pacific/Auckland: 3 pass, the 4th is refused until the month ends there.
    let mut seen = Vec::new();
    let mut resets = Vec::new();
    for _ in 0..4 {
        let answer = ask(&mut client, call(vec![descriptor(&[("monthly", "acme")])])).await;
        let status = &answer.statuses[0];
        let limit = status.current_limit.clone().unwrap();
        seen.push((answer.overall_code, status.limit_remaining, limit.unit));
        resets.push(status.duration_until_reset.unwrap().seconds);
    }
    assert_eq!(seen, [(OK, 2, 5), (OK, 1, 5), (OK, 0, 5), (OVER, 0, 5)]);
    let to_end = seconds_to_end(CalendarUnit::Month, "Pacific/Auckland");
    for reset in resets {
        let reset = u64::try_from(reset).unwrap();
        assert!(
            reset.abs_diff(to_end) <= 2,
            "reset in {reset} s, the month ends in Auckland in {to_end} s"
        );
    }
    // Each value counts apart, as for any descriptor without a value.
    let other = ask(&mut client, call(vec![descriptor(&[("monthly", "other")])])).await;
    assert_eq!(codes(&other), (OK, vec![OK]));

    // A token bucket refilling 2 per UTC week: 2 at once, then refused; WEEK (7) in the
    // answer.
    let mut seen = Vec::new();
    for _ in 0..3 {
        let answer = ask(&mut client, call(vec![descriptor(&[("weekly", "acme")])])).await;
        let limit = answer.statuses[0].current_limit.clone().unwrap();
        seen.push((answer.overall_code, limit.unit));
    }
    assert_eq!(seen, [(OK, 7), (OK, 7), (OVER, 7)]);
    server.stop().await;
}

#[tokio::test]
async fn hits_addend_unlimited_replaces_shadow_blocks_and_overrides() {
    let server = start("kinds").await;
    let mut client = server.client().await;
    // The call's hits_addend, then a descriptor's own; 0 asks without taking.
    let mut request = call(vec![descriptor(&[("tenant", "wide")])]);
    request.hits_addend = 2;
    assert_eq!(
        ask(&mut client, request.clone()).await.statuses[0].limit_remaining,
        3
    );
    request.descriptors[0].hits_addend = Some(UInt64Value { value: 3 });
    assert_eq!(
        ask(&mut client, request.clone()).await.statuses[0].limit_remaining,
        0
    );
    // 0 checks without taking: refused once nothing is left (issue 41: it was OK).
    request.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    assert_eq!(ask(&mut client, request.clone()).await.overall_code, OVER);
    request.descriptors[0].hits_addend = Some(UInt64Value { value: 1 });
    assert_eq!(ask(&mut client, request.clone()).await.overall_code, OVER);
    // A cost the limit can never grant is over the limit, not an error.
    let mut huge = call(vec![descriptor(&[("tenant", "a")])]);
    huge.hits_addend = 1_000_000;
    assert_eq!(ask(&mut client, huge).await.overall_code, OVER);

    // `narrow` replaces `wide`: with both, only narrow counts (wide is spent, yet OK).
    let replaced = ask(
        &mut client,
        call(vec![
            descriptor(&[("tenant", "wide")]),
            descriptor(&[("tenant", "narrow")]),
        ]),
    )
    .await;
    assert_eq!(codes(&replaced), (OK, vec![OK, OK]));
    assert!(replaced.statuses[0].current_limit.is_none());

    // Unlimited: OK with everything remaining; no rule: OK; unknown domain: OK.
    let free = ask(&mut client, call(vec![descriptor(&[("tenant", "free")])])).await;
    assert_eq!(
        (free.overall_code, free.statuses[0].limit_remaining),
        (OK, u32::MAX)
    );
    assert_eq!(
        ask(&mut client, call(vec![descriptor(&[("nothing", "x")])]))
            .await
            .overall_code,
        OK
    );
    let mut elsewhere = call(vec![descriptor(&[("tenant", "a")])]);
    elsewhere.domain = "other".to_string();
    assert_eq!(ask(&mut client, elsewhere).await.overall_code, OK);

    // Shadow mode: counted, never refuses.
    for _ in 0..3 {
        let shadow = ask(&mut client, call(vec![descriptor(&[("tenant", "shadow")])])).await;
        assert_eq!(shadow.overall_code, OK);
    }
    // A block refuses, and nothing else of the call is charged.
    let blocked = ask(
        &mut client,
        call(vec![
            descriptor(&[("tenant", "blocked")]),
            descriptor(&[("remote_address", "9.9.9.9")]),
        ]),
    )
    .await;
    assert_eq!(blocked.overall_code, OVER);
    let after = ask(
        &mut client,
        call(vec![descriptor(&[("remote_address", "9.9.9.9")])]),
    )
    .await;
    assert_eq!(after.statuses[0].limit_remaining, 1);

    // A descriptor carrying its own limit (envoyproxy/ratelimit's override).
    let mut over = descriptor(&[("custom", "x")]);
    over.limit = Some(RateLimitOverride {
        requests_per_unit: 2,
        unit: 3,
    });
    let answers: Vec<i32> = {
        let mut out = Vec::new();
        for _ in 0..3 {
            out.push(
                ask(&mut client, call(vec![over.clone()]))
                    .await
                    .overall_code,
            );
        }
        out
    };
    assert_eq!(answers, [OK, OK, OVER]);
    // MONTH: UTC's calendar month (its own counter); YEAR is refused.
    let mut monthly = descriptor(&[("custom", "y")]);
    monthly.limit = Some(RateLimitOverride {
        requests_per_unit: 2,
        unit: 5,
    });
    let mut answers = Vec::new();
    for _ in 0..3 {
        let answer = ask(&mut client, call(vec![monthly.clone()])).await;
        let limit = answer.statuses[0].current_limit.clone().unwrap();
        answers.push((answer.overall_code, limit.unit));
    }
    assert_eq!(answers, [(OK, 5), (OK, 5), (OVER, 5)]);
    over.limit = Some(RateLimitOverride {
        requests_per_unit: 2,
        unit: 6,
    });
    let status = client
        .should_rate_limit(call(vec![over]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    server.stop().await;
}

#[tokio::test]
async fn a_diana_key_shares_the_counter_of_a_diana_global_rule() {
    let server = start("shared").await;
    let mut client = server.client().await;
    // The wasm filter's rule (W 4/hour, actor all) takes 3 through the HTTP API's store.
    let rule = ResolvedRule {
        key: "8f3a2c1d00e1b7a4:0000000000000001",
        algo: diana_core::algo::lookup("W").unwrap(),
        limit: diana_core::algo::Limit {
            rpu: 4.try_into().unwrap(),
            unit: diana_core::time::Unit::Hour,
            burst: 4.try_into().unwrap(),
            slices: 10.try_into().unwrap(),
            calendar: None,
            period: None,
        },
        want: 3.try_into().unwrap(),
        cost: 1.try_into().unwrap(),
        max_delay: None,
        dry_run: false,
    };
    let granted = server
        .state
        .store()
        .check_and_update(&[rule])
        .await
        .unwrap();
    assert_eq!(granted[0].result.granted, 3);
    let codes: Vec<i32> = {
        let mut out = Vec::new();
        for _ in 0..2 {
            out.push(
                ask(&mut client, call(vec![descriptor(&[("tenant", "shared")])]))
                    .await
                    .overall_code,
            );
        }
        out
    };
    assert_eq!(codes, [OK, OVER], "one left for Envoy's filter");
    server.stop().await;
}

#[tokio::test]
async fn bad_calls_are_refused_naming_the_field() {
    let server = start("bad").await;
    let mut client = server.client().await;
    let cases = [
        (call(vec![]), "descriptors: must not be empty"),
        (
            call(vec![descriptor(&[])]),
            "descriptors[0].entries: must not be empty",
        ),
        (
            call(vec![descriptor(&[("", "x")])]),
            "descriptors[0].entries[0].key: must not be empty",
        ),
        (
            call(vec![
                descriptor(&[("tenant", "a")]),
                descriptor(&[("path", &"p".repeat(5000))]),
            ]),
            "descriptors[1].entries[0].value: 5000 bytes, at most 4096",
        ),
    ];
    for (request, expected) in cases {
        let status = client.should_rate_limit(request).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(
            status.message().starts_with(expected),
            "{}",
            status.message()
        );
    }
    let mut nameless = call(vec![descriptor(&[("tenant", "a")])]);
    nameless.domain.clear();
    let status = client.should_rate_limit(nameless).await.unwrap_err();
    assert_eq!(status.message(), "domain: must not be empty");
    let mut long = call(vec![descriptor(&[("tenant", "a")])]);
    long.domain = "d".repeat(5000);
    let status = client.should_rate_limit(long).await.unwrap_err();
    assert_eq!(status.message(), "domain: 5000 bytes, at most 4096");
    // RLQS streams: the same bounds on the domain and on a bucket id's entries.
    let mut quota = server.quota_client().await;
    let wide: Vec<(String, String)> = (0..65).map(|i| (format!("k{i}"), "v".into())).collect();
    let wide: Vec<(&str, &str)> = wide.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let long_value = "v".repeat(5000);
    for (reports, expected) in [
        (
            report(&"d".repeat(5000), &[("tenant", "a")], 1),
            "domain: 5000 bytes, at most 4096",
        ),
        (
            report("edge", &wide, 1),
            "bucket_quota_usages[0].bucket_id.bucket: at most 64 entries, got 65",
        ),
        (
            report("edge", &[("tenant", &long_value)], 1),
            "bucket_quota_usages[0].bucket_id.bucket: value of 5000 bytes, at most 4096 (key \"tenant\")",
        ),
    ] {
        let mut answers = quota
            .stream_rate_limit_quotas(tokio_stream::iter(vec![reports]))
            .await
            .unwrap()
            .into_inner();
        let status = answers.message().await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert_eq!(status.message(), expected);
    }
    server.stop().await;
}

#[tokio::test]
async fn calls_need_the_secret_in_their_metadata() {
    let store = Arc::new(MemoryStore::with_capacity(Arc::new(SystemClock), 100));
    let auth = Auth::with_secrets(&[checked(SECRET, "test").unwrap()]).unwrap();
    let server = start_with("auth", store, auth, HeaderStyle::None, Settings::default()).await;
    let mut client = server.client().await;
    let status = client
        .should_rate_limit(call(vec![descriptor(&[("tenant", "a")])]))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    let mut wrong = tonic::Request::new(call(vec![descriptor(&[("tenant", "a")])]));
    wrong
        .metadata_mut()
        .insert("authorization", "Bearer nope-nope-nope".parse().unwrap());
    assert_eq!(
        client.should_rate_limit(wrong).await.unwrap_err().code(),
        tonic::Code::Unauthenticated
    );
    let mut right = tonic::Request::new(call(vec![descriptor(&[("tenant", "a")])]));
    right
        .metadata_mut()
        .insert("authorization", format!("Bearer {SECRET}").parse().unwrap());
    assert_eq!(
        client
            .should_rate_limit(right)
            .await
            .unwrap()
            .into_inner()
            .overall_code,
        OK
    );
    // RLQS too.
    let mut quota = server.quota_client().await;
    let reports = tokio_stream::iter(vec![report("edge", &[("tenant", "a")], 1)]);
    let status = quota.stream_rate_limit_quotas(reports).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);
    server.stop().await;
}

#[tokio::test]
async fn headers_ride_on_the_answer() {
    let store = Arc::new(MemoryStore::with_capacity(Arc::new(SystemClock), 100));
    let server = start_with(
        "headers",
        store,
        Auth::insecure(),
        HeaderStyle::Both,
        Settings::default(),
    )
    .await;
    let mut client = server.client().await;
    let first = ask(&mut client, call(vec![descriptor(&[("tenant", "one")])])).await;
    let names: Vec<&str> = first
        .response_headers_to_add
        .iter()
        .map(|h| h.key.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
            "ratelimit-policy",
            "ratelimit"
        ]
    );
    assert_eq!(first.response_headers_to_add[3].value, "\"one\";q=1;w=3600");
    let refused = ask(&mut client, call(vec![descriptor(&[("tenant", "one")])])).await;
    assert_eq!(refused.overall_code, OVER);
    assert_eq!(refused.response_headers_to_add[0].key, "retry-after");
    let retry: u64 = refused.response_headers_to_add[0].value.parse().unwrap();
    assert!((1..=3600).contains(&retry));
    server.stop().await;
}

/// A store that fails, or takes a second.
struct Broken {
    slow: bool,
}

#[async_trait]
impl Store for Broken {
    async fn check_and_update(&self, _: &[ResolvedRule<'_>]) -> Result<Vec<Outcome>, StoreError> {
        if self.slow {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        Err(StoreError::Unavailable("connection refused".into()))
    }
    async fn charge(&self, _: &[ResolvedRule<'_>]) -> Result<Vec<RuleResult>, StoreError> {
        Err(StoreError::Unavailable("connection refused".into()))
    }
    async fn release(&self, _: &[ResolvedRule<'_>], _: &[Outcome]) -> Result<(), StoreError> {
        Ok(())
    }
    async fn renew(
        &self,
        _: &[ResolvedRule<'_>],
        _: &[diana_core::algo::Mark],
    ) -> Result<Vec<Outcome>, StoreError> {
        Err(StoreError::Unavailable("connection refused".into()))
    }
    async fn spend(
        &self,
        _: &[ResolvedRule<'_>],
        _: &[diana_quota::store::Spending],
    ) -> Result<diana_quota::store::Spent, StoreError> {
        Err(StoreError::Unavailable("connection refused".into()))
    }
    async fn note_call(&self, _: &str, _: &[Grant]) -> Result<Noted, StoreError> {
        Err(StoreError::Unavailable("connection refused".into()))
    }
    async fn take_call(&self, _: &str) -> Result<Option<Vec<Grant>>, StoreError> {
        Err(StoreError::Unavailable("connection refused".into()))
    }
    async fn health(&self) -> Result<(), StoreError> {
        Err(StoreError::Unavailable("connection refused".into()))
    }
    fn describe(&self) -> String {
        "broken".into()
    }
}

#[tokio::test]
async fn a_failing_store_is_an_error_before_the_callers_deadline() {
    for slow in [false, true] {
        let settings = Settings {
            deadline: Duration::from_millis(200),
            ..Settings::default()
        };
        let server = start_with(
            "broken",
            Arc::new(Broken { slow }),
            Auth::insecure(),
            HeaderStyle::None,
            settings,
        )
        .await;
        let mut client = server.client().await;
        let mut request = tonic::Request::new(call(vec![descriptor(&[("tenant", "a")])]));
        // Envoy's 50 ms timeout, less the 10 ms margin: answered within 40 ms.
        request.set_timeout(Duration::from_millis(50));
        let started = Instant::now();
        let status = client.should_rate_limit(request).await.unwrap_err();
        let took = started.elapsed();
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        if slow {
            assert!(
                status
                    .message()
                    .starts_with("deadline exceeded: no answer within 40 ms"),
                "{}",
                status.message()
            );
        } else {
            assert!(
                status.message().contains("connection refused"),
                "{}",
                status.message()
            );
        }
        assert!(took < Duration::from_millis(500), "{took:?}");
        // A descriptor without a rule needs no store.
        let free = ask(&mut client, call(vec![descriptor(&[("tenant", "free")])])).await;
        assert_eq!(free.overall_code, OK);
        server.stop().await;
    }
}

/// Where an RLQS stream's reports are sent.
type Reports = tokio::sync::mpsc::Sender<RateLimitQuotaUsageReports>;

fn report(domain: &str, bucket: &[(&str, &str)], allowed: u64) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: domain.to_string(),
        bucket_quota_usages: vec![BucketQuotaUsage {
            bucket_id: Some(BucketId {
                bucket: bucket
                    .iter()
                    .map(|(key, value)| (key.to_string(), value.to_string()))
                    .collect(),
            }),
            time_elapsed: Some(envoy_types::pb::google::protobuf::Duration {
                seconds: 1,
                nanos: 0,
            }),
            num_requests_allowed: allowed,
            num_requests_denied: 0,
        }],
    }
}

/// The strategy of the first bucket action of an RLQS answer.
fn strategy_of(
    response: &envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaResponse,
) -> Strategy {
    let action = response.bucket_action[0].bucket_action.unwrap();
    let Action::QuotaAssignmentAction(assignment) = action else {
        panic!("{action:?}")
    };
    assert_eq!(assignment.assignment_time_to_live.unwrap().seconds, 3);
    assignment.rate_limit_strategy.unwrap().strategy.unwrap()
}

#[tokio::test]
async fn rlqs_assigns_shares_and_charges_the_reported_usage() {
    let server = start("rlqs").await;
    let (sender, mut answers) = server.quota_stream().await;
    // A bucket of `tenant: a` (W 3/hour), its first request admitted: one gateway's share
    // is the whole limit, at most the 2 left.
    sender
        .send(report("edge", &[("tenant", "a")], 1))
        .await
        .unwrap();
    let first = answers.message().await.unwrap().unwrap();
    let Strategy::TokenBucket(bucket) = strategy_of(&first) else {
        panic!("{first:?}")
    };
    assert_eq!(
        (bucket.max_tokens, bucket.tokens_per_fill.unwrap().value),
        (2, 3)
    );
    assert_eq!(bucket.fill_interval.unwrap().seconds, 3600);
    // The gateway reports 2 more: 3 charged, nothing left: DENY_ALL.
    sender
        .send(report("", &[("tenant", "a")], 2))
        .await
        .unwrap();
    let second = answers.message().await.unwrap().unwrap();
    assert_eq!(
        strategy_of(&second),
        Strategy::BlanketRule(BlanketRule::DenyAll as i32)
    );
    // RLS sees the same counter spent.
    let mut client = server.client().await;
    assert_eq!(
        ask(&mut client, call(vec![descriptor(&[("tenant", "a")])]))
            .await
            .overall_code,
        OVER
    );
    // Unlimited and unknown buckets: ALLOW_ALL; blocked: DENY_ALL.
    for (entries, expected) in [
        (&[("tenant", "free")][..], BlanketRule::AllowAll),
        (&[("nothing", "x")][..], BlanketRule::AllowAll),
        (&[("tenant", "blocked")][..], BlanketRule::DenyAll),
    ] {
        sender.send(report("", entries, 0)).await.unwrap();
        let answer = answers.message().await.unwrap().unwrap();
        assert_eq!(
            strategy_of(&answer),
            Strategy::BlanketRule(expected as i32),
            "{entries:?}"
        );
    }
    // A second gateway on `tenant: bucket` (TB 100/hour, burst 4): each gets half.
    sender
        .send(report("", &[("tenant", "bucket")], 0))
        .await
        .unwrap();
    let alone = answers.message().await.unwrap().unwrap();
    let Strategy::TokenBucket(alone) = strategy_of(&alone) else {
        panic!()
    };
    assert_eq!(
        (alone.max_tokens, alone.tokens_per_fill.unwrap().value),
        (4, 100)
    );
    let (other_sender, mut other) = server.quota_stream().await;
    other_sender
        .send(report("edge", &[("tenant", "bucket")], 0))
        .await
        .unwrap();
    let half = other.message().await.unwrap().unwrap();
    let Strategy::TokenBucket(half) = strategy_of(&half) else {
        panic!()
    };
    assert_eq!(
        (half.max_tokens, half.tokens_per_fill.unwrap().value),
        (2, 50)
    );
    drop(sender);
    drop(other_sender);
    server.stop().await;
}

#[tokio::test]
async fn an_rlqs_report_of_any_elapsed_time_is_answered() {
    let server = start("rlqs-elapsed").await;
    let (sender, mut answers) = server.quota_stream().await;
    // `time_elapsed` as large as the message can say, then nothing (it tells no interval):
    // each answered on the same stream, the assignment living at most a minute.
    for (seconds, ttl) in [(i64::MAX, 60), (-1, 60), (1, 3)] {
        let mut usage = report("edge", &[("tenant", "bucket")], 0);
        usage.bucket_quota_usages[0].time_elapsed =
            Some(envoy_types::pb::google::protobuf::Duration { seconds, nanos: 0 });
        sender.send(usage).await.unwrap();
        let answer = answers.message().await.unwrap().unwrap();
        let Some(Action::QuotaAssignmentAction(assignment)) = answer.bucket_action[0].bucket_action
        else {
            panic!("{answer:?}")
        };
        assert_eq!(
            assignment.assignment_time_to_live.unwrap().seconds,
            ttl,
            "{seconds}"
        );
    }
    drop(sender);
    server.stop().await;
}

#[tokio::test]
async fn an_rlqs_stream_must_name_its_domain() {
    let server = start("rlqs-domain").await;
    let mut quota = server.quota_client().await;
    let mut answers = quota
        .stream_rate_limit_quotas(tokio_stream::iter(vec![report("", &[("tenant", "a")], 1)]))
        .await
        .unwrap()
        .into_inner();
    let status = answers.message().await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    server.stop().await;
}

#[tokio::test]
async fn sighup_reloads_the_files_and_a_bad_one_changes_nothing() {
    let server = start("reload").await;
    let mut client = server.client().await;
    let a = || call(vec![descriptor(&[("tenant", "a")])]);
    assert_eq!(ask(&mut client, a()).await.statuses[0].limit_remaining, 2);
    // A bad file: refused, the configuration in force stays.
    std::fs::write(
        &server.file,
        "domain: edge\ndescriptors: [{key: tenant, rate_limit: {unit: fortnight}}]\n",
    )
    .unwrap();
    let error = server.rls.reload().unwrap_err().to_string();
    assert!(
        error.contains("invalid rate limit unit `fortnight`"),
        "{error}"
    );
    assert_eq!(ask(&mut client, a()).await.statuses[0].limit_remaining, 1);
    // A good one: in force at once (another limit, another counter).
    std::fs::write(
        &server.file,
        CONFIG.replace("requests_per_unit: 3}", "requests_per_unit: 7}"),
    )
    .unwrap();
    let config = server.rls.reload().unwrap();
    assert_eq!(config.domains(), ["edge"]);
    assert_eq!(ask(&mut client, a()).await.statuses[0].limit_remaining, 6);
    server.stop().await;
}

/// A descriptor with its own `hits_addend`.
fn costing(entries: &[(&str, &str)], hits: u64) -> RateLimitDescriptor {
    RateLimitDescriptor {
        hits_addend: Some(UInt64Value { value: hits }),
        ..descriptor(entries)
    }
}

/// Issue 41, item 1: a budget spent by costs known after the response, as Envoy Gateway's
/// response costs and Envoy's `apply_on_stream_done` spend it: the request is checked
/// (`hits_addend: 0`), its cost charged when the stream ends. On a budget of 5 an hour,
/// six requests costing 4 each: before, every check was OK and a charge that did not fit
/// counted nothing (6 passed, 24 served); now, as envoyproxy/ratelimit, a charge always
/// counts and a check is refused once the budget is spent (2 passed, 8 counted).
#[tokio::test]
async fn post_hoc_costs_are_checked_then_counted_as_envoyproxy_ratelimit_does() {
    let server = start("post-hoc").await;
    let mut client = server.client().await;
    let (mut passed, mut served) = (0, 0);
    let mut charges = Vec::new();
    for _ in 0..6 {
        let check = ask(&mut client, call(vec![costing(&[("budget", "t1")], 0)])).await;
        if check.overall_code == OK {
            passed += 1;
            served += 4;
            // The stream ended: its cost is charged (Envoy ignores this answer).
            let charge = ask(&mut client, call(vec![costing(&[("budget", "t1")], 4)])).await;
            charges.push(charge.overall_code);
        }
    }
    eprintln!("budget 5/hour, 6 requests of cost 4: {passed} passed, {served} served");
    assert_eq!((passed, served), (2, 8));
    // The second charge went past the limit: counted anyway, and said so.
    assert_eq!(charges, [OK, OVER]);
    let after = ask(&mut client, call(vec![costing(&[("budget", "t1")], 0)])).await;
    assert_eq!(
        (after.overall_code, after.statuses[0].limit_remaining),
        (OVER, 0)
    );
    assert!(after.statuses[0].duration_until_reset.is_some());

    // Requests in flight together: both checked while 1 was left, both charged: 5 + 4
    // counted, the budget spent.
    for _ in 0..2 {
        let check = ask(&mut client, call(vec![costing(&[("budget", "t2")], 0)])).await;
        assert_eq!(check.overall_code, OK);
    }
    let first = ask(&mut client, call(vec![costing(&[("budget", "t2")], 4)])).await;
    let second = ask(&mut client, call(vec![costing(&[("budget", "t2")], 4)])).await;
    assert_eq!((first.overall_code, second.overall_code), (OK, OVER));
    assert_eq!(
        ask(&mut client, call(vec![costing(&[("budget", "t2")], 0)]))
            .await
            .overall_code,
        OVER
    );

    // A charge refused by another descriptor still counts (envoyproxy/ratelimit counts
    // every descriptor of a call); a request counted one each stays all or nothing (Diana's
    // promise: a refused request charges none of its descriptors).
    let mixed = ask(
        &mut client,
        call(vec![
            costing(&[("budget", "t3")], 3),
            descriptor(&[("tenant", "blocked")]),
        ]),
    )
    .await;
    assert_eq!(codes(&mixed), (OVER, vec![OK, OVER]));
    let left = ask(&mut client, call(vec![costing(&[("budget", "t3")], 0)])).await;
    assert_eq!(left.statuses[0].limit_remaining, 2, "the 3 were counted");
    let plain = ask(
        &mut client,
        call(vec![
            descriptor(&[("budget", "t4")]),
            descriptor(&[("tenant", "blocked")]),
        ]),
    )
    .await;
    assert_eq!(plain.overall_code, OVER);
    let untouched = ask(&mut client, call(vec![costing(&[("budget", "t4")], 0)])).await;
    assert_eq!(untouched.statuses[0].limit_remaining, 5, "nothing charged");

    // A cost above the wire's largest want (100,000) is counted whole, in pieces.
    let big = ask(
        &mut client,
        call(vec![costing(&[("tokens", "u")], 250_000)]),
    )
    .await;
    assert_eq!(
        (big.overall_code, big.statuses[0].limit_remaining),
        (OK, 750_000)
    );
    server.stop().await;
}

/// Issue 41, item 2: `quota_mode` (soft limits: the call is refused only when every quota
/// descriptor is over; each over one says so in its status) and the answer's dynamic
/// metadata (`--rls-response-metadata`), as envoyproxy/ratelimit's example
/// `service_1`/`service_2` quota routing uses them.
#[tokio::test]
async fn quota_mode_is_soft_and_the_metadata_names_what_passed() {
    let server = start("quota").await;
    server.rls.clone().with_response_metadata(true);
    let mut client = server.client().await;
    let both = || {
        call(vec![
            descriptor(&[("service", "service_1")]),
            descriptor(&[("service", "service_2")]),
        ])
    };
    let names = |response: &RateLimitResponse| -> Vec<String> {
        use envoy_types::pb::google::protobuf::value::Kind;
        let Some(metadata) = &response.dynamic_metadata else {
            return Vec::new();
        };
        let Some(Kind::StructValue(merged)) = metadata
            .fields
            .get("metadata")
            .and_then(|value| value.kind.clone())
        else {
            return Vec::new();
        };
        let Some(Kind::StructValue(service)) = merged
            .fields
            .get("service_with_quota")
            .and_then(|value| value.kind.clone())
        else {
            return Vec::new();
        };
        match service
            .fields
            .get("name")
            .and_then(|value| value.kind.clone())
        {
            Some(Kind::StringValue(name)) => vec![name],
            _ => Vec::new(),
        }
    };
    // Both within their limits: OK, the first one's metadata first.
    let first = ask(&mut client, both()).await;
    assert_eq!(codes(&first), (OK, vec![OK, OK]));
    assert_eq!(names(&first), ["service_1"]);
    let metadata = first.dynamic_metadata.clone().unwrap();
    assert!(metadata.fields.contains_key("domain") && metadata.fields.contains_key("descriptors"));
    // Merged: service_2's other keys join service_1's.
    assert!(
        format!("{:?}", metadata.fields["metadata"]).contains("\"tier\""),
        "{metadata:?}"
    );
    // service_1 over: its status says so, the call is OK, the metadata is service_2's.
    let second = ask(&mut client, both()).await;
    assert_eq!(codes(&second), (OK, vec![OVER, OK]));
    assert_eq!(names(&second), ["service_2"]);
    // Both over: refused.
    let third = ask(&mut client, both()).await;
    assert_eq!(codes(&third), (OVER, vec![OVER, OVER]));
    assert!(names(&third).is_empty());
    // A quota descriptor does not soften an ordinary one.
    let mixed = ask(
        &mut client,
        call(vec![
            descriptor(&[("service", "service_1")]),
            descriptor(&[("tenant", "blocked")]),
        ]),
    )
    .await;
    assert_eq!(mixed.overall_code, OVER);
    server.stop().await;
}

/// `--rls-headers ratelimit`: envoyproxy/ratelimit's `RateLimit-Limit`, `-Remaining` and
/// `-Reset` (`LIMIT_RESPONSE_HEADERS_ENABLED`), on admitted and refused answers alike.
#[tokio::test]
async fn envoyproxy_ratelimit_headers_are_one_more_choice() {
    let store = Arc::new(MemoryStore::with_capacity(Arc::new(SystemClock), 100));
    let server = start_with(
        "ratelimit-headers",
        store,
        Auth::insecure(),
        HeaderStyle::Ratelimit,
        Settings::default(),
    )
    .await;
    let mut client = server.client().await;
    let headers = |response: &RateLimitResponse| -> Vec<(String, String)> {
        response
            .response_headers_to_add
            .iter()
            .map(|header| (header.key.clone(), header.value.clone()))
            .collect()
    };
    let first = ask(&mut client, call(vec![descriptor(&[("tenant", "a")])])).await;
    let found = headers(&first);
    assert_eq!(
        found.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
        ["ratelimit-limit", "ratelimit-remaining", "ratelimit-reset"]
    );
    assert_eq!((found[0].1.as_str(), found[1].1.as_str()), ("3", "2"));
    let reset: u64 = found[2].1.parse().unwrap();
    assert!((1..=3600).contains(&reset));
    for _ in 0..2 {
        ask(&mut client, call(vec![descriptor(&[("tenant", "a")])])).await;
    }
    let refused = ask(&mut client, call(vec![descriptor(&[("tenant", "a")])])).await;
    assert_eq!(refused.overall_code, OVER);
    let found = headers(&refused);
    assert_eq!(
        found.len(),
        3,
        "no Retry-After: envoyproxy/ratelimit sends none"
    );
    assert_eq!(
        found[1],
        ("ratelimit-remaining".to_string(), "0".to_string())
    );
    server.stop().await;
}

/// Issue 41, item 2: envoyproxy/ratelimit's own example and test configurations
/// (`tests/fixtures/envoyproxy-ratelimit`, copied as they are) load, and match as they do
/// there; the ones its tests refuse are refused.
#[test]
fn envoyproxy_ratelimit_configuration_files_load_as_they_are() {
    use diana_quota::rls::config::{Lookup, RuleKind};
    let fixtures =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/envoyproxy-ratelimit");
    let keys = rls::CounterKeys::public();
    let mut loaded = 0;
    for entry in std::fs::read_dir(fixtures.join("good")).unwrap() {
        let file = entry.unwrap().path();
        if file.extension().is_some_and(|ext| ext == "yaml") {
            let config = rls::load(std::slice::from_ref(&file), &keys)
                .unwrap_or_else(|error| panic!("{}: {error}", file.display()));
            assert_eq!(config.domains().len(), 1);
            loaded += 1;
        }
    }
    assert_eq!(loaded, 13);
    let good = |name: &str| fixtures.join("good").join(name);
    let matched = |config: &rls::RlsConfig, domain: &str, entries: &[(&str, &str)]| match config
        .lookup(domain, entries)
    {
        Lookup::Matched(found) => Some((found.rule.clone(), found.key)),
        _ => None,
    };

    // The example: quota_mode, metadata, replaces, shadow_mode, detailed_metric, unlimited.
    let example = rls::load(&[good("examples__ratelimit__config__example.yaml")], &keys).unwrap();
    let (service, _) = matched(&example, "rl", &[("service", "service_2")]).unwrap();
    assert!(service.quota && service.metadata.is_some());
    assert_eq!(service.requests_per_unit, 2);
    let (shady, _) = matched(&example, "rl", &[("foo", "x"), ("baz", "shady")]).unwrap();
    assert!(shady.shadow);
    let (banned, _) = matched(&example, "rl", &[("foo", "x"), ("bar", "banned")]).unwrap();
    assert!(matches!(banned.kind, RuleKind::Blocked));
    assert_eq!(banned.name.as_deref(), Some("banned_limit"));
    let (over, _) = matched(
        &example,
        "rl",
        &[
            ("source_cluster", "proxy"),
            ("destination_cluster", "override"),
        ],
    )
    .unwrap();
    assert_eq!(over.replaces, ["banned_limit"]);
    let (unspec, _) = matched(&example, "rl", &[("unspec", "x")]).unwrap();
    assert!(unspec.detailed_metric);
    let (bay, _) = matched(&example, "rl", &[("foo", "x"), ("bay", "y")]).unwrap();
    assert!(matches!(bay.kind, RuleKind::Unlimited));

    // Wildcards: trailing, middle, several; a value without a star matches only itself.
    let wildcard = rls::load(&[good("test__config__wildcard.yaml")], &keys).unwrap();
    for (entries, expected) in [
        (vec![("wild", "foo1")], Some(20)),
        (vec![("wild", "bar")], None),
        (vec![("noWild", "foo1")], None),
        (vec![("midWild", "barab")], Some(20)),
        (vec![("midWild", "bar123b")], Some(20)),
        (vec![("midWild", "barabc")], None),
        (vec![("multiWild", "foo1bar2baz")], Some(10)),
        (vec![("multiWild", "foobarba")], None),
        (vec![("nestedWild", "val1"), ("wild", "goo2")], Some(20)),
    ] {
        assert_eq!(
            matched(&wildcard, "test-domain", &entries).map(|(rule, _)| rule.requests_per_unit),
            expected,
            "{entries:?}"
        );
    }
    // Each wildcard match counts apart, unless share_threshold.
    let (_, one) = matched(&wildcard, "test-domain", &[("wild", "foo1")]).unwrap();
    let (_, two) = matched(&wildcard, "test-domain", &[("wild", "foo2")]).unwrap();
    assert_ne!(one, two);
    let shared = rls::load(&[good("test__config__share_threshold.yaml")], &keys).unwrap();
    let key = |entries: &[(&str, &str)]| {
        matched(&shared, "test-domain", entries).map(|(rule, key)| (rule.requests_per_unit, key))
    };
    let (a, b) = (
        key(&[("files", "files/a.pdf")]).unwrap(),
        key(&[("files", "files/b.csv")]).unwrap(),
    );
    assert_eq!((a.0, &a.1), (100, &b.1));
    let (x, y) = (
        key(&[
            ("user", "user/1"),
            ("resource", "res/a"),
            ("action", "read"),
        ])
        .unwrap(),
        key(&[
            ("user", "user/2"),
            ("resource", "res/b"),
            ("action", "read"),
        ])
        .unwrap(),
    );
    assert_eq!((x.0, &x.1), (150, &y.1));
    // An explicit value comes before a wildcard.
    assert_eq!(key(&[("file", "test1")]).unwrap().0, 50);
    assert_eq!(key(&[("file", "test2")]).unwrap().0, 100);

    // The metadata file: nested maps become the answer's metadata.
    let metadata = rls::load(&[good("test__config__metadata.yaml")], &keys).unwrap();
    let (service, _) = matched(&metadata, "test-domain", &[("key2", "x")]).unwrap();
    assert!(service
        .metadata
        .unwrap()
        .fields
        .contains_key("service_with_quota"));

    // What envoyproxy/ratelimit refuses, refused.
    for entry in std::fs::read_dir(fixtures.join("refused")).unwrap() {
        let file = entry.unwrap().path();
        let files = if file.ends_with("test__config__duplicate_domain.yaml") {
            vec![good("test__config__basic_config.yaml"), file.clone()]
        } else {
            vec![file.clone()]
        };
        let error = rls::load(&files, &keys).expect_err(&file.display().to_string());
        assert!(
            error
                .to_string()
                .contains(file.file_name().unwrap().to_str().unwrap()),
            "{error}"
        );
    }
    let merged = rls::load(
        &[
            good("test__config__merge_domain_key1.yaml"),
            good("test__config__merge_domain_key2.yaml"),
        ],
        &keys,
    );
    assert!(matches!(
        merged,
        Err(rls::ConfigError::DuplicateDomain { .. })
    ));
}

/// Issue 41, item 2: the counters of descriptors are keyed with the deployment's RLS key:
/// another key, other counters; no key, the public one (and not the unkeyed XXH3 of
/// before).
#[test]
fn rls_counter_keys_are_keyed_with_the_deployment_key() {
    use diana_quota::rls::config::Lookup;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("edge.yaml");
    std::fs::write(&file, CONFIG).unwrap();
    let key_of = |keys: &rls::CounterKeys| {
        let config = rls::load(std::slice::from_ref(&file), keys).unwrap();
        match config.lookup("edge", &[("remote_address", "203.0.113.7")]) {
            Lookup::Matched(found) => found.key,
            other => panic!("{other:?}"),
        }
    };
    let ours =
        rls::CounterKeys::with_secret("a-deployment-rls-key-of-32-bytes-or-more", "t").unwrap();
    let theirs =
        rls::CounterKeys::with_secret("another-deployment-key-32-bytes-or-more", "t").unwrap();
    let public = rls::CounterKeys::public();
    assert_eq!(key_of(&ours), key_of(&ours));
    assert_ne!(key_of(&ours), key_of(&theirs));
    assert_ne!(key_of(&ours), key_of(&public));
    let mut bytes = Vec::new();
    for text in ["edge", "remote_address", "203.0.113.7"] {
        bytes.extend_from_slice(&u32::try_from(text.len()).unwrap().to_le_bytes());
        bytes.extend_from_slice(text.as_bytes());
    }
    let unkeyed = format!("rls:{:032x}", xxhash_rust::xxh3::xxh3_128(&bytes));
    assert_ne!(key_of(&public), unkeyed);
    // From a file; too short a key is refused.
    let key_file = dir.path().join("rls.key");
    std::fs::write(&key_file, "short\n").unwrap();
    assert!(matches!(
        rls::CounterKeys::from_sources(Some(&key_file), None),
        Err(rls::KeyError::TooShort { .. })
    ));
    std::fs::write(&key_file, "a-deployment-rls-key-of-32-bytes-or-more\n").unwrap();
    assert_eq!(
        key_of(&rls::CounterKeys::from_sources(Some(&key_file), None).unwrap()),
        key_of(&ours)
    );
}

#[test]
fn the_rls_flags_go_together() {
    use clap::Parser;
    let parse = |args: &[&str]| {
        diana_quota::Cli::try_parse_from(std::iter::once("diana-quota").chain(args.iter().copied()))
            .unwrap()
    };
    assert!(parse(&[]).rls_config().unwrap().is_none());
    assert!(matches!(
        parse(&["--rls-listen", "127.0.0.1:0"]).rls_config(),
        Err(StartError::RlsListenWithoutConfig)
    ));
    assert!(matches!(
        parse(&["--rls-config", "/nonexistent.yaml"]).rls_config(),
        Err(StartError::RlsConfigWithoutListen)
    ));
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.yaml"), dir.path().join("b.yaml"));
    std::fs::write(&a, "domain: a\n").unwrap();
    std::fs::write(&b, "domain: b\n").unwrap();
    let both = format!("{},{}", a.display(), b.display());
    let cli = parse(&[
        "--rls-listen",
        "127.0.0.1:0",
        "--rls-config",
        &both,
        "--rls-headers",
        "ietf",
    ]);
    assert_eq!(cli.rls_config().unwrap().unwrap().domains(), ["a", "b"]);
    assert_eq!(cli.rls_headers, HeaderStyle::Ietf);
    assert!(!cli.rls_insecure_no_auth);
    let error = parse(&[
        "--rls-listen",
        "127.0.0.1:0",
        "--rls-config",
        &format!("{}", dir.path().join("c.yaml").display()),
    ])
    .rls_config()
    .unwrap_err();
    assert!(matches!(error, StartError::RlsConfig(_)), "{error}");
    assert!(error.to_string().starts_with("--rls-config "), "{error}");
}
