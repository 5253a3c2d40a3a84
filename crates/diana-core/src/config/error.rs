//! What a refused document says: every error type of the configuration. A refusal is a
//! value ([`ConfigErrorKind`], [`PinRefusal`]) carried with the field path and position it
//! is about ([`ConfigError`]); its text is made once, by `Display`.

use super::model::Pinned;
use crate::actor::ReservedActor;
use std::fmt;

/// A document that could not be accepted: what is wrong ([`ConfigErrorKind`]), the field
/// it is about (its path in the document as written) and, for what the text holds, the
/// line and column. Displayed as one message, `[document N: ][path: ]what[ at line L column
/// C]`, e.g. `resources[0].rules[1].rpu: invalid value: integer `0`, expected a nonzero u32
/// at line 5 column 10` or `rules[0].cost: a cost of 11 could never pass: … at line 3
/// column 22`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The document of a `---` stream (from 1), when the text holds more than one.
    pub document: Option<usize>,
    /// The field path as written (`resources[0].rules[1].rpu`, `rules[0].cost`,
    /// `global.token`); empty when the refusal is about the whole text.
    pub path: String,
    /// Where the field's value is in the text; `None` when the text does not hold what is
    /// refused (an empty document, an environment variable, a signature header).
    pub position: Option<Position>,
    /// What is wrong.
    pub kind: ConfigErrorKind,
}

/// A place in the text: line and column, both from 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub line: usize,
    pub column: usize,
}

