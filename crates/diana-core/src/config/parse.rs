//! From text to [`Policy`]: form detection, typed deserialization with positions, then
//! defaults and ordering.
//!
//! Accepted forms (YAML, or JSON such as Istio's `pluginConfig`):
//! - one block: `Url: /` + `rules: [...]` (the seed's document);
//! - a sequence of blocks;
//! - several `---` documents, each a block, a sequence of blocks or the full form (a
//!   section such as `global` may be given by one document only);
//! - the full form: `resources`, `actors`, `response`, `global`, `remote`, `dry_run`,
//!   `metrics`.
//!
//! The text is read twice: once as a sketch that finds the form of each document and the
//! actor names it defines, then into the typed structures of `raw` through
//! `serde_path_to_error`, so that an error names its field path and its line and column,
//! e.g. `resources[0].rules[1].rpu: invalid value: integer `0`, expected a nonzero u32 at
//! line 5 column 10`.

use super::error::{ConfigError, ConfigErrorKind, Position};
use super::locate::{locate, Site, Stop};
use super::model::{
    BoundsError, Cost, CostSource, CountOnly, GlobalSpec, HotShow, HotSpec, Lease, MetricsSpec,
    OnInvalidConfig, PathOptions, Pinned, PlanChoice, PlanName, PlanSource, Policy, RemoteSpec,
    Reserve, ReserveBounds, Resource, ResponseCost, ResponseSpec, Rule, RuleKeys, RuleUnit, Scope,
    Upfront, AUTO_LEASE_SHARE, DEFAULT_HOT_TOP, MAX_RESPONSE_COST,
};
use super::raw::{self, ContextGuard, RawBlock, RawFull, RawRule};
use super::shape::{Describe, Shape};
use crate::actor::{ActorDef, ActorRegistry};
use crate::algo;
use crate::breaker::{Reach, Settings, SlowCalls, Spec, StatusClasses, Window};
use crate::calendar::Zone;
use crate::hash::{hash_parts, IdentityHasher, IdentityKey};
use crate::matching;
use crate::metrics::stat_name;
use crate::path;
use crate::secret::Secret;
use crate::time::{Nanos, Unit, NANOS_PER_SECOND};
use crate::usage::Weights;
use crate::wire;
use serde::de::{self, IgnoredAny, Visitor};
use serde::Deserialize;
use std::fmt;
use std::num::{NonZeroU32, NonZeroU8};
use std::sync::Arc;

/// Default `slices` (sliding window).
const DEFAULT_SLICES: NonZeroU32 = nonzero(10);
/// Default `slots` (local slot table size for per-identity actors).
const DEFAULT_SLOTS: NonZeroU32 = nonzero(65_536);
/// Default `remote.poll_seconds`.
const DEFAULT_POLL_SECONDS: u32 = 10;
/// The environment variable that holds the quota service's credential when the document
/// has no `global.token` (the same name diana-quota reads).
pub const TOKEN_ENV: &str = "DIANA_QUOTA_TOKEN";
/// Default `max_wait_seconds` (leaky bucket).
const DEFAULT_MAX_WAIT_SECONDS: u64 = 10;

const fn nonzero(value: u32) -> NonZeroU32 {
    match NonZeroU32::new(value) {
        Some(value) => value,
        None => NonZeroU32::MIN,
    }
}

/// Seed of rule ids.
const RULE_SEED: u64 = 0x6469_616e_615f_7275; // "diana_ru"
/// Seed of a rule's table id ([`RuleKeys`]).
const TABLE_SEED: u64 = 0x6469_616e_615f_7462; // "diana_tb"

/// Parses and validates a Diana document (YAML or JSON, any form of DESIGN §3).
pub fn parse_policy(text: &str) -> Result<Policy, ConfigError> {
    let json = is_json(text);
    let collected = if json {
        parse_json(text)?
    } else {
        parse_yaml(text)?
    };
    build(collected).map_err(|refusal| refusal.located(text, json))
}

// ---------------------------------------------------------------------------------------
// Forms.

/// What one document is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    Empty,
    Block,
    Blocks,
    Full,
}

/// The first look at a document: its form and the actor names it defines. Reads through
/// the document without building it, so duplicate keys and bad values are left for the
/// typed pass, which reports them with their exact position.
struct Sketch {
    form: Form,
    actor_names: Vec<String>,
}

impl<'de> Deserialize<'de> for Sketch {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(SketchVisitor)
    }
}

struct SketchVisitor;

impl SketchVisitor {
    /// A scalar document: the typed pass reports "expected a resource block".
    fn scalar<E>(self) -> Result<Sketch, E> {
        Ok(Sketch {
            form: Form::Block,
            actor_names: Vec::new(),
        })
    }
}

