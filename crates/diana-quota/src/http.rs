//! The HTTP API (see `docs/wire-format.md`):
//!
//! - `POST /v1/acquire`: decide every rule of one gateway request.
//! - `POST /v1/wait`: the same, but the service waits out leaky-bucket delays itself.
//! - `GET /healthz`: `200 ok`, or `503` when the store is down.
//! - `GET /metrics`: Prometheus (OpenMetrics) text.

use crate::metrics::{self, Metrics};
use crate::store::{Store, StoreError};
use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use diana_core::global::wire::{self, AcquireRequest, AcquireResponse, ErrorResponse, RuleResult};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Tunables of the HTTP layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// Longest a store decision may take before the answer is 503.
    pub store_deadline: Duration,
    /// Longest `/v1/wait` sleeps.
    pub max_wait: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            store_deadline: Duration::from_millis(750),
            max_wait: Duration::from_millis(wire::MAX_WAIT_MS),
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
    metrics: Metrics,
    settings: Settings,
}

impl AppState {
    pub fn new(store: Arc<dyn Store>, settings: Settings) -> AppState {
        AppState {
            inner: Arc::new(Inner {
                store,
                metrics: Metrics::new(),
                settings,
            }),
        }
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }
}

/// The service's router.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route(wire::ACQUIRE_PATH, post(acquire))
        .route(wire::WAIT_PATH, post(wait))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics_text))
        .layer(middleware::from_fn_with_state(state.clone(), track))
        .with_state(state)
}

/// A route label with bounded cardinality.
fn route_label(request: &Request) -> &'static str {
    match request
        .extensions()
        .get::<MatchedPath>()
        .map(MatchedPath::as_str)
    {
        Some(wire::ACQUIRE_PATH) => wire::ACQUIRE_PATH,
        Some(wire::WAIT_PATH) => wire::WAIT_PATH,
        Some("/healthz") => "/healthz",
        Some("/metrics") => "/metrics",
        _ => "other",
    }
}

/// Counts and times every request.
async fn track(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = route_label(&request);
    let response = next.run(request).await;
    state
        .metrics()
        .request(route, response.status().as_u16(), started.elapsed());
    response
}

/// A JSON error answer.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        Json(ErrorResponse {
            error: message.into(),
        }),
    )
        .into_response()
}

fn store_failure(state: &AppState, failure: &StoreError) -> Response {
    state.metrics().store_error(failure.kind());
    match failure {
        StoreError::Unavailable(_) => {
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

/// Reads and checks the body; the error is the answer to send.
async fn read_request(headers: &HeaderMap, body: Body) -> Result<AcquireRequest, Response> {
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
            format!("request body larger than {} bytes", wire::MAX_BODY_BYTES),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse::<u64>().ok());
    if declared.is_some_and(|length| length > wire::MAX_BODY_BYTES as u64) {
        return Err(too_large());
    }
    let bytes = axum::body::to_bytes(body, wire::MAX_BODY_BYTES)
        .await
        .map_err(|_| too_large())?;
    wire::decode_request(&bytes).map_err(|reason| error(StatusCode::BAD_REQUEST, reason))
}

/// Decides a request: the results, or the answer to send instead.
async fn decide(state: &AppState, request: &AcquireRequest) -> Result<Vec<RuleResult>, Response> {
    let rules = request
        .resolve()
        .map_err(|reason| error(StatusCode::BAD_REQUEST, reason))?;
    let deadline = state.inner.settings.store_deadline;
    let results = match tokio::time::timeout(deadline, state.store().check_and_update(&rules)).await
    {
        Ok(Ok(results)) => results,
        Ok(Err(failure)) => return Err(store_failure(state, &failure)),
        Err(_) => {
            state.metrics().store_error("timeout");
            return Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "store unavailable: no answer within {} ms",
                    deadline.as_millis()
                ),
            ));
        }
    };
    if results.len() != rules.len() {
        return Err(store_failure(
            state,
            &StoreError::Internal(format!(
                "{} results for {} rules",
                results.len(),
                rules.len()
            )),
        ));
    }
    for (rule, result) in rules.iter().zip(&results) {
        state.metrics().decision(rule.algo.code(), result.granted);
    }
    Ok(results)
}

async fn acquire(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let request = match read_request(&headers, body).await {
        Ok(request) => request,
        Err(answer) => return answer,
    };
    match decide(&state, &request).await {
        Ok(results) => Json(AcquireResponse { results }).into_response(),
        Err(answer) => answer,
    }
}

/// Like `acquire`, but when every rule is allowed the service sleeps the longest
/// leaky-bucket delay (at most `max_wait`) and reports the delays minus the time slept
/// (so 0, unless a delay was longer than `max_wait`). When a rule is denied it answers at
/// once: the gateway rejects the request anyway.
async fn wait(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let request = match read_request(&headers, body).await {
        Ok(request) => request,
        Err(answer) => return answer,
    };
    let mut results = match decide(&state, &request).await {
        Ok(results) => results,
        Err(answer) => return answer,
    };
    if results.iter().all(|result| result.allowed) {
        let longest = results
            .iter()
            .map(|result| result.delay_ms)
            .max()
            .unwrap_or(0);
        let slept = Duration::from_millis(longest).min(state.inner.settings.max_wait);
        if !slept.is_zero() {
            tokio::time::sleep(slept).await;
            state.metrics().waited(slept);
        }
        let slept_ms = u64::try_from(slept.as_millis()).unwrap_or(u64::MAX);
        for result in &mut results {
            result.delay_ms = result.delay_ms.saturating_sub(slept_ms);
        }
    }
    Json(AcquireResponse { results }).into_response()
}

async fn healthz(State(state): State<AppState>) -> Response {
    let deadline = state.inner.settings.store_deadline;
    match tokio::time::timeout(deadline, state.store().health()).await {
        Ok(Ok(())) => (StatusCode::OK, "ok").into_response(),
        Ok(Err(failure)) => {
            state.metrics().store_error(failure.kind());
            (StatusCode::SERVICE_UNAVAILABLE, failure.to_string()).into_response()
        }
        Err(_) => {
            state.metrics().store_error("timeout");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "store unavailable: no answer within {} ms",
                    deadline.as_millis()
                ),
            )
                .into_response()
        }
    }
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    match state.metrics().encode() {
        Ok(text) => ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response(),
        Err(failure) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode metrics: {failure}"),
        ),
    }
}
