//! diana-quota: the global-limit service of Diana.
//!
//! A small stateless HTTP service between the gateways' Diana filters and Redis: one
//! `POST /v1/acquire` carries every global rule of one gateway request and gets, per rule,
//! the tokens granted (a lease), what remains, and when to retry. The rules of a request
//! are decided together, all or nothing: by one Lua script in Redis (time from Redis
//! `TIME`), per key with compensation in Redis Cluster, or, without Redis, by the filter's
//! own algorithms in memory (one replica only). `POST /v1/charge` charges response costs
//! past the limits. The wire format is `docs/wire-format.md` and
//! [`diana_core::wire`].
//!
//! Only gateways may call it: every gateway endpoint needs `authorization: Bearer
//! <secret>` ([`auth`]); the service refuses to start without a secret unless told
//! `--insecure-no-auth`.
//!
//! - [`auth`]: the secrets, and the check of every gateway request.
//! - [`app`](mod@app): the service's state ([`AppState`], [`Settings`]) and what every handler
//!   shares: load shedding, deadlines, bounded bodies, error answers.
//! - [`http`]: the router ([`app()`](fn@app)) and the gateway endpoints' handlers.
//! - [`conn`]: each port's connection gate (caps per port and per peer, idle timeouts).
//! - [`store`]: the storage seam ([`store::Store`]) with [`store::MemoryStore`] and [`store::RedisStore`].
//! - [`metrics`]: Prometheus metrics.
//! - [`report`] and [`fleet`]: the gateways' tick report (`POST /v1/report`: the fleet's
//!   breakers, kept by the store, [`store::breakers`]) and the fleet view (`GET /v1/view`,
//!   `/metrics`), in memory per replica; [`ui`]: the view's page (`GET /ui`).
//! - [`rls`]: Envoy's rate limit protocols over gRPC (`--rls-listen`): RLS
//!   (`ShouldRateLimit`, a drop-in for envoyproxy/ratelimit reading its configuration files)
//!   and RLQS (`StreamRateLimitQuotas`), on the same store.
//! - [`Cli`], [`serve`] and [`run`]: what the binary does.

pub mod app;
pub mod auth;
pub mod conn;
pub mod error;
pub mod fleet;
pub mod http;
pub mod metrics;
pub mod report;
pub mod rls;
pub mod store;
pub mod ui;

pub use app::{AppState, Settings};
pub use auth::{Auth, AuthError, NO_SECRET};
pub use error::StartError;
pub use http::app;

use auth::{Secret, TOKEN_ENV};
use clap::Parser;
use std::future::Future;
use std::path::PathBuf;
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
    about = "Diana's global-limit service (HTTP in front of Redis)",
    after_help = AFTER_HELP
)]
pub struct Cli {
    /// Address to listen on, ADDR:PORT.
    #[arg(long, env = "DIANA_QUOTA_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: String,

    /// Redis: `redis://[user:password@]host:port[/db]` or
    /// `redis+cluster://[user:password@]h1:p1,h2:p2` (a password or an ACL user: better in
    /// DIANA_QUOTA_REDIS than on the command line, where `ps` shows it). Without it
    /// counters live in this process's memory (run one replica only).
    // `--help` never shows the variable's value: it may hold a password.
    #[arg(long, env = "DIANA_QUOTA_REDIS", hide_env_values = true)]
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
    #[arg(long, env = "DIANA_QUOTA_MAX_WAIT_MS", default_value_t = diana_core::wire::MAX_WAIT_MS)]
    pub max_wait_ms: u64,

    /// Connections open at once on each port (--listen, --rls-listen); one more is closed
    /// as soon as it is accepted.
    #[arg(long, env = "DIANA_QUOTA_MAX_CONNECTIONS", default_value_t = conn::ConnectionLimits::DEFAULT.max_connections as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: u64,

    /// Connections open at once on each port from one peer address (a gateway, or every
    /// gateway behind one NAT address: raise it then); one more is closed at once.
    #[arg(long, env = "DIANA_QUOTA_MAX_CONNECTIONS_PER_PEER", default_value_t = conn::ConnectionLimits::DEFAULT.max_per_peer as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections_per_peer: u64,

    /// HTTP/1: a request head must be complete this many milliseconds after the connection
    /// opened or its previous answer left; an idle keep-alive connection is closed then.
    /// The gateways' idle timeout to this service must be shorter (Envoy: the cluster's
    /// common_http_protocol_options.idle_timeout; the bootstraps set 5 s).
    #[arg(long, env = "DIANA_QUOTA_HEADER_TIMEOUT_MS", default_value_t = conn::ConnectionLimits::DEFAULT.header_timeout.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub header_timeout_ms: u64,

