//! The service's state and what every handler shares: the settings, [`AppState`] (the
//! store, credentials, metrics, fleet view and the places in flight), admission with its
//! deadline, reading a bounded JSON body, and the error answers. Below the handlers
//! ([`crate::http`], [`crate::report`], [`crate::rls`]) and the connection gates
//! ([`crate::conn`]), which all use it and none of which it uses.

use crate::auth::{Auth, SCHEME};
use crate::conn::ConnectionLimits;
use crate::fleet::metrics::FleetCollector;
use crate::fleet::view::Limits;
use crate::fleet::{Fleet, ViewAccess};
use crate::metrics::Metrics;
use crate::store::{Store, StoreError, SystemClock};
use axum::body::Body;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use diana_core::wire::{self, ErrorResponse};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// The error text of a shed request.
pub const OVERLOADED: &str = "overloaded";

/// Tunables of the HTTP layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// The longest the service takes to answer a decision (503 at worst). Shorter than the
    /// gateway's callout timeout (50 ms by default), so the answer arrives in time.
    pub deadline: Duration,
    /// With `x-diana-timeout-ms: T`, the answer comes before `T − timeout_margin` (the
    /// network and the gateway's own scheduling take the rest).
    pub timeout_margin: Duration,
    /// Decisions made at once; one more is shed (503 overloaded).
    pub max_in_flight: usize,
    /// Longest `/v1/wait` sleeps.
    pub max_wait: Duration,
    /// Bounds of each port's connections (`crate::conn`).
    pub connections: ConnectionLimits,
}

/// The gateway's default callout timeout (`global.timeout_ms`).
pub const GATEWAY_TIMEOUT: Duration = Duration::from_millis(50);

impl Default for Settings {
    fn default() -> Self {
        Settings {
            deadline: Duration::from_millis(40),
            timeout_margin: Duration::from_millis(10),
            max_in_flight: 256,
            max_wait: Duration::from_millis(wire::MAX_WAIT_MS),
            connections: ConnectionLimits::default(),
        }
    }
}

/// Everything a handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    inner: Arc<Inner>,
}

struct Inner {
    store: Arc<dyn Store>,
    auth: Arc<Auth>,
    metrics: Arc<Metrics>,
    settings: Settings,
    permits: Arc<Semaphore>,
    shutting_down: AtomicBool,
    /// What the gateways' reports say (`/v1/report`, `/v1/view`).
    fleet: Arc<Fleet>,
    view_access: ViewAccess,
}

impl AppState {
    /// The state of a service over `store`, accepting the gateways `auth` accepts
    /// ([`Auth::insecure`]: everyone).
    /// The fleet view is readable with the gateways' credential ([`ViewAccess::Service`]).
    pub fn new(store: Arc<dyn Store>, settings: Settings, auth: impl Into<Arc<Auth>>) -> AppState {
        AppState::with_view(store, settings, auth, ViewAccess::Service)
    }

    /// [`AppState::new`], with the fleet view readable by whoever `view_access` admits.
    pub fn with_view(
        store: Arc<dyn Store>,
        settings: Settings,
        auth: impl Into<Arc<Auth>>,
        view_access: ViewAccess,
    ) -> AppState {
        let auth = auth.into();
        let fleet = Arc::new(Fleet::new(Limits::default(), Arc::new(SystemClock)));
        let mut metrics = Metrics::new();
        metrics.register_collector(FleetCollector(fleet.clone()));
        metrics.set_auth_required(auth.is_required());
        AppState {
            inner: Arc::new(Inner {
                store,
                auth,
                metrics: Arc::new(metrics),
                permits: Arc::new(Semaphore::new(settings.max_in_flight.max(1))),
                settings,
                shutting_down: AtomicBool::new(false),
                fleet,
                view_access,
            }),
        }
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// Who may call the gateway endpoints (its secrets can be replaced while serving).
    pub fn auth(&self) -> &Arc<Auth> {
        &self.inner.auth
    }

    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The metrics, for what outlives a request (a port's connection gate).
    pub fn shared_metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.inner.metrics)
    }

    /// The fleet view of this replica.
    pub fn fleet(&self) -> &Arc<Fleet> {
        &self.inner.fleet
    }

    /// Who may read the fleet view.
    pub fn view_access(&self) -> &ViewAccess {
        &self.inner.view_access
    }

    pub fn settings(&self) -> &Settings {
        &self.inner.settings
    }

    /// From now on `/readyz` answers 503 (the load balancer stops sending).
    pub fn begin_shutdown(&self) {
        self.inner.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutting_down.load(Ordering::SeqCst)
    }

    /// Takes a place among the decisions in flight, or `None` (counted as shed on `path`)
    /// when all are taken: the gRPC servers share the HTTP API's limit.
    pub fn try_admit(&self, path: &'static str) -> Option<OwnedSemaphorePermit> {
        match self.inner.permits.clone().try_acquire_owned() {
            Ok(permit) => {
                self.metrics().set_in_flight(self.in_flight());
                Some(permit)
            }
            Err(_) => {
                self.metrics().shed(path);
                None
            }
        }
    }

    /// Decisions being made right now.
    pub fn in_flight(&self) -> usize {
        self.settings().max_in_flight.max(1) - self.inner.permits.available_permits()
    }
}

/// The text of a 401.
pub const UNAUTHORIZED: &str = "unauthorized";

