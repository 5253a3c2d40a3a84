//! `limitador-rls`: Envoy's Rate Limit Service (gRPC
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`) answered by Kuadrant's
//! Limitador library, with its counters in Redis (`--redis`) or in memory (`--memory`).
//!
//! The request handling is that of limitador-server's `envoy_rls` module: the RLS `domain`
//! is the Limitador namespace; the request's descriptors are bound, in order, as the CEL
//! list `descriptors` (each a map of entry key → value), so a limit's conditions and
//! variables read them as `descriptors[0]['generic_key']`; `hits_addend` 0 counts as 1;
//! one `check_rate_limited_and_update` call decides OK or OVER_LIMIT; a storage error is
//! answered with gRPC UNAVAILABLE (Envoy's ratelimit filter then applies its
//! `failure_mode_deny`). See README.md.

use anyhow::{anyhow, bail, Context as _};
use clap::Parser;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use limitador::limit::{Context, Expression, Limit, Namespace, Predicate};
use limitador::storage::redis::{AsyncRedisStorage, CachedRedisStorageBuilder};
use limitador::storage::{AsyncCounterStorage, AsyncStorage};
use limitador::{AsyncRateLimiter, AsyncRateLimiterBuilder, CheckResult, RateLimiter};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use tonic::{Request, Response, Status};

/// Envoy RLS (gRPC ShouldRateLimit) on the Limitador library.
#[derive(Parser, Debug)]
#[command(name = "limitador-rls", version)]
struct Cli {
    /// Address of the gRPC server, ADDR:PORT.
    #[arg(long, default_value = "127.0.0.1:8081")]
    listen: SocketAddr,

    /// Counters in Redis at this URL (redis://HOST:PORT), with Limitador's
    /// AsyncRedisStorage: limitador-server's `redis URL` storage.
    #[arg(long, required_unless_present = "memory", conflicts_with = "memory")]
    redis: Option<String>,

    /// With --redis: Limitador's CachedRedisStorage instead (limitador-server's
    /// `redis_cached URL`: counters cached in memory, flushed to Redis in batches).
    #[arg(long, requires = "redis")]
    redis_cached: bool,

    /// Counters in this process's memory (limitador-server's `memory` storage).
    #[arg(long)]
    memory: bool,

    /// Size of the in-memory counter cache (--memory).
    #[arg(long, default_value_t = 10_000)]
    cache_size: u64,

    /// A limit, NAMESPACE:MAX_VALUE:SECONDS[:ITEM[,ITEM...]] (repeatable). NAMESPACE is the
    /// Envoy RLS domain. Each ITEM reads the request's first descriptor: KEY=VALUE is the
    /// condition `descriptors[0]['KEY'] == 'VALUE'`, a bare KEY the variable
    /// `descriptors[0]['KEY']` (one counter per value; requests without KEY are not
    /// counted). E.g. `bench:1000000:1:generic_key=bench`.
    #[arg(long = "limit", value_name = "SPEC")]
    limits: Vec<String>,

    /// A limits file in limitador-server's format: a YAML (or JSON) list of
    /// {namespace, max_value, seconds, conditions: [CEL], variables: [CEL], name?}.
    #[arg(long, value_name = "FILE")]
    limits_file: Option<PathBuf>,
}

/// The two kinds of limiter limitador-server runs: blocking (memory) and async (Redis).
enum Limiter {
    Blocking(RateLimiter),
    Async(AsyncRateLimiter),
}

impl Limiter {
    async fn build(cli: &Cli) -> anyhow::Result<(Self, &'static str)> {
        if let Some(url) = &cli.redis {
            let counters: Box<dyn AsyncCounterStorage> = if cli.redis_cached {
                Box::new(
                    CachedRedisStorageBuilder::new(url)
                        .build()
                        .await
                        .with_context(|| format!("cannot connect to Redis at {url}"))?,
                )
            } else {
                Box::new(
                    AsyncRedisStorage::new(url)
                        .await
                        .with_context(|| format!("cannot connect to Redis at {url}"))?,
                )
            };
            let storage = AsyncStorage::with_counter_storage(counters);
            let name = if cli.redis_cached {
                "redis_cached"
            } else {
                "redis"
            };
            Ok((
                Self::Async(AsyncRateLimiterBuilder::new(storage).build()),
                name,
            ))
        } else if cli.memory {
            Ok((Self::Blocking(RateLimiter::new(cli.cache_size)), "memory"))
        } else {
            bail!("one of --redis URL or --memory is required")
        }
    }

    async fn configure(&self, limits: Vec<Limit>) -> anyhow::Result<()> {
        match self {
            Self::Blocking(l) => l.configure_with(limits),
            Self::Async(l) => l.configure_with(limits).await,
        }
        .map_err(|e| anyhow!("cannot configure the limits: {e}"))
    }

    async fn check_and_update(
        &self,
        namespace: &Namespace,
        ctx: &Context<'_>,
        hits: u64,
    ) -> Result<CheckResult, limitador::errors::LimitadorError> {
        match self {
            Self::Blocking(l) => l.check_rate_limited_and_update(namespace, ctx, hits),
            Self::Async(l) => l.check_rate_limited_and_update(namespace, ctx, hits).await,
        }
    }
}

/// A CEL string literal (single-quoted) holding `s`.
fn cel_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('\'');
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\'' => out.push_str("\\'"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            _ => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// `NAMESPACE:MAX_VALUE:SECONDS[:ITEM[,ITEM...]]` → a Limitador limit (see `--limit`).
fn parse_limit_spec(spec: &str) -> anyhow::Result<Limit> {
    let mut parts = spec.splitn(4, ':');
    let (Some(namespace), Some(max_value), Some(seconds)) =
        (parts.next(), parts.next(), parts.next())
    else {
        bail!("limit {spec:?}: expected NAMESPACE:MAX_VALUE:SECONDS[:ITEM,...]");
    };
    if namespace.is_empty() {
        bail!("limit {spec:?}: empty namespace");
    }
    let max_value: u64 = max_value
        .parse()
        .with_context(|| format!("limit {spec:?}: MAX_VALUE {max_value:?} is not a number"))?;
    let seconds: u64 = seconds
        .parse()
        .with_context(|| format!("limit {spec:?}: SECONDS {seconds:?} is not a number"))?;
    if seconds == 0 {
        bail!("limit {spec:?}: SECONDS must be at least 1");
    }
    let mut conditions = Vec::new();
    let mut variables = Vec::new();
    for item in parts
        .next()
        .unwrap_or("")
        .split(',')
        .filter(|s| !s.is_empty())
    {
        match item.split_once('=') {
            Some((key, value)) if !key.is_empty() => {
                let source = format!("descriptors[0][{}] == {}", cel_str(key), cel_str(value));
                conditions.push(
                    Predicate::parse(&source)
                        .map_err(|e| anyhow!("limit {spec:?}: condition {source}: {e}"))?,
                );
            }
            Some(_) => bail!("limit {spec:?}: item {item:?} has an empty key"),
            None => {
                let source = format!("descriptors[0][{}]", cel_str(item));
                variables.push(
                    Expression::parse(&source)
                        .map_err(|e| anyhow!("limit {spec:?}: variable {source}: {e}"))?,
                );
            }
        }
    }
    Ok(Limit::new(
        namespace, max_value, seconds, conditions, variables,
    ))
}

fn load_limits(cli: &Cli) -> anyhow::Result<Vec<Limit>> {
    let mut limits = Vec::new();
    for spec in &cli.limits {
        limits.push(parse_limit_spec(spec)?);
    }
    if let Some(path) = &cli.limits_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the limits file {}", path.display()))?;
        let parsed: Vec<Limit> = serde_yaml::from_str(&text)
            .with_context(|| format!("cannot parse the limits file {}", path.display()))?;
        limits.extend(parsed);
    }
    Ok(limits)
}

fn reply(code: Code) -> Response<RateLimitResponse> {
    Response::new(RateLimitResponse {
        overall_code: code.into(),
        ..Default::default()
    })
}

struct Rls {
    limiter: Limiter,
    storage_errors: AtomicU64,
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = request.into_inner();
        // As limitador-server: no domain, no namespace → UNKNOWN (Envoy lets it pass).
        if req.domain.is_empty() {
            return Ok(reply(Code::Unknown));
        }
        let namespace = Namespace::from(req.domain);
        let descriptors: Vec<HashMap<String, String>> = req
            .descriptors
            .into_iter()
            .map(|d| d.entries.into_iter().map(|e| (e.key, e.value)).collect())
            .collect();
        // hits_addend is optional in the protocol and means 1 when unset (0 on the wire).
        // A descriptor's own `limit`, `hits_addend` and `is_negative_hits` (newer Envoy
        // APIs) are ignored, as by limitador-server: one call checks every descriptor.
        let hits = u64::from(req.hits_addend.max(1));
        let mut ctx = Context::default();
        ctx.list_binding("descriptors".to_string(), descriptors);

        match self.limiter.check_and_update(&namespace, &ctx, hits).await {
            Ok(result) if result.limited => Ok(reply(Code::OverLimit)),
            Ok(_) => Ok(reply(Code::Ok)),
            Err(error) => {
                // UNAVAILABLE, not UNKNOWN: Envoy counts it as an error and applies
                // failure_mode_deny (limitador-server does the same). Logged on the 1st,
                // 2nd, 4th, 8th … error, so an outage does not flood the log.
                let n = self.storage_errors.fetch_add(1, Ordering::Relaxed) + 1;
                if n.is_power_of_two() {
                    eprintln!("limitador-rls: storage error #{n}: {error}");
                }
                Err(Status::unavailable("rate limit storage unavailable"))
            }
        }
    }
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(error) => {
                eprintln!("limitador-rls: cannot watch SIGTERM ({error}); Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let limits = load_limits(&cli)?;
    let (limiter, storage) = Limiter::build(&cli).await?;
    if limits.is_empty() {
        eprintln!("limitador-rls: warning: no limits; every request is answered OK");
    }
    let n_limits = limits.len();
    limiter.configure(limits).await?;
    let service = RateLimitServiceServer::new(Rls {
        limiter,
        storage_errors: AtomicU64::new(0),
    });
    // Bind first, so that a port that accepts connections means the service is ready.
    let listener = tokio::net::TcpListener::bind(cli.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cli.listen))?;
    eprintln!(
        "limitador-rls: {n_limits} limit(s), storage {storage}, gRPC on {}",
        listener.local_addr().unwrap_or(cli.listen)
    );
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, shutdown_signal())
        .await
        .context("gRPC server failed")?;
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("limitador-rls: cannot start the runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("limitador-rls: {error:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::{
        rate_limit_descriptor::Entry, RateLimitDescriptor,
    };

    fn rls(specs: &[&str]) -> Rls {
        let limiter = RateLimiter::new(1000);
        for spec in specs {
            limiter.add_limit(parse_limit_spec(spec).unwrap());
        }
        Rls {
            limiter: Limiter::Blocking(limiter),
            storage_errors: AtomicU64::new(0),
        }
    }

    fn request(
        domain: &str,
        entries: &[(&str, &str)],
        hits_addend: u32,
    ) -> Request<RateLimitRequest> {
        Request::new(RateLimitRequest {
            domain: domain.to_string(),
            descriptors: vec![RateLimitDescriptor {
                entries: entries
                    .iter()
                    .map(|(k, v)| Entry {
                        key: k.to_string(),
                        value: v.to_string(),
                    })
                    .collect(),
                ..Default::default()
            }],
            hits_addend,
        })
    }

    async fn code(rls: &Rls, req: Request<RateLimitRequest>) -> Code {
        let resp = rls.should_rate_limit(req).await.unwrap().into_inner();
        Code::try_from(resp.overall_code).unwrap()
    }

    #[test]
    fn parses_specs() {
        let l = parse_limit_spec("bench:5:60:generic_key=bench").unwrap();
        assert_eq!(l.namespace().as_ref(), "bench");
        assert_eq!((l.max_value(), l.seconds()), (5, 60));
        assert_eq!(l.conditions().len(), 1);
        assert!(l.variables().is_empty());
        let l = parse_limit_spec("ns:1:1:a,b=it's").unwrap();
        assert_eq!(l.variables().len(), 1);
        assert_eq!(l.conditions().len(), 1);
        assert!(parse_limit_spec("ns:1:1").unwrap().conditions().is_empty());
        for bad in ["ns:1", ":1:1", "ns:x:1", "ns:1:0", "ns:1:1:=v"] {
            assert!(parse_limit_spec(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn ok_then_over_limit() {
        let rls = rls(&["bench:5:60:generic_key=bench"]);
        for _ in 0..5 {
            assert_eq!(
                code(&rls, request("bench", &[("generic_key", "bench")], 0)).await,
                Code::Ok
            );
        }
        assert_eq!(
            code(&rls, request("bench", &[("generic_key", "bench")], 1)).await,
            Code::OverLimit
        );
        // Another descriptor value or domain does not match the limit.
        assert_eq!(
            code(&rls, request("bench", &[("generic_key", "other")], 1)).await,
            Code::Ok
        );
        assert_eq!(
            code(&rls, request("other", &[("generic_key", "bench")], 1)).await,
            Code::Ok
        );
        assert_eq!(
            code(&rls, request("", &[("generic_key", "bench")], 1)).await,
            Code::Unknown
        );
    }

    #[tokio::test]
    async fn hits_addend_counts() {
        let rls = rls(&["ns:10:60:k=v"]);
        assert_eq!(code(&rls, request("ns", &[("k", "v")], 6)).await, Code::Ok);
        assert_eq!(
            code(&rls, request("ns", &[("k", "v")], 6)).await,
            Code::OverLimit
        );
        assert_eq!(code(&rls, request("ns", &[("k", "v")], 4)).await, Code::Ok);
    }

    #[tokio::test]
    async fn variables_count_per_value() {
        let rls = rls(&["ns:1:60:user"]);
        assert_eq!(
            code(&rls, request("ns", &[("user", "a")], 1)).await,
            Code::Ok
        );
        assert_eq!(
            code(&rls, request("ns", &[("user", "b")], 1)).await,
            Code::Ok
        );
        assert_eq!(
            code(&rls, request("ns", &[("user", "a")], 1)).await,
            Code::OverLimit
        );
        // Without the key the limit does not apply.
        assert_eq!(
            code(&rls, request("ns", &[("other", "a")], 1)).await,
            Code::Ok
        );
    }

    #[test]
    fn limits_file_format() {
        let yaml = "- namespace: bench\n  max_value: 3\n  seconds: 1\n  conditions: [\"descriptors[0]['generic_key'] == 'bench'\"]\n  variables: []\n";
        let limits: Vec<Limit> = serde_yaml::from_str(yaml).unwrap();
        assert_eq!(limits.len(), 1);
        assert_eq!(limits[0].max_value(), 3);
    }
}
