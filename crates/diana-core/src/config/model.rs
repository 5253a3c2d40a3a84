//! The validated, immutable plan that the engine evaluates. Every default is resolved
//! here, so nothing downstream interprets the document again.

use crate::actor::{ActorSource, Identity};
use crate::algo::{Algorithm, Limit};
use crate::calendar::{Calendar, CalendarUnit, Zone};
use crate::facts::RequestFacts;
use crate::hash::{IdentityHasher, IdentityKey, KeyOrigin};
use crate::jwt::{Claim, ClaimOrigin};
use crate::secret::Secret;
use crate::signature::SignatureKey;
use crate::store::Generation;
use crate::time::{Nanos, Unit};
use crate::usage::{JsonPath, Usage, UsageSource, Weights};
use std::fmt;
use std::num::{NonZeroU32, NonZeroU8};
use std::sync::Arc;

/// The whole validated configuration.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Every rule in [`Rule::index`] order is `resources[..].rules[..]` flattened.
    /// Resource blocks, least specific first (fewer path segments first), so the engine
    /// evaluates `/` before `/sample` by walking this list in order.
    pub resources: Vec<Resource>,
    pub response: ResponseSpec,
    pub global: GlobalSpec,
    pub remote: Option<RemoteSpec>,
    /// Where the filter answers with its metrics (nginx has no `/stats`).
    pub metrics: Option<MetricsSpec>,
    /// Document-level dry run: count and report, never reject.
    pub dry_run: bool,
    /// What requests get where the host cannot run without a valid configuration (nginx).
    pub on_invalid_config: OnInvalidConfig,
}

/// `on_invalid_config`: what a worker does with requests when it has no usable
/// configuration, on a host where refusing the document would stop the worker (nginx: a
/// refused document, or no `shm_kv` zone). Read from a refused document leniently, so a
/// typo elsewhere does not hide it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnInvalidConfig {
    /// Answer 503 at once (fail closed).
    #[default]
    Deny,
    /// Let requests through unlimited (fail open).
    Allow,
}

impl OnInvalidConfig {
    pub const ALL: [OnInvalidConfig; 2] = [OnInvalidConfig::Deny, OnInvalidConfig::Allow];

    pub fn name(self) -> &'static str {
        match self {
            OnInvalidConfig::Deny => "deny",
            OnInvalidConfig::Allow => "allow",
        }
    }
}

impl Policy {
    /// Every breaker, in [`crate::breaker::Spec::index`] order.
    pub fn breakers(&self) -> impl Iterator<Item = &crate::breaker::Spec> {
        self.resources
            .iter()
            .filter_map(|resource| resource.breaker.as_ref())
    }

    /// Every rule, in [`Rule::index`] order.
    pub fn rules(&self) -> impl Iterator<Item = &Rule> {
        self.resources
            .iter()
            .flat_map(|resource| resource.rules.iter())
    }

    /// A breaker of `scope: global`: the worker reports to the quota service every
    /// [`crate::breaker::FLEET_REPORT_EVERY`].
    pub fn has_fleet_breakers(&self) -> bool {
        self.breakers()
            .any(|spec| spec.settings.reach == crate::breaker::Reach::Fleet)
    }

    /// A rule holds places at the quota service (`max_in_flight` with `scope: global`):
    /// each is given back from a worker's tick after its request ends.
    pub fn holds_global_places(&self) -> bool {
        self.rules()
            .any(|rule| rule.scope == Scope::Global && rule.algo.holds_until_done())
    }

    /// Who reads a claim from the request's `authorization` header, which Diana does not
    /// verify: each such actor once (`actor user`), each rule whose plan does (`the plan
    /// of rule api`), in document order.
    pub fn header_claims(&self) -> Vec<String> {
        let mut found: Vec<String> = Vec::new();
        for rule in self.rules() {
            let source = rule.actor_source();
            let reads_header = source.contains(&("source", "jwt_claim"))
                && !source.iter().any(|(key, _)| *key == "from");
            let actor = format!("actor `{}`", rule.actor_name);
            if reads_header && !found.contains(&actor) {
                found.push(actor);
            }
            if let Some(choice) = rule.plan.as_ref().filter(|c| c.by.header_claim().is_some()) {
                let base = rule
                    .name
                    .strip_suffix(choice.name())
                    .and_then(|name| name.strip_suffix('.'))
                    .unwrap_or(&rule.name);
                let plan = format!("the plan of rule `{base}`");
                if !found.contains(&plan) {
                    found.push(plan);
                }
            }
        }
        found
    }

    /// A rule reads the request's body (`response_cost.reserve.json`): only then does a
    /// host need to see it.
    pub fn reads_request_bodies(&self) -> bool {
        self.rules().any(|rule| rule.request_body_path().is_some())
    }

    /// A rule reads the answer's body (`response_cost.usage` or `.json`): only then does a
    /// host need to see it.
    pub fn reads_response_bodies(&self) -> bool {
        self.rules()
            .any(|rule| rule.response_body_source().is_some())
    }

    /// The rules that read a request's body (`reserve.json`), by name: on a host that
    /// cannot hold a request for its body (proxy-wasm: Envoy's wasm filter, nginx) they
    /// reserve `reserve.default`, so the filter there and `diana check` say so at load
    /// ([`body_warning`]).
    pub fn body_readers(&self) -> Vec<&str> {
        self.rules()
            .filter(|rule| rule.request_body_path().is_some())
            .map(|rule| rule.name.as_str())
            .collect()
    }

