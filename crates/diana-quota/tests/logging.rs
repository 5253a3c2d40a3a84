//! What the `diana-quota` binary writes for an operator: logs without terminal colour codes
//! when they go to a file or a pipe, and a `--help` that names every `--redis` form the
//! service accepts (issue 22, item 4).

#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Command, Stdio};

/// The binary with nothing inherited that would change what it does: no secret, store or
/// address, and no colour preference (`NO_COLOR` alone would hide the bug this guards).
fn command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_diana-quota"));
    for name in [
        "DIANA_QUOTA_TOKEN",
        "DIANA_QUOTA_TOKEN_FILE",
        "DIANA_QUOTA_REDIS",
        "DIANA_QUOTA_LISTEN",
        "NO_COLOR",
    ] {
        command.env_remove(name);
    }
    command.stdin(Stdio::null());
    command
}

#[test]
fn redirected_logs_carry_no_ansi_colour_codes() {
    // Without a secret the service refuses to start: its log line (tracing, level ERROR)
    // goes to stderr, which here is a pipe, as when it is redirected to a file.
    let output = command()
        .args(["--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let log = String::from_utf8_lossy(&output.stderr);
    assert!(log.contains("ERROR"), "no tracing line to check:\n{log}");
    assert!(
        !log.contains('\u{1b}'),
        "colour codes in a redirected log:\n{}",
        log.escape_debug()
    );
}

#[test]
fn help_names_the_redis_url_with_a_password() {
    let output = command().arg("--help").output().unwrap();
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    // The forms docs/wire-format.md documents (`RedisTarget::parse` reads them).
    for form in [
        "redis://[user:password@]host:port[/db]",
        "redis+cluster://[user:password@]h1:p1,h2:p2",
    ] {
        assert!(help.contains(form), "--help lacks `{form}`:\n{help}");
    }
}