    /// A connection (either port) from which nothing was read for this many milliseconds is
    /// closed (HTTP/2 peers answer the service's pings every 30 s: a live one never idles).
    #[arg(long, env = "DIANA_QUOTA_IDLE_TIMEOUT_MS", default_value_t = conn::ConnectionLimits::DEFAULT.idle_timeout.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_timeout_ms: u64,

    /// Memory store (no --redis): most counters held; idle ones are evicted to make room,
    /// and when all are live, requests needing a new one are refused with 503.
    #[arg(long, env = "DIANA_QUOTA_MEMORY_MAX_KEYS", default_value_t = store::DEFAULT_MAX_KEYS as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub memory_max_keys: u64,

    /// Log filter (tracing-subscriber EnvFilter syntax), e.g. `info` or `diana_quota=debug`.
    #[arg(long, env = "DIANA_QUOTA_LOG", default_value = "info")]
    pub log: String,

    /// File holding the secret gateways must present (`authorization: Bearer <secret>`):
    /// one secret per line, any of them accepted (rotation), each at least 32 bytes of
    /// printable ASCII; surrounding whitespace and blank lines are ignored. SIGHUP re-reads
    /// it. The secret can also come from the environment variable DIANA_QUOTA_TOKEN (never
    /// from a command-line value).
    #[arg(long, env = "DIANA_QUOTA_TOKEN_FILE", value_name = "PATH")]
    pub token_file: Option<PathBuf>,

    /// Serve WITHOUT authentication: anyone who can reach the port can read, drain and
    /// reset every counter. For loopback demos and benchmarks only (a warning is logged).
    #[arg(long)]
    pub insecure_no_auth: bool,

    /// Also serve Envoy's rate limit protocols over gRPC (HTTP/2 cleartext) on ADDR:PORT:
    /// RLS (`envoy.service.ratelimit.v3.RateLimitService`, for the `ratelimit` filter) and
    /// RLQS (`envoy.service.rate_limit_quota.v3.RateLimitQuotaService`, for the
    /// `rate_limit_quota` filter). Needs --rls-config.
    #[arg(long, env = "DIANA_QUOTA_RLS_LISTEN", value_name = "ADDR:PORT")]
    pub rls_listen: Option<String>,

    /// The rate limits of --rls-listen, in envoyproxy/ratelimit's configuration format: a
    /// YAML file (one domain), or a directory of them (*.yaml, *.yml); repeat the flag (or
    /// separate with commas) for several. SIGHUP re-reads them (a bad file changes nothing).
    #[arg(
        long,
        env = "DIANA_QUOTA_RLS_CONFIG",
        value_name = "FILE",
        value_delimiter = ','
    )]
    pub rls_config: Vec<PathBuf>,

    /// Rate-limit headers the RLS answer asks Envoy to add to the response (with
    /// `Retry-After` when refused): none, x-ratelimit, ietf (RateLimit-Policy and
    /// RateLimit), both.
    #[arg(
        long,
        env = "DIANA_QUOTA_RLS_HEADERS",
        value_enum,
        default_value = "none"
    )]
    pub rls_headers: rls::HeaderStyle,

    /// Answers carry envoyproxy/ratelimit's dynamic metadata (its RESPONSE_DYNAMIC_METADATA):
    /// the domain, the descriptors, and the `metadata` of the rules whose descriptors
    /// passed, for the filters after Envoy's `ratelimit` filter.
    #[arg(long, env = "DIANA_QUOTA_RLS_RESPONSE_METADATA")]
    pub rls_response_metadata: bool,

    /// File holding the key of the RLS counters (at least 32 bytes; the same on every
    /// replica): descriptor values are hashed under it, so nobody can compute where a value
    /// lands. Also from the environment variable DIANA_QUOTA_RLS_KEY. Without either, the
    /// public key is used (a warning): replicas agree, and so can anyone.
    #[arg(long, env = "DIANA_QUOTA_RLS_KEY_FILE", value_name = "PATH")]
    pub rls_key_file: Option<PathBuf>,

    /// Serve --rls-listen WITHOUT authentication (the HTTP API keeps its secret): for
    /// platforms whose Envoy cannot send `authorization` metadata to the rate limit
    /// service, where the port is reachable by the gateways only (bind it to loopback or a
    /// pod-local address, or fence it with a network policy). A warning is logged.
    #[arg(long)]
    pub rls_insecure_no_auth: bool,

    /// File holding the read-only secret(s) of the fleet view (`GET /v1/view`), as
    /// --token-file holds the gateways' (one per line, each at least 32 bytes; SIGHUP
    /// re-reads it). The gateways' secret opens the view too. Without it, only the
    /// gateways' secret does, and nobody under --insecure-no-auth.
    #[arg(long, env = "DIANA_QUOTA_VIEW_TOKEN_FILE", value_name = "PATH")]
    pub view_token_file: Option<PathBuf>,

    /// Serve the fleet view (`GET /v1/view`: gateway ids, rule and breaker names, the
    /// hottest identities and paths) WITHOUT a credential: loopback demos only (a warning
    /// is logged).
    #[arg(long)]
    pub insecure_open_view: bool,
}

