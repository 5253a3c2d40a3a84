//! Counters in Redis or Redis Cluster. Each rule is one atomic Lua script (one script per
//! algorithm, `lua/*.lua`), run by `EVALSHA` and reloaded on `NOSCRIPT`; the time is the
//! Redis server's (`TIME`), so gateways with skewed clocks agree. Keys are
//! `diana:{<key>}:<algo>`: the hash tag keeps every key of one counter in one cluster slot.
//!
//! A single server gets all rules of a request in one pipeline; a cluster gets the rules'
//! scripts concurrently (they may live on different nodes).
//!
//! Connections are made lazily, with short timeouts, and dropped on any connection-level
//! error, so a dead or slow Redis costs one short timeout (then a fast 503 while the
//! reconnect back-off runs) and a restarted Redis is picked up by the next request.

use super::{Store, StoreError};
use async_trait::async_trait;
use diana_core::algo::Limit;
use diana_core::global::wire::{ResolvedRule, RuleResult};
use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{
    AsyncConnectionConfig, ErrorKind, RedisError, RedisResult, Script, ScriptInvocation,
    ServerErrorKind,
};
use std::future::Future;
use std::time::{Duration, Instant};

/// Where Redis is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// `redis://[user:password@]host:port[/db]`
    Single(String),
    /// `redis+cluster://[user:password@]h1:p1,h2:p2,…`: the seed nodes, each as a `redis://` URL.
    Cluster(Vec<String>),
}

impl RedisTarget {
    /// Parses `redis://host:port[/db]` or `redis+cluster://h1:p1,h2:p2`.
    pub fn parse(url: &str) -> Result<RedisTarget, String> {
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
                return Err(format!(
                    "{}: no cluster node (expected redis+cluster://h1:p1,h2:p2)",
                    redact(url)
                ));
            }
            for node in &nodes {
                redis::Client::open(node.as_str())
                    .map_err(|error| format!("{}: {error}", redact(node)))?;
            }
            return Ok(RedisTarget::Cluster(nodes));
        }
        if url.starts_with("redis://") {
            redis::Client::open(url).map_err(|error| format!("{}: {error}", redact(url)))?;
            return Ok(RedisTarget::Single(url.to_string()));
        }
        Err(format!(
            "{}: unsupported Redis URL (expected redis://host:port[/db] or redis+cluster://h1:p1,h2:p2)",
            redact(url)
        ))
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

/// Timeouts of the Redis store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisOptions {
    /// Longest wait for a TCP connection (and handshake) to Redis.
    pub connect_timeout: Duration,
    /// Longest wait for an answer from Redis.
    pub response_timeout: Duration,
    /// After a failed connection attempt, requests fail at once for this long before the
    /// next attempt (so a dead Redis costs one timeout, not one per request).
    pub reconnect_backoff: Duration,
}

impl Default for RedisOptions {
    fn default() -> Self {
        RedisOptions {
            connect_timeout: Duration::from_millis(200),
            response_timeout: Duration::from_millis(250),
            reconnect_backoff: Duration::from_millis(100),
        }
    }
}

impl RedisOptions {
    /// The longest a decision can take: a connection plus an answer (plus a NOSCRIPT reload).
    pub fn deadline(&self) -> Duration {
        self.connect_timeout + self.response_timeout * 2 + Duration::from_millis(50)
    }
}

// ---------------------------------------------------------------------------------------
// Scripts: one per algorithm, found by the algorithm's code (open–closed: a new algorithm
// is a new script and one entry in LUA_ALGORITHMS).

/// An algorithm as a Lua script: its code, source and argument builder.
struct LuaAlgorithm {
    code: &'static str,
    /// The script as Redis runs it, see `lua_script!`.
    source: &'static str,
    /// ARGV (before the optional test clock) for a limit and a `want`.
    args: fn(&Limit, u32) -> Vec<u64>,
}

/// A script as Redis runs it (and hashes it for `EVALSHA`): the helpers every script shares,
/// `lua/common.lua`, then the algorithm's own `lua/<name>.lua`.
macro_rules! lua_script {
    ($name:literal) => {
        concat!(
            include_str!("../../lua/common.lua"),
            include_str!(concat!("../../lua/", $name, ".lua"))
        )
    };
}

