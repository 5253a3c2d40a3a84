//! `diana check`: the plan shows every effective setting of every rule as the filter uses
//! it, and a refused document names the field path and its line and column, checks across
//! fields included (issue 22, items 2 and 3).

#![cfg(test)]

mod common;

use common::{check_json, diana, repo_root, text};
use serde_json::Value;

fn check_text(document: &str) -> String {
    let out = diana(&["check", "-"], Some(document));
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    text(&out.stdout)
}

fn demo() -> String {
    std::fs::read_to_string(repo_root().join("envoy/demo-diana.yaml")).unwrap()
}

/// The rule named `name` in a plan.
fn rule<'p>(plan: &'p Value, name: &str) -> &'p Value {
    plan["resources"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|resource| resource["rules"].as_array().unwrap())
        .find(|rule| rule["name"] == name)
        .unwrap_or_else(|| panic!("no rule {name} in {plan:#}"))
}

fn rules(plan: &Value) -> Vec<&Value> {
    plan["resources"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|resource| resource["rules"].as_array().unwrap())
        .collect()
}

#[test]
fn the_demo_plan_shows_costs_waits_actors_and_metrics() {
    let plan = check_json(&demo());
    let llm = rule(&plan, "llm_tokens");
    assert_eq!(llm["cost"], 1, "one token up front");
    assert_eq!(
        llm["response_cost"],
        serde_json::json!({"header": "x-llm-tokens", "max": 100000, "reserve": null}),
        "{llm:#}"
    );
    assert_eq!(llm["max_wait_seconds"], Value::Null, "TB holds no request");
    assert_eq!(llm["actor"], "account");
    assert_eq!(llm["metric_name"], "llm_tokens");
    let site = rule(&plan, "site_tb");
    assert_eq!(site["cost"], 1);
    assert_eq!(site["response_cost"], Value::Null);
    // Where each actor's identity comes from: the document's definition, or the built-in one.
    assert_eq!(
        plan["actors"],
        serde_json::json!({
            "all": {"source": "all"},
            "device": {"source": "header", "header": "x-device-id", "fallback": "ip"},
            "account": {"source": "header", "header": "x-account-id", "fallback": "skip"},
        })
    );
    assert_eq!(
        plan["metrics"],
        Value::Null,
        "the demo serves no metrics path"
    );
    assert_eq!(plan["global"]["token"], "none");

    let yaml = check_text(&demo());
    for line in [
        "    cost: 1",
        "    response_cost:",
        "      header: x-llm-tokens",
        "      max: 100000",
        "    max_wait_seconds: null",
        "actors:",
        "  device:",
        "    source: header",
        "    header: x-device-id",
        "    fallback: ip",
        "metrics: null",
    ] {
        assert!(
            yaml.lines().any(|l| l == line),
            "missing line {line:?} in:\n{yaml}"
        );
    }
}

#[test]
fn a_document_level_dry_run_shows_on_every_rule() {
    let document = "resources:\n  - Url: /\n    rules:\n      - {name: a, rpu: 5}\n      - {name: b, rpu: 5, scope: global}\n  - Url: /x\n    rules: [{name: c, rpu: 1, algo: LB}]\ndry_run: true\n";
    let plan = check_json(document);
    assert_eq!(plan["dry_run"], true);
    for rule in rules(&plan) {
        assert_eq!(rule["dry_run"], true, "{rule:#}");
    }
    let yaml = check_text(document);
    assert!(
        !yaml.contains("    dry_run: false"),
        "a rule listed as enforcing under a dry-run document:\n{yaml}"
    );
    // Without it, a rule's own dry run is its alone.
    let plan = check_json(
        &document
            .replace("dry_run: true\n", "")
            .replace("{name: a, rpu: 5}", "{name: a, rpu: 5, dry_run: true}"),
    );
    let runs: Vec<&Value> = rules(&plan).iter().map(|rule| &rule["dry_run"]).collect();
    assert_eq!(runs, [true, false, false]);
}

