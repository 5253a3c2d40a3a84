//! `diana check-nginx`: the configuration mistakes ngx_wasm_module does not let the filter
//! catch at run time (nginx/README.md), found in the nginx configuration itself.
//!
//! - no `shm_kv` zone for Diana's keys (`diana/...`: a `shm_kv diana` zone, or the
//!   default `shm_kv *` zone): `nginx -t` passes, then every worker traps at its first
//!   shared-data call (in its first tick, or in a request before it, answered 500), and
//!   Diana's locations answer `on_invalid_config` from then on;
//! - a location that runs `proxy_wasm diana` with a global rule but without
//!   `proxy_wasm_request_headers_in_access on;` (in it or in a parent block): the first
//!   request paused for its quota-service call can crash its worker;
//! - a zone smaller than the documents need ([`crate::nginx::zone_bytes_of`], what
//!   `diana check` prints), or with `eviction=none`;
//! - a document the filter refuses (`parse_policy`, as `diana check`), or whose
//!   `global.cluster` / `remote.cluster` is not `host:port`.

use crate::nginx;
use crate::nginx_conf::{Config, Directive};
use diana_core::config::{parse_policy, Policy, Scope};
use diana_core::worker::is_host_port;
use std::collections::HashMap;

/// What the check found: one line per problem, or a summary when there is none.
pub struct Outcome {
    pub problems: Vec<String>,
    pub summary: String,
}

/// The Diana document given with `--document`, checked in place of those written in the
/// `proxy_wasm diana` lines.
pub struct Document<'a> {
    pub name: &'a str,
    pub text: &'a str,
}

const FLAG: &str = "proxy_wasm_request_headers_in_access";

/// A location (or a server without locations) whose requests run `proxy_wasm diana`.
struct Served<'c> {
    block: &'c Directive,
    filter: &'c Directive,
    /// The nearest `proxy_wasm_request_headers_in_access` that applies, if any.
    flag: Option<&'c Directive>,
}

/// One `proxy_wasm diana` line's document as the filter reads it.
enum Verdict {
    Accepted(Box<Policy>),
    Refused,
}