/// What is wrong with a document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigErrorKind {
    /// Not YAML (the reader's message).
    Syntax { reason: String },
    /// A value the field does not take, as the typed reader found it: a wrong type, a
    /// value out of range, an unknown name, an unknown, missing or duplicate field, a
    /// section given by two documents.
    Invalid { reason: String },
    /// A remote document writes a value the local document pins (DESIGN §6).
    Pinned { refusal: PinRefusal },
    /// No resource block at all.
    NoResources,
    /// An actor definition the registry refuses.
    Actor { reason: ReservedActor },
    /// A rule names an actor that is not defined.
    UnknownActor { actor: String },
    /// `cost.default` above `cost.max`.
    CostDefaultAboveMax { default: u32, max: u32 },
    /// A cost above what the rule could ever grant at once.
    CostNeverPasses { cost: u32, capacity: u64 },
    /// A global rule's cost above its lease (one callout must cover one request).
    CostAboveLease { cost: u32, lease: u32 },
    /// A global rule the quota service would refuse (wire-format "Bounds").
    QuotaBounds { reason: String },
    /// `response_cost` on an algorithm that cannot charge after the fact.
    ResponseCostNotApplicable { algo: &'static str },
    /// `max_wait_seconds` on an algorithm that does not hold requests.
    MaxWaitNotApplicable { algo: &'static str },
    /// `cost` and `response_cost.reserve` both given: each says what a request takes up
    /// front.
    CostWithReserve,
    /// A rule with neither `rpu` nor `max_in_flight`.
    NoLimit,
    /// A rule with both `rpu` and `max_in_flight`.
    RateAndConcurrency,
    /// A field of rate limits on a concurrency limit (`max_in_flight`).
    NotForConcurrency { field: &'static str },
    /// `count` on an algorithm whose charge cannot be given back once passed.
    CountNotApplicable { algo: &'static str },
    /// `count` and `response_cost` on one rule.
    CountWithResponseCost,
    /// `lease` on a rule that is not `scope: global`: a local rule never calls the quota
    /// service, so a lease there would mean nothing.
    LeaseNotApplicable,
    /// Two rules with the same name.
    DuplicateRuleName { name: String },
    /// Two rule names that make the same metric name
    /// ([`crate::metrics::stat_name`]).
    MetricNameClash { first: String, second: String },
    /// A request to `url` could ask one callout for more tokens than it may carry.
    TokensPerCallout { url: String, tokens: u64, most: u64 },
    /// A request to `url` could carry more global rules than one callout may.
    RulesPerCallout {
        url: String,
        rules: usize,
        most: usize,
    },
    /// A resource block with neither `rules` nor a `breaker`: it would do nothing.
    NoRulesNorBreaker,
    /// A `breaker` with neither threshold (`failure_ratio`, `slow_ms` with `slow_ratio`): it
    /// could never open.
    BreakerNoThreshold,
    /// One of `slow_ms` and `slow_ratio` without the other.
    BreakerSlowPair {
        written: &'static str,
        missing: &'static str,
    },
    /// Two breakers with the same name (given or derived from their `Url`s).
    DuplicateBreakerName { name: String },
    /// Two breaker names that make the same metric name ([`crate::metrics::stat_name`]).
    BreakerMetricNameClash { first: String, second: String },
    /// A breaker's `fallback_header` is a request header the document reads (an actor's, a
    /// plan's, a cost's): the client's own value of it is removed before the request goes on.
    FallbackHeaderInUse { header: String, read_by: String },
    /// A value read from one of several sources with none or more than one written
    /// (`response_cost`: `usage`, `json`, `header`; `reserve`: `header`, `json`).
    OneSource {
        field: &'static str,
        choices: &'static str,
        written: Vec<&'static str>,
    },
    /// `response_cost.header` without `max`.
    HeaderCostWithoutMax,
    /// `weights` on a `response_cost` that is not read from a provider's usage.
    WeightsWithoutUsage { source: &'static str },
    /// `weights: {input: 0, output: 0}`: nothing would ever be charged.
    WeightsAllZero,
    /// `reserve.json` without `default`.
    ReserveJsonWithoutDefault,
    /// `reserve.min` above `reserve.default`.
    ReserveMinAboveDefault { min: u32, default: u32 },
    /// `unit: week | month` on an algorithm without calendar periods.
    CalendarUnitNotApplicable {
        unit: &'static str,
        algo: &'static str,
    },
    /// `timezone` on a rule of a fixed unit.
    TimezoneWithoutCalendar { unit: &'static str },
    /// A value from the environment (`global.token` from [`super::TOKEN_ENV`]) refused.
    Environment {
        variable: &'static str,
        reason: String,
    },
    /// A remote document whose signature does not verify (`remote.signature`).
    Signature {
        scheme: &'static str,
        reason: String,
    },
    /// A remote document that is not UTF-8 text.
    NotUtf8 { reason: String },
}

impl ConfigError {
    /// A refusal of the whole text, or of what the text does not hold: no path, no
    /// position.
    pub fn of(kind: ConfigErrorKind) -> ConfigError {
        ConfigError {
            document: None,
            path: String::new(),
            position: None,
            kind,
        }
    }

    /// The refusal as one line (what [`fmt::Display`] writes).
    pub fn message(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = self.kind.to_string();
        if let Some(document) = self.document {
            write!(f, "document {document}: ")?;
        }
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        f.write_str(&what)?;
        match self.position {
            // Some reader messages already place themselves (`… at line 3 column 1, while
            // parsing …`).
            Some(Position { line, column }) if !what.contains(" at line ") => {
                write!(f, " at line {line} column {column}")
            }
            _ => Ok(()),
        }
    }
}

impl std::error::Error for ConfigError {}

impl fmt::Display for ConfigErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigErrorKind::Syntax { reason } => write!(f, "invalid YAML: {reason}"),
            ConfigErrorKind::Invalid { reason } => f.write_str(reason),
            ConfigErrorKind::Pinned { refusal } => refusal.fmt(f),
            ConfigErrorKind::Actor { reason } => reason.fmt(f),
            ConfigErrorKind::NoResources => f.write_str(
                "no resources: the configuration is empty; expected a block (`Url:` and `rules:`), a sequence of \
                 blocks, or a document with `resources:`",
            ),
            ConfigErrorKind::UnknownActor { actor } => write!(f, "unknown actor `{actor}`"),
            ConfigErrorKind::CostDefaultAboveMax { default, max } => {
                write!(f, "cost.default ({default}) is above cost.max ({max})")
            }
            ConfigErrorKind::CostNeverPasses { cost, capacity } => write!(
                f,
                "a cost of {cost} could never pass: the rule grants at most {capacity} at once (rpu, or burst for TB and LB)"
            ),
            ConfigErrorKind::CostAboveLease { cost, lease } => write!(
                f,
                "a cost of {cost} is above the lease ({lease}): a global rule's callout asks for `lease` tokens, \
                 which must cover one request; set `lease` to at least {cost}"
            ),
            ConfigErrorKind::QuotaBounds { reason } => write!(
                f,
                "{reason}; the quota service refuses such a global rule (a bucket may span at most a day)"
            ),
            ConfigErrorKind::ResponseCostNotApplicable { algo } => write!(
                f,
                "response_cost does not apply to algo {algo}: a leaky bucket paces requests, it does not charge them afterwards"
            ),
            ConfigErrorKind::NoLimit => f.write_str(
                "missing field `rpu`: a rule limits requests per unit (`rpu`) or requests inside at once \
                 (`max_in_flight`)",
            ),
            ConfigErrorKind::RateAndConcurrency => f.write_str(
                "rpu and max_in_flight on one rule: a rule limits either requests per unit or requests \
                 inside at once; write two rules for both",
            ),
            ConfigErrorKind::NotForConcurrency { field } => write!(
                f,
                "{field} does not apply to a concurrency limit (max_in_flight): a request holds one place \
                 from admission to its end, whatever the time"
            ),
            ConfigErrorKind::CostWithReserve => f.write_str(
                "cost and response_cost.reserve both say what a request takes up front; \
                 with a reservation, remove `cost` (the reservation is taken instead)",
            ),
            ConfigErrorKind::CountNotApplicable { algo } => write!(
                f,
                "count does not apply to algo {algo}: a leaky bucket's turn cannot be given back once it has passed"
            ),
            ConfigErrorKind::CountWithResponseCost => f.write_str(
                "count and response_cost on one rule: a rule counts either answers of some statuses \
                 or the cost an answer reports; write two rules",
            ),
            ConfigErrorKind::MaxWaitNotApplicable { algo } => write!(
                f,
                "max_wait_seconds applies to algo LB (leaky bucket) only, not to {algo}"
            ),
            ConfigErrorKind::LeaseNotApplicable => f.write_str(
                "lease applies to scope: global rules only (the tokens fetched from the quota \
                 service per callout); this rule is local: remove `lease`, or add `scope: global`",
            ),
            ConfigErrorKind::DuplicateRuleName { name } => write!(
                f,
                "duplicate rule name `{name}`: two rules would share its metrics"
            ),
            ConfigErrorKind::MetricNameClash { first, second } => write!(
                f,
                "rule names `{first}` and `{second}` are both `{}` in metric names: two rules would share their metrics",
                crate::metrics::stat_name(second)
            ),
            ConfigErrorKind::TokensPerCallout { url, tokens, most } => write!(
                f,
                "a request to {url} could ask for {tokens} tokens over its global rules (their `cost` maxima); \
                 one callout asks for at most {most}"
            ),
            ConfigErrorKind::RulesPerCallout { url, rules, most } => write!(
                f,
                "a request to {url} would carry {rules} global rules (its own and those of the resources above it); \
                 one callout carries at most {most}"
            ),
            ConfigErrorKind::NoRulesNorBreaker => f.write_str(
                "missing field `rules`: a resource block has `rules`, a `breaker`, or both",
            ),
            ConfigErrorKind::BreakerNoThreshold => f.write_str(
                "a breaker needs a threshold to open on: `failure_ratio`, or `slow_ms` with \
                 `slow_ratio`, or both",
            ),
            ConfigErrorKind::BreakerSlowPair { written, missing } => write!(
                f,
                "{written} without {missing}: slow calls open a breaker only with both (slow_ms says \
                 which call is slow, slow_ratio what share of them opens it)"
            ),
            ConfigErrorKind::DuplicateBreakerName { name } => write!(
                f,
                "duplicate breaker name `{name}`: two breakers would share their state and metrics \
                 (a breaker's name defaults to its Url; give one a `name`)"
            ),
            ConfigErrorKind::BreakerMetricNameClash { first, second } => write!(
                f,
                "breaker names `{first}` and `{second}` are both `{}` in metric names: two breakers \
                 would share their metrics (give one a `name`)",
                crate::metrics::stat_name(second)
            ),
            ConfigErrorKind::FallbackHeaderInUse { header, read_by } => write!(
                f,
                "fallback_header `{header}` is read by {read_by}: a client's own value of a fallback \
                 header is removed before the request goes on; choose a header of its own \
                 (such as x-diana-fallback)"
            ),
            ConfigErrorKind::OneSource {
                field,
                choices,
                written,
            } => match written.as_slice() {
                [] => write!(f, "{field} is read from one of {choices}; none is given"),
                written => write!(
                    f,
                    "{field} is read from one of {choices}, not from {}: keep one",
                    written.join(" and ")
                ),
            },
            ConfigErrorKind::HeaderCostWithoutMax => f.write_str(
                "missing field `max`: a cost read from a response header needs `max`, the most one \
                 answer is charged",
            ),
            ConfigErrorKind::WeightsWithoutUsage { source } => write!(
                f,
                "weights price a provider's input and output tokens: they apply with `usage` only, \
                 not with `{source}` (one number, no input or output)"
            ),
            ConfigErrorKind::WeightsAllZero => f.write_str(
                "weights of 0 for both input and output would never charge anything: give one a \
                 weight of at least 1",
            ),
            ConfigErrorKind::ReserveJsonWithoutDefault => f.write_str(
                "missing field `default`: a reservation read from the request body needs `default`, \
                 what a request without that number reserves",
            ),
            ConfigErrorKind::ReserveMinAboveDefault { min, default } => write!(
                f,
                "reserve.min ({min}) is above reserve.default ({default}): a request that says \
                 nothing would reserve less than one that says the least"
            ),
            ConfigErrorKind::CalendarUnitNotApplicable { unit, algo } => write!(
                f,
                "unit {unit} is a calendar period: it applies to algo W (the period is the window) \
                 and TB (refilled over the period), not to {algo}"
            ),
            ConfigErrorKind::TimezoneWithoutCalendar { unit } => write!(
                f,
                "timezone applies to calendar units (week, month), not to {unit}: a {unit} is \
                 the same length in every zone"
            ),
            ConfigErrorKind::Environment { variable, reason } => {
                write!(f, "from the environment variable {variable}: {reason}")
            }
            ConfigErrorKind::Signature { scheme, reason } => {
                write!(f, "remote.signature ({scheme}): {reason}")
            }
            ConfigErrorKind::NotUtf8 { reason } => write!(f, "not UTF-8: {reason}"),
        }
    }
}

/// Why a remote document was not adopted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteError {
    /// Not a valid document (the same messages as a local one).
    Invalid(ConfigError),
    /// Valid, but it changes what the local document pins, or its signature is missing or
    /// wrong (DESIGN §6).
    Refused(ConfigError),
}

impl RemoteError {
    /// The refusal of the document itself (without what kind of refusal it is).
    pub fn error(&self) -> &ConfigError {
        match self {
            RemoteError::Invalid(error) | RemoteError::Refused(error) => error,
        }
    }

    /// That refusal's message.
    pub fn message(&self) -> String {
        self.error().to_string()
    }
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoteError::Invalid(error) => write!(f, "invalid remote document: {error}"),
            RemoteError::Refused(error) => write!(f, "remote document refused: {error}"),
        }
    }
}

