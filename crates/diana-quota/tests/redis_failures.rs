//! Redis going away, hanging, restarting, forgetting its scripts: the service answers 503
//! fast, never hangs, and recovers by itself. Plus the key layout (hash tags, TTLs).

#![cfg(test)]

mod common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use common::*;
use diana_core::wire::{AcquireResponse, RuleRequest, RuleResult};
use diana_quota::store::{cluster_slot, RedisOptions, RedisStore, RedisTarget};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

async fn healthz(router: &Router) -> (StatusCode, String) {
    let (status, _, body) =
        send(router, Request::get("/readyz").body(Body::empty()).unwrap()).await;
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// Polls until a request is answered 200 (counters may have been lost with the restart).
async fn until_recovered(router: &Router, key: &str, within: Duration) -> Duration {
    let probe = rule(key, "TB", 1000, "hour", 1000, 10, 1);
    until_answered(router, probe, within).await.0
}

/// Sends `request` until it is answered 200 (503 meanwhile): how long that took, and the
/// answer.
async fn until_answered(
    router: &Router,
    request: RuleRequest,
    within: Duration,
) -> (Duration, RuleResult) {
    let started = Instant::now();
    loop {
        let (status, body) = post_rules(router, "/v1/acquire", vec![request.clone()]).await;
        if status == StatusCode::OK {
            let mut answer: AcquireResponse = serde_json::from_str(&body).unwrap();
            return (started.elapsed(), answer.results.remove(0));
        }
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(
            started.elapsed() < within,
            "not recovered within {within:?}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every request while Redis is down is answered 503 within 1 s.
async fn expect_fast_503(router: &Router, key: &str, requests: usize) {
    for _ in 0..requests {
        let started = Instant::now();
        let (status, body) = post_rules(
            router,
            "/v1/acquire",
            vec![rule(key, "TB", 10, "hour", 10, 10, 1)],
        )
        .await;
        let took = started.elapsed();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(body.contains("store unavailable"), "{body}");
        assert!(took < Duration::from_secs(1), "503 took {took:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_redis_gives_fast_503_and_a_restart_recovers() {
    let mut server = RedisServer::start();
    let router = service(Arc::new(redis_store(&server.url())));
    let key = unique_key("kill");
    assert!(
        acquire_one(&router, rule(&key, "TB", 10, "hour", 10, 10, 1))
            .await
            .allowed
    );
    assert_eq!(
        healthz(&router).await,
        (StatusCode::OK, "ready".to_string())
    );

    server.kill();
    expect_fast_503(&router, &key, 5).await;
    let (status, body) = healthz(&router).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body.starts_with("store unavailable"), "{body}");

    server.restart();
    let took = until_recovered(&router, &key, Duration::from_secs(5)).await;
    eprintln!("recovered {took:?} after the restart");
    assert_eq!(healthz(&router).await.0, StatusCode::OK);

    // Metrics saw the failures.
    let (_, _, body) = send(
        &router,
        Request::get("/metrics").body(Body::empty()).unwrap(),
    )
    .await;
    let text = String::from_utf8(body).unwrap();
    assert!(
        text.contains("diana_quota_store_errors_total{kind=\"unavailable\"}"),
        "{text}"
    );
    assert!(
        text.contains("diana_quota_http_requests_total{path=\"/v1/acquire\",status=\"503\"}"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_redis_gives_fast_503_and_recovers() {
    let server = RedisServer::start();
    let router = service(Arc::new(redis_store(&server.url())));
    let key = unique_key("stop");
    assert!(
        acquire_one(&router, rule(&key, "TB", 10, "hour", 10, 10, 1))
            .await
            .allowed
    );

    server.signal("STOP");
    {
        // Resumes the server even if an assertion fails.
        let _resume = Resume(&server);
        expect_fast_503(&router, &key, 3).await;
        let started = Instant::now();
        assert_eq!(healthz(&router).await.0, StatusCode::SERVICE_UNAVAILABLE);
        assert!(started.elapsed() < Duration::from_secs(1));
    }
    until_recovered(&router, &key, Duration::from_secs(5)).await;
    // The counter survived (the server was only paused): 1 + 1 taken of 10, plus each
    // request that timed out (503) while its command sat in the paused server's socket:
    // the connection is kept across response timeouts, so those run when the server
    // resumes. A Redis timeout never means "not counted".
    let result = acquire_one(&router, rule(&key, "TB", 10, "hour", 10, 10, 100)).await;
    assert!((5..=8).contains(&result.granted), "{result:?}");
}

/// Sends SIGCONT to a stopped server when dropped.
struct Resume<'a>(&'a RedisServer);

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        self.0.signal("CONT");
    }
}

/// A TCP proxy to a Redis server, with two faults on the connections open at the time:
/// they go silent for good — no byte forwarded either way, never closed — (a half-open
/// connection: a peer gone without FIN or RST, a NAT that lost the flow), or they lose
/// the next answer and are closed (the command ran; its client never hears). New
/// connections work. Threads of the test process; a frozen connection's threads hold it
/// until the end.
struct FaultyProxy {
    port: u16,
    faults: Arc<Faults>,
}

#[derive(Default)]
struct Faults {
    /// Connections with an id below this are frozen.
    frozen_below: AtomicU64,
    /// Connections with an id below this lose their next answer and are closed.
    cut_below: AtomicU64,
    next_id: AtomicU64,
}

impl FaultyProxy {
    fn start(target: u16) -> FaultyProxy {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let faults = Arc::new(Faults::default());
        let shared = faults.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(upstream) = std::net::TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
                for (from, to, answers) in [
                    (
                        client.try_clone().unwrap(),
                        upstream.try_clone().unwrap(),
                        false,
                    ),
                    (upstream, client, true),
                ] {
                    let faults = shared.clone();
                    std::thread::spawn(move || pump(from, to, id, answers, &faults));
                }
            }
        });
        FaultyProxy { port, faults }
    }

    /// Every connection open now goes silent for good.
    fn silence_open_connections(&self) -> u64 {
        let open = self.faults.next_id.load(Ordering::SeqCst);
        self.faults.frozen_below.store(open, Ordering::SeqCst);
        open
    }

    /// Every connection open now loses the next answer it carries, and is closed.
    fn cut_open_connections_at_their_next_answer(&self) -> u64 {
        let open = self.faults.next_id.load(Ordering::SeqCst);
        self.faults.cut_below.store(open, Ordering::SeqCst);
        open
    }

    fn connections(&self) -> u64 {
        self.faults.next_id.load(Ordering::SeqCst)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

/// Copies `from` to `to` for connection `id`; `answers`: this is the direction from Redis.
fn pump(
    mut from: std::net::TcpStream,
    mut to: std::net::TcpStream,
    id: u64,
    answers: bool,
    faults: &Faults,
) {
    use std::io::{Read, Write};
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => {
                let _ = to.shutdown(std::net::Shutdown::Write);
                return;
            }
            Ok(n) => n,
        };
        while id < faults.frozen_below.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(50)); // silent, and holding both sockets
        }
        if answers && id < faults.cut_below.load(Ordering::SeqCst) {
            let _ = from.shutdown(std::net::Shutdown::Both);
            let _ = to.shutdown(std::net::Shutdown::Both);
            return;
        }
        if to.write_all(&buf[..n]).is_err() {
            return;
        }
    }
}

