//! Envoy's own rate limit protocols, served from the same store as the HTTP API:
//!
//! - [`service`]: `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` (RLS), what
//!   Envoy's `envoy.filters.http.ratelimit` filter calls; a drop-in for envoyproxy/ratelimit
//!   reading its configuration files ([`config`]).
//! - [`quota`]: `envoy.service.rate_limit_quota.v3.RateLimitQuotaService` (RLQS), the
//!   `envoy.filters.http.rate_limit_quota` filter's stream: usage reports in, quota
//!   assignments out.
//!
//! Both listen on `--rls-listen` (gRPC over HTTP/2 cleartext). A descriptor's counter is a
//! Diana counter like any other, so a descriptor and a Diana global rule can name the same
//! one (`rate_limit.diana_key`) and the wasm filter and Envoy's filters spend one budget.
//!
//! Calls need `authorization: Bearer <secret>` in their gRPC metadata (Envoy:
//! `grpc_service.initial_metadata`) unless `--rls-insecure-no-auth` (or
//! `--insecure-no-auth`), checked before the message is read; every answer comes before
//! the call's deadline (its `grpc-timeout`, less `--timeout-margin-ms`, and at most
//! `--deadline-ms`), an error at worst, so that Envoy applies its failure mode at once
//! instead of timing out.

pub mod config;
pub mod keys;
pub mod metadata;
pub mod quota;
pub mod service;

pub use config::{load, ConfigError, RlsConfig};
pub use keys::{CounterKeys, KeyError};

use crate::app::AppState;
use crate::auth::Auth;
use crate::store::{Outcome, Spend, Spending, Spent, StoreError};
use diana_core::algo::{Algorithm, Limit};
use diana_core::wire::ResolvedRule;
use std::future::Future;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::time::Instant;
use tonic::metadata::MetadataMap;
use tonic::Status;

/// The metric and log label of RLS calls.
pub const RLS_PATH: &str = "rls";
/// The metric and log label of RLQS streams.
pub const RLQS_PATH: &str = "rlqs";

/// The largest gRPC message read (tonic's default, said here): an RLS call within the
/// descriptor bounds, an RLQS report of every bucket a stream may have.
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;
/// Streams one HTTP/2 connection may have open at once (Envoy opens another connection
/// beyond it); without a bound one connection could hold any number.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 1024;
/// A gRPC connection older than this is asked to go (a graceful GOAWAY: its calls finish;
/// Envoy opens another), and closed `MAX_CONNECTION_AGE_GRACE` later whatever it still
/// carries (an RLQS stream then reconnects): nobody holds a connection for ever.
pub const MAX_CONNECTION_AGE: Duration = Duration::from_secs(3600);
pub const MAX_CONNECTION_AGE_GRACE: Duration = Duration::from_secs(30);

