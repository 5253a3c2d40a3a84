//! The config parser: every document of the repository (tests, README, docs, fixtures:
//! `corpus/config/`, rebuilt by `corpus/extract.py`), mutated, as YAML and as JSON, and
//! random bytes. Properties: no panic; parsing is deterministic (a second parse of the
//! same text gives the same policy or the same error: the parser keeps per-thread state);
//! an accepted policy is well formed (normal urls, least specific first, unique rule names,
//! indices in order); and the YAML and JSON spellings of one document are accepted or
//! refused together, with the same rules.

use crate::mutate::{mutate, random_bytes};
use crate::rng::Rng;
use crate::Target;
use diana_core::config::{parse_policy, ConfigError, Policy};
use diana_core::path;
use std::sync::Arc;

/// Longest generated document.
const MAX_LEN: usize = 16 * 1024;

/// The starting documents: as written (YAML or JSON), and the YAML ones converted to JSON.
#[derive(Debug, Clone)]
pub struct Corpus {
    pub written: Arc<Vec<Vec<u8>>>,
    pub json: Arc<Vec<Vec<u8>>>,
    /// Parsed values, for the structured mutations of [`Forms`].
    pub values: Arc<Vec<serde_json::Value>>,
}

/// Documents used when the corpus directory cannot be read (a binary moved elsewhere).
const BUILT_IN: &[&str] = &[
    "Url: /\nrules:\n  - actor: device\n    unit: second\n    rpu: 10\n    algo: TB\n    scope: global\n  - actor: all\n    unit: second\n    rpu: 50\n    algo: W\n    scope: local\n",
    "resources:\n  - Url: /\n    rules: [{rpu: 5, unit: minute, algo: SW, slices: 6}]\n  - Url: /api\n    rules: [{rpu: 1, actor: tenant, algo: LB, burst: 2}]\nactors:\n  tenant: {header: x-tenant, fallback: ip}\nresponse: {status: 429, body: slow, headers: all}\n",
    "{\"resources\":[{\"Url\":\"/\",\"rules\":[{\"rpu\":3,\"unit\":\"hour\"}]}],\"dry_run\":true}",
];

impl Corpus {
    pub fn load() -> Corpus {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/corpus/config");
        let mut written: Vec<Vec<u8>> = std::fs::read_dir(dir)
            .map(|entries| {
                let mut paths: Vec<_> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
                paths.sort();
                paths
                    .iter()
                    .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "json"))
                    .filter_map(|p| std::fs::read(p).ok())
                    .collect()
            })
            .unwrap_or_default();
        if written.is_empty() {
            written = BUILT_IN.iter().map(|d| d.as_bytes().to_vec()).collect();
        }
        let values: Vec<serde_json::Value> = written
            .iter()
            .filter_map(|doc| std::str::from_utf8(doc).ok())
            .filter_map(|doc| serde_yaml::from_str::<serde_json::Value>(doc).ok())
            .filter(|value| value.is_object() || value.is_array())
            .collect();
        let json = values
            .iter()
            .filter_map(|value| serde_json::to_vec_pretty(value).ok())
            .collect();
        Corpus {
            written: Arc::new(written),
            json: Arc::new(json),
            values: Arc::new(values),
        }
    }
}

fn pick(rng: &mut Rng, docs: &[Vec<u8>]) -> Vec<u8> {
    rng.pick(docs).cloned().unwrap_or_default()
}

/// A corpus document mutated (sometimes as is), or random bytes.
fn generate(rng: &mut Rng, docs: &[Vec<u8>]) -> Vec<u8> {
    if rng.one_in(16) {
        return random_bytes(rng, MAX_LEN);
    }
    let mut doc = pick(rng, docs);
    if !rng.one_in(8) {
        let other = pick(rng, docs);
        mutate(rng, &mut doc, &other, MAX_LEN);
    }
    doc
}

/// What a parse came to, comparable: the policy's shape, or the error.
fn outcome(result: &Result<Policy, ConfigError>) -> Result<String, String> {
    match result {
        Ok(policy) => Ok(format!("{policy:?}")),
        Err(error) => Err(error.to_string()),
    }
}

/// Checks an accepted policy's invariants.
fn well_formed(policy: &Policy) -> Result<(), String> {
    let mut segments = 0;
    let mut names = Vec::new();
    for (i, rule) in policy.rules().enumerate() {
        if rule.index != i {
            return Err(format!("rule {} has index {}", i, rule.index));
        }
        if names.contains(&rule.name) {
            return Err(format!("rule name {:?} twice", rule.name));
        }
        names.push(rule.name.clone());
        if rule.algo.capacity(&rule.limit) == 0 {
            return Err(format!("rule {} can never admit", rule.name));
        }
    }
    for resource in &policy.resources {
        let url = resource.url.as_bytes();
        if !path::is_normal(url) || path::normalize(url).as_ref() != url {
            return Err(format!("url {:?} is not normal", resource.url));
        }
        let count = path::segment_count(url);
        if count < segments {
            return Err(format!("url {:?} after a more specific one", resource.url));
        }
        segments = count;
    }
    Ok(())
}

fn parse_and_check(input: &[u8]) -> Result<(), String> {
    let text = String::from_utf8_lossy(input);
    let first = parse_policy(&text);
    let second = parse_policy(&text);
    if outcome(&first) != outcome(&second) {
        return Err(format!(
            "two parses differ: {:?} then {:?}",
            outcome(&first),
            outcome(&second)
        ));
    }
    match &first {
        Ok(policy) => well_formed(policy),
        Err(_) => Ok(()),
    }
}

/// The documents as written (mostly YAML).
pub struct Yaml(pub Corpus);