    /// The rule at `index`.
    pub fn rule(&self, index: usize) -> Option<&Rule> {
        self.rules().nth(index)
    }

    /// The identity key the document sets (`identity_key`, derived), `None` without one.
    /// Every rule carries the hasher of its scope ([`Rule::identity`]); this reads it back.
    pub fn identity_key(&self) -> Option<IdentityKey> {
        self.rules()
            .next()
            .filter(|rule| rule.identity.origin() == KeyOrigin::Configured)
            .map(|rule| rule.identity.key())
    }

    /// Keys every rule's identities with `key` (the document's `identity_key`, or the local
    /// document's pinned on a remote one), or without one: global rules with the public
    /// key (gateways must agree), local rules unbound until the process key is bound
    /// ([`Policy::bind_process_key`]).
    pub fn set_identity_key(&mut self, key: Option<IdentityKey>) {
        for rule in self.rules_mut() {
            rule.identity = match (key, rule.scope) {
                (Some(key), _) => IdentityHasher::new(key, KeyOrigin::Configured),
                (None, Scope::Global) => IdentityHasher::public(),
                (None, Scope::Local) => IdentityHasher::unbound(),
            };
        }
    }

    /// True when a local rule waits for the process's key (the document sets no
    /// `identity_key`).
    pub fn needs_process_key(&self) -> bool {
        self.rules()
            .any(|rule| rule.identity.origin() == KeyOrigin::Unbound)
    }

    /// Keys the local rules of a document without `identity_key` with the process's random
    /// key (`store::identity`); rules keyed otherwise are left alone.
    pub fn bind_process_key(&mut self, key: IdentityKey) {
        for rule in self.rules_mut() {
            if matches!(
                rule.identity.origin(),
                KeyOrigin::Unbound | KeyOrigin::Process
            ) {
                rule.identity = IdentityHasher::process(key);
            }
        }
    }

    fn rules_mut(&mut self) -> impl Iterator<Item = &mut Rule> {
        self.resources
            .iter_mut()
            .flat_map(|resource| resource.rules.iter_mut())
    }
}

/// One `Url` block.
#[derive(Debug, Clone)]
pub struct Resource {
    /// Normalised path prefix, always starting with `/`, no trailing `/` except for the root.
    pub url: String,
    pub rules: Vec<Rule>,
    /// The circuit breaker of the upstream behind it (DESIGN §4b).
    pub breaker: Option<crate::breaker::Spec>,
    /// How a request path is compared with `url` (`path:`; issue 41, item 6).
    pub path: PathOptions,
}

/// `path: {strip_parameters, case_insensitive}`: how a block's `Url` is compared with a
/// request path, for a backend that reads paths more loosely than their spelling
/// ([`crate::matching`]). Both off by default: the path as normalised, exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PathOptions {
    /// Segments' parameters ignored: `/admin;jsessionid=1/x` is under `/admin`, and
    /// `/public/..;/admin` is `/admin` (as a servlet container reads them).
    pub strip_parameters: bool,
    /// ASCII letters compared without regard to case: `/ADMIN/x` is under `/admin`.
    pub case_insensitive: bool,
}

/// One rule with every default resolved, and what evaluating it needs precomputed.
#[derive(Clone)]
pub struct Rule {
    /// Position among all the policy's rules, resources in evaluation order (the index
    /// metrics are reported under).
    pub index: usize,
    /// `name` from the document, or `<url>#<index>` (index within its block, from 0).
    pub name: String,
    /// The name as it appears in metric names ([`crate::metrics::stat_name`]), unique.
    pub metric_name: String,
    /// Stable identity of the rule's counters: a hash of the resource url and every
    /// parameter that shapes the counter (actor, algorithm, limit, scope, slots). A reloaded
    /// document whose rule has the same id keeps that rule's state.
    pub id: u64,
    /// Actor name as written (`all`, `account`, `device`, `ip`, or a user-defined name).
    pub actor_name: String,
    /// Where the identity for this rule comes from.
    pub actor: Arc<dyn ActorSource>,
    /// The actor's source in canonical form (`all`, `ip`, `header=x-device-id;fallback=ip`;
    /// part of [`Rule::id`]); read it with [`Rule::actor_source`].
    pub actor_spec: String,
    /// The keyed hash of this rule's identities (DESIGN §6): the document's
    /// `identity_key`, else the process's random key (local) or the public key (global).
    /// Set through [`Policy::set_identity_key`] and [`Policy::bind_process_key`].
    pub identity: IdentityHasher,
    pub algo: &'static dyn Algorithm,
    pub limit: Limit,
    pub scope: Scope,
    /// Size of the local slot table (1 for actors that have a single counter, like `all`).
    pub slots: NonZeroU32,
    /// Tokens fetched per global callout (global scope only; 1 = exact). With
    /// `lease: auto`, the most a callout asks for (see [`Lease`]).
    pub lease: NonZeroU32,
    /// `lease: auto`: each callout asks for what this gateway spends in
    /// [`AUTO_LEASE_SPAN`], at most [`Rule::lease`].
    pub lease_auto: bool,
    /// Tokens a request takes.
    pub cost: Cost,
    /// Tokens charged after the upstream answered: from a response header, or from the
    /// answer's body (an LLM provider's usage, a number at a JSON path).
    pub response_cost: Option<ResponseCost>,
    /// `hot`: where the gateway keeps this rule's hottest identities for the fleet view.
    pub hot: Option<HotSpec>,
    /// Only answers of these statuses are counted (`count.status`).
    pub count: Option<CountOnly>,
    /// Leaky bucket: the longest a request may be held; one whose turn is further away is
    /// rejected with `Retry-After` (`max_wait_seconds`, default 10 s).
    pub max_wait: Nanos,
    /// Rule-level dry run (the document-level flag is in [`Policy::dry_run`]).
    pub dry_run: bool,
    /// Where the rule's state lives in shared data.
    pub keys: RuleKeys,
    /// One plan of a rule written with `rpu: {by, values, default}`: the document's rule
    /// is one [`Rule`] per plan (and one for every other value), each with its own limit,
    /// counters and metrics, and a request is charged by the one its plan selects.
    pub plan: Option<PlanChoice>,
}