/// Which rate-limit headers the RLS answer asks Envoy to add (`--rls-headers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum HeaderStyle {
    /// None (Envoy's filter can still add `X-RateLimit-*` itself from the descriptor
    /// statuses: `enable_x_ratelimit_headers: DRAFT_VERSION_03`).
    #[default]
    None,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`.
    XRatelimit,
    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10).
    Ietf,
    /// Both sets.
    Both,
    /// `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset`: what envoyproxy/ratelimit
    /// sends with `LIMIT_RESPONSE_HEADERS_ENABLED` (its default header names), on every
    /// answer, and nothing else.
    Ratelimit,
}

impl HeaderStyle {
    pub fn x_ratelimit(self) -> bool {
        matches!(self, HeaderStyle::XRatelimit | HeaderStyle::Both)
    }

    pub fn ietf(self) -> bool {
        matches!(self, HeaderStyle::Ietf | HeaderStyle::Both)
    }
}

/// What the gRPC services share: the HTTP API's state (store, metrics, limits, secrets),
/// the configuration (replaced whole on SIGHUP), and their own settings.
#[derive(Clone)]
pub struct Rls {
    inner: Arc<Inner>,
}

struct Inner {
    state: AppState,
    config: RwLock<Arc<RlsConfig>>,
    files: Vec<PathBuf>,
    headers: HeaderStyle,
    /// Set once, before serving ([`Rls::with_response_metadata`]).
    response_metadata: AtomicBool,
    auth: Arc<Auth>,
    warnings: LogGate,
}

impl Rls {
    /// `auth`: who may call (`Auth::insecure()` with `--rls-insecure-no-auth`); the
    /// counters are keyed as `config`'s ([`RlsConfig::keys`]), on reloads too.
    pub fn new(
        state: AppState,
        config: RlsConfig,
        files: Vec<PathBuf>,
        headers: HeaderStyle,
        auth: Arc<Auth>,
    ) -> Rls {
        Rls {
            inner: Arc::new(Inner {
                state,
                config: RwLock::new(Arc::new(config)),
                files,
                headers,
                response_metadata: AtomicBool::new(false),
                auth,
                warnings: LogGate::new(20),
            }),
        }
    }

    /// Whether answers carry envoyproxy/ratelimit's dynamic metadata
    /// (`--rls-response-metadata`, its `RESPONSE_DYNAMIC_METADATA`).
    pub fn with_response_metadata(self, enabled: bool) -> Rls {
        self.inner
            .response_metadata
            .store(enabled, Ordering::Relaxed);
        self
    }

    pub fn response_metadata(&self) -> bool {
        self.inner.response_metadata.load(Ordering::Relaxed)
    }

    pub fn state(&self) -> &AppState {
        &self.inner.state
    }

    /// The configuration now.
    pub fn config(&self) -> Arc<RlsConfig> {
        self.inner
            .config
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    pub fn headers(&self) -> HeaderStyle {
        self.inner.headers
    }

    /// Re-reads the configuration files; on error the current configuration stays.
    pub fn reload(&self) -> Result<Arc<RlsConfig>, ConfigError> {
        let keys = self.config().keys().clone();
        let config = Arc::new(load(&self.inner.files, &keys)?);
        *self
            .inner
            .config
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = config.clone();
        Ok(config)
    }

    /// Checks a call's `authorization` metadata.
    pub fn authenticate(&self, metadata: &MetadataMap) -> Result<(), Status> {
        let values = metadata
            .get_all("authorization")
            .iter()
            .map(|value| value.as_encoded_bytes());
        match self.inner.auth.check_values(values) {
            Ok(()) => Ok(()),
            Err(rejection) => {
                self.state().metrics().unauthorized(rejection.label());
                Err(Status::unauthenticated(
                    "unauthorized: send `authorization: Bearer <secret>` in the gRPC metadata \
                     (Envoy: grpc_service.initial_metadata)",
                ))
            }
        }
    }

    /// A warning, at most 20 a second (a flood of bad calls does not flood the log); the
    /// lines left out are counted in the next one that passes.
    pub fn warn(&self, message: std::fmt::Arguments<'_>) {
        if let Some(suppressed) = self.inner.warnings.pass() {
            if suppressed > 0 {
                tracing::warn!("{message} ({suppressed} similar lines suppressed)");
            } else {
                tracing::warn!("{message}");
            }
        }
    }
}

/// At most `per_second` passes a second.
struct LogGate {
    per_second: u64,
    second: AtomicU64,
    passed: AtomicU64,
    suppressed: AtomicU64,
}

impl LogGate {
    fn new(per_second: u64) -> LogGate {
        LogGate {
            per_second,
            second: AtomicU64::new(0),
            passed: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(lines suppressed since the last pass)`, or `None` to suppress this one.
    fn pass(&self) -> Option<u64> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        if self.second.swap(now, Ordering::Relaxed) != now {
            self.passed.store(0, Ordering::Relaxed);
        }
        if self.passed.fetch_add(1, Ordering::Relaxed) < self.per_second {
            Some(self.suppressed.swap(0, Ordering::Relaxed))
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// The `grpc-timeout` of a call (`<digits><H|M|S|m|u|n>`), if it has a valid one.
pub fn grpc_timeout(metadata: &MetadataMap) -> Option<Duration> {
    let text = metadata.get("grpc-timeout")?.to_str().ok()?;
    let split = text.len().checked_sub(1)?;
    let (digits, unit) = (text.get(..split)?, text.get(split..)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let value: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(value.saturating_mul(3600)),
        "M" => Duration::from_secs(value.saturating_mul(60)),
        "S" => Duration::from_secs(value),
        "m" => Duration::from_millis(value),
        "u" => Duration::from_micros(value),
        "n" => Duration::from_nanos(value),
        _ => return None,
    })
}

/// How long a call may take: `--deadline-ms`, or less when the caller's `grpc-timeout`
/// minus `--timeout-margin-ms` is sooner.
pub fn budget(state: &AppState, metadata: &MetadataMap) -> Duration {
    let settings = state.settings();
    match grpc_timeout(metadata) {
        Some(timeout) => timeout
            .saturating_sub(settings.timeout_margin)
            .min(settings.deadline),
        None => settings.deadline,
    }
}

/// One rule to decide, owning its key.
#[derive(Debug, Clone)]
pub struct OwnedRule {
    pub key: String,
    pub algo: &'static dyn Algorithm,
    pub limit: Limit,
    pub want: NonZeroU32,
    pub cost: NonZeroU32,
    pub dry_run: bool,
}