/// The end of `--help`.
const AFTER_HELP: &str = "\
Authentication: every call to /v1/acquire, /v1/wait and /v1/charge must carry
`authorization: Bearer <secret>` (otherwise 401, nothing touched). The secret comes from
--token-file PATH or the environment variable DIANA_QUOTA_TOKEN (at least 32 bytes, e.g.
`openssl rand -hex 32`); there is no flag that takes the secret itself. Without a secret
the service refuses to start, unless --insecure-no-auth. /healthz, /readyz and /metrics
need no secret.

The fleet view (GET /v1/view) needs the gateways' secret or a read-only one from
--view-token-file; under --insecure-no-auth it is closed unless --insecure-open-view.

Rotation: add the new secret as a second line of the token file and send SIGHUP (or
restart); move the gateways to the new secret; remove the old line and SIGHUP again.

Envoy's protocols: --rls-listen ADDR:PORT --rls-config FILE serves RLS (the `ratelimit`
filter) and RLQS (the `rate_limit_quota` filter) over gRPC from envoyproxy/ratelimit's own
configuration files, on the same store. Calls need `authorization: Bearer <secret>` in their
gRPC metadata (Envoy: grpc_service.initial_metadata) unless --rls-insecure-no-auth. See
docs/rls.md.";

impl Cli {
    /// The secrets of `--token-file` and of `env_token` (the value of DIANA_QUOTA_TOKEN, if
    /// set), both checked; empty when neither is given.
    pub fn secrets(&self, env_token: Option<&str>) -> Result<Vec<Secret>, AuthError> {
        let mut secrets = Vec::new();
        if let Some(path) = &self.token_file {
            secrets.extend(auth::read_token_file(path)?);
        }
        if let Some(text) = env_token {
            secrets.extend(auth::parse_secrets(text, TOKEN_ENV)?);
        }
        Ok(secrets)
    }

    /// The authentication these flags and `env_token` (DIANA_QUOTA_TOKEN's value) describe:
    /// the secrets, or none with `--insecure-no-auth`; an error (the service must not start)
    /// without either, with both, or with a bad secret.
    pub fn auth_with(&self, env_token: Option<&str>) -> Result<Auth, AuthError> {
        let secrets = self.secrets(env_token)?;
        match (self.insecure_no_auth, secrets.is_empty()) {
            (true, true) => Ok(Auth::insecure()),
            (true, false) => Err(AuthError::InsecureWithSecret),
            (false, true) => Err(AuthError::NoSecret),
            (false, false) => Auth::with_secrets(&secrets),
        }
    }

    /// [`Cli::auth_with`] the environment's DIANA_QUOTA_TOKEN.
    pub fn auth(&self) -> Result<Auth, AuthError> {
        self.auth_with(env_token()?.as_deref())
    }

    /// Checks the RLS flags go together; the configuration they name, loaded (`None`
    /// without --rls-listen).
    pub fn rls_config(&self) -> Result<Option<rls::RlsConfig>, StartError> {
        match (&self.rls_listen, self.rls_config.is_empty()) {
            (None, true) => Ok(None),
            (None, false) => Err(StartError::RlsConfigWithoutListen),
            (Some(_), true) => Err(StartError::RlsListenWithoutConfig),
            (Some(_), false) => {
                let keys = self.rls_keys()?;
                Ok(Some(rls::load(&self.rls_config, &keys)?))
            }
        }
    }