/// The most plans one rule may have: each is a counter table and a metric of its own.
pub const MAX_PLANS: usize = 32;

/// The longest `global.timeout_ms`: a minute. A request waits for its callout that long at
/// most; beyond it the bound is the gateway's own route timeout, not Diana's.
pub const MAX_TIMEOUT_MS: u64 = 60_000;

/// The longest `global.retry_seconds`: an hour. Without a bound a document (a remote one
/// included, unless signed) could keep every global rule local, N gateways each admitting
/// the whole limit, for a century after one failed call.
pub const MAX_RETRY_SECONDS: u64 = 3_600;
/// The longest plan name.
pub const MAX_PLAN_NAME: usize = 64;

/// Which requests one plan of a rule applies to (see [`Rule::plan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanChoice {
    /// Where a request's plan is read.
    pub by: PlanSource,
    /// The plan this rule counts.
    pub plan: PlanName,
}

/// Where a request's plan is read (`rpu.by`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanSource {
    /// A request header's value.
    Header(String),
    /// A claim: of the bearer token, unverified, or of the payload jwt_authn verified (as
    /// for a `jwt_claim` actor).
    JwtClaim(Claim),
}

impl PlanSource {
    /// The request's plan as sent (surrounding spaces trimmed); `None` when absent (and
    /// when it is read from metadata this host does not have: `diana check-nginx` says
    /// so).
    pub fn read(&self, facts: &dyn RequestFacts) -> Option<Vec<u8>> {
        let value = match self {
            PlanSource::Header(name) => facts.header(name),
            PlanSource::JwtClaim(claim) => claim.read(facts).ok().flatten(),
        }?;
        Some(value.trim_ascii().to_vec())
    }

    /// As `diana check` shows it: `header x-plan`, `jwt_claim /plan`, `jwt_claim /plan
    /// from jwt_authn:NAME`.
    pub fn describe(&self) -> String {
        match self {
            PlanSource::Header(name) => format!("header {name}"),
            PlanSource::JwtClaim(claim) => format!("jwt_claim {}", claim.describe()),
        }
    }

    /// The claim it reads from the `authorization` header, if it does (unverified).
    pub fn header_claim(&self) -> Option<&Claim> {
        match self {
            PlanSource::JwtClaim(claim) if claim.origin() == &ClaimOrigin::Bearer => Some(claim),
            _ => None,
        }
    }

    /// The claim it reads from jwt_authn's metadata, if it does (hosts without metadata
    /// cannot).
    pub fn metadata_claim(&self) -> Option<&Claim> {
        match self {
            PlanSource::JwtClaim(claim) if claim.origin() != &ClaimOrigin::Bearer => Some(claim),
            _ => None,
        }
    }
}

/// One plan of a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlanName {
    /// Requests whose plan is exactly this value.
    Named(String),
    /// Requests without a plan, or with a value that names none of these plans.
    Default { named: Arc<[String]> },
}

impl PlanChoice {
    /// True when a request whose plan reads `value` is counted by this plan.
    pub fn selects(&self, value: Option<&[u8]>) -> bool {
        match (&self.plan, value) {
            (PlanName::Named(name), Some(value)) => name.as_bytes() == value,
            (PlanName::Named(_), None) => false,
            (PlanName::Default { named }, Some(value)) => {
                !named.iter().any(|name| name.as_bytes() == value)
            }
            (PlanName::Default { .. }, None) => true,
        }
    }

    /// The plan's name as in metric and rule names: the value, or `default`.
    pub fn name(&self) -> &str {
        match &self.plan {
            PlanName::Named(name) => name,
            PlanName::Default { .. } => "default",
        }
    }
}

/// `lease: auto` sizes a callout's lease to what the gateway spends in this long.
pub const AUTO_LEASE_SPAN: Nanos = Nanos::from_millis(100);
/// `lease: auto` keeps each gateway's lease within this share of the rule's capacity (the
/// accuracy budget: with G gateways the global count may be off by G × this share).
pub const AUTO_LEASE_SHARE: u64 = 100;

/// A lease as written: a size, or `auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lease {
    Fixed(NonZeroU32),
    Auto,
}

