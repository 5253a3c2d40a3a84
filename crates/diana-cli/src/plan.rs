//! The effective plan of a validated [`Policy`]: what the filter will do, every default
//! filled in, resources in evaluation order. Every setting of a rule is shown as the filter
//! uses it: its cost, response cost and longest wait, the actor it counts (with where that
//! actor's identity comes from, under `actors`), and its dry run with the document's
//! included. Built once as an ordered YAML value; printed as YAML for people (`diana
//! check`) or as JSON (`diana check --json`).

use crate::yaml::{map, number, string};
use diana_core::algo::inflight::RECLAIMED_AFTER;
use diana_core::breaker::record::{record_bytes, record_key};
use diana_core::breaker::{Ratio, Spec};
use diana_core::calendar::CalendarUnit;
use diana_core::config::{
    Cost, CostSource, Lease, PlanChoice, PlanName, Policy, Reserve, ResponseCost, Rule, Scope,
};
use diana_core::time::NANOS_PER_SECOND;
use serde_yaml::Value;

/// Why the plan cannot be printed: the serializer's reason.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("cannot print the plan: {0}")]
    Json(#[from] serde_json::Error),
    #[error("cannot print the plan: {0}")]
    Yaml(#[from] serde_yaml::Error),
}

/// Machine-readable plan (JSON): rates also as numbers (`rate_per_second`).
pub fn render_json(policy: &Policy) -> Result<String, PlanError> {
    let plan = build(policy, true);
    let mut text = serde_json::to_string_pretty(&plan)?;
    text.push('\n');
    Ok(text)
}

/// Human-readable plan (YAML with a header comment).
pub fn render_text(policy: &Policy) -> Result<String, PlanError> {
    let plan = build(policy, false);
    let body = serde_yaml::to_string(&plan)?;
    let rules: usize = policy
        .resources
        .iter()
        .map(|resource| resource.rules.len())
        .sum();
    let global = count_global(policy);
    let breakers = match policy.breakers().count() {
        0 => String::new(),
        count => format!(", {count} {}", plural(count, "breaker", "breakers")),
    };
    let mut out = format!(
        "# The configuration is valid: {} {}, {} {} ({} global){breakers}.\n",
        policy.resources.len(),
        plural(policy.resources.len(), "resource", "resources"),
        rules,
        plural(rules, "rule", "rules"),
        global,
    );
    out.push_str(&format!(
        "# nginx (ngx_wasm_module): `{}` holds every counter without eviction (nginx/README.md).\n",
        crate::nginx::directive(policy)
    ));
    if let Some(warning) = diana_core::store::identity::public_key_warning(policy) {
        out.push_str(&format!("# {warning}\n"));
    }
    out.push_str(
        "# Effective plan: every default filled in, every setting as the filter uses it (a\n\
         # rule's dry_run includes the document's). Resources are listed in evaluation order\n\
         # (least specific first, all matching resources apply); within a resource, rules apply\n\
         # in order and the first rule that denies ends the evaluation.\n",
    );
    out.push_str(&body);
    Ok(out)
}

fn plural<'a>(count: usize, one: &'a str, many: &'a str) -> &'a str {
    if count == 1 {
        one
    } else {
        many
    }
}

/// Number of rules with `scope: global`.
pub fn count_global(policy: &Policy) -> usize {
    policy
        .resources
        .iter()
        .flat_map(|resource| resource.rules.iter())
        .filter(|rule| rule.scope == Scope::Global)
        .count()
}

fn build(policy: &Policy, machine: bool) -> Value {
    let resources = policy
        .resources
        .iter()
        .map(|resource| {
            let rules = resource
                .rules
                .iter()
                .map(|rule| rule_plan(policy, rule, machine))
                .collect();
            map(vec![
                ("url", string(&resource.url)),
                ("rules", Value::Sequence(rules)),
                (
                    "breaker",
                    resource.breaker.as_ref().map_or(Value::Null, breaker_plan),
                ),
                // How a request path is compared with the url.
                (
                    "path",
                    map(vec![
                        (
                            "strip_parameters",
                            Value::Bool(resource.path.strip_parameters),
                        ),
                        (
                            "case_insensitive",
                            Value::Bool(resource.path.case_insensitive),
                        ),
                    ]),
                ),
            ])
        })
        .collect();

    let response = &policy.response;
    let global = &policy.global;
    let remote = match &policy.remote {
        None => Value::Null,
        Some(remote) => map(vec![
            ("cluster", string(&remote.cluster)),
            ("authority", string(&remote.authority)),
            ("path", string(&remote.path)),
            ("poll_seconds", number(u64::from(remote.poll_seconds))),
            (
                "allow",
                Value::Sequence(
                    remote
                        .allow
                        .iter()
                        .map(|name| string(name.name()))
                        .collect(),
                ),
            ),
            (
                "signature",
                // An HMAC key is a secret: the plan says which kind, never the value.
                remote.signature.as_ref().map_or(Value::Null, |key| {
                    map(vec![(key.kind(), string(&key.shown()))])
                }),
            ),
        ]),
    };

    let nginx = map(vec![(
        "shm_kv_bytes",
        number(crate::nginx::zone_bytes(policy)),
    )]);

    let metrics = match &policy.metrics {
        None => Value::Null,
        Some(metrics) => map(vec![("path", string(&metrics.path))]),
    };

    map(vec![
        ("resources", Value::Sequence(resources)),
        ("actors", actors_plan(policy)),
        (
            "response",
            map(vec![
                ("status", number(u64::from(response.status))),
                ("body", string(&response.body)),
                ("headers", string(response.headers.name())),
                ("header_style", string(response.header_style.name())),
            ]),
        ),
        (
            "global",
            map(vec![
                ("cluster", string(&global.cluster)),
                ("authority", string(&global.authority)),
                ("path", string(&global.path)),
                ("timeout_ms", number(u64::from(global.timeout_ms))),
                (
                    "lease",
                    match global.lease {
                        Lease::Fixed(lease) => number(u64::from(lease.get())),
                        Lease::Auto => string("auto"),
                    },
                ),
                ("retry_seconds", number(u64::from(global.retry_seconds))),
                // A secret: whether there is one, never its value.
                (
                    "token",
                    string(if global.token.is_some() {
                        "<redacted>"
                    } else {
                        "none"
                    }),
                ),
                ("used_by_rules", number(count_global(policy) as u64)),
            ]),
        ),
        ("remote", remote),
        ("metrics", metrics),
        ("dry_run", Value::Bool(policy.dry_run)),
        (
            "on_invalid_config",
            Value::String(policy.on_invalid_config.name().to_string()),
        ),
        ("identity_key", identity_key_plan(policy)),
        ("nginx", nginx),
    ])
}

/// `identity_key`: whether the document sets one, never its value.
fn identity_key_plan(policy: &Policy) -> Value {
    string(if policy.identity_key().is_some() {
        "<redacted>"
    } else {
        "none: local rules hash identities with a per-process random key, global rules with a public key"
    })
}

/// Every actor a rule counts, in the order rules first use it: where its identities come
/// from (`source: all`, `source: ip`, or `source: header` with the header and the
/// fallback for requests without it).
fn actors_plan(policy: &Policy) -> Value {
    let mut seen: Vec<&str> = Vec::new();
    let mut entries = Vec::new();
    for rule in policy.rules() {
        if seen.contains(&rule.actor_name.as_str()) {
            continue;
        }
        seen.push(&rule.actor_name);
        let settings = rule
            .actor_source()
            .into_iter()
            .map(|(key, value)| (key, string(value)))
            .collect();
        entries.push((rule.actor_name.as_str(), map(settings)));
    }
    map(entries)
}

/// `cost`: a number, or where a request's cost is read from.
fn cost_plan(cost: &Cost) -> Value {
    match cost {
        Cost::Fixed(cost) => number(u64::from(cost.get())),
        Cost::Header { name, default, max } => map(vec![
            ("header", string(name)),
            ("default", number(u64::from(default.get()))),
            ("max", number(u64::from(max.get()))),
        ]),
    }
}

/// `response_cost`: where the answer's cost is read (the keys of its form), its cap, and
/// what a request reserves.
fn response_cost_plan(cost: &ResponseCost) -> Value {
    let mut entries = match &cost.source {
        CostSource::Header(name) => vec![("header", string(name))],
        CostSource::Usage { provider, weights } => vec![
            ("usage", string(provider.name())),
            (
                "weights",
                weights.map_or(Value::Null, |weights| {
                    map(vec![
                        ("input", number(weights.input)),
                        ("output", number(weights.output)),
                    ])
                }),
            ),
        ],
        CostSource::Json(path) => vec![("json", string(path.as_str()))],
    };
    entries.extend([
        ("max", number(u64::from(cost.max.get()))),
        // Taken up front instead of `cost`, and settled with the answer.
        (
            "reserve",
            cost.reserve.as_ref().map_or(Value::Null, reserve_plan),
        ),
    ]);
    map(entries)
}

/// `reserve`: a number, or where a request's reservation is read and its bounds.
fn reserve_plan(reserve: &Reserve) -> Value {
    let (key, from, bounds) = match reserve {
        Reserve::Fixed(tokens) => return number(u64::from(tokens.get())),
        Reserve::Header { name, bounds } => ("header", name.as_str(), bounds),
        Reserve::Json { path, bounds } => ("json", path.as_str(), bounds),
    };
    map(vec![
        (key, string(from)),
        ("default", number(u64::from(bounds.default().get()))),
        ("max", number(u64::from(bounds.max().get()))),
        // The least a request reserves, whatever it says.
        ("min", number(u64::from(bounds.min().get()))),
    ])
}

fn rule_plan(policy: &Policy, rule: &Rule, machine: bool) -> Value {
    let limit = &rule.limit;
    let per_second = rate_per_second(limit.rpu.get(), limit.unit.seconds());
    let mut entries = vec![
        ("name", string(&rule.name)),
        ("id", string(&format!("{:016x}", rule.id))),
        ("table", string(&format!("{:016x}", rule.keys.table))),
        ("actor", string(&rule.actor_name)),
        ("algo", string(rule.algo.code())),
    ];
    if rule.algo.holds_until_done() {
        // A concurrency limit has no rate: the places, and how long a lost one lasts.
        entries.extend([
            ("max_in_flight", number(u64::from(limit.rpu.get()))),
            (
                "lost_place_reclaimed_after_seconds",
                number(RECLAIMED_AFTER / NANOS_PER_SECOND),
            ),
        ]);
    } else if let Some(calendar) = &limit.calendar {
        // Periods of the calendar: their length varies, so the rate is per period.
        let unit = calendar.unit().name();
        let start = match calendar.unit() {
            CalendarUnit::Week => "Monday",
            CalendarUnit::Month => "the 1st",
        };
        let zone = calendar.zone().name();
        // What the count does at the period's start: W starts again, TB refills evenly.
        let period = if rule.algo.code() == "TB" {
            format!(
                "a bucket of {}, refilled {} evenly over each {unit} ({zone})",
                limit.burst, limit.rpu
            )
        } else {
            format!("counted from {start} 00:00 to the next ({zone})")
        };
        entries.extend([
            ("rpu", number(u64::from(limit.rpu.get()))),
            ("unit", string(unit)),
            ("timezone", string(zone)),
            ("rate", string(&format!("{}/{unit}", limit.rpu))),
            ("period", string(&period)),
        ]);
        if machine {
            entries.push(("rate_per_second", Value::Null));
        }
    } else {
        entries.extend([
            ("rpu", number(u64::from(limit.rpu.get()))),
            ("unit", string(limit.unit.name())),
            ("timezone", Value::Null),
            ("rate", string(&format_rate(per_second))),
        ]);
        if machine {
            entries.push(("rate_per_second", Value::Number(per_second.into())));
        }
        entries.extend([
            ("burst", number(u64::from(limit.burst.get()))),
            ("slices", number(u64::from(limit.slices.get()))),
            ("max_in_flight", Value::Null),
        ]);
    }
    entries.extend([
        ("slots", number(u64::from(rule.slots.get()))),
        ("scope", string(rule.scope.name())),
        (
            "lease",
            if rule.lease_auto {
                string(&format!("auto (at most {})", rule.lease))
            } else {
                number(u64::from(rule.lease.get()))
            },
        ),
        ("cost", cost_plan(&rule.cost)),
        (
            "response_cost",
            rule.response_cost
                .as_ref()
                .map_or(Value::Null, response_cost_plan),
        ),
        (
            "count",
            rule.count.as_ref().map_or(Value::Null, |count| {
                map(vec![(
                    "status",
                    Value::Sequence(count.describe().iter().map(|s| string(s)).collect()),
                )])
            }),
        ),
        // Only a leaky bucket holds a request; for the others the setting does not exist.
        (
            "max_wait_seconds",
            if rule.algo.waits() {
                number(rule.max_wait / NANOS_PER_SECOND)
            } else {
                Value::Null
            },
        ),
        // As the filter decides: the rule's own, or the whole document's.
        ("dry_run", Value::Bool(rule.dry_run || policy.dry_run)),
        ("metric_name", string(&rule.metric_name)),
        ("plan", rule.plan.as_ref().map_or(Value::Null, plan_choice)),
        // Where the gateway keeps this rule's hottest identities for the fleet view.
        (
            "hot",
            rule.hot.map_or(Value::Null, |hot| {
                map(vec![
                    ("show", string(hot.show.name())),
                    ("top", number(u64::from(hot.top.get()))),
                ])
            }),
        ),
    ]);
    map(entries)
}

/// A resource's breaker with every default resolved, and what the document does not say
/// but the breaker does: how long a probe may take before it counts as failed, where its
/// state lives in shared data and how many bytes that takes.
fn breaker_plan(spec: &Spec) -> Value {
    let settings = &spec.settings;
    let slow = settings.slow();
    let ratio = |ratio: Option<Ratio>| {
        ratio.map_or(Value::Null, |ratio| {
            // As written: `0.5`; a number, not text, in both forms.
            serde_yaml::from_str(&ratio.to_string()).unwrap_or(Value::Null)
        })
    };
    let failure_status = settings.failure_status.to_string();
    let failure_status = failure_status
        .trim_start_matches('[')
        .trim_end_matches(']')
        .split(", ")
        .filter(|item| !item.is_empty())
        .map(string)
        .collect();
    map(vec![
        ("name", string(&settings.name)),
        ("index", number(spec.index as u64)),
        ("metric_name", string(&spec.metric_name)),
        (
            "slow_ms",
            slow.map_or(Value::Null, |slow| number(slow.threshold.whole_millis())),
        ),
        ("slow_ratio", ratio(slow.map(|slow| slow.ratio))),
        ("failure_status", Value::Sequence(failure_status)),
        ("failure_ratio", ratio(settings.failure_ratio())),
        ("min_calls", number(u64::from(settings.min_calls.get()))),
        (
            "window_seconds",
            number(u64::from(settings.window.seconds())),
        ),
        ("open_seconds", number(settings.open_for / NANOS_PER_SECOND)),
        (
            "half_open_calls",
            number(u64::from(settings.half_open_calls.get())),
        ),
        ("scope", string(settings.reach.name())),
        ("force", string(settings.force.name())),
        (
            "fallback_header",
            spec.fallback_header.as_deref().map_or(Value::Null, string),
        ),
        // A probe's place held this long without an outcome counts as a failed probe.
        (
            "probe_timeout_ms",
            number(settings.probe_timeout().whole_millis()),
        ),
        ("record_key", string(&record_key(&settings.name))),
        (
            "record_bytes",
            number(record_bytes(settings.half_open_calls.get()) as u64),
        ),
    ])
}

/// One plan of a rule written with `rpu: {by, values, default}`: where the plan is read,
/// and which values it counts.
fn plan_choice(choice: &PlanChoice) -> Value {
    let selects = match &choice.plan {
        PlanName::Named(name) => string(name),
        PlanName::Default { named } => string(&format!(
            "any other value, or none (not {})",
            named.join(", ")
        )),
    };
    map(vec![
        ("by", string(&choice.by.describe())),
        ("name", string(choice.name())),
        ("selects", selects),
    ])
}

/// Requests per second of `rpu` per `unit_seconds`.
pub fn rate_per_second(rpu: u32, unit_seconds: u64) -> f64 {
    // Both fit exactly in an f64 (rpu < 2^32, unit ≤ 86,400).
    f64::from(rpu) / unit_seconds as f64
}

/// `10/s`, `1.5/s`, `16.667/s`, `0.333/s`, `0.0833/s`, `0.000116/s`: at most three
/// decimals at or above 1, three significant digits below.
pub fn format_rate(per_second: f64) -> String {
    let decimals = if per_second >= 1.0 || per_second <= 0.0 {
        3
    } else {
        // Leading zeros after the point, plus three significant digits.
        let zeros = (-per_second.log10()).floor().max(0.0) as usize;
        zeros + 3
    };
    let mut text = format!("{per_second:.decimals$}");
    if text.contains('.') {
        while text.ends_with('0') {
            text.pop();
        }
        if text.ends_with('.') {
            text.pop();
        }
    }
    text.push_str("/s");
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_shows_remote_allow_and_the_kind_of_signature_never_an_hmac_key() {
        let key = "plan-hmac-key-0123456789abcdef0123456789";
        let document = format!(
            "resources: [{{Url: /, rules: [{{rpu: 1}}]}}]\n\
             remote: {{cluster: c, path: /p, allow: [dry_run], signature: {{hmac_sha256: {key}}}}}\n"
        );
        let policy = diana_core::config::parse_policy(&document).unwrap();
        for plan in [render_text(&policy).unwrap(), render_json(&policy).unwrap()] {
            assert!(!plan.contains(key), "{plan}");
            assert!(
                plan.contains("hmac_sha256") && plan.contains("<redacted>"),
                "{plan}"
            );
            assert!(plan.contains("dry_run"), "{plan}");
        }
    }

    #[test]
    fn the_plan_says_whether_an_identity_key_is_set_never_its_value() {
        let key = "plan-identity-key-0123456789abcdef012345";
        let rules = "resources: [{Url: /, rules: [{rpu: 1, actor: device, scope: global}]}]\n";
        let keyed =
            diana_core::config::parse_policy(&format!("{rules}identity_key: {key}\n")).unwrap();
        for plan in [render_text(&keyed).unwrap(), render_json(&keyed).unwrap()] {
            assert!(!plan.contains(key), "{plan}");
            assert!(
                plan.contains("identity_key") && plan.contains("<redacted>"),
                "{plan}"
            );
            assert!(!plan.contains("WARNING"), "{plan}");
        }
        assert!(!format!("{keyed:?}").contains(key));
        let unkeyed = diana_core::config::parse_policy(rules).unwrap();
        let text = render_text(&unkeyed).unwrap();
        assert!(
            text.contains("# WARNING: identity_key is not set"),
            "{text}"
        );
    }

    #[test]
    fn rates_are_readable() {
        for (rpu, unit, expected) in [
            (10, 1, "10/s"),
            (50, 1, "50/s"),
            (3, 2, "1.5/s"),
            (1000, 60, "16.667/s"),
            (20, 60, "0.333/s"),
            (1, 3, "0.333/s"),
            (5, 60, "0.0833/s"),
            (10, 86_400, "0.000116/s"),
            (1, 86_400, "0.0000116/s"),
            (4_294_967_295, 1, "4294967295/s"),
            (60, 60, "1/s"),
        ] {
            assert_eq!(
                format_rate(rate_per_second(rpu, unit)),
                expected,
                "{rpu}/{unit}"
            );
        }
    }
}
