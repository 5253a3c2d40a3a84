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

impl Service {
    fn start(env: &[(&str, String)]) -> Service {
        let port = free_port(false);
        let mut command = Command::new(env!("CARGO_BIN_EXE_diana-quota"));
        command
            .env("DIANA_QUOTA_LISTEN", format!("127.0.0.1:{port}"))
            .envs(env.iter().map(|(name, value)| (*name, value.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let service = Service {
            child: command.spawn().unwrap(),
            port,
        };
        let started = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "diana-quota did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        service
    }

    /// One HTTP/1.1 exchange; returns the status line's code and the body.
    fn http(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nhost: diana-quota\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).unwrap();
        let code = answer.split(' ').nth(1).unwrap().parse().unwrap();
        let body = answer
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_string())
            .unwrap_or_default();
        (code, body)
    }

    /// SIGTERM, then the exit status and what was logged.
    fn terminate(mut self) -> (bool, String) {
        let status = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success());
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
    let service = Service::start(&[]);
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
    let service = Service::start(&[("DIANA_QUOTA_REDIS", server.url())]);
    let (code, body) = service.http("POST", "/v1/acquire", BODY);
    assert_eq!(code, 200, "{body}");
    assert!(server
        .cli(&["--scan", "--pattern", "diana:*"])
        .contains("diana:{ab:cd}:W"));
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
    let output = Command::new(env!("CARGO_BIN_EXE_diana-quota"))
        .args(["--listen", "127.0.0.1:0", "--redis", "mysql://x"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("unsupported Redis URL"), "{stderr}");
}