/// How many tokens a request takes from a rule (`cost`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    /// The same for every request (default 1).
    Fixed(NonZeroU32),
    /// From a request header: its value if it is a decimal integer ≥ 1, `default` when it
    /// is missing or not one, `max` when it is above `max`.
    Header {
        name: String,
        default: NonZeroU32,
        max: NonZeroU32,
    },
}

impl Cost {
    /// The cost of a request.
    pub fn of(&self, facts: &dyn RequestFacts) -> u32 {
        match self {
            Cost::Fixed(cost) => cost.get(),
            Cost::Header { name, default, max } => facts
                .header(name)
                .and_then(|value| decimal(&value))
                .and_then(|value| u32::try_from(value.min(u64::from(max.get()))).ok())
                .and_then(NonZeroU32::new)
                .unwrap_or(*default)
                .get(),
        }
    }

    /// The most a request can take.
    pub fn max(&self) -> u32 {
        match self {
            Cost::Fixed(cost) => cost.get(),
            Cost::Header { max, .. } => max.get(),
        }
    }
}

/// `response_cost`: tokens charged after the upstream answered, even past the limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseCost {
    /// Where the answer's cost is read.
    pub source: CostSource,
    /// The most one answer is charged (`max`; for a body source [`MAX_RESPONSE_COST`]
    /// unless written).
    pub max: NonZeroU32,
    /// `reserve`: tokens taken up front instead of `cost`, all or nothing, and settled
    /// against the answer's cost (the difference given back or owed). A request whose
    /// answer never comes, or carries no cost, keeps its reservation charged.
    pub reserve: Option<Reserve>,
}

/// The most a body source charges one answer when `max` is not written (and the most
/// `max` may be).
pub const MAX_RESPONSE_COST: u32 = 1_000_000_000;

/// Where an answer's cost is read (`response_cost.header | usage | json`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CostSource {
    /// A response header holding a decimal integer (`header: x-llm-tokens`).
    Header(String),
    /// An LLM provider's usage object, from a JSON answer or its server-sent events
    /// ([`crate::usage`]); priced by `weights` when written, else the provider's total
    /// (or input + output).
    Usage {
        provider: Provider,
        weights: Option<Weights>,
    },
    /// The number at a dotted path of a JSON answer (of the last event of a stream that
    /// has it).
    Json(JsonPath),
}

impl CostSource {
    /// The key that names it in the document.
    pub fn key(&self) -> &'static str {
        match self {
            CostSource::Header(_) => "header",
            CostSource::Usage { .. } => "usage",
            CostSource::Json(_) => "json",
        }
    }
}

/// `response_cost.usage`: whose usage object an answer carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    OpenAi,
    Anthropic,
    Gemini,
}

impl Provider {
    pub const ALL: [Provider; 3] = [Provider::OpenAi, Provider::Anthropic, Provider::Gemini];

    /// The spelling in the document.
    pub fn name(self) -> &'static str {
        match self {
            Provider::OpenAi => "openai",
            Provider::Anthropic => "anthropic",
            Provider::Gemini => "gemini",
        }
    }

    /// What [`crate::usage::UsageReader`] reads for it.
    pub fn usage_source(self) -> UsageSource {
        match self {
            Provider::OpenAi => UsageSource::OpenAi,
            Provider::Anthropic => UsageSource::Anthropic,
            Provider::Gemini => UsageSource::Gemini,
        }
    }
}

impl ResponseCost {
    /// The tokens a response header value says the answer cost (a [`CostSource::Header`]):
    /// a decimal integer, at most `max`; `None` for anything else (absent, not a number).
    pub fn of(&self, value: Option<&[u8]>) -> Option<u32> {
        value.and_then(decimal).map(|value| self.capped(value))
    }

    /// The response header the cost is read from, for a [`CostSource::Header`].
    pub fn header(&self) -> Option<&str> {
        match &self.source {
            CostSource::Header(name) => Some(name),
            CostSource::Usage { .. } | CostSource::Json(_) => None,
        }
    }

    /// What reads the answer's body, for a body source (`usage`, `json`): a rule without
    /// one never needs the body.
    pub fn body_source(&self) -> Option<UsageSource> {
        match &self.source {
            CostSource::Header(_) => None,
            CostSource::Usage { provider, .. } => Some(provider.usage_source()),
            CostSource::Json(path) => Some(UsageSource::JsonPath(path.clone())),
        }
    }

    /// The tokens an answer whose body reported `usage` cost: `input × w_in + output ×
    /// w_out` with `weights`, else the reported total (input + output without one), at
    /// most `max`.
    pub fn charge(&self, usage: &Usage) -> u32 {
        let cost = match &self.source {
            CostSource::Usage {
                weights: Some(weights),
                ..
            } => weights.cost(usage),
            _ => usage.tokens(),
        };
        self.capped(cost)
    }

    fn capped(&self, cost: u64) -> u32 {
        u32::try_from(cost.min(u64::from(self.max.get()))).unwrap_or(self.max.get())
    }
}

