//! `diana simulate`, run as users run it, on small hand-written logs whose every count is
//! worked out in the comments.

#![cfg(test)]

use serde_json::Value;
use std::process::{Command, Output, Stdio};
use tempfile::TempDir;

/// Runs `diana simulate POLICY LOG ARGS...` from files holding `policy` and `log`, in a
/// directory of its own (removed when the returned [`TempDir`] is dropped).
fn simulate(policy: &str, log: &[u8], args: &[&str]) -> (Output, TempDir) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policy.yaml"), policy).unwrap();
    std::fs::write(dir.path().join("requests.log"), log).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_diana"))
        .current_dir(dir.path())
        .args(["simulate", "policy.yaml", "requests.log"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (out, dir)
}

/// Standard output of a run that must succeed.
fn stdout_of(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}, stderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// 2026-01-01T00:00:00Z.
const T0: &str = "1767225600";

/// A local token bucket per device on every path, a dry-run window and a leaky bucket on
/// /post, a global window on /g.
const POLICY: &str = "\
resources:
  - Url: /
    rules:
      - {name: per_device, actor: device, algo: TB, rpu: 2, unit: second, burst: 2}
  - Url: /post
    rules:
      - {name: probe, algo: W, rpu: 1, unit: second, dry_run: true}
      - {name: pace, algo: LB, rpu: 2, unit: second, burst: 2}
  - Url: /g
    rules:
      - {name: glob, algo: W, rpu: 2, unit: second, scope: global}
";

/// Both formats, both kinds of JSON time, one malformed line.
fn mixed_log() -> String {
    let lines = [
        // d1: the bucket of 2 admits two, the third finds 0.4 token.
        r#"{"ts": "2026-01-01T00:00:00.100Z", "method": "GET", "path": "/a", "headers": {"x-device-id": "d1"}}"#.to_string(),
        r#"{"ts": "2026-01-01T00:00:00.200Z", "path": "/a", "headers": {"x-device-id": "d1"}}"#.to_string(),
        r#"{"ts": "2026-01-01T00:00:00.300Z", "path": "/a", "headers": {"x-device-id": "d1"}}"#.to_string(),
        // Three posts at once: `probe` (1/s, dry run) would reject the last two; `pace`
        // lets the first through, holds the next two for 500 ms and 1 s (queue of 2).
        format!(r#"{{"ts": {T0}.4, "path": "/post", "headers": {{"x-device-id": "d2"}}}}"#),
        format!(r#"{{"ts": {T0}.4, "path": "/post", "headers": {{"x-device-id": "d3"}}}}"#),
        format!(r#"{{"ts": {T0}.4, "path": "/post", "headers": {{"x-device-id": "d4"}}}}"#),
        "not a request".to_string(),
        // The global window of 2 admits two of three; the third's local charge goes back.
        format!(r#"{{"ts": {T0}.5, "path": "/g", "headers": {{"x-device-id": "d5"}}}}"#),
        format!(r#"{{"ts": {T0}.5, "path": "/g", "headers": {{"x-device-id": "d6"}}}}"#),
        format!(r#"{{"ts": {T0}.5, "path": "/g", "headers": {{"x-device-id": "d7"}}}}"#),
        // Envoy's default format; no device id: the device actor falls back to the address.
        r#"[2026-01-01T00:00:01.000Z] "GET /g HTTP/1.1" 200 - 0 2 1 1 "10.0.0.1" "curl/8.0" "9b1f" "api" "127.0.0.1:8080""#.to_string(),
    ];
    lines.join("\n") + "\n"
}

#[test]
fn a_mixed_log_gives_the_exact_table() {
    let (out, _) = simulate(POLICY, mixed_log().as_bytes(), &[]);
    let expected = "\
diana simulate: 10 requests from requests.log through 4 rules, 1 gateway
time: 2026-01-01T00:00:00Z to 2026-01-01T00:00:01Z (2 s)
lines: 11 read, 10 requests (9 JSON, 1 Envoy), 1 malformed
malformed: line 7: neither a JSON object nor an Envoy access-log line (\"[time] ...\")

rules, in evaluation order
rule        scope   algo  actor   limit
per_device  local   TB    device  2/second, burst 2
probe       local   W     all     1/second           dry run
pace        local   LB    all     2/second, queue 2
glob        global  W     all     2/second

per second            rule        admitted  delayed  rejected  dry-run
2026-01-01T00:00:00Z  (all)              5        2         2        2
                      per_device         5        2         1        0
                      probe              1        0         0        2
                      pace               1        2         0        0
                      glob               2        0         1        0
2026-01-01T00:00:01Z  (all)              1        0         0        0
                      per_device         1        0         0        0
                      glob               1        0         0        0

totals      admitted  delayed  rejected  dry-run  max delay  mean delay
per_device         6        2         1        0  1000.0 ms    750.0 ms
probe              1        0         0        2          -           -
pace               1        2         0        0  1000.0 ms    750.0 ms
glob               3        0         1        0          -           -
(all)              6        2         2        2  1000.0 ms    750.0 ms
10 requests: 6 admitted, 2 delayed, 2 rejected; 0 matched no rule; 4 callouts to the simulated quota service
";
    assert_eq!(stdout_of(&out), expected);
}

#[test]
fn json_output_carries_the_same_counts() {
    let (out, _) = simulate(POLICY, mixed_log().as_bytes(), &["--json"]);
    let report: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
    assert_eq!(report["input"]["malformed"], 1);
    assert_eq!(report["input"]["malformed_examples"][0]["line"], 7);
    assert_eq!(report["input"]["envoy"], 1);
    assert_eq!(report["callouts"], 4);
    let all = &report["all"];
    assert_eq!(
        (
            &all["requests"],
            &all["admitted"],
            &all["delayed"],
            &all["rejected"],
            &all["dry_run"]
        ),
        (
            &Value::from(10),
            &Value::from(6),
            &Value::from(2),
            &Value::from(2),
            &Value::from(2)
        )
    );
    assert_eq!(all["delay_max_ms"], 1000.0);
    let names: Vec<&str> = report["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["per_device", "probe", "pace", "glob"]);
    assert_eq!(report["rules"][3]["scope"], "global");
    assert_eq!(report["rules"][1]["dry_run"], true);
    assert_eq!(report["rules"][2]["totals"]["delayed"], 2);
    assert_eq!(report["rules"][2]["totals"]["delay_mean_ms"], 750.0);
    let seconds = report["seconds"].as_array().unwrap();
    assert_eq!(seconds.len(), 2);
    assert_eq!(seconds[0]["time"], "2026-01-01T00:00:00Z");
    assert_eq!(seconds[0]["t"], 1_767_225_600u64);
    assert_eq!(seconds[0]["rules"][3]["rejected"], 1);
    assert_eq!(seconds[1]["all"]["admitted"], 1);
}

#[test]
fn envoy_logs_are_put_back_in_time_order_with_appended_fields() {
    // Envoy writes a line when the request ends: the 00.900 request, which took long,
    // comes after the 01.500 one. `once` admits one request per minute: the earlier.
    let policy = "\
resources:
  - Url: /
    rules:
      - {name: per_device, actor: device, algo: W, rpu: 1, unit: minute}
  - Url: /once
    rules:
      - {name: once, algo: W, rpu: 1, unit: minute}
";
    let line = |time: &str, path: &str, device: &str, address: &str| {
        format!(
            r#"[2026-01-01T00:00:{time}Z] "GET {path} HTTP/1.1" 200 - 0 2 1 1 "-" "curl" "-" "api" "127.0.0.1:8080" "{device}" "{address}""#
        )
    };
    let log = [
        line("01.500", "/once", "a", "10.0.0.1:40000"),
        line("00.900", "/once", "b", "10.0.0.1:40001"),
        // Devices p1 (twice), then no device: the address decides (10.0.0.9 twice).
        line("02.000", "/x", "p1", "10.0.0.2:1"),
        line("02.100", "/x", "p1", "10.0.0.3:1"),
        line("02.200", "/x", "-", "10.0.0.9:5555"),
        line("02.300", "/x", "-", "10.0.0.9:5556"),
        line("02.400", "/x", "-", "10.0.0.8:5555"),
        // Envoy answered before any filter: no request.
        r#"[2026-01-01T00:00:02.500Z] "- - -" 400 DPE 0 11 0 - "-" "-" "-" "-" "-" "-" "-""#
            .to_string(),
    ]
    .join("\n");
    let args = ["--json", "--envoy-field", "x-device-id,client_ip"];
    let (out, _) = simulate(policy, log.as_bytes(), &args);
    let report: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
    assert_eq!(report["input"]["envoy"], 7);
    assert_eq!(report["input"]["no_request"], 1);
    assert_eq!(report["input"]["late"], 0);
    let seconds = report["seconds"].as_array().unwrap();
    // Second 0 (the 00.900 request) admitted by `once`, second 1 rejected.
    assert_eq!(seconds[0]["rules"][1]["admitted"], 1);
    assert_eq!(seconds[1]["rules"][1]["rejected"], 1);
    // p1 once, 10.0.0.9 once, 10.0.0.8 once (and a, b in their own windows).
    let device = &report["rules"][0]["totals"];
    assert_eq!(
        (&device["admitted"], &device["rejected"]),
        (&Value::from(4), &Value::from(2))
    );

    // Without the reordering window the file order rules: the 01.500 request is admitted
    // and the 00.900 one, replayed late, is rejected.
    let mut args = args.to_vec();
    args.extend(["--reorder-seconds", "0"]);
    let (out, _) = simulate(policy, log.as_bytes(), &args);
    let report: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
    assert_eq!(report["input"]["late"], 1);
    assert_eq!(report["seconds"][0]["rules"][1]["rejected"], 1);
    assert_eq!(report["seconds"][1]["rules"][1]["admitted"], 1);

    // The appended fields must be there when asked for: every line is then malformed.
    let (out, _) = simulate(
        policy,
        log.as_bytes(),
        &["--json", "--envoy-field", "x-device-id,client_ip,x-tenant"],
    );
    let report: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
    assert_eq!(report["input"]["malformed"], 8);
    assert_eq!(report["input"]["requests"], 0);
}

#[test]
fn malformed_lines_are_counted_and_the_first_few_named() {
    let mut log = Vec::new();
    log.extend_from_slice(format!("{{\"ts\": {T0}, \"path\": \"/\"}}\n").as_bytes());
    for bad in [
        &b"{\"ts\": \"soon\", \"path\": \"/\"}"[..],
        b"{\"path\": \"/\"}",
        b"{\"ts\": 1, \"path\": \"/\", \"headers\": {\"x\": 5}}",
        b"[2026-01-01T00:00:00Z] \"GET / HTTP/1.1\" 200",
        b"\xff\xfe{ not utf-8",
        b"{\"ts\": 1,",
    ] {
        log.extend_from_slice(bad);
        log.push(b'\n');
    }
    log.extend(std::iter::repeat_n(b'x', (1 << 20) + 1));
    log.extend_from_slice(b"\n\n   \n");
    log.extend_from_slice(format!("{{\"ts\": {T0}.5, \"path\": \"/\"}}").as_bytes());
    let policy = "Url: /\nrules:\n  - {name: all, algo: W, rpu: 1, unit: second}\n";
    let (out, _) = simulate(policy, &log, &[]);
    let stdout = stdout_of(&out);
    for expected in [
        "lines: 11 read, 2 requests (2 JSON, 0 Envoy), 2 blank, 7 malformed\n",
        "malformed: line 2: \"ts\": \"soon\" is not an RFC 3339 time",
        "malformed: line 3: \"ts\": missing\n",
        "malformed: line 4: \"headers\".\"x\": a string expected\n",
        "malformed: line 5: 2 fields after the time, expected 12 (Envoy's default format)\n",
        "malformed: line 6: neither a JSON object nor an Envoy access-log line",
        "malformed: ... and 2 more\n",
        "2 requests: 1 admitted, 0 delayed, 1 rejected;",
    ] {
        assert!(
            stdout.contains(expected),
            "{expected:?} missing in:\n{stdout}"
        );
    }
    let (out, _) = simulate(policy, &log, &["--json"]);
    let report: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
    assert_eq!(report["input"]["malformed"], 7);
    assert_eq!(
        report["input"]["malformed_examples"]
            .as_array()
            .unwrap()
            .len(),
        5
    );
}

#[test]
fn gateways_split_local_counters_and_share_global_ones() {
    let policy = "\
resources:
  - Url: /l
    rules: [{name: local_w, algo: W, rpu: 2, unit: minute}]
  - Url: /g
    rules: [{name: global_w, algo: W, rpu: 3, unit: minute, scope: global, lease: 2}]
";
    // Ten requests on /l, then ten on /g a second later: round robin gives each gateway
    // its share of both.
    let mut log = String::new();
    for (second, path) in [(0, "/l"), (1, "/g")] {
        for i in 0..10 {
            log.push_str(&format!(
                "{{\"ts\": {}.{i}, \"path\": \"{path}\"}}\n",
                1_767_225_600 + second
            ));
        }
    }
    for (gateways, local, global) in [("1", 2, 3), ("2", 4, 3), ("3", 6, 3)] {
        let (out, _) = simulate(policy, log.as_bytes(), &["--json", "--gateways", gateways]);
        let report: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
        assert_eq!(report["gateways"], gateways.parse::<u64>().unwrap());
        assert_eq!(
            report["rules"][0]["totals"]["admitted"], local,
            "{gateways} gateways"
        );
        assert_eq!(
            report["rules"][1]["totals"]["admitted"], global,
            "{gateways} gateways"
        );
        assert_eq!(report["rules"][1]["totals"]["rejected"], 10 - global);
    }
}

#[test]
fn intervals_merge_seconds_and_totals_can_stand_alone() {
    let policy = "Url: /\nrules:\n  - {name: w, algo: W, rpu: 2, unit: second}\n";
    let mut log = String::new();
    for second in 0..6 {
        for k in 0..3 {
            log.push_str(&format!(
                "{{\"ts\": {}.{k}, \"path\": \"/\"}}\n",
                1_767_225_600 + second
            ));
        }
    }
    let (out, _) = simulate(policy, log.as_bytes(), &["--interval", "4"]);
    let stdout = stdout_of(&out);
    assert!(stdout.contains("per 4 s"), "{stdout}");
    // 00..03 (4 seconds: 8 admitted, 4 rejected), then 04..05 (4 and 2).
    assert!(
        stdout.contains("2026-01-01T00:00:00Z  (all)         8        0         4        0\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("2026-01-01T00:00:04Z  (all)         4        0         2        0\n"),
        "{stdout}"
    );
    let (out, _) = simulate(policy, log.as_bytes(), &["--totals"]);
    let stdout = stdout_of(&out);
    assert!(!stdout.contains("per second"), "{stdout}");
    assert!(
        stdout.contains("\nw             12        0         6        0          -           -\n"),
        "{stdout}"
    );
}

#[test]
fn the_chart_has_a_panel_per_rule_and_a_bar_per_count() {
    let (out, dir) = simulate(POLICY, mixed_log().as_bytes(), &["--svg", "chart.svg"]);
    stdout_of(&out);
    let svg = std::fs::read_to_string(dir.path().join("chart.svg")).unwrap();
    assert!(
        svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""),
        "{svg}"
    );
    assert!(svg.trim_end().ends_with("</svg>"));
    for title in [
        ">all requests<",
        ">rule per_device: local TB actor device, 2/second, burst 2<",
        ">rule probe: local W actor all, 1/second, dry run<",
        ">rule pace: local LB actor all, 2/second, queue 2<",
        ">rule glob: global W actor all, 2/second<",
        ">seconds since 2026-01-01T00:00:00Z<",
        ">requests/s<",
    ] {
        assert!(svg.contains(title), "{title} missing");
    }
    // One bar segment per non-zero count (tooltips say which), plus the legend's box.
    let bars = |what: &str| svg.matches(&format!(" {what}</title>")).count();
    // admitted: (all) ×2, per_device ×2, probe, pace, glob ×2; delayed: (all),
    // per_device, pace; rejected: (all), per_device, glob.
    assert_eq!(
        (bars("admitted"), bars("delayed"), bars("rejected")),
        (8, 3, 3)
    );
    assert!(svg.contains("<title>2026-01-01T00:00:00Z: 2 delayed</title>"));
    // The dry-run line: in the all-requests panel and the probe's.
    assert_eq!(
        svg.matches("stroke-dasharray=\"4,3\"/>").count(),
        3,
        "2 lines + the legend"
    );
}

#[test]
fn a_log_on_standard_input_and_the_errors() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policy.yaml"), POLICY).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_diana"))
        .current_dir(dir.path())
        .args(["simulate", "policy.yaml", "-", "--totals"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(mixed_log().as_bytes()).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(stdout_of(&out).contains("10 requests: 6 admitted, 2 delayed, 2 rejected;"));

    // An invalid policy: the filter's message, exit 1.
    let (out, _) = simulate("Url: /\nrules:\n  - {rpu: 0}\n", b"", &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("rpu"));
    // A log that cannot be read, a bad option value: exit 2.
    let out = Command::new(env!("CARGO_BIN_EXE_diana"))
        .current_dir(dir.path())
        .args(["simulate", "policy.yaml", "no-such.log"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read no-such.log"));
    for args in [
        &["--envoy-field", "bad header"][..],
        &["--gateways", "0"],
        &["--reorder-seconds", "-1"],
        &["--format", "csv"],
    ] {
        let (out, _) = simulate(POLICY, b"", args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
    // An empty log is not an error.
    let (out, _) = simulate(POLICY, b"", &[]);
    assert!(stdout_of(&out).contains("0 requests: 0 admitted"));
}

#[test]
fn a_forced_format_reads_every_line_as_that_format() {
    // As JSON, the Envoy line and the bad line are malformed; as Envoy lines, all but one.
    for (format, requests, malformed) in [("jsonl", 9, 2), ("envoy", 1, 10)] {
        let args = ["--format", format, "--json"];
        let (out, _) = simulate(POLICY, mixed_log().as_bytes(), &args);
        let report: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
        let input = &report["input"];
        assert_eq!(input["requests"], requests, "{format}");
        assert_eq!(input["malformed"], malformed, "{format}");
    }
}

#[test]
fn the_logged_answers_settle_counted_statuses_and_reservations() {
    // 5 failed logins an hour per account: the log's statuses say which logins failed.
    // 8 good logins, then 7 wrong: the good ones are given back, 5 wrong ones pass, 2 are
    // rejected. LLM calls reserving 400 of 1000 and using 100 (worked out below).
    let policy = "\
resources:
  - Url: /login
    rules:
      - {name: failed, actor: account, algo: W, unit: hour, rpu: 5, count: {status: [401]}}
  - Url: /llm
    rules:
      - {name: llm, actor: account, algo: TB, unit: hour, rpu: 1000, response_cost: {header: x-llm-tokens, max: 5000, reserve: 400}}
";
    let mut log = String::new();
    for i in 0..15 {
        let status = if i < 8 { 200 } else { 401 };
        log.push_str(&format!(
            "{{\"ts\": {}, \"path\": \"/login\", \"headers\": {{\"x-account-id\": \"a\"}}, \"status\": {status}}}\n",
            1_767_225_600 + i
        ));
    }
    // Each call reserves 400 and its answer settles it to 100 (300 given back): after k
    // calls 1000 - 100·k are left, and a call passes while 400 are: 7 pass, the 8th finds
    // 300 (a second's refill of 1000/hour is a fraction of a token).
    for i in 0..12 {
        log.push_str(&format!(
            "{{\"ts\": {}, \"path\": \"/llm\", \"headers\": {{\"x-account-id\": \"b\"}}, \"status\": 200, \
             \"response_headers\": {{\"X-LLM-Tokens\": \"100\"}}}}\n",
            1_767_225_620 + i
        ));
    }
    let (out, _) = simulate(policy, log.as_bytes(), &["--json"]);
    let report: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
    let totals = |index: usize| {
        let totals = &report["rules"][index]["totals"];
        (totals["admitted"].clone(), totals["rejected"].clone())
    };
    assert_eq!(totals(0), (Value::from(13), Value::from(2)), "{report:#}");
    assert_eq!(totals(1), (Value::from(7), Value::from(5)), "{report:#}");
}

/// A log with the answers' bodies replays an LLM budget charged from their usage: the
/// OpenAI stream's usage settles each call's reservation, as in the gateway.
#[test]
fn answers_bodies_in_the_log_settle_the_usage_they_report() {
    let policy = "Url: /v1/chat/completions\nrules:\n  - {name: llm, actor: account, algo: W, unit: hour, rpu: 1000, response_cost: {usage: openai, reserve: 400}}\n";
    // Each call reserves 400 and reports 100 in its stream: after k calls 1000 - 100·k
    // are left, and a call passes while 400 are: 7 pass, then none.
    let stream = "data: {\\\"usage\\\":null}\\n\\ndata: {\\\"usage\\\":{\\\"prompt_tokens\\\":60,\\\"completion_tokens\\\":40,\\\"total_tokens\\\":100}}\\n\\ndata: [DONE]\\n\\n";
    let mut log = String::new();
    for i in 0..12 {
        log.push_str(&format!(
            "{{\"ts\": {}, \"path\": \"/v1/chat/completions\", \"headers\": {{\"x-account-id\": \"b\"}}, \"status\": 200, \
             \"response_headers\": {{\"content-type\": \"text/event-stream\"}}, \"response_body\": \"{stream}\"}}\n",
            1_767_225_620 + i
        ));
    }
    let (out, _) = simulate(policy, log.as_bytes(), &["--json"]);
    let report: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
    let totals = &report["rules"][0]["totals"];
    assert_eq!(
        (totals["admitted"].clone(), totals["rejected"].clone()),
        (Value::from(7), Value::from(5)),
        "{report:#}"
    );
    // Without the bodies each reservation stands: 2 pass.
    let bare: String = log
        .lines()
        .map(|line| format!("{}}}\n", &line[..line.find(", \"response_body\"").unwrap()]))
        .collect();
    let (out, _) = simulate(policy, bare.as_bytes(), &["--json"]);
    let report: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
    let totals = &report["rules"][0]["totals"];
    assert_eq!(
        (totals["admitted"].clone(), totals["rejected"].clone()),
        (Value::from(2), Value::from(10)),
        "{report:#}"
    );
}

#[test]
fn requests_hold_their_concurrency_places_as_long_as_the_log_says_they_lasted() {
    // max_in_flight 2 per account. Each request lasts 1.5 s (duration_ms); one arrives
    // every 0.5 s: at most 2 are inside at once, so every third is rejected while the
    // two before it are still inside: requests at 0, 0.5 pass; 1.0 is rejected (both
    // inside); 1.5 passes (the first ended at 1.5), 2.0 passes (the second ended), 2.5 is
    // rejected, and so on: 2 of every 3.
    let policy = "Url: /\nrules:\n  - {name: inside, actor: account, max_in_flight: 2}\n";
    let mut log = String::new();
    for i in 0..12u64 {
        log.push_str(&format!(
            "{{\"ts\": {}.{}, \"path\": \"/\", \"headers\": {{\"x-account-id\": \"a\"}}, \"duration_ms\": 1500}}\n",
            1_767_225_600 + i / 2,
            if i % 2 == 0 { "0" } else { "5" }
        ));
    }
    let (out, _) = simulate(policy, log.as_bytes(), &["--json"]);
    let report: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
    let totals = &report["rules"][0]["totals"];
    assert_eq!(
        (totals["admitted"].clone(), totals["rejected"].clone()),
        (Value::from(8), Value::from(4)),
        "{report:#}"
    );
    // The same limit over every gateway (the quota service holds the places): the same,
    // once a place's leave had its tick (1 ms) to reach the service: requests of 1.4 s.
    let global = "resources:\n  - Url: /\n    rules:\n      - {name: inside, actor: account, max_in_flight: 2, scope: global}\nglobal: {cluster: \"127.0.0.1:18081\"}\n";
    let shorter = log.replace("\"duration_ms\": 1500", "\"duration_ms\": 1400");
    let (out, _) = simulate(global, shorter.as_bytes(), &["--json"]);
    let report: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
    let totals = &report["rules"][0]["totals"];
    assert_eq!(
        (totals["admitted"].clone(), totals["rejected"].clone()),
        (Value::from(8), Value::from(4)),
        "{global}: {report:#}"
    );
    // Without durations, every request ends at once: none is rejected.
    let instant = log.replace(", \"duration_ms\": 1500", "");
    let (out, _) = simulate(policy, instant.as_bytes(), &["--json"]);
    let report: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
    assert_eq!(report["rules"][0]["totals"]["rejected"], 0, "{report:#}");
}

/// A breaker on /pay in front of a generous rule: 30 answers of 200, 25 of 503, 60 of 200,
/// one request every 100 ms from 2026-01-01T00:00:00Z, each answered in 20 ms.
const BREAKER_POLICY: &str = "\
resources:
  - Url: /pay
    breaker: {failure_ratio: 0.4, min_calls: 20, open_seconds: 5, half_open_calls: 2}
    rules:
      - {name: pay_all, algo: W, rpu: 100, unit: second}
";

fn breaker_log() -> String {
    let t0: u64 = T0.parse().unwrap();
    (0..115u64)
        .map(|index| {
            let status = if (30..55).contains(&index) { 503 } else { 200 };
            format!(
                "{{\"ts\": {}.{}, \"path\": \"/pay\", \"status\": {status}, \"duration_ms\": 20}}\n",
                t0 + index / 10,
                index % 10
            )
        })
        .collect()
}

#[test]
fn breakers_show_their_transitions_in_every_report() {
    let (out, dir) = simulate(
        BREAKER_POLICY,
        breaker_log().as_bytes(),
        &["--totals", "--svg", "chart.svg"],
    );
    let text = stdout_of(&out);
    // The 20th 503 (sent at 4.9 s, answered at 4.92 s) makes 20 failed of 50 calls: open
    // until 9.92 s, so the 50 requests of 5.0 s to 9.9 s fail fast without reaching the
    // rule; the request of 10.0 s finds it over and probes, with the one of 10.1 s,
    // answered at 10.12 s: closed.
    let expected = "\
totals   admitted  delayed  rejected  dry-run  fast-failed  max delay  mean delay
pay_all        65        0         0        0                       -           -
(all)          65        0         0        0           50          -           -
115 requests: 65 admitted, 0 delayed, 0 rejected, 50 fast-failed by a breaker, 0 sent to a breaker's fallback; 0 matched no rule; 0 callouts to the simulated quota service

breakers
breaker  scope  opens when          min calls  window  open for  probes  force  fallback
pay      local  failed [5xx] ≥ 0.4         20    10 s   5.000 s       2   auto         -

breaker totals  calls  slow  failed  no answer  fast-failed  time open  state at end  transitions
pay                65     0      20          0           50    5.080 s        closed            3

transitions of pay: 3
after start  time                      from       to         why                        calls  slow  failed
+4.920 s     2026-01-01T00:00:04.920Z  closed     open       failed share reached          50  0.0%   40.0%
+10.000 s    2026-01-01T00:00:10.000Z  open       half-open  open_seconds over              0     -       -
+10.120 s    2026-01-01T00:00:10.120Z  half-open  closed     every probe answered well      2  0.0%    0.0%
";
    assert!(text.ends_with(expected), "{text}");
    let chart = std::fs::read_to_string(dir.path().join("chart.svg")).unwrap();
    assert!(chart.contains("<title>breaker pay open</title>"), "{chart}");
    assert!(chart.contains("10 fast-failed</title>"), "{chart}");

    let (out, _) = simulate(BREAKER_POLICY, breaker_log().as_bytes(), &["--json"]);
    let json: Value = serde_json::from_str(&stdout_of(&out)).unwrap();
    assert_eq!(json["all"]["fast_failed"], 50);
    let breaker = &json["breakers"][0];
    assert_eq!(breaker["name"], "pay");
    assert_eq!(breaker["gateways"][0]["calls"], 65);
    assert_eq!(breaker["gateways"][0]["failed"], 20);
    assert_eq!(breaker["gateways"][0]["open_ms"], 5080.0);
    assert_eq!(breaker["transitions_total"], 3);
    let transitions: Vec<(f64, &str, &str)> = breaker["transitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["at_ms"].as_f64().unwrap(),
                t["from"].as_str().unwrap(),
                t["to"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        transitions,
        [
            (4920.0, "closed", "open"),
            (10000.0, "open", "half-open"),
            (10120.0, "half-open", "closed")
        ]
    );
    // The seconds the breaker was open: 10 fast-failed each.
    let fast: Vec<u64> = json["seconds"]
        .as_array()
        .unwrap()
        .iter()
        .map(|second| second["all"]["fast_failed"].as_u64().unwrap())
        .collect();
    assert_eq!(fast, [0, 0, 0, 0, 0, 10, 10, 10, 10, 10, 0, 0]);

    // Without breakers, nothing of them is printed.
    let (out, _) = simulate(POLICY, mixed_log().as_bytes(), &["--totals"]);
    let text = stdout_of(&out);
    assert!(
        !text.contains("breaker") && !text.contains("fast-failed"),
        "{text}"
    );
}
