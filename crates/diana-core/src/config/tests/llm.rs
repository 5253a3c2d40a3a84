//! LLM budgets (issue 42) and the reservation floor (issue 41, 5d): where an answer's cost
//! is read, its weights, a reservation from the request, calendar periods in a time zone;
//! every refusal with its field and position.

use super::breaker::refused_saying;
use super::{parse, rules, Facts};
use crate::calendar::CalendarUnit;
use crate::config::{
    CostSource, Provider, Reserve, ResponseCost, Rule, Upfront, MAX_RESPONSE_COST,
};
use crate::time::Unit;
use crate::usage::{Usage, UsageSource, Weights};

fn rule(fields: &str) -> Rule {
    let policy = parse(&format!("Url: /\nrules:\n  - {{{fields}}}\n"));
    rules(&policy)[0].clone()
}

fn response_cost(fields: &str) -> ResponseCost {
    rule(fields).response_cost.expect("a response cost")
}

#[test]
fn the_answers_cost_is_read_from_one_source() {
    let cases: [(&str, CostSource, u32); 6] = [
        (
            "usage: openai",
            CostSource::Usage {
                provider: Provider::OpenAi,
                weights: None,
            },
            MAX_RESPONSE_COST,
        ),
        (
            "usage: ' Anthropic ', max: 5000",
            CostSource::Usage {
                provider: Provider::Anthropic,
                weights: None,
            },
            5000,
        ),
        (
            "usage: GEMINI, weights: {input: 0, output: 3}",
            CostSource::Usage {
                provider: Provider::Gemini,
                weights: Some(Weights {
                    input: 0,
                    output: 3,
                }),
            },
            MAX_RESPONSE_COST,
        ),
        (
            "usage: openai, weights: {input: 2}",
            CostSource::Usage {
                provider: Provider::OpenAi,
                weights: Some(Weights {
                    input: 2,
                    output: 1,
                }),
            },
            MAX_RESPONSE_COST,
        ),
        (
            "json: usage.total_tokens",
            CostSource::Json(crate::usage::JsonPath::parse("usage.total_tokens").unwrap()),
            MAX_RESPONSE_COST,
        ),
        (
            "header: X-LLM-Tokens, max: 9",
            CostSource::Header("x-llm-tokens".into()),
            9,
        ),
    ];
    for (written, source, max) in cases {
        let cost = response_cost(&format!("rpu: 1000, response_cost: {{{written}}}"));
        assert_eq!(cost.source, source, "{written}");
        assert_eq!(cost.max.get(), max, "{written}");
        assert_eq!(cost.reserve, None);
    }
}

#[test]
fn a_body_source_is_read_from_the_body_and_a_header_source_from_its_header() {
    let usage = rule("rpu: 1000, response_cost: {usage: anthropic}");
    assert_eq!(usage.response_body_source(), Some(UsageSource::Anthropic));
    assert_eq!(usage.answer_header(), None, "no header to read");
    assert_eq!(usage.request_body_path(), None);
    let json = rule("rpu: 1000, response_cost: {json: a.b}");
    assert!(matches!(
        json.response_body_source(),
        Some(UsageSource::JsonPath(path)) if path.as_str() == "a.b"
    ));
    let header = rule("rpu: 1000, response_cost: {header: x-t, max: 9}");
    assert_eq!(header.response_body_source(), None);
    assert_eq!(header.answer_header(), Some("x-t"));
    // Only a document that reads bodies makes a host look at them.
    let policy = parse(
        "Url: /\nrules:\n  - {rpu: 1000, response_cost: {header: x-t, max: 9, reserve: 5}}\n",
    );
    assert!(!policy.reads_request_bodies() && !policy.reads_response_bodies());
    let policy = parse(
        "Url: /\nrules:\n  - {rpu: 1000}\n  - {rpu: 1000, response_cost: {usage: openai, reserve: {json: max_tokens, default: 100, max: 900}}}\n",
    );
    assert!(policy.reads_request_bodies() && policy.reads_response_bodies());
    assert_eq!(
        rules(&policy)[1]
            .request_body_path()
            .map(|path| path.as_str()),
        Some("max_tokens")
    );
}

