//! The document as written: serde types with `deny_unknown_fields`, whose field types
//! validate their value *inside* the deserializer's visitor, so that every error —
//! syntax, type, range, unknown name, duplicate — carries the field path and the
//! line/column where it occurs. Nothing here resolves defaults; see `parse::build`.
//!
//! Checks that need to know more than one value (is this actor defined in `actors:`? was
//! this `Url` already used?) read a per-thread [`Context`] that `parse_policy` fills in
//! before the typed pass and clears afterwards.

use crate::actor::{
    source_kind, ActorDef, Fallback, JwtClaimKind, SourceKind, CONFIGURABLE_BUILTINS,
    DEFAULT_USER_FALLBACK, RESERVED_ACTORS, SOURCE_KINDS,
};
use crate::algo::{self, Algorithm};
use crate::config::{
    HeaderMode, HeaderStyle, Pinned, Scope, MAX_PLANS, MAX_PLAN_NAME, MAX_RETRY_SECONDS,
    MAX_TIMEOUT_MS,
};
use crate::jwt::{ClaimOrigin, ClaimPath};
use crate::path;
use crate::secret::Secret;
use crate::signature::SignatureKey;
use crate::time::Unit;
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

/// One `Url` block.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a resource block with `Url` and `rules`"
)]
pub(super) struct RawBlock {
    #[serde(rename = "Url", alias = "url")]
    pub url: UrlField,
    pub rules: Vec<RawRule>,
}

/// One rule as written; `None` means "use the default" (the key is absent: a key written
/// with `null` is refused, see [`present`]).
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a rule (a mapping with at least `rpu` or `max_in_flight`)"
)]
pub(super) struct RawRule {
    /// Required unless `max_in_flight` is given (the parser says so, naming both).
    #[serde(default, deserialize_with = "present")]
    pub rpu: Option<RpuField>,
    /// A concurrency limit instead of a rate: requests of an identity inside at once.
    #[serde(default, deserialize_with = "present")]
    pub max_in_flight: Option<Ranged<1, 1_000_000>>,
    #[serde(default, deserialize_with = "present")]
    pub unit: Option<UnitField>,
    #[serde(default, deserialize_with = "present")]
    pub algo: Option<AlgoField>,
    #[serde(default, deserialize_with = "present")]
    pub scope: Option<ScopeField>,
    #[serde(default, deserialize_with = "present")]
    pub actor: Option<ActorRef>,
    #[serde(default, deserialize_with = "present")]
    pub burst: Option<NonZeroU32>,
    #[serde(default, deserialize_with = "present")]
    pub slices: Option<Ranged<1, { wire::MAX_SLICES as u64 }>>,
    #[serde(default, deserialize_with = "present")]
    pub slots: Option<Ranged<1, 1_048_576>>,
    #[serde(default, deserialize_with = "present")]
    pub lease: Option<LeaseField>,
    #[serde(default, deserialize_with = "present")]
    pub max_wait_seconds: Option<Ranged<0, 86_400>>,
    #[serde(default, deserialize_with = "present")]
    pub cost: Option<CostField>,
    #[serde(default, deserialize_with = "present")]
    pub response_cost: Option<RawResponseCost>,
    #[serde(default, deserialize_with = "present")]
    pub count: Option<RawCount>,
    #[serde(default, deserialize_with = "present")]
    pub name: Option<RuleName>,
    #[serde(default, deserialize_with = "present")]
    pub dry_run: Option<bool>,
}

/// The full form. Every section is optional; a section, `resources` included, may be given
/// by one document only.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a Diana document")]
pub(super) struct RawFull {
    #[serde(default, deserialize_with = "present")]
    pub resources: Option<Section<Vec<RawBlock>, SECTION_RESOURCES>>,
    #[serde(default, deserialize_with = "present")]
    pub actors: Option<Section<RawActors, SECTION_ACTORS>>,
    #[serde(default, deserialize_with = "present")]
    pub response: Option<Section<RawResponse, SECTION_RESPONSE>>,
    #[serde(default, deserialize_with = "present")]
    pub global: Option<Section<RawGlobal, SECTION_GLOBAL>>,
    #[serde(default, deserialize_with = "present")]
    pub remote: Option<Section<RawRemote, SECTION_REMOTE>>,
    #[serde(default, deserialize_with = "present")]
    pub dry_run: Option<Section<bool, SECTION_DRY_RUN>>,
    #[serde(default, deserialize_with = "present")]
    pub metrics: Option<Section<RawMetrics, SECTION_METRICS>>,
    /// The deployment's identity-hash secret (DESIGN §6), or `{env: NAME}`.
    #[serde(default, deserialize_with = "present")]
    pub identity_key: Option<Section<IdentityKeyField, SECTION_IDENTITY_KEY>>,
    #[serde(default, deserialize_with = "present")]
    pub on_invalid_config:
        Option<Section<super::model::OnInvalidConfig, SECTION_ON_INVALID_CONFIG>>,
}