    /// Who may read the fleet view: the secrets of `--view-token-file`, open with
    /// `--insecure-open-view` (not both), else the gateways' secret.
    pub fn view_access(&self) -> Result<fleet::ViewAccess, StartError> {
        match (&self.view_token_file, self.insecure_open_view) {
            (Some(_), true) => Err(StartError::OpenViewWithToken),
            (None, true) => Ok(fleet::ViewAccess::Open),
            (None, false) => Ok(fleet::ViewAccess::Service),
            (Some(path), false) => {
                let secrets = read_view_token_file(path)?;
                Ok(fleet::ViewAccess::Tokens(Arc::new(Auth::with_secrets(
                    &secrets,
                )?)))
            }
        }
    }

    /// The key of the RLS counters: `--rls-key-file`, DIANA_QUOTA_RLS_KEY, or the public
    /// key.
    pub fn rls_keys(&self) -> Result<rls::CounterKeys, StartError> {
        let env = match std::env::var(rls::keys::KEY_ENV) {
            Ok(value) => Some(value),
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(_)) => return Err(rls::KeyError::NotUtf8.into()),
        };
        Ok(rls::CounterKeys::from_sources(
            self.rls_key_file.as_deref(),
            env.as_deref(),
        )?)
    }

    /// The store and the HTTP settings these flags describe.
    pub fn build(&self) -> Result<(Arc<dyn Store>, Settings), StartError> {
        let settings = Settings {
            deadline: Duration::from_millis(self.deadline_ms.max(1)),
            timeout_margin: Duration::from_millis(self.timeout_margin_ms),
            max_in_flight: usize::try_from(self.max_in_flight.max(1)).unwrap_or(usize::MAX),
            max_wait: Duration::from_millis(self.max_wait_ms),
            connections: conn::ConnectionLimits {
                max_connections: usize::try_from(self.max_connections).unwrap_or(usize::MAX),
                max_per_peer: usize::try_from(self.max_connections_per_peer).unwrap_or(usize::MAX),
                header_timeout: Duration::from_millis(self.header_timeout_ms),
                idle_timeout: Duration::from_millis(self.idle_timeout_ms),
            },
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
///
/// Each connection is bounded as [`conn`] describes: the port's and the peer's connection
/// caps, the request head's timeout and size, the idle timeout (HTTP/1 and HTTP/2).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), StartError> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto;

    let router = app(state.clone());
    let settings = *state.settings();
    let limits = settings.connections;
    let gate = conn::Gate::new("http", limits, Some(state.shared_metrics()));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(conn::MAX_HEAD_BYTES)
        .max_headers(conn::MAX_HEAD_FIELDS);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(conn::MAX_HEADER_LIST_BYTES)
        .max_concurrent_streams(conn::MAX_HTTP2_STREAMS)
        .keep_alive_interval(conn::KEEPALIVE_INTERVAL)
        .keep_alive_timeout(conn::KEEPALIVE_TIMEOUT);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let signal_state = state.clone();
    let stop = async move {
        shutdown.await;
        signal_state.begin_shutdown();
    };
    conn::accept_loop(listener, gate.clone(), stop, |connection| {
        // A request's head read: the connection's first-request deadline is met.
        let served = connection.served();
        let service =
            hyper_util::service::TowerToHyperService::new(tower::ServiceExt::map_request(
                router.clone(),
                move |request: axum::extract::Request<hyper::body::Incoming>| {
                    served.mark();
                    request
                },
            ));
        let served = builder
            .serve_connection(TokioIo::new(connection), service)
            .into_owned();
        let served = graceful.watch(served);
        let gate = gate.clone();
        tokio::spawn(async move {
            if let Err(error) = served.await {
                let header_timeout = error
                    .downcast_ref::<hyper::Error>()
                    .is_some_and(hyper::Error::is_timeout);
                if header_timeout {
                    gate.closed("header");
                }
                tracing::debug!(%error, "HTTP connection ended");
            }
        });
    })
    .await;
    let drain = settings.max_wait + settings.deadline + Duration::from_secs(1);
    tokio::select! {
        () = graceful.shutdown() => Ok(()),
        () = tokio::time::sleep(drain) => {
            tracing::warn!(drain_ms = drain.as_millis(), "requests still in flight after the drain time: stopping anyway");
            Ok(())
        }
    }
}

/// The secrets of `--view-token-file`.
fn read_view_token_file(path: &std::path::Path) -> Result<Vec<Secret>, AuthError> {
    let origin = format!("--view-token-file {}", path.display());
    match std::fs::read_to_string(path) {
        Ok(text) => auth::parse_secrets(&text, &origin),
        Err(error) => Err(AuthError::Unreadable { origin, error }),
    }
}

/// The value of DIANA_QUOTA_TOKEN, if set.
fn env_token() -> Result<Option<String>, AuthError> {
    match std::env::var(TOKEN_ENV) {
        Ok(value) => Ok(Some(value)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(_)) => Err(AuthError::EnvironmentNotUtf8),
    }
}

/// Serves until SIGTERM or SIGINT, then finishes the requests in flight. SIGHUP re-reads
/// the token file.
pub async fn run(cli: Cli) -> Result<(), StartError> {
    let auth = Arc::new(cli.auth()?);
    let view_access = cli.view_access()?;
    let rls_config = cli.rls_config()?;
    let (store, settings) = cli.build()?;
    reload_on_sighup(cli.clone(), auth.clone());
    if let (fleet::ViewAccess::Tokens(view), Some(path)) = (&view_access, &cli.view_token_file) {
        auth::warn_if_readable_by_others(path);
        reload_view_on_sighup(path.clone(), view.clone());
    }
    let listener = tokio::net::TcpListener::bind(&cli.listen)
        .await
        .map_err(StartError::listen("--listen", &cli.listen))?;
    let rls_listener = match &cli.rls_listen {
        Some(address) => Some(
            tokio::net::TcpListener::bind(address)
                .await
                .map_err(StartError::listen("--rls-listen", address))?,
        ),
        None => None,
    };
    let address = listener
        .local_addr()
        .map_err(StartError::listen("--listen", &cli.listen))?;
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
    if auth.is_required() {
        if let Some(path) = &cli.token_file {
            auth::warn_if_readable_by_others(path);
        }
        tracing::info!(
            secrets = auth.secrets(),
            token_file = cli
                .token_file
                .as_ref()
                .map(|path| path.display().to_string()),
            env = std::env::var_os(TOKEN_ENV).is_some(),
            "gateway endpoints require authorization: Bearer <secret>"
        );
    } else {
        tracing::warn!(
            "--insecure-no-auth: AUTHENTICATION IS OFF. Anyone who can reach {address} can read, \
             drain and reset every counter. Use --token-file or {TOKEN_ENV} anywhere but on a \
             loopback demo or benchmark."
        );
    }
    match &view_access {
        fleet::ViewAccess::Open => tracing::warn!(
            "--insecure-open-view: anyone who can reach {address} can read the fleet view \
             (gateway ids, rule and breaker names, the hottest identities and paths)"
        ),
        fleet::ViewAccess::Service if !auth.is_required() => tracing::warn!(
            "the fleet view (GET /v1/view) is closed: --insecure-no-auth gives it no secret; \
             give --view-token-file (or --insecure-open-view on a loopback demo)"
        ),
        fleet::ViewAccess::Service | fleet::ViewAccess::Tokens(_) => {}
    }
    let state = AppState::with_view(store, settings, auth.clone(), view_access);
    let (stop, stopping) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop.send(true);
    });
    let stopped = |mut stopping: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopping.wait_for(|stop| *stop).await;
    };
    let grpc = match (rls_listener, rls_config) {
        (Some(rls_listener), Some(config)) => {
            let rls = start_rls(&cli, &state, &auth, &rls_listener, config)?;
            let shutdown = stopped(stopping.clone());
            Some(tokio::spawn(rls::serve(rls_listener, rls, shutdown)))
        }
        _ => None,
    };
    let served = serve(listener, state, stopped(stopping)).await;
    if let Some(grpc) = grpc {
        match grpc.await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::error!("{error}"),
            Err(error) => tracing::error!("the gRPC server failed: {error}"),
        }
    }
    served?;
    tracing::info!("diana-quota stopped");
    Ok(())
}

