//! Counters in Redis or Redis Cluster, decided by ONE Lua script (`lua/common.lua`, one file
//! per algorithm, `lua/decide.lua`), run by `EVALSHA` and reloaded on `NOSCRIPT` (the
//! script never ran, so nothing is charged twice); the time is the Redis server's (`TIME`),
//! so gateways with skewed clocks agree. An acquire whose rules are all fixed windows (the
//! RLS default, envoyproxy/ratelimit's only algorithm) takes a lean script instead
//! (`window.lua`, next to this file): the same decision on the same stored counters for a
//! third of the general script's Redis time (most of which is the general script building
//! every algorithm's functions on each call; `window.lua`'s header has the figures), also
//! by `EVALSHA` on `TIME`. Keys are
//! `diana:{<key>}:<ALGO>:<rpu>:<unit>:<burst>:<slices>` ([`diana_core::quota::CounterId::params`]): a counter
//! is bound to its parameters (a request with other parameters addresses another key and
//! can neither read nor reset this one), and the hash tag keeps every counter of one rule
//! key in one cluster slot.
//!
//! All or nothing:
//! - a single server gets every rule of a request in one script call over all its keys:
//!   the script checks every rule, then charges all or none, atomically;
//! - a cluster cannot run one script over keys in different slots, so the rules are
//!   grouped by key (one call per group, concurrently, each group all or nothing); when a
//!   group is denied (or fails), the groups that were charged are given their grants back
//!   by a `release` call: exact like `Algorithm::release` (a token-bucket or window count
//!   comes back whole; a leaky-bucket turn comes back while no later request queued behind
//!   it, else it passes unused). Between the charge and the release, other requests may
//!   see those tokens taken: a race can deny both of two requests that one counter could
//!   have admitted one of, never admit more than the limit. A release that fails leaves
//!   the tokens charged (stricter, never looser).
//!
//! Connections are made lazily, with short timeouts, and dropped on any connection-level
//! error, so a dead or slow Redis costs one short timeout (then a fast 503 while the
//! reconnect back-off runs) and a restarted Redis is picked up by the next request. A
//! response timeout keeps the connection, unless nothing came back on it (on that key's
//! cluster slot) for [`RedisOptions::dead_after`]: a peer that went silent without
//! closing (half-open: a host gone, a NAT or firewall that lost the flow) is replaced.

mod breakers;

pub use self::breakers::{breaker_key, MAX_ATTEMPTS as BREAKER_SWAP_ATTEMPTS};

use super::breakers::FleetBreakers;
use super::{
    decide, CounterDigest, Enforcement, Grant, Noted, Outcome, Part, Spend, Spending, Spent, Store,
    StoreError,
};
use async_trait::async_trait;
use diana_core::algo::{Limit, Mark};
use diana_core::quota::counter_params;
use diana_core::quota::ledger::{self, CALL_MEMORY, RELEASED};
use diana_core::wire::{ResolvedRule, RuleResult};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{
    AsyncConnectionConfig, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult, Script,
    ScriptInvocation, ServerErrorKind, Value,
};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Where Redis is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// `redis://[user:password@]host:port[/db]`
    Single(String),
    /// `redis+cluster://[user:password@]h1:p1,h2:p2,…`: the seed nodes, each as a `redis://` URL.
    Cluster(Vec<String>),
}

/// Why a Redis URL (`--redis`) cannot be used. `url` is always shown without its
/// credentials.
#[derive(Debug, thiserror::Error)]
pub enum RedisUrlError {
    #[error("{url}: unsupported Redis URL (expected redis://host:port[/db] or redis+cluster://h1:p1,h2:p2)")]
    Unsupported { url: String },
    #[error("{url}: no cluster node (expected redis+cluster://h1:p1,h2:p2)")]
    NoClusterNode { url: String },
    /// The `redis` crate refused it (a bad port, database, or option).
    #[error("{url}: {error}")]
    Invalid {
        url: String,
        #[source]
        error: redis::RedisError,
    },
}

impl RedisUrlError {
    fn invalid(url: &str, error: redis::RedisError) -> RedisUrlError {
        RedisUrlError::Invalid {
            url: redact(url),
            error,
        }
    }
}

impl RedisTarget {
    /// Parses `redis://host:port[/db]` or `redis+cluster://h1:p1,h2:p2`.
    pub fn parse(url: &str) -> Result<RedisTarget, RedisUrlError> {
        let url = url.trim();
        if let Some(rest) = url.strip_prefix("redis+cluster://") {
            let (userinfo, hosts) = match rest.rsplit_once('@') {
                Some((userinfo, hosts)) => (format!("{userinfo}@"), hosts),
                None => (String::new(), rest),
            };
            let hosts = hosts.trim_end_matches('/');
            let nodes: Vec<String> = hosts
                .split(',')
                .map(str::trim)
                .filter(|host| !host.is_empty())
                .map(|host| format!("redis://{userinfo}{host}"))
                .collect();
            if nodes.is_empty() {
                return Err(RedisUrlError::NoClusterNode { url: redact(url) });
            }
            for node in &nodes {
                redis::Client::open(node.as_str())
                    .map_err(|error| RedisUrlError::invalid(node, error))?;
            }
            return Ok(RedisTarget::Cluster(nodes));
        }
        if url.starts_with("redis://") {
            redis::Client::open(url).map_err(|error| RedisUrlError::invalid(url, error))?;
            return Ok(RedisTarget::Single(url.to_string()));
        }
        Err(RedisUrlError::Unsupported { url: redact(url) })
    }

    /// The target without credentials, for logs.
    pub fn describe(&self) -> String {
        match self {
            RedisTarget::Single(url) => redact(url),
            RedisTarget::Cluster(nodes) => format!(
                "redis cluster [{}]",
                nodes
                    .iter()
                    .map(|node| redact(node))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

/// Removes `user:password@` from a URL.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

/// Timeouts of the Redis store. Both stay below the service's request deadline (40 ms by
/// default, `app::Settings::deadline`), which stays below the gateway's callout timeout
/// (50 ms by default): see `docs/wire-format.md`, "Deadlines".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisOptions {
    /// Longest wait for a TCP connection (and handshake) to Redis.
    pub connect_timeout: Duration,
    /// Longest wait for an answer from Redis.
    pub response_timeout: Duration,
    /// After a failed connection attempt, requests fail at once for this long before the
    /// next attempt (so a dead Redis costs one timeout, not one per request).
    pub reconnect_backoff: Duration,
    /// A response timeout on a connection that answered nothing for this long (on that
    /// cluster slot) drops it: its peer went silent without closing, and TCP alone would
    /// keep it for hours.
    pub dead_after: Duration,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            connect_timeout: Duration::from_millis(20),
            response_timeout: Duration::from_millis(20),
            reconnect_backoff: Duration::from_millis(100),
            dead_after: Duration::from_secs(1),
        }
    }
}

// ---------------------------------------------------------------------------------------
// The script: one for every algorithm and operation. A new algorithm is a new Lua file
// (adding itself to ALGOS), one line in `SCRIPT` and one entry in `LUA_ALGORITHMS`.

/// The script as Redis runs it (and hashes it for `EVALSHA`): the shared helpers, each
/// algorithm, then the entry point.
const SCRIPT: &str = concat!(
    include_str!("../../lua/common.lua"),
    include_str!("../../lua/window.lua"),
    include_str!("../../lua/sliding.lua"),
    include_str!("../../lua/leaky.lua"),
    include_str!("../../lua/token.lua"),
    include_str!("../../lua/inflight.lua"),
    include_str!("../../lua/decide.lua"),
);

/// The lean script: an acquire whose rules are all fixed windows ([`takes_lean_window`]).
/// It decides as `SCRIPT` does on the same keys and state (`tests/lean_window.rs`).
const WINDOW_SCRIPT: &str = include_str!("window.lua");

/// The release ledger's script (`lua/calls.lua`): one key per call with an id.
const CALLS_SCRIPT: &str = include_str!("../../lua/calls.lua");

/// The Redis key of a call's ledger entry (its own hash tag: one slot per call).
fn call_key(call: &str) -> String {
    format!("diana:{{call:{call}}}")
}

/// The fixed window's code, the one algorithm the lean script decides.
const WINDOW_CODE: &str = "W";

/// How an algorithm's [`Mark`] travels to and from the script.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MarkForm {
    /// A window or slice index, as is.
    Index,
    /// An instant `(µs, fraction in 1/rpu µs)` (token and leaky bucket); the Rust mark is
    /// that instant × rpu in ns.
    Instant,
}