#[test]
fn an_answer_is_charged_its_weighted_usage_at_most_max() {
    let usage = |input, output, total| Usage {
        input,
        output,
        total,
    };
    // (fields, usage, charged)
    let cases = [
        ("usage: openai", usage(10, 30, Some(40)), 40),
        // Without weights: the reported total, else input + output.
        ("usage: anthropic", usage(10, 30, None), 40),
        (
            "usage: openai, weights: {input: 1, output: 4}",
            usage(10, 30, Some(40)),
            130,
        ),
        (
            "usage: openai, weights: {input: 0}",
            usage(10, 30, Some(40)),
            30,
        ),
        ("usage: openai, max: 100", usage(10, 30, Some(999)), 100),
        (
            "usage: gemini, weights: {input: 1000000, output: 1000000}",
            usage(u64::MAX, 1, None),
            MAX_RESPONSE_COST,
        ),
        ("json: n", usage(0, 0, Some(77)), 77),
    ];
    for (fields, reported, charged) in cases {
        let cost = response_cost(&format!("rpu: 1000, response_cost: {{{fields}}}"));
        assert_eq!(cost.charge(&reported), charged, "{fields}");
    }
}

#[test]
fn a_reservation_read_from_the_request_never_goes_below_its_floor() {
    let header = |value: Option<&str>| {
        let mut facts = Facts::default();
        if let Some(value) = value {
            facts.headers.push(("x-max", value.as_bytes().to_vec()));
        }
        facts
    };
    // The floor defaults to `default`: a client cannot reserve less (issue 41, 5d).
    let defaulted = rule("rpu: 100000, response_cost: {header: x-t, max: 90000, reserve: {header: x-max, default: 1000, max: 8000}}");
    let floored = rule("rpu: 100000, response_cost: {header: x-t, max: 90000, reserve: {header: x-max, default: 1000, max: 8000, min: 10}}");
    // (header value, reserved by `defaulted`, by `floored`)
    let cases: [(Option<&str>, u32, u32); 8] = [
        (None, 1000, 1000),
        (Some("1"), 1000, 10),
        (Some("0"), 1000, 10),
        (Some("500"), 1000, 500),
        (Some("4000"), 4000, 4000),
        (Some("99999999999999999999999"), 8000, 8000),
        (Some("lots"), 1000, 1000),
        (Some("-5"), 1000, 1000),
    ];
    for (value, expected, with_floor) in cases {
        assert_eq!(
            defaulted.upfront().of(&header(value)),
            expected,
            "{value:?}"
        );
        assert_eq!(
            floored.upfront().of(&header(value)),
            with_floor,
            "{value:?}"
        );
    }
    assert_eq!(defaulted.upfront().max(), 8000);
    let Some(Reserve::Header { bounds, .. }) = defaulted.response_cost.and_then(|c| c.reserve)
    else {
        panic!("a header reservation");
    };
    assert_eq!(
        (
            bounds.default().get(),
            bounds.min().get(),
            bounds.max().get()
        ),
        (1000, 1000, 8000)
    );
    // From the body: its `default` until the body is read; the bounds apply to what it says.
    let json = rule("rpu: 100000, response_cost: {usage: openai, reserve: {json: max_completion_tokens, default: 1000, max: 100000}}");
    assert!(matches!(
        json.upfront(),
        Upfront::Reserve(Reserve::Json { .. })
    ));
    assert_eq!(json.upfront().of(&header(Some("5"))), 1000);
    let Some(Reserve::Json { path, bounds }) = json.response_cost.and_then(|c| c.reserve) else {
        panic!("a body reservation");
    };
    assert_eq!(path.as_str(), "max_completion_tokens");
    assert_eq!(
        [None, Some(1), Some(5000), Some(u64::MAX)].map(|value| bounds.of(value)),
        [1000, 1000, 5000, 100_000]
    );
    // A constant is what it says.
    let fixed = rule("rpu: 1000, response_cost: {header: x-t, max: 9, reserve: 300}");
    assert_eq!(fixed.upfront().of(&header(Some("1"))), 300);
}

