//! A resource's `breaker` (DESIGN §4b): every field as the breaker uses it, the defaults,
//! the names and indices, and every refusal with its field and position.

use super::{error, parse};
use crate::breaker::{Force, Ratio, Reach, Spec, StatusClasses};
use crate::config::{parse_remote, Policy};
use crate::time::Nanos;

fn breakers(policy: &Policy) -> Vec<&Spec> {
    policy.breakers().collect()
}

fn ppm(ppm: u32) -> Ratio {
    Ratio::from_ppm(ppm).expect("a ratio")
}

#[test]
fn a_breaker_with_every_field_as_written() {
    let policy = parse(
        "resources:\n  - Url: /payments\n    breaker:\n      name: pay\n      slow_ms: 1500\n      \
         slow_ratio: 0.25\n      failure_status: [5xx, 429]\n      failure_ratio: 1\n      \
         min_calls: 7\n      window_seconds: 60\n      open_seconds: 90\n      half_open_calls: 255\n      \
         scope: global\n      force: OPEN\n      fallback_header: X-Backup\n",
    );
    let [spec] = breakers(&policy)[..] else {
        panic!("one breaker: {policy:?}");
    };
    let settings = &spec.settings;
    assert_eq!(settings.name, "pay");
    assert_eq!(spec.metric_name, "pay");
    assert_eq!(spec.index, 0);
    let slow = settings.slow().expect("slow calls");
    assert_eq!(slow.threshold, Nanos::from_millis(1_500));
    assert_eq!(slow.ratio, ppm(250_000));
    assert_eq!(settings.failure_ratio(), Some(ppm(1_000_000)));
    assert_eq!(settings.failure_status.to_string(), "[5xx, 429]");
    assert_eq!(settings.min_calls.get(), 7);
    assert_eq!(settings.window.seconds(), 60);
    assert_eq!(settings.open_for, Nanos::from_secs(90));
    assert_eq!(settings.half_open_calls.get(), 255);
    assert_eq!(settings.reach, Reach::Fleet);
    assert_eq!(settings.force, Force::Open);
    assert_eq!(spec.fallback_header.as_deref(), Some("x-backup"));
    assert_eq!(settings.probe_timeout(), Nanos::from_secs(3));
    // A block may have a breaker and no rules.
    assert!(policy.resources[0].rules.is_empty());
}

#[test]
fn a_breaker_left_to_its_defaults_is_the_breakers_own() {
    let policy = parse("Url: /\nrules: [{rpu: 5}]\nbreaker: {failure_ratio: 0.5}\n");
    let spec = breakers(&policy)[0];
    let settings = &spec.settings;
    assert_eq!(settings.name, "root");
    assert_eq!(spec.metric_name, "root");
    assert_eq!(settings.slow(), None);
    assert_eq!(settings.failure_ratio(), Some(ppm(500_000)));
    assert_eq!(settings.failure_status, StatusClasses::server_errors());
    assert_eq!(settings.min_calls.get(), 20);
    assert_eq!(settings.window.seconds(), 10);
    assert_eq!(settings.open_for, Nanos::from_secs(30));
    assert_eq!(settings.half_open_calls.get(), 3);
    assert_eq!(settings.reach, Reach::Gateway);
    assert_eq!(settings.force, Force::Auto);
    assert_eq!(spec.fallback_header, None);
    // Exactly what the breaker's own constructor gives.
    let own = crate::breaker::Settings::new("root", None, Some(ppm(500_000))).expect("settings");
    assert_eq!(*settings, own);
    assert_eq!(policy.rules().count(), 1);
}