/// An algorithm as the script knows it: its code, its parameters, its mark.
struct LuaAlgorithm {
    code: &'static str,
    /// The parameters after the code, as the algorithm's Lua header lists them.
    params: fn(&Limit) -> Vec<u64>,
    mark: MarkForm,
}

static LUA_ALGORITHMS: [LuaAlgorithm; 5] = [
    LuaAlgorithm {
        code: "W",
        params: window_params,
        mark: MarkForm::Index,
    },
    LuaAlgorithm {
        code: "SW",
        params: sliding_params,
        mark: MarkForm::Index,
    },
    LuaAlgorithm {
        code: "LB",
        params: gcra_params,
        mark: MarkForm::Instant,
    },
    LuaAlgorithm {
        code: "TB",
        params: gcra_params,
        mark: MarkForm::Instant,
    },
    LuaAlgorithm {
        code: "IF",
        params: inflight_params,
        mark: MarkForm::Index,
    },
];

fn lua_algorithm(code: &str) -> Option<&'static LuaAlgorithm> {
    LUA_ALGORITHMS.iter().find(|algo| algo.code == code)
}

const MICROS_PER_SECOND: u64 = 1_000_000;
const NANOS_PER_MICRO: u128 = 1_000;
/// Largest GCRA tolerance passed to the scripts (keeps every Lua number below 2^53).
const MAX_TOLERANCE_US: u64 = 1 << 50;

/// The unit in microseconds: a calendar period's length for a rule that names one.
fn unit_micros(limit: &Limit) -> u64 {
    match limit.period {
        Some(period) => period.length.get() / 1_000,
        None => limit.unit.seconds() * MICROS_PER_SECOND,
    }
}

/// window.lua: rpu, unit_us, origin_us (0, or the start of the period before a calendar
/// period's, so that the period is window 1: `algo::window`'s windows of a given period).
fn window_params(limit: &Limit) -> Vec<u64> {
    let origin = limit.period.map_or(0, |period| {
        period.start.saturating_sub(period.length).unix_nanos() / 1_000
    });
    vec![u64::from(limit.rpu.get()), unit_micros(limit), origin]
}

/// inflight.lua: rpu (the places).
fn inflight_params(limit: &Limit) -> Vec<u64> {
    vec![u64::from(limit.rpu.get())]
}

/// sliding.lua: rpu, unit_us, slices.
fn sliding_params(limit: &Limit) -> Vec<u64> {
    vec![
        u64::from(limit.rpu.get()),
        unit_micros(limit),
        u64::from(limit.slices.get()),
    ]
}

/// token.lua / leaky.lua: rpu, T = unit/rpu and B = burst·T as (microseconds, remainder
/// over rpu). Computed exactly in 128 bits; B is clamped to 2^50 µs (35 years).
fn gcra_params(limit: &Limit) -> Vec<u64> {
    let rpu = u128::from(limit.rpu.get());
    let unit = u128::from(unit_micros(limit));
    let tolerance = unit * u128::from(limit.burst.get());
    let (mut b_us, mut b_rem) = (tolerance / rpu, tolerance % rpu);
    if b_us > u128::from(MAX_TOLERANCE_US) {
        (b_us, b_rem) = (u128::from(MAX_TOLERANCE_US), 0);
    }
    let narrow = |value: u128| u64::try_from(value).unwrap_or(u64::MAX);
    vec![
        narrow(rpu),
        narrow(unit / rpu),
        narrow(unit % rpu),
        narrow(b_us),
        narrow(b_rem),
    ]
}

impl MarkForm {
    fn to_mark(self, limit: &Limit, m1: i64, m2: i64) -> Mark {
        let word = |value: i64| u128::try_from(value).unwrap_or(0);
        match self {
            MarkForm::Index => Mark(word(m1)),
            MarkForm::Instant => {
                let rpu = u128::from(limit.rpu.get());
                Mark((word(m1) * rpu + word(m2)) * NANOS_PER_MICRO)
            }
        }
    }

    fn to_lua(self, limit: &Limit, mark: Mark) -> (u64, u64) {
        let narrow = |value: u128| u64::try_from(value).unwrap_or(u64::MAX);
        match self {
            MarkForm::Index => (narrow(mark.0), 0),
            MarkForm::Instant => {
                let rpu = u128::from(limit.rpu.get());
                let scaled = mark.0 / NANOS_PER_MICRO;
                (narrow(scaled / rpu), narrow(scaled % rpu))
            }
        }
    }
}

/// What one script call does.
#[derive(Clone, Copy)]
enum Op<'a> {
    Acquire,
    Charge,
    /// Gives back the grants of these outcomes (indexed like the request's rules).
    Release(&'a [Outcome]),
    /// Renews concurrency places counted at these marks (indexed like the rules).
    Renew(&'a [Mark]),
    /// Decides an RLS call, each rule as these say (indexed like the rules).
    Spend(&'a [Spending]),
}

impl Op<'_> {
    fn name(&self) -> &'static str {
        match self {
            Op::Acquire => "acquire",
            Op::Charge => "charge",
            Op::Release(_) => "release",
            Op::Renew(_) => "renew",
            Op::Spend(_) => "spend",
        }
    }
}

/// Values the script returns per rule.
const REPLY_WIDTH: usize = 8;