/// `response_cost: {header: NAME, max: N, reserve: N | {header, default, max}}`.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a response cost `{header: NAME, max: N}` (optionally `reserve: N`)"
)]
pub(super) struct RawResponseCost {
    pub header: HeaderNameField,
    pub max: Ranged<1, 1_000_000_000>,
    #[serde(default, deserialize_with = "present")]
    pub reserve: Option<CostField>,
}

/// `count: {status: [401, 403, 5xx]}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "`{status: [401, 403, 4xx, …]}`")]
pub(super) struct RawCount {
    pub status: StatusList,
}

/// The statuses a `count` rule counts: 1 to 32 of `100`–`599` or `1xx`–`5xx`.
pub(super) struct StatusList(pub Vec<(u16, u16)>);

impl<'de> Deserialize<'de> for StatusList {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let statuses = Vec::<StatusField>::deserialize(deserializer)?;
        if statuses.is_empty() || statuses.len() > 32 {
            return Err(de::Error::custom(
                "expected 1 to 32 statuses (`[401, 403]`, `[4xx]`)",
            ));
        }
        Ok(StatusList(
            statuses.into_iter().map(|status| status.0).collect(),
        ))
    }
}

/// One status (`401`) or class (`4xx`), as an inclusive range.
struct StatusField((u16, u16));

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
                    Ok(status) if (100..=599).contains(&status) => {
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

/// `cost: {header: NAME, default: N, max: N}`.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a header cost `{header: NAME, default: N, max: N}`"
)]
pub(super) struct RawHeaderCost {
    pub header: HeaderNameField,
    #[serde(default, deserialize_with = "present")]
    pub default: Option<Ranged<1, { wire::MAX_WANT as u64 }>>,
    pub max: Ranged<1, { wire::MAX_WANT as u64 }>,
}

/// `rpu`: one limit, or a limit per plan (`{by: x-plan, values: {free: 10, pro: 1000},
/// default: 10}`).
pub(super) enum RpuField {
    Fixed(NonZeroU32),
    Plans(RawPlans),
}

/// `rpu: {by, values, default}`: the limit chosen per request from the request's plan.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "plans `{by: HEADER, values: {PLAN: N, …}, default: N}`"
)]
pub(super) struct RawPlans {
    pub by: PlanByField,
    pub values: PlanValues,
    pub default: NonZeroU32,
}

/// `by`: where a request's plan is read — a request header (`by: x-plan`), or a claim of
/// the bearer token (`by: {jwt_claim: plan}`) or of the payload jwt_authn verified (`by:
/// {jwt_claim: plan, from: {jwt_authn: NAME}}`).
pub(super) enum PlanByField {
    Header(String),
    JwtClaim(crate::jwt::Claim),
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "`{jwt_claim: PATH}` or `{jwt_claim: PATH, from: {jwt_authn: NAME}}`"
)]
struct RawPlanByClaim {
    jwt_claim: NonEmpty,
    from: Option<ClaimOriginField>,
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

/// A plan's name: the header value (or claim) that selects it, matched exactly.
struct PlanName(String);

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
            if raw == "default" {
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
                if value.trim().eq_ignore_ascii_case("auto") {
                    Ok(LeaseField::Auto)
                } else {
                    Err(E::invalid_value(Unexpected::Str(value), &self))
                }
            }
        }
        deserializer.deserialize_any(LeaseVisitor)
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

/// A request or response header name, lower-cased (RFC 9110 token).
pub(super) struct HeaderNameField(pub String);

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

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "`{env: NAME}`")]
struct RawSecretFromEnv {
    env: NonEmpty,
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "the `metrics` section")]
pub(super) struct RawMetrics {
    pub path: PathField,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "the `response` section")]
pub(super) struct RawResponse {
    #[serde(default, deserialize_with = "present")]
    pub status: Option<Ranged<100, 599>>,
    #[serde(default, deserialize_with = "present")]
    pub body: Option<Text>,
    #[serde(default, deserialize_with = "present")]
    pub headers: Option<HeaderModeField>,
    #[serde(default, deserialize_with = "present")]
    pub header_style: Option<HeaderStyleField>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "the `global` section")]
pub(super) struct RawGlobal {
    #[serde(default, deserialize_with = "present")]
    pub cluster: Option<NonEmpty>,
    #[serde(default, deserialize_with = "present")]
    pub authority: Option<NonEmpty>,
    #[serde(default, deserialize_with = "present")]
    pub path: Option<PathField>,
    #[serde(default, deserialize_with = "present")]
    pub timeout_ms: Option<Ranged<1, MAX_TIMEOUT_MS>>,
    #[serde(default, deserialize_with = "present")]
    pub lease: Option<LeaseField>,
    #[serde(default, deserialize_with = "present")]
    pub retry_seconds: Option<Ranged<0, MAX_RETRY_SECONDS>>,
    #[serde(default, deserialize_with = "present")]
    pub token: Option<SecretField>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "the `remote` section")]