#[test]
fn costs_waits_and_metrics_as_the_filter_uses_them() {
    let document = "\
resources:
  - Url: /
    rules:
      - {name: pace, rpu: 10, algo: LB}
      - {name: patient, rpu: 10, algo: LB, max_wait_seconds: 0}
      - {name: priced, rpu: 100, lease: 20, scope: global, cost: {header: X-Cost, max: 20}}
      - {name: fixed, rpu: 100, cost: 7, response_cost: {header: x-used, max: 50}}
      - {name: reserving, rpu: 1000, response_cost: {header: x-used, max: 900, reserve: {header: x-max, default: 50, max: 500}}}
      - {name: logins, rpu: 5, unit: hour, count: {status: [401, 5xx]}}
      - {name: tiered, rpu: {by: x-plan, values: {pro: 50}, default: 5}}
actors:
  tenant: {header: x-tenant-id, fallback: shared}
metrics: {path: /diana/metrics/}
";
    let plan = check_json(document);
    assert_eq!(rule(&plan, "pace")["max_wait_seconds"], 10, "the default");
    assert_eq!(rule(&plan, "patient")["max_wait_seconds"], 0);
    assert_eq!(
        rule(&plan, "priced")["cost"],
        serde_json::json!({"header": "x-cost", "default": 1, "max": 20})
    );
    assert_eq!(rule(&plan, "fixed")["cost"], 7);
    assert_eq!(
        rule(&plan, "fixed")["response_cost"],
        serde_json::json!({"header": "x-used", "max": 50, "reserve": null})
    );
    assert_eq!(
        rule(&plan, "reserving")["response_cost"]["reserve"],
        // `min`: the least a request reserves, whatever its header says (issue 41, 5d).
        serde_json::json!({"header": "x-max", "default": 50, "max": 500, "min": 50})
    );
    assert_eq!(
        rule(&plan, "logins")["count"],
        serde_json::json!({"status": ["401", "5xx"]})
    );
    assert_eq!(rule(&plan, "fixed")["count"], Value::Null);
    assert_eq!(rule(&plan, "tiered.pro")["rpu"], 50);
    assert_eq!(
        rule(&plan, "tiered.default")["plan"],
        serde_json::json!({"by": "header x-plan", "name": "default", "selects": "any other value, or none (not pro)"})
    );
    assert_eq!(plan["metrics"]["path"], "/diana/metrics");
    // Only the actors rules count are listed (`tenant` is defined but unused).
    assert_eq!(
        plan["actors"],
        serde_json::json!({"all": {"source": "all"}})
    );
}

/// The plan cannot fall behind the document: every key a rule may be written with, and
/// every section of the full form, is in the plan (the schema lists them from the code).
#[test]
fn every_setting_the_document_can_write_is_in_the_plan() {
    let out = diana(&["schema"], None);
    assert!(out.status.success(), "stderr: {}", text(&out.stderr));
    let schema: Value = serde_json::from_slice(&out.stdout).unwrap();
    let keys = |definition: &str| -> Vec<String> {
        schema["definitions"][definition]["properties"]
            .as_object()
            .unwrap_or_else(|| panic!("no {definition} in the schema"))
            .keys()
            .cloned()
            .collect()
    };
    let plan = check_json(
        "resources: [{Url: /, rules: [{rpu: 1}], breaker: {failure_ratio: 1}}]\n\
         remote: {cluster: c, path: /p}\nmetrics: {path: /m}\n",
    );
    let written = &plan["resources"][0]["rules"][0];
    for key in keys("rule") {
        assert!(
            written.get(&key).is_some(),
            "the plan's rule has no `{key}`: {written:#}"
        );
    }
    let resource = &plan["resources"][0];
    for key in keys("block") {
        assert!(
            resource.get(key.to_lowercase()).is_some(),
            "the plan's resource has no `{key}`: {resource:#}"
        );
    }
    for key in keys("breaker") {
        assert!(
            resource["breaker"].get(&key).is_some(),
            "the plan's breaker has no `{key}`: {resource:#}"
        );
    }
    assert_eq!(
        resource["path"],
        serde_json::json!({"strip_parameters": false, "case_insensitive": false})
    );
    let loose = check_json("Url: /admin\nrules: []\npath: {strip_parameters: true}\n");
    assert_eq!(
        loose["resources"][0]["path"],
        serde_json::json!({"strip_parameters": true, "case_insensitive": false})
    );
    for section in keys("full") {
        assert!(plan.get(&section).is_some(), "the plan has no `{section}`");
    }
    for (definition, section) in [
        ("global", "global"),
        ("response", "response"),
        ("remote", "remote"),
    ] {
        for key in keys(definition) {
            assert!(
                plan[section].get(&key).is_some(),
                "the plan's {section} has no `{key}`: {:#}",
                plan[section]
            );
        }
    }
}