/// The script call for `rules` (each with its index in the request).
fn invocation<'s>(
    script: &'s Script,
    op: Op<'_>,
    rules: &[(usize, &ResolvedRule<'_>)],
    now_us: Option<u64>,
) -> Result<ScriptInvocation<'s>, StoreError> {
    let mut call = script.prepare_invoke();
    call.arg(op.name());
    match now_us {
        Some(now) => call.arg(now),
        None => call.arg(""),
    };
    for &(index, rule) in rules {
        let code = rule.algo.code();
        let lua = lua_algorithm(code).ok_or_else(|| {
            StoreError::Unsupported(format!(
                "rules[{index}].algo: {code} is not supported by the Redis store"
            ))
        })?;
        call.key(redis_key(rule));
        call.arg(code);
        for value in (lua.params)(&rule.limit) {
            call.arg(value);
        }
        match op {
            Op::Acquire => {
                call.arg(rule.cost.get()).arg(rule.want.get());
                match rule.max_delay {
                    Some(nanos) => call.arg(nanos.get() / 1_000),
                    None => call.arg(""),
                };
                call.arg(u8::from(rule.dry_run));
            }
            Op::Charge => {
                call.arg(rule.want.get());
            }
            Op::Release(outcomes) => {
                let outcome = outcomes.get(index).copied().unwrap_or_default();
                let (m1, m2) = lua.mark.to_lua(&rule.limit, outcome.mark);
                call.arg(outcome.result.granted).arg(m1).arg(m2);
            }
            Op::Renew(places) => {
                let place = places.get(index).copied().unwrap_or_default();
                let (m1, m2) = lua.mark.to_lua(&rule.limit, place);
                call.arg(rule.want.get()).arg(m1).arg(m2);
            }
            Op::Spend(how) => {
                let Some(spending) = how.get(index) else {
                    return Err(StoreError::Internal(format!(
                        "rules[{index}]: no spending given"
                    )));
                };
                let spend = match spending.spend {
                    Spend::Take => "take",
                    Spend::Check => "check",
                    Spend::Count => "count",
                };
                let enforcement: u8 = match spending.enforcement {
                    Enforcement::Enforced => 0,
                    Enforcement::Shadow => 1,
                    Enforcement::Quota => 2,
                };
                call.arg(spend).arg(rule.want.get()).arg(enforcement);
            }
        }
    }
    Ok(call)
}

/// Whether a call goes to the lean script: an acquire of fixed windows only. Charges and
/// releases (response costs, cluster compensation, late answers) are rare and stay on the
/// general script, which reads and writes the same state.
fn takes_lean_window(op: Op<'_>, rules: &[(usize, &ResolvedRule<'_>)]) -> bool {
    matches!(op, Op::Acquire)
        && !rules.is_empty()
        && rules
            .iter()
            .all(|(_, rule)| rule.algo.code() == WINDOW_CODE && rule.limit.period.is_none())
}

/// The lean script's call: per rule its key, then rpu, unit (µs), need, want, dry run
/// (`window.lua`'s header). Its reply is the general script's (8 integers per rule).
fn window_invocation<'s>(
    script: &'s Script,
    rules: &[(usize, &ResolvedRule<'_>)],
    now_us: Option<u64>,
) -> ScriptInvocation<'s> {
    let mut call = script.prepare_invoke();
    match now_us {
        Some(now) => call.arg(now),
        None => call.arg(""),
    };
    for &(_, rule) in rules {
        call.key(redis_key(rule));
        call.arg(rule.limit.rpu.get())
            .arg(unit_micros(&rule.limit))
            .arg(rule.cost.get())
            .arg(rule.want.get())
            .arg(u8::from(rule.dry_run));
    }
    call
}

