//! The HTTP API (see `docs/wire-format.md`):
//!
//! - `POST /v1/acquire`: decide every rule of one gateway request, all or nothing.
//! - `POST /v1/wait`: the same, but the service waits out leaky-bucket delays itself.
//! - `POST /v1/charge`: charge response costs past the limits (debts).
//! - `POST /v1/release`: give back the grant of a call whose gateway request went away.
//! - `POST /v1/leave`, `POST /v1/renew`: give back or renew concurrency places (`IF`).
//! - `GET /healthz`: liveness, `200 ok` while the process serves.
//! - `GET /readyz`: readiness, `200 ready`, or `503` when the store is unreachable or the
//!   service is shutting down.
//! - `GET /metrics`: Prometheus (OpenMetrics) text.
//! - `POST /v1/report`, `GET /v1/view`: the gateways' tick report and the fleet view
//!   ([`crate::report`]).
//! - `GET /ui`: the fleet view's page, static; its data is `/v1/view` ([`crate::ui`]).
//!
//! Only gateways may call the `/v1/` endpoints: a layer in front of them answers `401` (with
//! `www-authenticate: Bearer`) to a request without `authorization: Bearer <secret>`
//! before its body is read, its place in flight taken or its store touched
//! ([`crate::auth`]). Health and metrics need no secret and reveal no counter or key.
//!
//! Holding under load: at most [`Settings::max_in_flight`](crate::app::Settings::max_in_flight) decisions are made at once; one
//! more is refused at once with `503 {"error":"overloaded"}` (shed, before its body is
//! read). Every decision is answered before its deadline, `min(Settings::deadline,
//! x-diana-timeout-ms − Settings::timeout_margin)` after it arrived (503 at worst), so
//! the answer reaches the gateway before it gives up; a grant whose store answer comes
//! later is given back (`Store::release`) instead of being lost to nobody.

use crate::app::{
    admit, error, expired, read_body, store_failure, unauthorized, within_deadline, Admitted,
    AppState, Refusal,
};
use crate::metrics;
use crate::report::{self, VIEW_PATH};
use crate::store::{Clock, CounterDigest, Grant, Noted, Outcome, StoreError, SystemClock};
use crate::ui;
use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use diana_core::report::REPORT_PATH;
use diana_core::time::Nanos;
use diana_core::wire::{
    self, AcquireRequest, AcquireResponse, ReleaseResponse, Released, ResolvedRule, RuleResult,
};
use std::time::Duration;
use tokio::time::Instant;

/// The service's router: the gateway endpoints behind `authenticate`, health and
/// metrics open.
pub fn app(state: AppState) -> Router {
    let gateway = Router::new()
        .route(wire::ACQUIRE_PATH, post(acquire))
        .route(wire::WAIT_PATH, post(wait))
        .route(wire::CHARGE_PATH, post(charge))
        .route(wire::RELEASE_PATH, post(release))
        .route(wire::LEAVE_PATH, post(leave))
        .route(wire::RENEW_PATH, post(renew))
        .route(REPORT_PATH, post(report::report))
        .route_layer(middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new()
        .merge(gateway)
        .route(VIEW_PATH, get(report::view))
        .merge(ui::routes())
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
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
        Some(wire::CHARGE_PATH) => wire::CHARGE_PATH,
        Some(wire::RELEASE_PATH) => wire::RELEASE_PATH,
        Some(wire::LEAVE_PATH) => wire::LEAVE_PATH,
        Some(wire::RENEW_PATH) => wire::RENEW_PATH,
        Some(REPORT_PATH) => REPORT_PATH,
        Some(VIEW_PATH) => VIEW_PATH,
        Some("/healthz") => "/healthz",
        Some("/readyz") => "/readyz",
        Some("/metrics") => "/metrics",
        Some(path) if path.starts_with(ui::UI_PATH) => ui::UI_PATH,
        _ => "other",
    }
}

/// Counts and times every request.
async fn track(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let started = std::time::Instant::now();
    let route = route_label(&request);
    let response = next.run(request).await;
    state
        .metrics()
        .request(route, response.status().as_u16(), started.elapsed());
    response
}

/// In front of every gateway endpoint: a request without a valid `authorization: Bearer
/// <secret>` is answered 401 here, before its body is read, a place in flight taken or the
/// store touched, and counted (`diana_quota_unauthorized_total`).
async fn authenticate(State(state): State<AppState>, request: Request, next: Next) -> Response {
    match state.auth().check(request.headers()) {
        Ok(()) => next.run(request).await,
        Err(rejection) => {
            state.metrics().unauthorized(rejection.label());
            unauthorized()
        }
    }
}

