//! The document as written: serde types with `deny_unknown_fields`, whose field types
//! validate their value *inside* the deserializer's visitor, so that every error —
//! syntax, type, range, unknown name, duplicate — carries the field path and the
//! line/column where it occurs. Nothing here resolves defaults; see `parse::build`.
//!
//! These types are also the one description of the document ([`document`], see
//! `shape`): each mapping is declared once with `document_struct!` (its reader and its
//! description), and each value type with a reader of its own describes itself next to
//! its visitor, from the constants the visitor checks. The JSON schema, the pin pass of
//! remote documents and the position finder read that description.
//!
//! Checks that need to know more than one value (is this actor defined in `actors:`? was
//! this `Url` already used?) read a per-thread [`Context`] that `parse_policy` fills in
//! before the typed pass and clears afterwards.

use super::error::{LocalOnly, PinnedValue};
use super::model::{
    HeaderMode, HeaderStyle, HotShow, OnInvalidConfig, Pinned, Provider, RuleUnit, Scope,
    MAX_HOT_TOP, MAX_PLANS, MAX_PLAN_NAME, MAX_RESPONSE_COST, MAX_RETRY_SECONDS, MAX_TIMEOUT_MS,
};
use super::shape::{case_insensitive, document_struct, Constraint, Describe, Field, Pin, Shape};
use crate::actor::{
    source_kind, ActorDef, Fallback, JwtClaimKind, SourceKind, CONFIGURABLE_BUILTINS,
    DEFAULT_USER_FALLBACK, RESERVED_ACTORS, SOURCE_KINDS,
};
use crate::algo::{self, Algorithm};
use crate::breaker::Force;
use crate::calendar::{Zone, ZONE_NAME_MAX};
use crate::jwt::{self, ClaimOrigin, ClaimPath};
use crate::path;
use crate::secret::{Secret, MIN_SECRET_BYTES};
use crate::signature::SignatureKey;
use crate::usage::{JsonPath, JSON_PATH_MAX, MAX_FOLLOWED};
use crate::wire;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, Unexpected, Visitor};
use serde::Deserialize;
use std::cell::Cell;
use std::fmt;
use std::num::NonZeroU32;

// ---------------------------------------------------------------------------------------
// Per-parse context.

/// What the typed pass needs to know beyond the value at hand.
#[derive(Debug, Default)]
pub(super) struct Context {
    /// Every actor name a rule may use: built-ins and the document's `actors:` keys.
    pub actor_names: Vec<String>,
    /// Normalised urls of the blocks seen so far (duplicate detection).
    pub urls: Vec<String>,
    /// Names defined under `actors:` so far (duplicate detection).
    pub defined_actors: Vec<String>,
    /// Explicit rule names seen so far.
    pub rule_names: Vec<String>,
    /// Sections (`actors`, `response`, …) already given by a document.
    pub sections: Vec<u8>,
}

thread_local! {
    static CONTEXT: Cell<Context> = Cell::new(Context::default());
}

/// Runs `f` on this thread's parse context (never panics; re-entrant calls see a fresh one).
pub(super) fn with_context<R>(f: impl FnOnce(&mut Context) -> R) -> R {
    let mut context = CONTEXT.try_with(Cell::take).unwrap_or_default();
    let result = f(&mut context);
    let _ = CONTEXT.try_with(|cell| cell.set(context));
    result
}

/// Installs a fresh context for one parse and clears it when dropped.
pub(super) struct ContextGuard;

impl ContextGuard {
    pub fn new(actor_names: Vec<String>) -> ContextGuard {
        with_context(|context| {
            *context = Context {
                actor_names,
                ..Context::default()
            };
        });
        ContextGuard
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        with_context(|context| *context = Context::default());
    }
}

/// The actor names every document knows.
pub(super) fn builtin_actor_names() -> Vec<String> {
    let mut names: Vec<String> = RESERVED_ACTORS
        .iter()
        .map(|name| name.to_string())
        .collect();
    names.extend(
        CONFIGURABLE_BUILTINS
            .iter()
            .map(|builtin| builtin.name.to_string()),
    );
    names
}

// ---------------------------------------------------------------------------------------
// Document structure.

/// The document: one block, a list of blocks, or the full form.
pub fn document() -> Shape {
    Shape::any_of(vec![
        RawBlock::shape(),
        Vec::<RawBlock>::shape(),
        RawFull::shape(),
    ])
}

document_struct! {
    /// One `Url` block.
    #[expecting = "a resource block with `Url` and `rules`"]
    #[shape = |shape: Shape| shape
        .named("block")
        .described(
            "A resource: a path prefix (matched on segment boundaries), its rules, applied in \
             order, and the circuit breaker of the upstream behind it",
        )
        // `parse::build` refuses a block with neither (NoRulesNorBreaker).
        .constraint(Constraint::AtLeastOne(vec!["rules", "breaker"]))]
    pub(super) struct RawBlock {
        url ("Url" | "url"): UrlField;
        rules: Option<Vec<RawRule>> => "The limits, applied in order (a block has rules, a breaker, or both)";
        breaker: Option<RawBreaker> =>
            "The circuit breaker of the upstream behind this resource (DESIGN §4b): fail fast while \
             its answers are slow or failing, probe, close again";
        path: Option<RawPathOptions> =>
            "How a request path is compared with this Url, for a backend that reads paths more \
             loosely than their spelling (default: exactly, after normalisation)";
    }
}

document_struct! {
    /// `path: {strip_parameters: BOOL, case_insensitive: BOOL}`.
    #[expecting = "`{strip_parameters: BOOL, case_insensitive: BOOL}`"]
    pub(super) struct RawPathOptions {
        strip_parameters: Option<bool> =>
            "Ignore each segment's `;parameters` (`/admin;jsessionid=1` is `/admin`, `/x/..;/admin` \
             is `/admin`), as servlet containers read paths (default false)";
        case_insensitive: Option<bool> =>
            "Compare letters without regard to case (`/ADMIN` is `/admin`), for a backend that \
             does (default false)";
    }
}

document_struct! {
    /// `breaker:` (a resource's circuit breaker, DESIGN §4b). Every field is free: a remote
    /// document may tune it and flip `force` (the manual switch).
    #[expecting = "the `breaker` section"]
    #[shape = |shape: Shape| shape
        .named("breaker")
        .described(
            "The circuit breaker of the upstream behind a resource: opens when, in the window, at \
             least `min_calls` calls were made and the slow or failed share reaches its ratio",
        )
        // `parse::build_breaker` refuses neither threshold (BreakerNoThreshold) and one half
        // of the slow-call pair (BreakerSlowPair).
        .constraint(Constraint::AtLeastOne(vec!["failure_ratio", "slow_ratio"]))
        .constraint(Constraint::Needs { key: "slow_ratio", needs: "slow_ms" })
        .constraint(Constraint::Needs { key: "slow_ms", needs: "slow_ratio" })]
    pub(super) struct RawBreaker {
        name: Option<BreakerName> =>
            "In metrics and logs, unique among breakers (default: from the Url, `/payments` → \
             `payments`, `/` → `root`)";
        slow_ms: Option<Ranged<1, { MAX_SLOW_MS }>> =>
            "A call whose response headers come later than this is slow (with slow_ratio)";
        slow_ratio: Option<Ratio> =>
            "Open when at least this share of the window's calls was slow (with slow_ms)";
        failure_status: Option<StatusList> =>
            "The statuses that count as failed (default [5xx]); a reset or an upstream timeout always does";
        failure_ratio: Option<Ratio> => "Open when at least this share of the window's calls failed";
        min_calls: Option<Ranged<1, { MAX_MIN_CALLS }>> =>
            "No verdict on fewer calls in the window (default 20)";
        window_seconds: Option<Ranged<1, { MAX_WINDOW_SECONDS }>> =>
            "The sliding statistics window, in 10 slices (default 10)";
        open_seconds: Option<Ranged<1, { MAX_OPEN_SECONDS }>> =>
            "How long it fails fast before probing (default 30)";
        half_open_calls: Option<Ranged<1, { u8::MAX as u64 }>> =>
            "Half-open: this many calls go through; all good: closed, one bad: open again (default 3)";
        scope: Option<ScopeField> =>
            "local: one state per gateway process; global: one state for every gateway, kept by \
             diana-quota (the `global` section says where), each gateway falling back to its own \
             when it cannot reach it (default local)";
        force: Option<ForceField>;
        fallback_header: Option<FallbackHeaderField> => format!(
            "While open, send the request on with `<header>: <name>` (route it to a backup) instead \
             of answering it; a client's own value of the header is always removed. Not a \
             pseudo-header, nor a header the document's rules read, nor one of {}",
            RESERVED_FALLBACK_HEADERS.join(", ")
        );
    }
}

/// The longest `slow_ms`: an hour.
pub(super) const MAX_SLOW_MS: u64 = 3_600_000;
/// The largest `min_calls`.
pub(super) const MAX_MIN_CALLS: u64 = 1_000_000;
/// The longest `window_seconds`: an hour (ten slices of six minutes).
pub(super) const MAX_WINDOW_SECONDS: u64 = 3_600;
/// The longest `open_seconds`: a day.
pub(super) const MAX_OPEN_SECONDS: u64 = 86_400;

/// Longest breaker name (as long as a rule's).
const MAX_BREAKER_NAME: usize = MAX_RULE_NAME;

/// A breaker's `name`: printable ASCII, at most [`MAX_BREAKER_NAME`] bytes. Unique among
/// the breakers, also as a metric name: `parse::build` checks that once every name, the
/// derived ones included, is known.
pub(super) struct BreakerName(pub String);

impl Describe for BreakerName {
    fn shape() -> Shape {
        RuleName::shape()
    }
}

impl<'de> Deserialize<'de> for BreakerName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a breaker name", |raw| {
            printable_name(raw, "breaker", MAX_BREAKER_NAME).map(|()| BreakerName(raw.to_string()))
        })
    }
}

/// `force`: auto | open | closed (the manual switch).
pub(super) struct ForceField(pub Force);