/// The RLS/RLQS services of `--rls-listen`, logged, with SIGHUP re-reading their files.
fn start_rls(
    cli: &Cli,
    state: &AppState,
    auth: &Arc<Auth>,
    listener: &tokio::net::TcpListener,
    config: rls::RlsConfig,
) -> Result<rls::Rls, StartError> {
    let address = listener.local_addr().map_err(StartError::listen(
        "--rls-listen",
        cli.rls_listen.as_deref().unwrap_or_default(),
    ))?;
    let grpc_auth = if cli.rls_insecure_no_auth {
        tracing::warn!(
            "--rls-insecure-no-auth: the gRPC rate limit services on {address} need NO secret. Anyone who \
             can reach that port can spend and drain every counter: keep it reachable by the gateways only."
        );
        Arc::new(Auth::insecure())
    } else {
        auth.clone()
    };
    if config.keys().origin() == rls::keys::KeyOrigin::Public {
        tracing::warn!(
            "no --rls-key-file (or {}): RLS counter keys are hashed under the public key, so \
             anyone can compute which counter a descriptor value lands on; give every replica \
             the same key of 32 bytes or more",
            rls::keys::KEY_ENV
        );
    }
    tracing::info!(
        %address,
        domains = %config.domains().join(","),
        rules = config.rules(),
        headers = ?cli.rls_headers,
        response_metadata = cli.rls_response_metadata,
        auth = grpc_auth.is_required(),
        "diana-quota serving Envoy's RLS and RLQS"
    );
    let rls = rls::Rls::new(
        state.clone(),
        config,
        cli.rls_config.clone(),
        cli.rls_headers,
        grpc_auth,
    )
    .with_response_metadata(cli.rls_response_metadata);
    reload_rls_on_sighup(rls.clone());
    Ok(rls)
}