impl Target for Yaml {
    fn name(&self) -> &'static str {
        "config_yaml"
    }
    fn weight(&self) -> u64 {
        6
    }
    fn generate(&self, rng: &mut Rng) -> Vec<u8> {
        generate(rng, &self.0.written)
    }
    fn run(&self, input: &[u8]) -> Result<(), String> {
        parse_and_check(input)
    }
}

/// Every document in its JSON form.
pub struct Json(pub Corpus);

impl Target for Json {
    fn name(&self) -> &'static str {
        "config_json"
    }
    fn weight(&self) -> u64 {
        4
    }
    fn generate(&self, rng: &mut Rng) -> Vec<u8> {
        generate(rng, &self.0.json)
    }
    fn run(&self, input: &[u8]) -> Result<(), String> {
        parse_and_check(input)
    }
}

/// One document, changed structurally (a value replaced, a key dropped or renamed, a
/// rule duplicated), written both as YAML and as JSON: both spellings must be accepted
/// or refused together, with the same rules. The input is the JSON text.
pub struct Forms(pub Corpus);

const KEYS: &[&str] = &[
    "Url",
    "url",
    "resources",
    "rules",
    "rpu",
    "unit",
    "algo",
    "scope",
    "actor",
    "actors",
    "header",
    "fallback",
    "burst",
    "slices",
    "slots",
    "lease",
    "name",
    "dry_run",
    "response",
    "status",
    "body",
    "headers",
    "global",
    "remote",
    "metrics",
    "path",
    "max_wait_seconds",
];

fn random_value(rng: &mut Rng) -> serde_json::Value {
    use serde_json::Value;
    match rng.below(9) {
        0 => Value::from(rng.interesting_u64()),
        1 => Value::from(-(rng.below(3) as i64)),
        2 => Value::from(rng.below(100) as f64 / 7.0),
        3 => Value::Bool(rng.one_in(2)),
        4 => Value::Null,
        5 => Value::from(*rng.pick(KEYS).unwrap_or(&"x")),
        6 => Value::from(
            *rng.pick(&[
                "/",
                "/a",
                "/a/../b",
                "//x",
                "W",
                "SW",
                "LB",
                "TB",
                "token bucket",
                "minute",
                "Seconds",
                "all",
                "ip",
                "device",
                "account",
                "actor",
                "global",
                "local",
                "skip",
                "shared",
                "none",
                "limited",
                "all",
            ])
            .unwrap_or(&""),
        ),
        7 => Value::Array(Vec::new()),
        _ => Value::Object(serde_json::Map::new()),
    }
}

/// Changes one randomly chosen place of `value`.
fn change(rng: &mut Rng, value: &mut serde_json::Value, depth: u32) {
    use serde_json::Value;
    match value {
        Value::Object(map) if !map.is_empty() && (depth > 6 || !rng.one_in(3)) => {
            let keys: Vec<String> = map.keys().cloned().collect();
            let Some(key) = rng.pick(&keys).cloned() else {
                return;
            };
            match rng.below(6) {
                0 => {
                    map.remove(&key);
                }
                1 => {
                    if let Some(moved) = map.remove(&key) {
                        map.insert((*rng.pick(KEYS).unwrap_or(&"x")).to_string(), moved);
                    }
                }
                2 => {
                    map.insert(
                        (*rng.pick(KEYS).unwrap_or(&"x")).to_string(),
                        random_value(rng),
                    );
                }
                _ => {
                    if let Some(inner) = map.get_mut(&key) {
                        change(rng, inner, depth + 1);
                    }
                }
            }
        }
        Value::Array(items) if !items.is_empty() && !rng.one_in(4) => {
            let at = rng.index(items.len());
            match rng.below(4) {
                0 => {
                    if let Some(copy) = items.get(at).cloned() {
                        items.push(copy);
                    }
                }
                1 => {
                    items.remove(at);
                }
                _ => {
                    if let Some(inner) = items.get_mut(at) {
                        change(rng, inner, depth + 1);
                    }
                }
            }
        }
        _ => *value = random_value(rng),
    }
}

/// Rules as the forms must agree on them.
fn rules_of(policy: &Policy) -> Vec<(u64, String, u32, bool)> {
    policy
        .rules()
        .map(|rule| {
            (
                rule.id,
                rule.name.clone(),
                rule.limit.rpu.get(),
                rule.dry_run,
            )
        })
        .collect()
}

impl Target for Forms {
    fn name(&self) -> &'static str {
        "config_forms"
    }
    fn weight(&self) -> u64 {
        3
    }
    fn generate(&self, rng: &mut Rng) -> Vec<u8> {
        let mut value = rng.pick(&self.0.values).cloned().unwrap_or_default();
        let changes = rng.below(4);
        for _ in 0..changes {
            change(rng, &mut value, 0);
        }
        serde_json::to_vec(&value).unwrap_or_default()
    }
    fn run(&self, input: &[u8]) -> Result<(), String> {
        let Ok(value) = serde_json::from_slice::<serde_json::Value>(input) else {
            return parse_and_check(input);
        };
        let json = serde_json::to_string(&value).map_err(|e| e.to_string())?;
        let yaml = serde_yaml::to_string(&value).map_err(|e| e.to_string())?;
        let (from_json, from_yaml) = (parse_policy(&json), parse_policy(&yaml));
        match (&from_json, &from_yaml) {
            (Ok(a), Ok(b)) if rules_of(a) == rules_of(b) => well_formed(a),
            (Err(_), Err(_)) => Ok(()),
            _ => Err(format!(
                "the JSON and YAML forms disagree:\nJSON {json}\n  -> {:?}\nYAML {yaml}\n  -> {:?}",
                from_json.as_ref().map(rules_of).map_err(|e| e.to_string()),
                from_yaml.as_ref().map(rules_of).map_err(|e| e.to_string())
            )),
        }
    }
}