/// Every `force`, in the order the description lists them.
const FORCES: [Force; 3] = [Force::Auto, Force::Open, Force::Closed];

impl Describe for ForceField {
    fn shape() -> Shape {
        Shape::words(FORCES.iter().map(|force| force.name()).collect(), false)
            .named("force")
            .described(
                "The manual switch: auto (the calls decide, the default), open (fail fast now), \
                 closed (never trip; calls still counted)",
            )
    }
}

impl<'de> Deserialize<'de> for ForceField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "auto, open or closed", |raw| {
            named(raw, &FORCES, Force::name, "force").map(ForceField)
        })
    }
}

/// `fallback_header`: a request header name, lower-cased; not a pseudo-header and not one
/// Diana itself reads or writes ([`RESERVED_FALLBACK_HEADERS`]), nor one the host manages.
pub(super) struct FallbackHeaderField(pub String);

/// The headers a breaker's `fallback_header` may not be: Diana's own (the rate-limit
/// answer's, the bearer token it reads, the quota service's and the config center's) and
/// those the host frames the request with. A client's own value of the fallback header is
/// removed before the request goes on, so each of these would be lost or forged.
pub(super) const RESERVED_FALLBACK_HEADERS: [&str; 17] = [
    crate::response::RETRY_AFTER,
    crate::response::X_RATELIMIT_LIMIT,
    crate::response::X_RATELIMIT_REMAINING,
    crate::response::X_RATELIMIT_RESET,
    crate::response::RATELIMIT_POLICY,
    crate::response::RATELIMIT,
    crate::signature::SIGNATURE_HEADER,
    wire::TIMEOUT_HEADER,
    "authorization",
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
    "keep-alive",
];

impl Describe for FallbackHeaderField {
    fn shape() -> Shape {
        let reserved: Vec<String> = RESERVED_FALLBACK_HEADERS
            .iter()
            .map(|name| case_insensitive(name))
            .collect();
        Shape::string("x-diana-fallback")
            .pattern(format!(
                "^\\s*(?!(?:{})\\s*$)[!#$%&'*+.^_`|~0-9A-Za-z-]+\\s*$",
                reserved.join("|")
            ))
            .length(None, Some(crate::actor::MAX_HEADER_NAME))
    }
}

impl<'de> Deserialize<'de> for FallbackHeaderField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a header name", |raw| {
            let name = crate::actor::HeaderKind
                .parse_value(raw)
                .map_err(|error| error.to_string())?;
            if name.starts_with(':') {
                return Err(format!(
                    "`{name}` is a pseudo-header: a fallback header is an ordinary request header \
                     (such as x-diana-fallback) that a route can match"
                ));
            }
            if RESERVED_FALLBACK_HEADERS.contains(&name.as_str()) {
                return Err(format!(
                    "`{name}` is a header Diana or the host uses itself: a fallback header is one of \
                     your own (such as x-diana-fallback), removed from clients' requests"
                ));
            }
            Ok(FallbackHeaderField(name))
        })
    }
}

document_struct! {
    /// One rule as written; `None` means "use the default" (the key is absent: a key written
    /// with `null` is refused, see [`present`]).
    #[expecting = "a rule (a mapping with at least `rpu` or `max_in_flight`)"]
    #[shape = |shape: Shape| shape
        .named("rule")
        .described(
            "One limit: `rpu` (requests per unit) or `max_in_flight` (requests inside at once); \
             see docs/design.md §3 and the README for the defaults.",
        )
        // `parse::build_rules` refuses neither (NoLimit) and both (RateAndConcurrency).
        .constraint(Constraint::ExactlyOne(vec!["rpu", "max_in_flight"]))]
    pub(super) struct RawRule {
        /// Required unless `max_in_flight` is given (the parser says so, naming both).
        rpu: Option<RpuField> =>
            "Requests per unit (≥ 1), or a limit per plan: `{by: x-plan, values: {free: 10, pro: 1000}, default: 10}` \
             (each plan counted on its own counter; `default` for any other value or none)";
        /// A concurrency limit instead of a rate: requests of an identity inside at once.
        max_in_flight: Option<Ranged<1, 1_000_000>> =>
            "Instead of `rpu`: at most this many requests of an identity inside the gateway at once, \
             each holding its place from admission to its end (with `scope: global`, over every gateway: \
             diana-quota holds the places; no unit, algo, burst, slices, cost, \
             response_cost, count or lease)";
        unit: Option<UnitField>;
        algo: Option<AlgoField>;
        scope: Option<ScopeField>;
        actor: Option<ActorRef> => format!(
            "Whose counter: {} (the seed's `actor` means account) or a name defined \
             under `actors` (default all)",
            builtin_actor_names().join(", ")
        );
        burst: Option<NonZeroU32> => "TB: bucket capacity (default rpu); LB: queue length";
        slices: Option<Ranged<1, { wire::MAX_SLICES as u64 }>> => "SW: slices per unit (default 10)";
        slots: Option<Ranged<1, 1_048_576>> =>
            "Local slot-table size for per-identity actors (default 65536)";
        lease: Option<LeaseField> =>
            "Global: tokens fetched per callout (default global.lease); at least the cost; \
             `auto`: what the gateway spends in 100 ms, at most 1% of the limit";
        max_wait_seconds: Option<Ranged<0, 86_400>> =>
            "LB: the longest a request may be held (default 10); further: rejected with Retry-After";
        cost: Option<CostField> =>
            "Tokens a request takes: a constant (default 1), or read from a request header";
        response_cost: Option<RawResponseCost> =>
            "Tokens charged after the upstream answered, from a response header or the answer's \
             body (an LLM provider's usage, a number at a JSON path); not LB";
        count: Option<RawCount> =>
            "Count only the requests whose answer has one of these statuses (not LB, not with response_cost)";
        timezone: Option<ZoneField> =>
            "With unit week or month: the IANA time zone whose calendar the periods follow \
             (default UTC)";
        hot: Option<RawHot> =>
            "Keep this rule's hottest identities for the fleet view (diana-quota's /ui)";
        name: Option<RuleName> =>
            "Printable ASCII; used in metrics and headers (default <Url>#<index>)";
        dry_run: Option<bool>;
    }
}

document_struct! {
    /// `hot: {show: value | digest, top: N}`.
    #[expecting = "`{show: value | digest, top: N}`"]
    pub(super) struct RawHot {
        show: Option<HotShowField>;
        top: Option<Ranged<1, { MAX_HOT_TOP as u64 }>> =>
            "How many identities are listed (default 10)";
    }
}

/// `hot.show`: value | digest.
pub(super) struct HotShowField(pub HotShow);

impl Describe for HotShowField {
    fn shape() -> Shape {
        Shape::words(HotShow::ALL.iter().map(|show| show.name()).collect(), false).described(
            "How an identity is shown: value (its first 64 bytes, the default) or digest (a \
             keyed digest, for privacy)",
        )
    }
}

impl<'de> Deserialize<'de> for HotShowField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "value or digest", |raw| {
            named(raw, &HotShow::ALL, HotShow::name, "hot.show").map(HotShowField)
        })
    }
}

/// `timezone`: an IANA time zone name ([`Zone::parse`]).
pub(super) struct ZoneField(pub Zone);

impl Describe for ZoneField {
    fn shape() -> Shape {
        Shape::string("Europe/Berlin")
            .pattern("^[A-Za-z0-9_+/-]+$")
            .length(Some(1), Some(ZONE_NAME_MAX))
    }
}

impl<'de> Deserialize<'de> for ZoneField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "an IANA time zone name", |raw| {
            Zone::parse(raw).map(ZoneField)
        })
    }
}

document_struct! {
    /// The full form. Every section is optional; a section, `resources` included, may be
    /// given by one document only.
    #[expecting = "a Diana document"]
    #[shape = |shape: Shape| shape
        .named("full")
        .described("The full form: every section but `resources` is optional")
        // A lone document without blocks is refused (NoResources).
        .constraint(Constraint::Required("resources"))]
    pub(super) struct RawFull {
        resources: Option<Section<Vec<RawBlock>, SECTION_RESOURCES>>;
        actors: Option<Section<RawActors, SECTION_ACTORS>>;
        response: Option<Section<RawResponse, SECTION_RESPONSE>>;
        global: Option<Section<RawGlobal, SECTION_GLOBAL>>;
        remote: Option<Section<RawRemote, SECTION_REMOTE>>;
        dry_run: Option<Section<bool, SECTION_DRY_RUN>>
            [Pin::Pinned(PinnedValue::DryRun)] => "Count and report, never reject";
        metrics: Option<Section<RawMetrics, SECTION_METRICS>> =>
            "The filter answers GET <path> with its metrics (Prometheus text)";
        /// The deployment's identity-hash secret (DESIGN §6), or `{env: NAME}`.
        identity_key: Option<Section<IdentityKeyField, SECTION_IDENTITY_KEY>>
            [Pin::Pinned(PinnedValue::IdentityKey)] =>
            "The key of the identity hash, shared by every gateway of a deployment";
        on_invalid_config: Option<Section<OnInvalidConfig, SECTION_ON_INVALID_CONFIG>> =>
            "nginx: what requests get while the worker has no usable configuration (a refused \
             document, no shm_kv zone): 503 (deny, the default) or through unlimited (allow)";
    }
}

