//! The rate limit configuration of the RLS and RLQS servers: envoyproxy/ratelimit's own YAML
//! format, read as it is, plus a few optional fields of Diana's under `rate_limit`.
//!
//! ```yaml
//! domain: edge                    # one domain per file; several files, several domains
//! descriptors:
//!   - key: remote_address         # no value: every value counts apart
//!     rate_limit: {unit: second, requests_per_unit: 10}
//!   - key: remote_address
//!     value: 50.0.0.5             # the most specific match wins: key and value first
//!     rate_limit: {unit: second, requests_per_unit: 0}
//!   - key: path
//!     value: /api/*               # wildcard: `*` matches any run of characters
//!     share_threshold: true       # ... and every match shares one counter
//!     rate_limit: {unit: minute, requests_per_unit: 100, algorithm: SW}
//!   - key: tenant
//!     descriptors:                # nested: (tenant, x), (plan, y) as one descriptor
//!       - key: plan
//!         value: free
//!         rate_limit: {unit: hour, requests_per_unit: 1000, name: free}
//!         shadow_mode: true       # counted, never refused
//! ```
//!
//! Fields (envoyproxy/ratelimit's, every one): `domain`; `descriptors[].key`, `.value`
//! (exact, or with `*` wildcards), `.rate_limit` (`unit`: second/minute/hour/day,
//! `requests_per_unit`, `unlimited`, `name`, `replaces: [{name}]`), `.shadow_mode`,
//! `.quota_mode` (a soft limit: refuses a call only when every quota rule of it is over),
//! `.share_threshold`, `.metadata` (sent back in the answer's dynamic metadata when the
//! descriptor passed, `--rls-response-metadata`), `.detailed_metric` and
//! `.value_to_metric` (the per-rule statistics' keys), nested `.descriptors`. Diana's, all
//! optional, under `rate_limit`: `algorithm` (`W` default, `SW`, `TB`; `LB` is refused:
//! neither protocol can carry a wait), `burst` (TB capacity, default `requests_per_unit`),
//! `slices` (SW, default 10) and `diana_key` (the counter's key, to share it with a Diana
//! global rule). Anything else is refused, naming the file and the field.
//!
//! A request's descriptor reaches a counter keyed `rls:<32 hex digits>`, a keyed hash of
//! its domain and entries ([`super::keys`]), bound to the rule's algorithm and every
//! parameter like any Diana counter (`diana:{rls:…}:W:10:minute:10:10` in Redis).

use super::keys::CounterKeys;
use diana_core::algo::{self, Algorithm, Limit};
use diana_core::calendar::{CalendarUnit, Zone};
use diana_core::config::{RuleUnit, CALENDAR_ALGORITHMS};
use diana_core::time::Unit;
use diana_core::wire::{self, RuleRequest};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value as PbValue};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};

/// Default sliding-window slices (as a Diana rule's).
pub const DEFAULT_SLICES: u32 = 10;
/// Most bytes of a request's domain, or of one descriptor entry's key or value.
pub const MAX_TEXT_BYTES: usize = 4096;
/// How much of a caller's text a log line or an error shows.
pub const SHOWN_BYTES: usize = 64;
/// Most entries in one request descriptor (or one RLQS bucket id).
pub const MAX_ENTRIES: usize = 64;
/// Most nesting in a configuration file.
pub const MAX_DEPTH: usize = 64;

/// At most the first [`SHOWN_BYTES`] of `text` (cut at a character's start): what a log
/// line or an error shows of a caller's text, however long it is.
pub fn shown(text: &str) -> &str {
    let mut end = text.len().min(SHOWN_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or_default()
}

pub use super::keys::KEY_PREFIX;

/// A YAML scalar read as text, as envoyproxy/ratelimit reads `key` and `value` (`value: 500`
/// is the string `500`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum Scalar {
    Text(String),
    Unsigned(u64),
    Signed(i64),
    Float(f64),
    Bool(bool),
}