impl OwnedRule {
    pub fn resolved(&self) -> ResolvedRule<'_> {
        ResolvedRule {
            key: &self.key,
            algo: self.algo,
            limit: self.limit.clone(),
            want: self.want,
            cost: self.cost,
            max_delay: None,
            dry_run: self.dry_run,
        }
    }
}

/// Why no decision came back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    Store(StoreError),
    /// No answer before the deadline (`budget` in milliseconds).
    Deadline(u128),
}

impl Failure {
    /// The gRPC status Envoy gets (any error makes it apply its failure mode).
    pub fn status(&self) -> Status {
        match self {
            Failure::Store(StoreError::Unsupported(reason)) => Status::invalid_argument(reason),
            Failure::Store(StoreError::Internal(reason)) => {
                Status::internal(format!("store error: {reason}"))
            }
            Failure::Store(failure) => Status::unavailable(failure.to_string()),
            Failure::Deadline(budget) => {
                Status::unavailable(format!("deadline exceeded: no answer within {budget} ms"))
            }
        }
    }
}

/// What the store is asked for a call's rules.
#[derive(Debug, Clone)]
pub enum Ask {
    /// All or nothing ([`crate::store::Store::check_and_update`]).
    Acquire,
    /// Each rule as these say ([`crate::store::Store::spend`]).
    Spend(Vec<Spending>),
}

/// Decides `rules` as `ask` says, answering by `deadline`. The store call is awaited here;
/// if the deadline comes first it goes on in a task of its own, which keeps `permit` (the
/// call's place in flight) until the store has answered and gives that late answer's
/// takes back, as the HTTP API does (a count stays: it is a charge, whatever the answer).
pub async fn decide(
    state: &AppState,
    path: &'static str,
    rules: Vec<OwnedRule>,
    ask: Ask,
    deadline: Instant,
    budget: Duration,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
) -> Result<Spent, Failure> {
    let task_state = state.clone();
    let mut call = Box::pin(async move {
        let resolved: Vec<ResolvedRule<'_>> = rules.iter().map(OwnedRule::resolved).collect();
        let outcome = match &ask {
            Ask::Acquire => task_state
                .store()
                .check_and_update(&resolved)
                .await
                .map(|outcomes| Spent {
                    admitted: outcomes
                        .iter()
                        .zip(&rules)
                        .all(|(outcome, rule)| outcome.result.granted > 0 || rule.dry_run),
                    outcomes,
                }),
            Ask::Spend(how) => task_state.store().spend(&resolved, how).await,
        };
        (rules, ask, outcome)
    });
    let outcome = tokio::select! {
        biased;
        (_, _, outcome) = &mut call => outcome,
        () = tokio::time::sleep_until(deadline) => {
            let late_state = state.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let (rules, ask, outcome) = call.await;
                let Ok(spent) = outcome else {
                    return;
                };
                let takes: Vec<Outcome> = match &ask {
                    Ask::Acquire => spent.outcomes,
                    Ask::Spend(how) => spent
                        .outcomes
                        .into_iter()
                        .zip(how)
                        .map(|(outcome, spending)| {
                            if spending.spend == Spend::Take {
                                outcome
                            } else {
                                Outcome::default()
                            }
                        })
                        .collect(),
                };
                if takes.iter().any(|outcome| outcome.result.granted > 0) {
                    late_state.metrics().late_release();
                    let resolved: Vec<ResolvedRule<'_>> = rules.iter().map(OwnedRule::resolved).collect();
                    if let Err(error) = late_state.store().release(&resolved, &takes).await {
                        tracing::warn!(%error, "a late decision could not be given back: its tokens stay charged");
                    }
                }
            });
            state.metrics().store_error("timeout");
            state.metrics().expired(path);
            return Err(Failure::Deadline(budget.as_millis()));
        }
    };
    outcome.map_err(|failure| {
        state.metrics().store_error(failure.kind());
        Failure::Store(failure)
    })
}

/// Lets through the calls whose metadata carries the credential ([`Rls::authenticate`]),
/// from their headers, before their message is read: a caller without it gets nothing
/// buffered and nothing done. A refused call is counted under `path`, as answered ones are.
fn authenticated(
    rls: Rls,
    path: &'static str,
) -> impl Fn(tonic::Request<()>) -> Result<tonic::Request<()>, Status> + Clone {
    move |request| {
        // A request's head read: the connection's first-request deadline is met.
        if let Some(served) = request.extensions().get::<crate::conn::Served>() {
            served.mark();
        }
        match rls.authenticate(request.metadata()) {
            Ok(()) => Ok(request),
            Err(status) => {
                rls.state().metrics().request(path, 401, Duration::ZERO);
                Err(status)
            }
        }
    }
}

