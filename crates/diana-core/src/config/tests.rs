//! Table-driven tests of the configuration: every form, defaults, ids, and every error
//! class with its field path and position.

use super::*;
use crate::actor::Identity;
use crate::algo;
use crate::facts::RequestFacts;
use crate::time::Unit;
use std::num::NonZeroU32;

mod breaker;
mod description;
mod hot;
mod llm;
mod path;

/// The seed design's document, verbatim (one copy for every test that needs it).
const SEED: &str = include_str!("../../../../tests/fixtures/seed.yaml");

fn parse(text: &str) -> Policy {
    match parse_policy(text) {
        Ok(policy) => policy,
        Err(err) => panic!("document should parse: {err}\n---\n{text}"),
    }
}

fn error(text: &str) -> String {
    match parse_policy(text) {
        Ok(policy) => panic!("document should be rejected: {policy:?}\n---\n{text}"),
        Err(err) => err.to_string(),
    }
}

fn nz(value: u32) -> NonZeroU32 {
    NonZeroU32::new(value).expect("nonzero")
}

fn code(name: &str) -> &'static str {
    algo::lookup(name).expect("known algorithm").code()
}

fn urls(policy: &Policy) -> Vec<&str> {
    policy
        .resources
        .iter()
        .map(|resource| resource.url.as_str())
        .collect()
}

fn rules(policy: &Policy) -> Vec<&Rule> {
    policy
        .resources
        .iter()
        .flat_map(|resource| resource.rules.iter())
        .collect()
}

fn ids(policy: &Policy) -> Vec<u64> {
    rules(policy).iter().map(|rule| rule.id).collect()
}

#[derive(Default)]
struct Facts {
    headers: Vec<(&'static str, Vec<u8>)>,
    ip: Option<Vec<u8>>,
}

impl RequestFacts for Facts {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.headers
            .iter()
            .find(|(known, _)| *known == name)
            .map(|(_, value)| value.clone())
    }
    fn client_ip(&self) -> Option<Vec<u8>> {
        self.ip.clone()
    }
}

// ---------------------------------------------------------------------------------------
// Forms.

#[test]
fn seed_document_verbatim() {
    let policy = parse(SEED);
    assert_eq!(urls(&policy), ["/"]);
    let rules = rules(&policy);
    assert_eq!(rules.len(), 2);

    let device = rules[0];
    assert_eq!(device.name, "/#0");
    assert_eq!(device.actor_name, "device");
    assert_eq!(device.algo.code(), code("TB"));
    assert_eq!(device.limit.rpu, nz(10));
    assert_eq!(device.limit.unit, Unit::Second);
    assert_eq!(
        device.limit.burst,
        algo::lookup("TB")
            .expect("TB")
            .default_burst(nz(10), Unit::Second)
    );
    assert_eq!(device.limit.slices, nz(10));
    assert_eq!(device.scope, Scope::Global);
    assert_eq!(device.slots, nz(65_536));
    assert_eq!(device.lease, nz(1));
    assert!(!device.dry_run);
    assert!(!device.actor.is_single_counter());

    let all = rules[1];
    assert_eq!(all.name, "/#1");
    assert_eq!(all.actor_name, "all");
    assert_eq!(all.algo.code(), code("W"));
    assert_eq!(all.limit.rpu, nz(50));
    assert_eq!(all.scope, Scope::Local);
    assert_eq!(all.slots, nz(1), "`all` has one counter");
    assert!(all.actor.is_single_counter());
    assert_ne!(device.id, all.id);

    // Sections absent: the documented defaults.
    assert_eq!(policy.response, ResponseSpec::default());
    assert_eq!(policy.global, GlobalSpec::default());
    assert_eq!(policy.global.cluster, "diana_quota");
    assert!(policy.remote.is_none());
    assert!(!policy.dry_run);
}

#[test]
fn every_form_gives_the_same_policy() {
    let block_a = "Url: /\nrules:\n  - rpu: 10\n    actor: device\n";
    let block_b = "Url: /sample\nrules:\n  - rpu: 5\n    algo: SW\n";
    let forms = [
        // A sequence of blocks.
        "- Url: /\n  rules:\n    - rpu: 10\n      actor: device\n\
         - Url: /sample\n  rules:\n    - rpu: 5\n      algo: SW\n"
            .to_string(),
        // Several documents, each a block.
        format!("{block_a}---\n{block_b}"),
        // Several documents with an explicit start, an empty document and a trailing end.
        format!("---\n{block_a}---\n---\n{block_b}...\n"),
        // A document that is a sequence, then a block, in reverse order (sorting fixes it).
        format!("- {}\n---\n{block_a}", block_b.replace('\n', "\n  ").trim_end()),
        // The full form.
        "resources:\n  - Url: /\n    rules:\n      - rpu: 10\n        actor: device\n  \
         - url: /sample\n    rules:\n      - {rpu: 5, algo: SW}\n"
            .to_string(),
        // Full form in one document, a block in another.
        format!("resources: []\nresponse: {{status: 503}}\n---\n{block_a}---\n{block_b}"),
        // JSON: one object per form.
        r#"[{"Url": "/", "rules": [{"rpu": 10, "actor": "device"}]},
            {"url": "/sample", "rules": [{"rpu": 5, "algo": "SW"}]}]"#
            .to_string(),
        r#"{
            "resources": [
                {"Url": "/", "rules": [{"rpu": 10, "actor": "device"}]},
                {"Url": "/sample", "rules": [{"rpu": 5, "algo": "SW"}]}
            ]
        }"#
        .to_string(),
        // YAML flow style that is not JSON.
        "[{Url: /, rules: [{rpu: 10, actor: device}]}, {Url: /sample, rules: [{rpu: 5, algo: SW}]}]".to_string(),
    ];
    let reference = parse(&forms[0]);
    assert_eq!(urls(&reference), ["/", "/sample"]);
    for form in &forms {
        let policy = parse(form);
        assert_eq!(urls(&policy), ["/", "/sample"], "{form}");
        assert_eq!(ids(&policy), ids(&reference), "{form}");
        let rules = rules(&policy);
        assert_eq!(rules[0].actor_name, "device");
        assert_eq!(rules[1].algo.code(), code("SW"));
        assert_eq!(rules[1].name, "/sample#0");
    }
}

#[test]
fn json_single_block_and_istio_style() {
    let policy = parse(
        r#"{"Url":"/","rules":[{"actor":"device","unit":"second","rpu":10,"algo":"TB","scope":"global"},{"actor":"all","unit":"second","rpu":50,"algo":"W","scope":"local"}]}"#,
    );
    assert_eq!(ids(&policy), ids(&parse(SEED)));
    // Leading whitespace and tabs (JSON allows tabs where YAML does not).
    let policy = parse("\n\t{\n\t\"Url\": \"/x\",\n\t\"rules\": [{\"rpu\": 3}]\n}");
    assert_eq!(urls(&policy), ["/x"]);
    let full = parse(
        r#"{"resources":[{"Url":"/","rules":[{"rpu":1}]}],"response":{"status":429,"body":"slow down","headers":"all"},
            "global":{"cluster":"q","lease":8},"remote":{"cluster":"cfg","path":"/d.json","poll_seconds":3},"dry_run":true}"#,
    );
    assert_eq!(full.response.status, 429);
    assert_eq!(full.response.headers, HeaderMode::All);
    assert_eq!(full.global.lease, Lease::Fixed(nz(8)));
    assert_eq!(rules(&full)[0].lease, nz(8));
    assert_eq!(
        full.remote.as_ref().map(|remote| remote.poll_seconds),
        Some(3)
    );
    assert!(full.dry_run);
}

#[test]
fn full_form_every_section() {
    let policy = parse(
        "\
resources:
  - Url: /sample
    rules:
      - {rpu: 3, actor: tenant, scope: global, lease: 4, name: tenants}
      - {rpu: 7, actor: account, algo: leaky bucket, unit: minute, burst: 2, dry_run: true}
  - Url: /
    rules:
      - {rpu: 100, actor: ip, algo: sliding window, slices: 20, slots: 1024}
actors:
  account: {header: X-User, fallback: shared}
  device:  {header: x-dev}
  tenant:  {header: x-tenant-id}
response:
  status: 429
  body: \"go away\\n\"
  headers: none
  header_style: both
global:
  cluster: quota
  authority: quota.local
  path: /v2/acquire
  timeout_ms: 25
  lease: 2
  retry_seconds: 0
remote:
  cluster: diana_config
  authority: config
  path: /diana.yaml
dry_run: true
",
    );
    assert_eq!(urls(&policy), ["/", "/sample"], "least specific first");
    assert_eq!(
        policy.response,
        ResponseSpec {
            status: 429,
            body: "go away\n".to_string(),
            headers: HeaderMode::None,
            header_style: HeaderStyle::Both,
        }
    );
    assert_eq!(
        policy.global,
        GlobalSpec {
            cluster: "quota".to_string(),
            authority: "quota.local".to_string(),
            path: "/v2/acquire".to_string(),
            timeout_ms: 25,
            lease: Lease::Fixed(nz(2)),
            retry_seconds: 0,
            token: None,
            written: true,
        }
    );
    assert_eq!(
        policy.remote,
        Some(RemoteSpec {
            cluster: "diana_config".to_string(),
            authority: "config".to_string(),
            path: "/diana.yaml".to_string(),
            poll_seconds: 10,
            allow: Vec::new(),
            signature: None,
        })
    );
    assert!(policy.dry_run);

    let rules = rules(&policy);
    let ip = rules[0];
    assert_eq!((ip.actor_name.as_str(), ip.algo.code()), ("ip", code("SW")));
    assert_eq!(
        (ip.limit.slices, ip.slots, ip.lease),
        (nz(20), nz(1024), nz(2))
    );
    assert_eq!(ip.name, "/#0");

    let tenant = rules[1];
    assert_eq!(
        (tenant.name.as_str(), tenant.scope, tenant.lease),
        ("tenants", Scope::Global, nz(4))
    );
    let facts = Facts {
        headers: vec![("x-tenant-id", b"acme".to_vec())],
        ip: None,
    };
    assert!(matches!(tenant.identify(&facts), Identity::Key(_)));
    assert_eq!(
        tenant.identify(&Facts::default()),
        Identity::Skip,
        "user actors skip by default"
    );

    let account = rules[2];
    assert_eq!(account.name, "/sample#1");
    assert_eq!(account.algo.code(), code("LB"));
    assert_eq!(
        (account.limit.unit, account.limit.burst),
        (Unit::Minute, nz(2))
    );
    assert!(account.dry_run);
    // Redefined: header lower-cased, fallback shared.
    let facts = Facts {
        headers: vec![("x-user", b"u1".to_vec())],
        ip: None,
    };
    assert!(matches!(account.identify(&facts), Identity::Key(_)));
    assert_eq!(account.identify(&Facts::default()), Identity::Everyone);
}

