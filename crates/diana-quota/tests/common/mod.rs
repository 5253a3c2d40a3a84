//! Test support: real `redis-server` processes on free loopback ports (stopped by PID when
//! dropped, their log printed when the test failed), a 3-master Redis Cluster, and helpers
//! to call the service in-process.
#![cfg(test)]
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use diana_core::wire::{AcquireRequest, AcquireResponse, RuleRequest, RuleResult};
use diana_quota::auth::{parse_secrets, Auth};
use diana_quota::store::{MemoryStore, RedisOptions, RedisStore, RedisTarget, Store};
use diana_quota::{app, AppState, Settings};
use http_body_util::BodyExt;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower::ServiceExt;

// ---------------------------------------------------------------------------------------
// Redis processes.

/// The `redis-server` binary; a missing one fails the test (it is a declared dependency).
pub fn redis_server_binary() -> PathBuf {
    which("redis-server").unwrap_or_else(|| {
        panic!(
            "redis-server not found on PATH: these tests need a real Redis \
             (Debian: apt-get install -y redis-server); refusing to skip them"
        )
    })
}

fn redis_cli_binary() -> PathBuf {
    which("redis-cli").unwrap_or_else(|| {
        panic!("redis-cli not found on PATH (Debian: apt-get install -y redis-tools); refusing to skip")
    })
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// A loopback port nobody listens on (and, for cluster nodes, whose bus port +10000 is free too).
pub fn free_port(with_bus: bool) -> u16 {
    for _ in 0..200 {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        if !with_bus {
            return port;
        }
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free port found");
}

static SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// One `redis-server` child process.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    /// Its `--dir` (log, cluster config); removed when the server is dropped, after
    /// [`Drop`] has stopped the process (fields drop after `drop` returns).
    dir: tempfile::TempDir,
    cluster: bool,
}

impl RedisServer {
    /// A fresh server on a free port.
    pub fn start() -> RedisServer {
        RedisServer::start_on(free_port(false), false)
    }

    /// A server on `port` (`cluster`: with `--cluster-enabled yes`).
    pub fn start_on(port: u16, cluster: bool) -> RedisServer {
        let mut server = RedisServer {
            port,
            child: None,
            dir: tempfile::tempdir().unwrap(),
            cluster,
        };
        server.spawn();
        server
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("redis.log")
    }

    fn spawn(&mut self) {
        let mut command = Command::new(redis_server_binary());
        command
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .arg("--logfile")
            .arg(self.log_path());
        if self.cluster {
            command
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
                .arg("--cluster-config-file")
                .arg(self.dir.path().join("nodes.conf"));
        }
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(command.spawn().expect("start redis-server"));
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            if ping(self.port) {
                return;
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!(
                    "redis-server on port {} exited with {status}:\n{}",
                    self.port,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "redis-server on port {} did not answer PING within 10 s:\n{}",
            self.port,
            self.log()
        );
    }

    /// Kills the server (SIGKILL to its PID) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port (after [`RedisServer::kill`]).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Sends a signal (e.g. `STOP`, `CONT`) to this server's PID.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("running").id();
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal} {pid}");
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path())
            .unwrap_or_else(|error| format!("(no log: {error})"))
    }

    /// Runs `redis-cli -p <port> <args>` and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        redis_cli(self.port, args)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "---- redis-server :{} log ({}) ----\n{}",
                self.port,
                self.log_path().display(),
                self.log()
            );
        }
    }
}

pub fn redis_cli(port: u16, args: &[&str]) -> String {
    let output = Command::new(redis_cli_binary())
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run redis-cli");
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// True when something on `port` answers `PING` with `+PONG`.
fn ping(port: u16) -> bool {
    let Ok(mut stream) =
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(100))
    else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buffer = [0u8; 16];
    matches!(stream.read(&mut buffer), Ok(n) if buffer[..n].starts_with(b"+PONG"))
}