pub fn check(config: &Config, document: Option<&Document>) -> Outcome {
    let mut problems = Vec::new();
    let main = config
        .files
        .first()
        .map(|path| path.display().to_string())
        .unwrap_or_default();

    // Every `proxy_wasm diana` line, and the places whose requests run one.
    let mut filters: Vec<&Directive> = Vec::new();
    let mut served: Vec<Served> = Vec::new();
    for http in blocks(&config.directives, "http") {
        walk(http, None, None, &mut filters, &mut served);
    }
    if filters.is_empty() {
        return Outcome {
            problems: vec![format!(
                "{main}: no `proxy_wasm diana` directive in http {{ }}, server {{ }} or location {{ }} ({} file{} read): nothing to check",
                config.files.len(),
                if config.files.len() == 1 { "" } else { "s" },
            )],
            summary: String::new(),
        };
    }

    // Each document, read once.
    let mut verdicts: HashMap<&str, Verdict> = HashMap::new();
    let mut order: Vec<&str> = Vec::new();
    for filter in &filters {
        let (text, at) = match document {
            Some(document) => (document.text, document.name.to_string()),
            None => (
                filter.args.get(1).map(String::as_str).unwrap_or(""),
                format!("{}: the document of `proxy_wasm diana`", config.at(filter)),
            ),
        };
        if verdicts.contains_key(text) {
            continue;
        }
        let verdict = match parse_policy(text) {
            Ok(policy) => {
                check_upstreams(&policy, &at, &mut problems);
                check_claim_origins(&policy, &at, &mut problems);
                Verdict::Accepted(Box::new(policy))
            }
            Err(err) => {
                problems.push(format!("{at}: refused by the filter: {err}"));
                Verdict::Refused
            }
        };
        verdicts.insert(text, verdict);
        order.push(text);
    }
    let policies: Vec<&Policy> = order
        .iter()
        .filter_map(|text| match verdicts.get(text) {
            Some(Verdict::Accepted(policy)) => Some(policy.as_ref()),
            _ => None,
        })
        .collect();
    let needed = nginx::zone_bytes_of(&policies);
    let needed_m = needed >> 20;
    // Does this filter line pause requests for the quota service here? A global rule does;
    // `remote` may bring global rules; an unreadable document may have them. Not in
    // `location = <metrics.path>`: Diana answers every request there itself, before any
    // rule.
    let pauses = |filter: &Directive, block: &Directive| -> Option<&'static str> {
        let text = match document {
            Some(document) => document.text,
            None => filter.args.get(1).map(String::as_str).unwrap_or(""),
        };
        match verdicts.get(text) {
            Some(Verdict::Accepted(policy)) => {
                let metrics_only = block.name == "location"
                    && policy.metrics.as_ref().is_some_and(|metrics| {
                        matches!(block.args.as_slice(), [exact, path] if exact == "=" && *path == metrics.path)
                    });
                if metrics_only {
                    None
                } else if policy.rules().any(|rule| rule.scope == Scope::Global) {
                    Some("with a global rule")
                } else if policy.remote.is_some() {
                    Some("with `remote` (a remote document may bring global rules)")
                } else {
                    None
                }
            }
            _ => Some("(its document could not be read, so it may have global rules)"),
        }
    };

    // The wasm block: module diana and a zone for diana/... keys.
    let wasm: Vec<&Directive> = blocks(&config.directives, "wasm").collect();
    let mut module_path = None;
    let mut zone_summary = String::new();
    match wasm.first() {
        None => {
            let first = filters.first().map(|f| config.at(f)).unwrap_or_default();
            problems.push(format!(
                "{first}: `proxy_wasm diana` needs a `wasm {{ }}` block, and {main} has none: add `wasm {{ module diana /path/to/diana.wasm; shm_kv diana {needed_m}m; }}` at its top level (outside http {{ }})"
            ));
        }
        Some(wasm) => {
            let children = wasm.children();
            module_path = children
                .iter()
                .find(|d| d.name == "module" && d.args.first().is_some_and(|n| n == "diana"))
                .and_then(|d| d.args.get(1).cloned());
            if module_path.is_none() {
                problems.push(format!(
                    "{}: the wasm block loads no module named diana: add `module diana /path/to/diana.wasm;` inside it",
                    config.at(wasm)
                ));
            }
            let zones: Vec<&Directive> = children.iter().filter(|d| d.name == "shm_kv").collect();
            let zone = zones
                .iter()
                .find(|d| d.args.first().is_some_and(|n| n == "diana"))
                .or_else(|| {
                    zones
                        .iter()
                        .find(|d| d.args.first().is_some_and(|n| n == "*"))
                });
            match zone {
                None => {
                    let others: Vec<String> = zones
                        .iter()
                        .map(|d| {
                            format!(
                                "`shm_kv {}` ({})",
                                d.args.first().map(String::as_str).unwrap_or(""),
                                config.at(d)
                            )
                        })
                        .collect();
                    let others = if others.is_empty() {
                        String::new()
                    } else {
                        format!(
                            " (only {}: a zone holds the keys of its own namespace, or of every namespace without one for `*`)",
                            others.join(", ")
                        )
                    };
                    problems.push(format!(
                        "{}: the wasm block has no shm_kv zone for Diana's keys (diana/...){others}: add `shm_kv diana {needed_m}m;` inside it (without it Diana's locations answer `on_invalid_config`, 503 by default, and a worker's first request in its first second may fail with 500: \"failed getting value from shm (could not resolve namespace)\")",
                        config.at(wasm)
                    ));
                }
                Some(zone) => {
                    let name = zone.args.first().map(String::as_str).unwrap_or("");
                    let size_text = zone.args.get(1).map(String::as_str).unwrap_or("");
                    let fix = if name == "*" {
                        format!("add `shm_kv diana {needed_m}m;` (a zone of Diana's own)")
                    } else {
                        format!("make it `shm_kv diana {needed_m}m;`")
                    };
                    match parse_size(size_text) {
                        None => problems.push(format!(
                            "{}: cannot read the size of `shm_kv {name} {size_text}`: write it as nginx does (`{needed_m}m`)",
                            config.at(zone)
                        )),
                        Some(size) if !policies.is_empty() && size < needed => problems.push(format!(
                            "{}: `shm_kv {name} {size_text}` is smaller than the {needed_m}m the document{} need{} (`diana check`): counters are evicted when it fills; {fix}",
                            config.at(zone),
                            if policies.len() == 1 { "" } else { "s" },
                            if policies.len() == 1 { "s" } else { "" },
                        )),
                        Some(_) => {}
                    }
                    if zone.args.iter().any(|arg| arg == "eviction=none") {
                        problems.push(format!(
                            "{}: `shm_kv {name}` has eviction=none: a write into a full zone then traps and the request fails with a 500; remove it (the default slru, or lru)",
                            config.at(zone)
                        ));
                    }
                    zone_summary = if policies.is_empty() {
                        format!("shm_kv {name} {size_text}")
                    } else {
                        format!("shm_kv {name} {size_text} (needs {needed_m}m)")
                    };
                }
            }
        }
    }

    // proxy_wasm_request_headers_in_access where requests may pause.
    let mut paused_places = 0;
    for place in &served {
        let Some(why) = pauses(place.filter, place.block) else {
            continue;
        };
        paused_places += 1;
        let what = describe(place.block);
        match place.flag {
            Some(flag) if flag.args.first().is_some_and(|v| v.eq_ignore_ascii_case("on")) => {}
            Some(flag) => problems.push(format!(
                "{}: {what} runs `proxy_wasm diana` ({}) {why}, and `{FLAG} {};` ({}) applies to it: make it `{FLAG} on;` (a request paused for its quota-service call can crash its worker)",
                config.at(place.block),
                config.at(place.filter),
                flag.args.join(" "),
                config.at(flag),
            )),
            None => problems.push(format!(
                "{}: {what} runs `proxy_wasm diana` ({}) {why} without `{FLAG} on;`: add it inside this {} (or its server {{ }} / http {{ }} block); without it a request paused for its quota-service call can crash its worker",
                config.at(place.block),
                config.at(place.filter),
                place.block.name,
            )),
        }
    }

    let mut summary = format!("{main}: ok:");
    if let Some(path) = &module_path {
        summary.push_str(&format!(" module diana {path};"));
    }
    if !zone_summary.is_empty() {
        summary.push_str(&format!(" {zone_summary};"));
    }
    summary.push_str(&format!(
        " {} `proxy_wasm diana` line{} ({} document{}{});",
        filters.len(),
        if filters.len() == 1 { "" } else { "s" },
        order.len(),
        if order.len() == 1 { "" } else { "s" },
        match document {
            Some(document) => format!(", from {}", document.name),
            None => String::new(),
        },
    ));
    summary.push_str(&format!(
        " {FLAG} on where requests pause: {paused_places} of {} location{}; {} file{} read",
        served.len(),
        if served.len() == 1 { "" } else { "s" },
        config.files.len(),
        if config.files.len() == 1 { "" } else { "s" },
    ));
    Outcome { problems, summary }
}