#[test]
fn redefined_device_keeps_its_fallback() {
    let policy = parse("resources:\n  - Url: /\n    rules: [{rpu: 1, actor: device}]\nactors:\n  device: {header: x-dev}\n");
    let device = rules(&policy)[0];
    let facts = Facts {
        headers: vec![("x-device-id", b"d".to_vec())],
        ip: Some(b"10.0.0.1".to_vec()),
    };
    let by_ip = Facts {
        headers: Vec::new(),
        ip: Some(b"10.0.0.1".to_vec()),
    };
    // x-device-id is no longer read: both fall back to the address.
    assert_eq!(device.identify(&facts), device.identify(&by_ip));
    assert!(matches!(device.identify(&by_ip), Identity::Key(_)));
}

#[test]
fn seed_actor_word_means_account() {
    let policy =
        parse("Url: /\nrules:\n  - {rpu: 1, actor: actor}\n  - {rpu: 1, actor: account}\n");
    let rules = rules(&policy);
    assert_eq!(rules[0].actor_name, "actor");
    let facts = Facts {
        headers: vec![("x-account-id", b"a".to_vec())],
        ip: None,
    };
    assert_eq!(rules[0].identify(&facts), rules[1].identify(&facts));
    assert_eq!(rules[0].identify(&Facts::default()), Identity::Skip);
    // Same counter shape: `actor` and `account` are one actor, so only the occurrence differs.
    let a = parse("Url: /\nrules: [{rpu: 1, actor: actor}]\n");
    let b = parse("Url: /\nrules: [{rpu: 1, actor: account}]\n");
    assert_eq!(ids(&a), ids(&b));
}

#[test]
fn rule_defaults() {
    let policy = parse("Url: /api/\nrules:\n  - rpu: 7\n  - {rpu: 7, actor: account}\n");
    let rules = rules(&policy);
    let rule = rules[0];
    assert_eq!(policy.resources[0].url, "/api");
    assert_eq!(rule.name, "/api#0");
    assert_eq!(rule.actor_name, "all");
    assert_eq!(rule.algo.code(), algo::default_algorithm().code());
    assert_eq!(rule.algo.code(), code("TB"));
    assert_eq!(rule.limit.unit, Unit::Second);
    assert_eq!(
        rule.limit.burst,
        algo::default_algorithm().default_burst(nz(7), Unit::Second)
    );
    assert_eq!(rule.limit.slices, nz(10));
    assert_eq!(rule.scope, Scope::Local);
    assert_eq!(rule.slots, nz(1));
    assert_eq!(Lease::Fixed(rule.lease), GlobalSpec::default().lease);
    assert!(!rule.dry_run);
    assert_eq!(rules[1].slots, nz(65_536));
    // `slots` is ignored (forced to 1) for single-counter actors.
    let policy = parse("Url: /\nrules: [{rpu: 1, slots: 99}]\n");
    assert_eq!(rules_of(&policy)[0].slots, nz(1));
}

fn rules_of(policy: &Policy) -> Vec<&Rule> {
    rules(policy)
}

#[test]
fn burst_default_comes_from_the_algorithm() {
    for (name, unit) in [
        ("LB", "minute"),
        ("TB", "hour"),
        ("W", "second"),
        ("SW", "day"),
    ] {
        let policy = parse(&format!(
            "Url: /\nrules: [{{rpu: 120, algo: {name}, unit: {unit}}}]\n"
        ));
        let rule = rules(&policy)[0];
        let algorithm = algo::lookup(name).expect("known");
        assert_eq!(
            rule.limit.burst,
            algorithm.default_burst(nz(120), rule.limit.unit),
            "{name}"
        );
        assert_eq!(rule.limit.unit, Unit::parse(unit).expect("unit"));
    }
    let policy = parse("Url: /\nrules: [{rpu: 120, algo: LB, burst: 9}]\n");
    assert_eq!(rules(&policy)[0].limit.burst, nz(9));
}

#[test]
fn algorithm_spellings_are_case_insensitive() {
    for algorithm in algo::REGISTRY {
        for spelling in std::iter::once(algorithm.code()).chain(algorithm.aliases().iter().copied())
        {
            for written in [
                spelling.to_string(),
                spelling.to_ascii_uppercase(),
                spelling.to_ascii_lowercase(),
            ] {
                let policy = parse(&format!("Url: /\nrules: [{{rpu: 1, algo: '{written}'}}]\n"));
                assert_eq!(rules(&policy)[0].algo.code(), algorithm.code(), "{written}");
            }
        }
    }
}

#[test]
fn units_scopes_and_modes_spellings() {
    for (written, unit) in [
        ("second", Unit::Second),
        ("Minute", Unit::Minute),
        ("hours", Unit::Hour),
        ("DAY", Unit::Day),
    ] {
        let policy = parse(&format!("Url: /\nrules: [{{rpu: 1, unit: {written}}}]\n"));
        assert_eq!(rules(&policy)[0].limit.unit, unit);
    }
    for (written, scope) in [("local", Scope::Local), ("Global", Scope::Global)] {
        let policy = parse(&format!("Url: /\nrules: [{{rpu: 1, scope: {written}}}]\n"));
        assert_eq!(rules(&policy)[0].scope, scope);
    }
    for (written, mode) in [
        ("none", HeaderMode::None),
        ("limited", HeaderMode::Limited),
        ("ALL", HeaderMode::All),
    ] {
        let policy = parse(&format!(
            "resources: [{{Url: /, rules: []}}]\nresponse: {{headers: {written}}}\n"
        ));
        assert_eq!(policy.response.headers, mode);
    }
    for (written, style) in [
        ("x-ratelimit", HeaderStyle::XRateLimit),
        ("X-RateLimit", HeaderStyle::XRateLimit),
        ("ietf", HeaderStyle::Ietf),
        ("IETF", HeaderStyle::Ietf),
        ("both", HeaderStyle::Both),
    ] {
        let policy = parse(&format!(
            "resources: [{{Url: /, rules: []}}]\nresponse: {{header_style: {written}}}\n"
        ));
        assert_eq!(policy.response.header_style, style);
        assert_eq!(policy.response.headers, HeaderMode::Limited);
    }
    let json = parse(
        r#"{"resources":[{"Url":"/","rules":[{"rpu":1}]}],"response":{"headers":"all","header_style":"ietf"}}"#,
    );
    assert_eq!(json.response.header_style, HeaderStyle::Ietf);
    assert_eq!(json.response.headers, HeaderMode::All);
    assert_eq!(
        parse("Url: /\nrules: [{rpu: 1}]\n").response.header_style,
        HeaderStyle::XRateLimit,
        "default"
    );
}