/// `response_cost.reserve`: what a request takes up front and holds until its answer's
/// cost settles it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reserve {
    /// The same for every request.
    Fixed(NonZeroU32),
    /// From a request header: a decimal integer within `bounds`, `default` when it is
    /// missing or not one.
    Header { name: String, bounds: ReserveBounds },
    /// From the request body (JSON) at `path` (`max_tokens`): within `bounds`, `default`
    /// when the body has no number there, or was not read (a host that cannot hold a
    /// request for its body: [`crate::worker::HostProfile::holds_requests_for_bodies`]).
    /// The worker reads it ([`crate::usage::RequestReader`]) and hands it over as
    /// [`RequestFacts::body_number`].
    Json {
        path: JsonPath,
        bounds: ReserveBounds,
    },
}

impl Reserve {
    /// The reservation of a request, from its headers.
    pub fn of(&self, facts: &dyn RequestFacts) -> u32 {
        match self {
            Reserve::Fixed(tokens) => tokens.get(),
            Reserve::Header { name, bounds } => {
                bounds.of(facts.header(name).and_then(|value| decimal(&value)))
            }
            Reserve::Json { path, bounds } => bounds.of(facts.body_number(path)),
        }
    }

    /// The most a request may reserve.
    pub fn max(&self) -> u32 {
        match self {
            Reserve::Fixed(tokens) => tokens.get(),
            Reserve::Header { bounds, .. } | Reserve::Json { bounds, .. } => bounds.max().get(),
        }
    }

    /// The request body's path it is read from, for [`Reserve::Json`].
    pub fn body_path(&self) -> Option<&JsonPath> {
        match self {
            Reserve::Json { path, .. } => Some(path),
            Reserve::Fixed(_) | Reserve::Header { .. } => None,
        }
    }
}

/// What a reservation read from a request may be: `min ≤ default ≤ max` (issue 41, 5d:
/// the value is the client's choice, so it cannot go below `min`, by default `default`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReserveBounds {
    default: NonZeroU32,
    min: NonZeroU32,
    max: NonZeroU32,
}

/// Why reservation bounds are refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoundsError {
    DefaultAboveMax,
    MinAboveDefault,
}

impl ReserveBounds {
    /// `min` defaults to `default`.
    pub fn new(
        default: NonZeroU32,
        min: Option<NonZeroU32>,
        max: NonZeroU32,
    ) -> Result<ReserveBounds, BoundsError> {
        let min = min.unwrap_or(default);
        if default > max {
            return Err(BoundsError::DefaultAboveMax);
        }
        if min > default {
            return Err(BoundsError::MinAboveDefault);
        }
        Ok(ReserveBounds { default, min, max })
    }

    pub fn default(&self) -> NonZeroU32 {
        self.default
    }

    pub fn min(&self) -> NonZeroU32 {
        self.min
    }

    pub fn max(&self) -> NonZeroU32 {
        self.max
    }

    /// The reservation for a value read from the request: `default` without one, else
    /// the value within `min..=max`.
    pub fn of(&self, value: Option<u64>) -> u32 {
        match value {
            None => self.default.get(),
            Some(value) => {
                let value = value.clamp(u64::from(self.min.get()), u64::from(self.max.get()));
                u32::try_from(value).unwrap_or(self.max.get())
            }
        }
    }
}

/// What a request takes up front from a rule: its `cost`, or its reservation.
#[derive(Debug, Clone, Copy)]
pub enum Upfront<'r> {
    Cost(&'r Cost),
    Reserve(&'r Reserve),
}

impl Upfront<'_> {
    /// What a request takes, from its headers (a reservation read from the body: its
    /// `default`, see [`Reserve::Json`]).
    pub fn of(&self, facts: &dyn RequestFacts) -> u32 {
        match self {
            Upfront::Cost(cost) => cost.of(facts),
            Upfront::Reserve(reserve) => reserve.of(facts),
        }
    }

    /// The most a request can take.
    pub fn max(&self) -> u32 {
        match self {
            Upfront::Cost(cost) => cost.max(),
            Upfront::Reserve(reserve) => reserve.max(),
        }
    }

    /// The request header it is read from, if it is.
    pub fn header(&self) -> Option<&str> {
        match self {
            Upfront::Cost(Cost::Header { name, .. })
            | Upfront::Reserve(Reserve::Header { name, .. }) => Some(name),
            _ => None,
        }
    }
}

/// The algorithms a calendar period (`unit: week | month`) applies to: a fixed window (the
/// period is the window) and a token bucket (refilled over the period). A sliding window's
/// slices and a leaky bucket's pace have no calendar meaning.
pub const CALENDAR_ALGORITHMS: [&str; 2] = ["W", "TB"];

/// `unit` as written: a fixed unit, or a calendar period (`week`, `month`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleUnit {
    Fixed(Unit),
    Calendar(CalendarUnit),
}

impl RuleUnit {
    /// Every unit, fixed ones first, as the document names them.
    pub const ALL: [RuleUnit; 6] = [
        RuleUnit::Fixed(Unit::Second),
        RuleUnit::Fixed(Unit::Minute),
        RuleUnit::Fixed(Unit::Hour),
        RuleUnit::Fixed(Unit::Day),
        RuleUnit::Calendar(CalendarUnit::Week),
        RuleUnit::Calendar(CalendarUnit::Month),
    ];