/// Reads and checks the body; the error is the answer to send.
async fn read_request(headers: &HeaderMap, body: Body) -> Result<AcquireRequest, Response> {
    let bytes = read_body(headers, body, wire::MAX_BODY_BYTES).await?;
    wire::decode_request(&bytes).map_err(|reason| error(StatusCode::BAD_REQUEST, reason))
}

/// Admits a decision and reads its request before its deadline.
async fn start(
    state: &AppState,
    path: &'static str,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Admitted, AcquireRequest), Response> {
    let admitted = admit(state, path, headers).map_err(Refusal::answer)?;
    if admitted.budget.is_zero() {
        return Err(expired(state, path, admitted.budget));
    }
    match tokio::time::timeout_at(admitted.deadline, read_request(headers, body)).await {
        Ok(Ok(request)) => Ok((admitted, request)),
        Ok(Err(answer)) => Err(answer),
        Err(_) => Err(expired(state, path, admitted.budget)),
    }
}

// ---------------------------------------------------------------------------------------
// Decisions.

/// Decides a request, all or nothing, before the deadline: the results, or the answer to
/// send instead. `max_delay` caps every waiting rule's `max_delay` (`/v1/wait`).
///
/// The store call runs in a task of its own, which keeps the place in flight until the
/// store has answered: when that answer comes after the deadline (the gateway got a 503
/// and will not use it), its grants are given back.
async fn decide(
    state: &AppState,
    admitted: Admitted,
    request: AcquireRequest,
    max_delay: Option<Duration>,
) -> Result<Vec<RuleResult>, Response> {
    let algos: Vec<&'static str> = match request.resolve().and_then(|rules| {
        wire::check_periods(&rules, SystemClock.now())?;
        Ok(rules)
    }) {
        Ok(rules) => rules.iter().map(|rule| rule.algo.code()).collect(),
        Err(reason) => return Err(error(StatusCode::BAD_REQUEST, reason)),
    };
    let (sender, receiver) = tokio::sync::oneshot::channel();
    let task_state = state.clone();
    let permit = admitted.permit;
    tokio::spawn(async move {
        if let Ok(mut rules) = request.resolve() {
            if let Some(cap) = max_delay {
                cap_delays(&mut rules, cap);
            }
            let outcome = task_state.store().check_and_update(&rules).await;
            // A call with an id is noted after its answer left (no latency added): its
            // gateway may release it if the answer never reaches the request.
            let noted = match (&request.call, &outcome) {
                (Some(call), Ok(outcomes)) => {
                    Grant::of(&rules, outcomes).map(|grants| (call, grants))
                }
                _ => None,
            };
            match sender.send(outcome) {
                Err(Ok(outcomes)) => give_back_late(&task_state, &rules, &outcomes).await,
                Ok(()) => {
                    if let Some((call, grants)) = noted {
                        note_call(&task_state, call, &rules, &grants).await;
                    }
                }
                Err(Err(_)) => {}
            }
        }
        drop(permit);
        task_state.metrics().set_in_flight(task_state.in_flight());
    });
    let outcomes = match tokio::time::timeout_at(admitted.deadline, receiver).await {
        Ok(Ok(Ok(outcomes))) => outcomes,
        Ok(Ok(Err(failure))) => return Err(store_failure(state, &failure)),
        Ok(Err(_)) => {
            return Err(store_failure(
                state,
                &StoreError::Internal("the decision task ended without an answer".into()),
            ))
        }
        Err(_) => {
            state.metrics().store_error("timeout");
            return Err(expired(state, admitted.path, admitted.budget));
        }
    };
    if outcomes.len() != algos.len() {
        return Err(store_failure(
            state,
            &StoreError::Internal(format!(
                "{} results for {} rules",
                outcomes.len(),
                algos.len()
            )),
        ));
    }
    for (algo, outcome) in algos.iter().zip(&outcomes) {
        state
            .metrics()
            .decision(algo, outcome.result.allowed, outcome.result.granted);
    }
    Ok(outcomes.into_iter().map(|outcome| outcome.result).collect())
}