document_struct! {
    /// `response_cost`: where the answer's cost is read (exactly one of `header`, `usage`,
    /// `json`), its cap, and what a request reserves up front.
    #[expecting = "a response cost `{header: NAME, max: N}`, `{usage: PROVIDER}` or `{json: PATH}` (optionally `reserve`)"]
    #[shape = |shape: Shape| shape
        // `parse::response_cost_of` refuses none or two (ResponseCostSources), `header`
        // without `max` (HeaderCostWithoutMax), `weights` without `usage` (WeightsWithoutUsage).
        .constraint(Constraint::ExactlyOne(vec!["usage", "json", "header"]))
        .constraint(Constraint::Needs { key: "header", needs: "max" })
        .constraint(Constraint::Needs { key: "weights", needs: "usage" })]
    pub(super) struct RawResponseCost {
        header: Option<HeaderNameField> =>
            "A response header holding the answer's cost, a decimal integer (with `max`)";
        usage: Option<ProviderField> =>
            "The provider's usage object, from a JSON answer or its server-sent events";
        json: Option<JsonPathField> =>
            "The number at this dotted path of a JSON answer (or of the last event of a stream \
             that has it)";
        weights: Option<RawWeights> =>
            "With `usage`: the price of input and output tokens, cost = input × input weight + \
             output × output weight (default: the provider's total)";
        max: Option<Ranged<1, { MAX_RESPONSE_COST as u64 }>> =>
            "The most one answer is charged (required with `header`; default 1000000000)";
        reserve: Option<ReserveField> =>
            "Tokens taken up front instead of `cost` (all or nothing) and settled with the answer's cost: \
             a constant, or read from a request header or the request's JSON body; not with `cost`";
    }
}

/// `usage`: openai | anthropic | gemini.
pub(super) struct ProviderField(pub Provider);

impl Describe for ProviderField {
    fn shape() -> Shape {
        Shape::words(Provider::ALL.iter().map(|p| p.name()).collect(), false)
    }
}

impl<'de> Deserialize<'de> for ProviderField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "openai, anthropic or gemini", |raw| {
            named(raw, &Provider::ALL, Provider::name, "provider").map(ProviderField)
        })
    }
}

/// A dotted path of a JSON body (`usage.total_tokens`, `max_tokens`): at most
/// [`JSON_PATH_MAX`] bytes of printable ASCII, at most [`MAX_FOLLOWED`] keys (the reader
/// follows no deeper), none empty.
pub(super) struct JsonPathField(pub JsonPath);

impl Describe for JsonPathField {
    fn shape() -> Shape {
        Shape::string("usage.total_tokens")
            .pattern(format!(
                "^[!-\\-/-~]+(?:\\.[!-\\-/-~]+){{0,{}}}$",
                MAX_FOLLOWED - 1
            ))
            .length(None, Some(JSON_PATH_MAX))
    }
}

impl<'de> Deserialize<'de> for JsonPathField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a dotted JSON path", |raw| {
            let path = JsonPath::parse(raw).map_err(|error| error.to_string())?;
            let keys = raw.split('.').count();
            if keys > MAX_FOLLOWED {
                return Err(format!(
                    "a JSON path has at most {MAX_FOLLOWED} keys (the body is not read deeper), \
                     this one has {keys}"
                ));
            }
            Ok(JsonPathField(path))
        })
    }
}

document_struct! {
    /// `weights: {input: N, output: N}`.
    #[expecting = "`{input: N, output: N}`"]
    pub(super) struct RawWeights {
        input: Option<Ranged<0, { MAX_WEIGHT }>> => "The price of an input token (default 1)";
        output: Option<Ranged<0, { MAX_WEIGHT }>> => "The price of an output token (default 1)";
    }
}

/// The largest weight.
pub(super) const MAX_WEIGHT: u64 = 1_000_000;

/// `reserve`: a constant, or read from a request header or the request's JSON body.
pub(super) enum ReserveField {
    Fixed(u32),
    Read(RawReserveFrom),
}

impl<'de> Deserialize<'de> for ReserveField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ReserveVisitor;
        impl<'de> Visitor<'de> for ReserveVisitor {
            type Value = ReserveField;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    formatter,
                    "an integer between 1 and {} or `{{header | json, default, max, min}}`",
                    wire::MAX_WANT
                )
            }
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<ReserveField, E> {
                match u32::try_from(value) {
                    Ok(tokens) if (1..=wire::MAX_WANT).contains(&tokens) => {
                        Ok(ReserveField::Fixed(tokens))
                    }
                    _ => Err(E::invalid_value(Unexpected::Unsigned(value), &self)),
                }
            }
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<ReserveField, E> {
                match u64::try_from(value) {
                    Ok(value) => self.visit_u64(value),
                    Err(_) => Err(E::invalid_value(Unexpected::Signed(value), &self)),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<ReserveField, A::Error> {
                RawReserveFrom::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(ReserveField::Read)
            }
        }
        deserializer.deserialize_any(ReserveVisitor)
    }
}

impl Describe for ReserveField {
    fn shape() -> Shape {
        Shape::one_of(vec![
            Shape::integer(1, u64::from(wire::MAX_WANT)),
            RawReserveFrom::shape(),
        ])
    }
}

document_struct! {
    /// `reserve: {header: NAME | json: PATH, default: N, max: N, min: N}`.
    #[expecting = "a reservation `{header: NAME, default: N, max: N, min: N}` or `{json: PATH, default: N, max: N, min: N}`"]
    #[shape = |shape: Shape| shape
        // `parse::reserve_of` refuses none or both (ReserveSources) and `json` without
        // `default` (ReserveJsonWithoutDefault).
        .constraint(Constraint::ExactlyOne(vec!["header", "json"]))
        .constraint(Constraint::Needs { key: "json", needs: "default" })]
    pub(super) struct RawReserveFrom {
        header: Option<HeaderNameField> => "A request header holding the reservation";
        json: Option<JsonPathField> =>
            "The number at this dotted path of the request's JSON body (`max_tokens`)";
        default: Option<Ranged<1, { wire::MAX_WANT as u64 }>> =>
            "Reserved when the request has no readable value (default 1; required with `json`)";
        max: Ranged<1, { wire::MAX_WANT as u64 }> => "The most a request reserves";
        min: Option<Ranged<1, { wire::MAX_WANT as u64 }>> =>
            "The least a request reserves, whatever it says (default: `default`)";
    }
}

document_struct! {
    /// `count: {status: [401, 403, 5xx]}`.
    #[expecting = "`{status: [401, 403, 4xx, …]}`"]
    pub(super) struct RawCount {
        status: StatusList;
    }
}

/// The statuses a `count` rule counts: 1 to [`MAX_STATUSES`] of `100`–`599` or
/// `1xx`–`5xx`.
pub(super) struct StatusList(pub Vec<(u16, u16)>);

/// The most statuses a `count` rule lists.
const MAX_STATUSES: usize = 32;

impl<'de> Deserialize<'de> for StatusList {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Counted inside the visitor, so that a refusal is placed at the list itself (an
        // error raised after the reader has left it is placed at the mapping around it).
        struct ListVisitor;
        impl<'de> Visitor<'de> for ListVisitor {
            type Value = StatusList;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    formatter,
                    "1 to {MAX_STATUSES} statuses (`[401, 403]`, `[4xx]`)"
                )
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<StatusList, A::Error> {
                let mut statuses = Vec::new();
                while let Some(status) = seq.next_element::<StatusField>()? {
                    if statuses.len() == MAX_STATUSES {
                        return Err(de::Error::invalid_length(MAX_STATUSES + 1, &self));
                    }
                    statuses.push(status.0);
                }
                if statuses.is_empty() {
                    return Err(de::Error::invalid_length(0, &self));
                }
                Ok(StatusList(statuses))
            }
        }
        deserializer.deserialize_seq(ListVisitor)
    }
}

impl Describe for StatusList {
    fn shape() -> Shape {
        Vec::<StatusField>::shape().items(1, MAX_STATUSES)
    }
}

/// One status (`401`) or class (`4xx`), as an inclusive range.
struct StatusField((u16, u16));

/// The statuses an answer may have.
const STATUSES: (u16, u16) = (100, 599);

impl Describe for StatusField {
    fn shape() -> Shape {
        Shape::one_of(vec![
            Shape::integer(u64::from(STATUSES.0), u64::from(STATUSES.1)),
            Shape::string("5xx").pattern("^\\s*([1-5][xX][xX]|[1-5][0-9][0-9])\\s*$"),
        ])
    }
}

impl<'de> Deserialize<'de> for StatusField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StatusVisitor;
        impl<'de> Visitor<'de> for StatusVisitor {
            type Value = StatusField;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("an HTTP status 100 to 599, or a class `1xx` to `5xx`")
            }
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<StatusField, E> {
                match u16::try_from(value) {
                    Ok(status) if (STATUSES.0..=STATUSES.1).contains(&status) => {
                        Ok(StatusField((status, status)))
                    }
                    _ => Err(E::invalid_value(Unexpected::Unsigned(value), &self)),
                }
            }
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<StatusField, E> {
                match u64::try_from(value) {
                    Ok(value) => self.visit_u64(value),
                    Err(_) => Err(E::invalid_value(Unexpected::Signed(value), &self)),
                }
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<StatusField, E> {
                let text = value.trim();
                if let Ok(status) = text.parse::<u64>() {
                    return self.visit_u64(status);
                }
                match text.as_bytes() {
                    [class @ b'1'..=b'5', x, y]
                        if x.eq_ignore_ascii_case(&b'x') && y.eq_ignore_ascii_case(&b'x') =>
                    {
                        let first = u16::from(class - b'0') * 100;
                        Ok(StatusField((first, first + 99)))
                    }
                    _ => Err(E::invalid_value(Unexpected::Str(value), &self)),
                }
            }
        }
        deserializer.deserialize_any(StatusVisitor)
    }
}

document_struct! {
    /// `cost: {header: NAME, default: N, max: N}`.
    #[expecting = "a header cost `{header: NAME, default: N, max: N}`"]
    pub(super) struct RawHeaderCost {
        header: HeaderNameField;
        default: Option<Ranged<1, { wire::MAX_WANT as u64 }>>;
        max: Ranged<1, { wire::MAX_WANT as u64 }>;
    }
}

/// `rpu`: one limit, or a limit per plan (`{by: x-plan, values: {free: 10, pro: 1000},
/// default: 10}`).
pub(super) enum RpuField {
    Fixed(NonZeroU32),
    Plans(RawPlans),
}

impl Describe for RpuField {
    fn shape() -> Shape {
        Shape::one_of(vec![NonZeroU32::shape(), RawPlans::shape()])
    }
}