    pub fn name(self) -> &'static str {
        match self {
            RuleUnit::Fixed(unit) => unit.name(),
            RuleUnit::Calendar(unit) => unit.name(),
        }
    }

    /// A limit's [`Limit::unit`] and [`Limit::calendar`] for this unit (a calendar's in
    /// `zone`): a calendar period's `unit` is the longest fixed one, which nothing reads as
    /// its period.
    pub fn limit_unit(self, zone: Zone) -> (Unit, Option<Calendar>) {
        match self {
            RuleUnit::Fixed(unit) => (unit, None),
            RuleUnit::Calendar(period) => (Unit::Day, Some(Calendar::new(period, zone))),
        }
    }

    /// `second`, `minute`, `hour`, `day`, `week`, `month` (case-insensitive; a trailing
    /// `s` is accepted).
    pub fn parse(text: &str) -> Option<RuleUnit> {
        let lower = text.trim().to_ascii_lowercase();
        let word = lower.strip_suffix('s').unwrap_or(&lower);
        RuleUnit::ALL.into_iter().find(|unit| unit.name() == word)
    }
}

/// `hot: {show, top}`: the rule's hottest identities, kept by the gateway for the fleet
/// view (issue 43).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HotSpec {
    /// How an identity is shown.
    pub show: HotShow,
    /// How many identities are listed (1 to [`MAX_HOT_TOP`], default [`DEFAULT_HOT_TOP`]).
    pub top: NonZeroU8,
}

/// The most identities `hot.top` lists.
pub const MAX_HOT_TOP: u8 = 100;
/// `hot.top` when the document does not say.
pub const DEFAULT_HOT_TOP: NonZeroU8 = match NonZeroU8::new(10) {
    Some(top) => top,
    None => NonZeroU8::MIN,
};

/// `hot.show`: an identity as its value (truncated to 64 bytes) or as a keyed digest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HotShow {
    #[default]
    Value,
    /// A keyed digest instead of the value (privacy).
    Digest,
}

impl HotShow {
    pub const ALL: [HotShow; 2] = [HotShow::Value, HotShow::Digest];

    pub fn name(self) -> &'static str {
        match self {
            HotShow::Value => "value",
            HotShow::Digest => "digest",
        }
    }
}

/// `count: {status: [401, 403, 5xx]}`: the rule counts only the requests whose answer has
/// one of these statuses. Each request reserves its cost up front (so that concurrent
/// requests cannot all pass on the last token) and gets it back when its answer's status
/// is not counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CountOnly {
    /// Inclusive ranges, in the order written (`401` is `401..=401`, `4xx` `400..=499`).
    pub statuses: Vec<(u16, u16)>,
}

impl CountOnly {
    /// True when an answer whose `:status` reads `value` is counted; an unreadable status
    /// is counted (a request keeps its reservation when nothing says otherwise).
    pub fn counts(&self, value: Option<&[u8]>) -> bool {
        let Some(status) = value
            .and_then(decimal)
            .and_then(|status| u16::try_from(status).ok())
        else {
            return true;
        };
        self.statuses
            .iter()
            .any(|&(first, last)| (first..=last).contains(&status))
    }

    /// As written: `401`, `4xx`.
    pub fn describe(&self) -> Vec<String> {
        self.statuses
            .iter()
            .map(|&(first, last)| {
                if first == last {
                    first.to_string()
                } else {
                    format!("{}xx", first / 100)
                }
            })
            .collect()
    }
}

/// A header value as a decimal integer (surrounding spaces allowed, nothing else; one
/// too large for `u64` reads as `u64::MAX`); `None` for anything else.
pub fn decimal(value: &[u8]) -> Option<u64> {
    let digits = value.trim_ascii();
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(digits.iter().fold(0u64, |sum, digit| {
        sum.saturating_mul(10)
            .saturating_add(u64::from(digit - b'0'))
    }))
}

/// Where a rule's state lives in shared data. The key names come from the rule's *table*,
/// which an edit of its limit leaves alone (its url, actor, scope, slots and name, or its
/// place among the block's rules of the same actor): a document that only tunes `rpu`,
/// `unit`, `burst` or the algorithm writes the same keys again, so a config center that
/// keeps changing limits cannot grow a host that never frees a key name (Envoy). Each
/// record is sealed with its rule's *generation* (the rule id): a record written under
/// other parameters reads as free, never as this rule's state. Computed once at load, so
/// evaluating a request builds no key prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleKeys {
    /// `diana/<table>/`: the rule's slot table (scope local, and global rules degraded).
    pub slots: String,
    /// `diana/lease/<table>/`: the lease stash of a global rule.
    pub leases: String,
    /// The table's id (what the lifecycle releases when no rule uses it any more).
    pub table: u64,
    /// What the records of this rule are sealed with: [`Rule::id`].
    pub generation: Generation,
}

impl RuleKeys {
    pub fn of(table: u64, generation: Generation) -> RuleKeys {
        RuleKeys {
            slots: format!("diana/{table:016x}/"),
            leases: format!("diana/lease/{table:016x}/"),
            table,
            generation,
        }
    }
}

