//! diana-quota: the global-limit service of Diana.
//!
//! A small stateless HTTP service between the gateways' Diana filters and Redis: one
//! `POST /v1/acquire` carries every global rule of one gateway request and gets, per rule,
//! the tokens granted (a lease), what remains, and when to retry. Each rule is decided
//! atomically by a Lua script in Redis (time from Redis `TIME`), or, without Redis, by the
//! filter's own algorithms in memory (one replica only). The wire format is
//! `docs/wire-format.md` and [`diana_core::global::wire`].
//!
//! - [`http`]: the router ([`app`]) and handlers.
//! - [`store`]: the storage seam ([`store::Store`]) with [`store::MemoryStore`] and [`store::RedisStore`].
//! - [`metrics`]: Prometheus metrics.
//! - [`Cli`] and [`run`]: what the binary does.

pub mod http;
pub mod metrics;
pub mod store;

pub use http::{app, AppState, Settings};

use clap::Parser;
use std::sync::Arc;
use std::time::Duration;
use store::{MemoryStore, RedisOptions, RedisStore, RedisTarget, Store};

/// Command line (every flag also read from the environment).
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

    /// Longest wait for a connection to Redis, in milliseconds.
    #[arg(
        long,
        env = "DIANA_QUOTA_REDIS_CONNECT_TIMEOUT_MS",
        default_value_t = 200
    )]
    pub redis_connect_timeout_ms: u64,

    /// Longest wait for an answer from Redis, in milliseconds.
    #[arg(long, env = "DIANA_QUOTA_REDIS_TIMEOUT_MS", default_value_t = 250)]
    pub redis_timeout_ms: u64,

    /// Longest delay /v1/wait sleeps before answering, in milliseconds.
    #[arg(long, env = "DIANA_QUOTA_MAX_WAIT_MS", default_value_t = diana_core::global::wire::MAX_WAIT_MS)]
    pub max_wait_ms: u64,

    /// Log filter (tracing-subscriber EnvFilter syntax), e.g. `info` or `diana_quota=debug`.
    #[arg(long, env = "DIANA_QUOTA_LOG", default_value = "info")]
    pub log: String,
}

impl Cli {
    /// The store and the HTTP settings these flags describe.
    pub fn build(&self) -> Result<(Arc<dyn Store>, Settings), String> {
        let mut settings = Settings {
            max_wait: Duration::from_millis(self.max_wait_ms),
            ..Settings::default()
        };
        let store: Arc<dyn Store> = match &self.redis {
            Some(url) => {
                let target = RedisTarget::parse(url)?;
                let options = RedisOptions {
                    connect_timeout: Duration::from_millis(self.redis_connect_timeout_ms.max(1)),
                    response_timeout: Duration::from_millis(self.redis_timeout_ms.max(1)),
                    ..RedisOptions::default()
                };
                settings.store_deadline = options.deadline();
                Arc::new(RedisStore::new(&target, options)?)
            }
            None => Arc::new(MemoryStore::default()),
        };
        Ok((store, settings))
    }
}

/// Serves until SIGTERM or SIGINT, then finishes the requests in flight.
pub async fn run(cli: Cli) -> Result<(), String> {
    let (store, settings) = cli.build()?;
    let listener = tokio::net::TcpListener::bind(&cli.listen)
        .await
        .map_err(|error| format!("cannot listen on {}: {error}", cli.listen))?;
    let address = listener.local_addr().map_err(|error| error.to_string())?;
    tracing::info!(%address, store = %store.describe(), "diana-quota listening");
    if cli.redis.is_none() {
        tracing::warn!("no --redis: counters live in this process; run a single replica");
    }
    let router = app(AppState::new(store, settings));
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown_signal())
        .await
        .map_err(|error| format!("server error: {error}"))?;
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
