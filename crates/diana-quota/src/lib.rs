//! diana-quota: the global-limit service of Diana.
//!
//! A small stateless HTTP service between the gateways' Diana filters and Redis: one
//! `POST /v1/acquire` carries every global rule of one gateway request and gets, per rule,
//! the tokens granted (a lease), what remains, and when to retry. The rules of a request
//! are decided together, all or nothing: by one Lua script in Redis (time from Redis
//! `TIME`), per key with compensation in Redis Cluster, or, without Redis, by the filter's
//! own algorithms in memory (one replica only). `POST /v1/charge` charges response costs
//! past the limits. The wire format is `docs/wire-format.md` and
//! [`diana_core::global::wire`].
//!
//! - [`http`]: the router ([`app`]), handlers, load shedding and deadlines.
//! - [`store`]: the storage seam ([`store::Store`]) with [`store::MemoryStore`] and [`store::RedisStore`].
//! - [`metrics`]: Prometheus metrics.
//! - [`Cli`], [`serve`] and [`run`]: what the binary does.

pub mod http;
pub mod metrics;
pub mod store;

pub use http::{app, AppState, Settings};

use clap::Parser;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use store::{MemoryStore, RedisOptions, RedisStore, RedisTarget, Store, SystemClock};

/// Command line (every flag also read from the environment).
///
/// The deadline arithmetic with the defaults: the gateway waits 50 ms for an answer
/// (`global.timeout_ms`, sent as `x-diana-timeout-ms`); the service answers within
/// `min(--deadline-ms 40, 50 − --timeout-margin-ms 10) = 40 ms`, leaving 10 ms for the
/// network and the gateway; one Redis connection attempt (`--redis-connect-timeout-ms 20`)
/// plus one answer (`--redis-timeout-ms 20`) fit in those 40 ms.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "diana-quota",
    version,
    about = "Diana's global-limit service (HTTP in front of Redis)"
)]
pub struct Cli {
    /// Address to listen on, ADDR:PORT.
    #[arg(long, env = "DIANA_QUOTA_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: String,

    /// Redis: redis://host:port[/db] or redis+cluster://h1:p1,h2:p2. Without it counters
    /// live in this process's memory (run one replica only).
    #[arg(long, env = "DIANA_QUOTA_REDIS")]
    pub redis: Option<String>,

    /// Longest wait for a connection to Redis, in milliseconds (keep it within
    /// --deadline-ms).
    #[arg(
        long,
        env = "DIANA_QUOTA_REDIS_CONNECT_TIMEOUT_MS",
        default_value_t = 20
    )]
    pub redis_connect_timeout_ms: u64,

    /// Longest wait for an answer from Redis, in milliseconds (keep it within
    /// --deadline-ms).
    #[arg(long, env = "DIANA_QUOTA_REDIS_TIMEOUT_MS", default_value_t = 20)]
    pub redis_timeout_ms: u64,

    /// Every decision is answered within this many milliseconds (503 at worst). Keep it
    /// below the gateway's callout timeout (50 ms by default).
    #[arg(long, env = "DIANA_QUOTA_DEADLINE_MS", default_value_t = 40,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub deadline_ms: u64,

    /// With the gateway's x-diana-timeout-ms header T, answer within T minus this many
    /// milliseconds (if that is shorter than --deadline-ms).
    #[arg(long, env = "DIANA_QUOTA_TIMEOUT_MARGIN_MS", default_value_t = 10)]
    pub timeout_margin_ms: u64,

    /// Decisions made at once; more are refused at once with 503 {"error":"overloaded"}.
    #[arg(long, env = "DIANA_QUOTA_MAX_IN_FLIGHT", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_in_flight: u32,

    /// Longest delay /v1/wait sleeps before answering, in milliseconds.
    #[arg(long, env = "DIANA_QUOTA_MAX_WAIT_MS", default_value_t = diana_core::global::wire::MAX_WAIT_MS)]
    pub max_wait_ms: u64,

    /// Memory store (no --redis): most counters held; idle ones are evicted to make room,
    /// and when all are live, requests needing a new one are refused with 503.
    #[arg(long, env = "DIANA_QUOTA_MEMORY_MAX_KEYS", default_value_t = store::DEFAULT_MAX_KEYS as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub memory_max_keys: u64,

    /// Log filter (tracing-subscriber EnvFilter syntax), e.g. `info` or `diana_quota=debug`.
    #[arg(long, env = "DIANA_QUOTA_LOG", default_value = "info")]
    pub log: String,
}