#[test]
fn calendar_periods_in_a_time_zone() {
    let cases: [(&str, CalendarUnit, &str); 5] = [
        ("unit: week", CalendarUnit::Week, "UTC"),
        ("unit: Months", CalendarUnit::Month, "UTC"),
        (
            "unit: month, timezone: Europe/Berlin",
            CalendarUnit::Month,
            "Europe/Berlin",
        ),
        (
            "unit: week, timezone: asia/kathmandu",
            CalendarUnit::Week,
            "Asia/Kathmandu",
        ),
        (
            "unit: month, algo: W, timezone: UTC",
            CalendarUnit::Month,
            "UTC",
        ),
    ];
    for (fields, unit, zone) in cases {
        let rule = rule(&format!("rpu: 1000, {fields}"));
        let calendar = rule.limit.calendar.as_ref().expect("a calendar");
        assert_eq!(calendar.unit(), unit, "{fields}");
        assert_eq!(calendar.zone().name(), zone, "{fields}");
        // The fixed unit is a placeholder, never the period.
        assert_eq!(rule.limit.unit, Unit::Day);
    }
    assert_eq!(rule("rpu: 1").limit.calendar, None);
    // A month is counted apart from a day, a week, and a month elsewhere.
    let ids: Vec<u64> = [
        "unit: day",
        "unit: week",
        "unit: month",
        "unit: month, timezone: Europe/Berlin",
        "unit: month, timezone: America/New_York",
    ]
    .iter()
    .map(|fields| rule(&format!("rpu: 10, {fields}")).id)
    .collect();
    for (index, id) in ids.iter().enumerate() {
        assert!(!ids[..index].contains(id), "{ids:x?}");
    }
    // A reservation works with any unit.
    let reserving = rule(
        "rpu: 100000, unit: week, response_cost: {usage: openai, reserve: {json: max_tokens, default: 10, max: 100}}",
    );
    assert!(reserving.settles());
}

#[test]
fn a_malformed_llm_budget_is_refused_naming_the_field_and_its_position() {
    let rule = "Url: /\nrules:\n  - rpu: 100000\n";
    let table: &[(&str, &[&str])] = &[
        // sources
        ("    response_cost: {max: 5}\n", &["rules[0].response_cost: ", "response_cost is read from one of usage, json or header; none is given", "line 4"]),
        ("    response_cost:\n      usage: openai\n      header: x-t\n      max: 5\n", &["rules[0].response_cost.header: ", "not from usage and header: keep one", "line 6 column 15"]),
        ("    response_cost: {header: x-t}\n", &["rules[0].response_cost: ", "missing field `max`", "line 4"]),
        ("    response_cost: {usage: mistral}\n", &["rules[0].response_cost.usage: ", "unknown provider `mistral`, expected one of openai, anthropic, gemini", "line 4"]),
        ("    response_cost: {usage: openai, max: 0}\n", &["rules[0].response_cost.max: ", "between 1 and 1000000000", "line 4"]),
        // weights
        ("    response_cost:\n      json: n\n      weights: {input: 2}\n", &["rules[0].response_cost.weights: ", "apply with `usage` only, not with `json`", "line 6 column 16"]),
        ("    response_cost: {header: x-t, max: 5, weights: {output: 2}}\n", &["rules[0].response_cost.weights: ", "not with `header`", "line 4"]),
        ("    response_cost: {usage: openai, weights: {input: 0, output: 0}}\n", &["rules[0].response_cost.weights: ", "would never charge anything", "line 4"]),
        ("    response_cost: {usage: openai, weights: {input: -1}}\n", &["rules[0].response_cost.weights.input: ", "line 4"]),
        ("    response_cost: {usage: openai, weights: {input: 1.5}}\n", &["rules[0].response_cost.weights.input: ", "line 4"]),
        ("    response_cost: {usage: openai, weights: {cached: 1}}\n", &["rules[0].response_cost.weights.cached: ", "unknown field `cached`", "line 4"]),
        // JSON paths
        ("    response_cost: {json: ''}\n", &["rules[0].response_cost.json: ", "not empty", "line 4"]),
        ("    response_cost: {json: 'usage..total'}\n", &["rules[0].response_cost.json: ", "key 2 of the JSON path is empty", "line 4"]),
        ("    response_cost: {json: 'usage total'}\n", &["rules[0].response_cost.json: ", "printable ASCII", "line 4"]),
        ("    response_cost: {json: a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q}\n", &["rules[0].response_cost.json: ", "at most 16 keys", "this one has 17", "line 4"]),
        // reservations
        ("    response_cost:\n      usage: openai\n      reserve: {header: x-m, json: max_tokens, default: 5, max: 9}\n", &["rules[0].response_cost.reserve.json: ", "response_cost.reserve is read from one of header or json, not from header and json", "line 6"]),
        ("    response_cost: {usage: openai, reserve: {default: 5, max: 9}}\n", &["rules[0].response_cost.reserve: ", "none is given", "line 4"]),
        ("    response_cost:\n      usage: openai\n      reserve: {json: max_tokens, max: 9}\n", &["rules[0].response_cost.reserve: ", "missing field `default`", "line 6 column 16"]),
        ("    response_cost:\n      usage: openai\n      reserve: {header: x-m, default: 5, max: 9, min: 6}\n", &["rules[0].response_cost.reserve.min: ", "reserve.min (6) is above reserve.default (5)", "line 6"]),
        ("    response_cost: {usage: openai, reserve: {json: max_tokens, default: 50, max: 9}}\n", &["rules[0].response_cost.reserve.default: ", "cost.default (50) is above cost.max (9)", "line 4"]),
        ("    response_cost: {usage: openai, reserve: {json: max_tokens, default: 5, max: 9, min: 0}}\n", &["rules[0].response_cost.reserve.min: ", "between 1 and 100000", "line 4"]),
        ("    response_cost: {usage: openai, reserve: {json: max_tokens, default: 5, max: 200000}}\n", &["rules[0].response_cost.reserve.max: ", "between 1 and 100000", "line 4"]),
        ("    response_cost:\n      usage: openai\n      reserve: {json: max_tokens, default: 5, max: 100000}\n    burst: 500\n", &["rules[0].response_cost.reserve.max: ", "a cost of 100000 could never pass", "line 6"]),
        ("    algo: LB\n    response_cost: {usage: openai}\n", &["rules[0].response_cost: ", "does not apply to algo LB", "line 5"]),
        // calendar periods
        ("    unit: month\n    algo: SW\n", &["rules[0].unit: ", "unit month is a calendar period: it applies to algo W", "not to SW", "line 4 column 11"]),
        ("    unit: week\n    algo: LB\n", &["rules[0].unit: ", "not to LB", "line 4"]),
        ("    unit: hour\n    timezone: Europe/Berlin\n", &["rules[0].timezone: ", "timezone applies to calendar units (week, month), not to hour", "line 5 column 15"]),
        ("    timezone: UTC\n", &["rules[0].timezone: ", "not to second", "line 4"]),
        ("    unit: month\n    timezone: Mars/Olympus\n", &["rules[0].timezone: ", "is not an IANA time zone name", "line 5"]),
        ("    unit: month\n    timezone: '+05:00'\n", &["rules[0].timezone: ", "line 5"]),
        ("    unit: month\n    timezone: ''\n", &["rules[0].timezone: ", "not empty", "line 5"]),
    ];
    let table: Vec<(String, &[&str])> = table
        .iter()
        .map(|(fields, wanted)| (format!("{rule}{fields}"), *wanted))
        .collect();
    refused_saying(&table);
    // A concurrency limit has no period, nor a zone.
    refused_saying(&[(
        "Url: /\nrules:\n  - {max_in_flight: 5, timezone: UTC}\n",
        &[
            "rules[0].timezone: ",
            "does not apply to a concurrency limit",
        ][..],
    )]);
}