/// `global.cluster` (with global rules) and `remote.cluster` must be host:port on nginx.
fn check_upstreams(policy: &Policy, at: &str, problems: &mut Vec<String>) {
    if policy.rules().any(|rule| rule.scope == Scope::Global)
        && !is_host_port(&policy.global.cluster)
    {
        problems.push(format!(
            "{at}: global.cluster is `{}`, an Envoy cluster name: on nginx write the quota service's host:port (`\"global\": {{\"cluster\": \"127.0.0.1:8081\"}}`)",
            policy.global.cluster
        ));
    }
    if let Some(remote) = &policy.remote {
        if !is_host_port(&remote.cluster) {
            problems.push(format!(
                "{at}: remote.cluster is `{}`, an Envoy cluster name: on nginx write the config center's host:port",
                remote.cluster
            ));
        }
    }
}

/// An actor or a plan that reads a claim from `jwt_authn`'s metadata (`from: {jwt_authn:
/// NAME}`) reads nothing on nginx, which has no such filter: every request would take
/// the actor's fallback, or the rule's default plan.
fn check_claim_origins(policy: &Policy, at: &str, problems: &mut Vec<String>) {
    let mut seen: Vec<&str> = Vec::new();
    let mut plans_seen: Vec<&str> = Vec::new();
    for rule in policy.rules() {
        if let Some(choice) = &rule.plan {
            // The rule as written: its plans are named `<rule>.<plan>`.
            let base = rule
                .name
                .strip_suffix(choice.name())
                .and_then(|name| name.strip_suffix('.'))
                .unwrap_or(&rule.name);
            if let Some(claim) = choice.by.metadata_claim() {
                if !plans_seen.contains(&base) {
                    plans_seen.push(base);
                    problems.push(format!(
                        "{at}: rule `{base}` reads its plan from the claim {}, the metadata Envoy's jwt_authn filter leaves: nginx has no such filter, so every request would count by the default plan; read the bearer token instead (drop `from`, and verify the token in front of Diana)",
                        claim.describe()
                    ));
                }
            }
        }
        if seen.contains(&rule.actor_name.as_str()) {
            continue;
        }
        seen.push(&rule.actor_name);
        if let Some((_, from)) = rule
            .actor_source()
            .into_iter()
            .find(|(key, _)| *key == "from")
        {
            problems.push(format!(
                "{at}: actor `{}` reads its claim from {from}, the metadata Envoy's jwt_authn filter leaves: nginx has no such filter, so every request would take the actor's fallback; read the bearer token instead (drop `from`, and verify the token in front of Diana)",
                rule.actor_name
            ));
        }
    }
}

