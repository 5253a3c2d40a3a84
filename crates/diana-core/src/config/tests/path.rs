//! A resource's `path` options (issue 41, item 6): how its `Url` is compared with a request
//! path, for backends that read paths more loosely than their spelling.

use super::breaker::refused_saying;
use super::parse;
use crate::config::PathOptions;
use crate::matching::matching;
use crate::path::normalize;

#[test]
fn path_options_as_written_and_by_default() {
    let policy = parse(
        "- Url: /admin\n  rules: [{rpu: 5}]\n  path: {strip_parameters: true, case_insensitive: true}\n\
         - Url: /api\n  rules: [{rpu: 5}]\n  path: {case_insensitive: true}\n\
         - Url: /x\n  rules: [{rpu: 5}]\n  path: {}\n\
         - Url: /y\n  rules: [{rpu: 5}]\n",
    );
    let options: Vec<(&str, PathOptions)> = policy
        .resources
        .iter()
        .map(|resource| (resource.url.as_str(), resource.path))
        .collect();
    let both = PathOptions {
        strip_parameters: true,
        case_insensitive: true,
    };
    let case = PathOptions {
        case_insensitive: true,
        ..PathOptions::default()
    };
    assert_eq!(
        options,
        [
            ("/admin", both),
            ("/api", case),
            ("/x", PathOptions::default()),
            ("/y", PathOptions::default()),
        ]
    );
    // The policy matches by them: `;jsessionid` and upper case no longer escape `/admin`.
    for raw in [
        &b"/admin;jsessionid=0123/panel"[..],
        b"/ADMIN/panel",
        b"/static/..;/Admin",
    ] {
        let path = normalize(raw);
        let urls: Vec<&str> = matching(&policy, &path)
            .map(|(_, resource)| resource.url.as_str())
            .collect();
        assert_eq!(urls, ["/admin"], "{:?}", String::from_utf8_lossy(raw));
    }
}

#[test]
fn a_malformed_path_option_is_refused_naming_the_field_and_its_position() {
    refused_saying(&[
        (
            "Url: /\nrules: []\npath: {strip_parameters: yes}\n",
            &["path.strip_parameters: ", "line 3"][..],
        ),
        (
            "Url: /\nrules: []\npath: {case_insensitive: 1}\n",
            &["path.case_insensitive: ", "line 3"][..],
        ),
        (
            "Url: /\nrules: []\npath: {lowercase: true}\n",
            &["path.lowercase: ", "unknown field `lowercase`", "line 3"][..],
        ),
        ("Url: /\nrules: []\npath: /x\n", &["path: ", "line 3"][..]),
    ]);
}

/// A request under `/api/x` also matches a case-insensitive `/API` block: the global rules
/// one callout carries count both.
#[test]
fn the_global_rules_of_one_request_count_every_block_that_matches_it_by_its_options() {
    let rules = |count: usize| {
        (0..count)
            .map(|n| format!("{{rpu: 10, scope: global, name: r{n}{}}}", count))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let document = |options: &str| {
        format!(
            "- Url: /API\n  path: {{{options}}}\n  rules: [{}]\n- Url: /api/x\n  rules: [{}]\n",
            rules(40),
            rules(30)
        )
    };
    // Compared exactly, `/API` never applies with `/api/x`: 40 and 30 global rules.
    parse(&document("case_insensitive: false"));
    refused_saying(&[(
        document("case_insensitive: true"),
        &[
            "[1].Url: ",
            "a request to /api/x would carry 70 global rules",
            "line 4",
        ][..],
    )]);
}
