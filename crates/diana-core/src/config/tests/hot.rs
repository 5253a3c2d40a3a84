//! A rule's `hot` (issue 43): where the gateway keeps the rule's hottest identities for the
//! fleet view.

use super::breaker::refused_saying;
use super::{parse, rules};
use crate::config::{parse_remote, HotShow, HotSpec, DEFAULT_HOT_TOP, MAX_HOT_TOP};
use std::num::NonZeroU8;

fn hot(fields: &str) -> Option<HotSpec> {
    let policy = parse(&format!(
        "Url: /\nrules:\n  - {{rpu: 5, actor: device{fields}}}\n"
    ));
    rules(&policy)[0].hot
}

fn top(top: u8) -> NonZeroU8 {
    NonZeroU8::new(top).expect("nonzero")
}

#[test]
fn a_rules_hot_list_as_written_and_by_default() {
    let cases: [(&str, Option<HotSpec>); 6] = [
        ("", None),
        (
            ", hot: {}",
            Some(HotSpec {
                show: HotShow::Value,
                top: DEFAULT_HOT_TOP,
            }),
        ),
        (
            ", hot: {show: digest}",
            Some(HotSpec {
                show: HotShow::Digest,
                top: DEFAULT_HOT_TOP,
            }),
        ),
        (
            ", hot: {show: ' VALUE ', top: 1}",
            Some(HotSpec {
                show: HotShow::Value,
                top: top(1),
            }),
        ),
        (
            ", hot: {top: 100}",
            Some(HotSpec {
                show: HotShow::Value,
                top: top(MAX_HOT_TOP),
            }),
        ),
        (
            ", hot: {show: digest, top: 25}",
            Some(HotSpec {
                show: HotShow::Digest,
                top: top(25),
            }),
        ),
    ];
    for (fields, expected) in cases {
        assert_eq!(hot(fields), expected, "{fields}");
    }
    assert_eq!(DEFAULT_HOT_TOP.get(), 10);
    // Every plan of a rule with plans keeps the list its rule asks for.
    let policy = parse(
        "Url: /\nrules:\n  - {rpu: {by: x-plan, values: {pro: 50}, default: 5}, hot: {top: 3}}\n",
    );
    assert!(rules(&policy)
        .iter()
        .all(|rule| rule.hot.map(|hot| hot.top.get()) == Some(3)));
}

#[test]
fn a_malformed_hot_list_is_refused_naming_the_field_and_its_position() {
    refused_saying(&[
        (
            "Url: /\nrules:\n  - rpu: 5\n    hot: {top: 0}\n",
            &[
                "rules[0].hot.top: ",
                "between 1 and 100",
                "line 4 column 16",
            ][..],
        ),
        (
            "Url: /\nrules:\n  - rpu: 5\n    hot: {top: 101}\n",
            &["rules[0].hot.top: ", "between 1 and 100", "line 4"][..],
        ),
        (
            "Url: /\nrules:\n  - rpu: 5\n    hot: {show: hash}\n",
            &[
                "rules[0].hot.show: ",
                "unknown hot.show `hash`, expected one of value, digest",
                "line 4 column 17",
            ][..],
        ),
        (
            "Url: /\nrules:\n  - rpu: 5\n    hot: {top: 5, paths: true}\n",
            &["rules[0].hot.paths: ", "unknown field `paths`", "line 4"][..],
        ),
        (
            "Url: /\nrules:\n  - rpu: 5\n    hot: true\n",
            &["rules[0].hot: ", "line 4"][..],
        ),
        (
            "Url: /\nrules:\n  - rpu: 5\n    hot: ~\n",
            &["rules[0].hot: ", "null where a value is expected", "line 4"][..],
        ),
    ]);
}

/// Free for a remote document, as any other tuning of a rule.
#[test]
fn a_remote_document_may_ask_for_a_hot_list() {
    let local = parse("resources: [{Url: /, rules: [{rpu: 5}]}]\nremote: {cluster: c, path: /d}\n");
    let remote = parse_remote(
        "resources: [{Url: /, rules: [{rpu: 5, hot: {show: digest, top: 50}}]}]\n",
        &local,
    )
    .expect("adopted");
    assert_eq!(
        rules(&remote)[0].hot,
        Some(HotSpec {
            show: HotShow::Digest,
            top: top(50),
        })
    );
}