/// The blocks named `name` among `directives`.
fn blocks<'c>(directives: &'c [Directive], name: &'c str) -> impl Iterator<Item = &'c Directive> {
    directives
        .iter()
        .filter(move |d| d.name == name && d.block.is_some())
}

/// Walks an http, server or location block: the `proxy_wasm` lines and the
/// `proxy_wasm_request_headers_in_access` that apply are inherited from the parent block
/// unless the block has its own.
fn walk<'c>(
    block: &'c Directive,
    inherited_filter: Option<&'c Directive>,
    inherited_flag: Option<&'c Directive>,
    filters: &mut Vec<&'c Directive>,
    served: &mut Vec<Served<'c>>,
) {
    let children = block.children();
    let own: Vec<&Directive> = children
        .iter()
        .filter(|d| d.name == "proxy_wasm" && d.block.is_none())
        .collect();
    let own_diana = own
        .iter()
        .copied()
        .find(|d| d.args.first().is_some_and(|n| n == "diana"));
    filters.extend(
        own.iter()
            .copied()
            .filter(|d| d.args.first().is_some_and(|n| n == "diana")),
    );
    // A block with proxy_wasm lines of its own replaces its parent's filter chain.
    let filter = if own.is_empty() {
        inherited_filter
    } else {
        own_diana
    };
    let flag = children
        .iter()
        .rev()
        .find(|d| d.name == FLAG && d.block.is_none())
        .or(inherited_flag);
    let inner: Vec<&Directive> = children
        .iter()
        .filter(|d| {
            d.block.is_some()
                && match block.name.as_str() {
                    "http" => d.name == "server",
                    _ => d.name == "location",
                }
        })
        .collect();
    // Requests are served in locations; a server without any in the server itself.
    let serves = block.name == "location" || (block.name == "server" && inner.is_empty());
    if serves {
        if let Some(filter) = filter {
            served.push(Served {
                block,
                filter,
                flag,
            });
        }
    }
    for child in inner {
        walk(child, filter, flag, filters, served);
    }
}