impl Scalar {
    fn text(&self) -> String {
        match self {
            Scalar::Text(text) => text.clone(),
            Scalar::Unsigned(number) => number.to_string(),
            Scalar::Signed(number) => number.to_string(),
            Scalar::Float(number) => number.to_string(),
            Scalar::Bool(flag) => flag.to_string(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRoot {
    domain: Option<Scalar>,
    descriptors: Option<Vec<RawDescriptor>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescriptor {
    key: Option<Scalar>,
    value: Option<Scalar>,
    rate_limit: Option<RawRateLimit>,
    descriptors: Option<Vec<RawDescriptor>>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    quota_mode: bool,
    #[serde(default)]
    share_threshold: bool,
    #[serde(default)]
    detailed_metric: bool,
    #[serde(default)]
    value_to_metric: bool,
    #[serde(default)]
    metadata: Option<serde_yaml::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRateLimit {
    unit: Option<String>,
    requests_per_unit: Option<u64>,
    #[serde(default)]
    unlimited: bool,
    name: Option<String>,
    replaces: Option<Vec<RawReplaces>>,
    // Diana's.
    algorithm: Option<String>,
    burst: Option<u64>,
    slices: Option<u64>,
    diana_key: Option<String>,
    /// The IANA zone of a `week` or `month` unit's calendar (default UTC).
    timezone: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReplaces {
    name: Option<String>,
}

/// What a rule does with the descriptors it matches.
#[derive(Debug, Clone)]
pub enum RuleKind {
    /// `unlimited: true`: always OK, no counter.
    Unlimited,
    /// `requests_per_unit: 0`: always over the limit, no counter.
    Blocked,
    /// A counter with this algorithm and limit.
    Limited {
        algo: &'static dyn Algorithm,
        limit: Limit,
        /// `diana_key`: this counter's key instead of the descriptor's.
        diana_key: Option<String>,
    },
}

/// One `rate_limit` block, resolved.
#[derive(Debug, Clone)]
pub struct Rule {
    /// `rate_limit.name` (for `replaces`, and the IETF headers).
    pub name: Option<String>,
    /// Names of the rules this one replaces in a request that matches both.
    pub replaces: Vec<String>,
    /// `shadow_mode`: counted, never refuses.
    pub shadow: bool,
    /// `quota_mode`: a soft limit, refusing a call only when every quota rule of the call
    /// is over (envoyproxy/ratelimit's).
    pub quota: bool,
    /// `metadata`: returned in the answer's dynamic metadata when the descriptor passed.
    pub metadata: Option<Struct>,
    /// `detailed_metric`: the rule's statistics are kept per value.
    pub detailed_metric: bool,
    /// `value_to_metric`: the statistics' key holds the request's values where the
    /// configuration has none.
    pub value_to_metric: bool,
    pub kind: RuleKind,
    /// As configured (0 when blocked or unlimited).
    pub requests_per_unit: u32,
    /// As configured (`None` when unlimited): a fixed unit, or a calendar's week or month.
    pub unit: Option<RuleUnit>,
    /// `domain.key_value.key…`, the descriptor's place in the file (logs, headers).
    pub path: String,
}

impl Rule {
    /// The name the IETF headers give the rule: its `name`, else its place.
    pub fn label(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.path)
    }
}

/// How a configured descriptor matches a request entry's value.
#[derive(Debug, Clone)]
enum Value {
    /// No value: any value, each counted apart.
    Any,
    Exact(String),
    /// With `*`: the literal parts between the stars, and the pattern as written.
    Wildcard {
        parts: Vec<String>,
        pattern: String,
    },
}

#[derive(Debug, Clone)]
struct Child {
    key: String,
    value: Value,
    share_threshold: bool,
    rule: Option<Rule>,
    node: Node,
}

/// One level of descriptors.
#[derive(Debug, Clone, Default)]
struct Node {
    children: Vec<Child>,
    /// `key` → `value` of exact children → index.
    exact: HashMap<String, HashMap<String, usize>>,
    /// `key` of children without a value → index.
    any: HashMap<String, usize>,
    /// Wildcard children, in file order.
    wildcards: Vec<usize>,
}

impl Node {
    /// The child matching `key` = `value`: key and value first, then the wildcards in file
    /// order, then the key alone (envoyproxy/ratelimit's order).
    fn find(&self, key: &str, value: &str) -> Option<&Child> {
        let index = self
            .exact
            .get(key)
            .and_then(|values| values.get(value))
            .copied()
            .or_else(|| {
                self.wildcards.iter().copied().find(|&index| {
                    self.children.get(index).is_some_and(|child| {
                        child.key == key
                            && matches!(&child.value, Value::Wildcard { parts, .. } if wildcard_match(parts, value))
                    })
                })
            })
            .or_else(|| self.any.get(key).copied())?;
        self.children.get(index)
    }
}

/// Whether `value` matches a pattern split at its stars: starts with the first part, ends
/// with the last, and holds the middle ones in order in between. Each `*` matches any run
/// of characters, the empty one too.
pub fn wildcard_match(parts: &[String], value: &str) -> bool {
    let (Some(first), Some(last)) = (parts.first(), parts.last()) else {
        return false;
    };
    if parts.len() == 1 {
        return first == value;
    }
    if value.len() < parts.iter().map(String::len).sum::<usize>() {
        return false;
    }
    let Some(rest) = value.strip_prefix(first.as_str()) else {
        return false;
    };
    let Some(mut middle) = rest.strip_suffix(last.as_str()) else {
        return false;
    };
    for part in parts.iter().skip(1).take(parts.len().saturating_sub(2)) {
        match middle.find(part.as_str()) {
            Some(at) => middle = middle.get(at + part.len()..).unwrap_or(""),
            None => return false,
        }
    }
    true
}

/// One domain's descriptors.
#[derive(Debug, Clone)]
pub struct Domain {
    pub name: String,
    /// The file it was read from.
    pub file: PathBuf,
    root: Node,
}

/// Every domain of every file, and the keys of their counters.
#[derive(Debug, Clone, Default)]
pub struct RlsConfig {
    domains: HashMap<String, Domain>,
    keys: CounterKeys,
}

/// The counter a descriptor was matched to.
#[derive(Debug, Clone)]
pub struct Matched<'a> {
    pub rule: &'a Rule,
    /// The counter's key (`rls:…`, or the rule's `diana_key`).
    pub key: String,
}

/// What a request descriptor (or an RLQS bucket) finds in the configuration.
#[derive(Debug, Clone)]
pub enum Lookup<'a> {
    /// No file has this domain.
    UnknownDomain,
    /// No rule: no limit applies.
    NoMatch,
    Matched(Matched<'a>),
}

impl RlsConfig {
    /// This configuration with its counters keyed by `keys`.
    pub fn with_keys(mut self, keys: CounterKeys) -> RlsConfig {
        self.keys = keys;
        self
    }

    /// The keys of the counters.
    pub fn keys(&self) -> &CounterKeys {
        &self.keys
    }

    /// The domains, sorted.
    pub fn domains(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.domains.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Rules configured, over every domain.
    pub fn rules(&self) -> usize {
        fn count(node: &Node) -> usize {
            node.children
                .iter()
                .map(|child| usize::from(child.rule.is_some()) + count(&child.node))
                .sum()
        }
        self.domains
            .values()
            .map(|domain| count(&domain.root))
            .sum()
    }

    /// The rule of a request descriptor (its entries in order), as envoyproxy/ratelimit
    /// finds it: level by level, each entry matched by key and value, then by wildcard, then
    /// by key alone; the rule is the one at the level of the last entry (a request with more
    /// or fewer entries than the configuration nests matches nothing).
    pub fn lookup<'a>(&'a self, domain: &str, entries: &[(&str, &str)]) -> Lookup<'a> {
        let Some(found) = self.domains.get(domain) else {
            return Lookup::UnknownDomain;
        };
        let mut node = &found.root;
        let mut path = Vec::with_capacity(entries.len());
        let mut rule = None;
        for (index, &(key, value)) in entries.iter().enumerate() {
            let Some(child) = node.find(key, value) else {
                return Lookup::NoMatch;
            };
            path.push((key, counted_value(child, value)));
            if index + 1 == entries.len() {
                rule = child.rule.as_ref();
            }
            node = &child.node;
        }
        match rule {
            Some(rule) => Lookup::Matched(Matched {
                key: key_of(&self.keys, rule, domain, &path),
                rule,
            }),
            None => Lookup::NoMatch,
        }
    }

    /// The rule of an RLQS bucket (an unordered map of entries): the entries are matched
    /// in the order the configuration nests their keys, trying at each level the
    /// descriptors in file order whose key the bucket holds; the match must use every
    /// entry. Returns the match with the entries in that order (so a bucket and an RLS
    /// descriptor with the same entries name the same counter).
    pub fn lookup_bucket<'a>(
        &'a self,
        domain: &str,
        bucket: &BTreeMap<String, String>,
    ) -> (Lookup<'a>, Vec<(String, String)>) {
        let Some(found) = self.domains.get(domain) else {
            return (Lookup::UnknownDomain, Vec::new());
        };
        let mut order = Vec::with_capacity(bucket.len());
        let mut used = vec![false; bucket.len()];
        let entries: Vec<(&str, &str)> = bucket
            .iter()
            .map(|(key, value)| (key.as_str(), value.as_str()))
            .collect();
        if entries.is_empty() || !order_bucket(&found.root, &entries, &mut used, &mut order) {
            return (Lookup::NoMatch, Vec::new());
        }
        let ordered: Vec<(&str, &str)> = order
            .iter()
            .filter_map(|&index| entries.get(index).copied())
            .collect();
        let lookup = self.lookup(domain, &ordered);
        let owned = ordered
            .iter()
            .map(|&(key, value)| (key.to_string(), value.to_string()))
            .collect();
        (lookup, owned)
    }
}

/// Depth-first: extends `order` with an entry of `entries` not yet `used` that a child of
/// `node` matches, until every entry is used at a level whose child has a rule.
fn order_bucket(
    node: &Node,
    entries: &[(&str, &str)],
    used: &mut [bool],
    order: &mut Vec<usize>,
) -> bool {
    let mut tried: Vec<&str> = Vec::new();
    for child in &node.children {
        if tried.contains(&child.key.as_str()) {
            continue;
        }
        tried.push(&child.key);
        let Some(index) = entries.iter().enumerate().position(|(index, (key, _))| {
            *key == child.key && !used.get(index).copied().unwrap_or(true)
        }) else {
            continue;
        };
        let Some(&(key, value)) = entries.get(index) else {
            continue;
        };
        // The child the entry really lands on (key and value first, as for a request).
        let Some(target) = node.find(key, value) else {
            continue;
        };
        if let Some(flag) = used.get_mut(index) {
            *flag = true;
        }
        order.push(index);
        let done = used.iter().all(|&flag| flag);
        if (done && target.rule.is_some())
            || (!done && order_bucket(&target.node, entries, used, order))
        {
            return true;
        }
        order.pop();
        if let Some(flag) = used.get_mut(index) {
            *flag = false;
        }
    }
    false
}

/// The value an entry contributes to its counter's key: the pattern for a wildcard with
/// `share_threshold` (every match shares the counter), else the request's value.
fn counted_value<'a>(child: &'a Child, value: &'a str) -> &'a str {
    match &child.value {
        Value::Wildcard { pattern, .. } if child.share_threshold => pattern,
        _ => value,
    }
}

fn key_of(keys: &CounterKeys, rule: &Rule, domain: &str, path: &[(&str, &str)]) -> String {
    match &rule.kind {
        RuleKind::Limited {
            diana_key: Some(key),
            ..
        } => key.clone(),
        _ => keys.counter_key(domain, path),
    }
}

/// Maps Envoy's `RateLimitResponse.RateLimit.Unit` to Diana's (`MONTH` and `WEEK` are
/// UTC calendar periods); `None` for `YEAR` and UNKNOWN.
pub fn unit_of_proto(unit: i32) -> Option<RuleUnit> {
    match unit {
        1 => Some(RuleUnit::Fixed(Unit::Second)),
        2 => Some(RuleUnit::Fixed(Unit::Minute)),
        3 => Some(RuleUnit::Fixed(Unit::Hour)),
        4 => Some(RuleUnit::Fixed(Unit::Day)),
        5 => Some(RuleUnit::Calendar(CalendarUnit::Month)),
        7 => Some(RuleUnit::Calendar(CalendarUnit::Week)),
        _ => None,
    }
}

/// Diana's unit as Envoy's `RateLimitResponse.RateLimit.Unit`.
pub fn proto_unit(unit: RuleUnit) -> i32 {
    match unit {
        RuleUnit::Fixed(Unit::Second) => 1,
        RuleUnit::Fixed(Unit::Minute) => 2,
        RuleUnit::Fixed(Unit::Hour) => 3,
        RuleUnit::Fixed(Unit::Day) => 4,
        RuleUnit::Calendar(CalendarUnit::Month) => 5,
        RuleUnit::Calendar(CalendarUnit::Week) => 7,
    }
}

/// The limit of `rpu` per `unit` (a calendar's in `zone`) with the other fields given:
/// a calendar limit counts per period of its zone ([`RuleUnit::limit_unit`], as in a
/// Diana document).
pub fn limit_of(
    rpu: NonZeroU32,
    unit: RuleUnit,
    zone: Zone,
    burst: impl FnOnce(Unit) -> NonZeroU32,
    slices: NonZeroU32,
) -> Limit {
    let (unit, calendar) = unit.limit_unit(zone);
    Limit {
        rpu,
        unit,
        burst: burst(unit),
        slices,
        calendar,
        period: None,
    }
}

/// Why a configuration could not be loaded: the path or file, and what is wrong there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A path `--rls-config` names cannot be read (the system's reason).
    #[error("--rls-config {}: {reason}", path.display())]
    Unreadable { path: PathBuf, reason: String },
    /// A directory `--rls-config` names holds no configuration file.
    #[error("--rls-config {}: no *.yaml or *.yml file in this directory", .0.display())]
    EmptyDirectory(PathBuf),
    /// `--rls-config` given no path.
    #[error("--rls-config: no file given")]
    NoFile,
    /// A configuration file cannot be read (the system's reason).
    #[error("{}: {reason}", file.display())]
    FileUnreadable { file: PathBuf, reason: String },
    /// Not YAML of envoyproxy/ratelimit's shape (the reader's message, with its position).
    #[error("{}: {reason}", file.display())]
    Syntax { file: PathBuf, reason: String },
    /// A file without a domain.
    #[error("{}: domain: a config file cannot have an empty domain", file.display())]
    EmptyDomain { file: PathBuf },
    /// A domain that an earlier file already holds.
    #[error("{}: duplicate domain `{domain}` (also in {})", file.display(), first.display())]
    DuplicateDomain {
        file: PathBuf,
        domain: String,
        first: PathBuf,
    },
    /// A field refused, at its path (`descriptors[0].rate_limit.unit`).
    #[error("{}: {field}: {problem}", file.display())]
    Field {
        file: PathBuf,
        field: String,
        problem: Problem,
    },
}

/// What is wrong with one field of a descriptor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    #[error("nested more than {MAX_DEPTH} levels")]
    NestedTooDeep,
    #[error("a descriptor has an empty key")]
    EmptyKey,
    #[error("must be a map of keys to values, got {got}")]
    MetadataNotMap { got: &'static str },
    #[error("only for a wildcard value (containing `*`), but `{composite}` has none")]
    ShareThresholdWithoutWildcard { composite: String },
    #[error("duplicate descriptor composite key `{path}`")]
    DuplicateKey { path: String },
    #[error("should not have an empty replaces entry")]
    EmptyReplaces,
    #[error("replaces should not contain the name of the same descriptor (`{name}`)")]
    ReplacesItself { name: String },
    #[error("should not specify a rate limit unit when unlimited")]
    UnitWhenUnlimited,
    #[error("means nothing on an unlimited rate limit")]
    NothingWhenUnlimited,
    #[error("means nothing with requests_per_unit 0 (every request is over the limit)")]
    NothingWhenBlocked,
    #[error("missing: second, minute, hour, day, week or month")]
    NoUnit,
    #[error(
        "`{unit}` is not supported: a Diana counter spans at most a calendar month \
         (second, minute, hour, day, week, month)"
    )]
    UnitTooLong { unit: String },
    #[error("invalid rate limit unit `{unit}` (second, minute, hour, day, week, month)")]
    UnknownUnit { unit: String },
    #[error(
        "`{unit}` counts in calendar periods with W or TB only, not {code} \
         (a period's length varies)"
    )]
    CalendarAlgorithm {
        unit: &'static str,
        code: &'static str,
    },
    #[error("only with a calendar unit (week or month), not `{unit}`")]
    TimezoneWithoutCalendar { unit: &'static str },
    /// Not a zone of the bundled database (its reason).
    #[error("{reason}")]
    BadTimezone { reason: String },
    #[error("{requests} is more than 4294967295")]
    RequestsTooMany { requests: u64 },
    #[error("unknown algorithm `{algorithm}` (W, SW, TB)")]
    UnknownAlgorithm { algorithm: String },
    #[error(
        "{code} (leaky bucket) answers with a wait, which neither Envoy's rate limit \
         protocol nor its quota protocol can carry (the filter forwards or rejects): use TB for bursts \
         or SW for a smooth window"
    )]
    AlgorithmWaits { code: &'static str },
    #[error("must be between 1 and {max}, got {value}")]
    OutOfRange { max: u32, value: u64 },
    /// A limit the quota service's wire format refuses ([`wire::LimitError`]'s reason).
    #[error("{reason}")]
    Bounds { reason: String },
    #[error(
        "names one counter, but this descriptor counts each value apart \
         (a descriptor without a value, or a wildcard without share_threshold, on the way to it): \
         give it values, or share_threshold"
    )]
    KeyCountedApart,
    /// A `diana_key` the wire format refuses (its reason).
    #[error("{reason}")]
    InvalidKey { reason: String },
}