#[test]
fn breakers_are_named_after_their_url_and_numbered_in_evaluation_order() {
    let policy = parse(
        "- Url: /api/v1/pay\n  breaker: {failure_ratio: 0.5}\n\
         - Url: /\n  breaker: {failure_ratio: 0.5}\n\
         - Url: /payments\n  rules: [{rpu: 1}]\n  breaker: {slow_ms: 100, slow_ratio: 0.5}\n\
         - Url: /plain\n  rules: [{rpu: 1}]\n",
    );
    let found: Vec<(usize, &str, &str)> = breakers(&policy)
        .iter()
        .map(|spec| {
            (
                spec.index,
                spec.settings.name.as_str(),
                spec.metric_name.as_str(),
            )
        })
        .collect();
    assert_eq!(
        found,
        [
            (0, "root", "root"),
            (1, "payments", "payments"),
            (2, "api/v1/pay", "api_v1_pay"),
        ]
    );
    // Each is its resource's, in `Policy::resources` order.
    let urls: Vec<(&str, Option<usize>)> = policy
        .resources
        .iter()
        .map(|resource| {
            (
                resource.url.as_str(),
                resource.breaker.as_ref().map(|spec| spec.index),
            )
        })
        .collect();
    assert_eq!(
        urls,
        [
            ("/", Some(0)),
            ("/payments", Some(1)),
            ("/plain", None),
            ("/api/v1/pay", Some(2)),
        ]
    );
}

#[test]
fn a_breaker_is_read_alike_from_json() {
    let yaml = parse(
        "Url: /x\nbreaker: {slow_ms: 200, slow_ratio: 0.5, failure_status: [503, 4xx], force: closed}\n",
    );
    let json = parse(
        r#"{"Url": "/x", "breaker": {"slow_ms": 200, "slow_ratio": 0.5, "failure_status": [503, "4xx"], "force": "closed"}}"#,
    );
    assert_eq!(breakers(&yaml)[0].settings, breakers(&json)[0].settings);
    assert_eq!(
        breakers(&json)[0].settings.failure_status.to_string(),
        "[4xx, 503]"
    );
}