/// A connection whose peer went silent without closing times out on every command and
/// TCP never reports it broken: it must be replaced once it has answered nothing for
/// `dead_after`, or the service answers 503 for ever while a new connection would work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_gone_silent_is_replaced() {
    let server = RedisServer::start();
    let proxy = FaultyProxy::start(server.port);
    let options = RedisOptions {
        dead_after: Duration::from_millis(600),
        ..test_options()
    };
    let store = RedisStore::new(&RedisTarget::parse(&proxy.url()).unwrap(), options).unwrap();
    let router = service(Arc::new(store));
    let key = unique_key("silent");
    assert!(
        acquire_one(&router, rule(&key, "TB", 10, "hour", 10, 10, 1))
            .await
            .allowed
    );
    assert_eq!(proxy.silence_open_connections(), 1);
    let (status, body) = post_rules(
        &router,
        "/v1/acquire",
        vec![rule(&key, "TB", 10, "hour", 10, 10, 1)],
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    // Timeouts of 250 ms each until the connection has been silent 600 ms, then a new one.
    let took = until_recovered(&router, &key, Duration::from_secs(5)).await;
    assert!(took < Duration::from_secs(2), "recovered after {took:?}");
    assert_eq!(proxy.connections(), 2, "one new connection");
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_at_start_then_up() {
    let port = free_port(false);
    let router = service(Arc::new(redis_store(&format!("redis://127.0.0.1:{port}"))));
    let key = unique_key("late");
    expect_fast_503(&router, &key, 3).await;
    assert_eq!(healthz(&router).await.0, StatusCode::SERVICE_UNAVAILABLE);
    let server = RedisServer::start_on(port, false);
    until_recovered(&router, &key, Duration::from_secs(5)).await;
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_flush_is_survived_without_double_charging() {
    let server = RedisServer::start();
    let router = service(Arc::new(redis_store(&server.url())));
    away_from_boundary(3_600_000, Duration::from_secs(5)).await;
    let (tb, w, sw, lb) = (
        unique_key("f-tb"),
        unique_key("f-w"),
        unique_key("f-sw"),
        unique_key("f-lb"),
    );
    let rules = |want: u32| {
        vec![
            rule(&tb, "TB", 10, "hour", 10, 10, want),
            rule(&w, "W", 10, "hour", 10, 10, want),
            rule(&sw, "SW", 10, "hour", 10, 6, want),
            rule(&lb, "LB", 10, "hour", 9, 10, want),
        ]
    };
    let first = acquire(&router, rules(3)).await;
    assert!(first.iter().all(|result| result.granted == 3), "{first:?}");
    assert!(server.cli(&["SCRIPT", "FLUSH"]).contains("OK"));
    // Every script is gone: each rule is re-run once after loading, never twice.
    let second = acquire(&router, rules(3)).await;
    assert!(
        second.iter().all(|result| result.granted == 3),
        "{second:?}"
    );
    let third = acquire(&router, rules(10)).await;
    let granted: Vec<u32> = third.iter().map(|result| result.granted).collect();
    assert_eq!(granted, [4, 4, 4, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_carry_a_hash_tag_and_a_ttl() {
    let server = RedisServer::start();
    let router = service(Arc::new(redis_store(&server.url())));
    let key = unique_key("ttl");
    let denied_key = unique_key("ttl-denied");
    let rules = vec![
        rule(&key, "TB", 10, "second", 10, 10, 1),
        rule(&key, "W", 10, "minute", 10, 10, 1),
        rule(&key, "SW", 10, "hour", 10, 6, 1),
        rule(&key, "LB", 10, "day", 3, 10, 1),
    ];
    assert!(acquire(&router, rules)
        .await
        .iter()
        .all(|result| result.allowed));
    let keys = server.cli(&["--scan", "--pattern", "diana:*"]);
    let mut keys: Vec<&str> = keys.lines().collect();
    keys.sort_unstable();
    let expected: Vec<String> = [
        "LB:10:day:3:10",
        "SW:10:hour:10:6",
        "TB:10:second:10:10",
        "W:10:minute:10:10",
    ]
    .iter()
    .map(|params| format!("diana:{{{key}}}:{params}"))
    .collect();
    assert_eq!(keys, expected);
    // TTL: until the state is idle again, plus one second.
    let ttl = |name: &str| server.cli(&["PTTL", name]).trim().parse::<i64>().unwrap();
    let limits = [
        ("TB:10:second:10:10", 100, 1_100),
        ("W:10:minute:10:10", 1_000, 61_000),
        ("SW:10:hour:10:6", 1_000, 3_601_000),
        ("LB:10:day:3:10", 1_000, 9_640_000),
    ];
    for (algo, low, high) in limits {
        let pttl = ttl(&format!("diana:{{{key}}}:{algo}"));
        assert!(
            pttl > low && pttl <= high,
            "{algo}: PTTL {pttl} not in ({low}, {high}]"
        );
    }
    // A debt pushes the expiry further: 15 tokens of 100 ms owed, full again in 1.5 s.
    let debt_key = unique_key("ttl-debt");
    let (status, body) = post_rules(
        &router,
        "/v1/charge",
        vec![rule(&debt_key, "TB", 10, "second", 10, 10, 15)],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let pttl = ttl(&format!("diana:{{{debt_key}}}:TB:10:second:10:10"));
    assert!(
        pttl > 2_000 && pttl <= 2_500,
        "PTTL {pttl}: must cover the 1.5 s debt + 1 s"
    );
    // A denied request writes nothing (and creates no key).
    let _ = acquire(&router, vec![rule(&denied_key, "W", 1, "hour", 1, 10, 1)]).await;
    let before = server.cli(&["HGETALL", &format!("diana:{{{denied_key}}}:W:1:hour:1:10")]);
    let denied = acquire(&router, vec![rule(&denied_key, "W", 1, "hour", 1, 10, 1)]).await;
    assert!(!denied[0].allowed);
    assert_eq!(
        server.cli(&["HGETALL", &format!("diana:{{{denied_key}}}:W:1:hour:1:10")]),
        before
    );
}

/// The Redis key of a counter is bound to its parameters: requests with the same key and
/// other parameters (the old script read a window of seconds, or a bucket of 1 per day,
/// over an hour's state and wrote it back: a reset) leave the original key exactly as it
/// was, value and expiry, and get keys of their own, in the same cluster slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_parameters_leave_the_original_redis_key_unchanged() {
    let server = RedisServer::start();
    let router = service(Arc::new(redis_store(&server.url())));
    away_from_boundary(3_600_000, Duration::from_secs(5)).await;
    let key = unique_key("bound");
    let window = rule(&key, "W", 3, "hour", 3, 10, 3);
    let bucket = rule(&key, "TB", 10, "hour", 10, 10, 10);
    assert_eq!(acquire_one(&router, window.clone()).await.granted, 3);
    assert_eq!(acquire_one(&router, bucket.clone()).await.granted, 10);
    let originals = [
        format!("diana:{{{key}}}:W:3:hour:3:10"),
        format!("diana:{{{key}}}:TB:10:hour:10:10"),
    ];
    let snapshot = || {
        originals
            .iter()
            .map(|name| {
                let fields = server.cli(&["HGETALL", name]);
                let expiry = server.cli(&["PEXPIRETIME", name]);
                assert!(!fields.trim().is_empty(), "{name} missing");
                (fields, expiry)
            })
            .collect::<Vec<_>>()
    };
    let before = snapshot();
    let mut others = Vec::new();
    for unit in ["second", "minute", "day"] {
        let mut w = window.clone();
        (w.unit, w.want) = (unit.to_string(), 1);
        others.push(w);
    }
    let mut per_day = bucket.clone();
    (per_day.rpu, per_day.unit, per_day.burst, per_day.want) = (1, "day".to_string(), 1, 1);
    others.push(per_day);
    let mut deeper = bucket.clone();
    (deeper.burst, deeper.want) = (240, 1);
    others.push(deeper);
    for other in &others {
        let result = acquire_one(&router, other.clone()).await;
        assert!(result.allowed, "{other:?}: {result:?}");
    }
    let mut debt = window.clone();
    (debt.rpu, debt.want) = (100, 50);
    let (status, body) = post_rules(&router, "/v1/charge", vec![debt]).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(snapshot(), before, "an original key changed");
    // The others have keys of their own, all in the rule key's slot.
    let keys = server.cli(&["--scan", "--pattern", &format!("diana:{{{key}}}:*")]);
    assert_eq!(keys.lines().count(), 2 + others.len() + 1, "{keys}");
    for name in keys.lines() {
        // Redis hashes the bytes between the first `{` and the next `}`: the rule key.
        let tag = name
            .split_once('{')
            .and_then(|(_, rest)| rest.split_once('}'));
        assert_eq!(tag.map(|(tag, _)| tag), Some(key.as_str()), "{name}");
    }
    // And the originals still deny.
    assert!(
        !acquire_one(&router, rule(&key, "W", 3, "hour", 3, 10, 1))
            .await
            .allowed
    );
    assert!(
        !acquire_one(&router, rule(&key, "TB", 10, "hour", 10, 10, 1))
            .await
            .allowed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_survives_script_flush_and_spreads_keys() {
    let cluster = RedisCluster::start();
    let router = service(Arc::new(redis_store(&cluster.url())));
    let keys = keys_on_every_node();
    let rules = |want: u32| {
        keys.iter()
            .map(|key| rule(key, "TB", 10, "hour", 10, 10, want))
            .collect::<Vec<_>>()
    };
    assert!(acquire(&router, rules(4))
        .await
        .iter()
        .all(|result| result.granted == 4));
    for node in &cluster.nodes {
        assert!(node.cli(&["SCRIPT", "FLUSH"]).contains("OK"));
    }
    assert!(acquire(&router, rules(4))
        .await
        .iter()
        .all(|result| result.granted == 4));
    assert!(acquire(&router, rules(4))
        .await
        .iter()
        .all(|result| result.granted == 2));
    // The keys live on more than one master.
    let holding = cluster
        .nodes
        .iter()
        .filter(|node| node.cli(&["DBSIZE"]).trim().parse::<u64>().unwrap_or(0) > 0)
        .count();
    assert!(holding >= 2, "all 12 keys on one node");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_node_killed_gives_fast_503() {
    let mut cluster = RedisCluster::start();
    let router = service(Arc::new(redis_store(&cluster.url())));
    let keys = keys_on_every_node();
    let rules = || {
        keys.iter()
            .map(|key| rule(key, "TB", 1000, "hour", 1000, 10, 1))
            .collect::<Vec<_>>()
    };
    assert_eq!(acquire(&router, rules()).await.len(), 12);
    cluster.nodes[1].kill();
    for _ in 0..3 {
        let started = Instant::now();
        let (status, body) = post_rules(&router, "/v1/acquire", rules()).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "took {:?}",
            started.elapsed()
        );
    }
    cluster.nodes[1].restart();
    let started = Instant::now();
    loop {
        let (status, body) = post_rules(&router, "/v1/acquire", rules()).await;
        if status == StatusCode::OK {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "cluster not recovered: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Twelve keys, four in each third of the slot space: `redis-cli --cluster create` gives
/// each of the three masters one third, so whichever node is killed holds four of them.
fn keys_on_every_node() -> Vec<String> {
    let mut thirds: [Vec<String>; 3] = Default::default();
    while thirds.iter().any(|keys| keys.len() < 4) {
        let key = unique_key("down");
        let third = match cluster_slot(&key) {
            0..=5460 => 0,
            5461..=10922 => 1,
            _ => 2,
        };
        if thirds[third].len() < 4 {
            thirds[third].push(key);
        }
    }
    thirds.concat()
}

/// The store's slot of a rule key (`diana:{<key>}:<ALGO>`: CRC16 of the key, modulo 16384).
#[test]
fn cluster_slots_match_redis() {
    // `CLUSTER KEYSLOT foo` is 12182, `somekey` 11058 (Redis documentation).
    assert_eq!(cluster_slot("foo"), 12182);
    assert_eq!(cluster_slot("somekey"), 11058);
    assert_eq!(cluster_slot("123456789"), 0x31C3); // the CRC-16/XMODEM check value
                                                   // Redis's hash tag ends at the first `}`: a key holding one is placed by its prefix.
    assert_eq!(cluster_slot("foo}bar"), cluster_slot("foo"));
}

/// A script whose answer is lost has run (its charge stands) and must not run again:
/// Redis cannot tell a retry from a new request, so a second run charges twice. The
/// cluster client may retry a command (one retry, for redirects); a connection that drops
/// after the script ran must give 503 and one charge, and the next request a new
/// connection. One node holding every slot, which announces the proxy's port, so that
/// the client reaches it only through the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_a_lost_answer_is_not_run_again() {
    let node = RedisServer::start_on(free_port(true), true);
    assert!(node
        .cli(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"])
        .contains("OK"));
    let proxy = FaultyProxy::start(node.port);
    let announced = proxy.port.to_string();
    for (option, value) in [
        ("cluster-announce-ip", "127.0.0.1"),
        ("cluster-announce-port", announced.as_str()),
    ] {
        assert!(node.cli(&["CONFIG", "SET", option, value]).contains("OK"));
    }
    let started = Instant::now();
    while !node.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok") {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "cluster not ok"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(node
        .cli(&["CLUSTER", "SLOTS"])
        .lines()
        .any(|line| line.trim() == announced));
    let url = format!("redis+cluster://127.0.0.1:{}", proxy.port);
    let router = service(Arc::new(redis_store(&url)));
    let key = unique_key("lost");
    let ten = |want: u32| rule(&key, "TB", 10, "hour", 10, 10, want);
    assert_eq!(acquire_one(&router, ten(1)).await.granted, 1);
    let open = proxy.cut_open_connections_at_their_next_answer();
    assert!(open >= 1);
    let (status, body) = post_rules(&router, "/v1/acquire", vec![ten(1)]).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    // The lost run took its token; nothing else did: 10 − 1 − 1 are left.
    let (_, left) = until_answered(&router, ten(10), Duration::from_secs(5)).await;
    assert_eq!(left.granted, 8, "{left:?}");
    assert!(proxy.connections() > open, "a new connection");
}
