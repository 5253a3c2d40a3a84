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

use super::raw::{self, ContextGuard, RawBlock, RawFull, RawRule};
use super::{
    ConfigError, Cost, GlobalSpec, Lease, MetricsSpec, Pinned, Policy, RemoteSpec, Resource,
    ResponseCost, ResponseSpec, Rule, RuleKeys, Scope, AUTO_LEASE_SHARE,
};
use crate::actor::{ActorDef, ActorRegistry};
use crate::algo;
use crate::hash::{hash_parts, IdentityHasher, IdentityKey};
use crate::metrics::stat_name;
use crate::path;
use crate::secret::Secret;
use crate::time::{Unit, NANOS_PER_SECOND};
use crate::wire;
use serde::de::{self, IgnoredAny, Visitor};
use serde::Deserialize;
use std::fmt;
use std::fmt::Write as _;
use std::num::NonZeroU32;

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

/// Parses and validates a Diana document (YAML or JSON, any form of DESIGN §3).
pub fn parse_policy(text: &str) -> Result<Policy, ConfigError> {
    let collected = if is_json(text) {
        parse_json(text)?
    } else {
        parse_yaml(text)?
    };
    build(collected)
}

// ---------------------------------------------------------------------------------------
// Forms.

/// What one document is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Empty,
    Block,
    Blocks,
    Full,
}

/// The first look at a document: its form and the actor names it defines. Reads through
/// the document without building it, so duplicate keys and bad values are left for the
/// typed pass, which reports them with their exact position.
struct Sketch {
    shape: Shape,
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
            shape: Shape::Block,
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
            shape: Shape::Empty,
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
            shape: Shape::Blocks,
            actor_names: Vec::new(),
        })
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Sketch, A::Error> {
        let mut is_block = false;
        let mut actor_names = Vec::new();
        while let Some(key) = map.next_key::<serde_yaml::Value>()? {
            match key.as_str() {
                Some("Url" | "url" | "rules") => {
                    is_block = true;
                    map.next_value::<IgnoredAny>()?;
                }
                Some("actors") => actor_names.extend(map.next_value::<ActorNames>()?.0),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let shape = if is_block { Shape::Block } else { Shape::Full };
        Ok(Sketch { shape, actor_names })
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
    actors: Vec<(String, ActorDef)>,
    response: Option<raw::RawResponse>,
    global: Option<raw::RawGlobal>,
    remote: Option<raw::RawRemote>,
    metrics: Option<raw::RawMetrics>,
    dry_run: Option<bool>,
    identity_key: Option<Secret>,
}

impl Collected {
    fn add_full(&mut self, full: RawFull) {
        self.blocks.extend(full.resources);
        if let Some(actors) = full.actors {
            self.actors.extend(actors.0 .0);
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
        compose(
            None,
            &err.path().to_string(),
            &inner.to_string(),
            position,
            false,
        )
    };
    let sketch: Sketch =
        serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text))
            .map_err(error)?;
    let mut names = raw::builtin_actor_names();
    add_names(&mut names, sketch.actor_names);
    let _guard = ContextGuard::new(names);

    let mut collected = Collected::default();
    let mut deserializer = serde_json::Deserializer::from_str(text);
    match sketch.shape {
        Shape::Empty => {}
        Shape::Block => collected
            .blocks
            .push(serde_path_to_error::deserialize(&mut deserializer).map_err(error)?),
        Shape::Blocks => {
            collected.blocks = serde_path_to_error::deserialize(&mut deserializer).map_err(error)?
        }
        Shape::Full => {
            collected.add_full(serde_path_to_error::deserialize(&mut deserializer).map_err(error)?)
        }
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
                let message = format!("invalid YAML: {err}");
                return Err(compose(label, ".", &message, position, false));
            }
        }
    }
    let multiple = sketches.len() > 1;
    let mut names = raw::builtin_actor_names();
    let shapes: Vec<Shape> = sketches
        .into_iter()
        .map(|sketch| {
            add_names(&mut names, sketch.actor_names);
            sketch.shape
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
            compose(
                label,
                &err.path().to_string(),
                &inner.to_string(),
                position,
                true,
            )
        };
        match shapes.get(index).copied().unwrap_or(Shape::Empty) {
            Shape::Empty => {}
            Shape::Block => collected
                .blocks
                .push(serde_path_to_error::deserialize(document).map_err(error)?),
            Shape::Blocks => {
                let blocks: Vec<RawBlock> =
                    serde_path_to_error::deserialize(document).map_err(error)?;
                collected.blocks.extend(blocks);
            }
            Shape::Full => {
                collected.add_full(serde_path_to_error::deserialize(document).map_err(error)?)
            }
        }
    }
    Ok(collected)
}