/// Three masters, no replicas, every slot assigned.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start() -> RedisCluster {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| RedisServer::start_on(free_port(true), true))
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port))
            .collect();
        let mut args: Vec<&str> = vec!["--cluster", "create"];
        args.extend(addresses.iter().map(String::as_str));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"]);
        let output = redis_cli(nodes[0].port, &args);
        let cluster = RedisCluster { nodes };
        let started = Instant::now();
        loop {
            let ready = cluster.nodes.iter().all(|node| {
                let info = node.cli(&["cluster", "info"]);
                info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
            });
            if ready {
                return cluster;
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "cluster did not become ready; redis-cli --cluster create said:\n{output}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|node| format!("127.0.0.1:{}", node.port))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }
}

// ---------------------------------------------------------------------------------------
// Stores and the service in-process.

/// Timeouts for tests: longer than the service's defaults (20 ms), so that a test machine
/// busy with other tests does not turn a slow answer into a 503.
pub fn test_options() -> RedisOptions {
    RedisOptions {
        connect_timeout: Duration::from_millis(250),
        response_timeout: Duration::from_millis(250),
        ..RedisOptions::default()
    }
}

pub fn redis_store(url: &str) -> RedisStore {
    RedisStore::new(&RedisTarget::parse(url).unwrap(), test_options()).unwrap()
}

pub fn memory_store() -> MemoryStore {
    MemoryStore::default()
}

/// Settings for tests: the defaults, with a deadline that covers [`test_options`].
pub fn test_settings() -> Settings {
    Settings {
        deadline: Duration::from_millis(800),
        ..Settings::default()
    }
}

/// The secret of the in-process services of the tests (every request helper sends it).
pub const TEST_TOKEN: &str = "test-secret-0123456789abcdef0123456789";

/// `authorization` with [`TEST_TOKEN`].
pub fn bearer() -> String {
    format!("Bearer {TEST_TOKEN}")
}

/// Authentication accepting [`TEST_TOKEN`] only.
pub fn test_auth() -> Auth {
    Auth::with_secrets(&parse_secrets(TEST_TOKEN, "test").unwrap()).unwrap()
}

/// The service's router around a store, as `diana-quota` builds it (with [`test_auth`]).
pub fn service(store: Arc<dyn Store>) -> Router {
    app(AppState::new(store, test_settings(), test_auth()))
}

/// The in-process quota service of `diana simulate`, the worker's `Sim` and the engine's
/// tests (diana-core's `MemoryQuota`, over the same decision table as the memory store)
/// behind the service's routes, on the system clock: the scenarios run against it too, so
/// that it cannot decide otherwise than the service. A `/v1/wait` answer is held as long
/// as the service would hold it.
pub fn simulated_service() -> Router {
    use diana_core::call::{Answer, Answered, Callout};
    use diana_core::quota::MemoryQuota;
    use diana_quota::store::{Clock, SystemClock};
    let quota = Arc::new(std::sync::Mutex::new(MemoryQuota::new()));
    Router::new().fallback(move |request: Request<Body>| {
        let quota = quota.clone();
        async move {
            let (parts, body) = request.into_parts();
            let body = axum::body::to_bytes(body, usize::MAX)
                .await
                .unwrap()
                .to_vec();
            let mut headers = vec![(":path", parts.uri.path().to_string())];
            if let Some(timeout) = parts.headers.get(diana_core::wire::TIMEOUT_HEADER) {
                headers.push((
                    diana_core::wire::TIMEOUT_HEADER,
                    timeout.to_str().unwrap().to_string(),
                ));
            }
            let callout = Callout {
                upstream: "diana_quota".to_string(),
                headers,
                body,
                timeout_ms: 0,
            };
            let held = quota
                .lock()
                .unwrap()
                .answer_held(&callout, SystemClock.now());
            tokio::time::sleep(Duration::from_nanos(held.held.get())).await;
            let Answer::Answered(Answered {
                status,
                body: Ok(body),
                ..
            }) = held.reply
            else {
                panic!("{:?}", held.reply)
            };
            axum::http::Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .body(Body::from(body))
                .unwrap()
        }
    })
}

/// A unique key for one counter of one test.
pub fn unique_key(tag: &str) -> String {
    format!(
        "{tag}-{}-{}:00ff",
        std::process::id(),
        SEQUENCE.fetch_add(1, Ordering::Relaxed)
    )
}

pub fn rule(
    key: &str,
    algo: &str,
    rpu: u32,
    unit: &str,
    burst: u32,
    slices: u32,
    want: u32,
) -> RuleRequest {
    RuleRequest {
        place: None,
        key: key.to_string(),
        algo: algo.to_string(),
        rpu,
        unit: unit.to_string(),
        burst,
        slices,
        want,
        cost: 1,
        max_delay_ms: None,
        dry_run: false,
        period: None,
    }
}

/// Sends a raw request; returns the status, content type and body.
pub async fn send(router: &Router, request: Request<Body>) -> (StatusCode, String, Vec<u8>) {
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|value| value.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body = response
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec();
    (status, content_type, body)
}

/// A POST of JSON with the test's credential.
pub fn post_json(path: &str, body: impl Into<Body>) -> Request<Body> {
    Request::builder()
        .method("POST")
        .uri(path)
        .header("content-type", "application/json")
        .header("authorization", bearer())
        .body(body.into())
        .unwrap()
}

/// POSTs rules; returns the status and the body as text.
pub async fn post_rules(
    router: &Router,
    path: &str,
    rules: Vec<RuleRequest>,
) -> (StatusCode, String) {
    let body = serde_json::to_vec(&AcquireRequest::new(rules)).unwrap();
    let (status, _, body) = send(router, post_json(path, body)).await;
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// POSTs rules to `/v1/acquire` and expects 200.
pub async fn acquire(router: &Router, rules: Vec<RuleRequest>) -> Vec<RuleResult> {
    let (status, body) = post_rules(router, "/v1/acquire", rules).await;
    assert_eq!(status, StatusCode::OK, "body: {body}");
    serde_json::from_str::<AcquireResponse>(&body)
        .unwrap()
        .results
}

/// One rule, one answer.
pub async fn acquire_one(router: &Router, rule: RuleRequest) -> RuleResult {
    acquire(router, vec![rule]).await.remove(0)
}

/// Milliseconds since the epoch (the test machine's clock, which is also Redis's).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Waits until `now` is at least `margin` away from the end of the current `unit_ms`
/// window, so that a test counting inside one window does not straddle two.
pub async fn away_from_boundary(unit_ms: u64, margin: Duration) {
    let into = now_ms() % unit_ms;
    let left = unit_ms - into;
    if left < margin.as_millis() as u64 {
        tokio::time::sleep(Duration::from_millis(left + 5)).await;
    }
}

// ---------------------------------------------------------------------------------------
// Every scenario × every store.

/// Runs each scenario (`async fn(&Router)`, in scope where the macro is used) against the
/// memory store, a fresh Redis each, and one Redis Cluster (three processes) for all.
#[macro_export]
macro_rules! suite {
    ($($scenario:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    let router = $crate::common::service(std::sync::Arc::new($crate::common::memory_store()));
                    super::$scenario(&router).await;
                }
            )*
        }

        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    let server = $crate::common::RedisServer::start();
                    let router = $crate::common::service(std::sync::Arc::new($crate::common::redis_store(&server.url())));
                    super::$scenario(&router).await;
                    drop(server);
                }
            )*
        }

        /// One cluster (three processes) for the whole suite.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn cluster_runs_the_suite() {
            let cluster = $crate::common::RedisCluster::start();
            let router = $crate::common::service(std::sync::Arc::new($crate::common::redis_store(&cluster.url())));
            $(
                eprintln!("cluster: {}", stringify!($scenario));
                $scenario(&router).await;
            )*
            drop(cluster);
        }
    };
}