impl<'de> Visitor<'de> for SketchVisitor {
    type Value = Sketch;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a Diana document")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Sketch, E> {
        Ok(Sketch {
            form: Form::Empty,
            actor_names: Vec::new(),
        })
    }

    fn visit_none<E: de::Error>(self) -> Result<Sketch, E> {
        self.visit_unit()
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Sketch, E> {
        self.scalar()
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Sketch, E> {
        self.scalar()
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Sketch, E> {
        self.scalar()
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Sketch, E> {
        self.scalar()
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<Sketch, E> {
        self.scalar()
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Sketch, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Sketch {
            form: Form::Blocks,
            actor_names: Vec::new(),
        })
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Sketch, A::Error> {
        let mut is_block = false;
        let mut actor_names = Vec::new();
        // A key of a block (under any spelling) makes the document a block.
        let block: Shape = RawBlock::shape();
        while let Some(key) = map.next_key::<serde_yaml::Value>()? {
            match key.as_str() {
                Some(key) if block.field(key).is_some() => {
                    is_block = true;
                    map.next_value::<IgnoredAny>()?;
                }
                Some("actors") => actor_names.extend(map.next_value::<ActorNames>()?.0),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let form = if is_block { Form::Block } else { Form::Full };
        Ok(Sketch { form, actor_names })
    }
}

/// The keys of an `actors:` mapping (anything else: none).
struct ActorNames(Vec<String>);

impl<'de> Deserialize<'de> for ActorNames {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ActorNamesVisitor)
    }
}

struct ActorNamesVisitor;

impl<'de> Visitor<'de> for ActorNamesVisitor {
    type Value = ActorNames;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("actor definitions")
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<ActorNames, A::Error> {
        let mut names = Vec::new();
        while let Some(key) = map.next_key::<serde_yaml::Value>()? {
            map.next_value::<IgnoredAny>()?;
            if let Some(name) = key.as_str() {
                names.push(name.to_string());
            }
        }
        Ok(ActorNames(names))
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<ActorNames, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(ActorNames(Vec::new()))
    }

    fn visit_unit<E: de::Error>(self) -> Result<ActorNames, E> {
        Ok(ActorNames(Vec::new()))
    }

    fn visit_none<E: de::Error>(self) -> Result<ActorNames, E> {
        self.visit_unit()
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<ActorNames, E> {
        self.visit_unit()
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<ActorNames, E> {
        self.visit_unit()
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<ActorNames, E> {
        self.visit_unit()
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<ActorNames, E> {
        self.visit_unit()
    }

    fn visit_str<E: de::Error>(self, _: &str) -> Result<ActorNames, E> {
        self.visit_unit()
    }
}

fn add_names(names: &mut Vec<String>, more: Vec<String>) {
    for name in more {
        if !names.contains(&name) {
            names.push(name);
        }
    }
}

/// Everything the documents say, not yet resolved.
#[derive(Default)]
struct Collected {
    blocks: Vec<RawBlock>,
    /// Where each of `blocks` is written.
    sites: Vec<Site>,
    /// Each definition, with the document that writes it.
    actors: Vec<(String, ActorDef, usize)>,
    /// The documents of the full form, in order.
    full_documents: Vec<usize>,
    response: Option<raw::RawResponse>,
    global: Option<raw::RawGlobal>,
    remote: Option<raw::RawRemote>,
    metrics: Option<raw::RawMetrics>,
    dry_run: Option<bool>,
    on_invalid_config: Option<OnInvalidConfig>,
    identity_key: Option<Secret>,
}

impl Collected {
    fn add_block(&mut self, block: RawBlock, site: Site) {
        self.blocks.push(block);
        self.sites.push(site);
    }

    fn add_blocks(&mut self, blocks: Vec<RawBlock>, document: usize) {
        let root = Site::new(document);
        for (index, block) in blocks.into_iter().enumerate() {
            self.add_block(block, root.index(index));
        }
    }

    fn add_full(&mut self, full: RawFull, document: usize) {
        self.full_documents.push(document);
        let resources = Site::new(document).key("resources");
        for (index, block) in full
            .resources
            .map(|section| section.0)
            .unwrap_or_default()
            .into_iter()
            .enumerate()
        {
            self.add_block(block, resources.index(index));
        }
        if let Some(actors) = full.actors {
            self.actors.extend(
                actors
                    .0
                     .0
                    .into_iter()
                    .map(|(name, def)| (name, def, document)),
            );
        }
        if let Some(response) = full.response {
            self.response = Some(response.0);
        }
        if let Some(global) = full.global {
            self.global = Some(global.0);
        }
        if let Some(remote) = full.remote {
            self.remote = Some(remote.0);
        }
        if let Some(metrics) = full.metrics {
            self.metrics = Some(metrics.0);
        }
        if let Some(dry_run) = full.dry_run {
            self.dry_run = Some(dry_run.0);
        }
        if let Some(identity_key) = full.identity_key {
            self.identity_key = Some(identity_key.0 .0);
        }
        if let Some(on_invalid_config) = full.on_invalid_config {
            self.on_invalid_config = Some(on_invalid_config.0);
        }
    }
}

/// True when the text is a JSON object or array (JSON is read by serde_json, whose
/// positions are exact; YAML flow style that is not JSON goes to the YAML reader).
pub(super) fn is_json(text: &str) -> bool {
    let trimmed = text.trim_start();
    (trimmed.starts_with('{') || trimmed.starts_with('['))
        && serde_json::from_str::<IgnoredAny>(text).is_ok()
}

fn parse_json(text: &str) -> Result<Collected, ConfigError> {
    let error = |err: serde_path_to_error::Error<serde_json::Error>| {
        let inner = err.inner();
        let position = (inner.line() > 0).then(|| (inner.line(), inner.column()));
        let composed = compose(
            None,
            &err.path().to_string(),
            &inner.to_string(),
            position,
            false,
            invalid,
        );
        at_the_value(composed, &inner.to_string(), text, true, 0, err.path())
    };
    let sketch: Sketch =
        serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text))
            .map_err(error)?;
    let mut names = raw::builtin_actor_names();
    add_names(&mut names, sketch.actor_names);
    let _guard = ContextGuard::new(names);

    let mut collected = Collected::default();
    let mut deserializer = serde_json::Deserializer::from_str(text);
    match sketch.form {
        Form::Empty => {}
        Form::Block => collected.add_block(
            serde_path_to_error::deserialize(&mut deserializer).map_err(error)?,
            Site::new(0),
        ),
        Form::Blocks => collected.add_blocks(
            serde_path_to_error::deserialize(&mut deserializer).map_err(error)?,
            0,
        ),
        Form::Full => collected.add_full(
            serde_path_to_error::deserialize(&mut deserializer).map_err(error)?,
            0,
        ),
    }
    Ok(collected)
}

fn parse_yaml(text: &str) -> Result<Collected, ConfigError> {
    // Pass 1: the form of every document and the actor names defined anywhere.
    let mut sketches = Vec::new();
    for document in serde_yaml::Deserializer::from_str(text) {
        let label = sketches.len() + 1;
        match Sketch::deserialize(document) {
            Ok(sketch) => sketches.push(sketch),
            Err(err) => {
                let position = err
                    .location()
                    .map(|location| (location.line(), location.column()));
                // Only a multi-document stream needs a document number; it is unknown
                // here whether more follow, so number from the second on.
                let label = (label > 1).then_some(label);
                let reason = err.to_string();
                return Err(compose(label, ".", &reason, position, false, syntax));
            }
        }
    }
    let multiple = sketches.len() > 1;
    let mut names = raw::builtin_actor_names();
    let forms: Vec<Form> = sketches
        .into_iter()
        .map(|sketch| {
            add_names(&mut names, sketch.actor_names);
            sketch.form
        })
        .collect();
    let _guard = ContextGuard::new(names);

    // Pass 2: typed, with paths and positions.
    let mut collected = Collected::default();
    for (index, document) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let label = multiple.then_some(index + 1);
        let error = |err: serde_path_to_error::Error<serde_yaml::Error>| {
            let inner = err.inner();
            let position = inner
                .location()
                .map(|location| (location.line(), location.column()));
            let composed = compose(
                label,
                &err.path().to_string(),
                &inner.to_string(),
                position,
                true,
                invalid,
            );
            at_the_value(composed, &inner.to_string(), text, false, index, err.path())
        };
        match forms.get(index).copied().unwrap_or(Form::Empty) {
            Form::Empty => {}
            Form::Block => collected.add_block(
                serde_path_to_error::deserialize(document).map_err(error)?,
                Site::new(index),
            ),
            Form::Blocks => collected.add_blocks(
                serde_path_to_error::deserialize(document).map_err(error)?,
                index,
            ),
            Form::Full => collected.add_full(
                serde_path_to_error::deserialize(document).map_err(error)?,
                index,
            ),
        }
    }
    Ok(collected)
}

/// A refusal raised before the value was read (a `null`, a section given again: see
/// [`raw::refused_before_reading`]) is reported by the YAML reader at the mapping around
/// it; this moves the error to the value itself, read again from the text at the error's
/// path.
fn at_the_value(
    mut error: ConfigError,
    message: &str,
    text: &str,
    json: bool,
    document: usize,
    path: &serde_path_to_error::Path,
) -> ConfigError {
    if !raw::refused_before_reading(message) {
        return error;
    }
    let mut site = Site::new(document);
    for segment in path.iter() {
        site = match segment {
            serde_path_to_error::Segment::Seq { index } => site.index(*index),
            serde_path_to_error::Segment::Map { key } => site.key(key),
            serde_path_to_error::Segment::Enum { variant } => site.key(variant),
            serde_path_to_error::Segment::Unknown => return error,
        };
    }
    let (_, _, position) = locate(text, json, &site, Stop::AtValue);
    if position.is_some() {
        error.position = position;
    }
    error
}

/// [`ConfigErrorKind::Invalid`].
pub(super) fn invalid(reason: String) -> ConfigErrorKind {
    ConfigErrorKind::Invalid { reason }
}

/// [`ConfigErrorKind::Syntax`].
fn syntax(reason: String) -> ConfigErrorKind {
    ConfigErrorKind::Syntax { reason }
}

/// A reader's error as a [`ConfigError`] of `kind`: its path, its position, and its message
/// without the path and position the reader may have written into it, so that it displays
/// as `[document N: ][path: ]message[ at line L column C]`.
pub(super) fn compose(
    document: Option<usize>,
    path: &str,
    message: &str,
    position: Option<(usize, usize)>,
    yaml_path_prefix: bool,
    kind: impl FnOnce(String) -> ConfigErrorKind,
) -> ConfigError {
    let mut message = message;
    if let Some((line, column)) = position {
        let suffix = format!(" at line {line} column {column}");
        message = message.strip_suffix(&suffix).unwrap_or(message);
    }
    if yaml_path_prefix {
        message = strip_path_prefix(message);
    }
    ConfigError {
        document,
        path: if path == "." {
            String::new()
        } else {
            path.to_string()
        },
        position: position.map(|(line, column)| Position { line, column }),
        kind: kind(message.to_string()),
    }
}

/// serde_yaml prefixes messages with its own idea of the path (`rules[0].rpu: …`); the
/// path from serde_path_to_error replaces it. A prefix is a first word ending in `: `.
fn strip_path_prefix(message: &str) -> &str {
    match message.split_once(": ") {
        Some((head, tail))
            if !head.is_empty()
                && !head.contains(|c: char| c.is_whitespace() || c == '`' || c == '"')
                && (head.starts_with('.')
                    || head.starts_with('[')
                    || head.contains(['.', '['])
                    || is_word(head)) =>
        {
            tail
        }
        _ => message,
    }
}

fn is_word(text: &str) -> bool {
    text.bytes()
        .all(|byte| byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-')
}

// ---------------------------------------------------------------------------------------
// Resolution.

/// A refusal found after the typed pass: what is wrong, and the value it is about, whose
/// path and position [`locate`] reads from the text.
struct Refusal {
    /// The value refused; `None` when the text does not hold it.
    site: Option<Site>,
    /// The path when there is no site.
    path: &'static str,
    kind: ConfigErrorKind,
}

impl Refusal {
    fn at(site: Site, kind: ConfigErrorKind) -> Refusal {
        Refusal {
            site: Some(site),
            path: "",
            kind,
        }
    }

    fn located(self, text: &str, json: bool) -> ConfigError {
        let Some(site) = self.site else {
            return ConfigError {
                path: self.path.to_string(),
                ..ConfigError::of(self.kind)
            };
        };
        let (document, path, position) = locate(text, json, &site, Stop::AtValue);
        ConfigError {
            document,
            path,
            position,
            kind: self.kind,
        }
    }
}

fn build(collected: Collected) -> Result<Policy, Refusal> {
    let mut actors = ActorRegistry::builtin();
    for (name, def, document) in collected.actors {
        let site = Site::new(document).key("actors").key(&name);
        actors
            .define(&name, def)
            .map_err(|reason| Refusal::at(site, ConfigErrorKind::Actor { reason }))?;
    }

    let response = match collected.response {
        None => ResponseSpec::default(),
        Some(raw) => {
            let default = ResponseSpec::default();
            ResponseSpec {
                status: raw.status.map_or(default.status, |status| {
                    u16::try_from(status.0).unwrap_or(default.status)
                }),
                body: raw.body.map_or(default.body, |text| text.0),
                headers: raw.headers.map_or(default.headers, |headers| headers.0),
                header_style: raw
                    .header_style
                    .map_or(default.header_style, |style| style.0),
            }
        }
    };

    let global = match collected.global {
        None => GlobalSpec {
            token: token_from_environment()?,
            ..GlobalSpec::default()
        },
        Some(raw) => {
            let default = GlobalSpec {
                token: if raw.token.is_some() {
                    None
                } else {
                    token_from_environment()?
                },
                ..GlobalSpec::default()
            };
            GlobalSpec {
                cluster: raw.cluster.map_or(default.cluster, |cluster| cluster.0),
                authority: raw
                    .authority
                    .map_or(default.authority, |authority| authority.0),
                path: raw.path.map_or(default.path, |path| path.0),
                timeout_ms: raw
                    .timeout_ms
                    .and_then(|ms| u32::try_from(ms.0).ok())
                    .unwrap_or(default.timeout_ms),
                lease: raw.lease.map_or(default.lease, lease_of),
                retry_seconds: raw
                    .retry_seconds
                    .and_then(|seconds| u32::try_from(seconds.0).ok())
                    .unwrap_or(default.retry_seconds),
                token: raw.token.map(|token| token.0).or(default.token),
                written: true,
            }
        }
    };

    let remote = collected.remote.map(|raw| RemoteSpec {
        authority: raw
            .authority
            .map_or_else(|| raw.cluster.0.clone(), |authority| authority.0),
        cluster: raw.cluster.0,
        path: raw.path.0,
        poll_seconds: raw
            .poll_seconds
            .map_or(DEFAULT_POLL_SECONDS, NonZeroU32::get),
        allow: raw.allow.map_or_else(Vec::new, |allow| {
            let mut names: Vec<Pinned> = Vec::new();
            for name in allow {
                if !names.contains(&name.0) {
                    names.push(name.0);
                }
            }
            names
        }),
        signature: raw.signature.map(|signature| signature.0),
    });

    if collected.blocks.is_empty() {
        return Err(Refusal {
            site: collected
                .full_documents
                .first()
                .map(|&document| Site::new(document).key("resources")),
            path: "",
            kind: ConfigErrorKind::NoResources,
        });
    }

    // Each resource with where its block is written, in evaluation order.
    let mut written = Vec::with_capacity(collected.blocks.len());
    for (block, site) in collected.blocks.into_iter().zip(collected.sites) {
        let url = block.url.0;
        let (raw_rules, breaker) = match (block.rules, block.breaker) {
            (None, None) => return Err(Refusal::at(site, ConfigErrorKind::NoRulesNorBreaker)),
            (rules, breaker) => (rules.unwrap_or_default(), breaker),
        };
        let breaker = breaker
            .map(|raw| build_breaker(&url, &raw, &site.key("breaker")))
            .transpose()?;
        let mut seen = Seen::default();
        let mut rules = Vec::with_capacity(raw_rules.len());
        // Where each rule is written (a rule with plans is several rules).
        let mut positions = Vec::with_capacity(raw_rules.len());
        for (index, raw) in raw_rules.into_iter().enumerate() {
            let at = site.key("rules").index(index);
            let built = build_rules(&url, index, raw, &actors, &global, &mut seen, &at)?;
            positions.extend(std::iter::repeat_n(index, built.len()));
            rules.extend(built);
        }
        let path = block
            .path
            .map_or_else(PathOptions::default, |path| PathOptions {
                strip_parameters: path.strip_parameters.unwrap_or(false),
                case_insensitive: path.case_insensitive.unwrap_or(false),
            });
        written.push((
            Resource {
                url,
                rules,
                breaker,
                path,
            },
            (site, positions),
        ));
    }
    written.sort_by_key(|(resource, _)| path::segment_count(resource.url.as_bytes()));
    let (mut resources, placed): (Vec<Resource>, Vec<(Site, Vec<usize>)>) =
        written.into_iter().unzip();
    let (sites, positions): (Vec<Site>, Vec<Vec<usize>>) = placed.into_iter().unzip();
    for (index, rule) in resources
        .iter_mut()
        .flat_map(|resource| resource.rules.iter_mut())
        .enumerate()
    {
        rule.index = index;
    }

    let mut names: Vec<(&str, &str)> = Vec::new();
    for ((resource, site), positions) in resources.iter().zip(&sites).zip(&positions) {
        for (rule, &index) in resource.rules.iter().zip(positions) {
            if let Some((other, _)) = names
                .iter()
                .find(|(_, metric_name)| *metric_name == rule.metric_name)
            {
                let kind = if *other == rule.name {
                    ConfigErrorKind::DuplicateRuleName {
                        name: rule.name.clone(),
                    }
                } else {
                    ConfigErrorKind::MetricNameClash {
                        first: other.to_string(),
                        second: rule.name.clone(),
                    }
                };
                return Err(Refusal::at(
                    site.key("rules").index(index).key("name"),
                    kind,
                ));
            }
            names.push((&rule.name, &rule.metric_name));
        }
    }
    check_global_rules_per_request(&resources, &sites)?;
    check_breakers(&mut resources, &sites)?;

    let mut policy = Policy {
        resources,
        response,
        global,
        remote,
        metrics: collected.metrics.map(|raw| MetricsSpec {
            path: path::normalize_str(&raw.path.0),
        }),
        dry_run: collected.dry_run.unwrap_or(false),
        on_invalid_config: collected.on_invalid_config.unwrap_or_default(),
    };
    // Identities hashed with the document's secret (DESIGN §6), or see `set_identity_key`.
    policy.set_identity_key(
        collected
            .identity_key
            .map(|secret| IdentityKey::derive(secret.expose().as_bytes())),
    );
    Ok(policy)
}

/// A resource's `breaker`, resolved (its [`Spec::index`] is set once the resources are in
/// evaluation order, by [`check_breakers`]).
fn build_breaker(url: &str, raw: &raw::RawBreaker, site: &Site) -> Result<Spec, Refusal> {
    let slow = match (&raw.slow_ms, &raw.slow_ratio) {
        (Some(ms), Some(ratio)) => Some(SlowCalls {
            threshold: Nanos::from_millis(ms.0),
            ratio: ratio.1,
        }),
        (None, None) => None,
        (Some(_), None) => {
            return Err(Refusal::at(
                site.key("slow_ms"),
                ConfigErrorKind::BreakerSlowPair {
                    written: "slow_ms",
                    missing: "slow_ratio",
                },
            ))
        }
        (None, Some(_)) => {
            return Err(Refusal::at(
                site.key("slow_ratio"),
                ConfigErrorKind::BreakerSlowPair {
                    written: "slow_ratio",
                    missing: "slow_ms",
                },
            ))
        }
    };
    let name = raw.name.as_ref().map_or_else(
        || match url.trim_start_matches('/') {
            "" => "root".to_string(),
            path => path.to_string(),
        },
        |name| name.0.clone(),
    );
    let failure_ratio = raw.failure_ratio.as_ref().map(|ratio| ratio.1);
    let mut settings = Settings::new(name, slow, failure_ratio)
        .map_err(|_| Refusal::at(site.clone(), ConfigErrorKind::BreakerNoThreshold))?;
    if let Some(statuses) = &raw.failure_status {
        let mut classes = StatusClasses::none();
        for &(first, last) in &statuses.0 {
            for status in first..=last {
                // 100 to 599, as the reader checked.
                classes.add_status(u32::from(status)).map_err(|error| {
                    Refusal::at(
                        site.key("failure_status"),
                        ConfigErrorKind::Invalid {
                            reason: error.to_string(),
                        },
                    )
                })?;
            }
        }
        settings.failure_status = classes;
    }
    if let Some(calls) = raw
        .min_calls
        .as_ref()
        .and_then(|calls| NonZeroU32::new(calls.get_u32()))
    {
        settings.min_calls = calls;
    }
    if let Some(seconds) = raw
        .window_seconds
        .as_ref()
        .and_then(|seconds| NonZeroU32::new(seconds.get_u32()))
    {
        settings.window = Window::from_secs(seconds);
    }
    if let Some(seconds) = &raw.open_seconds {
        settings.open_for = Nanos::from_secs(seconds.0);
    }
    if let Some(calls) = raw
        .half_open_calls
        .as_ref()
        .and_then(|calls| u8::try_from(calls.0).ok())
        .and_then(NonZeroU8::new)
    {
        settings.half_open_calls = calls;
    }
    if let Some(scope) = &raw.scope {
        settings.reach = match scope.0 {
            Scope::Local => Reach::Gateway,
            Scope::Global => Reach::Fleet,
        };
    }
    if let Some(force) = &raw.force {
        settings.force = force.0;
    }
    Ok(Spec {
        index: 0,
        metric_name: stat_name(&settings.name),
        settings,
        fallback_header: raw.fallback_header.as_ref().map(|header| header.0.clone()),
    })
}

/// Numbers the breakers in evaluation order ([`Spec::index`]) and refuses two that would
/// share a name (their state: the record is named after it) or a metric name, and a
/// fallback header that a rule reads.
fn check_breakers(resources: &mut [Resource], sites: &[Site]) -> Result<(), Refusal> {
    let read = request_headers_read(resources);
    let mut names: Vec<(String, String)> = Vec::new();
    let mut index = 0;
    for (resource, site) in resources.iter_mut().zip(sites) {
        let Some(spec) = &mut resource.breaker else {
            continue;
        };
        let site = site.key("breaker");
        spec.index = index;
        index += 1;
        let name = &spec.settings.name;
        if let Some((first, _)) = names
            .iter()
            .find(|(_, metric_name)| *metric_name == spec.metric_name)
        {
            let kind = if first == name {
                ConfigErrorKind::DuplicateBreakerName { name: name.clone() }
            } else {
                ConfigErrorKind::BreakerMetricNameClash {
                    first: first.clone(),
                    second: name.clone(),
                }
            };
            return Err(Refusal::at(site.key("name"), kind));
        }
        names.push((name.clone(), spec.metric_name.clone()));
        if let Some(header) = &spec.fallback_header {
            if let Some((_, read_by)) = read.iter().find(|(name, _)| name == header) {
                return Err(Refusal::at(
                    site.key("fallback_header"),
                    ConfigErrorKind::FallbackHeaderInUse {
                        header: header.clone(),
                        read_by: read_by.clone(),
                    },
                ));
            }
        }
    }
    Ok(())
}

/// Every request header the rules of `resources` read, each with what reads it (the first
/// rule that does): actors' headers, plans', costs' and reservations'.
fn request_headers_read(resources: &[Resource]) -> Vec<(String, String)> {
    let mut read: Vec<(String, String)> = Vec::new();
    let mut add = |header: &str, what: String| {
        if !read.iter().any(|(name, _)| name == header) {
            read.push((header.to_string(), what));
        }
    };
    for rule in resources.iter().flat_map(|resource| resource.rules.iter()) {
        for (key, value) in rule.actor_source() {
            if key == "header" {
                add(
                    value,
                    format!("actor `{}` (rule `{}`)", rule.actor_name, rule.name),
                );
            }
        }
        if let Some(PlanChoice {
            by: PlanSource::Header(name),
            ..
        }) = &rule.plan
        {
            add(name, format!("the plans of rule `{}`", rule.name));
        }
        if let Some(name) = rule.upfront().header() {
            add(name, format!("the cost of rule `{}`", rule.name));
        }
    }
    read
}

/// `global.token` when the document does not write one: the gateway process's environment
/// variable [`TOKEN_ENV`] when it is set (Envoy passes it to the VM when
/// `vm_config.environment_variables.host_env_keys` lists it; nginx with `env
/// DIANA_QUOTA_TOKEN;`), so that the secret can live where the platform keeps secrets and
/// not in the document. Set but too short: refused, naming the variable, not its value.
fn token_from_environment() -> Result<Option<Secret>, Refusal> {
    if std::env::var_os(TOKEN_ENV).is_none() {
        return Ok(None);
    }
    Secret::from_env(TOKEN_ENV)
        .map(Some)
        .map_err(|error| Refusal {
            site: None,
            path: "global.token",
            kind: ConfigErrorKind::Environment {
                variable: TOKEN_ENV,
                reason: error.to_string(),
            },
        })
}

/// Refuses a document in which one request could carry more global rules than one
/// callout may (the quota service would answer 400 to every such request): the global
/// rules of a resource and of every resource whose `Url` is a prefix of it all apply.
fn check_global_rules_per_request(resources: &[Resource], sites: &[Site]) -> Result<(), Refusal> {
    // Of a rule with plans, one plan applies to a request: its default stands for all.
    let applies = |rule: &&Rule| {
        rule.scope == Scope::Global
            && rule
                .plan
                .as_ref()
                .is_none_or(|choice| matches!(choice.plan, PlanName::Default { .. }))
    };
    let globals = |resource: &Resource| resource.rules.iter().filter(applies).count();
    for (resource, site) in resources.iter().zip(sites) {
        // Every block a request under this one's Url also matches (the outer blocks, by
        // their own way of comparing paths).
        let outer = |outer: &&Resource| matching::covers(outer, resource.url.as_bytes());
        let applying: usize = resources.iter().filter(outer).map(globals).sum();
        let costs: u64 = resources
            .iter()
            .filter(outer)
            .flat_map(|outer| outer.rules.iter())
            .filter(applies)
            .map(|rule| u64::from(rule.upfront().max()))
            .sum();
        if costs > wire::MAX_TOTAL_WANT {
            return Err(Refusal::at(
                site.key("Url"),
                ConfigErrorKind::TokensPerCallout {
                    url: resource.url.clone(),
                    tokens: costs,
                    most: wire::MAX_TOTAL_WANT,
                },
            ));
        }
        if applying > wire::MAX_RULES {
            return Err(Refusal::at(
                site.key("Url"),
                ConfigErrorKind::RulesPerCallout {
                    url: resource.url.clone(),
                    rules: applying,
                    most: wire::MAX_RULES,
                },
            ));
        }
    }
    Ok(())
}

fn lease_of(raw: raw::LeaseField) -> Lease {
    match raw {
        raw::LeaseField::Fixed(lease) => {
            Lease::Fixed(NonZeroU32::new(lease).unwrap_or(NonZeroU32::MIN))
        }
        raw::LeaseField::Auto => Lease::Auto,
    }
}

/// The rules of one written rule: itself, or with `rpu: {by, values, default}` one rule
/// per plan and one for every other value ([`Rule::plan`]).
fn build_rules(
    url: &str,
    index: usize,
    raw: RawRule,
    actors: &ActorRegistry,
    global: &GlobalSpec,
    seen: &mut Seen,
    site: &Site,
) -> Result<Vec<Rule>, Refusal> {
    let plans = match (&raw.rpu, &raw.max_in_flight) {
        (Some(_), Some(_)) => {
            return Err(Refusal::at(
                site.key("max_in_flight"),
                ConfigErrorKind::RateAndConcurrency,
            ))
        }
        (None, None) => return Err(Refusal::at(site.clone(), ConfigErrorKind::NoLimit)),
        (None, Some(places)) => {
            let places = NonZeroU32::new(places.get_u32()).unwrap_or(NonZeroU32::MIN);
            let rule = build_rule(url, index, &raw, places, None, actors, global, seen, site)?;
            return Ok(vec![rule]);
        }
        (Some(raw::RpuField::Fixed(rpu)), None) => {
            let rule = build_rule(url, index, &raw, *rpu, None, actors, global, seen, site)?;
            return Ok(vec![rule]);
        }
        (Some(raw::RpuField::Plans(plans)), None) => plans,
    };
    let by = match &plans.by {
        raw::PlanByField::Header(name) => PlanSource::Header(name.clone()),
        raw::PlanByField::JwtClaim(claim) => PlanSource::JwtClaim(claim.clone()),
    };
    let named: Arc<[String]> = plans
        .values
        .0
        .iter()
        .map(|(name, _)| name.clone())
        .collect();
    let mut variants: Vec<(PlanName, NonZeroU32, Vec<&str>)> = plans
        .values
        .0
        .iter()
        .map(|(name, rpu)| {
            (
                PlanName::Named(name.clone()),
                *rpu,
                vec!["rpu", "values", name.as_str()],
            )
        })
        .collect();
    variants.push((
        PlanName::Default { named },
        plans.default,
        vec!["rpu", "default"],
    ));
    let mut rules = Vec::with_capacity(variants.len());
    for (plan, rpu, field) in variants {
        let choice = PlanChoice {
            by: by.clone(),
            plan,
        };
        rules.push(build_rule(
            url,
            index,
            &raw,
            rpu,
            Some((choice, field.as_slice())),
            actors,
            global,
            seen,
            site,
        )?);
    }
    Ok(rules)
}

/// One rule with the limit `rpu`; `plan`: the plan it counts, and where its rpu is written.
#[allow(clippy::too_many_arguments)]
fn build_rule(
    url: &str,
    index: usize,
    raw: &RawRule,
    rpu: NonZeroU32,
    plan: Option<(PlanChoice, &[&str])>,
    actors: &ActorRegistry,
    global: &GlobalSpec,
    seen: &mut Seen,
    site: &Site,
) -> Result<Rule, Refusal> {
    let rpu_field: &[&str] = plan.as_ref().map_or(&["rpu"], |(_, field)| field);
    let refuse = |field: &[&str], kind: ConfigErrorKind| {
        // An error about the limit is about the plan's rpu.
        let field = if field == ["rpu"] { rpu_field } else { field };
        let site = field.iter().fold(site.clone(), |site, key| site.key(key));
        Refusal::at(site, kind)
    };
    let actor_name = raw
        .actor
        .as_ref()
        .map_or_else(|| "all".to_string(), |actor| actor.0.clone());
    let canonical = ActorRegistry::canonical_name(&actor_name);
    let def = actors.get(&actor_name).ok_or_else(|| {
        refuse(
            &["actor"],
            ConfigErrorKind::UnknownActor {
                actor: actor_name.clone(),
            },
        )
    })?;
    let in_flight = raw.max_in_flight.is_some();
    if in_flight {
        // What shapes a rate has no meaning for places held until a request ends.
        let written = [
            ("algo", raw.algo.is_some()),
            ("unit", raw.unit.is_some()),
            ("burst", raw.burst.is_some()),
            ("slices", raw.slices.is_some()),
            ("cost", raw.cost.is_some()),
            ("response_cost", raw.response_cost.is_some()),
            ("count", raw.count.is_some()),
            ("max_wait_seconds", raw.max_wait_seconds.is_some()),
            ("lease", raw.lease.is_some()),
            ("timezone", raw.timezone.is_some()),
        ];
        if let Some((field, _)) = written.into_iter().find(|(_, written)| *written) {
            return Err(refuse(
                &[field],
                ConfigErrorKind::NotForConcurrency { field },
            ));
        }
    }
    let algo: &'static dyn algo::Algorithm = if in_flight {
        &algo::InFlight
    } else {
        raw.algo
            .as_ref()
            .map_or_else(algo::default_algorithm, |algo| algo.0)
    };
    let written_unit = raw
        .unit
        .as_ref()
        .map_or(RuleUnit::Fixed(Unit::Second), |unit| unit.0);
    // A calendar period is the limit's own (`Limit::calendar`); its `limit.unit` is the
    // longest fixed unit, which nothing reads as its period.
    let (unit, calendar) = match written_unit {
        RuleUnit::Fixed(unit) => {
            if raw.timezone.is_some() {
                return Err(refuse(
                    &["timezone"],
                    ConfigErrorKind::TimezoneWithoutCalendar { unit: unit.name() },
                ));
            }
            (unit, None)
        }
        RuleUnit::Calendar(_) if !super::CALENDAR_ALGORITHMS.contains(&algo.code()) => {
            return Err(refuse(
                &["unit"],
                ConfigErrorKind::CalendarUnitNotApplicable {
                    unit: written_unit.name(),
                    algo: algo.code(),
                },
            ))
        }
        RuleUnit::Calendar(_) => written_unit.limit_unit(
            raw.timezone
                .as_ref()
                .map_or_else(Zone::utc, |zone| zone.0.clone()),
        ),
    };
    let burst = raw.burst.unwrap_or_else(|| algo.default_burst(rpu, unit));
    let slices = raw
        .slices
        .as_ref()
        .and_then(|slices| NonZeroU32::new(slices.get_u32()))
        .unwrap_or(DEFAULT_SLICES);
    let slots = if def.source.is_single_counter() {
        NonZeroU32::MIN
    } else {
        raw.slots
            .as_ref()
            .and_then(|slots| NonZeroU32::new(slots.get_u32()))
            .unwrap_or(DEFAULT_SLOTS)
    };
    let scope = raw.scope.as_ref().map_or(Scope::Local, |scope| scope.0);
    // A global calendar rule (`unit: week | month`, W and TB as in local scope) names its
    // period to the quota service on every call: `wire::RuleRequest::with_period`.
    // Accepting it silently would let an operator believe a local rule is shared or batched.
    if scope == Scope::Local && raw.lease.is_some() {
        return Err(refuse(&["lease"], ConfigErrorKind::LeaseNotApplicable));
    }
    // A place is taken by one request and held until it ends: never leased ahead.
    let written = if in_flight {
        Lease::Fixed(NonZeroU32::MIN)
    } else {
        raw.lease.map_or(global.lease, lease_of)
    };
    let cost = match &raw.cost {
        None => Cost::Fixed(NonZeroU32::MIN),
        Some(field) => cost_of(field).map_err(|(at, kind)| refuse(&["cost", at], kind))?,
    };
    let reserve = match raw
        .response_cost
        .as_ref()
        .and_then(|rc| rc.reserve.as_ref())
    {
        None => None,
        // One number says what a request takes up front: two would leave a reader guessing.
        Some(_) if raw.cost.is_some() => {
            return Err(refuse(&["cost"], ConfigErrorKind::CostWithReserve))
        }
        Some(field) => Some(
            reserve_of(field)
                .map_err(|(at, kind)| refuse(&["response_cost", "reserve", at], kind))?,
        ),
    };
    // What a request takes up front, and where its largest value is written.
    let (upfront, upfront_field): (Upfront<'_>, &[&str]) = match (&reserve, &raw.cost) {
        (Some(reserve @ Reserve::Fixed(_)), _) => {
            (Upfront::Reserve(reserve), &["response_cost", "reserve"])
        }
        (Some(reserve), _) => (
            Upfront::Reserve(reserve),
            &["response_cost", "reserve", "max"],
        ),
        (None, Some(raw::CostField::Header(_))) => (Upfront::Cost(&cost), &["cost", "max"]),
        (None, _) => (Upfront::Cost(&cost), &["cost"]),
    };
    let limit = algo::Limit {
        rpu,
        unit,
        burst,
        slices,
        calendar,
        period: None,
    };
    if u64::from(upfront.max()) > algo.capacity(&limit) {
        return Err(refuse(
            upfront_field,
            ConfigErrorKind::CostNeverPasses {
                cost: upfront.max(),
                capacity: algo.capacity(&limit),
            },
        ));
    }
    let (lease, lease_auto) = match written {
        Lease::Fixed(lease) => (lease, false),
        // The accuracy budget: a gateway holds at most 1/AUTO_LEASE_SHARE of the limit.
        Lease::Auto => {
            let cap =
                (algo.capacity(&limit) / AUTO_LEASE_SHARE).clamp(1, u64::from(wire::MAX_WANT));
            let cap = u32::try_from(cap).unwrap_or(1).max(upfront.max());
            (NonZeroU32::new(cap).unwrap_or(NonZeroU32::MIN), true)
        }
    };
    if scope == Scope::Global && !algo.waits() && upfront.max() > lease.get() {
        return Err(refuse(
            upfront_field,
            ConfigErrorKind::CostAboveLease {
                cost: upfront.max(),
                lease: lease.get(),
            },
        ));
    }
    // What diana-quota would refuse is refused here, naming the field: a global counter
    // lives at most about a day (docs/wire-format.md, "Bounds").
    if scope == Scope::Global {
        if let Err(error) = wire::check_rule_limits(algo, &limit) {
            return Err(refuse(
                &[error.field],
                ConfigErrorKind::QuotaBounds {
                    reason: error.reason,
                },
            ));
        }
    }
    let response_cost = match &raw.response_cost {
        None => None,
        Some(_) if !algo.allows_debt() => {
            return Err(refuse(
                &["response_cost"],
                ConfigErrorKind::ResponseCostNotApplicable { algo: algo.code() },
            ))
        }
        Some(raw) => Some(
            response_cost_of(raw, reserve)
                .map_err(|(at, kind)| refuse(&["response_cost", at], kind))?,
        ),
    };
    let count = match &raw.count {
        None => None,
        // A leaky bucket's turn, once passed, cannot be given back.
        Some(_) if !algo.allows_debt() => {
            return Err(refuse(
                &["count"],
                ConfigErrorKind::CountNotApplicable { algo: algo.code() },
            ))
        }
        Some(_) if response_cost.is_some() => {
            return Err(refuse(&["count"], ConfigErrorKind::CountWithResponseCost))
        }
        Some(raw) => Some(CountOnly {
            statuses: raw.status.0.clone(),
        }),
    };
    let hot = raw.hot.as_ref().map(|hot| HotSpec {
        show: hot.show.as_ref().map_or(HotShow::default(), |show| show.0),
        top: hot
            .top
            .as_ref()
            .and_then(|top| u8::try_from(top.0).ok())
            .and_then(NonZeroU8::new)
            .unwrap_or(DEFAULT_HOT_TOP),
    });
    let max_wait_seconds = match &raw.max_wait_seconds {
        Some(_) if !algo.waits() => {
            return Err(refuse(
                &["max_wait_seconds"],
                ConfigErrorKind::MaxWaitNotApplicable { algo: algo.code() },
            ))
        }
        Some(seconds) => seconds.0,
        None => DEFAULT_MAX_WAIT_SECONDS,
    };

    // A plan's counters are its own: its source and name are part of both hashes (a rule
    // without plans hashes as it always has).
    let (rpu_bytes, burst_bytes) = (rpu.get().to_le_bytes(), burst.get().to_le_bytes());
    let (slices_bytes, slots_bytes) = (slices.get().to_le_bytes(), slots.get().to_le_bytes());
    let plan = plan.map(|(choice, _)| choice);
    let plan_parts = plan
        .as_ref()
        .map(|choice| [choice.by.describe(), choice.name().to_string()]);
    let plan_bytes: Vec<&[u8]> = plan_parts.iter().flatten().map(String::as_bytes).collect();
    // A concurrency limit's state is the places held, whatever N: its id (the generation
    // that seals its records, and its key at the quota service) leaves N out, so that an
    // edit of `max_in_flight` keeps counting the requests inside (issue 41, item 5c).
    let limit_bytes: [&[u8]; 2] = if in_flight {
        [b"", b""]
    } else {
        [&rpu_bytes, &burst_bytes]
    };
    let [rpu_part, burst_part] = limit_bytes;
    let mut parts: Vec<&[u8]> = vec![
        url.as_bytes(),
        canonical.as_bytes(),
        def.spec.as_bytes(),
        algo.code().as_bytes(),
        rpu_part,
        written_unit.name().as_bytes(),
        burst_part,
        &slices_bytes,
        &slots_bytes,
        scope.name().as_bytes(),
    ];
    parts.extend(&plan_bytes);
    // A calendar's periods depend on its zone: another zone, other counters. (A rule of a
    // fixed unit hashes as it always has.)
    if let Some(calendar) = &limit.calendar {
        parts.push(calendar.zone().name().as_bytes());
    }
    let base = hash_parts(RULE_SEED, &parts);
    let id = seen.distinct(base);
    // Where the counters live: what an edit of the limit leaves alone, so that a config
    // center tuning `rpu` reuses the key names (Envoy never frees one) — the rule's name
    // when it has one, else its place among the block's rules of the same actor.
    let mut table_parts: Vec<&[u8]> = vec![
        url.as_bytes(),
        canonical.as_bytes(),
        def.spec.as_bytes(),
        &slots_bytes,
        scope.name().as_bytes(),
        raw.name.as_ref().map_or(&b""[..], |name| name.0.as_bytes()),
    ];
    table_parts.extend(&plan_bytes);
    let table = seen.distinct(hash_parts(TABLE_SEED, &table_parts));

    let written = raw
        .name
        .as_ref()
        .map_or_else(|| format!("{url}#{index}"), |name| name.0.clone());
    // Each plan is named, and counted in metrics, on its own: `api.pro`, `api.default`.
    let name = match &plan {
        Some(choice) => format!("{written}.{}", choice.name()),
        None => written,
    };
    Ok(Rule {
        index: 0,
        metric_name: stat_name(&name),
        name,
        id,
        actor_name,
        actor: def.source.clone(),
        actor_spec: def.spec.clone(),
        identity: IdentityHasher::default(),
        algo,
        limit,
        scope,
        slots,
        lease,
        lease_auto,
        cost,
        response_cost,
        hot,
        count,
        max_wait: max_wait_seconds * NANOS_PER_SECOND,
        dry_run: raw.dry_run.unwrap_or(false),
        keys: RuleKeys::of(table, id),
        plan,
    })
}

/// A cost as written (`cost`, `response_cost.reserve`); a refusal names the subfield
/// (`""` for the value itself).
fn cost_of(field: &raw::CostField) -> Result<Cost, (&'static str, ConfigErrorKind)> {
    match field {
        raw::CostField::Fixed(cost) => Ok(Cost::Fixed(
            NonZeroU32::new(*cost).unwrap_or(NonZeroU32::MIN),
        )),
        raw::CostField::Header(header) => {
            let max = NonZeroU32::new(header.max.get_u32()).unwrap_or(NonZeroU32::MIN);
            let default = header
                .default
                .as_ref()
                .and_then(|default| NonZeroU32::new(default.get_u32()))
                .unwrap_or(NonZeroU32::MIN);
            if default > max {
                return Err((
                    "default",
                    ConfigErrorKind::CostDefaultAboveMax {
                        default: default.get(),
                        max: max.get(),
                    },
                ));
            }
            Ok(Cost::Header {
                name: header.header.0.clone(),
                default,
                max,
            })
        }
    }
}

/// `response_cost` as written: one source, its cap, `weights` with `usage` only; a
/// refusal names the subfield.
fn response_cost_of(
    raw: &raw::RawResponseCost,
    reserve: Option<Reserve>,
) -> Result<ResponseCost, (&'static str, ConfigErrorKind)> {
    let written: Vec<&'static str> = [
        ("usage", raw.usage.is_some()),
        ("json", raw.json.is_some()),
        ("header", raw.header.is_some()),
    ]
    .into_iter()
    .filter_map(|(key, written)| written.then_some(key))
    .collect();
    let source = match (&raw.usage, &raw.json, &raw.header) {
        (Some(provider), None, None) => CostSource::Usage {
            provider: provider.0,
            weights: raw.weights.as_ref().map(weights_of).transpose()?,
        },
        (None, Some(path), None) => CostSource::Json(path.0.clone()),
        (None, None, Some(header)) => CostSource::Header(header.0.clone()),
        _ => {
            let at = written.get(1).copied().unwrap_or("");
            return Err((
                at,
                ConfigErrorKind::OneSource {
                    field: "response_cost",
                    choices: "usage, json or header",
                    written,
                },
            ));
        }
    };
    if raw.weights.is_some() && !matches!(source, CostSource::Usage { .. }) {
        return Err((
            "weights",
            ConfigErrorKind::WeightsWithoutUsage {
                source: source.key(),
            },
        ));
    }
    let max = match (&raw.max, &source) {
        (Some(max), _) => max.get_u32(),
        // A header's value is the upstream's word: its cap is the operator's to write.
        (None, CostSource::Header(_)) => return Err(("", ConfigErrorKind::HeaderCostWithoutMax)),
        (None, _) => MAX_RESPONSE_COST,
    };
    Ok(ResponseCost {
        source,
        max: NonZeroU32::new(max).unwrap_or(NonZeroU32::MIN),
        reserve,
    })
}

/// `weights` as written (each 1 unless written); both 0 would charge nothing ever.
fn weights_of(raw: &raw::RawWeights) -> Result<Weights, (&'static str, ConfigErrorKind)> {
    let weights = Weights {
        input: raw.input.as_ref().map_or(1, |weight| weight.0),
        output: raw.output.as_ref().map_or(1, |weight| weight.0),
    };
    if weights.input == 0 && weights.output == 0 {
        return Err(("weights", ConfigErrorKind::WeightsAllZero));
    }
    Ok(weights)
}

/// `response_cost.reserve` as written; a refusal names the subfield (`""` for the value
/// itself).
fn reserve_of(field: &raw::ReserveField) -> Result<Reserve, (&'static str, ConfigErrorKind)> {
    let raw = match field {
        raw::ReserveField::Fixed(tokens) => {
            return Ok(Reserve::Fixed(
                NonZeroU32::new(*tokens).unwrap_or(NonZeroU32::MIN),
            ))
        }
        raw::ReserveField::Read(raw) => raw,
    };
    let bound = |value: &raw::Ranged<1, { wire::MAX_WANT as u64 }>| {
        NonZeroU32::new(value.get_u32()).unwrap_or(NonZeroU32::MIN)
    };
    let max = bound(&raw.max);
    let default = match (&raw.default, &raw.json) {
        (Some(default), _) => bound(default),
        // What a request that says nothing reserves is the operator's to say.
        (None, Some(_)) => return Err(("", ConfigErrorKind::ReserveJsonWithoutDefault)),
        (None, None) => NonZeroU32::MIN,
    };
    let min = raw.min.as_ref().map(bound);
    let bounds = ReserveBounds::new(default, min, max).map_err(|error| match error {
        BoundsError::DefaultAboveMax => (
            "default",
            ConfigErrorKind::CostDefaultAboveMax {
                default: default.get(),
                max: max.get(),
            },
        ),
        BoundsError::MinAboveDefault => (
            "min",
            ConfigErrorKind::ReserveMinAboveDefault {
                min: min.map_or(0, NonZeroU32::get),
                default: default.get(),
            },
        ),
    })?;
    match (&raw.header, &raw.json) {
        (Some(header), None) => Ok(Reserve::Header {
            name: header.0.clone(),
            bounds,
        }),
        (None, Some(path)) => Ok(Reserve::Json {
            path: path.0.clone(),
            bounds,
        }),
        (header, json) => {
            let written: Vec<&'static str> =
                [("header", header.is_some()), ("json", json.is_some())]
                    .into_iter()
                    .filter_map(|(key, written)| written.then_some(key))
                    .collect();
            Err((
                if written.len() > 1 { "json" } else { "" },
                ConfigErrorKind::OneSource {
                    field: "response_cost.reserve",
                    choices: "header or json",
                    written,
                },
            ))
        }
    }
}

/// The hashes already given to a block's rules: a repeated one is told apart by how many
/// times it came before (identical rules keep counters of their own).
#[derive(Default)]
struct Seen(Vec<u64>);

impl Seen {
    fn distinct(&mut self, base: u64) -> u64 {
        let occurrence = self.0.iter().filter(|&&seen| seen == base).count() as u64;
        self.0.push(base);
        hash_parts(RULE_SEED, &[&base.to_le_bytes(), &occurrence.to_le_bytes()])
    }
}