/// The files `paths` name: a file as is, a directory's `*.yaml` and `*.yml` files (not
/// recursively, sorted by name).
pub fn config_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>, ConfigError> {
    let mut files = Vec::new();
    for path in paths {
        let unreadable = |error: std::io::Error| ConfigError::Unreadable {
            path: path.clone(),
            reason: error.to_string(),
        };
        let metadata = std::fs::metadata(path).map_err(unreadable)?;
        if metadata.is_dir() {
            let entries = std::fs::read_dir(path).map_err(unreadable)?;
            let mut found: Vec<PathBuf> = entries
                .filter_map(Result::ok)
                .map(|entry| entry.path())
                .filter(|file| {
                    file.is_file()
                        && file
                            .extension()
                            .and_then(|ext| ext.to_str())
                            .is_some_and(|ext| ext == "yaml" || ext == "yml")
                })
                .collect();
            found.sort();
            if found.is_empty() {
                return Err(ConfigError::EmptyDirectory(path.clone()));
            }
            files.extend(found);
        } else {
            files.push(path.clone());
        }
    }
    if files.is_empty() {
        return Err(ConfigError::NoFile);
    }
    Ok(files)
}

/// Reads every file of `paths` ([`config_files`]), one domain each, their counters keyed
/// by `keys`; a domain in two files is refused.
pub fn load(paths: &[PathBuf], keys: &CounterKeys) -> Result<RlsConfig, ConfigError> {
    let mut config = RlsConfig::default().with_keys(keys.clone());
    for file in config_files(paths)? {
        let text = std::fs::read_to_string(&file).map_err(|error| ConfigError::FileUnreadable {
            file: file.clone(),
            reason: error.to_string(),
        })?;
        let domain = parse_domain(&text, &file)?;
        if let Some(first) = config.domains.get(&domain.name) {
            return Err(ConfigError::DuplicateDomain {
                file,
                domain: domain.name,
                first: first.file.clone(),
            });
        }
        config.domains.insert(domain.name.clone(), domain);
    }
    Ok(config)
}

