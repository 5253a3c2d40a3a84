//! The `diana-quota` binary: flags and environment, serving, graceful shutdown.

#![cfg(test)]

mod common;

use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The service as a child process, killed by PID if still running when dropped.
struct Service {
    child: Child,
    port: u16,
}

/// The binary with a clean slate: no secret (nor store, nor address) inherited from the
/// test's environment.
fn command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_diana-quota"));
    command
        .env_remove("DIANA_QUOTA_TOKEN")
        .env_remove("DIANA_QUOTA_TOKEN_FILE")
        .env_remove("DIANA_QUOTA_VIEW_TOKEN_FILE")
        .env_remove("DIANA_QUOTA_REDIS")
        .env_remove("DIANA_QUOTA_LISTEN");
    command
}

/// The environment that gives the service [`TEST_TOKEN`].
fn with_token() -> (&'static str, String) {
    ("DIANA_QUOTA_TOKEN", TEST_TOKEN.to_string())
}

impl Service {
    fn start(env: &[(&str, String)]) -> Service {
        Service::start_with(&[], env)
    }

    fn start_with(args: &[&str], env: &[(&str, String)]) -> Service {
        let port = free_port(false);
        let mut command = command();
        command
            .args(args)
            .env("DIANA_QUOTA_LISTEN", format!("127.0.0.1:{port}"))
            .envs(env.iter().map(|(name, value)| (*name, value.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut service = Service {
            child: command.spawn().unwrap(),
            port,
        };
        let started = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Some(status) = service.child.try_wait().unwrap() {
                let mut log = String::new();
                let _ = service
                    .child
                    .stderr
                    .take()
                    .unwrap()
                    .read_to_string(&mut log);
                panic!("diana-quota exited with {status}:\n{log}");
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "diana-quota did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        service
    }

    /// One HTTP/1.1 exchange with the test's secret; the status code and the body.
    fn http(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        let auth = bearer();
        let (code, _, body) = self.exchange(method, path, body, Some(&auth));
        (code, body)
    }

    /// One HTTP/1.1 exchange with this `authorization` (or none); the status code, the
    /// head (lower case) and the body.
    fn exchange(
        &self,
        method: &str,
        path: &str,
        body: &str,
        authorization: Option<&str>,
    ) -> (u16, String, String) {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let auth = authorization
            .map(|value| format!("authorization: {value}\r\n"))
            .unwrap_or_default();
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nhost: diana-quota\r\ncontent-type: application/json\r\n\
             {auth}content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        let code = answer.split(' ').nth(1).unwrap().parse().unwrap();
        let (head, body) = answer
            .split_once("\r\n\r\n")
            .map(|(head, body)| (head.to_string(), body.to_string()))
            .unwrap_or_default();
        (code, head.to_ascii_lowercase(), body)
    }

    /// Sends a signal (`HUP`, `TERM`, …) to the service's PID.
    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// SIGTERM, then the exit status and what was logged.
    fn terminate(mut self) -> (bool, String) {
        self.signal("TERM");
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let mut log = String::new();
                self.child
                    .stderr
                    .take()
                    .unwrap()
                    .read_to_string(&mut log)
                    .unwrap();
                return (status.success(), log);
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "no exit within 5 s of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// These tests pick free ports by binding port 0 and releasing it; run concurrently, two
/// of them could be handed the same port before either binds it (a Redis of one test then
/// answers the other's HTTP with a reset). One at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

const BODY: &str = r#"{"rules":[{"key":"ab:cd","algo":"W","rpu":1,"unit":"hour","burst":1,"slices":10,"want":1}]}"#;

#[test]
fn serves_memory_store_and_stops_on_sigterm() {
    let _serial = serial();
    let service = Service::start(&[with_token()]);
    assert_eq!(service.http("GET", "/healthz", ""), (200, "ok".to_string()));
    let (code, body) = service.http("POST", "/v1/acquire", BODY);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#""allowed":true"#), "{body}");
    let (code, body) = service.http("POST", "/v1/acquire", BODY);
    assert_eq!(code, 200);
    assert!(body.contains(r#""allowed":false"#), "{body}");
    let (code, body) = service.http("GET", "/metrics", "");
    assert_eq!(code, 200);
    assert!(body.contains("diana_quota_decisions_total"), "{body}");
    let (clean, log) = service.terminate();
    assert!(clean, "exit status not 0; log:\n{log}");
    assert!(log.contains("SIGTERM"), "{log}");
}

#[test]
fn serves_redis_from_the_environment() {
    let _serial = serial();
    let server = RedisServer::start();
    let service = Service::start(&[("DIANA_QUOTA_REDIS", server.url()), with_token()]);
    let (code, body) = service.http("POST", "/v1/acquire", BODY);
    assert_eq!(code, 200, "{body}");
    assert!(server
        .cli(&["--scan", "--pattern", "diana:*"])
        .contains("diana:{ab:cd}:W:1:hour:1:10"));
    let (clean, log) = service.terminate();
    assert!(clean, "{log}");
    assert!(
        log.contains(&format!("redis://127.0.0.1:{}", server.port)),
        "{log}"
    );
}

#[test]
fn refuses_a_bad_redis_url() {
    let _serial = serial();
    let output = command()
        .args([
            "--listen",
            "127.0.0.1:0",
            "--redis",
            "mysql://x",
            "--insecure-no-auth",
        ])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("unsupported Redis URL"), "{stderr}");
}

// ---------------------------------------------------------------------------------------
// Authentication.

/// Runs the binary, which must refuse to start: its exit status and what it printed.
fn refused(args: &[&str], env: &[(&str, String)]) -> (std::process::ExitStatus, String) {
    let port = free_port(false);
    let mut child = command()
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(args)
        .envs(env.iter().map(|(name, value)| (*name, value.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut log = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut log)
                .unwrap();
            return (status, log);
        }
        if started.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("diana-quota {args:?} started instead of refusing");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

const SECOND: &str = "second-secret-abcdefghijklmnopqrstuvwxyz0123";

#[test]
fn refuses_to_start_without_a_secret() {
    let _serial = serial();
    let (status, log) = refused(&[], &[]);
    assert!(!status.success());
    for name in ["--token-file", "DIANA_QUOTA_TOKEN", "--insecure-no-auth"] {
        assert!(log.contains(name), "{name} not named:\n{log}");
    }
    // An empty variable is no secret either.
    let (status, log) = refused(&[], &[("DIANA_QUOTA_TOKEN", String::new())]);
    assert!(!status.success());
    assert!(log.contains("DIANA_QUOTA_TOKEN: no secret"), "{log}");
}

#[test]
fn refuses_a_secret_shorter_than_32_bytes() {
    let _serial = serial();
    let short = "short-secret-0123456789abcdefgh"; // 31 bytes
    assert_eq!(short.len(), 31);
    let (status, log) = refused(&[], &[("DIANA_QUOTA_TOKEN", short.to_string())]);
    assert!(!status.success());
    assert!(log.contains("at least 32 bytes"), "{log}");
    assert!(!log.contains(short), "the secret was printed:\n{log}");
    // Mode 600: `NamedTempFile` creates it so on unix.
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(&file, format!("{TEST_TOKEN}\n{short}\n")).unwrap();
    let path = file.path().to_str().unwrap();
    let (status, log) = refused(&["--token-file", path], &[]);
    assert!(!status.success());
    assert!(
        log.contains(&format!(
            "--token-file {path}: line 2: a secret must be at least 32 bytes"
        )),
        "{log}"
    );
    assert!(!log.contains(short) && !log.contains(TEST_TOKEN), "{log}");
    let (status, log) = refused(&["--token-file", "/nonexistent/diana-token"], &[]);
    assert!(!status.success());
    assert!(
        log.contains("--token-file /nonexistent/diana-token"),
        "{log}"
    );
}

#[test]
fn there_is_no_flag_that_takes_the_secret() {
    let _serial = serial();
    for flag in ["--token", "--secret", "--auth-token"] {
        for args in [
            vec![flag.to_string(), TEST_TOKEN.to_string()],
            vec![format!("{flag}={TEST_TOKEN}")],
        ] {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let (status, log) = refused(&args, &[]);
            assert!(!status.success(), "{args:?}");
            assert!(log.contains("unexpected argument"), "{args:?}:\n{log}");
        }
    }
    // And --insecure-no-auth next to a secret is a contradiction.
    let (status, log) = refused(&["--insecure-no-auth"], &[with_token()]);
    assert!(!status.success());
    assert!(log.contains("choose one"), "{log}");
}

#[test]
fn unauthorized_requests_get_401_and_change_no_counter() {
    let _serial = serial();
    let service = Service::start(&[with_token()]);
    let wrong = format!("Bearer {SECOND}");
    for path in ["/v1/acquire", "/v1/wait", "/v1/charge"] {
        for authorization in [None, Some(wrong.as_str())] {
            let (code, head, body) = service.exchange("POST", path, BODY, authorization);
            assert_eq!(code, 401, "{path} {authorization:?}: {body}");
            assert!(head.contains("www-authenticate: bearer"), "{head}");
            assert_eq!(body, r#"{"error":"unauthorized"}"#);
        }
    }
    // Nothing was counted: the one token of the hour is still there.
    let (code, body) = service.http("POST", "/v1/acquire", BODY);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#""allowed":true"#), "{body}");
    let (_, body) = service.http("POST", "/v1/acquire", BODY);
    assert!(body.contains(r#""allowed":false"#), "{body}");
    // Health and metrics are open, and name no key.
    let (code, _, _) = service.exchange("GET", "/healthz", "", None);
    assert_eq!(code, 200);
    let (code, _, metrics) = service.exchange("GET", "/metrics", "", None);
    assert_eq!(code, 200);
    for line in [
        "diana_quota_unauthorized_total{reason=\"missing\"} 3",
        "diana_quota_unauthorized_total{reason=\"invalid\"} 3",
        "diana_quota_auth_required 1",
    ] {
        assert!(metrics.contains(line), "{line} not in:\n{metrics}");
    }
    assert!(!metrics.contains("ab:cd"), "{metrics}");
    let (clean, log) = service.terminate();
    assert!(clean, "{log}");
    assert!(!log.contains(TEST_TOKEN), "the secret was logged:\n{log}");
}

#[test]
fn a_token_file_of_two_lines_accepts_both_and_sighup_reloads_it() {
    let _serial = serial();
    // Mode 600: `NamedTempFile` creates it so on unix; rewriting it in place keeps the mode.
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(&file, format!("{TEST_TOKEN}\n{SECOND}\n")).unwrap();
    let service = Service::start_with(&["--token-file", file.path().to_str().unwrap()], &[]);
    let body = |key: &str| BODY.replace("ab:cd", key);
    let as_ = |token: &str, key: &str| {
        service
            .exchange(
                "POST",
                "/v1/acquire",
                &body(key),
                Some(&format!("Bearer {token}")),
            )
            .0
    };
    assert_eq!(as_(TEST_TOKEN, "one"), 200);
    assert_eq!(as_(SECOND, "two"), 200);
    assert_eq!(as_("third-secret-abcdefghijklmnopqrstuvwxyz", "three"), 401);
    // Rotation, last step: the old secret leaves the file; SIGHUP.
    std::fs::write(&file, format!("{SECOND}\n")).unwrap();
    service.signal("HUP");
    let started = Instant::now();
    while as_(TEST_TOKEN, "four") != 401 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the old secret is still accepted after SIGHUP"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(as_(SECOND, "five"), 200);
    // A broken file changes nothing.
    std::fs::write(&file, "short\n").unwrap();
    service.signal("HUP");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(as_(SECOND, "six"), 200);
    let (clean, log) = service.terminate();
    assert!(clean, "{log}");
    assert!(log.contains("SIGHUP: token file reloaded"), "{log}");
    assert!(
        log.contains("the secrets accepted so far stay in force"),
        "{log}"
    );
    assert!(
        !log.contains(TEST_TOKEN) && !log.contains(SECOND),
        "a secret was logged:\n{log}"
    );
}

#[test]
fn insecure_no_auth_serves_anyone_and_says_so() {
    let _serial = serial();
    let service = Service::start_with(&["--insecure-no-auth"], &[]);
    let (code, _, body) = service.exchange("POST", "/v1/acquire", BODY, None);
    assert_eq!(code, 200, "{body}");
    let (clean, log) = service.terminate();
    assert!(clean, "{log}");
    assert!(log.contains("AUTHENTICATION IS OFF"), "{log}");
}

const VIEW_SECRET: &str = "read-only-view-secret-0123456789abcdef";

#[test]
fn the_view_has_its_own_read_only_secret_and_sighup_reloads_it() {
    let _serial = serial();
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(&file, format!("{VIEW_SECRET}\n")).unwrap();
    let service = Service::start_with(
        &["--view-token-file", file.path().to_str().unwrap()],
        &[with_token()],
    );
    let view = |token: &str| {
        service
            .exchange("GET", "/v1/view", "", Some(&format!("Bearer {token}")))
            .0
    };
    assert_eq!(view(VIEW_SECRET), 200);
    assert_eq!(view(TEST_TOKEN), 200, "the gateways' secret reads it too");
    assert_eq!(view(SECOND), 401);
    // Read-only: the view's secret decides nothing.
    let (code, _, _) = service.exchange(
        "POST",
        "/v1/acquire",
        BODY,
        Some(&format!("Bearer {VIEW_SECRET}")),
    );
    assert_eq!(code, 401);
    std::fs::write(&file, format!("{SECOND}\n")).unwrap();
    service.signal("HUP");
    let started = Instant::now();
    while view(VIEW_SECRET) != 401 {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the old view secret is still accepted after SIGHUP"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(view(SECOND), 200);
    let (clean, log) = service.terminate();
    assert!(clean, "{log}");
    assert!(log.contains("SIGHUP: view token file reloaded"), "{log}");
    assert!(
        !log.contains(VIEW_SECRET) && !log.contains(SECOND) && !log.contains(TEST_TOKEN),
        "a secret was logged:\n{log}"
    );
}

#[test]
fn without_authentication_the_view_stays_closed_unless_opened_by_name() {
    let _serial = serial();
    let service = Service::start_with(&["--insecure-no-auth"], &[]);
    let auth = bearer();
    assert_eq!(service.exchange("GET", "/v1/view", "", None).0, 401);
    assert_eq!(service.exchange("GET", "/v1/view", "", Some(&auth)).0, 401);
    let (clean, log) = service.terminate();
    assert!(clean, "{log}");
    assert!(
        log.contains("the fleet view (GET /v1/view) is closed"),
        "{log}"
    );
    let service = Service::start_with(&["--insecure-no-auth", "--insecure-open-view"], &[]);
    let (code, _, body) = service.exchange("GET", "/v1/view", "", None);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"gateways\":[]"), "{body}");
    let (clean, log) = service.terminate();
    assert!(clean, "{log}");
    assert!(log.contains("--insecure-open-view"), "{log}");
    let (status, log) = refused(
        &["--insecure-open-view", "--view-token-file", "/nonexistent"],
        &[with_token()],
    );
    assert!(!status.success());
    assert!(log.contains("choose one"), "{log}");
}