/// `location /api` or `server`.
fn describe(block: &Directive) -> String {
    if block.args.is_empty() {
        block.name.clone()
    } else {
        format!("{} {}", block.name, block.args.join(" "))
    }
}

/// An nginx size: bytes, or with a k, m or g suffix (either case).
fn parse_size(text: &str) -> Option<u64> {
    let (digits, unit) = match text.char_indices().last() {
        Some((at, c)) if c.is_ascii_alphabetic() => (text.get(..at)?, Some(c.to_ascii_lowercase())),
        _ => (text, None),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let number: u64 = digits.parse().ok()?;
    let scale: u64 = match unit {
        None => 1,
        Some('k') => 1 << 10,
        Some('m') => 1 << 20,
        Some('g') => 1 << 30,
        Some(_) => return None,
    };
    number.checked_mul(scale)
}

#[cfg(test)]
mod tests {
    use super::{check_claim_origins, parse_size};
    use diana_core::config::parse_policy;

    #[test]
    fn a_plan_from_jwt_authn_metadata_is_a_problem_on_nginx() {
        for (plans, expected) in [
            ("{by: {jwt_claim: /plan, from: {jwt_authn: jwt_payload}}, values: {pro: 5}, default: 1}", 1),
            ("{by: {jwt_claim: /plan}, values: {pro: 5}, default: 1}", 0),
            ("{by: x-plan, values: {pro: 5}, default: 1}", 0),
        ] {
            let document = format!(
                "resources:\n  - Url: /\n    rules:\n      - {{name: api.v2, rpu: {plans}}}\n"
            );
            let policy = parse_policy(&document).expect("a valid document");
            let mut problems = Vec::new();
            check_claim_origins(&policy, "diana.yaml", &mut problems);
            assert_eq!(problems.len(), expected, "{plans}: {problems:?}");
            if expected == 1 {
                assert!(
                    problems[0].contains("rule `api.v2` reads its plan from the claim /plan from jwt_authn:jwt_payload"),
                    "{problems:?}"
                );
            }
        }
    }

    #[test]
    fn a_claim_from_jwt_authn_metadata_is_a_problem_on_nginx() {
        let cases: [(&str, usize); 4] = [
            ("user: {jwt_claim: sub, from: {jwt_authn: jwt_payload}}", 1),
            ("user: {jwt_claim: sub}", 0),
            ("user: {header: x-user}", 0),
            (
                "account: {jwt_claim: sub, from: {jwt_authn: p}}\n  user: {jwt_claim: sub}",
                0,
            ),
        ];
        for (actors, expected) in cases {
            let document = format!(
                "resources: [{{Url: /, rules: [{{rpu: 5, actor: user}}, {{rpu: 9, actor: user, unit: hour}}]}}]\nactors:\n  {actors}\n"
            );
            let policy = parse_policy(&document).expect("a valid document");
            let mut problems = Vec::new();
            check_claim_origins(&policy, "diana.yaml", &mut problems);
            assert_eq!(problems.len(), expected, "{actors}: {problems:?}");
            if let Some(problem) = problems.first() {
                assert!(
                    problem.starts_with(
                        "diana.yaml: actor `user` reads its claim from jwt_authn:jwt_payload"
                    ),
                    "{problem}"
                );
                assert!(problem.contains("nginx has no such filter"), "{problem}");
            }
        }
    }

    #[test]
    fn sizes_as_nginx_reads_them() {
        assert_eq!(parse_size("64m"), Some(64 << 20));
        assert_eq!(parse_size("64M"), Some(64 << 20));
        assert_eq!(parse_size("512k"), Some(512 << 10));
        assert_eq!(parse_size("1g"), Some(1 << 30));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("m"), None);
        assert_eq!(parse_size("12x"), None);
    }
}