/// Parses one file's text (`file` names it in errors).
pub fn parse_domain(text: &str, file: &Path) -> Result<Domain, ConfigError> {
    let raw: RawRoot = serde_yaml::from_str(text).map_err(|error| ConfigError::Syntax {
        file: file.to_path_buf(),
        reason: error.to_string(),
    })?;
    let name = raw.domain.map(|domain| domain.text()).unwrap_or_default();
    if name.is_empty() {
        return Err(ConfigError::EmptyDomain {
            file: file.to_path_buf(),
        });
    }
    let mut root = Node::default();
    let mut context = Context {
        domain: &name,
        path: String::from("descriptors"),
        depth: 0,
    };
    load_level(
        &mut root,
        raw.descriptors.unwrap_or_default(),
        &mut context,
        &name,
        false,
    )
    .map_err(|FieldError { field, problem }| ConfigError::Field {
        file: file.to_path_buf(),
        field,
        problem,
    })?;
    Ok(Domain {
        name,
        file: file.to_path_buf(),
        root,
    })
}

/// A refused field, before the file is known.
struct FieldError {
    field: String,
    problem: Problem,
}

/// Refuses `field` for `problem`.
fn refuse<T>(field: impl Into<String>, problem: Problem) -> Result<T, FieldError> {
    Err(FieldError {
        field: field.into(),
        problem,
    })
}

struct Context<'a> {
    domain: &'a str,
    /// The field path of the current list (`descriptors[0].descriptors`).
    path: String,
    depth: usize,
}

/// Loads one list of descriptors into `node`. `parent`: the composite key so far
/// (`domain.key_value`); `counts_apart`: an entry above matches values it counts apart
/// (no value, or a wildcard without `share_threshold`).
fn load_level(
    node: &mut Node,
    descriptors: Vec<RawDescriptor>,
    context: &mut Context<'_>,
    parent: &str,
    counts_apart: bool,
) -> Result<(), FieldError> {
    if context.depth >= MAX_DEPTH {
        return refuse(context.path.as_str(), Problem::NestedTooDeep);
    }
    for (index, raw) in descriptors.into_iter().enumerate() {
        let here = format!("{}[{index}]", context.path);
        let key = raw.key.as_ref().map(Scalar::text).unwrap_or_default();
        if key.is_empty() {
            return refuse(format!("{here}.key"), Problem::EmptyKey);
        }
        let value_text = raw.value.as_ref().map(Scalar::text).unwrap_or_default();
        let composite = if value_text.is_empty() {
            key.clone()
        } else {
            format!("{key}_{value_text}")
        };
        let path = format!("{parent}.{composite}");
        let value = if value_text.is_empty() {
            Value::Any
        } else if value_text.contains('*') {
            Value::Wildcard {
                parts: value_text.split('*').map(str::to_string).collect(),
                pattern: value_text.clone(),
            }
        } else {
            Value::Exact(value_text.clone())
        };
        if raw.share_threshold && !matches!(value, Value::Wildcard { .. }) {
            return refuse(
                format!("{here}.share_threshold"),
                Problem::ShareThresholdWithoutWildcard { composite },
            );
        }
        let duplicate = match &value {
            Value::Any => node.any.contains_key(&key),
            Value::Exact(value) => node
                .exact
                .get(&key)
                .is_some_and(|values| values.contains_key(value)),
            Value::Wildcard { pattern, .. } => node.wildcards.iter().any(|&other| {
                node.children.get(other).is_some_and(|child| {
                    child.key == key
                        && matches!(&child.value, Value::Wildcard { pattern: seen, .. } if seen == pattern)
                })
            }),
        };
        if duplicate {
            return refuse(here, Problem::DuplicateKey { path });
        }
        let apart = counts_apart
            || matches!(value, Value::Any)
            || (matches!(value, Value::Wildcard { .. }) && !raw.share_threshold);
        let metadata = match raw.metadata {
            None => None,
            Some(value) => Some(metadata_struct(value).map_err(|problem| FieldError {
                field: format!("{here}.metadata"),
                problem,
            })?),
        };
        let rule = match raw.rate_limit {
            Some(rate_limit) => Some(Rule {
                quota: raw.quota_mode,
                metadata,
                detailed_metric: raw.detailed_metric,
                value_to_metric: raw.value_to_metric,
                ..load_rule(
                    rate_limit,
                    raw.shadow_mode,
                    &format!("{here}.rate_limit"),
                    &path,
                    apart,
                )?
            }),
            None => None,
        };
        let mut child = Child {
            key: key.clone(),
            value,
            share_threshold: raw.share_threshold,
            rule,
            node: Node::default(),
        };
        if let Some(nested) = raw.descriptors {
            let saved = std::mem::replace(&mut context.path, format!("{here}.descriptors"));
            context.depth += 1;
            let loaded = load_level(&mut child.node, nested, context, &path, apart);
            context.depth -= 1;
            context.path = saved;
            loaded?;
        }
        let position = node.children.len();
        match &child.value {
            Value::Any => {
                node.any.insert(key, position);
            }
            Value::Exact(value) => {
                node.exact
                    .entry(key)
                    .or_default()
                    .insert(value.clone(), position);
            }
            Value::Wildcard { .. } => node.wildcards.push(position),
        }
        node.children.push(child);
    }
    let _ = context.domain;
    Ok(())
}