/// LLM budgets as the filter uses them: the answer's cost from a provider's usage (with
/// its weights) or a JSON path, a reservation from the request body with its floor, and
/// calendar periods in a time zone.
#[test]
fn llm_budgets_and_calendar_periods_as_the_filter_uses_them() {
    let document = "\
resources:
  - Url: /v1/chat
    rules:
      - name: monthly
        actor: account
        unit: month
        timezone: Europe/Berlin
        rpu: 1000000
        response_cost:
          usage: openai
          weights: {output: 4}
          reserve: {json: max_tokens, default: 1000, max: 100000, min: 200}
      - {name: weekly, unit: weeks, algo: W, rpu: 5000, response_cost: {json: usage.total_tokens, max: 9000}}
      - {name: daily, unit: day, rpu: 100, response_cost: {header: x-used, max: 50, reserve: 7}, hot: {show: digest}}
";
    let plan = check_json(document);
    let monthly = rule(&plan, "monthly");
    assert_eq!(monthly["unit"], "month");
    assert_eq!(monthly["timezone"], "Europe/Berlin");
    assert_eq!(monthly["rate"], "1000000/month");
    assert_eq!(monthly["rate_per_second"], Value::Null);
    // What the period means: a token bucket refills over it, a window starts again.
    assert_eq!(
        monthly["period"],
        "a bucket of 1000000, refilled 1000000 evenly over each month (Europe/Berlin)"
    );
    assert_eq!(
        monthly["response_cost"],
        serde_json::json!({
            "usage": "openai",
            "weights": {"input": 1, "output": 4},
            "max": 1_000_000_000,
            "reserve": {"json": "max_tokens", "default": 1000, "max": 100000, "min": 200},
        })
    );
    let weekly = rule(&plan, "weekly");
    assert_eq!(
        (&weekly["unit"], &weekly["timezone"]),
        (&Value::from("week"), &Value::from("UTC"))
    );
    assert_eq!(
        weekly["period"],
        "counted from Monday 00:00 to the next (UTC)"
    );
    assert_eq!(rule(&plan, "daily")["period"], Value::Null);
    assert_eq!(
        weekly["response_cost"],
        serde_json::json!({"json": "usage.total_tokens", "max": 9000, "reserve": null})
    );
    let daily = rule(&plan, "daily");
    assert_eq!(daily["timezone"], Value::Null);
    assert_eq!(daily["response_cost"]["reserve"], 7);
    // `hot`: the list the gateway keeps for the fleet view, defaults resolved.
    assert_eq!(
        daily["hot"],
        serde_json::json!({"show": "digest", "top": 10})
    );
    assert_eq!(weekly["hot"], Value::Null);
}