document_struct! {
    /// `rpu: {by, values, default}`: the limit chosen per request from the request's plan.
    #[expecting = "plans `{by: HEADER, values: {PLAN: N, …}, default: N}`"]
    pub(super) struct RawPlans {
        by: PlanByField =>
            "Where the plan is read: a request header, or a claim of the bearer token (or, with `from`, \
             of the payload jwt_authn verified)";
        values: PlanValues;
        default: NonZeroU32;
    }
}

/// `by`: where a request's plan is read — a request header (`by: x-plan`), or a claim of
/// the bearer token (`by: {jwt_claim: plan}`) or of the payload jwt_authn verified (`by:
/// {jwt_claim: plan, from: {jwt_authn: NAME}}`).
pub(super) enum PlanByField {
    Header(String),
    JwtClaim(crate::jwt::Claim),
}

impl Describe for PlanByField {
    fn shape() -> Shape {
        Shape::one_of(vec![HeaderNameField::shape(), RawPlanByClaim::shape()])
    }
}

document_struct! {
    /// `by: {jwt_claim: PATH [, from: {jwt_authn: NAME}]}`.
    #[expecting = "`{jwt_claim: PATH}` or `{jwt_claim: PATH, from: {jwt_authn: NAME}}`"]
    struct RawPlanByClaim {
        jwt_claim: NonEmpty;
        from: Option<ClaimOriginField>;
    }
}

impl<'de> Deserialize<'de> for PlanByField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ByVisitor;
        impl<'de> Visitor<'de> for ByVisitor {
            type Value = PlanByField;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str(
                    "a request header name, or `{jwt_claim: PATH [, from: {jwt_authn: NAME}]}`",
                )
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<PlanByField, E> {
                crate::actor::HeaderKind
                    .parse_value(value)
                    .map(PlanByField::Header)
                    .map_err(E::custom)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<PlanByField, A::Error> {
                let raw = RawPlanByClaim::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let path = crate::jwt::ClaimPath::parse(raw.jwt_claim.0.trim())
                    .map_err(de::Error::custom)?;
                let origin = raw.from.map_or(ClaimOrigin::Bearer, |from| from.0);
                origin.check(&path).map_err(de::Error::custom)?;
                Ok(PlanByField::JwtClaim(crate::jwt::Claim::new(path, origin)))
            }
        }
        deserializer.deserialize_any(ByVisitor)
    }
}

/// `values: {PLAN: N, …}`: in the order written, names unique, at most [`MAX_PLANS`].
pub(super) struct PlanValues(pub Vec<(String, NonZeroU32)>);

impl<'de> Deserialize<'de> for PlanValues {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ValuesVisitor;
        impl<'de> Visitor<'de> for ValuesVisitor {
            type Value = PlanValues;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    formatter,
                    "a mapping of 1 to {MAX_PLANS} plan names to their rpu (`{{free: 10, pro: 1000}}`)"
                )
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<PlanValues, A::Error> {
                let mut values: Vec<(String, NonZeroU32)> = Vec::new();
                while let Some(name) = map.next_key::<PlanName>()? {
                    let name = name.0;
                    if values.iter().any(|(seen, _)| *seen == name) {
                        return Err(de::Error::custom(format!("duplicate plan `{name}`")));
                    }
                    if values.len() == MAX_PLANS {
                        return Err(de::Error::custom(format!(
                            "more than {MAX_PLANS} plans: each plan is a counter table of its own"
                        )));
                    }
                    let rpu = map.next_value::<NonZeroU32>()?;
                    values.push((name, rpu));
                }
                if values.is_empty() {
                    return Err(de::Error::custom(
                        "no plans: `values` names at least one plan and its rpu",
                    ));
                }
                Ok(PlanValues(values))
            }
        }
        deserializer.deserialize_map(ValuesVisitor)
    }
}

impl Describe for PlanValues {
    fn shape() -> Shape {
        Shape::object(Vec::new())
            .entries(
                format!("^[!-~]{{1,{MAX_PLAN_NAME}}}$"),
                "pro",
                NonZeroU32::shape(),
                (Some(1), Some(MAX_PLANS)),
            )
            .constraint(Constraint::Never(PlanName::DEFAULT))
    }
}

/// A plan's name: the header value (or claim) that selects it, matched exactly.
struct PlanName(String);

impl PlanName {
    /// Not a plan's name: what `rpu.default` is the limit of.
    const DEFAULT: &'static str = "default";
}

impl<'de> Deserialize<'de> for PlanName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a plan name", |raw| {
            if raw.is_empty() || raw.len() > MAX_PLAN_NAME {
                return Err(format!(
                    "invalid plan name `{}`: 1 to {MAX_PLAN_NAME} characters",
                    raw.escape_debug()
                ));
            }
            if !raw.bytes().all(|byte| byte.is_ascii_graphic()) {
                return Err(format!(
                    "invalid plan name `{}`: only visible ASCII, no spaces (the value is matched \
                     exactly, and names the plan's metrics)",
                    raw.escape_debug()
                ));
            }
            if raw == PlanName::DEFAULT {
                return Err(
                    "`default` names the plan of every other value: write its limit as \
                     `rpu.default`"
                        .to_string(),
                );
            }
            Ok(PlanName(raw.to_string()))
        })
    }
}

impl<'de> Deserialize<'de> for RpuField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct RpuVisitor;
        impl<'de> Visitor<'de> for RpuVisitor {
            type Value = RpuField;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("a nonzero u32, or plans `{by, values, default}`")
            }
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<RpuField, E> {
                // The same words as a plain `NonZeroU32` field.
                u32::try_from(value)
                    .ok()
                    .and_then(NonZeroU32::new)
                    .map(RpuField::Fixed)
                    .ok_or_else(|| E::invalid_value(Unexpected::Unsigned(value), &"a nonzero u32"))
            }
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<RpuField, E> {
                match u64::try_from(value) {
                    Ok(value) => self.visit_u64(value),
                    Err(_) => Err(E::invalid_value(
                        Unexpected::Signed(value),
                        &"a nonzero u32",
                    )),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<RpuField, A::Error> {
                RawPlans::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(RpuField::Plans)
            }
        }
        deserializer.deserialize_any(RpuVisitor)
    }
}

/// `lease`: tokens fetched per callout, or `auto`.
#[derive(Clone, Copy)]
pub(super) enum LeaseField {
    Fixed(u32),
    Auto,
}

impl<'de> Deserialize<'de> for LeaseField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct LeaseVisitor;
        impl<'de> Visitor<'de> for LeaseVisitor {
            type Value = LeaseField;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    formatter,
                    "an integer between 1 and {} or `auto`",
                    wire::MAX_WANT
                )
            }
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<LeaseField, E> {
                match u32::try_from(value) {
                    Ok(lease) if (1..=wire::MAX_WANT).contains(&lease) => {
                        Ok(LeaseField::Fixed(lease))
                    }
                    _ => Err(E::invalid_value(Unexpected::Unsigned(value), &self)),
                }
            }
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<LeaseField, E> {
                match u64::try_from(value) {
                    Ok(value) => self.visit_u64(value),
                    Err(_) => Err(E::invalid_value(Unexpected::Signed(value), &self)),
                }
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<LeaseField, E> {
                if value.trim().eq_ignore_ascii_case(LeaseField::AUTO) {
                    Ok(LeaseField::Auto)
                } else {
                    Err(E::invalid_value(Unexpected::Str(value), &self))
                }
            }
        }
        deserializer.deserialize_any(LeaseVisitor)
    }
}

impl LeaseField {
    /// The lease sized from the observed rate.
    const AUTO: &'static str = "auto";
}

impl Describe for LeaseField {
    fn shape() -> Shape {
        Shape::one_of(vec![
            Shape::integer(1, u64::from(wire::MAX_WANT)),
            Shape::words(vec![LeaseField::AUTO], false),
        ])
    }
}

/// `cost`: tokens a request takes, a constant or read from a request header.
pub(super) enum CostField {
    Fixed(u32),
    Header(RawHeaderCost),
}

impl<'de> Deserialize<'de> for CostField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct CostVisitor;
        impl<'de> Visitor<'de> for CostVisitor {
            type Value = CostField;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    formatter,
                    "an integer between 1 and {} or `{{header: NAME, default: N, max: N}}`",
                    wire::MAX_WANT
                )
            }
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<CostField, E> {
                match u32::try_from(value) {
                    Ok(cost) if (1..=wire::MAX_WANT).contains(&cost) => Ok(CostField::Fixed(cost)),
                    _ => Err(E::invalid_value(Unexpected::Unsigned(value), &self)),
                }
            }
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<CostField, E> {
                match u64::try_from(value) {
                    Ok(value) => self.visit_u64(value),
                    Err(_) => Err(E::invalid_value(Unexpected::Signed(value), &self)),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<CostField, A::Error> {
                RawHeaderCost::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(CostField::Header)
            }
        }
        deserializer.deserialize_any(CostVisitor)
    }
}

impl Describe for CostField {
    fn shape() -> Shape {
        Shape::one_of(vec![
            Shape::integer(1, u64::from(wire::MAX_WANT)),
            RawHeaderCost::shape(),
        ])
    }
}

/// A request or response header name, lower-cased (RFC 9110 token).
pub(super) struct HeaderNameField(pub String);

impl Describe for HeaderNameField {
    fn shape() -> Shape {
        let (pattern, longest) = crate::actor::HeaderKind.value_shape();
        Shape::string("x-plan")
            .pattern(pattern)
            .length(None, Some(longest))
            .named("header_name")
            .described("An HTTP header name (case-insensitive)")
    }
}

impl<'de> Deserialize<'de> for HeaderNameField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a header name", |raw| {
            crate::actor::HeaderKind
                .parse_value(raw)
                .map(HeaderNameField)
        })
    }
}

/// A secret (`global.token`): the value itself, or `{env: NAME}` to read it from the
/// gateway process's environment. Errors never quote the value.
pub(super) struct SecretField(pub Secret);