/// The script's reply, [`REPLY_WIDTH`] integers per rule, on the wire.
fn outcomes(
    op: Op<'_>,
    rules: &[(usize, &ResolvedRule<'_>)],
    reply: &[i64],
) -> Result<Vec<Outcome>, StoreError> {
    if reply.len() != rules.len() * REPLY_WIDTH {
        return Err(StoreError::Internal(format!(
            "the script returned {} values for {} rules",
            reply.len(),
            rules.len()
        )));
    }
    rules
        .iter()
        .zip(reply.chunks_exact(REPLY_WIDTH))
        .map(|(&(index, rule), values)| to_outcome(op, index, rule, values))
        .collect()
}

/// One rule's `{allowed, granted, remaining, reset_us, retry_after_us, delay_us, mark1,
/// mark2}`. A charge keeps its retry (when the debt is paid back) although allowed.
fn to_outcome(
    op: Op<'_>,
    index: usize,
    rule: &ResolvedRule<'_>,
    reply: &[i64],
) -> Result<Outcome, StoreError> {
    let &[allowed, granted, remaining, reset_us, retry_us, delay_us, m1, m2] = reply else {
        return Err(StoreError::Internal(format!(
            "rules[{index}]: script returned {} values, expected {REPLY_WIDTH}",
            reply.len()
        )));
    };
    let millis = |us: i64| u64::try_from(us).unwrap_or(0).div_ceil(1000);
    // Never more than asked, whatever the script says.
    let granted = u32::try_from(granted.max(0))
        .unwrap_or(u32::MAX)
        .min(rule.want.get());
    let mark = lua_algorithm(rule.algo.code())
        .map_or_else(Mark::default, |lua| lua.mark.to_mark(&rule.limit, m1, m2));
    let result = RuleResult {
        place: None,
        // A spend's count is charged even when it did not pass: its own verdict says.
        allowed: allowed != 0 || (granted > 0 && !matches!(op, Op::Spend(_))),
        granted,
        remaining: u64::try_from(remaining).unwrap_or(0),
        reset_ms: millis(reset_us),
        retry_after_ms: if allowed == 0 || matches!(op, Op::Charge) {
            millis(retry_us)
        } else {
            0
        },
        delay_ms: if granted > 0 { millis(delay_us) } else { 0 },
    };
    // Places granted or renewed name their bucket (a charge or release answers none).
    let result = match op {
        Op::Acquire | Op::Renew(_) => result.placed(rule.algo, mark),
        Op::Charge | Op::Release(_) | Op::Spend(_) => result,
    };
    Ok(Outcome { result, mark })
}

/// The rules grouped by key (a hash tag: one cluster slot), in order of first appearance.
fn groups_by_key<'r, 'a>(rules: &'r [ResolvedRule<'a>]) -> Vec<Vec<(usize, &'r ResolvedRule<'a>)>> {
    let mut groups: Vec<Vec<(usize, &ResolvedRule<'a>)>> = Vec::new();
    for (index, rule) in rules.iter().enumerate() {
        match groups.iter_mut().find(|group| {
            group
                .first()
                .is_some_and(|(_, first)| first.key == rule.key)
        }) {
            Some(group) => group.push((index, rule)),
            None => groups.push(vec![(index, rule)]),
        }
    }
    groups
}

// ---------------------------------------------------------------------------------------
// Connections.

/// A connection made on first use and dropped on failure.
struct Lazy<C> {
    slot: tokio::sync::Mutex<Slot<C>>,
    connect_timeout: Duration,
    backoff: Duration,
    name: String,
}

struct Slot<C> {
    current: Option<(u64, C)>,
    /// When the current connection was made.
    connected_at: Option<Instant>,
    generation: u64,
    last_failure: Option<(Instant, String)>,
    /// Whether the outage was already logged.
    down: bool,
}

impl<C: Clone> Lazy<C> {
    fn new(name: String, connect_timeout: Duration, backoff: Duration) -> Lazy<C> {
        Lazy {
            slot: tokio::sync::Mutex::new(Slot {
                current: None,
                connected_at: None,
                generation: 0,
                last_failure: None,
                down: false,
            }),
            connect_timeout,
            backoff,
            name,
        }
    }

    /// The current connection (and its generation), connecting if there is none.
    async fn get<F, Fut>(&self, connect: F) -> Result<(u64, C), StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = RedisResult<C>>,
    {
        let mut slot = self.slot.lock().await;
        if let Some((generation, connection)) = &slot.current {
            return Ok((*generation, connection.clone()));
        }
        if let Some((at, reason)) = &slot.last_failure {
            if at.elapsed() < self.backoff {
                return Err(StoreError::Unavailable(reason.clone()));
            }
        }
        let outcome = match tokio::time::timeout(self.connect_timeout, connect()).await {
            Ok(Ok(connection)) => Ok(connection),
            Ok(Err(error)) => Err(format!("cannot connect to {}: {error}", self.name)),
            Err(_) => Err(format!(
                "cannot connect to {}: timed out after {} ms",
                self.name,
                self.connect_timeout.as_millis()
            )),
        };
        match outcome {
            Ok(connection) => {
                slot.generation += 1;
                slot.current = Some((slot.generation, connection.clone()));
                slot.connected_at = Some(Instant::now());
                slot.last_failure = None;
                if std::mem::take(&mut slot.down) {
                    tracing::info!(store = %self.name, "redis reachable again");
                } else {
                    tracing::debug!(store = %self.name, "connected to redis");
                }
                Ok((slot.generation, connection))
            }
            Err(reason) => {
                if !std::mem::replace(&mut slot.down, true) {
                    tracing::warn!(store = %self.name, %reason, "redis unavailable; answering 503 until it is back");
                }
                slot.last_failure = Some((Instant::now(), reason.clone()));
                Err(StoreError::Unavailable(reason))
            }
        }
    }

    /// Drops the connection of this generation if nothing came back on it since it was
    /// made, or since `last_answer` (its latest answer on the route that timed out), for
    /// `dead_after`.
    async fn invalidate_if_silent(
        &self,
        generation: u64,
        last_answer: Option<Instant>,
        dead_after: Duration,
    ) {
        let silent_since = {
            let slot = self.slot.lock().await;
            match (&slot.current, slot.connected_at) {
                (Some((current, _)), Some(connected)) if *current == generation => {
                    last_answer.map_or(connected, |answer| answer.max(connected))
                }
                _ => return,
            }
        };
        let silent = silent_since.elapsed();
        if silent >= dead_after {
            let reason = format!(
                "no answer for {} ms (the connection went silent without closing)",
                silent.as_millis()
            );
            self.invalidate(generation, &reason).await;
        }
    }

    /// Drops the connection of this generation (a newer one is kept).
    async fn invalidate(&self, generation: u64, reason: &str) {
        let mut slot = self.slot.lock().await;
        if matches!(&slot.current, Some((current, _)) if *current == generation) {
            slot.current = None;
            if !std::mem::replace(&mut slot.down, true) {
                tracing::warn!(store = %self.name, %reason, "redis connection lost; reconnecting on the next request");
            }
        }
    }
}

/// Whether an error means the connection should be replaced.
/// A response timeout does not: the connection stays usable (the late answer is dropped),
/// and reconnecting on every slow answer under load would turn a slow Redis into a
/// reconnect storm with its back-off of fast 503s.
fn needs_reconnect(error: &RedisError) -> bool {
    if error.is_timeout() {
        return false;
    }
    match error.kind() {
        ErrorKind::Server(ServerErrorKind::ReadOnly) => true,
        ErrorKind::Server(_) | ErrorKind::Extension => false,
        _ => true,
    }
}

/// The store error for a Redis error: a script or protocol problem is internal (500);
/// everything else (I/O, timeouts, a node down, slots moving, loading, read-only) means
/// Redis cannot serve right now (503).
fn store_error(error: &RedisError) -> StoreError {
    match error.kind() {
        ErrorKind::Server(
            ServerErrorKind::ResponseError
            | ServerErrorKind::NoScript
            | ServerErrorKind::CrossSlot
            | ServerErrorKind::NoPerm
            | ServerErrorKind::ExecAbort,
        )
        | ErrorKind::Extension
        | ErrorKind::UnexpectedReturnType
        | ErrorKind::Parse => StoreError::Internal(error.to_string()),
        _ => StoreError::Unavailable(error.to_string()),
    }
}

enum Backend {
    Single {
        client: redis::Client,
        config: AsyncConnectionConfig,
        connection: Lazy<MultiplexedConnection>,
    },
    Cluster {
        client: ClusterClient,
        connection: Lazy<ClusterConnection>,
    },
}

/// A connection of either backend.
enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(conn) => conn.req_packed_command(cmd),
            Conn::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(conn) => conn.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(conn) => conn.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(conn) => conn.get_db(),
            Conn::Cluster(conn) => conn.get_db(),
        }
    }
}

/// Counters in Redis (one server) or Redis Cluster.
pub struct RedisStore {
    backend: Backend,
    script: Script,
    /// The lean script for fixed-window acquires ([`WINDOW_SCRIPT`]).
    window_script: Script,
    /// The release ledger ([`CALLS_SCRIPT`]).
    calls_script: Script,
    /// Whether fixed-window acquires take the lean script (always, but for the tests and
    /// benchmarks that compare it with the general one).
    lean_window: bool,
    options: RedisOptions,
    description: String,
    /// When each route last answered, in ms after `epoch` (0: not yet): one route for a
    /// single server, one per slot for a cluster (a node's connection may go silent
    /// while the others answer).
    answered: Box<[AtomicU64]>,
    epoch: Instant,
    /// Serialise this replica's reports on one fleet breaker state (`breakers.rs`).
    breaker_locks: breakers::Stripes,
}

/// Redis Cluster hash slots.
const CLUSTER_SLOTS: usize = 16_384;
const CLUSTER_SLOTS_U16: u16 = 16_384;

/// The Redis key of a rule's counter, `diana:{<key>}:<ALGO>:<rpu>:<unit>:<burst>:<slices>`
/// (`diana:{8f3a:5c1e}:TB:10:second:10:10`): the rule key is a hash tag, so every counter
/// of one rule key lives on one cluster slot; the parameters bind the counter to them.
pub fn redis_key(rule: &ResolvedRule<'_>) -> String {
    format!(
        "diana:{{{}}}:{}",
        rule.key,
        counter_params(rule.algo.code(), &rule.limit)
    )
}

/// The Redis Cluster slot of a rule key: the slot of its Redis keys (`diana:{<key>}:…`)
/// by Redis's own rule (CRC16/XMODEM of the hash tag — the bytes between the first `{` and
/// the next `}` — modulo 16384; `CLUSTER KEYSLOT` gives the same).
pub fn cluster_slot(rule_key: &str) -> u16 {
    let key = format!("diana:{{{rule_key}}}:");
    let tag = key
        .split_once('{')
        .and_then(|(_, rest)| rest.split_once('}'))
        .map(|(tag, _)| tag)
        .filter(|tag| !tag.is_empty())
        .unwrap_or(&key);
    crc16::State::<crc16::XMODEM>::calculate(tag.as_bytes()) % CLUSTER_SLOTS_U16
}