static LUA_ALGORITHMS: [LuaAlgorithm; 4] = [
    LuaAlgorithm {
        code: "W",
        source: lua_script!("window"),
        args: window_args,
    },
    LuaAlgorithm {
        code: "SW",
        source: lua_script!("sliding"),
        args: sliding_args,
    },
    LuaAlgorithm {
        code: "LB",
        source: lua_script!("leaky"),
        args: gcra_args,
    },
    LuaAlgorithm {
        code: "TB",
        source: lua_script!("token"),
        args: gcra_args,
    },
];

const MICROS_PER_SECOND: u64 = 1_000_000;
/// Largest GCRA tolerance passed to the scripts (keeps every Lua number below 2^53).
const MAX_TOLERANCE_US: u64 = 1 << 50;

fn unit_micros(limit: &Limit) -> u64 {
    limit.unit.seconds() * MICROS_PER_SECOND
}

/// window.lua: rpu, unit_us, want.
fn window_args(limit: &Limit, want: u32) -> Vec<u64> {
    vec![
        u64::from(limit.rpu.get()),
        unit_micros(limit),
        u64::from(want),
    ]
}

/// sliding.lua: rpu, unit_us, slices, want.
fn sliding_args(limit: &Limit, want: u32) -> Vec<u64> {
    vec![
        u64::from(limit.rpu.get()),
        unit_micros(limit),
        u64::from(limit.slices.get()),
        u64::from(want),
    ]
}

/// token.lua / leaky.lua: rpu, T = unit/rpu and B = burst·T as (microseconds, remainder
/// over rpu), want. Computed exactly in 128 bits; B is clamped to 2^50 µs (35 years).
fn gcra_args(limit: &Limit, want: u32) -> Vec<u64> {
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
        u64::from(want),
    ]
}

struct Scripts {
    entries: Vec<(&'static LuaAlgorithm, Script)>,
}

impl Scripts {
    fn new() -> Scripts {
        Scripts {
            entries: LUA_ALGORITHMS
                .iter()
                .map(|algo| (algo, Script::new(algo.source)))
                .collect(),
        }
    }

    fn find(&self, code: &str) -> Option<&(&'static LuaAlgorithm, Script)> {
        self.entries.iter().find(|(algo, _)| algo.code == code)
    }

    /// The script and its invocation for one rule.
    fn invocation<'s>(
        &'s self,
        index: usize,
        rule: &ResolvedRule<'_>,
        now_us: Option<u64>,
    ) -> Result<(&'s Script, ScriptInvocation<'s>), StoreError> {
        let code = rule.algo.code();
        let (algo, script) = self.find(code).ok_or_else(|| {
            StoreError::Unsupported(format!(
                "rules[{index}].algo: {code} is not supported by the Redis store"
            ))
        })?;
        let mut invocation = script.prepare_invoke();
        invocation.key(format!("diana:{{{}}}:{}", rule.key, algo.code));
        for arg in (algo.args)(&rule.limit, rule.want.get()) {
            invocation.arg(arg);
        }
        if let Some(now) = now_us {
            invocation.arg(now);
        }
        Ok((script, invocation))
    }
}