/// Every breaker's effective settings: all defaults resolved, the probe timeout and the
/// record it keeps in shared data (and nginx's zone counts it).
#[test]
fn the_plan_shows_every_breakers_effective_settings() {
    let document = "\
resources:
  - Url: /payments
    breaker: {slow_ms: 800, slow_ratio: 0.5, failure_status: [5xx, 429], fallback_header: X-Backup}
  - Url: /
    rules: [{rpu: 10}]
    breaker: {failure_ratio: 0.25, force: open, scope: global, half_open_calls: 10}
";
    let plan = check_json(document);
    assert_eq!(
        plan["resources"][0]["breaker"],
        serde_json::json!({
            "name": "root", "index": 0, "metric_name": "root",
            "slow_ms": null, "slow_ratio": null, "failure_status": ["5xx"], "failure_ratio": 0.25,
            "min_calls": 20, "window_seconds": 10, "open_seconds": 30, "half_open_calls": 10,
            "scope": "global", "force": "open", "fallback_header": null,
            "probe_timeout_ms": 60000,
            "record_key": diana_core::breaker::record::record_key("root"),
            "record_bytes": diana_core::breaker::record::record_bytes(10),
        })
    );
    let payments = &plan["resources"][1]["breaker"];
    assert_eq!(payments["name"], "payments");
    assert_eq!(payments["index"], 1);
    assert_eq!(payments["slow_ms"], 800);
    assert_eq!(payments["slow_ratio"], 0.5);
    assert_eq!(
        payments["failure_status"],
        serde_json::json!(["5xx", "429"])
    );
    assert_eq!(payments["failure_ratio"], Value::Null);
    assert_eq!(payments["probe_timeout_ms"], 1600, "twice slow_ms");
    assert_eq!(payments["fallback_header"], "x-backup");
    assert_eq!(payments["scope"], "local");
    assert_eq!(plan["resources"][1]["rules"], serde_json::json!([]));
    let text = check_text(document);
    assert!(
        text.starts_with(
            "# The configuration is valid: 2 resources, 1 rule (0 global), 2 breakers."
        ),
        "{text}"
    );
    for line in [
        "  breaker:",
        "    name: payments",
        "    force: open",
        "    slow_ratio: 0.5",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }
}

/// A refusal across fields names the path and position, on stderr, exactly as the filter
/// logs it; `diana check` exits 1.
#[test]
fn refusals_across_fields_name_the_field_and_its_position() {
    for (document, expected) in [
        (
            "Url: /\nrules:\n  - {rpu: 10, cost: 11}\n",
            "rules[0].cost: a cost of 11 could never pass: the rule grants at most 10 at once \
             (rpu, or burst for TB and LB) at line 3 column 21",
        ),
        (
            "Url: /\nrules:\n  - rpu: 10\n    algo: LB\n    response_cost: {header: x, max: 5}\n",
            "rules[0].response_cost: response_cost does not apply to algo LB: a leaky bucket paces \
             requests, it does not charge them afterwards at line 5 column 20",
        ),
        (
            "resources:\n  - Url: /\n    rules:\n      - rpu: 1\n        max_wait_seconds: 5\n",
            "resources[0].rules[0].max_wait_seconds: max_wait_seconds applies to algo LB (leaky \
             bucket) only, not to TB at line 5 column 27",
        ),
        (
            "Url: /pay\nbreaker:\n  slow_ms: 500\n  failure_ratio: 0.5\n",
            "breaker.slow_ms: slow_ms without slow_ratio: slow calls open a breaker only with both \
             (slow_ms says which call is slow, slow_ratio what share of them opens it) at line 3 column 12",
        ),
    ] {
        let out = diana(&["check", "-"], Some(document));
        assert_eq!(out.status.code(), Some(1), "{document}");
        assert!(out.stdout.is_empty());
        assert_eq!(text(&out.stderr), format!("{expected}\n"));
        let filter = diana_core::config::parse_policy(document).unwrap_err();
        assert_eq!(filter.to_string(), expected);
    }
}