impl Describe for SecretField {
    fn shape() -> Shape {
        Shape::one_of(vec![
            Shape::string("0123456789abcdef0123456789abcdef")
                .pattern("^[!-~]+$")
                .length(Some(MIN_SECRET_BYTES), None),
            RawSecretFromEnv::shape(),
        ])
        .named("secret")
        .described(format!(
            "A secret of at least {MIN_SECRET_BYTES} bytes of printable ASCII, or {{env: NAME}}"
        ))
    }
}

document_struct! {
    /// `{env: NAME}`: a secret read from the gateway process's environment.
    #[expecting = "`{env: NAME}`"]
    struct RawSecretFromEnv {
        env: NonEmpty;
    }
}

impl<'de> Deserialize<'de> for SecretField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SecretVisitor;

        impl<'de> Visitor<'de> for SecretVisitor {
            type Value = SecretField;

            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("a secret string, or `{env: NAME}`")
            }

            fn visit_str<E: de::Error>(self, value: &str) -> Result<SecretField, E> {
                Secret::new(value).map(SecretField).map_err(E::custom)
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<SecretField, A::Error> {
                let raw =
                    RawSecretFromEnv::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Secret::from_env(raw.env.0.trim())
                    .map(SecretField)
                    .map_err(de::Error::custom)
            }
        }
        deserializer.deserialize_any(SecretVisitor)
    }
}

/// `identity_key`: a secret of at least 32 bytes, or `{env: NAME}` ([`SecretField`]). A
/// value of another type (a number, a boolean) is refused without being quoted either.
pub(super) struct IdentityKeyField(pub Secret);

impl Describe for IdentityKeyField {
    fn shape() -> Shape {
        SecretField::shape()
    }
}

impl<'de> Deserialize<'de> for IdentityKeyField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;

        impl KeyVisitor {
            fn refuse<T, E: de::Error>(self) -> Result<T, E> {
                Err(E::custom(
                    "expected a secret string of at least 32 bytes (quoted), or `{env: NAME}`",
                ))
            }
        }

        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = IdentityKeyField;

            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("a secret string of at least 32 bytes, or `{env: NAME}`")
            }

            fn visit_str<E: de::Error>(self, value: &str) -> Result<IdentityKeyField, E> {
                Secret::new(value).map(IdentityKeyField).map_err(E::custom)
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<IdentityKeyField, A::Error> {
                SecretField::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(|field| IdentityKeyField(field.0))
            }

            fn visit_u64<E: de::Error>(self, _: u64) -> Result<IdentityKeyField, E> {
                self.refuse()
            }

            fn visit_i64<E: de::Error>(self, _: i64) -> Result<IdentityKeyField, E> {
                self.refuse()
            }

            fn visit_f64<E: de::Error>(self, _: f64) -> Result<IdentityKeyField, E> {
                self.refuse()
            }

            fn visit_bool<E: de::Error>(self, _: bool) -> Result<IdentityKeyField, E> {
                self.refuse()
            }

            fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<IdentityKeyField, E> {
                self.refuse()
            }
        }
        deserializer.deserialize_any(KeyVisitor)
    }
}

document_struct! {
    /// `metrics: {path: /diana/metrics}`.
    #[expecting = "the `metrics` section"]
    pub(super) struct RawMetrics {
        path: PathField;
    }
}

document_struct! {
    /// `response:` (rejections and rate-limit headers).
    #[expecting = "the `response` section"]
    #[shape = |shape: Shape| shape.named("response")]
    pub(super) struct RawResponse {
        status: Option<Ranged<{ STATUSES.0 as u64 }, { STATUSES.1 as u64 }>> =>
            "Rejection status (default 503)";
        body: Option<AnyText> => "Rejection body (default \"rate limited\\n\")";
        headers: Option<HeaderModeField>;
        header_style: Option<HeaderStyleField>;
    }
}

document_struct! {
    /// `global:` (the quota service). Where it is and its credential are pinned.
    #[expecting = "the `global` section"]
    #[shape = |shape: Shape| shape
        .named("global")
        .described("The quota service used by `scope: global` rules")]
    pub(super) struct RawGlobal {
        cluster: Option<NonEmpty> [Pin::Pinned(PinnedValue::QuotaService)] =>
            "Envoy cluster name; host:port on nginx/Kong (default diana_quota)";
        authority: Option<NonEmpty> [Pin::Pinned(PinnedValue::QuotaService)] =>
            "Default diana-quota";
        path: Option<PathField> [Pin::Pinned(PinnedValue::QuotaService)] => "Default /v1/acquire";
        timeout_ms: Option<Ranged<1, MAX_TIMEOUT_MS>> => "Default 50";
        lease: Option<LeaseField> => "Default 1; `auto`: sized from the observed rate";
        retry_seconds: Option<Ranged<0, MAX_RETRY_SECONDS>> =>
            "Circuit breaker: stay local this long (default 5)";
        token: Option<SecretField> [Pin::Pinned(PinnedValue::QuotaCredential)] =>
            "The quota service's credential (default: the environment variable DIANA_QUOTA_TOKEN)";
    }
}

document_struct! {
    /// `remote:` (the config center). Pinned whole; `allow` and `signature` are the local
    /// document's alone.
    #[expecting = "the `remote` section"]
    #[shape = |shape: Shape| shape
        .named("remote")
        .described("Config center, polled; its document replaces this one")]
    pub(super) struct RawRemote {
        cluster: NonEmpty [Pin::Pinned(PinnedValue::ConfigCenter)];
        authority: Option<NonEmpty> [Pin::Pinned(PinnedValue::ConfigCenter)] => "Default: cluster";
        path: PathField [Pin::Pinned(PinnedValue::ConfigCenter)];
        poll_seconds: Option<NonZeroU32> [Pin::Pinned(PinnedValue::ConfigCenter)] => "Default 10";
        allow: Option<Vec<PinnedField>> [Pin::LocalOnly(LocalOnly::Allow)] =>
            "What a remote document may change of what this document pins \
             (default none: a remote document that changes one is refused)";
        signature: Option<SignatureField> [Pin::LocalOnly(LocalOnly::Signature)] =>
            "Adopt only remote documents signed with this key (x-diana-signature header)";
    }
}

/// A name in `remote.allow`: what a remote document may change.
#[derive(Clone, Copy)]
pub(super) struct PinnedField(pub Pinned);

impl Describe for PinnedField {
    fn shape() -> Shape {
        Shape::words(Pinned::ALL.iter().map(|name| name.name()).collect(), false)
    }
}

impl<'de> Deserialize<'de> for PinnedField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(
            deserializer,
            "global, remote, dry_run or identity_key",
            |raw| named(raw, &Pinned::ALL, Pinned::name, "name in remote.allow").map(PinnedField),
        )
    }
}

/// `remote.signature`: `{hmac_sha256: SECRET}` (or `{hmac_sha256: {env: NAME}}`) or
/// `{ed25519: PUBLIC_KEY}`, exactly one.
pub(super) struct SignatureField(pub SignatureKey);

impl<'de> Deserialize<'de> for SignatureField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SignatureVisitor;

        impl<'de> Visitor<'de> for SignatureVisitor {
            type Value = SignatureField;

            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("`{hmac_sha256: SECRET}` or `{ed25519: PUBLIC_KEY}`")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<SignatureField, A::Error> {
                const KINDS: &[&str] = &[SignatureField::HMAC_SHA256, SignatureField::ED25519];
                let mut key: Option<SignatureKey> = None;
                while let Some(kind) = map.next_key::<String>()? {
                    if key.is_some() {
                        return Err(de::Error::custom(
                            "two signature keys, expected one: `hmac_sha256` or `ed25519`",
                        ));
                    }
                    let next = match kind.as_str() {
                        SignatureField::HMAC_SHA256 => {
                            SignatureKey::HmacSha256(map.next_value::<SecretField>()?.0)
                        }
                        SignatureField::ED25519 => map.next_value::<Ed25519KeyField>()?.0,
                        other => return Err(de::Error::unknown_field(other, KINDS)),
                    };
                    key = Some(next);
                }
                key.map(SignatureField).ok_or_else(|| {
                    de::Error::custom("no signature key, expected `hmac_sha256` or `ed25519`")
                })
            }
        }
        deserializer.deserialize_map(SignatureVisitor)
    }
}

impl SignatureField {
    const HMAC_SHA256: &'static str = "hmac_sha256";
    const ED25519: &'static str = "ed25519";
}

impl Describe for SignatureField {
    fn shape() -> Shape {
        Shape::object(vec![
            Field::of::<SecretField>(SignatureField::HMAC_SHA256, false)
                .described("Shared signing key"),
            Field::of::<Ed25519KeyField>(SignatureField::ED25519, false)
                .described("The config center's public key, base64"),
        ])
        .constraint(Constraint::ExactlyOne(vec![
            SignatureField::HMAC_SHA256,
            SignatureField::ED25519,
        ]))
    }
}

/// An Ed25519 public key in base64.
struct Ed25519KeyField(SignatureKey);

impl Describe for Ed25519KeyField {
    fn shape() -> Shape {
        // RFC 8032's first test key.
        Shape::string("11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=")
    }
}

impl<'de> Deserialize<'de> for Ed25519KeyField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a base64 Ed25519 public key", |raw| {
            SignatureKey::ed25519(raw).map(Ed25519KeyField)
        })
    }
}

// ---------------------------------------------------------------------------------------
// Sections given once across documents.

pub(super) const SECTION_ACTORS: u8 = 0;
pub(super) const SECTION_RESPONSE: u8 = 1;
pub(super) const SECTION_GLOBAL: u8 = 2;
pub(super) const SECTION_REMOTE: u8 = 3;
pub(super) const SECTION_DRY_RUN: u8 = 4;
pub(super) const SECTION_METRICS: u8 = 5;
pub(super) const SECTION_IDENTITY_KEY: u8 = 6;
pub(super) const SECTION_ON_INVALID_CONFIG: u8 = 7;
pub(super) const SECTION_RESOURCES: u8 = 8;