#[test]
fn an_llm_budget_is_read_alike_from_json() {
    let yaml = rule(
        "rpu: 100000, unit: month, timezone: Europe/Paris, response_cost: {usage: openai, weights: {input: 1, output: 4}, reserve: {json: max_tokens, default: 1000, max: 100000, min: 100}}",
    );
    let policy = parse(
        r#"{"Url": "/", "rules": [{"rpu": 100000, "unit": "month", "timezone": "Europe/Paris", "response_cost": {"usage": "openai", "weights": {"input": 1, "output": 4}, "reserve": {"json": "max_tokens", "default": 1000, "max": 100000, "min": 100}}}]}"#,
    );
    let json = rules(&policy)[0];
    assert_eq!(yaml.response_cost, json.response_cost);
    assert_eq!(yaml.limit.calendar, json.limit.calendar);
    assert_eq!(yaml.id, json.id);
}

/// A document whose rules reserve from a request's body is warned about at load where the
/// host cannot hold a request for it (proxy-wasm), naming them.
#[test]
fn rules_that_read_a_body_are_named_in_the_load_warning() {
    let policy = parse(
        "resources:\n  - Url: /a\n    rules:\n      - {name: usage, rpu: 100, response_cost: {usage: openai}}\n      - {name: header, rpu: 100, response_cost: {header: x-used, max: 50}}\n  - Url: /b\n    rules:\n      - {name: reserved, rpu: 100, response_cost: {header: x-used, max: 50, reserve: {json: max_tokens, default: 10, max: 50}}}\n",
    );
    assert_eq!(policy.body_readers(), vec!["reserved"]);
    let warning = crate::config::body_warning(&policy).expect("a warning");
    assert!(warning.contains("rule(s) reserved reserve"), "{warning}");
    assert!(warning.contains("envoy-native"), "{warning}");
    let plain = parse("Url: /\nrules:\n  - {rpu: 100, response_cost: {header: x-used, max: 50}}\n");
    assert_eq!(crate::config::body_warning(&plain), None);
}