impl std::error::Error for RemoteError {}

/// Why a value of a remote document was refused ([`ConfigErrorKind::Pinned`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PinRefusal {
    /// A pinned value differs from the local document's, and the local `remote.allow`
    /// does not name it.
    Changed {
        value: PinnedValue,
        /// The local value as the message shows it; `None` for a secret (never shown) or
        /// where the local document has none.
        local: Option<String>,
    },
    /// `remote.allow` or `remote.signature` differs from the local document's: only the
    /// local document sets them.
    LocalOnly(LocalOnly),
}

/// A pinned value, as a refusal names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinnedValue {
    /// `global.cluster`, `global.authority` or `global.path`.
    QuotaService,
    /// `global.token`.
    QuotaCredential,
    /// `remote.cluster`, `remote.authority`, `remote.path` or `remote.poll_seconds`.
    ConfigCenter,
    /// The document-level `dry_run`.
    DryRun,
    /// `identity_key`.
    IdentityKey,
}

impl PinnedValue {
    /// The `remote.allow` entry that would let a remote document change it.
    pub fn allowed_by(self) -> Pinned {
        match self {
            PinnedValue::QuotaService | PinnedValue::QuotaCredential => Pinned::Global,
            PinnedValue::ConfigCenter => Pinned::Remote,
            PinnedValue::DryRun => Pinned::DryRun,
            PinnedValue::IdentityKey => Pinned::IdentityKey,
        }
    }

    fn described(self) -> &'static str {
        match self {
            PinnedValue::QuotaService => "where the quota service is called",
            PinnedValue::QuotaCredential => "the quota service's credential",
            PinnedValue::ConfigCenter => "where or how often the config center is polled",
            PinnedValue::DryRun => "the document-level dry run",
            PinnedValue::IdentityKey => "the identity key",
        }
    }
}

/// A field of `remote` that only the local document sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocalOnly {
    Allow,
    Signature,
}

impl LocalOnly {
    fn name(self) -> &'static str {
        match self {
            LocalOnly::Allow => "allow",
            LocalOnly::Signature => "signature",
        }
    }
}

impl fmt::Display for PinRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PinRefusal::Changed { value, local } => {
                write!(f, "a remote document may not change {}", value.described())?;
                if let Some(local) = local {
                    write!(f, " (the local document has {local})")?;
                }
                write!(
                    f,
                    "; the local document's `remote.allow: [{}]` would let it",
                    value.allowed_by().name()
                )
            }
            PinRefusal::LocalOnly(field) => write!(
                f,
                "only the local document sets remote.{}: a remote document may leave it out or repeat it unchanged",
                field.name()
            ),
        }
    }
}

impl std::error::Error for PinRefusal {}