fn section_name(id: u8) -> &'static str {
    match id {
        SECTION_ACTORS => "actors",
        SECTION_RESPONSE => "response",
        SECTION_GLOBAL => "global",
        SECTION_REMOTE => "remote",
        SECTION_DRY_RUN => "dry_run",
        SECTION_IDENTITY_KEY => "identity_key",
        SECTION_ON_INVALID_CONFIG => "on_invalid_config",
        SECTION_RESOURCES => "resources",
        _ => "metrics",
    }
}

/// A top-level section; refuses a second occurrence in a later `---` document. (Merging
/// two `resources:` lists, or two `global:` sections, would make one document's meaning
/// depend on another's that the reader may never look at.)
pub(super) struct Section<T, const ID: u8>(pub T);

impl<'de, T: Deserialize<'de>, const ID: u8> Deserialize<'de> for Section<T, ID> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Checked before the value is read, so that the error's position is where the
        // repeated section's value starts, not where the reader stopped after it.
        let repeated = with_context(|context| {
            if context.sections.contains(&ID) {
                true
            } else {
                context.sections.push(ID);
                false
            }
        });
        if repeated {
            return Err(de::Error::custom(format_args!(
                "section `{}` {SECTION_REPEATED}: give each section in one document only",
                section_name(ID)
            )));
        }
        T::deserialize(deserializer).map(Section)
    }
}

impl<T: Describe, const ID: u8> Describe for Section<T, ID> {
    fn shape() -> Shape {
        T::shape()
    }
}

/// `on_invalid_config`: deny | allow, as written (serde's own names).
impl Describe for OnInvalidConfig {
    fn shape() -> Shape {
        Shape::exact(
            OnInvalidConfig::ALL
                .iter()
                .map(|mode| mode.name())
                .collect(),
        )
    }
}

/// What the refusal of a section given again says.
const SECTION_REPEATED: &str = "is already given by an earlier document";

/// The message for a key written with `null` (YAML `~`, `null`, or nothing after the key).
const NULL_REFUSED: &str = "null where a value is expected: write the value, or leave the key \
                            out for its default (quote it, \"null\", if that is the text you mean)";

/// True when `message` is a refusal raised before the value was read: a `null` refused by
/// [`present`], or a [`Section`] given again. The YAML reader reports such an error at the
/// enclosing mapping, so the caller finds the value's own position.
pub(super) fn refused_before_reading(message: &str) -> bool {
    message.contains(NULL_REFUSED) || message.contains(SECTION_REPEATED)
}

/// Reads an optional field that is present: absent is `None` (through `#[serde(default)]`),
/// and `null` is refused rather than read as absent. A key written with nothing after it is
/// more often a value forgotten than a wish for the default, which leaving the key out
/// gives; and a text field must not take `~` as "default" when it refuses it as text.
pub(super) fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    deserializer: D,
) -> Result<Option<T>, D::Error> {
    struct PresentVisitor<T>(std::marker::PhantomData<T>);

    impl<'de, T: Deserialize<'de>> Visitor<'de> for PresentVisitor<T> {
        type Value = Option<T>;

        fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
            formatter.write_str("a value")
        }

        fn visit_none<E: de::Error>(self) -> Result<Option<T>, E> {
            Err(E::custom(NULL_REFUSED))
        }

        fn visit_unit<E: de::Error>(self) -> Result<Option<T>, E> {
            Err(E::custom(NULL_REFUSED))
        }

        fn visit_some<D2: Deserializer<'de>>(
            self,
            deserializer: D2,
        ) -> Result<Option<T>, D2::Error> {
            T::deserialize(deserializer).map(Some)
        }
    }
    deserializer.deserialize_option(PresentVisitor(std::marker::PhantomData))
}

// ---------------------------------------------------------------------------------------
// Validating scalar fields.

/// A visitor for string values validated by `parse`, whose error (any type that displays)
/// becomes the message.
struct StrVisitor<X, F> {
    expecting: X,
    parse: F,
}

/// Text fields accept a string, and an integer or a boolean as its text (YAML's `name: 5`,
/// the same in JSON, so both forms agree). `null` (YAML `~`, `null`, an empty value) is
/// refused rather than read as the text "null", and so is a float, whose text YAML and
/// JSON would not keep as written (`1.50` → `1.5`).
impl<T, X, F, P> Visitor<'_> for StrVisitor<X, F>
where
    X: fmt::Display,
    F: FnOnce(&str) -> Result<T, P>,
    P: fmt::Display,
{
    type Value = T;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}", self.expecting)
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<T, E> {
        (self.parse)(value).map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<T, E> {
        self.visit_str(&value.to_string())
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<T, E> {
        self.visit_str(&value.to_string())
    }

    fn visit_bool<E: de::Error>(self, value: bool) -> Result<T, E> {
        self.visit_str(if value { "true" } else { "false" })
    }

    fn visit_unit<E: de::Error>(self) -> Result<T, E> {
        Err(E::custom(format!(
            "null where {} is expected (quote it, \"null\", if that is the text you mean)",
            self.expecting
        )))
    }

    fn visit_none<E: de::Error>(self) -> Result<T, E> {
        self.visit_unit()
    }
}

pub(super) fn deserialize_str_with<'de, D: Deserializer<'de>, T, P: fmt::Display>(
    deserializer: D,
    expecting: impl fmt::Display,
    parse: impl FnOnce(&str) -> Result<T, P>,
) -> Result<T, D::Error> {
    deserializer.deserialize_any(StrVisitor { expecting, parse })
}

fn one_of<'a>(names: impl IntoIterator<Item = &'a str>) -> String {
    names.into_iter().collect::<Vec<_>>().join(", ")
}

/// A resource `Url`: starts with `/`, no query or fragment, normalised, not seen before.
pub(super) struct UrlField(pub String);

impl Describe for UrlField {
    fn shape() -> Shape {
        Shape::string("/")
            .pattern("^/[^?#]*$")
            .described("Path prefix starting with `/`, without query or fragment")
    }
}

impl<'de> Deserialize<'de> for UrlField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a path starting with `/`", |raw| {
            if !raw.starts_with('/') {
                return Err(format!(
                    "invalid Url `{raw}`: a Url is a path and must start with `/`"
                ));
            }
            if raw.contains(['?', '#']) {
                return Err(format!(
                    "invalid Url `{raw}`: a Url is a path, without `?query` or `#fragment`"
                ));
            }
            let url = path::normalize_str(raw);
            with_context(|context| {
                if context.urls.contains(&url) {
                    let same = if url == raw {
                        String::new()
                    } else {
                        format!(" (`{url}` after normalisation)")
                    };
                    return Err(format!(
                        "duplicate resource `{raw}`{same}: an earlier block has the same Url"
                    ));
                }
                context.urls.push(url.clone());
                Ok(UrlField(url))
            })
        })
    }
}

/// `unit`: second | minute | hour | day | week | month.
pub(super) struct UnitField(pub RuleUnit);

impl Describe for UnitField {
    fn shape() -> Shape {
        Shape::words(RuleUnit::ALL.iter().map(|unit| unit.name()).collect(), true)
            .named("unit")
            .described(
                "Unit of `rpu`, case-insensitive, a trailing `s` accepted (default second); week \
                 and month are calendar periods in the rule's `timezone` (W and TB)",
            )
    }
}

impl<'de> Deserialize<'de> for UnitField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a unit", |raw| {
            RuleUnit::parse(raw).map(UnitField).ok_or_else(|| {
                format!(
                    "unknown unit `{raw}`, expected one of {}",
                    one_of(RuleUnit::ALL.iter().map(|unit| unit.name()))
                )
            })
        })
    }
}

/// `algo`: any spelling in the algorithm registry, case-insensitive.
pub(super) struct AlgoField(pub &'static dyn Algorithm);

impl Describe for AlgoField {
    fn shape() -> Shape {
        Shape::words(algorithm_names(), false)
            .named("algo")
            .described(
                "Algorithm, case-insensitive: W (fixed window), SW (sliding window), LB (leaky \
                 bucket), TB (token bucket, the default)",
            )
    }
}

impl<'de> Deserialize<'de> for AlgoField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "an algorithm name", |raw| {
            algo::lookup(raw).map(AlgoField).ok_or_else(|| {
                format!(
                    "unknown algorithm `{raw}`, expected one of {}",
                    one_of(algorithm_names())
                )
            })
        })
    }
}

/// Every spelling of the algorithm registry, without case-insensitive repeats.
fn algorithm_names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = Vec::new();
    for name in algo::known_names() {
        if !names.iter().any(|known| known.eq_ignore_ascii_case(name)) {
            names.push(name);
        }
    }
    names
}

/// `scope`: local | global.
pub(super) struct ScopeField(pub Scope);

impl Describe for ScopeField {
    fn shape() -> Shape {
        Shape::words(Scope::ALL.iter().map(|scope| scope.name()).collect(), false)
            .named("scope")
            .described(
                "local: counted per gateway process; global: shared through diana-quota \
                 (default local)",
            )
    }
}

impl<'de> Deserialize<'de> for ScopeField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "`local` or `global`", |raw| {
            Scope::ALL
                .into_iter()
                .find(|scope| scope.name().eq_ignore_ascii_case(raw.trim()))
                .map(ScopeField)
                .ok_or_else(|| format!("unknown scope `{raw}`, expected local or global"))
        })
    }
}

/// `actor`: a built-in name or one defined in `actors:`.
pub(super) struct ActorRef(pub String);

impl Describe for ActorRef {
    fn shape() -> Shape {
        Shape::string("all").pattern(ACTOR_NAME_PATTERN)
    }
}

impl<'de> Deserialize<'de> for ActorRef {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "an actor name", |raw| {
            with_context(|context| {
                if context.actor_names.iter().any(|name| name == raw) {
                    Ok(ActorRef(raw.to_string()))
                } else {
                    let known = context
                        .actor_names
                        .iter()
                        .map(String::as_str)
                        .filter(|name| *name != "actor");
                    Err(format!("unknown actor `{raw}`, expected one of {} (or a name defined under `actors`)", one_of(known)))
                }
            })
        })
    }
}