impl Rule {
    /// What a request takes up front: its `response_cost.reserve` when the rule reserves,
    /// else its `cost`.
    pub fn upfront(&self) -> Upfront<'_> {
        match self
            .response_cost
            .as_ref()
            .and_then(|response_cost| response_cost.reserve.as_ref())
        {
            Some(reserve) => Upfront::Reserve(reserve),
            None => Upfront::Cost(&self.cost),
        }
    }

    /// The path of the request body its reservation is read from (`reserve.json`): a rule
    /// without one never needs the request's body.
    pub fn request_body_path(&self) -> Option<&JsonPath> {
        self.response_cost
            .as_ref()
            .and_then(|response_cost| response_cost.reserve.as_ref())
            .and_then(Reserve::body_path)
    }

    /// What reads the answer's body (`response_cost.usage` or `.json`): a rule without
    /// one never needs the answer's body.
    pub fn response_body_source(&self) -> Option<UsageSource> {
        self.response_cost
            .as_ref()
            .and_then(ResponseCost::body_source)
    }

    /// True when what a request takes up front is settled once its answer arrives
    /// (`response_cost.reserve`, `count.status`): given back in part or whole, or more
    /// owed.
    pub fn settles(&self) -> bool {
        self.count.is_some()
            || self
                .response_cost
                .as_ref()
                .is_some_and(|response_cost| response_cost.reserve.is_some())
    }

    /// The response header read once the upstream answered: the cost's, or `:status`.
    /// `None` for a cost read from the answer's body ([`Rule::response_body_source`]).
    pub fn answer_header(&self) -> Option<&str> {
        match (&self.response_cost, &self.count) {
            (Some(response_cost), _) => response_cost.header(),
            (None, Some(_)) => Some(":status"),
            (None, None) => None,
        }
    }

    /// The identity a request is charged to under this rule, hashed with its key.
    pub fn identify(&self, facts: &dyn RequestFacts) -> Identity {
        self.actor.identify(facts, &self.identity)
    }

    /// [`Rule::identify`], keeping the value the identity was read from in `shown` (the
    /// fleet view's hot lists).
    pub fn identify_shown(
        &self,
        facts: &dyn RequestFacts,
        shown: &mut Option<Vec<u8>>,
    ) -> Identity {
        self.actor.identify_shown(facts, &self.identity, shown)
    }

    /// Where this rule's identities come from, as `(key, value)` pairs in the order the
    /// source defines them: `[("source", "all")]`, `[("source", "ip")]`, `[("source",
    /// "header"), ("header", "x-device-id"), ("fallback", "ip")]`.
    pub fn actor_source(&self) -> Vec<(&str, &str)> {
        let mut settings = Vec::new();
        for (index, part) in self.actor_spec.split(';').enumerate() {
            match part.split_once('=') {
                Some((key, value)) => {
                    if index == 0 {
                        settings.push(("source", key));
                    }
                    settings.push((key, value));
                }
                None => settings.push(("source", part)),
            }
        }
        settings
    }

    /// A global rule asking the service for exactly each request's own tokens (`lease: 1`):
    /// every admission is the service's, so the gateway keeps nothing that could make its
    /// count differ from the service's.
    pub fn exact_lease(&self) -> bool {
        self.lease.get() == 1 && !self.lease_auto
    }
}

impl fmt::Debug for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rule")
            .field("name", &self.name)
            .field("id", &format_args!("{:016x}", self.id))
            .field("actor", &self.actor_name)
            .field("actor_spec", &self.actor_spec)
            .field("algo", &self.algo.code())
            .field("limit", &self.limit)
            .field("scope", &self.scope)
            .field("slots", &self.slots)
            .field("lease", &self.lease)
            .field("lease_auto", &self.lease_auto)
            .field("cost", &self.cost)
            .field("response_cost", &self.response_cost)
            .field("hot", &self.hot)
            .field("count", &self.count)
            .field("max_wait", &self.max_wait)
            .field("dry_run", &self.dry_run)
            .field("plan", &self.plan)
            .finish()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    Local,
    Global,
}

impl Scope {
    pub const ALL: [Scope; 2] = [Scope::Local, Scope::Global];

    pub fn name(self) -> &'static str {
        match self {
            Scope::Local => "local",
            Scope::Global => "global",
        }
    }
}

/// When a response carries rate-limit headers (which ones: [`HeaderStyle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderMode {
    /// No rate-limit headers (`Retry-After` is still sent on rejection).
    None,
    /// Rate-limit headers on rejected responses only.
    Limited,
    /// Rate-limit headers on every response that a rule evaluated, admitted ones included.
    All,
}

impl HeaderMode {
    pub const ALL: [HeaderMode; 3] = [HeaderMode::None, HeaderMode::Limited, HeaderMode::All];

    /// The spelling in the document.
    pub fn name(self) -> &'static str {
        match self {
            HeaderMode::None => "none",
            HeaderMode::Limited => "limited",
            HeaderMode::All => "all",
        }
    }
}