#[test]
fn a_malformed_breaker_is_refused_naming_the_field_and_its_position() {
    let block = "Url: /pay\nrules: [{rpu: 5}]\nbreaker:\n";
    let table: &[(&str, &[&str])] = &[
        (
            "  failure_ratio: 0\n",
            &[
                "breaker.failure_ratio: ",
                "a number greater than 0 and at most 1",
                "line 4 column 18",
            ],
        ),
        (
            "  failure_ratio: 1.5\n",
            &["breaker.failure_ratio: ", "line 4 column 18"],
        ),
        (
            "  failure_ratio: -0.5\n",
            &["breaker.failure_ratio: ", "line 4"],
        ),
        (
            "  failure_ratio: 0.0000001\n",
            &["breaker.failure_ratio: ", "at least 0.000001", "line 4"],
        ),
        (
            "  failure_ratio: half\n",
            &["breaker.failure_ratio: ", "line 4"],
        ),
        (
            "  slow_ms: 10\n  slow_ratio: 2\n",
            &["breaker.slow_ratio: ", "line 5 column 15"],
        ),
        (
            "  failure_ratio: 0.5\n  min_calls: 0\n",
            &[
                "breaker.min_calls: ",
                "between 1 and 1000000",
                "line 5 column 14",
            ],
        ),
        (
            "  failure_ratio: 0.5\n  window_seconds: 0\n",
            &["breaker.window_seconds: ", "between 1 and 3600", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  window_seconds: 3601\n",
            &["breaker.window_seconds: ", "between 1 and 3600", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  open_seconds: 86401\n",
            &["breaker.open_seconds: ", "between 1 and 86400", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  half_open_calls: 256\n",
            &["breaker.half_open_calls: ", "between 1 and 255", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  half_open_calls: 0\n",
            &["breaker.half_open_calls: ", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  slow_ms: 0\n  slow_ratio: 0.5\n",
            &["breaker.slow_ms: ", "between 1 and 3600000", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  failure_status: [6xx]\n",
            &["breaker.failure_status", "6xx", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  failure_status: []\n",
            &["breaker.failure_status: ", "1 to 32 statuses", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  scope: fleet\n",
            &["breaker.scope: ", "unknown scope `fleet`", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  force: half\n",
            &[
                "breaker.force: ",
                "unknown force `half`, expected one of auto, open, closed",
                "line 5",
            ],
        ),
        (
            "  failure_ratio: 0.5\n  fallback_header: ':authority'\n",
            &["breaker.fallback_header: ", "pseudo-header", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  fallback_header: Retry-After\n",
            &[
                "breaker.fallback_header: ",
                "`retry-after` is a header Diana or the host uses",
                "line 5",
            ],
        ),
        (
            "  failure_ratio: 0.5\n  fallback_header: x-ratelimit-remaining\n",
            &["breaker.fallback_header: ", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  fallback_header: authorization\n",
            &["breaker.fallback_header: ", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  fallback_header: 'x backup'\n",
            &["breaker.fallback_header: ", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  name: ''\n",
            &["breaker.name: ", "empty breaker name", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  name: \"caf\\u00e9\"\n",
            &["breaker.name: ", "printable ASCII", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  ratio: 0.5\n",
            &["breaker.ratio: ", "unknown field `ratio`", "line 5"],
        ),
        (
            "  failure_ratio: 0.5\n  force: ~\n",
            &[
                "breaker.force: ",
                "null where a value is expected",
                "line 5",
            ],
        ),
        // Across its fields: typed refusals at the field, or at the breaker.
        (
            "  min_calls: 5\n",
            &[
                "breaker: ",
                "a breaker needs a threshold to open on",
                "line 4 column 3",
            ],
        ),
        (
            "  slow_ms: 100\n",
            &[
                "breaker.slow_ms: ",
                "slow_ms without slow_ratio",
                "line 4 column 12",
            ],
        ),
        (
            "  slow_ratio: 0.5\n  failure_ratio: 0.5\n",
            &[
                "breaker.slow_ratio: ",
                "slow_ratio without slow_ms",
                "line 4 column 15",
            ],
        ),
    ];
    let table: Vec<(String, &[&str])> = table
        .iter()
        .map(|(fields, wanted)| (format!("{block}{fields}"), *wanted))
        .collect();
    refused_saying(&table);
}

/// Each document refused with a message that says each of its words.
pub(super) fn refused_saying<T: AsRef<str>>(table: &[(T, &[&str])]) {
    for (text, wanted) in table {
        let text = text.as_ref();
        let message = error(text);
        for want in *wanted {
            assert!(
                message.contains(want),
                "{message:?} lacks {want:?}\n---\n{text}"
            );
        }
    }
}

#[test]
fn cross_field_refusals_are_typed() {
    use crate::config::{parse_policy, ConfigErrorKind};
    let kind = |text: &str| parse_policy(text).map(drop).unwrap_err().kind;
    assert_eq!(
        kind("Url: /\nbreaker: {min_calls: 3}\n"),
        ConfigErrorKind::BreakerNoThreshold
    );
    assert_eq!(
        kind("Url: /\nbreaker: {slow_ms: 3}\n"),
        ConfigErrorKind::BreakerSlowPair {
            written: "slow_ms",
            missing: "slow_ratio"
        }
    );
    assert_eq!(kind("Url: /\n"), ConfigErrorKind::NoRulesNorBreaker);
    assert_eq!(
        kind("- Url: /a\n  breaker: {failure_ratio: 1, name: x}\n- Url: /b\n  breaker: {failure_ratio: 1, name: x}\n"),
        ConfigErrorKind::DuplicateBreakerName { name: "x".into() }
    );
}

#[test]
fn two_breakers_may_not_share_a_name_a_metric_name_or_a_header_a_rule_reads() {
    let table: &[(&str, &[&str])] = &[
        (
            "- Url: /a\n  breaker: {failure_ratio: 1, name: pay}\n- Url: /b\n  breaker: {failure_ratio: 1, name: pay}\n",
            &["[1].breaker.name: ", "duplicate breaker name `pay`", "line 4 column 37"],
        ),
        // Derived names: the Urls differ, their metric names do not; refused at the breaker.
        (
            "- Url: /a-b\n  breaker: {failure_ratio: 1}\n- Url: /a_b\n  breaker: {failure_ratio: 1}\n",
            &["[1].breaker: ", "breaker names `a-b` and `a_b` are both `a_b` in metric names", "line 4"],
        ),
        // A name given to one equals the name derived for the other.
        (
            "- Url: /pay\n  breaker: {failure_ratio: 1}\n- Url: /other\n  breaker: {failure_ratio: 1, name: pay}\n",
            &["[1].breaker.name: ", "duplicate breaker name `pay`", "line 4"],
        ),
        (
            "Url: /\nrules: [{rpu: 5, actor: device}]\nbreaker: {failure_ratio: 1, fallback_header: X-Device-Id}\n",
            &["breaker.fallback_header: ", "fallback_header `x-device-id` is read by actor `device`", "line 3"],
        ),
        (
            "- Url: /\n  rules: [{rpu: 5, cost: {header: x-cost, max: 5}}]\n- Url: /x\n  breaker: {failure_ratio: 1, fallback_header: x-cost}\n",
            &["[1].breaker.fallback_header: ", "the cost of rule `/#0`", "line 4"],
        ),
        (
            "Url: /\nrules: [{rpu: {by: x-plan, values: {pro: 5}, default: 1}}]\nbreaker: {failure_ratio: 1, fallback_header: x-plan}\n",
            &["breaker.fallback_header: ", "the plans of rule", "line 3"],
        ),
        (
            "resources: [{Url: /, rules: [{rpu: 5, actor: tenant}], breaker: {failure_ratio: 1, fallback_header: x-tenant}}]\nactors: {tenant: {header: x-tenant}}\n",
            &["resources[0].breaker.fallback_header: ", "actor `tenant`", "line 1"],
        ),
        // A block of neither.
        ("Url: /\n", &["missing field `rules`", "a `breaker`, or both", "line 1"]),
        ("resources:\n  - Url: /\n", &["resources[0]: ", "missing field `rules`", "line 2"]),
    ];
    refused_saying(table);
    // Names that differ, and a header no rule reads, are fine.
    let policy = parse(
        "- Url: /a\n  rules: [{rpu: 5, actor: device}]\n  breaker: {failure_ratio: 1, fallback_header: x-diana-fallback}\n\
         - Url: /b\n  breaker: {failure_ratio: 1, fallback_header: x-diana-fallback}\n",
    );
    assert_eq!(policy.breakers().count(), 2);
}

/// Every breaker field is free (DESIGN §6): a config center may tune a breaker and flip its
/// manual switch — which denies traffic to the route, the point of a manual switch, and why
/// its documents should be signed.
#[test]
fn a_remote_document_may_flip_the_switch_and_tune_the_breaker() {
    let local = parse(
        "resources: [{Url: /pay, rules: [{rpu: 5}], breaker: {failure_ratio: 0.5}}]\n\
         remote: {cluster: c, path: /d}\n",
    );
    let remote = parse_remote(
        "resources: [{Url: /pay, rules: [{rpu: 5}], breaker: {failure_ratio: 0.2, force: open, scope: global, fallback_header: x-backup}}]\n",
        &local,
    )
    .expect("adopted");
    let spec = remote.breakers().next().expect("a breaker");
    assert_eq!(spec.settings.force, Force::Open);
    assert_eq!(spec.settings.failure_ratio(), Some(ppm(200_000)));
    assert_eq!(spec.settings.reach, Reach::Fleet);
    assert_eq!(spec.fallback_header.as_deref(), Some("x-backup"));
    // And may drop it.
    let remote = parse_remote("Url: /pay\nrules: [{rpu: 5}]\n", &local).expect("adopted");
    assert_eq!(remote.breakers().count(), 0);
}