/// A script's reply `{granted, remaining, reset_us, retry_after_us, delay_us}` on the wire.
fn to_result(index: usize, reply: &[i64], want: u32) -> Result<RuleResult, StoreError> {
    let &[granted, remaining, reset_us, retry_us, delay_us] = reply else {
        return Err(StoreError::Internal(format!(
            "rules[{index}]: script returned {} values, expected 5",
            reply.len()
        )));
    };
    let millis = |us: i64| u64::try_from(us).unwrap_or(0).div_ceil(1000);
    let granted = u32::try_from(granted.max(0)).unwrap_or(u32::MAX).min(want);
    Ok(RuleResult {
        allowed: granted > 0,
        granted,
        remaining: u64::try_from(remaining).unwrap_or(0),
        reset_ms: millis(reset_us),
        retry_after_ms: if granted > 0 { 0 } else { millis(retry_us) },
        delay_ms: if granted > 0 { millis(delay_us) } else { 0 },
    })
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
fn needs_reconnect(error: &RedisError) -> bool {
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

fn is_noscript(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
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

/// Counters in Redis (one server) or Redis Cluster.
pub struct RedisStore {
    backend: Backend,
    scripts: Scripts,
    options: RedisOptions,
    description: String,
}

impl RedisStore {
    /// A store for this target. Nothing is connected until the first request, so the
    /// service starts (and answers 503) while Redis is down.
    pub fn new(target: &RedisTarget, options: RedisOptions) -> Result<RedisStore, String> {
        let description = target.describe();
        let backend = match target {
            RedisTarget::Single(url) => Backend::Single {
                client: redis::Client::open(url.as_str())
                    .map_err(|error| format!("{description}: {error}"))?,
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
                    .map_err(|error| format!("{description}: {error}"))?,
                // Connecting to a cluster also reads its slot map: one more round trip.
                connection: Lazy::new(
                    description.clone(),
                    options.connect_timeout + options.response_timeout,
                    options.reconnect_backoff,
                ),
            },
        };
        Ok(RedisStore {
            backend,
            scripts: Scripts::new(),
            options,
            description,
        })
    }

    pub fn options(&self) -> RedisOptions {
        self.options
    }

    /// [`Store::check_and_update`] with the scripts' clock set to `now_us` (microseconds
    /// since the epoch) instead of Redis `TIME`. For tests that compare the scripts with
    /// the Rust algorithms on a fake clock; the service never sets it.
    pub async fn check_at(
        &self,
        rules: &[ResolvedRule<'_>],
        now_us: Option<u64>,
    ) -> Result<Vec<RuleResult>, StoreError> {
        let calls = rules
            .iter()
            .enumerate()
            .map(|(index, rule)| self.scripts.invocation(index, rule, now_us))
            .collect::<Result<Vec<_>, _>>()?;
        let replies = match &self.backend {
            Backend::Single {
                client,
                config,
                connection,
            } => {
                let (generation, mut conn) = connection
                    .get(|| client.get_multiplexed_async_connection_with_config(config))
                    .await?;
                match run_pipeline(&mut conn, &calls).await {
                    Ok(replies) => replies,
                    Err(error) => {
                        if needs_reconnect(&error) {
                            connection.invalidate(generation, &error.to_string()).await;
                        }
                        return Err(store_error(&error));
                    }
                }
            }
            Backend::Cluster { client, connection } => {
                let (generation, conn) = connection.get(|| client.get_async_connection()).await?;
                let pending = calls.iter().map(|(_, invocation)| {
                    let mut conn = conn.clone();
                    async move { invocation.invoke_async::<Vec<i64>>(&mut conn).await }
                });
                let mut replies = Vec::with_capacity(calls.len());
                for reply in futures_util::future::join_all(pending).await {
                    match reply {
                        Ok(reply) => replies.push(reply),
                        Err(error) => {
                            if needs_reconnect(&error) {
                                connection.invalidate(generation, &error.to_string()).await;
                            }
                            return Err(store_error(&error));
                        }
                    }
                }
                replies
            }
        };
        rules
            .iter()
            .zip(&replies)
            .enumerate()
            .map(|(index, (rule, reply))| to_result(index, reply, rule.want.get()))
            .collect()
    }
}

/// Runs every invocation in one pipeline. Scripts the server does not know (`NOSCRIPT`,
/// e.g. after a restart or `SCRIPT FLUSH`) are loaded and only those invocations re-run,
/// so no rule is charged twice.
async fn run_pipeline(
    conn: &mut MultiplexedConnection,
    calls: &[(&Script, ScriptInvocation<'_>)],
) -> RedisResult<Vec<Vec<i64>>> {
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    for (_, invocation) in calls {
        pipe.invoke_script(invocation);
    }
    let first: Vec<RedisResult<Vec<i64>>> = pipe.query_async(conn).await?;
    let missing: Vec<usize> = first
        .iter()
        .enumerate()
        .filter(|(_, reply)| matches!(reply, Err(error) if is_noscript(error)))
        .map(|(index, _)| index)
        .collect();
    let mut replies = first;
    if !missing.is_empty() {
        let mut loaded: Vec<&str> = Vec::new();
        let mut retry = redis::pipe();
        retry.ignore_errors();
        for &index in &missing {
            if let Some((script, invocation)) = calls.get(index) {
                if !loaded.contains(&script.get_hash()) {
                    script.load_async(conn).await?;
                    loaded.push(script.get_hash());
                }
                retry.invoke_script(invocation);
            }
        }
        let second: Vec<RedisResult<Vec<i64>>> = retry.query_async(conn).await?;
        for (index, reply) in missing.into_iter().zip(second) {
            if let Some(slot) = replies.get_mut(index) {
                *slot = reply;
            }
        }
    }
    replies.into_iter().collect()
}

#[async_trait]
impl Store for RedisStore {
    async fn check_and_update(
        &self,
        rules: &[ResolvedRule<'_>],
    ) -> Result<Vec<RuleResult>, StoreError> {
        self.check_at(rules, None).await
    }

    async fn health(&self) -> Result<(), StoreError> {
        let outcome = match &self.backend {
            Backend::Single {
                client,
                config,
                connection,
            } => {
                let (generation, mut conn) = connection
                    .get(|| client.get_multiplexed_async_connection_with_config(config))
                    .await?;
                match redis::cmd("PING").query_async::<String>(&mut conn).await {
                    Ok(_) => Ok(()),
                    Err(error) => {
                        if needs_reconnect(&error) {
                            connection.invalidate(generation, &error.to_string()).await;
                        }
                        Err(error)
                    }
                }
            }
            Backend::Cluster { client, connection } => {
                let (generation, mut conn) =
                    connection.get(|| client.get_async_connection()).await?;
                match redis::cmd("PING")
                    .query_async::<redis::Value>(&mut conn)
                    .await
                {
                    Ok(_) => Ok(()),
                    Err(error) => {
                        if needs_reconnect(&error) {
                            connection.invalidate(generation, &error.to_string()).await;
                        }
                        Err(error)
                    }
                }
            }
        };
        outcome.map_err(|error| store_error(&error))
    }

    fn describe(&self) -> String {
        self.description.clone()
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )]
    use super::*;
    use diana_core::time::Unit;
    use std::num::NonZeroU32;

    fn limit(rpu: u32, unit: Unit, burst: u32, slices: u32) -> Limit {
        Limit {
            rpu: NonZeroU32::new(rpu).unwrap(),
            unit,
            burst: NonZeroU32::new(burst).unwrap(),
            slices: NonZeroU32::new(slices).unwrap(),
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
        assert!(RedisTarget::parse("redis+cluster://")
            .unwrap_err()
            .contains("no cluster node"));
        assert!(RedisTarget::parse("http://x:1")
            .unwrap_err()
            .contains("unsupported Redis URL"));
        assert!(RedisTarget::parse("memcached://u:pw@x:1")
            .unwrap_err()
            .starts_with("memcached://***@x:1"));
    }

    #[test]
    fn every_algorithm_has_a_script() {
        for algo in diana_core::algo::REGISTRY.iter() {
            assert!(
                Scripts::new().find(algo.code()).is_some(),
                "no Lua script for {}",
                algo.code()
            );
        }
    }

    #[test]
    fn gcra_arguments_are_exact() {
        // 10 per second, burst 10: T = 100 ms, B = 1 s.
        assert_eq!(
            gcra_args(&limit(10, Unit::Second, 10, 1), 3),
            vec![10, 100_000, 0, 1_000_000, 0, 3]
        );
        // 3 per second: T = 333333 + 1/3 µs, B = 2·T = 666666 + 2/3 µs.
        assert_eq!(
            gcra_args(&limit(3, Unit::Second, 2, 1), 1),
            vec![3, 333_333, 1, 666_666, 2, 1]
        );
        // 7 per day, burst 4e9: B is clamped.
        let args = gcra_args(&limit(7, Unit::Day, 4_000_000_000, 1), 1);
        assert_eq!((args[3], args[4]), (MAX_TOLERANCE_US, 0));
        assert_eq!(
            window_args(&limit(5, Unit::Minute, 1, 1), 2),
            vec![5, 60_000_000, 2]
        );
        assert_eq!(
            sliding_args(&limit(5, Unit::Hour, 1, 6), 2),
            vec![5, 3_600_000_000, 6, 2]
        );
    }

    #[test]
    fn replies() {
        let result = to_result(0, &[2, 8, 1_500, 0, 0], 3).unwrap();
        assert_eq!(
            result,
            RuleResult {
                allowed: true,
                granted: 2,
                remaining: 8,
                reset_ms: 2,
                retry_after_ms: 0,
                delay_ms: 0
            }
        );
        let denied = to_result(0, &[0, 0, 999_001, 1, 5], 1).unwrap();
        assert_eq!(
            (
                denied.allowed,
                denied.reset_ms,
                denied.retry_after_ms,
                denied.delay_ms
            ),
            (false, 1000, 1, 0)
        );
        // Never more than asked, whatever the script says.
        assert_eq!(to_result(0, &[9, 0, 0, 0, 0], 2).unwrap().granted, 2);
        assert!(to_result(3, &[1, 2], 1)
            .unwrap_err()
            .to_string()
            .contains("rules[3]"));
    }
}