fn load_rule(
    raw: RawRateLimit,
    shadow: bool,
    here: &str,
    path: &str,
    counts_apart: bool,
) -> Result<Rule, FieldError> {
    let name = raw.name.filter(|name| !name.is_empty());
    let mut replaces = Vec::new();
    for (index, replaced) in raw.replaces.unwrap_or_default().into_iter().enumerate() {
        let replaced = replaced.name.unwrap_or_default();
        if replaced.is_empty() {
            return refuse(
                format!("{here}.replaces[{index}].name"),
                Problem::EmptyReplaces,
            );
        }
        if name.as_deref() == Some(replaced.as_str()) {
            return refuse(
                format!("{here}.replaces[{index}].name"),
                Problem::ReplacesItself { name: replaced },
            );
        }
        replaces.push(replaced);
    }
    let unit_text = raw.unit.unwrap_or_default();
    let rule = |kind, requests_per_unit, unit| Rule {
        name: name.clone(),
        replaces: replaces.clone(),
        shadow,
        quota: false,
        metadata: None,
        detailed_metric: false,
        value_to_metric: false,
        kind,
        requests_per_unit,
        unit,
        path: path.to_string(),
    };
    if raw.unlimited {
        if !unit_text.is_empty() {
            return refuse(format!("{here}.unit"), Problem::UnitWhenUnlimited);
        }
        let extra = [
            ("algorithm", raw.algorithm.is_some()),
            ("burst", raw.burst.is_some()),
            ("slices", raw.slices.is_some()),
            ("diana_key", raw.diana_key.is_some()),
            ("timezone", raw.timezone.is_some()),
        ];
        if let Some((field, _)) = extra.iter().find(|(_, set)| *set) {
            return refuse(format!("{here}.{field}"), Problem::NothingWhenUnlimited);
        }
        return Ok(rule(RuleKind::Unlimited, 0, None));
    }
    let unit = match parse_unit(&unit_text) {
        Ok(unit) => unit,
        Err(problem) => return refuse(format!("{here}.unit"), problem),
    };
    let requests = raw.requests_per_unit.unwrap_or(0);
    let Ok(requests) = u32::try_from(requests) else {
        return refuse(
            format!("{here}.requests_per_unit"),
            Problem::RequestsTooMany { requests },
        );
    };
    let algo = match &raw.algorithm {
        None => &algo::FixedWindow as &'static dyn Algorithm,
        Some(text) => match algo::lookup(text) {
            Some(algo) => algo,
            None => {
                return refuse(
                    format!("{here}.algorithm"),
                    Problem::UnknownAlgorithm {
                        algorithm: text.clone(),
                    },
                )
            }
        },
    };
    if algo.waits() {
        return refuse(
            format!("{here}.algorithm"),
            Problem::AlgorithmWaits { code: algo.code() },
        );
    }
    let zone = match (unit, &raw.timezone) {
        (_, None) => Zone::utc(),
        (RuleUnit::Fixed(unit), Some(_)) => {
            return refuse(
                format!("{here}.timezone"),
                Problem::TimezoneWithoutCalendar { unit: unit.name() },
            )
        }
        (RuleUnit::Calendar(_), Some(name)) => match Zone::parse(name) {
            Ok(zone) => zone,
            Err(error) => {
                return refuse(
                    format!("{here}.timezone"),
                    Problem::BadTimezone {
                        reason: error.to_string(),
                    },
                )
            }
        },
    };
    // A period of varying length: a fixed window is the period, a token bucket refills
    // `rpu` over it; a sliding window's slices would not tile it (as in a Diana document).
    if let RuleUnit::Calendar(period) = unit {
        if !CALENDAR_ALGORITHMS.contains(&algo.code()) {
            return refuse(
                format!("{here}.algorithm"),
                Problem::CalendarAlgorithm {
                    unit: period.name(),
                    code: algo.code(),
                },
            );
        }
    }
    let Some(rpu) = NonZeroU32::new(requests) else {
        // Zero requests per unit: every request is over the limit (a block list).
        let extra = [
            ("burst", raw.burst.is_some()),
            ("slices", raw.slices.is_some()),
            ("diana_key", raw.diana_key.is_some()),
            ("timezone", raw.timezone.is_some()),
        ];
        if let Some((field, _)) = extra.iter().find(|(_, set)| *set) {
            return refuse(format!("{here}.{field}"), Problem::NothingWhenBlocked);
        }
        return Ok(rule(RuleKind::Blocked, 0, Some(unit)));
    };
    let burst = match raw.burst {
        None => None,
        Some(burst) => match u32::try_from(burst).ok().and_then(NonZeroU32::new) {
            Some(burst) => Some(burst),
            None => {
                return refuse(
                    format!("{here}.burst"),
                    Problem::OutOfRange {
                        max: u32::MAX,
                        value: burst,
                    },
                )
            }
        },
    };
    let slices = match raw.slices {
        None => NonZeroU32::new(DEFAULT_SLICES).unwrap_or(NonZeroU32::MIN),
        Some(slices) => match u32::try_from(slices)
            .ok()
            .and_then(NonZeroU32::new)
            .filter(|slices| slices.get() <= wire::MAX_SLICES)
        {
            Some(slices) => slices,
            None => {
                return refuse(
                    format!("{here}.slices"),
                    Problem::OutOfRange {
                        max: wire::MAX_SLICES,
                        value: slices,
                    },
                )
            }
        },
    };
    let limit = limit_of(
        rpu,
        unit,
        zone,
        |unit| burst.unwrap_or_else(|| algo.default_burst(rpu, unit)),
        slices,
    );
    if let Err(error) = wire::check_rule_limits(algo, &limit) {
        return refuse(
            format!("{here}.{}", error.field),
            Problem::Bounds {
                reason: error.reason,
            },
        );
    }
    if let Some(key) = &raw.diana_key {
        if counts_apart {
            return refuse(format!("{here}.diana_key"), Problem::KeyCountedApart);
        }
        if let Err(refused) = RuleRequest::new(key.clone(), algo, &limit, 1).resolve(0) {
            // The key is the only field of that request this file wrote on its own.
            let reason = if refused.field.ends_with(".key") {
                refused.problem.to_string()
            } else {
                refused.to_string()
            };
            return refuse(format!("{here}.diana_key"), Problem::InvalidKey { reason });
        }
    }
    Ok(rule(
        RuleKind::Limited {
            algo,
            limit,
            diana_key: raw.diana_key,
        },
        requests,
        Some(unit),
    ))
}