/// The 401 answer, with `www-authenticate: Bearer`.
pub(crate) fn unauthorized() -> Response {
    let mut answer = error(StatusCode::UNAUTHORIZED, UNAUTHORIZED);
    answer.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        axum::http::HeaderValue::from_static(SCHEME),
    );
    answer
}

/// A JSON error answer.
pub(crate) fn error(status: StatusCode, message: impl fmt::Display) -> Response {
    (
        status,
        Json(ErrorResponse {
            error: message.to_string(),
        }),
    )
        .into_response()
}

pub(crate) fn store_failure(state: &AppState, failure: &StoreError) -> Response {
    state.metrics().store_error(failure.kind());
    match failure {
        StoreError::Unavailable(_) | StoreError::Full(_) => {
            tracing::debug!(error = %failure, "answering 503");
            error(StatusCode::SERVICE_UNAVAILABLE, failure.to_string())
        }
        StoreError::Internal(_) => {
            tracing::error!(error = %failure, "store error");
            error(StatusCode::INTERNAL_SERVER_ERROR, failure.to_string())
        }
        StoreError::Unsupported(_) => error(StatusCode::BAD_REQUEST, failure.to_string()),
    }
}

// ---------------------------------------------------------------------------------------
// Admission: the concurrency limit and the deadline.

/// A decision admitted: its place among those in flight, and when it must be answered.
pub(crate) struct Admitted {
    pub(crate) permit: OwnedSemaphorePermit,
    pub(crate) path: &'static str,
    /// When the answer must be sent.
    pub(crate) deadline: Instant,
    /// `deadline` − arrival, for messages.
    pub(crate) budget: Duration,
    /// With the timeout header: when the gateway stops waiting, minus the margin.
    pub(crate) gateway_deadline: Option<Instant>,
}

/// Why a decision was not admitted.
pub(crate) enum Refusal {
    /// Too many decisions in flight.
    Overloaded,
    /// The timeout header is not a number.
    BadTimeout,
}

impl Refusal {
    pub(crate) fn answer(self) -> Response {
        match self {
            Refusal::Overloaded => error(StatusCode::SERVICE_UNAVAILABLE, OVERLOADED),
            Refusal::BadTimeout => error(
                StatusCode::BAD_REQUEST,
                format!(
                    "{}: must be a whole number of milliseconds",
                    wire::TIMEOUT_HEADER
                ),
            ),
        }
    }
}

/// Takes a place among the decisions in flight (or sheds the request at once) and works
/// out its deadline from the settings and the gateway's timeout header.
pub(crate) fn admit(
    state: &AppState,
    path: &'static str,
    headers: &HeaderMap,
) -> Result<Admitted, Refusal> {
    let arrived = Instant::now();
    let Ok(permit) = state.inner.permits.clone().try_acquire_owned() else {
        state.metrics().shed(path);
        return Err(Refusal::Overloaded);
    };
    state.metrics().set_in_flight(state.in_flight());
    let settings = state.settings();
    let gateway = match headers.get(wire::TIMEOUT_HEADER) {
        None => None,
        Some(value) => {
            let millis = value
                .to_str()
                .ok()
                .and_then(|text| text.trim().parse::<u64>().ok())
                .ok_or(Refusal::BadTimeout)?;
            Some(Duration::from_millis(millis).saturating_sub(settings.timeout_margin))
        }
    };
    let budget = gateway.map_or(settings.deadline, |gateway| gateway.min(settings.deadline));
    Ok(Admitted {
        permit,
        path,
        deadline: arrived + budget,
        budget,
        gateway_deadline: gateway.map(|gateway| arrived + gateway),
    })
}

/// The answer at the deadline.
/// Runs one store call of an admitted request before its deadline, then frees its place in
/// flight: the store's answer, or the answer to send instead (the store's failure, or 503
/// when the deadline passed first).
pub(crate) async fn within_deadline<T>(
    state: &AppState,
    admitted: Admitted,
    work: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, Response> {
    let answer = tokio::time::timeout_at(admitted.deadline, work).await;
    drop(admitted.permit);
    state.metrics().set_in_flight(state.in_flight());
    match answer {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(failure)) => Err(store_failure(state, &failure)),
        Err(_) => {
            state.metrics().store_error("timeout");
            Err(expired(state, admitted.path, admitted.budget))
        }
    }
}

pub(crate) fn expired(state: &AppState, path: &'static str, budget: Duration) -> Response {
    state.metrics().expired(path);
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        format!(
            "deadline exceeded: no answer within {} ms",
            budget.as_millis()
        ),
    )
}

/// Reads a JSON body of at most `max` bytes (a larger declared length is refused before
/// anything is read); the error is the answer to send.
pub(crate) async fn read_body(
    headers: &HeaderMap,
    body: Body,
    max: usize,
) -> Result<axum::body::Bytes, Response> {
    if let Some(content_type) = headers.get(header::CONTENT_TYPE) {
        let essence = content_type
            .to_str()
            .unwrap_or("")
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if essence != wire::CONTENT_TYPE {
            return Err(error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("content-type must be {}", wire::CONTENT_TYPE),
            ));
        }
    }
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body larger than {max} bytes"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse::<u64>().ok());
    if declared.is_some_and(|length| length > max as u64) {
        return Err(too_large());
    }
    axum::body::to_bytes(body, max)
        .await
        .map_err(|_| too_large())
}