impl Cli {
    /// The store and the HTTP settings these flags describe.
    pub fn build(&self) -> Result<(Arc<dyn Store>, Settings), String> {
        let settings = Settings {
            deadline: Duration::from_millis(self.deadline_ms.max(1)),
            timeout_margin: Duration::from_millis(self.timeout_margin_ms),
            max_in_flight: usize::try_from(self.max_in_flight.max(1)).unwrap_or(usize::MAX),
            max_wait: Duration::from_millis(self.max_wait_ms),
        };
        let store: Arc<dyn Store> = match &self.redis {
            Some(url) => {
                let target = RedisTarget::parse(url)?;
                let options = RedisOptions {
                    connect_timeout: Duration::from_millis(self.redis_connect_timeout_ms.max(1)),
                    response_timeout: Duration::from_millis(self.redis_timeout_ms.max(1)),
                    ..RedisOptions::default()
                };
                if options.response_timeout > settings.deadline {
                    tracing::warn!(
                        "--redis-timeout-ms {} is longer than --deadline-ms {}: slow answers become 503 at the deadline",
                        self.redis_timeout_ms,
                        self.deadline_ms
                    );
                }
                Arc::new(RedisStore::new(&target, options)?)
            }
            None => Arc::new(MemoryStore::with_capacity(
                Arc::new(SystemClock),
                usize::try_from(self.memory_max_keys).unwrap_or(usize::MAX),
            )),
        };
        Ok((store, settings))
    }
}

/// Serves on `listener` until `shutdown` resolves, then shuts down gracefully: `/readyz`
/// turns 503, the listener is closed (new connections are refused), idle connections are
/// closed, and the requests in flight are answered (for at most `max_wait` plus the
/// deadline plus one second, after which the server stops anyway).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let router = app(state.clone());
    let (stopping, stopped) = tokio::sync::oneshot::channel::<()>();
    let signal_state = state.clone();
    let signal = async move {
        shutdown.await;
        signal_state.begin_shutdown();
        let _ = stopping.send(());
    };
    let settings = *state.settings();
    let drain = settings.max_wait + settings.deadline + Duration::from_secs(1);
    let server = axum::serve(listener, router).with_graceful_shutdown(signal);
    let deadline = async move {
        if stopped.await.is_ok() {
            tokio::time::sleep(drain).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        served = server => served.map_err(|error| format!("server error: {error}")),
        () = deadline => {
            tracing::warn!(drain_ms = drain.as_millis(), "requests still in flight after the drain time: stopping anyway");
            Ok(())
        }
    }
}

/// Serves until SIGTERM or SIGINT, then finishes the requests in flight.
pub async fn run(cli: Cli) -> Result<(), String> {
    let (store, settings) = cli.build()?;
    let listener = tokio::net::TcpListener::bind(&cli.listen)
        .await
        .map_err(|error| format!("cannot listen on {}: {error}", cli.listen))?;
    let address = listener.local_addr().map_err(|error| error.to_string())?;
    tracing::info!(
        %address,
        store = %store.describe(),
        deadline_ms = settings.deadline.as_millis(),
        max_in_flight = settings.max_in_flight,
        "diana-quota listening"
    );
    if cli.redis.is_none() {
        tracing::warn!("no --redis: counters live in this process; run a single replica");
    }
    serve(listener, AppState::new(store, settings), shutdown_signal()).await?;
    tracing::info!("diana-quota stopped");
    Ok(())
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let interrupt = async {
        if let Err(error) = tokio::signal::ctrl_c().await {
            tracing::error!(%error, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => tracing::info!("SIGINT: shutting down"),
        () = terminate => tracing::info!("SIGTERM: shutting down"),
    }
}