/// One message: `[document N: ][path: ]message[ at line L column C]`.
pub(super) fn compose(
    document: Option<usize>,
    path: &str,
    message: &str,
    position: Option<(usize, usize)>,
    yaml_path_prefix: bool,
) -> ConfigError {
    let mut message = message;
    if let Some((line, column)) = position {
        let suffix = format!(" at line {line} column {column}");
        message = message.strip_suffix(&suffix).unwrap_or(message);
    }
    if yaml_path_prefix {
        message = strip_path_prefix(message);
    }
    let mut out = String::new();
    if let Some(document) = document {
        let _ = write!(out, "document {document}: ");
    }
    if path != "." && !path.is_empty() {
        let _ = write!(out, "{path}: ");
    }
    out.push_str(message);
    if let Some((line, column)) = position {
        if !message.contains(" at line ") {
            let _ = write!(out, " at line {line} column {column}");
        }
    }
    ConfigError { message: out }
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

fn plain(message: String) -> ConfigError {
    ConfigError { message }
}

fn build(collected: Collected) -> Result<Policy, ConfigError> {
    let mut actors = ActorRegistry::builtin();
    for (name, def) in collected.actors {
        actors
            .define(&name, def)
            .map_err(|message| plain(format!("actors.{name}: {message}")))?;
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
                timeout_ms: raw.timeout_ms.map_or(default.timeout_ms, NonZeroU32::get),
                lease: raw.lease.map_or(default.lease, lease_of),
                retry_seconds: raw.retry_seconds.unwrap_or(default.retry_seconds),
                token: raw.token.map(|token| token.0).or(default.token),
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
        return Err(plain(
            "no resources: the configuration is empty; expected a block (`Url:` and `rules:`), a sequence of \
             blocks, or a document with `resources:`"
                .to_string(),
        ));
    }

    let mut resources = Vec::with_capacity(collected.blocks.len());
    for block in collected.blocks {
        let url = block.url.0;
        let mut bases = Vec::with_capacity(block.rules.len());
        let mut rules = Vec::with_capacity(block.rules.len());
        for (index, raw) in block.rules.into_iter().enumerate() {
            rules.push(build_rule(&url, index, raw, &actors, &global, &mut bases)?);
        }
        resources.push(Resource { url, rules });
    }
    resources.sort_by_key(|resource| path::segment_count(resource.url.as_bytes()));
    for (index, rule) in resources
        .iter_mut()
        .flat_map(|resource| resource.rules.iter_mut())
        .enumerate()
    {
        rule.index = index;
    }

    let mut names: Vec<(&str, &str)> = Vec::new();
    for rule in resources.iter().flat_map(|resource| resource.rules.iter()) {
        if let Some((other, _)) = names
            .iter()
            .find(|(_, metric_name)| *metric_name == rule.metric_name)
        {
            return Err(plain(if *other == rule.name {
                format!(
                    "duplicate rule name `{}`: two rules would share its metrics",
                    rule.name
                )
            } else {
                format!(
                    "rule names `{other}` and `{}` are both `{}` in metric names: two rules would share their metrics",
                    rule.name, rule.metric_name
                )
            }));
        }
        names.push((&rule.name, &rule.metric_name));
    }
    check_global_rules_per_request(&resources)?;

    let mut policy = Policy {
        resources,
        response,
        global,
        remote,
        metrics: collected.metrics.map(|raw| MetricsSpec {
            path: path::normalize_str(&raw.path.0),
        }),
        dry_run: collected.dry_run.unwrap_or(false),
    };
    // Identities hashed with the document's secret (DESIGN §6), or see `set_identity_key`.
    policy.set_identity_key(
        collected
            .identity_key
            .map(|secret| IdentityKey::derive(secret.expose().as_bytes())),
    );
    Ok(policy)
}

/// `global.token` when the document does not write one: the gateway process's environment
/// variable [`TOKEN_ENV`] when it is set (Envoy passes it to the VM when
/// `vm_config.environment_variables.host_env_keys` lists it; nginx with `env
/// DIANA_QUOTA_TOKEN;`), so that the secret can live where the platform keeps secrets and
/// not in the document. Set but too short: refused, naming the variable, not its value.
fn token_from_environment() -> Result<Option<Secret>, ConfigError> {
    if std::env::var_os(TOKEN_ENV).is_none() {
        return Ok(None);
    }
    Secret::from_env(TOKEN_ENV).map(Some).map_err(|error| {
        plain(format!(
            "global.token (from the environment variable {TOKEN_ENV}): {error}"
        ))
    })
}

/// Refuses a document in which one request could carry more global rules than one
/// callout may (the quota service would answer 400 to every such request): the global
/// rules of a resource and of every resource whose `Url` is a prefix of it all apply.
fn check_global_rules_per_request(resources: &[Resource]) -> Result<(), ConfigError> {
    let globals = |resource: &Resource| {
        resource
            .rules
            .iter()
            .filter(|rule| rule.scope == Scope::Global)
            .count()
    };
    for resource in resources {
        let applying: usize = resources
            .iter()
            .filter(|outer| path::is_prefix(&outer.url, &resource.url))
            .map(globals)
            .sum();
        let costs: u64 = resources
            .iter()
            .filter(|outer| path::is_prefix(&outer.url, &resource.url))
            .flat_map(|outer| outer.rules.iter())
            .filter(|rule| rule.scope == Scope::Global)
            .map(|rule| u64::from(rule.cost.max()))
            .sum();
        if costs > wire::MAX_TOTAL_WANT {
            return Err(plain(format!(
                "{}: a request to it could ask for {costs} tokens over its global rules (their `cost` maxima); \
                 one callout asks for at most {}",
                resource.url,
                wire::MAX_TOTAL_WANT
            )));
        }
        if applying > wire::MAX_RULES {
            return Err(plain(format!(
                "{}: a request to it would carry {applying} global rules (its own and those of the resources above it); \
                 one callout carries at most {}",
                resource.url,
                wire::MAX_RULES
            )));
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

fn build_rule(
    url: &str,
    index: usize,
    raw: RawRule,
    actors: &ActorRegistry,
    global: &GlobalSpec,
    bases: &mut Vec<u64>,
) -> Result<Rule, ConfigError> {
    let actor_name = raw.actor.map_or_else(|| "all".to_string(), |actor| actor.0);
    let canonical = ActorRegistry::canonical_name(&actor_name);
    let def = actors
        .get(&actor_name)
        .ok_or_else(|| plain(format!("{url}#{index}: unknown actor `{actor_name}`")))?;
    let algo = raw.algo.map_or_else(algo::default_algorithm, |algo| algo.0);
    let rpu = raw.rpu;
    let unit = raw.unit.map_or(Unit::Second, |unit| unit.0);
    let burst = raw.burst.unwrap_or_else(|| algo.default_burst(rpu, unit));
    let slices = raw
        .slices
        .and_then(|slices| NonZeroU32::new(slices.get_u32()))
        .unwrap_or(DEFAULT_SLICES);
    let slots = if def.source.is_single_counter() {
        NonZeroU32::MIN
    } else {
        raw.slots
            .and_then(|slots| NonZeroU32::new(slots.get_u32()))
            .unwrap_or(DEFAULT_SLOTS)
    };
    let scope = raw.scope.map_or(Scope::Local, |scope| scope.0);
    let written = raw.lease.map_or(global.lease, lease_of);
    let cost = match raw.cost {
        None => Cost::Fixed(NonZeroU32::MIN),
        Some(raw::CostField::Fixed(cost)) => {
            Cost::Fixed(NonZeroU32::new(cost).unwrap_or(NonZeroU32::MIN))
        }
        Some(raw::CostField::Header(header)) => {
            let max = NonZeroU32::new(header.max.get_u32()).unwrap_or(NonZeroU32::MIN);
            let default = header
                .default
                .and_then(|default| NonZeroU32::new(default.get_u32()))
                .unwrap_or(NonZeroU32::MIN);
            if default > max {
                return Err(plain(format!(
                    "{url}#{index}: cost.default ({default}) is above cost.max ({max})"
                )));
            }
            Cost::Header {
                name: header.header.0,
                default,
                max,
            }
        }
    };
    let limit = algo::Limit {
        rpu,
        unit,
        burst,
        slices,
    };
    if u64::from(cost.max()) > algo.capacity(&limit) {
        return Err(plain(format!(
            "{url}#{index}: a cost of {} could never pass: the rule grants at most {} at once (rpu, or burst for TB and LB)",
            cost.max(),
            algo.capacity(&limit)
        )));
    }
    let (lease, lease_auto) = match written {
        Lease::Fixed(lease) => (lease, false),
        // The accuracy budget: a gateway holds at most 1/AUTO_LEASE_SHARE of the limit.
        Lease::Auto => {
            let cap =
                (algo.capacity(&limit) / AUTO_LEASE_SHARE).clamp(1, u64::from(wire::MAX_WANT));
            let cap = u32::try_from(cap).unwrap_or(1).max(cost.max());
            (NonZeroU32::new(cap).unwrap_or(NonZeroU32::MIN), true)
        }
    };
    if scope == Scope::Global && !algo.waits() && cost.max() > lease.get() {
        return Err(plain(format!(
            "{url}#{index}: a cost of {} is above the lease ({lease}): a global rule's callout asks for `lease` tokens, \
             which must cover one request; set `lease` to at least {}",
            cost.max(),
            cost.max()
        )));
    }
    // What diana-quota would refuse is refused here, naming the field: a global counter
    // lives at most about a day (docs/wire-format.md, "Bounds").
    if scope == Scope::Global {
        if let Err(error) = wire::check_rule_limits(algo, &limit) {
            return Err(plain(format!(
                "{url}#{index}: {error}; the quota service refuses such a global rule (a bucket may span at most a day)"
            )));
        }
    }
    let response_cost = match raw.response_cost {
        None => None,
        Some(_) if !algo.allows_debt() => {
            return Err(plain(format!(
                "{url}#{index}: response_cost does not apply to algo {}: a leaky bucket paces requests, it does not charge them afterwards",
                algo.code()
            )))
        }
        Some(raw) => Some(ResponseCost {
            header: raw.header.0,
            max: NonZeroU32::new(raw.max.get_u32()).unwrap_or(NonZeroU32::MIN),
        }),
    };
    let max_wait_seconds = match raw.max_wait_seconds {
        Some(_) if !algo.waits() => {
            return Err(plain(format!(
                "{url}#{index}: max_wait_seconds applies to algo LB (leaky bucket) only"
            )))
        }
        Some(seconds) => seconds.0,
        None => DEFAULT_MAX_WAIT_SECONDS,
    };

    let base = hash_parts(
        RULE_SEED,
        &[
            url.as_bytes(),
            canonical.as_bytes(),
            def.spec.as_bytes(),
            algo.code().as_bytes(),
            &rpu.get().to_le_bytes(),
            unit.name().as_bytes(),
            &burst.get().to_le_bytes(),
            &slices.get().to_le_bytes(),
            &slots.get().to_le_bytes(),
            scope.name().as_bytes(),
        ],
    );
    let occurrence = bases.iter().filter(|&&seen| seen == base).count() as u64;
    bases.push(base);
    let id = hash_parts(RULE_SEED, &[&base.to_le_bytes(), &occurrence.to_le_bytes()]);

    let name = raw
        .name
        .map_or_else(|| format!("{url}#{index}"), |name| name.0);
    Ok(Rule {
        index: 0,
        metric_name: stat_name(&name),
        name,
        id,
        actor_name,
        actor: def.source.clone(),
        identity: IdentityHasher::default(),
        algo,
        limit,
        scope,
        slots,
        lease,
        lease_auto,
        cost,
        response_cost,
        max_wait: max_wait_seconds * NANOS_PER_SECOND,
        dry_run: raw.dry_run.unwrap_or(false),
        keys: RuleKeys::of(id),
    })
}