/// Which rate-limit header fields a response carries (`response.header_style`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderStyle {
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset` (the default).
    XRateLimit,
    /// `RateLimit-Policy` and `RateLimit` of draft-ietf-httpapi-ratelimit-headers-10,
    /// structured fields named after the rule.
    Ietf,
    /// Both sets.
    Both,
}

impl HeaderStyle {
    pub const ALL: [HeaderStyle; 3] = [
        HeaderStyle::XRateLimit,
        HeaderStyle::Ietf,
        HeaderStyle::Both,
    ];

    /// The spelling in the document.
    pub fn name(self) -> &'static str {
        match self {
            HeaderStyle::XRateLimit => "x-ratelimit",
            HeaderStyle::Ietf => "ietf",
            HeaderStyle::Both => "both",
        }
    }

    /// Sends `X-RateLimit-*`.
    pub fn x_ratelimit(self) -> bool {
        self != HeaderStyle::Ietf
    }

    /// Sends `RateLimit-Policy` and `RateLimit`.
    pub fn ietf(self) -> bool {
        self != HeaderStyle::XRateLimit
    }
}

/// `response:` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseSpec {
    /// Default 503.
    pub status: u16,
    /// Default `"rate limited\n"`.
    pub body: String,
    /// Default [`HeaderMode::Limited`].
    pub headers: HeaderMode,
    /// Default [`HeaderStyle::XRateLimit`].
    pub header_style: HeaderStyle,
}

impl Default for ResponseSpec {
    fn default() -> Self {
        ResponseSpec {
            status: 503,
            body: "rate limited\n".to_string(),
            headers: HeaderMode::Limited,
            header_style: HeaderStyle::XRateLimit,
        }
    }
}

/// `global:` section (quota service callouts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlobalSpec {
    /// Envoy cluster name, or `host:port` on nginx. Default `diana_quota`.
    pub cluster: String,
    /// Default `diana-quota`.
    pub authority: String,
    /// Default `/v1/acquire`.
    pub path: String,
    /// Default 50, at most [`MAX_TIMEOUT_MS`].
    pub timeout_ms: u32,
    /// Default 1.
    pub lease: Lease,
    /// Circuit breaker: after a failure stay local this long, then probe. Default 5, at
    /// most [`MAX_RETRY_SECONDS`].
    pub retry_seconds: u32,
    /// The quota service's credential, sent as `authorization: Bearer …` on every call.
    /// None: calls carry no credential (a service started with `--insecure-no-auth`).
    pub token: Option<Secret>,
    /// The document writes a `global` section: it names a quota service, and its gateways
    /// report their figures to it for the fleet view (also when every rule is local).
    pub written: bool,
}

impl Default for GlobalSpec {
    fn default() -> Self {
        GlobalSpec {
            cluster: "diana_quota".to_string(),
            authority: "diana-quota".to_string(),
            path: "/v1/acquire".to_string(),
            timeout_ms: 50,
            lease: Lease::Fixed(NonZeroU32::MIN),
            retry_seconds: 5,
            token: None,
            written: false,
        }
    }
}

/// `metrics:` section: the filter itself answers `GET <path>` with its metrics in the
/// Prometheus text format, before any rule. Absent: no such path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetricsSpec {
    /// Normalised, starting with `/`.
    pub path: String,
}

/// `remote:` section (config center). No defaults: absent means no config center.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteSpec {
    pub cluster: String,
    pub authority: String,
    pub path: String,
    /// Default 10 when the section is present without it.
    pub poll_seconds: u32,
    /// What a remote document may change of what the local document pins
    /// (`remote.allow`, default none). Always the local document's own.
    pub allow: Vec<Pinned>,
    /// The key every remote document must be signed with (`remote.signature`); `None`:
    /// unsigned documents are accepted. Always the local document's own.
    pub signature: Option<SignatureKey>,
}

impl RemoteSpec {
    /// Whether `remote.allow` lets a remote document change `pinned`.
    pub fn allows(&self, pinned: Pinned) -> bool {
        self.allow.contains(&pinned)
    }
}

/// What a remote document may not change unless the local document's `remote.allow`
/// names it (DESIGN §6: a remote document cannot redirect or disarm). Omitted from a
/// remote document, each keeps the local document's value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pinned {
    /// `global.cluster`, `global.authority`, `global.path` and `global.token`: where the
    /// quota service callouts go, and their credential.
    Global,
    /// `remote.cluster`, `remote.authority`, `remote.path`, `remote.poll_seconds`: where
    /// and how often the config center is polled.
    Remote,
    /// The document-level `dry_run` (a rule's own `dry_run` is the remote document's).
    DryRun,
    /// `identity_key`: the key of the identity hash.
    IdentityKey,
}

impl Pinned {
    pub const ALL: [Pinned; 4] = [
        Pinned::Global,
        Pinned::Remote,
        Pinned::DryRun,
        Pinned::IdentityKey,
    ];

    /// The spelling in `remote.allow`.
    pub fn name(self) -> &'static str {
        match self {
            Pinned::Global => "global",
            Pinned::Remote => "remote",
            Pinned::DryRun => "dry_run",
            Pinned::IdentityKey => "identity_key",
        }
    }
}

/// The warning for a document whose rules reserve from a request's body
/// ([`Policy::body_readers`]) on a host that cannot hold a request for it, or `None`.
pub fn body_warning(policy: &Policy) -> Option<String> {
    let readers = policy.body_readers();
    if readers.is_empty() {
        return None;
    }
    Some(format!(
        "diana: rule(s) {} reserve from the request's body (reserve.json): this filter decides at the request's headers (proxy-wasm hands a filter no body of a request it holds), so each request reserves reserve.default, settled from the answer's usage as usual; Envoy's dynamic module (envoy-native) holds the request until its body is read",
        readers.join(", ")
    ))
}