/// Longest rule name.
const MAX_RULE_NAME: usize = 128;

/// A rule's or a breaker's name: not blank, at most `longest` bytes of printable ASCII
/// (0x20 to 0x7E).
fn printable_name(raw: &str, what: &str, longest: usize) -> Result<(), String> {
    if raw.trim().is_empty() {
        return Err(format!("empty {what} name"));
    }
    if raw.len() > longest {
        return Err(format!("{what} name longer than {longest} characters"));
    }
    if !raw.bytes().all(|byte| (0x20..0x7f).contains(&byte)) {
        return Err(format!(
            "invalid {what} name `{}`: only printable ASCII (0x20 to 0x7E) is allowed: the name is \
             used in metrics and logs, and as a structured-field string in the RateLimit headers",
            raw.escape_debug()
        ));
    }
    Ok(())
}

/// `name`: printable ASCII, unique among the document's explicit names.
pub(super) struct RuleName(pub String);

impl Describe for RuleName {
    fn shape() -> Shape {
        Shape::string("api")
            .pattern("^[ -~]*[!-~][ -~]*$")
            .length(None, Some(MAX_RULE_NAME))
    }
}

impl<'de> Deserialize<'de> for RuleName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a rule name", |raw| {
            printable_name(raw, "rule", MAX_RULE_NAME)?;
            with_context(|context| {
                if context.rule_names.iter().any(|name| name == raw) {
                    return Err(format!("duplicate rule name `{raw}`"));
                }
                context.rule_names.push(raw.to_string());
                Ok(RuleName(raw.to_string()))
            })
        })
    }
}

/// The member of `all` named `raw` (case-insensitive, surrounding spaces ignored), or a
/// message naming every choice.
fn named<T: Copy>(
    raw: &str,
    all: &[T],
    name: fn(T) -> &'static str,
    what: &str,
) -> Result<T, String> {
    all.iter()
        .copied()
        .find(|member| name(*member).eq_ignore_ascii_case(raw.trim()))
        .ok_or_else(|| {
            format!(
                "unknown {what} `{raw}`, expected one of {}",
                one_of(all.iter().map(|member| name(*member)))
            )
        })
}

/// `response.headers`: none | limited | all.
pub(super) struct HeaderModeField(pub HeaderMode);

impl Describe for HeaderModeField {
    fn shape() -> Shape {
        Shape::words(
            HeaderMode::ALL.iter().map(|mode| mode.name()).collect(),
            false,
        )
        .named("headers")
        .described(
            "When rate-limit headers are sent: none, limited (on rejections, the default), all \
                 (admitted answers too)",
        )
    }
}

impl<'de> Deserialize<'de> for HeaderModeField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "none, limited or all", |raw| {
            named(raw, &HeaderMode::ALL, HeaderMode::name, "headers mode").map(HeaderModeField)
        })
    }
}

/// `response.header_style`: x-ratelimit | ietf | both.
pub(super) struct HeaderStyleField(pub HeaderStyle);

impl Describe for HeaderStyleField {
    fn shape() -> Shape {
        Shape::words(
            HeaderStyle::ALL.iter().map(|style| style.name()).collect(),
            false,
        )
        .named("header_style")
        .described(
            "Which rate-limit headers: x-ratelimit (X-RateLimit-Limit/Remaining/Reset, the \
                 default), ietf (RateLimit-Policy and RateLimit of \
                 draft-ietf-httpapi-ratelimit-headers-10, named after the rule), both",
        )
    }
}

impl<'de> Deserialize<'de> for HeaderStyleField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "x-ratelimit, ietf or both", |raw| {
            named(raw, &HeaderStyle::ALL, HeaderStyle::name, "header style").map(HeaderStyleField)
        })
    }
}

/// `fallback`: skip | ip | shared.
pub(super) struct FallbackField(pub Fallback);

impl Describe for FallbackField {
    fn shape() -> Shape {
        Shape::words(Fallback::ALL.iter().map(|f| f.name()).collect(), false)
            .named("fallback")
            .described(
                "When the identity header is missing: skip the rule, count by client ip, or \
                 one shared counter",
            )
    }
}

impl<'de> Deserialize<'de> for FallbackField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "skip, ip or shared", |raw| {
            Fallback::parse(raw).map(FallbackField).ok_or_else(|| {
                format!(
                    "unknown fallback `{raw}`, expected one of {}",
                    one_of(Fallback::ALL.iter().map(|f| f.name()))
                )
            })
        })
    }
}

/// Any text (the rejection body).
pub(super) struct AnyText(pub String);

impl Describe for AnyText {
    fn shape() -> Shape {
        Shape::string("rate limited")
    }
}

impl<'de> Deserialize<'de> for AnyText {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a string", |raw| {
            Ok::<_, std::convert::Infallible>(AnyText(raw.to_string()))
        })
    }
}

/// A non-empty string (cluster, authority).
pub(super) struct NonEmpty(pub String);

impl Describe for NonEmpty {
    fn shape() -> Shape {
        Shape::string("sub")
            .pattern("\\S")
            .named("text")
            .described("A non-empty string")
    }
}

impl<'de> Deserialize<'de> for NonEmpty {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a non-empty string", |raw| {
            if raw.trim().is_empty() {
                Err("empty value, expected a non-empty string".to_string())
            } else {
                Ok(NonEmpty(raw.to_string()))
            }
        })
    }
}

/// An HTTP request path for a callout (`global.path`, `remote.path`): starts with `/`.
pub(super) struct PathField(pub String);

impl Describe for PathField {
    fn shape() -> Shape {
        Shape::string("/p")
            .pattern("^/[^\\u0000-\\u0020\\u007f]*$")
            .named("path")
            .described("An HTTP path starting with `/`, no spaces or control characters")
    }
}

impl<'de> Deserialize<'de> for PathField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a path starting with `/`", |raw| {
            if !raw.starts_with('/') {
                Err(format!("invalid path `{raw}`: must start with `/`"))
            } else if raw.bytes().any(|byte| byte <= b' ' || byte == 0x7f) {
                Err(format!(
                    "invalid path `{}`: spaces and control characters are not allowed",
                    raw.escape_debug()
                ))
            } else {
                Ok(PathField(raw.to_string()))
            }
        })
    }
}

/// A share: a number greater than 0 and at most 1 (`0.5`, `1`), as written and in parts
/// per million ([`crate::breaker::Ratio`], what the breaker's machine counts in: a share
/// finer than a millionth is refused, not rounded).
pub(super) struct Ratio(
    #[cfg_attr(not(test), allow(dead_code))] pub f64,
    pub crate::breaker::Ratio,
);

impl Describe for Ratio {
    fn shape() -> Shape {
        Shape::ratio()
    }
}

impl<'de> Deserialize<'de> for Ratio {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct RatioVisitor;

        impl Visitor<'_> for RatioVisitor {
            type Value = Ratio;

            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("a number greater than 0 and at most 1")
            }

            fn visit_f64<E: de::Error>(self, value: f64) -> Result<Ratio, E> {
                if !(value > 0.0 && value <= 1.0) {
                    return Err(E::invalid_value(Unexpected::Float(value), &self));
                }
                crate::breaker::Ratio::from_f64(value)
                    .map(|ratio| Ratio(value, ratio))
                    .map_err(|error| E::custom(format_args!("{value}: {error}")))
            }

            fn visit_u64<E: de::Error>(self, value: u64) -> Result<Ratio, E> {
                match value {
                    1 => self.visit_f64(1.0),
                    _ => Err(E::invalid_value(Unexpected::Unsigned(value), &self)),
                }
            }

            fn visit_i64<E: de::Error>(self, value: i64) -> Result<Ratio, E> {
                match u64::try_from(value) {
                    Ok(value) => self.visit_u64(value),
                    Err(_) => Err(E::invalid_value(Unexpected::Signed(value), &self)),
                }
            }
        }
        deserializer.deserialize_any(RatioVisitor)
    }
}

/// An integer in `MIN..=MAX`.
pub(super) struct Ranged<const MIN: u64, const MAX: u64>(pub u64);

struct RangedVisitor<const MIN: u64, const MAX: u64>;

impl<const MIN: u64, const MAX: u64> Visitor<'_> for RangedVisitor<MIN, MAX> {
    type Value = Ranged<MIN, MAX>;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "an integer between {MIN} and {MAX}")
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Self::Value, E> {
        if (MIN..=MAX).contains(&value) {
            Ok(Ranged(value))
        } else {
            Err(E::invalid_value(Unexpected::Unsigned(value), &self))
        }
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<Self::Value, E> {
        match u64::try_from(value) {
            Ok(value) => self.visit_u64(value),
            Err(_) => Err(E::invalid_value(Unexpected::Signed(value), &self)),
        }
    }
}

impl<'de, const MIN: u64, const MAX: u64> Deserialize<'de> for Ranged<MIN, MAX> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_u64(RangedVisitor::<MIN, MAX>)
    }
}

impl<const MIN: u64, const MAX: u64> Describe for Ranged<MIN, MAX> {
    fn shape() -> Shape {
        Shape::integer(MIN, MAX)
    }
}

impl<const MIN: u64, const MAX: u64> Ranged<MIN, MAX> {
    /// The value as `u32`, saturating (ranges used here fit).
    pub fn get_u32(&self) -> u32 {
        u32::try_from(self.0).unwrap_or(u32::MAX)
    }
}

// ---------------------------------------------------------------------------------------
// `actors:` section.

/// `actors:` — name → definition, in document order.
pub(super) struct RawActors(pub Vec<(String, ActorDef)>);

/// What an actor's name looks like (defined, or named by a rule).
const ACTOR_NAME_PATTERN: &str = "^[A-Za-z0-9_.-]{1,64}$";
/// The longest actor name.
const MAX_ACTOR_NAME: usize = 64;