/// From now on, every SIGHUP re-reads the --rls-config files; a file that cannot be read
/// or is invalid changes nothing (logged as an error).
fn reload_rls_on_sighup(rls: rls::Rls) {
    #[cfg(unix)]
    {
        let mut hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        {
            Ok(signal) => signal,
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGHUP: --rls-config is read at start only");
                return;
            }
        };
        tokio::spawn(async move {
            while hangup.recv().await.is_some() {
                match rls.reload() {
                    Ok(config) => tracing::info!(
                        domains = %config.domains().join(","),
                        rules = config.rules(),
                        "SIGHUP: --rls-config reloaded"
                    ),
                    Err(error) => tracing::error!(
                        "SIGHUP: {error}; the rate limit configuration in force stays"
                    ),
                }
            }
        });
    }
    #[cfg(not(unix))]
    let _ = rls;
}

/// From now on, every SIGHUP re-reads the token file (and DIANA_QUOTA_TOKEN), and exactly
/// those secrets are accepted from then on; a file that cannot be read or holds a bad
/// secret changes nothing (logged as an error). Without a token file, SIGHUP is logged and
/// ignored. (Call it within the runtime: it installs the handler, then watches in a task.)
pub fn reload_on_sighup(cli: Cli, auth: Arc<Auth>) {
    #[cfg(unix)]
    {
        let mut hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        {
            Ok(signal) => signal,
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGHUP: the token file is read at start only");
                return;
            }
        };
        tokio::spawn(async move {
            while hangup.recv().await.is_some() {
                match reload(&cli, &auth) {
                    Ok(count) => tracing::info!(secrets = count, "SIGHUP: token file reloaded"),
                    Err(error) => tracing::error!(
                        "SIGHUP: {error}; the secrets accepted so far stay in force"
                    ),
                }
            }
        });
    }
    #[cfg(not(unix))]
    let _ = (cli, auth);
}

/// From now on, every SIGHUP re-reads `--view-token-file` (a file that cannot be read or
/// holds a bad secret changes nothing, logged as an error).
fn reload_view_on_sighup(path: PathBuf, view: Arc<Auth>) {
    #[cfg(unix)]
    {
        let mut hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        {
            Ok(signal) => signal,
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGHUP: the view token file is read at start only");
                return;
            }
        };
        tokio::spawn(async move {
            while hangup.recv().await.is_some() {
                match read_view_token_file(&path).and_then(|secrets| view.replace(&secrets)) {
                    Ok(()) => {
                        tracing::info!(secrets = view.secrets(), "SIGHUP: view token file reloaded")
                    }
                    Err(error) => tracing::error!(
                        "SIGHUP: {error}; the view secrets accepted so far stay in force"
                    ),
                }
            }
        });
    }
    #[cfg(not(unix))]
    let _ = (path, view);
}

/// Re-reads the secrets; how many are accepted now.
fn reload(cli: &Cli, auth: &Auth) -> Result<usize, AuthError> {
    if !auth.is_required() {
        return Err(AuthError::Off);
    }
    if cli.token_file.is_none() {
        return Err(AuthError::NoTokenFile);
    }
    let secrets = cli.secrets(env_token()?.as_deref())?;
    auth.replace(&secrets)?;
    Ok(auth.secrets())
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