/// Every name a document accepts is a valid structured-field string once `"` and `\` are
/// escaped (the IETF RateLimit headers carry it): printable ASCII only, explicit or default
/// (a default name is built from the normalised `Url`, in which anything else is
/// percent-encoded).
#[test]
fn rule_names_are_printable_ascii() {
    let policy = parse(
        r#"resources:
  - Url: "/caf\u00e9/a b/\\\"q\t"
    rules: [{rpu: 1}]
  - Url: /x
    rules: [{rpu: 1, name: ' "quoted" \ ~'}]
"#,
    );
    let names: Vec<&str> = policy.rules().map(|rule| rule.name.as_str()).collect();
    assert_eq!(names, [r#" "quoted" \ ~"#, "/caf%C3%A9/a%20b/%5C%22q%09#0"]);
    for name in names {
        assert!(
            name.bytes().all(|byte| (0x20..0x7f).contains(&byte)),
            "{name:?}"
        );
    }
}

#[test]
fn resources_sorted_least_specific_first_and_stable() {
    let policy = parse(
        "- {Url: /a/b/c, rules: []}\n- {Url: /b, rules: []}\n- {Url: /a/b, rules: []}\n\
         - {Url: /a, rules: []}\n- {Url: /, rules: []}\n- {Url: /c/d, rules: []}\n",
    );
    assert_eq!(urls(&policy), ["/", "/b", "/a", "/a/b", "/c/d", "/a/b/c"]);
}

#[test]
fn urls_are_normalised() {
    let policy = parse("- {Url: '//sample/./x/../', rules: []}\n- {Url: '/%7Eme', rules: []}\n- {Url: /café, rules: []}\n");
    assert_eq!(urls(&policy), ["/sample", "/~me", "/caf%C3%A9"]);
    let policy = parse("- {Url: /a/.., rules: []}\n");
    assert_eq!(urls(&policy), ["/"]);
}

#[test]
fn remote_authority_defaults_to_cluster() {
    let policy = parse("resources: [{Url: /, rules: []}]\nremote: {cluster: cfg, path: /d.yaml, poll_seconds: 2}\n");
    let remote = policy.remote.expect("remote");
    assert_eq!(
        (
            remote.cluster.as_str(),
            remote.authority.as_str(),
            remote.poll_seconds
        ),
        ("cfg", "cfg", 2)
    );
}

// ---------------------------------------------------------------------------------------
// Rule ids.

#[test]
fn rule_ids_are_stable() {
    let base =
        "Url: /\nrules:\n  - {rpu: 5, actor: device}\n  - {rpu: 5, actor: device}\n  - {rpu: 9}\n";
    let a = parse(base);
    let b = parse(base);
    assert_eq!(ids(&a), ids(&b), "same document, same ids");
    let ids_a = ids(&a);
    assert_ne!(ids_a[0], ids_a[1], "identical rules do not share counters");
    assert_ne!(ids_a[0], ids_a[2]);

    // Inserting an unrelated rule does not move the others; names and dry runs don't matter.
    let inserted = parse("Url: /\nrules:\n  - {rpu: 1, algo: W}\n  - {rpu: 5, actor: device, name: d}\n  - {rpu: 5, actor: device, dry_run: true}\n  - {rpu: 9}\n");
    assert_eq!(ids(&inserted)[1..], ids_a[..]);

    // Anything that shapes the counter changes the id.
    let changed = [
        "Url: /\nrules:\n  - {rpu: 6, actor: device}\n",
        "Url: /\nrules:\n  - {rpu: 5, actor: account}\n",
        "Url: /\nrules:\n  - {rpu: 5, actor: device, unit: minute}\n",
        "Url: /\nrules:\n  - {rpu: 5, actor: device, algo: W}\n",
        "Url: /\nrules:\n  - {rpu: 5, actor: device, burst: 6}\n",
        "Url: /\nrules:\n  - {rpu: 5, actor: device, slices: 5}\n",
        "Url: /\nrules:\n  - {rpu: 5, actor: device, slots: 5}\n",
        "Url: /\nrules:\n  - {rpu: 5, actor: device, scope: global}\n",
        "Url: /x\nrules:\n  - {rpu: 5, actor: device}\n",
        "resources: [{Url: /, rules: [{rpu: 5, actor: device}]}]\nactors: {device: {header: x-other}}\n",
        "resources: [{Url: /, rules: [{rpu: 5, actor: device}]}]\nactors: {device: {fallback: skip}}\n",
    ];
    for text in changed {
        assert_ne!(ids(&parse(text))[0], ids_a[0], "{text}");
    }
    // Spelling the same thing differently keeps the id.
    let same = [
        "Url: /\nrules:\n  - {rpu: 5, actor: device, unit: second, algo: tb, slices: 10, scope: local}\n",
        "url: //\nrules:\n  - {rpu: 5, actor: device, slots: 65536}\n",
        "resources: [{Url: /, rules: [{rpu: 5, actor: device}]}]\nactors: {device: {header: X-Device-Id, fallback: ip}}\n",
        "{\"Url\": \"/\", \"rules\": [{\"rpu\": 5, \"actor\": \"device\"}]}",
    ];
    for text in same {
        assert_eq!(ids(&parse(text))[0], ids_a[0], "{text}");
    }
}

// ---------------------------------------------------------------------------------------
// Errors: each names the field path and the position.

/// `(document, expected pieces of the message in order)`; every YAML/JSON error must also
/// carry `at line L column C`.
#[test]
fn an_actor_may_count_by_a_claim_of_the_bearer_token() {
    let policy = parse(
        "resources: [{Url: /, rules: [{rpu: 5, actor: user}, {rpu: 50, actor: org, scope: global}]}]\n\
         actors:\n  user: {jwt_claim: sub}\n  org: {jwt_claim: /org/id, fallback: ip}\n",
    );
    let specs: Vec<&str> = rules(&policy)
        .iter()
        .map(|rule| rule.actor_spec.as_str())
        .collect();
    assert_eq!(
        specs,
        [
            "jwt_claim=/sub;fallback=skip",
            "jwt_claim=/org/id;fallback=ip"
        ]
    );
}

#[test]
fn an_actor_may_read_its_claim_from_jwt_authn_metadata() {
    let policy = parse(
        "resources: [{Url: /, rules: [{rpu: 5, actor: user}, {rpu: 50, actor: org}, {rpu: 9, actor: account}]}]\n\
         actors:\n  user: {jwt_claim: sub, from: {jwt_authn: jwt_payload}}\n  \
         org: {from: {jwt_authn: 'https://issuer.example.com'}, jwt_claim: /org/id, fallback: ip}\n  \
         account: {jwt_claim: sub, from: {jwt_authn: ' p '}}\n",
    );
    let specs: Vec<&str> = rules(&policy)
        .iter()
        .map(|rule| rule.actor_spec.as_str())
        .collect();
    assert_eq!(
        specs,
        [
            "jwt_claim=/sub;from=jwt_authn:jwt_payload;fallback=skip",
            "jwt_claim=/org/id;from=jwt_authn:https://issuer.example.com;fallback=ip",
            // A built-in actor keeps its fallback (account: skip).
            "jwt_claim=/sub;from=jwt_authn:p;fallback=skip",
        ]
    );
    // `diana check` shows where the claim is read.
    let settings = rules(&policy)[0].actor_source();
    assert!(
        settings.contains(&("from", "jwt_authn:jwt_payload")),
        "{settings:?}"
    );
    // Reading the token or the metadata are two sources: two rule ids.
    let header = parse(
        "resources: [{Url: /, rules: [{rpu: 5, actor: user}]}]\nactors:\n  user: {jwt_claim: sub}\n",
    );
    assert_ne!(rules(&header)[0].id, rules(&policy)[0].id);
}

#[test]
fn errors_name_field_and_position() {
    let table: &[(&str, &[&str])] = &[
        // rpu
        ("Url: /\nrules:\n  - rpu: 1\n  - rpu: 0\n", &["rules[1].rpu: ", "expected a nonzero u32", "at line 4 column 10"]),
        (
            "resources:\n  - Url: /\n    rules:\n      - rpu: 10\n      - rpu: 0\n",
            &["resources[0].rules[1].rpu: invalid value: integer `0`, expected a nonzero u32 at line 5 column 14"],
        ),
        ("Url: /\nrules:\n  - rpu: -3\n", &["rules[0].rpu: ", "-3", "line 3 column 10"]),
        ("Url: /\nrules:\n  - rpu: ten\n", &["rules[0].rpu: ", "invalid type", "line 3"]),
        // concurrency
        ("Url: /\nrules:\n  - unit: second\n", &["rules[0]: ", "missing field `rpu`", "max_in_flight", "line 3"]),
        ("Url: /\nrules:\n  - {rpu: 5, max_in_flight: 5}\n", &["rules[0].max_in_flight: ", "write two rules", "line 3"]),
        ("Url: /\nrules:\n  - {max_in_flight: 0}\n", &["rules[0].max_in_flight: ", "between 1 and 1000000", "line 3"]),
        ("Url: /\nrules:\n  - {max_in_flight: 5, unit: minute}\n", &["rules[0].unit: ", "does not apply to a concurrency limit", "line 3"]),
        ("Url: /\nrules:\n  - {max_in_flight: 5, algo: TB}\n", &["rules[0].algo: ", "does not apply to a concurrency limit"]),
        ("Url: /\nrules:\n  - {max_in_flight: 5, count: {status: [500]}}\n", &["rules[0].count: ", "does not apply"]),
        // reservations and counted statuses
        ("Url: /\nrules:\n  - rpu: 1000\n    cost: 2\n    response_cost: {header: x-t, max: 9, reserve: 5}\n", &["rules[0].cost: ", "remove `cost`", "line 4"]),
        ("Url: /\nrules:\n  - rpu: 100\n    response_cost: {header: x-t, max: 9, reserve: 500}\n", &["rules[0].response_cost.reserve: ", "a cost of 500 could never pass", "line 4"]),
        ("Url: /\nrules:\n  - rpu: 1000\n    response_cost: {header: x-t, max: 9, reserve: {header: x-m, max: 600, default: 700}}\n", &["rules[0].response_cost.reserve.default: ", "cost.default (700) is above cost.max (600)"]),
        ("Url: /\nrules:\n  - rpu: 1000\n    scope: global\n    lease: 10\n    response_cost: {header: x-t, max: 9, reserve: 200}\n", &["rules[0].response_cost.reserve: ", "above the lease (10)", "line 6"]),
        ("Url: /\nrules:\n  - rpu: 5\n    algo: LB\n    count: {status: [401]}\n", &["rules[0].count: ", "count does not apply to algo LB", "line 5"]),
        ("Url: /\nrules:\n  - rpu: 5\n    count: {status: [401]}\n    response_cost: {header: x-t, max: 9}\n", &["rules[0].count: ", "write two rules", "line 4"]),
        ("Url: /\nrules:\n  - rpu: 5\n    count: {status: [401, 6xx]}\n", &["rules[0].count.status", "6xx", "line 4"]),
        ("Url: /\nrules:\n  - rpu: 5\n    count: {status: [99]}\n", &["rules[0].count.status", "line 4"]),
        ("Url: /\nrules:\n  - rpu: 5\n    count: {status: []}\n", &["rules[0].count.status: ", "1 to 32 statuses", "line 4"]),
        // plans
        ("Url: /\nrules:\n  - rpu: {by: x-plan, values: {free: 0}, default: 1}\n", &["rules[0].rpu.values.free: ", "expected a nonzero u32", "line 3"]),
        ("Url: /\nrules:\n  - rpu: {by: x-plan, values: {default: 2}, default: 1}\n", &["rules[0].rpu.values", "`default` names the plan of every other value", "line 3"]),
        ("Url: /\nrules:\n  - rpu: {by: x-plan, values: {a: 2, a: 3}, default: 1}\n", &["rules[0].rpu.values", "duplicate", "line 3"]),
        ("Url: /\nrules:\n  - rpu: {by: x-plan, values: {}, default: 1}\n", &["rules[0].rpu.values: ", "no plans", "line 3"]),
        ("Url: /\nrules:\n  - rpu: {by: x-plan, values: {free: 2}}\n", &["rules[0].rpu: ", "missing field `default`", "line 3"]),
        ("Url: /\nrules:\n  - rpu: {by: 'x plan', values: {free: 2}, default: 1}\n", &["rules[0].rpu.by: ", "line 3"]),
        (
            "Url: /\nrules:\n  - rpu: {by: x-plan, values: {free: 2, pro: 50}, default: 1}\n    cost: 10\n",
            &["rules[0].cost: ", "a cost of 10 could never pass: the rule grants at most 2", "line 4"],
        ),
        (
            "Url: /\nrules:\n  - rpu: {by: x-plan, values: {pro: 2}, default: 1}\n    name: api\n  - {rpu: 1, name: api.pro}\n",
            &["rules[1].name: ", "api.pro", "line 5"],
        ),
        ("Url: /\nrules:\n  - rpu: 4294967296\n", &["rules[0].rpu: ", "line 3"]),
        ("Url: /\nrules:\n  - unit: second\n", &["rules[0]: ", "missing field `rpu`", "line 3"]),
        // unknown and misspelled keys
        ("Url: /\nrules:\n  - rpu: 1\n    Unit: second\n", &["rules[0].Unit: ", "unknown field `Unit`", "line 4 column 5"]),
        ("Url: /\nrules:\n  - rpu: 1\n    rpus: 1\n", &["rules[0].rpus: ", "unknown field `rpus`", "line 4"]),
        ("URL: /\nrules: []\n", &["URL: ", "unknown field `URL`", "line 1 column 1"]),
        ("Url: /\nrule: []\n", &["rule: ", "unknown field `rule`", "line 2"]),
        ("resources: []\nresponses: {}\n", &["responses: ", "unknown field `responses`", "line 2"]),
        ("resources: []\nglobal: {lease: 1, leases: 2}\n", &["global.leases: ", "unknown field", "line 2"]),
        ("Url: /\nUrl: /x\nrules: []\n", &["duplicate field `Url`", "line 1 column 1"]),
        ("Url: /\nurl: /x\nrules: []\n", &["duplicate field `Url`", "line"]),
        ("Url: /\n", &["missing field `rules`", "line 1"]),
        ("rules: []\n", &["missing field `Url`", "line 1"]),
        // Url
        ("Url: sample\nrules: []\n", &["Url: ", "must start with `/`", "line 1 column 6"]),
        ("- Url: /a\n  rules: []\n- Url: a\n  rules: []\n", &["[1].Url: ", "must start with `/`", "line 3 column 8"]),
        ("Url: /a?b=1\nrules: []\n", &["Url: ", "without `?query`", "line 1"]),
        ("Url: 42\nrules: []\n", &["Url: ", "must start with `/`", "line 1"]),
        (
            "- Url: /sample\n  rules: []\n- Url: //sample/\n  rules: []\n",
            &["[1].Url: ", "duplicate resource `//sample/`", "`/sample` after normalisation", "line 3 column 8"],
        ),
        ("resources:\n  - {Url: /x, rules: []}\n  - {url: /x, rules: []}\n", &["resources[1].url: ", "duplicate resource `/x`", "line 3"]),
        ("Url: /x\nrules: []\n---\nUrl: /x/.\nrules: []\n", &["document 2: Url: ", "duplicate resource", "line 4"]),
        // actor
        ("Url: /\nrules:\n  - {rpu: 1, actor: bob}\n", &["rules[0].actor: ", "unknown actor `bob`", "all, ip, account, device", "line 3"]),
        ("Url: /\nrules:\n  - {rpu: 1, actor: Device}\n", &["rules[0].actor: ", "unknown actor `Device`", "line 3"]),
        // algo
        (
            "Url: /\nrules:\n  - rpu: 1\n    algo: fast\n",
            &["rules[0].algo: ", "unknown algorithm `fast`", "expected one of", "line 4 column 11"],
        ),
        // unit, scope
        ("Url: /\nrules:\n  - {rpu: 1, unit: fortnight}\n", &["rules[0].unit: ", "unknown unit `fortnight`", "second, minute, hour, day, week, month", "line 3"]),
        ("Url: /\nrules:\n  - {rpu: 1, scope: cluster}\n", &["rules[0].scope: ", "unknown scope `cluster`", "line 3"]),
        // ranges
        ("Url: /\nrules:\n  - {rpu: 1, burst: 0}\n", &["rules[0].burst: ", "nonzero", "line 3"]),
        ("Url: /\nrules:\n  - {rpu: 1, lease: 0}\n", &["rules[0].lease: ", "between 1 and 100000", "line 3"]),
        ("Url: /\nrules:\n  - {rpu: 1, lease: 200000}\n", &["rules[0].lease: ", "integer `200000`", "between 1 and 100000", "line 3"]),
        ("Url: /\nrules:\n  - {rpu: 1, algo: LB, max_wait_seconds: 86401}\n", &["rules[0].max_wait_seconds: ", "between 0 and 86400", "line 3"]),

        ("Url: /\nrules:\n  - {rpu: 1, slices: 0}\n", &["rules[0].slices: ", "between 1 and 60", "line 3"]),
        ("Url: /\nrules:\n  - {rpu: 1, slices: 61}\n", &["rules[0].slices: ", "integer `61`", "between 1 and 60", "line 3"]),
        ("Url: /\nrules:\n  - {rpu: 1, slots: 0}\n", &["rules[0].slots: ", "between 1 and 1048576", "line 3"]),
        ("Url: /\nrules:\n  - {rpu: 1, slots: 1048577}\n", &["rules[0].slots: ", "between 1 and 1048576", "line 3"]),
        ("Url: /\nrules:\n  - {rpu: 1, slots: -1}\n", &["rules[0].slots: ", "integer `-1`", "line 3"]),
        ("Url: /\nrules:\n  - {rpu: 1, dry_run: yes}\n", &["rules[0].dry_run: ", "invalid type", "line 3"]),
        // rule names
        ("Url: /\nrules:\n  - {rpu: 1, name: a}\n  - {rpu: 1, name: a}\n", &["rules[1].name: ", "duplicate rule name `a`", "line 4"]),
        ("Url: /\nrules:\n  - {rpu: 1, name: ''}\n", &["rules[0].name: ", "empty rule name", "line 3"]),
        ("Url: /\nrules:\n  - {rpu: 1, name: \"a\\nb\"}\n", &["rules[0].name: ", "printable ASCII", "line 3"]),
        (
            "Url: /\nrules:\n  - {rpu: 1}\n  - rpu: 2\n    name: \"café\"\n",
            &["rules[1].name: ", "invalid rule name `café`", "printable ASCII (0x20 to 0x7E)", "RateLimit headers", "line 5 column 11"],
        ),
        ("Url: /\nrules:\n  - {rpu: 1, name: \"tab\\there\"}\n", &["rules[0].name: ", "invalid rule name `tab\\there`", "line 3"]),
        (
            "{\"Url\": \"/\", \"rules\": [{\"rpu\": 1, \"name\": \"bell\\u0007\"}]}",
            &["rules[0].name: ", "invalid rule name `bell\\u{7}`", "printable ASCII", "line 1 column"],
        ),
        // response
        ("resources: []\nresponse:\n  status: 99\n", &["response.status: ", "integer `99`", "between 100 and 599", "line 3 column 11"]),
        ("resources: []\nresponse: {status: 600}\n", &["response.status: ", "integer `600`", "line 2"]),
        ("resources: []\nresponse: {headers: some}\n", &["response.headers: ", "unknown headers mode `some`", "line 2"]),
        (
            "resources: []\nresponse:\n  headers: all\n  header_style: rfc\n",
            &["response.header_style: ", "unknown header style `rfc`", "expected one of x-ratelimit, ietf, both", "line 4 column 17"],
        ),
        ("resources: []\nresponse: {header_style: [ietf]}\n", &["response.header_style: ", "invalid type: sequence", "x-ratelimit, ietf or both", "line 2"]),
        ("resources: []\nresponse: {headerstyle: ietf}\n", &["response.headerstyle: ", "unknown field `headerstyle`", "header_style", "line 2"]),
        ("resources: []\nresponse: {body: [1]}\n", &["response.body: ", "invalid type", "line 2"]),
        // global
        ("resources: []\nglobal: {timeout_ms: 0}\n", &["global.timeout_ms: ", "between 1 and 60000", "line 2"]),
        ("resources: []\nglobal: {timeout_ms: 60001}\n", &["global.timeout_ms: ", "between 1 and 60000", "line 2"]),
        ("resources: []\nglobal: {retry_seconds: 3601}\n", &["global.retry_seconds: ", "between 0 and 3600", "line 2"]),
        ("resources: []\nglobal: {lease: 0}\n", &["global.lease: ", "between 1 and 100000", "line 2"]),
        ("resources: []\nglobal: {path: v1/acquire}\n", &["global.path: ", "must start with `/`", "line 2"]),
        ("resources: []\nglobal: {cluster: ''}\n", &["global.cluster: ", "empty", "line 2"]),
        ("resources: []\nglobal: {retry_seconds: -1}\n", &["global.retry_seconds: ", "line 2"]),
        // remote
        ("resources: []\nremote:\n  cluster: c\n  path: /d\n  poll_seconds: 0\n", &["remote.poll_seconds: ", "nonzero", "line 5 column 17"]),
        ("resources: []\nremote: {path: /d}\n", &["remote: ", "missing field `cluster`", "line 2"]),
        ("resources: []\nremote: {cluster: c}\n", &["remote: ", "missing field `path`", "line 2"]),
        // actors
        ("resources: []\nactors:\n  all: {header: x}\n", &["actors", "`all` is built in", "line 3"]),
        ("resources: []\nactors:\n  ip: {header: x}\n", &["actors", "`ip` is built in", "line 3"]),
        ("resources: []\nactors:\n  actor: {header: x}\n", &["actors", "`actor` is built in", "line 3"]),
        ("resources: []\nactors:\n  t: {cookie: sid}\n", &["actors.t", "unknown field `cookie`", "`header`", "line 3"]),
        ("resources: []\nactors:\n  t: {fallback: ip}\n", &["actors.t: ", "needs a source", "`header`, `jwt_claim`", "line 3"]),
        ("resources: []\nactors:\n  t: {header: x, fallback: never}\n", &["actors.t.fallback: ", "unknown fallback `never`", "skip, ip, shared", "line 3"]),
        ("resources: []\nactors:\n  t: {header: 'x y'}\n", &["actors.t.header: ", "invalid header name", "line 3"]),
        ("resources: []\nactors:\n  t: {header: ''}\n", &["actors.t.header: ", "empty header name", "line 3"]),
        ("resources: []\nactors:\n  t: {jwt_claim: '/org/a~2'}\n", &["actors.t.jwt_claim: ", "JSON Pointer", "line 3"]),
        ("resources: []\nactors:\n  t: {jwt_claim: ''}\n", &["actors.t.jwt_claim: ", "empty claim", "line 3"]),
        ("resources: []\nactors:\n  t: {jwt_claim: sub, header: x}\n", &["actors.t", "two sources", "line 3"]),
        // `from`: where a claim is read
        ("resources: []\nactors:\n  t: {header: x, from: {jwt_authn: p}}\n", &["actors.t: ", "`from` says where a `jwt_claim` is read", "`header`", "line 3"]),
        ("resources: []\nactors:\n  t: {from: {jwt_authn: p}}\n", &["actors.t: ", "needs a source", "line 3"]),
        ("resources: []\nactors:\n  t: {jwt_claim: sub, from: {jwt_authn: ''}}\n", &["actors.t.from.jwt_authn: ", "empty `payload_in_metadata` name", "line 3"]),
        ("resources: []\nactors:\n  t: {jwt_claim: sub, from: {jwt_authn: 'a;b'}}\n", &["actors.t.from.jwt_authn: ", "character ';' is not allowed", "line 3"]),
        ("resources: []\nactors:\n  t: {jwt_claim: sub, from: {jwt_authn: p, header: x}}\n", &["actors.t.from", "unknown field `header`", "line 3"]),
        ("resources: []\nactors:\n  t: {jwt_claim: sub, from: jwt_authn}\n", &["actors.t.from: ", "invalid type", "`{jwt_authn: NAME}`", "line 3"]),
        ("resources: []\nactors:\n  t: {jwt_claim: sub, from: {}}\n", &["actors.t.from: ", "missing field `jwt_authn`", "line 3"]),
        ("resources: []\nactors:\n  t: {jwt_claim: sub, from: {jwt_authn: p}, from: {jwt_authn: q}}\n", &["actors.t", "duplicate field `from`", "line 3"]),
        ("resources: []\nactors:\n  t: {jwt_claim: \"/a\\0b\", from: {jwt_authn: p}}\n", &["actors.t: ", "cannot contain a NUL", "line 3"]),
        ("resources: []\nactors:\n  t: {jwt_claim: sub, from: {jwt_authn: p}, fallback: x}\n", &["actors.t.fallback: ", "unknown fallback", "line 3"]),
        ("resources: []\nactors:\n  'a b': {header: x}\n", &["actors", "invalid actor name", "line 3"]),
        ("resources: []\nactors:\n  t: x-tenant\n", &["actors.t: ", "invalid type", "line 3"]),
        ("resources: []\nactors: [t]\n", &["actors: ", "invalid type", "line 2"]),
        // sections repeated across documents
        (
            "Url: /\nrules: []\n---\nglobal: {lease: 2}\n---\nglobal: {lease: 3}\n",
            &["document 3: ", "global", "section `global` is already given by an earlier document", "line 6"],
        ),
        // `resources` too (issue 22, item 4: two lists were merged)
        (
            "resources:\n  - Url: /\n    rules: []\n---\nresources:\n  - Url: /a\n    rules: []\n",
            &["document 2: ", "resources: ", "section `resources` is already given by an earlier document", "line 6 column 3"],
        ),
        (
            "resources: [{Url: /, rules: []}]\n---\nUrl: /b\nrules: []\n---\nresources: [{Url: /c, rules: []}]\n",
            &["document 3: ", "resources: ", "section `resources` is already given", "line 6 column 12"],
        ),
        // a lease on a local rule (issue 22, item 4: accepted silently)
        ("Url: /\nrules:\n  - rpu: 5\n    lease: 4\n", &["rules[0].lease: ", "lease applies to scope: global rules only", "line 4 column 12"]),
        ("Url: /\nrules: [{rpu: 5, scope: local, lease: auto}]\n", &["rules[0].lease: ", "this rule is local", "line 2 column 39"]),
        (
            "{\"resources\": [{\"Url\": \"/\", \"rules\": [{\"rpu\": 5, \"lease\": 2}]}]}",
            &["resources[0].rules[0].lease: ", "scope: global", "line 1 column"],
        ),
        ("Url: /\nrules: []\n---\nUrl: /a\nrules:\n  - rpu: 0\n", &["document 2: rules[0].rpu: ", "nonzero", "line 6 column 10"]),
        // structure
        ("Url: /\nrules: 5\n", &["rules: ", "invalid type: integer `5`", "expected a sequence", "line 2"]),
        ("Url: /\nrules:\n  - 5\n", &["rules[0]: ", "invalid type", "expected a rule", "line 3"]),
        ("hello\n", &["invalid type: string \"hello\"", "expected a resource block", "line 1 column 1"]),
        ("- hello\n", &["[0]: ", "invalid type", "line 1 column 3"]),
        ("resources: 5\n", &["resources: ", "invalid type", "line 1"]),
        // YAML syntax
        ("Url: /\nrules: [\n", &["invalid YAML", "line 3 column 1"]),
        ("Url: /\n  rules: []\n", &["invalid YAML", "line 2"]),
        ("Url: /\nrules: []\nrules: []\n", &["duplicate field `rules`", "line 1 column 1"]),
        ("resources: []\nactors:\n  t: {header: x}\n  t: {header: y}\n", &["actors", "`t` is defined twice", "line 4"]),
        // JSON
        (r#"{"Url": "/", "rules": [{"rpu": 0}]}"#, &["rules[0].rpu: ", "nonzero", "line 1 column 32"]),
        (
            "{\n  \"resources\": [\n    {\"Url\": \"/\", \"rules\": [{\"rpu\": 1, \"actor\": \"x\"}]}\n  ]\n}",
            &["resources[0].rules[0].actor: ", "unknown actor `x`", "line 3 column"],
        ),
        (r#"{"resources": [], "response": {"status": 1000}}"#, &["response.status: ", "integer `1000`", "line 1"]),
        (r#"{"Url": "/", "rules": [], "extra": true}"#, &["extra: ", "unknown field `extra`", "line 1"]),
    ];
    for (text, pieces) in table {
        let message = error(text);
        let mut rest = message.as_str();
        for piece in *pieces {
            match rest.find(piece) {
                Some(at) => rest = &rest[at + piece.len()..],
                None => panic!("message for\n{text}\nis\n  {message}\nexpected, in order: {pieces:?} (missing {piece:?})"),
            }
        }
        assert!(message.contains("line "), "{message}");
        assert!(message.contains(" column "), "{message}");
    }
}

#[test]
fn empty_documents_are_rejected_clearly() {
    for text in [
        "",
        "   \n",
        "# only a comment\n",
        "---\n",
        "---\n...\n---\n",
        "[]",
        "{}",
        "null",
        "resources: []\n",
        "{\"resources\": []}",
        "- []\n",
    ] {
        let message = parse_policy(text)
            .err()
            .map(|err| err.to_string())
            .unwrap_or_default();
        // `- []` is a sequence holding a non-block: a type error with a position.
        if text == "- []\n" {
            assert!(
                message.contains("[0]") && message.contains("line 1"),
                "{text:?}: {message}"
            );
        } else {
            assert!(message.contains("no resources"), "{text:?}: {message}");
        }
    }
}

#[test]
fn unknown_algorithm_message_lists_every_known_spelling() {
    let message = error("Url: /\nrules: [{rpu: 1, algo: nope}]\n");
    for algorithm in algo::REGISTRY {
        assert!(message.contains(algorithm.code()), "{message}");
    }
}

#[test]
fn a_rejected_document_leaves_no_trace() {
    // The duplicate check must not remember urls of a failed parse.
    let _ = error("- {Url: /x, rules: []}\n- {Url: /y, rules: [{rpu: 0}]}\n");
    let policy = parse("- {Url: /x, rules: []}\n- {Url: /y, rules: []}\n");
    assert_eq!(urls(&policy), ["/x", "/y"]);
    // Nor the actor names of another document.
    let _ =
        parse("resources: [{Url: /, rules: [{rpu: 1, actor: t}]}]\nactors: {t: {header: x-t}}\n");
    assert!(error("Url: /\nrules: [{rpu: 1, actor: t}]\n").contains("unknown actor `t`"));
}

#[test]
fn actors_defined_in_another_document_are_usable() {
    let policy = parse(
        "Url: /\nrules: [{rpu: 1, actor: tenant}]\n---\nactors: {tenant: {header: x-tenant-id}}\n",
    );
    assert_eq!(rules(&policy)[0].actor_name, "tenant");
}

#[test]
fn hostile_documents_fail_cleanly() {
    // Deep nesting and alias bombs are refused by the YAML reader, never a crash.
    let deep = format!(
        "Url: /\nrules: {}{}\n",
        "[".repeat(10_000),
        "]".repeat(10_000)
    );
    assert!(parse_policy(&deep).is_err());
    let bomb = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n\
                c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n\
                e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]\n\
                g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]\nh: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]\n";
    assert!(parse_policy(bomb).is_err());
    assert!(parse_policy("\u{0}\u{1}\u{2}").is_err());
    assert!(parse_policy("Url: /\nrules: [{rpu: 1, name: \"\u{e9}\"}]\n").is_err());
}

/// Checks that look at more than one value: the message names the rule or the resource.
#[test]
fn what_the_quota_service_or_the_metrics_would_refuse_is_refused_at_load() {
    let mut many = String::from("resources:\n  - Url: /\n    rules:\n");
    for i in 0..40 {
        many.push_str(&format!("      - {{name: a{i}, rpu: 5, scope: global}}\n"));
    }
    many.push_str("  - Url: /api\n    rules:\n");
    for i in 0..25 {
        many.push_str(&format!("      - {{name: b{i}, rpu: 5, scope: global}}\n"));
    }
    assert_eq!(
        error(&many),
        "resources[1].Url: a request to /api would carry 65 global rules (its own and those of the \
         resources above it); one callout carries at most 64 at line 44 column 10"
    );
    // 64 in all is fine.
    assert!(parse_policy(&many.replace("b24", "x").replacen(
        "      - {name: x, rpu: 5, scope: global}\n",
        "",
        1
    ))
    .is_ok());
}

/// Every refusal that looks at more than one value names the field path and the line and
/// column of the value, like the reader's own refusals (issue 22, item 3), in every form:
/// `(document, kind, document label, path, line, column)`.
#[test]
fn checks_across_fields_name_the_field_path_and_position() {
    use super::{ConfigErrorKind as K, Position};
    let mut costly = String::from("resources:\n  - Url: /\n    rules:\n");
    for i in 0..12 {
        costly.push_str(&format!(
            "      - {{name: r{i}, rpu: 1000000, unit: hour, scope: global, lease: 100000, cost: 100000}}\n"
        ));
    }
    let mut many = String::from("resources:\n  - Url: /\n    rules:\n");
    for i in 0..40 {
        many.push_str(&format!("      - {{name: a{i}, rpu: 5, scope: global}}\n"));
    }
    many.push_str("  - Url: /api\n    rules:\n");
    for i in 0..25 {
        many.push_str(&format!("      - {{name: b{i}, rpu: 5, scope: global}}\n"));
    }
    let never = |cost, capacity| K::CostNeverPasses { cost, capacity };
    let no_wait = K::MaxWaitNotApplicable { algo: "TB" };
    /// `(document, kind, document label, path, line, column)`.
    type Case = (String, K, Option<usize>, &'static str, usize, usize);
    let table: Vec<Case> = vec![
        // cost above what the rule grants at once: flow, block, header, sequence, JSON
        ("Url: /\nrules:\n  - {rpu: 10, cost: 11}\n".into(), never(11, 10), None, "rules[0].cost", 3, 21),
        ("Url: /\nrules:\n  - rpu: 10\n    cost: 11\n".into(), never(11, 10), None, "rules[0].cost", 4, 11),
        (
            "Url: /\nrules:\n  - {rpu: 5, algo: TB, burst: 8, cost: {header: x-cost, max: 9}}\n".into(),
            never(9, 8),
            None,
            "rules[0].cost.max",
            3,
            62,
        ),
        (
            "- Url: /a\n  rules: []\n- Url: /b\n  rules:\n    - rpu: 5\n      cost: 6\n".into(),
            never(6, 5),
            None,
            "[1].rules[0].cost",
            6,
            13,
        ),
        (
            "{\n  \"Url\": \"/\",\n  \"rules\": [\n    {\"rpu\": 1, \"cost\": {\"header\": \"x\", \"max\": 5}}\n  ]\n}".into(),
            never(5, 1),
            None,
            "rules[0].cost.max",
            4,
            47,
        ),
        // cost above the lease of a global rule
        (
            "Url: /\nrules:\n  - {rpu: 100, scope: global, cost: 20}\n".into(),
            K::CostAboveLease { cost: 20, lease: 1 },
            None,
            "rules[0].cost",
            3,
            37,
        ),
        (
            "Url: /\nrules:\n  - {rpu: 100, scope: global, cost: {header: x-cost, max: 20}}\n".into(),
            K::CostAboveLease { cost: 20, lease: 1 },
            None,
            "rules[0].cost.max",
            3,
            59,
        ),
        // cost.default above cost.max
        (
            "Url: /\nrules:\n  - {rpu: 10, cost: {header: x-cost, default: 5, max: 3}}\n".into(),
            K::CostDefaultAboveMax { default: 5, max: 3 },
            None,
            "rules[0].cost.default",
            3,
            47,
        ),
        // response_cost on a leaky bucket
        (
            "Url: /\nrules:\n  - rpu: 10\n    algo: LB\n    response_cost: {header: x, max: 5}\n".into(),
            K::ResponseCostNotApplicable { algo: "LB" },
            None,
            "rules[0].response_cost",
            5,
            20,
        ),
        // max_wait_seconds on anything but a leaky bucket: flow, full form, second document, JSON
        ("Url: /\nrules:\n  - {rpu: 1, max_wait_seconds: 5}\n".into(), no_wait.clone(), None, "rules[0].max_wait_seconds", 3, 32),
        (
            "resources:\n  - Url: /\n    rules:\n      - rpu: 1\n        max_wait_seconds: 5\n".into(),
            no_wait.clone(),
            None,
            "resources[0].rules[0].max_wait_seconds",
            5,
            27,
        ),
        (
            "Url: /\nrules: []\n---\nUrl: /x\nrules:\n  - rpu: 1\n    max_wait_seconds: 3\n".into(),
            no_wait.clone(),
            Some(2),
            "rules[0].max_wait_seconds",
            7,
            23,
        ),
        (
            r#"{"Url": "/", "rules": [{"rpu": 1, "max_wait_seconds": 5}]}"#.into(),
            no_wait,
            None,
            "rules[0].max_wait_seconds",
            1,
            55,
        ),
        // what the quota service refuses: a bucket spanning more than a day
        (
            "resources: [{Url: /, rules: [{algo: TB, rpu: 1, unit: day, burst: 5, scope: global}]}]\n".into(),
            K::QuotaBounds {
                reason: "5 at 1 per day spans 432000 s (burst × unit / rpu), more than a day (86400 s): at most 1 at this rate".into(),
            },
            None,
            "resources[0].rules[0].burst",
            1,
            67,
        ),
        // names: the later rule's name, or the rule itself when its name is the default
        (
            "Url: /\nrules:\n  - {rpu: 1, name: a-b}\n  - {rpu: 2, name: a_b}\n".into(),
            K::MetricNameClash { first: "a-b".into(), second: "a_b".into() },
            None,
            "rules[1].name",
            4,
            20,
        ),
        (
            "Url: /\nrules:\n  - {rpu: 1}\n  - {rpu: 2, name: \"/#0\"}\n".into(),
            K::DuplicateRuleName { name: "/#0".into() },
            None,
            "rules[1].name",
            4,
            20,
        ),
        (
            "Url: /\nrules:\n  - {rpu: 1, name: \"/#1\"}\n  - {rpu: 2}\n".into(),
            K::DuplicateRuleName { name: "/#1".into() },
            None,
            "rules[1]",
            4,
            5,
        ),
        // what one callout could not carry: the resource's Url
        (
            costly,
            K::TokensPerCallout { url: "/".into(), tokens: 1_200_000, most: 1_000_000 },
            None,
            "resources[0].Url",
            2,
            10,
        ),
        (
            many,
            K::RulesPerCallout { url: "/api".into(), rules: 65, most: 64 },
            None,
            "resources[1].Url",
            44,
            10,
        ),
        // no resources, in a document that has the section
        ("resources: []\n".into(), K::NoResources, None, "resources", 1, 12),
    ];
    for (text, kind, document, path, line, column) in table {
        let error = parse_policy(&text).expect_err(&text);
        assert_eq!(
            (
                &error.kind,
                error.document,
                error.path.as_str(),
                error.position
            ),
            (&kind, document, path, Some(Position { line, column })),
            "{text}\n  -> {error}"
        );
        let label = document.map_or_else(String::new, |n| format!("document {n}: "));
        assert_eq!(
            error.to_string(),
            format!("{label}{path}: {kind} at line {line} column {column}"),
        );
    }
}

/// The error is a value: what is wrong, where, and one line for logs (today's format).
#[test]
fn config_errors_are_typed_and_display_as_one_line() {
    use super::{ConfigErrorKind, Position};
    let error = parse_policy("Url: /\nrules:\n  - rpu: 0\n").unwrap_err();
    assert_eq!(error.path, "rules[0].rpu");
    assert_eq!(
        error.position,
        Some(Position {
            line: 3,
            column: 10
        })
    );
    assert_eq!(error.document, None);
    assert!(
        matches!(&error.kind, ConfigErrorKind::Invalid { reason } if reason.contains("nonzero"))
    );
    assert_eq!(
        error.to_string(),
        "rules[0].rpu: invalid value: integer `0`, expected a nonzero u32 at line 3 column 10"
    );
    assert_eq!(error.message(), error.to_string());
    let source: &dyn std::error::Error = &error;
    assert_eq!(source.to_string(), error.to_string());

    let syntax = parse_policy("Url: /\nrules: [\n").unwrap_err();
    assert!(
        matches!(syntax.kind, ConfigErrorKind::Syntax { .. }),
        "{syntax:?}"
    );
    assert!(syntax.to_string().starts_with("invalid YAML: "), "{syntax}");
    assert!(syntax.position.is_some(), "{syntax:?}");

    // Small enough to return by value (clippy's `result_large_err` draws the line at 128).
    assert!(std::mem::size_of::<super::ConfigError>() <= 128);

    let empty = parse_policy("").unwrap_err();
    assert_eq!(
        (empty.kind.clone(), empty.path.as_str(), empty.position),
        (ConfigErrorKind::NoResources, "", None)
    );
}

#[test]
fn costs_are_checked_against_the_limit_the_lease_and_the_algorithm() {
    for (text, pieces) in [
        (
            "Url: /\nrules:\n  - {rpu: 10, cost: 0}\n",
            ["rules[0].cost: ", "line 3"],
        ),
        (
            "Url: /\nrules:\n  - {rpu: 10, cost: {header: 'bad header'}}\n",
            ["rules[0].cost.header: ", "line 3"],
        ),
        (
            "Url: /\nrules:\n  - {rpu: 10, cost: {header: x-cost, max: 0}}\n",
            ["rules[0].cost.max: ", "line 3"],
        ),
        (
            "Url: /\nrules:\n  - {rpu: 10, response_cost: {header: x-t}}\n",
            ["rules[0].response_cost: ", "missing field `max`"],
        ),
    ] {
        let message = error(text);
        assert!(
            pieces.iter().all(|piece| message.contains(piece)),
            "{message}"
        );
    }
    let policy = parse_policy(
        "Url: /\nrules:\n  - {rpu: 100, algo: TB, lease: 20, scope: global, cost: {header: X-Cost, default: 2, max: 20}, response_cost: {header: x-llm-tokens, max: 5000}}\n",
    )
    .unwrap();
    let rule = policy.rules().next().unwrap();
    assert_eq!(
        rule.cost,
        Cost::Header {
            name: "x-cost".into(),
            default: NonZeroU32::new(2).unwrap(),
            max: NonZeroU32::new(20).unwrap()
        }
    );
    assert_eq!(
        rule.response_cost.as_ref().unwrap().header(),
        Some("x-llm-tokens")
    );
}

#[test]
fn lease_auto_caps_each_gateway_at_a_hundredth_of_the_limit() {
    let policy = parse_policy(
        "resources:\n  - Url: /\n    rules:\n      - {rpu: 50000, scope: global, lease: auto}\n      - {rpu: 50, scope: global, lease: auto}\n      - {rpu: 1000, scope: global, lease: 7}\n      - {rpu: 1000, scope: global}\nglobal: {lease: auto}\n",
    )
    .unwrap();
    let leases: Vec<(u32, bool)> = policy
        .rules()
        .map(|rule| (rule.lease.get(), rule.lease_auto))
        .collect();
    assert_eq!(leases, [(500, true), (1, true), (7, false), (10, true)]);
    assert!(error("Url: /\nrules:\n  - {rpu: 5, lease: often}\n")
        .contains("expected an integer between 1 and 100000 or `auto`"));
}

#[test]
fn null_is_never_read_as_text() {
    for text in [
        "resources: [{Url: /, rules: [{rpu: 1, actor: t}]}]\nactors: {t: {header: null}}\n",
        "resources: [{Url: /, rules: [{rpu: 1, actor: t}]}]\nactors: {t: {header: ~}}\n",
        "resources: [{Url: /, rules: [{rpu: 1, actor: t}]}]\nactors:\n  t:\n    header:\n",
        "resources: [{Url: /, rules: []}]\nremote: {cluster: ~, path: /d.yaml}\n",
        "{\"resources\": [{\"Url\": \"/\", \"rules\": []}], \"remote\": {\"cluster\": null, \"path\": \"/d\"}}",
    ] {
        let message = error(text);
        assert!(message.contains("null where"), "{text:?}: {message}");
    }
    // An optional field given null is refused too, with its path and the position of the
    // null (issue 22, item 4: `name: ~`, `name:`, `"name": null` and `body: ~` were read as
    // absent, i.e. as the default, while the README said null is refused). Leaving the key
    // out is how a default is asked for. `(document, path, line, column)`.
    let optional: &[(&str, &str, usize, usize)] = &[
        (
            "Url: /\nrules: [{rpu: 1, name: ~}]\n",
            "rules[0].name",
            2,
            24,
        ),
        (
            "Url: /\nrules:\n  - rpu: 1\n    name:\n",
            "rules[0].name",
            4,
            10,
        ),
        (
            "Url: /\nrules:\n  - rpu: 1\n    name:\n    unit: second\n",
            "rules[0].name",
            4,
            10,
        ),
        (
            "{\"Url\": \"/\", \"rules\": [{\"rpu\": 1, \"name\": null}]}",
            "rules[0].name",
            1,
            46,
        ),
        (
            "resources: [{Url: /, rules: []}]\nresponse: {body: ~}\n",
            "response.body",
            2,
            18,
        ),
        (
            "Url: /\nrules: [{rpu: 1, unit: ~}]\n",
            "rules[0].unit",
            2,
            24,
        ),
        (
            "Url: /\nrules: [{rpu: 1, burst: null}]\n",
            "rules[0].burst",
            2,
            25,
        ),
        (
            "Url: /\nrules: [{rpu: 1, cost: {header: x, default: ~, max: 2}}]\n",
            "rules[0].cost.default",
            2,
            45,
        ),
        (
            "resources: [{Url: /, rules: []}]\nglobal: {authority: ~}\n",
            "global.authority",
            2,
            21,
        ),
        (
            "resources: [{Url: /, rules: []}]\nremote: {cluster: c, path: /d, authority: ~}\n",
            "remote.authority",
            2,
            43,
        ),
        (
            "resources: [{Url: /, rules: []}]\nglobal:\n",
            "global",
            2,
            8,
        ),
        (
            "resources: [{Url: /, rules: []}]\ndry_run: ~\n",
            "dry_run",
            2,
            10,
        ),
    ];
    for (text, path, line, column) in optional {
        let err = parse_policy(text).expect_err(text);
        assert_eq!(err.path, *path, "{text:?}: {err}");
        assert_eq!(
            err.position,
            Some(Position {
                line: *line,
                column: *column
            }),
            "{text:?}: {err}"
        );
        assert!(
            err.to_string().contains("null where a value is expected"),
            "{text:?}: {err}"
        );
        assert!(
            err.to_string().contains("leave the key out"),
            "{text:?}: {err}"
        );
    }
    // Left out, the same fields take their defaults.
    assert_eq!(rules(&parse("Url: /\nrules: [{rpu: 1}]\n"))[0].name, "/#0");
    // Quoted, it is text like any other.
    let policy = parse(
        "resources: [{Url: /, rules: [{rpu: 1, actor: t}]}]\nactors: {t: {header: \"null\"}}\n",
    );
    let facts = Facts {
        headers: vec![("null", b"v".to_vec())],
        ip: None,
    };
    assert!(matches!(
        rules(&policy)[0].identify(&facts),
        Identity::Key(_)
    ));
}

/// A mapping of the document is read from a mapping, in JSON as in YAML: serde's own
/// reader of a struct also takes a JSON array of its values in field order, so that
/// `"global": ["evil", "evil.example", "/steal"]` was a quota service at `evil` in JSON and
/// refused in YAML. And `null` is refused for every optional key, `from` of a plan's
/// claim included (it was read as absent).
#[test]
fn a_mapping_is_a_mapping_in_json_as_in_yaml() {
    let block = "{\"Url\": \"/\", \"rules\": [{\"rpu\": 1}]}";
    for (json, yaml, want) in [
        (
            format!("{{\"resources\": [{block}], \"global\": [\"evil\", \"evil.example\", \"/steal\"]}}"),
            format!("resources: [{block}]\nglobal: [evil, evil.example, /steal]\n"),
            "global: invalid type: sequence, expected the `global` section at line ",
        ),
        (
            format!("{{\"resources\": [{block}], \"response\": []}}"),
            format!("resources: [{block}]\nresponse: []\n"),
            "response: invalid type: sequence, expected the `response` section at line ",
        ),
        (
            "[[\"/\", [{\"rpu\": 1}]]]".to_string(),
            "- [/, [{rpu: 1}]]\n".to_string(),
            "[0]: invalid type: sequence, expected a resource block with `Url` and `rules` at line ",
        ),
        (
            "{\"Url\": \"/\", \"rules\": [[5]]}".to_string(),
            "Url: /\nrules: [[5]]\n".to_string(),
            "rules[0]: invalid type: sequence, expected a rule (a mapping with at least `rpu` or \
             `max_in_flight`) at line ",
        ),
    ] {
        for text in [&json, &yaml] {
            let message = error(text);
            assert!(message.starts_with(want), "{message}\n---\n{text}");
        }
    }
    let by_claim =
        "Url: /\nrules: [{rpu: {by: {jwt_claim: plan, from: null}, values: {a: 1}, default: 1}}]\n";
    assert!(
        error(by_claim).starts_with("rules[0].rpu.by.from: null where a value is expected"),
        "{}",
        error(by_claim)
    );
}

#[test]
fn integers_and_booleans_are_text_alike_in_yaml_and_json() {
    let yaml = parse("Url: /\nrules: [{rpu: 1, name: 5}, {rpu: 2, name: true}]\n");
    let json = parse(
        "{\"Url\": \"/\", \"rules\": [{\"rpu\": 1, \"name\": 5}, {\"rpu\": 2, \"name\": true}]}",
    );
    let names =
        |policy: &Policy| -> Vec<String> { rules(policy).iter().map(|r| r.name.clone()).collect() };
    assert_eq!(names(&yaml), names(&json));
    assert!(
        names(&yaml)[0].contains('5') && names(&yaml)[1].contains("true"),
        "{:?}",
        names(&yaml)
    );
    // A float would not keep its spelling (`1.50` reads as 1.5): refused, in both forms.
    error("Url: /\nrules: [{rpu: 1, name: 1.50}]\n");
    error("{\"Url\": \"/\", \"rules\": [{\"rpu\": 1, \"name\": 1.50}]}");
}

#[test]
fn global_token_is_a_secret_from_the_document_or_the_environment() {
    let token = "q".repeat(40);
    let doc = format!("resources: [{{Url: /, rules: [{{rpu: 1}}]}}]\nglobal: {{token: {token}}}\n");
    let policy = parse_policy(&doc).expect("valid");
    assert_eq!(
        policy.global.token.as_ref().map(|t| t.expose().to_string()),
        Some(token.clone())
    );
    assert!(!format!("{policy:?}").contains(&token));

    // Too short: refused with its position, never its value.
    let short = "resources: [{Url: /, rules: [{rpu: 1}]}]\nglobal: {token: hunter2hunter2}\n";
    let error = parse_policy(short).expect_err("short").to_string();
    assert!(error.contains("global.token"), "{error}");
    assert!(error.contains("at least 32 bytes"), "{error}");
    assert!(!error.contains("hunter2"), "{error}");

    // From the environment: a missing variable is named.
    let env = "resources: [{Url: /, rules: [{rpu: 1}]}]\nglobal: {token: {env: DIANA_TEST_UNSET_TOKEN_VAR}}\n";
    let error = parse_policy(env).expect_err("unset").to_string();
    assert!(error.contains("DIANA_TEST_UNSET_TOKEN_VAR"), "{error}");
    assert!(error.contains("global.token"), "{error}");
}

/// (c) `identity_key`: two gateways given the same secret (two parses) compute the same
/// identities, local and global; another secret, or none, gives others.
#[test]
fn identity_key_makes_gateways_agree_and_only_them() {
    use crate::hash::KeyOrigin;
    let rules_doc = "resources:\n  - Url: /\n    rules:\n      - {rpu: 1, actor: device}\n      - {rpu: 1, actor: device, scope: global}\n";
    let keyed = |secret: &str| parse(&format!("{rules_doc}identity_key: \"{secret}\"\n"));
    let secret = "a-deployment-secret-of-at-least-32-bytes";
    let (one, two) = (keyed(secret), keyed(secret));
    let other = keyed("another-deployment-secret-of-32-bytes!!");
    let unkeyed = parse(rules_doc);
    let facts = Facts {
        headers: vec![("x-device-id", b"phone-1".to_vec())],
        ip: Some(b"10.0.0.1".to_vec()),
    };
    for index in 0..2 {
        let identity = |policy: &Policy| rules(policy)[index].identify(&facts);
        assert!(matches!(identity(&one), Identity::Key(_)));
        assert_eq!(identity(&one), identity(&two), "rule {index}");
        assert_ne!(identity(&one), identity(&other), "rule {index}");
        assert_ne!(identity(&one), identity(&unkeyed), "rule {index}");
        assert_eq!(rules(&one)[index].identity.origin(), KeyOrigin::Configured);
    }
    assert_eq!(one.identity_key(), two.identity_key());
    assert!(one.identity_key().is_some() && unkeyed.identity_key().is_none());
    // Without a key: global rules agree on the public key, local ones wait for the process's.
    assert_eq!(rules(&unkeyed)[1].identity.origin(), KeyOrigin::Public);
    assert_eq!(rules(&unkeyed)[0].identity.origin(), KeyOrigin::Unbound);
    assert_eq!(
        rules(&unkeyed)[1].identify(&facts),
        rules(&parse(rules_doc))[1].identify(&facts)
    );
    // The key never shows: not in the policy's Debug, not in a rule's.
    let shown = format!("{one:?}");
    assert!(!shown.contains("deployment-secret"), "{shown}");
    // In its own `---` document, or from the environment.
    let split = parse(&format!("{rules_doc}---\nidentity_key: \"{secret}\"\n"));
    assert_eq!(
        rules(&split)[0].identify(&facts),
        rules(&one)[0].identify(&facts)
    );
}

#[test]
fn a_bad_identity_key_is_refused_without_its_value() {
    let rules_doc = "resources: [{Url: /, rules: [{rpu: 1, actor: device}]}]\n";
    for (value, wanted) in [
        ("hunter2hunter2", "at least 32 bytes"),
        ("\"\"", "at least 32 bytes"),
        ("12345678901234567", "secret string"),
        ("true", "secret string"),
        (
            "{env: DIANA_TEST_UNSET_IDENTITY_KEY_VAR}",
            "DIANA_TEST_UNSET_IDENTITY_KEY_VAR",
        ),
    ] {
        let message = error(&format!("{rules_doc}identity_key: {value}\n"));
        assert!(message.starts_with("identity_key: "), "{message}");
        assert!(message.contains(wanted), "{message}");
        assert!(message.contains("line 2"), "{message}");
        if !value.starts_with('{') && value.len() > 2 {
            assert!(!message.contains(value), "{message}");
        }
    }
    // JSON too.
    let message = error(
        "{\"resources\": [{\"Url\": \"/\", \"rules\": [{\"rpu\": 1}]}], \"identity_key\": \"hunter2hunter2\"}",
    );
    assert!(
        message.contains("identity_key") && !message.contains("hunter2"),
        "{message}"
    );
    // Given by two documents: refused like any section.
    let twice = format!(
        "{rules_doc}identity_key: \"{}\"\n---\nidentity_key: \"{}\"\n",
        "a".repeat(32),
        "b".repeat(32)
    );
    let message = error(&twice);
    assert!(message.contains("already given"), "{message}");
    assert!(!message.contains(&"b".repeat(32)), "{message}");
}

#[test]
fn global_rules_the_quota_service_would_refuse_are_refused_at_load() {
    // A bucket that would take more than a day to refill: the service bounds what a key
    // can live. The same rule is fine locally.
    let global =
        "resources: [{Url: /, rules: [{algo: TB, rpu: 1, unit: day, burst: 5, scope: global}]}]\n";
    let error = parse_policy(global).expect_err("refused").to_string();
    assert!(error.contains("burst"), "{error}");
    assert!(error.contains("quota service"), "{error}");
    let local = "resources: [{Url: /, rules: [{algo: TB, rpu: 1, unit: day, burst: 5}]}]\n";
    assert!(parse_policy(local).is_ok());
    // Costs that one callout could never carry (12 × 100,000 > 1,000,000).
    let mut doc = String::from("resources:\n  - Url: /\n    rules:\n");
    for i in 0..12 {
        doc.push_str(&format!(
            "      - {{name: r{i}, rpu: 1000000, unit: hour, scope: global, lease: 100000, cost: 100000}}\n"
        ));
    }
    let error = parse_policy(&doc).expect_err("refused").to_string();
    assert!(error.contains("1000000"), "{error}");
}

#[test]
fn a_rule_with_plans_is_one_rule_per_plan_and_one_for_the_rest() {
    let policy = parse(
        "resources:\n  - Url: /api\n    rules:\n      - rpu: {by: X-Plan, values: {free: 10, pro: 1000}, default: 5}\n        \
         unit: minute\n        actor: account\n      - rpu: 3\n",
    );
    let rules = rules(&policy);
    let shown: Vec<(&str, u32, Option<&str>)> = rules
        .iter()
        .map(|rule| {
            (
                rule.name.as_str(),
                rule.limit.rpu.get(),
                rule.plan.as_ref().map(|p| p.name()),
            )
        })
        .collect();
    assert_eq!(
        shown,
        [
            ("/api#0.free", 10, Some("free")),
            ("/api#0.pro", 1000, Some("pro")),
            ("/api#0.default", 5, Some("default")),
            ("/api#1", 3, None),
        ]
    );
    // The header name is lower-cased; each plan has counters of its own.
    assert_eq!(
        rules[0].plan.as_ref().map(|p| p.by.clone()),
        Some(PlanSource::Header("x-plan".to_string()))
    );
    let tables: Vec<u64> = rules.iter().map(|rule| rule.keys.table).collect();
    let mut distinct = tables.clone();
    distinct.dedup();
    assert_eq!(distinct.len(), 4, "{tables:x?}");
    // Editing a plan's limit keeps its table (its counters' key names), not its generation.
    let edited = parse(
        "resources:\n  - Url: /api\n    rules:\n      - rpu: {by: X-Plan, values: {free: 20, pro: 1000}, default: 5}\n        \
         unit: minute\n        actor: account\n      - rpu: 3\n",
    );
    let edited = rules_of(&edited);
    assert_eq!(edited[0].keys.table, rules[0].keys.table);
    assert_ne!(edited[0].id, rules[0].id);
    assert_eq!(edited[1].id, rules[1].id);
}

#[test]
fn a_plan_is_read_from_the_bearer_token_or_from_jwt_authn_metadata() {
    use crate::actor::fake::Facts;
    use crate::jwt::JWT_AUTHN_NAMESPACE;
    let source = |by: &str| {
        let policy = parse(&format!(
            "resources:\n  - Url: /\n    rules:\n      - rpu: {{by: {by}, values: {{pro: 9}}, default: 1}}\n"
        ));
        let rules = rules_of(&policy);
        let plan = rules[0].plan.clone().expect("a rule with plans");
        (plan.by, rules[0].id)
    };
    let (verified, verified_id) = source("{jwt_claim: /tier, from: {jwt_authn: jwt_payload}}");
    let (token, token_id) = source("{jwt_claim: /tier}");
    assert_eq!(
        verified.describe(),
        "jwt_claim /tier from jwt_authn:jwt_payload"
    );
    assert_eq!(token.describe(), "jwt_claim /tier");
    assert!(verified.metadata_claim().is_some() && token.metadata_claim().is_none());
    assert_ne!(
        verified_id, token_id,
        "where the plan is read is part of the rule"
    );
    // From metadata: the payload's name, then the claim's segments; trimmed as a header is.
    let facts = Facts::default().metadata(JWT_AUTHN_NAMESPACE, &["jwt_payload", "tier"], b" pro ");
    assert_eq!(verified.read(&facts), Some(b"pro".to_vec()));
    // Not from the bearer token, and nothing on a host without metadata.
    assert_eq!(verified.read(&Facts::default()), None);
    assert_eq!(token.read(&facts), None);
    // A NUL cannot be sent as a metadata path segment; `from` names its payload.
    for (by, expected) in [
        (
            "{jwt_claim: \"/a\\0b\", from: {jwt_authn: p}}",
            "cannot contain a NUL",
        ),
        ("{jwt_claim: /tier, from: {jwt_authn: \"\"}}", "jwt_authn"),
        ("{jwt_claim: /tier, from: {jwt: p}}", "unknown field `jwt`"),
    ] {
        let document = format!(
            "resources:\n  - Url: /\n    rules:\n      - rpu: {{by: {by}, values: {{pro: 9}}, default: 1}}\n"
        );
        let error = crate::config::parse_policy(&document)
            .expect_err(by)
            .to_string();
        assert!(error.contains(expected), "{by}: {error}");
    }
}

#[test]
fn plans_of_a_global_rule_count_once_per_callout() {
    // 16 global rules with 3 plans each: one plan of each applies to a request.
    let mut doc = "resources:\n  - Url: /\n    rules:\n".to_string();
    for _ in 0..crate::wire::MAX_RULES {
        doc.push_str(
            "      - {scope: global, rpu: {by: x-plan, values: {a: 1, b: 2}, default: 1}}\n",
        );
    }
    let policy = parse(&doc);
    assert_eq!(rules(&policy).len(), 3 * crate::wire::MAX_RULES);
}

#[test]
fn counted_statuses_and_reservations_as_written() {
    let policy = parse(
        "Url: /\nrules:\n  - {rpu: 5, count: {status: [401, ' 403 ', 5Xx]}}\n  - {rpu: 1000, response_cost: {header: x-t, max: 9000, reserve: {header: x-max, max: 800}}}\n",
    );
    let rules = rules(&policy);
    let count = rules[0].count.as_ref().unwrap();
    assert_eq!(count.statuses, [(401, 401), (403, 403), (500, 599)]);
    assert_eq!(count.describe(), ["401", "403", "5xx"]);
    assert!(rules[0].settles() && rules[1].settles());
    assert_eq!(rules[0].answer_header(), Some(":status"));
    assert_eq!(rules[1].answer_header(), Some("x-t"));
    assert_eq!(rules[1].upfront().max(), 800);
    assert_eq!(rules[1].cost.max(), 1);
}

#[test]
fn a_concurrency_limit_is_a_rule_of_its_own_algorithm() {
    let policy = parse("Url: /\nrules:\n  - {max_in_flight: 5, actor: account, name: inside}\n");
    let rule = rules(&policy)[0];
    assert_eq!(rule.algo.code(), "IF");
    assert!(rule.algo.holds_until_done() && !rule.algo.lends());
    assert_eq!(rule.limit.rpu.get(), 5);
    assert_eq!(rule.scope, Scope::Local);
    // Its id (the generation sealing its places, its key at the quota service) does not
    // hash N, so an edit of N keeps the places of the requests inside; a rate's does.
    let edited = parse("Url: /\nrules:\n  - {max_in_flight: 9, actor: account, name: inside}\n");
    assert_eq!(rules(&edited)[0].id, rule.id);
    assert_eq!(rules(&edited)[0].keys, rule.keys);
    let rate = |rpu: u32| {
        ids(&parse(&format!(
            "Url: /\nrules:\n  - {{rpu: {rpu}, name: r}}\n"
        )))
    };
    assert_ne!(rate(5), rate(9));
    // Anything else still makes another rule.
    let other = parse("Url: /\nrules:\n  - {max_in_flight: 5, actor: ip, name: inside}\n");
    assert_ne!(rules(&other)[0].id, rule.id);
}