/// Serves RLS and RLQS on `listener` until `shutdown` resolves; then RLQS streams are
/// ended and calls in flight answered (for at most the deadline plus one second).
pub async fn serve(
    listener: tokio::net::TcpListener,
    rls: Rls,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), crate::StartError> {
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
    use tonic::service::interceptor::InterceptedService;

    let (stop, stopping) = tokio::sync::watch::channel(false);
    let stopped_accepting = stopping.clone();
    let quota = quota::Rlqs::new(rls.clone(), stopping);
    let drain = rls.state().settings().deadline + Duration::from_secs(1);
    let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel::<()>();
    let signal = async move {
        shutdown.await;
        let _ = stop.send(true);
        let _ = stopped_tx.send(());
    };
    // Every connection through the port's gate (its caps, its idle timeout), with no
    // Nagle delay: small answers, sent at once.
    let gate = crate::conn::Gate::new(
        "grpc",
        rls.state().settings().connections,
        Some(rls.state().shared_metrics()),
    );
    // Each connection waiting here holds a place of the gate: the channel never holds more
    // than the port's cap, so none is dropped for want of room.
    let limits = rls.state().settings().connections;
    let (accepted, incoming) =
        tokio::sync::mpsc::channel::<crate::conn::Guarded>(limits.max_connections.max(1));
    let mut accepting = stopped_accepting.clone();
    tokio::spawn(crate::conn::accept_loop(
        listener,
        gate,
        async move {
            let _ = accepting.wait_for(|stop| *stop).await;
        },
        move |connection| {
            if let Err(error) = accepted.try_send(connection) {
                tracing::debug!(%error, "gRPC connection dropped: the server is not taking connections");
            }
        },
    ));
    let incoming = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::ReceiverStream::new(incoming),
        Ok::<_, std::io::Error>,
    );
    let server = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
        .http2_keepalive_interval(Some(crate::conn::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(crate::conn::KEEPALIVE_TIMEOUT))
        .http2_max_header_list_size(crate::conn::MAX_HEADER_LIST_BYTES)
        .max_connection_age(MAX_CONNECTION_AGE)
        .max_connection_age_grace(MAX_CONNECTION_AGE_GRACE)
        .add_service(InterceptedService::new(
            RateLimitServiceServer::new(service::RateLimiter::new(rls.clone()))
                .max_decoding_message_size(MAX_MESSAGE_BYTES),
            authenticated(rls.clone(), RLS_PATH),
        ))
        .add_service(InterceptedService::new(
            RateLimitQuotaServiceServer::new(quota).max_decoding_message_size(MAX_MESSAGE_BYTES),
            authenticated(rls.clone(), RLQS_PATH),
        ))
        .serve_with_incoming_shutdown(incoming, signal);
    let deadline = async move {
        if stopped_rx.await.is_ok() {
            tokio::time::sleep(drain).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        served = server => served.map_err(|error| crate::StartError::Serve {
            protocol: "gRPC",
            error: std::io::Error::other(error),
        }),
        () = deadline => {
            tracing::warn!("gRPC calls still in flight after the drain time: stopping anyway");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::metadata::MetadataValue;

    #[test]
    fn grpc_timeouts_are_read() {
        let mut metadata = MetadataMap::new();
        assert_eq!(grpc_timeout(&metadata), None);
        for (text, expected) in [
            ("20m", Duration::from_millis(20)),
            ("1S", Duration::from_secs(1)),
            ("2M", Duration::from_secs(120)),
            ("1H", Duration::from_secs(3600)),
            ("500u", Duration::from_micros(500)),
            ("7n", Duration::from_nanos(7)),
        ] {
            metadata.insert("grpc-timeout", MetadataValue::from_static(text));
            assert_eq!(grpc_timeout(&metadata), Some(expected), "{text}");
        }
        for bad in ["", "m", "20", "20x", "-1m", "123456789m"] {
            metadata.insert("grpc-timeout", MetadataValue::try_from(bad).unwrap());
            assert_eq!(grpc_timeout(&metadata), None, "{bad}");
        }
    }

    #[test]
    fn the_log_gate_lets_a_few_lines_through_each_second() {
        let gate = LogGate::new(3);
        let passed = (0..10).filter(|_| gate.pass().is_some()).count();
        // Two seconds may have started during the loop; at most 6 pass either way.
        assert!((3..=6).contains(&passed), "{passed}");
    }
}