impl RedisStore {
    /// A store for this target. Nothing is connected until the first request, so the
    /// service starts (and answers 503) while Redis is down.
    pub fn new(target: &RedisTarget, options: RedisOptions) -> Result<RedisStore, RedisUrlError> {
        let description = target.describe();
        let backend = match target {
            RedisTarget::Single(url) => Backend::Single {
                client: redis::Client::open(url.as_str())
                    .map_err(|error| RedisUrlError::invalid(url, error))?,
                config: AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(options.connect_timeout))
                    .set_response_timeout(Some(options.response_timeout)),
                connection: Lazy::new(
                    description.clone(),
                    options.connect_timeout,
                    options.reconnect_backoff,
                ),
            },
            RedisTarget::Cluster(nodes) => Backend::Cluster {
                client: ClusterClient::builder(nodes.iter().map(String::as_str))
                    .connection_timeout(options.connect_timeout)
                    .response_timeout(options.response_timeout)
                    .retries(1)
                    .build()
                    .map_err(|error| RedisUrlError::Invalid {
                        url: description.clone(),
                        error,
                    })?,
                // Connecting to a cluster also reads its slot map: one more round trip.
                connection: Lazy::new(
                    description.clone(),
                    options.connect_timeout + options.response_timeout,
                    options.reconnect_backoff,
                ),
            },
        };
        let routes = if matches!(backend, Backend::Cluster { .. }) {
            CLUSTER_SLOTS
        } else {
            1
        };
        Ok(RedisStore {
            backend,
            script: Script::new(SCRIPT),
            window_script: Script::new(WINDOW_SCRIPT),
            calls_script: Script::new(CALLS_SCRIPT),
            lean_window: true,
            options,
            description,
            answered: (0..routes).map(|_| AtomicU64::new(0)).collect(),
            epoch: Instant::now(),
            breaker_locks: breakers::Stripes::new(),
        })
    }

    pub fn options(&self) -> RedisOptions {
        self.options
    }

    /// With `false`, every call takes the general script, fixed-window acquires too: for
    /// the tests and benchmarks that compare the lean script with it (both decide the same).
    #[must_use]
    pub fn with_lean_window(mut self, enabled: bool) -> RedisStore {
        self.lean_window = enabled;
        self
    }

    fn is_cluster(&self) -> bool {
        matches!(self.backend, Backend::Cluster { .. })
    }

    /// The current connection (and its generation), connecting if there is none.
    async fn connection(&self) -> Result<(u64, Conn), StoreError> {
        match &self.backend {
            Backend::Single {
                client,
                config,
                connection,
            } => {
                let (generation, conn) = connection
                    .get(|| client.get_multiplexed_async_connection_with_config(config))
                    .await?;
                Ok((generation, Conn::Single(conn)))
            }
            Backend::Cluster { client, connection } => {
                let (generation, conn) = connection.get(|| client.get_async_connection()).await?;
                Ok((generation, Conn::Cluster(conn)))
            }
        }
    }

    /// The route of a command on `key` (a hash tag): its slot on a cluster.
    fn route(&self, key: Option<&str>) -> usize {
        match key {
            Some(key) if self.answered.len() == CLUSTER_SLOTS => usize::from(cluster_slot(key)),
            _ => 0,
        }
    }

    fn answered_now(&self, route: usize) {
        let millis = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        if let Some(at) = self.answered.get(route) {
            at.store(millis.max(1), Ordering::Relaxed);
        }
    }

    fn last_answer(&self, route: usize) -> Option<Instant> {
        match self.answered.get(route)?.load(Ordering::Relaxed) {
            0 => None,
            millis => Some(self.epoch + Duration::from_millis(millis)),
        }
    }

    /// The store error for a failure on the connection of `generation`, which is dropped
    /// when the failure means it is broken, or when it timed out on a route silent for
    /// `dead_after`.
    async fn failure(&self, generation: u64, route: usize, error: &RedisError) -> StoreError {
        if needs_reconnect(error) {
            let reason = error.to_string();
            match &self.backend {
                Backend::Single { connection, .. } => {
                    connection.invalidate(generation, &reason).await;
                }
                Backend::Cluster { connection, .. } => {
                    connection.invalidate(generation, &reason).await;
                }
            }
        } else if error.is_timeout() {
            let (last, dead_after) = (self.last_answer(route), self.options.dead_after);
            match &self.backend {
                Backend::Single { connection, .. } => {
                    connection
                        .invalidate_if_silent(generation, last, dead_after)
                        .await;
                }
                Backend::Cluster { connection, .. } => {
                    connection
                        .invalidate_if_silent(generation, last, dead_after)
                        .await;
                }
            }
        }
        store_error(error)
    }

    /// Runs one command (or script) on `key`'s route, dropping the connection when broken.
    async fn query<T, F, Fut>(&self, key: Option<&str>, run: F) -> Result<T, StoreError>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let route = self.route(key);
        let (generation, conn) = self.connection().await?;
        match run(conn).await {
            Ok(value) => {
                self.answered_now(route);
                Ok(value)
            }
            Err(error) => {
                if matches!(error.kind(), ErrorKind::Server(_)) {
                    self.answered_now(route); // an error reply is an answer
                }
                Err(self.failure(generation, route, &error).await)
            }
        }
    }

    /// One script call over `rules` (all in one slot on a cluster).
    async fn call(
        &self,
        op: Op<'_>,
        rules: &[(usize, &ResolvedRule<'_>)],
        now_us: Option<u64>,
    ) -> Result<Vec<Outcome>, StoreError> {
        let call = if self.lean_window && takes_lean_window(op, rules) {
            window_invocation(&self.window_script, rules, now_us)
        } else {
            invocation(&self.script, op, rules, now_us)?
        };
        let key = rules.first().map(|(_, rule)| rule.key);
        let reply: Vec<i64> = self
            .query(
                key,
                |mut conn| async move { call.invoke_async(&mut conn).await },
            )
            .await?;
        outcomes(op, rules, &reply)
    }

    /// One call per group, concurrently; the outcomes in request order.
    async fn call_groups(
        &self,
        op: Op<'_>,
        groups: &[Vec<(usize, &ResolvedRule<'_>)>],
        count: usize,
        now_us: Option<u64>,
    ) -> (Vec<Outcome>, Vec<Result<(), StoreError>>) {
        let replies =
            futures_util::future::join_all(groups.iter().map(|group| self.call(op, group, now_us)))
                .await;
        let mut all = vec![Outcome::default(); count];
        let mut status = Vec::with_capacity(groups.len());
        for (group, reply) in groups.iter().zip(replies) {
            status.push(reply.map(|outcomes| {
                for (&(index, _), outcome) in group.iter().zip(outcomes) {
                    if let Some(slot) = all.get_mut(index) {
                        *slot = outcome;
                    }
                }
            }));
        }
        (all, status)
    }

    /// [`Store::check_and_update`] with the script's clock set to `now_us` (microseconds
    /// since the epoch) instead of Redis `TIME` when given (tests on a fake clock).
    pub async fn acquire_at(
        &self,
        rules: &[ResolvedRule<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Outcome>, StoreError> {
        let groups = groups_by_key(rules);
        if !self.is_cluster() || groups.len() == 1 {
            let all: Vec<(usize, &ResolvedRule<'_>)> = rules.iter().enumerate().collect();
            return self.call(Op::Acquire, &all, now_us).await;
        }
        let (mut outcomes, status) = self
            .call_groups(Op::Acquire, &groups, rules.len(), now_us)
            .await;
        let failed = status.iter().find_map(|status| status.clone().err());
        let admitted = outcomes
            .iter()
            .zip(rules)
            .all(|(outcome, rule)| outcome.result.granted > 0 || rule.dry_run);
        if failed.is_none() && admitted {
            return Ok(outcomes);
        }
        // Not all: give back what the other groups were charged.
        let charged: Vec<Vec<(usize, &ResolvedRule<'_>)>> = groups
            .iter()
            .zip(&status)
            .filter(|(group, status)| {
                status.is_ok()
                    && group.iter().any(|&(index, _)| {
                        outcomes
                            .get(index)
                            .is_some_and(|outcome| outcome.result.granted > 0)
                    })
            })
            .map(|(group, _)| group.clone())
            .collect();
        let (released, status) = self
            .call_groups(Op::Release(&outcomes), &charged, rules.len(), now_us)
            .await;
        for (group, status) in charged.iter().zip(status) {
            if let Err(error) = status {
                tracing::warn!(%error, rules = group.len(), "cluster compensation failed: tokens stay charged");
            }
            for &(index, _) in group {
                if let (Some(slot), Some(after)) = (outcomes.get_mut(index), released.get(index)) {
                    *slot = Outcome {
                        result: RuleResult {
                            allowed: true,
                            ..after.result
                        },
                        mark: Mark::default(),
                    };
                }
            }
        }
        match failed {
            Some(error) => Err(error),
            None => Ok(outcomes),
        }
    }

    /// [`RedisStore::acquire_at`], the results only.
    pub async fn check_at(
        &self,
        rules: &[ResolvedRule<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<RuleResult>, StoreError> {
        Ok(self
            .acquire_at(rules, now_us)
            .await?
            .into_iter()
            .map(|outcome| outcome.result)
            .collect())
    }

    /// [`Store::charge`] on the script's clock `now_us` when given. One call on a single
    /// server (atomic); one per key on a cluster.
    pub async fn charge_at(
        &self,
        rules: &[ResolvedRule<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<RuleResult>, StoreError> {
        super::refuse_debtless(rules)?;
        self.each_group(Op::Charge, rules, now_us).await
    }

    /// Gives back the grants of `outcomes` (from [`RedisStore::acquire_at`] on the same
    /// rules), on the script's clock `now_us` when given; answers what each rule has after.
    pub async fn release_at(
        &self,
        rules: &[ResolvedRule<'_>],
        outcomes: &[Outcome],
        now_us: Option<u64>,
    ) -> Result<Vec<RuleResult>, StoreError> {
        self.each_group(Op::Release(outcomes), rules, now_us).await
    }

    /// [`Store::renew`] on the script's clock `now_us` when given. One call on a single
    /// server (atomic); one per key on a cluster.
    pub async fn renew_at(
        &self,
        rules: &[ResolvedRule<'_>],
        places: &[Mark],
        now_us: Option<u64>,
    ) -> Result<Vec<Outcome>, StoreError> {
        self.each_group_outcomes(Op::Renew(places), rules, now_us)
            .await
    }

    /// [`Store::spend`] on the script's clock `now_us` when given. One atomic call on a
    /// single server. On a cluster one call per key, each with its quota rules as shadow
    /// ones (a key cannot see the others' quota rules); the call is then decided over
    /// every answer, and when it is refused the takes other keys kept are given back (the
    /// counts stay, as on a single server).
    pub async fn spend_at(
        &self,
        rules: &[ResolvedRule<'_>],
        how: &[Spending],
        now_us: Option<u64>,
    ) -> Result<Spent, StoreError> {
        if how.len() != rules.len() {
            return Err(StoreError::Internal(format!(
                "{} spendings for {} rules",
                how.len(),
                rules.len()
            )));
        }
        let counts: Vec<bool> = how
            .iter()
            .map(|spending| spending.spend == Spend::Count)
            .collect();
        diana_core::quota::table::debtless(rules, Some(&counts))
            .map_err(|refused| StoreError::Unsupported(refused.to_string()))?;
        let groups = groups_by_key(rules);
        if !self.is_cluster() || groups.len() == 1 {
            let all: Vec<(usize, &ResolvedRule<'_>)> = rules.iter().enumerate().collect();
            let outcomes = self.call(Op::Spend(how), &all, now_us).await?;
            let passed: Vec<bool> = outcomes.iter().map(|o| o.result.allowed).collect();
            let admitted = decide::admits(how, &passed);
            return Ok(Spent { outcomes, admitted });
        }
        let local: Vec<Spending> = how
            .iter()
            .map(|spending| Spending {
                enforcement: match spending.enforcement {
                    Enforcement::Quota => Enforcement::Shadow,
                    other => other,
                },
                ..*spending
            })
            .collect();
        let (mut outcomes, status) = self
            .call_groups(Op::Spend(&local), &groups, rules.len(), now_us)
            .await;
        let failed = status.iter().find_map(|status| status.clone().err());
        let passed: Vec<bool> = outcomes.iter().map(|o| o.result.allowed).collect();
        let admitted = failed.is_none() && decide::admits(how, &passed);
        if !admitted {
            // The takes other keys kept go back; the counts stay.
            let mut takes = outcomes.clone();
            for (outcome, spending) in takes.iter_mut().zip(how) {
                if spending.spend != Spend::Take {
                    outcome.result.granted = 0;
                }
            }
            let kept: Vec<Vec<(usize, &ResolvedRule<'_>)>> = groups
                .iter()
                .zip(&status)
                .filter(|(group, status)| {
                    status.is_ok()
                        && group.iter().any(|&(index, _)| {
                            takes
                                .get(index)
                                .is_some_and(|outcome| outcome.result.granted > 0)
                        })
                })
                .map(|(group, _)| group.clone())
                .collect();
            let (_, status) = self
                .call_groups(Op::Release(&takes), &kept, rules.len(), now_us)
                .await;
            for (group, status) in kept.iter().zip(status) {
                if let Err(error) = status {
                    tracing::warn!(%error, rules = group.len(), "cluster compensation failed: tokens stay charged");
                }
            }
            for (outcome, take) in outcomes.iter_mut().zip(&takes) {
                if take.result.granted > 0 {
                    outcome.result.granted = 0;
                    outcome.mark = Mark::default();
                }
            }
        }
        match failed {
            Some(error) => Err(error),
            None => Ok(Spent { outcomes, admitted }),
        }
    }

    /// One call for every rule (a single server), or one per key (a cluster).
    async fn each_group(
        &self,
        op: Op<'_>,
        rules: &[ResolvedRule<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<RuleResult>, StoreError> {
        let outcomes = self.each_group_outcomes(op, rules, now_us).await?;
        Ok(outcomes.into_iter().map(|outcome| outcome.result).collect())
    }

    /// [`RedisStore::each_group`], with where each grant was counted.
    async fn each_group_outcomes(
        &self,
        op: Op<'_>,
        rules: &[ResolvedRule<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<Outcome>, StoreError> {
        let groups = if self.is_cluster() {
            groups_by_key(rules)
        } else {
            vec![rules.iter().enumerate().collect()]
        };
        let (outcomes, status) = self.call_groups(op, &groups, rules.len(), now_us).await;
        for status in status {
            status?;
        }
        Ok(outcomes)
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn check_and_update(
        &self,
        rules: &[ResolvedRule<'_>],
    ) -> Result<Vec<Outcome>, StoreError> {
        self.acquire_at(rules, None).await
    }

    async fn charge(&self, rules: &[ResolvedRule<'_>]) -> Result<Vec<RuleResult>, StoreError> {
        self.charge_at(rules, None).await
    }

    async fn release(
        &self,
        rules: &[ResolvedRule<'_>],
        outcomes: &[Outcome],
    ) -> Result<(), StoreError> {
        self.release_at(rules, outcomes, None).await.map(|_| ())
    }

    async fn renew(
        &self,
        rules: &[ResolvedRule<'_>],
        places: &[Mark],
    ) -> Result<Vec<Outcome>, StoreError> {
        self.renew_at(rules, places, None).await
    }

    async fn spend(
        &self,
        rules: &[ResolvedRule<'_>],
        how: &[Spending],
    ) -> Result<Spent, StoreError> {
        self.spend_at(rules, how, None).await
    }

    async fn note_call(&self, call: &str, grants: &[Grant]) -> Result<Noted, StoreError> {
        let key = call_key(call);
        let tag = format!("call:{call}");
        let mut invocation = self.calls_script.prepare_invoke();
        invocation
            .key(&key)
            .arg("note")
            .arg(ledger::encode(grants))
            .arg(CALL_MEMORY.whole_millis());
        let released: i64 = self
            .query(Some(&tag), |mut conn| async move {
                invocation.invoke_async(&mut conn).await
            })
            .await?;
        Ok(if released == 1 {
            Noted::AlreadyReleased
        } else {
            Noted::Kept
        })
    }

    async fn take_call(&self, call: &str) -> Result<Option<Vec<Grant>>, StoreError> {
        let key = call_key(call);
        let tag = format!("call:{call}");
        let mut invocation = self.calls_script.prepare_invoke();
        invocation
            .key(&key)
            .arg("take")
            .arg(RELEASED)
            .arg(CALL_MEMORY.whole_millis());
        let held: Option<String> = self
            .query(Some(&tag), |mut conn| async move {
                invocation.invoke_async(&mut conn).await
            })
            .await?;
        Ok(held.as_deref().and_then(ledger::decode))
    }

    async fn take_part(
        &self,
        call: &str,
        rule: usize,
        tokens: u32,
        counter: CounterDigest,
    ) -> Result<Part, StoreError> {
        let key = call_key(call);
        let tag = format!("call:{call}");
        let mut invocation = self.calls_script.prepare_invoke();
        invocation
            .key(&key)
            .arg("part")
            .arg(rule)
            .arg(tokens)
            .arg(counter.hex())
            .arg(CALL_MEMORY.whole_millis());
        let found: Option<String> = self
            .query(Some(&tag), |mut conn| async move {
                invocation.invoke_async(&mut conn).await
            })
            .await?;
        Ok(ledger::part_of_reply(found.as_deref()))
    }

    async fn health(&self) -> Result<(), StoreError> {
        self.query(None, |mut conn| async move {
            redis::cmd("PING").query_async::<Value>(&mut conn).await
        })
        .await
        .map(|_| ())
    }

    fn describe(&self) -> String {
        self.description.clone()
    }

    fn breakers(&self) -> Option<&dyn FleetBreakers> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use diana_core::time::Unit;
    use diana_core::wire::RuleRequest;
    use std::num::NonZeroU32;

    fn limit(rpu: u32, unit: Unit, burst: u32, slices: u32) -> Limit {
        Limit {
            rpu: NonZeroU32::new(rpu).unwrap(),
            unit,
            burst: NonZeroU32::new(burst).unwrap(),
            slices: NonZeroU32::new(slices).unwrap(),
            calendar: None,
            period: None,
        }
    }

    #[test]
    fn urls() {
        assert_eq!(
            RedisTarget::parse("redis://127.0.0.1:6379/2").unwrap(),
            RedisTarget::Single("redis://127.0.0.1:6379/2".to_string())
        );
        assert_eq!(
            RedisTarget::parse("redis+cluster://a:7000, b:7001").unwrap(),
            RedisTarget::Cluster(vec![
                "redis://a:7000".to_string(),
                "redis://b:7001".to_string()
            ])
        );
        let secret = RedisTarget::parse("redis+cluster://u:pw@a:7000,b:7001").unwrap();
        assert_eq!(
            secret,
            RedisTarget::Cluster(vec![
                "redis://u:pw@a:7000".to_string(),
                "redis://u:pw@b:7001".to_string()
            ])
        );
        assert_eq!(
            secret.describe(),
            "redis cluster [redis://***@a:7000, redis://***@b:7001]"
        );
        assert_eq!(
            RedisTarget::parse("redis://:pw@h:1").unwrap().describe(),
            "redis://***@h:1"
        );
        assert!(matches!(
            RedisTarget::parse("redis+cluster://"),
            Err(RedisUrlError::NoClusterNode { .. })
        ));
        assert!(matches!(
            RedisTarget::parse("http://x:1"),
            Err(RedisUrlError::Unsupported { .. })
        ));
        assert!(matches!(
            RedisTarget::parse("redis://h:notaport"),
            Err(RedisUrlError::Invalid { .. })
        ));
        // The credentials are never shown.
        let refused = RedisTarget::parse("memcached://u:pw@x:1").unwrap_err();
        assert!(
            refused
                .to_string()
                .starts_with("memcached://***@x:1: unsupported"),
            "{refused}"
        );
        let refused = RedisTarget::parse("redis://u:pw@h:notaport").unwrap_err();
        assert!(!refused.to_string().contains("pw"), "{refused}");
    }

    #[test]
    fn every_algorithm_has_a_script() {
        for algo in diana_core::algo::REGISTRY.iter() {
            assert!(
                lua_algorithm(algo.code()).is_some(),
                "no Lua algorithm for {}",
                algo.code()
            );
            assert!(
                SCRIPT.contains(&format!("ALGOS.{} = {{", algo.code())),
                "the script does not define ALGOS.{}",
                algo.code()
            );
        }
    }

    #[test]
    fn parameters_are_exact() {
        // 10 per second, burst 10: T = 100 ms, B = 1 s.
        assert_eq!(
            gcra_params(&limit(10, Unit::Second, 10, 1)),
            vec![10, 100_000, 0, 1_000_000, 0]
        );
        // 3 per second: T = 333333 + 1/3 µs, B = 2·T = 666666 + 2/3 µs.
        assert_eq!(
            gcra_params(&limit(3, Unit::Second, 2, 1)),
            vec![3, 333_333, 1, 666_666, 2]
        );
        // 7 per day, burst 4e9: B is clamped.
        let params = gcra_params(&limit(7, Unit::Day, 4_000_000_000, 1));
        assert_eq!((params[3], params[4]), (MAX_TOLERANCE_US, 0));
        assert_eq!(
            window_params(&limit(5, Unit::Minute, 1, 1)),
            vec![5, 60_000_000, 0]
        );
        assert_eq!(
            sliding_params(&limit(5, Unit::Hour, 1, 6)),
            vec![5, 3_600_000_000, 6]
        );
    }

    #[test]
    fn marks_travel_both_ways() {
        let l = limit(3, Unit::Second, 2, 1);
        // An instant of 1 000 000 µs + 2/3 µs, × rpu in ns.
        let mark = MarkForm::Instant.to_mark(&l, 1_000_000, 2);
        assert_eq!(mark, Mark((1_000_000 * 3 + 2) * 1_000));
        assert_eq!(MarkForm::Instant.to_lua(&l, mark), (1_000_000, 2));
        assert_eq!(MarkForm::Index.to_mark(&l, 42, 0), Mark(42));
        assert_eq!(MarkForm::Index.to_lua(&l, Mark(42)), (42, 0));
    }

    #[test]
    fn replies() {
        let request = RuleRequest {
            place: None,
            key: "k".to_string(),
            algo: "TB".to_string(),
            rpu: 10,
            unit: "second".to_string(),
            burst: 10,
            slices: 1,
            want: 3,
            cost: 1,
            max_delay_ms: None,
            dry_run: false,
            period: None,
        };
        let rule = request.resolve(0).unwrap();
        let result = to_outcome(Op::Acquire, 0, &rule, &[1, 2, 8, 1_500, 0, 0, 0, 0])
            .unwrap()
            .result;
        assert_eq!(
            result,
            RuleResult {
                place: None,
                allowed: true,
                granted: 2,
                remaining: 8,
                reset_ms: 2,
                retry_after_ms: 0,
                delay_ms: 0
            }
        );
        let denied = to_outcome(Op::Acquire, 0, &rule, &[0, 0, 0, 999_001, 1, 5, 0, 0])
            .unwrap()
            .result;
        assert_eq!(
            (
                denied.allowed,
                denied.reset_ms,
                denied.retry_after_ms,
                denied.delay_ms
            ),
            (false, 1000, 1, 0)
        );
        // Spared: allowed, nothing granted, no retry.
        let spared = to_outcome(Op::Acquire, 0, &rule, &[1, 0, 5, 10, 99, 0, 0, 0])
            .unwrap()
            .result;
        assert_eq!(
            (spared.allowed, spared.granted, spared.retry_after_ms),
            (true, 0, 0)
        );
        // A charge keeps its retry.
        let charged = to_outcome(Op::Charge, 0, &rule, &[1, 3, 0, 10, 2_001, 0, 0, 0])
            .unwrap()
            .result;
        assert_eq!((charged.granted, charged.retry_after_ms), (3, 3));
        // Never more than asked, whatever the script says.
        let greedy = to_outcome(Op::Acquire, 0, &rule, &[1, 9, 0, 0, 0, 0, 0, 0]).unwrap();
        assert_eq!(greedy.result.granted, 3);
        assert!(outcomes(Op::Acquire, &[(3, &rule)], &[1, 2])
            .unwrap_err()
            .to_string()
            .contains("2 values for 1 rules"));
    }

    #[test]
    fn keys_are_bound_to_the_parameters() {
        let request = |algo: &str, rpu: u32, unit: &str, burst: u32, slices: u32| RuleRequest {
            place: None,
            key: "8f3a:5c1e".to_string(),
            algo: algo.to_string(),
            rpu,
            unit: unit.to_string(),
            burst,
            slices,
            want: 1,
            cost: 1,
            max_delay_ms: None,
            dry_run: false,
            period: None,
        };
        let key = |r: RuleRequest| redis_key(&r.resolve(0).unwrap());
        assert_eq!(
            key(request("TB", 10, "second", 10, 10)),
            "diana:{8f3a:5c1e}:TB:10:second:10:10"
        );
        // Aliases and spellings resolve first: one counter.
        assert_eq!(
            key(request("token bucket", 10, "Seconds", 10, 10)),
            "diana:{8f3a:5c1e}:TB:10:second:10:10"
        );
        // Any other parameter: another key, in the same slot.
        let others = [
            request("LB", 10, "second", 10, 10),
            request("TB", 11, "second", 10, 10),
            request("TB", 10, "minute", 10, 10),
            request("TB", 10, "second", 9, 10),
            request("TB", 10, "second", 10, 9),
        ];
        for other in others {
            let name = key(other);
            assert_ne!(name, "diana:{8f3a:5c1e}:TB:10:second:10:10");
            assert!(name.starts_with("diana:{8f3a:5c1e}:"), "{name}");
        }
    }

    #[test]
    fn only_fixed_window_acquires_take_the_lean_script() {
        let request = |algo: &str| RuleRequest {
            place: None,
            key: "k".to_string(),
            algo: algo.to_string(),
            rpu: 5,
            unit: "minute".to_string(),
            burst: 1,
            slices: 1,
            want: 2,
            cost: 1,
            max_delay_ms: None,
            dry_run: true,
            period: None,
        };
        let (w, tb) = (request("W"), request("TB"));
        let (w, tb) = (w.resolve(0).unwrap(), tb.resolve(0).unwrap());
        let windows = [(0, &w), (1, &w)];
        assert!(takes_lean_window(Op::Acquire, &windows));
        assert!(!takes_lean_window(Op::Acquire, &[(0, &w), (1, &tb)]));
        assert!(!takes_lean_window(Op::Acquire, &[]));
        assert!(!takes_lean_window(Op::Charge, &windows));
        assert!(!takes_lean_window(Op::Release(&[]), &windows));
    }

    #[test]
    fn rules_are_grouped_by_key() {
        let rule = |key: &str| RuleRequest {
            place: None,
            key: key.to_string(),
            algo: "W".to_string(),
            rpu: 1,
            unit: "second".to_string(),
            burst: 1,
            slices: 1,
            want: 1,
            cost: 1,
            max_delay_ms: None,
            dry_run: false,
            period: None,
        };
        let requests = [rule("a"), rule("b"), rule("a"), rule("c")];
        let rules: Vec<_> = requests.iter().map(|r| r.resolve(0).unwrap()).collect();
        let groups: Vec<Vec<usize>> = groups_by_key(&rules)
            .iter()
            .map(|group| group.iter().map(|(index, _)| *index).collect())
            .collect();
        assert_eq!(groups, vec![vec![0, 2], vec![1], vec![3]]);
    }
}