/// A descriptor's `metadata` as the protobuf `Struct` the answer carries: a map (its keys
/// as text, as envoyproxy/ratelimit writes them), any YAML inside it.
fn metadata_struct(value: serde_yaml::Value) -> Result<Struct, Problem> {
    match value {
        serde_yaml::Value::Mapping(map) => Ok(struct_of(map)),
        serde_yaml::Value::Tagged(tagged) => metadata_struct(tagged.value),
        other => Err(Problem::MetadataNotMap {
            got: yaml_kind(&other),
        }),
    }
}

fn yaml_kind(value: &serde_yaml::Value) -> &'static str {
    match value {
        serde_yaml::Value::Null => "null",
        serde_yaml::Value::Bool(_) => "a boolean",
        serde_yaml::Value::Number(_) => "a number",
        serde_yaml::Value::String(_) => "a string",
        serde_yaml::Value::Sequence(_) => "a list",
        serde_yaml::Value::Mapping(_) => "a map",
        serde_yaml::Value::Tagged(_) => "a tagged value",
    }
}

fn struct_of(map: serde_yaml::Mapping) -> Struct {
    Struct {
        fields: map
            .into_iter()
            .map(|(key, value)| (scalar_text(&key), value_of(value)))
            .collect(),
    }
}

/// A map key as text (`500` is `"500"`, as envoyproxy/ratelimit's `%v`).
fn scalar_text(key: &serde_yaml::Value) -> String {
    match key {
        serde_yaml::Value::String(text) => text.clone(),
        serde_yaml::Value::Number(number) => number.to_string(),
        serde_yaml::Value::Bool(flag) => flag.to_string(),
        serde_yaml::Value::Null => "<nil>".to_string(),
        serde_yaml::Value::Tagged(tagged) => scalar_text(&tagged.value),
        other => serde_yaml::to_string(other)
            .map(|text| text.trim().to_string())
            .unwrap_or_default(),
    }
}

fn value_of(value: serde_yaml::Value) -> PbValue {
    let kind = match value {
        serde_yaml::Value::Null => Kind::NullValue(0),
        serde_yaml::Value::Bool(flag) => Kind::BoolValue(flag),
        serde_yaml::Value::Number(number) => Kind::NumberValue(number.as_f64().unwrap_or(0.0)),
        serde_yaml::Value::String(text) => Kind::StringValue(text),
        serde_yaml::Value::Sequence(items) => Kind::ListValue(ListValue {
            values: items.into_iter().map(value_of).collect(),
        }),
        serde_yaml::Value::Mapping(map) => Kind::StructValue(struct_of(map)),
        serde_yaml::Value::Tagged(tagged) => return value_of(tagged.value),
    };
    PbValue { kind: Some(kind) }
}