/// Caps the `max_delay` of every rule whose algorithm waits (whole milliseconds).
fn cap_delays(rules: &mut [ResolvedRule<'_>], cap: Duration) {
    let cap = Nanos::saturating_from_millis(u64::try_from(cap.as_millis()).unwrap_or(u64::MAX));
    for rule in rules.iter_mut().filter(|rule| rule.algo.waits()) {
        rule.max_delay = Some(rule.max_delay.map_or(cap, |own| own.min(cap)));
    }
}

/// A decision answered after its deadline: nobody uses its grants, so they go back.
async fn give_back_late(state: &AppState, rules: &[ResolvedRule<'_>], outcomes: &[Outcome]) {
    if !outcomes.iter().any(|outcome| outcome.result.granted > 0) {
        return;
    }
    state.metrics().late_release();
    if let Err(error) = state.store().release(rules, outcomes).await {
        tracing::warn!(%error, "a late decision could not be given back: its tokens stay charged");
    }
}

/// Notes what a call with an id was granted; if its release came first, gives it back.
async fn note_call(state: &AppState, call: &str, rules: &[ResolvedRule<'_>], grants: &[Grant]) {
    match state.store().note_call(call, grants).await {
        Ok(Noted::Kept) => {}
        Ok(Noted::AlreadyReleased) => {
            state.metrics().call_release();
            if let Err(error) = state.store().release(rules, &Grant::outcomes(grants)).await {
                tracing::warn!(%error, "a released call's grant could not be given back: its tokens stay charged");
            }
        }
        Err(error) => {
            tracing::debug!(%error, "a call was not noted: a release of it will find nothing");
        }
    }
}

/// Gives back what the acquire with the same `call` id granted: the gateway's request went
/// away before the answer reached it. The body is that acquire's (its rules name the
/// counters). Answers whether a grant was given back; when the acquire has not been
/// decided yet, it gives its grant back as soon as it is made.
///
/// With `rule`, part of one rule's grant (the request was answered, and its answer is not
/// counted): the body's one rule names that rule's counter and its `want` the tokens. At
/// most what that rule was granted comes back, once; nothing is noted for an acquire
/// still to come.
async fn release(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let (admitted, request) = match start(&state, wire::RELEASE_PATH, &headers, body).await {
        Ok(started) => started,
        Err(answer) => return answer,
    };
    let (rules, call, released) = match wire::resolve_release(&request) {
        Ok(resolved) => resolved,
        Err(reason) => return error(StatusCode::BAD_REQUEST, reason),
    };
    // Ok(Err(reason)): not the rules of that call, or not something the store gives
    // back (400, not a store failure).
    let work = async {
        let grants = match released {
            Released::Whole => state.store().take_call(call).await?,
            Released::Part { rule } => {
                let Some(asked) = rules.first() else {
                    return Ok(Ok(false));
                };
                let part = state
                    .store()
                    .take_part(call, rule, asked.want.get(), CounterDigest::of(asked))
                    .await?;
                match part.outcome(call, rule) {
                    Ok(taken) => taken.map(|grant| vec![grant]),
                    Err(refused) => return Ok(Err(refused.to_string())),
                }
            }
        };
        let Some(grants) = grants else {
            return Ok(Ok(false));
        };
        let outcomes = match Grant::released(call, &rules, &grants) {
            Ok(outcomes) => outcomes,
            Err(refused) => return Ok(Err(refused.to_string())),
        };
        state.metrics().call_release();
        match state.store().release(&rules, &outcomes).await {
            Ok(()) => Ok(Ok(true)),
            Err(StoreError::Unsupported(reason)) => Ok(Err(reason)),
            Err(failure) => Err(failure),
        }
    };
    match within_deadline(&state, admitted, work).await {
        Ok(Ok(released)) => Json(ReleaseResponse { released }).into_response(),
        Ok(Err(reason)) => error(StatusCode::BAD_REQUEST, reason),
        Err(answer) => answer,
    }
}

/// Gives back concurrency places of a gateway request that ended: each rule names its
/// counter, its `want` the places, its `place` the bucket they are counted in.
async fn leave(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let (admitted, request) = match start(&state, wire::LEAVE_PATH, &headers, body).await {
        Ok(started) => started,
        Err(answer) => return answer,
    };
    let (rules, places) = match wire::resolve_places(&request) {
        Ok(resolved) => resolved,
        Err(reason) => return error(StatusCode::BAD_REQUEST, reason),
    };
    let outcomes = Outcome::held(&rules, places);
    match within_deadline(&state, admitted, state.store().release(&rules, &outcomes)).await {
        Ok(()) => Json(ReleaseResponse { released: true }).into_response(),
        Err(answer) => answer,
    }
}

/// Renews concurrency places of gateway requests still inside: they move to the current
/// bucket, which each result's `place` names.
async fn renew(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let (admitted, request) = match start(&state, wire::RENEW_PATH, &headers, body).await {
        Ok(started) => started,
        Err(answer) => return answer,
    };
    let (rules, places) = match wire::resolve_places(&request) {
        Ok(resolved) => resolved,
        Err(reason) => return error(StatusCode::BAD_REQUEST, reason),
    };
    match within_deadline(&state, admitted, state.store().renew(&rules, &places)).await {
        Ok(outcomes) => Json(AcquireResponse {
            results: outcomes.into_iter().map(|outcome| outcome.result).collect(),
        })
        .into_response(),
        Err(answer) => answer,
    }
}

async fn acquire(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let (admitted, request) = match start(&state, wire::ACQUIRE_PATH, &headers, body).await {
        Ok(started) => started,
        Err(answer) => return answer,
    };
    match decide(&state, admitted, request, None).await {
        Ok(results) => Json(AcquireResponse { results }).into_response(),
        Err(answer) => answer,
    }
}

/// Like `acquire`, but when every rule is allowed the service sleeps the longest
/// leaky-bucket delay and reports the delays minus the time slept (so 0). A waiting rule's
/// turn must come within `max_wait` and, with the timeout header, before the gateway stops
/// waiting (its `max_delay` is capped accordingly: a later turn is denied, not reserved).
/// When a rule is denied it answers at once: the gateway rejects the request anyway.
async fn wait(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let (admitted, request) = match start(&state, wire::WAIT_PATH, &headers, body).await {
        Ok(started) => started,
        Err(answer) => return answer,
    };
    let settings = *state.settings();
    // The sleep starts at the decision's deadline at the latest and ends before the gateway
    // stops waiting.
    let gateway_deadline = admitted.gateway_deadline;
    let cap = gateway_deadline.map_or(settings.max_wait, |gateway| {
        settings
            .max_wait
            .min(gateway.saturating_duration_since(admitted.deadline))
    });
    let mut results = match decide(&state, admitted, request, Some(cap)).await {
        Ok(results) => results,
        Err(answer) => return answer,
    };
    if results.iter().all(|result| result.allowed) {
        let longest = results
            .iter()
            .map(|result| result.delay_ms)
            .max()
            .unwrap_or(0);
        let mut slept = Duration::from_millis(longest).min(settings.max_wait);
        if let Some(gateway) = gateway_deadline {
            slept = slept.min(gateway.saturating_duration_since(Instant::now()));
        }
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

/// Charges every rule `want` tokens past its limit (response costs). Every rule's
/// algorithm must take debts (400 otherwise, nothing charged).
async fn charge(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let (admitted, request) = match start(&state, wire::CHARGE_PATH, &headers, body).await {
        Ok(started) => started,
        Err(answer) => return answer,
    };
    let rules = match request.resolve().and_then(|rules| {
        wire::check_periods(&rules, SystemClock.now())?;
        Ok(rules)
    }) {
        Ok(rules) => rules,
        Err(reason) => return error(StatusCode::BAD_REQUEST, reason),
    };
    if let Err(refused) = crate::store::refuse_debtless(&rules) {
        return error(StatusCode::BAD_REQUEST, refused.to_string());
    }
    match within_deadline(&state, admitted, state.store().charge(&rules)).await {
        Ok(results) => {
            for (rule, result) in rules.iter().zip(&results) {
                state.metrics().charged(rule.algo.code(), result.granted);
            }
            Json(AcquireResponse { results }).into_response()
        }
        Err(answer) => answer,
    }
}

// ---------------------------------------------------------------------------------------
// Health and metrics.

/// Liveness: the process serves HTTP.
async fn healthz() -> Response {
    (StatusCode::OK, "ok").into_response()
}

/// Readiness: not shutting down, and the store answers within the deadline.
async fn readyz(State(state): State<AppState>) -> Response {
    if state.is_shutting_down() {
        return (StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response();
    }
    let deadline = state.settings().deadline;
    match tokio::time::timeout(deadline, state.store().health()).await {
        Ok(Ok(())) => (StatusCode::OK, "ready").into_response(),
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
    if let Some(usage) = state.store().usage() {
        state.metrics().store_usage(usage);
    }
    state.metrics().set_in_flight(state.in_flight());
    match state.metrics().encode() {
        Ok(text) => ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response(),
        Err(failure) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode metrics: {failure}"),
        ),
    }
}
