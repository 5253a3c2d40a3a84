//! The gateways' tick report and the fleet view (`docs/wire-format.md`):
//!
//! - `POST /v1/report` ([`report`]): behind the gateways' credential like `/v1/acquire`
//!   (checked before the body is read), admitted among the decisions in flight, its body
//!   at most [`MAX_REPORT_BYTES`] and checked ([`diana_core::report::decode`]: a 400 names
//!   the field). What it says goes into the view at once; each fleet breaker
//!   (`fleet: true`) is then decided by the store's [`FleetBreakers`] and answered as a
//!   [`FleetAnswer`] before the deadline (503 at worst, as for the other endpoints); a
//!   local breaker's status is echoed.
//! - `GET /v1/view` ([`view`]): the view as JSON, to whoever [`crate::fleet::ViewAccess`]
//!   admits (checked first; never open by default).
//!
//! ```text
//!   credential ─▶ place in flight ─▶ body (bounded, within the deadline) ─▶ decode
//!     ─▶ view.record_report ─▶ fleet breakers? ── none ──▶ 200 (statuses echoed)
//!                                   │
//!                                   └─▶ store (a task of its own) ─▶ 200 answers
//!                                         │ deadline first: 503; the places the late
//!                                         │ answer granted are given back
//! ```
//!
//! The view takes a report whether or not its breakers could be decided (a Redis outage
//! must not blind the view): a gateway that gets a 503 sends its breakers' calls again
//! with its next report (`Handle::restore_report`), not its rules' counts.

use crate::app::{self, AppState};
use crate::store::{BreakerCall, Decided, FleetBreakers, StoreError};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use diana_core::breaker::FleetAnswer;
use diana_core::report::{self as wire, ReportResponse, MAX_REPORT_BYTES, REPORT_PATH};

/// The fleet view's path.
pub const VIEW_PATH: &str = "/v1/view";

/// `POST /v1/report`.
pub async fn report(State(state): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let admitted = match app::admit(&state, REPORT_PATH, &headers) {
        Ok(admitted) => admitted,
        Err(refusal) => return refusal.answer(),
    };
    if admitted.budget.is_zero() {
        return app::expired(&state, REPORT_PATH, admitted.budget);
    }
    let read = app::read_body(&headers, body, MAX_REPORT_BYTES);
    let report = match tokio::time::timeout_at(admitted.deadline, read).await {
        Ok(Ok(bytes)) => match wire::decode(&bytes) {
            Ok(report) => report,
            Err(refused) => return app::error(StatusCode::BAD_REQUEST, refused),
        },
        Ok(Err(answer)) => return answer,
        Err(_) => return app::expired(&state, REPORT_PATH, admitted.budget),
    };
    state.fleet().record_report(&report);
    let fleet: Vec<usize> = report
        .breakers
        .iter()
        .enumerate()
        .filter(|(_, breaker)| breaker.fleet)
        .map(|(at, _)| at)
        .collect();
    let mut answers: Vec<FleetAnswer> = report
        .breakers
        .iter()
        .map(diana_core::quota::fleet::echo)
        .collect();
    if fleet.is_empty() {
        return Json(ReportResponse { breakers: answers }).into_response();
    }
    let calls: Vec<BreakerCall> = fleet
        .iter()
        .filter_map(|&at| report.breakers.get(at).map(BreakerCall::of))
        .collect();
    let (sender, receiver) = tokio::sync::oneshot::channel();
    let store = state.store().clone();
    let task_state = state.clone();
    let permit = admitted.permit;
    tokio::spawn(async move {
        let decided = match store.breakers() {
            Some(breakers) => breakers.report(&calls).await,
            None => Err(StoreError::Unavailable(
                "this store keeps no fleet breakers".into(),
            )),
        };
        if let Err(Ok(late)) = sender.send(decided) {
            if let Some(breakers) = store.breakers() {
                give_back_late(breakers, &calls, &late).await;
            }
        }
        drop(permit);
        task_state.metrics().set_in_flight(task_state.in_flight());
    });
    let decided = match tokio::time::timeout_at(admitted.deadline, receiver).await {
        Ok(Ok(Ok(decided))) => decided,
        Ok(Ok(Err(failure))) => return app::store_failure(&state, &failure),
        Ok(Err(_)) => {
            return app::store_failure(
                &state,
                &StoreError::Internal("the report task ended without an answer".into()),
            )
        }
        Err(_) => {
            state.metrics().store_error("timeout");
            return app::expired(&state, REPORT_PATH, admitted.budget);
        }
    };
    if decided.len() != fleet.len() {
        return app::store_failure(
            &state,
            &StoreError::Internal(format!(
                "{} answers for {} fleet breakers",
                decided.len(),
                fleet.len()
            )),
        );
    }
    let mut answered = Vec::with_capacity(fleet.len());
    for (&at, decided) in fleet.iter().zip(&decided) {
        let (Some(reported), Some(answer)) = (report.breakers.get(at), answers.get_mut(at)) else {
            continue;
        };
        *answer = decided.answer;
        for transition in &decided.transitions {
            tracing::info!(
                breaker = %reported.name,
                key = %reported.key,
                gateway = %report.gateway,
                "fleet breaker {}: {transition}",
                reported.name
            );
        }
        answered.push((reported, decided));
    }
    state.fleet().record_fleet(answered);
    Json(ReportResponse { breakers: answers }).into_response()
}

/// Answers that came after the deadline: their gateway got a 503 and will not use the
/// places granted to it, which would otherwise sit out until their probes time out.
async fn give_back_late(breakers: &dyn FleetBreakers, calls: &[BreakerCall], late: &[Decided]) {
    let give_back: Vec<BreakerCall> = calls
        .iter()
        .zip(late)
        .filter(|(_, decided)| decided.answer.places > 0)
        .map(|(call, decided)| {
            BreakerCall::give_back(
                &call.key,
                call.params,
                decided.answer.round,
                decided.answer.places,
            )
        })
        .collect();
    if give_back.is_empty() {
        return;
    }
    if let Err(error) = breakers.report(&give_back).await {
        tracing::warn!(%error, "late fleet probe places could not be given back: they free when their probes time out");
    }
}

/// `GET /v1/view`: the fleet view as JSON (`fleet::view::Snapshot`).
pub async fn view(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(rejection) = state.view_access().check(state.auth(), &headers) {
        state.metrics().unauthorized(rejection.label());
        return app::unauthorized();
    }
    let snapshot = state.fleet().snapshot();
    let mut answer = Json(snapshot).into_response();
    // The view changes every report: never cached on the way.
    answer.headers_mut().insert(
        header::CACHE_CONTROL,
        axum::http::HeaderValue::from_static("no-store"),
    );
    answer
}