pub(super) struct RawRemote {
    pub cluster: NonEmpty,
    #[serde(default, deserialize_with = "present")]
    pub authority: Option<NonEmpty>,
    pub path: PathField,
    #[serde(default, deserialize_with = "present")]
    pub poll_seconds: Option<NonZeroU32>,
    #[serde(default, deserialize_with = "present")]
    pub allow: Option<Vec<PinnedField>>,
    #[serde(default, deserialize_with = "present")]
    pub signature: Option<SignatureField>,
}

/// A name in `remote.allow`: what a remote document may change.
#[derive(Clone, Copy)]
pub(super) struct PinnedField(pub Pinned);

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
                const KINDS: &[&str] = &["hmac_sha256", "ed25519"];
                let mut key: Option<SignatureKey> = None;
                while let Some(kind) = map.next_key::<String>()? {
                    if key.is_some() {
                        return Err(de::Error::custom(
                            "two signature keys, expected one: `hmac_sha256` or `ed25519`",
                        ));
                    }
                    let next = match kind.as_str() {
                        "hmac_sha256" => {
                            SignatureKey::HmacSha256(map.next_value::<SecretField>()?.0)
                        }
                        "ed25519" => map.next_value::<Ed25519KeyField>()?.0,
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

/// An Ed25519 public key in base64.
struct Ed25519KeyField(SignatureKey);

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

/// `unit`: second | minute | hour | day.
pub(super) struct UnitField(pub Unit);

impl<'de> Deserialize<'de> for UnitField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a unit", |raw| {
            Unit::parse(raw).map(UnitField).ok_or_else(|| {
                format!(
                    "unknown unit `{raw}`, expected one of {}",
                    one_of(Unit::ALL.iter().map(|unit| unit.name()))
                )
            })
        })
    }
}

/// `algo`: any spelling in the algorithm registry, case-insensitive.
pub(super) struct AlgoField(pub &'static dyn Algorithm);

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

impl<'de> Deserialize<'de> for ScopeField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "`local` or `global`", |raw| {
            [Scope::Local, Scope::Global]
                .into_iter()
                .find(|scope| scope.name().eq_ignore_ascii_case(raw.trim()))
                .map(ScopeField)
                .ok_or_else(|| format!("unknown scope `{raw}`, expected local or global"))
        })
    }
}

/// `actor`: a built-in name or one defined in `actors:`.
pub(super) struct ActorRef(pub String);

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

/// `name`: printable ASCII, unique among the document's explicit names.
pub(super) struct RuleName(pub String);

impl<'de> Deserialize<'de> for RuleName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a rule name", |raw| {
            if raw.trim().is_empty() {
                return Err("empty rule name".to_string());
            }
            if raw.len() > MAX_RULE_NAME {
                return Err(format!("rule name longer than {MAX_RULE_NAME} characters"));
            }
            if !raw.bytes().all(|byte| (0x20..0x7f).contains(&byte)) {
                return Err(format!(
                    "invalid rule name `{}`: only printable ASCII (0x20 to 0x7E) is allowed: the name is \
                     used in metrics and logs, and as a structured-field string in the RateLimit headers",
                    raw.escape_debug()
                ));
            }
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

impl<'de> Deserialize<'de> for HeaderModeField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "none, limited or all", |raw| {
            named(raw, &HeaderMode::ALL, HeaderMode::name, "headers mode").map(HeaderModeField)
        })
    }
}

/// `response.header_style`: x-ratelimit | ietf | both.
pub(super) struct HeaderStyleField(pub HeaderStyle);

impl<'de> Deserialize<'de> for HeaderStyleField {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "x-ratelimit, ietf or both", |raw| {
            named(raw, &HeaderStyle::ALL, HeaderStyle::name, "header style").map(HeaderStyleField)
        })
    }
}

/// `fallback`: skip | ip | shared.
pub(super) struct FallbackField(pub Fallback);

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
pub(super) struct Text(pub String);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "a string", |raw| {
            Ok::<_, std::convert::Infallible>(Text(raw.to_string()))
        })
    }
}

/// A non-empty string (cluster, authority).
pub(super) struct NonEmpty(pub String);

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
                && raw.len() <= 64
                && raw
                    .bytes()
                    .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'_' | b'-' | b'.'));
            if !valid {
                return Err(format!(
                    "invalid actor name `{}`: use 1 to 64 letters, digits, `_`, `-` or `.`",
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

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "`{jwt_authn: NAME}`, NAME the `payload_in_metadata` of the jwt_authn provider that verified the token"
)]
struct RawClaimOrigin {
    jwt_authn: MetadataName,
}

struct MetadataName(ClaimOrigin);

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

impl<'de> Deserialize<'de> for SpecKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserialize_str_with(deserializer, "an actor field", |raw| {
            if raw == "fallback" {
                Ok(SpecKey::Fallback)
            } else if raw == "from" {
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