impl Describe for RawActors {
    fn shape() -> Shape {
        // An actor's keys: one source, `fallback`, and `from` (with `jwt_claim` only).
        let definition = || {
            let mut fields: Vec<Field> = SOURCE_KINDS
                .iter()
                .map(|kind| {
                    let (pattern, longest) = kind.value_shape();
                    let value = Shape::string("x")
                        .pattern(pattern)
                        .length(None, Some(longest));
                    Field::new(kind.key(), false, value)
                })
                .collect();
            fields.push(Field::of::<FallbackField>(SpecKey::FALLBACK, false));
            fields.push(Field::of::<ClaimOriginField>(SpecKey::FROM, false));
            Shape::object(fields).constraint(Constraint::Needs {
                key: SpecKey::FROM,
                needs: JwtClaimKind.key(),
            })
        };
        let sources: Vec<&'static str> = SOURCE_KINDS.iter().map(|kind| kind.key()).collect();
        // A built-in actor keeps its source unless one is written; a new one needs one.
        let builtins = CONFIGURABLE_BUILTINS
            .iter()
            .map(|builtin| {
                let definition = definition().constraint(Constraint::AtMostOne(sources.clone()));
                Field::new(builtin.name, false, definition)
            })
            .collect();
        let reserved: Vec<&str> = RESERVED_ACTORS
            .iter()
            .copied()
            .chain(CONFIGURABLE_BUILTINS.iter().map(|builtin| builtin.name))
            .collect();
        Shape::object(builtins)
            .entries(
                format!(
                    "^(?!(?:{})$){}",
                    reserved.join("|"),
                    ACTOR_NAME_PATTERN.trim_start_matches('^')
                ),
                "tenant",
                definition().constraint(Constraint::ExactlyOne(sources.clone())),
                (None, None),
            )
            .named("actors")
            .described(format!(
                "Where identities come from. {} may be redefined; other names are new actors \
                 ({}); {} are built in and cannot be redefined.",
                CONFIGURABLE_BUILTINS
                    .iter()
                    .map(|builtin| builtin.name)
                    .collect::<Vec<_>>()
                    .join(" and "),
                sources
                    .iter()
                    .map(|key| format!("`{key}`"))
                    .collect::<Vec<_>>()
                    .join(", "),
                RESERVED_ACTORS.join(", "),
            ))
    }
}

impl<'de> Deserialize<'de> for RawActors {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(ActorsVisitor)
    }
}

struct ActorsVisitor;

impl<'de> Visitor<'de> for ActorsVisitor {
    type Value = RawActors;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .write_str("a mapping of actor names to `{header: NAME | jwt_claim: CLAIM [, from: {jwt_authn: NAME}], fallback: skip|ip|shared}`")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawActors, A::Error> {
        let mut actors: Vec<(String, ActorDef)> = Vec::new();
        while let Some(ActorDefName(name)) = map.next_key()? {
            let def = map.next_value_seed(ActorSpecSeed { name: &name })?;
            actors.push((name, def));
        }
        Ok(RawActors(actors))
    }
}

/// The name of an actor being defined: a word, not a reserved name.
struct ActorDefName(String);

impl<'de> Deserialize<'de> for ActorDefName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "an actor name", |raw| {
            if RESERVED_ACTORS.contains(&raw) {
                return Err(format!("actor `{raw}` is built in and cannot be redefined"));
            }
            let valid = !raw.is_empty()
                && raw.len() <= MAX_ACTOR_NAME
                && raw
                    .bytes()
                    .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'-' | b'.'));
            if !valid {
                return Err(format!(
                    "invalid actor name `{}`: use 1 to {MAX_ACTOR_NAME} letters, digits, `_`, `-` or `.`",
                    raw.escape_debug()
                ));
            }
            with_context(|context| {
                if context.defined_actors.iter().any(|known| known == raw) {
                    return Err(format!("actor `{raw}` is defined twice"));
                }
                context.defined_actors.push(raw.to_string());
                Ok(ActorDefName(raw.to_string()))
            })
        })
    }
}

/// One actor definition; knows its name to apply the built-in defaults of `account`/`device`.
struct ActorSpecSeed<'n> {
    name: &'n str,
}

impl<'de> DeserializeSeed<'de> for ActorSpecSeed<'_> {
    type Value = ActorDef;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<ActorDef, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ActorSpecSeed<'_> {
    type Value = ActorDef;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "a mapping with one source ({}) and an optional `fallback`",
            source_keys()
        )
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ActorDef, A::Error> {
        let mut source: Option<(&'static dyn SourceKind, String)> = None;
        let mut fallback: Option<Fallback> = None;
        let mut from: Option<ClaimOrigin> = None;
        while let Some(key) = map.next_key::<SpecKey>()? {
            match key {
                SpecKey::From => {
                    if from.is_some() {
                        return Err(de::Error::duplicate_field("from"));
                    }
                    from = Some(map.next_value::<ClaimOriginField>()?.0);
                }
                SpecKey::Fallback => {
                    if fallback.is_some() {
                        return Err(de::Error::duplicate_field("fallback"));
                    }
                    fallback = Some(map.next_value::<FallbackField>()?.0);
                }
                SpecKey::Source(kind) => {
                    if let Some((previous, _)) = source {
                        return Err(de::Error::custom(format_args!(
                            "actor `{}` has two sources (`{}` and `{}`), expected one",
                            self.name,
                            previous.key(),
                            kind.key()
                        )));
                    }
                    let value = map.next_value_seed(SourceValueSeed { kind })?;
                    source = Some((kind, value));
                }
            }
        }
        let builtin = CONFIGURABLE_BUILTINS
            .iter()
            .find(|builtin| builtin.name == self.name);
        let (kind, value) = match (source, builtin) {
            (Some(source), _) => source,
            (None, Some(builtin)) => (builtin.kind, builtin.value.to_string()),
            (None, None) => {
                return Err(de::Error::custom(format_args!(
                    "actor `{}` needs a source, one of {}",
                    self.name,
                    source_keys()
                )))
            }
        };
        let fallback = fallback
            .or(builtin.map(|builtin| builtin.fallback))
            .unwrap_or(DEFAULT_USER_FALLBACK);
        match from {
            None => Ok(kind.build(&value, fallback)),
            Some(origin) if kind.key() == JwtClaimKind.key() => {
                // `value` is the canonical pointer `parse_value` returned.
                let path = ClaimPath::parse(&value).map_err(de::Error::custom)?;
                origin.check(&path).map_err(|error| {
                    de::Error::custom(format_args!("actor `{}`: {error}", self.name))
                })?;
                Ok(JwtClaimKind::build_from(&value, origin, fallback))
            }
            Some(_) => Err(de::Error::custom(format_args!(
                "actor `{}`: `from` says where a `jwt_claim` is read; this actor has `{}`",
                self.name,
                kind.key()
            ))),
        }
    }
}

/// `from: {jwt_authn: NAME}`: a claim read from the payload Envoy's `jwt_authn` filter
/// verified and left in the request's metadata (its provider's `payload_in_metadata`).
struct ClaimOriginField(ClaimOrigin);

impl Describe for ClaimOriginField {
    fn shape() -> Shape {
        RawClaimOrigin::shape().described(
            "Where a `jwt_claim` is read (default: the bearer token of the \
             `authorization` header, unverified). `{jwt_authn: NAME}`: the payload \
             Envoy's jwt_authn filter verified and left in the request's metadata \
             (its provider's `payload_in_metadata: NAME`); Envoy's wasm filter only",
        )
    }
}

document_struct! {
    /// `{jwt_authn: NAME}`.
    #[expecting = "`{jwt_authn: NAME}`, NAME the `payload_in_metadata` of the jwt_authn provider that verified the token"]
    struct RawClaimOrigin {
        jwt_authn: MetadataName;
    }
}

/// The `payload_in_metadata` name of a jwt_authn provider ([`ClaimOrigin::jwt_authn`]).
struct MetadataName(ClaimOrigin);

impl Describe for MetadataName {
    fn shape() -> Shape {
        Shape::string("jwt_payload")
            .pattern("^[^;\\u0000-\\u001f\\u007f]*[^;\\s][^;\\u0000-\\u001f\\u007f]*$")
            .length(None, Some(jwt::MAX_METADATA_NAME_BYTES))
    }
}

impl<'de> Deserialize<'de> for MetadataName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a `payload_in_metadata` name", |raw| {
            ClaimOrigin::jwt_authn(raw).map(MetadataName)
        })
    }
}

impl<'de> Deserialize<'de> for ClaimOriginField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        RawClaimOrigin::deserialize(deserializer).map(|raw| ClaimOriginField(raw.jwt_authn.0))
    }
}

fn source_keys() -> String {
    SOURCE_KINDS
        .iter()
        .map(|kind| format!("`{}`", kind.key()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A key inside an actor definition: `fallback`, `from` or the key of a source kind.
enum SpecKey {
    Fallback,
    From,
    Source(&'static dyn SourceKind),
}

impl SpecKey {
    const FALLBACK: &'static str = "fallback";
    const FROM: &'static str = "from";
}

impl<'de> Deserialize<'de> for SpecKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "an actor field", |raw| {
            if raw == SpecKey::FALLBACK {
                Ok(SpecKey::Fallback)
            } else if raw == SpecKey::FROM {
                Ok(SpecKey::From)
            } else {
                source_kind(raw).map(SpecKey::Source).ok_or_else(|| {
                    format!(
                        "unknown field `{raw}`, expected {}, `from` or `fallback`",
                        source_keys()
                    )
                })
            }
        })
    }
}

/// The value of a source key, validated by its kind.
struct SourceValueSeed {
    kind: &'static dyn SourceKind,
}

impl<'de> DeserializeSeed<'de> for SourceValueSeed {
    type Value = String;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<String, D::Error> {
        let kind = self.kind;
        deserialize_str_with(
            deserializer,
            format_args!("a string for `{}`", kind.key()),
            |raw| kind.parse_value(raw),
        )
    }
}
