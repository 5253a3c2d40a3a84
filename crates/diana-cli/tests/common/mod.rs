//! What the tests of the `diana` binary share: running it as users do, and reading what
//! it printed.

use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// Runs `diana args`, with `stdin` on its standard input.
pub fn diana(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_diana"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        let mut pipe = child.stdin.take().unwrap();
        if let Some(text) = stdin {
            // A command that fails before reading its input closes the pipe: the write
            // then fails, and the exit status is what the test looks at.
            let _ = pipe.write_all(text.as_bytes());
        }
    }
    child.wait_with_output().unwrap()
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// `diana check --json` of `document`, which must be accepted.
pub fn check_json(document: &str) -> Value {
    let out = diana(&["check", "--json", "-"], Some(document));
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}