/// `second`, `minute`, `hour`, `day`, `week`, `month`, case-insensitive (envoyproxy/
/// ratelimit's names; `week` and `month` are calendar periods, where envoyproxy/ratelimit
/// counts 7 and 30 days from 1970); `year` is refused.
fn parse_unit(text: &str) -> Result<RuleUnit, Problem> {
    let lower = text.trim().to_ascii_lowercase();
    match lower.as_str() {
        "second" => Ok(RuleUnit::Fixed(Unit::Second)),
        "minute" => Ok(RuleUnit::Fixed(Unit::Minute)),
        "hour" => Ok(RuleUnit::Fixed(Unit::Hour)),
        "day" => Ok(RuleUnit::Fixed(Unit::Day)),
        "week" => Ok(RuleUnit::Calendar(CalendarUnit::Week)),
        "month" => Ok(RuleUnit::Calendar(CalendarUnit::Month)),
        "year" => Err(Problem::UnitTooLong {
            unit: text.to_string(),
        }),
        "" => Err(Problem::NoUnit),
        _ => Err(Problem::UnknownUnit {
            unit: text.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<RlsConfig, String> {
        let domain =
            parse_domain(text, Path::new("test.yaml")).map_err(|error| error.to_string())?;
        let mut config = RlsConfig::default();
        config.domains.insert(domain.name.clone(), domain);
        Ok(config)
    }

    fn matched<'a>(
        config: &'a RlsConfig,
        domain: &str,
        entries: &[(&str, &str)],
    ) -> Option<Matched<'a>> {
        match config.lookup(domain, entries) {
            Lookup::Matched(matched) => Some(matched),
            _ => None,
        }
    }

    const EXAMPLES: &str = r#"
domain: messaging
descriptors:
  # Only allow 5 marketing messages a day
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit:
          unit: day
          requests_per_unit: 5
  - key: to_number
    rate_limit:
      unit: day
      requests_per_unit: 100
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: remote_address
    value: 50.0.0.5
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: database
    value: 500
    rate_limit: {unit: Second, requests_per_unit: 500}
  - key: ldap
    rate_limit:
      unlimited: true
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: route
    value: /api/*/action
    detailed_metric: true
    value_to_metric: true
    metadata: {team: a}
    rate_limit: {unit: minute, requests_per_unit: 20, algorithm: SW, slices: 6}
  - key: tenant
    descriptors:
      - key: plan
        value: free
        shadow_mode: true
        rate_limit: {unit: hour, requests_per_unit: 1000, name: free, algorithm: TB, burst: 50}
"#;

    #[test]
    fn reads_envoyproxy_ratelimit_files() {
        let config = parse(EXAMPLES).unwrap();
        assert_eq!(config.domains(), ["messaging"]);
        assert_eq!(config.rules(), 9);

        let nested = matched(
            &config,
            "messaging",
            &[("message_type", "marketing"), ("to_number", "2061111111")],
        )
        .unwrap();
        assert_eq!(nested.rule.requests_per_unit, 5);
        assert_eq!(
            nested.rule.path,
            "messaging.message_type_marketing.to_number"
        );
        let other = matched(
            &config,
            "messaging",
            &[("message_type", "marketing"), ("to_number", "2062222222")],
        )
        .unwrap();
        assert_ne!(nested.key, other.key, "each value counts apart");
        assert!(nested.key.starts_with("rls:") && nested.key.len() == 36);

        // Most specific first: key and value, then the key alone.
        let blocked = matched(&config, "messaging", &[("remote_address", "50.0.0.5")]).unwrap();
        assert!(matches!(blocked.rule.kind, RuleKind::Blocked));
        let any = matched(&config, "messaging", &[("remote_address", "50.0.0.1")]).unwrap();
        assert_eq!(any.rule.requests_per_unit, 10);

        // Numbers are values too; units are case-insensitive.
        let database = matched(&config, "messaging", &[("database", "500")]).unwrap();
        assert_eq!(database.rule.unit, Some(RuleUnit::Fixed(Unit::Second)));
        assert!(matches!(
            matched(&config, "messaging", &[("ldap", "x")])
                .unwrap()
                .rule
                .kind,
            RuleKind::Unlimited
        ));

        // share_threshold: every match shares one counter; other wildcards count apart.
        let a = matched(&config, "messaging", &[("files", "files/a.pdf")]).unwrap();
        let b = matched(&config, "messaging", &[("files", "files/b.csv")]).unwrap();
        assert_eq!(a.key, b.key);
        assert!(matches!(
            config.lookup("messaging", &[("files", "other/a")]),
            Lookup::NoMatch
        ));
        let one = matched(&config, "messaging", &[("route", "/api/1/action")]).unwrap();
        let two = matched(&config, "messaging", &[("route", "/api/2/action")]).unwrap();
        assert_ne!(one.key, two.key);
        assert!(matches!(
            config.lookup("messaging", &[("route", "/api/1/other")]),
            Lookup::NoMatch
        ));
        match &one.rule.kind {
            RuleKind::Limited { algo, limit, .. } => {
                assert_eq!(algo.code(), "SW");
                assert_eq!(limit.slices.get(), 6);
                assert_eq!(limit.burst.get(), 20);
            }
            other => panic!("{other:?}"),
        }

        // Depth must match: fewer or more entries than the nesting match nothing.
        assert!(matches!(
            config.lookup("messaging", &[("message_type", "marketing")]),
            Lookup::NoMatch
        ));
        assert!(matches!(
            config.lookup("messaging", &[("remote_address", "1"), ("x", "y")]),
            Lookup::NoMatch
        ));
        assert!(matches!(
            config.lookup("other", &[("to_number", "1")]),
            Lookup::UnknownDomain
        ));

        let free = matched(&config, "messaging", &[("tenant", "t1"), ("plan", "free")]).unwrap();
        assert!(free.rule.shadow);
        assert_eq!(free.rule.label(), "free");
        match &free.rule.kind {
            RuleKind::Limited { algo, limit, .. } => {
                assert_eq!(algo.code(), "TB");
                assert_eq!(limit.burst.get(), 50);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn wildcards_match_like_envoyproxy_ratelimit() {
        let parts = |pattern: &str| pattern.split('*').map(str::to_string).collect::<Vec<_>>();
        assert!(wildcard_match(&parts("value*"), "value"));
        assert!(wildcard_match(&parts("value*"), "valueXYZ"));
        assert!(!wildcard_match(&parts("value*"), "valu"));
        assert!(wildcard_match(&parts("/api/*/action"), "/api/123/action"));
        assert!(!wildcard_match(&parts("/api/*/action"), "/api/123/other"));
        assert!(wildcard_match(
            &parts("/api/*/resource/*/action"),
            "/api/v1/resource/1/action"
        ));
        assert!(!wildcard_match(
            &parts("/api/*/resource/*/action"),
            "/api/v1/action"
        ));
        assert!(!wildcard_match(&parts("ab*ba"), "aba"));
        assert!(wildcard_match(&parts("*"), "anything"));
    }

    #[test]
    fn bad_files_are_refused_naming_the_field() {
        let cases = [
            ("descriptors: []", "domain: a config file cannot have an empty domain"),
            ("domain: d\ndescriptors: [{value: x}]", "descriptors[0].key: a descriptor has an empty key"),
            ("domain: d\ndescriptors: [{key: k, rate_limit: {unit: fortnight, requests_per_unit: 1}}]",
             "descriptors[0].rate_limit.unit: invalid rate limit unit `fortnight`"),
            ("domain: d\ndescriptors: [{key: k, rate_limit: {unit: year, requests_per_unit: 1}}]",
             "descriptors[0].rate_limit.unit: `year` is not supported: a Diana counter spans at most a calendar month"),
            ("domain: d\ndescriptors: [{key: k, rate_limit: {unit: month, requests_per_unit: 1, algorithm: SW}}]",
             "descriptors[0].rate_limit.algorithm: `month` counts in calendar periods with W or TB only, not SW"),
            ("domain: d\ndescriptors: [{key: k, rate_limit: {unit: hour, requests_per_unit: 1, timezone: UTC}}]",
             "descriptors[0].rate_limit.timezone: only with a calendar unit (week or month), not `hour`"),
            ("domain: d\ndescriptors: [{key: k, rate_limit: {unit: week, requests_per_unit: 1, timezone: Mars/Olympus}}]",
             "descriptors[0].rate_limit.timezone: \"Mars/Olympus\" is not an IANA time zone name"),
            ("domain: d\ndescriptors: [{key: k, rate_limit: {unlimited: true, timezone: UTC}}]",
             "descriptors[0].rate_limit.timezone: means nothing on an unlimited rate limit"),
            ("domain: d\ndescriptors: [{key: k, rate_limit: {unlimited: true, unit: second}}]",
             "should not specify a rate limit unit when unlimited"),
            ("domain: d\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 1, algorithm: LB}}]",
             "descriptors[0].rate_limit.algorithm: LB (leaky bucket) answers with a wait"),
            ("domain: d\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 1, algorithm: XX}}]",
             "unknown algorithm `XX`"),
            ("domain: d\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 1, colour: red}}]",
             "unknown field `colour`"),
            ("domain: d\ndescriptors: [{key: k, value: v}, {key: k, value: v}]",
             "descriptors[1]: duplicate descriptor composite key `d.k_v`"),
            ("domain: d\ndescriptors: [{key: k, metadata: [a, b], rate_limit: {unit: second, requests_per_unit: 1}}]",
             "descriptors[0].metadata: must be a map of keys to values, got a list"),
            ("domain: d\ndescriptors: [{key: k, share_threshold: true}]", "only for a wildcard value"),
            ("domain: d\ndescriptors: [{key: k, rate_limit: {name: a, replaces: [{name: a}], unit: second, requests_per_unit: 1}}]",
             "replaces should not contain the name of the same descriptor"),
            ("domain: d\ndescriptors: [{key: k, rate_limit: {unit: day, requests_per_unit: 1, algorithm: TB, burst: 5}}]",
             "descriptors[0].rate_limit.burst: 5 at 1 per day spans"),
            ("domain: d\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 1, diana_key: x}}]",
             "diana_key: names one counter, but this descriptor counts each value apart"),
            ("domain: d\ndescriptors: [{key: k, value: v, rate_limit: {unit: second, requests_per_unit: 1, diana_key: 'a b'}}]",
             "diana_key: invalid character ' '"),
            ("domain: d\ndescriptors: [{key: k, value: v, rate_limit: {unit: second, requests_per_unit: 1, slices: 61}}]",
             "slices: must be between 1 and 60"),
            ("domain: d\ndescriptors: [{key: k, descriptors: [{key: j, rate_limit: {unit: hour}}, {key: j, value: '', rate_limit: {unit: hour}}]}]",
             "descriptors[0].descriptors[1]: duplicate descriptor composite key `d.k.j`"),
        ];
        for (text, expected) in cases {
            let error = parse(text).unwrap_err();
            assert!(error.starts_with("test.yaml: "), "{error}");
            assert!(
                error.contains(expected),
                "{text}\n→ {error}\nexpected: {expected}"
            );
        }
        // Missing requests_per_unit reads as 0, as in envoyproxy/ratelimit: a block.
        let config = parse("domain: d\ndescriptors: [{key: k, rate_limit: {unit: hour}}]").unwrap();
        assert!(matches!(
            matched(&config, "d", &[("k", "v")]).unwrap().rule.kind,
            RuleKind::Blocked
        ));
    }

    #[test]
    fn a_diana_key_names_a_shared_counter() {
        let config = parse(
            "domain: d\ndescriptors:\n  - key: tier\n    value: gold\n    rate_limit: {unit: minute, requests_per_unit: 10, diana_key: '8f3a2c1d00e1b7a4:0000000000000001'}\n  - key: path\n    value: /x/*\n    share_threshold: true\n    rate_limit: {unit: minute, requests_per_unit: 10, diana_key: shared}\n",
        )
        .unwrap();
        assert_eq!(
            matched(&config, "d", &[("tier", "gold")]).unwrap().key,
            "8f3a2c1d00e1b7a4:0000000000000001"
        );
        assert_eq!(
            matched(&config, "d", &[("path", "/x/1")]).unwrap().key,
            "shared"
        );
    }

    #[test]
    fn buckets_match_in_the_order_the_file_nests_them() {
        let config = parse(
            "domain: d\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: plan\n        value: free\n        rate_limit: {unit: minute, requests_per_unit: 5}\n  - key: name\n    rate_limit: {unit: minute, requests_per_unit: 7}\n",
        )
        .unwrap();
        let bucket: BTreeMap<String, String> = [("plan", "free"), ("tenant", "t1")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let (lookup, order) = config.lookup_bucket("d", &bucket);
        let Lookup::Matched(found) = lookup else {
            panic!("{lookup:?}")
        };
        assert_eq!(found.rule.requests_per_unit, 5);
        assert_eq!(
            order,
            [
                ("tenant".to_string(), "t1".to_string()),
                ("plan".to_string(), "free".to_string())
            ]
        );
        // The same counter as the RLS descriptor (tenant, t1), (plan, free).
        assert_eq!(
            found.key,
            matched(&config, "d", &[("tenant", "t1"), ("plan", "free")])
                .unwrap()
                .key
        );

        let one: BTreeMap<String, String> = [("name".to_string(), "a".to_string())]
            .into_iter()
            .collect();
        assert!(matches!(
            config.lookup_bucket("d", &one).0,
            Lookup::Matched(_)
        ));
        let extra: BTreeMap<String, String> = [("name", "a"), ("zzz", "b")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert!(matches!(
            config.lookup_bucket("d", &extra).0,
            Lookup::NoMatch
        ));
        assert!(matches!(
            config.lookup_bucket("x", &one).0,
            Lookup::UnknownDomain
        ));
    }

    #[test]
    fn a_refused_field_names_its_file_path_and_problem() {
        let error = parse_domain(
            "domain: d\ndescriptors: [{key: k, descriptors: [{key: j, rate_limit: {unit: year, requests_per_unit: 1}}]}]",
            Path::new("tenants.yaml"),
        )
        .unwrap_err();
        assert_eq!(
            error,
            ConfigError::Field {
                file: PathBuf::from("tenants.yaml"),
                field: "descriptors[0].descriptors[0].rate_limit.unit".to_string(),
                problem: Problem::UnitTooLong {
                    unit: "year".to_string()
                },
            }
        );
        assert_eq!(
            error.to_string(),
            "tenants.yaml: descriptors[0].descriptors[0].rate_limit.unit: `year` is not supported: \
             a Diana counter spans at most a calendar month (second, minute, hour, day, week, month)"
        );
        let error = parse_domain("descriptors: []", Path::new("x.yaml")).unwrap_err();
        assert_eq!(
            error,
            ConfigError::EmptyDomain {
                file: PathBuf::from("x.yaml")
            }
        );
    }

    #[test]
    fn files_and_directories_load_one_domain_each() {
        let temp = tempfile::tempdir().unwrap();
        let dir = temp.path().to_path_buf();
        std::fs::write(dir.join("a.yaml"), "domain: a\ndescriptors: [{key: k, rate_limit: {unit: second, requests_per_unit: 1}}]\n").unwrap();
        std::fs::write(dir.join("b.yml"), "domain: b\ndescriptors: []\n").unwrap();
        std::fs::write(dir.join("notes.txt"), "not read").unwrap();
        let config = load(std::slice::from_ref(&dir), &CounterKeys::public()).unwrap();
        assert_eq!(config.domains(), ["a", "b"]);
        std::fs::write(dir.join("c.yaml"), "domain: a\n").unwrap();
        let error = load(std::slice::from_ref(&dir), &CounterKeys::public()).unwrap_err();
        assert_eq!(
            error,
            ConfigError::DuplicateDomain {
                file: dir.join("c.yaml"),
                domain: "a".to_string(),
                first: dir.join("a.yaml"),
            }
        );
        assert!(
            error
                .to_string()
                .contains("c.yaml: duplicate domain `a` (also in"),
            "{error}"
        );
        let error = load(&[dir.join("missing.yaml")], &CounterKeys::public()).unwrap_err();
        assert!(
            matches!(&error, ConfigError::Unreadable { path, .. } if path == &dir.join("missing.yaml")),
            "{error:?}"
        );
        assert!(error.to_string().starts_with("--rls-config "), "{error}");
    }
}
